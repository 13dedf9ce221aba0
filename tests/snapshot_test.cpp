// SPDX-License-Identifier: Apache-2.0
// Snapshots of one sequence (CacheManager::save / load, kvcache/snapshot.h,
// docs/snapshot-format.md): the round trip for every registered scheme and policy (blocks byte
// for byte, then attend() outputs and evictions equal while both copies continue), every class of
// refused file with the cache unchanged, bytes on disk against bytes stored, and the atomic
// write (a full disk, a read-only directory, a kill -9 in the middle of a save).
#include <dirent.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>
#include <thread>

#include "../fuzz/snapshot_configs.h"
#include "cache/cache_manager_access.h"
#include "cache/layer_store.h"
#include "cache/multi_sequence_access.h"
#include "cache_test_util.h"
#include "kvcache/kvquant.h"
#include "kvcache/multi_sequence_cache.h"
#include "kvcache/registry.h"
#include "kvcache/snapshot.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;
using testing::make_config;
using testing::positions_range;
using Reason = SnapshotError::Reason;

const std::string kModel = "test-model:config=abc:weights=0123456789abcdef";

std::string temp_dir(const std::string& name) {
  std::string d = ::testing::TempDir() + "snapshot_test_" + std::to_string(::getpid()) + "_" + name;
  ::mkdir(d.c_str(), 0755);
  return d;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::vector<std::string> dir_entries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(n);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string bytes_of(const CacheManager& m, const std::string& model = kModel) {
  std::ostringstream os;
  m.save(os, model);
  return os.str();
}

void load_bytes(CacheManager& m, const std::string& bytes, const std::string& model = kModel) {
  std::istringstream is(bytes);
  m.load(is, model);
}

/// The reason of the SnapshotError `f` throws (fails the test when it throws none).
Reason reason_of(const std::function<void()>& f, std::string* what = nullptr) {
  try {
    f();
  } catch (const SnapshotError& e) {
    if (what != nullptr) *what = e.what();
    return e.reason();
  }
  ADD_FAILURE() << "no SnapshotError";
  return Reason::kIo;
}


// ------------------------------------------------------------ driving two caches alike

/// One step fed to every cache in `ms` alike (random K/V/q from `gen`, 2 KV heads, 4 query heads,
/// D = 8): append + attend per layer, then end_step(kind); a replay step when `replay`. Returns
/// the attend() outputs of the first cache and EXPECTs the others' equal bit for bit.
std::vector<at::Tensor> step_all(const std::vector<TorchCache*>& ms, at::Generator& gen, int64_t n, StepKind kind,
                                 bool replay, const std::string& where) {
  std::vector<at::Tensor> outs;
  if (replay) {
    for (TorchCache* m : ms) m->begin_replay();
  }
  const int64_t layers = ms[0]->config().num_layers;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t p0 = ms[0]->next_position(l);
    const int64_t d = ms[0]->config().head_dim;
    const at::Tensor k = testing::randn({1, 2, n, d}, gen) * 2.0, v = testing::randn({1, 2, n, d}, gen);
    const at::Tensor q = testing::randn({1, 4, n, d}, gen);
    for (size_t i = 0; i < ms.size(); ++i) {
      EXPECT_EQ(ms[i]->next_position(l), p0) << where;
      ms[i]->append(l, k, v, positions_range(p0, n));
      const at::Tensor o = ms[i]->attend(l, q, positions_range(p0, n));
      if (i == 0) {
        outs.push_back(o);
      } else {
        EXPECT_TRUE(at::equal(o, outs.back())) << where << " layer " << l << ": attend() differs";
      }
    }
  }
  for (TorchCache* m : ms) {
    m->end_step(kind);
    m->check_invariants();
  }
  return outs;
}

/// The steps of a request of 40 tokens: three prefill chunks (18 tokens), a context replay when
/// the policy asks for one (KVzip), then decode steps. `from`..`to` (step indices).
void run_steps(const std::vector<TorchCache*>& ms, at::Generator& gen, int from, int to, const std::string& where) {
  const int64_t chunks[3] = {6, 5, 7};
  for (int s = from; s < to; ++s) {
    if (s < 3) {
      step_all(ms, gen, chunks[s], s == 2 ? StepKind::kPrefillEnd : StepKind::kPrefill, false, where);
      if (s == 2 && ms[0]->replay_need().any()) {
        step_all(ms, gen, 3, StepKind::kReplay, true, where + " replay");
        step_all(ms, gen, 4, StepKind::kReplayEnd, true, where + " replay end");
      }
    } else {
      step_all(ms, gen, 1, StepKind::kDecode, false, where + " decode " + std::to_string(s));
    }
  }
}

/// EXPECTs that the stored blocks of `a` and `b` are equal: per layer, head and stream the
/// scales, every block's format, slots, holes and positions, and the bytes of its filled groups.
void expect_same_blocks(const SequenceCache& a, const SequenceCache& b, const std::string& where) {
  for (int64_t l = 0; l < a.config().num_layers; ++l) {
    const cache::LayerStore& la = cache::CacheManagerAccess::layer(a, l);
    const cache::LayerStore& lb = cache::CacheManagerAccess::layer(b, l);
    EXPECT_EQ(la.k_scale(), lb.k_scale()) << where;
    EXPECT_EQ(la.v_scale(), lb.v_scale()) << where;
    for (int64_t h = 0; h < la.num_heads(); ++h) {
      for (const bool key : {true, false}) {
        const cache::HeadStream& sa = key ? la.k(h) : la.v(h);
        const cache::HeadStream& sb = key ? lb.k(h) : lb.v(h);
        EXPECT_EQ(sa.written, sb.written) << where;
        for (int li = 0; li < 2; ++li) {
          const cache::BlockList& xa = li == 0 ? sa.quant : sa.resid;
          const cache::BlockList& xb = li == 0 ? sb.quant : sb.resid;
          const std::string at = detail::str_cat(where, " layer ", l, " head ", h, key ? " K" : " V",
                                                 li == 0 ? " quantized" : " residual");
          ASSERT_EQ(xa.blocks().size(), xb.blocks().size()) << at;
          for (size_t i = 0; i < xa.blocks().size(); ++i) {
            const cache::Block& ba = xa.blocks()[i];
            const cache::Block& bb = xb.blocks()[i];
            EXPECT_EQ(ba.format, bb.format) << at;
            EXPECT_EQ(ba.filled, bb.filled) << at;
            EXPECT_EQ(ba.live, bb.live) << at;
            EXPECT_EQ(ba.dead, bb.dead) << at;
            for (int64_t s = 0; s < ba.filled; ++s) EXPECT_EQ(ba.position(s), bb.position(s)) << at;
            const cache::BlockFormat& F = xa.format(ba);
            const int64_t groups = (ba.filled + F.layout.group_tokens - 1) / F.layout.group_tokens;
            const int64_t meta = F.layout.meta_count * dtype_size(F.layout.meta_dtype) * groups;
            const uint8_t* ma = F.pool->data(ba.id);
            const uint8_t* mb = xb.format(bb).pool->data(bb.id);
            EXPECT_EQ(std::memcmp(ma, mb, static_cast<size_t>(groups * F.layout.code_bytes)), 0) << at << " codes";
            EXPECT_EQ(std::memcmp(ma + F.scales_offset, mb + F.scales_offset, static_cast<size_t>(meta)), 0) << at;
            if (F.layout.has_zeros) {
              EXPECT_EQ(std::memcmp(ma + F.zeros_offset, mb + F.zeros_offset, static_cast<size_t>(meta)), 0) << at;
            }
          }
        }
      }
    }
  }
}

struct RoundTripCase {
  std::string scheme, policy;
  KeyStorage keys = KeyStorage::kPostRoPE;
  PositionMode positions = PositionMode::kOriginal;
  int64_t head_dim = 8;
};

/// Runs `c` to step `save_at`, saves, loads into a fresh cache (whose context length differs:
/// the snapshot's replaces it), compares blocks and snapshot bytes, then continues both.
void round_trip(const RoundTripCase& rc, int save_at) {
  auto cfg = make_config(2, 4, 2, rc.head_dim, rc.scheme, rc.policy, 40);
  cfg.key_storage = rc.keys;
  cfg.position_mode = rc.positions;
  const std::string where = rc.scheme + " " + rc.policy + " saved after step " + std::to_string(save_at);
  CacheManager a(cfg);
  TorchCache ta(a);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  run_steps({&ta}, gen, 0, save_at, where);
  const std::string saved = bytes_of(a);
  auto cfg_b = cfg;
  cfg_b.context_length = 0;
  CacheManager b(cfg_b);
  load_bytes(b, saved);
  TorchCache tb(b);
  tb.check_invariants();
  EXPECT_EQ(b.config().context_length, 40) << where;
  expect_same_blocks(a, b, where);
  testing::Snapshot(ta).expect_same(testing::Snapshot(tb), where);
  EXPECT_EQ(bytes_of(b), saved) << where << ": the restored cache saves other bytes";
  // Both continue with the same inputs: every attend() output, eviction and counter equal.
  run_steps({&ta, &tb}, gen, save_at, 12, where);
  testing::Snapshot(ta).expect_same(testing::Snapshot(tb), where + " at the end");
  expect_same_blocks(a, b, where + " at the end");
  EXPECT_EQ(bytes_of(a), bytes_of(b)) << where << " at the end";
}

