// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file block_list.h (internal)
/// The block storage of one stream (K or V) of one KV head: a chronological list of blocks
/// from BlockPools, each holding up to `capacity` tokens in one BlockFormat (the stream's
/// quantizer, its full-precision residual dtype, small blocks for converted per-channel
/// groups, or the fp32 fallback). No tensors: raw memory laid out by the quantizer's
/// StoredLayout, so attention reads exactly what is stored (docs/cache-manager.md).
///
/// Invariants (check()): every block holds ≥ 1 live token; live tokens' positions increase
/// strictly along the list; `live` = filled slots − dead slots; counters equal recounts.
///
/// Eviction leaves holes (dead slots) that readers skip. Then, per touched block:
///   - no live token left → the block returns to its pool at once;
///   - token-readable formats: a block merges with a neighbour of the same format when
///     their live tokens fit one block (the earlier block takes both, compacted; the later
///     one is freed), so any two adjacent blocks of one format hold more than `capacity`
///     live tokens and a list reserves < 2 × its live slots + 1 block per format run;
///   - per-channel formats (one group = one block; a group cannot be split): when the
///     survivors take no more bytes in the conversion format than the whole group, they are
///     dequantized once into a small block of that format (never requantized); otherwise the
///     group keeps its bytes with dead slots until that rule or full eviction frees it.
///
/// Sharing (prefix caching, docs/cache-manager.md "Many sequences, shared prefixes"): a block
/// may be held by several lists (BlockPool reference count > 1) and is then read-only. Host
/// metadata (slots filled, holes, positions) is per list, so evicting from a shared block only
/// marks holes in this list's view; the one write into an existing block — merging a neighbour
/// into it (and appending into a partly filled tail) — first copies a shared block into a
/// private one (copy-on-write, counted by cow_copies()). A list therefore does exactly what it
/// would do with private blocks, and no other holder ever sees a byte change.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cache/block_pool.h"
#include "kvcache/quantizer.h"

namespace kvcache::cache {

/// One stored format: a quantizer's StoredLayout for head_dim D with `capacity` tokens per
/// block. Block memory: [codes: groups × code_bytes][scales][zeros], each region 8-aligned.
struct BlockFormat {
  const Quantizer* quantizer = nullptr;
  StoredLayout layout;
  int64_t head_dim = 0;
  int64_t capacity = 0;  ///< tokens per block (multiple of layout.group_tokens)
  int64_t groups = 0;    ///< groups per block
  int64_t scales_offset = 0, zeros_offset = 0, block_bytes = 0;
  BlockPool* pool = nullptr;
  bool raw_fp32 = false;  ///< plain float32 rows: readers may use the block memory as is

  BlockFormat() = default;
  BlockFormat(const Quantizer& q, int64_t head_dim, int64_t capacity, BlockPool* pool);
  /// Block bytes a `capacity`-token block of `q` needs (to pick its pool before building).
  static int64_t bytes_for(const Quantizer& q, int64_t head_dim, int64_t capacity);

  bool token_readable() const { return layout.token_readable(); }
  /// Stored bytes of one token (token-readable formats) or one group.
  int64_t group_bytes() const { return layout.group_bytes(); }
  GroupBuffers at(uint8_t* block, int64_t group) const;
  ConstGroupBuffers at(const uint8_t* block, int64_t group) const;
};

/// The formats a stream's blocks may use, by index (Block::format).
struct StreamFormats {
  enum : uint8_t { kMain = 0, kResidual = 1, kConverted = 2, kFallback = 3, kCount = 4 };
  BlockFormat f[kCount];
  /// Whether the main format uses a per-stream tensor scale (fp8:*:scaled).
  bool tensor_scale() const { return f[kMain].layout.tensor_scale; }
};

struct Block {
  BlockId id = -1;
  uint8_t format = 0;
  int32_t filled = 0;  ///< slots written, ≤ capacity
  int32_t live = 0;    ///< live tokens among the filled slots
  int64_t pos0 = 0;    ///< implicit positions: slot s holds pos0 + s (when `pos` is empty)
  std::vector<uint64_t> dead;  ///< bit s: slot s evicted (empty: no holes)
  std::vector<int64_t> pos;    ///< explicit position per slot (empty: implicit)

  bool alive(int64_t s) const {
    return dead.empty() || ((dead[static_cast<size_t>(s >> 6)] >> (s & 63)) & 1u) == 0;
  }
  int64_t position(int64_t s) const { return pos.empty() ? pos0 + s : pos[static_cast<size_t>(s)]; }
  bool has_holes() const { return live != filled; }
};

class BlockList {
 public:
  explicit BlockList(const StreamFormats* formats = nullptr) : fmts_(formats) {}
  BlockList(BlockList&&) noexcept;
  BlockList& operator=(BlockList&&) noexcept;
  ~BlockList();

  int64_t live() const { return live_; }
  /// Stored bytes of the live tokens: live rows of token-readable blocks, whole groups of
  /// per-channel blocks with any live token.
  int64_t bytes_resident() const { return bytes_; }
  /// Bytes of the blocks held (each block's full size).
  int64_t bytes_reserved() const { return reserved_; }
  const std::vector<Block>& blocks() const { return blocks_; }
  const BlockFormat& format(const Block& b) const { return fmts_->f[b.format]; }

