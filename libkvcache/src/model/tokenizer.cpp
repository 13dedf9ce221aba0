// SPDX-License-Identifier: Apache-2.0
#include "kvcache/model/tokenizer.h"

#include <algorithm>

#include "kvcache/error.h"
#include "model/tokenizer_impl.h"
#include "model/unicode.h"

namespace kvcache {
namespace {

bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

/// Code point starting at byte `i` of valid UTF-8 `s`.
char32_t cp_at(const std::string& s, size_t i) {
  const size_t len = std::min(unicode::utf8_len(static_cast<unsigned char>(s[i])), s.size() - i);
  return unicode::decode_utf8(std::string_view(s).substr(i, len)).front();
}

/// Start of the code point that ends right before byte `i`.
size_t prev_cp_start(const std::string& s, size_t i) {
  size_t j = i - 1;
  while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
  return j;
}

/// Word character for AddedToken::single_word: ASCII alphanumerics, '_' and all non-ASCII
/// code points (an approximation of HF's `\w`).
bool is_word_char(char32_t c) {
  return c >= 0x80 || c == '_' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') ||
         (c >= 'A' && c <= 'Z');
}

struct AddedMatch {
  size_t begin, end;  // byte range in the text, including stripped whitespace
  size_t index;       // into Impl::added
};

}  // namespace

void Tokenizer::Impl::finalize() {
  std::sort(added.begin(), added.end(), [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
  for (size_t i = 1; i < added.size(); ++i) {
    KV_CHECK_ARG(added[i].id != added[i - 1].id, source, ": two added tokens have id ", added[i].id, " ('",
                 added[i - 1].content, "', '", added[i].content, "')");
  }
  added_by_content.clear();
  for (auto& v : added_by_first_byte) v.clear();
  for (size_t i = 0; i < added.size(); ++i) {
    added_by_content.emplace(added[i].content, i);
    added_by_first_byte[static_cast<unsigned char>(added[i].content[0])].push_back(i);
  }
  for (auto& v : added_by_first_byte) {
    std::stable_sort(v.begin(), v.end(), [this](size_t a, size_t b) {
      return added[a].content.size() > added[b].content.size();
    });
  }
  int64_t size = 0;
  for (const auto& [token, id] : bpe->vocab()) size = std::max<int64_t>(size, int64_t{id} + 1);
  for (const auto& a : added) size = std::max(size, a.id + 1);
  id_to_token.assign(static_cast<size_t>(size), std::string());
  id_state.assign(static_cast<size_t>(size), 0);
  for (const auto& [token, id] : bpe->vocab()) {
    id_to_token[static_cast<size_t>(id)] = token;
    id_state[static_cast<size_t>(id)] = 1;
  }
  for (const auto& a : added) {
    id_to_token[static_cast<size_t>(a.id)] = a.content;
    id_state[static_cast<size_t>(a.id)] = a.special ? 3 : 2;
  }
}

void Tokenizer::Impl::encode_segment(std::string_view segment, bool at_text_start,
                                     std::vector<int64_t>& out) const {
  if (segment.empty()) return;
  std::string normalized = tok::apply_normalizers(normalizers, std::string(segment));
  for (const auto& piece : tok::apply_pretokenizers(pretokenizers, std::move(normalized), at_text_start)) {
    bpe->encode_word(piece, out);
  }
}

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

std::vector<int64_t> Tokenizer::encode(const std::string& text, SpecialTokens mode, PostProcess post) const {
  const size_t bad = unicode::find_invalid_utf8(text);
  KV_CHECK_ARG(bad == std::string::npos, "Tokenizer::encode: text is not valid UTF-8 at byte ", bad,
               " (byte value 0x", std::hex, static_cast<int>(static_cast<unsigned char>(text[bad == std::string::npos ? 0 : bad])), ")");
  const Impl& im = *impl_;

  // 1. Added tokens, leftmost-longest.
  std::vector<AddedMatch> matches;
  for (size_t i = 0; i < text.size();) {
    bool found = false;
    for (size_t idx : im.added_by_first_byte[static_cast<unsigned char>(text[i])]) {
      const AddedToken& a = im.added[idx];
      if (mode == SpecialTokens::kIgnore && a.special) continue;
      if (text.compare(i, a.content.size(), a.content) != 0) continue;
      const size_t end = i + a.content.size();
      if (a.single_word && ((i > 0 && is_word_char(cp_at(text, prev_cp_start(text, i)))) ||
                            (end < text.size() && is_word_char(cp_at(text, end))))) {
        continue;
      }
      matches.push_back({i, end, idx});
      i = end;
      found = true;
      break;
    }
    if (!found) i += unicode::utf8_len(static_cast<unsigned char>(text[i]));
  }
  // lstrip / rstrip swallow neighbouring whitespace (never across another match).
  for (size_t k = 0; k < matches.size(); ++k) {
    const AddedToken& a = im.added[matches[k].index];
    const size_t lo = k == 0 ? 0 : matches[k - 1].end;
    if (a.lstrip) {
      while (matches[k].begin > lo) {
        const size_t p = prev_cp_start(text, matches[k].begin);
        if (!is_white_space(cp_at(text, p))) break;
        matches[k].begin = p;
      }
    }
    const size_t hi = k + 1 < matches.size() ? matches[k + 1].begin : text.size();
    if (a.rstrip) {
      while (matches[k].end < hi && is_white_space(cp_at(text, matches[k].end))) {
        matches[k].end += unicode::utf8_len(static_cast<unsigned char>(text[matches[k].end]));
      }
    }
  }

  // 2-4. Segments between added tokens go through normalizer, pre-tokenizer and BPE.
  std::vector<int64_t> ids;
  ids.reserve(text.size() / 3 + 8);
  if (post == PostProcess::kApply) ids.insert(ids.end(), im.prefix.begin(), im.prefix.end());
  size_t pos = 0;
  for (const auto& m : matches) {
    if (m.begin > pos) im.encode_segment(std::string_view(text).substr(pos, m.begin - pos), pos == 0, ids);
    ids.push_back(im.added[m.index].id);
    pos = m.end;
  }
  if (pos < text.size()) im.encode_segment(std::string_view(text).substr(pos), pos == 0, ids);
  if (post == PostProcess::kApply) ids.insert(ids.end(), im.suffix.begin(), im.suffix.end());
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special) const {
  const Impl& im = *impl_;
  const auto size = static_cast<int64_t>(im.id_to_token.size());
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t id = ids[i];
    KV_CHECK_ARG(id >= 0 && id < size && im.id_state[static_cast<size_t>(id)] != 0, "Tokenizer::decode: id ", id,
                 " at position ", i, " is not a token of this tokenizer (valid ids: [0, ", size, ")",
                 (id >= 0 && id < size) ? ", this one is unassigned" : "", ")");
    if (skip_special && im.id_state[static_cast<size_t>(id)] == 3) continue;
    tokens.push_back(im.id_to_token[static_cast<size_t>(id)]);
  }
  std::string out;
  if (!im.has_decoder) {
    // HF joins the raw tokens with spaces when a tokenizer has no decoder.
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) out += ' ';
      out += tokens[i];
    }
    return out;
  }
  for (const auto& t : tok::apply_decoders(im.decoders, std::move(tokens))) out += t;
  return out;
}

