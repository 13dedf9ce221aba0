// SPDX-License-Identifier: Apache-2.0
// GEAR (arXiv 2403.05527; src/quant/gear_quantizer.h, the `gear` cache scheme): outlier
// selection with exact counts and ties, the power iteration recovering a rank-1 / full-rank
// residual, the stored bytes against a hand count, spec round trips and errors, and the cache
// holding exactly what quantize() stores.
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "cache_test_util.h"
#include "kvcache/cache_manager.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"
#include "quant/gear_quantizer.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;
using quant::GearQuantizer;

using testing::error_of;

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

/// The key / value stream quantizers of `spec` for head_dim d.
LayerStreams streams_of(const std::string& spec, int64_t d) {
  return make_cache_scheme(spec)->streams(CacheGeometry{1, 1, d}, 0, 0);
}

// ------------------------------------------------------------ outlier selection

TEST(GearOutliers, CountsPerSide) {
  EXPECT_EQ(quant::gear::outliers_per_side(0.02, 128), 1);  // the reference's 0.02 on a 128-value row
  EXPECT_EQ(quant::gear::outliers_per_side(0.02, 64), 0);   // 0.64 → none
  EXPECT_EQ(quant::gear::outliers_per_side(0.25, 8), 1);
  EXPECT_EQ(quant::gear::outliers_per_side(0.58, 100), 29);  // 0.58 · 100 / 2 is 28.999… in binary
  EXPECT_EQ(quant::gear::outliers_per_side(0.5, 7), 1);
  EXPECT_EQ(quant::gear::outliers_per_side(0.0, 4096), 0);
}

TEST(GearOutliers, LargestThenSmallestTiesLowestIndexFirst) {
  // Row with ties at both ends: the k = 2 largest are the first two 5s (indices 0 and 2; the
  // 5 at 6 loses the tie), the k = 2 smallest the two −2s (3, 5).
  const std::vector<float> row = {5, 1, 5, -2, 0, -2, 5, 3};
  std::vector<int64_t> idx(4);
  quant::gear::select_outliers(row.data(), 8, 1, 2, idx.data());
  EXPECT_EQ(idx, (std::vector<int64_t>{0, 2, 3, 5}));
  // A constant row sends exactly k + k entries, the lowest indices: 0, 1 largest; 2, 3 smallest.
  const std::vector<float> flat(8, 1.5f);
  quant::gear::select_outliers(flat.data(), 8, 1, 2, idx.data());
  EXPECT_EQ(idx, (std::vector<int64_t>{0, 1, 2, 3}));
  // Strided (a key channel of a [4, 2] block: column 1 = 7, −1, 7, 9): largest 9 (t 3), smallest −1 (t 1).
  const std::vector<float> block = {0, 7, 0, -1, 0, 7, 0, 9};
  std::vector<int64_t> one(2);
  quant::gear::select_outliers(block.data() + 1, 4, 2, 1, one.data());
  EXPECT_EQ(one, (std::vector<int64_t>{3, 1}));
}

