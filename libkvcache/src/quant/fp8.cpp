// SPDX-License-Identifier: Apache-2.0
#include "quant/fp8.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>

#include "common/parallel.h"
#include "kvcache/error.h"
#include "quant/int_kernels_avx512.h"
#include "quant/simd.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(KVCACHE_NO_TARGET_CLONES)
#include <immintrin.h>

#define KV_FP8_AVX512 1
#define KV_FP8_AVX512_FN __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#else
#define KV_FP8_AVX512 0
#endif

namespace kvcache::quant {
namespace {

/// Branch-free encoder for a format with EXP exponent bits, MAN mantissa bits and
/// largest finite code MAXCODE (0x7E for e4m3fn, whose 0x7F is NaN; 0x7B for e5m2,
/// whose exponent 31 is Inf/NaN).
template <int EXP, int MAN, int MAXCODE>
KV_ALWAYS_INLINE uint32_t encode_one(float x) {
  constexpr int kBias = (1 << (EXP - 1)) - 1;
  constexpr int kShift = 23 - MAN;
  // 2^(1 - bias): smallest normal; below it the value is a multiple of 2^(1 - bias - MAN).
  constexpr float kMinNormal = 1.0f / static_cast<float>(1u << (kBias - 1));
  constexpr float kSubScale = static_cast<float>(1u << (kBias - 1 + MAN));
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs_bits = u & 0x7fffffffu;
  float a;
  std::memcpy(&a, &abs_bits, sizeof a);
  // Normal: round the float32 mantissa to MAN bits, ties to even, then rebias the exponent.
  const uint32_t rounded = abs_bits + ((1u << (kShift - 1)) - 1u) + ((abs_bits >> kShift) & 1u);
  const int32_t normal = static_cast<int32_t>(rounded >> kShift) - ((127 - kBias) << MAN);
  // Subnormal: an integer multiple of the smallest subnormal (2^MAN means the min normal,
  // whose bit pattern is exactly that integer).
  const int32_t sub = static_cast<int32_t>(rint_bits(a * kSubScale) & 0xffu);
  int32_t code = a < kMinNormal ? sub : normal;
  code = code > MAXCODE ? MAXCODE : code;  // saturate
  return sign | static_cast<uint32_t>(code);
}

KV_ALWAYS_INLINE uint32_t encode_dispatch(float x, Fp8Format f) {
  return f == Fp8Format::kE4M3 ? encode_one<4, 3, 0x7E>(x) : encode_one<5, 2, 0x7B>(x);
}

/// kScaled = false: scale is 1 and the division (x / 1 == x exactly) is left out — a vector
/// divide per 16 values is the costliest instruction of the loop.
/// Values per vectorized inner loop of the array kernels, and how far ahead (in bytes of
/// input) each chunk asks for the memory it will read: the hardware prefetchers alone fell
/// behind on a VM's Intel Xeon (fp8:e4m3 quantize at 512 MB: 1.4 GB/s, the loads stalled).
constexpr int64_t kChunk = 256;
constexpr int64_t kAheadBytes = 4096;

/// Asks for the cache lines of bytes [p + kAheadBytes, p + kAheadBytes + n) below `end`, into
/// all cache levels (prefetcht0). Not prefetchnta: on the Xeon it stalled the encoder on data
/// already in L2/L3 (75 % of the samples on the instruction after it; fp8:e4m3 quantize at 4 MB
/// ran at a third of its 512 MB rate, docs/performance.md).
KV_ALWAYS_INLINE void prefetch_ahead(const void* p, int64_t n, const void* end) {
  const char* a = static_cast<const char*>(p) + kAheadBytes;
  const char* stop = std::min(a + n, static_cast<const char*>(end));
  for (; a < stop; a += 64) __builtin_prefetch(a, 0, 3);
}

template <int EXP, int MAN, int MAXCODE, bool kScaled>
KV_ALWAYS_INLINE uint32_t encode_range(const float* __restrict x, int64_t b, int64_t e, float scale,
                                       uint8_t* __restrict out) {
  uint32_t bad = 0;
  for (int64_t c = b; c < e; c += kChunk) {
    const int64_t ce = std::min(e, c + kChunk);
    prefetch_ahead(x + c, kChunk * 4, x + e);
#pragma omp simd reduction(| : bad)
    for (int64_t i = c; i < ce; ++i) {
      const float v = x[i];
      bad |= nonfinite_bit(v);
      out[i] = static_cast<uint8_t>(encode_one<EXP, MAN, MAXCODE>(kScaled ? v / scale : v));
    }
  }
  return bad;
}

KV_TARGET_CLONES uint32_t encode_e4m3(const float* x, int64_t b, int64_t e, float scale, uint8_t* out) {
  return scale == 1.0f ? encode_range<4, 3, 0x7E, false>(x, b, e, scale, out)
                       : encode_range<4, 3, 0x7E, true>(x, b, e, scale, out);
}
KV_TARGET_CLONES uint32_t encode_e5m2(const float* x, int64_t b, int64_t e, float scale, uint8_t* out) {
  return scale == 1.0f ? encode_range<5, 2, 0x7B, false>(x, b, e, scale, out)
                       : encode_range<5, 2, 0x7B, true>(x, b, e, scale, out);
}

#if KV_FP8_AVX512
/// encode_one() on 16 floats with AVX-512: the same integer and float steps, lane for lane, so
/// the codes are the scalar encoder's bit for bit (Fp8Exhaustive.Avx512EncoderEqualsTheScalarOne
/// holds it to encode_one over every exponent, rounding tie and special value). GCC vectorizes
/// encode_range only at 128 bits, even in its x86-64-v4 clone, and with byte stores: fp8:e4m3
/// quantize at 512 MB ran at ~4 GB/s on an Intel Xeon (docs/performance.md).
template <int EXP, int MAN, int MAXCODE>
KV_FP8_AVX512_FN inline __m512i encode16(__m512 v) {
  constexpr int kBias = (1 << (EXP - 1)) - 1;
  constexpr int kShift = 23 - MAN;
  constexpr float kMinNormal = 1.0f / static_cast<float>(1u << (kBias - 1));
  constexpr float kSubScale = static_cast<float>(1u << (kBias - 1 + MAN));
  const __m512i u = _mm512_castps_si512(v);
  const __m512i abs_bits = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(abs_bits, kShift), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(abs_bits, _mm512_set1_epi32((1 << (kShift - 1)) - 1)), odd);
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, kShift), _mm512_set1_epi32((127 - kBias) << MAN));
  // The subnormal code: a·kSubScale is exact here (a power-of-two scale of a value below the
  // smallest normal), then rint through the 1.5·2^23 add, as rint_bits() does.
  const __m512 a = _mm512_castsi512_ps(abs_bits);
  const __m512i sub = _mm512_and_si512(
      _mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(a, _mm512_set1_ps(kSubScale)), _mm512_set1_ps(12582912.0f))),
      _mm512_set1_epi32(0xff));
  const __mmask16 is_sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(kMinNormal), _CMP_LT_OQ);
  const __m512i code = _mm512_min_epi32(_mm512_mask_blend_epi32(is_sub, normal, sub), _mm512_set1_epi32(MAXCODE));
  return _mm512_or_si512(sign, code);
}

