// SPDX-License-Identifier: Apache-2.0
// KIVI (arXiv 2402.02750) as a cache scheme: residual flushing in prefill and decode
// (methods.md b.2), stored groups, measured bytes, and eviction from per-channel groups.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cache/cache_manager_access.h"
#include "kvcache/cache_scheme.h"
#include "cache_test_util.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/torch.h"

namespace kvcache {
namespace {

using cache::CacheManagerAccess;
using testing::make_config;
using testing::positions_range;
using testing::test_rope;

constexpr int64_t kR = 128, kG = 32, kD = 64, kH = 2;

struct Expect {
  int64_t k_quant, k_res, v_quant, v_res;
};

Expect kivi_rule(int64_t t) {
  // Keys: quantize T − T mod R, keep T mod R; values: keep min(T, R), quantize the rest.
  return {t - t % kR, t % kR, t - std::min(t, kR), std::min(t, kR)};
}

// Bytes per KV head for k2/v2, g32, D 64: a quantized token costs 16 B of codes + 8 B of fp16
// scale/zero (keys: 64 channels × 2 × 2 B per 32 tokens; values: 2 groups × 2 × 2 B); a
// residual token 64 × 2 B.
int64_t kivi_bytes(const Expect& e) { return kH * (24 * (e.k_quant + e.v_quant) + 128 * (e.k_res + e.v_res)); }

void check_stream(const TorchCache& m, bool key, int64_t quant, int64_t res, const at::Tensor& source,
                  const std::string& where) {
  auto s = CacheManagerAccess::stream(m.core(), 0, key);
  for (int64_t h = 0; h < kH; ++h) {
    EXPECT_EQ(s.quantized_tokens[h], quant) << where;
    EXPECT_EQ(s.residual_tokens[h], res) << where;
    if (key) {
      EXPECT_EQ(s.quantized_groups[h], quant / kG) << where;  // one block per group
    }
    const int64_t t = quant + res;
    auto src = source.narrow(1, h, 1);
    if (res > 0) {  // the residual holds exactly the most recent tokens, in fp16
      EXPECT_TRUE(at::equal(as_tensor(s.residual[h]), src.narrow(2, t - res, res).to(at::kHalf))) << where;
    }
    if (quant > 0) {
      // Quantized part within half a quantization step of its fp16 input.
      auto x = src.narrow(2, 0, quant).to(at::kHalf).to(at::kFloat);
      auto xh = as_tensor(s.stored[h]).narrow(2, 0, quant);
      at::Tensor step;
      if (key) {  // per channel, groups of 32 tokens
        auto g = x.view({quant / kG, kG, kD});
        step = ((g.amax(1) - g.amin(1)) / 3.0).unsqueeze(1).expand({quant / kG, kG, kD}).reshape({1, 1, quant, kD});
      } else {  // per token, groups of 32 channels
        auto g = x.view({quant, kD / kG, kG});
        step = ((g.amax(2) - g.amin(2)) / 3.0).unsqueeze(2).expand({quant, kD / kG, kG}).reshape({1, 1, quant, kD});
      }
      EXPECT_TRUE(((xh - x).abs() <= step * 0.5 * 1.01 + 2e-3).all().item<bool>()) << where;
    }
  }
}

// methods.md b.2 at T = 1, 31, 32, 127, 128, 129, 300 (+ 4096): prefill in one chunk and
// decode token by token store the same counts, the same residual and the same groups.
TEST(Kivi, ResidualFlushingPrefillAndDecode) {
  for (int64_t t : {1, 31, 32, 127, 128, 129, 300, 4096}) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(t));
    auto k = testing::randn({1, kH, t, kD}, gen);
    auto v = testing::randn({1, kH, t, kD}, gen);
    auto k_post = test_rope(k, positions_range(0, t));
    const Expect e = kivi_rule(t);
    const std::string where = "T=" + std::to_string(t);

