// SPDX-License-Identifier: Apache-2.0
// The per-layer scheme layers(<scheme>*<n>;...) (kvcache/cache_scheme.h): canonical forms and
// round trips, errors in the user's words (a layer list that does not cover the model), the
// streams each layer resolves to, the bytes the cache stores per layer, and the study's
// memory format and reconstruction error of a per-layer scheme.
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cache/cache_manager_access.h"
#include "cache_test_util.h"
#include "kvcache/cache_manager.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/registry.h"
#include "kvcache/study/arm.h"
#include "kvcache/study/memory.h"
#include "kvcache/study/metrics.h"
#include "kvcache/study/quant_error.h"
#include "kvcache/torch.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;
using testing::make_config;
using testing::positions_range;

using testing::error_of;

TEST(LayerScheme, CanonicalFormsRoundTrip) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"layers(int4*2;int8*2)", "layers(int4*2;int8*2)"},
      {"layers(int4:tok*1;int4*3)", "layers(int4*4)"},  // equal canonical runs merge, *1 dropped
      {"layers(int8;int8;int4)", "layers(int8*2;int4)"},
      {"layers(kivi:k8:v4*4;kivi:r128:k4:v2*20)", "layers(kivi:k8:v4:g32:r128*4;kivi:k4:v2:g32:r128*20)"},
      {"layers(had(int4)*2;fp16)", "layers(had(int4)*2;fp16)"},
      {"layers(had:k(kivi:k4:v4)*1;int3:chan:g32*2)", "layers(had:k(kivi:k4:v4:g32:r128);int3:g32:chan*2)"},
      {"had(layers(int4;int8*3))", "had(layers(int4;int8*3))"},
      {"layers(fp32*007)", "layers(fp32*7)"},
  };
  for (const auto& [in, canonical] : cases) {
    const auto s = make_cache_scheme(in);
    EXPECT_EQ(s->spec(), canonical) << in;
    EXPECT_EQ(make_cache_scheme(s->spec())->spec(), canonical) << in;
  }
  EXPECT_EQ(layers_scheme_spec({"int8", "int8:g0", "int4", "int8"}), "layers(int8*2;int4;int8)");  // g0: the default
  EXPECT_THAT(error_of([] { layers_scheme_spec({"int8", "bogus"}); }), HasSubstr("run 2 'bogus'"));
  EXPECT_EQ(spec_kind("layers(int4*2)"), SpecKind::kCacheScheme);
  // It reads well in an arm: the scheme side of '+'.
  const study::Arm a = study::parse_arm("layers(kivi:k8:v4:g32:r128*4;kivi:k4:v2:g32:r128*20)+full");
  EXPECT_EQ(a.scheme, "layers(kivi:k8:v4:g32:r128*4;kivi:k4:v2:g32:r128*20)");
  EXPECT_EQ(a.policy, "full");
  EXPECT_EQ(study::parse_arm_list("layers(int8;int4)+full,int4+h2o@50%").size(), 2u);
}

TEST(LayerScheme, BadSpecsNameTheUsersText) {
  EXPECT_THAT(error_of([] { make_cache_scheme("layers"); }), HasSubstr("wraps another spec: write layers(<spec>)"));
  EXPECT_THAT(error_of([] { make_cache_scheme("layers(int4;;int8)"); }),
              HasSubstr("cache scheme 'layers(int4;;int8)': run 2 is empty"));
  EXPECT_THAT(error_of([] { make_cache_scheme("layers(int4*0)"); }),
              HasSubstr("cache scheme 'layers(int4*0)': run 1 'int4*0': layer count = 0 is out of range [1, 1000000]"));
  EXPECT_THAT(error_of([] { make_cache_scheme("layers(int4*two)"); }),
              HasSubstr("run 1 'int4*two': layer count = 'two' is not an integer"));
  EXPECT_THAT(error_of([] { make_cache_scheme("layers(int4;*3)"); }), HasSubstr("run 2 '*3' names no scheme before '*'"));
  EXPECT_THAT(error_of([] { make_cache_scheme("layers(int4;int5*3)"); }),
              HasSubstr("cache scheme 'layers(int4;int5*3)': run 2 'int5*3': unknown cache scheme 'int5'"));
  EXPECT_THAT(error_of([] { make_cache_scheme("layers(int4;h2o@50%)"); }), HasSubstr("'h2o' is an eviction policy"));
  EXPECT_THAT(error_of([] { make_cache_scheme("layers(layers(int4)*2)"); }),
              HasSubstr("a run cannot itself be per-layer"));
  EXPECT_THAT(error_of([] { make_cache_scheme("layers(kivi:k8:v4:g32:r100)"); }),
              HasSubstr("run 1 'kivi:k8:v4:g32:r100': cache scheme 'kivi:k8:v4:g32:r100': residual r=100"));
  EXPECT_THAT(error_of([] { make_cache_scheme("layers(int4)x"); }), HasSubstr("unexpected 'x'"));
}

