// SPDX-License-Identifier: Apache-2.0
// MultiSequenceCache (kvcache/multi_sequence_cache.h): each sequence is a StepProtocol over a
// SequenceStore whose blocks come from one shared PoolSet (step_protocol.h, sequence_store.h);
// the prefix index is a RadixTree whose pages hold references to the blocks of a prompt's whole
// blocks, for every layer, KV head and stream.
#include "kvcache/multi_sequence_cache.h"

#include <dirent.h>
#include <unistd.h>
#include <xxhash.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <istream>
#include <list>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <unordered_map>
#include <utility>

#include "cache/block_list.h"
#include "cache/layer_store.h"
#include "cache/multi_sequence_access.h"
#include "cache/pool_set.h"
#include "cache/radix_tree.h"
#include "cache/snapshot_io.h"
#include "cache/step_protocol.h"
#include "common/file_io.h"
#include "common/log.h"
#include "kvcache/error.h"

namespace kvcache {
namespace {

using cache::Block;
using cache::BlockList;
using cache::BlockPool;
using cache::LayerStore;
using cache::RadixTree;
using cache::StepProtocol;
using cache::StreamFormats;

/// The blocks one page (P prompt tokens) holds in every block list: list i = (layer · H_kv +
/// head) · 2 + stream (0 = K, 1 = V) has blocks[start[i] .. start[i + 1]).
struct CachedPage {
  std::vector<Block> blocks;
  std::vector<BlockPool*> pools;  ///< per block
  std::vector<uint32_t> start;
  // With a disk tier (MultiSequenceConfig::disk_tier_dir) only: what a spill writes.
  std::pair<uint64_t, uint64_t> key{0, 0};  ///< chain_key() of its path
  int64_t depth = -1;                        ///< its page index in the path (−1: no disk tier)
  std::vector<int64_t> tokens;               ///< its own P token ids
  const std::string* ns = nullptr;           ///< its namespace (a key of Impl::ns_configs)
};

using DiskKey = std::pair<uint64_t, uint64_t>;

/// The magic of a page spilled to the disk tier.
constexpr char kDiskPageMagic[8] = {'\x89', 'K', 'V', 'P', 'A', 'G', 'E', '\n'};

/// The disk tier's key of a page: XXH3-128 chained over the namespace key and every page of the
/// path — h(ns) for the root, then h(parent's key ‖ the page's P token ids) — as vLLM's block
/// hashes; a spilled file also holds the page's own tokens and depth, checked on read.
std::pair<uint64_t, uint64_t> chain_key(const std::pair<uint64_t, uint64_t>& parent, const int64_t* tokens,
                                        int64_t n) {
  std::string buf(16 + static_cast<size_t>(n) * sizeof(int64_t), '\0');
  std::memcpy(&buf[0], &parent.first, 8);
  std::memcpy(&buf[8], &parent.second, 8);
  std::memcpy(&buf[16], tokens, static_cast<size_t>(n) * sizeof(int64_t));
  const XXH128_hash_t h = XXH3_128bits(buf.data(), buf.size());
  return {h.low64, h.high64};
}
std::pair<uint64_t, uint64_t> root_key(const std::string& ns) {
  const XXH128_hash_t h = XXH3_128bits(ns.data(), ns.size());
  return {h.low64, h.high64};
}

/// Everything that changes the bytes a configuration stores for the same tokens: the index's
/// namespace. (A CacheConfig field added later that changes stored bytes belongs here.)
std::string storage_key(const StepProtocol& m) {
  auto stream = [](const StreamSpec& s) {
    return s.quantizer->spec() + ",r" + std::to_string(s.residual) +
           (s.flush == ResidualFlush::kBlock ? ",block," : ",sliding,") + to_string(s.residual_dtype);
  };
  const CacheConfig& c = m.config();
  // The scheme's canonical spec, then how it resolved every layer's streams (a scheme may
  // store each layer differently; runs of equal layers are written once).
  std::string key = "scheme=" + m.store().scheme().spec();
  std::string last;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    std::string streams =
        "K[" + stream(m.store().key_setup(l).spec) + "] V[" + stream(m.store().value_setup(l).spec) + "]";
    if (streams != last) key += " L" + std::to_string(l) + ":" + streams;
    last = std::move(streams);
  }
  return key + " keys=" + (c.key_storage == KeyStorage::kPreRoPE ? "pre-rope" : "post-rope") +
         " positions=" + (c.position_mode == PositionMode::kRerotate ? "rerotate" : "original") +
         " block=" + std::to_string(m.store().block_tokens());
}

/// A block a page may hold: full, in the stream's main format, no holes, implicit positions.
bool sealed(const BlockList& list, const Block& b) {
  return b.format == StreamFormats::kMain && b.filled == list.format(b).capacity && b.live == b.filled &&
         b.dead.empty() && b.pos.empty();
}

/// Pages [b0, b1) of P tokens settled in `list` (held by sealed quantized blocks exactly
/// covering them), from b0 on: their blocks go to out[page − b0]. *irregular is set when a
/// block there can never be shared (holes, a merge, the fp32 fallback).
int64_t settled_pages(const BlockList& list, int64_t P, int64_t b0, int64_t b1, std::vector<std::vector<Block>>& out,
                      bool* irregular) {
  const auto& bl = list.blocks();
  size_t i = 0;
  while (i < bl.size() && bl[i].pos0 + bl[i].filled <= b0 * P) ++i;
  for (int64_t b = b0; b < b1; ++b) {
    int64_t want = b * P;
    const int64_t hi = want + P;
    std::vector<Block>& got = out[static_cast<size_t>(b - b0)];
    got.clear();
    while (want < hi) {
      if (i == bl.size()) return b - b0;  // not settled yet (still in the residual, or not written)
      const Block& x = bl[i];
      if (i + 1 == bl.size() && x.format == StreamFormats::kMain && x.filled < list.format(x).capacity &&
          x.live == x.filled && x.dead.empty() && x.pos.empty() && x.pos0 == want) {
        return b - b0;  // the tail block is still filling: settled once full
      }
      if (!sealed(list, x) || x.pos0 != want || x.pos0 + x.filled > hi) {
        *irregular = true;
        return b - b0;
      }
      got.push_back(x);
      want += x.filled;
      ++i;
    }
  }
  return b1 - b0;
}

/// Bytes of the blocks `m` holds (each block's pool size).
int64_t held_bytes(const StepProtocol& m) {
  int64_t n = 0;
  for (int64_t l = 0; l < m.config().num_layers; ++l) {
    const LayerStore& store = m.store().store(l);
    for (int64_t h = 0; h < store.num_heads(); ++h) {
      for (const BlockList* list : {&store.k(h).quant, &store.k(h).resid, &store.v(h).quant, &store.v(h).resid}) {
        for (const Block& b : list->blocks()) n += list->format(b).pool->block_bytes();
      }
    }
  }
  return n;
}

/// The largest snapshot or prefix index pages file read (64 GiB, as CacheManager::load).
constexpr int64_t kMaxSnapshotBytes = int64_t{64} << 30;
constexpr const char* kManifestName = "MANIFEST";

std::string read_snapshot_file(const std::string& path, const char* what, const char* fn) {
  try {
    return io::read_regular_file(path, what, kMaxSnapshotBytes);
  } catch (const InvalidArgument& e) {
    throw SnapshotError(SnapshotError::Reason::kIo, detail::str_cat(fn, ": ", e.what(), " (io)"));
  }
}

std::string hex16(uint64_t v) {
  static const char* digits = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<size_t>(i)] = digits[v & 15];
  return s;
}

}  // namespace

// ---------------------------------------------------------------- counters
double PrefixCounters::hit_rate() const {
  return prompt_tokens_queried > 0 ? static_cast<double>(prompt_tokens_hit) / static_cast<double>(prompt_tokens_queried)
                                   : 0.0;
}

PrefixCounters PrefixCounters::operator-(const PrefixCounters& e) const {
  PrefixCounters d;
  d.requests = requests - e.requests;
  d.prompt_tokens_queried = prompt_tokens_queried - e.prompt_tokens_queried;
  d.prompt_tokens_hit = prompt_tokens_hit - e.prompt_tokens_hit;
  d.blocks_shared = blocks_shared - e.blocks_shared;
  d.blocks_published = blocks_published - e.blocks_published;
  d.blocks_copied = blocks_copied - e.blocks_copied;
  d.blocks_reclaimed = blocks_reclaimed - e.blocks_reclaimed;
  d.preemptions = preemptions - e.preemptions;
  d.refusals = refusals - e.refusals;
  d.prompt_tokens_hit_memory = prompt_tokens_hit_memory - e.prompt_tokens_hit_memory;
  d.prompt_tokens_hit_disk = prompt_tokens_hit_disk - e.prompt_tokens_hit_disk;
  d.disk_pages_written = disk_pages_written - e.disk_pages_written;
  d.disk_bytes_written = disk_bytes_written - e.disk_bytes_written;
  d.disk_pages_read = disk_pages_read - e.disk_pages_read;
  d.disk_bytes_read = disk_bytes_read - e.disk_bytes_read;
  d.disk_evictions = disk_evictions - e.disk_evictions;
  d.disk_failures = disk_failures - e.disk_failures;
  d.disk_read_seconds = disk_read_seconds - e.disk_read_seconds;
  return d;
}

