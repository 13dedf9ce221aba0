// SPDX-License-Identifier: Apache-2.0
// kvcache::core alone: built without LibTorch on its include or link path (tests/CMakeLists.txt)
// and checked, in the process itself, to have loaded no libtorch / libc10. Covers the core's
// views, the quantizers (hand-checked codes, every registered format's round trip, stored
// layouts and buffer reuse), the cache (attention over the stored blocks against a plain
// double-precision reference, the batched form, counters and all-or-nothing calls), the
// policies (hand-checked plans, attention-fed H2O) and the engine adapters, against the same
// references the ATen suite uses: the worked numbers of methods.md and plain softmax attention.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kvcache/attention.h"
#include "kvcache/buffer.h"
#include "kvcache/cache_debug.h"
#include "kvcache/cache_manager.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/external_attention.h"
#include "kvcache/multi_sequence_cache.h"
#include "kvcache/quantizer.h"
#include "kvcache/registry.h"
#include "kvcache/view.h"

namespace kvcache {
namespace {

std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

template <class E = InvalidArgument>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "no error";
}

// ---------------------------------------------------------------- the process

TEST(CoreOnly, NoLibTorchIsLoaded) {
  std::ifstream maps("/proc/self/maps");
  ASSERT_TRUE(maps.good());
  std::string line;
  bool core = false;
  while (std::getline(maps, line)) {
    EXPECT_EQ(line.find("libtorch"), std::string::npos) << line;
    EXPECT_EQ(line.find("libc10"), std::string::npos) << line;
    core = core || line.find("libkvcache_core") != std::string::npos;
  }
  EXPECT_TRUE(core) << "libkvcache_core is not mapped";
}

// ---------------------------------------------------------------- views

TEST(CoreViews, ContiguousStridesShapesAndNames) {
  float x[24] = {};
  const TensorView v(x, {2, 3, 4});
  EXPECT_EQ(v.rank, 3);
  EXPECT_EQ(v.strides[0], 12);
  EXPECT_EQ(v.strides[2], 1);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(shape_str(v), "[2, 3, 4] Float");  // dtypes named as PyTorch prints them
  EXPECT_EQ(shape_str(TensorView()), "undefined");
  TensorView t = v;  // a transposed view of the last two dims
  std::swap(t.shape[1], t.shape[2]);
  std::swap(t.strides[1], t.strides[2]);
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2);
  EXPECT_STREQ(to_string(DType::kInt64), "Long");
  EXPECT_STREQ(to_string(DType::kFloat16), "Half");
  EXPECT_EQ(error_of([] { (void)TensorView(static_cast<const float*>(nullptr), {1, 2, 3, 4, 5}); }),
            "a view has at most 4 dimensions, got 5");
}

TEST(CoreViews, BufferEnsureReusesAndAvoidsTheInput) {
  Buffer b(DType::kFloat32, {2, 3});
  void* p = b.data();
  EXPECT_TRUE(b.ensure(DType::kFloat32, {2, 3}));
  EXPECT_EQ(b.data(), p);
  EXPECT_FALSE(b.ensure(DType::kFloat32, {2, 3}, p, static_cast<char*>(p) + 4));  // overlaps: a new block
  EXPECT_NE(b.data(), p);
  EXPECT_EQ(b.nbytes(), 24);
  Buffer c = b;
  EXPECT_TRUE(c == b);
  c.data_as<float>()[0] = 1.5f;
  EXPECT_FALSE(c == b);
  EXPECT_EQ(Buffer().nbytes(), 0);
}

// ---------------------------------------------------------------- quantizers

const std::vector<float> kWorked = {0.10f, -0.50f, 0.32f, 1.20f, -0.05f, 0.77f, -0.31f, 0.48f};

