// SPDX-License-Identifier: Apache-2.0
// The model evaluator on the exported TinyStories-656K (../shared): canonical arms, task runs
// with cache stats and span residency, perplexity two ways and KLD inputs, Q/K/V capture parity
// with the managed cache, and a two-arm sweep end to end.
#include <gtest/gtest.h>

#include <regex>

#include "kvcache/error.h"
#include "kvcache/model/causal_lm.h"
#include "kvcache/model/runner.h"
#include "kvcache/model/tokenizer.h"
#include "kvcache/study/model_evaluator.h"
#include "kvcache/study/report.h"
#include "kvcache/study/task_suite.h"
#include "kvcache/torch.h"
#include "model_test_util.h"

using namespace kvcache;
using namespace kvcache::study;
namespace t = kvcache::testing;

namespace {

std::string ts_model() {
  if (!t::have_shared_data()) return "";
  std::string err;
  const auto pt = t::export_hf(t::shared_data() + "/models/tinystories-656k", "ts656k.pt", &err);
  EXPECT_TRUE(err.empty()) << err;
  return pt;
}

std::unique_ptr<ArmEvaluator> evaluator(const std::string& pt) {
  ModelEvaluatorOptions o;
  o.model_path = pt;
  o.threads = 1;
  o.text_tokens = 60;
  o.capture_tokens = 40;
  return make_model_evaluator(o);
}

Task story_task() {
  Task task;
  task.id = "story";
  task.messages = {{"user", "Once upon a time, there was a little girl named Lily. She liked to play."}};
  task.span = {0, 41, 73};  // "She liked to play." ... from "named Lily."
  task.rule = {RuleKind::kContains, "Lily"};
  task.max_new_tokens = 12;
  return task;
}

#define SKIP_WITHOUT_MODEL(pt)                                                            \
  if ((pt).empty()) GTEST_SKIP() << "../shared/data not found next to the repository"

}  // namespace

TEST(StudyModel, CanonicalArmsAndUnsupported) {
  const auto pt = ts_model();
  SKIP_WITHOUT_MODEL(pt);
  auto ev = evaluator(pt);
  // "<file name>@<8 hex digits of the file's FNV-1a>"
  EXPECT_TRUE(std::regex_search(ev->model_id(), std::regex("ts656k\\.pt@[0-9a-f]{8}$"))) << ev->model_id();
  EXPECT_EQ(evaluator(pt)->model_id(), ev->model_id());
  EXPECT_EQ(ev->canonicalize(parse_arm("fp8+h2o@50%")).spec(), "fp8:e4m3+h2o@50%");
  EXPECT_EQ(ev->canonicalize(parse_arm("kivi:k2:v2:g16:r128")).spec(), "kivi:k2:v2:g16:r128+full");
  EXPECT_THROW(ev->canonicalize(parse_arm("kivi:k2:v2:g32:r128")), UnsupportedError);  // head_dim 16
  EXPECT_THROW(ev->canonicalize(parse_arm("int5")), InvalidArgument);
  EXPECT_THROW(ev->canonicalize(parse_arm("fp32+nosuch@50%")), InvalidArgument);
}

TEST(StudyModel, TaskRunsAreDeterministicAndMeasured) {
  const auto pt = ts_model();
  SKIP_WITHOUT_MODEL(pt);
  auto ev = evaluator(pt);
  const Task task = story_task();
  const auto a = ev->run_task(control_arm(), task, QueryMode::kAware);
  const auto b = ev->run_task(control_arm(), task, QueryMode::kAware);
  EXPECT_EQ(a.output, b.output);
  EXPECT_FALSE(a.output.empty());
  EXPECT_GT(a.prompt_tokens, 10);
  EXPECT_GE(a.generated_tokens, 1);
  EXPECT_LE(a.generated_tokens, 12);
  // stats are totals over the 2 layers
  EXPECT_EQ(a.cache.tokens_written, 2 * (a.prompt_tokens + a.generated_tokens - 1));
  EXPECT_EQ(a.cache.tokens_resident, a.cache.tokens_written);
  EXPECT_DOUBLE_EQ(a.span_resident, 1.0);
  const auto w = ev->run_task(parse_arm("fp32+window@50%"), task, QueryMode::kAware);
  EXPECT_LT(w.cache.tokens_resident, w.cache.tokens_written);
  EXPECT_LT(w.cache.bytes_resident_peak, a.cache.bytes_resident_peak);
  EXPECT_GE(w.span_resident, 0.0);
  EXPECT_LE(w.span_resident, 1.0);
}

TEST(StudyModel, AgnosticModeSplitsThePromptAtTheQuestion) {
  // "She liked to play." is the question: in agnostic mode the context ends before it. With the
  // full cache both modes compute the same reply; a task without a question runs as aware.
  const auto pt = ts_model();
  SKIP_WITHOUT_MODEL(pt);
  auto ev = evaluator(pt);
  Task task = story_task();
  const auto aware = ev->run_task(control_arm(), task, QueryMode::kAware);
  EXPECT_EQ(aware.question_tokens, 0);
  EXPECT_EQ(ev->run_task(control_arm(), task, QueryMode::kAgnostic).question_tokens, 0);  // no question
  task.question = {0, 54, 72};  // "She liked to play."
  const auto agnostic = ev->run_task(control_arm(), task, QueryMode::kAgnostic);
  // At least the question's words, and never the whole prompt (the context keeps a token).
  EXPECT_GE(agnostic.question_tokens, 4);
  EXPECT_LT(agnostic.question_tokens, agnostic.prompt_tokens);
  EXPECT_EQ(agnostic.prompt_tokens, aware.prompt_tokens);
  EXPECT_EQ(agnostic.output, aware.output);
  EXPECT_EQ(agnostic.cache.tokens_written, aware.cache.tokens_written);
  EXPECT_EQ(ev->run_task(control_arm(), task, QueryMode::kAware).question_tokens, 0);
}