std::vector<RoundTripCase> round_trip_cases() {
  static const std::string cal = testing::uniform_kvquant_calibration_file("snapshot_test", 2, 2, 8);
  std::vector<RoundTripCase> cases;
  // Every scheme (registered heads, and variants: per-channel, scaled fp8, a residual), under a
  // policy that evicts and keeps scores (holes, merges, converted groups, h2o state).
  for (const std::string s : {"fp32", "fp16", "bf16", "fp8:e4m3", "fp8:e4m3:scaled", "int8", "int4:g4", "int3",
                              "int2:g8:chan", "kivi:k2:v4:g4:r8", "had(int4)", "gear:b2:g4:s0.25:r1:loop1:nb8",
                              "gear:b2:g4:s0.25:r1:loop1:nb8:rp2:whole", "layers(int8;int4:g4)"}) {
    cases.push_back({s, "h2o@12"});
  }
  // The 2025 rotation formats (seeded rotations and sketches; PolarQuant needs head_dim >= 16).
  for (const std::string s :
       {"tq:b3", "tq:b2.5:prod:nc", "tq:b2:o2:g4", "turboquant:k3:v3", "qjl:m16:o2:g4:v2:r8:mo8:vg8"}) {
    cases.push_back({s, "h2o@12"});
  }
  cases.push_back({"polar", "h2o@12", KeyStorage::kPostRoPE, PositionMode::kOriginal, 16});
  cases.push_back({"kvquant:b3:o1:cal=" + cal, "h2o@12", KeyStorage::kPreRoPE});
  cases.push_back({"kvquant:b2:o1:f2:cal=" + cal, "full", KeyStorage::kPreRoPE});
  // Every policy (and wrappers), over int4 and KIVI.
  for (const std::string p :
       {"full", "window@12", "sink:s2@12", "h2o@12", "random:seed3@12", "tova@12", "snapkv:w4@90%",
        "pyramid:w4:b2@90%", "knorm:stream@12", "keydiff:stream@12", "expected:s2:stream@12", "expected:s2:n8@90%",
        "duo:s2:r6:w4@24", "kvzip:s2@90%", "adakv:h2o@12", "adakv:snapkv:w4@90%", "adakv:kvzip:s2@90%",
        "decode:i3:b2:keydiff@12", "decode:i4:b2:prefill:adakv:expected:s2@12", "perlayer(h2o@8;h2o@12)",
        "perlayer(full;snapkv:w4@90%)"}) {
    cases.push_back({"int4:g4", p});
    cases.push_back({"kivi:k2:v4:g4:r8", p});
  }
  // Pre-RoPE keys, re-rotated positions.
  for (const std::string p : {"sink:s2@12", "adakv:h2o@12", "duo:s2:r6:w4@24"}) {
    cases.push_back({"int4:g4", p, KeyStorage::kPreRoPE, PositionMode::kRerotate});
    cases.push_back({"fp16", p, KeyStorage::kPreRoPE});
  }
  return cases;
}

TEST(Snapshot, EveryRegisteredHeadIsCovered) {
  std::set<std::string> covered;
  for (const auto& c : round_trip_cases()) {
    covered.insert(spec_head(c.scheme));
    covered.insert(spec_head(c.policy));
    // Wrapped heads: adakv:<inner>, decode:...:<inner>, perlayer(<inner>...), had(<inner>), layers(...)
    for (const auto& s : registered_specs()) {
      if ((c.scheme + " " + c.policy).find(s.table.head) != std::string::npos) covered.insert(s.table.head);
    }
  }
  for (const auto& s : registered_specs()) EXPECT_TRUE(covered.count(s.table.head)) << s.table.head << " not round-tripped";
}

TEST(Snapshot, RoundTripContinuesBitForBit) {
  for (const auto& c : round_trip_cases()) {
    for (int save_at : {1, 3, 6}) {  // inside the prefill, after the prompt (and replay), while decoding
      round_trip(c, save_at);
      if (::testing::Test::HasFailure()) return;  // one case's failures, not hundreds
    }
  }
}

TEST(Snapshot, TokenIdsComeBackFromLoad) {
  auto cfg = make_config(2, 4, 2, 8, "int4:g4", "full", 40);
  CacheManager a(cfg), b(cfg);
  const std::vector<int64_t> ids = {1, 17, -3, int64_t{1} << 40};
  std::ostringstream os;
  a.save(os, kModel, ids);
  std::istringstream is(os.str());
  EXPECT_EQ(b.load(is, kModel), ids);
  std::istringstream again(bytes_of(a));
  EXPECT_EQ(b.load(again, kModel), std::vector<int64_t>{});
}

TEST(Snapshot, EmptyCacheRoundTrips) {
  auto cfg = make_config(3, 4, 2, 8, "int4:g4", "h2o@12", 40);
  CacheManager a(cfg), b(cfg);
  load_bytes(b, bytes_of(a));
  EXPECT_EQ(b.stats().tokens_written, 0);
  EXPECT_EQ(bytes_of(b), bytes_of(a));
}

TEST(Snapshot, SequenceOfAMultiSequenceCacheLoadsIntoACacheManager) {
  // Sequence 1 reuses sequence 0's prompt prefix from the index (shared blocks), goes on, and is
  // saved; a CacheManager of the same configuration loads it and both continue alike.
  for (const std::string scheme : {"int4:g4", "kivi:k2:v4:g4:r8", "fp16"}) {
    auto model = make_config(2, 4, 2, 8, scheme, "full", 0);
    model.block_tokens = 8;
    MultiSequenceConfig mc;
    mc.model = model;
    mc.capacity_bytes = int64_t{1} << 28;
    MultiSequenceCache pool(mc);
    std::vector<int64_t> prompt(32);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int64_t>(3 + i % 11);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(23);
    Sequence& first = pool.add_sequence();
    ASSERT_EQ(first.begin_request(prompt, 48).cached_tokens, 0);
    TorchCache t0(first);
    step_all({&t0}, gen, 16, StepKind::kPrefill, false, scheme);
    step_all({&t0}, gen, 16, StepKind::kPrefillEnd, false, scheme);
    first.finish();
    std::vector<int64_t> longer = prompt;
    for (int64_t i = 0; i < 8; ++i) longer.push_back(100 + i);
    Sequence& second = pool.add_sequence();
    const PrefixReuse reuse = second.begin_request(longer, 48);
    ASSERT_GT(reuse.cached_tokens, 0) << scheme;
    TorchCache t1(second);
    step_all({&t1}, gen, 40 - reuse.cached_tokens, StepKind::kPrefillEnd, false, scheme);
    step_all({&t1}, gen, 1, StepKind::kDecode, false, scheme);
    std::ostringstream os;
    second.save(os, kModel);
    auto cfg = model;
    CacheManager m(cfg);
    std::istringstream is(os.str());
    (void)m.load(is, kModel);
    expect_same_blocks(second, m, scheme);
    EXPECT_EQ(bytes_of(m), os.str()) << scheme;
    TorchCache tm(m);
    for (int i = 0; i < 4; ++i) step_all({&t1, &tm}, gen, 1, StepKind::kDecode, false, scheme + " continued");
    testing::Snapshot(t1).expect_same(testing::Snapshot(tm), scheme);
  }
}

std::string bytes_of(const Sequence& s, const std::string& model = kModel) {
  std::ostringstream os;
  s.save(os, model);
  return os.str();
}

std::vector<int64_t> load_bytes(Sequence& s, const std::string& bytes, const std::string& model = kModel) {
  std::istringstream is(bytes);
  return s.load(is, model);
}

MultiSequenceConfig pool_config(const CacheConfig& model, int64_t capacity = int64_t{1} << 28) {
  MultiSequenceConfig mc;
  mc.model = model;
  mc.capacity_bytes = capacity;
  return mc;
}

