// SPDX-License-Identifier: Apache-2.0
// FP8 codec and quantizer: golden bytes, saturation, ties-to-even, vLLM worked numbers
// (methods.md b.7), and an exhaustive comparison against nearest-value search.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"
#include "quant/fp8.h"
#include "quant_test_util.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;
using quant::Fp8Format;

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

TEST(Fp8Golden, E4M3Bytes) {
  QuantizedTensor qt = make_quantizer("fp8:e4m3")->quantize(row({1.0f, 2.0f, 3.5f, 0.25f}));
  EXPECT_EQ(bytes_of(as_tensor(qt.codes)), (std::vector<int>{0x38, 0x40, 0x46, 0x28}));
  EXPECT_FALSE(as_tensor(qt.scales).defined());
  EXPECT_EQ(qt.nbytes(), 4);
}

TEST(Fp8Golden, E5M2Bytes) {
  QuantizedTensor qt = make_quantizer("fp8:e5m2")->quantize(row({1.0f, 2.0f, 3.5f, 0.25f}));
  EXPECT_EQ(bytes_of(as_tensor(qt.codes)), (std::vector<int>{0x3C, 0x40, 0x43, 0x34}));
}

TEST(Fp8Golden, NegativeZeroAndSubnormals) {
  using quant::fp8_encode;
  EXPECT_EQ(fp8_encode(-0.0f, Fp8Format::kE4M3), 0x80);
  EXPECT_EQ(fp8_encode(-1.0f, Fp8Format::kE4M3), 0xB8);
  EXPECT_EQ(fp8_encode(std::ldexp(1.0f, -9), Fp8Format::kE4M3), 0x01);   // min subnormal
  EXPECT_EQ(fp8_encode(std::ldexp(1.0f, -6), Fp8Format::kE4M3), 0x08);   // min normal
  EXPECT_EQ(fp8_encode(std::ldexp(1.0f, -16), Fp8Format::kE5M2), 0x01);
  EXPECT_EQ(fp8_encode(std::ldexp(1.0f, -14), Fp8Format::kE5M2), 0x04);
  EXPECT_EQ(fp8_encode(std::ldexp(1.0f, -11), Fp8Format::kE4M3), 0x00);  // below half the min subnormal
}

TEST(Fp8Saturation, E4M3ClampsTo448) {
  auto q = make_quantizer("fp8:e4m3");
  at::Tensor y = kvcache::dequantize(*q, q->quantize(row({449.0f, 1000.0f, -1000.0f, 1e6f})));
  EXPECT_EQ(floats_of(y), (std::vector<float>{448.0f, 448.0f, -448.0f, 448.0f}));
  EXPECT_EQ(quant::fp8_encode(464.0f, Fp8Format::kE4M3), 0x7E);  // would round to 480: saturate, not NaN
  EXPECT_EQ(quant::fp8_encode(3.0e38f, Fp8Format::kE4M3), 0x7E);
}

TEST(Fp8Saturation, E5M2ClampsTo57344) {
  auto q = make_quantizer("fp8:e5m2");
  at::Tensor y = kvcache::dequantize(*q, q->quantize(row({60000.0f, 1e6f, -1e9f, 57344.0f})));
  EXPECT_EQ(floats_of(y), (std::vector<float>{57344.0f, 57344.0f, -57344.0f, 57344.0f}));
  EXPECT_EQ(quant::fp8_encode(3.0e38f, Fp8Format::kE5M2), 0x7B);
}

TEST(Fp8Saturation, FiniteInputNeverGivesNaNOrInf) {
  at::Tensor x = testing::randn_kv({1, 2, 64, 64}, 3) * 1e30;
  for (const char* spec : {"fp8:e4m3", "fp8:e5m2", "fp8:e4m3:scaled", "fp8:e5m2:scaled"}) {
    auto q = make_quantizer(spec);
    EXPECT_TRUE(at::isfinite(kvcache::dequantize(*q, q->quantize(x))).all().item<bool>()) << spec;
  }
}

