// SPDX-License-Identifier: Apache-2.0
// The PCRE2 wrapper behind the tokenizer's Split pre-tokenizer.
#include "model/regex.h"
#include "model/tokenizer_impl.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvcache/error.h"
#include "kvcache/model/tokenizer.h"

namespace kvcache::tok {
namespace {

std::vector<std::string> pieces(const Regex& re, const std::string& text) {
  std::vector<std::string> out;
  for (const auto& [b, e] : re.find_all(text)) out.push_back(text.substr(b, e - b));
  return out;
}

TEST(TokenizerRegex, Qwen2PatternSplitsLikeHf) {
  const Regex re(kQwen2SplitRegex, Regex::Syntax::kPattern);
  using ::testing::ElementsAre;
  EXPECT_THAT(pieces(re, "Hello world"), ElementsAre("Hello", " world"));
  // Digits one by one; contractions case-insensitively; spaces before newlines join them;
  // a run of spaces gives its last one to the following word.
  EXPECT_THAT(pieces(re, "It'S 2024!!  \n\nok   go"),
              ElementsAre("It", "'S", " ", "2", "0", "2", "4", "!!", "  \n\n", "ok", "  ", " go"));
  // Unicode letters (\p{L}) in UCP mode.
  EXPECT_THAT(pieces(re, "\xD0\xBD\xD0\xB0 caf\xC3\xA9"), ElementsAre("\xD0\xBD\xD0\xB0", " caf\xC3\xA9"));
}

TEST(TokenizerRegex, WhitespaceFollowsOniguruma) {
  // U+0085 (NEL) is \s in Oniguruma (which HF tokenizers uses) but not in PCRE2's UCP \s.
  EXPECT_EQ(onigurumize_whitespace(R"(\s+(?!\S)|[^\s\p{L}])"), R"([\s\x{85}]+(?![^\s\x{85}])|[^\s\x{85}\p{L}])");
  const Regex re("\\s+", Regex::Syntax::kPattern);
  EXPECT_THAT(pieces(re, "a\xC2\x85 b"), ::testing::ElementsAre("\xC2\x85 "));
  // A literal pattern is not rewritten.
  const Regex lit("\\s", Regex::Syntax::kLiteral);
  EXPECT_THAT(pieces(lit, "a\\sb"), ::testing::ElementsAre("\\s"));
}

TEST(TokenizerRegex, BadPatternThrows) {
  EXPECT_THROW(Regex("(?<", Regex::Syntax::kPattern), InvalidArgument);
}

TEST(TokenizerPreTokenizers, SplitBehaviorsMatchHfDocs) {
  // The example of HF's SplitDelimiterBehavior docs: "the-final--countdown" split on "-".
  auto split = [](SplitBehavior b) {
    PreTokStep step;
    step.kind = PreTokStep::Kind::kSplit;
    step.regex = std::make_shared<const Regex>("-", Regex::Syntax::kLiteral);
    step.behavior = b;
    return apply_pretokenizers({step}, "the-final--countdown", true);
  };
  using ::testing::ElementsAre;
  EXPECT_THAT(split(SplitBehavior::kRemoved), ElementsAre("the", "final", "countdown"));
  EXPECT_THAT(split(SplitBehavior::kIsolated), ElementsAre("the", "-", "final", "-", "-", "countdown"));
  EXPECT_THAT(split(SplitBehavior::kMergedWithPrevious), ElementsAre("the-", "final-", "-", "countdown"));
  EXPECT_THAT(split(SplitBehavior::kMergedWithNext), ElementsAre("the", "-final", "-", "-countdown"));
  EXPECT_THAT(split(SplitBehavior::kContiguous), ElementsAre("the", "-", "final", "--", "countdown"));
}

TEST(TokenizerPreTokenizers, MetaspaceAndByteLevel) {
  PreTokStep meta;
  meta.kind = PreTokStep::Kind::kMetaspace;
  meta.scheme = PrependScheme::kAlways;
  meta.split = true;
  EXPECT_THAT(apply_pretokenizers({meta}, "Hey friend!", false),
              ::testing::ElementsAre("\xE2\x96\x81Hey", "\xE2\x96\x81" "friend!"));
  meta.scheme = PrependScheme::kFirst;
  EXPECT_THAT(apply_pretokenizers({meta}, "Hey", false), ::testing::ElementsAre("Hey"));
  PreTokStep bl;
  bl.kind = PreTokStep::Kind::kByteLevel;
  bl.add_prefix_space = true;
  bl.regex = std::make_shared<const Regex>(kGpt2SplitRegex, Regex::Syntax::kPattern);
  // GPT-2: prefix space, regex split, bytes mapped (space -> U+0120 'Ġ', '\n' -> U+010A 'Ċ').
  EXPECT_THAT(apply_pretokenizers({bl}, "Hi there\n", true),
              ::testing::ElementsAre("\xC4\xA0Hi", "\xC4\xA0there", "\xC4\x8A"));
}

}  // namespace
}  // namespace kvcache::tok
