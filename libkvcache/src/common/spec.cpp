// SPDX-License-Identifier: Apache-2.0
#include "kvcache/spec.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <limits>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "kvcache/error.h"

namespace kvcache {
namespace {

/// Shortest decimal text that parses back to exactly `v` (so canonical specs round-trip).
std::string format_number(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) return std::to_string(static_cast<long long>(v));
  for (int precision = 6; precision <= 17; ++precision) {
    std::ostringstream os;
    os.precision(precision);
    os << v;
    if (std::strtod(os.str().c_str(), nullptr) == v) return os.str();
  }
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

/// "{2, 3, 4, 8}" for a param with allowed values, else "[min, max]".
std::string value_set(const ParamDef& p) {
  std::string out;
  if (p.allowed.empty()) return "[" + format_number(p.min_value) + ", " + format_number(p.max_value) + "]";
  for (double v : p.allowed) out += (out.empty() ? "{" : ", ") + format_number(v);
  return out + "}";
}

std::string allowed_fields(const ParamTable& table) {
  if (table.params.empty()) return "'" + table.head + "' takes no fields";
  std::ostringstream os;
  os << "allowed fields of '" << table.head << "': ";
  bool first = true;
  for (const auto& p : table.params) {
    if (!first) os << ", ";
    first = false;
    if (p.kind == ParamDef::Kind::kChoice) {
      for (size_t i = 0; i < p.choices.size(); ++i) os << (i ? "|" : "") << p.choices[i];
      os << " (" << p.help << ")";
    } else if (p.kind == ParamDef::Kind::kText) {
      os << p.key << "=<text> (" << p.help << ")";
    } else {
      os << p.key << "<" << (p.kind == ParamDef::Kind::kInt ? "int" : "number") << " in " << value_set(p)
         << "> (" << p.help << ", default " << format_number(p.default_value) << ")";
    }
  }
  return os.str();
}

enum class NumberText { kOk, kMalformed, kOutOfRange };

/// Decimal numbers only ("64", "0.5", "-1", "1e3"); no hex, inf or nan, which strtod
/// would otherwise accept. A well-formed number whose magnitude does not fit a double
/// ("1e400", a 400-digit integer) or underflows to zero ("1e-400") is kOutOfRange.
NumberText parse_number(const std::string& s, double* out) {
  if (s.empty()) return NumberText::kMalformed;
  for (char c : s) {
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '+' || c == 'e' ||
          c == 'E')) {
      return NumberText::kMalformed;
    }
  }
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return NumberText::kMalformed;
  if (!std::isfinite(v) || (errno == ERANGE && v == 0.0)) return NumberText::kOutOfRange;
  *out = v;
  return NumberText::kOk;
}

}  // namespace