TEST(Snapshot, LoadIntoASequenceOfAMultiSequenceCacheContinuesBitForBit) {
  // A CacheManager's snapshot (holes, h2o scores, a KIVI residual) loads into a sequence of a
  // pool that holds other requests and cached prefixes; both continue with every attend()
  // output, eviction and block equal. Then that sequence's own snapshot — its blocks private
  // now — loads into a second sequence, which continues alike too.
  for (const std::string scheme : {"int4:g4", "kivi:k2:v4:g4:r8", "fp16"}) {
    for (const std::string policy : {"full", "h2o@12"}) {
      const std::string where = scheme + " " + policy;
      auto cfg = make_config(2, 4, 2, 8, scheme, policy, 40);
      cfg.block_tokens = 8;
      CacheManager a(cfg);
      TorchCache ta(a);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(31);
      run_steps({&ta}, gen, 0, 5, where);
      const std::string saved = bytes_of(a);

      MultiSequenceCache pool(pool_config(cfg));
      auto cfg_full = cfg;  // the same storage (namespace) under a policy that shares prefixes
      cfg_full.policy = "full";
      Sequence& other = pool.add_sequence(cfg_full);
      std::vector<int64_t> prompt(24);
      std::iota(prompt.begin(), prompt.end(), 7);
      ASSERT_EQ(other.begin_request(prompt, 40).cached_tokens, 0);
      TorchCache to(other);
      auto gen2 = at::make_generator<at::CPUGeneratorImpl>(32);
      step_all({&to}, gen2, 24, StepKind::kPrefillEnd, false, where);
      Sequence& target = pool.add_sequence();
      ASSERT_EQ(target.begin_request(prompt, 40).cached_tokens, policy == "full" ? 16 : 0) << where;  // shared blocks
      TorchCache tt(target);
      step_all({&tt}, gen2, 24 - target.prefix().cached_tokens, StepKind::kPrefillEnd, false, where);
      const int64_t index_pages = pool.stats().cached_blocks;
      ASSERT_GT(index_pages, 0);

      EXPECT_EQ(load_bytes(target, saved), std::vector<int64_t>{}) << where;
      pool.check_invariants();
      EXPECT_EQ(target.config().context_length, 40);
      expect_same_blocks(a, target, where);
      EXPECT_EQ(bytes_of(target), saved) << where << ": the loaded sequence saves other bytes";
      EXPECT_EQ(pool.stats().cached_blocks, index_pages) << where << ": the index changed";
      EXPECT_EQ(target.prefix().cached_tokens, 0);
      run_steps({&ta, &tt}, gen, 5, 9, where + " continued");
      pool.check_invariants();
      expect_same_blocks(a, target, where + " at the end");
      EXPECT_EQ(bytes_of(a), bytes_of(target)) << where;

      // Sequence -> Sequence (the other one, which shares blocks with the index).
      const std::string from_seq = bytes_of(other);
      Sequence& third = pool.add_sequence(cfg_full);
      load_bytes(third, from_seq);
      pool.check_invariants();
      expect_same_blocks(other, third, where + " sequence to sequence");
      TorchCache t3(third);
      for (int i = 0; i < 3; ++i) step_all({&to, &t3}, gen2, 1, StepKind::kDecode, false, where + " seq to seq");
      expect_same_blocks(other, third, where + " sequence to sequence, at the end");
      pool.check_invariants();
    }
  }
}

// ------------------------------------------------------------ refusals

/// A cache with eviction state (int4, h2o) after six steps, its snapshot, and a second cache of
/// the same config holding other tokens: the target a refused load must leave unchanged.
struct Refusal {
  CacheConfig cfg = make_config(2, 4, 2, 8, "int4:g4", "h2o@12", 40);
  CacheManager source{cfg}, target{cfg};
  std::string good;
  std::string target_bytes;
  Refusal() {
    TorchCache ts(source), tt(target);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    run_steps({&ts}, gen, 0, 6, "source");
    auto gen2 = at::make_generator<at::CPUGeneratorImpl>(6);
    run_steps({&tt}, gen2, 0, 4, "target");
    good = bytes_of(source);
    target_bytes = bytes_of(target);
  }
  /// The reason loading `bytes` into the target gives; EXPECTs the target unchanged.
  Reason refuse(const std::string& bytes, const std::string& where, std::string* what = nullptr,
                const std::string& model = kModel) {
    const Reason r = reason_of([&] { load_bytes(target, bytes, model); }, what);
    EXPECT_EQ(bytes_of(target), target_bytes) << where << ": a refused load changed the cache";
    return r;
  }
};

/// Recomputes the section checksums of `file` after an edit (to forge a file whose checksums hold).
void reseal(std::string& file) {
  auto* p = reinterpret_cast<uint8_t*>(&file[0]);
  uint64_t h = XXH3_64bits(p, 16);
  std::memcpy(p + 16, &h, 8);
  uint32_t count = 0;
  std::memcpy(&count, p + 12, 4);
  size_t at = 24;
  for (uint32_t i = 0; i < count && at + 24 <= file.size(); ++i) {
    h = XXH3_64bits(p + at, 16);
    std::memcpy(p + at + 16, &h, 8);
    uint64_t size = 0;
    std::memcpy(&size, p + at + 8, 8);
    at += 24;
    h = XXH3_64bits(p + at, size);
    std::memcpy(p + at + size, &h, 8);
    at += size + 8;
  }
}

TEST(SnapshotRefusal, EveryTruncationIsRefusedAsTruncated) {
  Refusal r;
  EXPECT_EQ(r.refuse("", "empty"), Reason::kNotSnapshot);
  for (size_t n = 1; n < r.good.size(); ++n) {
    std::string what;
    ASSERT_EQ(r.refuse(r.good.substr(0, n), "cut at " + std::to_string(n), &what), Reason::kTruncated)
        << "cut at " << n << ": " << what;
  }
  std::string what;
  r.refuse(r.good.substr(0, r.good.size() - 3), "cut", &what);
  EXPECT_THAT(what, HasSubstr("snapshot '<stream>': ends after " + std::to_string(r.good.size() - 3) + " bytes"));
  EXPECT_THAT(what, HasSubstr("(truncated)"));
}

TEST(SnapshotRefusal, EveryFlippedBitIsRefusedByAChecksum) {
  Refusal r;
  for (size_t i = 0; i < r.good.size(); ++i) {
    std::string bad = r.good;
    bad[i] = static_cast<char>(bad[i] ^ (1 << (i % 8)));
    std::string what;
    // The magic's bytes make it no snapshot at all; every other byte is under a checksum.
    ASSERT_EQ(r.refuse(bad, "flip at " + std::to_string(i), &what), i < 8 ? Reason::kNotSnapshot : Reason::kChecksum)
        << "flip at " << i << ": " << what;
  }
  std::string bad = r.good;
  bad[bad.size() / 2] ^= 0x40;
  std::string what;
  r.refuse(bad, "flip", &what);
  EXPECT_THAT(what, HasSubstr("does not match its bytes (checksum)"));
}

TEST(SnapshotRefusal, OtherModelSchemePolicyOrShape) {
  Refusal r;
  std::string what;
  EXPECT_EQ(r.refuse(r.good, "model", &what, "another-model"), Reason::kOtherModel);
  EXPECT_THAT(what, HasSubstr("written for model '" + kModel + "', the caller's model is 'another-model'"));
  struct Case {
    std::function<void(CacheConfig&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](CacheConfig& c) { c.scheme = "int8"; }, "scheme is 'int4:g4' in the file, 'int8' in the cache"},
      {[](CacheConfig& c) { c.policy = "h2o@16"; }, "policy is 'h2o@12' in the file, 'h2o@16' in the cache"},
      {[](CacheConfig& c) { c.block_tokens = 16; }, "block_tokens is '64' in the file, '16' in the cache"},
      {[](CacheConfig& c) { c.head_dim = 16; },
       "shape is '[layers=2, H_q=4, H_kv=2, D=8]' in the file, '[layers=2, H_q=4, H_kv=2, D=16]' in the cache"},
      {[](CacheConfig& c) { c.num_layers = 3; }, "shape is '[layers=2, H_q=4, H_kv=2, D=8]' in the file, '[layers=3,"},
      {[](CacheConfig& c) { c.num_q_heads = 2; }, "H_q=2"},
      {[](CacheConfig& c) { c.residual_length = 4; }, "residual_length is '0' in the file, '4' in the cache"},
      {[](CacheConfig& c) { c.key_storage = KeyStorage::kPreRoPE; }, "key_storage is '0' in the file, '1'"},
  };
  for (const auto& c : cases) {
    CacheConfig cfg = r.cfg;
    c.edit(cfg);
    CacheManager other(cfg);
    const std::string before = bytes_of(other);
    EXPECT_EQ(reason_of([&] { load_bytes(other, r.good); }, &what), Reason::kOtherConfig) << c.message;
    EXPECT_THAT(what, HasSubstr(c.message));
    EXPECT_THAT(what, HasSubstr("(other-config)"));
    EXPECT_EQ(bytes_of(other), before) << c.message;
  }
  // A spec spelled otherwise but canonically equal is the same configuration.
  CacheConfig same = r.cfg;
  same.scheme = "int4:g4:tok";
  CacheManager m(same);
  load_bytes(m, r.good);
  EXPECT_EQ(bytes_of(m), r.good);
}

TEST(SnapshotRefusal, FutureVersionAndNotASnapshot) {
  Refusal r;
  std::string future = r.good;
  const uint32_t v = kSnapshotFormatVersion + 1;
  std::memcpy(&future[8], &v, 4);
  reseal(future);
  std::string what;
  EXPECT_EQ(r.refuse(future, "future", &what), Reason::kFutureVersion);
  EXPECT_THAT(what, HasSubstr("format version 2, newer than the version 1 this library"));
  EXPECT_EQ(r.refuse("Once upon a time there was a cache.\n", "text", &what), Reason::kNotSnapshot);
  EXPECT_THAT(what, HasSubstr("does not start with the snapshot magic"));
  EXPECT_EQ(r.refuse(read_bytes(testing::uniform_kvquant_calibration_file("snapshot_test", 1, 1, 8)), "calibration"), Reason::kNotSnapshot);
  EXPECT_EQ(r.refuse(std::string(100, '\0'), "zeros"), Reason::kNotSnapshot);
}

