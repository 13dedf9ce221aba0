// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_store.h (internal)
/// LayerStore: what one layer holds — per KV head, a K stream and a V stream, each a list
/// of quantized blocks followed by a list of full-precision residual blocks (BlockList),
/// oldest first; both streams hold the same tokens in the same order. The residual rule of
/// the cache scheme (StreamSpec: R tokens, sliding or block flush) moves tokens from the
/// residual into quantized storage as they are written.

#include <cstdint>
#include <memory>
#include <vector>

#include "cache/block_list.h"
#include "kvcache/cache_scheme.h"

namespace kvcache::cache {

/// How one stream (K or V) of a layer is stored (StreamSpec from the layer's cache scheme).
struct StreamSetup {
  StreamSpec spec;
  StreamFormats formats;
  /// Per KV head, when the scheme gives head quantizers (StreamSpec::head_quantizers): the
  /// same layouts as `formats`, each head's own quantizer. Empty: `formats` for every head.
  std::vector<StreamFormats> head_formats;
  const StreamFormats* formats_for(int64_t h) const {
    return head_formats.empty() ? &formats : &head_formats[static_cast<size_t>(h)];
  }
  /// Number of oldest residual tokens the flush rule moves out of a residual of `r` tokens.
  int64_t flush_count(int64_t r) const;
  bool direct() const { return spec.residual == 0 && spec.flush == ResidualFlush::kSliding; }
};

/// One stream of one KV head.
struct HeadStream {
  BlockList quant, resid;
  /// Tokens ever written or adopted (StreamSpec::sink_tokens: the first ones stay unquantized).
  int64_t written = 0;
  int64_t live() const { return quant.live() + resid.live(); }
  int64_t bytes_resident() const { return quant.bytes_resident() + resid.bytes_resident(); }
  int64_t bytes_reserved() const { return quant.bytes_reserved() + resid.bytes_reserved(); }
  /// Positions of the live tokens, oldest first.
  std::vector<int64_t> positions() const;
};

/// A stream's blocks in cache order — the quantized list, then the full-precision residual —
/// for the readers that visit them one at a time (attend()'s tiles, the policies' view).
class StreamBlockWalk {
 public:
  explicit StreamBlockWalk(const HeadStream& s) : s_(&s) {}
  /// The next block and the list holding it (for its format and decode); false after the last.
  bool next(const BlockList** list, const Block** block) {
    while (true) {
      const BlockList& l = list_ == 0 ? s_->quant : s_->resid;
      if (bi_ < l.blocks().size()) {
        *list = &l;
        *block = &l.blocks()[bi_++];
        return true;
      }
      if (list_ == 1) return false;
      list_ = 1;
      bi_ = 0;
    }
  }

 private:
  const HeadStream* s_;
  int list_ = 0;
  size_t bi_ = 0;
};

class LayerStore {
 public:
  LayerStore(const StreamSetup* key, const StreamSetup* value, int64_t num_heads, int64_t head_dim);

  int64_t num_heads() const { return static_cast<int64_t>(k_.size()); }
  int64_t head_dim() const { return head_dim_; }
  const HeadStream& k(int64_t h) const { return k_[static_cast<size_t>(h)]; }
  const HeadStream& v(int64_t h) const { return v_[static_cast<size_t>(h)]; }
  const StreamSetup& key_setup() const { return *ks_; }
  const StreamSetup& value_setup() const { return *vs_; }
  /// Per-stream scales (fp8:*:scaled), fixed at the layer's first write.
  float k_scale() const { return k_scale_; }
  float v_scale() const { return v_scale_; }
  bool scales_set() const { return scales_set_; }
  void set_scales(float k, float v);

  /// Writes `n` tokens of head h: rows `k`/`v` float32 `[n, D]` (keys as stored), positions.
  void write(int64_t h, const float* k, const float* v, const int64_t* pos, int64_t n);
  /// Evicts the head's live tokens at indices `idx` (strictly increasing) from both streams.
  void evict(int64_t h, const std::vector<int64_t>& idx);
  /// Re-numbers every head's positions contiguously, ending at max_resident() − 1: a head of
  /// n_h tokens gets max_resident() − n_h, ..., max_resident() − 1 (PositionMode::kRerotate;
  /// heads of equal length: 0, 1, ...).
  void renumber_positions();
  /// Takes shared blocks as head h's oldest tokens (prefix sharing): `k` and `v` in order,
  /// appended to the quantized lists (settled blocks: in neither residual). The head must be
  /// empty.
  void adopt(int64_t h, const std::vector<Block>& k, const std::vector<Block>& v);

  /// Upper bound of the bytes of new blocks write(h, ..., n) allocates for every head when no
  /// value overflows its format (BlockList::append_bound; frees in the same call not subtracted).
  int64_t write_bound(int64_t n) const;
  /// Upper bound of the bytes evict(h, idx) allocates (BlockList::evict_bound, both streams).
  int64_t evict_bound(int64_t h, const std::vector<int64_t>& idx) const;
  /// Blocks copied on write, over every head and stream (cumulative).
  int64_t cow_copies() const;

  int64_t resident(int64_t h) const { return k_[static_cast<size_t>(h)].live(); }
  int64_t max_resident() const;
  int64_t bytes_resident() const;
  int64_t bytes_reserved() const;

  void clear();
  /// A snapshot being read (snapshot.cpp): head h's K (`key`) or V stream to fill, and the
  /// stream scales as saved. The caller checks the whole store afterwards.
  HeadStream& restore_stream(int64_t h, bool key) { return key ? k_[static_cast<size_t>(h)] : v_[static_cast<size_t>(h)]; }
  void restore_scales(float k, float v, bool set) {
    k_scale_ = k;
    v_scale_ = v;
    scales_set_ = set;
  }
  /// @throws InternalError naming layer `layer` on a broken invariant.
  void check(int64_t layer) const;

 private:
  void write_stream(HeadStream& s, const StreamSetup& st, float scale, const float* x, const int64_t* pos, int64_t n);
  const StreamSetup* ks_;
  const StreamSetup* vs_;
  int64_t head_dim_;
  std::vector<HeadStream> k_, v_;
  float k_scale_ = 1.0f, v_scale_ = 1.0f;
  bool scales_set_ = false;
};

}  // namespace kvcache::cache
