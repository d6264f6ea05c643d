// The OpenAI-compatible HTTP server: see server.h.
#include "server/server.h"

#include <httplib.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <thread>
#include <utility>

#include "chat/output_parser.h"
#include "server/chat_output.h"

namespace ds {

using json = nlohmann::ordered_json;
using Ms = std::chrono::milliseconds;

namespace {

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

const char* finish_reason_api(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "abort";
    case FinishReason::kError:
      return "error";
    case FinishReason::kNone:
      break;
  }
  return nullptr;
}

// The server's routes and their methods (405 with Allow for another method; metrics labels).
constexpr std::pair<const char*, const char*> kRoutes[] = {
    {"/health", "GET, HEAD"},    {"/version", "GET, HEAD"},        {"/v1/models", "GET, HEAD"},
    {"/metrics", "GET, HEAD"},   {"/v1/completions", "POST"},      {"/v1/chat/completions", "POST"},
    {"/tokenize", "POST"},       {"/detokenize", "POST"}};

std::string endpoint_label(const std::string& path) {
  for (const auto& [p, allow] : kRoutes) {
    if (path == p) return p;
  }
  return "other";
}

int status_of(RejectedError::Kind k) {
  switch (k) {
    case RejectedError::Kind::kInvalid:
      return 400;
    case RejectedError::Kind::kQueueFull:
      return 429;
    case RejectedError::Kind::kShuttingDown:
      return 503;
  }
  return 400;
}

// The text a token stands for on its own (logprobs "token" fields).
std::string token_text(const Tokenizer* tok, int32_t id) {
  if (!tok || id >= tok->vocab_size()) return "token_id:" + std::to_string(id);
  const int32_t one[1] = {id};
  return sanitize_utf8(tok->decode(std::span<const int32_t>(one, 1)));
}

// Characters (code points) of UTF-8 text: OpenAI's text_offset counts characters.
size_t utf8_length(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

json token_bytes_json(const Tokenizer* tok, int32_t id) {
  json b = json::array();
  if (!tok || id >= tok->vocab_size()) return b;
  for (unsigned char c : tok->token_bytes(id)) b.push_back(static_cast<int>(c));
  return b;
}

}  // namespace

// One generation request in flight: its choices (streams) and how to render them.
struct Server::Job {
  struct Choice {
    std::shared_ptr<RequestStream> stream;
    int index = 0;
    int prompt_index = 0;
    std::string echo;                    // completions with echo: the prompt text
    bool echo_lp = false;                // echo with logprobs: the prompt's entries not yet sent
    int32_t first_prompt_id = 0;         // the echo's first token (it has no logprob)
    std::vector<GeneratedToken> prompt_lp;  // prompt tokens 1.. (echo logprobs, prompt_logprobs)
    std::vector<int32_t> prompt_ids;     // with return_token_ids: sent once, then cleared
    std::string text;                    // completions: all text (non-streaming)
    std::vector<GeneratedToken> tokens;  // all tokens (non-streaming logprobs)
    size_t text_offset = 0;              // completions logprobs text_offset
    std::unique_ptr<ChatOutput> chat;
    bool role_sent = false;
    bool finished = false;
    FinishReason finish = FinishReason::kNone;
    std::string error;
    json stop_reason;  // vLLM's: the stop string or stop_token_ids id that ended it, else null
    int n_prompt = 0, n_generated = 0;
    double ttft_s = -1, e2e_s = -1;
  };
  bool chat = false, stream = false, include_usage = false, continuous_usage = false;
  bool logprobs = false;
  int top_logprobs = 0;     // completions: the logprobs count (the echo's entries too)
  int prompt_logprobs = -1;  // vLLM's prompt_logprobs field (rendered when >= 0): its count
  bool return_token_ids = false;
  // Bumped by every output of any choice: the response writer sleeps on it (no polling).
  std::shared_ptr<StreamNotifier> notifier = std::make_shared<StreamNotifier>();
  std::string id, model;
  int64_t created = 0;
  const Tokenizer* tok = nullptr;
  std::vector<Choice> choices;
  std::vector<int> prompt_lens;  // per distinct prompt
  bool starts_in_reasoning = false;
  json tools;
  ServerMetrics* metrics = nullptr;

  bool all_finished() const {
    for (const Choice& c : choices) {
      if (!c.finished) return false;
    }
    return true;
  }
  void cancel_all() {
    for (Choice& c : choices) {
      if (!c.finished) c.stream->cancel();
    }
  }
  json usage() const {
    int prompt = 0, completion = 0;
    for (int n : prompt_lens) prompt += n;
    for (const Choice& c : choices) completion += c.n_generated;
    return json{{"prompt_tokens", prompt},
                {"completion_tokens", completion},
                {"total_tokens", prompt + completion}};
  }
  // A stream chunk's usage: null, or with continuous_usage_stats its choice's so far (vLLM's).
  json chunk_usage(const Choice& c) const {
    if (!continuous_usage) return nullptr;
    return json{{"prompt_tokens", c.n_prompt},
                {"completion_tokens", c.n_generated},
                {"total_tokens", c.n_prompt + c.n_generated}};
  }
  json chunk_base() const {
    return json{{"id", id},
                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created},
                {"model", model}};
  }