TEST(SnapshotRefusal, ForgedContentWithValidChecksumsIsInconsistent) {
  Refusal r;
  // The first layer section starts after the preamble and the HEAD section.
  uint64_t head = 0;
  std::memcpy(&head, &r.good[24 + 8], 8);
  const size_t layer0 = 24 + 24 + head + 8 + 24;  // payload of section 1
  struct Forge {
    size_t offset;
    int64_t value;
    const char* message;
  };
  // Fields of layer 0: index, written, last position, min step, 7 counters, scales, flag, then
  // head 0's K stream: written, block count.
  for (const Forge& f : {Forge{0, 1, "names another layer"}, Forge{8, -5, "written -5"},
                         // a last position with no next one (append refuses to write it)
                         Forge{16, std::numeric_limits<int64_t>::max(), "last position 9223372036854775807"},
                         Forge{8 * 5, 999, "CacheManager invariant violated at layer 0: counters"},
                         Forge{8 * 11 + 9 + 8, int64_t{1} << 40, "needs"},
                         // fuzz_snapshot: a K stream's own count of tokens written, negative,
                         // was accepted and its next step wrote K and V differently.
                         Forge{8 * 11 + 9, -281474976710635,
                               "head 0 streams count -281474976710635 (K) and 21 (V) tokens written, expected equal and in [12, 21]"}}) {
    std::string bad = r.good;
    std::memcpy(&bad[layer0 + f.offset], &f.value, 8);
    reseal(bad);
    std::string what;
    EXPECT_EQ(r.refuse(bad, f.message, &what), Reason::kInconsistent) << f.message << ": " << what;
    EXPECT_THAT(what, HasSubstr(f.message));
  }
  // The header's context length (after four strings, six int64 and two bytes), past kMaxTokens:
  // fuzz_snapshot's DuoAttention overflowed sizing its streaming heads for 7.2e18 tokens.
  size_t at = 24 + 24;
  for (int s = 0; s < 4; ++s) {
    uint64_t len = 0;
    std::memcpy(&len, &r.good[at], 8);
    at += 8 + len;
  }
  at += 6 * 8 + 2;
  int64_t context = 0;
  std::memcpy(&context, &r.good[at], 8);
  ASSERT_EQ(context, 40);
  for (const int64_t v : {int64_t{-1}, kMaxTokens + 1, int64_t{0x6400000000000010}}) {
    std::string bad = r.good;
    std::memcpy(&bad[at], &v, 8);
    reseal(bad);
    std::string what;
    EXPECT_EQ(r.refuse(bad, "context", &what), Reason::kInconsistent) << v << ": " << what;
    EXPECT_THAT(what, HasSubstr("context length " + std::to_string(v) + " (expected 0 to 1000000000)"));
  }
  // Trailing bytes after the last section.
  std::string what;
  EXPECT_EQ(r.refuse(r.good + "x", "trailing", &what), Reason::kInconsistent);
  EXPECT_THAT(what, HasSubstr("1 bytes after the last of 5 sections"));
}

TEST(SnapshotRefusal, PolicyStateThatDoesNotFitTheShapeIsRefused) {
  // h2o's scores for 3 layers in a 2-layer cache (forged with valid checksums).
  std::string state;
  PolicyStateIO w(&state);
  std::vector<std::vector<std::vector<float>>> scores(3);
  w.io(scores);
  auto cfg = make_config(2, 4, 2, 8, "int4:g4", "h2o@12", 40);
  auto p = make_eviction_policy("h2o@12");
  p->reset(40, CacheShape{2, 4, 2});
  PolicyStateIO rd(reinterpret_cast<const uint8_t*>(state.data()), state.size());
  try {
    p->persist(rd);
    ADD_FAILURE() << "accepted";
  } catch (const SnapshotError& e) {
    EXPECT_EQ(e.reason(), Reason::kInconsistent);
    EXPECT_THAT(e.what(), HasSubstr("policy state: h2o scores for 3 layers, expected 2"));
  }
  // A count larger than the bytes left is refused before anything is allocated.
  std::string huge;
  PolicyStateIO hw(&huge);
  uint64_t n = uint64_t{1} << 60;
  hw.io(n);
  PolicyStateIO hr(reinterpret_cast<const uint8_t*>(huge.data()), huge.size());
  std::vector<float> v;
  EXPECT_THROW(hr.io(v), SnapshotError);
}

TEST(SnapshotRefusal, LoadIntoASequenceRefusedLeavesPoolAndSequenceUnchanged) {
  // int4, no eviction, blocks of 8 tokens: a 21-token snapshot needs 3 blocks per list.
  auto cfg = make_config(2, 4, 2, 8, "int4:g4", "full", 40);
  cfg.block_tokens = 8;
  CacheManager a(cfg);
  TorchCache ta(a);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(41);
  run_steps({&ta}, gen, 0, 6, "source");  // 18 prompt tokens + 3 decoded
  const std::string saved = bytes_of(a);
  int64_t need = 0;
  {
    MultiSequenceCache roomy(pool_config(cfg));
    load_bytes(roomy.add_sequence(), saved);
    need = roomy.stats().bytes_in_use;
  }
  ASSERT_GT(need, 0);
  const int64_t per_block = need / (2 * 2 * 2 * 3);  // layers x KV heads x streams x blocks
  ASSERT_EQ(need, per_block * 24);

  // A cache of need − 8 bytes, its sequence holding a 4-token request: even ending that request
  // leaves too little. Refused, nothing changed; then every class of a bad file, likewise.
  MultiSequenceCache small(pool_config(cfg, need - 8));
  Sequence& seq = small.add_sequence();
  std::vector<int64_t> mine = {900, 901, 902, 903};
  seq.begin_request(mine, 40);
  TorchCache ts(seq);
  step_all({&ts}, gen, 4, StepKind::kPrefillEnd, false, "small");
  const std::string before = bytes_of(seq);
  const PoolStats st = small.stats();
  auto unchanged = [&](const std::string& where) {
    small.check_invariants();
    EXPECT_EQ(bytes_of(seq), before) << where;
    EXPECT_EQ(small.stats().bytes_in_use, st.bytes_in_use) << where;
    EXPECT_EQ(small.stats().cached_blocks, st.cached_blocks) << where;
    EXPECT_EQ(seq.prefix().prompt_tokens, 4) << where;
  };
  try {
    load_bytes(seq, saved);
    ADD_FAILURE() << "no PoolFullError";
  } catch (const PoolFullError& e) {
    EXPECT_FALSE(e.preempted());
    EXPECT_THAT(e.what(), HasSubstr(std::to_string(need) + " B of blocks"));
  }
  unchanged("no room");
  std::string flipped = saved;
  flipped[flipped.size() / 2] ^= 0x10;
  EXPECT_EQ(reason_of([&] { load_bytes(seq, flipped); }), Reason::kChecksum);
  unchanged("flipped");
  EXPECT_EQ(reason_of([&] { load_bytes(seq, saved, "another-model"); }), Reason::kOtherModel);
  unchanged("other model");
  EXPECT_EQ(reason_of([&] { load_bytes(seq, saved.substr(0, saved.size() - 1)); }), Reason::kTruncated);
  unchanged("truncated");
  auto other_scheme = cfg;
  other_scheme.scheme = "int8";
  Sequence& int8 = small.add_sequence(other_scheme);
  EXPECT_EQ(reason_of([&] { load_bytes(int8, saved); }), Reason::kOtherConfig);
  unchanged("other scheme");
  EXPECT_EQ(reason_of([&] { int8.load("/nonexistent-dir/x.kvsnap", kModel); }), Reason::kIo);
  unchanged("missing file");
}

TEST(Snapshot, LoadIntoASequenceEndsItsRequestAndReclaimsUnusedPrefixes) {
  // A pool of exactly the snapshot's bytes, holding a finished request's cached prefix (2
  // blocks per list) and the target's own 4-token request (1 block per list): the load fits
  // only by ending the target's request and reclaiming the prefix. It does, and continues exactly.
  auto cfg = make_config(2, 4, 2, 8, "int4:g4", "full", 40);
  cfg.block_tokens = 8;
  CacheManager a(cfg);
  TorchCache ta(a);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(43);
  run_steps({&ta}, gen, 0, 6, "source");
  const std::string saved = bytes_of(a);
  const int64_t need = [&] {
    MultiSequenceCache roomy(pool_config(cfg));
    load_bytes(roomy.add_sequence(), saved);
    return roomy.stats().bytes_in_use;
  }();
  MultiSequenceCache pool(pool_config(cfg, need));
  Sequence& first = pool.add_sequence();
  std::vector<int64_t> prompt(17);
  std::iota(prompt.begin(), prompt.end(), 500);
  first.begin_request(prompt, 40);
  TorchCache t1(first);
  auto gen2 = at::make_generator<at::CPUGeneratorImpl>(44);
  step_all({&t1}, gen2, 16, StepKind::kPrefill, false, "first");
  first.finish();
  ASSERT_EQ(pool.stats().cached_blocks, 2 * 2 * 2 * 2);
  Sequence& target = pool.add_sequence();
  target.begin_request({1, 2, 3, 4}, 40);
  TorchCache tt(target);
  step_all({&tt}, gen2, 4, StepKind::kPrefillEnd, false, "target");
  ASSERT_EQ(pool.stats().bytes_in_use, need);
  const PrefixCounters c0 = pool.counters();
  load_bytes(target, saved);
  pool.check_invariants();
  EXPECT_EQ(pool.stats().bytes_in_use, need);
  EXPECT_EQ(pool.stats().cached_blocks, 0);
  EXPECT_EQ((pool.counters() - c0).blocks_reclaimed, 16);
  expect_same_blocks(a, target, "reclaimed");
  run_steps({&ta, &tt}, gen, 6, 8, "reclaimed, continued");
}

TEST(SnapshotRefusal, SaveInsideAStepIsRefused) {
  auto cfg = make_config(2, 4, 2, 8, "int4:g4", "full", 40);
  CacheManager m(cfg);
  TorchCache t(m);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  t.append(0, testing::randn({1, 2, 3, 8}, gen), testing::randn({1, 2, 3, 8}, gen), positions_range(0, 3));
  EXPECT_THAT(testing::error_of([&] { (void)bytes_of(m); }),
              HasSubstr("CacheManager::save: layer 0 is inside a step (append/attend ran; call end_step first)"));
}

