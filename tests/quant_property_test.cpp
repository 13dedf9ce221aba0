// SPDX-License-Identifier: Apache-2.0
// Property test of every registered quantizer spec over adversarial value classes
// (constant groups, 1e-30 / 1e-40 / 1e-45, ±65504, bf16's max, FLT_MAX, large offsets with
// tiny ranges, mixed signs and magnitudes), each input dtype, contiguous and strided, and
// T = 0 / 1. For every case:
//   * finite in → finite out (or the one documented rejection: fp16 storage of |x| ≥ 65520);
//   * the documented error bound (docs/quantizers.md) on the float32 reconstruction, and the
//     returned tensor is exactly that reconstruction rounded to the input dtype, saturating;
//   * nbytes() is exactly what the StoredLayout says (fp32 metadata when promoted);
//   * encode()/decode() write quantize()'s bytes and return its float32 reconstruction, or
//     report overflow exactly when quantize() had to leave the layout; a group encode() wrote
//     without overflow decodes finite and within the bound.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"
#include "torch/quant_reference.h"
#include "quant_test_util.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

constexpr float kFltMax = std::numeric_limits<float>::max();
constexpr float kBf16Max = 0x1.fep127f;
constexpr float kFp16Max = 65504.0f;
constexpr int64_t kB = 1, kH = 2, kD = 64;

/// What a spec is, as far as its bound is concerned.
struct SpecInfo {
  enum Kind { kFp32, kFp16, kBf16, kFp8, kInt } kind = kFp32;
  int bits = 0;            // int: 2, 3, 4, 8
  int fp8_man = 0;         // fp8: mantissa bits (3 for e4m3, 2 for e5m2)
  int fp8_bias = 0;        // fp8: exponent bias
  float fp8_max = 0;       // fp8: largest finite
  bool scaled = false;     // fp8:*:scaled
};

SpecInfo info_of(const std::string& spec) {
  SpecInfo i;
  if (spec == "fp32") return i;
  if (spec == "fp16") {
    i.kind = SpecInfo::kFp16;
  } else if (spec == "bf16") {
    i.kind = SpecInfo::kBf16;
  } else if (spec.rfind("fp8", 0) == 0) {
    i.kind = SpecInfo::kFp8;
    const bool e4m3 = spec.find("e4m3") != std::string::npos;
    i.fp8_man = e4m3 ? 3 : 2;
    i.fp8_bias = e4m3 ? 7 : 15;
    i.fp8_max = e4m3 ? 448.0f : 57344.0f;
    i.scaled = spec.find("scaled") != std::string::npos;
  } else if (spec.rfind("int", 0) == 0) {
    i.kind = SpecInfo::kInt;
    i.bits = spec[3] - '0';
  } else {
    ADD_FAILURE() << "no documented bound for '" << spec << "': add its kind to info_of() and bound_of()";
  }
  return i;
}

/// The largest finite value of an input dtype.
float dtype_max(at::ScalarType t) { return t == at::kHalf ? kFp16Max : t == at::kBFloat16 ? kBf16Max : kFltMax; }

// ------------------------------------------------------------------ value classes
// Each builds float32 [1, 2, T, 64]; values a dtype cannot hold are clamped to its range
// before the cast (the classes are about the values that dtype CAN hold).

using Gen = at::Generator;
struct ValueClass {
  std::string name;
  std::function<at::Tensor(int64_t t, Gen& gen)> make;
};

at::Tensor shape_randn(int64_t t, Gen& gen) { return at::randn({kB, kH, t, kD}, gen); }
at::Tensor shape_rand(int64_t t, Gen& gen) { return at::rand({kB, kH, t, kD}, gen); }
at::Tensor random_signs(int64_t t, Gen& gen) { return at::where(shape_rand(t, gen) < 0.5, -1.0, 1.0).to(at::kFloat); }

/// Each element replaced by `v` (with a random sign when `sign`) with probability p.
at::Tensor sprinkle(at::Tensor x, float v, double p, bool sign, Gen& gen) {
  const int64_t t = x.size(2);
  at::Tensor val = sign ? random_signs(t, gen) * v : at::full_like(x, v);
  return at::where(shape_rand(t, gen) < p, val, x);
}