    TorchCache prefill(make_config(1, kH, kH, kD, "kivi:k2:v2:g32:r128", "full"));
    EXPECT_EQ(CacheManagerAccess::scheme(prefill.core()), "kivi:k2:v2:g32:r128");
    prefill.append(0, k, v, positions_range(0, t));
    prefill.end_step(StepKind::kPrefillEnd);
    prefill.check_invariants();
    check_stream(prefill, true, e.k_quant, e.k_res, k_post, where + " prefill K");
    check_stream(prefill, false, e.v_quant, e.v_res, v, where + " prefill V");
    EXPECT_EQ(prefill.stats().bytes_resident, kivi_bytes(e)) << where;
    EXPECT_FALSE(CacheManagerAccess::stream(prefill.core(), 0, true).token_readable);  // per-channel keys
    EXPECT_TRUE(CacheManagerAccess::stream(prefill.core(), 0, false).token_readable);  // per-token values

    if (t > 300) continue;
    TorchCache decode(make_config(1, kH, kH, kD, "kivi:k2:v2:g32:r128", "full"));
    for (int64_t i = 0; i < t; ++i) {
      decode.append(0, k.narrow(2, i, 1), v.narrow(2, i, 1), positions_range(i, 1));
      decode.end_step(testing::step_kind(i == 0));
      const Expect ei = kivi_rule(i + 1);
      auto ks = CacheManagerAccess::stream(decode.core(), 0, true);
      auto vs = CacheManagerAccess::stream(decode.core(), 0, false);
      ASSERT_EQ(ks.residual_tokens[0], ei.k_res) << where << " step " << i;  // oscillates 0..R−1
      ASSERT_EQ(vs.residual_tokens[1], ei.v_res) << where << " step " << i;  // min(T, R)
    }
    decode.check_invariants();
    check_stream(decode, true, e.k_quant, e.k_res, k_post, where + " decode K");
    check_stream(decode, false, e.v_quant, e.v_res, v, where + " decode V");
    EXPECT_EQ(decode.stats().bytes_resident, kivi_bytes(e)) << where;
    EXPECT_TRUE(at::equal(decode.get(0).k, prefill.get(0).k)) << where;
    EXPECT_TRUE(at::equal(decode.get(0).v, prefill.get(0).v)) << where;
  }
}

TEST(Kivi, SchemeSpecValidation) {
  auto c = make_config(1, 2, 2, 64, "kivi:k4:v4:g32:r128", "full");
  EXPECT_NO_THROW(TorchCache{c});
  c.scheme = "kivi:k2:v2:g32:r100";
  EXPECT_THROW(c.validate(), InvalidArgument);
  c.scheme = "kivi:k2:v2:g32:r128:x1";
  EXPECT_THROW(c.validate(), InvalidArgument);
  c.scheme = "kivi:k2:v2:g32:r128";
  c.residual_length = 64;  // conflicts with r128
  EXPECT_THROW(c.validate(), InvalidArgument);
  c.scheme = "kivi";  // defaults k2 v2 g32 r128
  c.residual_length = 0;
  TorchCache m(c);
  EXPECT_EQ(CacheManagerAccess::scheme(m.core()), "kivi:k2:v2:g32:r128");
}