// methods.md b.1: int4, g = 8 — the same numbers as tests/quant_int_test.cpp.
TEST(CoreQuantizers, Int4WorkedExample) {
  auto q = make_quantizer("int4:g8");
  const QuantizedTensor qt = q->quantize(TensorView(kWorked.data(), {1, 1, 1, 8}));
  ASSERT_EQ(qt.codes.dtype(), DType::kUInt8);
  const auto* c = qt.codes.data_as<uint8_t>();
  EXPECT_EQ(std::vector<int>(c, c + 4), (std::vector<int>{0x45, 0xB0, 0x27, 0x9F}));
  ASSERT_EQ(qt.scales.dtype(), DType::kFloat16);
  float y[8];
  q->dequantize_into(qt, MutableTensorView(y, {1, 1, 1, 8}));
  const std::vector<float> expect = {0.06671f, -0.5f, 0.29340f, 1.20013f, -0.04663f, 0.74677f, -0.27332f, 0.52008f};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(y[i], expect[static_cast<size_t>(i)], 1e-5) << i;
  EXPECT_FLOAT_EQ(y[0], 5 * 0.11334228515625f - 0.5f);
  EXPECT_EQ(qt.nbytes(), 4 + 2 + 2);
}

// Every format: the round trip within its bound (half a step of a b-bit group, relative to the
// group's range; the float formats' own rounding), nbytes() = bits_per_value × values / 8 for
// the per-group formats, stored layout codec == quantize byte for byte, and a strided fp16 view
// quantizes as its contiguous float32 copy.
TEST(CoreQuantizers, EveryRegisteredFormatRoundTrips) {
  const std::vector<std::string> specs = {"fp32",     "fp16",          "bf16",         "fp8:e4m3", "fp8:e5m2",
                                          "int8",     "int4",          "int3",         "int2",     "int4:g32",
                                          "int2:g32:chan", "int8:g32:chan", "had(int4)", "fp8:e4m3:scaled"};
  const int64_t t = 32, d = 64;
  const std::vector<float> x = randn(static_cast<size_t>(2 * t * d), 7);
  for (const std::string& spec : specs) {
    auto q = make_quantizer(spec);
    const QuantizedTensor qt = q->quantize(TensorView(x.data(), {1, 2, t, d}));
    std::vector<float> y(x.size());
    q->dequantize_into(qt, MutableTensorView(y.data(), {1, 2, t, d}));
    double err = 0, norm = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      err += (x[i] - y[i]) * (x[i] - y[i]);
      norm += x[i] * x[i];
    }
    const double rel = std::sqrt(err / norm);
    const double bits = q->bits_per_value(d);
    // Relative Frobenius error of a uniform b-bit quantizer of N(0, 1) data: about 2^-b · 1.5
    // (range ≈ 6σ over 2^b − 1 steps); the float formats far below.
    const double bound = bits >= 16 ? 1e-2 : bits >= 8 ? 0.07 : 3.0 / static_cast<double>((1 << static_cast<int>(bits)) - 1);
    EXPECT_LE(rel, bound) << spec;
    if (spec.rfind("int", 0) == 0) {
      EXPECT_EQ(qt.nbytes() * 8, static_cast<int64_t>(std::llround(bits * static_cast<double>(x.size())))) << spec;
    }
    // The block codec of one head: the same bytes as quantize() for per-token formats.
    const StoredLayout l = q->stored_layout(d);
    if (l.token_readable() && !l.tensor_scale && spec.rfind("had", 0) != 0) {
      std::vector<uint8_t> codes(static_cast<size_t>(t * l.code_bytes));
      std::vector<uint8_t> meta(static_cast<size_t>(t * l.meta_bytes() + 1));
      GroupBuffers out;
      out.codes = codes.data();
      out.scales = l.meta_count > 0 ? meta.data() : nullptr;
      out.zeros = l.has_zeros ? meta.data() + t * l.meta_count * dtype_size(l.meta_dtype) : nullptr;
      const EncodeStatus st = q->encode(x.data(), t, d, 1.0f, out);
      EXPECT_FALSE(st.overflow || st.nonfinite) << spec;
      EXPECT_EQ(std::memcmp(codes.data(), qt.codes.data(), codes.size()), 0) << spec;
    }
    // A strided fp16 view (heads interleaved) quantizes as the contiguous copy of its values.
    std::vector<uint16_t> h(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      float v = x[i];
      uint32_t bits32;
      std::memcpy(&bits32, &v, 4);
      h[i] = static_cast<uint16_t>(bits32 >> 16);  // bf16 bits, exact in float32
    }
    TensorView strided(h.data(), DType::kBFloat16, {1, t, 2, d});  // memory [T, H, D]
    std::swap(strided.shape[1], strided.shape[2]);
    std::swap(strided.strides[1], strided.strides[2]);  // viewed as [1, H, T, D]
    std::vector<float> dense(x.size());
    for (int64_t hh = 0; hh < 2; ++hh) {
      for (int64_t tt = 0; tt < t; ++tt) {
        for (int64_t i = 0; i < d; ++i) {
          uint32_t b = static_cast<uint32_t>(h[static_cast<size_t>((tt * 2 + hh) * d + i)]) << 16;
          std::memcpy(&dense[static_cast<size_t>((hh * t + tt) * d + i)], &b, 4);
        }
      }
    }
    const QuantizedTensor a = q->quantize(strided), b = q->quantize(TensorView(dense.data(), {1, 2, t, d}));
    EXPECT_TRUE(a.codes == b.codes) << spec;
    EXPECT_TRUE(a.scales == b.scales) << spec;
    EXPECT_EQ(a.dtype, DType::kBFloat16) << spec;
  }
}

