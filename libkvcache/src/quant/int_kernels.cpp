// SPDX-License-Identifier: Apache-2.0
// Fast integer quantizer kernels (layout and semantics: int_kernels.h). Compiled with
// -ffp-contract=off (x̂ = code·s + z must not become an FMA, to match the LibTorch-ops
// reference bit for bit) and -fopenmp-simd (for the min/max reductions).
#include "quant/int_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/parallel.h"
#include "kvcache/error.h"
#include "quant/int_kernels_avx512.h"
#include "quant/simd.h"

namespace kvcache::quant {
namespace {

/// Metadata → float inside vectorized loops (branch-free software conversion).
KV_ALWAYS_INLINE float load_meta(Half v) { return fp16_to_float(v.x); }
KV_ALWAYS_INLINE float load_meta(float v) { return v; }
/// Metadata → float for one value (one F16C instruction in the AVX2/AVX-512 clones).
KV_ALWAYS_INLINE float load_meta_scalar(Half v) {
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

/// fp32-metadata groups: the same code computed on x·k (k = 1, or 1/4 for a group whose
/// range reaches float32's limit, so x − z cannot overflow), with zk = z·k, inv = 1/(s·k).
template <int BITS>
KV_ALWAYS_INLINE uint32_t code_of_k(float x, float k, float zk, float inv) {
  return code_of<BITS>(x * k, zk, inv);
}

// fp32-metadata constants (int_kernels.h): scales are at least 2^-126 (so 1/s is finite),
// and a scale ≥ 2^96 marks a group computed and reconstructed at 1/4 scale.
constexpr float kMinScale32 = 0x1p-126f;  // FLT_MIN
constexpr float kQuarterScale = 0x1p96f;
constexpr float kQuarterRange = 0x1p98f;  // (max − min)/4 from which the range is taken at 1/4
constexpr float kFltMax = 0x1.fffffep127f;

struct Flags {
  uint32_t bad = 0;
  uint32_t meta_overflow = 0;
};

/// Metadata of n groups from their min and max, vectorized across groups (int_kernels.h):
///   fp16: z = fp16 round-down(mn), s = fp16 round-up((mx − z) / L), at least 2^-24 if mx > z;
///   fp32: z = mn, s = max((mx − z) / L, 2^-126) if mx > z (the range taken at 1/4 when it
///         would overflow), k = 1/4 if s ≥ 2^96 else 1.
/// s = 0 only for mx == z (then every code is 0 and x̂ = z = x). Writes the stored s and z, and
/// for the codes: zc = z·k (k = 1 for fp16), inv = 1/(s·k) (0 if s == 0), and k (fp32 only,
/// may be null for fp16). `zc` may alias `mn`.
template <int BITS, typename MetaT>
KV_ALWAYS_INLINE void make_meta(int64_t n, const float* mn, const float* __restrict mx, MetaT* __restrict s_out,
                                MetaT* __restrict z_out, float* zc, float* __restrict inv, float* __restrict kk,
                                Flags* f) {
  constexpr float kMax = static_cast<float>((1 << BITS) - 1);
  if constexpr (std::is_same_v<MetaT, Half>) {
    (void)kk;
    uint32_t meta_bad = 0;
#pragma omp simd reduction(| : meta_bad)
    for (int64_t i = 0; i < n; ++i) {
      const float lo = mn[i];
      const float hi = mx[i];
      const uint32_t hz = fp16_bits_down(lo);
      const float z = fp16_to_float(static_cast<uint16_t>(hz));
      const float scale = (hi - z) / kMax;
      uint32_t hs = fp16_bits_up(scale);
      hs = hs == 0 && hi > z ? 1u : hs;  // a range that underflows still gets 2^-24
      // fp16 cannot hold a zero within one fp16 step below a minimum outside [−65504, 65520)
      // (mn ≥ 65520 would round down to a far-away 65504), nor a scale past 65504.
      meta_bad |= static_cast<uint32_t>(!(lo >= -65504.0f && lo < 65520.0f && scale <= 65504.0f));
      s_out[i].x = static_cast<uint16_t>(hs);
      z_out[i].x = static_cast<uint16_t>(hz);
      const float s = fp16_to_float(static_cast<uint16_t>(hs));
      zc[i] = z;
      inv[i] = s != 0.0f ? 1.0f / s : 0.0f;
    }
    f->meta_overflow |= meta_bad;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float z = mn[i];
      const float hi = mx[i];
      const float quarter = hi * 0.25f - z * 0.25f;  // never overflows
      const float scale = quarter >= kQuarterRange ? (quarter / kMax) * 4.0f : (hi - z) / kMax;
      const float s = hi > z ? (scale > kMinScale32 ? scale : kMinScale32) : 0.0f;
      const float k = s >= kQuarterScale ? 0.25f : 1.0f;
      s_out[i] = s;
      z_out[i] = z;
      zc[i] = z * k;
      inv[i] = s != 0.0f ? 1.0f / (s * k) : 0.0f;
      kk[i] = k;
    }
  }
}

/// x̂ of fp32 metadata: (code·(s·k) + z·k) clamped to ±FLT_MAX·k, times 1/k (no overflow).
struct Recon32 {
  float sk, zk, lo, hi, back;
};
KV_ALWAYS_INLINE Recon32 recon32(float s, float z) {
  const bool quarter = s >= kQuarterScale;
  const float k = quarter ? 0.25f : 1.0f;
  return {s * k, z * k, -kFltMax * k, kFltMax * k, quarter ? 4.0f : 1.0f};
}
KV_ALWAYS_INLINE float recon32_apply(float c, float sk, float zk, float lo, float hi, float back) {
  float v = c * sk + zk;
  v = v < lo ? lo : v;
  v = v > hi ? hi : v;
  return v * back;
}

// ---------------------------------------------------------------- packing
// Each kernel computes a group's codes with a function of the value (the metadata path: fp16
// or fp32), then packs them (int_kernels.h):
//   b ∈ {8, 4, 2}: k = 8/b codes per byte, byte j = Σ_{m<k} c[j + m·g/k] << m·b;
//   int3 (g = 8e codes in 3e bytes, the split of llama.cpp's q3_K into the two low bits and
//   the high bit): low plane bytes [0, 2e) pack c & 3 as int2 packs its codes (byte j holds
//   codes j + m·2e, m < 4), high plane bytes [2e, 3e) hold c >> 2, byte j bit m = code j + m·e.
//   Both planes are one plain loop over j < e reading codes j + m·e (m < 8): low byte j
//   takes the codes of even m, low byte j + e those of odd m.
// Per-channel blocks pack down each column, code rows in place of bytes.

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

/// Packs the g codes code(p[i]) of one per-token group into o (g·b/8 bytes).
template <int BITS, typename CodeFn>
KV_ALWAYS_INLINE void pack_tok(const float* __restrict p, int64_t g, uint8_t* __restrict o, CodeFn code) {
  if constexpr (BITS == 3) {
    const int64_t e = g / 8;
#pragma omp simd
    for (int64_t j = 0; j < e; ++j) {
      uint32_t c[8];
      for (int m = 0; m < 8; ++m) c[m] = code(p[j + m * e]);
      o[j] = static_cast<uint8_t>(low3(c, 0));
      o[j + e] = static_cast<uint8_t>(low3(c, 1));
      o[j + 2 * e] = static_cast<uint8_t>(high3(c));
    }
  } else {
    constexpr int64_t K = 8 / BITS;
    const int64_t q = g / K;
#pragma omp simd
    for (int64_t j = 0; j < q; ++j) {
      uint32_t byte = 0;
      for (int64_t m = 0; m < K; ++m) byte |= code(p[j + m * q]) << (m * BITS);
      o[j] = static_cast<uint8_t>(byte);
    }
  }
}

/// Unpacks one per-token group: o[i] = value(code i) for i < g.
template <int BITS, typename ValueFn>
KV_ALWAYS_INLINE void unpack_tok(const uint8_t* __restrict in, int64_t g, float* __restrict o, ValueFn value) {
  if constexpr (BITS == 3) {
    const int64_t e = g / 8;
#pragma omp simd
    for (int64_t j = 0; j < e; ++j) {
      const uint32_t l0 = in[j], l1 = in[j + e], hi = in[j + 2 * e];
      for (int m = 0; m < 8; ++m) o[j + m * e] = value(static_cast<float>(code3(l0, l1, hi, m)));
    }
  } else {
    constexpr int64_t K = 8 / BITS;
    constexpr uint32_t kMask = (1u << BITS) - 1u;
    const int64_t q = g / K;
#pragma omp simd
    for (int64_t j = 0; j < q; ++j) {
      const uint32_t byte = in[j];
      for (int64_t m = 0; m < K; ++m) o[j + m * q] = value(static_cast<float>((byte >> (m * BITS)) & kMask));
    }
  }
}

/// Packs one per-channel block (g rows × d columns at p) into o (g·b/8 rows of d bytes):
/// code(v, c) is the code of value v of column c.
template <int BITS, typename CodeFn>
KV_ALWAYS_INLINE void pack_chan(const float* __restrict p, int64_t g, int64_t d, uint8_t* __restrict o, CodeFn code) {
  if constexpr (BITS == 3) {
    const int64_t e = g / 8;
    for (int64_t j = 0; j < e; ++j) {
      uint8_t* __restrict lo0 = o + j * d;
      uint8_t* __restrict lo1 = o + (j + e) * d;
      uint8_t* __restrict hrow = o + (j + 2 * e) * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) {
        uint32_t cm[8];
        for (int m = 0; m < 8; ++m) cm[m] = code(p[(j + m * e) * d + c], c);
        lo0[c] = static_cast<uint8_t>(low3(cm, 0));
        lo1[c] = static_cast<uint8_t>(low3(cm, 1));
        hrow[c] = static_cast<uint8_t>(high3(cm));
      }
    }
  } else {
    constexpr int64_t K = 8 / BITS;
    const int64_t q = g / K;
    for (int64_t j = 0; j < q; ++j) {
      uint8_t* __restrict orow = o + j * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) {
        uint32_t byte = 0;
        for (int64_t m = 0; m < K; ++m) byte |= code(p[(j + m * q) * d + c], c) << (m * BITS);
        orow[c] = static_cast<uint8_t>(byte);
      }
    }
  }
}

