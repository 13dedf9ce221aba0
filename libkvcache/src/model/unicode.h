// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file unicode.h
/// UTF-8 helpers and NFC normalisation used by the tokenizer (private to libkvcache).

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvcache::unicode {

/// Byte offset of the first invalid UTF-8 sequence in `s` (overlongs, surrogates and
/// code points above U+10FFFF are invalid), or std::string::npos when `s` is valid.
size_t find_invalid_utf8(std::string_view s);

/// Decodes valid UTF-8 (checked with find_invalid_utf8 first) into code points.
std::vector<char32_t> decode_utf8(std::string_view s);

/// Appends the UTF-8 encoding of `cp` to `out`.
void append_utf8(std::string& out, char32_t cp);

/// Length in bytes of the UTF-8 sequence that starts with lead byte `c` (1 for a
/// stray continuation byte, so loops always advance).
size_t utf8_len(unsigned char c);

/// Turns arbitrary bytes into valid UTF-8, replacing each maximal invalid
/// subsequence by U+FFFD (like Rust's String::from_utf8_lossy, which HF decoders use).
std::string utf8_lossy(std::string_view bytes);

/// Canonical combining class of `cp` (0 for starters).
uint8_t combining_class(char32_t cp);

/// Unicode Normalization Form C (canonical decomposition, canonical ordering, canonical
/// composition; Hangul algorithmically), over the full code space, with the tables of
/// unicode_nfc_data.h (Unicode 14.0.0). `s` must be valid UTF-8.
std::string nfc(std::string_view s);

/// Unicode Normalization Form D (canonical decomposition + ordering). `s` must be valid UTF-8.
std::string nfd(std::string_view s);

}  // namespace kvcache::unicode
