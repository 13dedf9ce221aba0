// SPDX-License-Identifier: Apache-2.0
// Scorer policies (policies.h): the uniform selection every scorer plans with, the once/stream
// schedule of the attention-free scorers, and the two wrappers around any scorer: AdaKV
// (head-wise budgets, arXiv 2407.11550) and decode-time compression (kvpress DecodingPress).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "evict/policies.h"
#include "kvcache/error.h"

namespace kvcache::evict {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

void check_scores(const ScorerPolicy& p, const EvictionContext& ctx, const TokenScores& s) {
  KV_INTERNAL_ASSERT(static_cast<int64_t>(s.size()) == ctx.num_kv_heads(), "policy '", p.spec(), "' scored ",
                     s.size(), " heads of layer ", ctx.layer);
  for (int64_t h = 0; h < ctx.num_kv_heads(); ++h) {
    KV_INTERNAL_ASSERT(static_cast<int64_t>(s[static_cast<size_t>(h)].size()) == ctx.resident[static_cast<size_t>(h)],
                       "policy '", p.spec(), "' scored ", s[static_cast<size_t>(h)].size(), " tokens of layer ",
                       ctx.layer, " head ", h, " which holds ", ctx.resident[static_cast<size_t>(h)]);
  }
}

/// Resets a wrapper's inner policy for a request; errors then name the wrapper's whole spec (at
/// construction, context 0, make_eviction_policy names it instead).
void reset_inner(EvictionPolicy& inner, const EvictionPolicy& outer) {
  if (outer.context_length() == 0) {
    inner.reset(outer.context_length(), outer.shape());
    return;
  }
  try {
    inner.reset(outer.context_length(), outer.shape());
  } catch (const CapacityError& e) {
    throw CapacityError("eviction policy '" + outer.spec() + "': " + e.what());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("eviction policy '" + outer.spec() + "': " + e.what());
  }
}

/// Protected (+inf) tokens of a row.
int64_t count_protected(const std::vector<float>& s) {
  return std::count_if(s.begin(), s.end(), [](float x) { return x == kInf; });
}

}  // namespace

// ---------------------------------------------------------------- ScorerPolicy
bool ScorerPolicy::over_target(const EvictionContext& ctx, int64_t target) const {
  for (int64_t t : ctx.resident) {
    if (t > target) return true;
  }
  return false;
}

EvictionPlan ScorerPolicy::select(const EvictionContext& ctx, int64_t target, TokenScores scores) const {
  check_scores(*this, ctx, scores);
  EvictionPlan p;
  for (int64_t h = 0; h < ctx.num_kv_heads(); ++h) {
    const int64_t t = ctx.resident[static_cast<size_t>(h)];
    if (t <= target) continue;
    auto& s = scores[static_cast<size_t>(h)];
    s[static_cast<size_t>(t - 1)] = kInf;  // the newest token is never evicted
    const int64_t protect = count_protected(s);
    KV_CHECK(protect <= target, CapacityError, "policy '", spec(), "': layer ", ctx.layer, " head ", h, " protects ",
             protect, " tokens but keeps only ", target);
    if (p.evict.empty()) p.evict.resize(static_cast<size_t>(ctx.num_kv_heads()));
    p.evict[static_cast<size_t>(h)] = lowest_k(s.data(), t, t - target);
  }
  return p;
}

const EvictionPolicy& ScorerPolicy::wrapped(const std::unique_ptr<EvictionPolicy>& inner, const char* wrapper) {
  KV_INTERNAL_ASSERT(inner != nullptr, wrapper, " without an inner policy");
  return *inner;
}

EvictionPlan ScorerPolicy::plan(const EvictionContext& ctx) const {
  const std::optional<int64_t> target = compression_target(ctx);
  if (!target || !over_target(ctx, *target)) return {};
  return select(ctx, *target, score(ctx));
}

// ---------------------------------------------------------------- ScheduledScorer
ScheduledScorer::ScheduledScorer(const ParsedSpec& spec, Budget budget, bool stream, const std::string& name)
    : ScorerPolicy(spec, budget), stream_(stream), name_(name) {
  KV_CHECK_ARG(budget.kind != Budget::Kind::kNone, name, " needs a budget: '", name, "@1024' or '", name, "@50%'");
}

void ScheduledScorer::on_reset() {
  prompt_done_ = false;
  layers_done_ = 0;
  if (budget().kind == Budget::Kind::kFraction && context_length() == 0) return;  // unresolved
  const int64_t b = resolved_budget();
  KV_CHECK(b > protected_prefix(), CapacityError, name_, ": budget of ", b, " tokens (", budget().to_string(),
           context_length() > 0 ? " of " + std::to_string(context_length()) : std::string(), ") must exceed the ",
           protected_prefix(), " sink tokens it always keeps (plus the newest token)");
}

int64_t ScheduledScorer::layer_budget(int64_t layer) const {
  (void)layer;
  return resolved_budget();
}

