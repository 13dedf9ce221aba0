// SPDX-License-Identifier: Apache-2.0
// Summaries on synthetic rows: every table's numbers, the generated recommendations, and the
// Markdown / JSON / CSV renderings.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvcache/error.h"
#include "kvcache/study/report.h"

using namespace kvcache;
using namespace kvcache::study;

namespace {

int64_t g_order = 0;

ResultRow task_row(const std::string& arm, int i, bool passed, double peak, int depth = -1,
                   const std::string& family = "needle") {
  ResultRow r;
  r.order = g_order++;
  r.kind = "task";
  r.arm = arm;
  r.task = "t" + std::to_string(i);
  r.model = "m1";
  r.family = family;
  r.depth_pct = depth;
  r.passed = passed;
  r.values = {{"peak_bytes", peak}, {"peak_reserved_bytes", 2 * peak}, {"tokens_written", 100},
              {"tokens_resident", arm.find('@') != std::string::npos ? 50 : 100},
              {"prompt_tokens", 95}, {"generated_tokens", 5}, {"prefill_s", 0.5}, {"decode_s", 0.25}};
  if (i % 2 == 0) r.values["rss_growth_peak_bytes"] = 4096.0 * (1 + i);  // measured on even tasks only
  return r;
}

ResultRow text_row(const std::string& arm, double ppl, double kld) {
  ResultRow r;
  r.order = g_order++;
  r.kind = "text";
  r.arm = arm;
  r.task = "text";
  r.model = "m1";
  r.values = {{"ppl_single", ppl}, {"ppl_stream", ppl + 1}, {"kld_mean", kld}, {"kld_max", 2 * kld}, {"top1", 1 - kld}};
  return r;
}

/// 10 tasks per arm: t0..t3 needle at depths 5/35/65/95, t4..t9 summary.
/// control: 9 passed (t9 fails), peak 1024 B;  int4+full: 8 passed (t0, t9 fail), 256 B;
/// fp32+h2o@50%: 9 passed (t3 fails), 512 B;   int2+full: 5 passed, 128 B.
std::vector<ResultRow> rows() {
  g_order = 0;
  std::vector<ResultRow> out;
  const int depths[] = {5, 35, 65, 95};
  auto arm = [&](const std::string& name, std::vector<int> fails, double peak) {
    for (int i = 0; i < 10; ++i) {
      const bool pass = std::find(fails.begin(), fails.end(), i) == fails.end();
      out.push_back(i < 4 ? task_row(name, i, pass, peak, depths[i]) : task_row(name, i, pass, peak, -1, "summary"));
    }
  };
  arm("fp32+full", {9}, 1024);
  out.push_back(text_row("fp32+full", 10.0, 0.0));
  arm("int4+full", {0, 9}, 256);
  out.push_back(text_row("int4+full", 10.5, 0.02));
  arm("fp32+h2o@50%", {3}, 512);
  out.push_back(text_row("fp32+h2o@50%", 10.2, 0.05));
  arm("int2+full", {0, 1, 4, 5, 6}, 128);
  // int2 has no text row: its perplexity cells are missing
  ResultRow rec;
  rec.order = g_order++;
  rec.kind = "recon";
  rec.arm = "int4";
  rec.task = "recon";
  rec.model = "m1";
  rec.values = {{"bits_per_value", 4.5}, {"key_rel_err", 0.12}, {"value_rel_err", 0.08}, {"attn_out_rel_err", 0.05},
                {"attn_prob_rel_err", 0.03}};
  out.push_back(rec);
  for (int bits : {2, 4}) {
    ResultRow a;
    a.order = g_order++;
    a.kind = "attn";
    a.arm = "";
    a.task = "attn:kivi:b" + std::to_string(bits);
    a.granularity = "kivi";
    a.model = "m1";
    a.values = {{"out_rel_err", bits == 2 ? 0.3 : 0.05}, {"prob_rel_err", bits == 2 ? 0.2 : 0.03}, {"group", 32},
                {"bits", bits}};
    out.push_back(a);
  }
  return out;
}

const ArmSummary& arm(const Summary& s, const std::string& name) {
  for (const auto& a : s.arms) {
    if (a.arm == name) return a;
  }
  throw std::runtime_error("no arm " + name);
}

}  // namespace

