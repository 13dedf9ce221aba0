// SPDX-License-Identifier: Apache-2.0
// TurboQuant (arXiv 2504.19874; src/quant/turboquant_quantizer.h): the Lloyd–Max codebooks
// against the closed-form distortions, the randomized Hadamard rotation, bytes per token by hand,
// a seed-independent golden vector, round-trip error per bit width, hostile values, the spec
// grammar, seeds, the raw codec against quantize(), and Prod's unbiased inner products.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"
#include "quant/hadamard.h"
#include "quant/lloyd_max.h"
#include "quant/turboquant_quantizer.h"
#include "quant_test_util.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

at::Tensor row(std::vector<float> v) {
  const auto n = static_cast<int64_t>(v.size());
  return at::tensor(v).reshape({1, 1, 1, n});
}

std::vector<float> floats_of(const at::Tensor& t) {
  at::Tensor c = t.contiguous().to(at::kFloat);
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

std::vector<uint8_t> bytes_of(const Buffer& b) {
  const auto* p = static_cast<const uint8_t*>(b.data());
  return std::vector<uint8_t>(p, p + b.nbytes());
}

const quant::TurboQuantizer& as_tq(const Quantizer& q) { return dynamic_cast<const quant::TurboQuantizer&>(q); }

// ------------------------------------------------------------------ codebook
TEST(LloydMaxGaussian, DistortionMatchesTheClassicalValues) {
  // Max (1960) / Lloyd (1982): MSE per coordinate of a unit-variance Gaussian.
  const double expected[] = {0.3634, 0.1175, 0.03454, 0.009497};
  for (int b = 1; b <= 4; ++b) {
    const quant::GaussianCodebook& cb = quant::gaussian_lloyd_max(b);
    ASSERT_EQ(cb.levels.size(), size_t{1} << b);
    ASSERT_EQ(cb.boundaries.size(), (size_t{1} << b) - 1);
    EXPECT_NEAR(cb.mse, expected[b - 1], 1e-3 * expected[b - 1] + 1e-6) << "b = " << b;
    for (size_t i = 0; i < cb.levels.size(); ++i) {
      EXPECT_NEAR(cb.levels[i], -cb.levels[cb.levels.size() - 1 - i], 1e-12) << "symmetric, b = " << b;
      if (i > 0) {
        EXPECT_LT(cb.levels[i - 1], cb.levels[i]);
      }
    }
    for (size_t i = 0; i < cb.boundaries.size(); ++i) {
      EXPECT_DOUBLE_EQ(cb.boundaries[i], 0.5 * (cb.levels[i] + cb.levels[i + 1]));
    }
  }
  // b = 1 in closed form: levels ±√(2/π), MSE 1 − 2/π.
  EXPECT_NEAR(quant::gaussian_lloyd_max(1).levels[1], std::sqrt(2.0 / M_PI), 1e-12);
  EXPECT_NEAR(quant::gaussian_lloyd_max(1).mse, 1.0 - 2.0 / M_PI, 1e-12);
  // b = 2: the classical levels ±0.4528, ±1.510.
  EXPECT_NEAR(quant::gaussian_lloyd_max(2).levels[2], 0.4528, 1e-4);
  EXPECT_NEAR(quant::gaussian_lloyd_max(2).levels[3], 1.5104, 1e-4);
  EXPECT_THROW(quant::gaussian_lloyd_max(0), InvalidArgument);
  EXPECT_THROW(quant::gaussian_lloyd_max(9), InvalidArgument);
}

TEST(LloydMaxGaussian, EmpiricalDistortionOfSamplesAgrees) {
  std::mt19937_64 rng(3);
  std::normal_distribution<double> n01;
  for (int b = 1; b <= 4; ++b) {
    const quant::GaussianCodebook& cb = quant::gaussian_lloyd_max(b);
    double se = 0;
    const int n = 200000;
    for (int i = 0; i < n; ++i) {
      const double v = n01(rng);
      const auto k = std::lower_bound(cb.boundaries.begin(), cb.boundaries.end(), v) - cb.boundaries.begin();
      se += (v - cb.levels[static_cast<size_t>(k)]) * (v - cb.levels[static_cast<size_t>(k)]);
    }
    EXPECT_NEAR(se / n, cb.mse, 0.03 * cb.mse) << "b = " << b;
  }
}

// ------------------------------------------------------------------ rotation
TEST(TurboQuantRotation, OrthonormalAndInvertible) {
  const auto q = make_quantizer("tq:b4");
  const int64_t d = 64;
  const auto tab = as_tq(*q).tables(d);
  ASSERT_EQ(tab->signs.size(), static_cast<size_t>(d));
  int negative = 0;
  for (float s : tab->signs) {
    EXPECT_TRUE(s == 1.0f || s == -1.0f);
    negative += s < 0;
  }
  EXPECT_GT(negative, 16);  // seeded signs, not all one way
  EXPECT_LT(negative, 48);
  // Columns of R = H_D · diag(s): R e_j.
  std::vector<float> r(static_cast<size_t>(d * d), 0.0f);
  for (int64_t j = 0; j < d; ++j) r[static_cast<size_t>(j * d + j)] = tab->signs[static_cast<size_t>(j)];
  quant::hadamard_rows(r.data(), d, d);  // row j of r is now R e_j
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < d; ++k) dot += double(r[static_cast<size_t>(i * d + k)]) * r[static_cast<size_t>(j * d + k)];
      EXPECT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-6) << i << ", " << j;
    }
  }
  // The inverse diag(s) · H_D undoes it.
  std::vector<float> x(static_cast<size_t>(d)), y;
  for (int64_t i = 0; i < d; ++i) x[static_cast<size_t>(i)] = std::sin(0.7f * static_cast<float>(i)) + 0.1f * static_cast<float>(i);
  y = x;
  for (int64_t i = 0; i < d; ++i) y[static_cast<size_t>(i)] *= tab->signs[static_cast<size_t>(i)];
  quant::hadamard_rows(y.data(), 1, d);
  quant::hadamard_rows(y.data(), 1, d);
  for (int64_t i = 0; i < d; ++i) EXPECT_NEAR(y[static_cast<size_t>(i)] * tab->signs[static_cast<size_t>(i)], x[static_cast<size_t>(i)], 1e-5);
}

// ------------------------------------------------------------------ layout and bytes
TEST(TurboQuantLayout, BytesPerTokenByHand) {
  // tq:b4 at D = 64: 64 codes × 4 bits = 32 bytes + one fp16 norm = 34 bytes = 4.25 bits/value.
  auto q = make_quantizer("tq:b4");
  StoredLayout l = q->stored_layout(64);
  EXPECT_EQ(l.group_tokens, 1);
  EXPECT_EQ(l.code_bytes, 32);
  EXPECT_EQ(l.meta_count, 1);
  EXPECT_FALSE(l.has_zeros);
  EXPECT_EQ(l.meta_dtype, DType::kFloat16);
  EXPECT_EQ(l.group_bytes(), 34);
  EXPECT_EQ(l.kernel, KernelKind::kTurboQuant);  // read as stored by the fused attention kernels
  EXPECT_DOUBLE_EQ(q->bits_per_value(64), 4.25);
  // tq:b3 at D = 128: 48 bytes + 2 = 50 bytes = 3.125 bits/value.
  EXPECT_EQ(make_quantizer("tq:b3")->stored_layout(128).group_bytes(), 50);
  EXPECT_DOUBLE_EQ(make_quantizer("tq:b3")->bits_per_value(128), 3.125);
  // tq:b3:prod at D = 64: 2-bit codes 16 bytes + 8 bytes of signs + fp16 ‖x‖ and γ = 28 bytes = 3.5.
  auto p = make_quantizer("tq:b3:prod");
  EXPECT_EQ(p->stored_layout(64).code_bytes, 24);
  EXPECT_EQ(p->stored_layout(64).meta_count, 2);
  EXPECT_EQ(p->stored_layout(64).group_bytes(), 28);
  EXPECT_DOUBLE_EQ(p->bits_per_value(64), 3.5);
  // Fractional: tq:b2.5 at D = 64: 32 coordinates × 3 bits + 32 × 2 = 160 bits = 20 bytes + 2 = 22
  // bytes = 2.75 bits/value (the norm's 16 bits count: 0.25 at D = 64, 0.125 at D = 128).
  EXPECT_EQ(make_quantizer("tq:b2.5")->stored_layout(64).group_bytes(), 22);
  EXPECT_DOUBLE_EQ(make_quantizer("tq:b2.5")->bits_per_value(64), 2.75);
  EXPECT_DOUBLE_EQ(make_quantizer("tq:b3.5")->bits_per_value(128), 3.625);
  // tq:b3.5:prod at D = 128: MSE stage 2.5 bits (64 × 3 + 64 × 2 = 40 bytes) + 16 bytes of signs
  // + 4 bytes = 60 bytes = 3.75 bits/value.
  EXPECT_EQ(make_quantizer("tq:b3.5:prod")->stored_layout(128).group_bytes(), 60);
  // tq:b1 at D = 8: one byte of codes + 2 bytes of norm = 3 bits/value.
  EXPECT_DOUBLE_EQ(make_quantizer("tq:b1")->bits_per_value(8), 3.0);
  // quantize() holds exactly that: [1, 2, 5, 64] → 10 rows × 34 bytes.
  QuantizedTensor t = q->quantize(testing::randn_kv({1, 2, 5, 64}, 1));
  EXPECT_EQ(t.codes.shape(), (std::vector<int64_t>{1, 2, 5, 32}));
  EXPECT_EQ(t.scales.shape(), (std::vector<int64_t>{1, 2, 5, 1}));
  EXPECT_FALSE(t.zeros.defined());
  EXPECT_EQ(t.nbytes(), 340);
}

