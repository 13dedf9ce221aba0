// SPDX-License-Identifier: Apache-2.0
// results.jsonl: row serialization, crash repair, locking, shards, merge.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "kvcache/error.h"
#include "kvcache/study/results.h"

using namespace kvcache;
using namespace kvcache::study;

namespace {
std::string tmp(const std::string& name) {
  const std::string p = ::testing::TempDir() + "/study_results_" + name;
  std::remove(p.c_str());
  return p;
}
std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
ResultRow row(int64_t order, const std::string& arm, const std::string& task) {
  ResultRow r;
  r.order = order;
  r.kind = "task";
  r.arm = arm;
  r.task = task;
  r.model = "m";
  r.family = "needle";
  r.depth_pct = 35;
  r.context_target = 512;
  r.passed = true;
  r.output = "48213\n\"quoted\"";
  r.values = {{"peak_bytes", 1024}, {"prefill_s", 0.125}, {"nan", NAN}};
  return r;
}
}  // namespace

TEST(StudyResults, RowJsonRoundTripIsStable) {
  const auto r = row(3, "int4+full", "t1");
  const std::string j = row_to_json(r);
  EXPECT_EQ(j.find('\n'), std::string::npos);
  EXPECT_EQ(j.find("nan"), std::string::npos);  // non-finite values are dropped
  const auto back = row_from_json(j);
  EXPECT_EQ(row_to_json(back), j);
  EXPECT_EQ(back.output, r.output);
  EXPECT_EQ(back.value("peak_bytes"), 1024);
  EXPECT_TRUE(std::isnan(back.value("nan")));
  EXPECT_EQ(back.key(), "int4+full\tt1\tm");
  EXPECT_THROW(row_from_json("{\"order\":1}"), InvalidArgument);
  EXPECT_THROW(row_from_json("[1,2]"), InvalidArgument);
}

TEST(StudyResults, StoreAppendsReopensAndRepairsPartialLine) {
  const std::string path = tmp("store.jsonl");
  {
    ResultsStore s(path);
    s.append(row(0, "a", "t0"));
    s.append(row(1, "a", "t1"));
    EXPECT_THROW(s.append(row(5, "a", "t1")), InvalidArgument);  // key already present
  }
  const std::string good = slurp(path);
  EXPECT_EQ(std::count(good.begin(), good.end(), '\n'), 2);
  const std::string torn = "{\"order\":2,\"kind\":\"task\",\"ar";
  {
    std::ofstream out(path, std::ios::app | std::ios::binary);
    out << torn;
  }
  {
    ResultsStore s(path);
    EXPECT_EQ(s.repaired_bytes(), static_cast<int64_t>(torn.size()));
    ASSERT_EQ(s.rows().size(), 2u);
    EXPECT_TRUE(s.contains(row(0, "a", "t0").key()));
    EXPECT_FALSE(s.contains(row(0, "a", "t2").key()));
  }
  EXPECT_EQ(slurp(path), good);  // truncated back to the complete rows
  int64_t partial = 0;
  {
    std::ofstream out(path, std::ios::app | std::ios::binary);
    out << "{\"par";
  }
  EXPECT_EQ(read_results(path, &partial).size(), 2u);  // readers skip it without writing
  EXPECT_EQ(partial, 1);
}

TEST(StudyResults, CorruptCompleteLineIsAnErrorNotSilentlyDropped) {
  const std::string path = tmp("corrupt.jsonl");
  {
    std::ofstream out(path, std::ios::binary);
    out << row_to_json(row(0, "a", "t0")) << "\n" << "garbage\n";
  }
  try {
    ResultsStore s(path);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(":2:"), std::string::npos) << e.what();
  }
}

TEST(StudyResults, SecondWriterIsLockedOut) {
  const std::string path = tmp("locked.jsonl");
  ResultsStore a(path);
  EXPECT_THROW(ResultsStore b(path), InvalidArgument);
}

TEST(StudyResults, ShardParseAndOwnership) {
  auto s = Shard::parse("1/3");
  EXPECT_EQ(s.index, 1);
  EXPECT_EQ(s.count, 3);
  EXPECT_TRUE(s.owns(4));
  EXPECT_FALSE(s.owns(5));
  EXPECT_EQ(s.to_string(), "1/3");
  for (const char* bad : {"3/3", "-1/3", "1/0", "1", "a/b", "1/3x", "", " 1/3", "+1/3", "1/ 3", "1/3 "}) {
    EXPECT_THROW(Shard::parse(bad), InvalidArgument) << bad;
  }
}