TEST(StudyReport, PerArmNumbers) {
  const auto s = summarize(rows());
  EXPECT_EQ(s.model, "m1");
  ASSERT_TRUE(s.has_control);
  ASSERT_EQ(s.arms.size(), 4u);
  EXPECT_EQ(s.arms[0].arm, "fp32+full");  // plan order
  EXPECT_EQ(s.arms[3].arm, "int2+full");
  const auto& c = arm(s, "fp32+full");
  EXPECT_TRUE(c.is_control);
  EXPECT_EQ(c.passed, 9);
  EXPECT_DOUBLE_EQ(c.accuracy, 0.9);
  EXPECT_DOUBLE_EQ(c.peak_kib_mean, 1.0);
  EXPECT_DOUBLE_EQ(c.memory_ratio, 1.0);
  EXPECT_DOUBLE_EQ(c.reserved_kib_mean, 2.0);
  // RSS growth over the tasks that measured it: t0, t2, t4, t6, t8 → 4 KiB × (1+3+5+7+9)/5.
  EXPECT_DOUBLE_EQ(c.rss_growth_kib_mean, 4.0 * 5);
  const auto& q = arm(s, "int4+full");
  EXPECT_NEAR(q.delta_pp, -10.0, 1e-9);
  EXPECT_EQ(q.delta_tasks, -1);
  EXPECT_DOUBLE_EQ(q.memory_ratio, 0.25);
  EXPECT_DOUBLE_EQ(q.family_accuracy.at("needle"), 0.75);
  EXPECT_DOUBLE_EQ(q.family_accuracy.at("summary"), 5.0 / 6.0);
  EXPECT_DOUBLE_EQ(q.depth_accuracy.at(5), 0.0);
  EXPECT_DOUBLE_EQ(q.depth_accuracy.at(95), 1.0);
  EXPECT_DOUBLE_EQ(q.ppl_single, 10.5);
  EXPECT_DOUBLE_EQ(q.ppl_stream, 11.5);
  EXPECT_DOUBLE_EQ(q.kld_mean, 0.02);
  EXPECT_DOUBLE_EQ(q.prefill_tps, 190.0);  // 950 tokens / 5 s
  EXPECT_DOUBLE_EQ(q.decode_tps, 20.0);    // 50 tokens / 2.5 s
  EXPECT_DOUBLE_EQ(arm(s, "fp32+h2o@50%").tokens_resident_mean, 50.0);
  EXPECT_DOUBLE_EQ(arm(s, "fp32+h2o@50%").depth_accuracy.at(95), 0.0);
  EXPECT_TRUE(std::isnan(arm(s, "int2+full").ppl_stream));
  EXPECT_EQ(s.families, (std::vector<std::string>{"needle", "summary"}));
  EXPECT_EQ(s.depths, (std::vector<int>{5, 35, 65, 95}));
  ASSERT_EQ(s.reconstruction.size(), 1u);
  EXPECT_EQ(s.reconstruction[0].quant, "int4");
  ASSERT_EQ(s.attention.size(), 1u);
  EXPECT_EQ(s.attention[0].description, "per-channel K + per-token V (KIVI)");
  EXPECT_DOUBLE_EQ(s.attention[0].out_rel_err.at(2), 0.3);
}

TEST(StudyReport, RecommendationsFollowTheRules) {
  const auto s = summarize(rows());
  ASSERT_EQ(s.recommendations.size(), 5u);
  // R1: within one task of the control (>= 8 passed): int4 (0.25x) beats h2o (0.5x) and control.
  EXPECT_EQ(s.recommendations[0].arm, "int4+full");
  EXPECT_NE(s.recommendations[0].evidence.find("passed 8/10"), std::string::npos) << s.recommendations[0].evidence;
  // R2: best accuracy at <= 50% memory: h2o (90%) over int4 (80%) and int2 (50%).
  EXPECT_EQ(s.recommendations[1].arm, "fp32+h2o@50%");
  // R3: <= 25%: int4 (80%) over int2 (50%).
  EXPECT_EQ(s.recommendations[2].arm, "int4+full");
  // R4: lowest streaming perplexity at <= 50%: h2o 11.2 < int4 11.5 (int2 has none).
  EXPECT_EQ(s.recommendations[3].arm, "fp32+h2o@50%");
  // R5: fastest decode within one task: all 20 tok/s -> the first in plan order (the control).
  EXPECT_EQ(s.recommendations[4].arm, "fp32+full");
  // Without control rows nothing is recommended.
  std::vector<ResultRow> no_ctrl;
  for (const auto& r : rows()) {
    if (r.arm != "fp32+full") no_ctrl.push_back(r);
  }
  const auto n = summarize(no_ctrl);
  EXPECT_FALSE(n.has_control);
  for (const auto& r : n.recommendations) EXPECT_TRUE(r.arm.empty());
  EXPECT_FALSE(n.notes.empty());
}

