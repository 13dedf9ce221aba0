// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file fp8_quantizer.h (internal)
/// fp8:e4m3 / fp8:e5m2 [:scaled]: one FP8 byte per value (codec in fp8.h), as vLLM's fp8
/// KV cache (methods.md b.7). Unscaled: codes = fp8(x). Scaled: one per-tensor fp32 scale
/// s = amax(|x|) / max_finite (448 or 57344; s = 1 if x == 0) held in QuantizedTensor.scales
/// (shape [1]), codes = fp8(x / s), x̂ = decode(code) · s.
/// codes: uint8 [B, H_kv, T, D], one byte per value, same order as x.

#include "kvcache/quantizer.h"
#include "quant/fp8.h"

namespace kvcache::quant {

class Fp8Quantizer final : public Quantizer {
 public:
  /// The spec table of `fp8` (format e4m3|e5m2, shown in the canonical form; unscaled|scaled).
  static const ParamTable& table();

  Fp8Quantizer(Fp8Format format, bool scaled) : format_(format), scaled_(scaled) {}

  /// Always names the format (the table marks it shown): "fp8:e4m3", "fp8:e5m2:scaled".
  std::string spec() const override;
  double bits_per_value(int64_t /*head_dim*/) const override { return 8.0; }

  Fp8Format format() const { return format_; }
  /// Scaled: amax(|x|) / max_finite (1 when x == 0), as quantize() computes its scale.
  float fit_tensor_scale(const TensorView& x) const override;
  bool scaled() const { return scaled_; }

 protected:
  bool checks_finite_itself() const override { return true; }
  void do_quantize_into(const Input& in, QuantizedTensor& out) const override;
  void do_dequantize_into(const QuantizedTensor& q, float* out) const override;
  StoredLayout do_stored_layout(int64_t head_dim) const override;
  EncodeStatus do_encode(const float* x, int64_t groups, int64_t head_dim, float tensor_scale,
                         GroupBuffers out) const override;
  void do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float tensor_scale,
                 float* out) const override;

 private:
  Fp8Format format_;
  bool scaled_;
};

}  // namespace kvcache::quant
