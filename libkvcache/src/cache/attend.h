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
/// second pass over the blocks otherwise): the mean over the G query heads (summed over rows)
/// or, for AttentionNeed::Reduce::kMax, the max over both.
///
/// A replay step (KVzip) hands extra tokens (`tail_*`): float32 post-RoPE keys and values that
/// follow every stored token of the head, at later positions; they are attended like stored
/// ones (causally by position), and the mass covers the stored tokens only.

#include <cstdint>
#include <vector>

#include "cache/attend_tiles.h"
#include "cache/layer_store.h"
#include "common/rope_table.h"
#include "kvcache/attention.h"

namespace kvcache::cache {

struct AttendArgs {
  const LayerStore* layer = nullptr;
  const float* q = nullptr;        ///< `[H_q, T_q, D]` float32 contiguous (batch 1)
  const int64_t* q_pos = nullptr;  ///< `[T_q]`
  int64_t t_q = 0;
  int64_t num_q_heads = 0;
  const common::RopeTable* rope = nullptr;  ///< non-null: keys are stored pre-RoPE, rotate on read
  AttentionNeed need;               ///< rows whose mass `mass` receives (if any())
  float* out = nullptr;             ///< `[H_q, T_q, D]` float32
  AttentionMass* mass = nullptr;    ///< filled when need.any()
  /// Scores of the selected rows kept for the mass when they fit (floats); beyond, a second
  /// pass over the blocks recomputes them (tests set 0 to exercise it).
  int64_t max_buffered_scores = int64_t{16} << 20;
  /// Use the fused kernels (attend_fused.h) where the CPU and every block format allow; false
  /// runs the generic path (the reference twin) everywhere.
  bool fused = true;
  /// Tokens after the stored ones (a replay step): per KV head h, keys at tail_k + h·tail_n·D
  /// and values at tail_v + h·tail_n·D (`[tail_n, D]` float32, keys post-RoPE), positions
  /// tail_pos `[tail_n]` (shared by every head, after every stored position).
  const float* tail_k = nullptr;
  const float* tail_v = nullptr;
  const int64_t* tail_pos = nullptr;
  int64_t tail_n = 0;
};

/// The online softmax's state of query rows before normalisation (a partial attention state of
/// FlashInfer's cascade attention): per row the running max m of the scores (−inf: no key
/// seen), the sum l of exp(s − m) and the unnormalised accumulator Σ exp(s − m)·v.
struct PartialState {
  int64_t rows = 0, d = 0;
  std::vector<float> m, l;  ///< `[rows]`
  std::vector<float> acc;   ///< `[rows, D]`
  /// `rows` empty rows (m −inf, l 0, acc 0).
  void reset(int64_t rows, int64_t d);
};

/// Attention of stacked query rows over a run of one KV head's stored tokens (the live tokens
/// [first, first + count) of both streams, oldest first), with no mass, no tail: a pass of the
/// cascade (attend_cascade.h). The same walk, tiles and kernels as attend_head — the fused
/// kernels where `fused` and the layer's formats allow, the generic decode otherwise — with
/// rows taken 256 at a time (one walk over the blocks for 256 rows).
struct RangeArgs {
  const LayerStore* layer = nullptr;
  int64_t head = 0;
  const common::RopeTable* rope = nullptr;  ///< non-null: keys stored pre-RoPE
  bool fused = true;
  const float* q = nullptr;        ///< `[rows, D]` float32 contiguous, any rows of any sequences
  const int64_t* q_pos = nullptr;  ///< `[rows]`: each row's query position (causal mask)
  int64_t rows = 0;
  int64_t first = 0, count = 0;    ///< the live tokens read
};
/// `out` = the rows' partial states over the range (reset first).
void attend_range(const RangeArgs& args, PartialState& out);
/// Merges state (m2, l2, acc2 `[D]`) into (m, l, acc `[D]`) of one row: the log-sum-exp merge
/// of two partial attention states over disjoint key sets — m = max(m, m2), l and acc each
/// rescaled by exp(m_old − m) and summed. Either may be empty (m −inf).
void merge_partial(float* m, float* l, float* acc, float m2, float l2, const float* acc2, int64_t d);
/// out[:D] = acc / l (0 where l is 0: a row that saw no key), as attend_head writes a row.
void normalize_partial(float l, const float* acc, int64_t d, float* out);
/// Walks over the blocks attend_range makes for `rows` rows, and attend_head for a head of
/// `args` (byte accounting of a batch: AttendBatchStats).
int64_t range_walks(int64_t rows);
int64_t head_walks(const AttendArgs& args);

/// Sets up args.mass for args.need (before attend_head runs for any head).
void begin_attend(const AttendArgs& args);
/// Attention of KV head h (heads are independent: any number may run at once).
void attend_head(const AttendArgs& args, int64_t h);
/// A head's multiply-adds: heads run in parallel once this reaches 64 Ki.
int64_t head_work(const AttendArgs& args);
/// begin_attend, then every KV head: in parallel when the work is large, and with each head's
/// keys split across the threads (attend_split) when split_parts() says so.
void attend_generic(const AttendArgs& args);

/// One long sequence on more threads than KV heads (issue 37, decision 4): each head's stored
/// keys are cut into `parts` contiguous runs on K block boundaries (split_points), each run is an
/// attend_range() pass over all of the head's query rows (a task of its own: hkv · parts tasks
/// over the threads), and the head's partial states are merged in run order by merge_partial
/// (the cascade's log-sum-exp merge) and normalised into the output. The result depends on
/// `parts` only, not on which thread ran which run, so it is the same on every run with the same
/// thread count. Against the unsplit head it differs by float32 rounding alone: the same bytes,
/// kernels and scores, the online softmax's sums continued across a cut by one rescaling
/// exp(m − m') instead (tests/attend_cascade_test.cpp, AttendSplit.*, states the tolerance).
///
/// Not used when the step needs the attention mass (need.any()) — the policy's mass then stays
/// bit for bit what one thread computes, from one pass per head — nor in a replay step (tail_n >
/// 0): those run unsplit, in parallel over KV heads only.
///
/// The parts per head for `threads` threads: 1 (no split) when threads < 2, when the heads
/// already fill the threads evenly (H_kv a multiple of threads), when the mass or a tail is
/// needed, or when a run would hold fewer than kSplitGrain multiply-adds; else the fewest parts
/// that spread H_kv · parts runs evenly over the threads (threads / gcd(H_kv, threads)), or, if
/// runs that small fall below the grain, as many as the grain allows up to ⌈threads / H_kv⌉.
int64_t split_parts(const AttendArgs& args, int64_t threads);
/// Multiply-adds of one run (per product: query rows × keys × D) below which a head is not split:
/// 2^20, 2,341 keys of a 7-row, 64-dim head — 90-170 µs of the fused kernels on one core at
/// issue 37's one-thread 32k figures (22 and 12 multiply-adds per ns for int8 and fp32) —
/// against the few µs a parallel region costs to start (tens when its threads sleep between
/// regions: OMP_WAIT_POLICY=passive).
constexpr int64_t kSplitGrain = int64_t{1} << 20;
/// Live-token cut points of head h's keys into `parts` runs: parts + 1 non-decreasing values from
/// 0 to resident(h), each inner one the K block boundary nearest to i · resident(h) / parts.
std::vector<int64_t> split_points(const LayerStore& layer, int64_t h, int64_t parts);
/// The thread count attend_generic passes to split_parts from here (detail::max_threads() as the
/// library is built: 1 without OpenMP, the sanitizer build).
int64_t attend_threads();
/// begin_attend, then every KV head as `parts` runs (above), merged. Requires !need.any() and
/// tail_n == 0 (an internal error otherwise); parts ≥ 1.
void attend_split(const AttendArgs& args, int64_t parts);

}  // namespace kvcache::cache
