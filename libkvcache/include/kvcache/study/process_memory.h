// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file process_memory.h
/// The process's real resident set, for the study's memory columns (Linux /proc).
///
/// PeakRssProbe measures the peak resident-set growth over a span of work: start() returns
/// freed heap memory to the system (malloc_trim), resets the kernel's peak counter (VmHWM,
/// by writing "5" to /proc/self/clear_refs) and records the current resident set;
/// peak_growth() reads VmHWM and returns its growth over that start. Where the peak cannot be
/// reset (no /proc, a kernel without clear_refs) it falls back to the current resident set at
/// the end, and says so.

#include <cstdint>

namespace kvcache::study {

/// Resident set of this process now, in bytes (-1 if unknown).
int64_t current_rss_bytes();

class PeakRssProbe {
 public:
  /// Starts a measurement (see the file comment).
  void start();
  /// Peak resident-set growth since start(), bytes (≥ 0); -1 if nothing could be read.
  int64_t peak_growth() const;
  /// True if the kernel's peak counter was reset at start() (else peak_growth() is the
  /// growth of the current resident set, a lower bound of the peak).
  bool peak_reset() const { return reset_; }

 private:
  int64_t start_rss_ = -1;
  bool reset_ = false;
};

}  // namespace kvcache::study
