// SPDX-License-Identifier: Apache-2.0
// The generic block-by-block attention (attend.h): the walk over a head's stored blocks in
// tiles, the fused kernels or the tile kernels (attend_tiles.h) per tile, and the attention
// mass of the selected rows.
#include "cache/attend.h"
#include "cache/attend_fused.h"
#include "cache/attend_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "common/parallel.h"
#include "kvcache/error.h"
#include "quant/simd.h"

namespace kvcache::cache {
namespace {

constexpr int64_t kRowBlock = 64;
/// Query rows attend_range() takes through one walk over the blocks: a cascade's shared pass
/// stacks every sharing sequence's rows (16 decode sequences × 7 query heads: 112), and each
/// walk reads the shared blocks again, so the block is larger than kRowBlock; the scores
/// of a tile (256 rows × 128 keys, 128 KiB) and the accumulators still stay in L2.
constexpr int64_t kRangeRowBlock = 256;
/// Blocks a stream's cursor prefetches ahead of the one it reads (Cursor::prefetch_next).
/// bench_attention at 32k, one thread (CPU time, 2 runs): one block ahead took int8 from 2.05
/// to 1.50 ms, int4 1.64 -> 1.32, fp16 3.3 -> 2.56, KIVI-2 1.81 -> 1.53; two or four ahead
/// were no better.
constexpr int kPrefetchBlocks = 1;
/// The cache level the prefetches fill: 2 = prefetcht1, into L2 (not L1). A block's burst of
/// up to 256 line prefetches into L1 fills the core's few L1 miss buffers, and on AMD Zen 4 the
/// prefetch instructions then wait for them: perf put 88 % of Cursor::remaining's samples (12 %
/// of the step) on the loop, and prefetcht0 was no faster than no prefetch at all. Into L2 the
/// burst does not stall and the kernels' L1 misses are L2 hits. bench_attention at 32k, one
/// thread, AMD EPYC Zen 4, 2026-12-06 17:20 UTC, load 0.6, two alternating rounds, µs:
/// prefetcht0 / prefetcht1 / prefetcht2 / none: fp16 4515, 4177 / 3225, 3329 / 3214, 3265 /
/// 3943, 4078; int8 2885, 2854 / 2247, 2259 / 2183, 2247 / 2896, 3017; int4 2436, 2426 /
/// 1980, 2089 / 1989, 2271 / 2497, 2654 (the figures of kPrefetchBlocks above were prefetcht0
/// against none, on another CPU).
constexpr int kPrefetchLocality = 2;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

/// A block's prefetch held back until a point of the tile (Cursor::prefetch_next): the
/// value stream's next block is requested once the tile's q·k has run, while its softmax and
/// p·v compute, the key stream's once its p·v starts, not both in one burst at the tile's
/// start (for_each_tile, tile_keys, tile_values). bench_attention at 32k, one thread, AMD
/// EPYC Zen 4, 2026-12-06 17:48 UTC, load 0.8-0.9, three alternating rounds, µs, before / after:
/// fp16 3301, 3293, 3295 / 3156, 3059, 3037; fp8:e5m2 2268, 2198, 2151 / 2190, 2040, 2141; int8
/// 2295, 2230, 2247 / 2256, 2137, 2153; int4 2059, 1969, 2009 / 2079, 1963, 1973; KIVI-2 2260,
/// 2288, 2318 / 2307, 2218, 2248. The key stream's likewise waits for the tile's p·v (the
/// next tile's keys arrive during it): a further fp16 3117, 3156, 3000 / 2948, 2846, 2941;
/// int8 2102, 2157, 2107 / 2054, 2051, 2052; fp8:e5m2, int4 and KIVI-2 within 1 % (17:52 UTC,
/// load 0.9).
struct PendingPrefetch {
  const char* p = nullptr;
  int64_t bytes = 0;
  void issue() {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, kPrefetchLocality);
    p = nullptr;
    bytes = 0;
  }
};

/// Walks one stream's live tokens block by block (quantized list, then residual list). In
/// decode mode each block is decoded once into float32 (pre-RoPE keys rotated by position);
/// in raw mode (the fused kernels) the block is read as stored. Rows and slot lists handed
/// out stay valid until the second begin_tile() after them: a tile may span several blocks.
class Cursor {
 public:
  /// Starts after the stream's first `skip` live tokens: whole blocks before them are passed
  /// over unread, the block holding the first token read is entered part-way.
  /// Each block's prefetch is handed to `pending` (for the caller to issue at a point of the
  /// tile) when the block before it is loaded; the first block's is issued here.
  Cursor(const HeadStream& s, float tensor_scale, const common::RopeTable* rope, int64_t d, bool raw,
         PendingPrefetch& pending, int64_t skip = 0)
      : scale_(tensor_scale), rope_(rope), d_(d), raw_(raw), walk_(s), ahead_(s), pending_(&pending) {
    while (skip > 0) {
      StreamBlockWalk w = walk_;
      const BlockList* list = nullptr;
      const Block* block = nullptr;
      if (!w.next(&list, &block) || block->live > skip) break;
      skip -= block->live;
      walk_ = w;
    }
    skip_ = skip;
    ahead_ = walk_;
    for (int i = 0; i < kPrefetchBlocks; ++i) prefetch_next();
    pending_->issue();
  }

