// SPDX-License-Identifier: Apache-2.0
// Runner::generate_batch / decode_step_batch: several sequences in one forward per step, proven
// against what each sequence generates alone (ragged prompts, early EOS, a full pool), on the
// models of tests/runner_test_util.h.

#include "kvcache/model/runner.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>

#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/model/causal_lm.h"
#include "kvcache/model/tokenizer.h"
#include "kvcache/multi_sequence_cache.h"
#include "kvcache/attention.h"
#include "kvcache/torch.h"
#include "model_test_util.h"
#include "runner_test_util.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;
using namespace kvcache::runner_testing;
namespace t = kvcache::testing;

// ----------------------------------------------------------------------------------------
// Batched decode (Runner::generate_batch): one forward per step for the batch, on every model.

/// Three ragged prompts (13, 9 and 16 tokens) from the model's test prompt; the first and the
/// third share their first 8 tokens (two blocks of 4).
std::vector<std::vector<int64_t>> ragged_prompts(const std::vector<int64_t>& p) {
  std::vector<int64_t> a(p.begin(), p.begin() + 13);
  std::vector<int64_t> b(p.begin() + 3, p.begin() + 12);
  std::vector<int64_t> c(p.begin(), p.begin() + 8);
  for (size_t i : {9, 4, 2, 11, 6, 1, 10, 5}) c.push_back(p[i]);
  return {a, b, c};
}

std::vector<KVCache*> pointers(std::vector<std::unique_ptr<TorchCache>>& caches) {
  std::vector<KVCache*> out;
  for (auto& c : caches) out.push_back(c.get());
  return out;
}

TEST_P(RunnerModels, BatchOfOneIsBitIdenticalToGenerate) {
  // One sequence: the dense layers take the same GEMV path, and q rotated after qkv at
  // position 0 equals q rotated inside qkv, so every logit is the same bits.
  const TestModel& m = GetParam().get();
  REQUIRE_MODEL(m);
  const Runner runner(*m.lm);
  for (const char* quant : {"fp32", "int4"}) {
    CacheConfig c = m.lm->cache_config();
    c.scheme = quant;
    TorchCache alone(c), batched(c);
    GenerationOptions o = greedy(10, 4);
    o.stop_at_eos = false;
    const GenerationResult a = runner.generate(m.prompt, o, alone);
    const std::vector<GenerationResult> b = runner.generate_batch({m.prompt}, o, {&batched});
    ASSERT_EQ(b.size(), 1u);
    EXPECT_EQ(b[0].tokens, a.tokens) << quant;
    EXPECT_TRUE(at::equal(b[0].logits, a.logits)) << quant << ": max diff " << max_abs_diff(b[0].logits, a.logits);
    EXPECT_EQ(b[0].decode_steps, 9);
    EXPECT_EQ(b[0].prompt_tokens, static_cast<int64_t>(m.prompt.size()));
  }
}

