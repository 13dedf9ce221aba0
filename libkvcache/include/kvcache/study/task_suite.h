// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file task_suite.h
/// The deterministic task generator of kv_study (evaluation suites and training data).
///
/// Every task is built from templates over a small fixed vocabulary (a filler sentence
/// grammar, a question bank, name/colour/word banks) so that a tiny model trained from scratch
/// on generate_training_tasks() can learn the families (issue 6). Output depends only on the
/// arguments: a private splitmix64 stream seeded from (seed, mode, family, cell, repetition),
/// no std:: distributions, no global state.
///
/// Families and cells of the "default" suite (222 tasks):
///   needle      depth {5,35,65,95}% x length {256,512,768} x 8 repetitions        =  96
///   multiturn   (length, chatter turns) in {256,512,768} x {2,6} x 7 repetitions  =  42
///   instruction length {256,512,768} x 14 repetitions                               =  42
///   summary     length {256,512,768} x 14 repetitions (detail: name/colour/number)  =  42
/// "small" (20 tasks) is a subset of "default" with the same seed: every needle cell once,
/// then the first tasks of the other families. Lengths are approx_tokens() of the rendered
/// prompt (the generator fills up to, never over, the target).

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/study/task.h"

namespace kvcache::study {

/// Names accepted by generate_suite().
std::vector<std::string> suite_names();

/// The evaluation suite `name` ("default" or "small") for `seed`. Task ids are
/// "s<seed>-<family>-L<length>[-d<depth>|-t<turns>]-r<repetition>".
/// @throws InvalidArgument for an unknown name (listing the valid ones).
std::vector<Task> generate_suite(const std::string& name, uint64_t seed);

/// The reference reply to `question_of`'s question in `style_of`'s reply style: the question is
/// the text after the last "Question: " of question_of's last user turn, looked up in the
/// suite's question bank, and its plain answer ("The sky is blue.") is styled by style_of's
/// rule as make_instruction styles its own answer (uppercase: "THE SKY IS BLUE."; ends_with W:
/// "The sky is blue, W."; starts_with W: "W, the sky is blue."). instruction_reply(t, t) is
/// t.answer. The few-shot family of kv_study prefix (prefix_workload.h) builds its worked
/// examples and references with it.
/// @throws InvalidArgument naming the task id if either task is not an instruction task (or
///         style_of's rule is not uppercase / ends_with / starts_with), or if question_of's last
///         user turn has no "Question: " or its question is not one of the suite's.
std::string instruction_reply(const Task& question_of, const Task& style_of);

/// The most tasks one generate_training_tasks() call writes (10^7).
inline constexpr int64_t kMaxTrainingTasks = 10000000;
/// The largest context target of a training task (approximate tokens).
inline constexpr int64_t kMaxTrainingContext = 131072;

/// Options of the training-data mode.
struct TrainingOptions {
  int64_t min_context = 64;    ///< smallest context target (approximate tokens), >= 48
  int64_t max_context = 800;   ///< largest context target, >= min_context
  /// Families to draw from (uniformly); empty = all four.
  std::vector<TaskFamily> families;
};

/// `count` training tasks for `seed`: family uniform, context target uniform in
/// [min_context, max_context], needle depth uniform in 0..100, chatter turns 1..8.
/// The random stream is salted with "train", so training tasks never coincide with a suite
/// generated from the same numeric seed (issue 6 additionally uses disjoint seeds).
/// Ids are "train-s<seed>-<index>".
/// @throws InvalidArgument for a bad option (naming it): count outside [0, kMaxTrainingTasks],
///         contexts outside [48, kMaxTrainingContext] or max_context < min_context.
std::vector<Task> generate_training_tasks(uint64_t seed, int64_t count,
                                          const TrainingOptions& options = {});

/// A passage of filler sentences (the suite's haystack grammar) of about `approx_tokens`
/// approximate tokens, deterministic for `seed`: the default text of the perplexity / KLD rows.
/// @throws InvalidArgument if approx_tokens < 1.
std::string filler_passage(uint64_t seed, int64_t approx_tokens);

/// The word banks of the generator (for tests and the tokenizer trainer): every word the
/// templates can emit, lowercased, sorted and unique.
std::vector<std::string> generator_vocabulary();

}  // namespace kvcache::study
