// SPDX-License-Identifier: Apache-2.0
// SnapKV (Li et al., arXiv 2404.14469; FasterDecoding/SnapKV, kvpress SnapKVPress).
#include <algorithm>
#include <cmath>
#include <limits>

#include "evict/policies.h"
#include "kvcache/error.h"

namespace kvcache::evict {

const ParamTable& SnapKVPolicy::table() {
  static const ParamTable t{
      "snapkv",
      "SnapKV (arXiv 2404.14469): prompt keys scored by the last w prompt queries, pooled, "
      "compressed once at the end of prefill",
      {{"w", "observation window: last prompt queries (always kept)", ParamDef::Kind::kInt, 32, 1,
        1e9, {}},
       {"k", "pooling kernel (odd)", ParamDef::Kind::kInt, 5, 1, 1e6, {}},
       {"pool", "pooling of scores along keys", ParamDef::Kind::kChoice, 0, 0, 0, {"avg", "max"}}}};
  return t;
}

SnapKVPolicy::SnapKVPolicy(const ParsedSpec& spec, Budget budget)
    : SnapKVPolicy(spec, budget, spec.integer("w"), spec.integer("k"), spec.choice("pool") == "max") {}

SnapKVPolicy::SnapKVPolicy(const ParsedSpec& spec, Budget budget, int64_t window, int64_t kernel,
                           bool use_max)
    : ScorerPolicy(spec, budget),
      window_(window),
      kernel_(kernel),
      use_max_(use_max) {
  KV_CHECK_ARG(kernel_ % 2 == 1, spec.head(),
               ": kernel k must be odd (padding k/2 keeps the length), got k", kernel_);
  KV_CHECK_ARG(budget.kind != Budget::Kind::kNone, spec.head(), " needs a budget: '", spec.head(),
               "@1024' or '", spec.head(), "@50%'");
}

void SnapKVPolicy::on_reset() {
  rows_.assign(static_cast<size_t>(shape().num_layers), at::Tensor());
  prefill_done_ = false;
  layers_done_ = 0;
}

int64_t SnapKVPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  return resolved_budget();
}

void SnapKVPolicy::do_observe(int64_t layer, const AttentionMass& mass) {
  if (prefill_done_) return;  // SnapKV compresses the prompt only
  auto red = mass.to_tensor();  // [H_kv, rows ≤ w, T]: the step's last query rows
  const int64_t t = red.size(2);
  auto& rows = rows_.at(static_cast<size_t>(layer));
  if (rows.defined()) {
    KV_CHECK_ARG(rows.size(2) <= t, "snapkv.observe: layer ", layer, " attention covers ", t,
                 " keys, fewer than the ", rows.size(2), " seen before");
    // Earlier queries could not attend to later keys: their columns are 0.
    if (rows.size(2) < t) {
      rows = at::cat({rows, at::zeros({rows.size(0), rows.size(1), t - rows.size(2)}, rows.options())}, 2);
    }
    rows = at::cat({rows, red}, 1);
    if (rows.size(1) > window_) rows = rows.narrow(1, rows.size(1) - window_, window_);
    rows = rows.contiguous();
  } else {
    rows = red.contiguous();
  }
}

at::Tensor SnapKVPolicy::pool(const at::Tensor& scores, int64_t kernel, bool use_max) {
  KV_CHECK_ARG(scores.dim() == 2 && kernel % 2 == 1, "snapkv.pool: expected [H, T] and odd kernel, got ",
               scores.sizes(), " k=", kernel);
  if (kernel == 1) return scores.contiguous();
  const int64_t pad = kernel / 2;
  auto x = scores.unsqueeze(1);  // [H, 1, T]
  auto out = use_max ? at::max_pool1d(x, {kernel}, {1}, {pad})
                     : at::avg_pool1d(x, {kernel}, {1}, {pad}, /*ceil_mode=*/false,
                                      /*count_include_pad=*/true);
  return out.squeeze(1).contiguous();
}

int64_t SnapKVPolicy::decode_reserve(const EvictionContext& ctx) const {
  // Reserve room for the request's remaining tokens so the budget holds after the last one.
  return context_length() > ctx.logical_length ? context_length() - ctx.logical_length : 0;
}

std::optional<int64_t> SnapKVPolicy::compression_target(const EvictionContext& ctx) const {
  if (prefill_done_ || !ctx.is_prefill_end()) return std::nullopt;
  const int64_t t = uniform_resident(ctx, name());
  const int64_t reserve = decode_reserve(ctx);
  const int64_t uniform = layer_budget(ctx.layer) - reserve;
  const int64_t w = std::min(window_, t);
  KV_CHECK(uniform >= w, CapacityError, name(), ": budget of ", layer_budget(ctx.layer), " tokens (",
           budget().to_string(), " of ", context_length(), ") minus ", reserve,
           " tokens reserved for decoding leaves ", uniform, " prompt tokens, fewer than the w=", w,
           " observation window that is always kept");
  return prompt_keep(ctx.layer, t, uniform);
}

