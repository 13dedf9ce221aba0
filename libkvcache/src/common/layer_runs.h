// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_runs.h (internal)
/// The run list inside the per-layer specs `layers(<scheme>*<n>;...)` (cache scheme) and
/// `perlayer(<policy>@<budget>*<n>;...)` (eviction policy): items separated by ';' outside
/// parentheses, each `<spec>[*<layers>]`.
#include <string>
#include <vector>

namespace kvcache::detail {

/// Splits `inner` at the ';' outside parentheses (empty items kept: the caller names them).
inline std::vector<std::string> split_layer_runs(const std::string& inner) {
  std::vector<std::string> out;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= inner.size(); ++i) {
    if (i < inner.size() && inner[i] == '(') ++depth;
    if (i < inner.size() && inner[i] == ')') --depth;
    if (i == inner.size() || (inner[i] == ';' && depth == 0)) {
      out.push_back(inner.substr(start, i - start));
      start = i + 1;
    }
  }
  return out;
}

/// Where a run's layer count starts: the last '*' of `item` outside parentheses, or
/// std::string::npos (no count: one layer).
inline size_t layer_run_star(const std::string& item) {
  size_t star = std::string::npos;
  int depth = 0;
  for (size_t j = 0; j < item.size(); ++j) {
    if (item[j] == '(') ++depth;
    if (item[j] == ')') --depth;
    if (item[j] == '*' && depth == 0) star = j;
  }
  return star;
}

}  // namespace kvcache::detail
