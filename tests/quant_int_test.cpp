// SPDX-License-Identifier: Apache-2.0
// Integer quantizers: hand-checked cases (methods.md b.1, b.2), packing golden vectors,
// degenerate input, fp16-range metadata, and fast-path vs LibTorch-ops reference parity.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"
#include "torch/quant_reference.h"
#include "quant/simd.h"
#include "quant_test_util.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

at::Tensor row(std::vector<float> v) {
  const auto n = static_cast<int64_t>(v.size());
  return at::tensor(v).reshape({1, 1, 1, n});
}

std::vector<int> bytes_of(const at::Tensor& t) {
  at::Tensor c = t.contiguous().to(at::kInt);
  return std::vector<int>(c.data_ptr<int>(), c.data_ptr<int>() + c.numel());
}

std::vector<float> floats_of(const at::Tensor& t) {
  at::Tensor c = t.contiguous().to(at::kFloat);
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

const std::vector<float> kWorked = {0.10f, -0.50f, 0.32f, 1.20f, -0.05f, 0.77f, -0.31f, 0.48f};

// methods.md b.1: int4, g = 8.
TEST(IntQuantizerExact, Int4WorkedExampleCodesAndFp16Reconstruction) {
  auto q = make_quantizer("int4:g8");
  QuantizedTensor qt = q->quantize(row(kWorked));
  const auto codes = quant::ref::unpack_codes(as_tensor(qt.codes), 4, 8, GroupAxis::kPerToken, {1, 1, 1, 8});
  EXPECT_EQ(bytes_of(codes), (std::vector<int>{5, 0, 7, 15, 4, 11, 2, 9}));
  // Golden packing: byte j = c[j] | c[j + 4] << 4.
  EXPECT_EQ(bytes_of(as_tensor(qt.codes)), (std::vector<int>{0x45, 0xB0, 0x27, 0x9F}));
  ASSERT_EQ(as_tensor(qt.scales).scalar_type(), at::kHalf);
  EXPECT_EQ(floats_of(as_tensor(qt.scales)), (std::vector<float>{0.11334228515625f}));
  EXPECT_EQ(floats_of(as_tensor(qt.zeros)), (std::vector<float>{-0.5f}));
  const std::vector<float> expect = {0.06671f, -0.5f, 0.29340f, 1.20013f, -0.04663f, 0.74677f, -0.27332f, 0.52008f};
  const auto got = floats_of(kvcache::dequantize(*q, qt));
  for (size_t i = 0; i < expect.size(); ++i) EXPECT_NEAR(got[i], expect[i], 1e-5) << i;
  EXPECT_FLOAT_EQ(got[0], 5 * 0.11334228515625f - 0.5f);
  EXPECT_EQ(qt.nbytes(), 4 + 2 + 2);
}

// methods.md b.1: int2, g = 8.
TEST(IntQuantizerExact, Int2WorkedExample) {
  auto q = make_quantizer("int2:g8");
  QuantizedTensor qt = q->quantize(row(kWorked));
  const auto codes = quant::ref::unpack_codes(as_tensor(qt.codes), 2, 8, GroupAxis::kPerToken, {1, 1, 1, 8});
  EXPECT_EQ(bytes_of(codes), (std::vector<int>{1, 0, 1, 3, 1, 2, 0, 2}));
  // Golden packing: byte j = c[j] | c[j+2] << 2 | c[j+4] << 4 | c[j+6] << 6.
  EXPECT_EQ(bytes_of(as_tensor(qt.codes)), (std::vector<int>{0x15, 0xAC}));
  const std::vector<float> expect = {0.0667f, -0.5f, 0.0667f, 1.2f, 0.0667f, 0.6333f, -0.5f, 0.6333f};
  const auto got = floats_of(kvcache::dequantize(*q, qt));
  for (size_t i = 0; i < expect.size(); ++i) EXPECT_NEAR(got[i], expect[i], 1e-3) << i;
}

// int3, g = 8: z = −0.5, s = fp16 round-up(1.7 / 7) = 0.242919921875; codes rint((x − z) / s).
TEST(IntQuantizerExact, Int3WorkedExampleCodesAndTwoPlanePacking) {
  auto q = make_quantizer("int3:g8");
  QuantizedTensor qt = q->quantize(row(kWorked));
  const auto codes = quant::ref::unpack_codes(as_tensor(qt.codes), 3, 8, GroupAxis::kPerToken, {1, 1, 1, 8});
  EXPECT_EQ(bytes_of(codes), (std::vector<int>{2, 0, 3, 7, 2, 5, 1, 4}));
  // Golden packing (8 codes in 3 bytes): low plane byte 0 = c0 | c2 << 2 | c4 << 4 | c6 << 6
  // (the low two bits), byte 1 = c1 | c3 << 2 | c5 << 4 | c7 << 6, high plane bit m = c[m] >> 2.
  EXPECT_EQ(bytes_of(as_tensor(qt.codes)), (std::vector<int>{0x6E, 0x1C, 0xA8}));
  EXPECT_EQ(floats_of(as_tensor(qt.scales)), (std::vector<float>{0.242919921875f}));
  EXPECT_EQ(floats_of(as_tensor(qt.zeros)), (std::vector<float>{-0.5f}));
  const std::vector<float> expect = {-0.01416015625f, -0.5f,          0.228759765625f, 1.200439453125f,
                                     -0.01416015625f, 0.714599609375f, -0.257080078125f, 0.4716796875f};
  EXPECT_EQ(floats_of(kvcache::dequantize(*q, qt)), expect);
  EXPECT_EQ(qt.nbytes(), 3 + 2 + 2);
  EXPECT_EQ(q->bits_per_value(8), 3.0 + 32.0 / 8);
}

TEST(IntQuantizerExact, Int3GroupsAreMultiplesOfEight) {
  for (const char* bad : {"int3:g4", "int3:g12", "int3:g4:chan"}) {
    try {
      make_quantizer(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("multiple of 8")) << bad;
    }
  }
  // g = 0 (head_dim) needs head_dim a multiple of 8 too.
  EXPECT_THROW(make_quantizer("int3")->quantize(at::zeros({1, 1, 2, 12})), InvalidArgument);
  EXPECT_EQ(make_quantizer("int3")->quantize(at::zeros({1, 1, 2, 16})).codes.numel(), 2 * 6);
}

TEST(IntQuantizerExact, Int8WorkedExampleIsWithinHalfAStep) {
  // s = fp16(1.7 / 255) = 0.00666809082; (x + 0.5) / s = [89.98, 0, 122.97, 254.95, 67.49, ...].
  auto q = make_quantizer("int8:g8");
  QuantizedTensor qt = q->quantize(row(kWorked));
  EXPECT_EQ(bytes_of(as_tensor(qt.codes)), (std::vector<int>{90, 0, 123, 255, 67, 190, 28, 147}));
  const auto got = floats_of(kvcache::dequantize(*q, qt));
  const float s = floats_of(as_tensor(qt.scales))[0];
  for (size_t i = 0; i < kWorked.size(); ++i) EXPECT_LE(std::fabs(got[i] - kWorked[i]), s / 2 + 1e-6f) << i;
}

// methods.md b.2: KIVI per-channel key example, 2 channels × 4 tokens, b = 2.
TEST(IntQuantizerExact, PerChannelInt2HalfRoundsToEven) {
  auto q = make_quantizer("int2:g4:chan");
  EXPECT_EQ(q->group_axis(), GroupAxis::kPerChannel);
  at::Tensor k = at::tensor({1.0f, -3.0f, 2.0f, 9.0f, 0.5f, -1.0f, 1.5f, 5.0f}).reshape({1, 1, 4, 2});
  QuantizedTensor qt = q->quantize(k);
  EXPECT_EQ(as_tensor(qt.codes).sizes(), (std::vector<int64_t>{1, 1, 1, 2}));
  EXPECT_EQ(as_tensor(qt.scales).sizes(), (std::vector<int64_t>{1, 1, 1, 2}));
  EXPECT_EQ(floats_of(as_tensor(qt.scales)), (std::vector<float>{0.5f, 4.0f}));
  EXPECT_EQ(floats_of(as_tensor(qt.zeros)), (std::vector<float>{0.5f, -3.0f}));
  const auto codes = quant::ref::unpack_codes(as_tensor(qt.codes), 2, 4, GroupAxis::kPerChannel, {1, 1, 4, 2});
  // rows = tokens: channel 0 q [1, 3, 0, 2]; channel 1 (x-mn)/s = [0, 3, 0.5, 2] → [0, 3, 0, 2].
  EXPECT_EQ(bytes_of(codes), (std::vector<int>{1, 0, 3, 3, 0, 0, 2, 2}));
  // Golden packing: column d holds tokens 0..3 at bits 0,2,4,6: [1,3,0,2] → 0x8D (KIVI's word 141).
  EXPECT_EQ(bytes_of(as_tensor(qt.codes)), (std::vector<int>{0x8D, 0x8C}));
  EXPECT_EQ(floats_of(kvcache::dequantize(*q, qt)), (std::vector<float>{1.0f, -3.0f, 2.0f, 9.0f, 0.5f, -3.0f, 1.5f, 5.0f}));
}

TEST(IntQuantizerExact, PerChannelLayoutPairsTokenJWithJPlusHalfGroup) {
  // int4:g4:chan on 8 tokens × 1 channel with codes 0..15 known: tokens t, t+2 share a byte.
  at::Tensor k = at::tensor({0.0f, 15.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 15.0f}).reshape({1, 1, 8, 1});
  QuantizedTensor qt = make_quantizer("int4:g4:chan")->quantize(k);
  EXPECT_EQ(as_tensor(qt.codes).sizes(), (std::vector<int64_t>{1, 1, 4, 1}));
  // block 0: tokens 0..3 codes [0, 15, 1, 2]; block 1: min 3, s = 12/15 rounded UP to fp16
  // = 0.80029296875 (nearest would be 0.7998, and 3 + 15·0.7998 < 15 would leave the max
  // outside [z, z + 15·s]) → (x - 3)/s = [0, 1.2495, 2.4991, 14.9945] → [0, 1, 2, 15].
  // byte j = code(token j) | code(token j + 2) << 4.
  EXPECT_EQ(bytes_of(as_tensor(qt.codes)), (std::vector<int>{0x10, 0x2F, 0x20, 0xF1}));
  EXPECT_EQ(floats_of(as_tensor(qt.scales)), (std::vector<float>{1.0f, 0.80029296875f}));
}

TEST(IntQuantizerDegenerate, ConstantGroupIsExactOrWithinHalfItsStep) {
  for (const char* spec : {"int8", "int4", "int3", "int2", "int4:g4:chan", "int3:g8:chan"}) {
    auto q = make_quantizer(spec);
    // An fp16 value: z = x, s = 0, every code 0, x̂ = x exactly.
    at::Tensor x = at::full({1, 2, 8, 64}, 0.75f);
    QuantizedTensor qt = q->quantize(x);
    EXPECT_TRUE(at::equal(kvcache::dequantize(*q, qt), x)) << spec;
    EXPECT_TRUE(at::all(as_tensor(qt.codes) == 0).item<bool>()) << spec;
    EXPECT_TRUE(at::all(as_tensor(qt.scales).to(at::kFloat) == 0).item<bool>()) << spec;
    // 0.3 is not: z = 0.2998046875 (fp16 round-down), s = fp16 round-up of
    // (0.3 − z)/L > 0, and x̂ is within s/2 of 0.3 (closer than fp16(0.3) = 0.30005).
    at::Tensor x3 = at::full({1, 2, 8, 64}, 0.3f);
    QuantizedTensor q3 = q->quantize(x3);
    EXPECT_TRUE(at::all(as_tensor(q3.zeros).to(at::kFloat) == 0.2998046875f).item<bool>()) << spec;
    const float s = as_tensor(q3.scales).to(at::kFloat).max().item<float>();
    EXPECT_GT(s, 0.0f) << spec;
    const double err = reconstruction_error(x3, kvcache::dequantize(*q, q3)).max_abs;
    EXPECT_LE(err, s / 2 + 1e-7) << spec;
    EXPECT_LT(err, std::fabs(static_cast<float>(c10::Half(0.3f)) - 0.3f)) << spec;
  }
}

TEST(IntQuantizerDegenerate, TinyRangeGivesNoNaN) {
  for (const char* spec : {"int8:g8", "int4:g8", "int3:g8", "int2:g8"}) {
    auto q = make_quantizer(spec);
    at::Tensor x = row({0.0f, 1e-30f, 5e-31f, 0.0f, 1e-30f, 0.0f, 2e-31f, 1e-30f});
    at::Tensor y = kvcache::dequantize(*q, q->quantize(x));
    EXPECT_TRUE(at::isfinite(y).all().item<bool>()) << spec;
    EXPECT_LE(reconstruction_error(x, y).max_abs, 1.01e-30) << spec;
    at::Tensor x2 = row({1.0f, 1.0f + 1e-7f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f});
    at::Tensor y2 = kvcache::dequantize(*q, q->quantize(x2));
    EXPECT_TRUE(at::isfinite(y2).all().item<bool>()) << spec;
    EXPECT_LE(reconstruction_error(x2, y2).max_abs, 1e-6) << spec;
  }
}

TEST(IntQuantizerDegenerate, GroupNotDividingAxisNamesBothNumbers) {
  try {
    make_quantizer("int4:g48")->quantize(at::zeros({1, 2, 8, 64}));
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("D = 64"));
    EXPECT_THAT(e.what(), HasSubstr("g = 48"));
  }
  try {
    make_quantizer("int2:g32:chan")->quantize(at::zeros({1, 2, 30, 64}));
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("T = 30"));
    EXPECT_THAT(e.what(), HasSubstr("g = 32"));
  }
  // g = head_dim must still allow packing: an odd head_dim cannot hold nibble pairs.
  EXPECT_THROW(make_quantizer("int4")->quantize(at::zeros({1, 1, 2, 7})), InvalidArgument);
  EXPECT_NO_THROW(make_quantizer("int8")->quantize(at::zeros({1, 1, 2, 7})));
}

