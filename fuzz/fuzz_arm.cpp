// SPDX-License-Identifier: Apache-2.0
// Study arms ("scheme+policy", `--configs`, `--budget`): parse_arm_list, with_budget, dedupe,
// parse_arm round trip; then every arm whose scheme and policy specs are accepted is run for one
// short request through a CacheManager (2 layers, H_q 4, H_kv 2, D 32; a 40-token prompt in
// chunks of 16, then 8 decode steps, attend() every step) with check_invariants() at the end:
// a configuration that validates must work, and may refuse a call only with a user error.
//
// Input: line 1 the arm list (comma-separated), optional line 2 a --budget value.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <string>
#include <vector>

#include "cache_test_util.h"
#include "fuzz_util.h"
#include "known_issues.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/cache_manager.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/study/arm.h"
#include "kvcache/torch.h"

using namespace kvcache;
using kvcache::study::Arm;

namespace {

constexpr int64_t kLayers = 2, kQHeads = 4, kKvHeads = 2, kHeadDim = 32;
constexpr int64_t kPrompt = 40, kChunk = 16, kDecode = 8;

/// One request of an accepted arm; returns when the cache refuses a call with a user error.
void run_request(const Arm& arm) {
  CacheConfig c = kvcache::testing::make_config(kLayers, kQHeads, kKvHeads, kHeadDim, arm.scheme, arm.policy);
  std::unique_ptr<TorchCache> m;
  if (!fuzz::accepts("CacheManager", [&] { m = std::make_unique<TorchCache>(c); })) return;
  if (!fuzz::accepts("reset", [&] { m->reset(kPrompt + kDecode); })) return;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  int64_t pos = 0;
  auto step = [&](int64_t n, StepKind kind) {
    return fuzz::accepts("step", [&] {
      const at::Tensor positions = kvcache::testing::positions_range(pos, n);
      for (int64_t l = 0; l < kLayers; ++l) {
        const at::Tensor k = kvcache::testing::randn({1, kKvHeads, n, kHeadDim}, gen);
        const at::Tensor v = kvcache::testing::randn({1, kKvHeads, n, kHeadDim}, gen);
        const at::Tensor q = kvcache::testing::randn({1, kQHeads, n, kHeadDim}, gen);
        m->append(l, k, v, positions);
        const at::Tensor out = m->attend(l, q, positions);
        KV_FUZZ_CHECK(out.sizes() == q.sizes(), "attend", arm.spec(), ": output ", out.sizes(), " for q ", q.sizes());
      }
      m->end_step(kind);
      pos += n;
    });
  };
  for (int64_t done = 0; done < kPrompt; done += kChunk) {
    const int64_t n = std::min(kChunk, kPrompt - done);
    if (!step(n, done + n == kPrompt ? StepKind::kPrefillEnd : StepKind::kPrefill)) return;
  }
  if (m->replay_need().any()) {
    // KVzip: the context replay the runner runs after the prompt (one 8-token chunk, not stored).
    const bool replayed = fuzz::accepts("replay", [&] {
      const at::Tensor positions = kvcache::testing::positions_range(pos, 8);
      m->begin_replay();
      for (int64_t l = 0; l < kLayers; ++l) {
        m->append(l, kvcache::testing::randn({1, kKvHeads, 8, kHeadDim}, gen),
                  kvcache::testing::randn({1, kKvHeads, 8, kHeadDim}, gen), positions);
        (void)m->attend(l, kvcache::testing::randn({1, kQHeads, 8, kHeadDim}, gen), positions);
      }
      m->end_step(StepKind::kReplayEnd);
    });
    if (!replayed) return;
  }
  for (int64_t i = 0; i < kDecode; ++i) {
    if (!step(1, StepKind::kDecode)) return;
  }
  fuzz::accepts("check_invariants", [&] { m->check_invariants(); });
  const CacheStats s = m->stats();
  KV_FUZZ_CHECK(s.tokens_written == kLayers * (kPrompt + kDecode) && s.bytes_resident >= 0 &&
                    s.bytes_reserved >= s.bytes_resident,
                "stats", arm.spec(), ": written ", s.tokens_written, ", resident ", s.bytes_resident, " B, reserved ",
                s.bytes_reserved, " B");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 512) return 0;
  fuzz::Bytes in(data, size);
  const std::string list = in.text(/*line=*/true);
  const std::string budget = in.text(/*line=*/true);

  std::vector<Arm> arms;
  // The leading ',' keeps the list from naming a file (parse_arm_list reads one if it exists).
  if (!fuzz::accepts("parse_arm_list", [&] { arms = study::parse_arm_list("," + list); })) return 0;
  if (!budget.empty() && !fuzz::accepts("with_budget", [&] { arms = study::with_budget(arms, budget); })) return 0;
  arms = study::dedupe(arms);
  if (arms.size() > 3) arms.resize(3);
  for (const Arm& a : arms) {
    if (fuzz::skip_known_arm_fault(a.policy)) continue;
    Arm again;
    KV_FUZZ_CHECK(fuzz::accepts("parse_arm(spec)", [&] { again = study::parse_arm(a.spec()); }) && again == a,
                  "parse_arm round trip", "'", a.spec(), "' -> '", again.spec(), "'");
    std::string quant, policy;
    if (!fuzz::accepts("make_cache_scheme", [&] { quant = make_cache_scheme(a.scheme)->spec(); })) continue;
    if (!fuzz::accepts("make_eviction_policy", [&] { policy = make_eviction_policy(a.policy)->spec(); })) continue;
    run_request(Arm{quant, policy});
  }
  return 0;
}
