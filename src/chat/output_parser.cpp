// Streaming output parser: reasoning / content / tool calls (see output_parser.h).
#include "chat/output_parser.h"

#include <algorithm>
#include <optional>

#include "chat/jinja_value.h"
#include "core/error.h"

namespace ds {
namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kToolOpen = "<tool_call>";
constexpr std::string_view kToolClose = "</tool_call>";
constexpr std::string_view kFunctionOpen = "<function=";
constexpr std::string_view kFunctionClose = "</function>";
constexpr std::string_view kParamOpen = "<parameter=";
constexpr std::string_view kParamClose = "</parameter>";
constexpr size_t kMaxTagLength = 4096;  // a `<function=...` without `>` this long is not a tag

bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

// s is a proper prefix of marker (so more text could complete it).
bool is_prefix_of(std::string_view s, std::string_view marker) {
  return s.size() < marker.size() && marker.substr(0, s.size()) == s;
}

// Length of the longest suffix of s that is a proper prefix of marker.
size_t partial_suffix(std::string_view s, std::string_view marker) {
  for (size_t n = std::min(s.size(), marker.size() - 1); n > 0; --n)
    if (s.substr(s.size() - n) == marker.substr(0, n)) return n;
  return 0;
}

// Trailing bytes of s that start a UTF-8 sequence not complete yet.
size_t incomplete_utf8_tail(std::string_view s) {
  size_t n = s.size();
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte
    size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return len > back ? back : 0;
  }
  return 0;
}

std::string trim_ws(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && is_ws(s[b])) ++b;
  while (e > b && is_ws(s[e - 1])) --e;
  return std::string(s.substr(b, e - b));
}

// json.dumps(v, ensure_ascii=False): the argument text OpenAI clients get (as vLLM produces it).
std::string dumps(const ojson& v) {
  return jinja::Value::from_json(v).to_json(jinja::JsonOptions{});
}

// dumps of a value parsed from model output, which may be one a template value cannot hold
// (nested deeper than 256 levels, an integer above INT64_MAX): nullopt then, never a throw
// (push() runs while the response is written).
std::optional<std::string> try_dumps(const ojson& v) {
  try {
    return dumps(v);
  } catch (const std::exception&) {  // ds::Error, or nlohmann's (invalid UTF-8, say)
    return std::nullopt;
  }
}

// s with every byte that is not UTF-8 as U+FFFD (arguments must be JSON a client can parse, and
// a template value's dump does not check).
std::string valid_utf8(const std::string& s) {
  return ojson::parse(ojson(s).dump(-1, ' ', false, ojson::error_handler_t::replace))
      .get<std::string>();
}

void append_args(OutputDelta& d, int index, const std::string& piece) {
  if (!d.tool_calls.empty() && d.tool_calls.back().index == index) {
    d.tool_calls.back().arguments += piece;
  } else {
    ToolCallDelta t;
    t.index = index;
    t.arguments = piece;
    d.tool_calls.push_back(std::move(t));
  }
}

std::vector<std::string> schema_types(const ojson& schema) {
  std::vector<std::string> types;
  if (!schema.is_object()) return types;
  auto t = schema.find("type");
  if (t != schema.end()) {
    if (t->is_string())
      types.push_back(t->get<std::string>());
    else if (t->is_array())
      for (const auto& x : *t)
        if (x.is_string()) types.push_back(x.get<std::string>());
  }
  for (const char* key : {"anyOf", "oneOf"}) {
    auto alt = schema.find(key);
    if (alt != schema.end() && alt->is_array())
      for (const auto& branch : *alt)
        for (auto& bt : schema_types(branch)) types.push_back(bt);
  }
  return types;
}

}  // namespace

OutputParser::OutputParser(bool starts_in_reasoning, const ojson& tools, bool parse_tool_calls)
    : state_(starts_in_reasoning ? State::kReasoning : State::kContent),
      parse_tool_calls_(parse_tool_calls) {
  tool_params_ = ojson::object();
  if (!tools.is_array()) return;
  for (const auto& tool : tools) {
    if (!tool.is_object()) continue;
    const ojson& fn =
        tool.contains("function") && tool["function"].is_object() ? tool["function"] : tool;
    if (!fn.contains("name") || !fn["name"].is_string()) continue;
    ojson props = ojson::object();
    if (fn.contains("parameters") && fn["parameters"].is_object() &&
        fn["parameters"].contains("properties") && fn["parameters"]["properties"].is_object())
      props = fn["parameters"]["properties"];
    tool_params_[fn["name"].get<std::string>()] = props;
  }
}

