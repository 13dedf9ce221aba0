// SPDX-License-Identifier: Apache-2.0
// The fused attention kernels (attend_fused.h) for x86-64 with AVX-512 F/BW/VL/DQ, VNNI, VBMI
// and F16C. This translation unit is compiled with those instructions enabled and is entered
// only through fused::scores / fused::accumulate when the dispatch (fused::current_isa(),
// attend_fused.cpp) found them on the CPU: nothing in it may run at load time (no dynamic
// initialisers).
//
// Layouts read (docs/quantizers.md "Packing layout", StoredLayout): a block is
// [codes | scales | zeros]; a per-token format stores token slot s's codes at s·code_bytes and
// its group scales/zeros (fp16) at s·meta_count; a per-channel block holds one group of g
// tokens: code row j, byte d holds tokens j + m·rows (m < 8/bits) of channel d, and D fp16
// scales and zeros.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cache/fused_abi.h"
#include "cache/fused_codes.h"
#include "cache/fused_loops.h"

namespace kvcache::cache::fused::avx512 {
namespace {

using Kind = KernelFormat::Kind;

// ---------------------------------------------------------------- conversions

/// 16 stored values of a 16- or 32-bit float format at `p` → 16 floats (fp8 codes are widened
/// 32 or more at a time: qk_fp8, Lanes512::fp8_values).
template <Kind K>
inline __m512 load16(const uint8_t* p) {
  if constexpr (K == Kind::kF32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (K == Kind::kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    static_assert(K == Kind::kBF16);
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
}


// ---------------------------------------------------------------- integer codes


/// 16 ymm rows of 8 dwords (keys j, dwords 0..7) → 8 zmm: out[e] lane j = row j's dword e.
KV_ALWAYS_INLINE void transpose_16x8(const __m256i (&in)[16], __m512i (&out)[8]) {
  __m512i z[8];
  for (int i = 0; i < 8; ++i) z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(in[i]), in[i + 8], 1);
  __m512i t[8];
  for (int a = 0; a < 4; ++a) {
    t[2 * a] = _mm512_unpacklo_epi32(z[2 * a], z[2 * a + 1]);
    t[2 * a + 1] = _mm512_unpackhi_epi32(z[2 * a], z[2 * a + 1]);
  }
  __m512i u[2][4];
  for (int b = 0; b < 2; ++b) {
    u[b][0] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
    u[b][1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
    u[b][2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
    u[b][3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[0][k], u[1][k], 0x88);  // lanes (0,2 | 0,2)
    const __m512i x1 = _mm512_shuffle_i32x4(u[0][k], u[1][k], 0xDD);  // lanes (1,3 | 1,3)
    out[k] = _mm512_shuffle_i32x4(x0, x0, 0xD8);
    out[4 + k] = _mm512_shuffle_i32x4(x1, x1, 0xD8);
  }
}

/// 16×16 float transpose in place: r[e] lane j = old r[j] element e.
KV_ALWAYS_INLINE void transpose_16x16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m512 v[4][4];  // v[b][k] lane L = keys 4b..4b+3, element 4L + k
  for (int b = 0; b < 4; ++b) {
    const __m512d lo0 = _mm512_castps_pd(t[4 * b]), lo1 = _mm512_castps_pd(t[4 * b + 2]);
    const __m512d hi0 = _mm512_castps_pd(t[4 * b + 1]), hi1 = _mm512_castps_pd(t[4 * b + 3]);
    v[b][0] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo0, lo1));
    v[b][1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo0, lo1));
    v[b][2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi0, hi1));
    v[b][3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi0, hi1));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 x0 = _mm512_shuffle_f32x4(v[0][k], v[1][k], 0x88);
    const __m512 x1 = _mm512_shuffle_f32x4(v[0][k], v[1][k], 0xDD);
    const __m512 x2 = _mm512_shuffle_f32x4(v[2][k], v[3][k], 0x88);
    const __m512 x3 = _mm512_shuffle_f32x4(v[2][k], v[3][k], 0xDD);
    r[k] = _mm512_shuffle_f32x4(x0, x2, 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(x0, x2, 0xDD);
    r[4 + k] = _mm512_shuffle_f32x4(x1, x3, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(x1, x3, 0xDD);
  }
}

inline void store_row(float* dst, __m512 v, int m) {
  _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << m) - 1u), v);
}

