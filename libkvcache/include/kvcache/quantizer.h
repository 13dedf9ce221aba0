// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file quantizer.h
/// The Quantizer interface, the QuantizedTensor it produces, and the factory.
///
/// A Quantizer turns a K or V tensor `[B, H_kv, T, D]` (float32/float16/bfloat16, a view:
/// kvcache/view.h) into a QuantizedTensor that holds exactly the bytes a cache would store
/// (packed codes, fp16 scales/zeros, side data such as outliers or low-rank factors) in
/// Buffers the core owns. `nbytes()` is summed over the buffers really held: memory is
/// measured, never computed from a formula. Reconstructions are written into the caller's
/// memory (dequantize_into). The at::Tensor forms (dequantize(q) returning a tensor, the
/// reuse of a caller's at::Tensor) are in kvcache/torch/quantizer.h.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/buffer.h"
#include "kvcache/spec.h"
#include "kvcache/types.h"
#include "kvcache/view.h"

namespace kvcache {

/// The stored form of one quantized K or V tensor.
struct QuantizedTensor {
  /// Canonical spec of the quantizer that produced it (e.g. "int4:g32", "fp8:e5m2").
  /// Dequantizing with a quantizer of another spec is an error.
  std::string format;
  /// Logical shape `[B, H_kv, T, D]` of the original tensor.
  std::vector<int64_t> shape;
  /// dtype of the original tensor (float32, float16 or bfloat16): what dequantize_into()
  /// rounds to unless asked for float32.
  DType dtype = DType::kFloat32;
  /// Packed codes, uint8 (or the raw values for float formats: float32/float16/bfloat16).
  Buffer codes;
  /// Per-group scales (fp16 for integer formats, fp32 for a tensor whose metadata exceeds
  /// fp16's range; one fp32 per-tensor scale for `fp8:*:scaled`). May be undefined.
  Buffer scales;
  /// Per-group zero points (the group minimum, rounded down to fp16 when fp16; same dtype and
  /// shape as `scales`). May be undefined.
  Buffer zeros;
  /// Named side data (outlier values/indices, low-rank factors, ...). May be empty.
  std::map<std::string, Buffer> side;

  /// Bytes really held: sum of nbytes() over every defined buffer above.
  int64_t nbytes() const;
  /// Number of logical values (product of `shape`).
  int64_t numel() const;
};

/// Which fused attention kernel reads a format's stored bytes without decoding them
/// (src/cache/attend_fused.h): the format says so itself, so the dispatch asks the layout,
/// never the quantizer's class. kNone: the generic path decodes its blocks (int3, rotated
/// `had(...)`, GEAR, KVQuant).
enum class KernelKind : uint8_t {
  kNone,
  kFloat32,     ///< raw float32 values
  kFloat16,     ///< raw float16 values
  kBFloat16,    ///< raw bfloat16 values
  kFp8E4M3,     ///< fp8 codes (tensor_scale says whether scaled)
  kFp8E5M2,
  kIntToken,    ///< per-token integer groups: kernel_bits 8/4/2, kernel_group values per group
  kIntChannel,  ///< per-channel integer groups: kernel_bits 8/4/2, kernel_group tokens per group
  /// TurboQuant (`tq`, arXiv 2504.19874): Lloyd–Max codes of the rotated unit vector, ‖x‖ (and
  /// for `:prod` the residual's sign sketch and γ); the kernels take the rotation, codebooks
  /// and sketch from the quantizer (src/quant/turboquant_quantizer.h).
  kTurboQuant,
  /// QJL keys (the `qjl` scheme's, arXiv 2406.03482): per group of tokens the outlier channel
  /// indices, per token the sign bits of S k_in and S_o k_out and the two norms; the kernels
  /// take the sketch from the quantizer (src/quant/qjl_quantizer.h).
  kQjl,
  /// PolarQuant (`polar`, arXiv 2502.02617): angle codes of 16-value blocks and one fp16 radius
  /// per block; the kernels take the preconditioning and the cos/sin tables from the quantizer
  /// (src/quant/polar_quantizer.h).
  kPolar,
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
  DType meta_dtype = DType::kFloat16;
  /// One fp32 scale for a whole stream (fp8:*:scaled): fit_tensor_scale() computes it and
  /// encode()/decode() take it. False: the tensor_scale arguments are ignored.
  bool tensor_scale = false;
  /// The fused kernel that reads these bytes as stored (KernelKind), and for the integer
  /// kinds their bit width and group size.
  KernelKind kernel = KernelKind::kNone;
  int kernel_bits = 0;
  int64_t kernel_group = 0;

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
  QuantizedTensor quantize(const TensorView& x) const;

  /// quantize(x) into a caller-held `out`, for callers that quantize same-shaped tensors
  /// again and again: every buffer of `out` whose shape and dtype already fit (and that does
  /// not overlap `x`) is overwritten in place, so a repeated call allocates nothing and
  /// touches no fresh pages; the others are reallocated. The result is bit-identical to
  /// quantize(x). Same validation and errors as quantize() (the message names
  /// "quantize_into(x, out)"); when it throws, `out` holds unspecified values (its buffers
  /// stay valid).
  void quantize_into(const TensorView& x, QuantizedTensor& out) const;

