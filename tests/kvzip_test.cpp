// SPDX-License-Identifier: Apache-2.0
// KVzip (arXiv 2505.23416): the MAX reduction of attention over a GQA group and rows, the
// policy's survivors on scripted replay scores (ties, protected sinks), the CacheManager's
// replay step (stores nothing; the mass is the max of the plain reference's probabilities),
// and generation on the default model (a budget holding the prompt = the full cache).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "cache_test_util.h"
#include "evict/policies.h"
#include "kvcache/attention.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/model/causal_lm.h"
#include "kvcache/model/runner.h"
#include "kvcache/model/tokenizer.h"
#include "kvcache/torch.h"
#include "model_test_util.h"

namespace kvcache {
namespace {

namespace t = kvcache::testing;

AttentionNeed max_need(int64_t rows, bool per_row) {
  AttentionNeed n;
  n.rows = rows;
  n.per_row = per_row;
  n.reduce = AttentionNeed::Reduce::kMax;
  return n;
}

// 2 KV heads × 7 query heads each (GQA group of 7), 2 rows, 3 keys, hand-set values.
at::Tensor scripted_probs() {
  auto p = at::full({1, 14, 2, 3}, 0.1f);
  p[0][3][1][0] = 0.9f;  // group 0: the max of key 0 is one query head's second row
  p[0][0][0][1] = 0.2f;
  p[0][6][0][2] = 0.5f;
  p.narrow(1, 7, 7).fill_(0.25f);
  p[0][13][0][1] = 0.75f;
  return p;
}

TEST(KVzipReduce, MaxOverTheSevenQueryHeadsOfAGroupAndOverRows) {
  const at::Tensor p = scripted_probs();
  const AttentionMass m = reduce_attention(p, 2, max_need(AttentionNeed::kAllRows, false));
  ASSERT_EQ(m.rows, 1);
  EXPECT_EQ(m.heads[0], (std::vector<float>{0.9f, 0.2f, 0.5f}));
  EXPECT_EQ(m.heads[1], (std::vector<float>{0.25f, 0.75f, 0.25f}));
  // Per row: the max over the group only.
  const AttentionMass r = reduce_attention(p, 2, max_need(AttentionNeed::kAllRows, true));
  ASSERT_EQ(r.rows, 2);
  EXPECT_EQ(r.heads[0], (std::vector<float>{0.1f, 0.2f, 0.5f, 0.9f, 0.1f, 0.1f}));
  // The last row only.
  EXPECT_EQ(reduce_attention(p, 2, max_need(1, false)).heads[0], (std::vector<float>{0.9f, 0.1f, 0.1f}));
  // Not the mean: the default reduction of the same probabilities (mean over 7, sum over 2 rows).
  const AttentionMass mean = reduce_attention(p, 2, AttentionNeed{AttentionNeed::kAllRows, false});
  EXPECT_NEAR(mean.heads[0][0], (13 * 0.1 + 0.9) / 7.0, 1e-6);
  EXPECT_NEAR(mean.heads[1][1], (13 * 0.25 + 0.75) / 7.0, 1e-6);
}

EvictionContext ctx(StepKind step, int64_t resident, int64_t heads = 1) {
  EvictionContext c;
  c.layer = 0;
  c.step = step;
  c.resident.assign(static_cast<size_t>(heads), resident);
  c.new_tokens = 0;
  c.logical_length = resident;
  return c;
}

AttentionMass mass1(std::vector<float> scores) {
  AttentionMass m;
  m.rows = 1;
  m.heads = {std::move(scores)};
  return m;
}

TEST(KVzipPolicy, SpecTableAndErrors) {
  EXPECT_EQ(make_eviction_policy("kvzip:s4:c2048@50%")->spec(), "kvzip@50%");
  EXPECT_EQ(make_eviction_policy("kvzip:s2:c512@64")->spec(), "kvzip:s2:c512@64");
  EXPECT_EQ(make_eviction_policy("adakv:kvzip@50%")->spec(), "adakv:kvzip@50%");
  EXPECT_TRUE(make_eviction_policy("adakv:kvzip@50%")->replay_need().any());
  EXPECT_THROW(make_eviction_policy("kvzip"), InvalidArgument);       // no budget
  EXPECT_THROW(make_eviction_policy("kvzip:s8@8"), CapacityError);    // sinks fill the budget
  EXPECT_THROW(make_eviction_policy("kvzip:c0@50%"), InvalidArgument);
  // Wrappers that cannot run it say so.
  try {
    make_eviction_policy("decode:kvzip@50%");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("context replay"), std::string::npos) << e.what();
  }
  try {
    make_eviction_policy("perlayer(kvzip@25%*1;kvzip@75%*1)");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("perlayer(...) does not run"), std::string::npos) << e.what();
  }
  const ReplayNeed n = make_eviction_policy("kvzip:c100@50%")->replay_need();
  EXPECT_EQ(n.chunk, 100);
  EXPECT_EQ(n.instruction, "Repeat the previous context exactly.");
  EXPECT_EQ(n.attention.rows, AttentionNeed::kAllRows);
  EXPECT_FALSE(n.attention.per_row);
  EXPECT_TRUE(n.attention.reduce == AttentionNeed::Reduce::kMax);
}

