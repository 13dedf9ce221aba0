// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cache_debug.h
/// CacheDebug: what tests and debugging read of a SequenceCache beyond its verbs — the stored
/// K/V materialised (an explicit O(T·D) copy that attend() never makes) and the invariant
/// check. Both are O(T) or worse; neither belongs on an engine's per-token path.

#include <cstdint>

#include "kvcache/sequence_cache.h"

namespace kvcache {

class CacheDebug {
 public:
  /// Everything `layer` holds, dequantized to float32 and post-RoPE, oldest first.
  /// @throws InvalidArgument on a layer out of range; UnsupportedError if its KV heads hold
  ///         different numbers of tokens (use tokens() for ragged heads).
  static LayerKV get(const SequenceCache& cache, int64_t layer);

  /// Verifies internal invariants (block lists, positions, residual rules, byte counters ==
  /// recounts from the blocks, pool blocks in use == blocks held, peaks ≥ current). O(T).
  /// @throws InternalError describing the first violation.
  static void check_invariants(const SequenceCache& cache);
};

}  // namespace kvcache