// A value row [0, 10, −10, 3] with k = 1 per side: 10 and −10 are kept exactly; the others are
// quantized after the outliers were replaced by the row mean 0.75 (2 bits, one group of 4:
// min 0, max 3, scale 1 → 0 and 3 exact). A tied constant key channel keeps exactly k + k.
TEST(GearOutliers, KeptExactlyAndReplacedByTheMeanBeforeQuantization) {
  const LayerStreams s = streams_of("gear:b2:g4:s0.5:r0:loop1:nb4", 4);
  const auto& v = dynamic_cast<const GearQuantizer&>(*s.value.quantizer);
  EXPECT_EQ(v.per_side(4), 1);
  EXPECT_EQ(v.outliers_per_block(4), 8);  // 4 tokens × (1 + 1)
  at::Tensor x = at::tensor({0.f, 10.f, -10.f, 3.f}, at::kFloat).repeat({4}).reshape({1, 1, 4, 4});
  const at::Tensor y = kvcache::dequantize(v, v.quantize(x));
  EXPECT_EQ(max_abs_diff(x, y), 0.0) << y;
  // Keys: channel 0 constant 3 over 4 tokens (k = 1: tokens 0 and 1 are the outliers; a zero
  // range stores 3 exactly), channel 1 = 0, 1, 4, 10: 10 (t 3) and 0 (t 0) kept, 1 and 4
  // quantized after the mean 3.75 replaced the outliers: group {3.75, 1, 4, 3.75} → min 1,
  // scale 1, both exact.
  // (Channels 2 and 3 repeat 0 and 1: head_dim 4 takes the value groups of 4.)
  const auto& k = dynamic_cast<const GearQuantizer&>(*s.key.quantizer);
  EXPECT_EQ(k.outliers_per_block(4), 8);  // 4 channels × (1 + 1)
  at::Tensor xk = at::tensor({3.f, 0.f, 3.f, 1.f, 3.f, 4.f, 3.f, 10.f}, at::kFloat).reshape({4, 2}).repeat({1, 2});
  xk = xk.reshape({1, 1, 4, 4});
  const at::Tensor yk = kvcache::dequantize(k, k.quantize(xk));
  EXPECT_EQ(max_abs_diff(xk, yk), 0.0) << yk;
}

// The base quantizer has 2^b − 1 levels, not the reference's b² − 1 (docs/quantizers.md):
// at 3 bits a row 0, 1, …, 7 is on the 7-level grid (scale 1) and comes back exactly; on 8
// levels (scale 7/8) 1 would come back as 0.875.
TEST(GearOutliers, BaseLevelsAreTwoToTheBitsMinusOne) {
  const LayerStreams s = streams_of("gear:b3:g8:s0:r0:loop1:nb8", 8);
  const at::Tensor x = at::arange(8, at::kFloat).repeat({8}).reshape({1, 1, 8, 8});
  EXPECT_EQ(max_abs_diff(x, kvcache::dequantize(*s.value.quantizer, s.value.quantizer->quantize(x))), 0.0);
  // At 2 bits (3 levels either way) a 4-value row 0 … 3 is exact too.
  const LayerStreams t = streams_of("gear:b2:g4:s0:r0:loop1:nb4", 4);
  const at::Tensor y = at::arange(4, at::kFloat).repeat({4}).reshape({1, 1, 4, 4});
  EXPECT_EQ(max_abs_diff(y, kvcache::dequantize(*t.value.quantizer, t.value.quantizer->quantize(y))), 0.0);
}

// ------------------------------------------------------------ low rank

TEST(GearLowRank, PowerIterationRecoversARankOneMatrix) {
  const std::vector<float> u = {1, -2, 0.5f, 3, 0, -1, 2, 0.25f};
  const std::vector<float> v = {0.5f, -1, 2, 0.125f};
  std::vector<float> e(32);
  for (int t = 0; t < 8; ++t) {
    for (int c = 0; c < 4; ++c) e[static_cast<size_t>(t * 4 + c)] = u[static_cast<size_t>(t)] * v[static_cast<size_t>(c)];
  }
  for (int64_t loop : {1, 3}) {
    std::vector<float> uu(8), pp(4);
    quant::gear::low_rank(e.data(), 8, 4, 1, loop, uu.data(), pp.data());
    double norm = 0;
    for (float x : uu) norm += static_cast<double>(x) * x;
    EXPECT_NEAR(norm, 1.0, 1e-6) << "U is orthonormal, loop " << loop;
    for (int t = 0; t < 8; ++t) {
      for (int c = 0; c < 4; ++c) {
        EXPECT_NEAR(uu[static_cast<size_t>(t)] * pp[static_cast<size_t>(c)], e[static_cast<size_t>(t * 4 + c)], 1e-5)
            << t << "," << c << " loop " << loop;
      }
    }
  }
}

