// SPDX-License-Identifier: Apache-2.0
// PolarQuant (arXiv 2502.02617; src/quant/polar_quantizer.h): the angle codebooks, bytes per
// token by hand, a golden vector, round trips, hostile values, seeds, the raw codec.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"
#include "quant/polar_quantizer.h"
#include "quant_test_util.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

std::vector<uint8_t> bytes_of(const Buffer& b) {
  const auto* p = static_cast<const uint8_t*>(b.data());
  return std::vector<uint8_t>(p, p + b.nbytes());
}

std::vector<float> floats_of(const at::Tensor& t) {
  at::Tensor c = t.contiguous().to(at::kFloat);
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

TEST(PolarCodebooks, LloydConditionsAndEmpiricalDistortion) {
  // Level 1: the uniform 16-level grid on (−π, π].
  const auto& l1 = quant::polar_codebook(1);
  ASSERT_EQ(l1.levels.size(), 16u);
  EXPECT_NEAR(l1.levels[0], -M_PI + M_PI / 16, 1e-12);
  EXPECT_NEAR(l1.mse, std::pow(2 * M_PI / 16, 2) / 12, 1e-12);
  // Levels 2–4: 4 levels on [0, π/2], symmetric about π/4, concentrating as n grows.
  double spread_before = 10;
  for (int level = 2; level <= 4; ++level) {
    const auto& cb = quant::polar_codebook(level);
    ASSERT_EQ(cb.levels.size(), 4u);
    EXPECT_NEAR(cb.levels[0] + cb.levels[3], M_PI / 2, 1e-6) << level;
    EXPECT_NEAR(cb.levels[1] + cb.levels[2], M_PI / 2, 1e-6) << level;
    EXPECT_NEAR(cb.thresholds[1], M_PI / 4, 1e-6) << level;
    EXPECT_LT(cb.levels[3] - cb.levels[0], spread_before) << level;
    spread_before = cb.levels[3] - cb.levels[0];
  }
  // The angles of Gaussian data follow the assumed densities: quantizing sampled angles gives
  // the codebooks' computed distortion (within 3 %).
  std::mt19937_64 rng(5);
  std::normal_distribution<double> n01;
  for (int level = 2; level <= 4; ++level) {
    const int n = 1 << (level - 1);
    const auto& cb = quant::polar_codebook(level);
    double se = 0;
    const int samples = 200000;
    for (int s = 0; s < samples; ++s) {
      double a = 0, b = 0;
      for (int i = 0; i < n; ++i) {
        const double u = n01(rng), v = n01(rng);
        a += u * u;
        b += v * v;
      }
      const double psi = std::atan2(std::sqrt(b), std::sqrt(a));
      const auto c = std::lower_bound(cb.thresholds.begin(), cb.thresholds.end(), psi) - cb.thresholds.begin();
      se += std::pow(psi - cb.levels[static_cast<size_t>(c)], 2);
    }
    EXPECT_NEAR(se / samples, cb.mse, 0.03 * cb.mse) << "level " << level;
  }
  EXPECT_THROW(quant::polar_codebook(5), InvalidArgument);
}

TEST(PolarLayout, BytesPerTokenByHand) {
  // D = 64: 4 blocks × 46 bits = 184 bits = 23 bytes + 4 fp16 radii = 31 bytes = 3.875 bits/value.
  auto q = make_quantizer("polar");
  const StoredLayout l = q->stored_layout(64);
  EXPECT_EQ(l.code_bytes, 23);
  EXPECT_EQ(l.meta_count, 4);
  EXPECT_FALSE(l.has_zeros);
  EXPECT_EQ(l.group_bytes(), 31);
  EXPECT_DOUBLE_EQ(q->bits_per_value(64), 3.875);
  EXPECT_DOUBLE_EQ(q->bits_per_value(128), 3.875);
  // D = 32: 92 bits round up to 12 bytes + 2 radii: 16 bytes = 4 bits/value.
  EXPECT_EQ(q->stored_layout(32).group_bytes(), 16);
  EXPECT_DOUBLE_EQ(q->bits_per_value(32), 4.0);
  EXPECT_EQ(q->quantize(testing::randn_kv({1, 2, 3, 64}, 1)).nbytes(), 6 * 31);
  EXPECT_THAT([&] { q->quantize(at::zeros({1, 1, 1, 8})); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("power of two >= 16 (blocks of 16 values")));
  EXPECT_THROW(q->stored_layout(48), InvalidArgument);
  EXPECT_EQ(make_quantizer("polar:seed42")->spec(), "polar");
  EXPECT_EQ(make_quantizer("polar:seed7")->spec(), "polar:seed7");
  EXPECT_THROW(make_quantizer("polar:b3"), InvalidArgument);
}

TEST(PolarValues, RoundTripsAndHostileValues) {
  auto q = make_quantizer("polar");
  // Gaussian rows at D = 128: the angles' distortion gives 0.1795 relative error (measured;
  // between tq:b3's 0.186 and tq:b4's 0.097 at 4.25 bits).
  const double e = reconstruction_error(*q, testing::randn_kv({1, 4, 128, 128}, 2)).rel_fro;
  EXPECT_GT(e, 0.05);
  EXPECT_LT(e, 0.25);
  // A row that is one block's e_0 after preconditioning decodes near itself: the norm is kept.
  at::Tensor z = at::zeros({1, 1, 2, 16});
  EXPECT_TRUE(at::equal(kvcache::dequantize(*q, q->quantize(z)), z));
  at::Tensor c = at::full({1, 1, 1, 32}, -2.5f);
  const std::vector<float> y = floats_of(kvcache::dequantize(*q, q->quantize(c)));
  for (float v : y) EXPECT_TRUE(std::isfinite(v));
  at::Tensor h = testing::randn_kv({1, 1, 2, 32}, 3);
  h[0][0][1][7] = std::numeric_limits<float>::max();
  const QuantizedTensor ht = q->quantize(h);
  EXPECT_EQ(ht.scales.dtype(), DType::kFloat32);
  const std::vector<float> hy = floats_of(kvcache::dequantize(*q, ht));
  for (float v : hy) EXPECT_TRUE(std::isfinite(v));
  EXPECT_GT(hy[32 + 7], 0.5f * std::numeric_limits<float>::max());
  at::Tensor big = at::full({1, 1, 1, 32}, 3.0e38f);
  EXPECT_THAT([&] { q->quantize(big); }, ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("row [b, h, t] = [0, 0, 0]")));
}