/// Unpacks one per-channel block: row r, column c of o = value(code, c).
template <int BITS, typename ValueFn>
KV_ALWAYS_INLINE void unpack_chan(const uint8_t* __restrict in, int64_t g, int64_t d, float* __restrict o,
                                  ValueFn value) {
  if constexpr (BITS == 3) {
    const int64_t e = g / 8;
    for (int64_t j = 0; j < e; ++j) {
      const uint8_t* lo0 = in + j * d;
      const uint8_t* lo1 = in + (j + e) * d;
      const uint8_t* hrow = in + (j + 2 * e) * d;
      for (int m = 0; m < 8; ++m) {
        float* __restrict orow = o + (j + m * e) * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) orow[c] = value(static_cast<float>(code3(lo0[c], lo1[c], hrow[c], m)), c);
      }
    }
  } else {
    constexpr int64_t K = 8 / BITS;
    constexpr uint32_t kMask = (1u << BITS) - 1u;
    const int64_t q = g / K;
    for (int64_t j = 0; j < q; ++j) {
      const uint8_t* irow = in + j * d;
      for (int64_t m = 0; m < K; ++m) {
        float* __restrict orow = o + (j + m * q) * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) {
          orow[c] = value(static_cast<float>((static_cast<uint32_t>(irow[c]) >> (m * BITS)) & kMask), c);
        }
      }
    }
  }
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
  const int64_t g = G > 0 ? G : g_rt;
  const int64_t q = g * BITS / 8;  // bytes per group
  // NaN/Inf flags are OR-ed lane-wise across all groups and reduced once at the end (a
  // per-group horizontal reduction would cost as much as the min/max ones).
  constexpr int64_t kLanes = 16;
  const int64_t g_lanes = g - g % kLanes;
  alignas(64) uint32_t bad_lanes[kLanes] = {};
  uint32_t bad = 0;
  alignas(64) float mn[kChunk], mx[kChunk], kv[kChunk], inv[kChunk];
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
        // (omp simd: GCC's SLP pass otherwise leaves this unrolled loop scalar when the
        // metadata code below grows, halving quantize throughput.)
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) bad_lanes[l] |= nonfinite_bit(p[e0 + l]);
      }
      for (int64_t e = g_lanes; e < g; ++e) bad |= nonfinite_bit(p[e]);
      mn[i] = lo;
      mx[i] = hi;
    }
    make_meta<BITS>(n, mn, mx, sc + k0, ze + k0, mn, inv, kv, f);  // mn now holds the codes' zero
    for (int64_t i = 0; i < n; ++i) {
      const float* __restrict p = x + (k0 + i) * g;
      uint8_t* __restrict o = codes + (k0 + i) * q;
      const float z = mn[i];
      const float iv = inv[i];
      if constexpr (BITS == 3) {
        if constexpr (std::is_same_v<MetaT, Half>) {
          pack_tok<3>(p, g, o, [z, iv](float v) { return code_of<3>(v, z, iv); });
        } else {
          const float k = kv[i];
          pack_tok<3>(p, g, o, [k, z, iv](float v) { return code_of_k<3>(v, k, z, iv); });
        }
      } else if constexpr (std::is_same_v<MetaT, Half>) {
        // The power-of-two widths keep main's loops as written (the helpers serve int3).
        constexpr int64_t K = 8 / BITS;
#pragma omp simd
        for (int64_t j = 0; j < q; ++j) {
          uint32_t byte = 0;
          for (int64_t m = 0; m < K; ++m) byte |= code_of<BITS>(p[j + m * q], z, iv) << (m * BITS);
          o[j] = static_cast<uint8_t>(byte);
        }
      } else {
        constexpr int64_t K = 8 / BITS;
        const float k = kv[i];
#pragma omp simd
        for (int64_t j = 0; j < q; ++j) {
          uint32_t byte = 0;
          for (int64_t m = 0; m < K; ++m) byte |= code_of_k<BITS>(p[j + m * q], k, z, iv) << (m * BITS);
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
  const int64_t g = G > 0 ? G : g_rt;
  const int64_t q = g * BITS / 8;
  for (int64_t k = g0; k < g1; ++k) {
    const float s = load_meta_scalar(sc[k]);
    const float z = load_meta_scalar(ze[k]);
    const uint8_t* __restrict in = codes + k * q;
    float* __restrict o = out + k * g;
    if constexpr (std::is_same_v<MetaT, Half>) {
      // |code·s + z| ≤ 255·65504 + 65504: finite, no clamp needed.
      if constexpr (BITS == 3) {
        unpack_tok<3>(in, g, o, [s, z](float c) { return c * s + z; });
      } else {
        constexpr int64_t K = 8 / BITS;
        constexpr uint32_t kMask = (1u << BITS) - 1u;
#pragma omp simd
        for (int64_t j = 0; j < q; ++j) {
          const uint32_t byte = in[j];
          for (int64_t m = 0; m < K; ++m) o[j + m * q] = static_cast<float>((byte >> (m * BITS)) & kMask) * s + z;
        }
      }
    } else {
      const Recon32 r = recon32(s, z);
      unpack_tok<BITS>(in, g, o, [r](float c) { return recon32_apply(c, r.sk, r.zk, r.lo, r.hi, r.back); });
    }
  }
}

// ---------------------------------------------------------------- per-channel
template <int BITS, typename MetaT>
KV_ALWAYS_INLINE void quant_chan(const float* __restrict x, int64_t b0, int64_t b1, int64_t g, int64_t d,
                                 uint8_t* __restrict codes, MetaT* __restrict sc, MetaT* __restrict ze,
                                 Flags* f) {
  const int64_t q = g * BITS / 8;  // code rows per block
  std::vector<float> buf(static_cast<size_t>(4 * d));
  float* mn = buf.data();
  float* __restrict mx = mn + d;
  float* __restrict kv = mx + d;
  float* __restrict inv = kv + d;
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
    make_meta<BITS>(d, mn, mx, sc + b * d, ze + b * d, mn, inv, kv, f);  // mn now holds the codes' zero
    uint8_t* o = codes + b * q * d;
    if constexpr (std::is_same_v<MetaT, Half> && BITS != 3) {
      constexpr int64_t K = 8 / BITS;
      for (int64_t j = 0; j < q; ++j) {
        uint8_t* __restrict orow = o + j * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) {
          uint32_t byte = 0;
          for (int64_t m = 0; m < K; ++m) byte |= code_of<BITS>(p[(j + m * q) * d + c], mn[c], inv[c]) << (m * BITS);
          orow[c] = static_cast<uint8_t>(byte);
        }
      }
    } else if constexpr (std::is_same_v<MetaT, Half>) {
      pack_chan<BITS>(p, g, d, o, [mn, inv](float v, int64_t c) { return code_of<BITS>(v, mn[c], inv[c]); });
    } else {
      pack_chan<BITS>(p, g, d, o,
                      [mn, inv, kv](float v, int64_t c) { return code_of_k<BITS>(v, kv[c], mn[c], inv[c]); });
    }
  }
  f->bad |= bad;
}

