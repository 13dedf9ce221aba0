// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file results.h
/// The crash-safe results file of a sweep (results.jsonl) and shard merging.
///
/// One finished work item = one JSON line, written with a single write(2) and fsync'd before
/// the next item starts, so a killed sweep loses no finished row. A crash in the middle of a
/// write can at worst leave a trailing partial line (no '\n'); ResultsStore removes it when it
/// reopens the file. Rows are keyed by (arm, task, model); a rerun skips keys already present,
/// so rerunning the same command resumes and produces the same file as an uninterrupted run.
/// Query-agnostic task rows (QueryMode::kAgnostic) add their mode to the key; query-aware rows
/// do not, so files written before query modes existed resume as aware rows.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvcache::study {

/// Kinds of result rows.
///   "task":  one (arm, task) generation, scored;            task = task id
///   "text":  perplexity / KLD / top-1 of one arm;           task = "text"
///   "recon": reconstruction error of one quantizer spec;    arm = quant spec, task = "recon"
///   "attn":  attention error of one granularity scheme;     arm = "", task = "attn:<key>:b<bits>"
///            (the task id is only the row's identity: the scheme is in `granularity`, the bit
///            width in values["bits"], and nothing parses the id back)
struct ResultRow {
  int64_t order = 0;      ///< index of the item in the full (unsharded) sweep plan
  std::string kind;       ///< "task", "text", "recon", "attn"
  std::string arm;        ///< canonical arm spec "quant+policy" (see kinds above)
  std::string task;       ///< task id or pseudo-task (see kinds above)
  std::string model;      ///< model id
  // task rows
  std::string family;     ///< task family name
  int depth_pct = -1;     ///< needle depth, -1 otherwise
  int64_t context_target = 0;
  bool passed = false;
  std::string output;     ///< the generated reply
  std::string error;      ///< non-empty if the item failed with a user-level error (counted as a fail)
  /// attn rows: the granularity key (KvGranularity, e.g. "kivi"). Rows written before this field
  /// existed carry it only in the task id; row_from_json() fills it from there (legacy files).
  std::string granularity;
  /// task rows: "agnostic" for a query-agnostic row (QueryMode::kAgnostic), "" for a query-aware
  /// one (the default, and every row written before query modes existed). row_from_json reads
  /// "aware" as "".
  std::string query_mode;
  /// Named measurements (finite numbers only), e.g. peak_bytes, prefill_s, ppl_stream, kld_mean;
  /// every key is a row metric of schema.h (write them with set()).
  std::map<std::string, double> values;

  /// values[key] = v. @throws InternalError if `key` is not in row_metrics() (schema.h): a new
  /// number is declared there, with its unit, before a sweep writes it.
  void set(const std::string& key, double v);
  /// arm + '\t' + task + '\t' + model, then + '\t' + query_mode if query_mode is not empty.
  std::string key() const;
  /// Value `name`, or NaN if absent.
  double value(const std::string& name) const;
};

/// One JSON object (no newline), keys sorted: identical rows serialize identically.
std::string row_to_json(const ResultRow& row);
/// @throws InvalidArgument if the line is not a row.
ResultRow row_from_json(const std::string& line);

/// The most shards a sweep may be cut into (`--shard i/n`: n <= 10^6, as Slurm's largest arrays).
inline constexpr int64_t kMaxShards = 1000000;

/// The largest results file read (a results file of the default suite's every arm is a few
/// MB), and the longest line of one: bounds on what a file named by a user is read into memory.
inline constexpr int64_t kMaxResultsFileBytes = int64_t{1} << 30;
inline constexpr int64_t kMaxResultLineBytes = int64_t{16} << 20;

/// Deterministic slice `index` of `count` (0-based): owns plan item `order` iff
/// order % count == index.
struct Shard {
  int64_t index = 0;
  int64_t count = 1;
  /// Parses "i/n": decimal integers (no blanks or signs) with 1 <= n <= kMaxShards, 0 <= i < n.
  /// @throws InvalidArgument naming the shard text, the bad part and its range.
  static Shard parse(const std::string& text);
  bool owns(int64_t order) const { return order % count == index; }
  std::string to_string() const { return std::to_string(index) + "/" + std::to_string(count); }
};

/// An open results file, locked against a second writer.
class ResultsStore {
 public:
  /// Opens (creating) `path`, takes an exclusive advisory lock, truncates a trailing partial
  /// line, and loads the finished rows.
  /// @throws InvalidArgument if the file cannot be opened, is not a regular file, is locked by
  ///         another process, is larger than kMaxResultsFileBytes (1 GiB), has a line longer than
  ///         kMaxResultLineBytes (16 MiB), or holds a complete line that is not a row (naming the
  ///         line).
  explicit ResultsStore(const std::string& path);
  ~ResultsStore();
  ResultsStore(const ResultsStore&) = delete;
  ResultsStore& operator=(const ResultsStore&) = delete;

  const std::string& path() const { return path_; }
  bool contains(const std::string& key) const;
  /// Appends the row as one line with one write(2), then fsync(2).
  /// @throws InvalidArgument if its key is already present; InternalError on an I/O failure.
  void append(const ResultRow& row);
  const std::vector<ResultRow>& rows() const { return rows_; }
  /// Bytes of a trailing partial line removed when the file was opened (0 if none).
  int64_t repaired_bytes() const { return repaired_bytes_; }

 private:
  std::string path_;
  int fd_ = -1;
  std::vector<ResultRow> rows_;
  std::map<std::string, size_t> index_;
  int64_t repaired_bytes_ = 0;
};

/// Reads a results file without modifying it. A trailing partial line is skipped and counted in
/// `*partial_lines` if given. @throws InvalidArgument if `path` does not exist, is not a regular
///         file (a directory, a device such as /dev/zero, a FIFO: refused before reading), is
///         larger than kMaxResultsFileBytes (1 GiB) or has a line longer than kMaxResultLineBytes
///         (16 MiB) (naming the limit), or on a bad complete line (naming it).
std::vector<ResultRow> read_results(const std::string& path, int64_t* partial_lines = nullptr);

/// Writes rows (one line each) to `path` atomically: a temporary file in the same directory,
/// fsync, rename; on any failure `path` is as it was and no temporary is left.
/// @throws InvalidArgument naming the path and the OS error.
void write_results(const std::string& path, const std::vector<ResultRow>& rows);

struct MergeStats {
  int64_t rows_in = 0;
  int64_t rows_out = 0;
  int64_t duplicates = 0;     ///< identical rows dropped
  int64_t conflicts = 0;      ///< same key, different content: the first input's row kept
  int64_t partial_lines = 0;  ///< trailing partial lines skipped
};

/// Combines rows (e.g. of several shard files): one row per key (the first seen), sorted by
/// (order, key) — the order of an unsharded run.
std::vector<ResultRow> merge_rows(const std::vector<std::vector<ResultRow>>& inputs, MergeStats* stats = nullptr);

/// read_results on every input, merge_rows, write_results to `output`.
MergeStats merge_result_files(const std::vector<std::string>& inputs, const std::string& output);

}  // namespace kvcache::study
