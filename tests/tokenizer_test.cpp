// SPDX-License-Identifier: Apache-2.0
// Tokenizer: Qwen2 byte-level BPE vs llama.cpp's vectors, TinyStories SentencePiece-style BPE
// vs its golden file, hand-built fixtures, NFC, special tokens and errors.
#include "kvcache/model/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kvcache/error.h"

namespace kvcache {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Ids = std::vector<int64_t>;

const std::string kShared = std::string(KVCACHE_SOURCE_DIR) + "/../shared/data";
const std::string kQwenDir = kShared + "/tokenizers/qwen2";
const std::string kTinyDir = kShared + "/models/tinystories-656k";

bool exists(const std::string& path) { return std::ifstream(path).good(); }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// Runs `fn`, expects InvalidArgument, and returns its message.
template <typename Fn>
std::string invalid_argument_message(Fn&& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected InvalidArgument, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected InvalidArgument, nothing was thrown";
  return "";
}

/// The 22 special tokens of Qwen2.5 (README of tokenizers/qwen2), ids 151643..151664.
std::vector<AddedToken> qwen2_added_tokens() {
  const char* names[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                         "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                         "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                         "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                         "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                         "<|repo_name|>", "<|file_sep|>"};
  std::vector<AddedToken> out;
  int64_t id = 151643;
  for (const char* n : names) {
    AddedToken t;
    t.id = id++;
    t.content = n;
    // As in Qwen2.5's tokenizer_config.json: the tool/FIM markers are not "special".
    t.special = id - 1 < 151657;
    out.push_back(t);
  }
  return out;
}

class Qwen2Tokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!exists(kQwenDir + "/vocab.json")) return;
    tok_ = std::make_unique<Tokenizer>(Tokenizer::from_vocab_merges(
        slurp(kQwenDir + "/vocab.json"), slurp(kQwenDir + "/merges.txt"), qwen2_added_tokens()));
  }
  static void TearDownTestSuite() { tok_.reset(); }
  void SetUp() override {
    if (!tok_) GTEST_SKIP() << "shared data folder absent: " << kQwenDir;
  }

  /// The 46 llama.cpp cases: .inp split on "\n__ggml_vocab_test__\n", .out one line per case.
  static void load_cases(std::vector<std::string>& texts, std::vector<Ids>& expected) {
    std::string inp = slurp(kQwenDir + "/ggml-vocab-qwen2.gguf.inp");
    const std::string sep = "\n__ggml_vocab_test__\n";
    for (size_t pos; (pos = inp.find(sep)) != std::string::npos;) {
      texts.push_back(inp.substr(0, pos));
      inp.erase(0, pos + sep.size());
    }
    std::istringstream out(slurp(kQwenDir + "/ggml-vocab-qwen2.gguf.out"));
    for (std::string line; std::getline(out, line);) {
      std::istringstream ls(line);
      Ids ids;
      for (int64_t id; ls >> id;) ids.push_back(id);
      expected.push_back(ids);
    }
  }

  static std::unique_ptr<Tokenizer> tok_;
};
std::unique_ptr<Tokenizer> Qwen2Tokenizer::tok_;

TEST_F(Qwen2Tokenizer, All46LlamaCppVectorsMatch) {
  std::vector<std::string> texts;
  std::vector<Ids> expected;
  load_cases(texts, expected);
  ASSERT_EQ(texts.size(), 46u);
  ASSERT_EQ(expected.size(), 46u);
  int matched = 0;
  for (size_t k = 0; k < texts.size(); ++k) {
    const Ids got = tok_->encode(texts[k], SpecialTokens::kIgnore);
    EXPECT_EQ(got, expected[k]) << "case " << k << ": '" << texts[k] << "'";
    matched += got == expected[k];
  }
  EXPECT_EQ(matched, 46);
}

