// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared helpers of the eviction policy tests: what a plan keeps.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kvcache/eviction_policy.h"

namespace kvcache::testing {

/// Kept positions of each head, in cache order.
using Rows = std::vector<std::vector<int64_t>>;

/// What a plan keeps, per head (the complement of its evictions); empty = keeps all. Fails the
/// test (non-fatally) if a head's evictions are not strictly increasing or out of range.
inline Rows kept_rows(const EvictionPlan& plan, const EvictionContext& c) {
  Rows out;
  if (plan.empty()) return out;
  for (size_t h = 0; h < c.resident.size(); ++h) {
    std::vector<int64_t> row;
    const auto& e = plan.evict.at(h);
    for (size_t i = 1; i < e.size(); ++i) EXPECT_LT(e[i - 1], e[i]) << "evictions not increasing";
    size_t di = 0;
    for (int64_t i = 0; i < c.resident[h]; ++i) {
      if (di < e.size() && e[di] == i) {
        ++di;
      } else {
        row.push_back(i);
      }
    }
    EXPECT_EQ(di, e.size()) << "eviction index out of range";
    out.push_back(row);
  }
  return out;
}

}  // namespace kvcache::testing
