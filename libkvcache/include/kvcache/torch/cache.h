// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/cache.h
/// TorchCache: a core SequenceCache (a CacheManager, or a Sequence of a MultiSequenceCache)
/// driven through at::Tensors (kvcache::torch target) — the runner's KVCache interface
/// (kvcache/kv_cache.h) and the verbs CacheManager had before the core left LibTorch, with
/// today's signatures: append(layer, k, v, positions), attend(layer, q, q_positions) returning
/// `[1, H_q, T_q, D]` float32, observe_attention, observe_queries, get(), check_invariants().
/// Every call is the core's (kvcache/sequence_cache.h: the same checks, messages and
/// all-or-nothing promises); the adapter only converts tensors to views and allocates outputs.

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "kvcache/cache_manager.h"
#include "kvcache/kv_cache.h"
#include "kvcache/multi_sequence_cache.h"
#include "kvcache/torch/rope.h"
#include "kvcache/torch/tensor_view.h"

namespace kvcache {

/// What TorchCache::get(layer) materialises (tests and debugging).
struct TensorLayerKV {
  at::Tensor k;          ///< `[1, H_kv, T_res, D]` float32, post-RoPE, as stored (dequantized)
  at::Tensor v;          ///< `[1, H_kv, T_res, D]` float32
  at::Tensor positions;  ///< `[H_kv, T_res]` int64: the position each key carries
};

class TorchCache final : public KVCache {
 public:
  /// Owns a new CacheManager of `config`. @throws as CacheManager's constructor.
  explicit TorchCache(CacheConfig config);
  /// Drives `cache` (not owned: it must outlive the adapter).
  explicit TorchCache(CacheManager& cache);
  /// Drives `seq` (not owned), its begin_request() and finish() included.
  explicit TorchCache(Sequence& seq);
  /// Drives any core cache (not owned) by its SequenceCache verbs: begin_request() resets it,
  /// finish() does nothing (pass a Sequence as one to get its request verbs).
  explicit TorchCache(SequenceCache& cache);
  TorchCache(TorchCache&&) noexcept;
  TorchCache& operator=(TorchCache&&) noexcept;
  ~TorchCache() override;

  /// The core cache behind the adapter.
  SequenceCache& core() { return *cache_; }
  const SequenceCache& core() const { return *cache_; }

  // ---- KVCache (the runner's interface) -------------------------------------------------
  const CacheConfig& config() const override;
  void reset(int64_t context_length) override;
  /// A Sequence's begin_request(); a CacheManager's reset(context_length), nothing cached.
  PrefixReuse begin_request(const std::vector<int64_t>& prompt, int64_t context_length) override;
  int64_t next_position(int64_t layer) const override;
  /// SequenceCache::append over tensors (CPU; k, v `[1, H_kv, T_new, D]`, positions int64).
  void append(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) override;
  /// SequenceCache::attend into a new `[1, H_q, T_q, D]` float32 tensor.
  at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions) override;
  void end_step(StepKind step) override;
  /// A Sequence's finish(); nothing for a CacheManager.
  void finish() override;
  ReplayNeed replay_need() const override;
  void begin_replay() override;
  /// The core cache (core()): the runner's batched decode attends it through attend_batch.
  SequenceCache* core_cache() override { return cache_; }

  // ---- the rest of the verbs the at::Tensor API had -------------------------------------
  const EvictionPolicy& policy() const;
  /// ExternalAttention::observe_attention (kvcache/external_attention.h).
  void observe_attention(int64_t layer, const at::Tensor& probs);
  /// ExternalAttention::observe_queries.
  void observe_queries(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions);
  LayerTokens tokens(int64_t layer) const;
  CacheStats stats() const;
  /// CacheDebug::get as tensors (copies).
  TensorLayerKV get(int64_t layer) const;
  /// CacheDebug::check_invariants.
  void check_invariants() const;

 private:
  std::unique_ptr<CacheManager> owned_;
  SequenceCache* cache_ = nullptr;
  Sequence* seq_ = nullptr;
};

}  // namespace kvcache
