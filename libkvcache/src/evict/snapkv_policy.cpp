// SPDX-License-Identifier: Apache-2.0
// SnapKV (Li et al., arXiv 2404.14469; FasterDecoding/SnapKV, kvpress SnapKVPress).
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/cascade_sum.h"
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
  rows_.assign(static_cast<size_t>(shape().num_layers), Rows{});
  prefill_done_ = false;
  layers_done_ = 0;
}

int64_t SnapKVPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  return resolved_budget();
}

void SnapKVPolicy::do_observe(int64_t layer, const AttentionMass& mass) {
  if (prefill_done_) return;  // SnapKV compresses the prompt only
  // mass: [H_kv, rows ≤ w, T], the step's last query rows (heads of equal length).
  const int64_t heads = mass.num_kv_heads(), nr = mass.rows;
  KV_CHECK_ARG(heads >= 1 && nr >= 1, "snapkv.observe: empty attention mass");
  const int64_t t = mass.keys(0);
  for (int64_t h = 1; h < heads; ++h) {
    KV_CHECK_ARG(mass.keys(h) == t, "snapkv.observe: head ", h, " holds ", mass.keys(h), " keys but head 0 holds ", t,
                 " (SnapKV needs heads of equal length)");
  }
  auto& rows = rows_.at(static_cast<size_t>(layer));
  if (rows.defined()) {
    KV_CHECK_ARG(rows.keys <= t, "snapkv.observe: layer ", layer, " attention covers ", t, " keys, fewer than the ",
                 rows.keys, " seen before");
  }
  // Earlier queries could not attend to later keys: their columns are 0. Then the new rows;
  // the last w rows are kept.
  const int64_t old = rows.defined() ? rows.rows : 0;
  const int64_t total = old + nr, keep = std::min(total, window_), drop = total - keep;
  Rows next;
  next.heads = heads;
  next.rows = keep;
  next.keys = t;
  next.data.assign(static_cast<size_t>(heads * keep * t), 0.0f);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t r = drop; r < total; ++r) {
      float* dst = next.data.data() + (h * keep + (r - drop)) * t;
      if (r < old) {
        const float* src = rows.data.data() + (h * old + r) * rows.keys;
        std::copy_n(src, rows.keys, dst);
      } else {
        const float* src = mass.heads[static_cast<size_t>(h)].data() + (r - old) * t;
        std::copy_n(src, t, dst);
      }
    }
  }
  rows = std::move(next);
}

std::vector<float> SnapKVPolicy::pool(const std::vector<float>& scores, int64_t heads, int64_t kernel, bool use_max) {
  KV_CHECK_ARG(heads >= 1 && static_cast<int64_t>(scores.size()) % heads == 0 && kernel % 2 == 1,
               "snapkv.pool: expected [H, T] and an odd kernel, got ", scores.size(), " values over ", heads,
               " heads, k=", kernel);
  if (kernel == 1) return scores;
  const int64_t t = static_cast<int64_t>(scores.size()) / heads, pad = kernel / 2;
  std::vector<float> out(scores.size());
  for (int64_t h = 0; h < heads; ++h) {
    const float* x = scores.data() + h * t;
    for (int64_t j = 0; j < t; ++j) {
      const int64_t lo = std::max<int64_t>(0, j - pad), hi = std::min(t, j + pad + 1);
      float acc = use_max ? -std::numeric_limits<float>::infinity() : 0.0f;
      for (int64_t i = lo; i < hi; ++i) acc = use_max ? (x[i] > acc || std::isnan(x[i]) ? x[i] : acc) : acc + x[i];
      out[static_cast<size_t>(h * t + j)] = use_max ? acc : acc / static_cast<float>(kernel);
    }
  }
  return out;
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
  const Rows& rows = rows_.at(static_cast<size_t>(ctx.layer));
  KV_CHECK_ARG(rows.defined() && rows.keys == t, name(), ": layer ", ctx.layer, " has ", t,
               " prompt tokens but attention was observed over ", rows.defined() ? rows.keys : 0,
               "; call observe_attention(layer, probs) for the prompt chunks");
  const int64_t w = std::min(window_, t);
  const int64_t prefix = t - w;
  // Mean over the observation queries (kvpress; the sum ranks the same: at::mean's sum over the
  // rows then a division by their count), prefix keys only, pooled; the window is kept.
  const int64_t heads = rows.heads;
  std::vector<float> mean(static_cast<size_t>(heads * prefix));
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t j = 0; j < prefix; ++j) {
      const float* col = rows.data.data() + h * rows.rows * t + j;
      mean[static_cast<size_t>(h * prefix + j)] =
          detail::cascade_sum(col, t, rows.rows) / static_cast<float>(rows.rows);
    }
  }
  const std::vector<float> pooled = prefix > 0 ? pool(mean, heads, kernel_, use_max_) : mean;  // [H_kv, prefix]
  TokenScores out(static_cast<size_t>(ctx.num_kv_heads()));
  for (int64_t h = 0; h < ctx.num_kv_heads(); ++h) {
    auto& row = out[static_cast<size_t>(h)];
    row.assign(static_cast<size_t>(t), std::numeric_limits<float>::infinity());
    std::copy_n(pooled.begin() + h * prefix, prefix, row.begin());
  }
  return out;
}

void SnapKVPolicy::on_step_end(const EvictionContext& ctx) {
  if (prefill_done_ || !ctx.is_prefill_end()) return;
  rows_.at(static_cast<size_t>(ctx.layer)) = Rows{};
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
