// Chat output assembly: see chat_output.h. (Interim: content only, until ds::OutputParser lands.)
#include "server/chat_output.h"

namespace ds {

using json = nlohmann::ordered_json;

struct ChatOutput::Impl {
  std::string content;
};

ChatOutput::ChatOutput(bool, const json&) : impl_(std::make_unique<Impl>()) {}
ChatOutput::~ChatOutput() = default;

json ChatOutput::push(const std::string& text) {
  impl_->content += text;
  if (text.empty()) return json::object();
  return json{{"content", text}};
}
json ChatOutput::finish() { return json::object(); }
json ChatOutput::message() const { return json{{"role", "assistant"}, {"content", impl_->content}}; }
bool ChatOutput::has_tool_calls() const { return false; }

}  // namespace ds
