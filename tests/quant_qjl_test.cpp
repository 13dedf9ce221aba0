// SPDX-License-Identifier: Apache-2.0
// QJL keys (arXiv 2406.03482; src/quant/qjl_quantizer.h) and the `qjl` cache scheme: the
// orthogonalised sketch, bytes per token by hand, the estimator's constant settled by
// unbiasedness, outliers, hostile values, seeds, the raw codec against quantize(), the spec.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"
#include "quant/qjl_quantizer.h"
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

quant::QjlKeyQuantizer make(int64_t m, int64_t mo, int64_t o, int64_t g, int64_t seed = 42) {
  quant::QjlParams p;
  p.sketch = m;
  p.outlier_sketch = mo;
  p.outliers = o;
  p.group = g;
  p.seed = seed;
  return quant::QjlKeyQuantizer(p, "qjl test keys");
}

TEST(QjlSketch, BlocksOfDRowsAreOrthogonalWithRowNormSqrtD) {
  const int64_t d = 16, m = 40;  // two full blocks and a partial one of 8 rows
  const auto q = make(m, 8, 2, 1);
  const auto s = q.sketch(d);
  ASSERT_EQ(s->size(), static_cast<size_t>(m * d));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) dot += double((*s)[static_cast<size_t>(i * d + c)]) * (*s)[static_cast<size_t>(j * d + c)];
      if (i == j) {
        EXPECT_NEAR(dot, double(d), 1e-4) << i;
      } else if (i / d == j / d) {
        EXPECT_NEAR(dot, 0.0, 1e-4) << i << ", " << j;  // same block: orthogonal
      }
    }
  }
  // Rows of different blocks are independent, not orthogonal: some pair has a sizeable dot.
  double max_cross = 0;
  for (int64_t j = d; j < 2 * d; ++j) {
    double dot = 0;
    for (int64_t c = 0; c < d; ++c) dot += double((*s)[static_cast<size_t>(c)]) * (*s)[static_cast<size_t>(j * d + c)];
    max_cross = std::max(max_cross, std::abs(dot));
  }
  EXPECT_GT(max_cross, 1.0);
  EXPECT_EQ(*make(m, 8, 2, 1).sketch(d), *s);      // same seed, same sketch
  EXPECT_NE(*make(m, 8, 2, 1, 7).sketch(d), *s);   // another seed, another
}

TEST(QjlLayout, BytesPerTokenByHand) {
  // README settings at D = 128: m = 256, m_o = 64, o = 8, g = 32: codes 8 index bytes + 32 tokens
  // × (32 + 8) sign bytes = 1288, norms 64 fp16 = 128 bytes: 1416 bytes per 32 tokens, 44.25 per
  // token = 2.765625 bits per value.
  const auto readme = make(256, 64, 8, 32);
  const StoredLayout l = readme.stored_layout(128);
  EXPECT_EQ(l.group_tokens, 32);
  EXPECT_EQ(l.code_bytes, 1288);
  EXPECT_EQ(l.meta_count, 64);
  EXPECT_FALSE(l.has_zeros);
  EXPECT_EQ(l.group_bytes(), 1416);
  EXPECT_DOUBLE_EQ(readme.bits_per_value(128), 2.765625);
  // At D = 64 with m = 128, m_o = 32, o = 4: 4 + 32 × 20 = 644 + 128 = 772 bytes per 32 tokens.
  EXPECT_EQ(make(128, 32, 4, 32).stored_layout(64).group_bytes(), 772);
  const QuantizedTensor t = make(128, 32, 4, 32).quantize(testing::randn_kv({1, 2, 64, 64}, 3));
  EXPECT_EQ(t.codes.shape(), (std::vector<int64_t>{1, 2, 2, 644}));
  EXPECT_EQ(t.scales.shape(), (std::vector<int64_t>{1, 2, 2, 64}));
  EXPECT_EQ(t.nbytes(), 4 * 772);
}