void MultiSequenceConfig::validate() const {
  model.validate();
  KV_CHECK_ARG(capacity_bytes >= 1, "MultiSequenceConfig.capacity_bytes must be >= 1 (bytes of blocks the pool may hold), got ",
               capacity_bytes);
  KV_CHECK_ARG(when_full == PoolFullRule::kRefuse || when_full == PoolFullRule::kPreemptNewest,
               "MultiSequenceConfig.when_full: ", static_cast<int>(when_full), " is neither kRefuse nor kPreemptNewest");
  KV_CHECK_ARG(disk_tier_dir.empty() ? disk_tier_bytes == 0 : disk_tier_bytes >= 1,
               disk_tier_dir.empty()
                   ? detail::str_cat("MultiSequenceConfig.disk_tier_bytes = ", disk_tier_bytes,
                                     " without a disk_tier_dir (set both, or neither)")
                   : detail::str_cat("MultiSequenceConfig.disk_tier_bytes must be >= 1 (bytes the disk tier's files "
                                     "may take) with disk_tier_dir '", disk_tier_dir, "', got ", disk_tier_bytes));
}

// ---------------------------------------------------------------- state
struct Sequence::State final : cache::StepHooks {
  MultiSequenceCache::Impl* cache = nullptr;
  int64_t id = 0;
  StepProtocol* m = nullptr;  ///< the sequence's steps (owned by its SequenceCache)
  RadixTree::Namespace ns;    ///< key "" = never shared (not_shared says why)
  std::string not_shared;
  int64_t granularity = 0;    ///< reused prefixes are multiples of this (block size, block-flush R)
  int64_t min_step = 0;       ///< the largest sliding residual: the first step after a reused prefix
  std::vector<int64_t> prompt;
  int64_t published = 0;      ///< prompt pages in the index through this request (adopted or inserted)
  bool publishing = false;
  RadixTree::Node* locked = nullptr;
  PrefixMatch match;
  int64_t serial = -1;        ///< request order (−1: idle)
  bool preempted = false;
  std::string preempted_why;
  int64_t cow_seen = 0;

  void before_append(int64_t bytes) override;
  void before_evict(int64_t bytes) override;
  void check_live(const char* fn) const {
    if (preempted) {
      throw PoolFullError(detail::str_cat(fn, ": sequence ", id, " was preempted (", preempted_why,
                                          "); start its request again with begin_request()"),
                          /*preempted=*/true);
    }
  }
};

struct MultiSequenceCache::Impl {
  MultiSequenceConfig cfg;
  std::shared_ptr<cache::PoolSet> pools = std::make_shared<cache::PoolSet>();
  RadixTree tree;
  std::unordered_map<RadixTree::PageId, CachedPage> pages;
  RadixTree::PageId next_page = 0;
  std::vector<std::unique_ptr<Sequence>> seqs;
  int64_t next_id = 0, next_serial = 0;
  PrefixCounters counters;
  int64_t peak = 0;
  /// The configuration of each namespace the index has held (what reads its blocks' formats).
  std::map<std::string, CacheConfig> ns_configs;
  mutable std::map<std::string, std::unique_ptr<StepProtocol>> format_protos;  ///< formats_of()

  /// The disk tier (MultiSequenceConfig::disk_tier_dir): one file per spilled page, by key.
  struct DiskEntry {
    std::string path;
    int64_t file_bytes = 0, pool_bytes = 0;
    std::list<DiskKey>::iterator lru;
  };
  struct DiskTier {
    std::string dir, prefix;
    int64_t capacity = 0, used = 0;
    std::map<DiskKey, DiskEntry> entries;
    std::list<DiskKey> lru;  ///< least recently written or read first
  };
  std::unique_ptr<DiskTier> disk;

