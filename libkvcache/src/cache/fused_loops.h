// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file fused_loops.h (internal)
/// The loops the fused kernels' builds share, written once over a vector width: the float-key
/// score walk (qk_float), the value loaders of p·v (value_span) and the p·v loops (pv_rows,
/// pv_int_token) with their dispatch (pv, accumulate_rows). Each kernel unit (attend_avx512.cpp,
/// attend_avx2.cpp) instantiates them with its own lane traits `L`, as cache/attend_tiles.cpp
/// builds its tile kernels once per width:
///
///   using F = the register type; kLanes = W (floats per register); kRows (query rows per q·k
///     pass); kPvRows (query rows per p·v pass);
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

#include <immintrin.h>

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

// ---------------------------------------------------------------- TurboQuant
//
// Traits the TurboQuant loops use: TqLut (one region's codebook and unpack constants),
// tq_lut(levels16, bits), tq_centroids(p, lut) (the centroids of the W codes of the byte-aligned
// bit stream at p: W·bits/8 bytes), signs_pm1(p) (W sign bits at p as ±1.0f), div, sqrt.

/// Where a W-dim chunk [c, c + W) of a TurboQuant row lies: byte offset and region (the first
/// tq_n_hi codes have tq_hi bits, the rest tq_lo). c is a multiple of W and tq_n_hi (0 or D/2)
/// of 16, so a chunk starts on a byte and lies in one region.
struct TqChunk {
  int64_t offset;
  bool hi;
};
KV_ALWAYS_INLINE TqChunk tq_chunk(const KernelFormat& kf, int64_t c) {
  if (c < kf.tq_n_hi) return {c * kf.tq_hi / 8, true};
  return {(kf.tq_n_hi * kf.tq_hi + (c - kf.tq_n_hi) * kf.tq_lo) / 8, false};
}

constexpr float kTqQjl = 1.2533141373155003f;  ///< √(π/2)

/// TurboQuant keys: s = ‖k‖·f·(qrot·c) [+ √(π/2)/D·γ·(qsketch·z)], f = 1/‖c‖ with nc (1
/// otherwise). W keys × W dims of centroids are looked up in registers, transposed and
/// multiplied in float32 as qk_float does; ‖c‖² of the W keys accumulates on the way.
template <class L, int NR>
void qk_tq(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  using F = typename L::F;
  constexpr int W = L::kLanes;
  const KernelFormat& kf = k.kf;
  const int64_t d = q.d;
  const int64_t row_bytes = kf.code_bytes, mc = kf.meta_count;
  const uint8_t* meta = k.block + kf.scales_offset;
  const typename L::TqLut lut_hi = L::tq_lut(kf.tq_levels_hi, kf.tq_hi);
  const typename L::TqLut lut_lo = L::tq_lut(kf.tq_levels_lo, kf.tq_lo);
  const float qjl = kTqQjl / static_cast<float>(d);
  for (int64_t j0 = 0; j0 < n; j0 += W) {
    const int m = static_cast<int>(min64(W, n - j0));
    const int32_t* slots = k.slots + j0;
    F out[NR];
    for (int r = 0; r < NR; ++r) out[r] = L::zero();
    F csq = L::zero();
    for (int64_t c = 0; c < d; c += W) {
      const TqChunk ch = tq_chunk(kf, c);
      const typename L::TqLut& lut = ch.hi ? lut_hi : lut_lo;
      F kt[W];
      for (int j = 0; j < W; ++j) {
        kt[j] = j < m ? L::tq_centroids(k.block + static_cast<int64_t>(slots[j]) * row_bytes + ch.offset, lut)
                      : L::zero();
      }
      L::transpose(kt);
#pragma GCC unroll 16
      for (int e = 0; e < W; ++e) {
        if (kf.tq_nc) csq = L::fmadd(kt[e], kt[e], csq);
        for (int r = 0; r < NR; ++r) out[r] = L::fmadd(kt[e], L::set1(q.qrot[(r0 + r) * d + c + e]), out[r]);
      }
    }
    F scale = L::meta(meta, slots, m, mc, 0);  // ‖k‖ (lanes ≥ m: 0, never stored)
    if (kf.tq_nc) scale = L::div(scale, L::sqrt(csq));
    for (int r = 0; r < NR; ++r) out[r] = L::mul(out[r], scale);
    if (kf.tq_prod) {
      F sk[NR];
      for (int r = 0; r < NR; ++r) sk[r] = L::zero();
      for (int64_t c = 0; c < d; c += W) {
        F zt[W];
        for (int j = 0; j < W; ++j) {
          zt[j] = j < m ? L::signs_pm1(k.block + static_cast<int64_t>(slots[j]) * row_bytes + kf.tq_mse_bytes + c / 8)
                        : L::zero();
        }
        L::transpose(zt);
#pragma GCC unroll 16
        for (int e = 0; e < W; ++e) {
          for (int r = 0; r < NR; ++r) sk[r] = L::fmadd(zt[e], L::set1(q.qsketch[(r0 + r) * d + c + e]), sk[r]);
        }
      }
      const F g = L::mul(L::meta(meta, slots, m, mc, 1), L::set1(qjl));  // √(π/2)/D · γ
      for (int r = 0; r < NR; ++r) out[r] = L::fmadd(sk[r], g, out[r]);
    }
    for (int r = 0; r < NR; ++r) L::store_row(s + r * ld + j0, out[r], m);
  }
}

