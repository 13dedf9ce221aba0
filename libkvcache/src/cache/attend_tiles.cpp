// SPDX-License-Identifier: Apache-2.0
// The tile kernels of the generic read path (attend_tiles.h). Compiled with -fopenmp-simd (SIMD
// reductions, no OpenMP runtime) and -ffp-contract=fast (FMAs in the dot products); built once
// per vector width, each with its ISA enabled (TileKernels), the widest the CPU runs picked once.
#include "cache/attend_tiles.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "kvcache/error.h"
#include "quant/simd.h"

namespace kvcache::cache {
namespace {

using quant::bits_float;
using quant::float_bits;

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

/// p = exp(s − m_r) / l_r for the tile's scores of rows r < nr, maxed into
/// `mass_rows[row_of[r]] + j0` (AttentionNeed::Reduce::kMax: KVzip's replay score).
template <int W>
KV_ALWAYS_INLINE void tile_mass_max_w(const float* __restrict s, int64_t ld, int64_t nr, int64_t n, const float* m,
                                      const float* l, float* const* mass_rows) {
  for (int64_t r = 0; r < nr; ++r) {
    if (l[r] <= 0.0f) continue;
    const float* __restrict sr = s + r * ld;
    float* __restrict out = mass_rows[r];
    const float mr = m[r], inv = 1.0f / l[r];
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      const vf<W> p = vexp_nonpos<W>(vload<W>(sr + j) - mr) * inv;
      const vf<W> o = vload<W>(out + j);
      vstore<W>(out + j, p > o ? p : o);
    }
    for (; j < n; ++j) {
      const float p = exp_nonpos(sr[j] - mr) * inv;
      out[j] = p > out[j] ? p : out[j];
    }
  }
}

// ---- The tile kernels' entry points, one set per ISA (picked once: tile_kernels()) ----------
using ScoresFn = void (*)(const float*, int64_t, const float* const*, int64_t, int64_t, float, float*, int64_t);
using SoftmaxFn = void (*)(float*, int64_t, int64_t, int64_t, int64_t, float*, float*, float*);
using PvFn = void (*)(const float*, int64_t, int64_t, int64_t, const float* const*, int64_t, float*);
using MassFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, const float*, float, float* const*);
using MassMaxFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, const float*, float* const*);
struct TileKernels {
  ScoresFn scores;
  SoftmaxFn softmax;
  PvFn pv;
  MassFn mass;
  MassMaxFn mass_max;
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
  }                                                                                                         \
  ATTR void tile_mass_max_##SUFFIX(const float* s, int64_t ld, int64_t nr, int64_t n, const float* m,        \
                                   const float* l, float* const* mass_rows) {                               \
    tile_mass_max_w<W>(s, ld, nr, n, m, l, mass_rows);                                                      \
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

constexpr TileKernels kBaseKernels{tile_scores_base, tile_softmax_base, tile_pv_base, tile_mass_base,
                                   tile_mass_max_base, 4};

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
  if (v4 && (lanes == 0 || lanes == 16)) {
    return {tile_scores_v4, tile_softmax_v4, tile_pv_v4, tile_mass_v4, tile_mass_max_v4, 16};
  }
  if (v3 && (lanes == 0 || lanes == 8)) {
    return {tile_scores_v3, tile_softmax_v3, tile_pv_v3, tile_mass_v3, tile_mass_max_v3, 8};
  }
#endif
  return kBaseKernels;
}

/// The tile kernels in use: the widest the CPU runs, or 8 lanes once the AVX2 fused kernels are
/// selected (kvcache::set_attention_kernels("avx2")), so that the online softmax and the generic
/// path also sum as an AVX2-only CPU does (the attention arithmetic of such a CPU, reproduced on
/// an AVX-512 one).
TileKernels& tile_kernels() {
  static TileKernels k = pick_tile_kernels(0);
  return k;
}

}  // namespace

/// Hides key j from row r when its position is after the row's.
void tile_mask(float* s, int64_t ld, int64_t nr, int64_t n, const int64_t* kpos, const int64_t* rpos) {
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      if (kpos[j] > rpos[r]) s[r * ld + j] = kNegInf;
    }
  }
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
void tile_mass_max(const float* s, int64_t ld, int64_t nr, int64_t n, const float* m, const float* l,
                   float* const* mass_rows) {
  tile_kernels().mass_max(s, ld, nr, n, m, l, mass_rows);
}

int tile_lanes() { return tile_kernels().lanes; }

bool use_tile_lanes(int lanes) {
  KV_CHECK_ARG(lanes == 0 || lanes == 4 || lanes == 8 || lanes == 16, "use_tile_lanes: lanes must be 0, 4, 8 or 16, got ",
               lanes);
  const TileKernels k = pick_tile_kernels(lanes);
  if (lanes != 0 && k.lanes != lanes) return false;
  tile_kernels() = k;
  return true;
}

}  // namespace kvcache::cache
