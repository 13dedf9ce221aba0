// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file fused_abi.h (internal)
/// The plain-data interface between the attention orchestration and the fused kernels
/// (attend_fused.h). The kernels' translation units (attend_avx512.cpp, attend_avx2.cpp) are
/// compiled for AVX-512 (or AVX2) and include nothing but this header, fused_codes.h (whose
/// helpers have internal linkage), <immintrin.h> and <cstdint>/<cstring>: an inline function
/// of a shared header compiled there could be picked by the linker for the whole library and
/// run on a CPU without those instructions.

#include <cstdint>

namespace kvcache::cache::fused {

/// The largest QJL sketch (m bits per key) the fused kernels read (their per-row buffers of S·q
/// are sized for it); a larger m takes the generic path.
inline constexpr int64_t kMaxQjlSketch = 1024;

/// What a fused kernel needs to know about a block format (filled by classify()).
struct KernelFormat {
  enum class Kind : uint8_t { kNone, kF32, kF16, kBF16, kE4M3, kE5M2, kIntToken, kIntChannel, kTurboQuant, kQjl, kPolar };
  Kind kind = Kind::kNone;
  int bits = 0;          ///< integer formats: 8, 4, 2
  int64_t group = 0;     ///< integer formats: group size (values per token, or tokens per channel)
  bool scaled = false;   ///< fp8 with a per-stream scale
  int64_t head_dim = 0;  ///< D
  int64_t code_bytes = 0, meta_count = 0;  ///< StoredLayout of one group
  int64_t scales_offset = 0, zeros_offset = 0;  ///< byte offsets of the metadata regions
  /// kTurboQuant (quant/turboquant_quantizer.h): code i of a row (LSB-first bit stream) has
  /// tq_hi bits for i < tq_n_hi and tq_lo bits after; the scales are ‖x‖ (and γ: tq_prod) per
  /// token. The tables belong to the quantizer (live as long as the cache's formats).
  int tq_hi = 0, tq_lo = 0;
  int64_t tq_n_hi = 0;
  int64_t tq_mse_bytes = 0;  ///< bytes of the codes; for tq_prod the D sign bits follow
  bool tq_nc = false;        ///< norm correction: scores and values × 1/‖c‖
  bool tq_prod = false;      ///< TurboQuant-Prod keys: + √(π/2)/D · γ · ⟨S q, z⟩
  const float* tq_levels_hi = nullptr;  ///< 16 floats (codebook · 1/√D, zero-padded)
  const float* tq_levels_lo = nullptr;
  const float* rot_signs = nullptr;     ///< D signs s of the rotation diag(s)·H (x̂ = ‖x‖·diag(s)·H·c; kPolar too)
  const float* polar_angles = nullptr;  ///< kPolar: 80 floats (quant::PolarQuantizer::KernelTables::angles)
  const float* sketch = nullptr;        ///< tq_prod: S, D × D row-major; kQjl: S, qjl_m × D row-major
  /// kQjl: Sᵀ, D × qjl_m row-major (S's columns contiguous), built once by the quantizer
  /// (quant::QjlKeyQuantizer::sketch_tables) and lives as long as it.
  const float* sketch_t = nullptr;
  /// kQjl (quant/qjl_quantizer.h; `group` = g tokens per group, one group's codes are
  /// code_bytes: qjl_o outlier indices, then per token (qjl_m + qjl_mo)/8 sign bytes; scales
  /// 2 fp16 per token, ‖k_in‖ and ‖k_out‖).
  int64_t qjl_m = 0, qjl_mo = 0, qjl_o = 0;
};

/// One stream's tokens of a tile, as stored: `n` live slots of one block.
struct RawTokens {
  const uint8_t* block = nullptr;
  KernelFormat kf;
  const int32_t* slots = nullptr;  ///< slot indices (increasing)
  float tensor_scale = 1.0f;       ///< the stream's scale (fp8:*:scaled main blocks), else 1
};

/// The step's query rows of one KV head: float rows scaled by 1/√D and, for integer keys,
/// their two-term int8 form in chunks of 32 dims: q ≈ q' = qs·(qh + ql/kLowSteps), with
/// qh = round(q/qs) and ql = round((q − qs·qh)·kLowSteps/qs), qs = max|q|/127 over the chunk
/// (1 for a zero chunk). |q − q'| ≤ max|q|/(2·127·kLowSteps) ≈ 1.6e-5·max|q|: below fp16's
/// rounding, so integer keys are read with VNNI at float accuracy.
/// The terms are laid out as the VNNI loop reads them (chunk-major, then row: the 32 high
/// terms, then the 32 low terms), so that the kernel broadcasts them from constant offsets of
/// one base pointer per chunk and builds no table per block.
inline constexpr float kLowSteps = 254.0f;
struct QueryView {
  int64_t rows = 0, d = 0;
  const float* qf = nullptr;    ///< `[rows, d]` q / √D
  const int8_t* qt = nullptr;   ///< `[d/32, rows, 2, 32]` the chunk's high terms, then its low terms
  const float* qs = nullptr;    ///< `[rows, d/32]` chunk scales
  const float* qsum = nullptr;  ///< `[rows, d/32]` Σ q' over the chunk (of the rounded query)
  const float* qfsum = nullptr; ///< `[rows, d/32]` Σ qf over the chunk (the float query: AVX2 kernels)
  const float* qsum1 = nullptr; ///< `[rows, d/32]` Σ qs·qh over the chunk (the one-term query)
  /// The int8 query (kvcache::set_attention_query("int8")): bit b set when b-bit per-token
  /// (one_term_token) or per-channel (one_term_channel) integer keys are dotted with the high
  /// term alone, q ≈ qs·qh (llama.cpp's q8 rounding; the AVX-512 kernels, and the AVX2 ones for
  /// the widths of kInt8QueryAvx2Bits). 0: two terms (AVX2: the float query).
  uint32_t one_term_token = 0, one_term_channel = 0;
  /// TurboQuant keys (fused::rotate_queries): `[rows, d]` H·diag(s)·qf, the rotated query
  /// (qrot), and for Prod keys S·qf (qsketch, `[rows, d]`); QJL keys: qsketch = S·qf,
  /// `[rows, qjl_m]`. Null when the layer's keys are neither.
  const float* qrot = nullptr;
  const float* qsketch = nullptr;
  const float* sketch_t = nullptr;  ///< QJL keys: Sᵀ, `[d, qjl_m]` (the outlier columns of S, contiguous): KernelFormat::sketch_t
};

/// The key code widths (bit b: b-bit codes) for which the AVX2 kernels can take the int8 query:
/// their vpmaddubsw products of codes ≤ 15 and terms ≤ 127 sum to int16 without saturating
/// (attend_avx2.cpp, qk_int_q8); 8-bit codes could saturate and keep the float query there.
inline constexpr uint32_t kInt8QueryAvx2Bits = (1u << 4) | (1u << 2);

namespace avx512 {
/// s[r·ld + j] = q_{r0+r} · k_j / √D for r < nr, j < n.
void scores(const QueryView& q, int64_t r0, int64_t nr, const RawTokens& k, int64_t n, float* s, int64_t ld);
/// acc[r·d + :] += Σ_j p[r·ld + j] · v_j for r < nr, j < n. TurboQuant values (kTurboQuant):
/// acc is the rotated-domain accumulator, acc += Σ_j p_j·‖v_j‖·f_j·c_j (attend_fused.h).
void accumulate(const float* p, int64_t ld, int64_t nr, const RawTokens& v, int64_t n, int64_t d, float* acc);
}  // namespace avx512

namespace avx2 {
/// As avx512::scores, in the float domain (attend_avx2.cpp): reads QueryView::qf and qfsum only,
/// but for the int8 query (one_term_*: 4- and 2-bit keys, kInt8QueryAvx2Bits), which reads the
/// high terms of qt, qs and qsum1 as the AVX-512 kernels do.
void scores(const QueryView& q, int64_t r0, int64_t nr, const RawTokens& k, int64_t n, float* s, int64_t ld);
/// As avx512::accumulate.
void accumulate(const float* p, int64_t ld, int64_t nr, const RawTokens& v, int64_t n, int64_t d, float* acc);
}  // namespace avx2

}  // namespace kvcache::cache::fused
