// SPDX-License-Identifier: Apache-2.0
#include "quant/fp8_quantizer.h"

#include "kvcache/error.h"
#include "quant/checks.h"

namespace kvcache::quant {

std::string Fp8Quantizer::spec() const {
  return std::string("fp8:") + fp8_name(format_) + (scaled_ ? ":scaled" : "");
}

QuantizedTensor Fp8Quantizer::do_quantize(const at::Tensor& x) const {
  const std::string where = "quantize(x) [" + spec() + "]";
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  QuantizedTensor q;
  q.format = spec();
  q.shape = x.sizes().vec();
  q.dtype = x.scalar_type();
  q.codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  float scale = 1.0f;
  if (scaled_) {
    const float amax = xf.numel() > 0 ? xf.abs().max().item<float>() : 0.0f;
    if (!std::isfinite(amax)) throw_first_nonfinite(x, where);
    scale = amax > 0.0f ? amax / fp8_max(format_) : 1.0f;
    if (scale == 0.0f) scale = 1.0f;  // amax below float32's subnormal range × max: keep codes finite
    q.scales = at::full({1}, scale, x.options().dtype(at::kFloat));
  }
  if (fp8_encode_array(xf.data_ptr<float>(), xf.numel(), scale, format_, q.codes.data_ptr<uint8_t>())) {
    throw_first_nonfinite(x, where);
  }
  return q;
}

at::Tensor Fp8Quantizer::do_dequantize(const QuantizedTensor& q) const {
  const std::string where = "dequantize(q) [" + spec() + "]";
  KV_CHECK_ARG(q.codes.scalar_type() == at::kByte && q.codes.sizes().vec() == q.shape && q.codes.is_contiguous(),
               where, ": q.codes must be contiguous uint8 of shape ", shape_str(q.shape), ", got ",
               q.codes.scalar_type(), " ", shape_str(q.codes.sizes()));
  float scale = 1.0f;
  if (scaled_) {
    KV_CHECK_ARG(q.scales.defined() && q.scales.numel() == 1 && q.scales.scalar_type() == at::kFloat, where,
                 ": q.scales must hold one fp32 per-tensor scale");
    scale = q.scales.item<float>();
  }
  at::Tensor out = at::empty(q.shape, q.codes.options().dtype(at::kFloat));
  fp8_decode_array(q.codes.data_ptr<uint8_t>(), out.numel(), scale, format_, out.data_ptr<float>());
  return q.dtype == at::kFloat ? out : out.to(q.dtype);
}

}  // namespace kvcache::quant
