// The 27B prefill chunk as it runs in the engine (issue 7): where the time of a 4096-token chunk
// goes beyond the sum of its kernels timed alone. The forward of a prompt chunk runs eagerly
// (~700 launches), so CUPTI records every kernel's device start / end, every runtime / driver API
// call on the host (launches, copies, synchronisations) and the host clock around step() on one
// timeline. Printed per kernel role (gdn_in, gdn_prefill kernels, gate_up, add_rmsnorm, ...):
// launches per chunk, in-situ time, the gaps before its kernels (sum, largest, and the part the
// GPU spent waiting for the host: the launch call returned after the previous kernel ended), the
// per-class sums next to the isolated times of docs/perf/RESULTS.md (b3a8664), and the chunk's
// host-timed step split into host work before the first kernel, the kernel span and the tail
// (logits copy + synchronisation); then the API calls made during a chunk (count, host time).
// Cases: a fresh 4096-token chunk and a second chunk after 4096 cached tokens, synthetic
// Qwen3.5-27B weights on the device, each under three paths in the same process:
//   session4 = $DS_NORM_FIT=0 + fold off (the path RESULTS.md measured),
//   fit      = the norm build sized to d (bit-identical outputs: asserted),
//   fit+mixer / fit+all = plus the residual add folded into the mixer out-projections / those and
//              the MLP down projection (CudaEngineOptions::prefill_residual_fold; logits compared
//              with session4: max abs / relative L2 printed, L2 < 3e-2 asserted).
// Untraced host-timed medians come first, then the traced chunks (CUPTI adds ~1-2 us per API
// call, printed beside). CUPTI (libcupti.so.13) is loaded at run time ($DS_CUPTI_LIB, else the
// loader's search path), as in cuda_decode_profile_test; without it only the host times print.
// Then the same kernels alone in the same process (ALONE lines: each GEMM shape of the chunk with
// the engine's algorithm, add_rmsnorm both builds, silu_mul), to tell "slower in situ" from
// "another machine state than RESULTS.md's run". Off by default (heavy): DS_PROFILE=1 runs it.
// PHASE lines carry the wall clock (UTC seconds) so that an nvidia-smi log of the same run (SM
// clock, power) can be lined up with the chunks.
#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "cuda_test_util.h"
#include "cupti_loader.h"

