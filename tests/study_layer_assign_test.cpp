// SPDX-License-Identifier: Apache-2.0
// kv_study layers (kvcache/study/layer_assign.h): the exact per-layer assignment on scripted
// sensitivity tables with known optima (where greedy fails; ties; the budget's boundary), held
// to a brute-force enumeration on random tables; the sensitivity measurement through a scripted
// evaluator (which arms it runs, the KLD of each); the JSON and Markdown outputs; and the
// measurement on a real model (TinyStories-656K from ../shared) when it is there.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/quantizer.h"
#include "kvcache/study/layer_assign.h"
#include "kvcache/study/model_evaluator.h"
#include "kvcache/torch.h"
#include "model_test_util.h"

namespace kvcache::study {
namespace {

using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

/// A profile of `kld` [layer][choice] whose choices cost `bits` in every layer.
LayerSensitivity profile(const std::vector<std::string>& choices, const std::vector<double>& bits,
                         const std::vector<std::vector<double>>& kld) {
  LayerSensitivity p;
  p.choices = choices;
  p.kld = kld;
  p.cost.assign(kld.size(), bits);
  return p;
}

// Choices A = int8 at 8 bits, B = int4 at 4, C = int2 at 2 (scripted bits) over 4 layers, hand-enumerated.
TEST(LayerAssignment, ExactOptimumOfAHandCheckedTable) {
  const auto p = profile({"int8", "int4", "int2"}, {8, 4, 2},
                         {{0.00, 0.30, 0.40},   // layer 0: sensitive
                          {0.00, 0.05, 0.35},   // layer 1
                          {0.00, 0.05, 0.35},   // layer 2
                          {0.00, 0.05, 0.35}});  // layer 3
  // Mean 4 bits = 16 in total. Within it: B,B,B,B 0.30 + 3·0.05 = 0.45; A on layer 0 leaves 8 bits
  // for three layers: A,B,C,C 0.75 or A,C,C,C 1.05; A elsewhere: C,A,B,C 0.80, B,A,C,C 1.00;
  // no A: B,B,B,B is the least (each B -> C adds KLD). Optimum: B,B,B,B.
  LayerAssignment a = choose_layer_assignment(p, 4.0);
  EXPECT_EQ(a.choice, (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_DOUBLE_EQ(a.mean_cost, 4.0);
  EXPECT_NEAR(a.predicted_kld, 0.45, 1e-12);
  // Mean 5 bits = 20: A,B,B,B 0.15; B,A,B,B 0.40; A,A,C,C 0.70. Optimum: the sensitive layer at A.
  a = choose_layer_assignment(p, 5.0);
  EXPECT_EQ(a.choice, (std::vector<int64_t>{0, 1, 1, 1}));
  EXPECT_NEAR(a.predicted_kld, 0.15, 1e-12);
  EXPECT_DOUBLE_EQ(a.mean_cost, 5.0);
  EXPECT_EQ(a.spec, "layers(int8;int4*3)");
}

// Where the greedy rule (start at the cheapest choices, take the upgrade of most KLD saved per
// bit while it fits) falls short: from C,C (1.1) it takes layer 1's C -> B (0.15/bit), then
// only layer 1's B -> A fits: C,A = 0.6. The optimum A,C = 0.5 costs the same 10 bits.
TEST(LayerAssignment, ExactWhereGreedyIsNot) {
  const auto p = profile({"int8", "int4", "int2"}, {8, 4, 2}, {{0.0, 0.6, 0.6}, {0.0, 0.2, 0.5}});
  const LayerAssignment a = choose_layer_assignment(p, 5.0);
  EXPECT_EQ(a.choice, (std::vector<int64_t>{0, 2}));
  EXPECT_NEAR(a.predicted_kld, 0.5, 1e-12);
  EXPECT_DOUBLE_EQ(a.mean_cost, 5.0);
}

TEST(LayerAssignment, SpecIsTheCanonicalLayersScheme) {
  const auto p = profile({"kivi:k8:v4:g32:r128", "kivi:k4:v2:g32:r128"},
                         {make_quantizer("int8:g32:chan")->bits_per_value(64) / 2 +
                              make_quantizer("int4:g32")->bits_per_value(64) / 2,
                          make_quantizer("int4:g32:chan")->bits_per_value(64) / 2 +
                              make_quantizer("int2:g32")->bits_per_value(64) / 2},
                         {{0.2, 0.9}, {0.01, 0.02}, {0.01, 0.02}, {0.3, 0.5}});
  // Bits: K8V4 = (9 + 5)/2 = 7, K4V2 = (5 + 3)/2 = 4 (g32: + 32/32 bit of fp16 scale and zero).
  EXPECT_DOUBLE_EQ(p.cost[0][0], 7.0);
  EXPECT_DOUBLE_EQ(p.cost[0][1], 4.0);
  // 5.5 bits mean = 22 in total: two layers at K8V4 (7+7+4+4 = 22): layers 0 and 3 save most.
  const LayerAssignment a = choose_layer_assignment(p, 5.5);
  EXPECT_EQ(a.choice, (std::vector<int64_t>{0, 1, 1, 0}));
  EXPECT_EQ(a.spec, "layers(kivi:k8:v4:g32:r128;kivi:k4:v2:g32:r128*2;kivi:k8:v4:g32:r128)");
  EXPECT_NEAR(a.predicted_kld, 0.2 + 0.02 + 0.02 + 0.3, 1e-12);
  EXPECT_EQ(make_cache_scheme(a.spec)->spec(), a.spec);
}

TEST(LayerAssignment, TiesPreferFewerBitsThenEarlierChoices) {
  // (A, B = int8, int4.) Equal KLD at 8 and 4 bits: the cheaper.
  auto p = profile({"int8", "int4"}, {8, 4}, {{0.1, 0.1}, {0.1, 0.1}});
  EXPECT_EQ(choose_layer_assignment(p, 8.0).choice, (std::vector<int64_t>{1, 1}));
  // Two choices identical in bits and KLD: the earlier-listed.
  p = profile({"int8", "int4"}, {4, 4}, {{0.1, 0.1}, {0.2, 0.2}});
  EXPECT_EQ(choose_layer_assignment(p, 4.0).choice, (std::vector<int64_t>{0, 0}));
  // Two assignments of equal total KLD and bits: the lexicographically smaller.
  p = profile({"int8", "int4"}, {8, 4}, {{0.0, 0.1}, {0.0, 0.1}});
  EXPECT_EQ(choose_layer_assignment(p, 6.0).choice, (std::vector<int64_t>{0, 1}));
}

TEST(LayerAssignment, BudgetBoundaryAndInfeasibleBudget) {
  const auto p = profile({"int8", "int2"}, {8, 2}, {{0.0, 1.0}, {0.0, 1.0}, {0.0, 1.0}});
  // (8 + 2 + 2)/3 = 4 exactly: one layer may be upgraded at 4 bits, none below.
  EXPECT_EQ(choose_layer_assignment(p, 4.0).choice, (std::vector<int64_t>{0, 1, 1}));
  EXPECT_EQ(choose_layer_assignment(p, 3.999).choice, (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(choose_layer_assignment(p, 2.0).choice, (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(choose_layer_assignment(p, 100.0).choice, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_THAT(error_of([&] { choose_layer_assignment(p, 1.5); }),
              HasSubstr("no per-layer assignment fits an average of 1.5 bits/value: the cheapest choices average 2 "
                        "bits/value (choices: int8, int2)"));
  EXPECT_EQ(choose_layer_assignment(p, 4.0).arm, "layers(int8;int2*2)+full");
  EXPECT_THAT(error_of([&] { choose_layer_assignment(p, 0); }), HasSubstr("the average budget must be a finite number > 0"));
}

TEST(LayerAssignment, MalformedProfilesAreRefused) {
  auto p = profile({"int8", "int4"}, {8, 4}, {{0.1, 0.2}, {0.1}});
  EXPECT_THAT(error_of([&] { choose_layer_assignment(p, 8); }), HasSubstr("layer 1 has 1 KLD and 2 cost entries"));
  p = profile({"int8", "int4"}, {8, 4}, {{0.1, -0.2}});
  EXPECT_THAT(error_of([&] { choose_layer_assignment(p, 8); }), HasSubstr("choice 'int4' has KLD -0.2"));
  p = profile({"int8", "int4"}, {8, 4}, {{0.1, NAN}});
  EXPECT_THAT(error_of([&] { choose_layer_assignment(p, 8); }), HasSubstr("expected a finite value >= 0"));
  p = profile({"int8"}, {8}, {});
  EXPECT_THAT(error_of([&] { choose_layer_assignment(p, 8); }), HasSubstr("has no layer"));
}

/// The optimum by enumerating every assignment (C^L), with the documented tie rule.
std::vector<int64_t> brute_force(const LayerSensitivity& p, double budget) {
  const size_t L = p.kld.size(), C = p.choices.size();
  std::vector<int64_t> pick(L, 0), best;
  double best_loss = 0, best_cost = 0;
  for (;;) {
    double cost = 0, loss = 0;
    for (size_t l = 0; l < L; ++l) {
      cost += p.cost[l][static_cast<size_t>(pick[l])];
      loss += p.kld[l][static_cast<size_t>(pick[l])];
    }
    if (cost <= budget * static_cast<double>(L) + 1e-9 * static_cast<double>(L)) {
      const bool better = best.empty() || loss < best_loss - 1e-12 ||
                          (std::abs(loss - best_loss) <= 1e-12 && (cost < best_cost || (cost == best_cost && pick < best)));
      if (better) {
        best = pick;
        best_loss = loss;
        best_cost = cost;
      }
    }
    size_t i = L;
    while (i > 0 && pick[i - 1] == static_cast<int64_t>(C) - 1) pick[--i] = 0;
    if (i == 0) break;
    ++pick[i - 1];
  }
  return best;
}

// Random tables (KLDs on a coarse grid, so that ties occur): the DP finds the enumeration's optimum.
TEST(LayerAssignment, MatchesBruteForceOnRandomTables) {
  std::mt19937_64 rng(2025);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t L = 1 + rng() % 7, C = 1 + rng() % 4;
    LayerSensitivity p;
    const std::vector<std::string> names = {"int8", "int4", "int3", "int2"};
    for (size_t c = 0; c < C; ++c) p.choices.push_back(names[c]);
    p.kld.assign(L, std::vector<double>(C));
    p.cost.assign(L, std::vector<double>(C));
    for (size_t l = 0; l < L; ++l) {
      for (size_t c = 0; c < C; ++c) {
        p.kld[l][c] = static_cast<double>(rng() % 6) / 8.0;         // exact in binary: sums exact
        p.cost[l][c] = 2.0 + static_cast<double>(rng() % 13) / 2.0;  // 2 .. 8 in halves
      }
    }
    const double budget = 2.0 + static_cast<double>(rng() % 14) / 2.0;
    const auto want = brute_force(p, budget);
    if (want.empty()) {
      EXPECT_THROW(choose_layer_assignment(p, budget), InvalidArgument) << "trial " << trial;
      continue;
    }
    EXPECT_EQ(choose_layer_assignment(p, budget).choice, want) << "trial " << trial << " L=" << L << " C=" << C;
  }
}

// ------------------------------------------------------------ measurement

/// An evaluator whose streaming logits are a scripted function of the arm's per-layer schemes:
/// the control's logits plus, for every layer not stored in fp32, delta(layer, scheme).
class ScriptedEvaluator : public ArmEvaluator {
 public:
  std::vector<std::string> asked;  ///< arms passed to eval_text, in order

  std::string model_id() const override { return "scripted@0"; }
  Arm canonicalize(const Arm& arm) const override {
    Arm a{make_cache_scheme(arm.scheme)->spec(), arm.policy};
    return a;
  }
  Generation run_task(const Arm&, const Task&, QueryMode) override { return {}; }
  ReconstructionResult reconstruction(const std::string&) override { return {}; }
  std::vector<QkvSample> capture_qkv() override { return {}; }
  CacheGeometry geometry() const override { return CacheGeometry{3, 2, 64}; }

  static at::Tensor control_logits() { return at::arange(5 * 4, at::kFloat).reshape({5, 4}).remainder(3.0); }
  static at::Tensor delta(int64_t layer, const std::string& scheme) {
    const double size = scheme == "int8" ? 0.1 : scheme == "int4" ? 0.5 : 0.0;
    return at::arange(5 * 4, at::kFloat).reshape({5, 4}).remainder(2.0 + static_cast<double>(layer)) * size *
           static_cast<double>(layer + 1);
  }
  /// The logits of per-layer schemes `per_layer`.
  static at::Tensor logits(const std::vector<std::string>& per_layer) {
    at::Tensor t = control_logits();
    for (size_t l = 0; l < per_layer.size(); ++l) t = t + delta(static_cast<int64_t>(l), per_layer[l]);
    return t;
  }

  TextEval eval_text(const Arm& arm) override {
    asked.push_back(arm.spec());
    const auto s = make_cache_scheme(arm.scheme);
    std::vector<std::string> per_layer;
    const CacheGeometry g = geometry();
    for (int64_t l = 0; l < g.num_layers; ++l) {
      const LayerStreams st = s->streams(g, l, 0);
      per_layer.push_back(st.key.quantizer->spec());
    }
    TextEval t;
    t.stream_logits = logits(per_layer);
    return t;
  }
};

TEST(LayerSensitivity, MeasuresEachLayerAloneAgainstTheControl) {
  ScriptedEvaluator ev;
  const LayerSensitivity p = measure_layer_sensitivity(ev, "fp32", {"int8", "int4:g0"});
  EXPECT_EQ(p.choices, (std::vector<std::string>{"int8", "int4"}));
  EXPECT_EQ(p.base, "fp32");
  EXPECT_EQ(p.control, "fp32+full");
  EXPECT_EQ(p.model_id, "scripted@0");
  EXPECT_EQ(p.base_kld, 0.0);
  EXPECT_EQ(p.positions, 5);
  // The arms it ran: the control, the base, then per layer each choice alone.
  EXPECT_EQ(ev.asked, (std::vector<std::string>{"fp32+full", "fp32+full", "layers(int8;fp32*2)+full",
                                                "layers(int4;fp32*2)+full", "layers(fp32;int8;fp32)+full",
                                                "layers(fp32;int4;fp32)+full", "layers(fp32*2;int8)+full",
                                                "layers(fp32*2;int4)+full"}));
  const at::Tensor ref = ScriptedEvaluator::control_logits();
  for (int64_t l = 0; l < 3; ++l) {
    for (size_t c = 0; c < 2; ++c) {
      std::vector<std::string> per_layer(3, "fp32");
      per_layer[static_cast<size_t>(l)] = p.choices[c];
      const double want = compare_logits(ref, ScriptedEvaluator::logits(per_layer)).kld_mean;
      EXPECT_EQ(p.kld[static_cast<size_t>(l)][c], want) << l << " " << c;
      EXPECT_GT(want, 0.0);
    }
    EXPECT_DOUBLE_EQ(p.cost[static_cast<size_t>(l)][0], make_quantizer("int8")->bits_per_value(64));
    EXPECT_DOUBLE_EQ(p.cost[static_cast<size_t>(l)][1], make_quantizer("int4")->bits_per_value(64));
  }
  // Later layers are scripted to be more sensitive, int4 more than int8.
  EXPECT_LT(p.kld[0][1], p.kld[2][1]);
  EXPECT_LT(p.kld[1][0], p.kld[1][1]);
  // A choice equal to the base reuses the base's pass.
  ScriptedEvaluator ev2;
  const LayerSensitivity q = measure_layer_sensitivity(ev2, "int8", {"int8", "int4"});
  EXPECT_EQ(ev2.asked.size(), 2u + 3u);  // control, base, then int4 in each layer
  EXPECT_GT(q.base_kld, 0.0);
  EXPECT_EQ(q.kld[1][0], q.base_kld);
}

TEST(LayerSensitivity, BadChoicesAreNamed) {
  ScriptedEvaluator ev;
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {}); }), HasSubstr("layer sensitivity: no choice"));
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"int4", "h2o@50%"}); }),
              HasSubstr("choice 'h2o@50%' is an eviction policy (the choices are all cache schemes or all policies"));
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"int4", "int5"}); }),
              HasSubstr("unknown cache scheme 'int5'"));
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"int4", "int4:tok"}); }),
              HasSubstr("choice 'int4:tok' is listed twice (as 'int4')"));
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"layers(int4*3)"}); }),
              HasSubstr("choice 'layers(int4*3)' is a per-layer scheme"));
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "layers(int4*3)", {"int4"}); }),
              HasSubstr("base 'layers(int4*3)' is a per-layer scheme"));
  EXPECT_TRUE(ev.asked.empty());  // refused before any pass
}