/// encode_range() with encode16: 64 values per step, packed to one 64-byte store.
template <int EXP, int MAN, int MAXCODE, bool kScaled>
KV_FP8_AVX512_FN uint32_t encode_range_avx512(const float* __restrict x, int64_t b, int64_t e, float scale,
                                             uint8_t* __restrict out) {
  __mmask16 bad = 0;
  const __m512 sv = _mm512_set1_ps(scale);
  // packus_epi32 then packus_epi16 leave 128-bit lane L holding dwords (r0, r1, r2, r3) of
  // lane L; this puts dword 4L + i at position 4i + L.
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  int64_t i = b;
  for (; i + 64 <= e; i += 64) {
    if (((i - b) & (kChunk - 1)) == 0) prefetch_ahead(x + i, kChunk * 4, x + e);
    __m512i r[4];
    for (int k = 0; k < 4; ++k) {
      const __m512 v = _mm512_loadu_ps(x + i + 16 * k);
      const __m512i exp_bits = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7f800000));
      bad |= _mm512_cmpeq_epi32_mask(exp_bits, _mm512_set1_epi32(0x7f800000));
      r[k] = encode16<EXP, MAN, MAXCODE>(kScaled ? _mm512_div_ps(v, sv) : v);
    }
    const __m512i w = _mm512_packus_epi16(_mm512_packus_epi32(r[0], r[1]), _mm512_packus_epi32(r[2], r[3]));
    _mm512_storeu_si512(out + i, _mm512_permutexvar_epi32(order, w));
  }
  return encode_range<EXP, MAN, MAXCODE, kScaled>(x, i, e, scale, out) | static_cast<uint32_t>(bad != 0);
}