ojson OutputParser::convert_value(const std::string& param, const std::string& raw) const {
  auto tool = tool_params_.find(current_tool_);
  if (tool == tool_params_.end() || !tool->contains(param)) return raw;
  std::vector<std::string> types = schema_types((*tool)[param]);
  if (std::find(types.begin(), types.end(), "string") != types.end()) return raw;
  std::string t = trim_ws(raw);
  for (const std::string& type : types) {
    if (type == "boolean" || type == "bool") {
      std::string lower = t;
      std::transform(lower.begin(), lower.end(), lower.begin(),
                     [](unsigned char c) { return std::tolower(c); });
      if (lower == "true" || lower == "false") return lower == "true";
      continue;
    }
    if (type == "null") {
      if (t == "null" || t == "None") return nullptr;
      continue;
    }
    ojson parsed = ojson::parse(t, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded()) continue;
    if ((type == "integer" || type == "int") && parsed.is_number_integer()) return parsed;
    if ((type == "number" || type == "float") && parsed.is_number()) return parsed;
    if ((type == "object" || type == "dict") && parsed.is_object()) return parsed;
    if ((type == "array" || type == "list") && parsed.is_array()) return parsed;
  }
  return raw;
}

void OutputParser::emit_content(OutputDelta& d, std::string_view s) {
  if (s.empty()) return;
  d.content += s;
  content_ += s;
}

void OutputParser::emit_reasoning(OutputDelta& d, std::string_view s) {
  if (!reasoning_started_) {
    size_t i = 0;
    while (i < s.size() && s[i] == '\n') ++i;
    s.remove_prefix(i);
  }
  if (s.empty()) return;
  reasoning_started_ = true;
  d.reasoning += s;
  reasoning_ += s;
}

void OutputParser::open_call(OutputDelta& d, const std::string& name) {
  call_open_ = true;
  n_args_ = 0;
  current_tool_ = name;
  calls_.push_back(ParsedToolCall{name, ""});
  ToolCallDelta t;
  t.index = static_cast<int>(calls_.size()) - 1;
  t.name = name;
  d.tool_calls.push_back(std::move(t));
}

void OutputParser::add_argument(OutputDelta& d, const std::string& key,
                                const std::string& raw_value) {
  std::string_view v(raw_value);
  if (starts_with(v, "\n")) v.remove_prefix(1);  // the template writes ">\n" VALUE "\n</parameter>"
  if (!v.empty() && v.back() == '\n') v.remove_suffix(1);
  const std::string name = valid_utf8(key), text = valid_utf8(std::string(v));
  std::optional<std::string> value = try_dumps(convert_value(name, text));
  if (!value) value = dumps(ojson(text));  // the raw text, as a string
  std::string piece = (n_args_ == 0 ? "{" : ", ") + dumps(ojson(name)) + ": " + *value;
  ++n_args_;
  calls_.back().arguments += piece;
  append_args(d, static_cast<int>(calls_.size()) - 1, piece);
}

void OutputParser::close_call(OutputDelta& d) {
  if (!call_open_) return;
  std::string piece = n_args_ == 0 ? "{}" : "}";
  calls_.back().arguments += piece;
  append_args(d, static_cast<int>(calls_.size()) - 1, piece);
  call_open_ = false;
}

