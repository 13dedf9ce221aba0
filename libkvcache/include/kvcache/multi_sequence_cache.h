// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file multi_sequence_cache.h
/// MultiSequenceCache: many independent sequences over one block pool with a capacity in
/// bytes, and prefix caching between them (docs/cache-manager.md, "Many sequences, shared
/// prefixes").
///
/// Every sequence is a SequenceCache of its own (kvcache/sequence_cache.h), driven as a
/// CacheManager is — its own positions, eviction policy, residual and quantization groups (a per-channel group never spans two
/// sequences, so a sequence holds and computes the same alone or beside others) — whose blocks
/// come from the cache's shared pools. A prefix index, a radix tree over token ids at block
/// granularity (RadixAttention: Zheng et al., "SGLang: Efficient Execution of Structured
/// Language Model Programs", arXiv 2312.07104; methods.md b.8), maps a new request's prompt to the
/// longest cached prefix; the request takes over those blocks by reference count and its
/// caller skips their prefill (Runner::generate does, through the torch face's KVCache::begin_request()).
///
/// Why a radix tree rather than vLLM's chained block hashes (automatic prefix caching over
/// PagedAttention blocks: Kwon et al., "Efficient Memory Management for Large Language Model
/// Serving with PagedAttention", arXiv 2309.06180; b.7): a match compares the token
/// ids themselves, so two prompts can never share a block by a hash collision and nothing has
/// to be verified after a lookup; the tree's leaves are exactly what may be reclaimed (LRU,
/// leaves first); and a sequence pins its whole prefix with one lock on its deepest node.
///
/// Keys: one namespace (SGLang's extra_key) per storage key of a sequence's configuration —
/// the K and V quantizers, their residual windows and flush rules, key storage (pre/post-RoPE),
/// position mode and block size — everything that changes the stored bytes, so the same tokens
/// under int4 and fp16 never alias. Positions are the depth in the tree (a prompt starts at 0).
///
/// Sequences that hold the same prefix blocks attend them once together through attend_batch()
/// (kvcache/sequence_cache.h: shared-prefix, "cascade", attention).
///
/// Shared blocks are read-only. A sequence's eviction only marks holes in its own view of a
/// shared block; the one write into an existing block (a merge of survivors) copies a shared
/// block first (copy-on-write), as does converting a shared per-channel group's survivors.
/// So a sequence that reuses a prefix holds exactly the blocks — bytes, layout, positions —
/// it holds when it computes the prefix itself, and attend() returns the same bits.
///
/// Exactness conditions (a prefix is reused only where they hold; PrefixMatch::limited_by
/// says which one cut a match): whole blocks only; at least one prompt token is left to
/// compute (its logits start generation); a scheme that flushes its residual in blocks of R
/// tokens (KIVI keys, per-channel plain quantizers) reuses multiples of R; a sliding residual
/// of R tokens (KIVI values, `residual_length` R) leaves at least R prompt tokens and needs
/// a first step of at least R tokens (PrefixReuse::min_first_step); the policy must need no
/// attention during prefill (h2o, tova, snapkv, pyramid do; see allow_inexact_reuse) and plan
/// no eviction during the skipped prefix (its budget holds it); `fp8:*:scaled` streams (a
/// scale fixed by the request's own first write) are never shared.
///
/// When the pool is full: an append or an eviction that needs more bytes than are free is
/// planned first: if it would not fit even after reclaiming every unused cached prefix and
/// (kPreemptNewest) preempting every newer request, it is refused having changed nothing.
/// Otherwise it reclaims cached prefix blocks that no sequence uses (least recently used leaf
/// first, its tail first); if that is not enough, PoolFullRule decides. Nothing is dropped
/// silently.
/// Not thread-safe: one thread drives the cache and all its sequences. Separate
/// MultiSequenceCaches share no mutable state and may be driven from separate threads at once,
/// each computing what it computes alone (cache_manager.h, "Threads").

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/cache_config.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/sequence_cache.h"

