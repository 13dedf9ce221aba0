// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file turboquant_quantizer.h (internal)
/// TurboQuant (Zandieh, Daliri, Hadian, Mirrokni; arXiv 2504.19874): a per-token format with no
/// per-group scale or zero. Each row x of D values (one token of one KV head) is stored as
///   - ‖x‖₂ (fp16), and
///   - the codes of y = H_D · diag(s) · (x / ‖x‖) (a seeded randomized Walsh–Hadamard rotation;
///     s ∈ {±1}^D; hadamard.h), each coordinate ≈ N(0, 1/D) for D large, quantized to the nearest
///     level of the fixed 2^m-level Lloyd–Max codebook of N(0, 1) scaled by 1/√D (lloyd_max.h).
///     Fractional bits (b = 1.5, 2.5, 3.5: TurboQuant's 2.5/3.5-bit settings): the first D/2
///     coordinates of y get ⌈m⌉ bits, the other D/2 ⌊m⌋ bits. After the rotation every
///     coordinate is alike, so which half gets the extra bit does not matter and no channel
///     indices are stored. The paper's own split, by *channels* (outliers at more bits, each set
///     quantized by its own TurboQuant instance), is `tq:b<b>:o<n>[:g<G>]`, a separate class
///     (turboquant_outlier.h; docs/quantizers.md, "TurboQuant").
/// Dequantize (`mse`): c_i = level[code_i]/√D; with `nc` (vLLM's norm correction) c ← c/‖c‖;
/// x̂ = ‖x‖ · diag(s) · H_D · c.
///
/// `prod` (TurboQuant-Prod, for keys: unbiased inner products): the above at m = b − 1 bits,
/// then the residual r = x − x̂_mse (of the stored, decoded x̂) is sketched by one bit per
/// coordinate, z = sign(S r) (sign(0) = +1), with S a seeded D × D matrix of i.i.d. N(0, 1)
/// entries, and γ = ‖r‖₂ (fp16). The reconstruction the generic attention path reads is
///   x̂ = x̂_mse + √(π/2)/D · γ · Sᵀ z,
/// so that E_S[⟨q, x̂⟩] = ⟨q, x⟩ for every q: for a Gaussian row g, E[sign(g·r)(g·q)] =
/// √(2/π)·⟨r, q⟩/‖r‖. Its variance is that of the 1-bit sketch (‖x̂ − x‖ grows: Prod trades
/// reconstruction error for unbiasedness; docs/quantizers.md, "TurboQuant").
///
/// Seeds: `seed` (default 42, vLLM's rotation seed of layer 0; vLLM uses 42 + 1337·layer): the
/// signs s are the bits of splitmix64(seed ⊕ 0x5157, i/64) (bit i mod 64); the sketch S entries
/// are Box–Muller normals from splitmix64(seed ⊕ 0x51e7, k). The same seed gives the same bytes
/// (on every platform: no std:: distributions).
///
/// Stored layout per row (group_tokens = 1): codes = ⌈D·m/8⌉ bytes of m-bit codes, LSB-first
/// (code i in bits [i·m, (i+1)·m) of the row's little-endian bit stream), then for `prod`
/// ⌈D/8⌉ bytes of sign bits (bit j = 1 iff (S r)_j ≥ 0); scales = ‖x‖ (and γ for `prod`) in
/// fp16; no zeros. Bits per value: (8·code_bytes + 16·meta_count)/D, e.g. `tq:b4` at D = 64:
/// 4.25, `tq:b3:prod` at D = 64: 3.5. D must be a power of two (InvalidArgument otherwise; no
/// padding). quantize() stores a tensor whose ‖x‖ or γ exceeds fp16 with fp32 metadata (as the
/// int formats do) and rejects a row whose ‖x‖ exceeds float32 (InvalidArgument naming it;
/// every |x| ≤ FLT_MAX/√D is safe); encode() reports such rows as EncodeStatus::overflow.
/// Decoding saturates at ±FLT_MAX.
///
/// Fused attention (KernelKind::kTurboQuant; src/cache/attend_fused.h) reads the codes as
/// stored: since x̂ = ‖x‖·f·diag(s)·H·c (f = 1/‖c‖ with `nc`, else 1) and diag(s)·H is
/// orthogonal, q·x̂ = ‖x‖·f·⟨H·diag(s)·q, c⟩: the query is rotated once per step and each key
/// costs one centroid lookup per coordinate (Tables::levels_lo/levels_hi); `prod` adds
/// √(π/2)/D·γ·⟨S q, z⟩ with S q computed once per step. Values are accumulated as
/// Σ p·‖v‖·f·c in the rotated domain and rotated back once per query row.

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvcache/quantizer.h"