  void open_disk_tier() {
    if (cfg.disk_tier_dir.empty()) return;
    const std::string& dir = cfg.disk_tier_dir;
    struct stat st {};
    if (::mkdir(dir.c_str(), 0755) != 0 && (errno != EEXIST || ::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))) {
      throw InvalidArgument(detail::str_cat("MultiSequenceConfig.disk_tier_dir: cannot use '", dir,
                                            "' as the disk tier's directory: ",
                                            errno == EEXIST ? "it exists and is not a directory" : std::strerror(errno)));
    }
    static std::atomic<int64_t> instances{0};
    disk = std::make_unique<DiskTier>();
    disk->dir = dir;
    disk->prefix = detail::str_cat("kvpage-", ::getpid(), "-", instances++);
    disk->capacity = cfg.disk_tier_bytes;
  }

  void drop_disk_entry(std::map<DiskKey, DiskEntry>::iterator it) {
    std::remove(it->second.path.c_str());
    disk->used -= it->second.file_bytes;
    disk->lru.erase(it->second.lru);
    disk->entries.erase(it);
  }

  void touch(DiskEntry& e) { disk->lru.splice(disk->lru.end(), disk->lru, e.lru); }

  /// A page about to be reclaimed, written to the disk tier when its blocks are about to be
  /// freed (no sequence holds them) and it is not there already. A write that fails counts in
  /// disk_failures and is dropped (the page is lost, as without a tier).
  void spill(RadixTree::PageId id) {
    const CachedPage& p = pages.at(id);
    if (p.depth < 0 || p.ns == nullptr) return;
    int64_t pool_bytes = 0;
    for (size_t i = 0; i < p.blocks.size(); ++i) {
      if (p.pools[i]->refcount(p.blocks[i].id) != 1) return;  // a sequence holds it: nothing is lost
      pool_bytes += p.pools[i]->block_bytes();
    }
    const auto it = disk->entries.find(p.key);
    if (it != disk->entries.end()) {
      touch(it->second);
      return;
    }
    using namespace cache::snapio;
    std::string payload;
    {
      Out o(payload);
      o.put<uint64_t>(p.key.first);
      o.put<uint64_t>(p.key.second);
      o.str(*p.ns);
      o.put<int64_t>(p.depth);
      o.put<uint64_t>(p.tokens.size());
      o.bytes(p.tokens.data(), p.tokens.size() * sizeof(int64_t));
      put_page_lists(o, p, formats_of(*p.ns));
    }
    std::string file = preamble(kDiskPageMagic, 1);
    put_section(file, "DPAG", 0, payload);
    const auto n = static_cast<int64_t>(file.size());
    if (n > disk->capacity) return;  // larger than the whole tier: dropped as without one
    while (disk->used + n > disk->capacity) {
      drop_disk_entry(disk->entries.find(disk->lru.front()));
      ++counters.disk_evictions;
    }
    const std::string path = disk->dir + "/" + disk->prefix + "-" + hex16(p.key.second) + hex16(p.key.first) + ".kvpage";
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out.write(file.data(), static_cast<std::streamsize>(file.size()));
      out.close();
      if (!out) {
        std::remove(path.c_str());
        ++counters.disk_failures;
        log::logger().warn("MultiSequenceCache: disk tier: cannot write '{}' ({} B); the page is dropped", path, n);
        return;
      }
    }
    disk->lru.push_back(p.key);
    disk->entries.emplace(p.key, DiskEntry{path, n, pool_bytes, std::prev(disk->lru.end())});
    disk->used += n;
    ++counters.disk_pages_written;
    counters.disk_bytes_written += n;
  }

  /// Reads entry `e` as page `depth` of s's prompt (key `key`) into `out` (blocks of s's
  /// formats from the shared pool), checking framing, checksums, key, namespace, depth, tokens
  /// and every block. false (nothing held) when any of it fails.
  bool read_disk_page(const Sequence::State& s, const DiskEntry& e, const DiskKey& key, int64_t depth,
                      CachedPage& out) {
    using namespace cache::snapio;
    std::string bytes;
    {
      std::ifstream in(e.path, std::ios::binary);
      if (!in) return false;
      bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      if (in.bad()) return false;
    }
    const int64_t P = s.ns.page_tokens;
    const int64_t* want = s.prompt.data() + depth * P;
    try {
      const std::vector<Section> sec = frame(bytes, e.path, kDiskPageMagic, "disk tier page magic \\x89KVPAGE\\n");
      if (sec.size() != 1 || sec[0].tag != tag_of("DPAG")) fail(Reason::kInconsistent, e.path, "not one 'DPAG' section");
      In in(sec[0].data, sec[0].size, "section 0 (DPAG)", e.path);
      const auto k1 = in.get<uint64_t>(), k2 = in.get<uint64_t>();
      const std::string ns = in.str();
      const auto d = in.get<int64_t>();
      const auto n = in.get<uint64_t>();
      if (DiskKey{k1, k2} != key || ns != s.ns.key || d != depth || n != static_cast<uint64_t>(P)) {
        fail(Reason::kInconsistent, e.path, "another page's file");
      }
      const uint8_t* ids = in.take(static_cast<size_t>(P) * sizeof(int64_t));
      if (std::memcmp(ids, want, static_cast<size_t>(P) * sizeof(int64_t)) != 0) {
        fail(Reason::kInconsistent, e.path, "another page's tokens");
      }
      read_page_lists(in, *s.m, depth, P, out, "section 0 (DPAG)", e.path);
      in.done();
    } catch (const SnapshotError& err) {
      for (size_t i = 0; i < out.blocks.size(); ++i) out.pools[i]->release(out.blocks[i].id);
      out = CachedPage{};
      log::logger().warn("MultiSequenceCache: disk tier: {}; counted as a miss", err.what());
      return false;
    }
    counters.disk_bytes_read += static_cast<int64_t>(bytes.size());
    out.key = key;
    out.depth = depth;
    out.tokens.assign(want, want + P);
    out.ns = &ns_configs.find(s.ns.key)->first;
    return true;
  }

  /// Extends `hit` (s's match in memory) with the pages that follow it on the disk tier, as far
  /// as a reuse could use them (≥ max(1, min_step) prompt tokens left to compute): each is read,
  /// checked and inserted into the index as a cached page (room made by reclaiming, the path
  /// pinned meanwhile). A missing or corrupt file ends the extension (disk_failures).
  void extend_from_disk(Sequence::State& s, RadixTree::Match& hit) {
    const int64_t P = s.ns.page_tokens, n = static_cast<int64_t>(s.prompt.size());
    const int64_t limit = n - std::max<int64_t>(1, s.min_step);
    int64_t j = hit.tokens / P;
    if ((j + 1) * P > limit || disk->entries.empty() || !ns_configs.count(s.ns.key)) return;
    DiskKey key = root_key(s.ns.key);
    for (int64_t k = 0; k < j; ++k) key = chain_key(key, s.prompt.data() + k * P, P);
    const auto t0 = std::chrono::steady_clock::now();
    RadixTree::Node* pin = hit.node;
    tree.lock(pin);
    int64_t got = 0;
    for (; (j + 1) * P <= limit; ++j) {
      key = chain_key(key, s.prompt.data() + j * P, P);
      auto it = disk->entries.find(key);
      if (it == disk->entries.end()) break;
      const int64_t need = it->second.pool_bytes;
      if (need > free_bytes()) {
        reclaim(need - free_bytes());        // may spill others (the path is pinned)
        it = disk->entries.find(key);        // ... and drop this one to make disk room
        if (it == disk->entries.end() || need > free_bytes()) break;
      }
      CachedPage page;
      if (!read_disk_page(s, it->second, key, j, page)) {
        drop_disk_entry(it);
        ++counters.disk_failures;
        break;
      }
      touch(it->second);
      ++counters.disk_pages_read;
      bool taken = false;
      RadixTree::Node* node = tree.insert(s.ns, s.prompt.data(), (j + 1) * P, [&](int64_t pg) {
        KV_INTERNAL_ASSERT(pg == j, "disk tier: page ", pg, " asked for, ", j, " read");
        taken = true;
        const RadixTree::PageId id = next_page++;
        pages.emplace(id, std::move(page));
        return id;
      });
      KV_INTERNAL_ASSERT(taken, "disk tier: page ", j, " was in the index already");
      tree.lock(node);
      tree.unlock(pin);
      pin = node;
      ++got;
    }
    tree.unlock(pin);
    if (got > 0) hit = tree.match(s.ns, s.prompt.data(), n);
    counters.disk_read_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  ~Impl() {
    seqs.clear();  // their blocks first, then the index's
    for (auto& [id, p] : pages) {
      for (size_t i = 0; i < p.blocks.size(); ++i) p.pools[i]->release(p.blocks[i].id);
    }
    if (disk) {
      for (const auto& [key, e] : disk->entries) std::remove(e.path.c_str());
    }
  }

  int64_t in_use() const { return pools->bytes_in_use(); }
  int64_t free_bytes() const { return cfg.capacity_bytes - in_use(); }

  /// After a call that may have changed the pool or copied blocks.
  void after(Sequence::State& s) {
    peak = std::max(peak, in_use());
    const int64_t cow = s.m->cow_copies();
    counters.blocks_copied += cow - s.cow_seen;
    s.cow_seen = cow;
  }

  void release_page(RadixTree::PageId id) {
    auto it = pages.find(id);
    KV_INTERNAL_ASSERT(it != pages.end(), "release of page ", id);
    const CachedPage& p = it->second;
    for (size_t i = 0; i < p.blocks.size(); ++i) {
      p.pools[i]->release(p.blocks[i].id);
      if (p.pools[i]->refcount(p.blocks[i].id) == 0) ++counters.blocks_reclaimed;
    }
    pages.erase(it);
  }

  int64_t reclaim(int64_t bytes) {
    const int64_t before = in_use();
    tree.evict([&] { return before - in_use() >= bytes; }, [&](RadixTree::PageId p) {
      if (disk) spill(p);
      release_page(p);
    });
    return before - in_use();
  }

  void unlock(Sequence::State& s) {
    if (s.locked != nullptr) tree.unlock(s.locked);
    s.locked = nullptr;
  }

  /// Ends s's request in place (its blocks go back; what it published stays cached).
  void end_request(Sequence::State& s) {
    s.m->reset(s.m->config().context_length);  // a context it was valid for: cannot throw
    unlock(s);
    s.prompt.clear();
    s.published = 0;
    s.publishing = false;
    s.match = PrefixMatch{};
  }

  void preempt(Sequence::State& v, const Sequence::State& who, int64_t bytes) {
    std::string why = detail::str_cat("the pool was full when sequence ", who.id, " needed up to ", bytes, " B: ",
                                      free_bytes(), " B free of capacity_bytes = ", cfg.capacity_bytes, ", ", in_use(),
                                      " B in use; PoolFullRule::kPreemptNewest preempts the newest request first");
    end_request(v);
    v.preempted = true;
    v.preempted_why = std::move(why);
    v.serial = -1;
    ++counters.preemptions;
    log::logger().info("MultiSequenceCache: preempted sequence {} for sequence {} ({} B needed)", v.id, who.id, bytes);
  }

  /// Whether `c` is a request kPreemptNewest may preempt for `s`: running (it holds blocks) and
  /// begun after s's.
  static bool preemptible_for(const Sequence::State& c, const Sequence::State& s) {
    return &c != &s && c.serial > s.serial && c.m->stats().bytes_reserved > 0;
  }

  /// The bytes free once every cached page no request would use is reclaimed and, with
  /// `preempt`, every request begun after s's is preempted — all make_room can reach —
  /// computed without changing anything: a block is freed when every reference to it goes
  /// (the victims' block lists, then the pages left unlocked without the victims' locks).
  /// With `self`, s's own request counts as ended too (Sequence::load ends it first).
  int64_t reachable_free(const Sequence::State& s, bool preempt, int64_t* victims_out, bool self = false) {
    std::vector<Sequence::State*> victims;
    if (preempt) {
      for (auto& q : seqs) {
        if (preemptible_for(*q->s_, s)) victims.push_back(q->s_.get());
      }
    }
    if (self) {
      for (auto& q : seqs) {
        if (q->s_.get() == &s) victims.push_back(q->s_.get());
      }
    }
    std::map<std::pair<const BlockPool*, cache::BlockId>, int64_t> dropped;
    for (const Sequence::State* v : victims) {
      const cache::StepProtocol& m = *v->m;
      for (int64_t l = 0; l < m.config().num_layers; ++l) {
        const LayerStore& store = m.store().store(l);
        for (int64_t h = 0; h < store.num_heads(); ++h) {
          for (const BlockList* list : {&store.k(h).quant, &store.k(h).resid, &store.v(h).quant, &store.v(h).resid}) {
            for (const Block& b : list->blocks()) ++dropped[{list->format(b).pool, b.id}];
          }
        }
      }
    }
    // Lock counts as they would be without the victims (unlock and lock only count: restored
    // exactly before anything else happens).
    for (const Sequence::State* v : victims) {
      if (v->locked != nullptr) tree.unlock(v->locked);
    }
    tree.for_each_page([&](RadixTree::PageId id, bool locked) {
      if (locked) return;
      const CachedPage& p = pages.at(id);
      for (size_t i = 0; i < p.blocks.size(); ++i) ++dropped[{p.pools[i], p.blocks[i].id}];
    });
    for (const Sequence::State* v : victims) {
      if (v->locked != nullptr) tree.lock(v->locked);
    }
    int64_t freed = 0;
    for (const auto& [key, refs] : dropped) {
      if (key.first->refcount(key.second) == refs) freed += key.first->block_bytes();
    }
    if (victims_out != nullptr) *victims_out = static_cast<int64_t>(victims.size());
    return free_bytes() + freed;
  }

  /// Makes `bytes` free for s's next allocation, or throws PoolFullError (PoolFullRule). Plans
  /// first: a call that cannot fit even after reclaiming every unused cached page (and, under
  /// kPreemptNewest, preempting every newer request) is refused before anything is reclaimed or
  /// preempted, so a refused call changes nothing.
  void make_room(Sequence::State& s, int64_t bytes) {
    if (bytes <= free_bytes()) return;
    const bool preempting = cfg.when_full == PoolFullRule::kPreemptNewest;
    int64_t newer = 0;
    const int64_t reachable = reachable_free(s, preempting, &newer);
    if (bytes > reachable) {
      ++counters.refusals;
      int64_t running = 0;
      for (auto& q : seqs) running += q->s_->m->stats().bytes_reserved > 0;
      throw PoolFullError(
          detail::str_cat(
              "MultiSequenceCache: sequence ", s.id, " needs up to ", bytes, " B of new blocks but only ",
              free_bytes(), " B of the pool's capacity_bytes = ", cfg.capacity_bytes, " are free (", in_use(),
              " B in use by ", running, " running sequences and the prefix index), and ",
              preempting ? detail::str_cat("reclaiming every unused cached prefix and preempting the ", newer,
                                           " requests newer than this one")
                         : std::string("reclaiming every unused cached prefix"),
              " would leave ", reachable, " B free",
              preempting ? "" : " (PoolFullRule::kRefuse)",
              "; nothing was reclaimed or preempted: end a request (Sequence::finish) and retry, or raise "
              "capacity_bytes"),
          /*preempted=*/false);
    }
    reclaim(bytes - free_bytes());
    while (bytes > free_bytes()) {
      Sequence::State* victim = nullptr;
      for (auto& q : seqs) {
        Sequence::State& c = *q->s_;
        if (!preemptible_for(c, s)) continue;
        if (victim == nullptr || c.serial > victim->serial) victim = &c;
      }
      KV_INTERNAL_ASSERT(preempting && victim != nullptr, "MultiSequenceCache: the plan said ", reachable,
                         " B can be freed, but only ", free_bytes(), " B are free with no request left to preempt");
      preempt(*victim, s, bytes);
      if (bytes > free_bytes()) reclaim(bytes - free_bytes());  // its prefix may be unused now
    }
  }

  // ---- prefix index -------------------------------------------------------------------
  /// Sets s's namespace, granularity and first-step rule from its configuration.
  void classify(Sequence::State& s) {
    const StepProtocol& m = *s.m;
    s.granularity = m.store().block_tokens();
    s.min_step = 0;
    bool tensor_scale = false;
    for (int64_t l = 0; l < m.config().num_layers; ++l) {
      const auto& ks = m.store().key_setup(l);
      const auto& vs = m.store().value_setup(l);
      tensor_scale = tensor_scale || ks.formats.tensor_scale() || vs.formats.tensor_scale();
      for (const StreamSpec* sp : {&ks.spec, &vs.spec}) {
        if (sp->residual <= 0) continue;
        if (sp->flush == ResidualFlush::kBlock) s.granularity = std::lcm(s.granularity, sp->residual);
        if (sp->flush == ResidualFlush::kSliding) s.min_step = std::max(s.min_step, sp->residual);
      }
    }
    s.ns = RadixTree::Namespace{storage_key(m), m.store().block_tokens()};
    s.not_shared.clear();
    if (!cfg.prefix_sharing) {
      s.not_shared = "prefix sharing is off (MultiSequenceConfig::prefix_sharing)";
    } else if (tensor_scale) {
      s.not_shared = "'" + m.config().scheme +
                     "' scales each stream by the request's own first write, so its blocks depend on more "
                     "than the tokens";
    }
    if (!s.not_shared.empty()) s.ns.key.clear();
  }

  /// The longest reusable cached prefix of s.prompt, adopted into s.m (freshly reset).
  void reuse(Sequence::State& s) {
    PrefixMatch& pm = s.match;
    const auto n = static_cast<int64_t>(s.prompt.size());
    pm.prompt_tokens = n;
    if (s.ns.key.empty()) {
      pm.limited_by = s.not_shared;
      if (cfg.prefix_sharing) {
        ++counters.requests;
        counters.prompt_tokens_queried += n;
      }
      return;
    }
    ++counters.requests;
    counters.prompt_tokens_queried += n;
    s.publishing = true;
    if (n == 0) return;
    const int64_t P = s.ns.page_tokens;
    RadixTree::Match hit = tree.match(s.ns, s.prompt.data(), n);
    const int64_t in_memory = hit.tokens;
    if (disk) extend_from_disk(s, hit);
    pm.indexed_tokens = hit.tokens;
    int64_t m = hit.tokens;
    auto cut = [&](int64_t to, const std::string& why) {
      if (to < m) {
        m = std::max<int64_t>(0, to);
        pm.limited_by += (pm.limited_by.empty() ? "" : "; ") + why;
      }
    };
    cut(n - std::max<int64_t>(1, s.min_step),
        s.min_step > 0 ? detail::str_cat("a sliding residual of ", s.min_step, " tokens: at least ", s.min_step,
                                         " prompt tokens are computed")
                       : std::string("at least one prompt token is computed (its logits start generation)"));
    cut(m / s.granularity * s.granularity,
        detail::str_cat("prefixes are reused in multiples of ", s.granularity,
                        " tokens (blocks of ", P, "; residuals flushed in blocks)"));
    if (m > 0) {
      std::string why = s.m->replay_blocker(m, cfg.allow_inexact_reuse);
      if (!why.empty()) {
        // A budget below the prefix: reuse what fits it, if that replays.
        int64_t b = std::numeric_limits<int64_t>::max();
        for (int64_t l = 0; l < s.m->config().num_layers; ++l) b = std::min(b, s.m->policy().layer_budget(l));
        const int64_t fit = std::min(m, b) / s.granularity * s.granularity;
        if (fit > 0 && fit < m && s.m->replay_blocker(fit, cfg.allow_inexact_reuse).empty()) {
          cut(fit, why);
        } else {
          cut(0, why);
        }
      }
    }
    pm.cached_tokens = m;
    if (m == 0) return;
    RadixTree::Node* node = hit.node;
    if (m < hit.tokens) node = tree.match(s.ns, s.prompt.data(), m).node;  // split at m, to lock just that
    cache::AdoptedPrefix a;
    a.tokens = m;
    a.min_next_step = s.min_step;
    const int64_t L = s.m->config().num_layers, H = s.m->config().num_kv_heads;
    a.k.assign(static_cast<size_t>(L), std::vector<std::vector<Block>>(static_cast<size_t>(H)));
    a.v = a.k;
    for (int64_t j = 0; j < m / P; ++j) {
      const CachedPage& p = pages.at(hit.pages[static_cast<size_t>(j)]);
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t h = 0; h < H; ++h) {
          for (int st = 0; st < 2; ++st) {
            const size_t list = static_cast<size_t>((l * H + h) * 2 + st);
            auto& dst = (st == 0 ? a.k : a.v)[static_cast<size_t>(l)][static_cast<size_t>(h)];
            dst.insert(dst.end(), p.blocks.begin() + p.start[list], p.blocks.begin() + p.start[list + 1]);
            counters.blocks_shared += p.start[list + 1] - p.start[list];
          }
        }
      }
    }
    s.m->adopt(a);
    tree.lock(node);
    s.locked = node;
    s.published = m / P;
    pm.min_first_step = s.min_step;
    counters.prompt_tokens_hit += m;
    counters.prompt_tokens_hit_memory += std::min(m, in_memory);
    counters.prompt_tokens_hit_disk += std::max<int64_t>(0, m - in_memory);
  }

  /// The prompt pages of a sequence that settled since its last publication, with a reference
  /// taken on each of their blocks (so that the step's eviction copies them on write, as it
  /// must once the index holds them), not yet in the index: end_step commits them after the
  /// sequence's own end_step succeeded, or aborts them (references returned) when it is refused,
  /// so that a refused end_step leaves the index as it was (error.h).
  struct PendingPublish {
    bool active = false;         ///< s.publishing was set when planned
    bool stop = false;           ///< publishing ends with this step (evicted, irregular, done)
    int64_t b0 = 0, settled = 0;  ///< pages [b0, b0 + settled) of the prompt
    int64_t first_retained = 0;  ///< pages before it were in the index already when planned
    std::vector<std::vector<std::vector<Block>>> blocks;  ///< [list][page − b0]
    std::vector<const BlockList*> lists;
    std::vector<bool> retained;  ///< [page − b0]: references are held for this page's blocks
  };

  /// Plans the publication of s's settled prompt pages (end_step, before evicting).
  PendingPublish plan_publish(Sequence::State& s) {
    PendingPublish pp;
    if (!s.publishing) return pp;
    pp.active = true;
    const StepProtocol& m = *s.m;
    const CacheStats st = m.stats();
    if (st.tokens_resident < st.tokens_written) {  // it evicted: what is left of its prompt stays private
      pp.stop = true;
      return pp;
    }
    const int64_t P = s.ns.page_tokens;
    const int64_t b0 = s.published, b1 = static_cast<int64_t>(s.prompt.size()) / P;
    pp.b0 = b0;
    if (b0 >= b1) {
      pp.stop = true;
      return pp;
    }
    const int64_t L = m.config().num_layers, H = m.config().num_kv_heads;
    pp.blocks.resize(static_cast<size_t>(L * H * 2));
    pp.lists.resize(pp.blocks.size());
    int64_t settled = b1 - b0;
    bool irregular = false;
    for (int64_t l = 0; l < L && settled > 0; ++l) {
      const LayerStore& store = m.store().store(l);
      for (int64_t h = 0; h < H && settled > 0; ++h) {
        for (int st2 = 0; st2 < 2 && settled > 0; ++st2) {
          const size_t i = static_cast<size_t>((l * H + h) * 2 + st2);
          pp.lists[i] = st2 == 0 ? &store.k(h).quant : &store.v(h).quant;
          pp.blocks[i].resize(static_cast<size_t>(b1 - b0));
          settled = std::min(settled, settled_pages(*pp.lists[i], P, b0, b0 + settled, pp.blocks[i], &irregular));
        }
      }
    }
    pp.settled = settled;
    pp.stop = irregular || b0 + settled >= b1;
    // Pages the index holds already (another request published the same tokens) are not taken
    // from this one: insert() asks only for the others. Counted without touching the tree.
    pp.first_retained = std::max(b0, std::min(b0 + settled, tree.cached_tokens(s.ns, s.prompt.data(), (b0 + settled) * P) / P));
    pp.retained.assign(static_cast<size_t>(settled), false);
    for (int64_t page = pp.first_retained; page < b0 + settled; ++page) retain_page(pp, page);
    return pp;
  }

  void retain_page(PendingPublish& pp, int64_t page) {
    for (size_t i = 0; i < pp.blocks.size(); ++i) {
      for (const Block& b : pp.blocks[i][static_cast<size_t>(page - pp.b0)]) pp.lists[i]->format(b).pool->retain(b.id);
    }
    pp.retained[static_cast<size_t>(page - pp.b0)] = true;
  }

  void release_page(PendingPublish& pp, int64_t page) {
    for (size_t i = 0; i < pp.blocks.size(); ++i) {
      for (const Block& b : pp.blocks[i][static_cast<size_t>(page - pp.b0)]) pp.lists[i]->format(b).pool->release(b.id);
    }
    pp.retained[static_cast<size_t>(page - pp.b0)] = false;
  }

  /// A refused end_step: the references taken by plan_publish go back; nothing else was touched.
  void abort_publish(PendingPublish& pp) {
    for (int64_t page = pp.b0; page < pp.b0 + pp.settled; ++page) {
      if (pp.retained[static_cast<size_t>(page - pp.b0)]) release_page(pp, page);
    }
  }

  /// Inserts the planned pages into the index (after the sequence's end_step succeeded).
  void commit_publish(Sequence::State& s, PendingPublish& pp) {
    if (!pp.active) return;
    const int64_t b0 = pp.b0, settled = pp.settled;
    if (settled > 0) {
      const std::string* ns = &ns_configs.emplace(s.ns.key, s.m->config()).first->first;
      const int64_t P = s.ns.page_tokens;
      std::vector<DiskKey> keys;  // the disk tier's keys of pages 0 .. b0 + settled
      if (disk) {
        keys.push_back(chain_key(root_key(s.ns.key), s.prompt.data(), P));
        for (int64_t k = 1; k < b0 + settled; ++k) keys.push_back(chain_key(keys.back(), s.prompt.data() + k * P, P));
      }
      RadixTree::Node* node = tree.insert(s.ns, s.prompt.data(), (b0 + settled) * s.ns.page_tokens, [&](int64_t page) {
        KV_INTERNAL_ASSERT(page >= b0 && page < b0 + settled, "publish: page ", page, " outside [", b0, ", ",
                           b0 + settled, ")");
        // A page the index lost while the step ran (reclaimed to make room) is taken now.
        if (!pp.retained[static_cast<size_t>(page - b0)]) retain_page(pp, page);
        pp.retained[static_cast<size_t>(page - b0)] = false;  // the page holds the references now
        CachedPage p;
        p.start.push_back(0);
        for (size_t i = 0; i < pp.blocks.size(); ++i) {
          for (const Block& b : pp.blocks[i][static_cast<size_t>(page - b0)]) {
            p.blocks.push_back(b);
            p.pools.push_back(pp.lists[i]->format(b).pool);
          }
          p.start.push_back(static_cast<uint32_t>(p.blocks.size()));
        }
        if (disk) {
          p.key = keys[static_cast<size_t>(page)];
          p.depth = page;
          p.tokens.assign(s.prompt.begin() + page * P, s.prompt.begin() + (page + 1) * P);
          p.ns = ns;
        }
        counters.blocks_published += static_cast<int64_t>(p.blocks.size());
        const RadixTree::PageId id = next_page++;
        pages.emplace(id, std::move(p));
        return id;
      });
      abort_publish(pp);  // references of pages the index already held when inserted
      tree.lock(node);
      unlock(s);
      s.locked = node;
      s.published = b0 + settled;
    }
    if (pp.stop) s.publishing = false;
  }

  // ---- snapshots ----------------------------------------------------------------------
  /// Sequence::load: every check of `bytes` in blocks of a private pool, then room (ending s's
  /// request, reclaiming unused prefixes), then the same bytes read into the shared pool. The
  /// caller swaps the returned protocol in.
  std::unique_ptr<StepProtocol> load_sequence(Sequence::State& s, const std::string& bytes, const std::string& fp,
                                              const std::string& source, std::vector<int64_t>* tokens) {
    int64_t need = 0;
    {
      const std::unique_ptr<StepProtocol> probe = StepProtocol::from_snapshot(s.m->config(), bytes, fp, source, tokens);
      need = held_bytes(*probe);
    }
    const int64_t reachable = reachable_free(s, false, nullptr, /*self=*/true);
    if (need > reachable) {
      ++counters.refusals;
      throw PoolFullError(
          detail::str_cat("Sequence::load: snapshot '", source, "' holds ", need, " B of blocks but only ",
                          free_bytes(), " B of the pool's capacity_bytes = ", cfg.capacity_bytes,
                          " are free, and ending sequence ", s.id,
                          "'s request and reclaiming every unused cached prefix would leave ", reachable,
                          " B free; nothing was changed: end a request (Sequence::finish) and retry, or raise "
                          "capacity_bytes"),
          /*preempted=*/false);
    }
    end_request(s);
    if (need > free_bytes()) reclaim(need - free_bytes());
    // The bytes passed every check above; reading them again cannot fail but for memory.
    return StepProtocol::from_snapshot(s.m->config(), bytes, fp, source, nullptr, pools, &s);
  }

  /// The namespaces a load may fill: the storage key of config().model and of every sequence's
  /// configuration, each with a protocol over `over` (null: pools of its own) whose formats read
  /// the pages' blocks.
  std::map<std::string, std::unique_ptr<StepProtocol>> namespaces(const std::shared_ptr<cache::PoolSet>& over) const {
    std::map<std::string, std::unique_ptr<StepProtocol>> out;
    std::vector<CacheConfig> configs{cfg.model};
    for (const auto& q : seqs) configs.push_back(q->s_->m->config());
    for (CacheConfig c : configs) {
      c.context_length = 0;
      auto m = std::make_unique<StepProtocol>(std::move(c), over, nullptr);
      std::string key = storage_key(*m);
      if (!out.count(key)) out.emplace(std::move(key), std::move(m));
    }
    return out;
  }

  /// A page read from an index file: its namespace, parent (file order), depth and tokens, and
  /// its blocks (one reference each, taken from the formats' pools).
  struct LoadedPage {
    const RadixTree::Namespace* ns = nullptr;
    int64_t parent = -1, depth = 0;
    std::vector<int64_t> tokens;
    CachedPage page;
  };

  static void release_loaded(std::vector<LoadedPage>& pages) {
    for (LoadedPage& lp : pages) {
      for (size_t i = 0; i < lp.page.blocks.size(); ++i) lp.page.pools[i]->release(lp.page.blocks[i].id);
      lp.page.blocks.clear();
    }
  }

  /// Reads a page's block lists (every layer, KV head, K then V: u32 count, block records) into
  /// `page` — blocks of `m`'s formats, each with one reference the page holds — checking that
  /// they are sealed and cover exactly positions [depth · P, (depth + 1) · P). On a failed
  /// check the blocks already in `page` stay there (the caller releases them).
  static void read_page_lists(cache::snapio::In& in, const StepProtocol& m, int64_t depth, int64_t P,
                              CachedPage& page, const std::string& where, const std::string& source) {
    using namespace cache::snapio;
    const int64_t L = m.config().num_layers, H = m.config().num_kv_heads;
    page.start.assign(1, 0);
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t h = 0; h < H; ++h) {
        for (const bool key : {true, false}) {
          const StreamFormats& fmts = *(key ? m.store().key_setup(l) : m.store().value_setup(l)).formats_for(h);
          const std::string at = detail::str_cat(where, " layer ", l, " head ", h, key ? " K" : " V");
          BlockList list(&fmts);
          const auto blocks = in.get<uint32_t>();
          in.need(blocks);
          int64_t expect = depth * P;
          for (uint32_t b = 0; b < blocks; ++b) get_block(in, list, fmts, expect, at, source);
          // A page holds sealed blocks (full, main format, no holes) covering exactly its tokens.
          int64_t want = depth * P;
          for (const Block& b : list.blocks()) {
            if (!sealed(list, b) || b.pos0 != want) {
              fail(Reason::kInconsistent, source,
                   detail::str_cat(at, ": a block at position ", b.pos0, " of ", b.filled,
                                   " slots is not a full, hole-free block of the main format at ", want));
            }
            want += b.filled;
          }
          if (want != (depth + 1) * P) {
            fail(Reason::kInconsistent, source, detail::str_cat(at, ": blocks cover positions ", depth * P, " .. ", want,
                                                                ", not the page's ", depth * P, " .. ",
                                                                (depth + 1) * P));
          }
          for (const Block& b : list.blocks()) {
            list.format(b).pool->retain(b.id);  // the page's reference; the list's goes with it
            page.blocks.push_back(b);
            page.pools.push_back(list.format(b).pool);
          }
          page.start.push_back(static_cast<uint32_t>(page.blocks.size()));
        }
      }
    }
  }

  /// Writes a page's block lists as read_page_lists() reads them; `proto` (a protocol of the
  /// page's namespace configuration) gives the blocks' formats.
  static void put_page_lists(cache::snapio::Out& o, const CachedPage& p, const StepProtocol& proto) {
    const int64_t H = proto.config().num_kv_heads;
    for (size_t list = 0; list + 1 < p.start.size(); ++list) {
      const int64_t l = static_cast<int64_t>(list) / (2 * H), h = (static_cast<int64_t>(list) / 2) % H;
      const StreamFormats& fmts =
          *(list % 2 == 0 ? proto.store().key_setup(l) : proto.store().value_setup(l)).formats_for(h);
      o.put<uint32_t>(p.start[list + 1] - p.start[list]);
      // Positions as deltas from the page's first token (depth · P): 0 for every block.
      int64_t expect = p.start[list] < p.start[list + 1] ? p.blocks[p.start[list]].pos0 : 0;
      for (uint32_t b = p.start[list]; b < p.start[list + 1]; ++b) {
        const Block& blk = p.blocks[b];
        cache::snapio::put_block(o, fmts.f[blk.format], blk, p.pools[b]->data(blk.id), expect);
      }
    }
  }

  /// A protocol of namespace `ns`'s configuration over pools of its own: its formats read and
  /// write the namespace's pages (a page keeps its blocks' pools, not their formats, which are
  /// those of the sequence that published it and may be gone).
  const StepProtocol& formats_of(const std::string& ns) const {
    auto& proto = format_protos[ns];
    if (!proto) {
      CacheConfig c = ns_configs.at(ns);
      c.context_length = 0;
      proto = std::make_unique<StepProtocol>(std::move(c), nullptr, nullptr);
    }
    return *proto;
  }

  /// Reads and checks the pages of `file` (framed, kIndexMagic) into blocks of the formats of
  /// `protos` (by namespace key). On a failed check every block taken is given back.
  void read_index(const std::string& file, const std::string& fp, const std::string& source,
                  const std::map<std::string, std::unique_ptr<StepProtocol>>& protos,
                  std::vector<RadixTree::Namespace>& nss, std::vector<LoadedPage>& out) const {
    using namespace cache::snapio;
    const std::vector<Section> sections = frame(file, source, kIndexMagic, "prefix index magic \\x89KVINDX\\n");
    if (sections.empty() || sections[0].tag != tag_of("HEAD")) {
      fail(Reason::kInconsistent, source, "its first section is not 'HEAD'");
    }
    In hin(sections[0].data, sections[0].size, "section 0 (HEAD)", source);
    const std::string library = hin.str();
    const std::string model = hin.str();
    if (model != fp) {
      fail(Reason::kOtherModel, source, "written for model '" + model + "', the caller's model is '" + fp + "'");
    }
    const CacheConfig& g = cfg.model;
    for (const auto& [name, mine] : {std::pair<const char*, int64_t>{"num_layers", g.num_layers},
                                     {"num_q_heads", g.num_q_heads},
                                     {"num_kv_heads", g.num_kv_heads},
                                     {"head_dim", g.head_dim}}) {
      const auto v = hin.get<int64_t>();
      if (v != mine) {
        fail(Reason::kOtherConfig, source, detail::str_cat(name, " is ", v, " in the index, ", mine, " in the cache"));
      }
    }
    const auto n_ns = hin.get<uint64_t>();
    hin.need(n_ns);
    nss.clear();
    std::vector<const StepProtocol*> ns_proto;
    for (uint64_t i = 0; i < n_ns; ++i) {
      RadixTree::Namespace ns;
      ns.key = hin.str();
      ns.page_tokens = hin.get<int64_t>();
      const auto it = protos.find(ns.key);
      if (it == protos.end()) {
        std::string known;
        for (const auto& [k, m] : protos) known += (known.empty() ? "'" : ", '") + k + "'";
        fail(Reason::kOtherConfig, source,
             "namespace '" + ns.key + "' is stored by no configuration of this cache (config().model or a sequence's: " +
                 known + ")");
      }
      if (ns.page_tokens != it->second->store().block_tokens()) {
        fail(Reason::kInconsistent, source, detail::str_cat("namespace '", ns.key, "' has pages of ", ns.page_tokens,
                                                            " tokens, its blocks hold ",
                                                            it->second->store().block_tokens()));
      }
      nss.push_back(std::move(ns));
      ns_proto.push_back(it->second.get());
    }
    const auto n_pages = hin.get<uint64_t>();
    hin.done();
    if (n_pages != sections.size() - 1) {
      fail(Reason::kInconsistent, source, detail::str_cat("the header counts ", n_pages, " pages, the file holds ",
                                                          sections.size() - 1, " page sections"));
    }
    out.clear();
    out.reserve(static_cast<size_t>(n_pages));
    std::vector<int64_t> chain;  // the pages on the current path, by depth
    try {
      for (size_t si = 1; si < sections.size(); ++si) {
        const std::string where = detail::str_cat("section ", si, " (page ", si - 1, ")");
        if (sections[si].tag != tag_of("PAGE")) {
          fail(Reason::kInconsistent, source, where + " is '" + tag_name(sections[si].tag) + "', expected 'PAGE'");
        }
        In in(sections[si].data, sections[si].size, where, source);
        LoadedPage lp;
        const auto ns = in.get<uint32_t>();
        lp.parent = in.get<int64_t>();
        if (ns >= nss.size()) fail(Reason::kInconsistent, source, detail::str_cat(where, ": namespace ", ns));
        lp.ns = &nss[ns];
        const int64_t self = static_cast<int64_t>(si) - 1;
        if (lp.parent >= 0) {
          const LoadedPage* q = lp.parent < self ? &out[static_cast<size_t>(lp.parent)] : nullptr;
          if (q == nullptr || q->ns != lp.ns || static_cast<int64_t>(chain.size()) <= q->depth ||
              chain[static_cast<size_t>(q->depth)] != lp.parent) {
            fail(Reason::kInconsistent, source,
                 detail::str_cat(where, ": its parent page ", lp.parent, " is not on the path before it"));
          }
          lp.depth = q->depth + 1;
          chain.resize(static_cast<size_t>(lp.depth));
        } else if (lp.parent == -1) {
          chain.clear();
        } else {
          fail(Reason::kInconsistent, source, detail::str_cat(where, ": parent ", lp.parent));
        }
        chain.push_back(self);
        const int64_t P = lp.ns->page_tokens;
        in.need(static_cast<uint64_t>(P));  // each token takes 8 bytes: P <= bytes left bounds P * 8
        const uint8_t* ids = in.take(static_cast<size_t>(P) * sizeof(int64_t));
        lp.tokens.resize(static_cast<size_t>(P));
        std::memcpy(lp.tokens.data(), ids, static_cast<size_t>(P) * sizeof(int64_t));
        out.push_back(std::move(lp));
        LoadedPage& page = out.back();
        read_page_lists(in, *ns_proto[ns], page.depth, P, page.page, where, source);
        in.done();
      }
    } catch (...) {
      release_loaded(out);
      out.clear();
      throw;
    }
  }

  int64_t load_index(const std::string& dir, const std::string& fp) {
    using namespace cache::snapio;
    const char* fn = "MultiSequenceCache::load_prefix_index";
    const std::string mpath = dir + "/" + kManifestName;
    const std::string manifest = read_snapshot_file(mpath, "prefix index manifest", fn);
    const std::vector<Section> ms = frame(manifest, mpath, kManifestMagic, "prefix index manifest magic \\x89KVMANI\\n");
    if (ms.size() != 1 || ms[0].tag != tag_of("MANI")) {
      fail(Reason::kInconsistent, mpath, detail::str_cat("holds ", ms.size(), " sections, expected one 'MANI'"));
    }
    In min(ms[0].data, ms[0].size, "section 0 (MANI)", mpath);
    const std::string library = min.str();
    const std::string model = min.str();
    const std::string name = min.str();
    const auto size = min.get<uint64_t>();
    const auto sum = min.get<uint64_t>();
    min.done();
    if (model != fp) {
      fail(Reason::kOtherModel, mpath, "written for model '" + model + "', the caller's model is '" + fp + "'");
    }
    if (name.empty() || name.find('/') != std::string::npos || name[0] == '.') {
      fail(Reason::kInconsistent, mpath, "names the pages file '" + name + "' (a plain file name is expected)");
    }
    if (!cfg.prefix_sharing) {
      fail(Reason::kOtherConfig, mpath, "this cache does not share prefixes (MultiSequenceConfig::prefix_sharing)");
    }
    const std::string ppath = dir + "/" + name;
    const std::string file = read_snapshot_file(ppath, "prefix index pages file", fn);
    if (file.size() != size) {
      fail(file.size() < size ? Reason::kTruncated : Reason::kInconsistent, ppath,
           detail::str_cat("is ", file.size(), " bytes, the manifest says ", size));
    }
    if (xxh3(file.data(), file.size()) != sum) {
      fail(Reason::kChecksum, ppath, "its checksum does not match the manifest's");
    }
    std::vector<RadixTree::Namespace> nss;
    std::vector<LoadedPage> pages_in;
    int64_t need = 0;
    {
      // Pass 1: every check, in pools of the probe's own.
      const auto probes = namespaces(nullptr);
      read_index(file, fp, ppath, probes, nss, pages_in);
      for (const LoadedPage& lp : pages_in) {
        for (const BlockPool* p : lp.page.pools) need += p->block_bytes();
      }
      release_loaded(pages_in);
    }
    if (need > free_bytes()) {
      ++counters.refusals;
      throw PoolFullError(detail::str_cat(fn, ": the index '", dir, "' holds ", pages_in.size(), " pages of ", need,
                                          " B of blocks but only ", free_bytes(), " B of the pool's capacity_bytes = ",
                                          cfg.capacity_bytes, " are free (a load reclaims nothing); nothing was "
                                          "changed: raise capacity_bytes or load into a cache with room"),
                          /*preempted=*/false);
    }
    // Pass 2: the same bytes into the shared pools (cannot fail but for memory), then the tree.
    const auto protos = namespaces(pools);
    read_index(file, fp, ppath, protos, nss, pages_in);
    int64_t added = 0;
    for (const RadixTree::Namespace& ns : nss) ns_configs.emplace(ns.key, protos.at(ns.key)->config());
    std::vector<int64_t> path;
    std::vector<size_t> chain;
    for (size_t i = 0; i < pages_in.size(); ++i) {
      LoadedPage& lp = pages_in[i];
      if (lp.parent < 0) chain.clear();
      chain.resize(static_cast<size_t>(lp.depth));
      chain.push_back(i);
      path.clear();
      for (size_t j : chain) path.insert(path.end(), pages_in[j].tokens.begin(), pages_in[j].tokens.end());
      if (disk) {
        const DiskKey parent = lp.parent < 0 ? root_key(lp.ns->key) : pages_in[static_cast<size_t>(lp.parent)].page.key;
        lp.page.key = chain_key(parent, lp.tokens.data(), lp.ns->page_tokens);
        lp.page.depth = lp.depth;
        lp.page.tokens = lp.tokens;
        lp.page.ns = &ns_configs.find(lp.ns->key)->first;
      }
      bool taken = false;
      tree.insert(*lp.ns, path.data(), static_cast<int64_t>(path.size()), [&](int64_t page) {
        KV_INTERNAL_ASSERT(page == lp.depth, "load_prefix_index: page ", page, " asked for at depth ", lp.depth);
        taken = true;
        const RadixTree::PageId id = next_page++;
        pages.emplace(id, std::move(lp.page));
        return id;
      });
      if (taken) {
        ++added;
      } else {
        for (size_t b = 0; b < lp.page.blocks.size(); ++b) lp.page.pools[b]->release(lp.page.blocks[b].id);
      }
    }
    peak = std::max(peak, in_use());
    return added;
  }

  void save_index(const std::string& dir, const std::string& fp) const {
    using namespace cache::snapio;
    const char* fn = "MultiSequenceCache::save_prefix_index";
    // Pages in pre-order: file order, each after its parent.
    std::vector<std::string> ns_keys;
    std::vector<int64_t> ns_page;
    std::map<std::string, uint32_t> ns_index;
    std::unordered_map<RadixTree::PageId, int64_t> ordinal;
    std::vector<std::string> payloads;
    tree.for_each_page_in_order([&](const RadixTree::Namespace& ns, RadixTree::PageId page, RadixTree::PageId parent,
                                    const int64_t* tokens) {
      auto it = ns_index.find(ns.key);
      if (it == ns_index.end()) {
        it = ns_index.emplace(ns.key, static_cast<uint32_t>(ns_keys.size())).first;
        ns_keys.push_back(ns.key);
        ns_page.push_back(ns.page_tokens);
      }
      const int64_t self = static_cast<int64_t>(payloads.size());
      ordinal[page] = self;
      std::string payload;
      Out o(payload);
      o.put<uint32_t>(it->second);
      o.put<int64_t>(parent < 0 ? -1 : ordinal.at(parent));
      o.bytes(tokens, static_cast<size_t>(ns.page_tokens) * sizeof(int64_t));
      put_page_lists(o, pages.at(page), formats_of(ns.key));
      payloads.push_back(std::move(payload));
    });
    std::string file = preamble(kIndexMagic, static_cast<uint32_t>(payloads.size() + 1));
    {
      std::string head;
      Out o(head);
      o.str(KVCACHE_VERSION_STRING);
      o.str(fp);
      for (int64_t v : {cfg.model.num_layers, cfg.model.num_q_heads, cfg.model.num_kv_heads, cfg.model.head_dim}) {
        o.put<int64_t>(v);
      }
      o.put<uint64_t>(ns_keys.size());
      for (size_t i = 0; i < ns_keys.size(); ++i) {
        o.str(ns_keys[i]);
        o.put<int64_t>(ns_page[i]);
      }
      o.put<uint64_t>(payloads.size());
      put_section(file, "HEAD", 0, head);
    }
    for (size_t i = 0; i < payloads.size(); ++i) put_section(file, "PAGE", static_cast<uint32_t>(i + 1), payloads[i]);
    const uint64_t sum = xxh3(file.data(), file.size());
    const std::string name = "pages-" + hex16(sum) + ".kvidx";
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      throw SnapshotError(Reason::kIo, detail::str_cat(fn, ": cannot create the directory '", dir, "': ",
                                                       std::strerror(errno), " (io)"));
    }
    cache::write_snapshot(dir + "/" + name, file, fn);
    std::string manifest = preamble(kManifestMagic, 1);
    {
      std::string body;
      Out o(body);
      o.str(KVCACHE_VERSION_STRING);
      o.str(fp);
      o.str(name);
      o.put<uint64_t>(file.size());
      o.put<uint64_t>(sum);
      put_section(manifest, "MANI", 0, body);
    }
    try {
      cache::write_snapshot(dir + "/" + kManifestName, manifest, fn);
    } catch (...) {
      std::remove((dir + "/" + name).c_str());  // unreferenced: the previous manifest and its file stand
      throw;
    }
    // The previous pages files are unreferenced now (best effort: a leftover is harmless).
    if (DIR* d = ::opendir(dir.c_str())) {
      std::vector<std::string> stale;
      while (const dirent* e = ::readdir(d)) {
        const std::string n = e->d_name;
        if (n != name && n.rfind("pages-", 0) == 0 && n.size() > 6 && n.compare(n.size() - 6, 6, ".kvidx") == 0) {
          stale.push_back(n);
        }
      }
      ::closedir(d);
      for (const auto& n : stale) std::remove((dir + "/" + n).c_str());
    }
  }

  Sequence::State& state_of(Sequence& seq, const char* fn) {
    for (auto& q : seqs) {
      if (q.get() == &seq) return *q->s_;
    }
    throw InvalidArgument(detail::str_cat(fn, ": the sequence is not one of this cache's"));
  }

  /// Blocks by (pool, id): holders and the most live slots any holder sees (stats, checks).
  struct BlockInfo {
    int64_t refs = 0, max_live = 0;
    bool indexed = false, unlocked_page = false;
  };
  std::map<std::pair<const BlockPool*, cache::BlockId>, BlockInfo> census(int64_t* logical_slots) const {
    std::map<std::pair<const BlockPool*, cache::BlockId>, BlockInfo> blocks;
    int64_t logical = 0;
    for (const auto& q : seqs) {
      const StepProtocol& m = *q->s_->m;
      for (int64_t l = 0; l < m.config().num_layers; ++l) {
        const LayerStore& store = m.store().store(l);
        for (int64_t h = 0; h < store.num_heads(); ++h) {
          for (const BlockList* list : {&store.k(h).quant, &store.k(h).resid, &store.v(h).quant, &store.v(h).resid}) {
            for (const Block& b : list->blocks()) {
              BlockInfo& info = blocks[{list->format(b).pool, b.id}];
              ++info.refs;
              info.max_live = std::max<int64_t>(info.max_live, b.live);
              logical += b.live;
            }
          }
        }
      }
    }
    tree.for_each_page([&](RadixTree::PageId id, bool locked) {
      const CachedPage& p = pages.at(id);
      for (size_t i = 0; i < p.blocks.size(); ++i) {
        BlockInfo& info = blocks[{p.pools[i], p.blocks[i].id}];
        ++info.refs;
        info.max_live = std::max<int64_t>(info.max_live, p.blocks[i].filled);
        info.indexed = true;
        info.unlocked_page = info.unlocked_page || !locked;
      }
    });
    if (logical_slots != nullptr) *logical_slots = logical;
    return blocks;
  }
};