  /// Starts a tile: the buffers of blocks loaded before it, except the current one, may be reused.
  void begin_tile() {
    if (have_) {
      std::swap(pool_[cur_], pool_[0]);
      cur_ = 0;
      free_ = 1;
    } else {
      free_ = 0;
    }
  }
  /// Live tokens left in the current block, loading the next block when it is used up;
  /// 0 at the end of the stream.
  int64_t remaining() {
    while (!have_ || next_ >= pool_[cur_].slots.size()) {
      if (!load()) return 0;
    }
    return static_cast<int64_t>(pool_[cur_].slots.size() - next_);
  }
  const float* row(int64_t j) const {
    const Loaded& b = pool_[cur_];
    return b.rows + static_cast<int64_t>(b.slots[next_ + static_cast<size_t>(j)]) * d_;
  }
  int64_t position(int64_t j) const {
    const Loaded& b = pool_[cur_];
    return b.block->position(b.slots[next_ + static_cast<size_t>(j)]);
  }
  /// The next tokens as stored (raw mode).
  fused::RawTokens raw_tokens() const {
    const Loaded& b = pool_[cur_];
    fused::RawTokens t;
    t.block = b.format->pool->data(b.block->id);
    t.kf = b.kf;
    t.slots = b.slots.data() + next_;
    t.tensor_scale = b.block->format == StreamFormats::kMain ? scale_ : 1.0f;
    return t;
  }
  void advance(int64_t n) { next_ += static_cast<size_t>(n); }
  /// True if the current block is read as float32 rows (row()), false if as stored (raw mode
  /// over a format the fused kernels read). Plain float32 blocks are their own decoded form:
  /// rows by pointer in decode mode, read as stored in raw mode like every other format (the
  /// fused fp32 pass, one 16×16 transpose per 16 keys and dims and no per-row pointer, ran
  /// 8-17 % faster than the generic tile kernels over the same rows: bench_attention fp32 on
  /// the Xeon, 2026-12-03, docs/performance.md).
  bool rows() const { return pool_[cur_].rows != nullptr; }

 private:
  struct Loaded {
    const Block* block = nullptr;
    const BlockFormat* format = nullptr;
    const float* rows = nullptr;  ///< decoded (or raw float32) rows; null in raw mode
    fused::KernelFormat kf;
    std::vector<float> scratch;
    std::vector<int32_t> slots;  ///< live slots, increasing
  };

  /// Asks the memory system for the whole block kPrefetchBlocks ahead of the one being
  /// loaded: a block's bytes (up to 16 KiB) lie at an address the hardware prefetchers cannot
  /// guess, so without this every block starts with a stall, and reading the stream does not
  /// overlap the kernels' arithmetic over the block before it. The request is handed to the
  /// caller (pending_), after issuing one still held there: its block is due first.
  void prefetch_next() {
    const BlockList* list = nullptr;
    const Block* block = nullptr;
    if (!ahead_.next(&list, &block)) return;
    const BlockFormat& f = list->format(*block);
    const auto* p = static_cast<const char*>(static_cast<const void*>(f.pool->data(block->id)));
    pending_->issue();
    *pending_ = PendingPrefetch{p, f.block_bytes};
  }

  bool load() {
    const BlockList* list = nullptr;
    const Block* block = nullptr;
    if (!walk_.next(&list, &block)) return false;
    prefetch_next();
    if (free_ >= pool_.size()) pool_.emplace_back();
    cur_ = free_++;
    have_ = true;
    Loaded& b = pool_[cur_];
    b.block = block;
    b.format = &list->format(*b.block);
    b.rows = nullptr;
    if (raw_) {
      auto& k = kf_cache_[b.block->format];
      if (k.kind == fused::KernelFormat::Kind::kNone) k = fused::classify(*b.format);
      b.kf = k;
    } else if (b.format->raw_fp32 && rope_ == nullptr) {
      b.rows = reinterpret_cast<const float*>(b.format->pool->data(b.block->id));
    } else {
      b.scratch.resize(static_cast<size_t>(b.format->capacity * d_));
      list->decode(*b.block, b.scratch.data(), scale_);
      b.rows = b.scratch.data();
    }
    b.slots.clear();
    if (!b.block->has_holes()) {  // the usual block: every filled slot live
      b.slots.resize(static_cast<size_t>(b.block->filled));
      std::iota(b.slots.begin(), b.slots.end(), 0);
    } else {
      for (int32_t sl = 0; sl < b.block->filled; ++sl) {
        if (b.block->alive(sl)) b.slots.push_back(sl);
      }
    }
    if (rope_ != nullptr) {
      for (const int32_t sl : b.slots) {
        rope_->rotate(b.scratch.data() + static_cast<int64_t>(sl) * d_, b.block->position(sl));
      }
    }
    next_ = static_cast<size_t>(skip_);  // skip_ < the block's live tokens (constructor)
    skip_ = 0;
    return true;
  }

