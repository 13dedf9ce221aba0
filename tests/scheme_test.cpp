// SPDX-License-Identifier: Apache-2.0
// Cache schemes as a public concept (kvcache/cache_scheme.h) over the one registry of spec heads
// (kvcache/registry.h): kinds, canonical forms, wrong-kind errors, old spellings, the streams
// each scheme resolves to; the Hadamard rotation (fast Walsh–Hadamard transform against the
// explicit matrix; had(fp32) reproduces fp32 attention with post- and pre-RoPE keys).
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cache/cache_manager_access.h"
#include "cache_test_util.h"
#include "kvcache/cache_manager.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/quantizer.h"
#include "kvcache/registry.h"
#include "kvcache/study/arm.h"
#include "kvcache/torch.h"
#include "quant/hadamard.h"
#include "torch/quant_reference.h"
#include "quant_test_util.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;
using testing::make_config;
using testing::positions_range;

using testing::error_of;

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// ------------------------------------------------------------ the one registry

TEST(SpecRegistry, OneListOfUniqueHeadsInKindOrder) {
  std::vector<std::string> heads;
  std::vector<SpecKind> kinds;
  for (const auto& s : registered_specs()) {
    heads.push_back(s.table.head);
    kinds.push_back(s.kind);
  }
  EXPECT_EQ(heads, (std::vector<std::string>{"fp32", "fp16", "bf16", "fp8", "int8", "int4", "int3", "int2", "tq",
                                             "polar", "kivi", "kvquant", "had", "gear", "turboquant", "qjl", "layers", "full", "window", "sink", "h2o",
                                             "random", "snapkv", "tova", "pyramid", "knorm", "keydiff", "expected", "duo",
                                             "kvzip", "adakv", "decode", "perlayer"}));
  EXPECT_TRUE(std::is_sorted(kinds.begin(), kinds.end()));  // quantizers, then schemes, then policies
  // The per-kind lists are slices of the one list.
  EXPECT_EQ(registered_quantizers().size(), 10u);
  EXPECT_EQ(registered_cache_schemes().size(), 7u);
  EXPECT_EQ(registered_policies().size(), 16u);
  EXPECT_FALSE(registered_specs()[10].wrapper);  // kivi
  EXPECT_FALSE(registered_specs()[11].wrapper);  // kvquant
  EXPECT_TRUE(registered_specs()[12].wrapper);   // had
  EXPECT_FALSE(registered_specs()[13].wrapper);  // gear
  EXPECT_FALSE(registered_specs()[14].wrapper);  // turboquant
  EXPECT_FALSE(registered_specs()[15].wrapper);  // qjl
  EXPECT_TRUE(registered_specs()[16].wrapper);   // layers
}

TEST(SpecRegistry, SpecKindReadsTheHeadOfAnySpec) {
  EXPECT_EQ(spec_kind("int3:g32:chan"), SpecKind::kQuantizer);
  EXPECT_EQ(spec_kind("kivi:k2:v2:g32:r128"), SpecKind::kCacheScheme);
  EXPECT_EQ(spec_kind("had:k(kivi)"), SpecKind::kCacheScheme);
  EXPECT_EQ(spec_kind("h2o@50%"), SpecKind::kPolicy);
  EXPECT_EQ(spec_kind("pyramid:b2"), SpecKind::kPolicy);
  EXPECT_EQ(spec_kind("pyramidkv:b2@50%"), SpecKind::kPolicy);  // old spelling
  EXPECT_EQ(spec_kind("int5"), std::nullopt);
  EXPECT_EQ(spec_head("had:k(int4)"), "had");
  EXPECT_EQ(spec_head("sink:s4@50%"), "sink");
}

TEST(SpecRegistry, ASpecOfTheWrongKindIsNamed) {
  EXPECT_THAT(error_of([] { make_cache_scheme("h2o@50%"); }), HasSubstr("'h2o' is an eviction policy"));
  EXPECT_THAT(error_of([] { make_quantizer("kivi:k2:v2:g32:r128"); }), HasSubstr("'kivi' is a cache scheme"));
  EXPECT_THAT(error_of([] { make_eviction_policy("int4@50%"); }), HasSubstr("'int4' is a quantizer"));
  const std::string unknown = error_of([] { make_cache_scheme("int5:g32"); });
  EXPECT_THAT(unknown, HasSubstr("unknown cache scheme 'int5' in spec 'int5:g32'"));
  EXPECT_THAT(unknown, HasSubstr("fp32, fp16, bf16, fp8, int8, int4, int3, int2, tq, polar, kivi, kvquant, had"));
}

