// SPDX-License-Identifier: Apache-2.0
// Building a Tokenizer from tokenizer.json / vocab.json + merges.txt / tokenizer_config.json.
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kvcache/error.h"
#include "kvcache/model/tokenizer.h"
#include "model/tokenizer_impl.h"
#include "model/unicode.h"

namespace kvcache {
namespace {

using json = nlohmann::json;
using tok::DecStep;
using tok::NormStep;
using tok::PrependScheme;
using tok::PreTokStep;
using tok::Regex;
using tok::SplitBehavior;

/// Largest id accepted from a file (guards against absurd allocations from corrupt input).
constexpr int64_t kMaxTokenId = int64_t{1} << 26;

[[noreturn]] void fail(const std::string& where, const std::string& field, const std::string& what) {
  throw InvalidArgument(detail::str_cat(where, ": ", field, ": ", what));
}

json parse_json(const std::string& text, const std::string& where) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw InvalidArgument(detail::str_cat(where, ": malformed JSON: ", e.what()));
  }
}

std::string read_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  KV_CHECK_ARG(in.good(), "cannot open ", what, " '", path, "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  KV_CHECK_ARG(!in.bad(), "cannot read ", what, " '", path, "'");
  return ss.str();
}

bool file_exists(const std::string& path) { return std::ifstream(path).good(); }

/// Typed field access with messages naming the file and the JSON path.
class Reader {
 public:
  explicit Reader(std::string where) : where_(std::move(where)) {}
  const std::string& where() const { return where_; }

  /// Null when absent or JSON null.
  static const json* find(const json& obj, const char* key) {
    if (!obj.is_object()) return nullptr;
    const auto it = obj.find(key);
    return (it == obj.end() || it->is_null()) ? nullptr : &*it;
  }
  const json& require(const json& obj, const char* key, const std::string& path) const {
    const json* v = find(obj, key);
    if (v == nullptr) fail(where_, path + "." + key, "missing");
    return *v;
  }
  std::string string(const json& obj, const char* key, const std::string& path,
                     const std::string& fallback = "", bool required = false) const {
    const json* v = required ? &require(obj, key, path) : find(obj, key);
    if (v == nullptr) return fallback;
    if (!v->is_string()) fail(where_, path + "." + key, "expected a string, got " + v->dump());
    return v->get<std::string>();
  }
  bool boolean(const json& obj, const char* key, const std::string& path, bool fallback) const {
    const json* v = find(obj, key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) fail(where_, path + "." + key, "expected true/false, got " + v->dump());
    return v->get<bool>();
  }
  int64_t integer(const json& obj, const char* key, const std::string& path, int64_t fallback,
                  bool required = false) const {
    const json* v = required ? &require(obj, key, path) : find(obj, key);
    if (v == nullptr) return fallback;
    if (!v->is_number_integer()) fail(where_, path + "." + key, "expected an integer, got " + v->dump());
    return v->get<int64_t>();
  }
  int64_t token_id(const json& v, const std::string& path) const {
    if (!v.is_number_integer()) fail(where_, path, "expected an integer id, got " + v.dump());
    const auto id = v.get<int64_t>();
    if (id < 0 || id >= kMaxTokenId) {
      fail(where_, path, detail::str_cat("id ", id, " is out of range [0, ", kMaxTokenId, ")"));
    }
    return id;
  }

 private:
  std::string where_;
};

std::string one_char(const Reader& r, const std::string& s, const std::string& path) {
  if (unicode::find_invalid_utf8(s) != std::string::npos || unicode::decode_utf8(s).size() != 1) {
    fail(r.where(), path, "expected a single character, got '" + s + "'");
  }
  return s;
}

