// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file registry.h
/// The one registry of spec heads. Every quantizer (`int4`), cache scheme (`kivi`, `had`) and
/// eviction policy (`sink`) is registered once, under a head unique across all three kinds,
/// with its ParamTable (spec.h); make_quantizer (quantizer.h), make_cache_scheme
/// (cache_scheme.h) and make_eviction_policy (eviction_policy.h) look heads up here, so a
/// spec of the wrong kind gets an error naming what it is ("'h2o' is an eviction policy, not
/// a cache scheme"), and a program that must tell the kinds apart (the study's
/// `scheme+policy` arms) asks spec_kind() instead of keeping its own list.
///
/// A plain quantizer spec is also the trivial cache scheme (the same quantizer for K and V):
/// make_cache_scheme accepts every quantizer spec. Registration order is `kv_study list`
/// order. Adding a method is one registration in its module's list (docs/policies.md,
/// docs/quantizers.md, docs/cache-manager.md "Adding a cache scheme").

#include <optional>
#include <string>
#include <vector>

#include "kvcache/spec.h"

namespace kvcache {

/// What a registered head builds.
enum class SpecKind {
  kQuantizer,    ///< make_quantizer (and, as the trivial scheme, make_cache_scheme)
  kCacheScheme,  ///< make_cache_scheme: per-stream quantizers, residuals, rotations
  kPolicy,       ///< make_eviction_policy
};

/// "quantizer", "cache scheme" or "eviction policy".
const char* to_string(SpecKind kind);

/// One registered head.
struct RegisteredSpec {
  SpecKind kind = SpecKind::kQuantizer;
  ParamTable table;
  /// A wrapper (`had`): its specs are `head(:field)*(spec)` around another spec.
  bool wrapper = false;
};

/// Every registered head in registration order: the quantizers, then the cache schemes, then
/// the eviction policies.
std::vector<RegisteredSpec> registered_specs();

/// The kind of the head of `spec` (spec_head(): "had" of "had:k(int4)"), or std::nullopt when
/// no registered head matches (an old spelling, `pyramidkv`, has its new head's kind: the
/// factories accept it and canonicalize it to `pyramid`). Does not validate the fields.
std::optional<SpecKind> spec_kind(const std::string& spec);

}  // namespace kvcache
