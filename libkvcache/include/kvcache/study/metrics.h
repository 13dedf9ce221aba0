// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file metrics.h
/// Pure metric functions of kv_study: perplexity (whole-sequence and strided windows),
/// KL divergence / top-1 agreement of next-token distributions, and the attention error of a
/// K/V quantization granularity scheme (the quantization deep-dive's table).
///
/// Conventions: log-probabilities are natural logs; logits `[N, V]` (N scored positions,
/// V vocabulary) any floating dtype, computed in float64; q `[B, H_q, T_q, D]`,
/// k/v `[B, H_kv, T, D]` (query head h reads KV head h / (H_q / H_kv)).

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvcache/types.h"

namespace kvcache::study {

// ---------------------------------------------------------------- perplexity

/// Accumulates negative log-likelihood per token. Perplexity is exp(total NLL / tokens):
/// an average per token, never per window or per chunk.
class NllAccumulator {
 public:
  /// Adds the log-probabilities of `logprobs` (any shape, any float dtype; every element is one
  /// scored token). @throws InvalidArgument on NaN or a positive log-probability > 1e-6.
  void add(const at::Tensor& logprobs);
  void add(const std::vector<double>& logprobs);
  int64_t tokens() const { return tokens_; }
  double total_nll() const { return total_nll_; }
  /// Mean NLL per token. @throws InvalidArgument if no token was added.
  double mean_nll() const;
  /// exp(mean_nll()).
  double perplexity() const;

