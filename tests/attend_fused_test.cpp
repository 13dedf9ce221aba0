// SPDX-License-Identifier: Apache-2.0
// The fused attention kernels (src/cache/attend_avx512.cpp, src/cache/attend_avx2.cpp) against
// their reference twin, the generic per-block path, on the same cache: every stored format the
// kernels read, head_dim 32/64/128, odd head counts, one-token blocks, per-channel key groups, T
// not a multiple of the block, holes left by eviction, decode queries and prefill chunks. Each
// test that runs kernels runs them for every kernel ISA the CPU runs (AVX-512 and AVX2 on an
// AVX-512 CPU: fused::use_fused_isa), skipped (saying so) on a CPU that runs none.
//
// Tolerances, stated and derived (attend_fused.h):
//   - float key formats (fp32/fp16/bf16/fp8): both paths compute q·k, the softmax and p·v in
//     float32 over the same stored values, in a different order (FMA, register blocking,
//     transposes): |Δout| ≤ 2e-5 for unit-scale data (as attend_test.cpp against at::). Each
//     fp8/fp16/bf16 code's conversion is checked exactly, every code, with one-hot queries and
//     weights (EveryFloatCodeReadsAsItsValue).
//   - per-token integer keys: the fused path computes exactly q'·k̂ for the two-term int8 query
//     q' (chunks of 32 dims, q' = qs·hi + qs/254·lo, |q − q'| ≤ 1.6e-5·max|q|); fused(q) against
//     generic(q') to the same 2e-5. The rounding's own effect on the output is bounded
//     separately: scores move by ≤ δ = max |(q − q')·k̂|, so each probability by a factor in
//     [e^{−2δ}, e^{2δ}] and |fused(q) − generic(q)| ≤ (e^{2δ} − 1)·max|v̂|.
//   - per-channel keys (KIVI, :chan): the kernel rounds w = q ⊙ s; its scores are checked
//     against the exact formula Σ_c ws_c Σ_d wi_d c_d + Σ_d q_d z_d at 1e-5 relative (float
//     accumulation order), and end to end against generic(q) with the bound above, δ computed
//     from the stored codes.
//   - the AVX2 kernels (float-domain: codes converted to float and multiplied with the float
//     query, integer keys factored per group as s·(q·c) + z·Σq) do not round the query: every
//     format, integer keys included, is held to generic(q) directly within kFloatTol (the
//     difference is float32 summation order only), and per-channel scores to the exact formula
//     Σ_d q_d (s_d c_d + z_d). With the int8 query (set_attention_query("int8")) their 4- and
//     2-bit keys are dotted with the one-term int8 query as the AVX-512 kernels do (vpmaddubsw):
//     held to the AVX-512 kernels' scores and outputs and to the reference twin (Int8Query*).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cache/attend_fused.h"
#include "cache/cache_manager_access.h"
#include "cache/layer_store.h"
#include "cache_test_util.h"
#include "kvcache/cache_manager.h"
#include "kvcache/attention.h"
#include "kvcache/quantizer.h"
#include "kvcache/study/metrics.h"
#include "kvcache/study/model_evaluator.h"
#include "kvcache/torch/attention.h"
#include "kvcache/torch.h"
#include "quant/fp8.h"

