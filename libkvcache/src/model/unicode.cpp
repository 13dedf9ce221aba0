// SPDX-License-Identifier: Apache-2.0
#include "model/unicode.h"

#include <algorithm>
#include <unordered_map>

#include "model/unicode_nfc_data.h"

namespace kvcache::unicode {
namespace {

// Hangul syllable arithmetic (Unicode Standard, section 3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28;
constexpr char32_t kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

const unicode_data::Decomp* find_decomp(char32_t cp) {
  const auto* begin = std::begin(unicode_data::kCanonicalDecomp);
  const auto* end = std::end(unicode_data::kCanonicalDecomp);
  const auto* it = std::lower_bound(begin, end, cp, [](const unicode_data::Decomp& d, char32_t c) {
    return d.cp < c;
  });
  return (it != end && it->cp == cp) ? it : nullptr;
}

/// (first << 32 | second) -> primary composite, built once from the decomposition table.
const std::unordered_map<uint64_t, char32_t>& composition_map() {
  static const std::unordered_map<uint64_t, char32_t> map = [] {
    std::unordered_map<uint64_t, char32_t> m;
    for (const auto& d : unicode_data::kCanonicalDecomp) {
      if (d.composable) m.emplace((uint64_t{d.first} << 32) | d.second, d.cp);
    }
    return m;
  }();
  return map;
}

void decompose_into(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const char32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (cp < 0xC0) {  // nothing below U+00C0 decomposes
    out.push_back(cp);
    return;
  }
  const auto* d = find_decomp(cp);
  if (d == nullptr) {
    out.push_back(cp);
    return;
  }
  decompose_into(d->first, out);
  if (d->second != 0) decompose_into(d->second, out);
}

/// Full canonical decomposition followed by the canonical ordering algorithm.
std::vector<char32_t> canonical_decompose(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  for (char32_t cp : decode_utf8(s)) decompose_into(cp, out);
  // Stable sort of each run of non-starters by combining class.
  size_t i = 0;
  while (i < out.size()) {
    if (combining_class(out[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < out.size() && combining_class(out[j]) != 0) ++j;
    std::stable_sort(out.begin() + static_cast<std::ptrdiff_t>(i),
                     out.begin() + static_cast<std::ptrdiff_t>(j),
                     [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
  return out;
}

char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  const auto& map = composition_map();
  const auto it = map.find((uint64_t{a} << 32) | b);
  return it == map.end() ? 0 : it->second;
}

bool needs_normalization_check(std::string_view s) {
  // Every code point below U+0300 is NFC-stable and none of them composes with a
  // preceding character, so a string made only of them is already in NFC and NFD-free
  // of marks; U+00C0..U+02FF do decompose though, which only matters for NFD.
  for (unsigned char c : s) {
    if (c >= 0xCC) return true;  // lead bytes of U+0300 and above
  }
  return false;
}

}  // namespace

size_t utf8_len(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;
}

size_t find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    char32_t cp = 0, min = 0;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return i;
    }
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string::npos;
}

std::vector<char32_t> decode_utf8(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t len = std::min(utf8_len(c), s.size() - i);
    char32_t cp = len == 1 ? c : (c & (0x7F >> len));
    for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += len;
  }
  return out;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const size_t bad = find_invalid_utf8(bytes.substr(i));
    if (bad == std::string::npos) {
      out.append(bytes.substr(i));
      break;
    }
    out.append(bytes.substr(i, bad));
    i += bad;
    // Skip the maximal prefix of a valid sequence (at least one byte), as from_utf8_lossy does.
    const auto c = static_cast<unsigned char>(bytes[i]);
    size_t skip = 1;
    const size_t want = utf8_len(c);
    if (want > 1 && c != 0xC0 && c != 0xC1 && c <= 0xF4) {
      while (skip < want && i + skip < bytes.size()) {
        const auto cc = static_cast<unsigned char>(bytes[i + skip]);
        if ((cc & 0xC0) != 0x80) break;
        // Second-byte range restrictions of well-formed UTF-8 (Unicode Table 3-7).
        if (skip == 1 && ((c == 0xE0 && cc < 0xA0) || (c == 0xED && cc > 0x9F) ||
                          (c == 0xF0 && cc < 0x90) || (c == 0xF4 && cc > 0x8F))) {
          break;
        }
        ++skip;
      }
    }
    out.append("\xEF\xBF\xBD");
    i += skip;
  }
  return out;
}

uint8_t combining_class(char32_t cp) {
  if (cp < 0x300) return 0;
  const auto* begin = std::begin(unicode_data::kCombiningClass);
  const auto* end = std::end(unicode_data::kCombiningClass);
  const auto* it = std::upper_bound(begin, end, cp, [](char32_t c, const unicode_data::CccRange& r) {
    return c < r.first;
  });
  if (it == begin) return 0;
  --it;
  return (cp <= it->last) ? it->ccc : 0;
}

std::string nfd(std::string_view s) {
  bool ascii_latin1_only = true;
  for (unsigned char c : s) {
    if (c >= 0xC3) {  // U+00C0 and above may decompose
      ascii_latin1_only = false;
      break;
    }
  }
  if (ascii_latin1_only) return std::string(s);
  std::string out;
  out.reserve(s.size() + s.size() / 2);
  for (char32_t cp : canonical_decompose(s)) append_utf8(out, cp);
  return out;
}

std::string nfc(std::string_view s) {
  if (!needs_normalization_check(s)) return std::string(s);
  std::vector<char32_t> cps = canonical_decompose(s);
  // Canonical composition algorithm (Unicode Standard, section 3.11, D117).
  size_t starter = std::string::npos;  // index of the last starter in the output
  int last_ccc = -1;                   // combining class of the last character kept after it
  size_t w = 0;                        // write index (compose in place)
  for (size_t r = 0; r < cps.size(); ++r) {
    const char32_t cp = cps[r];
    const int ccc = combining_class(cp);
    if (starter != std::string::npos) {
      // Blocked if a character of ccc 0 or ccc >= this one sits between starter and cp.
      const bool blocked = (last_ccc != -1) && (last_ccc == 0 || last_ccc >= ccc);
      if (!blocked) {
        const char32_t composite = compose_pair(cps[starter], cp);
        if (composite != 0) {
          cps[starter] = composite;
          continue;  // cp is consumed; last_ccc is unchanged
        }
      }
    }
    if (ccc == 0) {
      starter = w;
      last_ccc = -1;
    } else {
      last_ccc = ccc;
    }
    cps[w++] = cp;
  }
  cps.resize(w);
  std::string out;
  out.reserve(s.size());
  for (char32_t cp : cps) append_utf8(out, cp);
  return out;
}

}  // namespace kvcache::unicode
