// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file runner_core.h (private)
/// The managed forward pass, written once over any cache type with CacheManager's verbs
/// (config, reset, next_position(layer), append, get, needs_attention, observe_attention,
/// end_step). Runner instantiates it for CacheManager; bench/bench_model.cpp also instantiates it
/// for ConcatKVCache to measure the CacheManager's overhead on the same code path.

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/model/causal_lm.h"
#include "kvcache/model/runner.h"

namespace kvcache::detail {

/// GQA attention over cached keys (src/model/attention.cpp).
/// @param q      `[B, H_q, T, D]` post-RoPE queries (any float dtype; computed in float32)
/// @param k      `[B, H_kv, S, D]` float32 post-RoPE keys
/// @param v      `[B, H_kv, S, D]` float32 values
/// @param k_pos  int64 `[H_kv, S]` position of each key
/// @param q_pos  int64 `[T]` position of each query
/// @param probs  if not null, receives the probabilities `[B, H_q, T, S]` float32
/// @return       `[B, H_q, T, D]` float32. A key is visible iff k_pos ≤ q_pos.
at::Tensor gqa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& k_pos, const at::Tensor& q_pos, at::Tensor* probs);

/// Throws InvalidArgument naming `fn` if an id is outside [0, vocab).
void check_token_ids(const std::vector<int64_t>& ids, int64_t vocab, const char* fn);

/// Throws InvalidArgument if the cache's layer/head/head_dim counts differ from the model's.
void check_cache_fits(const CacheConfig& cache, const ModelConfig& model, const char* fn);

enum class LogitsFor { kLastToken, kAllTokens };

/// One forward step of `ids` `[1, T]` int64 through every layer with `cache`.
/// @return logits `[1, T, V]` (kAllTokens) or `[1, 1, V]` (kLastToken) float32.
template <class Cache>
at::Tensor forward_step(const CausalLM& model, const at::Tensor& ids, Cache& cache,
                        bool is_prefill_end, LogitsFor which) {
  const int64_t T = ids.size(1);
  const bool want_probs = cache.needs_attention();
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor h = model.embed(ids);
  const int64_t L = model.config().num_hidden_layers;
  at::Tensor pos;
  int64_t pos_start = -1;
  for (int64_t l = 0; l < L; ++l) {
    // Positions per layer: in PositionMode::kRerotate with layer-dependent budgets, layers
    // hold different physical lengths and so give the new tokens different positions.
    const int64_t p0 = cache.next_position(l);
    if (p0 != pos_start) {
      pos = at::arange(p0, p0 + T, long_opts);
      pos_start = p0;
    }
    QKV x = model.qkv(l, h, pos);
    cache.append(l, x.k.to(at::kFloat), x.v.to(at::kFloat), pos);
    const LayerKV kv = cache.get(l);
    at::Tensor probs;
    at::Tensor out =
        gqa_attention(x.q, kv.k, kv.v, kv.positions, pos, want_probs ? &probs : nullptr);
    if (want_probs) cache.observe_attention(l, probs);
    h = model.finish(l, h, out.to(h.scalar_type()));
  }
  cache.end_step(is_prefill_end);
  if (which == LogitsFor::kLastToken && T > 1) h = h.slice(/*dim=*/1, T - 1, T);
  return model.head(h).to(at::kFloat);
}

inline at::Tensor ids_tensor(const int64_t* ids, int64_t n) {
  return at::tensor(at::ArrayRef<int64_t>(ids, static_cast<size_t>(n)),
                    at::TensorOptions().dtype(at::kLong))
      .view({1, n});
}

template <class Cache>
at::Tensor prefill_with(const CausalLM& model, const std::vector<int64_t>& ids, Cache& cache,
                        int64_t chunk_size) {
  KV_CHECK_ARG(!ids.empty(), "Runner::prefill: ids must not be empty");
  KV_CHECK_ARG(chunk_size >= 0, "Runner::prefill: chunk_size must be >= 0 (0 = whole prompt), got ",
               chunk_size);
  check_token_ids(ids, model.config().vocab_size, "Runner::prefill");
  check_cache_fits(cache.config(), model.config(), "Runner::prefill");
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t c = chunk_size == 0 ? n : chunk_size;
  at::Tensor logits;
  for (int64_t s = 0; s < n; s += c) {
    const int64_t t = std::min(c, n - s);
    logits = forward_step(model, ids_tensor(ids.data() + s, t), cache,
                          /*is_prefill_end=*/s + t == n, LogitsFor::kLastToken);
  }
  return logits.view({-1});
}

