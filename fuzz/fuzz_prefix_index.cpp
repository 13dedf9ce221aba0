// SPDX-License-Identifier: Apache-2.0
// The prefix index directory reader (MultiSequenceCache::load_prefix_index) and the disk tier's
// page reader (MultiSequenceConfig::disk_tier_dir) on hostile bytes (docs/snapshot-format.md).
// Structure-aware: the target builds valid files itself — an index saved from a small workload,
// or the pages a pool spilled to its disk tier — and the input edits them at offsets relative to
// their sections. Input:
//   [case u8]  a cache of kCases (scheme; one or two namespaces)
//   [flags u8] bit 0: reseal (recompute the preamble's and every section's checksum and number
//              the sections in order) after the edits, so that they reach the content checks;
//              bit 1: the manifest states the edited pages file's size and checksum;
//              bit 2: the loading cache already holds an index and a running request;
//              bit 3: its pool is one byte short of the valid file's pages (PoolFullError);
//              bit 4: the disk tier instead of the index (edits go to the spilled pages' files)
//   then edits of 8 bytes: [op u8][target u8][offset u16][value u32] (apply_edit()).
// Properties:
//   - index: a refused load throws SnapshotError or PoolFullError (the documented kinds) and
//     leaves the cache as it was (its index saves the same bytes, the same bytes in use, its
//     invariants hold); an accepted one holds its invariants, accounts the pool exactly (bytes
//     in use grow by the pages added; reclaiming them frees it again), serves a request that
//     reuses a loaded prefix and decodes a step, and saves an index that loads again;
//   - disk tier: whatever the spilled files hold, the request that reads them back succeeds
//     (a file that fails a check is a miss, counted in disk_failures), with its invariants; with
//     the files untouched it hits every page.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "kvcache/log.h"
#include "kvcache/multi_sequence_cache.h"
#include "kvcache/snapshot.h"

using namespace kvcache;

namespace {

constexpr const char* kFingerprint = "fuzz-model";
constexpr int64_t kLayers = 2, kQHeads = 4, kKvHeads = 2, kDim = 8, kBlock = 8, kContext = 64;

struct Case {
  const char* scheme;
  const char* second;  ///< a second sequence configuration (another namespace), or nullptr
};
/// Block-flushed residual (KIVI), plain, per-channel groups, rotated, and two namespaces.
constexpr Case kCases[] = {
    {"int4:g4", nullptr},
    {"kivi:k2:v4:g4:r8", nullptr},
    {"fp16", nullptr},
    {"int4:g4", "int8"},
    {"had(int4)", nullptr},
};
constexpr size_t kCaseCount = sizeof(kCases) / sizeof(kCases[0]);

CacheConfig model_config(size_t c, const char* scheme = nullptr) {
  CacheConfig cfg;
  cfg.num_layers = kLayers;
  cfg.num_q_heads = kQHeads;
  cfg.num_kv_heads = kKvHeads;
  cfg.head_dim = kDim;
  cfg.scheme = scheme != nullptr ? scheme : kCases[c].scheme;
  cfg.policy = "full";
  cfg.block_tokens = kBlock;
  cfg.context_length = kContext;
  cfg.rope = rotate_half_rope(10000.0);
  return cfg;
}

MultiSequenceConfig pool_config(size_t c, int64_t capacity = int64_t{1} << 24) {
  MultiSequenceConfig mc;
  mc.model = model_config(c);
  mc.capacity_bytes = capacity;
  return mc;
}

/// K, V, q of a token: a function of its id, layer, head and channel alone (so that every run
/// stores the same bytes for the same tokens).
float value_of(int64_t token, int64_t layer, int64_t head, int64_t d, int which) {
  const double x = static_cast<double>(token * 131 + layer * 17 + head * 7 + d * 3 + which * 1009);
  return static_cast<float>(2.0 * std::sin(x * 0.37) + 0.25 * std::cos(x * 1.3));
}

/// Whether attend() outputs must be finite (the blocks are the library's own, not edited ones).
bool g_check_finite = true;

/// One step of tokens ids[from, to) on every layer (append, attend when `attend`), then end_step.
void step(Sequence& s, const std::vector<int64_t>& ids, int64_t from, int64_t to, StepKind kind, bool attend = true) {
  const int64_t T = to - from;
  std::vector<float> k(static_cast<size_t>(kKvHeads * T * kDim)), v(k.size());
  std::vector<float> q(static_cast<size_t>(kQHeads * T * kDim)), out(q.size());
  std::vector<int64_t> pos(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = from + t;
  for (int64_t l = 0; l < kLayers; ++l) {
    for (int64_t h = 0; h < kQHeads; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t d = 0; d < kDim; ++d) {
          const int64_t tok = ids[static_cast<size_t>(from + t)];
          const auto i = static_cast<size_t>((h * T + t) * kDim + d);
          q[i] = value_of(tok, l, h, d, 2);
          if (h < kKvHeads) {
            k[i] = value_of(tok, l, h, d, 0);
            v[i] = value_of(tok, l, h, d, 1);
          }
        }
      }
    }
    s.append(l, TensorView(k.data(), {1, kKvHeads, T, kDim}), TensorView(v.data(), {1, kKvHeads, T, kDim}),
             TensorView(pos.data(), {T}));
    if (!attend) continue;
    s.attend(l, TensorView(q.data(), {1, kQHeads, T, kDim}), TensorView(pos.data(), {T}),
             MutableTensorView(out.data(), DType::kFloat32, {1, kQHeads, T, kDim}));
    if (g_check_finite) {
      for (float x : out) KV_FUZZ_CHECK(std::isfinite(x), "attend", "a non-finite output");
    }
  }
  s.end_step(kind);
}