std::vector<ValueClass> value_classes() {
  std::vector<ValueClass> c;
  c.push_back({"normal", [](int64_t t, Gen& g) { return shape_randn(t, g); }});
  c.push_back({"outliers", [](int64_t t, Gen& g) {
                 (void)g;
                 return testing::outlier_kv({kB, kH, t, kD}, 7);
               }});
  c.push_back({"zeros", [](int64_t t, Gen& g) {
                 (void)g;
                 return at::zeros({kB, kH, t, kD});
               }});
  // Constant groups: per token a constant (fp16-representable or not), per channel too.
  c.push_back({"constant_tokens", [](int64_t t, Gen& g) {
                 const at::Tensor v = at::randn({kB, kH, t, 1}, g) * 100.0 + 0.3;
                 return v.expand({kB, kH, t, kD}).contiguous();
               }});
  c.push_back({"constant_channels", [](int64_t t, Gen& g) {
                 const at::Tensor v = at::randn({kB, kH, 1, kD}, g) * 3.0 + 0.1;
                 return v.expand({kB, kH, t, kD}).contiguous();
               }});
  c.push_back({"tiny_1e-30", [](int64_t t, Gen& g) { return shape_randn(t, g) * 1e-30; }});
  c.push_back({"denormal_1e-40", [](int64_t t, Gen& g) { return shape_randn(t, g) * 1e-40; }});
  c.push_back({"denormal_1e-45", [](int64_t t, Gen& g) {
                 // multiples of the least float32 denormal: 0, ±1, ±2, ±3 × 1.4e-45
                 return (at::randint(-3, 4, {kB, kH, t, kD}, g).to(at::kFloat) * 1.4e-45f);
               }});
  c.push_back({"tiny_in_normal", [](int64_t t, Gen& g) { return sprinkle(shape_randn(t, g), 1e-40f, 0.3, true, g); }});
  c.push_back({"fp16_max_mixed", [](int64_t t, Gen& g) {
                 return sprinkle(shape_randn(t, g) * 100.0, kFp16Max, 0.2, true, g);
               }});
  c.push_back({"fp16_max_positive", [](int64_t t, Gen& g) {  // groups [~0, 65504]: the top code overshoots
                 return sprinkle(shape_rand(t, g) * 30000.0, kFp16Max, 0.3, false, g);
               }});
  c.push_back({"fp16_max_all", [](int64_t t, Gen& g) { return random_signs(t, g) * kFp16Max; }});
  c.push_back({"past_fp16_max", [](int64_t t, Gen& g) {  // 65504 < x < 65520 rounds to 65504 in fp16
                 return 65504.0 + shape_rand(t, g) * 15.9;
               }});
  c.push_back({"bf16_max_mixed", [](int64_t t, Gen& g) { return sprinkle(shape_randn(t, g), kBf16Max, 0.2, true, g); }});
  c.push_back({"bf16_max_all", [](int64_t t, Gen& g) { return random_signs(t, g) * kBf16Max; }});
  c.push_back({"flt_max_mixed", [](int64_t t, Gen& g) { return sprinkle(shape_randn(t, g), kFltMax, 0.2, true, g); }});
  c.push_back({"flt_max_positive", [](int64_t t, Gen& g) {
                 return sprinkle(shape_rand(t, g) * 1e38, kFltMax, 0.3, false, g);
               }});
  // Large offsets, tiny ranges: the 1000.3 case, 1e6 + tiny (past fp16), −1e6 + tiny.
  c.push_back({"offset_1000.3", [](int64_t t, Gen& g) { return 1000.3 + shape_rand(t, g) * 0.05; }});
  c.push_back({"offset_1e6", [](int64_t t, Gen& g) { return 1e6 + shape_rand(t, g) * 0.1; }});
  c.push_back({"offset_-1e6", [](int64_t t, Gen& g) { return -1e6 + shape_rand(t, g) * 0.1; }});
  c.push_back({"offset_60000", [](int64_t t, Gen& g) { return 60000.0 + shape_rand(t, g) * 3.0; }});
  // Mixed signs over 76 decades, 1e-38 to 1e38 (clamped to each dtype below).
  c.push_back({"mixed_magnitudes", [](int64_t t, Gen& g) {
                 return random_signs(t, g) * at::pow(10.0, shape_rand(t, g) * 76.0 - 38.0);
               }});
  return c;
}

at::Tensor in_dtype(const at::Tensor& xf, at::ScalarType dtype) {
  const double m = dtype_max(dtype);
  return xf.clamp(-m, m).to(dtype);
}

