// SPDX-License-Identifier: Apache-2.0
// The shared-prefix workloads of kv_study (kvcache/study/prefix_workload.h): their structure
// (which prefixes the requests share), and runs on the default model with exact counters
// derived from the requests' token ids, sharing on against sharing off.
#include "kvcache/study/prefix_workload.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "kvcache/error.h"
#include "kvcache/study/task_suite.h"
#include "model_test_util.h"

using namespace kvcache;
using namespace kvcache::study;
namespace t = kvcache::testing;

namespace {

std::string default_model() {
  const std::string p = t::source_dir() + "/models/kvstudy-default.pt";
  return std::filesystem::is_regular_file(p) ? p : "";
}

#define SKIP_WITHOUT_DEFAULT_MODEL(p) \
  if ((p).empty()) GTEST_SKIP() << "models/kvstudy-default.pt is not in this checkout"

const PrefixWorkloadRunner& runner() {
  static const PrefixWorkloadRunner r([] {
    PrefixRunOptions o;
    o.model_path = default_model();
    o.threads = 1;
    o.block_tokens = 16;
    o.prefill_chunk = 64;
    return o;
  }());
  return r;
}

int64_t common_prefix(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return static_cast<int64_t>(n);
}

/// Prompt tokens a request reuses under `fp32+full` in blocks of `block`: whole blocks of the
/// longest prefix it shares with an earlier request's prompt (every earlier prompt's whole
/// blocks are in the index), leaving at least its last token to compute.
int64_t expected_hit(const std::vector<std::vector<int64_t>>& prompts, size_t i, int64_t block) {
  int64_t best = 0;
  for (size_t j = 0; j < i; ++j) best = std::max(best, common_prefix(prompts[i], prompts[j]));
  best = std::min(best, static_cast<int64_t>(prompts[i].size()) - 1);
  return best / block * block;
}

/// The instruction tasks of the default suite's 512 length class, in suite order (the tasks the
/// system_prompt and fewshot families are built from).
std::vector<Task> instruction_512(uint64_t seed) {
  std::vector<Task> out;
  for (const Task& t : generate_suite("default", seed)) {
    if (t.family == TaskFamily::kInstruction && t.context_target == 512) out.push_back(t);
  }
  return out;
}

/// A hand-built instruction task: system prompt, user turn "Question: <q>", rule.
Task hand_instruction(const std::string& id, const std::string& question, ScoringRule rule) {
  Task t;
  t.id = id;
  t.family = TaskFamily::kInstruction;
  t.messages = {{"system", "You are a helpful assistant."}, {"user", "Here is a note.\n\nIt is a calm day.\n\nQuestion: " + question}};
  t.rule = std::move(rule);
  return t;
}

}  // namespace

TEST(StudyPrefix, SystemPromptRequestsShareTheSystemPromptAndNoteAndDifferInTheQuestion) {
  const auto wls = generate_prefix_workloads(1234, 2, 4);
  ASSERT_EQ(wls.size(), 6u);  // system_prompt ×2, multiturn ×2, fewshot ×2
  for (size_t w = 0; w < 2; ++w) {
    const PrefixWorkload& wl = wls[w];
    EXPECT_EQ(wl.family, PrefixFamily::kSystemPrompt);
    EXPECT_TRUE(wl.concurrent);
    ASSERT_EQ(wl.requests.size(), 4u);
    const Task& first = wl.requests[0].task;
    ASSERT_EQ(first.messages.size(), 2u);
    EXPECT_EQ(first.messages[0].role, "system");
    EXPECT_THAT(first.messages[0].content, ::testing::HasSubstr("Always"));  // the instruction
    std::vector<std::string> questions;
    for (const PrefixRequest& r : wl.requests) {
      EXPECT_TRUE(r.scored);
      EXPECT_EQ(r.task.messages[0].content, first.messages[0].content);
      EXPECT_EQ(r.task.rule.kind, first.rule.kind);  // the shared instruction scores every reply
      EXPECT_EQ(r.task.rule.arg, first.rule.arg);
      EXPECT_EQ(r.task.max_new_tokens, first.max_new_tokens);
      // The reference: the asked question's answer in the shared instruction's style.
      EXPECT_TRUE(score_output(r.task.rule, r.task.answer)) << r.task.answer;
      EXPECT_FALSE(r.task.answer.empty());
      const std::string& user = r.task.messages[1].content;
      const size_t q = user.rfind("\n\nQuestion: ");
      ASSERT_NE(q, std::string::npos);
      EXPECT_EQ(user.substr(0, q), first.messages[1].content.substr(0, q));  // the same note
      questions.push_back(user.substr(q));
    }
    std::sort(questions.begin(), questions.end());
    EXPECT_EQ(std::unique(questions.begin(), questions.end()), questions.end()) << "questions repeat in " << wl.id;
  }
  EXPECT_NE(wls[0].requests[0].task.messages[1].content, wls[1].requests[0].task.messages[1].content);
}