void Sequence::State::before_append(int64_t bytes) { cache->make_room(*this, bytes); }
void Sequence::State::before_evict(int64_t bytes) { cache->make_room(*this, bytes); }

// ---------------------------------------------------------------- Sequence
Sequence::Sequence(std::unique_ptr<cache::StepProtocol> steps, std::unique_ptr<State> state)
    : SequenceCache(std::move(steps)), s_(std::move(state)) {
  s_->m = &this->steps();
}
Sequence::~Sequence() = default;

int64_t Sequence::id() const { return s_->id; }
bool Sequence::preempted() const { return s_->preempted; }

void Sequence::save(const std::string& path, const std::string& model_fingerprint,
                    const std::vector<int64_t>& tokens) const {
  KV_CHECK_ARG(!s_->preempted, "Sequence::save: sequence ", id(),
               " was preempted (its blocks went back to the pool): nothing to save");
  cache::write_snapshot(path, steps().snapshot(model_fingerprint, tokens), "Sequence::save");
}

void Sequence::save(std::ostream& out, const std::string& model_fingerprint,
                    const std::vector<int64_t>& tokens) const {
  KV_CHECK_ARG(!s_->preempted, "Sequence::save: sequence ", id(),
               " was preempted (its blocks went back to the pool): nothing to save");
  cache::write_snapshot(out, steps().snapshot(model_fingerprint, tokens), "Sequence::save");
}