std::string Tokenizer::decode_lenient(const std::vector<int64_t>& ids, bool skip_special) const {
  const Impl& im = *impl_;
  const auto size = static_cast<int64_t>(im.id_to_token.size());
  std::string out;
  std::vector<int64_t> run;
  for (const int64_t id : ids) {
    if (id >= 0 && id < size && im.id_state[static_cast<size_t>(id)] != 0) {
      run.push_back(id);
      continue;
    }
    out += decode(run, skip_special);
    out += "\xEF\xBF\xBD";  // U+FFFD
    run.clear();
  }
  return out + decode(run, skip_special);
}

std::optional<int64_t> Tokenizer::token_to_id(const std::string& token) const {
  const auto a = impl_->added_by_content.find(token);
  if (a != impl_->added_by_content.end()) return impl_->added[a->second].id;
  const auto& vocab = impl_->bpe->vocab();
  const auto it = vocab.find(token);
  if (it == vocab.end()) return std::nullopt;
  return it->second;
}

std::string Tokenizer::id_to_token(int64_t id) const {
  const auto size = static_cast<int64_t>(impl_->id_to_token.size());
  KV_CHECK_ARG(id >= 0 && id < size && impl_->id_state[static_cast<size_t>(id)] != 0,
               "Tokenizer::id_to_token: id ", id, " is not a token of this tokenizer (valid ids: [0, ", size, "))");
  return impl_->id_to_token[static_cast<size_t>(id)];
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }
std::optional<int64_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int64_t> Tokenizer::eos_id() const { return impl_->eos; }

std::optional<AddedToken> Tokenizer::find_added_token(const std::string& content) const {
  const auto it = impl_->added_by_content.find(content);
  if (it == impl_->added_by_content.end()) return std::nullopt;
  return impl_->added[it->second];
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }

bool Tokenizer::is_special(int64_t id) const {
  return id >= 0 && id < vocab_size() && impl_->id_state[static_cast<size_t>(id)] == 3;
}

const std::vector<int64_t>& Tokenizer::prefix_ids() const { return impl_->prefix; }
const std::vector<int64_t>& Tokenizer::suffix_ids() const { return impl_->suffix; }
TokenizerKind Tokenizer::kind() const { return impl_->kind; }

}  // namespace kvcache