// The study once spelled PyramidKV `pyramidkv` (and read `pyramid:b2` as a quantizer): both
// spellings now go to the registered policy, and results carry the registry's spelling.
TEST(SpecRegistry, PyramidSpellingsAreOnePolicy) {
  EXPECT_EQ(make_eviction_policy("pyramidkv:b2@50%")->spec(), "pyramid:b2@50%");
  EXPECT_EQ(make_eviction_policy("pyramid:b2@50%")->spec(), "pyramid:b2@50%");
  EXPECT_EQ(study::parse_arm("pyramid:b2"), (study::Arm{"fp32", "pyramid:b2"}));
  EXPECT_EQ(study::parse_arm("pyramidkv"), (study::Arm{"fp32", "pyramidkv"}));
  EXPECT_EQ(study::parse_arm("kivi:k2:v2:g32:r128+full"), (study::Arm{"kivi:k2:v2:g32:r128", "full"}));
  EXPECT_EQ(study::parse_arm("had(int4)"), (study::Arm{"had(int4)", "full"}));
}

// ------------------------------------------------------------ canonical forms

TEST(CacheScheme, CanonicalFormsRoundTrip) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"fp32", "fp32"},
      {"int4:tok:g32", "int4:g32"},
      {"int3:chan:g32", "int3:g32:chan"},
      {"kivi", "kivi:k2:v2:g32:r128"},
      {"kivi:r64:g16:v3:k3", "kivi:k3:v3:g16:r64"},
      {"had(int4)", "had(int4)"},
      {"had:kv(int4:tok)", "had(int4)"},
      {"had(kivi)", "had(kivi:k2:v2:g32:r128)"},
      {"had:k(kivi:k4:v4)", "had:k(kivi:k4:v4:g32:r128)"},
      {"had:k(int4:g32)", "had:k(int4:g32)"},
  };
  for (const auto& [in, canonical] : cases) {
    const auto s = make_cache_scheme(in);
    EXPECT_EQ(s->spec(), canonical) << in;
    EXPECT_EQ(make_cache_scheme(s->spec())->spec(), canonical) << in;
  }
  // A rotated quantizer is a quantizer too (kv_study quant, bench_quant), canonicalized alike.
  EXPECT_EQ(make_quantizer("had:kv(int4:tok:g32)")->spec(), "had(int4:g32)");
}

TEST(CacheScheme, BadSpecsSayWhatIsExpected) {
  EXPECT_THAT(error_of([] { make_cache_scheme("had"); }), HasSubstr("wraps another spec: write had(<spec>)"));
  EXPECT_THAT(error_of([] { make_cache_scheme("int4(fp32)"); }), HasSubstr("not a wrapped '(spec)'"));
  EXPECT_THAT(error_of([] { make_cache_scheme("had(had(int4))"); }), HasSubstr("already rotated"));
  EXPECT_THAT(error_of([] { make_quantizer("had(had(int4))"); }), HasSubstr("already rotated"));
  EXPECT_THAT(error_of([] { make_quantizer("had:k(int4)"); }), HasSubstr("rotates only the keys of a cache scheme"));
  EXPECT_THAT(error_of([] { make_cache_scheme("had(int4"); }), HasSubstr("had(int4"));
  EXPECT_THAT(error_of([] { make_cache_scheme("had()"); }), HasSubstr("had()"));
  EXPECT_THAT(error_of([] { make_cache_scheme("had(h2o)"); }), HasSubstr("'h2o' is an eviction policy"));
  EXPECT_THAT(error_of([] { make_cache_scheme("kivi:k5"); }), HasSubstr("k=5 is not one of {2, 3, 4, 8}"));
  EXPECT_THAT(error_of([] { make_cache_scheme(""); }), HasSubstr("cache scheme spec is empty"));
}

// ------------------------------------------------------------ streams