// Values beyond fp16's range: metadata is kept in fp32 for the whole tensor (documented
// in docs/quantizers.md), never Inf.
TEST(IntQuantizerDegenerate, BeyondFp16RangeKeepsMetadataInFp32) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor x = testing::randn_kv({1, 2, 16, 64}, 11) * 1e5;
    x = x.to(dtype);
    for (const char* spec : {"int8", "int4:g32", "int2:g16:chan"}) {
      auto q = make_quantizer(spec);
      QuantizedTensor qt = q->quantize(x);
      EXPECT_EQ(as_tensor(qt.scales).scalar_type(), at::kFloat) << spec;
      EXPECT_EQ(as_tensor(qt.zeros).scalar_type(), at::kFloat) << spec;
      EXPECT_TRUE(at::isfinite(as_tensor(qt.scales)).all().item<bool>());
      EXPECT_TRUE(at::isfinite(as_tensor(qt.zeros)).all().item<bool>());
      at::Tensor y = kvcache::dequantize(*q, qt);
      EXPECT_TRUE(at::isfinite(y).all().item<bool>()) << spec;
      // Real memory: codes + fp32 scale and zero per group.
      const int64_t groups = as_tensor(qt.scales).numel();
      EXPECT_EQ(qt.nbytes(), as_tensor(qt.codes).numel() + groups * 8);
      const double bound = std::string(spec).rfind("int8", 0) == 0 ? 0.02 : 0.8;
      EXPECT_LE(reconstruction_error(x, y).rel_fro, bound) << spec;
    }
  }
  // In range: fp16 metadata.
  EXPECT_EQ(make_quantizer("int4")->quantize(at::ones({1, 1, 1, 64}) * 6e4).scales.dtype(), kvcache::DType::kFloat16);
}

