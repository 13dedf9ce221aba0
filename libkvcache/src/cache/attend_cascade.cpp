// SPDX-License-Identifier: Apache-2.0
// A batched attention call's run (attend_cascade.h): the plan of shared-prefix passes per KV
// head, the passes and unshared heads as tasks over the threads, the merge of partial states.
#include "cache/attend_cascade.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <utility>

#include "common/parallel.h"

namespace kvcache::cache {
namespace {

/// One stream of one head of one request, its blocks in cache order.
struct Flat {
  std::vector<const BlockList*> lists;
  std::vector<const Block*> blocks;
  std::vector<int64_t> cum;  ///< cum[i]: live tokens of blocks [0, i)

  explicit Flat(const HeadStream& s) {
    StreamBlockWalk w(s);
    const BlockList* l = nullptr;
    const Block* b = nullptr;
    cum.push_back(0);
    while (w.next(&l, &b)) {
      lists.push_back(l);
      blocks.push_back(b);
      cum.push_back(cum.back() + b->live);
    }
  }
  size_t size() const { return blocks.size(); }
  /// Bytes of the blocks holding live tokens [first, first + count).
  int64_t bytes(int64_t first, int64_t count) const {
    int64_t n = 0;
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (cum[i + 1] > first && cum[i] < first + count) n += lists[i]->format(*blocks[i]).block_bytes;
    }
    return n;
  }
};

/// The same stored block as two holders see it: one pool block, and the same live slots and
/// positions (a holder's eviction marks holes in its own view of a shared block only).
bool same_block(const Flat& a, const Flat& b, size_t i) {
  const Block& x = *a.blocks[i];
  const Block& y = *b.blocks[i];
  return x.id == y.id && x.format == y.format && a.lists[i]->format(x).pool == b.lists[i]->format(y).pool &&
         x.filled == y.filled && x.live == y.live && x.pos0 == y.pos0 && x.dead == y.dead && x.pos == y.pos;
}

/// End of the run of identical blocks of a and b from block `from` on (blocks before it identical).
size_t same_run(const Flat& a, const Flat& b, size_t from) {
  size_t i = from;
  while (i < a.size() && i < b.size() && same_block(a, b, i)) ++i;
  return i;
}

/// What a pass reads besides the blocks: requests that differ here never share a pass.
std::string pass_key(const AttendArgs& a) {
  const LayerStore& L = *a.layer;
  std::string key = std::to_string(L.num_heads()) + "," + std::to_string(L.head_dim()) + "," +
                    std::to_string(a.num_q_heads / L.num_heads()) + (a.fused ? ",fused" : ",generic") +
                    (a.rope != nullptr ? ",pre-rope" : ",post-rope");
  for (const float sc : {L.k_scale(), L.v_scale()}) {
    uint32_t bits = 0;
    std::memcpy(&bits, &sc, sizeof bits);
    key += "," + std::to_string(bits);
  }
  for (const StreamSetup* st : {&L.key_setup(), &L.value_setup()}) {
    for (int64_t h = 0; h < L.num_heads(); ++h) {
      for (const BlockFormat& f : st->formats_for(h)->f) {
        key += f.quantizer != nullptr ? "|" + f.quantizer->spec() + ":" + std::to_string(f.capacity) : "|-";
      }
      if (st->head_formats.empty()) break;
    }
  }
  return key;
}

/// A pass over live tokens [first, first + count) of one KV head, for the rows of `members`
/// (request indices; member k's rows at row_at[k], token-major t·G + g).
struct Pass {
  int64_t head = 0;
  int leader = 0;
  int64_t first = 0, count = 0;
  std::vector<int> members;
  std::vector<int64_t> row_at;
  std::vector<float> q;
  std::vector<int64_t> pos;
  PartialState state;
};

/// A request's head covered by passes: (pass, first row) root first, its own pass last.
struct Chain {
  int request = 0;
  int64_t head = 0;
  std::vector<std::pair<size_t, int64_t>> passes;
  bool split = false;  ///< the runs of one long head split across threads (no sharing)
};

int64_t rows_of(const AttendArgs& a) { return a.t_q * (a.num_q_heads / a.layer->num_heads()); }

/// The plan of one KV head over one class of requests (same pass_key).
class HeadPlanner {
 public:
  HeadPlanner(const std::vector<BatchItem>& items, int64_t head, const std::vector<int>& members,
              std::vector<Pass>& passes)
      : items_(items), head_(head), passes_(passes) {
    for (const int r : members) {
      const LayerStore& L = *items[static_cast<size_t>(r)].args->layer;
      k_.emplace(r, Flat(L.k(head)));
      v_.emplace(r, Flat(L.v(head)));
    }
  }