TEST(CacheScheme, TrivialSchemeStreams) {
  const CacheGeometry g{2, 2, 64};
  LayerStreams s = make_cache_scheme("int4")->streams(g, 1, 5);
  EXPECT_EQ(s.key.quantizer->spec(), "int4");
  EXPECT_EQ(s.value.quantizer->spec(), "int4");
  EXPECT_EQ(s.key.residual, 5);
  EXPECT_EQ(s.key.flush, ResidualFlush::kSliding);
  EXPECT_EQ(s.key.residual_dtype, DType::kFloat16);
  // Per-channel groups of 32 tokens: the residual is raised to whole groups, flushed in blocks.
  s = make_cache_scheme("int3:g32:chan")->streams(g, 0, 5);
  EXPECT_EQ(s.key.residual, 32);
  EXPECT_EQ(s.key.flush, ResidualFlush::kBlock);
  s = make_cache_scheme("int3:g32:chan")->streams(g, 0, 40);
  EXPECT_EQ(s.value.residual, 64);
  // float32 rows keep a float32 residual, rotated or not.
  EXPECT_EQ(make_cache_scheme("fp32")->streams(g, 0, 4).key.residual_dtype, DType::kFloat32);
  EXPECT_EQ(make_cache_scheme("had(fp32)")->streams(g, 0, 4).key.residual_dtype, DType::kFloat32);
  EXPECT_EQ(make_cache_scheme("fp16")->streams(g, 0, 4).key.residual_dtype, DType::kFloat16);
  EXPECT_THAT(error_of([&] { make_cache_scheme("int4")->streams(g, 2, 0); }), HasSubstr("layer 2 out of range [0, 2)"));
}

TEST(CacheScheme, KiviAndRotationStreams) {
  const CacheGeometry g{1, 2, 64};
  LayerStreams s = make_cache_scheme("kivi:k3:v3:g32:r128")->streams(g, 0, 0);
  EXPECT_EQ(s.key.quantizer->spec(), "int3:g32:chan");
  EXPECT_EQ(s.value.quantizer->spec(), "int3:g32");
  EXPECT_EQ(s.key.residual, 128);
  EXPECT_EQ(s.value.residual, 128);
  EXPECT_EQ(s.key.flush, ResidualFlush::kBlock);
  EXPECT_EQ(s.value.flush, ResidualFlush::kSliding);
  EXPECT_THAT(error_of([&] { make_cache_scheme("kivi")->streams(g, 0, 64); }),
              HasSubstr("CacheConfig::residual_length must be 0 or 128, got 64"));
  s = make_cache_scheme("had:k(kivi)")->streams(g, 0, 0);
  EXPECT_EQ(s.key.quantizer->spec(), "had(int2:g32:chan)");
  EXPECT_EQ(s.value.quantizer->spec(), "int2:g32");
  EXPECT_EQ(s.key.residual, 128);
  s = make_cache_scheme("had(kivi)")->streams(g, 0, 0);
  EXPECT_EQ(s.value.quantizer->spec(), "had(int2:g32)");
  // Rotation keeps the bits: the same stored bytes as the wrapped format.
  EXPECT_EQ(s.value.quantizer->bits_per_value(64), make_quantizer("int2:g32")->bits_per_value(64));
}

TEST(CacheScheme, RotationNeedsAPowerOfTwoHeadDim) {
  const std::string e = error_of([] { make_cache_scheme("had(int4)")->streams(CacheGeometry{1, 1, 48}, 0, 0); });
  EXPECT_THAT(e, HasSubstr("cache scheme 'had(int4)'"));
  EXPECT_THAT(e, HasSubstr("head_dim a power of two, got head_dim=48"));
  // CacheConfig::validate() resolves the scheme: a config that validates runs.
  EXPECT_THROW(make_config(1, 2, 2, 48, "had(int4)", "full").validate(), InvalidArgument);
  EXPECT_THROW(make_config(1, 2, 2, 48, "had:k(kivi:k2:v2:g16:r16)", "full").validate(), InvalidArgument);
  EXPECT_NO_THROW(make_config(1, 2, 2, 64, "had:k(kivi:k2:v2:g16:r16)", "full").validate());
  EXPECT_THROW(make_quantizer("had(int4)")->quantize(at::zeros({1, 1, 2, 12})), InvalidArgument);
}

// ------------------------------------------------------------ Hadamard transform