TEST(CoreQuantizers, IntoReusesBuffersAndErrorsNameTheValue) {
  auto q = make_quantizer("int4:g32");
  std::vector<float> x = randn(2 * 16 * 64, 3);
  QuantizedTensor out;
  q->quantize_into(TensorView(x.data(), {1, 2, 16, 64}), out);
  const void* codes = out.codes.data();
  q->quantize_into(TensorView(x.data(), {1, 2, 16, 64}), out);
  EXPECT_EQ(out.codes.data(), codes);  // a repeated call allocates nothing
  x[5 * 64 + 3] = std::nanf("");
  EXPECT_EQ(error_of([&] { q->quantize(TensorView(x.data(), {1, 2, 16, 64})); }),
            "quantize(x) [int4:g32]: x contains NaN at [b, h, t, d] = [0, 0, 5, 3] (expected finite values; shape "
            "[1, 2, 16, 64])");
  EXPECT_EQ(error_of([&] { q->quantize_into(TensorView(x.data(), {2, 16, 64}), out); }),
            "quantize_into(x, out) [int4:g32]: x must be 4-D [B, H_kv, T, D], got 3-D shape [2, 16, 64]");
  const std::vector<double> wide(64, 0.0);
  EXPECT_EQ(error_of([&] { q->quantize(TensorView(wide.data(), DType::kFloat64, {1, 1, 1, 64})); }),
            "quantize(x) [int4:g32]: x has dtype Double, expected float32, float16 or bfloat16");
  std::vector<float> y(10);
  EXPECT_EQ(error_of([&] { q->dequantize_into(out, MutableTensorView(y.data(), {1, 1, 1, 10})); }),
            "dequantize_into(q, out) [int4:g32]: out must be [1, 2, 16, 64] of dtype Float, got [1, 1, 1, 10] Float");
}

// ---------------------------------------------------------------- attention

CacheConfig config(const std::string& scheme, const std::string& policy, int64_t context = 0) {
  CacheConfig c;
  c.num_layers = 2;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.scheme = scheme;
  c.policy = policy;
  c.context_length = context;
  c.rope = keys_already_rotated();
  return c;
}

/// Plain softmax attention in double of q [H_q, T_q, D] over k, v [H_kv, T, D] (positions
/// `kpos` per head, causal against `qpos`): the reference of tests/attend_test.cpp in loops.
std::vector<double> reference(const std::vector<float>& q, int64_t hq, int64_t tq, const std::vector<int64_t>& qpos,
                              const float* k, const float* v, const int64_t* kpos, int64_t hkv, int64_t t, int64_t d) {
  std::vector<double> out(static_cast<size_t>(hq * tq * d), 0.0);
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t kv = h / (hq / hkv);
    for (int64_t r = 0; r < tq; ++r) {
      std::vector<double> s(static_cast<size_t>(t), -INFINITY);
      double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j < t; ++j) {
        if (kpos[kv * t + j] > qpos[static_cast<size_t>(r)]) continue;
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += double(q[static_cast<size_t>((h * tq + r) * d + i)]) * k[(kv * t + j) * d + i];
        s[static_cast<size_t>(j)] = dot / std::sqrt(double(d));
        m = std::max(m, s[static_cast<size_t>(j)]);
      }
      for (auto& x : s) sum += x == -INFINITY ? 0 : (x = std::exp(x - m));
      for (int64_t j = 0; j < t; ++j) {
        if (s[static_cast<size_t>(j)] == -INFINITY) continue;
        for (int64_t i = 0; i < d; ++i) {
          out[static_cast<size_t>((h * tq + r) * d + i)] += s[static_cast<size_t>(j)] / sum * v[(kv * t + j) * d + i];
        }
      }
    }
  }
  return out;
}

