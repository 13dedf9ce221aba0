// SPDX-License-Identifier: Apache-2.0
// MultiSequenceCache: many sequences over one block pool with prefix sharing. A synthetic
// model gives every (token id, position, layer) fixed K, V and q rows, so two sequences that
// see the same prompt store the same bytes; a sequence that reuses a cached prefix is then held
// to one that computed it (a plain CacheManager), bit for bit, for every deterministic format.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "cache/block_list.h"
#include "cache/cache_manager_access.h"
#include "cache/layer_store.h"
#include "cache/multi_sequence_access.h"
#include "cache_test_util.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/multi_sequence_cache.h"
#include "kvcache/torch.h"

namespace kvcache {
namespace {

using Ids = std::vector<int64_t>;
using cache::MultiSequenceAccess;
using testing::make_config;

constexpr int64_t kL = 2, kHq = 4, kHkv = 2, kD = 16;

/// Rows of tokens ids[from, from + n) at positions from.. in `layer`: [1, heads, n, D] float32,
/// a fixed function of (id, position, layer, head, channel, which: 0 = K, 1 = V, 2 = q).
at::Tensor synth(const Ids& ids, int64_t from, int64_t n, int64_t layer, int which, int64_t heads) {
  const auto dbl = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor id = at::tensor(at::ArrayRef<int64_t>(ids.data() + from, static_cast<size_t>(n))).to(at::kDouble).view({1, 1, n, 1});
  const at::Tensor pos = at::arange(from, from + n, dbl).view({1, 1, n, 1});
  const at::Tensor h = at::arange(heads, dbl).view({1, heads, 1, 1});
  const at::Tensor d = at::arange(kD, dbl).view({1, 1, 1, kD});
  const at::Tensor x = at::sin(0.37 * id + 0.11 * pos + 1.3 * static_cast<double>(layer) + 0.7 * h + 0.29 * d +
                               2.1 * which) *
                       (1.0 + 0.5 * at::cos(0.05 * id * (d + 1.0)));
  return x.to(at::kFloat);
}

/// One step of ids[from, from + n) through every layer: append, attend. Returns the attention
/// outputs of the layers, stacked: [L, 1, H_q, n, D].
at::Tensor step(SequenceCache& seq, const Ids& ids, int64_t from, int64_t n, StepKind kind) {
  TorchCache c(seq);  // the at::Tensor face of the sequence (or manager)
  std::vector<at::Tensor> out;
  for (int64_t l = 0; l < kL; ++l) {
    EXPECT_EQ(c.next_position(l), from);
    const at::Tensor pos = at::arange(from, from + n, at::kLong);
    c.append(l, synth(ids, from, n, l, 0, kHkv), synth(ids, from, n, l, 1, kHkv), pos);
    out.push_back(c.attend(l, synth(ids, from, n, l, 2, kHq), pos));
  }
  c.end_step(kind);
  return at::stack(out);
}

/// Prefill of ids[start, n_prompt) as the runner does it (first step ≥ first_min, then chunks
/// of `chunk`, 0 = the rest in one step), then `decode` tokens ids[n_prompt ..]: every step's
/// outputs, in order.
std::vector<at::Tensor> run(SequenceCache& c, const Ids& prompt_ids, int64_t n_prompt, int64_t start, int64_t chunk,
                            int64_t first_min, int64_t decode) {
  // Decoded tokens past the end of `prompt_ids` are a fixed function of their index (the
  // callers pass only the prompt).
  Ids ids = prompt_ids;
  while (static_cast<int64_t>(ids.size()) < n_prompt + decode) {
    ids.push_back(3 + (static_cast<int64_t>(ids.size()) * 11) % 50);
  }
  std::vector<at::Tensor> out;
  if (chunk == 0) chunk = n_prompt;
  for (int64_t s = start; s < n_prompt;) {
    const int64_t t = std::min(s == start ? std::max(chunk, first_min) : chunk, n_prompt - s);
    out.push_back(step(c, ids, s, t, s + t == n_prompt ? StepKind::kPrefillEnd : StepKind::kPrefill));
    s += t;
  }
  for (int64_t i = 0; i < decode; ++i) out.push_back(step(c, ids, n_prompt + i, 1, StepKind::kDecode));
  return out;
}

Ids tokens(int64_t first, int64_t n) {
  Ids t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = first + (i * 7) % 50;
  return t;
}

Ids cat(Ids a, const Ids& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

MultiSequenceConfig pool_config(const CacheConfig& model, int64_t capacity = int64_t{1} << 30) {
  MultiSequenceConfig c;
  c.model = model;
  c.capacity_bytes = capacity;
  return c;
}

/// FNV-1a of n bytes.
uint64_t fnv(const uint8_t* p, int64_t n) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

/// The hash of every block the index holds, by its memory.
std::map<const uint8_t*, uint64_t> hash_cached(const MultiSequenceCache& c) {
  std::map<const uint8_t*, uint64_t> h;
  for (const auto& b : MultiSequenceAccess::cached_blocks(c)) h[b.data] = fnv(b.data, b.bytes);
  return h;
}

/// Every block of `before` is still cached, with the same bytes (blocks cached since may be added).
void expect_unchanged(const std::map<const uint8_t*, uint64_t>& before, const MultiSequenceCache& c) {
  const auto now = hash_cached(c);
  for (const auto& [data, h] : before) {
    const auto it = now.find(data);
    ASSERT_NE(it, now.end()) << "a cached block left the index";
    EXPECT_EQ(it->second, h) << "a byte of a cached block changed";
  }
}

void expect_same_state(const SequenceCache& a, const SequenceCache& b, const std::string& where) {
  for (int64_t l = 0; l < kL; ++l) {
    const LayerTokens ta = a.tokens(l), tb = b.tokens(l);
    EXPECT_EQ(ta.positions, tb.positions) << where << " layer " << l;
    EXPECT_EQ(ta.written, tb.written) << where;
    EXPECT_EQ(ta.stats.bytes_resident, tb.stats.bytes_resident) << where << " layer " << l;
    EXPECT_EQ(ta.stats.bytes_reserved, tb.stats.bytes_reserved) << where << " layer " << l;
    for (bool key : {true, false}) {
      const auto sa = cache::CacheManagerAccess::stream(a, l, key), sb = cache::CacheManagerAccess::stream(b, l, key);
      EXPECT_EQ(sa.quantized_tokens, sb.quantized_tokens) << where;
      EXPECT_EQ(sa.residual_tokens, sb.residual_tokens) << where;
      EXPECT_EQ(sa.blocks, sb.blocks) << where << " layer " << l << (key ? " K" : " V") << ": the same block layout";
      for (size_t h = 0; h < sa.stored.size(); ++h) {
        EXPECT_TRUE(at::equal(as_tensor(sa.stored[h]), as_tensor(sb.stored[h]))) << where << " layer " << l << " head " << h;
      }
    }
  }
}

// ----------------------------------------------------------------------------------------
// A reused prefix computes exactly what computing it computes.

struct ReuseCase {
  const char* name;
  const char* scheme;  ///< CacheConfig::scheme
  int64_t residual;   ///< CacheConfig::residual_length
  const char* policy;
  int64_t chunk;      ///< prefill chunk after the prefix
  int64_t cached;     ///< expected reused tokens of B's prompt
  int64_t min_step;   ///< expected PrefixReuse::min_first_step
  bool copies;        ///< expect copies on write
};

void PrintTo(const ReuseCase& c, std::ostream* os) { *os << c.name; }

class PrefixReuse : public ::testing::TestWithParam<ReuseCase> {};

TEST_P(PrefixReuse, IsBitIdenticalToComputingThePrefix) {
  const ReuseCase& rc = GetParam();
  CacheConfig model = make_config(kL, kHq, kHkv, kD, rc.scheme, rc.policy, 0);
  model.residual_length = rc.residual;
  model.block_tokens = 8;
  MultiSequenceCache cache(pool_config(model));
  const Ids shared = tokens(3, 40);  // five blocks of 8
  const Ids a_ids = cat(cat(shared, tokens(60, 13)), tokens(200, 3));
  const Ids b_ids = cat(cat(shared, tokens(80, 20)), tokens(300, 6));
  const int64_t na = 53, nb = 60;

  Sequence& a = cache.add_sequence();
  EXPECT_EQ(a.begin_request(Ids(a_ids.begin(), a_ids.begin() + na), 100).cached_tokens, 0);
  run(a, a_ids, na, 0, 16, 0, 3);
  cache.check_invariants();

  Sequence& b = cache.add_sequence();
  const auto hashes = hash_cached(cache);
  ASSERT_FALSE(hashes.empty());
  const kvcache::PrefixReuse r = b.begin_request(Ids(b_ids.begin(), b_ids.begin() + nb), 100);
  EXPECT_EQ(r.cached_tokens, rc.cached) << b.prefix().limited_by;
  EXPECT_EQ(r.min_first_step, rc.min_step);
  EXPECT_EQ(b.prefix().prompt_tokens, nb);
  EXPECT_EQ(b.prefix().computed_tokens(), nb - rc.cached);
  cache.check_invariants();
  const auto out = run(b, b_ids, nb, r.cached_tokens, rc.chunk, r.min_first_step, 6);
  cache.check_invariants();

  // The reference: a plain CacheManager that appends the prefix itself (one step), then the same steps.
  TorchCache alone(cache.config().model);
  alone.reset(100);
  if (r.cached_tokens > 0) step(alone.core(), b_ids, 0, r.cached_tokens, StepKind::kPrefill);
  const auto ref = run(alone.core(), b_ids, nb, r.cached_tokens, rc.chunk, r.min_first_step, 6);
  ASSERT_EQ(out.size(), ref.size());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_TRUE(at::equal(out[i], ref[i])) << "step " << i;
  expect_same_state(b, alone.core(), rc.name);
  expect_unchanged(hashes, cache);
  if (rc.copies) {
    EXPECT_GT(b.blocks_copied(), 0) << "eviction inside the shared prefix copied blocks on write";
  } else {
    EXPECT_EQ(b.blocks_copied(), 0);
  }
  EXPECT_EQ(cache.counters().blocks_copied, a.blocks_copied() + b.blocks_copied());
}

INSTANTIATE_TEST_SUITE_P(
    Formats, PrefixReuse,
    ::testing::Values(
        ReuseCase{"fp32", "fp32", 0, "full", 7, 40, 0, false}, ReuseCase{"fp16", "fp16", 0, "full", 20, 40, 0, false},
        ReuseCase{"bf16", "bf16", 0, "full", 5, 40, 0, false},
        ReuseCase{"fp8_e4m3", "fp8:e4m3", 0, "full", 8, 40, 0, false},
        ReuseCase{"int8", "int8", 0, "full", 3, 40, 0, false}, ReuseCase{"int4", "int4:g8", 0, "full", 20, 40, 0, false},
        ReuseCase{"int2", "int2:g16", 0, "full", 1, 40, 0, false},
        // Per-channel groups of 8 tokens, flushed in blocks of 8.
        ReuseCase{"int4_chan", "int4:g8:chan", 0, "full", 9, 40, 0, false},
        // A sliding residual of 8 tokens: the first step after the prefix carries >= 8 tokens.
        ReuseCase{"int4_residual", "int4:g8", 8, "full", 3, 40, 8, false},
        // KIVI: keys flushed in blocks of r = 16 (reuse in multiples of 16: 32 of 40), values sliding 16.
        ReuseCase{"kivi", "kivi:k2:v2:g8:r16", 0, "full", 5, 32, 16, false},
        // Hadamard-rotated streams (the index key holds the scheme's spec): plain, and keys only
        // around KIVI (its block-flushed keys still set the granularity).
        ReuseCase{"had_int4", "had(int4:g8)", 0, "full", 7, 40, 0, false},
        ReuseCase{"had_k_kivi", "had:k(kivi:k2:v2:g8:r16)", 0, "full", 5, 32, 16, false},
        // GEAR: both streams compressed in blocks of nb = 8 tokens (outliers and factors inside).
        ReuseCase{"gear", "gear:b2:g8:s0.25:r1:loop1:nb8", 0, "full", 9, 40, 0, false},
        // GEAR re-compressing every older block at each decode-step flush (`whole`; prompt blocks
        // at rank rp2): the shared prefix blocks are copied before they are rewritten.
        ReuseCase{"gear_whole", "gear:b2:g8:s0.25:r1:loop1:nb8:rp2:whole", 0, "full", 9, 40, 0, true},
        // Eviction inside the shared prefix: window frees whole blocks (no copy), random leaves
        // holes that merge (copy-on-write), KIVI's per-channel groups convert (copy-on-write).
        ReuseCase{"fp16_window", "fp16", 0, "window@44", 6, 40, 0, false},
        ReuseCase{"int8_sink", "int8", 0, "sink:s4@44", 6, 40, 0, true},
        ReuseCase{"int4_random", "int4:g8", 0, "random:seed5@41", 6, 40, 0, true},
        ReuseCase{"kivi_random", "kivi:k4:v2:g8:r16", 0, "random:seed2@34", 16, 32, 16, true}),
    [](const auto& p) { return std::string(p.param.name); });

// ----------------------------------------------------------------------------------------

TEST(MultiSequenceCache, ExactnessRulesLimitTheMatch) {
  const Ids prompt = tokens(1, 48);
  auto publish = [&](MultiSequenceCache& c, const Ids& ids) {
    Sequence& s = c.add_sequence();
    s.begin_request(ids, 64);
    run(s, ids, static_cast<int64_t>(ids.size()), 0, 0, 0, 1);
    return &s;
  };
  CacheConfig model = make_config(kL, kHq, kHkv, kD, "fp16", "full");
  model.block_tokens = 8;
  {
    // The same prompt again: everything is cached, one block is computed (the last token's logits).
    MultiSequenceCache c(pool_config(model));
    publish(c, prompt);
    Sequence& s = c.add_sequence();
    EXPECT_EQ(s.begin_request(prompt, 64).cached_tokens, 40);
    EXPECT_EQ(s.prefix().indexed_tokens, 48);
    EXPECT_NE(s.prefix().limited_by.find("at least one prompt token"), std::string::npos) << s.prefix().limited_by;
    // int4 sequences never see fp16 blocks: another namespace.
    CacheConfig int4 = model;
    int4.scheme = "int4";
    Sequence& q = c.add_sequence(int4);
    EXPECT_EQ(q.begin_request(prompt, 64).cached_tokens, 0);
    EXPECT_EQ(q.prefix().indexed_tokens, 0);
    // Nor do Hadamard-rotated ones (had(fp16) stores H·x): the key holds the scheme's spec.
    CacheConfig had = model;
    had.scheme = "had(fp16)";
    Sequence& r = c.add_sequence(had);
    EXPECT_EQ(r.begin_request(prompt, 64).cached_tokens, 0);
    EXPECT_EQ(r.prefix().indexed_tokens, 0);
    // An attention-reading policy reuses nothing unless allowed; a budget caps the prefix.
    CacheConfig h2o = model;
    h2o.policy = "h2o@32";
    Sequence& h = c.add_sequence(h2o);
    EXPECT_EQ(h.begin_request(prompt, 64).cached_tokens, 0);
    EXPECT_NE(h.prefix().limited_by.find("reads the prompt's attention"), std::string::npos) << h.prefix().limited_by;
    CacheConfig window = model;
    window.policy = "window@20";
    Sequence& w = c.add_sequence(window);
    EXPECT_EQ(w.begin_request(prompt, 64).cached_tokens, 16);
    EXPECT_NE(w.prefix().limited_by.find("would evict"), std::string::npos) << w.prefix().limited_by;
    CacheConfig scaled = model;
    scaled.scheme = "fp8:e4m3:scaled";
    Sequence& f = c.add_sequence(scaled);
    EXPECT_EQ(f.begin_request(prompt, 64).cached_tokens, 0);
    EXPECT_NE(f.prefix().limited_by.find("first write"), std::string::npos) << f.prefix().limited_by;
    c.check_invariants();
  }
  {
    MultiSequenceConfig inexact = pool_config(model);
    inexact.allow_inexact_reuse = true;
    MultiSequenceCache c(inexact);
    publish(c, prompt);
    CacheConfig h2o = model;
    h2o.policy = "h2o@32";
    Sequence& h = c.add_sequence(h2o);
    EXPECT_EQ(h.begin_request(prompt, 64).cached_tokens, 32) << h.prefix().limited_by;
    run(h, prompt, 48, 32, 8, 0, 2);  // runs: its scores simply never saw the prefix's attention
    c.check_invariants();
  }
  {
    // A sliding residual: at least R prompt tokens computed, and a first step of at least R.
    CacheConfig resid = model;
    resid.scheme = "int8";
    resid.residual_length = 12;
    MultiSequenceCache c(pool_config(resid));
    const Ids longer = cat(prompt, tokens(90, 8));
    Sequence& a = c.add_sequence();
    a.begin_request(longer, 80);
    run(a, longer, 56, 0, 0, 0, 12);  // decode until the prompt's last block has left the residual
    Sequence& s = c.add_sequence();
    const auto r = s.begin_request(prompt, 64);
    EXPECT_EQ(r.cached_tokens, 32);  // 48 − 12 = 36, whole blocks: 32
    EXPECT_EQ(r.min_first_step, 12);
    EXPECT_NE(s.prefix().limited_by.find("sliding residual of 12"), std::string::npos) << s.prefix().limited_by;
    try {
      step(s, prompt, 32, 4, StepKind::kPrefill);
      ADD_FAILURE() << "a first step of 4 < 12 tokens was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("at least 12 tokens"), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.tokens(0).written, 32) << "the rejected step changed nothing";
    step(s, prompt, 32, 16, StepKind::kPrefillEnd);
    c.check_invariants();
  }
  {
    MultiSequenceConfig off = pool_config(model);
    off.prefix_sharing = false;
    MultiSequenceCache c(off);
    publish(c, prompt);
    Sequence& s = c.add_sequence();
    EXPECT_EQ(s.begin_request(prompt, 64).cached_tokens, 0);
    EXPECT_EQ(c.counters().requests, 0);
    EXPECT_EQ(c.stats().cached_blocks, 0);
  }
}

TEST(MultiSequenceCache, CountersOnAScriptedWorkload) {
  // 2 layers × 2 KV heads × (K, V) = 8 block lists; fp16 blocks of 8 tokens × D 16 = 256 B.
  CacheConfig model = make_config(kL, kHq, kHkv, kD, "fp16", "full");
  model.block_tokens = 8;
  MultiSequenceCache c(pool_config(model));
  const Ids s24 = tokens(5, 24);
  const Ids p1 = cat(s24, tokens(100, 8)), p2 = cat(s24, tokens(120, 8));
  Sequence& r1 = c.add_sequence();
  Sequence& r2 = c.add_sequence();
  Sequence& r3 = c.add_sequence();
  EXPECT_EQ(r1.begin_request(p1, 40).cached_tokens, 0);
  run(r1, p1, 32, 0, 0, 0, 0);
  // r1 published its 4 whole blocks: 4 pages × 8 lists.
  EXPECT_EQ(c.counters().blocks_published, 32);
  const PrefixCounters after_r1 = c.counters();
  EXPECT_EQ(r2.begin_request(p2, 40).cached_tokens, 24);  // the shared 24 tokens
  run(r2, p2, 32, 24, 0, 0, 0);
  EXPECT_EQ(r3.begin_request(p1, 40).cached_tokens, 24);  // all 32 cached; the last block is computed
  run(r3, p1, 32, 24, 0, 0, 0);
  const PrefixCounters n = c.counters();
  EXPECT_EQ(n.requests, 3);
  EXPECT_EQ(n.prompt_tokens_queried, 96);
  EXPECT_EQ(n.prompt_tokens_hit, 48);
  EXPECT_DOUBLE_EQ(n.hit_rate(), 0.5);
  const PrefixCounters window = n - after_r1;  // hit rate over r2 and r3 only
  EXPECT_EQ(window.prompt_tokens_queried, 64);
  EXPECT_DOUBLE_EQ(window.hit_rate(), 0.75);
  EXPECT_EQ(n.blocks_shared, 48);     // 3 pages × 8 lists, twice
  EXPECT_EQ(n.blocks_published, 40);  // r2's own last page; r3's duplicates r1's and is not taken
  EXPECT_EQ(n.blocks_copied, 0);
  EXPECT_EQ(n.blocks_reclaimed, 0);

  // Unique tokens per layer: r1's 32, r2's last 8, r3's last 8 (its private copy): 48 for 96 logical.
  PoolStats st = c.stats();
  EXPECT_DOUBLE_EQ(st.logical_tokens, 3 * 32 * kL);
  EXPECT_DOUBLE_EQ(st.unique_tokens, 48 * kL);
  EXPECT_DOUBLE_EQ(st.sharing_ratio, 2.0);
  const int64_t block = 8 * kD * 2;
  EXPECT_EQ(st.bytes_in_use, 6 * 8 * block);  // 6 distinct pages of 8 blocks
  EXPECT_EQ(st.cached_blocks, 40);
  EXPECT_EQ(st.bytes_cached, 0) << "every cached block is in use";
  EXPECT_EQ(st.running_sequences, 3);
  c.check_invariants();

  for (Sequence* s : {&r1, &r2, &r3}) s->finish();
  st = c.stats();
  EXPECT_EQ(st.bytes_in_use, 5 * 8 * block) << "r3's private last page went back; the index keeps 5 pages";
  EXPECT_EQ(st.bytes_cached, st.bytes_in_use);
  EXPECT_EQ(st.bytes_in_use_peak, 6 * 8 * block);
  // Reclaim one page's bytes: the least recently used leaf is r2's last page.
  EXPECT_EQ(c.reclaim(8 * block), 8 * block);
  EXPECT_EQ(c.counters().blocks_reclaimed, 8);
  Sequence& r4 = c.add_sequence();
  EXPECT_EQ(r4.begin_request(cat(p2, tokens(1, 1)), 40).cached_tokens, 24) << "r2's last page is gone";
  EXPECT_EQ(r4.prefix().indexed_tokens, 24);
  r4.finish();
  c.check_invariants();
}

TEST(MultiSequenceCache, ReferenceCountsReturnToZeroWhenEverySequenceEnds) {
  CacheConfig model = make_config(kL, kHq, kHkv, kD, "int4:g8", "full");
  model.block_tokens = 8;
  MultiSequenceCache c(pool_config(model));
  const Ids shared = tokens(7, 32);
  std::vector<Sequence*> seqs;
  for (int i = 0; i < 4; ++i) {
    CacheConfig cfg = model;
    cfg.scheme = i % 2 == 0 ? "int4:g8" : "kivi:k2:v4:g8:r16";
    cfg.policy = i == 3 ? "random:seed1@30" : "full";
    Sequence& s = c.add_sequence(cfg);
    const Ids ids = cat(cat(shared, tokens(100 + 10 * i, 11)), tokens(500, 20));
    const auto r = s.begin_request(Ids(ids.begin(), ids.begin() + 43), 80);
    run(s, ids, 43, r.cached_tokens, 5, r.min_first_step, 20);
    c.check_invariants();
    seqs.push_back(&s);
  }
  // Prefills in steps of 5 publish each block once it fills: sequence 2 (int4) reuses sequence
  // 0's 32 shared tokens; sequence 3 (KIVI, r = 16) reuses 16 of sequence 1's 32 (43 − 16 = 27,
  // in multiples of 16); the first of each scheme finds nothing.
  EXPECT_EQ(c.counters().prompt_tokens_hit, 32 + 16);
  for (Sequence* s : seqs) {
    s->finish();
    c.check_invariants();
  }
  const PoolStats st = c.stats();
  EXPECT_EQ(st.running_sequences, 0);
  EXPECT_EQ(st.bytes_cached, st.bytes_in_use) << "only the index holds blocks now";
  EXPECT_EQ(c.reclaim(std::numeric_limits<int64_t>::max()), st.bytes_in_use);
  EXPECT_EQ(c.stats().bytes_in_use, 0);
  EXPECT_EQ(c.stats().cached_blocks, 0);
  EXPECT_EQ(c.counters().blocks_reclaimed, c.counters().blocks_published);
  c.check_invariants();
  // Removing a sequence in the middle of a request gives its blocks back too.
  Sequence& t = *seqs[0];
  const Ids ids = cat(shared, tokens(900, 9));
  t.begin_request(ids, 50);
  run(t, ids, 41, 0, 0, 0, 2);
  EXPECT_GT(c.stats().bytes_in_use, c.stats().bytes_cached);
  c.remove_sequence(t);
  EXPECT_EQ(c.stats().bytes_in_use, c.stats().bytes_cached) << "only the index holds blocks";
  EXPECT_EQ(c.stats().cached_blocks, 5 * 8) << "t's 5 whole prompt blocks in 8 lists";
  c.check_invariants();
  for (size_t i = 1; i < seqs.size(); ++i) c.remove_sequence(*seqs[i]);
  EXPECT_EQ(c.num_sequences(), 0);
  const int64_t cached = c.stats().bytes_cached;
  EXPECT_GT(cached, 0);
  EXPECT_EQ(c.reclaim(std::numeric_limits<int64_t>::max()), cached);
  EXPECT_EQ(c.stats().bytes_in_use, 0);
}

TEST(MultiSequenceCache, PerChannelGroupsAreBatchInvariant) {
  // A sequence's per-channel groups (KIVI keys, :chan) are its own: the same request alone or
  // interleaved with three others (other data, other chunkings, other schemes) stores and
  // computes the same bits, group by group.
  for (const char* quant : {"int2:g8:chan", "kivi:k2:v2:g8:r16"}) {
    CacheConfig model = make_config(kL, kHq, kHkv, kD, quant, "full");
    model.block_tokens = 8;
    MultiSequenceConfig off = pool_config(model);
    off.prefix_sharing = false;
    const Ids ids = tokens(11, 90);
    MultiSequenceCache solo(off), crowd(off);
    Sequence& x = solo.add_sequence();
    x.reset(90);
    Sequence& y = crowd.add_sequence();
    y.reset(90);
    std::vector<Sequence*> others;
    for (int i = 0; i < 3; ++i) {
      CacheConfig cfg = model;
      if (i == 2) cfg.scheme = "int4:g8:chan";
      others.push_back(&crowd.add_sequence(cfg));
      others.back()->reset(90);
    }
    const std::vector<int64_t> chunks = {5, 12, 3, 9, 1, 1, 20, 7, 13, 19};
    int64_t at = 0, o_at[3] = {0, 0, 0};
    for (int64_t n : chunks) {
      for (int i = 0; i < 3; ++i) {  // the others step first, with their own sizes
        const int64_t m = (n * (i + 2)) % 11 + 1;
        step(*others[static_cast<size_t>(i)], tokens(40 + i, 200), o_at[i], m, StepKind::kPrefill);
        o_at[i] += m;
      }
      const at::Tensor a = step(x, ids, at, n, StepKind::kPrefill);
      const at::Tensor b = step(y, ids, at, n, StepKind::kPrefill);
      EXPECT_TRUE(at::equal(a, b)) << quant << " at " << at;
      at += n;
    }
    expect_same_state(x, y, quant);
    // 90 tokens: int2:g8:chan flushes whole groups of 8 (11 groups); KIVI flushes keys in blocks
    // of r = 16 (80 tokens: 10 groups of 8) — per head, whatever the others did.
    const int64_t want = std::string(quant) == "int2:g8:chan" ? 11 : 10;
    EXPECT_EQ(cache::CacheManagerAccess::stream(y, 0, true).quantized_groups,
              (std::vector<int64_t>{want, want}))
        << quant;
    crowd.check_invariants();
  }
}

TEST(MultiSequenceCache, PoolFullReclaimsThenRefusesThenPreempts) {
  CacheConfig model = make_config(kL, kHq, kHkv, kD, "fp16", "full");
  model.block_tokens = 8;
  const int64_t page = 8 * (8 * kD * 2);  // one block of 8 tokens in each of the 8 lists: 2 KiB
  const Ids p1 = tokens(1, 32), p2 = tokens(2, 32), p3 = tokens(3, 32);
  {
    // Room for 6 pages. r1 publishes 4 pages and ends: they stay cached (reclaimable).
    MultiSequenceCache c(pool_config(model, 6 * page));
    Sequence& r1 = c.add_sequence();
    r1.begin_request(p1, 40);
    run(r1, p1, 32, 0, 8, 0, 0);
    r1.finish();
    EXPECT_EQ(c.stats().bytes_cached, 4 * page);
    // r2 needs 4 pages: 2 free + 2 reclaimed from r1's prefix (its tail first).
    Sequence& r2 = c.add_sequence();
    r2.begin_request(p2, 40);
    run(r2, p2, 32, 0, 8, 0, 0);
    EXPECT_EQ(c.counters().blocks_reclaimed, 2 * 8);
    EXPECT_EQ(c.stats().bytes_in_use, 6 * page);
    // r3 cannot fit: r2 holds 4 pages, the index's remaining 2 pages are r1's head, reclaimable too.
    Sequence& r3 = c.add_sequence();
    r3.begin_request(p3, 40);
    run(r3, p3, 16, 0, 8, 0, 0);  // two pages, from r1's last cached ones
    EXPECT_EQ(c.counters().blocks_reclaimed, 4 * 8);
    const testing::Snapshot before{TorchCache(r3)};
    try {
      step(r3, p3, 16, 8, StepKind::kPrefill);
      ADD_FAILURE() << "an append beyond capacity was accepted";
    } catch (const CapacityError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("sequence 2 needs up to 1024 B"), std::string::npos) << m;
      EXPECT_NE(m.find("capacity_bytes = 12288"), std::string::npos) << m;
      EXPECT_NE(m.find("kRefuse"), std::string::npos) << m;
    }
    before.expect_unchanged(TorchCache(r3), "refused append");
    EXPECT_EQ(c.counters().refusals, 1);
    c.check_invariants();
    r2.finish();
    step(r3, p3, 16, 8, StepKind::kPrefill);  // fits now
    c.check_invariants();
  }
  {
    MultiSequenceConfig cfg = pool_config(model, 6 * page);
    cfg.when_full = PoolFullRule::kPreemptNewest;
    MultiSequenceCache c(cfg);
    Sequence& old = c.add_sequence();
    Sequence& mid = c.add_sequence();
    Sequence& young = c.add_sequence();
    old.begin_request(p1, 48);
    mid.begin_request(p2, 48);
    young.begin_request(p3, 48);
    run(old, p1, 16, 0, 16, 0, 0);
    run(mid, p2, 16, 0, 16, 0, 0);
    run(young, p3, 16, 0, 16, 0, 0);  // 6 pages: full
    // The oldest request grows: the newest yields, and only it.
    step(old, p1, 16, 8, StepKind::kPrefill);
    EXPECT_TRUE(young.preempted());
    EXPECT_FALSE(mid.preempted());
    EXPECT_EQ(c.counters().preemptions, 1);
    try {
      young.next_position(0);
      ADD_FAILURE() << "a preempted sequence answered";
    } catch (const CapacityError& e) {
      EXPECT_NE(std::string(e.what()).find("was preempted"), std::string::npos) << e.what();
    }
    // The newest running request (mid now) cannot preempt the older one: refused.
    step(mid, p2, 16, 8, StepKind::kPrefill);  // fits: young's cached pages are reclaimed
    EXPECT_THROW(step(mid, p2, 24, 8, StepKind::kPrefill), CapacityError);
    EXPECT_FALSE(old.preempted());
    c.check_invariants();
    // young starts again (from the cache: its first 16 tokens were published before it yielded).
    const auto r = young.begin_request(p3, 48);
    EXPECT_FALSE(young.preempted());
    EXPECT_EQ(r.cached_tokens, 0) << "young's blocks were reclaimed to make room";
    c.check_invariants();
  }
}

// Under kPreemptNewest, a call that cannot fit even after preempting every newer request is
// refused having preempted nothing: the requests that would have yielded for nothing keep
// running (issue 39, fault 2: they were preempted, then the call was refused anyway).
TEST(MultiSequenceCache, ARefusedCallPreemptsNobody) {
  CacheConfig model = make_config(kL, kHq, kHkv, kD, "fp16", "full");
  model.block_tokens = 8;
  const int64_t page = 8 * (8 * kD * 2);  // one block of 8 tokens in each of the 8 lists: 2 KiB
  const Ids p1 = tokens(1, 96), p2 = tokens(2, 32), p3 = tokens(3, 32);
  MultiSequenceConfig cfg = pool_config(model, 6 * page);
  cfg.when_full = PoolFullRule::kPreemptNewest;
  MultiSequenceCache c(cfg);
  Sequence& old = c.add_sequence();
  Sequence& mid = c.add_sequence();
  Sequence& young = c.add_sequence();
  old.begin_request(p1, 96);
  mid.begin_request(p2, 48);
  young.begin_request(p3, 48);
  run(old, p1, 16, 0, 16, 0, 0);
  run(mid, p2, 16, 0, 16, 0, 0);
  run(young, p3, 16, 0, 16, 0, 0);  // 6 pages: full, every page locked by its request
  const testing::Snapshot old_before{TorchCache(old)}, mid_before{TorchCache(mid)}, young_before{TorchCache(young)};
  const PoolStats pool_before = c.stats();
  const PrefixCounters counters_before = c.counters();
  // 72 more tokens of the oldest request in layer 0 need 9 blocks in each of its 4 lists
  // (9216 B); preempting both newer requests frees their 4 pages (8192 B).
  try {
    old.append(0, synth(p1, 16, 72, 0, 0, kHkv), synth(p1, 16, 72, 0, 1, kHkv), at::arange(16, 88, at::kLong));
    ADD_FAILURE() << "an append of 9216 B into a pool where at most 8192 B can be freed was accepted";
  } catch (const PoolFullError& e) {
    EXPECT_FALSE(e.preempted());
    const std::string m = e.what();
    EXPECT_NE(m.find("sequence 0 needs up to 9216 B"), std::string::npos) << m;
    EXPECT_NE(m.find("preempting the 2 requests newer than this one would leave 8192 B free"), std::string::npos)
        << m;
    EXPECT_NE(m.find("nothing was reclaimed or preempted"), std::string::npos) << m;
  }
  EXPECT_FALSE(mid.preempted());
  EXPECT_FALSE(young.preempted());
  EXPECT_EQ(c.counters().preemptions, counters_before.preemptions);
  EXPECT_EQ(c.counters().blocks_reclaimed, counters_before.blocks_reclaimed);
  EXPECT_EQ(c.counters().refusals, counters_before.refusals + 1);
  EXPECT_EQ(c.stats().bytes_in_use, pool_before.bytes_in_use);
  EXPECT_EQ(c.stats().cached_blocks, pool_before.cached_blocks);
  EXPECT_EQ(c.stats().running_sequences, 3);
  old_before.expect_unchanged(TorchCache(old), "old after the refused append");
  mid_before.expect_unchanged(TorchCache(mid), "mid after the refused append");
  young_before.expect_unchanged(TorchCache(young), "young after the refused append");
  c.check_invariants();
  // 16 tokens (2048 B) fit by preempting the newest alone (one of its pages reclaimed).
  old.append(0, synth(p1, 16, 16, 0, 0, kHkv), synth(p1, 16, 16, 0, 1, kHkv), at::arange(16, 32, at::kLong));
  EXPECT_TRUE(young.preempted());
  EXPECT_FALSE(mid.preempted());
  EXPECT_EQ(c.counters().preemptions, 1);
  c.check_invariants();
}

// A refused end_step changes nothing (fuzz/known K5). The end of a window@40 prefill both
// publishes its settled prompt pages to the index and evicts inside its oldest block; once the
// page is published that block is shared, so the eviction copies it on write. Where the pool
// cannot hold the copy (and the caller is the newest request: nobody to preempt), the call is
// refused, and the index must not have taken the pages either. Capacities from tight to ample:
// at least one refusal and one success, each checked.
TEST(MultiSequenceCache, ARefusedEndStepPublishesNothing) {
  CacheConfig model = make_config(kL, kHq, kHkv, kD, "fp16", "full");
  model.block_tokens = 8;
  const int64_t page = 8 * (8 * kD * 2);  // one block of 8 tokens in each of the 8 lists: 2 KiB
  const Ids filler = tokens(1, 16), prompt = tokens(5, 44);
  int refused = 0, accepted = 0;
  for (int64_t cap = 6; cap <= 12; ++cap) {
    MultiSequenceConfig cfg = pool_config(model, cap * page);
    cfg.when_full = PoolFullRule::kPreemptNewest;
    MultiSequenceCache c(cfg);
    Sequence& old = c.add_sequence();
    CacheConfig w = model;
    w.policy = "window@40";
    Sequence& win = c.add_sequence(w);
    old.begin_request(filler, 17);
    run(old, filler, 16, 0, 0, 0, 0);  // 2 pages, locked by the older request
    win.begin_request(prompt, 45);
    TorchCache t(win);
    bool appended = true;
    for (int64_t l = 0; appended && l < kL; ++l) {
      try {
        t.append(l, synth(prompt, 0, 44, l, 0, kHkv), synth(prompt, 0, 44, l, 1, kHkv), at::arange(0, 44, at::kLong));
        t.attend(l, synth(prompt, 0, 44, l, 2, kHq), at::arange(0, 44, at::kLong));
      } catch (const PoolFullError&) {
        appended = false;
      }
    }
    if (!appended) continue;  // the prompt itself does not fit: not this test's case
    const testing::Snapshot win_before{TorchCache(win)}, old_before{TorchCache(old)};
    const PoolStats pool_before = c.stats();
    const PrefixCounters counters_before = c.counters();
    const std::string where = "capacity " + std::to_string(cap) + " pages";
    try {
      t.end_step(StepKind::kPrefillEnd);
      ++accepted;
      EXPECT_GT(c.stats().cached_blocks, pool_before.cached_blocks) << where << ": the prompt pages were published";
    } catch (const PoolFullError& e) {
      ++refused;
      EXPECT_FALSE(e.preempted()) << where;
      EXPECT_FALSE(old.preempted()) << where;
      EXPECT_EQ(c.stats().cached_blocks, pool_before.cached_blocks) << where;
      EXPECT_EQ(c.stats().bytes_in_use, pool_before.bytes_in_use) << where;
      EXPECT_EQ(c.counters().blocks_published, counters_before.blocks_published) << where;
      EXPECT_EQ(c.counters().refusals, counters_before.refusals + 1) << where;
      win_before.expect_unchanged(TorchCache(win), where + ": the refused sequence");
      old_before.expect_unchanged(TorchCache(old), where + ": the older sequence");
    }
    c.check_invariants();
  }
  EXPECT_GT(refused, 0) << "no capacity refused the end_step: the case above is not reached";
  EXPECT_GT(accepted, 0);
}

// Property (seeded): requests of four sequences over a pool that runs full, call by call,
// under kPreemptNewest. Every refused call (PoolFullError, preempted() false) changes nothing —
// no sequence preempted, every manager, the pool's counters and its index as they were — and
// every accepted call preempts only requests that began after the caller's. The invariants
// hold after every call.
TEST(MultiSequenceCache, PoolExhaustionWithPreemptionProperty) {
  CacheConfig model = make_config(kL, kHq, kHkv, kD, "int8", "full");
  model.block_tokens = 8;
  MultiSequenceConfig cfg = pool_config(model, 24 * 1024);
  cfg.when_full = PoolFullRule::kPreemptNewest;
  MultiSequenceCache c(cfg);
  const std::vector<std::pair<const char*, const char*>> kinds = {
      {"int8", "full"}, {"fp16", "window@40"}, {"int4:g8", "full"}, {"kivi:k2:v2:g8:r16", "full"}};
  std::vector<Sequence*> seqs;
  for (const auto& [q, p] : kinds) {
    CacheConfig s = model;
    s.scheme = q;
    s.policy = p;
    seqs.push_back(&c.add_sequence(s));
  }
  uint64_t rng = 777;
  auto next = [&](uint64_t n) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (rng >> 33) % n;
  };
  // What a refused call must leave as it was.
  struct World {
    std::vector<bool> preempted;
    std::vector<testing::Snapshot> managers;
    PrefixCounters counters;
    PoolStats pool;
  };
  auto world = [&] {
    World w{{}, {}, c.counters(), c.stats()};
    for (Sequence* s : seqs) {
      w.preempted.push_back(s->preempted());
      w.managers.emplace_back(TorchCache(*s));
    }
    return w;
  };
  std::vector<int64_t> began(seqs.size(), -1);  // request order, as the cache counts it
  int64_t serial = 0, refused = 0, preempting_calls = 0, accepted = 0;
  // Runs one call of sequence i; false when it threw PoolFullError.
  auto call = [&](size_t i, const std::string& what, const std::function<void()>& f) {
    const World before = world();
    bool ok = true;
    try {
      f();
      ++accepted;
    } catch (const PoolFullError& e) {
      ok = false;
      if (!e.preempted()) {
        ++refused;
        const World after = world();
        const std::string where = what + " (refused)";
        EXPECT_EQ(after.preempted, before.preempted) << where;
        for (size_t j = 0; j < seqs.size(); ++j) before.managers[j].expect_same(after.managers[j], where);
        EXPECT_EQ(after.counters.preemptions, before.counters.preemptions) << where;
        EXPECT_EQ(after.counters.blocks_reclaimed, before.counters.blocks_reclaimed) << where;
        EXPECT_EQ(after.counters.refusals, before.counters.refusals + 1) << where;
        EXPECT_EQ(after.pool.bytes_in_use, before.pool.bytes_in_use) << where;
        EXPECT_EQ(after.pool.cached_blocks, before.pool.cached_blocks) << where;
      }
    }
    if (ok) {
      const World after = world();
      bool any = false;
      for (size_t j = 0; j < seqs.size(); ++j) {
        if (after.preempted[j] && !before.preempted[j]) {
          any = true;
          EXPECT_GT(began[j], began[i]) << what << ": sequence " << j << " preempted for an older or equal request";
        }
      }
      preempting_calls += any;
    }
    c.check_invariants();
    EXPECT_LE(c.stats().bytes_in_use, cfg.capacity_bytes);
    return ok;
  };
  // Requests advance one step at a time, interleaved: an older request that grows meets newer
  // ones holding blocks (preemption), a newer one meets older ones (refusal).
  struct Request {
    bool active = false;
    Ids ids;
    int64_t prompt = 0, from = 0, end = 0, first_min = 0;
  };
  std::vector<Request> req(seqs.size());
  const Ids base = tokens(9, 64);
  for (int iter = 0; iter < 240; ++iter) {
    const size_t i = next(seqs.size());
    Sequence& s = *seqs[i];
    Request& q = req[i];
    const std::string what = "iteration " + std::to_string(iter) + " sequence " + std::to_string(i);
    if (!q.active) {
      const int64_t keep = static_cast<int64_t>(next(4)) * 8;
      const Ids prompt = cat(Ids(base.begin(), base.begin() + keep),
                             tokens(100 + static_cast<int64_t>(next(3)), 8 + static_cast<int64_t>(next(40))));
      q.prompt = static_cast<int64_t>(prompt.size());
      q.ids = cat(prompt, tokens(700, 16));
      q.end = q.prompt + 1 + static_cast<int64_t>(next(16));
      kvcache::PrefixReuse r;
      if (!call(i, what + " begin_request", [&] { r = s.begin_request(prompt, q.end); })) continue;
      began[i] = serial++;
      q.active = true;
      q.from = r.cached_tokens;
      q.first_min = r.min_first_step;
      continue;
    }
    // One step: a prefill chunk or one decode token.
    const int64_t t = q.from >= q.prompt
                          ? 1
                          : std::min(std::max<int64_t>(q.first_min, 1 + static_cast<int64_t>(next(24))), q.prompt - q.from);
    const int64_t first = q.from;
    bool alive = true;
    for (int64_t l = 0; alive && l < kL; ++l) {
      const at::Tensor pos = at::arange(first, first + t, at::kLong);
      alive = call(i, what + " append at " + std::to_string(first) + " layer " + std::to_string(l), [&] {
        s.append(l, synth(q.ids, first, t, l, 0, kHkv), synth(q.ids, first, t, l, 1, kHkv), pos);
        (void)TorchCache(s).attend(l, synth(q.ids, first, t, l, 2, kHq), pos);
      });
    }
    if (alive) {
      alive = call(i, what + " end_step", [&] {
        s.end_step(first + t < q.prompt ? StepKind::kPrefill
                                        : first + t == q.prompt ? StepKind::kPrefillEnd : StepKind::kDecode);
      });
    }
    q.from += t;
    q.first_min = 0;
    if (!alive || q.from >= q.end) {
      s.finish();
      q.active = false;
    }
    c.check_invariants();
  }
  EXPECT_GT(refused, 3) << "the pool never refused: the property was not exercised";
  EXPECT_GT(preempting_calls, 3) << "nothing was ever preempted: the property was not exercised";
  EXPECT_GT(accepted, 100);
}

TEST(MultiSequenceCache, RandomizedInvariants) {
  // Random requests over a small vocabulary (prompts share prefixes often), mixed schemes and
  // policies, a pool that runs full: check_invariants() after every call.
  at::manual_seed(0);
  CacheConfig model = make_config(kL, kHq, kHkv, kD, "int8", "full");
  model.block_tokens = 8;
  MultiSequenceConfig cfg = pool_config(model, 120 * 1024);
  cfg.when_full = PoolFullRule::kPreemptNewest;
  MultiSequenceCache c(cfg);
  const std::vector<std::pair<const char*, const char*>> kinds = {
      {"int8", "full"}, {"fp16", "window@40"}, {"kivi:k2:v2:g8:r16", "full"}, {"int4:g8", "random:seed3@36"},
      {"int8", "sink:s4@40"}};
  std::vector<Sequence*> seqs;
  for (const auto& [q, p] : kinds) {
    CacheConfig s = model;
    s.scheme = q;
    s.policy = p;
    seqs.push_back(&c.add_sequence(s));
  }
  uint64_t rng = 12345;
  auto next = [&](uint64_t n) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (rng >> 33) % n;
  };
  const Ids base = tokens(9, 64);
  int64_t refused = 0, done = 0;
  for (int iter = 0; iter < 60; ++iter) {
    Sequence& s = *seqs[next(seqs.size())];
    const int64_t keep = static_cast<int64_t>(next(5)) * 8;  // a shared head of 0..32 tokens
    Ids prompt(base.begin(), base.begin() + keep);
    const Ids tail = tokens(100 + static_cast<int64_t>(next(3)), 9 + static_cast<int64_t>(next(24)));
    prompt = cat(prompt, tail);
    const auto n = static_cast<int64_t>(prompt.size());
    const Ids ids = cat(prompt, tokens(700, 8));
    try {
      const auto r = s.begin_request(prompt, n + 8);
      c.check_invariants();
      run(s, ids, n, r.cached_tokens, 1 + static_cast<int64_t>(next(12)), r.min_first_step,
          static_cast<int64_t>(next(8)));
      ++done;
    } catch (const CapacityError&) {
      ++refused;
    }
    c.check_invariants();
    if (next(3) == 0) s.finish();
    c.check_invariants();
    EXPECT_LE(c.stats().bytes_in_use, cfg.capacity_bytes);
  }
  EXPECT_GT(done, 20);
  EXPECT_GT(c.counters().prompt_tokens_hit, 0);
  for (Sequence* s : seqs) s->finish();
  c.reclaim(std::numeric_limits<int64_t>::max());
  EXPECT_EQ(c.stats().bytes_in_use, 0);
  c.check_invariants();
  (void)refused;
}

TEST(MultiSequenceCache, BadInputIsRejected) {
  CacheConfig model = make_config(kL, kHq, kHkv, kD, "fp16", "full");
  MultiSequenceConfig cfg = pool_config(model, 0);
  try {
    MultiSequenceCache c(cfg);
    ADD_FAILURE() << "capacity 0 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("capacity_bytes must be >= 1"), std::string::npos) << e.what();
  }
  MultiSequenceCache c(pool_config(model));
  CacheConfig other = model;
  other.head_dim = 32;
  try {
    c.add_sequence(other);
    ADD_FAILURE() << "another head_dim accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("CacheConfig.head_dim = 32 but the cache's sequences have 16"),
              std::string::npos)
        << e.what();
  }
  Sequence& s = c.add_sequence();
  EXPECT_THROW(s.begin_request(tokens(1, 10), 5), InvalidArgument);
  EXPECT_THROW(c.sequence(7), InvalidArgument);
  MultiSequenceCache d(pool_config(model));
  EXPECT_THROW(d.remove_sequence(s), InvalidArgument);
  EXPECT_THROW(c.reclaim(-1), InvalidArgument);
}

}  // namespace
}  // namespace kvcache
