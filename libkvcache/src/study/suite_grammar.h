// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file suite_grammar.h (internal)
/// The sentence grammar, word banks and task builders that the default suite (task_suite.cpp)
/// and the long suite (long_suite.cpp) share. Every builder draws from the given Rng in a fixed
/// order, so a suite's tasks depend only on its seed; changing what a builder draws changes
/// every suite built on it (the default suite's tests pin its tasks).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvcache/study/long_suite.h"
#include "kvcache/study/task.h"
#include "rng.h"

namespace kvcache::study::grammar {

// ---- word banks (small, fixed vocabulary; no digits, no colours or names in the filler) ----
extern const std::vector<std::string> kAdj, kNoun, kVerb, kPrep, kPlace, kWeather, kThing;
/// Rule words: none is the first or last word of any reference reply.
extern const std::vector<std::string> kRuleWords;
extern const std::vector<std::string> kNames, kRoles, kColours, kAnimals;

struct QA {
  const char* q;
  const char* a;
};
extern const std::vector<QA> kQuestions;

extern const char* kSystem;
extern const char* kNeedleIntro;
extern const char* kNeedleQuestion;
extern const char* kGoodbye;
extern const char* kGoodbyeReply;
extern const char* kRuleAck;
extern const char* kNoteIntro;
extern const char* kStoryIntro;

enum class Style { kUppercase = 0, kEndsWith = 1, kStartsWith = 2 };

std::string upper(std::string s);
std::string capitalize(std::string s);
std::string decapitalize(std::string s);
/// Applies a reply style to a plain reply that ends with '.'.
std::string styled(const std::string& reply, Style style, const std::string& word);
ScoringRule style_rule(Style style, const std::string& word);

/// One sentence of the haystack grammar.
std::string filler_sentence(Rng& r);
std::vector<std::string> filler_pool(Rng& r, size_t n);
/// parts[begin, end) joined with single spaces.
std::string join(const std::vector<std::string>& parts, size_t begin, size_t end);
/// A code of `digits` digits, the first not 0.
std::string random_code(Rng& r, int digits);

/// A task body produced by a builder for a given number of filler sentences.
struct Body {
  std::vector<Message> messages;
  Span span;
  Span question;  ///< message -1: none
};

/// build(k) for the largest number of filler sentences k (0..max_k) with
/// counter(build(k).messages) <= target (k = 0 if even the empty body is over target); `chosen`
/// (optional) receives k. An empty counter is approx_prompt_tokens.
Body fill_to(const std::function<Body(size_t)>& build, size_t max_k, int64_t target,
             const PromptTokenCounter& counter, size_t* chosen = nullptr);

/// Sets approx_tokens and max_new_tokens and checks the task's invariants (the reference
/// reply passes its rule; the span and question lie inside the messages).
Task finish(Task t);

/// The arguments both training generators share (generate_training_tasks,
/// generate_long_training_tasks), checked: count in [0, kMaxTrainingTasks], min_context in
/// [48, kMaxTrainingContext], max_context in [min_context, kMaxTrainingContext] (approximate
/// tokens), and every requested family one of `allowed` (else InvalidArgument "training family
/// '<f>' <not_allowed>"). @return the families to draw from: `requested`, or `allowed` if empty.
std::vector<TaskFamily> check_training_request(int64_t count, int64_t min_context, int64_t max_context,
                                               const std::vector<TaskFamily>& requested,
                                               const std::vector<TaskFamily>& allowed, const std::string& not_allowed);

Task make_needle(Rng& r, int depth_pct, int64_t target, int code_digits, const PromptTokenCounter& counter);
Task make_multiturn(Rng& r, Style style, int turns, int64_t target, const PromptTokenCounter& counter);
Task make_instruction(Rng& r, Style style, int64_t target, const PromptTokenCounter& counter);
Task make_summary(Rng& r, int detail, int64_t target, const PromptTokenCounter& counter);

}  // namespace kvcache::study::grammar
