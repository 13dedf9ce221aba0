// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file qjl_quantizer.h (internal)
/// QJL keys (Zandieh, Daliri, Han; arXiv 2406.03482; methods.md b.15): the 1-bit
/// Johnson–Lindenstrauss sketch of each key, built by the `qjl` cache scheme
/// (src/cache/codebook_schemes.h) and stored in groups of g consecutive tokens of one KV head.
///
/// Sketch S (m × D, from the seed): i.i.d. N(0, 1) entries (seeded_random.h, stream 0x9a1),
/// orthogonalised in blocks of D rows (rows [iD, (i+1)D) made orthonormal by modified
/// Gram–Schmidt in double: the Q of a QR), every row then scaled to norm √D; a last partial
/// block keeps its first m mod D orthonormalised rows. The outlier sketch S_o is S's first m_o rows.
///
/// Per group of g tokens: the o channels with the largest Σ_t k_t,c² (ties: the lower index) are
/// the group's outliers (stored as o uint8 indices; D ≤ 256). Per token, k_in = k with the
/// outliers zeroed, k_out = k on the outliers only; stored: z = sign(S k_in) (m bits),
/// z_o = sign(S_o k_out) (m_o bits; sign(0) = +1), ‖k_in‖ and ‖k_out‖ (fp16).
///
/// Estimator (the reference kernel's): q·k ≈ √(π/2)/m · ‖k_in‖ · ⟨S q_in, z⟩ +
/// √(π/2)/m_o · ‖k_out‖ · ⟨S_o q_out, z_o⟩ (q_in, q_out: q on the inlier / outlier channels; the
/// reference applies S to the whole q, which has the same mean and more variance). The generic
/// path reads the reconstruction k̂ = √(π/2)/m · ‖k_in‖ · P_in Sᵀ z + √(π/2)/m_o · ‖k_out‖ · P_out S_oᵀ z_o
/// (P: the channel masks), so ⟨q, k̂⟩ is that estimate. With rows of norm √D the constant
/// √(π/2)/m is unbiased up to the factor √D·Γ(D/2)/(√π·Γ((D+1)/2))·√(π/2) = 1 + 1/(4D) + O(D⁻²)
/// (a Gaussian row's norm varies; an orthogonalised row's is fixed); √(π/2/D) is not
/// (docs/quantizers.md, "QJL"; tests/quant_qjl_test.cpp).
///
/// Stored layout (group_tokens = g, axis per channel: a group spans g tokens): codes = o index
/// bytes, then per token m/8 + m_o/8 bytes of sign bits (bit j of the token's stream set iff
/// (S k_in)_j ≥ 0, LSB first, then the outlier bits); scales = 2g fp16 (‖k_in‖, ‖k_out‖ per token);
/// no zeros. Bits per value (8·(o + g·(m + m_o)/8) + 32·g)/(g·D).
///
/// Fused attention (KernelKind::kQjl; src/cache/attend_fused.h) computes the estimate from the
/// stored bits: S·q once per step and query row; per group S q_in = S q − Σ_{c∈out} q_c S[:, c]
/// and S_o q_out = Σ_{c∈out} q_c S_o[:, c] (o columns); per key the two sign dots.

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvcache/quantizer.h"

namespace kvcache::quant {

struct QjlParams {
  int64_t sketch = 256;          ///< m, a multiple of 8
  int64_t outlier_sketch = 64;   ///< m_o, a multiple of 8, ≤ m (0 only when outliers == 0)
  int64_t outliers = 8;          ///< o outlier channels per group, < D
  int64_t group = 32;            ///< g tokens per group
  int64_t seed = 42;
};

class QjlKeyQuantizer final : public Quantizer {
 public:
  /// `name`: spec() (the scheme's canonical spec + " keys").
  /// @throws InvalidArgument for m or m_o not a positive multiple of 8 (m_o may be 0 when o = 0),
  ///         m_o > m, o < 0, g < 1.
  QjlKeyQuantizer(const QjlParams& p, std::string name);

  std::string spec() const override { return name_; }
  double bits_per_value(int64_t head_dim) const override;
  GroupAxis group_axis() const override { return GroupAxis::kPerChannel; }

  /// The sketch S (m × D row-major) for head_dim d (computed once per d). Exposed for tests.
  std::shared_ptr<const std::vector<float>> sketch(int64_t d) const;
  /// S and its transpose for head_dim d, built together once per d (thread-safe; they live as
  /// long as the quantizer): the fused kernels read Sᵀ's rows (S's columns, contiguous) for the
  /// outlier channels and multiply q with it (KernelFormat::sketch_t), so no step transposes S.
  struct Sketch {
    std::vector<float> s;    ///< S, m × D row-major
    std::vector<float> s_t;  ///< Sᵀ, D × m row-major
  };
  std::shared_ptr<const Sketch> sketch_tables(int64_t d) const;
  const QjlParams& params() const { return p_; }

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
  int64_t code_bytes(int64_t d) const;
  /// `groups` groups of g rows × D (finite) → codes and float32 norms (2g per group).
  void encode_groups(const float* x, int64_t groups, int64_t d, uint8_t* codes, float* meta) const;
  void decode_groups(const uint8_t* codes, const float* meta, int64_t groups, int64_t d, float* out) const;

  QjlParams p_;
  std::string name_;
  mutable std::mutex mu_;
  mutable std::map<int64_t, std::shared_ptr<const Sketch>> sketches_;
};

}  // namespace kvcache::quant