namespace kvcache {
namespace {

// Under the sanitizers (CI's ASan + UBSan tree at -O1) the widest TurboQuant sweeps run a
// subset that keeps every code path — each code width (1, 2, 3, 4 bits through 1.5 and 3.5),
// nc, Prod keys, Prod values (generic), kmse keys, polar — and fewer decode steps: the whole
// sweep took over four minutes there.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

using cache::CacheManagerAccess;
using testing::make_config;
using testing::positions_range;

#define REQUIRE_FUSED()                                                                        \
  do {                                                                                         \
    if (!cache::fused::available()) GTEST_SKIP() << "CPU without AVX2/FMA/F16C: fused kernels not used"; \
  } while (0)

using cache::fused::FusedIsa;

/// The kernel ISAs this CPU runs, best first (a test that runs kernels loops over them).
std::vector<FusedIsa> runnable_isas() {
  const FusedIsa before = cache::fused::current_isa();
  std::vector<FusedIsa> out;
  for (const FusedIsa isa : {FusedIsa::kAvx512, FusedIsa::kAvx2}) {
    if (cache::fused::use_fused_isa(isa)) out.push_back(isa);
  }
  cache::fused::use_fused_isa(before);
  return out;
}

bool runnable_isas_has(FusedIsa isa) {
  const auto isas = runnable_isas();
  return std::find(isas.begin(), isas.end(), isa) != isas.end();
}

/// Selects `isa` for its lifetime and restores the CPU's default kernels at the end of the
/// scope, also when an ASSERT returns early from the test.
struct IsaScope {
  explicit IsaScope(FusedIsa isa)
      : before(cache::fused::current_isa()),
        trace(__FILE__, __LINE__, std::string("fused ISA ") + cache::fused::isa_name(isa)) {
    EXPECT_TRUE(cache::fused::use_fused_isa(isa));
  }
  ~IsaScope() { cache::fused::use_fused_isa(before); }  // what was selected (KVCACHE_FUSED_ISA too)
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;
  FusedIsa before;
  ::testing::ScopedTrace trace;
};

constexpr double kFloatTol = 2e-5;

bool integer_keys(const std::string& quant) { return quant.rfind("int", 0) == 0 || quant.rfind("kivi", 0) == 0; }
bool channel_keys(const std::string& quant) {
  return quant.rfind("kivi", 0) == 0 || quant.find(":chan") != std::string::npos;
}

double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }

/// x rounded as the fused path rounds queries (fused::prepare): two int8 terms per 32-dim
/// chunk, x' = qs·hi + (qs/254)·lo, qs = max|x|/127 (1 for a zero chunk), round half to even —
/// in float32, the same operations.
/// `fused_residual`: x − qs·hi rounded once (as an FMA), the per-channel fold in the kernel;
/// otherwise product and difference rounded apart, as fused::prepare does.
/// `one_term`: the high term alone, x' = qs·hi (the int8 query, QueryRounding::kInt8*).
at::Tensor two_term_rounded(const at::Tensor& x, bool fused_residual = false, bool one_term = false) {
  auto out = x.clone();
  for (int64_t c = 0; c < x.size(-1) / 32; ++c) {
    const auto ch = x.narrow(-1, 32 * c, 32);
    auto qs = std::get<0>(ch.abs().max(-1, /*keepdim=*/true)) / 127.0f;
    qs = at::where(qs > 0, qs, at::ones_like(qs));
    const auto step = qs / cache::fused::kLowSteps;
    // The per-channel fold multiplies by the reciprocals (1/qs, 1/step, each rounded to float);
    // fused::prepare divides.
    const auto hi = at::clamp(at::round(fused_residual ? ch * at::reciprocal(qs) : ch / qs), -127, 127);
    const auto resid = fused_residual ? (ch.to(at::kDouble) - qs.to(at::kDouble) * hi.to(at::kDouble)).to(at::kFloat)
                                      : ch - qs * hi;
    const auto lo = at::clamp(at::round(fused_residual ? resid * at::reciprocal(step) : resid / step), -127, 127);
    out.narrow(-1, 32 * c, 32).copy_(one_term ? qs * hi : qs * hi + step * lo);
  }
  return out;
}

float inv_sqrt(int64_t d) { return 1.0f / std::sqrt(static_cast<float>(d)); }

/// The query that makes the generic path compute what the fused path computes for q:
/// q' / (1/√D), q' = two_term_rounded(q · (1/√D)).
at::Tensor rounded_query(const at::Tensor& q, bool one_term = false) {
  const float s = inv_sqrt(q.size(3));
  return two_term_rounded(q * s, false, one_term) / s;
}

/// max over query rows and keys of |(q − q')·k̂| (per-token keys).
double token_delta(const TorchCache& m, const at::Tensor& q) {
  const TensorLayerKV kv = m.get(0);
  const int64_t hq = q.size(1), g = hq / kv.k.size(1);
  const auto qf = q * inv_sqrt(q.size(3));
  const auto dq = (qf - two_term_rounded(qf)).to(at::kDouble)[0];
  double delta = 0;
  for (int64_t h = 0; h < hq; ++h) {
    delta = std::max(delta, max_abs(at::matmul(dq[h], kv.k[0][h / g].to(at::kDouble).t())));
  }
  return delta;
}

float half_at(const uint8_t* p, int64_t i) {
  at::Half h;
  std::memcpy(&h, p + 2 * i, 2);
  return static_cast<float>(h);
}

/// Per-channel key blocks of layer 0: for each (KV head, main block), the codes [g, D], the
/// stored scales and zeros [D] (exact, read from the block) — what the kernel reads.
struct ChannelBlock {
  int64_t head;
  at::Tensor codes, s, z;  // float64
  cache::fused::RawTokens raw;
  std::vector<int32_t> slots;
};

std::vector<ChannelBlock> channel_blocks(const TorchCache& m) {
  std::vector<ChannelBlock> out;
  const auto& L = CacheManagerAccess::layer(m.core(), 0);
  for (int64_t h = 0; h < L.num_heads(); ++h) {
    const auto& list = L.k(h).quant;
    for (const auto& b : list.blocks()) {
      if (b.format != cache::StreamFormats::kMain) continue;
      const auto& f = list.format(b);
      const int64_t d = f.head_dim, g = f.layout.group_tokens;
      ChannelBlock cb;
      cb.head = h;
      const uint8_t* data = f.pool->data(b.id);
      cb.s = at::empty({d}, at::kDouble);
      cb.z = at::empty({d}, at::kDouble);
      for (int64_t i = 0; i < d; ++i) {
        cb.s[i] = half_at(data + f.scales_offset, i);
        cb.z[i] = half_at(data + f.zeros_offset, i);
      }
      std::vector<float> rows(static_cast<size_t>(g * d));
      list.decode(b, rows.data(), 1.0f);
      const auto khat = at::from_blob(rows.data(), {g, d}, at::kFloat).to(at::kDouble);
      cb.codes = at::round((khat - cb.z) / at::where(cb.s > 0, cb.s, at::ones_like(cb.s)));
      cb.slots.resize(static_cast<size_t>(g));
      for (int64_t t = 0; t < g; ++t) cb.slots[static_cast<size_t>(t)] = static_cast<int32_t>(t);
      cb.raw.block = data;
      cb.raw.kf = cache::fused::classify(f);
      out.push_back(std::move(cb));
    }
  }
  return out;
}

/// max |(w − w')·c| over rows and the per-channel blocks' keys (w = q/√D ⊙ s; w' its two-term
/// rounding, or with `one_term` its one-term rounding: the int8 query).
double channel_delta(const TorchCache& m, const at::Tensor& q, bool one_term = false) {
  const int64_t hq = q.size(1), g = hq / m.config().num_kv_heads;
  const auto qf = q * inv_sqrt(q.size(3));
  double delta = 0;
  for (const auto& cb : channel_blocks(m)) {
    for (int64_t h = cb.head * g; h < (cb.head + 1) * g; ++h) {
      const auto w = qf[0][h] * cb.s.to(at::kFloat);  // [T_q, D], float as the kernel does
      const auto dw = (w - two_term_rounded(w, true, one_term)).to(at::kDouble);
      delta = std::max(delta, max_abs(at::matmul(dw, cb.codes.t())));
    }
  }
  return delta;
}

struct Shape {
  int64_t hq, hkv, d, block_tokens;
};

TEST(AttendFused, MatchesTheGenericPathForEveryFormat) {
  REQUIRE_FUSED();
  const std::vector<std::string> quants = {"fp32",          "fp16",          "bf16",          "fp8:e4m3",
                                           "fp8:e5m2",      "fp8:e4m3:scaled", "int8",        "int4",
                                           "int2",          "int8:g32",      "int4:g32",      "int2:g32",
                                           "int4:g32:chan", "int2:g32:chan", "int8:g32:chan", "kivi:k2:v2:g32:r128",
                                           "kivi:k4:v4:g32:r32"};
  // The last shape has one-token blocks: every tile spans many blocks (segments).
  const std::vector<Shape> shapes = {{14, 2, 64, 64}, {9, 3, 32, 32}, {4, 1, 128, 96}, {7, 7, 64, 32}, {6, 2, 64, 1}};
  for (const FusedIsa isa : runnable_isas()) {
    const IsaScope scope(isa);
    const bool avx2 = isa == FusedIsa::kAvx2;
    uint64_t seed = 1;
    for (const auto& quant : quants) {
      for (const auto& sh : shapes) {
        if (sh.block_tokens == 1 && channel_keys(quant)) continue;  // a per-channel block is one group
        auto c = make_config(1, sh.hq, sh.hkv, sh.d, quant, "full");
        c.block_tokens = sh.block_tokens;
        TorchCache m(c);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(++seed);
        int64_t pos = 0;
        for (int64_t n : {1, 37, 250, 1, 1, 80}) {  // T reaches 370: never a multiple of the block
          m.append(0, testing::randn({1, sh.hkv, n, sh.d}, gen) * 1.5, testing::randn({1, sh.hkv, n, sh.d}, gen),
                   positions_range(pos, n));
          pos += n;
          for (int64_t tq : {int64_t{1}, std::min<int64_t>(n, 9)}) {
            const std::string where = quant + " H_q " + std::to_string(sh.hq) + " H_kv " + std::to_string(sh.hkv) +
                                      " D " + std::to_string(sh.d) + " T " + std::to_string(pos) + " T_q " +
                                      std::to_string(tq);
            const auto q = testing::randn({1, sh.hq, tq, sh.d}, gen);
            const auto qp = positions_range(pos - tq, tq);
            const auto fast = testing::access_attend(m, 0, q, qp, /*fused=*/true);
            const auto ref = testing::access_attend(m, 0, q, qp, /*fused=*/false);
            const double vmax = max_abs(m.get(0).v);
            if (!integer_keys(quant) || avx2) {  // AVX2: no query rounding (file comment)
              EXPECT_LE(max_abs(fast - ref), kFloatTol) << where;
              continue;
            }
            const double delta = channel_keys(quant) ? channel_delta(m, q) : token_delta(m, q);
            EXPECT_LE(max_abs(fast - ref), (std::exp(2 * delta) - 1) * vmax + kFloatTol) << where;
            if (!channel_keys(quant)) {  // exactly the rounded query's attention
              const auto rounded = testing::access_attend(m, 0, rounded_query(q), qp, /*fused=*/false);
              EXPECT_LE(max_abs(fast - rounded), kFloatTol) << where;
            }
          }
          m.end_step(StepKind::kPrefill);
        }
      }
    }
  }
}

// head_dim 256 (eight 32-dim chunks, the widest the kernels read) and 96 (three chunks), and the
// per-token group sizes whose codes the kernels unpack differently (int4 g64/g128: nibble halves
// of the group; int2 g64: two fields; int2 g128/g256: four quarter rows), with 7 and 21 query
// rows (one and three passes of the AVX2 kernels' 7 rows) and a block tail.
TEST(AttendFused, WideHeadsAndGroupSizes) {
  REQUIRE_FUSED();
  using Kind = cache::fused::KernelFormat::Kind;
  struct Case {
    const char* quant;
    int64_t d;
  };
  const std::vector<Case> cases = {{"fp16", 256},      {"bf16", 256},     {"fp8:e4m3:scaled", 256}, {"fp8:e5m2", 256},
                                   {"int8", 256},      {"int4:g64", 256}, {"int4:g128", 256},       {"int2:g64", 256},
                                   {"int2:g128", 256}, {"int2:g256", 256}, {"int8:g64", 256},       {"int4:g32:chan", 256},
                                   {"int8:g32", 96},   {"int4:g32", 96},  {"int2:g32", 96},         {"int2:g32:chan", 96},
                                   {"fp8:e4m3", 96}};
  for (const FusedIsa isa : runnable_isas()) {
    const IsaScope scope(isa);
    const bool avx2 = isa == FusedIsa::kAvx2;
    uint64_t seed = 100;
    for (const auto& cs : cases) {
      const std::string quant = cs.quant;
      const auto qz = make_quantizer(quant);
      const int64_t cap = std::max<int64_t>(64, qz->stored_layout(cs.d).group_tokens);
      ASSERT_NE(cache::fused::classify(cache::BlockFormat(*qz, cs.d, cap, nullptr)).kind, Kind::kNone) << quant;
      auto c = make_config(1, 7, 1, cs.d, quant, "full");
      c.block_tokens = 64;
      TorchCache m(c);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(++seed);
      m.append(0, testing::randn({1, 1, 101, cs.d}, gen) * 1.5, testing::randn({1, 1, 101, cs.d}, gen),
               positions_range(0, 101));  // a full block and a tail of 37
      for (int64_t tq : {1, 3}) {
        const std::string where = quant + " D " + std::to_string(cs.d) + " T_q " + std::to_string(tq);
        const auto q = testing::randn({1, 7, tq, cs.d}, gen);
        const auto qp = positions_range(101 - tq, tq);
        const auto fast = testing::access_attend(m, 0, q, qp, /*fused=*/true);
        if (avx2 || !integer_keys(quant)) {
          EXPECT_LE(max_abs(fast - testing::access_attend(m, 0, q, qp, false)), kFloatTol) << where;
        } else if (!channel_keys(quant)) {
          EXPECT_LE(max_abs(fast - testing::access_attend(m, 0, rounded_query(q), qp, false)), kFloatTol) << where;
        } else {
          const double tol = (std::exp(2 * channel_delta(m, q)) - 1) * max_abs(m.get(0).v) + kFloatTol;
          EXPECT_LE(max_abs(fast - testing::access_attend(m, 0, q, qp, false)), tol) << where;
        }
      }
    }
  }
}

// use_fused_isa: refuses nothing the CPU runs, changes nothing when it refuses, and the
// generic path (kNone) turns the fused kernels off.
TEST(AttendFused, IsaHookSelectsAndRestores) {
  const FusedIsa best = cache::fused::best_isa();
  const FusedIsa initial = cache::fused::current_isa();
  // What the test executable set from KVCACHE_FUSED_ISA (tests/support/fused_isa_env.cpp).
  const char* env = std::getenv("KVCACHE_FUSED_ISA");
  EXPECT_EQ(initial, cache::fused::isa_from_name(env != nullptr ? env : "", "KVCACHE_FUSED_ISA"));
  for (const FusedIsa isa : {FusedIsa::kAvx512, FusedIsa::kAvx2, FusedIsa::kNone}) {
    const IsaScope restore(best);
    const bool ok = cache::fused::use_fused_isa(isa);
    EXPECT_EQ(cache::fused::current_isa(), ok ? isa : best) << cache::fused::isa_name(isa);
    EXPECT_EQ(cache::fused::available(), cache::fused::current_isa() != FusedIsa::kNone);
  }
  EXPECT_TRUE(cache::fused::use_fused_isa(FusedIsa::kNone));
  EXPECT_FALSE(cache::fused::available());
  cache::fused::use_fused_isa(best);
  EXPECT_EQ(cache::fused::current_isa(), best);
  if (best == FusedIsa::kAvx512) {  // every CPU with the AVX-512 kernels' ISA has AVX2, FMA, F16C, BMI2
    EXPECT_TRUE(cache::fused::use_fused_isa(FusedIsa::kAvx2));
  }
  cache::fused::use_fused_isa(initial);
}

// KVCACHE_FUSED_ISA's vocabulary (what the apps pass to kvcache::set_attention_kernels): empty
// is the CPU's best; avx512/avx2/none select, if the CPU runs them; anything else, or an ISA the
// CPU lacks, is refused naming the source and the value.
TEST(AttendFused, IsaFromTheEnvironment) {
  const auto isa_from_name = [](const char* v) { return cache::fused::isa_from_name(v, "KVCACHE_FUSED_ISA"); };
  const FusedIsa best = cache::fused::best_isa();
  EXPECT_EQ(isa_from_name(""), best);
  EXPECT_EQ(isa_from_name("none"), FusedIsa::kNone);
  for (const char* bad : {"avx9", "AVX2", "avx2 "}) {
    try {
      isa_from_name(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("KVCACHE_FUSED_ISA=") + bad + ":"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("expected avx512, avx2 or none"), std::string::npos) << e.what();
    }
  }
  for (const auto& [name, isa] : {std::pair{"avx512", FusedIsa::kAvx512}, std::pair{"avx2", FusedIsa::kAvx2}}) {
    const IsaScope restore(best);
    if (cache::fused::use_fused_isa(isa)) {
      EXPECT_EQ(isa_from_name(name), isa);
    } else {
      EXPECT_THROW(isa_from_name(name), InvalidArgument) << name;
    }
  }
}

// Per-channel keys: the kernel's scores equal Σ_c ws_c Σ_d wi_d c_d + Σ_d q_d z_d (w = q ⊙ s
// rounded per chunk as the kernel rounds it), from the stored codes, scales and zeros.
TEST(AttendFused, ChannelKeyScoresFollowTheFoldedQueryFormula) {
  REQUIRE_FUSED();
  for (const FusedIsa isa : runnable_isas()) {
    const IsaScope scope(isa);
    for (const std::string quant : {"int2:g32:chan", "int4:g32:chan", "int8:g32:chan", "kivi:k2:v2:g32:r128"}) {
      TorchCache m(make_config(1, 6, 2, 64, quant, "full"));
      auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
      m.append(0, testing::randn({1, 2, 300, 64}, gen) * 2.0, testing::randn({1, 2, 300, 64}, gen), positions_range(0, 300));
      const auto q = testing::randn({1, 6, 3, 64}, gen);
      const auto blocks = channel_blocks(m);
      ASSERT_GE(blocks.size(), 8u) << quant;
      for (const auto& cb : blocks) {
        // The head's 3 query heads × 3 tokens, token-major as attend orders rows.
        std::vector<float> rows;
        for (int64_t t = 0; t < 3; ++t) {
          for (int64_t g = 0; g < 3; ++g) {
            const auto r = q[0][cb.head * 3 + g][t].contiguous();
            rows.insert(rows.end(), r.data_ptr<float>(), r.data_ptr<float>() + 64);
          }
        }
        // The two-term query, then the int8 query for every format (kInt8Everywhere): AVX-512
        // rounds w to one int8 term for every width, AVX2 for the widths of kInt8QueryAvx2Bits
        // (4 and 2 bits; 8-bit codes keep the float query there).
        for (const bool one : {false, true}) {
          const bool one_used = one && (isa == FusedIsa::kAvx512 || ((cache::fused::kInt8QueryAvx2Bits >> cb.raw.kf.bits) & 1u) != 0);
          cache::fused::set_query_rounding(one ? cache::fused::QueryRounding::kInt8Everywhere
                                               : cache::fused::QueryRounding::kTwoTerm);
          cache::fused::Queries fq;
          cache::fused::prepare(rows.data(), 9, 64, inv_sqrt(64), fq);
          cache::fused::set_query_rounding(cache::fused::QueryRounding::kTwoTerm);
          cache::fused::RawTokens raw = cb.raw;
          raw.slots = cb.slots.data();
          std::vector<float> s(9 * 32);
          cache::fused::scores(fq, 0, 9, raw, 32, s.data(), 32);
          const auto qf = at::from_blob(rows.data(), {9, 64}, at::kFloat) * inv_sqrt(64);
          const auto w = qf * cb.s.to(at::kFloat);
          // AVX2's exact query: the float query, unrounded (Σ_d q_d s_d c_d + q_d z_d).
          const auto wk = isa == FusedIsa::kAvx2 && !one_used ? w.to(at::kDouble)
                                                              : two_term_rounded(w, true, one_used).to(at::kDouble);
          const auto want = at::matmul(wk, cb.codes.t()) + at::matmul(qf.to(at::kDouble), cb.z).unsqueeze(1);  // [9, 32]
          const auto got = at::from_blob(s.data(), {9, 32}, at::kFloat).to(at::kDouble);
          EXPECT_LE(max_abs(got - want), 1e-5 * (1 + max_abs(want))) << quant << (one ? " int8 query" : "");
        }
      }
    }
  }
}

// Every stored code of the 8- and 16-bit float formats through both kernels, checked exactly:
// keys whose D = 64 values are consecutive codes (every finite one; NaN/Inf codes replaced by
// 0), one-hot queries (score r of key j = value of dim r, one exact product) and one-hot
// weights (accumulated row r = value r). Catches a wrong bit trick in a conversion (e4m3 as an
// fp16 exponent field, e5m2 as fp16's upper byte, bf16 halves of a transposed dword), which
// random data near 1 would only sample. fp8:e4m3:scaled multiplies by the stream's scale,
// rounded once.
TEST(AttendFused, EveryFloatCodeReadsAsItsValue) {
  REQUIRE_FUSED();
  constexpr int64_t kD = 64;
  struct Case {
    const char* spec;
    int bytes;  // per value
    float tensor_scale;
  };
  for (const FusedIsa isa : runnable_isas()) {
    const IsaScope scope(isa);
    for (const Case cs : {Case{"fp8:e4m3", 1, 1.0f}, Case{"fp8:e5m2", 1, 1.0f}, Case{"fp8:e4m3:scaled", 1, 0.0371f},
                          Case{"fp16", 2, 1.0f}, Case{"bf16", 2, 1.0f}}) {
      const std::string spec = cs.spec;
      const auto qz = make_quantizer(spec);
      const cache::fused::KernelFormat kf = cache::fused::classify(cache::BlockFormat(*qz, kD, 64, nullptr));
      ASSERT_NE(kf.kind, cache::fused::KernelFormat::Kind::kNone) << spec;
      const int64_t codes = cs.bytes == 1 ? 256 : 65536, n = codes / kD;
      ASSERT_EQ(kf.code_bytes, kD * cs.bytes) << spec;
      std::vector<uint8_t> block(static_cast<size_t>(codes * cs.bytes + 64), 0);
      std::vector<float> want(static_cast<size_t>(codes));
      for (int64_t c = 0; c < codes; ++c) {
        float v = 0;
        uint32_t code = static_cast<uint32_t>(c);
        if (cs.bytes == 1) {
          const auto f = spec.find("e5m2") != std::string::npos ? quant::Fp8Format::kE5M2 : quant::Fp8Format::kE4M3;
          v = quant::fp8_decode(static_cast<uint8_t>(code), f);
          if (!std::isfinite(v)) v = 0, code = 0;
          block[static_cast<size_t>(c)] = static_cast<uint8_t>(code);
        } else {
          const auto bits = static_cast<uint16_t>(code);
          v = spec == "fp16" ? static_cast<float>(c10::Half(bits, c10::Half::from_bits()))
                             : static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
          const uint16_t stored = std::isfinite(v) ? bits : 0;
          if (!std::isfinite(v)) v = 0;
          std::memcpy(block.data() + 2 * c, &stored, 2);
        }
        want[static_cast<size_t>(c)] = v * cs.tensor_scale;  // one rounding, as the kernels scale
      }
      cache::fused::RawTokens raw;
      raw.block = block.data();
      raw.kf = kf;
      raw.tensor_scale = cs.tensor_scale;
      std::vector<int32_t> slots(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) slots[static_cast<size_t>(j)] = static_cast<int32_t>(j);
      raw.slots = slots.data();
      // Scores: query row r = e_r, unscaled.
      std::vector<float> eye(static_cast<size_t>(kD * kD), 0.0f);
      for (int64_t r = 0; r < kD; ++r) eye[static_cast<size_t>(r * kD + r)] = 1.0f;
      cache::fused::Queries fq;
      cache::fused::prepare(eye.data(), kD, kD, 1.0f, fq);
      std::vector<float> sc(static_cast<size_t>(kD * n), -1.0f);
      cache::fused::scores(fq, 0, kD, raw, n, sc.data(), n);
      int64_t bad_k = 0, bad_v = 0;
      for (int64_t r = 0; r < kD; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          const float got = sc[static_cast<size_t>(r * n + j)], exp = want[static_cast<size_t>(j * kD + r)];
          if (got != exp && bad_k++ < 3) ADD_FAILURE() << spec << " key code " << j * kD + r << ": score " << got << ", value " << exp;
        }
      }
      // Values, 64 keys at a time: weights = the identity, so accumulated row r = value r.
      for (int64_t j0 = 0; j0 < n; j0 += kD) {
        const int64_t m = std::min(kD, n - j0);
        cache::fused::RawTokens part = raw;
        part.slots = slots.data() + j0;
        std::vector<float> acc(static_cast<size_t>(m * kD), 0.0f);
        cache::fused::accumulate(eye.data(), kD, m, part, m, kD, acc.data());
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t d = 0; d < kD; ++d) {
            const float got = acc[static_cast<size_t>(r * kD + d)], exp = want[static_cast<size_t>((j0 + r) * kD + d)];
            if (got != exp && bad_v++ < 3) ADD_FAILURE() << spec << " value code " << (j0 + r) * kD + d << ": " << got << ", want " << exp;
          }
        }
      }
      EXPECT_EQ(bad_k, 0) << spec << " (ISA " << static_cast<int>(isa) << ")";
      EXPECT_EQ(bad_v, 0) << spec << " (ISA " << static_cast<int>(isa) << ")";
    }
  }
}