/// The fp16 words at `base` of group `gi` for 16 token slots (meta_count `mc` words per
/// token: the per-token scales or zeros), as floats. Ascending slots that span 16 (no holes)
/// are read with one or two vector loads and a word permute; holes and tails with a gather
/// of the 32-bit words at their 2-byte offsets (the pool's slab slack covers the last one).
KV_ALWAYS_INLINE __m512 meta16(const uint8_t* base, const int32_t* slots, int m, int64_t mc, int64_t gi) {
  const __mmask16 lanes = static_cast<__mmask16>((1u << m) - 1u);
  if (m == 16 && slots[15] - slots[0] == 15 && mc <= 4) {
    const uint8_t* p = base + 2 * static_cast<int64_t>(slots[0]) * mc;
    if (mc == 1) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    // Word j·mc + gi of the 16·mc words from p, for j < 16.
    const __m512i idx = _mm512_add_epi16(_mm512_mullo_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                            _mm512_set1_epi16(static_cast<int16_t>(mc))),
                                         _mm512_set1_epi16(static_cast<int16_t>(gi)));
    const __m512i w0 = _mm512_loadu_si512(p);
    const __m512i sel = mc == 2 ? _mm512_permutexvar_epi16(idx, w0)
                                : _mm512_permutex2var_epi16(w0, idx, _mm512_loadu_si512(p + 64));
    return _mm512_cvtph_ps(_mm512_castsi512_si256(sel));
  }
  const __m512i slot_v = _mm512_maskz_loadu_epi32(lanes, slots);
  const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(slot_v, _mm512_set1_epi32(static_cast<int>(mc))),
                                      _mm512_set1_epi32(static_cast<int>(gi)));
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, at, base, 2)));
}

// ---------------------------------------------------------------- q·k

/// Rounds 16 floats to int8 (half to even, the default MXCSR mode) at `dst`; returns them as
/// floats. Callers pass |x| ≤ 127·(1 + 2^-22) (a term of the two-term split: its scale is the
/// chunk's max / 127), so the rounded value is within ±127 and the saturating narrowing never
/// saturates: the same as clamping to ±127.
inline __m512 round_to_int8(__m512 x, int8_t* dst) {
  const __m512i i = _mm512_cvtps_epi32(x);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(i));
  return _mm512_cvtepi32_ps(i);
}

/// Eight horizontal reductions at once: lane r of the result (r < 8) is v[r]'s 16 lanes reduced
/// with `op`, in the pairing _mm512_reduce_{max,add}_ps uses (lanes i ⊕ i+8, then i ⊕ i+4, i ⊕ i+2,
/// i ⊕ i+1), so each sum is the one that reduction gives, bit for bit. 23 shuffles and ops
/// instead of 8 × 8.
template <class Op>
inline __m512 reduce8(const __m512 (&v)[8], Op op) {
  __m512 u[4], w[2];
  for (int k = 0; k < 4; ++k) {  // u[k]: lanes 0-7 = v[2k] (i ⊕ i+8), lanes 8-15 = v[2k+1]
    u[k] = op(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  }
  for (int k = 0; k < 2; ++k) {  // w[k]: quarter e = v[4k + e] reduced to 4 lanes (i ⊕ i+4)
    w[k] = op(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88), _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
  }
  // Quarter e: lanes 0,1 = v[e] (i ⊕ i+2), lanes 2,3 = v[4 + e].
  const __m512 x = op(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 y = op(x, _mm512_shuffle_ps(x, x, _MM_SHUFFLE(2, 3, 0, 1)));  // i ⊕ i+1
  // v[e] at lane 4e, v[4 + e] at lane 4e + 2.
  return _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 10, 6, 2, 12, 8, 4, 0), y);
}

