// SPDX-License-Identifier: Apache-2.0
// The reference attention (plain at:: ops) and the reduction of probabilities to the
// attention mass policies consume (kvcache/attention.h).
#include "kvcache/attention.h"

#include <cmath>
#include <limits>
#include <sstream>
#include <tuple>

#include "cache/attend_fused.h"
#include "kvcache/error.h"

namespace kvcache {
namespace {

std::string shape_of(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream os;
  os << t.sizes() << " " << at::toString(t.scalar_type());
  return os.str();
}

}  // namespace

int64_t AttentionMass::keys(int64_t h) const {
  KV_CHECK_ARG(h >= 0 && h < num_kv_heads() && rows > 0, "AttentionMass::keys: head ", h, " of ",
               num_kv_heads(), " (rows ", rows, ")");
  return static_cast<int64_t>(heads[static_cast<size_t>(h)].size()) / rows;
}

at::Tensor AttentionMass::to_tensor() const {
  KV_CHECK_ARG(!heads.empty() && rows > 0, "AttentionMass::to_tensor: empty mass");
  const int64_t t = keys(0);
  auto out = at::empty({num_kv_heads(), rows, t}, at::kFloat);
  for (int64_t h = 0; h < num_kv_heads(); ++h) {
    KV_CHECK_ARG(keys(h) == t, "AttentionMass::to_tensor: head ", h, " holds ", keys(h),
                 " keys but head 0 holds ", t, " (ragged heads have no [H_kv, rows, T] form)");
    std::copy(heads[static_cast<size_t>(h)].begin(), heads[static_cast<size_t>(h)].end(),
              out.data_ptr<float>() + h * rows * t);
  }
  return out;
}

AttentionMass reduce_attention(const at::Tensor& probs, int64_t num_kv_heads, const AttentionNeed& need) {
  KV_CHECK_ARG(probs.defined() && probs.dim() == 4 && probs.scalar_type() == at::kFloat,
               "attention probabilities must be float32 [B, H_q, T_q, T], got ", shape_of(probs));
  const int64_t hq = probs.size(1), tq = probs.size(2), t = probs.size(3);
  KV_CHECK_ARG(num_kv_heads >= 1 && hq % num_kv_heads == 0, "attention probabilities have H_q = ", hq,
               ", not a multiple of H_kv = ", num_kv_heads);
  KV_CHECK_ARG(need.any(), "reduce_attention: the policy needs no attention");
  const int64_t n = need.selected(tq);
  KV_CHECK_ARG(n >= 1, "attention probabilities have no query row (T_q = ", tq, ")");
  const auto bad = (probs.isnan() | probs.isinf() | (probs < 0)).nonzero();
  if (bad.size(0) > 0) {
    const auto i = bad[0];
    throw InvalidArgument(detail::str_cat(
        "attention probabilities must be finite and >= 0; got ",
        probs.index({i[0], i[1], i[2], i[3]}).item<float>(), " at [", i[0].item<int64_t>(), ", ",
        i[1].item<int64_t>(), ", ", i[2].item<int64_t>(), ", ", i[3].item<int64_t>(), "]"));
  }
  const int64_t g = hq / num_kv_heads;
  at::Tensor red;
  if (need.reduce == AttentionNeed::Reduce::kMax) {
    // [B, H_q, n, T] → max over B → [H_kv, G, n, T] → max over G → [H_kv, n, T] (→ max over rows).
    red = std::get<0>(probs.narrow(2, tq - n, n).max(0)).reshape({num_kv_heads, g, n, t});
    red = std::get<0>(red.max(1));
    if (!need.per_row) red = std::get<0>(red.max(1, /*keepdim=*/true));
  } else {
    // [B, H_q, n, T] → sum over B → [H_kv, G, n, T] → mean over G → [H_kv, n, T].
    red = probs.narrow(2, tq - n, n).sum(0).view({num_kv_heads, g, n, t}).mean(1);
    if (!need.per_row) red = red.sum(1, /*keepdim=*/true);
  }
  red = red.contiguous();
  AttentionMass m;
  m.rows = red.size(1);
  m.heads.resize(static_cast<size_t>(num_kv_heads));
  const float* p = red.data_ptr<float>();
  for (int64_t h = 0; h < num_kv_heads; ++h) m.heads[static_cast<size_t>(h)].assign(p + h * m.rows * t, p + (h + 1) * m.rows * t);
  return m;
}

at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& k_pos, const at::Tensor& q_pos, at::Tensor* probs) {
  KV_CHECK_ARG(q.defined() && q.dim() == 4 && at::isFloatingType(q.scalar_type()),
               "reference_attention: q must be a floating [B, H_q, T_q, D] tensor, got ", shape_of(q));
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  KV_CHECK_ARG(k.defined() && k.dim() == 4 && k.size(0) == B && k.size(3) == D && k.size(1) >= 1 &&
                   Hq % k.size(1) == 0,
               "reference_attention: k must be [B=", B, ", H_kv | H_q=", Hq, ", S, D=", D, "], got ", shape_of(k));
  KV_CHECK_ARG(v.defined() && v.sizes() == k.sizes(), "reference_attention: v must match k ", shape_of(k), ", got ",
               shape_of(v));
  const int64_t Hkv = k.size(1), S = k.size(2);
  KV_CHECK_ARG(k_pos.defined() && k_pos.dim() == 2 && k_pos.size(0) == Hkv && k_pos.size(1) == S &&
                   k_pos.scalar_type() == at::kLong,
               "reference_attention: k_pos must be int64 [H_kv=", Hkv, ", S=", S, "], got ", shape_of(k_pos));
  KV_CHECK_ARG(q_pos.defined() && q_pos.dim() == 1 && q_pos.size(0) == T && q_pos.scalar_type() == at::kLong,
               "reference_attention: q_pos must be int64 [T_q=", T, "], got ", shape_of(q_pos));
  const at::ScalarType dt = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t G = Hq / Hkv;
  // Query head h = kv * G + g, so [B, H_q, T, D] is [B, H_kv, G·T, D] in memory: attending
  // G·T query rows per KV head needs no copy of K/V.
  const at::Tensor qg = q.to(dt).reshape({B, Hkv, G * T, D});
  at::Tensor scores = at::matmul(qg, k.to(dt).transpose(-1, -2));  // [B, H_kv, G·T, S]
  scores.mul_(1.0 / std::sqrt(static_cast<double>(D)));
  // Key s is hidden from query t iff k_pos[kv, s] > q_pos[t]: [H_kv, 1, T, S] over G.
  const at::Tensor hidden = k_pos.reshape({Hkv, 1, 1, S}).gt(q_pos.reshape({1, 1, T, 1}));
  scores.view({B, Hkv, G, T, S}).masked_fill_(hidden, -std::numeric_limits<double>::infinity());
  const at::Tensor p = at::softmax(scores, -1);
  if (probs != nullptr) *probs = p.view({B, Hq, T, S});
  return at::matmul(p, v.to(dt)).view({B, Hq, T, D});
}

std::string attention_kernels() { return cache::fused::isa_name(cache::fused::current_isa()); }

}  // namespace kvcache
