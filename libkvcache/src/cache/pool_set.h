// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file pool_set.h (internal)
/// PoolSet: the BlockPools of a cache, one per block size (bytes, rounded up to 8). A
/// CacheManager owns one; a MultiSequenceCache shares one between all its sequences and its
/// prefix index, so blocks can move between holders by reference count alone.

#include <cstdint>
#include <map>
#include <memory>

#include "cache/block_pool.h"

namespace kvcache::cache {

class PoolSet {
 public:
  /// The pool of `block_bytes`-byte blocks (rounded up to a multiple of 8), made on first use.
  BlockPool* get(int64_t block_bytes) {
    const int64_t key = (block_bytes + 7) / 8 * 8;
    auto& p = pools_[key];
    if (!p) p = std::make_unique<BlockPool>(key);
    return p.get();
  }
  /// Bytes of the blocks in use (reference count > 0) over every pool.
  int64_t bytes_in_use() const {
    int64_t n = 0;
    for (const auto& [bytes, p] : pools_) n += p->blocks_in_use() * p->block_bytes();
    return n;
  }
  /// Blocks in use over every pool.
  int64_t blocks_in_use() const {
    int64_t n = 0;
    for (const auto& [bytes, p] : pools_) n += p->blocks_in_use();
    return n;
  }
  /// Bytes of every slab held from the allocator.
  int64_t slab_bytes() const {
    int64_t n = 0;
    for (const auto& [bytes, p] : pools_) n += p->slab_bytes();
    return n;
  }
  /// Frees every block of every pool and returns the slabs (ids become invalid).
  void clear() {
    for (auto& [bytes, p] : pools_) p->clear();
  }
  const std::map<int64_t, std::unique_ptr<BlockPool>>& pools() const { return pools_; }

 private:
  std::map<int64_t, std::unique_ptr<BlockPool>> pools_;
};

}  // namespace kvcache::cache