/// Integer keys: for 16 keys at a time, u8 codes × the two int8 terms of the query (VNNI), per
/// 32-dim chunk scaled by the query chunk's scale and the key group's scale, plus zero × Σq'.
/// kOne: the high term alone (the int8 query, QueryView::one_term_*): one VNNI product per
/// key and 4 dims instead of two, zero × Σ of that rounded query (qsum1).
template <int NR, bool kChannel, bool kOne>
void qk_int(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  const int64_t d = q.d, chunks = d / 32;
  const int64_t mc = k.kf.meta_count;
  const uint8_t* sc = k.block + k.kf.scales_offset;
  const uint8_t* ze = k.block + k.kf.zeros_offset;
  // The query terms of chunk c, row r at qt[c] + 64·r (32 high, then 32 low: QueryView::qt), so
  // that every VNNI product takes its broadcast from a constant offset of one pointer per chunk.
  const int8_t* qt[8];
  float ws[NR][8], wz[NR];
  const float* qs[NR];
  const float* qsum[NR];
  // Per-channel keys: fold the channel scales into the query (w = q ⊙ s), split w per chunk
  // into two int8 terms as prepare() splits q (written in QueryView::qt's layout), and add
  // Σ_d q_d z_d once per row.
  alignas(64) int8_t wt[kChannel ? 8 : 1][NR][2][32];
  if constexpr (kChannel) {
    __m512 zr[NR];
    for (int r = 0; r < NR; ++r) zr[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 64 * c)));
      const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 64 * c + 32)));
      const __m512 z0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ze + 64 * c)));
      const __m512 z1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ze + 64 * c + 32)));
      __m512 w[NR][2], amax[8];
      for (int r = 0; r < 8; ++r) amax[r] = _mm512_setzero_ps();
      for (int r = 0; r < NR; ++r) {
        const float* qf = q.qf + (r0 + r) * d + 32 * c;
        const __m512 q0 = _mm512_loadu_ps(qf), q1 = _mm512_loadu_ps(qf + 16);
        w[r][0] = _mm512_mul_ps(q0, s0);
        w[r][1] = _mm512_mul_ps(q1, s1);
        zr[r] = _mm512_fmadd_ps(q0, z0, _mm512_fmadd_ps(q1, z1, zr[r]));
        amax[r] = _mm512_max_ps(_mm512_abs_ps(w[r][0]), _mm512_abs_ps(w[r][1]));
      }
      // The rows' chunk scales and their reciprocals, eight rows per vector: terms by
      // multiplying with the reciprocals (the fold runs once per block; the test's formula
      // rounds the same products: two_term_rounded, attend_fused_test).
      const __m512 m = reduce8(amax, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
      const __m512 scale = _mm512_mask_div_ps(_mm512_set1_ps(1.0f), _mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_GT_OQ),
                                              m, _mm512_set1_ps(127.0f));
      alignas(64) float sa[16], inv[16], inv_step[16];
      _mm512_store_ps(sa, scale);
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), scale));
      _mm512_store_ps(inv_step, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(scale, _mm512_set1_ps(kLowSteps))));
      for (int r = 0; r < NR; ++r) {
        const __m512 sc_v = _mm512_set1_ps(sa[r]), iv = _mm512_set1_ps(inv[r]), is = _mm512_set1_ps(inv_step[r]);
        int8_t* hi = wt[c][r][0];
        int8_t* lo = wt[c][r][1];
        // The low term from w − scale·hi with one rounding (an explicit FMA: the contraction
        // the compiler would otherwise choose per call site is fixed here).
        const __m512 h0 = round_to_int8(_mm512_mul_ps(w[r][0], iv), hi);
        const __m512 h1 = round_to_int8(_mm512_mul_ps(w[r][1], iv), hi + 16);
        if constexpr (!kOne) {
          round_to_int8(_mm512_mul_ps(_mm512_fnmadd_ps(sc_v, h0, w[r][0]), is), lo);
          round_to_int8(_mm512_mul_ps(_mm512_fnmadd_ps(sc_v, h1, w[r][1]), is), lo + 16);
        } else {
          (void)lo, (void)is;
        }
        ws[r][c] = sa[r];
      }
      qt[c] = wt[c][0][0];
    }
    __m512 zpad[8];
    for (int r = 0; r < 8; ++r) zpad[r] = r < NR ? zr[r] : _mm512_setzero_ps();
    alignas(64) float zs[16];
    _mm512_store_ps(zs, reduce8(zpad, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
    for (int r = 0; r < NR; ++r) {
      wz[r] = zs[r];
      qs[r] = ws[r];
    }
  } else {
    for (int64_t c = 0; c < chunks; ++c) qt[c] = q.qt + (c * q.rows + r0) * 64;
    for (int r = 0; r < NR; ++r) {
      qs[r] = q.qs + (r0 + r) * chunks;
      qsum[r] = (kOne ? q.qsum1 : q.qsum) + (r0 + r) * chunks;
    }
  }
  TokenChunk tc[8];
  int64_t gic[8];
  for (int64_t c = 0; c < chunks; ++c) {
    if constexpr (!kChannel) {
      tc[c] = token_chunk(k.kf, c);
      gic[c] = 32 * c / k.kf.group;
    }
  }
  const int bits = k.kf.bits;
  const int64_t row_bytes = k.kf.code_bytes;
  const __m512 low = _mm512_set1_ps(1.0f / kLowSteps);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int m = static_cast<int>(min64(16, n - j0));
    const int32_t* slots = k.slots + j0;
    __m512 out[NR];
    for (int r = 0; r < NR; ++r) out[r] = kChannel ? _mm512_set1_ps(wz[r]) : _mm512_setzero_ps();
    ChanPos pos[16];
    if constexpr (kChannel) {
      for (int j = 0; j < m; ++j) pos[j] = chan_pos(k, slots[j]);
    }
    for (int64_t c = 0; c < chunks; ++c) {
      __m256i rows[16];
      if constexpr (kChannel) {
        for (int j = 0; j < 16; ++j) rows[j] = j < m ? channel_codes32(k, pos[j], c) : _mm256_setzero_si256();
      } else if (m == 16) {
        for (int j = 0; j < 16; ++j) rows[j] = chunk_codes32(k.block + static_cast<int64_t>(slots[j]) * row_bytes, tc[c], bits);
      } else {
        for (int j = 0; j < 16; ++j) {
          rows[j] = j < m ? chunk_codes32(k.block + static_cast<int64_t>(slots[j]) * row_bytes, tc[c], bits)
                          : _mm256_setzero_si256();
        }
      }
      __m512i kt[8];
      transpose_16x8(rows, kt);
      __m512i ah[NR], al[NR];
      for (int r = 0; r < NR; ++r) ah[r] = al[r] = _mm512_setzero_si512();
      const int8_t* qc = qt[c];
#pragma GCC unroll 8
      for (int e = 0; e < 8; ++e) {
        for (int r = 0; r < NR; ++r) {
          int32_t hi;
          std::memcpy(&hi, qc + 64 * r + 4 * e, 4);
          ah[r] = _mm512_dpbusd_epi32(ah[r], kt[e], _mm512_set1_epi32(hi));
          if constexpr (!kOne) {
            int32_t lo;
            std::memcpy(&lo, qc + 64 * r + 32 + 4 * e, 4);
            al[r] = _mm512_dpbusd_epi32(al[r], kt[e], _mm512_set1_epi32(lo));
          }
        }
      }
      // Σ q'·c / qs = ah + al / kLowSteps (int32 sums, exact in float up to 2^24); ah alone for
      // the one-term query.
      __m512 dots[NR];
      for (int r = 0; r < NR; ++r) {
        dots[r] = kOne ? _mm512_cvtepi32_ps(ah[r]) : _mm512_fmadd_ps(_mm512_cvtepi32_ps(al[r]), low, _mm512_cvtepi32_ps(ah[r]));
      }
      if constexpr (kChannel) {
        for (int r = 0; r < NR; ++r) out[r] = _mm512_fmadd_ps(dots[r], _mm512_set1_ps(qs[r][c]), out[r]);
      } else {
        // The 16 keys' scale and zero of the group holding this chunk.
        const __m512 sv = meta16(sc, slots, m, mc, gic[c]);
        const __m512 zv = meta16(ze, slots, m, mc, gic[c]);
        for (int r = 0; r < NR; ++r) {
          out[r] = _mm512_fmadd_ps(_mm512_mul_ps(dots[r], sv), _mm512_set1_ps(qs[r][c]), out[r]);
          out[r] = _mm512_fmadd_ps(zv, _mm512_set1_ps(qsum[r][c]), out[r]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) store_row(s + r * ld + j0, out[r], m);
  }
}

/// The float-key kernels' walk over a block's keys: 16 at a time, the rows' accumulators in
/// registers; chunk(c, slots, m, out) adds dims [c, c + kStep) of the m keys at `slots` to
/// out[r] (keys across lanes), then the scores times `ts` are stored. (Each kernel's chunk is
/// forced inline: it must keep out[] in registers.)
template <int NR, int kStep, class Chunk>
inline void qk_walk(const QueryView& q, const RawTokens& k, int64_t n, float* s, int64_t ld, float ts, Chunk&& chunk) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int m = static_cast<int>(min64(16, n - j0));
    __m512 out[NR];
    for (int r = 0; r < NR; ++r) out[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < q.d; c += kStep) chunk(c, k.slots + j0, m, out);
    for (int r = 0; r < NR; ++r) store_row(s + r * ld + j0, _mm512_mul_ps(out[r], _mm512_set1_ps(ts)), m);
  }
}

