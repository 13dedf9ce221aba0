// SPDX-License-Identifier: Apache-2.0
#include "quant/checks.h"

#include <cmath>

#include "common/view_ops.h"
#include "kvcache/error.h"

namespace kvcache::quant {

void throw_first_nonfinite(const TensorView& x, const std::string& where) {
  const std::vector<int64_t> idx = detail::first_nonfinite(x);
  KV_INTERNAL_ASSERT(!idx.empty(), "mask has no true element");
  const double v = detail::value_at(x, idx);
  const char* what = std::isnan(v) ? "NaN" : (v > 0 ? "+Inf" : "-Inf");
  throw InvalidArgument(detail::str_cat(where, ": x contains ", what, " at [b, h, t, d] = ", detail::index_str(idx),
                                        " (expected finite values; shape ", shape_str(x.sizes()), ")"));
}

void check_finite(const TensorView& x, const std::string& where) {
  if (!detail::first_nonfinite(x).empty()) throw_first_nonfinite(x, where);
}

void check_fp16_overflow(const float* x, const uint16_t* codes, const std::vector<int64_t>& shape,
                         const std::string& where) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  for (int64_t i = 0; i < n; ++i) {
    if ((codes[i] & 0x7c00u) != 0x7c00u) continue;
    std::vector<int64_t> idx(shape.size());
    int64_t r = i;
    for (size_t k = shape.size(); k-- > 0;) {
      idx[k] = r % shape[k];
      r /= shape[k];
    }
    throw InvalidArgument(detail::str_cat(where, ": x = ", static_cast<double>(x[i]), " at [b, h, t, d] = ",
                                          detail::index_str(idx), " is outside fp16's range ±65504",
                                          "; use a wider format (bf16 or fp32) or rescale the input"));
  }
}

std::pair<const void*, const void*> byte_range(const TensorView& v) {
  if (!v.defined() || v.numel() == 0) return {nullptr, nullptr};
  int64_t last = 0;
  for (int i = 0; i < v.rank; ++i) last += (v.shape[i] - 1) * v.strides[i];
  const auto* b = static_cast<const char*>(v.data);
  return {b, b + (last + 1) * dtype_size(v.dtype)};
}

void check_codes_and_metadata(const QuantizedTensor& q, const std::vector<int64_t>& code_shape,
                              const std::vector<int64_t>& meta_shape, const std::string& where,
                              const std::string& meta_what) {
  KV_CHECK_ARG(q.codes.dtype() == DType::kUInt8 && q.codes.shape() == code_shape, where,
               ": q.codes must be contiguous uint8 of shape ", shape_str(code_shape), ", got ",
               to_string(q.codes.dtype()), " ", shape_str(q.codes.shape()));
  KV_CHECK_ARG(q.scales.defined() && q.scales.shape() == meta_shape &&
                   (q.scales.dtype() == DType::kFloat16 || q.scales.dtype() == DType::kFloat32),
               where, ": q.scales must be contiguous fp16 (or fp32) of shape ", shape_str(meta_shape), " (", meta_what,
               ")");
}

bool any_nonfinite(const float* x, int64_t n) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) bad = bad || !std::isfinite(x[i]);
  return bad;
}

}  // namespace kvcache::quant