  // A logprob as JSON: -inf (and NaN) as -9999.0, vLLM's floor, so that clients always parse a
  // number (JSON has no -inf: it would be written null).
  static double lp_number(float x) { return x >= -9999.0f ? static_cast<double>(x) : -9999.0; }

  // Completions logprobs for `tokens` (text offsets continue from c.text_offset), after the
  // echoed prompt's when they are due (OpenAI's echo: the first prompt token's logprob and top
  // entries are null; offsets from 0 within the echo). Each token's top entries: the `logprobs`
  // most probable and the token itself.
  json completion_logprobs(Choice& c, const std::vector<GeneratedToken>& tokens) {
    json lp = {{"tokens", json::array()},
               {"token_logprobs", json::array()},
               {"top_logprobs", json::array()},
               {"text_offset", json::array()}};
    auto add = [&](const GeneratedToken& g, size_t& offset) {
      const std::string t = token_text(tok, g.id);
      lp["tokens"].push_back(t);
      lp["token_logprobs"].push_back(lp_number(g.logprob));
      json top = json::object();
      const size_t n_top = std::min(g.top.size(), static_cast<size_t>(top_logprobs));
      for (size_t i = 0; i < n_top; ++i)
        top[token_text(tok, g.top[i].token)] = lp_number(g.top[i].logprob);
      // The token itself too, as vLLM and OpenAI's legacy API do (up to logprobs + 1 entries).
      if (!top.contains(t)) top[t] = lp_number(g.logprob);
      lp["top_logprobs"].push_back(top);
      lp["text_offset"].push_back(offset);
      offset += utf8_length(t);
    };
    if (c.echo_lp) {
      const std::string first = token_text(tok, c.first_prompt_id);
      lp["tokens"].push_back(first);
      lp["token_logprobs"].push_back(nullptr);
      lp["top_logprobs"].push_back(nullptr);
      lp["text_offset"].push_back(0);
      size_t offset = utf8_length(first);
      for (const GeneratedToken& g : c.prompt_lp) add(g, offset);
      // The output's offsets go on from the echo's tokens (as vLLM counts them: token by token,
      // which differs from the echoed text where a character spans tokens).
      c.text_offset = offset;
      c.echo_lp = false;
    }
    for (const GeneratedToken& g : tokens) add(g, c.text_offset);
    return lp;
  }
  // vLLM's prompt_logprobs: null for the first prompt token, then per token {"<id>": {"logprob",
  // "rank", "decoded_token"}} for the token itself (its rank in the vocabulary) and the top ones
  // (ranks 1..n).
  json vllm_prompt_logprobs(const Choice& c) const {
    json all = json::array({nullptr});
    for (const GeneratedToken& g : c.prompt_lp) {
      json d = json::object();
      d[std::to_string(g.id)] = {
          {"logprob", lp_number(g.logprob)},
          {"rank", g.rank},
          {"decoded_token", token_text(tok, g.id)}};
      // (the engine may have computed more: an echo with more logprobs than this field)
      const size_t n_top = std::min(g.top.size(), static_cast<size_t>(prompt_logprobs));
      for (size_t i = 0; i < n_top; ++i) {
        const TokenLogprob& a = g.top[i];
        if (a.token == g.id) continue;
        d[std::to_string(a.token)] = {{"logprob", lp_number(a.logprob)},
                                      {"rank", static_cast<int>(i) + 1},
                                      {"decoded_token", token_text(tok, a.token)}};
      }
      all.push_back(std::move(d));
    }
    return all;
  }
  json chat_logprobs(const std::vector<GeneratedToken>& tokens) const {
    json content = json::array();
    for (const GeneratedToken& g : tokens) {
      json top = json::array();
      for (const TokenLogprob& a : g.top) {
        top.push_back({{"token", token_text(tok, a.token)},
                       {"logprob", lp_number(a.logprob)},
                       {"bytes", token_bytes_json(tok, a.token)}});
      }
      content.push_back({{"token", token_text(tok, g.id)},
                         {"logprob", lp_number(g.logprob)},
                         {"bytes", token_bytes_json(tok, g.id)},
                         {"top_logprobs", top}});
    }
    return json{{"content", content}};
  }

