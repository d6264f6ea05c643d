// The 27B decode step as it runs inside its CUDA graph (issue 6): every kernel's in-graph start and
// end from CUPTI activity records (the device's own timestamps of each graph kernel node), so the
// table shows what isolated kernel timings cannot: how long each kernel runs next to its
// neighbours and the gap (or, under programmatic dependent launch, the overlap) before it.
// Synthetic Qwen3.5-27B weights on the device, batch 1, 2 and 4 ($DS_PROFILE_BATCHES, e.g. 1,16,
// for others) at a 4K context, device greedy
// (step_greedy, the graph of bench decode); each variant of the decode step (the fused norms on /
// off, CudaEngineOptions::fused_norm_rows 4 / 0) is timed and profiled in the same process on the
// same weights. Printed per kernel role (gdn_in, gate_up+silu, down, add_rmsnorm, ...): launches
// per step, mean in-graph duration, mean gap before it (start minus the previous kernel's end; < 0:
// it started while the previous one ran), and the mean "advance" (its end minus the previous
// kernel's end: what it added to the step's critical path); then the first layers of one step
// kernel by kernel.
// CUPTI (libcupti.so.13 of the CUDA toolkit) is loaded at run time with dlopen ($DS_CUPTI_LIB, else
// the loader's search path; DS_CUPTI_LIB=none: not loaded), so the test binary needs no CUPTI to
// start; without it only the step times are printed. Off by default (heavy): DS_PROFILE=1 runs it
// (scripts/gpu_test.sh
// --only cuda_decode_profile_test with DS_PROFILE=1). CUPTI's tracing adds a little to each step:
// the step time with tracing is printed next to the untraced median.
//
// HostGap (issue 6: the time per decode step outside the graph), also DS_PROFILE=1, batch 1 and 4
// at 4K, lines prefixed HOSTGAP: (a) the host clock split of a synchronous step_greedy
// (validation, metadata, copy + plan, graph launch, wait in the stream sync, the rest: medians,
// cuda_last_step_timing), (b) the graph replayed back to back 20 times between events (the pure
// device time per step, cuda_replay_last_graph), (c) the pipelined loop (launch t+1, collect t) and
// its per-step interval, (d) a CUPTI timeline of a few steps of each loop (kernels, memcpys and
// the runtime API calls on one clock): the mean idle time from the last kernel of step t (argmax)
// to the first kernel of step t+1 and what sits in it (the token D2H copy, the host's wake-up
// after the sync, the host's own work until the next metadata copy is issued, that copy, the
// cudaGraphLaunch call, the latency to the first kernel).
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
#include "cupti_loader.h"

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

// HostGap's timeline: GPU kernels and memcpys, and runtime API calls (same CUPTI clock, ns).
struct TimelineRec {
  enum Kind { kKernel, kH2D, kD2H, kApi } kind = kKernel;
  uint64_t start = 0, end = 0;
  uint32_t correlation = 0, cbid = 0;
  std::string name;  // kernels: demangled
};
std::vector<TimelineRec> g_timeline;
bool g_keep_timeline = false;

using test::demangle;

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buf, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::vector<KernelRec> got;
  std::vector<TimelineRec> tl;
  while (test::cupti_next_record &&
         test::cupti_next_record(buf, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      TimelineRec t;
      t.kind = m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? TimelineRec::kH2D
               : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? TimelineRec::kD2H
                                                                : TimelineRec::kApi;
      if (t.kind == TimelineRec::kApi) continue;
      t.start = m->start;
      t.end = m->end;
      t.correlation = m->correlationId;
      tl.push_back(t);
      continue;
    }
    if (rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
      TimelineRec t;
      t.kind = TimelineRec::kApi;
      t.start = a->start;
      t.end = a->end;
      t.correlation = a->correlationId;
      t.cbid = a->cbid;
      tl.push_back(t);
      continue;
    }
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
    TimelineRec t;
    t.kind = TimelineRec::kKernel;
    t.start = r.start;
    t.end = r.end;
    t.correlation = r.correlation;
    t.name = r.name;
    tl.push_back(t);
    got.push_back(std::move(r));
  }
  std::free(buf);
  const std::lock_guard<std::mutex> lock(g_mu);
  g_recs.insert(g_recs.end(), got.begin(), got.end());
  if (g_keep_timeline) g_timeline.insert(g_timeline.end(), tl.begin(), tl.end());
}