  float scale_;
  const common::RopeTable* rope_;
  int64_t d_;
  bool raw_;
  StreamBlockWalk walk_;
  StreamBlockWalk ahead_;  ///< kPrefetchBlocks blocks in front of walk_
  std::vector<Loaded> pool_;  ///< blocks loaded for the current tile (the current one last)
  size_t cur_ = 0, free_ = 0;
  bool have_ = false;
  size_t next_ = 0;
  int64_t skip_ = 0;  ///< live tokens of the first block loaded to pass over
  fused::KernelFormat kf_cache_[StreamFormats::kCount];  ///< per format index, classified once
  PendingPrefetch* pending_;
};

/// A run of one stream's tokens inside one block: tile keys [at, at + n).
struct Segment {
  int64_t at = 0, n = 0;
  bool rows = true;       ///< given as float32 rows (Tile::krows/vrows), else `raw`
  fused::RawTokens raw;
};

/// The keys and values of one tile: up to `tile_tokens` consecutive live tokens, which may span
/// several blocks (a list of segments per stream: K and V blocks need not line up). Each
/// segment is decoded rows (generic path, float32 blocks) or the stored tokens (fused).
struct Tile {
  int64_t n = 0, j0 = 0;  ///< tokens; resident index of the first
  int64_t last_pos = 0;   ///< position of the tile's last (newest) key
  const float* const* krows = nullptr;
  const float* const* vrows = nullptr;
  const int64_t* kpos = nullptr;  ///< per key, valid when last_pos > the rows' min position
  const Segment* kseg = nullptr;
  const Segment* vseg = nullptr;
  size_t nk_seg = 0, nv_seg = 0;
  /// The streams' next blocks: the values' prefetched once the tile's keys are scored
  /// (tile_keys), the keys' once its p·v starts (tile_values).
  PendingPrefetch* vprefetch = nullptr;
  PendingPrefetch* kprefetch = nullptr;
};

/// Keys per tile: at least kMinTileTokens and at least the largest block of the layer. Long
/// enough that the online softmax's per-row work (max, rescale, sums) is spread over many
/// keys, short enough that a row block's scores stay in L1/L2. (bench_attention at 32k, with
/// the prefetches of the time into L1 and at the tile's start: 128- and 256-key tiles were no
/// faster than 64 for per-token formats, and 8-10% slower for int8. Since the prefetches go to
/// L2 and are spread over the tile, 128 is faster: AMD EPYC Zen 4, 2026-12-06 18:54 UTC, load
/// about 1, three alternating rounds, one thread, µs, 64 / 128 keys: at 32k fp16 3231, 3192,
/// 2928 / 2987, 2776, 2826; int8 2541, 2290, 2102 / 2147, 2032, 2040; int4 2353, 2456, 2007 /
/// 1912, 1958, 1917; KIVI-2 2409, 2310, 2266 / 2287, 2190, 2210; tq:b4 2673, 2452, 2484 / 2400,
/// 2458, 2379; at 4k fp16 469, 434, 430 / 388, 432, 371, the others within noise or faster.
/// 256 was no better than 128.)
constexpr int64_t kMinTileTokens = 128;

int64_t max_capacity(const StreamSetup& st) {
  int64_t c = 0;
  for (const auto& f : st.formats.f) c = std::max(c, f.capacity);
  return c;
}

/// Tokens after a head's stored ones (AttendArgs::tail_*, a replay step), as float32 rows.
struct Tail {
  const float* k = nullptr;
  const float* v = nullptr;
  const int64_t* pos = nullptr;
  int64_t n = 0;
};

/// A run of a head's stored tokens: live tokens [first, first + count) of both streams.
struct TokenRange {
  int64_t first = 0;
  int64_t count = std::numeric_limits<int64_t>::max();
};

/// Iterates the tiles of one head's keys — its stored tokens in `range`, then `tail`'s:
/// fn(const Tile&). Stops after the first tile that reaches keys lying after `max_qpos`; fills
/// Tile::kpos only for tiles reaching past `min_qpos` (the only ones a mask touches).
template <class Fn>
void for_each_tile(const LayerStore& L, int64_t h, const common::RopeTable* rope, bool raw, const Tail& tail,
                   int64_t min_qpos, int64_t max_qpos, int64_t tile_tokens, const TokenRange& range, Fn&& fn) {
  const int64_t d = L.head_dim();
  PendingPrefetch kpf, vpf;
  Cursor kc(L.k(h), L.k_scale(), rope, d, raw, kpf, range.first);
  Cursor vc(L.v(h), L.v_scale(), nullptr, d, raw, vpf, range.first);
  int64_t stored_left = range.count;  // stored keys the range still holds
  std::vector<const float*> kr(static_cast<size_t>(tile_tokens)), vr(static_cast<size_t>(tile_tokens));
  std::vector<int64_t> kpos(static_cast<size_t>(tile_tokens));
  std::vector<Segment> ks, vs;
  Tile t;
  t.j0 = range.first;
  t.krows = kr.data();
  t.vrows = vr.data();
  t.kpos = kpos.data();
  t.vprefetch = &vpf;
  t.kprefetch = &kpf;
  int64_t tk = 0, tv = 0;  // tail tokens taken for keys / values
  bool done = false;
  while (!done) {
    kc.begin_tile();
    vc.begin_tile();
    ks.clear();
    vs.clear();
    int64_t n = 0;
    bool need_pos = false;
    while (n < tile_tokens) {
      const int64_t nk = stored_left > 0 ? std::min(kc.remaining(), stored_left) : 0;
      const bool from_tail = nk == 0;
      if (from_tail && tk == tail.n) {
        done = true;
        break;
      }
      const int64_t first_pos = from_tail ? tail.pos[tk] : kc.position(0);
      if (first_pos > max_qpos) {  // positions increase along the stream: nothing later is visible
        done = true;
        break;
      }
      Segment sg;
      sg.at = n;
      sg.n = std::min(from_tail ? tail.n - tk : nk, tile_tokens - n);
      sg.rows = from_tail || kc.rows();
      if (from_tail) {
        for (int64_t j = 0; j < sg.n; ++j) kr[static_cast<size_t>(n + j)] = tail.k + (tk + j) * d;
      } else if (sg.rows) {
        for (int64_t j = 0; j < sg.n; ++j) kr[static_cast<size_t>(n + j)] = kc.row(j);
      } else {
        sg.raw = kc.raw_tokens();
      }
      auto position = [&](int64_t j) { return from_tail ? tail.pos[tk + j] : kc.position(j); };
      t.last_pos = position(sg.n - 1);
      if (t.last_pos > min_qpos) {  // some key may be hidden from some row: the mask needs positions
        if (!need_pos) {
          // Keys of the tile's earlier segments lie at or before min_qpos (positions grow
          // along the stream) and no row hides them: min_qpos stands in for their positions.
          std::fill(kpos.begin(), kpos.begin() + n, min_qpos);
          need_pos = true;
        }
        for (int64_t j = 0; j < sg.n; ++j) kpos[static_cast<size_t>(n + j)] = position(j);
      }
      ks.push_back(sg);
      if (from_tail) {
        tk += sg.n;
      } else {
        kc.advance(sg.n);
        stored_left -= sg.n;
      }
      n += sg.n;
    }
    if (n == 0) break;
    for (int64_t m = 0; m < n;) {
      const int64_t nv = vc.remaining();
      Segment sg;
      sg.at = m;
      if (nv == 0) {
        KV_INTERNAL_ASSERT(tv < tail.n, "attend: V stream shorter than K at key ", t.j0 + m);
        sg.n = std::min(tail.n - tv, n - m);
        sg.rows = true;
        for (int64_t j = 0; j < sg.n; ++j) vr[static_cast<size_t>(m + j)] = tail.v + (tv + j) * d;
        tv += sg.n;
      } else {
        sg.n = std::min(nv, n - m);
        sg.rows = vc.rows();
        if (sg.rows) {
          for (int64_t j = 0; j < sg.n; ++j) vr[static_cast<size_t>(m + j)] = vc.row(j);
        } else {
          sg.raw = vc.raw_tokens();
        }
        vc.advance(sg.n);
      }
      vs.push_back(sg);
      m += sg.n;
    }
    t.n = n;
    t.kseg = ks.data();
    t.nk_seg = ks.size();
    t.vseg = vs.data();
    t.nv_seg = vs.size();
    fn(t);
    vpf.issue();  // if fn scored no keys or read no values
    kpf.issue();
    t.j0 += n;
  }
}

/// Formats read in the rotated domain (TurboQuant, PolarQuant): keys against the rotated query,
/// values into the rotated accumulator (RotatedValues).
bool rotated_kind(fused::KernelFormat::Kind k) {
  return k == fused::KernelFormat::Kind::kTurboQuant || k == fused::KernelFormat::Kind::kPolar;
}

/// True if the fused kernels can read every block of head h's layer (and its keys need no
/// rotation on read).
bool fusable(const LayerStore& L, const common::RopeTable* rope) {
  if (rope != nullptr || !fused::available()) return false;
  for (const StreamSetup* st : {&L.key_setup(), &L.value_setup()}) {
    fused::KernelFormat tq;  // the stream's first TurboQuant format: the others must rotate alike
    for (const auto& f : st->formats.f) {
      if (f.quantizer == nullptr) continue;
      const fused::KernelFormat k = fused::classify(f);
      if (k.kind == fused::KernelFormat::Kind::kNone) return false;
      if (!rotated_kind(k.kind) && k.kind != fused::KernelFormat::Kind::kQjl) continue;
      // TurboQuant-Prod is a key format (the paper's, the turboquant scheme's); Prod values
      // (`tq:b<b>:prod` as a whole-cache scheme) would need Sᵀ of a sign accumulator per row
      // besides the inverse rotation: they take the generic path (as would QJL values; the
      // qjl scheme stores only keys so).
      if (st == &L.value_setup() && (k.tq_prod || k.kind == fused::KernelFormat::Kind::kQjl)) return false;
      if (tq.kind == fused::KernelFormat::Kind::kNone) {
        tq = k;
      } else if (!fused::same_rotation(tq, k)) {
        return false;
      }
    }
  }
  return true;
}

/// The first TurboQuant or PolarQuant (or, `qjl`, QJL) format of a stream (its rotation or sketch is every
/// such format's there: fusable()), or kind kNone.
fused::KernelFormat turboquant_format(const StreamSetup& st, bool qjl = false) {
  for (const auto& f : st.formats.f) {
    if (f.quantizer == nullptr) continue;
    const fused::KernelFormat k = fused::classify(f);
    if (rotated_kind(k.kind) || (qjl && k.kind == fused::KernelFormat::Kind::kQjl)) return k;
  }
  return {};
}

/// TurboQuant values' rotated-domain accumulator (attend_fused.h): the tiles' p·v of
/// TurboQuant segments go to `rot` (Σ p·‖v‖·f·c, unrotated), the other segments to acc; the
/// online softmax rescales both alike, and the inverse rotation folds `rot` into acc once per
/// row at the end. Inactive (no rows) when the layer's values are not TurboQuant or the generic
/// path runs.
struct RotatedValues {
  const float* signs = nullptr;
  std::vector<float> rot, m_old;

