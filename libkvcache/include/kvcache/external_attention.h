// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file external_attention.h
/// ExternalAttention: for an engine that computes attention with its own kernel instead of
/// SequenceCache::attend(), the one adapter through which it hands the eviction policy what
/// attend() would have handed it: the step's attention probabilities (policy().needs_attention():
/// h2o, tova, snapkv, pyramid, adakv) and its query rows (policy().query_need().any(): expected,
/// duo). It holds a reference to the cache and owns nothing.

#include <cstdint>

#include "kvcache/sequence_cache.h"
#include "kvcache/view.h"

namespace kvcache {

class ExternalAttention {
 public:
  /// `cache` must outlive the adapter.
  explicit ExternalAttention(SequenceCache& cache) : cache_(&cache) {}

  /// Hands the policy the step's probabilities `probs` float32 `[1, H_q, T_q, T_res]` over
  /// `layer`'s resident keys (every KV head must hold T_res tokens). Needed only when
  /// policy().needs_attention(). All-or-nothing, and checked whether or not the policy needs
  /// attention.
  /// @throws InvalidArgument on a shape that does not match, a value that is not a
  ///         probability (NaN, Inf, < 0, > 1) or a row whose mass exceeds 1 (naming the
  ///         index), a second observation of the layer in one step, or a replay step.
  void observe_attention(int64_t layer, const TensorView& probs);

  /// Hands the policy the step's post-RoPE queries `q` `[1, H_q, T_q, D]` at int64
  /// `q_positions` `[T_q]` (what attend() would have received). Needed only when
  /// policy().query_need().any(); a no-op otherwise (after the checks).
  /// @throws InvalidArgument on a wrong shape/dtype, NaN/Inf, a query position outside the
  ///         RoPE table (pre-RoPE rows), a second observation of the layer's queries in one
  ///         step, or a replay step.
  void observe_queries(int64_t layer, const TensorView& q, const TensorView& q_positions);

 private:
  SequenceCache* cache_;
};

}  // namespace kvcache