TEST(Fp8Rounding, TiesToEven) {
  using quant::fp8_decode;
  using quant::fp8_encode;
  auto rt = [](float v, Fp8Format f) { return fp8_decode(fp8_encode(v, f), f); };
  // e4m3 in [1, 2): step 1/8.
  EXPECT_EQ(rt(1.0625f, Fp8Format::kE4M3), 1.0f);    // tie → even mantissa 000
  EXPECT_EQ(rt(1.1875f, Fp8Format::kE4M3), 1.25f);   // tie → even mantissa 010
  EXPECT_EQ(rt(1.0626f, Fp8Format::kE4M3), 1.125f);
  // e5m2 in [1, 2): step 1/4.
  EXPECT_EQ(rt(1.125f, Fp8Format::kE5M2), 1.0f);
  EXPECT_EQ(rt(1.375f, Fp8Format::kE5M2), 1.5f);
  // Subnormal ties (e4m3 step 2^-9).
  EXPECT_EQ(rt(std::ldexp(0.5f, -9), Fp8Format::kE4M3), 0.0f);
  EXPECT_EQ(rt(std::ldexp(1.5f, -9), Fp8Format::kE4M3), std::ldexp(2.0f, -9));
  EXPECT_EQ(rt(std::ldexp(2.5f, -9), Fp8Format::kE4M3), std::ldexp(2.0f, -9));
  // Tie between the largest subnormal (7·2^-9) and the min normal (8·2^-9) → even (normal).
  EXPECT_EQ(rt(std::ldexp(7.5f, -9), Fp8Format::kE4M3), std::ldexp(1.0f, -6));
}

// methods.md b.7: vLLM worked example, amax |K| = 12 → k_scale 0.06 (x/s computed in float).
TEST(Fp8WorkedVllm, ScaledValues) {
  using quant::fp8_decode;
  using quant::fp8_encode;
  const float s = 0.06f;
  auto rt = [&](float x, Fp8Format f) { return fp8_decode(fp8_encode(x / s, f), f); };
  EXPECT_EQ(rt(0.318f, Fp8Format::kE4M3), 5.5f);
  EXPECT_EQ(rt(0.318f, Fp8Format::kE5M2), 5.0f);
  EXPECT_EQ(rt(1.1f, Fp8Format::kE4M3), 18.0f);
  EXPECT_EQ(rt(1.1f, Fp8Format::kE5M2), 20.0f);
  EXPECT_EQ(rt(11.9f, Fp8Format::kE4M3), 192.0f);
  EXPECT_EQ(rt(11.9f, Fp8Format::kE5M2), 192.0f);
  EXPECT_NEAR(rt(0.318f, Fp8Format::kE4M3) * s, 0.330, 1e-6);
  EXPECT_NEAR(rt(1.1f, Fp8Format::kE5M2) * s, 1.20, 1e-6);
  EXPECT_NEAR(rt(11.9f, Fp8Format::kE4M3) * s, 11.52, 1e-5);
}

TEST(Fp8Scaled, PerTensorScaleIsAmaxOver448) {
  auto q = make_quantizer("fp8:e4m3:scaled");
  at::Tensor x = row({0.318f, 1.1f, 11.9f, -12.0f});
  QuantizedTensor qt = q->quantize(x);
  ASSERT_TRUE(as_tensor(qt.scales).defined());
  EXPECT_EQ(as_tensor(qt.scales).scalar_type(), at::kFloat);
  EXPECT_EQ(as_tensor(qt.scales).numel(), 1);
  EXPECT_EQ(as_tensor(qt.scales).item<float>(), 12.0f / 448.0f);
  EXPECT_EQ(qt.nbytes(), 4 + 4);
  at::Tensor y = kvcache::dequantize(*q, qt);
  EXPECT_EQ(bytes_of(as_tensor(qt.codes))[3], 0xFE);  // -amax → -448
  EXPECT_NEAR(floats_of(y)[3], -12.0f, 1e-5);
  EXPECT_LE(reconstruction_error(x, y).rel_fro, 0.0625);
  // e5m2: amax / 57344.
  EXPECT_EQ(as_tensor(make_quantizer("fp8:e5m2:scaled")->quantize(x).scales).item<float>(), 12.0f / 57344.0f);
}