// 8 resident tokens, budget 5, sinks s2, no decode reserve (context = prompt). Two replay chunks:
// max = [0.3, 0, 0.3, 0.3, 0.3, 0.05, 0.2, 0.4]. Kept: sinks 0 and 1 (0 scores lowest but is
// protected; sink 0 ties the cut value 0.3), the newest 7, and two of the three tied 0.3 tokens:
// ties keep the more recent (3, 4). Evicted: 2, 5, 6.
TEST(KVzipPolicy, SurvivorsOnScriptedReplayScoresWithTiesAtSinks) {
  auto p = make_eviction_policy("kvzip:s2@5");
  p->reset(8, CacheShape{1, 2, 1});
  EXPECT_TRUE(p->plan(ctx(StepKind::kPrefillEnd, 8)).empty());  // waits for the replay
  p->on_step_end(ctx(StepKind::kPrefillEnd, 8));
  p->observe(0, mass1({0.3f, 0.0f, 0.3f, 0.1f, 0.3f, 0.05f, 0.2f, 0.4f}));
  p->observe(0, mass1({0.1f, 0.0f, 0.1f, 0.3f, 0.1f, 0.05f, 0.1f, 0.1f}));
  const auto& kz = dynamic_cast<const evict::KVzipPolicy&>(*p);
  EXPECT_EQ(kz.scores(0)[0], (std::vector<float>{0.3f, 0.0f, 0.3f, 0.3f, 0.3f, 0.05f, 0.2f, 0.4f}));
  EXPECT_TRUE(p->plan(ctx(StepKind::kReplay, 8)).empty());  // only the last chunk compresses
  const EvictionPlan plan = p->plan(ctx(StepKind::kReplayEnd, 8));
  ASSERT_EQ(plan.evict.size(), 1u);
  EXPECT_EQ(plan.evict[0], (std::vector<int64_t>{2, 5, 6}));
  p->on_evicted(0, plan);
  p->on_step_end(ctx(StepKind::kReplayEnd, 8));
  EXPECT_TRUE(kz.compressed());
  EXPECT_FALSE(p->replay_need().any());
  EXPECT_TRUE(p->plan(ctx(StepKind::kDecode, 6)).empty());  // decode tokens are never evicted
}

TEST(KVzipPolicy, AStepAfterThePromptWithoutTheReplayFails) {
  auto p = make_eviction_policy("kvzip:s1@50%");
  p->reset(10, CacheShape{1, 2, 1});  // budget 5
  EXPECT_TRUE(p->plan(ctx(StepKind::kPrefill, 4)).empty());  // before the prompt's end
  EXPECT_TRUE(p->plan(ctx(StepKind::kDecode, 4)).empty());   // a stream without a prompt end
  p->on_step_end(ctx(StepKind::kPrefillEnd, 8));
  try {
    (void)p->plan(ctx(StepKind::kDecode, 9));
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'kvzip:s1@50%': the context was not replayed"), std::string::npos) << e.what();
  }
  // A replay end without observed replay attention (keep 5 − 2 reserved = 3 of 8).
  EXPECT_THROW((void)p->plan(ctx(StepKind::kReplayEnd, 8)), InvalidArgument);
}