TEST_P(RunnerModels, RaggedBatchGeneratesWhatEachSequenceGeneratesAlone) {
  // Three prompts of 13, 9 and 16 tokens decoded together (positions 13.., 9.., 16.. in the
  // same step), over CacheManagers and over the Sequences of one MultiSequenceCache (blocks
  // of 4, the third prompt reusing the first's 8-token prefix), for fp32 and deterministic
  // quantizers, KIVI's per-channel key groups among them (a group never spans two sequences),
  // and with eviction (window@12, int8+h2o@60%: each sequence evicts by its own state).
  // Each sequence's greedy tokens are the ones it generates alone, and so are the logits of
  // its prefill (computed alone in both). The decode steps' dense layers multiply 3 rows (a
  // GEMM) instead of one (a GEMV), which rounds differently: with fp32 storage the logits agree
  // within 1e-5 × the logit scale (measured: 4.7e-7 to 1.2e-6); a quantizer may round a value that
  // sits on a bin edge into the neighbouring bin, so only the tokens are held equal there.
  const TestModel& m = GetParam().get();
  REQUIRE_MODEL(m);
  const Runner runner(*m.lm);
  const auto prompts = ragged_prompts(m.prompt);
  GenerationOptions o = greedy(12, 5);
  o.stop_at_eos = false;
  const std::pair<const char*, const char*> arms[] = {{"fp32", "full"},    {"int8", "full"},
                                                      {"int4:g8", "full"}, {"kivi:k4:v4:g4:r4", "full"},
                                                      {"fp32", "window@12"}, {"int8", "h2o@60%"}};
  for (const auto& arm : arms) {
    const char* quant = arm.first;
    const std::string policy = arm.second;
    CacheConfig c = m.lm->cache_config();
    c.scheme = quant;
    c.policy = policy;
    c.block_tokens = 4;
    // The references: each prompt alone in a CacheManager, and one at a time in a pool of
    // their own (the third then reuses the same prefix and prefills in the same steps as in
    // the batch, which matters with eviction: a window evicts at step ends).
    std::vector<GenerationResult> alone, alone_in_pool;
    for (const auto& p : prompts) {
      TorchCache cache(c);
      alone.push_back(runner.generate(p, o, cache));
    }
    MultiSequenceConfig mc;
    mc.model = c;
    mc.capacity_bytes = int64_t{1} << 30;
    {
      MultiSequenceCache one_at_a_time(mc);
      for (const auto& p : prompts) {
        TorchCache face(one_at_a_time.add_sequence());
        alone_in_pool.push_back(runner.generate(p, o, face));
      }
    }
    std::vector<std::unique_ptr<TorchCache>> managers;
    for (size_t i = 0; i < prompts.size(); ++i) managers.push_back(std::make_unique<TorchCache>(c));
    const std::vector<GenerationResult> in_managers = runner.generate_batch(prompts, o, pointers(managers));

    MultiSequenceCache pool(mc);
    std::vector<std::unique_ptr<TorchCache>> faces;
    for (size_t i = 0; i < prompts.size(); ++i) faces.push_back(std::make_unique<TorchCache>(pool.add_sequence()));
    const std::vector<GenerationResult> in_pool = runner.generate_batch(prompts, o, pointers(faces));
    EXPECT_EQ(in_pool[0].cached_prompt_tokens, 0) << quant;
    EXPECT_EQ(in_pool[1].cached_prompt_tokens, 0) << quant;
    // The third prompt reuses the first's two blocks where the scheme allows it (KIVI's
    // residual of 4 tokens caps a reuse at a multiple of 4 leaving at least 4 to compute).
    // H2O reads attention during prefill, so it reuses nothing (without allow_inexact_reuse).
    EXPECT_EQ(in_pool[2].cached_prompt_tokens, policy == "h2o@60%" ? 0 : 8)
        << quant << "+" << policy << ": " << pool.sequence(2).prefix().limited_by;
    pool.check_invariants();

    ASSERT_EQ(in_managers.size(), 3u);
    ASSERT_EQ(in_pool.size(), 3u);
    for (size_t i = 0; i < prompts.size(); ++i) {
      const double scale = std::max(1.0, alone[i].logits.abs().max().item<double>());
      const std::pair<const GenerationResult*, const GenerationResult*> pairs[] = {{&in_managers[i], &alone[i]},
                                                                             {&in_pool[i], &alone_in_pool[i]}};
      for (const auto& pr : pairs) {
        const GenerationResult& r = *pr.first;
        const GenerationResult& ref = *pr.second;
        EXPECT_EQ(r.tokens, ref.tokens) << quant << "+" << policy << " sequence " << i;
        EXPECT_EQ(r.decode_steps, 11) << quant << "+" << policy << " sequence " << i;
        EXPECT_EQ(r.cached_prompt_tokens, ref.cached_prompt_tokens);
        // The prefill is computed alone in both: the same bits.
        EXPECT_TRUE(at::equal(r.logits[0], ref.logits[0])) << quant << "+" << policy << " sequence " << i;
        if (std::string(quant) == "fp32" && policy == "full") {
          EXPECT_LT(max_abs_diff(r.logits, ref.logits), 1e-5 * scale) << quant << " sequence " << i;
        }
      }
      // Without eviction a reused prefix changes nothing either: the pool's tokens are the
      // CacheManager's.
      if (policy == "full") {
        EXPECT_EQ(in_pool[i].tokens, alone[i].tokens) << quant << " sequence " << i;
      }
      EXPECT_EQ(managers[i]->next_position(0), static_cast<int64_t>(prompts[i].size()) + 11);
    }
    for (Sequence* s : {&pool.sequence(0), &pool.sequence(1), &pool.sequence(2)}) s->finish();
    pool.check_invariants();
  }
}

