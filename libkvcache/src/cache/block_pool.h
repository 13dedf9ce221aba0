// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file block_pool.h (internal)
/// BlockPool: fixed-size blocks of raw memory with a free list and reference counts — the
/// unit the cache frees now and shares next (prefix caching). Blocks are carved from slabs
/// of about 256 KiB (at least one block), 64-byte aligned with 64 bytes of slack after the
/// last block (readers' vector loads may run a little past a block), allocated on demand; a freed
/// block goes to a LIFO free list and is handed out again before a new slab is touched.
/// Memory is returned to the allocator only by clear() / destruction. Not thread-safe.

#include <cstdint>
#include <memory>
#include <vector>

namespace kvcache::cache {

using BlockId = int32_t;

class BlockPool {
 public:
  /// @param block_bytes bytes of every block (≥ 1; rounded up to a multiple of 8).
  explicit BlockPool(int64_t block_bytes);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  /// A block with reference count 1 (contents undefined).
  BlockId allocate();
  /// Reference count + 1 (a second owner shares the block read-only).
  void retain(BlockId id);
  /// Reference count − 1; at 0 the block returns to the free list.
  void release(BlockId id);
  int32_t refcount(BlockId id) const;

  uint8_t* data(BlockId id);
  const uint8_t* data(BlockId id) const;

  int64_t block_bytes() const { return block_bytes_; }
  /// Blocks with a reference count > 0.
  int64_t blocks_in_use() const { return in_use_; }
  /// Blocks carved from slabs so far (in use + free).
  int64_t blocks_allocated() const { return static_cast<int64_t>(refs_.size()); }
  /// Bytes of every slab held from the allocator.
  int64_t slab_bytes() const;

  /// Frees every block and returns all slabs to the allocator (ids become invalid).
  void clear();

 private:
  struct FreeDeleter {
    void operator()(uint8_t* p) const;
  };
  int64_t block_bytes_;
  int64_t blocks_per_slab_;
  std::vector<std::unique_ptr<uint8_t, FreeDeleter>> slabs_;
  std::vector<int32_t> refs_;  ///< per block id
  std::vector<BlockId> free_;
  int64_t in_use_ = 0;
};

}  // namespace kvcache::cache