// A short name per kernel family.
std::string short_name(const KernelRec& r) {
  const std::string& n = r.name;
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (has("add_rmsnorm")) return "add_rmsnorm";
  if (has("gemv_mlp_norm_kernel")) return "gemv_mlp";  // $DS_MLP_FUSED: gate_up + down
  if (has("gemv_bulk_argmax"))  // $DS_ARGMAX_FUSED: lm_head; <M, R, NORM>: $DS_HEAD_NORM too
    return std::string("gemv_bulk_argmax(f32)") + (has(", true>") ? "+norm" : "");
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
  if (has("gemv_tma_narrow")) return "gemv_tma_narrow";
  if (has("gemv_tma_kernel")) return "gemv_tma";
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
    if (s[i].rfind("gemv_bulk_argmax(f32)", 0) == 0)
      role = s[i] == "gemv_bulk_argmax(f32)" ? "lm_head+argmax" : "norm+lm_head+argmax";
    else if (s[i] == "gemv_mlp")
      role = "gate_up+down";
    else if (silu(s[i]))
      role = "gate_up+silu";
    else if (next == "gdn_decode" || next == "gdn_decode_stream")
      role = "gdn_in";
    else if (next == "rope_kv" || next == "attn_split")  // attn_split: the fused rope
      role = "attn_qkv";
    else if (prev == "gdn_decode" || prev == "gdn_decode_stream")
      role = "gdn_out";
    else if (prev == "attn_merge" || prev == "attn_split")
      role = "attn_o";
    else if (next == "silu_mul")
      role = "gate_up";
    else if (prev == "silu_mul" || silu(prev))
      role = "down";
    else if (s[i] == "gemv_bulk(f32)+norm")  // $DS_HEAD_NORM: the final norm in its prologue
      role = "norm+lm_head";
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
  // The same roles split by the kind of layer they run in (a layer's kernels from its input
  // projection to the next one's: "@attn" or "@gdn"), for the roles both kinds have (the MLP and
  // the norms). Answers whether a context-dependent cost sits next to the attention layers or is
  // spread over every layer (decode_kernels.md, "Batch-1 TPOT against context").
  {
    std::map<std::string, Row> by_kind;
    std::vector<std::string> kind_order;
    for (const auto& st : steps) {
      const auto role = roles(st);
      bool attn = false;  // layer 0 is a GDN layer; its embedding and first norm count with it
      for (size_t i = 0; i < st.size(); ++i) {
        // A layer's kind: its in-projection, or its mixer kernels (with $DS_MLP_FUSED=3 the
        // in-projections after layer 0 run inside the previous layer's fused MLP kernel).
        const std::string& ro = role[i];
        if (ro.rfind("attn_qkv", 0) == 0 || ro.rfind("attn_split", 0) == 0 ||
            ro.rfind("attn_merge", 0) == 0 || ro.rfind("rope_kv", 0) == 0)
          attn = true;
        if (ro.rfind("gdn_in", 0) == 0 || ro.rfind("gdn_decode", 0) == 0) attn = false;
        const bool shared = ro.rfind("gate_up", 0) == 0 || ro.rfind("down", 0) == 0 ||
                            ro.rfind("add_rmsnorm", 0) == 0 || ro.rfind("silu_mul", 0) == 0;
        if (!shared || i == 0) continue;
        const std::string key = role[i] + (attn ? " @attn" : " @gdn");
        if (!by_kind.count(key)) kind_order.push_back(key);
        Row& r = by_kind[key];
        r.n++;
        r.dur += (st[i].end - st[i].start) * 1e-3;
        r.gap += (double(st[i].start) - double(st[i - 1].end)) * 1e-3;
        r.adv += (double(st[i].end) - double(st[i - 1].end)) * 1e-3;
      }
    }
    std::sort(kind_order.begin(), kind_order.end());
    std::printf("PROFILE %s by layer kind:\n", title.c_str());
    for (const auto& k : kind_order) {
      const Row& r = by_kind[k];
      std::printf("PROFILE   %-38s %5.0f %9.2f %9.2f %9.2f %10.3f %10.3f\n", k.c_str(), r.n / ns,
                  r.dur / r.n, r.gap / r.n, r.adv / r.n, r.dur / ns * 1e-3, r.adv / ns * 1e-3);
    }
  }
  if (print_layers) {
    const auto& st = steps.back();
    const auto role = roles(st);
    std::printf(
        "PROFILE %s, one step, first 40 kernels (past the first attention layer): start us (from the step's first), "
        "duration, gap before, grid x block, shared memory, registers\n",
        title.c_str());
    for (size_t i = 0; i < std::min<size_t>(40, st.size()); ++i)
      std::printf("PROFILE   %3zu %-30s %9.2f %8.2f %8.2f  %4d x %4d %7d B %4d\n", i,
                  role[i].c_str(), (st[i].start - st[0].start) * 1e-3,
                  (st[i].end - st[i].start) * 1e-3,
                  i ? (double(st[i].start) - double(st[i - 1].end)) * 1e-3 : 0.0, st[i].grid,
                  st[i].block, st[i].smem, st[i].regs);
  }
  return span / ns;
}

