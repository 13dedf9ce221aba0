// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file rope_table.h (internal)
/// Native rotation of pre-RoPE keys read from the cache (KeyStorage::kPreRoPE). The model's
/// RoPE is a hook over rows (CacheConfig::rope); attend() must not call it per block, so
/// the table records its cos/sin per position by probing it with unit vectors, once per new
/// position, and rotates rows with the same float32 operations the export uses:
///   y[i]       = x[i]·cos_i + (−x[i + D/2])·sin_i
///   y[i + D/2] = x[i + D/2]·cos_i + x[i]·sin_i          (HF rotate_half, i < D/2)
/// The probe also verifies that the hook has this form (and equal cos/sin in both halves).

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/cache_config.h"

namespace kvcache::common {

class RopeTable {
 public:
  RopeTable() = default;
  /// @throws InvalidArgument if `rope` is not a rotate-half RoPE over head_dim (even D); the
  /// message ends with `needed_by` (who needs the table).
  RopeTable(RopeFn rope, int64_t head_dim,
            const std::string& needed_by = "key_storage=kPreRoPE rotates keys on read and needs it");

  /// Records positions `pos[0..n)` not seen yet (positions ≥ 0).
  void extend(const int64_t* pos, int64_t n);
  /// Rotates `x` `[D]` in place for position p (recorded before).
  void rotate(float* x, int64_t p) const;
  /// Rotates `x` `[D]` back by position p (recorded before): the inverse of rotate().
  void unrotate(float* x, int64_t p) const;
  /// Mean over positions [first, first + n) of cos and sin per frequency (`[D/2]` each),
  /// probing the hook once (nothing is recorded). first ≥ 0, n ≥ 1.
  void mean_cos_sin(int64_t first, int64_t n, float* cos_out, float* sin_out) const;
  bool enabled() const { return head_dim_ > 0; }
  /// True if the hook rotated nothing at the probed positions (cos 1, sin 0 everywhere): the
  /// identity, as keys_already_rotated() is — a table that cannot rotate or un-rotate anything.
  bool identity() const { return identity_; }

 private:
  /// cos/sin rows for positions [first, first + n) from one call of the hook.
  void probe(int64_t first, int64_t n, float* cos_out, float* sin_out) const;
  RopeFn rope_;
  int64_t head_dim_ = 0;
  std::vector<float> cs_;  ///< per position: D/2 cos then D/2 sin
  int64_t size_ = 0;       ///< positions [0, size_) recorded
  bool identity_ = false;
};

}  // namespace kvcache::common
