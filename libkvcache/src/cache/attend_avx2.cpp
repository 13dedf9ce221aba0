// SPDX-License-Identifier: Apache-2.0
// The fused attention kernels (attend_fused.h) for x86-64 with AVX2, FMA, F16C and BMI/BMI2:
// the build for CPUs without AVX-512 VNNI/VBMI (AMD EPYC before Zen 4, Intel client cores).
// This translation unit is compiled with those instructions enabled and is entered only
// through fused::scores / fused::accumulate after the dispatch (attend_fused.cpp) found them on
// the CPU: nothing in it may run at load time (no dynamic initialisers).
//
// Float-domain arithmetic throughout. AVX2 has no VNNI, and vpmaddubsw saturates its int16
// pair sums for 8-bit codes, so integer codes are converted to float32 in registers and
// multiplied with the float query QueryView::qf (never the two-term rounded query qt): the
// kernels compute what the generic path computes for q, to float32 rounding (summation order).
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
inline void transpose8(__m256 (&r)[8]) {
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
/// the per-token scales or zeros), as floats. Eight ascending slots without holes and one group
/// per token are one 16-byte load; otherwise a gather of the 32-bit words at their 2-byte
/// offsets (the pool's slab slack covers the last one, as in attend_avx512.cpp's meta16).
inline __m256 meta8(const uint8_t* base, const int32_t* slots, int m, int64_t mc, int64_t gi) {
  if (m == 8 && mc == 1 && slots[7] - slots[0] == 7) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 2 * static_cast<int64_t>(slots[0]))));
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
        for (int j = 0; j < 8; ++j) {
          __m256i codes = _mm256_setzero_si256();
          if (j < m) {
            if constexpr (kChannel) {
              codes = channel_codes32(k, pos[j], c);
            } else {
              codes = chunk_codes32(k.block + static_cast<int64_t>(slots[j]) * row_bytes, tc[c], bits);
            }
          }
          kt[j] = _mm256_castsi256_ps(codes);
        }
        transpose8(kt);  // kt[e] lane j: key j's codes of dims 32c + 4e .. + 3
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