namespace ds {
namespace {

struct KernelRec {
  uint64_t start = 0, end = 0;
  uint32_t correlation = 0;
  int grid = 0, block = 0, regs = 0;
  std::string name;  // demangled
};
struct ApiRec {
  uint64_t start = 0, end = 0;
  uint32_t correlation = 0, cbid = 0;
  bool runtime = true;  // else driver
};
struct CopyRec {
  uint64_t start = 0, end = 0, bytes = 0;
  int kind = 0;  // CUpti_ActivityMemcpyKind
};

std::mutex g_mu;
std::vector<KernelRec> g_kernels;
std::vector<ApiRec> g_api;
std::vector<CopyRec> g_copies;

using test::demangle;

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buf, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::vector<KernelRec> ks;
  std::vector<ApiRec> as;
  std::vector<CopyRec> cs;
  while (test::cupti_next_record &&
         test::cupti_next_record(buf, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ||
        rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      KernelRec r;
      r.start = k->start;
      r.end = k->end;
      r.correlation = k->correlationId;
      r.grid = k->gridX * k->gridY * k->gridZ;
      r.block = k->blockX * k->blockY * k->blockZ;
      r.regs = k->registersPerThread;
      r.name = demangle(k->name);
      ks.push_back(std::move(r));
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME ||
               rec->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
      as.push_back({a->start, a->end, a->correlationId, a->cbid,
                    rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      cs.push_back({m->start, m->end, m->bytes, int(m->copyKind)});
    }
  }
  std::free(buf);
  const std::lock_guard<std::mutex> lock(g_mu);
  g_kernels.insert(g_kernels.end(), ks.begin(), ks.end());
  g_api.insert(g_api.end(), as.begin(), as.end());
  g_copies.insert(g_copies.end(), cs.begin(), cs.end());
}

// The kernel family of a record; "" for a cuBLASLt GEMM kernel (named by its neighbours).
std::string family(const KernelRec& r) {
  const std::string& n = r.name;
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (has("add_rmsnorm")) return "rmsnorm";
  if (has("silu_mul")) return "silu_mul";
  if (has("rope_kv")) return "rope_kv";
  if (has("attention_prefill") || has("attention_decode")) return "attn_prefill";
  if (has("gdn_")) return "gdn_prefill";
  if (has("gather_rows")) return "gather";
  if (has("argmax")) return "argmax";
  if (has("gemv") || has("skinny")) return "gemv";
  return "";
}

// A short kernel name: the function name without namespaces and template arguments.
std::string short_kernel(std::string n) {
  for (size_t a; (a = n.find("(anonymous namespace)::")) != std::string::npos;) n.erase(a, 23);
  std::string s = n.substr(0, n.find('('));
  const size_t t = s.find('<');
  if (t != std::string::npos) s = s.substr(0, t);
  const size_t c = s.rfind("::");
  if (c != std::string::npos) s = s.substr(c + 2);
  return s.size() > 28 ? s.substr(0, 28) : s;
}

// Role of each kernel of one chunk (sorted by start): "class: detail". Classes match RESULTS.md's
// profile rows: gemm.<projection>, gdn_prefill, attn_prefill, rmsnorm, silu_mul, rope_kv,
// gather.embedding / gather.lm_rows, argmax. A GEMM (any kernel of no known family) is named by
// the families around it; cuBLASLt kernels of one GEMM (e.g. a split-K reduction) share a role.
std::vector<std::string> roles(const std::vector<KernelRec>& ks) {
  const size_t n = ks.size();
  std::vector<std::string> fam(n), r(n);
  for (size_t i = 0; i < n; ++i) fam[i] = family(ks[i]);
  auto prev_known = [&](size_t i) {
    while (i-- > 0)
      if (!fam[i].empty()) return fam[i];
    return std::string();
  };
  auto next_known = [&](size_t i) {
    while (++i < n)
      if (!fam[i].empty()) return fam[i];
    return std::string();
  };
  for (size_t i = 0; i < n; ++i) {
    const std::string p = prev_known(i), x = next_known(i);
    if (!fam[i].empty()) {
      std::string detail;
      if (fam[i] == "gather") {
        r[i] = p.empty() ? "gather.embedding" : "gather.lm_rows";
        continue;
      }
      if (fam[i] == "gdn_prefill" || fam[i] == "attn_prefill")
        detail = short_kernel(ks[i].name);
      r[i] = fam[i] + (detail.empty() ? "" : ": " + detail);
      continue;
    }
    std::string role = "?";
    if (x == "gdn_prefill")
      role = "gdn_in";
    else if (x == "rope_kv")
      role = "attn_qkv";
    else if (x == "silu_mul")
      role = "gate_up";
    else if (p == "silu_mul")
      role = "down";
    else if (p == "gdn_prefill")
      role = "gdn_out";
    else if (p == "attn_prefill")
      role = "attn_o";
    else if (p == "gather")
      role = "lm_head";
    r[i] = "gemm." + role + ": " + short_kernel(ks[i].name);
  }
  // Norms by what follows: input (before gdn_in / attn_qkv), post (before gate_up), final.
  for (size_t i = 0; i < n; ++i) {
    if (fam[i] != "rmsnorm") continue;
    std::string after = "final";
    for (size_t j = i + 1; j < n; ++j) {
      if (r[j].rfind("gemm.gate_up", 0) == 0) {
        after = "post";
        break;
      }
      if (r[j].rfind("gemm.gdn_in", 0) == 0 || r[j].rfind("gemm.attn_qkv", 0) == 0) {
        after = "input";
        break;
      }
      if (fam[j] == "gather") break;
    }
    r[i] = "rmsnorm: " + after;
  }
  return r;
}

std::string class_of(const std::string& role) { return role.substr(0, role.find(':')); }

// Isolated kernel times of a fresh 4096-token chunk, ms per chunk (docs/perf/RESULTS.md, b3a8664:
// bench kernels at the forward's shapes, each kernel alone in a CUDA graph).
const std::map<std::string, double> kIsolatedFresh4096 = {
    {"gemm.gate_up", 133.106},  {"gemm.down", 67.852},     {"gemm.gdn_in", 41.409},
    {"gdn_prefill", 20.919},    {"gemm.gdn_out", 17.752},  {"gemm.attn_qkv", 13.265},
    {"rmsnorm", 7.867},         {"attn_prefill", 7.417},   {"silu_mul", 6.875},
    {"gemm.attn_o", 5.929},     {"rope_kv", 1.796},        {"gemm.lm_head", 0.568},
    {"gather.embedding", 0.023}, {"gather.lm_rows", 0.002}};

// One traced chunk: its kernels (sorted), the API calls and copies inside the host window.
struct Chunk {
  uint64_t t_call = 0, t_return = 0;  // CUPTI clock around step()
  std::vector<KernelRec> kernels;
  std::vector<ApiRec> api;
  std::vector<CopyRec> copies;
};

// dur: the kernel's own start..end; adv (advance): how far it moved the chunk's end, i.e. its end
// minus the latest end of the kernels before it (0 when it ran entirely beside one). Kernels under
// programmatic dependent launch overlap (the GDN output kernel beside the state pass; add_rmsnorm
// resident before the GEMM ends), so durations double-count and advances sum to the span.
struct RoleRow {
  int n = 0;
  double dur = 0, adv = 0, gap = 0, host_gap = 0, max_gap = 0, min_dur = 1e30, max_dur = 0;
};

void report(const std::string& title, const std::vector<Chunk>& chunks,
            const test::CuptiLib& cupti, double untraced_ms, bool fresh) {
  std::map<std::string, RoleRow> rows;
  std::map<std::string, double> cls, cls_adv;  // class -> in-situ ms per chunk (dur, advance)
  std::vector<double> pre_ms;
  double span = 0, busy = 0, gaps = 0, host_gaps = 0, host_ms = 0, pre = 0, post = 0;
  double max_gap = 0;
  std::string max_gap_at;
  std::map<std::string, std::pair<int, double>> api_calls;  // name -> (count, host us)
  const double nc = double(chunks.size());
  for (const Chunk& c : chunks) {
    const auto& ks = c.kernels;
    const auto role = roles(ks);
    // The launch call of each kernel, by correlation id (runtime or driver record).
    std::map<uint32_t, uint64_t> launch_end;
    for (const ApiRec& a : c.api) {
      auto it = launch_end.find(a.correlation);
      if (it == launch_end.end() || a.end > it->second) launch_end[a.correlation] = a.end;
      auto& e = api_calls[cupti.api_name(a.runtime, a.cbid)];
      e.first++;
      e.second += (a.end - a.start) * 1e-3;
    }
    span += (ks.back().end - ks.front().start) * 1e-6;
    host_ms += (c.t_return - c.t_call) * 1e-6;
    pre += (double(ks.front().start) - double(c.t_call)) * 1e-6;
    pre_ms.push_back((double(ks.front().start) - double(c.t_call)) * 1e-6);
    uint64_t last_end = ks.front().start;
    post += (double(c.t_return) - double(ks.back().end)) * 1e-6;
    for (size_t i = 0; i < ks.size(); ++i) {
      RoleRow& r = rows[role[i]];
      const double dur = (ks[i].end - ks[i].start) * 1e-3;
      r.n++;
      r.dur += dur;
      r.min_dur = std::min(r.min_dur, dur);
      r.max_dur = std::max(r.max_dur, dur);
      busy += dur * 1e-3;
      cls[class_of(role[i])] += dur * 1e-3 / nc;
      const double adv = std::max(0.0, (double(ks[i].end) - double(last_end)) * 1e-3);
      last_end = std::max(last_end, ks[i].end);
      r.adv += adv;
      cls_adv[class_of(role[i])] += adv * 1e-3 / nc;
      if (i == 0) continue;
      const double gap = (double(ks[i].start) - double(ks[i - 1].end)) * 1e-3;
      double host = 0;
      auto it = launch_end.find(ks[i].correlation);
      if (it != launch_end.end() && gap > 0)
        host = std::clamp((double(it->second) - double(ks[i - 1].end)) * 1e-3, 0.0, gap);
      r.gap += gap;
      r.host_gap += host;
      r.max_gap = std::max(r.max_gap, gap);
      gaps += gap * 1e-3;
      host_gaps += host * 1e-3;
      if (gap > max_gap) {
        max_gap = gap;
        max_gap_at = role[i] + " (kernel " + std::to_string(i) + ")";
      }
    }
  }
  std::printf(
      "PROFILE %s: %zu kernels per chunk; host-timed step (traced) %.3f ms, untraced %.3f ms = "
      "host before the first kernel %.3f + kernel span %.3f + tail %.3f (last kernel end to "
      "step() return); in the span: kernels %.3f, gaps %.3f (of which the GPU waited for the "
      "host %.3f), largest gap %.1f us before %s; mean of %zu chunks\n",
      title.c_str(), chunks.front().kernels.size(), host_ms / nc, untraced_ms, pre / nc,
      span / nc, post / nc, busy / nc, gaps / nc, host_gaps / nc, max_gap, max_gap_at.c_str(),
      chunks.size());
  std::printf("PROFILE %s: host before the first kernel, per chunk (ms):", title.c_str());
  for (double x : pre_ms) std::printf(" %.3f", x);
  std::printf("\n");
  std::printf("PROFILE %-44s %5s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n", "role: kernel", "n",
              "dur us", "min dur", "max dur", "adv us", "gap us", "hostgap", "max gap", "dur ms",
              "adv ms");
  std::vector<std::string> order;
  for (const auto& [k, v] : rows) order.push_back(k);
  std::sort(order.begin(), order.end(),
            [&](const auto& a, const auto& b) { return rows[a].dur > rows[b].dur; });
  for (const auto& k : order) {
    const RoleRow& r = rows[k];
    std::printf("PROFILE %-44s %5.0f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.3f %9.3f\n",
                k.c_str(), r.n / nc, r.dur / r.n, r.min_dur, r.max_dur, r.adv / r.n, r.gap / r.n,
                r.host_gap / r.n, r.max_gap, r.dur / nc * 1e-3, r.adv / nc * 1e-3);
  }
  std::printf("PROFILE %s: per class, in situ vs alone (RESULTS.md b3a8664, fresh 4096 chunk)\n",
              title.c_str());
  std::vector<std::pair<double, std::string>> by_ms;
  double sum_situ = 0, sum_adv = 0, sum_alone = 0;
  for (const auto& [k, v] : cls) by_ms.push_back({v, k});
  std::sort(by_ms.rbegin(), by_ms.rend());
  for (const auto& [ms, k] : by_ms) {
    sum_situ += ms;
    sum_adv += cls_adv[k];
    auto it = kIsolatedFresh4096.find(k);
    if (fresh && it != kIsolatedFresh4096.end()) {
      sum_alone += it->second;
      std::printf(
          "CLASS %-18s in situ %9.3f ms, advance %9.3f ms  alone %9.3f ms  advance - alone "
          "%+8.3f ms (%+.1f%%)\n",
          k.c_str(), ms, cls_adv[k], it->second, cls_adv[k] - it->second,
          (cls_adv[k] / it->second - 1) * 100);
    } else {
      std::printf("CLASS %-18s in situ %9.3f ms, advance %9.3f ms\n", k.c_str(), ms, cls_adv[k]);
    }
  }
  if (fresh)
    std::printf(
        "CLASS %-18s in situ %9.3f ms, advance %9.3f ms  alone %9.3f ms  advance - alone %+8.3f "
        "ms\n",
        "SUM", sum_situ, sum_adv, sum_alone, sum_adv - sum_alone);
  else
    std::printf("CLASS %-18s in situ %9.3f ms, advance %9.3f ms\n", "SUM", sum_situ, sum_adv);
  std::printf("API %s: calls per chunk on the host (count, host us per chunk)\n", title.c_str());
  std::vector<std::pair<double, std::string>> api_order;
  for (const auto& [k, v] : api_calls) api_order.push_back({v.second, k});
  std::sort(api_order.rbegin(), api_order.rend());
  for (const auto& [us, k] : api_order)
    std::printf("API   %-40s %7.1f %10.1f\n", k.c_str(), api_calls[k].first / nc, us / nc);
  std::map<int, std::pair<int, double>> copies;  // kind -> (count, bytes)
  for (const Chunk& c : chunks)
    for (const CopyRec& m : c.copies) {
      copies[m.kind].first++;
      copies[m.kind].second += double(m.bytes);
    }
  for (const auto& [k, v] : copies)
    std::printf("COPY  kind %d (1 HtoD, 2 DtoH, 8 DtoD, 10 PtoP): %.1f per chunk, %.0f bytes\n", k,
                v.first / nc, v.second / nc);
  // The last chunk's first two layers kernel by kernel, then its largest gaps.
  const Chunk& last = chunks.back();
  const auto role = roles(last.kernels);
  std::printf("LAYERS %s, last chunk, first 20 kernels: start us, dur, gap before, grid x block, "
              "registers\n", title.c_str());
  for (size_t i = 0; i < std::min<size_t>(20, last.kernels.size()); ++i) {
    const KernelRec& k = last.kernels[i];
    std::printf("LAYERS %3zu %-44s %9.1f %8.2f %8.2f %6d x %4d %4d\n", i, role[i].c_str(),
                (k.start - last.kernels[0].start) * 1e-3, (k.end - k.start) * 1e-3,
                i ? (double(k.start) - double(last.kernels[i - 1].end)) * 1e-3 : 0.0, k.grid,
                k.block, k.regs);
  }
  std::vector<std::pair<double, size_t>> g;
  for (size_t i = 1; i < last.kernels.size(); ++i)
    g.push_back({(double(last.kernels[i].start) - double(last.kernels[i - 1].end)) * 1e-3, i});
  std::sort(g.rbegin(), g.rend());
  std::printf("GAPS %s, last chunk, largest 8: gap us before kernel (index, role, grid x block)\n",
              title.c_str());
  for (size_t j = 0; j < std::min<size_t>(8, g.size()); ++j) {
    const size_t i = g[j].second;
    std::printf("GAPS  %8.2f us before %4zu %-44s %6d x %4d (after %s)\n", g[j].first, i,
                role[i].c_str(), last.kernels[i].grid, last.kernels[i].block,
                role[i - 1].c_str());
  }
}

// The prompt chunk's kernels alone, in this process right after the traced chunks (same GPU, same
// clocks regime, the engine's tuned GEMM algorithms from the process cache): each GEMM shape of
// the 4096-token chunk (the out-projections also with the residual folded in, beta = 1),
// add_rmsnorm (both builds, with and without delta) and silu_mul, 12 calls back to back timed by
// CUDA events after 3 warm-up calls; us per call and ms per chunk (x launches per chunk).
void time_alone(const ModelConfig& c, int T) {
  cudaStream_t st;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  DS_CUDA_CHECK(cudaEventCreate(&e0));
  DS_CUDA_CHECK(cudaEventCreate(&e1));
  const int dm = c.d_model;
  const int64_t max_k = std::max<int64_t>({dm, c.d_ff, c.gdn_z_dim(), c.attn_out_dim()});
  const int64_t max_n = std::max<int64_t>({2 * int64_t(c.d_ff), c.gdn_in_dim(),
                                           int64_t(c.q_proj_dim() + 2 * c.kv_dim()), dm});
  test::DevBuf<uint16_t> x(size_t(T) * max_k), w(size_t(max_n) * max_k), y(size_t(T) * max_n),
      h(size_t(T) * dm);
  auto fill = [&](test::DevBuf<uint16_t>& b, uint64_t seed, float sd) {
    cuda::launch_fill_synthetic_normal_bf16(b.as<__nv_bfloat16>(), int64_t(b.n), seed, 0.f, sd,
                                            st);
  };
  fill(x, 11, 1.f);
  fill(w, 12, 0.02f);
  fill(y, 13, 1.f);
  fill(h, 14, 1.f);
  auto timed = [&](const auto& body) {
    for (int i = 0; i < 3; ++i) body();
    DS_CUDA_CHECK(cudaEventRecord(e0, st));
    constexpr int kCalls = 12;
    for (int i = 0; i < kCalls; ++i) body();
    DS_CUDA_CHECK(cudaEventRecord(e1, st));
    DS_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    DS_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return double(ms) * 1e3 / kCalls;
  };
  cuda::GemmEngine g;
  struct G {
    const char* name;
    int n, k, per_chunk;
  };
  const int n_lin = c.n_linear_layers(), n_full = c.n_full_layers();
  const G shapes[] = {{"gemm.gdn_in", c.gdn_in_dim(), dm, n_lin},
                      {"gemm.gdn_out", dm, c.gdn_z_dim(), n_lin},
                      {"gemm.attn_qkv", c.q_proj_dim() + 2 * c.kv_dim(), dm, n_full},
                      {"gemm.attn_o", dm, c.attn_out_dim(), n_full},
                      {"gemm.gate_up", 2 * c.d_ff, dm, c.n_layers},
                      {"gemm.down", dm, c.d_ff, c.n_layers}};
  cuda::GemmTuneOptions opt;  // what the engine's prompt tuning asks: the process cache answers
  opt.max_candidates = 8;
  opt.max_weights = 1;
  opt.batches = 3;
  const __nv_bfloat16* wp = w.as<__nv_bfloat16>();
  for (const G& s : shapes) {
    for (bool acc : {false, true}) {
      if (acc && s.n != dm) continue;
      const auto r = g.tune(T, s.n, s.k, cuda::GemmOut::kBF16, {wp}, x.as<__nv_bfloat16>(),
                            y.as<__nv_bfloat16>(), st, acc, opt);
      fill(x, 11, 1.f);
      fill(y, 13, 1.f);
      const double us = timed([&] {
        g.run(x.as<__nv_bfloat16>(), wp, y.as<__nv_bfloat16>(), T, s.n, s.k,
              cuda::GemmOut::kBF16, st, acc);
      });
      const double tflops = 2.0 * T * s.n * s.k / (us * 1e-6) / 1e12;
      std::printf("ALONE %-14s %-9s m %d n %5d k %5d: %9.2f us %6.1f TFLOP/s, x %2d = %8.3f ms "
                  "per chunk (%s)\n",
                  s.name, acc ? "beta=1" : "", T, s.n, s.k, us, tflops, s.per_chunk,
                  us * s.per_chunk * 1e-3, r.cached ? "engine's algorithm" : "tuned here");
    }
  }
  const int n_norms = 2 * c.n_layers + 1;
  for (bool with_delta : {true, false})
    for (auto which : {cuda::RmsNormKernel::kMax8, cuda::RmsNormKernel::kFit}) {
      const double us = timed([&] {
        cuda::launch_add_rmsnorm(h.as<__nv_bfloat16>(),
                                 with_delta ? x.as<__nv_bfloat16>() : nullptr,
                                 w.as<__nv_bfloat16>(), T, dm, 1e-6f, 1.f,
                                 y.as<__nv_bfloat16>(), st, which);
      });
      const double gb = (with_delta ? 4.0 : 2.0) * T * dm * 2 / 1e9;
      std::printf("ALONE %-14s %-9s %d x %d %s: %9.2f us %6.0f GB/s, x %d = %8.3f ms per chunk\n",
                  "rmsnorm", which == cuda::RmsNormKernel::kFit ? "fit" : "max8", T, dm,
                  with_delta ? "with delta" : "no delta  ", us, gb / (us * 1e-6), n_norms,
                  us * n_norms * 1e-3);
    }
  const double us = timed([&] {
    cuda::launch_silu_mul(y.as<__nv_bfloat16>(), T, c.d_ff, x.as<__nv_bfloat16>(), st);
  });
  std::printf("ALONE %-14s %-9s %d x %d: %9.2f us %6.0f GB/s, x %d = %8.3f ms per chunk\n",
              "silu_mul", "", T, c.d_ff, us, 3.0 * T * c.d_ff * 2 / 1e9 / (us * 1e-6), c.n_layers,
              us * c.n_layers * 1e-3);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(st);
}

double now_unix() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

TEST(PrefillProfile, Synthetic27bChunk) {
  DS_REQUIRE_GPU();
  const char* env = std::getenv("DS_PROFILE");
  if (!env || std::string(env) != "1")
    GTEST_SKIP() << "set DS_PROFILE=1 to profile the 27B prefill chunk";
  test::CuptiLib cupti(buffer_completed);
  if (!cupti.ok) std::printf("  CUPTI not available (%s): host times only\n", cupti.why.c_str());
  const ModelConfig c = synthetic_model_config("27b");
  BackendOptions o;
  o.device = "cuda";
  o.n_slots = 1;
  o.chunk_size = 4096;
  o.max_seq_len = 8192;
  CudaEngineOptions e;
  e.verbose = false;
  e.max_kv_tokens = 8192;
  const char* fit_env = std::getenv("DS_NORM_FIT");
  const std::string fit_saved = fit_env ? fit_env : "";
  auto b = make_cuda_backend_synthetic(o, c, 1, e);
  const auto fold_saved = cuda_prefill_fold(*b);
  using Fold = CudaEngineOptions::PrefillFold;
  std::mt19937 rng(7);
  const int V = c.vocab_size;
  std::vector<int32_t> p1(4096), p2(4096);
  for (auto& x : p1) x = int32_t(rng() % V);
  for (auto& x : p2) x = int32_t(rng() % V);
  // One pair = a fresh 4096 chunk, then 4096 more after it; ms = host time of each step().
  std::vector<float> logits;
  auto pair = [&](double* ms, std::vector<float>* out1, std::vector<float>* out2,
                  uint64_t* t = nullptr) {
    b->reset_slot(0);
    int k = 0;
    for (const auto* p : {&p1, &p2}) {
      SeqWork w{0, *p, false};
      if (t && cupti.ok) cupti.timestamp(&t[2 * k]);
      const auto t0 = std::chrono::steady_clock::now();
      b->step(std::span<const SeqWork>(&w, 1), logits);
      const double dt =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
      if (t && cupti.ok) cupti.timestamp(&t[2 * k + 1]);
      if (ms) ms[k] = dt;
      if (k == 0 && out1) *out1 = logits;
      if (k == 1 && out2) *out2 = logits;
      ++k;
    }
  };
  struct Path {
    const char* name;
    bool fit;
    Fold fold;
  };
  const Path paths[] = {{"session4", false, Fold::kOff},
                        {"fit", true, Fold::kOff},
                        {"fit+mixer", true, Fold::kMixer},
                        {"fit+all", true, Fold::kAll}};
  std::map<std::string, std::pair<std::vector<float>, std::vector<float>>> out;
  for (const Path& path : paths) {
    setenv("DS_NORM_FIT", path.fit ? "1" : "0", 1);
    set_cuda_prefill_fold(*b, path.fold);
    pair(nullptr, &out[path.name].first, &out[path.name].second);  // warm-up (plans, modules)
    std::printf("PHASE %s untraced start %.3f\n", path.name, now_unix());
    std::vector<double> ms[2];
    for (int it = 0; it < 5; ++it) {
      double m[2];
      pair(m, nullptr, nullptr);
      ms[0].push_back(m[0]);
      ms[1].push_back(m[1]);
    }
    std::printf("PHASE %s untraced end %.3f\n", path.name, now_unix());
    double med[2];
    for (int k = 0; k < 2; ++k) {
      std::sort(ms[k].begin(), ms[k].end());
      med[k] = ms[k][ms[k].size() / 2];
      std::printf("STEP %-9s %s: p50 %.3f ms, min %.3f, max %.3f (host-timed step(), %zu runs)\n",
                  path.name, k ? "4096 after 4096" : "4096 fresh     ", med[k], ms[k].front(),
                  ms[k].back(), ms[k].size());
    }
    if (!cupti.ok) continue;
    // Traced: 3 pairs with kernels, API calls and copies recorded.
    {
      const std::lock_guard<std::mutex> lock(g_mu);
      g_kernels.clear();
      g_api.clear();
      g_copies.clear();
    }
    const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                        CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER,
                                        CUPTI_ACTIVITY_KIND_MEMCPY};
    for (auto k : kinds) EXPECT_EQ(cupti.enable(k), CUPTI_SUCCESS);
    std::vector<std::array<uint64_t, 4>> windows;
    for (int it = 0; it < 3; ++it) {
      std::array<uint64_t, 4> t{};
      pair(nullptr, nullptr, nullptr, t.data());
      windows.push_back(t);
    }
    cudaDeviceSynchronize();
    cupti.flush_all(1);
    for (auto k : kinds) cupti.disable(k);
    std::vector<Chunk> fresh, cached;
    {
      const std::lock_guard<std::mutex> lock(g_mu);
      for (const auto& t : windows)
        for (int k = 0; k < 2; ++k) {
          Chunk ch;
          ch.t_call = t[2 * k];
          ch.t_return = t[2 * k + 1];
          for (const auto& r : g_kernels)
            if (r.start >= ch.t_call && r.end <= ch.t_return) ch.kernels.push_back(r);
          for (const auto& a : g_api)
            if (a.start >= ch.t_call && a.end <= ch.t_return) ch.api.push_back(a);
          for (const auto& m : g_copies)
            if (m.start >= ch.t_call && m.end <= ch.t_return) ch.copies.push_back(m);
          std::sort(ch.kernels.begin(), ch.kernels.end(),
                    [](const auto& a, const auto& x) { return a.start < x.start; });
          (k ? cached : fresh).push_back(std::move(ch));
        }
    }
    ASSERT_FALSE(fresh.front().kernels.empty()) << "CUPTI recorded no kernels";
    for (const auto& ch : fresh) EXPECT_EQ(ch.kernels.size(), fresh.front().kernels.size());
    report(std::string(path.name) + " 4096 fresh", fresh, cupti, med[0], true);
    report(std::string(path.name) + " 4096 after 4096", cached, cupti, med[1], false);
  }
  // Numerics of the last row's logits (both chunks): fit is bit-identical to session4; the fold
  // moves the bf16 rounding of h + delta (one rounding in the GEMM epilogue instead of two).
  auto compare = [&](const std::vector<float>& a, const std::vector<float>& ref, double* l2) {
    double num = 0, den = 0, mx = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double d = double(a[i]) - ref[i];
      num += d * d;
      den += double(ref[i]) * ref[i];
      mx = std::max(mx, std::fabs(d));
    }
    *l2 = std::sqrt(num / std::max(den, 1e-30));
    return mx;
  };
  const auto& base = out["session4"];
  for (const char* name : {"fit", "fit+mixer", "fit+all"}) {
    const auto& got = out[name];
    ASSERT_EQ(got.first.size(), base.first.size());
    for (int k = 0; k < 2; ++k) {
      const auto& a = k ? got.second : got.first;
      const auto& r = k ? base.second : base.first;
      double l2 = 0;
      const double mx = compare(a, r, &l2);
      const auto am = std::max_element(a.begin(), a.end()) - a.begin();
      const auto rm = std::max_element(r.begin(), r.end()) - r.begin();
      double rmax = 0;
      for (float x : r) rmax = std::max(rmax, std::fabs(double(x)));
      std::printf(
          "NUMERICS %-10s vs session4, %s last-row logits: max abs %.3e (of max %.3g), rel L2 "
          "%.3e, argmax %s\n",
          name, k ? "4096 after 4096" : "4096 fresh", mx, rmax, l2, am == rm ? "same" : "differs");
      if (std::string(name) == "fit")
        EXPECT_EQ(mx, 0.0) << "the fitted norm build must be bit-identical";
      else
        EXPECT_LT(l2, 3e-2) << name;
    }
  }
  std::printf("PHASE alone start %.3f\n", now_unix());
  time_alone(c, 4096);
  std::printf("PHASE alone end %.3f\n", now_unix());
  if (fit_env)
    setenv("DS_NORM_FIT", fit_saved.c_str(), 1);
  else
    unsetenv("DS_NORM_FIT");
  set_cuda_prefill_fold(*b, fold_saved);
}

}  // namespace
}  // namespace ds
