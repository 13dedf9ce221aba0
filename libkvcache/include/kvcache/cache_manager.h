// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cache_manager.h
/// CacheManager: the KV cache that sits inside the forward pass. It quantizes on write,
/// applies an eviction policy under a token budget during prefill and decode, and holds
/// only what it reports: tokens live in fixed-size blocks of their stored form (packed
/// codes, scales/zeros, or the full-precision residual) and attention reads those blocks
/// directly — there is no float32 copy of K or V (docs/cache-manager.md).
///
/// Protocol per forward step (kvcache/kv_cache.h), for each layer l:
///   1. `append(l, k_pre_rope, v, positions)` — new tokens (keys are PRE-RoPE; the manager
///      rotates them through `CacheConfig::rope` when storing post-RoPE keys);
///   2. `attend(l, q, positions)` — attention over everything layer l holds, including the
///      tokens just appended; when the policy consumes attention (h2o, tova, snapkv,
///      pyramid), attend() also hands it the step's attention mass, and when it consumes query
///      rows (expected, duo), the step's queries (kvcache/layer_view.h);
/// then once per step `end_step(kind)`, which runs the eviction plan on every layer.
/// An engine with its own attention kernel calls `observe_attention(l, probs)` instead of
/// attend() when the policy needs attention (policy().needs_attention()), and
/// `observe_queries(l, q, positions)` when it needs query rows (policy().query_need()).
/// Policies that read keys or values (knorm, keydiff, expected, duo) get a read-only view of
/// the layer's blocks in end_step(), decoded on demand: no copy of the cache is kept for them.
///
/// Storage per layer, stream (K, V) and KV head: quantized blocks followed by full-precision
/// residual blocks, oldest first; heads may hold different numbers of tokens. Eviction
/// leaves holes that attention skips and frees a block as soon as it is empty.
///
/// Threads: one CacheManager (with its policy) is driven by one thread at a time; it is not
/// thread-safe. Separate CacheManagers share no mutable state, so an engine may drive
/// different managers from different threads at the same time, and each computes bit for bit
/// what it computes driven alone (test CacheThreads.TwoThreadsTwoCachesAreBitEqualToOneThread);
/// the same holds for separate MultiSequenceCaches. What they do share is process-wide and set
/// up front: the attention kernels (chosen once, KVCACHE_FUSED_ISA read at the first attend()),
/// LibTorch's intra-op threads (at::set_num_threads), the library's logger (kvcache/log.h;
/// thread-safe), the kvquant calibration files read (a mutex-guarded cache), and the
/// CacheConfig::rope hook when several configs hold the same one — it is then called from
/// several threads at once and must allow that (CausalLM::cache_config()'s does).

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/attention.h"
#include "kvcache/cache_config.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/kv_cache.h"
#include "kvcache/types.h"

namespace kvcache {

namespace cache {
struct CacheManagerAccess;  // test/debug introspection (src/cache/cache_manager_access.h)
struct SequenceSeam;        // a sequence of a MultiSequenceCache (src/cache/sequence_seam.h)
class PoolSet;
class StepHooks;
}  // namespace cache

/// What `get(layer)` materialises (debugging and tests).
struct LayerKV {
  at::Tensor k;          ///< `[1, H_kv, T_res, D]` float32, post-RoPE, as stored (dequantized)
  at::Tensor v;          ///< `[1, H_kv, T_res, D]` float32
  at::Tensor positions;  ///< `[H_kv, T_res]` int64: the position each key carries
};

/// The tokens one layer holds (`tokens(layer)`).
struct LayerTokens {
  int64_t written = 0;        ///< tokens ever appended to the layer (its logical length)
  int64_t next_position = 0;  ///< == next_position(layer)
  /// Per KV head: the positions of its resident tokens, oldest first (size = T_h).
  std::vector<std::vector<int64_t>> positions;
  CacheStats stats;           ///< this layer's counters

  /// Resident tokens of head h.
  int64_t resident(int64_t h) const { return static_cast<int64_t>(positions.at(static_cast<size_t>(h)).size()); }
  /// Resident tokens of the largest head (the layer's physical length).
  int64_t max_resident() const;
};

class CacheManager final : public KVCache {
 public:
  /// @throws InvalidArgument if `config.validate()` fails or a spec does not parse.
  explicit CacheManager(CacheConfig config);
  ~CacheManager() override;
  CacheManager(CacheManager&&) noexcept;
  CacheManager& operator=(CacheManager&&) noexcept;

  const CacheConfig& config() const override;
  /// The eviction policy (budget, spec, attention_need()).
  const EvictionPolicy& policy() const;

  /// Clears every layer, counter (incl. peaks) and block for a new request of
  /// `context_length` tokens (prompt + max new tokens; resolves "@P%" budgets).
  /// All-or-nothing: a rejected call changes nothing.
  /// @throws InvalidArgument if context_length < 0; CapacityError if the policy's budget
  ///         does not fit this context (e.g. `sink@1%` of 100 tokens keeps no window).
  void reset(int64_t context_length) override;

