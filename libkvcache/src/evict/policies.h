// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file policies.h
/// Internal declarations of the registered eviction policies (built through
/// make_eviction_policy; declared here so unit tests can reach the scoring helpers).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvcache/eviction_policy.h"
#include "kvcache/snapshot.h"
#include "kvcache/spec.h"

namespace kvcache::evict {

/// Builds `perlayer(<policy>@<budget>*<n>;...)` (src/evict/per_layer_policy.cpp): the runs are
/// validated now, the layer count at reset(). @throws InvalidArgument / CapacityError naming
/// the run as written.
std::unique_ptr<EvictionPolicy> make_per_layer_policy(const std::string& text);

/// `ctx.view`, checked against the context (head count, tokens per head).
/// @throws InvalidArgument naming `policy` if it is null or does not match.
const LayerView& require_view(const EvictionContext& ctx, const char* policy);
/// The `once|stream` choice of ScheduledScorer policies (ParamTable entry "schedule").
ParamDef scorer_schedule_param();

/// Keep-scores of one layer: per KV head, one float per resident token in cache order
/// (higher = keep; +inf = protected: never evicted by a selection).
using TokenScores = std::vector<std::vector<float>>;

/// A policy that ranks tokens by a per-token score (kvpress's ScorerPress): when it compresses a
/// layer, it keeps `target` tokens per KV head by score. Splitting *when* and *how many*
/// (compression_target), *which scores* (score) and *how the kept set is chosen* (select) is
/// what lets AdaKV (head-wise selection) and decode-time compression (its own schedule) wrap
/// any scorer. plan() = target → over_target → score → select.
class ScorerPolicy : public EvictionPolicy {
 public:
  /// Tokens per KV head `ctx.layer` keeps if the policy compresses it in this step; nullopt
  /// when this step is not one of its compression points (SnapKV before the prompt's end).
  /// @throws CapacityError if the budget cannot hold the protected tokens.
  virtual std::optional<int64_t> compression_target(const EvictionContext& ctx) const = 0;
  /// Keep-scores of `ctx.layer` (one row per KV head, ctx.resident[h] values each).
  /// @throws InvalidArgument if what it scores from (attention, queries, ctx.view) is missing.
  virtual TokenScores score(const EvictionContext& ctx) const = 0;
  /// Whether score() works at every step (decode-time compression needs that); false: only at
  /// the policy's own compression points (SnapKV, PyramidKV).
  virtual bool scores_any_step() const { return true; }
  /// Whether select() distributes the budget across heads (AdaKV, or a wrapper around it).
  virtual bool head_wise() const { return false; }
  /// Whether compression_target() follows a decode-time schedule (decode, or a wrapper around it).
  virtual bool decode_scheduled() const { return false; }
  /// Whether keeping `target` per head evicts anything: some head holds more than `target`
  /// (uniform selection); AdaKV: the layer holds more than H_kv · target.
  virtual bool over_target(const EvictionContext& ctx, int64_t target) const;
  /// The plan that keeps `target` tokens per head: per head, the highest scores (ties keep the
  /// more recent token); the newest token is always kept. AdaKV overrides it (head-wise).
  /// @throws CapacityError if a head protects (+inf) more than `target` tokens.
  virtual EvictionPlan select(const EvictionContext& ctx, int64_t target, TokenScores scores) const;
  EvictionPlan plan(const EvictionContext& ctx) const override;

 protected:
  using EvictionPolicy::EvictionPolicy;
  /// `*inner` (a wrapper's inner policy, checked not null) for the wrapper's base constructor.
  static const EvictionPolicy& wrapped(const std::unique_ptr<EvictionPolicy>& inner, const char* wrapper);
};

/// The compression schedule of the scorers that come in two modes (knorm, keydiff, expected):
///   - once (default, kvpress's presses): at the end of the prompt, like SnapKV, keeping
///     budget − (context − prompt) tokens so that the budget holds after the last new token;
///     decode tokens are appended and never evicted;
///   - stream: whenever a head holds more than the budget at the end of any step, prefill
///     chunks included (KeyDiff's block-wise prefill), so the budget holds throughout.
class ScheduledScorer : public ScorerPolicy {
 public:
  std::optional<int64_t> compression_target(const EvictionContext& ctx) const override;
  void on_step_end(const EvictionContext& ctx) override;
  int64_t layer_budget(int64_t layer) const override;
  bool streaming() const { return stream_; }

