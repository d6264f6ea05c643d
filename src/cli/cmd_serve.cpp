// `deltaserve serve (--model DIR | --synthetic 27b|tiny|CONFIG [--layers N] --tokenizer DIR)
// [--host 127.0.0.1 --port 8000 --max-batch N --max-model-len N
// --chunk-size N --api-key KEY ...]`: the OpenAI-compatible server (src/server) over the engine
// (src/runtime/engine.h) on the CPU or CUDA backend. SIGTERM / SIGINT shut it down gracefully:
// new requests get 503, running ones finish (up to --shutdown-timeout seconds), then it exits 0.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "bench/bench.h"
#include "chat/chat_template.h"
#include "cli/command.h"
#include "core/error.h"
#include "model/weights.h"
#include "runtime/backend_factory.h"
#include "runtime/engine.h"
#include "server/server.h"
#include "tokenizer/tokenizer.h"

namespace ds::cli {
namespace {

struct ServeOpts {
  std::string synthetic;  // instead of --model: random weights ("27b", "tiny", or a config.json)
  int layers = 0;         // synthetic: keep only the first N layers
  uint64_t seed = 1;      // synthetic weights' seed
  int64_t max_kv_tokens = 0;  // synthetic on CUDA: cap the KV pool (tests preemption)
  std::string model, tokenizer, device = "cpu", host = "127.0.0.1", api_key;
  std::vector<std::string> served_names;
  int port = 8000;
  int max_batch = 8;
  int max_model_len = 0;
  int chunk_size = 512;
  int max_num_batched_tokens = 0;
  int max_logit_rows = 256;
  int max_waiting = 256;
  int max_body_mb = 16;
  int read_timeout = 20;
  int request_timeout = 60;
  int http_threads = 0;
  int shutdown_timeout = 30;
  int max_logprobs = 20;
};

bool has_file(const std::string& dir, const char* name) {
  std::error_code ec;
  return std::filesystem::exists(std::filesystem::path(dir) / name, ec);
}

int run_serve(const ServeOpts& o) {
  // Signals go to one waiting thread only: block them before any other thread exists.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  DS_CHECK(o.model.empty() != o.synthetic.empty(), "give exactly one of --model and --synthetic");
  const std::string tok_dir = o.tokenizer.empty() ? o.model : o.tokenizer;
  std::shared_ptr<const Tokenizer> tok;
  if (!o.tokenizer.empty() || (!tok_dir.empty() && (has_file(tok_dir, "tokenizer.json") ||
                                                    has_file(tok_dir, "vocab.json")))) {
    tok = std::make_shared<const Tokenizer>(Tokenizer::load(tok_dir));
  } else {
    std::fprintf(stderr,
                 "deltaserve: note: no tokenizer (%s): prompts must be token ids, no chat\n",
                 tok_dir.empty() ? "synthetic weights; pass --tokenizer DIR" : tok_dir.c_str());
  }
  std::shared_ptr<const ChatTemplate> tmpl;
  if (tok) {
    try {
      tmpl = std::make_shared<const ChatTemplate>(ChatTemplate::load(tok_dir));
    } catch (const Error& e) {
      std::fprintf(stderr,
                   "deltaserve: note: no chat template (%s): /v1/chat/completions disabled\n",
                   e.what());
    }
  }

  std::unique_ptr<Backend> backend;
  if (!o.synthetic.empty()) {
    // Synthetic weights (generated on the device for CUDA): the bench's engine setup.
    bench::BenchBackendSpec spec;
    spec.device = o.device;
    spec.synthetic = o.synthetic;
    spec.layers = o.layers;
    spec.n_slots = o.max_batch;
    spec.max_seq_len = o.max_model_len;
    spec.chunk_size = o.chunk_size;
    spec.seed = o.seed;
    spec.max_kv_tokens = o.max_kv_tokens;
    spec.verbose = false;
    backend = bench::make_bench_backend(spec);
  } else {
    HostWeights weights = load_host_weights(o.model);
    BackendOptions bo;
    bo.device = o.device;
    bo.n_slots = o.max_batch;
    bo.max_seq_len = o.max_model_len;
    bo.chunk_size = o.chunk_size;
    backend = make_backend(bo, weights);
  }
  // (As vLLM: a context past the positions the model was made for is refused, as generate and
  // score refuse such prompts.)
  const int max_pos = backend->config().max_position_embeddings;
  if (max_pos > 0 && o.max_model_len > max_pos) {
    throw_error("--max-model-len ", o.max_model_len, " exceeds the model's max_position_embeddings ",
                max_pos);
  }
  if (tok && tok->vocab_size() > backend->config().vocab_size) {
    throw_error("the tokenizer of ", tok_dir, " has ", tok->vocab_size(),
                " tokens but the model's vocab_size is ", backend->config().vocab_size);
  }
  const std::string backend_name = backend->name();

  EngineOptions eo;
  eo.max_model_len = o.max_model_len;
  eo.scheduler.max_batch = o.max_batch;
  eo.scheduler.chunk_size = o.chunk_size;
  eo.scheduler.max_num_batched_tokens = o.max_num_batched_tokens > 0
                                            ? o.max_num_batched_tokens
                                            : std::max(2048, o.chunk_size + o.max_batch);
  eo.scheduler.max_waiting = o.max_waiting;
  eo.scheduler.max_logit_rows = o.max_logit_rows;
  Engine engine(std::move(backend), tok, eo);

  ServerOptions so;
  so.host = o.host;
  so.port = o.port;
  so.api_key = o.api_key;
  if (so.api_key.empty()) {
    if (const char* env = std::getenv("DELTASERVE_API_KEY")) so.api_key = env;
  }
  so.model_names = o.served_names;
  if (so.model_names.empty() && !o.synthetic.empty()) {
    const bool path = o.synthetic.find('/') != std::string::npos ||
                      o.synthetic.find(".json") != std::string::npos;
    so.model_names.push_back(path ? std::string("synthetic") : "synthetic-" + o.synthetic);
  }
  if (so.model_names.empty()) {
    std::string name = std::filesystem::path(o.model).lexically_normal().filename().string();
    if (name.empty())
      name = std::filesystem::path(o.model).lexically_normal().parent_path().filename().string();
    so.model_names.push_back(name.empty() ? o.model : name);
  }
  so.max_body_bytes = static_cast<size_t>(o.max_body_mb) << 20;
  so.read_timeout_s = o.read_timeout;
  so.request_read_deadline_s = o.request_timeout;
  so.http_threads = o.http_threads > 0 ? o.http_threads : std::max(256, 4 * o.max_batch + 16);
  so.shutdown_timeout_s = o.shutdown_timeout;
  so.limits.max_logprobs = o.max_logprobs;
  ChatRenderFn render;
  if (tmpl) render = [tmpl](const nlohmann::ordered_json& input) { return tmpl->render(input); };

  Server server(engine, render, so);
  const int port = server.bind();
  std::fprintf(
      stderr,
      "deltaserve: serving '%s' on http://%s:%d (backend %s, %d slots, max_model_len %d, chunk %d, "
      "%s%s)\n",
      so.model_names.front().c_str(), o.host.c_str(), port, backend_name.c_str(), o.max_batch,
      engine.max_model_len(), o.chunk_size, tok ? "tokenizer" : "no tokenizer",
      tmpl ? " + chat template" : "");
  std::fflush(stderr);

  std::thread signal_thread([&server, sigs] {
    int sig = 0;
    sigwait(&sigs, &sig);
    std::fprintf(stderr, "deltaserve: signal %d: shutting down (draining running requests)\n", sig);
    server.shutdown();
  });
  server.serve();
  // serve() returned: wake the signal thread if no signal came.
  pthread_kill(signal_thread.native_handle(), SIGTERM);
  signal_thread.join();
  std::fprintf(stderr, "deltaserve: stopped\n");
  return 0;
}

std::function<int()> setup_serve(CLI::App& app) {
  auto o = std::make_shared<ServeOpts>();
  auto* model = app.add_option("--model", o->model,
                               "Checkpoint folder (config.json + safetensors [+ tokenizer files])");
  auto* synth =
      app.add_option("--synthetic", o->synthetic,
                     "Serve random weights instead of --model: 27b, tiny, or a config.json path");
  model->excludes(synth);
  app.add_option("--layers", o->layers, "With --synthetic: keep only the first N layers")
      ->check(CLI::Range(0, 1024));
  app.add_option("--seed", o->seed, "With --synthetic: seed of the weights")->capture_default_str();
  app.add_option("--max-kv-tokens", o->max_kv_tokens,
                 "With --synthetic on CUDA: cap the KV pool to this many tokens (0: by memory)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--tokenizer", o->tokenizer,
                 "Tokenizer + chat template folder (default: the model folder)");
  app.add_option("--host", o->host, "Address to listen on")->capture_default_str();
  app.add_option("--port", o->port, "Port to listen on (0: any free port)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--served-model-name", o->served_names,
                 "Model id(s) clients use (default: folder name)");
  app.add_option("--max-batch", o->max_batch, "Sequences running at once (sequence slots)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--max-model-len", o->max_model_len,
                 "Tokens per sequence, prompt + output (0: the model's)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 24));
  app.add_option("--chunk-size", o->chunk_size,
                 "Prompt tokens per sequence per step (chunked prefill)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--max-num-batched-tokens", o->max_num_batched_tokens,
                 "Tokens per engine step, decode + prompt chunks (0: max(2048, chunk + batch))")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 24));
  app.add_option("--max-logit-rows", o->max_logit_rows,
                 "Prompt tokens per step whose logits rows are kept (prompt logprobs, echo with "
                 "logprobs): each row is vocab floats on the host")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--max-waiting", o->max_waiting,
                 "Sequences waiting for a slot at most (each prompt x n of a request is one; more "
                 "get 429, and a request with more than this many gets 400)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--api-key", o->api_key,
                 "Require 'Authorization: Bearer KEY' on /v1 (or env DELTASERVE_API_KEY)");
  app.add_option("--max-body-mb", o->max_body_mb, "Largest request body in MiB (larger: 413)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--read-timeout", o->read_timeout,
                 "Seconds a socket read may take (slow clients are dropped)")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600));
  app.add_option("--request-timeout", o->request_timeout,
                 "Seconds a request's line, headers and body may take to arrive in all (0: no "
                 "limit; slow clients are dropped)")
      ->capture_default_str()
      ->check(CLI::Range(0, 3600));
  app.add_option("--http-threads", o->http_threads,
                 "HTTP worker threads (0: max(256, 4 x max-batch + 16))")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  app.add_option("--shutdown-timeout", o->shutdown_timeout,
                 "Seconds running requests may take to finish on SIGTERM")
      ->capture_default_str()
      ->check(CLI::Range(0, 3600));
  app.add_option("--max-logprobs", o->max_logprobs,
                 "Largest logprobs / top_logprobs a request may ask")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000));
  add_device_option(app, o->device);
  return [o]() { return run_serve(*o); };
}

}  // namespace

DS_COMMAND("serve", "OpenAI-compatible HTTP server with continuous batching", setup_serve);

}  // namespace ds::cli
