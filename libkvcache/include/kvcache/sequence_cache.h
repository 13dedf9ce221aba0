// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file sequence_cache.h
/// SequenceCache: the KV cache of one sequence as the core API drives it — the verbs a
/// CacheManager (kvcache/cache_manager.h) and a sequence of a MultiSequenceCache
/// (kvcache/multi_sequence_cache.h) share, over views (kvcache/view.h): no framework type.
/// An engine's forward step per layer l: `append(l, k_pre_rope, v, positions)`, then
/// `attend(l, q, positions, out)` (or attend_batch() over several sequences at once); then once
/// per step `end_step(kind)`. The at::Tensor face (today's signatures, the runner's KVCache
/// interface) is kvcache/torch/cache.h; the C API is kvcache/c_api.h; docs/engine-api.md.
///
/// Contract of every mutator: all-or-nothing — a rejected call (InvalidArgument, CapacityError)
/// changes nothing, the policy included (docs/errors.md). Not thread-safe: one thread drives a
/// sequence (attend_batch parallelises inside one call).

#include <cstdint>
#include <memory>
#include <vector>

#include "kvcache/buffer.h"
#include "kvcache/cache_config.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/types.h"
#include "kvcache/view.h"

namespace kvcache {

namespace cache {
class StepProtocol;          // src/cache/step_protocol.h
struct CacheManagerAccess;   // test/debug introspection (src/cache/cache_manager_access.h)
}  // namespace cache

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

/// What Sequence::begin_request() (kvcache/multi_sequence_cache.h) found: the prompt's first `cached_tokens` tokens are already in the
/// cache (their keys and values, at positions 0 .. cached_tokens − 1), so the caller ingests
/// only the rest, starting at next_position(layer) == cached_tokens.
struct PrefixReuse {
  int64_t cached_tokens = 0;  ///< prompt tokens the cache holds already (their prefill is skipped)
  /// The first step after them must append at least this many tokens (a scheme with a
  /// sliding full-precision residual of R tokens needs R, to hold exactly what computing the
  /// prefix would hold; 0: any step).
  int64_t min_first_step = 0;
};

/// What CacheDebug::get(layer) materialises (tests and debugging): float32 and int64 Buffers.
struct LayerKV {
  Buffer k;          ///< `[1, H_kv, T_res, D]` float32, post-RoPE, as stored (dequantized)
  Buffer v;          ///< `[1, H_kv, T_res, D]` float32
  Buffer positions;  ///< `[H_kv, T_res]` int64: the position each key carries
};

class SequenceCache {
 public:
  virtual ~SequenceCache();
  SequenceCache(const SequenceCache&) = delete;
  SequenceCache& operator=(const SequenceCache&) = delete;

  /// The configuration (geometry, scheme, policy, RoPE hook); context_length is the current
  /// request's.
  const CacheConfig& config() const;
  /// The eviction policy (budget, spec, attention_need(), replay_need()).
  const EvictionPolicy& policy() const;

  /// Clears every layer, counter (incl. peaks) and block for a new request of
  /// `context_length` tokens (prompt + max new tokens; resolves "@P%" budgets).
  /// @throws InvalidArgument if context_length < 0; CapacityError if the policy's budget
  ///         does not fit this context (e.g. `sink@1%` of 100 tokens keeps no window).
  virtual void reset(int64_t context_length);

  /// Appends new tokens to layer `layer`.
  /// @param k  `[1, H_kv, T_new, D]` float32/float16/bfloat16 PRE-RoPE keys (rotated through
  ///        CacheConfig::rope as they are stored), finite, any strides
  /// @param v  `[1, H_kv, T_new, D]` values, same dtype rules (k and v may differ in dtype)
  /// @param positions int64 `[T_new]`: increasing, after the layer's last position, below
  ///        2^63 − 1 (in kRerotate mode exactly next_position(layer) + i)
  /// @throws InvalidArgument on a wrong shape/dtype/layer, NaN/Inf (naming the index), bad
  ///         positions (the message names expected vs got), keys whose RoPE leaves float32
  ///         (`rope(k) contains +Inf`, in both key storages), or an append after attend() or
  ///         ExternalAttention ran on the layer in this step — for every policy, whether or not
  ///         it reads attention (append, then attend, then end_step);
  ///         CapacityError (PoolFullError) when a shared pool has no room.
  virtual void append(int64_t layer, const TensorView& k, const TensorView& v, const TensorView& positions);