// The same through a CacheManager driven by hand: prefill, then decode without the replay.
TEST(KVzipCache, ABareManagerWithoutTheReplayFailsAtTheNextStep) {
  TorchCache m(t::make_config(1, 4, 2, 8, "fp32", "kvzip@50%", 12));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  m.append(0, t::randn({1, 2, 8, 8}, gen), t::randn({1, 2, 8, 8}, gen), t::positions_range(0, 8));
  (void)m.attend(0, t::randn({1, 4, 8, 8}, gen), t::positions_range(0, 8));
  m.end_step(StepKind::kPrefillEnd);
  EXPECT_EQ(m.tokens(0).max_resident(), 8);
  m.append(0, t::randn({1, 2, 1, 8}, gen), t::randn({1, 2, 1, 8}, gen), t::positions_range(8, 1));
  (void)m.attend(0, t::randn({1, 4, 1, 8}, gen), t::positions_range(8, 1));
  EXPECT_THROW(m.end_step(StepKind::kDecode), InvalidArgument);
  // Replay kinds need begin_replay(), and a replay needs kReplay / kReplayEnd.
  TorchCache f(t::make_config(1, 4, 2, 8, "fp32", "full", 12));
  EXPECT_THROW(f.end_step(StepKind::kReplayEnd), InvalidArgument);
  f.begin_replay();
  EXPECT_THROW(f.begin_replay(), InvalidArgument);
  EXPECT_THROW(f.end_step(StepKind::kDecode), InvalidArgument);
  EXPECT_THROW(f.end_step(StepKind::kReplayEnd), InvalidArgument);  // layer 0 appended nothing
  // A replay on caches whose policies asked for none (h2o needs every step's attention) only
  // computes attention: no plan, nothing stored.
  TorchCache h(t::make_config(1, 4, 2, 8, "fp32", "h2o@6", 12));
  for (TorchCache* c : {&f, &h}) {
    if (c == &h) {
      c->append(0, t::randn({1, 2, 8, 8}, gen), t::randn({1, 2, 8, 8}, gen), t::positions_range(0, 8));
      (void)c->attend(0, t::randn({1, 4, 8, 8}, gen), t::positions_range(0, 8));
      c->end_step(StepKind::kPrefillEnd);
      c->begin_replay();
    }
    const t::Snapshot before(*c);
    const int64_t p0 = c->next_position(0);
    c->append(0, t::randn({1, 2, 3, 8}, gen), t::randn({1, 2, 3, 8}, gen), t::positions_range(p0, 3));
    EXPECT_THROW(c->append(0, t::randn({1, 2, 3, 8}, gen), t::randn({1, 2, 3, 8}, gen), t::positions_range(p0, 3)),
                 InvalidArgument);  // one append per layer and replay step
    EXPECT_THROW((void)c->attend(0, t::randn({1, 4, 2, 8}, gen), t::positions_range(p0, 2)), InvalidArgument);
    (void)c->attend(0, t::randn({1, 4, 3, 8}, gen), t::positions_range(p0, 3));
    c->end_step(StepKind::kReplayEnd);
    before.expect_unchanged(*c, "after a replay its policy did not ask for");
    c->check_invariants();
  }
}

