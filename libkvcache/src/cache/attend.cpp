// SPDX-License-Identifier: Apache-2.0
// The generic block-by-block attention (attend.h). Compiled with -fopenmp-simd (SIMD
// reductions, no OpenMP runtime) and -ffp-contract=fast (FMAs in the dot products); the
// tile kernels are built once per vector width, each with its ISA enabled (TileKernels).
#include "cache/attend.h"
#include "cache/attend_fused.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "kvcache/error.h"
#include "quant/simd.h"

namespace kvcache::cache {
namespace {

using quant::bits_float;
using quant::float_bits;

constexpr int64_t kRowBlock = 64;
/// Blocks a stream's cursor prefetches ahead of the one it reads (Cursor::prefetch_next).
/// bench_attention at 32k, one thread (CPU time, 2 runs): one block ahead took int8 from 2.05
/// to 1.50 ms, int4 1.64 -> 1.32, fp16 3.3 -> 2.56, KIVI-2 1.81 -> 1.53; two or four ahead
/// were no better.
constexpr int kPrefetchBlocks = 1;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

/// The steps shared by exp_nonpos and vexp_nonpos (T = float or a float vector), for xc in
/// [−87.3, 0]: sets t (n + 1.5·2^23, whose low bits hold n) and returns the polynomial's value,
/// e^(xc − n·ln 2).
template <class T>
KV_ALWAYS_INLINE T exp_reduced(T xc, T& t) {
  t = xc * 1.44269504088896341f + 12582912.0f;  // round to nearest via 1.5·2^23
  const T n = t - 12582912.0f;
  T r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const T z = r * r;
  T y = T{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  return y * z + r + 1.0f;
}

/// exp(x) for x ≤ 0 (softmax arguments), 0 for x < −87.3 (incl. −inf). Cephes' expf:
/// n = round(x·log2 e), r = x − n·ln 2 (two-part constant), degree-6 polynomial, scaled by
/// 2^n through the exponent bits; about 2 ulp. For scalar tails and per-row corrections: loops
/// take vexp_nonpos (a float ?: keeps GCC from vectorizing a loop over this one).
KV_ALWAYS_INLINE float exp_nonpos(float x) {
  const bool live = x > -87.3f;
  const float xc = live ? x : -87.3f;
  float t;
  const float y = exp_reduced(xc, t);
  const int32_t ni = static_cast<int32_t>(float_bits(t) - 0x4B400000u);
  const float p2 = bits_float(static_cast<uint32_t>(ni + 127) << 23);
  return live ? y * p2 : 0.0f;
}

// ---- SIMD building blocks (GCC/Clang vector extensions), templated on the lane count W ----
// Each ISA gets the width of its registers: W = 16 for AVX-512, 8 for AVX2, 4 for baseline
// x86-64 and other targets. A vector type wider than the target's registers is lowered by the
// compiler to element moves through the stack: with one 16-lane source for every clone, the
// AVX2 build of tile_pv spent its time in stack stores and lane inserts, and the generic path
// ran 2.6× slower than the float32 baseline on an AVX2-only AMD EPYC (docs/performance.md,
// "Without AVX-512"). The kernels' entry points (TileKernels) are compiled once per width
// with that ISA's target attribute and picked for the running CPU once.
template <int W>
struct VecOf;
template <>
struct VecOf<4> {
  typedef float f __attribute__((vector_size(16)));
  typedef int32_t i __attribute__((vector_size(16)));
};
template <>
struct VecOf<8> {
  typedef float f __attribute__((vector_size(32)));
  typedef int32_t i __attribute__((vector_size(32)));
};
template <>
struct VecOf<16> {
  typedef float f __attribute__((vector_size(64)));
  typedef int32_t i __attribute__((vector_size(64)));
};
template <int W>
using vf = typename VecOf<W>::f;
template <int W>
using vi = typename VecOf<W>::i;

template <int W>
KV_ALWAYS_INLINE vf<W> vload(const float* p) {
  vf<W> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int W>
KV_ALWAYS_INLINE void vstore(float* p, vf<W> v) {
  std::memcpy(p, &v, sizeof v);
}
template <int W>
KV_ALWAYS_INLINE vf<W> vsplat(float x) {
  return vf<W>{} + x;
}

/// exp_nonpos lane by lane, as vector operations (the same steps, so the same value per lane).
template <int W>
KV_ALWAYS_INLINE vf<W> vexp_nonpos(vf<W> x) {
  const vi<W> live = x > vsplat<W>(-87.3f);
  const vf<W> xc = live ? x : vsplat<W>(-87.3f);
  vf<W> t;
  const vf<W> y = exp_reduced(xc, t);
  const vi<W> ni = __builtin_bit_cast(vi<W>, t) - 0x4B400000;
  const vi<W> e = (ni + 127) << 23;
  const vf<W> p2 = __builtin_bit_cast(vf<W>, e);
  return live ? y * p2 : vf<W>{};
}

/// Lanes [0, W/2): adjacent pair sums of a; lanes [W/2, W): of b.
template <int W, size_t... I>
KV_ALWAYS_INLINE vf<W> pair_sums_impl(vf<W> a, vf<W> b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, (2 * I)...) + __builtin_shufflevector(a, b, (2 * I + 1)...);
}
template <int W>
KV_ALWAYS_INLINE vf<W> pair_sums(vf<W> a, vf<W> b) {
  return pair_sums_impl<W>(a, b, std::make_index_sequence<W>{});
}

/// Lane j of the result = the sum of the W lanes of v[j] (a fixed tree: W − 1 shuffle-add
/// pairs for W sums instead of W serial reductions).
template <int W>
KV_ALWAYS_INLINE vf<W> hsum(vf<W>* v) {
  for (int w = W / 2; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) v[i] = pair_sums<W>(v[2 * i], v[2 * i + 1]);
  }
  return v[0];
}

/// s[r·ld + j] = (q_r · k_j) · scale for r < nr, j < n; D = W·C.
template <int W, int C>
KV_ALWAYS_INLINE void scores_vec(const float* q, int64_t nr, const float* const* krows, int64_t n, float scale,
                                 float* s, int64_t ld) {
  constexpr int64_t D = W * C;
  for (int64_t r = 0; r < nr; ++r) {
    vf<W> qr[C];
    for (int c = 0; c < C; ++c) qr[c] = vload<W>(q + r * D + W * c);
    for (int64_t j0 = 0; j0 < n; j0 += W) {
      const int64_t m = std::min<int64_t>(W, n - j0);
      vf<W> acc[W];
      for (int64_t j = 0; j < W; ++j) {
        vf<W> a{};
        if (j < m) {
          const float* k = krows[j0 + j];
          for (int c = 0; c < C; ++c) a += qr[c] * vload<W>(k + W * c);
        }
        acc[j] = a;
      }
      const vf<W> sums = hsum<W>(acc) * scale;
      if (m == W) {
        vstore<W>(s + r * ld + j0, sums);
      } else {
        float tmp[W];
        vstore<W>(tmp, sums);
        std::memcpy(s + r * ld + j0, tmp, static_cast<size_t>(m) * sizeof(float));
      }
    }
  }
}

template <int W>
KV_ALWAYS_INLINE void tile_scores_w(const float* __restrict q, int64_t nr, const float* const* krows, int64_t n,
                                    int64_t d, float scale, float* __restrict s, int64_t ld) {
  switch (d) {
    case 16: return scores_vec<W, 16 / W>(q, nr, krows, n, scale, s, ld);
    case 32: return scores_vec<W, 32 / W>(q, nr, krows, n, scale, s, ld);
    case 64: return scores_vec<W, 64 / W>(q, nr, krows, n, scale, s, ld);
    case 128: return scores_vec<W, 128 / W>(q, nr, krows, n, scale, s, ld);
    default: break;
  }
  for (int64_t r = 0; r < nr; ++r) {
    const float* __restrict qr = q + r * d;
    for (int64_t j = 0; j < n; ++j) {
      const float* __restrict k = krows[j];
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < d; ++i) acc += qr[i] * k[i];
      s[r * ld + j] = acc * scale;
    }
  }
}

/// Hides key j from row r when its position is after the row's.
void tile_mask(float* s, int64_t ld, int64_t nr, int64_t n, const int64_t* kpos, const int64_t* rpos) {
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      if (kpos[j] > rpos[r]) s[r * ld + j] = kNegInf;
    }
  }
}

