// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file float_quantizer.h (internal)
/// fp32 / fp16 / bf16: the tensor is stored as a plain cast to the storage dtype.
/// QuantizedTensor.codes holds the values in that dtype (4 or 2 bytes per value); no scales.
/// fp16 rejects values outside ±65504 (they would become Inf); bf16 saturates the values
/// within half a bf16 step of FLT_MAX to its largest finite ±3.3895e38 (never Inf).
/// dequantize() to an fp16 input saturates too (fp16's 65504 is 65536 in bf16).

#include "kvcache/quantizer.h"

namespace kvcache::quant {

class FloatCastQuantizer final : public Quantizer {
 public:
  /// The spec table of `fp32`, `fp16` or `bf16` (no fields), by storage dtype.
  static const ParamTable& table(DType storage);

  /// `storage` ∈ {kFloat32, kFloat16, kBFloat16}; `name` is the spec head ("fp32", "fp16", "bf16").
  FloatCastQuantizer(DType storage, std::string name);

  std::string spec() const override { return canonical_spec(table(storage_), {}, {}); }
  double bits_per_value(int64_t head_dim) const override;
  /// The storage dtype (kFloat32, kFloat16, kBFloat16).
  DType storage() const { return storage_; }

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
  DType storage_;
  std::string name_;
};

}  // namespace kvcache::quant