TEST(TurboQuantLayout, HeadDimNotAPowerOfTwoIsRefused) {
  auto q = make_quantizer("tq:b4");
  try {
    q->quantize(at::zeros({1, 1, 2, 48}));
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("power of two, got D = 48"));
  }
  EXPECT_THROW(q->stored_layout(96), InvalidArgument);
}

// ------------------------------------------------------------------ exact values
TEST(TurboQuantValues, GoldenVectorAtHeadDim2) {
  // x = [3, 4]: ‖x‖ = 5 (exact in fp16). For every sign pair s, H_2·diag(s)·x/5 is
  // ±[0.98995, −0.14142] up to order, whose 1-bit codes (levels ±√(2/π)/√2 = ±0.56419) undo to
  // diag(s)·H_2·c = [0, 0.79788]: x̂ = [0, 5·√(2/π)] = [0, 3.98942]. With nc, c is renormalised to
  // unit norm first: x̂ = [0, 5].
  for (int seed : {0, 1, 2, 3, 42}) {
    const std::string s = ":seed" + std::to_string(seed);
    std::vector<float> y = floats_of(kvcache::dequantize(*make_quantizer("tq:b1" + s), make_quantizer("tq:b1" + s)->quantize(row({3, 4}))));
    EXPECT_NEAR(y[0], 0.0f, 1e-6) << seed;
    EXPECT_NEAR(y[1], 5.0 * std::sqrt(2.0 / M_PI), 1e-5) << seed;
    auto nc = make_quantizer("tq:b1:nc" + s);
    y = floats_of(kvcache::dequantize(*nc, nc->quantize(row({3, 4}))));
    EXPECT_NEAR(y[0], 0.0f, 1e-6) << seed;
    EXPECT_NEAR(y[1], 5.0f, 1e-5) << seed;
  }
}