// A range past float32 (max − min > FLT_MAX) is quantized at 1/4 scale with fp32 metadata:
// finite, and within half a step of x (docs/quantizers.md).
TEST(IntQuantizerDegenerate, RangeBeyondFloat32IsQuantizedFinitely) {
  const float big = std::numeric_limits<float>::max();
  at::Tensor x = at::tensor({big, -big, 3e38f, -3e38f, 1.0f, 0.0f, 1e37f, -1e-45f}).reshape({1, 1, 1, 8});
  for (const char* spec : {"int8:g8", "int4:g8", "int3:g8", "int2:g8"}) {
    auto q = make_quantizer(spec);
    QuantizedTensor qt = q->quantize(x);
    ASSERT_EQ(as_tensor(qt.scales).scalar_type(), at::kFloat) << spec;
    const float s = as_tensor(qt.scales).item<float>();
    EXPECT_TRUE(std::isfinite(s)) << spec;
    EXPECT_EQ(as_tensor(qt.zeros).item<float>(), -big) << spec;
    at::Tensor y = kvcache::dequantize(*q, qt);
    EXPECT_TRUE(at::isfinite(y).all().item<bool>()) << spec;
    EXPECT_EQ(y[0][0][0][0].item<float>(), big) << spec;   // the top code reconstructs FLT_MAX, clamped
    EXPECT_EQ(y[0][0][0][1].item<float>(), -big) << spec;  // code 0 is z exactly
    EXPECT_LE((y.to(at::kDouble) - x.to(at::kDouble)).abs().max().item<double>(), s * (0.5 + 1e-5)) << spec;
  }
}