 protected:
  ScheduledScorer(const ParsedSpec& spec, Budget budget, bool stream, const std::string& name);
  void on_reset() override;
  void do_persist(PolicyStateIO& io) override;
  /// Tokens always kept at the start of the cache (Expected Attention's sinks).
  virtual int64_t protected_prefix() const { return 0; }
  const std::string& name() const { return name_; }

 private:
  bool stream_;
  std::string name_;
  bool prompt_done_ = false;
  int64_t layers_done_ = 0;
};

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
class H2OPolicy final : public ScorerPolicy {
 public:
  static const ParamTable& table();
  H2OPolicy(const ParsedSpec& spec, Budget budget);
  int64_t layer_budget(int64_t layer) const override;
  AttentionNeed attention_need() const override { return {AttentionNeed::kAllRows, false}; }
  /// Every step: heavy + recent per head.
  std::optional<int64_t> compression_target(const EvictionContext& ctx) const override;
  /// Accumulated scores; the recent window +inf.
  TokenScores score(const EvictionContext& ctx) const override;
  void on_evicted(int64_t layer, const EvictionPlan& plan) override;
  /// Accumulated scores of `layer`, per KV head (one per token observed so far).
  const std::vector<std::vector<float>>& scores(int64_t layer) const { return scores_.at(static_cast<size_t>(layer)); }
  int64_t heavy() const { return heavy_; }
  int64_t recent() const { return recent_; }

 protected:
  void on_reset() override;
  void do_persist(PolicyStateIO& io) override;
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
  void do_persist(PolicyStateIO& io) override;

 private:
  uint64_t seed_;
  std::vector<uint64_t> calls_;  ///< per layer: plans drawn so far this request
};

/// `tova`: Token Omission Via Attention (arXiv 2401.06104). When over budget, keeps the
/// tokens with the highest attention from the LAST query of the step, averaged over all
/// query heads of the layer; one selection shared by every KV head; the newest token is kept.
class TovaPolicy final : public ScorerPolicy {
 public:
  static const ParamTable& table();
  TovaPolicy(const ParsedSpec& spec, Budget budget);
  int64_t layer_budget(int64_t layer) const override;
  AttentionNeed attention_need() const override { return {1, true}; }
  std::optional<int64_t> compression_target(const EvictionContext& ctx) const override;
  /// The layer-wide mean of the last query's attention, the same row for every KV head (so
  /// AdaKV over TOVA selects what TOVA does, as in kvpress).
  TokenScores score(const EvictionContext& ctx) const override;
  void on_evicted(int64_t layer, const EvictionPlan& plan) override;

 protected:
  void on_reset() override;
  void do_persist(PolicyStateIO& io) override;
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
class SnapKVPolicy : public ScorerPolicy {
 public:
  static const ParamTable& table();
  SnapKVPolicy(const ParsedSpec& spec, Budget budget);
  int64_t layer_budget(int64_t layer) const override;
  AttentionNeed attention_need() const override {
    return prefill_done_ ? AttentionNeed{} : AttentionNeed{window_, true};
  }
  /// At the end of the prompt only: the prompt tokens the layer keeps.
  std::optional<int64_t> compression_target(const EvictionContext& ctx) const override;
  /// Pooled window attention of the prefix; the window +inf.
  TokenScores score(const EvictionContext& ctx) const override;
  bool scores_any_step() const override { return false; }
  /// At the end of the prompt: the layer's rows are spent; after the last layer, done.
  void on_step_end(const EvictionContext& ctx) override;

  /// Pools `scores` row-major `[H, T]` along T with kernel `kernel` (odd), stride 1, padding
  /// kernel/2 → `[H, T]`. avg: zero padding counted (PyTorch avg_pool1d's default: a float32 sum
  /// of the window's valid values from the left, divided by k); max: padding ignored.
  static std::vector<float> pool(const std::vector<float>& scores, int64_t heads, int64_t kernel, bool use_max);

 protected:
  SnapKVPolicy(const ParsedSpec& spec, Budget budget, int64_t window, int64_t kernel, bool use_max);
  void on_reset() override;
  void do_persist(PolicyStateIO& io) override;
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
  /// The last query rows of one layer: row-major `[H_kv, rows <= w, T]` (none until observed).
  struct Rows {
    int64_t heads = 0, rows = 0, keys = 0;
    std::vector<float> data;
    bool defined() const { return heads > 0; }
  };
  std::vector<Rows> rows_;  ///< per layer
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
  void do_persist(PolicyStateIO& io) override;
  int64_t prompt_keep(int64_t layer, int64_t prompt, int64_t uniform_keep) const override;

