// Prometheus metrics: see metrics.h.
#include "server/metrics.h"

#include <cstdio>

namespace ds {

namespace {
std::string fmt_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}
void header(std::string& out, const char* name, const char* type, const char* help) {
  out += "# HELP ";
  out += name;
  out += ' ';
  out += help;
  out += "\n# TYPE ";
  out += name;
  out += ' ';
  out += type;
  out += '\n';
}
void line(std::string& out, const std::string& name, double v) {
  out += name + ' ' + fmt_double(v) + '\n';
}
}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  counts_[i]++;
  sum_ += v;
  n_++;
}

void Histogram::render(const std::string& name, std::string& out) const {
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += name + "_bucket{le=\"" + fmt_double(bounds_[i]) + "\"} " + std::to_string(cum) + '\n';
  }
  cum += counts_.back();
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(cum) + '\n';
  out += name + "_sum " + fmt_double(sum_) + '\n';
  out += name + "_count " + std::to_string(n_) + '\n';
}

ServerMetrics::ServerMetrics()
    : ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
             10.0, 20.0, 40.0, 80.0}),
      tpot_({0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
             0.075, 0.1,    0.15,  0.2,    0.3,  0.4,   0.5,  0.75,  1.0,  2.5}),
      e2e_({0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
            240.0, 480.0}),
      prompt_len_({1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                   100000, 200000}),
      gen_len_({1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000}) {}

void ServerMetrics::count_http(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> lk(mu_);
  http_[{endpoint, status}]++;
}

void ServerMetrics::record_request(const StreamOutput& o) {
  std::lock_guard<std::mutex> lk(mu_);
  finished_[finish_reason_name(o.finish)]++;
  prompt_tokens_ += static_cast<uint64_t>(o.n_prompt_tokens);
  generation_tokens_ += static_cast<uint64_t>(o.n_generated);
  prompt_len_.observe(o.n_prompt_tokens);
  gen_len_.observe(o.n_generated);
  if (o.ttft_s >= 0) ttft_.observe(o.ttft_s);
  if (o.e2e_s >= 0) e2e_.observe(o.e2e_s);
  if (o.ttft_s >= 0 && o.e2e_s >= 0 && o.n_generated > 1) {
    tpot_.observe((o.e2e_s - o.ttft_s) / (o.n_generated - 1));
  }
}

std::string ServerMetrics::render(const EngineStats& e) const {
  std::string out;
  std::lock_guard<std::mutex> lk(mu_);
  header(out, "deltaserve_http_requests_total", "counter",
         "HTTP requests by endpoint and status code.");
  for (const auto& [key, n] : http_) {
    out += "deltaserve_http_requests_total{endpoint=\"" + key.first + "\",status=\"" +
           std::to_string(key.second) + "\"} " + std::to_string(n) + '\n';
  }
  header(out, "deltaserve_request_finished_total", "counter",
         "Generations (choices) finished, by finish reason (stop, length, cancelled, error).");
  for (const char* r : {"stop", "length", "cancelled", "error"}) {
    auto it = finished_.find(r);
    out += std::string("deltaserve_request_finished_total{finish_reason=\"") + r + "\"} " +
           std::to_string(it == finished_.end() ? 0 : it->second) + '\n';
  }
  header(out, "deltaserve_prompt_tokens_total", "counter", "Prompt tokens of finished requests.");
  line(out, "deltaserve_prompt_tokens_total", static_cast<double>(prompt_tokens_));
  header(out, "deltaserve_generation_tokens_total", "counter",
         "Generated tokens of finished requests.");
  line(out, "deltaserve_generation_tokens_total", static_cast<double>(generation_tokens_));
  header(out, "deltaserve_engine_prompt_tokens_total", "counter",
         "Prompt tokens computed by the engine (chunks of prefills, recomputes excluded).");
  line(out, "deltaserve_engine_prompt_tokens_total", static_cast<double>(e.prompt_tokens));
  header(out, "deltaserve_engine_generation_tokens_total", "counter",
         "Tokens sampled by the engine.");
  line(out, "deltaserve_engine_generation_tokens_total", static_cast<double>(e.generation_tokens));
  header(out, "deltaserve_engine_steps_total", "counter",
         "Engine steps (batches run by the backend).");
  line(out, "deltaserve_engine_steps_total", static_cast<double>(e.n_steps));
  header(out, "deltaserve_num_preemptions_total", "counter",
         "Sequences preempted (recomputed later) because the KV cache was full.");
  line(out, "deltaserve_num_preemptions_total", static_cast<double>(e.n_preemptions));

  header(out, "deltaserve_num_requests_running", "gauge", "Sequences running in the engine.");
  line(out, "deltaserve_num_requests_running", e.n_running);
  header(out, "deltaserve_num_requests_waiting", "gauge",
         "Sequences waiting for a slot (queue length).");
  line(out, "deltaserve_num_requests_waiting", e.n_waiting);
  header(out, "deltaserve_kv_blocks_used", "gauge", "Paged KV cache blocks in use.");
  line(out, "deltaserve_kv_blocks_used", static_cast<double>(e.memory.kv_blocks_used));
  header(out, "deltaserve_kv_blocks_total", "gauge", "Paged KV cache blocks in the pool.");
  line(out, "deltaserve_kv_blocks_total", static_cast<double>(e.memory.kv_blocks_total));
  header(out, "deltaserve_state_slots_used", "gauge", "Gated DeltaNet state slots in use.");
  line(out, "deltaserve_state_slots_used", e.memory.state_slots_used);
  header(out, "deltaserve_state_slots_total", "gauge", "Gated DeltaNet state slots.");
  line(out, "deltaserve_state_slots_total", e.memory.state_slots_total);
  const double usage = e.memory.kv_blocks_total > 0
                           ? static_cast<double>(e.memory.kv_blocks_used) / e.memory.kv_blocks_total
                           : 0.0;
  header(out, "deltaserve_kv_cache_usage_perc", "gauge",
         "Fraction of KV cache blocks in use (0-1).");
  line(out, "deltaserve_kv_cache_usage_perc", usage);

  header(out, "deltaserve_time_to_first_token_seconds", "histogram", "Time to first token.");
  ttft_.render("deltaserve_time_to_first_token_seconds", out);
  header(out, "deltaserve_time_per_output_token_seconds", "histogram",
         "Mean time per output token after the first, per request.");
  tpot_.render("deltaserve_time_per_output_token_seconds", out);
  header(out, "deltaserve_e2e_request_latency_seconds", "histogram", "End-to-end request latency.");
  e2e_.render("deltaserve_e2e_request_latency_seconds", out);
  header(out, "deltaserve_request_prompt_tokens", "histogram", "Prompt length per request.");
  prompt_len_.render("deltaserve_request_prompt_tokens", out);
  header(out, "deltaserve_request_generation_tokens", "histogram", "Generated tokens per request.");
  gen_len_.render("deltaserve_request_generation_tokens", out);
  return out;
}

}  // namespace ds