template <int BITS, typename MetaT>
KV_ALWAYS_INLINE void dequant_chan(const uint8_t* __restrict codes, const MetaT* __restrict sc,
                                   const MetaT* __restrict ze, int64_t b0, int64_t b1, int64_t g, int64_t d,
                                   float* __restrict out) {
  const int64_t q = g * BITS / 8;
  constexpr bool kHalf = std::is_same_v<MetaT, Half>;
  std::vector<float> buf(static_cast<size_t>((kHalf ? 2 : 5) * d));
  float* __restrict sv = buf.data();
  float* __restrict zv = sv + d;
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t c = 0; c < d; ++c) {
      sv[c] = load_meta(sc[b * d + c]);
      zv[c] = load_meta(ze[b * d + c]);
    }
    const uint8_t* in = codes + b * q * d;
    float* o = out + b * g * d;
    if constexpr (kHalf && BITS != 3) {
      constexpr int64_t K = 8 / BITS;
      constexpr uint32_t kMask = (1u << BITS) - 1u;
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
    } else if constexpr (kHalf) {
      unpack_chan<BITS>(in, g, d, o, [sv, zv](float code, int64_t c) { return code * sv[c] + zv[c]; });
    } else {
      float* __restrict lo = zv + d;
      float* __restrict hi = lo + d;
      float* __restrict back = hi + d;
      for (int64_t c = 0; c < d; ++c) {
        const Recon32 r = recon32(sv[c], zv[c]);
        sv[c] = r.sk;
        zv[c] = r.zk;
        lo[c] = r.lo;
        hi[c] = r.hi;
        back[c] = r.back;
      }
      unpack_chan<BITS>(in, g, d, o, [sv, zv, lo, hi, back](float code, int64_t c) {
        return recon32_apply(code, sv[c], zv[c], lo[c], hi[c], back[c]);
      });
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

KV_DEFINE_KERNELS(8, Half, 8h)
KV_DEFINE_KERNELS(4, Half, 4h)
KV_DEFINE_KERNELS(3, Half, 3h)
KV_DEFINE_KERNELS(2, Half, 2h)
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
  }
  KernelStatus status() const {
    KernelStatus s;
    s.nonfinite = nonfinite_.load();
    s.meta_overflow = meta_.load();
    return s;
  }

 private:
  std::atomic<bool> nonfinite_{false}, meta_{false};
};

