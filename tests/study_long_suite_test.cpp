// SPDX-License-Identifier: Apache-2.0
// The long suite (issue 34): composition, determinism, token-exact lengths, every family's
// scorer on hand-written replies, the evidence of the training mode, the JSONL round trip, the
// lengths grammar.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <map>
#include <regex>
#include <set>

#include "kvcache/error.h"
#include "kvcache/study/long_suite.h"
#include "kvcache/study/task_suite.h"

using namespace kvcache::study;

namespace {

std::string span_text(const Task& t, const Span& s) {
  const auto& c = t.messages.at(static_cast<size_t>(s.message)).content;
  return c.substr(static_cast<size_t>(s.begin), static_cast<size_t>(s.end - s.begin));
}

/// A counter unlike approx_tokens: bytes / 4 of the ChatML text (a coarse tokenizer).
int64_t bytes_over_4(const std::vector<Message>& m) {
  return static_cast<int64_t>(render_chatml(m, true).size() / 4);
}

const Task& first_of(const std::vector<Task>& ts, TaskFamily f) {
  for (const auto& t : ts) {
    if (t.family == f) return t;
  }
  throw std::runtime_error("no task of family " + to_string(f));
}

std::vector<Task> suite_4k() {
  LongSuiteOptions o;
  o.lengths = {4096};
  return generate_long_suite(1234, o);
}

}  // namespace

TEST(LongSuite, CompositionIdsAndDepths) {
  LongSuiteOptions o;
  o.lengths = {4096, 8192};
  o.reps = 2;
  const auto ts = generate_long_suite(77, o);
  ASSERT_EQ(ts.size(), 2u * 2u * 20u);
  std::map<std::pair<int64_t, std::string>, int> cells;
  std::map<int64_t, std::set<int>> depths;
  std::set<std::string> ids;
  for (const auto& t : ts) {
    EXPECT_TRUE(ids.insert(t.id).second) << "duplicate id " << t.id;
    EXPECT_EQ(t.id.rfind("s77-long-" + to_string(t.family) + "-L" + length_label(t.context_target), 0), 0u) << t.id;
    cells[{t.context_target, to_string(t.family)}]++;
    if (t.family == TaskFamily::kNeedle) depths[t.context_target].insert(t.depth_pct);
    else EXPECT_EQ(t.depth_pct, -1) << t.id;
    EXPECT_EQ(t.max_new_tokens, kLongNewTokens) << t.id;
    EXPECT_TRUE(t.evidence.empty()) << t.id << ": evaluation tasks carry no training alignments";
    EXPECT_EQ(t.messages.back().role, "user");
  }
  for (int64_t len : o.lengths) {
    EXPECT_EQ((cells[{len, "needle"}]), 16);
    for (const char* f : {"multikey", "multivalue", "vartrack", "aggregation", "instruction", "multiturn"}) {
      EXPECT_EQ((cells[{len, f}]), 4) << f << " at " << len;
    }
    EXPECT_EQ(depths[len], (std::set<int>{0, 14, 29, 43, 57, 71, 86, 100}));
  }
}

TEST(LongSuite, DeterministicPerSeed) {
  LongSuiteOptions o;
  o.lengths = {4096};
  const auto a = generate_long_suite(5, o);
  const auto b = generate_long_suite(5, o);
  const auto c = generate_long_suite(6, o);
  ASSERT_EQ(a.size(), b.size());
  int differ = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(task_to_json(a[i]), task_to_json(b[i]));
    differ += a[i].answer != c[i].answer;
  }
  EXPECT_GE(differ, 15);  // 20 tasks; the three "uppercase" style answers may coincide
  // Pinned: the long model's evaluation and README's figures depend on these tasks.
  EXPECT_EQ(a[0].id, "s5-long-needle-L4k-d0-r0");
}

TEST(LongSuite, PromptsAreWithinOnePercentBelowTheirTargetForTheGivenCounter) {
  for (const bool coarse : {false, true}) {
    LongSuiteOptions o;
    o.lengths = {4096, 16384};
    if (coarse) o.counter = bytes_over_4;
    for (const auto& t : generate_long_suite(11, o)) {
      const int64_t n = coarse ? bytes_over_4(t.messages) : approx_prompt_tokens(t.messages);
      EXPECT_LE(n, t.context_target) << t.id;
      EXPECT_GE(n, t.context_target - t.context_target / 100) << t.id << (coarse ? " (bytes/4 counter)" : "");
    }
  }
}

