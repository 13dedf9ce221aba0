// SPDX-License-Identifier: Apache-2.0
// The fused attention kernels (attend_fused.h) for x86-64 with AVX2, FMA, F16C and BMI/BMI2:
// the build for CPUs without AVX-512 VNNI/VBMI (AMD EPYC before Zen 4, Intel client cores).
// This translation unit is compiled with those instructions enabled and is entered only
// through fused::scores / fused::accumulate after the dispatch (attend_fused.cpp) found them on
// the CPU: nothing in it may run at load time (no dynamic initialisers).
//
// Float-domain arithmetic, except for the int8 query. AVX2 has no VNNI, and vpmaddubsw
// saturates its int16 pair sums for 8-bit codes, so integer codes are converted to float32 in
// registers and multiplied with the float query QueryView::qf (never the two-term rounded query
// qt): the kernels compute what the generic path computes for q, to float32 rounding (summation
// order). With the int8 query (kvcache::set_attention_query("int8"): QueryView::one_term_*),
// 4- and 2-bit keys are dotted in the integer domain instead, as the AVX-512 kernels do:
// vpmaddubsw + vpmaddwd with the one-term int8 query (qk_int_q8; its comment proves that the
// int16 sums cannot saturate for codes ≤ 15).
//   - per-token integer keys: s = Σ_g s_g·(q_g·c_g) + z_g·Σ_{d∈g} q_d, the codes' dot once per
//     key and group (shared by all rows through the 8×8 transpose), then the group's scale and
//     zero (QueryView::qfsum holds Σ q per 32-dim chunk);
//   - per-channel integer keys: w = q ⊙ s folded per block, s = w·c + Σ_d q_d z_d;
//   - float formats (fp32, fp16, bf16, fp8 e4m3/e5m2 with the `scaled` tensor scale): converted
//     in registers, multiplied in float32;
//   - values: float formats and per-channel integers dequantized 16 dims at a time in
//     registers; per-token integers as Σ_j (p_j s_jG) c_jd + Σ_j p_j z_jG (pv_int_token).
// Tiling for 16 ymm registers: keys 8 at a time (an 8×8 transpose puts one dim of 8 keys in a
// register), up to 7 query rows per pass; p·v holds 16 dims × up to 7 rows of accumulators.
//
// Layouts read: as attend_avx512.cpp (docs/quantizers.md "Packing layout", StoredLayout).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cache/fused_abi.h"
#include "cache/fused_codes.h"
#include "cache/fused_loops.h"

namespace kvcache::cache::fused::avx2 {
namespace {

using Kind = KernelFormat::Kind;

constexpr int kRows = 7;  ///< query rows per pass

// ---------------------------------------------------------------- conversions

/// 8 fp8 e4m3 codes (the low 8 bytes) → 8 floats: the magnitude bits shifted left by 7 are an
/// fp16 whose value is the e4m3 value times 2^-8 exactly (normal and subnormal alike; see
/// attend_avx512.cpp's fp8_upper_to_half), the sign moves to bit 15, ×256 is exact.
inline __m256 e4m3_to_ps(__m128i codes) {
  const __m128i w = _mm_cvtepu8_epi16(codes);
  const __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(mag, sign)), _mm256_set1_ps(256.0f));
}

/// 8 stored values of a float format at `p` → 8 floats.
template <Kind K>
inline __m256 load8(const uint8_t* p) {
  if constexpr (K == Kind::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (K == Kind::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (K == Kind::kBF16) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else if constexpr (K == Kind::kE5M2) {
    // e5m2 is the upper byte of the fp16 with the same bits.
    const __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8);
    return _mm256_cvtph_ps(h);
  } else {
    static_assert(K == Kind::kE4M3);
    return e4m3_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
}


inline float hsum(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

/// Lanes [0, m) set.
inline __m256i lane_mask(int m) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline void store_row(float* dst, __m256 v, int m) {
  if (m == 8) {
    _mm256_storeu_ps(dst, v);
  } else {
    _mm256_maskstore_ps(dst, lane_mask(m), v);
  }
}

/// 8×8 float transpose in place: r[e] lane j = old r[j] element e.
KV_ALWAYS_INLINE void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int b = 0; b < 2; ++b) {  // u[4b + k]: rows 4b..4b+3 of columns k (low half), k + 4 (high)
    u[4 * b + 0] = _mm256_shuffle_ps(t[4 * b], t[4 * b + 2], 0x44);
    u[4 * b + 1] = _mm256_shuffle_ps(t[4 * b], t[4 * b + 2], 0xEE);
    u[4 * b + 2] = _mm256_shuffle_ps(t[4 * b + 1], t[4 * b + 3], 0x44);
    u[4 * b + 3] = _mm256_shuffle_ps(t[4 * b + 1], t[4 * b + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

// ---------------------------------------------------------------- integer codes


/// 16 codes of dims [16h, 16h + 16) of the per-channel token at `p`.
inline __m128i channel_codes16(const RawTokens& t, const ChanPos& p, int64_t h) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t.block + p.offset + 16 * h));
  if (t.kf.bits == 8) return b;
  return _mm_and_si128(_mm_srl_epi16(b, p.shift), _mm_set1_epi8(static_cast<char>((1 << t.kf.bits) - 1)));
}

/// 16 codes (bytes) → two vectors of 8 floats.
inline void codes16_to_ps(__m128i c, __m256& x0, __m256& x1) {
  x0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
  x1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c, 8)));
}

