// SPDX-License-Identifier: Apache-2.0
#include "model/bpe.h"

#include <cstdio>
#include <queue>

#include "kvcache/error.h"
#include "model/unicode.h"

namespace kvcache::tok {

BpeModel::BpeModel(std::unordered_map<std::string, int32_t> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges,
                   BpeOptions options, const std::string& where)
    : vocab_(std::move(vocab)), options_(std::move(options)) {
  merges_.reserve(merges.size() * 2);
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const auto ia = vocab_.find(a);
    const auto ib = vocab_.find(b);
    const auto ic = vocab_.find(a + b);
    KV_CHECK_ARG(ia != vocab_.end() && ib != vocab_.end() && ic != vocab_.end(), where,
                 ": merge #", rank, " '", a, " ", b, "' uses a token missing from the vocab ('",
                 ia == vocab_.end() ? a : (ib == vocab_.end() ? b : a + b), "')");
    // The first occurrence of a pair wins (HF keeps the lowest rank as well).
    merges_.emplace(pair_key(ia->second, ib->second),
                    MergeInfo{static_cast<int32_t>(rank), ic->second});
  }
  if (options_.unk_token) {
    const auto it = vocab_.find(*options_.unk_token);
    KV_CHECK_ARG(it != vocab_.end(), where, ": unk_token '", *options_.unk_token,
                 "' is not in the vocab");
    unk_id_ = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    char name[16];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    const auto it = vocab_.find(name);
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }
}

namespace {
struct Symbol {
  int32_t id;
  int32_t prev;  // -1: none
  int32_t next;  // -1: none
  bool alive;
};
struct Candidate {
  int32_t rank;
  int32_t pos;
  int32_t new_id;
  // priority_queue is a max-heap: "less" means lower priority = higher rank, then later pos.
  bool operator<(const Candidate& o) const {
    return rank != o.rank ? rank > o.rank : pos > o.pos;
  }
};
}  // namespace

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  std::vector<Symbol> syms;
  syms.reserve(word.size());
  auto push = [&syms](int32_t id) {
    const auto n = static_cast<int32_t>(syms.size());
    syms.push_back(Symbol{id, n - 1, -1, true});
    if (n > 0) syms[static_cast<size_t>(n - 1)].next = n;
  };
  bool pending_unk = false;
  std::string ch;
  for (size_t i = 0; i < word.size();) {
    const size_t len = std::min(unicode::utf8_len(static_cast<unsigned char>(word[i])),
                                word.size() - i);
    ch.assign(word.substr(i, len));
    i += len;
    const auto it = vocab_.find(ch);
    if (it != vocab_.end()) {
      if (pending_unk) push(*unk_id_), pending_unk = false;
      push(it->second);
      continue;
    }
    if (options_.byte_fallback) {
      bool ok = true;
      for (unsigned char c : ch) ok = ok && byte_ids_[c] >= 0;
      if (ok) {
        if (pending_unk) push(*unk_id_), pending_unk = false;
        for (unsigned char c : ch) push(byte_ids_[c]);
        continue;
      }
    }
    if (unk_id_) {
      if (pending_unk && !options_.fuse_unk) push(*unk_id_);
      pending_unk = true;
    }
    // Without an unk token the symbol is dropped, as HF tokenizers does.
  }
  if (pending_unk) push(*unk_id_);

  std::priority_queue<Candidate> heap;
  auto consider = [&](int32_t pos) {
    const int32_t nxt = syms[static_cast<size_t>(pos)].next;
    if (nxt < 0) return;
    const auto it = merges_.find(pair_key(syms[static_cast<size_t>(pos)].id,
                                          syms[static_cast<size_t>(nxt)].id));
    if (it != merges_.end()) heap.push(Candidate{it->second.rank, pos, it->second.new_id});
  };
  for (int32_t p = 0; p + 1 < static_cast<int32_t>(syms.size()); ++p) consider(p);
  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    Symbol& left = syms[static_cast<size_t>(top.pos)];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = syms[static_cast<size_t>(left.next)];
    // Stale entry: the pair at this position changed since it was queued.
    const auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.new_id != top.new_id) continue;
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) syms[static_cast<size_t>(right.next)].prev = top.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(top.pos);
  }
  for (const auto& s : syms) {
    if (s.alive) out.push_back(s.id);
  }
}

void BpeModel::encode_word(std::string_view word, std::vector<int64_t>& out) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    const auto it = vocab_.find(std::string(word));
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  std::string key;
  if (cacheable) {
    key.assign(word);
    std::lock_guard<std::mutex> lock(cache_mutex_);
    const auto it = cache_.find(key);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  merge_word(word, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() >= kMaxCacheEntries) cache_.clear();
    cache_.emplace(std::move(key), std::move(ids));
  }
}

}  // namespace kvcache::tok
