// SPDX-License-Identifier: Apache-2.0
// The 2024-2026 eviction methods inside a CacheManager: the read-only view policies get (held to
// get()'s dequantized K/V for every format and key mode), the query rows attend() hands over,
// head-wise budgets (AdaKV, DuoAttention) that free blocks for real, and the config checks.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "cache/cache_manager_access.h"
#include "cache_test_util.h"
#include "evict/policies.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/torch.h"

namespace kvcache {
namespace {

using testing::make_config;
using testing::positions_range;

/// Everything the view hands out for head h: keys, values `[T_h, D]` and positions.
struct Visited {
  std::vector<float> k, v;
  std::vector<int64_t> pos, first;
};

Visited visit_all(const LayerView& view, int64_t h, ViewStreams s) {
  Visited out;
  int64_t expect_first = 0;
  view.visit(h, s, [&](const TokenRun& r) {
    EXPECT_EQ(r.first, expect_first);
    EXPECT_GE(r.n, 1);
    expect_first += r.n;
    out.first.push_back(r.first);
    out.pos.insert(out.pos.end(), r.positions, r.positions + r.n);
    const int64_t d = view.head_dim();
    if (r.keys != nullptr) out.k.insert(out.k.end(), r.keys, r.keys + r.n * d);
    if (r.values != nullptr) out.v.insert(out.v.end(), r.values, r.values + r.n * d);
  });
  EXPECT_EQ(expect_first, view.resident(h));
  return out;
}

// The view decodes the same bytes get() does: bit for bit, for every format, block size, key
// storage, with holes left by eviction.
TEST(LayerView, MatchesGetForEveryFormatAndKeyMode) {
  for (const std::string quant : {"fp32", "fp16", "bf16", "int8", "int4:g4", "int2:g8:chan", "fp8:e4m3:scaled",
                                  "kivi:k2:v4:g4:r8"}) {
    for (const bool pre : {false, true}) {
      for (const int64_t block : {int64_t{0}, int64_t{8}}) {
        auto c = make_config(1, 4, 2, 8, quant, "random:seed3@100");
        if (pre) c.key_storage = KeyStorage::kPreRoPE;
        c.block_tokens = block;
        c.context_length = 200;
        TorchCache m(c);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
        for (int64_t step = 0; step < 11; ++step) {  // 11 × 12 tokens, random eviction to 100
          const int64_t p0 = m.next_position(0);
          m.append(0, testing::randn({1, 2, 12, 8}, gen), testing::randn({1, 2, 12, 8}, gen), positions_range(p0, 12));
          m.end_step(StepKind::kPrefill);
        }
        const std::string where = quant + (pre ? " pre-RoPE" : " post-RoPE") + " block " + std::to_string(block);
        const auto kv = m.get(0);
        const auto view = cache::CacheManagerAccess::view(m.core(), 0);
        EXPECT_EQ(view.next_position(), m.next_position(0)) << where;
        for (int64_t h = 0; h < 2; ++h) {
          const auto got = visit_all(view, h, ViewStreams::kBoth);
          ASSERT_EQ(static_cast<int64_t>(got.pos.size()), 100) << where;
          EXPECT_EQ(got.first, (std::vector<int64_t>{0, 64})) << where;  // runs of kRunTokens, across blocks
          const auto k = kv.k[0][h].contiguous(), v = kv.v[0][h].contiguous();
          EXPECT_TRUE(std::equal(got.k.begin(), got.k.end(), k.data_ptr<float>())) << where << " K head " << h;
          EXPECT_TRUE(std::equal(got.v.begin(), got.v.end(), v.data_ptr<float>())) << where << " V head " << h;
          const auto p = kv.positions[h].contiguous();
          EXPECT_TRUE(std::equal(got.pos.begin(), got.pos.end(), p.data_ptr<int64_t>())) << where;
          const auto only_pos = visit_all(view, h, ViewStreams::kPositions);
          EXPECT_EQ(only_pos.pos, got.pos) << where;
          EXPECT_TRUE(only_pos.k.empty() && only_pos.v.empty()) << where;
        }
      }
    }
  }
}

// A policy scores the same through the manager's block view as through a TensorLayerView of
// get(): nothing but decoding stands between them.
TEST(LayerView, ScorersSeeWhatGetShows) {
  for (const std::string spec : {"knorm:stream@100", "keydiff:stream@100"}) {
    auto c = make_config(1, 14, 2, 8, "int4:g4", spec, 64);
    c.key_storage = KeyStorage::kPreRoPE;
    TorchCache m(c);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    m.append(0, testing::randn({1, 2, 30, 8}, gen), testing::randn({1, 2, 30, 8}, gen), positions_range(0, 30));
    m.end_step(StepKind::kPrefill);
    const auto& p = dynamic_cast<const evict::ScorerPolicy&>(m.policy());
    const auto block_view = cache::CacheManagerAccess::view(m.core(), 0);
    const auto kv = m.get(0);
    const TensorLayerView plain(kv.k, kv.v, kv.positions, 30);
    EvictionContext ctx;
    ctx.resident = {30, 30};
    ctx.view = &block_view;
    const auto a = p.score(ctx);
    ctx.view = &plain;
    EXPECT_EQ(a, p.score(ctx)) << spec;
  }
}

// attend() hands Expected Attention the step's queries rotated back to pre-RoPE; an engine
// with its own kernel hands the same through observe_queries().
TEST(QueryRows, AttendHandsPreRopeQueries) {
  auto c = make_config(2, 4, 2, 8, "fp16", "expected:s2@50%", 12);  // a 10-token prompt + 2 new
  TorchCache m(c);
  TorchCache e(c);  // the engine path
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  const auto q_pre = testing::randn({1, 4, 10, 8}, gen);
  const auto pos = positions_range(0, 10);
  const auto q_post = testing::test_rope(q_pre, pos);
  for (int64_t l = 0; l < 2; ++l) {
    const auto k = testing::randn({1, 2, 10, 8}, gen), v = testing::randn({1, 2, 10, 8}, gen);
    m.append(l, k, v, pos);
    e.append(l, k, v, pos);
    (void)m.attend(l, q_post, pos);
    e.observe_queries(l, q_post, pos);
    EXPECT_THROW(e.observe_queries(l, q_post, pos), InvalidArgument);  // once per layer and step
    EXPECT_THROW(e.append(l, k.narrow(2, 0, 1), v.narrow(2, 0, 1), positions_range(10, 1)), InvalidArgument);
  }
  const auto& ea = dynamic_cast<const evict::ExpectedAttentionPolicy&>(m.policy());
  const auto& eb = dynamic_cast<const evict::ExpectedAttentionPolicy&>(e.policy());
  // Queries at positions 0 and 1 are sinks: 8 rows fitted; mean of the pre-RoPE rows 2..9.
  EXPECT_EQ(ea.queries_seen(1), 8);
  const auto want = q_pre[0].narrow(1, 2, 8).mean(1).to(at::kDouble);  // [H_q, D]
  for (const auto* p : {&ea, &eb}) {
    const auto mean = p->query_mean(1);
    for (int64_t h = 0; h < 4; ++h) {
      for (int64_t i = 0; i < 8; ++i) EXPECT_NEAR(mean[static_cast<size_t>(h * 8 + i)], want[h][i].item<double>(), 1e-6);
    }
  }
  EXPECT_FALSE(m.policy().needs_attention());  // no attention probabilities: fused kernels stay on
  EXPECT_THROW(e.observe_queries(0, testing::randn({1, 3, 2, 8}, gen), positions_range(0, 2)), InvalidArgument);
  m.end_step(StepKind::kPrefillEnd);
  m.check_invariants();
  EXPECT_EQ(testing::physical_length(m, 0), 4);  // budget 6 − 2 reserved for the new tokens
  EXPECT_EQ(m.tokens(0).positions[0][0], 0);     // the sinks stay
  EXPECT_EQ(m.tokens(0).positions[1][1], 1);
}

// A policy that needs pre-RoPE queries needs a rotate-half RoPE: validate() says so.
TEST(QueryRows, ConfigNeedsARotateHalfRope) {
  auto c = make_config(1, 4, 2, 8, "fp16", "expected@50%", 40);
  c.rope = rope_from([](const at::Tensor& x, const at::Tensor&) { return x * 2.0; });
  try {
    c.validate();
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("eviction policy 'expected@50%' reads pre-RoPE queries"), std::string::npos)
        << e.what();
  }
  c.policy = "knorm@50%";  // keys only: any RoPE hook will do
  EXPECT_NO_THROW(c.validate());
  EXPECT_NO_THROW(TorchCache{c});
}

// AdaKV gives heads different numbers of tokens, and the bytes follow: fp16 K and V of D = 8
// take 16 B per token and stream, 4-token blocks 64 B.
TEST(HeadWise, AdaKVFreesTheBlocksOfTheHeadsItShrinks) {
  auto c = make_config(1, 14, 2, 8, "fp16", "adakv:a0:knorm:stream@8", 64);
  c.block_tokens = 4;
  TorchCache m(c);
  // Head 0's keys have small norms, head 1's large (except its newest): head 0 keeps 15, head 1
  // only its newest.
  auto k = at::ones({1, 2, 16, 8});
  k[0][1].mul_(10.0);
  k[0][1][15].fill_(0.01f);
  m.append(0, k, at::ones({1, 2, 16, 8}), positions_range(0, 16));
  m.end_step(StepKind::kPrefill);
  m.check_invariants();
  const auto t = m.tokens(0);
  EXPECT_EQ(t.resident(0), 15);
  EXPECT_EQ(t.resident(1), 1);
  EXPECT_EQ(t.positions[1], (std::vector<int64_t>{15}));
  EXPECT_EQ(t.stats.tokens_resident, 15);  // the largest head's
  EXPECT_EQ(m.stats().bytes_resident, (15 + 1) * 2 * 16);
  // Head 0: 15 live tokens in 4 blocks (one hole); head 1: one block per stream.
  EXPECT_EQ(m.stats().bytes_reserved, (4 + 1) * 2 * 64);
  EXPECT_THROW(m.get(0), UnsupportedError);  // ragged heads have no [1, H_kv, T, D] form
  // Attention still reads every head's own tokens.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const auto q = testing::randn({1, 14, 1, 8}, gen);
  EXPECT_EQ(m.attend(0, q, positions_range(15, 1)).sizes(), (at::IntArrayRef{1, 14, 1, 8}));
  // Uniform knorm keeps 8 and 8: more bytes in head 1, fewer in head 0, the same total tokens.
  auto u = c;
  u.policy = "knorm:stream@8";
  TorchCache mu(u);
  mu.append(0, k, at::ones({1, 2, 16, 8}), positions_range(0, 16));
  mu.end_step(StepKind::kPrefill);
  EXPECT_EQ(mu.tokens(0).resident(0), 8);
  EXPECT_EQ(mu.tokens(0).resident(1), 8);
  EXPECT_EQ(mu.stats().bytes_resident, m.stats().bytes_resident);
}

// DuoAttention in a manager: after the prompt the streaming heads keep sink + recent and their
// blocks return to the pool; retrieval heads keep every token.
TEST(HeadWise, DuoStreamingHeadsFreeTheirBlocks) {
  // 2 layers × 2 KV heads, a 40-token request (32 prompt + 8), budget 50% = 20, s2 + r6 = 8:
  // ⌈4·20 / 32⌉ = 3 heads stream.
  auto c = make_config(2, 4, 2, 8, "fp16", "duo:s2:r6:w4@50%", 40);
  c.block_tokens = 8;
  TorchCache m(c);
  EXPECT_EQ(dynamic_cast<const evict::DuoAttentionPolicy&>(m.policy()).streaming_heads(), 3);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  for (int64_t chunk = 0; chunk < 2; ++chunk) {
    for (int64_t l = 0; l < 2; ++l) {
      const auto pos = positions_range(chunk * 16, 16);
      m.append(l, testing::randn({1, 2, 16, 8}, gen), testing::randn({1, 2, 16, 8}, gen), pos);
      (void)m.attend(l, testing::randn({1, 4, 16, 8}, gen) * 3.0, pos);
    }
    m.end_step(testing::step_kind(chunk == 1));
    m.check_invariants();
  }
  const auto& duo = dynamic_cast<const evict::DuoAttentionPolicy&>(m.policy());
  int64_t streaming = 0, tokens = 0;
  for (int64_t l = 0; l < 2; ++l) {
    const auto t = m.tokens(l);
    for (int64_t h = 0; h < 2; ++h) {
      streaming += duo.is_streaming(l, h);
      EXPECT_EQ(t.resident(h), duo.is_streaming(l, h) ? 8 : 32) << "layer " << l << " head " << h;
      if (duo.is_streaming(l, h)) {
        EXPECT_EQ(t.positions[static_cast<size_t>(h)], (std::vector<int64_t>{0, 1, 26, 27, 28, 29, 30, 31}));
      }
      tokens += t.resident(h);
    }
  }
  EXPECT_EQ(streaming, 3);
  EXPECT_EQ(m.stats().bytes_resident, tokens * 2 * 16);
  // The streaming heads slide while decoding; the budget holds at the request's end.
  for (int64_t step = 0; step < 8; ++step) {
    for (int64_t l = 0; l < 2; ++l) {
      const auto pos = positions_range(32 + step, 1);
      m.append(l, testing::randn({1, 2, 1, 8}, gen), testing::randn({1, 2, 1, 8}, gen), pos);
      (void)m.attend(l, testing::randn({1, 4, 1, 8}, gen), pos);
    }
    m.end_step(StepKind::kDecode);
    m.check_invariants();
  }
  int64_t total = 0;
  for (int64_t l = 0; l < 2; ++l) {
    for (int64_t h = 0; h < 2; ++h) total += m.tokens(l).resident(h);
  }
  EXPECT_EQ(total, 3 * 8 + 40);
  EXPECT_LE(total, 4 * 20);
}

}  // namespace
}  // namespace kvcache
