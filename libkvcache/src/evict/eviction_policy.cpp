// SPDX-License-Identifier: Apache-2.0
// EvictionPolicy base class, shared helpers and the policy factory.
#include "kvcache/eviction_policy.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <sstream>

#include "evict/policies.h"
#include "kvcache/error.h"

namespace kvcache {

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

void EvictionPolicy::observe(int64_t layer, const at::Tensor& probs) {
  KV_CHECK_ARG(layer >= 0 && layer < shape_.num_layers, "observe: layer ", layer,
               " out of range [0, ", shape_.num_layers, ")");
  KV_CHECK_ARG(probs.defined() && probs.dim() == 4 && probs.scalar_type() == at::kFloat,
               "observe: probs must be float32 [B, H_q, T_q, T_res], got ",
               probs.defined() ? probs.sizes() : at::IntArrayRef{}, " ",
               probs.defined() ? std::string(at::toString(probs.scalar_type())) : "undefined");
  KV_CHECK_ARG(probs.size(1) == shape_.num_q_heads, "observe: probs has H_q = ", probs.size(1),
               ", expected ", shape_.num_q_heads, " (shape ", probs.sizes(), ")");
  do_observe(layer, probs);
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

at::Tensor reduce_to_kv_heads(const at::Tensor& probs, int64_t num_kv_heads) {
  KV_CHECK_ARG(probs.dim() == 4, "reduce_to_kv_heads: expected [B, H_q, T_q, T], got ",
               probs.sizes());
  const int64_t hq = probs.size(1);
  KV_CHECK_ARG(num_kv_heads >= 1 && hq % num_kv_heads == 0, "reduce_to_kv_heads: H_q = ", hq,
               " is not a multiple of H_kv = ", num_kv_heads);
  auto summed = probs.to(at::kFloat).sum(0);  // [H_q, T_q, T]
  return summed.view({num_kv_heads, hq / num_kv_heads, summed.size(1), summed.size(2)}).mean(1);
}

std::vector<int64_t> top_k_recent_ties(const float* scores, const std::vector<int64_t>& candidates,
                                       int64_t k) {
  const auto n = static_cast<int64_t>(candidates.size());
  if (k >= n) return candidates;
  if (k <= 0) return {};
  // Total order "better": higher score first; equal scores: larger index (more recent) first.
  // Its reverse ("worse") selects the complement, so either side gives the same set.
  if (k <= n / 2) {
    std::vector<int64_t> order(candidates);
    auto better = [scores](int64_t a, int64_t b) {
      if (scores[a] != scores[b]) return scores[a] > scores[b];
      return a > b;
    };
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), better);
    order.resize(static_cast<size_t>(k));
    std::sort(order.begin(), order.end());
    return order;
  }
  // Few to drop (the decode case drops one): select the n − k worst, O(n), no sort of the kept.
  const int64_t d = n - k;
  auto worse = [scores](int64_t a, int64_t b) {
    if (scores[a] != scores[b]) return scores[a] < scores[b];
    return a < b;
  };
  std::vector<int64_t> dropped;
  if (d == 1) {
    dropped.push_back(*std::min_element(candidates.begin(), candidates.end(), worse));
  } else {
    dropped = candidates;
    std::nth_element(dropped.begin(), dropped.begin() + (d - 1), dropped.end(), worse);
    dropped.resize(static_cast<size_t>(d));
    std::sort(dropped.begin(), dropped.end());
  }
  std::vector<int64_t> kept;
  kept.reserve(static_cast<size_t>(k));
  size_t di = 0;
  for (int64_t c : candidates) {
    if (di < dropped.size() && dropped[di] == c) {
      ++di;
    } else {
      kept.push_back(c);
    }
  }
  return kept;
}

at::Tensor shared_plan(const std::vector<int64_t>& keep, int64_t num_kv_heads) {
  auto row = at::empty({static_cast<int64_t>(keep.size())}, at::kLong);
  std::copy(keep.begin(), keep.end(), row.data_ptr<int64_t>());
  return row.unsqueeze(0).expand({num_kv_heads, row.size(0)}).contiguous();
}

at::Tensor per_head_plan(const std::vector<std::vector<int64_t>>& keep) {
  KV_INTERNAL_ASSERT(!keep.empty(), "empty per-head plan");
  const auto n = static_cast<int64_t>(keep[0].size());
  auto plan = at::empty({static_cast<int64_t>(keep.size()), n}, at::kLong);
  auto* p = plan.data_ptr<int64_t>();
  for (size_t h = 0; h < keep.size(); ++h) {
    KV_INTERNAL_ASSERT(static_cast<int64_t>(keep[h].size()) == n, "heads keep different counts");
    std::copy(keep[h].begin(), keep[h].end(), p + static_cast<int64_t>(h) * n);
  }
  return plan;
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

struct Registration {
  const ParamTable& (*table)();
  std::function<std::unique_ptr<EvictionPolicy>(const ParsedSpec&, Budget)> make;
};

const std::vector<Registration>& registry() {
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

std::unique_ptr<EvictionPolicy> make_eviction_policy(const std::string& spec) {
  auto [body, budget] = split_budget(spec);
  KV_CHECK_ARG(!body.empty(), "eviction policy spec '", spec, "' has no head");
  const std::string head = split_spec(body)[0];
  for (const auto& reg : registry()) {
    const ParamTable& table = reg.table();
    if (table.head != head) continue;
    auto policy = reg.make(ParsedSpec::parse(body, table), budget);
    // Validates absolute budgets against protected tokens now; fractional ones at reset().
    policy->reset(0, CacheShape{});
    return policy;
  }
  std::ostringstream heads;
  for (const auto& reg : registry()) heads << (heads.tellp() > 0 ? ", " : "") << reg.table().head;
  throw InvalidArgument("unknown eviction policy '" + head + "' in spec '" + spec +
                        "'; registered: " + heads.str());
}

std::vector<ParamTable> registered_policies() {
  std::vector<ParamTable> out;
  for (const auto& reg : registry()) out.push_back(reg.table());
  return out;
}

}  // namespace kvcache
