// SPDX-License-Identifier: Apache-2.0
// Exact small cases for every eviction policy: scripted attention, known survivors.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "eviction_test_util.h"
#include "evict/policies.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/torch.h"

namespace kvcache {
namespace {

using testing::kept_rows;
using testing::Rows;

EvictionContext ctx_for(int64_t layer, int64_t resident, int64_t new_tokens = 1, bool prefill_end = false,
                        int64_t logical = -1, int64_t heads = 2) {
  EvictionContext c;
  c.layer = layer;
  c.resident.assign(static_cast<size_t>(heads), resident);
  c.new_tokens = new_tokens;
  c.logical_length = logical < 0 ? resident : logical;
  c.step = prefill_end ? StepKind::kPrefillEnd : StepKind::kDecode;
  return c;
}


Rows plan_rows(EvictionPolicy& p, const EvictionContext& c) { return kept_rows(p.plan(c), c); }

/// One layer's end of step as CacheManager::end_step drives it: plan, on_evicted (for a
/// non-empty plan), on_step_end; the kept rows.
Rows step_rows(EvictionPolicy& p, const EvictionContext& c) {
  const EvictionPlan plan = p.plan(c);
  if (!plan.empty()) p.on_evicted(c.layer, plan);
  p.on_step_end(c);
  return kept_rows(plan, c);
}

std::unique_ptr<EvictionPolicy> make(const std::string& spec, int64_t context, int64_t hq = 2,
                                     int64_t hkv = 2, int64_t layers = 1) {
  auto p = make_eviction_policy(spec);
  p->reset(context, CacheShape{layers, hq, hkv});
  return p;
}

TEST(EvictionPolicyFactory, SpecsRoundTrip) {
  for (const std::string spec :
       {"full", "window:w256", "window@50%", "sink@50%", "sink:s2:w10", "sink:s8@256",
        "h2o@50%", "h2o:r64@256", "h2o:h128:r128", "random:seed7@50%", "random@100",
        "snapkv@50%", "snapkv:w16:k7:max@1024", "tova@512", "pyramid@50%",
        "pyramid:w64:b10:max@25%"}) {
    auto p = make_eviction_policy(spec);
    EXPECT_EQ(p->spec(), spec);
    EXPECT_EQ(make_eviction_policy(p->spec())->spec(), spec);
  }
  // Defaults are dropped from the canonical form.
  EXPECT_EQ(make_eviction_policy("sink:s4:w10")->spec(), "sink:w10");
  EXPECT_EQ(make_eviction_policy("snapkv:w32:k5:avg@64")->spec(), "snapkv@64");
  EXPECT_EQ(make_eviction_policy("random:seed0@8")->spec(), "random@8");
}

TEST(EvictionPolicyFactory, RegisteredTablesAndErrors) {
  std::vector<std::string> heads;
  for (const auto& t : registered_policies()) heads.push_back(t.head);
  EXPECT_EQ(heads, (std::vector<std::string>{"full", "window", "sink", "h2o", "random", "snapkv", "tova",
                                             "pyramid", "knorm", "keydiff", "expected", "duo", "kvzip", "adakv", "decode",
                                             "perlayer"}));
  try {
    make_eviction_policy("lru@50%");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("registered: full, window, sink"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(make_eviction_policy("full@50%"), InvalidArgument);
  EXPECT_THROW(make_eviction_policy("h2o"), InvalidArgument);      // no budget
  EXPECT_THROW(make_eviction_policy("tova"), InvalidArgument);     // no budget
  EXPECT_THROW(make_eviction_policy("sink:s4"), InvalidArgument);  // no window, no budget
  EXPECT_THROW(make_eviction_policy("window:x3"), InvalidArgument);
  EXPECT_THROW(make_eviction_policy("snapkv:k4@64"), InvalidArgument);  // even kernel
  EXPECT_THROW(make_eviction_policy("window@0"), InvalidArgument);
}

TEST(EvictionPolicyBudget, FractionNeverRoundsToZero) {
  auto p = make_eviction_policy("window@1%");
  EXPECT_THROW(p->reset(50, CacheShape{1, 2, 2}), CapacityError);  // 0.5 tokens
  p->reset(100, CacheShape{1, 2, 2});
  EXPECT_EQ(p->token_budget(), 1);
  // Unknown context: a fractional budget cannot plan.
  auto q = make_eviction_policy("window@50%");
  EXPECT_THROW(q->plan(ctx_for(0, 10)), InvalidArgument);
}

// kvpress StreamingLLMPress test vector: T = 10, r = 0.5, n_sink = 4 → keep [0, 1, 2, 3, 9].
TEST(SinkPolicy, KvpressVector) {
  auto p = make("sink@50%", 10);
  EXPECT_EQ(p->token_budget(), 5);
  auto rows = plan_rows(*p, (ctx_for(0, 10)));
  EXPECT_EQ(rows, (Rows{{0, 1, 2, 3, 9}, {0, 1, 2, 3, 9}}));
  // Decode: one more token resident → still sinks + newest window token.
  rows = plan_rows(*p, (ctx_for(0, 6)));
  EXPECT_EQ(rows, (Rows{{0, 1, 2, 3, 5}, {0, 1, 2, 3, 5}}));
}

TEST(SinkPolicy, BudgetSmallerThanSinksPlusWindowThrows) {
  try {
    make_eviction_policy("sink:s4:w8@10");
    FAIL() << "expected CapacityError";
  } catch (const CapacityError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("budget of 10"), std::string::npos) << msg;
    EXPECT_NE(msg.find("4 sinks + 8 window = 12"), std::string::npos) << msg;
  }
  EXPECT_THROW(make_eviction_policy("sink:s4@4"), CapacityError);  // no room for the newest token
  auto p = make_eviction_policy("sink@10%");
  EXPECT_THROW(p->reset(40, CacheShape{1, 2, 2}), CapacityError);  // 4 tokens, 4 sinks
  p->reset(50, CacheShape{1, 2, 2});                               // 5 tokens: ok
  EXPECT_EQ(p->token_budget(), 5);
}

TEST(WindowPolicy, MostRecent) {
  auto p = make("window:w3", 0);
  EXPECT_EQ(plan_rows(*p, (ctx_for(0, 5))), (Rows{{2, 3, 4}, {2, 3, 4}}));
  auto q = make("window@50%", 8);
  EXPECT_EQ(q->token_budget(), 4);
  EXPECT_EQ(plan_rows(*q, (ctx_for(0, 6))), (Rows{{2, 3, 4, 5}, {2, 3, 4, 5}}));
  EXPECT_THROW(make_eviction_policy("window:w9@8"), CapacityError);
}

TEST(EvictionPolicyBudget, BudgetAtLeastContextEvictsNothing) {
  for (const std::string spec : {"window@100%", "sink@100%", "h2o@100%", "random@100%",
                                 "snapkv:w4@100%", "tova@100%", "full"}) {
    auto p = make(spec, 12);
    if (p->needs_attention()) {
      auto probs = at::full({1, 2, 1, 12}, 1.0f / 12);
      p->observe(0, probs);
    }
    EXPECT_TRUE(p->plan(ctx_for(0, 12, 12, true)).empty()) << spec;
  }
}

// 14 query heads, 2 KV heads: query head h belongs to KV head h / 7.
at::Tensor gqa_probs(int64_t t, const std::vector<std::vector<std::pair<int64_t, float>>>& per_qhead) {
  auto p = at::zeros({1, 14, 1, t});
  for (int64_t h = 0; h < 14; ++h) {
    for (auto [idx, val] : per_qhead[static_cast<size_t>(h)]) p[0][h][0][idx] = val;
  }
  return p;
}

TEST(H2OPolicy, GqaMeanAggregationAndAccumulation) {
  auto p = make("h2o:r2@4", 0, /*hq=*/14, /*hkv=*/2);
  auto* h2o = dynamic_cast<evict::H2OPolicy*>(p.get());
  ASSERT_NE(h2o, nullptr);
  EXPECT_EQ(h2o->heavy(), 2);
  EXPECT_EQ(h2o->recent(), 2);
  // Step 1 over 5 keys. Group 0: q0 → token 1; q1..q6 → tokens 0 and 3 half each.
  // Group 1: every head → token 2 (0.6), token 1 (0.4).
  std::vector<std::vector<std::pair<int64_t, float>>> s1(14);
  s1[0] = {{1, 1.0f}};
  for (int h = 1; h < 7; ++h) s1[static_cast<size_t>(h)] = {{0, 0.5f}, {3, 0.5f}};
  for (int h = 7; h < 14; ++h) s1[static_cast<size_t>(h)] = {{2, 0.6f}, {1, 0.4f}};
  p->observe(0, gqa_probs(5, s1));
  EXPECT_FALSE(p->plan(ctx_for(0, 5)).empty());  // 5 > 4: evicts
  // (the plan above is discarded: the manager would evict; here we keep observing)
  // Step 2 over 6 keys: group 1 → token 0 only; group 0 same as step 1.
  std::vector<std::vector<std::pair<int64_t, float>>> s2(s1);
  for (int h = 7; h < 14; ++h) s2[static_cast<size_t>(h)] = {{0, 1.0f}};
  p->observe(0, gqa_probs(6, s2));
  const auto& sc = h2o->scores(0);
  ASSERT_EQ(sc.size(), 2u);
  ASSERT_EQ(sc[0].size(), 6u);
  ASSERT_EQ(sc[1].size(), 6u);
  EXPECT_NEAR(sc[0][0], 2 * 3.0f / 7, 1e-6);  // mean over 7 heads, 2 steps
  EXPECT_NEAR(sc[0][1], 2 * 1.0f / 7, 1e-6);
  EXPECT_NEAR(sc[0][3], 2 * 3.0f / 7, 1e-6);
  EXPECT_NEAR(sc[1][0], 1.0f, 1e-6);
  EXPECT_NEAR(sc[1][1], 0.4f, 1e-6);
  EXPECT_NEAR(sc[1][2], 0.6f, 1e-6);
  EXPECT_NEAR(sc[1][5], 0.0f, 1e-6);
  auto rows = plan_rows(*p, (ctx_for(0, 6)));
  // KV head 0: top-2 of tokens 0..3 = {0, 3}; KV head 1: {0 (1.0), 2 (0.6)}; + recent {4, 5}.
  EXPECT_EQ(rows, (Rows{{0, 3, 4, 5}, {0, 2, 4, 5}}));
  // After eviction the survivors keep their scores, in order.
  p->on_evicted(0, p->plan(ctx_for(0, 6)));
  EXPECT_NEAR(h2o->scores(0)[1][1], 0.6f, 1e-6);
  EXPECT_EQ(h2o->scores(0)[0].size(), 4u);
  EXPECT_EQ(h2o->scores(0)[1].size(), 4u);
}

TEST(H2OPolicy, TiesPreferRecentAndProtectedWindowSurvives) {
  auto p = make("h2o:r2@4", 0);
  // Uniform attention: every candidate ties → the most recent candidates win.
  p->observe(0, at::full({1, 2, 1, 8}, 0.125f));
  EXPECT_EQ(plan_rows(*p, (ctx_for(0, 8))), (Rows{{4, 5, 6, 7}, {4, 5, 6, 7}}));
  // Recent tokens with zero score are still kept; old heavy hitters fill the rest.
  auto q = make("h2o:r2@4", 0);
  auto probs = at::zeros({1, 2, 1, 8});
  probs.select(3, 1).fill_(0.5f);
  probs.select(3, 3).fill_(0.5f);
  q->observe(0, probs);
  EXPECT_EQ(plan_rows(*q, (ctx_for(0, 8))), (Rows{{1, 3, 6, 7}, {1, 3, 6, 7}}));
  // Three-way tie for two heavy slots at the edge of the recent window: 5 and 4 win over 2.
  auto r = make("h2o:r2@4", 0);
  auto pr = at::zeros({1, 2, 1, 8});
  for (int64_t i : {2, 4, 5}) pr.select(3, i).fill_(0.3f);
  r->observe(0, pr);
  EXPECT_EQ(plan_rows(*r, (ctx_for(0, 8))), (Rows{{4, 5, 6, 7}, {4, 5, 6, 7}}));
}

TEST(H2OPolicy, ErrorsWithoutAttentionAndOnBadShapes) {
  auto p = make("h2o@4", 0);
  EXPECT_TRUE(p->needs_attention());
  EXPECT_THROW(p->plan(ctx_for(0, 8)), InvalidArgument);
  EXPECT_THROW(p->observe(0, at::zeros({1, 3, 1, 8})), InvalidArgument);  // H_q 3 != 2
  EXPECT_THROW(p->observe(0, at::zeros({1, 2, 8})), InvalidArgument);
  EXPECT_THROW(p->observe(1, at::zeros({1, 2, 1, 8})), InvalidArgument);  // layer out of range
  EXPECT_THROW(make_eviction_policy("h2o:h3:r2@4"), CapacityError);       // 5 > 4
  EXPECT_EQ(make("h2o@1", 0)->token_budget(), 1);  // r = max(1/2, 1) = 1, h = 0
  EXPECT_EQ(make("h2o:h4:r0", 0)->token_budget(), 5);  // no budget: h + the protected newest
}

TEST(TovaPolicy, LastQueryAveragedOverAllHeadsSharedSelection) {
  auto p = make("tova@3", 0, /*hq=*/14, /*hkv=*/2);
  // Two queries; only the last row counts. Row 0 would favour tokens 0 and 1.
  auto probs = at::zeros({1, 14, 2, 6});
  probs.select(2, 0).select(2, 0).fill_(0.5f);
  probs.select(2, 0).select(2, 1).fill_(0.5f);
  // Last row: group 0 heads → token 2 (1.0); group 1 heads → token 4 (0.8), token 3 (0.2).
  for (int64_t h = 0; h < 7; ++h) probs[0][h][1][2] = 1.0f;
  for (int64_t h = 7; h < 14; ++h) {
    probs[0][h][1][4] = 0.8f;
    probs[0][h][1][3] = 0.2f;
  }
  p->observe(0, probs);
  // Mean over 14 heads: t2 = 0.5, t4 = 0.4, t3 = 0.1 → top-2 {2, 4} + newest 5, for both heads.
  EXPECT_EQ(plan_rows(*p, (ctx_for(0, 6))), (Rows{{2, 4, 5}, {2, 4, 5}}));
  p->on_evicted(0, p->plan(ctx_for(0, 6)));
  EXPECT_THROW(p->plan(ctx_for(0, 4)), InvalidArgument);  // stale: needs a new observation
  // All equal → most recent win, newest protected even with zero attention.
  auto q = make("tova@3", 0);
  auto pq = at::full({1, 2, 1, 6}, 0.2f);
  pq.select(3, 5).fill_(0.0f);
  q->observe(0, pq);
  EXPECT_EQ(plan_rows(*q, (ctx_for(0, 6))), (Rows{{3, 4, 5}, {3, 4, 5}}));
}

// A window larger than its budget names both, and the context only once it is known.
TEST(WindowPolicy, WindowPastTheBudgetNamesBoth) {
  try {
    (void)make_eviction_policy("window:w5@3");
    FAIL() << "expected CapacityError";
  } catch (const CapacityError& e) {
    EXPECT_STREQ(e.what(), "window: w5 exceeds the budget of 3 tokens (@3)");
  }
  auto p = make_eviction_policy("window:w5@50%");
  try {
    p->reset(8, CacheShape{1, 2, 2});
    FAIL() << "expected CapacityError";
  } catch (const CapacityError& e) {
    EXPECT_STREQ(e.what(), "window: w5 exceeds the budget of 4 tokens (@50% of 8)");
  }
}

// plan() is const: planning twice gives the same plan; the stream advances with on_evicted.
TEST(RandomPolicy, PlanningChangesNothingEvictingAdvances) {
  auto p = make("random:seed7@20", 0, 2, 2, 2);
  const auto first = plan_rows(*p, ctx_for(1, 64));
  EXPECT_EQ(plan_rows(*p, ctx_for(1, 64)), first);
  EXPECT_EQ(step_rows(*p, ctx_for(1, 64)), first);
  EXPECT_NE(plan_rows(*p, ctx_for(1, 64)), first);
  EXPECT_EQ(plan_rows(*p, ctx_for(0, 64)), plan_rows(*make("random:seed7@20", 0, 2, 2, 2), ctx_for(0, 64)));
}

TEST(RandomPolicy, SeededReproducibleNewestKept) {
  auto a = make("random:seed7@20", 0, 2, 2, 2);
  auto b = make("random:seed7@20", 0, 2, 2, 2);
  auto c = make("random:seed8@20", 0, 2, 2, 2);
  for (int step = 0; step < 3; ++step) {
    auto pa = step_rows(*a, ctx_for(1, 64));
    auto pb = step_rows(*b, ctx_for(1, 64));
    auto pc = step_rows(*c, ctx_for(1, 64));
    ASSERT_EQ(pa.size(), 2u);
    EXPECT_EQ(pa, pb);
    EXPECT_NE(pa, pc);
    EXPECT_NE(pa[0], pa[1]);  // heads draw independently
    for (const auto& row : pa) {
      ASSERT_EQ(row.size(), 20u);
      EXPECT_EQ(row.back(), 63);
      for (size_t i = 1; i < row.size(); ++i) EXPECT_LT(row[i - 1], row[i]);
    }
  }
  // A reset restarts the stream.
  auto first = plan_rows(*make("random:seed7@20", 0, 2, 2, 2), ctx_for(1, 64));
  a->reset(0, CacheShape{2, 2, 2});
  EXPECT_EQ(plan_rows(*a, (ctx_for(1, 64))), first);
  // Budget 1: only the newest token.
  EXPECT_EQ(plan_rows(*make("random@1", 0), ctx_for(0, 9)), (Rows{{8}, {8}}));
}

// methods.md b.10: avg_pool1d counts zero padding; maxpool ignores it.
TEST(SnapKVPolicy, PoolingWorkedNumbers) {
  const std::vector<float> s = {0.1f, 0.5f, 0.0f, 0.2f, 0.2f};  // one head
  const auto avg = evict::SnapKVPolicy::pool(s, 1, 3, false);
  const float want_avg[] = {0.2f, 0.2f, 0.7f / 3, 0.4f / 3, 0.4f / 3};
  const auto mx = evict::SnapKVPolicy::pool(s, 1, 3, true);
  const float want_max[] = {0.5f, 0.5f, 0.5f, 0.2f, 0.2f};
  for (int i = 0; i < 5; ++i) {
    EXPECT_NEAR(avg[static_cast<size_t>(i)], want_avg[i], 1e-6) << i;
    EXPECT_NEAR(mx[static_cast<size_t>(i)], want_max[i], 1e-7) << i;
  }
  // The same pooling on a tensor (what kvpress computes): bit for bit.
  const at::Tensor st = at::tensor(s).view({1, 1, 5});
  const at::Tensor ref_avg = at::avg_pool1d(st, {3}, {1}, {1}, false, true).view({5});
  const at::Tensor ref_max = at::max_pool1d(st, {3}, {1}, {1}).view({5});
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(avg[static_cast<size_t>(i)], ref_avg[i].item<float>()) << i;
    EXPECT_EQ(mx[static_cast<size_t>(i)], ref_max[i].item<float>()) << i;
  }
}

// A 10-token prompt, window w = 2, kernel 3, one KV head with two query heads whose mean over
// the window queries gives prefix scores [0.1, 0.5, 0.0, 0.2, 0.2, 0, 0, 0].
at::Tensor snap_probs() {
  auto p = at::zeros({1, 2, 10, 10});
  const float mean_scores[] = {0.1f, 0.5f, 0.0f, 0.2f, 0.2f};
  for (int64_t q = 8; q < 10; ++q) {
    for (int64_t k = 0; k < 5; ++k) {
      // Head 0 gets 2× the mean and head 1 nothing (mean over the group = the target),
      // except token 0 which head 1 carries: a per-head (non-mean) reduction would differ.
      if (k == 0) {
        p[0][1][q][k] = 2 * mean_scores[k];
      } else {
        p[0][0][q][k] = 2 * mean_scores[k];
      }
    }
  }
  return p;
}

TEST(SnapKVPolicy, PooledSelectionOnceAtPrefillEnd) {
  auto p = make("snapkv:w2:k3@5", 10, /*hq=*/2, /*hkv=*/1);
  p->observe(0, snap_probs());
  EXPECT_TRUE(p->plan(ctx_for(0, 10, 10, /*prefill_end=*/false, -1, 1)).empty());
  // Pooled prefix scores [0.2, 0.2, 0.233, 0.133, 0.133, 0.067, 0, 0] → top-3 {0, 1, 2} +
  // window {8, 9}. (Raw scores would pick {1, 3, 4}.)
  EXPECT_EQ(plan_rows(*p, ctx_for(0, 10, 10, true, -1, 1)), (Rows{{0, 1, 2, 8, 9}}));
  EXPECT_TRUE(p->needs_attention());  // planning changed nothing
  EXPECT_EQ(step_rows(*p, ctx_for(0, 10, 10, true, -1, 1)), (Rows{{0, 1, 2, 8, 9}}));
  EXPECT_FALSE(p->needs_attention());
  EXPECT_TRUE(p->plan(ctx_for(0, 6, 1, false, 11, 1)).empty());  // decode: appended only
  // Raw (kernel 1) scores for comparison.
  auto raw = make("snapkv:w2:k1@5", 10, 2, 1);
  raw->observe(0, snap_probs());
  EXPECT_EQ(plan_rows(*raw, ctx_for(0, 10, 10, true, -1, 1)), (Rows{{1, 3, 4, 8, 9}}));
}

TEST(SnapKVPolicy, ReservesDecodeTokensAndChecksWindow) {
  // Context 12 = 10 prompt + 2 new tokens: keep 5 − 2 = 3 prompt tokens → top-1 {2} + window.
  auto p = make("snapkv:w2:k3@5", 12, 2, 1);
  p->observe(0, snap_probs());
  EXPECT_EQ(plan_rows(*p, ctx_for(0, 10, 10, true, -1, 1)), (Rows{{2, 8, 9}}));
  auto q = make("snapkv:w4:k3@5", 12, 2, 1);
  q->observe(0, snap_probs());
  EXPECT_THROW(q->plan(ctx_for(0, 10, 10, true, -1, 1)), CapacityError);  // 3 < w = 4
  // Window rows gathered across chunks: two 5-query chunks give the same scores.
  auto c = make("snapkv:w2:k3@5", 10, 2, 1);
  auto full = snap_probs();
  c->observe(0, full.narrow(2, 0, 5).narrow(3, 0, 5).contiguous());
  c->observe(0, full.narrow(2, 5, 5).contiguous());
  EXPECT_EQ(plan_rows(*c, ctx_for(0, 10, 5, true, -1, 1)), (Rows{{0, 1, 2, 8, 9}}));
}

TEST(EvictionPolicyHelpers, ReduceAttentionIsGroupMean) {
  auto p = at::arange(14 * 2 * 3, at::kFloat).view({1, 14, 2, 3});
  // Group 0 = heads 0..6: mean of rows 0..6 = row 3; group 1 = row 10. Per row, last row only.
  auto r = reduce_attention(p, 2, AttentionNeed{1, true});
  ASSERT_EQ(r.rows, 1);
  EXPECT_TRUE(at::allclose(mass_tensor(r)[0][0], p[0][3][1]));
  EXPECT_TRUE(at::allclose(mass_tensor(r)[1][0], p[0][10][1]));
  // Summed over both rows.
  auto s = reduce_attention(p, 2, AttentionNeed{AttentionNeed::kAllRows, false});
  EXPECT_TRUE(at::allclose(mass_tensor(s)[0][0], p[0][3][0] + p[0][3][1]));
  EXPECT_THROW(reduce_attention(p, 4, AttentionNeed{1, true}), InvalidArgument);
  auto bad = p.clone();
  bad[0][5][1][2] = std::nanf("");
  try {
    reduce_attention(bad, 2, AttentionNeed{1, true});
    FAIL() << "NaN accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("[0, 5, 1, 2]"), std::string::npos) << e.what();
  }
}

TEST(EvictionPolicyHelpers, LowestKEvictsOlderOnTies) {
  const float sc[] = {0.3f, 0.1f, 0.1f, 0.5f, 0.1f};
  EXPECT_EQ(evict::lowest_k(sc, 5, 1), (std::vector<int64_t>{1}));
  EXPECT_EQ(evict::lowest_k(sc, 5, 2), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(evict::lowest_k(sc, 5, 4), (std::vector<int64_t>{0, 1, 2, 4}));
  EXPECT_EQ(evict::lowest_k(sc, 5, 0), (std::vector<int64_t>{}));
  EXPECT_EQ(evict::lowest_k(sc, 3, 7), (std::vector<int64_t>{0, 1, 2}));
}

}  // namespace
}  // namespace kvcache

namespace kvcache {
namespace {

// methods.md b.10: Qwen2.5-0.5B, T = 4096, r = 0.5, w = 64, β = 20 → 3994, 3824, …, 102.
TEST(PyramidKVPolicy, QwenLayerBudgets) {
  auto b = evict::PyramidKVPolicy::budgets(4096, 2048, 64, 20, 24);
  ASSERT_EQ(b.size(), 24u);
  EXPECT_EQ(b[0], 3994);
  EXPECT_EQ(b[1], 3824);
  EXPECT_EQ(b[23], 102);
  int64_t total = 0;
  for (auto x : b) total += x;
  EXPECT_EQ(total, 49152);  // 24 × 2048
  for (size_t i = 1; i < b.size(); ++i) EXPECT_LT(b[i], b[i - 1]);
  // r = 0.75 and 0.875: min < w → uniform fallback.
  EXPECT_EQ(evict::PyramidKVPolicy::budgets(4096, 1024, 64, 20, 24), std::vector<int64_t>(24, 1024));
  EXPECT_EQ(evict::PyramidKVPolicy::budgets(4096, 512, 64, 20, 24), std::vector<int64_t>(24, 512));
  // Clipping: max = 2·60 − 6 = 114 > T − w = 96 → max 96, min = 24.
  EXPECT_EQ(evict::PyramidKVPolicy::budgets(100, 60, 4, 10, 3), (std::vector<int64_t>{96, 60, 24}));
}

TEST(PyramidKVPolicy, PerLayerPlansAtPrefillEnd) {
  // 3 layers, 20-token prompt, budget 50% of 20 → n = 10; β = 2 → [15, 10, 5].
  auto p = make("pyramid:w2:k1:b2@50%", 20, /*hq=*/2, /*hkv=*/2, /*layers=*/3);
  EXPECT_EQ(p->spec(), "pyramid:w2:k1:b2@50%");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  for (int64_t l = 0; l < 3; ++l) p->observe(l, at::softmax(at::randn({1, 2, 4, 20}, gen), -1));
  const int64_t want[] = {15, 10, 5};
  for (int64_t l = 0; l < 3; ++l) {
    auto rows = step_rows(*p, ctx_for(l, 20, 20, true));
    ASSERT_EQ(rows.size(), 2u);
    EXPECT_EQ(static_cast<int64_t>(rows[0].size()), want[l]) << "layer " << l;
    EXPECT_EQ(rows[0].back(), 19);
    EXPECT_EQ(rows[1][rows[1].size() - 2], 18);  // the window w = 2 is kept
    EXPECT_EQ(p->layer_budget(l), want[l]);
  }
  EXPECT_FALSE(p->needs_attention());
}

}  // namespace
}  // namespace kvcache