  void init(const fused::KernelFormat& vf, int64_t rows, int64_t d) {
    if (!rotated_kind(vf.kind)) return;
    signs = vf.rot_signs;
    rot.assign(static_cast<size_t>(rows * d), 0.0f);
    m_old.resize(static_cast<size_t>(rows));
  }
  bool active() const { return signs != nullptr; }
  float* data(int64_t r0, int64_t d) { return active() ? rot.data() + r0 * d : nullptr; }
  /// Before the tile's softmax: remember the rows' running maxima.
  void before_softmax(const float* m, int64_t nr) {
    if (active()) std::copy_n(m, nr, m_old.data());
  }
  /// After it: rescale rows [r0, r0 + nr) as tile_softmax rescaled acc, by exp(m_old − m_new)
  /// (0 for a row that had seen no key; std::exp here, the tile kernels' exp there: the two
  /// factors agree to float rounding).
  void after_softmax(const float* m, int64_t r0, int64_t nr, int64_t d) {
    if (!active()) return;
    for (int64_t r = 0; r < nr; ++r) {
      const float mo = m_old[static_cast<size_t>(r)], mn = m[r];
      if (mo == mn) continue;
      const float corr = mo == kNegInf ? 0.0f : std::exp(mo - mn);
      float* a = rot.data() + (r0 + r) * d;
      for (int64_t i = 0; i < d; ++i) a[i] *= corr;
    }
  }
  /// acc[r] += diag(s)·H·rot[r] for rows [r0, r0 + nr); rot's rows are zeroed for reuse.
  void fold(int64_t r0, int64_t nr, int64_t d, float* acc) {
    if (!active()) return;
    float* a = rot.data() + r0 * d;
    fused::add_rotated_back(signs, a, nr, d, acc);
    std::fill(a, a + nr * d, 0.0f);
  }
};

/// Scores of query rows [r0, r0 + nr) against a tile's keys, segment by segment.
void tile_keys(const Tile& t, const fused::Queries& fq, const float* qh, int64_t r0, int64_t nr, int64_t d,
               float scale, float* s, int64_t ld) {
  for (size_t i = 0; i < t.nk_seg; ++i) {
    const Segment& sg = t.kseg[i];
    if (sg.rows) {
      tile_scores(qh + r0 * d, nr, t.krows + sg.at, sg.n, d, scale, s + sg.at, ld);
    } else {
      fused::scores(fq, r0, nr, sg.raw, sg.n, s + sg.at, ld);
    }
  }
  if (t.vprefetch != nullptr) t.vprefetch->issue();
}

/// acc[r] += p[r] · values of a tile, for its nr rows of probabilities p (ld apart), segment by
/// segment (decoded rows or the fused kernel).
/// TurboQuant segments accumulate into `rot` instead (RotatedValues; null: none in the layer).
void tile_values(const Tile& t, const float* p, int64_t ld, int64_t nr, int64_t d, float* acc, float* rot) {
  if (t.kprefetch != nullptr) t.kprefetch->issue();
  for (size_t i = 0; i < t.nv_seg; ++i) {
    const Segment& sg = t.vseg[i];
    if (sg.rows) {
      tile_pv(p + sg.at, ld, nr, sg.n, t.vrows + sg.at, d, acc);
    } else {
      const bool rotated = rotated_kind(sg.raw.kf.kind);
      fused::accumulate(p + sg.at, ld, nr, sg.raw, sg.n, d, rotated ? rot : acc);
    }
  }
}

void attend_one_head(const AttendArgs& a, int64_t h) {
  const LayerStore& L = *a.layer;
  const int64_t d = L.head_dim(), hkv = L.num_heads(), G = a.num_q_heads / hkv, tq = a.t_q;
  const int64_t R = G * tq;  // rows, token-major: r = t·G + g
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t cap = std::max({kMinTileTokens, max_capacity(L.key_setup()), max_capacity(L.value_setup())});
  Tail tail;
  if (a.tail_n > 0) tail = Tail{a.tail_k + h * a.tail_n * d, a.tail_v + h * a.tail_n * d, a.tail_pos, a.tail_n};
  std::vector<float> qh(static_cast<size_t>(R * d));
  std::vector<int64_t> rpos(static_cast<size_t>(R));
  for (int64_t t = 0; t < tq; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const float* src = a.q + ((h * G + g) * tq + t) * d;
      std::copy_n(src, d, qh.data() + (t * G + g) * d);
      rpos[static_cast<size_t>(t * G + g)] = a.q_pos[t];
    }
  }
  // Attention mass of the selected rows (the last `sel_t` query tokens), over the stored keys.
  const int64_t th = L.resident(h);
  const int64_t sel_t = a.need.any() ? a.need.selected(tq) : 0;
  const int64_t sel_first = R - sel_t * G;  // first selected row
  const bool per_row = a.need.per_row;
  const bool reduce_max = a.need.reduce == AttentionNeed::Reduce::kMax;
  const bool buffered = sel_t > 0 && sel_t * G * th <= a.max_buffered_scores;
  std::vector<float> sbuf;
  if (buffered) sbuf.assign(static_cast<size_t>(sel_t * G * th), kNegInf);
  std::vector<float> m_sel(static_cast<size_t>(sel_t * G)), l_sel(static_cast<size_t>(sel_t * G));
  // Of a tile's keys [j0, j0 + n), those that are stored tokens (the mass covers only them).
  auto stored_in = [th](const Tile& t) { return std::max<int64_t>(0, std::min(t.n, th - t.j0)); };