// Holes: scattered eviction leaves dead slots inside blocks (tiles with non-consecutive slots)
// and frees/merges blocks; the fused path reads the same live tokens.
TEST(AttendFused, SkipsHolesLikeTheGenericPath) {
  REQUIRE_FUSED();
  for (const FusedIsa isa : runnable_isas()) {
    const IsaScope scope(isa);
    const bool avx2 = isa == FusedIsa::kAvx2;
    for (const std::string quant : {"fp16", "int4", "int8:g32", "kivi:k2:v2:g32:r128", "fp8:e5m2"}) {
      auto c = make_config(1, 14, 2, 64, quant, "random:seed9@300", 4000);
      c.block_tokens = 32;
      TorchCache m(c);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
      m.append(0, testing::randn({1, 2, 400, 64}, gen), testing::randn({1, 2, 400, 64}, gen), positions_range(0, 400));
      m.end_step(StepKind::kPrefillEnd);
      for (int64_t step = 0; step < 40; ++step) {
        const int64_t p = 400 + step;
        m.append(0, testing::randn({1, 2, 1, 64}, gen), testing::randn({1, 2, 1, 64}, gen), positions_range(p, 1));
        const auto q = testing::randn({1, 14, 1, 64}, gen);
        const auto fast = testing::access_attend(m, 0, q, positions_range(p, 1), true);
        const auto qg = !avx2 && integer_keys(quant) && !channel_keys(quant) ? rounded_query(q) : q;
        const auto ref = testing::access_attend(m, 0, qg, positions_range(p, 1), false);
        const double tol = !avx2 && channel_keys(quant)
                               ? (std::exp(2 * channel_delta(m, q)) - 1) * max_abs(m.get(0).v) + kFloatTol
                               : kFloatTol;
        EXPECT_LE(max_abs(fast - ref), tol) << quant << " step " << step;
        m.end_step(StepKind::kDecode);
      }
      const auto s = CacheManagerAccess::stream(m.core(), 0, false);
      EXPECT_GT(s.dead_slots[0] + s.dead_slots[1], 0) << quant << ": the case must have holes";
    }
  }
}

