// SPDX-License-Identifier: Apache-2.0
// The at::Tensor face of the quantizers (kvcache/torch/quantizer.h).
#include "kvcache/torch/quantizer.h"

#include <limits>

#include "kvcache/error.h"
#include "quant/as_call.h"

namespace kvcache {
namespace {

bool overlaps(const at::Tensor& t, const Buffer& b) {
  if (!b.defined() || !t.defined() || t.numel() == 0 || b.nbytes() == 0) return false;
  const auto* lo = static_cast<const char*>(t.data_ptr());
  const auto* hi = lo + t.numel() * static_cast<int64_t>(t.element_size());
  const auto* blo = static_cast<const char*>(b.data());
  return lo < blo + b.nbytes() && blo < hi;
}

}  // namespace

at::Tensor dequantize(const Quantizer& quantizer, const QuantizedTensor& q) {
  const std::string me = quantizer.spec();
  at::Tensor out;
  quant::as_call("dequantize_into(q, out) [" + me + "]", "dequantize(q) [" + me + "]", [&] {
    quantizer.check_dequantizable(q);  // before q.shape sizes an allocation
    out = at::empty(q.shape, at::TensorOptions().dtype(scalar_type_of(q.dtype)));
    quantizer.dequantize_into(q, mutable_view_of(out));
  });
  return out;
}

void dequantize_into(const Quantizer& quantizer, const QuantizedTensor& q, at::Tensor& out) {
  quantizer.check_dequantizable(q);  // before q.shape sizes an allocation
  bool fits = out.defined() && out.device().is_cpu() && out.is_contiguous() && out.sizes().vec() == q.shape &&
              out.scalar_type() == scalar_type_of(q.dtype);
  fits = fits && !overlaps(out, q.codes) && !overlaps(out, q.scales) && !overlaps(out, q.zeros);
  for (const auto& kv : q.side) fits = fits && !overlaps(out, kv.second);
  at::Tensor target = fits ? out : at::empty(q.shape, at::TensorOptions().dtype(scalar_type_of(q.dtype)));
  quantizer.dequantize_into(q, mutable_view_of(target));
  out = target;
}

ReconstructionError reconstruction_error(const at::Tensor& x, const at::Tensor& x_hat) {
  KV_CHECK_ARG(x.defined() && x_hat.defined(), "reconstruction_error(x, x_hat): undefined tensor");
  KV_CHECK_ARG(x.sizes() == x_hat.sizes(), "reconstruction_error(x, x_hat): shapes differ: x ",
               shape_str(x.sizes().vec()), " vs x_hat ", shape_str(x_hat.sizes().vec()));
  ReconstructionError e;
  if (x.numel() == 0) return e;
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor diff = xf - x_hat.to(at::kFloat);
  const double num = at::linalg_vector_norm(diff, 2, c10::nullopt, false, at::kDouble).item<double>();
  const double den = at::linalg_vector_norm(xf, 2, c10::nullopt, false, at::kDouble).item<double>();
  e.max_abs = diff.abs().max().to(at::kDouble).item<double>();
  if (den > 0) {
    e.rel_fro = num / den;
  } else {
    e.rel_fro = num == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  }
  return e;
}

ReconstructionError reconstruction_error(const Quantizer& q, const at::Tensor& x) {
  return reconstruction_error(x, dequantize(q, q.quantize(x)));
}

}  // namespace kvcache