/// docs/quantizers.md's bound with the stored metadata: z ≤ x and
/// |x̂ − x| ≤ s/2 + 2^-21·(L·s + |x|) for every x (tests/quant_property_test.cpp covers
/// every spec and the adversarial value classes).
TEST(IntQuantizerBound, ElementwiseErrorWithinHalfStep) {
  for (const char* spec : {"int8:g32", "int4", "int2:g16", "int4:g16:chan", "int2:g32:chan"}) {
    auto q = make_quantizer(spec);
    at::Tensor x = testing::outlier_kv({1, 2, 64, 64}, 12);
    QuantizedTensor qt = q->quantize(x);
    at::Tensor y = kvcache::dequantize(*q, qt);
    // Broadcast per-group scale to every element.
    at::Tensor s = as_tensor(qt.scales).to(at::kFloat);
    at::Tensor z = as_tensor(qt.zeros).to(at::kFloat);
    at::Tensor sb, zb;
    if (q->group_axis() == GroupAxis::kPerToken) {
      const int64_t g = 64 / s.size(3);
      sb = s.repeat_interleave(g, 3);
      zb = z.repeat_interleave(g, 3);
    } else {
      const int64_t g = 64 / s.size(2);
      sb = s.repeat_interleave(g, 2);
      zb = z.repeat_interleave(g, 2);
    }
    const double levels = std::string(spec).rfind("int8", 0) == 0 ? 255 : spec[3] == '4' ? 15 : 3;
    EXPECT_TRUE(at::all(zb <= x).item<bool>()) << spec;
    const at::Tensor err = (y.to(at::kDouble) - x.to(at::kDouble)).abs();
    const at::Tensor bound = sb.to(at::kDouble) * 0.5 + (sb.to(at::kDouble) * levels + x.abs()) * std::ldexp(1.0, -21);
    EXPECT_TRUE(at::all(err <= bound).item<bool>()) << spec;
    // The bound is tight: some value sits within 5% of half a step.
    EXPECT_TRUE(at::any(err >= sb * 0.45).item<bool>()) << spec;
  }
}

