// SPDX-License-Identifier: Apache-2.0
// The memory calculator against the quantization deep-dive's numbers and methods b.0.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <vector>
#include <utility>
#include <string>

#include "kvcache/error.h"
#include "kvcache/spec.h"
#include "kvcache/study/memory.h"

using namespace kvcache;
using namespace kvcache::study;

namespace {
const ModelShape kLlama = model_shape_preset("llama-3-8b");
double gb(double bytes) { return bytes / 1e9; }
}  // namespace

TEST(StudyMemory, Llama3DeepDiveNumbers) {
  const auto fp16 = kv_format("fp16", 128);
  EXPECT_EQ(estimate_kv_memory(kLlama, fp16, 1).raw_bytes, 131072.0);  // 128 KiB per token
  EXPECT_EQ(format_gb(estimate_kv_memory(kLlama, fp16, 4096).raw_bytes), "0.54 GB");
  EXPECT_EQ(format_gb(estimate_kv_memory(kLlama, fp16, 131072).raw_bytes), "17.18 GB");
  EXPECT_NEAR(gb(estimate_kv_memory(kLlama, fp16, 131072).raw_bytes), 17.179869184, 1e-9);
  EXPECT_EQ(format_gb(estimate_kv_memory(kLlama, kv_format("int2", 128), 131072).raw_bytes), "2.15 GB");
  EXPECT_EQ(format_gb(estimate_kv_memory(kLlama, kv_format("int4", 128), 32768).raw_bytes), "1.07 GB");
  EXPECT_EQ(format_mib(estimate_kv_memory(kLlama, fp16, 4096).raw_bytes), "512.0 MiB");
  // fp16 has no metadata: raw == effective.
  auto m = estimate_kv_memory(kLlama, fp16, 4096);
  EXPECT_EQ(m.raw_bytes, m.effective_bytes);
  EXPECT_EQ(m.effective_bits_per_value, 16.0);
}

TEST(StudyMemory, Qwen05BMethodsB0) {
  const auto q = model_shape_preset("qwen2.5-0.5b");
  const auto fp16 = kv_format("bf16", 64);
  EXPECT_EQ(estimate_kv_memory(q, fp16, 1).raw_bytes, 12288.0);
  EXPECT_EQ(format_mib(estimate_kv_memory(q, fp16, 4096).raw_bytes), "48.0 MiB");
  EXPECT_EQ(format_mib(estimate_kv_memory(q, fp16, 32768).raw_bytes), "384.0 MiB");
  EXPECT_EQ(estimate_kv_memory(q, kv_format("fp32", 64), 10, 3).raw_bytes, 12288.0 * 2 * 10 * 3);
}

