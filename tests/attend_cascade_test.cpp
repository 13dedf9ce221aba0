// SPDX-License-Identifier: Apache-2.0
// Shared-prefix (cascade) attention in attend_batch (kvcache/sequence_cache.h,
// src/cache/attend_cascade.h) against its reference twin, every request attended alone
// (AttendBatchOptions::cascade = false, itself bit for bit each sequence's attend()): the
// sequences of a MultiSequenceCache that reuse cached prompt prefixes, for every registered
// quantizer and cache scheme head, odd head counts, one-token blocks, prefixes that are not a
// multiple of the block, pre-RoPE keys, holes in a sequence's own part, ragged own lengths,
// groups sharing different prefixes and nested ones (a tree). And the merge of partial states
// (attend_range over two runs of keys, merged) against one pass, and the thread split of one
// long head (attend_split: a head's keys cut into runs across threads, merged by the same code)
// against the unsplit head (AttendSplit.*; its tolerance is stated above those tests).
//
// Tolerance: a cascade reads the same stored bytes with the same kernels (fused or generic) as
// the sequence alone; only the order of float32 sums changes — the shared keys' partial state
// is merged with the own keys' by log-sum-exp (two rescalings by exp(m − m'), exact to a few
// ulp) instead of continued by the online softmax, and tiles start at the shared run's end.
// With unit-scale values the outputs (convex combinations of values ≤ 1.6 in size) move by a
// few float32 ulp of 1: |Δ| ≤ kTol = 1e-5 · max|v| (measured: 3.0e-7 to 4.9e-7 over every
// format here). A skipped, doubled or wrongly masked key moves them by O(0.01–0.1) (an own pass
// starting one token late: 0.11–0.15).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "cache/attend.h"
#include "cache/attend_fused.h"
#include "cache/cache_manager_access.h"
#include "cache_test_util.h"
#include "kvcache/cache_manager.h"
#include "kvcache/kvquant.h"
#include "kvcache/multi_sequence_cache.h"
#include "kvcache/registry.h"
#include "kvcache/torch.h"

