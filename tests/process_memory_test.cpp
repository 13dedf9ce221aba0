// SPDX-License-Identifier: Apache-2.0
// PeakRssProbe: the peak resident-set growth of a span of work, freed memory included.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "kvcache/study/process_memory.h"

namespace kvcache::study {
namespace {

TEST(PeakRssProbe, SeesMemoryTouchedAndFreedInsideTheSpan) {
  ASSERT_GT(current_rss_bytes(), 0) << "no /proc/self/status";
  PeakRssProbe probe;
  probe.start();
  {
    const size_t n = size_t{64} << 20;
    std::vector<char> buf(n);
    std::memset(buf.data(), 1, n);  // touch every page
    EXPECT_GE(current_rss_bytes(), static_cast<int64_t>(n));
  }
  const int64_t growth = probe.peak_growth();
  if (probe.peak_reset()) {
    // The 64 MiB were freed before the end: only the reset peak still holds them.
    EXPECT_GE(growth, int64_t{60} << 20);
    EXPECT_LT(growth, int64_t{96} << 20);
  } else {
    EXPECT_GE(growth, 0);  // no clear_refs: the current resident set only
  }
  PeakRssProbe idle;
  idle.start();
  EXPECT_LT(idle.peak_growth(), int64_t{8} << 20);
}

}  // namespace
}  // namespace kvcache::study
