// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file tokenizer_impl.h
/// State of kvcache::Tokenizer and its pipeline steps (private to libkvcache).

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvcache/model/tokenizer.h"
#include "model/bpe.h"
#include "model/regex.h"

namespace kvcache::tok {

/// One normalizer of the HF pipeline.
struct NormStep {
  enum class Kind { kNFC, kNFD, kPrepend, kReplace, kStrip };
  Kind kind = Kind::kNFC;
  std::string text;                    // kPrepend: prefix; kReplace: literal pattern
  std::string content;                 // kReplace: replacement
  std::shared_ptr<const Regex> regex;  // kReplace with a Regex pattern
  bool left = false, right = false;    // kStrip
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
enum class PrependScheme { kAlways, kFirst, kNever };

/// One pre-tokenizer of the HF pipeline.
struct PreTokStep {
  enum class Kind { kSplit, kByteLevel, kMetaspace };
  Kind kind = Kind::kSplit;
  std::shared_ptr<const Regex> regex;  // kSplit; kByteLevel when use_regex (GPT-2 pattern)
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;        // kByteLevel
  std::string replacement = "\u2581";   // kMetaspace
  PrependScheme scheme = PrependScheme::kAlways;
  bool split = true;                    // kMetaspace: split before each replacement char
};

/// One decoder of the HF pipeline (each maps a list of token strings to a new list).
struct DecStep {
  enum class Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace };
  Kind kind = Kind::kFuse;
  std::string pattern, content;         // kReplace (literal); kStrip: content (one char)
  size_t start = 0, stop = 0;           // kStrip
  std::string replacement = "\u2581";   // kMetaspace
  PrependScheme scheme = PrependScheme::kAlways;
};

/// GPT-2 bytes_to_unicode: byte -> UTF-8 of its printable stand-in, and back.
struct ByteLevelTables {
  std::array<std::string, 256> byte_to_utf8;
  std::unordered_map<char32_t, uint8_t> char_to_byte;
  static const ByteLevelTables& get();
};

/// The GPT-2 ByteLevel pre-tokenizer regex (use_regex = true).
inline constexpr const char* kGpt2SplitRegex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Pipeline steps (tokenizer_pipeline.cpp).
std::string apply_normalizers(const std::vector<NormStep>& steps, std::string s);
/// Pre-tokenizes one normalised segment. `at_text_start`: the segment starts at offset 0 of
/// the input (Metaspace prepend_scheme "first").
std::vector<std::string> apply_pretokenizers(const std::vector<PreTokStep>& steps,
                                             std::string segment, bool at_text_start);
std::vector<std::string> apply_decoders(const std::vector<DecStep>& steps,
                                        std::vector<std::string> tokens);

}  // namespace kvcache::tok

namespace kvcache {

struct Tokenizer::Impl {
  std::string source;  // file or "tokenizer.json", for messages
  std::vector<tok::NormStep> normalizers;
  std::vector<tok::PreTokStep> pretokenizers;
  std::unique_ptr<tok::BpeModel> bpe;
  bool has_decoder = false;  // HF joins tokens with " " when there is no decoder
  std::vector<tok::DecStep> decoders;
  std::vector<int64_t> prefix, suffix;  // post-processor
  std::optional<int64_t> bos, eos;
  TokenizerKind kind = TokenizerKind::kOtherBpe;

  std::vector<AddedToken> added;  // sorted by id
  std::unordered_map<std::string, size_t> added_by_content;
  std::array<std::vector<size_t>, 256> added_by_first_byte;  // longest first

  std::vector<std::string> id_to_token;  // "" for unassigned ids
  std::vector<uint8_t> id_state;         // 0 unassigned, 1 vocab, 2 added, 3 special added

  /// Rebuilds added-token indexes and the id tables from `bpe` and `added`.
  void finalize();
  void encode_segment(std::string_view segment, bool at_text_start,
                      std::vector<int64_t>& out) const;
};

}  // namespace kvcache
