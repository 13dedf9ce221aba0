// SPDX-License-Identifier: Apache-2.0
#include "quant/fp8_quantizer.h"

#include <cmath>

#include "common/view_ops.h"
#include "kvcache/error.h"
#include "quant/checks.h"

namespace kvcache::quant {
namespace {

/// True if decoded values (at most ±max_finite) times `scale` stay finite.
bool scale_fits(float scale, float max_finite) { return std::isfinite(scale * max_finite); }

/// amax / max_finite; 1 for amax == 0 or when the quotient underflows to 0 (codes stay finite).
/// For amax near FLT_MAX the rounded quotient may be a hair too large for max_finite · s to
/// stay finite (decode would give ±Inf): it is then lowered by one float32 step, which
/// saturates amax itself to max_finite · s (within 2^-23 of it).
float scale_for_amax(float amax, float max_finite) {
  float s = amax > 0.0f ? amax / max_finite : 1.0f;
  if (s == 0.0f) s = 1.0f;
  if (!scale_fits(s, max_finite)) s = std::nextafter(s, 0.0f);
  return s;
}

}  // namespace

const ParamTable& Fp8Quantizer::table() {
  static const ParamTable t = [] {
    ParamTable tt;
    tt.head = "fp8";
    tt.help =
        "8-bit float (OCP FP8: e4m3 max ±448, e5m2 max ±57344), round-to-nearest-even, saturating; "
        "as vLLM's fp8 KV cache";
    ParamDef fmt;
    fmt.key = "format";
    fmt.help = "e4m3: 4 exponent + 3 mantissa bits; e5m2: 5 + 2";
    fmt.kind = ParamDef::Kind::kChoice;
    fmt.choices = {"e4m3", "e5m2"};
    fmt.shown = true;  // fp8 always names its format
    ParamDef scale;
    scale.key = "scale";
    scale.help = "unscaled: encode x as is; scaled: one fp32 per-tensor scale amax/max_finite, encode x/scale";
    scale.kind = ParamDef::Kind::kChoice;
    scale.choices = {"unscaled", "scaled"};
    tt.params = {fmt, scale};
    return tt;
  }();
  return t;
}

std::string Fp8Quantizer::spec() const {
  return canonical_spec(table(), {}, {{"format", fp8_name(format_)}, {"scale", scaled_ ? "scaled" : "unscaled"}});
}

void Fp8Quantizer::do_quantize_into(const Input& in, QuantizedTensor& q) const {
  const std::string where = "quantize(x) [" + spec() + "]";
  const std::vector<int64_t> shape = in.x.sizes();
  const auto* x = static_cast<const float*>(in.x.data);
  const int64_t n = in.x.numel();
  q.format = spec();
  q.shape = shape;
  q.dtype = in.dtype;
  q.side.clear();
  q.zeros.reset();
  q.codes.ensure(DType::kUInt8, shape, in.avoid_begin, in.avoid_end);
  float scale = 1.0f;
  if (scaled_) {
    // One pass, no temporary.
    const float amax = fp8_amax(x, n);
    if (!std::isfinite(amax)) throw_first_nonfinite(in.x, where);
    scale = scale_for_amax(amax, fp8_max(format_));
    q.scales.ensure(DType::kFloat32, {1}, in.avoid_begin, in.avoid_end);
    *q.scales.data_as<float>() = scale;
  } else {
    q.scales.reset();
  }
  if (fp8_encode_array(x, n, scale, format_, q.codes.data_as<uint8_t>())) throw_first_nonfinite(in.x, where);
}

void Fp8Quantizer::do_dequantize_into(const QuantizedTensor& q, float* out) const {
  const std::string where = "dequantize_into(q, out) [" + spec() + "]";
  KV_CHECK_ARG(q.codes.dtype() == DType::kUInt8 && q.codes.shape() == q.shape, where,
               ": q.codes must be contiguous uint8 of shape ", shape_str(q.shape), ", got ",
               to_string(q.codes.dtype()), " ", shape_str(q.codes.shape()));
  float scale = 1.0f;
  if (scaled_) {
    KV_CHECK_ARG(q.scales.defined() && q.scales.numel() == 1 && q.scales.dtype() == DType::kFloat32, where,
                 ": q.scales must hold one fp32 per-tensor scale");
    scale = *q.scales.data_as<float>();
  }
  fp8_decode_array(q.codes.data_as<uint8_t>(), q.numel(), scale, format_, out);
}

float Fp8Quantizer::fit_tensor_scale(const TensorView& x) const {
  if (!scaled_) return 1.0f;
  detail::Float32Rows xf;
  detail::read_float32(x, xf);
  return scale_for_amax(fp8_amax(xf.data, xf.numel), fp8_max(format_));
}

StoredLayout Fp8Quantizer::do_stored_layout(int64_t head_dim) const {
  StoredLayout l;
  l.code_bytes = head_dim;
  l.tensor_scale = scaled_;
  l.kernel = format_ == Fp8Format::kE4M3 ? KernelKind::kFp8E4M3 : KernelKind::kFp8E5M2;
  return l;
}

EncodeStatus Fp8Quantizer::do_encode(const float* x, int64_t groups, int64_t head_dim, float tensor_scale,
                                     GroupBuffers out) const {
  EncodeStatus s;
  s.nonfinite = fp8_encode_array(x, groups * head_dim, scaled_ ? tensor_scale : 1.0f, format_, out.codes);
  // Saturating codes: finite input never overflows, but a caller's stream scale may be so
  // large that decode(code) · scale would (fit_tensor_scale() never returns such a scale).
  s.overflow = scaled_ && !scale_fits(tensor_scale, fp8_max(format_));
  return s;
}

void Fp8Quantizer::do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float tensor_scale,
                             float* out) const {
  fp8_decode_array(in.codes, groups * head_dim, scaled_ ? tensor_scale : 1.0f, format_, out);
}

}  // namespace kvcache::quant