// The synthetic engine of both tests: `slots` slots (4 unless asked), each holding a random prompt
// of `prompt_len` tokens (4096 unless asked; fed in 4096-token chunks) drawn from rng, which the
// caller goes on using for the decode tokens.
std::unique_ptr<Backend> engine_with_4k_prompts(const ModelConfig& c, int64_t max_kv_tokens,
                                                std::mt19937& rng, int slots = 4,
                                                int prompt_len = 4096) {
  BackendOptions o;
  o.device = "cuda";
  o.n_slots = slots;
  o.chunk_size = 4096;
  CudaEngineOptions e;
  e.verbose = false;
  e.max_kv_tokens = max_kv_tokens;
  auto b = make_cuda_backend_synthetic(o, c, 1, e);
  std::vector<float> logits;
  for (int s = 0; s < slots; ++s) {
    for (int at = 0; at < prompt_len; at += 4096) {
      std::vector<int32_t> p(std::min(4096, prompt_len - at));
      for (auto& x : p) x = int32_t(rng() % c.vocab_size);
      SeqWork w{s, p, false};
      b->step(std::span<const SeqWork>(&w, 1), logits);
    }
  }
  return b;
}

TEST(DecodeProfile, Synthetic27bInGraph) {
  DS_REQUIRE_GPU();
  const char* env = std::getenv("DS_PROFILE");
  if (!env || std::string(env) != "1") GTEST_SKIP() << "set DS_PROFILE=1 to profile the 27B step";
  test::CuptiLib cupti(buffer_completed);
  if (!cupti.ok) std::printf("  CUPTI not available (%s): step times only\n", cupti.why.c_str());
  // $DS_PROFILE_BATCHES: the batch sizes, comma-separated, 1..32 (default 1,2,4); batches above 4
  // run the default step only (the fused norms take at most 4 rows, so on / off are one graph).
  std::vector<int> batches = {1, 2, 4};
  if (const char* bl = std::getenv("DS_PROFILE_BATCHES"); bl && *bl) {
    batches.clear();
    std::string v = bl;
    for (size_t at = 0; at <= v.size();) {
      const size_t end = std::min(v.find(',', at), v.size());
      const int x = std::atoi(v.substr(at, end - at).c_str());
      ASSERT_TRUE(x >= 1 && x <= 32) << "DS_PROFILE_BATCHES: batch sizes 1..32, got '" << v << "'";
      batches.push_back(x);
      at = end + 1;
    }
  }
  const int max_batch = std::max(4, *std::max_element(batches.begin(), batches.end()));
  // $DS_PROFILE_CONTEXT: the prompt length before the profiled steps (default 4096).
  int ctx = 4096;
  if (const char* cv = std::getenv("DS_PROFILE_CONTEXT"); cv && *cv) {
    ctx = std::atoi(cv);
    ASSERT_TRUE(ctx >= 64 && ctx <= 131072) << "DS_PROFILE_CONTEXT: 64..131072, got '" << cv << "'";
  }
  const ModelConfig c = synthetic_model_config("27b");
  std::mt19937 rng(5);
  auto b = engine_with_4k_prompts(c, int64_t(max_batch) * (ctx + 504), rng, max_batch, ctx);
  const int V = c.vocab_size;
  std::vector<float> logits;
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
  for (int batch : batches) {
    for (bool fused : {false, true}) {
      if (batch > 4 && !fused) continue;  // one graph either way: run it once
      set_cuda_fused_norm(*b, fused ? 4 : 0);  // on: at every batch size the kernels support
      const std::string title =
          "batch " + std::to_string(batch) + " ctx " + std::to_string(ctx) +
          (batch > 4 ? std::string() : std::string(", fused_norm ") + (fused ? "on" : "off"));
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
            const bool first =
                short_name(all[i]) == "gather_rows" &&
                (i == 0 || short_name(all[i - 1]).find("argmax") != std::string::npos);
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
      report(title + " [" + how + "]", steps, batch == 1 || batch >= 8);
    }
  }
  set_cuda_fused_norm(*b, default_rows);
  EXPECT_EQ(cuda_graph_stats(*b).failures, 0);
}

