// SPDX-License-Identifier: Apache-2.0
// The at::Tensor face of the core's views (kvcache/torch/tensor_view.h).
#include "kvcache/torch/tensor_view.h"

#include <sstream>

#include "kvcache/error.h"

namespace kvcache {

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kDouble: return DType::kFloat64;
    case at::kByte: return DType::kUInt8;
    case at::kChar: return DType::kInt8;
    case at::kShort: return DType::kInt16;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kBool: return DType::kBool;
    default: break;
  }
  throw InvalidArgument(detail::str_cat("a tensor of dtype ", t,
                                        " has no view (expected float32, float16, bfloat16, int64 or another real type)"));
}

at::ScalarType scalar_type_of(DType t) {
  switch (t) {
    case DType::kFloat32: return at::kFloat;
    case DType::kFloat16: return at::kHalf;
    case DType::kBFloat16: return at::kBFloat16;
    case DType::kFloat64: return at::kDouble;
    case DType::kUInt8: return at::kByte;
    case DType::kInt8: return at::kChar;
    case DType::kInt16: return at::kShort;
    case DType::kInt32: return at::kInt;
    case DType::kInt64: return at::kLong;
    case DType::kBool: return at::kBool;
  }
  return at::kFloat;
}

namespace {

template <class View, class Ptr>
View make_view(const at::Tensor& t, Ptr data) {
  View v;
  if (!t.defined()) return v;
  std::ostringstream dev;
  dev << t.device();
  KV_CHECK_ARG(t.device().is_cpu(), "a tensor on ", dev.str(), " has no view (expected a CPU tensor)");
  KV_CHECK_ARG(t.dim() <= kMaxViewRank, "a ", t.dim(), "-D tensor has no view (at most ", kMaxViewRank,
               " dimensions)");
  v.data = data;
  v.dtype = dtype_of(t.scalar_type());
  v.rank = static_cast<int>(t.dim());
  for (int i = 0; i < v.rank; ++i) {
    v.shape[i] = t.size(i);
    v.strides[i] = t.stride(i);
  }
  return v;
}

}  // namespace

TensorView view_of(const at::Tensor& t) {
  return make_view<TensorView>(t, t.defined() ? static_cast<const void*>(t.data_ptr()) : nullptr);
}

MutableTensorView mutable_view_of(at::Tensor& t) {
  return make_view<MutableTensorView>(t, t.defined() ? t.data_ptr() : nullptr);
}

std::string shape_str(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream dtype;
  dtype << t.scalar_type();
  const std::vector<int64_t> sizes = t.sizes().vec();
  switch (t.scalar_type()) {
    case at::kFloat: case at::kHalf: case at::kBFloat16: case at::kDouble: case at::kByte: case at::kChar:
    case at::kShort: case at::kInt: case at::kLong: case at::kBool:
      return shape_str(sizes) + " " + to_string(dtype_of(t.scalar_type()));
    default: return shape_str(sizes) + " " + dtype.str();
  }
}

std::vector<TensorView> views(const std::vector<at::Tensor>& ts) {
  std::vector<TensorView> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(view_of(t));
  return out;
}

at::Tensor as_tensor(const Buffer& b) {
  if (!b.defined()) return at::Tensor();
  return at::from_blob(const_cast<void*>(b.data()), b.shape(), at::TensorOptions().dtype(scalar_type_of(b.dtype())));
}

at::Tensor to_tensor(const Buffer& b) {
  if (!b.defined()) return at::Tensor();
  return as_tensor(b).clone();
}

}  // namespace kvcache