std::vector<int64_t> Sequence::load(const std::string& path, const std::string& model_fingerprint) {
  const std::string bytes = read_snapshot_file(path, "snapshot", "Sequence::load");
  return load_bytes(bytes, model_fingerprint, path);
}

std::vector<int64_t> Sequence::load(std::istream& in, const std::string& model_fingerprint) {
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) {
    throw SnapshotError(SnapshotError::Reason::kIo,
                        detail::str_cat("Sequence::load: the stream failed after ", bytes.size(), " bytes (io)"));
  }
  return load_bytes(bytes, model_fingerprint, "<stream>");
}

std::vector<int64_t> Sequence::load_bytes(const std::string& bytes, const std::string& model_fingerprint,
                                          const std::string& source) {
  State& s = *s_;
  std::vector<int64_t> tokens;
  std::unique_ptr<cache::StepProtocol> loaded = s.cache->load_sequence(s, bytes, model_fingerprint, source, &tokens);
  // Nothing below throws: the old protocol (reset by end_request, holding no block) goes.
  replace_steps(std::move(loaded));
  s.m = &steps();
  s.cow_seen = s.m->cow_copies();
  s.preempted = false;
  s.serial = s.cache->next_serial++;
  s.cache->after(s);
  return tokens;
}

const PrefixMatch& Sequence::prefix() const { return s_->match; }