  const bool raw = a.fused && fusable(L, a.rope);
  fused::Queries fq;
  RotatedValues rv;
  if (raw) {
    fused::prepare(qh.data(), R, d, scale, fq);
    const fused::KernelFormat ktq = turboquant_format(L.key_setup(), /*qjl=*/true);
    if (ktq.kind != fused::KernelFormat::Kind::kNone) fused::rotate_queries(ktq, fq);
    rv.init(turboquant_format(L.value_setup()), kRowBlock, d);
  }
  std::vector<float> s(static_cast<size_t>(kRowBlock * cap));
  std::vector<float> m(static_cast<size_t>(kRowBlock)), l(static_cast<size_t>(kRowBlock));
  std::vector<float> acc(static_cast<size_t>(kRowBlock * d));
  for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
    const int64_t nr = std::min(kRowBlock, R - r0);
    std::fill(m.begin(), m.end(), kNegInf);
    std::fill(l.begin(), l.end(), 0.0f);
    std::fill(acc.begin(), acc.end(), 0.0f);
    const int64_t* rp = rpos.data() + r0;
    const int64_t min_q = *std::min_element(rp, rp + nr), max_q = *std::max_element(rp, rp + nr);
    for_each_tile(L, h, a.rope, raw, tail, min_q, max_q, cap, TokenRange{}, [&](const Tile& t) {
      tile_keys(t, fq, qh.data(), r0, nr, d, scale, s.data(), cap);
      if (t.last_pos > min_q) tile_mask(s.data(), cap, nr, t.n, t.kpos, rp);
      const int64_t ns = stored_in(t);
      if (buffered && r0 + nr > sel_first && ns > 0) {
        for (int64_t r = std::max(r0, sel_first); r < r0 + nr; ++r) {
          std::copy_n(s.data() + (r - r0) * cap, ns, sbuf.data() + (r - sel_first) * th + t.j0);
        }
      }
      rv.before_softmax(m.data(), nr);
      tile_softmax(s.data(), cap, nr, t.n, d, m.data(), l.data(), acc.data());
      rv.after_softmax(m.data(), 0, nr, d);
      tile_values(t, s.data(), cap, nr, d, acc.data(), rv.data(0, d));
    });
    rv.fold(0, nr, d, acc.data());
    for (int64_t r = r0; r < r0 + nr; ++r) {
      const int64_t t = r / G, g = r % G;
      float* dst = a.out + ((h * G + g) * tq + t) * d;
      const float lr = l[static_cast<size_t>(r - r0)];
      const float inv = lr > 0.0f ? 1.0f / lr : 0.0f;
      const float* ar = acc.data() + (r - r0) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = ar[i] * inv;
      if (r >= sel_first) {
        m_sel[static_cast<size_t>(r - sel_first)] = m[static_cast<size_t>(r - r0)];
        l_sel[static_cast<size_t>(r - sel_first)] = lr;
      }
    }
  }
  if (sel_t == 0) return;

  // Mass: mean over the G query heads of each selected token's probabilities (or the max over
  // heads and rows); per row or summed.
  auto& out = a.mass->heads[static_cast<size_t>(h)];
  out.assign(static_cast<size_t>((per_row ? sel_t : 1) * th), 0.0f);
  if (th == 0) return;
  const float w = 1.0f / static_cast<float>(G);
  const int64_t nsel = sel_t * G;
  std::vector<float*> mass_rows(static_cast<size_t>(nsel));
  for (int64_t i = 0; i < nsel; ++i) {
    const int64_t row_out = per_row ? i / G : 0;
    mass_rows[static_cast<size_t>(i)] = out.data() + row_out * th;
  }
  auto mass = [&](const float* sc, int64_t ld, int64_t nr, int64_t n, const float* mm, const float* ll,
                  float* const* rows) {
    if (reduce_max) {
      tile_mass_max(sc, ld, nr, n, mm, ll, rows);
    } else {
      tile_mass(sc, ld, nr, n, mm, ll, w, rows);
    }
  };
  if (buffered) {
    for (int64_t i = 0; i < nsel; ++i) {
      mass(sbuf.data() + i * th, th, 1, th, m_sel.data() + i, l_sel.data() + i, mass_rows.data() + i);
    }
    return;
  }
  // Second pass over the blocks for the selected rows only.
  const int64_t* rp = rpos.data() + sel_first;
  const int64_t min_q = *std::min_element(rp, rp + nsel), max_q = *std::max_element(rp, rp + nsel);
  for (int64_t r0 = 0; r0 < nsel; r0 += kRowBlock) {
    const int64_t nr = std::min(kRowBlock, nsel - r0);
    std::vector<float*> rows_at(static_cast<size_t>(nr));
    for_each_tile(L, h, a.rope, raw, tail, min_q, max_q, cap, TokenRange{}, [&](const Tile& t) {
      const int64_t ns = stored_in(t);
      if (ns == 0) return;
      tile_keys(t, fq, qh.data(), sel_first + r0, nr, d, scale, s.data(), cap);
      if (t.last_pos > min_q) tile_mask(s.data(), cap, nr, t.n, t.kpos, rp + r0);
      for (int64_t r = 0; r < nr; ++r) rows_at[static_cast<size_t>(r)] = mass_rows[static_cast<size_t>(r0 + r)] + t.j0;
      mass(s.data(), cap, nr, ns, m_sel.data() + r0, l_sel.data() + r0, rows_at.data());
    });
  }
}

}  // namespace