// ------------------------------------------------------------------ bounds

/// Per-element scale s and zero z of an int QuantizedTensor, broadcast to x's shape (float).
void broadcast_meta(const QuantizedTensor& qt, GroupAxis axis, at::Tensor* sb, at::Tensor* zb) {
  const at::Tensor s = as_tensor(qt.scales).to(at::kFloat), z = as_tensor(qt.zeros).to(at::kFloat);
  if (axis == GroupAxis::kPerToken) {
    const int64_t g = kD / s.size(3);
    *sb = s.repeat_interleave(g, 3);
    *zb = z.repeat_interleave(g, 3);
  } else {
    const int64_t g = qt.shape[2] / s.size(2);
    *sb = s.repeat_interleave(g, 2);
    *zb = z.repeat_interleave(g, 2);
  }
}

/// The documented bound of docs/quantizers.md on |x − x̂| for the float32 reconstruction x̂
/// of x (float64 per element). For int formats `extra` also requires z ≤ x (the zero is
/// rounded down, so no value lies below it).
at::Tensor bound_of(const SpecInfo& info, const QuantizedTensor& qt, GroupAxis axis, const at::Tensor& x,
                    at::Tensor* extra, std::string* why) {
  const at::Tensor ax = x.abs();
  *extra = at::ones_like(x, at::kBool);
  switch (info.kind) {
    case SpecInfo::kFp32:
      *why = "fp32: exact";
      return at::zeros_like(x);
    case SpecInfo::kFp16:
      // Round to nearest: half an fp16 step, ≤ 2^-11 relative (2^-25 absolute below 2^-14).
      *why = "fp16: |x − x̂| ≤ 2^-11·|x| + 2^-25";
      return ax * std::ldexp(1.0, -11) + std::ldexp(1.0, -25);
    case SpecInfo::kBf16:
      // Half a bf16 step (2^-8 relative: 8 significant bits; 2^-134 among its denormals); values past bf16's
      // largest finite saturate to it.
      *why = "bf16: |x − x̂| ≤ 2^-8·|x| + 2^-134 + (|x| − 3.3895e38 past it)";
      return ax * std::ldexp(1.0, -8) + std::ldexp(1.0, -134) + (ax - static_cast<double>(kBf16Max)).clamp_min(0);
    case SpecInfo::kFp8: {
      // v = x / s (s = 1 unscaled): |v − fp8(v)| ≤ 2^-(M+1)·|v| + 2^(−bias−M) (half the
      // least subnormal), saturating at ±max beyond it; times s, plus float32 rounding of
      // x / s and of the product (2^-22 relative).
      const double s = info.scaled ? as_tensor(qt.scales).item<float>() : 1.0;
      *why = "fp8: |x − x̂| ≤ (2^-(M+1) + 2^-22)·|x| + s·2^(−bias−M) + (|x| − s·max past it)";
      return ax * (std::ldexp(1.0, -info.fp8_man - 1) + std::ldexp(1.0, -22)) +
             std::ldexp(1.0, -info.fp8_bias - info.fp8_man) * s +
             (ax - static_cast<double>(info.fp8_max) * s).clamp_min(0);
    }
    case SpecInfo::kInt: {
      at::Tensor sb, zb;
      broadcast_meta(qt, axis, &sb, &zb);
      sb = sb.to(at::kDouble);
      *extra = zb.to(at::kDouble) <= x;
      const double levels = static_cast<double>((1 << info.bits) - 1);
      *why = "int: |x − x̂| ≤ s/2 + 2^-21·(L·s + |x|), z ≤ x";
      return sb * 0.5 + (sb * levels + ax) * std::ldexp(1.0, -21);
    }
  }
  return at::zeros_like(x);
}

/// "[b, h, t, d] x = …, x̂ = …, bound …" of the first element where `ok` is false, or "".
std::string first_violation(const at::Tensor& ok, const at::Tensor& x, const at::Tensor& xh, const at::Tensor& bound) {
  if (ok.all().item<bool>()) return "";
  const at::Tensor idx = ok.logical_not().nonzero()[0];
  at::Tensor xs = x, hs = xh, bs = bound;
  std::string where = "[";
  for (int64_t i = 0; i < idx.numel(); ++i) {
    const int64_t k = idx[i].item<int64_t>();
    where += (i ? ", " : "") + std::to_string(k);
    xs = xs.select(0, k);
    hs = hs.select(0, k);
    bs = bs.select(0, k);
  }
  char buf[200];
  std::snprintf(buf, sizeof buf, "] x = %.9g, x̂ = %.9g, |x − x̂| = %.4g, bound %.4g", xs.item<double>(),
                hs.item<double>(), std::fabs(xs.item<double>() - hs.item<double>()), bs.item<double>());
  return where + buf;
}