/// qk_fp8's byte permutes: result word w (of 32) takes transposed-row byte 4·(w mod 16) + w/16 +
/// 2·half into its upper byte (lane j of a transposed row holds key j's codes of four consecutive
/// dims): words 0-15 are dim 2·half of the four for keys 0-15, words 16-31 dim 2·half + 1. The
/// lower bytes' entries are unused (the permute zeroes them). A constant, so no initialiser runs.
struct Fp8WordIndex {
  alignas(64) uint8_t half[2][64];
};
constexpr Fp8WordIndex make_fp8_word_index() {
  Fp8WordIndex t{};
  for (int h = 0; h < 2; ++h) {
    for (int w = 0; w < 32; ++w) t.half[h][2 * w + 1] = static_cast<uint8_t>(4 * (w % 16) + w / 16 + 2 * h);
  }
  return t;
}
constexpr Fp8WordIndex kFp8WordIndex = make_fp8_word_index();
constexpr __mmask64 kUpperBytes = 0xAAAAAAAAAAAAAAAAULL;

/// 32 fp16 words with an fp8 code in each upper byte (lower byte 0) → the fp16 form of the code.
/// e5m2 is that word already (e5m2 is fp16's upper byte). For e4m3, shifted right by one
/// arithmetically (the sign stays in bit 15) with bit 14 cleared, the word has the code's
/// magnitude bits in bits 7..13: an fp16 whose exponent field is e4m3's exponent field, so read
/// with fp16's bias (15, against e4m3's 7) it is the e4m3 value times 2^-8 exactly, normal
/// (2^(e-15)·(1 + m/8)) and subnormal (m·2^-17 for m·2^-9) alike. (0x7F, the NaN code, is
/// never produced by the encoder.) Callers fold the 2^8 into a scale or weight.
template <Kind K>
inline __m512i fp8_upper_to_half(__m512i w) {
  if constexpr (K == Kind::kE4M3) return _mm512_and_si512(_mm512_srai_epi16(w, 1), _mm512_set1_epi16(static_cast<int16_t>(0xBFFF)));
  return w;
}

