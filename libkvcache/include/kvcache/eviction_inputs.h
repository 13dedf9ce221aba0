// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file eviction_inputs.h
/// What an eviction policy consumes (kvcache/eviction_policy.h), beside its interface:
///   - attention: AttentionNeed (which statistics a policy asks for), AttentionMass (what
///     CacheManager::attend() computes and hands over, never a `[B, H_q, T_q, T]` tensor),
///     ReplayNeed (KVzip's context replay) and reduce_attention() (the same mass from
///     probabilities an engine computed itself);
///   - keys and values: LayerView, a read-only view of one layer's resident K/V decoded ON
///     DEMAND from the stored blocks, one block at a time, per KV head, in cache order.
///     Scorers that need keys or values (Knorm, KeyDiff, Expected Attention, DuoAttention) read
///     them here; the cache keeps no float32 copy for them and no per-token side data
///     (docs/policies.md, "What scorers read"). TensorLayerView is its twin over plain arrays;
///   - queries: QueryNeed / QueryRows, the step's query rows a policy asks for (Expected
///     Attention fits its query statistics on them, DuoAttention scores its heads with them),
///     handed over by CacheManager::attend() (or ExternalAttention::observe_queries()) like
///     attention mass.
///
/// Letters as in kvcache/types.h: H_q query heads, H_kv KV heads, G = H_q / H_kv, D head_dim,
/// T_h the tokens KV head h holds (heads may be ragged).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvcache/cache_config.h"
#include "kvcache/view.h"

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
/// over the batch), or with AttentionNeed::Reduce::kMax their max over the group (and batch).
/// `heads[h]` is row-major `[rows, T_h]` float32, keys in cache order
/// (oldest first), T_h = the tokens head h holds; rows = the selected query rows in order
/// (per_row) or 1 (their sum).
struct AttentionMass {
  int64_t rows = 0;
  std::vector<std::vector<float>> heads;

  int64_t num_kv_heads() const { return static_cast<int64_t>(heads.size()); }
  /// Keys of head h (T_h).
  int64_t keys(int64_t h) const;
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

/// Reduces attention probabilities `[B, H_q, T_q, T]` (float32, finite, rows of a softmax; a
/// view of any strides) to what `need` selects over `num_kv_heads` KV heads: the mass attend()
/// would hand over (need.reduce: mean over the group and sum over rows, or max over both; the
/// sums run in float32 in the order of the rows, the mean divides by G as at::mean does).
/// @throws InvalidArgument on a bad rank/dtype, H_q not a multiple of num_kv_heads, or
///         non-finite / negative probabilities (the message names the first bad index).
AttentionMass reduce_attention(const TensorView& probs, int64_t num_kv_heads, const AttentionNeed& need);

/// Which streams LayerView::visit decodes (positions are always given).
enum class ViewStreams : uint8_t {
  kPositions = 0,  ///< positions only: nothing is decoded
  kKeys = 1,
  kValues = 2,
  kBoth = 3,
};

/// A run of consecutive resident tokens of one KV head, as LayerView::visit hands them out.
/// Pointers are valid only during the callback.
struct TokenRun {
  int64_t first = 0;                   ///< resident index (cache order, oldest = 0) of the run's first token
  int64_t n = 0;                       ///< tokens in the run (≥ 1)
  const float* keys = nullptr;         ///< `[n, D]` float32 keys as attention reads them (post-RoPE, dequantized); null unless requested
  const float* values = nullptr;       ///< `[n, D]` float32 values (dequantized); null unless requested
  const int64_t* positions = nullptr;  ///< `[n]` int64 positions the tokens carry
};

/// Read-only view of one layer's resident tokens for an eviction policy. Implementations:
/// the CacheManager's block view (decodes each block once per visit through the format's own
/// decode kernel into a one-block scratch: O(T_h·D) work, O(block·D) memory) and
/// TensorLayerView (plain tensors, the reference twin the tests hold it to).
class LayerView {
 public:
  virtual ~LayerView() = default;
  virtual int64_t num_kv_heads() const = 0;
  virtual int64_t head_dim() const = 0;
  /// Tokens KV head h holds (T_h).
  virtual int64_t resident(int64_t h) const = 0;
  /// The position the layer's next token gets (the first future position).
  virtual int64_t next_position() const = 0;
  /// Calls `fn` for head h's resident tokens in cache order, in runs that together cover
  /// indices [0, T_h) exactly once, increasing. Keys are post-RoPE (pre-RoPE storage is
  /// rotated by each token's position, as attend() does).
  /// @throws InvalidArgument if h is out of range.
  virtual void visit(int64_t h, ViewStreams streams, const std::function<void(const TokenRun&)>& fn) const = 0;
  /// The mean over positions [first, first + n) of the rotary embedding's cos and sin per
  /// frequency i < D/2 (rotate-half RoPE: the mean rotation is R̄x = c̄·x + s̄·rotate_half(x)),
  /// written to `cos_out[D/2]`, `sin_out[D/2]` (Expected Attention, arXiv 2510.00636).
  /// @throws UnsupportedError if the view has no rotary embedding (e.g. a TensorLayerView
  ///         built without one); InvalidArgument if first < 0 or n < 1.
  virtual void mean_rotation(int64_t first, int64_t n, float* cos_out, float* sin_out) const = 0;
};

/// A LayerView over plain arrays (copied in when built): for engines with their own cache and
/// for tests (the reference the block view is compared with).
class TensorLayerView final : public LayerView {
 public:
  /// Heads of equal length.
  /// @param k          `[1, H_kv, T, D]` float32/float16/bfloat16 post-RoPE keys (any strides)
  /// @param v          `[1, H_kv, T, D]` values, the same
  /// @param positions  int64 `[H_kv, T]`, increasing per head
  /// @param next_position  position of the next token
  /// @param rope       the model's rotate-half RoPE (for mean_rotation), or empty
  /// @throws InvalidArgument on shapes or dtypes that do not fit (naming them).
  TensorLayerView(const TensorView& k, const TensorView& v, const TensorView& positions, int64_t next_position,
                  RopeFn rope = {});
  /// Ragged heads: per KV head h, keys `k[h]` and values `v[h]` float `[T_h, D]` and int64
  /// `positions[h]` `[T_h]` (kvcache/torch/tensor_view.h's views() makes the vectors from
  /// at::Tensors). @throws InvalidArgument on shapes or dtypes that do not fit.
  TensorLayerView(const std::vector<TensorView>& k, const std::vector<TensorView>& v,
                  const std::vector<TensorView>& positions, int64_t next_position, RopeFn rope = {});

