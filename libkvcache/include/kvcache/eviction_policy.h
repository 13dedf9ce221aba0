// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file eviction_policy.h
/// EvictionPolicy: decides which cached tokens to evict under a token budget. Policies only
/// PLAN (indices to evict per KV head); the CacheManager frees the storage and then tells the
/// policy what it evicted (`on_evicted`) so stateful policies (accumulated scores) follow.
///
/// Conventions shared by every policy (docs/cache-manager.md, docs/policies.md):
///   - Indices refer to the resident tokens of one KV head of one layer in cache order
///     (oldest first). Heads may hold different numbers of tokens (ragged) and plan
///     independently; the uniform policies below keep the same count in every head.
///   - A plan lists the tokens to EVICT per head (what a paged cache frees), so planning a
///     decode step is O(evicted) for positional policies.
///   - The newest resident token (the last token written in the current step) is never
///     evicted. Protected tokens (sinks, recent window) survive score ties.
///   - Ties between equal scores are broken in favour of the MORE RECENT token.
///   - The budget is `@N` tokens or `@P%` of the request's full context (prompt + max new
///     tokens, given to reset()); a resolved budget is never 0 (CapacityError). A budget at
///     least as large as the resident length evicts nothing.
///   - Attention reaches a policy as AttentionMass (kvcache/eviction_inputs.h): per KV head, the
///     MEAN over the G = H_q / H_kv query heads of each group (query head h → KV head h / G)
///     and the SUM over batch rows, for the query rows its attention_need() selects — or, in
///     the replay steps of a policy whose replay_need() asks for one (KVzip), the MAX over the
///     group and the replay's query rows (AttentionNeed::Reduce::kMax).
///   - Keys and values reach a policy through EvictionContext::view (a LayerView, same header), a
///     read-only view that decodes the stored blocks on demand; query rows through
///     query_need() / observe_queries(). Policies never change K/V.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/eviction_inputs.h"
#include "kvcache/spec.h"
#include "kvcache/types.h"

namespace kvcache {

class PolicyStateIO;  // kvcache/snapshot.h

/// The cache geometry a policy plans for (set by reset()).
struct CacheShape {
  int64_t num_layers = 1;
  int64_t num_q_heads = 1;   ///< H_q (multiple of H_kv)
  int64_t num_kv_heads = 1;  ///< H_kv
};

/// What a policy sees when asked for a plan for one layer at the end of a step.
struct EvictionContext {
  int64_t layer = 0;
  StepKind step = StepKind::kDecode;
  /// Tokens resident per KV head before eviction (incl. this step's).
  std::vector<int64_t> resident;
  int64_t new_tokens = 0;      ///< tokens appended in this step (the last `new_tokens` of each head)
  int64_t logical_length = 0;  ///< tokens ever written to this layer (incl. this step)
  /// The layer's resident keys and values (decoded on demand), or null when the caller has no
  /// cache behind the plan (tests driving a policy directly). Policies that read K/V throw
  /// InvalidArgument without one.
  const LayerView* view = nullptr;

  bool is_prefill_end() const { return step == StepKind::kPrefillEnd; }
  int64_t num_kv_heads() const { return static_cast<int64_t>(resident.size()); }
};

/// Result of EvictionPolicy::plan(): per KV head, the resident indices to evict, strictly
/// increasing, never the head's newest token. Empty `evict` (or empty rows) = keep all.
struct EvictionPlan {
  std::vector<std::vector<int64_t>> evict;

  bool empty() const;
  /// Tokens evicted from head h.
  int64_t count(int64_t h) const;
};

/// Base class of eviction policies. Not thread-safe; one instance per CacheManager (driven by the
/// thread driving that manager; separate managers' policies share nothing: cache_manager.h).
class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;

  /// Canonical spec incl. budget suffix, e.g. "sink:s4@50%" (the rule of spec.h applied to the
  /// fields the policy was built from, then Budget::to_string()); make_eviction_policy(spec())
  /// builds an equivalent policy.
  std::string spec() const { return fields_ + budget_.to_string(); }

