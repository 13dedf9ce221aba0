// SPDX-License-Identifier: Apache-2.0
// EvictionPolicy base class, shared helpers and the policy factory.
#include "kvcache/eviction_policy.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <sstream>

#include "registry/registry.h"
#include "evict/policies.h"
#include "kvcache/error.h"
#include "kvcache/spec.h"

namespace kvcache {

bool EvictionPlan::empty() const {
  for (const auto& e : evict) {
    if (!e.empty()) return false;
  }
  return true;
}

int64_t EvictionPlan::count(int64_t h) const {
  return evict.empty() ? 0 : static_cast<int64_t>(evict.at(static_cast<size_t>(h)).size());
}

int64_t EvictionPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  return resolved_budget();
}

int64_t EvictionPolicy::resolved_budget() const {
  KV_CHECK_ARG(!(budget_.kind == Budget::Kind::kFraction && context_length_ <= 0), "policy '",
               spec(), "': budget ", budget_.to_string(),
               " is a fraction of the request's context length, which is unknown (0): call "
               "CacheManager::reset(context_length) / EvictionPolicy::reset first");
  return resolved_budget_;
}

void EvictionPolicy::observe(int64_t layer, const AttentionMass& mass) {
  KV_CHECK_ARG(layer >= 0 && layer < shape_.num_layers, "observe: layer ", layer,
               " out of range [0, ", shape_.num_layers, ")");
  KV_CHECK_ARG(mass.num_kv_heads() == shape_.num_kv_heads, "observe: attention mass for ",
               mass.num_kv_heads(), " KV heads, expected H_kv = ", shape_.num_kv_heads);
  KV_CHECK_ARG(mass.rows >= 1, "observe: attention mass with ", mass.rows, " rows");
  for (int64_t h = 0; h < mass.num_kv_heads(); ++h) {
    const auto& m = mass.heads[static_cast<size_t>(h)];
    KV_CHECK_ARG(static_cast<int64_t>(m.size()) % mass.rows == 0, "observe: head ", h, " holds ", m.size(),
                 " values, not a multiple of ", mass.rows, " rows");
    for (size_t i = 0; i < m.size(); ++i) {
      KV_CHECK_ARG(std::isfinite(m[i]) && m[i] >= 0.0f, "observe: attention mass of layer ", layer, " head ", h,
                   " at ", i, " is ", m[i], " (expected a finite probability >= 0)");
    }
  }
  do_observe(layer, mass);
}

void EvictionPolicy::observe_queries(int64_t layer, const QueryRows& rows, const LayerView& view) {
  KV_CHECK_ARG(layer >= 0 && layer < shape_.num_layers, "observe_queries: layer ", layer, " out of range [0, ",
               shape_.num_layers, ")");
  KV_CHECK_ARG(rows.num_q_heads == shape_.num_q_heads, "observe_queries: ", rows.num_q_heads,
               " query heads, expected H_q = ", shape_.num_q_heads);
  KV_CHECK_ARG(view.num_kv_heads() == shape_.num_kv_heads, "observe_queries: a view of ", view.num_kv_heads(),
               " KV heads, expected H_kv = ", shape_.num_kv_heads);
  KV_CHECK_ARG(rows.head_dim == view.head_dim() && rows.rows() >= 1, "observe_queries: ", rows.rows(),
               " rows of dim ", rows.head_dim, " for a view of head_dim ", view.head_dim(), " (expected >= 1 row)");
  const size_t want = static_cast<size_t>(rows.num_q_heads * rows.rows() * rows.head_dim);
  KV_CHECK_ARG(rows.post_rope.size() == want && (rows.pre_rope.empty() || rows.pre_rope.size() == want),
               "observe_queries: ", rows.post_rope.size(), " post-RoPE and ", rows.pre_rope.size(),
               " pre-RoPE values, expected ", want, " (H_q x rows x D)");
  for (const auto* v : {&rows.post_rope, &rows.pre_rope}) {
    for (size_t i = 0; i < v->size(); ++i) {
      KV_CHECK_ARG(std::isfinite((*v)[i]), "observe_queries: layer ", layer, " query value ", i, " is ", (*v)[i],
                   " (expected finite)");
    }
  }
  do_observe_queries(layer, rows, view);
}

void EvictionPolicy::observe(int64_t layer, const TensorView& probs) {
  observe(layer, reduce_attention(probs, shape_.num_kv_heads, attention_need()));
}

