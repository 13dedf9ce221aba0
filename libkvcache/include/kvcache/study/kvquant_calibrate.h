// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file kvquant_calibrate.h
/// `kv_study calibrate`: KVQuant calibration of an exported model (KVQuant, arXiv
/// 2401.18079; the fit and the file format: kvcache/kvquant.h). The model runs over
/// calibration text (an unmanaged fp32 forward, sequences of `seqlen` tokens), its pre-RoPE K
/// and V are captured per layer and fit_kvquant_calibration() turns them into per-channel key
/// thresholds and per-layer codebooks.
///
/// Calibration text: by default, conversations of the same kind as the evaluation tasks
/// (ChatML-rendered, special tokens parsed: the keys of `<|im_start|>`, digits and questions
/// occur in calibration as in evaluation) taken from generate_training_tasks(seed, ...) — the
/// training-data mode, with its own "train" salt and seed kCalibrationSeed, never the
/// evaluation seed — each with its reference answer as the assistant's last turn.
/// Disjointness: every sentence of a calibration message that also occurs in an evaluation
/// text (evaluation_sentences(): the default perplexity passage and every message of the
/// `default` and `small` suites at the evaluation seed) is dropped, so calibration and
/// evaluation share no sentence. A `--text` file is used as given (plain text).

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "kvcache/kvquant.h"
#include "kvcache/model/chat_template.h"

namespace kvcache::study {

/// Seed of the default calibration filler (the evaluation uses 1234; training other seeds).
inline constexpr uint64_t kCalibrationSeed = 2401;

/// Every sentence ('.'-terminated, trimmed) of the evaluation texts at `eval_seed`: the
/// default passage filler_passage(eval_seed, 256) and the messages of both suites.
std::set<std::string> evaluation_sentences(uint64_t eval_seed);

/// The default calibration conversations: generate_training_tasks(seed, count)'s messages
/// plus the reference answer as an assistant turn, every sentence found in `exclude` removed
/// (a message left empty is dropped; a conversation left without a message too).
/// @throws InvalidArgument if count is out of generate_training_tasks' range.
std::vector<std::vector<ChatMessage>> calibration_conversations(uint64_t seed, int64_t count,
                                                                const std::set<std::string>& exclude);

/// The '.'- or newline-terminated sentences of `text`, trimmed (a trailing fragment counts).
std::vector<std::string> split_sentences(const std::string& text);

struct KvquantCalibrateOptions {
  std::string model_path;     ///< exported model (.pt, ABI v1) with its tokenizer
  int threads = 0;            ///< LibTorch threads (0: leave as is)
  std::string text;           ///< calibration text; empty: calibration_conversations(seed, ...)
  uint64_t seed = kCalibrationSeed;
  uint64_t eval_seed = 1234;  ///< the evaluation seed whose texts the default text avoids
  int64_t tokens = 8192;      ///< calibration tokens of the default conversations (at least)
  int64_t seqlen = 512;       ///< tokens per forward (capped at max_position_embeddings)
  KvquantFitOptions fit;
  /// Optional weights file (`--weights`; load_kvquant_weights(), docs/quantizers.md "KVQuant
  /// weights file"): one weight per captured value, for the captured [L, N, H_kv, D] (N: the
  /// calibration tokens, printed by a run without weights). Empty: the unweighted fit.
  std::string weights;
};

/// Largest `kv_study calibrate --text` file read (the text is tokenized whole).
inline constexpr int64_t kMaxCalibrationTextBytes = int64_t{64} << 20;

/// The text of a calibration text file (`kv_study calibrate --text FILE`).
/// @throws InvalidArgument naming the path: missing or unreadable, not a regular file (a
///         directory, a device such as /dev/zero, a FIFO: refused before anything is read),
///         larger than kMaxCalibrationTextBytes (64 MiB), or empty.
std::string read_calibration_text(const std::string& path);

/// Runs the model over the calibration text and fits the calibration.
/// @throws InvalidArgument if the model cannot be loaded, the text has fewer than 2 tokens,
///         an option is out of range, or the weights file does not fit the capture
///         (load_kvquant_weights()'s errors, naming the file and both shapes).
KvquantCalibration calibrate_kvquant(const KvquantCalibrateOptions& options);

}  // namespace kvcache::study
