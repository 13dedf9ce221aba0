// SPDX-License-Identifier: Apache-2.0
// Quantizer base class (validation, then the protected virtuals), QuantizedTensor
// accounting and reconstruction error.
#include "kvcache/quantizer.h"

#include <cmath>
#include <limits>

#include "kvcache/error.h"
#include "quant/checks.h"

namespace kvcache {
namespace {

int64_t tensor_bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

bool is_float_input(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

}  // namespace

int64_t QuantizedTensor::nbytes() const {
  int64_t n = tensor_bytes(codes) + tensor_bytes(scales) + tensor_bytes(zeros);
  for (const auto& kv : side) n += tensor_bytes(kv.second);
  return n;
}

int64_t QuantizedTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

QuantizedTensor Quantizer::quantize(const at::Tensor& x) const {
  const std::string where = "quantize(x) [" + spec() + "]";
  validate_quantize_input(x, where);
  QuantizedTensor q = do_quantize(x);
  KV_INTERNAL_ASSERT(q.format == spec(), "quantizer ", spec(), " produced format ", q.format);
  return q;
}

namespace {
/// Runs fn; an InvalidArgument whose message starts with `from` (the allocating call's name,
/// which the quantizers' own checks and kernels write: "quantize(x) [spec]") is rethrown
/// starting with `to` instead, so that a caller of the *_into form reads the call it made.
template <class Fn>
void as_call(const std::string& from, const std::string& to, Fn&& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    if (msg.rfind(from, 0) != 0) throw;
    throw InvalidArgument(to + msg.substr(from.size()));
  }
}
}  // namespace

void Quantizer::quantize_into(const at::Tensor& x, QuantizedTensor& out) const {
  const std::string where = "quantize_into(x, out) [" + spec() + "]";
  as_call("quantize(x) [" + spec() + "]", where, [&] {
    validate_quantize_input(x, where);
    do_quantize_into(x, out);
  });
  KV_INTERNAL_ASSERT(out.format == spec(), "quantizer ", spec(), " produced format ", out.format);
}

void Quantizer::validate_quantize_input(const at::Tensor& x, const std::string& where) const {
  KV_CHECK_ARG(x.defined(), where, ": x is an undefined tensor (expected [B, H_kv, T, D])");
  KV_CHECK_ARG(x.dim() == 4, where, ": x must be 4-D [B, H_kv, T, D], got ", x.dim(), "-D shape ",
               quant::shape_str(x.sizes()));
  KV_CHECK_ARG(is_float_input(x.scalar_type()), where, ": x has dtype ", x.scalar_type(),
               ", expected float32, float16 or bfloat16");
  KV_CHECK_ARG(x.device().is_cpu(), where, ": x is on ", x.device(), ", expected a CPU tensor");
  check_input(x);
  if (!checks_finite_itself()) quant::check_finite(x, where);
}

void Quantizer::validate_dequantize_input(const QuantizedTensor& q) const {
  const std::string me = spec();
  KV_CHECK_ARG(q.format == me, "dequantize(q) [", me, "]: q.format is '", q.format,
               "', expected '", me, "' (decode a tensor with the quantizer that produced it)");
  KV_CHECK_ARG(q.shape.size() == 4, "dequantize(q) [", me, "]: q.shape must have 4 entries, got ",
               q.shape.size());
  // Sizes a tensor can have: none negative, their product within int64 (what quantize() makes).
  int64_t numel = 1;
  for (int64_t s : q.shape) {
    KV_CHECK_ARG(s >= 0 && (s == 0 || numel <= std::numeric_limits<int64_t>::max() / s), "dequantize(q) [", me,
                 "]: q.shape ", quant::shape_str(q.shape), " is not the shape of a tensor [B, H_kv, T, D] (",
                 s < 0 ? "a negative size" : "more elements than int64 counts", ")");
    numel = s == 0 ? 0 : numel * s;
  }
  KV_CHECK_ARG(q.codes.defined(), "dequantize(q) [", me, "]: q.codes is undefined");
}

at::Tensor Quantizer::dequantize(const QuantizedTensor& q) const {
  validate_dequantize_input(q);
  return do_dequantize(q);
}

void Quantizer::dequantize_into(const QuantizedTensor& q, at::Tensor& out) const {
  as_call("dequantize(q) [" + spec() + "]", "dequantize_into(q, out) [" + spec() + "]", [&] {
    validate_dequantize_input(q);
    do_dequantize_into(q, out);
  });
}

int64_t StoredLayout::meta_bytes() const {
  return meta_count * (has_zeros ? 2 : 1) * static_cast<int64_t>(c10::elementSize(meta_dtype));
}

StoredLayout Quantizer::stored_layout(int64_t head_dim) const {
  KV_CHECK_ARG(head_dim > 0, "stored_layout(head_dim) [", spec(), "]: head_dim must be > 0, got ", head_dim);
  StoredLayout l = do_stored_layout(head_dim);
  KV_INTERNAL_ASSERT(l.group_tokens >= 1 && l.code_bytes >= 1 && l.meta_count >= 0 &&
                         (l.meta_dtype == at::kHalf || l.meta_dtype == at::kFloat),
                     "quantizer ", spec(), " declared a bad layout");
  return l;
}

StoredLayout Quantizer::do_stored_layout(int64_t /*head_dim*/) const {
  throw UnsupportedError("quantizer '" + spec() + "' has no block layout (it cannot be stored by the CacheManager)");
}

EncodeStatus Quantizer::encode(const float* x, int64_t groups, int64_t head_dim, float tensor_scale,
                               GroupBuffers out) const {
  KV_INTERNAL_ASSERT(groups >= 0 && head_dim > 0 && (groups == 0 || (x != nullptr && out.codes != nullptr)),
                     "encode [", spec(), "]");
  if (groups == 0) return {};
  return do_encode(x, groups, head_dim, tensor_scale, out);
}

void Quantizer::decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float tensor_scale,
                       float* out) const {
  KV_INTERNAL_ASSERT(groups >= 0 && head_dim > 0 && (groups == 0 || (in.codes != nullptr && out != nullptr)),
                     "decode [", spec(), "]");
  if (groups == 0) return;
  do_decode(in, groups, head_dim, tensor_scale, out);
}

EncodeStatus Quantizer::do_encode(const float*, int64_t, int64_t, float, GroupBuffers) const {
  throw UnsupportedError("quantizer '" + spec() + "' has no raw encoder");
}

void Quantizer::do_decode(ConstGroupBuffers, int64_t, int64_t, float, float*) const {
  throw UnsupportedError("quantizer '" + spec() + "' has no raw decoder");
}

ReconstructionError reconstruction_error(const at::Tensor& x, const at::Tensor& x_hat) {
  KV_CHECK_ARG(x.defined() && x_hat.defined(), "reconstruction_error(x, x_hat): undefined tensor");
  KV_CHECK_ARG(x.sizes() == x_hat.sizes(), "reconstruction_error(x, x_hat): shapes differ: x ",
               quant::shape_str(x.sizes()), " vs x_hat ", quant::shape_str(x_hat.sizes()));
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
  return reconstruction_error(x, q.dequantize(q.quantize(x)));
}

}  // namespace kvcache