// H_2 = [[1, 1], [1, −1]]/√2; H_4 row 3 = (1, −1, −1, 1)/2.
TEST(Hadamard, HandCheckedSmallTransforms) {
  std::vector<float> x2 = {1.0f, 3.0f};
  quant::hadamard_rows(x2.data(), 1, 2);
  EXPECT_FLOAT_EQ(x2[0], 4.0f / std::sqrt(2.0f));
  EXPECT_FLOAT_EQ(x2[1], -2.0f / std::sqrt(2.0f));
  std::vector<float> x4 = {1.0f, 2.0f, 3.0f, 4.0f};
  quant::hadamard_rows(x4.data(), 1, 4);
  EXPECT_EQ(x4, (std::vector<float>{5.0f, -1.0f, -2.0f, 0.0f}));  // (10, −2, −4, 0)/2
  std::vector<float> x1 = {7.0f};
  quant::hadamard_rows(x1.data(), 1, 1);
  EXPECT_EQ(x1[0], 7.0f);
  const at::Tensor h4 = quant::ref::hadamard_matrix(4);
  EXPECT_EQ(h4[3][1].item<double>(), -0.5);
  EXPECT_EQ(h4[3][3].item<double>(), 0.5);
}

// The fast transform (O(D log D)) against its plain twin, the explicit matrix; orthonormality
// (H·H = I, norms kept) for every supported head_dim up to 512.
TEST(Hadamard, FastTransformMatchesTheExplicitMatrix) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  for (int64_t d = 1; d <= 512; d *= 2) {
    const int64_t rows = 37;
    const at::Tensor x = at::randn({rows, d}, gen) * 3.0;
    at::Tensor fast = x.clone();
    quant::hadamard_rows(fast.data_ptr<float>(), rows, d);
    const at::Tensor h = quant::ref::hadamard_matrix(d);
    EXPECT_TRUE(at::allclose(h.matmul(h), at::eye(d, at::kDouble), 0, 1e-12)) << d;
    const at::Tensor ref = x.to(at::kDouble).matmul(h.t());
    EXPECT_LT(max_abs_diff(fast, ref), 1e-5 * std::sqrt(static_cast<double>(d))) << d;
    EXPECT_NEAR(fast.norm().item<double>(), x.norm().item<double>(), 1e-4 * x.norm().item<double>()) << d;
    at::Tensor back = fast.clone();
    quant::hadamard_rows(back.data_ptr<float>(), rows, d);
    EXPECT_LT(max_abs_diff(back, x), 1e-5) << d;
  }
  EXPECT_FALSE(quant::is_power_of_two(48));
  EXPECT_FALSE(quant::is_power_of_two(0));
  EXPECT_TRUE(quant::is_power_of_two(128));
}