// The kernels' directed fp16 rounding (simd.h) against an independent oracle: a binary
// search in the sorted list of every finite fp16 value, for every fp16 value, its float32
// neighbours, the midpoints between consecutive fp16 values (ties) and random floats.
TEST(IntQuantizerRounding, Fp16RoundDownAndUpAreExact) {
  std::vector<float> grid;  // every finite fp16 value, ascending (one zero)
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    if ((h & 0x7c00u) == 0x7c00u || h == 0x8000u) continue;
    grid.push_back(quant::fp16_to_float(static_cast<uint16_t>(h)));
  }
  std::sort(grid.begin(), grid.end());
  const float inf = std::numeric_limits<float>::infinity();
  auto check = [&](float f) {
    // round down: the largest fp16 ≤ f (−Inf below −65504; 65504 up to 65536, the documented range)
    auto it = std::upper_bound(grid.begin(), grid.end(), f);
    const float down = it == grid.begin() ? -inf : *(it - 1);
    if (f < 65536.0f) {
      const float got = quant::fp16_to_float(static_cast<uint16_t>(quant::fp16_bits_down(f)));
      ASSERT_EQ(got, down) << "round down of " << f;
    }
    if (f >= 0.0f) {
      auto lo = std::lower_bound(grid.begin(), grid.end(), f);
      const float up = lo == grid.end() ? inf : *lo;
      const float got = quant::fp16_to_float(static_cast<uint16_t>(quant::fp16_bits_up(f)));
      ASSERT_EQ(got, up) << "round up of " << f;
    }
  };
  for (size_t i = 0; i < grid.size(); ++i) {
    const float v = grid[i];
    check(v);
    check(std::nextafter(v, -inf));
    check(std::nextafter(v, inf));
    if (i + 1 < grid.size()) check(v + (grid[i + 1] - v) / 2);  // exact tie in float32
  }
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
  std::uniform_int_distribution<int> e(-40, 16);
  for (int i = 0; i < 200000; ++i) {
    check(u(gen));
    check(std::ldexp(u(gen) / 70000.0f, e(gen)));
  }
  for (float f : {0.0f, -0.0f, 1e-45f, -1e-45f, 1e-30f, -1e-30f, 65504.0f, 65519.0f, 65520.0f, 65535.0f, -65504.0f,
                  -65505.0f, -65520.0f, -1e6f}) {
    check(f);
  }
}