namespace kvcache {

/// What a call that does not fit does, after the cache reclaimed what no sequence uses.
enum class PoolFullRule {
  /// The call throws PoolFullError (a CapacityError) and changes nothing; the caller ends a request
  /// (Sequence::finish) or waits, and retries.
  kRefuse,
  /// Preempt running requests that began after the caller's, newest first (vLLM's recompute
  /// preemption order: the latest arrival yields), until the call fits: each preempted
  /// sequence gives back its blocks, and every later call on it throws PoolFullError
  /// (preempted() true) saying so
  /// until it begins a new request. When the caller is the newest request, it is refused; so
  /// is a call that would not fit even after preempting every newer request — before any of
  /// them is preempted (a refused call changes nothing).
  kPreemptNewest,
};

/// Configuration of a MultiSequenceCache. validate() (the constructor calls it).
struct MultiSequenceConfig {
  /// Geometry (num_layers, num_q_heads, num_kv_heads, head_dim) and `rope` of every sequence
  /// (CausalLM::cache_config() gives them); its other fields are the configuration
  /// add_sequence() gives a sequence.
  CacheConfig model;
  /// Bytes of blocks the pool may hold, sequences and cached prefixes together, ≥ 1 (a block
  /// counts whole; host bookkeeping is not counted).
  int64_t capacity_bytes = 0;
  /// Keep the prompts' blocks in the prefix index and let new requests reuse them. false: every
  /// request computes its whole prompt (the baseline a study compares against).
  bool prefix_sharing = true;
  PoolFullRule when_full = PoolFullRule::kRefuse;
  /// Also reuse prefixes for sequences whose policy reads attention during prefill (h2o, tova,
  /// snapkv, pyramid). Their policy then never sees the skipped prefix's attention, so they do
  /// NOT compute what computing it alone computes (H2O starts the prefix's scores at 0). For
  /// studies of sharing × eviction; off by default.
  bool allow_inexact_reuse = false;
  /// A disk tier under the pool (off when empty): cached prefix pages that the pool reclaims
  /// (LRU, to make room) are written to files in this directory — created if missing, its
  /// parent must exist — instead of being dropped, and a later request whose prompt continues
  /// past its match in memory reads, verifies and adopts them instead of computing them
  /// (docs/cache-manager.md, "Disk tier"). The files are this cache's own (named after its
  /// process and instance) and removed when it is destroyed.
  std::string disk_tier_dir;
  /// Bytes the disk tier's files may take, ≥ 1 when disk_tier_dir is set (0 otherwise): the
  /// least recently written or read files are removed to stay within it.
  int64_t disk_tier_bytes = 0;

  /// @throws InvalidArgument naming the bad field (model validated as CacheConfig::validate).
  void validate() const;
};

/// How a request's prompt met the prefix index (Sequence::prefix()).
struct PrefixMatch {
  int64_t prompt_tokens = 0;   ///< tokens of the prompt given to begin_request()
  int64_t cached_tokens = 0;   ///< reused from the index: their prefill is skipped
  int64_t min_first_step = 0;  ///< the next step must append at least this many tokens
  int64_t indexed_tokens = 0;  ///< the longest prefix the index held (whole blocks, before the caps)
  /// Why cached_tokens < indexed_tokens (every rule that cut the match, in the order applied,
  /// "; "-separated), or why nothing is shared; "" if neither.
  std::string limited_by;
  /// Prompt tokens the request computes itself.
  int64_t computed_tokens() const { return prompt_tokens - cached_tokens; }
};

/// The prefix cache's counters, cumulative since construction. Token counters as vLLM's
/// prefix_cache_queries/hits and SGLang's cache_hit_rate expose them; block counters count
/// physical blocks (one layer, one KV head, one stream).
struct PrefixCounters {
  int64_t requests = 0;               ///< begin_request() calls that queried the index
  int64_t prompt_tokens_queried = 0;  ///< Σ prompt tokens of those requests
  int64_t prompt_tokens_hit = 0;      ///< Σ prompt tokens reused (PrefixMatch::cached_tokens)
  int64_t blocks_shared = 0;          ///< block references requests took over from the index
  int64_t blocks_published = 0;       ///< blocks the index took from requests' prompts
  int64_t blocks_copied = 0;          ///< copies on write: a write into a shared block copied it first
  int64_t blocks_reclaimed = 0;       ///< cached blocks freed to make room (or by reclaim())
  int64_t preemptions = 0;            ///< requests preempted (PoolFullRule::kPreemptNewest)
  int64_t refusals = 0;               ///< calls refused with CapacityError for want of room
  // By tier (prompt_tokens_hit = memory + disk; prompt_tokens_queried − prompt_tokens_hit were
  // computed, the misses). The disk_* counters stay 0 without a disk tier.
  int64_t prompt_tokens_hit_memory = 0;  ///< reused tokens whose pages were in the pool
  int64_t prompt_tokens_hit_disk = 0;    ///< reused tokens whose pages were read from the disk tier
  int64_t disk_pages_written = 0;        ///< reclaimed pages spilled to a file
  int64_t disk_bytes_written = 0;        ///< bytes of those files
  int64_t disk_pages_read = 0;           ///< spilled pages read back, verified and adopted
  int64_t disk_bytes_read = 0;           ///< bytes of those files
  int64_t disk_evictions = 0;            ///< files removed to stay within disk_tier_bytes
  /// Spilled pages that could not be written (a full or read-only disk) or read back (a file
  /// missing, truncated or corrupt): dropped, never an error of the request (a miss).
  int64_t disk_failures = 0;
  /// Wall time of the disk tier's reads: reading, verifying and adopting spilled pages, and
  /// the room they need (reclaims, which may spill other pages) — what a prefix hit from disk
  /// costs instead of recomputing its prefill — in seconds.
  double disk_read_seconds = 0;