// The median of v (v is sorted in place).
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// From a CUPTI timeline of consecutive decode steps: per boundary (the argmax kernel ending step t
// to the next embedding gather starting step t+1) the idle time and its parts. Host-side marks
// come from the runtime API records on the same clock.
void report_gaps(const std::string& title, std::vector<TimelineRec> tl) {
  std::sort(tl.begin(), tl.end(), [](const auto& a, const auto& b) { return a.start < b.start; });
  std::vector<const TimelineRec*> argmax_end, gather_start;
  for (const auto& r : tl) {
    if (r.kind != TimelineRec::kKernel) continue;
    if (r.name.find("argmax") != std::string::npos) argmax_end.push_back(&r);
    if (r.name.find("gather_rows") != std::string::npos) gather_start.push_back(&r);
  }
  struct Acc {
    std::vector<double> gap, d2h_wait, d2h, wake, host, h2d_issue, h2d, feed, launch_call, to_first;
  } a;
  auto us = [](uint64_t x, uint64_t y) { return (double(y) - double(x)) * 1e-3; };
  for (const TimelineRec* am : argmax_end) {
    // The next step's first kernel: the embedding gather (the lm-rows gather precedes argmax).
    const TimelineRec* first = nullptr;
    for (const TimelineRec* g : gather_start)
      if (g->start >= am->end) {
        first = g;
        break;
      }
    if (!first) continue;
    // Only the embedding gather of the next step: no other argmax in between.
    bool clean = true;
    for (const TimelineRec* o : argmax_end)
      clean &= !(o != am && o->end > am->end && o->end < first->start);
    if (!clean) continue;
    a.gap.push_back(us(am->end, first->start));
    const TimelineRec *d2h = nullptr, *h2d = nullptr, *sync_api = nullptr, *h2d_api = nullptr,
                      *launch_api = nullptr, *feed = nullptr;
    for (const auto& r : tl) {
      if (r.kind == TimelineRec::kD2H && !d2h && r.start >= am->end) d2h = &r;
      if (r.kind == TimelineRec::kH2D && r.start >= am->end && r.end <= first->start) h2d = &r;
      if (r.kind == TimelineRec::kKernel && r.name.find("feed_tokens") != std::string::npos &&
          r.start >= am->end && r.end <= first->start)
        feed = &r;
    }
    if (d2h) {
      a.d2h_wait.push_back(us(am->end, d2h->start));
      a.d2h.push_back(us(d2h->start, d2h->end));
      for (const auto& r : tl)  // the sync / event wait that returned after the copy
        if (r.kind == TimelineRec::kApi && r.end >= d2h->end && !sync_api &&
            (r.cbid == CUPTI_RUNTIME_TRACE_CBID_cudaStreamSynchronize_v3020 ||
             r.cbid == CUPTI_RUNTIME_TRACE_CBID_cudaEventSynchronize_v3020))
          sync_api = &r;
      if (sync_api) a.wake.push_back(us(d2h->end, sync_api->end));
    }
    if (h2d) {
      for (const auto& r : tl)
        if (r.kind == TimelineRec::kApi && r.correlation == h2d->correlation) h2d_api = &r;
      a.h2d.push_back(us(h2d->start, h2d->end));
      if (h2d_api) a.h2d_issue.push_back(us(h2d_api->start, h2d->start));
      if (h2d_api && sync_api && h2d_api->start > sync_api->end)
        a.host.push_back(us(sync_api->end, h2d_api->start));
    }
    if (feed) a.feed.push_back(us(feed->start, feed->end));
    for (const auto& r : tl)
      if (r.kind == TimelineRec::kApi && r.correlation == first->correlation) launch_api = &r;
    if (launch_api) {
      a.launch_call.push_back(us(launch_api->start, launch_api->end));
      a.to_first.push_back(us(launch_api->end, first->start));
    }
  }
  auto m = [&](const std::vector<double>& v) { return v.empty() ? -1.0 : median(v); };
  std::printf(
      "HOSTGAP %s timeline (%zu step boundaries, medians, us; -1: not seen): idle GPU from the "
      "last kernel of step t to the first of t+1 %.1f = argmax end -> token D2H start %.1f, D2H "
      "%.1f; host: D2H end -> sync returns %.1f, sync return -> next metadata H2D issued %.1f; "
      "H2D issue -> start %.1f, H2D %.1f, feed kernel %.1f; cudaGraphLaunch call %.1f, its return "
      "-> first kernel %.1f\n",
      title.c_str(), a.gap.size(), m(a.gap), m(a.d2h_wait), m(a.d2h), m(a.wake), m(a.host),
      m(a.h2d_issue), m(a.h2d), m(a.feed), m(a.launch_call), m(a.to_first));
}

