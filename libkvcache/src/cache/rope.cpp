// SPDX-License-Identifier: Apache-2.0
// The framework-free RoPE hooks of kvcache/cache_config.h. Compiled without FMA contraction
// (the project default): y = x·cos − x'·sin as two products and a difference.
#include <cmath>
#include <memory>
#include <vector>

#include "kvcache/cache_config.h"
#include "kvcache/error.h"

namespace kvcache {

RopeFn rotate_half_rope(double theta) {
  KV_CHECK_ARG(std::isfinite(theta) && theta > 1.0, "rotate_half_rope: theta must be finite and > 1, got ", theta);
  const auto base = static_cast<float>(theta);
  return [base](float* x, int64_t heads, int64_t tokens, int64_t d, const int64_t* positions) {
    KV_CHECK_ARG(d % 2 == 0, "rotate_half_rope: head_dim must be even, got ", d);
    const int64_t half = d / 2;
    std::vector<float> inv(static_cast<size_t>(half)), c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) {
      inv[static_cast<size_t>(i)] =
          1.0f / std::pow(base, static_cast<float>(2 * i) / static_cast<float>(d));
    }
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(positions[t]) * inv[static_cast<size_t>(i)];
        c[static_cast<size_t>(i)] = std::cos(a);
        s[static_cast<size_t>(i)] = std::sin(a);
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* row = x + (h * tokens + t) * d;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = row[i], x2 = row[i + half];
          row[i] = x1 * c[static_cast<size_t>(i)] - x2 * s[static_cast<size_t>(i)];
          row[i + half] = x2 * c[static_cast<size_t>(i)] + x1 * s[static_cast<size_t>(i)];
        }
      }
    }
  };
}

RopeFn keys_already_rotated() {
  return [](float*, int64_t, int64_t, int64_t, const int64_t*) {};
}

}  // namespace kvcache