TEST(LongSuite, ACounterThatCannotReachTheTargetIsRefusedNamingTheTask) {
  LongSuiteOptions o;
  o.lengths = {4096};
  o.counter = [](const std::vector<Message>& m) { return 5000 + bytes_over_4(m); };  // always over
  try {
    (void)generate_long_suite(1, o);
    FAIL() << "expected InvalidArgument";
  } catch (const kvcache::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("s1-long-needle-L4k-d0-r0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not within 1% below its target of 4096"), std::string::npos) << e.what();
  }
}

TEST(LongSuite, ReferenceRepliesPassAndTheLoadBearingTextIsWhereTheSpanSays) {
  const auto ts = suite_4k();
  for (const auto& t : ts) {
    ASSERT_TRUE(score_output(t.rule, t.answer)) << t.id << ": " << t.answer;
    const std::string s = span_text(t, t.span);
    const std::string& doc = t.messages.back().content;
    switch (t.family) {
      case TaskFamily::kNeedle:
        EXPECT_EQ(s, "The access code is " + t.answer + ".") << t.id;
        EXPECT_EQ(doc.find(t.answer), doc.rfind(t.answer)) << t.id << ": the code occurs once";
        break;
      case TaskFamily::kMultiKey: {
        EXPECT_NE(s.find(" is " + t.answer + "."), std::string::npos) << s;
        // six keyed codes of the same form, one of them asked
        const std::regex re("The access code for the [a-z]+ is [0-9]{5}\\.");
        EXPECT_EQ(std::distance(std::sregex_iterator(doc.begin(), doc.end(), re), std::sregex_iterator()), 6) << t.id;
        break;
      }
      case TaskFamily::kMultiValue: {
        const std::regex re("The (first|second|third|fourth) access code for the [a-z]+ is [0-9]{5}\\.");
        EXPECT_EQ(std::distance(std::sregex_iterator(doc.begin(), doc.end(), re), std::sregex_iterator()), 7) << t.id;
        EXPECT_EQ(t.answer.rfind("first ", 0), 0u) << t.answer;
        break;
      }
      case TaskFamily::kVarTrack: {
        const std::regex re("Let [a-z]+ be [a-z0-9]+\\.");
        EXPECT_EQ(std::distance(std::sregex_iterator(doc.begin(), doc.end(), re), std::sregex_iterator()), 10) << t.id;
        EXPECT_EQ(s.rfind("Let ", 0), 0u) << s;
        break;
      }
      case TaskFamily::kAggregation: {
        // 4096 / 128 = 32 mentions, the answer 10 of them (ceil(0.3 * 32)); no other colour as many
        const std::regex re("A lamp glowed ([a-z]+)\\.");
        std::map<std::string, int> count;
        for (auto it = std::sregex_iterator(doc.begin(), doc.end(), re); it != std::sregex_iterator(); ++it) {
          count[(*it)[1]]++;
        }
        int total = 0, runner_up = 0;
        for (const auto& [c, n] : count) {
          total += n;
          if (t.answer.find(" " + c + " ") == std::string::npos) runner_up = std::max(runner_up, n);
        }
        EXPECT_EQ(total, 32) << t.id;
        const std::string top = t.answer.substr(17, t.answer.size() - 17 - 12);  // "The lamps glowed " X " most often."
        EXPECT_EQ(t.answer, "The lamps glowed " + top + " most often.");
        EXPECT_EQ(count[top], 10) << t.id;
        EXPECT_LE(runner_up, 5) << t.id;
        break;
      }
      case TaskFamily::kInstruction:
        EXPECT_EQ(t.span.message, 0);
        EXPECT_EQ(s.rfind("Always ", 0), 0u) << s;
        break;
      case TaskFamily::kMultiTurn:
        EXPECT_EQ(t.span.message, 1);
        EXPECT_EQ(s.rfind("When I say goodbye,", 0), 0u) << s;
        EXPECT_EQ(t.messages.back().content, "Goodbye!");
        break;
      default:
        ADD_FAILURE() << "not a long family: " << t.id;
    }
    // The filler never contains an answer: the reply's code or rule word appears only where the
    // task puts it.
    if (t.rule.kind == RuleKind::kExact && t.family != TaskFamily::kAggregation) {
      int n = 0;
      for (const auto& m : t.messages) {
        for (size_t p = m.content.find(t.answer); p != std::string::npos; p = m.content.find(t.answer, p + 1)) ++n;
      }
      EXPECT_EQ(n, 1) << t.id;
    }
  }
}