int64_t bytes_of(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

/// The float32 reconstruction dequantize() computes before narrowing to the input dtype.
at::Tensor reconstruct_f32(const Quantizer& q, QuantizedTensor qt) {
  qt.dtype = kvcache::DType::kFloat32;
  return kvcache::dequantize(q, qt);
}

bool promoted(const SpecInfo& info, const QuantizedTensor& qt) {
  return info.kind == SpecInfo::kInt && as_tensor(qt.scales).scalar_type() == at::kFloat;
}

/// Buffers of n groups of a layout.
struct Buffers {
  std::vector<uint8_t> codes, scales, zeros;
  Buffers(const StoredLayout& l, int64_t n)
      : codes(static_cast<size_t>(n * l.code_bytes)),
        scales(static_cast<size_t>(n * l.meta_count * kvcache::dtype_size(l.meta_dtype))),
        zeros(l.has_zeros ? scales.size() : 0) {}
  GroupBuffers out() { return {codes.data(), scales.data(), zeros.data()}; }
  ConstGroupBuffers in() const { return {codes.data(), scales.data(), zeros.data()}; }
};

bool same_bytes(const std::vector<uint8_t>& v, const at::Tensor& t) {
  return static_cast<int64_t>(v.size()) == bytes_of(t) && (v.empty() || std::memcmp(v.data(), t.data_ptr(), v.size()) == 0);
}

/// Checks quantize()/dequantize() of x (its dtype, any strides) against the properties above.
/// Returns false (after recording failures) on the first broken property.
bool check_quantize(const Quantizer& q, const SpecInfo& info, const at::Tensor& x) {
  const at::ScalarType dtype = x.scalar_type();
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor x64 = xf.to(at::kDouble);
  if (info.kind == SpecInfo::kFp16 && xf.numel() > 0 && (xf.abs() >= 65520.0f).any().item<bool>()) {
    // The documented rejection: fp16 storage of a value it would round to ±Inf.
    try {
      q.quantize(x);
      ADD_FAILURE() << "fp16 storage of |x| ≥ 65520 must be rejected";
      return false;
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("outside fp16's range"));
    }
    return true;
  }
  const QuantizedTensor qt = q.quantize(x);
  const at::Tensor y = kvcache::dequantize(q, qt);
  EXPECT_EQ(y.scalar_type(), dtype);
  EXPECT_EQ(y.sizes(), x.sizes());
  if (!at::isfinite(y).all().item<bool>()) {
    ADD_FAILURE() << "finite in, non-finite out: " << first_violation(at::isfinite(y), x64, y.to(at::kDouble), x64);
    return false;
  }
  const StoredLayout l = q.stored_layout(kD);
  const int64_t groups = x.numel() / (kD * l.group_tokens);
  const int64_t meta = promoted(info, qt) ? l.meta_count * 2 * 4 : l.meta_bytes();
  // Exact byte counts: what the StoredLayout says (fp32 metadata, 4 B each, when promoted).
  EXPECT_EQ(qt.nbytes(), groups * (l.code_bytes + meta) + (l.tensor_scale ? 4 : 0));
  EXPECT_EQ(qt.nbytes(), bytes_of(as_tensor(qt.codes)) + bytes_of(as_tensor(qt.scales)) + bytes_of(as_tensor(qt.zeros)));
  if (l.tensor_scale) {
    EXPECT_EQ(q.fit_tensor_scale(xf), as_tensor(qt.scales).item<float>());
  }
  if (x.numel() == 0) return !::testing::Test::HasFailure();
  const at::Tensor xh = reconstruct_f32(q, qt);
  EXPECT_TRUE(at::isfinite(xh).all().item<bool>());
  // The returned tensor is the float32 reconstruction rounded to the input dtype, saturating.
  if (!at::equal(y, quant::ref::to_dtype_saturating(xh, dtype))) {
    ADD_FAILURE() << "dequantize() is not x̂ rounded to " << c10::toString(dtype);
    return false;
  }
  at::Tensor extra;
  std::string why;
  const at::Tensor bound = bound_of(info, qt, q.group_axis(), x64, &extra, &why);
  const at::Tensor xh64 = xh.to(at::kDouble);
  const at::Tensor ok = ((x64 - xh64).abs() <= bound) & extra;
  const std::string v = first_violation(ok, x64, xh64, bound);
  if (!v.empty()) {
    ADD_FAILURE() << why << " violated at " << v << (promoted(info, qt) ? " (fp32 metadata)" : "");
    return false;
  }
  if (dtype != at::kFloat) {
    // Rounding x̂ to the input dtype, whose grid holds x: at most doubles the error.
    const at::Tensor y64 = y.to(at::kDouble);
    const std::string v2 = first_violation((x64 - y64).abs() <= bound * 2, x64, y64, bound * 2);
    if (!v2.empty()) {
      ADD_FAILURE() << "2 × (" << why << ") violated after rounding to " << c10::toString(dtype) << " at " << v2;
      return false;
    }
  }
  return !::testing::Test::HasFailure();
}

