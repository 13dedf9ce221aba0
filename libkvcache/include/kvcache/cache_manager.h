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
/// config, policy, reset, append, attend, end_step, begin_replay, next_position, tokens, stats —
/// and save/load of a snapshot (kvcache/snapshot.h).
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
/// up front: the attention kernels and their query arithmetic (set_attention_kernels(),
/// set_attention_query(), kvcache/attention.h), the OpenMP threads (LibTorch's intra-op threads
/// in a process with LibTorch; attend() splits a long head's keys across them when a layer has
/// fewer KV heads than threads, so its float32 rounding depends on their number, never on the
/// run: docs/cache-manager.md, "Threads"), the library's logger
/// (kvcache/log.h; thread-safe), the kvquant calibration files read (a mutex-guarded cache),
/// and the CacheConfig::rope hook when several configs hold the same one — it is then called
/// from several threads at once and must allow that (rotate_half_rope()'s and
/// CausalLM::cache_config()'s do).

#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/cache_config.h"
#include "kvcache/sequence_cache.h"
#include "kvcache/snapshot.h"

namespace kvcache {

class CacheManager final : public SequenceCache {
 public:
  /// @throws InvalidArgument if `config.validate()` fails or a spec does not parse.
  explicit CacheManager(CacheConfig config);
  ~CacheManager() override;
  CacheManager(CacheManager&&) noexcept;
  CacheManager& operator=(CacheManager&&) noexcept;

  // ---- snapshots (kvcache/snapshot.h, docs/snapshot-format.md) ---------------------------
  /// Writes the sequence to `path` as a snapshot: every layer's blocks as stored (packed codes,
  /// fp16/fp32 scales and zeros, full-precision residual rows, per-slot positions and eviction
  /// holes), the counters, and the eviction policy's state, under a header naming the format
  /// version, the library version, the canonical scheme and policy specs, block_tokens, the
  /// shape [layers, H_q, H_kv, D] and `model_fingerprint` (any bytes the caller chooses to name
  /// the model: CausalLM::fingerprint() hashes config and weights, kvcache/model/causal_lm.h).
  /// Size: stats().bytes_reserved less the unfilled tails of blocks (only filled slots are
  /// written), plus 4 bytes per block (more with holes or explicit positions) and the header. Atomic: a temporary file in the same directory,
  /// fsync, rename over `path`, fsync of the directory; a save that fails (or a process killed
  /// during one) leaves the file that was at `path` as it was and no temporary file behind.
  /// Between steps only (after end_step).
  /// @throws InvalidArgument inside a step; SnapshotError (kIo) naming the path and the OS
  ///         error when the file cannot be written (read-only directory, full disk, no such
  ///         directory).
  /// `tokens`: the token ids the sequence holds, when the caller wants them back from load() (a
  /// runner checks that a new prompt starts with them); stored as given (int64), not checked.
  void save(const std::string& path, const std::string& model_fingerprint,
            const std::vector<int64_t>& tokens = {}) const;
  /// The same bytes written to `out` (no atomicity: the stream's own).
  /// @throws as save(path); SnapshotError (kIo) when the stream fails.
  void save(std::ostream& out, const std::string& model_fingerprint, const std::vector<int64_t>& tokens = {}) const;
  /// Replaces the sequence by the snapshot at `path`, written by a cache of this configuration
  /// (canonical scheme and policy, block_tokens, shape, residual_length, key storage, position
  /// mode) for the model `model_fingerprint` names; context_length becomes the saved request's.
  /// Everything is checked before anything changes: on any error the cache is as it was. The
  /// restored sequence continues exactly as the saved one would have (attend() outputs and
  /// evictions bit for bit: test Snapshot.RoundTripContinuesBitForBit).
  /// @throws SnapshotError whose reason() says which check failed: kNotSnapshot, kTruncated,
  ///         kChecksum (a flipped byte), kFutureVersion, kOtherModel, kOtherConfig (naming the
  ///         field, the file's value and the cache's), kInconsistent, kIo (cannot read `path`).
  /// @return the token ids given to save() (empty if none).
  std::vector<int64_t> load(const std::string& path, const std::string& model_fingerprint);
  /// The same, reading `in` to its end. @throws as load(path).
  std::vector<int64_t> load(std::istream& in, const std::string& model_fingerprint);

 private:
  explicit CacheManager(std::unique_ptr<cache::StepProtocol> steps);
};

}  // namespace kvcache
