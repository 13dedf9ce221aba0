// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cascade_sum.h (internal)
/// The float32 sum that at::sum computed (ATen 1.13, SumKernel.cpp's multi_row_sum for one row)
/// where the library used to reduce attention with at:: ops: values are added in blocks of
/// 2^p (p = max(4, ⌈log2 n⌉ / 4)) that are summed into up to four levels, so for n ≤ 16 it is
/// the plain running sum 0 + x_0 + x_1 + …, and beyond a cascade. Keeping that order keeps
/// every score a policy computes from attention (H2O, SnapKV, AdaKV, KVzip) bit-identical to
/// what it was before the core left LibTorch (docs/engine-api.md).

#include <algorithm>
#include <cstdint>

namespace kvcache::detail {

/// ⌈log2 x⌉ as ATen's utils::CeilLog2 (1 for x ≤ 2).
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x) - 1; v != 0; v >>= 1) ++bits;
  return bits;
}

/// Σ_{i<n} x[i · stride] in at::sum's order (float32 accumulators).
inline float cascade_sum(const float* x, int64_t stride, int64_t n) {
  constexpr int64_t kLevels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(n) / kLevels);
  const int64_t step = int64_t{1} << power;
  const int64_t mask = step - 1;
  float acc[kLevels] = {0.0f, 0.0f, 0.0f, 0.0f};
  int64_t i = 0;
  while (i + step <= n) {
    for (int64_t j = 0; j < step; ++j, ++i) acc[0] += x[i * stride];
    for (int64_t j = 1; j < kLevels; ++j) {
      acc[j] += acc[j - 1];
      acc[j - 1] = 0.0f;
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < n; ++i) acc[0] += x[i * stride];
  for (int64_t j = 1; j < kLevels; ++j) acc[0] += acc[j];
  return acc[0];
}

}  // namespace kvcache::detail