/// The fp16 words at `base` of group `gi` for 8 token slots (meta_count `mc` words per token:
/// the per-token scales or zeros), as floats. Eight ascending slots without holes are, for one
/// group per token, one 16-byte load; for two or four (head dim 64 or 128 in groups of 32), one
/// or two 32-byte loads, a dword permute and a word shift (the words are the gather's, so the
/// floats are too); otherwise a gather of the 32-bit words at their 2-byte offsets (the pool's
/// slab slack covers the last one, as in attend_avx512.cpp's meta16).
KV_ALWAYS_INLINE __m256 meta8(const uint8_t* base, const int32_t* slots, int m, int64_t mc, int64_t gi) {
  if (m == 8 && mc <= 4 && mc != 3 && slots[7] - slots[0] == 7) {
    const uint8_t* p = base + 2 * static_cast<int64_t>(slots[0]) * mc;
    if (mc == 1) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    // Token j's word gi: dword (j·mc + gi) / 2 of the 8·mc words from p, half gi mod 2.
    __m256i dw;
    if (mc == 2) {
      dw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    } else {  // mc == 4: tokens 0-3 in the first 32 bytes, 4-7 in the second
      const int g2 = static_cast<int>(gi >> 1);
      const __m256i idx = _mm256_setr_epi32(g2, 2 + g2, 4 + g2, 6 + g2, g2, 2 + g2, 4 + g2, 6 + g2);
      const __m256i a = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), idx);
      const __m256i b = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), idx);
      dw = _mm256_permute2x128_si256(a, b, 0x20);
    }
    const __m256i lo = (gi & 1) != 0 ? _mm256_srli_epi32(dw, 16) : _mm256_and_si256(dw, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)));
  }
  const __m256i lanes = lane_mask(m);
  const __m256i slot_v = _mm256_maskload_epi32(slots, lanes);
  const __m256i at = _mm256_add_epi32(_mm256_mullo_epi32(slot_v, _mm256_set1_epi32(static_cast<int>(mc))),
                                      _mm256_set1_epi32(static_cast<int>(gi)));
  const __m256i w = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(base), at, lanes, 2);
  const __m256i lo = _mm256_and_si256(w, _mm256_set1_epi32(0xFFFF));
  return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)));
}

// ---------------------------------------------------------------- q·k

/// The codes of chunk c (32 dims) of up to 8 keys (m of them; the rest zero), transposed as
/// dwords: kt[e] lane j holds key j's codes of dims 32c + 4e .. + 3, a byte each. Per-channel
/// keys read through their positions `pos`, per-token keys through their rows and `tc`.
/// Shared by the float query (qk_int) and the int8 query (qk_int_q8).
template <bool kChannel>
inline void key_chunk_t(const RawTokens& k, const int32_t* slots, int m, const ChanPos* pos, int64_t c,
                        const TokenChunk& tc, int bits, int64_t row_bytes, __m256 (&kt)[8]) {
  for (int j = 0; j < 8; ++j) {
    __m256i codes = _mm256_setzero_si256();
    if (j < m) {
      if constexpr (kChannel) {
        codes = channel_codes32(k, pos[j], c);
      } else {
        codes = chunk_codes32(k.block + static_cast<int64_t>(slots[j]) * row_bytes, tc, bits);
      }
    }
    kt[j] = _mm256_castsi256_ps(codes);
  }
  transpose8(kt);
}

