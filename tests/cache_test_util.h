// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared fixtures of the CacheManager tests: a small RoPE hook, configs, random KV and
// attention.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <string>
#include <vector>

#include "kvcache/cache_manager.h"

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
  c.quant = quant;
  c.policy = policy;
  c.context_length = context;
  c.rope = test_rope;
  return c;
}

inline at::Tensor randn(std::vector<int64_t> shape, at::Generator& gen) {
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat));
}

/// Softmax attention of random logits: [B, H_q, T_q, T] (rows sum to 1).
inline at::Tensor random_probs(int64_t b, int64_t hq, int64_t tq, int64_t t, at::Generator& gen) {
  return at::softmax(randn({b, hq, tq, t}, gen) * 2.0, -1);
}

/// The step kind a test's prefill-end flag stands for.
inline StepKind step_kind(bool prefill_end) { return prefill_end ? StepKind::kPrefillEnd : StepKind::kDecode; }

/// Tokens of the largest head of `layer` (the layer's physical length).
inline int64_t physical_length(const CacheManager& m, int64_t layer) { return m.tokens(layer).max_resident(); }

inline at::Tensor positions_range(int64_t start, int64_t n) {
  return at::arange(start, start + n, at::kLong);
}

}  // namespace kvcache::testing
