// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file policies.h
/// Internal declarations of the registered eviction policies (built through
/// make_eviction_policy; declared here so unit tests can reach the scoring helpers).

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/eviction_policy.h"
#include "kvcache/spec.h"

namespace kvcache::evict {

/// A plan that evicts the same indices from every one of `num_kv_heads` heads.
EvictionPlan uniform_plan(const std::vector<int64_t>& evict, int64_t num_kv_heads);
/// Per head holding t > `keep` tokens: evict the t − keep tokens from index `first` on (the
/// first `first` and the last keep − first survive). A window is first = 0, StreamingLLM's
/// sinks first = s.
EvictionPlan evict_span(const EvictionContext& ctx, int64_t first, int64_t keep);
/// The resident count shared by every head of `ctx` (uniform policies plan that way).
/// @throws InvalidArgument naming `policy` if the heads hold different counts.
int64_t uniform_resident(const EvictionContext& ctx, const char* policy);

/// `full`: never evicts.
class FullPolicy final : public EvictionPolicy {
 public:
  static const ParamTable& table();
  explicit FullPolicy(const ParsedSpec& spec, Budget budget);
  int64_t layer_budget(int64_t layer) const override;
  EvictionPlan plan(const EvictionContext& ctx) const override;
};

/// `window:w<N>`: the N most recent tokens (N defaults to the budget).
class WindowPolicy final : public EvictionPolicy {
 public:
  static const ParamTable& table();
  WindowPolicy(const ParsedSpec& spec, Budget budget);
  int64_t layer_budget(int64_t layer) const override;
  EvictionPlan plan(const EvictionContext& ctx) const override;

 protected:
  void on_reset() override;

 private:
  int64_t w_param_;  ///< -1: from the budget
  int64_t window_ = 0;
};

/// `sink:s<n>:w<N>`: StreamingLLM (arXiv 2309.17453): the first n resident tokens (attention
/// sinks) + the N most recent; N defaults to budget − n.
class SinkPolicy final : public EvictionPolicy {
 public:
  static const ParamTable& table();
  SinkPolicy(const ParsedSpec& spec, Budget budget);
  int64_t layer_budget(int64_t layer) const override;
  EvictionPlan plan(const EvictionContext& ctx) const override;
  int64_t sinks() const { return sinks_; }
  int64_t window() const { return window_; }

 protected:
  void on_reset() override;

 private:
  int64_t sinks_;
  int64_t w_param_;  ///< -1: budget − sinks
  int64_t window_ = 0;
};

/// `h2o:h<N>:r<N>`: Heavy-Hitter Oracle (arXiv 2306.14048). Score = attention received,
/// accumulated over every observed query (sum over queries and batch, mean over the query
/// heads of a KV group). Keeps the r most recent tokens + the h highest-scoring older ones.
class H2OPolicy final : public EvictionPolicy {
 public:
  static const ParamTable& table();
  H2OPolicy(const ParsedSpec& spec, Budget budget);
  int64_t layer_budget(int64_t layer) const override;
  AttentionNeed attention_need() const override { return {AttentionNeed::kAllRows, false}; }
  EvictionPlan plan(const EvictionContext& ctx) const override;
  void on_evicted(int64_t layer, const EvictionPlan& plan) override;
  /// Accumulated scores of `layer`, per KV head (one per token observed so far).
  const std::vector<std::vector<float>>& scores(int64_t layer) const { return scores_.at(static_cast<size_t>(layer)); }
  int64_t heavy() const { return heavy_; }
  int64_t recent() const { return recent_; }

 protected:
  void on_reset() override;
  void do_observe(int64_t layer, const AttentionMass& mass) override;

 private:
  int64_t h_param_, r_param_;  ///< -1: derived from the budget
  int64_t heavy_ = 0, recent_ = 0;
  std::vector<std::vector<std::vector<float>>> scores_;  ///< per layer, per KV head
};

/// `random:seed<k>`: drops uniformly chosen tokens (per KV head, independent draws) except
/// the newest; reproducible from the seed and the sequence of calls.
class RandomPolicy final : public EvictionPolicy {
 public:
  static const ParamTable& table();
  RandomPolicy(const ParsedSpec& spec, Budget budget);
  int64_t layer_budget(int64_t layer) const override;
  EvictionPlan plan(const EvictionContext& ctx) const override;
  /// Advances the layer's stream: the next plan draws anew.
  void on_evicted(int64_t layer, const EvictionPlan& plan) override;

 protected:
  void on_reset() override;

 private:
  uint64_t seed_;
  std::vector<uint64_t> calls_;  ///< per layer: plans drawn so far this request
};

/// `tova`: Token Omission Via Attention (arXiv 2401.06104). When over budget, keeps the
/// tokens with the highest attention from the LAST query of the step, averaged over all
/// query heads of the layer; one selection shared by every KV head; the newest token is kept.
class TovaPolicy final : public EvictionPolicy {
 public:
  static const ParamTable& table();
  TovaPolicy(const ParsedSpec& spec, Budget budget);
  int64_t layer_budget(int64_t layer) const override;
  AttentionNeed attention_need() const override { return {1, true}; }
  EvictionPlan plan(const EvictionContext& ctx) const override;
  void on_evicted(int64_t layer, const EvictionPlan& plan) override;

