// SPDX-License-Identifier: Apache-2.0
// Positional policies: full, window (most recent N), sink (StreamingLLM, arXiv 2309.17453).
// They need no attention and keep the same tokens in every KV head.
#include <limits>
#include <string>

#include "evict/policies.h"
#include "kvcache/error.h"

namespace kvcache::evict {

// ---------------------------------------------------------------- full
const ParamTable& FullPolicy::table() {
  static const ParamTable t{"full", "keep every token (no eviction)", {}};
  return t;
}

FullPolicy::FullPolicy(const ParsedSpec& spec, Budget budget) : EvictionPolicy(spec, budget) {
  KV_CHECK_ARG(budget.kind == Budget::Kind::kNone, "policy 'full' takes no budget, got '",
               budget.to_string(), "' (use e.g. 'window", budget.to_string(), "')");
}

int64_t FullPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  return context_length() > 0 ? context_length() : std::numeric_limits<int64_t>::max();
}

EvictionPlan FullPolicy::plan(const EvictionContext& ctx) const {
  (void)ctx;
  return {};
}

// ---------------------------------------------------------------- window
const ParamTable& WindowPolicy::table() {
  static const ParamTable t{
      "window",
      "keep the w most recent tokens (w defaults to the budget)",
      {{"w", "recent window in tokens (-1 = the budget)", ParamDef::Kind::kInt, -1, -1, 1e9, {}}}};
  return t;
}

WindowPolicy::WindowPolicy(const ParsedSpec& spec, Budget budget)
    : EvictionPolicy(spec, budget), w_param_(spec.integer("w")) {
  KV_CHECK_ARG(w_param_ != 0, "window: w0 keeps nothing; the newest token is always kept (w >= 1)");
  KV_CHECK_ARG(w_param_ > 0 || budget.kind != Budget::Kind::kNone,
               "window needs a size: 'window:w<N>' or a budget 'window@<N>' / 'window@<P>%'");
}

void WindowPolicy::on_reset() {
  if (budget().kind == Budget::Kind::kFraction && context_length() == 0) {
    window_ = w_param_;  // unresolved until a real reset
    return;
  }
  if (w_param_ > 0 && budget().kind != Budget::Kind::kNone) {
    KV_CHECK(w_param_ <= resolved_budget(), CapacityError, "window: w", w_param_,
             " exceeds the budget of ", resolved_budget(), " tokens (", budget().to_string(),
             context_length() > 0 ? " of " + std::to_string(context_length()) : std::string(), ")");
  }
  window_ = w_param_ > 0 ? w_param_ : resolved_budget();
}

int64_t WindowPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  if (w_param_ <= 0) (void)resolved_budget();  // throws if unresolved
  return window_;
}

EvictionPlan WindowPolicy::plan(const EvictionContext& ctx) const {
  return evict_span(ctx, /*first=*/0, layer_budget(ctx.layer));  // the oldest t − w
}

// ---------------------------------------------------------------- sink
const ParamTable& SinkPolicy::table() {
  static const ParamTable t{
      "sink",
      "StreamingLLM (arXiv 2309.17453): s attention-sink tokens + the w most recent",
      {{"s", "sink tokens kept at the start", ParamDef::Kind::kInt, 4, 0, 1e9, {}},
       {"w", "recent window in tokens (-1 = budget - s)", ParamDef::Kind::kInt, -1, -1, 1e9, {}}}};
  return t;
}

SinkPolicy::SinkPolicy(const ParsedSpec& spec, Budget budget)
    : EvictionPolicy(spec, budget), sinks_(spec.integer("s")), w_param_(spec.integer("w")) {
  KV_CHECK_ARG(w_param_ != 0, "sink: w0 would evict the newest token; the window must be >= 1");
  KV_CHECK_ARG(w_param_ > 0 || budget.kind != Budget::Kind::kNone,
               "sink needs a window or a budget: 'sink:s4:w508' or 'sink:s4@512' / 'sink@50%'");
}

void SinkPolicy::on_reset() {
  if (budget().kind == Budget::Kind::kFraction && context_length() == 0) {
    window_ = w_param_;
    return;
  }
  if (budget().kind == Budget::Kind::kNone) {
    window_ = w_param_;
    return;
  }
  const int64_t b = resolved_budget();
  if (w_param_ > 0) {
    KV_CHECK(sinks_ + w_param_ <= b, CapacityError, "sink: budget of ", b, " tokens (",
             budget().to_string(), context_length() > 0 ? " of " : "",
             context_length() > 0 ? std::to_string(context_length()) : "", ") is smaller than ",
             sinks_, " sinks + ", w_param_, " window = ", sinks_ + w_param_);
    window_ = w_param_;
  } else {
    KV_CHECK(b > sinks_, CapacityError, "sink: budget of ", b, " tokens (", budget().to_string(),
             context_length() > 0 ? " of " : "",
             context_length() > 0 ? std::to_string(context_length()) : "",
             ") leaves no recent window after ", sinks_,
             " sinks; need at least sinks + 1 = ", sinks_ + 1);
    window_ = b - sinks_;
  }
}

int64_t SinkPolicy::layer_budget(int64_t layer) const {
  (void)layer;
  if (w_param_ <= 0) (void)resolved_budget();
  return sinks_ + window_;
}

EvictionPlan SinkPolicy::plan(const EvictionContext& ctx) const {
  return evict_span(ctx, /*first=*/sinks_, layer_budget(ctx.layer));  // between sinks and window
}

}  // namespace kvcache::evict
