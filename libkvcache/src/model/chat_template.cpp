// SPDX-License-Identifier: Apache-2.0
#include "kvcache/model/chat_template.h"

#include <nlohmann/json.hpp>

#include <cstdio>

#include "kvcache/error.h"
#include "model/unicode.h"

namespace kvcache {
namespace {

constexpr const char* kImStart = "<|im_start|>";

/// The literal default system prompt of a ChatML Jinja template, i.e. the text between
/// `<|im_start|>system\n` and `<|im_end|>` inside one quoted string; nullopt when the
/// template builds the system message from variables only. Jinja strings in JSON-decoded
/// templates spell the newline as the two characters `\n`.
std::optional<std::string> literal_system_prompt(const std::string& tmpl) {
  for (const char* head : {"<|im_start|>system\\n", "<|im_start|>system\n"}) {
    const std::string h = head;
    for (size_t pos = tmpl.find(h); pos != std::string::npos; pos = tmpl.find(h, pos + 1)) {
      const size_t begin = pos + h.size();
      const size_t end = tmpl.find("<|im_end|>", begin);
      if (end == std::string::npos) continue;
      const std::string body = tmpl.substr(begin, end - begin);
      // Only a plain literal counts: no Jinja expression, no string concatenation.
      if (body.empty() || body.find_first_of("{}'\"+") != std::string::npos) continue;
      return body;
    }
  }
  return std::nullopt;
}

}  // namespace

ChatTemplate ChatTemplate::chatml(std::optional<std::string> default_system_prompt) {
  return ChatTemplate(Kind::kChatML, std::move(default_system_prompt));
}

ChatTemplate ChatTemplate::plain() { return ChatTemplate(Kind::kPlain, std::nullopt); }

ChatTemplate ChatTemplate::with_default_system_prompt(std::optional<std::string> prompt) const {
  return ChatTemplate(kind_, std::move(prompt));
}

std::string ChatTemplate::name() const { return kind_ == Kind::kChatML ? "chatml" : "plain"; }

ChatTemplate ChatTemplate::detect(const std::string& model_type, const std::string& tokenizer_config_json_text) {
  const bool is_qwen2 = model_type == "qwen2";
  if (tokenizer_config_json_text.empty()) {
    return is_qwen2 ? chatml() : plain();
  }
  nlohmann::json cfg;
  try {
    cfg = nlohmann::json::parse(tokenizer_config_json_text);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(detail::str_cat("tokenizer_config.json: malformed JSON: ", e.what()));
  }
  KV_CHECK_ARG(cfg.is_object(), "tokenizer_config.json: expected a JSON object, got ", cfg.type_name());

  std::string tmpl;
  if (const auto it = cfg.find("chat_template"); it != cfg.end() && !it->is_null()) {
    if (it->is_string()) {
      tmpl = it->get<std::string>();
    } else if (it->is_array()) {  // [{"name": "default", "template": "..."}, ...]
      for (const auto& t : *it) {
        if (t.is_object() && t.value("name", "") == "default" && t.contains("template") &&
            t["template"].is_string()) {
          tmpl = t["template"].get<std::string>();
        }
      }
    } else {
      throw InvalidArgument(detail::str_cat("tokenizer_config.json: chat_template: expected a string or a "
                                            "list of {name, template}, got ", it->type_name()));
    }
  }
  bool has_im_start = tmpl.find(kImStart) != std::string::npos;
  if (const auto it = cfg.find("added_tokens_decoder"); it != cfg.end() && it->is_object()) {
    for (const auto& [id, tok] : it->items()) {
      if (tok.is_object() && tok.value("content", "") == kImStart) has_im_start = true;
    }
  }
  if (const auto it = cfg.find("additional_special_tokens"); it != cfg.end() && it->is_array()) {
    for (const auto& t : *it) {
      if ((t.is_string() && t.get<std::string>() == kImStart) ||
          (t.is_object() && t.value("content", "") == kImStart)) {
        has_im_start = true;
      }
    }
  }
  if (!has_im_start) return plain();
  if (!tmpl.empty()) {
    // Qwen2.5 writes its default literally; a template that never writes one (Qwen3) gets none.
    return chatml(literal_system_prompt(tmpl));
  }
  return is_qwen2 ? chatml() : chatml(std::nullopt);
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  // Checked here, on the text the caller passed: after rendering, a byte offset would point
  // into the template's markers instead.
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& c = messages[i].content;
    const size_t bad = unicode::find_invalid_utf8(c);
    if (bad == std::string::npos) continue;
    char byte[8];
    std::snprintf(byte, sizeof byte, "0x%02x", static_cast<unsigned>(static_cast<unsigned char>(c[bad])));
    throw InvalidArgument(detail::str_cat("ChatTemplate::render: the ", messages[i].role, " message (message ", i,
                                          ") is not valid UTF-8 at byte ", bad, " of its content (byte value ", byte,
                                          ")"));
  }
  std::string out;
  if (kind_ == Kind::kPlain) {
    for (const auto& m : messages) out += m.content;
    return out;
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& role = messages[i].role;
    KV_CHECK_ARG(!role.empty() && role.find('\n') == std::string::npos, "ChatTemplate::render: message ", i,
                 " has role '", role, "', expected a non-empty name without newlines (system, user, assistant)");
  }
  if ((messages.empty() || messages.front().role != "system") && default_system_prompt_) {
    out += "<|im_start|>system\n" + *default_system_prompt_ + "<|im_end|>\n";
  }
  for (const auto& m : messages) {
    out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace kvcache