/// Largest of n floats with W-lane vectors (a fixed reduction tree).
template <int W>
KV_ALWAYS_INLINE float vmax(const float* x, int64_t n) {
  vf<W> m = vsplat<W>(kNegInf);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const vf<W> v = vload<W>(x + j);
    m = v > m ? v : m;
  }
  float r = kNegInf;
  for (int i = 0; i < W; ++i) r = m[i] > r ? m[i] : r;
  for (; j < n; ++j) r = x[j] > r ? x[j] : r;
  return r;
}

/// Online-softmax step of rows r < nr over a tile's scores (masked: −inf): turns s into
/// p = exp(s − m_new) in place, rescales the row's accumulator and sum by exp(m_old − m_new).
template <int W>
KV_ALWAYS_INLINE void tile_softmax_w(float* __restrict s, int64_t ld, int64_t nr, int64_t n, int64_t d,
                                     float* __restrict m, float* __restrict l, float* __restrict acc) {
  for (int64_t r = 0; r < nr; ++r) {
    float* __restrict sr = s + r * ld;
    const float mt = vmax<W>(sr, n);
    if (mt == kNegInf) {  // every key of the tile is hidden from this row
      for (int64_t j = 0; j < n; ++j) sr[j] = 0.0f;
      continue;
    }
    const float mn = m[r] > mt ? m[r] : mt;
    const float corr = m[r] == kNegInf ? 0.0f : exp_nonpos(m[r] - mn);
    vf<W> sumv{};
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      const vf<W> e = vexp_nonpos<W>(vload<W>(sr + j) - mn);
      vstore<W>(sr + j, e);
      sumv += e;
    }
    float sum = 0.0f;
    for (int i = 0; i < W; ++i) sum += sumv[i];
    for (; j < n; ++j) {
      sr[j] = exp_nonpos(sr[j] - mn);
      sum += sr[j];
    }
    l[r] = l[r] * corr + sum;
    m[r] = mn;
    if (corr != 1.0f) {
      float* __restrict ar = acc + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) ar[i] *= corr;
    }
  }
}

