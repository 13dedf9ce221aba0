// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file report.h
/// Summaries of a results file: the study seed's tables as Markdown (summary.md), JSON
/// (summary.json, read by tools/plot_results.py) and CSV (summary.csv, one row per arm), and a
/// recommendations table generated from the measured numbers by fixed rules (docs/study.md).
/// The per-arm columns, their units and aggregation are one table (report_columns.h); the code
/// is split into report_aggregate.cpp (summarize), report_curves.cpp (budget_curves),
/// report_rules.cpp (recommend) and report_writers.cpp (the three writers).
///
/// Definitions (per arm, over its "task" rows):
///   accuracy       passed / tasks (a row with an error counts as not passed);
///   Δ pp / Δ tasks accuracy and passed count minus the control's;
///   peak KV        mean of CacheStats::bytes_resident_peak (KiB = 1024 B) over the task rows
///                  without error (NaN if none: such an arm is never recommended), and its ratio
///                  to the control's mean; tokens written/resident and speed use the same rows;
///   reserved       mean of CacheStats::bytes_reserved_peak (the blocks the cache held);
///   RSS growth     mean of the peak growth of the process's resident set during a task (the
///                  cache and the request's other allocations), over the rows that measured it;
///   prefill tok/s  Σ prompt_tokens / Σ prefill_s; decode tok/s Σ generated_tokens / Σ decode_s.
/// Missing numbers are NaN (JSON null, empty CSV cell, "–" in Markdown).
///
/// Query modes (sweep.h, QueryMode) are kept apart: the tables above are the query-aware rows';
/// the query-agnostic rows get their own section in summary.md (its tables, then aware vs
/// agnostic accuracy per arm), their own "agnostic" object in summary.json, and their own lines
/// in summary.csv (column query_mode).

#include <cstdint>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/study/results.h"