TEST(Fp8Scaled, ScalingHelpsSmallValues) {
  at::Tensor x = testing::randn_kv({1, 2, 32, 64}, 4) * 1e-4;  // mostly below e4m3's normal range
  const double unscaled = reconstruction_error(*make_quantizer("fp8:e4m3"), x).rel_fro;
  const double scaled = reconstruction_error(*make_quantizer("fp8:e4m3:scaled"), x).rel_fro;
  EXPECT_GT(unscaled, 0.5);
  EXPECT_LT(scaled, 0.05);
}

TEST(Fp8Format, DecodingAsOtherFormatIsAnError) {
  at::Tensor x = row({1.0f, 2.0f, 3.5f, 0.25f});
  QuantizedTensor qt = make_quantizer("fp8:e4m3")->quantize(x);
  EXPECT_EQ(qt.format, "fp8:e4m3");
  try {
    kvcache::dequantize(*make_quantizer("fp8:e5m2"), qt);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("q.format is 'fp8:e4m3', expected 'fp8:e5m2'"));
  }
  EXPECT_THROW(kvcache::dequantize(*make_quantizer("fp8:e4m3:scaled"), qt), InvalidArgument);
}

/// Nearest representable value by exhaustive search, ties to the even code, saturating.
uint8_t nearest_code(float x, Fp8Format f) {
  const float maxv = quant::fp8_max(f);
  const float ax = std::min(std::fabs(x), maxv);
  int best = -1;
  double best_err = 0;
  for (int c = 0; c < 128; ++c) {
    const float v = quant::fp8_decode(static_cast<uint8_t>(c), f);
    if (!std::isfinite(v)) continue;
    const double err = std::fabs(static_cast<double>(v) - ax);
    if (best < 0 || err < best_err || (err == best_err && (c % 2 == 0))) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

// The array decoder (block decode, dequantize) computes each value instead of looking it up:
// it must give the table's value (fp8_decode, built from the format's definition) for every
// code, bit for bit (−0 and subnormals included), times the scale; NaN codes a NaN of the
// code's sign. Decoded as one array of all 256 codes and unaligned, so the vector body and
// the scalar tail both run.
TEST(Fp8Exhaustive, ComputedDecodeEqualsTheTableForEveryCode) {
  std::vector<uint8_t> codes(1 + 256);
  for (int c = 0; c < 256; ++c) codes[static_cast<size_t>(1 + c)] = static_cast<uint8_t>(c);
  for (auto f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (float scale : {1.0f, 0.37109375f, 3.0e-3f}) {
      std::vector<float> out(256, 12345.0f);
      quant::fp8_decode_array(codes.data() + 1, 256, scale, f, out.data());
      for (int c = 0; c < 256; ++c) {
        const float want = quant::fp8_decode(static_cast<uint8_t>(c), f) * scale;
        const float got = out[static_cast<size_t>(c)];
        const std::string where = std::string(quant::fp8_name(f)) + " code " + std::to_string(c) + " scale " +
                                  std::to_string(scale);
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(got)) << where;
          EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << where;
          continue;
        }
        uint32_t a, b;
        std::memcpy(&a, &got, 4);
        std::memcpy(&b, &want, 4);
        EXPECT_EQ(a, b) << where << ": got " << got << ", table " << want;
      }
    }
  }
}

