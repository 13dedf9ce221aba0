// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cache_manager.h
/// CacheManager: the KV cache of one sequence that sits inside an engine's forward pass. It
/// quantizes on write, applies an eviction policy under a token budget during prefill and
/// decode, and holds only what it reports: tokens live in fixed-size blocks of their stored
/// form (packed codes, scales/zeros, or the full-precision residual) and attention reads
/// those blocks directly — there is no float32 copy of K or V (docs/cache-manager.md).
///
/// Its verbs are SequenceCache's (kvcache/sequence_cache.h), over views — ten in all:
/// config, policy, reset, append, attend, end_step, begin_replay, next_position, tokens, stats.
/// Protocol per forward step, for each layer l:
///   1. `append(l, k_pre_rope, v, positions)` — new tokens (keys are PRE-RoPE; the manager
///      rotates them through `CacheConfig::rope` when storing post-RoPE keys);
///   2. `attend(l, q, positions, out)` — attention over everything layer l holds, including the
///      tokens just appended; when the policy consumes attention (h2o, tova, snapkv, pyramid),
///      attend() also hands it the step's attention mass, and when it consumes query rows
///      (expected, duo), the step's queries (kvcache/eviction_inputs.h);
/// then once per step `end_step(kind)`, which runs the eviction plan on every layer.
/// An engine with its own attention kernel hands the policy what it needs through
/// ExternalAttention (kvcache/external_attention.h) instead of attend(). Tests and debugging
/// read the stored K/V and check invariants through CacheDebug (kvcache/cache_debug.h).
/// Policies that read keys or values (knorm, keydiff, expected, duo) get a read-only view of
/// the layer's blocks in end_step(), decoded on demand: no copy of the cache is kept for them.
///
/// Storage per layer, stream (K, V) and KV head: quantized blocks followed by full-precision
/// residual blocks, oldest first; heads may hold different numbers of tokens. Eviction
/// leaves holes that attention skips and frees a block as soon as it is empty.
/// The at::Tensor face with today's signatures (append/attend on tensors, get(), the runner's
/// KVCache interface) is TorchCache, kvcache/torch/cache.h.
///
/// Threads: one CacheManager (with its policy) is driven by one thread at a time; it is not
/// thread-safe. Separate CacheManagers share no mutable state, so an engine may drive
/// different managers from different threads at the same time, and each computes bit for bit
/// what it computes driven alone (test CacheThreads.TwoThreadsTwoCachesAreBitEqualToOneThread);
/// the same holds for separate MultiSequenceCaches. What they do share is process-wide and set
/// up front: the attention kernels (set_attention_kernels(), kvcache/attention.h), the OpenMP
/// threads (LibTorch's intra-op threads in a process with LibTorch), the library's logger
/// (kvcache/log.h; thread-safe), the kvquant calibration files read (a mutex-guarded cache),
/// and the CacheConfig::rope hook when several configs hold the same one — it is then called
/// from several threads at once and must allow that (rotate_half_rope()'s and
/// CausalLM::cache_config()'s do).

#include "kvcache/cache_config.h"
#include "kvcache/sequence_cache.h"

namespace kvcache {

class CacheManager final : public SequenceCache {
 public:
  /// @throws InvalidArgument if `config.validate()` fails or a spec does not parse.
  explicit CacheManager(CacheConfig config);
  ~CacheManager() override;
  CacheManager(CacheManager&&) noexcept;
  CacheManager& operator=(CacheManager&&) noexcept;
};

}  // namespace kvcache
