// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file fused_loops.h (internal)
/// The loops the fused kernels' builds share, written once over a vector width: the float-key
/// score walk (qk_float), the value loaders of p·v (value_span) and the p·v loops (pv_rows,
/// pv_int_token) with their dispatch (pv, accumulate_rows). Each kernel unit (attend_avx512.cpp,
/// attend_avx2.cpp) instantiates them with its own lane traits `L`, as cache/attend_tiles.cpp
/// builds its tile kernels once per width:
///
///   using F = the register type; kLanes = W (floats per register); kRows (query rows per pass);
///   kE4m3Weight: what p·v's weights carry for e4m3 values (256 where fp8_values() returns the
///     e4m3 value times 2^-8, 1 where it returns the value itself);
///   zero(), set1(x), load(p) (aligned), loadu(p), store(p, v) (aligned), storeu(p, v),
///   load_first(p, m) (lanes [0, m), the rest 0), store_row(p, v, m) (lanes [0, m)),
///   fmadd(a, b, c) = a·b + c, add, mul, hsum(v) (the unit's fixed reduction order),
///   transpose(F (&)[W]) (W×W floats in place: r[e] lane j = old r[j] element e),
///   meta(base, slots, m, mc, gi) (fp16 scales/zeros of group gi of W token slots),
///   load_values<K>(p) (W stored values of a float format K, as floats),
///   fp8_values<K>(p, x0, x1) (2W fp8 codes at p, see kE4m3Weight),
///   channel_codes(v, pos, span, x0, x1) (codes of dims [2W·span, 2W·span + 2W) of the
///     per-channel token at pos, as floats),
///   token_codes(row, tc, bits, at, x0, x1) (codes of dims [at, at + 2W) of a per-token row
///     whose 32-dim chunk at/32 is tc, as floats).
///
/// The arithmetic — which products are summed in which order — is the one each unit had with
/// its own copy of these loops, so the outputs are bit for bit what they were (tests:
/// attend_fused_test; a byte comparison of attend() outputs over every fused format, both ISAs,
/// before and after the loops were shared). Include only from the kernel units, after the
/// traits: everything here has internal linkage (fused_codes.h explains why).

#include <cstdint>

#include "cache/fused_abi.h"
#include "cache/fused_codes.h"

