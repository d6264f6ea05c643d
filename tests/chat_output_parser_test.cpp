// OutputParser: reasoning split and tool-call parsing, checked for every way of chunking the text
// (the result must not depend on where the stream is cut), plus a round trip through the real
// Qwen3.5 chat template (render an assistant turn, parse it back).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "chat/chat_template.h"
#include "chat/output_parser.h"

namespace ds {
namespace {

using ojson = nlohmann::ordered_json;

struct Result {
  std::string reasoning, content;
  std::vector<std::pair<std::string, std::string>> calls;  // name, arguments
  bool operator==(const Result& o) const {
    return reasoning == o.reasoning && content == o.content && calls == o.calls;
  }
};

std::ostream& operator<<(std::ostream& os, const Result& r) {
  os << "reasoning=" << ojson(r.reasoning).dump() << " content=" << ojson(r.content).dump()
     << " calls=[";
  for (auto& [n, a] : r.calls) os << n << a << " ";
  return os << "]";
}

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    auto c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!len || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += len;
  }
  return true;
}

// Feeds `chunks`, rebuilds the message from the deltas only, and checks it against the parser's
// own accumulated view and the deltas' invariants.
Result run_chunks(const std::vector<std::string>& chunks, bool in_reasoning, const ojson& tools) {
  OutputParser p(in_reasoning, tools);
  Result r;
  std::map<int, size_t> slot;
  auto apply = [&](const OutputDelta& d) {
    EXPECT_TRUE(valid_utf8(d.content)) << d.content;
    EXPECT_TRUE(valid_utf8(d.reasoning)) << d.reasoning;
    r.reasoning += d.reasoning;
    r.content += d.content;
    for (const ToolCallDelta& t : d.tool_calls) {
      if (!slot.count(t.index)) {
        EXPECT_FALSE(t.name.empty()) << "first delta of a call must carry its name";
        EXPECT_EQ(static_cast<size_t>(t.index), r.calls.size())
            << "calls must be announced in order";
        slot[t.index] = r.calls.size();
        r.calls.emplace_back(t.name, "");
      } else {
        EXPECT_TRUE(t.name.empty()) << "the name is sent once";
      }
      r.calls[slot[t.index]].second += t.arguments;
    }
  };
  for (const std::string& c : chunks) apply(p.push(c));
  apply(p.finish());
  EXPECT_EQ(r.reasoning, p.reasoning());
  EXPECT_EQ(r.content, p.content());
  EXPECT_EQ(r.calls.size(), p.tool_calls().size());
  for (size_t i = 0; i < r.calls.size() && i < p.tool_calls().size(); ++i) {
    EXPECT_EQ(r.calls[i].first, p.tool_calls()[i].name);
    EXPECT_EQ(r.calls[i].second, p.tool_calls()[i].arguments);
    EXPECT_FALSE(ojson::parse(r.calls[i].second, nullptr, false).is_discarded())
        << r.calls[i].second;
  }
  return r;
}

// The whole text at once, split at every byte position, and byte by byte: all must agree.
Result parse_all_ways(const std::string& text, bool in_reasoning = false,
                      const ojson& tools = ojson()) {
  Result whole = run_chunks({text}, in_reasoning, tools);
  for (size_t cut = 1; cut < text.size(); ++cut) {
    Result r = run_chunks({text.substr(0, cut), text.substr(cut)}, in_reasoning, tools);
    EXPECT_EQ(r, whole) << "split at byte " << cut;
    if (!(r == whole)) break;
  }
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  EXPECT_EQ(run_chunks(bytes, in_reasoning, tools), whole) << "byte by byte";
  return whole;
}

const ojson kTools = ojson::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "location": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "filters": {"type": "object"}, "tags": {"type": "array"},
    "note": {"type": ["string", "null"]}, "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}},
  {"name": "bare_tool", "parameters": {"properties": {"n": {"type": "integer"}}}}
])");

TEST(OutputParser, ReasoningFromPromptThenContent) {
  Result r = parse_all_ways("Let me think.\nStep 2 < 3\n\n</think>\n\nThe answer is 4.\n", true);
  EXPECT_EQ(r.reasoning, "Let me think.\nStep 2 < 3");
  EXPECT_EQ(r.content, "The answer is 4.\n");
  EXPECT_TRUE(r.calls.empty());
}