  /// Appends `n` tokens encoded in format `fmt`: rows `x` float32 `[n, D]`, positions
  /// `pos[n]` (increasing, after every live position). For a per-channel format n must be a
  /// multiple of its group size. A group whose encoding overflows the format is stored in
  /// the fp32 fallback format instead.
  /// `encoder`: when not null, encodes the tokens instead of the format's quantizer (its
  /// StoredLayout must be the format's; StreamSpec::prefill_quantizer); decode() still reads
  /// them with the format's quantizer.
  void append(uint8_t fmt, const float* x, const int64_t* pos, int64_t n, float tensor_scale,
              const Quantizer* encoder = nullptr);
  /// Re-compression (StreamSpec::recompress): every block of format `fmt` is decoded (all its
  /// filled slots) and encoded again in place by the format's quantizer; a shared block is
  /// first copied (copy-on-write). A block whose new encoding overflows moves to the fp32
  /// fallback format, holding its decoded rows. Slots, holes and positions are unchanged.
  void reencode(uint8_t fmt, float tensor_scale);
  /// Upper bound of the bytes reencode(fmt) allocates: a copy of every shared block of `fmt`.
  int64_t reencode_bound(uint8_t fmt) const;
  /// Removes the `n` oldest live tokens (token-readable blocks only), writing their decoded
  /// rows to `out` `[n, D]` and their positions to `out_pos` (either may be null).
  void pop_front(int64_t n, float* out, int64_t* out_pos, float tensor_scale);
  /// Evicts the live tokens at local indices `idx[0..n)` (strictly increasing, < live()).
  void evict(const int64_t* idx, int64_t n, float tensor_scale);
  /// Re-numbers the live tokens' positions `next, next + 1, ...` in order; advances `next`.
  void renumber_positions(int64_t& next);

  /// Decodes block `b`'s filled slots, live and dead, to `out` float32 `[filled, D]`.
  /// `tensor_scale` applies to blocks of the main format only.
  void decode(const Block& b, float* out, float tensor_scale) const;
  /// Positions of the live tokens, in order, appended to `out`.
  void live_positions(std::vector<int64_t>& out) const;
  /// Decoded rows of the live tokens, in order, appended to `out` (`[live, D]` floats).
  void live_rows(std::vector<float>& out, float tensor_scale) const;

  /// Appends a block another holder owns (prefix sharing), taking a reference to it: `b`'s
  /// format, id, `filled` slots at positions pos0 + slot, no holes. Its positions must follow
  /// every live position of the list.
  void adopt(const Block& b);
  /// Appends a block read from a snapshot (snapshot.cpp): `b`'s format (one of the list's,
  /// checked by the caller), slots, holes and positions as given (b.id is ignored), in a new
  /// block whose memory is zeroed and then handed to `fill` to write the stored bytes. The
  /// counters follow; the caller runs check() once every block is in.
  void restore(Block b, const std::function<void(uint8_t* mem)>& fill);
  /// Blocks copied because a write would have touched a shared block (cumulative).
  int64_t cow_copies() const { return cow_; }
  /// Upper bound of the bytes of new blocks append(fmt, x, pos, n) allocates when no value
  /// overflows the format (no fp32 fallback), counting a copy-on-write of a shared tail.
  int64_t append_bound(uint8_t fmt, int64_t n) const;
  /// Upper bound of the bytes evict(idx, n) allocates: copies of shared blocks it may write
  /// into (a touched block or the one before it, which a merge writes) and converted
  /// per-channel survivors of shared groups. Blocks it frees are not subtracted.
  int64_t evict_bound(const int64_t* idx, int64_t n) const;
  /// Reference count of block `b` in its pool (1: held by this list only).
  int32_t refcount(const Block& b) const { return fmt(b.format).pool->refcount(b.id); }

  /// Releases every block.
  void clear();
  /// Verifies the invariants above. @throws InternalError naming `where`.
  void check(const std::string& where) const;

 private:
  const BlockFormat& fmt(uint8_t f) const { return fmts_->f[f]; }
  Block& new_block(uint8_t f);
  void release(Block& b);
  int64_t block_bytes_resident(const Block& b) const;
  void set_position(Block& b, int64_t slot, int64_t p);
  void kill(Block& b, int64_t slot);
  /// Per-channel block i with dead slots: converts its survivors when the rule allows.
  void convert_group(size_t i, float tensor_scale);
  /// Encodes m tokens into slots [0, m) of the empty block `b` of format f (fallback on overflow).
  void fill(Block& b, const float* x, const int64_t* pos, int64_t m, float tensor_scale, const Quantizer* enc);
  /// Merges block i+1 into block i (same token-readable format, fits).
  void merge_into(size_t i);
  bool mergeable(size_t i) const;
  /// Replaces block `b`'s memory by a private copy if another holder shares it.
  void make_private(Block& b);

  const StreamFormats* fmts_;
  std::vector<Block> blocks_;
  int64_t live_ = 0, bytes_ = 0, reserved_ = 0;
  int64_t cow_ = 0;
};

}  // namespace kvcache::cache
