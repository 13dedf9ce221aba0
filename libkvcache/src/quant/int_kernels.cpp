// SPDX-License-Identifier: Apache-2.0
// Fast integer quantizer kernels (layout and semantics: int_kernels.h). Compiled with
// -ffp-contract=off (x̂ = code·s + z must not become an FMA, to match the LibTorch-ops
// reference bit for bit) and -fopenmp-simd (for the min/max reductions).
#include "quant/int_kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kvcache/error.h"
#include "quant/simd.h"

namespace kvcache::quant {
namespace {

/// Metadata → float inside vectorized loops (branch-free software conversion).
KV_ALWAYS_INLINE float load_meta(c10::Half v) { return fp16_to_float(v.x); }
KV_ALWAYS_INLINE float load_meta(float v) { return v; }
/// Metadata → float for one value (one F16C instruction in the AVX2/AVX-512 clones).
KV_ALWAYS_INLINE float load_meta_scalar(c10::Half v) {
#if defined(__FLT16_MAX__)
  _Float16 h;
  std::memcpy(&h, &v.x, sizeof h);
  return static_cast<float>(h);
#else
  return fp16_to_float(v.x);
#endif
}
KV_ALWAYS_INLINE float load_meta_scalar(float v) { return v; }

/// Code of x for stored zero z and inverse scale inv: clamp then round-half-to-even (the
/// clamp bounds are integers, so this equals round-then-clamp).
template <int BITS>
KV_ALWAYS_INLINE uint32_t code_of(float x, float z, float inv) {
  constexpr float kMax = static_cast<float>((1 << BITS) - 1);
  float y = (x - z) * inv;
  y = y < 0.0f ? 0.0f : y;
  y = y > kMax ? kMax : y;
  return rint_bits(y) & ((1u << BITS) - 1u);
}

struct Flags {
  uint32_t bad = 0;
  uint32_t meta_overflow = 0;
  uint32_t scale_overflow = 0;
};

/// Metadata of n groups from their min and max, vectorized across groups: stores
/// s = meta((mx − mn) / L) and z = meta(mn), and returns the stored values as float in
/// s_f / z_f and the inverse scale (0 for a constant group) in inv. `z_f` may alias `mn`.
template <int BITS, typename MetaT>
KV_ALWAYS_INLINE void make_meta(int64_t n, const float* mn, const float* __restrict mx, MetaT* __restrict s_out,
                                MetaT* __restrict z_out, float* __restrict s_f, float* z_f, float* __restrict inv,
                                Flags* f) {
  constexpr float kMax = static_cast<float>((1 << BITS) - 1);
  uint32_t scale_bad = 0, meta_bad = 0;
#pragma omp simd reduction(| : scale_bad, meta_bad)
  for (int64_t i = 0; i < n; ++i) {
    const float scale = (mx[i] - mn[i]) / kMax;
    scale_bad |= nonfinite_bit(scale);
    float s, z;
    if constexpr (std::is_same_v<MetaT, c10::Half>) {
      const uint16_t hs = fp16_bits(scale);
      const uint16_t hz = fp16_bits(mn[i]);
      meta_bad |= fp16_nonfinite_bit(hs) | fp16_nonfinite_bit(hz);
      s_out[i].x = hs;
      z_out[i].x = hz;
      s = fp16_to_float(hs);
      z = fp16_to_float(hz);
    } else {
      s_out[i] = scale;
      z_out[i] = mn[i];
      s = scale;
      z = mn[i];
    }
    s_f[i] = s;
    z_f[i] = z;
    inv[i] = s != 0.0f ? 1.0f / s : 0.0f;
  }
  f->scale_overflow |= scale_bad;
  f->meta_overflow |= meta_bad;
}

// ---------------------------------------------------------------- int3 packing
// 3-bit codes of a group of g = 8e codes c[0..g) occupy 3e bytes in two planes (the split of
// llama.cpp's q3_K: the two low bits and the high bit stored apart), each packed like the
// power-of-two widths, pairing code j with codes j + m·(plane run):
//   low plane, bytes [0, 2e):  byte j = Σ_{m<4} (c[j + m·2e] & 3) << 2m     (int2's layout)
//   high plane, bytes [2e, 3e): byte j = Σ_{m<8} (c[j + m·e] >> 2) << m      (1 bit per code)
// Both are plain loops over j < e reading or writing codes j + m·e (m < 8): low byte j takes
// the codes of even m, low byte j + e those of odd m. Per-channel blocks use the same planes
// with code rows in place of bytes (int_kernels.h).

/// The low-plane byte of codes c[0], c[2], c[4], c[6] (odd = 0) or c[1], c[3], c[5], c[7].
KV_ALWAYS_INLINE uint32_t low3(const uint32_t* c, int odd) {
  return (c[odd] & 3u) | (c[odd + 2] & 3u) << 2 | (c[odd + 4] & 3u) << 4 | (c[odd + 6] & 3u) << 6;
}
KV_ALWAYS_INLINE uint32_t high3(const uint32_t* c) {
  uint32_t hi = 0;
  for (int m = 0; m < 8; ++m) hi |= (c[m] >> 2) << m;
  return hi;
}
/// Code m (< 8) of a run from its two low-plane bytes and its high-plane byte.
KV_ALWAYS_INLINE uint32_t code3(uint32_t l0, uint32_t l1, uint32_t hi, int m) {
  return (((m & 1) ? l1 : l0) >> (2 * (m >> 1)) & 3u) | ((hi >> m) & 1u) << 2;
}

// ---------------------------------------------------------------- per-token
// Groups are processed in chunks of kChunk: (1) min/max of each group, (2) the metadata of
// the whole chunk as one vector loop (the scalar divide/convert chain per group would
// otherwise dominate at g = 32), (3) the codes of each group.
// G > 0: group size known at compile time (the common 32/64/128); G == 0: runtime `g_rt`.
constexpr int64_t kChunk = 16;

template <int BITS, typename MetaT, int64_t G>
KV_ALWAYS_INLINE void quant_tok(const float* __restrict x, int64_t g0, int64_t g1, int64_t g_rt,
                                uint8_t* __restrict codes, MetaT* __restrict sc, MetaT* __restrict ze, Flags* f) {
  constexpr int64_t K = BITS == 3 ? 8 : 8 / BITS;  // codes per byte (int3: per 3 bytes)
  const int64_t g = G > 0 ? G : g_rt;
  const int64_t q = g * BITS / 8;  // bytes per group
  // NaN/Inf flags are OR-ed lane-wise across all groups and reduced once at the end (a
  // per-group horizontal reduction would cost as much as the min/max ones).
  constexpr int64_t kLanes = 16;
  const int64_t g_lanes = g - g % kLanes;
  alignas(64) uint32_t bad_lanes[kLanes] = {};
  uint32_t bad = 0;
  alignas(64) float mn[kChunk], mx[kChunk], sv[kChunk], inv[kChunk];
  for (int64_t k0 = g0; k0 < g1; k0 += kChunk) {
    const int64_t n = std::min(kChunk, g1 - k0);
    for (int64_t i = 0; i < n; ++i) {
      const float* __restrict p = x + (k0 + i) * g;
      float lo = p[0];
      float hi = p[0];
#pragma omp simd reduction(min : lo) reduction(max : hi)
      for (int64_t e = 0; e < g; ++e) {
        const float v = p[e];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
      }
      for (int64_t e0 = 0; e0 < g_lanes; e0 += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) bad_lanes[l] |= nonfinite_bit(p[e0 + l]);
      }
      for (int64_t e = g_lanes; e < g; ++e) bad |= nonfinite_bit(p[e]);
      mn[i] = lo;
      mx[i] = hi;
    }
    make_meta<BITS>(n, mn, mx, sc + k0, ze + k0, sv, mn, inv, f);  // mn now holds the stored zero
    for (int64_t i = 0; i < n; ++i) {
      const float* __restrict p = x + (k0 + i) * g;
      uint8_t* __restrict o = codes + (k0 + i) * q;
      const float z = mn[i];
      const float iv = inv[i];
      if constexpr (BITS == 3) {
        const int64_t e = g / 8;
#pragma omp simd
        for (int64_t j = 0; j < e; ++j) {
          uint32_t c[8];
          for (int m = 0; m < 8; ++m) c[m] = code_of<3>(p[j + m * e], z, iv);
          o[j] = static_cast<uint8_t>(low3(c, 0));
          o[j + e] = static_cast<uint8_t>(low3(c, 1));
          o[j + 2 * e] = static_cast<uint8_t>(high3(c));
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < q; ++j) {
          uint32_t byte = 0;
          for (int64_t m = 0; m < K; ++m) byte |= code_of<BITS>(p[j + m * q], z, iv) << (m * BITS);
          o[j] = static_cast<uint8_t>(byte);
        }
      }
    }
  }
  for (int64_t l = 0; l < kLanes; ++l) bad |= bad_lanes[l];
  f->bad |= bad;
}

template <int BITS, typename MetaT, int64_t G>
KV_ALWAYS_INLINE void dequant_tok(const uint8_t* __restrict codes, const MetaT* __restrict sc,
                                  const MetaT* __restrict ze, int64_t g0, int64_t g1, int64_t g_rt,
                                  float* __restrict out) {
  constexpr int64_t K = BITS == 3 ? 8 : 8 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  const int64_t g = G > 0 ? G : g_rt;
  const int64_t q = g * BITS / 8;
  for (int64_t k = g0; k < g1; ++k) {
    const float s = load_meta_scalar(sc[k]);
    const float z = load_meta_scalar(ze[k]);
    const uint8_t* __restrict in = codes + k * q;
    float* __restrict o = out + k * g;
    if constexpr (BITS == 3) {
      const int64_t e = g / 8;
#pragma omp simd
      for (int64_t j = 0; j < e; ++j) {
        const uint32_t l0 = in[j], l1 = in[j + e], hi = in[j + 2 * e];
        for (int m = 0; m < 8; ++m) o[j + m * e] = static_cast<float>(code3(l0, l1, hi, m)) * s + z;
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < q; ++j) {
        const uint32_t byte = in[j];
        for (int64_t m = 0; m < K; ++m) {
          o[j + m * q] = static_cast<float>((byte >> (m * BITS)) & kMask) * s + z;
        }
      }
    }
  }
}

// ---------------------------------------------------------------- per-channel
template <int BITS, typename MetaT>
KV_ALWAYS_INLINE void quant_chan(const float* __restrict x, int64_t b0, int64_t b1, int64_t g, int64_t d,
                                 uint8_t* __restrict codes, MetaT* __restrict sc, MetaT* __restrict ze,
                                 Flags* f) {
  constexpr int64_t K = BITS == 3 ? 8 : 8 / BITS;
  const int64_t q = g * BITS / 8;  // code rows per block
  std::vector<float> buf(static_cast<size_t>(4 * d));
  float* mn = buf.data();
  float* __restrict mx = mn + d;
  float* __restrict sv = mx + d;
  float* __restrict inv = sv + d;
  uint32_t bad = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const float* p = x + b * g * d;
#pragma omp simd reduction(| : bad)
    for (int64_t c = 0; c < d; ++c) {
      mn[c] = p[c];
      mx[c] = p[c];
      bad |= nonfinite_bit(p[c]);
    }
    for (int64_t r = 1; r < g; ++r) {
      const float* row = p + r * d;
#pragma omp simd reduction(| : bad)
      for (int64_t c = 0; c < d; ++c) {
        const float v = row[c];
        mn[c] = v < mn[c] ? v : mn[c];
        mx[c] = v > mx[c] ? v : mx[c];
        bad |= nonfinite_bit(v);
      }
    }
    make_meta<BITS>(d, mn, mx, sc + b * d, ze + b * d, sv, mn, inv, f);  // mn now holds the stored zero
    uint8_t* o = codes + b * q * d;
    if constexpr (BITS == 3) {
      const int64_t e = g / 8;
      for (int64_t j = 0; j < e; ++j) {
        uint8_t* __restrict lo0 = o + j * d;
        uint8_t* __restrict lo1 = o + (j + e) * d;
        uint8_t* __restrict hrow = o + (j + 2 * e) * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) {
          uint32_t cm[8];
          for (int m = 0; m < 8; ++m) cm[m] = code_of<3>(p[(j + m * e) * d + c], mn[c], inv[c]);
          lo0[c] = static_cast<uint8_t>(low3(cm, 0));
          lo1[c] = static_cast<uint8_t>(low3(cm, 1));
          hrow[c] = static_cast<uint8_t>(high3(cm));
        }
      }
    } else {
      for (int64_t j = 0; j < q; ++j) {
        uint8_t* __restrict orow = o + j * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) {
          uint32_t byte = 0;
          for (int64_t m = 0; m < K; ++m) {
            byte |= code_of<BITS>(p[(j + m * q) * d + c], mn[c], inv[c]) << (m * BITS);
          }
          orow[c] = static_cast<uint8_t>(byte);
        }
      }
    }
  }
  f->bad |= bad;
}