  int64_t num_kv_heads() const override { return static_cast<int64_t>(k_.size()); }
  int64_t head_dim() const override { return d_; }
  int64_t resident(int64_t h) const override;
  int64_t next_position() const override { return next_; }
  void visit(int64_t h, ViewStreams streams, const std::function<void(const TokenRun&)>& fn) const override;
  void mean_rotation(int64_t first, int64_t n, float* cos_out, float* sin_out) const override;

 private:
  std::vector<std::vector<float>> k_, v_;  ///< per head [T_h, D]
  std::vector<std::vector<int64_t>> pos_;  ///< per head [T_h]
  int64_t d_ = 0;
  int64_t next_ = 0;
  RopeFn rope_;
};

/// The query rows a policy needs from each step (EvictionPolicy::query_need()).
struct QueryNeed {
  static constexpr int64_t kAllRows = -1;
  /// Query tokens of the step, counted from its end: 0 = none, kAllRows = every one, n > 0 =
  /// the last min(n, T_q).
  int64_t rows = 0;
  /// Also hand over the rows before RoPE (rotated back by their positions; needs the model's
  /// RoPE to be rotate-half, checked when the CacheManager is built).
  bool pre_rope = false;

  bool any() const { return rows != 0; }
  int64_t selected(int64_t t_q) const { return rows == kAllRows ? t_q : (rows < t_q ? rows : t_q); }
};

/// One step's selected query rows of one layer.
struct QueryRows {
  int64_t num_q_heads = 0;         ///< H_q
  int64_t head_dim = 0;            ///< D
  std::vector<int64_t> positions;  ///< `[n]` positions of the selected query tokens, in order
  std::vector<float> post_rope;    ///< `[H_q, n, D]` float32, as attend() received them
  std::vector<float> pre_rope;     ///< `[H_q, n, D]` float32 (empty unless QueryNeed::pre_rope)

  int64_t rows() const { return static_cast<int64_t>(positions.size()); }
  /// Row t of query head h (post- or pre-RoPE).
  const float* post(int64_t h, int64_t t) const { return post_rope.data() + (h * rows() + t) * head_dim; }
  const float* pre(int64_t h, int64_t t) const { return pre_rope.data() + (h * rows() + t) * head_dim; }
};

}  // namespace kvcache