TEST_F(Qwen2Tokenizer, DecodeRoundTripsAll46Strings) {
  std::vector<std::string> texts;
  std::vector<Ids> expected;
  load_cases(texts, expected);
  for (size_t k = 0; k < texts.size(); ++k) {
    EXPECT_EQ(tok_->decode(expected[k]), texts[k]) << "case " << k;
    EXPECT_EQ(tok_->decode(tok_->encode(texts[k])), texts[k]) << "case " << k;
  }
}

TEST_F(Qwen2Tokenizer, ChatMLPromptGives31Tokens) {
  const std::string prompt =
      "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
      "<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n";
  const Ids expected = {151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364,
                        14817, 13, 1446, 525, 264, 10950, 17847, 13, 151645, 198, 151644,
                        872, 198, 9707, 0, 151645, 198, 151644, 77091, 198};
  EXPECT_EQ(tok_->encode(prompt), expected);
  EXPECT_EQ(tok_->decode(expected), prompt);
  // skip_special drops <|im_start|>/<|im_end|> and keeps the text between them.
  EXPECT_EQ(tok_->decode({151644, 872, 198, 9707, 0, 151645}, /*skip_special=*/true), "user\nHello!");
}

TEST_F(Qwen2Tokenizer, SpecialTokensParsedOrIgnored) {
  EXPECT_THAT(tok_->encode("<|im_end|>"), ElementsAre(151645));
  // kIgnore: the same characters are plain text and go through BPE.
  const Ids as_text = tok_->encode("<|im_end|>", SpecialTokens::kIgnore);
  EXPECT_GT(as_text.size(), 1u);
  EXPECT_EQ(std::count(as_text.begin(), as_text.end(), 151645), 0);
  EXPECT_EQ(tok_->decode(as_text), "<|im_end|>");
  // Non-special added tokens (<tool_call>) are matched in both modes, as in HF.
  EXPECT_THAT(tok_->encode("<tool_call>", SpecialTokens::kIgnore), ElementsAre(151657));
  EXPECT_FALSE(tok_->is_special(151657));
  EXPECT_TRUE(tok_->is_special(151645));
  // Leftmost-longest: text around a special token is encoded separately.
  EXPECT_THAT(tok_->encode("Hello<|endoftext|>Hello"), ElementsAre(9707, 151643, 9707));
}

TEST_F(Qwen2Tokenizer, VocabLookupsAndNoBos) {
  EXPECT_EQ(tok_->vocab_size(), 151665);
  EXPECT_EQ(tok_->token_to_id("!"), 0);
  EXPECT_EQ(tok_->token_to_id("\xC4\xA0"), 220);  // "Ġ" = byte 0x20
  EXPECT_EQ(tok_->token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok_->token_to_id("no-such-token-xyz"), std::nullopt);
  EXPECT_EQ(tok_->id_to_token(9707), "Hello");
  EXPECT_EQ(tok_->id_to_token(151645), "<|im_end|>");
  ASSERT_TRUE(tok_->find_added_token("<|im_end|>").has_value());
  EXPECT_EQ(tok_->find_added_token("<|im_end|>")->id, 151645);
  EXPECT_FALSE(tok_->bos_id().has_value());
  EXPECT_TRUE(tok_->prefix_ids().empty());
  EXPECT_EQ(tok_->kind(), TokenizerKind::kByteLevelBpe);
  EXPECT_THAT(tok_->encode("Hello world"), ElementsAre(9707, 1879));
  EXPECT_TRUE(tok_->encode("").empty());
}

