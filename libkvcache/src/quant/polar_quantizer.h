// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file polar_quantizer.h (internal)
/// PolarQuant (Han, Kacham, Karbasi, Mirrokni, Zandieh; arXiv 2502.02617; methods.md b.15): a
/// per-token format without per-group scale or zero. Each row x of D values (one token of one
/// KV head):
///   1. random preconditioning: y = H_D · diag(s) · x (TurboQuant's seeded randomized
///      Walsh–Hadamard rotation, computed in double so that no value overflows; seeds as
///      turboquant_quantizer.h: signs from splitmix64 stream 0x5157 of `seed`);
///   2. per block of 16 consecutive y values, a recursive polar transform over 4 levels:
///      level 1 turns the 8 pairs (y_2i, y_2i+1) into radii r_i and angles θ_i ∈ (−π, π];
///      level ℓ = 2, 3, 4 turns pairs of radii (a, b) of the level below into √(a² + b²) and
///      ψ = atan2(b, a) ∈ [0, π/2]; one radius ρ = ‖block‖ remains;
///   3. the 15 angles are quantized with fixed codebooks (no scale): level 1 θ with 4 bits,
///      the uniform 16-level grid (θ of a 2-D Gaussian is uniform); levels 2–4 ψ with 2 bits,
///      the 4-level Lloyd–Max quantizer of ψ's density for Gaussian input,
///      p(ψ) ∝ (sin ψ cos ψ)^(n−1), n = 2^(ℓ−1) (solved once on a grid; polar_codebook());
///      ρ is stored in fp16.
/// Bits per block: 8·4 + 4·2 + 2·2 + 1·2 = 46 code bits + 16 = 62: 3.875 bits per value.
/// Decoding runs the transform back from ρ and the angles' levels, then y → diag(s)·H_D·y.
///
/// Stored layout per row (group_tokens = 1): codes = ⌈46·D/16/8⌉ bytes, one LSB-first bit
/// stream of the D/16 blocks in order, each block's codes in the order level 1 (θ_0..θ_7, 4 bits
/// each), level 2 (4 × 2 bits), level 3 (2 × 2), level 4 (1 × 2); scales = D/16 fp16 radii; no
/// zeros. Bits per value (8·code_bytes + 16·D/16)/D: 3.875 at D = 64 or 128, 4 at D = 32.
/// D must be a power of two ≥ 16 (InvalidArgument otherwise; no padding). quantize() stores a
/// tensor with a radius past fp16 with fp32 radii and refuses a row whose radius exceeds float32
/// (naming it); encode() reports such rows as overflow. Decoding saturates at ±FLT_MAX.
/// Fused attention (KernelKind::kPolar) rebuilds each 16-value block in registers from ρ and
/// cos/sin tables against the query rotated once per step (kernel_tables()).

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvcache/quantizer.h"

namespace kvcache::quant {

/// The fixed angle codebook of level ℓ ∈ {1, 2, 3, 4}: levels ascending and the thresholds
/// between them (level 1: 16 levels on (−π, π]; 2–4: 4 levels on [0, π/2]), and its mean squared
/// error in rad² under the level's angle density (level 1: (2π/16)²/12).
struct PolarCodebook {
  std::vector<double> levels, thresholds;
  double mse = 0;
};
const PolarCodebook& polar_codebook(int level);

class PolarQuantizer final : public Quantizer {
 public:
  /// The spec table of `polar` (field seed).
  static const ParamTable& table();

  explicit PolarQuantizer(int64_t seed);

  std::string spec() const override;
  double bits_per_value(int64_t head_dim) const override;

  /// What the fused attention kernels read (KernelKind::kPolar; src/cache/attend_fused.h), per
  /// head_dim d (computed once): the preconditioning's signs s as float (x̂ = diag(s)·H·y, so
  /// q·x̂ = (H·diag(s)·q)·y), and the angle codebooks as cos/sin tables, rounded to float32:
  /// `angles` = [cos θ_0..15, sin θ_0..15] (level 1), then for levels 2, 3, 4 sixteen floats
  /// each, [cos ψ_0..3, sin ψ_0..3, 0 × 8]. A block's value i is ρ·Π_ℓ (cos or sin of level ℓ's
  /// angle over i), as decode_rows() runs the transform back.
  struct KernelTables {
    std::vector<float> signs;
    std::vector<float> angles;  ///< 80 floats
  };
  std::shared_ptr<const KernelTables> kernel_tables(int64_t d) const;

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
  static int64_t code_bytes(int64_t d) { return (46 * (d / 16) + 7) / 8; }
  std::shared_ptr<const std::vector<double>> signs(int64_t d) const;
  /// rows × D finite floats → codes and the float32 radii (+Inf past float32).
  void encode_rows(const float* x, int64_t rows, int64_t d, uint8_t* codes, float* radii) const;
  void decode_rows(const uint8_t* codes, const float* radii, int64_t rows, int64_t d, float* out) const;

  int64_t seed_;
  mutable std::mutex mu_;
  mutable std::map<int64_t, std::shared_ptr<const std::vector<double>>> signs_;
  mutable std::map<int64_t, std::shared_ptr<const KernelTables>> kernel_tables_;
};

}  // namespace kvcache::quant
