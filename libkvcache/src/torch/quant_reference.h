// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file quant_reference.h (internal, kvcache::torch)
/// Plain LibTorch-ops reference of the integer quantizers (the `*_ref` of ggml): the
/// definition the fast kernels (int_kernels.h) are tested against bit for bit, and the
/// baseline bench_quant measures them against. Not used on any production path (and so not
/// part of kvcache::core, which has no LibTorch).

#include <ATen/ATen.h>

#include "kvcache/types.h"

namespace kvcache::quant::ref {

/// Unpacked result of the reference quantizer.
struct IntRefResult {
  at::Tensor codes;   ///< uint8, one code per value, shape of x
  at::Tensor packed;  ///< uint8, packed exactly as IntQuantizer stores QuantizedTensor::codes
  at::Tensor scales;  ///< fp16 (fp32 if some fp16 scale/zero would be ±Inf), layout of IntQuantizer
  at::Tensor zeros;   ///< same dtype/shape as scales
};

/// Quantizes x [B, H, T, D] (any float dtype) with `bits` ∈ {2, 3, 4, 8}, group g (> 0,
/// dividing D for kPerToken or T for kPerChannel), as IntQuantizer does. Assumes finite x.
IntRefResult quantize_int(const at::Tensor& x, int bits, int64_t g, GroupAxis axis);

/// Packs per-value codes (uint8, shape [B, H, T, D]) into IntQuantizer's byte layout
/// (int_kernels.h; int3: the low-two-bit plane, then the high-bit plane, per group).
at::Tensor pack_codes(const at::Tensor& codes, int bits, int64_t g, GroupAxis axis);
/// Inverse of pack_codes: `packed` → per-value codes of `shape` [B, H, T, D].
at::Tensor unpack_codes(const at::Tensor& packed, int bits, int64_t g, GroupAxis axis, at::IntArrayRef shape);

/// x̂ = code · scale + zero, float32 [B, H, T, D] (scales/zeros in IntQuantizer's layout;
/// fp32 metadata of a scale ≥ 2^96 at 1/4 scale and clamped to ±FLT_MAX, as int_kernels.h).
at::Tensor dequantize_int(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, int64_t g,
                          GroupAxis axis);

/// The orthonormal Sylvester Hadamard matrix H_d [d, d] float64, built by its definition
/// H_d[i][j] = (−1)^popcount(i & j) / √d (d a power of two): the reference of
/// hadamard_rows (hadamard.h), which computes x ↦ H_d · x for each row.
at::Tensor hadamard_matrix(int64_t d);

/// `x` converted to `dtype` as dequantize() returns it: round to nearest even, saturating at
/// the dtype's largest finite value (clamp, then cast).
at::Tensor to_dtype_saturating(const at::Tensor& x, at::ScalarType dtype);

}  // namespace kvcache::quant::ref
