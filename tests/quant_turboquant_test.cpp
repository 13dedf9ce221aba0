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

#include "cache/attend_fused.h"
#include "cache/block_list.h"
#include "cache_test_util.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"
#include "quant/hadamard.h"
#include "quant/lloyd_max.h"
#include "quant/turboquant_outlier.h"
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

// ------------------------------------------------------------------ outlier channels (tq:b<b>:o<n>)
const quant::TurboOutlierQuantizer& as_tqo(const Quantizer& q) {
  return dynamic_cast<const quant::TurboOutlierQuantizer&>(q);
}

TEST(TurboQuantOutliers, BytesPerValueByHand) {
  // tq:b2:o16 at D = 64, G = 32: mask 64 bits = 8 bytes; per token 16 × 3 + 48 × 2 = 144 bits =
  // 18 bytes of codes and two fp16 norms (4 bytes). Per group: 8 + 32 · 18 = 584 code bytes +
  // 64 fp16 = 128 bytes = 712 bytes = 5696 bits over 32 · 64 values = 2.78125 bits/value.
  auto q = make_quantizer("tq:b2:o16");
  const StoredLayout l = q->stored_layout(64);
  EXPECT_EQ(l.axis, GroupAxis::kPerChannel);
  EXPECT_EQ(l.group_tokens, 32);
  EXPECT_EQ(l.code_bytes, 584);
  EXPECT_EQ(l.meta_count, 64);
  EXPECT_FALSE(l.has_zeros);
  EXPECT_EQ(l.meta_dtype, DType::kFloat16);
  EXPECT_EQ(l.group_bytes(), 712);
  EXPECT_EQ(l.kernel, KernelKind::kNone);  // no fused kernel reads the split: the generic path decodes it
  EXPECT_FALSE(l.token_readable());
  EXPECT_DOUBLE_EQ(q->bits_per_value(64), 2.78125);
  EXPECT_EQ(q->group_axis(), GroupAxis::kPerChannel);
  // The paper's example, tq:b2:o32 at D = 128: 16 + 32 · 36 = 1168 code bytes + 128 = 1296
  // bytes per 32 tokens = 40.5 bytes per token = 2.53125 bits/value (tq:b2.5: 42 bytes, 2.625).
  EXPECT_EQ(make_quantizer("tq:b2:o32")->stored_layout(128).group_bytes(), 1296);
  EXPECT_DOUBLE_EQ(make_quantizer("tq:b2:o32")->bits_per_value(128), 2.53125);
  // A head_dim that is no power of two (the dense rotations need none): D = 96, o32, b2:
  // 12 mask bytes + 32 · ⌈(192 + 32)/8⌉ = 28 bytes → 908 + 128 = 1036 bytes per 32 · 96 values.
  EXPECT_DOUBLE_EQ(make_quantizer("tq:b2:o32")->bits_per_value(96), 1036.0 * 8 / (32 * 96));
  // Codes that end mid-byte: D = 12, o3, b1, g4: 2 mask bytes + 4 tokens × ⌈(12 + 3)/8⌉ = 2 bytes
  // → 10 code bytes + 8 fp16 = 26 bytes per 48 values.
  auto small = make_quantizer("tq:b1:o3:g4");
  EXPECT_EQ(small->stored_layout(12).code_bytes, 10);
  EXPECT_DOUBLE_EQ(small->bits_per_value(12), 26.0 * 8 / 48);
  // quantize() holds exactly that: [1, 2, 64, 64] = 2 heads × 2 groups × 712 bytes.
  const QuantizedTensor t = q->quantize(testing::randn_kv({1, 2, 64, 64}, 1));
  EXPECT_EQ(t.codes.shape(), (std::vector<int64_t>{1, 2, 2, 584}));
  EXPECT_EQ(t.scales.shape(), (std::vector<int64_t>{1, 2, 2, 64}));
  EXPECT_FALSE(t.zeros.defined());
  EXPECT_EQ(t.nbytes(), 4 * 712);
  EXPECT_EQ(static_cast<double>(t.nbytes()), 2 * 64 * 64 * q->bits_per_value(64) / 8);
}

