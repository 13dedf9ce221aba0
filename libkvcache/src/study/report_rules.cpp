// SPDX-License-Identifier: Apache-2.0
// recommend(): the recommendation rules of docs/study.md, applied to the per-arm summaries.
#include <cmath>
#include <sstream>

#include "kvcache/study/report.h"
#include "study/report_format.h"

namespace kvcache::study {
namespace {

using report_format::fmt;
using report_format::pct;
using report_format::signed_fmt;

constexpr double kEps = 1e-9;

bool within_one_task(const ArmSummary& a, const ArmSummary& control) {
  return a.tasks == control.tasks && a.passed >= control.passed - 1;
}

std::string evidence(const ArmSummary& a, const Summary& s) {
  std::ostringstream os;
  os << "passed " << a.passed << "/" << a.tasks << " (" << pct(a.accuracy);
  if (s.has_control && !a.is_control) {
    os << ", " << signed_fmt(static_cast<double>(a.delta_tasks), "%.0f") << " tasks vs control";
  }
  os << "), peak KV " << fmt(a.peak_kib_mean, "%.1f") << " KiB (" << fmt(a.memory_ratio, "%.2f") << "x control)";
  return os.str();
}

/// The first arm (in plan order) that minimises `cost` among those passing `eligible`.
template <typename Eligible, typename Cost>
const ArmSummary* pick(const Summary& s, Eligible eligible, Cost cost) {
  const ArmSummary* best = nullptr;
  for (const auto& a : s.arms) {
    if (!eligible(a)) continue;
    const double c = cost(a);
    if (!std::isfinite(c)) continue;
    if (best == nullptr || c < cost(*best) - kEps) best = &a;
  }
  return best;
}

/// Accuracy first (higher), then memory (lower): a single sortable cost.
double accuracy_then_memory(const ArmSummary& a) { return -a.accuracy * 1e6 + a.memory_ratio; }

}  // namespace

std::vector<Recommendation> recommend(const Summary& s) {
  std::vector<Recommendation> out;
  const ArmSummary* c = nullptr;
  for (const auto& a : s.arms) {
    if (a.is_control && a.tasks > 0) c = &a;
  }
  auto add = [&](const std::string& rule, const ArmSummary* a, const std::string& extra = "") {
    Recommendation r;
    r.rule = rule;
    if (c == nullptr) {
      r.evidence = "no control rows";
    } else if (a == nullptr) {
      r.evidence = "no arm qualifies";
    } else {
      r.arm = a->arm;
      r.evidence = evidence(*a, s) + extra;
    }
    out.push_back(r);
  };
  const std::string r1 = "Cheapest arm within one task of the control (lowest mean peak KV among arms that "
                         "passed at least control - 1 of the same tasks)";
  const std::string r2 = "Best accuracy at <= 50% of the control's KV memory (ties: less memory)";
  const std::string r3 = "Best accuracy at <= 25% of the control's KV memory (ties: less memory)";
  const std::string r4 = "Lowest streaming perplexity at <= 50% of the control's KV memory";
  const std::string r5 = "Fastest decode (tokens/s) within one task of the control";
  // Rule 6, per budget curve (the ratio sweep): its smallest budget within one task.
  auto add_curves = [&] {
    for (const auto& curve : s.curves) {
      const std::string rule = "Smallest budget of " + curve.method + " within one task of the control";
      const int i = curve.smallest_within_one_task;
      const ArmSummary* a = nullptr;
      for (const auto& x : s.arms) {
        if (i >= 0 && x.arm == curve.arms[static_cast<size_t>(i)]) a = &x;
      }
      std::string extra;
      if (a != nullptr) {
        extra = ", budget " + curve.budgets[static_cast<size_t>(i)].substr(1) + " (swept: ";
        for (size_t k = 0; k < curve.budgets.size(); ++k) {
          extra += (k ? ", " : "") + curve.budgets[k].substr(1) + " " + pct(curve.accuracy[k]);
        }
        extra += ")";
      }
      add(rule, a, extra);
    }
  };
  if (c == nullptr) {
    for (const auto& r : {r1, r2, r3, r4, r5}) add(r, nullptr);
    add_curves();
    return out;
  }
  const ArmSummary ctrl = *c;
  auto tasks_ok = [&](const ArmSummary& a) { return a.tasks > 0 && std::isfinite(a.memory_ratio); };
  add(r1, pick(s, [&](const ArmSummary& a) { return tasks_ok(a) && within_one_task(a, ctrl); },
               [](const ArmSummary& a) { return a.memory_ratio * 1e6 - a.accuracy; }));
  add(r2, pick(s, [&](const ArmSummary& a) { return tasks_ok(a) && a.memory_ratio <= 0.5 + kEps; }, accuracy_then_memory));
  add(r3, pick(s, [&](const ArmSummary& a) { return tasks_ok(a) && a.memory_ratio <= 0.25 + kEps; }, accuracy_then_memory));
  const ArmSummary* p4 = pick(s, [&](const ArmSummary& a) { return tasks_ok(a) && a.memory_ratio <= 0.5 + kEps; },
                              [](const ArmSummary& a) { return a.ppl_stream; });
  add(r4, p4, p4 ? ", streaming perplexity " + fmt(p4->ppl_stream) : "");
  const ArmSummary* p5 = pick(s, [&](const ArmSummary& a) { return tasks_ok(a) && within_one_task(a, ctrl); },
                              [](const ArmSummary& a) { return -a.decode_tps; });
  add(r5, p5, p5 ? ", decode " + fmt(p5->decode_tps, "%.1f") + " tok/s" : "");
  add_curves();
  return out;
}

}  // namespace kvcache::study
