// SPDX-License-Identifier: Apache-2.0
// Per-layer budgets: perlayer(<policy>@<budget>*<n>;...) (docs/policies.md). Canonical forms,
// errors in the user's words (runs that do not cover the cache, mixed policies), heads holding
// exactly their layer's budget, and parity: each run behaves as the plain policy does on its
// layers (H2O with attention, Knorm on scripted keys).
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cache_test_util.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/registry.h"
#include "kvcache/study/arm.h"
#include "kvcache/torch.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;
using testing::make_config;
using testing::positions_range;

using testing::error_of;

TEST(PerLayerPolicy, CanonicalFormsRoundTrip) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"perlayer(snapkv@25%*2;snapkv@75%*2)", "perlayer(snapkv@25%*2;snapkv@75%*2)"},
      {"perlayer(snapkv:w32:avg@25%*1;snapkv:k5@75%*3)", "perlayer(snapkv@25%;snapkv@75%*3)"},
      {"perlayer(full*2;h2o@8*2)", "perlayer(full*2;h2o@8*2)"},
      {"perlayer(window@4;window@8)", "perlayer(window@4;window@8)"},
      {"perlayer(h2o@8*2;h2o@8*2)", "perlayer(h2o@8*2;h2o@8*2)"},  // runs are not merged (pyramid's slope)
      {"perlayer(adakv:snapkv@50%*3;full)", "perlayer(adakv:snapkv@50%*3;full)"},
  };
  for (const auto& [in, canonical] : cases) {
    const auto p = make_eviction_policy(in);
    EXPECT_EQ(p->spec(), canonical) << in;
    EXPECT_EQ(make_eviction_policy(p->spec())->spec(), canonical) << in;
  }
  EXPECT_EQ(spec_kind("perlayer(snapkv@25%*2;snapkv@75%*2)"), SpecKind::kPolicy);
  const study::Arm a = study::parse_arm("fp32+perlayer(snapkv@25%*2;snapkv@75%*2)");
  EXPECT_EQ(a.policy, "perlayer(snapkv@25%*2;snapkv@75%*2)");
  EXPECT_EQ(study::parse_arm("perlayer(window@4;window@8)").scheme, "fp32");
  // --budget overrides uniform budgets; per-layer ones are kept.
  const auto arms = study::with_budget({a, study::Arm{"fp32", "h2o@50%"}}, "25%");
  EXPECT_EQ(arms[0].policy, "perlayer(snapkv@25%*2;snapkv@75%*2)");
  EXPECT_EQ(arms[1].policy, "h2o@25%");
}

TEST(PerLayerPolicy, BadSpecsNameTheUsersText) {
  EXPECT_THAT(error_of([] { make_eviction_policy("perlayer(snapkv@50%;h2o@50%)"); }),
              HasSubstr("eviction policy 'perlayer(snapkv@50%;h2o@50%)': run 2 'h2o@50%': the runs must be one policy "
                        "with their own budgets (or full), but 'h2o' differs from 'snapkv'"));
  EXPECT_THAT(error_of([] { make_eviction_policy("perlayer(snapkv:w16@50%;snapkv@50%)"); }),
              HasSubstr("'snapkv' differs from 'snapkv:w16'"));
  EXPECT_THAT(error_of([] { make_eviction_policy("perlayer(h2o@8;;h2o@4)"); }), HasSubstr("run 2 is empty"));
  EXPECT_THAT(error_of([] { make_eviction_policy("perlayer(h2o@8*0)"); }),
              HasSubstr("run 1 'h2o@8*0': layer count = 0 is out of range [1, 1000000]"));
  EXPECT_THAT(error_of([] { make_eviction_policy("perlayer(h2o*2)"); }), HasSubstr("run 1 'h2o*2': "));
  EXPECT_THAT(error_of([] { make_eviction_policy("perlayer(perlayer(h2o@8)*2)"); }),
              HasSubstr("a run cannot itself be per-layer"));
  EXPECT_THAT(error_of([] { make_eviction_policy("perlayer(int4)"); }), HasSubstr("run 1 'int4': "));
  EXPECT_THAT(error_of([] { make_eviction_policy("perlayer"); }), HasSubstr("write perlayer(<policy>@<budget>*<n>;...)"));
  EXPECT_THROW(make_eviction_policy("adakv:perlayer(h2o@8)@50%"), InvalidArgument);
  EXPECT_THROW(make_eviction_policy("adakv:perlayer(h2o)@50%"), InvalidArgument);
  EXPECT_THAT(error_of<CapacityError>([] { make_eviction_policy("perlayer(sink:s8:w8@4;sink@4)"); }),
              HasSubstr("eviction policy 'perlayer(sink:s8:w8@4;sink@4)': run 1 'sink:s8:w8@4': "));
}