// A block whose base quantization error is exactly rank 1: per-token 2-bit groups of 4 with the
// minimum 0 and maximum 3 in channels 0 and 1 (scale 1, zero 0, exact) and a perturbation
// u_t · v_c below half a step in channels 2 and 3 (v = [0, 0, 0.25, −0.125]), which rounds
// back to the grid. Without the low-rank term the error is max|u v| = 0.25; with r = 1 it is
// the fp16 rounding of the stored factors (U entries ≤ 1, P = Eᵀ U: ≤ 2 · 2^-11 relative).
TEST(GearLowRank, RecoversARankOneResidualThroughTheStoredFactors) {
  const std::vector<float> u = {1, -1, 0.5f, 0.75f, -0.25f, 1, 0.125f, -0.5f};
  const std::vector<float> v = {0, 0, 0.25f, -0.125f};
  at::Tensor x = at::empty({1, 1, 8, 4}, at::kFloat);
  float* px = x.data_ptr<float>();
  for (int t = 0; t < 8; ++t) {
    const float grid[4] = {0, 3, t % 2 == 0 ? 1.0f : 2.0f, t % 2 == 0 ? 2.0f : 1.0f};  // codes · scale 1
    for (int c = 0; c < 4; ++c) px[t * 4 + c] = grid[c] + u[static_cast<size_t>(t)] * v[static_cast<size_t>(c)];
  }
  const LayerStreams base = streams_of("gear:b2:g4:s0:r0:loop1:nb8", 4);
  const Quantizer& base_only = *base.value.quantizer;
  EXPECT_EQ(max_abs_diff(x, kvcache::dequantize(base_only, base_only.quantize(x))), 0.25);
  for (const std::string spec : {"gear:b2:g4:s0:r1:loop1:nb8", "gear:b2:g4:s0:r1:loop3:nb8"}) {
    const LayerStreams st = streams_of(spec, 4);
    const Quantizer& q = *st.value.quantizer;
    EXPECT_LT(max_abs_diff(x, kvcache::dequantize(q, q.quantize(x))), 0.25 * 1.1e-3) << spec;
  }
}

// Rank r = min(n_b, D): the residual is recovered whatever it is (up to fp16 factors), for
// both streams, on random data with outliers.
TEST(GearLowRank, FullRankRecoversAnyResidual) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor x = testing::randn({2, 3, 16, 8}, gen);
  const LayerStreams s = streams_of("gear:b2:g4:s0.25:r8:loop2:nb8", 8);
  const LayerStreams base = streams_of("gear:b2:g4:s0.25:r0:loop2:nb8", 8);
  for (int i = 0; i < 2; ++i) {
    const Quantizer& q = i == 0 ? *s.key.quantizer : *s.value.quantizer;
    const Quantizer& b = i == 0 ? *base.key.quantizer : *base.value.quantizer;
    const double e_base = max_abs_diff(x, kvcache::dequantize(b, b.quantize(x)));
    const double e_full = max_abs_diff(x, kvcache::dequantize(q, q.quantize(x)));
    EXPECT_GT(e_base, 0.1) << q.spec();
    EXPECT_LT(e_full, 5e-3) << q.spec();
  }
}

// ------------------------------------------------------------ stored bytes

