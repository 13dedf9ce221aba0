// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file tokenizer.h
/// Text <-> token ids for the models libkvcache runs: BPE tokenizers read from a Hugging
/// Face `tokenizer.json` (byte-level BPE as in GPT-2/Qwen2/Llama-3, SentencePiece-style BPE
/// with byte fallback as in Llama-2/TinyStories) or from a `vocab.json` + `merges.txt` pair.
///
/// Pipeline of encode(), as in HF tokenizers:
///   1. added tokens (special or not) are matched literally in the raw text, leftmost-longest;
///   2. every text segment between them is normalised (NFC, Prepend, Replace, ...),
///   3. pre-tokenized (Split by regex, ByteLevel, Metaspace, ...),
///   4. each pre-token is encoded by BPE (lowest merge rank first);
///   5. the post-processor adds BOS/EOS ids (TemplateProcessing, tokenizer_config add_bos_token).
/// decode() maps ids to token strings and runs the decoder chain (ByteLevel, Replace,
/// ByteFallback, Fuse, Strip, Metaspace). See docs/tokenizers.md for the supported subset.
///
/// Thread safety: a Tokenizer is immutable after construction; encode/decode may run from
/// several threads at once (the pre-token cache is internally locked). Copies share state.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kvcache {

/// The Qwen2/Qwen2.5 pre-tokenizer split regex (digits split one by one), the default for
/// Tokenizer::from_vocab_merges.
inline constexpr const char* kQwen2SplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

/// A token added on top of the BPE vocabulary (HF `added_tokens`), matched literally in the
/// input before normalisation and BPE.
struct AddedToken {
  int64_t id = -1;
  std::string content;
  /// Control token (`<|im_start|>`, BOS, EOS): not matched under SpecialTokens::kIgnore and
  /// dropped by decode(ids, skip_special = true). Non-special added tokens always match.
  bool special = true;
  bool lstrip = false;       ///< a match also swallows the whitespace on its left
  bool rstrip = false;       ///< a match also swallows the whitespace on its right
  bool single_word = false;  ///< match only when not inside a word (ASCII alnum/_ or non-ASCII)
};

/// How encode() treats special added tokens written in the text.
enum class SpecialTokens {
  kParse,   ///< `<|im_start|>` in the text becomes its id (chat templates need this)
  kIgnore,  ///< special tokens are ordinary text (safe for untrusted user text)
};

/// Whether encode() applies the post-processor (BOS/EOS of the model's template).
enum class PostProcess {
  kApply,  ///< e.g. TinyStories: `<|start_story|>` (id 1) is prepended; Qwen2: nothing
  kSkip,   ///< raw ids of the text only (for continuing an already started sequence)
};

/// Flavour of the loaded tokenizer (informative).
enum class TokenizerKind {
  kByteLevelBpe,      ///< ByteLevel pre-tokenizer: GPT-2 bytes_to_unicode + BPE (Qwen2, Llama-3)
  kSentencePieceBpe,  ///< "▁" for spaces (Metaspace or Prepend+Replace), usually byte_fallback
  kOtherBpe,          ///< any other BPE pipeline
};

/// HF tokenizer files as text; an empty string means "absent".
struct TokenizerFiles {
  std::string tokenizer_json;         ///< tokenizer.json; when empty, vocab_json + merges_txt
  std::string vocab_json;             ///< vocab.json (byte-level BPE, Qwen2 split regex)
  std::string merges_txt;             ///< merges.txt ("#version" first line allowed)
  std::string tokenizer_config_json;  ///< optional: added_tokens_decoder, bos/eos_token,
                                      ///< add_bos_token/add_eos_token (override the template)
};

/// A BPE tokenizer. Ids are int64 (LibTorch's index dtype).
class Tokenizer {
 public:
  /// Parses a HF `tokenizer.json` (model type "BPE").
  /// @throws InvalidArgument on malformed JSON or an unsupported/unknown model type,
  ///         normalizer, pre-tokenizer, decoder or post-processor (message names the field
  ///         and the value).
  static Tokenizer from_json(const std::string& tokenizer_json_text);