TEST(TurboQuantOutliers, TheFusedTurboQuantKernelDoesNotTakeIt) {
  const auto kind = [](const std::string& spec) {
    const auto q = make_quantizer(spec);
    const int64_t cap = std::max<int64_t>(32, q->stored_layout(64).group_tokens);
    return cache::fused::classify(cache::BlockFormat(*q, 64, cap, nullptr)).kind;
  };
  EXPECT_EQ(kind("tq:b2:o16"), cache::fused::KernelFormat::Kind::kNone);
  EXPECT_EQ(kind("tq:b3:o8:g16:nc"), cache::fused::KernelFormat::Kind::kNone);
  EXPECT_EQ(kind("tq:b2.5"), cache::fused::KernelFormat::Kind::kTurboQuant);  // the half/half mode keeps it
}

TEST(TurboQuantOutliers, SelectionOnAHandMadeGroup) {
  // Two tokens, D = 8. Energies Σ_t x²: c0 2, c1 25, c2 0, c3 25, c4 0, c5 5, c6 0, c7 25.
  const std::vector<float> x = {1, 5, 0, 3, 0, 2, 0, 3,  //
                                1, 0, 0, 4, 0, 1, 0, -4};
  using Q = quant::TurboOutlierQuantizer;
  EXPECT_EQ(Q::select_outliers(x.data(), 2, 8, 2), (std::vector<int64_t>{1, 3}));  // a three-way tie: lower indices
  EXPECT_EQ(Q::select_outliers(x.data(), 2, 8, 3), (std::vector<int64_t>{1, 3, 7}));
  EXPECT_EQ(Q::select_outliers(x.data(), 2, 8, 4), (std::vector<int64_t>{1, 3, 5, 7}));
  EXPECT_EQ(Q::select_outliers(x.data(), 2, 8, 5), (std::vector<int64_t>{0, 1, 3, 5, 7}));
  EXPECT_EQ(Q::select_outliers(x.data(), 1, 8, 2), (std::vector<int64_t>{1, 3}));  // token 0 alone: 25, 9 (c3, c7)
  // The stored mask (the first ⌈D/8⌉ code bytes of the group): bit c set iff c is an outlier.
  const at::Tensor xt = at::tensor(x).reshape({1, 1, 2, 8});
  EXPECT_EQ(bytes_of(make_quantizer("tq:b2:o2:g2")->quantize(xt).codes)[0], 0x0a);
  EXPECT_EQ(bytes_of(make_quantizer("tq:b2:o4:g2")->quantize(xt).codes)[0], 0xaa);
  // g1: a mask per token. Token 0: c1 (25), c3 (9), then c7 (9) → o2 = {1, 3}; token 1: c3 and c7 (16).
  const QuantizedTensor per_token = make_quantizer("tq:b2:o2:g1")->quantize(xt);
  const std::vector<uint8_t> b = bytes_of(per_token.codes);
  ASSERT_EQ(b.size(), 2u * (1 + (8 * 2 + 2 + 7) / 8));
  EXPECT_EQ(b[0], 0x0a);
  EXPECT_EQ(b[b.size() / 2], 0x88);
  // The parts come back on their own channels: with nc each part's reconstruction has its stored
  // norm, so the outlier channels of token 0 ({1, 3}) hold √34 and the others √5.
  auto nc = make_quantizer("tq:b2:o2:g2:nc");
  const std::vector<float> y = floats_of(kvcache::dequantize(*nc, nc->quantize(xt)));
  const double out0 = std::hypot(y[1], y[3]);
  const double in0 = std::sqrt(y[0] * y[0] + y[2] * y[2] + y[4] * y[4] + y[5] * y[5] + y[6] * y[6] + y[7] * y[7]);
  EXPECT_NEAR(out0, std::sqrt(34.0), 2e-3 * std::sqrt(34.0));  // fp16 norm
  EXPECT_NEAR(in0, std::sqrt(14.0), 2e-3 * std::sqrt(14.0));
}

