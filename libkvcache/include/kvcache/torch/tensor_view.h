// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/tensor_view.h
/// The at::Tensor face of the core's views (kvcache::torch target): with this header included,
/// an at::Tensor converts implicitly to a TensorView (read-only arguments) or a
/// MutableTensorView (outputs written in place) wherever the core takes one — the pointer,
/// sizes, strides and dtype of the tensor, no copy. Only CPU tensors convert (InvalidArgument
/// naming the device otherwise); an undefined tensor becomes an undefined view, which the
/// core rejects naming the argument.

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "kvcache/buffer.h"
#include "kvcache/view.h"

namespace kvcache {

/// The DType of an ATen scalar type. @throws InvalidArgument for a type the core has no name
/// for (complex, quantized, ...), naming it.
DType dtype_of(at::ScalarType t);
/// The ATen scalar type of a DType.
at::ScalarType scalar_type_of(DType t);

/// A view of a CPU tensor (undefined: an undefined view).
/// @throws InvalidArgument for a tensor of another device or of a dtype without a DType, or of
///         more than kMaxViewRank dimensions.
TensorView view_of(const at::Tensor& t);
MutableTensorView mutable_view_of(at::Tensor& t);

/// "[1, 2, 256, 64] float32" for a tensor (as kvcache::shape_str names a view; "undefined").
std::string shape_str(const at::Tensor& t);

/// Views of each tensor (for the core's vector-of-views arguments, e.g. TensorLayerView's ragged heads).
std::vector<TensorView> views(const std::vector<at::Tensor>& ts);

/// A Buffer's memory as an at::Tensor of its shape and dtype, without copying: valid while the
/// buffer lives and is not reallocated (an undefined buffer gives an undefined tensor).
at::Tensor as_tensor(const Buffer& b);
/// A copy of a Buffer as a fresh at::Tensor.
at::Tensor to_tensor(const Buffer& b);

template <>
struct ViewTraits<at::Tensor> {
  static TensorView view(const at::Tensor& t) { return view_of(t); }
  static MutableTensorView mutable_view(at::Tensor& t) { return mutable_view_of(t); }
};

}  // namespace kvcache