void PartialState::reset(int64_t rows_, int64_t d_) {
  rows = rows_;
  d = d_;
  m.assign(static_cast<size_t>(rows), kNegInf);
  l.assign(static_cast<size_t>(rows), 0.0f);
  acc.assign(static_cast<size_t>(rows * d), 0.0f);
}

void attend_range(const RangeArgs& a, PartialState& st) {
  const LayerStore& L = *a.layer;
  const int64_t d = L.head_dim(), R = a.rows;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t cap = std::max({kMinTileTokens, max_capacity(L.key_setup()), max_capacity(L.value_setup())});
  st.reset(R, d);
  if (R == 0 || a.count <= 0) return;
  const bool raw = a.fused && fusable(L, a.rope);
  fused::Queries fq;
  const int64_t rb = std::min(R, kRangeRowBlock);
  RotatedValues rv;
  if (raw) {
    fused::prepare(a.q, R, d, scale, fq);
    const fused::KernelFormat ktq = turboquant_format(L.key_setup(), /*qjl=*/true);
    if (ktq.kind != fused::KernelFormat::Kind::kNone) fused::rotate_queries(ktq, fq);
    rv.init(turboquant_format(L.value_setup()), rb, d);
  }
  std::vector<float> s(static_cast<size_t>(rb * cap));
  for (int64_t r0 = 0; r0 < R; r0 += rb) {
    const int64_t nr = std::min(rb, R - r0);
    float* m = st.m.data() + r0;
    float* l = st.l.data() + r0;
    float* acc = st.acc.data() + r0 * d;
    const int64_t* rp = a.q_pos + r0;
    const int64_t min_q = *std::min_element(rp, rp + nr), max_q = *std::max_element(rp, rp + nr);
    for_each_tile(L, a.head, a.rope, raw, Tail{}, min_q, max_q, cap, TokenRange{a.first, a.count},
                  [&](const Tile& t) {
                    tile_keys(t, fq, a.q, r0, nr, d, scale, s.data(), cap);
                    if (t.last_pos > min_q) tile_mask(s.data(), cap, nr, t.n, t.kpos, rp);
                    rv.before_softmax(m, nr);
                    tile_softmax(s.data(), cap, nr, t.n, d, m, l, acc);
                    rv.after_softmax(m, 0, nr, d);
                    tile_values(t, s.data(), cap, nr, d, acc, rv.data(0, d));
                  });
    rv.fold(0, nr, d, acc);
  }
}

