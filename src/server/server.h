// The OpenAI-compatible HTTP server (cpp-httplib, header-only): GET /health, GET /v1/models,
// GET /metrics (Prometheus), POST /v1/completions and /v1/chat/completions, streamed with
// server-sent events or not. Requests go to an Engine; a client that disconnects (streaming or
// not: responses are written chunked so the socket is watched while the engine works) has its
// sequence cancelled, freeing its slot and KV blocks at once.
//
// Errors are OpenAI-shaped ({"error": {"message", "type", "param", "code"}}): 400 bad JSON / types
// / values / template input / prompt too long, 401 missing or wrong API key, 404 unknown model or
// path, 413 body too large, 429 waiting queue full, 503 shutting down, 500 engine failure.
// Slow clients: every socket read and write has a timeout (slow-loris protection).
// Shutdown (shutdown(), e.g. from SIGTERM): new requests get 503, running ones finish (up to
// shutdown_timeout_s, then they are cancelled), then the listener closes and serve() returns.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <semaphore>
#include <string>
#include <thread>
#include <vector>

#include "runtime/engine.h"
#include "server/metrics.h"
#include "server/openai.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace ds {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                       // 0: any free port (see Server::port())
  std::string api_key;                   // empty: no authentication
  std::vector<std::string> model_names;  // served ids; the first is reported
  size_t max_body_bytes = 16u << 20;     // request bodies above this get 413
  int read_timeout_s = 20;               // per socket read (slow clients)
  int request_read_deadline_s = 60;      // a request's line, headers and body in all (0: none)
  int write_timeout_s = 60;              // per socket write
  int keep_alive_timeout_s = 5;
  int http_threads = 0;         // 0: max(256, 4 * max_batch)
  int shutdown_timeout_s = 30;  // how long running requests may finish on shutdown
  ApiLimits limits;
};

// Renders a chat request (see chat_template_input) to the prompt text; throws ds::Error (template
// errors become 400).
using ChatRenderFn = std::function<std::string(const nlohmann::ordered_json&)>;

class Server {
 public:
  // `render_chat` may be empty (no chat template: /v1/chat/completions answers 400).
  Server(Engine& engine, ChatRenderFn render_chat, ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket; throws ds::Error when it cannot. Returns the port.
  int bind();
  int port() const { return port_; }
  // Serves until shutdown() has drained (also when shutdown() came first); call bind() first.
  void serve();
  // Graceful stop (thread-safe, returns at once; serve() returns when done).
  void shutdown();

  ServerMetrics& metrics() { return metrics_; }

 private:
  struct Job;
  void handle_completions(const httplib::Request& req, httplib::Response& res, bool chat);
  // vLLM's POST /tokenize (a prompt, or chat messages rendered with the model's template) and
  // POST /detokenize (token ids to text).
  void handle_tokenize(const httplib::Request& req, httplib::Response& res);
  void handle_detokenize(const httplib::Request& req, httplib::Response& res);
  void respond_error(httplib::Response& res, int status, const std::string& msg,
                     const std::string& param = {});
  // Runs a submitted job to its answer: streamed (SSE, as the tokens come), or whole once the
  // generation has ended.
  void start_job(std::shared_ptr<Job> job, const httplib::Request& req, httplib::Response& res);
  // tok->encode(text, true), with at most two texts over kBigEncodeBytes at a time.
  std::vector<int32_t> encode_prompt(const Tokenizer& tok, const std::string& text);
  // The chat template applied to chat_template_input's object (a template error: ApiError 400).
  std::string render_chat_prompt(const nlohmann::ordered_json& input) const;

  Engine& engine_;
  ChatRenderFn render_chat_;
  ServerOptions opt_;
  ServerMetrics metrics_;
  std::unique_ptr<httplib::Server> http_;
  int port_ = 0;
  std::atomic<bool> draining_{false};
  std::atomic<int> in_flight_{0};  // generation responses being written
  // BPE on one long word (6 MB of "a", inside the body limit) takes ~45 bytes of memory per
  // input byte while it runs, as HF tokenizers' does: with every HTTP thread on one, memory would
  // run out. Texts above 1 MiB are tokenized two at a time (the others wait their turn).
  static constexpr size_t kBigEncodeBytes = 1u << 20;
  std::counting_semaphore<2> big_encodes_{2};
  std::atomic<bool> shutdown_started_{false};
  std::atomic<bool> serve_entered_{false}, serve_returned_{false};  // serve() (see shutdown())
  std::thread drain_thread_;  // runs the graceful shutdown
};

}  // namespace ds