TokenScores SnapKVPolicy::score(const EvictionContext& ctx) const {
  const int64_t t = uniform_resident(ctx, name());
  const auto& rows = rows_.at(static_cast<size_t>(ctx.layer));
  KV_CHECK_ARG(rows.defined() && rows.size(2) == t, name(), ": layer ", ctx.layer, " has ", t,
               " prompt tokens but attention was observed over ", rows.defined() ? rows.size(2) : 0,
               "; call observe_attention(layer, probs) for the prompt chunks");
  const int64_t w = std::min(window_, t);
  const int64_t prefix = t - w;
  // Mean over the observation queries (kvpress; the sum ranks the same), prefix keys only,
  // pooled; the window is kept.
  auto pooled = pool(rows.narrow(2, 0, prefix).mean(1), kernel_, use_max_);  // [H_kv, prefix]
  const float* p = pooled.data_ptr<float>();
  TokenScores out(static_cast<size_t>(ctx.num_kv_heads()));
  for (int64_t h = 0; h < ctx.num_kv_heads(); ++h) {
    auto& row = out[static_cast<size_t>(h)];
    row.assign(static_cast<size_t>(t), std::numeric_limits<float>::infinity());
    std::copy_n(p + h * prefix, prefix, row.begin());
  }
  return out;
}

void SnapKVPolicy::on_step_end(const EvictionContext& ctx) {
  if (prefill_done_ || !ctx.is_prefill_end()) return;
  rows_.at(static_cast<size_t>(ctx.layer)) = at::Tensor();
  if (++layers_done_ >= shape().num_layers) prefill_done_ = true;
}

// ---------------------------------------------------------------- pyramid
const ParamTable& PyramidKVPolicy::table() {
  static const ParamTable t{
      "pyramid",
      "PyramidKV (arXiv 2406.02069): SnapKV scoring, layer budgets decreasing linearly with depth",
      {{"w", "observation window: last prompt queries (always kept)", ParamDef::Kind::kInt, 32, 1,
        1e9, {}},
       {"k", "pooling kernel (odd)", ParamDef::Kind::kInt, 5, 1, 1e6, {}},
       {"b", "beta: the last layer keeps n/beta", ParamDef::Kind::kFloat, 20, 1, 1e6, {}},
       {"pool", "pooling of scores along keys", ParamDef::Kind::kChoice, 0, 0, 0, {"avg", "max"}}}};
  return t;
}

PyramidKVPolicy::PyramidKVPolicy(const ParsedSpec& spec, Budget budget)
    : SnapKVPolicy(spec, budget, spec.integer("w"), spec.integer("k"), spec.choice("pool") == "max"),
      beta_(spec.num("b")) {}

void PyramidKVPolicy::on_reset() {
  SnapKVPolicy::on_reset();
  budgets_.clear();
}

std::vector<int64_t> PyramidKVPolicy::budgets(int64_t prompt, int64_t n, int64_t w, double beta,
                                              int64_t layers) {
  std::vector<int64_t> out(static_cast<size_t>(layers), n);
  if (layers < 2) return out;
  double mn = static_cast<double>(n) / beta;
  double mx = 2.0 * static_cast<double>(n) - mn;
  if (mx > static_cast<double>(prompt - w)) {
    mx = static_cast<double>(prompt - w);
    mn = 2.0 * static_cast<double>(n) - mx;
  }
  // kvpress falls back to uniform SnapKV unless T >= max >= min >= w.
  if (!(static_cast<double>(prompt) >= mx && mx >= mn && mn >= static_cast<double>(w))) return out;
  const double step = (mx - mn) / static_cast<double>(layers - 1);
  for (int64_t l = 0; l < layers; ++l) {
    out[static_cast<size_t>(l)] = static_cast<int64_t>(std::nearbyint(mx - static_cast<double>(l) * step));
  }
  return out;
}

int64_t PyramidKVPolicy::layer_budget(int64_t layer) const {
  if (budgets_.empty()) return SnapKVPolicy::layer_budget(layer);
  return budgets_.at(static_cast<size_t>(layer)) + reserve_;
}

int64_t PyramidKVPolicy::prompt_keep(int64_t layer, int64_t prompt, int64_t uniform_keep) const {
  if (!budgets_.empty()) return budgets_.at(static_cast<size_t>(layer));
  // Every layer holds the same prompt at its end: the budgets the first layer fixes.
  return budgets(prompt, uniform_keep, std::min(window(), prompt), beta_, shape().num_layers)
      .at(static_cast<size_t>(layer));
}

void PyramidKVPolicy::on_step_end(const EvictionContext& ctx) {
  if (!prefill_done() && ctx.is_prefill_end() && budgets_.empty()) {
    const int64_t prompt = uniform_resident(ctx, "pyramid");
    reserve_ = decode_reserve(ctx);
    const int64_t uniform = SnapKVPolicy::layer_budget(ctx.layer) - reserve_;
    budgets_ = budgets(prompt, uniform, std::min(window(), prompt), beta_, shape().num_layers);
  }
  SnapKVPolicy::on_step_end(ctx);
}

}  // namespace kvcache::evict
