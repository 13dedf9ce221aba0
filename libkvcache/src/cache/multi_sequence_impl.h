// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file multi_sequence_impl.h (internal)
/// The state behind MultiSequenceCache (kvcache/multi_sequence_cache.h): Sequence::State and
/// MultiSequenceCache::Impl, shared by multi_sequence_cache.cpp (sequences, the pool, the prefix
/// index: reuse, publication, reclaim, preemption) and multi_sequence_persist.cpp (the prefix
/// index directory, the disk tier, Sequence snapshots). Not part of the public API.

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cache/block_list.h"
#include "cache/layer_store.h"
#include "cache/pool_set.h"
#include "cache/radix_tree.h"
#include "cache/snapshot_io.h"
#include "cache/step_protocol.h"
#include "kvcache/error.h"
#include "kvcache/multi_sequence_cache.h"

namespace kvcache::cache::msc {

/// A page's key on the disk tier (chain_key()).
using DiskKey = std::pair<uint64_t, uint64_t>;

/// The blocks one page (P prompt tokens) holds in every block list: list i = (layer · H_kv +
/// head) · 2 + stream (0 = K, 1 = V) has blocks[start[i] .. start[i + 1]).
struct CachedPage {
  std::vector<Block> blocks;
  std::vector<BlockPool*> pools;  ///< per block
  std::vector<uint32_t> start;
  // With a disk tier (MultiSequenceConfig::disk_tier_dir) only: what a spill writes.
  DiskKey key{0, 0};                ///< chain_key() of its path
  int64_t depth = -1;               ///< its page index in the path (−1: no disk tier)
  std::vector<int64_t> tokens;      ///< its own P token ids
  const std::string* ns = nullptr;  ///< its namespace (a key of Impl::ns_configs)
};

/// The magic of a page spilled to the disk tier.
inline constexpr char kDiskPageMagic[8] = {'\x89', 'K', 'V', 'P', 'A', 'G', 'E', '\n'};

/// The disk tier's key of a page: XXH3-128 chained over the namespace key and every page of the
/// path — h(ns) for the root, then h(parent's key ‖ the page's P token ids) — as vLLM's block
/// hashes; a spilled file also holds the page's own tokens and depth, checked on read.
DiskKey chain_key(const DiskKey& parent, const int64_t* tokens, int64_t n);
/// The disk tier's key of a namespace (the root of its chains).
DiskKey root_key(const std::string& ns);

/// Everything that changes the bytes a configuration stores for the same tokens: the index's
/// namespace. (A CacheConfig field added later that changes stored bytes belongs here.)
std::string storage_key(const StepProtocol& m);

/// A block a page may hold: full, in the stream's main format, no holes, implicit positions.
bool sealed(const BlockList& list, const Block& b);

/// Pages [b0, b1) of P tokens settled in `list` (held by sealed quantized blocks exactly
/// covering them), from b0 on: their blocks go to out[page − b0]. *irregular is set when a
/// block there can never be shared (holes, a merge, the fp32 fallback).
int64_t settled_pages(const BlockList& list, int64_t P, int64_t b0, int64_t b1, std::vector<std::vector<Block>>& out,
                      bool* irregular);

/// Bytes of the blocks `m` holds (each block's pool size).
int64_t held_bytes(const StepProtocol& m);

/// The largest snapshot or prefix index pages file read (64 GiB, as CacheManager::load).
inline constexpr int64_t kMaxSnapshotBytes = int64_t{64} << 30;
inline constexpr const char* kManifestName = "MANIFEST";

/// The file at `path` (at most kMaxSnapshotBytes); SnapshotError (kIo) naming `fn` when it cannot be read.
std::string read_snapshot_file(const std::string& path, const char* what, const char* fn);
/// `v` as 16 lower-case hex digits.
std::string hex16(uint64_t v);

}  // namespace kvcache::cache::msc