// ------------------------------------------------------------ fast path vs reference

struct ParityCase {
  int bits;
  int64_t g;
  GroupAxis axis;
};

class IntParity : public ::testing::TestWithParam<ParityCase> {};

void expect_parity(const ParityCase& c, const at::Tensor& x) {
  const std::string spec = "int" + std::to_string(c.bits) + ":g" + std::to_string(c.g) +
                           (c.axis == GroupAxis::kPerChannel ? ":chan" : "");
  auto q = make_quantizer(spec);
  QuantizedTensor qt = q->quantize(x);
  quant::ref::IntRefResult r = quant::ref::quantize_int(x, c.bits, c.g, c.axis);
  ASSERT_TRUE(at::equal(as_tensor(qt.codes), r.packed)) << spec << " codes differ";
  ASSERT_EQ(as_tensor(qt.scales).scalar_type(), r.scales.scalar_type()) << spec;
  ASSERT_TRUE(at::equal(as_tensor(qt.scales), r.scales)) << spec << " scales differ";
  ASSERT_TRUE(at::equal(as_tensor(qt.zeros), r.zeros)) << spec << " zeros differ";
  ASSERT_TRUE(at::equal(quant::ref::unpack_codes(as_tensor(qt.codes), c.bits, c.g, c.axis, x.sizes()), r.codes)) << spec;
  at::Tensor fast = kvcache::dequantize(*q, qt).to(at::kFloat);
  at::Tensor ref = quant::ref::to_dtype_saturating(quant::ref::dequantize_int(r.codes, r.scales, r.zeros, c.g, c.axis),
                                                   x.scalar_type())
                       .to(at::kFloat);
  ASSERT_TRUE(at::equal(fast, ref)) << spec << " dequantize differs; max diff "
                                    << (fast - ref).abs().max().item<float>();
}

// One test per (bits, g, axis): random normal, outlier-heavy (float32, bf16 and fp16 input),
// beyond fp16's range (fp32 metadata), and integer-valued data that hits exact .5 ties.
TEST_P(IntParity, FastPathMatchesReferenceBitExactly) {
  const ParityCase c = GetParam();
  {
    SCOPED_TRACE("random normal");
    expect_parity(c, testing::randn_kv({2, 3, 64, 128}, 21));
  }
  {
    SCOPED_TRACE("outlier-heavy");
    expect_parity(c, testing::outlier_kv({1, 2, 128, 64}, 22));
    expect_parity(c, testing::outlier_kv({1, 2, 128, 64}, 23).to(at::kBFloat16));
    expect_parity(c, testing::outlier_kv({1, 2, 128, 64}, 24).to(at::kHalf));
  }
  {
    SCOPED_TRACE("beyond fp16 range");
    expect_parity(c, testing::randn_kv({1, 2, 64, 64}, 25) * 3e5);
  }
  {
    SCOPED_TRACE("ties");
    auto gen = at::make_generator<at::CPUGeneratorImpl>(26);
    at::Tensor x = at::randint(-8, 9, {1, 2, 64, 64}, gen, at::TensorOptions().dtype(at::kFloat)) * 0.5;
    expect_parity(c, x);
  }
  {
    // Edges of the metadata rules: fp16 round-down/up at ±65504 (fp16 input, saturated on
    // the way back), fp32 metadata at 1/4 scale near FLT_MAX and bf16's max, denormals, and
    // offsets whose fp16 zero lies far below the minimum.
    SCOPED_TRACE("adversarial");
    auto gen = at::make_generator<at::CPUGeneratorImpl>(27);
    const at::Tensor n = at::randn({1, 2, 64, 64}, gen);
    const at::Tensor pick = at::rand({1, 2, 64, 64}, gen) < 0.2;
    const at::Tensor sign = at::where(at::rand({1, 2, 64, 64}, gen) < 0.5, -1.0, 1.0).to(at::kFloat);
    const float flt_max = std::numeric_limits<float>::max();
    expect_parity(c, at::where(pick, sign * 65504.0, n * 100.0).to(at::kHalf));
    expect_parity(c, at::where(pick, sign * flt_max, n));
    expect_parity(c, at::where(pick, at::full_like(n, flt_max), n.abs().clamp_max(3.0) * 1e38));
    expect_parity(c, at::where(pick, sign * 0x1.fep127f, n).to(at::kBFloat16));
    expect_parity(c, n * 1e-40);
    expect_parity(c, at::where(pick, n * 1e-40, n));
    expect_parity(c, 1000.3 + at::rand({1, 2, 64, 64}, gen) * 0.05);
    expect_parity(c, 1e6 + at::rand({1, 2, 64, 64}, gen) * 0.1);
    expect_parity(c, sign * at::pow(10.0, at::rand({1, 2, 64, 64}, gen) * 76.0 - 38.0));
  }
}