// GQA 14 query heads over 2 KV heads (groups of 7), 2 layers, a 10-token context stored in int8
// (the replay reads the stored, dequantized keys), budget 6 of a 10-token request, sinks s1.
// Two replay chunks of 3 and 300 tokens at positions from 10 on: each changes nothing in the cache, the
// policy's scores are the max over the chunks' rows and the groups of the plain reference's
// probabilities (softmax over the resident keys and the chunk's causal keys), and the last chunk
// keeps per head the sink, the newest token and the top-scored others.
TEST(KVzipCache, ReplayStoresNothingAndScoresByTheMaxOfTheReference) {
  const int64_t L = 2, hq = 14, hkv = 2, d = 8, n = 10;
  TorchCache m(t::make_config(L, hq, hkv, d, "int8", "kvzip:s1@6", n));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  for (int64_t l = 0; l < L; ++l) {
    m.append(l, t::randn({1, hkv, n, d}, gen), t::randn({1, hkv, n, d}, gen), t::positions_range(0, n));
    (void)m.attend(l, t::randn({1, hq, n, d}, gen), t::positions_range(0, n));
  }
  m.end_step(StepKind::kPrefillEnd);
  ASSERT_TRUE(m.replay_need().any());
  std::vector<TensorLayerKV> stored;
  for (int64_t l = 0; l < L; ++l) stored.push_back(m.get(l));
  std::vector<std::vector<std::vector<float>>> expect(static_cast<size_t>(L));  // [layer][head][token]
  for (int chunk = 0; chunk < 2; ++chunk) {
    const int64_t r = chunk == 0 ? 3 : 300;  // 300 rows: the replay attends them in tiles of 128
    const t::Snapshot before(m);
    m.begin_replay();
    for (int64_t l = 0; l < L; ++l) {
      EXPECT_EQ(m.next_position(l), n);  // positions continue after the context, and do not advance
      const at::Tensor k = t::randn({1, hkv, r, d}, gen), v = t::randn({1, hkv, r, d}, gen);
      const at::Tensor q = t::randn({1, hq, r, d}, gen);
      const at::Tensor pos = t::positions_range(n, r);
      m.append(l, k, v, pos);
      const at::Tensor out = m.attend(l, q, pos);
      // The plain reference over [stored context, rope(chunk keys)].
      const TensorLayerKV& s = stored[static_cast<size_t>(l)];
      const at::Tensor kall = at::cat({s.k, t::test_rope(k, pos)}, 2);
      const at::Tensor vall = at::cat({s.v, v}, 2);
      const at::Tensor kpos = at::cat({s.positions, pos.view({1, r}).expand({hkv, r})}, 1).contiguous();
      at::Tensor probs;
      const at::Tensor ref = reference_attention(q, kall, vall, kpos, pos, &probs);
      EXPECT_TRUE(at::allclose(out, ref, 1e-4, 1e-5)) << "layer " << l << " chunk " << chunk;
      const AttentionMass mm =
          reduce_attention(probs.narrow(3, 0, n).contiguous(), hkv, max_need(AttentionNeed::kAllRows, false));
      auto& e = expect[static_cast<size_t>(l)];
      if (e.empty()) e = mm.heads;
      for (int64_t h = 0; h < hkv; ++h) {
        for (int64_t j = 0; j < n; ++j) {
          auto& x = e[static_cast<size_t>(h)][static_cast<size_t>(j)];
          x = std::max(x, mm.heads[static_cast<size_t>(h)][static_cast<size_t>(j)]);
        }
      }
      const auto& kz = dynamic_cast<const evict::KVzipPolicy&>(m.policy());
      for (int64_t h = 0; h < hkv; ++h) {
        const auto& got = kz.scores(l)[static_cast<size_t>(h)];
        ASSERT_EQ(got.size(), static_cast<size_t>(n));
        for (int64_t j = 0; j < n; ++j) {
          EXPECT_NEAR(got[static_cast<size_t>(j)], e[static_cast<size_t>(h)][static_cast<size_t>(j)], 1e-6)
              << "layer " << l << " head " << h << " token " << j;
        }
      }
    }
    if (chunk == 0) {
      m.end_step(StepKind::kReplay);
      before.expect_unchanged(m, "after a replay chunk");  // bytes, counters, peaks, positions, K/V
      m.check_invariants();
    }
  }
  m.end_step(StepKind::kReplayEnd);
  m.check_invariants();
  EXPECT_FALSE(m.replay_need().any());
  for (int64_t l = 0; l < L; ++l) {
    const LayerTokens tk = m.tokens(l);
    EXPECT_EQ(tk.written, n);
    EXPECT_EQ(tk.next_position, n);
    for (int64_t h = 0; h < hkv; ++h) {
      // Keep 6: the sink 0, the newest 9 and the top 4 of tokens 1..8 by the max replay score.
      std::vector<int64_t> mid(8);
      std::iota(mid.begin(), mid.end(), int64_t{1});
      const auto& sc = expect[static_cast<size_t>(l)][static_cast<size_t>(h)];
      std::sort(mid.begin(), mid.end(),
                [&](int64_t a, int64_t b) { return sc[static_cast<size_t>(a)] > sc[static_cast<size_t>(b)]; });
      std::vector<int64_t> keep = {0, 9, mid[0], mid[1], mid[2], mid[3]};
      std::sort(keep.begin(), keep.end());
      EXPECT_EQ(tk.positions[static_cast<size_t>(h)], keep) << "layer " << l << " head " << h;
    }
  }
}

