// OpenAI request validation and response shapes: see openai.h.
#include "server/openai.h"

#include "core/file_io.h"

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

namespace ds {

using json = nlohmann::ordered_json;

nlohmann::ordered_json error_body(int status, const std::string& message,
                                  const std::string& param) {
  const char* type = "invalid_request_error";
  if (status == 401)
    type = "authentication_error";
  else if (status == 404)
    type = "not_found_error";
  else if (status == 429)
    type = "rate_limit_error";
  else if (status >= 500)
    type = "server_error";
  json err = {{"message", sanitize_utf8(message)}, {"type", type}, {"code", status}};
  err["param"] = param.empty() ? json(nullptr) : json(param);
  return json{{"error", err}};
}

namespace {

constexpr int kMaxBodyDepth = 512;  // JSON nesting of a request body (see parse_body)

// JSON text nested deeper than kMaxBodyDepth is refused before it is parsed: nlohmann parses any
// depth, but copying, comparing and dumping a value recurse (200000 '[' overflow an HTTP thread's
// stack later on).
bool nested_too_deep(const std::string& text) { return json_nested_deeper_than(text, kMaxBodyDepth); }

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer";
    case json::value_t::number_float:
      return "a number";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    default:
      return "an unsupported value";
  }
}

[[noreturn]] void bad(const std::string& field, const std::string& msg) {
  throw ApiError(400, "'" + field + "' " + msg, field);
}

// Present and not null.
const json* field(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

// An integer in [lo, hi]; integral floats (16.0) are accepted, anything else is an error.
std::optional<int64_t> get_int(const json& obj, const char* key, int64_t lo, int64_t hi) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  int64_t x = 0;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    if (u > static_cast<uint64_t>(hi))
      bad(key, "must be at most " + std::to_string(hi) + ", got " + std::to_string(u));
    x = static_cast<int64_t>(u);
  } else if (v->is_number_integer()) {
    x = v->get<int64_t>();
  } else if (v->is_number_float()) {
    const double d = v->get<double>();
    if (!std::isfinite(d) || d != std::floor(d))
      bad(key, std::string("must be an integer, got ") + v->dump());
    // (int64's range in doubles is [-2^63, 2^63): 2^63 itself does not convert, and a bound
    // near it does not convert to a double exactly, so the bounds are checked on x below.)
    if (d < -0x1p63 || d >= 0x1p63 || d < static_cast<double>(lo) ||
        d > static_cast<double>(hi)) {
      bad(key, "must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " +
                   v->dump());
    }
    x = static_cast<int64_t>(d);
  } else {
    bad(key, std::string("must be an integer, got ") + type_name(*v));
  }
  if (x < lo || x > hi) {
    bad(key, "must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " +
                 std::to_string(x));
  }
  return x;
}

std::optional<double> get_number(const json& obj, const char* key, double lo, double hi) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad(key, std::string("must be a number, got ") + type_name(*v));
  const double d = v->get<double>();
  if (!std::isfinite(d) || d < lo || d > hi) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "must be between %g and %g, got %s", lo, hi, v->dump().c_str());
    bad(key, buf);
  }
  return d;
}

std::optional<bool> get_bool(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) bad(key, std::string("must be a boolean, got ") + type_name(*v));
  return v->get<bool>();
}

// A list of at most `max` token ids (non-negative int32).
std::optional<std::vector<int32_t>> get_id_list(const json& obj, const char* key, int max) {
  const json* ids = field(obj, key);
  if (!ids) return std::nullopt;
  if (!ids->is_array()) bad(key, std::string("must be a list of integers, got ") + type_name(*ids));
  if (static_cast<int64_t>(ids->size()) > max)
    bad(key, "has more than " + std::to_string(max) + " ids");
  std::vector<int32_t> out;
  out.reserve(ids->size());
  for (const json& x : *ids) {
    if (!x.is_number_integer() || x.get<int64_t>() < 0 ||
        x.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      bad(key, "must be a list of non-negative integers, found " + x.dump());
    }
    out.push_back(static_cast<int32_t>(x.get<int64_t>()));
  }
  return out;
}

}  // namespace

