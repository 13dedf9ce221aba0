// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file spec.h
/// Spec strings: the short, canonical names of quantizers, cache schemes and
/// eviction policies (faiss-style factory strings), all registered in one registry
/// (kvcache/registry.h).
///
/// Grammar: `head(:field)*[@budget]` or, for a wrapper, `head(:field)*(spec)`
///   - `head`    : lowercase identifier, e.g. `int4`, `fp8`, `kivi`, `sink`, `had`.
///   - `field`   : either `key<number>` (e.g. `g64`, `r128`, `seed7`, `k2`) for a numeric
///                 parameter, a bare word (e.g. `e4m3`, `chan`) for a choice parameter, or
///                 `key=text` for a text parameter (a file path: `kvquant:b3:cal=runs/c.kvqcal`;
///                 the text is non-empty and holds none of `: ( ) @ + ,` or blanks).
///   - `(spec)`  : only for wrappers (`had(int4)`, `had:k(kivi:k2:v2:g32:r128)`): the spec it
///                 transforms, itself any quantizer or cache-scheme spec.
///   - `@budget` : only for eviction policies: `@<N>` tokens or `@<P>%` of the request's
///                 full context (e.g. `sink:s4@50%`, `h2o@256`).
/// Each implementation declares a ParamTable (key, meaning, default, range, allowed values or
/// choices); the parser validates a spec against it and its errors list the allowed keys and
/// ranges.
///
/// The canonical rule (one for every quantizer, scheme and policy; canonical_spec()): the head,
/// then every field whose value differs from its default or that the table marks `shown`, in
/// table order; a wrapper appends `(` + the canonical inner spec + `)`; a policy appends its
/// budget (Budget::to_string()). The canonical form is the key of a result row and
/// round-trips through the factories.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace kvcache {

/// The largest token count that any budget, spec field or `kv_study` option accepts (10^9
/// tokens): far beyond any model's context, and small enough that sums and products of a few
/// such counts never overflow int64.
inline constexpr int64_t kMaxTokens = 1000000000;

/// One parameter an implementation accepts in its spec string.
struct ParamDef {
  enum class Kind { kInt, kFloat, kChoice, kText };
  /// numeric and text: the key letters (`g`, `cal`); choice: a name for the group (`format`)
  std::string key;
  std::string help;     ///< one line for `--list` output
  Kind kind = Kind::kInt;
  double default_value = 0;  ///< numeric default (ignored for choices)
  double min_value = 0;      ///< inclusive range for numeric params
  double max_value = 0;
  std::vector<std::string> choices;  ///< choice: allowed bare words; choices[0] is the default
  /// Numeric: the only values accepted, when not empty (e.g. bit widths {2, 3, 4, 8}); each
  /// lies in [min_value, max_value]. Empty: every value of the range (an integer for kInt).
  std::vector<double> allowed = {};
  /// The canonical form prints this field even at its default (KIVI's four fields, which
  /// papers always name; fp8's format).
  bool shown = false;
};

/// The parameter table of one registered implementation.
struct ParamTable {
  std::string head;  ///< e.g. "int4"
  std::string help;  ///< one-line description incl. paper / arXiv id where applicable
  std::vector<ParamDef> params;
};

/// A spec string parsed and validated against a ParamTable. Every param has a value
/// (explicit or default).
class ParsedSpec {
 public:
  /// Parses `text` (without any `@budget` suffix) against `table`.
  /// @throws InvalidArgument naming the bad field and listing allowed keys/ranges.
  static ParsedSpec parse(const std::string& text, const ParamTable& table);

  const std::string& head() const { return head_; }
  /// The text as written (for error messages in the user's words).
  const std::string& text() const { return text_; }
  /// Value of numeric param `key`. @throws InternalError if `key` is not numeric in the table.
  double num(const std::string& key) const;
  int64_t integer(const std::string& key) const { return static_cast<int64_t>(num(key)); }
  /// Selected word of choice param `key`.
  const std::string& choice(const std::string& key) const;
  /// Value of text param `key` ("" when not given: a text param's default is empty).
  /// @throws InternalError if `key` is not a text param of the table.
  const std::string& str(const std::string& key) const;
  /// True if the param was given explicitly in the spec string.
  bool is_set(const std::string& key) const;
  /// Canonical text (the rule of canonical_spec()): head, then the non-default and `shown`
  /// fields in table order.
  std::string canonical() const;

 private:
  const ParamTable* table_ = nullptr;
  std::string head_;
  std::string text_;
  std::map<std::string, double> nums_;
  std::map<std::string, std::string> choices_;
  std::map<std::string, bool> set_;
};

/// The canonical rule, applied to values: `table.head`, then, in table order, every param
/// whose value (`nums` for numeric params, `choices` for choice and text params; a param
/// missing from both maps has its default) differs from its default or that is `shown`
/// (a text param prints as `key=text`, and only when non-empty). Every
/// `spec()` of the library is this function of its parameters.
/// @throws InternalError if a value names no param of the table.
std::string canonical_spec(const ParamTable& table, const std::map<std::string, double>& nums,
                           const std::map<std::string, std::string>& choices);

/// Splits `text` at ':' into head and fields. @throws InvalidArgument on empty parts.
std::vector<std::string> split_spec(const std::string& text);

/// The head of any spec: the text before the first ':', '(', '@' or '+' ("had" of
/// "had:k(int4)", "sink" of "sink:s4@50%").
std::string spec_head(const std::string& text);

/// A wrapper spec `outer(inner)`, e.g. outer "had:k", inner "kivi:k2:v2:g32:r128".
struct WrappedSpec {
  std::string outer;  ///< head and fields, without the parentheses
  std::string inner;  ///< the wrapped spec
};

/// Splits `head(:field)*(inner)`; std::nullopt when `text` has no '('.
/// @throws InvalidArgument if the parentheses do not balance, the inner spec is empty, or
///         text follows the closing ')'.
std::optional<WrappedSpec> split_wrapper(const std::string& text);

/// A token budget of an eviction policy: absolute tokens or a fraction of the
/// request's full context.
struct Budget {
  enum class Kind { kNone, kTokens, kFraction };
  Kind kind = Kind::kNone;
  double value = 0;  ///< tokens (kTokens) or fraction in (0, 1] (kFraction)

  /// Parses "256" or "50%". @throws InvalidArgument if malformed, not an integer in
  /// [1, kMaxTokens] tokens, or not in [100/kMaxTokens, 100]% (a smaller percentage keeps less
  /// than one token of every context the cache accepts).
  static Budget parse(const std::string& text);
  /// Resolves to tokens for a request of `context_tokens` tokens: tokens, or
  /// floor(fraction * context). @throws CapacityError if the result is < 1 token.
  int64_t resolve(int64_t context_tokens) const;
  /// "" (none), "@256" or "@50%".
  std::string to_string() const;
};

/// Splits "head:fields@budget" into ("head:fields", budget).
std::pair<std::string, Budget> split_budget(const std::string& text);

/// Parses the decimal integer `text` (an optional '-' and digits only: no blanks, '+', hex or
/// exponent) and checks that it lies in [min_value, max_value]. `what` names it in errors, as
/// the user wrote it (e.g. "--context", "shard '9/4': i"); empty: the message starts with the value.
/// @throws InvalidArgument "<what> = '<text>' is not an integer (...)" or
///         "<what> = <text> is out of range [min, max]" (also for values beyond int64).
int64_t parse_integer(const std::string& text, const std::string& what, int64_t min_value, int64_t max_value);

/// Formats a ParamTable as help text (one line per param with default and range).
std::string describe(const ParamTable& table);

}  // namespace kvcache