/// Appends `n` random tokens to every layer at positions from next_position.
void append_random(SequenceCache& m, int64_t n, uint32_t seed) {
  const CacheConfig& c = m.config();
  const auto k = randn(static_cast<size_t>(c.num_kv_heads * n * c.head_dim), seed);
  const auto v = randn(k.size(), seed + 1);
  std::vector<int64_t> pos(static_cast<size_t>(n));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    for (int64_t i = 0; i < n; ++i) pos[static_cast<size_t>(i)] = m.next_position(l) + i;
    m.append(l, TensorView(k.data(), {1, c.num_kv_heads, n, c.head_dim}),
             TensorView(v.data(), {1, c.num_kv_heads, n, c.head_dim}), TensorView(pos.data(), {n}));
  }
}

// attend() over the stored blocks equals plain attention over what the cache holds
// (CacheDebug::get), for every format the fused kernels and the generic path read, through
// eviction holes (window) and a prefill chunk of causal rows.
TEST(CoreAttention, MatchesThePlainReferenceOverTheStoredKV) {
  for (const std::string scheme : {"fp32", "fp16", "bf16", "fp8:e4m3", "int8", "int4", "int2:g32:chan",
                                   "kivi:k2:v2:g32:r64", "had(int4)"}) {
    for (const std::string policy : {"full", "window@40"}) {
      CacheManager m(config(scheme, policy, 256));
      append_random(m, 50, 11);
      m.end_step(StepKind::kPrefillEnd);
      append_random(m, 6, 21);  // a chunk of 6 causal query rows after the eviction
      const int64_t tq = 6;
      const auto q = randn(static_cast<size_t>(4 * tq * 32), 31);
      std::vector<int64_t> qpos(static_cast<size_t>(tq));
      const LayerTokens tok = m.tokens(1);
      for (int64_t i = 0; i < tq; ++i) qpos[static_cast<size_t>(i)] = tok.written - tq + i;
      std::vector<float> out(q.size());
      m.attend(1, TensorView(q.data(), {1, 4, tq, 32}), TensorView(qpos.data(), {tq}),
               MutableTensorView(out.data(), {1, 4, tq, 32}));
      const LayerKV kv = CacheDebug::get(m, 1);
      const int64_t t = kv.k.shape()[2];
      const auto want = reference(q, 4, tq, qpos, kv.k.data_as<float>(), kv.v.data_as<float>(),
                                  kv.positions.data_as<int64_t>(), 2, t, 32);
      double worst = 0;
      for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::abs(out[i] - want[i]));
      // The fused kernels round integer keys' queries to two int8 terms (|δq| ≤ 1.6e-5·max|q|);
      // everything else agrees to float32 summation order.
      EXPECT_LE(worst, 2e-4) << scheme << " + " << policy;
      if (policy != "full") {
        EXPECT_EQ(t, 40 + tq) << scheme;
      }
      CacheDebug::check_invariants(m);
    }
  }
}