TEST(Fp8Exhaustive, EncoderMatchesNearestValueSearch) {
  for (auto f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    // Every code round-trips; every midpoint between neighbours and random values agree
    // with the search.
    for (int c = 0; c < 256; ++c) {
      const float v = quant::fp8_decode(static_cast<uint8_t>(c), f);
      if (!std::isfinite(v)) continue;
      EXPECT_EQ(quant::fp8_encode(v, f), c) << quant::fp8_name(f) << " code " << c;
      const float next = quant::fp8_decode(static_cast<uint8_t>(c + 1), f);
      if ((c & 0x7f) < 0x7f && std::isfinite(next)) {
        const float mid = (v + next) / 2;
        EXPECT_EQ(quant::fp8_encode(mid, f), nearest_code(mid, f)) << quant::fp8_name(f) << " mid " << mid;
      }
    }
    at::Tensor r = testing::randn_kv({1, 1, 64, 256}, 5) * at::exp(testing::randn_kv({1, 1, 64, 256}, 6) * 6);
    std::vector<float> vals = floats_of(r);
    std::vector<uint8_t> fast(vals.size());
    ASSERT_FALSE(quant::fp8_encode_array(vals.data(), static_cast<int64_t>(vals.size()), 1.0f, f, fast.data()));
    for (size_t i = 0; i < vals.size(); ++i) {
      ASSERT_EQ(fast[i], nearest_code(vals[i], f)) << quant::fp8_name(f) << " x = " << vals[i];
    }
  }
}

// Both array encoders (the hand-written AVX-512 one, where this CPU has it, and the
// auto-vectorized twin) give fp8_encode()'s code for every input, bit for bit: every exponent
// with mantissas at and around each format's rounding ties (the round bit alone, with a sticky
// bit, on odd and even kept mantissas), the subnormal range, saturation, both signs, scaled and
// unscaled; the array is unaligned and its length leaves a scalar tail. A non-finite value in
// the vector body or in the tail is reported by both.
TEST(Fp8Exhaustive, Avx512EncoderEqualsTheScalarOne) {
  std::vector<uint32_t> mantissas = {0u, 1u, 0x7fffffu, 0x400000u, 0x200000u, 0x100000u, 0x080000u, 0x040000u};
  for (int man : {2, 3}) {
    const uint32_t half = 1u << (22 - man);  // the round bit
    for (uint32_t kept : {0u, 1u, 2u, 3u, 5u, 6u, 7u}) {
      const uint32_t base = (kept & ((1u << man) - 1u)) << (23 - man);
      for (uint32_t m : {base | half, base | half | 1u, base | (half - 1u), base | half | (half - 1u)}) mantissas.push_back(m);
    }
  }
  std::vector<float> vals(1);  // vals[0] unused: the arrays start one float past alignment
  for (uint32_t e = 0; e < 255; ++e) {
    for (uint32_t m : mantissas) {
      for (uint32_t sign : {0u, 0x80000000u}) {
        const uint32_t bits = sign | (e << 23) | m;
        float v;
        std::memcpy(&v, &bits, 4);
        vals.push_back(v);
      }
    }
  }
  for (int i = 0; i < 1000; ++i) vals.push_back(static_cast<float>(i - 500) * 0.0371f);
  ASSERT_NE((vals.size() - 1) % 64, 0u) << "the length must leave a scalar tail";
  const int64_t n = static_cast<int64_t>(vals.size()) - 1;
  const float* x = vals.data() + 1;
  for (auto f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (float scale : {1.0f, 0.37109375f, 3.0e5f}) {
      std::vector<uint8_t> best(static_cast<size_t>(n) + 1, 0xAA), generic(static_cast<size_t>(n), 0x55);
      ASSERT_FALSE(quant::fp8_encode_array(x, n, scale, f, best.data() + 1, quant::Fp8Encoder::kBest));
      ASSERT_FALSE(quant::fp8_encode_array(x, n, scale, f, generic.data(), quant::Fp8Encoder::kGeneric));
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t want = quant::fp8_encode(scale == 1.0f ? x[i] : x[i] / scale, f);
        ASSERT_EQ(best[static_cast<size_t>(i) + 1], want) << quant::fp8_name(f) << " x = " << x[i] << " scale " << scale;
        ASSERT_EQ(generic[static_cast<size_t>(i)], want) << quant::fp8_name(f) << " x = " << x[i] << " scale " << scale;
      }
    }
    const int64_t tail_at = n - 1, body_at = 70;
    for (int64_t at_i : {body_at, tail_at}) {
      for (float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
        std::vector<float> y(vals.begin() + 1, vals.end());
        y[static_cast<size_t>(at_i)] = bad;
        std::vector<uint8_t> out(static_cast<size_t>(n));
        EXPECT_TRUE(quant::fp8_encode_array(y.data(), n, 1.0f, f, out.data(), quant::Fp8Encoder::kBest)) << at_i;
        EXPECT_TRUE(quant::fp8_encode_array(y.data(), n, 1.0f, f, out.data(), quant::Fp8Encoder::kGeneric)) << at_i;
      }
    }
  }
  std::printf("[ fp8 encoder ] the best array encoder here is %s\n",
              quant::fp8_avx512_kernels() ? "the AVX-512 one" : "the auto-vectorized one");
}