TEST_F(Qwen2Tokenizer, NfcComposesBeforeBpe) {
  struct Case {
    const char* decomposed;
    const char* composed;
  };
  const Case cases[] = {
      {"e\xCC\x81", "\xC3\xA9"},                         // e + U+0301 -> é (Latin)
      {"Cafe\xCC\x81 re\xCC\x81sume\xCC\x81", "Caf\xC3\xA9 r\xC3\xA9sum\xC3\xA9"},
      {"A\xCC\x8A", "\xC3\x85"},                         // A + ring -> Å
      {"\xCE\xB1\xCC\x81", "\xCE\xAC"},                  // α + acute -> ά (Greek)
      {"\xD0\xB8\xCC\x86", "\xD0\xB9"},                  // и + breve -> й (Cyrillic)
      {"\xE1\x84\x80\xE1\x85\xA1", "\xEA\xB0\x80"},      // ᄀ + ᅡ -> 가 (Hangul LV)
      {"\xE1\x84\x92\xE1\x85\xA1\xE1\x86\xAB", "\xED\x95\x9C"},  // ᄒ ᅡ ᆫ -> 한 (LVT)
      {"\xE2\x84\xAB", "\xC3\x85"},                      // U+212B ANGSTROM SIGN -> Å (singleton)
  };
  for (const auto& c : cases) {
    const Ids a = tok_->encode(c.decomposed);
    const Ids b = tok_->encode(c.composed);
    EXPECT_EQ(a, b) << c.decomposed;
    EXPECT_EQ(tok_->decode(a), c.composed);
  }
  // Canonical ordering: two marks in either order normalise to the same string.
  EXPECT_EQ(tok_->encode("a\xCC\xA3\xCC\x81"), tok_->encode("a\xCC\x81\xCC\xA3"));
}

TEST_F(Qwen2Tokenizer, DigitsAreSplitOneByOne) {
  EXPECT_THAT(tok_->encode("2024"), ElementsAre(17, 15, 17, 19));
  EXPECT_THAT(tok_->encode("3333"), ElementsAre(18, 18, 18, 18));
}

TEST_F(Qwen2Tokenizer, CopiesShareStateAndAgree) {
  const Tokenizer copy = *tok_;
  EXPECT_EQ(copy.encode("Hello, y'all! How are you?"), tok_->encode("Hello, y'all! How are you?"));
}

TEST_F(Qwen2Tokenizer, RejectsInvalidUtf8AndBadIds) {
  const std::string msg = invalid_argument_message([] { (void)tok_->encode("ab\xFF" "c"); });
  EXPECT_THAT(msg, HasSubstr("not valid UTF-8 at byte 2"));
  EXPECT_THAT(invalid_argument_message([] { (void)tok_->decode({9707, 151665}); }),
              HasSubstr("id 151665 at position 1"));
  EXPECT_THAT(invalid_argument_message([] { (void)tok_->decode({-1}); }), HasSubstr("id -1"));
  EXPECT_THAT(invalid_argument_message([] { (void)tok_->id_to_token(1000000); }), HasSubstr("1000000"));
}

TEST_F(Qwen2Tokenizer, LenientDecodeReplacesPaddingIds) {
  // 9707 = "Hello", 0 = "!", 151645 = <|im_end|>; 151665 and 151935 are padding rows of the
  // Qwen2.5 embedding (no token), -1 is no id at all.
  EXPECT_EQ(tok_->decode_lenient({9707, 151665, 0, 151935}), "Hello\xEF\xBF\xBD!\xEF\xBF\xBD");
  EXPECT_EQ(tok_->decode_lenient({-1, 9707, 151645}, /*skip_special=*/true), "\xEF\xBF\xBDHello");
  EXPECT_EQ(tok_->decode_lenient({9707, 0}), tok_->decode({9707, 0}));
  EXPECT_EQ(tok_->decode_lenient({}), "");
}