std::optional<int64_t> ScheduledScorer::compression_target(const EvictionContext& ctx) const {
  const int64_t b = layer_budget(ctx.layer);
  if (stream_) return b;
  if (prompt_done_ || !ctx.is_prefill_end()) return std::nullopt;
  // As SnapKV: room for the request's remaining tokens, so the budget holds after the last one.
  const int64_t reserve = context_length() > ctx.logical_length ? context_length() - ctx.logical_length : 0;
  const int64_t keep = b - reserve;
  KV_CHECK(keep > protected_prefix(), CapacityError, name_, ": budget of ", b, " tokens (", budget().to_string(),
           " of ", context_length(), ") minus ", reserve, " tokens reserved for decoding leaves ", keep,
           " prompt tokens; it must exceed the ", protected_prefix(), " sink tokens (plus the newest token)");
  return keep;
}

void ScheduledScorer::on_step_end(const EvictionContext& ctx) {
  if (stream_ || prompt_done_ || !ctx.is_prefill_end()) return;
  if (++layers_done_ >= shape().num_layers) prompt_done_ = true;
}

// ---------------------------------------------------------------- AdaKV
const ParamTable& AdaKVPolicy::table() {
  static const ParamTable t{
      "adakv",
      "AdaKV (arXiv 2407.11550): head-wise budgets over any scorer: a floor of a*n top tokens per head, the rest of "
      "the layer's H_kv*n to its globally top (head, token) pairs; heads really hold different numbers of tokens. "
      "Spec: adakv[:a<alpha>]:<scorer spec>@B, e.g. adakv:snapkv@50%",
      {{"a", "alpha: floor per head as a fraction of the uniform count n", ParamDef::Kind::kFloat, 0.2, 0, 1, {}}}};
  return t;
}

AdaKVPolicy::AdaKVPolicy(const ParsedSpec& spec, Budget budget, std::unique_ptr<EvictionPolicy> inner)
    : ScorerPolicy(spec, budget, wrapped(inner, "adakv")), alpha_(spec.num("a")) {
  auto* scorer = dynamic_cast<ScorerPolicy*>(inner.get());
  KV_CHECK_ARG(scorer != nullptr, "adakv wraps a scorer (h2o, snapkv, pyramid, tova, knorm, keydiff, expected, kvzip, or "
               "decode:...:<scorer>); '", inner->spec(), "' keeps tokens by position and has no per-token scores");
  KV_CHECK_ARG(!scorer->head_wise(), "adakv around '", inner->spec(), "', which is already head-wise");
  (void)inner.release();
  inner_.reset(scorer);
}

void AdaKVPolicy::on_reset() { reset_inner(*inner_, *this); }

bool AdaKVPolicy::over_target(const EvictionContext& ctx, int64_t target) const {
  const int64_t total = std::accumulate(ctx.resident.begin(), ctx.resident.end(), int64_t{0});
  return total > target * ctx.num_kv_heads();
}

EvictionPlan AdaKVPolicy::select(const EvictionContext& ctx, int64_t target, TokenScores scores) const {
  check_scores(*this, ctx, scores);
  const int64_t hkv = ctx.num_kv_heads();
  const int64_t total = std::accumulate(ctx.resident.begin(), ctx.resident.end(), int64_t{0});
  const int64_t evict_n = total - target * hkv;
  if (evict_n <= 0) return {};
  // The floor: every head keeps its ⌊α·n⌋ best (kvpress int(n_kept · α); ties: the more recent).
  const auto floor_n = static_cast<int64_t>(std::floor(alpha_ * static_cast<double>(target) + 1e-9));
  struct Cand {
    float score;
    int64_t age;  ///< tokens after it in its head (older = larger)
    int64_t head, index;
  };
  std::vector<Cand> cand;
  cand.reserve(static_cast<size_t>(total));
  for (int64_t h = 0; h < hkv; ++h) {
    const int64_t t = ctx.resident[static_cast<size_t>(h)];
    if (t == 0) continue;
    auto& s = scores[static_cast<size_t>(h)];
    s[static_cast<size_t>(t - 1)] = kInf;  // the newest token is never evicted
    if (floor_n > 0 && t > floor_n) {
      // Everything outside the head's top floor_n stays a candidate; the floor becomes protected.
      const std::vector<int64_t> rest = lowest_k(s.data(), t, t - floor_n);
      std::vector<bool> is_rest(static_cast<size_t>(t), false);
      for (int64_t i : rest) is_rest[static_cast<size_t>(i)] = true;
      for (int64_t i = 0; i < t; ++i) {
        if (!is_rest[static_cast<size_t>(i)]) s[static_cast<size_t>(i)] = kInf;
      }
    } else if (floor_n > 0) {
      std::fill(s.begin(), s.end(), kInf);
    }
    for (int64_t i = 0; i < t; ++i) {
      if (s[static_cast<size_t>(i)] != kInf) cand.push_back({s[static_cast<size_t>(i)], t - 1 - i, h, i});
    }
  }
  KV_CHECK(static_cast<int64_t>(cand.size()) >= evict_n, CapacityError, "policy '", spec(), "': layer ", ctx.layer,
           " must evict ", evict_n, " of its ", total, " tokens to keep ", target, " per head on average, but only ",
           cand.size(), " are neither protected nor in a head's floor of ", floor_n);
  // Globally lowest first; ties: the older token first, then the lower head.
  auto worse = [](const Cand& a, const Cand& b) {
    if (a.score != b.score) return a.score < b.score;
    if (a.age != b.age) return a.age > b.age;
    return a.head < b.head;
  };
  if (evict_n < static_cast<int64_t>(cand.size())) {
    std::nth_element(cand.begin(), cand.begin() + (evict_n - 1), cand.end(), worse);
    cand.resize(static_cast<size_t>(evict_n));
  }
  EvictionPlan p;
  p.evict.resize(static_cast<size_t>(hkv));
  for (const Cand& c : cand) p.evict[static_cast<size_t>(c.head)].push_back(c.index);
  for (auto& e : p.evict) std::sort(e.begin(), e.end());
  return p;
}

