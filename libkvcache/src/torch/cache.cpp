// SPDX-License-Identifier: Apache-2.0
// TorchCache (kvcache/torch/cache.h): a core SequenceCache through at::Tensors.
#include "kvcache/torch/cache.h"

#include "kvcache/cache_debug.h"
#include "kvcache/external_attention.h"

namespace kvcache {

TorchCache::TorchCache(CacheConfig config)
    : owned_(std::make_unique<CacheManager>(std::move(config))), cache_(owned_.get()) {}
TorchCache::TorchCache(CacheManager& cache) : cache_(&cache) {}
TorchCache::TorchCache(Sequence& seq) : cache_(&seq), seq_(&seq) {}
TorchCache::TorchCache(SequenceCache& cache) : cache_(&cache) {}
TorchCache::TorchCache(TorchCache&&) noexcept = default;
TorchCache& TorchCache::operator=(TorchCache&&) noexcept = default;
TorchCache::~TorchCache() = default;

const CacheConfig& TorchCache::config() const { return cache_->config(); }
void TorchCache::reset(int64_t context_length) { cache_->reset(context_length); }

PrefixReuse TorchCache::begin_request(const std::vector<int64_t>& prompt, int64_t context_length) {
  if (seq_ != nullptr) return seq_->begin_request(prompt, context_length);
  cache_->reset(context_length);
  return {};
}

int64_t TorchCache::next_position(int64_t layer) const { return cache_->next_position(layer); }

void TorchCache::append(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  cache_->append(layer, view_of(k), view_of(v), view_of(positions));
}

at::Tensor TorchCache::attend(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions) {
  const CacheConfig& c = cache_->config();
  // q is checked by the core (naming it); the output only needs its length when it has one.
  const int64_t tq = q.defined() && q.dim() == 4 ? q.size(2) : 0;
  at::Tensor out = at::empty({1, c.num_q_heads, tq, c.head_dim}, at::kFloat);
  cache_->attend(layer, view_of(q), view_of(q_positions), mutable_view_of(out));
  return out;
}

void TorchCache::end_step(StepKind step) { cache_->end_step(step); }

void TorchCache::finish() {
  if (seq_ != nullptr) seq_->finish();
}

ReplayNeed TorchCache::replay_need() const { return cache_->policy().replay_need(); }
void TorchCache::begin_replay() { cache_->begin_replay(); }
const EvictionPolicy& TorchCache::policy() const { return cache_->policy(); }

void TorchCache::observe_attention(int64_t layer, const at::Tensor& probs) {
  ExternalAttention(*cache_).observe_attention(layer, view_of(probs));
}

void TorchCache::observe_queries(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions) {
  ExternalAttention(*cache_).observe_queries(layer, view_of(q), view_of(q_positions));
}

LayerTokens TorchCache::tokens(int64_t layer) const { return cache_->tokens(layer); }
CacheStats TorchCache::stats() const { return cache_->stats(); }

TensorLayerKV TorchCache::get(int64_t layer) const {
  const LayerKV kv = CacheDebug::get(*cache_, layer);
  return TensorLayerKV{to_tensor(kv.k), to_tensor(kv.v), to_tensor(kv.positions)};
}

void TorchCache::check_invariants() const { CacheDebug::check_invariants(*cache_); }

}  // namespace kvcache
