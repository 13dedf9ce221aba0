// SPDX-License-Identifier: Apache-2.0
#include "quant/float_quantizer.h"

#include <cstring>

#include "kvcache/error.h"
#include "quant/cast_kernels.h"
#include "quant/checks.h"

namespace kvcache::quant {

const ParamTable& FloatCastQuantizer::table(at::ScalarType storage) {
  static const ParamTable f32{"fp32", "float32, stored as is (identity; the unquantized baseline)", {}};
  static const ParamTable f16{"fp16", "float16 cast (round-to-nearest-even); rejects |x| > 65504", {}};
  static const ParamTable b16{"bf16", "bfloat16 cast (round-to-nearest-even)", {}};
  KV_INTERNAL_ASSERT(storage == at::kFloat || storage == at::kHalf || storage == at::kBFloat16, "bad storage dtype");
  return storage == at::kFloat ? f32 : storage == at::kHalf ? f16 : b16;
}

FloatCastQuantizer::FloatCastQuantizer(at::ScalarType storage, std::string name)
    : storage_(storage), name_(std::move(name)) {
  KV_INTERNAL_ASSERT(name_ == table(storage).head, "FloatCastQuantizer '", name_, "' stores ", storage);
}

double FloatCastQuantizer::bits_per_value(int64_t /*head_dim*/) const {
  return 8.0 * static_cast<double>(c10::elementSize(storage_));
}

QuantizedTensor FloatCastQuantizer::do_quantize(const at::Tensor& x) const {
  QuantizedTensor q;
  do_quantize_into(x, q);
  return q;
}

void FloatCastQuantizer::do_quantize_into(const at::Tensor& x, QuantizedTensor& q) const {
  const std::string where = "quantize(x) [" + name_ + "]";
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  q.format = name_;
  q.shape = x.sizes().vec();
  q.dtype = x.scalar_type();
  q.scales = at::Tensor();
  q.zeros = at::Tensor();
  q.side.clear();
  // Never x's own memory: a cache must not alias the caller's buffer (a fresh tensor, or
  // the caller's earlier output when it fits).
  reuse_or_empty(q.codes, x.sizes(), storage_, {x, xf});
  const float* src = xf.data_ptr<float>();
  const int64_t n = xf.numel();
  CastStatus st;
  if (storage_ == at::kFloat) {
    st = copy_fp32(src, n, q.codes.data_ptr<float>());
  } else if (storage_ == at::kHalf) {
    st = cast_to_fp16(src, n, reinterpret_cast<uint16_t*>(q.codes.data_ptr<at::Half>()));
  } else {
    st = cast_to_bf16(src, n, reinterpret_cast<uint16_t*>(q.codes.data_ptr<at::BFloat16>()));
  }
  if (st.nonfinite) throw_first_nonfinite(x, where);
  // fp16 rejects what would round to ±Inf; bf16 saturates (cast_to_bf16) and never overflows.
  if (st.overflow) check_no_overflow(x, q.codes, where, "fp16", "±65504");
}

at::Tensor FloatCastQuantizer::do_dequantize(const QuantizedTensor& q) const {
  KV_CHECK_ARG(q.codes.scalar_type() == storage_ && q.codes.sizes().vec() == q.shape,
               "dequantize(q) [", name_, "]: q.codes must be ", c10::toString(storage_), " of shape ",
               shape_str(q.shape), ", got ", q.codes.scalar_type(), " ", shape_str(q.codes.sizes()));
  if (q.dtype == storage_ || q.dtype == at::kFloat) return q.codes.to(q.dtype, /*non_blocking=*/false, /*copy=*/true);
  // bf16 values past ±65504 (from fp16 input rounded up to 65536) saturate back to ±65504.
  return to_input_dtype(q.codes.to(at::kFloat).contiguous(), q.dtype);
}

void FloatCastQuantizer::do_dequantize_into(const QuantizedTensor& q, at::Tensor& out) const {
  if (q.dtype != at::kFloat) {
    out = do_dequantize(q);
    return;
  }
  KV_CHECK_ARG(q.codes.scalar_type() == storage_ && q.codes.sizes().vec() == q.shape && q.codes.is_contiguous(),
               "dequantize(q) [", name_, "]: q.codes must be contiguous ", c10::toString(storage_), " of shape ",
               shape_str(q.shape), ", got ", q.codes.scalar_type(), " ", shape_str(q.codes.sizes()));
  reuse_or_empty(out, q.shape, at::kFloat, {q.codes});
  // The widening conversions are exact: the same values as do_dequantize()'s at:: conversion.
  ConstGroupBuffers in;
  in.codes = static_cast<const uint8_t*>(q.codes.data_ptr());
  do_decode(in, out.numel(), 1, 1.0f, out.data_ptr<float>());
}

StoredLayout FloatCastQuantizer::do_stored_layout(int64_t head_dim) const {
  StoredLayout l;
  l.code_bytes = head_dim * static_cast<int64_t>(c10::elementSize(storage_));
  return l;
}

EncodeStatus FloatCastQuantizer::do_encode(const float* x, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                                           GroupBuffers out) const {
  const int64_t n = groups * head_dim;
  CastStatus st;
  if (storage_ == at::kFloat) {
    st = copy_fp32(x, n, reinterpret_cast<float*>(out.codes));
  } else if (storage_ == at::kHalf) {
    st = cast_to_fp16(x, n, reinterpret_cast<uint16_t*>(out.codes));
  } else {
    st = cast_to_bf16(x, n, reinterpret_cast<uint16_t*>(out.codes));
  }
  EncodeStatus s;
  s.nonfinite = st.nonfinite;
  s.overflow = st.overflow;
  return s;
}

void FloatCastQuantizer::do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                                   float* out) const {
  const int64_t n = groups * head_dim;
  if (storage_ == at::kFloat) {
    std::memcpy(out, in.codes, static_cast<size_t>(n) * sizeof(float));
  } else if (storage_ == at::kHalf) {
    fp16_to_fp32(reinterpret_cast<const uint16_t*>(in.codes), n, out);
  } else {
    bf16_to_fp32(reinterpret_cast<const uint16_t*>(in.codes), n, out);
  }
}

}  // namespace kvcache::quant
