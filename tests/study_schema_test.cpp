// SPDX-License-Identifier: Apache-2.0
// The study's one schema: every row metric and every report column appears once with a unit,
// the aggregated columns read declared row metrics, a sweep writes only declared keys, the
// three writers agree cell for cell, and legacy attn rows still read.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "kvcache/error.h"
#include "kvcache/study/report.h"
#include "kvcache/study/report_columns.h"
#include "kvcache/study/schema.h"
#include "kvcache/study/sweep.h"
#include "kvcache/study/task_suite.h"
#include "kvcache/torch.h"
#include "study/fake_evaluator.h"

using namespace kvcache;
using namespace kvcache::study;

namespace {

const std::set<std::string> kUnits = {"bytes", "KiB",   "tokens", "s",          "tokens/s", "fraction",
                                      "pp",    "ratio", "count",  "bits/value", "nats",     "ms/token", ""};

std::vector<std::string> split(const std::string& line, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : line) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

ResultRow row(const std::string& kind, const std::string& arm, const std::string& task, int64_t order) {
  ResultRow r;
  r.order = order;
  r.kind = kind;
  r.arm = arm;
  r.task = task;
  r.model = "m";
  return r;
}

}  // namespace

TEST(StudySchema, EachRowMetricOnceWithAUnit) {
  std::set<std::string> keys;
  int cache_fields = 0;
  for (const auto& m : row_metrics()) {
    EXPECT_TRUE(keys.insert(m.key).second) << "duplicate row metric " << m.key;
    EXPECT_TRUE(kUnits.count(m.unit)) << m.key << " has unit '" << m.unit << "'";
    EXPECT_GT(std::string(m.description).size(), 10u) << m.key;
    for (const auto& k : split(m.kinds, ',')) {
      EXPECT_TRUE(k == "task" || k == "text" || k == "recon" || k == "attn") << m.key << ": kind " << k;
    }
    cache_fields += m.cache_field != nullptr;
    EXPECT_EQ(find_row_metric(m.key), &m);
  }
  EXPECT_EQ(keys.size(), 38u);
  EXPECT_EQ(cache_fields, 7);  // every CacheStats counter
  EXPECT_EQ(find_row_metric("no_such_metric"), nullptr);
  EXPECT_STREQ(find_row_metric("peak_bytes")->unit, "bytes");
  EXPECT_EQ(find_row_metric("peak_bytes")->cache_field, &CacheStats::bytes_resident_peak);
}

TEST(StudySchema, EachArmColumnOnceWithAUnitAndADeclaredSource) {
  std::set<std::string> keys;
  for (const auto& c : arm_columns()) {
    EXPECT_TRUE(keys.insert(c.key).second) << "duplicate column " << c.key;
    EXPECT_TRUE(kUnits.count(c.unit)) << c.key << " has unit '" << c.unit << "'";
    EXPECT_GT(std::string(c.description).size(), 5u) << c.key;
    const bool reads_rows = c.aggregation != Aggregation::kDerived && c.aggregation != Aggregation::kPerFamily &&
                            c.aggregation != Aggregation::kPerDepth;
    if (reads_rows) {
      EXPECT_NE(find_row_metric(c.source), nullptr) << c.key << " reads undeclared '" << c.source << "'";
      EXPECT_GT(c.divisor, 0) << c.key;
    }
    if (c.aggregation == Aggregation::kSumMeasured || c.aggregation == Aggregation::kRatioOfSums) {
      EXPECT_NE(find_row_metric(c.source2), nullptr) << c.key << " reads undeclared '" << c.source2 << "'";
    }
    // A KiB column divides bytes by 1024; a column in its source's unit divides by 1.
    if (reads_rows && std::string(c.unit) == "KiB") {
      EXPECT_STREQ(find_row_metric(c.source)->unit, "bytes") << c.key;
      EXPECT_EQ(c.divisor, 1024.0) << c.key;
    }
  }
  EXPECT_EQ(&arm_column("peak_kib_mean"), &arm_columns()[8]);
  EXPECT_THROW(arm_column("nope"), InternalError);
}

