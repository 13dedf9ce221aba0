// SPDX-License-Identifier: Apache-2.0
// summarize(): result rows -> per-arm summaries. Every aggregated column is computed from the
// column table (report_columns.cpp); counts, accuracy and the control deltas here.
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "kvcache/error.h"
#include "kvcache/study/metrics.h"
#include "kvcache/study/report.h"
#include "kvcache/study/report_columns.h"
#include "kvcache/study/task.h"
#include "study/report_format.h"

namespace kvcache::study {
namespace {

using report_format::kNaN;

double nz(double v) { return std::isfinite(v) ? v : 0.0; }

/// Running sums of one aggregated column over an arm's measured rows.
struct ColumnAccum {
  double sum = 0, sum2 = 0, max = 0;
  int64_t present = 0;
};

struct Accum {
  int64_t order = std::numeric_limits<int64_t>::max();
  int64_t tasks = 0, passed = 0, errors = 0;
  int64_t measured = 0;  ///< task rows without error: the aggregated columns are over these
  std::vector<ColumnAccum> cols = std::vector<ColumnAccum>(arm_columns().size());
  std::map<std::string, std::pair<int64_t, int64_t>> fam;  // passed, total
  std::map<int, std::pair<int64_t, int64_t>> depth;
  const ResultRow* text = nullptr;

  void add_measured(const ResultRow& r) {
    const auto& table = arm_columns();
    for (size_t i = 0; i < table.size(); ++i) {
      const ArmColumn& c = table[i];
      ColumnAccum& x = cols[i];
      switch (c.aggregation) {
        case Aggregation::kMeanMeasured:
          x.sum += nz(r.value(c.source));
          break;
        case Aggregation::kMaxMeasured:
          x.max = std::max(x.max, nz(r.value(c.source)));
          break;
        case Aggregation::kMeanPresent:
          if (std::isfinite(r.value(c.source))) {
            x.sum += r.value(c.source);
            x.present++;
          }
          break;
        case Aggregation::kSumMeasured:
        case Aggregation::kRatioOfSums:
          x.sum += nz(r.value(c.source));
          x.sum2 += nz(r.value(c.source2));
          break;
        default:
          break;
      }
    }
  }

