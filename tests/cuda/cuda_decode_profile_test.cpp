// The 27B decode step as it runs inside its CUDA graph (issue 6): every kernel's in-graph start and
// end from CUPTI activity records (the device's own timestamps of each graph kernel node), so the
// table shows what isolated kernel timings cannot: how long each kernel runs next to its
// neighbours and the gap (or, under programmatic dependent launch, the overlap) before it.
// Synthetic Qwen3.5-27B weights on the device, batch 1, 2 and 4 at a 4K context, device greedy
// (step_greedy, the graph of bench decode); each variant of the decode step (the fused norms on /
// off, CudaEngineOptions::fused_norm_rows 4 / 0) is timed and profiled in the same process on the
// same weights. Printed per kernel role (gdn_in, gate_up+silu, down, add_rmsnorm, ...): launches
// per step, mean in-graph duration, mean gap before it (start minus the previous kernel's end; < 0:
// it started while the previous one ran), and the mean "advance" (its end minus the previous
// kernel's end: what it added to the step's critical path); then the first layers of one step
// kernel by kernel.
// CUPTI (libcupti.so.13 of the CUDA toolkit) is loaded at run time with dlopen ($DS_CUPTI_LIB, else
// the loader's search path), so the test binary needs no CUPTI to start; without it only the step
// times are printed. Off by default (heavy): DS_PROFILE=1 runs it (scripts/gpu_test.sh
// --only cuda_decode_profile_test with DS_PROFILE=1). CUPTI's tracing adds a little to each step:
// the step time with tracing is printed next to the untraced median.
#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda_test_util.h"

namespace ds {
namespace {

struct KernelRec {
  uint64_t start = 0, end = 0;
  uint32_t correlation = 0, graph = 0;
  int grid = 0, block = 0, smem = 0, regs = 0;
  std::string name;  // demangled
};

std::mutex g_mu;
std::vector<KernelRec> g_recs;

using GetNextRecordFn = CUptiResult (*)(uint8_t*, size_t, CUpti_Activity**);
GetNextRecordFn g_next = nullptr;

std::string demangle(const char* s) {
  if (!s) return "?";
  int st = 0;
  char* d = abi::__cxa_demangle(s, nullptr, nullptr, &st);
  std::string r = st == 0 && d ? d : s;
  std::free(d);
  return r;
}

void CUPTIAPI buffer_requested(uint8_t** buf, size_t* size, size_t* max_records) {
  *size = size_t(8) << 20;
  *buf = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buf, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::vector<KernelRec> got;
  while (g_next && g_next(buf, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL &&
        rec->kind != CUPTI_ACTIVITY_KIND_KERNEL)
      continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    KernelRec r;
    r.start = k->start;
    r.end = k->end;
    r.correlation = k->correlationId;
    r.graph = k->graphId;
    r.grid = k->gridX * k->gridY * k->gridZ;
    r.block = k->blockX * k->blockY * k->blockZ;
    r.smem = k->dynamicSharedMemory + k->staticSharedMemory;
    r.regs = k->registersPerThread;
    r.name = demangle(k->name);
    got.push_back(std::move(r));
  }
  std::free(buf);
  const std::lock_guard<std::mutex> lock(g_mu);
  g_recs.insert(g_recs.end(), got.begin(), got.end());
}

// The few CUPTI entry points the test uses, from a dlopen'd libcupti.
struct Cupti {
  CUptiResult (*enable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*disable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc,
                                    CUpti_BuffersCallbackCompleteFunc) = nullptr;
  CUptiResult (*flush_all)(uint32_t) = nullptr;
  bool ok = false;
  std::string why;

