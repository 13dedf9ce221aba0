// SPDX-License-Identifier: Apache-2.0
// MultiSequenceCache's persistence (kvcache/multi_sequence_cache.h, docs/snapshot-format.md): the
// prefix index directory (save_prefix_index / load_prefix_index), the disk tier under the pool
// (MultiSequenceConfig::disk_tier_dir: spilling reclaimed pages, reading them back) and a
// sequence's snapshots (Sequence::save / load), over the state of multi_sequence_impl.h.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <istream>
#include <iterator>
#include <map>

#include "cache/multi_sequence_impl.h"
#include "cache/snapshot_io.h"
#include "common/file_io.h"
#include "common/log.h"
#include "kvcache/error.h"

namespace kvcache::cache::msc {

DiskKey chain_key(const DiskKey& parent, const int64_t* tokens, int64_t n) {
  std::string buf(16 + static_cast<size_t>(n) * sizeof(int64_t), '\0');
  std::memcpy(&buf[0], &parent.first, 8);
  std::memcpy(&buf[8], &parent.second, 8);
  std::memcpy(&buf[16], tokens, static_cast<size_t>(n) * sizeof(int64_t));
  const XXH128_hash_t h = XXH3_128bits(buf.data(), buf.size());
  return {h.low64, h.high64};
}

DiskKey root_key(const std::string& ns) {
  const XXH128_hash_t h = XXH3_128bits(ns.data(), ns.size());
  return {h.low64, h.high64};
}

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

}  // namespace kvcache::cache::msc

namespace kvcache {
namespace {

using cache::Block;
using cache::BlockList;
using cache::BlockPool;
using cache::LayerStore;
using cache::RadixTree;
using cache::StepProtocol;
using cache::StreamFormats;
using cache::msc::CachedPage;
using cache::msc::DiskKey;
using cache::msc::chain_key;
using cache::msc::hex16;
using cache::msc::held_bytes;
using cache::msc::kDiskPageMagic;
using cache::msc::kManifestName;
using cache::msc::read_snapshot_file;
using cache::msc::root_key;
using cache::msc::sealed;
using cache::msc::storage_key;

}  // namespace

// ---------------------------------------------------------------- MultiSequenceCache::Impl
void MultiSequenceCache::Impl::open_disk_tier() {
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

void MultiSequenceCache::Impl::drop_disk_entry(std::map<DiskKey, DiskEntry>::iterator it) {
  std::remove(it->second.path.c_str());
  disk->used -= it->second.file_bytes;
  disk->lru.erase(it->second.lru);
  disk->entries.erase(it);
}

void MultiSequenceCache::Impl::spill(RadixTree::PageId id) {
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

bool MultiSequenceCache::Impl::read_disk_page(const Sequence::State& s, const DiskEntry& e, const DiskKey& key,
                                              int64_t depth, CachedPage& out) {
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

void MultiSequenceCache::Impl::extend_from_disk(Sequence::State& s, RadixTree::Match& hit) {
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

std::unique_ptr<StepProtocol> MultiSequenceCache::Impl::load_sequence(Sequence::State& s, const std::string& bytes,
                                                                      const std::string& fp, const std::string& source,
                                                                      std::vector<int64_t>* tokens) {
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

std::map<std::string, std::unique_ptr<StepProtocol>> MultiSequenceCache::Impl::namespaces(
    const std::shared_ptr<cache::PoolSet>& over) const {
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

void MultiSequenceCache::Impl::release_loaded(std::vector<LoadedPage>& pages) {
  for (LoadedPage& lp : pages) {
    for (size_t i = 0; i < lp.page.blocks.size(); ++i) lp.page.pools[i]->release(lp.page.blocks[i].id);
    lp.page.blocks.clear();
  }
}

void MultiSequenceCache::Impl::read_page_lists(cache::snapio::In& in, const StepProtocol& m, int64_t depth, int64_t P,
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

void MultiSequenceCache::Impl::put_page_lists(cache::snapio::Out& o, const CachedPage& p, const StepProtocol& proto) {
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

const StepProtocol& MultiSequenceCache::Impl::formats_of(const std::string& ns) const {
  auto& proto = format_protos[ns];
  if (!proto) {
    CacheConfig c = ns_configs.at(ns);
    c.context_length = 0;
    proto = std::make_unique<StepProtocol>(std::move(c), nullptr, nullptr);
  }
  return *proto;
}

void MultiSequenceCache::Impl::read_index(const std::string& file, const std::string& fp, const std::string& source,
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

int64_t MultiSequenceCache::Impl::load_index(const std::string& dir, const std::string& fp) {
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

void MultiSequenceCache::Impl::save_index(const std::string& dir, const std::string& fp) const {
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

// ---------------------------------------------------------------- Sequence
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

// ---------------------------------------------------------------- MultiSequenceCache
void MultiSequenceCache::save_prefix_index(const std::string& dir, const std::string& model_fingerprint) const {
  impl_->save_index(dir, model_fingerprint);
}

int64_t MultiSequenceCache::load_prefix_index(const std::string& dir, const std::string& model_fingerprint) {
  return impl_->load_index(dir, model_fingerprint);
}

}  // namespace kvcache