template <class Cache>
at::Tensor decode_step_with(const CausalLM& model, int64_t token, Cache& cache) {
  const int64_t V = model.config().vocab_size;
  KV_CHECK_ARG(token >= 0 && token < V, "Runner::decode_step: token id ", token,
               " outside the vocabulary [0, ", V, ")");
  return forward_step(model, ids_tensor(&token, 1), cache, /*is_prefill_end=*/false,
                      LogitsFor::kLastToken)
      .view({-1});
}

template <class Cache>
GenerationResult generate_with(const CausalLM& model, const std::vector<int64_t>& prompt,
                               const GenerationOptions& opt, Cache& cache) {
  KV_CHECK_ARG(!prompt.empty(), "Runner::generate: the prompt must not be empty");
  KV_CHECK_ARG(opt.max_new_tokens >= 1, "Runner::generate: max_new_tokens must be >= 1, got ",
               opt.max_new_tokens);
  check_token_ids(prompt, model.config().vocab_size, "Runner::generate");
  check_cache_fits(cache.config(), model.config(), "Runner::generate");
  const std::vector<int64_t>& eos =
      opt.eos_token_ids.empty() ? model.config().eos_token_ids : opt.eos_token_ids;
  using clock = std::chrono::steady_clock;

  GenerationResult r;
  r.prompt_tokens = static_cast<int64_t>(prompt.size());
  r.tokens.reserve(static_cast<size_t>(opt.max_new_tokens));
  std::vector<at::Tensor> kept;
  cache.reset(r.prompt_tokens + opt.max_new_tokens);

  const auto t0 = clock::now();
  at::Tensor logits = prefill_with(model, prompt, cache, opt.prefill_chunk);
  const auto t1 = clock::now();
  while (true) {
    const int64_t next = logits.argmax().item<int64_t>();  // the one host read per token
    r.tokens.push_back(next);
    if (opt.keep_logits) kept.push_back(logits);
    if (opt.stop_at_eos && std::find(eos.begin(), eos.end(), next) != eos.end()) {
      r.stopped_at_eos = true;
      break;
    }
    if (static_cast<int64_t>(r.tokens.size()) == opt.max_new_tokens) break;
    logits = decode_step_with(model, next, cache);
    ++r.decode_steps;
  }
  const auto t2 = clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  r.decode_seconds = std::chrono::duration<double>(t2 - t1).count();
  if (opt.keep_logits) r.logits = at::stack(kept);
  return r;
}

template <class Cache>
ScoreResult score_with(const CausalLM& model, const std::vector<int64_t>& ids, Cache& cache,
                       int64_t chunk_size) {
  KV_CHECK_ARG(ids.size() >= 2, "Runner::score: needs at least 2 tokens, got ", ids.size());
  KV_CHECK_ARG(chunk_size >= 0, "Runner::score: chunk_size must be >= 0 (0 = one step), got ",
               chunk_size);
  check_token_ids(ids, model.config().vocab_size, "Runner::score");
  check_cache_fits(cache.config(), model.config(), "Runner::score");
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t c = chunk_size == 0 ? n : chunk_size;
  const auto t0 = std::chrono::steady_clock::now();
  cache.reset(n);
  const at::Tensor all = ids_tensor(ids.data(), n).view({-1});
  std::vector<at::Tensor> parts;
  for (int64_t s = 0; s < n; s += c) {
    const int64_t t = std::min(c, n - s);
    const at::Tensor logits = forward_step(model, ids_tensor(ids.data() + s, t), cache,
                                           /*is_prefill_end=*/s + t == n, LogitsFor::kAllTokens);
    // Predict ids[s+1 .. s+t]; the last token of the sequence has no successor.
    const int64_t m = std::min(t, n - 1 - s);
    if (m <= 0) break;
    const at::Tensor lp = at::log_softmax(logits[0].slice(0, 0, m), -1);
    parts.push_back(lp.gather(1, all.slice(0, s + 1, s + 1 + m).unsqueeze(1)).squeeze(1));
  }
  ScoreResult r;
  r.logprobs = at::cat(parts);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace kvcache::detail