  Cupti() {
    std::vector<std::string> names;
    if (const char* e = std::getenv("DS_CUPTI_LIB")) names.push_back(e);
    names.push_back("libcupti.so.13");
    names.push_back("libcupti.so");
    void* lib = nullptr;
    for (const auto& n : names) {
      lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib) break;
      why += n + ": " + dlerror() + "; ";
    }
    if (!lib) return;
    auto sym = [&](const char* s) {
      void* p = dlsym(lib, s);
      if (!p) why += std::string("missing ") + s + "; ";
      return p;
    };
    enable = reinterpret_cast<decltype(enable)>(sym("cuptiActivityEnable"));
    disable = reinterpret_cast<decltype(disable)>(sym("cuptiActivityDisable"));
    register_callbacks =
        reinterpret_cast<decltype(register_callbacks)>(sym("cuptiActivityRegisterCallbacks"));
    flush_all = reinterpret_cast<decltype(flush_all)>(sym("cuptiActivityFlushAll"));
    g_next = reinterpret_cast<GetNextRecordFn>(sym("cuptiActivityGetNextRecord"));
    ok = enable && disable && register_callbacks && flush_all && g_next &&
         register_callbacks(buffer_requested, buffer_completed) == CUPTI_SUCCESS;
    if (!ok) why += "cuptiActivityRegisterCallbacks failed; ";
  }
};

// A short name per kernel family.
std::string short_name(const KernelRec& r) {
  const std::string& n = r.name;
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (has("add_rmsnorm")) return "add_rmsnorm";
  if (has("gemv_bulk_kernel")) {  // gemv_bulk_kernel<M, R, GLU, OutT, NORM>
    const size_t a = n.find('<', n.find("gemv_bulk_kernel")), e = n.find('>', a);
    std::vector<std::string> t;
    for (size_t i = a + 1; a != std::string::npos && e != std::string::npos && i < e;) {
      const size_t j = std::min(n.find(", ", i), e);
      t.push_back(n.substr(i, j - i));
      i = j + 2;
    }
    const bool glu = t.size() > 2 && t[2] == "true", f32 = t.size() > 3 && t[3] == "float",
               norm = t.size() > 4 && t[4] == "true";
    return std::string(glu ? "gemv_bulk_silu" : "gemv_bulk") + (f32 ? "(f32)" : "") +
           (norm ? "+norm" : "");
  }
  if (has("gemv_narrow")) return "gemv_narrow";
  if (has("skinny_gemm")) return "skinny_mma";
  if (has("gdn_decode_stream")) return "gdn_decode_stream";
  if (has("gdn_decode")) return "gdn_decode";
  if (has("rope_kv")) return "rope_kv";
  if (has("attention_decode_merge")) return "attn_merge";
  if (has("attention_decode")) return "attn_split";
  if (has("silu_mul")) return "silu_mul";
  if (has("argmax")) return "argmax";
  if (has("gather_rows")) return "gather_rows";
  const size_t p = n.find('(');
  return "other:" + n.substr(0, std::min<size_t>(p == std::string::npos ? n.size() : p, 40));
}

bool is_small(const std::string& s) {
  return s == "add_rmsnorm" || s == "gdn_decode" || s == "gdn_decode_stream" || s == "rope_kv" ||
         s == "attn_merge" || s == "attn_split" || s == "silu_mul" || s == "argmax" ||
         s == "gather_rows";
}

// The projection a GEMM-like kernel computes, from its neighbours in the step.
std::vector<std::string> roles(const std::vector<KernelRec>& step) {
  std::vector<std::string> s(step.size()), r(step.size());
  for (size_t i = 0; i < step.size(); ++i) s[i] = short_name(step[i]);
  for (size_t i = 0; i < step.size(); ++i) {
    const std::string prev = i ? s[i - 1] : "", next = i + 1 < s.size() ? s[i + 1] : "";
    if (is_small(s[i])) {
      r[i] = s[i];
      if (s[i] == "add_rmsnorm" && next.rfind("gemv_bulk_silu", 0) == 0) r[i] += " (post)";
      if (s[i] == "add_rmsnorm" && next == "gather_rows") r[i] += " (final)";
      if (s[i] == "gather_rows") r[i] += prev == "add_rmsnorm" ? " (lm rows)" : " (embedding)";
      continue;
    }
    std::string role;
    auto silu = [](const std::string& x) { return x.rfind("gemv_bulk_silu", 0) == 0; };
    if (silu(s[i]))
      role = "gate_up+silu";
    else if (next == "gdn_decode" || next == "gdn_decode_stream")
      role = "gdn_in";
    else if (next == "rope_kv")
      role = "attn_qkv";
    else if (prev == "gdn_decode" || prev == "gdn_decode_stream")
      role = "gdn_out";
    else if (prev == "attn_merge" || prev == "attn_split")
      role = "attn_o";
    else if (next == "silu_mul")
      role = "gate_up";
    else if (prev == "silu_mul" || silu(prev))
      role = "down";
    else if (next == "argmax" || s[i] == "gemv_bulk(f32)")
      role = "lm_head";
    else
      role = "?";
    r[i] = role + ": " + s[i];
  }
  return r;
}

struct Row {
  int n = 0;
  double dur = 0, gap = 0, adv = 0;
};

// Prints the per-role table of the steps (each sorted by start) and returns the mean span (ms).
double report(const std::string& title, const std::vector<std::vector<KernelRec>>& steps,
              bool print_layers) {
  std::map<std::string, Row> rows;
  std::vector<std::string> order;
  double span = 0, busy = 0;
  for (const auto& st : steps) {
    const auto role = roles(st);
    span += (st.back().end - st.front().start) * 1e-6;
    for (size_t i = 0; i < st.size(); ++i) {
      if (!rows.count(role[i])) order.push_back(role[i]);
      Row& r = rows[role[i]];
      r.n++;
      r.dur += (st[i].end - st[i].start) * 1e-3;
      busy += (st[i].end - st[i].start) * 1e-6;
      if (i > 0) {
        r.gap += (double(st[i].start) - double(st[i - 1].end)) * 1e-3;
        r.adv += (double(st[i].end) - double(st[i - 1].end)) * 1e-3;
      } else {
        r.adv += (st[i].end - st[i].start) * 1e-3;
      }
    }
  }
  const double ns = double(steps.size());
  std::printf(
      "PROFILE %s: %zu kernels per step, in-graph span %.3f ms (sum of kernel durations "
      "%.3f ms), mean of %zu steps\n",
      title.c_str(), steps.front().size(), span / ns, busy / ns, steps.size());
  std::printf("PROFILE %-34s %5s %9s %9s %9s %10s %10s\n", "role: kernel", "n", "dur us", "gap us",
              "adv us", "dur ms", "adv ms");
  std::sort(order.begin(), order.end(),
            [&](const auto& a, const auto& b) { return rows[a].adv > rows[b].adv; });
  for (const auto& k : order) {
    const Row& r = rows[k];
    std::printf("PROFILE %-34s %5.0f %9.2f %9.2f %9.2f %10.3f %10.3f\n", k.c_str(), r.n / ns,
                r.dur / r.n, r.gap / r.n, r.adv / r.n, r.dur / ns * 1e-3, r.adv / ns * 1e-3);
  }
  if (print_layers) {
    const auto& st = steps.back();
    const auto role = roles(st);
    std::printf(
        "PROFILE %s, one step, first 24 kernels: start us (from the step's first), "
        "duration, gap before, grid x block, shared memory, registers\n",
        title.c_str());
    for (size_t i = 0; i < std::min<size_t>(24, st.size()); ++i)
      std::printf("PROFILE   %3zu %-30s %9.2f %8.2f %8.2f  %4d x %4d %7d B %4d\n", i,
                  role[i].c_str(), (st[i].start - st[0].start) * 1e-3,
                  (st[i].end - st[i].start) * 1e-3,
                  i ? (double(st[i].start) - double(st[i - 1].end)) * 1e-3 : 0.0, st[i].grid,
                  st[i].block, st[i].smem, st[i].regs);
  }
  return span / ns;
}

TEST(DecodeProfile, Synthetic27bInGraph) {
  DS_REQUIRE_GPU();
  const char* env = std::getenv("DS_PROFILE");
  if (!env || std::string(env) != "1") GTEST_SKIP() << "set DS_PROFILE=1 to profile the 27B step";
  Cupti cupti;
  if (!cupti.ok) std::printf("  CUPTI not available (%s): step times only\n", cupti.why.c_str());
  const ModelConfig c = synthetic_model_config("27b");
  BackendOptions o;
  o.device = "cuda";
  o.n_slots = 4;
  o.chunk_size = 4096;
  CudaEngineOptions e;
  e.verbose = false;
  e.max_kv_tokens = 4 * 4600;
  auto b = make_cuda_backend_synthetic(o, c, 1, e);
  std::mt19937 rng(5);
  const int V = c.vocab_size;
  std::vector<float> logits;
  for (int s = 0; s < 4; ++s) {
    std::vector<int32_t> p(4096);
    for (auto& x : p) x = int32_t(rng() % V);
    SeqWork w{s, p, false};
    b->step(std::span<const SeqWork>(&w, 1), logits);
  }
  StepOutput out;
  auto run = [&](int batch, int n, std::vector<double>* ms) {
    std::vector<std::vector<int32_t>> toks(batch, std::vector<int32_t>(1));
    std::vector<SeqWork> work(batch);
    for (int st = 0; st < n; ++st) {
      for (int s = 0; s < batch; ++s) {
        toks[s][0] = int32_t(rng() % V);
        work[s] = {s, toks[s], false, true};
      }
      const auto t0 = std::chrono::steady_clock::now();
      b->step_greedy(work, out);
      if (ms)
        ms->push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() *
                      1e3);
    }
  };
  const int default_rows = cuda_fused_norm(*b);
  for (int batch : {1, 2, 4}) {
    for (bool fused : {false, true}) {
      set_cuda_fused_norm(*b, fused ? 4 : 0);  // on: at every batch size the kernels support
      const std::string title =
          "batch " + std::to_string(batch) + " ctx 4K, fused_norm " + (fused ? "on" : "off");
      run(batch, 6, nullptr);  // eager warm-up, capture, replays
      std::vector<double> ms;
      run(batch, 40, &ms);
      std::sort(ms.begin(), ms.end());
      std::printf("STEP %s: p50 %.3f ms, min %.3f, p90 %.3f (step_greedy, graph, %zu steps)\n",
                  title.c_str(), ms[ms.size() / 2], ms.front(), ms[ms.size() * 9 / 10], ms.size());
      if (!cupti.ok) continue;
      // graph = true: 8 steps with graphs re-captured under tracing (kernel nodes of graphs
      // instantiated before may not be traced); false: 8 eager steps (the fallback when CUPTI
      // reports no graph kernels). Returns the steps, each sorted by start.
      auto collect = [&](bool graph, std::vector<double>& traced) {
        {
          const std::lock_guard<std::mutex> lock(g_mu);
          g_recs.clear();
        }
        EXPECT_EQ(cupti.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), CUPTI_SUCCESS);
        set_cuda_graphs(*b, false);
        set_cuda_graphs(*b, graph);
        run(batch, 8, &traced);
        cudaDeviceSynchronize();
        cupti.flush_all(1);
        cupti.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
        set_cuda_graphs(*b, true);
        std::vector<KernelRec> all;
        {
          const std::lock_guard<std::mutex> lock(g_mu);
          for (const auto& r : g_recs)
            if ((r.graph != 0) == graph) all.push_back(r);
        }
        std::sort(all.begin(), all.end(),
                  [](const auto& a, const auto& x) { return a.start < x.start; });
        // One graph step = one cudaGraphLaunch: its kernel records share the launch's correlation
        // id. Eager steps (or a CUPTI that gives each node its own id) are cut at the embedding
        // gather, the first kernel of a step.
        std::map<uint32_t, std::vector<KernelRec>> by_launch;
        for (const auto& r : all) by_launch[r.correlation].push_back(r);
        std::vector<std::vector<KernelRec>> steps;
        if (graph && by_launch.size() >= 4 && by_launch.begin()->second.size() >= 50) {
          for (auto& [corr, v] : by_launch) steps.push_back(v);
        } else {
          std::printf(
              "  (%s: %zu kernel records, %zu correlation ids; steps cut at the embedding "
              "gather)\n",
              graph ? "graph" : "eager", all.size(), by_launch.size());
          for (size_t i = 0; i < all.size(); ++i) {
            const bool first = short_name(all[i]) == "gather_rows" &&
                               (i == 0 || short_name(all[i - 1]) == "argmax");
            if (first || steps.empty()) steps.emplace_back();
            steps.back().push_back(all[i]);
          }
        }
        return steps;
      };
      std::vector<double> traced;
      std::string how = "graph";
      auto steps = collect(true, traced);
      if (steps.size() < 4) {
        std::printf("  CUPTI saw %zu graph launches: profiling eager steps instead\n",
                    steps.size());
        how = "EAGER";
        traced.clear();
        steps = collect(false, traced);
      }
      ASSERT_GE(steps.size(), 4u) << title << ": CUPTI saw " << steps.size() << " steps";
      steps.erase(steps.begin(), steps.begin() + 2);  // warm-up / the replays right after capture
      for (const auto& s : steps) EXPECT_EQ(s.size(), steps.front().size()) << title;
      std::sort(traced.begin(), traced.end());
      std::printf("STEP %s: traced (%s) p50 %.3f ms\n", title.c_str(), how.c_str(),
                  traced[traced.size() / 2]);
      report(title + " [" + how + "]", steps, batch == 1);
    }
  }
  set_cuda_fused_norm(*b, default_rows);
  EXPECT_EQ(cuda_graph_stats(*b).failures, 0);
}

}  // namespace
}  // namespace ds
