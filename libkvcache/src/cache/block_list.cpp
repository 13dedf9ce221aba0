// SPDX-License-Identifier: Apache-2.0
#include "cache/block_list.h"

#include <algorithm>
#include <cstring>

#include "kvcache/error.h"

namespace kvcache::cache {
namespace {

int64_t align8(int64_t n) { return (n + 7) / 8 * 8; }

int64_t popcount_words(const std::vector<uint64_t>& w) {
  int64_t n = 0;
  for (uint64_t x : w) n += __builtin_popcountll(x);
  return n;
}

}  // namespace

// ---------------------------------------------------------------- BlockFormat
int64_t BlockFormat::bytes_for(const Quantizer& q, int64_t head_dim, int64_t capacity) {
  const StoredLayout l = q.stored_layout(head_dim);
  const int64_t groups = capacity / l.group_tokens;
  const int64_t meta = l.meta_count * dtype_size(l.meta_dtype);
  int64_t end = align8(groups * l.code_bytes);
  end = align8(end + groups * meta);
  if (l.has_zeros) end = align8(end + groups * meta);
  return end;
}

BlockFormat::BlockFormat(const Quantizer& q, int64_t d, int64_t cap, BlockPool* p)
    : quantizer(&q), layout(q.stored_layout(d)), head_dim(d), capacity(cap), pool(p) {
  KV_INTERNAL_ASSERT(cap >= 1 && cap % layout.group_tokens == 0, "format ", q.spec(), " capacity ", cap);
  groups = cap / layout.group_tokens;
  const int64_t meta = layout.meta_count * dtype_size(layout.meta_dtype);
  scales_offset = align8(groups * layout.code_bytes);
  zeros_offset = align8(scales_offset + groups * meta);
  block_bytes = layout.has_zeros ? align8(zeros_offset + groups * meta) : zeros_offset;
  raw_fp32 = q.spec() == "fp32";
  KV_INTERNAL_ASSERT(block_bytes == bytes_for(q, d, cap) && (p == nullptr || p->block_bytes() == block_bytes),
                     "format ", q.spec(), " block bytes");
}

GroupBuffers BlockFormat::at(uint8_t* block, int64_t group) const {
  const int64_t meta = layout.meta_count * dtype_size(layout.meta_dtype);
  GroupBuffers g;
  g.codes = block + group * layout.code_bytes;
  if (layout.meta_count > 0) g.scales = block + scales_offset + group * meta;
  if (layout.has_zeros) g.zeros = block + zeros_offset + group * meta;
  return g;
}

ConstGroupBuffers BlockFormat::at(const uint8_t* block, int64_t group) const {
  const GroupBuffers g = at(const_cast<uint8_t*>(block), group);
  return {g.codes, g.scales, g.zeros};
}

// ---------------------------------------------------------------- BlockList
BlockList::BlockList(BlockList&& o) noexcept
    : fmts_(o.fmts_),
      blocks_(std::move(o.blocks_)),
      live_(o.live_),
      bytes_(o.bytes_),
      reserved_(o.reserved_),
      cow_(o.cow_) {
  o.blocks_.clear();
  o.live_ = o.bytes_ = o.reserved_ = o.cow_ = 0;
}

BlockList& BlockList::operator=(BlockList&& o) noexcept {
  if (this != &o) {
    clear();
    fmts_ = o.fmts_;
    blocks_ = std::move(o.blocks_);
    live_ = o.live_;
    bytes_ = o.bytes_;
    reserved_ = o.reserved_;
    cow_ = o.cow_;
    o.blocks_.clear();
    o.live_ = o.bytes_ = o.reserved_ = o.cow_ = 0;
  }
  return *this;
}

BlockList::~BlockList() { clear(); }

void BlockList::clear() {
  for (auto& b : blocks_) fmt(b.format).pool->release(b.id);
  blocks_.clear();
  live_ = bytes_ = reserved_ = 0;
}

Block& BlockList::new_block(uint8_t f) {
  Block b;
  b.format = f;
  b.id = fmt(f).pool->allocate();
  reserved_ += fmt(f).block_bytes;
  blocks_.push_back(std::move(b));
  return blocks_.back();
}

void BlockList::make_private(Block& b) {
  const BlockFormat& F = fmt(b.format);
  if (F.pool->refcount(b.id) <= 1) return;
  const BlockId copy = F.pool->allocate();
  std::memcpy(F.pool->data(copy), F.pool->data(b.id), static_cast<size_t>(F.block_bytes));
  F.pool->release(b.id);
  b.id = copy;
  ++cow_;
}

void BlockList::adopt(const Block& b) {
  KV_INTERNAL_ASSERT(b.format < StreamFormats::kCount && fmt(b.format).quantizer != nullptr, "adopt: format ",
                     static_cast<int>(b.format));
  const BlockFormat& F = fmt(b.format);
  KV_INTERNAL_ASSERT(b.filled >= 1 && b.filled <= F.capacity && b.live == b.filled && b.dead.empty() && b.pos.empty(),
                     "adopt: block ", b.id, " must be hole-free with implicit positions");
  KV_INTERNAL_ASSERT(F.token_readable() || b.filled == F.layout.group_tokens, "adopt: partial per-channel group");
  if (!blocks_.empty()) {
    const Block& t = blocks_.back();
    int64_t s = t.filled - 1;
    while (s > 0 && !t.alive(s)) --s;
    KV_INTERNAL_ASSERT(t.position(s) < b.pos0, "adopt: position ", b.pos0, " does not follow ", t.position(s));
  }
  F.pool->retain(b.id);
  Block a;
  a.id = b.id;
  a.format = b.format;
  a.filled = a.live = b.filled;
  a.pos0 = b.pos0;
  blocks_.push_back(std::move(a));
  live_ += b.filled;
  bytes_ += block_bytes_resident(blocks_.back());
  reserved_ += F.block_bytes;
}

void BlockList::restore(Block b, const std::function<void(uint8_t* mem)>& fill) {
  const BlockFormat& F = fmt(b.format);
  b.id = F.pool->allocate();
  uint8_t* mem = F.pool->data(b.id);
  std::memset(mem, 0, static_cast<size_t>(F.block_bytes));
  fill(mem);
  live_ += b.live;
  reserved_ += F.block_bytes;
  blocks_.push_back(std::move(b));
  bytes_ += block_bytes_resident(blocks_.back());
}

int64_t BlockList::append_bound(uint8_t f, int64_t n) const {
  const BlockFormat& F = fmt(f);
  if (n <= 0) return 0;
  if (!F.token_readable()) return n / F.layout.group_tokens * F.block_bytes;
  int64_t free = 0, copy = 0;
  if (!blocks_.empty()) {
    const Block& t = blocks_.back();
    if (t.format == f && t.filled < F.capacity) {
      free = F.capacity - t.filled;
      if (refcount(t) > 1) copy = F.block_bytes;
    }
  }
  const int64_t rest = std::max<int64_t>(0, n - free);
  return copy + (rest + F.capacity - 1) / F.capacity * F.block_bytes;
}

int64_t BlockList::evict_bound(const int64_t* idx, int64_t n) const {
  if (n == 0) return 0;
  // Live tokens each block keeps after the eviction, and which blocks it touches.
  std::vector<int64_t> after(blocks_.size());
  std::vector<char> touched(blocks_.size(), 0);
  int64_t k = 0, base = 0;
  for (size_t bi = 0; bi < blocks_.size(); ++bi) {
    const int64_t live = blocks_[bi].live;
    int64_t gone = 0;
    while (k < n && idx[k] < base + live) ++gone, ++k;
    after[bi] = live - gone;
    touched[bi] = gone > 0;
    base += live;
  }
  int64_t bytes = 0;
  std::vector<char> counted(blocks_.size(), 0);
  auto count = [&](size_t i) {
    if (counted[i] || refcount(blocks_[i]) <= 1) return;
    counted[i] = 1;
    bytes += fmt(blocks_[i].format).block_bytes;  // a copy, or a converted block no larger
  };
  for (size_t c = 0; c < blocks_.size(); ++c) {
    if (!touched[c] || after[c] == 0) continue;
    count(c);
    const BlockFormat& F = fmt(blocks_[c].format);
    if (!F.token_readable()) continue;
    // Merges write into the earlier block of a pair: walk left while the survivors fit one block.
    int64_t sum = after[c];
    for (size_t j = c; j-- > 0;) {
      if (blocks_[j].format != blocks_[c].format || sum + after[j] > F.capacity) break;
      sum += after[j];
      count(j);
    }
  }
  return bytes;
}

void BlockList::release(Block& b) {
  fmt(b.format).pool->release(b.id);
  reserved_ -= fmt(b.format).block_bytes;
  b.id = -1;
}

int64_t BlockList::block_bytes_resident(const Block& b) const {
  const BlockFormat& F = fmt(b.format);
  if (F.token_readable()) return b.live * F.group_bytes();
  return b.live > 0 ? (b.filled / F.layout.group_tokens) * F.group_bytes() : 0;
}

void BlockList::set_position(Block& b, int64_t slot, int64_t p) {
  if (slot == 0) {
    b.pos0 = p;
    if (!b.pos.empty()) b.pos[0] = p;
    return;
  }
  if (b.pos.empty()) {
    if (p == b.pos0 + slot) return;
    b.pos.resize(static_cast<size_t>(fmt(b.format).capacity));
    for (int64_t s = 0; s < slot; ++s) b.pos[static_cast<size_t>(s)] = b.pos0 + s;
  }
  b.pos[static_cast<size_t>(slot)] = p;
}

void BlockList::kill(Block& b, int64_t slot) {
  if (b.dead.empty()) b.dead.assign(static_cast<size_t>((fmt(b.format).capacity + 63) / 64), 0);
  b.dead[static_cast<size_t>(slot >> 6)] |= uint64_t{1} << (slot & 63);
  --b.live;
}

void BlockList::append(uint8_t f, const float* x, const int64_t* pos, int64_t n, float tensor_scale,
                       const Quantizer* encoder) {
  const BlockFormat& F = fmt(f);
  const Quantizer* enc = encoder != nullptr ? encoder : F.quantizer;
  const int64_t d = F.head_dim;
  const float ts = f == StreamFormats::kMain ? tensor_scale : 1.0f;
  const int64_t gt = F.layout.group_tokens;
  KV_INTERNAL_ASSERT(n % gt == 0, "append of ", n, " tokens to format ", F.quantizer->spec());
  int64_t i = 0;
  while (i < n) {
    if (!F.token_readable()) {
      // One group per block: a per-channel group is encoded (and freed) as a whole.
      Block& b = new_block(f);
      fill(b, x + i * d, pos + i, gt, ts, enc);
      i += gt;
      continue;
    }
    Block* t = blocks_.empty() ? nullptr : &blocks_.back();
    if (t == nullptr || t->format != f || t->filled >= F.capacity) {
      t = &new_block(f);
    } else {
      make_private(*t);  // writing its free slots: never into a shared block
    }
    const int64_t m = std::min<int64_t>(n - i, F.capacity - t->filled);
    uint8_t* data = F.pool->data(t->id);
    EncodeStatus st = enc->encode(x + i * d, m, d, ts, F.at(data, t->filled));
    int64_t ok = m;
    if (st.overflow) {
      // Find the first token this format cannot hold; everything before it is written.
      ok = 0;
      while (ok < m && !enc->encode(x + (i + ok) * d, 1, d, ts, F.at(data, t->filled + ok)).overflow) ++ok;
    }
    for (int64_t s = 0; s < ok; ++s) set_position(*t, t->filled + s, pos[i + s]);
    t->filled += static_cast<int32_t>(ok);
    t->live += static_cast<int32_t>(ok);
    live_ += ok;
    bytes_ += ok * F.group_bytes();
    if (t->filled == 0) {  // nothing fitted in a fresh block: give it back
      release(*t);
      blocks_.pop_back();
    }
    i += ok;
    if (ok < m) {
      append(StreamFormats::kFallback, x + i * d, pos + i, 1, 1.0f);
      ++i;
    }
  }
}

void BlockList::fill(Block& b, const float* x, const int64_t* pos, int64_t m, float tensor_scale,
                     const Quantizer* enc) {
  const BlockFormat& F = fmt(b.format);
  const float ts = b.format == StreamFormats::kMain ? tensor_scale : 1.0f;
  const int64_t groups = F.token_readable() ? m : m / F.layout.group_tokens;
  if (enc->encode(x, groups, F.head_dim, ts, F.at(F.pool->data(b.id), 0)).overflow) {
    // The format cannot hold these values finitely: store the whole block in fp32.
    const BlockFormat& fb = fmt(StreamFormats::kFallback);
    KV_INTERNAL_ASSERT(b.format != StreamFormats::kFallback && m <= fb.capacity, "fallback overflow");
    release(b);
    b.format = StreamFormats::kFallback;
    b.id = fb.pool->allocate();
    reserved_ += fb.block_bytes;
    (void)fb.quantizer->encode(x, m, fb.head_dim, 1.0f, fb.at(fb.pool->data(b.id), 0));
  }
  b.pos.clear();
  b.dead.clear();
  for (int64_t s = 0; s < m; ++s) set_position(b, s, pos[s]);
  b.filled = b.live = static_cast<int32_t>(m);
  live_ += m;
  bytes_ += block_bytes_resident(b);
}

void BlockList::reencode(uint8_t f, float tensor_scale) {
  const BlockFormat& F = fmt(f);
  const float ts = f == StreamFormats::kMain ? tensor_scale : 1.0f;
  std::vector<float> rows;
  for (Block& b : blocks_) {
    if (b.format != f) continue;
    rows.resize(static_cast<size_t>(b.filled * F.head_dim));
    decode(b, rows.data(), tensor_scale);
    make_private(b);
    const int64_t groups = F.token_readable() ? b.filled : b.filled / F.layout.group_tokens;
    if (!F.quantizer->encode(rows.data(), groups, F.head_dim, ts, F.at(F.pool->data(b.id), 0)).overflow) continue;
    // The decoded rows do not fit the format again: keep them in fp32 (as fill() does).
    const BlockFormat& fb = fmt(StreamFormats::kFallback);
    KV_INTERNAL_ASSERT(b.filled <= fb.capacity, "reencode: fallback overflow");
    bytes_ -= block_bytes_resident(b);
    release(b);
    b.format = StreamFormats::kFallback;
    b.id = fb.pool->allocate();
    reserved_ += fb.block_bytes;
    (void)fb.quantizer->encode(rows.data(), b.filled, fb.head_dim, 1.0f, fb.at(fb.pool->data(b.id), 0));
    bytes_ += block_bytes_resident(b);
  }
}

int64_t BlockList::reencode_bound(uint8_t f) const {
  int64_t bytes = 0;
  for (const Block& b : blocks_) {
    if (b.format == f && refcount(b) > 1) bytes += fmt(f).block_bytes;
  }
  return bytes;
}

void BlockList::pop_front(int64_t n, float* out, int64_t* out_pos, float tensor_scale) {
  KV_INTERNAL_ASSERT(n >= 0 && n <= live_, "pop_front ", n, " of ", live_);
  int64_t k = 0;
  size_t erased = 0;
  while (k < n) {
    Block& b = blocks_[erased];
    const BlockFormat& F = fmt(b.format);
    KV_INTERNAL_ASSERT(F.token_readable(), "pop_front from a per-channel block");
    const float ts = b.format == StreamFormats::kMain ? tensor_scale : 1.0f;
    const uint8_t* data = F.pool->data(b.id);
    for (int64_t s = 0; s < b.filled && k < n; ++s) {
      if (!b.alive(s)) continue;
      if (out != nullptr) F.quantizer->decode(F.at(data, s), 1, F.head_dim, ts, out + k * F.head_dim);
      if (out_pos != nullptr) out_pos[k] = b.position(s);
      kill(b, s);
      bytes_ -= F.group_bytes();
      --live_;
      ++k;
    }
    if (b.live == 0) {
      release(b);
      ++erased;
    }
  }
  blocks_.erase(blocks_.begin(), blocks_.begin() + static_cast<std::ptrdiff_t>(erased));
}

void BlockList::evict(const int64_t* idx, int64_t n, float tensor_scale) {
  if (n == 0) return;
  KV_INTERNAL_ASSERT(idx[n - 1] < live_, "evict index ", idx[n - 1], " of ", live_);
  std::vector<size_t> touched;
  int64_t k = 0, base = 0;
  for (size_t bi = 0; bi < blocks_.size() && k < n; ++bi) {
    Block& b = blocks_[bi];
    const int64_t live_before = b.live;
    if (idx[k] < base + live_before) {
      const int64_t before = block_bytes_resident(b);
      int64_t ord = 0;
      for (int64_t s = 0; s < b.filled && k < n && idx[k] < base + live_before; ++s) {
        if (!b.alive(s)) continue;
        if (ord == idx[k] - base) {
          kill(b, s);
          --live_;
          ++k;
        }
        ++ord;
      }
      bytes_ += block_bytes_resident(b) - before;
      touched.push_back(bi);
    }
    base += live_before;
  }
  KV_INTERNAL_ASSERT(k == n, "evict consumed ", k, " of ", n, " indices");
  // Release empty blocks and convert per-channel groups, last touched first (indices stay valid).
  std::vector<size_t> survivors;
  for (auto it = touched.rbegin(); it != touched.rend(); ++it) {
    const size_t bi = *it;
    if (blocks_[bi].live == 0) {
      release(blocks_[bi]);
      blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(bi));
      for (auto& s : survivors) --s;  // every survivor so far sits after bi
      continue;
    }
    if (!fmt(blocks_[bi].format).token_readable()) convert_group(bi, tensor_scale);
    survivors.push_back(bi);
  }
  // Merge with neighbours (survivors are in decreasing order).
  for (size_t c : survivors) {
    if (c >= blocks_.size()) continue;
    while (mergeable(c)) merge_into(c);
    while (c > 0 && mergeable(c - 1)) {
      merge_into(c - 1);
      --c;
    }
  }
}