  void plan(const std::vector<int>& members, size_t bk0, size_t bv0, int64_t s0) {
    const int lead = members[0];
    if (members.size() == 1) {
      add(members, s0, k_.at(lead).cum.back() - s0);
      return;
    }
    size_t bk = std::numeric_limits<size_t>::max(), bv = bk;
    for (size_t i = 1; i < members.size(); ++i) {
      bk = std::min(bk, same_run(k_.at(lead), k_.at(members[i]), bk0));
      bv = std::min(bv, same_run(v_.at(lead), v_.at(members[i]), bv0));
    }
    const int64_t p = shared(lead, bk, bv);
    if (p > s0) add(members, s0, p - s0);
    std::vector<int> rest = members;
    while (!rest.empty()) {
      const int l = rest[0];
      std::vector<int> sub{l}, other;
      for (size_t i = 1; i < rest.size(); ++i) {
        const int j = rest[i];
        const int64_t pj = shared(l, same_run(k_.at(l), k_.at(j), bk), same_run(v_.at(l), v_.at(j), bv));
        (pj > p ? sub : other).push_back(j);
      }
      plan(sub, bk, bv, p);
      rest = std::move(other);
    }
  }

 private:
  /// Live tokens in the first `bk` K blocks and `bv` V blocks of request r, whichever fewer.
  int64_t shared(int r, size_t bk, size_t bv) const {
    return std::min(k_.at(r).cum[bk], v_.at(r).cum[bv]);
  }

  void add(const std::vector<int>& members, int64_t first, int64_t count) {
    Pass p;
    p.head = head_;
    p.leader = members[0];
    p.first = first;
    p.count = count;
    p.members = members;
    int64_t rows = 0;
    for (const int r : members) {
      p.row_at.push_back(rows);
      rows += rows_of(*items_[static_cast<size_t>(r)].args);
    }
    passes_.push_back(std::move(p));
  }

  const std::vector<BatchItem>& items_;
  int64_t head_;
  std::vector<Pass>& passes_;
  std::map<int, Flat> k_, v_;
};

/// The stacked query rows of a pass: member rows token-major (t·G + g), their positions.
void stack_queries(const std::vector<BatchItem>& items, Pass& p) {
  const AttendArgs& lead = *items[static_cast<size_t>(p.leader)].args;
  const int64_t d = lead.layer->head_dim(), G = lead.num_q_heads / lead.layer->num_heads();
  int64_t rows = 0;
  for (const int r : p.members) rows += rows_of(*items[static_cast<size_t>(r)].args);
  p.q.resize(static_cast<size_t>(rows * d));
  p.pos.resize(static_cast<size_t>(rows));
  for (size_t k = 0; k < p.members.size(); ++k) {
    const AttendArgs& a = *items[static_cast<size_t>(p.members[k])].args;
    for (int64_t t = 0; t < a.t_q; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = p.row_at[k] + t * G + g;
        std::copy_n(a.q + ((p.head * G + g) * a.t_q + t) * d, d, p.q.data() + row * d);
        p.pos[static_cast<size_t>(row)] = a.q_pos[t];
      }
    }
  }
}

}  // namespace