TEST(StudyPrefix, MultiTurnRequestsReSendTheHistory) {
  const auto wls = generate_prefix_workloads(1234, 1, 1);
  ASSERT_EQ(wls.size(), 3u);
  const PrefixWorkload& wl = wls[1];
  EXPECT_EQ(wl.family, PrefixFamily::kMultiTurn);
  EXPECT_FALSE(wl.concurrent);
  // A 2-chatter-turn session: the rule turn, two chatter turns, "Goodbye!".
  ASSERT_EQ(wl.requests.size(), 4u);
  for (size_t k = 0; k < wl.requests.size(); ++k) {
    const auto& msgs = wl.requests[k].task.messages;
    EXPECT_EQ(msgs.back().role, "user");
    EXPECT_EQ(wl.requests[k].scored, k + 1 == wl.requests.size());
    if (k == 0) continue;
    const auto& prev = wl.requests[k - 1].task.messages;
    ASSERT_EQ(msgs.size(), prev.size() + 2);  // + the reference reply + the next user turn
    for (size_t m = 0; m < prev.size(); ++m) EXPECT_EQ(msgs[m].content, prev[m].content);
    EXPECT_EQ(msgs[prev.size()].role, "assistant");
    EXPECT_EQ(msgs[prev.size()].content, wl.requests[k - 1].task.answer);
  }
  EXPECT_EQ(wl.requests.back().task.messages.back().content, "Goodbye!");
}

TEST(StudyPrefix, InstructionReplyStylesAnotherTasksAnswer) {
  const Task sky = hand_instruction("sky", "What colour is the sky?", {RuleKind::kUppercase, ""});
  const Task bees = hand_instruction("bees", "What do bees make?", {RuleKind::kEndsWith, "mango"});
  const Task moo = hand_instruction("moo", "What animal says moo?", {RuleKind::kStartsWith, "tiger"});
  EXPECT_EQ(instruction_reply(sky, sky), "THE SKY IS BLUE.");
  EXPECT_EQ(instruction_reply(bees, sky), "BEES MAKE HONEY.");
  EXPECT_EQ(instruction_reply(sky, bees), "The sky is blue, mango.");
  EXPECT_EQ(instruction_reply(sky, moo), "Tiger, the sky is blue.");
  EXPECT_EQ(instruction_reply(moo, moo), "Tiger, a cow says moo.");
  // On the suite: a task's own style of its own question is its reference answer.
  for (const Task& t : instruction_512(1234)) EXPECT_EQ(instruction_reply(t, t), t.answer) << t.id;
}