  static json ids_json(const std::vector<GeneratedToken>& tokens) {
    json ids = json::array();
    for (const GeneratedToken& g : tokens) ids.push_back(g.id);
    return ids;
  }

  std::string final_finish_reason(const Choice& c) const {
    if (chat && c.finish == FinishReason::kStop && c.chat && c.chat->has_tool_calls())
      return "tool_calls";
    const char* r = finish_reason_api(c.finish);
    return r ? r : "stop";
  }

  // Takes one output of choice c; for streaming returns the SSE events to send.
  std::string absorb(Choice& c, StreamOutput& out) {
    std::string sse;
    c.n_prompt = out.n_prompt_tokens;
    c.n_generated = out.n_generated;
    c.ttft_s = out.ttft_s;
    c.e2e_s = out.e2e_s;
    for (GeneratedToken& g : out.prompt_logprobs) c.prompt_lp.push_back(std::move(g));
    if (stream) {
      json base = chunk_base();
      if (chat) {
        if (!c.role_sent) {
          json ch = base;
          ch["choices"] = json::array({{{"index", c.index},
                                        {"delta", {{"role", "assistant"}, {"content", ""}}},
                                        {"logprobs", nullptr},
                                        {"finish_reason", nullptr}}});
          if (return_token_ids) {
            ch["prompt_token_ids"] = c.prompt_ids;
            c.prompt_ids.clear();
          }
          if (include_usage) ch["usage"] = chunk_usage(c);
          sse += "data: " + dump(ch) + "\n\n";
          c.role_sent = true;
        }
        json delta = c.chat->push(out.text);
        if (out.finish != FinishReason::kNone) {
          json rest = c.chat->finish();
          for (auto it = rest.begin(); it != rest.end(); ++it) {
            if (it.value().is_string() && delta.contains(it.key()) && delta[it.key()].is_string()) {
              delta[it.key()] = delta[it.key()].get<std::string>() + it.value().get<std::string>();
            } else if (it.value().is_array() && delta.contains(it.key()) &&
                       delta[it.key()].is_array()) {
              for (const json& x : it.value()) delta[it.key()].push_back(x);
            } else {
              delta[it.key()] = it.value();
            }
          }
        }
        if (!delta.empty() || ((logprobs || return_token_ids) && !out.tokens.empty())) {
          json ch = base;
          ch["choices"] =
              json::array({{{"index", c.index},
                            {"delta", delta},
                            {"logprobs", logprobs ? chat_logprobs(out.tokens) : json(nullptr)},
                            {"finish_reason", nullptr}}});
          if (return_token_ids) ch["choices"][0]["token_ids"] = ids_json(out.tokens);
          if (include_usage) ch["usage"] = chunk_usage(c);
          sse += "data: " + dump(ch) + "\n\n";
        }
      } else {
        std::string text = out.text;
        if (!c.echo.empty()) {
          text = c.echo + text;
          c.echo.clear();
        }
        if (!text.empty() || c.echo_lp ||
            ((logprobs || return_token_ids) && !out.tokens.empty())) {
          json ch = base;
          ch["choices"] = json::array(
              {{{"index", c.index},
                {"text", text},
                {"logprobs", logprobs ? completion_logprobs(c, out.tokens) : json(nullptr)},
                {"finish_reason", nullptr}}});
          if (return_token_ids) {
            json& choice = ch["choices"][0];
            choice["token_ids"] = ids_json(out.tokens);
            if (!c.prompt_ids.empty()) {
              choice["prompt_token_ids"] = c.prompt_ids;
              c.prompt_ids.clear();
            }
          }
          if (include_usage) ch["usage"] = chunk_usage(c);
          sse += "data: " + dump(ch) + "\n\n";
        }
      }
    } else {
      if (chat) {
        c.chat->push(out.text);
        if (out.finish != FinishReason::kNone) c.chat->finish();
      } else {
        c.text += out.text;
      }
      for (GeneratedToken& g : out.tokens) c.tokens.push_back(std::move(g));
    }
    if (out.finish != FinishReason::kNone) {
      c.finished = true;
      c.finish = out.finish;
      c.error = out.error;
      if (!out.stop_string.empty())
        c.stop_reason = out.stop_string;
      else if (out.stop_token >= 0)
        c.stop_reason = out.stop_token;
      if (metrics) metrics->record_request(out);
      if (stream) {
        if (c.finish == FinishReason::kError) {
          sse += "data: " + dump(error_body(500, "generation failed: " + c.error)) + "\n\n";
        }
        json ch = chunk_base();
        json choice = {{"index", c.index},
                       {"logprobs", nullptr},
                       {"finish_reason", final_finish_reason(c)},
                       {"stop_reason", c.stop_reason}};
        if (chat)
          choice["delta"] = json::object();
        else
          choice["text"] = "";
        ch["choices"] = json::array({choice});
        if (include_usage) ch["usage"] = chunk_usage(c);
        sse += "data: " + dump(ch) + "\n\n";
      }
    }
    return sse;
  }