  /// Attention of `q` `[1, H_q, T_q, D]` (post-RoPE, float32/float16/bfloat16) at `q_positions`
  /// int64 `[T_q]` over the tokens `layer` holds, read from their stored blocks
  /// (kvcache/attention.h), written to `out` `[1, H_q, T_q, D]` float32 (any strides; it may
  /// not overlap q). Hands the policy the step's attention mass / query rows it needs, once per
  /// layer and step: a second attend() of the layer in the same step computes the output and
  /// hands the policy nothing. A query position that sees no key gets a zero row.
  /// @throws InvalidArgument on a wrong shape/dtype/layer, NaN/Inf in q, or an `out` that does
  ///         not fit. Nothing is written to `out` then.
  virtual void attend(int64_t layer, const TensorView& q, const TensorView& q_positions, const MutableTensorView& out);

  /// Ends a forward step: asks the policy for a plan on every layer and evicts. All-or-
  /// nothing: every layer's plan is made (EvictionPolicy::plan() is const) and validated
  /// before any token is evicted or the policy advances.
  /// @throws InvalidArgument if layers appended different token counts in this step, or a
  ///         policy lacks the attention it needs; CapacityError if a budget cannot hold the
  ///         policy's protected tokens (or a shared pool has no room for a copy on write).
  virtual void end_step(StepKind step);

  /// Starts a replay step (KVzip's context replay, docs/cache-manager.md "Replay steps"): until
  /// end_step(kReplay or kReplayEnd), each layer's append() holds its tokens aside instead of
  /// storing them — positions must continue the context exactly (next_position(layer) + i,
  /// which does not advance) — and attend() reads them after the resident tokens through the
  /// same block path (causal by position), handing the policy the attention over the resident
  /// keys reduced as policy().replay_need().attention says. end_step drops the replay's tokens.
  /// @throws InvalidArgument inside a step (after an append or attention observation), or when
  ///         a replay step is already open; UnsupportedError for a sequence of a
  ///         MultiSequenceCache.
  virtual void begin_replay();

  /// Position to give the next appended token of `layer`: the last written position + 1,
  /// or the physical length (the longest KV head's count) in PositionMode::kRerotate, where
  /// every head's tokens are numbered contiguously up to it. O(1).
  /// @throws InvalidArgument on a layer out of range.
  virtual int64_t next_position(int64_t layer) const;

  /// The tokens `layer` holds: per-head positions, logical length, counters. O(T).
  LayerTokens tokens(int64_t layer) const;

  /// Totals over all layers (token counts summed over layers; peaks are peaks of the totals).
  CacheStats stats() const;

 protected:
  explicit SequenceCache(std::unique_ptr<cache::StepProtocol> steps);
  SequenceCache(SequenceCache&&) noexcept;
  SequenceCache& operator=(SequenceCache&&) noexcept;
  cache::StepProtocol& steps() { return *steps_; }
  const cache::StepProtocol& steps() const { return *steps_; }
  /// Replaces the steps (Sequence::load swaps in a restored sequence); returns the old ones.
  std::unique_ptr<cache::StepProtocol> replace_steps(std::unique_ptr<cache::StepProtocol> steps);