TEST(TurboQuantOutliers, DenseRotationIsOrthogonalAndSeeded) {
  auto q = make_quantizer("tq:b2:o32");
  for (const auto& [part, size] : {std::pair{0, int64_t{32}}, std::pair{1, int64_t{96}}, std::pair{1, int64_t{1}}}) {
    const auto r = as_tqo(*q).rotation(part, size);
    ASSERT_EQ(r->size(), static_cast<size_t>(size * size));
    double worst = 0;
    for (int64_t i = 0; i < size; ++i) {
      for (int64_t j = 0; j < size; ++j) {
        double dot = 0;
        for (int64_t k = 0; k < size; ++k) dot += double((*r)[i * size + k]) * (*r)[j * size + k];
        worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
      }
    }
    EXPECT_LT(worst, 1e-6) << "Q Qᵀ = I, size " << size;
    // Qᵀ(Q x) = x.
    std::vector<double> x(static_cast<size_t>(size)), y(static_cast<size_t>(size), 0.0), back(static_cast<size_t>(size), 0.0);
    for (int64_t i = 0; i < size; ++i) x[static_cast<size_t>(i)] = std::sin(0.7 * double(i)) + 0.1 * double(i);
    for (int64_t i = 0; i < size; ++i) {
      for (int64_t j = 0; j < size; ++j) y[static_cast<size_t>(i)] += (*r)[i * size + j] * x[static_cast<size_t>(j)];
    }
    for (int64_t i = 0; i < size; ++i) {
      for (int64_t j = 0; j < size; ++j) back[static_cast<size_t>(j)] += (*r)[i * size + j] * y[static_cast<size_t>(i)];
    }
    for (int64_t i = 0; i < size; ++i) EXPECT_NEAR(back[static_cast<size_t>(i)], x[static_cast<size_t>(i)], 1e-5);
    EXPECT_EQ(as_tqo(*q).rotation(part, size), r) << "cached";
  }
  // The two parts' rotations are independent even at equal sizes; another seed, another matrix.
  EXPECT_NE(*as_tqo(*q).rotation(0, 32), *as_tqo(*q).rotation(1, 32));
  EXPECT_NE(*as_tqo(*make_quantizer("tq:b2:o32:seed7")).rotation(0, 32), *as_tqo(*q).rotation(0, 32));
  // Same seed, same bytes; another seed, other bytes.
  const at::Tensor x = testing::randn_kv({1, 2, 64, 64}, 21);
  const QuantizedTensor a = make_quantizer("tq:b2:o16")->quantize(x), b = make_quantizer("tq:b2:o16")->quantize(x);
  EXPECT_EQ(bytes_of(a.codes), bytes_of(b.codes));
  EXPECT_EQ(bytes_of(a.scales), bytes_of(b.scales));
  const QuantizedTensor c = make_quantizer("tq:b2:o16:seed1379")->quantize(x);
  EXPECT_NE(bytes_of(a.codes), bytes_of(c.codes));
  EXPECT_EQ(bytes_of(a.scales), bytes_of(c.scales));  // the norms do not depend on the rotation
  // Golden bytes of seed 42 (tq:b2:o2:g1 at D = 8): mask 0xc0 (channels 6 and 7: 49 and 64 are the
  // largest squares), then 2 × 3 + 6 × 2 = 18 bits of codes in 3 bytes. A change in the seed
  // expansion, the Gram–Schmidt, the codebooks or the packing changes them.
  const QuantizedTensor g = make_quantizer("tq:b2:o2:g1")->quantize(row({1, -2, 3, -4, 5, -6, 7, -8}));
  const std::vector<uint8_t> gb = bytes_of(g.codes);
  // The outlier codes 2 and 5 (bits 0–5 of 0xea) mirror each other: a 2-d unit vector rotated
  // lands at about (−a, a) here. Bits 18–23 are padding (0).
  EXPECT_EQ(gb, (std::vector<uint8_t>{0xc0, 0xea, 0xc6, 0x01}));
}

