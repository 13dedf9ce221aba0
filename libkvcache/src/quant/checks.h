// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file checks.h (internal)
/// Shared input checks of the quantizers, so every implementation words errors alike.

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/quantizer.h"
#include "kvcache/view.h"

namespace kvcache::quant {

/// Throws InvalidArgument naming the first non-finite element of `x` as
/// "<where>: x contains NaN at [b, h, t, d] = [0, 1, 5, 3] (...)". Call only when `x` is
/// known to hold a NaN/Inf (it scans the view); throws InternalError if it does not.
[[noreturn]] void throw_first_nonfinite(const TensorView& x, const std::string& where);

/// Throws InvalidArgument if `x` holds a NaN/Inf (naming the first one).
void check_finite(const TensorView& x, const std::string& where);

/// Throws InvalidArgument naming the first element of `x` (float32, row-major over `shape`)
/// whose fp16 conversion `codes` became ±Inf (fp16's range ±65504), if any.
void check_fp16_overflow(const float* x, const uint16_t* codes, const std::vector<int64_t>& shape,
                         const std::string& where);

/// Checks what a codebook quantizer (TurboQuant, PolarQuant, QJL keys) dequantizes: q.codes
/// uint8 of `code_shape`, q.scales fp16 (or float32, the overflow fallback) of `meta_shape`.
/// @throws InvalidArgument "<where>: q.codes must be contiguous uint8 of shape ..." or
///         "<where>: q.scales must be contiguous fp16 (or fp32) of shape ... (<meta_what>)".
void check_codes_and_metadata(const QuantizedTensor& q, const std::vector<int64_t>& code_shape,
                              const std::vector<int64_t>& meta_shape, const std::string& where,
                              const std::string& meta_what);

/// True if some x[0 .. n) is NaN or ±Inf.
bool any_nonfinite(const float* x, int64_t n);

/// [begin, end) of the bytes a view's elements occupy (for Buffer::ensure's overlap test).
std::pair<const void*, const void*> byte_range(const TensorView& v);

}  // namespace kvcache::quant
