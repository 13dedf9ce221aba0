// SPDX-License-Identifier: Apache-2.0
// Per-layer budgets: `perlayer(<policy>@<budget>*<n>;...)` (docs/policies.md). Consecutive runs of
// layers, each run one policy instance that sees its layers as a model of that many layers (its
// local layers 0..n-1), so every policy's per-layer state and "after the last layer" step logic
// hold unchanged; the runs are one policy (head and fields) with their own budgets, or `full`.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/layer_runs.h"
#include "registry/registry.h"
#include "evict/policies.h"
#include "kvcache/error.h"

namespace kvcache {
namespace {

/// The most layers one run may name.
constexpr int64_t kMaxRunLayers = 1000000;

const ParamTable& per_layer_table() {
  static const ParamTable t{
      "perlayer",
      "per-layer budgets: perlayer(<policy>@<budget>*<n>;...) gives the first n layers the first policy and budget, "
      "the next ones the next (counts summing to the model's layers, '*1' may be left out); the runs are one policy "
      "(head and fields) with their own budgets, or full; each run's policy sees its layers as a whole model",
      {}};
  return t;
}

struct Run {
  std::unique_ptr<EvictionPolicy> policy;
  int64_t first = 0;  ///< global index of the run's first layer
  int64_t count = 1;
};

/// The spec without its budget ("snapkv:w16" of "snapkv:w16@50%").
std::string body_of(const std::string& spec) { return spec.substr(0, spec.find('@')); }

class PerLayerPolicy final : public EvictionPolicy {
 public:
  PerLayerPolicy(std::string canonical, std::vector<Run> runs, std::string text)
      : EvictionPolicy(std::move(canonical), Budget{}), runs_(std::move(runs)), text_(std::move(text)) {
    for (const auto& r : runs_) total_ += r.count;
  }

  int64_t layer_budget(int64_t layer) const override {
    const Run& r = run(layer);
    return r.policy->layer_budget(layer - r.first);
  }

  AttentionNeed attention_need() const override {
    AttentionNeed need;
    for (const auto& r : runs_) {
      const AttentionNeed n = r.policy->attention_need();
      if (!n.any()) continue;
      KV_INTERNAL_ASSERT(!need.any() || (need.rows == n.rows && need.per_row == n.per_row), "policy '", spec(),
                         "': its runs need different attention rows in one step");
      need = n;
    }
    return need;
  }

  QueryNeed query_need() const override {
    QueryNeed need;
    for (const auto& r : runs_) {
      const QueryNeed n = r.policy->query_need();
      if (!n.any()) continue;
      KV_INTERNAL_ASSERT(!need.any() || (need.rows == n.rows && need.pre_rope == n.pre_rope), "policy '", spec(),
                         "': its runs need different query rows in one step");
      need = n;
    }
    return need;
  }

  EvictionPlan plan(const EvictionContext& ctx) const override {
    const Run& r = run(ctx.layer);
    return r.policy->plan(local(ctx, r));
  }

  void on_evicted(int64_t layer, const EvictionPlan& plan) override {
    Run& r = run(layer);
    r.policy->on_evicted(layer - r.first, plan);
  }

  void on_step_end(const EvictionContext& ctx) override {
    Run& r = run(ctx.layer);
    r.policy->on_step_end(local(ctx, r));
  }

 protected:
  void on_reset() override {
    KV_CHECK_ARG(shape().num_layers == total_, "eviction policy '", text_, "': its runs cover ", total_, " layer",
                 total_ == 1 ? "" : "s", " (", counts(), "), the cache has ", shape().num_layers,
                 " (expected counts summing to ", shape().num_layers, ")");
    for (auto& r : runs_) {
      try {
        r.policy->reset(context_length(), CacheShape{r.count, shape().num_q_heads, shape().num_kv_heads});
      } catch (const CapacityError& e) {
        throw CapacityError(detail::str_cat("eviction policy '", text_, "': layers ", r.first, "-",
                                            r.first + r.count - 1, ": ", e.what()));
      }
    }
  }

  void do_persist(PolicyStateIO& io) override {
    for (auto& r : runs_) r.policy->persist(io);  // each run's state, in layer order
  }

  void do_observe(int64_t layer, const AttentionMass& mass) override {
    Run& r = run(layer);
    // The step's need is the runs' common one; a run that needs none (full) ignores it.
    if (r.policy->attention_need().any()) r.policy->observe(layer - r.first, mass);
  }

  void do_observe_queries(int64_t layer, const QueryRows& rows, const LayerView& view) override {
    Run& r = run(layer);
    if (r.policy->query_need().any()) r.policy->observe_queries(layer - r.first, rows, view);
  }