namespace kvcache::quant {

enum class TurboMode { kMse, kProd };

class TurboQuantizer final : public Quantizer {
 public:
  /// The spec table of `tq` (fields b, o, g, mode mse|prod, nonc|nc, seed; o and g belong to
  /// TurboOutlierQuantizer, which the registry builds when either is given).
  static const ParamTable& table();

  /// `bits` ∈ {1, 1.5, 2, 2.5, 3, 3.5, 4}.
  /// @throws InvalidArgument for another `bits`, or bits < 2 for `prod` (its MSE stage has b − 1 bits).
  TurboQuantizer(double bits, TurboMode mode, bool norm_correction, int64_t seed);

  std::string spec() const override;
  double bits_per_value(int64_t head_dim) const override;

  double bits() const { return half_bits_ / 2.0; }
  TurboMode mode() const { return mode_; }
  /// The MSE stage's bits per coordinate: b (mse) or b − 1 (prod), possibly fractional. A
  /// fractional stage m = k + ½ codes the first D/2 rotated coordinates with k + 1 bits and the
  /// others with k (hi_bits(), lo_bits(), hi_count(D)).
  int lo_bits() const { return mse_half_bits() / 2; }
  int hi_bits() const { return lo_bits() + (mse_half_bits() % 2); }
  int64_t hi_count(int64_t d) const { return mse_half_bits() % 2 ? d / 2 : 0; }
  /// `nc`: the centroid vector is re-normalised before the inverse rotation.
  bool norm_correction() const { return nc_; }
  /// Bytes of the MSE stage's codes of one row (the sign bits of `prod` follow them).
  int64_t mse_code_bytes(int64_t d) const;

  /// The rotation's signs s (±1, D values) and, for `prod`, the sketch S (D × D row-major) for
  /// head_dim `d` (computed once per d). Exposed for tests.
  struct Tables {
    std::vector<float> signs;
    std::vector<float> sketch;
    /// The codebooks of the lo_bits() and hi_bits() coordinates as decode_rows() reads them
    /// (level·(1/√D), rounded to float32), each padded with zeros to 16 entries (the fused
    /// kernels' lane permutes index 16 lanes).
    std::vector<float> levels_lo, levels_hi;
  };
  std::shared_ptr<const Tables> tables(int64_t d) const;

  /// Encodes `rows` rows of D floats (finite, D a power of two) into `codes` (rows ×
  /// code_bytes(D) bytes) and `meta` (rows × meta_count float32: ‖x‖, and γ for `prod`; a row
  /// whose ‖x‖ exceeds float32 gets +Inf). `meta_fp16`: the metadata will be stored as fp16, so
  /// the residual of `prod` is taken against the decode with the fp16-rounded norm.
  void encode_rows(const float* x, int64_t rows, int64_t d, uint8_t* codes, float* meta, bool meta_fp16) const;
  /// Decodes rows written by encode_rows (meta as stored, converted to float32).
  void decode_rows(const uint8_t* codes, const float* meta, int64_t rows, int64_t d, float* out) const;

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
  int64_t code_bytes(int64_t d) const;
  int64_t meta_count() const { return mode_ == TurboMode::kProd ? 2 : 1; }
  int mse_half_bits() const { return mode_ == TurboMode::kProd ? half_bits_ - 2 : half_bits_; }

  int half_bits_;  ///< 2·b
  TurboMode mode_;
  bool nc_;
  int64_t seed_;
  mutable std::mutex mu_;
  mutable std::map<int64_t, std::shared_ptr<const Tables>> tables_;
};

}  // namespace kvcache::quant
