// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file block_layer_view.h (internal)
/// BlockLayerView: the CacheManager's LayerView (kvcache/layer_view.h) over one LayerStore.
/// A visit walks the head's K and V block lists (quantized blocks, then residual blocks),
/// decodes each block once into a one-block float32 scratch through the format's own decode
/// kernel (BlockList::decode, the same bytes attend() reads), rotates pre-RoPE keys by their
/// positions, and hands out the live rows in runs of at most kRunTokens tokens. Memory: two
/// decoded blocks and two runs per visit, never a head's whole K or V.

#include <cstdint>

#include "cache/layer_store.h"
#include "common/rope_table.h"
#include "kvcache/layer_view.h"

namespace kvcache::cache {

class BlockLayerView final : public LayerView {
 public:
  /// Tokens per TokenRun (runs may cross block boundaries).
  static constexpr int64_t kRunTokens = 64;

  /// @param store        the layer (outlives the view)
  /// @param key_rope     non-null: keys are stored pre-RoPE and rotated by this table on read
  /// @param rope         table for mean_rotation(), or null (then it throws UnsupportedError)
  /// @param next_position the layer's next position
  BlockLayerView(const LayerStore* store, const common::RopeTable* key_rope, const common::RopeTable* rope, int64_t next_position)
      : store_(store), key_rope_(key_rope), rope_(rope), next_(next_position) {}

  int64_t num_kv_heads() const override { return store_->num_heads(); }
  int64_t head_dim() const override { return store_->head_dim(); }
  int64_t resident(int64_t h) const override;
  int64_t next_position() const override { return next_; }
  void visit(int64_t h, ViewStreams streams, const std::function<void(const TokenRun&)>& fn) const override;
  void mean_rotation(int64_t first, int64_t n, float* cos_out, float* sin_out) const override;

 private:
  const LayerStore* store_;
  const common::RopeTable* key_rope_;
  const common::RopeTable* rope_;
  int64_t next_;
};

}  // namespace kvcache::cache
