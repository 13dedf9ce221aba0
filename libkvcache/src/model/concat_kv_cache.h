// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file concat_kv_cache.h (private)
/// ConcatKVCache: the bare baseline a serving loop would write by hand — post-RoPE keys and
/// values concatenated per layer, no quantization, no eviction, no accounting. It has the
/// verbs runner_core.h needs, so the same forward code runs with it and with CacheManager;
/// bench/bench_model.cpp uses it to measure the CacheManager's overhead.

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kvcache/cache_manager.h"
#include "kvcache/error.h"

namespace kvcache::detail {

class ConcatKVCache {
 public:
  /// Uses num_layers and rope of `config` (quant/policy are ignored).
  explicit ConcatKVCache(CacheConfig config)
      : config_(std::move(config)), layers_(static_cast<size_t>(config_.num_layers)) {
    KV_CHECK_ARG(config_.rope != nullptr, "ConcatKVCache: CacheConfig::rope must be set");
  }

  const CacheConfig& config() const { return config_; }
  void reset(int64_t /*context_length*/) {
    for (auto& l : layers_) l = Layer{};
  }
  int64_t next_position(int64_t layer) const {
    return layers_.at(static_cast<size_t>(layer)).length;
  }
  void append(int64_t layer, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& positions) {
    Layer& s = layers_.at(static_cast<size_t>(layer));
    const at::Tensor kr = config_.rope(k, positions);
    const at::Tensor p = positions.view({1, -1}).expand({k.size(1), positions.numel()});
    if (s.length == 0) {
      s.k = kr.contiguous();
      s.v = v.contiguous();
      s.pos = p.contiguous();
    } else {
      s.k = at::cat({s.k, kr}, 2);
      s.v = at::cat({s.v, v}, 2);
      s.pos = at::cat({s.pos, p}, 1);
    }
    s.length += k.size(2);
  }
  LayerKV get(int64_t layer) const {
    const Layer& s = layers_.at(static_cast<size_t>(layer));
    return LayerKV{s.k, s.v, s.pos};
  }
  bool needs_attention() const { return false; }
  void observe_attention(int64_t /*layer*/, const at::Tensor& /*probs*/) {}
  void end_step(bool /*is_prefill_end*/ = false) {}

 private:
  struct Layer {
    at::Tensor k, v, pos;
    int64_t length = 0;
  };
  CacheConfig config_;
  std::vector<Layer> layers_;
};

}  // namespace kvcache::detail