/// acc_r += Σ_j p_j · v_j with the row in registers; D = W·C.
template <int W, int C>
KV_ALWAYS_INLINE void accumulate_vec(float* ar, const float* p, int64_t n, const float* const* vrows) {
  vf<W> a[C];
  for (int c = 0; c < C; ++c) a[c] = vload<W>(ar + W * c);
  for (int64_t j = 0; j < n; ++j) {
    const vf<W> pj = vsplat<W>(p[j]);
    const float* v = vrows[j];
    for (int c = 0; c < C; ++c) a[c] += pj * vload<W>(v + W * c);
  }
  for (int c = 0; c < C; ++c) vstore<W>(ar + W * c, a[c]);
}

/// acc_r += Σ_j p[r·ld + j] · v_j for rows r < nr.
template <int W>
KV_ALWAYS_INLINE void tile_pv_w(const float* __restrict p, int64_t ld, int64_t nr, int64_t n,
                                const float* const* vrows, int64_t d, float* __restrict acc) {
  for (int64_t r = 0; r < nr; ++r) {
    const float* __restrict pr = p + r * ld;
    float* __restrict ar = acc + r * d;
    switch (d) {
      case 16: accumulate_vec<W, 16 / W>(ar, pr, n, vrows); continue;
      case 32: accumulate_vec<W, 32 / W>(ar, pr, n, vrows); continue;
      case 64: accumulate_vec<W, 64 / W>(ar, pr, n, vrows); continue;
      case 128: accumulate_vec<W, 128 / W>(ar, pr, n, vrows); continue;
      default: break;
    }
    for (int64_t j = 0; j < n; ++j) {
      const float pj = pr[j];
      if (pj == 0.0f) continue;
      const float* __restrict v = vrows[j];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) ar[i] += pj * v[i];
    }
  }
}

/// p = exp(s − m_r) / l_r for the tile's scores of rows r < nr, added (× w) into
/// `mass_rows[row_of[r]] + j0`.
template <int W>
KV_ALWAYS_INLINE void tile_mass_w(const float* __restrict s, int64_t ld, int64_t nr, int64_t n, const float* m,
                                  const float* l, float w, float* const* mass_rows) {
  for (int64_t r = 0; r < nr; ++r) {
    if (l[r] <= 0.0f) continue;
    const float* __restrict sr = s + r * ld;
    float* __restrict out = mass_rows[r];
    const float mr = m[r], inv = w / l[r];
    int64_t j = 0;
    for (; j + W <= n; j += W) vstore<W>(out + j, vload<W>(out + j) + vexp_nonpos<W>(vload<W>(sr + j) - mr) * inv);
    for (; j < n; ++j) out[j] += exp_nonpos(sr[j] - mr) * inv;
  }
}

