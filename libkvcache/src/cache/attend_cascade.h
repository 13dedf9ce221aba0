// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file attend_cascade.h (internal)
/// The run of a batched attention call (kvcache::attend_batch): every prepared request's KV
/// heads, with shared-prefix (cascade) attention where requests hold the same leading blocks
/// (FlashInfer's cascade attention; Hydragen, arXiv 2402.05099). Planning — which requests
/// share which runs of tokens, per KV head — is split from running the passes.
///
/// Plan, per KV head, over the requests that may share (BatchItem::shareable) and agree on
/// everything a pass reads besides the blocks (head_dim, query heads per KV head, fused or not,
/// pre-RoPE or not, the per-stream scales, the stream formats): a group's common run is the
/// longest run of leading blocks identical (same pool and block id, format index, live slots,
/// positions) in every member's K stream, and likewise in the V stream; its tokens are the
/// fewer of the two runs' live tokens. The run is one pass over the stacked rows of every
/// member; the group then splits by what its members share beyond the run (a member that
/// shares a further block with the first one left joins its subgroup), recursively; a member
/// alone gets one pass over its remaining tokens. Identity is transitive, so comparisons start
/// where the group's run ended (one block each when members diverge there).
///
/// Split: an unshared head that attend() would split across the threads (split_parts: fewer KV
/// heads than threads, a long head, no mass needed) is split the same way here — its runs
/// (split_points) are passes of their own, merged in run order — so it gets attend()'s bits.
///
/// Run: every pass (attend_range) and every other unshared head (attend_head, untouched: bit for
/// bit attend()) is one task, largest first, taken by the threads from one counter; then each
/// cascaded or split (request, head) merges its passes' partial states (merge_partial, root
/// first) and normalises them into the request's output.

#include <vector>

#include "cache/attend.h"
#include "kvcache/sequence_cache.h"

namespace kvcache::cache {

struct BatchItem {
  const AttendArgs* args = nullptr;  ///< prepared (begin_attend not yet called); t_q > 0
  /// May join a shared pass: no attention mass needed from this call, no replay tail.
  bool shareable = false;
};

/// Attends every item's KV heads into its output (and its mass, for unshared ones), with shared
/// passes when `cascade`. `stats` (may be null) is reset and filled.
void attend_items(const std::vector<BatchItem>& items, bool cascade, AttendBatchStats* stats);

}  // namespace kvcache::cache
