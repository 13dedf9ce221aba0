// SPDX-License-Identifier: Apache-2.0
// What a policy consumes (kvcache/eviction_inputs.h): the attention mass and its reduction
// from probabilities, and TensorLayerView, the LayerView over plain arrays.
#include "kvcache/eviction_inputs.h"

#include <algorithm>
#include <cmath>

#include "common/cascade_sum.h"
#include "common/rope_table.h"
#include "common/view_ops.h"
#include "kvcache/error.h"

namespace kvcache {

int64_t AttentionMass::keys(int64_t h) const {
  KV_CHECK_ARG(h >= 0 && h < num_kv_heads() && rows > 0, "AttentionMass::keys: head ", h, " of ",
               num_kv_heads(), " (rows ", rows, ")");
  return static_cast<int64_t>(heads[static_cast<size_t>(h)].size()) / rows;
}

AttentionMass reduce_attention(const TensorView& probs, int64_t num_kv_heads, const AttentionNeed& need) {
  KV_CHECK_ARG(probs.defined() && probs.rank == 4 && probs.dtype == DType::kFloat32,
               "attention probabilities must be float32 [B, H_q, T_q, T], got ", shape_str(probs));
  const int64_t b = probs.size(0), hq = probs.size(1), tq = probs.size(2), t = probs.size(3);
  KV_CHECK_ARG(num_kv_heads >= 1 && hq % num_kv_heads == 0, "attention probabilities have H_q = ", hq,
               ", not a multiple of H_kv = ", num_kv_heads);
  KV_CHECK_ARG(need.any(), "reduce_attention: the policy needs no attention");
  const int64_t n = need.selected(tq);
  KV_CHECK_ARG(n >= 1, "attention probabilities have no query row (T_q = ", tq, ")");
  const auto* base = static_cast<const float*>(probs.data);
  auto at = [&](int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    return base[i0 * probs.strides[0] + i1 * probs.strides[1] + i2 * probs.strides[2] + i3 * probs.strides[3]];
  };
  for (int64_t i0 = 0; i0 < b; ++i0) {
    for (int64_t i1 = 0; i1 < hq; ++i1) {
      for (int64_t i2 = 0; i2 < tq; ++i2) {
        for (int64_t i3 = 0; i3 < t; ++i3) {
          const float p = at(i0, i1, i2, i3);
          KV_CHECK_ARG(std::isfinite(p) && p >= 0, "attention probabilities must be finite and >= 0; got ", p, " at [",
                       i0, ", ", i1, ", ", i2, ", ", i3, "]");
        }
      }
    }
  }
  // The reductions of the at:: ops this replaces (b.sum(0), then .mean over G, then .sum over
  // rows, or max for each), in at::sum's order of float32 additions (common/cascade_sum.h).
  const int64_t g = hq / num_kv_heads;
  const bool max = need.reduce == AttentionNeed::Reduce::kMax;
  AttentionMass m;
  m.rows = need.per_row ? n : 1;
  m.heads.assign(static_cast<size_t>(num_kv_heads), std::vector<float>(static_cast<size_t>(m.rows * t), 0.0f));
  std::vector<float> over_b(static_cast<size_t>(b)), over_g(static_cast<size_t>(g)), over_r(static_cast<size_t>(n));
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    auto& out = m.heads[static_cast<size_t>(h)];
    for (int64_t j = 0; j < t; ++j) {
      for (int64_t r = 0; r < n; ++r) {
        const int64_t qt = tq - n + r;
        for (int64_t gi = 0; gi < g; ++gi) {
          for (int64_t i0 = 0; i0 < b; ++i0) over_b[static_cast<size_t>(i0)] = at(i0, h * g + gi, qt, j);
          over_g[static_cast<size_t>(gi)] = max ? *std::max_element(over_b.begin(), over_b.end())
                                                : detail::cascade_sum(over_b.data(), 1, b);
        }
        over_r[static_cast<size_t>(r)] = max ? *std::max_element(over_g.begin(), over_g.end())
                                             : detail::cascade_sum(over_g.data(), 1, g) / static_cast<float>(g);
      }
      if (need.per_row) {
        for (int64_t r = 0; r < n; ++r) out[static_cast<size_t>(r * t + j)] = over_r[static_cast<size_t>(r)];
      } else {
        out[static_cast<size_t>(j)] = max ? *std::max_element(over_r.begin(), over_r.end())
                                          : detail::cascade_sum(over_r.data(), 1, n);
      }
    }
  }
  return m;
}

// ---------------------------------------------------------------- TensorLayerView

namespace {

/// Copies head h of a `[1, H, T, D]` (or `[T, D]` with h = -1) float view into rows.
std::vector<float> rows_of(const TensorView& v, int64_t h) {
  TensorView sub = v;
  if (h >= 0) {
    sub.rank = 2;
    sub.data = static_cast<const char*>(v.data) + h * v.strides[1] * dtype_size(v.dtype);
    sub.shape[0] = v.shape[2];
    sub.shape[1] = v.shape[3];
    sub.strides[0] = v.strides[2];
    sub.strides[1] = v.strides[3];
  }
  return detail::to_float32(sub);
}

}  // namespace