// The scaled AVX-512 encoder (vdivps per 16 values) against the scalar division. A quotient one
// float32 ulp off changes a code only next to an fp8 rounding midpoint, so the values are built
// there: for every code c, x = RN(mid(c, c+1) * scale) and its four neighbours on each side, both
// signs; then a binade of float32 mantissas, random values, zeros, subnormals, tiny and huge
// values, under thirteen scales; then 16 Mi codes (several parallel_for ranges) written from an
// address one byte past a 64-byte boundary, checked against the generic encoder.
TEST(Fp8Exhaustive, ScaledAvx512EncoderEqualsTheDivision) {
  const float tiny = std::numeric_limits<float>::denorm_min();
  const std::vector<float> scales = {0.37109375f,     3.0e5f,          1.7f / 448.0f, 0x1.fffffep-10f, 0x1.000002p-3f,
                                     0x1p-64f,        0x1.fffffep-65f, 0x1p64f,       0x1.000002p64f,  1e-40f,
                                     0x1.234568p-30f, 5.0e-8f,         12345.678f};
  for (auto f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (float scale : scales) {
      std::vector<float> vals;
      for (int c = 0; c < 0x7F; ++c) {
        const float lo = quant::fp8_decode(static_cast<uint8_t>(c), f);
        const float hi = quant::fp8_decode(static_cast<uint8_t>(c + 1), f);
        if (!std::isfinite(hi)) break;
        float x = 0.5f * (lo + hi) * scale;
        for (int k = 0; k < 4; ++k) x = std::nextafter(x, 0.0f);
        for (int k = 0; k < 9; ++k, x = std::nextafter(x, std::numeric_limits<float>::infinity())) {
          vals.push_back(x);
          vals.push_back(-x);
        }
      }
      for (uint32_t m = 0; m < (1u << 23); m += 61) {  // one binade, mantissas 61 apart
        const uint32_t bits = (130u << 23) | m;
        float v;
        std::memcpy(&v, &bits, 4);
        vals.push_back(v * scale);
      }
      for (float v : {0.0f, -0.0f, tiny, -tiny, 1e-39f, -3e-25f, 0x1p-64f, 0x1p-65f, 0x1p126f, -0x1.fffffep127f,
                      1e30f, 2.5f}) {
        vals.push_back(v);
      }
      uint64_t s = 0x9E3779B97F4A7C15ull;
      for (int i = 0; i < 20000; ++i) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        uint32_t bits = static_cast<uint32_t>(s) & 0xBFFFFFFFu;  // exponents below 128: finite
        float v;
        std::memcpy(&v, &bits, 4);
        vals.push_back(v);
      }
      const int64_t n = static_cast<int64_t>(vals.size());
      std::vector<uint8_t> best(static_cast<size_t>(n));
      ASSERT_FALSE(quant::fp8_encode_array(vals.data(), n, scale, f, best.data(), quant::Fp8Encoder::kBest));
      for (int64_t i = 0; i < n; ++i) {
        const float x = vals[static_cast<size_t>(i)];
        ASSERT_EQ(best[static_cast<size_t>(i)], quant::fp8_encode(x / scale, f))
            << quant::fp8_name(f) << " x = " << std::hexfloat << x << " scale " << scale;
      }
    }
  }
  // 16 Mi codes, from an output one byte past a 64-byte boundary.
  const int64_t n = int64_t{16} << 20;
  std::vector<float> x(static_cast<size_t>(n));
  uint64_t s = 12345;
  for (auto& v : x) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    v = static_cast<float>(static_cast<int64_t>(s % 2000001) - 1000000) * 1e-4f;
  }
  for (float scale : {1.0f, 100.0f / 448.0f}) {
    std::vector<uint8_t> best(static_cast<size_t>(n) + 65), generic(static_cast<size_t>(n));
    uint8_t* out = best.data() + (64 - reinterpret_cast<uintptr_t>(best.data()) % 64) % 64 + 1;
    ASSERT_FALSE(quant::fp8_encode_array(x.data(), n, scale, Fp8Format::kE4M3, out, quant::Fp8Encoder::kBest));
    ASSERT_FALSE(
        quant::fp8_encode_array(x.data(), n, scale, Fp8Format::kE4M3, generic.data(), quant::Fp8Encoder::kGeneric));
    ASSERT_EQ(std::memcmp(out, generic.data(), static_cast<size_t>(n)), 0) << "scale " << scale;
  }
}

