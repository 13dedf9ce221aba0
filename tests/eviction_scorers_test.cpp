// SPDX-License-Identifier: Apache-2.0
// Exact small cases for the 2024-2026 eviction methods: Knorm, KeyDiff, Expected Attention,
// AdaKV, DuoAttention and decode-time compression (docs/policies.md, methods.md b.13). Keys and
// values reach the policies through a TensorLayerView; scores are checked against hand-worked
// numbers and against plain at:: references.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "cache_test_util.h"
#include "eviction_test_util.h"
#include "evict/policies.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/layer_view.h"
#include "kvcache/torch.h"

namespace kvcache {
namespace {

using testing::kept_rows;
using testing::Rows;
constexpr float kInf = std::numeric_limits<float>::infinity();

EvictionContext ctx_of(int64_t layer, std::vector<int64_t> resident, StepKind step = StepKind::kDecode,
                       const LayerView* view = nullptr, int64_t logical = -1, int64_t new_tokens = 1) {
  EvictionContext c;
  c.layer = layer;
  c.resident = std::move(resident);
  c.step = step;
  c.view = view;
  c.new_tokens = new_tokens;
  int64_t mx = 0;
  for (int64_t t : c.resident) mx = std::max(mx, t);
  c.logical_length = logical < 0 ? mx : logical;
  return c;
}


Rows plan_rows(const EvictionPolicy& p, const EvictionContext& c) { return kept_rows(p.plan(c), c); }

/// One layer's end of step as CacheManager::end_step drives it; the kept rows.
Rows step_rows(EvictionPolicy& p, const EvictionContext& c) {
  const EvictionPlan plan = p.plan(c);
  if (!plan.empty()) p.on_evicted(c.layer, plan);
  EvictionContext after = c;
  after.view = nullptr;
  p.on_step_end(after);
  return kept_rows(plan, c);
}

std::unique_ptr<EvictionPolicy> make(const std::string& spec, int64_t context, int64_t hq = 2, int64_t hkv = 2,
                                     int64_t layers = 1) {
  auto p = make_eviction_policy(spec);
  p->reset(context, CacheShape{layers, hq, hkv});
  return p;
}

const evict::ScorerPolicy& scorer(const EvictionPolicy& p) {
  const auto* s = dynamic_cast<const evict::ScorerPolicy*>(&p);
  EXPECT_NE(s, nullptr) << p.spec();
  return *s;
}

/// Keys with given rows per head (D = row length); values = keys; positions 0..T-1.
TensorLayerView keys_view(const std::vector<std::vector<std::vector<float>>>& heads, RopeFn rope = {}) {
  std::vector<at::Tensor> k, v, p;
  int64_t next = 0;
  for (const auto& rows : heads) {
    const int64_t t = static_cast<int64_t>(rows.size()), d = static_cast<int64_t>(rows.at(0).size());
    auto kt = at::empty({t, d}, at::kFloat);
    for (int64_t i = 0; i < t; ++i) {
      for (int64_t j = 0; j < d; ++j) kt[i][j] = rows[static_cast<size_t>(i)][static_cast<size_t>(j)];
    }
    k.push_back(kt);
    v.push_back(kt.clone());
    p.push_back(at::arange(t, at::kLong));
    next = std::max(next, t);
  }
  return TensorLayerView(views(k), views(v), views(p), next, std::move(rope));
}

/// The identity "RoPE" (cos 1, sin 0): a rotate-half RoPE whose mean rotation is I.
at::Tensor identity_rope(const at::Tensor& x, const at::Tensor& positions) {
  (void)positions;
  return x.clone();
}

// ---------------------------------------------------------------- factory

TEST(ScorerFactory, NewSpecsRoundTrip) {
  for (const std::string spec :
       {"knorm@50%", "knorm:stream@64", "keydiff@50%", "keydiff:stream@8", "expected@50%",
        "expected:n64:s2:mean:novnorm:stream@32", "expected:e0.5@50%", "duo:s4:r8@50%", "duo:s2:r4:f0.5",
        "duo:w16@50%", "adakv:snapkv@50%", "adakv:a0.5:h2o:r8@64", "adakv:expected:stream@50%", "adakv:tova@16",
        "adakv:pyramid:w4@50%", "decode:knorm@2048", "decode:i64:b16:prefill:adakv:expected@50%",
        "adakv:decode:i8:b8:h2o@64", "decode:i4:b0:tova@8"}) {
    auto p = make_eviction_policy(spec);
    EXPECT_EQ(p->spec(), spec);
    EXPECT_EQ(make_eviction_policy(p->spec())->spec(), spec);
  }
  EXPECT_EQ(make_eviction_policy("adakv:a0.2:snapkv:w32@50%")->spec(), "adakv:snapkv@50%");
  EXPECT_EQ(make_eviction_policy("decode:i512:b256:decodeonly:knorm:once@1024")->spec(), "decode:knorm@1024");
  EXPECT_EQ(make_eviction_policy("expected:n512:s4:e0:cov:vnorm:once@10")->spec(), "expected@10");
  // Attention-free scorers leave the fused attention kernels alone.
  for (const std::string spec : {"knorm@8", "keydiff@8", "expected@8", "duo:s2:r2@8", "adakv:knorm@8"}) {
    EXPECT_FALSE(make_eviction_policy(spec)->needs_attention()) << spec;
  }
  EXPECT_TRUE(make_eviction_policy("expected@8")->query_need().pre_rope);
  EXPECT_TRUE(make_eviction_policy("adakv:h2o@8")->needs_attention());  // forwards its scorer's need
}

/// The message of the InvalidArgument (or CapacityError) `spec` throws.
template <class E>
std::string error_of(const std::string& spec) {
  try {
    (void)make_eviction_policy(spec);
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << spec << " did not throw";
  return "";
}

TEST(ScorerFactory, ErrorsNameTheWholeSpec) {
  std::string m = error_of<InvalidArgument>("adakv:h2o:x3@50%");
  EXPECT_NE(m.find("eviction policy 'adakv:h2o:x3@50%'"), std::string::npos) << m;
  EXPECT_NE(m.find("unknown field 'x3'"), std::string::npos) << m;
  m = error_of<InvalidArgument>("adakv@50%");
  EXPECT_NE(m.find("'adakv' wraps a policy"), std::string::npos) << m;
  m = error_of<InvalidArgument>("adakv:window@50%");
  EXPECT_NE(m.find("adakv wraps a scorer"), std::string::npos) << m;
  EXPECT_NE(m.find("'window@50%'"), std::string::npos) << m;
  m = error_of<InvalidArgument>("adakv:adakv:h2o@50%");
  EXPECT_NE(m.find("already head-wise"), std::string::npos) << m;
  m = error_of<InvalidArgument>("adakv:decode:adakv:h2o@50%");
  EXPECT_NE(m.find("already head-wise"), std::string::npos) << m;
  m = error_of<InvalidArgument>("decode:snapkv@50%");
  EXPECT_NE(m.find("scores only at the end of the prompt"), std::string::npos) << m;
  m = error_of<InvalidArgument>("decode:adakv:decode:h2o@50%");
  EXPECT_NE(m.find("already compresses on a decode-time schedule"), std::string::npos) << m;
  m = error_of<InvalidArgument>("adakv:a2:h2o@50%");
  EXPECT_NE(m.find("a=2 out of range [0, 1]"), std::string::npos) << m;
  EXPECT_NE(error_of<InvalidArgument>("knorm").find("knorm needs a budget"), std::string::npos);
  EXPECT_NE(error_of<InvalidArgument>("duo:s2").find("not neither"), std::string::npos);
  EXPECT_NE(error_of<InvalidArgument>("duo:f0.5@50%").find("not both"), std::string::npos);
  m = error_of<CapacityError>("decode:b8:knorm@8");
  EXPECT_NE(m.find("eviction policy 'decode:b8:knorm@8'"), std::string::npos) << m;
  EXPECT_NE(m.find("must exceed the b8 newest tokens"), std::string::npos) << m;
  EXPECT_NE(error_of<CapacityError>("expected:s8@8").find("must exceed the 8 sink tokens"), std::string::npos);
  // A fractional budget that does not fit is named with the whole spec when the request starts.
  auto p = make_eviction_policy("adakv:h2o:r8@10%");
  try {
    p->reset(40, CacheShape{1, 2, 2});
    FAIL() << "expected CapacityError";
  } catch (const CapacityError& e) {
    EXPECT_NE(std::string(e.what()).find("eviction policy 'adakv:h2o:r8@10%': h2o: budget of 4"), std::string::npos)
        << e.what();
  }
}

TEST(ScorerFactory, BudgetAtLeastContextEvictsNothing) {
  for (const std::string spec : {"knorm@100%", "keydiff:stream@100%", "expected@100%", "duo:s2:r2@100%",
                                 "adakv:knorm:stream@100%", "decode:i1:b1:knorm@100%"}) {
    auto p = make(spec, 12);
    const auto view = keys_view({std::vector<std::vector<float>>(12, {1.0f, 2.0f}),
                                 std::vector<std::vector<float>>(12, {3.0f, 1.0f})});
    EXPECT_TRUE(p->plan(ctx_of(0, {12, 12}, StepKind::kPrefillEnd, &view)).empty()) << spec;
    EXPECT_TRUE(p->plan(ctx_of(0, {12, 12}, StepKind::kDecode, &view)).empty()) << spec;
  }
}

// ---------------------------------------------------------------- knorm

TEST(KnormPolicy, KeepsLowNormKeysTiesKeepTheMoreRecent) {
  // Head 0 norms [2, 1, 2, 5, 3, 4]: the two lowest before the newest are 1 (index 1) and a tie
  // of 2 at indices 0 and 2, won by the more recent; the newest (norm 4) is kept anyway.
  // Head 1 norms [1, 1, 1, 1, 9, 9]: a four-way tie → the two most recent, 2 and 3.
  const auto view = keys_view({{{2, 0}, {0, 1}, {0, 2}, {3, 4}, {3, 0}, {0, 4}},
                               {{1, 0}, {0, 1}, {1, 0}, {0, 1}, {9, 0}, {0, 9}}});
  auto p = make("knorm:stream@3", 0, 14, 2);
  const auto s = scorer(*p).score(ctx_of(0, {6, 6}, StepKind::kDecode, &view));
  EXPECT_EQ(s[0], (std::vector<float>{-2, -1, -2, -5, -3, -4}));
  EXPECT_EQ(plan_rows(*p, ctx_of(0, {6, 6}, StepKind::kDecode, &view)), (Rows{{1, 2, 5}, {2, 3, 5}}));
}

TEST(KnormPolicy, OnceAtThePromptEndReservesDecodeTokens) {
  // 6-token prompt of a 7-token request, budget 4: keep 4 − 1 = 3 at the prompt's end.
  const auto view = keys_view({{{6, 0}, {1, 0}, {5, 0}, {2, 0}, {4, 0}, {9, 0}}});
  auto p = make("knorm@4", 7, 2, 1);
  EXPECT_TRUE(p->plan(ctx_of(0, {6}, StepKind::kPrefill, &view)).empty());  // not the prompt's end
  EXPECT_EQ(step_rows(*p, ctx_of(0, {6}, StepKind::kPrefillEnd, &view)), (Rows{{1, 3, 5}}));
  // Decode tokens are appended, never evicted.
  const auto later = keys_view({{{1, 0}, {2, 0}, {9, 0}, {9, 0}}});
  EXPECT_TRUE(p->plan(ctx_of(0, {4}, StepKind::kDecode, &later, 7)).empty());
  // Without a view it cannot score.
  auto q = make("knorm:stream@2", 0, 2, 1);
  EXPECT_THROW(q->plan(ctx_of(0, {4})), InvalidArgument);
  // A view that disagrees with the context is an error, not a misread.
  EXPECT_THROW(q->plan(ctx_of(0, {5}, StepKind::kDecode, &later)), InvalidArgument);
}

// ---------------------------------------------------------------- keydiff

TEST(KeyDiffPolicy, KeepsTheKeysLeastLikeTheMeanDirection) {
  // Keys [1,0] ×3, [0,1], [−1,0], newest [2,0]: anchor = mean of the normalised keys =
  // (4·[1,0] + [0,1] + [−1,0]) / 6 = [1/2, 1/6]; −cos = −0.94868 for [1,0], −0.31623 for [0,1],
  // +0.94868 for [−1,0].
  const auto view = keys_view({{{1, 0}, {1, 0}, {1, 0}, {0, 1}, {-1, 0}, {2, 0}}});
  auto p = make("keydiff:stream@3", 0, 7, 1);
  const auto s = scorer(*p).score(ctx_of(0, {6}, StepKind::kDecode, &view));
  const double c = 0.5 / std::sqrt(0.25 + 1.0 / 36), c2 = (1.0 / 6) / std::sqrt(0.25 + 1.0 / 36);
  const double want[] = {-c, -c, -c, -c2, c, -c};
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(s[0][static_cast<size_t>(i)], want[i], 1e-6) << i;
  EXPECT_EQ(plan_rows(*p, ctx_of(0, {6}, StepKind::kDecode, &view)), (Rows{{3, 4, 5}}));
  // One more slot: a three-way tie among the [1,0] keys, won by the most recent (2).
  auto q = make("keydiff:stream@4", 0, 7, 1);
  EXPECT_EQ(plan_rows(*q, ctx_of(0, {6}, StepKind::kDecode, &view)), (Rows{{2, 3, 4, 5}}));
  // A zero key has no direction: its score is 0, finite.
  const auto zero = keys_view({{{0, 0}, {1, 0}, {0, 1}}});
  const auto z = scorer(*q).score(ctx_of(0, {3}, StepKind::kDecode, &zero));
  EXPECT_EQ(z[0][0], 0.0f);
  EXPECT_TRUE(std::isfinite(z[0][1]) && std::isfinite(z[0][2]));
}

// ---------------------------------------------------------------- expected attention

/// Feeds `q` `[H_q, n, D]` pre-RoPE rows (post = pre under the identity RoPE) at positions.
void feed_queries(EvictionPolicy& p, int64_t layer, const at::Tensor& q, const std::vector<int64_t>& positions,
                  const LayerView& view) {
  QueryRows rows;
  rows.num_q_heads = q.size(0);
  rows.head_dim = q.size(2);
  rows.positions = positions;
  const auto c = q.contiguous();
  rows.post_rope.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  rows.pre_rope = rows.post_rope;
  p.observe_queries(layer, rows, view);
}

TEST(ExpectedAttentionPolicy, MeanQueriesAndValueNormsHandWorked) {
  // D = 2, one KV head, G = 2, no sinks, the identity RoPE (R̄ = I). Query head 0 always [2, 0],
  // head 1 always [0, 2]: logits μ·k/√2 over keys [1,0], [0,1], [0,0], [1,1] are [√2, 0, 0, √2]
  // and [0, √2, 0, √2]; softmax (e^√2 = 4.11325) → [.40222, .09778, .09778, .40222] and
  // [.09778, .40222, .09778, .40222]; group mean [.25, .25, .09778, .40222]; × ‖v‖ = [1, 3, 5, .5].
  std::vector<at::Tensor> k = {at::tensor({1.f, 0.f, 0.f, 1.f, 0.f, 0.f, 1.f, 1.f}).view({4, 2})};
  std::vector<at::Tensor> v = {at::tensor({1.f, 0.f, 0.f, 3.f, 5.f, 0.f, 0.f, .5f}).view({4, 2})};
  const TensorLayerView view(views(k), views(v), views({at::arange(4, at::kLong)}), 4, rope_from(identity_rope));
  auto p = make("expected:s0:mean:stream@2", 0, 2, 1);
  auto q = at::zeros({2, 3, 2});
  q.select(0, 0).select(1, 0).fill_(2.0f);
  q.select(0, 1).select(1, 1).fill_(2.0f);
  feed_queries(*p, 0, q, {0, 1, 2}, view);
  const auto s = scorer(*p).score(ctx_of(0, {4}, StepKind::kDecode, &view));
  const double e = std::exp(std::sqrt(2.0)), big = e / (2 * e + 2), small = 1 / (2 * e + 2);
  const double want[] = {(big + small) / 2, 3 * (big + small) / 2, 5 * small, 0.5 * big};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(s[0][static_cast<size_t>(i)], want[i], 1e-6) << i;
  // Keep 2: the newest (protected) and token 1 (0.75); token 2's attention is low but ‖v‖ = 5
  // puts it next (0.489 > 0.25).
  EXPECT_EQ(plan_rows(*p, ctx_of(0, {4}, StepKind::kDecode, &view)), (Rows{{1, 3}}));
  auto p3 = make("expected:s0:mean:stream@3", 0, 2, 1);
  feed_queries(*p3, 0, q, {0, 1, 2}, view);
  EXPECT_EQ(plan_rows(*p3, ctx_of(0, {4}, StepKind::kDecode, &view)), (Rows{{1, 2, 3}}));
  // Without the value norm: the attention alone, [.25, .25, .0978, .4022] → a tie at .25 that
  // the more recent (1) wins.
  auto nv = make("expected:s0:mean:novnorm:stream@2", 0, 2, 1);
  feed_queries(*nv, 0, q, {0, 1, 2}, view);
  EXPECT_EQ(plan_rows(*nv, ctx_of(0, {4}, StepKind::kDecode, &view)), (Rows{{1, 3}}));
}

TEST(ExpectedAttentionPolicy, CovarianceTermAndSinks) {
  // One query head alternating [2, 0] and [−2, 0]: μ = 0, Σ = diag(4, 0), so the logit of k is
  // kᵀΣk / (2·2) = k₀². Keys [1,0], [0,1], [0,0] → logits [1, 0, 0] → softmax
  // [e/(e+2), 1/(e+2), 1/(e+2)]. With the mean only every logit is 0 → 1/3 each.
  std::vector<at::Tensor> k = {at::tensor({1.f, 0.f, 0.f, 1.f, 0.f, 0.f}).view({3, 2})};
  const at::Tensor v0 = k[0].clone(), p0 = at::arange(3, at::kLong);
  const TensorLayerView view(views(k), {TensorView(v0)}, {TensorView(p0)}, 3, rope_from(identity_rope));
  auto q = at::tensor({2.f, 0.f, -2.f, 0.f}).view({1, 2, 2});
  auto cov = make("expected:s0:novnorm:stream@2", 0, 1, 1);
  feed_queries(*cov, 0, q, {0, 1}, view);
  auto s = scorer(*cov).score(ctx_of(0, {3}, StepKind::kDecode, &view));
  const double e = std::exp(1.0);
  EXPECT_NEAR(s[0][0], e / (e + 2), 1e-6);
  EXPECT_NEAR(s[0][1], 1 / (e + 2), 1e-6);
  EXPECT_NEAR(s[0][2], 1 / (e + 2), 1e-6);
  auto mean = make("expected:s0:mean:novnorm:stream@2", 0, 1, 1);
  feed_queries(*mean, 0, q, {0, 1}, view);
  s = scorer(*mean).score(ctx_of(0, {3}, StepKind::kDecode, &view));
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(s[0][static_cast<size_t>(i)], 1.0 / 3, 1e-6);
  // Sink s1: token 0 is kept whatever its score, the softmax runs over tokens 1..2, and the
  // query at position 0 is not fitted (kvpress drops the first n_sink states).
  auto sink = make("expected:s1:novnorm:stream@2", 0, 1, 1);
  feed_queries(*sink, 0, q, {0, 1}, view);
  EXPECT_EQ(dynamic_cast<const evict::ExpectedAttentionPolicy&>(*sink).queries_seen(0), 1);
  s = scorer(*sink).score(ctx_of(0, {3}, StepKind::kDecode, &view));
  EXPECT_EQ(s[0][0], kInf);
  EXPECT_NEAR(s[0][1], 0.5, 1e-6);  // one query [−2, 0]: μ = [−2, 0], Σ = 0 → logits 0, 0
  EXPECT_NEAR(s[0][2], 0.5, 1e-6);
  EXPECT_EQ(plan_rows(*sink, ctx_of(0, {3}, StepKind::kDecode, &view)), (Rows{{0, 2}}));  // tie: the newest
  // No query past the sinks yet: it cannot score.
  auto none = make("expected:s4:stream@5", 0, 1, 1);
  feed_queries(*none, 0, q, {0, 1}, view);
  EXPECT_THROW(scorer(*none).score(ctx_of(0, {3}, StepKind::kDecode, &view)), InvalidArgument);
}

TEST(ExpectedAttentionPolicy, MeanRotationOfTheNextPositions) {
  // RoPE of D = 2 (θ = 1): the mean of cos(p) and sin(p) over p = 10 .. 14.
  using Ts = std::vector<at::Tensor>;
  const TensorLayerView view(views(Ts{at::zeros({1, 2})}), views(Ts{at::zeros({1, 2})}),
                             views(Ts{at::zeros({1}, at::kLong)}), 10, rope_from(testing::test_rope));
  float c = 0, s = 0;
  view.mean_rotation(10, 5, &c, &s);
  double wc = 0, ws = 0;
  for (int p = 10; p < 15; ++p) {
    wc += std::cos(p) / 5;
    ws += std::sin(p) / 5;
  }
  EXPECT_NEAR(c, wc, 1e-6);
  EXPECT_NEAR(s, ws, 1e-6);
  const TensorLayerView bare(views(Ts{at::zeros({1, 2})}), views(Ts{at::zeros({1, 2})}),
                             views(Ts{at::zeros({1}, at::kLong)}), 10);
  EXPECT_THROW(bare.mean_rotation(10, 5, &c, &s), UnsupportedError);
}

/// kvpress's ExpectedAttentionPress score in plain at:: ops: q `[H_q, n, D]` pre-RoPE rows,
/// k, v `[H_kv, T, D]`, the mean rotation (c̄, s̄) `[D/2]`.
at::Tensor expected_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& c,
                              const at::Tensor& s, int64_t sinks) {
  const int64_t hq = q.size(0), d = q.size(2), hkv = k.size(0), t = k.size(1), G = hq / hkv;
  const auto qd = q.to(at::kDouble);
  const auto mu = qd.mean(1);                                            // [H_q, D]
  const auto cen = qd - mu.unsqueeze(1);
  const auto cov = at::matmul(cen.transpose(1, 2), cen) / q.size(1);     // [H_q, D, D]
  // R̄ = diag(c̄, c̄) + P·diag(s̄, s̄), P = [[0, −I], [I, 0]] (rotate_half as a matrix).
  auto R = at::zeros({d, d}, at::kDouble);
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    R[i][i] = c[i].item<double>();
    R[i + half][i + half] = c[i].item<double>();
    R[i][i + half] = -s[i].item<double>();
    R[i + half][i] = s[i].item<double>();
  }
  const auto mu_r = at::matmul(mu, R.t());                               // [H_q, D]
  const auto cov_r = at::matmul(at::matmul(R, cov), R.t());              // [H_q, D, D]
  const auto kk = k.to(at::kDouble).narrow(1, sinks, t - sinks);         // [H_kv, m, D]
  const auto kg = kk.repeat_interleave(G, 0);                            // [H_q, m, D]
  auto z = (kg * mu_r.unsqueeze(1)).sum(-1) / std::sqrt(static_cast<double>(d));
  z = z + (at::matmul(kg, cov_r) * kg).sum(-1) / (2.0 * d);
  const auto p = at::softmax(z, -1).view({hkv, G, t - sinks}).mean(1);   // [H_kv, m]
  return p * v.to(at::kDouble).narrow(1, sinks, t - sinks).norm(2, -1);
}

TEST(ExpectedAttentionPolicy, MatchesThePlainReferenceWithGqaAndRope) {
  // 14 query heads over 2 KV heads (G = 7), D = 8, the test RoPE, random pre-RoPE queries.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const int64_t hq = 14, hkv = 2, d = 8, t = 20, n = 12;
  const auto q = testing::randn({hq, n, d}, gen) + 0.5;
  const auto k = testing::randn({1, hkv, t, d}, gen), v = testing::randn({1, hkv, t, d}, gen);
  const auto pos = at::arange(t, at::kLong).unsqueeze(0).repeat({hkv, 1}).contiguous();
  const TensorLayerView view(k, v, pos, t, rope_from(testing::test_rope));
  auto p = make("expected:n16:s2:stream@10", 0, hq, hkv);
  std::vector<int64_t> qpos;
  for (int64_t i = 0; i < n; ++i) qpos.push_back(i + 2);  // every row at a position >= s
  feed_queries(*p, 0, q, qpos, view);
  const auto got = scorer(*p).score(ctx_of(0, {t, t}, StepKind::kDecode, &view));
  std::vector<float> c(d / 2), s(d / 2);
  view.mean_rotation(t, 16, c.data(), s.data());
  const auto want = expected_reference(q, k[0], v[0], at::tensor(c), at::tensor(s), 2);
  for (int64_t h = 0; h < hkv; ++h) {
    EXPECT_EQ(got[h][0], kInf);
    EXPECT_EQ(got[h][1], kInf);
    for (int64_t j = 2; j < t; ++j) {
      EXPECT_NEAR(got[static_cast<size_t>(h)][static_cast<size_t>(j)], want[h][j - 2].item<double>(), 1e-6)
          << "head " << h << " token " << j;
    }
  }
}

// ---------------------------------------------------------------- adakv

/// Attention mass `[1, 14, 1, T]` whose group means are the given per-KV-head rows; the 7
/// query heads of a group differ (a per-head reduction other than the mean would differ).
at::Tensor gqa_mass(const std::vector<std::vector<float>>& group_means) {
  const int64_t t = static_cast<int64_t>(group_means[0].size());
  auto p = at::zeros({1, 14, 1, t});
  for (int64_t g = 0; g < 2; ++g) {
    for (int64_t j = 0; j < t; ++j) {
      const float m = group_means[static_cast<size_t>(g)][static_cast<size_t>(j)];
      p[0][g * 7][0][j] = 7 * m;  // one head of the group carries the whole mass
    }
  }
  return p;
}

TEST(AdaKVPolicy, FloorPerHeadThenGlobalTopPairs) {
  // h2o:r1@4 keeps n = 4 per head; AdaKV keeps 2·4 = 8 over the layer, a floor of ⌊0.5·4⌋ = 2
  // per head (the protected newest counts in it).
  auto p = make("adakv:a0.5:h2o:r1@4", 0, 14, 2);
  p->observe(0, gqa_mass({{0.30f, 0.25f, 0.20f, 0.15f, 0.01f, 0.01f, 0.01f, 0.07f},
                          {0.02f, 0.02f, 0.02f, 0.02f, 0.05f, 0.03f, 0.04f, 0.80f}}));
  // Floors: head 0 {7, 0}, head 1 {7, 4}. The other 4 slots, globally: 0.25, 0.20, 0.15 (head 0)
  // and 0.04 (head 1, token 6). Head 0 keeps 5 tokens, head 1 keeps 3.
  EXPECT_EQ(plan_rows(*p, ctx_of(0, {8, 8})), (Rows{{0, 1, 2, 3, 7}, {4, 6, 7}}));
  // Uniform H2O with the same scores keeps 4 and 4.
  auto u = make("h2o:r1@4", 0, 14, 2);
  u->observe(0, gqa_mass({{0.30f, 0.25f, 0.20f, 0.15f, 0.01f, 0.01f, 0.01f, 0.07f},
                          {0.02f, 0.02f, 0.02f, 0.02f, 0.05f, 0.03f, 0.04f, 0.80f}}));
  EXPECT_EQ(plan_rows(*u, ctx_of(0, {8, 8})), (Rows{{0, 1, 2, 7}, {4, 5, 6, 7}}));
  // α = 0: no floor; the 6 free slots all go to head 0, head 1 keeps only its newest token.
  auto z = make("adakv:a0:h2o:r1@4", 0, 14, 2);
  z->observe(0, gqa_mass({{0.30f, 0.25f, 0.20f, 0.15f, 0.14f, 0.13f, 0.12f, 0.07f},
                          {0.02f, 0.02f, 0.02f, 0.02f, 0.05f, 0.03f, 0.04f, 0.80f}}));
  EXPECT_EQ(plan_rows(*z, ctx_of(0, {8, 8})), (Rows{{0, 1, 2, 3, 4, 5, 7}, {7}}));
}

TEST(AdaKVPolicy, RaggedHeadsKeepTheLayerTotalAndTiesEvictTheOlderThenTheLowerHead) {
  // Heads of 5 and 3 tokens (after an earlier head-wise step), knorm scores, n = 3 → keep 6.
  auto p = make("adakv:a0:knorm:stream@3", 0, 14, 2);
  const auto view = keys_view({{{1, 0}, {1, 0}, {4, 0}, {2, 0}, {9, 0}}, {{1, 0}, {3, 0}, {9, 0}}});
  // Candidates (newest excluded): head 0 [−1, −1, −4, −2], head 1 [−1, −3]. Evict 2: −4 (h0 t2)
  // and −3 (h1 t1).
  EXPECT_EQ(plan_rows(*p, ctx_of(0, {5, 3}, StepKind::kDecode, &view)), (Rows{{0, 1, 3, 4}, {0, 2}}));
  // A layer within the total evicts nothing, however its heads are split.
  EXPECT_TRUE(p->plan(ctx_of(0, {4, 2})).empty());
  // Equal scores everywhere: the older token goes first (more tokens after it in its head),
  // then the lower head. Keep 2·2 = 4 of 8: evict head 0's indices 0 (4 newer) and 1 (3 newer),
  // then head 0 index 2 and head 1 index 0 (2 newer each): the lower head first.
  auto q = make("adakv:a0:knorm:stream@2", 0, 14, 2);
  const auto flat = keys_view({{{1, 0}, {1, 0}, {1, 0}, {1, 0}, {1, 0}}, {{1, 0}, {1, 0}, {1, 0}}});
  EXPECT_EQ(plan_rows(*q, ctx_of(0, {5, 3}, StepKind::kDecode, &flat)), (Rows{{3, 4}, {1, 2}}));
}

TEST(AdaKVPolicy, WrapsSnapKVOnceAtThePromptsEnd) {
  // adakv:snapkv at the end of a 10-token prompt: SnapKV keeps 5 per head (window w2 kept);
  // AdaKV keeps 10 over the two heads.
  auto p = make("adakv:a0:snapkv:w2:k1@5", 10, 14, 2);
  auto probs = at::zeros({1, 14, 2, 10});
  const float h0[] = {0.4f, 0.3f, 0.2f, 0.1f, 0.05f, 0.01f, 0.01f, 0.01f};
  const float h1[] = {0.01f, 0.01f, 0.01f, 0.01f, 0.01f, 0.02f, 0.02f, 0.02f};
  for (int64_t r = 0; r < 2; ++r) {
    for (int64_t j = 0; j < 8; ++j) {
      probs[0][0][r][j] = 7 * h0[j];
      probs[0][7][r][j] = 7 * h1[j];
    }
  }
  p->observe(0, probs);
  EXPECT_TRUE(p->plan(ctx_of(0, {10, 10}, StepKind::kPrefill)).empty());
  // Protected: windows {8, 9} in both heads (4 slots); 6 more from the prefixes: head 0's 0.4,
  // 0.3, 0.2, 0.1, 0.05 and then the 0.02 ties of head 1 (tokens 5..7; ties keep the newer):
  // head 1 token 7.
  EXPECT_EQ(step_rows(*p, ctx_of(0, {10, 10}, StepKind::kPrefillEnd)), (Rows{{0, 1, 2, 3, 4, 8, 9}, {7, 8, 9}}));
  EXPECT_FALSE(p->needs_attention());  // SnapKV is done after the prompt
  EXPECT_TRUE(p->plan(ctx_of(0, {8, 4}, StepKind::kDecode)).empty());
}

// ---------------------------------------------------------------- decode-time compression

TEST(DecodeCompressionPolicy, EveryIntervalBackToTheTargetKeepingTheBuffer) {
  // decode:i3:b2 over knorm, target 3. Norms grow with the index except token 1 (norm 0.5).
  auto p = make("decode:i3:b2:knorm@3", 0, 2, 1);
  auto norms_view = [](int64_t t) {
    std::vector<std::vector<float>> rows;
    for (int64_t i = 0; i < t; ++i) rows.push_back({i == 1 ? 0.5f : static_cast<float>(i + 1), 0.0f});
    return keys_view({rows});
  };
  // The prompt (6 tokens) stays whole: no prefill compression without `prefill`.
  const auto v6 = norms_view(6);
  EXPECT_TRUE(step_rows(*p, ctx_of(0, {6}, StepKind::kPrefillEnd, &v6)).empty());
  const auto v7 = norms_view(7), v8 = norms_view(8), v9 = norms_view(9);
  EXPECT_TRUE(step_rows(*p, ctx_of(0, {7}, StepKind::kDecode, &v7)).empty());  // decoded 1
  EXPECT_TRUE(step_rows(*p, ctx_of(0, {8}, StepKind::kDecode, &v8)).empty());  // decoded 2
  // Decoded 3: back to 3 tokens = the buffer {7, 8} + the best other (token 1, norm 0.5).
  EXPECT_EQ(step_rows(*p, ctx_of(0, {9}, StepKind::kDecode, &v9)), (Rows{{1, 7, 8}}));
  // The count restarts: the next two steps keep everything.
  const auto v4 = norms_view(4), v5 = norms_view(5);
  EXPECT_TRUE(step_rows(*p, ctx_of(0, {4}, StepKind::kDecode, &v4)).empty());
  EXPECT_TRUE(step_rows(*p, ctx_of(0, {5}, StepKind::kDecode, &v5)).empty());
  // With `prefill` the prompt is compressed to the target at its end as well.
  auto q = make("decode:i3:b2:prefill:knorm@3", 0, 2, 1);
  EXPECT_EQ(step_rows(*q, ctx_of(0, {6}, StepKind::kPrefillEnd, &v6)), (Rows{{1, 4, 5}}));
  EXPECT_EQ(q->token_budget(), 3);
}

TEST(DecodeCompressionPolicy, OverAdaKVSelectsHeadWise) {
  auto p = make("decode:i1:b1:adakv:a0:knorm@2", 0, 2, 2);
  // Head 0 norms [1, 1, 1, 5], head 1 [9, 9, 9, 5]; keep 4 over both: the two buffers (newest)
  // and the two best others, both in head 0.
  const auto view = keys_view({{{1, 0}, {1, 0}, {1, 0}, {5, 0}}, {{9, 0}, {9, 0}, {9, 0}, {5, 0}}});
  EXPECT_EQ(plan_rows(*p, ctx_of(0, {4, 4}, StepKind::kDecode, &view)), (Rows{{1, 2, 3}, {3}}));
}

// ---------------------------------------------------------------- duo

/// Plain at:: reference of DuoAttention's head deviation: rows q `[G, n, D]` at positions qpos,
/// keys/values `[T, D]` at positions 0..T−1.
double duo_reference(const at::Tensor& q, const std::vector<int64_t>& qpos, const at::Tensor& k, const at::Tensor& v,
                     int64_t sinks, int64_t recent) {
  const int64_t G = q.size(0), n = q.size(1), t = k.size(0), d = k.size(1);
  double total = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < n; ++r) {
      const int64_t vis = std::min<int64_t>(qpos[static_cast<size_t>(r)] + 1, t);
      const auto z = at::matmul(k.narrow(0, 0, vis).to(at::kDouble), q[g][r].to(at::kDouble)) / std::sqrt(double(d));
      const auto o = at::matmul(at::softmax(z, 0), v.narrow(0, 0, vis).to(at::kDouble));
      auto keep = at::zeros({vis}, at::kBool);
      for (int64_t j = 0; j < vis; ++j) keep[j] = j < sinks || j >= vis - recent;
      const auto zs = z.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
      const auto os = at::matmul(at::softmax(zs, 0), v.narrow(0, 0, vis).to(at::kDouble));
      total += ((o - os).norm() / o.norm()).item<double>();
    }
  }
  return total / static_cast<double>(G * n);
}

