// SPDX-License-Identifier: Apache-2.0
// The task generator: determinism, composition, spans, depths, lengths, self-consistency.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <set>

#include "kvcache/error.h"
#include "kvcache/study/task_suite.h"

using namespace kvcache::study;

namespace {
std::string span_text(const Task& t) {
  const auto& c = t.messages.at(static_cast<size_t>(t.span.message)).content;
  return c.substr(static_cast<size_t>(t.span.begin), static_cast<size_t>(t.span.end - t.span.begin));
}
}  // namespace

TEST(StudySuite, DefaultCompositionAndIds) {
  auto tasks = generate_suite("default", 1234);
  ASSERT_EQ(tasks.size(), 222u);
  std::map<TaskFamily, int> per_family;
  std::map<std::pair<int64_t, int>, int> needle_cells;
  std::set<std::string> ids;
  for (const auto& t : tasks) {
    per_family[t.family]++;
    EXPECT_TRUE(ids.insert(t.id).second) << "duplicate id " << t.id;
    EXPECT_EQ(t.id.rfind("s1234-" + to_string(t.family) + "-L", 0), 0u) << t.id;
    if (t.family == TaskFamily::kNeedle) needle_cells[{t.context_target, t.depth_pct}]++;
    else EXPECT_EQ(t.depth_pct, -1);
  }
  EXPECT_EQ(per_family[TaskFamily::kNeedle], 96);
  EXPECT_EQ(per_family[TaskFamily::kMultiTurn], 42);
  EXPECT_EQ(per_family[TaskFamily::kInstruction], 42);
  EXPECT_EQ(per_family[TaskFamily::kSummary], 42);
  ASSERT_EQ(needle_cells.size(), 12u);  // 3 lengths x 4 depths
  for (const auto& [cell, n] : needle_cells) EXPECT_EQ(n, 8) << cell.first << "/" << cell.second;
}

TEST(StudySuite, DeterministicPerSeedAndPinned) {
  auto a = generate_suite("default", 7);
  auto b = generate_suite("default", 7);
  auto c = generate_suite("default", 8);
  ASSERT_EQ(a.size(), b.size());
  int differ = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(task_to_json(a[i]), task_to_json(b[i]));
    differ += a[i].answer != c[i].answer;
  }
  EXPECT_GT(differ, 150);  // another seed gives other codes/words/details
  // Pinned: the generator feeds the training of the default model (issue 6); a change here
  // silently invalidates that model. Update deliberately, together with the model.
  EXPECT_EQ(a[0].id, "s7-needle-L256-d5-r0");
  EXPECT_EQ(a[0].answer, std::string("1724"));
}

TEST(StudySuite, SmallIsASubsetOfDefault) {
  auto def = generate_suite("default", 99);
  auto small = generate_suite("small", 99);
  ASSERT_EQ(small.size(), 20u);
  std::map<std::string, std::string> by_id;
  for (const auto& t : def) by_id[t.id] = task_to_json(t);
  std::set<TaskFamily> fams;
  for (const auto& t : small) {
    ASSERT_TRUE(by_id.count(t.id)) << t.id;
    EXPECT_EQ(by_id[t.id], task_to_json(t));
    fams.insert(t.family);
  }
  EXPECT_EQ(fams.size(), 4u);
  EXPECT_THROW(generate_suite("huge", 1), kvcache::InvalidArgument);
}