TEST(StudyMemory, EffectiveBitsIncludeMetadataAndResidual) {
  const auto q = model_shape_preset("qwen2.5-0.5b");
  // HF int4 g64: 4.5 bits/value; int2 g64 2.5; q8-like int8 g32 9.0; int4 with one group per
  // 64-value head: 4.5 (the quantizer's own bits_per_value).
  EXPECT_DOUBLE_EQ(estimate_kv_memory(q, kv_format("int4", 64), 4096).effective_bits_per_value, 4.5);
  EXPECT_DOUBLE_EQ(estimate_kv_memory(q, kv_format("int4", 128), 4096).effective_bits_per_value, 4.25);
  EXPECT_DOUBLE_EQ(estimate_kv_memory(q, kv_format("int2:g64", 64), 4096).effective_bits_per_value, 2.5);
  EXPECT_DOUBLE_EQ(estimate_kv_memory(q, kv_format("int8:g32", 64), 4096).effective_bits_per_value, 9.0);
  EXPECT_DOUBLE_EQ(estimate_kv_memory(q, kv_format("int4", 128), 4096).raw_bits_per_value, 4.0);
  // KIVI-2 g32 r128 (methods b.0): T = 4096 -> 3.41 bpv (4.7x vs fp16); T = 512 -> 6.25 bpv (2.56x).
  const auto kivi2 = kv_format("kivi:k2:v2:g32:r128", 64);
  EXPECT_NEAR(estimate_kv_memory(q, kivi2, 4096).effective_bits_per_value, 3.40625, 1e-12);
  EXPECT_NEAR(16.0 / estimate_kv_memory(q, kivi2, 4096).effective_bits_per_value, 4.70, 0.01);
  EXPECT_NEAR(estimate_kv_memory(q, kivi2, 512).effective_bits_per_value, 6.25, 1e-12);
  EXPECT_NEAR(16.0 / estimate_kv_memory(q, kivi2, 512).effective_bits_per_value, 2.56, 0.01);
  EXPECT_DOUBLE_EQ(estimate_kv_memory(q, kivi2, 512).raw_bits_per_value, 2.0);
  // fewer tokens than the residual: everything fp16
  EXPECT_DOUBLE_EQ(estimate_kv_memory(q, kivi2, 100).effective_bits_per_value, 16.0);
  EXPECT_DOUBLE_EQ(kv_format("kivi:k4:v4", 64).key_bits, 5.0);  // KIVI-4 g32: 5.0 bpv
  // fp8: 8 bits; the scaled variant adds one fp32 scale per layer for K and V
  auto f8 = estimate_kv_memory(q, kv_format("fp8:e5m2", 64), 1000);
  EXPECT_EQ(f8.effective_bytes, f8.raw_bytes);
  EXPECT_EQ(f8.raw_bits_per_value, 8.0);
  auto f8s = estimate_kv_memory(q, kv_format("fp8:scaled", 64), 1000);
  EXPECT_EQ(f8s.effective_bytes - f8s.raw_bytes, 24 * 2 * 4);
  // per-channel groups (KIVI-style keys) are measured on a multiple of their group size
  const auto chan = kv_format("int2:g48:chan", 64);
  EXPECT_DOUBLE_EQ(chan.key_raw_bits, 2.0);
  EXPECT_DOUBLE_EQ(chan.key_bits, 2.0 + 32.0 / 48);
  EXPECT_EQ(kv_format("fp8", 64).spec, "fp8:e4m3");  // the quantizer's canonical spec
  // GEAR at D = 64 with g32 (docs/quantizers.md): 4 bits/value per stream (base 3 + factors 1),
  // an fp16 buffer of nb = 64 tokens.
  const KvFormat gear = kv_format("gear:g32", 64);
  EXPECT_EQ(gear.spec, "gear:b2:g32:s0.02:r2:loop3:nb64");
  EXPECT_DOUBLE_EQ(gear.key_bits, 4.0);
  EXPECT_DOUBLE_EQ(gear.value_bits, 4.0);
  EXPECT_EQ(gear.key_residual_tokens, 64);
  EXPECT_EQ(gear.value_residual_tokens, 64);
}

TEST(StudyMemory, BadSpecsAndArguments) {
  EXPECT_THROW(kv_format("int9", 64), InvalidArgument);
  EXPECT_THROW(kv_format("int4:q3", 64), InvalidArgument);
  EXPECT_THROW(kv_format("fp8:e3m4", 64), InvalidArgument);
  EXPECT_THROW(kv_format("fp16:g4", 64), InvalidArgument);
  EXPECT_THROW(kv_format("kivi:k9", 64), InvalidArgument);
  EXPECT_THROW(kv_format("gear9", 64), InvalidArgument);
  EXPECT_THROW(kv_format("gear:g128", 64), InvalidArgument);  // value groups of 128 channels, head_dim 64
  EXPECT_THROW(estimate_kv_memory(kLlama, kv_format("fp16", 128), -1), InvalidArgument);
  EXPECT_THROW(estimate_kv_memory(kLlama, kv_format("fp16", 128), 1, 0), InvalidArgument);
  EXPECT_THROW(model_shape_preset("gpt-5"), InvalidArgument);
}