// gear:b2:g4:s0.25:r1:nb8 at D = 8, per block of 8 tokens of one head (hand count):
//   keys:   base int2:g4:chan, 2 groups of 4 tokens: codes 2 × 4·8·2/8 = 16 B, scales + zeros
//           2 × 8 × 2 × 2 B = 64 B; outliers k = floor(0.25·8/2) = 1 per side per channel:
//           16 × (2 + 2) B = 64 B; U 8×1 and P 8×1 fp16: 32 B → 176 B = 22 bits/value;
//   values: base int2:g4, 8 tokens: codes 8 × 2 B = 16 B, scales + zeros 8 × 2 × 2 × 2 B =
//           64 B; outliers 1 per side per token: 64 B; factors 32 B → 176 B.
TEST(GearBytes, LayoutAndQuantizedTensorMatchTheHandCount) {
  const LayerStreams s = streams_of("gear:b2:g4:s0.25:r1:loop2:nb8", 8);
  for (const Quantizer* q : {s.key.quantizer.get(), s.value.quantizer.get()}) {
    const StoredLayout l = q->stored_layout(8);
    EXPECT_EQ(l.group_tokens, 8);
    EXPECT_EQ(l.code_bytes, 112) << q->spec();
    EXPECT_EQ(l.meta_count, 16) << q->spec();
    EXPECT_EQ(l.group_bytes(), 176) << q->spec();
    EXPECT_DOUBLE_EQ(q->bits_per_value(8), 22.0);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
    const QuantizedTensor qt = q->quantize(testing::randn({2, 3, 24, 8}, gen));
    EXPECT_EQ(qt.nbytes(), 2 * 3 * 3 * 176) << q->spec();  // B·H·(T/n_b) blocks
  }
  // The published settings at D = 128 (keys 3328 B, values 3840 B per 64-token block).
  const LayerStreams d = streams_of("gear", 128);
  EXPECT_EQ(d.key.quantizer->stored_layout(128).group_bytes(), 2048 + 512 + 0 + 256 + 512);
  EXPECT_EQ(d.value.quantizer->stored_layout(128).group_bytes(), 2048 + 512 + 512 + 256 + 512);
  EXPECT_DOUBLE_EQ(d.key.quantizer->bits_per_value(128), 3.25);
  EXPECT_DOUBLE_EQ(d.value.quantizer->bits_per_value(128), 3.75);
  // docs/quantizers.md's row: g32 at D = 64, no outlier (floor(0.64) = 0), 4 bits/value each.
  const LayerStreams e = streams_of("gear:g32", 64);
  EXPECT_EQ(e.key.quantizer->stored_layout(64).code_bytes, 1024 + 512);
  EXPECT_EQ(e.value.quantizer->stored_layout(64).code_bytes, 1024 + 512);
  EXPECT_DOUBLE_EQ(e.key.quantizer->bits_per_value(64), 4.0);
  EXPECT_DOUBLE_EQ(e.value.quantizer->bits_per_value(64), 4.0);
  // The deep-dive arm on the default model (D = 32): 3 + 1.5 bits/value.
  EXPECT_DOUBLE_EQ(streams_of("gear:g32", 32).key.quantizer->bits_per_value(32), 4.5);
}

// The cache stores the blocks quantize() stores: 20 tokens → 2 compressed blocks of 8 and 4
// fp16 residual tokens per head and stream; bytes_resident = 2 heads × 2 streams × (2 × 176 +
// 4 × 8 × 2) = 1664; get() returns the blocks exactly as dequantize(quantize()) of the
// fp16-rounded tokens (the residual's dtype, which is where they wait; keys after RoPE) and the
// residual as fp16.
TEST(GearCache, StoresWhatQuantizeStores) {
  const std::string spec = "gear:b2:g4:s0.25:r1:loop2:nb8";
  TorchCache m(testing::make_config(1, 4, 2, 8, spec, "full"));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor k = testing::randn({1, 2, 20, 8}, gen);
  const at::Tensor v = testing::randn({1, 2, 20, 8}, gen);
  m.append(0, k, v, testing::positions_range(0, 20));
  m.end_step(StepKind::kPrefillEnd);
  m.check_invariants();
  EXPECT_EQ(m.stats().bytes_resident, 2 * 2 * (2 * 176 + 4 * 8 * 2));
  const TensorLayerKV kv = m.get(0);
  const LayerStreams s = make_cache_scheme(spec)->streams(CacheGeometry{1, 2, 8}, 0, 0);
  // Keys are stored post-RoPE (the config's default): the manager rotates them on append.
  const at::Tensor k16 = testing::test_rope(k, testing::positions_range(0, 20)).to(at::kHalf).to(at::kFloat);
  const at::Tensor v16 = v.to(at::kHalf).to(at::kFloat);
  const at::Tensor k_hat = kvcache::dequantize(*s.key.quantizer, s.key.quantizer->quantize(k16.narrow(2, 0, 16)));
  const at::Tensor v_hat = kvcache::dequantize(*s.value.quantizer, s.value.quantizer->quantize(v16.narrow(2, 0, 16)));
  EXPECT_EQ(max_abs_diff(kv.k.narrow(2, 0, 16), k_hat), 0.0);
  EXPECT_EQ(max_abs_diff(kv.v.narrow(2, 0, 16), v_hat), 0.0);
  EXPECT_EQ(max_abs_diff(kv.k.narrow(2, 16, 4), k16.narrow(2, 16, 4)), 0.0);
  EXPECT_EQ(max_abs_diff(kv.v.narrow(2, 16, 4), v16.narrow(2, 16, 4)), 0.0);
  // Decode: the 4th token after the prompt completes the third block.
  for (int64_t t = 20; t < 24; ++t) {
    m.append(0, testing::randn({1, 2, 1, 8}, gen), testing::randn({1, 2, 1, 8}, gen), testing::positions_range(t, 1));
    m.end_step(StepKind::kDecode);
  }
  m.check_invariants();
  EXPECT_EQ(m.stats().bytes_resident, 2 * 2 * 3 * 176);
}

