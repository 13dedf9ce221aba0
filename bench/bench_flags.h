// SPDX-License-Identifier: Apache-2.0
#pragma once
// The benchmarks' own `--name=value` flags, read before Google Benchmark sees argv.
#include <cstring>
#include <string>

namespace kvcache_bench {

/// True (and *value = the text after '=') if `arg` is `name=value`.
inline bool take_flag(const char* arg, const char* name, std::string* value) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0 || arg[n] != '=') return false;
  *value = arg + n + 1;
  return true;
}

}  // namespace kvcache_bench
