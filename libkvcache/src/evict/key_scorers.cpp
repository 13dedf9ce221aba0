// SPDX-License-Identifier: Apache-2.0
// Attention-free scorers over the stored keys: Knorm (Devoto et al., arXiv 2406.11430) and
// KeyDiff (Park et al., arXiv 2504.15364; kvpress KnormPress / KeyDiffPress). They read the keys
// through EvictionContext::view (post-RoPE, dequantized, one block at a time) and need no
// attention, so attend() keeps its fused kernels.
#include <cmath>

#include "evict/policies.h"
#include "kvcache/error.h"

namespace kvcache::evict {

ParamDef scorer_schedule_param() {
  return {"schedule", "once: at the end of the prompt (kvpress); stream: whenever over budget, every step",
          ParamDef::Kind::kChoice, 0, 0, 0, {"once", "stream"}};
}

const LayerView& require_view(const EvictionContext& ctx, const char* policy) {
  KV_CHECK_ARG(ctx.view != nullptr, policy, ": layer ", ctx.layer,
               " has no view of its keys (EvictionContext::view is null); plan through a CacheManager, or give the "
               "context a LayerView (e.g. TensorLayerView)");
  KV_CHECK_ARG(ctx.view->num_kv_heads() == ctx.num_kv_heads(), policy, ": the view has ", ctx.view->num_kv_heads(),
               " KV heads, the context ", ctx.num_kv_heads());
  for (int64_t h = 0; h < ctx.num_kv_heads(); ++h) {
    KV_CHECK_ARG(ctx.view->resident(h) == ctx.resident[static_cast<size_t>(h)], policy, ": the view of layer ",
                 ctx.layer, " head ", h, " holds ", ctx.view->resident(h), " tokens, the context says ",
                 ctx.resident[static_cast<size_t>(h)]);
  }
  return *ctx.view;
}

// ---------------------------------------------------------------- knorm
const ParamTable& KnormPolicy::table() {
  static const ParamTable t{"knorm",
                            "Knorm (arXiv 2406.11430): keep the keys of lowest L2 norm; attention-free",
                            {scorer_schedule_param()}};
  return t;
}

KnormPolicy::KnormPolicy(const ParsedSpec& spec, Budget budget)
    : ScheduledScorer(spec, budget, spec.choice("schedule") == "stream", "knorm") {}

TokenScores KnormPolicy::score(const EvictionContext& ctx) const {
  const LayerView& view = require_view(ctx, "knorm");
  const int64_t d = view.head_dim();
  TokenScores out(static_cast<size_t>(ctx.num_kv_heads()));
  for (int64_t h = 0; h < ctx.num_kv_heads(); ++h) {
    auto& row = out[static_cast<size_t>(h)];
    row.resize(static_cast<size_t>(ctx.resident[static_cast<size_t>(h)]));
    view.visit(h, ViewStreams::kKeys, [&](const TokenRun& r) {
      for (int64_t j = 0; j < r.n; ++j) {
        const float* k = r.keys + j * d;
        double sq = 0;
        for (int64_t i = 0; i < d; ++i) sq += static_cast<double>(k[i]) * k[i];
        row[static_cast<size_t>(r.first + j)] = -static_cast<float>(std::sqrt(sq));
      }
    });
  }
  return out;
}

// ---------------------------------------------------------------- keydiff
const ParamTable& KeyDiffPolicy::table() {
  static const ParamTable t{
      "keydiff",
      "KeyDiff (arXiv 2504.15364): keep the keys least similar (cosine) to the mean normalised key; attention-free",
      {scorer_schedule_param()}};
  return t;
}

KeyDiffPolicy::KeyDiffPolicy(const ParsedSpec& spec, Budget budget)
    : ScheduledScorer(spec, budget, spec.choice("schedule") == "stream", "keydiff") {}

TokenScores KeyDiffPolicy::score(const EvictionContext& ctx) const {
  // torch's F.normalize / F.cosine_similarity guards: norms below these count as these.
  constexpr double kNormalizeEps = 1e-12, kCosineEps = 1e-8;
  const LayerView& view = require_view(ctx, "keydiff");
  const int64_t d = view.head_dim();
  TokenScores out(static_cast<size_t>(ctx.num_kv_heads()));
  std::vector<double> anchor(static_cast<size_t>(d));
  for (int64_t h = 0; h < ctx.num_kv_heads(); ++h) {
    const int64_t t = ctx.resident[static_cast<size_t>(h)];
    auto& row = out[static_cast<size_t>(h)];
    row.resize(static_cast<size_t>(t));
    if (t == 0) continue;
    // Pass 1: the anchor = mean of the normalised keys; the norms are kept (one float per token).
    std::fill(anchor.begin(), anchor.end(), 0.0);
    view.visit(h, ViewStreams::kKeys, [&](const TokenRun& r) {
      for (int64_t j = 0; j < r.n; ++j) {
        const float* k = r.keys + j * d;
        double sq = 0;
        for (int64_t i = 0; i < d; ++i) sq += static_cast<double>(k[i]) * k[i];
        const double norm = std::sqrt(sq);
        row[static_cast<size_t>(r.first + j)] = static_cast<float>(norm);
        const double inv = 1.0 / std::max(norm, kNormalizeEps);
        for (int64_t i = 0; i < d; ++i) anchor[static_cast<size_t>(i)] += k[i] * inv;
      }
    });
    double anorm = 0;
    for (auto& a : anchor) {
      a /= static_cast<double>(t);
      anorm += a * a;
    }
    anorm = std::max(std::sqrt(anorm), kCosineEps);
    // Pass 2: score = −cos(k, anchor).
    view.visit(h, ViewStreams::kKeys, [&](const TokenRun& r) {
      for (int64_t j = 0; j < r.n; ++j) {
        const float* k = r.keys + j * d;
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += k[i] * anchor[static_cast<size_t>(i)];
        float& s = row[static_cast<size_t>(r.first + j)];
        s = -static_cast<float>(dot / (std::max(static_cast<double>(s), kCosineEps) * anorm));
      }
    });
  }
  return out;
}

}  // namespace kvcache::evict
