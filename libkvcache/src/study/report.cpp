// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/report.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/file_io.h"
#include "kvcache/error.h"
#include "kvcache/study/metrics.h"
#include "kvcache/study/task.h"

namespace kvcache::study {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kEps = 1e-9;

std::string fmt(double v, const char* f = "%.3f") {
  if (!std::isfinite(v)) return "–";
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}
std::string pct(double frac) { return std::isfinite(frac) ? fmt(100.0 * frac, "%.1f") + "%" : "–"; }
std::string signed_fmt(double v, const char* f) {
  if (!std::isfinite(v)) return "–";
  return (v >= 0 ? "+" : "") + fmt(v, f);
}

struct Accum {
  int64_t order = std::numeric_limits<int64_t>::max();
  int64_t tasks = 0, passed = 0, errors = 0;
  int64_t measured = 0;  ///< task rows without error: memory/speed means are over these
  double peak_sum = 0, peak_max = 0, written_sum = 0, resident_sum = 0, reserved_sum = 0;
  double rss_sum = 0;
  int64_t rss_n = 0;
  double span_sum = 0;
  int64_t span_n = 0;
  double prompt_tokens = 0, prefill_s = 0, gen_tokens = 0, decode_s = 0;
  std::map<std::string, std::pair<int64_t, int64_t>> fam;  // passed, total
  std::map<int, std::pair<int64_t, int64_t>> depth;
  const ResultRow* text = nullptr;
};

double nz(double v) { return std::isfinite(v) ? v : 0.0; }

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

std::string csv_cell(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string csv_num(double v) {
  if (!std::isfinite(v)) return "";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

nlohmann::ordered_json jnum(double v) { return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(); }


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

  Summary s;
  s.model = model;
  s.control = control;
  std::map<std::string, Accum> acc;
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
    if (!r.error.empty()) {
      ++error_rows;
      if (error_examples.size() < 3) error_examples.push_back(r.arm + " " + r.task + ": " + r.error);
    }
    if (r.kind == "task") {
      Accum& a = acc[r.arm];
      a.order = std::min(a.order, r.order);
      const bool ok = r.passed && r.error.empty();
      a.tasks++;
      a.passed += ok;
      a.errors += !r.error.empty();
      auto& f = a.fam[r.family];
      f.first += ok;
      f.second++;
      families_seen.insert(r.family);
      if (r.depth_pct >= 0) {
        auto& d = a.depth[r.depth_pct];
        d.first += ok;
        d.second++;
        depths.insert(r.depth_pct);
      }
      if (!r.error.empty()) continue;
      a.measured++;
      const double peak = nz(r.value("peak_bytes"));
      a.peak_sum += peak;
      a.peak_max = std::max(a.peak_max, peak);
      a.written_sum += nz(r.value("tokens_written"));
      a.resident_sum += nz(r.value("tokens_resident"));
      a.reserved_sum += nz(r.value("peak_reserved_bytes"));
      if (std::isfinite(r.value("rss_growth_peak_bytes"))) {
        a.rss_sum += r.value("rss_growth_peak_bytes");
        a.rss_n++;
      }
      if (std::isfinite(r.value("span_resident"))) {
        a.span_sum += r.value("span_resident");
        a.span_n++;
      }
      a.prompt_tokens += nz(r.value("prompt_tokens"));
      a.prefill_s += nz(r.value("prefill_s"));
      a.gen_tokens += nz(r.value("generated_tokens"));
      a.decode_s += nz(r.value("decode_s"));
    } else if (r.kind == "text") {
      Accum& a = acc[r.arm];
      a.order = std::min(a.order, r.order);
      a.text = &r;
    } else if (r.kind == "recon") {
      recon_rows.push_back(&r);
    } else if (r.kind == "attn") {
      // task = "attn:<key>:b<bits>"
      const auto p1 = r.task.find(':');
      const auto p2 = r.task.rfind(":b");
      if (p1 == std::string::npos || p2 == std::string::npos || p2 <= p1) continue;
      const std::string k = r.task.substr(p1 + 1, p2 - p1 - 1);
      const int bits = std::atoi(r.task.c_str() + p2 + 2);
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

  std::vector<std::pair<int64_t, std::string>> arm_order;
  for (const auto& [arm, a] : acc) arm_order.emplace_back(a.order, arm);
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
    const double m = static_cast<double>(a.measured);
    x.peak_kib_mean = a.measured ? a.peak_sum / m / 1024.0 : kNaN;
    x.peak_kib_max = a.measured ? a.peak_max / 1024.0 : kNaN;
    x.reserved_kib_mean = a.measured ? a.reserved_sum / m / 1024.0 : kNaN;
    x.rss_growth_kib_mean = a.rss_n ? a.rss_sum / static_cast<double>(a.rss_n) / 1024.0 : kNaN;
    x.tokens_written_mean = a.measured ? a.written_sum / m : kNaN;
    x.tokens_resident_mean = a.measured ? a.resident_sum / m : kNaN;
    x.span_resident_mean = a.span_n ? a.span_sum / static_cast<double>(a.span_n) : kNaN;
    for (const auto& [f, pn] : a.fam) x.family_accuracy[f] = static_cast<double>(pn.first) / static_cast<double>(pn.second);
    for (const auto& [d, pn] : a.depth) {
      x.depth_accuracy[d] = static_cast<double>(pn.first) / static_cast<double>(pn.second);
      x.depth_tasks[d] = pn.second;
    }
    const bool text_ok = a.text != nullptr && a.text->error.empty();
    x.ppl_single = text_ok ? a.text->value("ppl_single") : kNaN;
    x.ppl_stream = text_ok ? a.text->value("ppl_stream") : kNaN;
    x.kld_mean = text_ok ? a.text->value("kld_mean") : kNaN;
    x.kld_max = text_ok ? a.text->value("kld_max") : kNaN;
    x.top1 = text_ok ? a.text->value("top1") : kNaN;
    x.prefill_tps = a.prefill_s > 0 ? a.prompt_tokens / a.prefill_s : kNaN;
    x.decode_tps = a.decode_s > 0 ? a.gen_tokens / a.decode_s : kNaN;
    x.total_seconds = a.prefill_s + a.decode_s;
    x.delta_pp = kNaN;
    x.memory_ratio = kNaN;
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
  } else {
    s.notes.push_back("no task rows for the control arm " + control + ": deltas and memory ratios are not computed");
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
    q.error = r->error;
    s.reconstruction.push_back(q);
  }
  std::vector<std::pair<int64_t, AttentionSummary>> at;
  for (auto& [k, v] : attn) at.push_back(v);
  std::sort(at.begin(), at.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [o, v] : at) s.attention.push_back(v);
  s.attention_bits.assign(attn_bits.begin(), attn_bits.end());
  if (std::isfinite(attn_group)) {
    s.notes.push_back("attention error: asymmetric min-max groups of " + fmt(attn_group, "%.0f") +
                      " values (methods b.1), causal attention over the captured queries");
  }
  s.recommendations = recommend(s);
  return s;
}

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
  if (c == nullptr) {
    for (const auto& r : {r1, r2, r3, r4, r5}) add(r, nullptr);
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
  return out;
}

std::string summary_markdown(const Summary& s) {
  std::ostringstream os;
  os << "# kv_study summary\n\nModel: `" << s.model << "`. Control arm: `" << s.control << "`.";
  if (!s.arms.empty()) os << " Arms: " << s.arms.size() << ".";
  os << "\n\n";

  os << "## Accuracy and KV memory per arm\n\n";
  os << "| arm | passed | accuracy | Δ vs control | peak KV KiB (mean/task) | × control | tokens written | tokens resident | errors |\n";
  os << "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& a : s.arms) {
    std::string delta = a.is_control ? "control"
                                     : (std::isfinite(a.delta_pp) ? signed_fmt(a.delta_pp, "%.1f") + " pp (" +
                                                                        signed_fmt(static_cast<double>(a.delta_tasks), "%.0f") + ")"
                                                                  : "–");
    os << "| " << a.arm << " | " << a.passed << "/" << a.tasks << " | " << pct(a.accuracy) << " | " << delta << " | "
       << fmt(a.peak_kib_mean, "%.1f") << " | " << fmt(a.memory_ratio, "%.2f") << " | " << fmt(a.tokens_written_mean, "%.1f")
       << " | " << fmt(a.tokens_resident_mean, "%.1f") << " | " << a.errors << " |\n";
  }

  os << "\n## KV memory: stored, reserved, real\n\n"
        "Mean over tasks of the peak stored bytes (bytes_resident_peak), the peak bytes of the blocks the cache "
        "held (bytes_reserved_peak), and the peak growth of the process's resident set during the task (the cache "
        "plus the request's other allocations).\n\n";
  os << "| arm | stored peak KiB | reserved peak KiB | RSS growth peak KiB | reserved / stored |\n";
  os << "|---|---:|---:|---:|---:|\n";
  for (const auto& a : s.arms) {
    os << "| " << a.arm << " | " << fmt(a.peak_kib_mean, "%.1f") << " | " << fmt(a.reserved_kib_mean, "%.1f") << " | "
       << fmt(a.rss_growth_kib_mean, "%.1f") << " | "
       << fmt(a.peak_kib_mean > 0 ? a.reserved_kib_mean / a.peak_kib_mean : kNaN, "%.2f") << " |\n";
  }

  os << "\n## Accuracy per family\n\n| arm |";
  for (const auto& f : s.families) os << " " << f << " |";
  os << "\n|---|";
  for (size_t i = 0; i < s.families.size(); ++i) os << "---:|";
  os << "\n";
  for (const auto& a : s.arms) {
    os << "| " << a.arm << " |";
    for (const auto& f : s.families) {
      auto it = a.family_accuracy.find(f);
      os << " " << (it == a.family_accuracy.end() ? "–" : pct(it->second)) << " |";
    }
    os << "\n";
  }

  if (!s.depths.empty()) {
    os << "\n## Needle accuracy by depth\n\n| arm |";
    for (int d : s.depths) os << " " << d << "% |";
    os << "\n|---|";
    for (size_t i = 0; i < s.depths.size(); ++i) os << "---:|";
    os << "\n";
    for (const auto& a : s.arms) {
      os << "| " << a.arm << " |";
      for (int d : s.depths) {
        auto it = a.depth_accuracy.find(d);
        os << " " << (it == a.depth_accuracy.end() ? "–" : pct(it->second)) << " |";
      }
      os << "\n";
    }
  }

  os << "\n## Perplexity and next-token agreement vs control\n\n";
  os << "| arm | accuracy | ppl (single pass) | ppl (streaming) | KLD vs control (mean) | KLD max | top-1 agreement |\n";
  os << "|---|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& a : s.arms) {
    os << "| " << a.arm << " | " << pct(a.accuracy) << " | " << fmt(a.ppl_single) << " | " << fmt(a.ppl_stream) << " | "
       << fmt(a.kld_mean, "%.5f") << " | " << fmt(a.kld_max, "%.4f") << " | " << pct(a.top1) << " |\n";
  }