namespace kvcache {

struct Sequence::State final : cache::StepHooks {
  MultiSequenceCache::Impl* cache = nullptr;
  int64_t id = 0;
  cache::StepProtocol* m = nullptr;  ///< the sequence's steps (owned by its SequenceCache)
  cache::RadixTree::Namespace ns;     ///< key "" = never shared (not_shared says why)
  std::string not_shared;
  int64_t granularity = 0;    ///< reused prefixes are multiples of this (block size, block-flush R)
  int64_t min_step = 0;       ///< the largest sliding residual: the first step after a reused prefix
  std::vector<int64_t> prompt;
  int64_t published = 0;      ///< prompt pages in the index through this request (adopted or inserted)
  bool publishing = false;
  cache::RadixTree::Node* locked = nullptr;
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
  using Block = cache::Block;
  using BlockList = cache::BlockList;
  using BlockPool = cache::BlockPool;
  using LayerStore = cache::LayerStore;
  using RadixTree = cache::RadixTree;
  using StepProtocol = cache::StepProtocol;
  using StreamFormats = cache::StreamFormats;
  using CachedPage = cache::msc::CachedPage;
  using DiskKey = cache::msc::DiskKey;

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

  // ---- the disk tier (multi_sequence_persist.cpp) -------------------------------------
  void open_disk_tier();

  void drop_disk_entry(std::map<DiskKey, DiskEntry>::iterator it);

  void touch(DiskEntry& e) { disk->lru.splice(disk->lru.end(), disk->lru, e.lru); }

  /// A page about to be reclaimed, written to the disk tier when its blocks are about to be
  /// freed (no sequence holds them) and it is not there already. A write that fails counts in
  /// disk_failures and is dropped (the page is lost, as without a tier).
  void spill(RadixTree::PageId id);

  /// Reads entry `e` as page `depth` of s's prompt (key `key`) into `out` (blocks of s's
  /// formats from the shared pool), checking framing, checksums, key, namespace, depth, tokens
  /// and every block. false (nothing held) when any of it fails.
  bool read_disk_page(const Sequence::State& s, const DiskEntry& e, const DiskKey& key, int64_t depth,
                      CachedPage& out);

  /// Extends `hit` (s's match in memory) with the pages that follow it on the disk tier, as far
  /// as a reuse could use them (≥ max(1, min_step) prompt tokens left to compute): each is read,
  /// checked and inserted into the index as a cached page (room made by reclaiming, the path
  /// pinned meanwhile). A missing or corrupt file ends the extension (disk_failures).
  void extend_from_disk(Sequence::State& s, RadixTree::Match& hit);

  // ---- the pool (multi_sequence_cache.cpp, as the prefix index below) ------------------
  ~Impl();

  int64_t in_use() const { return pools->bytes_in_use(); }
  int64_t free_bytes() const { return cfg.capacity_bytes - in_use(); }

  /// After a call that may have changed the pool or copied blocks.
  void after(Sequence::State& s);

  void release_page(RadixTree::PageId id);

  int64_t reclaim(int64_t bytes);

  void unlock(Sequence::State& s);

  /// Ends s's request in place (its blocks go back; what it published stays cached).
  void end_request(Sequence::State& s);

  void preempt(Sequence::State& v, const Sequence::State& who, int64_t bytes);

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
  int64_t reachable_free(const Sequence::State& s, bool preempt, int64_t* victims_out, bool self = false);

  /// Makes `bytes` free for s's next allocation, or throws PoolFullError (PoolFullRule). Plans
  /// first: a call that cannot fit even after reclaiming every unused cached page (and, under
  /// kPreemptNewest, preempting every newer request) is refused before anything is reclaimed or
  /// preempted, so a refused call changes nothing.
  void make_room(Sequence::State& s, int64_t bytes);

  // ---- prefix index -------------------------------------------------------------------
  /// Sets s's namespace, granularity and first-step rule from its configuration.
  void classify(Sequence::State& s);