nlohmann::ordered_json parse_body(const std::string& body, const std::string& content_type) {
  std::string media = content_type.substr(0, content_type.find(';'));
  while (!media.empty() && (media.back() == ' ' || media.back() == '\t')) media.pop_back();
  media.erase(0, std::min(media.size(), media.find_first_not_of(" \t")));
  for (char& c : media) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const std::string app = "application/", suffix = "+json";
  const bool json_type =
      media == "application/json" ||
      (media.starts_with(app) && media.size() > app.size() + suffix.size() &&
       media.ends_with(suffix));
  if (!content_type.empty() && !json_type) {
    throw ApiError(400, "the request body must be JSON: Content-Type '" + content_type +
                            "' is not application/json");
  }
  return parse_body(body);
}

nlohmann::ordered_json parse_body(const std::string& body) {
  if (body.empty()) throw ApiError(400, "the request body is empty (a JSON object is expected)");
  if (nested_too_deep(body)) {
    throw ApiError(400, "the request body is nested deeper than " + std::to_string(kMaxBodyDepth) +
                            " levels");
  }
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e999
    throw ApiError(400, std::string("invalid JSON in the request body: ") + e.what());
  }
  if (!j.is_object())
    throw ApiError(400, std::string("the request body must be a JSON object, got ") + type_name(j));
  return j;
}

void check_model(const nlohmann::ordered_json& body, const std::vector<std::string>& served) {
  const json* m = field(body, "model");
  if (!m) return;
  if (!m->is_string()) bad("model", std::string("must be a string, got ") + type_name(*m));
  const std::string name = m->get<std::string>();
  for (const std::string& s : served) {
    if (s == name) return;
  }
  throw ApiError(404, "The model `" + name + "` does not exist.", "model");
}