/// Qwen2.5's tokenizer.json layout (the file itself is not in ../shared; it is rebuilt here
/// from vocab.json + merges.txt with the pipeline the official file declares), with merges in
/// the newer [left, right] array form.
TEST_F(Qwen2Tokenizer, TokenizerJsonLayoutGivesTheSameIds) {
  nlohmann::json j;
  j["version"] = "1.0";
  j["added_tokens"] = nlohmann::json::array();
  for (const auto& a : qwen2_added_tokens()) {
    j["added_tokens"].push_back({{"id", a.id}, {"content", a.content}, {"single_word", false}, {"lstrip", false},
                                 {"rstrip", false}, {"normalized", false}, {"special", a.special}});
  }
  j["normalizer"] = {{"type", "NFC"}};
  const nlohmann::json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"},
                           {"pattern", {{"Regex", kQwen2SplitRegex}}},
                           {"behavior", "Isolated"},
                           {"invert", false}},
                          byte_level}}};
  j["post_processor"] = byte_level;
  j["decoder"] = byte_level;
  nlohmann::json merges = nlohmann::json::array();
  std::istringstream in(slurp(kQwenDir + "/merges.txt"));
  for (std::string line; std::getline(in, line);) {
    const size_t sp = line.find(' ');
    if (line.empty() || line[0] == '#' || sp == std::string::npos) continue;
    merges.push_back({line.substr(0, sp), line.substr(sp + 1)});
  }
  j["model"] = {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", ""},
                {"end_of_word_suffix", ""}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                {"vocab", nlohmann::json::parse(slurp(kQwenDir + "/vocab.json"))}, {"merges", merges}};
  const Tokenizer tok = Tokenizer::from_json(j.dump());
  EXPECT_EQ(tok.kind(), TokenizerKind::kByteLevelBpe);
  EXPECT_EQ(tok.vocab_size(), 151665);
  std::vector<std::string> texts;
  std::vector<Ids> expected;
  load_cases(texts, expected);
  for (size_t k = 0; k < texts.size(); ++k) {
    EXPECT_EQ(tok.encode(texts[k]), expected[k]) << "case " << k;
    EXPECT_EQ(tok.decode(expected[k]), texts[k]) << "case " << k;
  }
  EXPECT_THAT(tok.encode("<|im_start|>user\nHello!<|im_end|>"), ElementsAre(151644, 872, 198, 9707, 0, 151645));
}

// ---------------------------------------------------------------------------------------------
// TinyStories-656K: SentencePiece-style BPE (Prepend + Replace, byte_fallback, no pre-tokenizer).

class TinyStoriesTokenizer : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!exists(kTinyDir + "/tokenizer.json")) GTEST_SKIP() << "shared data folder absent: " << kTinyDir;
  }
};

TEST_F(TinyStoriesTokenizer, PromptMatchesGoldenIdsWithBosFromPostProcessor) {
  const Tokenizer tok = Tokenizer::from_file(kTinyDir + "/tokenizer.json");
  const auto golden = nlohmann::json::parse(slurp(kTinyDir + "/golden_once_upon_a_time.json"));
  const Ids prompt_ids = golden.at("prompt_ids").get<Ids>();
  ASSERT_EQ(prompt_ids, (Ids{1, 80, 147, 201, 282, 57, 8}));
  EXPECT_EQ(golden.at("prompt").get<std::string>(), "Once upon a time,");
  EXPECT_EQ(tok.encode("Once upon a time,"), prompt_ids);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.prefix_ids(), Ids{1});
  EXPECT_EQ(tok.kind(), TokenizerKind::kSentencePieceBpe);
  // Written out, the BOS is parsed as a special token; kSkip avoids a second BOS.
  EXPECT_EQ(tok.encode("<|start_story|>Once upon a time,", SpecialTokens::kParse, PostProcess::kSkip),
            prompt_ids);
  EXPECT_EQ(tok.encode("Once upon a time,", SpecialTokens::kParse, PostProcess::kSkip),
            (Ids{80, 147, 201, 282, 57, 8}));
}

TEST_F(TinyStoriesTokenizer, DecodeOfGreedyIdsMatchesGoldenText) {
  const Tokenizer tok = Tokenizer::from_file(kTinyDir + "/tokenizer.json");
  const auto golden = nlohmann::json::parse(slurp(kTinyDir + "/golden_once_upon_a_time.json"));
  Ids ids = golden.at("prompt_ids").get<Ids>();
  const Ids greedy = golden.at("greedy_ids").get<Ids>();
  ASSERT_EQ(greedy.size(), 60u);
  ids.insert(ids.end(), greedy.begin(), greedy.end());
  EXPECT_EQ(tok.decode(ids, /*skip_special=*/true), golden.at("text").get<std::string>());
  // Without skipping, the BOS text stays and the decoder's Strip finds no leading space.
  EXPECT_EQ(tok.decode({1, 80, 147}), "<|start_story|> On");
  // Merges run across word boundaries ("wanted▁to▁" is one token).
  EXPECT_EQ(tok.id_to_token(265), "wanted\xE2\x96\x81to\xE2\x96\x81");
}