TEST(TurboQuantValues, RoundTripErrorIsTheCodebookDistortion) {
  // For Gaussian rows at D = 128 the rotated coordinates are ≈ N(0, 1/D): the relative squared
  // error is the Lloyd–Max distortion (up to the fp16 norm and finite-D effects).
  at::Tensor x = testing::randn_kv({1, 4, 256, 128}, 11);
  for (int b = 1; b <= 4; ++b) {
    auto q = make_quantizer("tq:b" + std::to_string(b));
    const ReconstructionError e = reconstruction_error(*q, x);
    const double mse = quant::gaussian_lloyd_max(b).mse;
    EXPECT_NEAR(e.rel_fro * e.rel_fro, mse, 0.06 * mse) << "b = " << b;
  }
  // Fractional bits: half the coordinates at each width, the distortion their mean.
  for (int b = 1; b <= 3; ++b) {
    auto q = make_quantizer("tq:b" + std::to_string(b) + ".5");
    const ReconstructionError e = reconstruction_error(*q, x);
    const double mse = 0.5 * (quant::gaussian_lloyd_max(b).mse + quant::gaussian_lloyd_max(b + 1).mse);
    EXPECT_NEAR(e.rel_fro * e.rel_fro, mse, 0.06 * mse) << "b = " << b << ".5";
  }
  // nc changes the error by little at 4 bits and helps at 1 bit (the norm is kept).
  const double e1 = reconstruction_error(*make_quantizer("tq:b1"), x).rel_fro;
  const double e1nc = reconstruction_error(*make_quantizer("tq:b1:nc"), x).rel_fro;
  EXPECT_GT(e1nc, 0.0);
  EXPECT_NE(e1nc, e1);
  // Prod at b bits reconstructs worse than MSE at b − 1 bits (its 1-bit sketch's variance): with
  // c = √(π/2)/D·γ·Sᵀz, E‖c‖² = (π/2)(1 + 2/π)γ² = (π/2 + 1)γ² and E⟨c, r⟩ = γ², so
  // E‖c − r‖² = (π/2)·γ²: relative squared error (π/2)·(MSE at b − 1) = 1.571 · 0.1175 at b = 3.
  const ReconstructionError p3 = reconstruction_error(*make_quantizer("tq:b3:prod"), x);
  const double predicted = M_PI / 2 * quant::gaussian_lloyd_max(2).mse;
  EXPECT_NEAR(p3.rel_fro * p3.rel_fro, predicted, 0.06 * predicted);
}

TEST(TurboQuantValues, HostileValues) {
  for (const char* spec : {"tq:b4", "tq:b2:nc", "tq:b3:prod", "tq:b1.5"}) {
    auto q = make_quantizer(spec);
    // zeros → exact zeros
    at::Tensor z = at::zeros({1, 2, 3, 16});
    EXPECT_TRUE(at::equal(kvcache::dequantize(*q, q->quantize(z)), z)) << spec;
    // a constant row: finite, norm kept up to the format's error
    at::Tensor c = at::full({1, 1, 2, 64}, 0.75f);
    std::vector<float> y = floats_of(kvcache::dequantize(*q, q->quantize(c)));
    for (float v : y) EXPECT_TRUE(std::isfinite(v)) << spec;
    EXPECT_LT(reconstruction_error(*q, c).rel_fro, 0.8) << spec;
    // a value at FLT_MAX in an ordinary row: fp32 metadata, finite out, the big value kept
    at::Tensor h = testing::randn_kv({1, 1, 2, 64}, 5);
    h[0][0][1][3] = std::numeric_limits<float>::max();
    QuantizedTensor t = q->quantize(h);
    EXPECT_EQ(t.scales.dtype(), DType::kFloat32) << spec;
    y = floats_of(kvcache::dequantize(*q, t));
    for (float v : y) EXPECT_TRUE(std::isfinite(v)) << spec;
    EXPECT_GT(y[64 + 3], 0.5f * std::numeric_limits<float>::max()) << spec;
    // rows whose norm passes float32 are refused, naming the row
    at::Tensor big = at::full({1, 1, 3, 64}, 1.0e38f);
    big[0][0][0].fill_(1.0f);
    try {
      q->quantize(big);
      FAIL() << "expected InvalidArgument for " << spec;
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("row [b, h, t] = [0, 0, 1]")) << spec;
      EXPECT_THAT(e.what(), HasSubstr("norm beyond float32")) << spec;
    }
    // fp16 input at its range limit: finite out, saturated to fp16
    at::Tensor f16 = at::full({1, 1, 1, 64}, 65504.0f).to(at::kHalf);
    at::Tensor y16 = kvcache::dequantize(*q, q->quantize(f16));
    EXPECT_EQ(y16.scalar_type(), at::kHalf);
    EXPECT_TRUE(at::isfinite(y16).all().item<bool>()) << spec;
  }
}