bool BlockList::mergeable(size_t i) const {
  if (i + 1 >= blocks_.size()) return false;
  const Block& a = blocks_[i];
  const Block& b = blocks_[i + 1];
  const BlockFormat& F = fmt(a.format);
  return a.format == b.format && F.token_readable() && a.live + b.live <= F.capacity;
}

void BlockList::merge_into(size_t i) {
  make_private(blocks_[i]);  // the merge writes into the earlier block
  Block& a = blocks_[i];
  Block& b = blocks_[i + 1];
  const BlockFormat& F = fmt(a.format);
  const int64_t meta = F.layout.meta_count * dtype_size(F.layout.meta_dtype);
  uint8_t* da = F.pool->data(a.id);
  const uint8_t* db = F.pool->data(b.id);
  std::vector<int64_t> pos;
  pos.reserve(static_cast<size_t>(a.live + b.live));
  auto move_group = [&](const uint8_t* src_block, int64_t src, int64_t dst) {
    const ConstGroupBuffers s = F.at(src_block, src);
    const GroupBuffers t = F.at(da, dst);
    std::memmove(t.codes, s.codes, static_cast<size_t>(F.layout.code_bytes));
    if (s.scales != nullptr) std::memmove(t.scales, s.scales, static_cast<size_t>(meta));
    if (s.zeros != nullptr) std::memmove(t.zeros, s.zeros, static_cast<size_t>(meta));
  };
  int64_t w = 0;
  for (int64_t s = 0; s < a.filled; ++s) {
    if (!a.alive(s)) continue;
    if (w != s) move_group(da, s, w);
    pos.push_back(a.position(s));
    ++w;
  }
  for (int64_t s = 0; s < b.filled; ++s) {
    if (!b.alive(s)) continue;
    move_group(db, s, w);
    pos.push_back(b.position(s));
    ++w;
  }
  a.filled = a.live = static_cast<int32_t>(w);
  a.dead.clear();
  a.pos.clear();
  for (int64_t s = 0; s < w; ++s) set_position(a, s, pos[static_cast<size_t>(s)]);
  release(b);
  blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(i + 1));
}