PrefixReuse Sequence::begin_request(const std::vector<int64_t>& prompt, int64_t context_length) {
  State& s = *s_;
  KV_CHECK_ARG(context_length >= static_cast<int64_t>(prompt.size()), "Sequence::begin_request: context_length ",
               context_length, " is shorter than the prompt of ", prompt.size(), " tokens");
  s.m->reset(context_length);  // all-or-nothing: below, nothing throws for valid state
  auto& c = *s.cache;
  c.unlock(s);
  s.preempted = false;
  s.prompt = prompt;
  s.published = 0;
  s.publishing = false;
  s.match = PrefixMatch{};
  s.serial = c.next_serial++;
  c.reuse(s);
  c.after(s);
  return PrefixReuse{s.match.cached_tokens, s.match.cached_tokens > 0 ? s.match.min_first_step : 0};
}

void Sequence::reset(int64_t context_length) {
  State& s = *s_;
  s.m->reset(context_length);
  auto& c = *s.cache;
  c.unlock(s);
  s.preempted = false;
  s.prompt.clear();
  s.published = 0;
  s.publishing = false;
  s.match = PrefixMatch{};
  s.serial = c.next_serial++;
  c.after(s);
}

void Sequence::finish() {
  State& s = *s_;
  s.cache->end_request(s);
  s.preempted = false;
  s.serial = -1;
  s.cache->after(s);
}