  /// Resolved token budget per KV head for the current request (after reset()); for `full`
  /// (or no budget) the request's context length. Layer-aware policies: the budget of
  /// layer 0; see layer_budget().
  int64_t token_budget() const { return layer_budget(0); }
  /// Budget of `layer` (uniform policies: the same for every layer).
  virtual int64_t layer_budget(int64_t layer) const;

  /// The attention statistics plan() will need after this step (query it every step:
  /// SnapKV stops needing attention after the prompt). Default: none.
  virtual AttentionNeed attention_need() const { return {}; }
  /// Shorthand for attention_need().any().
  bool needs_attention() const { return attention_need().any(); }

  /// Whether the policy needs a context replay after the context's prefill (KVzip): the runner
  /// asks after the prefill's kPrefillEnd step (Runner::generate: the prompt's end in
  /// query-aware mode, GenerationOptions::question_start in query-agnostic mode) and, when
  /// any(), runs the replay steps (CacheManager::begin_replay(), end_step(kReplay /
  /// kReplayEnd)); in those steps the policy observes ReplayNeed::attention instead of
  /// attention_need(), and plans at kReplayEnd only. Default: none.
  virtual ReplayNeed replay_need() const { return {}; }

  /// The step's attention over the resident keys of `layer`, as attention_need() selected.
  /// @throws InvalidArgument on a layer out of range, a head count other than H_kv, or
  ///         non-finite mass.
  void observe(int64_t layer, const AttentionMass& mass);
  /// Convenience for engines and tests that hold probabilities `[B, H_q, T_q, T_res]` float32
  /// (a view; an at::Tensor converts with kvcache/torch/tensor_view.h):
  /// observe(layer, reduce_attention(probs, H_kv, attention_need())).
  void observe(int64_t layer, const TensorView& probs);

  /// The query rows plan() will need after this step (Expected Attention's statistics,
  /// DuoAttention's head scores). Default: none. Query it every step, like attention_need().
  virtual QueryNeed query_need() const { return {}; }
  /// The step's query rows of `layer` as query_need() selected, with the layer's view (which
  /// already holds the step's tokens).
  /// @throws InvalidArgument on a layer out of range, a query head count other than H_q,
  ///         sizes that do not fit, or non-finite values.
  void observe_queries(int64_t layer, const QueryRows& rows, const LayerView& view);

  /// Tokens to evict from `ctx.layer` now. const: planning changes nothing, so that when the
  /// plan of a later layer throws, CacheManager::end_step() leaves the cache and the policy as
  /// they were; what advances with a step advances in on_evicted() / on_step_end().
  /// @throws CapacityError if the protected tokens do not fit the budget; InvalidArgument if
  ///         the attention it needs was not observed.
  virtual EvictionPlan plan(const EvictionContext& ctx) const = 0;

  /// Called by the CacheManager after it evicted `plan` (from plan()) from `layer`, so that
  /// stateful policies (accumulated scores) follow the surviving tokens.
  virtual void on_evicted(int64_t layer, const EvictionPlan& plan) { (void)layer; (void)plan; }

  /// Called by the CacheManager for every layer once end_step() has planned all layers without
  /// an error (after on_evicted() for a non-empty plan), with the context plan() saw: where a
  /// policy advances per-step state (SnapKV's one compression at the end of the prompt).
  virtual void on_step_end(const EvictionContext& ctx) { (void)ctx; }

  /// Starts a new request: `context_length` = prompt + max new tokens (resolves "@P%"; 0 =
  /// unknown, then a fractional budget fails at the first plan); clears all per-layer state.
  /// @throws CapacityError if the budget resolves below 1 token or below the policy's
  ///         protected tokens (message names the numbers); InvalidArgument on a bad shape or
  ///         a context_length outside [0, kMaxTokens] (spec.h).
  void reset(int64_t context_length, const CacheShape& shape);

  /// Writes (io.reading() false) or reads the state the policy has advanced since reset() —
  /// accumulated scores, per-layer step counters, classifications — so that a snapshot
  /// (kvcache/snapshot.h) continues exactly. Reading follows reset() with the saved
  /// context_length and shape (which restore what reset() derives) and replaces that state.
  /// @throws SnapshotError (kInconsistent) when reading bytes that do not fit the shape.
  void persist(PolicyStateIO& io) { do_persist(io); }

