// Turns the generated text of a chat completion, as it streams, into OpenAI message deltas:
// `reasoning_content` split from `content` (<think>...</think>), and Qwen tool calls parsed into
// `tool_calls` (the parsing itself is ds::OutputParser of src/chat; this file maps its deltas onto
// the OpenAI JSON shapes and assembles the final message for non-streaming responses).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace ds {

class ChatOutput {
 public:
  // starts_in_reasoning: the prompt ends inside <think> (thinking on), so generation begins as
  // reasoning. tools: the request's tools (the parser converts parameter values by their schema).
  ChatOutput(bool starts_in_reasoning, const nlohmann::ordered_json& tools);
  ~ChatOutput();
  ChatOutput(const ChatOutput&) = delete;
  ChatOutput& operator=(const ChatOutput&) = delete;

  // New text -> the delta fields to stream now ({"content": ...}, {"reasoning_content": ...},
  // {"tool_calls": [...]}), an empty object when nothing is complete yet.
  nlohmann::ordered_json push(const std::string& text);
  // End of generation: whatever was held back.
  nlohmann::ordered_json finish();
  // The whole assistant message so far: {"role", "content", "reasoning_content"?, "tool_calls"?}.
  nlohmann::ordered_json message() const;
  bool has_tool_calls() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ds
