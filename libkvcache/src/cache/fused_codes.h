// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file fused_codes.h (internal)
/// Reading the stored form, shared by the fused kernels' translation units (attend_avx512.cpp,
/// attend_avx2.cpp): where a per-token row's 32-dim chunk lies and how its codes come out,
/// where a per-channel block holds a token, fp16 metadata. Needs AVX2 and F16C (both units
/// have them). Everything here has internal linkage (an unnamed namespace): each unit compiles
/// its own copy with its own instruction set and the linker never merges them, which is what
/// fused_abi.h's rule (no shared inline function) guards against. Include it only from those
/// units.
///
/// Layouts read (docs/quantizers.md "Packing layout", StoredLayout): a block is
/// [codes | scales | zeros]; a per-token format stores token slot s's codes at s·code_bytes and
/// its group scales/zeros (fp16) at s·meta_count; a per-channel block holds one group of g
/// tokens: code row j, byte d holds tokens j + m·rows (m < 8/bits) of channel d, and D fp16
/// scales and zeros.

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cache/fused_abi.h"
#include "quant/simd.h"  // KV_ALWAYS_INLINE

namespace kvcache::cache::fused {
namespace {  // NOLINT(google-build-namespaces): internal linkage per kernel unit, see above

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/// A row count known at compile time (the kernels' template parameter NR).
template <int N>
struct Rows {
  static constexpr int value = N;
};

template <int N, class Fn>
inline void call_rows(int64_t cnt, int64_t g, Fn& fn) {
  if constexpr (N > 1) {
    if (cnt < N) return call_rows<N - 1>(cnt, g, fn);
  }
  fn(Rows<N>{}, g);
}

/// Rows [0, nr) in groups of at most kMax: fn(Rows<NR>{}, first_row) per group, NR the group's
/// size, so that each kernel instantiation keeps its rows' accumulators in registers.
template <int kMax, class Fn>
inline void for_row_groups(int64_t nr, Fn&& fn) {
  for (int64_t g = 0; g < nr; g += kMax) call_rows<kMax>(min64(kMax, nr - g), g, fn);
}

/// Rows [0, nr) in the fewest groups of at most kMax, of sizes that differ by at most one (7
/// rows under kMax 6: 4 + 3, not 6 + 1, whose one-row pass reads every value again for 1/7th
/// of the work): fn(Rows<NR>{}, first_row) per group.
template <int kMax, class Fn>
inline void for_even_row_groups(int64_t nr, Fn&& fn) {
  const int64_t groups = (nr + kMax - 1) / kMax;
  for (int64_t i = 0, g = 0; i < groups; ++i) {
    const int64_t cnt = (nr - g) / (groups - i);  // the rest shared evenly: ≤ kMax
    const int64_t take = (nr - g) % (groups - i) != 0 ? cnt + 1 : cnt;
    call_rows<kMax>(take, g, fn);
    g += take;
  }
}

/// Bytes per stored value of a float format.
template <KernelFormat::Kind K>
constexpr int64_t value_bytes() {
  using Kind = KernelFormat::Kind;
  return K == Kind::kF32 ? 4 : (K == Kind::kF16 || K == Kind::kBF16) ? 2 : 1;
}

/// The fp16 word `index` at `base`, as a float.
inline float half_at(const uint8_t* base, int64_t index) {
  uint16_t h;
  std::memcpy(&h, base + 2 * index, sizeof h);
  return _cvtsh_ss(h);
}

/// How dims [32c, 32c + 32) of a per-token row are extracted: the same for every key of a
/// block, so worked out once per call (no division by the group size per key).
struct TokenChunk {
  int64_t offset = 0;  ///< byte offset in the row of the bytes loaded
  __m128i shift;       ///< right shift of the codes' bit field (epi16 lanes)
  int mode = 0;        ///< 0: 32 bytes, shift, mask; 1: int4 g32 (16 bytes, low | high nibbles);
                       ///< 2: int2 g32 (8 bytes, four fields); 3: int2 g64 (16 bytes, two fields)
};

KV_ALWAYS_INLINE TokenChunk token_chunk(const KernelFormat& kf, int64_t c) {
  const int bits = kf.bits;
  const int64_t g = kf.group, o = 32 * c, gi = o / g, off = o % g;
  const int64_t base = gi * (g * bits / 8);
  TokenChunk t;
  t.shift = _mm_cvtsi32_si128(0);
  if (bits == 8) {
    t.offset = base + off;
  } else if (bits == 4) {
    if (g == 32) {
      t.offset = base;
      t.mode = 1;
    } else {
      const int64_t half = g / 2;
      t.offset = base + (off < half ? off : off - half);
      t.shift = _mm_cvtsi32_si128(off < half ? 0 : 4);
    }
  } else if (g == 32) {
    t.offset = base;
    t.mode = 2;
  } else if (g == 64) {
    t.offset = base;
    t.mode = 3;
    t.shift = _mm_cvtsi32_si128(off == 0 ? 0 : 4);
  } else {
    const int64_t q = g / 4;
    t.offset = base + off % q;
    t.shift = _mm_cvtsi32_si128(static_cast<int>(2 * (off / q)));
  }
  return t;
}

/// The 32 codes (one per byte) of a per-token row's chunk described by `t`.
inline __m256i chunk_codes32(const uint8_t* row, const TokenChunk& t, int bits) {
  const uint8_t* p = row + t.offset;
  switch (t.mode) {
    case 1: {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m128i m4 = _mm_set1_epi8(0x0F);
      return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(b, m4)),
                                     _mm_and_si128(_mm_srli_epi16(b, 4), m4), 1);
    }
    case 2: {  // field f (dims 8f .. 8f + 7) = bits 2f of the 8 bytes: one 64-bit lane each
      uint64_t w;
      std::memcpy(&w, p, sizeof w);
      const __m256i b = _mm256_set1_epi64x(static_cast<long long>(w));
      return _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_set_epi64x(6, 4, 2, 0)), _mm256_set1_epi8(0x03));
    }
    case 3: {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m128i lo = _mm_srl_epi16(b, t.shift);
      const __m128i hi = _mm_srli_epi16(lo, 2);
      return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1), _mm256_set1_epi8(0x03));
    }
    default: {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      if (bits == 8) return b;
      return _mm256_and_si256(_mm256_srl_epi16(b, t.shift), _mm256_set1_epi8(static_cast<char>((1 << bits) - 1)));
    }
  }
}

/// Where token `slot` of a per-channel block (one group) lies: its code row's byte offset and
/// the shift of its bit field.
struct ChanPos {
  int64_t offset;
  __m128i shift;
};
inline ChanPos chan_pos(const RawTokens& t, int32_t slot) {
  const int64_t rows = t.kf.group * t.kf.bits / 8;
  int64_t row, field;
  if ((rows & (rows - 1)) == 0) {  // the usual case (g a power of two): no division per key
    row = slot & (rows - 1);
    field = slot >> __builtin_ctzll(static_cast<unsigned long long>(rows));
  } else {
    row = slot % rows;
    field = slot / rows;
  }
  return {row * t.kf.head_dim, _mm_cvtsi32_si128(static_cast<int>(t.kf.bits * field))};
}

/// 32 codes of dims [32c, 32c + 32) of the per-channel token at `p`.
inline __m256i channel_codes32(const RawTokens& t, const ChanPos& p, int64_t c) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.block + p.offset + 32 * c));
  if (t.kf.bits == 8) return b;
  const __m256i mask = _mm256_set1_epi8(static_cast<char>((1 << t.kf.bits) - 1));
  return _mm256_and_si256(_mm256_srl_epi16(b, p.shift), mask);
}

}  // namespace
}  // namespace kvcache::cache::fused
