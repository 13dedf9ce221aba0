// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cache_manager_access.h
/// Read-only introspection of a CacheManager's stored form, for tests and debugging
/// (residual contents, quantized blocks). Not part of the public API.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/cache_manager.h"

namespace kvcache::cache {

/// Stored form of one stream (K or V) of one layer, per KV head.
struct StreamDebug {
  std::vector<int64_t> quantized_tokens;  ///< live tokens in quantized storage
  std::vector<int64_t> residual_tokens;   ///< tokens in the full-precision residual
  std::vector<int64_t> quantized_blocks;  ///< GroupStore blocks (0 for per-token storage)
  std::vector<int64_t> dead_slots;        ///< evicted slots still held by quantized groups
  std::vector<at::Tensor> residual;       ///< `[B, 1, r, D]` residual rows (residual dtype)
  std::vector<at::Tensor> stored;         ///< `[B, 1, T, D]` float32: all tokens dequantized
  bool gatherable = false;
  int64_t residual_length = 0;
  std::string quantizer;
};

struct CacheManagerAccess {
  static StreamDebug stream(const CacheManager& m, int64_t layer, bool key);
  /// Canonical cache scheme spec.
  static std::string scheme(const CacheManager& m);
};

}  // namespace kvcache::cache