TEST(LongSuite, ScorersOnHandWrittenReplies) {
  const auto ts = suite_4k();
  // needle / multikey: exact code; a near miss (one digit off, extra words) fails
  {
    const Task& t = first_of(ts, TaskFamily::kNeedle);
    std::string off = t.answer;
    off[4] = off[4] == '9' ? '8' : static_cast<char>(off[4] + 1);
    EXPECT_TRUE(score_output(t.rule, t.answer + "<|im_end|>"));
    EXPECT_TRUE(score_output(t.rule, "  " + t.answer + "\n"));
    EXPECT_FALSE(score_output(t.rule, off));
    EXPECT_FALSE(score_output(t.rule, "The access code is " + t.answer + "."));
    EXPECT_FALSE(score_output(t.rule, t.answer + " " + t.answer));
  }
  {
    const Task& t = first_of(ts, TaskFamily::kMultiKey);
    EXPECT_TRUE(score_output(t.rule, t.answer));
    // another key's code of the same task is wrong
    const std::regex re("The access code for the [a-z]+ is ([0-9]{5})\\.");
    const std::string& doc = t.messages.back().content;
    int others = 0;
    for (auto it = std::sregex_iterator(doc.begin(), doc.end(), re); it != std::sregex_iterator(); ++it) {
      if ((*it)[1] != t.answer) {
        EXPECT_FALSE(score_output(t.rule, (*it)[1])) << (*it)[1];
        ++others;
      }
    }
    EXPECT_EQ(others, 5);
  }
  // multivalue: every value in order; the right values in another order, one missing or one
  // extra fail
  {
    const Task& t = first_of(ts, TaskFamily::kMultiValue);
    const std::regex num("[0-9]{5}");
    std::vector<std::string> v;
    for (auto it = std::sregex_iterator(t.answer.begin(), t.answer.end(), num); it != std::sregex_iterator(); ++it) {
      v.push_back(it->str());
    }
    ASSERT_EQ(v.size(), 4u);
    EXPECT_TRUE(score_output(t.rule, v[0] + ", " + v[1] + ", " + v[2] + ", " + v[3]));
    EXPECT_TRUE(score_output(t.rule, "first " + v[0] + ", second " + v[1] + ", third " + v[2] + ", fourth " + v[3] + "."));
    EXPECT_FALSE(score_output(t.rule, v[1] + ", " + v[0] + ", " + v[2] + ", " + v[3]));
    EXPECT_FALSE(score_output(t.rule, v[0] + ", " + v[1] + ", " + v[2]));
    EXPECT_FALSE(score_output(t.rule, v[0] + ", " + v[1] + ", " + v[2] + ", " + v[3] + ", 12345"));
    EXPECT_FALSE(score_output(t.rule, v[0] + v[1] + ", " + v[2] + ", " + v[3]));
  }
  // vartrack: the reply ends with the chain's value; the other chain's value fails
  {
    const Task& t = first_of(ts, TaskFamily::kVarTrack);
    EXPECT_TRUE(score_output(t.rule, t.answer));
    EXPECT_TRUE(score_output(t.rule, t.rule.arg));
    const std::regex re("Let [a-z]+ be ([0-9]{5})\\.");
    const std::string& doc = t.messages.back().content;
    int values = 0;
    for (auto it = std::sregex_iterator(doc.begin(), doc.end(), re); it != std::sregex_iterator(); ++it) {
      ++values;
      if ((*it)[1] != t.rule.arg) {
        EXPECT_FALSE(score_output(t.rule, "x is " + (*it)[1].str() + ".")) << (*it)[1];
      }
    }
    EXPECT_EQ(values, 2);
    EXPECT_FALSE(score_output(t.rule, t.answer.substr(0, t.answer.rfind(' '))));  // stopped one hop short
  }
  // aggregation: exactly the sentence with the most frequent colour
  {
    const Task& t = first_of(ts, TaskFamily::kAggregation);
    EXPECT_TRUE(score_output(t.rule, t.answer));
    EXPECT_TRUE(score_output(t.rule, " " + t.answer + "<|im_end|>"));
    const std::string other = t.answer.find(" ruby ") != std::string::npos ? "slate" : "ruby";
    EXPECT_FALSE(score_output(t.rule, "The lamps glowed " + other + " most often."));
    EXPECT_FALSE(score_output(t.rule, t.answer.substr(0, t.answer.size() - 12) + " and coral most often."));
    EXPECT_FALSE(score_output(t.rule, t.answer.substr(17, t.answer.size() - 29)));  // the colour alone
  }
  // instruction / multiturn: the style the rule asks for
  for (const TaskFamily f : {TaskFamily::kInstruction, TaskFamily::kMultiTurn}) {
    for (const auto& t : ts) {
      if (t.family != f) continue;
      EXPECT_TRUE(score_output(t.rule, t.answer)) << t.id;
      switch (t.rule.kind) {
        case RuleKind::kUppercase:
          EXPECT_FALSE(score_output(t.rule, "Goodbye, see you soon.")) << t.id;
          EXPECT_FALSE(score_output(t.rule, "GOODBYE, see you soon.")) << t.id;
          break;
        case RuleKind::kEndsWith:
          EXPECT_FALSE(score_output(t.rule, t.answer.substr(0, t.answer.rfind(',')) + ".")) << t.id;
          EXPECT_FALSE(score_output(t.rule, t.answer.substr(0, t.answer.size() - 1) + "s.")) << t.id;
          break;
        case RuleKind::kStartsWith:
          EXPECT_FALSE(score_output(t.rule, t.answer.substr(t.answer.find(',') + 2))) << t.id;
          break;
        default:
          ADD_FAILURE() << t.id << " has rule " << to_string(t.rule.kind);
      }
    }
  }
}