void attend_items(const std::vector<BatchItem>& items, bool cascade, AttendBatchStats* stats) {
  if (stats != nullptr) *stats = AttendBatchStats{};
  for (const BatchItem& it : items) begin_attend(*it.args);

  // Plan: per class of requests that may share a pass, per KV head.
  std::vector<Pass> passes;
  if (cascade) {
    std::map<std::string, std::vector<int>> classes;
    for (size_t i = 0; i < items.size(); ++i) {
      if (items[i].shareable) classes[pass_key(*items[i].args)].push_back(static_cast<int>(i));
    }
    for (const auto& [key, members] : classes) {
      if (members.size() < 2) continue;
      const int64_t hkv = items[static_cast<size_t>(members[0])].args->layer->num_heads();
      for (int64_t h = 0; h < hkv; ++h) {
        // Only requests whose K streams start with the same block can share anything: the
        // planner (and its per-block lists) runs on those alone, so a batch that shares
        // nothing (CacheManagers: pools of their own) costs a lookup per request here.
        std::map<std::pair<const BlockPool*, BlockId>, std::vector<int>> by_first;
        for (const int r : members) {
          StreamBlockWalk w(items[static_cast<size_t>(r)].args->layer->k(h));
          const BlockList* l = nullptr;
          const Block* b = nullptr;
          if (w.next(&l, &b)) by_first[{l->format(*b).pool, b->id}].push_back(r);
        }
        for (const auto& [first, group] : by_first) {
          if (group.size() > 1) HeadPlanner(items, h, group, passes).plan(group, 0, 0, 0);
        }
      }
    }
  }
  // A (request, head) alone in its only pass, from token 0, is attended as attend() does.
  std::vector<Chain> chains;
  {
    std::map<std::pair<int, int64_t>, Chain> by_head;
    for (size_t i = 0; i < passes.size(); ++i) {
      for (size_t k = 0; k < passes[i].members.size(); ++k) {
        Chain& c = by_head[{passes[i].members[k], passes[i].head}];
        c.request = passes[i].members[k];
        c.head = passes[i].head;
        c.passes.emplace_back(i, passes[i].row_at[k]);
      }
    }
    std::vector<size_t> keep(passes.size(), 0);
    for (auto& [rh, c] : by_head) {
      if (c.passes.size() == 1) continue;  // shares nothing at this head
      for (const auto& pr : c.passes) keep[pr.first] = 1;
      chains.push_back(std::move(c));
    }
    std::vector<size_t> renum(passes.size());
    std::vector<Pass> kept;
    for (size_t i = 0; i < passes.size(); ++i) {
      renum[i] = kept.size();
      if (keep[i] != 0) kept.push_back(std::move(passes[i]));
    }
    passes = std::move(kept);
    for (Chain& c : chains) {
      for (auto& pr : c.passes) pr.first = renum[pr.first];
    }
  }
  std::vector<std::vector<char>> covered(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    covered[i].assign(static_cast<size_t>(items[i].args->layer->num_heads()), 0);
  }
  for (const Chain& c : chains) covered[static_cast<size_t>(c.request)][static_cast<size_t>(c.head)] = 1;
  // A long head that attend() would split across the threads (fewer KV heads than threads:
  // split_parts) is split here the same way — its runs (split_points) passes of its own, merged
  // in run order by the chains' merge below — so that the request gets attend()'s bits.
  const int64_t threads = attend_threads();
  for (size_t i = 0; i < items.size(); ++i) {
    const AttendArgs& a = *items[i].args;
    const int64_t parts = split_parts(a, threads);
    if (parts < 2) continue;
    for (int64_t h = 0; h < a.layer->num_heads(); ++h) {
      if (covered[i][static_cast<size_t>(h)] != 0) continue;
      const std::vector<int64_t> cuts = split_points(*a.layer, h, parts);
      Chain c;
      c.request = static_cast<int>(i);
      c.head = h;
      c.split = true;
      for (int64_t p = 0; p < parts; ++p) {
        Pass ps;
        ps.head = h;
        ps.leader = static_cast<int>(i);
        ps.first = cuts[static_cast<size_t>(p)];
        ps.count = cuts[static_cast<size_t>(p + 1)] - ps.first;
        ps.members = {static_cast<int>(i)};
        ps.row_at = {0};
        c.passes.emplace_back(passes.size(), 0);
        passes.push_back(std::move(ps));
      }
      chains.push_back(std::move(c));
      covered[i][static_cast<size_t>(h)] = 1;
    }
  }

  // Tasks: every pass, every uncovered (request, head); the largest first.
  struct Task {
    int64_t work = 0;
    int64_t pass = -1;  ///< a pass, or -1: request `request`'s head `head` alone
    int request = 0;
    int64_t head = 0;
  };
  std::vector<Task> tasks;
  int64_t max_work = 0;
  for (size_t i = 0; i < passes.size(); ++i) {
    Pass& p = passes[i];
    stack_queries(items, p);
    const int64_t d = items[static_cast<size_t>(p.leader)].args->layer->head_dim();
    const int64_t rows = static_cast<int64_t>(p.pos.size());
    tasks.push_back({rows * p.count * d, static_cast<int64_t>(i), 0, 0});
  }
  for (size_t i = 0; i < items.size(); ++i) {
    for (int64_t h = 0; h < items[i].args->layer->num_heads(); ++h) {
      if (covered[i][static_cast<size_t>(h)] != 0) continue;
      tasks.push_back({head_work(*items[i].args), -1, static_cast<int>(i), h});
    }
  }
  for (const Task& t : tasks) max_work = std::max(max_work, t.work);
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.work > b.work; });
  const auto run = [&](const Task& t) {
    if (t.pass < 0) {
      attend_head(*items[static_cast<size_t>(t.request)].args, t.head);
      return;
    }
    Pass& p = passes[static_cast<size_t>(t.pass)];
    const AttendArgs& lead = *items[static_cast<size_t>(p.leader)].args;
    RangeArgs ra;
    ra.layer = lead.layer;
    ra.head = p.head;
    ra.rope = lead.rope;
    ra.fused = lead.fused;
    ra.q = p.q.data();
    ra.q_pos = p.pos.data();
    ra.rows = static_cast<int64_t>(p.pos.size());
    ra.first = p.first;
    ra.count = p.count;
    attend_range(ra, p.state);
  };
  // Threads take tasks from one counter (dynamic: a shared pass outweighs an own one by far).
  const auto n = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  detail::parallel_for(0, n, max_work >= (int64_t{1} << 16) ? 1 : n, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) run(tasks[static_cast<size_t>(i)]);
  });

  // Merge each cascaded (request, head): its passes root first, its own pass last.
  detail::parallel_for(0, static_cast<int64_t>(chains.size()), 64, [&](int64_t b, int64_t e) {
    for (int64_t ci = b; ci < e; ++ci) {
      const Chain& c = chains[static_cast<size_t>(ci)];
      const AttendArgs& a = *items[static_cast<size_t>(c.request)].args;
      const int64_t d = a.layer->head_dim(), G = a.num_q_heads / a.layer->num_heads(), R = rows_of(a);
      PartialState st;
      st.reset(R, d);
      for (const auto& [pi, row0] : c.passes) {
        const PartialState& ps = passes[pi].state;
        for (int64_t r = 0; r < R; ++r) {
          const auto pr = static_cast<size_t>(row0 + r);
          merge_partial(&st.m[static_cast<size_t>(r)], &st.l[static_cast<size_t>(r)], st.acc.data() + r * d, ps.m[pr],
                        ps.l[pr], ps.acc.data() + (row0 + r) * d, d);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t t = r / G, g = r % G;
        normalize_partial(st.l[static_cast<size_t>(r)], st.acc.data() + r * d, d,
                          a.out + ((c.head * G + g) * a.t_q + t) * d);
      }
    }
  });

  if (stats == nullptr) return;
  for (const Pass& p : passes) {
    const AttendArgs& lead = *items[static_cast<size_t>(p.leader)].args;
    const int64_t walks = range_walks(static_cast<int64_t>(p.pos.size()));
    stats->bytes_read += walks * (Flat(lead.layer->k(p.head)).bytes(p.first, p.count) +
                                  Flat(lead.layer->v(p.head)).bytes(p.first, p.count));
    if (p.members.size() > 1) {
      ++stats->shared_passes;
      stats->shared_tokens += p.count;
    }
  }
  std::vector<char> cascaded(items.size(), 0);
  for (const Chain& c : chains) {
    if (!c.split) cascaded[static_cast<size_t>(c.request)] = 1;
  }
  for (const char c : cascaded) stats->cascaded_requests += c;
  for (size_t i = 0; i < items.size(); ++i) {
    const AttendArgs& a = *items[i].args;
    for (int64_t h = 0; h < a.layer->num_heads(); ++h) {
      if (covered[i][static_cast<size_t>(h)] != 0) continue;
      const int64_t all = std::numeric_limits<int64_t>::max() / 2;
      stats->bytes_read += head_walks(a) * (Flat(a.layer->k(h)).bytes(0, all) + Flat(a.layer->v(h)).bytes(0, all));
    }
  }
}

}  // namespace kvcache::cache
