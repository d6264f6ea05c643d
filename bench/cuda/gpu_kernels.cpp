// `bench kernels` and `--profile`: every kernel family of the CUDA engine, called through its
// launch_* wrapper at exactly the shapes the forward issues for the configured model (PERF.md's
// family: prompt chunks of 4096 / 3072 / 512 tokens against 0 / 8K / 16K / 32K cached tokens,
// every decode GEMM of the model at batch 1 / 4 / 16, decode attention at 4K..32K, GDN at 1, 64,
// 512 and 4096 tokens, plus the small fused ops). Inputs are random (never zeros), each case
// rotates among enough input sets that together exceed three times L2, and times are the median
// of CUDA-graph replays (device_util.h). For every case: bytes and FLOPs it must move, the
// roofline floor from the measured ceilings, and, where the dispatch registry has a specialised
// variant in front of a generic one, the fallback's time on the same inputs and whether the two
// outputs agree.
//
// The profile composes one decode step / one prefill chunk from these isolated timings, in the
// forward's launch order (cuda_backend.cu), grouped by kernel class. It leaves out what only an
// in-engine timer sees (launch gaps, host work, the logits copy); the engine-measured step is put
// beside it when the same run measured one.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>

#include "bench/bench.h"
#include "bench/cuda/device_util.h"
#include "core/error.h"
#include "cuda/attention_decode.h"
#include "cuda/dispatch.h"
#include "cuda/gemm.h"
#include "cuda/gemv.h"
#include "cuda/gemv_bulk_norm.h"
#include "cuda/kernels.h"
#include "cuda/model_shapes.h"

