// Chat templates: renders a model's own Jinja chat template exactly as Hugging Face transformers'
// apply_chat_template(..., tokenize=False) does, including its input normalisation (keys whose
// value is null are dropped from each message; reasoning given as `reasoning_content`,
// `thinking` or `reasoning` is exposed under `reasoning_content` and `thinking`) and the template
// variables it adds (the tokenizer's special tokens, tools, documents, add_generation_prompt).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "chat/jinja.h"

namespace ds {

class ChatTemplate {
 public:
  // dir: chat_template.jinja if present, else tokenizer_config.json's "chat_template" (a string,
  // or a list of {name, template} from which "default" is taken), else chat_template.json.
  // Special tokens (bos_token, eos_token, ...) come from tokenizer_config.json. Throws ds::Error
  // naming the file, or TemplateError (with line and column) when the template does not parse.
  static ChatTemplate load(const std::string& dir);
  // From template text; special_tokens: {"eos_token": "<|im_end|>", ...} (strings or {content}).
  static ChatTemplate from_string(
      const std::string& source,
      const nlohmann::ordered_json& special_tokens = nlohmann::ordered_json::object());

  // request: {"messages": [...], "tools": [...]?, "add_generation_prompt": bool,
  // "continue_final_message": bool or field name (leave the last message open, as HF does), plus
  // any extra keys passed to the template (e.g. "enable_thinking")}. Throws ds::TemplateError (derives
  // from ds::Error) with the template's message / line:column, or ds::Error for a malformed
  // request. Parse request JSON as ordered_json: tojson of tools keeps their key order, like HF.
  std::string render(const nlohmann::ordered_json& request) const;
  // Same; objects of nlohmann::json have their keys sorted, so tool schemas render sorted.
  std::string render(const nlohmann::json& request) const;

  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::shared_ptr<const jinja::Template> template_;
  std::shared_ptr<const jinja::Template> tool_template_;  // "tool_use" of a named-template list
  jinja::Dict special_tokens_;
};

}  // namespace ds
