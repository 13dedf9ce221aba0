// SPDX-License-Identifier: Apache-2.0
// MultiSequenceCache (kvcache/multi_sequence_cache.h): each sequence is a StepProtocol over a
// SequenceStore whose blocks come from one shared PoolSet (step_protocol.h, sequence_store.h);
// the prefix index is a RadixTree whose pages hold references to the blocks of a prompt's whole
// blocks, for every layer, KV head and stream. The state is in multi_sequence_impl.h; the prefix
// index directory, the disk tier and Sequence snapshots are in multi_sequence_persist.cpp.
#include "kvcache/multi_sequence_cache.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <utility>

#include "cache/multi_sequence_access.h"
#include "cache/multi_sequence_impl.h"
#include "cache/step_protocol.h"
#include "common/log.h"
#include "kvcache/error.h"

namespace kvcache::cache::msc {

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

bool sealed(const BlockList& list, const Block& b) {
  return b.format == StreamFormats::kMain && b.filled == list.format(b).capacity && b.live == b.filled &&
         b.dead.empty() && b.pos.empty();
}

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
using cache::msc::root_key;
using cache::msc::settled_pages;
using cache::msc::storage_key;

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

// ---------------------------------------------------------------- MultiSequenceCache::Impl
MultiSequenceCache::Impl::~Impl() {
  seqs.clear();  // their blocks first, then the index's
  for (auto& [id, p] : pages) {
    for (size_t i = 0; i < p.blocks.size(); ++i) p.pools[i]->release(p.blocks[i].id);
  }
  if (disk) {
    for (const auto& [key, e] : disk->entries) std::remove(e.path.c_str());
  }
}

void MultiSequenceCache::Impl::after(Sequence::State& s) {
  peak = std::max(peak, in_use());
  const int64_t cow = s.m->cow_copies();
  counters.blocks_copied += cow - s.cow_seen;
  s.cow_seen = cow;
}

void MultiSequenceCache::Impl::release_page(RadixTree::PageId id) {
  auto it = pages.find(id);
  KV_INTERNAL_ASSERT(it != pages.end(), "release of page ", id);
  const CachedPage& p = it->second;
  for (size_t i = 0; i < p.blocks.size(); ++i) {
    p.pools[i]->release(p.blocks[i].id);
    if (p.pools[i]->refcount(p.blocks[i].id) == 0) ++counters.blocks_reclaimed;
  }
  pages.erase(it);
}

int64_t MultiSequenceCache::Impl::reclaim(int64_t bytes) {
  const int64_t before = in_use();
  tree.evict([&] { return before - in_use() >= bytes; }, [&](RadixTree::PageId p) {
    if (disk) spill(p);
    release_page(p);
  });
  return before - in_use();
}

void MultiSequenceCache::Impl::unlock(Sequence::State& s) {
  if (s.locked != nullptr) tree.unlock(s.locked);
  s.locked = nullptr;
}

void MultiSequenceCache::Impl::end_request(Sequence::State& s) {
  s.m->reset(s.m->config().context_length);  // a context it was valid for: cannot throw
  unlock(s);
  s.prompt.clear();
  s.published = 0;
  s.publishing = false;
  s.match = PrefixMatch{};
}

void MultiSequenceCache::Impl::preempt(Sequence::State& v, const Sequence::State& who, int64_t bytes) {
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

int64_t MultiSequenceCache::Impl::reachable_free(const Sequence::State& s, bool preempt, int64_t* victims_out,
                                                 bool self) {
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

void MultiSequenceCache::Impl::make_room(Sequence::State& s, int64_t bytes) {
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

void MultiSequenceCache::Impl::classify(Sequence::State& s) {
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

void MultiSequenceCache::Impl::reuse(Sequence::State& s) {
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

MultiSequenceCache::Impl::PendingPublish MultiSequenceCache::Impl::plan_publish(Sequence::State& s) {
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

void MultiSequenceCache::Impl::retain_page(PendingPublish& pp, int64_t page) {
  for (size_t i = 0; i < pp.blocks.size(); ++i) {
    for (const Block& b : pp.blocks[i][static_cast<size_t>(page - pp.b0)]) pp.lists[i]->format(b).pool->retain(b.id);
  }
  pp.retained[static_cast<size_t>(page - pp.b0)] = true;
}

void MultiSequenceCache::Impl::release_page(PendingPublish& pp, int64_t page) {
  for (size_t i = 0; i < pp.blocks.size(); ++i) {
    for (const Block& b : pp.blocks[i][static_cast<size_t>(page - pp.b0)]) pp.lists[i]->format(b).pool->release(b.id);
  }
  pp.retained[static_cast<size_t>(page - pp.b0)] = false;
}

void MultiSequenceCache::Impl::abort_publish(PendingPublish& pp) {
  for (int64_t page = pp.b0; page < pp.b0 + pp.settled; ++page) {
    if (pp.retained[static_cast<size_t>(page - pp.b0)]) release_page(pp, page);
  }
}

void MultiSequenceCache::Impl::commit_publish(Sequence::State& s, PendingPublish& pp) {
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

Sequence::State& MultiSequenceCache::Impl::state_of(Sequence& seq, const char* fn) {
  for (auto& q : seqs) {
    if (q.get() == &seq) return *q->s_;
  }
  throw InvalidArgument(detail::str_cat(fn, ": the sequence is not one of this cache's"));
}

std::map<std::pair<const BlockPool*, cache::BlockId>, MultiSequenceCache::Impl::BlockInfo>
MultiSequenceCache::Impl::census(int64_t* logical_slots) const {
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
