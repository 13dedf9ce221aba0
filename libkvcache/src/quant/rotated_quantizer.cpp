// SPDX-License-Identifier: Apache-2.0
#include "quant/rotated_quantizer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/view_ops.h"
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

/// Throws unless every value of the rotated `y` (the rows of `x` `[B, H, T, D]` float32
/// contiguous, rotated) is finite, naming the first row of `x` whose rotation leaves float32 and
/// the range that always rotates finitely.
void check_rotation_finite(const TensorView& x, const std::vector<float>& y, const std::string& where) {
  size_t bad = 0;
  while (bad < y.size() && std::isfinite(y[bad])) ++bad;
  if (bad == y.size()) return;
  const int64_t d = x.size(3), t = x.size(2), heads = x.size(1);
  const int64_t row = static_cast<int64_t>(bad) / d;
  const float* xr = static_cast<const float*>(x.data) + row * d;
  float amax = 0.0f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::abs(xr[i]));
  throw InvalidArgument(detail::str_cat(
      where, ": row [b, h, t] = [", row / (t * heads), ", ", (row / t) % heads, ", ", row % t, "] (max |x| = ", amax,
      ") rotates beyond float32: an entry of H_D·x exceeds ", std::numeric_limits<float>::max(),
      " (rows with every |x| <= FLT_MAX/sqrt(D) = ", std::numeric_limits<float>::max() / std::sqrt(static_cast<float>(d)),
      " always rotate finitely; docs/quantizers.md, \"Hadamard rotation\"); store such input unrotated"));
}

}  // namespace

std::vector<float> RotatedQuantizer::rotate(const TensorView& x, const std::string& where) const {
  const auto* xp = static_cast<const float*>(x.data);
  std::vector<float> y(xp, xp + x.numel());
  const int64_t d = x.size(x.rank - 1);
  if (!y.empty()) hadamard_rows(y.data(), static_cast<int64_t>(y.size()) / d, d);
  check_rotation_finite(x, y, where);
  return y;
}

float RotatedQuantizer::fit_tensor_scale(const TensorView& x) const {
  if (x.numel() == 0 || x.rank < 1 || !is_power_of_two(x.size(x.rank - 1))) return inner_->fit_tensor_scale(x);
  std::vector<float> y = detail::to_float32(x);
  const int64_t d = x.size(x.rank - 1);
  hadamard_rows(y.data(), static_cast<int64_t>(y.size()) / d, d);
  return inner_->fit_tensor_scale(TensorView(y.data(), DType::kFloat32, {static_cast<int64_t>(y.size())}));
}

void RotatedQuantizer::check_input(const TensorView& x) const {
  check_head_dim(x.size(3), "quantize(x) [" + spec() + "]");
}

QuantizedTensor RotatedQuantizer::do_quantize(const Input& in) const {
  const std::string where = "quantize(x) [" + spec() + "]";
  const std::vector<float> y = rotate(in.x, where);
  QuantizedTensor q;
  try {
    q = inner_->quantize(TensorView(y.data(), DType::kFloat32, in.x.sizes()));
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(where + ": " + e.what());
  }
  q.format = spec();
  q.dtype = in.dtype;
  return q;
}

void RotatedQuantizer::do_quantize_into(const Input& in, QuantizedTensor& out) const {
  const std::string where = "quantize_into(x, out) [" + spec() + "]";
  const std::vector<float> y = rotate(in.x, where);
  try {
    inner_->quantize_into(TensorView(y.data(), DType::kFloat32, in.x.sizes()), out);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(where + ": " + e.what());
  }
  out.format = spec();
  out.dtype = in.dtype;
}

void RotatedQuantizer::do_dequantize_into(const QuantizedTensor& q, float* out) const {
  const std::string where = "dequantize_into(q, out) [" + spec() + "]";
  QuantizedTensor inner_q = q;
  inner_q.format = inner_->spec();
  inner_q.dtype = DType::kFloat32;
  try {
    inner_->dequantize_into(inner_q, MutableTensorView(out, DType::kFloat32, q.shape));
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(where + ": " + e.what());
  }
  check_head_dim(q.shape[3], where);
  if (q.numel() > 0) hadamard_rows(out, q.numel() / q.shape[3], q.shape[3]);
  saturate(out, q.numel());
}

StoredLayout RotatedQuantizer::do_stored_layout(int64_t head_dim) const {
  check_head_dim(head_dim, "stored_layout(head_dim) [" + spec() + "]");
  StoredLayout l = inner_->stored_layout(head_dim);
  l.kernel = KernelKind::kNone;  // rotated values: decoded (and rotated back) by the generic path
  return l;
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