/// One span of p·v: acc[r][at, at + 2W) += Σ_j wt(r, j) · x_j over keys j < n ≤ 64, rows
/// r < NR, with start(r, a0, a1) giving row r's starting accumulators (its acc, plus what the
/// format adds) and x(j, x0, x1) key j's dims [at, at + 2W), dequantized. Where NR rows fit one
/// pass (NR ≤ L::kPvRows) the keys are dequantized in it; otherwise (AVX2's 7 rows of at most
/// 6: 2·7 accumulators + 2 values + 1 weight are 17 of its 16 ymm registers, and the spilled
/// accumulator costs a store-to-load round trip per key) the span's values are dequantized once
/// into a scratch row that even groups of rows then read. Either way each row's sum runs over
/// the keys in the same order, term for term: the outputs do not depend on the grouping.
/// kSplit = false keeps one pass whatever NR: the codebook formats, whose lookups are cheap
/// next to the scratch row's stores and loads (TurboQuant 0.84-0.90x, PolarQuant 0.92x split,
/// Zen 3: docs/performance.md).
template <class L, int NR, bool kSplit = true, class Start, class Weight, class Unpack>
KV_ALWAYS_INLINE void pv_span(int64_t n, int64_t d, int64_t at, float* acc, Start&& start, Weight&& wt,
                              Unpack&& unpack) {
  using F = typename L::F;
  constexpr int W = L::kLanes;
  // Rows [g, g + R) over the keys, x(j, x0, x1) giving key j's dims.
  const auto pass = [&](auto rows, int64_t g, auto&& x) {
    constexpr int R = decltype(rows)::value;
    F a[R][2];
    for (int r = 0; r < R; ++r) start(g + r, a[r][0], a[r][1]);
    for (int64_t j = 0; j < n; ++j) {
      F x0, x1;
      x(j, x0, x1);
      for (int r = 0; r < R; ++r) {
        const F wj = L::set1(wt(g + r, j));
        a[r][0] = L::fmadd(wj, x0, a[r][0]);
        a[r][1] = L::fmadd(wj, x1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      L::storeu(acc + (g + r) * d + at, a[r][0]);
      L::storeu(acc + (g + r) * d + at + W, a[r][1]);
    }
  };
  if constexpr (NR <= L::kPvRows || !kSplit) {
    pass(Rows<NR>{}, 0, unpack);
  } else {
    alignas(64) float xs[64][2 * W];
    for (int64_t j = 0; j < n; ++j) {
      F x0, x1;
      unpack(j, x0, x1);
      L::store(xs[j], x0);
      L::store(xs[j] + W, x1);
    }
    for_even_row_groups<L::kPvRows>(NR, [&](auto rows, int64_t g) {
      pass(rows, g, [&](int64_t j, F& x0, F& x1) {
        x0 = L::load(xs[j]);
        x1 = L::load(xs[j] + W);
      });
    });
  }
}

/// A span's rows start from their accumulators (formats that add nothing else).
template <class L>
struct LoadAcc {
  const float* acc;
  int64_t d, at;
  KV_ALWAYS_INLINE void operator()(int64_t r, typename L::F& a0, typename L::F& a1) const {
    a0 = L::loadu(acc + r * d + at);
    a1 = L::loadu(acc + r * d + at + L::kLanes);
  }
};

/// TurboQuant values, in the rotated domain (attend_fused.h): acc[r] += Σ_j p_rj·‖v_j‖·f_j·c_j,
/// the centroids looked up in registers 2W dims at a time with the rows' accumulators in
/// registers; the caller rotates acc back once per row (fused::add_rotated_back).
template <class L, int NR>
void pv_tq(const float* p, int64_t ld, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  using F = typename L::F;
  constexpr int W = L::kLanes;
  const KernelFormat& kf = v.kf;
  const int64_t row_bytes = kf.code_bytes, mc = kf.meta_count;
  const uint8_t* meta = v.block + kf.scales_offset;
  const typename L::TqLut lut_hi = L::tq_lut(kf.tq_levels_hi, kf.tq_hi);
  const typename L::TqLut lut_lo = L::tq_lut(kf.tq_levels_lo, kf.tq_lo);
  alignas(64) float w[NR][64];  // n ≤ 64 (accumulate_rows): p · ‖v‖ · f
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* row = v.block + static_cast<int64_t>(v.slots[j]) * row_bytes;
    float kw = half_at(meta, static_cast<int64_t>(v.slots[j]) * mc);
    if (kf.tq_nc) {
      F cc = L::zero();
      for (int64_t c = 0; c < d; c += W) {
        const TqChunk ch = tq_chunk(kf, c);
        const F x = L::tq_centroids(row + ch.offset, ch.hi ? lut_hi : lut_lo);
        cc = L::fmadd(x, x, cc);
      }
      kw /= _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(L::hsum(cc))));  // no <cmath>: fused_abi.h
    }
    for (int r = 0; r < NR; ++r) w[r][j] = p[r * ld + j] * kw;
  }
  for (int64_t h = 0; h < d / (2 * W); ++h) {
    const int64_t at = 2 * W * h;
    const TqChunk c0 = tq_chunk(kf, at), c1 = tq_chunk(kf, at + W);
    const typename L::TqLut& l0 = c0.hi ? lut_hi : lut_lo;
    const typename L::TqLut& l1 = c1.hi ? lut_hi : lut_lo;
    pv_span<L, NR, false>(
        n, d, at, acc, LoadAcc<L>{acc, d, at}, [&](int64_t r, int64_t j) { return w[r][j]; },
        [&](int64_t j, F& x0, F& x1) {
          const uint8_t* row = v.block + static_cast<int64_t>(v.slots[j]) * row_bytes;
          x0 = L::tq_centroids(row + c0.offset, l0);
          x1 = L::tq_centroids(row + c1.offset, l1);
        });
  }
}

