// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cache_scheme.h
/// A cache scheme: how the CacheManager stores keys and values. It names one quantizer per
/// stream (K, V), the full-precision residual window of each stream and how that residual is
/// flushed, and constraints on key storage. `CacheConfig::quant` is either a plain quantizer
/// spec (same quantizer for K and V, residual from `CacheConfig::residual_length`) or a
/// scheme spec such as `kivi:k2:v2:g32:r128`.
///
/// KVQuant and GEAR fit as schemes without new interfaces (docs/cache-manager.md): their
/// quantizers put outliers / low-rank factors into QuantizedTensor::side, KVQuant requires
/// `KeyStorage::kPreRoPE` (required_key_storage) and GEAR's streaming buffer is a residual
/// flushed in blocks.

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvcache/spec.h"
#include "kvcache/types.h"

namespace kvcache::cache {

/// How a stream's full-precision residual moves into quantized storage.
enum class ResidualFlush {
  /// Keep exactly the last R tokens in full precision; older ones are quantized as soon as
  /// they leave the window (KIVI values: one token at a time in decode).
  kSliding,
  /// Accumulate; whenever the residual holds >= R tokens, quantize the oldest floor(n/R)·R
  /// (KIVI keys: whole R-token blocks; the residual oscillates in [0, R−1]).
  kBlock,
};

/// Storage of one stream (K or V).
struct StreamSpec {
  std::string quantizer;               ///< spec for make_quantizer
  int64_t residual = 0;                ///< R: full-precision recent tokens
  ResidualFlush flush = ResidualFlush::kSliding;
  at::ScalarType residual_dtype = at::kHalf;  ///< dtype of residual (and dequantized-fp) rows
};

struct CacheScheme {
  std::string canonical;  ///< the scheme spec as printed back (e.g. "kivi:k2:v2:g32:r128")
  StreamSpec key, value;
  /// Set by schemes that quantize pre-RoPE keys (KVQuant); validate() checks the config.
  std::optional<KeyStorage> required_key_storage;
};

/// Parses `CacheConfig::quant` for head_dim `head_dim` (≥ 1). Plain quantizer specs: both
/// streams use it, residual = `residual_length` flushed sliding; a quantizer whose groups
/// span g tokens (StoredLayout::group_tokens > 1, the per-channel `chan` formats) flushes
/// whole groups instead: block flush, R raised to a multiple of g (at least g). Residual
/// dtype float32 for `fp32`, float16 otherwise.
/// @throws InvalidArgument on a bad scheme spec (listing the allowed fields), bad numbers,
///         or a quantizer whose layout does not fit head_dim.
CacheScheme parse_cache_scheme(const std::string& quant, int64_t residual_length, int64_t head_dim);

/// The canonical spec of `quant` (a quantizer or a cache scheme) without a model: checks the
/// grammar and the numbers that do not depend on head_dim.
/// @throws InvalidArgument as parse_cache_scheme.
std::string canonical_cache_spec(const std::string& quant);

/// Parameter tables of the registered cache schemes (for --list).
std::vector<ParamTable> registered_cache_schemes();

}  // namespace kvcache::cache