// ---- The tile kernels' entry points, one set per ISA (picked once: tile_kernels()) ----------
using ScoresFn = void (*)(const float*, int64_t, const float* const*, int64_t, int64_t, float, float*, int64_t);
using SoftmaxFn = void (*)(float*, int64_t, int64_t, int64_t, int64_t, float*, float*, float*);
using PvFn = void (*)(const float*, int64_t, int64_t, int64_t, const float* const*, int64_t, float*);
using MassFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, const float*, float, float* const*);
struct TileKernels {
  ScoresFn scores;
  SoftmaxFn softmax;
  PvFn pv;
  MassFn mass;
  int lanes;
};

#define KV_TILE_KERNELS(SUFFIX, ATTR, W)                                                                   \
  ATTR void tile_scores_##SUFFIX(const float* q, int64_t nr, const float* const* krows, int64_t n, int64_t d, \
                                 float scale, float* s, int64_t ld) {                                       \
    tile_scores_w<W>(q, nr, krows, n, d, scale, s, ld);                                                     \
  }                                                                                                         \
  ATTR void tile_softmax_##SUFFIX(float* s, int64_t ld, int64_t nr, int64_t n, int64_t d, float* m, float* l, \
                                  float* acc) {                                                             \
    tile_softmax_w<W>(s, ld, nr, n, d, m, l, acc);                                                          \
  }                                                                                                         \
  ATTR void tile_pv_##SUFFIX(const float* p, int64_t ld, int64_t nr, int64_t n, const float* const* vrows,   \
                             int64_t d, float* acc) {                                                       \
    tile_pv_w<W>(p, ld, nr, n, vrows, d, acc);                                                              \
  }                                                                                                         \
  ATTR void tile_mass_##SUFFIX(const float* s, int64_t ld, int64_t nr, int64_t n, const float* m, const float* l, \
                               float w, float* const* mass_rows) {                                          \
    tile_mass_w<W>(s, ld, nr, n, m, l, w, mass_rows);                                                       \
  }

#if defined(__x86_64__) && defined(__GNUC__) && defined(__ELF__) && !defined(KVCACHE_NO_TARGET_CLONES)
#define KV_TILE_MULTI_ISA 1
// The features of x86-64-v4 and v3 (KV_TARGET_CLONES' levels) that code of this kind uses,
// named as both GCC's and Clang's __builtin_cpu_supports know them, so that what a build may
// use is exactly what pick_tile_kernels() asks of the CPU.
#define KV_TILE_V3_FEATURES "avx2,fma,bmi,bmi2,popcnt"
#define KV_TILE_V4_FEATURES "avx512f,avx512bw,avx512dq,avx512vl,avx512cd," KV_TILE_V3_FEATURES
KV_TILE_KERNELS(v4, __attribute__((target(KV_TILE_V4_FEATURES))), 16)
KV_TILE_KERNELS(v3, __attribute__((target(KV_TILE_V3_FEATURES))), 8)
#endif
KV_TILE_KERNELS(base, , 4)
#undef KV_TILE_KERNELS

constexpr TileKernels kBaseKernels{tile_scores_base, tile_softmax_base, tile_pv_base, tile_mass_base, 4};

/// The widest set of kernels this CPU runs, or the one of `lanes` (0: the widest).
TileKernels pick_tile_kernels(int lanes) {
#if defined(KV_TILE_MULTI_ISA)
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
                  __builtin_cpu_supports("popcnt");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                  __builtin_cpu_supports("avx512cd");
  if (v4 && (lanes == 0 || lanes == 16)) return {tile_scores_v4, tile_softmax_v4, tile_pv_v4, tile_mass_v4, 16};
  if (v3 && (lanes == 0 || lanes == 8)) return {tile_scores_v3, tile_softmax_v3, tile_pv_v3, tile_mass_v3, 8};
#endif
  return kBaseKernels;
}

/// The tile kernels in use: the widest the CPU runs, or 8 lanes under KVCACHE_FUSED_ISA=avx2,
/// so that with the AVX2 fused kernels the online softmax and the generic path also sum as an
/// AVX2-only CPU does (the attention arithmetic of such a CPU, reproduced on an AVX-512 one).
TileKernels& tile_kernels() {
  static TileKernels k = pick_tile_kernels(fused::requested_isa() == fused::FusedIsa::kAvx2 ? 8 : 0);
  return k;
}