TEST(CoreAttention, BatchIsBitIdenticalToSingleCalls) {
  CacheManager a(config("int4", "full", 512)), b(config("kivi:k2:v2:g32:r64", "h2o@64", 512));
  append_random(a, 300, 1);
  append_random(b, 90, 2);
  const auto q = randn(4 * 32 * 2, 5);
  const std::vector<int64_t> qa = {a.next_position(0) - 1}, qb = {b.next_position(0) - 1};
  std::vector<float> out(4 * 32 * 2), single(4 * 32 * 2);
  std::vector<AttendRequest> reqs(2);
  reqs[0] = {&a, TensorView(q.data(), {1, 4, 1, 32}), TensorView(qa.data(), {1}),
             MutableTensorView(out.data(), {1, 4, 1, 32})};
  reqs[1] = {&b, TensorView(q.data() + 128, {1, 4, 1, 32}), TensorView(qb.data(), {1}),
             MutableTensorView(out.data() + 128, {1, 4, 1, 32})};
  attend_batch(0, reqs);
  a.attend(1, TensorView(q.data(), {1, 4, 1, 32}), TensorView(qa.data(), {1}),
           MutableTensorView(single.data(), {1, 4, 1, 32}));
  b.attend(1, TensorView(q.data() + 128, {1, 4, 1, 32}), TensorView(qb.data(), {1}),
           MutableTensorView(single.data() + 128, {1, 4, 1, 32}));
  EXPECT_EQ(std::memcmp(out.data(), single.data(), out.size() * sizeof(float)), 0);
  // A second attend of layer 0 in the same step computes the same output again (the policy is
  // fed once per layer and step: the first call fed it).
  std::vector<float> again(4 * 32);
  b.attend(0, TensorView(q.data() + 128, {1, 4, 1, 32}), TensorView(qb.data(), {1}),
           MutableTensorView(again.data(), {1, 4, 1, 32}));
  EXPECT_EQ(std::memcmp(again.data(), out.data() + 128, again.size() * sizeof(float)), 0);
  reqs[1].cache = &a;
  EXPECT_EQ(error_of([&] { attend_batch(1, reqs); }),
            "attend_batch: request 1 names a cache an earlier request names (each sequence attends once per call)");
}

// ---------------------------------------------------------------- cache and policies

TEST(CoreCache, CountersAndAllOrNothing) {
  CacheManager m(config("int8", "window@8", 64));
  append_random(m, 5, 3);
  m.end_step(StepKind::kPrefill);
  // int8 of D = 32: 32 code bytes + fp16 scale and zero per token row.
  EXPECT_EQ(m.stats().bytes_resident, 2 * 2 * 2 * 5 * (32 + 4));
  const CacheStats before = m.stats();
  std::vector<float> k(2 * 3 * 32, 1.0f);
  k[7] = INFINITY;
  const std::vector<int64_t> pos = {5, 6, 7};
  EXPECT_EQ(error_of([&] {
              m.append(0, TensorView(k.data(), {1, 2, 3, 32}), TensorView(k.data(), {1, 2, 3, 32}),
                       TensorView(pos.data(), {3}));
            }),
            "CacheManager::append: k contains +Inf at [b, h, t, d] = [0, 0, 0, 7]; the cache stores finite keys "
            "and values only");
  EXPECT_EQ(m.stats().bytes_resident, before.bytes_resident);
  EXPECT_EQ(m.stats().tokens_written, before.tokens_written);
  append_random(m, 9, 4);
  m.end_step(StepKind::kDecode);
  EXPECT_EQ(m.tokens(0).max_resident(), 8);  // the window's budget
  EXPECT_EQ(m.tokens(0).positions[0].front(), 6);
  CacheDebug::check_invariants(m);
}