 private:
  double beta_;
  std::vector<int64_t> budgets_;  ///< fixed after the first layer's prefill end
  int64_t reserve_ = 0;           ///< decode tokens reserved when budgets_ was computed
};

/// `knorm[:stream]`: Knorm (Devoto et al., arXiv 2406.11430): score = −‖k‖₂ of the stored
/// (post-RoPE, dequantized) key, per KV head; low-norm keys are kept. Attention-free: reads keys
/// through ctx.view.
class KnormPolicy final : public ScheduledScorer {
 public:
  static const ParamTable& table();
  KnormPolicy(const ParsedSpec& spec, Budget budget);
  TokenScores score(const EvictionContext& ctx) const override;
};

/// `keydiff[:stream]`: KeyDiff (Park et al., arXiv 2504.15364): score = −cos(k, a) with the
/// anchor a = the mean of the head's L2-normalised resident keys; the most *different* keys
/// are kept. Attention-free: reads keys through ctx.view (two passes).
class KeyDiffPolicy final : public ScheduledScorer {
 public:
  static const ParamTable& table();
  KeyDiffPolicy(const ParsedSpec& spec, Budget budget);
  TokenScores score(const EvictionContext& ctx) const override;
};

/// `expected:n<F>:s<n>:e<ε>:cov|mean:vnorm|novnorm[:stream]`: Expected Attention (Devoto et
/// al., arXiv 2510.00636; kvpress ExpectedAttentionPress). Future queries of query head h are
/// modelled as a Gaussian N(μ_h, Σ_h) fitted on the pre-RoPE queries the layer has seen (every
/// query of the request at positions ≥ s), rotated by the mean RoPE rotation R̄ of the next F
/// positions: μ' = R̄μ, Σ' = R̄ΣR̄ᵀ. Score of a non-sink key k (post-RoPE, as stored) =
/// softmax over the head's non-sink keys of (μ'·k/√D + kᵀΣ'k/(2D)), mean over the group's
/// query heads, then (· + ε)·‖v‖₂. The first s resident tokens (sinks) are kept.
class ExpectedAttentionPolicy final : public ScheduledScorer {
 public:
  static const ParamTable& table();
  ExpectedAttentionPolicy(const ParsedSpec& spec, Budget budget);
  QueryNeed query_need() const override { return {QueryNeed::kAllRows, true}; }
  TokenScores score(const EvictionContext& ctx) const override;
  /// Query statistics of `layer`: the queries fitted so far (positions ≥ s).
  int64_t queries_seen(int64_t layer) const { return stats_.at(static_cast<size_t>(layer)).n; }
  /// Their pre-RoPE mean, `[H_q, D]` row-major (empty before the first query).
  std::vector<double> query_mean(int64_t layer) const;

 protected:
  void on_reset() override;
  void do_persist(PolicyStateIO& io) override;
  void do_observe_queries(int64_t layer, const QueryRows& rows, const LayerView& view) override;
  int64_t protected_prefix() const override { return sinks_; }

 private:
  struct Stats {
    int64_t n = 0;
    std::vector<double> sum;    ///< [H_q, D]
    std::vector<double> outer;  ///< [H_q, D, D] Σ q qᵀ (only with covariance)
  };
  int64_t future_, sinks_;
  double epsilon_;
  bool covariance_, vnorm_;
  std::vector<Stats> stats_;  ///< per layer
};

/// `kvzip:s<n>:c<N>@B`: KVzip (Kim et al., arXiv 2505.23416; methods.md b.13), query-agnostic.
/// After the context's prefill the runner replays it (ReplayNeed): "Repeat the previous context
/// exactly." followed by the context, in chunks of at most c tokens, as replay steps over the
/// cache. The score of a cached (KV head, token) pair = the MAX over every replay query row
/// and over the GQA group's query heads of its attention probability (the softmax over the
/// resident keys and the chunk's own keys). At kReplayEnd every layer keeps, per KV head, its
/// first s tokens (sinks) + the top-scored ones up to budget − (context_length − the layer's
/// logical length) (the decode reserve, as SnapKV); ties keep the more recent token. A step
/// other than a replay after the prompt's kPrefillEnd throws (the replay is missing).
class KVzipPolicy final : public ScorerPolicy {
 public:
  static const ParamTable& table();
  /// The instruction fed before every replay chunk.
  static const char* instruction();
  KVzipPolicy(const ParsedSpec& spec, Budget budget);
  int64_t layer_budget(int64_t layer) const override;
  /// Until the compression: every row, max over rows and group; none after it.
  ReplayNeed replay_need() const override;
  /// At kReplayEnd: the tokens the layer keeps; throws after a kPrefillEnd not followed by a
  /// replay.
  std::optional<int64_t> compression_target(const EvictionContext& ctx) const override;
  /// The max replay attention; the sinks +inf. @throws InvalidArgument without replay scores.
  TokenScores score(const EvictionContext& ctx) const override;
  bool scores_any_step() const override { return false; }
  void on_step_end(const EvictionContext& ctx) override;
  /// Replay scores of `layer` so far, per KV head (one per resident token; empty before the replay).
  const std::vector<std::vector<float>>& scores(int64_t layer) const { return scores_.at(static_cast<size_t>(layer)); }
  int64_t sinks() const { return sinks_; }
  int64_t chunk() const { return chunk_; }
  bool compressed() const { return done_; }

