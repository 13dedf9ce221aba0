// SPDX-License-Identifier: Apache-2.0
// Eviction policy spec strings (CacheConfig::policy): make_eviction_policy, then reset() for a
// few context lengths and cache shapes and layer_budget() of every layer. An accepted spec's
// canonical form must be accepted and canonical again.
#include <memory>
#include <string>

#include "fuzz_util.h"
#include "known_issues.h"
#include "kvcache/eviction_policy.h"

using namespace kvcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 256) return 0;
  const std::string spec(reinterpret_cast<const char*>(data), size);
  if (fuzz::skip_known_budget_fault(spec)) return 0;

  std::unique_ptr<EvictionPolicy> p;
  if (!fuzz::accepts("make_eviction_policy", [&] { p = make_eviction_policy(spec); })) return 0;
  const std::string canon = p->spec();
  std::unique_ptr<EvictionPolicy> again;
  KV_FUZZ_CHECK(fuzz::accepts("make_eviction_policy(canonical)", [&] { again = make_eviction_policy(canon); }),
                "make_eviction_policy", "canonical spec '", canon, "' of '", spec, "' rejected");
  KV_FUZZ_CHECK(again->spec() == canon, "make_eviction_policy", "'", canon, "' -> '", again->spec(), "'");

  for (int64_t context : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{300}, int64_t{1} << 20, int64_t{1} << 40}) {
    for (const CacheShape shape : {CacheShape{1, 1, 1}, CacheShape{4, 4, 2}}) {
      if (!fuzz::accepts("reset", [&] { p->reset(context, shape); })) continue;
      for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
        fuzz::accepts("layer_budget", [&] {
          const int64_t b = p->layer_budget(layer);
          KV_FUZZ_CHECK(b >= 0, "layer_budget", canon, " context ", context, " layer ", layer, ": ", b);
        });
      }
      fuzz::accepts("attention_need", [&] { (void)p->needs_attention(); });
    }
  }
  return 0;
}