TEST_F(TinyStoriesTokenizer, RoundTripsTextAndMapsUnknownCharsToUnk) {
  const Tokenizer tok = Tokenizer::from_file(kTinyDir + "/tokenizer.json");
  for (const std::string text : {"Once upon a time, there was a little dog named Max.",
                                 "Hi  there\n\"quoted\" 123 <x>"}) {
    const Ids ids = tok.encode(text);
    ASSERT_FALSE(ids.empty());
    EXPECT_EQ(ids.front(), 1);
    EXPECT_EQ(tok.decode(ids, /*skip_special=*/true), text);
  }
  // byte_fallback is on but this vocab holds no <0xNN> tokens, so (as in HF) a character
  // outside the vocab becomes <unk> = 0, which decode(skip_special) drops.
  EXPECT_EQ(tok.encode("caf\xC3\xA9", SpecialTokens::kParse, PostProcess::kSkip),
            (Ids{80, 295, 58, 0}));
  EXPECT_EQ(tok.decode({80, 295, 58, 0}, /*skip_special=*/true), "caf");
}

TEST_F(TinyStoriesTokenizer, ConfigGivesEosAndDirectoryLoaderAgrees) {
  const Tokenizer tok = Tokenizer::from_directory(kTinyDir);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.encode("Once upon a time,"), (Ids{1, 80, 147, 201, 282, 57, 8}));
  EXPECT_EQ(tok.vocab_size(), 2048);
}

// ---------------------------------------------------------------------------------------------
// Hand-built SentencePiece-style fixture (the layout tools/convert_llama2c.py writes for
// llama2.c's tok512.bin: byte_fallback, Prepend + Replace, no pre-tokenizer).

std::string sp_fixture(const std::string& normalizer, const std::string& pre_tokenizer,
                       const std::string& decoder) {
  return R"({
    "version": "1.0",
    "added_tokens": [
      {"id": 0, "content": "<unk>", "special": true},
      {"id": 1, "content": "<s>", "special": true},
      {"id": 2, "content": "</s>", "special": true}],
    "normalizer": )" + normalizer + R"(,
    "pre_tokenizer": )" + pre_tokenizer + R"(,
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "pair": [],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "decoder": )" + decoder + R"(,
    "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true,
      "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xC3>": 3, "<0xA9>": 4, "▁": 5, "a": 6,
                "b": 7, "c": 8, "▁a": 9, "bc": 10, "▁abc": 11, "c▁": 12},
      "merges": ["c ▁", "▁ a", "b c", "▁a bc"]}
  })";
}

const char* kSpNormalizer =
    R"({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]})";
const char* kSpDecoder =
    R"({"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})";

TEST(SentencePieceBpeFixture, MergesAcrossWordsByRank) {
  const Tokenizer tok = Tokenizer::from_json(sp_fixture(kSpNormalizer, "null", kSpDecoder));
  EXPECT_EQ(tok.kind(), TokenizerKind::kSentencePieceBpe);
  EXPECT_EQ(tok.bos_id(), 1);
  // "▁abc▁abc": rank 0 "c ▁" joins the words, then "▁ a", then "b c" on the tail only.
  EXPECT_THAT(tok.encode("abc abc"), ElementsAre(1, 9, 7, 12, 6, 10));
  EXPECT_EQ(tok.decode({1, 9, 7, 12, 6, 10}, /*skip_special=*/true), "abc abc");
  // One word: "▁ a" then "b c" then "▁a bc".
  EXPECT_THAT(tok.encode("abc"), ElementsAre(1, 11));
  // Special token in the text, then Prepend on the following segment (HF semantics).
  EXPECT_THAT(tok.encode("<s>abc", SpecialTokens::kParse, PostProcess::kSkip), ElementsAre(1, 11));
}

