// SPDX-License-Identifier: Apache-2.0
// Fast Walsh–Hadamard transform of float32 rows (hadamard.h). Multiversioned like the other
// kernels; the butterflies are independent adds/subtracts the compiler vectorizes.
#include "quant/hadamard.h"

#include <algorithm>
#include <cmath>

#include "common/parallel.h"
#include "kvcache/error.h"
#include "quant/simd.h"

namespace kvcache::quant {
namespace {

/// One row: log2(d) butterfly stages, then the 1/√d scaling. The stages add up to d values, so
/// a row whose largest |x| reaches `big` = 2^(127 − log2 d) could overflow in them although the
/// result (each |y_i| ≤ √d·max|x|) need not: such a row runs its stages scaled by `down` =
/// 2^−log2(d) (exact for every value above float32's normal range) and is scaled back in the
/// last multiply (`scale_up` = scale·2^log2(d)): the unscaled result wherever that is finite,
/// ±Inf only where the true result exceeds float32. Other rows take the plain path unchanged.
KV_ALWAYS_INLINE void fwht_row(float* __restrict x, int64_t d, float scale, float big, float down, float scale_up) {
  float m = 0.0f;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < d; ++j) m = std::max(m, std::abs(x[j]));
  if (m >= big) {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) x[j] *= down;
    scale = scale_up;
  }
  for (int64_t h = 1; h < d; h *= 2) {
    for (int64_t i = 0; i < d; i += 2 * h) {
      float* __restrict a = x + i;
      float* __restrict b = x + i + h;
#pragma omp simd
      for (int64_t j = 0; j < h; ++j) {
        const float u = a[j], v = b[j];
        a[j] = u + v;
        b[j] = u - v;
      }
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) x[j] *= scale;
}

KV_TARGET_CLONES void fwht_rows(float* x, int64_t r0, int64_t r1, int64_t d, float scale, float big, float down,
                                float scale_up) {
  for (int64_t r = r0; r < r1; ++r) fwht_row(x + r * d, d, scale, big, down, scale_up);
}

}  // namespace

void hadamard_rows(float* x, int64_t rows, int64_t d) {
  KV_INTERNAL_ASSERT(is_power_of_two(d), "hadamard_rows: d = ", d, " is not a power of two");
  if (rows <= 0 || d == 1) return;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  int log2d = 0;
  while ((int64_t{1} << log2d) < d) ++log2d;
  const float big = std::ldexp(1.0f, 127 - log2d), down = std::ldexp(1.0f, -log2d);
  const float scale_up = std::ldexp(scale, log2d);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / d);
  detail::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) { fwht_rows(x, b, e, d, scale, big, down, scale_up); });
}

}  // namespace kvcache::quant