/// encode()/decode() of x (float32, contiguous) against quantize(): same bytes and float32
/// reconstruction when no overflow is reported; overflow exactly when quantize() left the
/// layout (int: fp32 metadata; fp16: rejection); each group encoded alone agrees likewise.
void check_codec(const Quantizer& q, const SpecInfo& info, const at::Tensor& x, int64_t max_single_groups) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const StoredLayout l = q.stored_layout(kD);
  const int64_t gt = l.group_tokens;
  const int64_t groups = xf.numel() / (kD * gt);
  if (groups == 0) return;
  const bool fp16_rejects = info.kind == SpecInfo::kFp16 && (xf.abs() >= 65520.0f).any().item<bool>();
  const float ts = q.fit_tensor_scale(xf);
  Buffers buf(l, groups);
  const EncodeStatus st = q.encode(xf.data_ptr<float>(), groups, kD, ts, buf.out());
  EXPECT_FALSE(st.nonfinite);
  if (fp16_rejects) {
    EXPECT_TRUE(st.overflow) << "fp16 encode of |x| ≥ 65520 must report overflow";
    return;
  }
  const QuantizedTensor qt = q.quantize(xf);
  EXPECT_EQ(st.overflow, promoted(info, qt)) << "encode() overflow must match quantize()'s fp32 metadata";
  if (!st.overflow) {
    EXPECT_TRUE(same_bytes(buf.codes, as_tensor(qt.codes))) << "codes";
    if (l.meta_count > 0) {
      EXPECT_TRUE(same_bytes(buf.scales, as_tensor(qt.scales))) << "scales";
    }
    if (l.has_zeros) {
      EXPECT_TRUE(same_bytes(buf.zeros, as_tensor(qt.zeros))) << "zeros";
    }
    at::Tensor out = at::empty(xf.sizes());
    q.decode(buf.in(), groups, kD, ts, out.data_ptr<float>());
    EXPECT_TRUE(at::equal(out, reconstruct_f32(q, qt))) << "decode() != dequantize() in float32";
    return;
  }
  // Overflow somewhere: every group encoded alone either overflows (and quantize() of it
  // promotes) or matches quantize() of it and decodes finite within the bound.
  const at::Tensor rows = xf.view({groups, gt, kD});
  for (int64_t i = 0; i < std::min(groups, max_single_groups); ++i) {
    const at::Tensor xg = rows[i].view({1, 1, gt, kD}).contiguous();
    Buffers one(l, 1);
    const EncodeStatus s1 = q.encode(xg.data_ptr<float>(), 1, kD, ts, one.out());
    const QuantizedTensor qg = q.quantize(xg);
    EXPECT_EQ(s1.overflow, promoted(info, qg)) << "group " << i;
    if (s1.overflow) continue;
    at::Tensor out = at::empty(xg.sizes());
    q.decode(one.in(), 1, kD, ts, out.data_ptr<float>());
    EXPECT_TRUE(at::isfinite(out).all().item<bool>()) << "group " << i << " decodes non-finite";
    EXPECT_TRUE(same_bytes(one.codes, as_tensor(qg.codes))) << "group " << i;
    EXPECT_TRUE(at::equal(out, reconstruct_f32(q, qg))) << "group " << i;
    check_quantize(q, info, xg);
    if (::testing::Test::HasFailure()) return;
  }
}