TEST(TurboQuantOutliers, BeatsTheHalfSplitOnKeysWithOutlierChannels) {
  // Keys-like data at D = 64: N(0, 1) with 4 channels at 10× the scale (they hold 400/460 = 87 %
  // of the energy). The half/half tq:b2.5 rotates them into every coordinate; the outlier split
  // codes them in their own instance. Measured (seed 51, [1, 4, 256, 64]): relative squared
  // error tq:b2.5 0.0611 (2.75 bits/value), tq:b2:o8 0.0395 (2.65625), tq:b2:o16 0.0390 (2.78125).
  at::Tensor x = testing::randn_kv({1, 4, 256, 64}, 51);
  at::Tensor k = x.clone();
  for (int64_t c : {3, 17, 40, 58}) k.select(3, c).mul_(10.0);
  const auto rel2 = [](const std::string& spec, const at::Tensor& t) {
    return std::pow(reconstruction_error(*make_quantizer(spec), t).rel_fro, 2);
  };
  const double half = rel2("tq:b2.5", k), o8 = rel2("tq:b2:o8", k), o16 = rel2("tq:b2:o16", k);
  EXPECT_LT(make_quantizer("tq:b2:o8")->bits_per_value(64), make_quantizer("tq:b2.5")->bits_per_value(64));
  EXPECT_LT(o8, 0.75 * half) << o8 << " vs " << half;   // fewer bits, a third less error
  EXPECT_LT(o16, 0.75 * half) << o16 << " vs " << half;  // 0.03 bits more
  // Isotropic N(0, 1): no channel stands out. tq:b2:o16 codes 2.25 bits per coordinate against
  // 2.5, so it loses, by less than the codebooks alone say ((16 · 0.0345 + 48 · 0.1175)/64 =
  // 0.0968 against 0.0760: 1.27×), since the group's highest-energy channels get the extra bit.
  // Measured: tq:b2.5 0.0747, tq:b2:o16 0.0859 (1.15×); tq:b2:o32 (2.5 code bits) 0.0648 (0.87×).
  const double iso_half = rel2("tq:b2.5", x), iso16 = rel2("tq:b2:o16", x), iso32 = rel2("tq:b2:o32", x);
  EXPECT_GT(iso16, iso_half);
  EXPECT_LT(iso16, 1.25 * iso_half) << iso16 << " vs " << iso_half;
  EXPECT_NEAR(iso32 / iso_half, 1.0, 0.2) << iso32 << " vs " << iso_half;
}

TEST(TurboQuantOutliers, HostileValues) {
  for (const char* spec : {"tq:b2:o16", "tq:b1:o4:g8:nc", "tq:b3:o32:g1"}) {
    auto q = make_quantizer(spec);
    // zeros → exact zeros
    at::Tensor z = at::zeros({1, 2, 32, 64});
    EXPECT_TRUE(at::equal(kvcache::dequantize(*q, q->quantize(z)), z)) << spec;
    // One non-zero channel: the inlier part of every token is 0 and decodes to exact zeros.
    at::Tensor one = at::zeros({1, 1, 32, 64});
    one.select(3, 5).fill_(2.5f);
    // (Every other channel ties at 0: the outliers are channel 5 and the first n − 1 others.)
    const at::Tensor y1 = kvcache::dequantize(*q, q->quantize(one));
    at::Tensor inliers = y1.clone();
    inliers.narrow(3, 0, as_tqo(*q).outliers()).zero_();  // (a superset of the outliers when n <= 5)
    inliers.select(3, 5).zero_();
    EXPECT_TRUE(at::equal(inliers, at::zeros_like(inliers))) << spec;
    EXPECT_GT(y1[0][0][0][5].item<float>(), 0.0f) << spec;
    // a constant row (every channel ties: the outliers are the first n): finite, error bounded
    at::Tensor c = at::full({1, 1, 32, 64}, 0.75f);
    EXPECT_TRUE(at::isfinite(kvcache::dequantize(*q, q->quantize(c))).all().item<bool>()) << spec;
    EXPECT_LT(reconstruction_error(*q, c).rel_fro, 0.8) << spec;
    // a value at FLT_MAX in an ordinary row: fp32 metadata, finite out, the big value kept
    at::Tensor h = testing::randn_kv({1, 1, 32, 64}, 5);
    h[0][0][1][3] = std::numeric_limits<float>::max();
    const QuantizedTensor t = q->quantize(h);
    EXPECT_EQ(t.scales.dtype(), DType::kFloat32) << spec;
    const std::vector<float> y = floats_of(kvcache::dequantize(*q, t));
    for (float v : y) ASSERT_TRUE(std::isfinite(v)) << spec;
    EXPECT_GT(y[64 + 3], 0.5f * std::numeric_limits<float>::max()) << spec;
    // a part norm past float32 is refused, naming the row
    at::Tensor big = at::full({1, 1, 32, 64}, 1.0e38f);
    big[0][0][0].fill_(1.0f);
    EXPECT_THAT([&] { q->quantize(big); },
                ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("row [b, h, t] = [0, 0, 1]")))
        << spec;
    // NaN is refused like every format, naming the index
    at::Tensor nan = testing::randn_kv({1, 1, 32, 64}, 6);
    nan[0][0][7][9] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_THAT([&] { q->quantize(nan); },
                ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("NaN at [b, h, t, d] = [0, 0, 7, 9]")))
        << spec;
  }
}

