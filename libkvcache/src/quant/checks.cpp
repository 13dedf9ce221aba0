// SPDX-License-Identifier: Apache-2.0
#include "quant/checks.h"

#include <cmath>
#include <sstream>

#include "kvcache/error.h"
#include "quant/cast_kernels.h"

namespace kvcache::quant {
namespace {

/// Index [b, h, t, d] of the first true element of the boolean `mask` (row-major order).
std::vector<int64_t> first_index(const at::Tensor& mask) {
  const at::Tensor idx = mask.nonzero();  // [n, dim] int64, row-major order
  KV_INTERNAL_ASSERT(idx.size(0) > 0, "mask has no true element");
  const at::Tensor row = idx[0].contiguous();
  return std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
}

std::string index_str(const std::vector<int64_t>& idx) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < idx.size(); ++i) os << (i ? ", " : "") << idx[i];
  os << "]";
  return os.str();
}

double value_at(const at::Tensor& x, const std::vector<int64_t>& idx) {
  at::Tensor v = x;
  for (int64_t i : idx) v = v.select(0, i);
  return v.to(at::kDouble).item<double>();
}

}  // namespace

std::string shape_str(at::IntArrayRef shape) { return index_str(shape.vec()); }

void throw_first_nonfinite(const at::Tensor& x, const std::string& where) {
  const auto idx = first_index(at::isfinite(x).logical_not());
  const double v = value_at(x, idx);
  const char* what = std::isnan(v) ? "NaN" : (v > 0 ? "+Inf" : "-Inf");
  throw InvalidArgument(detail::str_cat(where, ": x contains ", what, " at [b, h, t, d] = ",
                                        index_str(idx), " (expected finite values; shape ",
                                        shape_str(x.sizes()), ")"));
}

void check_finite(const at::Tensor& x, const std::string& where) {
  if (!at::isfinite(x).all().item<bool>()) throw_first_nonfinite(x, where);
}

void check_no_overflow(const at::Tensor& original, const at::Tensor& converted, const std::string& where,
                       const std::string& type_name, const std::string& range_text) {
  const at::Tensor inf = at::isinf(converted);
  if (!inf.any().item<bool>()) return;
  const auto idx = first_index(inf);
  throw InvalidArgument(detail::str_cat(where, ": x = ", value_at(original, idx), " at [b, h, t, d] = ",
                                        index_str(idx), " is outside ", type_name, "'s range ", range_text,
                                        "; use a wider format (bf16 or fp32) or rescale the input"));
}

at::Tensor& reuse_or_empty(at::Tensor& t, at::IntArrayRef shape, at::ScalarType dtype, at::TensorList avoid) {
  bool fits = t.defined() && t.device().is_cpu() && t.scalar_type() == dtype && t.sizes() == shape &&
              t.is_contiguous();
  for (const at::Tensor& a : avoid) fits = fits && !(a.defined() && t.is_alias_of(a));
  if (!fits) t = at::empty(shape, at::TensorOptions().dtype(dtype));
  return t;
}

at::Tensor& float32_target(at::Tensor& result, at::Tensor& scratch, at::IntArrayRef shape, at::ScalarType dtype,
                           at::TensorList avoid) {
  if (dtype == at::kFloat) return reuse_or_empty(result, shape, at::kFloat, avoid);
  scratch = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  return scratch;
}

at::Tensor to_input_dtype(const at::Tensor& x_f32, at::ScalarType dtype) {
  if (dtype == at::kFloat) return x_f32;
  KV_INTERNAL_ASSERT(x_f32.scalar_type() == at::kFloat && x_f32.is_contiguous() &&
                         (dtype == at::kHalf || dtype == at::kBFloat16),
                     "to_input_dtype: bad arguments");
  at::Tensor out = at::empty(x_f32.sizes(), x_f32.options().dtype(dtype));
  const float* src = x_f32.data_ptr<float>();
  if (dtype == at::kHalf) {
    cast_to_fp16_saturating(src, x_f32.numel(), reinterpret_cast<uint16_t*>(out.data_ptr<at::Half>()));
  } else {
    (void)cast_to_bf16(src, x_f32.numel(), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  }
  return out;
}

}  // namespace kvcache::quant