  /// Stores every aggregated column into `out` (its field, else out.extra).
  void finish(ArmSummary& out) const {
    const auto& table = arm_columns();
    const bool text_ok = text != nullptr && text->error.empty();
    const double m = static_cast<double>(measured);
    for (size_t i = 0; i < table.size(); ++i) {
      const ArmColumn& c = table[i];
      const ColumnAccum& x = cols[i];
      double v = kNaN;
      switch (c.aggregation) {
        case Aggregation::kMeanMeasured:
          v = measured ? x.sum / m / c.divisor : kNaN;
          break;
        case Aggregation::kMaxMeasured:
          v = measured ? x.max / c.divisor : kNaN;
          break;
        case Aggregation::kMeanPresent:
          v = x.present ? x.sum / static_cast<double>(x.present) / c.divisor : kNaN;
          break;
        case Aggregation::kSumMeasured:
          v = x.sum + x.sum2;
          break;
        case Aggregation::kRatioOfSums:
          v = x.sum2 > 0 ? x.sum / x.sum2 : kNaN;
          break;
        case Aggregation::kTextValue:
          v = text_ok ? text->value(c.source) : kNaN;
          break;
        default:
          continue;
      }
      if (c.real_field != nullptr) {
        out.*c.real_field = v;
      } else {
        out.extra[c.key] = v;
      }
    }
  }
};

}  // namespace

std::vector<std::string> models_in(const std::vector<ResultRow>& rows) {
  std::vector<std::string> out;
  for (const auto& r : rows) {
    if (std::find(out.begin(), out.end(), r.model) == out.end()) out.push_back(r.model);
  }
  return out;
}

Summary summarize(const std::vector<ResultRow>& rows, const std::string& model_in, const std::string& control) {
  const auto models = models_in(rows);
  std::string model = model_in;
  if (model.empty()) {
    KV_CHECK_ARG(!models.empty(), "no result rows to summarize");
    if (models.size() > 1) {
      std::string list;
      for (const auto& m : models) list += (list.empty() ? "" : ", ") + m;
      throw InvalidArgument("the results hold several models (" + list + "): choose one with --model-id");
    }
    model = models[0];
  }
  KV_CHECK_ARG(std::find(models.begin(), models.end(), model) != models.end(), "no result rows for model '",
               model, "'");

  // Query-agnostic task rows are summarized apart (with the model's text rows, which are
  // mode-free); the rest of this function sees only query-aware task rows.
  std::vector<ResultRow> agnostic_rows;
  std::set<std::string> agnostic_arms;
  for (const auto& r : rows) {
    if (r.model == model && r.kind == "task" && !r.query_mode.empty()) agnostic_arms.insert(r.arm);
  }
  const bool has_agnostic = !agnostic_arms.empty();
  for (const auto& r : rows) {
    if (r.model != model || !agnostic_arms.count(r.arm)) continue;
    if (r.kind == "task" && !r.query_mode.empty()) {
      agnostic_rows.push_back(r);
      agnostic_rows.back().query_mode.clear();
    } else if (r.kind == "text") {
      agnostic_rows.push_back(r);
    }
  }

  Summary s;
  s.model = model;
  s.control = control;
  std::map<std::string, Accum> acc;
  std::map<std::string, std::map<int64_t, Accum>> acc_len;  // arm -> length -> its rows
  std::set<int64_t> lengths;
  std::set<std::string> families_seen;
  std::set<int> depths;
  std::vector<const ResultRow*> recon_rows;
  std::map<std::string, std::pair<int64_t, AttentionSummary>> attn;  // key -> (order, summary)
  std::set<int> attn_bits;
  std::vector<std::string> error_examples;
  int64_t error_rows = 0;
  double attn_group = kNaN;
  for (const auto& r : rows) {
    if (r.model != model) continue;
    if (r.kind == "task" && !r.query_mode.empty()) {
      families_seen.insert(r.family);  // the families and depths of either mode
      if (r.depth_pct >= 0) depths.insert(r.depth_pct);
      continue;
    }
    if (!r.error.empty()) {
      ++error_rows;
      if (error_examples.size() < 3) error_examples.push_back(r.arm + " " + r.task + ": " + r.error);
    }
    if (r.kind == "task") {
      const bool ok = r.passed && r.error.empty();
      lengths.insert(r.context_target);
      for (Accum* ap : {&acc[r.arm], &acc_len[r.arm][r.context_target]}) {
        Accum& a = *ap;
        a.order = std::min(a.order, r.order);
        a.tasks++;
        a.passed += ok;
        a.errors += !r.error.empty();
        auto& f = a.fam[r.family];
        f.first += ok;
        f.second++;
        if (r.depth_pct >= 0) {
          auto& d = a.depth[r.depth_pct];
          d.first += ok;
          d.second++;
        }
        if (r.error.empty()) {
          a.measured++;
          a.add_measured(r);
        }
      }
      families_seen.insert(r.family);
      if (r.depth_pct >= 0) depths.insert(r.depth_pct);
    } else if (r.kind == "text") {
      Accum& a = acc[r.arm];
      a.order = std::min(a.order, r.order);
      a.text = &r;
    } else if (r.kind == "recon") {
      recon_rows.push_back(&r);
    } else if (r.kind == "attn") {
      const std::string& k = r.granularity;
      const double bits_value = r.value("bits");
      if (k.empty() || !std::isfinite(bits_value)) continue;
      const int bits = static_cast<int>(bits_value);
      auto it = attn.find(k);
      if (it == attn.end()) {
        AttentionSummary a;
        a.scheme = k;
        try {
          a.description = describe(parse_granularity(k));
        } catch (const InvalidArgument&) {
          a.description = k;
        }
        it = attn.emplace(k, std::make_pair(r.order, a)).first;
      }
      it->second.first = std::min(it->second.first, r.order);
      it->second.second.out_rel_err[bits] = r.error.empty() ? r.value("out_rel_err") : kNaN;
      it->second.second.prob_rel_err[bits] = r.error.empty() ? r.value("prob_rel_err") : kNaN;
      attn_bits.insert(bits);
      if (std::isfinite(r.value("group"))) attn_group = r.value("group");
    }
  }

  for (auto f : all_families()) {
    if (families_seen.count(to_string(f))) s.families.push_back(to_string(f));
  }
  for (const auto& f : families_seen) {
    if (std::find(s.families.begin(), s.families.end(), f) == s.families.end()) s.families.push_back(f);
  }
  s.depths.assign(depths.begin(), depths.end());
  s.lengths.assign(lengths.begin(), lengths.end());

  std::vector<std::pair<int64_t, std::string>> arm_order;
  for (const auto& [arm, a] : acc) {
    // With agnostic rows, an arm with a text row but no aware task row is an agnostic-only arm:
    // it is listed in the agnostic summary only.
    if (a.tasks > 0 || !has_agnostic) arm_order.emplace_back(a.order, arm);
  }
  std::sort(arm_order.begin(), arm_order.end());
  for (const auto& [order, arm] : arm_order) {
    const Accum& a = acc.at(arm);
    ArmSummary x;
    x.arm = arm;
    x.is_control = arm == control;
    x.tasks = a.tasks;
    x.passed = a.passed;
    x.errors = a.errors;
    const double n = static_cast<double>(a.tasks);
    x.accuracy = a.tasks ? static_cast<double>(a.passed) / n : kNaN;
    a.finish(x);
    for (const auto& [f, pn] : a.fam) x.family_accuracy[f] = static_cast<double>(pn.first) / static_cast<double>(pn.second);
    for (const auto& [d, pn] : a.depth) {
      x.depth_accuracy[d] = static_cast<double>(pn.first) / static_cast<double>(pn.second);
      x.depth_tasks[d] = pn.second;
    }
    x.delta_pp = kNaN;
    x.memory_ratio = kNaN;
    const auto bl = acc_len.find(arm);
    if (bl != acc_len.end()) {
      for (const auto& [len, la] : bl->second) {
        ArmSummary y;
        la.finish(y);
        LengthSummary l;
        l.tasks = la.tasks;
        l.passed = la.passed;
        l.accuracy = la.tasks ? static_cast<double>(la.passed) / static_cast<double>(la.tasks) : kNaN;
        l.peak_kib_mean = y.peak_kib_mean;
        l.reserved_kib_mean = y.reserved_kib_mean;
        l.rss_growth_kib_mean = y.rss_growth_kib_mean;
        l.prefill_tps = y.prefill_tps;
        l.decode_ms_per_token = y.decode_tps > 0 ? 1000.0 / y.decode_tps : kNaN;
        l.memory_ratio = kNaN;
        for (const auto& [f, pn] : la.fam) l.family_accuracy[f] = static_cast<double>(pn.first) / static_cast<double>(pn.second);
        for (const auto& [d, pn] : la.depth) l.depth_accuracy[d] = static_cast<double>(pn.first) / static_cast<double>(pn.second);
        x.by_length[len] = l;
      }
    }
    s.arms.push_back(x);
  }
  const ArmSummary* ctrl = nullptr;
  for (const auto& a : s.arms) {
    if (a.is_control && a.tasks > 0) ctrl = &a;
  }
  s.has_control = ctrl != nullptr;
  if (ctrl != nullptr) {
    const ArmSummary c = *ctrl;
    for (auto& a : s.arms) {
      a.delta_pp = (a.accuracy - c.accuracy) * 100.0;
      a.delta_tasks = a.passed - c.passed;
      a.memory_ratio = c.peak_kib_mean > 0 ? a.peak_kib_mean / c.peak_kib_mean : kNaN;
      if (a.tasks != c.tasks && a.tasks > 0) {
        s.notes.push_back("arm " + a.arm + " has " + std::to_string(a.tasks) + " task rows, the control " +
                          std::to_string(c.tasks) + " (partial run or unmerged shard): not compared task-for-task");
      }
    }
  } else if (!s.arms.empty() || !has_agnostic) {
    s.notes.push_back("no task rows for the control arm " + control + ": deltas and memory ratios are not computed");
  }
  // Per length: memory against the control's at that length, and the accuracy-vs-memory front.
  for (int64_t len : s.lengths) {
    const LengthSummary* c = nullptr;
    if (ctrl != nullptr) {
      const auto it = ctrl->by_length.find(len);
      if (it != ctrl->by_length.end()) c = &it->second;
    }
    const double c_peak = c != nullptr ? c->peak_kib_mean : kNaN;
    for (auto& a : s.arms) {
      auto it = a.by_length.find(len);
      if (it == a.by_length.end()) continue;
      it->second.memory_ratio = c_peak > 0 ? it->second.peak_kib_mean / c_peak : kNaN;
    }
    for (auto& a : s.arms) {
      auto it = a.by_length.find(len);
      if (it == a.by_length.end() || !std::isfinite(it->second.peak_kib_mean)) continue;
      LengthSummary& me = it->second;
      bool dominated = false;
      for (const auto& b : s.arms) {
        const auto jt = b.by_length.find(len);
        if (&b == &a || jt == b.by_length.end() || !std::isfinite(jt->second.peak_kib_mean)) continue;
        const LengthSummary& o = jt->second;
        if ((o.accuracy >= me.accuracy && o.peak_kib_mean < me.peak_kib_mean) ||
            (o.accuracy > me.accuracy && o.peak_kib_mean <= me.peak_kib_mean)) {
          dominated = true;
          break;
        }
      }
      me.pareto = !dominated;
    }
  }
  if (error_rows > 0) {
    std::string ex;
    for (const auto& e : error_examples) ex += "\n  - " + e;
    s.notes.push_back(std::to_string(error_rows) + " rows carry an error (task rows count as failures), e.g.:" + ex);
  }

  std::sort(recon_rows.begin(), recon_rows.end(), [](const ResultRow* a, const ResultRow* b) { return a->order < b->order; });
  for (const ResultRow* r : recon_rows) {
    ReconstructionSummary q;
    q.quant = r->arm;
    q.bits_per_value = r->value("bits_per_value");
    q.key_rel_err = r->value("key_rel_err");
    q.value_rel_err = r->value("value_rel_err");
    q.attn_out_rel_err = r->value("attn_out_rel_err");
    q.attn_prob_rel_err = r->value("attn_prob_rel_err");
    q.error = r->error;
    s.reconstruction.push_back(q);
  }
  std::vector<std::pair<int64_t, AttentionSummary>> at;
  for (auto& [k, v] : attn) at.push_back(v);
  std::sort(at.begin(), at.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [o, v] : at) s.attention.push_back(v);
  s.attention_bits.assign(attn_bits.begin(), attn_bits.end());
  if (std::isfinite(attn_group)) {
    s.notes.push_back("attention error: asymmetric min-max groups of " + report_format::fmt(attn_group, "%.0f") +
                      " values (methods b.1), causal attention over the captured queries");
  }
  s.curves = budget_curves(s);
  s.recommendations = recommend(s);
  if (has_agnostic) {
    auto g = std::make_shared<Summary>(summarize(agnostic_rows, model, control));
    for (auto& a : g->arms) a.query_mode = "agnostic";
    g->recommendations.clear();  // the rules read the query-aware rows only
    s.agnostic = g;
  }
  return s;
}

}  // namespace kvcache::study