TEST(PolarCodec, SeedsAndEncodeMatchesQuantize) {
  at::Tensor x = testing::randn_kv({1, 1, 9, 64}, 4);
  auto q = make_quantizer("polar");
  const QuantizedTensor a = q->quantize(x);
  EXPECT_EQ(bytes_of(a.codes), bytes_of(make_quantizer("polar")->quantize(x).codes));
  EXPECT_NE(bytes_of(a.codes), bytes_of(make_quantizer("polar:seed1379")->quantize(x).codes));
  std::vector<uint8_t> codes(9 * 23);
  std::vector<uint16_t> radii(9 * 4);
  EXPECT_FALSE(q->encode(x.data_ptr<float>(), 9, 64, 1.0f, {codes.data(), radii.data(), nullptr}).overflow);
  EXPECT_EQ(codes, bytes_of(a.codes));
  std::vector<float> out(9 * 64);
  q->decode({codes.data(), radii.data(), nullptr}, 9, 64, 1.0f, out.data());
  EXPECT_EQ(out, floats_of(kvcache::dequantize(*q, a)));
  // Golden bytes of seed 42: x = 0..15 at D = 16.
  std::vector<float> ramp(16);
  for (int i = 0; i < 16; ++i) ramp[static_cast<size_t>(i)] = static_cast<float>(i);
  const QuantizedTensor g = q->quantize(at::tensor(ramp).reshape({1, 1, 1, 16}));
  EXPECT_EQ(bytes_of(g.codes), (std::vector<uint8_t>{0x95, 0x5d, 0x19, 0x95, 0x33, 0x17}));
}

}  // namespace
}  // namespace kvcache
