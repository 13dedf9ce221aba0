// SPDX-License-Identifier: Apache-2.0
// The sweep driver over a fake evaluator: plan order, resume after a kill (incl. a partial
// line) reproducing the uninterrupted file, shards + merge, error rows, canonical arms, text rows.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <map>
#include <fstream>
#include <sstream>

#include "kvcache/study/progress.h"
#include "kvcache/study/sweep.h"
#include "kvcache/study/task_suite.h"
#include "study/fake_evaluator.h"

using namespace kvcache;
using namespace kvcache::study;
using kvcache::study::testing::FakeEvaluator;
using kvcache::study::testing::Killed;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string tmp(const std::string& name) {
  const std::string p = ::testing::TempDir() + "/study_sweep_" + name;
  std::remove(p.c_str());
  return p;
}

SweepOptions options() {
  SweepOptions o;
  o.arms = {parse_arm("fp32+full"), parse_arm("int4"), parse_arm("fp8:e4m3+h2o@50%")};
  o.tasks = generate_suite("small", 42);
  return o;
}

std::string run_to(const std::string& path, const SweepOptions& o, FakeEvaluator& ev) {
  ResultsStore store(path);
  run_sweep(ev, o, store);
  return slurp(path);
}

}  // namespace

TEST(StudySweep, PlanOrder) {
  auto o = options();
  std::vector<Arm> arms = {{"fp32", "full"}, {"int4", "full"}, {"fp32", "h2o@50%"}};
  auto plan = plan_sweep(arms, o.tasks, o);
  ASSERT_EQ(plan.size(), 8u + 2u + 3u * (20u + 1u));
  EXPECT_EQ(plan[0].row_task, "attn:tok-kv:b2");
  EXPECT_EQ(plan[1].row_task, "attn:tok-kv:b4");
  EXPECT_EQ(plan[5].row_task, "attn:kivi:b4");
  EXPECT_EQ(plan[8].row_arm, "fp32");  // distinct quant specs, arm order
  EXPECT_EQ(plan[9].row_arm, "int4");
  EXPECT_EQ(plan[10].row_arm, "fp32+full");
  EXPECT_EQ(plan[10].row_task, o.tasks[0].id);
  EXPECT_EQ(plan[30].row_task, "text");
  EXPECT_EQ(plan[31].row_arm, "int4+full");
  for (size_t i = 0; i < plan.size(); ++i) EXPECT_EQ(plan[i].order, static_cast<int64_t>(i));
  o.attention = false;
  o.reconstruction = false;
  o.text = false;
  EXPECT_EQ(plan_sweep(arms, o.tasks, o).size(), 60u);
}

TEST(StudySweep, KilledRunResumesToTheSameFile) {
  const auto o = options();
  FakeEvaluator ev_full;
  const std::string full = run_to(tmp("full.jsonl"), o, ev_full);
  ASSERT_FALSE(full.empty());
  EXPECT_EQ(std::count(full.begin(), full.end(), '\n'), 8 + 3 + 3 * 21);

  const std::string path = tmp("killed.jsonl");
  {
    FakeEvaluator ev;
    ev.kill_after = 30;
    ResultsStore store(path);
    EXPECT_THROW(run_sweep(ev, o, store), Killed);
  }
  const std::string partial_file = slurp(path);
  EXPECT_EQ(full.compare(0, partial_file.size(), partial_file), 0);  // a prefix of the full file
  // A crash in the middle of the next row's write leaves a partial line.
  const std::string torn = "{\"arm\":\"int4+full\",\"kind\":\"ta";
  {
    std::ofstream out(path, std::ios::binary | std::ios::app);
    out << torn;
  }
  FakeEvaluator ev2;
  {
    ResultsStore store(path);
    EXPECT_EQ(store.repaired_bytes(), static_cast<int64_t>(torn.size()));
    auto st = run_sweep(ev2, o, store);
    EXPECT_EQ(st.skipped, 8 + 30);  // attention rows + 30 served items
    EXPECT_EQ(st.executed, st.owned - st.skipped);
  }
  EXPECT_EQ(slurp(path), full);
  // A third run has nothing left to do.
  FakeEvaluator ev3;
  ResultsStore store(path);
  auto st = run_sweep(ev3, o, store);
  EXPECT_EQ(st.executed, 0);
  EXPECT_EQ(ev3.served, 0);
}