void tile_scores(const float* q, int64_t nr, const float* const* krows, int64_t n, int64_t d, float scale, float* s,
                 int64_t ld) {
  tile_kernels().scores(q, nr, krows, n, d, scale, s, ld);
}
void tile_softmax(float* s, int64_t ld, int64_t nr, int64_t n, int64_t d, float* m, float* l, float* acc) {
  tile_kernels().softmax(s, ld, nr, n, d, m, l, acc);
}
void tile_pv(const float* p, int64_t ld, int64_t nr, int64_t n, const float* const* vrows, int64_t d, float* acc) {
  tile_kernels().pv(p, ld, nr, n, vrows, d, acc);
}
void tile_mass(const float* s, int64_t ld, int64_t nr, int64_t n, const float* m, const float* l, float w,
               float* const* mass_rows) {
  tile_kernels().mass(s, ld, nr, n, m, l, w, mass_rows);
}

/// Walks one stream's live tokens block by block (quantized list, then residual list). In
/// decode mode each block is decoded once into float32 (pre-RoPE keys rotated by position);
/// in raw mode (the fused kernels) the block is read as stored. Rows and slot lists handed
/// out stay valid until the second begin_tile() after them: a tile may span several blocks.
class Cursor {
 public:
  Cursor(const HeadStream& s, float tensor_scale, const RopeTable* rope, int64_t d, bool raw)
      : scale_(tensor_scale), rope_(rope), d_(d), raw_(raw), walk_(s), ahead_(s) {
    for (int i = 0; i < kPrefetchBlocks; ++i) prefetch_next();
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
  /// overlap the kernels' arithmetic over the block before it.
  void prefetch_next() {
    const BlockList* list = nullptr;
    const Block* block = nullptr;
    if (!ahead_.next(&list, &block)) return;
    const BlockFormat& f = list->format(*block);
    const auto* p = static_cast<const char*>(static_cast<const void*>(f.pool->data(block->id)));
    for (int64_t o = 0; o < f.block_bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
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
    next_ = 0;
    return true;
  }

  float scale_;
  const RopeTable* rope_;
  int64_t d_;
  bool raw_;
  StreamBlockWalk walk_;
  StreamBlockWalk ahead_;  ///< kPrefetchBlocks blocks in front of walk_
  std::vector<Loaded> pool_;  ///< blocks loaded for the current tile (the current one last)
  size_t cur_ = 0, free_ = 0;
  bool have_ = false;
  size_t next_ = 0;
  fused::KernelFormat kf_cache_[StreamFormats::kCount];  ///< per format index, classified once
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
};

/// Keys per tile: at least kMinTileTokens and at least the largest block of the layer. Long
/// enough that the online softmax's per-row work (max, rescale, sums) is spread over many
/// keys, short enough that a row block's scores stay in L1/L2. (bench_attention at 32k: 128-
/// and 256-key tiles were no faster than 64 for per-token formats, and 8-10% slower for int8.)
constexpr int64_t kMinTileTokens = 64;

int64_t max_capacity(const StreamSetup& st) {
  int64_t c = 0;
  for (const auto& f : st.formats.f) c = std::max(c, f.capacity);
  return c;
}

/// Iterates the tiles of one head's keys: fn(const Tile&). Stops after the first tile that
/// reaches keys lying after `max_qpos`; fills Tile::kpos only for tiles reaching past
/// `min_qpos` (the only ones a mask touches).
template <class Fn>
void for_each_tile(const LayerStore& L, int64_t h, const RopeTable* rope, bool raw, int64_t min_qpos, int64_t max_qpos,
                   int64_t tile_tokens, Fn&& fn) {
  const int64_t d = L.head_dim();
  Cursor kc(L.k(h), L.k_scale(), rope, d, raw);
  Cursor vc(L.v(h), L.v_scale(), nullptr, d, raw);
  std::vector<const float*> kr(static_cast<size_t>(tile_tokens)), vr(static_cast<size_t>(tile_tokens));
  std::vector<int64_t> kpos(static_cast<size_t>(tile_tokens));
  std::vector<Segment> ks, vs;
  Tile t;
  t.krows = kr.data();
  t.vrows = vr.data();
  t.kpos = kpos.data();
  bool done = false;
  while (!done) {
    kc.begin_tile();
    vc.begin_tile();
    ks.clear();
    vs.clear();
    int64_t n = 0;
    bool need_pos = false;
    while (n < tile_tokens) {
      const int64_t nk = kc.remaining();
      if (nk == 0) {
        done = true;
        break;
      }
      if (kc.position(0) > max_qpos) {  // positions increase along the stream: nothing later is visible
        done = true;
        break;
      }
      Segment sg;
      sg.at = n;
      sg.n = std::min(nk, tile_tokens - n);
      sg.rows = kc.rows();
      if (sg.rows) {
        for (int64_t j = 0; j < sg.n; ++j) kr[static_cast<size_t>(n + j)] = kc.row(j);
      } else {
        sg.raw = kc.raw_tokens();
      }
      t.last_pos = kc.position(sg.n - 1);
      if (t.last_pos > min_qpos) {  // some key may be hidden from some row: the mask needs positions
        if (!need_pos) {
          // Keys of the tile's earlier segments lie at or before min_qpos (positions grow
          // along the stream) and no row hides them: min_qpos stands in for their positions.
          std::fill(kpos.begin(), kpos.begin() + n, min_qpos);
          need_pos = true;
        }
        for (int64_t j = 0; j < sg.n; ++j) kpos[static_cast<size_t>(n + j)] = kc.position(j);
      }
      ks.push_back(sg);
      kc.advance(sg.n);
      n += sg.n;
    }
    if (n == 0) break;
    for (int64_t m = 0; m < n;) {
      const int64_t nv = vc.remaining();
      KV_INTERNAL_ASSERT(nv > 0, "attend: V stream shorter than K at key ", t.j0 + m);
      Segment sg;
      sg.at = m;
      sg.n = std::min(nv, n - m);
      sg.rows = vc.rows();
      if (sg.rows) {
        for (int64_t j = 0; j < sg.n; ++j) vr[static_cast<size_t>(m + j)] = vc.row(j);
      } else {
        sg.raw = vc.raw_tokens();
      }
      vs.push_back(sg);
      vc.advance(sg.n);
      m += sg.n;
    }
    t.n = n;
    t.kseg = ks.data();
    t.nk_seg = ks.size();
    t.vseg = vs.data();
    t.nv_seg = vs.size();
    fn(t);
    t.j0 += n;
  }
}

/// True if the fused kernels can read every block of head h's layer (and its keys need no
/// rotation on read).
bool fusable(const LayerStore& L, const RopeTable* rope) {
  if (rope != nullptr || !fused::available()) return false;
  for (const StreamSetup* st : {&L.key_setup(), &L.value_setup()}) {
    for (const auto& f : st->formats.f) {
      if (f.quantizer != nullptr && fused::classify(f).kind == fused::KernelFormat::Kind::kNone) return false;
    }
  }
  return true;
}

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
}

void attend_head(const AttendArgs& a, int64_t h) {
  const LayerStore& L = *a.layer;
  const int64_t d = L.head_dim(), hkv = L.num_heads(), G = a.num_q_heads / hkv, tq = a.t_q;
  const int64_t R = G * tq;  // rows, token-major: r = t·G + g
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t cap = std::max({kMinTileTokens, max_capacity(L.key_setup()), max_capacity(L.value_setup())});
  std::vector<float> qh(static_cast<size_t>(R * d));
  std::vector<int64_t> rpos(static_cast<size_t>(R));
  for (int64_t t = 0; t < tq; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const float* src = a.q + ((h * G + g) * tq + t) * d;
      std::copy_n(src, d, qh.data() + (t * G + g) * d);
      rpos[static_cast<size_t>(t * G + g)] = a.q_pos[t];
    }
  }
  // Attention mass of the selected rows (the last `sel_t` query tokens).
  const int64_t th = L.resident(h);
  const int64_t sel_t = a.need.any() ? a.need.selected(tq) : 0;
  const int64_t sel_first = R - sel_t * G;  // first selected row
  const bool per_row = a.need.per_row;
  const bool buffered = sel_t > 0 && sel_t * G * th <= a.max_buffered_scores;
  std::vector<float> sbuf;
  if (buffered) sbuf.assign(static_cast<size_t>(sel_t * G * th), kNegInf);
  std::vector<float> m_sel(static_cast<size_t>(sel_t * G)), l_sel(static_cast<size_t>(sel_t * G));