// ------------------------------------------------------------ files

TEST(SnapshotFile, BytesOnDiskAreTheBytesStoredPlusTheHeader) {
  // 1024 tokens of D = 64, 2 KV heads, 2 layers, full policy: the file holds the stored bytes,
  // ~4 bytes of metadata per block, and a fixed header (the empty cache's file).
  for (const std::string scheme : {"int4:g32", "kivi:k2:v2:g32:r128", "fp16", "fp32"}) {
    auto cfg = make_config(2, 4, 2, 64, scheme, "full", 1100);
    CacheManager m(cfg);
    const auto empty = static_cast<int64_t>(bytes_of(m).size());
    TorchCache t(m);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    for (int64_t l = 0; l < 2; ++l) {
      t.append(l, testing::randn({1, 2, 1024, 64}, gen), testing::randn({1, 2, 1024, 64}, gen),
               positions_range(0, 1024));
    }
    t.end_step(StepKind::kPrefillEnd);
    const std::string dir = temp_dir("bytes");
    const std::string path = dir + "/seq.kvsnap";
    m.save(path, kModel);
    struct stat st{};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    const int64_t stored = m.stats().bytes_resident;
    EXPECT_EQ(m.stats().bytes_resident, m.stats().bytes_reserved) << scheme;  // no partly filled block here
    EXPECT_GE(st.st_size, stored) << scheme;
    EXPECT_LE(static_cast<double>(st.st_size), 1.01 * static_cast<double>(stored) + static_cast<double>(empty))
        << scheme << ": " << st.st_size << " bytes on disk for " << stored << " stored";
    std::remove(path.c_str());
    ::rmdir(dir.c_str());
  }
}

TEST(SnapshotFile, PathRoundTripAndMissingFile) {
  Refusal r;
  const std::string dir = temp_dir("path");
  const std::string path = dir + "/a.kvsnap";
  r.source.save(path, kModel);
  EXPECT_EQ(read_bytes(path), r.good);
  EXPECT_EQ(dir_entries(dir), std::vector<std::string>{"a.kvsnap"});  // no temporary left
  CacheManager m(r.cfg);
  m.load(path, kModel);
  EXPECT_EQ(bytes_of(m), r.good);
  std::string what;
  EXPECT_EQ(reason_of([&] { r.target.load(dir + "/missing.kvsnap", kModel); }, &what), Reason::kIo);
  EXPECT_THAT(what, HasSubstr("missing.kvsnap"));
  EXPECT_EQ(reason_of([&] { r.target.load(dir, kModel); }, &what), Reason::kIo);  // a directory
  EXPECT_EQ(bytes_of(r.target), r.target_bytes);
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

/// Runs `f` in a child process (fork) and returns its exit status (f's return value).
int in_child(const std::function<int()>& f) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 99;
    try {
      rc = f();
    } catch (...) {
      rc = 98;
    }
    ::_exit(rc);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(SnapshotFile, ReadOnlyDirectoryGivesAClearErrorAndChangesNothing) {
  Refusal r;
  const std::string dir = temp_dir("readonly");
  const std::string path = dir + "/a.kvsnap";
  r.target.save(path, kModel);
  ASSERT_EQ(::chmod(dir.c_str(), 0555), 0);
  // In a child that is not root (root writes anywhere): drop to nobody when root.
  const int rc = in_child([&] {
    if (::geteuid() == 0 && ::setuid(65534) != 0) return 97;
    try {
      r.source.save(path, kModel);
    } catch (const SnapshotError& e) {
      const std::string what = e.what();
      return e.reason() == Reason::kIo && what.find(path) != std::string::npos &&
                     what.find("Permission denied") != std::string::npos &&
                     what.find("the file at that path is unchanged") != std::string::npos
                 ? 0
                 : 2;
    }
    return 1;
  });
  ::chmod(dir.c_str(), 0755);
  EXPECT_EQ(rc, 0) << "1: saved into a read-only directory; 2: another error";
  EXPECT_EQ(read_bytes(path), r.target_bytes);
  EXPECT_EQ(dir_entries(dir), std::vector<std::string>{"a.kvsnap"});
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

TEST(SnapshotFile, FullDiskLeavesThePreviousFileAndNoTemporary) {
  Refusal r;
  const std::string dir = temp_dir("full");
  const std::string path = dir + "/a.kvsnap";
  r.target.save(path, kModel);
  // A file-size limit below the snapshot's size: write(2) fails with EFBIG as on a full disk.
  const int rc = in_child([&] {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{static_cast<rlim_t>(r.good.size() / 2), static_cast<rlim_t>(r.good.size() / 2)};
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return 97;
    try {
      r.source.save(path, kModel);
    } catch (const SnapshotError& e) {
      return e.reason() == Reason::kIo && std::string(e.what()).find(path) != std::string::npos ? 0 : 2;
    }
    return 1;
  });
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(read_bytes(path), r.target_bytes);
  EXPECT_EQ(dir_entries(dir), std::vector<std::string>{"a.kvsnap"});
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

TEST(SnapshotFile, KillNineInTheMiddleOfASaveLeavesALoadableSnapshot) {
  // A large cache (fp32, 4 layers x 4 heads x 4096 tokens x D 64: 32 MiB) saved once (state A),
  // then driven on (state B) and saved over and over by a child, killed while a temporary
  // file exists (mid-save). The file must load, as A or as B, whole.
  auto cfg = make_config(4, 4, 4, 64, "fp32", "full", 8192);
  CacheManager m(cfg);
  TorchCache t(m);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto fill = [&](int64_t p0, int64_t n) {
    for (int64_t l = 0; l < 4; ++l) {
      t.append(l, testing::randn({1, 4, n, 64}, gen), testing::randn({1, 4, n, 64}, gen), positions_range(p0, n));
    }
    t.end_step(StepKind::kPrefill);
  };
  fill(0, 4096);
  const std::string dir = temp_dir("kill");
  const std::string path = dir + "/a.kvsnap";
  m.save(path, kModel);
  const std::string a = read_bytes(path);
  fill(4096, 64);
  const std::string b = bytes_of(m);
  ASSERT_NE(a, b);
  bool killed_mid_save = false;
  for (int attempt = 0; attempt < 5 && !killed_mid_save; ++attempt) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      for (;;) {
        try {
          m.save(path, kModel);
        } catch (...) {
          ::_exit(3);
        }
      }
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < until) {
      if (dir_entries(dir).size() > 1) {  // a temporary beside the file: a save is under way
        ::kill(pid, SIGKILL);
        killed_mid_save = true;
        break;
      }
    }
    if (!killed_mid_save) ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the saving child exited with " << WEXITSTATUS(status);
    CacheManager restored(cfg);
    restored.load(path, kModel);  // whole: A or B, never a part
    const std::string now = bytes_of(restored);
    EXPECT_TRUE(now == a || now == b);
  }
  EXPECT_TRUE(killed_mid_save) << "never caught the child inside a save";
  for (const auto& e : dir_entries(dir)) std::remove((dir + "/" + e).c_str());
  ::rmdir(dir.c_str());
}

// ------------------------------------------------------------ the prefix index on disk

/// K, V and q of a token as a function of its id alone (tables drawn from a fixed seed), so
/// that two processes, or two requests, computing the same tokens store the same bytes.
struct TokenKV {
  static constexpr int64_t kVocab = 64;
  at::Tensor k, v, q;  ///< [L, H, vocab, D]
  explicit TokenKV(const CacheConfig& c) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
    k = testing::randn({c.num_layers, c.num_kv_heads, kVocab, c.head_dim}, gen) * 2.0;
    v = testing::randn({c.num_layers, c.num_kv_heads, kVocab, c.head_dim}, gen);
    q = testing::randn({c.num_layers, c.num_q_heads, kVocab, c.head_dim}, gen);
  }
  static at::Tensor rows(const at::Tensor& t, int64_t l, const std::vector<int64_t>& ids, int64_t from, int64_t to) {
    const std::vector<int64_t> slice(ids.begin() + from, ids.begin() + to);
    return t[l].index_select(1, at::tensor(slice, at::kLong)).unsqueeze(0).contiguous();
  }
  /// One step of tokens ids[from, to) (append + attend per layer); the attend outputs.
  std::vector<at::Tensor> step(TorchCache& t, const std::vector<int64_t>& ids, int64_t from, int64_t to,
                               StepKind kind) const {
    std::vector<at::Tensor> outs;
    for (int64_t l = 0; l < t.config().num_layers; ++l) {
      t.append(l, rows(k, l, ids, from, to), rows(v, l, ids, from, to), positions_range(from, to - from));
      outs.push_back(t.attend(l, rows(q, l, ids, from, to), positions_range(from, to - from)));
    }
    t.end_step(kind);
    return outs;
  }
};

/// Prompts of the index tests: two that share their first 16 tokens and then diverge.
std::vector<int64_t> index_prompt(int which, int64_t n) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[static_cast<size_t>(i)] = i < 16 ? (i * 5 + 3) % TokenKV::kVocab : (i * 7 + which * 11) % TokenKV::kVocab;
  return p;
}