TEST(StudySweep, ShardsMergeToTheUnshardedFile) {
  const auto o = options();
  FakeEvaluator ev_full;
  const std::string full = run_to(tmp("unsharded.jsonl"), o, ev_full);
  std::vector<std::string> parts;
  int64_t owned = 0;
  for (int i = 0; i < 3; ++i) {
    auto os = o;
    os.shard = Shard::parse(std::to_string(i) + "/3");
    FakeEvaluator ev;
    parts.push_back(tmp("shard" + std::to_string(i) + ".jsonl"));
    ResultsStore store(parts.back());
    owned += run_sweep(ev, os, store).owned;
  }
  EXPECT_EQ(owned, 8 + 3 + 3 * 21);
  const std::string merged = tmp("merged.jsonl");
  // Inputs in any order, one of them twice: duplicates are dropped.
  auto st = merge_result_files({parts[2], parts[0], parts[1], parts[0]}, merged);
  EXPECT_EQ(slurp(merged), full);
  EXPECT_EQ(st.rows_out, owned);
  EXPECT_GT(st.duplicates, 0);
  EXPECT_EQ(st.conflicts, 0);
}

TEST(StudySweep, RowsCarryCanonicalArmsScoresAndMetrics) {
  auto o = options();
  o.arms.push_back(parse_arm("fp8+h2o@50%"));  // same as fp8:e4m3+h2o@50% once canonical
  FakeEvaluator ev;
  const std::string path = tmp("rows.jsonl");
  ResultsStore store(path);
  auto st = run_sweep(ev, o, store);
  EXPECT_EQ(st.planned, 8 + 3 + 3 * 21);
  EXPECT_EQ(st.errors, 0);
  int task_rows = 0;
  for (const auto& r : store.rows()) {
    EXPECT_EQ(r.model, "fake-model@0001");
    if (r.kind == "task") {
      ++task_rows;
      EXPECT_TRUE(r.arm == "fp32+full" || r.arm == "int4+full" || r.arm == "fp8+h2o@50%") << r.arm;
      EXPECT_FALSE(r.family.empty());
      EXPECT_EQ(r.passed, r.output != "I do not know.");
      EXPECT_GT(r.value("peak_bytes"), 0);
      EXPECT_EQ(r.value("generated_tokens"), 5);
    } else if (r.kind == "text") {
      if (r.arm == "fp32+full") {
        EXPECT_EQ(r.value("kld_mean"), 0);
        EXPECT_EQ(r.value("top1"), 1);
        EXPECT_NEAR(r.value("ppl_single"), std::exp(2.0), 1e-9);
        EXPECT_NEAR(r.value("ppl_stream"), std::exp(2.1), 1e-9);
      } else {
        EXPECT_GT(r.value("kld_mean"), 0);
      }
    } else if (r.kind == "recon") {
      if (r.arm == "int4") {
        EXPECT_EQ(r.value("key_rel_err"), 0.1);
      }
    } else {
      EXPECT_EQ(r.kind, "attn");
      EXPECT_GT(r.value("out_rel_err"), 0);
      EXPECT_EQ(r.value("group"), 32);
    }
  }
  EXPECT_EQ(task_rows, 60);
  EXPECT_EQ(ev.text_calls, 3);  // the control's text eval is reused for KLD
}

TEST(StudySweep, UserErrorsBecomeRowsOtherErrorsAbort) {
  auto o = options();
  FakeEvaluator ev;
  ev.capacity_error_quant = "int4";
  ResultsStore store(tmp("errors.jsonl"));
  auto st = run_sweep(ev, o, store);
  EXPECT_EQ(st.errors, 20);
  for (const auto& r : store.rows()) {
    if (r.kind == "task" && r.arm == "int4+full") {
      EXPECT_FALSE(r.passed);
      EXPECT_NE(r.error.find("budget too small"), std::string::npos);
    }
  }
  // An arm the model cannot run: its rows record why, the other arms run.
  auto unsup = options();
  unsup.arms.push_back(parse_arm("kivi:k2:v2:g64:r128"));
  FakeEvaluator ev_u;
  ResultsStore store_u(tmp("unsupported.jsonl"));
  auto su = run_sweep(ev_u, unsup, store_u);
  EXPECT_EQ(su.errors, 21);  // 20 task rows + its text row (its recon row reaches the fake, which accepts it)
  int unsupported_rows = 0;
  for (const auto& r : store_u.rows()) {
    if (r.arm == "kivi:k2:v2:g64:r128+full") {
      ++unsupported_rows;
      EXPECT_NE(r.error.find("cannot run on this model: g64 does not divide head_dim 32"), std::string::npos) << r.error;
    }
  }
  EXPECT_EQ(unsupported_rows, 21);
  auto bad = options();
  bad.arms.push_back(parse_arm("bogus"));
  FakeEvaluator ev2;
  ResultsStore store2(tmp("bogus.jsonl"));
  EXPECT_THROW(run_sweep(ev2, bad, store2), InvalidArgument);
  EXPECT_EQ(ev2.served, 0);  // nothing ran
  auto dup = options();
  dup.tasks.push_back(dup.tasks[0]);
  EXPECT_THROW(run_sweep(ev2, dup, store2), InvalidArgument);
}

