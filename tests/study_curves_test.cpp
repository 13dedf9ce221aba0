// SPDX-License-Identifier: Apache-2.0
// The ratio sweep: --budgets expands the arms, the report draws one accuracy-vs-budget curve per
// method (overall, per family, per needle depth) and recommends each method's smallest budget
// within one task of the control.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>

#include "kvcache/error.h"
#include "kvcache/study/arm.h"
#include "kvcache/study/report.h"

using namespace kvcache;
using namespace kvcache::study;

namespace {

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no error)";
}

/// 8 tasks per arm: t0..t3 needle at depths 10/90 (two each), t4..t7 summary.
std::vector<ResultRow> sweep_rows() {
  std::vector<ResultRow> out;
  int64_t order = 0;
  auto arm = [&](const std::string& name, const std::vector<int>& fails) {
    for (int i = 0; i < 8; ++i) {
      ResultRow r;
      r.order = order++;
      r.kind = "task";
      r.arm = name;
      r.task = "t" + std::to_string(i);
      r.model = "m";
      r.family = i < 4 ? "needle" : "summary";
      r.depth_pct = i < 4 ? (i % 2 ? 90 : 10) : -1;
      r.passed = std::find(fails.begin(), fails.end(), i) == fails.end();
      r.set("peak_bytes", 1024);
      out.push_back(r);
    }
  };
  arm("fp32+full", {});                       // 8/8
  arm("fp32+h2o@25%", {0, 1, 2, 3, 4, 5});    // 2/8: needle 0, summary 0.5
  arm("fp32+h2o@50%", {0, 2, 4});             // 5/8: depth 10 → 0, depth 90 → 1
  arm("fp32+h2o@87.5%", {4});                 // 7/8: within one task
  arm("int4+full", {7});                      // no budget: no curve
  arm("fp32+snapkv@50%", {});                 // one budget only: no curve
  arm("fp32+tova@75%", {5});                  // listed before its smaller budget:
  arm("fp32+tova@25%", {0, 1, 2, 3});         // points sort by budget
  return out;
}

}  // namespace

TEST(StudyCurves, BudgetsExpandEveryEvictingArm) {
  const std::vector<Arm> arms = {{"fp32", "full"}, {"int4", "h2o@50%"}, {"fp32", "snapkv"}};
  const auto out = with_budgets(arms, "25%, 50%,@87.5%,256");
  ASSERT_EQ(out.size(), 9u);
  EXPECT_EQ(out[0].spec(), "fp32+full");  // a non-evicting arm runs once
  EXPECT_EQ(out[1].spec(), "int4+h2o@25%");
  EXPECT_EQ(out[2].spec(), "int4+h2o@50%");
  EXPECT_EQ(out[3].spec(), "int4+h2o@87.5%");
  EXPECT_EQ(out[4].spec(), "int4+h2o@256");
  EXPECT_EQ(out[5].spec(), "fp32+snapkv@25%");  // a policy without a budget gets each
  EXPECT_EQ(out[8].spec(), "fp32+snapkv@256");
}

TEST(StudyCurves, BadBudgetsAreRefusedNamingWhatTheUserWrote) {
  const std::vector<Arm> arms = {{"fp32", "h2o@50%"}};
  std::string m = message_of([&] { with_budgets(arms, "25%,150%"); });
  EXPECT_NE(m.find("--budgets '25%,150%'"), std::string::npos) << m;
  EXPECT_NE(m.find("item '150%'"), std::string::npos) << m;
  EXPECT_NE(m.find("(0, 100]"), std::string::npos) << m;
  m = message_of([&] { with_budgets(arms, "25%,half"); });
  EXPECT_NE(m.find("item 'half'"), std::string::npos) << m;
  m = message_of([&] { with_budgets(arms, "25%,,50%"); });
  EXPECT_NE(m.find("empty item"), std::string::npos) << m;
  m = message_of([&] { with_budgets(arms, "50%,25%,50.0%"); });
  EXPECT_NE(m.find("budget '50.0%' appears twice"), std::string::npos) << m;
  m = message_of([&] { with_budgets(arms, ""); });
  EXPECT_NE(m.find("empty item"), std::string::npos) << m;
}

