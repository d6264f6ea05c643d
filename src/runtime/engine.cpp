// The serving engine loop: see engine.h.
#include "runtime/engine.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>

namespace ds {

using Clock = std::chrono::steady_clock;

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
  }
  return "?";
}

// ---- StreamNotifier / RequestStream ----

uint64_t StreamNotifier::epoch() const {
  std::lock_guard<std::mutex> lk(mu_);
  return epoch_;
}

bool StreamNotifier::wait_past(uint64_t seen, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  return cv_.wait_for(lk, timeout, [&] { return epoch_ != seen; });
}

void StreamNotifier::notify() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++epoch_;
  }
  cv_.notify_all();
}

void RequestStream::set_notifier(std::shared_ptr<StreamNotifier> n) {
  std::lock_guard<std::mutex> lk(mu_);
  notifier_ = std::move(n);
}

bool RequestStream::next(StreamOutput& out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  if (delivered_) return false;
  if (!cv_.wait_for(lk, timeout, [&] { return has_news_ || done_; })) return false;
  out.text = std::move(pending_.text);
  out.tokens = std::move(pending_.tokens);
  out.prompt_logprobs = std::move(pending_.prompt_logprobs);
  pending_.text.clear();
  pending_.tokens.clear();
  pending_.prompt_logprobs.clear();
  out.finish = pending_.finish;
  out.error = pending_.error;
  out.stop_string = pending_.stop_string;
  out.stop_token = pending_.stop_token;
  out.n_prompt_tokens = pending_.n_prompt_tokens;
  out.n_generated = pending_.n_generated;
  out.n_preemptions = pending_.n_preemptions;
  out.ttft_s = pending_.ttft_s;
  out.e2e_s = pending_.e2e_s;
  has_news_ = false;
  if (done_) delivered_ = true;
  return true;
}

void RequestStream::cancel() {
  if (cancel_requested_.exchange(true)) return;
  if (on_cancel_) on_cancel_(id_);
}

bool RequestStream::finished() const {
  std::lock_guard<std::mutex> lk(mu_);
  return done_;
}

// ---- Engine ----

struct Engine::Control {
  std::mutex mu;
  std::condition_variable cv;       // wakes the loop
  std::condition_variable idle_cv;  // n_active reached 0
  std::deque<std::unique_ptr<Request>> incoming;
  std::vector<uint64_t> cancels;
  bool cancel_all = false;
  bool accepting = true;
  bool stop = false;
  uint64_t next_id = 1;
  int n_active = 0;  // submitted and not finished
  EngineStats stats;
};

struct Engine::Request {
  uint64_t id = 0;
  GenerationRequest req;
  std::shared_ptr<RequestStream> stream;
  Sampler sampler;
  std::optional<StreamDecoder> decoder;
  std::vector<int32_t> generated;
  std::string held;      // decoded text not yet published (may start a stop string)
  size_t stop_floor = 0;  // bytes of `held` made within min_tokens: no stop string ends there
  std::string out_text;  // to publish
  std::vector<GeneratedToken> out_tokens;
  // Prompt logprobs (req.prompt_logprobs >= 0): computed chunk by chunk, published with the first
  // token. next_prompt_lp: the prompt position whose logprob comes next (a recompute after a
  // preemption brings rows already taken).
  std::vector<GeneratedToken> prompt_lp;
  int next_prompt_lp = 1;
  std::string stop_string;  // what stopped it (StreamOutput::stop_string / stop_token)
  int32_t stop_token = -1;
  Clock::time_point t_submit;
  double ttft_s = -1;
  int n_preemptions = 0;

  explicit Request(const SamplingParams& p) : sampler(p) {}
};

Engine::Engine(std::unique_ptr<Backend> backend, std::shared_ptr<const Tokenizer> tokenizer,
               const EngineOptions& options)
    : backend_(std::move(backend)),
      tokenizer_(std::move(tokenizer)),
      config_(backend_->config()),
      backend_name_(backend_->name()),
      scheduler_(*backend_,
                 [&] {
                   SchedulerOptions o = options.scheduler;
                   o.max_waiting = INT_MAX;  // the bound is enforced at submit()
                   return o;
                 }()),
      ctl_(std::make_shared<Control>()) {
  max_model_len_ = backend_->max_seq_len();
  device_greedy_ = options.device_greedy;
  if (options.max_model_len > 0) max_model_len_ = std::min(max_model_len_, options.max_model_len);
  DS_CHECK(max_model_len_ >= 2, "engine: max_model_len must be >= 2 (got ", max_model_len_, ")");
  const MemoryUsage mem = backend_->memory();
  if (mem.page_size > 0 && mem.kv_blocks_total > 0)
    pool_tokens_ = mem.kv_blocks_total * mem.page_size;
  ctl_->stats.memory = mem;
  max_waiting_ = options.scheduler.max_waiting;
  using P = EngineOptions::Pipeline;
  P mode = options.decode_pipeline;
  if (const char* env = std::getenv("DS_DECODE_PIPELINE")) {
    const std::string v = env;
    if (v == "0" || v == "off")
      mode = P::kOff;
    else if (v == "1" || v == "on")
      mode = P::kAuto;
    else if (v != "ab")  // the bench's A/B mode: the engine keeps its option
      ds::throw_error("DS_DECODE_PIPELINE must be 0 or 1, got '", v, "'");
  }
  pipeline_ = mode == P::kOn || (mode == P::kAuto && backend_->pipelines_decode());
  for (int id : config_.eos_token_ids) eos_ids_.push_back(id);
  if (tokenizer_) {
    tok_vocab_ = tokenizer_->vocab_size();
    for (int32_t id : tokenizer_->eos_ids()) {
      if (std::find(eos_ids_.begin(), eos_ids_.end(), id) == eos_ids_.end()) eos_ids_.push_back(id);
    }
  }
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lk(ctl_->mu);
    ctl_->stop = true;
    ctl_->accepting = false;
  }
  ctl_->cv.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<RequestStream> Engine::submit(GenerationRequest request) {
  std::vector<GenerationRequest> one;
  one.push_back(std::move(request));
  return submit_all(std::move(one)).front();
}

