// SPDX-License-Identifier: Apache-2.0
// Random eviction baseline (kvpress RandomPress analogue), seeded and reproducible.

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
    : EvictionPolicy(budget), seed_(static_cast<uint64_t>(spec.integer("seed"))) {
  KV_CHECK_ARG(budget.kind != Budget::Kind::kNone,
               "random needs a budget: 'random:seed7@256' or 'random@50%'");
}

std::string RandomPolicy::spec() const {
  return (seed_ != 0 ? "random:seed" + std::to_string(seed_) : std::string("random")) +
         budget().to_string();
}

void RandomPolicy::on_reset() { calls_.assign(static_cast<size_t>(shape().num_layers), 0); }

int64_t RandomPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  return resolved_budget();
}

KeepPlan RandomPolicy::plan_keep(const EvictionContext& ctx) {
  const int64_t b = layer_budget(ctx.layer);
  const int64_t t = ctx.resident;
  if (t <= b) return {};
  const int64_t hkv = shape().num_kv_heads;
  const uint64_t call = calls_.at(static_cast<size_t>(ctx.layer))++;
  const int64_t n_drop = t - b;
  const int64_t m = t - 1;  // candidates [0, t-1): the newest token is protected
  std::vector<std::vector<int64_t>> keep(static_cast<size_t>(hkv));
  for (int64_t h = 0; h < hkv; ++h) {
    // One independent stream per (seed, layer, call, head).
    SplitMix64 mix(seed_ ^ 0x5DEECE66DULL);
    uint64_t stream = mix.next() ^ (static_cast<uint64_t>(ctx.layer) * 0x9E3779B97F4A7C15ULL);
    stream = SplitMix64(stream).next() ^ (call * 0xD1B54A32D192ED03ULL);
    stream = SplitMix64(stream).next() ^ static_cast<uint64_t>(h);
    SplitMix64 rng(stream);
    // Floyd's algorithm: n_drop distinct indices from [0, m).
    std::vector<char> dropped(static_cast<size_t>(t), 0);
    for (int64_t j = m - n_drop; j < m; ++j) {
      const auto r = static_cast<int64_t>(rng.below(static_cast<uint64_t>(j + 1)));
      if (dropped[static_cast<size_t>(r)]) {
        dropped[static_cast<size_t>(j)] = 1;
      } else {
        dropped[static_cast<size_t>(r)] = 1;
      }
    }
    auto& k = keep[static_cast<size_t>(h)];
    k.reserve(static_cast<size_t>(b));
    for (int64_t i = 0; i < t; ++i) {
      if (!dropped[static_cast<size_t>(i)]) k.push_back(i);
    }
  }
  return {per_head_plan(keep)};
}

}  // namespace kvcache::evict