  const bool raw = a.fused && fusable(L, a.rope);
  fused::Queries fq;
  if (raw) fused::prepare(qh.data(), R, d, scale, fq);
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
    for_each_tile(L, h, a.rope, raw, min_q, max_q, cap, [&](const Tile& t) {
      tile_keys(t, fq, qh.data(), r0, nr, d, scale, s.data(), cap);
      if (t.last_pos > min_q) tile_mask(s.data(), cap, nr, t.n, t.kpos, rp);
      if (buffered && r0 + nr > sel_first) {
        for (int64_t r = std::max(r0, sel_first); r < r0 + nr; ++r) {
          std::copy_n(s.data() + (r - r0) * cap, t.n, sbuf.data() + (r - sel_first) * th + t.j0);
        }
      }
      tile_softmax(s.data(), cap, nr, t.n, d, m.data(), l.data(), acc.data());
      for (size_t i = 0; i < t.nv_seg; ++i) {
        const Segment& sg = t.vseg[i];
        if (sg.rows) {
          tile_pv(s.data() + sg.at, cap, nr, sg.n, t.vrows + sg.at, d, acc.data());
        } else {
          fused::accumulate(s.data() + sg.at, cap, nr, sg.raw, sg.n, d, acc.data());
        }
      }
    });
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

