// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/task_suite.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <functional>
#include <set>

#include "kvcache/error.h"
#include "rng.h"
#include "suite_grammar.h"

namespace kvcache::study {

namespace {
using namespace grammar;

const int kDepths[] = {5, 35, 65, 95};
const int64_t kLengths[] = {256, 512, 768};
const int kTurns[] = {2, 6};
constexpr int kNeedleReps = 8;
constexpr int kMultiTurnReps = 7;
constexpr int kOtherReps = 14;

std::string prefix(uint64_t seed) { return "s" + std::to_string(seed) + "-"; }

std::vector<Task> needle_tasks(uint64_t seed, int reps) {
  std::vector<Task> out;
  for (int rep = 0; rep < reps; ++rep) {
    uint64_t cell = 0;
    for (int64_t len : kLengths) {
      for (int depth : kDepths) {
        Rng r(mix_seed(seed, "suite", 0, cell, static_cast<uint64_t>(rep)));
        Task t = make_needle(r, depth, len, 4 + (rep % 3), {});
        t.id = prefix(seed) + "needle-L" + std::to_string(len) + "-d" + std::to_string(depth) +
               "-r" + std::to_string(rep);
        out.push_back(finish(std::move(t)));
        ++cell;
      }
    }
  }
  return out;
}

std::vector<Task> multiturn_tasks(uint64_t seed, int reps) {
  std::vector<Task> out;
  for (int rep = 0; rep < reps; ++rep) {
    uint64_t cell = 0;
    for (int64_t len : kLengths) {
      for (int turns : kTurns) {
        Rng r(mix_seed(seed, "suite", 1, cell, static_cast<uint64_t>(rep)));
        Task t = make_multiturn(r, static_cast<Style>((rep + cell) % 3), turns, len, {});
        t.id = prefix(seed) + "multiturn-L" + std::to_string(len) + "-t" + std::to_string(turns) +
               "-r" + std::to_string(rep);
        out.push_back(finish(std::move(t)));
        ++cell;
      }
    }
  }
  return out;
}

std::vector<Task> single_cell_tasks(uint64_t seed, int reps, TaskFamily family) {
  std::vector<Task> out;
  const uint64_t fam = family == TaskFamily::kInstruction ? 2 : 3;
  for (int rep = 0; rep < reps; ++rep) {
    uint64_t cell = 0;
    for (int64_t len : kLengths) {
      Rng r(mix_seed(seed, "suite", fam, cell, static_cast<uint64_t>(rep)));
      const int variant = static_cast<int>((rep + cell) % 3);
      Task t = family == TaskFamily::kInstruction ? make_instruction(r, static_cast<Style>(variant), len, {})
                                                  : make_summary(r, variant, len, {});
      t.id = prefix(seed) + to_string(family) + "-L" + std::to_string(len) + "-r" + std::to_string(rep);
      out.push_back(finish(std::move(t)));
      ++cell;
    }
  }
  return out;
}

void append(std::vector<Task>& out, std::vector<Task> more, size_t limit) {
  for (size_t i = 0; i < more.size() && i < limit; ++i) out.push_back(std::move(more[i]));
}

}  // namespace

std::string instruction_reply(const Task& question_of, const Task& style_of) {
  for (const Task* t : {&question_of, &style_of}) {
    KV_CHECK_ARG(t->family == TaskFamily::kInstruction, "instruction_reply: task '", t->id, "' is a ",
                 to_string(t->family), " task, expected an instruction task");
  }
  Style style = Style::kUppercase;
  switch (style_of.rule.kind) {
    case RuleKind::kUppercase:
      style = Style::kUppercase;
      break;
    case RuleKind::kEndsWith:
      style = Style::kEndsWith;
      break;
    case RuleKind::kStartsWith:
      style = Style::kStartsWith;
      break;
    default:
      throw InvalidArgument("instruction_reply: task '" + style_of.id + "' has a " + to_string(style_of.rule.kind) +
                            " rule, expected uppercase, ends_with or starts_with");
  }
  const Message* user = nullptr;
  for (auto it = question_of.messages.rbegin(); it != question_of.messages.rend() && user == nullptr; ++it) {
    if (it->role == "user") user = &*it;
  }
  static const std::string kMark = "Question: ";
  const size_t at = user == nullptr ? std::string::npos : user->content.rfind(kMark);
  KV_CHECK_ARG(at != std::string::npos, "instruction_reply: task '", question_of.id,
               "' has no \"Question: \" in its last user turn");
  const std::string q = user->content.substr(at + kMark.size());
  for (const QA& qa : kQuestions) {
    if (q == qa.q) return styled(qa.a, style, style_of.rule.arg);
  }
  throw InvalidArgument("instruction_reply: the question of task '" + question_of.id + "', \"" + q +
                        "\", is not one of the suite's " + std::to_string(kQuestions.size()) + " questions");
}

std::vector<std::string> suite_names() { return {"default", "small"}; }

std::vector<Task> generate_suite(const std::string& name, uint64_t seed) {
  std::vector<Task> out;
  if (name == "default") {
    append(out, needle_tasks(seed, kNeedleReps), SIZE_MAX);
    append(out, multiturn_tasks(seed, kMultiTurnReps), SIZE_MAX);
    append(out, single_cell_tasks(seed, kOtherReps, TaskFamily::kInstruction), SIZE_MAX);
    append(out, single_cell_tasks(seed, kOtherReps, TaskFamily::kSummary), SIZE_MAX);
  } else if (name == "small") {
    append(out, needle_tasks(seed, 1), SIZE_MAX);
    append(out, multiturn_tasks(seed, 1), 3);
    append(out, single_cell_tasks(seed, 1, TaskFamily::kInstruction), 3);
    append(out, single_cell_tasks(seed, 1, TaskFamily::kSummary), 2);
  } else {
    throw InvalidArgument("unknown suite '" + name + "' (expected default or small)");
  }
  return out;
}

std::vector<Task> generate_training_tasks(uint64_t seed, int64_t count, const TrainingOptions& options) {
  const std::vector<TaskFamily> families = grammar::check_training_request(
      count, options.min_context, options.max_context, options.families, default_families(),
      "is a long-suite family: the default training mode takes needle, multiturn, instruction and summary (use "
      "--suite long for the long families)");
  std::vector<Task> out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    Rng r(mix_seed(seed, "train", static_cast<uint64_t>(i)));
    const TaskFamily fam = r.pick(families);
    const int64_t target = r.range(options.min_context, options.max_context);
    Task t;
    switch (fam) {
      case TaskFamily::kNeedle:
        t = make_needle(r, static_cast<int>(r.range(0, 100)), target, static_cast<int>(r.range(4, 6)), {});
        break;
      case TaskFamily::kMultiTurn:
        t = make_multiturn(r, static_cast<Style>(r.below(3)), static_cast<int>(r.range(1, 8)), target, {});
        break;
      case TaskFamily::kInstruction:
        t = make_instruction(r, static_cast<Style>(r.below(3)), target, {});
        break;
      case TaskFamily::kSummary:
        t = make_summary(r, static_cast<int>(r.below(3)), target, {});
        break;
      default:
        KV_INTERNAL_ASSERT(false, "unchecked training family ", to_string(fam));
    }
    t.id = "train-s" + std::to_string(seed) + "-" + std::to_string(i);
    out.push_back(finish(std::move(t)));
  }
  return out;
}