// Rows holding values near FLT_MAX (issue 39, fault 3): the transform's butterflies add up to D
// values, so they used to overflow where the result is finite — H·(FLT_MAX, 0, 0, 0) rotated
// back gave +Inf. Now the rotation of such a row runs scaled by 1/D and every had(...) format
// gives finite output for it; a row whose exact rotation leaves float32 is refused by quantize()
// naming the row and the range that always rotates finitely, and is an overflow for encode().
TEST(Hadamard, RowsNearFloatMaxRotateAndComeBackFinite) {
  constexpr float kMax = std::numeric_limits<float>::max();
  std::vector<float> row = {kMax, 0.0f, 0.0f, 0.0f};
  quant::hadamard_rows(row.data(), 1, 4);
  EXPECT_EQ(row, (std::vector<float>{kMax / 2, kMax / 2, kMax / 2, kMax / 2}));
  quant::hadamard_rows(row.data(), 1, 4);  // 4 · FLT_MAX/2 in the butterflies: scaled, exact
  EXPECT_EQ(row, (std::vector<float>{kMax, 0.0f, 0.0f, 0.0f}));
  std::vector<float> ones(64, kMax);  // H·x = (8·FLT_MAX, 0, ...): beyond float32
  quant::hadamard_rows(ones.data(), 1, 64);
  EXPECT_EQ(ones[0], std::numeric_limits<float>::infinity());
  EXPECT_EQ(ones[1], 0.0f);

  at::Tensor x = testing::randn_kv({1, 2, 32, 64}, 3);  // 64 rows: whole per-channel groups of 32
  x[0][0][1][0] = kMax;  // one value at FLT_MAX, the rest of its row ordinary
  x[0][1][2][5] = -kMax;
  x[0][1][3][7] = 3.0e38f;
  for (const auto& spec : testing::contract_specs()) {
    if (spec.rfind("had(", 0) != 0) continue;
    const auto q = make_quantizer(spec);
    QuantizedTensor t;
    try {
      t = q->quantize(x);
    } catch (const InvalidArgument& e) {
      // Only an inner format without the range may refuse (fp16's ±65504), naming its range.
      EXPECT_THAT(std::string(e.what()), HasSubstr("range")) << spec;
      continue;
    }
    const at::Tensor y = kvcache::dequantize(*q, t);
    EXPECT_TRUE(at::isfinite(y).all().item<bool>()) << spec << ": finite in, finite out";
    at::Tensor into;
    kvcache::dequantize_into(*q, t, into);
    EXPECT_TRUE(at::equal(into, y)) << spec;
    // The stored form: encode() then decode() of the same rows.
    const StoredLayout lay = q->stored_layout(64);
    const at::Tensor xr = x.contiguous();
    const int64_t groups = 64 / lay.group_tokens;
    std::vector<uint8_t> codes(static_cast<size_t>(groups * lay.code_bytes));
    std::vector<float> meta(static_cast<size_t>(2 * groups * lay.meta_count) + 2);
    GroupBuffers out{codes.data(), meta.data(), meta.data() + groups * lay.meta_count + 1};
    const float scale = q->fit_tensor_scale(xr);
    const EncodeStatus st = q->encode(xr.data_ptr<float>(), groups, 64, scale, out);
    if (!st.overflow) {
      std::vector<float> back(64 * 64);
      q->decode(ConstGroupBuffers{codes.data(), meta.data(), meta.data() + groups * lay.meta_count + 1}, groups, 64,
                scale, back.data());
      for (float v : back) ASSERT_TRUE(std::isfinite(v)) << spec << ": decode() of an encode() without overflow";
    }
    if (spec == "had(fp32)") {
      EXPECT_FALSE(st.overflow);
      EXPECT_NEAR(y[0][0][1][0].item<float>() / kMax, 1.0f, 1e-6) << spec;
      EXPECT_NEAR(y[0][1][2][5].item<float>() / kMax, -1.0f, 1e-6) << spec;
    }
  }
  // Every value of a row at FLT_MAX: H·x has 8·FLT_MAX in it. Refused, naming the row and range.
  at::Tensor big = at::zeros({1, 1, 2, 64});
  big[0][0][1].fill_(kMax);
  const std::string err = error_of([&] { (void)make_quantizer("had(int4)")->quantize(big); });
  EXPECT_THAT(err, HasSubstr("row [b, h, t] = [0, 0, 1]"));
  EXPECT_THAT(err, HasSubstr("rotates beyond float32"));
  EXPECT_THAT(err, HasSubstr("FLT_MAX/sqrt(D) = 4.25353e+37"));
  const auto had = make_quantizer("had(int4)");
  const StoredLayout lay = had->stored_layout(64);
  std::vector<uint8_t> codes(static_cast<size_t>(2 * lay.code_bytes));
  std::vector<uint16_t> meta(static_cast<size_t>(4 * lay.meta_count));
  const EncodeStatus st = had->encode(big.contiguous().data_ptr<float>(), 2, 64, 1.0f,
                                      GroupBuffers{codes.data(), meta.data(), meta.data() + 2 * lay.meta_count});
  EXPECT_TRUE(st.overflow);  // the cache stores such a row in its float32 fallback
  EXPECT_FALSE(st.nonfinite);
}

// had(q) stores q's codes of H·x: the stored bytes are those of q applied to the rotated rows,
// and the reconstruction is H·q⁻¹(codes).
TEST(Hadamard, RotatedQuantizerStoresTheRotatedRows) {
  const at::Tensor x = testing::randn_kv({1, 2, 16, 64}, 5);
  at::Tensor hx = x.contiguous().clone();
  quant::hadamard_rows(hx.data_ptr<float>(), 2 * 16, 64);
  const auto had = make_quantizer("had(int4:g32)");
  const auto plain = make_quantizer("int4:g32");
  const QuantizedTensor a = had->quantize(x);
  const QuantizedTensor b = plain->quantize(hx);
  EXPECT_EQ(a.format, "had(int4:g32)");
  EXPECT_TRUE(at::equal(as_tensor(a.codes), as_tensor(b.codes)));
  EXPECT_TRUE(at::equal(as_tensor(a.scales), as_tensor(b.scales)));
  EXPECT_EQ(a.nbytes(), b.nbytes());
  at::Tensor back = kvcache::dequantize(*plain, b).contiguous();
  quant::hadamard_rows(back.data_ptr<float>(), 2 * 16, 64);
  EXPECT_TRUE(at::equal(kvcache::dequantize(*had, a), back));
}