/// Integer keys, 8 at a time: per 32-dim chunk the 8 keys' codes are transposed as dwords
/// (register e holds dims 4e..4e+3 of the 8 keys, a byte each), each byte plane converted to
/// float and multiplied with the broadcast float query. Per-token keys: the dot over a group is
/// scaled by the 8 keys' group scale, plus their zero × Σ_{d∈g} q_d. Per-channel keys: the
/// query is w = q ⊙ s (folded once per call), plus Σ_d q_d z_d.
template <int NR, bool kChannel>
void qk_int(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  const int64_t d = q.d, chunks = d / 32;
  const int64_t mc = k.kf.meta_count;
  const uint8_t* sc = k.block + k.kf.scales_offset;
  const uint8_t* ze = k.block + k.kf.zeros_offset;
  const float* qrow[NR];
  alignas(32) float wq[kChannel ? NR : 1][kChannel ? 256 : 1];
  float zr[NR] = {};
  float gsum[NR][8] = {};
  int64_t groups = 1, per_group = chunks;  // chunks per group
  if constexpr (kChannel) {
    for (int r = 0; r < NR; ++r) {
      const float* qf = q.qf + (r0 + r) * d;
      __m256 za = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 2 * i)));
        const __m256 z8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ze + 2 * i)));
        const __m256 q8 = _mm256_loadu_ps(qf + i);
        _mm256_store_ps(wq[r] + i, _mm256_mul_ps(q8, s8));
        za = _mm256_fmadd_ps(q8, z8, za);
      }
      zr[r] = hsum(za);
      qrow[r] = wq[r];
    }
  } else {
    per_group = min64(k.kf.group / 32, chunks);
    groups = chunks / per_group;
    for (int r = 0; r < NR; ++r) {
      qrow[r] = q.qf + (r0 + r) * d;
      const float* cs = q.qfsum + (r0 + r) * chunks;
      for (int64_t gi = 0; gi < groups; ++gi) {
        float t = 0.0f;
        for (int64_t c = gi * per_group; c < (gi + 1) * per_group; ++c) t += cs[c];
        gsum[r][gi] = t;
      }
    }
  }
  TokenChunk tc[8];
  if constexpr (!kChannel) {
    for (int64_t c = 0; c < chunks; ++c) tc[c] = token_chunk(k.kf, c);
  }
  const int bits = k.kf.bits;
  const int64_t row_bytes = k.kf.code_bytes;
  const __m256i byte = _mm256_set1_epi32(0xFF);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int m = static_cast<int>(min64(8, n - j0));
    const int32_t* slots = k.slots + j0;
    __m256 out[NR];
    for (int r = 0; r < NR; ++r) out[r] = _mm256_set1_ps(zr[r]);
    ChanPos pos[8];
    if constexpr (kChannel) {
      for (int j = 0; j < m; ++j) pos[j] = chan_pos(k, slots[j]);
    }
    for (int64_t gi = 0; gi < groups; ++gi) {
      __m256 dot[NR];
      for (int r = 0; r < NR; ++r) dot[r] = _mm256_setzero_ps();
      for (int64_t c = gi * per_group; c < (gi + 1) * per_group; ++c) {
        __m256 kt[8];
        key_chunk_t<kChannel>(k, slots, m, pos, c, tc[c], bits, row_bytes, kt);
#pragma GCC unroll 8
        for (int e = 0; e < 8; ++e) {
          const __m256i x = _mm256_castps_si256(kt[e]);
#pragma GCC unroll 4
          for (int b = 0; b < 4; ++b) {
            const __m256i cb = b == 3 ? _mm256_srli_epi32(x, 24) : _mm256_and_si256(_mm256_srli_epi32(x, 8 * b), byte);
            const __m256 kf = _mm256_cvtepi32_ps(cb);
            const int64_t dim = 32 * c + 4 * e + b;
            for (int r = 0; r < NR; ++r) dot[r] = _mm256_fmadd_ps(kf, _mm256_broadcast_ss(qrow[r] + dim), dot[r]);
          }
        }
      }
      if constexpr (kChannel) {
        for (int r = 0; r < NR; ++r) out[r] = _mm256_add_ps(out[r], dot[r]);
      } else {
        const __m256 sv = meta8(sc, slots, m, mc, gi);
        const __m256 zv = meta8(ze, slots, m, mc, gi);
        for (int r = 0; r < NR; ++r) {
          out[r] = _mm256_fmadd_ps(dot[r], sv, _mm256_fmadd_ps(zv, _mm256_set1_ps(gsum[r][gi]), out[r]));
        }
      }
    }
    for (int r = 0; r < NR; ++r) store_row(s + r * ld + j0, out[r], m);
  }
}