void BlockList::convert_group(size_t i, float tensor_scale) {
  Block& b = blocks_[i];
  const BlockFormat& F = fmt(b.format);
  const BlockFormat& C = fmt(StreamFormats::kConverted);
  if (C.quantizer == nullptr || b.live > C.capacity || b.live * C.group_bytes() > block_bytes_resident(b)) return;
  std::vector<float> rows(static_cast<size_t>(b.filled * F.head_dim));
  decode(b, rows.data(), tensor_scale);
  std::vector<float> kept;
  std::vector<int64_t> pos;
  kept.reserve(static_cast<size_t>(b.live * F.head_dim));
  for (int64_t s = 0; s < b.filled; ++s) {
    if (!b.alive(s)) continue;
    kept.insert(kept.end(), rows.begin() + s * F.head_dim, rows.begin() + (s + 1) * F.head_dim);
    pos.push_back(b.position(s));
  }
  const int64_t m = b.live;
  bytes_ -= block_bytes_resident(b);
  live_ -= m;
  if (refcount(b) > 1) ++cow_;  // a private (converted) copy; the shared group stays with its holders
  release(b);
  b.format = StreamFormats::kConverted;
  b.id = C.pool->allocate();
  reserved_ += C.block_bytes;
  fill(b, kept.data(), pos.data(), m, 1.0f, C.quantizer);
}