/// {"String": s} or {"Regex": r} -> (literal text or compiled regex).
std::shared_ptr<const Regex> pattern_regex(const Reader& r, const json& pattern,
                                           const std::string& path, std::string* literal) {
  if (const json* s = Reader::find(pattern, "String")) {
    if (!s->is_string()) fail(r.where(), path + ".String", "expected a string");
    if (literal != nullptr) {
      *literal = s->get<std::string>();
      return nullptr;
    }
    return std::make_shared<const Regex>(s->get<std::string>(), Regex::Syntax::kLiteral);
  }
  if (const json* re = Reader::find(pattern, "Regex")) {
    if (!re->is_string()) fail(r.where(), path + ".Regex", "expected a string");
    try {
      return std::make_shared<const Regex>(re->get<std::string>(), Regex::Syntax::kPattern);
    } catch (const InvalidArgument& e) {
      fail(r.where(), path + ".Regex", e.what());
    }
  }
  fail(r.where(), path, "expected {\"String\": ...} or {\"Regex\": ...}, got " + pattern.dump());
}

PrependScheme prepend_scheme(const Reader& r, const json& obj, const std::string& path) {
  if (const json* s = Reader::find(obj, "prepend_scheme")) {
    const std::string v = s->is_string() ? s->get<std::string>() : s->dump();
    if (v == "always") return PrependScheme::kAlways;
    if (v == "first") return PrependScheme::kFirst;
    if (v == "never") return PrependScheme::kNever;
    fail(r.where(), path + ".prepend_scheme", "unknown value '" + v + "' (expected always, first, never)");
  }
  return r.boolean(obj, "add_prefix_space", path, true) ? PrependScheme::kAlways : PrependScheme::kNever;
}

void parse_normalizer(const Reader& r, const json& n, const std::string& path, std::vector<NormStep>& out) {
  const std::string type = r.string(n, "type", path, "", true);
  if (type == "Sequence") {
    const json& list = r.require(n, "normalizers", path);
    if (!list.is_array()) fail(r.where(), path + ".normalizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_normalizer(r, list[i], detail::str_cat(path, ".normalizers[", i, "]"), out);
    }
    return;
  }
  NormStep step;
  if (type == "NFC") {
    step.kind = NormStep::Kind::kNFC;
  } else if (type == "NFD") {
    step.kind = NormStep::Kind::kNFD;
  } else if (type == "Prepend") {
    step.kind = NormStep::Kind::kPrepend;
    step.text = r.string(n, "prepend", path, "", true);
  } else if (type == "Replace") {
    step.kind = NormStep::Kind::kReplace;
    const json& pattern = r.require(n, "pattern", path);
    if (Reader::find(pattern, "String") != nullptr) {
      pattern_regex(r, pattern, path + ".pattern", &step.text);
      if (step.text.empty()) fail(r.where(), path + ".pattern.String", "empty pattern");
    } else {
      step.regex = pattern_regex(r, pattern, path + ".pattern", nullptr);
    }
    step.content = r.string(n, "content", path, "", true);
  } else if (type == "Strip") {
    step.kind = NormStep::Kind::kStrip;
    step.left = r.boolean(n, "strip_left", path, true);
    step.right = r.boolean(n, "strip_right", path, true);
  } else {
    fail(r.where(), path + ".type",
         "unsupported normalizer '" + type + "' (supported: NFC, NFD, Prepend, Replace, Strip, Sequence)");
  }
  out.push_back(std::move(step));
}

