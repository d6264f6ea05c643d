// `deltaserve bench ceilings|kernels|prefill|decode|serve|all [--profile] [--json FILE]`: the
// benchmarks of bench/bench.h. Every GPU run measures the ceilings first and reports its numbers
// as ratios to them; the JSON file holds everything (bench/plot.py draws it). `all` runs every
// bench in one process on one engine (what scripts/gpu_bench.sh calls: the device time is spent
// on measuring, not on generating 27B weights five times).
//
// The engine benches also run on the CPU reference (--device cpu --synthetic tiny): a dry run of
// the harness without a GPU (no ceilings, so no ratios).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>

#include "bench/bench.h"
#include "cli/command.h"
#include "core/error.h"

namespace ds::cli {
namespace {

struct BenchOpts {
  std::string which;  // ceilings, kernels, prefill, decode, serve, all
  std::string json_path;
  bench::BenchBackendSpec spec;
  bool profile = false;
  bool quick = false;
  std::string contexts = "4096,8192,16384,32768", batches = "1,4,16", cases;
  std::string prompts = "4096,8192,16384,32768", repeats;
  int steps = 128, warmup = 8, requests = 5, output_tokens = 128;
  bool decode_logits = false;
  int samples = 30;
  std::string only;
  double max_seconds = 0;
  int profile_batch = 1;
  int64_t profile_context = 4096, profile_chunk = 4096, profile_cached = 0;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string read_commit() {
  if (const char* e = std::getenv("DS_BENCH_COMMIT")) return e;
  return "unknown (set DS_BENCH_COMMIT)";
}

int run_bench(BenchOpts o) {
  const auto t0 = std::chrono::steady_clock::now();
  const bool all = o.which == "all";
  const bool gpu = o.spec.device.rfind("cuda", 0) == 0;
  const bool want_kernels =
      (all && gpu) || o.which == "kernels";  // a CPU `all` skips the GPU parts
  const bool want_prefill = all || o.which == "prefill";
  const bool want_decode = all || o.which == "decode";
  const bool want_serve = all || o.which == "serve";
  int device = 0;
  if (o.spec.device.size() > 5) {
    try {
      device = std::stoi(o.spec.device.substr(5));
    } catch (...) {
      ds::throw_error("--device: bad value '", o.spec.device, "' (cpu, cuda or cuda:N)");
    }
  }
  DS_CHECK(gpu || o.spec.device == "cpu", "--device: bad value '", o.spec.device,
           "' (cpu, cuda or cuda:N)");
  DS_CHECK(gpu || (o.which != "ceilings" && o.which != "kernels" && !o.profile), "bench ", o.which,
           o.profile ? " --profile" : "", " needs a GPU (--device cuda)");
  if (!o.json_path.empty()) {  // fail now, not after minutes of measuring (and leave no empty file)
    const bool existed = std::filesystem::exists(o.json_path);
    {
      std::ofstream f(o.json_path, std::ios::app);
      DS_CHECK(f.good(), "--json: cannot write ", o.json_path);
    }
    if (!existed) std::filesystem::remove(o.json_path);
  }

  bench::Report report;
  report.set_meta("command", "bench " + o.which);
  report.set_meta("commit", read_commit());
  report.set_meta("device_option", o.spec.device);
  report.set_meta("weights", o.spec.model.empty() ? "synthetic " + o.spec.synthetic : o.spec.model);
  const ModelConfig cfg = bench::bench_model_config(o.spec);
  report.set_meta("model", cfg.summary());
  report.set_meta("layers", cfg.n_layers);
  auto save = [&]() {
    if (!o.json_path.empty()) {
      report.set_meta("wall_s", seconds_since(t0));
      report.write(o.json_path);
    }
  };

  // Each part is isolated: one that fails is reported (and the exit code says so) and the rest
  // still run. The engine benches go first and the kernel benches last, so that a kernel case
  // that breaks the CUDA context cannot cost the serving numbers.
  int failures = 0;
  auto part = [&](const char* name, const std::function<void()>& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      ++failures;
      report.add_note(std::string(name) + " failed: " + e.what());
    }
    save();
  };

  // Ceilings first: every other number is read against them.
  bench::Ceilings ceil;
  if (gpu) {
    const std::string why = bench::cuda_device_status();
    DS_CHECK(why.empty(), "bench ", o.which, ": ", why);
    part("ceilings", [&]() {
      ceil = bench::measure_ceilings(device);
      report.add_ceilings(ceil);
      report.set_meta("device", ceil.device);
    });
  } else {
    report.add_note(
        "CPU run: no ceilings, so no floors in seconds and no ratios (a dry run of the harness)");
  }
  save();
  if (o.which == "ceilings") return failures ? 1 : 0;

  bench::KernelBenchOptions ko;
  ko.device = device;
  ko.samples = o.samples;
  ko.quick = o.quick;
  ko.only = o.only;

