// SPDX-License-Identifier: Apache-2.0
// The state each eviction policy carries across steps, as a snapshot holds it
// (EvictionPolicy::persist, kvcache/snapshot.h, docs/snapshot-format.md "Policy state"). One
// function per policy both writes and reads, in the same order; reading follows reset() with the
// saved context length and shape, so what on_reset() derives from the budget is already there.
// Reading checks every per-layer / per-head count against the shape: a snapshot whose checksums
// hold cannot hand a policy vectors its plan() would index out of range.
#include <cstring>

#include "evict/policies.h"

namespace kvcache {

// ---------------------------------------------------------------- PolicyStateIO
void PolicyStateIO::raw(void* p, size_t n) {
  if (!reading()) {
    out_->append(static_cast<const char*>(p), n);
    return;
  }
  expect(n <= size_ - pos_, "ends " + std::to_string(n - (size_ - pos_)) + " bytes early");
  std::memcpy(p, in_ + pos_, n);
  pos_ += n;
}

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "snapshots are little-endian: a big-endian build must swap");

void PolicyStateIO::io(bool& x) {
  uint8_t b = x ? 1 : 0;
  raw(&b, 1);
  expect(b <= 1, "a flag of value " + std::to_string(b) + " (expected 0 or 1)");
  x = b != 0;
}
void PolicyStateIO::io(int64_t& x) { raw(&x, sizeof x); }
void PolicyStateIO::io(uint64_t& x) { raw(&x, sizeof x); }
void PolicyStateIO::io(float& x) { raw(&x, sizeof x); }
void PolicyStateIO::io(double& x) { raw(&x, sizeof x); }

void PolicyStateIO::io(std::vector<bool>& x) {
  uint64_t n = x.size();
  io(n);
  if (reading()) {
    expect(n <= size_ - pos_, "a vector of " + std::to_string(n) + " flags in " + std::to_string(size_ - pos_) +
                                  " bytes");
    x.assign(static_cast<size_t>(n), false);
  }
  for (size_t i = 0; i < x.size(); ++i) {
    bool b = x[i];
    io(b);
    x[i] = b;
  }
}

void PolicyStateIO::expect(bool ok, const std::string& what) const {
  if (reading() && !ok) throw SnapshotError(SnapshotError::Reason::kInconsistent, "policy state: " + what);
}

void PolicyStateIO::finish() const {
  expect(pos_ == size_, std::to_string(size_ - pos_) + " bytes left over after the policy's state");
}