namespace kvcache {
namespace {

using Ids = std::vector<int64_t>;
using testing::make_config;

constexpr int64_t kLayers = 2;
constexpr double kTol = 1e-5;

/// K or V rows of tokens ids[from, from + n) at positions from.. (which 0: K, 1: V):
/// [1, heads, n, D] float32, a fixed function of (id, position, layer, head, channel), so a
/// prefix means the same keys to every sequence; |x| ≤ 1.5.
at::Tensor synth(const Ids& ids, int64_t from, int64_t n, int64_t layer, int which, int64_t heads, int64_t d) {
  const auto dbl = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor id =
      at::tensor(at::ArrayRef<int64_t>(ids.data() + from, static_cast<size_t>(n))).to(at::kDouble).view({1, 1, n, 1});
  const at::Tensor pos = at::arange(from, from + n, dbl).view({1, 1, n, 1});
  const at::Tensor h = at::arange(heads, dbl).view({1, heads, 1, 1});
  const at::Tensor c = at::arange(d, dbl).view({1, 1, 1, d});
  const at::Tensor x = at::sin(0.37 * id + 0.11 * pos + 1.3 * static_cast<double>(layer) + 0.7 * h + 0.29 * c +
                               2.1 * which) *
                       (1.0 + 0.5 * at::cos(0.05 * id * (c + 1.0)));
  return x.to(at::kFloat);
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


struct Shape {
  std::string scheme;
  int64_t block_tokens = 0;  ///< 0: the default
  int64_t hq = 21, hkv = 3, d = 32;
  std::string policy = "full";
  int64_t context = 0;
  bool pre_rope = false;
};

/// Sequences of one MultiSequenceCache, each started with its prompt (reusing what the index
/// holds), prefilled and decoded `decode[i]` tokens; then decode steps in which every layer
/// attends once through attend_batch with the cascade and once without.
class Batch {
 public:
  Batch(const Shape& s, bool sharing) : shape_(s), cache_(config(s, sharing)) {}

  /// Adds a sequence, runs its prompt (one prefill step for what the index does not hold) and
  /// `decode` decode steps (one layer at a time, attend() alone).
  void add(const Ids& prompt, int64_t decode, uint64_t seed) {
    Sequence& seq = cache_.add_sequence();
    const int64_t ctx = static_cast<int64_t>(prompt.size()) + decode + 64;
    const PrefixReuse r = seq.begin_request(prompt, ctx);
    Ids ids = prompt;
    for (int64_t i = 0; i < decode + 16; ++i) {
      ids.push_back(3 + static_cast<int64_t>((seed * 13 + static_cast<uint64_t>(i) * 11) % 50));
    }
    const int64_t n_prompt = static_cast<int64_t>(prompt.size());
    ASSERT_LT(r.cached_tokens, n_prompt);
    step(seq, ids, r.cached_tokens, n_prompt - r.cached_tokens, StepKind::kPrefillEnd, seed);
    for (int64_t i = 0; i < decode; ++i) {
      step(seq, ids, n_prompt + i, 1, StepKind::kDecode, seed + 100 + static_cast<uint64_t>(i));
    }
    seqs_.push_back(&seq);
    ids_.push_back(std::move(ids));
    prompt_.push_back(n_prompt);
    cached_.push_back(r.cached_tokens);
  }

  /// One decode step of every sequence: per layer, append, then attend_batch with and without
  /// the cascade (and each sequence's attend() alone for layer 0: the reference twin is bit
  /// for bit attend()). Returns the largest |cascade − alone| over layers, sequences, rows.
  double decode_step(uint64_t seed, AttendBatchStats* stats, AttendBatchStats* stats_off = nullptr, int64_t tq = 1) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    double worst = 0;
    const int64_t n = static_cast<int64_t>(seqs_.size());
    for (int64_t l = 0; l < kLayers; ++l) {
      std::vector<at::Tensor> qs, pos, with, without;
      std::vector<AttendRequest> reqs(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        Sequence& seq = *seqs_[static_cast<size_t>(i)];
        const int64_t p = seq.next_position(l);
        const Ids& ids = ids_[static_cast<size_t>(i)];
        seq.append(l, synth(ids, p, tq, l, 0, shape_.hkv, shape_.d), synth(ids, p, tq, l, 1, shape_.hkv, shape_.d),
                   at::arange(p, p + tq, at::kLong));
        qs.push_back(testing::randn({1, shape_.hq, tq, shape_.d}, gen));
        pos.push_back(at::arange(p, p + tq, at::kLong));
        with.push_back(at::full({1, shape_.hq, tq, shape_.d}, 7.0f));
        without.push_back(at::full({1, shape_.hq, tq, shape_.d}, -7.0f));
      }
      for (int64_t i = 0; i < n; ++i) {
        reqs[static_cast<size_t>(i)] = {seqs_[static_cast<size_t>(i)], qs[static_cast<size_t>(i)],
                                        pos[static_cast<size_t>(i)], mutable_view_of(with[static_cast<size_t>(i)])};
      }
      AttendBatchOptions on;
      on.stats = l == 0 ? stats : nullptr;
      attend_batch(l, reqs, on);
      for (int64_t i = 0; i < n; ++i) {
        reqs[static_cast<size_t>(i)].out = mutable_view_of(without[static_cast<size_t>(i)]);
      }
      AttendBatchOptions off;
      off.cascade = false;
      off.stats = l == 0 ? stats_off : nullptr;
      attend_batch(l, reqs, off);
      for (int64_t i = 0; i < n; ++i) {
        const at::Tensor& a = with[static_cast<size_t>(i)];
        const at::Tensor& b = without[static_cast<size_t>(i)];
        worst = std::max(worst, (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>());
        if (l == 0) {
          TorchCache alone(*seqs_[static_cast<size_t>(i)]);
          EXPECT_TRUE(at::equal(alone.attend(l, qs[static_cast<size_t>(i)], pos[static_cast<size_t>(i)]), b))
              << "sequence " << i << ": attend_batch without the cascade is not attend()";
        }
      }
    }
    for (Sequence* s : seqs_) s->end_step(StepKind::kDecode);
    cache_.check_invariants();
    return worst;
  }

  const std::vector<int64_t>& cached() const { return cached_; }
  /// Dead slots (holes) over every sequence's layer-0 key streams.
  int64_t holes() const {
    int64_t n = 0;
    for (const Sequence* s : seqs_) {
      for (const int64_t d : cache::CacheManagerAccess::stream(*s, 0, true).dead_slots) n += d;
    }
    return n;
  }
  MultiSequenceCache& cache() { return cache_; }

 private:
  static MultiSequenceConfig config(const Shape& s, bool sharing) {
    MultiSequenceConfig c;
    c.model = make_config(kLayers, s.hq, s.hkv, s.d, s.scheme, s.policy, s.context);
    c.model.block_tokens = s.block_tokens;
    if (s.pre_rope) c.model.key_storage = KeyStorage::kPreRoPE;
    c.capacity_bytes = int64_t{1} << 30;
    c.prefix_sharing = sharing;
    return c;
  }

  void step(Sequence& seq, const Ids& ids, int64_t from, int64_t n, StepKind kind, uint64_t seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    for (int64_t l = 0; l < kLayers; ++l) {
      const at::Tensor p = at::arange(from, from + n, at::kLong);
      seq.append(l, synth(ids, from, n, l, 0, shape_.hkv, shape_.d), synth(ids, from, n, l, 1, shape_.hkv, shape_.d),
                 p);
      at::Tensor out = at::empty({1, shape_.hq, n, shape_.d});
      const at::Tensor q = testing::randn({1, shape_.hq, n, shape_.d}, gen);
      seq.attend(l, q, p, mutable_view_of(out));
    }
    seq.end_step(kind);
  }

  Shape shape_;
  MultiSequenceCache cache_;
  std::vector<Sequence*> seqs_;
  std::vector<Ids> ids_;
  std::vector<int64_t> prompt_, cached_;
};

/// Four sequences: three share a 37-token prompt prefix (then own prompt tails of 3..9 tokens
/// and 1..5 decoded tokens: ragged), one has a prompt of its own.
void run_shared_prefix(const Shape& s, double* worst, int64_t* passes) {
  Batch b(s, true);
  const Ids prefix = tokens(5, 37);
  b.add(cat(prefix, tokens(11, 3)), 2, 1);
  b.add(cat(prefix, tokens(17, 9)), 5, 2);
  b.add(tokens(23, 30), 3, 3);
  b.add(cat(prefix, tokens(29, 6)), 1, 4);
  for (uint64_t k = 0; k < 3; ++k) {
    AttendBatchStats st;
    *worst = std::max(*worst, b.decode_step(50 + k, &st));
    *passes += st.shared_passes;
  }
}

// Every registered quantizer and cache scheme head, several block sizes: the cascade equals
// every sequence attended alone within kTol, and shared passes ran (the prefix was reused).
TEST(AttendCascade, MatchesAttendingAloneForEveryFormat) {
  const std::string cal = ":cal=" + testing::uniform_kvquant_calibration_file("attend_cascade_test", kLayers, 3, 32, 2.0f);
  const std::vector<Shape> shapes = {
      {"fp32", 8},  {"fp32", 1},  {"fp16", 16},  {"bf16", 3},      {"fp8:e4m3", 8},   {"fp8:e5m2", 1},
      {"int8", 8},  {"int4", 32},  {"int4", 1},  {"int3", 8},      {"int2:g8", 4},    {"int4:g8:chan", 8},
      {"kivi:k2:v2:g8:r8", 8},    {"kivi:k4:v4:g4:r8", 4},        {"had(int4)", 8},  {"had:k(int4:g8:chan)", 8},
      {"gear:b4:g4:s0:r0:loop1:nb4", 8},                          {"layers(int4;fp16)", 8},
      {"tq:b4", 8},                {"tq:b3:prod", 4},             {"polar", 8},      {"turboquant:k3:v3", 8},
      {"qjl:m16:o2:g4:v2:r8:mo8:vg8", 8}};
  std::set<std::string> heads;
  for (const Shape& s : shapes) {
    double worst = 0;
    int64_t passes = 0;
    run_shared_prefix(s, &worst, &passes);
    const std::string where = s.scheme + " block " + std::to_string(s.block_tokens);
    EXPECT_LE(worst, kTol) << where;
    EXPECT_GT(passes, 0) << where << ": no shared pass ran";
    heads.insert(spec_head(s.scheme));
  }
  {
    Shape s{"kvquant:b4" + cal, 8};
    s.pre_rope = true;
    double worst = 0;
    int64_t passes = 0;
    run_shared_prefix(s, &worst, &passes);
    EXPECT_LE(worst, kTol) << "kvquant";
    EXPECT_GT(passes, 0) << "kvquant: no shared pass ran";
    heads.insert("kvquant");
  }
  for (const RegisteredSpec& r : registered_specs()) {
    if (r.kind != SpecKind::kPolicy) {
      EXPECT_TRUE(heads.count(r.table.head)) << r.table.head << " not covered";
    }
  }
}

// Shapes: one KV head with 7 query heads, an odd number of KV heads (5) and one query head each,
// head_dim 8 (generic path: the fused kernels need multiples of 32) and 64, pre-RoPE keys.
TEST(AttendCascade, MatchesAttendingAloneForShapes) {
  std::vector<Shape> shapes;
  for (const std::string q : {"fp16", "int4", "kivi:k2:v2:g8:r8"}) {
    Shape a{q, 8, 7, 1, 32};
    Shape b{q, q.rfind("kivi", 0) == 0 ? 8 : 1, 5, 5, 64};
    Shape c{q, 8, 21, 3, 8};
    Shape d{q, 3, 21, 3, 32};
    d.pre_rope = true;
    if (q.rfind("kivi", 0) == 0) d.block_tokens = 8;
    shapes.insert(shapes.end(), {a, b, c, d});
  }
  for (const Shape& s : shapes) {
    double worst = 0;
    int64_t passes = 0;
    run_shared_prefix(s, &worst, &passes);
    const std::string where = s.scheme + " block " + std::to_string(s.block_tokens) + " H_q " +
                              std::to_string(s.hq) + " H_kv " + std::to_string(s.hkv) + " D " + std::to_string(s.d) +
                              (s.pre_rope ? " pre-RoPE" : "");
    EXPECT_LE(worst, kTol) << where;
    EXPECT_GT(passes, 0) << where;
  }
}

// A prefix long enough that the passes run on the threads together (a task of ≥ 64 Ki
// multiply-adds), and more stacked query rows than one walk of a shared pass takes (12
// sequences × 24 query heads of the one KV head = 288 rows > 256: two walks).
TEST(AttendCascade, LongPrefixManySequences) {
  for (const std::string q : {"fp16", "int4"}) {
    Shape s{q, 16, 24, 1, 32};
    Batch b(s, true);
    const Ids prefix = tokens(5, 700);
    for (int64_t i = 0; i < 12; ++i) b.add(cat(prefix, tokens(11 + i, 5 + 3 * i)), i % 4, static_cast<uint64_t>(i + 1));
    AttendBatchStats st;
    EXPECT_LE(b.decode_step(80, &st), kTol) << q;
    EXPECT_EQ(st.shared_passes, 1) << q;  // the 700-token prompt's 43 whole blocks
    EXPECT_EQ(st.shared_tokens, 688) << q;
    EXPECT_EQ(st.cascaded_requests, 12) << q;
  }
}

// Several query tokens per sequence (a chunk of 4: speculative decoding, chunked prefill): the
// shared pass stacks 4 × 7 rows per sequence, the causal mask holds inside each own part.
TEST(AttendCascade, QueryChunks) {
  for (const std::string q : {"fp16", "int4", "kivi:k2:v2:g8:r8"}) {
    Shape s{q, 8};
    Batch b(s, true);
    const Ids prefix = tokens(5, 37);
    b.add(cat(prefix, tokens(11, 3)), 2, 1);
    b.add(cat(prefix, tokens(17, 9)), 5, 2);
    b.add(cat(prefix, tokens(29, 6)), 0, 4);
    AttendBatchStats st;
    EXPECT_LE(b.decode_step(31, &st, nullptr, 4), kTol) << q;
    EXPECT_GT(st.shared_passes, 0) << q;
  }
}

// Holes: a sink policy keeps the first 40 tokens (the shared prefix and more) and the newest,
// evicting from the middle of each sequence's own part — holes in its own blocks, none in the
// shared ones, so the prefix stays shared while the own parts have holes.
TEST(AttendCascade, HolesInTheOwnPart) {
  for (const std::string q : {"fp32", "int4", "int8", "kivi:k2:v2:g8:r8"}) {
    Shape s{q, 8, 21, 3, 32, "sink:s40@64"};
    Batch b(s, true);
    const Ids prefix = tokens(5, 32);
    b.add(cat(prefix, tokens(11, 30)), 20, 1);
    b.add(cat(prefix, tokens(17, 44)), 9, 2);
    b.add(cat(prefix, tokens(29, 13)), 30, 4);
    double worst = 0;
    int64_t passes = 0;
    for (uint64_t k = 0; k < 4; ++k) {
      AttendBatchStats st;
      worst = std::max(worst, b.decode_step(70 + k, &st));
      passes += st.shared_passes;
    }
    EXPECT_GT(b.holes(), 0) << q << ": no holes";
    EXPECT_LE(worst, kTol) << q;
    EXPECT_GT(passes, 0) << q;
  }
}

// Sequences that share nothing (prefix sharing off: every sequence computes its own blocks)
// fall back to attending alone: the same bits, no shared pass, and the same bytes read.
TEST(AttendCascade, NothingSharedFallsBackBitForBit) {
  for (const std::string q : {"fp16", "int4"}) {
    Shape s{q, 8};
    Batch b(s, false);
    const Ids prefix = tokens(5, 37);
    b.add(cat(prefix, tokens(11, 3)), 2, 1);
    b.add(cat(prefix, tokens(17, 9)), 5, 2);
    for (const int64_t c : b.cached()) EXPECT_EQ(c, 0);
    AttendBatchStats st;
    EXPECT_EQ(b.decode_step(9, &st), 0.0) << q;
    EXPECT_EQ(st.shared_passes, 0);
    EXPECT_EQ(st.cascaded_requests, 0);
    EXPECT_GT(st.bytes_read, 0);
  }
}

// Exact small case of the plan and its counters. fp32, blocks of 8, 3 KV heads. A and B share
// a 32-token prompt prefix P·Q (4 blocks); C shares P (16 tokens, 2 blocks) with them; D shares
// a different 16-token prefix R with E; F shares nothing. Per KV head: a pass over P for
// {A, B, C}, over Q for {A, B}, over R for {D, E}: 3 shared passes, 16 + 16 + 16 tokens.
TEST(AttendCascade, SequencesSharingDifferentAndNestedPrefixes) {
  Shape s{"fp32", 8};
  Batch b(s, true);
  const Ids P = tokens(5, 16), Q = tokens(9, 16), R = tokens(13, 16);
  b.add(cat(cat(P, Q), tokens(21, 5)), 1, 1);  // A
  b.add(cat(cat(P, Q), tokens(22, 7)), 2, 2);  // B
  b.add(cat(P, tokens(23, 20)), 3, 3);         // C
  b.add(cat(R, tokens(24, 9)), 1, 4);          // D
  b.add(cat(R, tokens(25, 2)), 4, 5);          // E
  b.add(tokens(26, 12), 2, 6);                 // F
  EXPECT_EQ(b.cached(), (std::vector<int64_t>{0, 32, 16, 0, 16, 0}));
  AttendBatchStats st, off;
  EXPECT_LE(b.decode_step(3, &st, &off), kTol);
  EXPECT_EQ(st.shared_passes, 3 * 3);
  EXPECT_EQ(st.shared_tokens, 3 * (16 + 16 + 16));
  EXPECT_EQ(st.cascaded_requests, 5);
  EXPECT_EQ(off.shared_passes, 0);
  // Bytes: fp32 blocks of 8 tokens × 32 dims (1 KiB). Alone, every sequence reads all its
  // blocks; the cascade reads P's 2 blocks once instead of 3 times, Q's and R's once instead of
  // twice — 8 blocks fewer per stream and KV head — and nothing else changes (every shared run
  // ends on a block boundary, where the own passes start).
  EXPECT_EQ(off.bytes_read - st.bytes_read, 8 * 2 * 3 * 1024);
}

// The merge: attend_range over keys [0, P) and [P, T), merged by merge_partial, equals one pass
// over [0, T) and attend() within kTol, for split points inside blocks and at their ends, with
// an empty side (P = 0, P = T).
TEST(AttendCascade, MergeOfTwoRunsEqualsOnePass) {
  for (const std::string q : {"fp32", "int4", "kivi:k2:v2:g8:r8"}) {
    auto c = make_config(1, 14, 2, 32, q, "full");
    c.block_tokens = 8;
    TorchCache m(c);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
    const int64_t T = 45;
    m.append(0, testing::randn({1, 2, T, 32}, gen), testing::randn({1, 2, T, 32}, gen), testing::positions_range(0, T));
    const at::Tensor qt = testing::randn({1, 14, 1, 32}, gen);
    const at::Tensor ref = m.attend(0, qt, testing::positions_range(T - 1, 1));
    const cache::LayerStore& L = cache::CacheManagerAccess::layer(m.core(), 0);
    for (int64_t h = 0; h < 2; ++h) {
      std::vector<float> rows(static_cast<size_t>(7 * 32));
      for (int64_t g = 0; g < 7; ++g) {
        const at::Tensor src = qt[0][h * 7 + g][0].contiguous();
        std::copy_n(src.data_ptr<float>(), 32, rows.data() + g * 32);
      }
      std::vector<int64_t> pos(7, T - 1);
      cache::RangeArgs ra;
      ra.layer = &L;
      ra.head = h;
      ra.fused = true;
      ra.q = rows.data();
      ra.q_pos = pos.data();
      ra.rows = 7;
      for (const int64_t p : {int64_t{0}, int64_t{5}, int64_t{8}, int64_t{32}, int64_t{44}, T}) {
        cache::PartialState a, b;
        ra.first = 0;
        ra.count = p;
        cache::attend_range(ra, a);
        ra.first = p;
        ra.count = T - p;
        cache::attend_range(ra, b);
        for (int64_t g = 0; g < 7; ++g) {
          const auto r = static_cast<size_t>(g);
          cache::merge_partial(&a.m[r], &a.l[r], a.acc.data() + g * 32, b.m[r], b.l[r], b.acc.data() + g * 32, 32);
          std::vector<float> out(32);
          cache::normalize_partial(a.l[r], a.acc.data() + g * 32, 32, out.data());
          const at::Tensor want = ref[0][h * 7 + g][0];
          for (int64_t i = 0; i < 32; ++i) {
            EXPECT_NEAR(out[static_cast<size_t>(i)], want[i].item<float>(), kTol) << q << " split " << p;
          }
        }
      }
    }
  }
}

// merge_partial against exact arithmetic on a hand-checked case: scores {0, ln 3} over values
// {1, 2} split one key per side: m = ln 3, l = 1/3 + 1, acc = 1/3 + 2, out = 7/4.
TEST(AttendCascade, MergeExactSmallCase) {
  float m = 0.0f, l = 1.0f, acc = 1.0f;                 // key 0: s = 0, v = 1
  const float m2 = std::log(3.0f), l2 = 1.0f, acc2 = 2.0f;  // key 1: s = ln 3, v = 2
  cache::merge_partial(&m, &l, &acc, m2, l2, &acc2, 1);
  EXPECT_FLOAT_EQ(m, std::log(3.0f));
  EXPECT_NEAR(l, 4.0f / 3.0f, 1e-6);
  float out = 0;
  cache::normalize_partial(l, &acc, 1, &out);
  EXPECT_NEAR(out, 1.75f, 1e-6);
  // An empty side changes nothing; two empty sides stay empty (output 0).
  const float before = acc;
  cache::merge_partial(&m, &l, &acc, -INFINITY, 0.0f, &acc2, 1);
  EXPECT_EQ(acc, before);
  float em = -INFINITY, el = 0.0f, ea = 0.0f;
  cache::merge_partial(&em, &el, &ea, -INFINITY, 0.0f, &acc2, 1);
  cache::normalize_partial(el, &ea, 1, &out);
  EXPECT_EQ(out, 0.0f);
}


// ---------------------------------------------------------------- the thread split of a head
// attend_split (attend.h) cuts each KV head's keys into runs on K block boundaries, takes each
// run's partial state with attend_range and merges them in run order with merge_partial. Against
// the unsplit head (begin_attend + attend_head: what one thread runs) only float32 rounding
// changes, as in the cascade above: the same bytes, kernels and scores; the online softmax's
// running sums are continued across a cut by a rescaling exp(m − m') instead of tile by tile, and
// tiles start at the cut. Outputs are convex combinations of the values, so |Δ| ≤ kTol · max|v|
// (randn values here, max|v| ≈ 4.2; measured on a Zen 4 EPYC: within 1.3e-7 · max|v| over every
// case, both ISAs). A key skipped at a cut (the first run one token short) fails every case.

/// A one-layer cache of `hkv` KV heads × 7 query heads each, D 64, `t` tokens appended in
/// prefill chunks of 61 (post-RoPE keys), then `decode` decode steps of one token; the policy
/// evicts as it says (holes).
TorchCache split_cache(const std::string& scheme, int64_t block, int64_t hkv, const std::string& policy, int64_t t,
                       int64_t decode, uint64_t seed) {
  auto c = make_config(1, 7 * hkv, hkv, 64, scheme, policy, t + decode + 64);
  c.block_tokens = block;
  TorchCache m(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (int64_t p = 0; p < t; p += 61) {
    const int64_t n = std::min<int64_t>(61, t - p);
    m.append(0, testing::randn({1, hkv, n, 64}, gen), testing::randn({1, hkv, n, 64}, gen),
             testing::positions_range(p, n));
    m.end_step(p + n >= t ? StepKind::kPrefillEnd : StepKind::kPrefill);
  }
  for (int64_t i = 0; i < decode; ++i) {
    m.append(0, testing::randn({1, hkv, 1, 64}, gen), testing::randn({1, hkv, 1, 64}, gen),
             testing::positions_range(t + i, 1));
    m.end_step(StepKind::kDecode);
  }
  return m;
}

/// The AttendArgs of layer 0 of `m` for query q `[1, H_q, T_q, D]` at positions `pos` into `out`.
cache::AttendArgs split_args(const TorchCache& m, const at::Tensor& q, const std::vector<int64_t>& pos, bool fused,
                             std::vector<float>& out) {
  cache::AttendArgs a;
  a.layer = &cache::CacheManagerAccess::layer(m.core(), 0);
  a.q = q.data_ptr<float>();
  a.q_pos = pos.data();
  a.t_q = static_cast<int64_t>(pos.size());
  a.num_q_heads = q.size(1);
  a.fused = fused;
  out.assign(static_cast<size_t>(q.numel()), 0.0f);
  a.out = out.data();
  return a;
}

/// What one thread computes: every head unsplit.
std::vector<float> unsplit(const cache::AttendArgs& a0) {
  std::vector<float> out(static_cast<size_t>(a0.num_q_heads * a0.t_q * a0.layer->head_dim()));
  cache::AttendArgs a = a0;
  a.out = out.data();
  cache::begin_attend(a);
  for (int64_t h = 0; h < a.layer->num_heads(); ++h) cache::attend_head(a, h);
  return out;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double w = 0;
  for (size_t i = 0; i < a.size(); ++i) w = std::max(w, std::abs(static_cast<double>(a[i]) - b[i]));
  return w;
}

/// The kernel ISAs this CPU runs (the AVX2 build too on an AVX-512 CPU), or none.
std::vector<cache::fused::FusedIsa> split_isas() {
  using cache::fused::FusedIsa;
  const FusedIsa before = cache::fused::current_isa();
  std::vector<FusedIsa> out;
  for (const FusedIsa isa : {FusedIsa::kAvx512, FusedIsa::kAvx2}) {
    if (cache::fused::use_fused_isa(isa)) out.push_back(isa);
  }
  cache::fused::use_fused_isa(before);
  if (out.empty()) out.push_back(FusedIsa::kNone);
  return out;
}

// Every format (fused and generic path, every kernel ISA the CPU runs), 1 and 2 KV heads, blocks
// of 8/16/32/1 tokens and T = 203 (not a multiple), with and without holes, a decode query and a
// 5-token chunk (its rows see different keys: the last runs are partly masked): split into 2, 3
// and 5 runs, the output equals the unsplit head within kTol · max|v|.
TEST(AttendSplit, EqualsTheUnsplitHeadForEveryFormat) {
  struct Case {
    std::string scheme;
    int64_t block;
  };
  const std::vector<Case> cases = {{"fp32", 8},         {"fp16", 16},          {"bf16", 8},
                                   {"fp8:e4m3", 8},     {"fp8:e4m3:scaled", 8}, {"int8", 32},
                                   {"int4", 8},         {"int4", 1},           {"int2", 16},
                                   {"int4:g32:chan", 32}, {"kivi:k2:v2:g32:r64", 32}, {"kivi:k4:v4:g32:r64", 32},
                                   {"int3", 8},         {"had(int4)", 8},      {"tq:b4", 8}};
  for (const cache::fused::FusedIsa isa : split_isas()) {
    if (isa != cache::fused::FusedIsa::kNone) cache::fused::use_fused_isa(isa);
    for (const Case& k : cases) {
      for (const int64_t hkv : {int64_t{1}, int64_t{2}}) {
        for (const std::string policy : {"full", "random:seed3@150"}) {
          TorchCache m = split_cache(k.scheme, k.block, hkv, policy, 203, 6, 11);
          const cache::LayerStore& L = cache::CacheManagerAccess::layer(m.core(), 0);
          if (policy != "full" && k.block > 1) {  // (one-token blocks are freed whole)
            const auto st = cache::CacheManagerAccess::stream(m.core(), 0, true);
            int64_t dead = 0;
            for (const int64_t d : st.dead_slots) dead += d;
            EXPECT_GT(dead, 0) << k.scheme << ": the case must have holes";
          }
          auto gen = at::make_generator<at::CPUGeneratorImpl>(21);
          const double vmax = m.get(0).v.abs().max().item<double>();
          for (const int64_t tq : {int64_t{1}, int64_t{5}}) {
            const at::Tensor q = testing::randn({1, 7 * hkv, tq, 64}, gen).contiguous();
            std::vector<int64_t> pos(static_cast<size_t>(tq));
            for (int64_t i = 0; i < tq; ++i) pos[static_cast<size_t>(i)] = 203 + 6 - tq + i;
            for (const bool fused : {true, false}) {
              std::vector<float> out;
              const cache::AttendArgs a = split_args(m, q, pos, fused, out);
              const std::vector<float> ref = unsplit(a);
              for (const int64_t parts : {2, 3, 5}) {
                const std::vector<int64_t> cuts = cache::split_points(L, 0, parts);
                ASSERT_EQ(cuts.size(), static_cast<size_t>(parts + 1));
                cache::attend_split(a, parts);
                const std::string where = k.scheme + " block " + std::to_string(k.block) + " H_kv " +
                                          std::to_string(hkv) + " " + policy + " T_q " + std::to_string(tq) +
                                          (fused ? " fused " : " generic ") + cache::fused::isa_name(isa) + " parts " +
                                          std::to_string(parts);
                EXPECT_LE(max_diff(out, ref), kTol * vmax) << where;
              }
            }
          }
        }
      }
    }
  }
  cache::fused::set_isa(cache::fused::best_isa());
}

// The merge is deterministic: the runs are independent tasks merged in run order, so a split
// gives the same bits on 1 and 2 threads and on every repetition (attend() on a given thread
// count always splits the same way: split_parts).
TEST(AttendSplit, SameBitsOnOneAndTwoThreads) {
  const int before_threads = at::get_num_threads();
  for (const std::string q : {"fp16", "int4", "kivi:k2:v2:g32:r64"}) {
    for (const int64_t hkv : {int64_t{1}, int64_t{2}}) {
      TorchCache m = split_cache(q, 32, hkv, "random:seed3@150", 203, 6, 13);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
      const at::Tensor qt = testing::randn({1, 7 * hkv, 1, 64}, gen).contiguous();
      const std::vector<int64_t> pos{208};
      std::vector<float> out;
      const cache::AttendArgs a = split_args(m, qt, pos, true, out);
      std::vector<std::vector<float>> runs;
      for (const int n : {1, 2, 2}) {
        at::set_num_threads(n);
        cache::attend_split(a, 5);
        runs.push_back(out);
      }
      for (size_t i = 1; i < runs.size(); ++i) {
        EXPECT_EQ(std::memcmp(runs[i].data(), runs[0].data(), out.size() * sizeof(float)), 0)
            << q << " H_kv " << hkv << ": run " << i << " differs from one thread";
      }
    }
  }
  at::set_num_threads(before_threads);
}

// The cut points on a hand-checked case: 45 live tokens in blocks of 8 (boundaries 0, 8, ..., 40,
// 45), three runs: the targets 15 and 30 go to the nearest boundaries 16 and 32; more runs than
// blocks give empty runs (equal cuts), never a cut inside a block.
TEST(AttendSplit, CutsOnTheNearestBlockBoundary) {
  TorchCache m = split_cache("fp32", 8, 1, "full", 45, 0, 3);
  const cache::LayerStore& L = cache::CacheManagerAccess::layer(m.core(), 0);
  EXPECT_EQ(cache::split_points(L, 0, 1), (std::vector<int64_t>{0, 45}));
  EXPECT_EQ(cache::split_points(L, 0, 3), (std::vector<int64_t>{0, 16, 32, 45}));
  EXPECT_EQ(cache::split_points(L, 0, 2), (std::vector<int64_t>{0, 24, 45}));  // 22.5 -> 22: 24 is nearer than 16
  const std::vector<int64_t> many = cache::split_points(L, 0, 12);
  ASSERT_EQ(many.size(), 13u);
  for (size_t i = 0; i + 1 < many.size(); ++i) {
    EXPECT_LE(many[i], many[i + 1]);
    EXPECT_TRUE(many[i] % 8 == 0 || many[i] == 45) << many[i];
  }
}

// When the split runs (split_parts): a head of 7 query rows × D 64 over T keys is 448 · T
// multiply-adds per product, so the grain (2^20) is 2,340.6 keys' worth.
TEST(AttendSplit, PartsFollowTheThreadsAndTheGrain) {
  std::vector<float> out;
  const std::vector<int64_t> pos{5000};
  {
    TorchCache m = split_cache("fp16", 0, 1, "full", 5000, 0, 5);  // 2.1 grains
    const at::Tensor q = at::zeros({1, 7, 1, 64});
    cache::AttendArgs a = split_args(m, q, pos, true, out);
    EXPECT_EQ(cache::split_parts(a, 1), 1);
    EXPECT_EQ(cache::split_parts(a, 2), 2);
    EXPECT_EQ(cache::split_parts(a, 4), 2);  // 4 runs would fall below the grain
    a.need.rows = 1;
    ASSERT_TRUE(a.need.any());
    EXPECT_EQ(cache::split_parts(a, 2), 1);  // the mass needs one pass per head
    a.need = AttentionNeed{};
    a.tail_n = 1;
    EXPECT_EQ(cache::split_parts(a, 2), 1);  // a replay tail
  }
  {
    TorchCache m = split_cache("fp16", 0, 1, "full", 2000, 0, 5);  // 0.85 grains
    const at::Tensor q = at::zeros({1, 7, 1, 64});
    const cache::AttendArgs a = split_args(m, q, pos, true, out);
    EXPECT_EQ(cache::split_parts(a, 2), 1);
  }
  {
    TorchCache m = split_cache("fp16", 0, 2, "full", 5000, 0, 5);
    const at::Tensor q = at::zeros({1, 14, 1, 64});
    const cache::AttendArgs a = split_args(m, q, pos, true, out);
    EXPECT_EQ(cache::split_parts(a, 2), 1);  // two heads fill two threads
    EXPECT_EQ(cache::split_parts(a, 4), 2);  // 2 heads × 2 runs
    EXPECT_EQ(cache::split_parts(a, 3), 2);  // 6 runs would be even, 3 per head fall below the grain
  }
  {
    TorchCache m = split_cache("fp16", 0, 1, "full", 12000, 0, 5);  // 5.1 grains
    const at::Tensor q = at::zeros({1, 7, 1, 64});
    const cache::AttendArgs a = split_args(m, q, pos, true, out);
    EXPECT_EQ(cache::split_parts(a, 16), 5);  // as many as the grain allows
    EXPECT_EQ(cache::split_parts(a, 3), 3);
  }
}

// The public attend() of one long sequence with one KV head: on two threads it is the split
// (the same bits as attend_split into 2), on one thread the unsplit head (the same bits as
// attend_head). Skipped where no OpenMP threads run (the sanitizer build).
TEST(AttendSplit, AttendSplitsOneLongHeadOnTwoThreads) {
  const int before_threads = at::get_num_threads();
  at::set_num_threads(2);
  const bool threads = cache::attend_threads() >= 2;
  at::set_num_threads(before_threads);
  if (!threads) GTEST_SKIP() << "built without OpenMP threads: attend() never splits";
  for (const std::string q : {"int4", "fp16"}) {
    TorchCache m = split_cache(q, 0, 1, "full", 5000, 0, 9);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
    const at::Tensor qt = testing::randn({1, 7, 1, 64}, gen).contiguous();
    const std::vector<int64_t> pos{4999};
    std::vector<float> out;
    const cache::AttendArgs a = split_args(m, qt, pos, true, out);
    cache::attend_split(a, 2);
    const std::vector<float> split = out;
    const std::vector<float> one = unsplit(a);
    EXPECT_GT(max_diff(split, one), 0.0) << q << ": the split should round differently somewhere";
    for (const int n : {2, 1}) {
      at::set_num_threads(n);
      const at::Tensor got = m.attend(0, qt, testing::positions_range(4999, 1)).contiguous();
      const std::vector<float> want = n == 2 ? split : one;
      EXPECT_EQ(std::memcmp(got.data_ptr<float>(), want.data(), want.size() * sizeof(float)), 0)
          << q << " on " << n << " threads";
    }
    at::set_num_threads(before_threads);
  }
}


// attend_batch splits a long head as attend() does (the same runs, merged in the same order), so
// a request in a batch — with the cascade or without — gets its attend() call's bits, on one
// thread and on two; and the split is no shared pass.
TEST(AttendSplit, AttendBatchSplitsAsAttendDoes) {
  const int before_threads = at::get_num_threads();
  for (const std::string q : {"int4", "fp16"}) {
    TorchCache m = split_cache(q, 0, 1, "full", 5000, 0, 4);
    TorchCache other = split_cache(q, 0, 2, "full", 300, 0, 5);  // a second request, 2 KV heads
    auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
    const at::Tensor qt = testing::randn({1, 7, 1, 64}, gen).contiguous();
    const at::Tensor qo = testing::randn({1, 14, 1, 64}, gen).contiguous();
    const at::Tensor pos = testing::positions_range(4999, 1), pos_o = testing::positions_range(299, 1);
    for (const int n : {1, 2}) {
      at::set_num_threads(n);
      const at::Tensor want = m.attend(0, qt, pos);
      const at::Tensor want_o = other.attend(0, qo, pos_o);
      for (const bool cascade : {true, false}) {
        at::Tensor out = at::full({1, 7, 1, 64}, 7.0f), out_o = at::full({1, 14, 1, 64}, 7.0f);
        std::vector<AttendRequest> reqs = {{&m.core(), qt, pos, mutable_view_of(out)},
                                           {&other.core(), qo, pos_o, mutable_view_of(out_o)}};
        AttendBatchOptions opt;
        opt.cascade = cascade;
        AttendBatchStats st;
        opt.stats = &st;
        attend_batch(0, reqs, opt);
        EXPECT_TRUE(at::equal(out, want)) << q << " on " << n << " threads, cascade " << cascade;
        EXPECT_TRUE(at::equal(out_o, want_o)) << q << " on " << n << " threads, cascade " << cascade;
        EXPECT_EQ(st.shared_passes, 0);
        EXPECT_EQ(st.cascaded_requests, 0);
      }
    }
    at::set_num_threads(before_threads);
  }
}

}  // namespace
}  // namespace kvcache