TEST(StudyCurves, OneCurvePerMethodWithExactPoints) {
  const Summary s = summarize(sweep_rows());
  ASSERT_EQ(s.curves.size(), 2u);
  const BudgetCurve& h = s.curves[0];
  EXPECT_EQ(h.method, "fp32+h2o");
  EXPECT_EQ(h.budgets, (std::vector<std::string>{"@25%", "@50%", "@87.5%"}));
  EXPECT_EQ(h.budget_values, (std::vector<double>{0.25, 0.5, 0.875}));
  EXPECT_EQ(h.arms, (std::vector<std::string>{"fp32+h2o@25%", "fp32+h2o@50%", "fp32+h2o@87.5%"}));
  EXPECT_EQ(h.accuracy, (std::vector<double>{0.25, 0.625, 0.875}));
  EXPECT_EQ(h.family_accuracy.at("needle"), (std::vector<double>{0.0, 0.5, 1.0}));
  EXPECT_EQ(h.family_accuracy.at("summary"), (std::vector<double>{0.5, 0.75, 0.75}));
  EXPECT_EQ(h.depth_accuracy.at(10), (std::vector<double>{0.0, 0.0, 1.0}));
  EXPECT_EQ(h.depth_accuracy.at(90), (std::vector<double>{0.0, 1.0, 1.0}));
  EXPECT_EQ(h.smallest_within_one_task, 2);  // 7/8 >= 8 - 1; 5/8 is not
  const BudgetCurve& t = s.curves[1];
  EXPECT_EQ(t.method, "fp32+tova");
  EXPECT_EQ(t.budgets, (std::vector<std::string>{"@25%", "@75%"}));
  EXPECT_EQ(t.accuracy, (std::vector<double>{0.5, 0.875}));
  EXPECT_EQ(t.smallest_within_one_task, 1);
}

TEST(StudyCurves, RulesUseTheCurves) {
  const Summary s = summarize(sweep_rows());
  ASSERT_EQ(s.recommendations.size(), 7u);  // the five rules, then one per curve
  EXPECT_EQ(s.recommendations[5].rule, "Smallest budget of fp32+h2o within one task of the control");
  EXPECT_EQ(s.recommendations[5].arm, "fp32+h2o@87.5%");
  EXPECT_NE(s.recommendations[5].evidence.find("budget 87.5% (swept: 25% 25.0%, 50% 62.5%, 87.5% 87.5%)"),
            std::string::npos)
      << s.recommendations[5].evidence;
  EXPECT_EQ(s.recommendations[6].arm, "fp32+tova@75%");
  // A method none of whose budgets comes within one task: the rule says so.
  auto rows = sweep_rows();
  for (auto& r : rows) {
    if (r.arm == "fp32+h2o@87.5%" && r.task == "t5") r.passed = false;  // 6/8
  }
  const Summary worse = summarize(rows);
  EXPECT_EQ(worse.curves[0].smallest_within_one_task, -1);
  EXPECT_EQ(worse.recommendations[5].arm, "");
  EXPECT_EQ(worse.recommendations[5].evidence, "no arm qualifies");
}

TEST(StudyCurves, WritersShowTheCurves) {
  const Summary s = summarize(sweep_rows());
  const std::string md = summary_markdown(s);
  EXPECT_NE(md.find("| method | 25% | 50% | 75% | 87.5% | smallest within one task |\n|---|---:|---:|---:|---:|---|\n"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("| fp32+h2o | 25.0% | 62.5% | – | 87.5% | 87.5% |"), std::string::npos) << md;
  EXPECT_NE(md.find("| fp32+tova | 50.0% | – | 87.5% | – | 75% |"), std::string::npos) << md;
  EXPECT_NE(md.find("| fp32+h2o | summary | 50.0% | 75.0% | – | 75.0% |"), std::string::npos) << md;
  EXPECT_NE(md.find("| fp32+h2o | 90% | 0.0% | 100.0% | – | 100.0% |"), std::string::npos) << md;
  const auto j = nlohmann::json::parse(summary_json(s));
  ASSERT_EQ(j["curves"].size(), 2u);
  EXPECT_EQ(j["curves"][0]["method"], "fp32+h2o");
  EXPECT_EQ(j["curves"][0]["budget_values"][2].get<double>(), 0.875);
  EXPECT_EQ(j["curves"][0]["accuracy"][1].get<double>(), 0.625);
  EXPECT_EQ(j["curves"][0]["depth_accuracy"]["90"][1].get<double>(), 1.0);
  EXPECT_EQ(j["curves"][0]["smallest_within_one_task"], "@87.5%");
  // Without a sweep: no curve section, an empty list.
  std::vector<ResultRow> plain;
  for (const auto& r : sweep_rows()) {
    if (r.arm == "fp32+full" || r.arm == "int4+full") plain.push_back(r);
  }
  const Summary p = summarize(plain);
  EXPECT_TRUE(p.curves.empty());
  EXPECT_EQ(summary_markdown(p).find("ratio sweep"), std::string::npos);
  EXPECT_TRUE(nlohmann::json::parse(summary_json(p))["curves"].empty());
  EXPECT_EQ(p.recommendations.size(), 5u);
}
