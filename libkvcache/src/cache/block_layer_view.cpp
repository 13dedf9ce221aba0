// SPDX-License-Identifier: Apache-2.0
// The CacheManager's read-only view for eviction policies (block_layer_view.h; its twin over
// plain arrays, TensorLayerView, is in src/evict/eviction_inputs.cpp).
#include "cache/block_layer_view.h"

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "kvcache/error.h"

namespace kvcache {
namespace cache {
namespace {

/// Reads one stream's live tokens in order, decoding each block once.
class StreamReader {
 public:
  StreamReader(const HeadStream& s, float tensor_scale, const common::RopeTable* rope, int64_t d, bool decode)
      : scale_(tensor_scale), rope_(rope), d_(d), decode_(decode), walk_(s) {}

  /// Copies the next min(n, left) live tokens: rows to `rows` `[n, D]` (when decoding) and
  /// positions to `pos`. Returns the count.
  int64_t read(int64_t n, float* rows, int64_t* pos) {
    int64_t got = 0;
    while (got < n) {
      if (block_ == nullptr || slot_ >= block_->filled) {
        if (!next_block()) break;
      }
      const int32_t sl = slot_++;
      if (!block_->alive(sl)) continue;
      pos[got] = block_->position(sl);
      if (decode_) {
        float* out = rows + got * d_;
        std::copy_n(scratch_.data() + static_cast<int64_t>(sl) * d_, d_, out);
        if (rope_ != nullptr) rope_->rotate(out, pos[got]);
      }
      ++got;
    }
    return got;
  }

 private:
  bool next_block() {
    const BlockList* list = nullptr;
    if (!walk_.next(&list, &block_)) return false;
    slot_ = 0;
    if (decode_) {
      scratch_.resize(static_cast<size_t>(list->format(*block_).capacity * d_));
      list->decode(*block_, scratch_.data(), scale_);
    }
    return true;
  }

  float scale_;
  const common::RopeTable* rope_;
  int64_t d_;
  bool decode_;
  StreamBlockWalk walk_;
  const Block* block_ = nullptr;
  int32_t slot_ = 0;
  std::vector<float> scratch_;
};

}  // namespace

int64_t BlockLayerView::resident(int64_t h) const {
  KV_CHECK_ARG(h >= 0 && h < num_kv_heads(), "LayerView: KV head ", h, " out of range [0, ", num_kv_heads(), ")");
  return store_->resident(h);
}

void BlockLayerView::visit(int64_t h, ViewStreams streams, const std::function<void(const TokenRun&)>& fn) const {
  const int64_t t = resident(h);
  const int64_t d = store_->head_dim();
  const bool want_k = (static_cast<uint8_t>(streams) & 1u) != 0;
  const bool want_v = (static_cast<uint8_t>(streams) & 2u) != 0;
  // Positions come with the K stream (both streams hold the same tokens in the same order).
  StreamReader kr(store_->k(h), store_->k_scale(), key_rope_, d, want_k);
  StreamReader vr(store_->v(h), store_->v_scale(), nullptr, d, want_v);
  std::vector<float> krows(want_k ? static_cast<size_t>(kRunTokens * d) : 0);
  std::vector<float> vrows(want_v ? static_cast<size_t>(kRunTokens * d) : 0);
  std::vector<int64_t> pos(static_cast<size_t>(kRunTokens)), vpos(static_cast<size_t>(kRunTokens));
  for (int64_t first = 0; first < t;) {
    const int64_t n = kr.read(std::min(kRunTokens, t - first), krows.data(), pos.data());
    KV_INTERNAL_ASSERT(n > 0, "LayerView: K stream of head ", h, " ended at ", first, " of ", t);
    if (want_v) {
      const int64_t nv = vr.read(n, vrows.data(), vpos.data());
      KV_INTERNAL_ASSERT(nv == n, "LayerView: V stream of head ", h, " shorter than K at ", first);
    }
    TokenRun run;
    run.first = first;
    run.n = n;
    run.keys = want_k ? krows.data() : nullptr;
    run.values = want_v ? vrows.data() : nullptr;
    run.positions = pos.data();
    fn(run);
    first += n;
  }
}

void BlockLayerView::mean_rotation(int64_t first, int64_t n, float* cos_out, float* sin_out) const {
  KV_CHECK(rope_ != nullptr && rope_->enabled(), UnsupportedError,
           "LayerView::mean_rotation: this cache holds no RoPE table (the policy did not ask for pre-RoPE queries)");
  KV_CHECK_ARG(first >= 0 && n >= 1, "LayerView::mean_rotation: positions [", first, ", ", first, " + ", n,
               ") (expected first >= 0, n >= 1)");
  rope_->mean_cos_sin(first, n, cos_out, sin_out);
}

}  // namespace cache
}  // namespace kvcache
