// SPDX-License-Identifier: Apache-2.0
// TOVA — Token Omission Via Attention (Oren et al., arXiv 2401.06104; schwartz-lab-NLP/TOVA).

#include "evict/policies.h"
#include "kvcache/error.h"

namespace kvcache::evict {

const ParamTable& TovaPolicy::table() {
  static const ParamTable t{
      "tova",
      "TOVA (arXiv 2401.06104): keep the tokens most attended by the last query, averaged over "
      "all query heads; one selection for all KV heads",
      {}};
  return t;
}

TovaPolicy::TovaPolicy(const ParsedSpec& spec, Budget budget) : ScorerPolicy(spec, budget) {
  KV_CHECK_ARG(budget.kind != Budget::Kind::kNone, "tova needs a budget: 'tova@512' or 'tova@50%'");
}

void TovaPolicy::on_reset() { last_row_.assign(static_cast<size_t>(shape().num_layers), {}); }

int64_t TovaPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  return resolved_budget();
}

void TovaPolicy::do_observe(int64_t layer, const AttentionMass& mass) {
  // Last query of the step, mean over every query head of the layer = mean over the KV
  // heads of their group means (groups have equal size).
  const int64_t hkv = mass.num_kv_heads();
  const int64_t t = mass.keys(0);
  auto& row = last_row_.at(static_cast<size_t>(layer));
  row.assign(static_cast<size_t>(t), 0.0f);
  for (int64_t h = 0; h < hkv; ++h) {
    KV_CHECK_ARG(mass.keys(h) == t, "tova.observe: layer ", layer, " head ", h, " holds ", mass.keys(h),
                 " keys but head 0 holds ", t, " (TOVA keeps one selection for every head)");
    const float* m = mass.heads[static_cast<size_t>(h)].data() + (mass.rows - 1) * t;
    for (int64_t i = 0; i < t; ++i) row[static_cast<size_t>(i)] += m[i];
  }
  for (auto& x : row) x /= static_cast<float>(hkv);
}

std::optional<int64_t> TovaPolicy::compression_target(const EvictionContext& ctx) const {
  return layer_budget(ctx.layer);
}

TokenScores TovaPolicy::score(const EvictionContext& ctx) const {
  const int64_t t = uniform_resident(ctx, "tova");
  auto& row = last_row_.at(static_cast<size_t>(ctx.layer));
  KV_CHECK_ARG(static_cast<int64_t>(row.size()) == t, "tova: layer ", ctx.layer, " has ", t,
               " resident tokens but the last observed query covers ", row.size(),
               " keys; call attend() (or observe_attention) in every step");
  // Candidates: every token but the newest (select() keeps it); one row for every KV head.
  return TokenScores(static_cast<size_t>(ctx.num_kv_heads()), row);
}

void TovaPolicy::on_evicted(int64_t layer, const EvictionPlan& plan) {
  (void)plan;
  last_row_.at(static_cast<size_t>(layer)).clear();  // stale after eviction
}

}  // namespace kvcache::evict