std::vector<std::shared_ptr<RequestStream>> Engine::submit_all(
    std::vector<GenerationRequest> requests) {
  using K = RejectedError::Kind;
  DS_CHECK(!requests.empty(), "engine: submit_all of no requests");
  std::vector<std::unique_ptr<Request>> rs;
  rs.reserve(requests.size());
  for (GenerationRequest& q : requests) rs.push_back(prepare(std::move(q)));
  const int64_t n = static_cast<int64_t>(rs.size());
  if (n > max_waiting_) {
    throw RejectedError(K::kInvalid,
                        std::to_string(n) + " sequences in one request (prompts x n) are more than "
                                            "the waiting queue holds (" +
                            std::to_string(max_waiting_) + ")",
                        "n");
  }
  std::vector<std::shared_ptr<RequestStream>> streams;
  {
    std::lock_guard<std::mutex> lk(ctl_->mu);
    if (!ctl_->accepting) throw RejectedError(K::kShuttingDown, "the server is shutting down");
    const int64_t queued = static_cast<int64_t>(ctl_->incoming.size()) + ctl_->stats.n_waiting;
    if (queued + n > max_waiting_) {
      throw RejectedError(K::kQueueFull, "too many requests are waiting (" +
                                             std::to_string(queued) + "); retry later");
    }
    for (std::unique_ptr<Request>& r : rs) {
      r->id = ctl_->next_id++;
      std::shared_ptr<RequestStream> stream(new RequestStream(r->id));
      stream->pending_.n_prompt_tokens = static_cast<int>(r->req.prompt.size());
      std::weak_ptr<Control> weak = ctl_;
      stream->on_cancel_ = [weak](uint64_t id) {
        if (auto c = weak.lock()) {
          {
            std::lock_guard<std::mutex> lk2(c->mu);
            c->cancels.push_back(id);
          }
          c->cv.notify_all();
        }
      };
      r->stream = stream;
      ++ctl_->n_active;
      ctl_->incoming.push_back(std::move(r));
      streams.push_back(std::move(stream));
    }
  }
  ctl_->cv.notify_all();
  return streams;
}