// TurboQuant (tq, the turboquant scheme; attend_fused.h): keys scored from their codes against
// the query rotated once per step (and S·q for Prod), values accumulated in the rotated domain
// and rotated back once per row, against the generic path that decodes each block. Every bit
// width (1..4, the fractional 1.5/2.5/3.5, Prod at 2..4), nc, the scheme with its fp16 window,
// head_dim 32 (the smallest the kernels read), 64, 128 and 256, one-token blocks, T never a
// multiple of the block, decode and prefill queries, both ISAs. PolarQuant (`polar`, two seeds)
// the same way: its 16-value blocks rebuilt in registers from ρ and the levels' cos/sin tables
// against the query rotated by its preconditioning (the generic path decodes in double with
// std::cos/std::sin: the tables' float rounding is within the same tolerance).
//
// Tolerance kFloatTol (2e-5 on the output, values of unit scale), as for the float formats: the
// two paths compute the same algebra — q·(‖k‖·f·diag(s)·H·c) = ‖k‖·f·((H·diag(s)·q)·c) and
// Σ_j p_j·diag(s)·H·(‖v_j‖·f_j·c_j) = diag(s)·H·Σ_j p_j·‖v_j‖·f_j·c_j — in float32, with the
// Hadamard butterflies (log2 D rounding steps) run on different vectors (each key or value on
// the generic path; the query, and each accumulated row once, on the fused one), nc's 1/‖c‖ in
// float here and in double there, and the softmax rescale of the rotated accumulator by std::exp
// instead of the tile kernels' exp: a few ulps per score and per output. Measured worst case over
// these cases: 4e-6 (AVX-512), 5e-6 (AVX2) (RecordProperty worst_<isa>).
constexpr double kTurboTol = kFloatTol;

TEST(AttendFused, TurboQuantMatchesTheGenericPath) {
  REQUIRE_FUSED();
  using Kind = cache::fused::KernelFormat::Kind;
  // Prod keys come from the turboquant scheme (keys Prod, values MSE); `tq:b3:prod` as a
  // whole-cache scheme makes the values Prod too, which the fused path does not read (the
  // layer takes the generic path: the outputs are then identical).
  const std::vector<std::string> all = {"tq:b1",           "tq:b1.5",          "tq:b2",
                                        "tq:b2.5",         "tq:b3",            "tq:b3.5",
                                        "tq:b4",           "tq:b3:nc",         "tq:b4:nc",
                                        "tq:b2.5:nc",      "turboquant:k2:v2", "turboquant:k2.5:v1.5",
                                        "turboquant:k3:v3", "turboquant:k3.5:v3.5:nc", "turboquant:k4:v4",
                                        "turboquant:k4:v2.5:kmse:nc", "tq:b3:prod", "polar", "polar:seed7"};
  const std::vector<std::string> sanitized = {"tq:b1.5", "tq:b3.5", "tq:b2.5:nc", "turboquant:k2.5:v1.5",
                                              "turboquant:k4:v2.5:kmse:nc", "tq:b3:prod", "polar"};
  const std::vector<std::string>& quants = kSanitized ? sanitized : all;
  const std::vector<Shape> shapes = {{14, 2, 64, 64}, {9, 3, 32, 32}, {4, 1, 128, 96}, {6, 2, 64, 1}, {7, 1, 256, 64}};
  for (const FusedIsa isa : runnable_isas()) {
    const IsaScope scope(isa);
    uint64_t seed = 300;
    double worst = 0;
    for (const auto& quant : quants) {
      const bool prod_values = quant == "tq:b3:prod";
      bool differs = false;  // the fused kernels ran (the generic path is deterministic)
      for (const auto& sh : shapes) {
        auto c = make_config(1, sh.hq, sh.hkv, sh.d, quant, "full");
        c.block_tokens = sh.block_tokens;
        TorchCache m(c);
        const auto& L = CacheManagerAccess::layer(m.core(), 0);
        ASSERT_EQ(cache::fused::classify(L.key_setup().formats.f[cache::StreamFormats::kMain]).kind,
                  quant.rfind("polar", 0) == 0 ? Kind::kPolar : Kind::kTurboQuant)
            << quant;
        auto gen = at::make_generator<at::CPUGeneratorImpl>(++seed);
        int64_t pos = 0;
        for (int64_t n : {1, 37, 150, 1, 80}) {  // T reaches 269: never a multiple of the block
          m.append(0, testing::randn({1, sh.hkv, n, sh.d}, gen) * 1.5, testing::randn({1, sh.hkv, n, sh.d}, gen),
                   positions_range(pos, n));
          pos += n;
          for (int64_t tq : {int64_t{1}, std::min<int64_t>(n, 9)}) {
            const std::string where = quant + " H_q " + std::to_string(sh.hq) + " H_kv " + std::to_string(sh.hkv) +
                                      " D " + std::to_string(sh.d) + " block " + std::to_string(sh.block_tokens) +
                                      " T " + std::to_string(pos) + " T_q " + std::to_string(tq);
            const auto q = testing::randn({1, sh.hq, tq, sh.d}, gen);
            const auto qp = positions_range(pos - tq, tq);
            const auto fast = testing::access_attend(m, 0, q, qp, /*fused=*/true);
            const auto ref = testing::access_attend(m, 0, q, qp, /*fused=*/false);
            const double diff = max_abs(fast - ref);
            worst = std::max(worst, diff);
            differs = differs || diff > 0;
            EXPECT_LE(diff, prod_values ? 0.0 : kTurboTol) << where;
          }
          m.end_step(StepKind::kPrefill);
        }
      }
      EXPECT_EQ(differs, !prod_values) << quant << ": the fused kernels must run (and only where they read the format)";
    }
    RecordProperty(std::string("worst_") + cache::fused::isa_name(isa), std::to_string(worst));
  }
}

