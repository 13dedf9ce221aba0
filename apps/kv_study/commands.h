// SPDX-License-Identifier: Apache-2.0
#pragma once
// kv_study subcommands. Each add_* registers one subcommand on the app; its callback runs the
// command (exceptions propagate to main, which prints them and exits non-zero).
#include <CLI/CLI.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/study/long_suite.h"
#include "kvcache/study/model_evaluator.h"
#include "kvcache/study/sweep.h"

namespace kv_study {

void add_memory_command(CLI::App& app);
void add_suite_command(CLI::App& app);
void add_quant_command(CLI::App& app);
void add_list_command(CLI::App& app);
void add_run_command(CLI::App& app);
void add_merge_command(CLI::App& app);
void add_report_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_prefix_command(CLI::App& app);
void add_layers_command(CLI::App& app);

/// The evaluator for `path` (threads: LibTorch intra-op threads), with a pointer to what to do
/// when the default model is asked for and this checkout has none (it is trained by
/// tools/train_default_model.py, issue 6).
/// `text_tokens` > 0: the perplexity/KLD passage's length (ModelEvaluatorOptions::text_tokens).
std::unique_ptr<kvcache::study::ArmEvaluator> load_evaluator(const std::string& path, int threads,
                                                             int64_t text_tokens = 0);
/// The same for options set in full (ModelEvaluatorOptions: model_path, threads, snapshots).
std::unique_ptr<kvcache::study::ArmEvaluator> load_evaluator(const kvcache::study::ModelEvaluatorOptions& options);

/// Creates `dir` and its missing parents. @throws InvalidArgument naming the one it cannot create.
void make_dirs(const std::string& dir);
/// "runs/x/model.pt" -> "model".
std::string stem(const std::string& path);
void add_calibrate_command(CLI::App& app);

/// Splits "a,b,c" (trimming blanks, dropping empty items).
std::vector<std::string> split_list(const std::string& text);

/// Option check: a decimal integer in [lo, hi] (kvcache::parse_integer: no blanks, signs other
/// than '-', exponents or overflow); CLI11 reports "--opt: <value> is out of range [lo, hi]".
CLI::Validator IntRange(int64_t lo, int64_t hi);
/// Option check: a finite decimal number in [lo, hi].
CLI::Validator NumberRange(double lo, double hi);
/// Each item of a comma list (split_list) as kvcache::parse_integer in [lo, hi]; `what` names
/// the option in errors (e.g. "--context").
std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what, int64_t lo, int64_t hi);

/// LibTorch intra-op threads an option may ask for.
inline constexpr int64_t kMaxThreads = 256;

/// The default model of `run`, `generate` and `quant --model`.
inline const char* kDefaultModel = "models/kvstudy-default.pt";
/// The default model of the long suite (`--suite long`): the long-context model (issue 34).
inline const char* kDefaultLongModel = "models/kvstudy-long.pt";

/// The long suite's decode limit: positions a length needs beyond itself.
inline constexpr int64_t kLongMaxNewTokens = kvcache::study::kLongNewTokens;
/// The long suite's default perplexity/KLD passage, tokens.
inline constexpr int64_t kLongTextTokens = 4096;

/// Refuses a long run whose estimated peak memory exceeds the machine's physical memory, naming
/// the estimate and its parts (weights, the fp32 cache at the longest length, the prefill's
/// attention scores, the text rows' logits). @throws InvalidArgument.
void check_long_memory(const kvcache::study::ModelPromptInfo& model, const std::string& path,
                       const std::vector<int64_t>& lengths, int64_t new_tokens, int64_t text_tokens);

/// True if `path` names an existing regular file.
bool file_exists(const std::string& path);

/// Refuses, before any work, a long-suite length the model cannot hold: each length plus
/// `new_tokens` must fit in `max_positions` (0: the model states no limit, nothing refused).
/// @throws InvalidArgument naming the length, the model and its limit.
void check_lengths_fit(const std::vector<int64_t>& lengths, int64_t new_tokens, int64_t max_positions,
                       const std::string& model);

/// The default seed of the evaluation suite (training data must use other seeds, issue 6).
inline constexpr uint64_t kDefaultSuiteSeed = 1234;

}  // namespace kv_study