TEST(SentencePieceBpeFixture, ByteFallbackUnkAndDecode) {
  const Tokenizer tok = Tokenizer::from_json(sp_fixture(kSpNormalizer, "null", kSpDecoder));
  // 'é' = C3 A9, both byte tokens exist.
  EXPECT_THAT(tok.encode("\xC3\xA9"), ElementsAre(1, 5, 3, 4));
  EXPECT_EQ(tok.decode({1, 5, 3, 4}, true), "\xC3\xA9");
  // 'x' has neither a token nor byte tokens: <unk>; fuse_unk joins "xx" into one <unk>.
  EXPECT_THAT(tok.encode("xx a"), ElementsAre(1, 5, 0, 9));
  // A lone <0xC3> is invalid UTF-8 and decodes to U+FFFD.
  EXPECT_EQ(tok.decode({6, 3}), "a\xEF\xBF\xBD");
  EXPECT_EQ(tok.decode({1, 6}), "<s>a");
}

TEST(SentencePieceBpeFixture, MetaspacePreTokenizerVariant) {
  const Tokenizer tok = Tokenizer::from_json(sp_fixture(
      "null", R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false})",
      R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false})"));
  EXPECT_EQ(tok.kind(), TokenizerKind::kSentencePieceBpe);
  EXPECT_THAT(tok.encode("abc abc"), ElementsAre(1, 9, 7, 12, 6, 10));
  // prepend_scheme "first": no "▁" before a segment that follows a special token.
  EXPECT_THAT(tok.encode("<s>abc", SpecialTokens::kParse, PostProcess::kSkip), ElementsAre(1, 6, 10));
  EXPECT_EQ(tok.decode({9, 7, 12, 6, 10}), "abc abc");
}

// ---------------------------------------------------------------------------------------------
// Hand-built byte-level fixture: Split regex + ByteLevel, merges as [left, right] arrays.

TEST(ByteLevelFixture, SplitRegexThenMergesWithinPreTokens) {
  const std::string json = R"({
    "added_tokens": [{"id": 9, "content": "<|end|>", "special": true, "lstrip": true, "rstrip": true}],
    "normalizer": {"type": "NFC"},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "\\p{L}+|\\s+"}, "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġa": 4, "!": 5, "ba": 6},
              "merges": [["a", "b"], ["b", "a"], ["Ġ", "a"]]}
  })";
  const Tokenizer tok = Tokenizer::from_json(json);
  EXPECT_EQ(tok.kind(), TokenizerKind::kByteLevelBpe);
  // Pre-tokens "abab", " ", "ba", "!": the space is its own piece, so "Ġ a" never applies.
  EXPECT_THAT(tok.encode("abab ba!"), ElementsAre(3, 3, 2, 6, 5));
  EXPECT_EQ(tok.decode({3, 3, 2, 6, 5}), "abab ba!");
  // lstrip/rstrip swallow the spaces around the added token.
  EXPECT_THAT(tok.encode("ab <|end|> ab"), ElementsAre(3, 9, 3));
  EXPECT_EQ(tok.vocab_size(), 10);
  EXPECT_THAT(invalid_argument_message([&] { (void)tok.decode({7}); }), HasSubstr("unassigned"));
}

// ---------------------------------------------------------------------------------------------
// Errors name the file, the field and the value.