/// Lanes [0, 8) of `v` reduced with max (exact: max neither rounds nor depends on the order).
inline float hmax(__m256 v) {
  const __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
}

/// Integer keys with the int8 query (kvcache::set_attention_query("int8"); the AVX-512 kernels'
/// qk_int<.., kOne = true>, without VNNI): per 32-dim chunk the 8 keys' codes are transposed as
/// dwords (register e holds dims 4e..4e+3 of the 8 keys, a byte each, as in qk_int), and each
/// register is multiplied with the broadcast four int8 query terms of those dims by vpmaddubsw
/// (unsigned code × signed term, adjacent pairs summed to int16); the chunk's eight int16 sums
/// per key are widened once by vpmaddwd (pairs summed to int32). The query terms, scales and
/// zero sums are the AVX-512 path's, and so is the algebra:
///   per-token keys: the high terms qh = round(q/qs) of QueryView::qt, per chunk
///     s += (Σ qh·c)·s_g·qs + z_g·Σ qs·qh (qsum1), the same two FMAs in the same order, so
///     the scores are the AVX-512 kernels' bit for bit (the integer dot is exact either way);
///   per-channel keys: w = q ⊙ s folded per block and rounded per chunk as the AVX-512 fold
///     rounds it (ws = max|w|/127, or 1 for a zero chunk; hi = round(w·(1/ws)), half to even),
///     s = Σ_d q_d z_d + Σ_c ws_c·(Σ hi·c): the same terms; only Σ q z is summed in another
///     order (8 lanes, not 16), a float32 rounding difference.
///
/// Why the 16-bit sums cannot saturate (vpmaddubsw saturates its pair sums to int16; the adds
/// below wrap), for the code widths this kernel is used for (kInt8QueryAvx2Bits: 4 and 2 bits):
/// a code is 0 ≤ c ≤ 2^b − 1 ≤ 15 and a query term |t| ≤ 127 (prepare() and the fold clamp or
/// round to ±127), so one pair sum is |c0·t0 + c1·t1| ≤ 2·15·127 = 3,810, and an int16 lane
/// of the chunk's accumulator adds the pair sums of its two dims over e = 0..7, 16 products:
/// |Σ| ≤ 16·15·127 = 30,480 < 32,767 (2-bit codes: 16·3·127 = 6,096). Every partial sum is
/// exact, and vpmaddwd's int32 sums (≤ 32·15·127 = 60,960 per chunk) are exact in float32
/// (< 2^24). 8-bit codes would reach 2·255·127 = 64,770 in one pair sum: saturation, so 8-bit
/// keys keep the float query (qk_int) even where the int8 query is asked for everywhere.
template <int NR, bool kChannel>
void qk_int_q8(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  const int64_t d = q.d, chunks = d / 32;
  const int64_t mc = k.kf.meta_count;
  const uint8_t* sc = k.block + k.kf.scales_offset;
  const uint8_t* ze = k.block + k.kf.zeros_offset;
  // The int8 terms of chunk c, row r at qt[c] + kStride·r: QueryView::qt's high terms (row
  // stride 64: high, then low terms) for per-token keys, the fold's wt for per-channel keys.
  constexpr int64_t kStride = kChannel ? 32 : 64;
  const int8_t* qt[8];
  const float* qs[NR];
  const float* qsum[NR];
  float ws[kChannel ? NR : 1][8];
  float wz[NR] = {};
  alignas(32) int8_t wt[kChannel ? 8 : 1][NR][32];
  if constexpr (kChannel) {
    __m256 zr[NR];
    for (int r = 0; r < NR; ++r) zr[r] = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t c = 0; c < chunks; ++c) {
      __m256 s8[4], z8[4];
      for (int i = 0; i < 4; ++i) {
        s8[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 64 * c + 16 * i)));
        z8[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ze + 64 * c + 16 * i)));
      }
      for (int r = 0; r < NR; ++r) {
        const float* qf = q.qf + (r0 + r) * d + 32 * c;
        __m256 w[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          const __m256 q8 = _mm256_loadu_ps(qf + 8 * i);
          w[i] = _mm256_mul_ps(q8, s8[i]);
          zr[r] = _mm256_fmadd_ps(q8, z8[i], zr[r]);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, w[i]));
        }
        // The AVX-512 fold's scale and reciprocal (IEEE division, rounded once, as there).
        const float mx = hmax(amax);
        const float scale = mx > 0.0f ? mx / 127.0f : 1.0f;
        const __m256 inv = _mm256_set1_ps(1.0f / scale);
        __m256i h[4];
        for (int i = 0; i < 4; ++i) h[i] = _mm256_cvtps_epi32(_mm256_mul_ps(w[i], inv));  // |h| ≤ 127
        // int32 → int8: the packs interleave the 128-bit lanes (dwords a0-3 b0-3 c0-3 d0-3 |
        // a4-7 b4-7 c4-7 d4-7); the permute restores dims 0..31.
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(h[0], h[1]), _mm256_packs_epi32(h[2], h[3]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(wt[c][r]), _mm256_permutevar8x32_epi32(b, order));
        ws[r][c] = scale;
      }
      qt[c] = wt[c][0];
    }
    for (int r = 0; r < NR; ++r) {
      wz[r] = hsum(zr[r]);
      qs[r] = ws[r];
    }
  } else {
    for (int64_t c = 0; c < chunks; ++c) qt[c] = q.qt + (c * q.rows + r0) * 64;
    for (int r = 0; r < NR; ++r) {
      qs[r] = q.qs + (r0 + r) * chunks;
      qsum[r] = q.qsum1 + (r0 + r) * chunks;
    }
  }
  TokenChunk tc[8];
  int64_t gic[8];
  if constexpr (!kChannel) {
    for (int64_t c = 0; c < chunks; ++c) {
      tc[c] = token_chunk(k.kf, c);
      gic[c] = 32 * c / k.kf.group;
    }
  }
  const int bits = k.kf.bits;
  const int64_t row_bytes = k.kf.code_bytes;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int m = static_cast<int>(min64(8, n - j0));
    const int32_t* slots = k.slots + j0;
    __m256 out[NR];
    for (int r = 0; r < NR; ++r) out[r] = _mm256_set1_ps(wz[r]);  // per-token: 0
    ChanPos pos[8];
    if constexpr (kChannel) {
      for (int j = 0; j < m; ++j) pos[j] = chan_pos(k, slots[j]);
    }
    __m256 sv = _mm256_setzero_ps(), zv = _mm256_setzero_ps();
    int64_t sv_group = -1;
    for (int64_t c = 0; c < chunks; ++c) {
      __m256 kt[8];
      key_chunk_t<kChannel>(k, slots, m, pos, c, tc[c], bits, row_bytes, kt);
      if constexpr (!kChannel) {
        // The 8 keys' scale and zero of the group holding this chunk (read once per group).
        if (gic[c] != sv_group) {
          sv_group = gic[c];
          sv = meta8(sc, slots, m, mc, sv_group);
          zv = meta8(ze, slots, m, mc, sv_group);
        }
      }
      const int8_t* qc = qt[c];
      // Row by row, so that only the 8 code registers and one row's sums are live (rows inside
      // the dims loop held NR int16 accumulators beside them, and GCC spilled every product).
      for (int r = 0; r < NR; ++r) {
        __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int e = 0; e < 8; ++e) {
          int32_t t4;
          std::memcpy(&t4, qc + kStride * r + 4 * e, 4);
          acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(_mm256_castps_si256(kt[e]), _mm256_set1_epi32(t4)));
        }
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc, ones));
        if constexpr (kChannel) {
          out[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(qs[r][c]), out[r]);
        } else {
          out[r] = _mm256_fmadd_ps(_mm256_mul_ps(dot, sv), _mm256_set1_ps(qs[r][c]), out[r]);
          out[r] = _mm256_fmadd_ps(zv, _mm256_set1_ps(qsum[r][c]), out[r]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) store_row(s + r * ld + j0, out[r], m);
  }
}