SplitBehavior split_behavior(const Reader& r, const std::string& v, const std::string& path) {
  if (v == "Removed") return SplitBehavior::kRemoved;
  if (v == "Isolated") return SplitBehavior::kIsolated;
  if (v == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (v == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (v == "Contiguous") return SplitBehavior::kContiguous;
  fail(r.where(), path, "unknown split behavior '" + v +
                            "' (expected Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)");
}

void parse_pretokenizer(const Reader& r, const json& p, const std::string& path, std::vector<PreTokStep>& out) {
  const std::string type = r.string(p, "type", path, "", true);
  PreTokStep step;
  if (type == "Sequence") {
    const json& list = r.require(p, "pretokenizers", path);
    if (!list.is_array()) fail(r.where(), path + ".pretokenizers", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_pretokenizer(r, list[i], detail::str_cat(path, ".pretokenizers[", i, "]"), out);
    }
    return;
  }
  if (type == "Split") {
    step.kind = PreTokStep::Kind::kSplit;
    step.regex = pattern_regex(r, r.require(p, "pattern", path), path + ".pattern", nullptr);
    step.behavior = split_behavior(r, r.string(p, "behavior", path, "", true), path + ".behavior");
    step.invert = r.boolean(p, "invert", path, false);
  } else if (type == "ByteLevel") {
    step.kind = PreTokStep::Kind::kByteLevel;
    step.add_prefix_space = r.boolean(p, "add_prefix_space", path, true);
    if (r.boolean(p, "use_regex", path, true)) {
      step.regex = std::make_shared<const Regex>(tok::kGpt2SplitRegex, Regex::Syntax::kPattern);
    }
  } else if (type == "Metaspace") {
    step.kind = PreTokStep::Kind::kMetaspace;
    step.replacement = one_char(r, r.string(p, "replacement", path, "\u2581"), path + ".replacement");
    step.scheme = prepend_scheme(r, p, path);
    step.split = r.boolean(p, "split", path, true);
  } else if (type == "Digits") {
    step.kind = PreTokStep::Kind::kSplit;
    const bool individual = r.boolean(p, "individual_digits", path, false);
    step.regex = std::make_shared<const Regex>(individual ? "\\p{N}" : "\\p{N}+", Regex::Syntax::kPattern);
    step.behavior = SplitBehavior::kIsolated;
  } else if (type == "Whitespace") {
    step.kind = PreTokStep::Kind::kSplit;
    step.regex = std::make_shared<const Regex>("\\w+|[^\\w\\s]+", Regex::Syntax::kPattern);
    step.behavior = SplitBehavior::kRemoved;
    step.invert = true;
  } else if (type == "WhitespaceSplit") {
    step.kind = PreTokStep::Kind::kSplit;
    step.regex = std::make_shared<const Regex>("\\s+", Regex::Syntax::kPattern);
    step.behavior = SplitBehavior::kRemoved;
  } else {
    fail(r.where(), path + ".type",
         "unsupported pre-tokenizer '" + type +
             "' (supported: Split, ByteLevel, Metaspace, Digits, Whitespace, WhitespaceSplit, Sequence)");
  }
  out.push_back(std::move(step));
}

void parse_decoder(const Reader& r, const json& d, const std::string& path, std::vector<DecStep>& out) {
  const std::string type = r.string(d, "type", path, "", true);
  DecStep step;
  if (type == "Sequence") {
    const json& list = r.require(d, "decoders", path);
    if (!list.is_array()) fail(r.where(), path + ".decoders", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_decoder(r, list[i], detail::str_cat(path, ".decoders[", i, "]"), out);
    }
    return;
  }
  if (type == "ByteLevel") {
    step.kind = DecStep::Kind::kByteLevel;
  } else if (type == "Replace") {
    step.kind = DecStep::Kind::kReplace;
    std::string literal;
    const json& pattern = r.require(d, "pattern", path);
    if (Reader::find(pattern, "String") == nullptr) {
      fail(r.where(), path + ".pattern", "only {\"String\": ...} patterns are supported in decoders");
    }
    pattern_regex(r, pattern, path + ".pattern", &literal);
    if (literal.empty()) fail(r.where(), path + ".pattern.String", "empty pattern");
    step.pattern = literal;
    step.content = r.string(d, "content", path, "", true);
  } else if (type == "ByteFallback") {
    step.kind = DecStep::Kind::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecStep::Kind::kFuse;
  } else if (type == "Strip") {
    step.kind = DecStep::Kind::kStrip;
    step.content = one_char(r, r.string(d, "content", path, " "), path + ".content");
    const int64_t start = r.integer(d, "start", path, 0), stop = r.integer(d, "stop", path, 0);
    if (start < 0 || stop < 0) fail(r.where(), path, "start/stop must be >= 0");
    step.start = static_cast<size_t>(start);
    step.stop = static_cast<size_t>(stop);
  } else if (type == "Metaspace") {
    step.kind = DecStep::Kind::kMetaspace;
    step.replacement = one_char(r, r.string(d, "replacement", path, "\u2581"), path + ".replacement");
    step.scheme = prepend_scheme(r, d, path);
  } else {
    fail(r.where(), path + ".type",
         "unsupported decoder '" + type +
             "' (supported: ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence)");
  }
  out.push_back(std::move(step));
}

/// Resolves a TemplateProcessing / Roberta / Bert post-processor into prefix and suffix ids.
void parse_post_processor(const Reader& r, const json& p, const std::string& path,
                          std::vector<int64_t>& prefix, std::vector<int64_t>& suffix) {
  const std::string type = r.string(p, "type", path, "", true);
  if (type == "Sequence") {
    const json& list = r.require(p, "processors", path);
    if (!list.is_array()) fail(r.where(), path + ".processors", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      parse_post_processor(r, list[i], detail::str_cat(path, ".processors[", i, "]"), prefix, suffix);
    }
    return;
  }
  if (type == "ByteLevel") return;  // only adjusts offsets
  if (type == "TemplateProcessing") {
    const json& single = r.require(p, "single", path);
    if (!single.is_array()) fail(r.where(), path + ".single", "expected an array");
    const json* specials = Reader::find(p, "special_tokens");
    bool seen_sequence = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string ipath = detail::str_cat(path, ".single[", i, "]");
      if (Reader::find(single[i], "Sequence") != nullptr) {
        seen_sequence = true;
        continue;
      }
      const json* sp = Reader::find(single[i], "SpecialToken");
      if (sp == nullptr) fail(r.where(), ipath, "expected SpecialToken or Sequence, got " + single[i].dump());
      const std::string name = r.string(*sp, "id", ipath + ".SpecialToken", "", true);
      const json* entry = specials != nullptr ? Reader::find(*specials, name.c_str()) : nullptr;
      if (entry == nullptr) fail(r.where(), path + ".special_tokens", "no entry for '" + name + "'");
      const json& ids = r.require(*entry, "ids", path + ".special_tokens." + name);
      if (!ids.is_array()) fail(r.where(), path + ".special_tokens." + name + ".ids", "expected an array");
      for (const auto& id : ids) {
        (seen_sequence ? suffix : prefix).push_back(r.token_id(id, path + ".special_tokens." + name + ".ids"));
      }
    }
    return;
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    const json& cls = r.require(p, "cls", path);
    const json& sep = r.require(p, "sep", path);
    if (!cls.is_array() || cls.size() != 2 || !sep.is_array() || sep.size() != 2) {
      fail(r.where(), path, "cls/sep must be [token, id]");
    }
    prefix.push_back(r.token_id(cls[1], path + ".cls[1]"));
    suffix.push_back(r.token_id(sep[1], path + ".sep[1]"));
    return;
  }
  fail(r.where(), path + ".type",
       "unsupported post-processor '" + type +
           "' (supported: TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing, Sequence)");
}

AddedToken parse_added_token(const Reader& r, const json& t, const std::string& path, int64_t id) {
  if (!t.is_object()) fail(r.where(), path, "expected an object, got " + t.dump());
  AddedToken a;
  a.id = id;
  a.content = r.string(t, "content", path, "", true);
  if (a.content.empty()) fail(r.where(), path + ".content", "empty added token");
  if (unicode::find_invalid_utf8(a.content) != std::string::npos) {
    fail(r.where(), path + ".content", "not valid UTF-8");
  }
  a.special = r.boolean(t, "special", path, false);
  a.lstrip = r.boolean(t, "lstrip", path, false);
  a.rstrip = r.boolean(t, "rstrip", path, false);
  a.single_word = r.boolean(t, "single_word", path, false);
  return a;
}

std::unordered_map<std::string, int32_t> parse_vocab(const Reader& r, const json& v, const std::string& path) {
  if (!v.is_object()) fail(r.where(), path, "expected an object {token: id}");
  std::unordered_map<std::string, int32_t> vocab;
  vocab.reserve(v.size());
  for (auto it = v.begin(); it != v.end(); ++it) {
    const int64_t id = r.token_id(it.value(), path + "[\"" + it.key() + "\"]");
    if (unicode::find_invalid_utf8(it.key()) != std::string::npos) {
      fail(r.where(), path, "token with id " + std::to_string(id) + " is not valid UTF-8");
    }
    vocab.emplace(it.key(), static_cast<int32_t>(id));
  }
  if (vocab.empty()) fail(r.where(), path, "empty vocabulary");
  return vocab;
}

std::pair<std::string, std::string> split_merge(const Reader& r, const std::string& line,
                                                const std::string& path) {
  const size_t sp = line.find(' ');
  if (sp == std::string::npos || sp == 0 || sp + 1 >= line.size() ||
      line.find(' ', sp + 1) != std::string::npos) {
    fail(r.where(), path, "expected 'left right', got '" + line + "'");
  }
  return {line.substr(0, sp), line.substr(sp + 1)};
}

TokenizerKind classify(const Tokenizer::Impl& impl) {
  for (const auto& p : impl.pretokenizers) {
    if (p.kind == PreTokStep::Kind::kByteLevel) return TokenizerKind::kByteLevelBpe;
  }
  for (const auto& d : impl.decoders) {
    if (d.kind == DecStep::Kind::kByteLevel) return TokenizerKind::kByteLevelBpe;
  }
  for (const auto& p : impl.pretokenizers) {
    if (p.kind == PreTokStep::Kind::kMetaspace) return TokenizerKind::kSentencePieceBpe;
  }
  for (const auto& n : impl.normalizers) {
    if ((n.kind == NormStep::Kind::kPrepend && n.text == "\u2581") ||
        (n.kind == NormStep::Kind::kReplace && n.content == "\u2581")) {
      return TokenizerKind::kSentencePieceBpe;
    }
  }
  return TokenizerKind::kOtherBpe;
}

std::shared_ptr<Tokenizer::Impl> impl_from_json(const std::string& text, const std::string& where) {
  const Reader r(where);
  const json root = parse_json(text, where);
  if (!root.is_object()) fail(where, "(root)", "expected a JSON object");
  auto impl = std::make_shared<Tokenizer::Impl>();
  impl->source = where;

  const json& model = r.require(root, "model", "(root)");
  const std::string type = r.string(model, "type", "model", "BPE");
  if (type != "BPE") {
    fail(where, "model.type", "unsupported tokenizer model '" + type + "' (supported: BPE)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!r.string(model, key, "model").empty()) {
      fail(where, std::string("model.") + key, "non-empty values are not supported");
    }
  }
  auto vocab = parse_vocab(r, r.require(model, "vocab", "model"), "model.vocab");
  std::vector<std::pair<std::string, std::string>> merges;
  if (const json* m = Reader::find(model, "merges")) {
    if (!m->is_array()) fail(where, "model.merges", "expected an array");
    merges.reserve(m->size());
    for (size_t i = 0; i < m->size(); ++i) {
      const json& e = (*m)[i];
      const std::string path = detail::str_cat("model.merges[", i, "]");
      if (e.is_string()) {
        merges.push_back(split_merge(r, e.get<std::string>(), path));
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        merges.emplace_back(e[0].get<std::string>(), e[1].get<std::string>());
      } else {
        fail(where, path, "expected \"left right\" or [left, right], got " + e.dump());
      }
    }
  }
  tok::BpeOptions opts;
  const std::string unk = r.string(model, "unk_token", "model");
  if (!unk.empty()) opts.unk_token = unk;
  opts.byte_fallback = r.boolean(model, "byte_fallback", "model", false);
  opts.fuse_unk = r.boolean(model, "fuse_unk", "model", false);
  opts.ignore_merges = r.boolean(model, "ignore_merges", "model", false);
  impl->bpe = std::make_unique<tok::BpeModel>(std::move(vocab), merges, opts, where);

  if (const json* added = Reader::find(root, "added_tokens")) {
    if (!added->is_array()) fail(where, "added_tokens", "expected an array");
    for (size_t i = 0; i < added->size(); ++i) {
      const std::string path = detail::str_cat("added_tokens[", i, "]");
      const int64_t id = r.token_id(r.require((*added)[i], "id", path), path + ".id");
      impl->added.push_back(parse_added_token(r, (*added)[i], path, id));
    }
  }
  if (const json* n = Reader::find(root, "normalizer")) parse_normalizer(r, *n, "normalizer", impl->normalizers);
  if (const json* p = Reader::find(root, "pre_tokenizer")) {
    parse_pretokenizer(r, *p, "pre_tokenizer", impl->pretokenizers);
  }
  if (const json* d = Reader::find(root, "decoder")) {
    impl->has_decoder = true;
    parse_decoder(r, *d, "decoder", impl->decoders);
  }
  if (const json* p = Reader::find(root, "post_processor")) {
    parse_post_processor(r, *p, "post_processor", impl->prefix, impl->suffix);
  }
  if (!impl->prefix.empty()) impl->bos = impl->prefix.front();
  impl->kind = classify(*impl);
  impl->finalize();
  return impl;
}

std::shared_ptr<Tokenizer::Impl> impl_from_vocab_merges(const std::string& vocab_text,
                                                        const std::string& merges_text,
                                                        const std::vector<AddedToken>& added,
                                                        const std::string& split_regex) {
  const Reader rv("vocab.json");
  auto vocab = parse_vocab(rv, parse_json(vocab_text, "vocab.json"), "(root)");
  const Reader rm("merges.txt");
  std::vector<std::pair<std::string, std::string>> merges;
  std::istringstream in(merges_text);
  std::string line;
  for (size_t lineno = 1; std::getline(in, line); ++lineno) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (lineno == 1 && line.rfind("#version", 0) == 0)) continue;
    merges.push_back(split_merge(rm, line, detail::str_cat("line ", lineno)));
  }
  auto impl = std::make_shared<Tokenizer::Impl>();
  impl->source = "vocab.json + merges.txt";
  impl->bpe = std::make_unique<tok::BpeModel>(std::move(vocab), merges, tok::BpeOptions{}, "merges.txt");
  impl->normalizers.push_back(NormStep{});  // NFC
  PreTokStep split;
  split.kind = PreTokStep::Kind::kSplit;
  split.regex = std::make_shared<const Regex>(split_regex, Regex::Syntax::kPattern);
  split.behavior = SplitBehavior::kIsolated;
  impl->pretokenizers.push_back(split);
  PreTokStep bl;
  bl.kind = PreTokStep::Kind::kByteLevel;
  bl.add_prefix_space = false;
  impl->pretokenizers.push_back(bl);
  impl->has_decoder = true;
  DecStep dec;
  dec.kind = DecStep::Kind::kByteLevel;
  impl->decoders.push_back(dec);
  for (const auto& a : added) {
    KV_CHECK_ARG(a.id >= 0 && a.id < kMaxTokenId, "Tokenizer::from_vocab_merges: added token '",
                 a.content, "' has id ", a.id, ", expected [0, ", kMaxTokenId, ")");
    KV_CHECK_ARG(!a.content.empty() && unicode::find_invalid_utf8(a.content) == std::string::npos,
                 "Tokenizer::from_vocab_merges: added token with id ", a.id,
                 " must be non-empty valid UTF-8");
    impl->added.push_back(a);
  }
  impl->kind = TokenizerKind::kByteLevelBpe;
  impl->finalize();
  return impl;
}