int64_t Sequence::next_position(int64_t layer) const {
  s_->check_live("Sequence::next_position");
  return s_->m->next_position(layer);
}

void Sequence::append(int64_t layer, const TensorView& k, const TensorView& v, const TensorView& positions) {
  s_->check_live("Sequence::append");
  s_->m->append(layer, k, v, positions);
  s_->cache->after(*s_);
}

void Sequence::attend(int64_t layer, const TensorView& q, const TensorView& q_positions,
                      const MutableTensorView& out) {
  s_->check_live("Sequence::attend");
  s_->m->attend(layer, q, q_positions, out);
}

void Sequence::end_step(StepKind step) {
  s_->check_live("Sequence::end_step");
  auto& c = *s_->cache;
  // The settled prompt pages are taken (referenced) before the step evicts, so that its
  // eviction copies them on write, and enter the index only once the step succeeded.
  MultiSequenceCache::Impl::PendingPublish pp = c.plan_publish(*s_);
  try {
    s_->m->end_step(step);
  } catch (...) {
    c.abort_publish(pp);
    throw;
  }
  c.commit_publish(*s_, pp);
  c.after(*s_);
}

void Sequence::begin_replay() {
  throw UnsupportedError(detail::str_cat("Sequence::begin_replay: sequence ", s_->id,
                                         " of a MultiSequenceCache runs no context replay (a CacheManager does)"));
}