// ------------------------------------------------------------ the default model
std::string default_model() {
  const std::string p = t::source_dir() + "/models/kvstudy-default.pt";
  return std::filesystem::is_regular_file(p) ? p : "";
}

TEST(KVzipRunner, AtABudgetHoldingThePromptItGeneratesWhatTheFullCacheDoes) {
  const std::string pt = default_model();
  if (pt.empty()) GTEST_SKIP() << "models/kvstudy-default.pt is not in this checkout";
  const CausalLM lm = CausalLM::load(pt, LoadOptions{1});
  const Runner runner(lm);
  const Tokenizer tok = Tokenizer::from_texts(lm.tokenizer_files());
  const std::vector<int64_t> prompt =
      tok.encode("The key is 4721. Remember it well, because later you will be asked for the key. What is the key?");
  const auto n = static_cast<int64_t>(prompt.size());
  const std::vector<int64_t> instr = tok.encode("Repeat the previous context exactly.", SpecialTokens::kParse,
                                                PostProcess::kSkip);
  for (const int64_t question_start : {int64_t{0}, n - 6}) {
    GenerationOptions go;
    go.max_new_tokens = 12;
    go.stop_at_eos = false;
    go.question_start = question_start;
    auto full_cfg = lm.cache_config();
    full_cfg.scheme = "fp32";
    full_cfg.policy = "full";
    TorchCache full(full_cfg);
    const GenerationResult want = runner.generate(prompt, go, full);
    EXPECT_EQ(want.replay_steps, 0);
    EXPECT_EQ(want.replay_seconds, 0.0);
    const int64_t context = question_start > 0 ? question_start : n;
    // c7: the context replays in ceil(context / 7) chunks; the budget holds prompt + new tokens.
    for (const std::string policy : {"kvzip@100%", "kvzip:c7@100%", "adakv:kvzip@100%"}) {
      auto cfg = full_cfg;
      cfg.policy = policy;
      TorchCache m(cfg);
      const GenerationResult got = runner.generate(prompt, go, m);
      const std::string where = policy + " question_start " + std::to_string(question_start);
      EXPECT_EQ(got.tokens, want.tokens) << where;
      const int64_t chunk = policy == "kvzip:c7@100%" ? 7 : 2048;
      const int64_t steps = (context + chunk - 1) / chunk;
      EXPECT_EQ(got.replay_steps, steps) << where;
      EXPECT_EQ(got.replay_tokens, context + steps * static_cast<int64_t>(instr.size())) << where;
      EXPECT_GT(got.replay_seconds, 0.0) << where;
      EXPECT_EQ(m.stats().tokens_resident, full.stats().tokens_resident) << where;
      EXPECT_EQ(m.stats().bytes_resident_peak, full.stats().bytes_resident_peak) << where;  // the replay stored nothing
    }
    // The same replay with the instruction given by the caller (GenerationOptions::replay_prefix).
    auto cfg = full_cfg;
    cfg.policy = "kvzip@50%";
    TorchCache a(cfg), b(cfg);
    go.replay_prefix.clear();
    const GenerationResult ra = runner.generate(prompt, go, a);
    go.replay_prefix = instr;
    const GenerationResult rb = runner.generate(prompt, go, b);
    EXPECT_EQ(ra.tokens, rb.tokens);
    // At 50% of prompt + 12 new tokens it evicts: every KV head ends within the budget.
    const int64_t budget = b.policy().token_budget();
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
      const LayerTokens tk = b.tokens(l);
      for (int64_t h = 0; h < cfg.num_kv_heads; ++h) EXPECT_LE(tk.resident(h), budget) << "layer " << l;
    }
    EXPECT_LT(b.stats().tokens_resident, full.stats().tokens_resident);
  }
}

}  // namespace
}  // namespace kvcache