  /// prompt_tokens_hit / prompt_tokens_queried (0 when nothing was queried).
  double hit_rate() const;
  /// The counts since `earlier` (take hit rates over a window from deltas, not the totals).
  PrefixCounters operator-(const PrefixCounters& earlier) const;
};

/// The pool now (MultiSequenceCache::stats()). O(blocks).
struct PoolStats {
  int64_t capacity_bytes = 0;
  int64_t bytes_in_use = 0;       ///< bytes of distinct blocks held by sequences or the index
  int64_t bytes_in_use_peak = 0;  ///< max of bytes_in_use, sampled after every call that changes it
  int64_t bytes_cached = 0;       ///< of which held by the index alone (reclaimable)
  int64_t running_sequences = 0;  ///< sequences holding at least one block
  int64_t cached_blocks = 0;      ///< blocks the index holds (shared with sequences or not)
  /// Σ over sequences of their resident tokens, and the tokens distinct blocks store (a
  /// shared block counts once, with the most live slots any holder sees), both as token-
  /// layers: slots of every (layer, KV head, stream) / (2 · H_kv).
  double logical_tokens = 0, unique_tokens = 0;
  /// logical_tokens / unique_tokens (1 without sharing; 0 when empty).
  double sharing_ratio = 0;
};

class MultiSequenceCache;

namespace cache {
struct MultiSequenceAccess;  // test/debug introspection (src/cache/multi_sequence_access.h)
}  // namespace cache

/// One sequence of a MultiSequenceCache: a SequenceCache (the verbs of a CacheManager, the
/// same checks and guarantees) whose blocks come from the cache's pool, plus the request
/// verbs of prefix caching. Made by MultiSequenceCache::add_sequence(); lives until
/// remove_sequence(). The runner drives it through kvcache/torch/cache.h's TorchCache.
class Sequence final : public SequenceCache {
 public:
  ~Sequence() override;

  /// Its id in the cache (0, 1, ... in order of add_sequence()).
  int64_t id() const;