class QuantizerProperty : public ::testing::TestWithParam<std::string> {};

TEST_P(QuantizerProperty, AdversarialValuesAreFiniteWithinTheBoundAndByteExact) {
  auto q = make_quantizer(GetParam());
  const SpecInfo info = info_of(GetParam());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  const int64_t t = 64;  // a multiple of every per-channel group in contract_specs()
  for (const ValueClass& c : value_classes()) {
    const at::Tensor xf = c.make(t, gen);
    for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      SCOPED_TRACE(c.name + ", " + c10::toString(dtype) + " input");
      const at::Tensor x = in_dtype(xf, dtype);
      ASSERT_TRUE(at::isfinite(x).all().item<bool>());
      if (!check_quantize(*q, info, x)) return;
      // Any strides: a [B, T, H, D] buffer viewed as [B, H, T, D] quantizes to the same bytes.
      const at::Tensor xs = x.transpose(1, 2).contiguous().transpose(1, 2);
      ASSERT_FALSE(xs.is_contiguous());
      if (!check_quantize(*q, info, xs)) return;
      if (info.kind != SpecInfo::kFp16 || !(x.to(at::kFloat).abs() >= 65520.0f).any().item<bool>()) {
        const QuantizedTensor a = q->quantize(x), b = q->quantize(xs);
        EXPECT_TRUE(at::equal(as_tensor(a.codes), as_tensor(b.codes)));
        EXPECT_TRUE(at::equal(kvcache::dequantize(*q, a), kvcache::dequantize(*q, b)));
      }
      check_codec(*q, info, x, 16);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

TEST_P(QuantizerProperty, EmptyAndSingleTokenTensors) {
  auto q = make_quantizer(GetParam());
  const SpecInfo info = info_of(GetParam());
  const bool per_channel = q->group_axis() == GroupAxis::kPerChannel;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    // T = 0: nothing stored but the per-tensor scale of fp8:*:scaled.
    const at::Tensor empty = at::empty({kB, kH, 0, kD}, at::TensorOptions().dtype(dtype));
    const QuantizedTensor qe = q->quantize(empty);
    EXPECT_EQ(qe.nbytes(), info.scaled ? 4 : 0);
    const at::Tensor ye = kvcache::dequantize(*q, qe);
    EXPECT_EQ(ye.sizes(), empty.sizes());
    EXPECT_EQ(ye.scalar_type(), dtype);
    EXPECT_TRUE(check_quantize(*q, info, empty));
    EXPECT_FALSE(q->encode(nullptr, 0, kD, 1.0f, {}).overflow);
    // T = 1: a per-token format holds it; a per-channel group of g > 1 tokens cannot.
    for (const ValueClass& c : value_classes()) {
      SCOPED_TRACE(c.name);
      const at::Tensor x = in_dtype(c.make(1, gen), dtype);
      if (per_channel) {
        try {
          q->quantize(x);
          ADD_FAILURE() << "T = 1 must be rejected by " << GetParam();
        } catch (const InvalidArgument& e) {
          EXPECT_THAT(e.what(), HasSubstr("T = 1"));
        }
        break;
      }
      if (!check_quantize(*q, info, x)) return;
      check_codec(*q, info, x, 2);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllSpecs, QuantizerProperty, ::testing::ValuesIn(testing::property_specs()),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           std::string n;
                           for (char c : p.param) n += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
                           return n;
                         });

// The counterexample to the old "within one step" claim: int8:g4 on
// [1000.3, 1000.31, 1000.32, 1000.35] reconstructed all four as 1000.5 (fp16(1000.3) =
// 1000.5 > every value, codes clamped at 0). Now z = 1000 (rounded down), s = fp16 round-up
// of 0.35/255 = 0.001373291015625, and each value is within s/2.
TEST(IntBound, OffsetGroupWithTinyRangeIsWithinHalfAStep) {
  const at::Tensor x = at::tensor({1000.3f, 1000.31f, 1000.32f, 1000.35f}).reshape({1, 1, 1, 4});
  auto q = make_quantizer("int8:g4");
  const QuantizedTensor qt = q->quantize(x);
  EXPECT_EQ(as_tensor(qt.zeros).item<float>(), 1000.0f);
  EXPECT_EQ(as_tensor(qt.scales).item<float>(), 0.001373291015625f);
  const at::Tensor y = kvcache::dequantize(*q, qt);
  const float s = as_tensor(qt.scales).item<float>();
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_LE(std::fabs(y[0][0][0][i].item<float>() - x[0][0][0][i].item<float>()), s / 2 + 1e-4f) << i;
  }
  // The old result, 1000.5, was 0.2 off: about 1,000 of the old steps (0.05 / 255).
  EXPECT_LT(reconstruction_error(x, y).max_abs, 1e-3);
}

// fp16 input at ±65504: the top code of a [0, 65504] group overshoots 65504 (int2: z = 0,
// s = 21840, 3·s = 65520, which rounds to +Inf in fp16); dequantize() saturates instead.
TEST(IntBound, Fp16MaxInputComesBackFinite) {
  const at::Tensor x = at::tensor({0.0f, 65504.0f, -65504.0f, 65504.0f}).reshape({1, 1, 1, 4}).to(at::kHalf);
  for (const char* spec : {"int2:g4", "int4:g4", "int8:g4", "bf16", "fp8:e5m2:scaled"}) {
    auto q = make_quantizer(spec);
    const at::Tensor y = kvcache::dequantize(*q, q->quantize(x));
    EXPECT_TRUE(at::isfinite(y).all().item<bool>()) << spec;
    EXPECT_EQ(y[0][0][0][1].item<float>(), 65504.0f) << spec;
  }
  const at::Tensor top = at::tensor({0.0f, 65504.0f, 1.0f, 2.0f}).reshape({1, 1, 1, 4}).to(at::kHalf);
  QuantizedTensor qt = make_quantizer("int2:g4")->quantize(top);
  EXPECT_EQ(as_tensor(qt.scales).item<float>(), 21840.0f);  // 65504 / 3 rounded up to fp16
  qt.dtype = kvcache::DType::kFloat32;
  EXPECT_EQ(kvcache::dequantize(*make_quantizer("int2:g4"), qt)[0][0][0][1].item<float>(), 65520.0f);
}

// bf16 storage saturates: FLT_MAX rounds past bf16's largest finite and is stored as it.
TEST(FloatBound, Bf16SaturatesNearFltMax) {
  const float big = std::numeric_limits<float>::max();
  const at::Tensor x = at::tensor({big, -big, 1.0f, kBf16Max}).reshape({1, 1, 1, 4});
  auto q = make_quantizer("bf16");
  const at::Tensor y = kvcache::dequantize(*q, q->quantize(x));
  EXPECT_EQ(y[0][0][0][0].item<float>(), kBf16Max);
  EXPECT_EQ(y[0][0][0][1].item<float>(), -kBf16Max);
  EXPECT_EQ(y[0][0][0][3].item<float>(), kBf16Max);
  std::vector<uint16_t> codes(4);
  EXPECT_FALSE(q->encode(x.data_ptr<float>(), 1, 4, 1.0f, {reinterpret_cast<uint8_t*>(codes.data()), nullptr, nullptr})
                   .overflow);
  EXPECT_EQ(codes[0], 0x7f7f);
  EXPECT_EQ(codes[1], 0xff7f);
}

// fp8:*:scaled with amax = FLT_MAX: the scale is lowered so that max · s stays finite, and a
// caller's stream scale too large for that is reported by encode().
TEST(Fp8Bound, ScaleNearFltMaxDecodesFinite) {
  const float big = std::numeric_limits<float>::max();
  for (const char* spec : {"fp8:e4m3:scaled", "fp8:e5m2:scaled"}) {
    auto q = make_quantizer(spec);
    const at::Tensor x = at::tensor({big, -big, 1.0f, 0.0f}).reshape({1, 1, 1, 4});
    const at::Tensor y = kvcache::dequantize(*q, q->quantize(x));
    EXPECT_TRUE(at::isfinite(y).all().item<bool>()) << spec;
    EXPECT_NEAR(y[0][0][0][0].item<float>() / big, 1.0, 1e-6) << spec;
    std::vector<uint8_t> codes(4);
    EXPECT_FALSE(q->encode(x.data_ptr<float>(), 1, 4, q->fit_tensor_scale(x), {codes.data(), nullptr, nullptr}).overflow);
    EXPECT_TRUE(q->encode(x.data_ptr<float>(), 1, 4, big, {codes.data(), nullptr, nullptr}).overflow) << spec;
  }
}

}  // namespace
}  // namespace kvcache