// What validates runs: a residual shorter than a key group (r0 once passed validation and then
// failed at the first flush with an internal error) and bit widths without an integer
// quantizer are rejected, in the words of the spec the user wrote.
TEST(Kivi, SchemesThatCannotRunAreRejected) {
  auto message = [](const std::string& quant) {
    try {
      make_config(1, 2, 2, 8, quant, "full").validate();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("valid");
  };
  EXPECT_EQ(message("kivi:k2:v2:g4:r0"), "spec 'kivi:k2:v2:g4:r0': field 'r0': r=0 out of range [1, 1000000000] "
                                         "(full-precision residual tokens (a positive multiple of g))");
  EXPECT_EQ(message("kivi:g4:r2"), "cache scheme 'kivi:g4:r2': residual r=2 must be a positive multiple of the group "
                                   "size g=4 (keys are quantized in whole groups of g tokens, which wait in the residual)");
  // Bit widths: those of the registered int<b> quantizers, as the table says ({2, 3, 4, 8}).
  EXPECT_EQ(message("kivi:k3:g4:r4"), "cache scheme 'kivi:k3:g4:r4': its keys are stored as 'int3:g4:chan', which "
                                      "fails: int3:g4: group size must be a multiple of 8 (8 codes are packed in 3 bytes "
                                      "within a group)");
  EXPECT_EQ(message("kivi:k3:v3:g8:r8"), "valid");
  EXPECT_EQ(message("kivi:v5:g4:r4"), "spec 'kivi:v5:g4:r4': field 'v5': v=5 is not one of {2, 3, 4, 8} (value bits "
                                      "(the registered int<b> widths))");
  EXPECT_EQ(message("kivi:g2:r2"), "cache scheme 'kivi:g2:r2': its keys are stored as 'int2:g2:chan', which fails: "
                                   "int2:g2: group size must be a multiple of 4 (4 codes are packed per byte within a "
                                   "group)");
  EXPECT_THROW((void)make_cache_scheme("kivi:g2:r2"), InvalidArgument);  // needs no head_dim to know
  EXPECT_EQ(message("kivi:k8:v8:g4:r4"), "valid");
  // The smallest residual that validates runs: prefill, a flush, decode.
  TorchCache m(make_config(1, 2, 2, 8, "kivi:k2:v2:g4:r4", "full"));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  m.append(0, testing::randn({1, 2, 5, 8}, gen), testing::randn({1, 2, 5, 8}, gen), positions_range(0, 5));
  m.end_step(StepKind::kPrefillEnd);
  for (int64_t p = 5; p < 12; ++p) {
    m.append(0, testing::randn({1, 2, 1, 8}, gen), testing::randn({1, 2, 1, 8}, gen), positions_range(p, 1));
    m.end_step(StepKind::kDecode);
    m.check_invariants();
  }
  EXPECT_EQ(m.stats().tokens_resident, 12);
  EXPECT_EQ(CacheManagerAccess::stream(m.core(), 0, true).residual_tokens, (std::vector<int64_t>{0, 0}));
}

// Evicting tokens of per-channel key groups (g = 8, D = 8, one KV head): a group that loses
// every token is freed; a group whose survivors fit in the group's bytes in fp16 is converted
// to fp16 once; otherwise the group stays quantized and holds dead slots.
TEST(Kivi, EvictionFromPerChannelGroups) {
  auto c = make_config(1, 1, 1, 8, "kivi:k2:v2:g8:r16", "h2o:h4:r4");
  TorchCache m(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  auto k = testing::randn({1, 1, 32, 8}, gen), v = testing::randn({1, 1, 32, 8}, gen);
  m.append(0, k, v, positions_range(0, 32));
  auto ks = CacheManagerAccess::stream(m.core(), 0, true);
  EXPECT_EQ(ks.quantized_groups[0], 4);  // 32 % 16 == 0: all keys quantized, 4 groups
  EXPECT_EQ(ks.residual_tokens[0], 0);
  auto before = m.get(0);
  auto k_before = before.k.clone(), v_before = before.v.clone();
  auto probs = at::zeros({1, 1, 1, 32});
  for (int64_t i : {0, 1, 2, 9}) probs[0][0][0][i] = 0.25f;
  m.observe_attention(0, probs);
  m.end_step(StepKind::kPrefillEnd);
  m.check_invariants();
  auto kept = at::tensor({0, 1, 2, 9, 28, 29, 30, 31}, at::kLong);
  auto after = m.get(0);
  EXPECT_TRUE(at::equal(after.positions[0], kept));
  // Group 0 keeps 3 tokens (3 × 8 × 2 B = 48 B ≤ its 48 B) → fp16; group 1 keeps 1 → fp16;
  // group 2 loses all → freed; group 3 keeps 4 (64 B > 48 B) → stays quantized, 4 dead slots.
  ks = CacheManagerAccess::stream(m.core(), 0, true);
  EXPECT_EQ(ks.quantized_groups[0], 1);
  EXPECT_EQ(ks.dead_slots[0], 4);
  EXPECT_EQ(ks.quantized_tokens[0], 4);  // group 3's survivors {28..31}
  EXPECT_EQ(ks.converted_tokens[0], 4);  // {0, 1, 2} and {9}, each group in a small fp16 block
  EXPECT_EQ(ks.blocks[0], 3);
  auto vs = CacheManagerAccess::stream(m.core(), 0, false);
  EXPECT_EQ(vs.quantized_tokens[0], 4);  // {0, 1, 2, 9} from the quantized values
  EXPECT_EQ(vs.residual_tokens[0], 4);   // {28..31} from the fp16 residual
  // Bytes: K 48 + 16 + 48; V 4 × (2 B codes + 4 B scale/zero) + 4 × 16 B.
  EXPECT_EQ(m.stats().bytes_resident, (48 + 16 + 48) + (4 * 6 + 4 * 16));
  // Survivors keep their values: exactly for quantized slots and values, up to fp16 rounding
  // of the dequantized key for converted groups (never requantized).
  EXPECT_TRUE(at::equal(after.v, v_before.index_select(2, kept)));
  EXPECT_TRUE(at::equal(after.k.narrow(2, 4, 4), k_before.narrow(2, 28, 4)));
  EXPECT_TRUE(at::allclose(after.k.narrow(2, 0, 4), k_before.index_select(2, kept.narrow(0, 0, 4)), 0, 4e-3));
  // Decode (r = 8, budget 24): flushes of 8 keys into new groups, scattered evictions
  // inside them. Partial groups never hold more bytes than their survivors would in fp16, so
  // the cache never exceeds 32 B (fp16 K + V, D = 8) per resident token.
  TorchCache d(make_config(1, 1, 1, 8, "kivi:k2:v2:g8:r8", "h2o:r4@24"));
  int64_t conversions_seen = 0, groups_seen = 0, dead_seen = 0;
  for (int64_t i = 0; i < 120; ++i) {
    d.append(0, testing::randn({1, 1, 1, 8}, gen), testing::randn({1, 1, 1, 8}, gen), positions_range(i, 1));
    d.observe_attention(0, testing::random_probs(1, 1, 1, testing::physical_length(d, 0), gen));
    d.end_step(testing::step_kind(i == 0));
    d.check_invariants();
    EXPECT_EQ(testing::physical_length(d, 0), std::min<int64_t>(i + 1, 24));
    EXPECT_LE(d.stats().bytes_resident, 32 * testing::physical_length(d, 0));
    auto s = CacheManagerAccess::stream(d.core(), 0, true);
    if (s.converted_tokens[0] > 0) ++conversions_seen;
    groups_seen += s.quantized_groups[0];
    dead_seen += s.dead_slots[0];
  }
  // The sequence exercised all three cases: live groups, dead slots, fp16 conversions.
  EXPECT_GT(groups_seen, 0);
  EXPECT_GT(dead_seen, 0);
  EXPECT_GT(conversions_seen, 0);
}

// A sliding window drains the oldest key group token by token: dead slots stay below one
// group, and the group is converted or freed, never requantized.
TEST(Kivi, WindowDrainsGroupsFrontFirst) {
  TorchCache m(make_config(1, 1, 1, 8, "kivi:k2:v2:g8:r16", "window@20"));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  int64_t max_bytes = 0;
  for (int64_t i = 0; i < 120; ++i) {
    m.append(0, testing::randn({1, 1, 1, 8}, gen), testing::randn({1, 1, 1, 8}, gen), positions_range(i, 1));
    m.end_step(testing::step_kind(i == 0));
    m.check_invariants();
    auto ks = CacheManagerAccess::stream(m.core(), 0, true);
    EXPECT_LT(ks.dead_slots[0], 8);
    EXPECT_LE(ks.quantized_groups[0], 20 / 8 + 1);
    EXPECT_EQ(testing::physical_length(m, 0), std::min<int64_t>(i + 1, 20));
    if (i >= 40) max_bytes = std::max(max_bytes, m.stats().bytes_resident);
  }
  // Steady state never holds more than 20 fp16 tokens' worth of K and V (640 B).
  EXPECT_LE(max_bytes, 20 * 2 * 16);
}

}  // namespace
}  // namespace kvcache