TEST_P(RunnerModels, SharedPrefixDecodeReadsThePrefixOnceForTheBatch) {
  // Four prompts share their first 32 tokens (4 blocks of 8) and differ in 3 more. The first
  // computes the prefix and publishes it; the other three reuse its blocks. In each of the 5
  // decode steps, every layer's attend_batch reads the 4 shared blocks once per KV head for the
  // 4 sequences (one pass of 4 · G query rows) instead of four times: shared_passes = steps ·
  // layers · H_kv, 32 tokens each, and 3 × 4 blocks of K and V fewer read per (step, layer,
  // head) than with cascade off — whose attention is each sequence's attend(), bit for bit.
  // The cascade merges partial softmax states (float32 rounding): the same greedy tokens,
  // logits within 1e-5 × their scale.
  const TestModel& m = GetParam().get();
  REQUIRE_MODEL(m);
  const Runner runner(*m.lm);
  std::vector<int64_t> prefix;
  while (prefix.size() < 32) prefix.push_back(m.prompt[prefix.size() % m.prompt.size()]);
  std::vector<std::vector<int64_t>> prompts;
  for (size_t i = 0; i < 4; ++i) {
    prompts.push_back(prefix);
    for (size_t j = 0; j < 3; ++j) prompts.back().push_back(m.prompt[(3 * i + j + 1) % m.prompt.size()]);
  }
  CacheConfig c = m.lm->cache_config();
  c.scheme = "fp32";
  c.block_tokens = 8;
  MultiSequenceConfig mc;
  mc.model = c;
  mc.capacity_bytes = int64_t{1} << 30;
  std::vector<GenerationResult> runs[2];
  AttendBatchStats stats[2];
  for (const bool cascade : {false, true}) {
    MultiSequenceCache pool(mc);
    std::vector<std::unique_ptr<TorchCache>> faces;
    for (size_t i = 0; i < prompts.size(); ++i) faces.push_back(std::make_unique<TorchCache>(pool.add_sequence()));
    GenerationOptions o = greedy(6);
    o.stop_at_eos = false;
    o.cascade_attention = cascade;
    o.attention_stats = &stats[cascade];
    runs[cascade] = runner.generate_batch(prompts, o, pointers(faces));
    for (size_t i = 1; i < prompts.size(); ++i) EXPECT_EQ(runs[cascade][i].cached_prompt_tokens, 32) << i;
    pool.check_invariants();
  }
  const int64_t steps = 5, layers = c.num_layers, heads = c.num_kv_heads;
  EXPECT_EQ(stats[0].shared_passes, 0);
  EXPECT_EQ(stats[0].cascaded_requests, 0);
  EXPECT_EQ(stats[1].shared_passes, steps * layers * heads);
  EXPECT_EQ(stats[1].shared_tokens, steps * layers * heads * 32);
  EXPECT_EQ(stats[1].cascaded_requests, steps * layers * 4);
  const int64_t block_bytes = 8 * c.head_dim * 4;  // fp32, one stream
  EXPECT_EQ(stats[0].bytes_read - stats[1].bytes_read, steps * layers * heads * 3 * 4 * 2 * block_bytes);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(runs[1][i].tokens, runs[0][i].tokens) << "sequence " << i;
    const double scale = std::max(1.0, runs[0][i].logits.abs().max().item<double>());
    EXPECT_LT(max_abs_diff(runs[1][i].logits, runs[0][i].logits), 1e-5 * scale) << "sequence " << i;
  }
}

