// Prometheus metrics of the server (text exposition format 0.0.4 for GET /metrics): HTTP request
// counts by endpoint and status, request outcomes by finish reason, tokens in/out, TTFT / TPOT /
// end-to-end latency histograms, plus the engine's gauges (running / waiting requests, KV blocks
// and GDN state slots in use, preemptions). Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "runtime/engine.h"

namespace ds {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);  // upper bounds, increasing (+Inf is implied)
  void observe(double v);
  // Appends the _bucket / _sum / _count lines of metric `name`.
  void render(const std::string& name, std::string& out) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative), last = +Inf
  double sum_ = 0;
  uint64_t n_ = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();
  void count_http(const std::string& endpoint, int status);
  // A finished generation (one choice): its outcome and timings.
  void record_request(const StreamOutput& final_output);
  // The full exposition text, with the engine's gauges.
  std::string render(const EngineStats& engine) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> http_;
  std::map<std::string, uint64_t> finished_;  // by finish reason
  uint64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  Histogram ttft_, tpot_, e2e_, prompt_len_, gen_len_;
};

}  // namespace ds
