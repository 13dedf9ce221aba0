// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file int_kernels_avx512.h (internal)
/// Hand-written AVX-512 per-token quantize kernel for fp16 metadata (the default), entered from
/// quantize_per_token() when the running CPU has AVX-512 F/BW/VL/DQ and the shape is one it
/// handles (avx512::handles()); everything else runs the portable kernel of int_kernels.cpp.
/// Same results bit for bit as that kernel and the LibTorch-ops reference (int_kernels.h gives
/// the arithmetic); tests/int_kernels_avx512_test.cpp holds it to the portable kernel.
///
/// Why a second kernel: the portable one takes each group's min and max with a horizontal
/// reduction per group, which at g = 32 costs as much as the rest of the work; this one reduces
/// 16 groups at once with a 4-level shuffle tree (about 3 shuffles + min/max per group and
/// quantity) and converts the metadata with the CPU's directed-rounding fp16 conversion
/// (vcvtps2ph with round-down for the zero, round-up for the scale: equal, for every float32
/// the kernel can meet, to fp16_bits_down()/fp16_bits_up(); checked exhaustively over all 2^32
/// bit patterns during development, and in the test on a sweep of edge values).
#include <cstdint>

namespace kvcache::quant::avx512 {

/// True if this build has the kernel and the running CPU can run it.
bool available();

/// True if the kernel handles per-token groups of `g` values at `bits` (8, 4, 2): g ∈ {32, 64,
/// 128} with each of the 8/bits code streams of a group (g·bits/8 values) a multiple of 16.
bool handles(int bits, int64_t g);

/// Groups [g0, g1) of `g` contiguous floats at `x` (layout: int_kernels.h, per-token). Writes
/// codes, fp16 scales/zeros (binary16 bits), and ORs into `*nonfinite` / `*meta_overflow`
/// (non-zero if a NaN/±Inf was read / a group's metadata has no finite fp16).
/// Requires available() && handles(bits, g).
void quantize_per_token_fp16(int bits, const float* x, int64_t g0, int64_t g1, int64_t g, uint8_t* codes,
                             uint16_t* scales, uint16_t* zeros, uint32_t* nonfinite, uint32_t* meta_overflow);

/// Tests only: false makes quantize_per_token() take the portable kernel even where this one
/// could run, so both can be compared in one process. Not thread-safe; default true.
void set_enabled(bool on);
bool enabled();

}  // namespace kvcache::quant::avx512
