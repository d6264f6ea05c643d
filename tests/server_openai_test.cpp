// Server pieces without HTTP: request validation (types, ranges, the field named in the error),
// chat input normalisation, error bodies, UTF-8 sanitising, Prometheus histograms, and the chat
// output assembly (reasoning split, Qwen tool calls into OpenAI tool_calls) being the same whether
// the text arrives at once or byte by byte.
#include <gtest/gtest.h>

#include "server/chat_output.h"
#include "server/metrics.h"
#include "server/openai.h"

namespace ds {
namespace {

using json = nlohmann::ordered_json;

int status_of(const std::function<void()>& f, std::string* param = nullptr) {
  try {
    f();
  } catch (const ApiError& e) {
    if (param) *param = e.param;
    return e.status;
  }
  return 0;
}

TEST(ServerOpenAI, ParseBodyChecksTheContentType) {
  for (const char* ok : {"", "application/json", "application/json; charset=utf-8",
                         "Application/JSON", " application/json ;charset=UTF-8",
                         "application/merge-patch+json"}) {
    EXPECT_EQ(parse_body("{\"a\": 1}", ok)["a"], 1) << ok;
  }
  for (const char* bad : {"text/plain", "application/x-www-form-urlencoded",
                          "multipart/form-data; boundary=x", "text/json", "application/+json",
                          "application/jsonx", "json"}) {
    EXPECT_EQ(status_of([&] { parse_body("{\"a\": 1}", bad); }), 400) << bad;
  }
}

TEST(ServerOpenAI, ParseBody) {
  EXPECT_EQ(status_of([] { parse_body("{\"a\": 1"); }), 400);
  EXPECT_EQ(status_of([] { parse_body(""); }), 400);
  EXPECT_EQ(status_of([] { parse_body("[1]"); }), 400);
  EXPECT_EQ(status_of([] { parse_body("{\"p\": \"\xff\"}"); }), 400);  // invalid UTF-8
  // A number beyond double is nlohmann's out_of_range, not a parse_error: it was a 500.
  EXPECT_EQ(status_of([] { parse_body("{\"max_tokens\": 1e999}"); }), 400);
  EXPECT_EQ(status_of([] { parse_body("{\"a\": [-1e400]}"); }), 400);
  EXPECT_EQ(parse_body("{\"a\": 1}")["a"], 1);
}

// 200000 '[' parse (nlohmann's parser is iterative) but then crashed the server: copying and
// dumping a value recurse, and the HTTP thread's stack overflowed. Deep bodies are refused.
TEST(ServerOpenAI, ParseBodyRefusesDeepNesting) {
  auto nested = [](int depth, char open, char close) {
    return std::string(depth, open) + std::string(depth, close);
  };
  EXPECT_EQ(status_of([&] { parse_body("{\"prompt\": " + nested(200000, '[', ']') + "}"); }), 400);
  std::string deep_objects;
  for (int i = 0; i < 1000; ++i) deep_objects += "{\"a\":";
  deep_objects += "1" + std::string(1000, '}');
  EXPECT_EQ(status_of([&] { parse_body(deep_objects); }), 400);
  // 500 levels are fine, and brackets inside strings (escaped quotes too) are text.
  const json ok = parse_body("{\"p\": " + nested(500, '[', ']') + ", \"s\": \"\\\"" +
                             std::string(5000, '[') + "\"}");
  EXPECT_EQ(ok["s"].get<std::string>().size(), 5001u);
}

TEST(ServerOpenAI, SamplingFields) {
  ApiLimits lim;
  SamplingRequest r = parse_sampling_request(
      json::parse(R"({"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": -1,
                      "stop": "END", "stop_token_ids": [5], "stream": true,
                      "stream_options": {"include_usage": true}, "logprobs": 3, "n": 2})"),
      false, lim);
  EXPECT_EQ(r.gen.max_tokens, 7);
  EXPECT_FLOAT_EQ(r.gen.sampling.temperature, 0.5f);
  EXPECT_EQ(r.gen.sampling.top_k, 40);
  EXPECT_EQ(*r.gen.sampling.seed, ~0ull);
  EXPECT_EQ(r.gen.stop, std::vector<std::string>{"END"});
  EXPECT_EQ(r.gen.stop_token_ids, std::vector<int32_t>{5});
  EXPECT_TRUE(r.stream && r.include_usage && r.logprobs);
  EXPECT_EQ(r.gen.top_logprobs, 3);
  EXPECT_EQ(r.n, 2);
  EXPECT_FALSE(r.return_token_ids);  // off unless asked for
  r = parse_sampling_request(json::parse(R"({"return_token_ids": true})"), false, lim);
  EXPECT_TRUE(r.return_token_ids);
  r = parse_sampling_request(json::parse(R"({"return_token_ids": null})"), true, lim);
  EXPECT_FALSE(r.return_token_ids);
  // Chat: max_completion_tokens wins; logprobs bool + top_logprobs.
  r = parse_sampling_request(
      json::parse(
          R"({"max_tokens": 7, "max_completion_tokens": 9, "logprobs": true, "top_logprobs": 2})"),
      true, lim);
  EXPECT_EQ(r.gen.max_tokens, 9);
  EXPECT_EQ(r.gen.top_logprobs, 2);
  r = parse_sampling_request(json::parse("{}"), true, lim);
  EXPECT_EQ(r.gen.max_tokens, -1);
  EXPECT_EQ(r.gen.top_logprobs, -1);
  EXPECT_EQ(r.gen.max_tokens, -1);
  EXPECT_FALSE(r.prompt_logprobs);
  EXPECT_EQ(r.gen.prompt_logprobs, -1);
  // vLLM's prompt_logprobs (null: not asked for).
  r = parse_sampling_request(json::parse(R"({"prompt_logprobs": 4})"), true, lim);
  EXPECT_TRUE(r.prompt_logprobs);
  EXPECT_EQ(r.gen.prompt_logprobs, 4);
  r = parse_sampling_request(json::parse(R"({"prompt_logprobs": null, "stream": true})"), false,
                             lim);
  EXPECT_FALSE(r.prompt_logprobs);
  EXPECT_EQ(r.gen.prompt_logprobs, -1);
  // seed: int64's range; a float at 2^63 (what 9223372036854775807.0 is as a double) is past it
  // (it was cast to int64, undefined behaviour), -2^63 is its least value.
  auto seed_status = [&](const char* body) {
    return status_of([&] { parse_sampling_request(json::parse(body), false, lim); });
  };
  EXPECT_EQ(seed_status(R"({"seed": 9223372036854775807.0})"), 400);
  EXPECT_EQ(seed_status(R"({"seed": 9223372036854775808})"), 400);
  EXPECT_EQ(seed_status(R"({"seed": 1e19})"), 400);
  EXPECT_EQ(seed_status(R"({"seed": -1e19})"), 400);
  EXPECT_EQ(seed_status(R"({"seed": 9223372036854775807})"), 0);
  EXPECT_EQ(seed_status(R"({"seed": -9223372036854775808})"), 0);
  EXPECT_EQ(seed_status(R"({"seed": -9223372036854775808.0})"), 0);
  EXPECT_EQ(seed_status(R"({"seed": 4611686018427387904.0})"), 0);  // 2^62
  r = parse_sampling_request(json::parse(R"({"max_tokens": 16.0, "temperature": null})"), false,
                             lim);
  EXPECT_EQ(r.gen.max_tokens, 16);

