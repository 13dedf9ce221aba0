// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file sequence_seam.h (internal)
/// What a MultiSequenceCache needs from the CacheManager of each of its sequences, and no more:
/// blocks from a PoolSet shared with the other sequences and the prefix index, a check before
/// every allocation (the pool's capacity), and taking over a cached prefix as if the manager
/// had appended it itself. A CacheManager built by its public constructor has none of this and
/// behaves exactly as before.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/block_list.h"
#include "kvcache/cache_manager.h"
#include "kvcache/cache_scheme.h"

namespace kvcache::cache {

class LayerStore;
class PoolSet;
struct StreamSetup;

/// Called by a manager before it allocates. Either may throw CapacityError; the manager has
/// then changed nothing (the call is rejected, as every rejected call is).
class StepHooks {
 public:
  virtual ~StepHooks() = default;
  /// append() validated a call that allocates at most `bytes` of new blocks.
  virtual void before_append(int64_t bytes) = 0;
  /// end_step() planned every layer; its evictions allocate at most `bytes` (copies on write).
  virtual void before_evict(int64_t bytes) = 0;
};

/// A cached prefix a sequence takes over: blocks per layer, per KV head, oldest first.
struct AdoptedPrefix {
  int64_t tokens = 0;                               ///< positions 0 .. tokens − 1
  std::vector<std::vector<std::vector<Block>>> k;   ///< [layer][head] → K blocks
  std::vector<std::vector<std::vector<Block>>> v;   ///< [layer][head] → V blocks
  /// The first append of each layer after the prefix must carry at least this many tokens
  /// (a stream with a sliding residual of R tokens: R), or the sequence would not hold what it
  /// holds when it computes the prefix itself.
  int64_t min_next_step = 0;
};

struct SequenceSeam {
  static CacheManager make(CacheConfig config, std::shared_ptr<PoolSet> pools, StepHooks* hooks);
  /// Why a freshly reset manager could not skip a prefill step of the prompt's first `tokens`
  /// tokens and still do exactly what it does when it runs that step: "" when it can. The step
  /// is replayable when the policy needs no attention for it and plans no eviction in it.
  /// With `allow_attention`, a policy that needs attention is let through (its state then
  /// misses the step's attention); the eviction test still applies, by the layer budgets.
  static std::string replay_blocker(const CacheManager& m, int64_t tokens, bool allow_attention);
  /// Takes over `prefix` in a freshly reset manager: its blocks become every layer's oldest
  /// tokens, the counters and positions are what appending them in one kPrefill step gives,
  /// and the policy sees that step end (on_step_end) — replay_blocker() must have said "".
  static void adopt(CacheManager& m, const AdoptedPrefix& prefix);

  static const LayerStore& layer(const CacheManager& m, int64_t layer);
  static const CacheScheme& scheme(const CacheManager& m);
  /// The stream setups of `layer` (a scheme may store each layer differently).
  static const StreamSetup& key_setup(const CacheManager& m, int64_t layer);
  static const StreamSetup& value_setup(const CacheManager& m, int64_t layer);
  static int64_t block_tokens(const CacheManager& m);
  /// Blocks this manager copied on write, over every layer (cumulative, since construction).
  static int64_t cow_copies(const CacheManager& m);
};

}  // namespace kvcache::cache