// ---------------------------------------------------------------- PolarQuant
//
// Traits: PolarLut (the cos/sin tables in registers), polar_lut(angles80),
// polar_chunk(row, c, lut): dims [c, c + W) of a row's preconditioned vector y without the
// block's radius ρ (Π over the four levels of cos or sin of the lane's angle).

/// The radius ρ of 16-dim block `b` of token `slot` (fp16, D/16 per token).
inline float polar_radius(const RawTokens& t, int32_t slot, int64_t b) {
  return half_at(t.block + t.kf.scales_offset, static_cast<int64_t>(slot) * t.kf.meta_count + b);
}

/// PolarQuant keys: s = (H·diag(s)·q)·y, y rebuilt W dims at a time in registers (ρ times the
/// four levels' cos/sin), transposed and multiplied in float32 as qk_float does.
template <class L, int NR>
void qk_polar(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  using F = typename L::F;
  constexpr int W = L::kLanes;
  const int64_t d = q.d, row_bytes = k.kf.code_bytes;
  const typename L::PolarLut lut = L::polar_lut(k.kf.polar_angles);
  for (int64_t j0 = 0; j0 < n; j0 += W) {
    const int m = static_cast<int>(min64(W, n - j0));
    const int32_t* slots = k.slots + j0;
    F out[NR];
    for (int r = 0; r < NR; ++r) out[r] = L::zero();
    for (int64_t c = 0; c < d; c += W) {
      F kt[W];
      for (int j = 0; j < W; ++j) {
        kt[j] = j < m ? L::mul(L::polar_chunk(k.block + static_cast<int64_t>(slots[j]) * row_bytes, c, lut),
                               L::set1(polar_radius(k, slots[j], c / 16)))
                      : L::zero();
      }
      L::transpose(kt);
#pragma GCC unroll 16
      for (int e = 0; e < W; ++e) {
        for (int r = 0; r < NR; ++r) out[r] = L::fmadd(kt[e], L::set1(q.qrot[(r0 + r) * d + c + e]), out[r]);
      }
    }
    for (int r = 0; r < NR; ++r) L::store_row(s + r * ld + j0, out[r], m);
  }
}

