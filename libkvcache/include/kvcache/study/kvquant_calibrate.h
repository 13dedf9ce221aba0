// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file kvquant_calibrate.h
/// `kv_study calibrate`: KVQuant calibration of an exported model (KVQuant, arXiv
/// 2401.18079; the fit and the file format: kvcache/kvquant.h). The model runs over
/// calibration text (an unmanaged fp32 forward, sequences of `seqlen` tokens), its pre-RoPE K
/// and V are captured per layer and fit_kvquant_calibration() turns them into per-channel key
/// thresholds and per-layer codebooks.
///
/// Disjointness from the evaluation: the default calibration text is filler from
/// kCalibrationSeed (never an evaluation seed), and every sentence of it that also occurs in
/// an evaluation text (evaluation_sentences(): the default perplexity passage and every
/// message of the `default` and `small` suites at the evaluation seed) is dropped, so the
/// calibration and evaluation texts share no sentence. A `--text` file is used as given.

#include <cstdint>
#include <set>
#include <string>

#include "kvcache/kvquant.h"

namespace kvcache::study {

/// Seed of the default calibration filler (the evaluation uses 1234; training other seeds).
inline constexpr uint64_t kCalibrationSeed = 2401;

/// Every sentence ('.'-terminated, trimmed) of the evaluation texts at `eval_seed`: the
/// default passage filler_passage(eval_seed, 256) and the messages of both suites.
std::set<std::string> evaluation_sentences(uint64_t eval_seed);

/// Filler of about `approx_tokens` tokens from `seed`, without any sentence of `exclude`.
/// @throws InvalidArgument if approx_tokens < 1.
std::string calibration_passage(uint64_t seed, int64_t approx_tokens, const std::set<std::string>& exclude);

struct KvquantCalibrateOptions {
  std::string model_path;     ///< exported model (.pt, ABI v1) with its tokenizer
  int threads = 0;            ///< LibTorch threads (0: leave as is)
  std::string text;           ///< calibration text; empty: calibration_passage(seed, tokens, evaluation_sentences(eval_seed))
  uint64_t seed = kCalibrationSeed;
  uint64_t eval_seed = 1234;  ///< the evaluation seed whose texts the default text avoids
  int64_t tokens = 8192;      ///< approximate calibration tokens of the default text
  int64_t seqlen = 512;       ///< tokens per forward (capped at max_position_embeddings)
  KvquantFitOptions fit;
};

/// Runs the model over the calibration text and fits the calibration.
/// @throws InvalidArgument if the model cannot be loaded, the text has fewer than 2 tokens,
///         or an option is out of range.
KvquantCalibration calibrate_kvquant(const KvquantCalibrateOptions& options);

}  // namespace kvcache::study