TEST(DecodeProfile, HostGap) {
  DS_REQUIRE_GPU();
  const char* env = std::getenv("DS_PROFILE");
  if (!env || std::string(env) != "1") GTEST_SKIP() << "set DS_PROFILE=1 to profile the 27B step";
  test::CuptiLib cupti(buffer_completed);
  if (!cupti.ok) std::printf("  CUPTI not available (%s): no timeline\n", cupti.why.c_str());
  const ModelConfig c = synthetic_model_config("27b");
  std::mt19937 rng(5);
  auto b = engine_with_4k_prompts(c, 4 * 4800, rng);
  const int V = c.vocab_size;
  std::vector<float> logits;
  StepOutput out;
  for (int batch : {1, 4}) {
    const std::string title = "batch " + std::to_string(batch) + " ctx 4K";
    std::vector<std::vector<int32_t>> toks(batch, std::vector<int32_t>(1));
    std::vector<SeqWork> work(batch);
    auto sync_steps = [&](int n, std::vector<double>* ms, std::vector<CudaStepTiming>* tm) {
      for (int st = 0; st < n; ++st) {
        for (int s = 0; s < batch; ++s) {
          toks[s][0] = int32_t(rng() % V);
          work[s] = {s, toks[s], false, true};
        }
        const auto t0 = std::chrono::steady_clock::now();
        b->step_greedy(work, out);
        const auto t1 = std::chrono::steady_clock::now();
        if (ms) ms->push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        if (tm) tm->push_back(cuda_last_step_timing(*b));
      }
    };
    std::vector<DecodeItem> items(batch);
    std::vector<int32_t> got;
    auto pipe_steps = [&](int n, std::vector<double>* ms, std::vector<CudaStepTiming>* tm) {
      for (int s = 0; s < batch; ++s) items[s] = {s, int32_t(rng() % V), -1};
      b->launch_greedy_decode(items);
      for (int s = 0; s < batch; ++s) items[s].feed_row = s;
      auto prev = std::chrono::steady_clock::now();
      for (int st = 0; st <= n; ++st) {
        if (st < n) b->launch_greedy_decode(items);
        b->collect_greedy_decode(got);
        const auto now = std::chrono::steady_clock::now();
        if (ms && st > 0)
          ms->push_back(std::chrono::duration<double, std::milli>(now - prev).count());
        if (tm && st < n) tm->push_back(cuda_last_step_timing(*b));
        prev = now;
      }
    };
    sync_steps(6, nullptr, nullptr);  // eager warm-up, capture, replays
    pipe_steps(4, nullptr, nullptr);
    // (a) + (c), interleaved twice.
    std::vector<double> sync_ms, pipe_ms;
    std::vector<CudaStepTiming> sync_t, pipe_t;
    for (int round = 0; round < 2; ++round) {
      sync_steps(30, &sync_ms, &sync_t);
      pipe_steps(30, &pipe_ms, &pipe_t);
    }
    auto field = [](const std::vector<CudaStepTiming>& v, double CudaStepTiming::*f) {
      std::vector<double> x;
      for (const auto& t : v) x.push_back(t.*f);
      return median(x);
    };
    const bool graphed =
        std::all_of(sync_t.begin(), sync_t.end(), [](auto& t) { return t.graphed; });
    EXPECT_TRUE(graphed) << title << ": some timed steps ran eagerly";
    // (b) the graph alone, back to back.
    sync_steps(1, nullptr, nullptr);
    std::vector<double> dev;
    for (int r = 0; r < 3; ++r) dev.push_back(cuda_replay_last_graph(*b, 20));
    const double dev_ms = median(dev), sync_p50 = median(sync_ms), pipe_p50 = median(pipe_ms);
    std::printf(
        "HOSTGAP %s: sync step_greedy p50 %.3f ms | graph replayed back to back %.3f ms | "
        "pipelined interval p50 %.3f ms | outside the graph: sync %.3f ms, pipelined %.3f ms\n",
        title.c_str(), sync_p50, dev_ms, pipe_p50, sync_p50 - dev_ms, pipe_p50 - dev_ms);
    std::printf(
        "HOSTGAP %s sync host split (medians, us): validate %.1f, metadata %.1f, H2D copy + plan "
        "%.1f, graph launch call %.1f, wait in the sync %.1f, after %.1f; host busy %.1f of %.1f\n",
        title.c_str(), field(sync_t, &CudaStepTiming::validate_us),
        field(sync_t, &CudaStepTiming::meta_us), field(sync_t, &CudaStepTiming::copy_plan_us),
        field(sync_t, &CudaStepTiming::launch_us), field(sync_t, &CudaStepTiming::sync_us),
        field(sync_t, &CudaStepTiming::tail_us),
        field(sync_t, &CudaStepTiming::validate_us) + field(sync_t, &CudaStepTiming::meta_us) +
            field(sync_t, &CudaStepTiming::copy_plan_us) +
            field(sync_t, &CudaStepTiming::launch_us) + field(sync_t, &CudaStepTiming::tail_us),
        sync_p50 * 1e3);
    std::printf(
        "HOSTGAP %s pipelined launch split (medians, us): validate %.1f, metadata %.1f, H2D + feed "
        "+ plan %.1f, graph launch call %.1f, after %.1f; collect wait %.1f\n",
        title.c_str(), field(pipe_t, &CudaStepTiming::validate_us),
        field(pipe_t, &CudaStepTiming::meta_us), field(pipe_t, &CudaStepTiming::copy_plan_us),
        field(pipe_t, &CudaStepTiming::launch_us), field(pipe_t, &CudaStepTiming::tail_us),
        field(pipe_t, &CudaStepTiming::collect_wait_us));
    if (!cupti.ok) continue;
    // (d) the timeline of 8 steps of each loop.
    for (bool pipelined : {false, true}) {
      {
        const std::lock_guard<std::mutex> lock(g_mu);
        g_timeline.clear();
        g_keep_timeline = true;
      }
      EXPECT_EQ(cupti.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), CUPTI_SUCCESS);
      EXPECT_EQ(cupti.enable(CUPTI_ACTIVITY_KIND_MEMCPY), CUPTI_SUCCESS);
      EXPECT_EQ(cupti.enable(CUPTI_ACTIVITY_KIND_RUNTIME), CUPTI_SUCCESS);
      set_cuda_graphs(*b, false);  // re-captured under tracing (see Synthetic27bInGraph)
      set_cuda_graphs(*b, true);
      std::vector<double> traced;
      if (pipelined) {
        sync_steps(2, nullptr, nullptr);
        pipe_steps(10, &traced, nullptr);
      } else {
        sync_steps(12, &traced, nullptr);
      }
      cudaDeviceSynchronize();
      cupti.flush_all(1);
      cupti.disable(CUPTI_ACTIVITY_KIND_RUNTIME);
      cupti.disable(CUPTI_ACTIVITY_KIND_MEMCPY);
      cupti.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
      std::vector<TimelineRec> tl;
      {
        const std::lock_guard<std::mutex> lock(g_mu);
        g_keep_timeline = false;
        tl.swap(g_timeline);
      }
      // Drop the steps before the graph runs (eager warm-up / capture): keep from the 4th argmax.
      std::sort(tl.begin(), tl.end(),
                [](const auto& x, const auto& y) { return x.start < y.start; });
      int n_argmax = 0;
      uint64_t cut = 0;
      for (const auto& r : tl)
        if (r.kind == TimelineRec::kKernel && r.name.find("argmax") != std::string::npos &&
            ++n_argmax == 4)
          cut = r.start;
      std::vector<TimelineRec> kept;
      for (const auto& r : tl)
        if (r.start >= cut) kept.push_back(r);
      std::printf("HOSTGAP %s %s: traced interval p50 %.3f ms, %zu records\n", title.c_str(),
                  pipelined ? "pipelined" : "sync", median(traced), kept.size());
      report_gaps(title + (pipelined ? " pipelined" : " sync"), kept);
    }
  }
  EXPECT_EQ(cuda_graph_stats(*b).failures, 0);
}

}  // namespace
}  // namespace ds