void check_group(int bits, int64_t g) {
  KV_INTERNAL_ASSERT(g > 0 && g % codes_per_unit(bits) == 0, "group ", g, " not a multiple of ", codes_per_unit(bits));
}

}  // namespace

namespace avx512 {

namespace {
bool g_enabled = true;
}  // namespace

bool available() {
#if defined(KVCACHE_QUANT_AVX512)
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return ok;
#else
  return false;
#endif
}

bool handles(int bits, int64_t g) {
  if (g != 32 && g != 64 && g != 128) return false;
  if (bits != 8 && bits != 4 && bits != 2) return false;
  return (g / (8 / bits)) % 16 == 0;
}

void set_enabled(bool on) { g_enabled = on; }
bool enabled() { return g_enabled; }

}  // namespace avx512

#if !defined(KVCACHE_QUANT_AVX512)
// Built without the AVX-512 kernels (KVCACHE_FUSED=OFF, or not x86-64): available() is false,
// so nothing reaches these; they exist so that callers link in every build.
namespace avx512 {
void quantize_per_token_fp16(int, const float*, int64_t, int64_t, int64_t, uint8_t*, uint16_t*, uint16_t*,
                             uint32_t*, uint32_t*) {
  KV_INTERNAL_ASSERT(false, "the AVX-512 quantize kernel is not built (KVCACHE_FUSED=OFF)");
}
void dequantize_per_token_fp16(int, const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t,
                               float*, bool) {
  KV_INTERNAL_ASSERT(false, "the AVX-512 dequantize kernel is not built (KVCACHE_FUSED=OFF)");
}
}  // namespace avx512
#endif

