// SPDX-License-Identifier: Apache-2.0
// The CacheManager under hostile and careless use: random valid and invalid calls (NaN/Inf in
// K, V, q or probabilities, wrong shapes/dtypes/devices, batch != 1, layers out of range, bad
// positions, calls in the wrong order, resets whose budget does not fit), check_invariants()
// after each, and a rejected call changes nothing. "Nothing" is checked two ways: the manager's
// Snapshot is the same before and after the rejected call, and a twin manager fed only the
// accepted calls shows the same state after every step (so a rejected call cannot have moved
// hidden state either, such as a policy's scores or its random stream).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <typeinfo>
#include <vector>

#include "cache_test_util.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/torch.h"

namespace kvcache {
namespace {

using testing::make_config;
using testing::positions_range;
using testing::Snapshot;

/// Runs `call`, which must throw `Exc` (exactly that class, never InternalError or a LibTorch
/// error), leave `m` unchanged and its invariants intact. Returns the message.
template <typename Exc>
std::string expect_rejected(TorchCache& m, const std::function<void()>& call, const std::string& where) {
  const Snapshot before(m);
  std::string message;
  try {
    call();
    ADD_FAILURE() << where << ": accepted";
  } catch (const Exc& e) {
    message = e.what();
    EXPECT_EQ(typeid(e), typeid(Exc)) << where << ": " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << where << ": threw " << typeid(e).name() << ": " << e.what();
  }
  before.expect_unchanged(m, where);
  m.check_invariants();
  return message;
}

at::Tensor randn(std::vector<int64_t> shape, at::Generator& gen) { return testing::randn(std::move(shape), gen); }

/// A valid K or V tensor for [1, H_kv, n, D] in one of the accepted input forms: float32,
/// float16, bfloat16, or a non-contiguous float32 view.
at::Tensor valid_kv(int64_t hkv, int64_t n, int64_t d, int form, at::Generator& gen) {
  switch (form) {
    case 1:
      return randn({1, hkv, n, d}, gen).to(at::kHalf);
    case 2:
      return randn({1, hkv, n, d}, gen).to(at::kBFloat16);
    case 3:
      return randn({1, n, hkv, d}, gen).transpose(1, 2);  // strided
    default:
      return randn({1, hkv, n, d}, gen);
  }
}

/// One invalid append of `n` tokens at layer `l` (positions from p0), chosen by `kind`.
struct BadAppend {
  at::Tensor k, v, pos;
  int64_t layer;
  std::string what;
};

BadAppend bad_append(int kind, int64_t l, int64_t layers, int64_t hkv, int64_t n, int64_t d, int64_t p0,
                     std::mt19937& rng, at::Generator& gen) {
  BadAppend b{randn({1, hkv, n, d}, gen), randn({1, hkv, n, d}, gen), positions_range(p0, n), l, ""};
  const int64_t h = static_cast<int64_t>(rng() % static_cast<uint32_t>(hkv));
  const int64_t t = static_cast<int64_t>(rng() % static_cast<uint32_t>(n));
  const int64_t c = static_cast<int64_t>(rng() % static_cast<uint32_t>(d));
  switch (kind) {
    case 0:
      b.k[0][h][t][c] = std::nanf("");
      b.what = "NaN in k";
      break;
    case 1:
      b.v[0][h][t][c] = std::numeric_limits<float>::infinity();
      b.what = "+Inf in v";
      break;
    case 2:
      b.k = b.k.to(at::kHalf);
      b.k[0][h][t][c] = -std::numeric_limits<float>::infinity();
      b.v = b.v.to(at::kHalf);
      b.what = "-Inf in float16 k";
      break;
    case 3:
      b.k = b.k.to(at::kBFloat16);
      b.v = b.v.to(at::kBFloat16);
      b.v[0][h][t][c] = std::nanf("");
      b.what = "NaN in bfloat16 v";
      break;
    case 4:
      b.k = b.k.to(at::kDouble);
      b.v = b.v.to(at::kDouble);
      b.what = "float64";
      break;
    case 5:
      b.k = at::ones({1, hkv, n, d}, at::kInt);
      b.what = "int32 k";
      break;
    case 6:
      b.k = randn({2, hkv, n, d}, gen);
      b.v = randn({2, hkv, n, d}, gen);
      b.what = "batch 2";
      break;
    case 7:
      b.k = randn({1, hkv + 1, n, d}, gen);
      b.v = randn({1, hkv + 1, n, d}, gen);
      b.what = "H_kv + 1";
      break;
    case 8:
      b.v = randn({1, hkv, n, d + 1}, gen);
      b.what = "D + 1 in v";
      break;
    case 9:
      b.k = randn({hkv, n, d}, gen);
      b.what = "3-d k";
      break;
    case 10:
      b.v = randn({1, hkv, n + 1, d}, gen);
      b.what = "v longer than k";
      break;
    case 11:
      b.pos = positions_range(p0, n).to(at::kInt);
      b.what = "int32 positions";
      break;
    case 12:
      b.pos = positions_range(p0, n + 1);
      b.what = "positions longer than T";
      break;
    case 13:
      b.pos = positions_range(p0 - 1, n);
      b.what = "positions overlapping the last one";
      break;
    case 14:
      b.pos = positions_range(p0, n).flip(0);
      b.what = "decreasing positions";
      if (n == 1) b.pos = at::full({1}, p0 - 1, at::kLong);
      break;
    case 15:
      b.layer = (rng() % 2) ? layers : -1;
      b.what = "layer out of range";
      break;
    case 16:
      b.k = at::Tensor();
      b.what = "undefined k";
      break;
    default:
      b.pos = at::full({n}, std::numeric_limits<int64_t>::max(), at::kLong);
      b.what = "position 2^63 - 1";
      if (n > 1) b.pos = positions_range(p0, n) + (std::numeric_limits<int64_t>::max() - p0 - n + 1);
      break;
  }
  return b;
}
constexpr int kBadAppendKinds = 18;

/// Invalid probabilities `[1, H_q, n, t]` for observe_attention, chosen by `kind`.
at::Tensor bad_probs(int kind, int64_t hq, int64_t n, int64_t t, at::Generator& gen, std::string* what) {
  at::Tensor p = testing::random_probs(1, hq, n, t, gen);
  switch (kind) {
    case 0:
      p.fill_(std::nanf(""));
      *what = "all-NaN probabilities";
      break;
    case 1:
      p[0][0][n - 1][0] = -0.25f;
      *what = "a negative probability";
      break;
    case 2:
      p[0][hq - 1][0][t - 1] = 1.5f;
      *what = "a probability > 1";
      break;
    case 3:
      p = p * 1.5;
      *what = "rows summing to 1.5";
      break;
    case 4:
      p = testing::random_probs(1, hq, n, t + 1, gen);
      *what = "T_res + 1 keys";
      break;
    case 5:
      p = testing::random_probs(1, hq + 1, n, t, gen);
      *what = "H_q + 1 heads";
      break;
    case 6:
      p = p.to(at::kDouble);
      *what = "float64 probabilities";
      break;
    default:
      p[0][0][0][0] = std::numeric_limits<float>::infinity();
      *what = "+Inf";
      break;
  }
  return p;
}
constexpr int kBadProbKinds = 8;

/// Asserts the dequantized cache and an attention output are finite (finite in, finite out).
void expect_finite(const TorchCache& m, const std::string& where) {
  for (int64_t l = 0; l < m.config().num_layers; ++l) {
    const auto& pos = m.tokens(l).positions;
    bool uniform = true;
    for (const auto& p : pos) uniform = uniform && p.size() == pos[0].size();
    if (!uniform) continue;
    const TensorLayerKV g = m.get(l);
    EXPECT_TRUE(at::isfinite(g.k).all().item<bool>()) << where << " layer " << l;
    EXPECT_TRUE(at::isfinite(g.v).all().item<bool>()) << where << " layer " << l;
  }
}

// Random sequences of valid and invalid calls over quantizers × policies × key storage; the
// twin gets only the valid calls. After every rejected call: unchanged, invariants hold; after
// every step: victim and twin identical, contents finite.
TEST(CacheHostile, RandomValidAndInvalidCalls) {
  const std::vector<std::string> quants = {"fp32", "fp16", "bf16", "int4:g4", "int2:g8:chan", "fp8:e4m3:scaled",
                                           "kivi:k2:v4:g4:r8", "gear:b2:g4:s0.25:r1:loop1:nb8",
                                           "gear:b2:g4:s0.25:r1:loop1:nb8:rp2:whole"};
  const std::vector<std::string> policies = {"full",         "window@12", "sink:s2@50%",       "h2o@12",
                                             "random:seed3@12", "tova@12", "snapkv:w4@90%", "pyramid:w4:b2@90%"};
  const int64_t layers = 2, hq = 4, hkv = 2, d = 8, context = 40;
  uint64_t seed = 7;
  int64_t rejected = 0;
  for (const auto& quant : quants) {
    for (const auto& policy : policies) {
      for (int pre_rope = 0; pre_rope < 2; ++pre_rope) {
        auto c = make_config(layers, hq, hkv, d, quant, policy, context);
        if (pre_rope) c.key_storage = KeyStorage::kPreRoPE;
        TorchCache m(c);
        TorchCache twin(c);
        std::mt19937 rng(static_cast<uint32_t>(++seed));
        auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
        const std::string where0 = quant + " " + policy + (pre_rope ? " pre-RoPE" : "");
        auto reject = [&](const std::function<void()>& call, const std::string& what) {
          ++rejected;
          return expect_rejected<InvalidArgument>(m, call, where0 + ": " + what);
        };
        int64_t written = 0;
        for (int step = 0; written < context; ++step) {
          const bool prefill = step < 3;
          const int64_t n = std::min<int64_t>(prefill ? 3 + static_cast<int64_t>(rng() % 5) : 1, context - written);
          const std::string where = where0 + " step " + std::to_string(step);
          for (int64_t l = 0; l < layers; ++l) {
            const int64_t p0 = m.next_position(l);
            ASSERT_EQ(p0, twin.next_position(l)) << where;
            for (int tries = static_cast<int>(rng() % 3); tries > 0; --tries) {
              const BadAppend b = bad_append(static_cast<int>(rng() % kBadAppendKinds), l, layers, hkv, n, d, p0, rng, gen);
              reject([&] { m.append(b.layer, b.k, b.v, b.pos); }, "append with " + b.what);
            }
            const at::Tensor k = valid_kv(hkv, n, d, static_cast<int>(rng() % 4), gen) * 2.0;
            const at::Tensor v = valid_kv(hkv, n, d, static_cast<int>(rng() % 4), gen);
            m.append(l, k, v, positions_range(p0, n));
            twin.append(l, k, v, positions_range(p0, n));
            m.check_invariants();
            const int64_t t = testing::physical_length(m, l);
            // Rejected attention calls first (none may reach the policy) ...
            if (rng() % 2) {
              std::string what;
              const at::Tensor bad = bad_probs(static_cast<int>(rng() % kBadProbKinds), hq, n, t, gen, &what);
              reject([&] { m.observe_attention(l, bad); }, "observe_attention with " + what);
            }
            if (rng() % 3 == 0) {
              at::Tensor q = randn({1, hq, n, d}, gen);
              q[0][static_cast<int64_t>(rng() % hq)][n - 1][0] = std::nanf("");
              reject([&] { (void)m.attend(l, q, positions_range(p0, n)); }, "attend with a NaN query");
              reject([&] { (void)m.attend(l, randn({1, hq, n, d}, gen), positions_range(p0, n + 1)); },
                     "attend with T_q + 1 positions");
              reject([&] { (void)m.attend(layers, randn({1, hq, n, d}, gen), positions_range(p0, n)); },
                     "attend on a layer out of range");
            }
            // ... then the valid one, the same for both.
            if (m.policy().needs_attention() && rng() % 2) {
              const at::Tensor probs = testing::random_probs(1, hq, n, t, gen);
              m.observe_attention(l, probs);
              twin.observe_attention(l, probs);
              reject([&] { m.observe_attention(l, probs); }, "a second observation in one step");
              reject([&] { m.append(l, k, v, positions_range(p0 + n, n)); }, "append after the step's observation");
            } else {
              const at::Tensor q = randn({1, hq, n, d}, gen);
              const at::Tensor out = m.attend(l, q, positions_range(p0, n));
              EXPECT_TRUE(at::equal(out, twin.attend(l, q, positions_range(p0, n)))) << where;
              EXPECT_TRUE(at::isfinite(out).all().item<bool>()) << where;
            }
          }
          if (rng() % 3 == 0) {
            reject([&] { m.end_step(static_cast<StepKind>(7)); }, "end_step with an unknown step kind");
          }
          const StepKind kind = step == 2 ? StepKind::kPrefillEnd : (prefill ? StepKind::kPrefill : StepKind::kDecode);
          m.end_step(kind);
          twin.end_step(kind);
          m.check_invariants();
          written += n;
          if (rng() % 4 == 0) {
            reject([&] { m.reset(-1); }, "reset(-1)");
            reject([&] { m.reset(kMaxTokens + 1); }, "reset(kMaxTokens + 1)");
            if (policy == "sink:s2@50%") {
              // 50% of 3 tokens is 1 token: no room after 2 sinks.
              ++rejected;
              expect_rejected<CapacityError>(m, [&] { m.reset(3); }, where + ": reset(3) under sink:s2@50%");
            }
          }
          Snapshot(twin).expect_same(Snapshot(m), where + ": victim vs twin");
          expect_finite(m, where);
          if (::testing::Test::HasFailure()) return;  // one sequence's report is enough
        }
      }
    }
  }
  EXPECT_GT(rejected, 1000);  // the sequences did try
}

// A step whose plan fails on a later layer (its attention was not observed) changes nothing —
// neither the cache nor the policy: observing the missing layer and ending the step again
// gives what a manager that never failed has. (SnapKV once counted the layers inside plan():
// the retry then skipped the compression altogether.)
TEST(CacheHostile, EndStepRejectedForAMissingObservationChangesNothing) {
  for (const std::string policy : {"snapkv:w2@8", "pyramid:w2:b2@8", "h2o@6", "tova@6"}) {
    auto c = make_config(3, 4, 2, 8, "fp32", policy, 12);
    TorchCache m(c);
    TorchCache twin(c);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    const int64_t n = 10;
    std::vector<at::Tensor> probs;
    for (int64_t l = 0; l < 3; ++l) {
      const at::Tensor k = randn({1, 2, n, 8}, gen), v = randn({1, 2, n, 8}, gen);
      m.append(l, k, v, positions_range(0, n));
      twin.append(l, k, v, positions_range(0, n));
      probs.push_back(testing::random_probs(1, 4, n, n, gen));
      twin.observe_attention(l, probs.back());
      if (l < 2) m.observe_attention(l, probs.back());  // the last layer forgets
    }
    const std::string msg =
        expect_rejected<InvalidArgument>(m, [&] { m.end_step(StepKind::kPrefillEnd); }, policy + ": end_step");
    EXPECT_NE(msg.find("layer 2"), std::string::npos) << msg;
    m.observe_attention(2, probs[2]);
    m.end_step(StepKind::kPrefillEnd);
    twin.end_step(StepKind::kPrefillEnd);
    EXPECT_LT(m.stats().tokens_resident, 30) << policy;  // it did evict
    Snapshot(twin).expect_same(Snapshot(m), policy + ": after the retried step");
    m.check_invariants();
  }
}

// Calls in the wrong order: a step that ends before every layer appended, and appends that do
// not follow the layer's positions, are rejected, and the step completes when the call is
// made right.
TEST(CacheHostile, CallsInTheWrongOrder) {
  auto c = make_config(2, 4, 2, 8, "int4:g4", "window@6", 12);
  TorchCache m(c);
  TorchCache twin(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor k = randn({1, 2, 4, 8}, gen), v = randn({1, 2, 4, 8}, gen);
  m.append(0, k, v, positions_range(0, 4));
  twin.append(0, k, v, positions_range(0, 4));
  EXPECT_EQ(expect_rejected<InvalidArgument>(m, [&] { m.end_step(StepKind::kPrefill); }, "end_step, layer 1 missing"),
            "CacheManager::end_step: layer 1 appended 0 tokens this step but layer 0 appended 4 (every layer must "
            "append the step's tokens)");
  EXPECT_EQ(expect_rejected<InvalidArgument>(m, [&] { m.append(1, k, v, positions_range(-1, 4)); }, "positions from -1"),
            "CacheManager::append: positions must increase and follow the layer's last position -1; got -1 at "
            "index 0");
  m.append(1, k, v, positions_range(0, 4));
  twin.append(1, k, v, positions_range(0, 4));
  m.end_step(StepKind::kPrefill);
  twin.end_step(StepKind::kPrefill);
  Snapshot(twin).expect_same(Snapshot(m), "after the step");
  EXPECT_EQ(expect_rejected<InvalidArgument>(m, [&] { m.append(0, k, v, positions_range(2, 4)); }, "positions again"),
            "CacheManager::append: positions must increase and follow the layer's last position 3; got 2 at index 0");
}

// What the rejections say: the bad value and what was expected.
TEST(CacheHostile, RejectionsNameTheValue) {
  TorchCache m(make_config(1, 4, 2, 8, "fp16", "h2o@6", 12));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  at::Tensor k = randn({1, 2, 3, 8}, gen);
  k[0][1][2][5] = std::nanf("");
  EXPECT_EQ(expect_rejected<InvalidArgument>(m, [&] { m.append(0, k, randn({1, 2, 3, 8}, gen), positions_range(0, 3)); },
                                             "NaN"),
            "CacheManager::append: k contains NaN at [b, h, t, d] = [0, 1, 2, 5]; the cache stores finite keys and "
            "values only");
  EXPECT_EQ(expect_rejected<InvalidArgument>(
                m, [&] { m.append(0, randn({2, 2, 3, 8}, gen), randn({2, 2, 3, 8}, gen), positions_range(0, 3)); },
                "batch 2"),
            "CacheManager::append: k must be a CPU float32/float16/bfloat16 tensor [B=1, H_kv=2, T_new, D=8] (the "
            "cache holds one sequence), got [2, 2, 3, 8] Float");
  EXPECT_EQ(expect_rejected<InvalidArgument>(
                m, [&] { m.append(3, randn({1, 2, 3, 8}, gen), randn({1, 2, 3, 8}, gen), positions_range(0, 3)); },
                "layer 3"),
            "CacheManager::append: layer 3 out of range [0, 1)");
  m.append(0, randn({1, 2, 3, 8}, gen), randn({1, 2, 3, 8}, gen), positions_range(0, 3));
  // After the largest position, the next one is compared, never computed (no overflow).
  const auto big = at::tensor(std::vector<int64_t>{std::numeric_limits<int64_t>::max(), 5}, at::kLong);
  EXPECT_EQ(expect_rejected<InvalidArgument>(
                m, [&] { m.append(0, randn({1, 2, 2, 8}, gen), randn({1, 2, 2, 8}, gen), big); }, "2^63 - 1, 5"),
            "CacheManager::append: positions must increase and follow the layer's last position 2; got 5 at index 1");
  EXPECT_EQ(expect_rejected<InvalidArgument>(m, [&] { m.reset(kMaxTokens + 1); }, "reset(10^9 + 1)"),
            "CacheManager::reset: context_length must be in [0, 1000000000] tokens, got 1000000001");
  at::Tensor p = testing::random_probs(1, 4, 3, 3, gen);
  p.fill_(std::nanf(""));
  EXPECT_EQ(expect_rejected<InvalidArgument>(m, [&] { m.observe_attention(0, p); }, "NaN probs"),
            "CacheManager::observe_attention: probs[0, 0, 0, 0] = nan is not a probability (expected a finite value "
            "in [0, 1])");
  p = at::full({1, 4, 3, 3}, 0.5f);
  EXPECT_EQ(expect_rejected<InvalidArgument>(m, [&] { m.observe_attention(0, p); }, "rows of 1.5"),
            "CacheManager::observe_attention: probs[0, 0, 0, :] sums to 1.5 > 1 (expected attention probabilities "
            "over the resident keys)");
}

// Finite in, finite out at the edges: a query position before every key sees nothing and gets
// a zero row; values near the float16 limit and far beyond it come back finite from every
// format (fp32 blocks where a format cannot hold them).
TEST(CacheHostile, EdgesStayFinite) {
  for (const std::string quant : {"fp32", "fp16", "bf16", "fp8:e4m3", "int8", "int2:g4:chan", "kivi:k2:v2:g4:r4",
                                  "gear:b2:g4:s0.25:r1:loop1:nb4"}) {
    TorchCache m(make_config(1, 2, 1, 8, quant, "full", 16));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
    m.append(0, randn({1, 1, 4, 8}, gen), randn({1, 1, 4, 8}, gen), positions_range(5, 4));
    const at::Tensor none = m.attend(0, randn({1, 2, 1, 8}, gen), positions_range(0, 1));
    EXPECT_TRUE(at::equal(none, at::zeros({1, 2, 1, 8}))) << quant;
    m.end_step(StepKind::kPrefill);  // a step's appends come before its attention
    for (float big : {65504.0f, 1e30f}) {
      m.append(0, randn({1, 1, 4, 8}, gen) * big, randn({1, 1, 4, 8}, gen) * big,
               positions_range(m.next_position(0), 4));
      const at::Tensor out = m.attend(0, randn({1, 2, 4, 8}, gen), positions_range(m.next_position(0) - 4, 4));
      EXPECT_TRUE(at::isfinite(out).all().item<bool>()) << quant << " " << big;
      m.end_step(StepKind::kPrefill);
      expect_finite(m, quant);
    }
    m.check_invariants();
  }
}

// Configurations that cannot work are rejected at construction, naming the value.
TEST(CacheHostile, AbsurdConfigsAreRejected) {
  auto message = [](const std::function<void(CacheConfig&)>& edit) {
    auto c = make_config(2, 4, 2, 8, "fp32", "full", 16);
    edit(c);
    try {
      TorchCache m(c);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    } catch (const CapacityError& e) {
      return "capacity: " + std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message([](CacheConfig& c) { c.policy = "random@1e300"; }),
            "budget '@1e300': token budget must be an integer in [1, 1000000000], got 1e300");
  EXPECT_EQ(message([](CacheConfig& c) { c.policy = "h2o@-5"; }),
            "budget '@-5': token budget must be an integer in [1, 1000000000], got -5");
  EXPECT_EQ(message([](CacheConfig& c) { c.policy = "sink@99999999999999999999"; }),
            "budget '@99999999999999999999': token budget must be an integer in [1, 1000000000], got "
            "99999999999999999999");
  EXPECT_EQ(message([](CacheConfig& c) { c.policy = "window@0.5"; }),
            "budget '@0.5': token budget must be an integer in [1, 1000000000], got 0.5");
  EXPECT_EQ(message([](CacheConfig& c) { c.residual_length = int64_t{1} << 62; }),
            "CacheConfig.residual_length must be in [0, 1000000000], got 4611686018427387904");
  EXPECT_EQ(message([](CacheConfig& c) { c.block_tokens = 5000; }),
            "CacheConfig.block_tokens must be in [0, 4096] (0 = default 64), got 5000");
  EXPECT_EQ(message([](CacheConfig& c) { c.scheme = "kivi:k2:v2:g4:r0"; }),
            "spec 'kivi:k2:v2:g4:r0': field 'r0': r=0 out of range [1, 1000000000] (full-precision residual tokens "
            "(a positive multiple of g))");
  EXPECT_EQ(message([](CacheConfig& c) { c.num_layers = 0; }), "CacheConfig.num_layers must be >= 1, got 0");
  EXPECT_EQ(message([](CacheConfig& c) { c.context_length = -1; }),
            "CacheConfig.context_length must be in [0, 1000000000] tokens, got -1");
  // A context past any request (kMaxTokens): found by fuzz_snapshot, whose DuoAttention sized its
  // streaming heads with an overflowing product.
  EXPECT_EQ(message([](CacheConfig& c) { c.context_length = 1000000001; }),
            "CacheConfig.context_length must be in [0, 1000000000] tokens, got 1000000001");
  EXPECT_EQ(message([](CacheConfig& c) { c.policy = "sink:s8@4"; }),
            "capacity: sink: budget of 4 tokens (@4) leaves no recent window after 8 sinks; need at least sinks + 1 = 9");
  EXPECT_EQ(message([](CacheConfig& c) { c.policy = "window@1000000000"; }), "accepted");
}

}  // namespace
}  // namespace kvcache