void EvictionPolicy::reset(int64_t context_length, const CacheShape& shape) {
  KV_CHECK_ARG(context_length >= 0 && context_length <= kMaxTokens, "reset: context_length must be in [0, ",
               kMaxTokens, "] tokens, got ", context_length);
  KV_CHECK_ARG(shape.num_layers >= 1 && shape.num_kv_heads >= 1 && shape.num_q_heads >= 1 &&
                   shape.num_q_heads % shape.num_kv_heads == 0,
               "reset: bad cache shape num_layers=", shape.num_layers, " H_q=", shape.num_q_heads,
               " H_kv=", shape.num_kv_heads, " (H_q must be a multiple of H_kv)");
  context_length_ = context_length;
  shape_ = shape;
  switch (budget_.kind) {
    case Budget::Kind::kNone:
      resolved_budget_ = context_length;
      break;
    case Budget::Kind::kTokens:
      resolved_budget_ = budget_.resolve(context_length);
      break;
    case Budget::Kind::kFraction:
      // Unknown context: resolution deferred, resolved_budget() throws until a real reset.
      resolved_budget_ = context_length > 0 ? budget_.resolve(context_length) : 0;
      break;
  }
  on_reset();
}

namespace evict {

std::vector<int64_t> lowest_k(const float* scores, int64_t n, int64_t k) {
  if (k <= 0) return {};
  std::vector<int64_t> out;
  if (k >= n) {
    out.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = i;
    return out;
  }
  // "Worse" total order: lower score first; equal scores: the older (smaller index) first.
  auto worse = [scores](int64_t a, int64_t b) {
    if (scores[a] != scores[b]) return scores[a] < scores[b];
    return a < b;
  };
  if (k == 1) {  // the decode case: one scan
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i) {
      if (worse(i, best)) best = i;
    }
    return {best};
  }
  out.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = i;
  std::nth_element(out.begin(), out.begin() + (k - 1), out.end(), worse);
  out.resize(static_cast<size_t>(k));
  std::sort(out.begin(), out.end());
  return out;
}

EvictionPlan uniform_plan(const std::vector<int64_t>& evict, int64_t num_kv_heads) {
  EvictionPlan p;
  if (evict.empty()) return p;
  p.evict.assign(static_cast<size_t>(num_kv_heads), evict);
  return p;
}

EvictionPlan evict_span(const EvictionContext& ctx, int64_t first, int64_t keep) {
  EvictionPlan p;
  for (int64_t h = 0; h < ctx.num_kv_heads(); ++h) {
    const int64_t t = ctx.resident[static_cast<size_t>(h)];
    if (t <= keep) continue;
    if (p.evict.empty()) p.evict.resize(static_cast<size_t>(ctx.num_kv_heads()));
    auto& e = p.evict[static_cast<size_t>(h)];
    e.resize(static_cast<size_t>(t - keep));
    std::iota(e.begin(), e.end(), first);
  }
  return p;
}

int64_t uniform_resident(const EvictionContext& ctx, const char* policy) {
  KV_INTERNAL_ASSERT(!ctx.resident.empty(), policy, ": no heads");
  const int64_t t = ctx.resident[0];
  for (size_t h = 1; h < ctx.resident.size(); ++h) {
    KV_CHECK_ARG(ctx.resident[h] == t, policy, ": layer ", ctx.layer, " head ", h, " holds ", ctx.resident[h],
                 " tokens but head 0 holds ", t, "; ", policy,
                 " plans one selection for every head and needs heads of equal length");
  }
  return t;
}

uint64_t SplitMix64::next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

uint64_t SplitMix64::below(uint64_t n) {
  const uint64_t limit = std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % n;
  uint64_t x = next();
  while (x >= limit) x = next();
  return x % n;
}

}  // namespace evict

