// Chat output assembly over ds::OutputParser: see chat_output.h.
#include "server/chat_output.h"

#include "chat/output_parser.h"
#include "server/openai.h"

namespace ds {

using json = nlohmann::ordered_json;

struct ChatOutput::Impl {
  Impl(bool starts_in_reasoning, const json& tools)
      : parser(starts_in_reasoning, tools, tools.is_array() && !tools.empty()) {}
  OutputParser parser;
  std::vector<std::string> call_ids;  // per tool call index

  // OutputDelta -> OpenAI delta fields; tool-call pieces of one call are merged.
  json to_json(const OutputDelta& d) {
    json out = json::object();
    if (!d.reasoning.empty()) out["reasoning_content"] = d.reasoning;
    if (!d.content.empty()) out["content"] = d.content;
    if (!d.tool_calls.empty()) {
      json calls = json::array();
      for (const ToolCallDelta& t : d.tool_calls) {
        if (!calls.empty() && calls.back()["index"] == t.index && t.name.empty()) {
          json& fn = calls.back()["function"];
          fn["arguments"] = fn["arguments"].get<std::string>() + t.arguments;
          continue;
        }
        json c = {{"index", t.index}};
        if (!t.name.empty()) {
          while (static_cast<int>(call_ids.size()) <= t.index)
            call_ids.push_back(make_request_id("call_"));
          c["id"] = call_ids[t.index];
          c["type"] = "function";
          c["function"] = {{"name", t.name}, {"arguments", t.arguments}};
        } else {
          c["function"] = {{"arguments", t.arguments}};
        }
        calls.push_back(c);
      }
      out["tool_calls"] = calls;
    }
    return out;
  }
};

ChatOutput::ChatOutput(bool starts_in_reasoning, const json& tools)
    : impl_(std::make_unique<Impl>(starts_in_reasoning, tools)) {}
ChatOutput::~ChatOutput() = default;

json ChatOutput::push(const std::string& text) {
  if (text.empty()) return json::object();
  return impl_->to_json(impl_->parser.push(text));
}

json ChatOutput::finish() { return impl_->to_json(impl_->parser.finish()); }

json ChatOutput::message() const {
  const OutputParser& p = impl_->parser;
  json m = {{"role", "assistant"}};
  const auto& calls = p.tool_calls();
  // No content beside tool calls or reasoning: null (OpenAI's, and vLLM's `content or None`).
  const bool none = p.content().empty() && (!calls.empty() || !p.reasoning().empty());
  m["content"] = none ? json(nullptr) : json(p.content());
  if (!p.reasoning().empty()) m["reasoning_content"] = p.reasoning();
  if (!calls.empty()) {
    json arr = json::array();
    for (size_t i = 0; i < calls.size(); ++i) {
      while (impl_->call_ids.size() <= i) impl_->call_ids.push_back(make_request_id("call_"));
      arr.push_back({{"id", impl_->call_ids[i]},
                     {"type", "function"},
                     {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}});
    }
    m["tool_calls"] = arr;
  }
  return m;
}

bool ChatOutput::has_tool_calls() const { return !impl_->parser.tool_calls().empty(); }

}  // namespace ds
