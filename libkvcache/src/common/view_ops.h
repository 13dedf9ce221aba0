// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file view_ops.h (internal)
/// What the core does with the caller's views: read them as contiguous float32 (borrowing a
/// contiguous float32 view, converting anything else once), find the first non-finite element
/// (naming its index), write a float32 result through an output view of any float dtype and
/// strides (fp16 saturating, bf16 rounding to nearest even, as dequantize() promises).

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/view.h"

namespace kvcache::detail {

/// A float view's values as contiguous float32: `data` points into the caller's memory when the
/// view already is contiguous float32, else into `owned` (converted exactly: fp16/bf16 widen
/// without rounding). The view must be defined and of dtype float32/float16/bfloat16.
struct Float32Rows {
  const float* data = nullptr;
  int64_t numel = 0;
  std::vector<float> owned;
};
void read_float32(const TensorView& v, Float32Rows& out);
/// The same into a fresh vector (always a copy).
std::vector<float> to_float32(const TensorView& v);
/// A contiguous int64 view's values, or a copy of a strided one. Requires dtype kInt64.
std::vector<int64_t> to_int64(const TensorView& v);

/// Index (rank entries) of the first NaN/±Inf of a float view in row-major order; empty if none.
std::vector<int64_t> first_nonfinite(const TensorView& v);
/// The value at `index` as a double.
double value_at(const TensorView& v, const std::vector<int64_t>& index);
/// "[0, 1, 5, 3]"
std::string index_str(const std::vector<int64_t>& index);

/// Writes `src` (`out.numel()` floats, row-major over out's shape) into `out` (float32, float16
/// saturating at ±65504, or bfloat16 saturating at ±3.3895e38: round to nearest even), any strides.
void write_float32(const float* src, const MutableTensorView& out);

/// Calls fn(offset_elements, linear_index) for every element of a view of `shape`/`strides`
/// (rank 0..4) in row-major order.
template <class Fn>
void for_each_element(int rank, const int64_t* shape, const int64_t* strides, Fn&& fn) {
  int64_t s[kMaxViewRank] = {1, 1, 1, 1}, st[kMaxViewRank] = {0, 0, 0, 0};
  const int pad = kMaxViewRank - (rank > 0 ? rank : 0);
  for (int i = 0; i < rank; ++i) {
    s[pad + i] = shape[i];
    st[pad + i] = strides[i];
  }
  int64_t linear = 0;
  for (int64_t a = 0; a < s[0]; ++a) {
    for (int64_t b = 0; b < s[1]; ++b) {
      for (int64_t c = 0; c < s[2]; ++c) {
        const int64_t base = a * st[0] + b * st[1] + c * st[2];
        for (int64_t d = 0; d < s[3]; ++d) fn(base + d * st[3], linear++);
      }
    }
  }
}

}  // namespace kvcache::detail