std::vector<std::string> split_spec(const std::string& text) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : text) {
    if (c == ':') {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  parts.push_back(cur);
  for (size_t i = 0; i < parts.size(); ++i) {
    KV_CHECK_ARG(!parts[i].empty(), "spec '", text, "': empty ",
                 i == 0 ? "head" : "field", " at position ", i,
                 " (grammar: head(:field)*, e.g. 'int4:g64')");
  }
  return parts;
}

ParsedSpec ParsedSpec::parse(const std::string& text, const ParamTable& table) {
  ParsedSpec out;
  out.table_ = &table;
  out.text_ = text;
  auto parts = split_spec(text);
  KV_CHECK_ARG(parts[0] == table.head, "spec '", text, "': head '", parts[0],
               "' does not match '", table.head, "'");
  out.head_ = parts[0];
  for (const auto& p : table.params) {
    if (p.kind == ParamDef::Kind::kChoice) {
      KV_INTERNAL_ASSERT(!p.choices.empty(), "choice param without choices");
      out.choices_[p.key] = p.choices[0];
    } else if (p.kind == ParamDef::Kind::kText) {
      out.choices_[p.key] = "";
    } else {
      out.nums_[p.key] = p.default_value;
    }
    out.set_[p.key] = false;
  }
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string& f = parts[i];
    const ParamDef* match = nullptr;
    std::string value_text;
    // key=text of a text param?
    const auto eq = f.find('=');
    if (eq != std::string::npos) {
      for (const auto& p : table.params) {
        if (p.kind == ParamDef::Kind::kText && f.compare(0, eq, p.key) == 0 && eq == p.key.size()) match = &p;
      }
      KV_CHECK_ARG(match != nullptr, "spec '", text, "': unknown field '", f, "'; ", allowed_fields(table));
      const std::string v = f.substr(eq + 1);
      KV_CHECK_ARG(!v.empty(), "spec '", text, "': field '", f, "': empty ", match->key, " (", match->help, ")");
      KV_CHECK_ARG(v.find_first_of("()@+, \t\n") == std::string::npos, "spec '", text, "': field '", f, "': ",
                   match->key, " must not hold any of ': ( ) @ + ,' or blanks (", match->help, ")");
      KV_CHECK_ARG(!out.set_[match->key], "spec '", text, "': '", match->key, "' given twice");
      out.choices_[match->key] = v;
      out.set_[match->key] = true;
      continue;
    }
    // A bare word of a choice param?
    for (const auto& p : table.params) {
      if (p.kind != ParamDef::Kind::kChoice) continue;
      for (const auto& c : p.choices) {
        if (c == f) match = &p;
      }
    }
    if (match != nullptr) {
      KV_CHECK_ARG(!out.set_[match->key], "spec '", text, "': '", match->key,
                   "' given twice (field '", f, "')");
      out.choices_[match->key] = f;
      out.set_[match->key] = true;
      continue;
    }
    // key<number>: the longest numeric key that prefixes the field.
    for (const auto& p : table.params) {
      if (p.kind == ParamDef::Kind::kChoice || p.kind == ParamDef::Kind::kText) continue;
      if (f.size() > p.key.size() && f.compare(0, p.key.size(), p.key) == 0) {
        std::string rest = f.substr(p.key.size());
        if (!(std::isdigit(static_cast<unsigned char>(rest[0])) || rest[0] == '.' || rest[0] == '-')) continue;
        if (match == nullptr || p.key.size() > match->key.size()) {
          match = &p;
          value_text = rest;
        }
      }
    }
    KV_CHECK_ARG(match != nullptr, "spec '", text, "': unknown field '", f, "'; ",
                 allowed_fields(table));
    double v = 0;
    const NumberText nt = parse_number(value_text, &v);
    KV_CHECK_ARG(nt != NumberText::kMalformed, "spec '", text, "': field '", f, "': '", value_text,
                 "' is not a number; ", allowed_fields(table));
    KV_CHECK_ARG(nt == NumberText::kOk, "spec '", text, "': field '", f, "': ", match->key, "=", value_text,
                 " out of range [", format_number(match->min_value), ", ", format_number(match->max_value), "] (",
                 match->help, ")");
    if (match->kind == ParamDef::Kind::kInt) {
      KV_CHECK_ARG(v == std::floor(v), "spec '", text, "': field '", f, "': ", match->key,
                   " must be an integer, got ", value_text);
    }
    KV_CHECK_ARG(v >= match->min_value && v <= match->max_value, "spec '", text, "': field '", f,
                 "': ", match->key, "=", value_text, " out of range [",
                 format_number(match->min_value), ", ", format_number(match->max_value), "] (",
                 match->help, ")");
    KV_CHECK_ARG(match->allowed.empty() ||
                     std::find(match->allowed.begin(), match->allowed.end(), v) != match->allowed.end(),
                 "spec '", text, "': field '", f, "': ", match->key, "=", value_text, " is not one of ",
                 value_set(*match), " (", match->help, ")");
    KV_CHECK_ARG(!out.set_[match->key], "spec '", text, "': '", match->key, "' given twice");
    out.nums_[match->key] = v;
    out.set_[match->key] = true;
  }
  return out;
}

double ParsedSpec::num(const std::string& key) const {
  auto it = nums_.find(key);
  KV_INTERNAL_ASSERT(it != nums_.end(), "no numeric param '", key, "' in spec ", head_);
  return it->second;
}

const std::string& ParsedSpec::choice(const std::string& key) const {
  auto it = choices_.find(key);
  KV_INTERNAL_ASSERT(it != choices_.end(), "no choice param '", key, "' in spec ", head_);
  return it->second;
}

const std::string& ParsedSpec::str(const std::string& key) const {
  const bool text_param = table_ != nullptr && std::any_of(table_->params.begin(), table_->params.end(), [&](const ParamDef& p) {
                            return p.key == key && p.kind == ParamDef::Kind::kText;
                          });
  KV_INTERNAL_ASSERT(text_param, "no text param '", key, "' in spec ", head_);
  return choices_.at(key);
}

bool ParsedSpec::is_set(const std::string& key) const {
  auto it = set_.find(key);
  return it != set_.end() && it->second;
}

std::string ParsedSpec::canonical() const {
  if (table_ == nullptr) return head_;
  return canonical_spec(*table_, nums_, choices_);
}

