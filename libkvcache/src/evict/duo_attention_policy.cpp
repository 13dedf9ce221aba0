// SPDX-License-Identifier: Apache-2.0
// DuoAttention with on-the-fly head identification (Xiao et al., arXiv 2410.10819; kvpress
// DuoAttentionPress on-the-fly mode; methods.md b.13): retrieval heads keep the whole cache,
// streaming heads keep sink + recent tokens. Heads are classified once, at the end of the
// prompt, by the deviation a sink + recent restriction causes in their attention output on the
// prompt's last queries; the freed blocks of streaming heads return to the pool.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "evict/policies.h"
#include "kvcache/error.h"

namespace kvcache::evict {

const ParamTable& DuoAttentionPolicy::table() {
  static const ParamTable t{
      "duo",
      "DuoAttention (arXiv 2410.10819), heads identified on the fly: retrieval heads keep everything, streaming "
      "heads keep s sinks + r recent; the heads whose output a sink+recent mask changes least stream",
      {{"s", "sink tokens a streaming head keeps", ParamDef::Kind::kInt, 128, 0, 1e9, {}},
       {"r", "recent tokens a streaming head keeps (incl. the newest)", ParamDef::Kind::kInt, 256, 1, 1e9, {}},
       {"f", "fraction of all KV heads that stream (-1 = as many as the budget needs)", ParamDef::Kind::kFloat, -1, -1,
        1, {}},
       {"w", "last prompt queries the heads are scored on", ParamDef::Kind::kInt, 64, 1, 1e9, {}}}};
  return t;
}

DuoAttentionPolicy::DuoAttentionPolicy(const ParsedSpec& spec, Budget budget)
    : EvictionPolicy(spec, budget),
      sinks_(spec.integer("s")),
      recent_(spec.integer("r")),
      window_(spec.integer("w")),
      fraction_(spec.num("f")) {
  const bool has_f = fraction_ >= 0;
  KV_CHECK_ARG(has_f != (budget.kind != Budget::Kind::kNone), "duo takes either a fraction of streaming heads ('",
               spec.canonical(), ":f0.5') or a budget ('", spec.canonical(), "@50%': as many streaming heads as it "
               "needs), not ", has_f ? "both" : "neither");
}

int64_t DuoAttentionPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  return resolved_budget();
}

void DuoAttentionPolicy::on_reset() {
  const int64_t layers = shape().num_layers, hkv = shape().num_kv_heads, all = layers * hkv;
  head_scores_.assign(static_cast<size_t>(layers), {});
  streaming_.clear();
  classified_ = false;
  layers_done_ = 0;
  streaming_count_ = 0;
  if (fraction_ >= 0) {
    streaming_count_ = static_cast<int64_t>(std::nearbyint(fraction_ * static_cast<double>(all)));
    return;
  }
  if (budget().kind == Budget::Kind::kFraction && context_length() == 0) return;  // unresolved
  const int64_t b = resolved_budget();
  const int64_t c = context_length();
  if (c == 0 || b >= c) return;  // an unknown context, or a budget that holds it: nothing streams
  // At the end of the request retrieval heads hold c tokens, streaming heads min(s + r, c):
  // the fewest streaming heads n with n·keep + (all − n)·c ≤ all·b.
  const int64_t keep = std::min(sinks_ + recent_, c);
  KV_CHECK(keep < b, CapacityError, "duo: streaming heads keep s", sinks_, " + r", recent_, " = ", sinks_ + recent_,
           " tokens, no fewer than the budget of ", b, " tokens (", budget().to_string(), " of ", c,
           "); every head streaming would still not fit");
  // ⌈all·x / y⌉ with x = c − b tokens to save per head, y = c − keep saved per streaming head;
  // ≤ all since x < y. all·x can pass int64, so split all = q·y + r: ⌈all·x / y⌉ = q·x + ⌈r·x / y⌉,
  // where r·x < y·x ≤ kMaxTokens² (reset() bounds c) fits.
  const int64_t x = c - b, y = c - keep, q = all / y, r = all % y;
  streaming_count_ = std::min(all, q * x + (r * x + y - 1) / y);
}

void DuoAttentionPolicy::do_observe_queries(int64_t layer, const QueryRows& rows, const LayerView& view) {
  if (classified_) return;
  auto& sc = head_scores_.at(static_cast<size_t>(layer));
  sc.assign(static_cast<size_t>(view.num_kv_heads()), 0.0f);
  for (int64_t h = 0; h < view.num_kv_heads(); ++h) {
    sc[static_cast<size_t>(h)] = head_deviation(rows, view, h, sinks_, recent_);
  }
}

float DuoAttentionPolicy::head_deviation(const QueryRows& q, const LayerView& view, int64_t h, int64_t sinks,
                                         int64_t recent) {
  const int64_t d = view.head_dim(), hkv = view.num_kv_heads();
  KV_CHECK_ARG(q.head_dim == d && q.num_q_heads % hkv == 0 && q.rows() >= 1, "duo: ", q.num_q_heads,
               " query heads of dim ", q.head_dim, " for a view of ", hkv, " KV heads of dim ", d);
  const int64_t G = q.num_q_heads / hkv, n = q.rows();
  const int64_t t = view.resident(h);
  // Keys visible to each row, and which of them a streaming head keeps: index < sinks, or among
  // the row's last `recent` visible keys.
  std::vector<int64_t> pos;
  pos.reserve(static_cast<size_t>(t));
  view.visit(h, ViewStreams::kPositions, [&](const TokenRun& r) { pos.insert(pos.end(), r.positions, r.positions + r.n); });
  std::vector<int64_t> visible(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    visible[static_cast<size_t>(r)] =
        std::upper_bound(pos.begin(), pos.end(), q.positions[static_cast<size_t>(r)]) - pos.begin();
  }
  // Two online softmaxes per (row, query head): over every visible key and over the kept ones.
  const int64_t rows = n * G;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  std::vector<double> m_full(static_cast<size_t>(rows), kNegInf), l_full(static_cast<size_t>(rows), 0.0);
  std::vector<double> m_str(static_cast<size_t>(rows), kNegInf), l_str(static_cast<size_t>(rows), 0.0);
  std::vector<double> o_full(static_cast<size_t>(rows * d), 0.0), o_str(static_cast<size_t>(rows * d), 0.0);
  auto update = [d](double z, const float* v, double& m, double& l, double* o) {
    if (z > m) {
      const double c = m == kNegInf ? 0.0 : std::exp(m - z);
      l *= c;
      for (int64_t i = 0; i < d; ++i) o[i] *= c;
      m = z;
    }
    const double p = std::exp(z - m);
    l += p;
    for (int64_t i = 0; i < d; ++i) o[i] += p * v[i];
  };
  view.visit(h, ViewStreams::kBoth, [&](const TokenRun& run) {
    for (int64_t j = 0; j < run.n; ++j) {
      const int64_t idx = run.first + j;
      const float* k = run.keys + j * d;
      const float* v = run.values + j * d;
      for (int64_t r = 0; r < n; ++r) {
        const int64_t vis = visible[static_cast<size_t>(r)];
        if (idx >= vis) continue;
        const bool kept = idx < sinks || idx >= vis - recent;
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = q.post(h * G + g, r);
          double z = 0;
          for (int64_t i = 0; i < d; ++i) z += static_cast<double>(qr[i]) * k[i];
          z *= scale;
          const int64_t row = r * G + g;
          update(z, v, m_full[static_cast<size_t>(row)], l_full[static_cast<size_t>(row)], o_full.data() + row * d);
          if (kept) update(z, v, m_str[static_cast<size_t>(row)], l_str[static_cast<size_t>(row)], o_str.data() + row * d);
        }
      }
    }
  });
  double total = 0;
  for (int64_t row = 0; row < rows; ++row) {
    if (l_full[static_cast<size_t>(row)] <= 0) continue;  // a row that sees no key
    double num = 0, den = 0;
    for (int64_t i = 0; i < d; ++i) {
      const double a = o_full[static_cast<size_t>(row * d + i)] / l_full[static_cast<size_t>(row)];
      const double b = l_str[static_cast<size_t>(row)] > 0 ? o_str[static_cast<size_t>(row * d + i)] / l_str[static_cast<size_t>(row)] : 0.0;
      num += (a - b) * (a - b);
      den += a * a;
    }
    total += den > 0 ? std::sqrt(num / den) : 0.0;
  }
  return static_cast<float>(total / static_cast<double>(rows));
}