TEST(TurboQuantOutliers, SpecRoundTripAndRefusals) {
  EXPECT_EQ(make_quantizer("tq:o16:b2")->spec(), "tq:b2:o16");
  EXPECT_EQ(make_quantizer("tq:b2:o16:g32:mse:nonc:seed42")->spec(), "tq:b2:o16");
  EXPECT_EQ(make_quantizer("tq:nc:seed7:g16:o8:b3")->spec(), "tq:b3:o8:g16:nc:seed7");
  EXPECT_EQ(make_quantizer("tq:b2:o16:nc")->spec(), "tq:b2:o16:nc");
  EXPECT_EQ(make_quantizer(make_quantizer("tq:b1:o3:g4")->spec())->spec(), "tq:b1:o3:g4");
  EXPECT_EQ(make_cache_scheme("tq:b2:o16:nc")->spec(), "tq:b2:o16:nc");
  // The tq table lists the fields (kv_study list, the registry).
  for (const ParamTable& t : registered_quantizers()) {
    if (t.head != "tq") continue;
    std::vector<std::string> keys;
    for (const ParamDef& d : t.params) keys.push_back(d.key);
    EXPECT_EQ(keys, (std::vector<std::string>{"b", "o", "g", "mode", "norm", "seed"}));
  }
  const auto message = [](const std::string& spec) {
    try {
      (void)make_quantizer(spec);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_THAT(message("tq:b2.5:o16"), HasSubstr("with outlier channels b must be an integer 1, 2 or 3"));
  EXPECT_THAT(message("tq:b2.5:o16"), HasSubstr("got b = 2.5"));
  EXPECT_THAT(message("tq:b4:o16"), HasSubstr("got b = 4"));
  EXPECT_THAT(message("tq:b3:o16:prod"), HasSubstr("prod is not supported with outlier channels"));
  EXPECT_THAT(message("tq:b2:o0"), HasSubstr("o<n> needs n >= 1 outlier channels, got o = 0"));
  EXPECT_THAT(message("tq:b4:g32"), HasSubstr("needs n >= 1 outlier channels"));  // g without o
  EXPECT_THAT(message("tq:b2:o16:g0"), HasSubstr("out of range [1, 4096]"));
  EXPECT_THAT(message("tq:b2:o-1"), HasSubstr("out of range [0, 4096]"));
  // D ≤ n is refused where D is known, naming it.
  auto q = make_quantizer("tq:b2:o64");
  EXPECT_THAT([&] { q->stored_layout(64); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("need head_dim D > 64 (both parts non-empty), got D = 64")));
  EXPECT_THAT([&] { q->quantize(at::zeros({1, 1, 32, 16})); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("got D = 16")));
  EXPECT_THROW(q->bits_per_value(64), InvalidArgument);
  EXPECT_THAT([&] { make_quantizer("tq:b2:o16")->quantize(at::zeros({1, 1, 33, 64})); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("seq_len T = 33")));
  CacheConfig c;
  c.num_layers = 1;
  c.num_q_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 16;
  c.scheme = "tq:b2:o16";
  c.policy = "full";
  c.rope = keys_already_rotated();
  EXPECT_THAT([&] { c.validate(); }, ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("got D = 16")));
}

TEST(TurboQuantOutliers, CodecMatchesQuantizeAndRefusesABadMask) {
  at::Tensor x = testing::randn_kv({1, 1, 64, 64}, 31);
  for (const char* spec : {"tq:b2:o16", "tq:b1:o3:g4:nc", "tq:b3:o8:g16"}) {
    auto q = make_quantizer(spec);
    const QuantizedTensor t = q->quantize(x);
    const StoredLayout l = q->stored_layout(64);
    const int64_t groups = 64 / l.group_tokens;
    std::vector<uint8_t> codes(static_cast<size_t>(groups * l.code_bytes));
    std::vector<uint16_t> meta(static_cast<size_t>(groups * l.meta_count));
    const EncodeStatus s = q->encode(x.data_ptr<float>(), groups, 64, 1.0f, {codes.data(), meta.data(), nullptr});
    EXPECT_FALSE(s.overflow || s.nonfinite) << spec;
    EXPECT_EQ(codes, bytes_of(t.codes)) << spec;
    const auto* sc = static_cast<const uint16_t*>(t.scales.data());
    EXPECT_EQ(meta, std::vector<uint16_t>(sc, sc + meta.size())) << spec;
    std::vector<float> out(static_cast<size_t>(64 * 64));
    q->decode({codes.data(), meta.data(), nullptr}, groups, 64, 1.0f, out.data());
    EXPECT_EQ(out, floats_of(kvcache::dequantize(*q, t))) << spec;
    // A norm past fp16 is an overflow for the raw codec (the cache stores such a group in fp32).
    std::vector<float> big(static_cast<size_t>(l.group_tokens * 64), 20000.0f);
    EXPECT_TRUE(q->encode(big.data(), 1, 64, 1.0f, {codes.data(), meta.data(), nullptr}).overflow) << spec;
  }
  // A hand-built mask of the wrong size is refused by dequantize(), naming the group.
  auto q = make_quantizer("tq:b2:o16");
  QuantizedTensor t = q->quantize(x);
  static_cast<uint8_t*>(t.codes.data())[584] ^= 0x01;  // group 1's channel 0
  EXPECT_THAT([&] { (void)kvcache::dequantize(*q, t); },
              ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("group [b, h, group] = [0, 0, 1] has a channel mask of")));
}