// kvpress's StreamingLLM vector (tests/eviction_policy_test.cpp): sink@50% of 10 tokens keeps
// [0, 1, 2, 3, 9]; H2O fed through ExternalAttention keeps the heavy hitters.
TEST(CorePolicies, SinkAndAttentionFedH2O) {
  CacheManager s(config("fp32", "sink@50%", 10));
  append_random(s, 10, 5);
  s.end_step(StepKind::kPrefillEnd);
  EXPECT_EQ(s.tokens(0).positions[0], (std::vector<int64_t>{0, 1, 2, 3, 9}));

  CacheConfig c = config("fp32", "h2o:r1@3", 16);
  c.num_layers = 1;
  CacheManager h(c);
  append_random(h, 5, 6);
  // Query heads 0, 1 (KV head 0) put their mass on token 1 and 2; heads 2, 3 on token 0.
  std::vector<float> probs(4 * 1 * 5, 0.0f);
  probs[0 * 5 + 1] = 0.7f;
  probs[0 * 5 + 4] = 0.3f;
  probs[1 * 5 + 2] = 0.9f;
  probs[1 * 5 + 4] = 0.1f;
  probs[2 * 5 + 0] = 1.0f;
  probs[3 * 5 + 0] = 0.8f;
  probs[3 * 5 + 3] = 0.2f;
  ExternalAttention ext(h);
  ext.observe_attention(0, TensorView(probs.data(), {1, 4, 1, 5}));
  EXPECT_NE(error_of([&] { ext.observe_attention(0, TensorView(probs.data(), {1, 4, 1, 5})); })
                .find("was already observed in this step"),
            std::string::npos);
  h.end_step(StepKind::kPrefillEnd);
  // Budget 3 = 2 heavy + 1 recent: KV head 0 keeps tokens 1, 2 (0.35, 0.45) and 4; head 1 keeps
  // 0 (0.9), 3 (0.1) and 4.
  EXPECT_EQ(h.tokens(0).positions[0], (std::vector<int64_t>{1, 2, 4}));
  EXPECT_EQ(h.tokens(0).positions[1], (std::vector<int64_t>{0, 3, 4}));
  probs[0] = 2.0f;  // not a probability: refused whatever the policy needs
  EXPECT_NE(error_of([&] { ext.observe_attention(0, TensorView(probs.data(), {1, 4, 1, 3})); }).find("is not a probability"),
            std::string::npos);
}

TEST(CoreCache, SequencesOfAPoolShareAPrefix) {
  MultiSequenceConfig mc;
  mc.model = config("int4", "full");
  mc.model.num_layers = 1;
  mc.capacity_bytes = int64_t{1} << 24;
  MultiSequenceCache pool(mc);
  std::vector<int64_t> prompt(130);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int64_t>(i);
  Sequence& a = pool.add_sequence();
  EXPECT_EQ(a.begin_request(prompt, 200).cached_tokens, 0);
  append_random(a, 130, 9);
  a.end_step(StepKind::kPrefillEnd);
  append_random(a, 1, 10);
  a.end_step(StepKind::kDecode);
  Sequence& b = pool.add_sequence();
  EXPECT_EQ(b.begin_request(prompt, 200).cached_tokens, 128);  // two whole blocks of 64
  const LayerKV ka = CacheDebug::get(a, 0), kb = CacheDebug::get(b, 0);
  ASSERT_EQ(ka.k.shape(), (std::vector<int64_t>{1, 2, 131, 32}));
  ASSERT_EQ(kb.k.shape(), (std::vector<int64_t>{1, 2, 128, 32}));
  for (int64_t h = 0; h < 2; ++h) {  // the shared blocks: the same stored bytes, read the same
    EXPECT_EQ(std::memcmp(ka.k.data_as<float>() + h * 131 * 32, kb.k.data_as<float>() + h * 128 * 32, 128 * 32 * 4), 0);
  }
  EXPECT_EQ(pool.counters().prompt_tokens_hit, 128);
  pool.check_invariants();
  EXPECT_EQ(error_of<UnsupportedError>([&] { b.begin_replay(); }),
            "Sequence::begin_replay: sequence 1 of a MultiSequenceCache runs no context replay (a CacheManager does)");
}

TEST(CoreIsa, SetterNamesTheValue) {
  const std::string before = attention_kernels();
  EXPECT_EQ(error_of([] { set_attention_kernels("avx9", "KVCACHE_FUSED_ISA"); }).rfind("KVCACHE_FUSED_ISA=avx9: expected avx512, avx2 or none", 0),
            0u);
  set_attention_kernels("none");
  EXPECT_EQ(attention_kernels(), "none");
  set_attention_kernels(before == "none" ? "" : before);
  EXPECT_EQ(attention_kernels(), before);
}

TEST(CoreRegistry, SpecKindsWithoutLibTorch) {
  EXPECT_EQ(spec_kind("kivi:k2:v2:g32:r128"), SpecKind::kCacheScheme);
  EXPECT_EQ(spec_kind("h2o@50%"), SpecKind::kPolicy);
  EXPECT_EQ(make_cache_scheme("kivi")->spec(), "kivi:k2:v2:g32:r128");
}

}  // namespace
}  // namespace kvcache
