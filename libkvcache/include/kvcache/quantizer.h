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
  /// Per-group scales (fp16 for integer formats, fp32 for a tensor whose metadata exceeds
  /// fp16's range; one fp32 per-tensor scale for `fp8:*:scaled`). May be undefined.
  at::Tensor scales;
  /// Per-group zero points (the group minimum, rounded down to fp16 when fp16; same dtype and
  /// shape as `scales`). May be undefined.
  at::Tensor zeros;
  /// Named side tensors (outlier values/indices, low-rank factors, ...). May be empty.
  std::map<std::string, at::Tensor> side;

  /// Bytes really held: sum of numel * element_size over every defined tensor above.
  int64_t nbytes() const;
  /// Number of logical values (product of `shape`).
  int64_t numel() const;
};

/// How a quantizer lays out what it stores for ONE KV head, as the cache's block store holds
/// it (docs/cache-manager.md, "Block storage"; ggml-style type traits). The unit is a *group*
/// of `group_tokens` consecutive tokens encoded together: 1 for per-token formats (a token
/// can be written, read and removed on its own), g for per-channel formats (`:chan`, KIVI
/// keys), whose groups run along tokens. `n` consecutive groups occupy three arrays:
///   codes:  n × code_bytes bytes (packed codes, or the raw fp32/fp16/bf16/fp8 bytes);
///   scales: n × meta_count values of meta_dtype (absent when meta_count == 0);
///   zeros:  as many values as scales when has_zeros (absent otherwise).
/// They are exactly QuantizedTensor's codes/scales/zeros for n = B·H_kv·T / group_tokens
/// groups, so quantize() and encode() agree byte for byte.
struct StoredLayout {
  GroupAxis axis = GroupAxis::kPerToken;
  int64_t group_tokens = 1;   ///< tokens encoded together (1 = token-readable)
  int64_t code_bytes = 0;     ///< bytes of codes per group
  int64_t meta_count = 0;     ///< scales per group (and zeros, when has_zeros)
  bool has_zeros = false;     ///< a zero point per scale
  /// dtype of scales and zeros: float16 for the integer formats. (A tensor whose metadata
  /// overflows float16 is stored by quantize() with fp32 metadata; encode() reports
  /// EncodeStatus::overflow instead and the cache stores such a group in fp32.)
  at::ScalarType meta_dtype = at::kHalf;
  /// One fp32 scale for a whole stream (fp8:*:scaled): fit_tensor_scale() computes it and
  /// encode()/decode() take it. False: the tensor_scale arguments are ignored.
  bool tensor_scale = false;

  /// Bytes of scales and zeros per group.
  int64_t meta_bytes() const;
  /// Bytes stored per group: codes + scales + zeros.
  int64_t group_bytes() const { return code_bytes + meta_bytes(); }
  /// True if one token can be encoded, read and removed alone (group_tokens == 1).
  bool token_readable() const { return group_tokens == 1; }
};

/// Raw memory of n consecutive groups in a StoredLayout (scales/zeros may be null when absent).
struct GroupBuffers {
  uint8_t* codes = nullptr;
  void* scales = nullptr;
  void* zeros = nullptr;
};
struct ConstGroupBuffers {
  const uint8_t* codes = nullptr;
  const void* scales = nullptr;
  const void* zeros = nullptr;
};

/// What encode() found while writing.
struct EncodeStatus {
  /// Some group's stored form is not finite in this format (an integer group's fp16 zero or
  /// scale: a minimum outside ±65504 or a range past 65504·(2^b − 1); fp16 values of
  /// |x| ≥ 65520; an fp8 stream scale so large that max_finite · scale overflows). The output
  /// of such a group is unusable; every other group is written correctly, and decode() of a
  /// group written without overflow is finite.
  bool overflow = false;
  /// Some input value was NaN/±Inf (callers validate first; output unusable).
  bool nonfinite = false;
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
  ///         by the group size (the message names both numbers); `had(q)`: a row whose rotation
  ///         leaves float32 (possible only when some |x| > FLT_MAX/√D; naming the row).
  QuantizedTensor quantize(const at::Tensor& x) const;

  /// Reconstructs a tensor of `q.shape` and `q.dtype`: the float32 reconstruction rounded to
  /// q.dtype, saturating at its largest finite value (finite input never comes back ±Inf).
  /// @throws InvalidArgument if `q.format` differs from spec(), or `q.shape` (checked first)
  ///         is not the shape of a tensor the format makes: a negative size, more elements than
  ///         int64 counts, a head_dim (e.g. 0) or seq_len that does not fit the group size, or
  ///         tensors of other shapes than it implies (a hand-built q).
  at::Tensor dequantize(const QuantizedTensor& q) const;

  /// quantize(x) into a caller-held `out`, for callers that quantize same-shaped tensors
  /// again and again: every tensor of `out` whose shape and dtype already fit (and that does
  /// not share storage with `x`) is overwritten in place, so a repeated call allocates
  /// nothing and touches no fresh pages; the others are allocated as quantize() does. The
  /// result is bit-identical to quantize(x). Same validation and errors as quantize(); when
  /// it throws, `out` is left holding unspecified values (its tensors stay valid).
  void quantize_into(const at::Tensor& x, QuantizedTensor& out) const;

