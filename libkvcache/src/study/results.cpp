// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/results.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/file_io.h"
#include "study/json_fields.h"
#include "kvcache/error.h"
#include "kvcache/spec.h"
#include "kvcache/study/schema.h"

namespace kvcache::study {
namespace {

using json = nlohmann::json;  // std::map-backed: keys sorted, deterministic output

std::string read_all(int fd, const std::string& path) {
  std::string data;
  char buf[1 << 16];
  KV_CHECK_ARG(::lseek(fd, 0, SEEK_SET) == 0, "cannot seek '", path, "': ", std::strerror(errno));
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    KV_CHECK_ARG(n >= 0, "cannot read '", path, "': ", std::strerror(errno));
    if (n == 0) break;
    data.append(buf, static_cast<size_t>(n));
  }
  return data;
}

/// Splits `data` into complete lines; returns the byte length of the complete part.
size_t complete_lines(const std::string& data, std::vector<std::string>* lines) {
  const size_t last_nl = data.rfind('\n');
  const size_t complete = last_nl == std::string::npos ? 0 : last_nl + 1;
  size_t start = 0;
  while (start < complete) {
    const size_t nl = data.find('\n', start);
    lines->push_back(data.substr(start, nl - start));
    start = nl + 1;
  }
  return complete;
}

std::vector<ResultRow> parse_lines(const std::vector<std::string>& lines, const std::string& path) {
  std::vector<ResultRow> rows;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (lines[i].find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      rows.push_back(row_from_json(lines[i]));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat(path, ":", i + 1, ": not a result row: ", e.what()));
    }
  }
  return rows;
}

}  // namespace

std::string ResultRow::key() const {
  std::string k = arm + '\t' + task + '\t' + model;
  if (!query_mode.empty()) k += '\t' + query_mode;
  return k;
}

void ResultRow::set(const std::string& name, double v) {
  KV_CHECK(find_row_metric(name) != nullptr, InternalError, "result row value '", name,
           "' is not a row metric of the schema (kvcache/study/schema.h)");
  values[name] = v;
}

double ResultRow::value(const std::string& name) const {
  auto it = values.find(name);
  return it == values.end() ? NAN : it->second;
}

std::string row_to_json(const ResultRow& r) {
  json j;
  j["order"] = r.order;
  j["kind"] = r.kind;
  j["arm"] = r.arm;
  j["task"] = r.task;
  j["model"] = r.model;
  if (r.kind == "task") {
    j["family"] = r.family;
    j["depth_pct"] = r.depth_pct;
    j["context_target"] = r.context_target;
    j["passed"] = r.passed;
    j["output"] = r.output;
    if (!r.query_mode.empty()) j["query_mode"] = r.query_mode;
  }
  if (r.kind == "attn" && !r.granularity.empty()) j["granularity"] = r.granularity;
  if (!r.error.empty()) j["error"] = r.error;
  json v = json::object();
  for (const auto& [k, x] : r.values) {
    if (std::isfinite(x)) v[k] = x;
  }
  j["values"] = v;
  return j.dump();
}

ResultRow row_from_json(const std::string& line) {
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    throw InvalidArgument(detail::str_cat("invalid JSON: ", e.what()));
  }
  KV_CHECK_ARG(j.is_object(), "a result row must be a JSON object");
  namespace f = json_fields;
  const std::string where = "result row";
  ResultRow r;
  r.order = f::integer(j, "order", where, 0, INT64_MAX);
  r.kind = f::string(j, "kind", where);
  r.arm = f::string(j, "arm", where);
  r.task = f::string(j, "task", where);
  r.model = f::string(j, "model", where);
  r.family = f::string(j, "family", where, std::string());
  r.depth_pct = static_cast<int>(f::integer(j, "depth_pct", where, -1, 100, -1));
  r.context_target = f::integer(j, "context_target", where, 0, INT64_MAX, 0);
  r.passed = f::boolean(j, "passed", where, false);
  r.output = f::string(j, "output", where, std::string());
  r.error = f::string(j, "error", where, std::string());
  if (j.contains("values")) {
    KV_CHECK_ARG(j.at("values").is_object(), where, ": field 'values' is not an object");
    for (const auto& [k, x] : j.at("values").items()) {
      KV_CHECK_ARG(x.is_number(), where, ": values['", k, "'] = ", x.dump(), " is not a number");
      r.values[k] = x.template get<double>();
    }
  }
  r.query_mode = f::string(j, "query_mode", where, std::string());
  if (r.query_mode == "aware") r.query_mode.clear();
  KV_CHECK_ARG(r.query_mode.empty() || (r.query_mode == "agnostic" && r.kind == "task"), where, ": query_mode '",
               r.query_mode, "' of a ", r.kind, " row (expected 'aware' or 'agnostic', on task rows only)");
  r.granularity = f::string(j, "granularity", where, std::string());
  if (r.kind == "attn" && r.granularity.empty()) {
    // Legacy rows (written before the field existed): the scheme only in "attn:<key>:b<bits>".
    const auto p1 = r.task.find(':');
    const auto p2 = r.task.rfind(":b");
    KV_CHECK_ARG(p1 != std::string::npos && p2 != std::string::npos && p2 > p1, where,
                 ": attn row without a 'granularity' field and task '", r.task, "' is not attn:<key>:b<bits>");
    r.granularity = r.task.substr(p1 + 1, p2 - p1 - 1);
  }
  return r;
}