void merge_partial(float* m, float* l, float* acc, float m2, float l2, const float* acc2, int64_t d) {
  if (m2 == kNegInf) return;  // b saw no key
  if (*m == kNegInf) {
    *m = m2;
    *l = l2;
    std::copy_n(acc2, d, acc);
    return;
  }
  const float mn = std::max(*m, m2);
  const float ca = std::exp(*m - mn), cb = std::exp(m2 - mn);
  *m = mn;
  *l = *l * ca + l2 * cb;
  for (int64_t i = 0; i < d; ++i) acc[i] = acc[i] * ca + acc2[i] * cb;
}

void normalize_partial(float l, const float* acc, int64_t d, float* out) {
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int64_t i = 0; i < d; ++i) out[i] = acc[i] * inv;
}

int64_t range_walks(int64_t rows) { return (rows + kRangeRowBlock - 1) / kRangeRowBlock; }
int64_t head_walks(const AttendArgs& a) {
  return (a.t_q * (a.num_q_heads / a.layer->num_heads()) + kRowBlock - 1) / kRowBlock;
}

void begin_attend(const AttendArgs& a) {
  if (a.need.any()) {
    a.mass->rows = a.need.per_row ? a.need.selected(a.t_q) : 1;
    a.mass->heads.assign(static_cast<size_t>(a.layer->num_heads()), {});
  }
}

void attend_head(const AttendArgs& a, int64_t h) { attend_one_head(a, h); }

