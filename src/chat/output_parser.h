// Output parsing for chat completions, usable while streaming: splits Qwen's
// <think>...</think> reasoning from the answer, and parses tool calls into OpenAI tool_calls with
// JSON `arguments`:
//   Qwen3.5 (XML):  <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...
//                   </function>\n</tool_call>
//   Qwen3 (JSON):   <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>
// Text arrives in chunks (decoded tokens); push() returns what can be emitted now and holds back
// anything that could still be the start of a marker (`<tool_call`, `</think`, ...), trailing
// newlines whose role is not known yet, and incomplete UTF-8 sequences, so a marker is never
// emitted as content. The result does not depend on how the text is chunked.
// Whitespace follows what the chat template does when it renders the message back: reasoning is
// stripped of leading/trailing newlines, content of the newlines after </think> and of the
// whitespace before a tool call. XML parameter values are converted with the tool's JSON schema
// type: string stays a string; integer/number/boolean/object/array/null are parsed as JSON when
// they parse (else kept as a string); parameters without a known type stay strings.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace ds {

// One piece of one tool call: `name` is set on the first piece of a call; `arguments` pieces,
// concatenated in order, form the call's JSON object text.
struct ToolCallDelta {
  int index = 0;  // 0-based position of the call in the message
  std::string name;
  std::string arguments;
};

struct OutputDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

struct ParsedToolCall {
  std::string name;
  std::string arguments;  // JSON object text, e.g. {"location": "Paris", "days": 3}
};

class OutputParser {
 public:
  // starts_in_reasoning: the prompt ended inside <think> (Qwen3.5 with thinking on ends the prompt
  // with "<think>\n"), so generation begins as reasoning. tools: the request's tools (OpenAI
  // shape, [{"type": "function", "function": {"name", "parameters"}}]) for value types; may be
  // null. parse_tool_calls=false leaves <tool_call> text in the content.
  explicit OutputParser(bool starts_in_reasoning = false,
                        const nlohmann::ordered_json& tools = nlohmann::ordered_json(),
                        bool parse_tool_calls = true);

  // Whether generation after `prompt` starts inside reasoning: the last assistant turn's header
  // ("<|im_start|>assistant") is followed by a <think> that is not closed (Qwen3.5's template
  // with enable_thinking=true ends the prompt with "<think>\n"). A <think> elsewhere in the prompt
  // (a user's text, a tool's result) does not count.
  static bool prompt_ends_in_reasoning(std::string_view prompt);

  OutputDelta push(std::string_view text);
  // End of generation: emits what was held back. A tool call cut off after its name was emitted
  // is closed with the parameters completed so far; one cut off before is returned as content.
  OutputDelta finish();

  // Everything emitted so far.
  const std::string& reasoning() const { return reasoning_; }
  const std::string& content() const { return content_; }
  const std::vector<ParsedToolCall>& tool_calls() const { return calls_; }

 private:
  enum class State {
    kContent,
    kReasoning,
    kToolCall,
    kFunction,
    kParameter,
    kAfterFunction,
    kJsonCall
  };

  bool step(OutputDelta& d, bool final);  // one transition; false when it needs more text
  void emit_content(OutputDelta& d, std::string_view s);
  void emit_reasoning(OutputDelta& d, std::string_view s);
  void open_call(OutputDelta& d, const std::string& name);
  void add_argument(OutputDelta& d, const std::string& key, const std::string& raw_value);
  void close_call(OutputDelta& d);
  // A Qwen3 JSON call {"name", "arguments"} (the text inside <tool_call>): emitted as a call and
  // true, or false (not one) with nothing emitted.
  bool json_call(OutputDelta& d, const std::string& text);
  nlohmann::ordered_json convert_value(const std::string& param, const std::string& raw) const;

  State state_;
  bool parse_tool_calls_;
  std::string buf_;                 // received, not yet consumed
  bool content_started_ = false;    // a non-whitespace content char was seen (no <think> after)
  bool strip_newlines_ = false;     // drop leading newlines of content (after </think>)
  bool reasoning_started_ = false;  // a non-newline reasoning char was emitted
  bool drop_whitespace_ = false;    // between / after tool calls
  std::string ws_before_tool_;      // whitespace before the last <tool_call>, if it is no call
  std::string param_name_;
  int n_args_ = 0;  // parameters emitted for the open call
  bool call_open_ = false;
  nlohmann::ordered_json tool_params_;  // tool name -> {param -> schema}
  std::string current_tool_;
  std::string reasoning_, content_;
  std::vector<ParsedToolCall> calls_;
};

}  // namespace ds
