// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/progress.h"

#include <chrono>
#include <cmath>
#include <cstdio>

namespace kvcache::study {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  char buf[64];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(s));
  } else if (s < 3600) {
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>((s % 3600) / 60));
  }
  return buf;
}

Progress::Progress(std::ostream& out, bool interactive, int64_t total, Clock clock, double log_every_s)
    : out_(out), interactive_(interactive), total_(total), clock_(std::move(clock)), log_every_s_(log_every_s) {
  if (!clock_) {
    clock_ = [] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    };
  }
  start_ = clock_();
}

void Progress::skipped(int64_t n) {
  done_ += n;
  if (n > 0) label_ = "resumed: " + std::to_string(n) + " finished before";
  maybe_print(/*force=*/false);
}

void Progress::done(const std::string& label) {
  ++done_;
  ++executed_;
  label_ = label;
  maybe_print(/*force=*/false);
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  maybe_print(/*force=*/true);
  if (interactive_) out_ << "\n";
  out_.flush();
}

std::string Progress::status() const {
  const int width = 20;
  const double frac = total_ > 0 ? static_cast<double>(done_) / static_cast<double>(total_) : 1.0;
  const int filled = static_cast<int>(std::floor(frac * width));
  std::string bar = "[" + std::string(static_cast<size_t>(filled), '#') +
                    std::string(static_cast<size_t>(width - filled), '.') + "]";
  const double elapsed = clock_() - start_;
  char buf[256];
  std::string rate = "-";
  std::string eta = "?";
  if (executed_ > 0 && elapsed > 0) {
    const double per_s = static_cast<double>(executed_) / elapsed;
    std::snprintf(buf, sizeof buf, "%.2f it/s", per_s);
    rate = buf;
    eta = format_duration(static_cast<double>(total_ - done_) / per_s);
  }
  if (done_ >= total_) eta = "0s";
  std::snprintf(buf, sizeof buf, "%s %lld/%lld %3.0f%% | %s | elapsed %s | ETA %s", bar.c_str(),
                static_cast<long long>(done_), static_cast<long long>(total_), 100.0 * frac, rate.c_str(),
                format_duration(elapsed).c_str(), eta.c_str());
  std::string s = buf;
  if (!label_.empty()) s += " | " + label_;
  return s;
}

void Progress::maybe_print(bool force) {
  const double now = clock_();
  const double every = interactive_ ? 0.2 : log_every_s_;
  const bool complete = done_ >= total_;
  const bool first_complete = complete && !printed_complete_;
  if (!force && !first_complete && now - last_print_ < every) return;
  if (!interactive_ && complete && printed_complete_) return;  // one completion line in logs
  if (complete) printed_complete_ = true;
  last_print_ = now;
  if (interactive_) {
    std::string s = status();
    if (s.size() > 150) s.resize(150);
    out_ << "\r" << s << "\033[K";
  } else {
    out_ << "progress: " << status() << "\n";
  }
  out_.flush();
}

}  // namespace kvcache::study