template <int BITS, typename MetaT>
KV_ALWAYS_INLINE void dequant_chan(const uint8_t* __restrict codes, const MetaT* __restrict sc,
                                   const MetaT* __restrict ze, int64_t b0, int64_t b1, int64_t g, int64_t d,
                                   float* __restrict out) {
  constexpr int64_t K = BITS == 3 ? 8 : 8 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  const int64_t q = g * BITS / 8;
  std::vector<float> buf(static_cast<size_t>(2 * d));
  float* __restrict sv = buf.data();
  float* __restrict zv = sv + d;
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t c = 0; c < d; ++c) {
      sv[c] = load_meta(sc[b * d + c]);
      zv[c] = load_meta(ze[b * d + c]);
    }
    const uint8_t* in = codes + b * q * d;
    float* o = out + b * g * d;
    if constexpr (BITS == 3) {
      const int64_t e = g / 8;
      for (int64_t j = 0; j < e; ++j) {
        const uint8_t* lo0 = in + j * d;
        const uint8_t* lo1 = in + (j + e) * d;
        const uint8_t* hrow = in + (j + 2 * e) * d;
        for (int m = 0; m < 8; ++m) {
          float* __restrict orow = o + (j + m * e) * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) {
            orow[c] = static_cast<float>(code3(lo0[c], lo1[c], hrow[c], m)) * sv[c] + zv[c];
          }
        }
      }
      continue;
    }
    for (int64_t j = 0; j < q; ++j) {
      const uint8_t* irow = in + j * d;
      for (int64_t m = 0; m < K; ++m) {
        float* __restrict orow = o + (j + m * q) * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) {
          orow[c] = static_cast<float>((static_cast<uint32_t>(irow[c]) >> (m * BITS)) & kMask) * sv[c] + zv[c];
        }
      }
    }
  }
}

