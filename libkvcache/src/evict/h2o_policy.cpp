// SPDX-License-Identifier: Apache-2.0
// H2O — Heavy-Hitter Oracle (Zhang et al., arXiv 2306.14048; FMInference/H2O utils_real_drop).

#include <algorithm>
#include <limits>

#include "evict/policies.h"
#include "kvcache/error.h"

namespace kvcache::evict {

const ParamTable& H2OPolicy::table() {
  static const ParamTable t{
      "h2o",
      "Heavy-Hitter Oracle (arXiv 2306.14048): accumulated attention (mean over each KV "
      "group's query heads) + recent window",
      {{"h", "heavy-hitter tokens (-1 = budget - r)", ParamDef::Kind::kInt, -1, -1, 1e9, {}},
       {"r", "recent tokens always kept (-1 = half the budget, at least 1)", ParamDef::Kind::kInt,
        -1, -1, 1e9, {}}}};
  return t;
}

H2OPolicy::H2OPolicy(const ParsedSpec& spec, Budget budget)
    : ScorerPolicy(spec, budget), h_param_(spec.integer("h")), r_param_(spec.integer("r")) {
  KV_CHECK_ARG(budget.kind != Budget::Kind::kNone || (h_param_ >= 0 && r_param_ >= 0),
               "h2o needs a budget ('h2o@256', 'h2o@50%') or both h and r ('h2o:h128:r128')");
}

void H2OPolicy::on_reset() {
  scores_.assign(static_cast<size_t>(shape().num_layers), {});
  if (budget().kind == Budget::Kind::kFraction && context_length() == 0) return;  // unresolved
  // The newest token is protected, so the recent window is at least 1 token.
  const int64_t b = budget().kind == Budget::Kind::kNone ? h_param_ + std::max<int64_t>(r_param_, 1)
                                                         : resolved_budget();
  recent_ = r_param_ >= 0 ? std::max<int64_t>(r_param_, 1) : std::max<int64_t>(b / 2, 1);
  heavy_ = h_param_ >= 0 ? h_param_ : b - recent_;
  KV_CHECK(b >= 1 && heavy_ >= 0 && heavy_ + recent_ <= b, CapacityError, "h2o: budget of ", b,
           " tokens (", budget().to_string(), context_length() > 0 ? " of " : "",
           context_length() > 0 ? std::to_string(context_length()) : "", ") is smaller than ",
           heavy_, " heavy + ", recent_, " recent = ", heavy_ + recent_,
           " (the recent window includes the newest token)");
}

int64_t H2OPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  if (budget().kind != Budget::Kind::kNone) (void)resolved_budget();
  return heavy_ + recent_;
}

void H2OPolicy::do_observe(int64_t layer, const AttentionMass& mass) {
  // Σ over the step's query rows (and batch), mean over each KV head's G query heads.
  const int64_t hkv = shape().num_kv_heads;
  auto& s = scores_.at(static_cast<size_t>(layer));
  if (s.empty()) s.resize(static_cast<size_t>(hkv));
  for (int64_t h = 0; h < hkv; ++h) {
    auto& acc = s[static_cast<size_t>(h)];
    const auto& m = mass.heads[static_cast<size_t>(h)];
    const int64_t t = mass.keys(h);
    KV_CHECK_ARG(static_cast<int64_t>(acc.size()) <= t, "h2o.observe: layer ", layer, " head ", h, " attention covers ",
                 t, " keys but ", acc.size(), " are already scored");
    acc.resize(static_cast<size_t>(t), 0.0f);
    for (int64_t r = 0; r < mass.rows; ++r) {
      const float* row = m.data() + r * t;
      for (int64_t i = 0; i < t; ++i) acc[static_cast<size_t>(i)] += row[i];
    }
  }
}

std::optional<int64_t> H2OPolicy::compression_target(const EvictionContext& ctx) const {
  return layer_budget(ctx.layer);
}

TokenScores H2OPolicy::score(const EvictionContext& ctx) const {
  const auto& s = scores_.at(static_cast<size_t>(ctx.layer));
  TokenScores out(static_cast<size_t>(ctx.num_kv_heads()));
  for (int64_t h = 0; h < ctx.num_kv_heads(); ++h) {
    const int64_t t = ctx.resident[static_cast<size_t>(h)];
    const int64_t scored = s.empty() ? 0 : static_cast<int64_t>(s[static_cast<size_t>(h)].size());
    KV_CHECK_ARG(scored == t, "h2o: layer ", ctx.layer, " head ", h, " has ", t,
                 " resident tokens but attention was observed for ", scored,
                 "; call attend() (or observe_attention) in every step");
    // Candidates: everything before the recent window, by accumulated score; the window is kept.
    auto& row = out[static_cast<size_t>(h)];
    row = s[static_cast<size_t>(h)];
    for (int64_t i = std::max<int64_t>(0, t - recent_); i < t; ++i) {
      row[static_cast<size_t>(i)] = std::numeric_limits<float>::infinity();
    }
  }
  return out;
}

void H2OPolicy::on_evicted(int64_t layer, const EvictionPlan& plan) {
  auto& s = scores_.at(static_cast<size_t>(layer));
  if (s.empty()) return;
  for (size_t h = 0; h < plan.evict.size(); ++h) {
    const auto& e = plan.evict[h];
    if (e.empty()) continue;
    auto& acc = s[h];  // survivors keep their accumulated scores, in order
    size_t w = 0, di = 0;
    for (size_t i = 0; i < acc.size(); ++i) {
      if (di < e.size() && static_cast<int64_t>(i) == e[di]) {
        ++di;
        continue;
      }
      acc[w++] = acc[i];
    }
    acc.resize(w);
  }
}

}  // namespace kvcache::evict