TEST(StudySchema, RowsRefuseUndeclaredKeysAndASweepWritesOnlyDeclaredOnes) {
  ResultRow r;
  r.set("peak_bytes", 5);
  EXPECT_EQ(r.value("peak_bytes"), 5);
  try {
    r.set("peak_byte", 1);
    FAIL() << "an undeclared key was accepted";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("'peak_byte'"), std::string::npos) << e.what();
  }
  SweepOptions o;
  o.arms = {parse_arm("fp32+full"), parse_arm("int4+h2o@50%")};
  o.tasks = generate_suite("small", 3);
  kvcache::study::testing::FakeEvaluator ev;
  const std::string path = ::testing::TempDir() + "/study_schema_rows.jsonl";
  std::remove(path.c_str());
  ResultsStore store(path);
  run_sweep(ev, o, store);
  std::set<std::string> seen;
  for (const auto& row : store.rows()) {
    for (const auto& kv : row.values) {
      const RowMetric* m = find_row_metric(kv.first);
      ASSERT_NE(m, nullptr) << kv.first;
      EXPECT_NE(std::string(m->kinds).find(row.kind), std::string::npos) << kv.first << " in a " << row.kind << " row";
      seen.insert(kv.first);
    }
    if (row.kind == "attn") {
      EXPECT_FALSE(row.granularity.empty());
      EXPECT_EQ(row.task, "attn:" + row.granularity + ":b" + std::to_string(static_cast<int>(row.value("bits"))));
    }
  }
  // Every CacheStats counter reaches the task rows by the table.
  for (const auto& m : row_metrics()) {
    if (m.cache_field != nullptr) {
      EXPECT_TRUE(seen.count(m.key)) << m.key;
    }
  }
}

TEST(StudySchema, AttnRowsCarryTheirSchemeAndLegacyRowsStillRead) {
  ResultRow a = row("attn", "", "attn:kivi:b2", 0);
  a.granularity = "kivi";
  a.set("bits", 2);
  const std::string line = row_to_json(a);
  EXPECT_NE(line.find(R"("granularity":"kivi")"), std::string::npos) << line;
  EXPECT_EQ(row_from_json(line).granularity, "kivi");
  // Task rows are serialized as before (no new field).
  EXPECT_EQ(row_to_json(row("task", "fp32+full", "t", 1)).find("granularity"), std::string::npos);
  // A row of an older results file: the scheme only in the task id.
  const ResultRow legacy = row_from_json(
      R"({"arm":"","kind":"attn","model":"m","order":3,"task":"attn:ch-k-tok-v:b4","values":{"bits":4,"out_rel_err":0.5}})");
  EXPECT_EQ(legacy.granularity, "ch-k-tok-v");
  EXPECT_THROW(row_from_json(R"({"arm":"","kind":"attn","model":"m","order":3,"task":"attn","values":{}})"),
               InvalidArgument);
}