// Every part of i/n is range-checked with the text the user wrote: values beyond int64 too.
TEST(StudyResults, ShardErrorsNameThePartAndItsRange) {
  auto message = [](const std::string& text) {
    try {
      (void)Shard::parse(text);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message("3/2"), "shard '3/2': i = 3 is out of range [0, 1] (shards are 0-based, like "
                            "SLURM_ARRAY_TASK_ID with --array=0-(n-1))");
  EXPECT_EQ(message("0/0"), "shard '0/0': n = 0 is out of range [1, 1000000]");
  EXPECT_EQ(message("99999999999999999999/2"), "shard '99999999999999999999/2': i = 99999999999999999999 is out of "
                                               "range [0, 1000000]");
  EXPECT_EQ(message("0/2000000"), "shard '0/2000000': n = 2000000 is out of range [1, 1000000]");
  EXPECT_EQ(message("+1/2"), "shard '+1/2': i = '+1' is not an integer (expected one in [0, 1000000])");
  EXPECT_EQ(Shard::parse("999999/1000000").index, 999999);
}

// A row with a mistyped or out-of-range field is an error naming the field and its value.
TEST(StudyResults, BadRowFieldsAreNamed) {
  auto message = [](const std::string& line) {
    try {
      (void)row_from_json(line);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("valid");
  };
  const std::string head = R"({"kind":"task","arm":"a","task":"t","model":"m")";
  EXPECT_EQ(message(head + R"(,"order":0})"), "valid");
  EXPECT_EQ(message(head + "}"), "result row: missing field 'order'");
  EXPECT_EQ(message(head + R"(,"order":"zero"})"), "result row: field 'order' = \"zero\" is not an integer");
  EXPECT_EQ(message(head + R"(,"order":99999999999999999999})"),
            "result row: field 'order' = 1e+20 is out of range [0, 9223372036854775807]");
  EXPECT_EQ(message(head + R"(,"order":-1})"), "result row: field 'order' = -1 is out of range [0, 9223372036854775807]");
  EXPECT_EQ(message(head + R"(,"order":0,"passed":"yes"})"), "result row: field 'passed' = \"yes\" is not true or false");
  EXPECT_EQ(message(head + R"(,"order":0,"values":{"x":"str"}})"), "result row: values['x'] = \"str\" is not a number");
  EXPECT_EQ(message(R"({"order":0,"kind":"task","arm":7,"task":"t","model":"m"})"),
            "result row: field 'arm' = 7 is not a string");
}

TEST(StudyResults, MergeDedupesAndSortsByPlanOrder) {
  auto r0 = row(0, "a", "t0");
  auto r1 = row(1, "a", "t1");
  auto r2 = row(2, "b", "t0");
  auto r1b = r1;
  r1b.passed = false;  // same key, different content
  MergeStats st;
  auto out = merge_rows({{r2, r0}, {r1, r0}, {r1b}}, &st);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].task, "t0");
  EXPECT_EQ(out[1].task, "t1");
  EXPECT_TRUE(out[1].passed);  // the first seen wins
  EXPECT_EQ(out[2].arm, "b");
  EXPECT_EQ(st.rows_in, 5);
  EXPECT_EQ(st.duplicates, 1);
  EXPECT_EQ(st.conflicts, 1);
  const std::string a = tmp("m_a.jsonl");
  const std::string b = tmp("m_b.jsonl");
  write_results(a, {r2});
  write_results(b, {r0, r1});
  const std::string m = tmp("m_out.jsonl");
  merge_result_files({a, b}, m);
  EXPECT_EQ(slurp(m), row_to_json(r0) + "\n" + row_to_json(r1) + "\n" + row_to_json(r2) + "\n");
}

TEST(StudyResults, AgnosticRowsAreKeyedApartFromAwareRowsOfTheSameTask) {
  // One aware and one agnostic row of the same (arm, task, model) are two keys; the aware key is
  // the one of a row written before query modes existed, so old files resume.
  const std::string path = tmp("qmode.jsonl");
  ResultRow aware = row(0, "fp32+snapkv@50%", "t1");
  ResultRow agnostic = row(1, "fp32+snapkv@50%", "t1");
  agnostic.query_mode = "agnostic";
  EXPECT_EQ(aware.key(), "fp32+snapkv@50%\tt1\tm");
  EXPECT_EQ(agnostic.key(), "fp32+snapkv@50%\tt1\tm\tagnostic");
  {
    ResultsStore store(path);
    store.append(aware);
    store.append(agnostic);
    EXPECT_THROW(store.append(agnostic), InvalidArgument);
  }
  ResultsStore again(path);
  ASSERT_EQ(again.rows().size(), 2u);
  EXPECT_TRUE(again.contains(aware.key()));
  EXPECT_TRUE(again.contains(agnostic.key()));
  EXPECT_EQ(again.rows()[1].query_mode, "agnostic");
  EXPECT_EQ(slurp(path).find("query_mode"), slurp(path).rfind("query_mode"));  // only the agnostic row has it
  // Merging keeps both (distinct keys), in plan order.
  MergeStats st;
  const auto merged = merge_rows({again.rows(), {aware}}, &st);
  EXPECT_EQ(merged.size(), 2u);
  EXPECT_EQ(st.duplicates, 1);
}