/// Per-token kernels with the group size fixed at compile time when it is one of the
/// common sizes (32, 64, 128): the inner loops then fully unroll into vector code.
template <int BITS, typename MetaT>
KV_ALWAYS_INLINE void quant_tok_any(const float* x, int64_t g0, int64_t g1, int64_t g, uint8_t* codes, MetaT* sc,
                                    MetaT* ze, Flags* f) {
  switch (g) {
    case 32:
      return quant_tok<BITS, MetaT, 32>(x, g0, g1, g, codes, sc, ze, f);
    case 64:
      return quant_tok<BITS, MetaT, 64>(x, g0, g1, g, codes, sc, ze, f);
    case 128:
      return quant_tok<BITS, MetaT, 128>(x, g0, g1, g, codes, sc, ze, f);
    default:
      return quant_tok<BITS, MetaT, 0>(x, g0, g1, g, codes, sc, ze, f);
  }
}

template <int BITS, typename MetaT>
KV_ALWAYS_INLINE void dequant_tok_any(const uint8_t* codes, const MetaT* sc, const MetaT* ze, int64_t g0, int64_t g1,
                                      int64_t g, float* out) {
  switch (g) {
    case 32:
      return dequant_tok<BITS, MetaT, 32>(codes, sc, ze, g0, g1, g, out);
    case 64:
      return dequant_tok<BITS, MetaT, 64>(codes, sc, ze, g0, g1, g, out);
    case 128:
      return dequant_tok<BITS, MetaT, 128>(codes, sc, ze, g0, g1, g, out);
    default:
      return dequant_tok<BITS, MetaT, 0>(codes, sc, ze, g0, g1, g, out);
  }
}