TEST_P(RunnerModels, SequencesLeaveTheBatchAtTheirOwnEos) {
  // The EOS id is the 4th token the second prompt generates alone: that sequence stops after
  // 4 tokens (3 decode steps) while the others run on; every result is what generate() gives
  // with the same options.
  const TestModel& m = GetParam().get();
  REQUIRE_MODEL(m);
  const Runner runner(*m.lm);
  const auto prompts = ragged_prompts(m.prompt);
  GenerationOptions o = greedy(10);
  o.stop_at_eos = false;
  CacheConfig c = m.lm->cache_config();
  {
    TorchCache cache(c);
    o.eos_token_ids = {runner.generate(prompts[1], o, cache).tokens[3]};
  }
  o.stop_at_eos = true;
  std::vector<GenerationResult> alone;
  for (const auto& p : prompts) {
    TorchCache cache(c);
    alone.push_back(runner.generate(p, o, cache));
  }
  ASSERT_TRUE(alone[1].stopped_at_eos);
  std::vector<std::unique_ptr<TorchCache>> managers;
  for (size_t i = 0; i < prompts.size(); ++i) managers.push_back(std::make_unique<TorchCache>(c));
  const std::vector<GenerationResult> batch = runner.generate_batch(prompts, o, pointers(managers));
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(batch[i].tokens, alone[i].tokens) << "sequence " << i;
    EXPECT_EQ(batch[i].stopped_at_eos, alone[i].stopped_at_eos) << "sequence " << i;
    EXPECT_EQ(batch[i].decode_steps, alone[i].decode_steps) << "sequence " << i;
  }
  EXPECT_LE(batch[1].tokens.size(), 4u);
  // The cache of a stopped sequence received no token after its EOS (the last is not fed back).
  EXPECT_EQ(managers[1]->next_position(0),
            static_cast<int64_t>(prompts[1].size() + batch[1].tokens.size()) - 1);
}

/// Bytes of one page of `c` in a MultiSequenceCache (a block of block_tokens tokens in every
/// (layer, KV head, stream) list), measured: one prompt of block_tokens tokens.
int64_t page_bytes(const Runner& runner, const CacheConfig& c, int64_t token) {
  MultiSequenceConfig mc;
  mc.model = c;
  mc.capacity_bytes = int64_t{1} << 30;
  mc.prefix_sharing = false;
  MultiSequenceCache pool(mc);
  Sequence& s = pool.add_sequence();
  const std::vector<int64_t> ids(static_cast<size_t>(c.block_tokens), token);
  s.begin_request(ids, c.block_tokens + 1);
  TorchCache face(s);
  runner.prefill(ids, face);
  return pool.stats().bytes_in_use;
}

/// The batch of PoolFullInTheBatch in a pool of `pages` pages (1 GiB when 0) under `rule`.
struct PoolRun {
  std::vector<GenerationResult> results;
  PrefixCounters counters;
  PoolStats stats;
};

PoolRun run_in_pool(const Runner& runner, const CacheConfig& c, const std::vector<std::vector<int64_t>>& prompts,
                    const GenerationOptions& o, int64_t capacity, PoolFullRule rule, bool sharing) {
  MultiSequenceConfig mc;
  mc.model = c;
  mc.capacity_bytes = capacity;
  mc.prefix_sharing = sharing;
  mc.when_full = rule;
  MultiSequenceCache pool(mc);
  std::vector<std::unique_ptr<TorchCache>> faces;
  for (size_t i = 0; i < prompts.size(); ++i) faces.push_back(std::make_unique<TorchCache>(pool.add_sequence()));
  PoolRun r;
  r.results = runner.generate_batch(prompts, o, pointers(faces));
  pool.check_invariants();
  for (size_t i = 0; i < prompts.size(); ++i) {
    // A sequence that left the batch was finished by the runner: it holds nothing.
    if (r.results[i].status != GenerationStatus::kOk) {
      EXPECT_EQ(pool.sequence(static_cast<int64_t>(i)).stats().bytes_reserved, 0);
    }
    pool.sequence(static_cast<int64_t>(i)).finish();
  }
  pool.check_invariants();
  EXPECT_EQ(pool.stats().running_sequences, 0);
  EXPECT_EQ(pool.stats().bytes_in_use, pool.stats().bytes_cached) << "only the index holds blocks";
  pool.reclaim(std::numeric_limits<int64_t>::max());
  EXPECT_EQ(pool.stats().bytes_in_use, 0) << "every reference count is back to zero";
  pool.check_invariants();
  r.counters = pool.counters();
  r.stats = pool.stats();
  return r;
}