namespace {

/// Deepest nesting of wrapper policies a spec may have (adakv:decode:h2o is 2).
constexpr int kMaxWrapperDepth = 4;

/// The eviction policies' registration list (order = `kv_study list` order): one line per
/// policy, fed into the one registry of spec heads (registry/registry.h). A wrapper (adakv,
/// decode) takes the policy it wraps as the rest of its spec, after its own fields.
struct Registration {
  const ParamTable& (*table)();
  /// inner: the wrapped policy (wrappers only; null otherwise).
  std::function<std::unique_ptr<EvictionPolicy>(const ParsedSpec&, Budget, std::unique_ptr<EvictionPolicy>)> make;
  bool wraps = false;  ///< takes an inner policy spec after its own fields
};

template <class P>
Registration plain() {
  return {&P::table, [](const ParsedSpec& s, Budget b, std::unique_ptr<EvictionPolicy>) { return std::make_unique<P>(s, b); },
          false};
}

template <class P>
Registration wrapper() {
  return {&P::table,
          [](const ParsedSpec& s, Budget b, std::unique_ptr<EvictionPolicy> inner) {
            return std::make_unique<P>(s, b, std::move(inner));
          },
          true};
}

const std::vector<Registration>& registrations() {
  using namespace evict;
  static const std::vector<Registration> regs = {
      plain<FullPolicy>(),   plain<WindowPolicy>(),     plain<SinkPolicy>(),         plain<H2OPolicy>(),
      plain<RandomPolicy>(), plain<SnapKVPolicy>(),     plain<TovaPolicy>(),         plain<PyramidKVPolicy>(),
      plain<KnormPolicy>(),  plain<KeyDiffPolicy>(),    plain<ExpectedAttentionPolicy>(), plain<DuoAttentionPolicy>(),
      plain<KVzipPolicy>(),
      wrapper<AdaKVPolicy>(), wrapper<DecodeCompressionPolicy>(),
  };
  return regs;
}

/// The registration of a registered policy head (an old spelling finds its new head), or null.
const Registration* find_registration(const std::string& head) {
  const registry::Entry* e = registry::find(head);
  if (e == nullptr || e->kind != SpecKind::kPolicy) return nullptr;
  for (const auto& reg : registrations()) {
    if (&reg.table() == e->table) return &reg;
  }
  return nullptr;
}

std::string join(const std::vector<std::string>& parts, size_t from, size_t to) {
  std::string out;
  for (size_t i = from; i < to; ++i) out += (i > from ? ":" : "") + parts[i];
  return out;
}

/// Builds `body` (no '@') with `budget`; wrappers build their inner policy from the rest of
/// the body after their own fields.
std::unique_ptr<EvictionPolicy> build(const std::string& body, Budget budget, const std::string& spec, int depth) {
  KV_CHECK_ARG(!body.empty(), "eviction policy spec '", spec, "' has no head");
  const std::vector<std::string> parts = split_spec(body);
  const Registration* reg = find_registration(parts[0]);
  if (reg == nullptr || !reg->wraps) {
    // Unknown heads and heads of another kind: the registry's errors.
    const registry::Parsed p = registry::parse(body, SpecKind::kPolicy, {SpecKind::kPolicy});
    return p.entry->policy(p.fields, budget);
  }
  // A wrapper: its own fields, then the wrapped policy from the first field that names a policy.
  size_t inner_at = 1;
  while (inner_at < parts.size() && find_registration(parts[inner_at]) == nullptr) ++inner_at;
  KV_CHECK_ARG(inner_at < parts.size(), "'", parts[0], "' wraps a policy: write it after ", parts[0],
               "'s own fields, e.g. '", parts[0], ":snapkv@50%' (spec '", spec, "')");
  KV_CHECK_ARG(depth < kMaxWrapperDepth, "spec '", spec, "' nests more than ", kMaxWrapperDepth, " wrapper policies");
  auto inner = build(join(parts, inner_at, parts.size()), budget, spec, depth + 1);
  return reg->make(ParsedSpec::parse(join(parts, 0, inner_at), reg->table()), budget, std::move(inner));
}

}  // namespace

namespace registry {

std::vector<Entry> policy_entries() {
  std::vector<Entry> v;
  for (const auto& reg : registrations()) {
    Entry e;
    e.kind = SpecKind::kPolicy;
    e.table = &reg.table();
    if (!reg.wraps) {
      auto make = reg.make;
      e.policy = [make](const ParsedSpec& s, Budget b) { return make(s, b, nullptr); };
    } else {
      const std::string head = reg.table().head;
      e.policy = [head](const ParsedSpec&, Budget) -> std::unique_ptr<EvictionPolicy> {
        throw InvalidArgument(detail::str_cat("'", head, "' wraps a policy: write it after ", head,
                                              "'s own fields, e.g. '", head, ":snapkv@50%'"));
      };
    }
    v.push_back(std::move(e));
  }
  v.push_back(per_layer_policy_entry());
  return v;
}

}  // namespace registry

std::unique_ptr<EvictionPolicy> make_eviction_policy(const std::string& spec) {
  // Per-layer budgets: its runs carry their own '@' budgets (reset() checks the layer count).
  if (spec_head(spec) == "perlayer") return evict::make_per_layer_policy(spec);
  auto [body, budget] = split_budget(spec);
  KV_CHECK_ARG(!body.empty(), "eviction policy spec '", spec, "' has no head");
  const Registration* top = find_registration(split_spec(body)[0]);
  if (top == nullptr || !top->wraps) {
    auto policy = build(body, budget, spec, 0);
    // Validates absolute budgets against protected tokens now; fractional ones at reset().
    policy->reset(0, CacheShape{});
    return policy;
  }
  // A wrapper: every error names the whole spec as the user wrote it.
  try {
    auto policy = build(body, budget, spec, 0);
    policy->reset(0, CacheShape{});
    return policy;
  } catch (const CapacityError& e) {
    throw CapacityError("eviction policy '" + spec + "': " + e.what());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("eviction policy '" + spec + "': " + e.what());
  }
}

std::vector<ParamTable> registered_policies() {
  std::vector<ParamTable> out;
  for (const auto& e : registry::entries()) {
    if (e.kind == SpecKind::kPolicy) out.push_back(*e.table);
  }
  return out;
}

}  // namespace kvcache