TEST(LayerScheme, ALayerListThatDoesNotCoverTheModelNamesExpectedAndFound) {
  const auto s = make_cache_scheme("layers(int4*3;int8)");
  EXPECT_EQ(error_of([&] { s->streams(CacheGeometry{5, 2, 64}, 0, 0); }),
            "cache scheme 'layers(int4*3;int8)': its runs cover 4 layers (3 + 1), the model has 5 (expected counts "
            "summing to 5)");
  EXPECT_THAT(error_of([&] { s->streams(CacheGeometry{3, 2, 64}, 0, 0); }),
              HasSubstr("its runs cover 4 layers (3 + 1), the model has 3"));
  EXPECT_THAT(error_of([&] { make_cache_scheme("layers(int4*1)")->streams(CacheGeometry{2, 1, 64}, 0, 0); }),
              HasSubstr("its runs cover 1 layer (1), the model has 2"));
  // CacheConfig::validate() resolves every layer: a config that validates runs.
  EXPECT_THAT(error_of([] { make_config(5, 2, 2, 64, "layers(int4*3;int8)", "full").validate(); }),
              HasSubstr("its runs cover 4 layers (3 + 1), the model has 5"));
  EXPECT_NO_THROW(make_config(4, 2, 2, 64, "layers(int4*3;int8)", "full").validate());
  // A run's own geometry checks still apply, in its words.
  EXPECT_THAT(error_of([] { make_config(2, 2, 2, 48, "layers(int4;had(int4))", "full").validate(); }),
              HasSubstr("cache scheme 'had(int4)': the Hadamard rotation needs head_dim a power of two"));
}

TEST(LayerScheme, EachLayerResolvesItsRunsStreams) {
  const CacheGeometry g{4, 2, 64};
  const auto s = make_cache_scheme("layers(kivi:k8:v4:g32:r128*2;int4:g32;had:k(kivi:k4:v2))");
  for (int64_t l : {0, 1}) {
    const LayerStreams st = s->streams(g, l, 0);
    EXPECT_EQ(st.key.quantizer->spec(), "int8:g32:chan") << l;
    EXPECT_EQ(st.value.quantizer->spec(), "int4:g32") << l;
    EXPECT_EQ(st.key.residual, 128);
    EXPECT_EQ(st.key.flush, ResidualFlush::kBlock);
    EXPECT_EQ(st.value.flush, ResidualFlush::kSliding);
  }
  const LayerStreams t = s->streams(g, 2, 0);
  EXPECT_EQ(t.key.quantizer->spec(), "int4:g32");
  EXPECT_EQ(t.value.quantizer->spec(), "int4:g32");
  EXPECT_EQ(t.key.residual, 0);
  const LayerStreams u = s->streams(g, 3, 0);
  EXPECT_EQ(u.key.quantizer->spec(), "had(int4:g32:chan)");
  EXPECT_EQ(u.value.quantizer->spec(), "int2:g32");
  EXPECT_THAT(error_of([&] { s->streams(g, 4, 0); }), HasSubstr("layer 4 out of range [0, 4)"));
  // The residual_length of the config reaches each run (KIVI takes 0 or its own r).
  EXPECT_THAT(error_of([&] { s->streams(g, 0, 64); }), HasSubstr("CacheConfig::residual_length must be 0 or 128"));
  EXPECT_EQ(make_cache_scheme("layers(int4;fp16)")->streams(CacheGeometry{2, 1, 64}, 1, 7).key.residual, 7);
  EXPECT_EQ(s->required_key_storage(), std::nullopt);
}

/// Stored bytes of `scheme` after `tokens` random tokens through every layer of a cache.
CacheStats fill(const std::string& scheme, int64_t layers, int64_t tokens) {
  TorchCache m(make_config(layers, 4, 2, 32, scheme, "full"));
  m.reset(tokens);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  for (int64_t l = 0; l < layers; ++l) {
    m.append(l, testing::randn({1, 2, tokens, 32}, gen), testing::randn({1, 2, tokens, 32}, gen),
             positions_range(0, tokens));
  }
  m.end_step(StepKind::kPrefillEnd);
  m.check_invariants();
  return m.stats();
}

// Each layer stores its own format: the bytes of layers(int8;int4;fp16) are the per-layer
// thirds of the uniform caches' bytes (int8 / int4 / fp16 in every layer).
TEST(LayerScheme, EachLayerStoresTheBytesOfItsOwnFormat) {
  const int64_t T = 96;
  const CacheStats mixed = fill("layers(int8;int4;fp16)", 3, T);
  const CacheStats i8 = fill("int8", 3, T);
  const CacheStats i4 = fill("int4", 3, T);
  const CacheStats f16 = fill("fp16", 3, T);
  ASSERT_EQ(i8.bytes_resident % 3, 0);
  EXPECT_EQ(mixed.bytes_resident, i8.bytes_resident / 3 + i4.bytes_resident / 3 + f16.bytes_resident / 3);
  EXPECT_EQ(mixed.bytes_reserved, i8.bytes_reserved / 3 + i4.bytes_reserved / 3 + f16.bytes_reserved / 3);
  // Hand-checked: fp16 stores 2 B per value; int4 with g=32 (D = 32: one group per token row)
  // 16 B codes + fp16 scale and zero = 20 B per row; int8 36 B: K and V, 2 KV heads, T tokens.
  EXPECT_EQ(f16.bytes_resident, 3 * 2 * 2 * T * 64);
  EXPECT_EQ(i4.bytes_resident, 3 * 2 * 2 * T * 20);
  EXPECT_EQ(i8.bytes_resident, 3 * 2 * 2 * T * 36);
  EXPECT_EQ(mixed.bytes_resident, 2 * 2 * T * (36 + 20 + 64));
  EXPECT_EQ(mixed.tokens_resident, 3 * T);
}