/// fp8 keys: per 32-dim chunk the 16 keys' codes are transposed as bytes (transpose_16x8 of 16
/// rows × 32 bytes: lane j holds key j's codes of dims 4e..4e+3), and one byte permute per pair
/// of dims lays 16 keys' codes of two dims out as fp16 words. That is a quarter of qk_float's
/// shuffle work (bytes, not floats, are transposed) and no per-key widening; the FMAs are
/// qk_float's in the same order (dims ascending per row), so the scores are qk_float's bit for
/// bit: e4m3's 2^-8 is folded into the final scale (a power of two, exact).
template <int NR, Kind K>
void qk_fp8(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  static_assert(K == Kind::kE4M3 || K == Kind::kE5M2);
  const int64_t d = q.d;
  const int64_t row_bytes = k.kf.code_bytes;
  const float ts = (k.kf.scaled ? k.tensor_scale : 1.0f) * (K == Kind::kE4M3 ? 256.0f : 1.0f);
  const __m512i idx[2] = {_mm512_load_si512(kFp8WordIndex.half[0]), _mm512_load_si512(kFp8WordIndex.half[1])};
  qk_walk<NR, 32>(q, k, n, s, ld, ts, [&](int64_t c, const int32_t* slots, int m, __m512(&out)[NR]) __attribute__((always_inline)) {
    __m256i rows[16];
    for (int j = 0; j < 16; ++j) {
      rows[j] = j < m ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k.block + static_cast<int64_t>(slots[j]) * row_bytes + c))
                      : _mm256_setzero_si256();
    }
    __m512i kt[8];
    transpose_16x8(rows, kt);
    for (int e = 0; e < 8; ++e) {
      for (int h = 0; h < 2; ++h) {
        const __m512i w = fp8_upper_to_half<K>(_mm512_maskz_permutexvar_epi8(kUpperBytes, idx[h], kt[e]));
        const __m512 k0 = _mm512_cvtph_ps(_mm512_castsi512_si256(w));
        const __m512 k1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
        const float* qd = q.qf + r0 * d + c + 4 * e + 2 * h;
        for (int r = 0; r < NR; ++r) out[r] = _mm512_fmadd_ps(k0, _mm512_set1_ps(qd[r * d]), out[r]);
        for (int r = 0; r < NR; ++r) out[r] = _mm512_fmadd_ps(k1, _mm512_set1_ps(qd[r * d + 1]), out[r]);
      }
    }
  });
}