// TurboQuant and QJL keys with holes (scattered eviction: non-consecutive slots in the kernels' key and
// value loops) and through the public attend() with the scheme's fp16 window; head_dim 16 (a
// power of two the rotation takes, below the kernels' 32) and pre-RoPE keys take the generic
// path (the keys must be rotated by position after decoding), so fused and generic agree
// exactly there.
TEST(AttendFused, TurboQuantHolesSmallHeadsAndPreRopeKeys) {
  REQUIRE_FUSED();
  using Kind = cache::fused::KernelFormat::Kind;
  for (const FusedIsa isa : runnable_isas()) {
    const IsaScope scope(isa);
    for (const std::string quant : {"tq:b3:nc", "tq:b4", "turboquant:k2.5:v2:nc", "turboquant:k3.5:v3", "qjl:r32", "polar"}) {
      auto c = make_config(1, 14, 2, 64, quant, "random:seed9@300", 4000);
      c.block_tokens = 32;
      TorchCache m(c);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(78);
      m.append(0, testing::randn({1, 2, 400, 64}, gen), testing::randn({1, 2, 400, 64}, gen), positions_range(0, 400));
      m.end_step(StepKind::kPrefillEnd);
      for (int64_t step = 0; step < (kSanitized ? 6 : 30); ++step) {
        const int64_t p = 400 + step;
        m.append(0, testing::randn({1, 2, 1, 64}, gen), testing::randn({1, 2, 1, 64}, gen), positions_range(p, 1));
        const auto q = testing::randn({1, 14, 1, 64}, gen);
        const auto fast = testing::access_attend(m, 0, q, positions_range(p, 1), true);
        const auto ref = testing::access_attend(m, 0, q, positions_range(p, 1), false);
        EXPECT_LE(max_abs(fast - ref), kTurboTol) << quant << " step " << step;
        m.end_step(StepKind::kDecode);
      }
      const auto s = CacheManagerAccess::stream(m.core(), 0, false);
      EXPECT_GT(s.dead_slots[0] + s.dead_slots[1], 0) << quant << ": the case must have holes";
    }
    for (const auto& [quant, pre_rope] : {std::pair{"tq:b3", false}, std::pair{"tq:b3", true}, std::pair{"polar", false}}) {
      const int64_t d = pre_rope ? 64 : 16;
      auto c = make_config(1, 4, 2, d, quant, "full");
      if (pre_rope) c.key_storage = KeyStorage::kPreRoPE;
      c.block_tokens = 16;
      TorchCache m(c);
      const auto& L = CacheManagerAccess::layer(m.core(), 0);
      const Kind kind = cache::fused::classify(L.key_setup().formats.f[cache::StreamFormats::kMain]).kind;
      EXPECT_EQ(kind, pre_rope ? Kind::kTurboQuant : Kind::kNone) << quant << " D " << d;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(79);
      m.append(0, testing::randn({1, 2, 50, d}, gen), testing::randn({1, 2, 50, d}, gen), positions_range(0, 50));
      const auto q = testing::randn({1, 4, 1, d}, gen);
      EXPECT_TRUE(at::equal(testing::access_attend(m, 0, q, positions_range(49, 1), true),
                            testing::access_attend(m, 0, q, positions_range(49, 1), false)))
          << quant << (pre_rope ? " pre-RoPE keys" : " D 16");
    }
  }
}

// QJL keys (the qjl scheme; attend_fused.h): the estimate computed from the stored sign bits
// against S·q (once per step) with the group's outlier columns moved from S q_in to S_o q_out,
// against the generic path that decodes k̂ = √(π/2)/m·‖k_in‖·P_in Sᵀz + √(π/2)/m_o·‖k_out‖·P_out S_oᵀz_o.
// Sketch sizes that are and are not a multiple of 16 bits (the AVX-512 kernels' lanes), no
// outliers, several groups per block (block_tokens 64, g 16), head_dim 32/64/128/256, the
// scheme's int2 values (fused) and fp16 window, holes from eviction, both ISAs. Tolerance
// kFloatTol: the same algebra in float32, with S·q and the m-term sign dots summed in float
// where the generic path sums Sᵀz in double (measured worst case: RecordProperty worst_<isa>).
TEST(AttendFused, QjlKeysMatchTheGenericPath) {
  REQUIRE_FUSED();
  using Kind = cache::fused::KernelFormat::Kind;
  struct Case {
    std::string quant;
    Shape sh;
  };
  const std::vector<Case> cases = {
      {"qjl", {14, 2, 64, 64}},          {"qjl", {4, 1, 128, 32}},          {"qjl:m72:mo8:o4:r32", {9, 3, 32, 32}},
      {"qjl:o0:mo0:g16:r32", {7, 1, 64, 64}}, {"qjl:m128:mo40:g16:r16", {6, 2, 256, 64}},
      {"qjl:v4:vg64", {14, 2, 64, 32}}};
  for (const FusedIsa isa : runnable_isas()) {
    const IsaScope scope(isa);
    uint64_t seed = 500;
    double worst = 0;
    for (const auto& [quant, sh] : cases) {
      auto c = make_config(1, sh.hq, sh.hkv, sh.d, quant, "full");
      c.block_tokens = sh.block_tokens;
      TorchCache m(c);
      const auto& L = CacheManagerAccess::layer(m.core(), 0);
      ASSERT_EQ(cache::fused::classify(L.key_setup().formats.f[cache::StreamFormats::kMain]).kind, Kind::kQjl) << quant;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(++seed);
      int64_t pos = 0;
      bool differs = false;
      for (int64_t n : {1, 37, 150, 1, 80}) {
        m.append(0, testing::randn({1, sh.hkv, n, sh.d}, gen) * 1.5, testing::randn({1, sh.hkv, n, sh.d}, gen),
                 positions_range(pos, n));
        pos += n;
        for (int64_t tq : {int64_t{1}, std::min<int64_t>(n, 9)}) {
          const std::string where = quant + " D " + std::to_string(sh.d) + " T " + std::to_string(pos) + " T_q " +
                                    std::to_string(tq);
          const auto q = testing::randn({1, sh.hq, tq, sh.d}, gen);
          const auto qp = positions_range(pos - tq, tq);
          const double diff = max_abs(testing::access_attend(m, 0, q, qp, true) - testing::access_attend(m, 0, q, qp, false));
          worst = std::max(worst, diff);
          differs = differs || diff > 0;
          EXPECT_LE(diff, kFloatTol) << where;
        }
        m.end_step(StepKind::kPrefill);
      }
      EXPECT_TRUE(differs) << quant << ": the fused kernels must run";
    }
    RecordProperty(std::string("worst_") + cache::fused::isa_name(isa), std::to_string(worst));
  }
}

// QJL's Sᵀ belongs to the quantizer: classify() points KernelFormat::sketch_t at the
// transpose it built once (the same table on every call, so no step copies or transposes S),
// rotate_queries() hands that pointer to the kernels, and S·q is the same sums as S's rows give.
TEST(AttendFused, QjlSketchTransposeIsTheQuantizers) {
  using Kind = cache::fused::KernelFormat::Kind;
  TorchCache m(make_config(1, 4, 2, 64, "qjl:m72:mo8:o4:r32", "full"));
  const auto& f = CacheManagerAccess::layer(m.core(), 0).key_setup().formats.f[cache::StreamFormats::kMain];
  const cache::fused::KernelFormat a = cache::fused::classify(f), b = cache::fused::classify(f);
  ASSERT_EQ(a.kind, Kind::kQjl);
  ASSERT_NE(a.sketch_t, nullptr);
  EXPECT_EQ(a.sketch_t, b.sketch_t) << "Sᵀ rebuilt per classify()";
  EXPECT_EQ(a.sketch, b.sketch);
  const int64_t d = 64, mm = a.qjl_m;
  ASSERT_EQ(mm, 72);
  int64_t bad = 0;
  for (int64_t j = 0; j < mm; ++j) {
    for (int64_t c = 0; c < d; ++c) bad += a.sketch_t[c * mm + j] != a.sketch[j * d + c];
  }
  EXPECT_EQ(bad, 0) << "sketch_t is not Sᵀ";
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const auto q = testing::randn({3, d}, gen);
  cache::fused::Queries fq;
  cache::fused::prepare(q.data_ptr<float>(), 3, d, 0.125f, fq);
  cache::fused::rotate_queries(a, fq);
  EXPECT_EQ(fq.view.sketch_t, a.sketch_t);
  ASSERT_EQ(fq.qsketch.size(), static_cast<size_t>(3 * mm));
  const auto s = at::from_blob(const_cast<float*>(a.sketch), {mm, d}, at::kFloat).to(at::kDouble);
  const auto want = at::matmul(q.to(at::kDouble) * 0.125, s.t());
  const auto got = at::from_blob(fq.qsketch.data(), {3, mm}, at::kFloat).to(at::kDouble);
  EXPECT_LE(max_abs(got - want), 1e-5 * (1 + max_abs(want)));
}