std::string filler_passage(uint64_t seed, int64_t approx_tokens_target) {
  KV_CHECK_ARG(approx_tokens_target >= 1, "filler_passage: approx_tokens must be >= 1, got ", approx_tokens_target);
  Rng r(mix_seed(seed, "passage"));
  std::string out;
  int64_t n = 0;
  while (n < approx_tokens_target) {
    const std::string s = filler_sentence(r);
    out += (out.empty() ? "" : " ") + s;
    n += approx_tokens(s);
  }
  return out;
}

std::vector<std::string> generator_vocabulary() {
  std::string all = std::string(kSystem) + " " + kNeedleIntro + " " + kNeedleQuestion + " " +
                    kGoodbye + " " + kGoodbyeReply + " " + kRuleAck + " " + kNoteIntro + " " +
                    kStoryIntro + " The access code is It a day in the likes Hello When I say "
                    "goodbye reply in uppercase end your with word start Always Question Once "
                    "upon time named lived house The end";
  for (const auto* bank : {&kAdj, &kNoun, &kVerb, &kPrep, &kPlace, &kWeather, &kThing, &kRuleWords,
                           &kNames, &kRoles, &kColours, &kAnimals}) {
    for (const auto& w : *bank) all += " " + w;
  }
  for (const auto& qa : kQuestions) all += std::string(" ") + qa.q + " " + qa.a;
  std::set<std::string> uniq;
  std::string cur;
  for (char c : all + " ") {
    if (std::isalpha(static_cast<unsigned char>(c))) {
      cur.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
    } else if (!cur.empty()) {
      uniq.insert(cur);
      cur.clear();
    }
  }
  return {uniq.begin(), uniq.end()};
}

}  // namespace kvcache::study
