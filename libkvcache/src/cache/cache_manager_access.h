// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cache_manager_access.h (internal)
/// Read-only introspection of a SequenceCache's stored form, for tests and debugging
/// (residual contents, quantized groups, holes). Not part of the public API.

#include <cstdint>
#include <string>
#include <vector>

#include "cache/block_layer_view.h"
#include "kvcache/buffer.h"
#include "kvcache/sequence_cache.h"

namespace kvcache::cache {

class LayerStore;
class StepProtocol;

/// Stored form of one stream (K or V) of one layer, per KV head.
struct StreamDebug {
  std::vector<int64_t> quantized_tokens;  ///< live tokens in the stream's quantized format
  std::vector<int64_t> residual_tokens;   ///< live tokens in the full-precision residual
  std::vector<int64_t> converted_tokens;  ///< survivors of per-channel groups, dequantized once
  std::vector<int64_t> quantized_groups;  ///< per-channel groups held (0 for per-token formats)
  std::vector<int64_t> dead_slots;        ///< evicted slots still inside held blocks
  std::vector<int64_t> blocks;            ///< blocks held
  std::vector<Buffer> residual;           ///< `[1, 1, r, D]` float32: the residual's rows
  std::vector<Buffer> stored;             ///< `[1, 1, T, D]` float32: all live tokens, dequantized
  bool token_readable = false;            ///< the quantized format stores tokens one by one
  int64_t residual_length = 0;
  int64_t block_tokens = 0;
  std::string quantizer;
};

struct CacheManagerAccess {
  static StreamDebug stream(const SequenceCache& m, int64_t layer, bool key);
  /// attend() of `layer` into `out` (`[1, H_q, T_q, D]` float32) without recording attention
  /// for the policy, through the fused kernels where available (`fused`) or the generic
  /// per-block path everywhere.
  static void attend(const SequenceCache& m, int64_t layer, const TensorView& q, const TensorView& q_positions,
                     bool fused, const MutableTensorView& out);
  /// The block store of `layer` (read-only).
  static const LayerStore& layer(const SequenceCache& m, int64_t layer);
  /// The LayerView the policy gets for `layer` in end_step().
  static BlockLayerView view(const SequenceCache& m, int64_t layer);
  /// Canonical cache scheme spec.
  static std::string scheme(const SequenceCache& m);
  /// The steps behind a cache.
  static const StepProtocol& steps(const SequenceCache& m);
};

}  // namespace kvcache::cache