/// PolarQuant values, in the rotated domain as TurboQuant's: acc[r] += Σ_j p_rj·y_j.
template <class L, int NR>
void pv_polar(const float* p, int64_t ld, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  using F = typename L::F;
  constexpr int W = L::kLanes;
  const int64_t row_bytes = v.kf.code_bytes;
  const typename L::PolarLut lut = L::polar_lut(v.kf.polar_angles);
  for (int64_t h = 0; h < d / (2 * W); ++h) {
    const int64_t c0 = 2 * W * h, c1 = c0 + W;
    pv_span<L, NR, false>(
        n, d, c0, acc, LoadAcc<L>{acc, d, c0}, [&](int64_t r, int64_t j) { return p[r * ld + j]; },
        [&](int64_t j, F& x0, F& x1) {
          const uint8_t* row = v.block + static_cast<int64_t>(v.slots[j]) * row_bytes;
          x0 = L::mul(L::polar_chunk(row, c0, lut), L::set1(polar_radius(v, v.slots[j], c0 / 16)));
          x1 = L::mul(L::polar_chunk(row, c1, lut), L::set1(polar_radius(v, v.slots[j], c1 / 16)));
        });
  }
}

// ---------------------------------------------------------------- QJL keys

/// W keys' dots of the ±1 signs at bit `bit0` of each key's sign bits (`row0 + t·tok_bytes`,
/// t the key's token in its group) with u[r] (`cols` entries, zero-padded to a multiple of W:
/// the bits read past them, the next stream's or token's, meet zeros), added to out[r].
template <class L, int NR>
inline void sign_dots(const uint8_t* row0, int64_t tok_bytes, const int32_t* ts, int m, int64_t bit0, int64_t cols,
                      const float (*u)[kMaxQjlSketch], typename L::F (&out)[NR]) {
  using F = typename L::F;
  constexpr int W = L::kLanes;
  for (int64_t c = 0; c < cols; c += W) {
    F zt[W];
    for (int j = 0; j < W; ++j) {
      zt[j] = j < m ? L::signs_pm1(row0 + static_cast<int64_t>(ts[j]) * tok_bytes + (bit0 + c) / 8) : L::zero();
    }
    L::transpose(zt);
#pragma GCC unroll 16
    for (int e = 0; e < W; ++e) {
      for (int r = 0; r < NR; ++r) out[r] = L::fmadd(zt[e], L::set1(u[r][c + e]), out[r]);
    }
  }
}