TEST(OutputParser, ThinkTagGeneratedByModel) {
  Result r = parse_all_ways("<think>\nplan\n</think>\n\nanswer");
  EXPECT_EQ(r.reasoning, "plan");
  EXPECT_EQ(r.content, "answer");
  r = parse_all_ways("\n <think>x</think>y");
  EXPECT_EQ(r.reasoning, "x");
  EXPECT_EQ(r.content, "y");
}

TEST(OutputParser, ThinkInsideContentIsContent) {
  Result r = parse_all_ways("a <think> b </think> c");
  EXPECT_EQ(r.reasoning, "");
  EXPECT_EQ(r.content, "a <think> b </think> c");
}

TEST(OutputParser, PlainContentWithAngleBracketsAndPartialMarkerAtEnd) {
  Result r = parse_all_ways("Hello <b>world</b> a < b and <tool_c");
  EXPECT_EQ(r.content, "Hello <b>world</b> a < b and <tool_c");
  r = parse_all_ways("x\n\n\n", false, kTools);
  EXPECT_EQ(r.content, "x\n\n\n");  // held whitespace comes out at the end
}

TEST(OutputParser, UnfinishedReasoning) {
  Result r = parse_all_ways("thinking about 中文 and 😀 </thi", true);
  EXPECT_EQ(r.reasoning, "thinking about 中文 and 😀 </thi");
  EXPECT_EQ(r.content, "");
}

TEST(OutputParser, Qwen35XmlToolCallWithTypes) {
  std::string text =
      "I'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=location>\nSão "
      "Paulo\n</parameter>\n"
      "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</"
      "parameter>\n<parameter=ratio>\n0.5\n"
      "</parameter>\n<parameter=filters>\n{\"a\": [1, "
      "2]}\n</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n"
      "<parameter=note>\nnull\n</parameter>\n<parameter=maybe>\n7\n</"
      "parameter>\n<parameter=unknown>\n42\n</parameter>\n"
      "</function>\n</tool_call>";
  Result r = parse_all_ways(text, false, kTools);
  EXPECT_EQ(r.content, "I'll check.");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].first, "get_weather");
  EXPECT_EQ(r.calls[0].second,
            "{\"location\": \"São Paulo\", \"days\": 3, \"metric\": true, \"ratio\": 0.5, "
            "\"filters\": {\"a\": [1, 2]}, "
            "\"tags\": [\"x\"], \"note\": \"null\", \"maybe\": 7, \"unknown\": \"42\"}");
}

TEST(OutputParser, ValuesThatDoNotMatchTheirTypeStayStrings) {
  std::string text =
      "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</"
      "parameter>\n<parameter=metric>\nyes\n"
      "</parameter>\n<parameter=filters>\n[1]\n</parameter>\n<parameter=location>\n  two\nlines  "
      "\n</parameter>\n"
      "</function>\n</tool_call>";
  Result r = parse_all_ways(text, false, kTools);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].second,
            "{\"days\": \"three\", \"metric\": \"yes\", \"filters\": \"[1]\", \"location\": \"  "
            "two\\nlines  \"}");
}

TEST(OutputParser, SeveralCallsNoToolsAndBareToolShape) {
  std::string text =
      "<tool_call>\n<function=bare_tool>\n<parameter=n>\n5\n</parameter>\n</function>\n</"
      "tool_call>\n"
      "<tool_call>\n<function=no_params>\n</function>\n</tool_call>\n\n";
  Result r = parse_all_ways(text, false, kTools);
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0], (std::pair<std::string, std::string>{"bare_tool", "{\"n\": 5}"}));
  EXPECT_EQ(r.calls[1], (std::pair<std::string, std::string>{"no_params", "{}"}));
  // Without tools every value stays a string.
  r = parse_all_ways(text);
  EXPECT_EQ(r.calls[0].second, "{\"n\": \"5\"}");
}

TEST(OutputParser, ReasoningThenToolCall) {
  std::string text =
      "need the "
      "weather\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=location>\nRome\n"
      "</parameter>\n</function>\n</tool_call>";
  Result r = parse_all_ways(text, true, kTools);
  EXPECT_EQ(r.reasoning, "need the weather");
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].second, "{\"location\": \"Rome\"}");
}