CacheConfig index_config(const std::string& scheme = "int4:g4") {
  auto c = make_config(2, 4, 2, 8, scheme, "full", 64);
  c.block_tokens = 8;
  return c;
}

/// Runs prompts 0 (32 tokens) and 1 (40 tokens) through `pool` (their pages enter the index).
void fill_index(MultiSequenceCache& pool, const TokenKV& kv) {
  for (int which : {0, 1}) {
    Sequence& s = pool.add_sequence();
    const std::vector<int64_t> p = index_prompt(which, which == 0 ? 32 : 40);
    const int64_t cached = s.begin_request(p, 64).cached_tokens;
    TorchCache t(s);
    kv.step(t, p, cached, static_cast<int64_t>(p.size()), StepKind::kPrefillEnd);
    s.finish();
  }
}

/// The same request computed whole (no sharing) and served by `pool` (reusing its index):
/// EXPECTs a prefix hit of `hit` tokens, equal blocks and bit-identical attend() outputs for
/// the computed tokens' step and two decode steps.
void expect_served_exactly(MultiSequenceCache& pool, const TokenKV& kv, const std::vector<int64_t>& prompt,
                           int64_t hit, const std::string& where) {
  CacheManager scratch(pool.config().model);
  scratch.reset(64);
  TorchCache ts(scratch);
  Sequence& s = pool.add_sequence();
  ASSERT_EQ(s.begin_request(prompt, 64).cached_tokens, hit) << where;
  TorchCache tr(s);
  const auto n = static_cast<int64_t>(prompt.size());
  kv.step(ts, prompt, 0, hit, StepKind::kPrefill);
  const auto a = kv.step(ts, prompt, hit, n, StepKind::kPrefillEnd);
  const auto b = kv.step(tr, prompt, hit, n, StepKind::kPrefillEnd);
  for (size_t l = 0; l < a.size(); ++l) EXPECT_TRUE(at::equal(a[l], b[l])) << where << " layer " << l;
  expect_same_blocks(scratch, s, where);
  std::vector<int64_t> more = prompt;
  for (int64_t d = 0; d < 2; ++d) {
    more.push_back((d * 13 + 1) % TokenKV::kVocab);
    const auto x = kv.step(ts, more, n + d, n + d + 1, StepKind::kDecode);
    const auto y = kv.step(tr, more, n + d, n + d + 1, StepKind::kDecode);
    for (size_t l = 0; l < x.size(); ++l) EXPECT_TRUE(at::equal(x[l], y[l])) << where << " decode " << d;
  }
  pool.check_invariants();
  pool.remove_sequence(s);
}

TEST(PrefixIndexFile, SaveLoadServesTheSamePrefixesBitForBit) {
  for (const std::string scheme : {"int4:g4", "kivi:k2:v4:g4:r8", "fp16"}) {
    const CacheConfig cfg = index_config(scheme);
    const TokenKV kv(cfg);
    MultiSequenceCache a(pool_config(cfg));
    fill_index(a, kv);
    const std::string dir = temp_dir("index_" + std::to_string(std::hash<std::string>()(scheme)));
    a.save_prefix_index(dir, kModel);
    // Pages of 8 tokens: prompt 0 publishes 4, prompt 1 reuses 2 of them and publishes 3 more;
    // KIVI keeps each prompt's last 8 tokens in its residuals: 3, then 2 more.
    const bool kivi = scheme.rfind("kivi", 0) == 0;
    const int64_t pages = kivi ? 5 : 7;
    const std::vector<std::string> files = dir_entries(dir);
    ASSERT_EQ(files.size(), 2u) << scheme;  // the manifest and one pages file
    EXPECT_EQ(files[0], "MANIFEST");
    a.save_prefix_index(dir, kModel);  // again: the same content, still two files
    EXPECT_EQ(dir_entries(dir), files);

    MultiSequenceCache b(pool_config(cfg));
    EXPECT_EQ(b.load_prefix_index(dir, kModel), pages) << scheme;
    b.check_invariants();
    EXPECT_EQ(b.stats().cached_blocks, a.stats().cached_blocks);
    EXPECT_EQ(b.stats().bytes_in_use, a.stats().bytes_in_use);
    EXPECT_EQ(b.load_prefix_index(dir, kModel), 0) << "pages held already are not added twice";
    b.check_invariants();
    // A request on branch 1 with new tokens: served from the loaded index, as from a's.
    std::vector<int64_t> p = index_prompt(1, 40);
    for (int64_t i = 0; i < 9; ++i) p.push_back(60 - i);
    // Whole pages of branch 1 the index holds: all 5 (int4, fp16); KIVI's last 8 prompt tokens
    // stay in its residuals, so 4 pages were published.
    const int64_t hit = kivi ? 32 : 40;
    expect_served_exactly(b, kv, p, hit, scheme + " from the loaded index");
    expect_served_exactly(a, kv, p, hit, scheme + " from memory");
    for (const auto& e : dir_entries(dir)) std::remove((dir + "/" + e).c_str());
    ::rmdir(dir.c_str());
  }
}

/// The child half of PrefixIndexFile.WarmStartInASecondProcess: run by that test in a process of
/// its own (this binary, exec'd with KVCACHE_TEST_INDEX_DIR set), it fills an index and saves it
/// there. Skipped when run any other way.
TEST(PrefixIndexChild, SavesAnIndexForTheParentProcess) {
  const char* dir = std::getenv("KVCACHE_TEST_INDEX_DIR");
  if (dir == nullptr) GTEST_SKIP() << "the child half of PrefixIndexFile.WarmStartInASecondProcess";
  const CacheConfig cfg = index_config();
  const TokenKV kv(cfg);
  MultiSequenceCache a(pool_config(cfg));
  fill_index(a, kv);
  a.save_prefix_index(dir, kModel);
}

TEST(PrefixIndexFile, WarmStartInASecondProcess) {
  const std::string dir = temp_dir("warm");
  const std::string target = dir + "/index";
  ::setenv("KVCACHE_TEST_INDEX_DIR", target.c_str(), 1);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const char* argv[] = {"snapshot_test", "--gtest_filter=PrefixIndexChild.SavesAnIndexForTheParentProcess", nullptr};
    ::execv("/proc/self/exe", const_cast<char* const*>(argv));
    ::_exit(127);
  }
  ::unsetenv("KVCACHE_TEST_INDEX_DIR");
  ASSERT_GT(pid, 0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child failed: status " << status;
  // This process never computed the prompts: its index comes from the child's files.
  const CacheConfig cfg = index_config();
  const TokenKV kv(cfg);
  MultiSequenceCache b(pool_config(cfg));
  EXPECT_EQ(b.load_prefix_index(target, kModel), 7);
  b.check_invariants();
  std::vector<int64_t> p = index_prompt(0, 32);
  p.resize(20);  // branch 0's first 20 tokens, then others: 2 whole pages are shared
  for (int64_t i = 0; i < 5; ++i) p.push_back(40 + i);
  const PrefixCounters c0 = b.counters();
  expect_served_exactly(b, kv, p, 16, "warm start");
  EXPECT_EQ((b.counters() - c0).prompt_tokens_hit, 16);
  for (const auto& e : dir_entries(target)) std::remove((target + "/" + e).c_str());
  ::rmdir(target.c_str());
  ::rmdir(dir.c_str());
}

