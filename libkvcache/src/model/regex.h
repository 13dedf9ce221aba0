// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file regex.h
/// A compiled PCRE2 pattern (UTF + UCP, JIT when available) for tokenizer splitting.
/// Private to libkvcache.

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvcache::tok {

/// Immutable compiled pattern; `find_all` is safe to call from several threads.
class Regex {
 public:
  enum class Syntax { kPattern, kLiteral };

  /// Compiles `pattern` in UTF + UCP mode. With kPattern the pattern is first adapted to
  /// Oniguruma's `\s` (which, unlike PCRE2's, also matches U+0085 NEL) because the HF
  /// tokenizers library runs its patterns on Oniguruma.
  /// @throws InvalidArgument naming the pattern, PCRE2's message and the offset.
  Regex(const std::string& pattern, Syntax syntax);

  /// Non-overlapping, non-empty matches in `text` as [begin, end) byte ranges, left to
  /// right. `text` must be valid UTF-8 (checked by the caller).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

  const std::string& pattern() const { return pattern_; }
  bool jit() const { return jit_; }

 private:
  struct CodeDeleter {
    void operator()(void* code) const;
  };
  std::string pattern_;
  std::unique_ptr<void, CodeDeleter> code_;  // pcre2_code_8*
  bool jit_ = false;
};

/// Rewrites `\s` to also match U+0085 and `\S` to exclude it (Oniguruma semantics);
/// exposed for tests.
std::string onigurumize_whitespace(const std::string& pattern);

}  // namespace kvcache::tok