 protected:
  void on_reset() override;
  void do_persist(PolicyStateIO& io) override;
  void do_observe(int64_t layer, const AttentionMass& mass) override;

 private:
  int64_t sinks_, chunk_;
  bool awaiting_ = false;  ///< the prompt ended (kPrefillEnd on every layer); the replay has not
  bool done_ = false;      ///< compressed at kReplayEnd
  std::vector<std::vector<std::vector<float>>> scores_;  ///< per layer, per KV head
};

/// `adakv:a<α>:<scorer>`: AdaKV (Feng et al., arXiv 2407.11550; kvpress AdaKVPress) over any
/// scorer: when the scorer compresses a layer to n tokens per head, AdaKV keeps the same total
/// H_kv·n, distributed across the layer's KV heads: every head first keeps its ⌊α·n⌋
/// top-scored tokens (α = 0.2), then the rest go to the layer's globally top (head, token)
/// pairs. Heads end with different numbers of tokens and the cache frees the rest for real
/// (kvpress only masks). Global ties evict the older token first, then the lower head.
class AdaKVPolicy final : public ScorerPolicy {
 public:
  static const ParamTable& table();
  AdaKVPolicy(const ParsedSpec& spec, Budget budget, std::unique_ptr<EvictionPolicy> inner);
  int64_t layer_budget(int64_t layer) const override { return inner_->layer_budget(layer); }
  AttentionNeed attention_need() const override { return inner_->attention_need(); }
  QueryNeed query_need() const override { return inner_->query_need(); }
  ReplayNeed replay_need() const override { return inner_->replay_need(); }
  std::optional<int64_t> compression_target(const EvictionContext& ctx) const override {
    return inner_->compression_target(ctx);
  }
  TokenScores score(const EvictionContext& ctx) const override { return inner_->score(ctx); }
  bool scores_any_step() const override { return inner_->scores_any_step(); }
  bool head_wise() const override { return true; }
  bool decode_scheduled() const override { return inner_->decode_scheduled(); }
  bool over_target(const EvictionContext& ctx, int64_t target) const override;
  EvictionPlan select(const EvictionContext& ctx, int64_t target, TokenScores scores) const override;
  void on_evicted(int64_t layer, const EvictionPlan& plan) override { inner_->on_evicted(layer, plan); }
  void on_step_end(const EvictionContext& ctx) override { inner_->on_step_end(ctx); }
  double alpha() const { return alpha_; }

 protected:
  void on_reset() override;
  void do_persist(PolicyStateIO& io) override;
  void do_observe(int64_t layer, const AttentionMass& mass) override { inner_->observe(layer, mass); }
  void do_observe_queries(int64_t layer, const QueryRows& rows, const LayerView& view) override {
    inner_->observe_queries(layer, rows, view);
  }