std::string canonical_spec(const ParamTable& table, const std::map<std::string, double>& nums,
                           const std::map<std::string, std::string>& choices) {
  // (Plain iteration, not structured bindings: C++17 lambdas cannot capture those; clang rejects it.)
  for (const auto& entry : nums) {
    const std::string& key = entry.first;
    KV_INTERNAL_ASSERT(std::any_of(table.params.begin(), table.params.end(),
                                   [&](const ParamDef& p) { return p.key == key && p.kind != ParamDef::Kind::kChoice; }),
                       "canonical_spec(", table.head, "): no numeric param '", key, "'");
  }
  for (const auto& entry : choices) {
    const std::string& key = entry.first;
    KV_INTERNAL_ASSERT(std::any_of(table.params.begin(), table.params.end(),
                                   [&](const ParamDef& p) {
                                     return p.key == key &&
                                            (p.kind == ParamDef::Kind::kChoice || p.kind == ParamDef::Kind::kText);
                                   }),
                       "canonical_spec(", table.head, "): no choice or text param '", key, "'");
  }
  std::string out = table.head;
  for (const auto& p : table.params) {
    if (p.kind == ParamDef::Kind::kText) {
      const auto it = choices.find(p.key);
      if (it != choices.end() && !it->second.empty()) out += ":" + p.key + "=" + it->second;
    } else if (p.kind == ParamDef::Kind::kChoice) {
      const auto it = choices.find(p.key);
      const std::string& c = it == choices.end() ? p.choices[0] : it->second;
      if (c != p.choices[0] || p.shown) out += ":" + c;
    } else {
      const auto it = nums.find(p.key);
      const double v = it == nums.end() ? p.default_value : it->second;
      if (v != p.default_value || p.shown) out += ":" + p.key + format_number(v);
    }
  }
  return out;
}

std::string spec_head(const std::string& text) { return text.substr(0, text.find_first_of(":(@+")); }

std::optional<WrappedSpec> split_wrapper(const std::string& text) {
  const auto open = text.find('(');
  if (open == std::string::npos) return std::nullopt;
  int depth = 0;
  size_t close = std::string::npos;
  for (size_t i = open; i < text.size(); ++i) {
    if (text[i] == '(') ++depth;
    if (text[i] == ')' && --depth == 0) {
      close = i;
      break;
    }
  }
  KV_CHECK_ARG(close != std::string::npos, "spec '", text, "': '(' at position ", open,
               " is never closed (grammar: head(:field)*(spec), e.g. 'had(int4)')");
  KV_CHECK_ARG(close + 1 == text.size(), "spec '", text, "': unexpected '", text.substr(close + 1),
               "' after the wrapped spec's ')' (grammar: head(:field)*(spec), e.g. 'had(int4)')");
  WrappedSpec w{text.substr(0, open), text.substr(open + 1, close - open - 1)};
  KV_CHECK_ARG(!w.outer.empty(), "spec '", text, "': no head before '(' (grammar: head(:field)*(spec), e.g. 'had(int4)')");
  KV_CHECK_ARG(!w.inner.empty(), "spec '", text, "': empty wrapped spec '()' (expected e.g. 'had(int4)')");
  return w;
}

Budget Budget::parse(const std::string& text) {
  Budget b;
  KV_CHECK_ARG(!text.empty(), "empty budget after '@' (expected e.g. '@256' tokens or '@50%')");
  double v = 0;
  if (text.back() == '%') {
    const NumberText nt = parse_number(text.substr(0, text.size() - 1), &v);
    KV_CHECK_ARG(nt != NumberText::kMalformed, "budget '@", text, "': not a percentage (expected e.g. '@50%')");
    KV_CHECK_ARG(nt == NumberText::kOk && v > 0 && v <= 100, "budget '@", text,
                 "': percentage must be in (0, 100], got ", text);
    // Below 100/kMaxTokens % a budget keeps less than one token of every context the cache
    // accepts (resolve() would always refuse it), and fractions that small lose their digits
    // (7e-324% is 0 once divided by 100): reject them here, where the user's text is known.
    // The test is resolve()'s own (floor(f·c + 1e-9) ≥ 1 at c = kMaxTokens), so a percentage
    // printed back by to_string() (f·100, which may differ in its last digit) passes it too.
    constexpr double kMinPercent = 100.0 / static_cast<double>(kMaxTokens);
    KV_CHECK_ARG(v / 100.0 * static_cast<double>(kMaxTokens) + 1e-9 >= 1.0, "budget '@", text,
                 "': percentage must be at least ", kMinPercent, "% (less keeps under one token of any context up to ",
                 kMaxTokens, " tokens), got ", text);
    b.kind = Kind::kFraction;
    b.value = v / 100.0;
  } else {
    const NumberText nt = parse_number(text, &v);
    KV_CHECK_ARG(nt != NumberText::kMalformed, "budget '@", text,
                 "': not a token count (expected e.g. '@256' or '@50%')");
    KV_CHECK_ARG(nt == NumberText::kOk && v >= 1 && v <= static_cast<double>(kMaxTokens) && v == std::floor(v),
                 "budget '@", text, "': token budget must be an integer in [1, ", kMaxTokens, "], got ", text);
    b.kind = Kind::kTokens;
    b.value = v;
  }
  return b;
}

