// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file kv_cache.h
/// KVCache: the interface the model runner drives in the forward pass, over at::Tensors
/// (kvcache::torch target). TorchCache (kvcache/torch/cache.h) implements it over a core
/// CacheManager or a MultiSequenceCache's Sequence; an engine may implement it to run its own
/// cache under the same runner (bench/ has a bare concatenating baseline).
///
/// Protocol per forward step (a prefill chunk or one decode token), for each layer l:
///   1. p = next_position(l); positions p .. p + T − 1 for the step's T tokens;
///   2. append(l, k_pre_rope, v, positions);
///   3. out = attend(l, q, positions)   — attention of the step's queries over what layer l
///      holds, including the tokens just appended;
/// then once per step end_step(kind). reset(context_length) starts a new request;
/// begin_request(prompt, context_length) starts one whose prompt the cache may already hold a
/// prefix of (prefix caching: kvcache/multi_sequence_cache.h).

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "kvcache/cache_config.h"
#include "kvcache/error.h"
#include "kvcache/eviction_inputs.h"
#include "kvcache/sequence_cache.h"
#include "kvcache/types.h"

namespace kvcache {

class KVCache {
 public:
  virtual ~KVCache() = default;

  /// Layer/head/head_dim counts and the RoPE hook (the runner checks they fit the model).
  virtual const CacheConfig& config() const = 0;
  /// Starts a new request of `context_length` tokens (prompt + max new tokens).
  virtual void reset(int64_t context_length) = 0;
  /// Starts a new request whose prompt is `prompt` (token ids) and which holds at most
  /// `context_length` tokens. A cache that shares prefixes between requests may already hold
  /// a prefix of the prompt; the caller then appends only prompt[cached_tokens:], in order, and
  /// its first step carries at least min_first_step tokens. Default: reset(context_length),
  /// nothing cached. @throws as reset().
  virtual PrefixReuse begin_request(const std::vector<int64_t>& prompt, int64_t context_length) {
    (void)prompt;
    reset(context_length);
    return {};
  }
  /// Position to give the next token appended to `layer`.
  virtual int64_t next_position(int64_t layer) const = 0;
  /// Appends new tokens to `layer`: k `[B, H_kv, T_new, D]` PRE-RoPE keys, v values (float),
  /// positions int64 `[T_new]`.
  virtual void append(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) = 0;
  /// Attention of q `[B, H_q, T_q, D]` (post-RoPE) at positions int64 `[T_q]` over `layer`'s
  /// cached tokens → `[B, H_q, T_q, D]` float32 (semantics: kvcache/attention.h).
  virtual at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions) = 0;
  /// Ends a forward step of kind `step`.
  virtual void end_step(StepKind step) = 0;
  /// Ends the current request where it stands (possibly mid-step) and gives back what it holds
  /// in a shared pool; the next request starts with reset()/begin_request(). The runner calls it
  /// on a sequence that leaves a batch on PoolFullError (Runner::generate_batch). Default:
  /// nothing (a cache that owns its storage keeps it for the next request). Never throws.
  virtual void finish() {}

  /// The context replay the cache's eviction policy needs now (EvictionPolicy::replay_need();
  /// KVzip). Default: none.
  virtual ReplayNeed replay_need() const { return {}; }
  /// Starts a replay step: the step's appends are held aside (attend() sees them, causally,
  /// after every resident token) and dropped at its end_step(kReplay / kReplayEnd); nothing is
  /// stored and next_position() does not advance (CacheManager::begin_replay()).
  /// @throws UnsupportedError by default (a cache that runs no replay reports no replay_need()).
  virtual void begin_replay() {
    throw UnsupportedError("this KVCache does not run context-replay steps (its replay_need() is none)");
  }
  /// The core cache behind this KVCache, if any (TorchCache: its CacheManager or Sequence).
  /// The runner's batched decode attends the core caches of a step together, one
  /// kvcache::attend_batch call per layer (kvcache/sequence_cache.h: spread over the threads,
  /// and shared-prefix "cascade" attention for Sequences that share prefix blocks), instead of
  /// calling attend() on each. Default: nullptr (attend() is called per sequence).
  virtual SequenceCache* core_cache() { return nullptr; }
};

}  // namespace kvcache
