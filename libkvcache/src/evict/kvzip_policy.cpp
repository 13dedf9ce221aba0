// SPDX-License-Identifier: Apache-2.0
// KVzip (Kim et al., arXiv 2505.23416): query-agnostic eviction scored by a replay of the
// context ("Repeat the previous context exactly." + the context) over the cache: a token's
// score is the max over the replay's queries and the GQA group of its attention probability.
#include <algorithm>
#include <limits>

#include "evict/policies.h"
#include "kvcache/error.h"

namespace kvcache::evict {

const ParamTable& KVzipPolicy::table() {
  static const ParamTable t{
      "kvzip",
      "KVzip (arXiv 2505.23416): query-agnostic; after the context, a replay of 'Repeat the previous context "
      "exactly.' + the context (chunks of c tokens) scores each cached token by its max attention over the replay "
      "queries and the GQA group; per KV head keeps s sinks + the top-scored; costs about one extra prefill "
      "(replay_s)",
      {{"s", "sink tokens always kept", ParamDef::Kind::kInt, 4, 0, 1e9, {}},
       {"c", "context tokens per replay chunk", ParamDef::Kind::kInt, 2048, 1, 1e9, {}}}};
  return t;
}

const char* KVzipPolicy::instruction() { return "Repeat the previous context exactly."; }

KVzipPolicy::KVzipPolicy(const ParsedSpec& spec, Budget budget)
    : ScorerPolicy(spec, budget), sinks_(spec.integer("s")), chunk_(spec.integer("c")) {
  KV_CHECK_ARG(budget.kind != Budget::Kind::kNone, "kvzip needs a budget: 'kvzip@1024' or 'kvzip@50%'");
}

void KVzipPolicy::on_reset() {
  awaiting_ = false;
  done_ = false;
  scores_.assign(static_cast<size_t>(shape().num_layers), {});
  if (budget().kind == Budget::Kind::kFraction && context_length() == 0) return;  // unresolved
  const int64_t b = resolved_budget();
  KV_CHECK(b > sinks_, CapacityError, "kvzip: budget of ", b, " tokens (", budget().to_string(),
           context_length() > 0 ? " of " + std::to_string(context_length()) : std::string(), ") must exceed the ",
           sinks_, " sink tokens it always keeps (plus the newest token)");
}

int64_t KVzipPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  return resolved_budget();
}

ReplayNeed KVzipPolicy::replay_need() const {
  if (done_) return {};
  ReplayNeed n;
  n.chunk = chunk_;
  n.instruction = instruction();
  n.attention.rows = AttentionNeed::kAllRows;
  n.attention.per_row = false;
  n.attention.reduce = AttentionNeed::Reduce::kMax;
  return n;
}

void KVzipPolicy::do_observe(int64_t layer, const AttentionMass& mass) {
  KV_CHECK_ARG(mass.rows == 1, "kvzip.observe: layer ", layer, " got ", mass.rows,
               " attention rows; the replay hands their max (ReplayNeed::attention)");
  auto& acc = scores_.at(static_cast<size_t>(layer));
  if (acc.empty()) {
    acc = mass.heads;
    return;
  }
  for (int64_t h = 0; h < mass.num_kv_heads(); ++h) {
    auto& a = acc[static_cast<size_t>(h)];
    const auto& m = mass.heads[static_cast<size_t>(h)];
    KV_CHECK_ARG(a.size() == m.size(), "kvzip.observe: layer ", layer, " head ", h, " got attention over ", m.size(),
                 " keys after a replay chunk over ", a.size(), " (the cache changed during the replay)");
    for (size_t j = 0; j < a.size(); ++j) a[j] = std::max(a[j], m[j]);
  }
}

std::optional<int64_t> KVzipPolicy::compression_target(const EvictionContext& ctx) const {
  if (done_ || ctx.step == StepKind::kReplay) return std::nullopt;
  if (ctx.step == StepKind::kReplayEnd) {
    const int64_t b = layer_budget(ctx.layer);
    const int64_t reserve = context_length() > ctx.logical_length ? context_length() - ctx.logical_length : 0;
    const int64_t keep = b - reserve;
    KV_CHECK(keep > sinks_, CapacityError, "kvzip: budget of ", b, " tokens (", budget().to_string(), " of ",
             context_length(), ") minus ", reserve, " tokens reserved for decoding leaves ", keep,
             " context tokens; it must exceed the ", sinks_, " sink tokens (plus the newest token)");
    return keep;
  }
  KV_CHECK_ARG(!awaiting_, "eviction policy '", spec(),
               "': the context was not replayed after the prompt's end. KVzip scores the cache by a context replay "
               "that the runner runs (Runner::generate does); a CacheManager driven by hand must run it after "
               "end_step(kPrefillEnd): begin_replay(), append + attend the replay tokens on every layer, "
               "end_step(kReplayEnd)");
  return std::nullopt;  // before the prompt's end (or a stream without one): nothing to compress yet
}

TokenScores KVzipPolicy::score(const EvictionContext& ctx) const {
  const auto& acc = scores_.at(static_cast<size_t>(ctx.layer));
  KV_CHECK_ARG(static_cast<int64_t>(acc.size()) == ctx.num_kv_heads(), "eviction policy '", spec(), "': layer ",
               ctx.layer, " has no replay attention (the replay steps must attend every layer)");
  TokenScores out = acc;
  for (int64_t h = 0; h < ctx.num_kv_heads(); ++h) {
    auto& row = out[static_cast<size_t>(h)];
    KV_CHECK_ARG(static_cast<int64_t>(row.size()) == ctx.resident[static_cast<size_t>(h)], "eviction policy '",
                 spec(), "': layer ", ctx.layer, " head ", h, " has replay scores for ", row.size(),
                 " tokens but holds ", ctx.resident[static_cast<size_t>(h)]);
    const int64_t n = std::min<int64_t>(sinks_, static_cast<int64_t>(row.size()));
    std::fill(row.begin(), row.begin() + n, std::numeric_limits<float>::infinity());
  }
  return out;
}

void KVzipPolicy::on_step_end(const EvictionContext& ctx) {
  const bool last_layer = ctx.layer == shape().num_layers - 1;
  if (ctx.step == StepKind::kPrefillEnd && !done_ && last_layer) awaiting_ = true;
  if (ctx.step == StepKind::kReplayEnd && !done_ && last_layer) {
    awaiting_ = false;
    done_ = true;
    scores_.assign(static_cast<size_t>(shape().num_layers), {});
  }
}

}  // namespace kvcache::evict