/// Prompts: 0 and 1 share their first 16 tokens; 2 shares none.
std::vector<int64_t> prompt(int which, int64_t n) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    p[static_cast<size_t>(i)] = which == 2 ? (i * 3 + 41) % 64 : i < 16 ? (i * 5 + 3) % 64 : (i * 7 + which * 11) % 64;
  }
  return p;
}

/// A whole request: begin (reusing what the index holds), compute the rest (attend() only when
/// `attend`: the requests that fill an index or a disk tier skip it), finish.
int64_t run_request(Sequence& s, const std::vector<int64_t>& p, bool finish = true, bool attend = false) {
  const int64_t cached = s.begin_request(p, kContext).cached_tokens;
  step(s, p, cached, static_cast<int64_t>(p.size()), StepKind::kPrefillEnd, attend);
  if (finish) s.finish();
  return cached;
}

// ---------------------------------------------------------------- files
std::string g_dir;  ///< this process's scratch directory

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(n);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void clear_dir(const std::string& dir) {
  for (const auto& e : entries(dir)) std::remove((dir + "/" + e).c_str());
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void remove_scratch() {
  if (g_dir.empty()) return;
  for (const auto& sub : entries(g_dir)) {
    clear_dir(g_dir + "/" + sub);
    ::rmdir((g_dir + "/" + sub).c_str());
  }
  ::rmdir(g_dir.c_str());
}

const std::string& scratch() {
  if (g_dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/fuzz_prefix_index.XXXXXX";
    if (::mkdtemp(&templ[0]) == nullptr) kvcache::fuzz::die("scratch", "mkdtemp failed");
    g_dir = templ;
    std::atexit(remove_scratch);
  }
  return g_dir;
}

/// The directory's pages file (the one entry that is not the MANIFEST), and the index's bytes.
struct IndexFiles {
  std::string name, pages, manifest;
  std::string dir;   ///< where the valid index stays (valid_index())
  int64_t need = 0;  ///< bytes of its pages' blocks
};

IndexFiles read_index_dir(const std::string& dir) {
  IndexFiles f;
  for (const auto& e : entries(dir)) {
    if (e != "MANIFEST") f.name = e;
  }
  f.pages = read_file(dir + "/" + f.name);
  f.manifest = read_file(dir + "/MANIFEST");
  return f;
}

/// The index a cache holds, as save_prefix_index writes it (its pages file's bytes).
std::string index_bytes(const MultiSequenceCache& c, const std::string& dir) {
  ::mkdir(dir.c_str(), 0755);
  clear_dir(dir);
  c.save_prefix_index(dir, kFingerprint);
  return read_index_dir(dir).pages;
}

/// Fills `c`'s index as a serving run does: prompt 0 (32 tokens), then 1 (40, reusing 16), and
/// with a second configuration, prompt 2 under it.
void fill(MultiSequenceCache& c, size_t cs) {
  Sequence& s = c.add_sequence();
  run_request(s, prompt(0, 32));
  run_request(s, prompt(1, 40));
  if (kCases[cs].second != nullptr) {
    Sequence& o = c.add_sequence(model_config(cs, kCases[cs].second));
    run_request(o, prompt(2, 24));
  }
}

/// The valid index of each case, saved once.
const IndexFiles& valid_index(size_t cs) {
  static std::map<size_t, IndexFiles> saved;
  auto it = saved.find(cs);
  if (it == saved.end()) {
    MultiSequenceCache c(pool_config(cs));
    fill(c, cs);
    const std::string dir = scratch() + "/valid" + std::to_string(cs);
    (void)index_bytes(c, dir);
    IndexFiles f = read_index_dir(dir);
    f.dir = dir;
    MultiSequenceCache probe(pool_config(cs));
    probe.add_sequence();
    if (kCases[cs].second != nullptr) probe.add_sequence(model_config(cs, kCases[cs].second));
    probe.load_prefix_index(dir, kFingerprint);
    f.need = probe.stats().bytes_in_use;
    it = saved.emplace(cs, std::move(f)).first;
  }
  return it->second;
}

// ---------------------------------------------------------------- edits
/// Section k's payload offset (k = 0: the file's start), or the file's start past the sections.
size_t section_start(const std::string& f, size_t k, size_t* header = nullptr) {
  if (k == 0 || f.size() < 24) return 0;
  size_t at = 24;
  for (size_t i = 1; f.size() - at >= 24; ++i) {
    uint64_t size = 0;
    std::memcpy(&size, f.data() + at + 8, 8);
    if (i == k) {
      if (header != nullptr) *header = at;
      return at + 24;
    }
    if (size > f.size() - at - 24 || f.size() - at - 24 - size < 8) break;
    at += 24 + static_cast<size_t>(size) + 8;
  }
  return 0;
}

/// The extent [begin, end) of section k ≥ 1 (header, payload, checksum), or false.
bool section_extent(const std::string& f, size_t k, size_t& begin, size_t& end) {
  size_t header = 0;
  if (k == 0 || section_start(f, k, &header) == 0) return false;
  uint64_t size = 0;
  std::memcpy(&size, f.data() + header + 8, 8);
  if (size > f.size() - header - 24 || f.size() - header - 24 - size < 8) return false;
  begin = header;
  end = header + 24 + static_cast<size_t>(size) + 8;
  return true;
}

void set_count(std::string& f, int delta) {
  if (f.size() < 24) return;
  uint32_t count = 0;
  std::memcpy(&count, &f[12], 4);
  count = static_cast<uint32_t>(static_cast<int64_t>(count) + delta);
  std::memcpy(&f[12], &count, 4);
}

/// Values a u64 field is set to: edges of sizes, counts, positions and signs.
uint64_t interesting(uint32_t v) {
  static const uint64_t table[] = {0,          1,          2,          7,          8,
                                   9,          16,         0x7fffffff, 0x80000000, 0xffffffff,
                                   1ull << 32, 1ull << 62, ~0ull >> 1, 1ull << 63, ~0ull,
                                   ~0ull - 1};
  constexpr uint32_t n = sizeof(table) / sizeof(table[0]);
  return v % (n + 1) < n ? table[v % (n + 1)] : v;
}

/// Applies one edit to `f`: op % 8 — 0 xor a byte, 1 write a u32, 2 write a u64 (interesting()),
/// 3 truncate, 4 insert bytes, 5 erase bytes, 6 duplicate section `target` at the end (the
/// preamble's count + 1), 7 remove section `target` (count − 1). The offset is relative to
/// section `target`'s payload (target 0: the file's start), wrapped into the file.
void apply_edit(std::string& f, uint8_t op, uint8_t target, uint16_t offset, uint32_t value) {
  const size_t base = section_start(f, target);
  const size_t at = f.empty() ? 0 : (base + offset) % (f.size() + 1);
  const size_t room = f.size() - at;
  switch (op % 8) {
    case 0:
      if (room > 0) f[at] = static_cast<char>(f[at] ^ ((value & 0xff) == 0 ? 1 : value & 0xff));
      break;
    case 1:
      if (room >= 4) std::memcpy(&f[at], &value, 4);
      break;
    case 2:
      if (room >= 8) {
        const uint64_t v = interesting(value);
        std::memcpy(&f[at], &v, 8);
      }
      break;
    case 3:
      f.resize(at);
      break;
    case 4:
      f.insert(at, static_cast<size_t>(value % 64) + 1, static_cast<char>(value >> 8));
      break;
    case 5:
      f.erase(at, std::min<size_t>(room, static_cast<size_t>(value % 64) + 1));
      break;
    case 6: {
      size_t b = 0, e = 0;
      if (section_extent(f, target, b, e) && f.size() < (1u << 20)) {
        f += f.substr(b, e - b);
        set_count(f, +1);
      }
      break;
    }
    case 7: {
      size_t b = 0, e = 0;
      if (section_extent(f, target, b, e)) {
        f.erase(b, e - b);
        set_count(f, -1);
      }
      break;
    }
  }
}

/// Recomputes the preamble's and every whole section's checksums and numbers the sections in
/// order (as far as the framing reads).
void reseal(std::string& f) {
  if (f.size() < 24) return;
  auto* p = reinterpret_cast<uint8_t*>(&f[0]);
  uint64_t h = XXH3_64bits(p, 16);
  std::memcpy(p + 16, &h, 8);
  uint32_t count = 0;
  std::memcpy(&count, p + 12, 4);
  size_t at = 24;
  for (uint32_t i = 0; i < count && f.size() - at >= 24; ++i) {
    std::memcpy(p + at + 4, &i, 4);
    h = XXH3_64bits(p + at, 16);
    std::memcpy(p + at + 16, &h, 8);
    uint64_t size = 0;
    std::memcpy(&size, p + at + 8, 8);
    at += 24;
    if (size > f.size() - at || f.size() - at - size < 8) return;
    h = XXH3_64bits(p + at, static_cast<size_t>(size));
    std::memcpy(p + at + size, &h, 8);
    at += static_cast<size_t>(size) + 8;
  }
}

/// The manifest's size and checksum fields (its payload's last 16 bytes) set to those of `pages`.
void restate(std::string& manifest, const std::string& pages) {
  if (manifest.size() < 24 + 24 + 16 + 8) return;
  const uint64_t size = pages.size(), sum = XXH3_64bits(pages.data(), pages.size());
  std::memcpy(&manifest[manifest.size() - 8 - 16], &size, 8);
  std::memcpy(&manifest[manifest.size() - 8 - 8], &sum, 8);
  reseal(manifest);
}

struct Edit {
  uint8_t op, target;
  uint16_t offset;
  uint32_t value;
};

std::vector<Edit> edits_of(fuzz::Bytes& in) {
  std::vector<Edit> out;
  while (in.remaining() >= 8 && out.size() < 32) {
    Edit e{};
    e.op = in.u8();
    e.target = in.u8();
    e.offset = in.u16();
    e.value = static_cast<uint32_t>(in.u16()) | static_cast<uint32_t>(in.u16()) << 16;
    out.push_back(e);
  }
  return out;
}

// ---------------------------------------------------------------- the index
/// A cache to load into: fresh (one sequence per namespace of the case, idle), or with an index
/// of its own (prompt 1's first 24 tokens) and a running request (`busy`).
std::unique_ptr<MultiSequenceCache> target_cache(size_t cs, bool busy, int64_t capacity) {
  auto c = std::make_unique<MultiSequenceCache>(pool_config(cs, capacity));
  Sequence& s = c->add_sequence();
  if (kCases[cs].second != nullptr) c->add_sequence(model_config(cs, kCases[cs].second));
  if (busy) {
    run_request(s, prompt(1, 24), /*finish=*/false);
  }
  return c;
}

/// Everything a refused load must leave as it was.
struct Observed {
  std::string index;
  int64_t bytes_in_use = 0, cached_blocks = 0;
  bool operator==(const Observed& o) const {
    return index == o.index && bytes_in_use == o.bytes_in_use && cached_blocks == o.cached_blocks;
  }
};

Observed observe(const MultiSequenceCache& c) {
  Observed o;
  o.index = index_bytes(c, scratch() + "/probe");
  const PoolStats st = c.stats();
  o.bytes_in_use = st.bytes_in_use;
  o.cached_blocks = st.cached_blocks;
  return o;
}

void fuzz_index(size_t cs, uint8_t flags, const std::vector<Edit>& edits) {
  const IndexFiles& valid = valid_index(cs);
  IndexFiles f = valid;
  for (const Edit& e : edits) apply_edit((e.target & 0x80) != 0 ? f.manifest : f.pages, e.op, e.target & 0x7f, e.offset, e.value);
  if (flags & 1) {
    reseal(f.pages);
    reseal(f.manifest);
  }
  if (flags & 2) restate(f.manifest, f.pages);
  const bool untouched = f.pages == valid.pages && f.manifest == valid.manifest;
  g_check_finite = untouched;
  const std::string dir = scratch() + "/index";
  ::mkdir(dir.c_str(), 0755);
  clear_dir(dir);
  write_file(dir + "/MANIFEST", f.manifest);
  write_file(dir + "/" + valid.name, f.pages);

  const bool busy = (flags & 4) != 0;
  int64_t capacity = int64_t{1} << 24;
  if (flags & 8) {  // room for the busy request and all but one byte of the valid file's pages
    capacity = target_cache(cs, busy, capacity)->stats().bytes_in_use + valid.need - 1;
  }
  std::unique_ptr<MultiSequenceCache> c = target_cache(cs, busy, capacity);
  const Observed before = observe(*c);
  const PrefixCounters c0 = c->counters();
  int64_t added = 0;
  try {
    added = c->load_prefix_index(dir, kFingerprint);
  } catch (const SnapshotError&) {
    KV_FUZZ_CHECK(observe(*c) == before, "load_prefix_index", "a refused load (SnapshotError) changed the cache");
    (void)fuzz::accepts("check_invariants after a refusal", [&] { c->check_invariants(); });
    KV_FUZZ_CHECK(c->counters().refusals == c0.refusals, "load_prefix_index", "a SnapshotError counted as a refusal");
    return;
  } catch (const PoolFullError& e) {
    KV_FUZZ_CHECK(!e.preempted(), "load_prefix_index", "a refused load says preempted");
    KV_FUZZ_CHECK(observe(*c) == before, "load_prefix_index", "a refused load (PoolFullError) changed the cache");
    (void)fuzz::accepts("check_invariants after a refusal", [&] { c->check_invariants(); });
    KV_FUZZ_CHECK(c->counters().refusals == c0.refusals + 1, "load_prefix_index", "a PoolFullError not counted");
    return;
  } catch (const InternalError& e) {
    fuzz::die_exception("load_prefix_index", "kvcache::InternalError", e.what());
  } catch (const std::exception& e) {
    fuzz::die_exception("load_prefix_index (expected SnapshotError or PoolFullError)", typeid(e).name(), e.what());
  }
  // Accepted.
  (void)fuzz::accepts("check_invariants after a load", [&] { c->check_invariants(); });
  const PoolStats st = c->stats();
  KV_FUZZ_CHECK(added >= 0, "load_prefix_index", "returned ", added);
  KV_FUZZ_CHECK(st.cached_blocks >= before.cached_blocks + (added > 0 ? 1 : 0), "load_prefix_index", "added ", added,
                " pages but the index holds ", st.cached_blocks, " blocks, ", before.cached_blocks, " before");
  KV_FUZZ_CHECK(st.bytes_in_use <= c->config().capacity_bytes, "load_prefix_index", "over capacity");
  if (added == 0) {
    KV_FUZZ_CHECK(st.bytes_in_use == before.bytes_in_use && st.cached_blocks == before.cached_blocks,
                  "load_prefix_index", "added no page but the pool changed");
  }
  if (untouched && !busy) {
    KV_FUZZ_CHECK(observe(*c).index == valid.pages, "load_prefix_index", "the valid index saves back other bytes");
  }
  // The saved index loads again, into a fresh cache, to the same bytes.
  const std::string again = index_bytes(*c, scratch() + "/again");
  {
    auto twin = target_cache(cs, false, int64_t{1} << 24);
    KV_FUZZ_CHECK(fuzz::accepts("re-load", [&] { twin->load_prefix_index(scratch() + "/again", kFingerprint); }),
                  "re-load", "an accepted index saves bytes that are refused");
    if (!busy) KV_FUZZ_CHECK(observe(*twin).index == again, "re-load", "a re-saved index loads to other bytes");
  }
  // Serve: a request continuing prompt 1 reuses what the loaded pages match, then decodes.
  if (!busy && c->config().capacity_bytes >= (int64_t{1} << 24)) {
    Sequence& s = c->sequence(0);
    std::vector<int64_t> p = prompt(1, 40);
    for (int64_t i = 0; i < 9; ++i) p.push_back(60 - i);
    const bool ok = fuzz::accepts("a request after a load", [&] {
      const int64_t cached = run_request(s, p, /*finish=*/false, /*attend=*/true);
      if (untouched) KV_FUZZ_CHECK(cached > 0, "serve", "the valid index served no prefix");
      p.push_back(5);
      step(s, p, static_cast<int64_t>(p.size()) - 1, static_cast<int64_t>(p.size()), StepKind::kDecode);
    });
    (void)fuzz::accepts("check_invariants after a request", [&] { c->check_invariants(); });
    if (ok) s.finish();
  }
  // Reclaiming every unused page gives the pool back to what the sequences hold.
  c->reclaim(INT64_MAX);
  (void)fuzz::accepts("check_invariants after reclaim", [&] { c->check_invariants(); });
  if (!busy) {
    KV_FUZZ_CHECK(c->stats().bytes_in_use == 0, "reclaim", c->stats().bytes_in_use, " B left in use with no request");
  }
}

// ---------------------------------------------------------------- the disk tier
/// A pool of 6 pages over a disk tier: prompt 0 (4 pages), then prompt 2 (4 others) spills
/// prompt 0's last 2; the edits go to those files (target bit 0 picks one, in name order);
/// then prompt 0 + 8 tokens reads them back.
void fuzz_disk(size_t cs, uint8_t flags, const std::vector<Edit>& edits) {
  static const size_t kDiskCases[] = {0, 2, 4};  // no residual, one namespace: 4 pages a prompt
  cs = kDiskCases[cs % 3];
  static std::map<size_t, int64_t> page_bytes;
  if (!page_bytes.count(cs)) {
    MultiSequenceCache probe(pool_config(cs));
    run_request(probe.add_sequence(), prompt(0, 32));
    page_bytes[cs] = probe.stats().bytes_in_use / 4;
  }
  const std::string dir = scratch() + "/tier";
  MultiSequenceConfig mc = pool_config(cs, 6 * page_bytes[cs]);
  mc.disk_tier_dir = dir;
  mc.disk_tier_bytes = int64_t{1} << 30;
  MultiSequenceCache c(mc);
  Sequence& s = c.add_sequence();
  run_request(s, prompt(0, 32));
  run_request(s, prompt(2, 32));
  const std::vector<std::string> files = entries(dir);
  std::vector<std::string> bytes;
  for (const auto& e : files) bytes.push_back(read_file(dir + "/" + e));
  const std::vector<std::string> valid = bytes;
  KV_FUZZ_CHECK(files.size() == 2, "disk tier", files.size(), " files spilled, expected 2");
  if (!files.empty()) {
    for (const Edit& e : edits) apply_edit(bytes[e.target % files.size()], e.op, (e.target >> 1) & 0x3f, e.offset, e.value);
    for (size_t i = 0; i < files.size(); ++i) {
      if (flags & 1) reseal(bytes[i]);
      if (bytes[i] != valid[i]) write_file(dir + "/" + files[i], bytes[i]);
    }
  }
  g_check_finite = bytes == valid;
  const PrefixCounters c0 = c.counters();
  std::vector<int64_t> p = prompt(0, 32);
  for (int64_t i = 0; i < 8; ++i) p.push_back(63 - i);
  int64_t cached = -1;
  (void)fuzz::accepts("check_invariants after spilling", [&] { c.check_invariants(); });
  KV_FUZZ_CHECK(fuzz::accepts("a request reading the disk tier", [&] { cached = run_request(s, p, false, true); }),
                "disk tier", "a request was refused (a corrupt page must be a miss)");
  (void)fuzz::accepts("check_invariants after reading the disk tier", [&] { c.check_invariants(); });
  const PrefixCounters d = c.counters() - c0;
  KV_FUZZ_CHECK(d.prompt_tokens_hit == cached && d.prompt_tokens_hit_disk + d.prompt_tokens_hit_memory == cached,
                "disk tier", "hit ", cached, " tokens, counted ", d.prompt_tokens_hit_memory, " + ", d.prompt_tokens_hit_disk);
  KV_FUZZ_CHECK(d.prompt_tokens_hit_disk <= d.disk_pages_read * kBlock, "disk tier", d.disk_pages_read,
                " pages read for ", d.prompt_tokens_hit_disk, " tokens");
  if (bytes == valid) {
    KV_FUZZ_CHECK(cached == 32 && d.disk_failures == 0 && d.disk_pages_read == 2, "disk tier",
                  "untouched files: hit ", cached, ", ", d.disk_failures, " failures");
  }
  if (bytes != valid) KV_FUZZ_CHECK(d.disk_failures <= 1, "disk tier", d.disk_failures, " failures");
  s.finish();
  c.reclaim(INT64_MAX);
  (void)fuzz::accepts("check_invariants after reclaim", [&] { c.check_invariants(); });
  KV_FUZZ_CHECK(c.stats().bytes_in_use == 0, "reclaim", c.stats().bytes_in_use, " B left in use");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  static const bool quiet = [] {  // a corrupt page's "counted as a miss" warning, every input
    set_log_level(LogLevel::kError);
    return true;
  }();
  (void)quiet;
  fuzz::Bytes in(data, size);
  const size_t cs = in.u8() % kCaseCount;
  const uint8_t flags = in.u8();
  const std::vector<Edit> edits = edits_of(in);
  if (flags & 16) {
    fuzz_disk(cs, flags, edits);
  } else {
    fuzz_index(cs, flags, edits);
  }
  return 0;
}
