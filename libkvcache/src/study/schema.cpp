// SPDX-License-Identifier: Apache-2.0
// The row-metric table (schema.h): every number a result row may carry, once, with its unit.
#include "kvcache/study/schema.h"

namespace kvcache::study {

const std::vector<RowMetric>& row_metrics() {
  // key, unit, row kinds, description, CacheStats field (the sweep copies those from stats()).
  static const std::vector<RowMetric> table = {
      {"prompt_tokens", "tokens", "task", "tokens of the chat-template-rendered prompt", nullptr},
      {"generated_tokens", "tokens", "task", "new tokens decoded (incl. the end-of-turn token)", nullptr},
      {"prefill_s", "s", "task", "wall time of the prefill", nullptr},
      {"decode_s", "s", "task", "wall time of the decode loop", nullptr},
      {"prefill_tok_s", "tokens/s", "task", "prompt tokens / prefill wall time (absent when the prefill took no time)",
       nullptr},
      {"decode_ms_per_token", "ms/token", "task", "decode wall time / new tokens (absent when none was decoded)", nullptr},
      {"replay_s", "s", "task",
       "wall time of the context replay (KVzip's extra prefill, not in prefill_s; 0: the policy needs none)", nullptr},
      {"replay_tokens", "tokens", "task", "tokens the context replay fed (instruction + context per chunk)", nullptr},
      {"span_resident", "fraction", "task",
       "fraction of the task's load-bearing span positions still resident after prefill (all layers and KV heads)",
       nullptr},
      {"question_tokens", "tokens", "task",
       "query-agnostic rows: prompt tokens fed as decode steps after the context was compressed (the question; 0: "
       "the task has no question after its context and ran as query-aware)",
       nullptr},
      {"rss_growth_peak_bytes", "bytes", "task",
       "peak growth of the process's resident set during the request (the cache and the request's other allocations)",
       nullptr},
      {"tokens_written", "tokens", "task,text", "tokens ever appended to the cache", &CacheStats::tokens_written},
      {"tokens_resident", "tokens", "task,text",
       "tokens stored at the end (per layer the longest KV head, summed over layers)", &CacheStats::tokens_resident},
      {"tokens_resident_peak", "tokens", "task,text", "peak of tokens_resident", &CacheStats::tokens_resident_peak},
      {"peak_bytes", "bytes", "task,text", "peak stored bytes of the live tokens (bytes_resident_peak)",
       &CacheStats::bytes_resident_peak},
      {"final_bytes", "bytes", "task,text", "stored bytes of the live tokens at the end (bytes_resident)",
       &CacheStats::bytes_resident},
      {"peak_reserved_bytes", "bytes", "task,text", "peak bytes of the blocks the cache held (bytes_reserved_peak)",
       &CacheStats::bytes_reserved_peak},
      {"final_reserved_bytes", "bytes", "task,text", "bytes of the blocks held at the end (bytes_reserved)",
       &CacheStats::bytes_reserved},
      {"ppl_single", "ratio", "text", "perplexity of the passage from one forward pass through a fresh cache", nullptr},
      {"ppl_stream", "ratio", "text", "perplexity of the passage streamed token by token through the managed cache",
       nullptr},
      {"scored_tokens", "tokens", "text", "tokens scored by the streaming pass", nullptr},
      {"kld_mean", "nats", "text", "mean over positions of KL(P_control || P_arm) of the streaming distributions",
       nullptr},
      {"kld_max", "nats", "text", "max over positions of that KL divergence", nullptr},
      {"kld_median", "nats", "text", "median over positions of that KL divergence (linear interpolation)", nullptr},
      {"kld_p99", "nats", "text", "99th percentile over positions of that KL divergence (rank 0.99·(N − 1))", nullptr},
      {"kld_p999", "nats", "text", "99.9th percentile over positions of that KL divergence (rank 0.999·(N − 1))",
       nullptr},
      {"top1", "fraction", "text", "fraction of positions whose argmax agrees with the control's", nullptr},
      {"bits_per_value", "bits/value", "recon", "stored bits per K/V value (KIVI: mean of K and V)", nullptr},
      {"key_rel_err", "fraction", "recon", "relative Frobenius error of the reconstructed keys", nullptr},
      {"value_rel_err", "fraction", "recon", "relative Frobenius error of the reconstructed values", nullptr},
      {"key_max_abs", "", "recon", "max |K - K_hat| (in the keys' own units)", nullptr},
      {"value_max_abs", "", "recon", "max |V - V_hat| (in the values' own units)", nullptr},
      {"attn_out_rel_err", "fraction", "recon",
       "relative Frobenius error of the causal attention output over the scheme's K_hat/V_hat", nullptr},
      {"attn_prob_rel_err", "fraction", "recon",
       "relative Frobenius error of the attention probabilities over the scheme's K_hat/V_hat", nullptr},
      {"out_rel_err", "fraction", "attn", "relative Frobenius error of the attention output", nullptr},
      {"prob_rel_err", "fraction", "attn", "relative Frobenius error of the attention probabilities", nullptr},
      {"bits", "bits/value", "attn", "bit width of the fake quantization", nullptr},
      {"group", "count", "attn", "values per quantization group", nullptr},
  };
  return table;
}

const RowMetric* find_row_metric(const std::string& key) {
  for (const auto& m : row_metrics()) {
    if (key == m.key) return &m;
  }
  return nullptr;
}

}  // namespace kvcache::study
