// The serving engine: owns a Backend and a Scheduler and runs the continuous-batching loop on its
// own thread (schedule -> Backend::step -> sample -> detokenize -> stop checks), handing each
// request a RequestStream from which a consumer thread (an HTTP handler, a benchmark client)
// takes new text and tokens as they come. Cancellation (RequestStream::cancel, e.g. a client that
// disconnected) frees the sequence's slot and KV blocks before the next step.
//
// Pipelined decode (EngineOptions::decode_pipeline, off by default): when a step is a pure greedy
// decode of the running sequences (device argmax, no logprobs / penalties), the loop launches it
// (Backend::launch_greedy_decode) and, while it runs, launches the next one with every row's
// token fed on the device from the step before, whenever that next step is exactly what the
// scheduler would plan once the tokens are in (nothing waiting or cancelled, nobody reaching
// max_tokens / max_model_len with this token, the KV pool holds one more token each); only then
// does it collect the first step's tokens and run the stop checks. A request that stops on EOS /
// a stop id / a stop string wastes the one step already queued for it (its row is dropped; its
// slot is reset at once: the backend runs its steps in order, so the queued step's writes land
// before anyone reuses the slot's KV pages or GDN state). Tokens are identical either way.
//
// Stops: EOS ids (unless ignore_eos), stop token ids, stop strings (never emitted, text held back
// while it could still become one; cuts happen between whole UTF-8 characters because matching
// is done on decoded text), max_tokens, max_model_len, and the KV pool's capacity (all "length").
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "runtime/backend.h"
#include "runtime/sampling.h"
#include "runtime/scheduler.h"
#include "tokenizer/tokenizer.h"

namespace ds {

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int max_tokens = 16;                  // generated tokens at most (>= 1)
  std::vector<std::string> stop;        // stop strings, excluded from the output (unless:)
  // vLLM's include_stop_str_in_output: the matched stop string kept, and a stop token's text
  bool include_stop_str = false;
  std::vector<int32_t> stop_token_ids;  // besides the EOS ids
  bool ignore_eos = false;
  // vLLM's min_tokens (0..max_tokens): until this many tokens are out, the EOS ids (unless
  // ignore_eos) and stop_token_ids are never sampled and stop strings do not end the output.
  int min_tokens = 0;
  int top_logprobs = -1;            // -1: no logprobs; n >= 0: chosen + n alternatives
  // vLLM's prompt_logprobs: -1 none; n >= 0: every prompt token after the first gets its logprob
  // (from the raw logits of the position before it), its rank and the n most probable ids.
  int prompt_logprobs = -1;
  bool skip_special_tokens = true;  // in the returned text
};

enum class FinishReason : uint8_t { kNone, kStop, kLength, kCancelled, kError };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "cancelled", "error"

struct GeneratedToken {
  int32_t id = 0;
  float logprob = 0;              // when logprobs were asked for
  std::vector<TokenLogprob> top;  // top_logprobs alternatives, best first (sampling.h)
  int32_t rank = 0;               // prompt tokens: 1 + ids more probable (PositionLogprobs)
};

// What a consumer takes from a stream: everything produced since its last take.
struct StreamOutput {
  std::string text;                    // newly complete text
  std::vector<GeneratedToken> tokens;  // newly generated tokens (incl. a final EOS / stop token)
  // With prompt_logprobs: prompt tokens 1.. (the first has no logprob), all of them in the output
  // that brings the first generated token (none when the request ends before one: an error, a
  // cancellation, or the KV pool unable to hold it).
  std::vector<GeneratedToken> prompt_logprobs;
  FinishReason finish = FinishReason::kNone;
  std::string error;  // when finish == kError
  // When finish == kStop, what stopped it (vLLM's stop_reason): the stop string, or else the id
  // of stop_token_ids that was generated (-1 and "": an EOS id).
  std::string stop_string;
  int32_t stop_token = -1;
  // Totals, valid in every output.
  int n_prompt_tokens = 0;
  int n_generated = 0;
  int n_preemptions = 0;
  // Timing (seconds since submission), valid once known (negative before).
  double ttft_s = -1;  // first token
  double e2e_s = -1;   // finished
};

