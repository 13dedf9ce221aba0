// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cast_kernels.h (internal)
/// float32 → fp16 / bf16 conversion, round-to-nearest-even, in one vectorized pass that
/// also reports whether any input was NaN/Inf or any output overflowed to ±Inf (ATen's
/// single-threaded Float→Half copy plus a separate overflow scan ran at < 1 GB/s here).

#include <cstdint>
#include <vector>

namespace kvcache::quant {

struct CastStatus {
  bool nonfinite = false;  ///< some input was NaN/±Inf
  bool overflow = false;   ///< some finite input became ±Inf in the target type
};

/// out[i] = fp16(x[i]) (IEEE binary16 bits). Runs detail::parallel_for. |x| ≥ 65520 gives ±Inf
/// and reports overflow.
CastStatus cast_to_fp16(const float* x, int64_t n, uint16_t* out);
/// out[i] = fp16(x[i]), saturating: what would round to ±Inf becomes ±65504 (finite x).
void cast_to_fp16_saturating(const float* x, int64_t n, uint16_t* out);
/// out[i] = bf16(x[i]) (upper 16 bits of float32 after rounding to nearest even),
/// saturating: a finite x that would round to ±Inf (|x| within half a bf16 step of FLT_MAX)
/// becomes ±3.3895314e38, bf16's largest finite. `overflow` is never set.
CastStatus cast_to_bf16(const float* x, int64_t n, uint16_t* out);
/// out[i] = x[i] (a copy that also checks finiteness).
CastStatus copy_fp32(const float* x, int64_t n, float* out);
/// out[i] = float(x[i]) for IEEE binary16 / bfloat16 bits (exact). Runs detail::parallel_for.
void fp16_to_fp32(const uint16_t* x, int64_t n, float* out);
void bf16_to_fp32(const uint16_t* x, int64_t n, float* out);
/// The first n metadata values (norms, radii, scales) of a buffer stored as fp16 (`fp16` true)
/// or float32, as float32: a quantizer whose metadata falls back to float32 where fp16 would
/// overflow reads both forms alike.
std::vector<float> metadata_to_fp32(const void* data, bool fp16, int64_t n);

}  // namespace kvcache::quant