SamplingRequest parse_sampling_request(const nlohmann::ordered_json& b, bool chat,
                                       const ApiLimits& lim) {
  SamplingRequest r;
  GenerationRequest& g = r.gen;
  g.max_tokens = -1;
  std::optional<int64_t> max_tokens;
  if (chat)
    max_tokens = get_int(b, "max_completion_tokens", 1, std::numeric_limits<int32_t>::max());
  if (!max_tokens) max_tokens = get_int(b, "max_tokens", 1, std::numeric_limits<int32_t>::max());
  if (max_tokens) g.max_tokens = static_cast<int>(*max_tokens);

  SamplingParams& s = g.sampling;
  if (auto t = get_number(b, "temperature", 0.0, 100.0)) s.temperature = static_cast<float>(*t);
  // top_p and repetition_penalty must stay > 0 as floats: 1e-300 passes a check in double but is
  // 0 in the engine's float (which refused it with the wrong field named).
  if (auto p = get_number(b, "top_p", 0.0, 1.0)) {
    s.top_p = static_cast<float>(*p);
    if (s.top_p <= 0.0f) bad("top_p", "must be in (0, 1], got " + b["top_p"].dump());
  }
  if (auto k = get_int(b, "top_k", -1, std::numeric_limits<int32_t>::max()))
    s.top_k = static_cast<int>(*k);
  if (auto m = get_number(b, "min_p", 0.0, 1.0)) s.min_p = static_cast<float>(*m);
  if (auto p = get_number(b, "presence_penalty", -2.0, 2.0))
    s.presence_penalty = static_cast<float>(*p);
  if (auto p = get_number(b, "frequency_penalty", -2.0, 2.0))
    s.frequency_penalty = static_cast<float>(*p);
  if (auto p = get_number(b, "repetition_penalty", 0.0, 100.0)) {
    s.repetition_penalty = static_cast<float>(*p);
    if (s.repetition_penalty <= 0.0f)
      bad("repetition_penalty", "must be > 0, got " + b["repetition_penalty"].dump());
  }
  if (auto seed = get_int(b, "seed", std::numeric_limits<int64_t>::min(),
                          std::numeric_limits<int64_t>::max())) {
    s.seed = static_cast<uint64_t>(*seed);
  }
  if (auto n = get_int(b, "n", 1, lim.max_n)) r.n = static_cast<int>(*n);
  if (auto best_of = get_int(b, "best_of", 1, lim.max_n)) {
    if (*best_of != r.n) bad("best_of", "is not supported (only best_of == n)");
  }

  if (const json* stop = field(b, "stop")) {
    if (stop->is_string()) {
      g.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (static_cast<int>(stop->size()) > lim.max_stop)
        bad("stop", "has more than " + std::to_string(lim.max_stop) + " strings");
      for (const json& x : *stop) {
        if (!x.is_string())
          bad("stop", std::string("must be a string or a list of strings, found ") + type_name(x));
        g.stop.push_back(x.get<std::string>());
      }
    } else {
      bad("stop", std::string("must be a string or a list of strings, got ") + type_name(*stop));
    }
    for (const std::string& x : g.stop) {
      if (x.empty()) bad("stop", "must not contain empty strings");
    }
  }
  if (auto ids = get_id_list(b, "stop_token_ids", lim.max_token_id_list))
    g.stop_token_ids = std::move(*ids);
  if (auto v = get_bool(b, "ignore_eos")) g.ignore_eos = *v;
  if (auto v = get_bool(b, "include_stop_str_in_output")) g.include_stop_str = *v;
  // vLLM's min_tokens: EOS and the stop ids are not sampled, and stop strings do not apply,
  // before that many tokens (the engine checks it against max_tokens once that is known).
  if (auto m = get_int(b, "min_tokens", 0, std::numeric_limits<int32_t>::max()))
    g.min_tokens = static_cast<int>(*m);
  if (auto v = get_bool(b, "skip_special_tokens")) g.skip_special_tokens = *v;

  if (chat) {
    if (auto v = get_bool(b, "logprobs")) r.logprobs = *v;
    auto top = get_int(b, "top_logprobs", 0, lim.max_logprobs);
    // (0 without logprobs is what some clients send by default: vLLM takes it too.)
    if (top && *top > 0 && !r.logprobs) bad("top_logprobs", "requires 'logprobs' to be true");
    if (r.logprobs) g.top_logprobs = top ? static_cast<int>(*top) : 0;
  } else {
    const json* lp = field(b, "logprobs");
    if (lp && lp->is_boolean())
      bad("logprobs", "must be an integer (the number of top log probabilities) for completions");
    if (auto n = get_int(b, "logprobs", 0, lim.max_logprobs)) {
      r.logprobs = true;
      g.top_logprobs = static_cast<int>(*n);
    }
  }

  if (auto v = get_bool(b, "stream")) r.stream = *v;
  if (auto v = get_bool(b, "return_token_ids")) r.return_token_ids = *v;
  if (const json* so = field(b, "stream_options")) {
    if (!so->is_object())
      bad("stream_options", std::string("must be an object, got ") + type_name(*so));
    if (!r.stream) bad("stream_options", "is only allowed when 'stream' is true");
    if (auto v = get_bool(*so, "include_usage")) r.include_usage = *v;
    if (auto v = get_bool(*so, "continuous_usage_stats")) r.continuous_usage = *v && r.include_usage;
  }
  // OpenAI's logit_bias: {"token id": bias in [-100, 100]}; ids past the vocabulary are refused
  // by the engine.
  if (const json* lb = field(b, "logit_bias")) {
    if (!lb->is_object())
      bad("logit_bias", std::string("must be an object, got ") + type_name(*lb));
    if (static_cast<int>(lb->size()) > lim.max_logit_bias)
      bad("logit_bias", "has more than " + std::to_string(lim.max_logit_bias) + " entries");
    for (const auto& [key, v] : lb->items()) {
      // The key: a token id in canonical decimal ("0", "42"; no sign, blank or leading zero).
      int64_t id = -1;
      if (!key.empty() && key.size() <= 10 && (key == "0" || key[0] != '0') &&
          std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        id = std::stoll(key);
      }
      if (id < 0 || id > std::numeric_limits<int32_t>::max())
        bad("logit_bias", "keys must be token ids (decimal integers), got \"" + key + "\"");
      if (!v.is_number() || !std::isfinite(v.get<double>()) || std::fabs(v.get<double>()) > 100.0)
        bad("logit_bias", "values must be numbers in [-100, 100], got " + v.dump() + " for " + key);
      s.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(v.get<double>()));
    }
  }
  // vLLM's allowed_token_ids: only these ids may be sampled (non-empty; ids past the vocabulary
  // are refused by the engine).
  if (auto ids = get_id_list(b, "allowed_token_ids", lim.max_token_id_list)) {
    if (ids->empty()) bad("allowed_token_ids", "must not be empty");
    s.allowed_token_ids = std::move(*ids);
  }
  // vLLM's truncate_prompt_tokens: keep only the last k prompt tokens (-1: the context length).
  if (auto k = get_int(b, "truncate_prompt_tokens", -1, std::numeric_limits<int32_t>::max())) {
    if (*k == 0) bad("truncate_prompt_tokens", "must be -1 or at least 1, got 0");
    r.truncate_prompt_tokens = static_cast<int>(*k);
  }
  // Accepted with no effect: the fast (Rust-style) detokenizer of vLLM ignores it too.
  (void)get_bool(b, "spaces_between_special_tokens");
  // vLLM options that change the output and that this server cannot honour: refused by name,
  // never ignored.
  for (const char* f : {"guided_json", "guided_regex", "guided_choice", "guided_grammar",
                        "structural_tag", "structured_outputs"}) {
    if (field(b, f)) bad(f, "is not supported (no constrained decoding)");
  }
  // vLLM's prompt_logprobs: each prompt token's logprob, rank and the n most probable ids
  // (non-streaming only, as vLLM).
  if (auto n = get_int(b, "prompt_logprobs", 0, lim.max_logprobs)) {
    if (r.stream) bad("prompt_logprobs", "is not available when 'stream' is true");
    r.prompt_logprobs = true;
    g.prompt_logprobs = static_cast<int>(*n);
  }
  if (field(b, "bad_words")) bad("bad_words", "is not supported");
  if (field(b, "logits_processors")) bad("logits_processors", "is not supported");
  if (field(b, "prompt_embeds")) bad("prompt_embeds", "is not supported");
  if (get_bool(b, "use_beam_search").value_or(false))
    bad("use_beam_search", "is not supported (sampling and greedy only)");
  if (!get_bool(b, "detokenize").value_or(true))
    bad("detokenize", "is not supported (only true); use return_token_ids for the ids");
  if (get_bool(b, "return_tokens_as_token_ids").value_or(false))
    bad("return_tokens_as_token_ids", "is not supported");
  if (auto pr = get_int(b, "priority", std::numeric_limits<int32_t>::min(),
                        std::numeric_limits<int32_t>::max());
      pr && *pr != 0) {
    bad("priority", "is not supported (first come, first served; only 0)");
  }
  if (const json* rf = field(b, "response_format")) {
    if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string()) {
      bad("response_format", "must be an object with a string 'type'");
    }
    if ((*rf)["type"] != "text") bad("response_format", "only {\"type\": \"text\"} is supported");
  }
  if (const json* u = field(b, "user")) {
    if (!u->is_string()) bad("user", std::string("must be a string, got ") + type_name(*u));
  }
  return r;
}

