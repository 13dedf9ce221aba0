// SPDX-License-Identifier: Apache-2.0
// Expected Attention (Devoto et al., arXiv 2510.00636; kvpress ExpectedAttentionPress): the
// attention future queries are expected to pay each key, in closed form from a Gaussian model
// of the queries, times the value norm.
#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "evict/policies.h"
#include "kvcache/error.h"

namespace kvcache::evict {
namespace {

/// y = R̄x for the mean rotation (c̄, s̄) of a rotate-half RoPE, x read with stride `sx`:
/// y_i = c̄_i x_i − s̄_i x_{i+D/2}, y_{i+D/2} = c̄_i x_{i+D/2} + s̄_i x_i.
void mean_rotate(const double* x, int64_t sx, const float* c, const float* s, int64_t d, double* y, int64_t sy) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double a = x[i * sx], b = x[(i + half) * sx];
    y[i * sy] = c[i] * a - s[i] * b;
    y[(i + half) * sy] = c[i] * b + s[i] * a;
  }
}

}  // namespace

const ParamTable& ExpectedAttentionPolicy::table() {
  static const ParamTable t{
      "expected",
      "Expected Attention (arXiv 2510.00636): expected attention of future queries (Gaussian fit of the pre-RoPE "
      "queries, mean RoPE rotation over the next n positions) times the value norm; s sinks kept",
      {{"n", "future positions the RoPE rotation is averaged over", ParamDef::Kind::kInt, 512, 1, 1e6, {}},
       {"s", "sink tokens always kept (and queries at positions < s not fitted)", ParamDef::Kind::kInt, 4, 0, 1e9, {}},
       {"e", "epsilon added to the expected attention before the value-norm rescale", ParamDef::Kind::kFloat, 0, 0,
        1e6, {}},
       {"cov", "query model: mean and covariance (kvpress default), or mean only", ParamDef::Kind::kChoice, 0, 0, 0,
        {"cov", "mean"}},
       {"vnorm", "rescale by the value norm (vnorm) or not", ParamDef::Kind::kChoice, 0, 0, 0, {"vnorm", "novnorm"}},
       scorer_schedule_param()}};
  return t;
}

ExpectedAttentionPolicy::ExpectedAttentionPolicy(const ParsedSpec& spec, Budget budget)
    : ScheduledScorer(spec, budget, spec.choice("schedule") == "stream", "expected"),
      future_(spec.integer("n")),
      sinks_(spec.integer("s")),
      epsilon_(spec.num("e")),
      covariance_(spec.choice("cov") == "cov"),
      vnorm_(spec.choice("vnorm") == "vnorm") {}

void ExpectedAttentionPolicy::on_reset() {
  ScheduledScorer::on_reset();
  stats_.assign(static_cast<size_t>(shape().num_layers), Stats{});
}

void ExpectedAttentionPolicy::do_observe_queries(int64_t layer, const QueryRows& rows, const LayerView& view) {
  (void)view;
  const int64_t hq = rows.num_q_heads, d = rows.head_dim, n = rows.rows();
  KV_CHECK_ARG(static_cast<int64_t>(rows.pre_rope.size()) == hq * n * d, "expected.observe_queries: layer ", layer,
               " got ", rows.pre_rope.size(), " pre-RoPE values for ", hq, " heads x ", n, " rows x ", d,
               " (QueryNeed::pre_rope)");
  Stats& st = stats_.at(static_cast<size_t>(layer));
  if (st.sum.empty()) {
    st.sum.assign(static_cast<size_t>(hq * d), 0.0);
    if (covariance_) st.outer.assign(static_cast<size_t>(hq * d * d), 0.0);
  }
  for (int64_t t = 0; t < n; ++t) {
    if (rows.positions[static_cast<size_t>(t)] < sinks_) continue;  // kvpress drops the first n_sink states
    ++st.n;
    for (int64_t h = 0; h < hq; ++h) {
      const float* q = rows.pre(h, t);
      double* sum = st.sum.data() + h * d;
      for (int64_t i = 0; i < d; ++i) sum[i] += q[i];
      if (!covariance_) continue;
      double* o = st.outer.data() + h * d * d;
      for (int64_t i = 0; i < d; ++i) {
        const double qi = q[i];
        for (int64_t j = 0; j < d; ++j) o[i * d + j] += qi * q[j];
      }
    }
  }
}

std::vector<double> ExpectedAttentionPolicy::query_mean(int64_t layer) const {
  const Stats& st = stats_.at(static_cast<size_t>(layer));
  std::vector<double> m = st.sum;
  for (auto& x : m) x /= static_cast<double>(std::max<int64_t>(st.n, 1));
  return m;
}