TEST(LongSuite, StylesRotateOverLengths) {
  LongSuiteOptions o;
  o.lengths = {4096, 8192, 16384};
  std::set<RuleKind> kinds;
  for (const auto& t : generate_long_suite(3, o)) {
    if (t.family == TaskFamily::kInstruction) kinds.insert(t.rule.kind);
  }
  EXPECT_EQ(kinds, (std::set<RuleKind>{RuleKind::kUppercase, RuleKind::kEndsWith, RuleKind::kStartsWith}));
}

TEST(LongSuite, TrainingEvidencePointsAtWhatTheReplyCopies) {
  LongTrainingOptions o;
  o.min_context = 128;
  o.max_context = 400;
  const auto ts = generate_long_training_tasks(9, 300, o);
  std::map<TaskFamily, int> seen;
  for (const auto& t : ts) {
    EXPECT_EQ(t.id.rfind("longtrain-s9-", 0), 0u);
    ++seen[t.family];
    ASSERT_FALSE(t.evidence.empty()) << t.id;
    for (const auto& e : t.evidence) {
      const std::string reply = t.answer.substr(static_cast<size_t>(e.reply_begin), static_cast<size_t>(e.reply_end - e.reply_begin));
      ASSERT_FALSE(e.sources.empty()) << t.id;
      for (const auto& s : e.sources) {
        const std::string src = span_text(t, s);
        if (t.family == TaskFamily::kAggregation) {
          EXPECT_TRUE(std::regex_match(src, std::regex("[a-z]+"))) << src;  // every mention
        } else if (t.rule.kind == RuleKind::kUppercase) {
          EXPECT_EQ(src, "uppercase") << t.id;
        } else if (t.rule.kind == RuleKind::kStartsWith) {
          EXPECT_EQ(src, t.rule.arg) << t.id;
          EXPECT_EQ(reply[0], static_cast<char>(std::toupper(static_cast<unsigned char>(src[0])))) << t.id;
        } else {
          EXPECT_EQ(src, reply) << t.id << ": reply '" << reply << "' copies '" << src << "'";
        }
      }
    }
    if (t.family == TaskFamily::kAggregation) {
      const std::string& doc = t.messages.back().content;
      const std::regex re("A lamp glowed ([a-z]+)\\.");
      EXPECT_EQ(static_cast<size_t>(std::distance(std::sregex_iterator(doc.begin(), doc.end(), re), std::sregex_iterator())),
                t.evidence[0].sources.size());
    }
  }
  EXPECT_EQ(seen.size(), 7u);
}