TokenizeRequest parse_tokenize_request(const nlohmann::ordered_json& b) {
  TokenizeRequest r;
  (void)get_bool(b, "add_special_tokens");  // type only (see openai.h)
  if (auto v = get_bool(b, "return_token_strs")) r.return_token_strs = *v;
  const json* prompt = field(b, "prompt");
  if (field(b, "messages")) {
    if (prompt) bad("prompt", "give either 'prompt' or 'messages', not both");
    return r;
  }
  if (!prompt) throw ApiError(400, "'prompt' or 'messages' is required", "prompt");
  if (!prompt->is_string())
    bad("prompt", std::string("must be a string, got ") + type_name(*prompt));
  r.prompt = prompt->get<std::string>();
  return r;
}

std::vector<int32_t> parse_detokenize_request(const nlohmann::ordered_json& b, int vocab_size) {
  const json* tokens = field(b, "tokens");
  if (!tokens) throw ApiError(400, "'tokens' is required", "tokens");
  if (!tokens->is_array())
    bad("tokens", std::string("must be a list of token ids, got ") + type_name(*tokens));
  std::vector<int32_t> ids;
  ids.reserve(tokens->size());
  for (const json& x : *tokens) {
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= vocab_size) {
      bad("tokens", "must be token ids in [0, " + std::to_string(vocab_size) + "), found " +
                        x.dump());
    }
    ids.push_back(static_cast<int32_t>(x.get<int64_t>()));
  }
  return ids;
}

std::vector<PromptInput> parse_completion_prompts(const nlohmann::ordered_json& b) {
  const json* p = field(b, "prompt");
  if (!p) throw ApiError(400, "'prompt' is required", "prompt");
  auto ids_of = [](const json& arr) {
    PromptInput in;
    for (const json& x : arr) {
      if (!x.is_number_integer())
        bad("prompt", "token lists must hold integers, found " + x.dump());
      const int64_t v = x.get<int64_t>();
      if (v < 0 || v > std::numeric_limits<int32_t>::max())
        bad("prompt", "token id out of range: " + x.dump());
      in.ids.push_back(static_cast<int32_t>(v));
    }
    return in;
  };
  std::vector<PromptInput> out;
  if (p->is_string()) {
    out.push_back(PromptInput{p->get<std::string>(), {}});
  } else if (p->is_array()) {
    if (p->empty()) bad("prompt", "must not be empty");
    if ((*p)[0].is_number()) {
      out.push_back(ids_of(*p));
    } else {
      for (const json& x : *p) {
        if (x.is_string())
          out.push_back(PromptInput{x.get<std::string>(), {}});
        else if (x.is_array())
          out.push_back(ids_of(x));
        else
          bad("prompt", std::string("must be a string, a list of strings, a list of token ids or a "
                                    "list of such lists; found ") +
                            type_name(x));
      }
    }
  } else {
    bad("prompt", std::string("must be a string or a list, got ") + type_name(*p));
  }
  for (const PromptInput& in : out) {
    if (in.text ? in.text->empty() : in.ids.empty()) bad("prompt", "must not be empty");
  }
  return out;
}