  /// Starts a request for `prompt` (token ids; opaque to the cache) of at most
  /// `context_length` tokens: ends the sequence's previous request, then reuses the longest
  /// cached prefix the exactness conditions allow (kvcache/multi_sequence_cache.h). The
  /// caller then appends the K/V of prompt[cached_tokens:], in order, in steps, the first at
  /// least min_first_step tokens, then decodes. The prompt's whole blocks enter the index as
  /// they settle (at the start of each end_step). All-or-nothing.
  /// @throws InvalidArgument if context_length < 0 or < the prompt's length; CapacityError as
  ///         CacheManager::reset (a budget that does not fit the context).
  PrefixReuse begin_request(const std::vector<int64_t>& prompt, int64_t context_length);
  /// Starts a request without a prompt: nothing reused, nothing published (CacheManager::reset).
  void reset(int64_t context_length) override;
  /// Ends the request: its blocks go back to the pool (what it published stays cached).
  /// Valid at any point, mid-step or after preemption (clears preempted()). Never throws.
  void finish();
  /// True after preemption, until begin_request()/reset()/finish().
  bool preempted() const;
  /// The current request's prefix match (all zero without begin_request()).
  const PrefixMatch& prefix() const;
  /// Blocks this sequence copied on write (cumulative).
  int64_t blocks_copied() const;

  /// Writes this sequence as a snapshot, as CacheManager::save does (kvcache/cache_manager.h,
  /// docs/snapshot-format.md): its blocks as stored — the prefix blocks it shares with the index
  /// written out as its own — counters and policy state, atomically. The file loads into a
  /// CacheManager of this sequence's configuration, which then continues bit for bit as the
  /// sequence would (Snapshot.SequenceOfAMultiSequenceCacheLoadsIntoACacheManager); the index
  /// and the pool are not written. Between steps only.
  /// @throws InvalidArgument inside a step or for a preempted sequence (its blocks are gone);
  ///         SnapshotError (kIo) when the file cannot be written.
  void save(const std::string& path, const std::string& model_fingerprint,
            const std::vector<int64_t>& tokens = {}) const;
  /// The same bytes written to `out`. @throws as save(path); SnapshotError (kIo) when the stream fails.
  void save(std::ostream& out, const std::string& model_fingerprint, const std::vector<int64_t>& tokens = {}) const;

  /// Reads a snapshot (CacheManager::save or Sequence::save, docs/snapshot-format.md) into this
  /// sequence, which then continues bit for bit as the saved cache would: its blocks as stored,
  /// counters and policy state, in new blocks from the cache's pool. The file must match this
  /// sequence's configuration (scheme, policy, block_tokens, shape, residual, key storage,
  /// position mode; its context length replaces the sequence's) and `model_fingerprint`.
  /// Every check runs before anything changes. Then the sequence's current request ends (its
  /// blocks go back to the pool, as finish()), unused cached prefixes are reclaimed if the
  /// snapshot needs their room (LRU, as make_room), and the loaded request begins: the newest
  /// request (no other is preempted for it), with no prompt — it reuses nothing from the index
  /// and publishes nothing to it. Valid at any point, as finish(); clears preempted().
  /// @return the token ids saved with the snapshot (empty if none were given).
  /// @throws SnapshotError naming the failed check (kvcache/snapshot.h; kIo when the file cannot
  ///         be read); PoolFullError (preempted() false) when the snapshot's blocks do not fit
  ///         even after this sequence's request ended and every unused cached prefix were
  ///         reclaimed. Both change nothing: the sequence, the pool and the index are as before.
  std::vector<int64_t> load(const std::string& path, const std::string& model_fingerprint);
  /// The same from a stream (read to its end). @throws as load(path).
  std::vector<int64_t> load(std::istream& in, const std::string& model_fingerprint);

  /// As SequenceCache (the same checks and guarantees), plus: PoolFullError (a CapacityError)
  /// when the pool has no room (PoolFullRule; preempted() false, the call changed nothing) or
  /// this sequence was preempted (preempted() true); InvalidArgument when the first step after
  /// a reused prefix appends fewer than min_first_step tokens. begin_replay() throws
  /// UnsupportedError (a sequence runs no context replay; add_sequence refuses KVzip).
  int64_t next_position(int64_t layer) const override;
  void append(int64_t layer, const TensorView& k, const TensorView& v, const TensorView& positions) override;
  void attend(int64_t layer, const TensorView& q, const TensorView& q_positions, const MutableTensorView& out) override;
  void end_step(StepKind step) override;
  void begin_replay() override;