std::unique_ptr<Engine::Request> Engine::prepare(GenerationRequest request) const {
  using K = RejectedError::Kind;
  const int n_prompt = static_cast<int>(request.prompt.size());
  if (n_prompt == 0) throw RejectedError(K::kInvalid, "the prompt is empty", "prompt");
  for (int32_t t : request.prompt) {
    if (t < 0 || t >= config_.vocab_size) {
      throw RejectedError(K::kInvalid, "prompt token id " + std::to_string(t) +
                                           " is outside the vocabulary [0, " +
                                           std::to_string(config_.vocab_size) + ")",
                          "prompt");
    }
  }
  if (request.max_tokens < 1) {
    throw RejectedError(K::kInvalid,
                        "max_tokens must be at least 1, got " + std::to_string(request.max_tokens),
                        "max_tokens");
  }
  if (static_cast<int64_t>(n_prompt) + request.max_tokens > max_model_len_) {
    throw RejectedError(K::kInvalid,
                        "This model's maximum context length is " + std::to_string(max_model_len_) +
                            " tokens. However, you requested " +
                            std::to_string(static_cast<int64_t>(n_prompt) + request.max_tokens) +
                            " tokens (" + std::to_string(n_prompt) + " in the prompt, " +
                            std::to_string(request.max_tokens) +
                            " in the completion). Please reduce the prompt or max_tokens.",
                        "max_tokens");
  }
  if (pool_tokens_ > 0 && n_prompt + 1 > pool_tokens_) {
    throw RejectedError(K::kInvalid, "the prompt (" + std::to_string(n_prompt) +
                                         " tokens) does not fit the KV cache (" +
                                         std::to_string(pool_tokens_) + " tokens)",
                        "prompt");
  }
  if (request.min_tokens < 0 || request.min_tokens > request.max_tokens) {
    throw RejectedError(K::kInvalid,
                        "min_tokens must be in [0, max_tokens = " +
                            std::to_string(request.max_tokens) + "], got " +
                            std::to_string(request.min_tokens),
                        "min_tokens");
  }
  auto check_id = [&](int32_t id, const char* field) {
    if (id < 0 || id >= config_.vocab_size) {
      throw RejectedError(K::kInvalid,
                          std::string(field) + ": token id " + std::to_string(id) +
                              " is outside the vocabulary (" +
                              std::to_string(config_.vocab_size) + " ids)",
                          field);
    }
  };
  for (int32_t id : request.sampling.allowed_token_ids) check_id(id, "allowed_token_ids");
  for (const auto& [id, bias] : request.sampling.logit_bias) check_id(id, "logit_bias");
  if (request.min_tokens > 0 && !request.sampling.allowed_token_ids.empty()) {
    // Within min_tokens the stop ids are banned: something else must be allowed.
    const auto& allowed = request.sampling.allowed_token_ids;
    if (std::all_of(allowed.begin(), allowed.end(),
                    [&](int32_t id) { return stops_on(request, id); })) {
      throw RejectedError(K::kInvalid,
                          "allowed_token_ids: every allowed id is a stop id, so nothing can be "
                          "sampled within min_tokens",
                          "allowed_token_ids");
    }
  }
  if (request.top_logprobs > config_.vocab_size) {
    throw RejectedError(K::kInvalid, "top_logprobs is larger than the vocabulary", "top_logprobs");
  }
  if (request.prompt_logprobs < -1 || request.prompt_logprobs > config_.vocab_size) {
    throw RejectedError(K::kInvalid,
                        "prompt_logprobs must be in [-1, " + std::to_string(config_.vocab_size) +
                            "], got " + std::to_string(request.prompt_logprobs),
                        "prompt_logprobs");
  }
  try {
    request.sampling.validate();
  } catch (const Error& e) {
    throw RejectedError(K::kInvalid, e.what());
  }
  if (!tokenizer_ && !request.stop.empty()) {
    throw RejectedError(K::kInvalid,
                        "stop strings need a tokenizer (this model has none); use stop_token_ids",
                        "stop");
  }
  for (const std::string& s : request.stop) {
    if (s.empty()) throw RejectedError(K::kInvalid, "stop strings must not be empty", "stop");
  }

  auto r = std::make_unique<Request>(request.sampling);
  r->t_submit = Clock::now();
  if (tokenizer_) r->decoder.emplace(*tokenizer_, request.skip_special_tokens);
  r->req = std::move(request);
  return r;
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(ctl_->mu);
  EngineStats s = ctl_->stats;
  s.n_waiting += static_cast<int>(ctl_->incoming.size());
  return s;
}

void Engine::stop_accepting() {
  std::lock_guard<std::mutex> lk(ctl_->mu);
  ctl_->accepting = false;
}

void Engine::cancel_all() {
  {
    std::lock_guard<std::mutex> lk(ctl_->mu);
    ctl_->cancel_all = true;
  }
  ctl_->cv.notify_all();
}

bool Engine::wait_idle(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(ctl_->mu);
  return ctl_->idle_cv.wait_for(lk, timeout, [&] { return ctl_->n_active == 0; });
}

void Engine::update_stats() {
  const MemoryUsage mem = backend_->memory();
  std::lock_guard<std::mutex> lk(ctl_->mu);
  ctl_->stats.memory = mem;
  ctl_->stats.n_running = scheduler_.n_running();
  ctl_->stats.n_waiting = scheduler_.n_waiting();
  ctl_->stats.n_preemptions = scheduler_.n_preemptions();
}

void Engine::publish(Request& r) {
  RequestStream& s = *r.stream;
  std::shared_ptr<StreamNotifier> notifier;
  {
    std::lock_guard<std::mutex> lk(s.mu_);
    s.pending_.text += r.out_text;
    for (GeneratedToken& g : r.out_tokens) s.pending_.tokens.push_back(std::move(g));
    // The prompt's logprobs go out whole, with the first token (they are complete once it is
    // sampled: the step that samples it ran the prompt's last rows).
    if (!r.generated.empty() && !r.prompt_lp.empty()) {
      s.pending_.prompt_logprobs = std::move(r.prompt_lp);
      r.prompt_lp.clear();
    }
    s.pending_.n_generated = static_cast<int>(r.generated.size());
    s.pending_.n_preemptions = r.n_preemptions;
    s.pending_.ttft_s = r.ttft_s;
    s.has_news_ = true;
    notifier = s.notifier_;
  }
  r.out_text.clear();
  r.out_tokens.clear();
  s.cv_.notify_all();
  if (notifier) notifier->notify();
}