TEST(StudyPrefix, InstructionReplyErrorsNameTheTask) {
  auto message = [](const Task& q, const Task& s) -> std::string {
    try {
      return "no InvalidArgument: " + instruction_reply(q, s);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
  };
  const Task sky = hand_instruction("sky", "What colour is the sky?", {RuleKind::kUppercase, ""});
  Task needle = sky;
  needle.id = "a-needle";
  needle.family = TaskFamily::kNeedle;
  EXPECT_THAT(message(needle, sky), ::testing::HasSubstr("task 'a-needle' is a needle task, expected an instruction task"));
  EXPECT_THAT(message(sky, needle), ::testing::HasSubstr("task 'a-needle' is a needle task, expected an instruction task"));
  const Task odd = hand_instruction("odd", "What is the access code?", {RuleKind::kUppercase, ""});
  EXPECT_THAT(message(odd, sky), ::testing::HasSubstr("the question of task 'odd', \"What is the access code?\", is not one "
                                                      "of the suite's 12 questions"));
  Task none = sky;
  none.id = "no-question";
  none.messages.back().content = "Here is a note.";
  EXPECT_THAT(message(none, sky), ::testing::HasSubstr("task 'no-question' has no \"Question: \" in its last user turn"));
  Task word = sky;
  word.id = "word-rule";
  word.rule = {RuleKind::kWord, "blue"};
  EXPECT_THAT(message(sky, word), ::testing::HasSubstr("task 'word-rule' has a word rule, expected uppercase, ends_with "
                                                       "or starts_with"));
}

TEST(StudyPrefix, FewShotRequestsShareTheInstructionAndWorkedExamplesAndDifferInTheLastTurn) {
  const std::vector<Task> instr = instruction_512(1234);
  ASSERT_EQ(instr.size(), 14u);
  const auto wls = generate_prefix_workloads(1234, 2, 4);
  ASSERT_EQ(wls.size(), 6u);
  for (size_t w = 0; w < 2; ++w) {
    const PrefixWorkload& wl = wls[4 + w];
    const Task& base = instr[w];
    EXPECT_EQ(wl.id, "fewshot-" + base.id);
    EXPECT_EQ(wl.family, PrefixFamily::kFewShot);
    EXPECT_EQ(to_string(wl.family), "fewshot");
    EXPECT_TRUE(wl.concurrent);
    ASSERT_EQ(wl.requests.size(), 4u);
    const auto& first = wl.requests[0].task.messages;
    // [instruction][example question][example reply][note + question]
    ASSERT_EQ(first.size(), 4u);
    EXPECT_EQ(first[0].role, "system");
    EXPECT_EQ(first[0].content, base.messages[0].content);
    const Task& ex = instr[(w + 1) % 14];
    const std::string& ex_user = ex.messages.back().content;
    EXPECT_EQ(first[1].role, "user");
    EXPECT_EQ(first[1].content, ex_user.substr(ex_user.rfind("\n\nQuestion: ") + 2));  // the question alone
    EXPECT_THAT(first[1].content, ::testing::StartsWith("Question: "));
    EXPECT_EQ(first[2].role, "assistant");
    EXPECT_EQ(first[2].content, instruction_reply(ex, base));
    EXPECT_TRUE(score_output(base.rule, first[2].content)) << first[2].content;
    std::vector<std::string> last;
    for (size_t i = 0; i < wl.requests.size(); ++i) {
      const PrefixRequest& r = wl.requests[i];
      const Task& other = instr[(w + 2 + i) % 14];
      EXPECT_TRUE(r.scored);
      ASSERT_EQ(r.task.messages.size(), 4u);
      for (size_t m = 0; m < 3; ++m) {
        EXPECT_EQ(r.task.messages[m].role, first[m].role);
        EXPECT_EQ(r.task.messages[m].content, first[m].content) << wl.id << " request " << i << " message " << m;
      }
      EXPECT_EQ(r.task.messages[3].role, "user");
      EXPECT_EQ(r.task.messages[3].content, other.messages.back().content);  // note + question
      EXPECT_EQ(r.task.rule.kind, base.rule.kind);  // the base instruction scores every reply
      EXPECT_EQ(r.task.rule.arg, base.rule.arg);
      EXPECT_EQ(r.task.answer, instruction_reply(other, base));
      EXPECT_TRUE(score_output(r.task.rule, r.task.answer)) << r.task.answer;
      EXPECT_EQ(r.task.max_new_tokens, wl.requests[0].task.max_new_tokens);
      EXPECT_GE(r.task.max_new_tokens, approx_tokens(r.task.answer) + 8);
      last.push_back(r.task.messages[3].content);
    }
    std::sort(last.begin(), last.end());
    EXPECT_EQ(std::unique(last.begin(), last.end()), last.end()) << "last turns repeat in " << wl.id;
  }
}

TEST(StudyPrefix, SameAsBaselineCountsScoredRepliesEqualToTheBaselineRun) {
  auto run = [](const std::string& wl, PrefixFamily f, const std::string& arm, bool sharing,
                std::vector<std::string> outputs, std::vector<bool> scored, std::vector<bool> completed = {}) {
    PrefixRunResult r;
    r.workload = wl;
    r.family = f;
    r.arm = arm;
    r.sharing = sharing;
    r.requests = static_cast<int64_t>(outputs.size());
    r.scored = std::count(scored.begin(), scored.end(), true);
    r.request_completed = completed.empty() ? std::vector<bool>(outputs.size(), true) : std::move(completed);
    r.outputs = std::move(outputs);
    r.request_scored = std::move(scored);
    return r;
  };
  const auto sp = PrefixFamily::kSystemPrompt;
  const auto mt = PrefixFamily::kMultiTurn;
  const std::vector<bool> all = {true, true, true};
  const std::vector<PrefixRunResult> results = {
      run("a", sp, "fp32+full", false, {"X", "Y", "Z"}, all),  // the system_prompt baseline
      run("a", sp, "fp32+full", true, {"X", "Y", "W"}, all),   // 2 of 3
      run("a", sp, "int4+full", false, {"X", "Q", "Z"}, all),  // 2 of 3: against fp32+full, not itself
      run("b", sp, "int4+full", true, {"X", "Y", "Z"}, all),   // no fp32+full run of "b"
      run("m", mt, "int4+full", false, {"a", "b", "c"}, {false, false, true}),  // multiturn's baseline: int4+full
      run("m", mt, "int4+full", true, {"a", "x", "c"}, {false, false, true}),   // 1 of 1: unscored replies left out
      run("m", mt, "fp32+full", true, {"a", "b", "y"}, {false, false, true}),   // 0 of 1
      // Requests that ended early (cut short) are compared in neither run.
      run("c", sp, "fp32+full", false, {"X", "", "Z"}, all, {true, false, true}),  // 2 of 2
      run("c", sp, "int4+full", true, {"", "", "Z"}, all, {false, true, true}),    // 1 of 1
      run("b", sp, "fp32+h2o@50%", true, {"X", "Y", "Z"}, all),                    // no baseline run
  };
  const std::vector<std::optional<BaselineAgreement>> same = same_as_baseline(results);
  ASSERT_EQ(same.size(), results.size());
  const std::vector<std::pair<int64_t, int64_t>> want = {{3, 3}, {2, 3}, {2, 3}, {-1, -1}, {1, 1},
                                                         {1, 1}, {0, 1}, {2, 2}, {1, 1},   {-1, -1}};
  for (size_t k = 0; k < results.size(); ++k) {
    if (want[k].first < 0) {
      EXPECT_FALSE(same[k].has_value()) << "result " << k;
      continue;
    }
    ASSERT_TRUE(same[k].has_value()) << "result " << k;
    EXPECT_EQ(same[k]->same, want[k].first) << "result " << k;
    EXPECT_EQ(same[k]->compared, want[k].second) << "result " << k;
  }

  const std::string md = prefix_report_markdown(results);
  EXPECT_THAT(md, ::testing::HasSubstr("| accuracy | same reply as baseline |"));
  // Summed over the row's runs that have a baseline run; "n/a" where none has.
  EXPECT_THAT(md, ::testing::HasSubstr("| system_prompt | fp32+full | on | 1 | 3 | 0.0% (0/3) | 2/3 (66.7%) |"));
  EXPECT_THAT(md, ::testing::HasSubstr("| system_prompt | int4+full | on | 2 | 6 | 0.0% (0/6) | 1/1 (100.0%) |"));
  EXPECT_THAT(md, ::testing::HasSubstr("| system_prompt | fp32+h2o@50% | on | 1 | 3 | 0.0% (0/3) | n/a |"));
  EXPECT_THAT(md, ::testing::HasSubstr("| system_prompt | fp32+full | off | 0.0% | 5/5 (100.0%) |"));
  EXPECT_THAT(md, ::testing::HasSubstr("| multiturn | fp32+full | on | 0.0% | 0/1 (0.0%) |"));
  const std::string json = prefix_results_json(results);
  EXPECT_THAT(json, ::testing::HasSubstr("\"same_as_baseline\": 2"));
  EXPECT_THAT(json, ::testing::HasSubstr("\"compared_with_baseline\": 3"));
  EXPECT_THAT(json, ::testing::HasSubstr("\"same_as_baseline\": null"));
  EXPECT_THAT(json, ::testing::HasSubstr("\"compared_with_baseline\": null"));

  // A malformed run is refused even where it is only the baseline of an earlier one.
  std::vector<PrefixRunResult> bad = {results[1], results[0]};
  bad[1].request_scored.pop_back();
  try {
    (void)same_as_baseline(bad);
    ADD_FAILURE() << "a result with 3 outputs and 2 flags was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("run of workload 'a' under 'fp32+full' has 3 outputs but 2 "
                                               "request_scored and 3 request_completed flags"));
  }
}