/// bf16 keys: per 32-dim chunk the 16 keys' 64-byte rows are transposed as dwords
/// (transpose_16x16: lane j of row e holds key j's dims 2e and 2e + 1, one bf16 in each half),
/// and each half becomes a float with one shift or mask: half of qk_float's shuffles (two
/// dims per transposed lane) and no widening load. The FMAs are qk_float's in the same order
/// (dims ascending per row), so the scores are qk_float's bit for bit.
template <int NR>
void qk_bf16(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  const int64_t d = q.d;
  const int64_t row_bytes = k.kf.code_bytes;
  qk_walk<NR, 32>(q, k, n, s, ld, 1.0f, [&](int64_t c, const int32_t* slots, int m, __m512(&out)[NR]) __attribute__((always_inline)) {
    __m512 kt[16];
    for (int j = 0; j < 16; ++j) {
      kt[j] = j < m ? _mm512_loadu_ps(k.block + static_cast<int64_t>(slots[j]) * row_bytes + 2 * c) : _mm512_setzero_ps();
    }
    transpose_16x16(kt);
    for (int e = 0; e < 16; ++e) {
      const __m512i w = _mm512_castps_si512(kt[e]);
      const __m512 k0 = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      const __m512 k1 = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      const float* qd = q.qf + r0 * d + c + 2 * e;
      for (int r = 0; r < NR; ++r) out[r] = _mm512_fmadd_ps(k0, _mm512_set1_ps(qd[r * d]), out[r]);
      for (int r = 0; r < NR; ++r) out[r] = _mm512_fmadd_ps(k1, _mm512_set1_ps(qd[r * d + 1]), out[r]);
    }
  });
}

// ---------------------------------------------------------------- the shared loops' traits