TEST(PrefixIndexFile, RefusalsLeaveTheCacheUnchanged) {
  const CacheConfig cfg = index_config();
  const TokenKV kv(cfg);
  MultiSequenceCache a(pool_config(cfg));
  fill_index(a, kv);
  const std::string dir = temp_dir("index_refusals");
  a.save_prefix_index(dir, kModel);
  const int64_t need = a.stats().bytes_in_use;
  std::string pages_file;
  for (const auto& e : dir_entries(dir)) {
    if (e != "MANIFEST") pages_file = dir + "/" + e;
  }
  const std::string good = read_bytes(pages_file), manifest = read_bytes(dir + "/MANIFEST");
  auto write = [](const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  };

  // The target holds an index of its own (prompt 1 only) and a running request.
  MultiSequenceCache b(pool_config(cfg));
  {
    Sequence& s = b.add_sequence();
    const std::vector<int64_t> p = index_prompt(1, 24);
    s.begin_request(p, 64);
    TorchCache t(s);
    kv.step(t, p, 0, 24, StepKind::kPrefillEnd);
  }
  const PoolStats st = b.stats();
  auto refuse = [&](const std::string& where, std::string* what = nullptr, const std::string& model = kModel) {
    const Reason r = reason_of([&] { b.load_prefix_index(dir, model); }, what);
    b.check_invariants();
    EXPECT_EQ(b.stats().bytes_in_use, st.bytes_in_use) << where;
    EXPECT_EQ(b.stats().cached_blocks, st.cached_blocks) << where;
    return r;
  };
  std::string what;
  EXPECT_EQ(refuse("other model", &what, "another-model"), Reason::kOtherModel);
  EXPECT_THAT(what, HasSubstr("another-model"));
  {
    auto c8 = cfg;
    c8.scheme = "int8";
    MultiSequenceCache other(pool_config(c8));
    EXPECT_EQ(reason_of([&] { other.load_prefix_index(dir, kModel); }, &what), Reason::kOtherConfig);
    EXPECT_THAT(what, HasSubstr("is stored by no configuration of this cache"));
    EXPECT_EQ(other.stats().cached_blocks, 0);
    auto shape = cfg;
    shape.head_dim = 16;
    MultiSequenceCache wide(pool_config(shape));
    EXPECT_EQ(reason_of([&] { wide.load_prefix_index(dir, kModel); }, &what), Reason::kOtherConfig);
    EXPECT_THAT(what, HasSubstr("head_dim is 8 in the index, 16 in the cache"));
  }
  // Every byte of the pages file flipped in turn (a stride): the manifest's checksum refuses it.
  for (size_t i = 0; i < good.size(); i += 97) {
    std::string bad = good;
    bad[i] ^= 0x04;
    write(pages_file, bad);
    ASSERT_EQ(refuse("flipped " + std::to_string(i)), Reason::kChecksum) << i;
  }
  write(pages_file, good.substr(0, good.size() - 5));
  EXPECT_EQ(refuse("truncated pages"), Reason::kTruncated);
  write(pages_file, good);
  std::string bad_manifest = manifest;
  bad_manifest[manifest.size() - 12] ^= 0x01;
  write(dir + "/MANIFEST", bad_manifest);
  EXPECT_EQ(refuse("flipped manifest"), Reason::kChecksum);
  write(dir + "/MANIFEST", "not a manifest");
  EXPECT_EQ(refuse("not a manifest"), Reason::kNotSnapshot);
  std::remove((dir + "/MANIFEST").c_str());
  EXPECT_EQ(refuse("no manifest", &what), Reason::kIo);
  EXPECT_THAT(what, HasSubstr("MANIFEST"));
  write(dir + "/MANIFEST", manifest);
  // No room: the pool's free bytes are less than the index's blocks (a load reclaims nothing).
  {
    MultiSequenceCache tight(pool_config(cfg, need - 8));
    try {
      tight.load_prefix_index(dir, kModel);
      ADD_FAILURE() << "no PoolFullError";
    } catch (const PoolFullError& e) {
      EXPECT_THAT(e.what(), HasSubstr(std::to_string(need) + " B of blocks"));
    }
    tight.check_invariants();
    EXPECT_EQ(tight.stats().bytes_in_use, 0);
  }
  // Restored, it loads. The target published prompt 1's first 3 pages itself (the first 2 are
  // prompt 0's too): of the file's 7 pages it gains the other 4, and keeps its own copies.
  const int64_t added = b.load_prefix_index(dir, kModel);
  b.check_invariants();
  EXPECT_EQ(added, 4);
  EXPECT_EQ(b.stats().cached_blocks, st.cached_blocks + 4 * 2 * 2 * 2);
  for (const auto& e : dir_entries(dir)) std::remove((dir + "/" + e).c_str());
  ::rmdir(dir.c_str());
}

TEST(PrefixIndexFile, ForgedContentWithValidChecksumsIsInconsistent) {
  // Pages files edited and resealed (every section checksum and the manifest's checksum and
  // size recomputed): the content checks refuse them, the cache unchanged.
  const CacheConfig cfg = index_config();
  const TokenKV kv(cfg);
  MultiSequenceCache a(pool_config(cfg));
  fill_index(a, kv);
  const std::string dir = temp_dir("index_forged");
  a.save_prefix_index(dir, kModel);
  std::string pages_file;
  for (const auto& e : dir_entries(dir)) {
    if (e != "MANIFEST") pages_file = dir + "/" + e;
  }
  const std::string good = read_bytes(pages_file), manifest = read_bytes(dir + "/MANIFEST");
  uint64_t head = 0;
  std::memcpy(&head, good.data() + 24 + 8, 8);
  const size_t page1 = 24 + 24 + static_cast<size_t>(head) + 8;  // the first PAGE section's header
  uint64_t page1_size = 0;
  std::memcpy(&page1_size, good.data() + page1 + 8, 8);
  const size_t page2 = page1 + 24 + static_cast<size_t>(page1_size) + 8;
  auto forge = [&](const std::function<void(std::string&)>& edit, const std::string& where) {
    std::string f = good;
    edit(f);
    reseal(f);
    std::ofstream(pages_file, std::ios::binary | std::ios::trunc) << f;
    std::string m = manifest;
    const uint64_t size = f.size(), sum = XXH3_64bits(f.data(), f.size());
    std::memcpy(&m[m.size() - 8 - 16], &size, 8);
    std::memcpy(&m[m.size() - 8 - 8], &sum, 8);
    reseal(m);
    std::ofstream(dir + "/MANIFEST", std::ios::binary | std::ios::trunc) << m;
    MultiSequenceCache b(pool_config(cfg));
    std::string what;
    const Reason r = reason_of([&] { b.load_prefix_index(dir, kModel); }, &what);
    b.check_invariants();
    EXPECT_EQ(b.stats().bytes_in_use, 0) << where;
    EXPECT_EQ(b.stats().cached_blocks, 0) << where;
    return std::make_pair(r, what);
  };
  // The second page names a parent after it.
  auto got = forge([&](std::string& f) { f[page2 + 24 + 4] = 9; }, "parent after");
  EXPECT_EQ(got.first, Reason::kInconsistent);
  EXPECT_THAT(got.second, HasSubstr("is not on the path before it"));
  // The first page's first block claims 7 filled slots: not a full block.
  got = forge(
      [&](std::string& f) {
        const size_t blocks = page1 + 24 + 4 + 8 + 8 * 8;  // ns, parent, 8 token ids
        f[blocks + 4 + 1] = 7;                             // list 0: count u32, then format u8, filled u16
      },
      "partial block");
  EXPECT_EQ(got.first, Reason::kInconsistent);
  // A namespace index beyond the header's.
  got = forge([&](std::string& f) { f[page1 + 24] = 3; }, "namespace");
  EXPECT_EQ(got.first, Reason::kInconsistent);
  EXPECT_THAT(got.second, HasSubstr("namespace 3"));
  {
    std::ofstream(pages_file, std::ios::binary | std::ios::trunc) << good;
    std::ofstream(dir + "/MANIFEST", std::ios::binary | std::ios::trunc) << manifest;
    MultiSequenceCache b(pool_config(cfg));
    EXPECT_EQ(b.load_prefix_index(dir, kModel), 7);  // restored: it loads
  }
  for (const auto& e : dir_entries(dir)) std::remove((dir + "/" + e).c_str());
  ::rmdir(dir.c_str());
}

// ------------------------------------------------------------ the disk tier under the pool

/// A scripted workload over a pool of 6 pages (int4, pages of 8 tokens: a page = 8 blocks,
/// layers x KV heads x streams): request A (32 tokens, 4 pages), then B (32 other tokens) —
/// whose second layer's append reclaims A's last 2 pages (spilled: A3, A2) — then A + 8 new
/// tokens, served from the disk tier past A0, A1 in memory, compared with computing it whole.
struct DiskWorkload {
  const CacheConfig cfg = index_config();
  const TokenKV kv{cfg};
  std::string dir;
  int64_t page_bytes = 0;
  std::unique_ptr<MultiSequenceCache> pool;

  DiskWorkload(const std::string& name, int64_t tier_files_or_0) {
    dir = temp_dir(name);
    {  // the bytes of a page and of its spilled file, measured on a roomy pool
      MultiSequenceCache probe(pool_config(cfg));
      run(probe, prompt_a());
      page_bytes = probe.stats().bytes_in_use / 4;
    }
    auto mc = pool_config(cfg, 6 * page_bytes);
    mc.disk_tier_dir = dir;
    mc.disk_tier_bytes = tier_files_or_0 > 0 ? tier_files_or_0 * file_bytes() : int64_t{1} << 30;
    pool = std::make_unique<MultiSequenceCache>(mc);
  }
  ~DiskWorkload() {
    pool.reset();  // removes its files
    EXPECT_EQ(dir_entries(dir), std::vector<std::string>{}) << "the tier's files outlived the cache";
    ::rmdir(dir.c_str());
  }
  /// A spilled page's file: preamble 24, section header 24 + checksum 8; payload: key 16, the
  /// namespace key (8 + its length), depth 8, P (8) + 8 token ids, then 8 lists of one block:
  /// count 4 + record (head 1, filled 2, varint 1; codes 8 tokens x 8 channels x 4 bits = 32;
  /// scales and zeros: 8 tokens x 2 groups of 4 channels x fp16 = 32 each).
  int64_t file_bytes() const {
    MultiSequenceCache probe(pool_config(cfg));
    const std::string ns_key = cache::MultiSequenceAccess::storage_key(probe.add_sequence());
    return 24 + 24 + 8 + 16 + 8 + static_cast<int64_t>(ns_key.size()) + 8 + 8 + 8 * 8 + 8 * (4 + 4 + 32 + 32 + 32);
  }
  static std::vector<int64_t> prompt_a() { return index_prompt(0, 32); }
  static std::vector<int64_t> prompt_b() {
    std::vector<int64_t> p(32);
    for (int64_t i = 0; i < 32; ++i) p[static_cast<size_t>(i)] = (i * 3 + 41) % TokenKV::kVocab;
    return p;
  }
  void run(MultiSequenceCache& c, const std::vector<int64_t>& p) const {
    Sequence& s = c.add_sequence();
    const int64_t cached = s.begin_request(p, 64).cached_tokens;
    TorchCache t(s);
    kv.step(t, p, cached, static_cast<int64_t>(p.size()), StepKind::kPrefillEnd);
    c.remove_sequence(s);
  }
  std::vector<int64_t> prompt_a_longer() const {
    std::vector<int64_t> p = prompt_a();
    for (int64_t i = 0; i < 8; ++i) p.push_back(63 - i);
    return p;
  }
};

