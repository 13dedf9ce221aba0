// SPDX-License-Identifier: Apache-2.0
// ChatTemplate: ChatML (Qwen2.5) and Plain rendering, detection from tokenizer_config.json,
// and the rendered Qwen2 prompt tokenized to the README's 31 ids.
#include "kvcache/model/chat_template.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvcache/error.h"
#include "kvcache/model/tokenizer.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

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

const char* kQwenPrompt =
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n";

TEST(ChatTemplate, ChatMLInsertsDefaultSystemPrompt) {
  const ChatTemplate t = ChatTemplate::chatml();
  EXPECT_EQ(t.kind(), ChatTemplate::Kind::kChatML);
  EXPECT_EQ(t.name(), "chatml");
  EXPECT_EQ(t.render({{"user", "Hello!"}}, /*add_generation_prompt=*/true), kQwenPrompt);
  EXPECT_EQ(t.render({{"user", "Hello!"}}, false),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHello!<|im_end|>\n");
}

TEST(ChatTemplate, ChatMLKeepsGivenSystemAndMultiTurn) {
  const ChatTemplate t = ChatTemplate::chatml();
  EXPECT_EQ(t.render({{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."}, {"user", "Bye"}}, true),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatTemplate, DefaultSystemPromptIsConfigurable) {
  const ChatTemplate custom = ChatTemplate::chatml("You are a helpful assistant.");
  EXPECT_EQ(custom.render({{"user", "x"}}, false),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nx<|im_end|>\n");
  const ChatTemplate none = ChatTemplate::chatml().with_default_system_prompt(std::nullopt);
  EXPECT_EQ(none.render({{"user", "x"}}, true), "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(none.render({}, true), "<|im_start|>assistant\n");
}

TEST(ChatTemplate, PlainConcatenatesContents) {
  const ChatTemplate t = ChatTemplate::plain();
  EXPECT_EQ(t.name(), "plain");
  EXPECT_EQ(t.render({{"user", "Once upon a time,"}}, true), "Once upon a time,");
  EXPECT_EQ(t.render({{"system", "A "}, {"user", "B"}}, false), "A B");
}

TEST(ChatTemplate, RejectsBadRoles) {
  EXPECT_THROW((void)ChatTemplate::chatml().render({{"", "x"}}, false), InvalidArgument);
  try {
    (void)ChatTemplate::chatml().render({{"user", "a"}, {"us\ner", "x"}}, false);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("message 1 has role"));
  }
}

// The byte offset of invalid UTF-8 points into the text the caller passed, not into the
// rendered prompt (whose markers would shift it), for both templates.
TEST(ChatTemplate, InvalidUtf8NamesTheMessageAndItsByte) {
  for (const ChatTemplate& t : {ChatTemplate::chatml(), ChatTemplate::plain()}) {
    try {
      (void)t.render({{"system", "Be brief."}, {"user", "a\xff" "b"}}, true);
      FAIL() << "expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      EXPECT_STREQ(e.what(), "ChatTemplate::render: the user message (message 1) is not valid UTF-8 at byte 1 of its "
                             "content (byte value 0xff)");
    }
  }
  try {
    (void)ChatTemplate::chatml().render({{"system", "caf\xc3"}}, false);  // truncated 2-byte sequence
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("the system message (message 0) is not valid UTF-8 at byte 3 of its content "
                                    "(byte value 0xc3)"));
  }
}

TEST(ChatTemplate, DetectFromQwenJinjaTemplate) {
  if (!exists(kQwenDir + "/Qwen-Qwen2.5-7B-Instruct.jinja")) GTEST_SKIP() << "shared data folder absent: " << kQwenDir;
  nlohmann::json cfg;
  cfg["chat_template"] = slurp(kQwenDir + "/Qwen-Qwen2.5-7B-Instruct.jinja");
  const ChatTemplate t = ChatTemplate::detect("qwen2", cfg.dump());
  EXPECT_EQ(t.kind(), ChatTemplate::Kind::kChatML);
  ASSERT_TRUE(t.default_system_prompt().has_value());
  EXPECT_EQ(*t.default_system_prompt(), "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  EXPECT_EQ(t.render({{"user", "Hello!"}}, true), kQwenPrompt);
}

TEST(ChatTemplate, DetectVariants) {
  // A template that writes another literal default (Qwen2-Instruct style).
  const std::string qwen2 = R"({"chat_template": "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{% endfor %}"})";
  EXPECT_EQ(ChatTemplate::detect("qwen2", qwen2).default_system_prompt(), "You are a helpful assistant.");
  // ChatML template with no literal default: no system message inserted.
  const std::string qwen3 = R"({"chat_template": "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endfor %}"})";
  EXPECT_EQ(ChatTemplate::detect("qwen3", qwen3).default_system_prompt(), std::nullopt);
  // Added tokens alone mark ChatML.
  const std::string added = R"({"added_tokens_decoder": {"151644": {"content": "<|im_start|>", "special": true}}})";
  EXPECT_EQ(ChatTemplate::detect("qwen2", added).kind(), ChatTemplate::Kind::kChatML);
  EXPECT_EQ(ChatTemplate::detect("qwen2", added).default_system_prompt(), kQwenDefaultSystemPrompt);
  EXPECT_EQ(ChatTemplate::detect("llama", R"({"bos_token": "<s>"})").kind(), ChatTemplate::Kind::kPlain);
  EXPECT_EQ(ChatTemplate::detect("llama", "").kind(), ChatTemplate::Kind::kPlain);
  EXPECT_EQ(ChatTemplate::detect("qwen2", "").kind(), ChatTemplate::Kind::kChatML);
  EXPECT_THROW((void)ChatTemplate::detect("qwen2", "{oops"), InvalidArgument);
}

TEST(ChatTemplate, TinyStoriesConfigIsPlain) {
  if (!exists(kTinyDir + "/tokenizer_config.json")) GTEST_SKIP() << "shared data folder absent: " << kTinyDir;
  const ChatTemplate t = ChatTemplate::detect("llama", slurp(kTinyDir + "/tokenizer_config.json"));
  EXPECT_EQ(t.kind(), ChatTemplate::Kind::kPlain);
  const Tokenizer tok = Tokenizer::from_directory(kTinyDir);
  EXPECT_EQ(tok.encode(t.render({{"user", "Once upon a time,"}}, true)),
            (std::vector<int64_t>{1, 80, 147, 201, 282, 57, 8}));
}

TEST(ChatTemplate, RenderedQwenPromptTokenizesTo31Ids) {
  if (!exists(kQwenDir + "/vocab.json")) GTEST_SKIP() << "shared data folder absent: " << kQwenDir;
  std::vector<AddedToken> added;
  for (const auto& [id, name] : std::vector<std::pair<int64_t, std::string>>{
           {151643, "<|endoftext|>"}, {151644, "<|im_start|>"}, {151645, "<|im_end|>"}}) {
    AddedToken a;
    a.id = id;
    a.content = name;
    added.push_back(a);
  }
  const Tokenizer tok = Tokenizer::from_vocab_merges(slurp(kQwenDir + "/vocab.json"), slurp(kQwenDir + "/merges.txt"), added);
  const std::string text = ChatTemplate::chatml().render({{"user", "Hello!"}}, true);
  EXPECT_EQ(tok.encode(text), (std::vector<int64_t>{151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364,
                                                    14817, 13, 1446, 525, 264, 10950, 17847, 13, 151645, 198, 151644,
                                                    872, 198, 9707, 0, 151645, 198, 151644, 77091, 198}));
}

}  // namespace
}  // namespace kvcache
