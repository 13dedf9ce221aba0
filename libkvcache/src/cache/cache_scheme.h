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

/// Parses `CacheConfig::quant`. Plain quantizer specs: both streams use it, residual =
/// `residual_length` flushed sliding (block flush of multiples of g for per-channel `chan`
/// quantizers, whose groups span tokens: R is raised to a multiple of g, at least g);
/// residual dtype float32 for `fp32`, float16 otherwise.
/// @throws InvalidArgument on a bad scheme spec (listing the allowed fields) or bad numbers.
CacheScheme parse_cache_scheme(const std::string& quant, int64_t residual_length, int64_t head_dim);

/// Parameter tables of the registered cache schemes (for --list).
std::vector<ParamTable> registered_cache_schemes();

/// Group size `g<N>` of a quantizer spec (0 if absent) and whether it has the `chan` field.
int64_t spec_group_size(const std::string& quantizer_spec);
bool spec_is_per_channel(const std::string& quantizer_spec);

}  // namespace kvcache::cache