void BlockList::renumber_positions(int64_t& next) {
  for (auto& b : blocks_) {
    if (!b.has_holes()) {
      b.pos.clear();
      b.pos0 = next;
      next += b.filled;
      continue;
    }
    b.pos.resize(static_cast<size_t>(fmt(b.format).capacity));
    for (int64_t s = 0; s < b.filled; ++s) {
      b.pos[static_cast<size_t>(s)] = b.alive(s) ? next++ : -1;
    }
    b.pos0 = b.pos[0];
  }
}

void BlockList::decode(const Block& b, float* out, float tensor_scale) const {
  const BlockFormat& F = fmt(b.format);
  const int64_t groups = F.token_readable() ? b.filled : b.filled / F.layout.group_tokens;
  const uint8_t* data = F.pool->data(b.id);
  F.quantizer->decode(F.at(data, 0), groups, F.head_dim,
                      b.format == StreamFormats::kMain ? tensor_scale : 1.0f, out);
}

void BlockList::live_positions(std::vector<int64_t>& out) const {
  for (const auto& b : blocks_) {
    for (int64_t s = 0; s < b.filled; ++s) {
      if (b.alive(s)) out.push_back(b.position(s));
    }
  }
}

void BlockList::live_rows(std::vector<float>& out, float tensor_scale) const {
  std::vector<float> rows;
  for (const auto& b : blocks_) {
    const int64_t d = fmt(b.format).head_dim;
    rows.resize(static_cast<size_t>(b.filled * d));
    decode(b, rows.data(), tensor_scale);
    for (int64_t s = 0; s < b.filled; ++s) {
      if (b.alive(s)) out.insert(out.end(), rows.begin() + s * d, rows.begin() + (s + 1) * d);
    }
  }
}