TEST(StudyModel, TextEvalTwoWays) {
  const auto pt = ts_model();
  SKIP_WITHOUT_MODEL(pt);
  auto ev = evaluator(pt);
  const auto c = ev->eval_text(control_arm());
  const int64_t n = c.single_logprobs.numel();
  ASSERT_GT(n, 40);
  EXPECT_EQ(c.stream_logprobs.numel(), n);
  EXPECT_EQ(c.stream_logits.size(0), n);
  EXPECT_EQ(c.stream_logits.size(1), 2048);  // vocab
  // fp32 + full: streaming token by token equals the single pass.
  EXPECT_NEAR(perplexity(c.single_logprobs), perplexity(c.stream_logprobs), 1e-3 * perplexity(c.single_logprobs));
  EXPECT_TRUE(at::allclose(c.single_logprobs.to(at::kDouble), c.stream_logprobs.to(at::kDouble), 1e-4, 1e-4));
  // Eviction acts only in the streaming pass.
  const auto w = ev->eval_text(parse_arm("fp32+window@25%"));
  EXPECT_TRUE(at::allclose(w.single_logprobs, c.single_logprobs, 1e-5, 1e-5));
  EXPECT_GT(compare_logits(c.stream_logits, w.stream_logits).kld_mean, 1e-4);
  EXPECT_LT(w.cache.tokens_resident, c.cache.tokens_resident);
}

TEST(StudyModel, CapturedQkvMatchesTheManagedCache) {
  const auto pt = ts_model();
  SKIP_WITHOUT_MODEL(pt);
  auto ev = evaluator(pt);
  const auto samples = ev->capture_qkv();
  ASSERT_EQ(samples.size(), 2u);
  const int64_t tok = samples[0].k.size(2);
  EXPECT_EQ(tok, 40);
  EXPECT_EQ(samples[0].q.sizes(), (std::vector<int64_t>{1, 8, tok, 16}));
  EXPECT_EQ(samples[1].k.sizes(), (std::vector<int64_t>{1, 4, tok, 16}));
  // The same ids prefilled through an fp32 full cache hold the same post-RoPE K and V in every
  // layer (layer 1 checks the capture's own attention).
  auto model = CausalLM::load(pt, LoadOptions{1});
  Runner runner(model);
  TorchCache cache(model.cache_config());
  cache.reset(tok);
  const auto ids = Tokenizer::from_texts({model.extra_file("tokenizer.json"), "", "", model.extra_file("tokenizer_config.json")})
                       .encode(filler_passage(1234, 60), SpecialTokens::kIgnore, PostProcess::kApply);
  runner.prefill(std::vector<int64_t>(ids.begin(), ids.begin() + tok), cache);
  for (int64_t l = 0; l < 2; ++l) {
    EXPECT_TRUE(at::allclose(cache.get(l).k, samples[static_cast<size_t>(l)].k, 1e-4, 1e-5)) << "layer " << l;
    EXPECT_TRUE(at::allclose(cache.get(l).v, samples[static_cast<size_t>(l)].v, 1e-4, 1e-5)) << "layer " << l;
  }
  const auto r = ev->reconstruction("int4");
  EXPECT_GT(r.key_rel_err, 0);
  EXPECT_LT(r.key_rel_err, 0.2);
  EXPECT_EQ(ev->reconstruction("fp32").value_rel_err, 0);
}

TEST(StudyModel, SweepEndToEnd) {
  const auto pt = ts_model();
  SKIP_WITHOUT_MODEL(pt);
  auto ev = evaluator(pt);
  SweepOptions o;
  o.arms = {control_arm(), parse_arm("int4+sink@50%"), parse_arm("kivi:k2:v2:g32:r128")};
  auto suite = generate_suite("small", 1);
  o.tasks = {suite[0], suite[19]};
  o.attention_bits = {4};
  t::TempDir dir;
  ResultsStore store(dir / "results.jsonl");
  const auto st = run_sweep(*ev, o, store);
  EXPECT_EQ(st.planned, 4 + 3 + 3 * 3);
  EXPECT_EQ(st.errors, 3 + 1);  // the KIVI-g32 arm (2 tasks + text) and its recon row
  const auto s = summarize(store.rows());
  ASSERT_EQ(s.arms.size(), 3u);
  EXPECT_EQ(s.arms[0].kld_mean, 0);
  EXPECT_GT(s.arms[1].kld_mean, 0);
  EXPECT_LT(s.arms[1].memory_ratio, 0.6);
  EXPECT_GT(s.arms[0].ppl_stream, 1.0);
  EXPECT_EQ(s.attention.size(), 4u);
}