bool OutputParser::step(OutputDelta& d, bool final) {
  auto skip_ws = [this] {
    size_t i = 0;
    while (i < buf_.size() && is_ws(buf_[i])) ++i;
    buf_.erase(0, i);
  };
  switch (state_) {
    case State::kContent: {
      if (!content_started_) {  // `<think>` opens reasoning only before any content
        size_t i = 0;
        while (i < buf_.size() && is_ws(buf_[i])) ++i;
        std::string_view rest = std::string_view(buf_).substr(i);
        if (starts_with(rest, kThinkOpen)) {
          buf_.erase(0, i + kThinkOpen.size());
          state_ = State::kReasoning;
          return true;
        }
        if (!final && (rest.empty() || is_prefix_of(rest, kThinkOpen))) return false;
        content_started_ = true;
      }
      if (strip_newlines_ || drop_whitespace_) {
        size_t i = 0;
        while (i < buf_.size() && (drop_whitespace_ ? is_ws(buf_[i]) : buf_[i] == '\n')) ++i;
        buf_.erase(0, i);
        if (buf_.empty()) return false;
        strip_newlines_ = drop_whitespace_ = false;
      }
      if (parse_tool_calls_) {
        size_t pos = buf_.find(kToolOpen);
        if (pos != std::string::npos) {
          size_t end = pos;
          while (end > 0 && is_ws(buf_[end - 1]))
            --end;  // the template's "\n\n" before <tool_call>
          emit_content(d, std::string_view(buf_).substr(0, end));
          ws_before_tool_ = buf_.substr(end, pos - end);  // output again if not a call
          buf_.erase(0, pos + kToolOpen.size());
          state_ = State::kToolCall;
          return true;
        }
      }
      size_t end = buf_.size();
      if (!final) {
        if (parse_tool_calls_) {
          end -= partial_suffix(buf_, kToolOpen);
          while (end > 0 && is_ws(buf_[end - 1])) --end;
        }
        end -= incomplete_utf8_tail(std::string_view(buf_).substr(0, end));
      }
      emit_content(d, std::string_view(buf_).substr(0, end));
      buf_.erase(0, end);
      return false;
    }
    case State::kReasoning: {
      size_t pos = buf_.find(kThinkClose);
      if (pos != std::string::npos) {
        size_t end = pos;
        while (end > 0 && buf_[end - 1] == '\n') --end;
        emit_reasoning(d, std::string_view(buf_).substr(0, end));
        buf_.erase(0, pos + kThinkClose.size());
        state_ = State::kContent;
        content_started_ = true;
        strip_newlines_ = true;
        return true;
      }
      size_t end = buf_.size();
      if (!final) end -= partial_suffix(buf_, kThinkClose);
      while (end > 0 && buf_[end - 1] == '\n') --end;
      if (!final) end -= incomplete_utf8_tail(std::string_view(buf_).substr(0, end));
      emit_reasoning(d, std::string_view(buf_).substr(0, end));
      buf_.erase(0, final ? buf_.size() : end);
      return false;
    }
    case State::kToolCall: {
      size_t i = 0;  // whitespace stays in buf_ until we know this is a tool call
      while (i < buf_.size() && is_ws(buf_[i])) ++i;
      std::string_view rest = std::string_view(buf_).substr(i);
      if (rest.empty()) return false;
      if (starts_with(rest, kFunctionOpen)) {
        size_t gt = rest.find('>');
        if (gt == std::string::npos && rest.size() < kMaxTagLength) return false;
        if (gt != std::string::npos) {
          std::string name = trim_ws(rest.substr(kFunctionOpen.size(), gt - kFunctionOpen.size()));
          if (!name.empty()) {
            buf_.erase(0, i + gt + 1);
            open_call(d, name);
            state_ = State::kFunction;
            return true;
          }
        }
      } else if (rest[0] == '{') {
        state_ = State::kJsonCall;
        return true;
      } else if (is_prefix_of(rest, kFunctionOpen)) {
        return false;
      }
      // Not a tool call after all: the marker and the text are content, as written.
      emit_content(d, ws_before_tool_ + std::string(kToolOpen));
      state_ = State::kContent;
      content_started_ = true;
      return true;
    }
    case State::kFunction: {
      skip_ws();
      if (buf_.empty()) return false;
      if (starts_with(buf_, kParamOpen)) {
        size_t gt = buf_.find('>');
        if (gt == std::string::npos) {
          if (buf_.size() < kMaxTagLength) return false;
          buf_.erase(0, kParamOpen.size());  // junk: skip the broken tag
          return true;
        }
        param_name_ =
            trim_ws(std::string_view(buf_).substr(kParamOpen.size(), gt - kParamOpen.size()));
        buf_.erase(0, gt + 1);
        state_ = State::kParameter;
        return true;
      }
      if (starts_with(buf_, kFunctionClose)) {
        buf_.erase(0, kFunctionClose.size());
        close_call(d);
        state_ = State::kAfterFunction;
        return true;
      }
      if (is_prefix_of(buf_, kParamOpen) || is_prefix_of(buf_, kFunctionClose)) return false;
      if (starts_with(buf_, kToolClose)) {  // `</function>` missing
        close_call(d);
        state_ = State::kAfterFunction;
        return true;
      }
      if (is_prefix_of(buf_, kToolClose)) return false;
      size_t lt = buf_.find('<', 1);  // stray text between parameters: skip it
      buf_.erase(0, lt == std::string::npos ? buf_.size() : lt);
      return !buf_.empty();
    }
    case State::kParameter: {
      size_t pos = buf_.find(kParamClose);
      size_t fpos = buf_.find(kFunctionClose);
      if (fpos != std::string::npos &&
          (pos == std::string::npos || fpos < pos)) {  // `</parameter>` missing
        add_argument(d, param_name_, buf_.substr(0, fpos));
        buf_.erase(0, fpos);
        state_ = State::kFunction;
        return true;
      }
      if (pos == std::string::npos) return false;
      add_argument(d, param_name_, buf_.substr(0, pos));
      buf_.erase(0, pos + kParamClose.size());
      state_ = State::kFunction;
      return true;
    }
    case State::kAfterFunction: {
      skip_ws();
      if (buf_.empty()) return false;
      if (starts_with(buf_, kToolClose)) {
        buf_.erase(0, kToolClose.size());
      } else if (starts_with(buf_, kFunctionOpen)) {  // several functions in one <tool_call>
        state_ = State::kToolCall;
        return true;
      } else if (is_prefix_of(buf_, kToolClose) || is_prefix_of(buf_, kFunctionOpen)) {
        return false;
      }
      state_ = State::kContent;
      content_started_ = true;
      drop_whitespace_ = true;
      return true;
    }
    case State::kJsonCall: {
      size_t pos = buf_.find(kToolClose);
      if (pos == std::string::npos) return false;
      std::string text = buf_.substr(0, pos);
      buf_.erase(0, pos + kToolClose.size());
      if (!json_call(d, text))
        emit_content(d, ws_before_tool_ + std::string(kToolOpen) + text + std::string(kToolClose));
      state_ = State::kContent;
      content_started_ = true;
      drop_whitespace_ = true;
      return true;
    }
  }
  return false;
}

