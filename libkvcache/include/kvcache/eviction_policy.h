// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file eviction_policy.h
/// EvictionPolicy: decides which cached tokens to keep under a token budget. Policies
/// only PLAN (indices to keep per KV head); the CacheManager moves the data and then tells
/// the policy what it kept (`on_compacted`) so stateful policies (accumulated scores) follow.
///
/// Conventions shared by every policy (docs/cache-manager.md, docs/policies.md):
///   - Indices refer to the resident tokens of one layer in cache order (oldest first), i.e.
///     the columns of `CacheManager::get(layer)`; every KV head keeps the same number of
///     tokens (heads may keep different ones).
///   - The newest resident token (the last token written in the current step) is never
///     evicted. Protected tokens (sinks, recent window) survive score ties.
///   - Ties between equal scores are broken in favour of the MORE RECENT token.
///   - The budget is `@N` tokens or `@P%` of the request's full context (prompt + max new
///     tokens, given to reset()); a resolved budget is never 0 (CapacityError). A budget at
///     least as large as the resident length evicts nothing.
///   - Attention probabilities `[B, H_q, T_q, T_res]` are reduced to KV heads by the MEAN over
///     the G = H_q / H_kv query heads of each group (query head h → KV head h / G) and by the
///     SUM over batch rows (the batch shares one cache layout).

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/spec.h"

namespace kvcache {

/// The cache geometry a policy plans for (set by reset()).
struct CacheShape {
  int64_t num_layers = 1;
  int64_t num_q_heads = 1;   ///< H_q (multiple of H_kv)
  int64_t num_kv_heads = 1;  ///< H_kv
};

/// What a policy sees when asked for a plan for one layer at the end of a step.
struct EvictionContext {
  int64_t layer = 0;
  int64_t resident = 0;        ///< T_res: tokens resident per KV head before eviction
  int64_t new_tokens = 0;      ///< tokens appended in this step (the last `new_tokens` of T_res)
  int64_t logical_length = 0;  ///< tokens ever written to this layer (incl. this step)
  bool is_prefill_end = false; ///< this step is the last chunk of the prompt
  /// `[H_kv, T_res]` int64 positions of the resident tokens (may be undefined in unit tests).
  at::Tensor positions;
};

/// Result of EvictionPolicy::plan_keep.
struct KeepPlan {
  /// `[H_kv, T_keep]` int64, strictly increasing per row, every row keeps the same count and
  /// includes index T_res − 1. Undefined: keep everything (no eviction this step).
  at::Tensor keep;
  bool keeps_all() const { return !keep.defined(); }
};

/// Base class of eviction policies. Not thread-safe; one instance per CacheManager.
class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;

  /// Canonical spec incl. budget suffix, e.g. "sink:s4@50%"; make_eviction_policy(spec())
  /// builds an equivalent policy.
  virtual std::string spec() const = 0;

  /// Resolved token budget per KV head for the current request (after reset()); for `full`
  /// (or no budget) the request's context length. Layer-aware policies: the budget of
  /// layer 0; see layer_budget().
  int64_t token_budget() const { return layer_budget(0); }
  /// Budget of `layer` (uniform policies: the same for every layer).
  virtual int64_t layer_budget(int64_t layer) const;

  /// True if plan_keep needs attention probabilities passed to observe().
  virtual bool needs_attention() const { return false; }

  /// Attention probabilities of the current step's queries over the resident keys of
  /// `layer`: `[B, H_q, T_q, T_res]` float32 (T_res = resident tokens incl. this step's).
  /// @throws InvalidArgument on wrong rank/dtype or a head count that is not a multiple.
  void observe(int64_t layer, const at::Tensor& probs);

  /// Indices to keep for `ctx.layer`. @throws CapacityError if the protected tokens do not
  /// fit the budget.
  virtual KeepPlan plan_keep(const EvictionContext& ctx) = 0;

  /// Called by the CacheManager after it compacted `layer` to `keep` (a plan from plan_keep).
  virtual void on_compacted(int64_t layer, const at::Tensor& keep) { (void)layer; (void)keep; }

  /// Starts a new request: `context_length` = prompt + max new tokens (resolves "@P%"; 0 =
  /// unknown, then a fractional budget fails at the first plan); clears all per-layer state.
  /// @throws CapacityError if the budget resolves below 1 token or below the policy's
  ///         protected tokens (message names the numbers); InvalidArgument on a bad shape.
  void reset(int64_t context_length, const CacheShape& shape);

  /// The parsed budget (kind kNone when the spec had no '@').
  const Budget& budget() const { return budget_; }
  int64_t context_length() const { return context_length_; }
  const CacheShape& shape() const { return shape_; }

 protected:
  explicit EvictionPolicy(Budget budget) : budget_(budget) {}
  /// Per-request hook after the budget is resolved (validate protected sizes, clear state).
  virtual void on_reset() {}
  virtual void do_observe(int64_t layer, const at::Tensor& probs) { (void)layer; (void)probs; }
  /// Resolved budget per KV head; for a spec without '@': the context length (0 if unknown).
  /// @throws InvalidArgument if the budget is fractional and the context length is unknown.
  int64_t resolved_budget() const;

 private:
  Budget budget_;
  int64_t context_length_ = 0;
  CacheShape shape_;
  int64_t resolved_budget_ = 0;
};

/// Builds a policy from `head(:field)*[@budget]`, e.g. "full", "window:w256", "sink:s4@50%",
/// "h2o:r64@256", "random:seed7@50%", "snapkv:w32:k5@50%", "tova@512", "pyramid@50%"
/// (docs/policies.md lists fields and rules).
/// @throws InvalidArgument for unknown heads (listing the registered ones), bad fields or a
///         missing budget; CapacityError when an absolute budget cannot hold the protected
///         tokens (e.g. sinks + window).
std::unique_ptr<EvictionPolicy> make_eviction_policy(const std::string& spec);

/// Parameter tables of every registered policy, in registration order (for --list).
std::vector<ParamTable> registered_policies();

namespace evict {
/// Reduces probabilities `[B, H_q, T_q, T]` to `[H_kv, T_q, T]` float32: sum over B, mean
/// over the query heads of each KV-head group. @throws InvalidArgument on bad shapes.
at::Tensor reduce_to_kv_heads(const at::Tensor& probs, int64_t num_kv_heads);

/// Indices of the `k` largest entries of `scores` `[T]` (float32) among `candidates`
/// (sorted ascending), ties broken towards the larger index (more recent token).
/// Returns them sorted ascending.
std::vector<int64_t> top_k_recent_ties(const float* scores, const std::vector<int64_t>& candidates,
                                       int64_t k);
}  // namespace evict

}  // namespace kvcache