namespace kvcache::cache::fused {
namespace {  // NOLINT(google-build-namespaces): internal linkage per kernel unit (fused_codes.h)

// ---------------------------------------------------------------- q·k of float keys

/// Float keys (and, where the unit has no kernel of its own for them, bf16 and fp8 keys): W
/// keys × W dims converted in registers, transposed, multiplied in float32, dims ascending per
/// row; the scores times the stream's tensor scale (1 unless fp8:*:scaled).
template <class L, int NR, KernelFormat::Kind K>
void qk_float(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  using F = typename L::F;
  constexpr int W = L::kLanes;
  const int64_t d = q.d;
  const int64_t row_bytes = k.kf.code_bytes;
  const float ts = k.kf.scaled ? k.tensor_scale : 1.0f;
  for (int64_t j0 = 0; j0 < n; j0 += W) {
    const int m = static_cast<int>(min64(W, n - j0));
    const int32_t* slots = k.slots + j0;
    F out[NR];
    for (int r = 0; r < NR; ++r) out[r] = L::zero();
    for (int64_t c = 0; c < d; c += W) {
      F kt[W];
      for (int j = 0; j < W; ++j) {
        kt[j] = j < m ? L::template load_values<K>(k.block + static_cast<int64_t>(slots[j]) * row_bytes +
                                                   c * value_bytes<K>())
                      : L::zero();
      }
      L::transpose(kt);
#pragma GCC unroll 16
      for (int e = 0; e < W; ++e) {
        for (int r = 0; r < NR; ++r) out[r] = L::fmadd(kt[e], L::set1(q.qf[(r0 + r) * d + c + e]), out[r]);
      }
    }
    for (int r = 0; r < NR; ++r) L::store_row(s + r * ld + j0, L::mul(out[r], L::set1(ts)), m);
  }
}

// ---------------------------------------------------------------- p·v

/// Dims [2W·span, 2W·span + 2W) of value slot `slot`, dequantized: x0 (first W), x1. Per-channel
/// integers take the block's channel scales and zeros from cs, cz (floats, D each); fp8 values
/// come as L::fp8_values gives them (see kE4m3Weight; the stream's scale is in the weights).
/// (Per-token integer values take pv_int_token.)
template <class L, KernelFormat::Kind K>
inline void value_span(const RawTokens& v, int32_t slot, int64_t span, const float* cs, const float* cz,
                       typename L::F& x0, typename L::F& x1) {
  using Kind = KernelFormat::Kind;
  constexpr int W = L::kLanes;
  static_assert(K != Kind::kIntToken);
  const uint8_t* row = v.block + static_cast<int64_t>(slot) * v.kf.code_bytes;
  if constexpr (K == Kind::kIntChannel) {
    L::channel_codes(v, chan_pos(v, slot), span, x0, x1);
    x0 = L::fmadd(x0, L::loadu(cs + 2 * W * span), L::loadu(cz + 2 * W * span));
    x1 = L::fmadd(x1, L::loadu(cs + 2 * W * span + W), L::loadu(cz + 2 * W * span + W));
  } else if constexpr (K == Kind::kE4M3 || K == Kind::kE5M2) {
    L::template fp8_values<K>(row + 2 * W * span, x0, x1);
  } else {
    row += 2 * W * span * value_bytes<K>();
    x0 = L::template load_values<K>(row);
    x1 = L::template load_values<K>(row + W * value_bytes<K>());
  }
}

/// acc[r] += Σ_j p[r][j] · v_j, 2W dims at a time with the rows' accumulators in registers.
/// (Float formats and per-channel integers; per-token integers: pv_int_token.)
template <class L, int NR, KernelFormat::Kind K>
void pv_rows_impl(const float* p, int64_t ld, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  using F = typename L::F;
  constexpr int W = L::kLanes;
  alignas(64) float cs[256], cz[256];
  if constexpr (K == KernelFormat::Kind::kIntChannel) {
    for (int64_t i = 0; i < d; ++i) {
      cs[i] = half_at(v.block + v.kf.scales_offset, i);
      cz[i] = half_at(v.block + v.kf.zeros_offset, i);
    }
  }
  for (int64_t h = 0; h < d / (2 * W); ++h) {
    F a[NR][2];
    for (int r = 0; r < NR; ++r) {
      a[r][0] = L::loadu(acc + r * d + 2 * W * h);
      a[r][1] = L::loadu(acc + r * d + 2 * W * h + W);
    }
    for (int64_t j = 0; j < n; ++j) {
      F x0, x1;
      value_span<L, K>(v, v.slots[j], h, cs, cz, x0, x1);
      for (int r = 0; r < NR; ++r) {
        const F pj = L::set1(p[r * ld + j]);
        a[r][0] = L::fmadd(pj, x0, a[r][0]);
        a[r][1] = L::fmadd(pj, x1, a[r][1]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      L::storeu(acc + r * d + 2 * W * h, a[r][0]);
      L::storeu(acc + r * d + 2 * W * h + W, a[r][1]);
    }
  }
}

/// The weights carry what the values do not: kE4m3Weight for e4m3 (a power of two: exact) and
/// the stream's scale for fp8:*:scaled, one multiply per weight instead of one per value
/// (p·scale rounded where the generic path rounds v·scale: within kFloatTol, and exact for a
/// weight of 1).
template <class L, int NR, KernelFormat::Kind K>
void pv_rows(const float* p, int64_t ld, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  const float f = (K == KernelFormat::Kind::kE4M3 ? L::kE4m3Weight : 1.0f) * (v.kf.scaled ? v.tensor_scale : 1.0f);
  if (f == 1.0f) return pv_rows_impl<L, NR, K>(p, ld, v, n, d, acc);
  alignas(64) float pw[NR][64];  // n ≤ 64 (accumulate_rows)
  for (int r = 0; r < NR; ++r) {
    for (int64_t j = 0; j < n; ++j) pw[r][j] = f * p[r * ld + j];
  }
  pv_rows_impl<L, NR, K>(&pw[0][0], 64, v, n, d, acc);
}

/// Per-token integer values: v_jd = s_jG c_jd + z_jG (G the group of dim d), so
/// Σ_j p_j v_jd = Σ_j (p_j s_jG) c_jd + Σ_j p_j z_jG: the weights p·s and the zero sums are
/// formed W keys at a time, and the inner loop only converts codes and multiplies.
template <class L, int NR>
void pv_int_token(const float* p, int64_t ld, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  using F = typename L::F;
  constexpr int W = L::kLanes;
  const int64_t mc = v.kf.meta_count;  // groups per token
  const uint8_t* sc = v.block + v.kf.scales_offset;
  const uint8_t* ze = v.block + v.kf.zeros_offset;
  alignas(64) float w[NR][8][64];     // [row][group][key]: p · s (n ≤ 64 per call, groups ≤ 8)
  alignas(64) float zacc[NR][8][W];   // [row][group]: Σ p·z, W lanes
  for (int r = 0; r < NR; ++r) {
    for (int64_t gi = 0; gi < mc; ++gi) L::store(zacc[r][gi], L::zero());
  }
  for (int64_t j0 = 0; j0 < n; j0 += W) {
    const int m = static_cast<int>(min64(W, n - j0));
    for (int64_t gi = 0; gi < mc; ++gi) {
      const F sv = L::meta(sc, v.slots + j0, m, mc, gi);
      const F zv = L::meta(ze, v.slots + j0, m, mc, gi);
      for (int r = 0; r < NR; ++r) {
        const F pr = L::load_first(p + r * ld + j0, m);
        L::store(&w[r][gi][j0], L::mul(pr, sv));
        L::store(zacc[r][gi], L::fmadd(pr, zv, L::load(zacc[r][gi])));
      }
    }
  }
  float zsum[NR][8];
  for (int r = 0; r < NR; ++r) {
    for (int64_t gi = 0; gi < mc; ++gi) zsum[r][gi] = L::hsum(L::load(zacc[r][gi]));
  }
  const int bits = v.kf.bits;
  const int64_t row_bytes = v.kf.code_bytes;
  for (int64_t at = 0; at < d; at += 2 * W) {
    const int64_t chunk = at / 32;
    const int64_t gi = 32 * chunk / v.kf.group;
    const TokenChunk tc = token_chunk(v.kf, chunk);
    F a[NR][2];
    for (int r = 0; r < NR; ++r) {
      const F z = L::set1(zsum[r][gi]);
      a[r][0] = L::add(L::loadu(acc + r * d + at), z);
      a[r][1] = L::add(L::loadu(acc + r * d + at + W), z);
    }
    for (int64_t j = 0; j < n; ++j) {
      F x0, x1;
      L::token_codes(v.block + static_cast<int64_t>(v.slots[j]) * row_bytes, tc, bits, at, x0, x1);
      for (int r = 0; r < NR; ++r) {
        const F wj = L::set1(w[r][gi][j]);
        a[r][0] = L::fmadd(wj, x0, a[r][0]);
        a[r][1] = L::fmadd(wj, x1, a[r][1]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      L::storeu(acc + r * d + at, a[r][0]);
      L::storeu(acc + r * d + at + W, a[r][1]);
    }
  }
}

template <class L, int NR>
void pv(const float* p, int64_t ld, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  using Kind = KernelFormat::Kind;
  switch (v.kf.kind) {
    case Kind::kF32: return pv_rows<L, NR, Kind::kF32>(p, ld, v, n, d, acc);
    case Kind::kF16: return pv_rows<L, NR, Kind::kF16>(p, ld, v, n, d, acc);
    case Kind::kBF16: return pv_rows<L, NR, Kind::kBF16>(p, ld, v, n, d, acc);
    case Kind::kE4M3: return pv_rows<L, NR, Kind::kE4M3>(p, ld, v, n, d, acc);
    case Kind::kE5M2: return pv_rows<L, NR, Kind::kE5M2>(p, ld, v, n, d, acc);
    case Kind::kIntToken: return pv_int_token<L, NR>(p, ld, v, n, d, acc);
    case Kind::kIntChannel: return pv_rows<L, NR, Kind::kIntChannel>(p, ld, v, n, d, acc);
    case Kind::kNone: break;
  }
}

/// fused::accumulate for the unit of traits L: rows in groups of L::kRows, keys 64 at a time
/// (pv_int_token's and pv_rows' weights are sized for 64 keys).
template <class L>
void accumulate_rows(const float* p, int64_t ld, int64_t nr, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  if (n > 64) {
    for (int64_t j = 0; j < n; j += 64) {
      RawTokens part = v;
      part.slots = v.slots + j;
      accumulate_rows<L>(p + j, ld, nr, part, min64(64, n - j), d, acc);
    }
    return;
  }
  for_row_groups<L::kRows>(nr, [&](auto rows, int64_t g) {
    pv<L, decltype(rows)::value>(p + g * ld, ld, v, n, d, acc + g * d);
  });
}

}  // namespace
}  // namespace kvcache::cache::fused
