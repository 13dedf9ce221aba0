// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file token_buffer.h
/// TokenBuffer: a growable tensor `[B, H, capacity, rest...]` whose live rows along the token
/// axis (dim 2) are `[begin, end)`. It is the storage primitive of the CacheManager: codes,
/// scales, residual tokens, positions and the dequantized compute views all live in one.
///
/// - append: amortized O(rows appended) (capacity doubles; live rows are re-centred when the
///   end hits the capacity).
/// - keep (eviction): in-place per-head compaction with memmove, moving either the rows after
///   the first dropped one (towards the front) or the rows before the last dropped one
///   (towards the back), whichever moves fewer rows. Dropping the oldest tokens (windows,
///   sinks) therefore costs O(sinks), not O(T).
/// - nbytes: bytes of the live rows only (capacity slack is allocator detail, as a paged
///   engine's partially filled last block).
/// CPU tensors only.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace kvcache::cache {

class TokenBuffer {
 public:
  TokenBuffer() = default;
  /// Fixes dtype and the non-token dims (`shape[2]` is ignored) before the first append.
  TokenBuffer(at::ScalarType dtype, std::vector<int64_t> shape);

  /// Appends `x` `[B, H, n, rest...]` (converted to the buffer dtype). The first append of a
  /// default-constructed buffer fixes dtype and shape.
  void append(const at::Tensor& x);
  /// Appends `x` `[B, 1, n, rest...]` (buffer dtype, contiguous) to every head.
  void append_to_all_heads(const at::Tensor& x);
  /// Live rows `[B, H, size(), rest...]`: a view, invalidated by the next mutation.
  at::Tensor view() const;
  /// Live rows `[start, start + n)` of head `h`: `[B, 1, n, rest...]` view.
  at::Tensor rows(int64_t h, int64_t start, int64_t n) const;
  /// Overwrites rows `[start, start + x.size(2))` of head `h` with `x` `[B, 1, n, rest...]`.
  void write(int64_t h, int64_t start, const at::Tensor& x);
  /// Overwrites rows `[start, start + x.size(2))` of every head with `x` `[B, H, n, rest...]`.
  void write_all(int64_t start, const at::Tensor& x);

  /// Removes, for every head h, the rows `drops[h]` (strictly increasing indices into the live
  /// rows; every head drops the same number). Cost: O(drops) memmoves of the rows between
  /// drops, on the side (front or back) that moves fewer rows.
  void drop(const std::vector<std::vector<int64_t>>& drops);
  /// Drops the first `n` live rows of every head (O(1)).
  void drop_front(int64_t n);

  int64_t size() const { return end_ - begin_; }
  bool initialized() const { return data_.defined(); }
  int64_t num_heads() const { return shape_.size() > 1 ? shape_[1] : 0; }
  /// numel × element size of the live rows.
  int64_t nbytes() const;
  at::ScalarType dtype() const { return dtype_; }
  /// Converts the stored rows to `dtype` (e.g. fp16 → fp32 metadata promotion).
  void set_dtype(at::ScalarType dtype);
  void clear();

 private:
  void ensure_capacity(int64_t extra);
  int64_t row_bytes() const { return row_elems_ * static_cast<int64_t>(at::elementSize(dtype_)); }
  uint8_t* row_ptr(int64_t b, int64_t h, int64_t idx) const;

  at::ScalarType dtype_ = at::kFloat;
  std::vector<int64_t> shape_;  ///< [B, H, capacity, rest...]
  int64_t row_elems_ = 0;       ///< product of rest
  at::Tensor data_;
  int64_t begin_ = 0, end_ = 0;
};

}  // namespace kvcache::cache