 private:
  friend class ExternalAttention;
  friend class CacheDebug;
  friend struct AttendBatch;
  friend struct cache::CacheManagerAccess;
  std::unique_ptr<cache::StepProtocol> steps_;
};

/// One sequence's part of attend_batch().
struct AttendRequest {
  SequenceCache* cache = nullptr;
  TensorView q;            ///< `[1, H_q, T_q, D]` (T_q may differ between requests)
  TensorView q_positions;  ///< int64 `[T_q]`
  MutableTensorView out;   ///< `[1, H_q, T_q, D]` float32
};

/// What an attend_batch() call did (AttendBatchOptions::stats).
struct AttendBatchStats {
  /// Shared-prefix passes: one (KV head, group of ≥ 2 sequences, run of shared tokens) read
  /// once for the stacked query rows of every sequence in the group.
  int64_t shared_passes = 0;
  /// Σ over the shared passes of their tokens (per KV head: 16 sequences sharing 16k tokens
  /// over 2 KV heads count 32k).
  int64_t shared_tokens = 0;
  /// Requests that took part in at least one shared pass.
  int64_t cascaded_requests = 0;
  /// Bytes of stored K and V blocks the call's walks read: every block a walk touches, counted
  /// whole, once per walk (a walk serves up to 64 query rows of one sequence's KV head, or up
  /// to 256 stacked rows of a pass). A model of the reads, not a hardware counter: it does not
  /// tell cache hits from memory, and leaves out the second walk of a policy's mass.
  int64_t bytes_read = 0;

  /// Adds `other`'s counts (totals over several calls, e.g. GenerationOptions::attention_stats).
  AttendBatchStats& operator+=(const AttendBatchStats& other) {
    shared_passes += other.shared_passes;
    shared_tokens += other.shared_tokens;
    cascaded_requests += other.cascaded_requests;
    bytes_read += other.bytes_read;
    return *this;
  }
};

/// How attend_batch() runs.
struct AttendBatchOptions {
  /// Shared-prefix (cascade) attention where requests share prefix blocks (see attend_batch).
  /// false: every request is attended alone, bit for bit as its attend() call.
  bool cascade = true;
  /// Filled when not null (reset first).
  AttendBatchStats* stats = nullptr;
};

/// Attention of several sequences' queries in one call (an engine's batched decode step: one
/// call per layer): each request is what `request.cache->attend(layer, q, q_positions, out)`
/// computes and hands its policy — the same outputs, masses and query rows — with the
/// (sequence, KV head) work spread over the threads together instead of one sequence at a
/// time. Sequences may hold different numbers of tokens (ragged) and differ in scheme and
/// policy; their geometry may differ too. All-or-nothing: every request is checked before any
/// is attended or any policy fed.
///
/// Shared-prefix (cascade) attention, for the sequences of one MultiSequenceCache that reuse a
/// cached prefix (the idea of FlashInfer's cascade attention, "Cascade Inference: Memory
/// Bandwidth Efficient Shared Prefix Batch Decoding", flashinfer.ai, 2024, and of Hydragen:
/// Juravsky et al., arXiv 2402.05099): per KV head, requests whose streams begin
/// with the same blocks (the same pool block, live slots and positions in the K and in the V
/// stream) are grouped by the longest such run (a tree: a group's common run is read once,
/// then it splits by what its members share beyond it, level by level); each run is attended
/// once with the stacked query rows of every request in its group (B sequences × G query
/// heads × T_q rows against the shared keys), each request's own tokens alone, and the
/// partial states (running max, sum, unnormalised accumulator per row) are merged by
/// log-sum-exp. Every stored format: the fused kernels where a sequence's own attend() uses
/// them, the generic decode otherwise; holes, pre-RoPE keys, ragged lengths as attend().
/// When it applies: options.cascade, and a request whose policy takes no attention mass from
/// this call (AttentionNeed none: full, window, sink, ... — h2o, tova, snapkv in their
/// observation windows are not) and that is no replay step, sharing at least one block with
/// another such request at a KV head. Any query length works (decode, T_q = 1, is the
/// target); everything else — and every head that shares nothing — is attended alone, bit for
/// bit as attend().
/// Tolerance: a cascaded request's output differs from its attend() output only by float32
/// rounding (the keys are summed in another order and the merge rescales by exp(m − m')):
/// |Δ| ≤ 1e-5 · max|v| per element in the tests (tests/attend_cascade_test.cpp), for every
/// format, since both read the same stored bytes with the same kernels.
/// @throws InvalidArgument naming the request index: a null cache, a cache given twice, or
///         anything attend() rejects.
void attend_batch(int64_t layer, const std::vector<AttendRequest>& requests, const AttendBatchOptions& options = {});

}  // namespace kvcache
