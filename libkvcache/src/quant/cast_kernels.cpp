// SPDX-License-Identifier: Apache-2.0
#include "quant/cast_kernels.h"

#include <algorithm>
#include <atomic>

#include "common/parallel.h"
#include "quant/simd.h"

namespace kvcache::quant {
namespace {

// Flags: bit 0 = non-finite input, bit 1 = output is ±Inf (exponent all ones).
KV_TARGET_CLONES uint32_t fp16_range(const float* __restrict x, int64_t b, int64_t e, uint16_t* __restrict out) {
  uint32_t bad = 0, ovf = 0;
#pragma omp simd reduction(| : bad, ovf)
  for (int64_t i = b; i < e; ++i) {
    const uint16_t h = fp16_bits(x[i]);
    out[i] = h;
    bad |= nonfinite_bit(x[i]);
    ovf |= static_cast<uint32_t>((h & 0x7c00u) == 0x7c00u);
  }
  return bad | (ovf << 1);
}

// bf16 saturates: the few float32 values past bf16's largest finite (within half a bf16 step
// of FLT_MAX) store ±3.3895e38 instead of rounding to ±Inf. Never reports overflow.
KV_TARGET_CLONES uint32_t bf16_range(const float* __restrict x, int64_t b, int64_t e, uint16_t* __restrict out) {
  uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = b; i < e; ++i) {
    out[i] = saturate_bits(bf16_bits(x[i]), 0x7f80u, kBf16MaxBits);
    bad |= nonfinite_bit(x[i]);
  }
  return bad;
}

KV_TARGET_CLONES uint32_t fp16_sat_range(const float* __restrict x, int64_t b, int64_t e, uint16_t* __restrict out) {
#pragma omp simd
  for (int64_t i = b; i < e; ++i) out[i] = saturate_bits(fp16_bits(x[i]), 0x7c00u, kFp16MaxBits);
  return 0;
}

KV_TARGET_CLONES uint32_t copy_range(const float* __restrict x, int64_t b, int64_t e, float* __restrict out) {
  uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = b; i < e; ++i) {
    out[i] = x[i];
    bad |= nonfinite_bit(x[i]);
  }
  return bad;
}

KV_TARGET_CLONES void fp16_widen_range(const uint16_t* __restrict x, int64_t b, int64_t e, float* __restrict out) {
#pragma omp simd
  for (int64_t i = b; i < e; ++i) out[i] = fp16_to_float(x[i]);
}

KV_TARGET_CLONES void bf16_widen_range(const uint16_t* __restrict x, int64_t b, int64_t e, float* __restrict out) {
#pragma omp simd
  for (int64_t i = b; i < e; ++i) out[i] = bits_float(static_cast<uint32_t>(x[i]) << 16);
}

template <typename Fn, typename Out>
CastStatus run(Fn fn, const float* x, int64_t n, Out* out) {
  std::atomic<uint32_t> flags{0};
  detail::parallel_for(0, n, int64_t{1} << 16, [&](int64_t b, int64_t e) { flags.fetch_or(fn(x, b, e, out)); });
  CastStatus s;
  s.nonfinite = (flags.load() & 1u) != 0;
  s.overflow = (flags.load() & 2u) != 0;
  return s;
}

}  // namespace

CastStatus cast_to_fp16(const float* x, int64_t n, uint16_t* out) { return run(fp16_range, x, n, out); }
CastStatus cast_to_bf16(const float* x, int64_t n, uint16_t* out) { return run(bf16_range, x, n, out); }
CastStatus copy_fp32(const float* x, int64_t n, float* out) { return run(copy_range, x, n, out); }
void cast_to_fp16_saturating(const float* x, int64_t n, uint16_t* out) { (void)run(fp16_sat_range, x, n, out); }

std::vector<float> metadata_to_fp32(const void* data, bool fp16, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  if (n == 0) return out;
  if (fp16) {
    fp16_to_fp32(static_cast<const uint16_t*>(data), n, out.data());
  } else {
    const auto* f = static_cast<const float*>(data);
    std::copy(f, f + n, out.data());
  }
  return out;
}

void fp16_to_fp32(const uint16_t* x, int64_t n, float* out) {
  detail::parallel_for(0, n, int64_t{1} << 16, [&](int64_t b, int64_t e) { fp16_widen_range(x, b, e, out); });
}

void bf16_to_fp32(const uint16_t* x, int64_t n, float* out) {
  detail::parallel_for(0, n, int64_t{1} << 16, [&](int64_t b, int64_t e) { bf16_widen_range(x, b, e, out); });
}

}  // namespace kvcache::quant