#if defined(KVCACHE_QUANT_AVX512)
namespace {
/// The AVX-512 kernels take this call (fp16 metadata, a shape they handle, the CPU can).
bool use_avx512(int bits, int64_t g, MetaType meta) {
  return meta == MetaType::kHalf && avx512::enabled() && avx512::available() && avx512::handles(bits, g);
}
}  // namespace
#endif

KernelStatus quantize_per_token(int bits, const float* x, int64_t ngroups, int64_t g, uint8_t* codes,
                                void* scales, void* zeros, MetaType meta) {
  check_group(bits, g);
  StatusAccumulator acc;
#if defined(KVCACHE_QUANT_AVX512)
  if (use_avx512(bits, g, meta)) {
    detail::parallel_for(0, ngroups, grain(g), [&](int64_t b, int64_t e) {
      uint32_t bad = 0, meta_bad = 0;
      avx512::quantize_per_token_fp16(bits, x, b, e, g, codes, static_cast<uint16_t*>(scales),
                                      static_cast<uint16_t*>(zeros), &bad, &meta_bad);
      Flags f;
      f.bad = bad;
      f.meta_overflow = meta_bad;
      acc.add(f);
    });
    return acc.status();
  }
#endif
  const QuantTokFn fn = kQuantTok[variant(bits, meta)];
  detail::parallel_for(0, ngroups, grain(g), [&](int64_t b, int64_t e) {
    Flags f;
    fn(x, b, e, g, codes, scales, zeros, &f);
    acc.add(f);
  });
  return acc.status();
}