int64_t head_work(const AttendArgs& a) {
  return (a.layer->max_resident() + a.tail_n) * (a.num_q_heads / a.layer->num_heads()) * a.t_q * a.layer->head_dim();
}

int64_t split_parts(const AttendArgs& a, int64_t threads) {
  const int64_t hkv = a.layer->num_heads();
  if (threads < 2 || a.need.any() || a.tail_n > 0 || hkv % threads == 0) return 1;
  const int64_t most = head_work(a) / kSplitGrain;  // runs the grain allows per head
  const int64_t even = threads / std::gcd(hkv, threads);
  const int64_t p = even <= most ? even : std::min(most, (threads + hkv - 1) / hkv);
  return p >= 2 ? p : 1;
}

std::vector<int64_t> split_points(const LayerStore& L, int64_t h, int64_t parts) {
  std::vector<int64_t> cum{0};  // live tokens before each K block boundary
  {
    StreamBlockWalk w(L.k(h));
    const BlockList* list = nullptr;
    const Block* block = nullptr;
    while (w.next(&list, &block)) cum.push_back(cum.back() + block->live);
  }
  const int64_t total = cum.back();
  std::vector<int64_t> cuts{0};
  size_t b = 0;
  for (int64_t i = 1; i < parts; ++i) {
    const int64_t target = i * total / parts;
    while (b + 1 < cum.size() && cum[b + 1] <= target) ++b;  // cum[b] ≤ target < cum[b + 1]
    int64_t cut = cum[b];
    if (b + 1 < cum.size() && cum[b + 1] - target < target - cum[b]) cut = cum[b + 1];
    cuts.push_back(std::max(cuts.back(), cut));
  }
  cuts.push_back(total);
  return cuts;
}

int64_t attend_threads() { return detail::max_threads(); }

void attend_split(const AttendArgs& a, int64_t parts) {
  KV_INTERNAL_ASSERT(!a.need.any() && a.tail_n == 0 && parts >= 1,
                     "attend_split: needs no mass and no tail, parts >= 1; got parts ", parts);
  begin_attend(a);
  const LayerStore& L = *a.layer;
  const int64_t hkv = L.num_heads(), d = L.head_dim(), G = a.num_q_heads / hkv, tq = a.t_q;
  const int64_t R = G * tq;  // rows per head, token-major as attend_one_head: r = t·G + g
  std::vector<float> q(static_cast<size_t>(hkv * R * d));
  std::vector<int64_t> rpos(static_cast<size_t>(R));
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t t = 0; t < tq; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        std::copy_n(a.q + ((h * G + g) * tq + t) * d, d, q.data() + (h * R + t * G + g) * d);
      }
    }
  }
  for (int64_t t = 0; t < tq; ++t) std::fill_n(rpos.data() + t * G, G, a.q_pos[t]);
  std::vector<std::vector<int64_t>> cuts(static_cast<size_t>(hkv));
  for (int64_t h = 0; h < hkv; ++h) cuts[static_cast<size_t>(h)] = split_points(L, h, parts);
  std::vector<PartialState> states(static_cast<size_t>(hkv * parts));
  // One run per task; parallel_for hands each thread a contiguous share of the tasks.
  detail::parallel_for(0, hkv * parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t h = i / parts, p = i % parts;
      const std::vector<int64_t>& c = cuts[static_cast<size_t>(h)];
      RangeArgs ra;
      ra.layer = &L;
      ra.head = h;
      ra.rope = a.rope;
      ra.fused = a.fused;
      ra.q = q.data() + h * R * d;
      ra.q_pos = rpos.data();
      ra.rows = R;
      ra.first = c[static_cast<size_t>(p)];
      ra.count = c[static_cast<size_t>(p + 1)] - ra.first;
      attend_range(ra, states[static_cast<size_t>(i)]);
    }
  });
  // Per head: the runs merged into the first, in run order, then normalised into the output.
  for (int64_t h = 0; h < hkv; ++h) {
    PartialState& st = states[static_cast<size_t>(h * parts)];
    for (int64_t p = 1; p < parts; ++p) {
      const PartialState& o = states[static_cast<size_t>(h * parts + p)];
      for (int64_t r = 0; r < R; ++r) {
        const auto ri = static_cast<size_t>(r);
        merge_partial(&st.m[ri], &st.l[ri], st.acc.data() + r * d, o.m[ri], o.l[ri], o.acc.data() + r * d, d);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = r / G, g = r % G;
      normalize_partial(st.l[static_cast<size_t>(r)], st.acc.data() + r * d, d, a.out + ((h * G + g) * tq + t) * d);
    }
  }
}

void attend_generic(const AttendArgs& a) {
  if (const int64_t parts = split_parts(a, attend_threads()); parts > 1) {
    attend_split(a, parts);
    return;
  }
  begin_attend(a);
  const int64_t hkv = a.layer->num_heads();
  // Parallel over KV heads once a head's work is worth a thread (≈ 64 Ki multiply-adds).
  detail::parallel_for(0, hkv, head_work(a) >= (int64_t{1} << 16) ? 1 : hkv, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h) attend_one_head(a, h);
  });
}

}  // namespace kvcache::cache