/// `bos_token`/`eos_token` of tokenizer_config.json: a string, {"content": ...} or null.
std::optional<std::string> config_token_name(const Reader& r, const json& cfg, const char* key) {
  const json* v = Reader::find(cfg, key);
  if (v == nullptr) return std::nullopt;
  if (v->is_string()) return v->get<std::string>();
  if (v->is_object()) return r.string(*v, "content", key, "", true);
  fail(r.where(), key, "expected a string, an object with \"content\" or null, got " + v->dump());
}

void apply_config(Tokenizer::Impl& impl, const std::string& text) {
  const Reader r("tokenizer_config.json");
  const json cfg = parse_json(text, r.where());
  if (!cfg.is_object()) fail(r.where(), "(root)", "expected a JSON object");
  if (const json* dec = Reader::find(cfg, "added_tokens_decoder")) {
    if (!dec->is_object()) fail(r.where(), "added_tokens_decoder", "expected an object");
    for (auto it = dec->begin(); it != dec->end(); ++it) {
      const std::string path = "added_tokens_decoder." + it.key();
      int64_t id = -1;
      try {
        size_t used = 0;
        id = std::stoll(it.key(), &used);
        if (used != it.key().size()) id = -1;
      } catch (const std::exception&) {
        id = -1;
      }
      if (id < 0 || id >= kMaxTokenId) fail(r.where(), path, "key is not a token id");
      bool known = false;
      for (const auto& a : impl.added) known = known || a.id == id;
      if (!known) impl.added.push_back(parse_added_token(r, it.value(), path, id));
    }
    impl.finalize();
  }
  auto resolve = [&](const char* key) -> std::optional<int64_t> {
    const auto name = config_token_name(r, cfg, key);
    if (!name) return std::nullopt;
    const auto it = impl.added_by_content.find(*name);
    if (it != impl.added_by_content.end()) return impl.added[it->second].id;
    const auto v = impl.bpe->vocab().find(*name);
    if (v == impl.bpe->vocab().end()) fail(r.where(), key, "token '" + *name + "' is not in the vocabulary");
    return v->second;
  };
  if (auto bos = resolve("bos_token")) impl.bos = bos;
  if (auto eos = resolve("eos_token")) impl.eos = eos;
  const json* add_bos = Reader::find(cfg, "add_bos_token");
  const json* add_eos = Reader::find(cfg, "add_eos_token");
  if (add_bos != nullptr || add_eos != nullptr) {
    const bool want_bos = r.boolean(cfg, "add_bos_token", "(root)", false);
    const bool want_eos = r.boolean(cfg, "add_eos_token", "(root)", false);
    if (want_bos && !impl.bos) fail(r.where(), "add_bos_token", "true but no bos_token is defined");
    if (want_eos && !impl.eos) fail(r.where(), "add_eos_token", "true but no eos_token is defined");
    impl.prefix.clear();
    impl.suffix.clear();
    if (want_bos) impl.prefix.push_back(*impl.bos);
    if (want_eos) impl.suffix.push_back(*impl.eos);
  }
}

}  // namespace

