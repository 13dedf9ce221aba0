// SPDX-License-Identifier: Apache-2.0
// The reference attention (plain at:: ops) and the attention mass as a tensor
// (kvcache/torch/attention.h).
#include "kvcache/torch/attention.h"

#include <cmath>
#include <limits>

#include "kvcache/error.h"

namespace kvcache {

at::Tensor mass_tensor(const AttentionMass& mass) {
  KV_CHECK_ARG(!mass.heads.empty() && mass.rows > 0, "mass_tensor: empty mass");
  const int64_t t = mass.keys(0), rows = mass.rows;
  auto out = at::empty({mass.num_kv_heads(), rows, t}, at::kFloat);
  for (int64_t h = 0; h < mass.num_kv_heads(); ++h) {
    KV_CHECK_ARG(mass.keys(h) == t, "mass_tensor: head ", h, " holds ", mass.keys(h), " keys but head 0 holds ", t,
                 " (ragged heads have no [H_kv, rows, T] form)");
    std::copy(mass.heads[static_cast<size_t>(h)].begin(), mass.heads[static_cast<size_t>(h)].end(),
              out.data_ptr<float>() + h * rows * t);
  }
  return out;
}

at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& k_pos, const at::Tensor& q_pos, at::Tensor* probs) {
  KV_CHECK_ARG(q.defined() && q.dim() == 4 && at::isFloatingType(q.scalar_type()),
               "reference_attention: q must be a floating [B, H_q, T_q, D] tensor, got ", shape_str(q));
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  KV_CHECK_ARG(k.defined() && k.dim() == 4 && k.size(0) == B && k.size(3) == D && k.size(1) >= 1 &&
                   Hq % k.size(1) == 0,
               "reference_attention: k must be [B=", B, ", H_kv | H_q=", Hq, ", S, D=", D, "], got ", shape_str(k));
  KV_CHECK_ARG(v.defined() && v.sizes() == k.sizes(), "reference_attention: v must match k ", shape_str(k), ", got ",
               shape_str(v));
  const int64_t Hkv = k.size(1), S = k.size(2);
  KV_CHECK_ARG(k_pos.defined() && k_pos.dim() == 2 && k_pos.size(0) == Hkv && k_pos.size(1) == S &&
                   k_pos.scalar_type() == at::kLong,
               "reference_attention: k_pos must be int64 [H_kv=", Hkv, ", S=", S, "], got ", shape_str(k_pos));
  KV_CHECK_ARG(q_pos.defined() && q_pos.dim() == 1 && q_pos.size(0) == T && q_pos.scalar_type() == at::kLong,
               "reference_attention: q_pos must be int64 [T_q=", T, "], got ", shape_str(q_pos));
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

}  // namespace kvcache