  if (!s.reconstruction.empty()) {
    os << "\n## Quantizer reconstruction error (K/V captured from the model)\n\n";
    os << "| quantizer | bits/value | key rel. error | value rel. error |\n|---|---:|---:|---:|\n";
    for (const auto& q : s.reconstruction) {
      if (!q.error.empty()) {
        os << "| " << q.quant << " | – | – | – (" << q.error << ") |\n";
      } else {
        os << "| " << q.quant << " | " << fmt(q.bits_per_value, "%.2f") << " | " << fmt(q.key_rel_err, "%.4f") << " | "
           << fmt(q.value_rel_err, "%.4f") << " |\n";
      }
    }
  }

  if (!s.attention.empty()) {
    os << "\n## Attention error by K/V quantization granularity (relative Frobenius error)\n\n| scheme |";
    for (int b : s.attention_bits) os << " " << b << "-bit output | " << b << "-bit probs |";
    os << "\n|---|";
    for (size_t i = 0; i < s.attention_bits.size(); ++i) os << "---:|---:|";
    os << "\n";
    for (const auto& a : s.attention) {
      os << "| " << a.description << " |";
      for (int b : s.attention_bits) {
        auto o = a.out_rel_err.find(b);
        auto p = a.prob_rel_err.find(b);
        os << " " << (o == a.out_rel_err.end() ? "–" : fmt(o->second, "%.4f")) << " | "
           << (p == a.prob_rel_err.end() ? "–" : fmt(p->second, "%.4f")) << " |";
      }
      os << "\n";
    }
  }

