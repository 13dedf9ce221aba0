// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file fp8.h (internal)
/// Our own FP8 codec (LibTorch 1.13 has no fp8 dtype). OCP 8-bit floats:
///   E4M3 (e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, only
///         S.1111.111 is NaN; max finite ±448 (0x7E), min normal 2^-6, min subnormal 2^-9.
///   E5M2: 1 sign, 5 exponent (bias 15), 2 mantissa bits (IEEE-like); max finite ±57344
///         (0x7B), min normal 2^-14, min subnormal 2^-16.
/// Encoding rounds to nearest, ties to even, and SATURATES: every finite float32 maps to
/// a finite code (|x| beyond the max finite value → ±max), so NaN/Inf codes are never
/// produced. Decoding is exact (every fp8 value is a float32).

#include <cstdint>

namespace kvcache::quant {

enum class Fp8Format { kE4M3, kE5M2 };

/// Largest finite magnitude: 448 (E4M3) or 57344 (E5M2).
float fp8_max(Fp8Format f);
/// "e4m3" / "e5m2".
const char* fp8_name(Fp8Format f);

/// Encodes one value (scalar reference of the kernel below). `x` must not be NaN.
uint8_t fp8_encode(float x, Fp8Format f);
/// Decodes one code (NaN for the NaN codes, never produced by the encoder).
float fp8_decode(uint8_t code, Fp8Format f);

/// Which array encoder runs: the best for the CPU (hand-written AVX-512 where it has AVX-512
/// F/BW/DQ/VL, else the auto-vectorized AVX2 or baseline clone), or that auto-vectorized twin
/// whatever the CPU (tests hold the two to each other and to fp8_encode).
enum class Fp8Encoder { kBest, kGeneric };

/// out[i] = fp8_encode(x[i] / scale). Returns true if some x[i] was NaN/±Inf (the output
/// is then garbage). Vectorized, runs detail::parallel_for.
bool fp8_encode_array(const float* x, int64_t n, float scale, Fp8Format f, uint8_t* out,
                      Fp8Encoder which = Fp8Encoder::kBest);
/// True if the hand-written AVX-512 fp8 kernels run on this CPU: Fp8Encoder::kBest's encoder
/// and fp8_amax()'s loop (the check of avx512::available(); false in builds without the
/// AVX-512 kernels, -DKVCACHE_FUSED=OFF).
bool fp8_avx512_kernels();
/// max_i |x[i]| (0 for n = 0), or +Inf if some x[i] is NaN/±Inf: one pass, no temporary (the
/// per-tensor scale of fp8:*:scaled). Vectorized, runs detail::parallel_for.
float fp8_amax(const float* x, int64_t n);
/// out[i] = fp8_decode(codes[i]) * scale.
void fp8_decode_array(const uint8_t* codes, int64_t n, float scale, Fp8Format f, float* out);

}  // namespace kvcache::quant
