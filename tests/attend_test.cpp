// SPDX-License-Identifier: Apache-2.0
// CacheManager::attend() — the generic per-block read path — against the plain at:: reference
// (reference_attention) over the same stored values (get(): the dequantized stored form), for
// every stored format and the shapes that stress the block walk: odd head counts, one-token
// blocks, T not a multiple of the block, holes left by eviction, prefill chunks with causal
// masking, pre-RoPE keys rotated on read, ragged heads. And the attention mass handed to the
// policy against reduce_attention() of the reference probabilities.
//
// Tolerance: both sides compute q·k, softmax and p·v in float32 over identical K/V, but in a
// different order (online softmax over blocks with a rescale per block, FMA dot products and a
// polynomial exp of ~2 ulp, against BLAS matmuls and ATen's softmax). With |q·k|/√D = O(3) and
// unit-scale values the difference stays below 1e-5 absolute; 2e-5 leaves room for the
// accumulation over up to ~600 keys. A wrong mask, a skipped or doubled token would be O(0.1).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cache/attend.h"
#include "cache/block_pool.h"
#include "cache/layer_store.h"
#include "cache_test_util.h"
#include "kvcache/attention.h"
#include "kvcache/cache_manager.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"

namespace kvcache {
namespace {

using testing::make_config;
using testing::positions_range;

constexpr double kTol = 2e-5;

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

/// attend() of q against the reference over get()'s K/V/positions.
void expect_attend_matches_reference(TorchCache& m, int64_t layer, const at::Tensor& q, const at::Tensor& q_pos,
                                     const std::string& where) {
  const TensorLayerKV kv = m.get(layer);
  at::Tensor probs;
  const at::Tensor ref = reference_attention(q, kv.k, kv.v, kv.positions, q_pos, &probs);
  const at::Tensor out = m.attend(layer, q, q_pos);
  ASSERT_EQ(out.sizes(), ref.sizes()) << where;
  EXPECT_LT(max_abs_diff(out, ref), kTol) << where;
}

struct FormatCase {
  std::string quant;
  int64_t block_tokens;
};

// Every stored format, blocks of 1, 3 and 64 tokens (per-channel formats: multiples of their
// group), prompts of 1 .. 37 tokens in chunks, then decode steps; GQA with 7 query heads per KV
// head and an odd number of KV heads (3).
TEST(Attend, MatchesReferenceForEveryFormatAndBlockSize) {
  const std::vector<FormatCase> cases = {
      {"fp32", 1},       {"fp32", 3},         {"fp32", 0},        {"fp16", 3},          {"bf16", 0},
      {"fp8:e4m3", 3},   {"fp8:e5m2", 0},     {"fp8:e4m3:scaled", 1}, {"int8", 3},      {"int4", 0},
      {"int2:g4", 1},    {"int4:g8:chan", 8}, {"int2:g4:chan", 0}, {"kivi:k2:v2:g4:r8", 4},
      {"kivi:k4:v4:g4:r8", 12}, {"int3", 3},        {"int3:g8:chan", 8}, {"kivi:k3:v3:g8:r8", 8},
      {"had(fp32)", 1},         {"had(int4)", 3},   {"had(int3:g8:chan)", 0}, {"had:k(kivi:k2:v2:g4:r8)", 4},
      {"gear:b2:g4:s0.25:r2:loop2:nb8", 8},     {"gear:b4:g4:s0:r0:loop1:nb4", 0},
      {"had:k(gear:b2:g4:s0.25:r1:loop1:nb8)", 16}, {"tq:b4", 3}, {"tq:b3:prod", 0}, {"tq:b2.5:nc", 1},
      {"turboquant:k3:v2.5", 3}, {"qjl:m16:o2:g4:v2:r8:mo8:vg8", 4}, {"qjl:m64:o0:g4:v4:r4:mo0:vg4", 0}};
  uint64_t seed = 40;
  for (const auto& fc : cases) {
    auto c = make_config(2, 21, 3, 8, fc.quant, "full");
    c.block_tokens = fc.block_tokens;
    TorchCache m(c);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(++seed);
    int64_t pos = 0;
    for (int64_t n : {13, 1, 24, 1, 1, 1}) {  // prefill chunks, then decode
      for (int64_t l = 0; l < 2; ++l) {
        m.append(l, testing::randn({1, 3, n, 8}, gen), testing::randn({1, 3, n, 8}, gen), positions_range(pos, n));
        const std::string where = fc.quant + " block " + std::to_string(fc.block_tokens) + " at " + std::to_string(pos);
        expect_attend_matches_reference(m, l, testing::randn({1, 21, n, 8}, gen), positions_range(pos, n), where);
      }
      m.end_step(n > 1 ? StepKind::kPrefill : StepKind::kDecode);
      m.check_invariants();
      pos += n;
    }
  }
}

// Holes: scattered eviction (random, h2o) and positional eviction (sink) leave dead slots;
// attention must skip them exactly as the reference over the survivors does.
TEST(Attend, SkipsEvictedTokens) {
  for (const std::string policy : {"random:seed5@11", "h2o@11", "sink:s2@11", "tova@11"}) {
    for (const std::string quant : {"fp32", "int4", "kivi:k2:v2:g4:r8", "gear:b2:g4:s0.25:r1:loop1:nb4"}) {
      auto c = make_config(1, 4, 2, 8, quant, policy, 80);
      c.block_tokens = 4;
      TorchCache m(c);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
      int64_t pos = 0;
      for (int64_t step = 0; step < 30; ++step) {
        const int64_t n = step == 0 ? 9 : 1;
        m.append(0, testing::randn({1, 2, n, 8}, gen), testing::randn({1, 2, n, 8}, gen), positions_range(pos, n));
        const auto q = testing::randn({1, 4, n, 8}, gen);
        expect_attend_matches_reference(m, 0, q, positions_range(pos, n), policy + " " + quant);
        m.end_step(step == 0 ? StepKind::kPrefillEnd : StepKind::kDecode);
        m.check_invariants();
        pos += n;
      }
      EXPECT_EQ(testing::physical_length(m, 0), 11) << policy;
    }
  }
}

// Causal masking inside a prefill chunk, and keys whose positions are past some queries:
// queries attending at earlier positions than the newest keys see only keys ≤ their position.
TEST(Attend, CausalByStoredPositions) {
  TorchCache m(make_config(1, 2, 1, 4, "fp32", "full"));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  m.append(0, testing::randn({1, 1, 6, 4}, gen), testing::randn({1, 1, 6, 4}, gen),
           at::tensor({0, 1, 2, 10, 11, 12}, at::kLong));
  const auto q = testing::randn({1, 2, 3, 4}, gen);
  // Queries at 1, 10, 20: the first sees keys 0..1 only, the second 0..10, the last all.
  expect_attend_matches_reference(m, 0, q, at::tensor({1, 10, 20}, at::kLong), "gapped positions");
  // A query before every key sees nothing: zeros.
  const auto none = m.attend(0, q.narrow(2, 0, 1), at::tensor({-1}, at::kLong));
  EXPECT_EQ(none.abs().max().item<float>(), 0.0f);
}

// Keys stored pre-RoPE are rotated on read by their stored positions: the same output as
// post-RoPE storage, also after eviction and with re-rotated (contiguous) positions.
TEST(Attend, PreRopeKeysRotateOnRead) {
  for (const bool rerotate : {false, true}) {
    auto c = make_config(1, 4, 2, 8, "int8", "sink:s2@10");
    c.key_storage = KeyStorage::kPreRoPE;
    if (rerotate) c.position_mode = PositionMode::kRerotate;
    c.block_tokens = 3;
    TorchCache m(c);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
    for (int64_t step = 0; step < 20; ++step) {
      const int64_t n = step == 0 ? 7 : 1;
      const int64_t p0 = m.next_position(0);
      m.append(0, testing::randn({1, 2, n, 8}, gen), testing::randn({1, 2, n, 8}, gen), positions_range(p0, n));
      expect_attend_matches_reference(m, 0, testing::randn({1, 4, n, 8}, gen), positions_range(p0, n),
                                      rerotate ? "rerotate" : "pre-RoPE");
      m.end_step(step == 0 ? StepKind::kPrefillEnd : StepKind::kDecode);
      m.check_invariants();
    }
  }
}

// Through the manager: a policy fed by attend() plans exactly what the same policy fed the
// reference probabilities (observe_attention) plans — h2o (every row summed), tova (last row),
// snapkv (last w rows); random data keeps the scores far from ties.
TEST(Attend, PolicyFedByAttendPlansLikeReferenceProbabilities) {
  for (const std::string policy : {"h2o@9", "tova@9", "snapkv:w3:k1@80%"}) {
    auto c = make_config(1, 6, 2, 8, "int4", policy, 30);
    c.block_tokens = 5;
    TorchCache m(c), scripted(c);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(23);
    const auto k = testing::randn({1, 2, 17, 8}, gen), v = testing::randn({1, 2, 17, 8}, gen);
    m.append(0, k, v, positions_range(0, 17));
    scripted.append(0, k, v, positions_range(0, 17));
    const auto q = testing::randn({1, 6, 17, 8}, gen) * 3.0;
    const TensorLayerKV kv = m.get(0);
    at::Tensor probs;
    (void)reference_attention(q, kv.k, kv.v, kv.positions, positions_range(0, 17), &probs);
    (void)m.attend(0, q, positions_range(0, 17));
    scripted.observe_attention(0, probs);
    EXPECT_THROW(scripted.observe_attention(0, probs), InvalidArgument) << "second observation in one step";
    m.end_step(StepKind::kPrefillEnd);
    scripted.end_step(StepKind::kPrefillEnd);
    EXPECT_LT(testing::physical_length(m, 0), 17) << policy;
    EXPECT_EQ(m.tokens(0).positions, scripted.tokens(0).positions) << policy;
  }
}

// The internal read path over a LayerStore whose heads hold different numbers of tokens
// (what head-wise budgets produce): each head against the reference over its own tokens, and
// the per-head mass against reduce_attention().
TEST(Attend, RaggedHeads) {
  std::shared_ptr<const Quantizer> q4 = make_quantizer("int4");
  auto f16 = make_quantizer("fp16");
  auto f32 = make_quantizer("fp32");
  cache::BlockPool pool_main(cache::BlockFormat::bytes_for(*q4, 8, 4));
  cache::BlockPool pool_res(cache::BlockFormat::bytes_for(*f16, 8, 4));
  cache::BlockPool pool_fb(cache::BlockFormat::bytes_for(*f32, 8, 4));
  cache::StreamSetup st;
  st.spec = StreamSpec{q4, 3, ResidualFlush::kSliding, DType::kFloat16, {}, 0, nullptr, false};
  st.formats.f[cache::StreamFormats::kMain] = cache::BlockFormat(*q4, 8, 4, &pool_main);
  st.formats.f[cache::StreamFormats::kResidual] = cache::BlockFormat(*f16, 8, 4, &pool_res);
  st.formats.f[cache::StreamFormats::kFallback] = cache::BlockFormat(*f32, 8, 4, &pool_fb);
  cache::LayerStore L(&st, &st, 2, 8);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(31);
  const int64_t lengths[2] = {11, 6};
  std::vector<at::Tensor> ks(2), vs(2), ps(2);
  for (int64_t h = 0; h < 2; ++h) {
    ks[h] = testing::randn({lengths[h], 8}, gen).contiguous();
    vs[h] = testing::randn({lengths[h], 8}, gen).contiguous();
    ps[h] = at::arange(lengths[h], at::kLong) * 2;  // gaps, as after eviction
    L.write(h, ks[h].data_ptr<float>(), vs[h].data_ptr<float>(), ps[h].data_ptr<int64_t>(), lengths[h]);
  }
  L.evict(0, {1, 4, 5});  // holes in head 0 only
  L.check(0);
  EXPECT_EQ(L.resident(0), 8);
  EXPECT_EQ(L.resident(1), 6);
  const int64_t hq = 4, tq = 3;
  const auto q = testing::randn({1, hq, tq, 8}, gen).contiguous();
  const auto qpos = at::tensor({9, 14, 30}, at::kLong);
  // Every tile width this CPU runs (the online softmax and the mass use W-lane vectors).
  for (const int lanes : {4, 8, 16}) {
    if (!cache::use_tile_lanes(lanes)) continue;
    for (const AttentionNeed need : {AttentionNeed{AttentionNeed::kAllRows, false}, AttentionNeed{1, true},
                                     AttentionNeed{2, true}, AttentionNeed{5, false}}) {
      for (const int64_t buffer : {int64_t{1} << 20, int64_t{0}}) {  // scores kept / recomputed
        auto out = at::empty({1, hq, tq, 8});
        AttentionMass mass;
        cache::AttendArgs a;
        a.layer = &L;
        a.q = q.data_ptr<float>();
        a.q_pos = qpos.data_ptr<int64_t>();
        a.t_q = tq;
        a.num_q_heads = hq;
        a.need = need;
        a.out = out.data_ptr<float>();
        a.mass = &mass;
        a.max_buffered_scores = buffer;
        cache::attend_generic(a);
        const std::string where = "lanes " + std::to_string(lanes) + " rows " + std::to_string(need.rows) +
                                  (need.per_row ? " per row" : " summed") + (buffer > 0 ? " buffered" : " recomputed");
        ASSERT_EQ(mass.rows, need.per_row ? need.selected(tq) : 1) << where;
        for (int64_t h = 0; h < 2; ++h) {
          // The stored (dequantized) values of head h and their positions.
          std::vector<float> kr, vr;
          L.k(h).quant.live_rows(kr, 1.0f);
          L.k(h).resid.live_rows(kr, 1.0f);
          L.v(h).quant.live_rows(vr, 1.0f);
          L.v(h).resid.live_rows(vr, 1.0f);
          const auto pos = L.k(h).positions();
          const int64_t t = static_cast<int64_t>(pos.size());
          const auto k = at::from_blob(kr.data(), {1, 1, t, 8}, at::kFloat).clone();
          const auto v = at::from_blob(vr.data(), {1, 1, t, 8}, at::kFloat).clone();
          const auto kpos = at::tensor(pos, at::kLong).view({1, t});
          at::Tensor probs;
          const auto ref = reference_attention(q.narrow(1, 2 * h, 2), k, v, kpos, qpos, &probs);
          EXPECT_LT(max_abs_diff(out.narrow(1, 2 * h, 2), ref), kTol) << where << " head " << h;
          const AttentionMass want = reduce_attention(probs, 1, need);
          ASSERT_EQ(mass.keys(h), t) << where;
          ASSERT_EQ(mass.heads[h].size(), want.heads[0].size()) << where;
          for (size_t j = 0; j < want.heads[0].size(); ++j) {
            EXPECT_NEAR(mass.heads[h][j], want.heads[0][j], 1e-6) << where << " head " << h << " at " << j;
          }
        }
        EXPECT_THROW(mass_tensor(mass), InvalidArgument);  // ragged: no [H_kv, rows, T] form
      }
    }
  }
  EXPECT_TRUE(cache::use_tile_lanes(0));
}

// The tile kernels (q·k over float32 rows, the online softmax, p·v) are built once per vector
// width — 16 lanes (AVX-512), 8 (AVX2), 4 (baseline) — and the widest the CPU runs is used.
// Every width this CPU runs is held to the reference, at the head dims that take the vector
// kernels (16, 32, 64, 128; other dims take a plain loop), with tiles that are not a multiple
// of any width (blocks of 5 tokens, 1 .. 21-token chunks), causal masking inside prefill
// chunks, holes (h2o) and 7 query heads per KV head. fp32 and int3 are read as rows through
// these kernels on every CPU (int3 has no fused kernel; fp32 rows are read in place).
TEST(Attend, EveryTileWidthMatchesTheReference) {
  EXPECT_TRUE(cache::use_tile_lanes(0));
  const int widest = cache::tile_lanes();
  EXPECT_TRUE(widest == 4 || widest == 8 || widest == 16) << widest;
  int ran = 0;
  for (int lanes : {4, 8, 16}) {
    if (!cache::use_tile_lanes(lanes)) {
      EXPECT_GT(lanes, widest) << "a width narrower than the widest must run";
      continue;
    }
    EXPECT_EQ(cache::tile_lanes(), lanes);
    ++ran;
    uint64_t seed = 900 + static_cast<uint64_t>(lanes);
    for (int64_t d : {16, 32, 64, 128}) {
      for (const char* quant : {"fp32", "int3"}) {
        for (const char* policy : {"full", "h2o@24"}) {
          auto c = make_config(1, 14, 2, d, quant, policy);
          c.block_tokens = 5;
          TorchCache m(c);
          auto gen = at::make_generator<at::CPUGeneratorImpl>(++seed);
          int64_t pos = 0;
          for (int64_t n : {21, 1, 9, 1, 1}) {
            m.append(0, testing::randn({1, 2, n, d}, gen), testing::randn({1, 2, n, d}, gen), positions_range(pos, n));
            const std::string where = std::string(quant) + "+" + policy + " lanes " + std::to_string(lanes) + " d " +
                                      std::to_string(d) + " at " + std::to_string(pos);
            expect_attend_matches_reference(m, 0, testing::randn({1, 14, n, d}, gen), positions_range(pos, n), where);
            m.end_step(n > 1 ? StepKind::kPrefill : StepKind::kDecode);
            pos += n;
          }
        }
      }
    }
  }
  EXPECT_TRUE(cache::use_tile_lanes(0));
  EXPECT_EQ(cache::tile_lanes(), widest);
  EXPECT_GE(ran, 1);
  EXPECT_THROW(cache::use_tile_lanes(12), InvalidArgument);
}

TEST(Attend, ValidatesItsArguments) {
  TorchCache m(make_config(2, 4, 2, 8, "fp16", "full"));
  m.append(0, at::zeros({1, 2, 3, 8}), at::zeros({1, 2, 3, 8}), positions_range(0, 3));
  EXPECT_THROW(m.attend(2, at::zeros({1, 4, 1, 8}), positions_range(3, 1)), InvalidArgument);  // layer
  EXPECT_THROW(m.attend(0, at::zeros({1, 3, 1, 8}), positions_range(3, 1)), InvalidArgument);  // H_q
  EXPECT_THROW(m.attend(0, at::zeros({1, 4, 1, 8}), positions_range(3, 2)), InvalidArgument);  // positions
  EXPECT_THROW(m.attend(0, at::zeros({2, 4, 1, 8}), positions_range(3, 1)), InvalidArgument);  // batch
  EXPECT_EQ(m.attend(0, at::zeros({1, 4, 0, 8}), positions_range(3, 0)).size(2), 0);
}

}  // namespace
}  // namespace kvcache
