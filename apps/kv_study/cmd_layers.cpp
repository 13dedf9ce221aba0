// SPDX-License-Identifier: Apache-2.0
// kv_study layers: per-layer sensitivity and the per-layer assignment (mixed precision under an
// average-bit budget, or per-layer token budgets under an average budget;
// kvcache/study/layer_assign.h).
#include <unistd.h>

#include <iostream>

#include "commands.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/registry.h"
#include "kvcache/spec.h"
#include "kvcache/study/layer_assign.h"
#include "kvcache/study/metrics.h"
#include "kvcache/study/progress.h"

namespace kv_study {

using namespace kvcache::study;

void add_layers_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "layers",
      "Per-layer assignment from a measured per-layer sensitivity: the KLD vs fp32+full of the streaming pass over\n"
      "the evaluation passage when only that layer uses a choice. The choices are cache schemes (per-layer mixed\n"
      "precision, KVTuner arXiv 2502.04420; budget --avg-bits: mean bits/value of K and V codes + metadata) or one\n"
      "eviction policy with budgets (per-layer budgets, e.g. snapkv@25%,snapkv@75%,full; budget --avg-budget: mean\n"
      "budget in % of the context, or tokens). The assignment of least summed KLD within the budget is exact\n"
      "(knapsack). Writes OUT/layers.json and OUT/layers.md, prints the table, the chosen spec and the arm that\n"
      "runs it, and measures the chosen arm's own KLD.\n"
      "Example: kv_study layers --choices kivi:k8:v4:g32:r128,kivi:k4:v2:g32:r128 --avg-bits 4 --out runs/layers");
  auto model = std::make_shared<std::string>(kDefaultModel);
  auto out = std::make_shared<std::string>();
  auto choices = std::make_shared<std::string>();
  auto base = std::make_shared<std::string>("fp32");
  auto avg_bits = std::make_shared<double>(0);
  auto avg_budget = std::make_shared<std::string>();
  auto threads = std::make_shared<int>(2);
  auto no_verify = std::make_shared<bool>(false);
  cmd->add_option("--model", *model, "exported model (.pt)")->capture_default_str();
  cmd->add_option("--out", *out, "output directory (default runs/<model stem>-layers)");
  cmd->add_option("--choices", *choices,
                  "the per-layer choices, comma-separated: cache schemes (e.g. kivi:k8:v4:g32:r128,kivi:k4:v2:g32:r128) "
                  "or one eviction policy with budgets (e.g. snapkv@25%,snapkv@75%,full)")
      ->required();
  cmd->add_option("--base", *base,
                  "scheme of the layers not under test (schemes), or of every layer (policies)")
      ->capture_default_str();
  auto* bits_opt = cmd->add_option("--avg-bits", *avg_bits, "budget for scheme choices: mean bits/value over layers")
                       ->check(NumberRange(0.001, 64));
  auto* budget_opt =
      cmd->add_option("--avg-budget", *avg_budget,
                      "budget for policy choices: mean budget over layers, percent of the context (50%) or tokens (256)");
  bits_opt->excludes(budget_opt);
  cmd->add_option("--threads", *threads, "LibTorch intra-op threads")
      ->capture_default_str()
      ->check(IntRange(1, kMaxThreads));
  cmd->add_flag("--no-verify", *no_verify, "do not measure the chosen arm's own KLD");
  cmd->callback([=] {
    const std::vector<std::string> list = split_list(*choices);
    KV_CHECK_ARG(!list.empty(), "--choices '", *choices, "' lists no choice (expected e.g. 'int8,int4')");
    const bool policies = kvcache::spec_kind(list[0]) == kvcache::SpecKind::kPolicy;
    double budget = 0;
    if (policies) {
      KV_CHECK_ARG(!avg_budget->empty(), "--choices '", *choices,
                   "' are eviction policies: give their mean budget with --avg-budget (e.g. 50% or 256)");
      // Validated as a policy budget; % of the context or tokens, the unit the choices use.
      const kvcache::Budget b = kvcache::Budget::parse(*avg_budget);
      budget = b.kind == kvcache::Budget::Kind::kFraction ? b.value * 100.0 : b.value;
      for (const auto& c : list) {  // before any pass: the same unit as the choices
        if (kvcache::spec_kind(c) != kvcache::SpecKind::kPolicy || kvcache::spec_head(c) == "full") continue;
        const auto kind = kvcache::make_eviction_policy(c)->budget().kind;
        KV_CHECK_ARG(kind == kvcache::Budget::Kind::kNone || kind == b.kind, "--avg-budget '", *avg_budget, "' is in ",
                     b.kind == kvcache::Budget::Kind::kFraction ? "percent" : "tokens", ", choice '", c,
                     "' budgets ", kind == kvcache::Budget::Kind::kFraction ? "percent" : "tokens");
      }
    } else {
      KV_CHECK_ARG(avg_budget->empty() && *avg_bits > 0, "--choices '", *choices,
                   "' are cache schemes: give their mean bits/value with --avg-bits (e.g. 4)");
      budget = *avg_bits;
    }
    auto evaluator = load_evaluator(*model, *threads);
    Progress progress(std::cerr, ::isatty(::fileno(stderr)) != 0, 0);
    const LayerSensitivity profile = measure_layer_sensitivity(*evaluator, *base, list, &progress);
    const LayerAssignment chosen = choose_layer_assignment(profile, budget);
    double measured = -1;
    if (!*no_verify) {
      const TextEval ref = evaluator->eval_text(evaluator->canonicalize(control_arm()));
      const TextEval te = evaluator->eval_text(evaluator->canonicalize(parse_arm(chosen.arm)));
      measured = compare_logits(ref.stream_logits, te.stream_logits).kld_mean;
    }
    const std::string dir = out->empty() ? "runs/" + stem(*model) + "-layers" : *out;
    make_dirs(dir);
    write_layer_assignment_files(dir, profile, budget, chosen, measured);
    std::cout << layer_assignment_markdown(profile, budget, chosen, measured);
    std::cerr << "kv_study layers: wrote " << dir << "/layers.json and layers.md\n";
  });
}

}  // namespace kv_study
