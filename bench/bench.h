// `deltaserve bench`: the measurements every performance claim comes from (PERF.md "Benchmark
// method"). One result struct per bench, the functions that run them, and the report that prints
// each as a table and collects all of them into one JSON document (bench/plot.py draws it).
//
//   ceilings  streaming read, device-to-device copy, cuBLASLt bf16 GEMM 8192^3 (GPU only)
//   kernels   each kernel family over the shapes serving produces, against the roofline, with the
//             generic fallback's time and an output comparison where a specialised variant exists
//   profile   one decode step and one prefill chunk split by kernel class (built from the kernel
//             timings, compared with the measured step)
//   prefill   TTFT / tok/s / TFLOP/s per prompt length against the FLOP floor (any Backend)
//   decode    TPOT P50 / P99 per (context, batch) against the bandwidth floor (any Backend)
//   serve     the concurrency-1 bucket workload through the Engine, in-process
//
// The engine benches take any Backend, so they also run on the CPU reference with a tiny config
// (a dry run of the harness; the floors then have no ceilings to divide by and ratios are null).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_math.h"
#include "model/config.h"
#include "runtime/backend.h"

namespace ds::bench {

// ---- Ceilings (gpu_bench.cpp) -----------------------------------------------------------------
struct Ceilings {
  bool valid = false;  // measured on a GPU in this run
  std::string device;  // "NVIDIA H200 (sm_90, 132 SMs, 60 MiB L2)"
  double l2_bytes = 0;
  double read_bps = 0;             // streaming read, bytes/s
  double copy_bps = 0;             // device-to-device copy, bytes read + written per second
  double gemm_flops = 0;           // bf16 GEMM 8192^3 through cuBLASLt, FLOP/s
  Summary read_s, copy_s, gemm_s;  // per-repetition times
  double read_bytes = 0, copy_bytes = 0, gemm_flop = 0;  // work of one repetition
};

// "" when a CUDA device is usable; otherwise why not ("this binary was built without the CUDA
// backend", "no CUDA device: ...").
std::string cuda_device_status();
// Throws ds::Error with cuda_device_status() when there is no usable device.
Ceilings measure_ceilings(int device, int repeats = 20);

// ---- Kernels (gpu_kernels.cpp) ----------------------------------------------------------------
struct KernelResult {
  std::string family;   // dispatch family: gemm, attn_prefill, attn_decode, gdn_prefill, ...
  std::string variant;  // the variant timed (the engine's choice for the shape)
  std::string op;       // which op of the model (gate_up, down, lm_head, ...) or "" for a family
  std::string shape;    // human-readable shape
  double time_s = 0;    // median of the samples
  Summary samples;      // per-launch times, seconds
  double bytes = 0;     // device-memory bytes the launch must move at least
  double flops = 0;
  double floor_s = 0;  // roofline floor from the ceilings
  bool memory_bound = true;
  std::string fallback;         // the generic variant it replaces ("" if none)
  double fallback_time_s = -1;  // its median time on the same inputs
  std::string match;            // "bit-exact", "max abs err 1.2e-3 (rel 4e-4)", or ""
  std::string note;
};

struct KernelBenchOptions {
  int device = 0;
  int samples = 30;            // timed replays per case
  double min_sample_s = 2e-4;  // launches per replay are added until one replay takes this long
  bool quick = false;          // fewer shapes (decode batch 1, the 4096 chunk only)
  std::string only;            // comma-separated families to run ("" = all)
};

// Times every case; needs the ceilings for the floors.
std::vector<KernelResult> run_kernel_bench(const ModelConfig& c, const Ceilings& ceil,
                                           const KernelBenchOptions& opt);

// ---- Profile (gpu_kernels.cpp) ----------------------------------------------------------------
struct ProfileEntry {
  std::string kernel;  // kernel class (gemm.gate_up, attn_decode, gdn_decode, rmsnorm, ...)
  int launches = 0;    // per step
  double time_s = 0;   // all launches of the class in one step
  double bytes = 0, flops = 0;
  double share = 0;  // of the kernel sum
};
struct Profile {
  std::string phase;  // "decode" or "prefill"
  std::string shape;  // "batch 1 at context 4096" / "chunk 4096 after 0 cached"
  std::vector<ProfileEntry> entries;
  double kernel_sum_s = 0;  // sum of the isolated kernel times
  double measured_s = -1;   // the whole step through the engine, when measured in this run
  std::string method;
};
// One decode step (batch, context) and one prefill chunk (chunk tokens after `cached`), each
// composed from isolated kernel timings (CUDA graphs of the launches at exactly the shapes the
// forward issues, inputs rotated past L2), in forward order, grouped by kernel class.
std::vector<Profile> run_profile(const ModelConfig& c, const Ceilings& ceil,
                                 const KernelBenchOptions& opt, int decode_batch,
                                 int64_t decode_context, int64_t prefill_chunk,
                                 int64_t prefill_cached,
                                 const std::vector<KernelResult>& prior = {});

// ---- Engine benches (engine_bench.cpp) --------------------------------------------------------
struct PrefillResult {
  int64_t prompt = 0;
  Summary ttft_s;
  double tok_per_s = 0;  // prompt / median TTFT
  double tflops = 0;     // FLOPs / median TTFT, 1e12
  PrefillFlops flops;
  double floor_s = -1;  // FLOPs / GEMM ceiling (-1 without ceilings)
};
struct DecodeResult {
  int batch = 0;
  int64_t context = 0;      // nominal (the bucket)
  double context_mean = 0;  // tokens each sequence held, mean over the timed steps
  int warmup = 0;
  bool logits = false;  // step() with the logits rows to the host (else step_greedy)
  Summary tpot_s;       // per step (one token for every sequence)
  DecodeBytes bytes;    // at context_mean
  double floor_s = -1;  // bytes / streaming-read ceiling (-1 without ceilings)
  double fill_s = 0;    // time spent filling the KV cache for this case (prefill)
  int64_t fill_tokens = 0;
};
struct ServeBucket {
  std::string name;    // "4K-8K"
  int lo = 0, hi = 0;  // prompt lengths drawn from [lo, hi)
  double weight = 0;
  std::vector<int> prompts;
  Summary ttft_s, tpot_s;
  double throughput = 0;  // output tokens / end-to-end time, tok/s
};
struct ServeResult {
  std::vector<ServeBucket> buckets;
  double weighted_throughput = 0;
  int output_tokens = 0;
  std::string mode;  // "in-process (Engine)"
};

struct EngineBenchOptions {
  std::vector<int64_t> prompts = {4096, 8192, 16384, 32768};
  std::vector<int> prefill_repeats;  // per prompt; empty: 3 up to 8K, 2 up to 16K, then 1
  // Decode cases (batch, context), run in ascending context; the slots of the largest batch at a
  // context are filled first by real prefill (random tokens), then every batch of that context
  // decodes on the first `batch` slots.
  std::vector<std::pair<int, int64_t>> decode_cases;
  int decode_steps = 128;
  int decode_warmup = 8;
  // Decode steps through step_greedy (every row greedy: device argmax, 4 bytes per row to the
  // host: what the server pays for greedy requests) or, when true, through step() with every
  // row's logits copied to the host (what logprobs requests and host-side sampling pay).
  bool decode_logits = false;
  int serve_requests = 5;  // per bucket
  int serve_chunk = 8192;   // the serve bench's scheduler chunk (the backend's prompt chunk)
  int serve_output = 128;
  uint64_t seed = 0;
  double max_seconds = 0;  // > 0: skip the cases left once a bench has run this long
};

std::vector<PrefillResult> run_prefill_bench(Backend& be, const Ceilings& ceil,
                                             const EngineBenchOptions& opt);
std::vector<DecodeResult> run_decode_bench(Backend& be, const Ceilings& ceil,
                                           const EngineBenchOptions& opt);
// Takes the backend (the Engine owns it).
ServeResult run_serve_bench(std::unique_ptr<Backend> be, const EngineBenchOptions& opt);

// Slots and KV tokens the decode cases need (for sizing the backend).
int decode_slots_needed(const EngineBenchOptions& opt);
int64_t decode_kv_tokens_needed(const EngineBenchOptions& opt);
// "1@4096,4@4096" -> cases; or the cross product of batches x contexts.
std::vector<std::pair<int, int64_t>> parse_decode_cases(const std::string& cases);
std::vector<std::pair<int, int64_t>> cross_cases(const std::vector<int64_t>& batches,
                                                 const std::vector<int64_t>& contexts);

// ---- The engine under test (backend_setup.cpp) -----------------------------------------------
struct BenchBackendSpec {
  std::string device = "cuda";    // cpu, cuda, cuda:N
  std::string synthetic = "27b";  // "27b", "tiny", or a config.json path (random weights)
  std::string model;              // a checkpoint folder instead of synthetic weights
  int layers = 0;                 // > 0: keep only the first `layers` layers (quick runs)
  int n_slots = 1;
  int max_seq_len = 0;  // 0: the engine's default
  // Prompt tokens per forward. 8192: TTFT at 16K / 32K 0.03-1.6% lower than at 4096 in every
  // paired round on the H200, 8K a tie, 16384 slower at 32K (session 19, docs/perf/prefill_gaps.md).
  int chunk_size = 8192;
  int64_t max_kv_tokens = 0;  // cuda: cap the KV pool (leaves memory to the kernel bench)
  uint64_t seed = 1;
  bool verbose = true;
};
// The model config the spec names (without building anything).
ModelConfig bench_model_config(const BenchBackendSpec& spec);
std::unique_ptr<Backend> make_bench_backend(const BenchBackendSpec& spec);

// ---- Report (report.cpp) ----------------------------------------------------------------------
// Prints each part as a table on stdout as it comes, keeps everything for the JSON file.
class Report {
 public:
  Report();
  void set_meta(const std::string& key, const nlohmann::json& value);
  void add_ceilings(const Ceilings& c);
  void add_kernels(const std::vector<KernelResult>& r);
  void add_profile(const std::vector<Profile>& p);
  void add_prefill(const std::vector<PrefillResult>& r, const Ceilings& c);
  void add_decode(const std::vector<DecodeResult>& r, const Ceilings& c);
  void add_serve(const ServeResult& r);
  void add_note(const std::string& text);  // printed and kept under "notes"
  const nlohmann::json& json() const { return doc_; }
  // Writes the JSON document (pretty-printed). Throws ds::Error naming the file on failure.
  void write(const std::string& path) const;

 private:
  nlohmann::json doc_;
};

nlohmann::json to_json(const Summary& s);

}  // namespace ds::bench