  const std::vector<std::pair<const char*, const char*>> bad = {
      {R"({"max_tokens": -1})", "max_tokens"},
      {R"({"max_tokens": 0})", "max_tokens"},
      {R"({"max_tokens": "3"})", "max_tokens"},
      {R"({"max_tokens": 1e30})", "max_tokens"},
      {R"({"max_tokens": 18446744073709551615})", "max_tokens"},
      {R"({"max_tokens": 3.5})", "max_tokens"},
      {R"({"max_tokens": true})", "max_tokens"},
      {R"({"temperature": "x"})", "temperature"},
      {R"({"temperature": -0.1})", "temperature"},
      {R"({"top_p": 0})", "top_p"},
      {R"({"top_p": 1e-300})", "top_p"},  // > 0 as a double, 0 as the engine's float
      {R"({"repetition_penalty": 1e-300})", "repetition_penalty"},
      {R"({"top_k": -2})", "top_k"},
      {R"({"n": 17})", "n"},
      {R"({"best_of": 3})", "best_of"},
      {R"({"stop": [1]})", "stop"},
      {R"({"stop": {"a": 1}})", "stop"},
      {R"({"stop_token_ids": [1.5]})", "stop_token_ids"},
      {R"({"stream": 1})", "stream"},
      {R"({"return_token_ids": "yes"})", "return_token_ids"},
      {R"({"stream_options": {"include_usage": true}})", "stream_options"},
      {R"({"logprobs": 21})", "logprobs"},
      {R"({"logprobs": true})", "logprobs"},
      {R"({"logit_bias": [1, 2]})", "logit_bias"},
      {R"({"logit_bias": {"x": 2}})", "logit_bias"},
      {R"({"logit_bias": {"-1": 2}})", "logit_bias"},
      {R"({"logit_bias": {"01": 2}})", "logit_bias"},
      {R"({"logit_bias": {" 1": 2}})", "logit_bias"},
      {R"({"logit_bias": {"4294967296": 2}})", "logit_bias"},
      {R"({"logit_bias": {"1": 100.5}})", "logit_bias"},
      {R"({"logit_bias": {"1": "2"}})", "logit_bias"},
      {R"({"min_tokens": -1})", "min_tokens"},
      {R"({"allowed_token_ids": []})", "allowed_token_ids"},
      {R"({"allowed_token_ids": [-1]})", "allowed_token_ids"},
      {R"({"allowed_token_ids": 5})", "allowed_token_ids"},
      {R"({"truncate_prompt_tokens": 0})", "truncate_prompt_tokens"},
      {R"({"truncate_prompt_tokens": -2})", "truncate_prompt_tokens"},
      {R"({"spaces_between_special_tokens": 1})", "spaces_between_special_tokens"},
      {R"({"guided_json": {"type": "object"}})", "guided_json"},
      {R"({"guided_regex": "a+"})", "guided_regex"},
      {R"({"guided_choice": ["a", "b"]})", "guided_choice"},
      {R"({"guided_grammar": "root ::= x"})", "guided_grammar"},
      {R"({"structural_tag": "{}"})", "structural_tag"},
      {R"({"structured_outputs": {"json": {}}})", "structured_outputs"},
      {R"({"prompt_logprobs": -1})", "prompt_logprobs"},
      {R"({"prompt_logprobs": 21})", "prompt_logprobs"},
      {R"({"prompt_logprobs": true})", "prompt_logprobs"},
      {R"({"prompt_logprobs": 1, "stream": true})", "prompt_logprobs"},
      {R"({"bad_words": ["x"]})", "bad_words"},
      {R"({"logits_processors": ["x"]})", "logits_processors"},
      {R"({"prompt_embeds": "AAAA"})", "prompt_embeds"},
      {R"({"use_beam_search": true})", "use_beam_search"},
      {R"({"detokenize": false})", "detokenize"},
      {R"({"return_tokens_as_token_ids": true})", "return_tokens_as_token_ids"},
      {R"({"priority": 1})", "priority"},
      {R"({"min_tokens": 1.5})", "min_tokens"},
      {R"({"user": 5})", "user"},
  };
  for (const auto& [body, field] : bad) {
    std::string param;
    EXPECT_EQ(status_of([&] { parse_sampling_request(json::parse(body), false, lim); }, &param),
              400)
        << body;
    EXPECT_EQ(param, field) << body;
  }
  std::string param;
  EXPECT_EQ(
      status_of([&] { parse_sampling_request(json::parse(R"({"top_logprobs": 2})"), true, lim); },
                &param),
      400);
  EXPECT_EQ(param, "top_logprobs");
}

// logit_bias and min_tokens reach the engine's request as given (ids and bounds past the
// vocabulary or max_tokens are the engine's to refuse).
TEST(ServerOpenAI, LogitBiasAndMinTokens) {
  const ApiLimits lim;
  const SamplingRequest r = parse_sampling_request(
      json::parse(R"({"logit_bias": {"0": -100, "42": 2.5, "2147483647": 100}, "min_tokens": 7})"),
      false, lim);
  using P = std::pair<int32_t, float>;
  EXPECT_EQ(r.gen.sampling.logit_bias,
            (std::vector<P>{{0, -100.0f}, {42, 2.5f}, {2147483647, 100.0f}}));
  EXPECT_EQ(r.gen.min_tokens, 7);
  const SamplingRequest a = parse_sampling_request(
      json::parse(R"({"allowed_token_ids": [3, 1], "truncate_prompt_tokens": -1, "priority": 0,
                     "use_beam_search": false, "detokenize": true, "prompt_logprobs": null,
                     "spaces_between_special_tokens": false})"),
      false, lim);
  EXPECT_EQ(a.gen.sampling.allowed_token_ids, (std::vector<int32_t>{3, 1}));
  EXPECT_EQ(a.truncate_prompt_tokens, -1);
  EXPECT_TRUE(parse_sampling_request(json::parse(R"({"logit_bias": {}})"), false, lim)
                  .gen.sampling.logit_bias.empty());
  ApiLimits few;
  few.max_logit_bias = 2;
  std::string param;
  EXPECT_EQ(status_of(
                [&] {
                  parse_sampling_request(json::parse(R"({"logit_bias": {"1": 1, "2": 1, "3": 1}})"),
                                         false, few);
                },
                &param),
            400);
  EXPECT_EQ(param, "logit_bias");
}

