// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file step_protocol.h (internal)
/// StepProtocol: how a sequence's forward steps drive its store (sequence_store.h) and its
/// eviction policy — the checks of every call (nothing changes before all pass), the RoPE of
/// incoming keys, attention through the block path (attend.h) and the statistics it hands the
/// policy, query rows, end_step's plan-then-evict, and the replay steps (KVzip), whose tokens
/// are held aside and read by the same block path after the resident ones. CacheManager and a
/// MultiSequenceCache's Sequence are its two public faces (kvcache/sequence_cache.h); a
/// sequence of a MultiSequenceCache passes its shared pools and its StepHooks.

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "cache/attend.h"
#include "cache/block_layer_view.h"
#include "cache/sequence_store.h"
#include "common/rope_table.h"
#include "kvcache/cache_config.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/sequence_cache.h"

namespace kvcache::cache {

/// Largest position the RoPE table records cos/sin for (a table of D floats per position).
inline constexpr int64_t kMaxPreRopePosition = int64_t{1} << 22;

/// Called before a step allocates (MultiSequenceCache's pool capacity). Either may throw
/// CapacityError; the step has then changed nothing.
class StepHooks {
 public:
  virtual ~StepHooks() = default;
  /// append() validated a call that allocates at most `bytes` of new blocks.
  virtual void before_append(int64_t bytes) = 0;
  /// end_step() planned every layer; its evictions allocate at most `bytes` (copies on write).
  virtual void before_evict(int64_t bytes) = 0;
};

class StepProtocol {
 public:
  /// A manager of its own (`pools` null: its own PoolSet), or a sequence over shared pools
  /// that calls `hooks` (may be null) before it allocates. `config` validated here.
  StepProtocol(CacheConfig config, std::shared_ptr<PoolSet> pools, StepHooks* hooks);

  const CacheConfig& config() const { return cfg_; }
  const EvictionPolicy& policy() const { return *policy_; }
  const SequenceStore& store() const { return *store_; }

  void reset(int64_t context_length);
  void append(int64_t layer, const TensorView& k, const TensorView& v, const TensorView& positions);
  void attend(int64_t layer, const TensorView& q, const TensorView& q_positions, const MutableTensorView& out);
  void observe_attention(int64_t layer, const TensorView& probs);
  void observe_queries(int64_t layer, const TensorView& q, const TensorView& q_positions);
  void end_step(StepKind step);
  void begin_replay();
  int64_t next_position(int64_t layer) const;
  LayerTokens tokens(int64_t layer) const;
  CacheStats stats() const { return store_->total(); }
  LayerKV get(int64_t layer) const;
  void check_invariants() const;

  // ---- attend in two halves (attend_batch): every check first, then the heads, then the policy
  /// One checked attend() call, ready to run.
  struct Pending {
    int64_t layer = 0;
    AttendArgs args;
    std::vector<float> q;              ///< q as float32 when the caller's was not (else args.q is theirs)
    std::vector<int64_t> q_pos;        ///< the query positions
    std::vector<float> out;            ///< the result when `out` is not contiguous float32
    MutableTensorView target;          ///< the caller's output
    AttentionMass mass;
    AttentionNeed need;
    QueryNeed qneed;
    int64_t t_q = 0;
    bool replay = false;
  };
  /// Checks attend(layer, q, q_positions, out) and prepares it. Changes nothing.
  /// @throws what attend() throws.
  void prepare_attend(int64_t layer, const TensorView& q, const TensorView& q_positions, const MutableTensorView& out,
                      Pending& p) const;
  /// After p's heads ran (attend_head for every KV head): the output written to the caller's
  /// view, the policy fed, the layer's observation flags set. Nothing throws for a prepared call.
  void finish_attend(Pending& p);

  // ---- what a MultiSequenceCache needs of its sequences
  /// Why a freshly reset sequence could not skip a prefill step of the prompt's first `tokens`
  /// tokens and still do exactly what it does when it runs that step: "" when it can. The step
  /// is replayable when the policy needs no attention for it and plans no eviction in it. With
  /// `allow_attention`, a policy that needs attention is let through (its state then misses the
  /// step's attention); the eviction test still applies, by the layer budgets.
  std::string replay_blocker(int64_t tokens, bool allow_attention) const;
  /// Takes over `prefix` in a freshly reset sequence: its blocks become every layer's oldest
  /// tokens, the counters and positions are what appending them in one kPrefill step gives,
  /// and the policy sees that step end (on_step_end) — replay_blocker() must have said "".
  void adopt(const AdoptedPrefix& prefix);
  /// Blocks copied on write, over every layer (cumulative, since construction).
  int64_t cow_copies() const { return store_->cow_copies(); }
  /// The LayerView the policy gets for `layer` (in range).
  BlockLayerView view(int64_t layer) const;