void Engine::finish(Request& r, FinishReason reason, const std::string& error) {
  scheduler_.remove(r.id);  // frees the slot now (no-op when the scheduler already dropped it)
  if (reason != FinishReason::kCancelled) {
    if (r.decoder) r.held += r.decoder->flush();
    r.out_text += r.held;
  }
  r.decoder.reset();
  r.held.clear();
  // Gauges first, so that whoever sees this request finish (its consumer, or wait_idle) also sees
  // the memory it freed.
  const MemoryUsage mem = backend_->memory();
  {
    std::lock_guard<std::mutex> lk(ctl_->mu);
    ctl_->stats.memory = mem;
    ctl_->stats.n_running = scheduler_.n_running();
    ctl_->stats.n_waiting = scheduler_.n_waiting();
    ctl_->stats.n_finished[static_cast<int>(reason)]++;
  }
  publish(r);
  RequestStream& s = *r.stream;
  std::shared_ptr<StreamNotifier> notifier;
  {
    std::lock_guard<std::mutex> lk(s.mu_);
    s.pending_.finish = reason;
    s.pending_.error = error;
    if (reason == FinishReason::kStop) {
      s.pending_.stop_string = r.stop_string;
      s.pending_.stop_token = r.stop_token;
    }
    s.pending_.e2e_s = std::chrono::duration<double>(Clock::now() - r.t_submit).count();
    s.done_ = true;
    notifier = s.notifier_;
  }
  s.cv_.notify_all();
  if (notifier) notifier->notify();
  const uint64_t id = r.id;
  {
    std::lock_guard<std::mutex> lk(ctl_->mu);
    --ctl_->n_active;
  }
  ctl_->idle_cv.notify_all();
  active_.erase(id);  // destroys r
}

namespace {
// True when the request's next token, picked with n_generated tokens already out, is exactly the
// argmax of the raw logits and nothing else of the row is needed: greedy, no logprobs, no
// penalties, no logit bias or allowed ids and past min_tokens (they all change the logits on the
// host).
bool wants_only_argmax(const GenerationRequest& q, size_t n_generated) {
  const SamplingParams& p = q.sampling;
  return p.greedy() && q.top_logprobs < 0 && p.repetition_penalty == 1.0f &&
         p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f && p.logit_bias.empty() &&
         p.allowed_token_ids.empty() && n_generated >= static_cast<size_t>(q.min_tokens);
}
// Length of the longest suffix of `text` that is a proper prefix of one of `stops`.
size_t stop_holdback(const std::string& text, const std::vector<std::string>& stops) {
  size_t best = 0;
  for (const std::string& stop : stops) {
    const size_t max_k = std::min(text.size(), stop.size() - 1);
    for (size_t k = max_k; k > best; --k) {
      if (text.compare(text.size() - k, k, stop, 0, k) == 0) {
        best = k;
        break;
      }
    }
  }
  return best;
}
// Where `text` is cut for the earliest stop string of q (npos: none): at its start, or with
// include_stop_str at its end (of the first listed one, when several start there). Only matches
// that end past `floor` bytes count (the text before it came within min_tokens; vLLM likewise
// checks only what reaches past that point).
// `which`, when given, gets the stop string found.
size_t find_stop(const std::string& text, const GenerationRequest& q, size_t floor,
                 std::string* which = nullptr) {
  size_t best = std::string::npos;
  const std::string* found = nullptr;
  for (const std::string& stop : q.stop) {
    const size_t at = text.find(stop, floor >= stop.size() ? floor - stop.size() + 1 : 0);
    if (at < best) {
      best = at;
      found = &stop;
    }
  }
  if (found && which) *which = *found;
  return best == std::string::npos || !q.include_stop_str ? best : best + found->size();
}
}  // namespace

bool Engine::stops_on(const GenerationRequest& q, int32_t token) const {
  const auto& st = q.stop_token_ids;
  return std::find(st.begin(), st.end(), token) != st.end() ||
         (!q.ignore_eos && std::find(eos_ids_.begin(), eos_ids_.end(), token) != eos_ids_.end());
}

std::vector<int32_t> Engine::min_tokens_banned(const Request& r) const {
  const GenerationRequest& q = r.req;
  if (r.generated.size() >= static_cast<size_t>(q.min_tokens)) return {};
  std::vector<int32_t> ids = q.stop_token_ids;
  if (!q.ignore_eos) ids.insert(ids.end(), eos_ids_.begin(), eos_ids_.end());
  return ids;
}