TEST(StudySuite, EveryReferenceAnswerPassesAndSpanIsLoadBearing) {
  for (const auto& t : generate_suite("default", 3)) {
    EXPECT_TRUE(score_output(t.rule, t.answer)) << t.id;
    const std::string s = span_text(t);
    switch (t.family) {
      case TaskFamily::kNeedle:
        EXPECT_EQ(s, "The access code is " + t.answer + ".") << t.id;
        // the code occurs exactly once in the prompt
        EXPECT_EQ(t.messages[1].content.find(t.answer), static_cast<size_t>(t.span.begin + 19)) << t.id;
        EXPECT_EQ(t.messages[1].content.find(t.answer, static_cast<size_t>(t.span.end)), std::string::npos);
        EXPECT_GE(t.answer.size(), 4u);
        EXPECT_LE(t.answer.size(), 6u);
        break;
      case TaskFamily::kMultiTurn:
        EXPECT_EQ(s.rfind("When I say goodbye,", 0), 0u) << s;
        EXPECT_EQ(t.span.message, 1);
        EXPECT_EQ(t.messages.back().content, "Goodbye!");
        // the default reply would fail: the rule must be read back from turn 1
        EXPECT_FALSE(score_output(t.rule, "Goodbye, see you soon.")) << t.id;
        break;
      case TaskFamily::kInstruction:
        EXPECT_EQ(t.span.message, 0);
        EXPECT_EQ(s.rfind("Always ", 0), 0u) << s;
        break;
      case TaskFamily::kSummary:
        EXPECT_EQ(s.rfind("Once upon a time, a ", 0), 0u) << s;
        EXPECT_NE(s.find(t.rule.arg), std::string::npos) << t.id;  // the scored detail is in the span
        break;
      default:
        ADD_FAILURE() << t.id << " is not of a default-suite family";
    }
    EXPECT_EQ(t.messages.back().role, "user");
  }
}

TEST(StudySuite, LengthsFillUpToTargetAndDepthsAreWhereStated) {
  for (const auto& t : generate_suite("default", 5)) {
    EXPECT_LE(t.approx_tokens, t.context_target) << t.id;
    EXPECT_GE(t.approx_tokens, t.context_target - 16) << t.id;  // filled to within a sentence
    if (t.family != TaskFamily::kNeedle) continue;
    // Needle position inside the filler, measured in approximate tokens.
    const auto& c = t.messages[1].content;
    const size_t fill_begin = c.find("\n\n") + 2;
    const size_t fill_end = c.rfind("\n\n");
    const int64_t before = approx_tokens(c.substr(fill_begin, static_cast<size_t>(t.span.begin) - fill_begin));
    const int64_t after = approx_tokens(c.substr(static_cast<size_t>(t.span.end), fill_end - static_cast<size_t>(t.span.end)));
    const double depth = 100.0 * static_cast<double>(before) / static_cast<double>(before + after);
    EXPECT_NEAR(depth, t.depth_pct, 4.0) << t.id;
  }
}

TEST(StudySuite, RoundTripsThroughJsonl) {
  auto tasks = generate_suite("small", 11);
  const std::string path = ::testing::TempDir() + "/study_suite_small.jsonl";
  write_tasks_jsonl(path, tasks);
  auto back = read_tasks_jsonl(path);
  ASSERT_EQ(back.size(), tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) EXPECT_EQ(task_to_json(back[i]), task_to_json(tasks[i]));
  std::remove(path.c_str());
}

TEST(StudyTraining, DeterministicSaltedAndWithinOptions) {
  TrainingOptions opt;
  opt.min_context = 64;
  opt.max_context = 300;
  auto a = generate_training_tasks(1, 200, opt);
  auto b = generate_training_tasks(1, 200, opt);
  ASSERT_EQ(a.size(), 200u);
  std::map<TaskFamily, int> fams;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(task_to_json(a[i]), task_to_json(b[i]));
    EXPECT_EQ(a[i].id, "train-s1-" + std::to_string(i));
    EXPECT_GE(a[i].context_target, 64);
    EXPECT_LE(a[i].context_target, 300);
    EXPECT_TRUE(score_output(a[i].rule, a[i].answer));
    fams[a[i].family]++;
  }
  EXPECT_EQ(fams.size(), 4u);
  for (const auto& [f, n] : fams) EXPECT_GT(n, 25) << to_string(f);
  // Salted stream: the suite with the same numeric seed has other needle codes.
  std::set<std::string> suite_codes;
  for (const auto& t : generate_suite("default", 1)) {
    if (t.family == TaskFamily::kNeedle) suite_codes.insert(t.answer);
  }
  int shared = 0;
  for (const auto& t : a) shared += t.family == TaskFamily::kNeedle && suite_codes.count(t.answer);
  EXPECT_LE(shared, 1);
  TrainingOptions only;
  only.families = {TaskFamily::kSummary};
  for (const auto& t : generate_training_tasks(2, 20, only)) EXPECT_EQ(t.family, TaskFamily::kSummary);
  TrainingOptions bad;
  bad.max_context = 10;
  EXPECT_THROW(generate_training_tasks(1, 1, bad), kvcache::InvalidArgument);
}