 private:
  const Run& run(int64_t layer) const {
    for (const auto& r : runs_) {
      if (layer >= r.first && layer < r.first + r.count) return r;
    }
    throw InvalidArgument(detail::str_cat("eviction policy '", text_, "': layer ", layer, " out of range [0, ", total_,
                                          ")"));
  }
  Run& run(int64_t layer) { return const_cast<Run&>(static_cast<const PerLayerPolicy&>(*this).run(layer)); }

  static EvictionContext local(const EvictionContext& ctx, const Run& r) {
    EvictionContext c = ctx;
    c.layer = ctx.layer - r.first;
    return c;
  }

  std::string counts() const {
    std::string s;
    for (size_t i = 0; i < runs_.size(); ++i) s += (i ? " + " : "") + std::to_string(runs_[i].count);
    return s;
  }

  std::vector<Run> runs_;
  std::string text_;  ///< as written (errors name the user's text)
  int64_t total_ = 0;
};

}  // namespace

namespace evict {

std::unique_ptr<EvictionPolicy> make_per_layer_policy(const std::string& text) {
  const auto w = split_wrapper(text);
  KV_CHECK_ARG(w.has_value() && w->outer == "perlayer", "eviction policy '", text,
               "': write perlayer(<policy>@<budget>*<n>;...), e.g. 'perlayer(snapkv@25%*12;snapkv@75%*12)'");
  std::vector<Run> runs;
  std::vector<std::string> specs;  // canonical, per run
  std::string common;              // the policy body every non-full run shares
  int64_t total = 0;
  const auto items = detail::split_layer_runs(w->inner);
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string& item = items[i];
    KV_CHECK_ARG(!item.empty(), "eviction policy '", text, "': run ", i + 1,
                 " is empty (expected <policy>@<budget>*<layers> runs separated by ';', e.g. "
                 "'perlayer(snapkv@25%*12;snapkv@75%*12)')");
    const std::string where = detail::str_cat("eviction policy '", text, "': run ", i + 1, " '", item, "'");
    const size_t star = detail::layer_run_star(item);
    Run r;
    const std::string spec = star == std::string::npos ? item : item.substr(0, star);
    if (star != std::string::npos) r.count = parse_integer(item.substr(star + 1), where + ": layer count", 1, kMaxRunLayers);
    KV_CHECK_ARG(!spec.empty(), where, " names no policy before '*' (expected e.g. 'snapkv@50%*12')");
    const std::string head = spec_head(spec);
    KV_CHECK_ARG(head != "perlayer", where, ": a run cannot itself be per-layer (write its runs in place)");
    try {
      r.policy = make_eviction_policy(spec);
    } catch (const CapacityError& e) {
      throw CapacityError(detail::str_cat(where, ": ", e.what()));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat(where, ": ", e.what()));
    }
    KV_CHECK_ARG(!r.policy->replay_need().any(), where, ": '", r.policy->spec(),
                 "' scores by a context replay, which perlayer(...) does not run; give it every layer ('",
                 r.policy->spec(), "')");
    const std::string canonical = r.policy->spec();
    if (spec_head(canonical) != "full") {
      KV_CHECK_ARG(common.empty() || body_of(canonical) == common, where, ": the runs must be one policy with their "
                   "own budgets (or full), but '", body_of(canonical), "' differs from '", common,
                   "' (one step's attention and query rows serve every layer)");
      common = body_of(canonical);
    }
    r.first = total;
    total += r.count;
    KV_CHECK_ARG(total <= kMaxRunLayers, "eviction policy '", text, "': its runs cover more than ", kMaxRunLayers,
                 " layers");
    // Runs are not merged: a policy may depend on how many layers its run has (pyramid's
    // slope, duo's fraction of the run's heads), so a*2;a*2 is not a*4.
    specs.push_back(canonical);
    runs.push_back(std::move(r));
  }
  std::string canonical = "perlayer(";
  for (size_t i = 0; i < runs.size(); ++i) {
    canonical += (i ? ";" : "") + specs[i];
    if (runs[i].count != 1) canonical += "*" + std::to_string(runs[i].count);
  }
  canonical += ")";
  return std::make_unique<PerLayerPolicy>(canonical, std::move(runs), text);
}

}  // namespace evict

namespace registry {

Entry per_layer_policy_entry() {
  Entry e;
  e.kind = SpecKind::kPolicy;
  e.table = &per_layer_table();
  e.wrapper = true;
  // make_eviction_policy builds perlayer(...) itself (its runs carry '@' budgets); this factory
  // is reached only from inside another spec.
  e.policy = [](const ParsedSpec&, Budget) -> std::unique_ptr<EvictionPolicy> {
    throw InvalidArgument(
        "'perlayer(...)' is a whole policy spec: it cannot be wrapped or take a budget of its own (each run carries "
        "its budget, e.g. 'perlayer(snapkv@25%*12;snapkv@75%*12)')");
  };
  return e;
}

}  // namespace registry
}  // namespace kvcache