// What run_sweep would reject is rejected by validate_sweep, before a results file exists.
TEST(StudySweep, ValidateSweepRejectsBadInputsUpFront) {
  FakeEvaluator ev;
  auto message = [&](const std::function<void(SweepOptions&)>& edit) {
    SweepOptions o = options();
    edit(o);
    try {
      validate_sweep(ev, o);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("valid");
  };
  EXPECT_EQ(message([](SweepOptions&) {}), "valid");
  EXPECT_EQ(message([](SweepOptions& o) { o.arms.push_back(parse_arm("kivi:k2:v2:g64:r128")); }), "valid");
  EXPECT_EQ(message([](SweepOptions& o) { o.arms.push_back(parse_arm("bogus+full")); }), "unknown quantizer 'bogus'");
  EXPECT_EQ(message([](SweepOptions& o) { o.control = parse_arm("bogus+full"); }), "unknown quantizer 'bogus'");
  EXPECT_EQ(message([](SweepOptions& o) { o.tasks.clear(); }), "the sweep has no task (an empty task file or suite)");
  EXPECT_EQ(message([](SweepOptions& o) { o.arms.clear(); }), "the sweep has no arm");
  EXPECT_EQ(message([](SweepOptions& o) { o.tasks.push_back(o.tasks[0]); }),
            "task id '" + options().tasks[0].id + "' appears twice in the task list");
  EXPECT_EQ(message([](SweepOptions& o) { o.attention_bits = {2, 0}; }),
            "attention-error bit width 0 is out of range [1, 16]");
  EXPECT_EQ(message([](SweepOptions& o) { o.attention_group = 99999999999; }),
            "attention-error group 99999999999 is out of range [1, 65536]");
  EXPECT_EQ(ev.served, 0);  // nothing ran
  // run_sweep rejects the same before writing a row.
  const std::string path = tmp("rejected.jsonl");
  SweepOptions o = options();
  o.arms.push_back(parse_arm("bogus+full"));
  {
    ResultsStore store(path);
    EXPECT_THROW(run_sweep(ev, o, store), InvalidArgument);
  }
  EXPECT_EQ(slurp(path), "");
}

TEST(StudyProgress, LogLinesWithRateAndEta) {
  double now = 0;
  std::ostringstream out;
  Progress p(out, /*interactive=*/false, 10, [&] { return now; }, 30.0);
  p.skipped(2);
  now = 10;
  p.done("a");  // 1 executed in 10 s: 7 left -> 70 s
  EXPECT_NE(p.status().find("3/10"), std::string::npos) << p.status();
  EXPECT_NE(p.status().find("0.10 it/s"), std::string::npos) << p.status();
  EXPECT_NE(p.status().find("ETA 1m10s"), std::string::npos) << p.status();
  now = 40;
  p.done("b");  // 40 s after the last line: printed
  for (int i = 0; i < 6; ++i) p.done("c");  // within 30 s, but the last one completes: printed
  p.finish();
  const std::string log = out.str();
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), 3) << log;  // skip line, "b", completion
  EXPECT_NE(log.find("4/10"), std::string::npos) << log;
  EXPECT_EQ(log.find("3/10"), std::string::npos) << log;
  EXPECT_NE(log.find("10/10 100%"), std::string::npos) << log;
  EXPECT_EQ(log.find('\r'), std::string::npos);
  EXPECT_EQ(format_duration(3725), "1h02m");
  EXPECT_EQ(format_duration(59.4), "59s");
}

TEST(StudyProgress, InteractiveRedrawsOneLine) {
  double now = 0;
  std::ostringstream out;
  Progress p(out, /*interactive=*/true, 2, [&] { return now; });
  now = 1;
  p.done("x");
  now = 2;
  p.done("y");
  p.finish();
  const std::string s = out.str();
  EXPECT_EQ(s.front(), '\r');
  EXPECT_EQ(std::count(s.begin(), s.end(), '\n'), 1);
  EXPECT_NE(s.find("2/2"), std::string::npos);
}

// ---- query modes ----