// CacheConfig::fused_attention selects the path of the public attend(): false is exactly the
// generic per-block path, true exactly the fused one (here int4, where the two differ).
// int3 (two-plane codes) and rotated had(...) formats are not read by the fused kernels:
// classify() returns kNone, so the generic path (which decodes and rotates back) runs. No CPU
// feature is needed to classify.
TEST(AttendFused, Int3AndRotatedFormatsTakeTheGenericPath) {
  using Kind = cache::fused::KernelFormat::Kind;
  const auto kind = [](const std::string& spec) {
    const auto q = make_quantizer(spec);
    const int64_t cap = std::max<int64_t>(32, q->stored_layout(64).group_tokens);
    return cache::fused::classify(cache::BlockFormat(*q, 64, cap, nullptr)).kind;
  };
  for (const char* spec : {"int3", "int3:g32", "int3:g32:chan", "had(int4)", "had(fp32)", "had(int2:g32:chan)"}) {
    EXPECT_EQ(kind(spec), Kind::kNone) << spec;
  }
  EXPECT_EQ(kind("int4"), Kind::kIntToken);
  EXPECT_EQ(kind("int2:g32:chan"), Kind::kIntChannel);
  EXPECT_EQ(kind("fp32"), Kind::kF32);
  for (const char* spec : {"tq:b3", "tq:b2.5:prod:nc", "tq:b1"}) EXPECT_EQ(kind(spec), Kind::kTurboQuant) << spec;
  EXPECT_EQ(kind("polar"), Kind::kPolar);
}

TEST(AttendFused, ConfigSelectsThePath) {
  REQUIRE_FUSED();
  for (const FusedIsa isa : runnable_isas()) {
    const IsaScope scope(isa);
    // fp32 too: its blocks are read as stored by the fused kernels (another summation order
    // than the generic tile kernels over the same rows, so the outputs differ in rounding).
    for (const auto& [quant, fused] : {std::pair{"int4", false}, std::pair{"int4", true}, std::pair{"fp32", false},
                                       std::pair{"fp32", true}}) {
      auto c = make_config(1, 14, 2, 64, quant, "full");
      c.fused_attention = fused;
      TorchCache m(c);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
      m.append(0, testing::randn({1, 2, 200, 64}, gen), testing::randn({1, 2, 200, 64}, gen), positions_range(0, 200));
      const auto q = testing::randn({1, 14, 1, 64}, gen);
      const auto out = m.attend(0, q, positions_range(199, 1));
      EXPECT_TRUE(at::equal(out, testing::access_attend(m, 0, q, positions_range(199, 1), fused))) << quant;
      EXPECT_FALSE(at::equal(out, testing::access_attend(m, 0, q, positions_range(199, 1), !fused))) << quant;
    }
  }
}


// The int8 query (kvcache::set_attention_query("int8"), issue 37 decision 2): one int8 term per
// 32 dims for integer keys, allowed for a format when the attention output's extra error stays
// within 10 % of the error the format itself introduces:
//   ‖attend − ref(k̂, v̂)‖_F ≤ 0.1 · ‖ref(k̂, v̂) − ref(k, v)‖_F,
// ref = reference_attention in float64, k̂/v̂ the cache's dequantized K/V (get()), attend the
// fused path (AVX-512, and the AVX2 kernels, whose int8 query is the same arithmetic: qk_int_q8
// in attend_avx2.cpp), k/v the original K/V as a lossless fp32 cache holds them. Data:
// study::synthetic_qkv (q, k, v ~ N(0, 1), 4 key channels with offset and scale 8: the outlier
// structure KIVI and KVQuant report for real keys), 14 query / 2 KV heads, D 64, 1,024 tokens,
// the last 32 as queries (causal), two seeds pooled. Each format's two ratios (two-term and
// int8 query) are printed; docs/performance.md lists them (synthetic: int8 0.41, int8:g32 0.54,
// int4 0.025, int4:g32 0.032, int2 0.012, int4:g32:chan 0.29, KIVI-2 0.067, KIVI-4 0.30 with the
// int8 query; 5e-5 to 2e-3 with the two-term one; the default model's: the same verdicts). Formats outside
// kInt8QueryTokenBits / kInt8QueryChannelBits must FAIL the bound (so they keep the two-term
// query), those inside must pass it; under kInt8 the former give the two-term output bit for bit.
// The AVX2 kernels cannot take the int8 query for 8-bit codes (vpmaddubsw would saturate): there
// int8 keys keep the float query even under kInt8Everywhere, so their two ratios are equal.
// The same on the default model's captured K/V: Int8QueryWithinTheErrorBoundOnTheDefaultModel.

/// The integer key formats of the bound, and whether the int8 query is used for each.
struct Q8Format {
  std::string spec;
  bool channel;
  int bits;
  bool allowed() const {
    const uint32_t mask = channel ? cache::fused::kInt8QueryChannelBits : cache::fused::kInt8QueryTokenBits;
    return ((mask >> bits) & 1u) != 0;
  }
  /// Whether `isa`'s kernels can dot these keys with the int8 query at all (kInt8Everywhere).
  bool one_term_runs(FusedIsa isa) const {
    return isa == FusedIsa::kAvx512 || ((cache::fused::kInt8QueryAvx2Bits >> bits) & 1u) != 0;
  }
};
const std::vector<Q8Format>& q8_formats() {
  static const std::vector<Q8Format> f = {{"int8", false, 8},          {"int8:g32", false, 8},
                                          {"int4", false, 4},          {"int4:g32", false, 4},
                                          {"int2", false, 2},          {"int4:g32:chan", true, 4},
                                          {"kivi:k2:v2:g32:r128", true, 2}, {"kivi:k4:v4:g32:r128", true, 4}};
  return f;
}

/// The bound's two ratios of format `f` over `samples` (pooled): ‖attend − ref(k̂, v̂)‖ /
/// ‖ref(k̂, v̂) − ref(k, v)‖ with the two-term query (first) and the int8 query (second), the
/// last `tq` tokens of each sample as queries. Checks that QueryRounding::kInt8 picks the int8
/// query exactly where the format is allowed it.
std::pair<double, double> q8_ratios(const Q8Format& f, const std::vector<study::QkvSample>& samples, int64_t tq) {
  using cache::fused::QueryRounding;
  double num_two = 0, num_one = 0, den = 0;
  for (const study::QkvSample& smp : samples) {
    const int64_t hq = smp.q.size(1), hkv = smp.k.size(1), t = smp.k.size(2), d = smp.k.size(3);
    // The original K/V as a cache holds them (a lossless fp32 cache's get()), then the
    // format's dequantized ones.
    TorchCache lossless(make_config(1, hq, hkv, d, "fp32", "full"));
    lossless.append(0, smp.k, smp.v, positions_range(0, t));
    TorchCache m(make_config(1, hq, hkv, d, f.spec, "full"));
    m.append(0, smp.k, smp.v, positions_range(0, t));
    m.end_step(StepKind::kPrefillEnd);
    const at::Tensor q = smp.q.narrow(2, t - tq, tq).contiguous();
    const at::Tensor qpos = positions_range(t - tq, tq);
    const at::Tensor kpos = positions_range(0, t).unsqueeze(0).expand({hkv, t}).contiguous();
    const auto dbl = [](const at::Tensor& x) { return x.to(at::kDouble); };
    const auto orig = lossless.get(0);
    const auto kv = m.get(0);
    const at::Tensor ref = reference_attention(dbl(q), dbl(orig.k), dbl(orig.v), kpos, qpos);
    const at::Tensor ref_hat = reference_attention(dbl(q), dbl(kv.k), dbl(kv.v), kpos, qpos);
    cache::fused::set_query_rounding(QueryRounding::kTwoTerm);
    const at::Tensor two = dbl(m.attend(0, q, qpos));
    cache::fused::set_query_rounding(QueryRounding::kInt8Everywhere);
    const at::Tensor one = dbl(m.attend(0, q, qpos));
    cache::fused::set_query_rounding(QueryRounding::kInt8);
    const at::Tensor chosen = dbl(m.attend(0, q, qpos));
    cache::fused::set_query_rounding(QueryRounding::kTwoTerm);
    EXPECT_TRUE(at::equal(chosen, f.allowed() ? one : two))
        << f.spec << ": kInt8 must pick the " << (f.allowed() ? "int8" : "two-term") << " query";
    num_two += (two - ref_hat).pow(2).sum().item<double>();
    num_one += (one - ref_hat).pow(2).sum().item<double>();
    den += (ref_hat - ref).pow(2).sum().item<double>();
  }
  return {std::sqrt(num_two / den), std::sqrt(num_one / den)};
}