  /// The parsed budget (kind kNone when the spec had no '@').
  const Budget& budget() const { return budget_; }
  int64_t context_length() const { return context_length_; }
  const CacheShape& shape() const { return shape_; }

 protected:
  /// `spec`: the fields the policy was built from (its canonical form is spec()'s).
  EvictionPolicy(const ParsedSpec& spec, Budget budget) : fields_(spec.canonical()), budget_(budget) {}
  /// A wrapper policy (adakv, decode): `spec` its own fields, `inner` the policy it wraps
  /// (built with the same budget); spec() is `own:inner@budget`.
  EvictionPolicy(const ParsedSpec& spec, Budget budget, const EvictionPolicy& inner)
      : fields_(spec.canonical() + ":" + inner.fields_), budget_(budget) {}
  /// A policy whose canonical form is not `head(:field)*` (perlayer(...)): spec() prints
  /// `canonical` + the budget.
  EvictionPolicy(std::string canonical, Budget budget) : fields_(std::move(canonical)), budget_(budget) {}
  /// Per-request hook after the budget is resolved (validate protected sizes, clear state).
  virtual void on_reset() {}
  virtual void do_observe(int64_t layer, const AttentionMass& mass) { (void)layer; (void)mass; }
  virtual void do_observe_queries(int64_t layer, const QueryRows& rows, const LayerView& view) {
    (void)layer;
    (void)rows;
    (void)view;
  }
  /// The state persist() carries; default: none (positional policies derive all theirs in
  /// on_reset()). A policy that keeps state across steps overrides it.
  virtual void do_persist(PolicyStateIO& io) { (void)io; }
  /// Resolved budget per KV head; for a spec without '@': the context length (0 if unknown).
  /// @throws InvalidArgument if the budget is fractional and the context length is unknown.
  int64_t resolved_budget() const;

 private:
  std::string fields_;  ///< canonical head and fields, without the budget
  Budget budget_;
  int64_t context_length_ = 0;
  CacheShape shape_;
  int64_t resolved_budget_ = 0;
};

/// Builds a policy from `head(:field)*[@budget]`, e.g. "full", "window:w256", "sink:s4@50%",
/// "h2o:r64@256", "random:seed7@50%", "snapkv:w32:k5@50%", "tova@512", "pyramid@50%",
/// "knorm@50%", "keydiff:stream@50%", "expected@50%", "duo:s16:r48@50%". A wrapper takes the
/// policy it wraps as the rest of its spec, after its own fields: `head(:field)*:inner[@budget]`,
/// e.g. "adakv:snapkv@50%", "adakv:a0.1:expected@50%", "decode:i512:b256:knorm@2048",
/// "decode:i64:adakv:expected@50%"; the budget, once at the end, applies to both
/// (docs/policies.md lists fields and rules). Per-layer budgets:
/// `perlayer(<policy>@<budget>*<n>;...)`, e.g. "perlayer(snapkv@25%*2;snapkv@75%*2)" (the runs are
/// one policy with their own budgets, or full; the counts must sum to the cache's layers, which
/// reset() checks).
/// @throws InvalidArgument for unknown heads (listing the registered ones), bad fields or a
///         missing budget, a wrapper without an inner policy or around one it cannot use (the
///         message names the whole spec); CapacityError when an absolute budget cannot hold
///         the protected tokens (e.g. sinks + window).
std::unique_ptr<EvictionPolicy> make_eviction_policy(const std::string& spec);

/// Parameter tables of every registered policy, in registration order (for --list).
std::vector<ParamTable> registered_policies();

namespace evict {
/// The `k` lowest of `scores[0..n)` — the tokens a score-based policy evicts — sorted
/// ascending; ties evict the OLDER token first (so the top n − k keep the more recent one).
/// O(n) (one selection, no sort of the survivors).
std::vector<int64_t> lowest_k(const float* scores, int64_t n, int64_t k);
}  // namespace evict

}  // namespace kvcache