// ------------------------------------------------------------------ spec grammar
TEST(TurboQuantSpec, CanonicalFormsAndErrors) {
  EXPECT_EQ(make_quantizer("tq")->spec(), "tq:b4");
  EXPECT_EQ(make_quantizer("tq:b4:mse:nonc:seed42")->spec(), "tq:b4");
  EXPECT_EQ(make_quantizer("tq:nc:b3")->spec(), "tq:b3:nc");
  EXPECT_EQ(make_quantizer("tq:seed7:prod:b3")->spec(), "tq:b3:prod:seed7");
  EXPECT_EQ(make_quantizer("tq:b2:prod:nc")->spec(), "tq:b2:prod:nc");
  EXPECT_EQ(make_quantizer("tq:b3.5:nc")->spec(), "tq:b3.5:nc");
  EXPECT_EQ(make_quantizer("tq:b4.0")->spec(), "tq:b4");
  EXPECT_THROW(make_quantizer("tq:b5"), InvalidArgument);
  EXPECT_THROW(make_quantizer("tq:b2.25"), InvalidArgument);  // steps of 0.5 only
  EXPECT_THROW(make_quantizer("tq:b0"), InvalidArgument);
  EXPECT_THROW(make_quantizer("tq:b4:g32"), InvalidArgument);
  try {
    make_quantizer("tq:b1:prod");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("prod needs b >= 2"));
  }
  // As a cache scheme (the trivial scheme: the same quantizer for K and V).
  EXPECT_EQ(make_cache_scheme("tq:b3:nc")->spec(), "tq:b3:nc");
}

TEST(TurboQuantScheme, KeysProdValuesMseSeededPerLayer) {
  EXPECT_EQ(make_cache_scheme("turboquant")->spec(), "turboquant:k3:v3");
  EXPECT_EQ(make_cache_scheme("turboquant:v2.5:k3.5:nc:kmse")->spec(), "turboquant:k3.5:v2.5:kmse:nc");
  EXPECT_EQ(make_cache_scheme("turboquant:k4:v4:seed42")->spec(), "turboquant:k4:v4");
  EXPECT_THROW(make_cache_scheme("turboquant:k1:v2"), InvalidArgument);  // prod keys need k >= 2
  EXPECT_EQ(make_cache_scheme("turboquant:k1:v2:kmse")->spec(), "turboquant:k1:v2:kmse");
  auto s = make_cache_scheme("turboquant:k3:v2:nc");
  const CacheGeometry g{3, 2, 64};
  // vLLM's seeds: 42 + 1337·layer.
  EXPECT_EQ(s->streams(g, 0, 0).key.quantizer->spec(), "tq:b3:prod:nc");
  EXPECT_EQ(s->streams(g, 0, 0).value.quantizer->spec(), "tq:b2:nc");
  EXPECT_EQ(s->streams(g, 1, 0).key.quantizer->spec(), "tq:b3:prod:nc:seed1379");
  EXPECT_EQ(s->streams(g, 2, 16).value.quantizer->spec(), "tq:b2:nc:seed2716");
  EXPECT_EQ(s->streams(g, 2, 16).value.residual, 16);
  EXPECT_EQ(s->streams(g, 2, 16).key.flush, ResidualFlush::kSliding);
  try {
    s->streams(CacheGeometry{1, 1, 48}, 0, 0);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("power of two, got head_dim=48"));
  }
}

// ------------------------------------------------------------------ seeds and the raw codec
TEST(TurboQuantSeeds, SameSeedSameBytesOtherSeedOtherBytes) {
  at::Tensor x = testing::randn_kv({1, 2, 8, 64}, 21);
  for (const char* spec : {"tq:b4", "tq:b3:prod"}) {
    const QuantizedTensor a = make_quantizer(spec)->quantize(x);
    const QuantizedTensor b = make_quantizer(spec)->quantize(x);
    EXPECT_EQ(bytes_of(a.codes), bytes_of(b.codes)) << spec;
    EXPECT_EQ(bytes_of(a.scales), bytes_of(b.scales)) << spec;
    const QuantizedTensor c = make_quantizer(std::string(spec) + ":seed1379")->quantize(x);
    EXPECT_NE(bytes_of(a.codes), bytes_of(c.codes)) << spec;
  }
  // Golden bytes of seed 42 (the first row of x, tq:b2 at D = 8): a change in the seed
  // expansion, the rotation, the codebook or the packing changes them.
  const QuantizedTensor g = make_quantizer("tq:b2")->quantize(row({1, -2, 3, -4, 5, -6, 7, -8}));
  EXPECT_EQ(bytes_of(g.codes), (std::vector<uint8_t>{0x59, 0xa3}));
}