// ---------------------------------------------------------------- multiversioned entry points
// One non-template function per (bits, meta type) so target_clones applies to each.
#define KV_DEFINE_KERNELS(BITS, MT, SUFFIX)                                                                \
  KV_TARGET_CLONES void quant_tok_##SUFFIX(const float* x, int64_t g0, int64_t g1, int64_t g,              \
                                           uint8_t* codes, void* sc, void* ze, Flags* f) {                 \
    quant_tok_any<BITS, MT>(x, g0, g1, g, codes, static_cast<MT*>(sc), static_cast<MT*>(ze), f);           \
  }                                                                                                        \
  KV_TARGET_CLONES void dequant_tok_##SUFFIX(const uint8_t* codes, const void* sc, const void* ze,         \
                                             int64_t g0, int64_t g1, int64_t g, float* out) {              \
    dequant_tok_any<BITS, MT>(codes, static_cast<const MT*>(sc), static_cast<const MT*>(ze), g0, g1, g,    \
                              out);                                                                        \
  }                                                                                                        \
  KV_TARGET_CLONES void quant_chan_##SUFFIX(const float* x, int64_t b0, int64_t b1, int64_t g, int64_t d,  \
                                            uint8_t* codes, void* sc, void* ze, Flags* f) {                \
    quant_chan<BITS, MT>(x, b0, b1, g, d, codes, static_cast<MT*>(sc), static_cast<MT*>(ze), f);           \
  }                                                                                                        \
  KV_TARGET_CLONES void dequant_chan_##SUFFIX(const uint8_t* codes, const void* sc, const void* ze,        \
                                              int64_t b0, int64_t b1, int64_t g, int64_t d, float* out) {  \
    dequant_chan<BITS, MT>(codes, static_cast<const MT*>(sc), static_cast<const MT*>(ze), b0, b1, g, d,    \
                           out);                                                                           \
  }

