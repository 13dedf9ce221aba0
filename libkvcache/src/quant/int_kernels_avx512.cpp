// SPDX-License-Identifier: Apache-2.0
// AVX-512 per-token quantize kernel, fp16 metadata (int_kernels_avx512.h). Compiled with
// -mavx512f/bw/vl/dq and entered only when the CPU has them (available(), in int_kernels.cpp).
// No FMA contraction (-ffp-contract=off): (x − z)·inv is a subtract then a multiply, as in the
// reference; nothing here assumes finite math.
#include <immintrin.h>

#include <cstdint>

#include "quant/int_kernels_avx512.h"

namespace kvcache::quant::avx512 {
namespace {

constexpr int kChunk = 16;  // groups whose metadata is computed as one vector

template <bool kMax>
inline __m512 pick(__m512 a, __m512 b) {
  return kMax ? _mm512_max_ps(a, b) : _mm512_min_ps(a, b);
}

/// v[0..16): one vector per group → one vector, lane i = min (max) over v[i]'s 16 lanes.
/// Four levels of shuffle + min/max; the last leaves lane 4j + l holding group 4l + j, which
/// one permutation (a 4×4 transpose, its own inverse) puts in order.
template <bool kMax>
inline __m512 reduce16(const __m512* v) {
  __m512 c[8], d[4], e[2];
  for (int k = 0; k < 8; ++k) {  // 128-bit chunks: [a.0∘a.2, a.1∘a.3, b.0∘b.2, b.1∘b.3]
    const __m512 a = v[2 * k], b = v[2 * k + 1];
    c[k] = pick<kMax>(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int m = 0; m < 4; ++m) {  // chunk j = group 4m + j (4 partial lanes each)
    d[m] = pick<kMax>(_mm512_shuffle_f32x4(c[2 * m], c[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_f32x4(c[2 * m], c[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int n = 0; n < 2; ++n) {  // per chunk: lanes 0,1 of d[2n], lanes 2,3 of d[2n+1]
    e[n] = pick<kMax>(_mm512_shuffle_ps(d[2 * n], d[2 * n + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm512_shuffle_ps(d[2 * n], d[2 * n + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 f = pick<kMax>(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i transpose = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(transpose, f);
}

/// Codes of 16 values: clamp((x − z)·inv, 0, L) rounded half to even (the default MXCSR mode).
/// x ≥ mn ≥ z, so x − z ≥ 0 (rounding is monotone) and inv ≥ 0: the lower clamp never binds
/// and is left out. int8 leaves the upper one to the saturating pack (clamp-then-round equals
/// round-then-clamp, the bound being an integer; vcvtps2dq's out-of-range result 2^31 also
/// saturates to 255), the narrower widths clamp before packing.
template <int BITS>
inline __m512i codes16(__m512 x, __m512 z, __m512 inv) {
  const __m512 y = _mm512_mul_ps(_mm512_sub_ps(x, z), inv);
  if constexpr (BITS == 8) return _mm512_cvtps_epi32(y);
  return _mm512_cvtps_epi32(_mm512_min_ps(y, _mm512_set1_ps(static_cast<float>((1 << BITS) - 1))));
}

// fpclass categories: QNaN 0x01, +Inf 0x08, −Inf 0x10, SNaN 0x80.
constexpr int kNonFinite = 0x99;

template <int BITS, int G>
void quant_fp16(const float* __restrict x, int64_t g0, int64_t g1, uint8_t* __restrict codes,
                uint16_t* __restrict sc, uint16_t* __restrict ze, uint32_t* nonfinite, uint32_t* meta_overflow) {
  constexpr int V = G / 16;     // vectors per group
  constexpr int K = 8 / BITS;   // codes per byte
  constexpr int Q = G / K;      // bytes per group = values per code stream
  constexpr int S = Q / 16;     // vectors per code stream
  static_assert(Q % 16 == 0, "each code stream must be whole vectors");
  constexpr float kL = static_cast<float>((1 << BITS) - 1);
  constexpr int64_t kAhead = 2 * kChunk;  // groups ahead to prefetch
  __mmask16 bad = 0, meta_bad = 0;
  alignas(64) float zc[kChunk], inv[kChunk];
  for (int64_t k0 = g0; k0 < g1; k0 += kChunk) {
    const int n = static_cast<int>(g1 - k0 < kChunk ? g1 - k0 : kChunk);
    __m512 vmin[kChunk], vmax[kChunk];
    for (int i = 0; i < kChunk; ++i) {
      if (i >= n) {  // a short last chunk repeats its first group (results not stored)
        vmin[i] = vmin[0];
        vmax[i] = vmax[0];
        continue;
      }
      const float* p = x + (k0 + i) * G;
      // Two chunks ahead (4–16 KB): the metadata and code phases issue no loads of new
      // data, and without this the hardware prefetcher falls behind at 512 MB.
      for (int v = 0; v < V; v += 4) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * G + 16 * v), _MM_HINT_T0);
      __m512 lo = _mm512_loadu_ps(p), hi = lo;
      bad |= _mm512_fpclass_ps_mask(lo, kNonFinite);
      for (int v = 1; v < V; ++v) {
        const __m512 a = _mm512_loadu_ps(p + 16 * v);
        bad |= _mm512_fpclass_ps_mask(a, kNonFinite);
        lo = _mm512_min_ps(lo, a);
        hi = _mm512_max_ps(hi, a);
      }
      vmin[i] = lo;
      vmax[i] = hi;
    }
    const __m512 mn = reduce16<false>(vmin);
    const __m512 mx = reduce16<true>(vmax);
    // Metadata (int_kernels.h): z = fp16 round-down(mn), s = fp16 round-up((mx − z) / L), at
    // least 2^-24 when mx > z; inv = 1/s (0 for s = 0).
    const __m256i hz = _mm512_cvt_roundps_ph(mn, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 z = _mm512_cvtph_ps(hz);
    const __m512 scale = _mm512_div_ps(_mm512_sub_ps(mx, z), _mm512_set1_ps(kL));
    __m256i hs = _mm512_cvt_roundps_ph(scale, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
    const __mmask16 underflow = _mm512_cmp_ps_mask(_mm512_cvtph_ps(hs), _mm512_setzero_ps(), _CMP_EQ_OQ) &
                                _mm512_cmp_ps_mask(mx, z, _CMP_GT_OQ);
    hs = _mm256_mask_mov_epi16(hs, underflow, _mm256_set1_epi16(1));
    const __m512 s = _mm512_cvtph_ps(hs);
    const __mmask16 ok = _mm512_cmp_ps_mask(mn, _mm512_set1_ps(-65504.0f), _CMP_GE_OQ) &
                         _mm512_cmp_ps_mask(mn, _mm512_set1_ps(65520.0f), _CMP_LT_OQ) &
                         _mm512_cmp_ps_mask(scale, _mm512_set1_ps(65504.0f), _CMP_LE_OQ);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    meta_bad |= static_cast<__mmask16>(~ok & valid);
    const __mmask16 nonzero = _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    _mm512_store_ps(inv, _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0f), s));
    _mm512_store_ps(zc, z);
    _mm256_mask_storeu_epi16(sc + k0, valid, hs);
    _mm256_mask_storeu_epi16(ze + k0, valid, hz);
    for (int i = 0; i < n; ++i) {
      const float* p = x + (k0 + i) * G;
      uint8_t* o = codes + (k0 + i) * Q;
      const __m512 zi = _mm512_set1_ps(zc[i]);
      const __m512 ii = _mm512_set1_ps(inv[i]);
      for (int t = 0; t < S; ++t) {  // byte j = Σ_m c[j + m·Q] << (m·BITS)
        __m512i acc = codes16<BITS>(_mm512_loadu_ps(p + 16 * t), zi, ii);
        for (int m = 1; m < K; ++m) {
          const __m512i c = codes16<BITS>(_mm512_loadu_ps(p + m * Q + 16 * t), zi, ii);
          acc = _mm512_or_si512(acc, _mm512_slli_epi32(c, m * BITS));
        }
        const __m128i bytes = BITS == 8 ? _mm512_cvtusepi32_epi8(acc) : _mm512_cvtepi32_epi8(acc);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16 * t), bytes);
      }
    }
  }
  *nonfinite |= bad;
  *meta_overflow |= meta_bad;
}

}  // namespace

void quantize_per_token_fp16(int bits, const float* x, int64_t g0, int64_t g1, int64_t g, uint8_t* codes,
                             uint16_t* scales, uint16_t* zeros, uint32_t* nonfinite, uint32_t* meta_overflow) {
  const int key = bits * 1000 + static_cast<int>(g);
  switch (key) {
    case 8032: return quant_fp16<8, 32>(x, g0, g1, codes, scales, zeros, nonfinite, meta_overflow);
    case 8064: return quant_fp16<8, 64>(x, g0, g1, codes, scales, zeros, nonfinite, meta_overflow);
    case 8128: return quant_fp16<8, 128>(x, g0, g1, codes, scales, zeros, nonfinite, meta_overflow);
    case 4032: return quant_fp16<4, 32>(x, g0, g1, codes, scales, zeros, nonfinite, meta_overflow);
    case 4064: return quant_fp16<4, 64>(x, g0, g1, codes, scales, zeros, nonfinite, meta_overflow);
    case 4128: return quant_fp16<4, 128>(x, g0, g1, codes, scales, zeros, nonfinite, meta_overflow);
    case 2064: return quant_fp16<2, 64>(x, g0, g1, codes, scales, zeros, nonfinite, meta_overflow);
    case 2128: return quant_fp16<2, 128>(x, g0, g1, codes, scales, zeros, nonfinite, meta_overflow);
    default: __builtin_trap();  // handles() said no: a caller bug
  }
}

}  // namespace kvcache::quant::avx512
