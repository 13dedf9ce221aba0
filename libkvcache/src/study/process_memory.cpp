// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/process_memory.h"

#include <fstream>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace kvcache::study {
namespace {

/// A "Vm...:" line of /proc/self/status in bytes (-1 if absent).
int64_t status_kib_field(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(f, line)) {
    if (line.compare(0, k.size(), k) == 0) {
      try {
        return std::stoll(line.substr(k.size())) * 1024;
      } catch (const std::exception&) {
        return -1;
      }
    }
  }
  return -1;
}

}  // namespace

int64_t current_rss_bytes() { return status_kib_field("VmRSS"); }

void PeakRssProbe::start() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
  std::ofstream clear("/proc/self/clear_refs");
  reset_ = false;
  if (clear) {
    clear << "5";
    clear.flush();
    reset_ = static_cast<bool>(clear);
  }
  start_rss_ = current_rss_bytes();
}

int64_t PeakRssProbe::peak_growth() const {
  if (start_rss_ < 0) return -1;
  const int64_t end = reset_ ? status_kib_field("VmHWM") : current_rss_bytes();
  if (end < 0) return -1;
  return end > start_rss_ ? end - start_rss_ : 0;
}

}  // namespace kvcache::study
