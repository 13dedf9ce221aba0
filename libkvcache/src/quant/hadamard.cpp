// SPDX-License-Identifier: Apache-2.0
// Fast Walsh–Hadamard transform of float32 rows (hadamard.h). Multiversioned like the other
// kernels; the butterflies are independent adds/subtracts the compiler vectorizes.
#include "quant/hadamard.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "kvcache/error.h"
#include "quant/simd.h"

namespace kvcache::quant {
namespace {

KV_ALWAYS_INLINE void fwht_row(float* __restrict x, int64_t d, float scale) {
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

KV_TARGET_CLONES void fwht_rows(float* x, int64_t r0, int64_t r1, int64_t d, float scale) {
  for (int64_t r = r0; r < r1; ++r) fwht_row(x + r * d, d, scale);
}

}  // namespace

void hadamard_rows(float* x, int64_t rows, int64_t d) {
  KV_INTERNAL_ASSERT(is_power_of_two(d), "hadamard_rows: d = ", d, " is not a power of two");
  if (rows <= 0 || d == 1) return;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / d);
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) { fwht_rows(x, b, e, d, scale); });
}

}  // namespace kvcache::quant
