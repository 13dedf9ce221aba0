// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file model_evaluator.h
/// The ArmEvaluator over a real exported model (CausalLM + Tokenizer/ChatTemplate +
/// CacheManager): what `kv_study run`, `generate` and `quant --model` use.

#include <cstdint>
#include <memory>
#include <string>

#include "kvcache/study/sweep.h"

namespace kvcache::study {

struct ModelEvaluatorOptions {
  std::string model_path;        ///< exported model (.pt, model ABI v1) with its tokenizer
  int threads = 0;               ///< intra-op threads for LibTorch (0: leave as is)
  /// Evaluation passage of the perplexity/KLD rows; empty: filler_passage(passage_seed, text_tokens).
  std::string text;
  uint64_t passage_seed = 1234;
  int64_t text_tokens = 512;     ///< approximate length of the default passage
  int64_t text_chunk = 32;       ///< streaming chunk (tokens per forward step) of the streaming pass
  /// Layers whose Q/K/V capture_qkv() returns (empty: every layer).
  std::vector<int64_t> capture_layers;
};

/// Builds the evaluator for `options.model_path`.
/// @throws InvalidArgument if the model cannot be loaded; UnsupportedError where this build
///         lacks the model runner.
std::unique_ptr<ArmEvaluator> make_model_evaluator(const ModelEvaluatorOptions& options);

}  // namespace kvcache::study