// ------------------------------------------------------------ prefill rank and streaming modes

/// dequantize(quantize(x)) by `q` (x [B, H, n_b, D], one block per head).
at::Tensor round_trip(const Quantizer& q, const at::Tensor& x) { return kvcache::dequantize(q, q.quantize(x)); }

// rp2 beside r1 at D = 8, n_b = 8, g = 4, s = 0.25: every block reserves 2 factor columns.
// The hand count of GearBytes (r1: 112 code bytes, 32 of them U [8, 1] and P [8, 1] fp16)
// becomes 80 + 2 · (8 · 2 + 8 · 2) = 144 code bytes, + 16 scales + 16 zeros fp16 = 208 bytes
// per block: 208 · 8 / 64 = 26 bits/value (22 without rp).
TEST(GearPrefillRank, EveryBlockReservesTheLargerRank) {
  const LayerStreams s = streams_of("gear:b2:g4:s0.25:r1:rp2:loop2:nb8", 8);
  for (const StreamSpec* ss : {&s.key, &s.value}) {
    ASSERT_NE(ss->prefill_quantizer, nullptr);
    for (const Quantizer* q : {ss->quantizer.get(), ss->prefill_quantizer.get()}) {
      const StoredLayout l = q->stored_layout(8);
      EXPECT_EQ(l.code_bytes, 144) << q->spec();
      EXPECT_EQ(l.group_bytes(), 208) << q->spec();
      EXPECT_DOUBLE_EQ(q->bits_per_value(8), 26.0) << q->spec();
    }
    EXPECT_FALSE(ss->recompress);
  }
  EXPECT_EQ(s.key.prefill_quantizer->spec(), "gear:b2:g4:s0.25:r1:loop2:nb8:rp2 keys (prefill)");
  EXPECT_EQ(s.value.quantizer->spec(), "gear:b2:g4:s0.25:r1:loop2:nb8:rp2 values");
  // rp = r (or none): no second encoder, the layout of before.
  for (const char* spec : {"gear:b2:g4:s0.25:r1:loop2:nb8", "gear:b2:g4:s0.25:r1:rp1:loop2:nb8"}) {
    const LayerStreams d = streams_of(spec, 8);
    EXPECT_EQ(d.key.prefill_quantizer, nullptr) << spec;
    EXPECT_EQ(d.key.quantizer->stored_layout(8).group_bytes(), 176) << spec;
  }
  // rp below r: the blocks reserve r columns (the prompt's blocks use fewer).
  const LayerStreams lo = streams_of("gear:b2:g4:s0.25:r2:rp1:loop2:nb8", 8);
  EXPECT_EQ(lo.key.quantizer->stored_layout(8).group_bytes(), 208);
  EXPECT_EQ(lo.key.prefill_quantizer->stored_layout(8).group_bytes(), 208);
  // The rotation wraps both encoders.
  const LayerStreams h = streams_of("had(gear:b2:g4:s0.25:r1:rp2:loop2:nb8)", 8);
  ASSERT_NE(h.value.prefill_quantizer, nullptr);
  EXPECT_EQ(h.value.prefill_quantizer->stored_layout(8).group_bytes(), 208);
}