TEST(DuoAttentionPolicy, HeadDeviationMatchesThePlainReference) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const int64_t hkv = 2, G = 7, d = 8, t = 24, n = 5;
  const auto k = testing::randn({1, hkv, t, d}, gen), v = testing::randn({1, hkv, t, d}, gen);
  const TensorLayerView view(k, v, at::arange(t, at::kLong).unsqueeze(0).repeat({hkv, 1}).contiguous(), t);
  const auto q = testing::randn({hkv * G, n, d}, gen) * 2.0;
  QueryRows rows;
  rows.num_q_heads = hkv * G;
  rows.head_dim = d;
  rows.positions = {10, 15, 19, 22, 23};
  rows.post_rope.assign(q.contiguous().data_ptr<float>(), q.contiguous().data_ptr<float>() + q.numel());
  for (int64_t h = 0; h < hkv; ++h) {
    const double want = duo_reference(q.narrow(0, h * G, G), rows.positions, k[0][h], v[0][h], 2, 4);
    EXPECT_NEAR(evict::DuoAttentionPolicy::head_deviation(rows, view, h, 2, 4), want, 1e-5) << "head " << h;
  }
  // A head whose keys outside sink + recent get no attention deviates by 0.
  auto kz = at::zeros({1, 1, 6, 2});
  kz[0][0][0][0] = 50.0f;  // the sink takes all the attention
  auto vz = testing::randn({1, 1, 6, 2}, gen);
  const TensorLayerView sinky(kz, vz, at::arange(6, at::kLong).unsqueeze(0), 6);
  QueryRows one;
  one.num_q_heads = 1;
  one.head_dim = 2;
  one.positions = {5};
  one.post_rope = {1.0f, 0.0f};
  EXPECT_NEAR(evict::DuoAttentionPolicy::head_deviation(one, sinky, 0, 1, 1), 0.0, 1e-12);
}

