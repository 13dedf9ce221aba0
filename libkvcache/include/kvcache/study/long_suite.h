// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file long_suite.h
/// The long-context task suite of kv_study (`--suite long`, issue 34): RULER-style families
/// (RULER, arXiv 2404.06654) at 4k–32k tokens of the model's own tokenizer, generated
/// deterministically from a seed with the suite's own grammar, and the training data of the
/// long-context default model.
///
/// Families (docs/study.md, "The long suite", gives one example of each):
///   needle       one access code at depth {0,14,29,43,57,71,86,100} % of the filler
///                ("The access code is 48213."); asked: the code.
///   multikey     six codes of one form under six keys ("The access code for the granary is
///                48213."); asked: one key's code. The other five are distractors.
///   multivalue   four codes under one key, numbered in the text ("The second access code for
///                the castle is 55120.") among three codes under other keys; asked: every code of
///                the key, in order ("first 48213, second 55120, third ..., fourth ....").
///   vartrack     two chains of assignments, one value and four hops each ("Let alpha be 48213."
///                ... "Let beta be alpha." ...), interleaved; asked: the value of one chain's last
///                variable, answered by walking the chain back ("delta is gamma, gamma is beta,
///                beta is alpha, alpha is 48213.").
///   aggregation  one lamp colour per sentence, L/128 sentences, one colour about twice as
///                frequent as any other ("A lamp glowed amber."); asked: the most frequent colour
///                ("The lamps glowed amber most often.").
///   instruction  an instruction in the system prompt (position 0) that the reply to a question
///                after the long note must follow (uppercase / start with / end with a word).
///   multiturn    a rule set in the first user turn ("When I say goodbye, ..."), many turns of
///                chatter, then "Goodbye!".
/// Filler is the default suite's sentence grammar, whose banks share no word with any answer.
/// Each task's reply is scored programmatically (Task::rule); the generator checks that the
/// reference reply passes its own rule.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvcache/study/task.h"

namespace kvcache::study {

/// Counts the tokens of a chat prompt as the model will see it (chat template with the
/// generation prompt, then the tokenizer). The default counter is approx_tokens() of
/// render_chatml(messages, true).
using PromptTokenCounter = std::function<int64_t(const std::vector<Message>& messages)>;

/// approx_tokens(render_chatml(messages, /*add_generation_prompt=*/true)).
int64_t approx_prompt_tokens(const std::vector<Message>& messages);

/// The lengths of the long suite: 4k, 8k, 16k and 32k tokens (k = 1024).
std::vector<int64_t> long_suite_lengths();
/// The lengths `kv_study run --suite long` runs by default: 4k, 8k, 16k.
std::vector<int64_t> default_long_lengths();

/// Parses a comma-separated list of lengths: integers with an optional k suffix (×1024),
/// e.g. "4k,8k,16k" or "4096". Each must lie in [512, 131072].
/// @throws InvalidArgument naming the bad item and the accepted form.
std::vector<int64_t> parse_lengths(const std::string& text);

/// "4k" for 4096, "6000" for 6000 (the suffix form when divisible by 1024).
std::string length_label(int64_t tokens);

/// The families of the long suite, in suite order.
std::vector<TaskFamily> long_families();

/// Needle depths of the long suite, percent of the filler: 0, 14, 29, 43, 57, 71, 86, 100.
std::vector<int> long_needle_depths();

/// Every long task's decode limit (Task::max_new_tokens), tokens: long enough for quantization
/// error to compound over the reply; the model stops earlier at its end-of-turn token.
inline constexpr int64_t kLongNewTokens = 64;

/// The most repetitions generate_long_suite() takes.
inline constexpr int kMaxLongReps = 100;

struct LongSuiteOptions {
  /// Prompt lengths (tokens of `counter`), each in [512, 131072], distinct.
  std::vector<int64_t> lengths = {4096, 8192, 16384};
  /// Repetitions: per length and repetition, one needle per depth (8) and two tasks of each
  /// other family (12): 20 tasks.
  int reps = 1;
  /// Token counter of the prompt; empty = approx_prompt_tokens. Every prompt is filled to the
  /// largest length <= its target that this counter reports, within 1 % below the target (16
  /// tokens below targets under 1,600: a filler sentence is ~8 tokens).
  PromptTokenCounter counter;
};

/// The long suite for `seed`. Task ids are "s<seed>-long-<family>-L<label>[-d<depth>]-r<rep>[-<i>]"
/// (e.g. "s1234-long-needle-L16k-d43-r0", "s1234-long-vartrack-L8k-r0-1"). Every task's
/// max_new_tokens is kLongNewTokens.
/// @throws InvalidArgument for a bad option (naming it), or if a prompt cannot be filled
///         within 1 % of its target with `counter` (naming the task and the counts).
std::vector<Task> generate_long_suite(uint64_t seed, const LongSuiteOptions& options = {});

/// Options of the long training-data mode.
struct LongTrainingOptions {
  int64_t min_context = 128;  ///< smallest context target (approximate tokens), >= 48 (a task whose
                              ///< inserts alone are longer gets no filler)
  int64_t max_context = 1024; ///< largest context target, >= min_context, <= kMaxTrainingContext
  /// Families to draw from (uniformly); empty = long_families().
  std::vector<TaskFamily> families;
};

/// `count` training tasks of the long families for `seed`: family uniform, context target
/// uniform in [min_context, max_context] approximate tokens, depths, keys, counts and chains
/// random. Salted "long-train": never equal to a suite task of the same numeric seed. Ids are
/// "longtrain-s<seed>-<index>". Each task records what its reply copies from the prompt in
/// Task::evidence (the trainer's attention supervision).
/// @throws InvalidArgument for a bad option (naming it).
std::vector<Task> generate_long_training_tasks(uint64_t seed, int64_t count,
                                               const LongTrainingOptions& options = {});

}  // namespace kvcache::study