// What the rotation is for (QuaRot): outlier channels spread over the row, so per-token int4
// of outlier-heavy keys loses less. Measured on tests' outlier_kv (channels ×20 and +5, spikes).
TEST(Hadamard, RotationLowersPerTokenErrorOnOutlierChannels) {
  const at::Tensor x = testing::outlier_kv({1, 4, 128, 64}, 9);
  const double plain = reconstruction_error(x, kvcache::dequantize(*make_quantizer("int4"), make_quantizer("int4")->quantize(x))).rel_fro;
  const auto had = make_quantizer("had(int4)");
  const double rotated = reconstruction_error(x, kvcache::dequantize(*had, had->quantize(x))).rel_fro;
  EXPECT_LT(rotated, 0.8 * plain) << "int4 " << plain << " had(int4) " << rotated;
}

// ------------------------------------------------------------ through the cache

// had(fp32) reproduces fp32 to float rounding: attention outputs and what get() returns, keys
// stored post- or pre-RoPE, prefill chunks then decode; attention reads the stored blocks.
TEST(Hadamard, Fp32RotationReproducesFp32Attention) {
  for (const KeyStorage ks : {KeyStorage::kPostRoPE, KeyStorage::kPreRoPE}) {
    for (const char* scheme : {"had(fp32)", "had:k(fp32)"}) {
      auto c_ref = make_config(2, 8, 2, 32, "fp32", "full");
      auto c_had = make_config(2, 8, 2, 32, scheme, "full");
      c_ref.key_storage = c_had.key_storage = ks;
      c_ref.block_tokens = c_had.block_tokens = 5;  // tiles across blocks
      TorchCache ref(c_ref), had(c_had);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(23);
      int64_t pos = 0;
      const std::string where = std::string(scheme) + (ks == KeyStorage::kPreRoPE ? " pre-RoPE" : " post-RoPE");
      for (int64_t n : {11, 6, 1, 1, 1}) {
        for (int64_t l = 0; l < 2; ++l) {
          const at::Tensor k = testing::randn({1, 2, n, 32}, gen), v = testing::randn({1, 2, n, 32}, gen);
          ref.append(l, k, v, positions_range(pos, n));
          had.append(l, k, v, positions_range(pos, n));
          const at::Tensor q = testing::randn({1, 8, n, 32}, gen);
          EXPECT_LT(max_abs_diff(had.attend(l, q, positions_range(pos, n)), ref.attend(l, q, positions_range(pos, n))),
                    1e-5)
              << where << " at " << pos;
          EXPECT_LT(max_abs_diff(had.get(l).k, ref.get(l).k), 1e-5) << where;
          EXPECT_LT(max_abs_diff(had.get(l).v, ref.get(l).v), 1e-5) << where;
          had.check_invariants();
        }
        ref.end_step(n > 1 ? StepKind::kPrefill : StepKind::kDecode);
        had.end_step(n > 1 ? StepKind::kPrefill : StepKind::kDecode);
        pos += n;
      }
      // Same bytes: the rotation stores float32 rows like fp32.
      EXPECT_EQ(had.stats().bytes_resident, ref.stats().bytes_resident) << where;
    }
  }
}

// int3 and rotated schemes run end to end through the cache with eviction.
TEST(CacheScheme, NewSchemesRunThroughTheCacheWithEviction) {
  for (const char* scheme : {"int3", "int3:g8:chan", "kivi:k3:v3:g8:r8", "had(int4)", "had:k(kivi:k2:v2:g8:r8)",
                             "tq:b3", "tq:b2.5:prod", "turboquant:k3:v3", "qjl:m32:o2:g8:v2:r8:mo8:vg16", "polar"}) {
    auto c = make_config(2, 4, 2, 16, scheme, "h2o@24");
    TorchCache m(c);
    testing::run_prefill_then_decode(m, scheme);
    EXPECT_LE(m.stats().tokens_resident, 2 * 2 * 24) << scheme;
    EXPECT_EQ(cache::CacheManagerAccess::scheme(m.core()), make_cache_scheme(scheme)->spec());
  }
}

}  // namespace
}  // namespace kvcache