int64_t Budget::resolve(int64_t context_tokens) const {
  switch (kind) {
    case Kind::kNone:
      return context_tokens;
    case Kind::kTokens:
      KV_CHECK_ARG(value >= 1 && value <= static_cast<double>(kMaxTokens) && value == std::floor(value), "budget ",
                   to_string(), ": a token budget must be an integer in [1, ", kMaxTokens, "]");
      return static_cast<int64_t>(value);
    case Kind::kFraction: {
      KV_CHECK_ARG(value > 0 && value <= 1, "budget ", to_string(), ": a fraction must be in (0, 100]%");
      KV_CHECK_ARG(context_tokens > 0, "budget ", to_string(),
                   " needs the request's context length, got ", context_tokens);
      // Small epsilon so that 0.5 * 10 = 5 exactly despite binary fractions.
      const double c = static_cast<double>(context_tokens);
      const double f = std::floor(value * c + 1e-9);
      const int64_t t = f >= c ? context_tokens : static_cast<int64_t>(f);  // never past the context (nor int64)
      KV_CHECK(t >= 1, CapacityError, "budget ", to_string(), " of a ", context_tokens,
               "-token context rounds to ", t, " tokens; a budget must keep at least 1 token");
      return t;
    }
  }
  return context_tokens;
}

std::string Budget::to_string() const {
  switch (kind) {
    case Kind::kNone:
      return "";
    case Kind::kTokens:
      return "@" + format_number(value);
    case Kind::kFraction:
      return "@" + format_number(value * 100.0) + "%";
  }
  return "";
}

std::pair<std::string, Budget> split_budget(const std::string& text) {
  auto at = text.find('@');
  if (at == std::string::npos) return {text, Budget{}};
  KV_CHECK_ARG(text.find('@', at + 1) == std::string::npos, "spec '", text,
               "': more than one '@budget'");
  return {text.substr(0, at), Budget::parse(text.substr(at + 1))};
}

int64_t parse_integer(const std::string& text, const std::string& what, int64_t min_value, int64_t max_value) {
  KV_INTERNAL_ASSERT(min_value <= max_value, "parse_integer(", what, "): empty range");
  // std::from_chars takes an optional '-' and decimal digits only: no blanks, '+', hex or exponent.
  int64_t v = 0;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(first, last, v);
  const bool digits = !text.empty() && ptr == last;
  const std::string named = what.empty() ? std::string() : what + " = ";
  KV_CHECK_ARG(digits && (ec == std::errc() || ec == std::errc::result_out_of_range), named, "'", text,
               "' is not an integer (expected one in [", min_value, ", ", max_value, "])");
  KV_CHECK_ARG(ec == std::errc() && v >= min_value && v <= max_value, named, text, " is out of range [", min_value,
               ", ", max_value, "]");
  return v;
}

std::string describe(const ParamTable& table) {
  std::ostringstream os;
  os << table.head << " — " << table.help << "\n";
  for (const auto& p : table.params) {
    if (p.kind == ParamDef::Kind::kChoice) {
      os << "    ";
      for (size_t i = 0; i < p.choices.size(); ++i) os << (i ? "|" : "") << p.choices[i];
      os << "  " << p.help << " (default " << p.choices[0] << ")\n";
    } else if (p.kind == ParamDef::Kind::kText) {
      os << "    " << p.key << "=<text>  " << p.help << "\n";
    } else {
      os << "    " << p.key << "<" << (p.kind == ParamDef::Kind::kInt ? "int" : "number") << ">  " << p.help
         << " (default " << format_number(p.default_value) << ", " << (p.allowed.empty() ? "range " : "one of ")
         << value_set(p) << ")\n";
    }
  }
  return os.str();
}

}  // namespace kvcache