// A 16-token prompt flushes two blocks encoded with rp = 2; eight decode steps flush a third
// with r = 1. Each block reads back exactly as the plain rank's quantizer (without the
// reserved columns) reconstructs it: the zero columns add nothing.
TEST(GearPrefillRank, PromptBlocksUseRpDecodeBlocksUseR) {
  const std::string spec = "gear:b2:g4:s0.25:r1:rp2:loop2:nb8";
  TorchCache m(testing::make_config(1, 4, 2, 8, spec, "full"));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor k = testing::randn({1, 2, 24, 8}, gen);
  const at::Tensor v = testing::randn({1, 2, 24, 8}, gen);
  m.append(0, k.narrow(2, 0, 16), v.narrow(2, 0, 16), testing::positions_range(0, 16));
  m.end_step(StepKind::kPrefillEnd);
  for (int64_t t = 16; t < 24; ++t) {
    m.append(0, k.narrow(2, t, 1), v.narrow(2, t, 1), testing::positions_range(t, 1));
    m.end_step(StepKind::kDecode);
  }
  m.check_invariants();
  EXPECT_EQ(m.stats().bytes_resident, 2 * 2 * 3 * 208);
  const TensorLayerKV kv = m.get(0);
  const at::Tensor k16 = testing::test_rope(k, testing::positions_range(0, 24)).to(at::kHalf).to(at::kFloat);
  const at::Tensor v16 = v.to(at::kHalf).to(at::kFloat);
  const LayerStreams r2 = streams_of("gear:b2:g4:s0.25:r2:loop2:nb8", 8);
  const LayerStreams r1 = streams_of("gear:b2:g4:s0.25:r1:loop2:nb8", 8);
  for (int64_t b = 0; b < 3; ++b) {
    const LayerStreams& want = b < 2 ? r2 : r1;
    const LayerStreams& other = b < 2 ? r1 : r2;
    const at::Tensor kb = k16.narrow(2, 8 * b, 8), vb = v16.narrow(2, 8 * b, 8);
    EXPECT_EQ(max_abs_diff(kv.k.narrow(2, 8 * b, 8), round_trip(*want.key.quantizer, kb)), 0.0) << "block " << b;
    EXPECT_EQ(max_abs_diff(kv.v.narrow(2, 8 * b, 8), round_trip(*want.value.quantizer, vb)), 0.0) << "block " << b;
    // ... and not as the other rank does (the rank really differs).
    EXPECT_GT(max_abs_diff(kv.k.narrow(2, 8 * b, 8), round_trip(*other.key.quantizer, kb)), 1e-4) << "block " << b;
  }
}