  /// The longest reusable cached prefix of s.prompt, adopted into s.m (freshly reset).
  void reuse(Sequence::State& s);

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
  PendingPublish plan_publish(Sequence::State& s);

  void retain_page(PendingPublish& pp, int64_t page);

  void release_page(PendingPublish& pp, int64_t page);

  /// A refused end_step: the references taken by plan_publish go back; nothing else was touched.
  void abort_publish(PendingPublish& pp);

  /// Inserts the planned pages into the index (after the sequence's end_step succeeded).
  void commit_publish(Sequence::State& s, PendingPublish& pp);

  // ---- snapshots and the prefix index directory (multi_sequence_persist.cpp) ----------
  /// Sequence::load: every check of `bytes` in blocks of a private pool, then room (ending s's
  /// request, reclaiming unused prefixes), then the same bytes read into the shared pool. The
  /// caller swaps the returned protocol in.
  std::unique_ptr<StepProtocol> load_sequence(Sequence::State& s, const std::string& bytes, const std::string& fp,
                                              const std::string& source, std::vector<int64_t>* tokens);

  /// The namespaces a load may fill: the storage key of config().model and of every sequence's
  /// configuration, each with a protocol over `over` (null: pools of its own) whose formats read
  /// the pages' blocks.
  std::map<std::string, std::unique_ptr<StepProtocol>> namespaces(const std::shared_ptr<cache::PoolSet>& over) const;

  /// A page read from an index file: its namespace, parent (file order), depth and tokens, and
  /// its blocks (one reference each, taken from the formats' pools).
  struct LoadedPage {
    const RadixTree::Namespace* ns = nullptr;
    int64_t parent = -1, depth = 0;
    std::vector<int64_t> tokens;
    CachedPage page;
  };

  static void release_loaded(std::vector<LoadedPage>& pages);

  /// Reads a page's block lists (every layer, KV head, K then V: u32 count, block records) into
  /// `page` — blocks of `m`'s formats, each with one reference the page holds — checking that
  /// they are sealed and cover exactly positions [depth · P, (depth + 1) · P). On a failed
  /// check the blocks already in `page` stay there (the caller releases them).
  static void read_page_lists(cache::snapio::In& in, const StepProtocol& m, int64_t depth, int64_t P,
                              CachedPage& page, const std::string& where, const std::string& source);

  /// Writes a page's block lists as read_page_lists() reads them; `proto` (a protocol of the
  /// page's namespace configuration) gives the blocks' formats.
  static void put_page_lists(cache::snapio::Out& o, const CachedPage& p, const StepProtocol& proto);

  /// A protocol of namespace `ns`'s configuration over pools of its own: its formats read and
  /// write the namespace's pages (a page keeps its blocks' pools, not their formats, which are
  /// those of the sequence that published it and may be gone).
  const StepProtocol& formats_of(const std::string& ns) const;

  /// Reads and checks the pages of `file` (framed, kIndexMagic) into blocks of the formats of
  /// `protos` (by namespace key). On a failed check every block taken is given back.
  void read_index(const std::string& file, const std::string& fp, const std::string& source,
                  const std::map<std::string, std::unique_ptr<StepProtocol>>& protos,
                  std::vector<RadixTree::Namespace>& nss, std::vector<LoadedPage>& out) const;

  int64_t load_index(const std::string& dir, const std::string& fp);

  void save_index(const std::string& dir, const std::string& fp) const;

  // ---- bookkeeping (multi_sequence_cache.cpp) -----------------------------------------
  Sequence::State& state_of(Sequence& seq, const char* fn);

  /// Blocks by (pool, id): holders and the most live slots any holder sees (stats, checks).
  struct BlockInfo {
    int64_t refs = 0, max_live = 0;
    bool indexed = false, unlocked_page = false;
  };
  std::map<std::pair<const BlockPool*, cache::BlockId>, BlockInfo> census(int64_t* logical_slots) const;
};

}  // namespace kvcache
