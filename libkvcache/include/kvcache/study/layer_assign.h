// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_assign.h
/// Per-layer assignments chosen from a measured per-layer sensitivity: `kv_study layers`.
/// Two kinds of choice per layer:
///   - cache schemes: per-layer mixed precision (KVTuner, ICML 2025, arXiv 2502.04420;
///     methods.md b.13), e.g. K8V4 in some layers and K4V2 elsewhere, under an average-bit
///     budget; the result is a `layers(...)` scheme (kvcache/cache_scheme.h);
///   - eviction policies with their budgets: per-layer token budgets (one policy, e.g.
///     h2o@25% / h2o@75% / full), under an average budget; the result is a `perlayer(...)`
///     policy (docs/policies.md). The KLD pass streams the passage token by token, so the
///     policy must evict while decoding (not SnapKV, PyramidKV, DuoAttention, or Knorm /
///     KeyDiff / Expected Attention compressing `once` at a prompt's end).
///
///  1. Sensitivity: for every layer l and every choice c, the KLD of the model's next-token
///     distributions when only layer l uses c — every other layer the base scheme (schemes:
///     `layers(<base>*l;<c>;<base>*(L-l-1))+full`) or no eviction (policies:
///     `<base>+perlayer(full*l;<c>;full*(L-l-1))`) — against the control arm (fp32+full):
///     DistributionComparison::kld_mean of the evaluator's streaming pass over its evaluation
///     passage (TextEval::stream_logits, the study's KLD metric), in nats.
///  2. Cost of a choice in a layer: a scheme's bits per value, the mean of its K and V formats'
///     Quantizer::bits_per_value(head_dim) in that layer (codes + per-group metadata; the
///     full-precision residual window is not counted: it is the same R tokens whatever the
///     context, and KVTuner's budgets are those nominal bits); a policy's budget, in percent of
///     the request's context (`@25%` costs 25, `full` 100) or in tokens (`@256`: 256), one unit
///     for all choices.
///  3. Assignment: the per-layer choices minimising the sum over layers of the measured
///     sensitivities (the additive model: each layer's damage counted as if alone) subject to
///     the mean over layers of the cost <= the budget. Solved exactly (a multiple-choice
///     knapsack) by dynamic programming over the Pareto frontier of (total cost, total KLD)
///     partial assignments, layer by layer: a partial assignment is dropped only when another
///     costs no more and loses no more, so the optimum survives. Ties: the lower total cost,
///     then the lexicographically smaller choice indices (earlier layers take earlier-listed
///     choices).

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/cache_scheme.h"
#include "kvcache/study/sweep.h"

namespace kvcache::study {

/// What the choices of a profile are.
enum class LayerChoiceKind {
  kScheme,  ///< cache schemes (per-layer mixed precision): cost in bits/value
  kPolicy,  ///< eviction policies with budgets (per-layer budgets): cost in % of context or tokens
};

/// The measured per-layer sensitivity profile.
struct LayerSensitivity {
  std::string model_id;
  LayerChoiceKind kind = LayerChoiceKind::kScheme;
  /// kScheme: canonical scheme of the layers not under test; kPolicy: the scheme of every layer.
  std::string base;
  std::string control;               ///< canonical control arm the KLD is measured against
  std::vector<std::string> choices;  ///< canonical choices, in the user's order
  std::string cost_unit = "bits/value";  ///< "bits/value", "% of context" or "tokens"
  /// [layer][choice] cost of the choice in that layer (point 2 above).
  std::vector<std::vector<double>> cost;
  /// [layer][choice] mean KLD (nats) with only that layer using that choice (point 1).
  std::vector<std::vector<double>> kld;
  double base_kld = 0;    ///< KLD of the base arm (every layer base, no eviction); 0 when it is the control
  int64_t positions = 0;  ///< scored positions of each KLD
};

/// Measures the profile through `evaluator` on its model (ArmEvaluator::geometry()): eval_text
/// once for the control, once for the base arm, once per (layer, choice) (a choice equal to the
/// base, or `full`, reuses the base's KLD). `choices` are all cache schemes or all eviction
/// policies with budgets. `progress` (optional) counts the passes.
/// @throws InvalidArgument if `choices` is empty, mixes schemes and policies, lists a choice
///         twice, names no scheme / policy (as written), a per-layer one, a policy whose budget
///         depends on its run of layers (pyramid, duo) or that compresses only at a prompt's end
///         (snapkv, knorm / keydiff / expected without `:stream`), policies that differ in more than their
///         budget, budgets of both kinds (% and tokens), a policy without a budget, or `full`
///         among token budgets; UnsupportedError if an arm cannot run on the model.
LayerSensitivity measure_layer_sensitivity(ArmEvaluator& evaluator, const std::string& base,
                                           const std::vector<std::string>& choices, Progress* progress = nullptr);

/// One chosen assignment.
struct LayerAssignment {
  std::vector<int64_t> choice;  ///< [layer] index into LayerSensitivity::choices
  double mean_cost = 0;         ///< mean over layers of the chosen costs (LayerSensitivity::cost_unit)
  double predicted_kld = 0;     ///< sum over layers of the chosen sensitivities (nats)
  /// The canonical per-layer spec: a `layers(...)` scheme (layers_scheme_spec) or a
  /// `perlayer(...)` policy (consecutive equal choices in one run).
  std::string spec;
  std::string arm;  ///< the arm that runs it: `<spec>+full` or `<base>+<spec>`
};

/// The exact optimum of point 3 above under `budget` (mean cost over layers, in the profile's
/// unit; a budget within 1e-9 of a mean counts as met).
/// @throws InvalidArgument if the profile is malformed (ragged tables, no layer, a negative or
///         non-finite entry) or no assignment fits `budget` (naming the budget and the smallest
///         mean cost any assignment reaches).
LayerAssignment choose_layer_assignment(const LayerSensitivity& profile, double budget);

/// The profile and the assignment as JSON (keys: model, kind ("scheme" or "policy"), base,
/// control, positions, base_kld, cost_unit, choices [{spec}], layers [{layer, cost[], kld[]}],
/// budget, chosen {spec, arm, mean_cost, predicted_kld, choice[]} and, when measured_kld >= 0,
/// chosen.measured_kld).
std::string layer_assignment_json(const LayerSensitivity& profile, double budget, const LayerAssignment& chosen,
                                  double measured_kld = -1);

/// The same as Markdown: the sensitivity table (one row per layer, one KLD column per choice
/// headed by its layer-0 cost, the chosen cells marked with '*'), then the chosen spec and the
/// command that runs it.
std::string layer_assignment_markdown(const LayerSensitivity& profile, double budget, const LayerAssignment& chosen,
                                      double measured_kld = -1);

/// Writes `dir`/layers.json and `dir`/layers.md (the two renderings above), each atomically
/// (io::write_file_atomic). @throws InvalidArgument naming a path that cannot be written.
void write_layer_assignment_files(const std::string& dir, const LayerSensitivity& profile, double budget,
                                  const LayerAssignment& chosen, double measured_kld = -1);

}  // namespace kvcache::study
