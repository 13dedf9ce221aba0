// SPDX-License-Identifier: Apache-2.0
// Scoring rules on hand-made outputs, task JSON round trip, ChatML rendering, approx_tokens.
#include <gtest/gtest.h>

#include "kvcache/error.h"
#include "kvcache/study/task.h"

using namespace kvcache::study;

TEST(StudyScoring, ExactTrimsAndCutsEndMarker) {
  ScoringRule r{RuleKind::kExact, "48213"};
  EXPECT_TRUE(score_output(r, "48213"));
  EXPECT_TRUE(score_output(r, "  48213\n"));
  EXPECT_TRUE(score_output(r, "48213<|im_end|>garbage"));
  EXPECT_FALSE(score_output(r, "48213."));
  EXPECT_FALSE(score_output(r, "The code is 48213"));
}

TEST(StudyScoring, ContainsIsCaseInsensitiveSubstring) {
  ScoringRule r{RuleKind::kContains, "Dolores Park"};
  EXPECT_TRUE(score_output(r, "sit in dolores park on a sunny day"));
  EXPECT_FALSE(score_output(r, "sit in Dolores"));
  EXPECT_FALSE(score_output({RuleKind::kContains, ""}, "anything"));
}

TEST(StudyScoring, WordNeedsBoundaries) {
  ScoringRule code{RuleKind::kWord, "48213"};
  EXPECT_TRUE(score_output(code, "48213"));
  EXPECT_TRUE(score_output(code, "The access code is 48213."));
  EXPECT_FALSE(score_output(code, "482130"));
  EXPECT_FALSE(score_output(code, "148213"));
  EXPECT_FALSE(score_output(code, "4821"));
  ScoringRule name{RuleKind::kWord, "Lena"};
  EXPECT_TRUE(score_output(name, "LENA the sailor"));
  EXPECT_FALSE(score_output(name, "Lenamaria"));
  EXPECT_TRUE(score_output(name, "Helena, Lena"));  // second occurrence is bounded
}

TEST(StudyScoring, RegexSearchAndBadPatternThrows) {
  EXPECT_TRUE(score_output({RuleKind::kRegex, "^[0-9]{5}$"}, " 48213 "));
  EXPECT_FALSE(score_output({RuleKind::kRegex, "^[0-9]{5}$"}, "4821"));
  EXPECT_THROW(score_output({RuleKind::kRegex, "([0-9"}, "x"), kvcache::InvalidArgument);
}

TEST(StudyScoring, UppercaseNeedsALetterAndNoLowercase) {
  ScoringRule r{RuleKind::kUppercase, ""};
  EXPECT_TRUE(score_output(r, "GOODBYE, SEE YOU SOON."));
  EXPECT_FALSE(score_output(r, "GOODBYE, SEE YOU soon."));
  EXPECT_FALSE(score_output(r, "12345 !"));
  EXPECT_FALSE(score_output(r, ""));
}

TEST(StudyScoring, StartsAndEndsWithCompareWholeWords) {
  ScoringRule ends{RuleKind::kEndsWith, "banana"};
  EXPECT_TRUE(score_output(ends, "Goodbye, see you soon, banana."));
  EXPECT_TRUE(score_output(ends, "BANANA"));
  EXPECT_FALSE(score_output(ends, "Goodbye, see you soon, bananas."));
  EXPECT_FALSE(score_output(ends, "banana, goodbye."));
  ScoringRule starts{RuleKind::kStartsWith, "rocket"};
  EXPECT_TRUE(score_output(starts, "Rocket, the sky is blue."));
  EXPECT_TRUE(score_output(starts, "  \"rocket\" is first"));
  EXPECT_FALSE(score_output(starts, "Rockets, the sky is blue."));
  EXPECT_FALSE(score_output(starts, "The sky is blue, rocket."));
  EXPECT_FALSE(score_output(starts, ""));
}

TEST(StudyScoring, RuleAndFamilyNamesRoundTrip) {
  for (auto k : {RuleKind::kExact, RuleKind::kContains, RuleKind::kWord, RuleKind::kRegex,
                 RuleKind::kUppercase, RuleKind::kStartsWith, RuleKind::kEndsWith}) {
    EXPECT_EQ(parse_rule_kind(to_string(k)), k);
  }
  for (auto f : all_families()) EXPECT_EQ(parse_family(to_string(f)), f);
  EXPECT_THROW(parse_rule_kind("fuzzy"), kvcache::InvalidArgument);
  EXPECT_THROW(parse_family("math"), kvcache::InvalidArgument);
}

TEST(StudyTask, JsonRoundTrip) {
  Task t;
  t.id = "s1-needle-L256-d5-r0";
  t.family = TaskFamily::kNeedle;
  t.depth_pct = 5;
  t.context_target = 256;
  t.approx_tokens = 250;
  t.messages = {{"system", "You are a helpful assistant."}, {"user", "The access code is 1234.\n\"q\""}};
  t.answer = "1234";
  t.rule = {RuleKind::kWord, "1234"};
  t.span = {1, 0, 24};
  t.max_new_tokens = 12;
  const std::string line = task_to_json(t);
  EXPECT_EQ(line.find('\n'), std::string::npos);
  EXPECT_EQ(line.rfind("{\"id\":\"s1-needle-L256-d5-r0\",\"family\":\"needle\",\"depth_pct\":5", 0), 0u);
  Task u = task_from_json(line);
  EXPECT_EQ(task_to_json(u), line);
  EXPECT_EQ(u.messages[1].content, t.messages[1].content);
  EXPECT_EQ(u.span.end, 24);
}

