// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file concat_kv_cache.h (bench only)
/// ConcatKVCache: the bare baseline a serving loop would write by hand — post-RoPE keys and
/// values concatenated per layer in float32, no quantization, no eviction, no accounting,
/// attention by at:: matmuls (kvcache::reference_attention). This is "today's path" the
/// block cache is measured against: get() of a float32 copy + at:: attention.

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kvcache/error.h"
#include "kvcache/kv_cache.h"
#include "kvcache/torch/attention.h"
#include "kvcache/torch.h"

namespace kvcache::bench {

class ConcatKVCache final : public KVCache {
 public:
  /// Uses num_layers and rope of `config` (quant/policy are ignored).
  explicit ConcatKVCache(CacheConfig config) : config_(std::move(config)), layers_(static_cast<size_t>(config_.num_layers)) {
    KV_CHECK_ARG(config_.rope != nullptr, "ConcatKVCache: CacheConfig::rope must be set");
  }

  const CacheConfig& config() const override { return config_; }
  void reset(int64_t /*context_length*/) override {
    for (auto& l : layers_) l = Layer{};
  }
  int64_t next_position(int64_t layer) const override { return layers_.at(static_cast<size_t>(layer)).length; }
  void append(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) override {
    Layer& s = layers_.at(static_cast<size_t>(layer));
    // The cache's RoPE hook over a float32 copy of the keys, as the CacheManager applies it.
    at::Tensor kr = k.to(at::kFloat).contiguous().clone();
    const at::Tensor pos = positions.contiguous();
    config_.rope(kr.data_ptr<float>(), kr.size(1), kr.size(2), kr.size(3), pos.data_ptr<int64_t>());
    const at::Tensor p = positions.view({1, -1}).expand({k.size(1), positions.numel()});
    if (s.length == 0) {
      s.k = kr.contiguous();
      s.v = v.to(at::kFloat).contiguous();
      s.pos = p.contiguous();
    } else {
      s.k = at::cat({s.k, kr}, 2);
      s.v = at::cat({s.v, v.to(at::kFloat)}, 2);
      s.pos = at::cat({s.pos, p}, 1);
    }
    s.length += k.size(2);
  }
  at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions) override {
    const Layer& s = layers_.at(static_cast<size_t>(layer));
    return reference_attention(q, s.k, s.v, s.pos, q_positions);
  }
  void end_step(StepKind /*step*/) override {}

  /// The float32 K/V/positions of `layer` (what CacheManager::get() handed out before the core).
  const at::Tensor& keys(int64_t layer) const { return layers_.at(static_cast<size_t>(layer)).k; }

 private:
  struct Layer {
    at::Tensor k, v, pos;
    int64_t length = 0;
  };
  CacheConfig config_;
  std::vector<Layer> layers_;
};

}  // namespace kvcache::bench
