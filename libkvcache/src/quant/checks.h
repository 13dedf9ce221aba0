// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file checks.h (internal)
/// Shared input checks of the quantizers, so every implementation words errors alike.

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

}  // namespace kvcache::quant