// `whole`: every decode step that flushes a block first decodes and re-encodes every older
// block (rank r). A prompt of 8 tokens (block 0, rank rp = 2) and 24 decode steps (blocks 1,
// 2, 3 flushed at the 8th, 16th and 24th): block j is encoded once, then re-encoded 3 − j
// times. Bytes after each flush equal the newest-n_b mode's, and each block reads back as the
// plain loop y = Q_rp(x) or Q_r(x), then y = Q_r(y) (Q = dequantize ∘ quantize) 3 − j times.
TEST(GearWhole, RecompressionKeepsTheBytesAndCompoundsLikeTheReferenceLoop) {
  const std::string spec = "gear:b2:g4:s0.25:r1:rp2:loop2:nb8";
  TorchCache whole(testing::make_config(1, 4, 2, 8, spec + ":whole", "full"));
  TorchCache newest(testing::make_config(1, 4, 2, 8, spec, "full"));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const at::Tensor k = testing::randn({1, 2, 32, 8}, gen);
  const at::Tensor v = testing::randn({1, 2, 32, 8}, gen);
  for (TorchCache* m : {&whole, &newest}) {
    m->append(0, k.narrow(2, 0, 8), v.narrow(2, 0, 8), testing::positions_range(0, 8));
    m->end_step(StepKind::kPrefillEnd);
  }
  for (int64_t t = 8; t < 32; ++t) {
    for (TorchCache* m : {&whole, &newest}) {
      m->append(0, k.narrow(2, t, 1), v.narrow(2, t, 1), testing::positions_range(t, 1));
      m->end_step(StepKind::kDecode);
      m->check_invariants();
    }
    const int64_t blocks = (t + 1) / 8, resid = (t + 1) % 8;
    EXPECT_EQ(whole.stats().bytes_resident, 2 * 2 * (blocks * 208 + resid * 8 * 2)) << "t = " << t;
    EXPECT_EQ(whole.stats().bytes_resident, newest.stats().bytes_resident) << "t = " << t;
  }
  const TensorLayerKV w = whole.get(0), n = newest.get(0);
  const at::Tensor k16 = testing::test_rope(k, testing::positions_range(0, 32)).to(at::kHalf).to(at::kFloat);
  const at::Tensor v16 = v.to(at::kHalf).to(at::kFloat);
  const LayerStreams s = streams_of(spec + ":whole", 8);
  EXPECT_TRUE(s.key.recompress && s.value.recompress);
  for (int64_t b = 0; b < 4; ++b) {
    at::Tensor yk = k16.narrow(2, 8 * b, 8), yv = v16.narrow(2, 8 * b, 8);
    yk = round_trip(b == 0 ? *s.key.prefill_quantizer : *s.key.quantizer, yk);
    yv = round_trip(b == 0 ? *s.value.prefill_quantizer : *s.value.quantizer, yv);
    const at::Tensor once_k = yk;
    for (int64_t i = 0; i < 3 - b; ++i) {
      yk = round_trip(*s.key.quantizer, yk);
      yv = round_trip(*s.value.quantizer, yv);
    }
    EXPECT_EQ(max_abs_diff(w.k.narrow(2, 8 * b, 8), yk), 0.0) << "block " << b;
    EXPECT_EQ(max_abs_diff(w.v.narrow(2, 8 * b, 8), yv), 0.0) << "block " << b;
    // The newest-n_b mode holds the single encoding; re-encoding changed the older blocks.
    EXPECT_EQ(max_abs_diff(n.k.narrow(2, 8 * b, 8), once_k), 0.0) << "block " << b;
    if (b < 3) {
      EXPECT_GT(max_abs_diff(w.k.narrow(2, 8 * b, 8), once_k), 1e-4) << "block " << b;
    }
  }
}

// ------------------------------------------------------------ specs