TokenScores ExpectedAttentionPolicy::score(const EvictionContext& ctx) const {
  const LayerView& view = require_view(ctx, "expected");
  const Stats& st = stats_.at(static_cast<size_t>(ctx.layer));
  KV_CHECK_ARG(st.n > 0, "expected: layer ", ctx.layer, " has seen no query at a position >= s=", sinks_,
               "; call attend() (or observe_queries) in every step");
  const int64_t d = view.head_dim(), hkv = ctx.num_kv_heads();
  const int64_t hq = static_cast<int64_t>(st.sum.size()) / d, G = hq / hkv;
  KV_CHECK_ARG(hq == shape().num_q_heads && hq % hkv == 0, "expected: query statistics of ", hq,
               " heads for H_q = ", shape().num_q_heads);
  const double n = static_cast<double>(st.n);
  // Mean rotation over the next `future_` positions.
  std::vector<float> c(static_cast<size_t>(d / 2)), s(static_cast<size_t>(d / 2));
  view.mean_rotation(view.next_position(), future_, c.data(), s.data());
  // Per query head: μ' = R̄μ and Σ' = R̄ΣR̄ᵀ (Σ = E[qqᵀ] − μμᵀ, population).
  std::vector<double> mu(static_cast<size_t>(hq * d)), cov(covariance_ ? static_cast<size_t>(hq * d * d) : 0);
  {
    std::vector<double> m(static_cast<size_t>(d)), sig(static_cast<size_t>(d * d)), a(static_cast<size_t>(d * d));
    for (int64_t h = 0; h < hq; ++h) {
      for (int64_t i = 0; i < d; ++i) m[static_cast<size_t>(i)] = st.sum[static_cast<size_t>(h * d + i)] / n;
      mean_rotate(m.data(), 1, c.data(), s.data(), d, mu.data() + h * d, 1);
      if (!covariance_) continue;
      const double* o = st.outer.data() + h * d * d;
      for (int64_t i = 0; i < d; ++i) {
        for (int64_t j = 0; j < d; ++j) {
          sig[static_cast<size_t>(i * d + j)] = o[i * d + j] / n - m[static_cast<size_t>(i)] * m[static_cast<size_t>(j)];
        }
      }
      // A = R̄Σ (R̄ on every column), then Σ' = AR̄ᵀ (R̄ on every row of A).
      for (int64_t j = 0; j < d; ++j) mean_rotate(sig.data() + j, d, c.data(), s.data(), d, a.data() + j, d);
      double* out = cov.data() + h * d * d;
      for (int64_t i = 0; i < d; ++i) mean_rotate(a.data() + i * d, 1, c.data(), s.data(), d, out + i * d, 1);
    }
  }
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(d)), inv_2d = 1.0 / (2.0 * static_cast<double>(d));
  TokenScores out(static_cast<size_t>(hkv));
  std::vector<double> logits, kc(static_cast<size_t>(d));
  for (int64_t h = 0; h < hkv; ++h) {
    const int64_t t = ctx.resident[static_cast<size_t>(h)];
    const int64_t sinks = std::min(sinks_, t), m = t - sinks;
    auto& row = out[static_cast<size_t>(h)];
    row.assign(static_cast<size_t>(t), std::numeric_limits<float>::infinity());
    if (m == 0) continue;
    // Logits of the non-sink keys for each of the group's query heads: [G, m].
    logits.assign(static_cast<size_t>(G * m), 0.0);
    std::vector<double> vnorm(static_cast<size_t>(m), 1.0);
    view.visit(h, vnorm_ ? ViewStreams::kBoth : ViewStreams::kKeys, [&](const TokenRun& r) {
      for (int64_t j = 0; j < r.n; ++j) {
        const int64_t idx = r.first + j - sinks;
        if (idx < 0) continue;
        const float* k = r.keys + j * d;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t qh = h * G + g;
          const double* mq = mu.data() + qh * d;
          double z = 0;
          for (int64_t i = 0; i < d; ++i) z += mq[i] * k[i];
          z *= inv_sqrt_d;
          if (covariance_) {
            const double* sg = cov.data() + qh * d * d;
            for (int64_t i = 0; i < d; ++i) {
              double acc = 0;
              for (int64_t l = 0; l < d; ++l) acc += sg[i * d + l] * k[l];
              kc[static_cast<size_t>(i)] = acc;
            }
            double quad = 0;
            for (int64_t i = 0; i < d; ++i) quad += k[i] * kc[static_cast<size_t>(i)];
            z += quad * inv_2d;
          }
          logits[static_cast<size_t>(g * m + idx)] = z;
        }
        if (vnorm_) {
          const float* v = r.values + j * d;
          double sq = 0;
          for (int64_t i = 0; i < d; ++i) sq += static_cast<double>(v[i]) * v[i];
          vnorm[static_cast<size_t>(idx)] = std::sqrt(sq);
        }
      }
    });
    // Softmax over the non-sink keys per query head, mean over the group, (+ε)·‖v‖.
    std::vector<double> acc(static_cast<size_t>(m), 0.0);
    for (int64_t g = 0; g < G; ++g) {
      const double* z = logits.data() + g * m;
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < m; ++j) mx = std::max(mx, z[j]);
      double sum = 0;
      for (int64_t j = 0; j < m; ++j) sum += std::exp(z[j] - mx);
      for (int64_t j = 0; j < m; ++j) acc[static_cast<size_t>(j)] += std::exp(z[j] - mx) / sum;
    }
    for (int64_t j = 0; j < m; ++j) {
      const double p = acc[static_cast<size_t>(j)] / static_cast<double>(G);
      row[static_cast<size_t>(sinks + j)] = static_cast<float>((p + epsilon_) * vnorm[static_cast<size_t>(j)]);
    }
  }
  return out;
}

}  // namespace kvcache::evict