// Contexts and batches up to the accepted limits compute without overflow (an int64 product
// once printed a negative ratio); beyond them, an error naming the value and the range.
TEST(StudyMemory, HugeSizesAreInRangeOrRejected) {
  const KvFormat fp16 = kv_format("fp16", 128);
  const auto m = estimate_kv_memory(kLlama, fp16, kMaxTokens, kMaxBatch);
  EXPECT_DOUBLE_EQ(m.raw_bytes, 131072.0 * 1e9 * 1e6);
  const std::string md = memory_table_markdown(kLlama, {fp16}, {kMaxTokens}, kMaxBatch);
  EXPECT_NE(md.find("| 16.000 | 1.00x |"), std::string::npos) << md;
  auto message = [&](int64_t tokens, int64_t batch) {
    try {
      (void)estimate_kv_memory(kLlama, fp16, tokens, batch);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(INT64_MAX, 4), "context length 9223372036854775807 tokens is out of range [0, 1000000000]");
  EXPECT_EQ(message(4096, INT64_MAX), "batch 9223372036854775807 is out of range [1, 1000000]");
  // A config.json with a field beyond any model (or beyond int64) is rejected by name.
  const std::string path = ::testing::TempDir() + "/study_memory_huge_config.json";
  // (JSON keeps an integer beyond uint64 as a double: it prints back as 1e+20.)
  for (const auto& [layers, shown] : std::vector<std::pair<std::string, std::string>>{
           {"99999999999999999999", "1e+20"}, {"2000000", "2000000"}, {"0", "0"}, {"-3", "-3"}}) {
    std::ofstream(path) << "{\"num_hidden_layers\": " << layers
                        << ", \"num_attention_heads\": 8, \"hidden_size\": 512}";
    try {
      (void)model_shape_from_config(path);
      ADD_FAILURE() << layers;
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()),
                "config '" + path + "': num_hidden_layers = " + shown + " is out of range [1, 1000000]");
    }
  }
}

TEST(StudyMemory, ReadsConfigJson) {
  const std::string shared = std::string(KVCACHE_SOURCE_DIR) + "/../shared/data/models";
  if (!std::ifstream(shared + "/qwen2.5-0.5b-instruct/config.json").good()) {
    GTEST_SKIP() << "../shared/data/models not found next to the repository";
  }
  const auto q = resolve_model_shape(shared + "/qwen2.5-0.5b-instruct/config.json");
  EXPECT_EQ(q.num_layers, 24);
  EXPECT_EQ(q.num_kv_heads, 2);
  EXPECT_EQ(q.head_dim, 64);  // hidden_size 896 / 14 heads
  EXPECT_EQ(estimate_kv_memory(q, kv_format("fp16", 128), 1).raw_bytes, 12288.0);
  const auto ts = resolve_model_shape(shared + "/tinystories-656k");  // a directory
  EXPECT_EQ(ts.num_layers, 2);
  EXPECT_EQ(ts.num_kv_heads, 4);
  EXPECT_EQ(ts.head_dim, 16);
  EXPECT_THROW(resolve_model_shape(shared + "/no-such-model/config.json"), InvalidArgument);
}

TEST(StudyMemory, MarkdownTable) {
  auto md = memory_table_markdown(kLlama, {kv_format("fp16", 128), kv_format("int2:g64", 128)}, {131072}, 1);
  EXPECT_NE(md.find("fp16 131072 B/token (128 KiB)"), std::string::npos) << md;
  EXPECT_NE(md.find("| fp16 | 131072 | 131072 | 17.18 GB | 16384.0 MiB |"), std::string::npos) << md;
  EXPECT_NE(md.find("| int2:g64 | 131072 | 16384 | 2.15 GB | 2048.0 MiB | 2.68 GB | 2560.0 MiB | 2.500 | 6.40x |"), std::string::npos) << md;
}