  os << "\n## Speed\n\n| arm | prefill tok/s | decode tok/s | time (s) |\n|---|---:|---:|---:|\n";
  for (const auto& a : s.arms) {
    os << "| " << a.arm << " | " << fmt(a.prefill_tps, "%.1f") << " | " << fmt(a.decode_tps, "%.1f") << " | "
       << fmt(a.total_seconds, "%.1f") << " |\n";
  }

  os << "\n## Recommendations\n\nGenerated from the rows above by fixed rules (docs/study.md); never edited by hand.\n\n";
  os << "| rule | arm | evidence |\n|---|---|---|\n";
  for (const auto& r : s.recommendations) {
    os << "| " << r.rule << " | " << (r.arm.empty() ? "–" : "`" + r.arm + "`") << " | " << r.evidence << " |\n";
  }
  if (!s.notes.empty()) {
    os << "\n## Notes\n\n";
    for (const auto& n : s.notes) os << "- " << n << "\n";
  }
  return os.str();
}

std::string summary_json(const Summary& s) {
  using oj = nlohmann::ordered_json;
  oj j;
  j["model"] = s.model;
  j["control"] = s.control;
  j["has_control"] = s.has_control;
  j["families"] = s.families;
  j["depths"] = s.depths;
  oj arms = oj::array();
  for (const auto& a : s.arms) {
    oj x;
    x["arm"] = a.arm;
    x["is_control"] = a.is_control;
    x["tasks"] = a.tasks;
    x["passed"] = a.passed;
    x["errors"] = a.errors;
    x["accuracy"] = jnum(a.accuracy);
    x["delta_pp"] = jnum(a.delta_pp);
    x["delta_tasks"] = s.has_control ? oj(a.delta_tasks) : oj();
    x["peak_kib_mean"] = jnum(a.peak_kib_mean);
    x["peak_kib_max"] = jnum(a.peak_kib_max);
    x["memory_ratio"] = jnum(a.memory_ratio);
    x["reserved_kib_mean"] = jnum(a.reserved_kib_mean);
    x["rss_growth_kib_mean"] = jnum(a.rss_growth_kib_mean);
    x["tokens_written_mean"] = jnum(a.tokens_written_mean);
    x["tokens_resident_mean"] = jnum(a.tokens_resident_mean);
    x["span_resident_mean"] = jnum(a.span_resident_mean);
    oj fam = oj::object();
    for (const auto& [f, v] : a.family_accuracy) fam[f] = v;
    x["family_accuracy"] = fam;
    oj dep = oj::object();
    for (const auto& [d, v] : a.depth_accuracy) dep[std::to_string(d)] = v;
    x["depth_accuracy"] = dep;
    x["ppl_single"] = jnum(a.ppl_single);
    x["ppl_stream"] = jnum(a.ppl_stream);
    x["kld_mean"] = jnum(a.kld_mean);
    x["kld_max"] = jnum(a.kld_max);
    x["top1"] = jnum(a.top1);
    x["prefill_tps"] = jnum(a.prefill_tps);
    x["decode_tps"] = jnum(a.decode_tps);
    x["total_seconds"] = jnum(a.total_seconds);
    arms.push_back(x);
  }
  j["arms"] = arms;
  oj rec = oj::array();
  for (const auto& q : s.reconstruction) {
    rec.push_back(oj{{"quant", q.quant}, {"bits_per_value", jnum(q.bits_per_value)}, {"key_rel_err", jnum(q.key_rel_err)},
                     {"value_rel_err", jnum(q.value_rel_err)}, {"error", q.error}});
  }
  j["reconstruction"] = rec;
  oj att = oj::array();
  for (const auto& a : s.attention) {
    oj bits = oj::object();
    for (const auto& [b, v] : a.out_rel_err) {
      auto p = a.prob_rel_err.find(b);
      bits[std::to_string(b)] = oj{{"out_rel_err", jnum(v)}, {"prob_rel_err", jnum(p == a.prob_rel_err.end() ? kNaN : p->second)}};
    }
    att.push_back(oj{{"scheme", a.scheme}, {"description", a.description}, {"bits", bits}});
  }
  j["attention"] = att;
  oj recs = oj::array();
  for (const auto& r : s.recommendations) {
    recs.push_back(oj{{"rule", r.rule}, {"arm", r.arm.empty() ? oj() : oj(r.arm)}, {"evidence", r.evidence}});
  }
  j["recommendations"] = recs;
  j["notes"] = s.notes;
  return j.dump(2) + "\n";
}

