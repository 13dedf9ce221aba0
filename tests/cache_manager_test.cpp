// SPDX-License-Identifier: Apache-2.0
// CacheManager: bit-exact fp32 path, bookkeeping with exact numbers, policies end to end,
// re-rotation, and invariants under seeded random append/evict sequences.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cache/cache_manager_access.h"
#include "cache_test_util.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/multi_sequence_cache.h"
#include "kvcache/torch.h"

namespace kvcache {
namespace {

using testing::make_config;
using testing::positions_range;
using testing::Snapshot;
using testing::test_rope;

TEST(CacheConfig, ValidateNamesTheBadField) {
  auto ok = make_config(2, 4, 2, 8, "fp32", "full");
  EXPECT_NO_THROW(ok.validate());
  auto c = ok;
  c.rope = nullptr;
  EXPECT_THROW(c.validate(), InvalidArgument);
  c = ok;
  c.num_q_heads = 3;
  EXPECT_THROW(c.validate(), InvalidArgument);
  c = ok;
  c.position_mode = PositionMode::kRerotate;  // needs pre-RoPE keys
  try {
    c.validate();
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("kPreRoPE"), std::string::npos) << e.what();
  }
  c.key_storage = KeyStorage::kPreRoPE;
  EXPECT_NO_THROW(c.validate());
  c = ok;
  c.scheme = "int5";
  EXPECT_THROW(TorchCache{c}, InvalidArgument);
  c = ok;
  c.policy = "lru@3";
  EXPECT_THROW(c.validate(), InvalidArgument);
  c = ok;
  c.scheme = "kivi:k2:v2:g32:r100";  // r not a multiple of g
  EXPECT_THROW(c.validate(), InvalidArgument);
  c = ok;
  c.scheme = "kivi:k2:v2:g16:r32";  // head_dim 8 not divisible by 16
  EXPECT_THROW(c.validate(), InvalidArgument);
  c = ok;
  c.policy = "sink:s4:w8@10";
  EXPECT_THROW(c.validate(), CapacityError);
}

// fp32 + full: get() is bit-identical to concatenating rope(k) and v chunk by chunk.
TEST(CacheManager, Fp32FullIsBitIdenticalToConcatenation) {
  {
    const int64_t batch = 1;
    TorchCache m(make_config(2, 4, 2, 8, "fp32", "full"));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    std::vector<std::vector<at::Tensor>> ks(2), vs(2);
    int64_t pos = 0;
    for (int64_t n : {5, 3, 1, 1, 1, 7}) {
      for (int64_t l = 0; l < 2; ++l) {
        auto k = testing::randn({batch, 2, n, 8}, gen);
        auto v = testing::randn({batch, 2, n, 8}, gen);
        m.append(l, k, v, positions_range(pos, n));
        ks[l].push_back(test_rope(k, positions_range(pos, n)));
        vs[l].push_back(v.clone());
        m.check_invariants();
        auto kv = m.get(l);
        EXPECT_TRUE(at::equal(kv.k, at::cat(ks[l], 2)));
        EXPECT_TRUE(at::equal(kv.v, at::cat(vs[l], 2)));
        EXPECT_TRUE(at::equal(kv.positions,
                              positions_range(0, pos + n).unsqueeze(0).expand({2, pos + n})));
      }
      m.end_step(StepKind::kDecode);
      m.check_invariants();
      pos += n;
    }
    EXPECT_EQ(m.tokens(0).written, 18);
    EXPECT_EQ(testing::physical_length(m, 1), 18);
    EXPECT_EQ(m.next_position(0), 18);
    // 18 tokens × 2 layers × (K + V) × 2 heads × 8 × 4 B.
    EXPECT_EQ(m.stats().bytes_resident, 18 * 2 * 2 * 2 * 8 * 4 * batch);
    // Blocks of 64 tokens: one per layer, stream and head, 64 × 8 × 4 B each.
    EXPECT_EQ(m.stats().bytes_reserved, 2 * 2 * 2 * 64 * 8 * 4);
  }
}

TEST(CacheManager, OneSequencePerCache) {
  TorchCache m(make_config(1, 4, 2, 8, "fp32", "full"));
  try {
    m.append(0, at::zeros({2, 2, 3, 8}), at::zeros({2, 2, 3, 8}), positions_range(0, 3));
    FAIL() << "batch 2 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("B=1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.append(0, at::zeros({1, 2, 3, 8}, at::kDouble), at::zeros({1, 2, 3, 8}, at::kDouble),
                        positions_range(0, 3)),
               InvalidArgument);  // float64 is not a cache dtype
  EXPECT_EQ(m.stats().tokens_written, 0);
}

TEST(CacheManager, AppendValidation) {
  TorchCache m(make_config(2, 4, 2, 8, "fp32", "full"));
  auto k = at::zeros({1, 2, 3, 8});
  EXPECT_THROW(m.append(2, k, k, positions_range(0, 3)), InvalidArgument);  // layer
  try {
    m.append(0, at::zeros({1, 3, 3, 8}), k, positions_range(0, 3));
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("H_kv=2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.append(0, k, at::zeros({1, 2, 4, 8}), positions_range(0, 3)), InvalidArgument);
  EXPECT_THROW(m.append(0, k, k, positions_range(0, 2)), InvalidArgument);
  EXPECT_THROW(m.append(0, k, k, at::tensor({0, 2, 1}, at::kLong)), InvalidArgument);
  m.append(0, k, k, positions_range(0, 3));
  EXPECT_THROW(m.append(0, k, k, positions_range(2, 3)), InvalidArgument);  // overlaps
  EXPECT_THROW(m.end_step(StepKind::kDecode), InvalidArgument);  // layer 1 appended nothing
  m.append(1, k, k, positions_range(0, 3));
  EXPECT_NO_THROW(m.end_step(StepKind::kDecode));
  EXPECT_THROW(m.observe_attention(0, at::zeros({1, 4, 1, 2})), InvalidArgument);  // T_res 3
  m.check_invariants();
}

// Keys whose RoPE leaves float32 are refused whether keys are stored after RoPE (rotated once,
// at the append) or before it (rotated at every read), with the same message, and the rejected
// append changes nothing; at position 0 (the identity) the same values are stored and read back
// finite (issue 39, fault 3: pre-RoPE storage accepted them and get() returned +Inf).
TEST(CacheManager, KeysWhoseRopeOverflowsAreRefusedInBothStorages) {
  for (const KeyStorage ks : {KeyStorage::kPostRoPE, KeyStorage::kPreRoPE}) {
    const std::string where = ks == KeyStorage::kPreRoPE ? "pre-RoPE" : "post-RoPE";
    auto c = make_config(1, 2, 2, 8, "fp32", "full");
    c.key_storage = ks;
    TorchCache m(c);
    // At position 1: y[4] = x[4]·cos 1 + x[0]·sin 1 = 3e38 · 1.38, beyond float32.
    at::Tensor k = at::zeros({1, 2, 2, 8});
    k[0][1][1][0] = 3.0e38f;
    k[0][1][1][4] = 3.0e38f;
    const Snapshot before(m);
    const std::string err =
        testing::error_of([&] { m.append(0, k, at::zeros({1, 2, 2, 8}), positions_range(0, 2)); });
    EXPECT_NE(err.find("CacheManager::append: rope(k) contains +Inf at [b, h, t, d] = [0, 1, 1, 4]"),
              std::string::npos)
        << where << ": " << err;
    before.expect_unchanged(m, where + " after the refused append");
    at::Tensor k0 = at::zeros({1, 2, 1, 8});
    k0[0][1][0][0] = 3.0e38f;
    k0[0][1][0][4] = 3.0e38f;
    m.append(0, k0, at::zeros({1, 2, 1, 8}), positions_range(0, 1));
    const TensorLayerKV kv = m.get(0);
    EXPECT_TRUE(at::isfinite(kv.k).all().item<bool>()) << where;
    EXPECT_EQ(kv.k[0][1][0][4].item<float>(), 3.0e38f) << where;
    m.check_invariants();
  }
}

// The order of a step is one rule for every policy: after attend(), observe_attention or
// observe_queries on a layer, an append to it in the same step is refused — also when the
// policy reads no attention (issue 39, fault 8: `full` and `window` accepted it) — and changes
// nothing; the next step appends again.
TEST(CacheManager, AppendAfterAttendIsRefusedForEveryPolicy) {
  for (const std::string policy : {"full", "window@8", "h2o@8", "expected:s2:stream@8"}) {
    for (int how = 0; how < 3; ++how) {  // attend, observe_attention, observe_queries
      TorchCache m(make_config(1, 4, 2, 8, "fp32", policy, 32));
      auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
      m.append(0, testing::randn({1, 2, 3, 8}, gen), testing::randn({1, 2, 3, 8}, gen), positions_range(0, 3));
      if (how == 0) (void)m.attend(0, testing::randn({1, 4, 3, 8}, gen), positions_range(0, 3));
      if (how == 1) m.observe_attention(0, testing::random_probs(1, 4, 3, 3, gen));
      if (how == 2) m.observe_queries(0, testing::randn({1, 4, 3, 8}, gen), positions_range(0, 3));
      const std::string where = policy + " after " + std::vector<std::string>{"attend", "observe_attention", "observe_queries"}[how];
      const Snapshot before(m);
      const std::string err = testing::error_of(
          [&] { m.append(0, testing::randn({1, 2, 1, 8}, gen), testing::randn({1, 2, 1, 8}, gen), positions_range(3, 1)); });
      EXPECT_NE(err.find("CacheManager::append: the attention of layer 0 was already observed in this step"),
                std::string::npos)
          << where << ": " << err;
      EXPECT_NE(err.find("append the step's tokens first, then attend, then end_step()"), std::string::npos) << where;
      before.expect_unchanged(m, where);
      if (how != 0) (void)m.attend(0, testing::randn({1, 4, 3, 8}, gen), positions_range(0, 3));
      m.end_step(StepKind::kPrefillEnd);
      m.append(0, testing::randn({1, 2, 1, 8}, gen), testing::randn({1, 2, 1, 8}, gen), positions_range(3, 1));
      EXPECT_EQ(m.tokens(0).written, 4) << where;
      m.check_invariants();
    }
  }
}

struct StepExpect {
  int64_t chunk, written, resident_after_append, resident_after_end, peak_bytes;
};

// Chunked prefill under window@8: resident ≤ budget + chunk; exact bytes for fp32 and int8.
TEST(CacheManager, ChunkedIngestionBookkeeping) {
  // fp32: 2 (K, V) × 2 heads × 4 dims × 4 B = 64 B per token per layer.
  // int8 (one group per token): 2 × 2 × (4 codes + fp16 scale + fp16 zero) = 32 B.
  for (auto [quant, per_token] : std::vector<std::pair<std::string, int64_t>>{{"fp32", 64}, {"int8", 32}}) {
    TorchCache m(make_config(2, 2, 2, 4, quant, "window@8"));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    const std::vector<StepExpect> steps = {
        {5, 5, 5, 5, 5}, {5, 10, 10, 8, 10}, {5, 15, 13, 8, 13}, {1, 16, 9, 8, 13}, {1, 17, 9, 8, 13}};
    int64_t pos = 0;
    for (const auto& s : steps) {
      for (int64_t l = 0; l < 2; ++l) {
        m.append(l, testing::randn({1, 2, s.chunk, 4}, gen), testing::randn({1, 2, s.chunk, 4}, gen),
                 positions_range(pos, s.chunk));
        m.check_invariants();
        EXPECT_EQ(m.tokens(l).stats.tokens_resident, s.resident_after_append);
        EXPECT_EQ(m.tokens(l).stats.bytes_resident, s.resident_after_append * per_token);
      }
      m.end_step(testing::step_kind(s.chunk > 1 && pos + s.chunk == 15));
      m.check_invariants();
      pos += s.chunk;
      for (int64_t l = 0; l < 2; ++l) {
        auto st = m.tokens(l).stats;
        EXPECT_EQ(st.tokens_written, s.written) << quant << " step " << pos;
        EXPECT_EQ(st.tokens_resident, s.resident_after_end);
        EXPECT_EQ(st.tokens_resident_peak, s.peak_bytes);  // peak tokens
        EXPECT_EQ(st.bytes_resident, s.resident_after_end * per_token);
        EXPECT_EQ(st.bytes_resident_peak, s.peak_bytes * per_token);
        EXPECT_LE(st.tokens_resident_peak, 8 + 5);  // budget + chunk
      }
      auto total = m.stats();
      EXPECT_EQ(total.tokens_written, 2 * s.written);
      EXPECT_EQ(total.bytes_resident, 2 * s.resident_after_end * per_token);
      EXPECT_EQ(total.bytes_resident_peak, 2 * s.peak_bytes * per_token);
    }
    // The window keeps the 8 most recent positions, original positions.
    EXPECT_TRUE(at::equal(m.get(0).positions, positions_range(9, 8).unsqueeze(0).expand({2, 8})));
    EXPECT_EQ(m.next_position(0), 17);
    m.reset(100);
    EXPECT_EQ(m.stats().bytes_resident_peak, 0);
    EXPECT_EQ(testing::physical_length(m, 0), 0);
  }
}

// kvpress StreamingLLM vector through the manager: T = 10, sink@50% → positions [0,1,2,3,9].
TEST(CacheManager, SinkKeepsSinksAndRecentWithOriginalPositions) {
  auto c = make_config(1, 2, 2, 4, "fp32", "sink@50%", 10);
  TorchCache m(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto k = testing::randn({1, 2, 10, 4}, gen), v = testing::randn({1, 2, 10, 4}, gen);
  m.append(0, k, v, positions_range(0, 10));
  m.end_step(StepKind::kPrefillEnd);
  m.check_invariants();
  auto kv = m.get(0);
  auto idx = at::tensor({0, 1, 2, 3, 9}, at::kLong);
  EXPECT_TRUE(at::equal(kv.positions, idx.unsqueeze(0).expand({2, 5})));
  EXPECT_TRUE(at::equal(kv.v, v.index_select(2, idx)));
  EXPECT_TRUE(at::equal(kv.k, test_rope(k, positions_range(0, 10)).index_select(2, idx)));
  EXPECT_EQ(m.next_position(0), 10);  // new tokens get their true absolute position
  EXPECT_EQ(m.tokens(0).written, 10);
  EXPECT_EQ(testing::physical_length(m, 0), 5);
}

// H2O end to end with GQA (H_q = 14, H_kv = 2): heads keep different tokens.
TEST(CacheManager, H2OPerHeadSurvivorsFromObservedAttention) {
  TorchCache m(make_config(1, 14, 2, 4, "int8", "h2o:r2@4"));
  EXPECT_TRUE(m.policy().needs_attention());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto k = testing::randn({1, 2, 6, 4}, gen), v = testing::randn({1, 2, 6, 4}, gen);
  m.append(0, k, v, positions_range(0, 6));
  auto probs = at::zeros({1, 14, 1, 6});
  for (int64_t h = 0; h < 7; ++h) probs[0][h][0][1] = 1.0f;   // KV head 0: token 1
  probs[0][7][0][0] = 0.7f;                                   // KV head 1: tokens 0 and 3
  probs[0][8][0][3] = 0.7f;
  probs[0][9][0][3] = 0.3f;
  m.observe_attention(0, probs);
  auto before = m.get(0).v.clone();
  m.end_step(StepKind::kPrefillEnd);
  m.check_invariants();
  auto kv = m.get(0);
  // KV head 0: heavy {1, 3 (tie 0/2/3 at 0 → most recent 3)}; KV head 1: heavy {0, 3}.
  EXPECT_TRUE(at::equal(kv.positions, at::tensor({1, 3, 4, 5, 0, 3, 4, 5}, at::kLong).view({2, 4})));
  EXPECT_TRUE(at::equal(kv.v[0][0], before[0][0].index_select(0, at::tensor({1, 3, 4, 5}, at::kLong))));
  EXPECT_TRUE(at::equal(kv.v[0][1], before[0][1].index_select(0, at::tensor({0, 3, 4, 5}, at::kLong))));
  // Decode one token: observe over 5 keys, evict back to 4.
  m.append(0, testing::randn({1, 2, 1, 4}, gen), testing::randn({1, 2, 1, 4}, gen), positions_range(6, 1));
  EXPECT_THROW(m.end_step(StepKind::kDecode), InvalidArgument);  // attention not observed for the new token
  auto p2 = at::full({1, 14, 1, 5}, 0.2f);
  m.observe_attention(0, p2);
  m.end_step(StepKind::kDecode);
  m.check_invariants();
  EXPECT_EQ(testing::physical_length(m, 0), 4);
  EXPECT_EQ(m.get(0).positions[0][3].item<int64_t>(), 6);
}

TEST(CacheManager, SnapKVCompressesOnceAtPrefillEndThenGrows) {
  // Context 20 = 16 prompt + 4 new; budget 50% = 10 → keep 6 prompt tokens (window 4 + top 2).
  TorchCache m(make_config(2, 4, 2, 8, "fp16", "snapkv:w4:k3@50%", 20));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  for (int64_t chunk = 0; chunk < 2; ++chunk) {
    for (int64_t l = 0; l < 2; ++l) {
      m.append(l, testing::randn({1, 2, 8, 8}, gen), testing::randn({1, 2, 8, 8}, gen),
               positions_range(chunk * 8, 8));
      m.observe_attention(l, testing::random_probs(1, 4, 8, (chunk + 1) * 8, gen));
    }
    m.end_step(testing::step_kind(chunk == 1));
    m.check_invariants();
  }
  EXPECT_EQ(testing::physical_length(m, 0), 6);
  EXPECT_FALSE(m.policy().needs_attention());
  auto pos = m.get(1).positions;
  EXPECT_TRUE(at::equal(pos.narrow(1, 2, 4), positions_range(12, 4).unsqueeze(0).expand({2, 4})));
  for (int64_t step = 0; step < 4; ++step) {
    for (int64_t l = 0; l < 2; ++l) {
      m.append(l, testing::randn({1, 2, 1, 8}, gen), testing::randn({1, 2, 1, 8}, gen),
               positions_range(16 + step, 1));
    }
    m.end_step(StepKind::kDecode);
    m.check_invariants();
  }
  EXPECT_EQ(testing::physical_length(m, 0), 10);  // budget holds after the last announced token
  EXPECT_EQ(m.tokens(0).stats.tokens_resident_peak, 16);  // SnapKV holds the whole prompt first
}

// StreamingLLM re-rotation: keys stored pre-RoPE; after eviction kept keys carry contiguous
// positions. RoPE(prune(K), new positions) == rerotate(prune(RoPE(K))).
TEST(CacheManager, RerotateMatchesRopeOfPrunedKeys) {
  auto c = make_config(1, 2, 2, 8, "fp32", "sink:s2:w3");
  c.key_storage = KeyStorage::kPreRoPE;
  c.position_mode = PositionMode::kRerotate;
  TorchCache m(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(21);
  std::vector<at::Tensor> kept_pre;  // pre-RoPE keys of the expected survivors
  std::vector<int64_t> orig_pos;     // their original (absolute) positions
  int64_t absolute = 0;
  for (int64_t step = 0; step < 12; ++step) {
    const int64_t n = step == 0 ? 4 : 1;
    auto k = testing::randn({1, 2, n, 8}, gen);
    EXPECT_EQ(m.next_position(0), static_cast<int64_t>(kept_pre.size()));
    m.append(0, k, testing::randn({1, 2, n, 8}, gen), positions_range(m.next_position(0), n));
    for (int64_t i = 0; i < n; ++i) {
      kept_pre.push_back(k.narrow(2, i, 1));
      orig_pos.push_back(absolute++);
    }
    m.end_step(testing::step_kind(step == 0));
    m.check_invariants();
    if (kept_pre.size() > 5) {  // sinks 2 + window 3
      kept_pre.erase(kept_pre.begin() + 2, kept_pre.end() - 3);
      orig_pos.erase(orig_pos.begin() + 2, orig_pos.end() - 3);
    }
    const auto n_kept = static_cast<int64_t>(kept_pre.size());
    auto pruned = at::cat(kept_pre, 2);
    auto expect = test_rope(pruned, positions_range(0, n_kept));
    auto kv = m.get(0);
    EXPECT_TRUE(at::allclose(kv.k, expect, 1e-5, 1e-5)) << "step " << step;
    EXPECT_TRUE(at::equal(kv.positions, positions_range(0, n_kept).unsqueeze(0).expand({2, n_kept})));
    // kvpress KeyRerotationPress: rotate the post-RoPE survivors by (new − old) positions.
    auto old_pos = at::tensor(orig_pos, at::kLong);
    std::vector<at::Tensor> rerot;
    for (int64_t i = 0; i < n_kept; ++i) {
      auto post = test_rope(pruned.narrow(2, i, 1), old_pos.narrow(0, i, 1));
      rerot.push_back(test_rope(post, at::tensor({i - orig_pos[static_cast<size_t>(i)]}, at::kLong)));
    }
    EXPECT_TRUE(at::allclose(kv.k, at::cat(rerot, 2), 1e-4, 1e-4)) << "step " << step;
  }
  EXPECT_THROW(m.append(0, at::zeros({1, 2, 1, 8}), at::zeros({1, 2, 1, 8}), positions_range(99, 1)),
               InvalidArgument);
}

// Head-wise eviction (adakv, duo) leaves the KV heads of a layer with different numbers of
// tokens. In kRerotate mode each head's survivors are numbered contiguously up to the layer's
// next position (a head of n_h tokens holds next − n_h .. next − 1), so the one query position
// sees every head's keys at the distances the head would give them numbered alone: attention
// per head equals softmax over rope(k_h, 0 .. n_h − 1) with the query at n_h − 1. Before this
// the shorter head's next token took the longer head's next position, and check_invariants()
// threw "rerotate positions not contiguous at head 1" (issue 39, fault 1).
TEST(CacheManager, RerotateWithRaggedHeadsNumbersEachHeadUpToTheNextPosition) {
  for (const std::string policy : {"adakv:knorm:stream@6", "duo:s2:r6:w4@24"}) {
    auto c = make_config(1, 4, 2, 8, "fp32", policy, 40);
    c.key_storage = KeyStorage::kPreRoPE;
    c.position_mode = PositionMode::kRerotate;
    TorchCache m(c);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    bool ragged = false;
    for (int64_t step = 0; step < 11; ++step) {
      const int64_t n = step == 0 ? 30 : 1;
      const int64_t p = m.next_position(0);
      at::Tensor k = testing::randn({1, 2, n, 8}, gen);
      k[0][1].mul_(3.0);  // the heads' keys differ in scale: they score differently
      const at::Tensor v = testing::randn({1, 2, n, 8}, gen);
      m.append(0, k, v, positions_range(p, n));
      const at::Tensor q_pre = testing::randn({1, 4, n, 8}, gen);
      const at::Tensor out = m.attend(0, test_rope(q_pre, positions_range(p, n)), positions_range(p, n));
      if (n == 1) {
        // Per KV head h: its stored pre-RoPE keys numbered 0 .. n_h − 1, the query at n_h − 1.
        const auto ks = cache::CacheManagerAccess::stream(m.core(), 0, true);
        const auto vs = cache::CacheManagerAccess::stream(m.core(), 0, false);
        for (int64_t h = 0; h < 2; ++h) {
          const at::Tensor kh = as_tensor(ks.stored[static_cast<size_t>(h)])[0][0];  // [n_h, D]
          const int64_t nh = kh.size(0);
          const at::Tensor kr = test_rope(kh.view({1, 1, nh, 8}), positions_range(0, nh))[0][0];
          const at::Tensor qh = test_rope(q_pre.narrow(1, 2 * h, 2), positions_range(nh - 1, 1))[0];  // [2, 1, D]
          const at::Tensor probs = at::softmax(at::matmul(qh, kr.t()) / std::sqrt(8.0), -1);
          const at::Tensor want = at::matmul(probs, as_tensor(vs.stored[static_cast<size_t>(h)])[0][0]);
          EXPECT_TRUE(at::allclose(out[0].narrow(0, 2 * h, 2), want, 1e-5, 1e-5))
              << policy << " step " << step << " head " << h << " (" << nh << " tokens)";
        }
      }
      m.end_step(step == 0 ? StepKind::kPrefillEnd : StepKind::kDecode);
      m.check_invariants();
      const LayerTokens t = m.tokens(0);
      const int64_t next = m.next_position(0);
      EXPECT_EQ(next, t.max_resident()) << policy;
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t nh = t.resident(h);
        std::vector<int64_t> want(static_cast<size_t>(nh));
        for (int64_t j = 0; j < nh; ++j) want[static_cast<size_t>(j)] = next - nh + j;
        EXPECT_EQ(t.positions[static_cast<size_t>(h)], want) << policy << " step " << step << " head " << h;
      }
      ragged = ragged || t.resident(0) != t.resident(1);
    }
    EXPECT_TRUE(ragged) << policy << " never left the heads with different counts: the test tests nothing";
  }
}

TEST(CacheManager, PreRopeOriginalPositionsRotatesOnRead) {
  auto c = make_config(1, 2, 2, 8, "int4", "window@6");
  c.key_storage = KeyStorage::kPreRoPE;
  TorchCache m(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  int64_t pos = 0;
  for (int64_t n : {5, 4, 1, 1}) {
    m.append(0, testing::randn({1, 2, n, 8}, gen), testing::randn({1, 2, n, 8}, gen), positions_range(pos, n));
    m.end_step(StepKind::kDecode);
    m.check_invariants();  // checks k == rope(dequant(stored pre-RoPE keys), positions)
    pos += n;
  }
  EXPECT_TRUE(at::equal(m.get(0).positions, positions_range(5, 6).unsqueeze(0).expand({2, 6})));
  auto kv = cache::CacheManagerAccess::stream(m.core(), 0, true);
  EXPECT_TRUE(at::allclose(m.get(0).k.narrow(1, 1, 1), test_rope(as_tensor(kv.stored[1]), positions_range(5, 6)), 1e-5, 1e-5));
}

TEST(CacheManager, ResidualWindowWithPlainQuantizer) {
  auto c = make_config(1, 2, 2, 8, "int4", "full");
  c.residual_length = 3;
  TorchCache m(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  auto v = testing::randn({1, 2, 5, 8}, gen);
  m.append(0, testing::randn({1, 2, 5, 8}, gen), v, positions_range(0, 5));
  m.end_step(StepKind::kPrefillEnd);
  m.check_invariants();
  auto s = cache::CacheManagerAccess::stream(m.core(), 0, false);
  EXPECT_EQ(s.quantized_tokens, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(s.residual_tokens, (std::vector<int64_t>{3, 3}));
  EXPECT_TRUE(s.token_readable);
  EXPECT_TRUE(at::equal(as_tensor(s.residual[0]), v.narrow(1, 0, 1).narrow(2, 2, 3).to(at::kHalf).to(at::kFloat)));
  // Bytes: per head 2 int4 tokens (4 B codes + 2 + 2 B) + 3 fp16 tokens (16 B) = 16 + 48.
  EXPECT_EQ(m.tokens(0).stats.bytes_resident, 2 * 2 * (2 * 8 + 3 * 16));
}

// Seeded random sequences over quantizers × policies × key storage × block sizes:
// check_invariants() after every append, attention and end_step; attention comes from
// attend() or from observe_attention(probs) at random; rejected calls (NaN in K or V, a
// bad shape) change nothing. tests/cache_hostile_test.cpp tries many more rejected calls.
TEST(CacheManager, RandomizedInvariants) {
  const std::vector<std::string> quants = {"fp32", "fp16", "int8", "int4:g4", "int2:g8:chan",
                                           "fp8:e4m3:scaled", "kivi:k2:v4:g4:r8", "gear:b2:g4:s0.25:r1:loop1:nb8",
                                           "gear:b2:g4:s0.25:r1:loop1:nb8:rp2:whole"};
  const std::vector<std::string> policies = {"full", "window@12", "sink:s2@12", "h2o@12",
                                             "random:seed3@12", "tova@12", "snapkv:w4@90%",
                                             "pyramid:w4:b2@90%", "knorm:stream@12", "keydiff:stream@12",
                                             "expected:s2:stream@12", "expected:s2:n8@90%", "adakv:h2o@12",
                                             "adakv:knorm:stream@12", "adakv:snapkv:w4@90%", "duo:s2:r6:w4@24",
                                             "decode:i3:b2:keydiff@12", "decode:i4:b2:prefill:adakv:expected:s2@12",
                                             "perlayer(h2o@8;h2o@12)", "perlayer(full;snapkv:w4@90%)",
                                             "kvzip:s2@90%", "adakv:kvzip:s2@90%"};
  // Policies that hold every head within the budget after every step, and those that hold the
  // layer's total within H_kv × budget (head-wise).
  auto starts = [](const std::string& p, const char* head) { return p.rfind(head, 0) == 0; };
  auto per_head_bound = [&](const std::string& p) {
    for (const char* h : {"window", "sink", "h2o", "random", "tova", "perlayer(h2o"}) {
      if (starts(p, h)) return true;
    }
    return (starts(p, "knorm") || starts(p, "keydiff") || starts(p, "expected")) &&
           p.find(":stream") != std::string::npos;
  };
  uint64_t seed = 100;
  for (const auto& quant : quants) {
    for (const auto& policy : policies) {
      for (int mode = 0; mode < 3; ++mode) {  // post-RoPE, pre-RoPE, pre-RoPE + rerotate
        // Re-rotation: positional policies, and the head-wise ones (adakv, duo), whose ragged
        // heads are each numbered up to the layer's next position.
        const bool positional = policy.rfind("window", 0) == 0 || policy.rfind("sink", 0) == 0;
        const bool head_wise = policy.find("adakv") != std::string::npos || policy.rfind("duo", 0) == 0;
        if (mode == 2 && !positional && !head_wise) continue;
        auto c = make_config(2, 4, 2, 8, quant, policy, 40);
        if (mode >= 1) c.key_storage = KeyStorage::kPreRoPE;
        if (mode == 2) c.position_mode = PositionMode::kRerotate;
        std::mt19937 rng(static_cast<uint32_t>(seed + 1));
        c.block_tokens = std::vector<int64_t>{0, 8, 16}[rng() % 3];  // multiples of every group here
        TorchCache m(c);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(++seed);
        int64_t steps = 0;
        int64_t written = 0;
        const std::string where = quant + " " + policy + " mode " + std::to_string(mode);
        while (written < 40) {
          const bool prefill = steps < 3;
          int64_t n = prefill ? 4 + static_cast<int64_t>(rng() % 6) : 1;
          n = std::min<int64_t>(n, 40 - written);
          for (int64_t l = 0; l < 2; ++l) {
            const int64_t p0 = m.next_position(l);
            if (rng() % 5 == 0) {  // a rejected call first
              const Snapshot before(m);
              auto bad = testing::randn({1, 2, n, 8}, gen);
              bad[0][rng() % 2][static_cast<int64_t>(rng() % n)][3] = std::nanf("");
              if (rng() % 2) {
                EXPECT_THROW(m.append(l, bad, testing::randn({1, 2, n, 8}, gen), positions_range(p0, n)), InvalidArgument);
              } else {
                EXPECT_THROW(m.append(l, testing::randn({1, 2, n, 8}, gen), bad, positions_range(p0, n)), InvalidArgument);
              }
              EXPECT_THROW(m.append(l, testing::randn({1, 2, n, 7}, gen), bad, positions_range(p0, n)), InvalidArgument);
              before.expect_unchanged(m, where + " after a rejected append");
            }
            m.append(l, testing::randn({1, 2, n, 8}, gen) * 2.0, testing::randn({1, 2, n, 8}, gen),
                     positions_range(p0, n));
            m.check_invariants();
            const auto pos = m.tokens(l).positions;
            const bool uniform = pos[0].size() == pos[1].size();  // observe_attention needs equal heads
            if (m.policy().needs_attention() && uniform && rng() % 2) {
              m.observe_attention(l, testing::random_probs(1, 4, n, testing::physical_length(m, l), gen));
            } else {
              (void)m.attend(l, testing::randn({1, 4, n, 8}, gen), positions_range(p0, n));
            }
          }
          m.end_step(testing::step_kind(steps == 2));
          m.check_invariants();
          if (steps == 2 && m.replay_need().any()) {
            // KVzip's context replay: two chunks of random tokens at the positions after the
            // context; the first changes nothing, the last compresses.
            for (const StepKind kind : {StepKind::kReplay, StepKind::kReplayEnd}) {
              const Snapshot before(m);
              const int64_t r = 1 + static_cast<int64_t>(rng() % 5);
              m.begin_replay();
              for (int64_t l = 0; l < 2; ++l) {
                const int64_t p0 = m.next_position(l);
                m.append(l, testing::randn({1, 2, r, 8}, gen), testing::randn({1, 2, r, 8}, gen), positions_range(p0, r));
                (void)m.attend(l, testing::randn({1, 4, r, 8}, gen), positions_range(p0, r));
              }
              m.end_step(kind);
              m.check_invariants();
              if (kind == StepKind::kReplay) before.expect_unchanged(m, where + " after a replay chunk");
            }
            EXPECT_FALSE(m.replay_need().any()) << where;
          }
          written += n;
          ++steps;
          const auto st = m.tokens(1).stats;
          EXPECT_EQ(st.tokens_written, written);
          if (per_head_bound(policy)) {
            EXPECT_LE(st.tokens_resident, 12) << where;
          }
          if (starts(policy, "kvzip") && steps >= 3) {  // compressed after the replay
            EXPECT_LE(st.tokens_resident, 36) << where;
          }
          if (starts(policy, "adakv") && policy.find("snapkv") == std::string::npos &&
              policy.find("kvzip") == std::string::npos) {
            const auto t = m.tokens(1);
            EXPECT_LE(t.resident(0) + t.resident(1), 2 * 12) << where;
          }
          // Decode-time compression: back to 12 per head every i decoded tokens, so from its first
          // compression on a head holds at most 12 + i − 1 (head-wise: the layer 2·(12 + i − 1)).
          // i3 without prefill first compresses in the third decode step (steps 3, 4, 5).
          if (policy == "decode:i3:b2:keydiff@12" && steps >= 6) {
            const auto t = m.tokens(1);
            EXPECT_LE(std::max(t.resident(0), t.resident(1)), 12 + 2) << where << " step " << steps;
          }
          if (starts(policy, "decode:i4:b2:prefill") && steps >= 3) {
            const auto t = m.tokens(1);
            EXPECT_LE(t.resident(0) + t.resident(1), 2 * (12 + 3)) << where << " step " << steps;
          }
        }
        if (starts(policy, "duo")) {  // the budget holds on average over every head at the end
          int64_t total = 0;
          for (int64_t l = 0; l < 2; ++l) total += m.tokens(l).resident(0) + m.tokens(l).resident(1);
          EXPECT_LE(total, 2 * 2 * 24) << where;
        }
      }
    }
  }
}

// ------------------------------------------------------------ threads

/// What one cache computes over a fixed request: every attend() output of every step, then the
/// dequantized K/V and the stats (equal-length heads only).
struct CacheRun {
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> kv;
  CacheStats stats;
};

/// The inputs of one request, drawn up front (a generator is not shared across threads):
/// a 40-token prefill in chunks, then 24 decode steps, 2 layers, H_q 4, H_kv 2, D 32.
struct ThreadInputs {
  std::vector<int64_t> chunks;
  std::vector<std::array<at::Tensor, 3>> kvq;  ///< per step and layer: k, v, q
};

ThreadInputs thread_inputs(uint64_t seed) {
  ThreadInputs in;
  in.chunks = {17, 23};
  for (int i = 0; i < 24; ++i) in.chunks.push_back(1);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (int64_t n : in.chunks) {
    for (int64_t l = 0; l < 2; ++l) {
      in.kvq.push_back({testing::randn({1, 2, n, 32}, gen) * 2.0, testing::randn({1, 2, n, 32}, gen),
                        testing::randn({1, 4, n, 32}, gen)});
    }
  }
  return in;
}

CacheRun drive(KVCache& c, const ThreadInputs& in) {
  CacheRun r;
  int64_t pos = 0;
  size_t i = 0;
  for (size_t s = 0; s < in.chunks.size(); ++s) {
    const int64_t n = in.chunks[s];
    for (int64_t l = 0; l < 2; ++l, ++i) {
      c.append(l, in.kvq[i][0], in.kvq[i][1], positions_range(pos, n));
      r.outputs.push_back(c.attend(l, in.kvq[i][2], positions_range(pos, n)));
    }
    c.end_step(s == 0 ? StepKind::kPrefill : s == 1 ? StepKind::kPrefillEnd : StepKind::kDecode);
    pos += n;
  }
  return r;
}

void finish_run(const TorchCache& m, CacheRun& r) {
  for (int64_t l = 0; l < 2; ++l) {
    const TensorLayerKV kv = m.get(l);
    r.kv.push_back(kv.k);
    r.kv.push_back(kv.v);
  }
  r.stats = m.stats();
}

void expect_bit_equal(const CacheRun& a, const CacheRun& b, const std::string& where) {
  ASSERT_EQ(a.outputs.size(), b.outputs.size()) << where;
  for (size_t i = 0; i < a.outputs.size(); ++i) {
    EXPECT_TRUE(at::equal(a.outputs[i], b.outputs[i])) << where << ": attend() output " << i;
  }
  ASSERT_EQ(a.kv.size(), b.kv.size()) << where;
  for (size_t i = 0; i < a.kv.size(); ++i) EXPECT_TRUE(at::equal(a.kv[i], b.kv[i])) << where << ": K/V " << i;
  EXPECT_EQ(a.stats.bytes_resident, b.stats.bytes_resident) << where;
  EXPECT_EQ(a.stats.bytes_reserved_peak, b.stats.bytes_reserved_peak) << where;
  EXPECT_EQ(a.stats.tokens_resident, b.stats.tokens_resident) << where;
}

// Separate caches in one process share no mutable state (cache_manager.h, "Threads"): two
// threads, each driving its own cache at the same time, compute bit for bit what one thread
// computes driving the same caches one after the other — attention outputs, stored K/V,
// counters — for quantized, rotated, pre-RoPE and evicting caches and a MultiSequenceCache,
// over several rounds. (The hostile run of issue 39 matched 1,350 two-thread runs.)
TEST(CacheThreads, TwoThreadsTwoCachesAreBitEqualToOneThread) {
  struct Case {
    std::string scheme, policy;
    bool pre_rope;
  };
  const std::vector<std::pair<Case, Case>> pairs = {
      {{"int4:g32", "h2o@24", false}, {"kivi:k2:v2:g8:r16", "snapkv:w4@50%", false}},
      {{"had(int4)", "window@24", true}, {"fp8:e4m3:scaled", "expected:s2:stream@24", false}},
      {{"int8", "full", false}, {"gear:b2:g8:s0.25:r1:loop1:nb16", "knorm:stream@20", true}},
  };
  auto config = [](const Case& c) {
    CacheConfig cfg = make_config(2, 4, 2, 32, c.scheme, c.policy, 64);
    if (c.pre_rope) cfg.key_storage = KeyStorage::kPreRoPE;
    return cfg;
  };
  uint64_t seed = 40;
  for (const auto& [a, b] : pairs) {
    const ThreadInputs ia = thread_inputs(++seed), ib = thread_inputs(++seed);
    const std::string where = a.scheme + "+" + a.policy + " beside " + b.scheme + "+" + b.policy;
    // One thread: A, then B, then B's request again in a MultiSequenceCache sequence.
    CacheRun ra, rb, rs;
    {
      TorchCache ma(config(a)), mb(config(b));
      ra = drive(ma, ia);
      finish_run(ma, ra);
      rb = drive(mb, ib);
      finish_run(mb, rb);
      MultiSequenceConfig mc;
      mc.model = config(b);
      mc.capacity_bytes = int64_t{1} << 30;
      MultiSequenceCache pool(mc);
      Sequence& seq = pool.add_sequence();
      TorchCache s(seq);
      s.reset(64);
      rs = drive(s, ib);
    }
    expect_bit_equal(rb, CacheRun{rs.outputs, rb.kv, rb.stats}, where + " (sequence alone)");
    for (int round = 0; round < 4; ++round) {
      TorchCache ma(config(a)), mb(config(b));
      MultiSequenceConfig mc;
      mc.model = config(b);
      mc.capacity_bytes = int64_t{1} << 30;
      MultiSequenceCache pool(mc);
      Sequence& seq = pool.add_sequence();
      TorchCache s(seq);
      s.reset(64);
      CacheRun ta, tb, ts;
      std::string errors[3];
      std::atomic<int> ready{0};
      auto run = [&](int who, KVCache& c, const ThreadInputs& in, CacheRun& out) {
        ++ready;
        while (ready.load() < 3) std::this_thread::yield();  // start together
        try {
          out = drive(c, in);
        } catch (const std::exception& e) {
          errors[who] = e.what();
        }
      };
      std::thread t0(run, 0, std::ref(ma), std::cref(ia), std::ref(ta));
      std::thread t1(run, 1, std::ref(mb), std::cref(ib), std::ref(tb));
      std::thread t2(run, 2, std::ref(s), std::cref(ib), std::ref(ts));
      t0.join();
      t1.join();
      t2.join();
      for (const auto& e : errors) ASSERT_EQ(e, "") << where;
      finish_run(ma, ta);
      finish_run(mb, tb);
      const std::string w = where + ", round " + std::to_string(round);
      expect_bit_equal(ra, ta, w + " (cache A)");
      expect_bit_equal(rb, tb, w + " (cache B)");
      expect_bit_equal(rb, CacheRun{ts.outputs, rb.kv, rb.stats}, w + " (the sequence)");
      ma.check_invariants();
      mb.check_invariants();
      pool.check_invariants();
    }
  }
}

}  // namespace
}  // namespace kvcache
