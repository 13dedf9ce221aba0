// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file registry.h (internal)
/// The one registry behind kvcache/registry.h, assembled above the modules it lists (src/quant,
/// src/cache, src/evict each keep their own registration list and include nothing of this
/// directory but this header): one Entry per head, collected once from the
/// registration lists of the quantizers (src/quant/registry.cpp), the cache schemes
/// (src/cache/cache_scheme.cpp) and the eviction policies (src/evict/eviction_policy.cpp),
/// with heads unique across all of them. The factories (make_quantizer, make_cache_scheme,
/// make_eviction_policy) parse through parse() and build through the entry's function.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/cache_scheme.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/quantizer.h"
#include "kvcache/registry.h"
#include "kvcache/spec.h"

namespace kvcache::registry {

/// Builds from the parsed fields; `inner` is the wrapped spec of a wrapper entry ("" otherwise).
using QuantizerFactory = std::function<std::unique_ptr<Quantizer>(const ParsedSpec&, const std::string& inner)>;
using SchemeFactory = std::function<std::unique_ptr<CacheScheme>(const ParsedSpec&, const std::string& inner)>;
using PolicyFactory = std::function<std::unique_ptr<EvictionPolicy>(const ParsedSpec&, Budget)>;

struct Entry {
  SpecKind kind = SpecKind::kQuantizer;
  const ParamTable* table = nullptr;  ///< static storage
  bool wrapper = false;               ///< grammar head(:field)*(spec)
  QuantizerFactory quantizer;         ///< kQuantizer entries; a scheme wrapper may build quantizers too
  SchemeFactory scheme;               ///< kCacheScheme entries
  PolicyFactory policy;               ///< kPolicy entries
};

/// The registration lists of each module, in `kv_study list` order.
std::vector<Entry> quantizer_entries();
std::vector<Entry> scheme_entries();
/// The per-layer scheme `layers(...)` (src/cache/layer_scheme.cpp), listed by scheme_entries().
Entry layer_scheme_entry();
std::vector<Entry> policy_entries();
/// The per-layer budgets policy `perlayer(...)` (src/evict/per_layer_policy.cpp), listed by policy_entries().
Entry per_layer_policy_entry();

/// Every entry (quantizers, schemes, policies). @throws InternalError on a duplicate head.
const std::vector<Entry>& entries();
/// The entry of `head` (an old spelling such as `pyramidkv` finds its new head), or nullptr.
const Entry* find(const std::string& head);
/// The registered heads of the kinds in `kinds`, ", "-separated (for error messages).
std::string heads(std::initializer_list<SpecKind> kinds);

/// A spec parsed against its entry: the fields (outside the parentheses of a wrapper) and
/// the wrapped spec.
struct Parsed {
  const Entry* entry = nullptr;
  ParsedSpec fields;
  std::string inner;  ///< wrappers only
};

/// Parses `text` (no @budget; an old spelling of a head is read as its new head) for a factory that builds `want` ("quantizer", ... in
/// messages). @throws InvalidArgument: an unknown head (listing `known`, the heads of the
/// kinds the caller builds), a head of another kind (naming it and where it belongs), a wrapper without its `(spec)` or parentheses after a plain
/// head, bad fields.
Parsed parse(const std::string& text, SpecKind want, std::initializer_list<SpecKind> known);

}  // namespace kvcache::registry