TEST(StudySweepQueryModes, BothModesPlanAwareThenAgnosticPerArm) {
  auto o = options();
  o.attention = false;
  o.reconstruction = false;
  const std::vector<Arm> arms = {{"fp32", "full"}, {"fp32", "h2o@50%"}};
  const auto aware = plan_sweep(arms, o.tasks, o);
  o.query_modes = {QueryMode::kAgnostic, QueryMode::kAware};  // run order is aware first anyway
  const auto both = plan_sweep(arms, o.tasks, o);
  ASSERT_EQ(aware.size(), 2u * (20u + 1u));
  ASSERT_EQ(both.size(), 2u * (40u + 1u));
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_EQ(both[i].mode, QueryMode::kAware);
    EXPECT_EQ(both[20 + i].mode, QueryMode::kAgnostic);
    EXPECT_EQ(both[20 + i].row_task, o.tasks[i].id);
  }
  EXPECT_EQ(both[40].kind, ItemKind::kText);
  EXPECT_EQ(both[41].row_arm, "fp32+h2o@50%");
  // The default plan is the one before query modes existed: every task item aware.
  for (const auto& w : aware) EXPECT_EQ(w.mode, QueryMode::kAware);
  EXPECT_EQ(aware[21].row_arm, "fp32+h2o@50%");
}

TEST(StudySweepQueryModes, AgnosticRowsCarryTheModeInRowAndKeyAwareRowsResumeOldFiles) {
  const std::string path = tmp("qmode.jsonl");
  auto o = options();
  o.attention = false;
  o.reconstruction = false;
  o.text = false;
  FakeEvaluator ev;
  const std::string aware_only = run_to(path, o, ev);
  // An aware run's rows have no query_mode field (as before query modes existed).
  EXPECT_EQ(aware_only.find("query_mode"), std::string::npos);
  // Rerun with both modes on that file: the aware rows are kept (same keys), only the
  // agnostic rows run.
  o.query_modes = {QueryMode::kAware, QueryMode::kAgnostic};
  FakeEvaluator ev2;
  ResultsStore store(path);
  const SweepStats st = run_sweep(ev2, o, store);
  EXPECT_EQ(st.planned, 3 * 40);
  EXPECT_EQ(st.skipped, 3 * 20);
  EXPECT_EQ(st.executed, 3 * 20);
  int64_t agnostic = 0;
  for (const auto& r : store.rows()) {
    if (r.query_mode.empty()) continue;
    ++agnostic;
    EXPECT_EQ(r.query_mode, "agnostic");
    EXPECT_EQ(r.key(), r.arm + "\t" + r.task + "\t" + r.model + "\tagnostic");
    // The fake feeds 3 question tokens where the task has a question (not the summary family).
    EXPECT_EQ(r.value("question_tokens"), r.family == "summary" ? 0.0 : 3.0) << r.task;
    const auto back = row_from_json(row_to_json(r));
    EXPECT_EQ(back.query_mode, "agnostic");
    EXPECT_EQ(back.key(), r.key());
  }
  EXPECT_EQ(agnostic, 3 * 20);
  // The agnostic rows differ from the aware ones where the fake's hash says so: same task,
  // same arm, two rows.
  std::map<std::string, int> per_arm_task;
  for (const auto& r : store.rows()) per_arm_task[r.arm + "|" + r.task]++;
  for (const auto& [k, n] : per_arm_task) EXPECT_EQ(n, 2) << k;
  // A third run with both modes finds everything done.
  FakeEvaluator ev3;
  const SweepStats again = run_sweep(ev3, o, store);
  EXPECT_EQ(again.executed, 0);
  EXPECT_EQ(again.skipped, 3 * 40);
}

TEST(StudySweepQueryModes, BadModesAreRefusedNamingTheValue) {
  EXPECT_EQ(parse_query_modes("aware"), std::vector<QueryMode>{QueryMode::kAware});
  EXPECT_EQ(parse_query_modes("agnostic"), std::vector<QueryMode>{QueryMode::kAgnostic});
  EXPECT_EQ(parse_query_modes("both"), (std::vector<QueryMode>{QueryMode::kAware, QueryMode::kAgnostic}));
  try {
    parse_query_modes("agnositc");
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "query mode 'agnositc' is none of aware, agnostic, both");
  }
  EXPECT_THROW(parse_query_modes("Aware"), InvalidArgument);
  EXPECT_THROW(parse_query_modes(""), InvalidArgument);
  FakeEvaluator ev;
  auto o = options();
  o.query_modes = {};
  EXPECT_THROW(validate_sweep(ev, o), InvalidArgument);
  o.query_modes = {QueryMode::kAgnostic, QueryMode::kAgnostic};
  EXPECT_THROW(validate_sweep(ev, o), InvalidArgument);
}