/// What fused_loops.h's loops (qk_float, p·v) need of this unit: 16 lanes, 8 query rows.
struct Lanes512 {
  using F = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kRows = 8;
  static constexpr int kPvRows = 8;  ///< rows per p·v pass (2·8 + 3 of the 32 zmm registers)
  /// fp8_values() reads e4m3 codes as the value times 2^-8 (fp8_upper_to_half).
  static constexpr float kE4m3Weight = 256.0f;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_load_ps(p); }
  static F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_store_ps(p, v); }
  static void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F load_first(const float* p, int m) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << m) - 1u), p); }
  static void store_row(float* p, F v, int m) { fused::avx512::store_row(p, v, m); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  KV_ALWAYS_INLINE static void transpose(F (&r)[16]) { transpose_16x16(r); }
  static F meta(const uint8_t* base, const int32_t* slots, int m, int64_t mc, int64_t gi) {
    return meta16(base, slots, m, mc, gi);
  }
  template <Kind K>
  static F load_values(const uint8_t* p) { return load16<K>(p); }
  /// 32 codes widened once into the upper bytes of fp16 words, then fp8_upper_to_half.
  template <Kind K>
  static void fp8_values(const uint8_t* p, F& x0, F& x1) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i w = fp8_upper_to_half<K>(_mm512_slli_epi16(_mm512_cvtepu8_epi16(codes), 8));
    x0 = _mm512_cvtph_ps(_mm512_castsi512_si256(w));
    x1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
  }
  static void codes32(__m256i codes, F& x0, F& x1) {
    x0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(codes)));
    x1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(codes, 1)));
  }
  static void channel_codes(const RawTokens& v, const ChanPos& pos, int64_t span, F& x0, F& x1) {
    codes32(channel_codes32(v, pos, span), x0, x1);
  }
  static void token_codes(const uint8_t* row, const TokenChunk& tc, int bits, int64_t /*at: a chunk's start*/, F& x0,
                          F& x1) {
    codes32(chunk_codes32(row, tc, bits), x0, x1);
  }  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  /// TurboQuant: a region's 16-entry codebook and the byte shifts that unpack 16 codes of
  /// `bits` bits from one 64-bit word (vpmultishiftqb: byte i takes bits [i·bits, i·bits + 8)).
  struct TqLut {
    __m512 table;
    __m128i ctrl, mask;
    __mmask16 bytes;  ///< the 2·bits bytes of 16 codes
  };
  static TqLut tq_lut(const float* levels16, int bits) {
    TqLut t;
    t.table = _mm512_loadu_ps(levels16);
    t.ctrl = _mm_mullo_epi16(_mm_setr_epi16(0, 2, 4, 6, 8, 10, 12, 14), _mm_set1_epi16(static_cast<int16_t>(bits)));
    // bytes 2i, 2i + 1 of the epi16 products: i·2·bits and 0 → set byte 2i + 1 to (2i + 1)·bits
    t.ctrl = _mm_or_si128(t.ctrl, _mm_slli_epi16(_mm_add_epi16(t.ctrl, _mm_set1_epi16(static_cast<int16_t>(bits))), 8));
    t.mask = _mm_set1_epi8(static_cast<char>((1 << bits) - 1));
    t.bytes = static_cast<__mmask16>((1u << (2 * bits)) - 1u);
    return t;
  }
  /// The centroids of the 16 codes at p (2·bits bytes read, masked: nothing beyond).
  static F tq_centroids(const uint8_t* p, const TqLut& t) {
    const __m128i w = _mm_broadcastq_epi64(_mm_maskz_loadu_epi8(t.bytes, p));
    const __m128i codes = _mm_and_si128(_mm_multishift_epi64_epi8(t.ctrl, w), t.mask);
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), t.table);
  }
  /// PolarQuant: the level-1 cos and sin tables (16 each) and levels 2–4's [cos ×4, sin ×4].
  struct PolarLut {
    __m512 c1, s1, t2, t3, t4;
  };
  static PolarLut polar_lut(const float* a) {
    return {_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16), _mm512_loadu_ps(a + 32), _mm512_loadu_ps(a + 48),
            _mm512_loadu_ps(a + 64)};
  }
  /// The 16 values (one block, c a multiple of 16) without ρ: lane i takes level 1's code i/2
  /// (cos for even i, sin for odd), level 2's code i/4 (cos or sin by bit 1 of i), level 3's
  /// i/8 (bit 2), level 4's one code (bit 3). The block's 46 code bits start at bit 46·(c/16).
  KV_ALWAYS_INLINE static F polar_chunk(const uint8_t* row, int64_t c, const PolarLut& t) {
    const int64_t bit = 46 * (c / 16);
    const __m128i raw = _mm_maskz_loadu_epi8(static_cast<__mmask16>(0x7F), row + bit / 8);  // 7 bytes ≥ 46 + 7 bits
    const uint64_t w = static_cast<uint64_t>(_mm_cvtsi128_si64(raw)) >> (bit % 8);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i lo = _mm512_set1_epi32(static_cast<int>(w & 0xFFFFFFFFu));
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(w >> 32));
    const __m512i three = _mm512_set1_epi32(3);
    // level 1: code (w >> 4·(i/2)) & 15; + 16 for odd lanes (the sin table)
    const __m512i i1 = _mm512_or_si512(
        _mm512_and_si512(_mm512_srlv_epi32(lo, _mm512_slli_epi32(_mm512_srli_epi32(lane, 1), 2)), _mm512_set1_epi32(15)),
        _mm512_slli_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(1)), 4));
    F y = _mm512_permutex2var_ps(t.c1, i1, t.s1);
    // level ℓ = 2, 3, 4: code (hi >> (offset + 2·(i >> ℓ))) & 3, + 4 where bit ℓ−1 of i is set
    const auto level = [&](const __m512& tab, int offset, int shift) {
      const __m512i code = _mm512_and_si512(
          _mm512_srlv_epi32(hi, _mm512_add_epi32(_mm512_set1_epi32(offset),
                                                 _mm512_slli_epi32(_mm512_srli_epi32(lane, shift), 1))),
          three);
      const __m512i sel = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(lane, shift - 1), _mm512_set1_epi32(1)), 2);
      return _mm512_permutexvar_ps(_mm512_or_si512(code, sel), tab);
    };
    y = _mm512_mul_ps(y, level(t.t2, 0, 2));
    y = _mm512_mul_ps(y, level(t.t3, 8, 3));
    return _mm512_mul_ps(y, level(t.t4, 12, 4));
  }
  /// 16 sign bits at p (bit j set: +1) as ±1.0f.
  static F signs_pm1(const uint8_t* p) {
    uint16_t b;
    std::memcpy(&b, p, sizeof b);
    return _mm512_mask_blend_ps(static_cast<__mmask16>(b), _mm512_set1_ps(-1.0f), _mm512_set1_ps(1.0f));
  }
};