TEST(StudyPrefix, BadArgumentsAreNamed) {
  auto message = [](int64_t count, int64_t requests) -> std::string {
    try {
      generate_prefix_workloads(1, count, requests);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "no InvalidArgument";
  };
  EXPECT_THAT(message(0, 4), ::testing::HasSubstr("count must be in [1, 7], got 0"));
  EXPECT_THAT(message(8, 4), ::testing::HasSubstr("count must be in [1, 7], got 8"));
  EXPECT_THAT(message(1, 15), ::testing::HasSubstr("requests must be in [1, 14], got 15"));
  EXPECT_THAT(message(1, 0), ::testing::HasSubstr("requests must be in [1, 14], got 0"));
}

TEST(StudyPrefix, CountersOnTheScriptedWorkloadsAreExact) {
  // fp32+full in blocks of 16 on the default model (4 layers, 2 KV heads): each request reuses
  // exactly the whole blocks of the longest prefix it shares with an earlier prompt, computed
  // here from the token ids; a shared block reference per (layer, KV head, stream) = 16 per
  // block of 16 tokens; nothing is copied or reclaimed (no eviction, 1 GiB pool). The replies
  // are the same with sharing on and off (exact reuse), and sharing lowers the peak pool bytes
  // of the concurrent family.
  const std::string pt = default_model();
  SKIP_WITHOUT_DEFAULT_MODEL(pt);
  const auto wls = generate_prefix_workloads(1234, 1, 4);
  const Arm arm = runner().canonicalize(parse_arm("fp32+full"));
  for (const PrefixWorkload& wl : wls) {
    std::vector<std::vector<int64_t>> prompts;
    int64_t total = 0, hit = 0;
    for (const PrefixRequest& r : wl.requests) {
      prompts.push_back(runner().encode(r.task));
      total += static_cast<int64_t>(prompts.back().size());
    }
    for (size_t i = 0; i < prompts.size(); ++i) hit += expected_hit(prompts, i, 16);
    ASSERT_GT(hit, 0) << wl.id;
    const PrefixRunResult off = runner().run(wl, arm, false);
    const PrefixRunResult on = runner().run(wl, arm, true);
    EXPECT_EQ(off.prompt_tokens, total);
    EXPECT_EQ(off.computed_tokens, total) << wl.id;
    EXPECT_EQ(off.counters.prompt_tokens_hit, 0);
    EXPECT_EQ(off.counters.blocks_shared, 0);
    EXPECT_DOUBLE_EQ(off.sharing_ratio, 1.0);

    EXPECT_EQ(on.prompt_tokens, total);
    EXPECT_EQ(on.counters.requests, static_cast<int64_t>(prompts.size()));
    EXPECT_EQ(on.counters.prompt_tokens_queried, total) << wl.id;
    EXPECT_EQ(on.counters.prompt_tokens_hit, hit) << wl.id;
    EXPECT_EQ(on.computed_tokens, total - hit) << wl.id;
    EXPECT_EQ(on.counters.blocks_shared, hit / 16 * 4 * 2 * 2) << wl.id;
    EXPECT_EQ(on.counters.blocks_copied, 0);
    EXPECT_EQ(on.counters.blocks_reclaimed, 0);
    EXPECT_EQ(on.outputs, off.outputs) << wl.id;
    EXPECT_EQ(on.passed, off.passed) << wl.id;
    EXPECT_EQ(on.scored, wl.family == PrefixFamily::kMultiTurn ? 1 : 4);
    for (const auto& a : same_as_baseline({off, on})) {
      ASSERT_TRUE(a.has_value());
      EXPECT_EQ(a->compared, on.scored) << wl.id;
      EXPECT_EQ(a->same, on.scored) << wl.id;  // exact reuse: sharing on replies as off
    }
    if (wl.concurrent) {
      EXPECT_LT(on.peak_pool_bytes, off.peak_pool_bytes) << wl.id;
      EXPECT_GT(on.sharing_ratio, 1.0) << wl.id;
    } else {
      // One request at a time: the peak is the longest request either way.
      EXPECT_EQ(on.peak_pool_bytes, off.peak_pool_bytes) << wl.id;
    }
  }
}

TEST(StudyPrefix, FewShotControlFollowsTheInstructionAndSharingReusesTheExamples) {
  // fp32+full on the first fewshot workload (8 requests behind the instruction and its worked
  // example): the control follows the base instruction on every request — the family scores
  // the cache, not the model. The requests' prompts share at least the examples' tokens; with
  // sharing each request after the first computes only what follows the whole blocks it shares
  // (exact counts from the token ids), and the replies are the same as without.
  const std::string pt = default_model();
  SKIP_WITHOUT_DEFAULT_MODEL(pt);
  const auto wls = generate_prefix_workloads(1234, 1, 8);
  ASSERT_EQ(wls.size(), 3u);
  const PrefixWorkload& wl = wls[2];
  ASSERT_EQ(wl.family, PrefixFamily::kFewShot);
  Task shared = wl.requests[0].task;
  shared.messages.pop_back();  // [instruction][example question][example reply]
  const std::vector<int64_t> shared_ids = runner().encode(shared);
  std::vector<std::vector<int64_t>> prompts;
  int64_t total = 0, hit = 0;
  for (const PrefixRequest& r : wl.requests) {
    prompts.push_back(runner().encode(r.task));
    total += static_cast<int64_t>(prompts.back().size());
    // Up to the generation prompt's role ("assistant" there, "user" here), the same tokens.
    EXPECT_EQ(common_prefix(prompts.back(), shared_ids), static_cast<int64_t>(shared_ids.size()) - 2) << r.task.id;
  }
  for (size_t i = 1; i < prompts.size(); ++i) {
    EXPECT_GE(common_prefix(prompts[i], prompts[0]), static_cast<int64_t>(shared_ids.size()) - 2);
    EXPECT_LT(common_prefix(prompts[i], prompts[0]), static_cast<int64_t>(prompts[i].size()));  // last turns differ
  }
  for (size_t i = 0; i < prompts.size(); ++i) hit += expected_hit(prompts, i, 16);
  EXPECT_GE(hit, (static_cast<int64_t>(shared_ids.size()) - 2) / 16 * 16 * 7);
  const Arm arm = runner().canonicalize(parse_arm("fp32+full"));
  const PrefixRunResult off = runner().run(wl, arm, false);
  const PrefixRunResult on = runner().run(wl, arm, true);
  EXPECT_EQ(off.scored, 8);
  EXPECT_EQ(off.passed, 8) << ::testing::PrintToString(off.outputs);
  EXPECT_EQ(on.passed, 8);
  EXPECT_EQ(on.outputs, off.outputs);
  EXPECT_EQ(off.computed_tokens, total);
  EXPECT_EQ(on.computed_tokens, total - hit);
  EXPECT_EQ(on.counters.prompt_tokens_hit, hit);
  const auto agree = same_as_baseline({off, on});
  ASSERT_TRUE(agree[1].has_value());
  EXPECT_EQ(agree[1]->compared, 8);
  EXPECT_EQ(agree[1]->same, 8);
}

TEST(StudyPrefix, EvictionBesideSharedBlocksCopiesOnWriteAndCostsAccuracy) {
  // int4+h2o@50% with sharing (allow_inexact_reuse): every request evicts half its context out
  // of blocks it shares with the others; a shared block is never written, its survivors merge
  // into private copies (copied on write > 0; run() checks the pool's invariants). The reused
  // requests' H2O never saw the prefix's attention, so they keep other tokens than computing it
  // would: measured on this workload, 1 of 4 replies follow the instruction against 4 of 4
  // without sharing (docs/study.md, "Prefix sharing").
  const std::string pt = default_model();
  SKIP_WITHOUT_DEFAULT_MODEL(pt);
  const auto wls = generate_prefix_workloads(1234, 1, 4);
  const Arm arm = runner().canonicalize(parse_arm("int4+h2o@50%"));
  const PrefixRunResult on = runner().run(wls[0], arm, true);
  const PrefixRunResult off = runner().run(wls[0], arm, false);
  EXPECT_GT(on.counters.prompt_tokens_hit, 0);
  EXPECT_GT(on.counters.blocks_copied, 0);
  EXPECT_EQ(off.counters.blocks_copied, 0);
  EXPECT_LT(on.computed_tokens, off.computed_tokens);
  EXPECT_EQ(off.passed, 4);
  EXPECT_EQ(on.passed, 1);
  const std::string md = prefix_report_markdown({off, on});
  EXPECT_THAT(md, ::testing::HasSubstr("| system_prompt | int4+h2o@50% | off | 1 | 4 |"));
  EXPECT_THAT(md, ::testing::HasSubstr("copied on write"));
  EXPECT_THAT(prefix_results_json({on}), ::testing::HasSubstr("\"blocks_copied\": " + std::to_string(on.counters.blocks_copied)));
}

TEST(StudyPrefix, APoolTooSmallEndsRequestsEarlyCountedAndSharingMakesItFit) {
  // fp32+full, 4 requests behind one system prompt, and a session: a pool of half the peak the
  // workload needs without sharing (measured in a 1 GiB pool). Without sharing some requests
  // meet the full pool: the system prompt's batch loses the newest (refused in its prefill, or
  // preempted in decode for an older one: PoolFullRule::kPreemptNewest), the session's longest
  // requests are refused; each is counted (a refused request is one refusal of the pool) and
  // scored as failed; run() checked the pool's invariants. With sharing the batch's peak is
  // below the half (the system prompt is held once): nothing ends early and the replies are
  // those of the roomy pool.
  const std::string pt = default_model();
  SKIP_WITHOUT_DEFAULT_MODEL(pt);
  const auto wls = generate_prefix_workloads(1234, 1, 4);
  const Arm arm = runner().canonicalize(parse_arm("fp32+full"));
  for (const PrefixWorkload& wl : wls) {
    const PrefixRunResult roomy_off = runner().run(wl, arm, false);
    const PrefixRunResult roomy_on = runner().run(wl, arm, true);
    EXPECT_EQ(roomy_off.preempted + roomy_off.refused, 0);
    PrefixRunOptions o;
    o.model_path = default_model();
    o.threads = 1;
    o.block_tokens = 16;
    o.prefill_chunk = 64;
    o.pool_bytes = roomy_off.peak_pool_bytes / 2;
    o.when_full = PoolFullRule::kPreemptNewest;
    const PrefixWorkloadRunner small(o);
    const PrefixRunResult off = small.run(wl, arm, false);
    EXPECT_GT(off.preempted + off.refused, 0) << wl.id;
    EXPECT_EQ(off.refused, off.counters.refusals) << wl.id;
    EXPECT_LE(off.preempted, off.counters.preemptions) << wl.id;
    EXPECT_LE(off.peak_pool_bytes, o.pool_bytes) << wl.id;
    if (wl.concurrent) {
      // Every reply passes in the roomy pool; those that ended early fail, the others are the same.
      EXPECT_EQ(roomy_off.passed, roomy_off.scored) << wl.id;
      EXPECT_EQ(off.passed, roomy_off.passed - off.preempted - off.refused) << wl.id;
      // Against the roomy pool's replies: those that ended early are not compared, the others agree.
      const auto agree = same_as_baseline({roomy_off, off});
      ASSERT_TRUE(agree[1].has_value());
      EXPECT_EQ(agree[1]->compared, off.scored - off.preempted - off.refused) << wl.id;
      EXPECT_EQ(agree[1]->same, agree[1]->compared) << wl.id;
    }
    const std::string md = prefix_report_markdown({off});
    EXPECT_THAT(md, ::testing::HasSubstr(" | " + std::to_string(off.preempted) + " | " + std::to_string(off.refused) +
                                         " |\n"));
    EXPECT_THAT(prefix_results_json({off}), ::testing::HasSubstr("\"refused\": " + std::to_string(off.refused)));
    if (wl.family == PrefixFamily::kSystemPrompt) {
      // (A few-shot request shares its instruction and examples, not its note: its peak with
      // sharing stays above half of the peak without.)
      ASSERT_LT(roomy_on.peak_pool_bytes, o.pool_bytes) << wl.id;
      const PrefixRunResult on = small.run(wl, arm, true);
      EXPECT_EQ(on.preempted + on.refused, 0) << wl.id;
      EXPECT_EQ(on.counters.preemptions + on.counters.refusals, 0) << wl.id;
      EXPECT_EQ(on.outputs, roomy_on.outputs) << wl.id;
      EXPECT_EQ(on.passed, roomy_on.passed) << wl.id;
    }
  }
  PrefixRunOptions bad;
  bad.model_path = default_model();
  bad.pool_bytes = 0;
  try {
    PrefixWorkloadRunner r(bad);
    ADD_FAILURE() << "pool_bytes 0 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("pool_bytes must be >= 1, got 0"));
  }
}

// block_tokens 0 picks, per arm, 16 rounded up to the arm's token groups (KIVI g32 keys: 32);
// a given value that is not such a multiple is refused naming the flag, the arm and the group.
TEST(StudyPrefix, AutomaticBlockTokensFollowEachArmsTokenGroups) {
  SKIP_WITHOUT_DEFAULT_MODEL(default_model());
  CacheConfig c;
  c.num_layers = 2;
  c.num_q_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 64;
  c.scheme = "fp32";
  EXPECT_EQ(c.block_tokens_multiple(), 1);
  c.scheme = "int4:g32:chan";
  EXPECT_EQ(c.block_tokens_multiple(), 32);
  c.scheme = "kivi:k2:v2:g32:r128";
  EXPECT_EQ(c.block_tokens_multiple(), 32);
  c.scheme = "layers(fp32*1;int8:g16:chan*1)";
  EXPECT_EQ(c.block_tokens_multiple(), 16);

  const Arm kivi = parse_arm("kivi:k2:v2:g32:r128+full");
  try {
    (void)runner().canonicalize(kivi);  // block_tokens 16
    ADD_FAILURE() << "block_tokens 16 was accepted for KIVI g32";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("block tokens (--block-tokens) = 16 is not a multiple of arm "
                                               "'kivi:k2:v2:g32:r128+full''s quantizer group of 32 tokens"));
  }
  PrefixRunOptions o;
  o.model_path = default_model();
  o.threads = 1;
  o.prefill_chunk = 64;
  ASSERT_EQ(o.block_tokens, 0);
  const PrefixWorkloadRunner automatic(o);
  const auto wls = generate_prefix_workloads(1234, 1, 2);
  const PrefixRunResult k = automatic.run(wls.front(), automatic.canonicalize(kivi), true);
  EXPECT_EQ(k.block_tokens, 32);
  EXPECT_EQ(k.preempted + k.refused, 0);
  const PrefixRunResult f = automatic.run(wls.front(), automatic.canonicalize(parse_arm("fp32+full")), true);
  EXPECT_EQ(f.block_tokens, 16);
  EXPECT_THAT(prefix_results_json({f}), ::testing::HasSubstr("\"block_tokens\": 16"));
}