  /// Appends new tokens to layer `layer`. All-or-nothing: a rejected call changes nothing.
  /// @param k  `[1, H_kv, T_new, D]` float32/float16/bfloat16 PRE-RoPE keys, finite
  /// @param v  `[1, H_kv, T_new, D]` values, same dtype rules
  /// @param positions int64 `[T_new]`: increasing, after the layer's last position, below
  ///        2^63 − 1 (in kRerotate mode exactly next_position(layer) + i)
  /// @throws InvalidArgument on a wrong shape/dtype/layer, NaN/Inf (naming the index), bad
  ///         positions (the message names expected vs got), keys whose RoPE leaves float32
  ///         (`rope(k) contains +Inf`, in both key storages), or an append after attend(),
  ///         observe_attention() or observe_queries() ran on the layer in this step — for every
  ///         policy, whether or not it reads attention (append, then attend, then end_step).
  void append(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) override;

  /// Attention of `q` `[1, H_q, T_q, D]` (post-RoPE, float) at `q_positions` int64 `[T_q]`
  /// over the tokens `layer` holds, read from their stored blocks (kvcache/attention.h) →
  /// `[1, H_q, T_q, D]` float32. Records the attention mass the policy needs for this step
  /// (at most once per layer and step).
  /// A query position that sees no key (all keys later) gets a zero row.
  /// @throws InvalidArgument on a wrong shape/dtype/layer, NaN/Inf in q, or a second
  ///         attention observation of the layer in one step while the policy needs attention.
  at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions) override;

  /// For an engine that computes attention itself: hands the policy the step's
  /// probabilities `[1, H_q, T_q, T_res]` over `layer`'s resident keys (every KV head must
  /// hold T_res tokens). Needed only when policy().needs_attention().
  /// All-or-nothing, and checked whether or not the policy needs attention.
  /// @throws InvalidArgument on a shape that does not match, a value that is not a
  ///         probability (NaN, Inf, < 0, > 1) or a row whose mass exceeds 1 (naming the
  ///         index), or a second observation of the layer in one step.
  void observe_attention(int64_t layer, const at::Tensor& probs);

  /// For an engine that computes attention itself: hands the policy the step's post-RoPE
  /// queries `q` `[1, H_q, T_q, D]` at int64 `q_positions` `[T_q]` (what attend() would have
  /// received). Needed only when policy().query_need().any(); a no-op otherwise.
  /// @throws InvalidArgument on a wrong shape/dtype, NaN/Inf, a query position outside the
  ///         RoPE table (pre-RoPE rows), or a second observation of the layer's queries in one step.
  void observe_queries(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions);

  /// Ends a forward step: asks the policy for a plan on every layer and evicts. All-or-
  /// nothing: every layer's plan is made (EvictionPolicy::plan() is const) and validated
  /// before any token is evicted or the policy advances.
  /// @throws InvalidArgument if layers appended different token counts in this step, or a
  ///         policy lacks the attention it needs; CapacityError if a budget cannot hold the
  ///         policy's protected tokens.
  void end_step(StepKind step) override;

  /// The context replay the policy needs (EvictionPolicy::replay_need(); KVzip).
  ReplayNeed replay_need() const override;

  /// Starts a replay step (KVzip's context replay, docs/cache-manager.md "Replay steps"): until
  /// end_step(kReplay or kReplayEnd), each layer's append() holds its tokens aside instead of
  /// storing them — positions must continue the context exactly (next_position(layer) + i,
  /// which does not advance) — and attend() computes, per KV head, the plain softmax attention
  /// of the step's queries over the resident keys (decoded from their blocks) and the step's own
  /// keys (causal), handing the policy the probabilities over the resident keys reduced as
  /// replay_need().attention says (KVzip: max over the GQA group and the rows). end_step drops
  /// the replay's tokens (bytes, counters, positions and peaks are as before the step) and, when
  /// the policy asked for the replay, plans as any step (KVzip compresses at kReplayEnd; a
  /// policy that asked for none is neither planned nor told of the step). Cost: O(H_q · T_new · (T_res + T_new) · D)
  /// per layer, with a `[G, T_new, T_res + T_new]` float32 probability tensor per KV head.
  /// @throws InvalidArgument inside a step (after an append or attention observation), or when a
  ///         replay step is already open.
  void begin_replay() override;

  /// Position to give the next appended token of `layer`: the last written position + 1,
  /// or the physical length (the longest KV head's count) in PositionMode::kRerotate, where
  /// every head's tokens are numbered contiguously up to it. O(1).
  int64_t next_position(int64_t layer) const override;

  /// The tokens `layer` holds: per-head positions, logical length, counters. O(T).
  LayerTokens tokens(int64_t layer) const;

  /// Totals over all layers (token counts summed over layers; peaks are peaks of the totals).
  CacheStats stats() const;

  /// Everything `layer` holds, dequantized to float32 and post-RoPE, oldest first: an
  /// explicit O(T·D) materialisation for tests and debugging (attend() never makes one).
  /// @throws UnsupportedError if its KV heads hold different numbers of tokens.
  LayerKV get(int64_t layer) const;

  /// Verifies internal invariants (block lists, positions, residual rules, byte counters ==
  /// recounts from the blocks, pool blocks in use == blocks held, peaks ≥ current). O(T):
  /// for tests and debugging. @throws InternalError describing the first violation.
  void check_invariants() const;

 private:
  friend struct cache::CacheManagerAccess;
  friend struct cache::SequenceSeam;
  /// A manager whose blocks come from `pools`, shared with other holders, calling `hooks`
  /// (may be null) before it allocates (MultiSequenceCache).
  CacheManager(CacheConfig config, std::shared_ptr<cache::PoolSet> pools, cache::StepHooks* hooks);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcache
