// SPDX-License-Identifier: Apache-2.0
// Random eviction baseline (kvpress RandomPress analogue), seeded and reproducible.

#include <algorithm>
#include <unordered_set>

#include "evict/policies.h"
#include "kvcache/error.h"

namespace kvcache::evict {

const ParamTable& RandomPolicy::table() {
  static const ParamTable t{
      "random",
      "uniformly random eviction (per KV head), newest token protected; seeded baseline",
      {{"seed", "random seed", ParamDef::Kind::kInt, 0, 0, 9.0e15, {}}}};
  return t;
}

RandomPolicy::RandomPolicy(const ParsedSpec& spec, Budget budget)
    : EvictionPolicy(spec, budget), seed_(static_cast<uint64_t>(spec.integer("seed"))) {
  KV_CHECK_ARG(budget.kind != Budget::Kind::kNone,
               "random needs a budget: 'random:seed7@256' or 'random@50%'");
}

void RandomPolicy::on_reset() { calls_.assign(static_cast<size_t>(shape().num_layers), 0); }

int64_t RandomPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  return resolved_budget();
}

EvictionPlan RandomPolicy::plan(const EvictionContext& ctx) const {
  const int64_t b = layer_budget(ctx.layer);
  const int64_t hkv = ctx.num_kv_heads();
  bool over = false;
  for (int64_t t : ctx.resident) over = over || t > b;
  if (!over) return {};
  const uint64_t call = calls_.at(static_cast<size_t>(ctx.layer));
  EvictionPlan p;
  p.evict.resize(static_cast<size_t>(hkv));
  for (int64_t h = 0; h < hkv; ++h) {
    const int64_t t = ctx.resident[static_cast<size_t>(h)];
    if (t <= b) continue;
    // One independent stream per (seed, layer, call, head).
    SplitMix64 mix(seed_ ^ 0x5DEECE66DULL);
    uint64_t stream = mix.next() ^ (static_cast<uint64_t>(ctx.layer) * 0x9E3779B97F4A7C15ULL);
    stream = SplitMix64(stream).next() ^ (call * 0xD1B54A32D192ED03ULL);
    stream = SplitMix64(stream).next() ^ static_cast<uint64_t>(h);
    SplitMix64 rng(stream);
    // Floyd's algorithm: n_drop distinct indices from [0, m) (the newest token is protected),
    // O(n_drop) draws.
    const int64_t n_drop = t - b;
    const int64_t m = t - 1;
    std::unordered_set<int64_t> chosen;
    chosen.reserve(static_cast<size_t>(2 * n_drop));
    auto& e = p.evict[static_cast<size_t>(h)];
    e.reserve(static_cast<size_t>(n_drop));
    for (int64_t j = m - n_drop; j < m; ++j) {
      const auto r = static_cast<int64_t>(rng.below(static_cast<uint64_t>(j + 1)));
      const int64_t pick = chosen.count(r) ? j : r;
      chosen.insert(pick);
      e.push_back(pick);
    }
    std::sort(e.begin(), e.end());
  }
  return p;
}

void RandomPolicy::on_evicted(int64_t layer, const EvictionPlan& plan) {
  (void)plan;
  ++calls_.at(static_cast<size_t>(layer));
}

}  // namespace kvcache::evict
