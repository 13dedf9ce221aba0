// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file simd.h (internal)
/// Portable helpers for the auto-vectorized quantizer kernels.
///
/// KV_TARGET_CLONES compiles a kernel entry point for AVX-512, AVX2 and baseline x86-64;
/// the loader picks the best one for the running CPU (GCC/Clang function multiversioning
/// via ifunc). Kernel bodies are always_inline templates so each clone gets its own
/// vectorized copy. Other platforms get one baseline version.

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__ELF__) && !defined(KVCACHE_NO_TARGET_CLONES)
#define KV_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KV_TARGET_CLONES
#endif

#if defined(__GNUC__)
#define KV_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define KV_ALWAYS_INLINE inline
#endif

namespace kvcache::quant {

/// Bit pattern of a float (vectorizes; no aliasing UB).
KV_ALWAYS_INLINE uint32_t float_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

/// 1 if `v` is NaN or ±Inf (exponent all ones), else 0 — an integer test that stays
/// vectorizable and is immune to -ffinite-math-only.
KV_ALWAYS_INLINE uint32_t nonfinite_bit(float v) {
  return static_cast<uint32_t>((float_bits(v) & 0x7f800000u) == 0x7f800000u);
}

/// Bits as a float.
KV_ALWAYS_INLINE float bits_float(uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

/// float32 → IEEE binary16 bits, round-to-nearest-even, overflow to ±Inf (NaN → NaN).
/// Branch-free float/integer arithmetic (the FP16 library's fp16_ieee_from_fp32_value, also
/// used by c10::Half), so loops over it vectorize on any SIMD ISA; GCC 12 cannot vectorize
/// _Float16 conversions without AVX512-FP16.
KV_ALWAYS_INLINE uint16_t fp16_bits(float f) {
  const float scale_to_inf = bits_float(0x77800000u);   // 2^112
  const float scale_to_zero = bits_float(0x08800000u);  // 2^-110
  const uint32_t w = float_bits(f);
  float base = (bits_float(w & 0x7fffffffu) * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007c00u;
  const uint32_t mantissa_bits = bits & 0x00000fffu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

/// IEEE binary16 bits → float32 (exact). Branch-free (FP16's fp16_ieee_to_fp32_value), with
/// the choice between the normal and subnormal results made by a bit mask, not `?:`: GCC turns
/// a conditional between two float results into a branch it may not if-convert (the float
/// operations could trap), and the loops over it then stay scalar (fp16 decode of a cache
/// block ran element by element in the AVX2 build).
KV_ALWAYS_INLINE float fp16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t normalized = float_bits(bits_float((two_w >> 4) + (0xe0u << 23)) * bits_float(0x07800000u));  // × 2^-112
  const uint32_t denormalized = float_bits(bits_float((two_w >> 17) | (126u << 23)) - 0.5f);
  const uint32_t subnormal = 0u - static_cast<uint32_t>(two_w < (1u << 27));  // all ones for zero / subnormal
  return bits_float(sign | (denormalized & subnormal) | (normalized & ~subnormal));
}

/// 1 if binary16 bits `h` are ±Inf or NaN.
KV_ALWAYS_INLINE uint32_t fp16_nonfinite_bit(uint16_t h) { return static_cast<uint32_t>((h & 0x7c00u) == 0x7c00u); }

/// fp16_bits() that also reports the direction of its rounding: `up` = 1 if |f| was rounded
/// up in magnitude, `down` = 1 if rounded down (both 0 if exact). The rounding happens in the
/// float add of the magic constant; subtracting it back gives 4·|rounded value| exactly, to be
/// compared with 4·|f| (exact for |f| < 2^16; for larger |f| both are +Inf: "exact").
KV_ALWAYS_INLINE uint32_t fp16_bits_dir(float f, uint32_t* up, uint32_t* down) {
  const float scale_to_inf = bits_float(0x77800000u);   // 2^112
  const float scale_to_zero = bits_float(0x08800000u);  // 2^-110
  const uint32_t w = float_bits(f);
  const float in = (bits_float(w & 0x7fffffffu) * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  const float magic = bits_float((bias >> 1) + 0x07800000u);
  const float base = magic + in;
  const float rounded = base - magic;
  *up = rounded > in ? 1u : 0u;
  *down = rounded < in ? 1u : 0u;
  const uint32_t bits = float_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007c00u;
  const uint32_t mantissa_bits = bits & 0x00000fffu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return (sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign);
}

/// Binary16 bits of the largest fp16 value ≤ f (f finite): round-to-nearest-even, then one
/// step toward −∞ if that rounded up. −Inf (0xFC00) if f < −65504; 65504 for 65504 ≤ f < 65536
/// (+Inf above: such an f has no fp16 zero within a step below it, and callers reject it).
KV_ALWAYS_INLINE uint32_t fp16_bits_down(float f) {
  uint32_t up, down;
  const uint32_t h = fp16_bits_dir(f, &up, &down);
  // Toward −∞: a positive value rounded up steps down; a negative one (sign bit set) rounded
  // down in magnitude steps up in magnitude.
  return (h & 0x8000u) != 0 ? h + down : h - up;
}

/// Binary16 bits of the smallest fp16 value ≥ f, for f ≥ 0 finite: round-to-nearest-even,
/// then one step up if that rounded down. +Inf (0x7C00) if f > 65504.
KV_ALWAYS_INLINE uint32_t fp16_bits_up(float f) {
  uint32_t up, down;
  const uint32_t h = fp16_bits_dir(f, &up, &down);
  return h + down;
}

/// Largest finite values of the 16-bit formats, as binary16 / bfloat16 bits without sign.
constexpr uint16_t kFp16MaxBits = 0x7bffu;  // 65504
constexpr uint16_t kBf16MaxBits = 0x7f7fu;  // 3.3895314e38

/// Round-to-nearest-even truncation of float32 to its upper 16 bits (finite input).
KV_ALWAYS_INLINE uint16_t bf16_bits(float v) {
  const uint32_t u = float_bits(v);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/// Bits `h` of a 16-bit float whose exponent field is `exp_mask`: ±Inf becomes ±max_bits
/// (the largest finite value of that sign); every other value is kept.
KV_ALWAYS_INLINE uint16_t saturate_bits(uint16_t h, uint16_t exp_mask, uint16_t max_bits) {
  return (h & exp_mask) == exp_mask ? static_cast<uint16_t>((h & 0x8000u) | max_bits) : h;
}

/// fp16 bits of finite `v`, saturating at ±65504 (cast_to_fp16_saturating, one value).
KV_ALWAYS_INLINE uint16_t fp16_bits_saturating(float v) { return saturate_bits(fp16_bits(v), 0x7c00u, kFp16MaxBits); }
/// bf16 bits of finite `v`, saturating at ±3.3895e38 (cast_to_bf16, one value).
KV_ALWAYS_INLINE uint16_t bf16_bits_saturating(float v) { return saturate_bits(bf16_bits(v), 0x7f80u, kBf16MaxBits); }
/// bf16 bits → float32 (exact).
KV_ALWAYS_INLINE float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

/// An fp16 value as stored: its IEEE binary16 bits (the metadata element type of the integer
/// kernels; layout-compatible with c10::Half and uint16_t).
struct Half {
  uint16_t x;
};
static_assert(sizeof(Half) == 2, "Half is two bytes");

/// Integer code of y ∈ [0, 2^22) rounded half-to-even: adding 1.5·2^23 leaves rint(y) in
/// the low mantissa bits under the default rounding mode. Plain SSE2 arithmetic, unlike
/// rintf (which needs SSE4.1 to vectorize). The caller masks the result to its bit width.
KV_ALWAYS_INLINE uint32_t rint_bits(float y) { return float_bits(y + 12582912.0f); }

}  // namespace kvcache::quant