TEST(StudyReport, ErrorRowsCountAsFailuresButNotAsMemory) {
  auto r = rows();
  for (int i = 0; i < 10; ++i) {
    auto e = task_row("kivi:k2:v2:g32:r128+full", i, false, 0);
    e.error = "cannot run on this model";
    e.values.clear();
    r.push_back(e);
  }
  auto half = task_row("int8+full", 0, false, 0);  // one error row, nine measured rows
  half.error = "budget too small";
  half.values.clear();
  r.push_back(half);
  for (int i = 1; i < 10; ++i) r.push_back(task_row("int8+full", i, true, 2048));
  const auto s = summarize(r);
  const auto& k = arm(s, "kivi:k2:v2:g32:r128+full");
  EXPECT_EQ(k.errors, 10);
  EXPECT_EQ(k.passed, 0);
  EXPECT_TRUE(std::isnan(k.peak_kib_mean));
  EXPECT_TRUE(std::isnan(k.memory_ratio));
  const auto& i8 = arm(s, "int8+full");
  EXPECT_EQ(i8.passed, 9);
  EXPECT_DOUBLE_EQ(i8.peak_kib_mean, 2.0);  // over the 9 measured rows, not 18/10
  for (const auto& rec : s.recommendations) EXPECT_NE(rec.arm, "kivi:k2:v2:g32:r128+full") << rec.rule;
  EXPECT_EQ(s.recommendations[0].arm, "int4+full");
  bool noted = false;
  for (const auto& n : s.notes) noted |= n.find("11 rows carry an error") != std::string::npos;
  EXPECT_TRUE(noted);
}

