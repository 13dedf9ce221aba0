// SPDX-License-Identifier: Apache-2.0
#include "quant/float_quantizer.h"

#include <cstring>

#include "kvcache/error.h"
#include "quant/cast_kernels.h"
#include "quant/checks.h"

namespace kvcache::quant {

const ParamTable& FloatCastQuantizer::table(DType storage) {
  static const ParamTable f32{"fp32", "float32, stored as is (identity; the unquantized baseline)", {}};
  static const ParamTable f16{"fp16", "float16 cast (round-to-nearest-even); rejects |x| > 65504", {}};
  static const ParamTable b16{"bf16", "bfloat16 cast (round-to-nearest-even)", {}};
  KV_INTERNAL_ASSERT(storage == DType::kFloat32 || storage == DType::kFloat16 || storage == DType::kBFloat16,
                     "bad storage dtype");
  return storage == DType::kFloat32 ? f32 : storage == DType::kFloat16 ? f16 : b16;
}

FloatCastQuantizer::FloatCastQuantizer(DType storage, std::string name) : storage_(storage), name_(std::move(name)) {
  KV_INTERNAL_ASSERT(name_ == table(storage).head, "FloatCastQuantizer '", name_, "' stores ", to_string(storage));
}

double FloatCastQuantizer::bits_per_value(int64_t /*head_dim*/) const {
  return 8.0 * static_cast<double>(dtype_size(storage_));
}

void FloatCastQuantizer::do_quantize_into(const Input& in, QuantizedTensor& q) const {
  const std::string where = "quantize(x) [" + name_ + "]";
  const std::vector<int64_t> shape = in.x.sizes();
  q.format = name_;
  q.shape = shape;
  q.dtype = in.dtype;
  q.scales.reset();
  q.zeros.reset();
  q.side.clear();
  // Never x's own memory: a cache must not alias the caller's buffer (a fresh buffer, or
  // the caller's earlier output when it fits).
  q.codes.ensure(storage_, shape, in.avoid_begin, in.avoid_end);
  const auto* src = static_cast<const float*>(in.x.data);
  const int64_t n = in.x.numel();
  CastStatus st;
  if (storage_ == DType::kFloat32) {
    st = copy_fp32(src, n, q.codes.data_as<float>());
  } else if (storage_ == DType::kFloat16) {
    st = cast_to_fp16(src, n, q.codes.data_as<uint16_t>());
  } else {
    st = cast_to_bf16(src, n, q.codes.data_as<uint16_t>());
  }
  if (st.nonfinite) throw_first_nonfinite(in.x, where);
  // fp16 rejects what would round to ±Inf; bf16 saturates (cast_to_bf16) and never overflows.
  if (st.overflow) check_fp16_overflow(src, q.codes.data_as<uint16_t>(), shape, where);
}

void FloatCastQuantizer::do_dequantize_into(const QuantizedTensor& q, float* out) const {
  KV_CHECK_ARG(q.codes.dtype() == storage_ && q.codes.shape() == q.shape, "dequantize_into(q, out) [", name_,
               "]: q.codes must be ", to_string(storage_), " of shape ", shape_str(q.shape), ", got ",
               to_string(q.codes.dtype()), " ", shape_str(q.codes.shape()));
  // The widening conversions are exact (fp16/bf16 → float32); dequantize_into() then rounds
  // back to q.dtype, which gives the stored values again when q.dtype is the storage dtype.
  ConstGroupBuffers in;
  in.codes = static_cast<const uint8_t*>(q.codes.data());
  do_decode(in, q.numel(), 1, 1.0f, out);
}

StoredLayout FloatCastQuantizer::do_stored_layout(int64_t head_dim) const {
  StoredLayout l;
  l.code_bytes = head_dim * dtype_size(storage_);
  l.kernel = storage_ == DType::kFloat32   ? KernelKind::kFloat32
             : storage_ == DType::kFloat16 ? KernelKind::kFloat16
                                           : KernelKind::kBFloat16;
  return l;
}

EncodeStatus FloatCastQuantizer::do_encode(const float* x, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                                           GroupBuffers out) const {
  const int64_t n = groups * head_dim;
  CastStatus st;
  if (storage_ == DType::kFloat32) {
    st = copy_fp32(x, n, reinterpret_cast<float*>(out.codes));
  } else if (storage_ == DType::kFloat16) {
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
  if (n == 0) return;  // an empty tensor: no buffer to read (memcpy from NULL is undefined even for 0 bytes)
  if (storage_ == DType::kFloat32) {
    std::memcpy(out, in.codes, static_cast<size_t>(n) * sizeof(float));
  } else if (storage_ == DType::kFloat16) {
    fp16_to_fp32(reinterpret_cast<const uint16_t*>(in.codes), n, out);
  } else {
    bf16_to_fp32(reinterpret_cast<const uint16_t*>(in.codes), n, out);
  }
}

}  // namespace kvcache::quant