TEST(TurboQuantOutliers, RoundTripThroughTheCache) {
  // T = 45 tokens in chunks, G = 8: the first 40 are quantized in 5 groups as they fill, the last
  // 5 wait in the cache's fp16 window. get() returns exactly dequantize(quantize()) of the
  // fp16-rounded values for the groups and the fp16 values for the rest.
  const std::string spec = "tq:b2:o4:g8";
  auto cfg = testing::make_config(1, 4, 2, 16, spec, "full");
  TorchCache m(cfg);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<at::Tensor> vs;
  int64_t pos = 0;
  at::Tensor got, qr;
  for (int64_t n : {5, 3, 1, 12, 7, 16, 1}) {
    at::Tensor k = testing::randn({1, 2, n, 16}, gen), v = testing::randn({1, 2, n, 16}, gen);
    v.select(3, 2).mul_(8.0);  // an outlier channel
    m.append(0, k, v, testing::positions_range(pos, n));
    vs.push_back(v);
    if (pos + n == 45) {  // the last token's query (rotated, as an engine passes it) over all 45
      qr = testing::test_rope(testing::randn({1, 4, 1, 16}, gen), testing::positions_range(44, 1));
      got = m.attend(0, qr, testing::positions_range(44, 1));
      // No fused kernel reads the format: the fused and generic paths are one path.
      EXPECT_TRUE(at::equal(testing::access_attend(m, 0, qr, testing::positions_range(44, 1), true),
                            testing::access_attend(m, 0, qr, testing::positions_range(44, 1), false)));
    }
    m.end_step(StepKind::kDecode);
    m.check_invariants();
    pos += n;
  }
  ASSERT_EQ(pos, 45);
  const at::Tensor v16 = at::cat(vs, 2).to(at::kHalf).to(at::kFloat);
  auto q = make_quantizer(spec);
  const at::Tensor want = at::cat({kvcache::dequantize(*q, q->quantize(v16.narrow(2, 0, 40))), v16.narrow(2, 40, 5)}, 2);
  const auto kv = m.get(0);
  EXPECT_TRUE(at::equal(kv.v, want)) << (kv.v - want).abs().max().item<float>();
  EXPECT_GT((kv.v.narrow(2, 0, 40) - v16.narrow(2, 0, 40)).abs().max().item<float>(), 0.0f);  // quantized
  // Attention (the generic path) is softmax(q·kᵀ/√D)·v of what get() returns.
  const at::Tensor kk = kv.k.repeat_interleave(2, 1), vv = kv.v.repeat_interleave(2, 1);
  const at::Tensor ref = at::matmul(at::softmax(at::matmul(qr, kk.transpose(2, 3)) / 4.0, -1), vv);
  EXPECT_TRUE(at::allclose(got, ref, 1e-4, 1e-5)) << (got - ref).abs().max().item<float>();
}

}  // namespace
}  // namespace kvcache
