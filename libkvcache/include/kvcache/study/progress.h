// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file progress.h
/// Progress reporting of a sweep on stderr: a redrawn bar with rate and ETA on a terminal,
/// periodic log lines otherwise (files, Slurm logs). The clock is injected for tests.

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>

namespace kvcache::study {

/// "45s", "3m05s", "1h02m".
std::string format_duration(double seconds);

class Progress {
 public:
  /// Seconds since an arbitrary epoch (monotonic).
  using Clock = std::function<double()>;

  /// @param interactive  true: redraw one line with '\r' (at most every 0.2 s); false: print a
  ///                     line at most every `log_every_s` seconds and at the end.
  /// @param clock        defaults to std::chrono::steady_clock.
  Progress(std::ostream& out, bool interactive, int64_t total, Clock clock = {}, double log_every_s = 30.0);

  /// Sets the number of items (run_sweep calls it once it knows its shard's share).
  void set_total(int64_t total) { total_ = total; }
  /// `n` items were already finished (resume): counted as done, not in the rate.
  void skipped(int64_t n);
  /// One item finished now; `label` names it (e.g. "int4+full s1-needle-L512-d35-r0").
  void done(const std::string& label);
  /// Prints the final line (and a newline on a terminal).
  void finish();

  /// "[#######.............] 123/456 27% | 2.1 it/s | ETA 2m38s | label".
  std::string status() const;
  int64_t completed() const { return done_; }

 private:
  void maybe_print(bool force);
  std::ostream& out_;
  bool interactive_;
  int64_t total_;
  Clock clock_;
  double log_every_s_;
  double start_ = 0;
  double last_print_ = -1e300;
  int64_t done_ = 0;
  int64_t executed_ = 0;
  std::string label_;
  bool finished_ = false;
  bool printed_complete_ = false;
};

}  // namespace kvcache::study