void Engine::take_prompt_logprobs(Request& r, int begin, size_t n_rows, const float* rows,
                                  const RowScore* scores) {
  const GenerationRequest& q = r.req;
  if (q.prompt_logprobs < 0) return;
  const size_t vocab = static_cast<size_t>(config_.vocab_size);
  const int n_prompt = static_cast<int>(q.prompt.size());
  // The row at position p scores prompt token p + 1; rows before next_prompt_lp were taken
  // before a preemption. Rows are independent: ~0.5 ms each at a 248K vocabulary, so a chunk's
  // go over the cores.
  const int first = std::max(begin, r.next_prompt_lp - 1);
  const int last = std::min(begin + static_cast<int>(n_rows), n_prompt - 1);  // exclusive
  if (first >= last) return;
  DS_CHECK(first == r.next_prompt_lp - 1, "engine: prompt logprobs rows skipped (position ",
           r.next_prompt_lp, " due, rows start at ", begin, ")");
  const size_t at = r.prompt_lp.size();
  r.prompt_lp.resize(at + static_cast<size_t>(last - first));
#pragma omp parallel for schedule(static) if (!scores && last - first >= 8)
  for (int p = first; p < last; ++p) {
    RowScore sc;
    if (scores) {  // scored by the backend
      sc = scores[p - begin];
    } else {
      const float* row = rows + static_cast<size_t>(p - begin) * vocab;
      sc = position_logprobs(std::span<const float>(row, vocab), q.prompt[p + 1],
                             q.prompt_logprobs);
    }
    GeneratedToken& g = r.prompt_lp[at + static_cast<size_t>(p - first)];
    g.id = q.prompt[p + 1];
    g.logprob = sc.logprob;
    g.rank = sc.rank;
    g.top = std::move(sc.top);
  }
  r.next_prompt_lp = last + 1;
}

void Engine::on_token(Request& r, int32_t token, const float* row) {
  const GenerationRequest& q = r.req;
  GeneratedToken g;
  g.id = token;
  if (q.top_logprobs >= 0) {
    DS_CHECK(row != nullptr, "engine: logprobs asked for but no logits row");
    // One log-sum-exp for the token and its alternatives (a pass over the row each costs ~0.5 ms
    // at a 248K vocabulary, per generated token).
    RowScore lp = position_logprobs(
        std::span<const float>(row, static_cast<size_t>(config_.vocab_size)), token,
        q.top_logprobs);
    g.logprob = lp.logprob;
    g.top = std::move(lp.top);
  }
  r.out_tokens.push_back(std::move(g));
  r.generated.push_back(token);
  if (r.ttft_s < 0) r.ttft_s = std::chrono::duration<double>(Clock::now() - r.t_submit).count();
  {
    std::lock_guard<std::mutex> lk(ctl_->mu);
    ctl_->stats.generation_tokens++;
  }

  // Within min_tokens nothing stops the output but its length (the stop ids were not sampled).
  const bool may_stop = r.generated.size() > static_cast<size_t>(q.min_tokens);
  if (may_stop && stops_on(q, token)) {
    // The stop token's own text is part of the output only with include_stop_str_in_output (as
    // vLLM's detokenizer has it; an EOS is a special token, so "" unless special tokens are
    // shown). A stop string in the text wins, as in vLLM.
    const auto& ids = q.stop_token_ids;
    if (std::find(ids.begin(), ids.end(), token) != ids.end()) r.stop_token = token;
    if (r.decoder && q.include_stop_str && token < tok_vocab_) r.held += r.decoder->push(token);
    if (r.decoder) r.held += r.decoder->flush();
    const size_t at = find_stop(r.held, q, r.stop_floor, &r.stop_string);
    if (at != std::string::npos) r.held.resize(at);
    r.out_text += r.held;
    r.held.clear();
    r.decoder.reset();
    finish(r, FinishReason::kStop);
    return;
  }
  if (r.decoder) {
    // Ids past the tokenizer (checkpoints pad the embedding beyond it) decode to nothing.
    if (token < tok_vocab_) r.held += r.decoder->push(token);
    if (!q.stop.empty() && may_stop) {
      const size_t at = find_stop(r.held, q, r.stop_floor, &r.stop_string);
      if (at != std::string::npos) {
        r.out_text += r.held.substr(0, at);
        r.held.clear();
        r.decoder.reset();
        finish(r, FinishReason::kStop);
        return;
      }
    }
  }
  const int total = static_cast<int>(q.prompt.size() + r.generated.size());
  if (static_cast<int>(r.generated.size()) >= q.max_tokens || total >= max_model_len_) {
    if (r.decoder) {
      r.held += r.decoder->flush();
      r.decoder.reset();
      const size_t at =
          may_stop ? find_stop(r.held, q, r.stop_floor, &r.stop_string) : std::string::npos;
      if (at != std::string::npos) {
        r.held.resize(at);
        finish(r, FinishReason::kStop);
        return;
      }
    }
    finish(r, FinishReason::kLength);  // publishes what is held
    return;
  }
  const size_t keep = stop_holdback(r.held, q.stop);
  const size_t out = r.held.size() - keep;
  r.out_text += r.held.substr(0, out);
  r.held.erase(0, out);
  // Within min_tokens, all the text held so far is out of reach of the stop strings.
  r.stop_floor = may_stop ? r.stop_floor - std::min(r.stop_floor, out) : r.held.size();
  publish(r);
  scheduler_.append_token(r.id, token);
}