KV_FP8_AVX512_FN uint32_t encode_e4m3_avx512(const float* x, int64_t b, int64_t e, float scale, uint8_t* out) {
  return scale == 1.0f ? encode_range_avx512<4, 3, 0x7E, false>(x, b, e, scale, out)
                       : encode_range_avx512<4, 3, 0x7E, true>(x, b, e, scale, out);
}
KV_FP8_AVX512_FN uint32_t encode_e5m2_avx512(const float* x, int64_t b, int64_t e, float scale, uint8_t* out) {
  return scale == 1.0f ? encode_range_avx512<5, 2, 0x7B, false>(x, b, e, scale, out)
                       : encode_range_avx512<5, 2, 0x7B, true>(x, b, e, scale, out);
}
#endif

using EncodeFn = uint32_t (*)(const float*, int64_t, int64_t, float, uint8_t*);

/// The array encoder for format `f` (Fp8Encoder's two choices).
EncodeFn encoder(Fp8Format f, Fp8Encoder which) {
#if KV_FP8_AVX512
  if (which == Fp8Encoder::kBest && fp8_avx512_kernels()) {
    return f == Fp8Format::kE4M3 ? encode_e4m3_avx512 : encode_e5m2_avx512;
  }
#endif
  return f == Fp8Format::kE4M3 ? encode_e4m3 : encode_e5m2;
}

/// max |x[i]| over [b, e) and the OR of the non-finite bits.
KV_TARGET_CLONES float amax_range(const float* __restrict x, int64_t b, int64_t e, uint32_t* bad_out) {
  float m = 0.0f;
  uint32_t bad = 0;
  for (int64_t c = b; c < e; c += kChunk) {
    const int64_t ce = std::min(e, c + kChunk);
    prefetch_ahead(x + c, kChunk * 4, x + e);
#pragma omp simd reduction(max : m) reduction(| : bad)
    for (int64_t i = c; i < ce; ++i) {
      const float a = bits_float(float_bits(x[i]) & 0x7fffffffu);
      bad |= nonfinite_bit(x[i]);
      m = a > m ? a : m;
    }
  }
  *bad_out = bad;
  return m;
}

#if KV_FP8_AVX512
/// amax_range() in 512-bit registers: |x| as bits (sign cleared), their unsigned max in four
/// independent accumulators. For non-negative floats the order of the bits is the order of the
/// values, and a result of at least 0x7f800000 (+Inf's bits; NaN's lie above) means a NaN/±Inf
/// was seen, so one vpmaxud per 16 values does both jobs of the auto-vectorized loop (whose
/// compare-and-blend chain GCC emits one vector at a time).
/// (_mm512_mask_max_epu32 with a defined pass-through rather than _mm512_max_epu32, whose
/// undefined one trips GCC 12's -Wuninitialized, PR 105593.)
KV_FP8_AVX512_FN inline __m512i max_u32(__m512i a, __m512i b) { return _mm512_mask_max_epu32(a, 0xFFFF, a, b); }

