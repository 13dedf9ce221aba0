// SPDX-License-Identifier: Apache-2.0
// TOVA — Token Omission Via Attention (Oren et al., arXiv 2401.06104; schwartz-lab-NLP/TOVA).
#include <numeric>

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

TovaPolicy::TovaPolicy(const ParsedSpec& spec, Budget budget) : EvictionPolicy(budget) {
  (void)spec;
  KV_CHECK_ARG(budget.kind != Budget::Kind::kNone, "tova needs a budget: 'tova@512' or 'tova@50%'");
}

std::string TovaPolicy::spec() const { return "tova" + budget().to_string(); }

void TovaPolicy::on_reset() { last_row_.assign(static_cast<size_t>(shape().num_layers), at::Tensor()); }

int64_t TovaPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  return resolved_budget();
}

void TovaPolicy::do_observe(int64_t layer, const at::Tensor& probs) {
  // Last query of the step, summed over batch, mean over every query head of the layer → [T].
  const int64_t tq = probs.size(2);
  last_row_.at(static_cast<size_t>(layer)) =
      probs.select(2, tq - 1).sum(0).mean(0).contiguous();
}

KeepPlan TovaPolicy::plan_keep(const EvictionContext& ctx) {
  const int64_t b = layer_budget(ctx.layer);
  const int64_t t = ctx.resident;
  if (t <= b) return {};
  auto& row = last_row_.at(static_cast<size_t>(ctx.layer));
  KV_CHECK_ARG(row.defined() && row.size(0) == t, "tova: layer ", ctx.layer, " has ", t,
               " resident tokens but the last observed query covers ",
               row.defined() ? row.size(0) : 0,
               " keys; call observe_attention(layer, probs) in every step");
  std::vector<int64_t> candidates(static_cast<size_t>(t - 1));  // newest token protected
  std::iota(candidates.begin(), candidates.end(), 0);
  auto keep = top_k_recent_ties(row.data_ptr<float>(), candidates, b - 1);
  keep.push_back(t - 1);
  return {shared_plan(keep, shape().num_kv_heads)};
}

void TovaPolicy::on_compacted(int64_t layer, const at::Tensor& keep) {
  (void)keep;
  last_row_.at(static_cast<size_t>(layer)) = at::Tensor();  // stale after compaction
}

}  // namespace kvcache::evict
