// SPDX-License-Identifier: Apache-2.0
#pragma once
/// Deterministic, platform-independent random numbers for the study (no std:: distributions,
/// whose output is implementation-defined).

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/error.h"

namespace kvcache::study {

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// Combines a seed, a salt string and up to four integers into one 64-bit seed.
inline uint64_t mix_seed(uint64_t seed, const std::string& salt, uint64_t a = 0, uint64_t b = 0,
                         uint64_t c = 0, uint64_t d = 0) {
  uint64_t h = 0xCBF29CE484222325ULL;  // FNV-1a over the salt
  for (unsigned char ch : salt) {
    h ^= ch;
    h *= 0x100000001B3ULL;
  }
  uint64_t state = seed ^ h;
  for (uint64_t v : {a, b, c, d}) {
    state ^= splitmix64(state) + v;
  }
  return splitmix64(state);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() { return splitmix64(state_); }
  /// Uniform in [0, n), n >= 1 (rejection sampling, no modulo bias).
  uint64_t below(uint64_t n) {
    KV_INTERNAL_ASSERT(n >= 1, "empty range");
    const uint64_t limit = UINT64_MAX - (UINT64_MAX % n);
    uint64_t x = next();
    while (x >= limit) x = next();
    return x % n;
  }
  /// Uniform in [lo, hi] (inclusive).
  int64_t range(int64_t lo, int64_t hi) {
    KV_INTERNAL_ASSERT(hi >= lo, "empty range");
    return lo + static_cast<int64_t>(below(static_cast<uint64_t>(hi - lo) + 1));
  }
  template <typename T>
  const T& pick(const std::vector<T>& v) {
    KV_INTERNAL_ASSERT(!v.empty(), "pick from an empty bank");
    return v[below(v.size())];
  }

 private:
  uint64_t state_;
};

}  // namespace kvcache::study