std::vector<bool> DuoAttentionPolicy::classify() const {
  const int64_t layers = shape().num_layers, hkv = shape().num_kv_heads;
  struct Head {
    float score;
    int64_t layer, head;
  };
  std::vector<Head> all;
  for (int64_t l = 0; l < layers; ++l) {
    const auto& sc = head_scores_.at(static_cast<size_t>(l));
    KV_CHECK_ARG(static_cast<int64_t>(sc.size()) == hkv, "duo: layer ", l,
                 " has no head scores at the end of the prompt; call attend() (or observe_queries) for every layer "
                 "of the prompt's last chunk");
    for (int64_t h = 0; h < hkv; ++h) all.push_back({sc[static_cast<size_t>(h)], l, h});
  }
  // Lowest deviation first; ties: the later layer, then the later head streams first.
  std::stable_sort(all.begin(), all.end(), [](const Head& a, const Head& b) {
    if (a.score != b.score) return a.score < b.score;
    if (a.layer != b.layer) return a.layer > b.layer;
    return a.head > b.head;
  });
  std::vector<bool> mask(static_cast<size_t>(layers * hkv), false);
  for (int64_t i = 0; i < streaming_count_ && i < static_cast<int64_t>(all.size()); ++i) {
    mask[static_cast<size_t>(all[static_cast<size_t>(i)].layer * hkv + all[static_cast<size_t>(i)].head)] = true;
  }
  return mask;
}

bool DuoAttentionPolicy::is_streaming(int64_t layer, int64_t h) const {
  KV_CHECK_ARG(classified_, "duo: heads are classified at the end of the prompt");
  return streaming_.at(static_cast<size_t>(layer * shape().num_kv_heads + h));
}

EvictionPlan DuoAttentionPolicy::plan(const EvictionContext& ctx) const {
  if (budget().kind != Budget::Kind::kNone) (void)resolved_budget();  // a fraction needs the context
  if (!classified_ && !ctx.is_prefill_end()) return {};
  if (streaming_count_ == 0) return {};
  const std::vector<bool> mask = classified_ ? streaming_ : classify();
  const int64_t keep = sinks_ + recent_;
  EvictionPlan p;
  for (int64_t h = 0; h < ctx.num_kv_heads(); ++h) {
    if (!mask[static_cast<size_t>(ctx.layer * ctx.num_kv_heads() + h)]) continue;
    const int64_t t = ctx.resident[static_cast<size_t>(h)];
    if (t <= keep) continue;
    if (p.evict.empty()) p.evict.resize(static_cast<size_t>(ctx.num_kv_heads()));
    auto& e = p.evict[static_cast<size_t>(h)];
    e.resize(static_cast<size_t>(t - keep));
    std::iota(e.begin(), e.end(), sinks_);
  }
  return p;
}

void DuoAttentionPolicy::on_step_end(const EvictionContext& ctx) {
  if (classified_ || !ctx.is_prefill_end()) return;
  if (layers_done_ == 0) streaming_ = classify();
  if (++layers_done_ >= shape().num_layers) classified_ = true;
}

}  // namespace kvcache::evict