TEST(DuoAttentionPolicy, TheLeastDeviatingHeadsStreamAsTheBudgetNeeds) {
  // 2 layers × 2 KV heads, a 20-token request, budget 10, s1 + r3 = 4: the fewest streaming heads
  // n with n·4 + (4 − n)·20 ≤ 4·10 is ⌈40 / 16⌉ = 3.
  auto p = make("duo:s1:r3:w2@50%", 20, 2, 2, 2);
  auto* duo = dynamic_cast<evict::DuoAttentionPolicy*>(p.get());
  ASSERT_NE(duo, nullptr);
  EXPECT_EQ(duo->streaming_heads(), 3);
  EXPECT_EQ(duo->query_need().rows, 2);
  // Scores from real deviations: layer 0 head 0 attends to a middle token (large deviation), the
  // other heads to the sink (none).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
  const int64_t t = 16, d = 2;
  for (int64_t l = 0; l < 2; ++l) {
    auto k = at::zeros({1, 2, t, d});
    for (int64_t h = 0; h < 2; ++h) k[0][h][0][0] = 30.0f;                 // sink keys
    if (l == 0) k[0][0][8][1] = 60.0f;                                     // a middle key for head (0, 0)
    const auto v = testing::randn({1, 2, t, d}, gen);
    const TensorLayerView view(k, v, at::arange(t, at::kLong).unsqueeze(0).repeat({2, 1}).contiguous(), t);
    QueryRows rows;
    rows.num_q_heads = 2;
    rows.head_dim = d;
    rows.positions = {14, 15};
    rows.post_rope = {1, 1, 1, 1, 1, 1, 1, 1};  // [H_q=2, 2, D=2]
    p->observe_queries(l, rows, view);
  }
  EXPECT_GT(duo->head_scores(0)[0], 0.1f);
  EXPECT_LT(duo->head_scores(0)[1], 1e-6f);
  // At the prompt's end every head but (0, 0) streams: it keeps token 0 and the last 3.
  std::vector<int64_t> all(16);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(step_rows(*p, ctx_of(0, {16, 16}, StepKind::kPrefillEnd)), (Rows{all, {0, 13, 14, 15}}));
  EXPECT_EQ(step_rows(*p, ctx_of(1, {16, 16}, StepKind::kPrefillEnd)), (Rows{{0, 13, 14, 15}, {0, 13, 14, 15}}));
  EXPECT_TRUE(duo->is_streaming(1, 0));
  EXPECT_FALSE(duo->is_streaming(0, 0));
  EXPECT_EQ(duo->query_need().rows, 0);  // classified: no more queries needed
  // Decoding: streaming heads slide (evict the token after the sink), retrieval heads grow.
  std::vector<int64_t> all17(17);
  std::iota(all17.begin(), all17.end(), 0);
  EXPECT_EQ(step_rows(*p, ctx_of(0, {17, 5}, StepKind::kDecode)), (Rows{all17, {0, 2, 3, 4}}));
  // A budget the streaming heads cannot meet even all together is a CapacityError.
  auto tight = make_eviction_policy("duo:s2:r8@50%");
  EXPECT_THROW(tight->reset(18, CacheShape{2, 2, 2}), CapacityError);  // keep 10 >= budget 9
  // The largest context a request may hold, over 2^18 layers × 2^17 KV heads: all · (c − b) passes int64
  // (fuzz_snapshot found it): ⌈2^35 · 5·10^8 / (10^9 − 4)⌉ = 2^34 + 69 heads stream.
  auto huge = make_eviction_policy("duo:s1:r3@50%");
  huge->reset(kMaxTokens, CacheShape{int64_t{1} << 18, int64_t{1} << 17, int64_t{1} << 17});
  EXPECT_EQ(dynamic_cast<const evict::DuoAttentionPolicy&>(*huge).streaming_heads(), (int64_t{1} << 34) + 69);
  EXPECT_THROW(huge->reset(kMaxTokens + 1, CacheShape{2, 2, 2}), InvalidArgument);
  // With a fixed fraction: round(f · L · H_kv) heads stream, whatever the budget.
  EXPECT_EQ(dynamic_cast<const evict::DuoAttentionPolicy&>(*make("duo:s1:r3:f0.5", 20, 2, 2, 2)).streaming_heads(), 2);
}

}  // namespace
}  // namespace kvcache