KV_FP8_AVX512_FN float amax_range_avx512(const float* __restrict x, int64_t b, int64_t e, uint32_t* bad_out) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  __m512i m0 = _mm512_setzero_si512(), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = b;
  for (; i + 64 <= e; i += 64) {
    if (((i - b) & (kChunk - 1)) == 0) prefetch_ahead(x + i, kChunk * 4, x + e);
    m0 = max_u32(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), abs_mask));
    m1 = max_u32(m1, _mm512_and_si512(_mm512_loadu_si512(x + i + 16), abs_mask));
    m2 = max_u32(m2, _mm512_and_si512(_mm512_loadu_si512(x + i + 32), abs_mask));
    m3 = max_u32(m3, _mm512_and_si512(_mm512_loadu_si512(x + i + 48), abs_mask));
  }
  for (; i + 16 <= e; i += 16) m0 = max_u32(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), abs_mask));
  if (i < e) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (e - i)) - 1u);
    m1 = max_u32(m1, _mm512_and_si512(_mm512_maskz_loadu_epi32(tail, x + i), abs_mask));
  }
  alignas(64) uint32_t lanes[16];
  _mm512_store_si512(lanes, max_u32(max_u32(m0, m1), max_u32(m2, m3)));
  uint32_t m = 0;
  for (uint32_t v : lanes) m = v > m ? v : m;
  *bad_out = m >= 0x7f800000u ? 1u : 0u;
  return bits_float(m);
}
#endif

using AmaxFn = float (*)(const float*, int64_t, int64_t, uint32_t*);

/// The amax loop fp8_amax() runs (as encoder() picks the encoder).
AmaxFn amax_kernel() {
#if KV_FP8_AVX512
  if (fp8_avx512_kernels()) return amax_range_avx512;
#endif
  return amax_range;
}

float decode_slow(uint8_t code, Fp8Format f) {
  const int exp_bits = f == Fp8Format::kE4M3 ? 4 : 5;
  const int man_bits = 7 - exp_bits;
  const int bias = (1 << (exp_bits - 1)) - 1;
  const int sign = code >> 7;
  const int e = (code >> man_bits) & ((1 << exp_bits) - 1);
  const int m = code & ((1 << man_bits) - 1);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float v;
  if (f == Fp8Format::kE4M3 && e == 15 && m == 7) {
    v = nan;
  } else if (f == Fp8Format::kE5M2 && e == 31) {
    v = m == 0 ? std::numeric_limits<float>::infinity() : nan;
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), 1 - bias - man_bits);
  } else {
    v = std::ldexp(1.0f + static_cast<float>(m) / static_cast<float>(1 << man_bits), e - bias);
  }
  return sign ? -v : v;
}

using Lut = std::array<float, 256>;
const Lut& lut(Fp8Format f) {
  static const Lut e4m3 = [] {
    Lut t{};
    for (int c = 0; c < 256; ++c) t[c] = decode_slow(static_cast<uint8_t>(c), Fp8Format::kE4M3);
    return t;
  }();
  static const Lut e5m2 = [] {
    Lut t{};
    for (int c = 0; c < 256; ++c) t[c] = decode_slow(static_cast<uint8_t>(c), Fp8Format::kE5M2);
    return t;
  }();
  return f == Fp8Format::kE4M3 ? e4m3 : e5m2;
}

