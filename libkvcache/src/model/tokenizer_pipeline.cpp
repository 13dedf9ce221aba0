// SPDX-License-Identifier: Apache-2.0
// Normalizers, pre-tokenizers and decoders of the HF tokenizers pipeline (the supported subset).
#include <algorithm>
#include <cctype>

#include "kvcache/error.h"
#include "model/tokenizer_impl.h"
#include "model/unicode.h"

namespace kvcache::tok {
namespace {

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  for (size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out.append(to);
  }
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

/// Unicode White_Space (Rust's char::is_whitespace, used by HF's Strip normalizer).
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

std::string strip_white_space(const std::string& s, bool left, bool right) {
  const std::vector<char32_t> cps = unicode::decode_utf8(s);
  size_t b = 0, e = cps.size();
  if (left) {
    while (b < e && is_white_space(cps[b])) ++b;
  }
  if (right) {
    while (e > b && is_white_space(cps[e - 1])) --e;
  }
  std::string out;
  for (size_t i = b; i < e; ++i) unicode::append_utf8(out, cps[i]);
  return out;
}

/// Splits `piece` by the matches of `regex` according to HF's SplitDelimiterBehavior.
void split_piece(const std::string& piece, const Regex& regex, SplitBehavior behavior, bool invert,
                 std::vector<std::string>& out) {
  struct Span {
    size_t b, e;
    bool match;
  };
  std::vector<Span> spans;
  size_t pos = 0;
  for (const auto& [b, e] : regex.find_all(piece)) {
    if (b > pos) spans.push_back({pos, b, invert});
    spans.push_back({b, e, !invert});
    pos = e;
  }
  if (pos < piece.size()) spans.push_back({pos, piece.size(), invert});

  std::vector<std::string> parts;
  if (behavior == SplitBehavior::kMergedWithNext) {
    // As HF: walking backwards, a match joins the part after it unless that is a match too.
    bool next_was_match = false;
    for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
      std::string text = piece.substr(it->b, it->e - it->b);
      if (it->match && !next_was_match && !parts.empty()) {
        parts.back().insert(0, text);
      } else {
        parts.push_back(std::move(text));
      }
      next_was_match = it->match;
    }
    std::reverse(parts.begin(), parts.end());
    for (auto& p : parts) {
      if (!p.empty()) out.push_back(std::move(p));
    }
    return;
  }
  bool last_was_match = false;
  for (const Span& sp : spans) {
    std::string text = piece.substr(sp.b, sp.e - sp.b);
    switch (behavior) {
      case SplitBehavior::kRemoved:
        if (!sp.match) parts.push_back(std::move(text));
        break;
      case SplitBehavior::kIsolated:
        parts.push_back(std::move(text));
        break;
      case SplitBehavior::kMergedWithPrevious:
        if (sp.match && !parts.empty() && !last_was_match) {
          parts.back() += text;
        } else {
          parts.push_back(std::move(text));
        }
        break;
      case SplitBehavior::kMergedWithNext:  // handled above
        break;
      case SplitBehavior::kContiguous:
        if (sp.match && last_was_match && !parts.empty()) {
          parts.back() += text;
        } else {
          parts.push_back(std::move(text));
        }
        break;
    }
    last_was_match = sp.match;
  }
  for (auto& p : parts) {
    if (!p.empty()) out.push_back(std::move(p));
  }
}

std::string byte_level_map(const std::string& s) {
  const auto& t = ByteLevelTables::get();
  std::string out;
  out.reserve(s.size() * 2);
  for (unsigned char c : s) out += t.byte_to_utf8[c];
  return out;
}

bool starts_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}

/// HF ByteFallback: runs of "<0xNN>" tokens become their bytes when those form valid UTF-8,
/// else one U+FFFD per byte.
std::vector<std::string> byte_fallback(std::vector<std::string> tokens) {
  std::vector<std::string> out;
  std::string bytes;
  size_t nbytes = 0;
  auto flush = [&] {
    if (nbytes == 0) return;
    if (unicode::find_invalid_utf8(bytes) == std::string::npos) {
      out.push_back(bytes);
    } else {
      for (size_t i = 0; i < nbytes; ++i) out.emplace_back("\xEF\xBF\xBD");
    }
    bytes.clear();
    nbytes = 0;
  };
  for (auto& t : tokens) {
    int value = -1;
    if (t.size() == 6 && starts_with(t, "<0x") && t[5] == '>' && std::isxdigit(static_cast<unsigned char>(t[3])) &&
        std::isxdigit(static_cast<unsigned char>(t[4]))) {
      value = std::stoi(t.substr(3, 2), nullptr, 16);
    }
    if (value >= 0) {
      bytes.push_back(static_cast<char>(value));
      ++nbytes;
    } else {
      flush();
      out.push_back(std::move(t));
    }
  }
  flush();
  return out;
}

}  // namespace

const ByteLevelTables& ByteLevelTables::get() {
  static const ByteLevelTables tables = [] {
    ByteLevelTables t;
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const char32_t cp = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      unicode::append_utf8(t.byte_to_utf8[static_cast<size_t>(b)], cp);
      t.char_to_byte.emplace(cp, static_cast<uint8_t>(b));
    }
    return t;
  }();
  return tables;
}

