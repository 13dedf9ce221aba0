// SPDX-License-Identifier: Apache-2.0
#include <cmath>
#include <limits>

#include "model/runner_core.h"

namespace kvcache::detail {

at::Tensor gqa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& k_pos, const at::Tensor& q_pos, at::Tensor* probs) {
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  KV_INTERNAL_ASSERT(k.dim() == 4 && k.size(0) == B && k.size(3) == D && v.sizes() == k.sizes(),
                     "k ", k.sizes(), " v ", v.sizes(), " q ", q.sizes());
  KV_INTERNAL_ASSERT(Hq % Hkv == 0 && k_pos.dim() == 2 && k_pos.size(0) == Hkv &&
                         k_pos.size(1) == S && q_pos.numel() == T,
                     "k_pos ", k_pos.sizes(), " q_pos ", q_pos.sizes());
  const int64_t G = Hq / Hkv;
  // Query head h = kv * G + g, so [B, H_q, T, D] is [B, H_kv, G, T, D] in memory: attending
  // G·T query rows per KV head needs no copy of K/V.
  const at::Tensor qg = q.to(at::kFloat).reshape({B, Hkv, G * T, D});
  at::Tensor scores = at::matmul(qg, k.transpose(-1, -2));  // [B, H_kv, G·T, S]
  scores.mul_(1.0 / std::sqrt(static_cast<double>(D)));
  // Key s is hidden from query t iff k_pos[kv, s] > q_pos[t]: [H_kv, 1, T, S] over G.
  const at::Tensor hidden = k_pos.view({Hkv, 1, 1, S}).gt(q_pos.view({1, 1, T, 1}));
  scores.view({B, Hkv, G, T, S}).masked_fill_(hidden, -std::numeric_limits<float>::infinity());
  const at::Tensor p = at::softmax(scores, -1);
  if (probs != nullptr) *probs = p.view({B, Hq, T, S});
  return at::matmul(p, v).view({B, Hq, T, D});
}

void check_token_ids(const std::vector<int64_t>& ids, int64_t vocab, const char* fn) {
  for (size_t i = 0; i < ids.size(); ++i) {
    KV_CHECK_ARG(ids[i] >= 0 && ids[i] < vocab, fn, ": token id ", ids[i], " at index ", i,
                 " outside the vocabulary [0, ", vocab, ")");
  }
}

void check_cache_fits(const CacheConfig& c, const ModelConfig& m, const char* fn) {
  KV_CHECK_ARG(c.num_layers == m.num_hidden_layers && c.num_q_heads == m.num_attention_heads &&
                   c.num_kv_heads == m.num_key_value_heads && c.head_dim == m.head_dim,
               fn, ": cache config (layers=", c.num_layers, ", H_q=", c.num_q_heads,
               ", H_kv=", c.num_kv_heads, ", D=", c.head_dim,
               ") does not fit the model (layers=", m.num_hidden_layers,
               ", H_q=", m.num_attention_heads, ", H_kv=", m.num_key_value_heads,
               ", D=", m.head_dim, "); build it from CausalLM::cache_config()");
}

}  // namespace kvcache::detail