TEST(PerLayerPolicy, RunsThatDoNotCoverTheCacheNameExpectedAndFound) {
  EXPECT_EQ(error_of([] { make_config(3, 4, 2, 16, "fp32", "perlayer(window@4*2;window@8*2)").validate(); }),
            "eviction policy 'perlayer(window@4*2;window@8*2)': its runs cover 4 layers (2 + 2), the cache has 3 "
            "(expected counts summing to 3)");
  EXPECT_THROW(TorchCache(make_config(5, 4, 2, 16, "fp32", "perlayer(window@4*2;window@8*2)")), InvalidArgument);
  EXPECT_NO_THROW(make_config(4, 4, 2, 16, "fp32", "perlayer(window@4*2;window@8*2)").validate());
  // A fractional budget resolves per request; one too small for a run's protected tokens is
  // named with the run's layers.
  TorchCache m(make_config(2, 4, 2, 16, "fp32", "perlayer(sink:s4:w4@50%;sink:s4:w4@90%)"));
  EXPECT_THAT(error_of<CapacityError>([&] { m.reset(12); }), HasSubstr("'perlayer(sink:s4:w4@50%;sink:s4:w4@90%)': layers 0-0: "));
}

/// Resident positions of every head of every layer.
std::vector<std::vector<std::vector<int64_t>>> positions(const TorchCache& m, int64_t layers) {
  std::vector<std::vector<std::vector<int64_t>>> out;
  for (int64_t l = 0; l < layers; ++l) out.push_back(m.tokens(l).positions);
  return out;
}

// Heads really hold their layer's budget: window@4 in layers 0-1, window@8 in layer 2, full in 3.
TEST(PerLayerPolicy, EachLayerHoldsItsOwnBudget) {
  TorchCache m(make_config(4, 4, 2, 16, "fp16", "perlayer(window@4*2;window@8;full)"));
  m.reset(24);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  int64_t pos = 0;
  for (int64_t n : {16, 1, 1, 1, 1}) {
    for (int64_t l = 0; l < 4; ++l) {
      m.append(l, testing::randn({1, 2, n, 16}, gen), testing::randn({1, 2, n, 16}, gen), positions_range(pos, n));
    }
    m.end_step(n > 1 ? StepKind::kPrefillEnd : StepKind::kDecode);
    m.check_invariants();
    pos += n;
  }
  const auto range = [](int64_t a, int64_t b) {
    std::vector<int64_t> v;
    for (int64_t i = a; i < b; ++i) v.push_back(i);
    return v;
  };
  const auto p = positions(m, 4);
  for (int64_t h = 0; h < 2; ++h) {
    EXPECT_EQ(p[0][static_cast<size_t>(h)], range(16, 20));
    EXPECT_EQ(p[1][static_cast<size_t>(h)], range(16, 20));
    EXPECT_EQ(p[2][static_cast<size_t>(h)], range(12, 20));
    EXPECT_EQ(p[3][static_cast<size_t>(h)], range(0, 20));
  }
  EXPECT_EQ(m.policy().layer_budget(0), 4);
  EXPECT_EQ(m.policy().layer_budget(2), 8);
  EXPECT_EQ(m.policy().layer_budget(3), 24);
  // fp16: 2 B x 16 values x (K, V) x 2 heads per token: (4 + 4 + 8 + 20) tokens.
  EXPECT_EQ(m.stats().bytes_resident, (4 + 4 + 8 + 20) * 2 * 16 * 2 * 2);
}