// The estimator's constant, settled by unbiasedness. Over 3000 sketches (seeds), the mean of
// ⟨q, k̂⟩ with the reference's constant √(π/2)/m must be F_D·⟨q, k⟩ within 4 standard errors,
// F_D = √(π/2)·√D·Γ(D/2)/(√π·Γ((D+1)/2)) = 1 + 1/(4D) + O(D⁻²) (rows of fixed norm √D; 1.0079 at
// D = 32); the fork's √(π/2/D) scales every estimate by m/√D and is off by that factor.
TEST(QjlEstimator, ConstantSqrtPiOver2OverMIsUnbiased) {
  const int64_t d = 32, m = 64;
  at::Tensor k = testing::randn_kv({1, 1, 1, d}, 5);
  k[0][0][0][3] = 6.0f;  // an outlier channel, sketched apart
  at::Tensor q = 0.7 * k[0][0][0] + 0.7 * testing::randn_kv({1, 1, 1, d}, 6)[0][0][0];
  const double truth = at::dot(q, k[0][0][0]).item<double>();
  const double f = std::sqrt(M_PI / 2) * std::sqrt(double(d)) *
                   std::exp(std::lgamma(d / 2.0) - std::lgamma((d + 1) / 2.0)) / std::sqrt(M_PI);
  EXPECT_NEAR(f, 1.0 + 1.0 / (4 * d), 1e-3);
  for (const int64_t o : {int64_t{0}, int64_t{2}}) {
    double sum = 0, sum2 = 0;
    const int n = 3000;
    for (int s = 0; s < n; ++s) {
      const auto qz = make(m, o ? 16 : 0, o, 1, s);
      const double e = at::dot(q, kvcache::dequantize(qz, qz.quantize(k))[0][0][0]).item<double>();
      sum += e;
      sum2 += e * e;
    }
    const double mean = sum / n, se = std::sqrt((sum2 / n - mean * mean) / (n - 1));
    EXPECT_LT(std::abs(mean - f * truth), 4 * se) << "o = " << o << ": mean " << mean << " vs " << f * truth;
    EXPECT_LT(se, 0.03 * std::abs(truth)) << "o = " << o;
    // √(π/2/D) in place of √(π/2)/m multiplies every estimate by m/√D = 11.3.
    const double fork = mean * (std::sqrt(M_PI / 2 / d) / (std::sqrt(M_PI / 2) / m));
    EXPECT_GT(std::abs(fork - truth), 100 * se) << "o = " << o;
  }
}

TEST(QjlOutliers, TheLargestChannelsOfAGroupAreStoredAndKeptApart) {
  // Group of 4 tokens, D = 16, o = 2: channels 5 and 11 carry the energy.
  at::Tensor x = 0.1 * testing::randn_kv({1, 1, 4, 16}, 7);
  x.select(3, 5).fill_(8.0f);
  x.select(3, 11).fill_(-5.0f);
  const auto q = make(32, 16, 2, 4);
  const QuantizedTensor t = q.quantize(x);
  const auto b = bytes_of(t.codes);
  EXPECT_EQ(b[0], 5);
  EXPECT_EQ(b[1], 11);
  // ‖k_out‖ = √(64 + 25) per token, fp16.
  const at::Tensor norms = as_tensor(t.scales).to(at::kFloat).reshape({4, 2});
  for (int64_t i = 0; i < 4; ++i) EXPECT_NEAR(norms[i][1].item<float>(), std::sqrt(89.0f), 0.01f);
  // The outlier part reconstructs on the outlier channels only, the inlier part elsewhere.
  const std::vector<float> y = floats_of(kvcache::dequantize(q, t));
  double on = 0, off_big = 0;
  for (int64_t tkn = 0; tkn < 4; ++tkn) {
    on += std::abs(y[static_cast<size_t>(tkn * 16 + 5)]) + std::abs(y[static_cast<size_t>(tkn * 16 + 11)]);
    for (int64_t c = 0; c < 16; ++c) {
      if (c != 5 && c != 11) off_big = std::max(off_big, double(std::abs(y[static_cast<size_t>(tkn * 16 + c)])));
    }
  }
  EXPECT_GT(on / 8, 2.0);
  EXPECT_LT(off_big, 1.5);
}

TEST(QjlValues, HostileInputAndShapes) {
  const auto q = make(64, 16, 2, 4);
  at::Tensor z = at::zeros({1, 2, 8, 16});
  EXPECT_TRUE(at::equal(kvcache::dequantize(q, q.quantize(z)), z));
  at::Tensor c = at::full({1, 1, 4, 16}, 0.75f);
  for (float v : floats_of(kvcache::dequantize(q, q.quantize(c)))) EXPECT_TRUE(std::isfinite(v));
  at::Tensor h = testing::randn_kv({1, 1, 4, 16}, 8);
  h[0][0][2][3] = std::numeric_limits<float>::max();
  const QuantizedTensor ht = q.quantize(h);
  EXPECT_EQ(ht.scales.dtype(), DType::kFloat32);
  for (float v : floats_of(kvcache::dequantize(q, ht))) EXPECT_TRUE(std::isfinite(v));
  at::Tensor nan = testing::randn_kv({1, 1, 4, 16}, 9);
  nan[0][0][1][2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT([&] { q.quantize(nan); }, ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("NaN at [b, h, t, d] = [0, 0, 1, 2]")));
  EXPECT_THAT([&] { q.quantize(at::zeros({1, 1, 6, 16})); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("seq_len T = 6")));
  EXPECT_THAT([&] { q.quantize(at::zeros({1, 1, 4, 512})); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("[1, 256], got 512")));
  EXPECT_THAT([&] { make(64, 16, 16, 4).stored_layout(16); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("need head_dim D > o")));
  EXPECT_THROW(make(60, 16, 2, 4), InvalidArgument);   // m not a multiple of 8
  EXPECT_THROW(make(64, 128, 2, 4), InvalidArgument);  // mo > m
  EXPECT_THROW(make(64, 0, 2, 4), InvalidArgument);    // outliers need an outlier sketch
}