// ---------------------------------------------------------------- the shared loops' traits

/// What fused_loops.h's loops (qk_float, p·v) need of this unit: 8 lanes, kRows query rows.
struct Lanes256 {
  using F = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kRows = fused::avx2::kRows;
  /// Rows per p·v pass: a pass holds 2 accumulators per row, the two value registers and the
  /// weight's broadcast, 2·NR + 3 of the 16 ymm registers. At 7 rows (17) GCC kept one
  /// accumulator on the stack, and the store-to-load round trip of that FMA chain set the
  /// loop's pace (perf annotate of pv_rows_impl<7, fp16>: 65 % of its samples on that FMA);
  /// 7 rows now run as 4 + 3 (float values: fused_loops.h's accumulate_rows; integer values:
  /// pv_span, from a span dequantized once); codebook values keep one 7-row pass (pv_span).
  static constexpr int kPvRows = 6;
  /// load8<kE4M3> returns the e4m3 value itself (its ×256 is in the conversion).
  static constexpr float kE4m3Weight = 1.0f;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_load_ps(p); }
  static F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_store_ps(p, v); }
  static void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F load_first(const float* p, int m) { return _mm256_maskload_ps(p, lane_mask(m)); }
  static void store_row(float* p, F v, int m) { fused::avx2::store_row(p, v, m); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static float hsum(F v) { return fused::avx2::hsum(v); }
  KV_ALWAYS_INLINE static void transpose(F (&r)[8]) { transpose8(r); }
  static F meta(const uint8_t* base, const int32_t* slots, int m, int64_t mc, int64_t gi) {
    return meta8(base, slots, m, mc, gi);
  }
  template <Kind K>
  static F load_values(const uint8_t* p) { return load8<K>(p); }
  template <Kind K>
  static void fp8_values(const uint8_t* p, F& x0, F& x1) {
    x0 = load8<K>(p);
    x1 = load8<K>(p + 8);
  }
  static void channel_codes(const RawTokens& v, const ChanPos& pos, int64_t span, F& x0, F& x1) {
    codes16_to_ps(channel_codes16(v, pos, span), x0, x1);
  }
  /// Dims [at, at + 16): one half of the 32-dim chunk's codes.
  static void token_codes(const uint8_t* row, const TokenChunk& tc, int bits, int64_t at, F& x0, F& x1) {
    const __m256i codes = chunk_codes32(row, tc, bits);
    codes16_to_ps(at % 32 == 0 ? _mm256_castsi256_si128(codes) : _mm256_extracti128_si256(codes, 1), x0, x1);
  }  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  /// TurboQuant: a region's codebook (16 entries: two 8-lane halves) and the lane shifts that
  /// unpack 8 codes of `bits` bits from one 32-bit word.
  struct TqLut {
    __m256 lo, hi;
    __m256i shifts, mask;
    bool wide;  ///< 16 levels: two permutes and a blend on the code's bit 3
  };
  static TqLut tq_lut(const float* levels16, int bits) {
    TqLut t;
    t.lo = _mm256_loadu_ps(levels16);
    t.hi = _mm256_loadu_ps(levels16 + 8);
    t.shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
    t.mask = _mm256_set1_epi32((1 << bits) - 1);
    t.wide = bits == 4;
    return t;
  }
  /// The centroids of the 8 codes at p (bits bytes; 4 are loaded: the bytes after a row's codes
  /// are its block's, or the pool slab's 64 bytes of slack after the last block).
  static F tq_centroids(const uint8_t* p, const TqLut& t) {
    int32_t w;
    std::memcpy(&w, p, sizeof w);
    const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), t.shifts), t.mask);
    const __m256 v = _mm256_permutevar8x32_ps(t.lo, idx);
    if (!t.wide) return v;
    return _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(t.hi, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
  }
  /// PolarQuant: the level-1 cos and sin tables (16 each, as 8-lane halves) and levels 2–4's
  /// [cos ×4, sin ×4].
  struct PolarLut {
    __m256 c1lo, c1hi, s1lo, s1hi, t2, t3, t4;
  };
  static PolarLut polar_lut(const float* a) {
    return {_mm256_loadu_ps(a),      _mm256_loadu_ps(a + 8),  _mm256_loadu_ps(a + 16), _mm256_loadu_ps(a + 24),
            _mm256_loadu_ps(a + 32), _mm256_loadu_ps(a + 48), _mm256_loadu_ps(a + 64)};
  }
  /// Dims [c, c + 8) (half of block c/16) without ρ; lane i of the block as attend_avx512.cpp's
  /// polar_chunk. 8 bytes are loaded from the block's first code byte (7 needed: the bytes after
  /// a row's codes are its block's, or the pool slab's slack).
  KV_ALWAYS_INLINE static F polar_chunk(const uint8_t* row, int64_t c, const PolarLut& t) {
    const int64_t bit = 46 * (c / 16);
    uint64_t w;
    std::memcpy(&w, row + bit / 8, sizeof w);
    w >>= bit % 8;
    const __m256i lane = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(c % 16)));
    const __m256i lo = _mm256_set1_epi32(static_cast<int>(w & 0xFFFFFFFFu));
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(w >> 32));
    const __m256i three = _mm256_set1_epi32(3);
    const __m256i i1 = _mm256_and_si256(_mm256_srlv_epi32(lo, _mm256_slli_epi32(_mm256_srli_epi32(lane, 1), 2)),
                                        _mm256_set1_epi32(15));
    const __m256 wide = _mm256_castsi256_ps(_mm256_slli_epi32(i1, 28));  // code bit 3: the upper 8 entries
    const __m256 cv = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.c1lo, i1), _mm256_permutevar8x32_ps(t.c1hi, i1), wide);
    const __m256 sv = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.s1lo, i1), _mm256_permutevar8x32_ps(t.s1hi, i1), wide);
    __m256 y = _mm256_blend_ps(cv, sv, 0xAA);  // odd lanes (c is even): sin
    const auto level = [&](const __m256& tab, int offset, int shift) {
      const __m256i code = _mm256_and_si256(
          _mm256_srlv_epi32(hi, _mm256_add_epi32(_mm256_set1_epi32(offset),
                                                 _mm256_slli_epi32(_mm256_srli_epi32(lane, shift), 1))),
          three);
      const __m256i sel = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(lane, shift - 1), _mm256_set1_epi32(1)), 2);
      return _mm256_permutevar8x32_ps(tab, _mm256_or_si256(code, sel));
    };
    y = _mm256_mul_ps(y, level(t.t2, 0, 2));
    y = _mm256_mul_ps(y, level(t.t3, 8, 3));
    return _mm256_mul_ps(y, level(t.t4, 12, 4));
  }
  /// 8 sign bits at p (bit j set: +1) as ±1.0f.
  static F signs_pm1(const uint8_t* p) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(*p), bit), bit);
    return _mm256_blendv_ps(_mm256_set1_ps(-1.0f), _mm256_set1_ps(1.0f), _mm256_castsi256_ps(set));
  }
};

