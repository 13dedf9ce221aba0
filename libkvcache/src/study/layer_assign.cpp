// SPDX-License-Identifier: Apache-2.0
// Per-layer sensitivity and the exact per-layer assignment (kvcache/study/layer_assign.h).
#include "kvcache/study/layer_assign.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/file_io.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/registry.h"
#include "kvcache/spec.h"
#include "kvcache/study/metrics.h"
#include "kvcache/study/progress.h"

namespace kvcache::study {
namespace {

/// Mean bits per value of the stored K and V formats of `scheme` in `layer`.
double layer_bits(const CacheScheme& scheme, const CacheGeometry& g, int64_t layer) {
  const LayerStreams s = scheme.streams(g, layer, 0);
  return 0.5 * (s.key.quantizer->bits_per_value(g.head_dim) + s.value.quantizer->bits_per_value(g.head_dim));
}

std::string fmt(double v, const char* f) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

/// The spec without its budget ("snapkv:w16" of "snapkv:w16@50%").
std::string body_of(const std::string& spec) { return spec.substr(0, spec.find('@')); }

/// The canonical perlayer(...) policy giving layer l `per_layer[l]`, equal neighbours in one run.
std::string per_layer_policy_spec(const std::vector<std::string>& per_layer) {
  std::string s = "perlayer(";
  for (size_t i = 0; i < per_layer.size();) {
    size_t j = i;
    while (j < per_layer.size() && per_layer[j] == per_layer[i]) ++j;
    s += (i ? ";" : "") + per_layer[i];
    if (j - i != 1) s += "*" + std::to_string(j - i);
    i = j;
  }
  return make_eviction_policy(s + ")")->spec();
}

const char* kind_name(LayerChoiceKind k) { return k == LayerChoiceKind::kScheme ? "scheme" : "policy"; }

void check_profile(const LayerSensitivity& p) {
  const size_t layers = p.kld.size();
  const size_t choices = p.choices.size();
  KV_CHECK_ARG(layers >= 1, "layer sensitivity profile has no layer");
  KV_CHECK_ARG(choices >= 1, "layer sensitivity profile has no choice");
  KV_CHECK_ARG(p.cost.size() == layers, "layer sensitivity profile: ", p.cost.size(), " rows of costs for ", layers,
               " rows of KLD (expected one per layer)");
  for (size_t l = 0; l < layers; ++l) {
    KV_CHECK_ARG(p.kld[l].size() == choices && p.cost[l].size() == choices, "layer sensitivity profile: layer ", l,
                 " has ", p.kld[l].size(), " KLD and ", p.cost[l].size(), " cost entries (expected ", choices,
                 ", one per choice)");
    for (size_t c = 0; c < choices; ++c) {
      KV_CHECK_ARG(std::isfinite(p.kld[l][c]) && p.kld[l][c] >= 0, "layer sensitivity profile: layer ", l, " choice '",
                   p.choices[c], "' has KLD ", p.kld[l][c], " (expected a finite value >= 0)");
      KV_CHECK_ARG(std::isfinite(p.cost[l][c]) && p.cost[l][c] > 0, "layer sensitivity profile: layer ", l,
                   " choice '", p.choices[c], "' costs ", p.cost[l][c], " ", p.cost_unit,
                   " (expected a finite value > 0)");
    }
  }
}

/// The per-layer spec (scheme or policy) giving layer l choice `pick[l]`.
std::string assignment_spec(const LayerSensitivity& p, const std::vector<std::string>& per_layer) {
  return p.kind == LayerChoiceKind::kScheme ? layers_scheme_spec(per_layer) : per_layer_policy_spec(per_layer);
}

/// The arm of a per-layer spec.
Arm assignment_arm(const LayerSensitivity& p, const std::string& spec) {
  return p.kind == LayerChoiceKind::kScheme ? Arm{spec, "full"} : Arm{p.base, spec};
}

/// Policy choices: canonical specs, their costs and unit. @throws InvalidArgument (see the header).
void policy_choices(const std::vector<std::string>& choices, LayerSensitivity* p) {
  std::string common;
  int kind = 0;  // 1: fractions, 2: tokens
  std::vector<double> cost;
  for (const auto& c : choices) {
    KV_CHECK_ARG(spec_kind(c) == SpecKind::kPolicy, "layer sensitivity: choice '", c,
                 "' is no eviction policy (the choices are all cache schemes or all policies with budgets)");
    const std::string head = spec_head(c);
    KV_CHECK_ARG(head != "perlayer", "layer sensitivity: choice '", c,
                 "' is a per-layer policy (expected one policy with its budget per choice, e.g. 'snapkv@25%')");
    KV_CHECK_ARG(head != "pyramid" && head != "duo", "layer sensitivity: choice '", c, "': ", head,
                 " sets budgets across a run of layers (PyramidKV's slope, DuoAttention's streaming heads), so one "
                 "layer's measurement does not carry over to a run");
    const auto policy = make_eviction_policy(c);
    const std::string canonical = policy->spec();
    // The KLD pass streams the passage token by token (decode steps only): a policy that
    // compresses once at a prompt's end never acts there, and its sensitivity would read 0.
    const bool prompt_end_only =
        canonical.find("snapkv") != std::string::npos ||
        ((canonical.find("knorm") != std::string::npos || canonical.find("keydiff") != std::string::npos ||
          canonical.find("expected") != std::string::npos) &&
         canonical.find(":stream") == std::string::npos && head != "decode");
    KV_CHECK_ARG(!prompt_end_only, "layer sensitivity: choice '", c,
                 "' compresses once at the end of a prompt, which the KLD pass (the passage streamed token by token) "
                 "never reaches; choose a policy that evicts while decoding (h2o, tova, window, sink, random, "
                 "knorm:stream, keydiff:stream, expected:stream, decode:...)");
    KV_CHECK_ARG(std::find(p->choices.begin(), p->choices.end(), canonical) == p->choices.end(),
                 "layer sensitivity: choice '", c, "' is listed twice (as '", canonical, "')");
    p->choices.push_back(canonical);
    if (head == "full") {
      KV_CHECK_ARG(kind != 2, "layer sensitivity: choice 'full' among token budgets (a full layer's tokens depend on "
                              "the request: use budgets in %, where full costs 100)");
      kind = 1;
      cost.push_back(100.0);
      continue;
    }
    const Budget& b = policy->budget();
    KV_CHECK_ARG(b.kind != Budget::Kind::kNone, "layer sensitivity: choice '", c, "' has no budget (expected e.g. '",
                 c, "@50%')");
    const int k = b.kind == Budget::Kind::kFraction ? 1 : 2;
    KV_CHECK_ARG(kind == 0 || kind == k, "layer sensitivity: choice '", c, "' budgets ",
                 k == 1 ? "a percentage" : "tokens", " where the others budget ", kind == 1 ? "percentages" : "tokens",
                 " (one unit for every choice)");
    kind = k;
    KV_CHECK_ARG(common.empty() || body_of(canonical) == common, "layer sensitivity: choice '", c, "' is '",
                 body_of(canonical), "', the others '", common,
                 "' (the choices are one policy with different budgets, or full)");
    common = body_of(canonical);
    cost.push_back(k == 1 ? b.value * 100.0 : b.value);
  }
  p->cost_unit = kind == 2 ? "tokens" : "% of context";
  p->cost.assign(p->cost.size(), cost);
}

}  // namespace

LayerSensitivity measure_layer_sensitivity(ArmEvaluator& evaluator, const std::string& base,
                                           const std::vector<std::string>& choices, Progress* progress) {
  KV_CHECK_ARG(!choices.empty(), "layer sensitivity: no choice (expected cache schemes, e.g. "
                                 "'kivi:k8:v4:g32:r128,kivi:k4:v2:g32:r128', or one policy with budgets, e.g. "
                                 "'h2o@25%,h2o@75%,full')");
  const CacheGeometry geometry = evaluator.geometry();
  KV_CHECK_ARG(geometry.num_layers >= 1, "layer sensitivity: the model has ", geometry.num_layers, " layers");
  const int64_t L = geometry.num_layers;
  LayerSensitivity p;
  p.model_id = evaluator.model_id();
  p.kind = spec_kind(choices[0]) == SpecKind::kPolicy ? LayerChoiceKind::kPolicy : LayerChoiceKind::kScheme;
  p.base = make_cache_scheme(base)->spec();
  KV_CHECK_ARG(p.kind == LayerChoiceKind::kPolicy || spec_head(p.base) != "layers", "layer sensitivity: base '", base,
               "' is a per-layer scheme (expected one scheme for the layers not under test, e.g. 'fp32')");
  p.cost.assign(static_cast<size_t>(L), {});
  if (p.kind == LayerChoiceKind::kPolicy) {
    policy_choices(choices, &p);
  } else {
    std::vector<std::unique_ptr<CacheScheme>> schemes;
    for (const auto& c : choices) {
      KV_CHECK_ARG(spec_kind(c) != SpecKind::kPolicy, "layer sensitivity: choice '", c,
                   "' is an eviction policy (the choices are all cache schemes or all policies with budgets)");
      auto s = make_cache_scheme(c);
      KV_CHECK_ARG(spec_head(s->spec()) != "layers", "layer sensitivity: choice '", c,
                   "' is a per-layer scheme (expected one scheme per choice, e.g. 'kivi:k4:v2:g32:r128')");
      KV_CHECK_ARG(std::find(p.choices.begin(), p.choices.end(), s->spec()) == p.choices.end(),
                   "layer sensitivity: choice '", c, "' is listed twice (as '", s->spec(), "')");
      p.choices.push_back(s->spec());
      schemes.push_back(std::move(s));
    }
    for (int64_t l = 0; l < L; ++l) {
      for (const auto& s : schemes) p.cost[static_cast<size_t>(l)].push_back(layer_bits(*s, geometry, l));
    }
  }
  const size_t C = p.choices.size();
  p.kld.assign(static_cast<size_t>(L), std::vector<double>(C));
  if (progress != nullptr) progress->set_total(2 + L * static_cast<int64_t>(C));
  const Arm control = evaluator.canonicalize(control_arm());
  p.control = control.spec();
  const TextEval ref = evaluator.eval_text(control);
  if (progress != nullptr) progress->done(p.control);
  auto kld_of = [&](const Arm& arm) {
    const TextEval te = evaluator.eval_text(evaluator.canonicalize(arm));
    const DistributionComparison d = compare_logits(ref.stream_logits, te.stream_logits);
    p.positions = d.positions;
    return d.kld_mean;
  };
  const Arm base_arm{p.base, "full"};
  p.base_kld = kld_of(base_arm);
  if (progress != nullptr) progress->done(base_arm.spec());
  // What the layers not under test use: the base scheme, or no eviction.
  const std::string rest = p.kind == LayerChoiceKind::kScheme ? p.base : "full";
  for (int64_t l = 0; l < L; ++l) {
    for (size_t c = 0; c < C; ++c) {
      double& out = p.kld[static_cast<size_t>(l)][c];
      if (p.choices[c] == rest) {
        out = p.base_kld;  // the base arm itself
      } else {
        std::vector<std::string> per_layer(static_cast<size_t>(L), rest);
        per_layer[static_cast<size_t>(l)] = p.choices[c];
        out = kld_of(assignment_arm(p, assignment_spec(p, per_layer)));
      }
      if (progress != nullptr) progress->done("layer " + std::to_string(l) + " " + p.choices[c]);
    }
  }
  if (progress != nullptr) progress->finish();
  return p;
}

LayerAssignment choose_layer_assignment(const LayerSensitivity& profile, double budget) {
  check_profile(profile);
  KV_CHECK_ARG(std::isfinite(budget) && budget > 0, "the average budget must be a finite number > 0, got ", budget);
  const size_t L = profile.kld.size();
  const size_t C = profile.choices.size();
  const double limit = budget * static_cast<double>(L) + 1e-9 * static_cast<double>(L);
  // min_rest[l]: the least cost layers l.. can add (prunes partial assignments that cannot fit).
  std::vector<double> min_rest(L + 1, 0.0);
  for (size_t l = L; l-- > 0;) {
    min_rest[l] = min_rest[l + 1] + *std::min_element(profile.cost[l].begin(), profile.cost[l].end());
  }
  if (min_rest[0] > limit) {
    std::string names;
    for (const auto& c : profile.choices) names += (names.empty() ? "" : ", ") + c;
    throw InvalidArgument(detail::str_cat("no per-layer assignment fits an average of ", budget, " ",
                                          profile.cost_unit, ": the cheapest choices average ",
                                          min_rest[0] / static_cast<double>(L), " ", profile.cost_unit,
                                          " (choices: ", names, ")"));
  }
  struct Partial {
    double cost = 0;
    double loss = 0;
    std::vector<int64_t> pick;
  };
  std::vector<Partial> front(1);
  for (size_t l = 0; l < L; ++l) {
    std::vector<Partial> next;
    next.reserve(front.size() * C);
    for (const auto& p : front) {
      for (size_t c = 0; c < C; ++c) {
        Partial q;
        q.cost = p.cost + profile.cost[l][c];
        if (q.cost + min_rest[l + 1] > limit) continue;  // cannot fit whatever follows
        q.loss = p.loss + profile.kld[l][c];
        q.pick = p.pick;
        q.pick.push_back(static_cast<int64_t>(c));
        next.push_back(std::move(q));
      }
    }
    std::sort(next.begin(), next.end(), [](const Partial& a, const Partial& b) {
      if (a.cost != b.cost) return a.cost < b.cost;
      if (a.loss != b.loss) return a.loss < b.loss;
      return a.pick < b.pick;
    });
    // The Pareto frontier: keep a partial assignment only if it loses strictly less than every
    // one that costs no more (those come before it in this order).
    front.clear();
    double best = std::numeric_limits<double>::infinity();
    for (auto& q : next) {
      if (q.loss < best) {
        best = q.loss;
        front.push_back(std::move(q));
      }
    }
    KV_INTERNAL_ASSERT(!front.empty(), "layer assignment: no partial assignment survives layer ", l);
  }
  // The frontier's last entry loses least (losses fall along it as the cost grows).
  const Partial& best = front.back();
  LayerAssignment a;
  a.choice = best.pick;
  a.mean_cost = best.cost / static_cast<double>(L);
  a.predicted_kld = best.loss;
  std::vector<std::string> per_layer;
  for (int64_t c : a.choice) per_layer.push_back(profile.choices[static_cast<size_t>(c)]);
  a.spec = assignment_spec(profile, per_layer);
  a.arm = assignment_arm(profile, a.spec).spec();
  return a;
}

std::string layer_assignment_json(const LayerSensitivity& p, double budget, const LayerAssignment& chosen,
                                  double measured_kld) {
  using oj = nlohmann::ordered_json;
  oj j;
  j["model"] = p.model_id;
  j["kind"] = kind_name(p.kind);
  j["base"] = p.base;
  j["control"] = p.control;
  j["positions"] = p.positions;
  j["base_kld"] = p.base_kld;
  j["cost_unit"] = p.cost_unit;
  oj choices = oj::array();
  for (const auto& c : p.choices) choices.push_back(oj{{"spec", c}});
  j["choices"] = choices;
  oj layers = oj::array();
  for (size_t l = 0; l < p.kld.size(); ++l) layers.push_back(oj{{"layer", l}, {"cost", p.cost[l]}, {"kld", p.kld[l]}});
  j["layers"] = layers;
  j["budget"] = budget;
  oj c{{"spec", chosen.spec},
       {"arm", chosen.arm},
       {"mean_cost", chosen.mean_cost},
       {"predicted_kld", chosen.predicted_kld},
       {"choice", chosen.choice}};
  if (measured_kld >= 0) c["measured_kld"] = measured_kld;
  j["chosen"] = c;
  return j.dump(2) + "\n";
}

std::string layer_assignment_markdown(const LayerSensitivity& p, double budget, const LayerAssignment& chosen,
                                      double measured_kld) {
  std::ostringstream os;
  const bool schemes = p.kind == LayerChoiceKind::kScheme;
  const char* unit = p.cost_unit == "bits/value" ? " b" : p.cost_unit == "tokens" ? " tokens" : "%";
  os << "Per-layer sensitivity of " << p.model_id << ": mean KLD (nats, " << p.positions << " positions) vs "
     << p.control << " with only that layer using the choice, every other layer "
     << (schemes ? p.base : "full (no eviction), scheme " + p.base) << " (" << p.base << "+full: "
     << fmt(p.base_kld, "%.4g") << "); * = chosen\n\n| layer |";
  for (size_t c = 0; c < p.choices.size(); ++c) os << " " << p.choices[c] << " (" << fmt(p.cost[0][c], "%g") << unit << ") |";
  os << "\n|---:|";
  for (size_t c = 0; c < p.choices.size(); ++c) os << "---:|";
  os << "\n";
  for (size_t l = 0; l < p.kld.size(); ++l) {
    os << "| " << l << " |";
    for (size_t c = 0; c < p.choices.size(); ++c) {
      os << " " << fmt(p.kld[l][c], "%.4g") << (chosen.choice[l] == static_cast<int64_t>(c) ? " *" : "") << " |";
    }
    os << "\n";
  }
  // Specs in backticks: their '*' counts would read as Markdown emphasis.
  os << "\nChosen under an average of " << fmt(budget, "%g") << " " << p.cost_unit << " (exact knapsack): `"
     << chosen.spec << "`\nmean " << fmt(chosen.mean_cost, "%.4f") << " " << p.cost_unit
     << ", predicted KLD (sum over layers) " << fmt(chosen.predicted_kld, "%.4g");
  if (measured_kld >= 0) os << ", measured KLD " << fmt(measured_kld, "%.4g");
  os << "\nRun it: `kv_study run --configs '" << chosen.arm << "'`\n";
  return os.str();
}

void write_layer_assignment_files(const std::string& dir, const LayerSensitivity& profile, double budget,
                                  const LayerAssignment& chosen, double measured_kld) {
  io::write_file_atomic(dir + "/layers.json", layer_assignment_json(profile, budget, chosen, measured_kld));
  io::write_file_atomic(dir + "/layers.md", layer_assignment_markdown(profile, budget, chosen, measured_kld));
}

}  // namespace kvcache::study