// /tokenize and /detokenize bodies: what is parsed, and each bad form a 400 naming its field.
TEST(ServerOpenAI, TokenizeAndDetokenizeRequests) {
  TokenizeRequest t = parse_tokenize_request(json::parse(R"({"prompt": "hi"})"));
  EXPECT_EQ(t.prompt, std::optional<std::string>("hi"));
  EXPECT_FALSE(t.return_token_strs);
  t = parse_tokenize_request(json::parse(
      R"({"messages": [], "return_token_strs": true, "add_special_tokens": false})"));
  EXPECT_FALSE(t.prompt);  // chat: the messages are the template's to check
  EXPECT_TRUE(t.return_token_strs);
  for (const auto& [body, field] : std::vector<std::pair<const char*, const char*>>{
           {R"({})", "prompt"},
           {R"({"prompt": 1})", "prompt"},
           {R"({"prompt": ["a"]})", "prompt"},
           {R"({"prompt": "a", "messages": []})", "prompt"},
           {R"({"prompt": "a", "add_special_tokens": 1})", "add_special_tokens"},
           {R"({"prompt": "a", "return_token_strs": "yes"})", "return_token_strs"}}) {
    std::string param;
    EXPECT_EQ(status_of([&] { parse_tokenize_request(json::parse(body)); }, &param), 400) << body;
    EXPECT_EQ(param, field) << body;
  }
  EXPECT_EQ(parse_detokenize_request(json::parse(R"({"tokens": [0, 5, 9]})"), 10),
            (std::vector<int32_t>{0, 5, 9}));
  EXPECT_TRUE(parse_detokenize_request(json::parse(R"({"tokens": []})"), 10).empty());
  for (const char* body : {R"({})", R"({"tokens": 3})", R"({"tokens": [10]})",
                           R"({"tokens": [-1]})", R"({"tokens": [1.0]})", R"({"tokens": ["1"]})",
                           R"({"tokens": [1e30]})"}) {
    std::string param;
    EXPECT_EQ(status_of([&] { parse_detokenize_request(json::parse(body), 10); }, &param), 400)
        << body;
    EXPECT_EQ(param, "tokens") << body;
  }
}