std::vector<ParityCase> parity_cases() {
  std::vector<ParityCase> v;
  for (int bits : {8, 4, 3, 2}) {
    for (int64_t g : {4, 8, 16, 32, 64}) {
      if (g % (bits == 3 ? 8 : 8 / bits) != 0) continue;  // int3 packs 8 codes in 3 bytes
      v.push_back({bits, g, GroupAxis::kPerToken});
      v.push_back({bits, g, GroupAxis::kPerChannel});
    }
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(AllWidths, IntParity, ::testing::ValuesIn(parity_cases()),
                         [](const ::testing::TestParamInfo<ParityCase>& p) {
                           return "int" + std::to_string(p.param.bits) + "_g" + std::to_string(p.param.g) +
                                  (p.param.axis == GroupAxis::kPerChannel ? "_chan" : "_tok");
                         });

TEST(IntPacking, PackUnpackRoundTrip) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(31);
  for (int bits : {8, 4, 3, 2}) {
    for (auto axis : {GroupAxis::kPerToken, GroupAxis::kPerChannel}) {
      at::Tensor codes = at::randint(0, 1 << bits, {2, 2, 32, 16}, gen, at::TensorOptions().dtype(at::kByte));
      at::Tensor packed = quant::ref::pack_codes(codes, bits, 8, axis);
      EXPECT_EQ(packed.numel() * 8, codes.numel() * bits);
      EXPECT_TRUE(at::equal(quant::ref::unpack_codes(packed, bits, 8, axis, codes.sizes()), codes));
    }
  }
}

TEST(IntQuantizerThreads, ThreadCountDoesNotChangeResults) {
  at::Tensor x = testing::outlier_kv({2, 4, 256, 64}, 51);
  const int before = at::get_num_threads();
  for (const char* spec : {"int8:g32", "int4", "int2:g16:chan", "fp8:e4m3", "fp16"}) {
    auto q = make_quantizer(spec);
    at::set_num_threads(1);
    QuantizedTensor one = q->quantize(x);
    at::Tensor y1 = kvcache::dequantize(*q, one);
    at::set_num_threads(2);
    QuantizedTensor two = q->quantize(x);
    EXPECT_TRUE(at::equal(as_tensor(one.codes), as_tensor(two.codes))) << spec;
    EXPECT_TRUE(at::equal(kvcache::dequantize(*q, two), y1)) << spec;
  }
  // NaN detection is per chunk: still found (and named) with several threads.
  x[1][3][200][7] = std::numeric_limits<float>::quiet_NaN();
  try {
    make_quantizer("int4:g32")->quantize(x);
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("[1, 3, 200, 7]"));
  }
  at::set_num_threads(before);
}

TEST(IntQuantizerFormat, MetadataShapes) {
  at::Tensor x = testing::randn_kv({2, 2, 64, 64}, 41);
  QuantizedTensor a = make_quantizer("int4:g32")->quantize(x);
  EXPECT_EQ(as_tensor(a.codes).sizes(), (std::vector<int64_t>{2, 2, 64, 32}));
  EXPECT_EQ(as_tensor(a.scales).sizes(), (std::vector<int64_t>{2, 2, 64, 2}));
  QuantizedTensor b = make_quantizer("int2:g32:chan")->quantize(x);
  EXPECT_EQ(as_tensor(b.codes).sizes(), (std::vector<int64_t>{2, 2, 16, 64}));
  EXPECT_EQ(as_tensor(b.zeros).sizes(), (std::vector<int64_t>{2, 2, 2, 64}));
  // Tampered metadata is rejected, not read out of bounds.
  a.scales = kvcache::Buffer(a.scales.dtype(), {2, 2, 64, 1});
  EXPECT_THROW(kvcache::dequantize(*make_quantizer("int4:g32"), a), InvalidArgument);
}

}  // namespace
}  // namespace kvcache
