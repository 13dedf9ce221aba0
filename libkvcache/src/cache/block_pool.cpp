// SPDX-License-Identifier: Apache-2.0
#include "cache/block_pool.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <new>

#include "kvcache/error.h"

namespace kvcache::cache {
namespace {
constexpr int64_t kSlabTarget = 256 * 1024;
constexpr int64_t kAlign = 64;
}  // namespace

void BlockPool::FreeDeleter::operator()(uint8_t* p) const { std::free(p); }

BlockPool::BlockPool(int64_t block_bytes) {
  KV_INTERNAL_ASSERT(block_bytes >= 1 && block_bytes <= (int64_t{1} << 40), "BlockPool block_bytes ", block_bytes);
  block_bytes_ = (block_bytes + 7) / 8 * 8;
  blocks_per_slab_ = std::max<int64_t>(1, kSlabTarget / block_bytes_);
}

BlockId BlockPool::allocate() {
  if (free_.empty()) {
    KV_CHECK(refs_.size() + static_cast<size_t>(blocks_per_slab_) <
                 static_cast<size_t>(std::numeric_limits<BlockId>::max()),
             CapacityError, "BlockPool: more than 2^31 blocks of ", block_bytes_, " B");
    // + kAlign: slack after the last block, so that vector loads and gathers of the read paths
    // may read a few bytes past a block's last region without leaving the allocation.
    const int64_t bytes = (blocks_per_slab_ * block_bytes_ + 2 * kAlign - 1) / kAlign * kAlign;
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(kAlign, static_cast<size_t>(bytes)));
    if (p == nullptr) throw std::bad_alloc();
    slabs_.emplace_back(p);
    const auto first = static_cast<BlockId>(refs_.size());
    refs_.resize(refs_.size() + static_cast<size_t>(blocks_per_slab_), 0);
    // Hand out the slab's blocks in address order (LIFO free list: push them reversed).
    for (BlockId i = static_cast<BlockId>(blocks_per_slab_) - 1; i >= 0; --i) free_.push_back(first + i);
  }
  const BlockId id = free_.back();
  free_.pop_back();
  refs_[static_cast<size_t>(id)] = 1;
  ++in_use_;
  return id;
}

void BlockPool::retain(BlockId id) {
  KV_INTERNAL_ASSERT(id >= 0 && static_cast<size_t>(id) < refs_.size() && refs_[static_cast<size_t>(id)] > 0,
                     "retain of a free block ", id);
  ++refs_[static_cast<size_t>(id)];
}

void BlockPool::release(BlockId id) {
  KV_INTERNAL_ASSERT(id >= 0 && static_cast<size_t>(id) < refs_.size() && refs_[static_cast<size_t>(id)] > 0,
                     "release of a free block ", id);
  if (--refs_[static_cast<size_t>(id)] == 0) {
    free_.push_back(id);
    --in_use_;
  }
}

int32_t BlockPool::refcount(BlockId id) const {
  KV_INTERNAL_ASSERT(id >= 0 && static_cast<size_t>(id) < refs_.size(), "refcount of block ", id);
  return refs_[static_cast<size_t>(id)];
}

uint8_t* BlockPool::data(BlockId id) {
  const int64_t slab = id / blocks_per_slab_;
  return slabs_[static_cast<size_t>(slab)].get() + (id - slab * blocks_per_slab_) * block_bytes_;
}

const uint8_t* BlockPool::data(BlockId id) const { return const_cast<BlockPool*>(this)->data(id); }

int64_t BlockPool::slab_bytes() const {
  return static_cast<int64_t>(slabs_.size()) * blocks_per_slab_ * block_bytes_;
}

void BlockPool::clear() {
  slabs_.clear();
  refs_.clear();
  free_.clear();
  in_use_ = 0;
}

}  // namespace kvcache::cache