  // The engine: sized for the benches asked for.
  bench::EngineBenchOptions eo;
  eo.prompts = bench::parse_int_list(o.prompts, "--prompt");
  if (!o.repeats.empty())
    for (int64_t r : bench::parse_int_list(o.repeats, "--repeats"))
      eo.prefill_repeats.push_back(static_cast<int>(r));
  eo.decode_cases = o.cases.empty()
                        ? bench::cross_cases(bench::parse_int_list(o.batches, "--batch"),
                                             bench::parse_int_list(o.contexts, "--context"))
                        : bench::parse_decode_cases(o.cases);
  eo.decode_steps = o.steps;
  eo.decode_warmup = o.warmup;
  eo.decode_logits = o.decode_logits;
  eo.serve_requests = o.requests;
  eo.serve_output = o.output_tokens;
  eo.serve_chunk = o.spec.chunk_size;
  eo.max_seconds = o.max_seconds;
  DS_CHECK(o.steps >= 1 && o.warmup >= 0 && o.requests >= 1 && o.output_tokens >= 1,
           "--steps, --requests and --output-tokens must be positive, --warmup non-negative");
  std::vector<bench::PrefillResult> prefill;
  std::vector<bench::DecodeResult> decode;
  if (want_prefill || want_decode || want_serve) {
    int64_t max_len = 64, kv_tokens = 64;
    int slots = 1;
    if (want_prefill)
      for (int64_t p : eo.prompts)
        max_len = std::max(max_len, p), kv_tokens = std::max(kv_tokens, p + 64);
    if (want_decode) {
      int64_t max_ctx = 0;
      for (const auto& [b, c] : eo.decode_cases) max_ctx = std::max(max_ctx, c);
      max_len = std::max<int64_t>(
          max_len, max_ctx + int64_t(eo.decode_cases.size()) * (o.steps + o.warmup) + 64);
      kv_tokens = std::max(kv_tokens, bench::decode_kv_tokens_needed(eo));
      slots = std::max(slots, bench::decode_slots_needed(eo));
    }
    if (want_serve) {
      max_len = std::max<int64_t>(max_len, 32768 + o.output_tokens + 64);
      kv_tokens = std::max<int64_t>(kv_tokens, 32768 + o.output_tokens + 128);
    }
    o.spec.n_slots = slots;
    o.spec.max_seq_len = static_cast<int>((max_len + 63) / 64 * 64);
    o.spec.max_kv_tokens = kv_tokens;
    std::unique_ptr<Backend> be;
    part("engine setup", [&]() {
      const auto t_load = std::chrono::steady_clock::now();
      be = bench::make_bench_backend(o.spec);
      report.set_meta("engine", be->name());
      report.set_meta("engine_setup_s", seconds_since(t_load));
      std::printf("engine %s ready in %.1f s: %d slots, %d tokens per sequence\n",
                  be->name().c_str(), seconds_since(t_load), be->n_slots(), be->max_seq_len());
      std::fflush(stdout);
    });
    if (be && want_prefill)
      part("prefill", [&]() {
        prefill = bench::run_prefill_bench(*be, ceil, eo);
        report.add_prefill(prefill, ceil);
      });
    if (be && want_decode)
      part("decode", [&]() {
        decode = bench::run_decode_bench(*be, ceil, eo);
        report.add_decode(decode, ceil);
      });
    if (be && want_serve)
      part("serve", [&]() { report.add_serve(bench::run_serve_bench(std::move(be), eo)); });
    be.reset();  // frees the engine's memory for the kernel benches
  }