Tokenizer Tokenizer::from_json(const std::string& tokenizer_json_text) {
  return Tokenizer(impl_from_json(tokenizer_json_text, "tokenizer.json"));
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  return Tokenizer(impl_from_json(read_file(path, "tokenizer file"), path));
}

Tokenizer Tokenizer::from_vocab_merges(const std::string& vocab_json_text, const std::string& merges_txt_text,
                                       const std::vector<AddedToken>& added, const std::string& split_regex) {
  return Tokenizer(impl_from_vocab_merges(vocab_json_text, merges_txt_text, added, split_regex));
}

Tokenizer Tokenizer::from_texts(const TokenizerFiles& files) {
  std::shared_ptr<Impl> impl;
  if (!files.tokenizer_json.empty()) {
    impl = impl_from_json(files.tokenizer_json, "tokenizer.json");
  } else {
    KV_CHECK_ARG(!files.vocab_json.empty() && !files.merges_txt.empty(),
                 "Tokenizer::from_texts: need tokenizer.json or both vocab.json and merges.txt (got ",
                 files.vocab_json.empty() ? "no vocab.json" : "vocab.json", ", ",
                 files.merges_txt.empty() ? "no merges.txt" : "merges.txt", ")");
    impl = impl_from_vocab_merges(files.vocab_json, files.merges_txt, {}, kQwen2SplitRegex);
  }
  if (!files.tokenizer_config_json.empty()) apply_config(*impl, files.tokenizer_config_json);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_directory(const std::string& dir) {
  TokenizerFiles files;
  const std::string base = dir.empty() || dir.back() == '/' ? dir : dir + "/";
  if (file_exists(base + "tokenizer.json")) {
    files.tokenizer_json = read_file(base + "tokenizer.json", "tokenizer file");
  } else if (file_exists(base + "vocab.json") && file_exists(base + "merges.txt")) {
    files.vocab_json = read_file(base + "vocab.json", "vocab file");
    files.merges_txt = read_file(base + "merges.txt", "merges file");
  } else {
    throw InvalidArgument(detail::str_cat("Tokenizer::from_directory: no tokenizer.json and no vocab.json + "
                                          "merges.txt in '", dir, "'"));
  }
  if (file_exists(base + "tokenizer_config.json")) {
    files.tokenizer_config_json = read_file(base + "tokenizer_config.json", "tokenizer config");
  }
  try {
    return from_texts(files);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(detail::str_cat("in '", dir, "': ", e.what()));
  }
}

}  // namespace kvcache