template <int NR>
void qk(const QueryView& q, int64_t r0, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  switch (k.kf.kind) {
    case Kind::kF32: return qk_float<Lanes512, NR, Kind::kF32>(q, r0, k, n, s, ld);
    case Kind::kF16: return qk_float<Lanes512, NR, Kind::kF16>(q, r0, k, n, s, ld);
    case Kind::kBF16: return qk_bf16<NR>(q, r0, k, n, s, ld);
    case Kind::kE4M3: return qk_fp8<NR, Kind::kE4M3>(q, r0, k, n, s, ld);
    case Kind::kE5M2: return qk_fp8<NR, Kind::kE5M2>(q, r0, k, n, s, ld);
    case Kind::kIntToken:
      if ((q.one_term_token >> k.kf.bits) & 1u) return qk_int<NR, false, true>(q, r0, k, n, s, ld);
      return qk_int<NR, false, false>(q, r0, k, n, s, ld);
    case Kind::kIntChannel:
      if ((q.one_term_channel >> k.kf.bits) & 1u) return qk_int<NR, true, true>(q, r0, k, n, s, ld);
      return qk_int<NR, true, false>(q, r0, k, n, s, ld);
    case Kind::kTurboQuant: return qk_tq<Lanes512, NR>(q, r0, k, n, s, ld);
    case Kind::kQjl: return qk_qjl<Lanes512, NR>(q, r0, k, n, s, ld);
    case Kind::kPolar: return qk_polar<Lanes512, NR>(q, r0, k, n, s, ld);
    case Kind::kNone: break;
  }
}

}  // namespace

void scores(const QueryView& q, int64_t r0, int64_t nr, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  for_row_groups<Lanes512::kRows>(nr, [&](auto rows, int64_t g) { qk<decltype(rows)::value>(q, r0 + g, k, n, s + g * ld, ld); });
}

void accumulate(const float* p, int64_t ld, int64_t nr, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  accumulate_rows<Lanes512>(p, ld, nr, v, n, d, acc);
}

}  // namespace kvcache::cache::fused::avx512