namespace {
int64_t blocks_for(int64_t tokens, int page) { return (tokens + page - 1) / page; }
}  // namespace

void Engine::pipeline_round() {
  DS_ASSERT(in_flight_.size() == 1);
  const InFlight cur = in_flight_.front();
  // 1. The next step (rows fed from this one's, feed_row = the row here), if nothing can make it
  // differ from the scheduler's plan once this step's tokens are in.
  std::vector<DecodeItem> items;
  std::vector<uint64_t> ids;
  std::vector<int> slots;
  bool next = scheduler_.n_waiting() == 0;
  {
    std::lock_guard<std::mutex> lk(ctl_->mu);
    next =
        next && ctl_->incoming.empty() && ctl_->cancels.empty() && !ctl_->cancel_all && !ctl_->stop;
  }
  int n_alive = 0;
  const MemoryUsage mem = backend_->memory();
  const bool paged = mem.page_size > 0 && mem.kv_blocks_total > 0;
  int64_t free_blocks = mem.kv_blocks_total - mem.kv_blocks_used;
  for (size_t row = 0; row < cur.ids.size() && next; ++row) {
    auto found = active_.find(cur.ids[row]);
    const SchedSeq* s = scheduler_.find(cur.ids[row]);
    if (found == active_.end() || !s || s->status != SeqStatus::kRunning ||
        s->slot != cur.slots[row])
      continue;  // stopped or cancelled since its launch: the row is dropped
    ++n_alive;
    const Request& r = *found->second;
    const int64_t gen = static_cast<int64_t>(r.generated.size()) + 1;  // with this step's token
    const int64_t total = static_cast<int64_t>(r.req.prompt.size()) + gen;
    const int slot = cur.slots[row];
    const int64_t len = backend_->slot_len(slot);  // counts the step in flight
    const int64_t need =
        paged ? blocks_for(len + 1, mem.page_size) - blocks_for(len, mem.page_size) : 0;
    if (gen >= r.req.max_tokens || total >= max_model_len_ || !device_greedy_ ||
        !wants_only_argmax(r.req, static_cast<size_t>(gen)) || !backend_->can_grow(slot, 1) ||
        need > free_blocks) {
      next = false;
      break;
    }
    free_blocks -= need;
    items.push_back({slot, 0, static_cast<int>(row)});
    ids.push_back(cur.ids[row]);
    slots.push_back(slot);
  }
  // Every running sequence decodes in it (none prefilling), within the token budget.
  next = next && n_alive > 0 && n_alive == scheduler_.n_running() &&
         n_alive <= scheduler_.options().max_num_batched_tokens;
  // A launch that throws may have enqueued part of its step (a device error after the metadata
  // copy): its rows' slots can no longer be trusted, so their requests end with the error once
  // this step's tokens are out (never re-stepped, which could apply a step twice).
  std::string launch_error;
  std::vector<uint64_t> failed_ids;
  if (next) {
    try {
      backend_->launch_greedy_decode(items);
      in_flight_.push_back({ids, std::move(slots)});
      std::lock_guard<std::mutex> lk(ctl_->mu);
      ctl_->stats.n_pipelined_steps++;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "deltaserve: pipelined decode launch failed: %s\n", e.what());
      launch_error = e.what();
      failed_ids = ids;
    }
  }

  // 2. Collect the oldest step.
  std::vector<int32_t> tokens;
  try {
    backend_->collect_greedy_decode(tokens);
    DS_CHECK(tokens.size() == cur.ids.size(), "engine: a decode step returned ", tokens.size(),
             " tokens for ", cur.ids.size(), " rows");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "deltaserve: engine step failed: %s\n", e.what());
    in_flight_.pop_front();
    drain_pipeline();  // the step after it (if launched) is lost too
    fail_requests(cur.ids, e.what());
    return;
  }
  in_flight_.pop_front();

  // 3. Its rows as a completed scheduler step, then each token through the stop checks.
  StepPlan done;
  std::vector<size_t> rows;
  int64_t wasted = 0;
  for (size_t row = 0; row < cur.ids.size(); ++row) {
    const SchedSeq* s = scheduler_.find(cur.ids[row]);
    if (!active_.count(cur.ids[row]) || !s || s->status != SeqStatus::kRunning ||
        s->slot != cur.slots[row]) {
      ++wasted;
      continue;
    }
    ScheduledItem it;
    it.seq_id = cur.ids[row];
    it.slot = cur.slots[row];
    it.begin = s->n_cached;
    it.end = s->n_cached + 1;
    it.sample = true;
    done.items.push_back(it);
    rows.push_back(row);
  }
  scheduler_.complete(done);
  {
    std::lock_guard<std::mutex> lk(ctl_->mu);
    ctl_->stats.n_steps++;
    ctl_->stats.n_wasted_rows += wasted;
  }
  for (size_t k = 0; k < done.items.size(); ++k) {
    const uint64_t id = done.items[k].seq_id;
    auto found = active_.find(id);
    if (found == active_.end()) continue;
    try {
      const int32_t token = tokens[rows[k]];
      DS_CHECK(token >= 0, "sampling: the logits contain NaN or +inf");
      on_token(*found->second, token, nullptr);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "deltaserve: request %llu failed: %s\n",
                   static_cast<unsigned long long>(id), e.what());
      auto again = active_.find(id);
      if (again != active_.end()) finish(*again->second, FinishReason::kError, e.what());
    }
  }
  fail_requests(failed_ids, launch_error);
}