  // The non-streaming response: its status and body (a choice that failed in the engine fails
  // the whole response, 500).
  std::pair<int, json> response() {
    for (const Choice& c : choices) {
      if (c.finish == FinishReason::kError)
        return {500, error_body(500, "generation failed: " + c.error)};
    }
    return {200, body()};
  }
  json body() {
    json r = {{"id", id},
              {"object", chat ? "chat.completion" : "text_completion"},
              {"created", created},
              {"model", model}};
    json arr = json::array();
    for (Choice& c : choices) {
      json choice = {{"index", c.index},
                     {"finish_reason", final_finish_reason(c)},
                     {"stop_reason", c.stop_reason}};
      if (chat) {
        choice["message"] = c.chat->message();
        choice["logprobs"] = logprobs ? chat_logprobs(c.tokens) : json(nullptr);
        if (return_token_ids) {
          choice["token_ids"] = ids_json(c.tokens);
          if (!r.contains("prompt_token_ids")) r["prompt_token_ids"] = c.prompt_ids;
        }
      } else {
        choice["text"] = c.echo + c.text;
        choice["logprobs"] = logprobs ? completion_logprobs(c, c.tokens) : json(nullptr);
        if (return_token_ids) {
          choice["prompt_token_ids"] = c.prompt_ids;
          choice["token_ids"] = ids_json(c.tokens);
        }
        if (prompt_logprobs >= 0) choice["prompt_logprobs"] = vllm_prompt_logprobs(c);
      }
      arr.push_back(choice);
    }
    r["choices"] = arr;
    if (chat && prompt_logprobs >= 0 && !choices.empty())
      r["prompt_logprobs"] = vllm_prompt_logprobs(choices.front());
    r["usage"] = usage();
    return r;
  }
};

Server::Server(Engine& engine, ChatRenderFn render_chat, ServerOptions options)
    : engine_(engine),
      render_chat_(std::move(render_chat)),
      opt_(std::move(options)),
      http_(std::make_unique<httplib::Server>()) {
  if (opt_.model_names.empty()) opt_.model_names.push_back("deltaserve");
  int threads = opt_.http_threads;
  if (threads <= 0) threads = std::max(256, 4 * engine_.stats().memory.state_slots_total);
  http_->new_task_queue = [threads] {
    return new httplib::ThreadPool(static_cast<size_t>(threads));
  };
  http_->set_read_timeout(opt_.read_timeout_s, 0);
  http_->set_write_timeout(opt_.write_timeout_s, 0);
  http_->set_keep_alive_timeout(opt_.keep_alive_timeout_s);
  http_->set_payload_max_length(opt_.max_body_bytes);
  // A client that sends its request a byte per read timeout would hold a worker thread without
  // end (and enough of them every thread, /health included): the whole request must arrive in
  // this time.
  http_->set_request_read_deadline(opt_.request_read_deadline_s);
  // A body announced above the limit is refused before the client sends it (curl asks with
  // "Expect: 100-continue" for large bodies), not after reading it.
  http_->set_expect_100_continue_handler(
      [this](const httplib::Request& req, httplib::Response& res) {
        // (A length that is no number is left to the body's read: 400.)
        uint64_t n = 0;
        if (httplib::detail::parse_content_length(req.headers, n) && n > opt_.max_body_bytes) {
          res.status = 413;
          return 413;
        }
        return 100;
      });
  // Stream chunks are small writes, one per step: send each at once (no Nagle delay waiting for
  // the client's delayed ACK).
  http_->set_tcp_nodelay(true);
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, with which a second server on a
  // port in use starts too and the kernel splits the connections between the two.
  http_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const void*>(&yes), sizeof(yes));
  });

  http_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    // Range has no meaning here (RFC 9110 lets a server ignore it): httplib would answer a POST
    // with a Range header 206, cut an error body to the range ('{"') or label a generation
    // multipart/byteranges. The Request is httplib's own non-const object.
    const_cast<httplib::Request&>(req).ranges.clear();
    // The API key guards /v1/* and the tokenizer endpoints (vLLM leaves those open; here they
    // answer only with the key, like the rest of the API).
    const bool api = req.path.rfind("/v1/", 0) == 0 || req.path == "/tokenize" ||
                     req.path == "/detokenize";
    if (api && !opt_.api_key.empty()) {
      const std::string auth = req.get_header_value("Authorization");
      if (auth != "Bearer " + opt_.api_key) {
        respond_error(
            res, 401,
            auth.empty() ? "missing API key (Authorization: Bearer ...)" : "invalid API key");
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    if (api && req.method == "POST" && draining_.load()) {
      respond_error(res, 503, "the server is shutting down");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  http_->set_error_handler(httplib::Server::HandlerWithResponse(
      [this](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty() || res.content_length_ > 0)
          return httplib::Server::HandlerResponse::Unhandled;
        std::string msg;
        if (res.status == 404) {
          // A known path asked with another method: 405 with Allow, as vLLM (FastAPI) answers.
          for (const auto& [path, allow] : kRoutes) {
            if (req.path == path) {
              res.status = 405;
              res.set_header("Allow", allow);
              msg = "method not allowed: " + req.method + " " + req.path + " (allowed: " + allow +
                    ")";
              break;
            }
          }
        }
        switch (res.status) {
          case 405:
            break;
          case 404:
            msg = "not found: " + req.method + " " + req.path;
            break;
          case 413:
            msg = "the request body is too large (limit " + std::to_string(opt_.max_body_bytes) +
                  " bytes)";
            break;
          case 400:
            msg = "malformed HTTP request";
            break;
          case 408:
            msg = "request timeout";
            break;
          default:
            msg = "HTTP error " + std::to_string(res.status);
            break;
        }
        res.set_content(dump(error_body(res.status, msg)), "application/json");
        return httplib::Server::HandlerResponse::Handled;
      }));
  http_->set_exception_handler(
      [this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string msg = "internal error";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          msg = std::string("internal error: ") + e.what();
        } catch (...) {
        }
        respond_error(res, 500, msg);
      });
  http_->set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    metrics_.count_http(endpoint_label(req.path), res.status);
  });

  http_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (draining_.load()) {
      res.status = 503;
      res.set_content("{\"status\":\"shutting down\"}", "application/json");
    } else {
      res.set_content("{\"status\":\"ok\"}", "application/json");
    }
  });
  http_->Get("/version", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("{\"version\":\"0.1.0\"}", "application/json");
  });
  http_->Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    json data = json::array();
    for (const std::string& name : opt_.model_names) {
      data.push_back({{"id", name},
                      {"object", "model"},
                      {"created", static_cast<int64_t>(std::time(nullptr))},
                      {"owned_by", "deltaserve"},
                      {"root", name},
                      {"max_model_len", engine_.max_model_len()}});
    }
    res.set_content(dump(json{{"object", "list"}, {"data", data}}), "application/json");
  });
  http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.render(engine_.stats()), "text/plain; version=0.0.4; charset=utf-8");
  });
  http_->Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_completions(req, res, false);
  });
  http_->Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_completions(req, res, true);
  });
  http_->Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    handle_tokenize(req, res);
  });
  http_->Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    handle_detokenize(req, res);
  });
}