void BlockList::check(const std::string& where) const {
  auto fail = [&](const std::string& what) { throw InternalError(where + ": " + what); };
  int64_t live = 0, bytes = 0, reserved = 0;
  int64_t last = INT64_MIN;
  bool any = false;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block& b = blocks_[i];
    const std::string at = "block " + std::to_string(i);
    if (b.format >= StreamFormats::kCount || fmt(b.format).quantizer == nullptr) fail(at + ": bad format");
    const BlockFormat& F = fmt(b.format);
    if (b.id < 0 || b.id >= F.pool->blocks_allocated() || F.pool->refcount(b.id) < 1) fail(at + ": bad block id");
    if (b.filled < 1 || b.filled > F.capacity) fail(at + ": filled " + std::to_string(b.filled));
    if (!F.token_readable() && b.filled != F.layout.group_tokens) fail(at + ": partial per-channel group");
    const int64_t dead = b.dead.empty() ? 0 : popcount_words(b.dead);
    if (!b.dead.empty()) {
      // Every bit of the words, not only the block's capacity: a bit past it (a forged snapshot's)
      // would count as evicted and leave `live` short of the slots alive.
      for (int64_t s = b.filled; s < static_cast<int64_t>(b.dead.size()) * 64; ++s) {
        if (!b.alive(s)) fail(at + ": dead bit beyond the filled slots");
      }
    }
    if (b.live != b.filled - dead) fail(at + ": live " + std::to_string(b.live) + " != filled - dead");
    if (b.live < 1) fail(at + ": holds no live token");
    if (!b.pos.empty() && static_cast<int64_t>(b.pos.size()) != F.capacity) fail(at + ": positions size");
    for (int64_t s = 0; s < b.filled; ++s) {
      if (!b.alive(s)) continue;
      const int64_t p = b.position(s);
      if (any && p <= last) fail(at + ": positions not increasing (" + std::to_string(p) + " after " + std::to_string(last) + ")");
      last = p;
      any = true;
    }
    live += b.live;
    bytes += block_bytes_resident(b);
    reserved += F.block_bytes;
  }
  if (live != live_) fail("live counter " + std::to_string(live_) + " != " + std::to_string(live));
  if (bytes != bytes_) fail("bytes counter " + std::to_string(bytes_) + " != " + std::to_string(bytes));
  if (reserved != reserved_) fail("reserved counter " + std::to_string(reserved_) + " != " + std::to_string(reserved));
}

}  // namespace kvcache::cache