  /// dequantize(q) into a caller-held `out`: reused when it is already a contiguous CPU
  /// tensor of q.shape and q.dtype that does not share storage with q's tensors, else
  /// replaced by a new one. Bit-identical to dequantize(q); same errors.
  void dequantize_into(const QuantizedTensor& q, at::Tensor& out) const;

  // ---- raw-memory codec of one KV head (what the cache's block store calls) ----------

  /// The stored layout for head_dim `head_dim` (see StoredLayout).
  /// @throws InvalidArgument if head_dim does not fit the format (e.g. not divisible by the
  ///         group size); UnsupportedError for a quantizer without a block layout.
  StoredLayout stored_layout(int64_t head_dim) const;

  /// Encodes `groups` groups of one head: `x` float32, contiguous, row-major
  /// `[groups · group_tokens, head_dim]`, finite (not re-checked). Writes
  /// `groups × code_bytes` bytes to out.codes and the metadata arrays. `tensor_scale`: the
  /// stream's scale when StoredLayout::tensor_scale (else ignored). Never throws for
  /// finite input; reports overflow instead (EncodeStatus). Single-threaded below 64 Ki values.
  EncodeStatus encode(const float* x, int64_t groups, int64_t head_dim, float tensor_scale,
                      GroupBuffers out) const;

  /// Decodes `groups` groups written by encode() into `out` float32
  /// `[groups · group_tokens, head_dim]`, bit-identical to dequantize() of the same bytes.
  void decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float tensor_scale,
              float* out) const;

  /// The per-stream scale encode() should use for values like `x` (any shape, float32):
  /// amax / max_finite for fp8:*:scaled (as quantize() computes its per-tensor scale), 1
  /// for every other format.
  virtual float fit_tensor_scale(const at::Tensor& x) const { (void)x; return 1.0f; }

 protected:
  virtual QuantizedTensor do_quantize(const at::Tensor& x) const = 0;
  virtual at::Tensor do_dequantize(const QuantizedTensor& q) const = 0;
  /// Buffer-reusing forms behind quantize_into()/dequantize_into(). Defaults: `out =
  /// do_quantize(x)` / `out = do_dequantize(q)` (correct, but allocating); the built-in
  /// quantizers override them to write into `out`'s tensors where they fit.
  virtual void do_quantize_into(const at::Tensor& x, QuantizedTensor& out) const { out = do_quantize(x); }
  virtual void do_dequantize_into(const QuantizedTensor& q, at::Tensor& out) const { out = do_dequantize(q); }
  /// Extra validation of input beyond shape/dtype/finite (e.g. divisibility). Default: none.
  virtual void check_input(const at::Tensor& x) const { (void)x; }
  /// Layout / codec implementations behind the public methods above (layouts validated by
  /// stored_layout()). Default do_stored_layout: UnsupportedError naming the spec.
  virtual StoredLayout do_stored_layout(int64_t head_dim) const;
  virtual EncodeStatus do_encode(const float* x, int64_t groups, int64_t head_dim, float tensor_scale,
                                 GroupBuffers out) const;
  virtual void do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float tensor_scale,
                         float* out) const;
  /// True if do_quantize() itself rejects NaN/Inf input (throwing InvalidArgument that names
  /// the first bad index [b, h, t, d], like quantize() does), typically detected inside its
  /// kernel's single pass over the data. quantize() then skips its own finiteness scan, a
  /// whole extra read of the input. Default: false (quantize() scans).
  virtual bool checks_finite_itself() const { return false; }

 private:
  void validate_quantize_input(const at::Tensor& x, const std::string& where) const;
  void validate_dequantize_input(const QuantizedTensor& q) const;
};

/// Builds a quantizer from its spec string (e.g. "int4:g32", "fp8:e4m3", "bf16").
/// Registered: fp32, fp16, bf16, fp8 (e4m3|e5m2, scaled), int8/int4/int2 (g<group>, chan);
/// grammar, formats and packing in docs/quantizers.md.
/// @throws InvalidArgument for unknown heads (listing the registered ones) or bad fields.
std::unique_ptr<Quantizer> make_quantizer(const std::string& spec);

/// Parameter tables of every registered quantizer, in registration order (for --list).
std::vector<ParamTable> registered_quantizers();

/// Reconstruction error of `x_hat` against `x` (both converted to float32).
struct ReconstructionError {
  double rel_fro = 0;  ///< ||x - x_hat||_F / ||x||_F (0 when x == 0 and x_hat == 0; +inf when only x == 0)
  double max_abs = 0;  ///< max |x - x_hat|
};

/// @throws InvalidArgument if shapes differ.
ReconstructionError reconstruction_error(const at::Tensor& x, const at::Tensor& x_hat);

/// Quantize-dequantize `x` with `q` and measure the error.
ReconstructionError reconstruction_error(const Quantizer& q, const at::Tensor& x);

}  // namespace kvcache