TEST(TokenizerErrors, MalformedAndUnsupportedInputs) {
  EXPECT_THAT(invalid_argument_message([] { (void)Tokenizer::from_json("{\"model\": [1, 2"); }),
              HasSubstr("tokenizer.json: malformed JSON"));
  EXPECT_THAT(invalid_argument_message([] { (void)Tokenizer::from_json("{}"); }), HasSubstr("model"));
  EXPECT_THAT(invalid_argument_message([] {
                (void)Tokenizer::from_json(R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})");
              }),
              HasSubstr("model.type: unsupported tokenizer model 'WordPiece'"));
  EXPECT_THAT(invalid_argument_message([] {
                (void)Tokenizer::from_json(
                    R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                        "pre_tokenizer": {"type": "BertPreTokenizer"}})");
              }),
              HasSubstr("pre_tokenizer.type: unsupported pre-tokenizer 'BertPreTokenizer'"));
  EXPECT_THAT(invalid_argument_message([] {
                (void)Tokenizer::from_json(
                    R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Lowercase"}]}})");
              }),
              HasSubstr("normalizer.normalizers[0].type: unsupported normalizer 'Lowercase'"));
  EXPECT_THAT(invalid_argument_message([] {
                (void)Tokenizer::from_json(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1},
                                                         "merges": ["a b"]}})");
              }),
              HasSubstr("merge #0 'a b' uses a token missing from the vocab ('ab')"));
  EXPECT_THAT(invalid_argument_message([] {
                (void)Tokenizer::from_json(R"({"model": {"type": "BPE", "vocab": {"a": -3}}})");
              }),
              HasSubstr("id -3 is out of range"));
  EXPECT_THAT(invalid_argument_message([] {
                (void)Tokenizer::from_json(
                    R"({"model": {"type": "BPE", "vocab": {"a": 0}},
                        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"}})");
              }),
              HasSubstr("cannot compile split pattern '(unclosed'"));
}

TEST(TokenizerErrors, MissingFilesNameThePath) {
  EXPECT_THAT(invalid_argument_message([] { (void)Tokenizer::from_file("no/such/dir/tokenizer.json"); }),
              HasSubstr("'no/such/dir/tokenizer.json'"));
  EXPECT_THAT(invalid_argument_message([] { (void)Tokenizer::from_directory("no/such/dir"); }),
              HasSubstr("no tokenizer.json and no vocab.json + merges.txt in 'no/such/dir'"));
  EXPECT_THAT(invalid_argument_message([] { (void)Tokenizer::from_texts(TokenizerFiles{}); }),
              HasSubstr("need tokenizer.json or both vocab.json and merges.txt"));
}

TEST(TokenizerErrors, VocabMergesPairValidation) {
  EXPECT_THAT(invalid_argument_message([] { (void)Tokenizer::from_vocab_merges("[1]", ""); }),
              HasSubstr("vocab.json"));
  EXPECT_THAT(invalid_argument_message([] {
                (void)Tokenizer::from_vocab_merges(R"({"a": 0, "b": 1, "ab": 2})", "#version: 0.2\na b\nab\n");
              }),
              HasSubstr("merges.txt: line 3: expected 'left right', got 'ab'"));
  // A "#version" first line is skipped; the pair then works.
  const Tokenizer tok = Tokenizer::from_vocab_merges(R"({"a": 0, "b": 1, "ab": 2})", "#version: 0.2\na b\n");
  EXPECT_THAT(tok.encode("ab"), ElementsAre(2));
}

TEST(TokenizerConfig, AddedTokensAndBosEosFromConfig) {
  TokenizerFiles files;
  files.vocab_json = R"({"a": 0, "b": 1, "ab": 2})";
  files.merges_txt = "a b\n";
  files.tokenizer_config_json = R"({
    "added_tokens_decoder": {"3": {"content": "<s>", "special": true}, "4": {"content": "</s>", "special": true}},
    "bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": true, "add_eos_token": true})";
  const Tokenizer tok = Tokenizer::from_texts(files);
  EXPECT_EQ(tok.bos_id(), 3);
  EXPECT_EQ(tok.eos_id(), 4);
  EXPECT_THAT(tok.encode("abab"), ElementsAre(3, 2, 2, 4));
  EXPECT_THAT(tok.encode("abab", SpecialTokens::kParse, PostProcess::kSkip), ElementsAre(2, 2));
  EXPECT_EQ(tok.decode({3, 2, 2, 4}, /*skip_special=*/true), "abab");
  files.tokenizer_config_json = R"({"eos_token": "<nope>"})";
  EXPECT_THAT(invalid_argument_message([&] { (void)Tokenizer::from_texts(files); }),
              HasSubstr("tokenizer_config.json: eos_token: token '<nope>' is not in the vocabulary"));
}

}  // namespace
}  // namespace kvcache
