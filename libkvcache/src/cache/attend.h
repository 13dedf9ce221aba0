// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file attend.h (internal)
/// The generic read path: attention of one layer's queries over its LayerStore, block by
/// block, for every stored format (kvcache/attention.h gives the semantics). Per KV head:
///   for each block of the K and V streams (quantized blocks, then residual blocks), decode
///   it once into a small float32 scratch (the format's own decode kernel; fp32 blocks are
///   read in place), rotate pre-RoPE keys by their stored positions, then for each tile —
///   the live tokens a K block and a V block share — take q·k, mask by position, update an
///   online softmax (running max and sum per query row) and accumulate p·v.
/// Never a whole-cache copy: the scratch is two blocks. It is the reference twin of any
/// fused kernel and the path of every quantizer without one.
///
/// Query rows of KV head h are its G query heads × T_q tokens, token-major (row = t·G + g),
/// processed in blocks of up to 64 rows; the attention mass for the policy is formed from
/// the scores of the selected rows (kept for the pass when they fit 64 MiB, recomputed in a
/// second pass over the blocks otherwise).

#include <cstdint>

#include "cache/layer_store.h"
#include "cache/rope_table.h"
#include "kvcache/attention.h"

namespace kvcache::cache {

struct AttendArgs {
  const LayerStore* layer = nullptr;
  const float* q = nullptr;        ///< `[H_q, T_q, D]` float32 contiguous (batch 1)
  const int64_t* q_pos = nullptr;  ///< `[T_q]`
  int64_t t_q = 0;
  int64_t num_q_heads = 0;
  const RopeTable* rope = nullptr;  ///< non-null: keys are stored pre-RoPE, rotate on read
  AttentionNeed need;               ///< rows whose mass `mass` receives (if any())
  float* out = nullptr;             ///< `[H_q, T_q, D]` float32
  AttentionMass* mass = nullptr;    ///< filled when need.any()
  /// Scores of the selected rows kept for the mass when they fit (floats); beyond, a second
  /// pass over the blocks recomputes them (tests set 0 to exercise it).
  int64_t max_buffered_scores = int64_t{16} << 20;
  /// Use the fused kernels (attend_fused.h) where the CPU and every block format allow; false
  /// runs the generic path (the reference twin) everywhere.
  bool fused = true;
};

/// Runs attention for every KV head (at::parallel_for over heads when the work is large).
void attend_generic(const AttendArgs& args);

/// Lanes of the float32 vectors the generic path's tile kernels (q·k over rows, the online
/// softmax, p·v) use on this CPU: 16 (AVX-512), 8 (AVX2 + FMA) or 4 (baseline). Each width is
/// its own build of the same source with that ISA enabled, chosen once for the running CPU.
int tile_lanes();

/// Makes the tile kernels of `lanes` lanes the ones used (tests and benchmarks: each width is
/// held to the same reference); 0 picks the widest again. Not thread-safe: call while no
/// attention runs. Returns false (and changes nothing) if this CPU cannot run that width.
/// @throws InvalidArgument if lanes is not 0, 4, 8 or 16.
bool use_tile_lanes(int lanes);

}  // namespace kvcache::cache
