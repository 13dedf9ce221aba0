// SPDX-License-Identifier: Apache-2.0
// The per-arm column table (report_columns.h): what summarize() aggregates and what the three
// writers print. A new per-arm metric is one line in arm_columns().
#include "kvcache/study/report_columns.h"

#include <cmath>

#include "kvcache/error.h"
#include "study/report_format.h"

namespace kvcache::study {
namespace {

using A = Aggregation;
using F = Format;
using report_format::kNaN;

// Compact constructors of table lines.
ArmColumn derived(const char* key, const char* unit, const char* desc, F f, int dec, const char* hdr,
                  double ArmSummary::*real, int64_t ArmSummary::*count = nullptr) {
  return ArmColumn{key, unit, desc, A::kDerived, "", "", 1.0, f, dec, hdr, true, real, count, nullptr};
}
ArmColumn agg(const char* key, const char* unit, const char* desc, A a, const char* src, const char* src2, double div,
              F f, int dec, const char* hdr, double ArmSummary::*real) {
  return ArmColumn{key, unit, desc, a, src, src2, div, f, dec, hdr, true, real, nullptr, nullptr};
}
ArmColumn with_cell(ArmColumn c, std::string (*cell)(const ArmSummary&, const Summary&)) {
  c.md_cell = cell;
  return c;
}

std::string passed_of_tasks(const ArmSummary& a, const Summary&) {
  return std::to_string(a.passed) + "/" + std::to_string(a.tasks);
}
std::string delta_vs_control(const ArmSummary& a, const Summary&) {
  using report_format::signed_fmt;
  if (a.is_control) return "control";
  if (!std::isfinite(a.delta_pp)) return "–";
  return signed_fmt(a.delta_pp, "%.1f") + " pp (" + signed_fmt(static_cast<double>(a.delta_tasks), "%.0f") + ")";
}
std::string reserved_per_stored(const ArmSummary& a, const Summary&) {
  return report_format::fmt(a.peak_kib_mean > 0 ? a.reserved_kib_mean / a.peak_kib_mean : kNaN, "%.2f");
}

}  // namespace

const std::vector<ArmColumn>& arm_columns() {
  using S = ArmSummary;
  static const std::vector<ArmColumn> table = [] {
    std::vector<ArmColumn> t = {
        ArmColumn{"arm", "", "canonical arm spec, scheme+policy", A::kDerived, "", "", 1.0, F::kText, 0, "arm", true,
                  nullptr, nullptr, nullptr},
        ArmColumn{"is_control", "", "the control arm (the deltas' reference)", A::kDerived, "", "", 1.0, F::kBool, 0,
                  "control", true, nullptr, nullptr, nullptr},
        derived("tasks", "count", "task rows of the arm", F::kInt, 0, "tasks", nullptr, &S::tasks),
        with_cell(derived("passed", "count", "task rows passed without error", F::kInt, 0, "passed", nullptr, &S::passed),
                  passed_of_tasks),
        derived("errors", "count", "task rows carrying an error (counted as failed)", F::kInt, 0, "errors", nullptr,
                &S::errors),
        derived("accuracy", "fraction", "passed / tasks", F::kPercent, 1, "accuracy", &S::accuracy),
        with_cell(derived("delta_pp", "pp", "(accuracy - control accuracy) x 100", F::kFixed, 1, "Δ vs control",
                          &S::delta_pp),
                  delta_vs_control),
        derived("delta_tasks", "count", "passed - control passed (empty without control rows)", F::kInt, 0, "Δ tasks",
                nullptr, &S::delta_tasks),
        agg("peak_kib_mean", "KiB", "mean peak stored KV bytes per task (bytes_resident_peak)", A::kMeanMeasured,
            "peak_bytes", "", 1024.0, F::kFixed, 1, "peak KV KiB (mean/task)", &S::peak_kib_mean),
        agg("peak_kib_max", "KiB", "largest peak stored KV bytes of a task", A::kMaxMeasured, "peak_bytes", "", 1024.0,
            F::kFixed, 1, "peak KV KiB (max)", &S::peak_kib_max),
        derived("memory_ratio", "ratio", "peak_kib_mean / the control's", F::kFixed, 2, "× control", &S::memory_ratio),
        agg("reserved_kib_mean", "KiB", "mean peak bytes of the blocks the cache held (bytes_reserved_peak)",
            A::kMeanMeasured, "peak_reserved_bytes", "", 1024.0, F::kFixed, 1, "reserved peak KiB",
            &S::reserved_kib_mean),
        agg("rss_growth_kib_mean", "KiB", "mean peak growth of the process's resident set, over the rows measuring it",
            A::kMeanPresent, "rss_growth_peak_bytes", "", 1024.0, F::kFixed, 1, "RSS growth peak KiB",
            &S::rss_growth_kib_mean),
        agg("tokens_written_mean", "tokens", "mean tokens appended per task", A::kMeanMeasured, "tokens_written", "",
            1.0, F::kFixed, 1, "tokens written", &S::tokens_written_mean),
        agg("tokens_resident_mean", "tokens", "mean tokens stored at the end of a task", A::kMeanMeasured,
            "tokens_resident", "", 1.0, F::kFixed, 1, "tokens resident", &S::tokens_resident_mean),
        agg("span_resident_mean", "fraction", "mean fraction of the load-bearing span still resident after prefill",
            A::kMeanPresent, "span_resident", "", 1.0, F::kPercent, 1, "span resident", &S::span_resident_mean),
        agg("ppl_single", "ratio", "perplexity, one pass through a fresh cache", A::kTextValue, "ppl_single", "", 1.0,
            F::kFixed, 3, "ppl (single pass)", &S::ppl_single),
        agg("ppl_stream", "ratio", "perplexity, streamed through the managed cache", A::kTextValue, "ppl_stream", "",
            1.0, F::kFixed, 3, "ppl (streaming)", &S::ppl_stream),
        agg("kld_mean", "nats", "mean KL(P_control || P_arm) over the streamed positions", A::kTextValue, "kld_mean", "",
            1.0, F::kFixed, 5, "KLD vs control (mean)", &S::kld_mean),
        agg("kld_max", "nats", "max KL(P_control || P_arm) over the streamed positions", A::kTextValue, "kld_max", "",
            1.0, F::kFixed, 4, "KLD max", &S::kld_max),
        agg("kld_median", "nats", "median KL(P_control || P_arm) over the streamed positions", A::kTextValue,
            "kld_median", "", 1.0, F::kFixed, 5, "KLD median", nullptr),
        agg("kld_p99", "nats", "99th percentile of KL(P_control || P_arm) over the streamed positions", A::kTextValue,
            "kld_p99", "", 1.0, F::kFixed, 4, "KLD p99", nullptr),
        agg("kld_p999", "nats", "99.9th percentile of KL(P_control || P_arm) over the streamed positions",
            A::kTextValue, "kld_p999", "", 1.0, F::kFixed, 4, "KLD p99.9", nullptr),
        agg("top1", "fraction", "positions whose argmax agrees with the control's", A::kTextValue, "top1", "", 1.0,
            F::kPercent, 1, "top-1 agreement", &S::top1),
        agg("prefill_tps", "tokens/s", "Σ prompt tokens / Σ prefill seconds", A::kRatioOfSums, "prompt_tokens",
            "prefill_s", 1.0, F::kFixed, 1, "prefill tok/s", &S::prefill_tps),
        agg("decode_tps", "tokens/s", "Σ generated tokens / Σ decode seconds", A::kRatioOfSums, "generated_tokens",
            "decode_s", 1.0, F::kFixed, 1, "decode tok/s", &S::decode_tps),
        agg("replay_s_mean", "s", "mean context-replay seconds per task (KVzip's extra prefill; not in prefill tok/s or time)",
            A::kMeanMeasured, "replay_s", "", 1.0, F::kFixed, 3, "replay prefill s", nullptr),
        agg("total_seconds", "s", "Σ prefill + decode seconds", A::kSumMeasured, "prefill_s", "decode_s", 1.0,
            F::kFixed, 1, "time (s)", &S::total_seconds),
        ArmColumn{"reserved_per_stored", "ratio", "reserved_kib_mean / peak_kib_mean (Markdown only)", A::kDerived, "",
                  "", 1.0, F::kFixed, 2, "reserved / stored", false, nullptr, nullptr, reserved_per_stored},
        ArmColumn{"query_mode", "", "query mode of the arm's task rows: aware or agnostic (docs/study.md)",
                  A::kDerived, "", "", 1.0, F::kText, 0, "mode", true, nullptr, nullptr, nullptr},
        ArmColumn{"family_accuracy", "fraction", "passed / tasks per task family", A::kPerFamily, "", "", 1.0,
                  F::kPercent, 1, "", true, nullptr, nullptr, nullptr},
        ArmColumn{"depth_accuracy", "fraction", "passed / tasks of the needle tasks per depth", A::kPerDepth, "", "", 1.0,
                  F::kPercent, 1, "", true, nullptr, nullptr, nullptr},
    };
    return t;
  }();
  return table;
}

const ArmColumn& arm_column(const std::string& key) {
  for (const auto& c : arm_columns()) {
    if (key == c.key) return c;
  }
  throw InternalError("no report column '" + key + "' (report_columns.cpp)");
}

const std::string& column_text(const ArmColumn& c, const ArmSummary& a) {
  return std::string(c.key) == "query_mode" ? a.query_mode : a.arm;
}

double column_value(const ArmColumn& c, const ArmSummary& a, const Summary& s) {
  if (std::string(c.key) == "is_control") return a.is_control ? 1.0 : 0.0;
  if (std::string(c.key) == "delta_tasks" && !s.has_control) return kNaN;
  if (c.int_field != nullptr) return static_cast<double>(a.*c.int_field);
  if (c.real_field != nullptr) return a.*c.real_field;
  const auto it = a.extra.find(c.key);
  return it == a.extra.end() ? kNaN : it->second;
}

}  // namespace kvcache::study
