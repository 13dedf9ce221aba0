// SPDX-License-Identifier: Apache-2.0
// The AVX-512 per-token quantize kernel (quant/int_kernels_avx512.h) against the portable
// kernel it stands in for (int_kernels.cpp, itself held bit for bit to the LibTorch-ops
// reference by quant_int_test): identical codes, fp16 scales and zeros, and status flags, for
// every (bits, g) it handles, chunk tails, and the edge values of the metadata arithmetic.
#include <gtest/gtest.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "quant/int_kernels.h"
#include "quant/int_kernels_avx512.h"

namespace {

using kvcache::quant::KernelStatus;
using kvcache::quant::MetaType;
namespace avx512 = kvcache::quant::avx512;

struct Out {
  std::vector<uint8_t> codes;
  std::vector<c10::Half> scales, zeros;
  KernelStatus status;
};

Out run(int bits, const std::vector<float>& x, int64_t g, bool fast) {
  const int64_t ngroups = static_cast<int64_t>(x.size()) / g;
  Out o;
  o.codes.assign(static_cast<size_t>(x.size() * bits / 8), 0xAB);
  o.scales.assign(static_cast<size_t>(ngroups), c10::Half(0.0f));
  o.zeros.assign(static_cast<size_t>(ngroups), c10::Half(0.0f));
  avx512::set_enabled(fast);
  o.status = kvcache::quant::quantize_per_token(bits, x.data(), ngroups, g, o.codes.data(), o.scales.data(),
                                                o.zeros.data(), MetaType::kHalf);
  avx512::set_enabled(true);
  return o;
}

void expect_same(int bits, const std::vector<float>& x, int64_t g, const char* what) {
  const Out a = run(bits, x, g, true), b = run(bits, x, g, false);
  SCOPED_TRACE(testing::Message() << what << ": int" << bits << " g" << g << ", " << x.size() / g << " groups");
  EXPECT_EQ(a.status.nonfinite, b.status.nonfinite);
  EXPECT_EQ(a.status.meta_overflow, b.status.meta_overflow);
  if (a.status.nonfinite || a.status.meta_overflow) return;  // the output is unusable then (int_kernels.h)
  ASSERT_EQ(a.codes.size(), b.codes.size());
  for (size_t i = 0; i < a.codes.size(); ++i) ASSERT_EQ(a.codes[i], b.codes[i]) << "code byte " << i;
  for (size_t i = 0; i < a.scales.size(); ++i) {
    ASSERT_EQ(a.scales[i].x, b.scales[i].x) << "scale of group " << i;
    // ±0 zeros are interchangeable (x̂ = code·s + z is the same); every other zero bit for bit.
    if ((a.zeros[i].x & 0x7fff) == 0 && (b.zeros[i].x & 0x7fff) == 0) continue;
    ASSERT_EQ(a.zeros[i].x, b.zeros[i].x) << "zero of group " << i;
  }
}

struct Case {
  int bits;
  int64_t g;
};
const Case kCases[] = {{8, 32}, {8, 64}, {8, 128}, {4, 32}, {4, 64}, {4, 128}, {2, 64}, {2, 128}};

class Avx512Quant : public testing::Test {
 protected:
  void SetUp() override {
    if (!avx512::available()) GTEST_SKIP() << "this CPU (or build) has no AVX-512 quantize kernel";
    at::set_num_threads(1);
  }
};

TEST(Avx512QuantHandles, ExactlyTheWholeVectorStreams) {
  for (const Case& c : kCases) EXPECT_TRUE(avx512::handles(c.bits, c.g)) << c.bits << " " << c.g;
  EXPECT_FALSE(avx512::handles(2, 32));  // code streams of 8 values
  EXPECT_FALSE(avx512::handles(8, 16));
  EXPECT_FALSE(avx512::handles(8, 256));
  EXPECT_FALSE(avx512::handles(3, 32));
}

TEST_F(Avx512Quant, RandomTensorsWithOutlierChannelsAndChunkTails) {
  std::mt19937 rng(7);
  std::normal_distribution<float> n01;
  for (const Case& c : kCases) {
    for (int64_t groups : {1, 3, 15, 16, 17, 40, 257}) {  // chunks of 16 groups: tails of every length
      std::vector<float> x(static_cast<size_t>(groups * c.g));
      for (size_t i = 0; i < x.size(); ++i) x[i] = (i % 16 == 3) ? 8.0f * n01(rng) + 4.0f : n01(rng);
      expect_same(c.bits, x, c.g, "random");
    }
  }
}

TEST_F(Avx512Quant, EdgeValuesOfTheMetadata) {
  // Groups chosen to reach each branch of the metadata rule: constant groups (s = 0, and an
  // fp16-exact or inexact constant), a range that underflows to s = 2^-24, fp16 subnormal
  // zeros, minima at ±65504 and just past, scales near 65504, ±0, huge values.
  const float edge[] = {0.0f,      -0.0f,     1.0f,       -1.0f,     1e-8f,      -1e-8f,    6e-8f,
                        3e-5f,     0.1f,      -0.1f,      65504.0f,  -65504.0f,  65519.0f,  65520.0f,
                        -65505.0f, 1e5f,      -1e5f,      1.0001f,   3.14159f,   1e-30f,    16777216.0f};
  std::mt19937 rng(11);
  std::uniform_int_distribution<size_t> pick(0, sizeof(edge) / sizeof(edge[0]) - 1);
  for (const Case& c : kCases) {
    std::vector<float> x;
    for (const float v : edge) x.insert(x.end(), static_cast<size_t>(c.g), v);  // constant groups
    for (int t = 0; t < 64; ++t) {                                                 // mixtures of two
      const float a = edge[pick(rng)], b = edge[pick(rng)];
      for (int64_t e = 0; e < c.g; ++e) x.push_back(e % 5 == 0 ? b : a + static_cast<float>(e) * 1e-7f * a);
    }
    // Every group alone too, so one overflowing group does not hide the others.
    expect_same(c.bits, x, c.g, "edge mix");
    for (size_t k = 0; k < x.size() / static_cast<size_t>(c.g); ++k) {
      const std::vector<float> one(x.begin() + static_cast<int64_t>(k) * c.g, x.begin() + static_cast<int64_t>(k + 1) * c.g);
      expect_same(c.bits, one, c.g, "edge group");
    }
  }
}

TEST_F(Avx512Quant, NonFiniteInputIsReportedAnywhereInTheGroup) {
  for (const Case& c : kCases) {
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()}) {
      for (int64_t at : {int64_t{0}, c.g / 2, c.g - 1, 17 * c.g + 5}) {
        std::vector<float> x(static_cast<size_t>(20 * c.g), 0.5f);
        x[static_cast<size_t>(at)] = bad;
        const Out a = run(c.bits, x, c.g, true);
        EXPECT_TRUE(a.status.nonfinite) << "int" << c.bits << " g" << c.g << " value " << bad << " at " << at;
        EXPECT_EQ(a.status.nonfinite, run(c.bits, x, c.g, false).status.nonfinite);
      }
    }
  }
}

TEST_F(Avx512Quant, HandWorkedInt8Group) {
  // g = 32, values 0..31 (so mn = 0, mx = 31): z = 0, s = fp16 round-up(31/255) =
  // 0.12158203125 (0x2FC8), codes = rint(v / s): v = 31 → 254.97… → 255, v = 1 → 8.22… → 8.
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[static_cast<size_t>(i)] = static_cast<float>(i);
  const Out a = run(8, x, 32, true);
  EXPECT_EQ(a.zeros[0].x, 0x0000);
  EXPECT_EQ(a.scales[0].x, 0x2FC8);
  EXPECT_EQ(a.codes[0], 0);
  EXPECT_EQ(a.codes[1], 8);
  EXPECT_EQ(a.codes[31], 255);
}

}  // namespace