void Engine::fail_requests(std::span<const uint64_t> ids, const std::string& error) {
  for (uint64_t id : ids) {
    auto found = active_.find(id);
    if (found != active_.end()) finish(*found->second, FinishReason::kError, error);
  }
}

void Engine::drain_pipeline() {
  std::vector<int32_t> tokens;
  while (!in_flight_.empty()) {
    try {
      backend_->collect_greedy_decode(tokens);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "deltaserve: dropped decode step failed: %s\n", e.what());
    }
    in_flight_.pop_front();
  }
}

void Engine::loop() {
  StepOutput out;
  for (;;) {
    std::deque<std::unique_ptr<Request>> incoming;
    std::vector<uint64_t> cancels;
    bool cancel_everything = false, stopping = false;
    {
      std::unique_lock<std::mutex> lk(ctl_->mu);
      ctl_->cv.wait(lk, [&] {
        return ctl_->stop || ctl_->cancel_all || !ctl_->incoming.empty() ||
               !ctl_->cancels.empty() || !scheduler_.idle() || !in_flight_.empty();
      });
      incoming.swap(ctl_->incoming);
      // They wait until the scheduler says otherwise: counted as waiting in the same critical
      // section that takes them off the submit queue, or submit() would see neither count until
      // update_stats() after the next step and admit past max_waiting.
      ctl_->stats.n_waiting += static_cast<int>(incoming.size());
      cancels.swap(ctl_->cancels);
      cancel_everything = ctl_->cancel_all || ctl_->stop;
      ctl_->cancel_all = false;
      stopping = ctl_->stop;
    }
    for (auto& r : incoming) {
      const uint64_t id = r->id;
      std::vector<int32_t> prompt = r->req.prompt;
      Request& ref = *r;
      active_.emplace(id, std::move(r));
      using PR = Scheduler::PromptRows;
      const int k = ref.req.prompt_logprobs;
      const PR rows = k < 0 ? PR::kNone : scores_rows(k) ? PR::kScored : PR::kHost;
      if (!scheduler_.add(id, std::move(prompt), rows))
        finish(ref, FinishReason::kError, "queue full");
    }
    for (uint64_t id : cancels) {
      auto it = active_.find(id);
      if (it != active_.end()) finish(*it->second, FinishReason::kCancelled);
    }
    if (cancel_everything) {
      std::vector<uint64_t> ids;
      for (auto& [id, r] : active_) ids.push_back(id);
      for (uint64_t id : ids) finish(*active_.at(id), FinishReason::kCancelled);
    }
    if (stopping) {
      drain_pipeline();
      update_stats();
      return;
    }
    if (!in_flight_.empty()) {  // a pipelined decode step runs: collect it (launching the next)
      pipeline_round();
      update_stats();
      continue;
    }
    if (scheduler_.idle()) {
      update_stats();
      continue;
    }

    StepPlan plan = scheduler_.schedule();
    {  // who runs now and who waits (preempted, admitted), before the step rather than after it
      std::lock_guard<std::mutex> lk(ctl_->mu);
      ctl_->stats.n_running = scheduler_.n_running();
      ctl_->stats.n_waiting = scheduler_.n_waiting();
    }
    for (uint64_t id : plan.preempted) {
      auto it = active_.find(id);
      if (it != active_.end()) it->second->n_preemptions++;
    }
    for (uint64_t id : plan.capacity_stopped) {
      auto it = active_.find(id);
      if (it != active_.end()) finish(*it->second, FinishReason::kLength);
    }
    if (plan.empty()) {
      // Nothing can run now (memory is held by sequences that are all waiting on it): wait a
      // little for a cancellation rather than spin.
      update_stats();
      std::unique_lock<std::mutex> lk(ctl_->mu);
      ctl_->cv.wait_for(lk, std::chrono::milliseconds(2));
      continue;
    }
    int64_t n_prompt_tokens = 0;
    std::vector<uint64_t> plan_ids;
    for (const ScheduledItem& it : plan.items) {
      const SchedSeq* s = scheduler_.find(it.seq_id);
      n_prompt_tokens += std::max(0, std::min(it.end, s->n_prompt) - it.begin);
      plan_ids.push_back(it.seq_id);
    }
    // Rows that are not sampled, or sampled by plain argmax, come back as token ids only.
    for (size_t i = 0; i < plan.items.size(); ++i) {
      const ScheduledItem& it = plan.items[i];
      bool greedy = device_greedy_;
      if (greedy && it.sample) {
        auto found = active_.find(it.seq_id);
        greedy = found != active_.end() &&
                 wants_only_argmax(found->second->req, found->second->generated.size());
      }
      plan.work[i].greedy = greedy;
      // Prompt rows wanted: a backend that scores rows itself gets the targets instead.
      if (plan.work[i].all_logits) {
        auto found = active_.find(it.seq_id);
        if (found == active_.end()) continue;
        const GenerationRequest& q = found->second->req;
        if (!scores_rows(q.prompt_logprobs)) continue;
        SeqWork& w = plan.work[i];
        w.all_logits = false;
        w.score_top = q.prompt_logprobs;
        w.score_next = it.end < static_cast<int>(q.prompt.size()) ? q.prompt[it.end] : -1;
        if (w.score_next >= 0) w.greedy = true;  // every row scored: no row, no token
      }
    }
    // A pure greedy decode of running sequences: launched, collected by pipeline_round (which
    // launches the step after it first when it can).
    bool pure_decode = pipeline_ && !plan.items.empty();
    for (size_t i = 0; i < plan.items.size() && pure_decode; ++i) {
      const ScheduledItem& it = plan.items[i];
      pure_decode = it.sample && it.begin > 0 && it.end == it.begin + 1 && plan.work[i].greedy &&
                    !plan.work[i].all_logits;
    }
    if (pure_decode) {
      std::vector<uint64_t> ids;
      std::vector<int> slots;
      std::vector<DecodeItem> items;
      for (size_t i = 0; i < plan.items.size(); ++i) {
        ids.push_back(plan.items[i].seq_id);
        slots.push_back(plan.items[i].slot);
        items.push_back({plan.items[i].slot, plan.work[i].tokens[0], -1});
      }
      try {
        backend_->launch_greedy_decode(items);
        in_flight_.push_back({std::move(ids), std::move(slots)});
        std::lock_guard<std::mutex> lk(ctl_->mu);
        ctl_->stats.prompt_tokens += n_prompt_tokens;  // one-token prompt tails can come this way
      } catch (const std::exception& e) {
        // As a failed step below: the launch may have enqueued part of the step before it threw
        // (a device error), so the plan is never run again (that could apply a step twice).
        std::fprintf(stderr, "deltaserve: engine step failed: %s\n", e.what());
        fail_requests(plan_ids, e.what());
      }
      update_stats();
      continue;
    }
    try {
      backend_->step_greedy(plan.work, out);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "deltaserve: engine step failed: %s\n", e.what());
      fail_requests(plan_ids, e.what());
      update_stats();
      continue;
    }
    scheduler_.complete(plan);
    {
      std::lock_guard<std::mutex> lk(ctl_->mu);
      ctl_->stats.n_steps++;
      ctl_->stats.prompt_tokens += n_prompt_tokens;
    }
    const size_t vocab = static_cast<size_t>(config_.vocab_size);
    size_t next_row = 0;  // rows of out.logits belong to the items without `greedy`, in order
    size_t next_score = 0;  // out.scores: the scored items' rows, in order
    for (size_t i = 0; i < plan.items.size(); ++i) {
      const ScheduledItem& it = plan.items[i];
      const SeqWork& w = plan.work[i];
      const float* row = nullptr;
      const float* rows = nullptr;  // with all_logits: the first token's row
      const RowScore* scores = nullptr;  // with score_top: the first token's score
      if (w.score_top >= 0) {
        scores = out.scores.data() + next_score;
        next_score += w.tokens.size() - 1 + (w.score_next >= 0 ? 1 : 0);
      }
      if (!w.greedy || w.all_logits) {
        const size_t n_rows = w.all_logits ? w.tokens.size() : 1;
        rows = out.logits.data() + next_row * vocab;
        row = rows + (n_rows - 1) * vocab;  // the last token's row
        next_row += n_rows;
      }
      auto found = active_.find(it.seq_id);
      if (found == active_.end()) continue;
      Request& r = *found->second;
      try {
        if (w.all_logits || scores)
          take_prompt_logprobs(r, it.begin, w.tokens.size() - (scores && w.score_next < 0),
                               rows, scores);
        if (!it.sample) continue;
        int32_t token = 0;
        if (row) {
          token = r.sampler.sample(std::span<const float>(row, vocab), r.generated,
                                   min_tokens_banned(r));
        } else {
          token = out.tokens.at(i);
          DS_CHECK(token >= 0, "sampling: the logits contain NaN or +inf");
        }
        on_token(r, token, row);
      } catch (const std::exception& e) {
        // Never let one request's failure take the loop (and the server) down.
        std::fprintf(stderr, "deltaserve: request %llu failed: %s\n",
                     static_cast<unsigned long long>(it.seq_id), e.what());
        auto again = active_.find(it.seq_id);
        if (again != active_.end()) finish(*again->second, FinishReason::kError, e.what());
      }
    }
    update_stats();
  }
}

}  // namespace ds
