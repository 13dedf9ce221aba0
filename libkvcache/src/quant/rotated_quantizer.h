// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file rotated_quantizer.h (internal)
/// `had(<quantizer>)`: the quantizer rotated per KV head by the orthonormal Hadamard matrix
/// H_D (QuaRot, arXiv 2404.00456; llama.cpp rotates its quantized KV cache the same way):
/// every row x of D values (one token of one head) is stored as inner(H_D · x) and read back
/// as H_D · inner⁻¹(codes) (H_D · H_D = I). The rotation spreads outlier channels over the
/// whole row before per-token (or per-channel) quantization; an fp32 inner format reproduces
/// x to float rounding (≈ 1e-7 relative).
///
/// Stored bytes, layout, group axis and bits per value are the inner quantizer's: the same
/// codes, scales and zeros, of rotated values. head_dim must be a power of two (Sylvester
/// construction; hadamard.h): other head dims are rejected with InvalidArgument naming it.
/// Readers that decode blocks (the cache's generic attention path) get original-domain
/// values back, so q·k and p·v need nothing else; the fused kernels do not read it.

#include <memory>
#include <string>
#include <vector>

#include "kvcache/quantizer.h"

namespace kvcache::quant {

class RotatedQuantizer final : public Quantizer {
 public:
  /// The table of the `had` wrapper: field `kv` (rotate K and V, default) | `k` (keys only;
  /// only for cache schemes: a lone quantizer has no K/V).
  static const ParamTable& table();

  explicit RotatedQuantizer(std::shared_ptr<const Quantizer> inner);

  std::string spec() const override;
  double bits_per_value(int64_t head_dim) const override { return inner_->bits_per_value(head_dim); }
  GroupAxis group_axis() const override { return inner_->group_axis(); }
  /// The inner quantizer's scale for the rotated values (fp8:*:scaled).
  float fit_tensor_scale(const TensorView& x) const override;

  const Quantizer& inner() const { return *inner_; }

 protected:
  void check_input(const TensorView& x) const override;
  /// The inner quantizer's quantize() of the rotated x (a temporary copy).
  QuantizedTensor do_quantize(const Input& in) const override;
  /// The inner quantizer's buffer-reusing quantize_into() of the rotated x.
  void do_quantize_into(const Input& in, QuantizedTensor& out) const override;
  /// The inner reconstruction, rotated back in place.
  void do_dequantize_into(const QuantizedTensor& q, float* out) const override;
  StoredLayout do_stored_layout(int64_t head_dim) const override;
  EncodeStatus do_encode(const float* x, int64_t groups, int64_t head_dim, float tensor_scale,
                         GroupBuffers out) const override;
  void do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float tensor_scale,
                 float* out) const override;

 private:
  /// H_D x of validated input (float32 contiguous [..., D]); throws naming `where` when the
  /// rotation exceeds float32.
  std::vector<float> rotate(const TensorView& x, const std::string& where) const;
  std::shared_ptr<const Quantizer> inner_;
};

}  // namespace kvcache::quant
