// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared fixtures of the CacheManager tests: a small RoPE hook, configs, random KV and
// attention, and a Snapshot of everything a rejected call must leave unchanged.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "cache/cache_manager_access.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/kvquant.h"
#include "kvcache/torch/cache.h"
#include "kvcache/torch/rope.h"
#include "kvcache/torch/tensor_view.h"
#include "kvcache/torch.h"

namespace kvcache::testing {

/// Rotary embedding (rotate-half convention of HF Llama/Qwen, base 10000): x [B, H, T, D],
/// positions int64 [T] (negative positions rotate backwards, used to test re-rotation).
inline at::Tensor test_rope(const at::Tensor& x, const at::Tensor& positions) {
  const int64_t d = x.size(3), half = d / 2;
  auto inv_freq = at::pow(10000.0, -at::arange(0, half, at::kDouble) * 2.0 / static_cast<double>(d));
  auto ang = positions.to(at::kDouble).unsqueeze(1) * inv_freq.unsqueeze(0);  // [T, half]
  auto cos = at::cat({ang.cos(), ang.cos()}, 1).to(at::kFloat);               // [T, D]
  auto sin = at::cat({ang.sin(), ang.sin()}, 1).to(at::kFloat);
  auto x1 = x.narrow(3, 0, half), x2 = x.narrow(3, half, half);
  auto rot = at::cat({-x2, x1}, 3);
  return x * cos + rot * sin;
}

inline CacheConfig make_config(int64_t layers, int64_t hq, int64_t hkv, int64_t d,
                               const std::string& quant, const std::string& policy,
                               int64_t context = 0) {
  CacheConfig c;
  c.num_layers = layers;
  c.num_q_heads = hq;
  c.num_kv_heads = hkv;
  c.head_dim = d;
  c.scheme = quant;
  c.policy = policy;
  c.context_length = context;
  c.rope = rope_from(test_rope);
  return c;
}

inline at::Tensor randn(std::vector<int64_t> shape, at::Generator& gen) {
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat));
}

/// Softmax attention of random logits: [B, H_q, T_q, T] (rows sum to 1).
inline at::Tensor random_probs(int64_t b, int64_t hq, int64_t tq, int64_t t, at::Generator& gen) {
  return at::softmax(randn({b, hq, tq, t}, gen) * 2.0, -1);
}

/// A hand-made KVQuant calibration: every channel's key thresholds [−bound, bound], codebooks of
/// uniform centroids (2 bits: ±0.25, ±0.75) for 2, 3 and 4 bits, Q-Norm scale 2 / shift 0.5,
/// levels p = 0.99 and 1.
inline KvquantCalibration uniform_kvquant_calibration(int64_t L, int64_t H, int64_t D, float bound = 1.0f) {
  KvquantCalibration c;
  c.num_layers = L;
  c.num_kv_heads = H;
  c.head_dim = D;
  c.tokens = 1;
  c.source = "hand-made";
  c.bits = {2, 3, 4};
  for (double p : {0.99, 1.0}) {
    KvquantLevel lv;
    lv.sparsity = p;
    for (int64_t l = 0; l < L; ++l) {
      KvquantLayerCalibration lc;
      lc.key_lower.assign(static_cast<size_t>(H * D), -bound);
      lc.key_upper.assign(static_cast<size_t>(H * D), bound);
      for (int b : c.bits) {
        KvquantCodebook cb;
        cb.bits = b;
        const int k = 1 << b;
        for (int j = 0; j < k; ++j) cb.centroids.push_back(-1.0f + (2.0f * static_cast<float>(j) + 1.0f) / static_cast<float>(k));
        cb.qnorm_scale = 2.0f;
        cb.qnorm_shift = 0.5f;
        lc.key_codebooks.push_back(cb);
        lc.value_codebooks.push_back(cb);
      }
      lv.layers.push_back(lc);
    }
    c.levels.push_back(lv);
  }
  return c;
}

/// Files a test process wrote to the temporary directory, removed when it exits.
struct TempFilesRemovedAtExit {
  std::vector<std::string> paths;
  ~TempFilesRemovedAtExit() {
    for (const auto& p : paths) std::remove(p.c_str());
  }
};
inline TempFilesRemovedAtExit& temp_files_removed_at_exit() {
  static TempFilesRemovedAtExit files;
  return files;
}

/// uniform_kvquant_calibration() saved to a temporary .kvqcal file named by `tag`, the shape,
/// the bound and the process: its path (for a scheme's `:cal=` field). Removed at exit.
inline std::string uniform_kvquant_calibration_file(const std::string& tag, int64_t L, int64_t H, int64_t D,
                                                    float bound = 1.0f) {
  const std::string path = ::testing::TempDir() + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(L) +
                           "_" + std::to_string(H) + "_" + std::to_string(D) + "_" +
                           std::to_string(static_cast<int>(bound * 1000)) + ".kvqcal";
  save_kvquant_calibration(uniform_kvquant_calibration(L, H, D, bound), path);
  auto& files = temp_files_removed_at_exit().paths;
  if (std::find(files.begin(), files.end(), path) == files.end()) files.push_back(path);
  return path;
}

/// The step kind a test's prefill-end flag stands for.
inline StepKind step_kind(bool prefill_end) { return prefill_end ? StepKind::kPrefillEnd : StepKind::kDecode; }

/// Tokens of the largest head of `layer` (the layer's physical length).
inline int64_t physical_length(const TorchCache& m, int64_t layer) { return m.tokens(layer).max_resident(); }
inline int64_t physical_length(const SequenceCache& m, int64_t layer) { return m.tokens(layer).max_resident(); }