  /// Reads and parses a `tokenizer.json` file.
  /// @throws InvalidArgument when the file cannot be read (names the path) or as from_json.
  static Tokenizer from_file(const std::string& path);

  /// Byte-level BPE from the `vocab.json` + `merges.txt` pair (GPT-2/Qwen2 style): NFC
  /// normaliser, `split_regex` (Qwen2's by default) + ByteLevel pre-tokenizer without prefix
  /// space, ByteLevel decoder, no BOS. `added` are matched before BPE (pass Qwen2's special
  /// tokens for ChatML). @throws InvalidArgument on malformed input or a merge whose tokens
  /// are missing from the vocab.
  static Tokenizer from_vocab_merges(const std::string& vocab_json_text,
                                     const std::string& merges_txt_text,
                                     const std::vector<AddedToken>& added = {},
                                     const std::string& split_regex = kQwen2SplitRegex);

  /// tokenizer.json when given, else vocab.json + merges.txt; then tokenizer_config.json:
  /// its added_tokens_decoder entries are added (when their id is not yet an added token),
  /// bos_token/eos_token set bos_id()/eos_id(), and add_bos_token/add_eos_token, when
  /// present, replace the post-processor's BOS/EOS. @throws InvalidArgument.
  static Tokenizer from_texts(const TokenizerFiles& files);

  /// from_texts() over the files of a HF checkpoint directory (tokenizer.json or
  /// vocab.json + merges.txt, and tokenizer_config.json when present).
  /// @throws InvalidArgument naming the directory when no tokenizer file is there.
  static Tokenizer from_directory(const std::string& dir);

  /// Text (valid UTF-8) -> ids. @throws InvalidArgument for invalid UTF-8 (names the byte
  /// offset).
  std::vector<int64_t> encode(const std::string& text, SpecialTokens mode = SpecialTokens::kParse,
                              PostProcess post = PostProcess::kApply) const;

  /// Ids -> text through the decoder chain. Invalid UTF-8 produced by byte tokens becomes
  /// U+FFFD (so a prefix of a multi-byte character decodes to U+FFFD).
  /// @param skip_special drop special added tokens (BOS, EOS, `<|im_end|>`).
  /// @throws InvalidArgument when an id is negative, >= vocab_size() or unassigned.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special = false) const;
  /// decode() for model output: an id that is not a token of this tokenizer (the padding rows
  /// of an embedding larger than the vocabulary, e.g. Qwen2.5's ids 151,665..151,935, which a
  /// random-weight or broken model can emit) becomes U+FFFD instead of an error; the runs of
  /// valid ids between them are decoded as by decode().
  std::string decode_lenient(const std::vector<int64_t>& ids, bool skip_special = false) const;

  /// Id of a vocabulary or added token given by its exact string (as stored in the vocab,
  /// e.g. "Ġthe" for byte-level, "▁the" for SentencePiece), or nullopt.
  std::optional<int64_t> token_to_id(const std::string& token) const;
  /// Stored string of `id`. @throws InvalidArgument when `id` is out of range/unassigned.
  std::string id_to_token(int64_t id) const;
  /// 1 + the largest assigned id (vocab and added tokens). The model's embedding may be
  /// larger (Qwen2.5: 151,936 rows for 151,665 ids).
  int64_t vocab_size() const;

  /// BOS id: tokenizer_config's bos_token, else the first special token of the
  /// post-processor template; nullopt when the model has none (Qwen2).
  std::optional<int64_t> bos_id() const;
  /// EOS id: tokenizer_config's eos_token; nullopt when unknown.
  std::optional<int64_t> eos_id() const;
  /// The added token whose content is `content`, or nullopt.
  std::optional<AddedToken> find_added_token(const std::string& content) const;
  /// All added tokens, by id.
  const std::vector<AddedToken>& added_tokens() const;
  /// True when `id` is a special added token.
  bool is_special(int64_t id) const;
  /// Ids the post-processor puts before / after the text ids.
  const std::vector<int64_t>& prefix_ids() const;
  const std::vector<int64_t>& suffix_ids() const;
  TokenizerKind kind() const;

  struct Impl;  ///< private, defined in src/model/tokenizer_impl.h

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

}  // namespace kvcache