 private:
  friend class MultiSequenceCache;
  friend struct cache::MultiSequenceAccess;
  struct State;
  std::vector<int64_t> load_bytes(const std::string& bytes, const std::string& model_fingerprint,
                                  const std::string& source);
  Sequence(std::unique_ptr<cache::StepProtocol> steps, std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

class MultiSequenceCache {
 public:
  /// @throws InvalidArgument if config.validate() fails.
  explicit MultiSequenceCache(MultiSequenceConfig config);
  ~MultiSequenceCache();
  MultiSequenceCache(const MultiSequenceCache&) = delete;
  MultiSequenceCache& operator=(const MultiSequenceCache&) = delete;

  const MultiSequenceConfig& config() const;

  /// A new, idle sequence configured as config().model.
  Sequence& add_sequence();
  /// A new, idle sequence with its own storage and eviction configuration; `config`'s geometry
  /// must be the cache's and its rope is replaced by the cache's (keys post-RoPE depend on it).
  /// @throws InvalidArgument on another geometry (naming the field) or a config that does not
  ///         validate.
  Sequence& add_sequence(CacheConfig config);
  /// Ends `seq`'s request and removes it; the reference dangles afterwards.
  /// @throws InvalidArgument if `seq` is not a sequence of this cache.
  void remove_sequence(Sequence& seq);
  int64_t num_sequences() const;
  /// The sequence with `id`. @throws InvalidArgument if there is none.
  Sequence& sequence(int64_t id);

  PoolStats stats() const;
  PrefixCounters counters() const;
  /// Frees up to `bytes` of cached prefix blocks that no sequence uses (LRU leaf first, its
  /// tail first), whole pages; `reclaim(INT64_MAX)` empties the index of unused prefixes.
  /// @return bytes freed.
  int64_t reclaim(int64_t bytes);
  /// Sets bytes_in_use_peak to bytes_in_use (per-phase peaks).
  void reset_peak();

  /// Persists the prefix index to directory `dir` (created if missing; its parent must exist):
  /// every cached page — its blocks exactly as stored, the P token ids it keys and its place in
  /// the tree — in one pages file with an XXH3-64 per page, then a manifest naming that file,
  /// its size and checksum, written atomically last (docs/snapshot-format.md, "Prefix index
  /// directory"). A save that fails leaves the directory's previous index loadable; a save
  /// that succeeds removes the previous pages file. Pages held by running sequences are
  /// written too (shared blocks are read-only). Sequences are not written (Sequence::save).
  /// @throws SnapshotError (kIo) naming the path and the OS error (a read-only or full disk).
  void save_prefix_index(const std::string& dir, const std::string& model_fingerprint) const;
  /// Warm start: reads the index `dir` holds (save_prefix_index, possibly by another process)
  /// into this cache's index, whose later requests then reuse its prefixes as if they had
  /// been computed here — bit for bit the same blocks. Every namespace of the index must be the
  /// storage key of config().model or of a sequence already added (add_sequence(CacheConfig)
  /// first for the others), under the same geometry and `model_fingerprint`; pages the index
  /// already holds are kept and the file's copies dropped. The loaded pages are unused (the
  /// first to be reclaimed, LRU in file order). All-or-nothing: every page is read and checked
  /// (checksums, block records against the namespace's formats, full unholed blocks covering
  /// exactly their page) before the index changes.
  /// @return the pages added to the index.
  /// @throws SnapshotError naming the file and the failed check (kIo: no manifest or pages
  ///         file, unreadable; kOtherModel, kOtherConfig: geometry or a namespace no
  ///         configuration of this cache stores, or prefix sharing off; kChecksum, kTruncated,
  ///         kNotSnapshot, kFutureVersion, kInconsistent as for a snapshot); PoolFullError
  ///         (preempted() false) when the pages need more than the pool's free bytes (the load
  ///         reclaims nothing). Either leaves the cache unchanged.
  int64_t load_prefix_index(const std::string& dir, const std::string& model_fingerprint);

  /// Every sequence's invariants, the index's structure and locks, and the pool: every block's
  /// reference count equals its holders (sequences' block lists and the index), the blocks in
  /// use are exactly those, unused cached pages are held by the index alone, bytes in use ≤
  /// capacity. O(blocks). @throws InternalError describing the first violation.
  void check_invariants() const;

 private:
  friend class Sequence;
  friend struct cache::MultiSequenceAccess;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcache
