// The OpenAI API surface, without HTTP: request-body validation into engine requests (every
// field type- and range-checked, errors name the field), and the JSON shapes of responses,
// stream chunks, logprobs and errors ({"error": {"message", "type", "param", "code"}}).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/engine.h"

namespace ds {

// A request the server refuses: HTTP status plus the OpenAI error fields.
class ApiError : public Error {
 public:
  ApiError(int status, const std::string& msg, std::string param = {})
      : Error(msg), status(status), param(std::move(param)) {}
  int status;
  std::string param;
};

// {"error": {...}} for a status: type "invalid_request_error" (4xx), "authentication_error"
// (401), "not_found_error" (404), "rate_limit_error" (429), "server_error" (5xx).
nlohmann::ordered_json error_body(int status, const std::string& message,
                                  const std::string& param = {});

// Limits the server applies to every request.
struct ApiLimits {
  int max_logprobs = 20;  // top_logprobs / logprobs at most
  int max_n = 16;         // choices per request
  int max_stop = 16;      // stop strings
  int max_logit_bias = 1024;  // logit_bias entries
  // allowed_token_ids / stop_token_ids entries (each request's choices copy them, and the sampler
  // reads the allowed ones at every step): more than any vocabulary this server runs.
  int max_token_id_list = 262144;
};

// Fields common to /v1/completions and /v1/chat/completions, parsed and checked.
struct SamplingRequest {
  GenerationRequest gen;  // prompt left empty; max_tokens < 0 when not given
  int n = 1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // stream_options.continuous_usage_stats (vLLM's, with include_usage): every chunk carries its
  // choice's usage so far, not null.
  bool continuous_usage = false;
  bool logprobs = false;       // chat: logprobs flag; completions: logprobs field given
  // vLLM's extension "return_token_ids": choices carry "token_ids" (the generated ids; in a
  // stream, each chunk's new ones, so a client counts tokens exactly without logprobs or a
  // tokenizer) and "prompt_token_ids" (non-streaming, or the choice's first chunk).
  bool return_token_ids = false;
  // vLLM's prompt_logprobs given (gen.prompt_logprobs holds its n): completions choices carry
  // "prompt_logprobs", chat responses have it at the top level.
  bool prompt_logprobs = false;
  // vLLM's truncate_prompt_tokens: 0 none; k > 0 keep the prompt's last k tokens; -1 keep the
  // last max_model_len.
  int truncate_prompt_tokens = 0;
};

// Parses the sampling / stop / logprobs / stream fields of `body` (an object). `chat` selects the
// chat flavour of logprobs (bool + top_logprobs) over the completions one (int).
SamplingRequest parse_sampling_request(const nlohmann::ordered_json& body, bool chat,
                                       const ApiLimits& lim);

// The prompt of a completions request: a string, a list of ids, or a list of one of those
// (several prompts make several choices). Strings are returned as text, ids as ids.
struct PromptInput {
  std::optional<std::string> text;
  std::vector<int32_t> ids;
};
std::vector<PromptInput> parse_completion_prompts(const nlohmann::ordered_json& body);

// Checks and normalises the chat request for the template: messages (roles system / developer /
// user / assistant / tool; content a string, null, or a list of text parts, joined by "\n";
// a tool call's empty or null arguments as {}), tools, tool_choice ("auto", or "none": the tools
// are still rendered and `tool_choice_none` tells the server not to parse calls),
// add_generation_prompt, and chat_template_kwargs merged at top level over those (not over
// messages or tools). Returns the object ChatTemplate::render takes.
nlohmann::ordered_json chat_template_input(const nlohmann::ordered_json& body);

// vLLM's POST /tokenize: `prompt` (a string) or `messages` (chat, rendered with the model's
// template: chat_template_input's fields apply), not both; `add_special_tokens` (a boolean, no
// effect: the Qwen tokenizers' post-processor adds no tokens) and `return_token_strs`.
struct TokenizeRequest {
  std::optional<std::string> prompt;  // nullopt: a chat request (`messages`)
  bool return_token_strs = false;
};
TokenizeRequest parse_tokenize_request(const nlohmann::ordered_json& body);

// vLLM's POST /detokenize: `tokens`, a list of ids in [0, vocab_size).
std::vector<int32_t> parse_detokenize_request(const nlohmann::ordered_json& body, int vocab_size);

// Reads the body as a JSON object (ApiError 400 with the parser's message otherwise; also for
// nesting deeper than 512 levels, which later copies and dumps could not recurse through).
nlohmann::ordered_json parse_body(const std::string& body);
// parse_body for a request whose Content-Type header is `content_type` ("" when it has none): a
// type other than application/json or application/*+json is a 400, as FastAPI (vLLM) answers,
// so that a web page's form or text/plain POST (sent cross-site without a preflight) is refused.
nlohmann::ordered_json parse_body(const std::string& body, const std::string& content_type);

// Checks "model" when present: it must be one of `served` (404 otherwise).
void check_model(const nlohmann::ordered_json& body, const std::vector<std::string>& served);

// A unique id with a prefix ("cmpl-", "chatcmpl-").
std::string make_request_id(const char* prefix);

// UTF-8 text that is safe to put in JSON: invalid sequences replaced by U+FFFD.
std::string sanitize_utf8(const std::string& s);

}  // namespace ds