TEST(OutputParser, Qwen3JsonToolCall) {
  std::string text =
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"days\": "
      "2}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"a\\\":1}\"}\n</tool_call>";
  Result r = parse_all_ways(text, false, kTools);
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0], (std::pair<std::string, std::string>{
                            "get_weather", "{\"location\": \"Paris\", \"days\": 2}"}));
  EXPECT_EQ(r.calls[1], (std::pair<std::string, std::string>{"f", "{\"a\": 1}"}));
}

TEST(OutputParser, MalformedToolCallsBecomeContent) {
  Result r = parse_all_ways("<tool_call>oops</tool_call>");
  EXPECT_EQ(r.content, "<tool_call>oops</tool_call>");
  EXPECT_TRUE(r.calls.empty());
  r = parse_all_ways("<tool_call>\n{\"not\": \"a call\"}\n</tool_call>");
  EXPECT_EQ(r.content, "<tool_call>\n{\"not\": \"a call\"}\n</tool_call>");
  // Text that is no call comes back as written, the whitespace before the marker too (it was
  // dropped: "x<tool_call>"), as vLLM returns such output verbatim.
  r = parse_all_ways("x <tool_call>\n<func");  // cut off before the function name
  EXPECT_EQ(r.content, "x <tool_call>\n<func");
  r = parse_all_ways("Hello\n\n<tool_call>hello world");
  EXPECT_EQ(r.content, "Hello\n\n<tool_call>hello world");
  r = parse_all_ways("Hello\n\n<tool_call>\n{\"broken\": </tool_call>");
  EXPECT_EQ(r.content, "Hello\n\n<tool_call>\n{\"broken\": </tool_call>");
  EXPECT_TRUE(r.calls.empty());
}

// A Qwen3 JSON call the output ends in before its </tool_call> (a stop string there, or the
// length) is still a call when it parses, as vLLM's hermes parser reads it; one that does not
// parse stays content.
TEST(OutputParser, UnclosedJsonToolCallAtTheEnd) {
  Result r = parse_all_ways("Sure.\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n");
  EXPECT_EQ(r.content, "Sure.");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0], (std::pair<std::string, std::string>{"f", "{\"a\": 1}"}));
  r = parse_all_ways("Sure.\n<tool_call>\n{\"name\": \"f\", \"argu");
  EXPECT_TRUE(r.calls.empty());
  EXPECT_EQ(r.content, "Sure.\n<tool_call>\n{\"name\": \"f\", \"argu");
}

// A parameter name or value with bytes that are not UTF-8 (the server's detokenizer never gives
// such text; the parser must not throw on it anyway): U+FFFD in the arguments.
TEST(OutputParser, ParameterWithInvalidUtf8DoesNotThrow) {
  const std::string text =
      "<tool_call>\n<function=f>\n<parameter=k\xff>\nv\xfe\n</parameter>\n</function>\n</tool_call>";
  Result r;
  EXPECT_NO_THROW(r = run_chunks({text}, false, ojson()));
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(ojson::parse(r.calls[0].second).size(), 1u);
}

// Model output is not bounded like request JSON: arguments nested deeper than a template value
// may be (256) or holding an integer above INT64_MAX made jinja::Value::from_json throw inside
// push(), on the HTTP thread writing the response, which killed the server. Such a JSON call stays
// content; such an XML parameter value stays a string.
TEST(OutputParser, ArgumentsAJinjaValueCannotHoldDoNotThrow) {
  const std::string deep = std::string(300, '[') + std::string(300, ']');
  const std::string big = "18446744073709551615";
  for (const std::string& args : {"{\"a\": " + deep + "}", "{\"a\": " + big + "}",
                                  ojson("{\"a\": " + deep + "}").dump()}) {
    const std::string text =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " + args + "}\n</tool_call>";
    Result r = run_chunks({text}, false, kTools);
    EXPECT_TRUE(r.calls.empty()) << args;
    EXPECT_EQ(r.content, text);
  }
  for (const auto& [param, value] : {std::pair<std::string, std::string>{"filters", "{\"a\": " + deep + "}"},
                                     {"tags", deep}, {"days", big}}) {
    const std::string text = "<tool_call>\n<function=get_weather>\n<parameter=" + param + ">\n" +
                             value + "\n</parameter>\n</function>\n</tool_call>";
    Result r = run_chunks({text}, false, kTools);
    ASSERT_EQ(r.calls.size(), 1u) << param;
    EXPECT_EQ(r.calls[0].second, "{\"" + param + "\": " + ojson(value).dump() + "}");
  }
}

