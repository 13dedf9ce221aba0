// SPDX-License-Identifier: Apache-2.0
// The reconstruction-error table through quantizer.h, on synthetic K/V with outlier channels.
#include <gtest/gtest.h>

#include <cmath>

#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/study/quant_error.h"
#include "kvcache/torch.h"

using namespace kvcache;
using namespace kvcache::study;

namespace {
std::vector<QkvSample> samples() { return {synthetic_qkv(1, 4, 2, 96, 64), synthetic_qkv(2, 4, 2, 96, 64)}; }
}  // namespace

TEST(StudyQuantError, LosslessAndOrderedByBits) {
  const auto s = samples();
  const auto fp32 = measure_reconstruction("fp32", s);
  EXPECT_EQ(fp32.key_rel_err, 0);
  EXPECT_EQ(fp32.value_rel_err, 0);
  EXPECT_EQ(fp32.bits_per_value, 32);
  const auto i8 = measure_reconstruction("int8", s);
  const auto i4 = measure_reconstruction("int4", s);
  const auto i2 = measure_reconstruction("int2", s);
  EXPECT_LT(i8.key_rel_err, i4.key_rel_err);
  EXPECT_LT(i4.key_rel_err, i2.key_rel_err);
  EXPECT_LT(i4.value_rel_err, i2.value_rel_err);
  EXPECT_DOUBLE_EQ(i4.bits_per_value, 4.5);  // one fp16 scale + zero per 64-value head
  EXPECT_GT(measure_reconstruction("fp16", s).key_rel_err, 0);
  EXPECT_LT(measure_reconstruction("fp16", s).key_rel_err, 1e-3);
}

TEST(StudyQuantError, PooledErrorMatchesDirectMeasurement) {
  // One sample: the pooled error is reconstruction_error's own rel_fro.
  const std::vector<QkvSample> one = {synthetic_qkv(3, 2, 1, 64, 32)};
  const auto q = make_quantizer("int4:g32");
  EXPECT_NEAR(measure_reconstruction("int4:g32", one).key_rel_err, reconstruction_error(*q, one[0].k).rel_fro, 1e-12);
  EXPECT_NEAR(measure_reconstruction("int4:g32", one).value_max_abs, reconstruction_error(*q, one[0].v).max_abs, 1e-12);
}

TEST(StudyQuantError, PerChannelKeysWinOnOutlierChannels) {
  const auto s = samples();  // 96 tokens: per-channel g32 uses all 3 groups
  const auto tok = measure_reconstruction("int2:g32", s);
  const auto chan = measure_reconstruction("int2:g32:chan", s);
  EXPECT_LT(chan.key_rel_err, tok.key_rel_err);
  const auto kivi = measure_reconstruction("kivi:k2:v2:g32:r128", s);
  EXPECT_DOUBLE_EQ(kivi.key_rel_err, chan.key_rel_err);    // keys per channel
  EXPECT_DOUBLE_EQ(kivi.value_rel_err, tok.value_rel_err); // values per token
  EXPECT_DOUBLE_EQ(kivi.bits_per_value, 3.0);
  // Tokens cut to a whole number of groups; fewer than one group is an error.
  EXPECT_NO_THROW(measure_reconstruction("int4:g64:chan", s));
  EXPECT_THROW(measure_reconstruction("int4:g128:chan", s), InvalidArgument);
  EXPECT_THROW(measure_reconstruction("int5", s), InvalidArgument);
  EXPECT_THROW(measure_reconstruction("int4", {}), InvalidArgument);
}

TEST(StudyQuantError, AttentionErrorOfTheSchemeIsTheReferenceOverItsReconstruction) {
  const auto s = samples();
  const auto fp32 = measure_reconstruction("fp32", s);
  EXPECT_EQ(fp32.attn_out_rel_err, 0);
  EXPECT_EQ(fp32.attn_prob_rel_err, 0);
  // The mean over samples of attention_error over the quantize-dequantize round trip, with the
  // tokens cut to whole per-channel groups (96 tokens, g64: the first 64).
  for (const std::string spec : {"int4", "int2:g32", "kivi:k2:v2:g32:r128", "int4:g64:chan"}) {
    const auto r = measure_reconstruction(spec, s);
    const auto scheme = make_cache_scheme(spec);
    const LayerStreams st = scheme->streams(CacheGeometry{1, 2, 64}, 0, 0);
    const int64_t t = spec == "int4:g64:chan" ? 64 : 96;
    double out = 0, prob = 0;
    for (const auto& x : s) {
      const auto k = x.k.narrow(2, 0, t).contiguous();
      const auto v = x.v.narrow(2, 0, t).contiguous();
      const auto e = attention_error(x.q.narrow(2, 0, t), k, v,
                                     kvcache::dequantize(*st.key.quantizer, st.key.quantizer->quantize(k)),
                                     kvcache::dequantize(*st.value.quantizer, st.value.quantizer->quantize(v)), true);
      out += e.out_rel_fro / 2;
      prob += e.prob_rel_fro / 2;
    }
    EXPECT_DOUBLE_EQ(r.attn_out_rel_err, out) << spec;
    EXPECT_DOUBLE_EQ(r.attn_prob_rel_err, prob) << spec;
    EXPECT_GT(r.attn_out_rel_err, 0) << spec;
  }
  // Fewer bits, more attention error; per-channel keys beat per-token keys on outlier channels.
  EXPECT_LT(measure_reconstruction("int8", s).attn_out_rel_err, measure_reconstruction("int4", s).attn_out_rel_err);
  EXPECT_LT(measure_reconstruction("int2:g32:chan", s).attn_prob_rel_err,
            measure_reconstruction("int2:g32", s).attn_prob_rel_err);
  // Queries that are not one per token: not measured.
  auto last = s;
  for (auto& x : last) x.q = x.q.narrow(2, 95, 1);
  EXPECT_TRUE(std::isnan(measure_reconstruction("int4", last).attn_out_rel_err));
  EXPECT_EQ(measure_reconstruction("int4", last).key_rel_err, measure_reconstruction("int4", s).key_rel_err);
}

TEST(StudyQuantError, Tables) {
  const auto s = samples();
  const auto specs = default_quant_error_specs();
  EXPECT_EQ(specs.front(), "fp32");
  EXPECT_EQ(specs.back(), "kivi:k2:v2:g32:r128");
  // A spec that cannot be measured is an error (never a table cell), or listed as skipped.
  EXPECT_THROW((void)reconstruction_table_markdown({"fp32", "int4:g128:chan"}, s), InvalidArgument);
  EXPECT_THROW((void)reconstruction_table_markdown({"int5"}, s), InvalidArgument);
  std::vector<std::string> skipped;
  const std::string md = reconstruction_table_markdown({"fp32", "int4:g128:chan"}, s, &skipped);
  EXPECT_NE(md.find("| fp32 | 32.00 | 0.0000 | 0.0000 | 0.0000 | 0.0000 |"), std::string::npos) << md;
  EXPECT_EQ(md.find("int4:g128:chan"), std::string::npos) << md;
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0].rfind("int4:g128:chan: quantizer 'int4:g128:chan' groups 128 tokens per channel", 0), 0u)
      << skipped[0];
  const std::string att = attention_table_markdown(s, {2, 4}, 32);
  EXPECT_NE(att.find("| per-channel K + per-token V (KIVI) |"), std::string::npos) << att;
  EXPECT_NE(att.find("2-bit output | 2-bit probs | 4-bit output"), std::string::npos) << att;
}
