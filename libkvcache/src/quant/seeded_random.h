// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file seeded_random.h (internal)
/// The counter-based generator of the seeded rotations and sketches (TurboQuant, QJL): element
/// k of stream `stream` of seed `seed` is splitmix64(splitmix64(seed ⊕ stream) + k), so any
/// element is computed alone, tables do not depend on the order they are filled in, and the
/// same seed gives the same bytes on every platform (no std:: distributions).

#include <cmath>
#include <cstdint>

namespace kvcache::quant::seeded {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline uint64_t draw(int64_t seed, uint64_t stream, uint64_t k) {
  return splitmix64(splitmix64(static_cast<uint64_t>(seed) ^ stream) + k);
}

/// Uniform in (0, 1) from the top 53 bits (never 0 or 1).
inline double unit_open(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

/// Standard normal number k of stream `stream` (Box–Muller over elements 2·⌊k/2⌋ and 2·⌊k/2⌋ + 1:
/// even k the cosine, odd k the sine).
inline double normal(int64_t seed, uint64_t stream, uint64_t k) {
  const uint64_t base = k & ~uint64_t{1};
  const double u1 = unit_open(draw(seed, stream, base));
  const double u2 = unit_open(draw(seed, stream, base + 1));
  const double rad = std::sqrt(-2.0 * std::log(u1));
  const double angle = 2.0 * 3.14159265358979323846 * u2;
  return rad * ((k & 1) ? std::sin(angle) : std::cos(angle));
}

}  // namespace kvcache::quant::seeded