/// QJL keys (quant/qjl_quantizer.h): s = √(π/2)/m·‖k_in‖·⟨S q_in, z⟩ + √(π/2)/m_o·‖k_out‖·⟨S_o q_out, z_o⟩.
/// Per group (the block's slots in runs of one group): u = S q − Σ_{c∈out} q_c S[:, c] and
/// u_o = Σ_{c∈out} q_c S[:m_o, c] (S q once per step, QueryView::qsketch; Sᵀ the quantizer's, built once: sketch_t); per W keys the sign
/// bits as ±1 lanes, transposed, multiplied with u in float32.
template <class L, int NR>
void qk_qjl(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  using F = typename L::F;
  constexpr int W = L::kLanes;
  const KernelFormat& kf = k.kf;
  const int64_t d = q.d, g = kf.group, m = kf.qjl_m, mo = kf.qjl_mo, o = kf.qjl_o;
  const int64_t tok_bytes = (m + mo) / 8;
  const int64_t m_pad = (m + W - 1) / W * W, mo_pad = (mo + W - 1) / W * W;
  const float c_in = kTqQjl / static_cast<float>(m), c_out = mo > 0 ? kTqQjl / static_cast<float>(mo) : 0.0f;
  const uint8_t* meta = k.block + kf.scales_offset;
  alignas(64) float u[NR][kMaxQjlSketch], uo[NR][kMaxQjlSketch];
  alignas(64) int32_t ts[64];  // tokens in the group of W keys (slot mod g)
  for (int64_t j0 = 0; j0 < n;) {
    const int64_t gi = k.slots[j0] / g;
    int64_t j1 = j0 + 1;
    while (j1 < n && k.slots[j1] / g == gi) ++j1;  // slots increase: one group's run
    const uint8_t* cg = k.block + gi * kf.code_bytes;
    bool seen[256] = {};  // an index repeated (or past D) marks its channel once (or none), as decode does
    for (int r = 0; r < NR; ++r) {
      const float* sq = q.qsketch + (r0 + r) * m;
      for (int64_t j = 0; j < m_pad; ++j) u[r][j] = j < m ? sq[j] : 0.0f;
      for (int64_t j = 0; j < mo_pad; ++j) uo[r][j] = 0.0f;
    }
    for (int64_t i = 0; i < o; ++i) {
      const int c = cg[i];
      if (c >= d || seen[c]) continue;
      seen[c] = true;
      const float* sc = q.sketch_t + c * m;  // S[:, c], contiguous
      for (int r = 0; r < NR; ++r) {
        const float qc = q.qf[(r0 + r) * d + c];
        float* __restrict ur = u[r];
        float* __restrict uor = uo[r];
        for (int64_t j = 0; j < m; ++j) ur[j] -= qc * sc[j];
        for (int64_t j = 0; j < mo; ++j) uor[j] += qc * sc[j];
      }
    }
    const uint8_t* row0 = cg + o;
    for (int64_t jb = j0; jb < j1; jb += W) {
      const int mm = static_cast<int>(min64(W, j1 - jb));
      for (int j = 0; j < mm; ++j) ts[j] = static_cast<int32_t>(k.slots[jb + j] - gi * g);
      F in[NR], out[NR];
      for (int r = 0; r < NR; ++r) in[r] = out[r] = L::zero();
      sign_dots<L, NR>(row0, tok_bytes, ts, mm, 0, m_pad, u, in);
      if (mo > 0) sign_dots<L, NR>(row0, tok_bytes, ts, mm, m, mo_pad, uo, out);
      // Norms: fp16 words 2·slot (‖k_in‖) and 2·slot + 1 (‖k_out‖) of the block's scales.
      const F a = L::mul(L::meta(meta, k.slots + jb, mm, 2, 0), L::set1(c_in));
      const F b = L::mul(L::meta(meta, k.slots + jb, mm, 2, 1), L::set1(c_out));
      for (int r = 0; r < NR; ++r) L::store_row(s + r * ld + jb, L::fmadd(out[r], b, L::mul(in[r], a)), mm);
    }
    j0 = j1;
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
    const int64_t at = 2 * W * h;
    pv_span<L, NR>(
        n, d, at, acc, LoadAcc<L>{acc, d, at}, [&](int64_t r, int64_t j) { return p[r * ld + j]; },
        [&](int64_t j, F& x0, F& x1) { value_span<L, K>(v, v.slots[j], h, cs, cz, x0, x1); });
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
    pv_span<L, NR>(
        n, d, at, acc,
        [&](int64_t r, F& a0, F& a1) {
          const F z = L::set1(zsum[r][gi]);
          a0 = L::add(L::loadu(acc + r * d + at), z);
          a1 = L::add(L::loadu(acc + r * d + at + W), z);
        },
        [&](int64_t r, int64_t j) { return w[r][gi][j]; },
        [&](int64_t j, F& x0, F& x1) {
          L::token_codes(v.block + static_cast<int64_t>(v.slots[j]) * row_bytes, tc, bits, at, x0, x1);
        });
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
    case Kind::kTurboQuant: return pv_tq<L, NR>(p, ld, v, n, d, acc);
    case Kind::kPolar: return pv_polar<L, NR>(p, ld, v, n, d, acc);
    case Kind::kQjl:  // keys only (fusable() sends a layer with QJL values to the generic path)
    case Kind::kNone: break;
  }
}

/// fused::accumulate for the unit of traits L: keys 64 at a time (pv_int_token's and pv_rows'
/// weights are sized for 64 keys); rows in groups of L::kRows, except float values (fp32,
/// fp16, bf16, fp8), whose passes take even groups of at most L::kPvRows (for_even_row_groups):
/// a float value costs one conversion, and a pass over fewer rows converts it again. Integer
/// values take L::kRows and split them inside pv_span, after dequantizing a span's values once
/// (splitting here, each pass unpacking again, measured 0.85-0.95x for per-token integers on
/// Zen 3: docs/performance.md, "Zen 3"); codebook values take L::kRows in one pass. How rows are
/// grouped changes no output: each row's sum runs over the keys in the same order whatever rows
/// share its pass.
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
  const auto pass = [&](auto rows, int64_t g) { pv<L, decltype(rows)::value>(p + g * ld, ld, v, n, d, acc + g * d); };
  using Kind = KernelFormat::Kind;
  switch (v.kf.kind) {
    case Kind::kF32:
    case Kind::kF16:
    case Kind::kBF16:
    case Kind::kE4M3:
    case Kind::kE5M2:
      return for_even_row_groups<L::kPvRows>(nr, pass);
    default:
      return for_row_groups<L::kRows>(nr, pass);
  }
}

}  // namespace
}  // namespace kvcache::cache::fused