TensorLayerView::TensorLayerView(const TensorView& k, const TensorView& v, const TensorView& positions,
                                 int64_t next_position, RopeFn rope)
    : next_(next_position), rope_(std::move(rope)) {
  KV_CHECK_ARG(k.defined() && k.rank == 4 && k.size(0) == 1 && is_kv_dtype(k.dtype),
               "TensorLayerView: k must be float [1, H_kv, T, D], got ", shape_str(k));
  KV_CHECK_ARG(v.defined() && v.sizes() == k.sizes() && is_kv_dtype(v.dtype), "TensorLayerView: v must be float ",
               shape_str(k.sizes()), ", got ", shape_str(v));
  KV_CHECK_ARG(positions.defined() && positions.rank == 2 && positions.size(0) == k.size(1) &&
                   positions.size(1) == k.size(2) && positions.dtype == DType::kInt64,
               "TensorLayerView: positions must be int64 [H_kv=", k.size(1), ", T=", k.size(2), "], got ",
               shape_str(positions));
  d_ = k.size(3);
  const std::vector<int64_t> pos = detail::to_int64(positions);
  const int64_t t = k.size(2);
  for (int64_t h = 0; h < k.size(1); ++h) {
    k_.push_back(rows_of(k, h));
    v_.push_back(rows_of(v, h));
    pos_.emplace_back(pos.begin() + h * t, pos.begin() + (h + 1) * t);
  }
}

TensorLayerView::TensorLayerView(const std::vector<TensorView>& k, const std::vector<TensorView>& v,
                                 const std::vector<TensorView>& positions, int64_t next_position, RopeFn rope)
    : next_(next_position), rope_(std::move(rope)) {
  KV_CHECK_ARG(!k.empty() && k.size() == v.size() && k.size() == positions.size(),
               "TensorLayerView: ", k.size(), " key, ", v.size(), " value and ", positions.size(),
               " position tensors (expected one of each per KV head, at least one head)");
  KV_CHECK_ARG(k[0].defined() && k[0].rank == 2, "TensorLayerView: k[0] must be float32 [T_0, D], got ",
               shape_str(k[0]));
  d_ = k[0].size(1);
  for (size_t h = 0; h < k.size(); ++h) {
    KV_CHECK_ARG(k[h].defined() && k[h].rank == 2 && k[h].size(1) == d_ && is_kv_dtype(k[h].dtype),
                 "TensorLayerView: k[", h, "] must be float32 [T_h, D=", d_, "], got ", shape_str(k[h]));
    KV_CHECK_ARG(v[h].defined() && v[h].sizes() == k[h].sizes() && is_kv_dtype(v[h].dtype), "TensorLayerView: v[",
                 h, "] must be float32 ", shape_str(k[h].sizes()), ", got ", shape_str(v[h]));
    KV_CHECK_ARG(positions[h].defined() && positions[h].rank == 1 && positions[h].size(0) == k[h].size(0) &&
                     positions[h].dtype == DType::kInt64,
                 "TensorLayerView: positions[", h, "] must be int64 [T_h=", k[h].size(0), "], got ",
                 shape_str(positions[h]));
    k_.push_back(rows_of(k[h], -1));
    v_.push_back(rows_of(v[h], -1));
    pos_.push_back(detail::to_int64(positions[h]));
  }
}

int64_t TensorLayerView::resident(int64_t h) const {
  KV_CHECK_ARG(h >= 0 && h < num_kv_heads(), "LayerView: KV head ", h, " out of range [0, ", num_kv_heads(), ")");
  return static_cast<int64_t>(pos_[static_cast<size_t>(h)].size());
}

void TensorLayerView::visit(int64_t h, ViewStreams streams, const std::function<void(const TokenRun&)>& fn) const {
  const int64_t t = resident(h);
  if (t == 0) return;
  TokenRun run;
  run.first = 0;
  run.n = t;
  if ((static_cast<uint8_t>(streams) & 1u) != 0) run.keys = k_[static_cast<size_t>(h)].data();
  if ((static_cast<uint8_t>(streams) & 2u) != 0) run.values = v_[static_cast<size_t>(h)].data();
  run.positions = pos_[static_cast<size_t>(h)].data();
  fn(run);
}

void TensorLayerView::mean_rotation(int64_t first, int64_t n, float* cos_out, float* sin_out) const {
  KV_CHECK(static_cast<bool>(rope_), UnsupportedError,
           "TensorLayerView::mean_rotation: the view was built without a RoPE hook");
  KV_CHECK_ARG(first >= 0 && n >= 1, "LayerView::mean_rotation: positions [", first, ", ", first, " + ", n,
               ") (expected first >= 0, n >= 1)");
  common::RopeTable(rope_, head_dim(), "TensorLayerView::mean_rotation needs it").mean_cos_sin(first, n, cos_out, sin_out);
}

}  // namespace kvcache