namespace ds::bench {
namespace {

using bf16 = __nv_bfloat16;
using gpu::DevBuf;

constexpr int kPage = 64;       // the engine's default page size
constexpr int kMaxSplits = 64;  // the engine's decode-attention split bound
constexpr int kMaxRotations = 8;

std::string str(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string str(const char* f, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

// Device int32 array from host values.
DevBuf dev_ints(const std::vector<int32_t>& v, cudaStream_t s) {
  DevBuf b(std::max<size_t>(4, v.size() * 4), "bench metadata");
  gpu::check(cudaMemcpyAsync(b.as<void>(), v.data(), v.size() * 4, cudaMemcpyHostToDevice, s),
             "metadata copy");
  gpu::check(cudaStreamSynchronize(s), "metadata copy");
  return b;
}

struct GemmOp {
  std::string name;
  int n = 0, k = 0;
  bool f32_out = false;
};

class KernelBench {
 public:
  KernelBench(const ModelConfig& c, const Ceilings& ceil, const KernelBenchOptions& opt)
      : c_(c), ceil_(ceil), opt_(opt) {
    DS_CHECK(ceil.valid, "bench kernels: the ceilings were not measured");
    gpu::check(cudaSetDevice(opt.device), "cudaSetDevice");
    cudaDeviceProp prop{};
    gpu::check(cudaGetDeviceProperties(&prop, opt.device), "cudaGetDeviceProperties");
    sm_ = prop.major * 10 + prop.minor;
    n_sms_ = prop.multiProcessorCount;
    l2_ = static_cast<double>(prop.l2CacheSize);
    gpu::check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate");
    reg_ = cuda::DispatchRegistry::with_defaults(sm_);
    attn_ = cuda::attn_shape_of(c, kPage);
    gdn_ = cuda::gdn_shape_of(c);
    const int d = c.d_model;
    if (c.n_linear_layers() > 0) {
      ops_.push_back({"gdn_in", c.gdn_in_dim(), d, false});
      ops_.push_back({"gdn_out", d, c.gdn_z_dim(), false});
    }
    if (c.n_full_layers() > 0) {
      ops_.push_back({"attn_qkv", attn_.qkv_dim(), d, false});
      ops_.push_back({"attn_o", d, c.attn_out_dim(), false});
    }
    ops_.push_back({"gate_up", 2 * c.d_ff, d, false});
    ops_.push_back({"down", d, c.d_ff, false});
    ops_.push_back({"lm_head", c.vocab_size, d, true});
    to_.samples = opt.samples;
    to_.min_sample_s = opt.min_sample_s;
  }
  ~KernelBench() {
    if (s_) cudaStreamDestroy(s_);
  }

  const std::vector<GemmOp>& ops() const { return ops_; }
  bool has_op(const std::string& name) const {
    for (const auto& o : ops_)
      if (o.name == name) return true;
    return false;
  }
  const GemmOp& op(const std::string& name) const {
    for (const auto& o : ops_)
      if (o.name == name) return o;
    ds::throw_error("bench kernels: the model has no matrix '", name, "'");
  }
  void seed_results(const std::vector<KernelResult>& prior) {
    for (const auto& r : prior)
      if (r.time_s > 0) cache_[key(r.family, r.op, r.shape)] = r;
  }
  std::vector<KernelResult>& results() { return results_; }

  // ---- cases ----
  const KernelResult& gemm(const std::string& name, int m);
  // The narrow-output decode GEMMs (n = d_model: gdn_out, attn_o, down): every decode kernel that
  // takes the shape, launched directly without PDL, on the same rotated inputs, against cuBLASLt
  // tuned (the fallback column); one row per kernel, shape suffixed " A/B".
  void gemm_narrow_ab(const std::string& name, int m);
  // The tensor-core bulk GEMV (gemv_bulk_mma.cu, off in the engine unless $DS_GEMV_MMA=1) on the
  // k <= 8192 decode projections at batch 4 / 8 / 16: its shipped config alone and with PDL, the
  // k1024s5 config, and gemv_bulk (m <= 8) / skinny_mma beside it, launched directly on the same
  // rotated inputs against cuBLASLt tuned (the fallback column); shape suffixed " A/B mma".
  void gemm_mma_ab(const std::string& name, int m);
  // The batch-1 MLP in one kernel (launch_gemv_mlp_norm, $DS_MLP_FUSED=1 / 2) against the kernels
  // it fuses (gemv_bulk_silu with the norm, then gemv_narrow; with the mixer form gemv_bulk's
  // out-projection first), back to back with PDL on the same rotated weights: act, y (and delta)
  // compared, the separate kernels' time in the fallback column.
  void mlp_fused_ab();
  const KernelResult& attn_prefill(int q, int cached);
  const KernelResult& attn_decode(int batch, int ctx);
  const KernelResult& gdn_prefill(int n_tokens, int seq_pos);
  const KernelResult& gdn_decode(int batch);
  const KernelResult& rmsnorm(int n_tokens);
  const KernelResult& silu_mul(int n_tokens);
  const KernelResult& rope_kv(int n_tokens);
  const KernelResult& gather(int n_tokens, int d, const std::string& op);

 private:
  static std::string key(const std::string& f, const std::string& op, const std::string& shape) {
    return f + "|" + op + "|" + shape;
  }
  const KernelResult* cached(const std::string& f, const std::string& op,
                             const std::string& shape) {
    auto it = cache_.find(key(f, op, shape));
    return it == cache_.end() ? nullptr : &it->second;
  }
  // Rotated input sets so that one period touches at least 3x L2.
  int rotations(double bytes_per_set) const {
    return static_cast<int>(std::clamp(std::ceil(3.0 * l2_ / std::max(1.0, bytes_per_set)), 1.0,
                                       double(kMaxRotations)));
  }
  // The weights of GEMM op `name` as `rot` rotated copies ([rot, n, k] bf16): filled once per op
  // (again when a larger rotation than so far is asked for) and kept across m.
  const bf16* gemm_weights(const std::string& name, int rot);
  gpu::TimerOptions timer(int rot) const {
    gpu::TimerOptions t = to_;
    t.min_per_replay = rot;
    return t;
  }
  const KernelResult& finish(KernelResult r) {
    const Floor f = roofline_floor(r.bytes, r.flops, ceil_.read_bps, ceil_.gemm_flops);
    r.floor_s = f.seconds;
    r.memory_bound = f.memory_bound;
    r.time_s = r.samples.p50;
    std::printf(
        "  %-26s %-9s %-34s %10.2f us  (%3.0f%% of SOL)%s%s\n",
        (r.family + "." + r.variant).c_str(), r.op.c_str(), r.shape.c_str(), r.time_s * 1e6,
        100.0 * r.floor_s / r.time_s,
        r.fallback.empty() ? "" : str("  fallback %.2f us", r.fallback_time_s * 1e6).c_str(),
        r.match.empty() ? "" : ("  " + r.match).c_str());
    std::fflush(stdout);
    const std::string k = key(r.family, r.op, r.shape);
    results_.push_back(r);
    return cache_[k] = std::move(r);
  }
  std::string variant(cuda::KernelFamily f, const cuda::ShapeKey& k) const {
    return reg_.select(f, k).name;
  }

  const ModelConfig& c_;
  const Ceilings& ceil_;
  KernelBenchOptions opt_;
  int sm_ = 0, n_sms_ = 0;
  double l2_ = 0;
  cudaStream_t s_ = nullptr;
  cuda::DispatchRegistry reg_;
  cuda::AttnShape attn_;
  cuda::GdnShape gdn_;
  std::vector<GemmOp> ops_;
  gpu::TimerOptions to_;
  std::map<std::string, KernelResult> cache_;
  std::vector<KernelResult> results_;
  std::map<std::string, DevBuf> weights_;  // per GEMM op, kept across m (rotated copies)
  std::map<std::string, int> weight_rot_;
  uint64_t seed_ = 1000;
};

const bf16* KernelBench::gemm_weights(const std::string& name, int rot) {
  const GemmOp& o = op(name);
  if (weight_rot_[name] < rot) {
    weights_.erase(name);
    DevBuf w(size_t(2.0 * o.n * o.k) * rot, "gemm weights");
    gpu::fill_normal_bf16(w.as<bf16>(), int64_t(o.n) * o.k * rot, seed_++, 0.f, 0.02f, s_);
    weights_.emplace(name, std::move(w));
    weight_rot_[name] = rot;
  }
  return weights_.at(name).as<bf16>();
}

const KernelResult& KernelBench::gemm(const std::string& name, int m) {
  const GemmOp& o = op(name);
  const std::string shape = str("m=%d n=%d k=%d%s", m, o.n, o.k, o.f32_out ? " f32 out" : "");
  if (auto* r = cached("gemm", name, shape)) return *r;
  const double wbytes = 2.0 * o.n * o.k;
  const double out_elem = o.f32_out ? 4.0 : 2.0;
  const double set_bytes = wbytes + 2.0 * m * o.k + out_elem * m * o.n;
  const int rot = rotations(set_bytes);
  const bf16* w = gemm_weights(name, rot);
  DevBuf x(size_t(2) * m * o.k * rot, "gemm x"), y(size_t(out_elem) * m * o.n * rot, "gemm y");
  gpu::fill_normal_bf16(x.as<bf16>(), int64_t(m) * o.k * rot, seed_++, 0.f, 1.f, s_);
  // The engine's path (registry set: gemm.skinny_mma for decode shapes) and, when that is a
  // specialised variant, plain cuBLASLt on the same inputs (time and agreement).
  cuda::GemmEngine g, fallback;
  g.set_dispatch(&reg_);
  const cuda::GemmOut out = o.f32_out ? cuda::GemmOut::kF32 : cuda::GemmOut::kBF16;
  g.prepare(m, o.n, o.k, out);
  KernelResult r;
  r.family = "gemm";
  r.variant = g.variant(m, o.n, o.k);
  // cuBLASLt shapes the engine tunes at start-up (decode m <= 16 here, the 4096-token prompt
  // chunk): tuned the same way (gemm.h tune()); the fallback column is then the heuristic's
  // algorithm. $DS_GEMM_TUNE=0: heuristic only, as before.
  bool tuned = false;
  if (r.variant == "cublaslt" && (m <= 16 || m == 4096) && cuda::GemmEngine::tuning_enabled()) {
    std::vector<const bf16*> ws;
    for (int i = 0; i < rot; ++i) ws.push_back(w + int64_t(i) * o.n * o.k);
    cuda::GemmTuneOptions to;
    if (m > 16) to.max_candidates = 8, to.max_weights = 1, to.batches = 3;  // as the engine
    const cuda::GemmTuneResult tr =
        g.tune(m, o.n, o.k, out, ws, x.as<bf16>(), y.as<void>(), s_, false, to);
    tuned = !g.uses_heuristic_algo(m, o.n, o.k, out);
    r.variant = tuned ? "cublaslt_tuned" : "cublaslt";
    if (!tr.timed) r.note = "tuning: " + tr.note;
  }
  r.op = name;
  r.shape = shape;
  auto launch = [&](cuda::GemmEngine& e, int i) {
    const int k = i % rot;
    e.run(x.as<bf16>() + int64_t(k) * m * o.k, w + int64_t(k) * o.n * o.k,
          y.as<char>() + size_t(out_elem) * m * o.n * k, m, o.n, o.k, out, s_);
  };
  if (r.variant != "cublaslt") {  // a specialised kernel, or a tuned cuBLASLt algorithm
    fallback.prepare(m, o.n, o.k, out);
    // A specialised decode kernel is compared with cuBLASLt tuned as the engine would tune it
    // (the engine's fallback for these shapes), not with the heuristic's first algorithm.
    bool fallback_tuned = false;
    if (!tuned && r.variant != "cublaslt_tuned" && m <= 16 &&
        cuda::GemmEngine::tuning_enabled()) {
      std::vector<const bf16*> ws;
      for (int i = 0; i < rot; ++i) ws.push_back(w + int64_t(i) * o.n * o.k);
      DevBuf xt(size_t(2) * m * o.k, "gemm x (tuning)");
      fallback.tune(m, o.n, o.k, out, ws, xt.as<bf16>(), y.as<void>(), s_, false, {});
      fallback_tuned = !fallback.uses_heuristic_algo(m, o.n, o.k, out);
    }
    DevBuf y2(size_t(out_elem) * m * o.n, "gemm y (fallback)");
    g.run(x.as<bf16>(), w, y.as<void>(), m, o.n, o.k, out, s_);
    fallback.run(x.as<bf16>(), w, y2.as<void>(), m, o.n, o.k, out, s_);
    const int64_t cnt = int64_t(m) * o.n;
    r.match = o.f32_out ? gpu::compare_f32(y.as<float>(), y2.as<float>(), cnt, s_).text()
                        : gpu::compare_bf16(y.as<bf16>(), y2.as<bf16>(), cnt, s_).text();
    r.fallback = tuned            ? "cublaslt (heuristic)"
                 : fallback_tuned ? "cublaslt_tuned"
                                  : "cublaslt";
    r.fallback_time_s =
        gpu::time_launches([&](int i) { launch(fallback, i); }, s_, timer(rot)).p50;
  }
  r.samples = gpu::time_launches([&](int i) { launch(g, i); }, s_, timer(rot));
  r.bytes = set_bytes;
  r.flops = 2.0 * m * o.n * o.k;
  if (rot > 1) r.note += (r.note.empty() ? "" : "; ") + str("%d rotated weight copies", rot);
  return finish(r);
}

void KernelBench::gemm_narrow_ab(const std::string& name, int m) {
  const GemmOp& o = op(name);
  if (o.f32_out) return;
  const std::string shape = str("m=%d n=%d k=%d A/B", m, o.n, o.k);
  const double wbytes = 2.0 * o.n * o.k;
  const double set_bytes = wbytes + 2.0 * m * o.k + 2.0 * m * o.n;
  const int rot = rotations(set_bytes);
  const bf16* w = gemm_weights(name, rot);
  DevBuf x(size_t(2) * m * o.k * rot, "gemm x"), y(size_t(2) * m * o.n * rot, "gemm y"),
      yref(size_t(2) * m * o.n, "gemm y (cuBLASLt)");
  gpu::fill_normal_bf16(x.as<bf16>(), int64_t(m) * o.k * rot, seed_++, 0.f, 1.f, s_);
  auto xi = [&](int i) { return x.as<bf16>() + int64_t(i % rot) * m * o.k; };
  auto wi = [&](int i) { return w + int64_t(i % rot) * o.n * o.k; };
  auto yi = [&](int i) { return y.as<bf16>() + int64_t(i % rot) * m * o.n; };
  // cuBLASLt tuned as the engine tunes it: the fallback of every row.
  cuda::GemmEngine lt;
  const cuda::GemmOut out = cuda::GemmOut::kBF16;
  lt.prepare(m, o.n, o.k, out);
  if (cuda::GemmEngine::tuning_enabled()) {
    std::vector<const bf16*> ws;
    for (int i = 0; i < rot; ++i) ws.push_back(wi(i));
    DevBuf xt(size_t(2) * m * o.k, "gemm x (tuning)");
    lt.tune(m, o.n, o.k, out, ws, xt.as<bf16>(), y.as<void>(), s_, false, {});
  }
  const bool lt_tuned = !lt.uses_heuristic_algo(m, o.n, o.k, out);
  lt.run(xi(0), wi(0), yref.as<void>(), m, o.n, o.k, out, s_);
  const double t_lt =
      gpu::time_launches([&](int i) { lt.run(xi(i), wi(i), yi(i), m, o.n, o.k, out, s_); }, s_,
                         timer(rot))
          .p50;
  auto row = [&](const std::string& variant, const std::function<void(int)>& launch,
                 bool pdl = false) {
    KernelResult r;
    r.family = "gemm";
    r.variant = variant;
    r.op = name;
    r.shape = shape;
    launch(0);
    r.match = gpu::compare_bf16(yi(0), yref.as<bf16>(), int64_t(m) * o.n, s_).text();
    r.fallback = lt_tuned ? "cublaslt_tuned" : "cublaslt";
    r.fallback_time_s = t_lt;
    r.samples = gpu::time_launches(launch, s_, timer(rot));
    r.bytes = set_bytes;
    r.flops = 2.0 * m * o.n * o.k;
    r.note = str("launched directly, %s; %d rotated weight copies", pdl ? "with PDL" : "no PDL",
                 rot);
    finish(r);
  };
  if (cuda::gemv_narrow_supports(m, o.n, o.k, n_sms_)) {
    const cuda::GemvNarrowConfig c = cuda::gemv_narrow_config(m, o.n, o.k, n_sms_);
    row("gemv_narrow_" + c.name(), [&](int i) {
      cuda::launch_gemv_narrow(xi(i), wi(i), yi(i), m, o.n, o.k, out, false, c, n_sms_, s_);
    });
  }
  if (cuda::skinny_gemm_supports(m, o.n, o.k)) {
    const cuda::SkinnyConfig c = cuda::skinny_gemm_config(m, o.n, o.k, n_sms_);
    row("skinny_mma_" + c.name(), [&](int i) {
      cuda::launch_skinny_gemm(xi(i), wi(i), yi(i), m, o.n, o.k, out, false, c, s_);
    });
  }
  if (cuda::gemv_bulk_supports(m, o.n, o.k)) {
    const cuda::GemvBulkConfig c = cuda::gemv_bulk_config(m, o.n, o.k);
    row("gemv_bulk_" + c.name(), [&](int i) {
      cuda::launch_gemv_bulk(xi(i), wi(i), yi(i), m, o.n, o.k, out, false, c, n_sms_, s_);
    });
  }
  // The TMA tensor-core GEMV for narrow outputs (gemv_tma.cu; in the engine on the down
  // projection at m 3..16 unless $DS_GEMV_TMA_NARROW=0): the shipped config plain and with PDL
  // (back to back), and the other stage widths.
  if (cuda::gemv_tma_narrow_supports(m, o.n, o.k, n_sms_)) {
    const cuda::GemvTmaNarrowConfig shipped = cuda::gemv_tma_narrow_config(m, o.n, o.k);
    for (cuda::GemvTmaNarrowConfig c : cuda::gemv_tma_narrow_configs(m, o.n, o.k, n_sms_))
      for (bool pdl : {false, true}) {
        if (pdl && (c.kbox != shipped.kbox || c.slots != shipped.slots)) continue;
        c.pdl = pdl;
        row(
            "gemv_tma_narrow_" + c.name(),
            [&](int i) {
              cuda::launch_gemv_tma_narrow(xi(i), wi(i), yi(i), m, o.n, o.k, out, c, n_sms_, s_);
            },
            pdl);
      }
  }
  // The split-K tensor-core GEMV (gemv_splitk_mma.cu; in the engine only with $DS_GEMV_SPLITK),
  // plain and launched with PDL (back to back, each launch's first weight stages then stream
  // while the one before finishes, as after the engine's silu_mul / mixer kernels).
  if (cuda::gemv_splitk_supports(m, o.n, o.k)) {
    DevBuf ws(cuda::gemv_splitk_workspace_bytes(), "split-k workspace");
    gpu::check(cudaMemsetAsync(ws.as<void>(), 0, cuda::gemv_splitk_workspace_bytes(), s_),
               "split-k workspace");
    for (bool pdl : {false, true})
      row(
          pdl ? "gemv_splitk_mma_pdl" : "gemv_splitk_mma",
          [&](int i) {
            cuda::launch_gemv_splitk(xi(i), wi(i), yi(i), m, o.n, o.k, out, false, ws.as<void>(),
                                     s_, n_sms_, pdl);
          },
          pdl);
  }
}

void KernelBench::gemm_mma_ab(const std::string& name, int m) {
  const GemmOp& o = op(name);
  if (o.f32_out) return;
  const std::string shape = str("m=%d n=%d k=%d A/B mma", m, o.n, o.k);
  const double wbytes = 2.0 * o.n * o.k;
  const double set_bytes = wbytes + 2.0 * m * o.k + 2.0 * m * o.n;
  const int rot = rotations(set_bytes);
  const bf16* w = gemm_weights(name, rot);
  DevBuf x(size_t(2) * m * o.k * rot, "gemm x"), y(size_t(2) * m * o.n * rot, "gemm y"),
      yref(size_t(2) * m * o.n, "gemm y (cuBLASLt)");
  gpu::fill_normal_bf16(x.as<bf16>(), int64_t(m) * o.k * rot, seed_++, 0.f, 1.f, s_);
  auto xi = [&](int i) { return x.as<bf16>() + int64_t(i % rot) * m * o.k; };
  auto wi = [&](int i) { return w + int64_t(i % rot) * o.n * o.k; };
  auto yi = [&](int i) { return y.as<bf16>() + int64_t(i % rot) * m * o.n; };
  cuda::GemmEngine lt;  // cuBLASLt tuned as the engine tunes it: the fallback of every row
  const cuda::GemmOut out = cuda::GemmOut::kBF16;
  lt.prepare(m, o.n, o.k, out);
  if (cuda::GemmEngine::tuning_enabled()) {
    std::vector<const bf16*> ws;
    for (int i = 0; i < rot; ++i) ws.push_back(wi(i));
    DevBuf xt(size_t(2) * m * o.k, "gemm x (tuning)");
    lt.tune(m, o.n, o.k, out, ws, xt.as<bf16>(), y.as<void>(), s_, false, {});
  }
  const bool lt_tuned = !lt.uses_heuristic_algo(m, o.n, o.k, out);
  lt.run(xi(0), wi(0), yref.as<void>(), m, o.n, o.k, out, s_);
  const double t_lt =
      gpu::time_launches([&](int i) { lt.run(xi(i), wi(i), yi(i), m, o.n, o.k, out, s_); }, s_,
                         timer(rot))
          .p50;
  // ref / count: what the row's output is compared with (cuBLASLt's [m, n] unless given).
  auto row = [&](const std::string& variant, const std::string& how,
                 const std::function<void(int)>& launch, const bf16* ref = nullptr,
                 int64_t count = 0) {
    KernelResult r;
    r.family = "gemm";
    r.variant = variant;
    r.op = name;
    r.shape = shape;
    gpu::check(cudaMemsetAsync(yi(0), 0xFF, size_t(2) * m * o.n, s_), "poison y");  // NaN
    launch(0);
    r.match = gpu::compare_bf16(yi(0), ref ? ref : yref.as<bf16>(),
                                ref ? count : int64_t(m) * o.n, s_)
                  .text();
    r.fallback = lt_tuned ? "cublaslt_tuned" : "cublaslt";
    r.fallback_time_s = t_lt;
    r.samples = gpu::time_launches(launch, s_, timer(rot));
    r.bytes = set_bytes;
    r.flops = 2.0 * m * o.n * o.k;
    r.note = str("launched directly, %s; %d rotated weight copies", how.c_str(), rot);
    finish(r);
  };
  if (cuda::gemv_bulk_mma_supports(m, o.n, o.k, n_sms_)) {
    const cuda::GemvBulkMmaConfig shipped = cuda::gemv_bulk_mma_config(m, o.n, o.k);
    for (cuda::GemvBulkMmaConfig c : {shipped, cuda::GemvBulkMmaConfig{1024, 5, false}}) {
      if (!cuda::gemv_bulk_mma_fits(m, o.n, o.k, c, n_sms_)) continue;
      for (bool pdl : {false, true}) {
        if (pdl && (c.kc != shipped.kc || c.slots != shipped.slots)) continue;
        c.pdl = pdl;
        row("gemv_bulk_mma_" + c.name(), pdl ? "with PDL (back to back)" : "no PDL", [&](int i) {
          cuda::launch_gemv_bulk_mma(xi(i), wi(i), yi(i), m, o.n, o.k, out, false, c, n_sms_, s_);
        });
      }
    }
  }
  // The TMA tensor-core GEMV (gemv_tma.cu; in the engine at m 5..16 unless $DS_GEMV_TMA=0),
  // plain and with PDL; on gate_up also its fused SiLU kernel, whose [m, d_ff] activation is
  // compared with silu_mul of cuBLASLt's [m, 2 d_ff] output (the engine's unfused path).
  if (cuda::gemv_tma_supports(m, o.n, o.k, false, n_sms_)) {
    for (bool pdl : {false, true}) {
      cuda::GemvTmaConfig c = cuda::gemv_tma_config(m, o.n, o.k, false);
      c.pdl = pdl;
      row("gemv_tma_" + c.name(), pdl ? "with PDL (back to back)" : "no PDL", [&](int i) {
        cuda::launch_gemv_tma(xi(i), wi(i), yi(i), m, o.n, o.k, out, c, n_sms_, s_);
      });
    }
    // Wider stages (GemvTmaConfig::kbox, session 27: 2 / 4 x 64 k per stage), PDL, where they fit
    // and are not the config above.
    for (int kb : {2, 4}) {
      cuda::GemvTmaConfig c = cuda::gemv_tma_config(m, o.n, o.k, false);
      if (c.kbox == kb) continue;
      c.kbox = kb;
      c.pdl = true;
      if (!cuda::gemv_tma_fits(m, o.n, o.k, false, c, n_sms_)) continue;
      row("gemv_tma_" + c.name(), "with PDL (back to back); wider stages", [&](int i) {
        cuda::launch_gemv_tma(xi(i), wi(i), yi(i), m, o.n, o.k, out, c, n_sms_, s_);
      });
    }
    if (o.n % 2 == 0 && cuda::gemv_tma_supports(m, o.n / 2, o.k, true, n_sms_) &&
        name == "gate_up") {
      DevBuf aref(size_t(2) * m * (o.n / 2), "gemm silu reference");
      cuda::launch_silu_mul(yref.as<bf16>(), m, o.n / 2, aref.as<bf16>(), s_);
      for (bool pdl : {false, true}) {
        cuda::GemvTmaConfig c = cuda::gemv_tma_config(m, o.n / 2, o.k, true);
        c.pdl = pdl;
        row(
            "gemv_tma_silu_" + c.name(),
            pdl ? "with PDL (back to back); match: against cuBLASLt + silu_mul"
                : "no PDL; match: against cuBLASLt + silu_mul",
            [&](int i) {
              cuda::launch_gemv_tma_silu(xi(i), wi(i), yi(i), m, o.n / 2, o.k, c, n_sms_, s_);
            },
            aref.as<bf16>(), int64_t(m) * (o.n / 2));
      }
      for (int kb : {2, 4}) {  // wider stages (kbox), PDL, where they fit
        cuda::GemvTmaConfig c = cuda::gemv_tma_config(m, o.n / 2, o.k, true);
        if (c.kbox == kb) continue;
        c.kbox = kb;
        c.pdl = true;
        if (!cuda::gemv_tma_fits(m, o.n / 2, o.k, true, c, n_sms_)) continue;
        row(
            "gemv_tma_silu_" + c.name(),
            "with PDL (back to back); wider stages; match: against cuBLASLt + silu_mul",
            [&](int i) {
              cuda::launch_gemv_tma_silu(xi(i), wi(i), yi(i), m, o.n / 2, o.k, c, n_sms_, s_);
            },
            aref.as<bf16>(), int64_t(m) * (o.n / 2));
      }
    }
  }
  if (cuda::gemv_bulk_supports(m, o.n, o.k)) {
    const cuda::GemvBulkConfig c = cuda::gemv_bulk_config(m, o.n, o.k);
    row("gemv_bulk_" + c.name(), "no PDL", [&](int i) {
      cuda::launch_gemv_bulk(xi(i), wi(i), yi(i), m, o.n, o.k, out, false, c, n_sms_, s_);
    });
  }
  if (cuda::skinny_gemm_supports(m, o.n, o.k)) {
    const cuda::SkinnyConfig c = cuda::skinny_gemm_config(m, o.n, o.k, n_sms_);
    row("skinny_mma_" + c.name(), "no PDL", [&](int i) {
      cuda::launch_skinny_gemm(xi(i), wi(i), yi(i), m, o.n, o.k, out, false, c, s_);
    });
  }
}

void KernelBench::mlp_fused_ab() {
  if (!has_op("gate_up") || !has_op("down")) return;
  const GemmOp& gu = op("gate_up");
  const GemmOp& dn = op("down");
  const int d_ff = gu.n / 2, k = gu.k, n = dn.n;
  if (dn.k != d_ff || !cuda::gemv_mlp_norm_supports(1, d_ff, k, n, 0, n_sms_)) return;
  // The mixer form's out-projection: gdn_out (else attn_o) where the model has one of n = k rows.
  const GemmOp* out_op = has_op("gdn_out") ? &op("gdn_out") : has_op("attn_o") ? &op("attn_o")
                                                                                : nullptr;
  const int k0 = out_op && out_op->n == k &&
                         cuda::gemv_mlp_norm_supports(1, d_ff, k, n, out_op->k, n_sms_)
                     ? out_op->k
                     : 0;
  const double set_bytes = 2.0 * gu.n * k + 2.0 * n * d_ff + 2.0 * k * k0;
  const int rot = rotations(set_bytes);  // (form 3's extra weight only adds to the set)
  const bf16* wg = gemm_weights("gate_up", rot);
  const bf16* wd = gemm_weights("down", rot);
  const bf16* wo = k0 ? gemm_weights(out_op->name, rot) : nullptr;
  DevBuf res(size_t(2) * k, "mlp residual"), delta(size_t(2) * k, "mlp delta"),
      delta2(size_t(2) * k, "mlp delta (fused)"), x0(size_t(2) * std::max(k0, 8), "mlp x0"),
      nw(size_t(2) * k, "mlp norm weight"), rout(size_t(2) * k, "mlp residual out"),
      act(size_t(2) * d_ff, "mlp act"), act2(size_t(2) * d_ff, "mlp act (fused)"),
      y(size_t(2) * n, "mlp y"), y2(size_t(2) * n, "mlp y (fused)"), bar(8, "mlp grid barrier");
  gpu::fill_normal_bf16(res.as<bf16>(), k, seed_++, 0.f, 2.f, s_);
  gpu::fill_normal_bf16(delta.as<bf16>(), k, seed_++, 0.f, 1.f, s_);
  gpu::fill_normal_bf16(nw.as<bf16>(), k, seed_++, 0.f, 0.2f, s_);
  if (k0) gpu::fill_normal_bf16(x0.as<bf16>(), k0, seed_++, 0.f, 1.f, s_);
  gpu::check(cudaMemsetAsync(bar.as<void>(), 0, 8, s_), "mlp grid barrier");
  auto wgi = [&](int i) { return wg + int64_t(i % rot) * gu.n * k; };
  auto wdi = [&](int i) { return wd + int64_t(i % rot) * n * d_ff; };
  auto woi = [&](int i) { return wo + int64_t(i % rot) * k * k0; };
  cuda::GemvBulkConfig scfg = cuda::gemv_bulk_silu_config(1, d_ff, k);
  scfg.pdl = true;
  cuda::GemvNarrowConfig ncfg = cuda::gemv_narrow_config(1, n, d_ff, n_sms_);
  ncfg.pdl = true;
  cuda::GemvBulkConfig ocfg = cuda::gemv_bulk_config(1, k, std::max(k0, 8));
  ocfg.pdl = true;
  // The next layer's in-projection of form 3: gdn_in where the model has it (else attn_qkv).
  const GemmOp* in_op = has_op("gdn_in") ? &op("gdn_in") : has_op("attn_qkv") ? &op("attn_qkv")
                                                                              : nullptr;
  const int n_in = k0 && in_op && in_op->k == k &&
                           cuda::gemv_mlp_norm_supports(1, d_ff, k, n, k0, n_sms_, in_op->n)
                       ? in_op->n
                       : 0;
  const bf16* wi_in = n_in ? gemm_weights(in_op->name, rot) : nullptr;
  DevBuf nw2(size_t(2) * k, "mlp next norm weight"), rout2(size_t(2) * k, "mlp residual out 2"),
      rout2b(size_t(2) * k, "mlp residual out 2 (fused)"),
      rout1b(size_t(2) * k, "mlp residual (fused)"),
      proj(size_t(2) * std::max(n_in, 8), "mlp next projection"),
      proj2(size_t(2) * std::max(n_in, 8), "mlp next projection (fused)");
  gpu::fill_normal_bf16(nw2.as<bf16>(), k, seed_++, 0.f, 0.2f, s_);
  auto wii = [&](int i) { return wi_in + int64_t(i % rot) * n_in * k; };
  cuda::GemvBulkConfig icfg = cuda::gemv_bulk_config(1, std::max(n_in, 1), k);
  icfg.pdl = true;
  // form 1: the MLP; 2: the out-projection writes the norm's delta first (delta / delta2); 3: and
  // the next layer's norm + in-projection last.
  for (int form : {1, 2, 3}) {
    const bool mixer = form >= 2, with_next = form == 3;
    if ((mixer && !k0) || (with_next && !n_in)) continue;
    cuda::GemvNormIn nin;
    nin.residual = res.as<bf16>();
    nin.delta = delta.as<bf16>();
    nin.weight = nw.as<bf16>();
    nin.residual_out = rout.as<bf16>();
    cuda::GemvNormIn nin2 = nin;
    if (mixer) nin2.delta = delta2.as<bf16>();
    nin2.residual_out = rout1b.as<bf16>();
    cuda::GemvNormIn next_ref;  // the next layer's norm after the separate kernels
    next_ref.residual = rout.as<bf16>();
    next_ref.delta = y.as<bf16>();
    next_ref.weight = nw2.as<bf16>();
    next_ref.residual_out = rout2.as<bf16>();
    auto separate = [&](int i) {
      if (mixer)
        cuda::launch_gemv_bulk(x0.as<bf16>(), woi(i), delta.as<void>(), 1, k, k0,
                               cuda::GemmOut::kBF16, false, ocfg, n_sms_, s_);
      cuda::launch_gemv_bulk_silu_norm(nin, wgi(i), act.as<bf16>(), 1, d_ff, k, scfg, n_sms_, s_);
      cuda::launch_gemv_narrow(act.as<bf16>(), wdi(i), y.as<void>(), 1, n, d_ff,
                               cuda::GemmOut::kBF16, false, ncfg, n_sms_, s_);
      if (with_next)
        cuda::launch_gemv_bulk_norm(next_ref, wii(i), proj.as<void>(), 1, n_in, k,
                                    cuda::GemmOut::kBF16, icfg, n_sms_, s_);
    };
    auto fused = [&](int i) {
      cuda::GemvMlpMixer mx;
      if (mixer) mx = {x0.as<bf16>(), woi(i), delta2.as<bf16>(), k0};
      cuda::GemvMlpNext nx;
      if (with_next) {
        nx.norm = next_ref;
        nx.norm.residual = rout1b.as<bf16>();
        nx.norm.delta = y2.as<bf16>();
        nx.norm.residual_out = rout2b.as<bf16>();
        nx.w = wii(i);
        nx.y = proj2.as<bf16>();
        nx.n = n_in;
      }
      cuda::launch_gemv_mlp_norm(nin2, mx, nx, wgi(i), act2.as<bf16>(), wdi(i), y2.as<bf16>(), 1,
                                 d_ff, k, n, true, bar.as<unsigned>(), n_sms_, s_);
    };
    separate(0);
    fused(0);
    KernelResult r;
    r.family = "gemm";
    r.variant = form == 3 ? "mixer_mlp_next_fused" : mixer ? "mixer_mlp_fused" : "mlp_fused";
    r.op = (mixer ? out_op->name + "+" : std::string()) + "gate_up+down" +
           (with_next ? "+" + in_op->name : std::string());
    r.shape = form == 1   ? str("m=1 d_ff=%d k=%d n=%d A/B", d_ff, k, n)
              : form == 2 ? str("m=1 k0=%d d_ff=%d k=%d n=%d A/B", k0, d_ff, k, n)
                          : str("m=1 k0=%d d_ff=%d k=%d n=%d n_next=%d A/B", k0, d_ff, k, n, n_in);
    r.match = "y: " + gpu::compare_bf16(y2.as<bf16>(), y.as<bf16>(), n, s_).text() + "; act: " +
              gpu::compare_bf16(act2.as<bf16>(), act.as<bf16>(), d_ff, s_).text() +
              (mixer ? "; delta: " +
                           gpu::compare_bf16(delta2.as<bf16>(), delta.as<bf16>(), k, s_).text()
                     : std::string()) +
              (with_next
                   ? "; next: " +
                         gpu::compare_bf16(proj2.as<bf16>(), proj.as<bf16>(), n_in, s_).text() +
                         "; next residual: " +
                         gpu::compare_bf16(rout2b.as<bf16>(), rout2.as<bf16>(), k, s_).text()
                   : std::string());
    r.fallback = std::string(mixer ? "gemv_bulk, " : "") + "gemv_bulk_silu+norm, gemv_narrow" +
                 (with_next ? ", gemv_bulk+norm" : "");
    r.fallback_time_s = gpu::time_launches(separate, s_, timer(rot)).p50;
    r.samples = gpu::time_launches(fused, s_, timer(rot));
    const double extra = (mixer ? double(k) * k0 : 0.0) + (with_next ? double(n_in) * k : 0.0);
    r.bytes = 2.0 * gu.n * k + 2.0 * n * d_ff + 2.0 * extra;
    r.flops = 2.0 * (double(gu.n) * k + double(n) * d_ff + extra);
    r.note = str("all back to back with PDL (the separate kernels: %d launches per sample); %d "
                 "rotated weight copies",
                 1 + form, rot);
    finish(r);
  }
}

const KernelResult& KernelBench::attn_prefill(int q, int cached_tokens) {
  const std::string shape = str("q %d after %d cached, %dq/%dkv hd %d", q, cached_tokens,
                                c_.n_heads, c_.n_kv_heads, c_.head_dim);
  if (auto* r = cached("attn_prefill", "", shape)) return *r;
  const int kv = cached_tokens + q;
  const int n_blocks = (kv + kPage - 1) / kPage;
  const int64_t page_elems = int64_t(c_.n_kv_heads) * kPage * c_.head_dim;
  DevBuf kc(size_t(n_blocks) * page_elems * 2, "attn K"),
      vc(size_t(n_blocks) * page_elems * 2, "attn V");
  gpu::fill_normal_bf16(kc.as<bf16>(), n_blocks * page_elems, seed_++, 0.f, 1.f, s_);
  gpu::fill_normal_bf16(vc.as<bf16>(), n_blocks * page_elems, seed_++, 0.f, 1.f, s_);
  std::vector<int32_t> table(n_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(7));  // pages scattered, as in serving
  const int64_t qe = int64_t(q) * c_.n_heads * c_.head_dim;
  DevBuf qb(size_t(qe) * 2, "attn q"), gate(size_t(qe) * 2, "attn gate"),
      out(size_t(qe) * 2, "attn out"), out2(size_t(qe) * 2, "attn out (fallback)");
  gpu::fill_normal_bf16(qb.as<bf16>(), qe, seed_++, 0.f, 1.f, s_);
  gpu::fill_normal_bf16(gate.as<bf16>(), qe, seed_++, 0.f, 1.f, s_);
  DevBuf d_qs = dev_ints({0}, s_), d_ql = dev_ints({q}, s_), d_kl = dev_ints({kv}, s_),
         d_bt = dev_ints(table, s_);
  cuda::AttnBatch b;
  b.n_seqs = 1;
  b.q_start = d_qs.as<int32_t>();
  b.q_len = d_ql.as<int32_t>();
  b.kv_len = d_kl.as<int32_t>();
  b.block_table = d_bt.as<int32_t>();
  b.block_table_stride = n_blocks;
  b.max_q_len = q;
  b.max_kv_len = kv;
  cuda::AttnGate g;
  if (attn_.gated) g = {gate.as<bf16>(), int64_t(c_.n_heads) * c_.head_dim, c_.head_dim};
  KernelResult r;
  r.family = "attn_prefill";
  const cuda::ShapeKey key = reg_.key(c_.head_dim, c_.n_heads / c_.n_kv_heads, q, kv);
  r.variant = variant(cuda::KernelFamily::kAttnPrefill, key);
  r.shape = shape;
  auto run = [&](const cuda::DispatchRegistry* reg, bf16* o) {
    cuda::launch_attention_prefill(attn_, b, qb.as<bf16>(), kc.as<bf16>(), vc.as<bf16>(), g, o, s_,
                                   reg);
  };
  const bool generic = !reg_.select(cuda::KernelFamily::kAttnPrefill, key).guard;
  if (!generic) {
    // The generic kernel (registry null) on the same inputs: agreement and its time.
    run(&reg_, out.as<bf16>());
    run(nullptr, out2.as<bf16>());
    r.match = gpu::compare_bf16(out.as<bf16>(), out2.as<bf16>(), qe, s_).text();
    r.fallback = "wmma_flash";
    r.fallback_time_s =
        gpu::time_launches([&](int) { run(nullptr, out2.as<bf16>()); }, s_, timer(1)).p50;
    // Every other specialised variant that accepts the shape, for the dispatch table: its time
    // and its agreement with the generic kernel, in the note.
    for (const auto& v : reg_.variants()) {
      if (v.family != cuda::KernelFamily::kAttnPrefill || !v.guard || !v.enabled ||
          v.name == r.variant || !v.guard(key))
        continue;
      cuda::DispatchRegistry only = reg_;
      for (const auto& o : reg_.variants())
        if (o.family == v.family && o.guard && o.name != v.name)
          only.set_enabled(o.full_name(), false);
      bf16* o3 = out.as<bf16>();
      run(&only, o3);
      const std::string m = gpu::compare_bf16(o3, out2.as<bf16>(), qe, s_).text();
      const double t = gpu::time_launches([&](int) { run(&only, o3); }, s_, timer(1)).p50;
      r.note += str("%s%s %.2f us (%.0f TFLOP/s; vs generic %s)", r.note.empty() ? "" : "; ",
                    v.name.c_str(), t * 1e6,
                    4.0 * c_.n_heads * c_.head_dim * causal_pairs(q, cached_tokens) / t / 1e12,
                    m.c_str());
    }
  }
  r.samples = gpu::time_launches([&](int) { run(&reg_, out.as<bf16>()); }, s_, timer(1));
  r.flops = 4.0 * c_.n_heads * c_.head_dim * causal_pairs(q, cached_tokens);
  r.bytes = 3.0 * qe * 2 + 2.0 * double(kv) * c_.n_kv_heads * c_.head_dim * 2;
  std::printf("    %s: %.0f TFLOP/s%s%s%s\n", r.variant.c_str(), r.flops / r.samples.p50 / 1e12,
              r.fallback.empty()
                  ? ""
                  : str(", generic %.0f TFLOP/s", r.flops / r.fallback_time_s / 1e12).c_str(),
              r.note.empty() ? "" : "; ", r.note.c_str());
  return finish(r);
}

const KernelResult& KernelBench::attn_decode(int batch, int ctx) {
  const std::string shape = str("batch %d at context %d", batch, ctx);
  if (auto* r = cached("attn_decode", "", shape)) return *r;
  const int bps = (ctx + kPage - 1) / kPage;  // blocks per sequence
  const int64_t page_elems = int64_t(c_.n_kv_heads) * kPage * c_.head_dim;
  const double kv_bytes = 2.0 * double(batch) * ctx * c_.n_kv_heads * c_.head_dim * 2;
  const int rot = rotations(kv_bytes);
  const int64_t n_blocks = int64_t(rot) * batch * bps;
  DevBuf kc(size_t(n_blocks * page_elems * 2), "decode K"),
      vc(size_t(n_blocks * page_elems * 2), "decode V");
  gpu::fill_normal_bf16(kc.as<bf16>(), n_blocks * page_elems, seed_++, 0.f, 1.f, s_);
  gpu::fill_normal_bf16(vc.as<bf16>(), n_blocks * page_elems, seed_++, 0.f, 1.f, s_);
  std::vector<int32_t> table(static_cast<size_t>(n_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(9));
  const int64_t qe = int64_t(batch) * c_.n_heads * c_.head_dim;  // one rotation set
  DevBuf qb(size_t(qe * rot * 2), "decode q"), gate(size_t(qe * rot * 2), "decode gate"),
      out(size_t(qe * rot * 2), "decode out"), out2(size_t(qe * 2), "decode out (fallback)");
  gpu::fill_normal_bf16(qb.as<bf16>(), qe * rot, seed_++, 0.f, 1.f, s_);
  gpu::fill_normal_bf16(gate.as<bf16>(), qe * rot, seed_++, 0.f, 1.f, s_);
  std::vector<int32_t> qs(batch), ql(batch, 1), kl(batch, ctx);
  std::iota(qs.begin(), qs.end(), 0);
  DevBuf d_qs = dev_ints(qs, s_), d_ql = dev_ints(ql, s_), d_kl = dev_ints(kl, s_),
         d_bt = dev_ints(table, s_);
  const int kv_chunk =
      cuda::attention_decode_kv_chunk(batch, c_.n_kv_heads, ctx, n_sms_, kMaxSplits);
  const int n_splits = (ctx + kv_chunk - 1) / kv_chunk;
  DevBuf ws(cuda::attention_decode_workspace_bytes(attn_, batch, kMaxSplits), "decode partials");
  const int a_splits = cuda::attention_decode_adaptive_splits(batch, c_.n_kv_heads, n_sms_, 64);
  auto batch_for = [&](int k) {
    cuda::AttnBatch b;
    b.n_seqs = batch;
    b.q_start = d_qs.as<int32_t>();
    b.q_len = d_ql.as<int32_t>();
    b.kv_len = d_kl.as<int32_t>();
    b.block_table = d_bt.as<int32_t>() + int64_t(k) * batch * bps;
    b.block_table_stride = bps;
    b.max_q_len = 1;
    b.max_kv_len = ctx;
    return b;
  };
  auto gate_for = [&](int k) {
    cuda::AttnGate g;
    if (attn_.gated) g = {gate.as<bf16>() + k * qe, int64_t(c_.n_heads) * c_.head_dim, c_.head_dim};
    return g;
  };
  KernelResult r;
  r.family = "attn_decode";
  const cuda::ShapeKey key = reg_.key(c_.head_dim, c_.n_heads / c_.n_kv_heads, batch, ctx);
  r.variant = variant(cuda::KernelFamily::kAttnDecode, key);
  r.shape = shape;
  const bool split = r.variant == "split_kv_mma" || r.variant == "split_kv";
  // The row times what the engine runs: split_kv_mma with the adaptive splits unless
  // $DS_ATTN_DECODE=planned (launched plainly here: its PDL gain needs the kernel before it, see
  // cuda_attention_decode_test Timing and bench decode); the note gives the other split.
  const bool adaptive = r.variant == "split_kv_mma" &&
                        cuda::attention_decode_mode() != cuda::AttnDecodeMode::kPlanned;
  cuda::AttnDecodeLaunch how_adaptive;
  how_adaptive.which = cuda::AttnDecodeKernel::kMma;
  how_adaptive.split = cuda::AttnDecodeSplit::kAdaptive;
  auto run_planned = [&](int k, bf16* o) {
    cuda::launch_attention_decode(attn_, batch_for(k), qb.as<bf16>() + k * qe, kc.as<bf16>(),
                                  vc.as<bf16>(), gate_for(k), kv_chunk, n_splits, ws.as<void>(), o,
                                  s_);
  };
  auto run_adaptive = [&](int k, bf16* o) {
    cuda::launch_attention_decode(attn_, batch_for(k), qb.as<bf16>() + k * qe, kc.as<bf16>(),
                                  vc.as<bf16>(), gate_for(k), 64, a_splits, ws.as<void>(), o, s_,
                                  how_adaptive);
  };
  auto run_split = [&](int k, bf16* o) { adaptive ? run_adaptive(k, o) : run_planned(k, o); };
  auto run_generic = [&](int k, bf16* o) {
    cuda::launch_attention_prefill(attn_, batch_for(k), qb.as<bf16>() + k * qe, kc.as<bf16>(),
                                   vc.as<bf16>(), gate_for(k), o, s_);
  };
  if (split) {
    run_split(0, out.as<bf16>());
    run_generic(0, out2.as<bf16>());
    r.match = gpu::compare_bf16(out.as<bf16>(), out2.as<bf16>(), qe, s_).text();
    r.fallback = "prefill_kernel";
    r.fallback_time_s =
        gpu::time_launches([&](int i) { run_generic(i % rot, out.as<bf16>() + (i % rot) * qe); },
                           s_, timer(rot))
            .p50;
    r.samples = gpu::time_launches(
        [&](int i) { run_split(i % rot, out.as<bf16>() + (i % rot) * qe); }, s_, timer(rot));
    r.note = adaptive ? str("adaptive: at most %d splits of >= 64 keys", a_splits)
                      : str("planned: kv_chunk %d, %d splits", kv_chunk, n_splits);
    // The first (SIMT) split kernel on the same inputs, for the speed-up of the mma kernel.
    if (cuda::attention_decode_mma_supported(attn_)) {
      auto run_simt = [&](int i) {
        const int k = i % rot;
        cuda::launch_attention_decode(attn_, batch_for(k), qb.as<bf16>() + k * qe, kc.as<bf16>(),
                                      vc.as<bf16>(), gate_for(k), kv_chunk, n_splits,
                                      ws.as<void>(), out.as<bf16>() + k * qe, s_,
                                      cuda::AttnDecodeKernel::kSimt);
      };
      const double t_simt = gpu::time_launches(run_simt, s_, timer(rot)).p50;
      r.note += str("; split kernel mma (simt: %.1f us, %.0f GB/s)", t_simt * 1e6,
                    kv_bytes / t_simt * 1e-9);
      // The other split on the same inputs (the row's is the engine's), outputs compared.
      auto run_other = [&](int k, bf16* o) { adaptive ? run_planned(k, o) : run_adaptive(k, o); };
      run_other(0, out2.as<bf16>());
      run_split(0, out.as<bf16>());
      const std::string o_match =
          gpu::compare_bf16(out2.as<bf16>(), out.as<bf16>(), qe, s_).text();
      const double t_o =
          gpu::time_launches([&](int i) { run_other(i % rot, out.as<bf16>() + (i % rot) * qe); },
                             s_, timer(rot))
              .p50;
      r.note += str("; %s %.1f us, %.0f GB/s (vs the row: %s)",
                    adaptive ? str("planned (kv_chunk %d, %d splits)", kv_chunk, n_splits).c_str()
                             : str("adaptive (<= %d splits)", a_splits).c_str(),
                    t_o * 1e6, kv_bytes / t_o * 1e-9, o_match.c_str());
    }
  } else {
    r.samples = gpu::time_launches(
        [&](int i) { run_generic(i % rot, out.as<bf16>() + (i % rot) * qe); }, s_, timer(rot));
  }
  r.flops = 4.0 * c_.n_heads * c_.head_dim * double(batch) * ctx;
  r.bytes = kv_bytes + 3.0 * qe * 2;
  if (!r.note.empty()) std::printf("    attn_decode %s: %s\n", shape.c_str(), r.note.c_str());
  return finish(r);
}

// The GDN layer's inputs for `n_slots` state slots: random projection rows, small weights in
// their natural ranges, random initial states.
struct GdnInputs {
  DevBuf proj, conv_w, a_log, dt_bias, norm_w, conv_state, rec_state;
  cuda::GdnLayerWeights w;
  cuda::GdnStatePool pool;
};

GdnInputs make_gdn_inputs(const cuda::GdnShape& g, int64_t n_rows, int n_slots, uint64_t& seed,
                          cudaStream_t s) {
  GdnInputs in;
  const int64_t conv_slot = 4 * int64_t(g.qkv_dim()),
                rec_slot = int64_t(g.n_v_heads) * g.d_v * g.d_k;
  in.proj = DevBuf(size_t(n_rows) * g.in_dim() * 2, "gdn proj");
  in.conv_w = DevBuf(size_t(g.qkv_dim()) * g.conv_kernel * 2, "gdn conv_w");
  in.a_log = DevBuf(size_t(g.n_v_heads) * 4, "gdn A_log");
  in.dt_bias = DevBuf(size_t(g.n_v_heads) * 4, "gdn dt_bias");
  in.norm_w = DevBuf(size_t(g.d_v) * 2, "gdn norm_w");
  in.conv_state = DevBuf(size_t(conv_slot) * n_slots * 2, "gdn conv state");
  in.rec_state = DevBuf(size_t(rec_slot) * n_slots * 4, "gdn state");
  gpu::fill_normal_bf16(in.proj.as<bf16>(), n_rows * g.in_dim(), seed++, 0.f, 1.f, s);
  gpu::fill_normal_bf16(in.conv_w.as<bf16>(), int64_t(g.qkv_dim()) * g.conv_kernel, seed++, 0.f,
                        0.5f, s);
  gpu::fill_uniform_f32(in.a_log.as<float>(), g.n_v_heads, seed++, 0.f, 2.7f, s);  // A in [1, 15]
  gpu::fill_uniform_f32(in.dt_bias.as<float>(), g.n_v_heads, seed++, -2.f, 1.f, s);
  gpu::fill_normal_bf16(in.norm_w.as<bf16>(), g.d_v, seed++, 1.f, 0.1f, s);
  gpu::fill_normal_bf16(in.conv_state.as<bf16>(), conv_slot * n_slots, seed++, 0.f, 1.f, s);
  gpu::fill_normal_f32(in.rec_state.as<float>(), rec_slot * n_slots, seed++, 0.f, 0.05f, s);
  in.w = {in.conv_w.as<bf16>(), in.a_log.as<float>(), in.dt_bias.as<float>(), in.norm_w.as<bf16>()};
  in.pool = {in.conv_state.as<bf16>(), in.rec_state.as<float>(), conv_slot, rec_slot};
  return in;
}

const KernelResult& KernelBench::gdn_prefill(int n_tokens, int seq_pos) {
  const std::string shape =
      str("%d tokens after %d (state %s)", n_tokens, seq_pos, seq_pos ? "carried" : "fresh");
  if (auto* r = cached("gdn_prefill", "", shape)) return *r;
  const double state = double(gdn_.n_v_heads) * gdn_.d_v * gdn_.d_k * 4;
  const double set_bytes = double(n_tokens) * gdn_.in_dim() * 2 + state;
  const int rot = rotations(set_bytes);
  GdnInputs in = make_gdn_inputs(gdn_, int64_t(n_tokens) * rot, rot, seed_, s_);
  DevBuf out(size_t(n_tokens) * gdn_.out_dim() * 2, "gdn out");
  const size_t ws_bytes = cuda::gdn_prefill_workspace_bytes(gdn_, n_tokens, 1);
  DevBuf ws(ws_bytes, "gdn workspace");
  std::vector<DevBuf> slot_ids;
  for (int k = 0; k < rot; ++k) slot_ids.push_back(dev_ints({k}, s_));
  DevBuf cu = dev_ints({0, n_tokens}, s_), pos = dev_ints({seq_pos}, s_);
  KernelResult r;
  r.family = "gdn_prefill";
  r.variant = variant(cuda::KernelFamily::kGdnPrefill, reg_.key(gdn_.d_k, gdn_.d_v, n_tokens, 1));
  r.shape = shape;
  // The engine's path (registry) and, when that is a specialised variant, the path it replaces:
  // the one picked with it switched off (slice_scan_ov -> slice_scan_cs), else the generic kernels.
  cuda::DispatchRegistry prev_reg = reg_;
  for (const cuda::KernelVariant& kv : reg_.variants())
    if (kv.family == cuda::KernelFamily::kGdnPrefill && kv.name == r.variant)
      prev_reg.set_enabled(kv.full_name(), false);
  const std::string prev =
      prev_reg.select(cuda::KernelFamily::kGdnPrefill, reg_.key(gdn_.d_k, gdn_.d_v, n_tokens, 1))
          .name;
  const cuda::DispatchRegistry* fallback_reg = prev != "chunked" ? &prev_reg : nullptr;
  auto run = [&](const cuda::DispatchRegistry* reg, const cuda::GdnStatePool& pool, int k,
                 bf16* o) {
    cuda::launch_gdn_prefill(gdn_, in.w, pool,
                             in.proj.as<bf16>() + int64_t(k) * n_tokens * gdn_.in_dim(),
                             cu.as<int32_t>(), pos.as<int32_t>(), slot_ids[k].as<int32_t>(), 1,
                             n_tokens, ws.as<void>(), ws_bytes, o, s_, reg);
  };
  if (r.variant != "chunked") {
    // Same inputs and initial state (slot 0) through both paths; compare y and the new state.
    DevBuf conv2(in.conv_state.bytes(), "gdn conv state copy"),
        rec2(in.rec_state.bytes(), "gdn state copy");
    gpu::check(cudaMemcpyAsync(conv2.as<void>(), in.conv_state.as<void>(), in.conv_state.bytes(),
                               cudaMemcpyDeviceToDevice, s_),
               "copy");
    gpu::check(cudaMemcpyAsync(rec2.as<void>(), in.rec_state.as<void>(), in.rec_state.bytes(),
                               cudaMemcpyDeviceToDevice, s_),
               "copy");
    cuda::GdnStatePool p2 = in.pool;
    p2.conv_state = conv2.as<bf16>();
    p2.rec_state = rec2.as<float>();
    DevBuf out2(size_t(n_tokens) * gdn_.out_dim() * 2, "gdn out (fallback)");
    run(&reg_, in.pool, 0, out.as<bf16>());
    run(fallback_reg, p2, 0, out2.as<bf16>());
    const gpu::Diff dy = gpu::compare_bf16(out.as<bf16>(), out2.as<bf16>(),
                                           int64_t(n_tokens) * gdn_.out_dim(), s_);
    const gpu::Diff ds =
        gpu::compare_f32(in.rec_state.as<float>(), rec2.as<float>(),
                         int64_t(gdn_.n_v_heads) * gdn_.d_v * gdn_.d_k, s_);
    r.match = "y: " + dy.text() + "; state: " + ds.text();
    r.fallback = fallback_reg ? prev : "chunked";
    r.fallback_time_s =
        gpu::time_launches([&](int i) { run(fallback_reg, in.pool, i % rot, out.as<bf16>()); }, s_,
                           timer(rot))
            .p50;
  }
  r.samples = gpu::time_launches([&](int i) { run(&reg_, in.pool, i % rot, out.as<bf16>()); },
                                 s_, timer(rot));
  const double ring = 4.0 * gdn_.qkv_dim() * 2;
  r.bytes =
      double(n_tokens) * (gdn_.in_dim() + gdn_.out_dim()) * 2 + (seq_pos ? 2 : 1) * (state + ring);
  r.flops = gdn_layer_flops(c_, n_tokens);
  return finish(r);
}

const KernelResult& KernelBench::gdn_decode(int batch) {
  const std::string shape = str("batch %d (1 token each)", batch);
  if (auto* r = cached("gdn_decode", "", shape)) return *r;
  const double state = double(gdn_.n_v_heads) * gdn_.d_v * gdn_.d_k * 4;
  const double ring = 4.0 * gdn_.qkv_dim() * 2;
  const int rot = rotations(batch * (state + ring));
  const int n_slots = rot * batch;
  GdnInputs a = make_gdn_inputs(gdn_, n_slots, n_slots, seed_, s_);
  DevBuf out(size_t(n_slots) * gdn_.out_dim() * 2, "gdn decode out");
  std::vector<DevBuf> slot_ids;
  for (int k = 0; k < rot; ++k) {
    std::vector<int32_t> ids(batch);
    std::iota(ids.begin(), ids.end(), k * batch);
    slot_ids.push_back(dev_ints(ids, s_));
  }
  DevBuf pos = dev_ints(std::vector<int32_t>(batch, 4096), s_);
  KernelResult r;
  r.family = "gdn_decode";
  const cuda::ShapeKey key = reg_.key(gdn_.d_k, gdn_.d_v, batch);
  r.variant = variant(cuda::KernelFamily::kGdnDecode, key);
  r.shape = shape;
  auto run_fused_with = [&](int k, bf16* o, cuda::GdnDecodeKernel which) {
    cuda::launch_gdn_decode(gdn_, a.w, a.pool,
                            a.proj.as<bf16>() + int64_t(k) * batch * gdn_.in_dim(),
                            pos.as<int32_t>(), slot_ids[k].as<int32_t>(), batch, o, s_, which);
  };
  // The kernel the engine runs for this variant (kAuto when it is not a fused one).
  cuda::GdnDecodeKernel engine_kernel = cuda::GdnDecodeKernel::kAuto;
  const bool fused_variant = cuda::gdn_decode_kernel_for_variant(r.variant, &engine_kernel);
  auto run_fused = [&](int k, bf16* o) { run_fused_with(k, o, engine_kernel); };
  // Every fused kernel at this batch (new vs old in one run): the cluster splits, the streaming
  // kernel (4-chunk ring, and its whole-head-in-flight variant), its persistent one-wave grids
  // (4- / 8-chunk ring across units) and the split streaming kernels (a head's rows over 2 / 4
  // blocks).
  {
    const auto t_of = [&](cuda::GdnDecodeKernel which) {
      return gpu::time_launches(
                 [&](int i) {
                   const int k = i % rot;
                   run_fused_with(k, out.as<bf16>() + int64_t(k) * batch * gdn_.out_dim(), which);
                 },
                 s_, timer(rot))
          .p50;
    };
    const double bytes = 2.0 * state * batch;
    std::string note = "fused us (state TB/s):";
    const auto add = [&](const char* name, cuda::GdnDecodeKernel which) {
      const double t = t_of(which);
      note += str(" %s %.2f (%.2f)", name, t * 1e6, bytes / t * 1e-12);
    };
    if (cuda::gdn_decode_cluster8_supported(gdn_))
      add("cluster8", cuda::GdnDecodeKernel::kCluster8);
    add("cluster4", cuda::GdnDecodeKernel::kCluster4);
    if (cuda::gdn_decode_stream_supported(gdn_, a.pool)) {
      add("stream", cuda::GdnDecodeKernel::kStream);
      add("stream_whole", cuda::GdnDecodeKernel::kStreamWhole);
      add("persist", cuda::GdnDecodeKernel::kPersist);
      add("persist_deep", cuda::GdnDecodeKernel::kPersistDeep);
    }
    if (cuda::gdn_decode_split_supported(gdn_, a.pool, 2))
      add("split2", cuda::GdnDecodeKernel::kSplit2);
    if (cuda::gdn_decode_split_supported(gdn_, a.pool, 4))
      add("split4", cuda::GdnDecodeKernel::kSplit4);
    r.note = note;
  }
  // The generic path: the prompt kernels with one token per sequence.
  std::vector<int32_t> cu_h(batch + 1);
  std::iota(cu_h.begin(), cu_h.end(), 0);
  DevBuf cu = dev_ints(cu_h, s_);
  const size_t ws_bytes = cuda::gdn_prefill_workspace_bytes(gdn_, batch, batch);
  DevBuf ws(ws_bytes, "gdn workspace");
  auto run_generic = [&](const cuda::GdnStatePool& pool, int k, bf16* o) {
    cuda::launch_gdn_prefill(
        gdn_, a.w, pool, a.proj.as<bf16>() + int64_t(k) * batch * gdn_.in_dim(), cu.as<int32_t>(),
        pos.as<int32_t>(), slot_ids[k].as<int32_t>(), batch, batch, ws.as<void>(), ws_bytes, o, s_);
  };
  if (fused_variant) {
    // Same inputs and initial states through both paths; compare outputs and new states.
    DevBuf conv2(a.conv_state.bytes(), "gdn conv state copy"),
        rec2(a.rec_state.bytes(), "gdn state copy");
    gpu::check(cudaMemcpyAsync(conv2.as<void>(), a.conv_state.as<void>(), a.conv_state.bytes(),
                               cudaMemcpyDeviceToDevice, s_),
               "copy");
    gpu::check(cudaMemcpyAsync(rec2.as<void>(), a.rec_state.as<void>(), a.rec_state.bytes(),
                               cudaMemcpyDeviceToDevice, s_),
               "copy");
    cuda::GdnStatePool p2 = a.pool;
    p2.conv_state = conv2.as<bf16>();
    p2.rec_state = rec2.as<float>();
    DevBuf out2(size_t(batch) * gdn_.out_dim() * 2, "gdn decode out (fallback)");
    run_fused(0, out.as<bf16>());
    run_generic(p2, 0, out2.as<bf16>());
    const gpu::Diff dy =
        gpu::compare_bf16(out.as<bf16>(), out2.as<bf16>(), int64_t(batch) * gdn_.out_dim(), s_);
    const gpu::Diff ds =
        gpu::compare_f32(a.rec_state.as<float>(), rec2.as<float>(),
                         int64_t(batch) * gdn_.n_v_heads * gdn_.d_v * gdn_.d_k, s_);
    r.match = "y: " + dy.text() + "; state: " + ds.text();
    r.fallback = "prefill_path";
    r.fallback_time_s =
        gpu::time_launches(
            [&](int i) {
              run_generic(a.pool, i % rot,
                          out.as<bf16>() + int64_t(i % rot) * batch * gdn_.out_dim());
            },
            s_, timer(rot))
            .p50;
    r.samples = gpu::time_launches(
        [&](int i) {
          run_fused(i % rot, out.as<bf16>() + int64_t(i % rot) * batch * gdn_.out_dim());
        },
        s_, timer(rot));
  } else {
    r.samples = gpu::time_launches(
        [&](int i) {
          run_generic(a.pool, i % rot, out.as<bf16>() + int64_t(i % rot) * batch * gdn_.out_dim());
        },
        s_, timer(rot));
  }
  r.bytes = batch * (2 * (state + ring) + double(gdn_.in_dim() + gdn_.out_dim()) * 2);
  r.flops = batch * double(gdn_.n_v_heads) * gdn_.d_k * gdn_.d_v * 6;  // decay+update+readout
  return finish(r);
}

const KernelResult& KernelBench::rmsnorm(int n) {
  const std::string shape = str("%d rows x %d", n, c_.d_model);
  if (auto* r = cached("rmsnorm", "", shape)) return *r;
  const int64_t e = int64_t(n) * c_.d_model;
  const int rot = rotations(4.0 * e * 2);
  DevBuf h(size_t(e * rot * 2), "norm residual"), dl(size_t(e * rot * 2), "norm delta"),
      o(size_t(e * rot * 2), "norm out"), w(size_t(c_.d_model) * 2, "norm w");
  gpu::fill_normal_bf16(h.as<bf16>(), e * rot, seed_++, 0.f, 1.f, s_);
  gpu::fill_normal_bf16(dl.as<bf16>(), e * rot, seed_++, 0.f, 1e-3f, s_);  // small: h stays bounded
  gpu::fill_normal_bf16(w.as<bf16>(), c_.d_model, seed_++, 0.f, 0.1f, s_);
  KernelResult r;
  r.family = "rmsnorm";
  r.variant = variant(cuda::KernelFamily::kRmsNorm, reg_.key(c_.d_model));
  r.shape = shape;
  r.samples = gpu::time_launches(
      [&](int i) {
        const int64_t off = (i % rot) * e;
        cuda::launch_add_rmsnorm(h.as<bf16>() + off, dl.as<bf16>() + off, w.as<bf16>(), n,
                                 c_.d_model, c_.rms_norm_eps, 1.f, o.as<bf16>() + off, s_);
      },
      s_, timer(rot));
  r.bytes = 4.0 * e * 2;
  r.flops = 4.0 * e;
  return finish(r);
}

const KernelResult& KernelBench::silu_mul(int n) {
  const std::string shape = str("%d rows x %d", n, c_.d_ff);
  if (auto* r = cached("silu_mul", "", shape)) return *r;
  const int64_t e = int64_t(n) * c_.d_ff;
  const int rot = rotations(3.0 * e * 2);
  DevBuf gu(size_t(2 * e * rot * 2), "silu gu"), o(size_t(e * rot * 2), "silu out");
  gpu::fill_normal_bf16(gu.as<bf16>(), 2 * e * rot, seed_++, 0.f, 1.f, s_);
  KernelResult r;
  r.family = "silu_mul";
  r.variant = variant(cuda::KernelFamily::kSiluMul, reg_.key(c_.d_ff));
  r.shape = shape;
  r.samples = gpu::time_launches(
      [&](int i) {
        const int k = i % rot;
        cuda::launch_silu_mul(gu.as<bf16>() + 2 * e * k, n, c_.d_ff, o.as<bf16>() + e * k, s_);
      },
      s_, timer(rot));
  r.bytes = 3.0 * e * 2;
  r.flops = 5.0 * e;
  return finish(r);
}

const KernelResult& KernelBench::rope_kv(int n) {
  const std::string shape = str("%d tokens", n);
  if (auto* r = cached("rope_kv", "", shape)) return *r;
  const int qkv_dim = attn_.qkv_dim();
  const int64_t qe = int64_t(n) * c_.n_heads * c_.head_dim;
  const double set_bytes = double(n) * qkv_dim * 2 + qe * 2 + 2.0 * n * attn_.kv_dim() * 2;
  const int rot = rotations(set_bytes);
  const int n_blocks = (n * rot + kPage - 1) / kPage;
  const int64_t page_elems = int64_t(c_.n_kv_heads) * kPage * c_.head_dim;
  DevBuf qkv(size_t(n) * qkv_dim * rot * 2, "rope qkv"), q(size_t(qe * rot * 2), "rope q"),
      kc(size_t(n_blocks * page_elems * 2), "rope K"),
      vc(size_t(n_blocks * page_elems * 2), "rope V"), qn(size_t(c_.head_dim) * 2, "q_norm"),
      kn(size_t(c_.head_dim) * 2, "k_norm");
  gpu::fill_normal_bf16(qkv.as<bf16>(), int64_t(n) * qkv_dim * rot, seed_++, 0.f, 1.f, s_);
  gpu::fill_normal_bf16(qn.as<bf16>(), c_.head_dim, seed_++, 0.f, 0.1f, s_);
  gpu::fill_normal_bf16(kn.as<bf16>(), c_.head_dim, seed_++, 0.f, 0.1f, s_);
  std::vector<int32_t> pos(size_t(n) * rot), slots(size_t(n) * rot);
  for (int64_t t = 0; t < int64_t(n) * rot; ++t) {
    pos[t] = static_cast<int32_t>(4096 + t % n);
    slots[t] = static_cast<int32_t>(t);
  }
  DevBuf d_pos = dev_ints(pos, s_), d_slots = dev_ints(slots, s_);
  KernelResult r;
  r.family = "rope_kv";
  r.variant = variant(cuda::KernelFamily::kRopeKv, reg_.key(c_.head_dim, c_.rotary_dim, n));
  r.shape = shape;
  // The engine's kernel for this many tokens (kernels.h RopeKvKernel) and the other one.
  const bool warp_ok = cuda::qk_norm_rope_kv_warp_supported(attn_);
  // token_table is timed against block_per_token ("fused"), the kernel it replaced on prompts.
  const cuda::RopeKvKernel chosen =
      !warp_ok                          ? cuda::RopeKvKernel::kBlockPerToken
      : r.variant == "warp_per_head"    ? cuda::RopeKvKernel::kAuto
      : r.variant == "token_table"      ? cuda::RopeKvKernel::kTokenTable
                                        : cuda::RopeKvKernel::kBlockPerToken;
  const cuda::RopeKvKernel other = chosen == cuda::RopeKvKernel::kBlockPerToken
                                       ? cuda::RopeKvKernel::kAuto
                                       : cuda::RopeKvKernel::kBlockPerToken;
  auto run = [&](int k, bf16* qo, cuda::RopeKvKernel which) {
    cuda::launch_qk_norm_rope_kv(attn_, qkv.as<bf16>() + int64_t(k) * n * qkv_dim, qn.as<bf16>(),
                                 kn.as<bf16>(), d_pos.as<int32_t>() + int64_t(k) * n,
                                 d_slots.as<int32_t>() + int64_t(k) * n, n, qo, kc.as<bf16>(),
                                 vc.as<bf16>(), s_, which);
  };
  if (warp_ok) {  // time the other kernel too (for the fallback column or the rejected variant)
    DevBuf q2(size_t(qe * 2), "rope q (other kernel)");
    run(0, q.as<bf16>(), chosen);
    run(0, q2.as<bf16>(), other);
    r.match = gpu::compare_bf16(q.as<bf16>(), q2.as<bf16>(), qe, s_).text();
    r.fallback = other == cuda::RopeKvKernel::kAuto ? "warp_per_head (not picked here)" : "fused";
    r.fallback_time_s =
        gpu::time_launches([&](int i) { run(i % rot, q.as<bf16>() + (i % rot) * qe, other); }, s_,
                           timer(rot))
            .p50;
  }
  r.samples = gpu::time_launches(
      [&](int i) { run(i % rot, q.as<bf16>() + (i % rot) * qe, chosen); }, s_, timer(rot));
  r.bytes = set_bytes;
  r.flops = double(n) * qkv_dim * 8;
  return finish(r);
}

const KernelResult& KernelBench::gather(int n, int d, const std::string& opname) {
  const std::string shape = str("%d rows x %d", n, d);
  if (auto* r = cached("gather", opname, shape)) return *r;
  const int src_rows = 16384;  // the table size does not matter to a gather of n rows
  const int rot = rotations(2.0 * n * d * 2);
  DevBuf src(size_t(src_rows) * d * 2, "gather src"), out(size_t(n) * d * rot * 2, "gather out");
  gpu::fill_normal_bf16(src.as<bf16>(), int64_t(src_rows) * d, seed_++, 0.f, 1.f, s_);
  std::vector<int32_t> idx(size_t(n) * rot);
  std::mt19937 rng(3);
  for (auto& x : idx) x = static_cast<int32_t>(rng() % src_rows);
  DevBuf d_idx = dev_ints(idx, s_);
  KernelResult r;
  r.family = "gather";
  r.variant = "rows";
  r.op = opname;
  r.shape = shape;
  r.samples = gpu::time_launches(
      [&](int i) {
        const int k = i % rot;
        cuda::launch_gather_rows(src.as<bf16>(), d_idx.as<int32_t>() + int64_t(k) * n, n, d,
                                 out.as<bf16>() + int64_t(k) * n * d, s_);
      },
      s_, timer(rot));
  r.bytes = 2.0 * n * d * 2;
  r.flops = 0;
  return finish(r);
}

bool wanted(const KernelBenchOptions& o, const std::string& family) {
  if (o.only.empty()) return true;
  std::stringstream ss(o.only);
  std::string item;
  while (std::getline(ss, item, ','))
    if (item == family) return true;
  return false;
}

}  // namespace

std::vector<KernelResult> run_kernel_bench(const ModelConfig& c, const Ceilings& ceil,
                                           const KernelBenchOptions& opt) {
  KernelBench kb(c, ceil, opt);
  const std::vector<int> dec_batches = opt.quick ? std::vector<int>{1} : std::vector<int>{1, 4, 16};
  const std::vector<int> chunks =
      opt.quick ? std::vector<int>{4096} : std::vector<int>{4096, 3072, 512};
  const std::vector<int> cached_lens =
      opt.quick ? std::vector<int>{0, 32768} : std::vector<int>{0, 8192, 16384, 32768};
  const std::vector<int> contexts =
      opt.quick ? std::vector<int>{4096, 32768} : std::vector<int>{4096, 8192, 16384, 32768};
  std::printf("kernels (%s):\n", opt.quick ? "quick set" : "full set");
  // One failing case is recorded (time 0, note FAILED) and the others still run.
  auto guarded = [&](const std::string& family, const std::string& what,
                     const std::function<void()>& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      std::printf("  %s %s FAILED: %s\n", family.c_str(), what.c_str(), e.what());
      std::fflush(stdout);
      cudaGetLastError();
      KernelResult r;
      r.family = family;
      r.variant = "FAILED";
      r.shape = what;
      r.note = std::string("FAILED: ") + e.what();
      kb.results().push_back(r);
    }
  };
  auto S = [](int a, int b) { return std::to_string(a) + "/" + std::to_string(b); };
  if (wanted(opt, "gemm")) {
    for (const auto& o : kb.ops())
      for (int m : dec_batches)
        guarded("gemm", o.name + " m=" + std::to_string(m), [&] { kb.gemm(o.name, m); });
    for (const auto& o : kb.ops())
      if (!o.f32_out)
        for (int m : chunks)
          guarded("gemm", o.name + " m=" + std::to_string(m), [&] { kb.gemm(o.name, m); });
    // A/B of the decode kernels on the narrow outputs (gdn_out, attn_o, down: n = d_model; one
    // row set per distinct shape), at batch 1, 4, 8 and 16 also in the quick set.
    std::set<std::pair<int, int>> ab_done;
    for (const auto& o : kb.ops())
      if (o.n == c.d_model && o.k > c.d_model && ab_done.insert({o.n, o.k}).second)
        for (int m : {1, 2, 4, 8, 16})
          guarded("gemm", o.name + " m=" + std::to_string(m) + " A/B",
                  [&] { kb.gemm_narrow_ab(o.name, m); });
    guarded("gemm", "mlp m=1 A/B fused", [&] { kb.mlp_fused_ab(); });
    // A/B of the tensor-core bulk GEMV on every k <= 8192 decode projection (gdn_in, gdn_out,
    // attn_qkv, attn_o, gate_up on the 27B; one row set per distinct shape), batch 4, 8 and 16.
    std::set<std::pair<int, int>> mma_done;
    for (const auto& o : kb.ops())
      if (!o.f32_out && o.k >= 4096 && o.k <= 8192 && o.k % 64 == 0 &&
          mma_done.insert({o.n, o.k}).second)
        for (int m : {4, 8, 16})
          guarded("gemm", o.name + " m=" + std::to_string(m) + " A/B mma",
                  [&] { kb.gemm_mma_ab(o.name, m); });
  }
  if (c.n_full_layers() > 0 && wanted(opt, "attn_prefill")) {
    for (int q : chunks)
      for (int kv : cached_lens)
        guarded("attn_prefill", "q/cached " + S(q, kv), [&] { kb.attn_prefill(q, kv); });
    // One unchunked 16K causal prompt (issue 7's kernel target, the peers' shape) and short
    // chunks against a cache (speculative / small-chunk regime: at group 6, up to 21 tokens fill
    // one 128-row tile).
    if (!opt.quick) {
      guarded("attn_prefill", "q/cached " + S(16384, 0), [&] { kb.attn_prefill(16384, 0); });
      for (auto [q, kv] : {std::pair{16, 8192}, std::pair{4, 8192}, std::pair{10, 2048},
                           std::pair{21, 32768}, std::pair{64, 8192}})
        guarded("attn_prefill", "q/cached " + S(q, kv), [&] { kb.attn_prefill(q, kv); });
    }
  }
  if (c.n_full_layers() > 0 && wanted(opt, "attn_decode"))
    for (int b : dec_batches)
      for (int ctx : contexts)
        guarded("attn_decode", "batch/ctx " + S(b, ctx), [&] { kb.attn_decode(b, ctx); });
  if (c.n_linear_layers() > 0 && wanted(opt, "gdn_decode"))
    for (int b : opt.quick ? std::vector<int>{1} : std::vector<int>{1, 4, 8, 16})
      guarded("gdn_decode", "batch " + std::to_string(b), [&] { kb.gdn_decode(b); });
  if (c.n_linear_layers() > 0 && wanted(opt, "gdn_prefill")) {
    for (int t : opt.quick ? std::vector<int>{4096} : std::vector<int>{64, 512, 4096, 8192})
      guarded("gdn_prefill", "tokens/pos " + S(t, 8192), [&] { kb.gdn_prefill(t, 8192); });
    for (int t : opt.quick ? std::vector<int>{4096} : std::vector<int>{512, 4096, 8192})
      guarded("gdn_prefill", "tokens/pos " + S(t, 0), [&] { kb.gdn_prefill(t, 0); });
  }
  const std::vector<int> rows =
      opt.quick ? std::vector<int>{1, 4096} : std::vector<int>{1, 16, 4096};
  for (int n : rows) {
    const std::string w = std::to_string(n) + " rows";
    if (wanted(opt, "rmsnorm")) guarded("rmsnorm", w, [&] { kb.rmsnorm(n); });
    if (wanted(opt, "silu_mul")) guarded("silu_mul", w, [&] { kb.silu_mul(n); });
    if (c.n_full_layers() > 0 && wanted(opt, "rope_kv"))
      guarded("rope_kv", w, [&] { kb.rope_kv(n); });
    if (wanted(opt, "gather")) guarded("gather", w, [&] { kb.gather(n, c.d_model, "embedding"); });
  }
  return kb.results();
}

std::vector<Profile> run_profile(const ModelConfig& c, const Ceilings& ceil,
                                 const KernelBenchOptions& opt, int decode_batch,
                                 int64_t decode_context, int64_t prefill_chunk,
                                 int64_t prefill_cached, const std::vector<KernelResult>& prior) {
  KernelBench kb(c, ceil, opt);
  kb.seed_results(prior);
  std::printf("profile: timing the kernels of one decode step and one prefill chunk:\n");
  auto build = [&](bool decode) {
    Profile p;
    p.phase = decode ? "decode" : "prefill";
    const int T = decode ? decode_batch : static_cast<int>(prefill_chunk);
    p.shape = decode ? str("batch %d at context %lld", decode_batch,
                           static_cast<long long>(decode_context))
                     : str("chunk %lld after %lld cached", static_cast<long long>(prefill_chunk),
                           static_cast<long long>(prefill_cached));
    std::map<std::string, ProfileEntry> by;
    std::vector<std::string> order;
    auto add = [&](const std::string& cls, const KernelResult& r, int count) {
      if (!by.count(cls)) order.push_back(cls);
      ProfileEntry& e = by[cls];
      e.kernel = cls;
      e.launches += count;
      e.time_s += r.time_s * count;
      e.bytes += r.bytes * count;
      e.flops += r.flops * count;
    };
    const int n_lin = c.n_linear_layers(), n_full = c.n_full_layers();
    add("gather.embedding", kb.gather(T, c.d_model, "embedding"), 1);
    add("rmsnorm", kb.rmsnorm(T), 2 * c.n_layers + 1);
    if (n_lin) {
      add("gemm.gdn_in", kb.gemm("gdn_in", T), n_lin);
      if (decode)
        add("gdn_decode", kb.gdn_decode(T), n_lin);
      else
        add("gdn_prefill", kb.gdn_prefill(T, static_cast<int>(prefill_cached)), n_lin);
      add("gemm.gdn_out", kb.gemm("gdn_out", T), n_lin);
    }
    if (n_full) {
      add("gemm.attn_qkv", kb.gemm("attn_qkv", T), n_full);
      add("rope_kv", kb.rope_kv(T), n_full);
      if (decode)
        add("attn_decode", kb.attn_decode(T, static_cast<int>(decode_context)), n_full);
      else
        add("attn_prefill", kb.attn_prefill(T, static_cast<int>(prefill_cached)), n_full);
      add("gemm.attn_o", kb.gemm("attn_o", T), n_full);
    }
    add("gemm.gate_up", kb.gemm("gate_up", T), c.n_layers);
    add("silu_mul", kb.silu_mul(T), c.n_layers);
    add("gemm.down", kb.gemm("down", T), c.n_layers);
    const int rows = decode ? T : 1;
    add("gather.lm_rows", kb.gather(rows, c.d_model, "lm_rows"), 1);
    add("gemm.lm_head", kb.gemm("lm_head", rows), 1);
    for (const auto& k : order) p.kernel_sum_s += by[k].time_s;
    for (const auto& k : order) {
      ProfileEntry e = by[k];
      e.share = e.time_s / p.kernel_sum_s;
      p.entries.push_back(e);
    }
    std::sort(p.entries.begin(), p.entries.end(),
              [](const auto& a, const auto& b) { return a.time_s > b.time_s; });
    p.method =
        "sum of isolated kernel timings at the forward's shapes (CUDA-graph replays, inputs "
        "rotated past L2), "
        "times the launches per step; excludes launch gaps, host work and the logits copy";
    return p;
  };
  return {build(true), build(false)};
}

}  // namespace ds::bench