// ---------------------------------------------------------------- decode-time compression
const ParamTable& DecodeCompressionPolicy::table() {
  static const ParamTable t{
      "decode",
      "decode-time compression (kvpress DecodingPress): every i decoded tokens, compress back to the budget with the "
      "wrapped scorer, keeping the newest b; 'prefill' also compresses at the prompt's end. Spec: "
      "decode[:i<N>][:b<N>][:prefill]:<scorer spec>@B, e.g. decode:i512:b256:expected@2048",
      {{"i", "interval: decoded tokens between compressions", ParamDef::Kind::kInt, 512, 1, 1e9, {}},
       {"b", "buffer: newest tokens always kept at a compression", ParamDef::Kind::kInt, 256, 0, 1e9, {}},
       {"when", "also compress at the end of the prompt", ParamDef::Kind::kChoice, 0, 0, 0, {"decodeonly", "prefill"}}}};
  return t;
}

DecodeCompressionPolicy::DecodeCompressionPolicy(const ParsedSpec& spec, Budget budget,
                                                 std::unique_ptr<EvictionPolicy> inner)
    : ScorerPolicy(spec, budget, wrapped(inner, "decode")),
      interval_(spec.integer("i")),
      buffer_(spec.integer("b")),
      prefill_(spec.choice("when") == "prefill") {
  KV_CHECK_ARG(budget.kind != Budget::Kind::kNone, "decode needs a budget, the target it compresses back to: "
               "'decode:i512:b256:knorm@2048' or '...@50%'");
  auto* scorer = dynamic_cast<ScorerPolicy*>(inner.get());
  KV_CHECK_ARG(scorer != nullptr, "decode wraps a scorer (h2o, tova, knorm, keydiff, expected, or adakv:<scorer>); '",
               inner->spec(), "' keeps tokens by position and has no per-token scores");
  KV_CHECK_ARG(!scorer->decode_scheduled(), "decode around '", inner->spec(),
               "', which already compresses on a decode-time schedule");
  KV_CHECK_ARG(scorer->scores_any_step(), "decode compresses during decoding, but '", inner->spec(),
               "' scores only at the end of the prompt (its observation window or context replay); wrap h2o, tova, knorm, "
               "keydiff or "
               "expected");
  (void)inner.release();
  inner_.reset(scorer);
}

void DecodeCompressionPolicy::on_reset() {
  reset_inner(*inner_, *this);
  since_.assign(static_cast<size_t>(shape().num_layers), 0);
  if (budget().kind == Budget::Kind::kFraction && context_length() == 0) return;  // unresolved
  const int64_t b = resolved_budget();
  KV_CHECK(b > buffer_, CapacityError, "decode: target of ", b, " tokens (", budget().to_string(),
           context_length() > 0 ? " of " + std::to_string(context_length()) : std::string(),
           ") must exceed the b", buffer_, " newest tokens it keeps");
}

int64_t DecodeCompressionPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  return resolved_budget();
}

bool DecodeCompressionPolicy::due(const EvictionContext& ctx) const {
  if (ctx.is_prefill_end()) return prefill_;
  return ctx.step == StepKind::kDecode && since_.at(static_cast<size_t>(ctx.layer)) + ctx.new_tokens >= interval_;
}

std::optional<int64_t> DecodeCompressionPolicy::compression_target(const EvictionContext& ctx) const {
  if (!due(ctx)) return std::nullopt;
  return layer_budget(ctx.layer);
}

TokenScores DecodeCompressionPolicy::score(const EvictionContext& ctx) const {
  TokenScores s = inner_->score(ctx);
  for (size_t h = 0; h < s.size(); ++h) {
    auto& row = s[h];
    const int64_t t = static_cast<int64_t>(row.size());
    for (int64_t i = std::max<int64_t>(0, t - buffer_); i < t; ++i) row[static_cast<size_t>(i)] = kInf;
  }
  return s;
}

void DecodeCompressionPolicy::on_step_end(const EvictionContext& ctx) {
  inner_->on_step_end(ctx);
  if (ctx.step != StepKind::kDecode) return;
  auto& n = since_.at(static_cast<size_t>(ctx.layer));
  n = due(ctx) ? 0 : n + ctx.new_tokens;
}

}  // namespace kvcache::evict