  // Mass: mean over the G query heads of each selected token's probabilities; per row or summed.
  auto& out = a.mass->heads[static_cast<size_t>(h)];
  out.assign(static_cast<size_t>((per_row ? sel_t : 1) * th), 0.0f);
  const float w = 1.0f / static_cast<float>(G);
  const int64_t nsel = sel_t * G;
  std::vector<float*> mass_rows(static_cast<size_t>(nsel));
  for (int64_t i = 0; i < nsel; ++i) {
    const int64_t row_out = per_row ? i / G : 0;
    mass_rows[static_cast<size_t>(i)] = out.data() + row_out * th;
  }
  if (buffered) {
    for (int64_t i = 0; i < nsel; ++i) {
      tile_mass(sbuf.data() + i * th, th, 1, th, m_sel.data() + i, l_sel.data() + i, w, mass_rows.data() + i);
    }
    return;
  }
  // Second pass over the blocks for the selected rows only.
  const int64_t* rp = rpos.data() + sel_first;
  const int64_t min_q = *std::min_element(rp, rp + nsel), max_q = *std::max_element(rp, rp + nsel);
  for (int64_t r0 = 0; r0 < nsel; r0 += kRowBlock) {
    const int64_t nr = std::min(kRowBlock, nsel - r0);
    std::vector<float*> rows_at(static_cast<size_t>(nr));
    for_each_tile(L, h, a.rope, raw, min_q, max_q, cap, [&](const Tile& t) {
      tile_keys(t, fq, qh.data(), sel_first + r0, nr, d, scale, s.data(), cap);
      if (t.last_pos > min_q) tile_mask(s.data(), cap, nr, t.n, t.kpos, rp + r0);
      for (int64_t r = 0; r < nr; ++r) rows_at[static_cast<size_t>(r)] = mass_rows[static_cast<size_t>(r0 + r)] + t.j0;
      tile_mass(s.data(), cap, nr, t.n, m_sel.data() + r0, l_sel.data() + r0, w, rows_at.data());
    });
  }
}

}  // namespace

int tile_lanes() { return tile_kernels().lanes; }

bool use_tile_lanes(int lanes) {
  KV_CHECK_ARG(lanes == 0 || lanes == 4 || lanes == 8 || lanes == 16, "use_tile_lanes: lanes must be 0, 4, 8 or 16, got ",
               lanes);
  const TileKernels k = pick_tile_kernels(lanes);
  if (lanes != 0 && k.lanes != lanes) return false;
  tile_kernels() = k;
  return true;
}

void attend_generic(const AttendArgs& a) {
  const int64_t hkv = a.layer->num_heads();
  if (a.need.any()) {
    a.mass->rows = a.need.per_row ? a.need.selected(a.t_q) : 1;
    a.mass->heads.assign(static_cast<size_t>(hkv), {});
  }
  // Parallel over KV heads once a head's work is worth a thread (≈ 64 Ki multiply-adds).
  const int64_t work = a.layer->max_resident() * (a.num_q_heads / hkv) * a.t_q * a.layer->head_dim();
  at::parallel_for(0, hkv, work >= (int64_t{1} << 16) ? 1 : hkv, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h) attend_head(a, h);
  });
}

}  // namespace kvcache::cache
