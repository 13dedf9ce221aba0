// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file chat_template.h
/// Turns a conversation into the prompt text a model was trained on. Two formats, no Jinja:
///  - ChatML (Qwen2/Qwen2.5 Instruct): `<|im_start|>{role}\n{content}<|im_end|>\n` per message,
///    a default system message when the first message is not a system message, and the
///    generation prompt `<|im_start|>assistant\n`. Same output as Qwen2.5's Jinja template for
///    conversations without tools.
///  - Plain (base models): the contents concatenated as they are; BOS is left to the
///    tokenizer's post-processor (Tokenizer::encode with PostProcess::kApply).
/// Encode the rendered text with SpecialTokens::kParse so `<|im_start|>` becomes its id; the
/// message contents are not escaped, so a content that spells `<|im_end|>` is parsed too.

#include <optional>
#include <string>
#include <vector>

namespace kvcache {

/// Qwen2.5's default system prompt (its chat template inserts it when none is given).
inline constexpr const char* kQwenDefaultSystemPrompt =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

struct ChatMessage {
  std::string role;     ///< "system", "user", "assistant" (ChatML accepts any role name)
  std::string content;
};

class ChatTemplate {
 public:
  enum class Kind { kChatML, kPlain };

  /// ChatML with `default_system_prompt` inserted when the conversation does not start with
  /// a system message (nullopt: insert nothing).
  static ChatTemplate chatml(std::optional<std::string> default_system_prompt = std::string(kQwenDefaultSystemPrompt));
  static ChatTemplate plain();

  /// Chooses the format of a checkpoint: ChatML when tokenizer_config.json's `chat_template`
  /// or its added tokens (`added_tokens_decoder`, `additional_special_tokens`) contain
  /// `<|im_start|>`, else Plain. The default system prompt is the literal one of the
  /// template (`'<|im_start|>system\n...<|im_end|>\n'`, as in Qwen2.5) when present; without
  /// a chat_template, Qwen's for `model_type` "qwen2"; otherwise none.
  /// @param tokenizer_config_json_text may be empty (no config: Plain, unless model_type is
  ///        "qwen2").
  /// @throws InvalidArgument when the text is not valid JSON or not an object.
  static ChatTemplate detect(const std::string& model_type, const std::string& tokenizer_config_json_text);

  /// The prompt text. ChatML: see above; `add_generation_prompt` appends
  /// `<|im_start|>assistant\n`. Plain: contents concatenated (roles ignored, nothing appended).
  /// @throws InvalidArgument for an empty role or a role containing a newline (ChatML).
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;

  Kind kind() const { return kind_; }
  const std::optional<std::string>& default_system_prompt() const { return default_system_prompt_; }
  /// Same template with another default system prompt (nullopt: none).
  ChatTemplate with_default_system_prompt(std::optional<std::string> prompt) const;
  /// "chatml" or "plain".
  std::string name() const;

 private:
  ChatTemplate(Kind kind, std::optional<std::string> default_system_prompt)
      : kind_(kind), default_system_prompt_(std::move(default_system_prompt)) {}
  Kind kind_;
  std::optional<std::string> default_system_prompt_;
};

}  // namespace kvcache