/// The value of fp8 code `c`, as lut() holds it, computed instead of looked up: a loop over it
/// vectorizes, where a table lookup per byte stays scalar (a gather at best; fp8 block decode
/// was the costliest step of the generic attention path on AVX2). e4m3: the magnitude bits
/// shifted left by 7 are the binary16 bits of the value × 2^-8, normal and subnormal alike
/// (×256 is exact); e5m2: the code is the upper byte of the binary16 with the same value (±Inf
/// included). NaN codes give the table's quiet NaN with the code's sign. Checked against the
/// table for all 256 codes (Fp8Exhaustive.ComputedDecodeEqualsTheTableForEveryCode).
template <bool kE4M3>
KV_ALWAYS_INLINE float decode_one(uint32_t c) {
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t mag = c & 0x7Fu;
  uint32_t bits, nan;
  if constexpr (kE4M3) {
    bits = float_bits(fp16_to_float(static_cast<uint16_t>(mag << 7)) * 256.0f);
    nan = 0u - static_cast<uint32_t>(mag == 0x7Fu);
  } else {
    bits = float_bits(fp16_to_float(static_cast<uint16_t>(mag << 8)));
    nan = 0u - static_cast<uint32_t>(mag > 0x7Cu);
  }
  return bits_float(sign | (bits & ~nan) | (0x7FC00000u & nan));
}

template <bool kE4M3>
KV_ALWAYS_INLINE void decode_values(const uint8_t* __restrict codes, int64_t b, int64_t e, float scale,
                                    float* __restrict out) {
  for (int64_t c = b; c < e; c += kChunk) {
    const int64_t ce = std::min(e, c + kChunk);
    prefetch_ahead(codes + c, kChunk, codes + e);
#pragma omp simd
    for (int64_t i = c; i < ce; ++i) out[i] = decode_one<kE4M3>(codes[i]) * scale;
  }
}
KV_TARGET_CLONES void decode_e4m3_range(const uint8_t* codes, int64_t b, int64_t e, float scale, float* out) {
  decode_values<true>(codes, b, e, scale, out);
}
KV_TARGET_CLONES void decode_e5m2_range(const uint8_t* codes, int64_t b, int64_t e, float scale, float* out) {
  decode_values<false>(codes, b, e, scale, out);
}

constexpr int64_t kGrain = int64_t{1} << 16;

}  // namespace

float fp8_max(Fp8Format f) { return f == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }
const char* fp8_name(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }

uint8_t fp8_encode(float x, Fp8Format f) { return static_cast<uint8_t>(encode_dispatch(x, f)); }
float fp8_decode(uint8_t code, Fp8Format f) { return lut(f)[code]; }

// The CPU check of the AVX-512 integer kernels (F/BW/VL/DQ; false where the build left them out).
bool fp8_avx512_kernels() { return KV_FP8_AVX512 && avx512::available(); }

bool fp8_encode_array(const float* x, int64_t n, float scale, Fp8Format f, uint8_t* out, Fp8Encoder which) {
  std::atomic<bool> bad{false};
  const EncodeFn encode = encoder(f, which);
  detail::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    const uint32_t r = encode(x, b, e, scale, out);
    if (r != 0) bad.store(true, std::memory_order_relaxed);
  });
  return bad.load();
}

float fp8_amax(const float* x, int64_t n) {
  std::atomic<bool> bad{false};
  std::mutex mu;
  float m = 0.0f;
  const AmaxFn range = amax_kernel();
  detail::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    uint32_t r = 0;
    const float part = range(x, b, e, &r);
    if (r != 0) bad.store(true, std::memory_order_relaxed);
    const std::lock_guard<std::mutex> lock(mu);
    m = part > m ? part : m;
  });
  return bad.load() ? std::numeric_limits<float>::infinity() : m;
}

void fp8_decode_array(const uint8_t* codes, int64_t n, float scale, Fp8Format f, float* out) {
  const auto range = f == Fp8Format::kE4M3 ? decode_e4m3_range : decode_e5m2_range;
  detail::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) { range(codes, b, e, scale, out); });
}

}  // namespace kvcache::quant
