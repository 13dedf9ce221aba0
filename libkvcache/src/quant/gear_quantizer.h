// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file gear_quantizer.h (internal)
/// One stream (K or V) of the `gear` cache scheme (GEAR, arXiv 2403.05527; methods.md b.5):
/// each compressed block of n_b consecutive tokens of one KV head, X float32 [n_b, D], is
/// stored as X ≈ Q(X − S) + S + L:
///   1. S, sparse outliers: keys per channel (along the block's n_b tokens), values per token
///      (along the head's D channels): the k largest, then the k smallest of the remaining,
///      k = floor(s · len / 2) (len = n_b for key channels, D for value tokens; ties lowest
///      index first, so a constant row sends exactly k + k of its entries), kept as fp16 with
///      a uint16 index each, and replaced by the row mean (float64 sum) before quantization;
///   2. Q, the base quantizer, KIVI-style: keys `int<b>:g<g>:chan` (per channel in groups of g
///      tokens), values `int<b>:g<g>` (per token in groups of g channels of this head);
///      2^b − 1 levels (the reference's outlier path uses b² − 1, equal at b = 2 and 4);
///   3. L, a rank-r approximation of the residual E = X − (Q + S) (outlier positions hold
///      their fp16 values, so their error is their fp16 rounding), by power iteration with
///      QR (gear::low_rank), stored as fp16 factors U [n_b, R] and P [D, R]: L = U · Pᵀ,
///      added to every entry on read. R = GearParams::stored() >= r: the columns past r are
///      zero (the scheme's prefill rank rp > r reserves them in every block, counted in the
///      bytes).
///
/// Stored layout (StoredLayout; one group = one block of n_b tokens, group_tokens = n_b):
///   codes (code_bytes per block, byte offsets in this order; fp16 values as IEEE binary16 bits,
///   in host byte order, read and written with memcpy, so no alignment is assumed):
///     base codes   nb/gt × the base quantizer's code_bytes (gt: its group_tokens, g for keys, 1 for values)
///     outlier vals n_out fp16   (keys: channel-major, D × 2k; values: token-major, n_b × 2k;
///                               within a row the k largest in selection order, then the k smallest)
///     outlier idx  n_out uint16 (token index in the block for keys, channel index for values)
///     U            n_b × R fp16, row-major (R = stored rank; columns r..R−1 zero)
///     P            D × R fp16, row-major
///   scales, zeros: nb/gt × the base quantizer's meta_count fp16 each (its group minimum and scale).
/// quantize() stores exactly these bytes for every (b, h) and block: codes uint8
/// [B, H_kv, T/n_b, code_bytes], scales/zeros fp16 [B, H_kv, T/n_b, meta_count]; T must be a
/// multiple of n_b. A block whose fp16 values overflow (|x| ≥ 65520 in an outlier, a factor or
/// the base metadata) is reported by encode() as an overflow (the cache then stores it in its
/// fp32 fallback) and rejected by quantize() with InvalidArgument.
///
/// spec(): `gear:...` (the scheme's canonical spec) followed by ` keys` or ` values` (and the
/// role, ` (prefill)` for the encoder of prefill blocks): the stream of a scheme, not a
/// standalone quantizer (make_quantizer does not take it).

#include <cstdint>
#include <memory>
#include <string>

#include "kvcache/quantizer.h"

