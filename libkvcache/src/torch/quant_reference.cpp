// SPDX-License-Identifier: Apache-2.0
// LibTorch-ops reference of the integer quantizers (see reference.h). Written for
// clarity: each step is one tensor op, in the order int_kernels.h specifies.
#include "torch/quant_reference.h"

#include <cmath>

#include "kvcache/error.h"

namespace kvcache::quant::ref {
namespace {

/// View x [B, H, T, D] so that groups run along dim `gdim` of the returned view:
/// per-token [B, H, T, D/g, g] (gdim 4), per-channel [B, H, T/g, g, D] (gdim 3).
at::Tensor grouped(const at::Tensor& x, int64_t g, GroupAxis axis, int64_t* gdim) {
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  if (axis == GroupAxis::kPerToken) {
    *gdim = 4;
    return x.reshape({b, h, t, d / g, g});
  }
  *gdim = 3;
  return x.reshape({b, h, t / g, g, d});
}

// fp32-metadata constants of int_kernels.h.
constexpr double kMinScale32 = 0x1p-126;
constexpr double kQuarterScale = 0x1p96;
constexpr double kQuarterRange = 0x1p98;
constexpr double kFltMax = 0x1.fffffep127;

/// Binary16 bits of `h` (float16) viewed as int16, stepped one fp16 value toward −∞ where
/// `mask` (a fp16 value above its target rounded up): sign-magnitude, so a negative value's
/// code grows.
at::Tensor fp16_step_down(const at::Tensor& h, const at::Tensor& mask) {
  const at::Tensor bits = h.view(at::kShort);
  const at::Tensor stepped = at::where(bits < 0, bits + 1, bits - 1);
  return at::where(mask, stepped, bits).view(at::kHalf);
}

}  // namespace

at::Tensor to_dtype_saturating(const at::Tensor& x, at::ScalarType dtype) {
  if (dtype == at::kFloat) return x.to(at::kFloat);
  const double m = dtype == at::kHalf ? 65504.0 : 0x1.fep127;  // largest finite
  return x.to(at::kFloat).clamp(-m, m).to(dtype);
}

IntRefResult quantize_int(const at::Tensor& x, int bits, int64_t g, GroupAxis axis) {
  KV_INTERNAL_ASSERT(x.dim() == 4 && g > 0, "reference quantize_int: bad input");
  const double levels = static_cast<double>((1 << bits) - 1);
  int64_t gdim = 0;
  const at::Tensor xg = grouped(x.to(at::kFloat), g, axis, &gdim);
  const at::Tensor mn = xg.amin(gdim, /*keepdim=*/true);
  const at::Tensor mx = xg.amax(gdim, /*keepdim=*/true);
  // fp16 metadata: z = round-down(mn), s = round-up((mx − z) / L), at least 2^-24 if mx > z.
  const at::Tensor z_nearest = mn.to(at::kHalf);
  at::Tensor z = fp16_step_down(z_nearest, z_nearest.to(at::kFloat) > mn);
  at::Tensor zf = z.to(at::kFloat);
  const at::Tensor scale32 = (mx - zf) / levels;  // float32 division
  const at::Tensor s_nearest = scale32.to(at::kHalf);
  at::Tensor s_bits = s_nearest.view(at::kShort);
  s_bits = at::where(s_nearest.to(at::kFloat) < scale32, s_bits + 1, s_bits);
  s_bits = at::where((s_bits == 0).logical_and(mx > zf), at::ones_like(s_bits), s_bits);
  at::Tensor s = s_bits.view(at::kHalf);
  at::Tensor codes_g;
  if (at::isfinite(z_nearest).all().item<bool>() && at::isfinite(z).all().item<bool>() &&
      at::isfinite(s).all().item<bool>()) {
    const at::Tensor sf = s.to(at::kFloat);
    const at::Tensor inv = at::where(sf == 0, at::zeros_like(sf), at::reciprocal(sf));
    codes_g = ((xg - zf) * inv).round().clamp(0, levels).to(at::kByte);
  } else {
    // Metadata outside fp16's range: fp32, z = mn, the range taken at 1/4 where it would
    // overflow, s ≥ 2^-126, and codes at 1/4 scale (k) where s ≥ 2^96.
    z = mn;
    zf = mn;
    const at::Tensor quarter = mx * 0.25 - mn * 0.25;
    const at::Tensor scale = at::where(quarter >= kQuarterRange, (quarter / levels) * 4.0, (mx - mn) / levels);
    s = at::where(mx > mn, scale.clamp_min(kMinScale32), at::zeros_like(scale));
    const at::Tensor k = at::where(s >= kQuarterScale, at::full_like(s, 0.25), at::ones_like(s));
    const at::Tensor inv = at::where(s == 0, at::zeros_like(s), at::reciprocal(s * k));
    codes_g = ((xg * k - zf * k) * inv).round().clamp(0, levels).to(at::kByte);
  }

  IntRefResult r;
  r.codes = codes_g.reshape(x.sizes());
  r.packed = pack_codes(r.codes, bits, g, axis);
  r.scales = s.squeeze(gdim).contiguous();
  r.zeros = z.squeeze(gdim).contiguous();
  return r;
}

namespace {

/// One plane of `w`-bit fields (w ∈ {1, 2, 4, 8}, k = 8/w per byte) of per-value fields
/// `f` [B, H, T, D] (int32), packed like the power-of-two formats: byte j of a group holds
/// fields j + m·g/k, m < k. Returns the grouped bytes: per-token [B, H, T, D/g, g/k],
/// per-channel [B, H, T/g, g/k, D] (int32).
at::Tensor pack_plane(const at::Tensor& f, int64_t w, int64_t g, GroupAxis axis) {
  const int64_t k = 8 / w;
  const int64_t b = f.size(0), h = f.size(1), t = f.size(2), d = f.size(3);
  at::Tensor streams;  // [..., k, g/k, ...]: stream m holds group elements [m·g/k, (m+1)·g/k)
  int64_t mdim = 0;
  if (axis == GroupAxis::kPerToken) {
    streams = f.reshape({b, h, t, d / g, k, g / k});
    mdim = 4;
  } else {
    streams = f.reshape({b, h, t / g, k, g / k, d});
    mdim = 3;
  }
  at::Tensor packed = at::zeros_like(streams.select(mdim, 0));
  for (int64_t m = 0; m < k; ++m) packed = packed.bitwise_or(streams.select(mdim, m).bitwise_left_shift(m * w));
  return packed;
}

/// Inverse of pack_plane: grouped bytes → per-value fields [B, H, T, D] (int32).
at::Tensor unpack_plane(const at::Tensor& p, int64_t w, int64_t g, GroupAxis axis, at::IntArrayRef shape) {
  const int64_t k = 8 / w;
  const int64_t b = shape[0], h = shape[1], t = shape[2], d = shape[3];
  std::vector<at::Tensor> streams;
  for (int64_t m = 0; m < k; ++m) streams.push_back(p.bitwise_right_shift(m * w).bitwise_and((1 << w) - 1));
  if (axis == GroupAxis::kPerToken) {
    // per stream [B, H, T, D/g, g/k]; stack at dim 4.
    for (auto& s : streams) s = s.reshape({b, h, t, d / g, g / k});
    return at::stack(streams, 4).reshape(shape);
  }
  for (auto& s : streams) s = s.reshape({b, h, t / g, g / k, d});
  return at::stack(streams, 3).reshape(shape);
}

/// The dim of the grouped bytes that runs along a group's bytes (code rows, per-channel).
int64_t byte_dim(GroupAxis axis) { return axis == GroupAxis::kPerToken ? 4 : 3; }

}  // namespace

at::Tensor pack_codes(const at::Tensor& codes, int bits, int64_t g, GroupAxis axis) {
  const int64_t b = codes.size(0), h = codes.size(1), t = codes.size(2), d = codes.size(3);
  const at::Tensor c = codes.to(at::kInt);
  at::Tensor packed;
  if (bits == 3) {
    // Two planes per group: the low two bits as int2 packs them, then the high bit.
    packed = at::cat({pack_plane(c.bitwise_and(3), 2, g, axis), pack_plane(c.bitwise_right_shift(2), 1, g, axis)},
                     byte_dim(axis));
  } else {
    packed = pack_plane(c, bits, g, axis);
  }
  packed = packed.to(at::kByte);
  return axis == GroupAxis::kPerToken ? packed.reshape({b, h, t, d * bits / 8}) : packed.reshape({b, h, t * bits / 8, d});
}

at::Tensor unpack_codes(const at::Tensor& packed, int bits, int64_t g, GroupAxis axis, at::IntArrayRef shape) {
  const int64_t b = shape[0], h = shape[1], t = shape[2], d = shape[3];
  const int64_t gb = g * bits / 8;  // bytes (code rows) per group
  const at::Tensor p = axis == GroupAxis::kPerToken ? packed.to(at::kInt).reshape({b, h, t, d / g, gb})
                                                    : packed.to(at::kInt).reshape({b, h, t / g, gb, d});
  if (bits == 3) {
    const at::Tensor lo = unpack_plane(p.narrow(byte_dim(axis), 0, g / 4), 2, g, axis, shape);
    const at::Tensor hi = unpack_plane(p.narrow(byte_dim(axis), g / 4, g / 8), 1, g, axis, shape);
    return lo.bitwise_or(hi.bitwise_left_shift(2)).to(at::kByte);
  }
  return unpack_plane(p, bits, g, axis, shape).to(at::kByte);
}

at::Tensor dequantize_int(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, int64_t g,
                          GroupAxis axis) {
  int64_t gdim = 0;
  const at::Tensor cg = grouped(codes.to(at::kFloat), g, axis, &gdim);
  const at::Tensor s = scales.to(at::kFloat).unsqueeze(gdim);
  const at::Tensor z = zeros.to(at::kFloat).unsqueeze(gdim);
  if (scales.scalar_type() == at::kHalf) return (cg * s + z).reshape(codes.sizes());
  // fp32 metadata: at 1/4 scale where s ≥ 2^96, clamped to ±FLT_MAX (int_kernels.h).
  const at::Tensor quarter = s >= kQuarterScale;
  const at::Tensor k = at::where(quarter, at::full_like(s, 0.25), at::ones_like(s));
  const at::Tensor back = at::where(quarter, at::full_like(s, 4.0), at::ones_like(s));
  const at::Tensor v = at::minimum(at::maximum(cg * (s * k) + z * k, -kFltMax * k), kFltMax * k);
  return (v * back).reshape(codes.sizes());
}

at::Tensor hadamard_matrix(int64_t d) {
  KV_INTERNAL_ASSERT(d >= 1 && (d & (d - 1)) == 0, "hadamard_matrix: d = ", d, " is not a power of two");
  at::Tensor h = at::empty({d, d}, at::kDouble);
  const double s = 1.0 / std::sqrt(static_cast<double>(d));
  auto a = h.accessor<double, 2>();
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = 0; j < d; ++j) a[i][j] = (__builtin_popcountll(static_cast<uint64_t>(i & j)) % 2 ? -s : s);
  }
  return h;
}

}  // namespace kvcache::quant::ref
