// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file report_columns.h
/// The per-arm column table of the summaries: one line per column gives its key (the CSV header
/// and the JSON key), unit, description, how it aggregates the arm's result rows, and how
/// Markdown formats it. summarize() computes every aggregated column from this table, and
/// summary_csv(), summary_json() and summary_markdown() write the columns from it, so a new
/// per-arm metric is one line in report_columns.cpp (a column with no ArmSummary field is
/// stored in ArmSummary::extra under its key).

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/study/report.h"

namespace kvcache::study {

/// How a column is computed from the arm's rows. "Measured rows" are the arm's task rows
/// without an error; a missing value in such a row counts as 0 (kMean/kMax/kSum/kRatio).
enum class Aggregation {
  kDerived,       ///< computed by summarize() from the counts and the control (described in words)
  kMeanMeasured,  ///< Σ source / n over the measured rows, / divisor; NaN if there is none
  kMaxMeasured,   ///< max(0, source) over the measured rows, / divisor; NaN if there is none
  kMeanPresent,   ///< mean of source over the measured rows that carry it, / divisor; NaN if none
  kSumMeasured,   ///< Σ source + Σ source2 over the measured rows (0 if none)
  kRatioOfSums,   ///< Σ source / Σ source2 over the measured rows; NaN unless Σ source2 > 0
  kTextValue,     ///< source of the arm's "text" row; NaN if it has none or it carries an error
  kPerFamily,     ///< one value per task family (passed / tasks): CSV acc_<family>, JSON an object
  kPerDepth,      ///< one value per needle depth (passed / tasks): CSV needle_d<depth>, JSON an object
};

/// How a value is written. CSV writes numbers with %.6g (NaN: empty), JSON as numbers (NaN:
/// null; kInt as an integer, kBool as true/false); Markdown as below (NaN: "–").
enum class Format {
  kText,     ///< a label: the arm spec, or the query mode (column_text)
  kBool,     ///< CSV 1/0
  kInt,      ///< %.0f
  kFixed,    ///< %.<decimals>f
  kPercent,  ///< 100 × value, %.1f, then "%"
};

struct ArmColumn {
  const char* key;          ///< CSV header / JSON key, e.g. "peak_kib_mean"
  const char* unit;         ///< schema.h's units
  const char* description;  ///< what it is
  Aggregation aggregation;
  const char* source;       ///< row metric aggregated ("" for kDerived)
  const char* source2;      ///< second row metric of kSumMeasured / kRatioOfSums, else ""
  double divisor;           ///< applied after aggregating (1024: bytes to KiB), else 1
  Format format;
  int decimals;             ///< Markdown decimals of kFixed
  const char* md_header;    ///< Markdown column header
  bool in_files;            ///< written to summary.csv and summary.json (false: a Markdown-only view)
  double ArmSummary::*real_field;   ///< where summarize() stores it (real columns), or nullptr
  int64_t ArmSummary::*int_field;   ///< count columns, or nullptr
  /// The Markdown cell when it is not the formatted value ("8/10", "+1.0 pp (+1)"), or nullptr.
  std::string (*md_cell)(const ArmSummary&, const Summary&);
};

/// The columns in file order (CSV columns and JSON keys of each arm appear in this order; the
/// kPerFamily / kPerDepth columns expand last). Keys are unique.
const std::vector<ArmColumn>& arm_columns();

/// The column named `key`. @throws InternalError if there is none.
const ArmColumn& arm_column(const std::string& key);

/// The label of a kText column for arm `a`: ArmSummary::query_mode for "query_mode", else the arm.
const std::string& column_text(const ArmColumn& c, const ArmSummary& a);

/// The column's value for arm `a` of `s` (NaN where not computed: delta_tasks without control
/// rows, an unmeasured metric). Not for kText, kPerFamily, kPerDepth.
double column_value(const ArmColumn& c, const ArmSummary& a, const Summary& s);

}  // namespace kvcache::study