KV_DEFINE_KERNELS(8, c10::Half, 8h)
KV_DEFINE_KERNELS(4, c10::Half, 4h)
KV_DEFINE_KERNELS(3, c10::Half, 3h)
KV_DEFINE_KERNELS(2, c10::Half, 2h)
KV_DEFINE_KERNELS(8, float, 8f)
KV_DEFINE_KERNELS(4, float, 4f)
KV_DEFINE_KERNELS(3, float, 3f)
KV_DEFINE_KERNELS(2, float, 2f)
#undef KV_DEFINE_KERNELS

using QuantTokFn = void (*)(const float*, int64_t, int64_t, int64_t, uint8_t*, void*, void*, Flags*);
using DequantTokFn = void (*)(const uint8_t*, const void*, const void*, int64_t, int64_t, int64_t, float*);
using QuantChanFn = void (*)(const float*, int64_t, int64_t, int64_t, int64_t, uint8_t*, void*, void*,
                             Flags*);
using DequantChanFn = void (*)(const uint8_t*, const void*, const void*, int64_t, int64_t, int64_t,
                               int64_t, float*);

/// Index of (bits, meta) in the kernel tables below (order of kIntBits).
int variant(int bits, MetaType meta) {
  const int b = bits == 8 ? 0 : bits == 4 ? 1 : bits == 3 ? 2 : bits == 2 ? 3 : -1;
  KV_INTERNAL_ASSERT(b >= 0, "unsupported bit width ", bits);
  return b + (meta == MetaType::kFloat ? 4 : 0);
}

constexpr QuantTokFn kQuantTok[] = {quant_tok_8h, quant_tok_4h, quant_tok_3h, quant_tok_2h,
                                    quant_tok_8f, quant_tok_4f, quant_tok_3f, quant_tok_2f};