TEST(QjlCodec, SameSeedSameBytesAndEncodeMatchesQuantize) {
  at::Tensor x = testing::randn_kv({1, 1, 8, 32}, 10);
  const auto q = make(64, 16, 2, 4);
  const QuantizedTensor a = q.quantize(x), b = make(64, 16, 2, 4).quantize(x);
  EXPECT_EQ(bytes_of(a.codes), bytes_of(b.codes));
  EXPECT_NE(bytes_of(a.codes), bytes_of(make(64, 16, 2, 4, 1379).quantize(x).codes));
  const StoredLayout l = q.stored_layout(32);
  std::vector<uint8_t> codes(static_cast<size_t>(2 * l.code_bytes));
  std::vector<uint16_t> meta(static_cast<size_t>(2 * l.meta_count));
  EXPECT_FALSE(q.encode(x.data_ptr<float>(), 2, 32, 1.0f, {codes.data(), meta.data(), nullptr}).overflow);
  EXPECT_EQ(codes, bytes_of(a.codes));
  std::vector<float> out(static_cast<size_t>(8 * 32));
  q.decode({codes.data(), meta.data(), nullptr}, 2, 32, 1.0f, out.data());
  EXPECT_EQ(out, floats_of(kvcache::dequantize(q, a)));
}

TEST(QjlScheme, SpecAndStreams) {
  EXPECT_EQ(make_cache_scheme("qjl")->spec(), "qjl:m256:o8:g32:v2:r128");
  EXPECT_EQ(make_cache_scheme("qjl:mo32:m128:o4")->spec(), "qjl:m128:o4:g32:v2:r128:mo32");
  EXPECT_EQ(make_cache_scheme("qjl:m64:o0:mo0:g8:v4:r16:vg8:seed3")->spec(), "qjl:m64:o0:g8:v4:r16:mo0:vg8:seed3");
  EXPECT_THAT([] { make_cache_scheme("qjl:g32:r48"); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("window r=48 must be a positive multiple")));
  EXPECT_THROW(make_cache_scheme("qjl:m100"), InvalidArgument);
  EXPECT_THROW(make_cache_scheme("qjl:v5"), InvalidArgument);
  auto s = make_cache_scheme("qjl:m128:o4:g32:v2:r128:mo32");
  const CacheGeometry g{2, 2, 64};
  const LayerStreams l0 = s->streams(g, 0, 0), l1 = s->streams(g, 1, 128);
  EXPECT_EQ(l0.key.quantizer->stored_layout(64).group_tokens, 32);
  EXPECT_EQ(l0.key.flush, ResidualFlush::kBlock);
  EXPECT_EQ(l0.key.residual, 128);
  EXPECT_EQ(l0.value.quantizer->spec(), "int2:g32");
  EXPECT_EQ(l0.value.flush, ResidualFlush::kSliding);
  EXPECT_DOUBLE_EQ(l0.key.quantizer->bits_per_value(64), 772.0 * 8 / (32 * 64));
  EXPECT_NE(l0.key.quantizer->spec(), l1.key.quantizer->spec());  // layer 1: seed 42 + 1337
  EXPECT_THROW(s->streams(g, 0, 64), InvalidArgument);            // residual_length is the scheme's
  EXPECT_THROW(s->streams(CacheGeometry{1, 1, 48}, 0, 0), InvalidArgument);  // 48 % vg32
}

// The QJL README's setting at D = 128: m = 512 in the first 15 layers, 256 in the rest, written
// as a per-layer scheme. Each run's scheme sees the model's layer index, so layer l keeps the
// seed 42 + 1337·l it has in a whole-model `qjl` cache (a run-local index would reseed layer 15
// as layer 0).
TEST(QjlScheme, ReadmeFirstLayersAtM512ThroughLayers) {
  auto per_layer = make_cache_scheme("layers(qjl:m512:o8:g32:v2:r128*15;qjl:m256:o8:g32:v2:r128*9)");
  auto wide = make_cache_scheme("qjl:m512:o8:g32:v2:r128");
  auto narrow = make_cache_scheme("qjl:m256:o8:g32:v2:r128");
  const CacheGeometry g{24, 2, 128};
  for (int64_t layer : {0, 1, 14, 15, 23}) {
    const LayerStreams got = per_layer->streams(g, layer, 128);
    const LayerStreams want = (layer < 15 ? wide : narrow)->streams(g, layer, 128);
    EXPECT_EQ(got.key.quantizer->spec(), want.key.quantizer->spec()) << layer;
    EXPECT_EQ(got.value.quantizer->spec(), want.value.quantizer->spec()) << layer;
    EXPECT_EQ(got.key.residual, 128);
  }
  EXPECT_NE(per_layer->streams(g, 15, 128).key.quantizer->spec(), wide->streams(g, 0, 128).key.quantizer->spec());
  // m sign bits + the outlier sketch's 64 + two fp16 norms per token, the outlier indices per group:
  // 256 more sign bits per token at m = 512.
  const double b512 = per_layer->streams(g, 0, 128).key.quantizer->bits_per_value(128);
  const double b256 = per_layer->streams(g, 15, 128).key.quantizer->bits_per_value(128);
  EXPECT_DOUBLE_EQ(b512 - b256, 256.0 / 128);
}

}  // namespace
}  // namespace kvcache