// Thrown by Engine::submit: the request is refused (nothing was queued).
class RejectedError : public Error {
 public:
  enum class Kind : uint8_t { kInvalid, kQueueFull, kShuttingDown };
  RejectedError(Kind kind, const std::string& msg, std::string param = "")
      : Error(msg), kind(kind), param(std::move(param)) {}
  Kind kind;
  std::string param;  // the request field at fault ("prompt", "max_tokens", ...), "" if none
};

// Wakes a consumer that waits on several streams at once (e.g. an HTTP request with n > 1
// choices): every output a stream publishes after RequestStream::set_notifier bumps its epoch.
// Read epoch(), poll the streams (next with a zero timeout), then wait_past(epoch): nothing
// published in between is missed.
class StreamNotifier {
 public:
  uint64_t epoch() const;
  // Waits until the epoch is past `seen` or `timeout` has passed; true when it is past.
  bool wait_past(uint64_t seen, std::chrono::milliseconds timeout);
  void notify();

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t epoch_ = 0;
};

class RequestStream {
 public:
  // Waits up to `timeout` for output; returns false when nothing new came (not finished yet).
  // After the output with finish != kNone, returns false forever.
  bool next(StreamOutput& out, std::chrono::milliseconds timeout);
  // Asks the engine to drop the request; its slot is freed before the next step. Idempotent.
  void cancel();
  bool finished() const;
  uint64_t id() const { return id_; }
  // Also wake `n` on every later output (null: stop). Outputs published before are only seen
  // by next().
  void set_notifier(std::shared_ptr<StreamNotifier> n);

 private:
  friend class Engine;
  explicit RequestStream(uint64_t id) : id_(id) {}
  const uint64_t id_;
  std::function<void(uint64_t)> on_cancel_;  // tells the engine (set by submit)
  mutable std::mutex mu_;
  std::condition_variable cv_;
  StreamOutput pending_;
  std::shared_ptr<StreamNotifier> notifier_;
  bool has_news_ = false;
  bool done_ = false;       // final output produced by the engine
  bool delivered_ = false;  // final output taken by the consumer
  std::atomic<bool> cancel_requested_{false};
};

struct EngineOptions {
  SchedulerOptions scheduler;
  int max_model_len = 0;  // 0: the backend's max_seq_len
  // Rows sampled greedily without logprobs or penalties (and rows not sampled at all) come back
  // from the backend as token ids (Backend::step_greedy: argmax on the GPU, no logits copy).
  // Off: every row's logits go to the host sampler (same tokens, slower).
  bool device_greedy = true;
  // Pipelined greedy decode (see the header comment). kAuto: where the backend pipelines
  // (Backend::pipelines_decode: the CUDA engine); kOn: always (on a synchronous backend the same
  // loop runs each step at launch: tests); kOff: the synchronous loop. $DS_DECODE_PIPELINE=1 / 0
  // overrides (kAuto / kOff). Off by default: on the H200 it did not make bench decode faster
  // (same-call A/B, docs/perf/decode_kernels.md, "Time outside the decode graph"); tokens are
  // identical either way.
  enum class Pipeline : uint8_t { kAuto, kOn, kOff };
  Pipeline decode_pipeline = Pipeline::kOff;
};

// Counters and gauges for /metrics, a consistent snapshot.
struct EngineStats {
  int n_running = 0, n_waiting = 0;
  MemoryUsage memory;
  int64_t n_preemptions = 0;
  int64_t n_steps = 0;
  int64_t n_pipelined_steps = 0;  // of n_steps: launched while the step before ran
  int64_t n_wasted_rows = 0;      // pipelined rows whose request had stopped (EOS / stop / cancel)
  int64_t prompt_tokens = 0, generation_tokens = 0;  // totals computed / sampled
  int64_t n_finished[5] = {0, 0, 0, 0, 0};           // by FinishReason
};