namespace kvcache::quant {

/// The parameters of the `gear` scheme (cache_scheme.cpp validates them).
struct GearParams {
  int bits = 2;            ///< b: base quantizer bits (2, 3, 4, 8)
  int64_t group = 64;      ///< g: tokens per key group, channels per value group
  double sparsity = 0.02;  ///< s: outlier ratio in [0, 1)
  int64_t rank = 2;        ///< r: rank of the low-rank residual, >= 0 (0: none)
  int64_t loop = 3;        ///< power-iteration loops, >= 1
  int64_t block = 64;      ///< n_b: tokens per compressed block (the streaming buffer), multiple of g
  /// Factor columns every block reserves, >= rank (the scheme's max(r, rp), so that blocks
  /// encoded with the prefill rank rp and with the decode rank r share one StoredLayout);
  /// -1: rank. A block encoded with rank r < stored_rank writes zeros in its last
  /// stored_rank − r columns of U and P, so decode() reads the same columns for both.
  int64_t stored_rank = -1;
  int64_t stored() const { return stored_rank < 0 ? rank : stored_rank; }
};

enum class GearStream { kKey, kValue };

namespace gear {

/// k = floor(s · len / 2) outliers on each side of a row of `len` values (1e-9 slack so
/// that a decimal s such as 0.58 · 100 / 2 counts 29).
int64_t outliers_per_side(double sparsity, int64_t len);

/// The outliers of the row x[0], x[stride], ..., x[(n − 1)·stride]: idx[0..k) the k largest
/// (value descending, ties lowest index first), then idx[k..2k) the k smallest of the other
/// n − k (value ascending, ties lowest index first). Requires 2k <= n.
void select_outliers(const float* x, int64_t n, int64_t stride, int64_t k, int64_t* idx);

/// Rank-r approximation E ≈ U · Pᵀ of E float32 [m, n] row-major by power iteration (the
/// GEAR reference's algorithm; Eigen for the products and QR): P ← P0 [n, r] (deterministic:
/// P0[i][j] = uniform [0, 1) from splitmix64 of the seed 0x6ea4 and i·r + j); then `loop`
/// times: on the last iteration P ← Q of the thin QR of P; U ← E · P; on the last iteration
/// U ← Q of the thin QR of U; P ← Eᵀ · U. With U orthonormal, U · Pᵀ = U · Uᵀ · E, the
/// projection of E onto span(U): a rank-r E whose column space E · P0 spans is recovered
/// exactly. Writes U [m, r] and P [n, r] row-major float32. Requires 1 <= r <= min(m, n).
void low_rank(const float* e, int64_t m, int64_t n, int64_t r, int64_t loop, float* u, float* p);

}  // namespace gear

class GearQuantizer final : public Quantizer {
 public:
  /// `scheme_spec`: the canonical spec of the gear scheme (spec()); `written`: the scheme spec
  /// as the user wrote it, for construction errors (empty: scheme_spec).
  /// `p.rank` is the rank this quantizer encodes with, `p.stored()` the columns its layout
  /// reserves; `role` is appended to spec() (e.g. " (prefill)": the scheme's second encoder).
  /// @throws InvalidArgument if the base quantizer cannot be built from `p` (g not a multiple
  ///         of 8/b, or of 8 for b = 3), n_b not a multiple of g, or r > n_b.
  GearQuantizer(const GearParams& p, GearStream stream, std::string scheme_spec, const std::string& written = "",
                std::string role = "");

  std::string spec() const override;
  /// (code_bytes + meta bytes) · 8 / (n_b · D): codes, metadata, outliers and factors.
  double bits_per_value(int64_t head_dim) const override;
  GroupAxis group_axis() const override { return base_->group_axis(); }

  const GearParams& params() const { return p_; }
  GearStream stream() const { return stream_; }
  const Quantizer& base() const { return *base_; }
  /// Outliers per row side for head_dim `d` (keys: rows are channels of n_b tokens).
  int64_t per_side(int64_t head_dim) const;
  /// Outliers stored per block.
  int64_t outliers_per_block(int64_t head_dim) const;

 protected:
  void check_input(const TensorView& x) const override;
  void do_quantize_into(const Input& in, QuantizedTensor& out) const override;
  void do_dequantize_into(const QuantizedTensor& q, float* out) const override;
  StoredLayout do_stored_layout(int64_t head_dim) const override;
  EncodeStatus do_encode(const float* x, int64_t groups, int64_t head_dim, float tensor_scale,
                         GroupBuffers out) const override;
  void do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float tensor_scale,
                 float* out) const override;

 private:
  /// Byte offsets inside one block's codes.
  struct Offsets {
    int64_t base_groups = 0, base_code = 0, out_vals = 0, out_idx = 0, u = 0, p = 0, total = 0;
    int64_t n_out = 0, per_side = 0, rank = 0, stored_rank = 0, base_meta = 0;
  };
  Offsets offsets(int64_t head_dim) const;
  EncodeStatus encode_block(const float* x, int64_t d, const Offsets& o, GroupBuffers out) const;
  void decode_block(ConstGroupBuffers in, int64_t d, const Offsets& o, float* out) const;

  GearParams p_;
  GearStream stream_;
  std::string scheme_spec_;
  std::string role_;
  std::shared_ptr<const Quantizer> base_;
};

}  // namespace kvcache::quant
