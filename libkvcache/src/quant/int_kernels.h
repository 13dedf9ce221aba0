// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file int_kernels.h (internal)
/// Fast kernels of the asymmetric min–max integer quantizers (int8/int4/int3/int2): plain
/// C++ loops over contiguous float32 data, written to auto-vectorize (see int_kernels.cpp).
/// The LibTorch-ops reference in src/torch/quant_reference.h defines the same results; tests compare both
/// bit-exactly.
///
/// Per group of g values, L = 2^b − 1: mn = min, mx = max (float32). The stored zero z and
/// scale s are chosen so that every value lies in [z, z + L·s] (up to float32 rounding) and
/// codes are computed from the STORED s and z (docs/quantizers.md, "arithmetic"):
///   fp16 metadata (the default): z = the largest fp16 ≤ mn (round down), then
///     s = the smallest fp16 ≥ (mx − z) / L (float32 division, then round up), and s = 2^-24
///     (the least fp16) if that is 0 while mx > z. A tensor with some mn outside ±65504, or
///     some s past 65504, reports meta_overflow (IntQuantizer then stores fp32 metadata).
///   fp32 metadata: z = mn, s = (mx − z) / L, at least 2^-126 (so 1/s is finite) when
///     mx > z; when (mx − z)/4 ≥ 2^98 the range is taken as 4·((mx/4 − z/4) / L), which
///     cannot overflow.
///   s = 0 only if mx == z (a constant group of an fp16-representable value, or any
///   constant group with fp32 metadata): every code is 0 and x̂ = z = x exactly.
///   inv = (s == 0 ? 0 : 1 / s),  code = clamp(rint((x − z) · inv), 0, 2^b − 1)
/// with rint = round-half-to-even. Reconstruction: x̂ = code · s + z (two roundings: no
/// fused multiply-add, so the reference's separate mul and add match bit for bit); with fp16
/// metadata it is finite (|x̂| ≤ 256·65504).
/// fp32 metadata with s ≥ 2^96 (a range near float32's limit): the same arithmetic at 1/4
/// scale so nothing overflows, r = 1/4: code = clamp(rint((x·r − z·r) · (1/(s·r))), 0, L),
/// x̂ = clamp(code·(s·r) + z·r, ±FLT_MAX·r) / r; with r = 1 (s < 2^96) these are the plain
/// formulas (the clamp cannot bind). Error bound: docs/quantizers.md.
///
/// Packing, b ∈ {8, 4, 2} (k = 8 / b codes per byte, group of g codes c[0..g)):
///   byte j (0 ≤ j < g/k) = Σ_{m<k} c[j + m·g/k] << (m·b)
/// i.e. int4: byte j = c[j] | c[j + g/2] << 4; int2: byte j = c[j] | c[j+g/4] << 2 |
/// c[j+g/2] << 4 | c[j+3g/4] << 6; int8: byte j = c[j]. Pairing element j with j + g/k
/// (instead of adjacent elements) lets both quantize and dequantize vectorize as plain
/// loops: each of the k code streams is a contiguous run of g/k values.
/// int3 (8 codes in 3 bytes; g a multiple of 8): two planes, the two low bits of every code
/// packed as int2 packs its codes, then the high bit of every code, 8 to a byte:
///   bytes [0, g/4):      byte j = Σ_{m<4} (c[j + m·g/4] & 3) << 2m
///   bytes [g/4, 3g/8):   byte g/4 + j = Σ_{m<8} (c[j + m·g/8] >> 2) << m
/// (the split of llama.cpp's q3_K, whose `qs` holds the low 2 bits and `hmask` the high bit).
///
/// Layouts (N = B·H_kv), `units` = g·b/8 bytes per group:
///   per-token  (GroupAxis::kPerToken):  x [N, T, D], groups of g along D.
///     codes [N, T, D·b/8], group k of a token occupies bytes [k·g·b/8, (k+1)·g·b/8);
///     scales/zeros [N, T, D/g].
///   per-channel (GroupAxis::kPerChannel): x [N, T, D], groups of g consecutive tokens of
///     one channel. A block is g tokens × D channels; codes [N, T·b/8, D]: block r
///     occupies code rows [r·g·b/8, (r+1)·g·b/8), each row D bytes, one per channel, packed
///     down the column as a per-token group packs along its bytes (row j, column d holds
///     tokens r·g + j + m·g/k of channel d; int3: rows [0, g/4) the low planes, rows
///     [g/4, 3g/8) the high bits); scales/zeros [N, T/g, D].

#include <cstdint>

namespace kvcache::quant {

/// Element type of stored scales and zeros.
enum class MetaType { kHalf, kFloat };

/// The integer widths the kernels implement (the registered int<b> heads), widest first.
inline constexpr int kIntBits[] = {8, 4, 3, 2};

/// Codes per packing unit: a group's size must be a multiple of it (8 / b bytes-worth of
/// codes per byte for b ∈ {8, 4, 2}; 8 codes per 3 bytes for int3).
constexpr int codes_per_unit(int bits) { return bits == 3 ? 8 : 8 / bits; }

/// What a quantize kernel found while reading its input.
struct KernelStatus {
  bool nonfinite = false;      ///< a NaN or ±Inf was read (results are garbage then)
  /// MetaType::kHalf only: some group's zero or scale has no finite fp16 (see above); that
  /// group's output is unusable. fp32 metadata never overflows.
  bool meta_overflow = false;
};

/// Per-token: `ngroups` groups of `g` contiguous floats at `x`. Writes ngroups·g·bits/8
/// bytes to `codes` and `ngroups` scales/zeros of type `meta` (fp16 bits or float).
/// Requires g % codes_per_unit(bits) == 0. Runs detail::parallel_for (common/parallel.h) over groups.
KernelStatus quantize_per_token(int bits, const float* x, int64_t ngroups, int64_t g,
                                uint8_t* codes, void* scales, void* zeros, MetaType meta);
void dequantize_per_token(int bits, const uint8_t* codes, const void* scales, const void* zeros,
                          MetaType meta, int64_t ngroups, int64_t g, float* out);

/// Per-channel: `nblocks` blocks of `g` rows × `d` columns (row-major, contiguous) at
/// `x`; groups run down each column of a block. Writes nblocks·g·bits/8·d code bytes
/// and nblocks·d scales/zeros. Requires g % codes_per_unit(bits) == 0.
KernelStatus quantize_per_channel(int bits, const float* x, int64_t nblocks, int64_t g, int64_t d,
                                  uint8_t* codes, void* scales, void* zeros, MetaType meta);
void dequantize_per_channel(int bits, const uint8_t* codes, const void* scales, const void* zeros,
                            MetaType meta, int64_t nblocks, int64_t g, int64_t d, float* out);

}  // namespace kvcache::quant
