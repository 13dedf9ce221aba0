// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file attention.h
/// Attention over the KV cache: the semantics CacheManager::attend() implements, the
/// attention statistics it hands to an eviction policy, and the plain at::-ops reference
/// that every attention path of the project is held to.
///
/// Semantics (one layer, letters of types.h). Query rows q `[B, H_q, T_q, D]` (post-RoPE)
/// and the cached keys/values of each KV head; query head h reads KV head h / G,
/// G = H_q / H_kv (GQA: K/V are never copied per query head). For query row (h, t) at
/// position p_t and resident key j of KV head h / G at position k_j:
///   s_j = (q_t · k_j) / √D in float32, visible iff k_j ≤ p_t (causal by stored positions,
///         so holes left by eviction and ragged heads need no mask of their own);
///   out = Σ_j softmax(s)_j · v_j, computed with an online softmax over the stored blocks
///         (flash-attention style: running max and sum, rescaled per block).
/// Every query row sees at least one key in a cache that holds the step's own tokens; a row
/// that sees none gets zeros.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvcache {

/// The attention statistics an eviction policy consumes in one step
/// (EvictionPolicy::attention_need()). attend() computes exactly these, never a full
/// `[B, H_q, T_q, T]` probability tensor.
struct AttentionNeed {
  static constexpr int64_t kAllRows = -1;
  /// Query rows (query tokens of the step, counted from its end) whose attention is needed:
  /// 0 = none, kAllRows = every row, n > 0 = the last min(n, T_q) rows.
  int64_t rows = 0;
  /// Keep one row per query token (SnapKV's observation window) or their sum (H2O; with
  /// kMax: their maximum).
  bool per_row = false;
  /// How the G query heads of a KV group (and, without per_row, the selected rows and the
  /// batch) are reduced: kMeanSum = mean over the group, sum over rows and batch (H2O, SnapKV);
  /// kMax = max over the group, the rows and the batch (KVzip's replay score).
  enum class Reduce { kMeanSum, kMax };
  Reduce reduce = Reduce::kMeanSum;

  bool any() const { return rows != 0; }
  /// Rows selected among T_q query tokens.
  int64_t selected(int64_t t_q) const { return rows == kAllRows ? t_q : (rows < t_q ? rows : t_q); }
};

/// Attention mass of a step's query rows over one layer's resident keys, reduced to KV
/// heads: for KV head h, the mean over its G query heads of the softmax probabilities (sum
/// over the batch), or with AttentionNeed::Reduce::kMax their max over the group (and batch). `heads[h]` is row-major `[rows, T_h]` float32, keys in cache order
/// (oldest first), T_h = the tokens head h holds; rows = the selected query rows in order
/// (per_row) or 1 (their sum).
struct AttentionMass {
  int64_t rows = 0;
  std::vector<std::vector<float>> heads;

  int64_t num_kv_heads() const { return static_cast<int64_t>(heads.size()); }
  /// Keys of head h (T_h).
  int64_t keys(int64_t h) const;
  /// `[H_kv, rows, T]` float32 copy. @throws InvalidArgument if heads hold different counts.
  at::Tensor to_tensor() const;
};

/// What a policy needs from a context replay (EvictionPolicy::replay_need()): KVzip (Kim et al.,
/// arXiv 2505.23416) scores the cached context by the attention that a replay of it — an
/// instruction ("Repeat the previous context exactly.") followed by the context's own tokens,
/// in chunks — pays to each cached token. The runner feeds each chunk as `instruction ids +
/// context chunk` through a replay step (CacheManager::begin_replay(), StepKind::kReplay /
/// kReplayEnd) after the context's prefill; the replay's K/V are never stored.
struct ReplayNeed {
  /// Context tokens per replay step (> 0); 0 = no replay needed.
  int64_t chunk = 0;
  /// Text fed before every chunk (the runner encodes it with the model's tokenizer).
  std::string instruction;
  /// The attention of the replay's query rows over the resident keys that the policy observes
  /// in each replay step (KVzip: every row, max over rows and the GQA group).
  AttentionNeed attention;

  bool any() const { return chunk > 0; }
};

/// Reduces attention probabilities `[B, H_q, T_q, T]` (float32, finite, rows of a softmax)
/// to what `need` selects over `num_kv_heads` KV heads: the mass attend() would hand over
/// (need.reduce: mean over the group and sum over rows, or max over both).
/// @throws InvalidArgument on a bad rank/dtype, H_q not a multiple of num_kv_heads, or
///         non-finite / negative probabilities (the message names the first bad index).
AttentionMass reduce_attention(const at::Tensor& probs, int64_t num_kv_heads, const AttentionNeed& need);

/// The instruction set of the fused kernels through which CacheManager::attend() reads the
/// stored blocks on this CPU (docs/cache-manager.md, "Fused kernels"): "avx512" (AVX-512
/// VNNI/VBMI: integer keys dotted with a two-term int8 rounding of the query), "avx2" (AVX2 + FMA +
/// F16C: float32 arithmetic, as the generic path) or "none" (the generic per-block path). The
/// CPU's best, or what the environment variable KVCACHE_FUSED_ISA names (avx512, avx2 or none),
/// so that one machine can reproduce another's attention arithmetic.
/// @throws InvalidArgument if KVCACHE_FUSED_ISA holds another value or names an ISA this CPU
///         (or build) cannot run.
std::string attention_kernels();

/// The reference attention: plain at:: ops (matmul, masked softmax, matmul), in float64
/// when q is float64, else float32.
/// @param q      `[B, H_q, T_q, D]` post-RoPE queries
/// @param k      `[B, H_kv, S, D]` post-RoPE keys
/// @param v      `[B, H_kv, S, D]` values
/// @param k_pos  int64 `[H_kv, S]` position of each key
/// @param q_pos  int64 `[T_q]` position of each query
/// @param probs  if not null, receives the probabilities `[B, H_q, T_q, S]`
/// @return `[B, H_q, T_q, D]` in the compute dtype. A key is visible iff k_pos ≤ q_pos.
/// @throws InvalidArgument naming the tensor whose shape or dtype does not fit.
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& k_pos, const at::Tensor& q_pos,
                               at::Tensor* probs = nullptr);

}  // namespace kvcache