nlohmann::ordered_json chat_template_input(const nlohmann::ordered_json& b) {
  const json* msgs = field(b, "messages");
  if (!msgs) throw ApiError(400, "'messages' is required", "messages");
  if (!msgs->is_array()) bad("messages", std::string("must be a list, got ") + type_name(*msgs));
  if (msgs->empty()) bad("messages", "must not be empty");
  json messages = json::array();
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) bad(where, std::string("must be an object, got ") + type_name(m));
    const json* role = field(m, "role");
    if (!role || !role->is_string()) bad(where + ".role", "is required and must be a string");
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";
    if (r != "system" && r != "user" && r != "assistant" && r != "tool") {
      bad(where + ".role",
          "must be one of system, developer, user, assistant, tool; got '" + r + "'");
    }
    json out = m;
    out["role"] = r;
    const json* content = field(m, "content");
    if (!content) {
      if (r != "assistant") bad(where + ".content", "is required for role '" + r + "'");
      out["content"] = "";
    } else if (content->is_array()) {
      std::string text;
      for (size_t k = 0; k < content->size(); ++k) {
        const json& part = (*content)[k];
        const std::string pw = where + ".content[" + std::to_string(k) + "]";
        if (!part.is_object()) bad(pw, "must be an object");
        const json* type = field(part, "type");
        if (!type || !type->is_string()) bad(pw + ".type", "is required");
        if (*type != "text")
          bad(pw + ".type", "'" + type->get<std::string>() + "' is not supported (text only)");
        const json* t = field(part, "text");
        if (!t || !t->is_string()) bad(pw + ".text", "is required and must be a string");
        // Parts are joined line by line, as vLLM renders them for a text-only template.
        if (k > 0) text += '\n';
        text += t->get<std::string>();
      }
      out["content"] = text;
    } else if (!content->is_string()) {
      bad(where + ".content",
          std::string("must be a string or a list of content parts, got ") + type_name(*content));
    }
    if (const json* tc = field(m, "tool_calls")) {
      if (r != "assistant") bad(where + ".tool_calls", "is only allowed in assistant messages");
      if (!tc->is_array()) bad(where + ".tool_calls", "must be a list");
      json calls = json::array();
      for (size_t k = 0; k < tc->size(); ++k) {
        const std::string cw = where + ".tool_calls[" + std::to_string(k) + "]";
        const json& c = (*tc)[k];
        if (!c.is_object() || !c.contains("function") || !c["function"].is_object())
          bad(cw, "must be an object with a 'function' object");
        json call = c;
        const json& fn = c["function"];
        if (!fn.contains("name") || !fn["name"].is_string())
          bad(cw + ".function.name", "is required and must be a string");
        const bool no_arguments =
            !fn.contains("arguments") || fn["arguments"].is_null() ||
            (fn["arguments"].is_string() && fn["arguments"].get_ref<const std::string&>().empty());
        if (no_arguments) {
          // A call of a function without parameters: {} (as vLLM), which templates can iterate.
          call["function"]["arguments"] = json::object();
        } else if (fn["arguments"].is_string()) {
          // Templates iterate the arguments as a mapping (vLLM / transformers do the same).
          const std::string& text = fn["arguments"].get_ref<const std::string&>();
          if (nested_too_deep(text)) {
            bad(cw + ".function.arguments",
                "is nested deeper than " + std::to_string(kMaxBodyDepth) + " levels");
          }
          try {
            call["function"]["arguments"] = json::parse(text);
          } catch (const json::exception&) {  // parse_error, or out_of_range for 1e999
            bad(cw + ".function.arguments", "is not valid JSON");
          }
          if (!call["function"]["arguments"].is_object())
            bad(cw + ".function.arguments", "must be a JSON object");
        }
        calls.push_back(call);
      }
      out["tool_calls"] = calls;
    }
    if (r == "tool" && m.contains("tool_call_id") && !m["tool_call_id"].is_string() &&
        !m["tool_call_id"].is_null()) {
      bad(where + ".tool_call_id", "must be a string");
    }
    messages.push_back(out);
  }

  json input = json::object();
  input["messages"] = messages;
  // vLLM's continue_final_message: the last message is left open for the model to continue (the
  // template does it as transformers does); it implies no generation prompt unless one is asked
  // for, which contradicts it.
  const std::optional<bool> agp = get_bool(b, "add_generation_prompt");
  const bool cont = get_bool(b, "continue_final_message").value_or(false);
  if (cont) {
    if (agp.value_or(false))
      bad("continue_final_message", "cannot be true together with 'add_generation_prompt'");
    input["continue_final_message"] = true;
  }
  input["add_generation_prompt"] = agp.value_or(!cont);
  // A template in the request is code the server would run: vLLM refuses it unless trusted by a
  // flag; this server always uses its own.
  if (field(b, "chat_template"))
    bad("chat_template", "is not supported (the server's chat template is used)");
  // The request's template variables win over the defaults above (add_generation_prompt too), as
  // in vLLM; the messages and tools are the ones checked here.
  if (const json* kw = field(b, "chat_template_kwargs")) {
    if (!kw->is_object())
      bad("chat_template_kwargs", std::string("must be an object, got ") + type_name(*kw));
    for (auto it = kw->begin(); it != kw->end(); ++it) {
      if (it.key() != "messages" && it.key() != "tools") input[it.key()] = it.value();
    }
  }
  if (auto v = get_bool(b, "echo"); v && *v)
    bad("echo", "is not supported for chat completions");

  std::string tool_choice = "auto";
  if (const json* tc = field(b, "tool_choice")) {
    if (tc->is_string()) {
      tool_choice = tc->get<std::string>();
      if (tool_choice == "required")
        bad("tool_choice", "'required' is not supported (no constrained decoding); use 'auto'");
      if (tool_choice != "auto" && tool_choice != "none")
        bad("tool_choice", "must be 'auto' or 'none', got '" + tool_choice + "'");
    } else if (tc->is_object()) {
      bad("tool_choice",
          "naming a function is not supported (no constrained decoding); use 'auto'");
    } else {
      bad("tool_choice", std::string("must be a string, got ") + type_name(*tc));
    }
  }
  if (const json* tools = field(b, "tools")) {
    if (!tools->is_array()) bad("tools", std::string("must be a list, got ") + type_name(*tools));
    for (size_t k = 0; k < tools->size(); ++k) {
      const json& t = (*tools)[k];
      const std::string tw = "tools[" + std::to_string(k) + "]";
      if (!t.is_object()) bad(tw, "must be an object");
      if (!t.contains("type") || t["type"] != "function") bad(tw + ".type", "must be 'function'");
      if (!t.contains("function") || !t["function"].is_object())
        bad(tw + ".function", "is required and must be an object");
      const json& fn = t["function"];
      if (!fn.contains("name") || !fn["name"].is_string() ||
          fn["name"].get<std::string>().empty()) {
        bad(tw + ".function.name", "is required and must be a non-empty string");
      }
      if (fn.contains("parameters") && !fn["parameters"].is_object() &&
          !fn["parameters"].is_null()) {
        bad(tw + ".function.parameters", "must be an object (a JSON schema)");
      }
    }
    // With tool_choice "none" the tools are still rendered (vLLM's default): only the output is
    // not parsed for calls (tool_choice_none, for the server).
    if (!tools->empty()) input["tools"] = *tools;
  }
  if (tool_choice == "none") input["tool_choice_none"] = true;
  return input;
}

std::string make_request_id(const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt =
      std::random_device{}() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const uint64_t x = (counter.fetch_add(1) + 1) * 0x9E3779B97F4A7C15ull ^ salt;
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return std::string(prefix) + buf;
}

std::string sanitize_utf8(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    int len = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    }
    bool ok = len > 0 && i + len <= n;
    for (int k = 1; ok && k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80)
        ok = false;
      else
        cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (ok) {
      const uint32_t min_cp = len == 2 ? 0x80 : len == 3 ? 0x800 : 0x10000;
      if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) ok = false;
    }
    if (ok) {
      out.append(s, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

}  // namespace ds
