// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file checks.h (internal)
/// Shared input checks of the quantizers, so every implementation words errors alike, and
/// the conversion of a reconstruction back to the input's dtype.

#include <ATen/ATen.h>

#include <string>

namespace kvcache::quant {

/// "[1, 2, 256, 64]"
std::string shape_str(at::IntArrayRef shape);

/// Throws InvalidArgument naming the first non-finite element of `x` as
/// "<where>: x contains NaN at [b, h, t, d] = [0, 1, 5, 3] (...)". Call only when `x` is
/// known to hold a NaN/Inf (it scans the tensor); throws InternalError if it does not.
[[noreturn]] void throw_first_nonfinite(const at::Tensor& x, const std::string& where);

/// Throws InvalidArgument if `x` holds a NaN/Inf (naming the first one).
void check_finite(const at::Tensor& x, const std::string& where);

/// Throws InvalidArgument naming the first element of `original` whose conversion
/// `converted` became ±Inf (out of the target type's range `range_text`), if any.
void check_no_overflow(const at::Tensor& original, const at::Tensor& converted,
                       const std::string& where, const std::string& type_name,
                       const std::string& range_text);

/// A float32 reconstruction (finite) converted to `dtype` (float32, float16 or bfloat16),
/// rounding to nearest even and SATURATING: a value past the dtype's largest finite becomes
/// that largest finite value (±65504, ±3.3895e38) instead of ±Inf. The input came from finite
/// values of that dtype, so saturating only moves a reconstruction closer to it. Returns
/// `x_f32` itself for float32.
at::Tensor to_input_dtype(const at::Tensor& x_f32, at::ScalarType dtype);

/// `t` itself when it is a contiguous CPU tensor of `shape` and `dtype` that shares no storage
/// with any of `avoid` (entries may be undefined), else `t` replaced by at::empty(shape, dtype). For the
/// *_into() forms of the quantizers: a buffer that fits is overwritten, not reallocated.
at::Tensor& reuse_or_empty(at::Tensor& t, at::IntArrayRef shape, at::ScalarType dtype,
                           at::TensorList avoid = {});

/// Where a dequantize_into() writes its float32 reconstruction: `result` itself (reused by
/// reuse_or_empty) when the output dtype `dtype` is float32, else `scratch`, set to a fresh
/// float32 tensor that the caller then converts into `result` (to_input_dtype).
at::Tensor& float32_target(at::Tensor& result, at::Tensor& scratch, at::IntArrayRef shape, at::ScalarType dtype,
                           at::TensorList avoid);

}  // namespace kvcache::quant
