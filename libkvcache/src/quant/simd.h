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

/// Integer code of y ∈ [0, 2^22) rounded half-to-even: adding 1.5·2^23 leaves rint(y) in
/// the low mantissa bits under the default rounding mode. Plain SSE2 arithmetic, unlike
/// rintf (which needs SSE4.1 to vectorize). The caller masks the result to its bit width.
KV_ALWAYS_INLINE uint32_t rint_bits(float y) { return float_bits(y + 12582912.0f); }

}  // namespace kvcache::quant