TEST(DiskTier, CountersOnAScriptedWorkload) {
  DiskWorkload w("disk_counters", 0);
  w.run(*w.pool, DiskWorkload::prompt_a());
  w.run(*w.pool, DiskWorkload::prompt_b());
  PrefixCounters c = w.pool->counters();
  EXPECT_EQ(c.disk_pages_written, 2);  // A3, A2: B's second layer needed 2 pages
  EXPECT_EQ(c.disk_bytes_written, 2 * w.file_bytes());
  EXPECT_EQ(dir_entries(w.dir).size(), 2u);
  for (const auto& e : dir_entries(w.dir)) {
    struct stat st {};
    ASSERT_EQ(::stat((w.dir + "/" + e).c_str(), &st), 0);
    EXPECT_EQ(st.st_size, w.file_bytes()) << e;
  }
  // A + 8: A0, A1 in memory; A2, A3 read back (each reclaiming a page of B: B3, B2 spilled);
  // the 8 new tokens take a page (B1 spilled), the first decode step another (B0 spilled).
  const PrefixCounters c0 = c;
  expect_served_exactly(*w.pool, w.kv, w.prompt_a_longer(), 32, "served from disk");
  c = w.pool->counters() - c0;
  EXPECT_EQ(c.prompt_tokens_hit, 32);
  EXPECT_EQ(c.prompt_tokens_hit_memory, 16);
  EXPECT_EQ(c.prompt_tokens_hit_disk, 16);
  EXPECT_EQ(c.disk_pages_read, 2);
  EXPECT_EQ(c.disk_bytes_read, 2 * w.file_bytes());
  EXPECT_EQ(c.disk_pages_written, 4);
  EXPECT_EQ(c.disk_bytes_written, 4 * w.file_bytes());
  EXPECT_EQ(c.disk_evictions, 0);
  EXPECT_EQ(c.disk_failures, 0);
  EXPECT_EQ(dir_entries(w.dir).size(), 6u);  // read files stay (a page reclaimed again is not rewritten)
  w.pool->check_invariants();
}

TEST(DiskTier, EvictionsKeepTheTierWithinItsBytes) {
  // A tier of 3 files. A3, A2 spilled; then A + 8: A2 is read (B3 spilled: 3 files), reading A3
  // reclaims B2, whose file evicts the least recent, A3's — so the hit ends at A2 (24 tokens).
  // Computing 16 tokens reclaims B1 (evicting B3), the first decode step B0 (evicting A2).
  DiskWorkload w("disk_evictions", 3);
  w.run(*w.pool, DiskWorkload::prompt_a());
  w.run(*w.pool, DiskWorkload::prompt_b());
  expect_served_exactly(*w.pool, w.kv, w.prompt_a_longer(), 24, "partly from disk");
  const PrefixCounters c = w.pool->counters();
  EXPECT_EQ(c.prompt_tokens_hit_memory, 16);
  EXPECT_EQ(c.prompt_tokens_hit_disk, 8);
  EXPECT_EQ(c.disk_pages_written, 6);
  EXPECT_EQ(c.disk_pages_read, 1);
  EXPECT_EQ(c.disk_evictions, 3);
  EXPECT_EQ(c.disk_failures, 0);
  EXPECT_EQ(dir_entries(w.dir).size(), 3u);
  EXPECT_EQ(c.disk_bytes_written, 6 * w.file_bytes());
  EXPECT_EQ(c.disk_bytes_read, w.file_bytes());
}

TEST(DiskTier, ACorruptTruncatedOrMissingFileIsAMiss) {
  for (const std::string how : {"flipped", "truncated", "removed"}) {
    DiskWorkload w("disk_" + how, 0);
    w.run(*w.pool, DiskWorkload::prompt_a());
    w.run(*w.pool, DiskWorkload::prompt_b());
    for (const auto& e : dir_entries(w.dir)) {  // both spilled pages, A2 and A3
      const std::string path = w.dir + "/" + e;
      std::string bytes = read_bytes(path);
      if (how == "removed") {
        std::remove(path.c_str());
        continue;
      }
      if (how == "flipped") bytes[bytes.size() / 2] ^= 0x20;
      if (how == "truncated") bytes.resize(bytes.size() - 9);
      std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    }
    // A2 cannot be read: a miss, counted, its entry dropped; the request computes 24 tokens.
    expect_served_exactly(*w.pool, w.kv, w.prompt_a_longer(), 16, how);
    const PrefixCounters c = w.pool->counters();
    EXPECT_EQ(c.disk_failures, 1) << how;
    EXPECT_EQ(c.disk_pages_read, 0) << how;
    EXPECT_EQ(c.prompt_tokens_hit_disk, 0) << how;
    w.pool->check_invariants();
  }
}

TEST(DiskTier, ConfigurationIsValidated) {
  auto mc = pool_config(index_config());
  mc.disk_tier_bytes = 100;
  EXPECT_THROW(
      {
        try {
          MultiSequenceCache c(mc);
        } catch (const InvalidArgument& e) {
          EXPECT_THAT(e.what(), HasSubstr("disk_tier_bytes = 100 without a disk_tier_dir"));
          throw;
        }
      },
      InvalidArgument);
  mc.disk_tier_dir = temp_dir("disk_cfg");
  mc.disk_tier_bytes = 0;
  EXPECT_THROW(MultiSequenceCache c(mc), InvalidArgument);
  mc.disk_tier_bytes = 1 << 20;
  const std::string file = mc.disk_tier_dir + "/plain";
  std::ofstream(file) << "x";
  mc.disk_tier_dir = file;
  try {
    MultiSequenceCache c(mc);
    ADD_FAILURE() << "a file accepted as the tier's directory";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("it exists and is not a directory"));
  }
  std::remove(file.c_str());
  ::rmdir((temp_dir("disk_cfg")).c_str());
}

// ------------------------------------------------------------ the fuzz target's seeds

/// fuzz/corpus/snapshot/: one seed per fuzz/snapshot_configs.h case — [case][flags 1][a snapshot
/// of that cache after a 3-chunk prompt and 3 decode steps]. Each committed seed must load into
/// its case's cache (a format change that makes them stale fails here). With
/// KVCACHE_WRITE_FUZZ_SEEDS=1 the test (re)writes them instead.
TEST(SnapshotFuzzSeeds, CommittedSeedsLoad) {
  const std::string dir = std::string(KVCACHE_SOURCE_DIR) + "/fuzz/corpus/snapshot";
  const char* env = std::getenv("KVCACHE_WRITE_FUZZ_SEEDS");
  const bool write = env != nullptr && std::string(env) == "1";
  for (size_t i = 0; i < fuzz::kSnapshotCaseCount; ++i) {
    const std::string path = dir + "/seed" + std::to_string(i);
    CacheManager m(fuzz::snapshot_case_config(i));
    if (write) {
      TorchCache t(m);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(40 + i));
      run_steps({&t}, gen, 0, 6, "seed " + std::to_string(i));
      std::string seed;
      seed.push_back(static_cast<char>(i));
      seed.push_back(1);
      seed += bytes_of(m, fuzz::kSnapshotFingerprint);
      std::ofstream(path, std::ios::binary | std::ios::trunc) << seed;
      continue;
    }
    const std::string seed = read_bytes(path);
    ASSERT_GT(seed.size(), 2u) << path << " is missing: KVCACHE_WRITE_FUZZ_SEEDS=1 build/tests/snapshot_test "
                                          "--gtest_filter=SnapshotFuzzSeeds.* writes it";
    EXPECT_EQ(static_cast<size_t>(static_cast<uint8_t>(seed[0])), i);
    load_bytes(m, seed.substr(2), fuzz::kSnapshotFingerprint);
    EXPECT_GT(m.stats().tokens_written, 0) << path;
  }
}

/// fuzz_snapshot: seed 4 (int2:g8:chan, 8-slot blocks) with dead bits 25, 26 and 31 set in the
/// holes word of a block of layer 1 — past the block's capacity, where check() did not look — loaded,
/// and counted 3 live tokens too few; the next step wrote K and V differently.
TEST(SnapshotFuzzSeeds, DeadBitsPastTheCapacityAreRefused) {
  std::string file = read_bytes(std::string(KVCACHE_SOURCE_DIR) + "/fuzz/corpus/snapshot/seed4").substr(2);
  const size_t block = 3596 - 2;  // the block record: u8 format | 0x10, u16 filled, varint 0, u64 holes
  ASSERT_GT(file.size(), block + 12);
  ASSERT_EQ(static_cast<uint8_t>(file[block]), 0x10) << "seed4 changed: find a block with holes again";
  ASSERT_EQ(static_cast<uint8_t>(file[block + 1]), 8);
  file[block + 7] = static_cast<char>(0x86);  // bits 25, 26, 31 of the holes word
  reseal(file);
  CacheManager m(fuzz::snapshot_case_config(4));
  try {
    load_bytes(m, file, fuzz::kSnapshotFingerprint);
    ADD_FAILURE() << "accepted";
  } catch (const SnapshotError& e) {
    EXPECT_EQ(e.reason(), Reason::kInconsistent);
    EXPECT_THAT(e.what(), HasSubstr("dead bit beyond the filled slots"));
  }
}

}  // namespace
}  // namespace kvcache
