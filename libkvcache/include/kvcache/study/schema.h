// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file schema.h
/// The one schema of the study's numbers.
///
/// 1. Row metrics: every key a sweep may write into ResultRow::values, with its unit, the row
///    kinds that carry it and what it measures. ResultRow::set() refuses a key that is not here,
///    so the results file never holds an undocumented number.
/// 2. Arm columns (report_columns.h): every per-arm column of summary.csv / summary.json /
///    summary.md, with its unit, how it aggregates the rows and how it is formatted. The three
///    writers are driven by that table: a new metric is one line there.
///
/// Units are spelled once, as below: "bytes", "KiB" (1024 B), "tokens", "s", "tokens/s",
/// "fraction" (in [0, 1]), "pp" (percentage points), "ratio", "count", "bits/value", "nats",
/// "" (a label or a flag).

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/cache_config.h"

namespace kvcache::study {

/// One measurement key of a result row.
struct RowMetric {
  const char* key;          ///< ResultRow::values key, e.g. "peak_bytes"
  const char* unit;         ///< see the file comment
  const char* kinds;        ///< row kinds that carry it, comma-separated: "task", "task,text", "recon", "attn"
  const char* description;  ///< what it measures, in one sentence
  /// For the CacheManager counters: the CacheStats field it copies (the sweep writes every such
  /// metric from CacheManager::stats() by this table); nullptr otherwise.
  int64_t CacheStats::*cache_field;
};

/// Every row metric, in a fixed order (task rows, cache counters, text, recon, attn); each key
/// appears once.
const std::vector<RowMetric>& row_metrics();

/// The row metric named `key`, or nullptr.
const RowMetric* find_row_metric(const std::string& key);

}  // namespace kvcache::study