// fp8_amax (the per-tensor scale's amax; AVX-512: the unsigned max of |x|'s bits) against a
// plain loop: every length 0..200 (whole 64-value steps, 16-value steps and a masked tail), the
// maximum at every position, negative and subnormal maxima, and a NaN/±Inf at every position
// giving +Inf.
TEST(Fp8Amax, EqualsThePlainMaximumForEveryLengthAndPosition) {
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t n = 0; n <= 200; ++n) {
    std::vector<float> x(static_cast<size_t>(n) + 1);
    for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i) + 1] = std::sin(static_cast<float>(i)) * 0.5f;
    const float* p = x.data() + 1;  // one float past the vector's alignment
    float want = 0.0f;
    for (int64_t i = 0; i < n; ++i) want = std::max(want, std::fabs(p[i]));
    ASSERT_EQ(quant::fp8_amax(p, n), want) << "n " << n;
    for (int64_t at_i = 0; at_i < n; ++at_i) {
      std::vector<float> y(x);
      for (float big : {-7.25f, 3.5f}) {
        y[static_cast<size_t>(at_i) + 1] = big;
        ASSERT_EQ(quant::fp8_amax(y.data() + 1, n), std::fabs(big)) << "n " << n << " at " << at_i;
      }
      for (float bad : {std::numeric_limits<float>::quiet_NaN(), -inf, inf}) {
        y[static_cast<size_t>(at_i) + 1] = bad;
        ASSERT_EQ(quant::fp8_amax(y.data() + 1, n), inf) << "n " << n << " at " << at_i << " value " << bad;
      }
    }
  }
  const float sub = std::numeric_limits<float>::denorm_min() * 3.0f;
  std::vector<float> z(100, 0.0f);
  z[77] = -sub;
  EXPECT_EQ(quant::fp8_amax(z.data(), 100), sub);
  z[5] = -0.0f;
  EXPECT_EQ(quant::fp8_amax(z.data(), 100), sub);
}

}  // namespace
}  // namespace kvcache