 protected:
  void on_reset() override;
  void do_observe(int64_t layer, const AttentionMass& mass) override;

 private:
  std::vector<std::vector<float>> last_row_;  ///< per layer `[T]`, cleared after each plan
};

/// `snapkv:w<N>:k<N>:avg|max`: SnapKV (arXiv 2404.14469), applied once at the end of prefill.
/// Scores of the prompt keys before the observation window = attention from the last w
/// prompt queries (mean over those queries and over each KV group's query heads), pooled
/// along keys with kernel k (padding k/2; avg counts zero padding like PyTorch avg_pool1d,
/// max pads with −inf). Keeps the top (keep − w) per KV head + the whole window, where keep =
/// budget − (context_length − prompt_length), so that the budget still holds after the
/// request's last new token. Decode tokens are appended and never evicted.
class SnapKVPolicy : public EvictionPolicy {
 public:
  static const ParamTable& table();
  SnapKVPolicy(const ParsedSpec& spec, Budget budget);
  int64_t layer_budget(int64_t layer) const override;
  AttentionNeed attention_need() const override {
    return prefill_done_ ? AttentionNeed{} : AttentionNeed{window_, true};
  }
  EvictionPlan plan(const EvictionContext& ctx) const override;
  /// At the end of the prompt: the layer's rows are spent; after the last layer, done.
  void on_step_end(const EvictionContext& ctx) override;

  /// Pools `scores` `[H, T]` along T with kernel `kernel` (odd), stride 1, padding kernel/2.
  /// avg: zero padding counted (avg_pool1d default); max: padding ignored.
  static at::Tensor pool(const at::Tensor& scores, int64_t kernel, bool use_max);

 protected:
  SnapKVPolicy(const ParsedSpec& spec, Budget budget, int64_t window, int64_t kernel, bool use_max);
  void on_reset() override;
  void do_observe(int64_t layer, const AttentionMass& mass) override;
  /// Tokens reserved for the request's remaining (decode) tokens at the end of the prompt.
  int64_t decode_reserve(const EvictionContext& ctx) const;
  /// Prompt tokens `layer` keeps when the uniform count is `uniform_keep` for a prompt of
  /// `prompt` resident tokens (SnapKV: uniform).
  virtual int64_t prompt_keep(int64_t layer, int64_t prompt, int64_t uniform_keep) const {
    (void)layer;
    (void)prompt;
    return uniform_keep;
  }
  const char* name() const { return spec_head(spec()) == "pyramid" ? "pyramid" : "snapkv"; }
  int64_t window() const { return window_; }
  bool prefill_done() const { return prefill_done_; }

 private:
  int64_t window_, kernel_;
  bool use_max_;
  bool prefill_done_ = false;
  int64_t layers_done_ = 0;
  std::vector<at::Tensor> rows_;  ///< per layer `[H_kv, n_rows <= w, T]` last query rows
};

/// `pyramid:w<N>:k<N>:b<beta>:avg|max`: PyramidKV (arXiv 2406.02069; kvpress PyramidKVPress):
/// SnapKV scoring with layer budgets decreasing linearly from layer 0 to the last layer
/// around the uniform count n (methods.md b.10): min = n/β, max = 2n − min, clipped to
/// max ≤ T − w (then min = 2n − max); layer l keeps round_half_even(max − l·(max − min)/(L−1));
/// uniform SnapKV unless T ≥ max ≥ min ≥ w.
class PyramidKVPolicy final : public SnapKVPolicy {
 public:
  static const ParamTable& table();
  PyramidKVPolicy(const ParsedSpec& spec, Budget budget);

  /// Per-layer kept prompt tokens for a prompt of `prompt` tokens, uniform count `n`,
  /// window `w`, `beta`, `layers` layers.
  static std::vector<int64_t> budgets(int64_t prompt, int64_t n, int64_t w, double beta,
                                      int64_t layers);
  /// After the prompt: that layer's kept prompt tokens + the decode reserve.
  int64_t layer_budget(int64_t layer) const override;
  /// At the first layer's prompt end: fixes the per-layer budgets.
  void on_step_end(const EvictionContext& ctx) override;

 protected:
  void on_reset() override;
  int64_t prompt_keep(int64_t layer, int64_t prompt, int64_t uniform_keep) const override;

 private:
  double beta_;
  std::vector<int64_t> budgets_;  ///< fixed after the first layer's prefill end
  int64_t reserve_ = 0;           ///< decode tokens reserved when budgets_ was computed
};

/// Splittable 64-bit generator (SplitMix64) used by RandomPolicy: portable across standard
/// libraries, unlike std::uniform_int_distribution.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next();
  /// Uniform integer in [0, n) (rejection sampling, no modulo bias). n > 0.
  uint64_t below(uint64_t n);

 private:
  uint64_t state_;
};

}  // namespace kvcache::evict
