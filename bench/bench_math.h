// The arithmetic behind every benchmark number: order statistics of timing samples, and the
// floors a run is judged against (PERF.md): the bytes one decode step must move through device
// memory (weights + KV cache + GDN state) and the FLOPs a prompt must do (linear layers + causal
// attention + the chunked GDN form). Host arithmetic only, unit-tested in CI
// (tests/bench_math_test.cpp); the GPU benches divide these by the ceilings they measure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace ds::bench {

// Order statistics of a set of samples (any unit). Percentiles interpolate linearly between
// the two nearest order statistics (numpy's default), so p50 of {1, 2, 3, 4} is 2.5.
struct Summary {
  int n = 0;
  double mean = 0, stddev = 0, min = 0, max = 0;
  double p10 = 0, p50 = 0, p90 = 0, p99 = 0;
};
// Throws ds::Error for an empty sample set or a non-finite sample.
Summary summarize(std::vector<double> samples);
// One percentile q in [0, 100] of `samples` (which it sorts). Throws on empty input or bad q.
double percentile(std::vector<double>& samples, double q);

// The device-memory traffic of one decode step of `batch` sequences that each hold `context`
// tokens (before the new one), bf16 weights and KV, fp32 GDN state, as the engine lays them out.
struct DecodeBytes {
  double weights = 0;      // every matrix read once (embedding: only the batch's rows), norms
  double kv = 0;           // K and V of every cached token of every attention layer, read once
  double gdn_state = 0;    // recurrent state (fp32) read + written, conv ring read + written
  double activations = 0;  // the new token's K/V written (negligible, counted for honesty)
  double total() const { return weights + kv + gdn_state + activations; }
};
DecodeBytes decode_step_bytes(const ModelConfig& c, int64_t context, int batch);

// FLOPs of a prompt chunk of `n_new` tokens appended to a sequence already holding `n_cached`
// tokens, with `logit_rows` rows of lm_head (1 for a normal prompt).
struct PrefillFlops {
  double linear = 0;     // 2 * params of every layer matrix per token (+ lm_head rows)
  double attention = 0;  // QK^T and PV over the causal (bottom-right) pairs, all attention layers
  double gdn = 0;        // the chunked GDN form (state in / out, intra-chunk products), all layers
  double total() const { return linear + attention + gdn; }
};
PrefillFlops prefill_flops(const ModelConfig& c, int64_t n_new, int64_t n_cached = 0,
                           int64_t logit_rows = 1);
// Bytes a prompt chunk must move at least: every weight once plus its KV written and the cache
// it attends to read once (the memory side of the prefill roofline).
double prefill_min_bytes(const ModelConfig& c, int64_t n_new, int64_t n_cached = 0);

// (query, key) pairs of one head for n_new queries after n_cached cached tokens, causal with the
// bottom-right alignment: query j sees n_cached + j + 1 keys.
double causal_pairs(int64_t n_new, int64_t n_cached);
// GDN chunk length the FLOP count assumes (the engine's chunked form).
constexpr int kGdnChunk = 64;
// FLOPs of the chunked GDN form for one layer and n tokens (see bench_math.cpp for the terms).
double gdn_layer_flops(const ModelConfig& c, int64_t n_tokens);

// Bytes of weights a decode step reads (the largest part of DecodeBytes::weights), by matrix.
double layer_matrix_params(const ModelConfig& c, LayerType t);  // matmul parameters of one layer

// The time floor of a workload: whichever of bytes / bandwidth and flops / rate is larger.
struct Floor {
  double seconds = 0;
  bool memory_bound = true;
};
Floor roofline_floor(double bytes, double flops, double bytes_per_s, double flops_per_s);

// Parses a comma-separated list of positive integers ("4096,8192"), with an optional K suffix
// ("4K" = 4096). Throws ds::Error naming `what` on anything else.
std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what);

// Human formats: 1.23 ms / 456 us, 3.21 TB/s, 790 TFLOP/s.
std::string format_seconds(double s);

}  // namespace ds::bench