TEST(LongSuite, JsonlRoundTripKeepsEveryFieldAndTheEvidence) {
  LongTrainingOptions o;
  auto ts = generate_long_training_tasks(4, 40, o);
  LongSuiteOptions so;
  so.lengths = {4096};
  for (auto& t : generate_long_suite(4, so)) ts.push_back(t);
  char tmpl[] = "/tmp/kvlongXXXXXX";
  const int fd = ::mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  ::close(fd);
  write_tasks_jsonl(tmpl, ts);
  const auto back = read_tasks_jsonl(tmpl);
  std::remove(tmpl);
  ASSERT_EQ(back.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_EQ(task_to_json(back[i]), task_to_json(ts[i]));
    ASSERT_EQ(back[i].evidence.size(), ts[i].evidence.size());
    for (size_t e = 0; e < ts[i].evidence.size(); ++e) {
      EXPECT_EQ(back[i].evidence[e].reply_begin, ts[i].evidence[e].reply_begin);
      EXPECT_EQ(back[i].evidence[e].sources.size(), ts[i].evidence[e].sources.size());
    }
  }
}

TEST(LongSuite, BadEvidenceIsRefusedNamingTheTask) {
  auto t = generate_long_training_tasks(4, 1)[0];
  std::string j = task_to_json(t);
  const auto at = j.find("\"reply\":[");
  ASSERT_NE(at, std::string::npos);
  const std::string bad = j.substr(0, at) + "\"reply\":[0,999]" + j.substr(j.find(']', at) + 1);
  try {
    (void)task_from_json(bad);
    FAIL() << "expected InvalidArgument";
  } catch (const kvcache::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("evidence reply range [0, 999) is outside the answer"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find(t.id), std::string::npos) << e.what();
  }
}

TEST(LongSuite, LengthsGrammar) {
  EXPECT_EQ(parse_lengths("4k,8k,16k"), (std::vector<int64_t>{4096, 8192, 16384}));
  EXPECT_EQ(parse_lengths(" 4096 , 32K"), (std::vector<int64_t>{4096, 32768}));
  EXPECT_EQ(length_label(16384), "16k");
  EXPECT_EQ(length_label(6000), "6000");
  const auto msg = [](const std::string& text) {
    try {
      (void)parse_lengths(text);
    } catch (const kvcache::InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(msg("4k,,8k").find("length '' in '4k,,8k' is empty"), std::string::npos) << msg("4k,,8k");
  EXPECT_NE(msg("4kb").find("length '4kb' in '4kb' is not a whole number of tokens"), std::string::npos);
  EXPECT_NE(msg("256").find("is outside [512, 131072] tokens"), std::string::npos);
  EXPECT_NE(msg("256k").find("is outside [512, 131072] tokens"), std::string::npos);
  EXPECT_NE(msg("4k,4096").find("is given twice"), std::string::npos);
  EXPECT_NE(msg("-4k").find("not a whole number"), std::string::npos);
}

TEST(LongSuite, BadOptionsAreRefused) {
  LongSuiteOptions o;
  o.lengths = {};
  EXPECT_THROW(generate_long_suite(1, o), kvcache::InvalidArgument);
  o.lengths = {4096};
  o.reps = 0;
  EXPECT_THROW(generate_long_suite(1, o), kvcache::InvalidArgument);
  LongTrainingOptions t;
  t.min_context = 40;
  EXPECT_THROW(generate_long_training_tasks(1, 1, t), kvcache::InvalidArgument);
  t = {};
  t.families = {TaskFamily::kSummary};
  try {
    (void)generate_long_training_tasks(1, 1, t);
    FAIL();
  } catch (const kvcache::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'summary' is not a long-suite family"), std::string::npos) << e.what();
  }
  TrainingOptions d;
  d.families = {TaskFamily::kMultiKey};
  try {
    (void)generate_training_tasks(1, 1, d);
    FAIL();
  } catch (const kvcache::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'multikey' is a long-suite family"), std::string::npos) << e.what();
  }
}