TEST(LayerScheme, RunsThroughTheCacheWithEvictionAndAttention) {
  const std::string scheme = "layers(kivi:k4:v2:g8:r8;int3;had(int4))";
  auto c = make_config(3, 4, 2, 16, scheme, "h2o@24");
  TorchCache m(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(31);
  int64_t pos = 0;
  for (int64_t n : {30, 1, 1, 1, 1, 1, 1}) {
    for (int64_t l = 0; l < 3; ++l) {
      m.append(l, testing::randn({1, 2, n, 16}, gen), testing::randn({1, 2, n, 16}, gen), positions_range(pos, n));
      const at::Tensor out = m.attend(l, testing::randn({1, 4, n, 16}, gen), positions_range(pos, n));
      EXPECT_TRUE(at::isfinite(out).all().item<bool>());
    }
    m.end_step(n > 1 ? StepKind::kPrefillEnd : StepKind::kDecode);
    m.check_invariants();
    pos += n;
  }
  EXPECT_LE(m.stats().tokens_resident, 3 * 24);
  EXPECT_EQ(cache::CacheManagerAccess::scheme(m.core()), make_cache_scheme(scheme)->spec());
}

// The study's memory format: the mean over layers of each stream's bits.
TEST(LayerScheme, MemoryFormatAveragesTheLayers) {
  const study::KvFormat f = study::kv_format("layers(int8;int4*3)", 64, 4);
  EXPECT_EQ(f.spec, "layers(int8;int4*3)");
  EXPECT_DOUBLE_EQ(f.key_raw_bits, (8.0 + 3 * 4.0) / 4);
  EXPECT_DOUBLE_EQ(f.key_bits, (make_quantizer("int8")->bits_per_value(64) + 3 * make_quantizer("int4")->bits_per_value(64)) / 4);
  EXPECT_DOUBLE_EQ(f.value_bits, f.key_bits);
  // One format in every layer: the same figures as one layer.
  const study::KvFormat one = study::kv_format("int4", 64);
  const study::KvFormat all = study::kv_format("int4", 64, 24);
  EXPECT_EQ(all.key_bits, one.key_bits);
  EXPECT_EQ(all.key_raw_bits, one.key_raw_bits);
  EXPECT_THAT(error_of([] { study::kv_format("layers(int8;int4*3)", 64, 5); }),
              HasSubstr("its runs cover 4 layers (1 + 3), the model has 5"));
  EXPECT_THAT(error_of([] { study::kv_format("layers(kivi:k8:v4:g32:r128;int4)", 64, 2); }),
              HasSubstr("layer 1 keeps a residual of 0/0 K/V tokens, layer 0 128/128"));
}

// Reconstruction error of a per-layer scheme: each sample through its own layer's quantizers.
TEST(LayerScheme, ReconstructionUsesEachSamplesLayer) {
  std::vector<study::QkvSample> samples;
  for (int64_t l = 0; l < 2; ++l) {
    samples.push_back(study::synthetic_qkv(7 + static_cast<uint64_t>(l), 4, 2, 64, 32));
    samples.back().layer = l;
  }
  const auto mixed = study::measure_reconstruction("layers(int8;int2)", samples);
  EXPECT_DOUBLE_EQ(mixed.bits_per_value,
                   0.5 * (make_quantizer("int8")->bits_per_value(32) + make_quantizer("int2")->bits_per_value(32)));
  const auto i8 = study::measure_reconstruction("int8", {samples[0]});
  const auto i2 = study::measure_reconstruction("int2", {samples[1]});
  EXPECT_GT(mixed.key_max_abs, i8.key_max_abs);
  EXPECT_DOUBLE_EQ(mixed.key_max_abs, std::max(i8.key_max_abs, i2.key_max_abs));
  // Samples of some layers only: the model's layer count resolves the scheme.
  EXPECT_NO_THROW(study::measure_reconstruction("layers(int8;int2*3)", samples, 4));
  EXPECT_THAT(error_of([&] { study::measure_reconstruction("layers(int8;int2*3)", samples); }),
              HasSubstr("its runs cover 4 layers (1 + 3), the model has 2"));
  EXPECT_THAT(error_of([&] { study::measure_reconstruction("int4", samples, 1); }),
              HasSubstr("a sample of layer 1 in a model of 1 layers"));
}

}  // namespace
}  // namespace kvcache