/// Every format's ratios over `samples` against the bound: the two-term query at float
/// accuracy (≤ 0.01), the int8 query within 0.1 for the formats allowed it and above 0.1 for the
/// others (which keep the two-term query). Prints the figures docs/performance.md lists.
void check_q8_bound(const std::vector<study::QkvSample>& samples, int64_t tq, const char* data, FusedIsa isa) {
  for (const Q8Format& f : q8_formats()) {
    const auto [r_two, r_one] = q8_ratios(f, samples, tq);
    if (f.one_term_runs(isa)) {
      std::printf("[ int8 query ] %s %s %-20s %s %.2e  int8 %.3f  (bound 0.1)\n", cache::fused::isa_name(isa), data,
                  f.spec.c_str(), isa == FusedIsa::kAvx2 ? "float" : "two-term", r_two, r_one);
    } else {
      std::printf("[ int8 query ] %s %s %-20s float %.2e  int8 not taken (8-bit codes)\n", cache::fused::isa_name(isa), data,
                  f.spec.c_str(), r_two);
    }
    EXPECT_LE(r_two, 0.01) << data << " " << f.spec << ": the two-term query is at float accuracy";
    if (!f.one_term_runs(isa)) {
      EXPECT_EQ(r_one, r_two) << data << " " << f.spec << ": these kernels keep the exact query for it";
      EXPECT_FALSE(f.allowed()) << f.spec << ": allowed the int8 query where the AVX2 kernels cannot take it";
    } else if (f.allowed()) {
      EXPECT_LE(r_one, 0.1) << data << " " << f.spec << ": the int8 query is allowed for it but breaks the bound";
    } else {
      EXPECT_GT(r_one, 0.1) << data << " " << f.spec << ": the int8 query keeps the bound here; allow it (kInt8Query*Bits)";
    }
  }
}

TEST(AttendFused, Int8QueryWithinTheErrorBound) {
  REQUIRE_FUSED();
  const std::vector<study::QkvSample> samples = {study::synthetic_qkv(1, 14, 2, 1024, 64),
                                                 study::synthetic_qkv(2, 14, 2, 1024, 64)};
  for (const FusedIsa isa : runnable_isas()) {
    const IsaScope scope(isa);
    check_q8_bound(samples, 32, "synthetic", isa);
  }
}

// The same bound on the study's captured K/V: the embedded default model (models/
// kvstudy-default.pt: 4 layers, 4 query / 2 KV heads, head_dim 32) run unmanaged in fp32 over the
// first 512 tokens of the study's passage (study::make_model_evaluator's capture_qkv, as
// `kv_study` captures them), every layer, the last 64 tokens as queries.
TEST(AttendFused, Int8QueryWithinTheErrorBoundOnTheDefaultModel) {
  REQUIRE_FUSED();
  study::ModelEvaluatorOptions o;
  o.model_path = std::string(KVCACHE_SOURCE_DIR) + "/models/kvstudy-default.pt";
  o.threads = 1;
  o.text_tokens = 600;
  o.capture_tokens = 512;
  const std::vector<study::QkvSample> samples = study::make_model_evaluator(o)->capture_qkv();
  ASSERT_EQ(samples.size(), 4u);
  ASSERT_EQ(samples[0].k.size(2), 512);
  for (const FusedIsa isa : runnable_isas()) {
    const IsaScope scope(isa);
    check_q8_bound(samples, 64, "default-model", isa);
  }
}

// The int8 query's reference twin for per-token integer keys: fused(q) with one int8 term per
// 32 dims equals the generic path over the one-term rounded query q1 = qs·round(q/qs) to float
// rounding (kFloatTol, as the two-term query's twin), every integer width and group, head_dim 64
// and 128, T not a multiple of the block, a decode query and a prefill chunk; and it is not the
// exact output (the option reaches the kernel). Both ISAs: the AVX2 kernels take the int8 query
// for 4- and 2-bit codes (vpmaddubsw, qk_int_q8); their 8-bit keys keep the float query, so
// there the int8 query's output is the exact one bit for bit, and generic(q)'s to float rounding.
TEST(AttendFused, Int8QueryMatchesTheGenericPathOfTheRoundedQuery) {
  REQUIRE_FUSED();
  using cache::fused::QueryRounding;
  for (const FusedIsa isa : runnable_isas()) {
    const IsaScope scope(isa);
    for (const std::string quant : {"int8", "int8:g32", "int4", "int4:g32", "int2", "int2:g32"}) {
      const bool one_runs = isa == FusedIsa::kAvx512 || quant.rfind("int8", 0) != 0;
      for (const int64_t d : {int64_t{64}, int64_t{128}}) {
        auto c = make_config(1, 14, 2, d, quant, "full");
        c.block_tokens = 32;
        TorchCache m(c);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(31);
        m.append(0, testing::randn({1, 2, 301, d}, gen), testing::randn({1, 2, 301, d}, gen), positions_range(0, 301));
        for (const int64_t tq : {int64_t{1}, int64_t{5}}) {
          const auto q = testing::randn({1, 14, tq, d}, gen);
          const auto pos = positions_range(301 - tq, tq);
          cache::fused::set_query_rounding(QueryRounding::kInt8Everywhere);
          const auto fast = testing::access_attend(m, 0, q, pos, true);
          cache::fused::set_query_rounding(QueryRounding::kTwoTerm);
          const auto exact = testing::access_attend(m, 0, q, pos, true);
          const std::string where = quant + " D " + std::to_string(d) + " T_q " + std::to_string(tq);
          if (!one_runs) {
            EXPECT_TRUE(at::equal(fast, exact)) << where << ": AVX2 keeps the float query for 8-bit keys";
            EXPECT_LE(max_abs(fast - testing::access_attend(m, 0, q, pos, false)), kFloatTol) << where;
            continue;
          }
          const auto ref = testing::access_attend(m, 0, rounded_query(q, true), pos, false);
          EXPECT_LE(max_abs(fast - ref), kFloatTol) << where;
          EXPECT_GT(max_abs(fast - exact), 10 * kFloatTol) << where << ": the int8 query did not reach the kernel";
        }
      }
    }
  }
}

// The AVX2 kernels' int8 query (attend_avx2.cpp, qk_int_q8: vpmaddubsw/vpmaddwd, no VNNI), under
// kInt8Everywhere so that the 4-bit per-channel keys (kept on the exact query by kInt8) are
// covered too; int8 keys are the control (AVX2 keeps their float query). The cases: the integer
// formats of MatchesTheGenericPathForEveryFormat over its shapes (odd head counts, H_q = H_kv,
// one-token blocks, T never a multiple of the block, decode and prefill queries), the group
// sizes of WideHeadsAndGroupSizes at head_dim 256 and 96, and holes left by eviction.
// fn(cache, q, positions, where, quant) per query.
template <class Fn>
void for_q8_cases(Fn&& fn) {
  const std::vector<std::string> quants = {"int4",          "int2",          "int4:g32",            "int2:g32",
                                           "int4:g32:chan", "int2:g32:chan", "kivi:k2:v2:g32:r128", "kivi:k4:v4:g32:r32",
                                           "int8"};
  // Under the sanitizers three shapes keep every path: odd head counts, a block tail, one-token blocks.
  const std::vector<Shape> shapes = kSanitized ? std::vector<Shape>{{9, 3, 32, 32}, {4, 1, 128, 96}, {6, 2, 64, 1}}
                                               : std::vector<Shape>{{14, 2, 64, 64}, {9, 3, 32, 32}, {4, 1, 128, 96},
                                                                    {7, 7, 64, 32}, {6, 2, 64, 1}};
  uint64_t seed = 700;
  for (const auto& quant : quants) {
    for (const auto& sh : shapes) {
      if (sh.block_tokens == 1 && channel_keys(quant)) continue;  // a per-channel block is one group
      auto c = make_config(1, sh.hq, sh.hkv, sh.d, quant, "full");
      c.block_tokens = sh.block_tokens;
      TorchCache m(c);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(++seed);
      int64_t pos = 0;
      for (int64_t n : {1, 37, 250, 1, 1, 80}) {  // T reaches 370
        m.append(0, testing::randn({1, sh.hkv, n, sh.d}, gen) * 1.5, testing::randn({1, sh.hkv, n, sh.d}, gen),
                 positions_range(pos, n));
        pos += n;
        for (int64_t tq : {int64_t{1}, std::min<int64_t>(n, 9)}) {
          const auto q = testing::randn({1, sh.hq, tq, sh.d}, gen);
          fn(m, q, positions_range(pos - tq, tq),
             quant + " H_q " + std::to_string(sh.hq) + " H_kv " + std::to_string(sh.hkv) + " D " + std::to_string(sh.d) +
                 " block " + std::to_string(sh.block_tokens) + " T " + std::to_string(pos) + " T_q " + std::to_string(tq),
             quant);
        }
        m.end_step(StepKind::kPrefill);
      }
    }
  }
  const std::vector<std::pair<std::string, int64_t>> wide = {{"int4:g64", 256},  {"int4:g128", 256},      {"int2:g64", 256},
                                                             {"int2:g128", 256}, {"int2:g256", 256},      {"int4:g32:chan", 256},
                                                             {"int4:g32", 96},   {"int2:g32:chan", 96}};
  for (const auto& [quant, d] : wide) {
    auto c = make_config(1, 7, 1, d, quant, "full");
    c.block_tokens = 64;
    TorchCache m(c);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(++seed);
    m.append(0, testing::randn({1, 1, 101, d}, gen) * 1.5, testing::randn({1, 1, 101, d}, gen), positions_range(0, 101));
    for (int64_t tq : {1, 3}) {
      fn(m, testing::randn({1, 7, tq, d}, gen), positions_range(101 - tq, tq),
         quant + " D " + std::to_string(d) + " T_q " + std::to_string(tq), quant);
    }
  }
  for (const std::string quant : {"int4", "int2:g32", "kivi:k2:v2:g32:r128"}) {
    auto c = make_config(1, 14, 2, 64, quant, "random:seed9@300", 4000);
    c.block_tokens = 32;
    TorchCache m(c);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(++seed);
    m.append(0, testing::randn({1, 2, 400, 64}, gen), testing::randn({1, 2, 400, 64}, gen), positions_range(0, 400));
    m.end_step(StepKind::kPrefillEnd);
    for (int64_t step = 0; step < 12; ++step) {
      const int64_t p = 400 + step;
      m.append(0, testing::randn({1, 2, 1, 64}, gen), testing::randn({1, 2, 1, 64}, gen), positions_range(p, 1));
      fn(m, testing::randn({1, 14, 1, 64}, gen), positions_range(p, 1), quant + " holes step " + std::to_string(step),
         quant);
      m.end_step(StepKind::kDecode);
    }
    const auto st = CacheManagerAccess::stream(m.core(), 0, false);
    EXPECT_GT(st.dead_slots[0] + st.dead_slots[1], 0) << quant << ": the case must have holes";
  }
}

