// SPDX-License-Identifier: Apache-2.0
#pragma once
// Number formatting shared by the report's rules (evidence strings) and writers.
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

namespace kvcache::study::report_format {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// printf-formatted `v`, "–" if not finite.
inline std::string fmt(double v, const char* f = "%.3f") {
  if (!std::isfinite(v)) return "–";
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}
/// A fraction as a percentage, "90.0%".
inline std::string pct(double frac) { return std::isfinite(frac) ? fmt(100.0 * frac, "%.1f") + "%" : "–"; }
/// With a sign, "+1.0" / "-10.0".
inline std::string signed_fmt(double v, const char* f) {
  if (!std::isfinite(v)) return "–";
  return (v >= 0 ? "+" : "") + fmt(v, f);
}

}  // namespace kvcache::study::report_format