TEST(StudyTraining, VocabularyIsSmallAndCoversPrompts) {
  auto vocab = generator_vocabulary();
  EXPECT_LT(vocab.size(), 400u);
  std::set<std::string> v(vocab.begin(), vocab.end());
  for (const auto& t : generate_training_tasks(3, 100)) {
    std::string all = t.answer;
    for (const auto& m : t.messages) all += " " + m.content;
    std::string cur;
    for (char ch : all + " ") {
      if (std::isalpha(static_cast<unsigned char>(ch))) {
        cur.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
      } else if (!cur.empty()) {
        EXPECT_TRUE(v.count(cur)) << "word '" << cur << "' of " << t.id << " not in the vocabulary";
        cur.clear();
      }
    }
  }
}

TEST(StudySuite, FillerPassage) {
  const auto a = filler_passage(1, 300);
  EXPECT_EQ(a, filler_passage(1, 300));
  EXPECT_NE(a, filler_passage(2, 300));
  EXPECT_GE(approx_tokens(a), 300);
  EXPECT_LT(approx_tokens(a), 315);
  EXPECT_EQ(a.find_first_of("0123456789"), std::string::npos);
  EXPECT_THROW(filler_passage(1, 0), kvcache::InvalidArgument);
}

TEST(StudySuite, EveryQuestionFollowsItsContextAndRoundTrips) {
  // The query-agnostic mode compresses the prompt before Task::question: each family's question
  // is the text that asks for the answer, at the end of the prompt; the summary family has
  // none (its instruction precedes the story).
  std::map<std::string, int> with_question;
  for (const auto& t : generate_suite("default", 1234)) {
    const std::string fam = to_string(t.family);
    if (t.family == TaskFamily::kSummary) {
      EXPECT_EQ(t.question.message, -1) << t.id;
      continue;
    }
    ASSERT_GE(t.question.message, 0) << t.id;
    ++with_question[fam];
    const auto& msg = t.messages[static_cast<size_t>(t.question.message)];
    const std::string q = msg.content.substr(static_cast<size_t>(t.question.begin),
                                             static_cast<size_t>(t.question.end - t.question.begin));
    // The question ends the prompt: the last message, to its end.
    EXPECT_EQ(t.question.message, static_cast<int64_t>(t.messages.size()) - 1) << t.id;
    EXPECT_EQ(t.question.end, static_cast<int64_t>(msg.content.size())) << t.id;
    // It comes after the load-bearing span (the context holds the needle / rule / instruction).
    EXPECT_TRUE(t.span.message < t.question.message ||
                (t.span.message == t.question.message && t.span.end <= t.question.begin))
        << t.id;
    if (t.family == TaskFamily::kNeedle) {
      EXPECT_EQ(q, "Question: What is the access code?") << t.id;
    } else if (t.family == TaskFamily::kMultiTurn) {
      EXPECT_EQ(q, "Goodbye!") << t.id;
    } else {
      EXPECT_EQ(q.rfind("Question: ", 0), 0u) << q;
    }
    const Task back = task_from_json(task_to_json(t));
    EXPECT_EQ(back.question.message, t.question.message);
    EXPECT_EQ(back.question.begin, t.question.begin);
    EXPECT_EQ(back.question.end, t.question.end);
  }
  EXPECT_EQ(with_question["needle"], 96);
  EXPECT_EQ(with_question["multiturn"], 42);
  EXPECT_EQ(with_question["instruction"], 42);
}