 private:
  void add_one(double lp);
  double total_nll_ = 0;
  int64_t tokens_ = 0;
};

/// exp(-mean(logprobs)). @throws InvalidArgument if empty.
double perplexity(const std::vector<double>& logprobs);
double perplexity(const at::Tensor& logprobs);

/// One window of a strided perplexity evaluation: the model reads tokens [begin, end) and the
/// targets [score_begin, end) are scored (token t predicted from tokens [begin, t)).
struct EvalWindow {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t score_begin = 0;
};

/// Strided windows over `n_tokens` tokens (Hugging Face's "perplexity of fixed-length
/// models" scheme): windows of at most `max_length` tokens start every `stride` tokens and each
/// scores only tokens not scored by an earlier window, so tokens 1..n_tokens-1 are scored
/// exactly once (token 0 has no context). stride = max_length - 1 gives windows that share
/// one context token. (stride == max_length is refused: the first token of every window after
/// the first would have no context and go unscored, as in Hugging Face's recipe.)
/// @throws InvalidArgument unless n_tokens >= 2, max_length >= 2 and 1 <= stride < max_length.
std::vector<EvalWindow> strided_windows(int64_t n_tokens, int64_t max_length, int64_t stride);

/// Log-probabilities of the scored targets of one window: returns a tensor of
/// `window.end - window.score_begin` elements.
using WindowScorer = std::function<at::Tensor(const EvalWindow& window)>;

/// Perplexity over strided windows, averaged per token.
/// @throws InvalidArgument if a scorer returns the wrong number of log-probabilities.
double strided_perplexity(int64_t n_tokens, int64_t max_length, int64_t stride,
                          const WindowScorer& scorer);

// ---------------------------------------------------------------- distributions

/// Next-token distribution comparison of a test arm against a reference (control) arm.
struct DistributionComparison {
  double kld_mean = 0;        ///< mean over positions of KL(P_ref || P_test), nats
  double kld_max = 0;         ///< max over positions
  /// Percentiles over positions (llama.cpp's perplexity tool reports these): linear
  /// interpolation between order statistics, the p-quantile at rank p·(N − 1) (numpy's default).
  double kld_median = 0, kld_p99 = 0, kld_p999 = 0;
  double top1_agreement = 0;  ///< fraction of positions whose argmax agrees (ties: lowest index)
  int64_t positions = 0;
};

/// Compares logits `ref` and `test`, both `[N, V]` (a 1-D `[V]` counts as one position).
/// @throws InvalidArgument if shapes differ or N == 0.
DistributionComparison compare_logits(const at::Tensor& ref, const at::Tensor& test);

// ---------------------------------------------------------------- attention error

/// Asymmetric min-max group fake-quantization (methods b.1, the KIVI/HF/GEAR core), the
/// reference of the attention-error table: per group mn = min, s = (max - mn)/(2^bits - 1),
/// code = round_half_even(clamp((x - mn)/s, 0, 2^bits - 1)), x_hat = code*s + mn; scale and
/// minimum kept in float32; a constant group (s = 0) reconstructs exactly.
/// Groups of `group` consecutive values run along head_dim (kPerToken) or along tokens
/// (kPerChannel); a short last group is allowed. Returns float32 of x's shape.
/// @param x `[B, H, T, D]` floating.
/// @throws InvalidArgument unless 1 <= bits <= 16, group >= 1 and x is 4-D floating.
at::Tensor fake_quantize_minmax(const at::Tensor& x, int bits, int64_t group, GroupAxis axis);

/// The deep-dive's four K/V granularity schemes.
enum class KvGranularity {
  kPerTokenKV,            ///< K and V per token ("per-token K&V", FlexGen-style)
  kPerChannelKV,          ///< K and V per channel
  kPerChannelKPerTokenV,  ///< KIVI (arXiv 2402.02750): K per channel, V per token
  kPerTokenKPerChannelV,  ///< the inverse of KIVI
};
std::vector<KvGranularity> all_granularities();
/// "per-token K&V", "per-channel K&V", "per-channel K + per-token V (KIVI)",
/// "per-token K + per-channel V".
std::string describe(KvGranularity g);
/// Short key used in result rows: "tok-kv", "chan-kv", "kivi", "tok-k-chan-v".
std::string key(KvGranularity g);
/// @throws InvalidArgument listing the keys.
KvGranularity parse_granularity(const std::string& key);

/// Error of attention computed with quantized K/V.
struct AttentionError {
  double out_rel_fro = 0;   ///< ||O - O_hat||_F / ||O||_F,  O = softmax(q K^T / sqrt(D)) V
  double prob_rel_fro = 0;  ///< ||P - P_hat||_F / ||P||_F for the probabilities P
};

/// Attention error of (k_hat, v_hat) vs (k, v) for queries q. Causal: query i of T_q attends
/// keys [0, T - T_q + i] (queries are the last T_q positions). Computed in float64.
/// @throws InvalidArgument on shape mismatch (naming expected vs got).
AttentionError attention_error(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& k_hat, const at::Tensor& v_hat, bool causal);

/// Q/K/V of one attention layer (captured from a model or synthetic). k is post-RoPE.
struct QkvSample {
  int64_t layer = 0;
  at::Tensor q;  ///< `[B, H_q, T_q, D]`
  at::Tensor k;  ///< `[B, H_kv, T, D]`
  at::Tensor v;  ///< `[B, H_kv, T, D]`
  /// The keys before RoPE `[B, H_kv, T, D]` when captured from a model (undefined for synthetic
  /// samples): what a scheme with pre-RoPE key storage (KVQuant) quantizes.
  at::Tensor k_pre;
};

/// Attention error of scheme `g` at `bits` with groups of `group`, averaged over samples
/// (each sample's relative errors weighted equally). Causal attention.
AttentionError scheme_attention_error(const std::vector<QkvSample>& samples, KvGranularity g,
                                      int bits, int64_t group);

/// A synthetic attention layer with the outlier structure of real keys (KIVI / KVQuant
/// observation): q, v ~ N(0, 1); k ~ N(0, 1) plus, on `outlier_channels` fixed channels, an
/// offset and scale of `outlier_scale`. Deterministic for a seed (CPU generator).
/// @throws InvalidArgument on non-positive sizes, h_q % h_kv != 0, more than 2^24 values in
///         q, outlier_channels outside [0, head_dim] or outlier_scale outside [-1e4, 1e4].
QkvSample synthetic_qkv(uint64_t seed, int64_t h_q, int64_t h_kv, int64_t tokens, int64_t head_dim,
                        int64_t outlier_channels = 4, double outlier_scale = 8.0);

}  // namespace kvcache::study