inline at::Tensor positions_range(int64_t start, int64_t n) {
  return at::arange(start, start + n, at::kLong);
}

/// Everything a CacheManager shows through its public API: totals and peaks, per layer the
/// positions, logical length, next position and counters, the dequantized K/V (when the heads
/// hold equal numbers of tokens), and the policy's budget and attention need. A rejected call
/// must leave it unchanged; two managers fed the same accepted calls must show the same.
struct Snapshot {
  CacheStats stats;
  std::vector<LayerTokens> layers;
  std::vector<at::Tensor> kv;  ///< per layer k, v (undefined for ragged heads)
  int64_t budget = 0;
  bool needs_attention = false;

  explicit Snapshot(const TorchCache& m) : stats(m.stats()) {
    for (int64_t l = 0; l < m.config().num_layers; ++l) {
      layers.push_back(m.tokens(l));
      const auto& pos = layers.back().positions;
      bool uniform = true;
      for (const auto& p : pos) uniform = uniform && p.size() == pos[0].size();
      if (uniform) {
        const TensorLayerKV g = m.get(l);
        kv.push_back(g.k.clone());
        kv.push_back(g.v.clone());
      } else {
        kv.emplace_back();
        kv.emplace_back();
      }
    }
    try {
      budget = m.policy().token_budget();
    } catch (const Error&) {
      budget = -1;  // a fractional budget before reset(context_length)
    }
    needs_attention = m.policy().needs_attention();
  }

  /// EXPECTs that `other` shows exactly this (bit for bit).
  void expect_same(const Snapshot& other, const std::string& where) const {
    auto same_stats = [&](const CacheStats& a, const CacheStats& b, const std::string& what) {
      EXPECT_EQ(a.tokens_written, b.tokens_written) << where << what;
      EXPECT_EQ(a.tokens_resident, b.tokens_resident) << where << what;
      EXPECT_EQ(a.tokens_resident_peak, b.tokens_resident_peak) << where << what;
      EXPECT_EQ(a.bytes_resident, b.bytes_resident) << where << what;
      EXPECT_EQ(a.bytes_resident_peak, b.bytes_resident_peak) << where << what;
      EXPECT_EQ(a.bytes_reserved, b.bytes_reserved) << where << what;
      EXPECT_EQ(a.bytes_reserved_peak, b.bytes_reserved_peak) << where << what;
    };
    same_stats(stats, other.stats, " (totals)");
    ASSERT_EQ(layers.size(), other.layers.size()) << where;
    for (size_t l = 0; l < layers.size(); ++l) {
      const std::string layer = " (layer " + std::to_string(l) + ")";
      EXPECT_EQ(layers[l].positions, other.layers[l].positions) << where << layer;
      EXPECT_EQ(layers[l].written, other.layers[l].written) << where << layer;
      EXPECT_EQ(layers[l].next_position, other.layers[l].next_position) << where << layer;
      same_stats(layers[l].stats, other.layers[l].stats, layer);
    }
    for (size_t i = 0; i < kv.size(); ++i) {
      ASSERT_EQ(kv[i].defined(), other.kv[i].defined()) << where;
      if (kv[i].defined()) {
        EXPECT_TRUE(at::equal(kv[i], other.kv[i])) << where << " (K/V " << i << ")";
      }
    }
    EXPECT_EQ(budget, other.budget) << where;
    EXPECT_EQ(needs_attention, other.needs_attention) << where;
  }
  /// EXPECTs that `m` still shows this snapshot.
  void expect_unchanged(const TorchCache& m, const std::string& where) const { expect_same(Snapshot(m), where); }
};

/// Appends a 30-token prefill and six decode tokens to every layer of `m` (2 KV heads, 4 query
/// heads, head_dim 16; random K/V/q, seed 31), attending after each append: every output finite,
/// the invariants held after each step. `what` names the case in failures.
inline void run_prefill_then_decode(TorchCache& m, const std::string& what) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(31);
  int64_t pos = 0;
  for (int64_t n : {30, 1, 1, 1, 1, 1, 1}) {
    for (int64_t l = 0; l < m.config().num_layers; ++l) {
      m.append(l, randn({1, 2, n, 16}, gen), randn({1, 2, n, 16}, gen), positions_range(pos, n));
      const at::Tensor out = m.attend(l, randn({1, 4, n, 16}, gen), positions_range(pos, n));
      EXPECT_TRUE(at::isfinite(out).all().item<bool>()) << what;
    }
    m.end_step(n > 1 ? StepKind::kPrefillEnd : StepKind::kDecode);
    m.check_invariants();
    pos += n;
  }
}

/// CacheManagerAccess::attend as a tensor: attention of `layer` without feeding the policy,
/// through the fused kernels (`fused`) or the generic path everywhere.
inline at::Tensor access_attend(const SequenceCache& m, int64_t layer, const at::Tensor& q, const at::Tensor& qp,
                                bool fused) {
  at::Tensor out = at::empty({1, m.config().num_q_heads, q.size(2), m.config().head_dim}, at::kFloat);
  cache::CacheManagerAccess::attend(m, layer, q, qp, fused, out);
  return out;
}
inline at::Tensor access_attend(const TorchCache& m, int64_t layer, const at::Tensor& q, const at::Tensor& qp,
                                bool fused) {
  return access_attend(m.core(), layer, q, qp, fused);
}

/// The message of the `E` (InvalidArgument unless said) `f` throws, or "no error" (other
/// exceptions propagate).
template <class E = InvalidArgument>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace kvcache::testing