void dequantize_per_token(int bits, const uint8_t* codes, const void* scales, const void* zeros,
                          MetaType meta, int64_t ngroups, int64_t g, float* out) {
  check_group(bits, g);
#if defined(KVCACHE_QUANT_AVX512)
  if (use_avx512(bits, g, meta)) {
    // Non-temporal stores for an output well past the last-level cache (and 64-byte aligned):
    // nothing will read it back from cache soon, and they save reading each line first.
    constexpr int64_t kStreamBytes = int64_t{64} << 20;
    const bool stream = ngroups * g * 4 >= kStreamBytes && reinterpret_cast<uintptr_t>(out) % 64 == 0;
    detail::parallel_for(0, ngroups, grain(g), [&](int64_t b, int64_t e) {
      avx512::dequantize_per_token_fp16(bits, codes, static_cast<const uint16_t*>(scales),
                                        static_cast<const uint16_t*>(zeros), b, e, g, out, stream);
    });
    return;
  }
#endif
  const DequantTokFn fn = kDequantTok[variant(bits, meta)];
  detail::parallel_for(0, ngroups, grain(g), [&](int64_t b, int64_t e) { fn(codes, scales, zeros, b, e, g, out); });
}

KernelStatus quantize_per_channel(int bits, const float* x, int64_t nblocks, int64_t g, int64_t d,
                                  uint8_t* codes, void* scales, void* zeros, MetaType meta) {
  check_group(bits, g);
  const QuantChanFn fn = kQuantChan[variant(bits, meta)];
  StatusAccumulator acc;
  detail::parallel_for(0, nblocks, grain(g * d), [&](int64_t b, int64_t e) {
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
  detail::parallel_for(0, nblocks, grain(g * d),
                   [&](int64_t b, int64_t e) { fn(codes, scales, zeros, b, e, g, d, out); });
}

}  // namespace kvcache::quant