constexpr DequantTokFn kDequantTok[] = {dequant_tok_8h, dequant_tok_4h, dequant_tok_3h, dequant_tok_2h,
                                        dequant_tok_8f, dequant_tok_4f, dequant_tok_3f, dequant_tok_2f};
constexpr QuantChanFn kQuantChan[] = {quant_chan_8h, quant_chan_4h, quant_chan_3h, quant_chan_2h,
                                      quant_chan_8f, quant_chan_4f, quant_chan_3f, quant_chan_2f};
constexpr DequantChanFn kDequantChan[] = {dequant_chan_8h, dequant_chan_4h, dequant_chan_3h, dequant_chan_2h,
                                          dequant_chan_8f, dequant_chan_4f, dequant_chan_3f, dequant_chan_2f};

/// Work items per parallel chunk: about 64 Ki values.
int64_t grain(int64_t values_per_item) { return std::max<int64_t>(1, (int64_t{1} << 16) / values_per_item); }

/// Thread-safe accumulation of per-chunk flags.
class StatusAccumulator {
 public:
  void add(const Flags& f) {
    if (f.bad != 0) nonfinite_.store(true, std::memory_order_relaxed);
    if (f.meta_overflow) meta_.store(true, std::memory_order_relaxed);
    if (f.scale_overflow) scale_.store(true, std::memory_order_relaxed);
  }
  KernelStatus status() const {
    KernelStatus s;
    s.nonfinite = nonfinite_.load();
    s.meta_overflow = meta_.load();
    s.scale_overflow = scale_.load();
    return s;
  }

 private:
  std::atomic<bool> nonfinite_{false}, meta_{false}, scale_{false};
};

void check_group(int bits, int64_t g) {
  KV_INTERNAL_ASSERT(g > 0 && g % codes_per_unit(bits) == 0, "group ", g, " not a multiple of ", codes_per_unit(bits));
}

}  // namespace

KernelStatus quantize_per_token(int bits, const float* x, int64_t ngroups, int64_t g, uint8_t* codes,
                                void* scales, void* zeros, MetaType meta) {
  check_group(bits, g);
  const QuantTokFn fn = kQuantTok[variant(bits, meta)];
  StatusAccumulator acc;
  at::parallel_for(0, ngroups, grain(g), [&](int64_t b, int64_t e) {
    Flags f;
    fn(x, b, e, g, codes, scales, zeros, &f);
    acc.add(f);
  });
  return acc.status();
}

void dequantize_per_token(int bits, const uint8_t* codes, const void* scales, const void* zeros,
                          MetaType meta, int64_t ngroups, int64_t g, float* out) {
  check_group(bits, g);
  const DequantTokFn fn = kDequantTok[variant(bits, meta)];
  at::parallel_for(0, ngroups, grain(g), [&](int64_t b, int64_t e) { fn(codes, scales, zeros, b, e, g, out); });
}

KernelStatus quantize_per_channel(int bits, const float* x, int64_t nblocks, int64_t g, int64_t d,
                                  uint8_t* codes, void* scales, void* zeros, MetaType meta) {
  check_group(bits, g);
  const QuantChanFn fn = kQuantChan[variant(bits, meta)];
  StatusAccumulator acc;
  at::parallel_for(0, nblocks, grain(g * d), [&](int64_t b, int64_t e) {
    Flags f;
    fn(x, b, e, g, d, codes, scales, zeros, &f);
    acc.add(f);
  });
  return acc.status();
}

void dequantize_per_channel(int bits, const uint8_t* codes, const void* scales, const void* zeros,
                            MetaType meta, int64_t nblocks, int64_t g, int64_t d, float* out) {
  check_group(bits, g);
  const DequantChanFn fn = kDequantChan[variant(bits, meta)];
  at::parallel_for(0, nblocks, grain(g * d),
                   [&](int64_t b, int64_t e) { fn(codes, scales, zeros, b, e, g, d, out); });
}

}  // namespace kvcache::quant