TEST(ServerOpenAI, CompletionPrompts) {
  auto p = parse_completion_prompts(json::parse(R"({"prompt": "hi"})"));
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(*p[0].text, "hi");
  p = parse_completion_prompts(json::parse(R"({"prompt": [1, 2, 3]})"));
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].ids, (std::vector<int32_t>{1, 2, 3}));
  p = parse_completion_prompts(json::parse(R"({"prompt": ["a", [4], "b"]})"));
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p[1].ids, std::vector<int32_t>{4});
  for (const char* body : {R"({})", R"({"prompt": 3})", R"({"prompt": []})", R"({"prompt": ""})",
                           R"({"prompt": [[]]})", R"({"prompt": [1, "a"]})", R"({"prompt": [-1]})",
                           R"({"prompt": [true]})"}) {
    EXPECT_EQ(status_of([&] { parse_completion_prompts(json::parse(body)); }), 400) << body;
  }
}

TEST(ServerOpenAI, ChatInput) {
  json in = chat_template_input(json::parse(R"({
      "messages": [{"role": "developer", "content": "be brief"},
                   {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                   {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "42"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "chat_template_kwargs": {"enable_thinking": true}})"));
  EXPECT_EQ(in["messages"][0]["role"], "system");
  EXPECT_EQ(in["messages"][1]["content"], "a\nb");  // parts line by line, as vLLM
  EXPECT_EQ(in["messages"][2]["content"], "");
  EXPECT_EQ(in["messages"][2]["tool_calls"][0]["function"]["arguments"]["x"],
            1);  // parsed for the template
  EXPECT_EQ(in["tools"].size(), 1u);
  EXPECT_EQ(in["enable_thinking"], true);
  EXPECT_EQ(in["add_generation_prompt"], true);
  // tool_choice none: the tools are still rendered (vLLM's default), only not parsed for.
  json none = chat_template_input(json::parse(R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"})"));
  EXPECT_EQ(none["tools"].size(), 1u);
  EXPECT_EQ(none["tool_choice_none"], true);
  EXPECT_FALSE(in.contains("tool_choice_none"));
  // A call of a function without parameters: arguments missing, null or "" are {} (as vLLM).
  for (const char* args : {"", R"(, "arguments": null)", R"(, "arguments": "")"}) {
    json e = chat_template_input(json::parse(
        std::string(R"({"messages": [{"role": "assistant", "content": null, "tool_calls":
            [{"id": "c", "type": "function", "function": {"name": "f")") +
        args + "}}]}]}"));
    EXPECT_EQ(e["messages"][0]["tool_calls"][0]["function"]["arguments"], json::object()) << args;
  }
  // chat_template_kwargs win over the defaults (add_generation_prompt), not over the messages.
  json kw = chat_template_input(json::parse(R"({"messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": {"add_generation_prompt": false, "messages": [], "tools": [1]}})"));
  EXPECT_EQ(kw["add_generation_prompt"], false);
  EXPECT_EQ(kw["messages"].size(), 1u);
  EXPECT_FALSE(kw.contains("tools"));
  // top_logprobs 0 without logprobs is accepted (some clients send it by default); above 0 not.
  EXPECT_EQ(status_of([] {
              parse_sampling_request(json::parse(R"({"top_logprobs": 0})"), true, ApiLimits{});
            }),
            0);
  EXPECT_EQ(status_of([] {
              parse_sampling_request(json::parse(R"({"top_logprobs": 1})"), true, ApiLimits{});
            }),
            400);

  const std::vector<std::pair<const char*, const char*>> bad = {
      {R"({})", "messages"},
      {R"({"messages": []})", "messages"},
      {R"({"messages": [{"role": "alien", "content": "x"}]})", "messages[0].role"},
      {R"({"messages": [{"role": "user"}]})", "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
       "messages[0].content[0].type"},
      {R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})",
       "messages[0].tool_calls"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})",
       "tool_choice"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]})",
       "tools[0].function.name"},
  };
  for (const auto& [body, field] : bad) {
    std::string param;
    EXPECT_EQ(status_of([&] { chat_template_input(json::parse(body)); }, &param), 400) << body;
    EXPECT_EQ(param, field) << body;
  }
  // Tool-call arguments are JSON text parsed here: a number beyond double was a 500 (nlohmann's
  // out_of_range), and 200000 '[' in the string crashed the server (copying the parsed value
  // recursed through the HTTP thread's stack; the body's own depth check skips strings).
  auto with_args = [](const std::string& args) {
    json b = {{"messages", json::array({{{"role", "assistant"},
                                         {"tool_calls", json::array({{{"function",
                                                                       {{"name", "f"},
                                                                        {"arguments", args}}}}})}}})}};
    return b;
  };
  for (const std::string& args :
       {std::string(R"({"a": 1e999})"),
        R"({"a": )" + std::string(200000, '[') + std::string(200000, ']') + "}"}) {
    std::string param;
    EXPECT_EQ(status_of([&] { chat_template_input(with_args(args)); }, &param), 400);
    EXPECT_EQ(param, "messages[0].tool_calls[0].function.arguments");
  }
}

