// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/quantizer.h
/// The at::Tensor face of the quantizers (kvcache::torch target). Quantizer::quantize() and
/// quantize_into() take an at::Tensor as they are (kvcache/torch/tensor_view.h converts it);
/// these add the forms that return or reuse at::Tensors, with the messages of the calls named
/// as the user wrote them.

#include <ATen/ATen.h>

#include "kvcache/quantizer.h"
#include "kvcache/torch/tensor_view.h"

namespace kvcache {

/// The reconstruction of `q` as a new contiguous tensor of `q.shape` and `q.dtype` (the float32
/// reconstruction rounded to q.dtype, saturating: finite input never comes back ±Inf).
/// @throws InvalidArgument if `q.format` differs from the quantizer's spec() or q's buffers do
///         not fit its format (the message starts "dequantize(q) [spec]").
at::Tensor dequantize(const Quantizer& quantizer, const QuantizedTensor& q);

/// dequantize(quantizer, q) into a caller-held `out`: reused when it already is a contiguous
/// CPU tensor of q.shape and q.dtype that does not overlap q's buffers, else replaced by a new
/// one. Bit-identical to dequantize(); same errors (the message starts "dequantize_into(q, out)").
void dequantize_into(const Quantizer& quantizer, const QuantizedTensor& q, at::Tensor& out);

/// Reconstruction error with at:: ops (float32 tensors, float64 norms), as the study's tables
/// compute it. @throws InvalidArgument if shapes differ.
ReconstructionError reconstruction_error(const at::Tensor& x, const at::Tensor& x_hat);
/// Quantize-dequantize `x` with `q` (back to x's dtype) and measure the error with at:: ops.
ReconstructionError reconstruction_error(const Quantizer& q, const at::Tensor& x);

}  // namespace kvcache