TEST_P(RunnerModels, PoolFullInTheBatchDropsOneSequenceAndTheOthersFinishAsWithoutPressure) {
  // A pool of 11 pages (fp32, blocks of 4 tokens, no prefix sharing), 12 new tokens each (11
  // fed back). kRefuse: prompts of 13, 9 and 24 tokens: the first two prefill 4 + 3 pages, the
  // third's prefill (steps of 5) is refused when it needs its 5th page (7 + 4 = 11 held); it
  // leaves with nothing generated, its 4 pages go back, and the two others grow to 6 + 5 = 11
  // pages and finish. kPreemptNewest: prompts of 13, 9 and 12 tokens (4 + 3 + 3 pages; the third
  // takes the 11th page in decode step 1); in step 4 the first (13 + 4 = 17 tokens) needs a 5th
  // page: the newest request, the third, is preempted and leaves with the 4 tokens it had; the
  // others finish. In both, the sequences that stay generate the tokens of the same batch in a
  // pool with room, the counters are exact, and the pool is consistent, every reference count
  // back to zero once all end (with prefix sharing on, too: the refused prompt's published
  // blocks are reclaimed for the others' growth).
  const TestModel& m = GetParam().get();
  REQUIRE_MODEL(m);
  const Runner runner(*m.lm);
  CacheConfig c = m.lm->cache_config();
  c.scheme = "fp32";
  c.policy = "full";
  c.block_tokens = 4;
  const int64_t page = page_bytes(runner, c, m.prompt[1]);
  ASSERT_GT(page, 0);
  GenerationOptions o = greedy(12, 5);
  o.stop_at_eos = false;
  const std::vector<int64_t> a(m.prompt.begin(), m.prompt.begin() + 13);
  const std::vector<int64_t> b(m.prompt.begin() + 3, m.prompt.begin() + 12);
  std::vector<int64_t> c24, c12;
  for (int64_t i = 0; i < 24; ++i) c24.push_back(m.prompt[static_cast<size_t>((i * 5 + 2) % 15)]);
  c12.assign(c24.begin(), c24.begin() + 12);
  const int64_t roomy = int64_t{1} << 30;

  for (bool sharing : {false, true}) {
    const std::vector<std::vector<int64_t>> prompts = {a, b, c24};
    const PoolRun ref = run_in_pool(runner, c, prompts, o, roomy, PoolFullRule::kRefuse, sharing);
    const PoolRun got = run_in_pool(runner, c, prompts, o, 11 * page, PoolFullRule::kRefuse, sharing);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(got.results[i].status, GenerationStatus::kOk) << i << ": " << got.results[i].error;
      EXPECT_EQ(got.results[i].error, "");
      EXPECT_EQ(got.results[i].tokens, ref.results[i].tokens) << "sequence " << i << " sharing " << sharing;
      EXPECT_EQ(got.results[i].decode_steps, 11);
    }
    const GenerationResult& r = got.results[2];
    EXPECT_EQ(r.status, GenerationStatus::kRefused);
    EXPECT_STREQ(to_string(r.status), "refused");
    EXPECT_TRUE(r.tokens.empty());
    EXPECT_EQ(r.computed_prompt_tokens, 15) << "3 prefill steps of 5 completed; the 4th needed a 5th page";
    EXPECT_EQ(got.results[0].computed_prompt_tokens, 13);
    EXPECT_EQ(got.results[1].computed_prompt_tokens, 9);
    EXPECT_FALSE(r.logits.defined());
    EXPECT_EQ(r.decode_steps, 0);
    EXPECT_THAT(r.error, HasSubstr("sequence 2 needs up to"));
    EXPECT_THAT(r.error, HasSubstr("capacity_bytes = " + std::to_string(11 * page)));
    EXPECT_THAT(r.error, HasSubstr("kRefuse"));
    EXPECT_EQ(got.counters.refusals, 1) << "sharing " << sharing;
    EXPECT_EQ(got.counters.preemptions, 0);
    EXPECT_EQ(ref.counters.refusals, 0);
    EXPECT_EQ(got.stats.bytes_in_use_peak, 11 * page) << "sharing " << sharing;
    if (!sharing) {
      EXPECT_EQ(ref.stats.bytes_in_use_peak, (6 + 5 + 9) * page);
      EXPECT_EQ(got.counters.blocks_reclaimed, 0);
    } else {
      EXPECT_GT(got.counters.blocks_reclaimed, 0) << "the refused prompt's cached blocks made room";
    }
  }
  {
    const std::vector<std::vector<int64_t>> prompts = {a, b, c12};
    const PoolRun ref = run_in_pool(runner, c, prompts, o, roomy, PoolFullRule::kPreemptNewest, false);
    const PoolRun got = run_in_pool(runner, c, prompts, o, 11 * page, PoolFullRule::kPreemptNewest, false);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(got.results[i].status, GenerationStatus::kOk) << i << ": " << got.results[i].error;
      EXPECT_EQ(got.results[i].tokens, ref.results[i].tokens) << "sequence " << i;
      EXPECT_EQ(got.results[i].decode_steps, 11);
    }
    const GenerationResult& r = got.results[2];
    EXPECT_EQ(r.status, GenerationStatus::kPreempted);
    EXPECT_STREQ(to_string(r.status), "preempted");
    ASSERT_EQ(r.tokens.size(), 4u);
    EXPECT_EQ(r.computed_prompt_tokens, 12);
    EXPECT_EQ(r.decode_steps, 3);
    EXPECT_EQ(r.logits.size(0), 4);
    EXPECT_EQ(r.tokens, std::vector<int64_t>(ref.results[2].tokens.begin(), ref.results[2].tokens.begin() + 4));
    EXPECT_THAT(r.error, HasSubstr("sequence 2 was preempted"));
    EXPECT_THAT(r.error, HasSubstr("when sequence 0 needed up to"));
    EXPECT_THAT(r.error, HasSubstr("capacity_bytes = " + std::to_string(11 * page)));
    EXPECT_EQ(got.counters.preemptions, 1);
    EXPECT_EQ(got.counters.refusals, 0);
    EXPECT_EQ(got.stats.bytes_in_use_peak, 11 * page);
    EXPECT_EQ(ref.stats.bytes_in_use_peak, (6 + 5 + 6) * page);
  }
  // decode_step_batch keeps throwing: it has no results to mark.
  {
    MultiSequenceConfig mc;
    mc.model = c;
    mc.capacity_bytes = page;
    mc.prefix_sharing = false;
    MultiSequenceCache pool(mc);
    Sequence& s = pool.add_sequence();
    const std::vector<int64_t> four(a.begin(), a.begin() + 4);
    s.begin_request(four, 8);
    TorchCache face(s);
    runner.prefill(four, face);
    EXPECT_THROW(runner.decode_step_batch({a[5]}, {&face}), PoolFullError);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, RunnerModels,
                         ::testing::Values(ModelParam{"TinyStories656K", &tinystories},
                                           ModelParam{"Stories260K", &stories260k},
                                           ModelParam{"QwenRandom2Layers", &qwen_random_2l}),
                         [](const auto& p) { return std::string(p.param.name); });

}  // namespace
}  // namespace kvcache
