// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file turboquant_outlier.h (internal)
/// TurboQuant with outlier channels (`tq:b<b>:o<n>[:g<G>][:nc][:seed<s>]`; Zandieh, Daliri,
/// Hadian, Mirrokni, arXiv 2504.19874, the paper's fractional-bit setting): the channels of a
/// KV head are split into an outlier set and the rest, and each set is quantized by its own
/// TurboQuant-MSE instance, the outliers at b + 1 bits and the rest at b bits (the paper: "32
/// outlier channels at 3 bits + 96 at 2 bits" at D = 128, which is 2.25 code bits per value).
///
/// Per group of G consecutive tokens of one KV head (G = `g`, default 32):
///   - the n channels with the largest energy Σ_t x_t,c² over the group's tokens are its outliers
///     (ties: the lower channel index); stored as a D-bit channel mask (bit c set iff channel c is
///     an outlier; LSB first, ⌈D/8⌉ bytes; bits past D are 0);
///   - each token row x is split into x_out (the n outlier values, ascending channel order) and
///     x_in (the D − n others, ascending); for each part p of size d_p:
///       ν_p = ‖x_p‖₂ (double, stored fp16), u = x_p / ν_p (0 when ν_p = 0),
///       y = Q_p · u, with Q_p a seeded d_p × d_p random orthogonal matrix (below),
///       code_i = #{ t_j < √d_p · y_i } with t the thresholds of the Lloyd–Max codebook of
///       N(0, 1) at b + 1 bits (outliers) or b bits (rest) (lloyd_max.h);
///     decode: c_i = level[code_i]/√d_p; with `nc` c ← c/‖c‖ (per part); x̂_p = ν_p · Q_pᵀ · c,
///     scattered back to the part's channels. A part whose ν_p is 0 decodes to exact zeros.
///
/// Rotation Q_p: the part sizes are generally not powers of two (96 at D = 128, n = 32), so a
/// dense Haar-random orthogonal matrix replaces the randomized Hadamard transform of `tq`: a
/// d_p × d_p matrix of i.i.d. N(0, 1) entries (entry k = seeded::normal(seed, stream, k), stream
/// 0x7a0 for the outlier part and 0x7a1 for the rest, so the two instances are independent even
/// at equal sizes), its rows orthonormalised by modified Gram–Schmidt in double (the Q of a QR),
/// rounded to float32; computed once per (part, size) and cached. The same seed gives the same
/// bytes on every platform.
///
/// Stored layout (group_tokens = G, axis per channel: a group spans G tokens; kernel kNone, the
/// generic attention path decodes it): codes = ⌈D/8⌉ mask bytes, then per token (in order)
/// ⌈(n·(b+1) + (D − n)·b)/8⌉ bytes: one LSB-first bit stream holding the n outlier codes of
/// b + 1 bits (outlier j at bits [j·(b+1), (j+1)·(b+1))), then the D − n codes of b bits; scales =
/// 2G fp16 per group, (ν_out, ν_in) per token; no zeros. Bits per value:
///   (8·(⌈D/8⌉ + G·⌈(D·b + n)/8⌉) + 32·G) / (G·D)
/// e.g. `tq:b2:o16` at D = 64 (G = 32): 8 + 32·18 = 584 code bytes + 128 norm bytes = 712 bytes per
/// 32 tokens = 22.25 bytes per token = 2.78125 bits/value; `tq:b2:o32` at D = 128: 16 + 32·36 =
/// 1168 + 128 = 1296 bytes per 32 tokens = 40.5 bytes per token = 2.53125 bits/value.
///
/// Errors: InvalidArgument for b not an integer in [1, 3] (fractional b is the half/half mode of
/// TurboQuantizer, without o), `prod` (not supported with outliers: MSE only), n < 1, G < 1; for
/// head_dim D ≤ n (stored_layout, quantize, dequantize, bits_per_value; naming D); quantize() of
/// seq_len T not a multiple of G; a part norm beyond float32 (quantize() names the row; every
/// |x| ≤ FLT_MAX/√D is safe; encode() reports it, and a norm past fp16, as overflow). A tensor
/// whose norms exceed fp16 is stored with fp32 metadata. dequantize() of a hand-built group whose
/// mask does not hold exactly n channels is refused naming the group. Decoding saturates at
/// ±FLT_MAX.

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/quantizer.h"
#include "quant/turboquant_quantizer.h"

namespace kvcache::quant {

class TurboOutlierQuantizer final : public Quantizer {
 public:
  /// `bits` b (n outliers at b + 1 bits, D − n channels at b), `outliers` n, `group` G tokens.
  /// @throws InvalidArgument for b not in {1, 2, 3}, mode kProd, n < 1, G < 1 or a seed outside
  ///         [0, 2147483647] (each message names the value).
  TurboOutlierQuantizer(double bits, TurboMode mode, int64_t outliers, int64_t group, bool norm_correction,
                        int64_t seed);

  std::string spec() const override;
  double bits_per_value(int64_t head_dim) const override;
  GroupAxis group_axis() const override { return GroupAxis::kPerChannel; }

  int bits() const { return bits_; }
  int64_t outliers() const { return n_; }
  int64_t group() const { return g_; }

  /// The rotation Q_p of part `part` (0: outliers, 1: the rest) of size `size` (size × size,
  /// row-major, rows orthonormal): y = Q·u, u = Qᵀ·y. Computed once per (part, size). For tests.
  std::shared_ptr<const std::vector<float>> rotation(int part, int64_t size) const;

  /// The outlier mask of one group: G rows × D floats (finite) → the n channels of largest
  /// Σ_t x_t,c² (ties: lower index), ascending. For tests; encode uses the same function.
  static std::vector<int64_t> select_outliers(const float* x, int64_t rows, int64_t d, int64_t n);

  /// Bytes of codes per group (mask + G token streams) and per token stream.
  int64_t code_bytes(int64_t d) const;
  int64_t token_bytes(int64_t d) const { return (d * bits_ + n_ + 7) / 8; }
  static int64_t mask_bytes(int64_t d) { return (d + 7) / 8; }

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
  void check_head_dim(int64_t d, const std::string& where) const;
  /// `groups` groups of G rows × D (finite) → codes and float32 norms (2G per group; a norm past
  /// float32 is +Inf).
  void encode_groups(const float* x, int64_t groups, int64_t d, uint8_t* codes, float* meta) const;
  /// The inverse; a group whose mask does not hold exactly n channels (never written by encode)
  /// decodes to zeros.
  void decode_groups(const uint8_t* codes, const float* meta, int64_t groups, int64_t d, float* out) const;

  int bits_;
  int64_t n_, g_;
  bool nc_;
  int64_t seed_;
  mutable std::mutex mu_;
  mutable std::map<std::pair<int, int64_t>, std::shared_ptr<const std::vector<float>>> rotations_;
};

}  // namespace kvcache::quant