 private:
  double alpha_;
  std::unique_ptr<ScorerPolicy> inner_;
};

/// `decode:i<N>:b<N>[:prefill]:<scorer>@<target>`: decode-time compression (kvpress
/// DecodingPress; with `prefill`, PrefillDecodingPress): every `i` decoded tokens of a layer,
/// compress it back to the target (the budget) with the wrapped scorer's scores and selection
/// (AdaKV when it wraps one), the newest `b` tokens always kept. With `prefill` it also
/// compresses to the target at the end of the prompt; without, the prompt stays whole until
/// the first compression. Between compressions a layer holds up to target + i − 1 tokens.
class DecodeCompressionPolicy final : public ScorerPolicy {
 public:
  static const ParamTable& table();
  DecodeCompressionPolicy(const ParsedSpec& spec, Budget budget, std::unique_ptr<EvictionPolicy> inner);
  int64_t layer_budget(int64_t layer) const override;
  AttentionNeed attention_need() const override { return inner_->attention_need(); }
  QueryNeed query_need() const override { return inner_->query_need(); }
  std::optional<int64_t> compression_target(const EvictionContext& ctx) const override;
  TokenScores score(const EvictionContext& ctx) const override;
  bool head_wise() const override { return inner_->head_wise(); }
  bool decode_scheduled() const override { return true; }
  bool over_target(const EvictionContext& ctx, int64_t target) const override {
    return inner_->over_target(ctx, target);
  }
  EvictionPlan select(const EvictionContext& ctx, int64_t target, TokenScores scores) const override {
    return inner_->select(ctx, target, std::move(scores));
  }
  void on_evicted(int64_t layer, const EvictionPlan& plan) override { inner_->on_evicted(layer, plan); }
  void on_step_end(const EvictionContext& ctx) override;
  int64_t interval() const { return interval_; }
  int64_t buffer() const { return buffer_; }

 protected:
  void on_reset() override;
  void do_persist(PolicyStateIO& io) override;
  void do_observe(int64_t layer, const AttentionMass& mass) override { inner_->observe(layer, mass); }
  void do_observe_queries(int64_t layer, const QueryRows& rows, const LayerView& view) override {
    inner_->observe_queries(layer, rows, view);
  }

 private:
  bool due(const EvictionContext& ctx) const;
  int64_t interval_, buffer_;
  bool prefill_;
  std::unique_ptr<ScorerPolicy> inner_;
  std::vector<int64_t> since_;  ///< per layer: decoded tokens since its last compression
};

/// `duo:s<n>:r<n>:f<x>:w<n>`: DuoAttention with on-the-fly head identification (Xiao et al.,
/// arXiv 2410.10819; kvpress DuoAttentionPress's on-the-fly mode, methods.md b.13). At the end
/// of the prompt every KV head of every layer is scored by how much restricting its attention to
/// sink + recent tokens changes its output on the prompt's last w queries: the mean over those
/// rows and the group's query heads of ‖o_full − o_stream‖₂ / ‖o_full‖₂. The lowest-scoring heads
/// (a fraction f of all L·H_kv heads, or as many as the budget needs) become streaming heads and
/// keep only their first s and last r tokens from then on; retrieval heads keep everything.
class DuoAttentionPolicy final : public EvictionPolicy {
 public:
  static const ParamTable& table();
  DuoAttentionPolicy(const ParsedSpec& spec, Budget budget);
  /// The budget (average tokens per KV head at the end of the request), or, with f, the
  /// context length.
  int64_t layer_budget(int64_t layer) const override;
  QueryNeed query_need() const override { return classified_ ? QueryNeed{} : QueryNeed{window_, false}; }
  EvictionPlan plan(const EvictionContext& ctx) const override;
  void on_step_end(const EvictionContext& ctx) override;
  /// Streaming heads over all layers (fixed at reset from f or the budget).
  int64_t streaming_heads() const { return streaming_count_; }
  /// After the prompt: whether KV head h of `layer` is a streaming head.
  bool is_streaming(int64_t layer, int64_t h) const;
  /// The deviation score of each KV head of `layer` from the last observed step.
  const std::vector<float>& head_scores(int64_t layer) const { return head_scores_.at(static_cast<size_t>(layer)); }
  /// Deviation of one KV head: `q` the rows, `view` the layer (the reference of the score).
  static float head_deviation(const QueryRows& q, const LayerView& view, int64_t h, int64_t sinks, int64_t recent);

 protected:
  void on_reset() override;
  void do_persist(PolicyStateIO& io) override;
  void do_observe_queries(int64_t layer, const QueryRows& rows, const LayerView& view) override;

 private:
  /// Streaming mask over all layers × heads from the stored scores (lowest first).
  std::vector<bool> classify() const;
  int64_t sinks_, recent_, window_;
  double fraction_;
  int64_t streaming_count_ = 0;
  bool classified_ = false;
  int64_t layers_done_ = 0;
  std::vector<std::vector<float>> head_scores_;  ///< per layer, per KV head
  std::vector<bool> streaming_;                  ///< [L · H_kv], after the prompt
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