Server::~Server() {
  if (drain_thread_.joinable()) drain_thread_.join();
}

void Server::respond_error(httplib::Response& res, int status, const std::string& msg,
                           const std::string& param) {
  res.status = status;
  res.set_content(dump(error_body(status, msg, param)), "application/json");
}

int Server::bind() {
  if (opt_.port == 0) {
    port_ = http_->bind_to_any_port(opt_.host);
    if (port_ <= 0) throw_error("server: cannot listen on ", opt_.host, " (any port)");
  } else {
    if (!http_->bind_to_port(opt_.host, opt_.port)) {
      throw_error("server: cannot listen on ", opt_.host, ":", opt_.port,
                  " (address in use or not local?)");
    }
    port_ = opt_.port;
  }
  return port_;
}

void Server::serve() {
  // A shutdown() before the listener runs (a signal during start-up) must still end serve():
  // httplib's stop() does nothing to a server that is not listening yet. Either the drain thread
  // sees serve() entered and waits for the listener (below), or serve() sees the shutdown here.
  serve_entered_ = true;
  if (!shutdown_started_.load()) http_->listen_after_bind();
  serve_returned_ = true;
}

void Server::shutdown() {
  if (shutdown_started_.exchange(true)) return;
  draining_ = true;
  engine_.stop_accepting();
  drain_thread_ = std::thread([this] {
    if (!engine_.wait_idle(Ms(static_cast<int64_t>(opt_.shutdown_timeout_s) * 1000))) {
      std::fprintf(stderr, "deltaserve: shutdown timeout: cancelling the requests still running\n");
      engine_.cancel_all();
      engine_.wait_idle(Ms(5000));
    }
    // Let the handlers write their last bytes.
    for (int i = 0; i < 500 && in_flight_.load() > 0; ++i) std::this_thread::sleep_for(Ms(10));
    // stop() is a no-op until listen_after_bind() has started: if serve() is on its way there,
    // wait for the listener (if it is not, serve() sees shutdown_started_ and never listens).
    while (serve_entered_.load() && !serve_returned_.load() && !http_->is_running())
      std::this_thread::sleep_for(Ms(1));
    http_->stop();
  });
}