TEST(LayerSensitivity, JsonAndMarkdownCarryTheTableAndTheChosenSpec) {
  ScriptedEvaluator ev;
  const LayerSensitivity p = measure_layer_sensitivity(ev, "fp32", {"int8", "int4"});
  const double b8 = make_quantizer("int8")->bits_per_value(64), b4 = make_quantizer("int4")->bits_per_value(64);
  const double budget = (b8 + 2 * b4) / 3;  // one layer may keep int8: the most sensitive (layer 2)
  const LayerAssignment a = choose_layer_assignment(p, budget);
  EXPECT_EQ(a.spec, "layers(int4*2;int8)");
  const auto j = nlohmann::json::parse(layer_assignment_json(p, budget, a, 0.25));
  EXPECT_EQ(j["chosen"]["spec"], "layers(int4*2;int8)");
  EXPECT_EQ(j["chosen"]["arm"], "layers(int4*2;int8)+full");
  EXPECT_EQ(j["chosen"]["choice"], nlohmann::json::parse("[1, 1, 0]"));
  EXPECT_EQ(j["chosen"]["measured_kld"], 0.25);
  EXPECT_EQ(j["layers"].size(), 3u);
  EXPECT_EQ(j["layers"][2]["kld"][1].get<double>(), p.kld[2][1]);
  EXPECT_EQ(j["layers"][2]["cost"][0].get<double>(), b8);
  EXPECT_EQ(j["kind"], "scheme");
  EXPECT_EQ(j["cost_unit"], "bits/value");
  EXPECT_EQ(j["budget"].get<double>(), budget);
  EXPECT_EQ(j["choices"][0]["spec"], "int8");
  EXPECT_EQ(j["base"], "fp32");
  EXPECT_FALSE(nlohmann::json::parse(layer_assignment_json(p, budget, a))["chosen"].contains("measured_kld"));
  const std::string md = layer_assignment_markdown(p, budget, a, 0.25);
  EXPECT_THAT(md, HasSubstr("| layer | int8 (8.5 b) | int4 (4.5 b) |"));
  EXPECT_THAT(md, HasSubstr("Run it: `kv_study run --configs 'layers(int4*2;int8)+full'`"));
  EXPECT_THAT(md, HasSubstr("(exact knapsack): `layers(int4*2;int8)`"));
  EXPECT_THAT(md, HasSubstr("measured KLD 0.25"));
}

/// An evaluator whose streaming logits are a scripted function of each layer's token budget
/// (resolved for a 100-token context): the control's logits plus delta(layer, budget).
class ScriptedBudgetEvaluator : public ScriptedEvaluator {
 public:
  static at::Tensor delta(int64_t layer, int64_t budget) {
    const double size = budget >= 100 ? 0.0 : (100.0 - static_cast<double>(budget)) / 100.0;
    // One direction for every layer, scaled: earlier layers and smaller budgets move it more.
    return at::arange(5 * 4, at::kFloat).reshape({5, 4}).remainder(3.0) * size * static_cast<double>(3 - layer);
  }
  static at::Tensor logits(const std::vector<int64_t>& budgets) {
    at::Tensor t = control_logits();
    for (size_t l = 0; l < budgets.size(); ++l) t = t + delta(static_cast<int64_t>(l), budgets[l]);
    return t;
  }
  TextEval eval_text(const Arm& arm) override {
    asked.push_back(arm.spec());
    auto policy = make_eviction_policy(arm.policy);
    policy->reset(100, CacheShape{3, 4, 2});
    std::vector<int64_t> budgets;
    for (int64_t l = 0; l < 3; ++l) budgets.push_back(policy->layer_budget(l));
    TextEval t;
    t.stream_logits = logits(budgets);
    return t;
  }
};

TEST(LayerSensitivity, PerLayerBudgetsFromPolicyChoices) {
  ScriptedBudgetEvaluator ev;
  const LayerSensitivity p = measure_layer_sensitivity(ev, "int8", {"sink@25%", "sink:s4@75%", "full"});
  EXPECT_EQ(p.kind, LayerChoiceKind::kPolicy);
  EXPECT_EQ(p.choices, (std::vector<std::string>{"sink@25%", "sink@75%", "full"}));
  EXPECT_EQ(p.cost_unit, "% of context");
  EXPECT_EQ(p.cost[1], (std::vector<double>{25, 75, 100}));
  EXPECT_EQ(p.base, "int8");
  // Control, base (int8, no eviction), then per layer each budget alone (full reuses the base).
  EXPECT_EQ(ev.asked, (std::vector<std::string>{"fp32+full", "int8+full", "int8+perlayer(sink@25%;full*2)",
                                                "int8+perlayer(sink@75%;full*2)", "int8+perlayer(full;sink@25%;full)",
                                                "int8+perlayer(full;sink@75%;full)", "int8+perlayer(full*2;sink@25%)",
                                                "int8+perlayer(full*2;sink@75%)"}));
  const at::Tensor ref = ScriptedEvaluator::control_logits();
  EXPECT_EQ(p.kld[0][0], compare_logits(ref, ScriptedBudgetEvaluator::logits({25, 100, 100})).kld_mean);
  EXPECT_EQ(p.kld[2][1], compare_logits(ref, ScriptedBudgetEvaluator::logits({100, 100, 75})).kld_mean);
  EXPECT_EQ(p.kld[1][2], 0.0);
  // Mean 50%: 150 in total over 3 layers; the sensitive layer 0 gets the most.
  const LayerAssignment a = choose_layer_assignment(p, 50.0);
  EXPECT_LE(a.mean_cost, 50.0);
  EXPECT_EQ(a.spec, make_eviction_policy(a.spec)->spec());
  EXPECT_EQ(a.arm, "int8+" + a.spec);
  // Within 150 in total: full in one layer and 25% in two (or less); layer 0 is the most sensitive.
  EXPECT_EQ(a.spec, "perlayer(full;sink@25%*2)");
  EXPECT_EQ(a.choice, (std::vector<int64_t>{2, 0, 0}));
  EXPECT_DOUBLE_EQ(a.mean_cost, 50.0);
  // Token budgets are their own unit; the two kinds do not mix.
  ScriptedBudgetEvaluator ev2;
  const LayerSensitivity q = measure_layer_sensitivity(ev2, "fp32", {"h2o@25", "h2o@75"});
  EXPECT_EQ(q.cost_unit, "tokens");
  EXPECT_EQ(q.cost[0], (std::vector<double>{25, 75}));
  EXPECT_EQ(choose_layer_assignment(q, 25.0).spec, "perlayer(h2o@25*3)");
}

TEST(LayerSensitivity, BadPolicyChoicesAreNamed) {
  ScriptedBudgetEvaluator ev;
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"tova@25%", "h2o@50%"}); }),
              HasSubstr("choice 'h2o@50%' is 'h2o', the others 'tova' (the choices are one policy"));
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"h2o@25%", "h2o@64"}); }),
              HasSubstr("choice 'h2o@64' budgets tokens where the others budget percentages"));
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"snapkv@25%", "full"}); }),
              HasSubstr("choice 'snapkv@25%' compresses once at the end of a prompt"));
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"knorm@25%", "full"}); }),
              HasSubstr("choice 'knorm@25%' compresses once at the end of a prompt"));
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"adakv:expected@25%", "full"}); }),
              HasSubstr("compresses once at the end of a prompt"));
  // Streaming schedules and decode-time compression evict while decoding: accepted.
  EXPECT_EQ(measure_layer_sensitivity(ev, "fp32", {"knorm:stream@25%", "full"}).choices,
            (std::vector<std::string>{"knorm:stream@25%", "full"}));
  EXPECT_EQ(measure_layer_sensitivity(ev, "fp32", {"decode:i8:b4:knorm@25%", "full"}).kld.size(), 3u);
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"h2o@64", "full"}); }),
              HasSubstr("choice 'full' among token budgets"));
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"pyramid@25%", "full"}); }),
              HasSubstr("choice 'pyramid@25%': pyramid sets budgets across a run of layers"));
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"h2o@25%", "int4"}); }),
              HasSubstr("choice 'int4' is no eviction policy"));
  EXPECT_THAT(error_of([&] { measure_layer_sensitivity(ev, "fp32", {"sink@25%", "sink:s4@25%"}); }),
              HasSubstr("listed twice"));
}

// On a real model: the profile is measured, every entry a KLD >= 0, and the chosen spec runs.
TEST(LayerSensitivity, OnTinyStories) {
  if (!testing::have_shared_data()) GTEST_SKIP() << "../shared/data not found next to the repository";
  std::string err;
  const auto pt = testing::export_hf(testing::shared_data() + "/models/tinystories-656k", "ts656k.pt", &err);
  ASSERT_TRUE(err.empty()) << err;
  ModelEvaluatorOptions o;
  o.model_path = pt;
  o.threads = 1;
  o.text_tokens = 40;
  auto ev = make_model_evaluator(o);
  const CacheGeometry g = ev->geometry();
  ASSERT_GE(g.num_layers, 1);
  const LayerSensitivity p = measure_layer_sensitivity(*ev, "fp32", {"int8", "int2"});
  ASSERT_EQ(p.kld.size(), static_cast<size_t>(g.num_layers));
  for (const auto& row : p.kld) {
    EXPECT_GE(row[0], 0.0);
    EXPECT_GT(row[1], row[0]);  // 2 bits hurt more than 8 in every layer
  }
  const LayerAssignment a = choose_layer_assignment(p, (p.cost[0][0] + p.cost[0][1]) / 2);
  const TextEval te = ev->eval_text(ev->canonicalize(Arm{a.spec, "full"}));
  EXPECT_TRUE(at::isfinite(te.stream_logits).all().item<bool>());
}

}  // namespace
}  // namespace kvcache::study
