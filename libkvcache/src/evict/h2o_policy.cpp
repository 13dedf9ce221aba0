// SPDX-License-Identifier: Apache-2.0
// H2O — Heavy-Hitter Oracle (Zhang et al., arXiv 2306.14048; FMInference/H2O utils_real_drop).
#include <numeric>

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
    : EvictionPolicy(budget), h_param_(spec.integer("h")), r_param_(spec.integer("r")) {
  KV_CHECK_ARG(budget.kind != Budget::Kind::kNone || (h_param_ >= 0 && r_param_ >= 0),
               "h2o needs a budget ('h2o@256', 'h2o@50%') or both h and r ('h2o:h128:r128')");
}

std::string H2OPolicy::spec() const {
  std::string s = "h2o";
  if (h_param_ >= 0) s += ":h" + std::to_string(h_param_);
  if (r_param_ >= 0) s += ":r" + std::to_string(r_param_);
  return s + budget().to_string();
}

void H2OPolicy::on_reset() {
  scores_.assign(static_cast<size_t>(shape().num_layers), at::Tensor());
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

void H2OPolicy::do_observe(int64_t layer, const at::Tensor& probs) {
  // Σ over batch and queries, mean over the G query heads of each KV head → [H_kv, T].
  const int64_t hkv = shape().num_kv_heads;
  auto col = probs.sum(at::IntArrayRef{0, 2});  // [H_q, T]
  col = col.view({hkv, col.size(0) / hkv, col.size(1)}).mean(1);
  auto& s = scores_.at(static_cast<size_t>(layer));
  const int64_t t = col.size(1);
  if (!s.defined()) {
    s = col.contiguous();
    return;
  }
  KV_CHECK_ARG(s.size(1) <= t, "h2o.observe: layer ", layer, " probs cover ", t,
               " keys but ", s.size(1), " are already scored");
  if (s.size(1) < t) s = at::cat({s, at::zeros({hkv, t - s.size(1)}, s.options())}, 1);
  s.add_(col);
}

KeepPlan H2OPolicy::plan_keep(const EvictionContext& ctx) {
  const int64_t budget_tokens = layer_budget(ctx.layer);
  const int64_t t = ctx.resident;
  if (t <= budget_tokens) return {};
  const auto& s = scores_.at(static_cast<size_t>(ctx.layer));
  KV_CHECK_ARG(s.defined() && s.size(1) == t, "h2o: layer ", ctx.layer, " has ", t,
               " resident tokens but attention was observed for ",
               s.defined() ? s.size(1) : 0,
               "; call observe_attention(layer, probs) after every step's attention");
  const int64_t hkv = shape().num_kv_heads;
  std::vector<int64_t> candidates(static_cast<size_t>(t - recent_));
  std::iota(candidates.begin(), candidates.end(), 0);
  std::vector<std::vector<int64_t>> keep(static_cast<size_t>(hkv));
  auto sc = s.contiguous();
  for (int64_t h = 0; h < hkv; ++h) {
    auto& k = keep[static_cast<size_t>(h)];
    k = top_k_recent_ties(sc.data_ptr<float>() + h * t, candidates, heavy_);
    for (int64_t i = t - recent_; i < t; ++i) k.push_back(i);
  }
  return {per_head_plan(keep)};
}

void H2OPolicy::on_compacted(int64_t layer, const at::Tensor& keep) {
  auto& s = scores_.at(static_cast<size_t>(layer));
  if (s.defined()) s = s.gather(1, keep);  // survivors keep their accumulated scores
}

}  // namespace kvcache::evict