std::vector<int32_t> Server::encode_prompt(const Tokenizer& tok, const std::string& text) {
  if (text.size() <= kBigEncodeBytes) return tok.encode(text, true);
  big_encodes_.acquire();
  struct Release {
    std::counting_semaphore<2>& s;
    ~Release() { s.release(); }
  } release{big_encodes_};
  return tok.encode(text, true);
}

std::string Server::render_chat_prompt(const json& input) const {
  try {
    return render_chat_(input);
  } catch (const Error& e) {
    throw ApiError(400, std::string("chat template error: ") + e.what(), "messages");
  }
}

void Server::handle_completions(const httplib::Request& req, httplib::Response& res, bool chat) {
  auto job = std::make_shared<Job>();
  try {
    const json body = parse_body(req.body, req.get_header_value("Content-Type"));
    check_model(body, opt_.model_names);
    SamplingRequest sr = parse_sampling_request(body, chat, opt_.limits);
    const Tokenizer* tok = engine_.tokenizer();
    job->chat = chat;
    job->stream = sr.stream;
    job->include_usage = sr.include_usage;
    job->continuous_usage = sr.continuous_usage;
    job->logprobs = sr.logprobs;
    job->top_logprobs = std::max(sr.gen.top_logprobs, 0);
    job->prompt_logprobs = sr.prompt_logprobs ? sr.gen.prompt_logprobs : -1;
    job->return_token_ids = sr.return_token_ids;
    job->id = make_request_id(chat ? "chatcmpl-" : "cmpl-");
    job->created = static_cast<int64_t>(std::time(nullptr));
    job->model = opt_.model_names.front();
    job->tok = tok;
    job->metrics = &metrics_;

    std::vector<std::vector<int32_t>> prompts;
    std::vector<std::string> echoes;
    bool echo = false;
    if (chat) {
      if (!render_chat_)
        throw ApiError(400, "this model has no chat template; use /v1/completions");
      if (!tok) throw ApiError(400, "this model has no tokenizer; chat needs one");
      const json input = chat_template_input(body);
      const std::string text = render_chat_prompt(input);
      // Thinking on: the template opened <think> in the prompt, so generation starts as reasoning.
      job->starts_in_reasoning = OutputParser::prompt_ends_in_reasoning(text);
      if (input.contains("tools") && !input.contains("tool_choice_none"))
        job->tools = input["tools"];
      prompts.push_back(encode_prompt(*tok, text));
      echoes.emplace_back();
    } else {
      if (body.contains("echo") && !body["echo"].is_null()) {
        if (!body["echo"].is_boolean()) throw ApiError(400, "'echo' must be a boolean", "echo");
        echo = body["echo"].get<bool>();
      }
      if (body.contains("suffix") && !body["suffix"].is_null()) {
        throw ApiError(400, "'suffix' is not supported", "suffix");
      }
      for (PromptInput& in : parse_completion_prompts(body)) {
        if (in.text) {
          if (!tok)
            throw ApiError(400, "this model has no tokenizer: send the prompt as token ids",
                           "prompt");
          prompts.push_back(encode_prompt(*tok, *in.text));
          if (prompts.back().empty())
            throw ApiError(400, "'prompt' encodes to no tokens", "prompt");
          echoes.push_back(echo ? *in.text : std::string());
        } else {
          prompts.push_back(std::move(in.ids));
          echoes.push_back(echo && tok ? sanitize_utf8(tok->decode(prompts.back()))
                                       : std::string());
        }
      }
      if (static_cast<int>(prompts.size()) * sr.n > opt_.limits.max_n * 4) {
        throw ApiError(400, "too many prompts x n in one request", "prompt");
      }
    }
    if (sr.truncate_prompt_tokens > engine_.max_model_len()) {
      throw ApiError(400,
                     "'truncate_prompt_tokens' (" + std::to_string(sr.truncate_prompt_tokens) +
                         ") is larger than the context length (" +
                         std::to_string(engine_.max_model_len()) + ")",
                     "truncate_prompt_tokens");
    }
    if (sr.truncate_prompt_tokens != 0) {
      const size_t keep = sr.truncate_prompt_tokens > 0
                              ? static_cast<size_t>(sr.truncate_prompt_tokens)
                              : static_cast<size_t>(engine_.max_model_len());
      for (size_t p = 0; p < prompts.size(); ++p) {
        if (prompts[p].size() <= keep) continue;
        prompts[p].erase(prompts[p].begin(), prompts[p].end() - static_cast<ptrdiff_t>(keep));
        // The echo is the prompt the model saw.
        if (!echoes[p].empty() && tok) echoes[p] = sanitize_utf8(tok->decode(prompts[p]));
      }
    }
    std::vector<GenerationRequest> gens;  // one per choice, submitted together
    for (size_t p = 0; p < prompts.size(); ++p) {
      const int n_prompt = static_cast<int>(prompts[p].size());
      job->prompt_lens.push_back(n_prompt);
      for (int i = 0; i < sr.n; ++i) {
        GenerationRequest g = sr.gen;
        g.prompt = prompts[p];
        if (g.max_tokens < 0) {
          // OpenAI: 16 for completions; chat: the rest of the context.
          g.max_tokens = chat ? engine_.max_model_len() - n_prompt : 16;
          if (g.max_tokens < 1) {
            throw ApiError(400,
                           "This model's maximum context length is " +
                               std::to_string(engine_.max_model_len()) +
                               " tokens; the messages take " + std::to_string(n_prompt) + " tokens",
                           "messages");
          }
        }
        if (g.sampling.seed && i > 0) g.sampling.seed = *g.sampling.seed + static_cast<uint64_t>(i);
        // The echo's logprobs are the prompt's (as many top entries as for the output).
        const bool echo_lp = echo && sr.logprobs;
        if (echo_lp) g.prompt_logprobs = std::max(g.prompt_logprobs, g.top_logprobs);
        Job::Choice c;
        c.index = static_cast<int>(job->choices.size());
        c.prompt_index = static_cast<int>(p);
        c.echo = echoes[p];
        c.echo_lp = echo_lp;
        if (echo_lp && !prompts[p].empty()) c.first_prompt_id = prompts[p][0];
        c.n_prompt = n_prompt;
        if (sr.return_token_ids) c.prompt_ids = prompts[p];
        if (chat) c.chat = std::make_unique<ChatOutput>(job->starts_in_reasoning, job->tools);
        gens.push_back(std::move(g));
        job->choices.push_back(std::move(c));
      }
    }
    // All the choices or none: a request is never half queued.
    std::vector<std::shared_ptr<RequestStream>> streams;
    try {
      streams = engine_.submit_all(std::move(gens));
    } catch (const RejectedError& e) {
      throw ApiError(status_of(e.kind), e.what(), e.param);
    }
    for (size_t i = 0; i < streams.size(); ++i) {
      job->choices[i].stream = std::move(streams[i]);
      job->choices[i].stream->set_notifier(job->notifier);
    }
  } catch (const ApiError& e) {
    respond_error(res, e.status, e.what(), e.param);
    return;
  } catch (const Error& e) {
    respond_error(res, 400, e.what());
    return;
  }
  start_job(std::move(job), req, res);
}