TEST(StudyTask, JsonErrorsNameTheField) {
  try {
    task_from_json(R"({"id":"x","family":"needle","depth_pct":5,"context_target":1,"messages":[]})");
    FAIL() << "expected InvalidArgument";
  } catch (const kvcache::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("messages"), std::string::npos) << e.what();
  }
  try {
    task_from_json(R"({"id":"x","family":"needle","depth_pct":5,"context_target":1,
      "messages":[{"role":"user","content":"abc"}],"answer":"a","rule":{"kind":"word","arg":"a"},
      "span":{"message":0,"begin":1,"end":9}})");
    FAIL() << "expected InvalidArgument";
  } catch (const kvcache::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("span"), std::string::npos) << e.what();
  }
  EXPECT_THROW(task_from_json("not json"), kvcache::InvalidArgument);
}

// Numbers in a task file are range-checked by name (a huge max_new_tokens once reached the
// runner's allocation; a string where a number belongs escaped as a JSON library exception).
TEST(StudyTask, JsonNumbersOutOfRangeNameTheField) {
  auto message = [](const std::string& fields) {
    try {
      (void)task_from_json(R"({"id":"x","family":"needle","depth_pct":5,"context_target":1,)"
                           R"("messages":[{"role":"user","content":"abc"}],"answer":"a","rule":{"kind":"word"})" +
                           fields + "}");
    } catch (const kvcache::InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("valid");
  };
  EXPECT_EQ(message(""), "valid");
  EXPECT_EQ(message(R"(,"max_new_tokens":99999999999999999999)"),
            "task 'x': field 'max_new_tokens' = 1e+20 is out of range [1, 1000000000]");
  EXPECT_EQ(message(R"(,"max_new_tokens":0)"), "task 'x': field 'max_new_tokens' = 0 is out of range [1, 1000000000]");
  EXPECT_EQ(message(R"(,"max_new_tokens":"many")"), "task 'x': field 'max_new_tokens' = \"many\" is not an integer");
  EXPECT_EQ(message(R"(,"max_new_tokens":2.5)"), "task 'x': field 'max_new_tokens' = 2.5 is not an integer");
  EXPECT_EQ(message(R"(,"approx_tokens":-4)"), "task 'x': field 'approx_tokens' = -4 is out of range [0, 1000000000]");
  EXPECT_EQ(message(R"(,"span":[1,2])"), "task 'x': field 'span' is not an object {message, begin, end}");
  EXPECT_EQ(message(R"(,"span":{"message":0,"begin":-2,"end":1})"),
            "task 'x': field 'begin' = -2 is out of range [-1, 9223372036854775807]");
  EXPECT_EQ(message(R"(,"question":{"message":0,"begin":1,"end":3})"), "valid");
  EXPECT_EQ(message(R"(,"question":{"message":0,"begin":1,"end":4})"),
            "task 'x': question [1, 4) of message 0 is outside the message");
  EXPECT_EQ(message(R"(,"question":{"message":1,"begin":0,"end":1})"),
            "task 'x': question [0, 1) of message 1 is outside the message");
  EXPECT_EQ(message(R"(,"question":"end")"), "task 'x': field 'question' is not an object {message, begin, end}");
  EXPECT_EQ(message(R"(,"rule2":0)"), "valid");
  EXPECT_EQ(message(R"(,"max_new_tokens":12)"), "valid");
  EXPECT_EQ(message(R"(,"rule":{"kind":"regex","arg":"(("})").rfind("task 'x': scoring rule regex '((' ", 0), 0u);
  EXPECT_EQ(message(R"(,"rule":{"kind":"word","arg":7})"), "task 'x': field 'arg' = 7 is not a string");
}

TEST(StudyTask, ChatmlOffsetsPointAtContent) {
  std::vector<Message> m = {{"system", "Be brief."}, {"user", "Hi there"}};
  std::vector<int64_t> off;
  const std::string s = render_chatml(m, true, &off);
  EXPECT_EQ(s,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\n");
  ASSERT_EQ(off.size(), 2u);
  EXPECT_EQ(s.substr(static_cast<size_t>(off[0]), 9), "Be brief.");
  EXPECT_EQ(s.substr(static_cast<size_t>(off[1]), 8), "Hi there");
}

TEST(StudyTask, ApproxTokensCountsWordsDigitsPunctuation) {
  EXPECT_EQ(approx_tokens(""), 0);
  EXPECT_EQ(approx_tokens("The access code is 48213."), 4 + 5 + 1);
  EXPECT_EQ(approx_tokens("Hello!\n\n\nWorld"), 4);
  EXPECT_EQ(approx_tokens("<|im_start|>user\nHi<|im_end|>\n"), 6);
}
