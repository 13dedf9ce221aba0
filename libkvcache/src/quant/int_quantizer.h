// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file int_quantizer.h (internal)
/// int8 / int4 / int3 / int2: asymmetric min–max group quantization (methods.md b.1; the KIVI
/// arXiv 2402.02750, HF quantized-cache and GEAR arXiv 2403.05527 core), with fp16 scale
/// and zero (= group minimum) per group, codes round-half-to-even then clamp, bit-packed.
/// Semantics, packing and layouts: int_kernels.h and docs/quantizers.md.
///
/// Spec: `int<b>[:g<group>][:chan]`
///   - per-token (default): groups of g consecutive values along head_dim; g0 (default)
///     means g = head_dim. codes uint8 [B, H, T, D·b/8]; scales/zeros [B, H, T, D/g].
///   - `chan`: groups of g consecutive tokens of one channel (KIVI keys); g is required.
///     codes uint8 [B, H, T·b/8, D]; scales/zeros [B, H, T/g, D].
/// Metadata is fp16 unless some scale or zero of the tensor falls outside fp16's range
/// (|values| ≳ 65504, possible in bf16/fp32 input); then the whole tensor's scales and zeros
/// are stored as fp32 (nbytes() grows accordingly) instead of overflowing to Inf. The zero
/// is rounded down and the scale up so that every value lies in [z, z + L·s]: the error
/// bound of docs/quantizers.md holds; dequantize() saturates to the input dtype's range.

#include "kvcache/quantizer.h"

namespace kvcache::quant {

class IntQuantizer final : public Quantizer {
 public:
  /// The spec table of `int<bits>` (fields g, tok|chan). @throws InvalidArgument if bits ∉ {2, 3, 4, 8}.
  static const ParamTable& table(int bits);

  /// @throws InvalidArgument if `bits` ∉ {2, 3, 4, 8}, g < 0, g is not a multiple of
  ///         codes_per_unit(bits) (8/bits; 8 for int3), or axis is per-channel with g == 0.
  IntQuantizer(int bits, int64_t group, GroupAxis axis);

  std::string spec() const override;
  double bits_per_value(int64_t head_dim) const override;
  GroupAxis group_axis() const override { return axis_; }

  int bits() const { return bits_; }
  /// Group size as given (0 = head_dim, per-token only).
  int64_t group() const { return group_; }
  /// Group size used for an input with this head_dim.
  int64_t group_for(int64_t head_dim) const;

 protected:
  void check_input(const TensorView& x) const override;
  bool checks_finite_itself() const override { return true; }
  void do_quantize_into(const Input& in, QuantizedTensor& out) const override;
  void do_dequantize_into(const QuantizedTensor& q, float* out) const override;
  StoredLayout do_stored_layout(int64_t head_dim) const override;
  EncodeStatus do_encode(const float* x, int64_t groups, int64_t head_dim, float tensor_scale,
                         GroupBuffers out) const override;
  void do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float tensor_scale,
                 float* out) const override;

 private:
  int bits_;
  int64_t group_;
  GroupAxis axis_;
};

}  // namespace kvcache::quant