namespace kvcache::study {

/// One arm's task rows at one prompt length (Task::context_target): the long suite's
/// accuracy × length × arm table, its depth × length heatmap and its Pareto fronts per length.
struct LengthSummary {
  int64_t tasks = 0;
  int64_t passed = 0;
  double accuracy = 0;        ///< passed / tasks
  double peak_kib_mean = 0;   ///< mean bytes_resident_peak, KiB
  double memory_ratio = 0;    ///< peak_kib_mean / the control's at this length (NaN without it)
  double reserved_kib_mean = 0;
  double rss_growth_kib_mean = 0;
  double prefill_tps = 0;     ///< Σ prompt tokens / Σ prefill s
  double decode_ms_per_token = 0;  ///< Σ decode s / Σ generated tokens × 1000
  std::map<std::string, double> family_accuracy;
  std::map<int, double> depth_accuracy;
  bool pareto = false;  ///< on the accuracy-vs-peak-KV front of its length (no arm has >= accuracy at < memory, or > accuracy at <=)
};

struct ArmSummary {
  std::string arm;
  std::string query_mode = "aware";  ///< "aware" or "agnostic" (QueryMode of its task rows)
  bool is_control = false;
  int64_t tasks = 0;
  int64_t passed = 0;
  int64_t errors = 0;
  double accuracy = 0;      ///< passed / tasks, in [0, 1]
  double delta_pp = 0;      ///< (accuracy - control accuracy) * 100
  int64_t delta_tasks = 0;  ///< passed - control passed
  double peak_kib_mean = 0;
  double peak_kib_max = 0;
  double memory_ratio = 0;  ///< peak_kib_mean / control's
  double reserved_kib_mean = 0;    ///< mean bytes_reserved_peak, KiB
  double rss_growth_kib_mean = 0;  ///< mean peak resident-set growth, KiB (NaN if not measured)
  double tokens_written_mean = 0;
  double tokens_resident_mean = 0;
  double span_resident_mean = 0;  ///< NaN if not measured
  std::map<std::string, double> family_accuracy;  ///< by family name
  std::map<int, double> depth_accuracy;           ///< needle tasks by depth_pct
  std::map<int, int64_t> depth_tasks;
  double ppl_single = 0, ppl_stream = 0, kld_mean = 0, kld_max = 0, top1 = 0;  ///< NaN if no "text" row
  double kld_median = 0, kld_p99 = 0, kld_p999 = 0;  ///< NaN if no "text" row (or one written before them)
  double prefill_tps = 0, decode_tps = 0;
  double total_seconds = 0;  ///< Σ prefill_s + decode_s over the arm's tasks
  /// Columns of report_columns.h that have no field above, by column key (NaN if not measured).
  std::map<std::string, double> extra;
  /// The same arm per prompt length (Summary::lengths).
  std::map<int64_t, LengthSummary> by_length;
};

struct ReconstructionSummary {
  std::string quant;
  double bits_per_value = 0, key_rel_err = 0, value_rel_err = 0;
  /// The scheme's attention error (ReconstructionResult::attn_*; NaN when not measured).
  double attn_out_rel_err = std::nan(""), attn_prob_rel_err = std::nan("");
  std::string error;
};

struct AttentionSummary {
  std::string scheme;       ///< granularity key ("kivi")
  std::string description;  ///< "per-channel K + per-token V (KIVI)"
  std::map<int, double> out_rel_err;   ///< by bits
  std::map<int, double> prob_rel_err;  ///< by bits
};

/// One method's accuracy against its budget (the ratio sweep, `kv_study run --budgets`): the
/// arms with the same scheme and policy head (the policy spec without its @budget, split_budget)
/// at two or more budgets of one kind (percentages, or token counts), points by ascending budget.
struct BudgetCurve {
  std::string method;                 ///< "fp32+h2o": scheme + policy head
  std::vector<std::string> budgets;   ///< "@25%", ... (Budget::to_string), ascending
  std::vector<double> budget_values;  ///< fraction in (0, 1] or tokens, ascending
  std::vector<std::string> arms;      ///< the arm of each point
  std::vector<double> accuracy;       ///< passed / tasks of each point, in [0, 1]
  /// By task family / needle depth: the point's accuracy over that family's tasks (NaN where
  /// the arm has none of them).
  std::map<std::string, std::vector<double>> family_accuracy;
  std::map<int, std::vector<double>> depth_accuracy;
  /// The smallest budget whose arm is within one task of the control (same task count and
  /// passed >= control passed - 1): its index, or -1 (none, or no control rows).
  int smallest_within_one_task = -1;
};

struct Recommendation {
  std::string rule;      ///< the rule, in words
  std::string arm;       ///< chosen arm, or "" if none qualifies
  std::string evidence;  ///< the numbers that decided it
};

struct Summary {
  std::string model;
  std::string control;
  bool has_control = false;
  std::vector<std::string> families;  ///< in suite order
  std::vector<int> depths;            ///< ascending
  std::vector<int64_t> lengths;       ///< prompt lengths of the task rows (context_target), ascending
  std::vector<ArmSummary> arms;       ///< in plan order
  std::vector<ReconstructionSummary> reconstruction;
  std::vector<AttentionSummary> attention;
  std::vector<int> attention_bits;
  std::vector<BudgetCurve> curves;  ///< the ratio sweep's curves, in plan order of their first arm
  std::vector<Recommendation> recommendations;
  std::vector<std::string> notes;  ///< warnings (unequal task counts, error rows, missing control)
  /// The query-agnostic task rows (ResultRow::query_mode "agnostic"), summarized apart: arms,
  /// deltas against the control's agnostic rows, curves and notes (its text columns from the
  /// same arm's "text" row; no reconstruction or attention rows). Null when there are none. The
  /// fields above cover only the query-aware task rows, except `families` and `depths` (those
  /// of either mode). Recommendations come from the query-aware rows only.
  std::shared_ptr<const Summary> agnostic;
};

/// Model ids present in the rows, in first-appearance order.
std::vector<std::string> models_in(const std::vector<ResultRow>& rows);

/// Summarizes the rows of `model` (empty: the only model present).
/// @throws InvalidArgument if `model` is empty and the rows hold several models (listing them),
///         or if no row belongs to the model.
Summary summarize(const std::vector<ResultRow>& rows, const std::string& model = "",
                  const std::string& control = "fp32+full");

/// The budget curves of `summary.arms` (summarize() fills Summary::curves with this).
std::vector<BudgetCurve> budget_curves(const Summary& summary);

/// The recommendation rules, applied to `summary.arms` and `summary.curves` (summarize()
/// already calls this): the five fixed rules, then per budget curve the smallest budget within
/// one task of the control.
std::vector<Recommendation> recommend(const Summary& summary);

std::string summary_markdown(const Summary& summary);
std::string summary_json(const Summary& summary);
std::string summary_csv(const Summary& summary);

/// One row per arm and prompt length (Summary::lengths; LengthSummary's fields, then per-family
/// and per-depth accuracy at that length).
std::string summary_by_length_csv(const Summary& summary);

/// Writes summary.md, summary.json and summary.csv into `dir` (created if missing), each one
/// atomically (as write_results), and summary_by_length.csv when the rows hold two or more
/// prompt lengths.
void write_summary_files(const Summary& summary, const std::string& dir);

}  // namespace kvcache::study