template <int NR>
void qk(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  switch (k.kf.kind) {
    case Kind::kF32: return qk_float<Lanes256, NR, Kind::kF32>(q, r0, k, n, s, ld);
    case Kind::kF16: return qk_float<Lanes256, NR, Kind::kF16>(q, r0, k, n, s, ld);
    case Kind::kBF16: return qk_float<Lanes256, NR, Kind::kBF16>(q, r0, k, n, s, ld);
    case Kind::kE4M3: return qk_float<Lanes256, NR, Kind::kE4M3>(q, r0, k, n, s, ld);
    case Kind::kE5M2: return qk_float<Lanes256, NR, Kind::kE5M2>(q, r0, k, n, s, ld);
    // The int8 query where it is asked for and the codes fit vpmaddubsw (qk_int_q8).
    case Kind::kIntToken:
      if (((q.one_term_token & kInt8QueryAvx2Bits) >> k.kf.bits) & 1u) return qk_int_q8<NR, false>(q, r0, k, n, s, ld);
      return qk_int<NR, false>(q, r0, k, n, s, ld);
    case Kind::kIntChannel:
      if (((q.one_term_channel & kInt8QueryAvx2Bits) >> k.kf.bits) & 1u) return qk_int_q8<NR, true>(q, r0, k, n, s, ld);
      return qk_int<NR, true>(q, r0, k, n, s, ld);
    case Kind::kTurboQuant: return qk_tq<Lanes256, NR>(q, r0, k, n, s, ld);
    case Kind::kQjl: return qk_qjl<Lanes256, NR>(q, r0, k, n, s, ld);
    case Kind::kPolar: return qk_polar<Lanes256, NR>(q, r0, k, n, s, ld);
    case Kind::kNone: break;
  }
}

}  // namespace

void scores(const QueryView& q, int64_t r0, int64_t nr, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  for_row_groups<kRows>(nr, [&](auto rows, int64_t g) { qk<decltype(rows)::value>(q, r0 + g, k, n, s + g * ld, ld); });
}

void accumulate(const float* p, int64_t ld, int64_t nr, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  accumulate_rows<Lanes256>(p, ld, nr, v, n, d, acc);
}

}  // namespace kvcache::cache::fused::avx2