std::string apply_normalizers(const std::vector<NormStep>& steps, std::string s) {
  for (const auto& step : steps) {
    switch (step.kind) {
      case NormStep::Kind::kNFC:
        s = unicode::nfc(s);
        break;
      case NormStep::Kind::kNFD:
        s = unicode::nfd(s);
        break;
      case NormStep::Kind::kPrepend:
        if (!s.empty()) s = step.text + s;  // HF prepends only to non-empty strings
        break;
      case NormStep::Kind::kReplace:
        if (step.regex) {
          std::string out;
          size_t pos = 0;
          for (const auto& [b, e] : step.regex->find_all(s)) {
            out.append(s, pos, b - pos);
            out += step.content;
            pos = e;
          }
          out.append(s, pos, std::string::npos);
          s = std::move(out);
        } else {
          replace_all(s, step.text, step.content);
        }
        break;
      case NormStep::Kind::kStrip:
        s = strip_white_space(s, step.left, step.right);
        break;
    }
  }
  return s;
}

std::vector<std::string> apply_pretokenizers(const std::vector<PreTokStep>& steps,
                                             std::string segment, bool at_text_start) {
  std::vector<std::string> pieces;
  if (segment.empty()) return pieces;
  pieces.push_back(std::move(segment));
  for (const auto& step : steps) {
    std::vector<std::string> next;
    next.reserve(pieces.size() * 2);
    for (size_t i = 0; i < pieces.size(); ++i) {
      std::string& piece = pieces[i];
      switch (step.kind) {
        case PreTokStep::Kind::kSplit:
          split_piece(piece, *step.regex, step.behavior, step.invert, next);
          break;
        case PreTokStep::Kind::kByteLevel: {
          if (step.add_prefix_space && !starts_with(piece, " ")) piece.insert(0, " ");
          if (step.regex) {
            std::vector<std::string> parts;
            split_piece(piece, *step.regex, SplitBehavior::kIsolated, false, parts);
            for (auto& p : parts) next.push_back(byte_level_map(p));
          } else {
            next.push_back(byte_level_map(piece));
          }
          break;
        }
        case PreTokStep::Kind::kMetaspace: {
          replace_all(piece, " ", step.replacement);
          const bool needs_prefix = !starts_with(piece, step.replacement);
          if (needs_prefix && (step.scheme == PrependScheme::kAlways ||
                               (step.scheme == PrependScheme::kFirst && at_text_start && i == 0))) {
            piece.insert(0, step.replacement);
          }
          if (!step.split) {
            next.push_back(std::move(piece));
            break;
          }
          // Split before every replacement char (MergedWithNext).
          size_t start = 0;
          for (size_t hit = piece.find(step.replacement, 1); hit != std::string::npos;
               hit = piece.find(step.replacement, hit + step.replacement.size())) {
            if (hit > start) next.push_back(piece.substr(start, hit - start));
            start = hit;
          }
          if (start < piece.size()) next.push_back(piece.substr(start));
          break;
        }
      }
    }
    pieces = std::move(next);
  }
  return pieces;
}

std::vector<std::string> apply_decoders(const std::vector<DecStep>& steps,
                                        std::vector<std::string> tokens) {
  for (const auto& step : steps) {
    switch (step.kind) {
      case DecStep::Kind::kByteLevel: {
        const auto& t = ByteLevelTables::get();
        std::string bytes;
        for (const auto& tok : tokens) {
          std::string mapped;
          bool all = true;
          for (char32_t c : unicode::decode_utf8(tok)) {
            const auto it = t.char_to_byte.find(c);
            if (it == t.char_to_byte.end()) {
              all = false;
              break;
            }
            mapped.push_back(static_cast<char>(it->second));
          }
          bytes += all ? mapped : tok;  // HF keeps a token's own bytes when any char is unmapped
        }
        tokens.assign(1, unicode::utf8_lossy(bytes));
        break;
      }
      case DecStep::Kind::kReplace:
        for (auto& tok : tokens) replace_all(tok, step.pattern, step.content);
        break;
      case DecStep::Kind::kByteFallback:
        tokens = byte_fallback(std::move(tokens));
        break;
      case DecStep::Kind::kFuse: {
        std::string all;
        for (const auto& tok : tokens) all += tok;
        tokens.assign(1, std::move(all));
        break;
      }
      case DecStep::Kind::kStrip:
        for (auto& tok : tokens) {
          size_t b = 0;
          for (size_t k = 0; k < step.start && starts_with(tok.substr(b), step.content); ++k) {
            b += step.content.size();
          }
          size_t e = tok.size();
          for (size_t k = 0; k < step.stop && e >= b + step.content.size() &&
                             tok.compare(e - step.content.size(), step.content.size(), step.content) == 0;
               ++k) {
            e -= step.content.size();
          }
          tok = tok.substr(b, e - b);
        }
        break;
      case DecStep::Kind::kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          // HF drops every replacement char of the first token when a prefix was prepended.
          const bool drop = i == 0 && step.scheme != PrependScheme::kNever;
          replace_all(tokens[i], step.replacement, drop ? "" : " ");
        }
        break;
    }
  }
  return tokens;
}

}  // namespace kvcache::tok
