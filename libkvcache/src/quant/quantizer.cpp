// SPDX-License-Identifier: Apache-2.0
// Quantizer base class (validation, then the protected virtuals), QuantizedTensor
// accounting and reconstruction error.
#include "kvcache/quantizer.h"

#include <cmath>
#include <limits>

#include "common/view_ops.h"
#include "kvcache/error.h"
#include "quant/as_call.h"
#include "quant/checks.h"

namespace kvcache {

int64_t QuantizedTensor::nbytes() const {
  int64_t n = codes.nbytes() + scales.nbytes() + zeros.nbytes();
  for (const auto& kv : side) n += kv.second.nbytes();
  return n;
}

int64_t QuantizedTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Quantizer::Input Quantizer::make_input(const TensorView& x, std::vector<float>& scratch) const {
  Input in;
  in.dtype = x.dtype;
  const auto range = quant::byte_range(x);
  in.avoid_begin = range.first;
  in.avoid_end = range.second;
  if (x.dtype == DType::kFloat32 && x.is_contiguous()) {
    in.x = x;
  } else {
    scratch = detail::to_float32(x);
    in.x = TensorView(scratch.data(), DType::kFloat32, x.sizes());
  }
  return in;
}

QuantizedTensor Quantizer::quantize(const TensorView& x) const {
  const std::string where = "quantize(x) [" + spec() + "]";
  validate_quantize_input(x, where);
  std::vector<float> scratch;
  QuantizedTensor q = do_quantize(make_input(x, scratch));
  KV_INTERNAL_ASSERT(q.format == spec(), "quantizer ", spec(), " produced format ", q.format);
  return q;
}

void Quantizer::quantize_into(const TensorView& x, QuantizedTensor& out) const {
  const std::string where = "quantize_into(x, out) [" + spec() + "]";
  quant::as_call("quantize(x) [" + spec() + "]", where, [&] {
    validate_quantize_input(x, where);
    std::vector<float> scratch;
    do_quantize_into(make_input(x, scratch), out);
  });
  KV_INTERNAL_ASSERT(out.format == spec(), "quantizer ", spec(), " produced format ", out.format);
}

void Quantizer::validate_quantize_input(const TensorView& x, const std::string& where) const {
  KV_CHECK_ARG(x.defined(), where, ": x is an undefined tensor (expected [B, H_kv, T, D])");
  KV_CHECK_ARG(x.rank == 4, where, ": x must be 4-D [B, H_kv, T, D], got ", x.rank, "-D shape ",
               shape_str(x.sizes()));
  KV_CHECK_ARG(is_kv_dtype(x.dtype), where, ": x has dtype ", to_string(x.dtype),
               ", expected float32, float16 or bfloat16");
  check_input(x);
  if (!checks_finite_itself()) quant::check_finite(x, where);
}

void Quantizer::check_dequantizable(const QuantizedTensor& q) const {
  const std::string me = spec();
  KV_CHECK_ARG(q.format == me, "dequantize_into(q, out) [", me, "]: q.format is '", q.format, "', expected '", me,
               "' (decode a tensor with the quantizer that produced it)");
  KV_CHECK_ARG(q.shape.size() == 4, "dequantize_into(q, out) [", me, "]: q.shape must have 4 entries, got ",
               q.shape.size());
  // Sizes a tensor can have: none negative, their product within int64 (what quantize() makes).
  int64_t numel = 1;
  for (int64_t s : q.shape) {
    KV_CHECK_ARG(s >= 0 && (s == 0 || numel <= std::numeric_limits<int64_t>::max() / s), "dequantize_into(q, out) [",
                 me, "]: q.shape ", shape_str(q.shape), " is not the shape of a tensor [B, H_kv, T, D] (",
                 s < 0 ? "a negative size" : "more elements than int64 counts", ")");
    numel = s == 0 ? 0 : numel * s;
  }
  KV_CHECK_ARG(q.codes.defined(), "dequantize_into(q, out) [", me, "]: q.codes is undefined");
  KV_CHECK_ARG(is_kv_dtype(q.dtype), "dequantize_into(q, out) [", me, "]: q.dtype is ", to_string(q.dtype),
               ", expected float32, float16 or bfloat16");
}

void Quantizer::dequantize_into(const QuantizedTensor& q, const MutableTensorView& out) const {
  check_dequantizable(q);
  const std::string where = "dequantize_into(q, out) [" + spec() + "]";
  KV_CHECK_ARG(out.defined() && out.sizes() == q.shape && (out.dtype == DType::kFloat32 || out.dtype == q.dtype), where,
               ": out must be ", shape_str(q.shape), " of dtype Float",
               q.dtype == DType::kFloat32 ? std::string() : std::string(" or ") + to_string(q.dtype) + " (q.dtype)",
               ", got ", shape_str(TensorView(out)));
  // Written straight into `out` when it is contiguous float32 memory of its own; else through
  // a float32 reconstruction (also when `out` overlaps q's buffers, which it must not clobber
  // while they are read).
  const auto range = quant::byte_range(out);
  auto overlaps = [&](const Buffer& b) {
    const auto* lo = static_cast<const char*>(b.data());
    return b.defined() && range.first != nullptr && static_cast<const char*>(range.first) < lo + b.nbytes() &&
           lo < static_cast<const char*>(range.second);
  };
  bool aliased = overlaps(q.codes) || overlaps(q.scales) || overlaps(q.zeros);
  for (const auto& kv : q.side) aliased = aliased || overlaps(kv.second);
  if (out.dtype == DType::kFloat32 && out.is_contiguous() && !aliased) {
    do_dequantize_into(q, static_cast<float*>(out.data));
    return;
  }
  std::vector<float> tmp(static_cast<size_t>(q.numel()));
  do_dequantize_into(q, tmp.data());
  detail::write_float32(tmp.data(), out);
}

int64_t StoredLayout::meta_bytes() const { return meta_count * (has_zeros ? 2 : 1) * dtype_size(meta_dtype); }

StoredLayout Quantizer::stored_layout(int64_t head_dim) const {
  KV_CHECK_ARG(head_dim > 0, "stored_layout(head_dim) [", spec(), "]: head_dim must be > 0, got ", head_dim);
  StoredLayout l = do_stored_layout(head_dim);
  KV_INTERNAL_ASSERT(l.group_tokens >= 1 && l.code_bytes >= 1 && l.meta_count >= 0 &&
                         (l.meta_dtype == DType::kFloat16 || l.meta_dtype == DType::kFloat32),
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

ReconstructionError reconstruction_error(const TensorView& x, const TensorView& x_hat) {
  KV_CHECK_ARG(x.defined() && x_hat.defined(), "reconstruction_error(x, x_hat): undefined tensor");
  KV_CHECK_ARG(is_kv_dtype(x.dtype) && is_kv_dtype(x_hat.dtype), "reconstruction_error(x, x_hat): x is ",
               shape_str(x), " and x_hat ", shape_str(x_hat), " (expected float32, float16 or bfloat16)");
  KV_CHECK_ARG(x.sizes() == x_hat.sizes(), "reconstruction_error(x, x_hat): shapes differ: x ", shape_str(x.sizes()),
               " vs x_hat ", shape_str(x_hat.sizes()));
  ReconstructionError e;
  if (x.numel() == 0) return e;
  detail::Float32Rows a, b;
  detail::read_float32(x, a);
  detail::read_float32(x_hat, b);
  double num = 0, den = 0, mx = 0;
  for (int64_t i = 0; i < a.numel; ++i) {
    const double xi = a.data[i];
    const double diff = static_cast<double>(a.data[i] - b.data[i]);  // in float32, as x − x̂ of float tensors
    num += diff * diff;
    den += xi * xi;
    mx = std::max(mx, std::abs(diff));
  }
  e.max_abs = mx;
  if (den > 0) {
    e.rel_fro = std::sqrt(num) / std::sqrt(den);
  } else {
    e.rel_fro = num == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  }
  return e;
}

ReconstructionError reconstruction_error(const Quantizer& q, const TensorView& x) {
  const QuantizedTensor qt = q.quantize(x);
  Buffer y(qt.dtype, qt.shape);  // x's dtype, as the reconstruction a reader gets
  q.dequantize_into(qt, y.mutable_view());
  return reconstruction_error(x, y.view());
}

}  // namespace kvcache