class Engine {
 public:
  // `tokenizer` may be null: then no text (tokens only) and no stop strings.
  Engine(std::unique_ptr<Backend> backend, std::shared_ptr<const Tokenizer> tokenizer,
         const EngineOptions& options);
  ~Engine();  // stops the loop (cancelling what is left)
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request; throws RejectedError (invalid request, queue full, shutting down).
  std::shared_ptr<RequestStream> submit(GenerationRequest request);
  // Queues all of `requests` (one API request's prompts x n) or none: each is checked first, and
  // they take the waiting queue together (more than it can ever hold: kInvalid; more than it has
  // room for now: kQueueFull). The streams are in the order of `requests`.
  std::vector<std::shared_ptr<RequestStream>> submit_all(std::vector<GenerationRequest> requests);

  EngineStats stats() const;
  const ModelConfig& config() const { return config_; }
  int max_model_len() const { return max_model_len_; }
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  std::vector<int32_t> eos_ids() const { return eos_ids_; }
  std::string backend_name() const { return backend_name_; }

  // Refuses new requests from now on (kShuttingDown); running ones go on.
  void stop_accepting();
  // Cancels every request still queued or running.
  void cancel_all();
  // Waits until no request is queued or running, up to `timeout`; true when idle.
  bool wait_idle(std::chrono::milliseconds timeout);

 private:
  struct Request;
  // A checked request, ready to queue (RejectedError kInvalid otherwise).
  std::unique_ptr<Request> prepare(GenerationRequest request) const;
  void loop();
  void finish(Request& r, FinishReason reason, const std::string& error = {});
  // Ends every request of `ids` that is still active with FinishReason::kError and `error`.
  void fail_requests(std::span<const uint64_t> ids, const std::string& error);
  // logits_row: the row the token was sampled from; null when the backend gave only the token
  // (then the request asked for no logprobs).
  void on_token(Request& r, int32_t token, const float* logits_row);
  // With prompt_logprobs: takes the prompt positions of n_rows rows (positions begin..) that are
  // due into r.prompt_lp, from the backend's scores of those rows or else from their logits.
  void take_prompt_logprobs(Request& r, int begin, size_t n_rows, const float* rows,
                            const RowScore* scores);
  // Whether the backend scores prompt rows with k top ids itself (else they come to the host).
  bool scores_rows(int k) const { return k >= 0 && k <= backend_->max_score_top(); }
  // Whether `token` ends q's output: one of its stop_token_ids, or an EOS id unless ignore_eos.
  bool stops_on(const GenerationRequest& q, int32_t token) const;
  // The ids r's next token must not be (min_tokens not yet reached: its stop ids and, unless
  // ignore_eos, the EOS ids); empty otherwise.
  std::vector<int32_t> min_tokens_banned(const Request& r) const;
  // Pipelined decode, with one step in flight: launches the next step when it is certain to be
  // the scheduler's plan, then collects the one in flight and runs its tokens through the stop
  // checks. drain_pipeline collects what is in flight and drops it (stop / errors).
  void pipeline_round();
  void drain_pipeline();
  void publish(Request& r);
  void update_stats();

  std::unique_ptr<Backend> backend_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  ModelConfig config_;
  std::string backend_name_;
  int max_model_len_ = 0;
  bool device_greedy_ = true;
  int64_t pool_tokens_ = 0;  // tokens the KV pool can hold for one sequence (0: unknown)
  int max_waiting_ = 0;      // queued (not yet running) requests at most
  std::vector<int32_t> eos_ids_;
  int32_t tok_vocab_ = 0;  // ids >= this have no text (model vocabularies are often padded)
  Scheduler scheduler_;

  struct Control;                 // mutex-guarded state shared with the streams
  std::shared_ptr<Control> ctl_;  // (a stream may outlive the engine: cancel() is then a no-op)

  // Owned by the loop thread.
  std::unordered_map<uint64_t, std::unique_ptr<Request>> active_;  // by request id
  bool pipeline_ = false;  // decode_pipeline resolved against the backend and the environment
  // The pipelined decode steps launched and not collected, oldest first: each row's sequence id
  // and slot, in row order.
  struct InFlight {
    std::vector<uint64_t> ids;
    std::vector<int> slots;
  };
  std::deque<InFlight> in_flight_;
  std::thread thread_;
};

}  // namespace ds
