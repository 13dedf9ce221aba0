// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file quantizer.h
/// The Quantizer interface, the QuantizedTensor it produces, and the factory.
///
/// A Quantizer turns a K or V tensor `[B, H_kv, T, D]` (float32/float16/bfloat16) into a
/// QuantizedTensor that holds exactly the bytes a cache would store (packed codes, fp16
/// scales/zeros, side tensors such as outliers or low-rank factors). `nbytes()` is summed
/// over the tensors really held: memory is measured, never computed from a formula.

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/spec.h"
#include "kvcache/types.h"

namespace kvcache {

/// The stored form of one quantized K or V tensor.
struct QuantizedTensor {
  /// Canonical spec of the quantizer that produced it (e.g. "int4:g32", "fp8:e5m2").
  /// Dequantizing with a quantizer of another spec is an error.
  std::string format;
  /// Logical shape `[B, H_kv, T, D]` of the original tensor.
  std::vector<int64_t> shape;
  /// dtype of the original tensor; dequantize() returns this dtype.
  at::ScalarType dtype = at::kFloat;
  /// Packed codes, uint8 (or the raw values for float formats: fp16/bf16/fp32 bytes).
  at::Tensor codes;
  /// Per-group scales (fp16 for integer formats; fp32 per-tensor scale for fp8). May be undefined.
  at::Tensor scales;
  /// Per-group zero points (= group minimum, fp16). May be undefined.
  at::Tensor zeros;
  /// Named side tensors (outlier values/indices, low-rank factors, ...). May be empty.
  std::map<std::string, at::Tensor> side;

  /// Bytes really held: sum of numel * element_size over every defined tensor above.
  int64_t nbytes() const;
  /// Number of logical values (product of `shape`).
  int64_t numel() const;
};

/// Base class of all quantizers. Public methods validate their input once and then call
/// the protected virtuals, so implementations may assume valid input.
class Quantizer {
 public:
  virtual ~Quantizer() = default;

  /// Canonical spec string; `make_quantizer(spec())` builds an equivalent quantizer.
  virtual std::string spec() const = 0;

  /// Effective bits per stored value for a tensor with this head_dim, counting codes and
  /// per-group metadata (scales, zeros) spread over the group. E.g. int4 with g = 64 → 4.5.
  /// Per-tensor metadata (the fp32 fp8 scale) is excluded as it vanishes per value.
  virtual double bits_per_value(int64_t head_dim) const = 0;

  /// Axis along which groups run (per-token along head_dim by default).
  virtual GroupAxis group_axis() const { return GroupAxis::kPerToken; }

  /// Quantizes `x` `[B, H_kv, T, D]`, dtype float32/float16/bfloat16, any strides.
  /// @throws InvalidArgument if `x` is not 4-D, has another dtype, contains NaN/Inf
  ///         (the message names the first bad index), or its grouped axis is not divisible
  ///         by the group size (the message names both numbers).
  QuantizedTensor quantize(const at::Tensor& x) const;

  /// Reconstructs a tensor of `q.shape` and `q.dtype`.
  /// @throws InvalidArgument if `q.format` differs from spec().
  at::Tensor dequantize(const QuantizedTensor& q) const;

 protected:
  virtual QuantizedTensor do_quantize(const at::Tensor& x) const = 0;
  virtual at::Tensor do_dequantize(const QuantizedTensor& q) const = 0;
  /// Extra validation of input beyond shape/dtype/finite (e.g. divisibility). Default: none.
  virtual void check_input(const at::Tensor& x) const { (void)x; }
  /// True if do_quantize() itself rejects NaN/Inf input (throwing InvalidArgument that names
  /// the first bad index [b, h, t, d], like quantize() does), typically detected inside its
  /// kernel's single pass over the data. quantize() then skips its own finiteness scan, a
  /// whole extra read of the input. Default: false (quantize() scans).
  virtual bool checks_finite_itself() const { return false; }
};

/// Builds a quantizer from its spec string (e.g. "int4:g32", "fp8:e4m3", "bf16").
/// @throws InvalidArgument for unknown heads (listing the registered ones) or bad fields.
std::unique_ptr<Quantizer> make_quantizer(const std::string& spec);

/// Parameter tables of every registered quantizer, in registration order (for --list).
std::vector<ParamTable> registered_quantizers();

/// Reconstruction error of `x_hat` against `x` (both converted to float32).
struct ReconstructionError {
  double rel_fro = 0;  ///< ||x - x_hat||_F / ||x||_F (0 when x == 0 and x_hat == 0)
  double max_abs = 0;  ///< max |x - x_hat|
};

/// @throws InvalidArgument if shapes differ.
ReconstructionError reconstruction_error(const at::Tensor& x, const at::Tensor& x_hat);

/// Quantize-dequantize `x` with `q` and measure the error.
ReconstructionError reconstruction_error(const Quantizer& q, const at::Tensor& x);

}  // namespace kvcache