TEST(StudySchema, WritersAgreeCellForCell) {
  // Two arms, one with every measured number, one with errors only (NaN everywhere).
  std::vector<ResultRow> rows;
  int64_t order = 0;
  for (int i = 0; i < 4; ++i) {
    ResultRow r = row("task", "fp32+full", "t" + std::to_string(i), order++);
    r.family = i < 2 ? "needle" : "summary";
    r.depth_pct = i < 2 ? 10 * (i + 1) : -1;
    r.passed = i != 3;
    r.set("peak_bytes", 1024.0 * (i + 1));
    r.set("peak_reserved_bytes", 4096);
    r.set("tokens_written", 10 + i);
    r.set("tokens_resident", 7);
    r.set("prompt_tokens", 30);
    r.set("prefill_s", 0.125);
    r.set("generated_tokens", 3);
    r.set("decode_s", 0.5);
    if (i == 0) r.set("span_resident", 0.75);
    if (i == 1) r.set("rss_growth_peak_bytes", 3072);
    rows.push_back(r);
  }
  ResultRow t = row("text", "fp32+full", "text", order++);
  t.set("ppl_single", 7.25);
  t.set("ppl_stream", 8.5);
  t.set("kld_mean", 0);
  t.set("kld_max", 0);
  t.set("kld_median", 0);
  t.set("kld_p99", 0);
  t.set("kld_p999", 0);
  t.set("top1", 1);
  rows.push_back(t);
  for (int i = 0; i < 4; ++i) {
    ResultRow r = row("task", "int2+h2o@50%", "t" + std::to_string(i), order++);
    r.family = i < 2 ? "needle" : "summary";
    r.depth_pct = i < 2 ? 10 * (i + 1) : -1;
    r.error = "budget too small";
    rows.push_back(r);
  }
  const Summary s = summarize(rows);
  const auto& c = s.arms[0];
  // Exact values of the column-driven aggregation.
  EXPECT_DOUBLE_EQ(c.peak_kib_mean, 2.5);  // (1+2+3+4)/4 KiB
  EXPECT_DOUBLE_EQ(c.peak_kib_max, 4.0);
  EXPECT_DOUBLE_EQ(c.reserved_kib_mean, 4.0);
  EXPECT_DOUBLE_EQ(c.rss_growth_kib_mean, 3.0);  // the one row that measured it
  EXPECT_DOUBLE_EQ(c.span_resident_mean, 0.75);
  EXPECT_DOUBLE_EQ(c.tokens_written_mean, 11.5);
  EXPECT_DOUBLE_EQ(c.prefill_tps, 240.0);  // 120 tokens / 0.5 s
  EXPECT_DOUBLE_EQ(c.decode_tps, 6.0);     // 12 tokens / 2 s
  EXPECT_DOUBLE_EQ(c.total_seconds, 2.5);
  EXPECT_DOUBLE_EQ(c.ppl_stream, 8.5);
  EXPECT_TRUE(std::isnan(s.arms[1].peak_kib_mean));
  EXPECT_TRUE(std::isnan(s.arms[1].prefill_tps));
  EXPECT_EQ(s.arms[1].total_seconds, 0);

  const auto j = nlohmann::json::parse(summary_json(s));
  std::istringstream csv(summary_csv(s));
  std::string header_line;
  std::getline(csv, header_line);
  const auto header = split(header_line, ',');
  std::set<std::string> unique(header.begin(), header.end());
  EXPECT_EQ(unique.size(), header.size()) << header_line;
  const std::string md = summary_markdown(s);
  size_t files_columns = 0;
  for (size_t a = 0; a < s.arms.size(); ++a) {
    std::string line;
    std::getline(csv, line);
    const auto cells = split(line, ',');
    ASSERT_EQ(cells.size(), header.size()) << line;
    const auto& ja = j["arms"][a];
    for (const auto& col : arm_columns()) {
      if (!col.in_files) {
        EXPECT_FALSE(ja.contains(col.key)) << col.key;
        continue;
      }
      if (col.aggregation == Aggregation::kPerFamily || col.aggregation == Aggregation::kPerDepth) {
        EXPECT_TRUE(ja.at(col.key).is_object()) << col.key;
        continue;
      }
      files_columns += a == 0;
      const size_t at = static_cast<size_t>(std::find(header.begin(), header.end(), col.key) - header.begin());
      ASSERT_LT(at, header.size()) << col.key << " missing from the CSV header";
      const auto& jv = ja.at(col.key);
      const std::string& cell = cells[at];
      if (col.format == Format::kText) {
        EXPECT_EQ(jv.get<std::string>(), cell);
      } else if (jv.is_null()) {
        EXPECT_EQ(cell, "") << col.key;
      } else {
        const double v = jv.is_boolean() ? (jv.get<bool>() ? 1.0 : 0.0) : jv.get<double>();
        EXPECT_NEAR(std::stod(cell), v, 1e-5 * std::max(1.0, std::fabs(v))) << col.key;
        EXPECT_EQ(v, column_value(col, s.arms[a], s)) << col.key;
      }
    }
  }
  EXPECT_EQ(files_columns, 29u);
  EXPECT_EQ(header.size(), 29u + 2 + 2);  // + acc_needle, acc_summary, needle_d10, needle_d20
  // Markdown prints the same numbers in its own format.
  EXPECT_NE(md.find("| fp32+full | 3/4 | 75.0% | control | 2.5 | 1.00 | 11.5 | 7.0 | 0 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| int2+h2o@50% | 0/4 | 0.0% | -75.0 pp (-3) | – | – | – | – | 4 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| fp32+full | 2.5 | 4.0 | 3.0 | 1.60 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| fp32+full | 240.0 | 6.0 | 0.000 | 2.5 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| fp32+full | 75.0% | 7.250 | 8.500 | 0.00000 | 0.00000 | 0.0000 | 0.0000 | 0.0000 | 100.0% |"), std::string::npos) << md;
}