TEST(ServerOpenAI, ModelCheckAndErrorBody) {
  EXPECT_EQ(status_of([] { check_model(json::parse(R"({"model": "x"})"), {"m"}); }), 404);
  EXPECT_EQ(status_of([] { check_model(json::parse(R"({"model": "m"})"), {"m"}); }), 0);
  EXPECT_EQ(status_of([] { check_model(json::parse(R"({})"), {"m"}); }), 0);
  json e = error_body(429, "busy");
  EXPECT_EQ(e["error"]["type"], "rate_limit_error");
  EXPECT_EQ(e["error"]["code"], 429);
  EXPECT_TRUE(e["error"]["param"].is_null());
  EXPECT_EQ(error_body(401, "k")["error"]["type"], "authentication_error");
  EXPECT_EQ(error_body(400, "bad \xff", "f")["error"]["message"], "bad \xEF\xBF\xBD");
}

TEST(ServerOpenAI, SanitizeUtf8) {
  EXPECT_EQ(sanitize_utf8("ok é 你 🎉"), "ok é 你 🎉");
  EXPECT_EQ(sanitize_utf8("a\xC3"), "a\xEF\xBF\xBD");
  EXPECT_EQ(sanitize_utf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(sanitize_utf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");                  // overlong
}

TEST(ServerMetrics, HistogramAndRender) {
  Histogram h({0.1, 1.0});
  h.observe(0.05);
  h.observe(0.5);
  h.observe(5);
  std::string out;
  h.render("x", out);
  EXPECT_NE(out.find("x_bucket{le=\"0.1\"} 1\n"), std::string::npos);
  EXPECT_NE(out.find("x_bucket{le=\"1\"} 2\n"), std::string::npos);
  EXPECT_NE(out.find("x_bucket{le=\"+Inf\"} 3\n"), std::string::npos);
  EXPECT_NE(out.find("x_count 3\n"), std::string::npos);
  ServerMetrics m;
  m.count_http("/v1/completions", 200);
  StreamOutput o;
  o.finish = FinishReason::kStop;
  o.n_prompt_tokens = 5;
  o.n_generated = 3;
  o.ttft_s = 0.1;
  o.e2e_s = 0.3;
  m.record_request(o);
  EngineStats st;
  st.memory.state_slots_total = 4;
  const std::string text = m.render(st);
  EXPECT_NE(
      text.find("deltaserve_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1"),
      std::string::npos);
  EXPECT_NE(text.find("deltaserve_request_finished_total{finish_reason=\"stop\"} 1"),
            std::string::npos);
  EXPECT_NE(text.find("deltaserve_state_slots_total 4"), std::string::npos);
  EXPECT_NE(text.find("deltaserve_time_per_output_token_seconds_sum 0.1"), std::string::npos);
}

// Streams `text` through ChatOutput in pieces of `step` bytes, merging the deltas as a client does.
json stream_merge(const std::string& text, size_t step, bool reasoning, const json& tools) {
  ChatOutput out(reasoning, tools);
  json msg = {{"content", ""}, {"reasoning_content", ""}, {"tool_calls", json::array()}};
  auto merge = [&](const json& d) {
    if (d.contains("content"))
      msg["content"] = msg["content"].get<std::string>() + d["content"].get<std::string>();
    if (d.contains("reasoning_content")) {
      msg["reasoning_content"] =
          msg["reasoning_content"].get<std::string>() + d["reasoning_content"].get<std::string>();
    }
    if (d.contains("tool_calls")) {
      for (const json& c : d["tool_calls"]) {
        const int i = c["index"];
        if (c.contains("id")) {
          EXPECT_EQ(static_cast<int>(msg["tool_calls"].size()), i);
          EXPECT_EQ(c["type"], "function");
          msg["tool_calls"].push_back(
              {{"name", c["function"]["name"]}, {"arguments", c["function"]["arguments"]}});
        } else {
          EXPECT_LT(i, static_cast<int>(msg["tool_calls"].size()));
          json& t = msg["tool_calls"][i];
          t["arguments"] =
              t["arguments"].get<std::string>() + c["function"]["arguments"].get<std::string>();
        }
      }
    }
  };
  for (size_t i = 0; i < text.size(); i += step) merge(out.push(text.substr(i, step)));
  merge(out.finish());
  // Same as the non-streaming message.
  json full = out.message();
  EXPECT_EQ(msg["content"], full["content"].is_null() ? json("") : full["content"]);
  EXPECT_EQ(msg["reasoning_content"], full.value("reasoning_content", json("")));
  const json calls = full.value("tool_calls", json::array());
  EXPECT_EQ(msg["tool_calls"].size(), calls.size());
  for (size_t i = 0; i < calls.size() && i < msg["tool_calls"].size(); ++i) {
    EXPECT_EQ(msg["tool_calls"][i]["name"], calls[i]["function"]["name"]);
    EXPECT_EQ(json::parse(msg["tool_calls"][i]["arguments"].get<std::string>()),
              json::parse(calls[i]["function"]["arguments"].get<std::string>()));
  }
  msg["has_tool_calls"] = out.has_tool_calls();
  return msg;
}

TEST(ServerChatOutput, ReasoningAndXmlToolCallsStreamedAnyChunking) {
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}])");
  const std::string text =
      "Let me check.\n</think>\n\nChecking the weather.\n\n<tool_call>\n<function=get_weather>\n"
      "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</"
      "tool_call>";
  for (size_t step : {1, 2, 3, 7, 1000}) {
    json m = stream_merge(text, step, /*reasoning=*/true, tools);
    EXPECT_EQ(m["reasoning_content"], "Let me check.") << step;
    EXPECT_EQ(m["content"], "Checking the weather.") << step;
    ASSERT_EQ(m["tool_calls"].size(), 1u) << step;
    EXPECT_EQ(m["tool_calls"][0]["name"], "get_weather");
    const json args = json::parse(m["tool_calls"][0]["arguments"].get<std::string>());
    EXPECT_EQ(args["city"], "Paris");
    EXPECT_EQ(args["days"], 3);  // integer by the schema
    EXPECT_TRUE(m["has_tool_calls"].get<bool>());
  }
}

TEST(ServerChatOutput, NoToolsMeansToolMarkupStaysContent) {
  const std::string text = "plain answer <tool_call>\n<function=f>\n</function>\n</tool_call>";
  json m = stream_merge(text, 2, false, json());
  EXPECT_EQ(m["content"], text);
  EXPECT_FALSE(m["has_tool_calls"].get<bool>());
  ChatOutput out(false, json());
  out.push("hello");
  out.finish();
  EXPECT_EQ(out.message()["content"], "hello");
  EXPECT_FALSE(out.message().contains("tool_calls"));
  // Reasoning and no answer (cut off while thinking): content null, as vLLM; nothing at all: "".
  ChatOutput thinking(true, json());
  thinking.push("still thinking");
  thinking.finish();
  EXPECT_TRUE(thinking.message()["content"].is_null());
  EXPECT_EQ(thinking.message()["reasoning_content"], "still thinking");
  ChatOutput empty(false, json());
  empty.finish();
  EXPECT_EQ(empty.message()["content"], "");
}

}  // namespace
}  // namespace ds