bool OutputParser::json_call(OutputDelta& d, const std::string& text) {
  ojson j = ojson::parse(text, nullptr, false);
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  std::string args = "{}";
  if (j.contains("arguments")) {
    const ojson& a = j["arguments"];
    std::optional<std::string> dumped;
    if (a.is_object()) {
      dumped = try_dumps(a);
    } else if (a.is_string()) {
      ojson inner = ojson::parse(a.get<std::string>(), nullptr, false);
      if (inner.is_object()) dumped = try_dumps(inner);
    }
    if (!dumped) return false;
    args = std::move(*dumped);
  }
  open_call(d, j["name"].get<std::string>());
  calls_.back().arguments = args;
  append_args(d, static_cast<int>(calls_.size()) - 1, args);
  call_open_ = false;
  return true;
}

bool OutputParser::prompt_ends_in_reasoning(std::string_view prompt) {
  // Only the turn being generated counts: a <think> in a user, system or tool message (or an
  // earlier assistant turn) says nothing about how the output starts.
  constexpr std::string_view kAssistantTurn = "<|im_start|>assistant";
  const size_t turn = prompt.rfind(kAssistantTurn);
  if (turn == std::string_view::npos) return false;
  const std::string_view tail = prompt.substr(turn + kAssistantTurn.size());
  const size_t open = tail.rfind(kThinkOpen);
  if (open == std::string_view::npos) return false;
  return tail.find(kThinkClose, open) == std::string_view::npos;
}

OutputDelta OutputParser::push(std::string_view text) {
  OutputDelta d;
  buf_.append(text);
  while (step(d, false)) {
  }
  return d;
}

OutputDelta OutputParser::finish() {
  OutputDelta d;
  while (step(d, true)) {
  }
  switch (state_) {
    case State::kJsonCall:
      // A JSON call the output ended in before its </tool_call> (a stop string at it, say) is
      // still a call when it parses, as vLLM's hermes parser reads it.
      if (json_call(d, buf_)) break;
      [[fallthrough]];
    case State::kToolCall:
      emit_content(d, ws_before_tool_ + std::string(kToolOpen));
      emit_content(d, buf_);
      break;
    case State::kFunction:
    case State::kParameter:
      close_call(d);
      break;
    default:
      break;
  }
  buf_.clear();
  state_ = State::kContent;
  return d;
}

}  // namespace ds
