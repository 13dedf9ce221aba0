// SPDX-License-Identifier: Apache-2.0
// EvictionPolicy base class, shared helpers and the policy factory.
#include "kvcache/eviction_policy.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <sstream>

#include "common/registry.h"
#include "evict/policies.h"
#include "kvcache/error.h"

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

void EvictionPolicy::observe(int64_t layer, const at::Tensor& probs) {
  observe(layer, reduce_attention(probs, shape_.num_kv_heads, attention_need()));
}

void EvictionPolicy::reset(int64_t context_length, const CacheShape& shape) {
  KV_CHECK_ARG(context_length >= 0, "reset: context_length must be >= 0, got ", context_length);
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

/// The eviction policies' registration list (order = `kv_study list` order): one line per
/// policy, fed into the one registry of spec heads (common/registry.h).
struct Registration {
  const ParamTable& (*table)();
  std::function<std::unique_ptr<EvictionPolicy>(const ParsedSpec&, Budget)> make;
};

const std::vector<Registration>& registrations() {
  using namespace evict;
  static const std::vector<Registration> regs = {
      {&FullPolicy::table,
       [](const ParsedSpec& s, Budget b) { return std::make_unique<FullPolicy>(s, b); }},
      {&WindowPolicy::table,
       [](const ParsedSpec& s, Budget b) { return std::make_unique<WindowPolicy>(s, b); }},
      {&SinkPolicy::table,
       [](const ParsedSpec& s, Budget b) { return std::make_unique<SinkPolicy>(s, b); }},
      {&H2OPolicy::table,
       [](const ParsedSpec& s, Budget b) { return std::make_unique<H2OPolicy>(s, b); }},
      {&RandomPolicy::table,
       [](const ParsedSpec& s, Budget b) { return std::make_unique<RandomPolicy>(s, b); }},
      {&SnapKVPolicy::table,
       [](const ParsedSpec& s, Budget b) { return std::make_unique<SnapKVPolicy>(s, b); }},
      {&TovaPolicy::table,
       [](const ParsedSpec& s, Budget b) { return std::make_unique<TovaPolicy>(s, b); }},
      {&PyramidKVPolicy::table,
       [](const ParsedSpec& s, Budget b) { return std::make_unique<PyramidKVPolicy>(s, b); }},
  };
  return regs;
}

}  // namespace

namespace registry {

std::vector<Entry> policy_entries() {
  std::vector<Entry> v;
  for (const auto& reg : registrations()) {
    Entry e;
    e.kind = SpecKind::kPolicy;
    e.table = &reg.table();
    e.policy = reg.make;
    v.push_back(std::move(e));
  }
  return v;
}

}  // namespace registry

std::unique_ptr<EvictionPolicy> make_eviction_policy(const std::string& spec) {
  auto [body, budget] = split_budget(spec);
  KV_CHECK_ARG(!body.empty(), "eviction policy spec '", spec, "' has no head");
  const registry::Parsed p = registry::parse(body, SpecKind::kPolicy, {SpecKind::kPolicy});
  auto policy = p.entry->policy(p.fields, budget);
  // Validates absolute budgets against protected tokens now; fractional ones at reset().
  policy->reset(0, CacheShape{});
  return policy;
}

std::vector<ParamTable> registered_policies() {
  std::vector<ParamTable> out;
  for (const auto& e : registry::entries()) {
    if (e.kind == SpecKind::kPolicy) out.push_back(*e.table);
  }
  return out;
}

}  // namespace kvcache