void Server::handle_tokenize(const httplib::Request& req, httplib::Response& res) {
  try {
    const json body = parse_body(req.body, req.get_header_value("Content-Type"));
    check_model(body, opt_.model_names);
    const TokenizeRequest tr = parse_tokenize_request(body);
    const Tokenizer* tok = engine_.tokenizer();
    if (!tok) throw ApiError(400, "this model has no tokenizer");
    std::vector<int32_t> ids;
    if (tr.prompt) {
      ids = encode_prompt(*tok, *tr.prompt);
    } else {
      if (!render_chat_) throw ApiError(400, "this model has no chat template", "messages");
      ids = encode_prompt(*tok, render_chat_prompt(chat_template_input(body)));
    }
    // Written directly: a JSON tree of millions of ids and strings would take ~10x the text.
    std::string out = "{\"count\":" + std::to_string(ids.size()) +
                      ",\"max_model_len\":" + std::to_string(engine_.max_model_len()) +
                      ",\"tokens\":[";
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) out += ',';
      out += std::to_string(ids[i]);
    }
    out += "],\"token_strs\":";
    if (tr.return_token_strs) {
      out += '[';
      for (size_t i = 0; i < ids.size(); ++i) {
        if (i) out += ',';
        const auto str = tok->token_string(ids[i]);
        out += str ? dump(json(*str)) : std::string("null");
      }
      out += ']';
    } else {
      out += "null";
    }
    out += '}';
    res.set_content(std::move(out), "application/json");
  } catch (const ApiError& e) {
    respond_error(res, e.status, e.what(), e.param);
  } catch (const Error& e) {
    respond_error(res, 400, e.what());
  }
}

void Server::handle_detokenize(const httplib::Request& req, httplib::Response& res) {
  try {
    const json body = parse_body(req.body, req.get_header_value("Content-Type"));
    check_model(body, opt_.model_names);
    const Tokenizer* tok = engine_.tokenizer();
    if (!tok) throw ApiError(400, "this model has no tokenizer");
    const std::vector<int32_t> ids = parse_detokenize_request(body, tok->vocab_size());
    res.set_content(dump(json{{"prompt", tok->decode(ids)}}), "application/json");
  } catch (const ApiError& e) {
    respond_error(res, e.status, e.what(), e.param);
  } catch (const Error& e) {
    respond_error(res, 400, e.what());
  }
}