TEST(StudyReport, MarkdownJsonCsv) {
  const auto s = summarize(rows());
  const std::string md = summary_markdown(s);
  EXPECT_NE(md.find("| int4+full | 8/10 | 80.0% | -10.0 pp (-1) | 0.2 | 0.25 | 100.0 | 100.0 | 0 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| fp32+full | 9/10 | 90.0% | control | 1.0 | 1.00 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| arm | 5% | 35% | 65% | 95% |"), std::string::npos) << md;
  EXPECT_NE(md.find("| fp32+h2o@50% | 100.0% | 100.0% | 100.0% | 0.0% |"), std::string::npos) << md;
  EXPECT_NE(md.find("| int2+full | 50.0% | – | – | – | – | – |"), std::string::npos) << md;
  EXPECT_NE(md.find("| int4 | 4.50 | 0.1200 | 0.0800 | 0.0500 | 0.0300 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| per-channel K + per-token V (KIVI) | 0.3000 | 0.2000 | 0.0500 | 0.0300 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| int4+full | 190.0 | 20.0 | 0.000 | 7.5 |"), std::string::npos) << md;  // no replay: 0 s
  EXPECT_NE(md.find("`int4+full`"), std::string::npos);
  // Stored 0.25 KiB, reserved 0.5 KiB (2×), RSS growth 20 KiB (the measured tasks' mean).
  EXPECT_NE(md.find("| arm | stored peak KiB | reserved peak KiB | RSS growth peak KiB | reserved / stored |"),
            std::string::npos) << md;
  EXPECT_NE(md.find("| int4+full | 0.2 | 0.5 | 20.0 | 2.00 |"), std::string::npos) << md;

  const auto j = nlohmann::json::parse(summary_json(s));
  EXPECT_EQ(j["arms"].size(), 4u);
  EXPECT_EQ(j["arms"][1]["arm"], "int4+full");
  EXPECT_DOUBLE_EQ(j["arms"][1]["memory_ratio"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(j["arms"][1]["reserved_kib_mean"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(j["arms"][1]["rss_growth_kib_mean"].get<double>(), 20.0);
  EXPECT_DOUBLE_EQ(j["arms"][1]["depth_accuracy"]["95"].get<double>(), 1.0);
  EXPECT_TRUE(j["arms"][3]["ppl_stream"].is_null());
  EXPECT_EQ(j["recommendations"][0]["arm"], "int4+full");
  EXPECT_DOUBLE_EQ(j["attention"][0]["bits"]["2"]["out_rel_err"].get<double>(), 0.3);
  EXPECT_DOUBLE_EQ(j["reconstruction"][0]["attn_out_rel_err"].get<double>(), 0.05);
  EXPECT_DOUBLE_EQ(j["reconstruction"][0]["attn_prob_rel_err"].get<double>(), 0.03);

  const std::string csv = summary_csv(s);
  std::istringstream in(csv);
  std::string header, first, second;
  std::getline(in, header);
  std::getline(in, first);
  std::getline(in, second);
  EXPECT_EQ(header.rfind("arm,is_control,tasks,passed,errors,accuracy,delta_pp,delta_tasks,peak_kib_mean", 0), 0u);
  EXPECT_NE(header.find(",acc_needle,acc_summary,needle_d5,needle_d35,needle_d65,needle_d95"), std::string::npos) << header;
  EXPECT_EQ(second.rfind("int4+full,0,10,8,0,0.8,-10,-1,0.25,0.25,0.25,0.5,20,", 0), 0u) << second;
}

TEST(StudyReport, MarkdownEscapesArmNamesButJsonAndCsvKeepThem) {
  // A per-layer arm's '*' would start emphasis in Markdown; '_' and '|' too.
  g_order = 0;
  std::vector<ResultRow> r;
  for (int i = 0; i < 2; ++i) r.push_back(task_row("fp32+full", i, true, 1024));
  for (int i = 0; i < 2; ++i) r.push_back(task_row("layers(int8*2;int4*2)+full", i, i == 0, 512));
  const auto s = summarize(r);
  const std::string md = summary_markdown(s);
  EXPECT_NE(md.find("| layers(int8\\*2;int4\\*2)+full | 1/2 | 50.0% |"), std::string::npos) << md;
  EXPECT_EQ(md.find("| layers(int8*2"), std::string::npos) << md;
  EXPECT_NE(md.find("| fp32+full | 2/2 | 100.0% | control |"), std::string::npos) << md;
  const auto j = nlohmann::json::parse(summary_json(s));
  EXPECT_EQ(j["arms"][1]["arm"], "layers(int8*2;int4*2)+full");
  EXPECT_NE(summary_csv(s).find("\nlayers(int8*2;int4*2)+full,0,2,1,"), std::string::npos) << summary_csv(s);
}

TEST(StudyReport, ModelSelectionAndWrite) {
  auto r = rows();
  auto other = r[0];
  other.model = "m2";
  r.push_back(other);
  EXPECT_THROW(summarize(r), InvalidArgument);
  EXPECT_EQ(summarize(r, "m2").arms.size(), 1u);
  EXPECT_THROW(summarize(r, "m3"), InvalidArgument);
  EXPECT_EQ(models_in(r), (std::vector<std::string>{"m1", "m2"}));
  const std::string dir = ::testing::TempDir() + "/study_report_out";
  write_summary_files(summarize(r, "m1"), dir);
  for (const char* f : {"/summary.md", "/summary.json", "/summary.csv"}) {
    EXPECT_TRUE(std::ifstream(dir + f).good()) << f;
  }
}

// ---- query modes: the two lists are kept apart ----

TEST(StudyReportQueryModes, AgnosticRowsAreSummarizedApartAndTheAwareTablesAreUnchanged) {
  std::vector<ResultRow> base = rows();
  const Summary plain = summarize(base);
  // Agnostic rows of the control and of h2o: the control passes all 4 needle tasks, h2o only
  // t0 (in aware mode h2o failed only t3).
  std::vector<ResultRow> all = base;
  for (int i = 0; i < 4; ++i) {
    ResultRow c = task_row("fp32+full", i, true, 1024, 5 + 30 * i);
    c.query_mode = "agnostic";
    all.push_back(c);
    ResultRow h = task_row("fp32+h2o@50%", i, i == 0, 600, 5 + 30 * i);
    h.query_mode = "agnostic";
    all.push_back(h);
  }
  const Summary s = summarize(all);
  // The aware summary: exactly the one without agnostic rows.
  EXPECT_EQ(summary_markdown(s).rfind(summary_markdown(plain).substr(0, summary_markdown(plain).find("\n## Recommendations")), 0), 0u);
  ASSERT_EQ(s.arms.size(), plain.arms.size());
  for (size_t i = 0; i < s.arms.size(); ++i) {
    EXPECT_EQ(s.arms[i].passed, plain.arms[i].passed);
    EXPECT_EQ(s.arms[i].query_mode, "aware");
  }
  ASSERT_TRUE(s.agnostic);
  const Summary& g = *s.agnostic;
  ASSERT_EQ(g.arms.size(), 2u);
  EXPECT_EQ(g.arms[0].arm, "fp32+full");
  EXPECT_EQ(g.arms[0].query_mode, "agnostic");
  EXPECT_TRUE(g.arms[0].is_control);
  EXPECT_EQ(g.arms[0].passed, 4);
  EXPECT_EQ(g.arms[1].passed, 1);
  EXPECT_EQ(g.arms[1].delta_tasks, -3);  // against the control's agnostic rows
  EXPECT_NEAR(g.arms[1].accuracy, 0.25, 1e-12);
  EXPECT_NEAR(g.arms[1].peak_kib_mean, 600.0 / 1024.0, 1e-12);
  EXPECT_NEAR(g.arms[1].ppl_single, 10.2, 1e-12);  // the arm's (mode-free) text row
  EXPECT_TRUE(g.recommendations.empty());
  EXPECT_EQ(s.recommendations.size(), plain.recommendations.size());

  const std::string md = summary_markdown(s);
  EXPECT_NE(md.find("\n## Query-agnostic mode\n"), std::string::npos) << md;
  EXPECT_NE(md.find("\n## Query-agnostic: Accuracy and KV memory per arm\n"), std::string::npos);
  EXPECT_NE(md.find("| fp32+h2o@50% | 90.0% | 25.0% | – |"), std::string::npos) << md;  // 10 vs 4 tasks
  EXPECT_EQ(summary_markdown(plain).find("Query-agnostic"), std::string::npos);

  const auto j = nlohmann::json::parse(summary_json(s));
  EXPECT_EQ(j["arms"].size(), plain.arms.size());
  EXPECT_EQ(j["arms"][0]["query_mode"], "aware");
  ASSERT_TRUE(j.contains("agnostic"));
  EXPECT_EQ(j["agnostic"]["arms"].size(), 2u);
  EXPECT_EQ(j["agnostic"]["arms"][1]["arm"], "fp32+h2o@50%");
  EXPECT_EQ(j["agnostic"]["arms"][1]["query_mode"], "agnostic");
  EXPECT_EQ(j["agnostic"]["arms"][1]["passed"], 1);
  EXPECT_FALSE(nlohmann::json::parse(summary_json(plain)).contains("agnostic"));

  // CSV: one line per (arm, mode), the mode in its own column.
  std::istringstream in(summary_csv(s));
  std::string header, line;
  std::getline(in, header);
  std::vector<std::string> lines;
  while (std::getline(in, line)) lines.push_back(line);
  ASSERT_EQ(lines.size(), plain.arms.size() + 2);
  EXPECT_NE(header.find(",query_mode,"), std::string::npos) << header;
  EXPECT_EQ(lines[plain.arms.size() + 1].rfind("fp32+h2o@50%,0,4,1,0,0.25,-75,-3,", 0), 0u) << lines.back();
  EXPECT_NE(lines[plain.arms.size() + 1].find(",agnostic,"), std::string::npos) << lines.back();
  EXPECT_NE(lines[0].find(",aware,"), std::string::npos) << lines[0];
}

TEST(StudyReportQueryModes, SameTaskListsCompareAwareAndAgnosticInPp) {
  g_order = 0;
  std::vector<ResultRow> all;
  for (int i = 0; i < 4; ++i) {
    all.push_back(task_row("fp32+full", i, true, 1024, 5));
    all.push_back(task_row("fp32+snapkv@50%", i, i != 3, 512, 5));  // aware: 3/4
  }
  for (int i = 0; i < 4; ++i) {
    for (const char* arm : {"fp32+full", "fp32+snapkv@50%"}) {
      ResultRow r = task_row(arm, i, std::string(arm) == "fp32+full" || i == 0, 512, 5);  // agnostic snapkv: 1/4
      r.query_mode = "agnostic";
      all.push_back(r);
    }
  }
  const Summary s = summarize(all);
  const std::string md = summary_markdown(s);
  EXPECT_NE(md.find("| fp32+snapkv@50% | 75.0% | 25.0% | -50.0 pp (-2) |"), std::string::npos) << md;
  EXPECT_NE(md.find("| fp32+full | 100.0% | 100.0% | +0.0 pp (+0) |"), std::string::npos) << md;
}

TEST(StudyReportQueryModes, RowJsonReadsAwareAsTheDefaultAndRefusesOtherModes) {
  ResultRow r = task_row("fp32+full", 1, true, 10);
  EXPECT_EQ(row_to_json(r).find("query_mode"), std::string::npos);
  r.query_mode = "agnostic";
  EXPECT_NE(row_to_json(r).find("\"query_mode\":\"agnostic\""), std::string::npos);
  std::string line = row_to_json(r);
  const auto at = line.find("\"agnostic\"");
  const std::string aware_line = line.substr(0, at) + "\"aware\"" + line.substr(at + 10);
  EXPECT_EQ(row_from_json(aware_line).query_mode, "");
  const std::string bad = line.substr(0, at) + "\"blind\"" + line.substr(at + 10);
  try {
    row_from_json(bad);
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("query_mode 'blind' of a task row"), std::string::npos) << e.what();
  }
}
