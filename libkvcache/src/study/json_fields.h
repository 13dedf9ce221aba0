// SPDX-License-Identifier: Apache-2.0
#pragma once
// Typed, range-checked fields of the study's JSON lines (task files, results files): every
// error names the field and its value, never a JSON library exception.
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "kvcache/error.h"

namespace kvcache::study::json_fields {

/// Integer field `key` of object `j` in [lo, hi]; `fallback` when absent (nullopt: required).
/// `where` prefixes errors ("task 'x'").
template <typename Json>
int64_t integer(const Json& j, const char* key, const std::string& where, int64_t lo, int64_t hi,
                std::optional<int64_t> fallback = std::nullopt) {
  if (!j.contains(key) && fallback) return *fallback;
  KV_CHECK_ARG(j.contains(key), where, ": missing field '", key, "'");
  const Json& v = j.at(key);
  // JSON integers beyond uint64 arrive as doubles: out of range, not "not an integer".
  const bool integral_float =
      v.is_number_float() && std::isfinite(v.template get<double>()) &&
      v.template get<double>() == std::floor(v.template get<double>());
  KV_CHECK_ARG(v.is_number_integer() || integral_float, where, ": field '", key, "' = ", v.dump(),
               " is not an integer");
  bool fits = false;
  int64_t out = 0;
  if (v.is_number_unsigned()) {
    const auto u = v.template get<uint64_t>();
    fits = hi >= 0 && u <= static_cast<uint64_t>(hi) && (lo <= 0 || u >= static_cast<uint64_t>(lo));
    out = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    out = v.template get<int64_t>();
    fits = out >= lo && out <= hi;
  } else {
    const double d = v.template get<double>();
    fits = d >= static_cast<double>(lo) && d <= static_cast<double>(hi) && std::fabs(d) < 9.0e18;
    out = fits ? static_cast<int64_t>(d) : 0;
  }
  KV_CHECK_ARG(fits, where, ": field '", key, "' = ", v.dump(), " is out of range [", lo, ", ", hi, "]");
  return out;
}

/// String field `key`; `fallback` when absent (nullopt: required).
template <typename Json>
std::string string(const Json& j, const char* key, const std::string& where,
                   std::optional<std::string> fallback = std::nullopt) {
  if (!j.contains(key) && fallback) return *fallback;
  KV_CHECK_ARG(j.contains(key), where, ": missing field '", key, "'");
  KV_CHECK_ARG(j.at(key).is_string(), where, ": field '", key, "' = ", j.at(key).dump(), " is not a string");
  return j.at(key).template get<std::string>();
}

/// Boolean field `key`; `fallback` when absent.
template <typename Json>
bool boolean(const Json& j, const char* key, const std::string& where, bool fallback) {
  if (!j.contains(key)) return fallback;
  KV_CHECK_ARG(j.at(key).is_boolean(), where, ": field '", key, "' = ", j.at(key).dump(), " is not true or false");
  return j.at(key).template get<bool>();
}

}  // namespace kvcache::study::json_fields