std::string summary_csv(const Summary& s) {
  std::ostringstream os;
  os << "arm,is_control,tasks,passed,errors,accuracy,delta_pp,delta_tasks,peak_kib_mean,peak_kib_max,memory_ratio,"
        "reserved_kib_mean,rss_growth_kib_mean,tokens_written_mean,tokens_resident_mean,span_resident_mean,ppl_single,ppl_stream,kld_mean,kld_max,top1,"
        "prefill_tps,decode_tps,total_seconds";
  for (const auto& f : s.families) os << ",acc_" << f;
  for (int d : s.depths) os << ",needle_d" << d;
  os << "\n";
  for (const auto& a : s.arms) {
    os << csv_cell(a.arm) << "," << (a.is_control ? 1 : 0) << "," << a.tasks << "," << a.passed << "," << a.errors << ","
       << csv_num(a.accuracy) << "," << csv_num(a.delta_pp) << "," << (s.has_control ? std::to_string(a.delta_tasks) : "")
       << "," << csv_num(a.peak_kib_mean) << "," << csv_num(a.peak_kib_max) << "," << csv_num(a.memory_ratio) << ","
       << csv_num(a.reserved_kib_mean) << "," << csv_num(a.rss_growth_kib_mean) << "," << csv_num(a.tokens_written_mean) << "," << csv_num(a.tokens_resident_mean) << "," << csv_num(a.span_resident_mean)
       << "," << csv_num(a.ppl_single) << "," << csv_num(a.ppl_stream) << "," << csv_num(a.kld_mean) << ","
       << csv_num(a.kld_max) << "," << csv_num(a.top1) << "," << csv_num(a.prefill_tps) << "," << csv_num(a.decode_tps)
       << "," << csv_num(a.total_seconds);
    for (const auto& f : s.families) {
      auto it = a.family_accuracy.find(f);
      os << "," << (it == a.family_accuracy.end() ? "" : csv_num(it->second));
    }
    for (int d : s.depths) {
      auto it = a.depth_accuracy.find(d);
      os << "," << (it == a.depth_accuracy.end() ? "" : csv_num(it->second));
    }
    os << "\n";
  }
  return os.str();
}

void write_summary_files(const Summary& s, const std::string& dir) {
  ::mkdir(dir.c_str(), 0755);  // may exist
  struct stat st {};
  KV_CHECK_ARG(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "output directory '", dir, "' cannot be created");
  io::write_file_atomic(dir + "/summary.md", summary_markdown(s));
  io::write_file_atomic(dir + "/summary.json", summary_json(s));
  io::write_file_atomic(dir + "/summary.csv", summary_csv(s));
}

}  // namespace kvcache::study