  std::vector<bench::KernelResult> kernels;
  if (want_kernels)
    part("kernels", [&]() {
      kernels = bench::run_kernel_bench(cfg, ceil, ko);
      report.add_kernels(kernels);
    });
  if (o.profile)
    part("profile", [&]() {
      std::vector<bench::Profile> profile =
          bench::run_profile(cfg, ceil, ko, o.profile_batch, o.profile_context, o.profile_chunk,
                             o.profile_cached, kernels);
      // The engine-measured step beside the kernel sum, where this run measured the same shape.
      for (auto& p : profile) {
        if (p.phase == "decode")
          for (const auto& d : decode)
            if (d.batch == o.profile_batch && d.context == o.profile_context)
              p.measured_s = d.tpot_s.p50;
        if (p.phase == "prefill" && o.profile_cached == 0)
          for (const auto& r : prefill)
            if (r.prompt == o.profile_chunk) p.measured_s = r.ttft_s.p50;
      }
      report.add_profile(profile);
    });
  std::printf("\nbench %s done in %.1f s%s%s%s\n", o.which.c_str(), seconds_since(t0),
              o.json_path.empty() ? "" : ", JSON in ", o.json_path.c_str(),
              failures ? " (SOME PARTS FAILED: see the notes)" : "");
  return failures ? 1 : 0;
}

void add_common(CLI::App* sub, BenchOpts& o) {
  sub->add_option("--json", o.json_path, "Write every result to this JSON file");
  sub->add_option("--device", o.spec.device,
                  "cuda, cuda:N, or cpu (engine benches only: a dry run)")
      ->capture_default_str();
  sub->add_option("--synthetic", o.spec.synthetic,
                  "Random weights for: 27b (Qwen3.5-27B), tiny, or a config.json path")
      ->capture_default_str();
  sub->add_option("--model", o.spec.model, "A checkpoint folder instead of synthetic weights");
  sub->add_option("--layers", o.spec.layers, "Keep only the first N layers (quick runs)");
  sub->add_option("--seed", o.spec.seed, "Seed of the synthetic weights")->capture_default_str();
  sub->add_flag("--profile", o.profile,
                "Per-kernel breakdown of one decode step and one prefill chunk");
  sub->add_option("--profile-batch", o.profile_batch, "Decode batch of the profile")
      ->capture_default_str();
  sub->add_option("--profile-context", o.profile_context, "Decode context of the profile")
      ->capture_default_str();
  sub->add_option("--profile-chunk", o.profile_chunk, "Prefill chunk of the profile")
      ->capture_default_str();
  sub->add_option("--profile-cached", o.profile_cached, "Tokens cached before the profiled chunk")
      ->capture_default_str();
  sub->add_option("--max-seconds", o.max_seconds,
                  "Per engine bench: skip the cases left after this long (0: no limit)");
  sub->add_option("--chunk-size", o.spec.chunk_size, "Engine prompt chunk (tokens per forward)")
      ->capture_default_str();
}

void add_kernel_opts(CLI::App* sub, BenchOpts& o) {
  sub->add_flag("--quick", o.quick, "Fewer kernel shapes (decode batch 1, the 4096 chunk)");
  sub->add_option("--only", o.only,
                  "Comma-separated kernel families (gemm,attn_prefill,attn_decode,gdn_prefill,"
                  "gdn_decode,rmsnorm,silu_mul,rope_kv,gather)");
  sub->add_option("--samples", o.samples, "Timed graph replays per kernel case")
      ->capture_default_str();
}
void add_prefill_opts(CLI::App* sub, BenchOpts& o) {
  sub->add_option("--prompt", o.prompts, "Prompt lengths (comma-separated, K suffix allowed)")
      ->capture_default_str();
  sub->add_option("--repeats", o.repeats,
                  "Runs per prompt length (default 3 up to 8K, 2 up to 16K, else 1)");
}
void add_decode_opts(CLI::App* sub, BenchOpts& o) {
  sub->add_option("--context", o.contexts, "Context lengths (comma-separated)")
      ->capture_default_str();
  sub->add_option("--batch", o.batches, "Batch sizes (comma-separated)")->capture_default_str();
  sub->add_option("--cases", o.cases, "Explicit BATCH@CONTEXT list instead of --batch x --context");
  sub->add_option("--steps", o.steps, "Timed decode steps per case")->capture_default_str();
  sub->add_option("--warmup", o.warmup, "Untimed decode steps first")->capture_default_str();
  sub->add_flag("--decode-logits", o.decode_logits,
                "Time decode steps with every row's logits copied to the host (step()) instead "
                "of device greedy (step_greedy: 4 bytes per row, what greedy serving pays)");
}
void add_serve_opts(CLI::App* sub, BenchOpts& o) {
  sub->add_option("--requests", o.requests, "Requests per bucket")->capture_default_str();
  sub->add_option("--output-tokens", o.output_tokens, "Generated tokens per request")
      ->capture_default_str();
}

std::function<int()> setup_bench(CLI::App& app) {
  auto o = std::make_shared<BenchOpts>();
  app.require_subcommand(1);
  struct Sub {
    const char* name;
    const char* help;
  };
  const Sub subs[] = {
      {"ceilings", "GPU read / copy bandwidth and bf16 GEMM rate"},
      {"kernels", "Every kernel family over the serving shapes, against the roofline"},
      {"prefill", "TTFT, tok/s and TFLOP/s per prompt length against the FLOP floor"},
      {"decode", "TPOT P50/P99 per (batch, context) against the bandwidth floor"},
      {"serve", "The concurrency-1 bucket workload through the engine, in-process"},
      {"all", "Everything above in one process on one engine"},
  };
  auto chosen = std::make_shared<std::vector<std::pair<CLI::App*, std::string>>>();
  for (const Sub& s : subs) {
    CLI::App* sub = app.add_subcommand(s.name, s.help);
    add_common(sub, *o);
    const std::string n = s.name;
    if (n == "kernels" || n == "all") add_kernel_opts(sub, *o);
    if (n == "prefill" || n == "all") add_prefill_opts(sub, *o);
    if (n == "decode" || n == "all") add_decode_opts(sub, *o);
    if (n == "serve" || n == "all") add_serve_opts(sub, *o);
    chosen->emplace_back(sub, n);
  }
  return [o, chosen]() {
    for (const auto& [sub, name] : *chosen)
      if (sub->parsed()) {
        o->which = name;
        return run_bench(*o);
      }
    ds::throw_error("bench: name one of ceilings, kernels, prefill, decode, serve, all");
  };
}

DS_COMMAND("bench", "Benchmarks: ceilings, kernels, prefill, decode, serve, all (see docs/perf/)",
           setup_bench);

}  // namespace
}  // namespace ds::cli
