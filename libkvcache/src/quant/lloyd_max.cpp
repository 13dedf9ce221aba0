// SPDX-License-Identifier: Apache-2.0
#include "quant/lloyd_max.h"

#include <array>
#include <cmath>
#include <limits>
#include <mutex>

#include "kvcache/error.h"

namespace kvcache::quant {
namespace {

constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1/√(2π)

double pdf(double x) { return std::isinf(x) ? 0.0 : kInvSqrt2Pi * std::exp(-0.5 * x * x); }
double cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

/// Φ⁻¹(p) by bisection (only for the starting levels: precision 1e-12 is plenty).
double inverse_cdf(double p) {
  double lo = -40.0, hi = 40.0;
  for (int i = 0; i < 200 && hi - lo > 1e-13; ++i) {
    const double mid = 0.5 * (lo + hi);
    (cdf(mid) < p ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

GaussianCodebook solve(int bits) {
  const int n = 1 << bits;
  GaussianCodebook cb;
  cb.bits = bits;
  cb.levels.resize(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) cb.levels[static_cast<size_t>(i)] = inverse_cdf((i + 0.5) / n);
  std::vector<double> t(static_cast<size_t>(n) + 1);
  t.front() = -std::numeric_limits<double>::infinity();
  t.back() = std::numeric_limits<double>::infinity();
  for (cb.iterations = 0; cb.iterations < 100000; ++cb.iterations) {
    for (int i = 1; i < n; ++i) t[static_cast<size_t>(i)] = 0.5 * (cb.levels[static_cast<size_t>(i) - 1] + cb.levels[static_cast<size_t>(i)]);
    double moved = 0;
    for (int i = 0; i < n; ++i) {
      const double a = t[static_cast<size_t>(i)], b = t[static_cast<size_t>(i) + 1];
      const double c = (pdf(a) - pdf(b)) / (cdf(b) - cdf(a));
      moved = std::max(moved, std::abs(c - cb.levels[static_cast<size_t>(i)]));
      cb.levels[static_cast<size_t>(i)] = c;
    }
    if (moved < 1e-14) break;
  }
  cb.boundaries.clear();
  for (int i = 1; i < n; ++i) cb.boundaries.push_back(0.5 * (cb.levels[static_cast<size_t>(i) - 1] + cb.levels[static_cast<size_t>(i)]));
  double explained = 0;
  for (int i = 0; i < n; ++i) {
    const double a = i == 0 ? -std::numeric_limits<double>::infinity() : cb.boundaries[static_cast<size_t>(i) - 1];
    const double b = i == n - 1 ? std::numeric_limits<double>::infinity() : cb.boundaries[static_cast<size_t>(i)];
    explained += (cdf(b) - cdf(a)) * cb.levels[static_cast<size_t>(i)] * cb.levels[static_cast<size_t>(i)];
  }
  cb.mse = 1.0 - explained;
  return cb;
}

}  // namespace

const GaussianCodebook& gaussian_lloyd_max(int bits) {
  KV_CHECK_ARG(bits >= 1 && bits <= 8, "gaussian_lloyd_max(bits): bits must be in [1, 8], got ", bits);
  static std::array<GaussianCodebook, 9> books;
  static std::array<std::once_flag, 9> once;
  std::call_once(once[static_cast<size_t>(bits)], [bits] { books[static_cast<size_t>(bits)] = solve(bits); });
  return books[static_cast<size_t>(bits)];
}

}  // namespace kvcache::quant