/// Float keys: 8 keys × 8 dims converted in registers, transposed, multiplied in float32.
template <int NR, Kind K>
void qk_float(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  const int64_t d = q.d;
  const int64_t row_bytes = k.kf.code_bytes;
  const float ts = k.kf.scaled ? k.tensor_scale : 1.0f;
  const float* qf = q.qf + r0 * d;
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int m = static_cast<int>(min64(8, n - j0));
    const int32_t* slots = k.slots + j0;
    const uint8_t* rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = k.block + static_cast<int64_t>(slots[j < m ? j : 0]) * row_bytes;
    __m256 out[NR];
    for (int r = 0; r < NR; ++r) out[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
      __m256 kt[8];
      for (int j = 0; j < 8; ++j) kt[j] = j < m ? load8<K>(rows[j] + c * value_bytes<K>()) : _mm256_setzero_ps();
      transpose8(kt);
#pragma GCC unroll 8
      for (int e = 0; e < 8; ++e) {
        for (int r = 0; r < NR; ++r) out[r] = _mm256_fmadd_ps(kt[e], _mm256_broadcast_ss(qf + r * d + c + e), out[r]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      store_row(s + r * ld + j0, K == Kind::kE4M3 || K == Kind::kE5M2 ? _mm256_mul_ps(out[r], _mm256_set1_ps(ts)) : out[r], m);
    }
  }
}

template <int NR>
void qk(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  switch (k.kf.kind) {
    case Kind::kF32: return qk_float<NR, Kind::kF32>(q, r0, k, n, s, ld);
    case Kind::kF16: return qk_float<NR, Kind::kF16>(q, r0, k, n, s, ld);
    case Kind::kBF16: return qk_float<NR, Kind::kBF16>(q, r0, k, n, s, ld);
    case Kind::kE4M3: return qk_float<NR, Kind::kE4M3>(q, r0, k, n, s, ld);
    case Kind::kE5M2: return qk_float<NR, Kind::kE5M2>(q, r0, k, n, s, ld);
    case Kind::kIntToken: return qk_int<NR, false>(q, r0, k, n, s, ld);
    case Kind::kIntChannel: return qk_int<NR, true>(q, r0, k, n, s, ld);
    case Kind::kNone: break;
  }
}

// ---------------------------------------------------------------- p·v

/// Dims [16h, 16h + 16) of value slot `slot`, dequantized: x0 (first 8), x1.
template <Kind K>
inline void value16(const RawTokens& v, int32_t slot, int64_t h, const float* cs, const float* cz, __m256& x0,
                    __m256& x1) {
  static_assert(K != Kind::kIntToken);  // (per-token integer values take pv_int_token)
  if constexpr (K == Kind::kIntChannel) {
    codes16_to_ps(channel_codes16(v, chan_pos(v, slot), h), x0, x1);
    x0 = _mm256_fmadd_ps(x0, _mm256_load_ps(cs + 16 * h), _mm256_load_ps(cz + 16 * h));
    x1 = _mm256_fmadd_ps(x1, _mm256_load_ps(cs + 16 * h + 8), _mm256_load_ps(cz + 16 * h + 8));
  } else {
    const uint8_t* row = v.block + static_cast<int64_t>(slot) * v.kf.code_bytes + 16 * h * value_bytes<K>();
    x0 = load8<K>(row);
    x1 = load8<K>(row + 8 * value_bytes<K>());  // (fp8:*:scaled: the scale is in the weights, pv_rows)
  }
}

/// acc[r] += Σ_j p[r][j] · v_j, 16 dims at a time with the rows' accumulators in registers.
/// (Float formats and per-channel integers; per-token integers: pv_int_token.)
template <int NR, Kind K>
void pv_rows_impl(const float* p, int64_t ld, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  alignas(32) float cs[256], cz[256];
  if constexpr (K == Kind::kIntChannel) {
    for (int64_t i = 0; i < d; ++i) {
      cs[i] = half_at(v.block + v.kf.scales_offset, i);
      cz[i] = half_at(v.block + v.kf.zeros_offset, i);
    }
  }
  for (int64_t h = 0; h < d / 16; ++h) {
    __m256 a[NR][2];
    for (int r = 0; r < NR; ++r) {
      a[r][0] = _mm256_loadu_ps(acc + r * d + 16 * h);
      a[r][1] = _mm256_loadu_ps(acc + r * d + 16 * h + 8);
    }
    for (int64_t j = 0; j < n; ++j) {
      __m256 x0, x1;
      value16<K>(v, v.slots[j], h, cs, cz, x0, x1);
      for (int r = 0; r < NR; ++r) {
        const __m256 pj = _mm256_broadcast_ss(p + r * ld + j);
        a[r][0] = _mm256_fmadd_ps(pj, x0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(pj, x1, a[r][1]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      _mm256_storeu_ps(acc + r * d + 16 * h, a[r][0]);
      _mm256_storeu_ps(acc + r * d + 16 * h + 8, a[r][1]);
    }
  }
}

/// fp8:*:scaled: the stream's scale multiplies the weights, once per weight rather than once
/// per value (p·scale rounded where the generic path rounds v·scale: within kFloatTol, and
/// exact for a weight of 1).
template <int NR, Kind K>
void pv_rows(const float* p, int64_t ld, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  if (!v.kf.scaled) return pv_rows_impl<NR, K>(p, ld, v, n, d, acc);
  alignas(32) float pw[NR][64];  // n ≤ 64 (accumulate)
  for (int r = 0; r < NR; ++r) {
    for (int64_t j = 0; j < n; ++j) pw[r][j] = v.tensor_scale * p[r * ld + j];
  }
  pv_rows_impl<NR, K>(&pw[0][0], 64, v, n, d, acc);
}

/// Per-token integer values: v_jd = s_jG c_jd + z_jG (G the group of dim d), so
/// Σ_j p_j v_jd = Σ_j (p_j s_jG) c_jd + Σ_j p_j z_jG: the weights p·s and the zero sums are
/// formed 8 keys at a time, and the inner loop only converts codes and multiplies.
template <int NR>
void pv_int_token(const float* p, int64_t ld, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  const int64_t mc = v.kf.meta_count;  // groups per token
  const uint8_t* sc = v.block + v.kf.scales_offset;
  const uint8_t* ze = v.block + v.kf.zeros_offset;
  alignas(32) float w[NR][8][64];  // [row][group][key]: p · s (n ≤ 64 per call, groups ≤ 8)
  __m256 zacc[NR][8];              // [row][group]: Σ p·z, 8 lanes
  for (int r = 0; r < NR; ++r) {
    for (int64_t gi = 0; gi < mc; ++gi) zacc[r][gi] = _mm256_setzero_ps();
  }
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int m = static_cast<int>(min64(8, n - j0));
    const __m256i lanes = lane_mask(m);
    for (int64_t gi = 0; gi < mc; ++gi) {
      const __m256 sv = meta8(sc, v.slots + j0, m, mc, gi);
      const __m256 zv = meta8(ze, v.slots + j0, m, mc, gi);
      for (int r = 0; r < NR; ++r) {
        const __m256 pr = _mm256_maskload_ps(p + r * ld + j0, lanes);
        _mm256_store_ps(&w[r][gi][j0], _mm256_mul_ps(pr, sv));
        zacc[r][gi] = _mm256_fmadd_ps(pr, zv, zacc[r][gi]);
      }
    }
  }
  float zsum[NR][8];
  for (int r = 0; r < NR; ++r) {
    for (int64_t gi = 0; gi < mc; ++gi) zsum[r][gi] = hsum(zacc[r][gi]);
  }
  const int bits = v.kf.bits;
  const int64_t row_bytes = v.kf.code_bytes;
  for (int64_t h = 0; h < d / 32; ++h) {
    const int64_t gi = 32 * h / v.kf.group;
    const TokenChunk tc = token_chunk(v.kf, h);
    for (int half = 0; half < 2; ++half) {
      const int64_t at = 32 * h + 16 * half;
      __m256 a[NR][2];
      for (int r = 0; r < NR; ++r) {
        const __m256 z = _mm256_set1_ps(zsum[r][gi]);
        a[r][0] = _mm256_add_ps(_mm256_loadu_ps(acc + r * d + at), z);
        a[r][1] = _mm256_add_ps(_mm256_loadu_ps(acc + r * d + at + 8), z);
      }
      for (int64_t j = 0; j < n; ++j) {
        const __m256i codes = chunk_codes32(v.block + static_cast<int64_t>(v.slots[j]) * row_bytes, tc, bits);
        __m256 x0, x1;
        codes16_to_ps(half == 0 ? _mm256_castsi256_si128(codes) : _mm256_extracti128_si256(codes, 1), x0, x1);
        for (int r = 0; r < NR; ++r) {
          const __m256 wj = _mm256_broadcast_ss(&w[r][gi][j]);
          a[r][0] = _mm256_fmadd_ps(wj, x0, a[r][0]);
          a[r][1] = _mm256_fmadd_ps(wj, x1, a[r][1]);
        }
      }
      for (int r = 0; r < NR; ++r) {
        _mm256_storeu_ps(acc + r * d + at, a[r][0]);
        _mm256_storeu_ps(acc + r * d + at + 8, a[r][1]);
      }
    }
  }
}

template <int NR>
void pv(const float* p, int64_t ld, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  switch (v.kf.kind) {
    case Kind::kF32: return pv_rows<NR, Kind::kF32>(p, ld, v, n, d, acc);
    case Kind::kF16: return pv_rows<NR, Kind::kF16>(p, ld, v, n, d, acc);
    case Kind::kBF16: return pv_rows<NR, Kind::kBF16>(p, ld, v, n, d, acc);
    case Kind::kE4M3: return pv_rows<NR, Kind::kE4M3>(p, ld, v, n, d, acc);
    case Kind::kE5M2: return pv_rows<NR, Kind::kE5M2>(p, ld, v, n, d, acc);
    case Kind::kIntToken: return pv_int_token<NR>(p, ld, v, n, d, acc);
    case Kind::kIntChannel: return pv_rows<NR, Kind::kIntChannel>(p, ld, v, n, d, acc);
    case Kind::kNone: break;
  }
}

}  // namespace

void scores(const QueryView& q, int64_t r0, int64_t nr, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  for_row_groups<kRows>(nr, [&](auto rows, int64_t g) { qk<decltype(rows)::value>(q, r0 + g, k, n, s + g * ld, ld); });
}

void accumulate(const float* p, int64_t ld, int64_t nr, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  if (n > 64) {  // pv_int_token's weights are sized for 64 keys: larger blocks go 64 at a time
    for (int64_t j = 0; j < n; j += 64) {
      RawTokens part = v;
      part.slots = v.slots + j;
      accumulate(p + j, ld, nr, part, min64(64, n - j), d, acc);
    }
    return;
  }
  for_row_groups<kRows>(nr, [&](auto rows, int64_t g) { pv<decltype(rows)::value>(p + g * ld, ld, v, n, d, acc + g * d); });
}

}  // namespace kvcache::cache::fused::avx2