  // ---- snapshots (snapshot.cpp, docs/snapshot-format.md)
  /// The snapshot of this sequence: its blocks as stored, counters and policy state, under a
  /// header naming `model_fingerprint` and the caller's `tokens`. Between steps only.
  /// @throws InvalidArgument inside a step or a replay.
  std::string snapshot(const std::string& model_fingerprint, const std::vector<int64_t>& tokens) const;
  /// A new protocol of `config` (its context_length replaced by the snapshot's) holding what
  /// `bytes` holds, its blocks from `pools` (null: its own) and calling `hooks` afterwards (as
  /// the constructor). Every check runs before anything is returned; the caller's cache is not
  /// touched (blocks taken from shared `pools` go back when a check fails). `source` names the
  /// file in messages; the saved token ids go to `*tokens`.
  /// @throws SnapshotError naming the failed check (kvcache/snapshot.h).
  static std::unique_ptr<StepProtocol> from_snapshot(const CacheConfig& config, const std::string& bytes,
                                                     const std::string& model_fingerprint, const std::string& source,
                                                     std::vector<int64_t>* tokens,
                                                     std::shared_ptr<PoolSet> pools = nullptr,
                                                     StepHooks* hooks = nullptr);

 private:
  struct LayerStep {
    int64_t step_new = 0;
    bool observed = false;  ///< the policy got this step's attention for the layer
    bool queried = false;   ///< the policy got this step's query rows for the layer
    /// attend(), observe_attention or observe_queries ran on the layer in this step (whether or
    /// not the policy uses attention): the step's appends are over — one rule for every policy.
    bool attended = false;
  };
  /// A replay step's tokens of one layer, held aside (never stored).
  struct ReplayLayer {
    std::vector<float> k, v;   ///< `[H_kv, n, D]` float32, k post-RoPE
    std::vector<int64_t> pos;  ///< their positions (next_position(layer) + i)
    bool attended = false;
  };

  bool pre_rope() const { return cfg_.key_storage == KeyStorage::kPreRoPE; }
  /// Pre-RoPE keys `[H_kv, n, D]` float32: throws as rotate_keys() does when a key rotated by
  /// the RoPE table at its position — what every read applies — is not finite, so both key
  /// storages accept the same keys (positions recorded in the table first).
  void check_rotated_finite(const std::vector<float>& k, const int64_t* pos, int64_t n, const char* fn) const;
  void check_layer(int64_t layer, const char* fn) const;
  /// The rows of a checked k/v `[1, H_kv, n, D]` as float32 `[H_kv, n, D]` (converted once).
  void rotate_keys(std::vector<float>& k, const int64_t* pos, int64_t n, const char* fn) const;
  void replay_append(int64_t layer, const TensorView& k, const TensorView& v, const std::vector<int64_t>& pos);
  void hand_queries(int64_t layer, const float* q, const int64_t* q_pos, int64_t t_q, const QueryNeed& need);
  void check_plan(int64_t layer, const EvictionPlan& plan) const;

  CacheConfig cfg_;
  std::unique_ptr<EvictionPolicy> policy_;
  common::RopeTable rope_table_;  ///< kPreRoPE: rotation on read; policies: pre-RoPE queries, mean rotation
  std::unique_ptr<SequenceStore> store_;
  StepHooks* hooks_ = nullptr;
  std::vector<LayerStep> steps_;
  bool replaying_ = false;
  bool replay_plans_ = false;  ///< the policy asked for the replay (else its end plans nothing)
  std::vector<ReplayLayer> replay_;
};

/// Writes snapshot `bytes` to `path` atomically (io::write_file_atomic) or to `out`; `fn` names
/// the caller in messages. @throws SnapshotError (kIo) naming the path and the OS error.
void write_snapshot(const std::string& path, const std::string& bytes, const char* fn);
void write_snapshot(std::ostream& out, const std::string& bytes, const char* fn);

/// Why a config needs the RoPE table beyond pre-RoPE keys ("" if it does not): a policy that
/// takes pre-RoPE queries (Expected Attention un-rotates them and averages future rotations).
std::string rope_table_reason(const CacheConfig& c, const EvictionPolicy& policy);

}  // namespace kvcache::cache