/// Runs `policy` on a 2-layer cache through a prompt and decode steps with attention (the same
/// random inputs for any policy); returns the resident positions.
std::vector<std::vector<std::vector<int64_t>>> run_with_attention(const std::string& policy) {
  TorchCache m(make_config(2, 14, 2, 16, "fp32", policy));
  m.reset(40);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  int64_t pos = 0;
  for (int64_t n : {12, 12, 1, 1, 1, 1, 1, 1, 1, 1}) {
    for (int64_t l = 0; l < 2; ++l) {
      m.append(l, testing::randn({1, 2, n, 16}, gen), testing::randn({1, 2, n, 16}, gen), positions_range(pos, n));
      (void)m.attend(l, testing::randn({1, 14, n, 16}, gen) * 3.0, positions_range(pos, n));
    }
    m.end_step(pos + n == 24 ? StepKind::kPrefillEnd : (n > 1 ? StepKind::kPrefill : StepKind::kDecode));
    m.check_invariants();
    pos += n;
  }
  return positions(m, 2);
}

// Parity with the plain policy (GQA 7:1, attention every step): each layer of
// perlayer(h2o@8;h2o@14) holds what h2o@8 holds in layer 0 and h2o@14 in layer 1, and one run
// over every layer is h2o itself.
TEST(PerLayerPolicy, EachRunMatchesThePlainPolicyOnItsLayers) {
  const auto mixed = run_with_attention("perlayer(h2o@8;h2o@14)");
  const auto h8 = run_with_attention("h2o@8");
  const auto h14 = run_with_attention("h2o@14");
  EXPECT_EQ(mixed[0], h8[0]);
  EXPECT_EQ(mixed[1], h14[1]);
  EXPECT_NE(h8[1], h14[1]);
  EXPECT_EQ(mixed[0][0].size(), 8u);
  EXPECT_EQ(mixed[1][1].size(), 14u);
  EXPECT_EQ(run_with_attention("perlayer(h2o@8*2)"), h8);
  EXPECT_EQ(run_with_attention("perlayer(h2o@8;h2o@8)"), h8);
  // SnapKV's one compression at the end of the prompt, per run; full keeps its layer whole.
  // (40 tokens announced, 24 in the prompt: SnapKV keeps 28 − 16 = 12 prompt tokens, then the 8 decoded.)
  const auto snap = run_with_attention("perlayer(full;snapkv:w4@28)");
  const auto snap28 = run_with_attention("snapkv:w4@28");
  EXPECT_EQ(snap[1], snap28[1]);
  EXPECT_EQ(snap[1][0].size(), 20u);
  EXPECT_EQ(snap[0][0].size(), 32u);
}

// Knorm on scripted keys (no attention): layer 0 keeps 2 per head, layer 1 keeps 4; the
// survivors are the lowest-norm keys plus the newest (never evicted).
TEST(PerLayerPolicy, KnormKeepsEachLayersBudgetOfLowNormKeys) {
  TorchCache m(make_config(2, 4, 2, 8, "fp32", "perlayer(knorm@2;knorm@4)"));
  m.reset(8);
  const std::vector<float> norms = {5, 1, 4, 2, 3, 6, 0.5f, 7};
  at::Tensor k = at::zeros({1, 2, 8, 8});
  for (int64_t t = 0; t < 8; ++t) {
    k[0][0][t][0] = norms[static_cast<size_t>(t)];
    k[0][1][t][1] = norms[static_cast<size_t>(t)];
  }
  for (int64_t l = 0; l < 2; ++l) m.append(l, k, at::ones({1, 2, 8, 8}), positions_range(0, 8));
  m.end_step(StepKind::kPrefillEnd);
  m.check_invariants();
  for (int64_t h = 0; h < 2; ++h) {
    EXPECT_EQ(m.tokens(0).positions[static_cast<size_t>(h)], (std::vector<int64_t>{6, 7}));        // 0.5, newest
    EXPECT_EQ(m.tokens(1).positions[static_cast<size_t>(h)], (std::vector<int64_t>{1, 3, 6, 7}));  // 1, 2, 0.5, newest
  }
}

}  // namespace
}  // namespace kvcache