int64_t Sequence::blocks_copied() const { return s_->m->cow_copies(); }

// ---------------------------------------------------------------- MultiSequenceCache
MultiSequenceCache::MultiSequenceCache(MultiSequenceConfig config) : impl_(std::make_unique<Impl>()) {
  config.validate();
  impl_->cfg = std::move(config);
  impl_->open_disk_tier();
}

MultiSequenceCache::~MultiSequenceCache() = default;

const MultiSequenceConfig& MultiSequenceCache::config() const { return impl_->cfg; }

Sequence& MultiSequenceCache::add_sequence() { return add_sequence(impl_->cfg.model); }

Sequence& MultiSequenceCache::add_sequence(CacheConfig config) {
  const CacheConfig& g = impl_->cfg.model;
  for (const auto& [mine, theirs, name] :
       {std::tuple<int64_t, int64_t, const char*>{config.num_layers, g.num_layers, "num_layers"},
        {config.num_q_heads, g.num_q_heads, "num_q_heads"},
        {config.num_kv_heads, g.num_kv_heads, "num_kv_heads"},
        {config.head_dim, g.head_dim, "head_dim"}}) {
    KV_CHECK_ARG(mine == theirs, "MultiSequenceCache::add_sequence: CacheConfig.", name, " = ", mine,
                 " but the cache's sequences have ", theirs, " (MultiSequenceConfig::model)");
  }
  config.rope = g.rope;
  KV_CHECK_ARG(!make_eviction_policy(config.policy)->replay_need().any(), "MultiSequenceCache::add_sequence: policy '",
               config.policy, "' scores by a context replay (KVzip), which a Sequence does not run; use a CacheManager");
  auto st = std::make_unique<Sequence::State>();
  st->cache = impl_.get();
  st->id = impl_->next_id;
  auto steps = std::make_unique<cache::StepProtocol>(std::move(config), impl_->pools, st.get());
  Sequence::State& state = *st;
  impl_->seqs.push_back(std::unique_ptr<Sequence>(new Sequence(std::move(steps), std::move(st))));
  impl_->classify(state);
  ++impl_->next_id;
  return *impl_->seqs.back();
}

void MultiSequenceCache::remove_sequence(Sequence& seq) {
  Sequence::State& s = impl_->state_of(seq, "MultiSequenceCache::remove_sequence");
  impl_->unlock(s);
  auto& v = impl_->seqs;
  v.erase(std::find_if(v.begin(), v.end(), [&](const auto& q) { return q.get() == &seq; }));
}

int64_t MultiSequenceCache::num_sequences() const { return static_cast<int64_t>(impl_->seqs.size()); }

Sequence& MultiSequenceCache::sequence(int64_t id) {
  for (auto& q : impl_->seqs) {
    if (q->id() == id) return *q;
  }
  throw InvalidArgument(detail::str_cat("MultiSequenceCache::sequence: no sequence has id ", id, " (", num_sequences(),
                                        " sequences)"));
}

PrefixCounters MultiSequenceCache::counters() const { return impl_->counters; }

void MultiSequenceCache::save_prefix_index(const std::string& dir, const std::string& model_fingerprint) const {
  impl_->save_index(dir, model_fingerprint);
}

int64_t MultiSequenceCache::load_prefix_index(const std::string& dir, const std::string& model_fingerprint) {
  return impl_->load_index(dir, model_fingerprint);
}

int64_t MultiSequenceCache::reclaim(int64_t bytes) {
  KV_CHECK_ARG(bytes >= 0, "MultiSequenceCache::reclaim: bytes must be >= 0, got ", bytes);
  return impl_->reclaim(bytes);
}

void MultiSequenceCache::reset_peak() { impl_->peak = impl_->in_use(); }

PoolStats MultiSequenceCache::stats() const {
  const Impl& im = *impl_;
  PoolStats st;
  st.capacity_bytes = im.cfg.capacity_bytes;
  st.bytes_in_use = im.in_use();
  st.bytes_in_use_peak = std::max(im.peak, st.bytes_in_use);
  int64_t logical = 0, unique = 0;
  for (const auto& [key, info] : im.census(&logical)) {
    unique += info.max_live;
    if (info.indexed) {
      ++st.cached_blocks;
      if (info.refs == 1) st.bytes_cached += key.first->block_bytes();
    }
  }
  for (const auto& q : im.seqs) st.running_sequences += q->s_->m->stats().bytes_reserved > 0;
  const double per_token = 2.0 * static_cast<double>(im.cfg.model.num_kv_heads);
  st.logical_tokens = static_cast<double>(logical) / per_token;
  st.unique_tokens = static_cast<double>(unique) / per_token;
  st.sharing_ratio = unique > 0 ? static_cast<double>(logical) / static_cast<double>(unique) : 0.0;
  return st;
}

void MultiSequenceCache::check_invariants() const {
  const Impl& im = *impl_;
  std::vector<const RadixTree::Node*> locks;
  for (const auto& q : im.seqs) {
    q->s_->m->check_invariants();
    if (q->s_->locked != nullptr) locks.push_back(q->s_->locked);
  }
  im.tree.check(locks);
  KV_CHECK(static_cast<int64_t>(im.pages.size()) == im.tree.num_pages(), InternalError,
           "MultiSequenceCache invariant violated: ", im.pages.size(), " cached pages, the index holds ",
           im.tree.num_pages());
  std::map<const BlockPool*, int64_t> distinct;
  for (const auto& [key, info] : im.census(nullptr)) {
    const int32_t rc = key.first->refcount(key.second);
    KV_CHECK(rc == info.refs, InternalError, "MultiSequenceCache invariant violated: block ", key.second, " of the ",
             key.first->block_bytes(), " B pool has reference count ", rc, " but ", info.refs, " holders");
    KV_CHECK(!info.unlocked_page || info.refs == 1, InternalError, "MultiSequenceCache invariant violated: block ",
             key.second, " of an unused cached page is also held by a sequence");
    ++distinct[key.first];
  }
  for (const auto& [bytes, p] : im.pools->pools()) {
    KV_CHECK(p->blocks_in_use() == distinct[p.get()], InternalError, "MultiSequenceCache invariant violated: the ",
             bytes, " B pool has ", p->blocks_in_use(), " blocks in use but ", distinct[p.get()], " are held");
  }
  KV_CHECK(im.in_use() <= im.cfg.capacity_bytes, InternalError, "MultiSequenceCache invariant violated: ", im.in_use(),
           " B in use beyond capacity_bytes = ", im.cfg.capacity_bytes);
}

}  // namespace kvcache

// ---------------------------------------------------------------- introspection
namespace kvcache::cache {

const cache::StepProtocol& MultiSequenceAccess::steps(const Sequence& seq) { return *seq.s_->m; }
std::string MultiSequenceAccess::storage_key(const Sequence& seq) { return seq.s_->ns.key; }

std::vector<MultiSequenceAccess::BlockBytes> MultiSequenceAccess::cached_blocks(const MultiSequenceCache& c) {
  std::vector<BlockBytes> out;
  for (const auto& [id, p] : c.impl_->pages) {
    for (size_t i = 0; i < p.blocks.size(); ++i) out.push_back({p.pools[i]->data(p.blocks[i].id), p.pools[i]->block_bytes()});
  }
  return out;
}

}  // namespace kvcache::cache