/// Attention of `m`'s layer 0 for q under `isa`'s kernels with the int8 query everywhere.
at::Tensor attend_q8(FusedIsa isa, const TorchCache& m, const at::Tensor& q, const at::Tensor& qp) {
  const IsaScope scope(isa);
  cache::fused::set_query_rounding(cache::fused::QueryRounding::kInt8Everywhere);
  const auto out = testing::access_attend(m, 0, q, qp, /*fused=*/true);
  cache::fused::set_query_rounding(cache::fused::QueryRounding::kTwoTerm);
  return out;
}

// On every CPU with the AVX2 kernels: their int8 query against its reference twin — per-token
// keys the generic path over the one-term rounded query (kFloatTol, as
// Int8QueryMatchesTheGenericPathOfTheRoundedQuery), per-channel keys generic(q) within the bound
// the one-term fold's score change δ = max|(w − w1)·c| implies, (e^{2δ} − 1)·max|v̂| + kFloatTol
// (their scores are held to the exact formula in ChannelKeyScoresFollowTheFoldedQueryFormula),
// and int8 keys generic(q) itself (the float query).
TEST(AttendFused, Int8QueryAvx2MatchesItsReferenceTwin) {
  if (!runnable_isas_has(FusedIsa::kAvx2)) GTEST_SKIP() << "CPU without AVX2/FMA/F16C/BMI2: no AVX2 kernels";
  for_q8_cases([](const TorchCache& m, const at::Tensor& q, const at::Tensor& qp, const std::string& where,
                  const std::string& quant) {
    const auto fast = attend_q8(FusedIsa::kAvx2, m, q, qp);
    if (quant == "int8") {
      EXPECT_LE(max_abs(fast - testing::access_attend(m, 0, q, qp, false)), kFloatTol) << where;
    } else if (channel_keys(quant)) {
      const double tol = (std::exp(2 * channel_delta(m, q, /*one_term=*/true)) - 1) * max_abs(m.get(0).v) + kFloatTol;
      EXPECT_LE(max_abs(fast - testing::access_attend(m, 0, q, qp, false)), tol) << where;
    } else {
      EXPECT_LE(max_abs(fast - testing::access_attend(m, 0, rounded_query(q, true), qp, false)), kFloatTol) << where;
    }
  });
}

// Where the CPU runs both: the AVX2 kernels' int8 query against the AVX-512 kernels' (VNNI) on
// the same caches. Outputs within kFloatTol (the same scores, p·v summed over 8 lanes instead of
// 16); and every main key block's scores read directly: per-token keys bit for bit (the same int8
// terms, exact integer dots, the same two FMAs per chunk in the same order: qk_int_q8's
// comment), per-channel keys to 1e-6 relative (the same terms; Σ_d q_d z_d summed in another
// order). int8 keys: AVX2 keeps the float query, so only its outputs are compared, with the
// two-term bound of MatchesTheGenericPathForEveryFormat's rounded query.
TEST(AttendFused, Int8QueryAvx2MatchesAvx512) {
  if (!runnable_isas_has(FusedIsa::kAvx512) || !runnable_isas_has(FusedIsa::kAvx2)) {
    GTEST_SKIP() << "needs the AVX-512 and the AVX2 kernels (this CPU runs " << cache::fused::isa_name(cache::fused::best_isa())
                 << ")";
  }
  int64_t blocks_checked = 0;
  for_q8_cases([&](const TorchCache& m, const at::Tensor& q, const at::Tensor& qp, const std::string& where,
                   const std::string& quant) {
    const auto a2 = attend_q8(FusedIsa::kAvx2, m, q, qp);
    const auto a5 = attend_q8(FusedIsa::kAvx512, m, q, qp);
    if (quant == "int8") {  // AVX2: float query; AVX-512: one int8 term — compare each to its own twin
      EXPECT_LE(max_abs(a5 - testing::access_attend(m, 0, rounded_query(q, true), qp, false)), kFloatTol) << where;
      return;
    }
    EXPECT_LE(max_abs(a2 - a5), kFloatTol) << where;
    // Scores of every main key block of the layer, for the step's query rows of each KV head.
    if (q.size(2) != 1) return;  // decode queries: enough rows (the head's G query heads)
    const auto& L = CacheManagerAccess::layer(m.core(), 0);
    const int64_t hq = q.size(1), d = q.size(3), g = hq / L.num_heads();
    for (int64_t h = 0; h < L.num_heads(); ++h) {
      const auto rows = q[0].narrow(0, h * g, g).reshape({g, d}).contiguous();
      cache::fused::set_query_rounding(cache::fused::QueryRounding::kInt8Everywhere);
      cache::fused::Queries fq;
      cache::fused::prepare(rows.data_ptr<float>(), g, d, inv_sqrt(d), fq);
      cache::fused::set_query_rounding(cache::fused::QueryRounding::kTwoTerm);
      const auto& list = L.k(h).quant;
      for (const auto& b : list.blocks()) {
        if (b.format != cache::StreamFormats::kMain) continue;
        cache::fused::RawTokens raw;
        raw.block = list.format(b).pool->data(b.id);
        raw.kf = cache::fused::classify(list.format(b));
        std::vector<int32_t> slots;
        for (int32_t sl = 0; sl < b.filled; ++sl) {
          if (b.alive(sl)) slots.push_back(sl);
        }
        raw.slots = slots.data();
        const auto n = static_cast<int64_t>(slots.size());
        std::vector<float> s2(static_cast<size_t>(g * n)), s5(s2.size());
        {
          const IsaScope scope(FusedIsa::kAvx2);
          cache::fused::scores(fq, 0, g, raw, n, s2.data(), n);
        }
        {
          const IsaScope scope(FusedIsa::kAvx512);
          cache::fused::scores(fq, 0, g, raw, n, s5.data(), n);
        }
        const auto t2 = at::from_blob(s2.data(), {g, n}, at::kFloat).to(at::kDouble);
        const auto t5 = at::from_blob(s5.data(), {g, n}, at::kFloat).to(at::kDouble);
        if (channel_keys(quant)) {
          EXPECT_LE(max_abs(t2 - t5), 1e-6 * (1 + max_abs(t5))) << where << " head " << h;
        } else {
          EXPECT_TRUE(s2 == s5) << where << " head " << h << ": per-token scores differ by " << max_abs(t2 - t5);
        }
        ++blocks_checked;
      }
    }
  });
  EXPECT_GT(blocks_checked, 100);
}

// set_attention_query: the vocabulary, the default, and a refusal that names the value.
TEST(AttendFused, AttentionQuerySetter) {
  const std::string before = attention_query();  // KVCACHE_ATTENTION_QUERY's, else the default
  if (std::getenv("KVCACHE_ATTENTION_QUERY") == nullptr) {
    EXPECT_EQ(before, "exact");
  }
  set_attention_query("int8");
  EXPECT_EQ(attention_query(), "int8");
  EXPECT_EQ(cache::fused::query_rounding(), cache::fused::QueryRounding::kInt8);
  set_attention_query("");
  EXPECT_EQ(attention_query(), "exact");
  try {
    set_attention_query("q8", "KVCACHE_ATTENTION_QUERY");
    ADD_FAILURE() << "q8 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("KVCACHE_ATTENTION_QUERY=q8: expected exact"), std::string::npos) << e.what();
  }
  EXPECT_EQ(attention_query(), "exact");  // a refused value changes nothing
  set_attention_query(before);
}

}  // namespace
}  // namespace kvcache
