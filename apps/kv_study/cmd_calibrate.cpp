// SPDX-License-Identifier: Apache-2.0
// kv_study calibrate: a KVQuant calibration file of a model (kvcache/study/kvquant_calibrate.h).
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <memory>

#include "commands.h"
#include "kvcache/error.h"
#include "kvcache/kvquant.h"
#include "kvcache/study/kvquant_calibrate.h"

namespace kv_study {

void add_calibrate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "calibrate",
      "KVQuant calibration (arXiv 2401.18079): run the model over calibration conversations (training-mode tasks,\n"
      "ChatML-rendered, sharing no sentence with the evaluation texts) or --text FILE, capture pre-RoPE K and V per\n"
      "layer and write per-channel key thresholds and per-layer\n"
      "k-means codebooks (docs/quantizers.md, 'KVQuant calibration file'). Use the file as kvquant:...:cal=FILE.\n"
      "Example: kv_study calibrate --out runs/kvstudy-default.kvqcal");
  auto model = std::make_shared<std::string>(kDefaultModel);
  auto text = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto tokens = std::make_shared<int64_t>(8192);
  auto seqlen = std::make_shared<int64_t>(512);
  auto seed = std::make_shared<uint64_t>(kvcache::study::kCalibrationSeed);
  auto bits = std::make_shared<std::string>("2,3,4");
  auto sparsity = std::make_shared<std::string>("0.99,1");
  auto iters = std::make_shared<int64_t>(50);
  auto threads = std::make_shared<int>(0);
  auto weights = std::make_shared<std::string>();
  cmd->add_option("--model", *model, "exported model")->capture_default_str();
  cmd->add_option("--text", *text, "calibration text file (default: training-task conversations disjoint from the evaluation texts)");
  cmd->add_option("--out", *out, "calibration file to write (atomically)")->required();
  cmd->add_option("--tokens", *tokens, "calibration tokens of the default conversations (at least)")
      ->capture_default_str()
      ->check(IntRange(2, 10000000));
  cmd->add_option("--seqlen", *seqlen, "tokens per forward (capped at the model's max positions)")
      ->capture_default_str()
      ->check(IntRange(2, 1 << 20));
  cmd->add_option("--seed", *seed, "seed of the default calibration conversations (not the evaluation seed 1234)")
      ->capture_default_str()
      ->check(IntRange(0, INT64_MAX));
  cmd->add_option("--bits", *bits, "codebook widths, comma list of 2, 3, 4")->capture_default_str();
  cmd->add_option("--sparsity", *sparsity, "sparsity levels, comma list in (0.9, 1] (0.99 = 1% outliers, 1 = none)")
      ->capture_default_str();
  cmd->add_option("--iters", *iters, "k-means iterations at most")->capture_default_str()->check(IntRange(1, 10000));
  cmd->add_option("--threads", *threads, "LibTorch threads (0: default)")->check(IntRange(0, kMaxThreads));
  cmd->add_option("--weights", *weights,
                  "weights file: one non-negative weight per captured key and value (docs/quantizers.md, 'KVQuant "
                  "weights file'), for a weighted k-means (default: unweighted)");
  cmd->callback([=] {
    kvcache::study::KvquantCalibrateOptions o;
    o.model_path = *model;
    o.threads = *threads;
    o.tokens = *tokens;
    o.seqlen = *seqlen;
    o.seed = *seed;
    o.fit.max_iter = static_cast<int>(*iters);
    o.weights = *weights;
    o.fit.bits.clear();
    for (int64_t b : parse_int_list(*bits, "--bits", 2, 4)) o.fit.bits.push_back(static_cast<int>(b));
    KV_CHECK_ARG(!o.fit.bits.empty(), "--bits needs at least one width");
    o.fit.sparsities.clear();
    for (const auto& s : split_list(*sparsity)) {
      char* end = nullptr;
      const double p = std::strtod(s.c_str(), &end);
      KV_CHECK_ARG(end != s.c_str() && *end == '\0' && p > 0.9 && p <= 1.0, "--sparsity: '", s,
                   "' is not a number in (0.9, 1] (0.99 = 1% outliers, 1 = none)");
      o.fit.sparsities.push_back(p);
    }
    KV_CHECK_ARG(!o.fit.sparsities.empty(), "--sparsity needs at least one level");
    if (!text->empty()) {
      try {
        o.text = kvcache::study::read_calibration_text(*text);
      } catch (const kvcache::InvalidArgument& e) {
        throw kvcache::InvalidArgument(std::string("--text: ") + e.what());
      }
    }
    const kvcache::KvquantCalibration c = kvcache::study::calibrate_kvquant(o);
    kvcache::save_kvquant_calibration(c, *out);
    std::cerr << "kv_study calibrate: " << c.tokens << " tokens, " << c.num_layers << " layers x " << c.num_kv_heads
              << " KV heads x head_dim " << c.head_dim << (weights->empty() ? "" : ", weighted by " + *weights)
              << "; wrote " << *out << "\n";
  });
}

}  // namespace kv_study