Shard Shard::parse(const std::string& text) {
  const auto slash = text.find('/');
  KV_CHECK_ARG(slash != std::string::npos, "shard '", text, "' must be i/n with 0 <= i < n, e.g. 0/4");
  Shard s;
  s.count = parse_integer(text.substr(slash + 1), "shard '" + text + "': n", 1, kMaxShards);
  s.index = parse_integer(text.substr(0, slash), "shard '" + text + "': i", 0, kMaxShards);
  KV_CHECK_ARG(s.index < s.count, "shard '", text, "': i = ", s.index, " is out of range [0, ", s.count - 1,
               "] (shards are 0-based, like SLURM_ARRAY_TASK_ID with --array=0-(n-1))");
  return s;
}

ResultsStore::ResultsStore(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  KV_CHECK_ARG(fd_ >= 0, "cannot open results file '", path, "': ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd_);
    fd_ = -1;
    throw InvalidArgument("results file '" + path + "' is locked by another running kv_study process");
  }
  try {
    struct stat st {};
    KV_CHECK_ARG(::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode), "results file '", path,
                 "' is not a regular file (a results file is appended to and fsync'd)");
    KV_CHECK_ARG(st.st_size <= kMaxResultsFileBytes, "results file '", path, "' is ", st.st_size,
                 " bytes, more than the ", io::bytes_text(kMaxResultsFileBytes), " a results file may have");
    const std::string data = read_all(fd_, path);
    io::check_line_lengths(data, "results file", path, kMaxResultLineBytes);
    std::vector<std::string> lines;
    const size_t complete = complete_lines(data, &lines);
    if (complete < data.size()) {
      // A crash in the middle of a row's write(2): drop the partial line.
      KV_CHECK(::ftruncate(fd_, static_cast<off_t>(complete)) == 0, InternalError, "cannot truncate '", path,
               "': ", std::strerror(errno));
      KV_CHECK(::fsync(fd_) == 0, InternalError, "fsync '", path, "' failed: ", std::strerror(errno));
      repaired_bytes_ = static_cast<int64_t>(data.size() - complete);
    }
    rows_ = parse_lines(lines, path);
    for (size_t i = 0; i < rows_.size(); ++i) {
      KV_CHECK_ARG(index_.emplace(rows_[i].key(), i).second, path, ": duplicate row for arm '", rows_[i].arm,
                   "', task '", rows_[i].task, "', model '", rows_[i].model, "'",
                   rows_[i].query_mode.empty() ? "" : " (query_mode '" + rows_[i].query_mode + "')");
    }
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

ResultsStore::~ResultsStore() {
  if (fd_ >= 0) ::close(fd_);
}

bool ResultsStore::contains(const std::string& key) const { return index_.count(key) > 0; }

void ResultsStore::append(const ResultRow& row) {
  const std::string key = row.key();
  KV_CHECK_ARG(!contains(key), "results file '", path_, "' already holds arm '", row.arm, "', task '", row.task,
               "', model '", row.model, "'");
  io::write_all(fd_, row_to_json(row) + "\n", path_);
  KV_CHECK(::fsync(fd_) == 0, InternalError, "fsync '", path_, "' failed: ", std::strerror(errno));
  index_.emplace(key, rows_.size());
  rows_.push_back(row);
}

std::vector<ResultRow> read_results(const std::string& path, int64_t* partial_lines) {
  io::check_readable_file(path, "results file");
  const std::string data = io::read_regular_file(path, "results file", kMaxResultsFileBytes);
  io::check_line_lengths(data, "results file", path, kMaxResultLineBytes);
  std::vector<std::string> lines;
  const size_t complete = complete_lines(data, &lines);
  if (partial_lines != nullptr) *partial_lines = complete < data.size() ? 1 : 0;
  return parse_lines(lines, path);
}

void write_results(const std::string& path, const std::vector<ResultRow>& rows) {
  std::string data;
  for (const auto& r : rows) data += row_to_json(r) + "\n";
  io::write_file_atomic(path, data);
}

std::vector<ResultRow> merge_rows(const std::vector<std::vector<ResultRow>>& inputs, MergeStats* stats) {
  MergeStats st;
  std::map<std::string, ResultRow> by_key;
  for (const auto& rows : inputs) {
    for (const auto& r : rows) {
      ++st.rows_in;
      auto [it, inserted] = by_key.emplace(r.key(), r);
      if (!inserted) {
        if (row_to_json(it->second) == row_to_json(r)) {
          ++st.duplicates;
        } else {
          ++st.conflicts;
        }
      }
    }
  }
  std::vector<ResultRow> out;
  out.reserve(by_key.size());
  for (auto& [k, r] : by_key) out.push_back(std::move(r));
  std::stable_sort(out.begin(), out.end(), [](const ResultRow& a, const ResultRow& b) {
    if (a.order != b.order) return a.order < b.order;
    return a.key() < b.key();
  });
  st.rows_out = static_cast<int64_t>(out.size());
  if (stats != nullptr) *stats = st;
  return out;
}

MergeStats merge_result_files(const std::vector<std::string>& inputs, const std::string& output) {
  KV_CHECK_ARG(!inputs.empty(), "merge: no input files");
  std::vector<std::vector<ResultRow>> all;
  int64_t partial = 0;
  for (const auto& p : inputs) {
    int64_t pl = 0;
    all.push_back(read_results(p, &pl));
    partial += pl;
  }
  MergeStats st;
  auto rows = merge_rows(all, &st);
  st.partial_lines = partial;
  write_results(output, rows);
  return st;
}

}  // namespace kvcache::study