  /// Reconstructs `q` into the caller's `out`: a view of `q.shape` and dtype float32 or
  /// `q.dtype` (any strides). float32 receives the reconstruction itself; another dtype the
  /// float32 reconstruction rounded to it (nearest even), saturating at its largest finite
  /// value (finite input never comes back ±Inf). Writes nothing else.
  /// @throws InvalidArgument if `q.format` differs from spec(), `q.shape` (checked first) is not
  ///         the shape of a tensor the format makes (a negative size, more elements than int64
  ///         counts, a head_dim (e.g. 0) or seq_len that does not fit the group size: a
  ///         hand-built q), q's buffers do not have the shapes this format stores, or `out` has
  ///         another shape or dtype (naming both).
  void dequantize_into(const QuantizedTensor& q, const MutableTensorView& out) const;

  /// The checks dequantize_into() makes of `q` before anything is read or written: q.format is
  /// spec(), q.shape has 4 sizes, none negative, with at most int64's count of elements,
  /// q.codes is defined and q.dtype is float32, float16 or bfloat16. For callers that allocate
  /// the output from q.shape first (the at::Tensor face, kvcache/torch/quantizer.h).
  /// @throws InvalidArgument as dequantize_into() does (the message starts
  ///         "dequantize_into(q, out) [spec]").
  void check_dequantizable(const QuantizedTensor& q) const;

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

  /// The per-stream scale encode() should use for values like `x` (any shape, a float
  /// dtype, any strides): amax / max_finite for fp8:*:scaled (as quantize() computes its
  /// per-tensor scale), 1 for every other format.
  virtual float fit_tensor_scale(const TensorView& x) const { (void)x; return 1.0f; }

 protected:
  /// What the quantizers work on, validated: `x` is `[B, H_kv, T, D]` float32 contiguous (the
  /// caller's values, converted once — exactly — when they were another dtype or strided),
  /// `dtype` the caller's dtype (QuantizedTensor::dtype), [avoid_begin, avoid_end) the
  /// caller's memory, which no buffer of the output may overlap (Buffer::ensure).
  struct Input {
    TensorView x;
    DType dtype = DType::kFloat32;
    const void* avoid_begin = nullptr;
    const void* avoid_end = nullptr;
  };
  /// Writes the quantized form of in.x into `out`, reusing its buffers where they fit.
  /// Messages start "quantize(x) [spec]" (quantize_into() rewrites that prefix).
  virtual void do_quantize_into(const Input& in, QuantizedTensor& out) const = 0;
  /// quantize() itself. Default: do_quantize_into() into a fresh QuantizedTensor (`had` calls
  /// its inner quantizer's quantize() here and quantize_into() there, so that messages name
  /// the call made).
  virtual QuantizedTensor do_quantize(const Input& in) const {
    QuantizedTensor q;
    do_quantize_into(in, q);
    return q;
  }
  /// The float32 reconstruction of `q` (format and shape rank checked) into `out`: q.numel()
  /// floats, row-major over q.shape. Messages start "dequantize_into(q, out) [spec]".
  virtual void do_dequantize_into(const QuantizedTensor& q, float* out) const = 0;
  /// Extra validation of input beyond shape/dtype/finite (e.g. divisibility), on the caller's
  /// view. Default: none.
  virtual void check_input(const TensorView& x) const { (void)x; }
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
  void validate_quantize_input(const TensorView& x, const std::string& where) const;
  Input make_input(const TensorView& x, std::vector<float>& scratch) const;
};

/// Builds a quantizer from its spec string (e.g. "int4:g32", "fp8:e4m3", "bf16").
/// Registered: fp32, fp16, bf16, fp8 (e4m3|e5m2, scaled), int8/int4/int3/int2 (g<group>, chan),
/// tq (TurboQuant, arXiv 2504.19874: b<bits>, mse|prod, nc, seed; o<n>[:g<G>]: n outlier
/// channels per group of G tokens at b + 1 bits), polar (PolarQuant, arXiv 2502.02617: seed),
/// had(<spec>);
/// grammar, formats and packing in docs/quantizers.md.
/// @throws InvalidArgument for unknown heads (listing the registered ones) or bad fields.
std::unique_ptr<Quantizer> make_quantizer(const std::string& spec);

/// Parameter tables of every registered quantizer, in registration order (for --list).
std::vector<ParamTable> registered_quantizers();

/// Reconstruction error of `x_hat` against `x` (both read as float32, sums in float64).
struct ReconstructionError {
  double rel_fro = 0;  ///< ||x - x_hat||_F / ||x||_F (0 when x == 0 and x_hat == 0; +inf when only x == 0)
  double max_abs = 0;  ///< max |x - x_hat|
};

/// Of two float views of the same shape (any strides). (kvcache/torch/quantizer.h has the
/// at::Tensor form, computed with at:: ops as the study's tables always were.)
/// @throws InvalidArgument if either is undefined, not a float dtype, or the shapes differ.
ReconstructionError reconstruction_error(const TensorView& x, const TensorView& x_hat);

/// Quantize-dequantize `x` (`[B, H_kv, T, D]`) with `q` (back to x's dtype) and measure the error.
/// @throws as Quantizer::quantize.
ReconstructionError reconstruction_error(const Quantizer& q, const TensorView& x);

}  // namespace kvcache