TEST(TurboQuantCodec, EncodeDecodeMatchQuantizeDequantize) {
  // The block store's raw codec (encode/decode of a head's rows) is the reference twin of
  // quantize()/dequantize(): the same bytes and the same values.
  at::Tensor x = testing::randn_kv({1, 1, 37, 64}, 31);
  for (const char* spec : {"tq:b4", "tq:b1:nc", "tq:b3:prod", "tq:b3.5"}) {
    auto q = make_quantizer(spec);
    const QuantizedTensor t = q->quantize(x);
    const StoredLayout l = q->stored_layout(64);
    std::vector<uint8_t> codes(static_cast<size_t>(37 * l.code_bytes));
    std::vector<uint16_t> meta(static_cast<size_t>(37 * l.meta_count));
    const EncodeStatus s = q->encode(x.data_ptr<float>(), 37, 64, 1.0f, {codes.data(), meta.data(), nullptr});
    EXPECT_FALSE(s.overflow || s.nonfinite) << spec;
    EXPECT_EQ(codes, bytes_of(t.codes)) << spec;
    const auto* sc = static_cast<const uint16_t*>(t.scales.data());
    EXPECT_EQ(meta, std::vector<uint16_t>(sc, sc + meta.size())) << spec;
    std::vector<float> out(static_cast<size_t>(37 * 64));
    q->decode({codes.data(), meta.data(), nullptr}, 37, 64, 1.0f, out.data());
    EXPECT_EQ(out, floats_of(kvcache::dequantize(*q, t))) << spec;
    // A norm past fp16 is an overflow for the raw codec (the cache stores such a row in fp32).
    std::vector<float> big(64, 20000.0f);
    EXPECT_TRUE(q->encode(big.data(), 1, 64, 1.0f, {codes.data(), meta.data(), nullptr}).overflow) << spec;
  }
}

// ------------------------------------------------------------------ Prod: unbiased inner products
TEST(TurboQuantProd, InnerProductsAreUnbiasedOverSketches) {
  // Fixed k and q (D = 64); over 2000 seeds (rotation and sketch drawn afresh), the mean of
  // ⟨q, k̂⟩ must equal ⟨q, k⟩ within 4 standard errors of the mean (a false alarm about once in
  // 16000 runs; the seeds are fixed, so the test is deterministic). The MSE-only estimate at
  // 1 bit is biased (shrunk by about 2/π): it must fail the same test.
  const int64_t d = 64;
  at::Tensor k = testing::randn_kv({1, 1, 1, d}, 41);
  at::Tensor qv = k[0][0][0] * 0.6 + testing::randn_kv({1, 1, 1, d}, 42)[0][0][0] * 0.8;
  const double truth = at::dot(qv, k[0][0][0]).item<double>();
  ASSERT_GT(std::abs(truth), 1.0);
  auto stats = [&](const std::string& base) {
    double sum = 0, sum2 = 0;
    const int n = 2000;
    for (int s = 0; s < n; ++s) {
      auto q = make_quantizer(base + ":seed" + std::to_string(s));
      const double e = at::dot(qv, kvcache::dequantize(*q, q->quantize(k))[0][0][0]).item<double>();
      sum += e;
      sum2 += e * e;
    }
    const double mean = sum / n;
    const double se = std::sqrt((sum2 / n - mean * mean) / (n - 1));
    return std::make_pair(mean, se);
  };
  for (const char* spec : {"tq:b2:prod", "tq:b3:prod", "tq:b2.5:prod"}) {
    const auto [mean, se] = stats(spec);
    EXPECT_LT(std::abs(mean - truth), 4 * se) << spec << ": mean " << mean << " vs " << truth << " (se " << se << ")";
    EXPECT_LT(se, 0.05 * std::abs(truth)) << spec;  // the test has power
  }
  const auto [mean1, se1] = stats("tq:b1");
  EXPECT_GT(std::abs(mean1 - truth), 4 * se1) << "MSE-only at 1 bit should be biased: " << mean1 << " vs " << truth;
  EXPECT_NEAR(mean1 / truth, 2.0 / M_PI, 0.05);
}

}  // namespace
}  // namespace kvcache