namespace evict {
namespace {

/// Reading: `v` has one entry per layer.
template <class T>
void expect_layers(const PolicyStateIO& io, const std::vector<T>& v, const CacheShape& shape, const char* what) {
  io.expect(static_cast<int64_t>(v.size()) == shape.num_layers,
            std::string(what) + " for " + std::to_string(v.size()) + " layers, expected " +
                std::to_string(shape.num_layers));
}

/// Reading: per layer, no entry (not observed yet) or one per KV head.
template <class T>
void expect_heads(const PolicyStateIO& io, const std::vector<std::vector<T>>& v, const CacheShape& shape,
                  const char* what) {
  expect_layers(io, v, shape, what);
  for (size_t l = 0; l < v.size(); ++l) {
    io.expect(v[l].empty() || static_cast<int64_t>(v[l].size()) == shape.num_kv_heads,
              std::string(what) + " of layer " + std::to_string(l) + " for " + std::to_string(v[l].size()) +
                  " heads, expected " + std::to_string(shape.num_kv_heads));
  }
}

}  // namespace

void ScheduledScorer::do_persist(PolicyStateIO& io) {
  io.io(prompt_done_);
  io.io(layers_done_);
  io.expect(layers_done_ >= 0 && layers_done_ <= shape().num_layers, "layers done " + std::to_string(layers_done_));
}

void H2OPolicy::do_persist(PolicyStateIO& io) {
  io.io(scores_);
  expect_heads(io, scores_, shape(), "h2o scores");
}

void RandomPolicy::do_persist(PolicyStateIO& io) {
  io.io(calls_);
  expect_layers(io, calls_, shape(), "random draws");
}

void TovaPolicy::do_persist(PolicyStateIO& io) {
  io.io(last_row_);
  expect_layers(io, last_row_, shape(), "tova rows");
}

void SnapKVPolicy::do_persist(PolicyStateIO& io) {
  io.io(prefill_done_);
  io.io(layers_done_);
  io.expect(layers_done_ >= 0 && layers_done_ <= shape().num_layers, "layers done " + std::to_string(layers_done_));
  uint64_t n = rows_.size();
  io.io(n);
  io.expect(static_cast<int64_t>(n) == shape().num_layers, "snapkv rows for " + std::to_string(n) + " layers");
  if (io.reading()) rows_.assign(static_cast<size_t>(n), Rows{});
  for (Rows& r : rows_) {
    io.io(r.heads);
    io.io(r.rows);
    io.io(r.keys);
    io.io(r.data);
    io.expect(r.heads >= 0 && r.rows >= 0 && r.keys >= 0 && (r.heads == 0 || r.heads == shape().num_kv_heads) &&
                  static_cast<double>(r.heads) * static_cast<double>(r.rows) * static_cast<double>(r.keys) ==
                      static_cast<double>(r.data.size()),
              "snapkv rows of " + std::to_string(r.heads) + " heads x " + std::to_string(r.rows) + " x " +
                  std::to_string(r.keys) + " hold " + std::to_string(r.data.size()) + " values");
  }
}

void PyramidKVPolicy::do_persist(PolicyStateIO& io) {
  SnapKVPolicy::do_persist(io);
  io.io(budgets_);
  io.io(reserve_);
  io.expect(budgets_.empty() || static_cast<int64_t>(budgets_.size()) == shape().num_layers,
            "pyramid budgets for " + std::to_string(budgets_.size()) + " layers");
  for (int64_t b : budgets_) io.expect(b >= 1, "pyramid budget " + std::to_string(b));
}

void ExpectedAttentionPolicy::do_persist(PolicyStateIO& io) {
  ScheduledScorer::do_persist(io);
  uint64_t n = stats_.size();
  io.io(n);
  io.expect(static_cast<int64_t>(n) == shape().num_layers, "expected statistics for " + std::to_string(n) + " layers");
  if (io.reading()) stats_.assign(static_cast<size_t>(n), Stats{});
  for (Stats& s : stats_) {
    io.io(s.n);
    io.io(s.sum);
    io.io(s.outer);
    const auto hd = static_cast<size_t>(s.sum.size());
    io.expect(s.n >= 0 && (s.sum.empty() || hd % static_cast<size_t>(shape().num_q_heads) == 0),
              "expected statistics of " + std::to_string(s.n) + " queries, " + std::to_string(hd) + " sums");
    if (!s.sum.empty() && !s.outer.empty()) {
      const size_t d = hd / static_cast<size_t>(shape().num_q_heads);
      io.expect(s.outer.size() == hd * d, "expected covariance of " + std::to_string(s.outer.size()) + " values");
    }
  }
}

void KVzipPolicy::do_persist(PolicyStateIO& io) {
  io.io(awaiting_);
  io.io(done_);
  io.io(scores_);
  expect_heads(io, scores_, shape(), "kvzip scores");
}

void AdaKVPolicy::do_persist(PolicyStateIO& io) { inner_->persist(io); }

void DecodeCompressionPolicy::do_persist(PolicyStateIO& io) {
  inner_->persist(io);
  io.io(since_);
  expect_layers(io, since_, shape(), "decode counters");
}

void DuoAttentionPolicy::do_persist(PolicyStateIO& io) {
  io.io(streaming_count_);
  io.io(classified_);
  io.io(layers_done_);
  io.io(head_scores_);
  io.io(streaming_);
  const int64_t all = shape().num_layers * shape().num_kv_heads;
  io.expect(layers_done_ >= 0 && layers_done_ <= shape().num_layers, "layers done " + std::to_string(layers_done_));
  io.expect(streaming_count_ >= 0 && streaming_count_ <= all, "streaming heads " + std::to_string(streaming_count_));
  io.expect(classified_ ? static_cast<int64_t>(streaming_.size()) == all : streaming_.empty(),
            "streaming flags for " + std::to_string(streaming_.size()) + " heads");
  expect_layers(io, head_scores_, shape(), "duo head scores");
  for (const auto& h : head_scores_) {
    io.expect(h.empty() || static_cast<int64_t>(h.size()) == shape().num_kv_heads,
              "duo head scores for " + std::to_string(h.size()) + " heads");
  }
}

}  // namespace evict
}  // namespace kvcache