void Server::start_job(std::shared_ptr<Job> job, const httplib::Request& req,
                       httplib::Response& res) {
  ++in_flight_;
  // When the response is over (written, failed, or the client gone): what still runs is
  // cancelled and counted as such.
  auto release = [this, job]() {
    for (Job::Choice& c : job->choices) {
      if (c.finished) continue;
      c.stream->cancel();
      StreamOutput o;
      o.finish = FinishReason::kCancelled;
      o.n_prompt_tokens = c.n_prompt;
      o.n_generated = c.n_generated;
      o.ttft_s = c.ttft_s;
      metrics_.record_request(o);
      c.finished = true;
    }
    --in_flight_;
  };
  // Takes everything new from every choice (the SSE events to send, when streaming). The engine
  // thread never waits on this one: it publishes into the streams and bumps the job's notifier.
  auto take = [job]() {
    std::string out;
    for (Job::Choice& c : job->choices) {
      if (c.finished) continue;
      StreamOutput o;
      if (c.stream->next(o, Ms(0))) out += job->absorb(c, o);
    }
    return out;
  };
  // Sleeps on the notifier until the next output, at most 50 ms; false when, checked at least
  // every 50 ms, the client has left (`gone`).
  auto wait = [job](uint64_t seen, auto& last_check, auto gone) {
    const bool woke = job->notifier->wait_past(seen, Ms(50));
    const auto now = std::chrono::steady_clock::now();
    if (woke && now - last_check < Ms(50)) return true;
    last_check = now;
    return !gone();
  };

  if (!job->stream) {
    // The answer waits for the whole generation, so that its status says how it ended (500
    // when it failed; a chunked answer would have sent 200 first). A client that leaves
    // meanwhile cancels it. The wait runs inside httplib's handler try/catch.
    struct Guard {
      decltype(release)& f;
      ~Guard() { f(); }
    } guard{release};
    auto last_check = std::chrono::steady_clock::now();
    auto gone = [&req] { return req.is_connection_closed && req.is_connection_closed(); };
    for (;;) {
      const uint64_t seen = job->notifier->epoch();
      take();
      if (job->all_finished()) break;
      if (!wait(seen, last_check, gone)) {
        job->cancel_all();
        res.status = 499;  // (nobody reads it: the client has gone)
        return;
      }
    }
    auto [status, body] = job->response();
    res.status = status;
    res.set_content(dump(body), "application/json");
    return;
  }

  auto write_all = [job, take, wait](httplib::DataSink& sink) -> bool {
    std::string out_buf;
    auto last_check = std::chrono::steady_clock::now();
    auto gone = [&sink] { return !sink.is_writable(); };
    for (;;) {
      const uint64_t seen = job->notifier->epoch();
      out_buf += take();
      if (job->all_finished()) break;  // the last tokens go out with the end of the stream
      if (!out_buf.empty()) {
        if (!sink.write(out_buf.data(), out_buf.size())) {  // also fails once the client left
          job->cancel_all();
          return false;
        }
        out_buf.clear();
        continue;
      }
      // Nothing to write for 50 ms (a long prefill): check that the client is still there.
      if (!wait(seen, last_check, gone)) {
        job->cancel_all();
        return false;
      }
    }
    if (job->include_usage) {
      json ch = job->chunk_base();
      ch["choices"] = json::array();
      ch["usage"] = job->usage();
      out_buf += "data: " + dump(ch) + "\n\n";
    }
    out_buf += "data: [DONE]\n\n";
    if (!sink.write(out_buf.data(), out_buf.size())) return false;
    sink.done();
    return true;
  };
  // The writer runs outside httplib's handler try/catch: an exception there (rendering a model
  // output, say) would end the process. Instead it ends this response (the connection closes,
  // the releaser cancels what still runs) and the server goes on.
  auto provider = [job, write_all](size_t /*offset*/, httplib::DataSink& sink) -> bool {
    try {
      return write_all(sink);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "deltaserve: writing response %s failed: %s\n", job->id.c_str(),
                   e.what());
      job->cancel_all();
      return false;
    }
  };
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  // With the charset, as vLLM (Starlette) sends it: a client that goes by the header (Python
  // requests) would otherwise decode the chunks as Latin-1.
  // HTTP/1.0 has no chunked encoding (RFC 9112 section 6.1): the stream ends with the connection.
  auto releaser = [release](bool /*success*/) { release(); };
  if (req.version == "HTTP/1.0")
    res.set_content_provider("text/event-stream; charset=utf-8", provider, releaser);
  else
    res.set_chunked_content_provider("text/event-stream; charset=utf-8", provider, releaser);
}

}  // namespace ds