TEST(OutputParser, TruncatedCallIsClosed) {
  Result r = parse_all_ways(
      "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</"
      "parameter>\n<parameter=days>\n3",
      false, kTools);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].second, "{\"location\": \"Paris\"}");
}

TEST(OutputParser, TextAfterToolCallIsContent) {
  Result r = parse_all_ways("<tool_call>\n<function=f>\n</function>\n</tool_call>\n\nDone.");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.content, "Done.");
}

TEST(OutputParser, ToolCallsCanBeLeftAsContent) {
  OutputParser p(false, ojson(), /*parse_tool_calls=*/false);
  OutputDelta d = p.push("a\n<tool_call>\n<function=f>\n</function>\n</tool_call>");
  OutputDelta e = p.finish();
  EXPECT_EQ(d.content + e.content, "a\n<tool_call>\n<function=f>\n</function>\n</tool_call>");
  EXPECT_TRUE(p.tool_calls().empty());
}

TEST(OutputParser, PromptEndsInReasoning) {
  EXPECT_TRUE(OutputParser::prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n"));
  EXPECT_FALSE(
      OutputParser::prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
  EXPECT_FALSE(OutputParser::prompt_ends_in_reasoning("<|im_start|>assistant\n"));
  EXPECT_FALSE(OutputParser::prompt_ends_in_reasoning(""));
  // A <think> in the user's (or a system, or a tool) message is text, not the output's state.
  EXPECT_FALSE(OutputParser::prompt_ends_in_reasoning(
      "<|im_start|>user\nWhat does the <think> tag do?<|im_end|>\n<|im_start|>assistant\n"));
  EXPECT_FALSE(OutputParser::prompt_ends_in_reasoning(
      "<|im_start|>system\nWrap notes in <think> tags.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
      "<|im_start|>assistant\n<think>\n\n</think>\n\n"));
  EXPECT_TRUE(OutputParser::prompt_ends_in_reasoning(
      "<|im_start|>user\nthe <think> tag<|im_end|>\n<|im_start|>assistant\n<think>\n"));
  // A continued assistant message that opened its reasoning (continue_final_message).
  EXPECT_TRUE(OutputParser::prompt_ends_in_reasoning(
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nLet me see"));
  EXPECT_FALSE(OutputParser::prompt_ends_in_reasoning("no turns here <think>"));
}

// Render an assistant turn with the real Qwen3.5 template, parse the generated part back.
TEST(OutputParser, RoundTripThroughQwen35Template) {
  std::filesystem::path dir = std::filesystem::path(DS_SHARED_DATA) / "tokenizers" / "qwen3.5";
  if (!std::filesystem::exists(dir / "tokenizer_config.json")) GTEST_SKIP() << dir << " absent";
  ChatTemplate tmpl = ChatTemplate::load(dir.string());
  ojson args =
      ojson::parse(R"({"location": "Zürich \"HQ\"", "days": 14, "metric": false, "ratio": 2.5,
                                "filters": {"k": [1, {"x": null}]}, "tags": ["a", "b"], "note": "multi\nline"})");
  ojson req = {{"messages",
                {{{"role", "user"}, {"content", "weather?"}},
                 {{"role", "assistant"},
                  {"content", "Checking."},
                  {"reasoning_content", "The user wants weather."},
                  {"tool_calls",
                   {{{"type", "function"},
                     {"function", {{"name", "get_weather"}, {"arguments", args}}}}}}}}},
               {"tools", kTools}};
  std::string prompt = tmpl.render(req);
  const std::string head = "<|im_start|>assistant\n";
  size_t b = prompt.rfind(head);
  ASSERT_NE(b, std::string::npos);
  size_t e = prompt.find("<|im_end|>", b);
  std::string generated = prompt.substr(b + head.size(), e - b - head.size());
  Result r = parse_all_ways(generated, false, kTools);
  EXPECT_EQ(r.reasoning, "The user wants weather.");
  EXPECT_EQ(r.content, "Checking.");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].first, "get_weather");
  EXPECT_EQ(ojson::parse(r.calls[0].second), args);
}

}  // namespace
}  // namespace ds
