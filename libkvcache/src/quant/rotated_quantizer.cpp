// SPDX-License-Identifier: Apache-2.0
#include "quant/rotated_quantizer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvcache/error.h"
#include "quant/checks.h"
#include "quant/hadamard.h"

namespace kvcache::quant {

const ParamTable& RotatedQuantizer::table() {
  static const ParamTable t{
      "had",
      "Hadamard rotation (QuaRot arXiv 2404.00456; llama.cpp's rotated KV cache): each head's rows multiplied by "
      "the orthonormal H_D (D a power of two) before the wrapped quantizer or scheme stores them, undone on read: "
      "had(<spec>), e.g. had(int4), had:k(kivi:k2:v2:g32:r128)",
      {{"streams", "kv: rotate keys and values; k: keys only (cache schemes)", ParamDef::Kind::kChoice, 0, 0, 0,
        {"kv", "k"}}}};
  return t;
}

RotatedQuantizer::RotatedQuantizer(std::shared_ptr<const Quantizer> inner) : inner_(std::move(inner)) {
  KV_INTERNAL_ASSERT(inner_ != nullptr, "RotatedQuantizer without an inner quantizer");
  KV_CHECK_ARG(dynamic_cast<const RotatedQuantizer*>(inner_.get()) == nullptr, "spec 'had(", inner_->spec(),
               ")': '", inner_->spec(), "' is already rotated (H_D · H_D = I: a second rotation undoes the first)");
}

std::string RotatedQuantizer::spec() const {
  return canonical_spec(table(), {}, {{"streams", "kv"}}) + "(" + inner_->spec() + ")";
}

namespace {

void check_head_dim(int64_t d, const std::string& where) {
  KV_CHECK_ARG(is_power_of_two(d), where, ": the Hadamard rotation needs head_dim D a power of two, got D = ", d,
               " (H_D is built by Sylvester's doubling)");
}

/// Clamps the n values of a reconstruction rotated back to float32's finite range: the inverse
/// rotation of a finite decode can pass FLT_MAX only by the format's error on a row holding
/// values near FLT_MAX (finite in, finite out, as the other formats saturate). NaN stays NaN.
void saturate(float* x, int64_t n) {
  constexpr float kMax = std::numeric_limits<float>::max();
  for (int64_t i = 0; i < n; ++i) x[i] = std::min(std::max(x[i], -kMax), kMax);
}

/// Throws unless every row of the rotated `y` [B, H, T, D] is finite, naming the first row of
/// `x` whose rotation leaves float32 and the range that always rotates finitely.
void check_rotation_finite(const at::Tensor& x, const at::Tensor& y, const std::string& where) {
  if (at::isfinite(y).all().item<bool>()) return;
  const at::Tensor bad = at::logical_not(at::isfinite(y)).any(-1).nonzero()[0];
  const int64_t d = x.size(3);
  const at::Tensor row = x.index({bad[0], bad[1], bad[2]}).to(at::kFloat);
  throw InvalidArgument(detail::str_cat(
      where, ": row [b, h, t] = [", bad[0].item<int64_t>(), ", ", bad[1].item<int64_t>(), ", ", bad[2].item<int64_t>(),
      "] (max |x| = ", row.abs().max().item<float>(), ") rotates beyond float32: an entry of H_D·x exceeds ",
      std::numeric_limits<float>::max(), " (rows with every |x| <= FLT_MAX/sqrt(D) = ",
      std::numeric_limits<float>::max() / std::sqrt(static_cast<float>(d)),
      " always rotate finitely; docs/quantizers.md, \"Hadamard rotation\"); store such input unrotated"));
}

}  // namespace

at::Tensor RotatedQuantizer::rotate(const at::Tensor& x) const {
  at::Tensor y = x.to(at::kFloat).contiguous().clone();
  const int64_t d = y.size(-1);
  hadamard_rows(y.data_ptr<float>(), y.numel() / d, d);
  return y;
}

float RotatedQuantizer::fit_tensor_scale(const at::Tensor& x) const {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  if (xf.numel() == 0 || !is_power_of_two(xf.size(-1))) return inner_->fit_tensor_scale(xf);
  return inner_->fit_tensor_scale(rotate(xf));
}

void RotatedQuantizer::check_input(const at::Tensor& x) const {
  check_head_dim(x.size(3), "quantize(x) [" + spec() + "]");
}

QuantizedTensor RotatedQuantizer::do_quantize(const at::Tensor& x) const {
  const std::string where = "quantize(x) [" + spec() + "]";
  const at::Tensor y = rotate(x);
  check_rotation_finite(x, y, where);
  QuantizedTensor q;
  try {
    q = inner_->quantize(y);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(where + ": " + e.what());
  }
  q.format = spec();
  q.dtype = x.scalar_type();
  return q;
}

at::Tensor RotatedQuantizer::do_dequantize(const QuantizedTensor& q) const {
  QuantizedTensor inner_q = q;
  inner_q.format = inner_->spec();
  inner_q.dtype = at::kFloat;
  at::Tensor y;
  try {
    y = inner_->dequantize(inner_q).contiguous();
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("dequantize(q) [" + spec() + "]: " + e.what());
  }
  check_head_dim(y.size(3), "dequantize(q) [" + spec() + "]");
  hadamard_rows(y.data_ptr<float>(), y.numel() / y.size(3), y.size(3));
  saturate(y.data_ptr<float>(), y.numel());
  return to_input_dtype(y, q.dtype);  // saturating, as the other quantizers
}

void RotatedQuantizer::do_quantize_into(const at::Tensor& x, QuantizedTensor& out) const {
  const std::string where = "quantize_into(x, out) [" + spec() + "]";
  const at::Tensor y = rotate(x);
  check_rotation_finite(x, y, where);
  try {
    inner_->quantize_into(y, out);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(where + ": " + e.what());
  }
  out.format = spec();
  out.dtype = x.scalar_type();
}

void RotatedQuantizer::do_dequantize_into(const QuantizedTensor& q, at::Tensor& out) const {
  if (q.dtype != at::kFloat) {
    out = do_dequantize(q);  // rounded to q.dtype from a float32 reconstruction
    return;
  }
  QuantizedTensor inner_q = q;
  inner_q.format = inner_->spec();
  inner_q.dtype = at::kFloat;
  try {
    inner_->dequantize_into(inner_q, out);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("dequantize_into(q, out) [" + spec() + "]: " + e.what());
  }
  if (!out.is_contiguous()) out = out.contiguous();
  check_head_dim(out.size(3), "dequantize_into(q, out) [" + spec() + "]");
  hadamard_rows(out.data_ptr<float>(), out.numel() / out.size(3), out.size(3));
  saturate(out.data_ptr<float>(), out.numel());
}

StoredLayout RotatedQuantizer::do_stored_layout(int64_t head_dim) const {
  check_head_dim(head_dim, "stored_layout(head_dim) [" + spec() + "]");
  return inner_->stored_layout(head_dim);
}

EncodeStatus RotatedQuantizer::do_encode(const float* x, int64_t groups, int64_t head_dim, float tensor_scale,
                                         GroupBuffers out) const {
  const int64_t rows = groups * inner_->stored_layout(head_dim).group_tokens;
  const int64_t n = rows * head_dim;
  bool input_finite = true;
  for (int64_t i = 0; i < n; ++i) input_finite = input_finite && std::isfinite(x[i]);
  std::vector<float> y(x, x + n);
  hadamard_rows(y.data(), rows, head_dim);
  EncodeStatus s = inner_->encode(y.data(), groups, head_dim, tensor_scale, out);
  // Finite input whose rotation overflows float32 (|x| ~ 1e38) cannot be stored rotated: an
  // overflow, which the cache stores in its float32 fallback (unrotated), like any other.
  // Non-finite input stays non-finite (the rotation would smear a NaN over the whole row).
  if (s.nonfinite && input_finite) {
    s.nonfinite = false;
    s.overflow = true;
  }
  return s;
}

void RotatedQuantizer::do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float tensor_scale,
                                 float* out) const {
  inner_->decode(in, groups, head_dim, tensor_scale, out);
  const int64_t rows = groups * inner_->stored_layout(head_dim).group_tokens;
  hadamard_rows(out, rows, head_dim);
  saturate(out, rows * head_dim);
}

}  // namespace kvcache::quant