TEST(GearSpec, CanonicalFormsRoundTrip) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"gear", "gear:b2:g64:s0.02:r2:loop3:nb64"},
      {"gear:nb128:b4:r0:g32", "gear:b4:g32:s0.02:r0:loop3:nb128"},
      {"gear:s0.1:loop1:g32:nb32", "gear:b2:g32:s0.1:r2:loop1:nb32"},
      {"had:k(gear:g32)", "had:k(gear:b2:g32:s0.02:r2:loop3:nb64)"},
      // rp equal to r and the default mode print nothing; rp4 and whole are printed.
      {"gear:rp2:newest", "gear:b2:g64:s0.02:r2:loop3:nb64"},
      {"gear:whole:rp4", "gear:b2:g64:s0.02:r2:loop3:nb64:rp4:whole"},
      {"gear:r0:rp4:g32", "gear:b2:g32:s0.02:r0:loop3:nb64:rp4"},
  };
  for (const auto& c : cases) {
    const auto s = make_cache_scheme(c.first);
    EXPECT_EQ(s->spec(), c.second) << c.first;
    EXPECT_EQ(make_cache_scheme(s->spec())->spec(), c.second) << c.first;
  }
  const LayerStreams st = streams_of("gear:g32", 32);
  EXPECT_EQ(st.key.quantizer->spec(), "gear:b2:g32:s0.02:r2:loop3:nb64 keys");
  EXPECT_EQ(st.value.quantizer->spec(), "gear:b2:g32:s0.02:r2:loop3:nb64 values");
  EXPECT_EQ(st.key.residual, 64);
  EXPECT_EQ(st.key.flush, ResidualFlush::kBlock);
  EXPECT_EQ(st.value.flush, ResidualFlush::kBlock);
  EXPECT_EQ(st.value.residual_dtype, DType::kFloat16);
}

TEST(GearSpec, BadSpecsNameTheValue) {
  EXPECT_THAT(error_of([] { make_cache_scheme("gear:b5"); }), HasSubstr("b=5 is not one of {2, 3, 4, 8}"));
  EXPECT_THAT(error_of([] { make_cache_scheme("gear:s0.6"); }), HasSubstr("s=0.6 out of range [0, 0.5]"));
  EXPECT_THAT(error_of([] { make_cache_scheme("gear:g32:nb48"); }),
              HasSubstr("the block nb=48 must be a positive multiple of the group size g=32"));
  EXPECT_THAT(error_of([] { make_cache_scheme("gear:g32:nb16"); }),
              HasSubstr("the block nb=16 must be a positive multiple of the group size g=32"));
  EXPECT_THAT(error_of([] { make_cache_scheme("gear:g8:nb8:r9"); }), HasSubstr("rank r=9 exceeds the block's nb=8"));
  EXPECT_THAT(error_of([] { make_cache_scheme("gear:b3:g4:nb8"); }), HasSubstr("base quantizer fails"));
  EXPECT_THAT(error_of([] { make_cache_scheme("gear:mode1"); }), HasSubstr("unknown field 'mode1'"));
  // Geometry: default g = 64 on the default model's head_dim 32; a rank above head_dim.
  EXPECT_THAT(error_of([] { streams_of("gear", 32); }),
              HasSubstr("cache scheme 'gear:b2:g64:s0.02:r2:loop3:nb64': values are grouped along head_dim (per KV "
                        "head), which must be divisible by g=64, got head_dim=32"));
  EXPECT_THAT(error_of([] { streams_of("gear:g4:nb8:r6", 4); }), HasSubstr("rank r=6 exceeds head_dim D=4"));
  EXPECT_THAT(error_of([] { make_cache_scheme("gear:g8:nb8:rp9"); }),
              HasSubstr("prefill rank rp=9 exceeds the block's nb=8"));
  EXPECT_THAT(error_of([] { streams_of("gear:g4:nb8:r2:rp6", 4); }), HasSubstr("prefill rank rp=6 exceeds head_dim D=4"));
  EXPECT_THAT(error_of([] { make_cache_scheme("gear:all"); }), HasSubstr("unknown field 'all'"));
  EXPECT_THAT(error_of([] { make_cache_scheme("gear:g4:nb8")->streams(CacheGeometry{1, 1, 8}, 0, 16); }),
              HasSubstr("CacheConfig::residual_length must be 0 or 8, got 16"));
  const LayerStreams st = streams_of("gear:g4:nb8", 8);
  const Quantizer& q = *st.key.quantizer;
  EXPECT_THAT(error_of([&] { q.quantize(at::zeros({1, 1, 12, 8})); }), HasSubstr("T=12 is not a multiple of the block nb=8"));
}

}  // namespace
}  // namespace kvcache
