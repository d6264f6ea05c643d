// GPU tests of the Gated DeltaNet kernels (src/cuda/gdn.h) against a plain fp32 CPU reference that
// runs the token-by-token recurrence of SPEC.md (the oracle): conv + SiLU, l2norm, gates, the
// delta rule, gated RMSNorm. Random inputs (fresh per case), outputs and untouched state poisoned
// with NaN before each run, normalised error ||gpu - ref|| / ||ref|| with per-kernel tolerances:
//  - prefill output y: 2e-2 (bf16 q/k/v, T, W, U, V_new and state snapshots, as FLA);
//  - prefill final state: 2e-2 (fp32 running state fed by bf16 products);
//  - decode output y: 1e-2 (fp32 throughout, bf16 output); decode state: 1e-4 (fp32);
//  - conv ring: exact (it stores the bf16 inputs).
// Shapes: Qwen3.5-27B (16 k heads, 48 v heads, d 128) at lengths 1, 63, 64, 65, 4095, 4097, several
// sequences of different lengths in one launch, carried state (prefill -> prefill -> decode), and
// small heads (d 16/32/64, d_k != d_v). The Timing test prints ms per layer (CUDA events, warm,
// median) next to PERF.md's targets, PrefillStageTiming the time of each prompt-path stage at
// 4096 tokens (sm 90); they assert nothing about speed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "cuda/cuda_common.h"
#include "cuda/dispatch.h"
#include "cuda/gdn.h"
#include "cuda/gdn_prefill_sm90.h"
#include "cuda_graph_timer.h"

namespace ds::cuda {
namespace {

#define CK(x) DS_CUDA_CHECK(x)

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

GdnShape shape_27b() { return GdnShape{16, 48, 128, 128, 4, 1e-6f}; }

// Host copy of one layer's weights (floats rounded through bf16 where the GPU keeps bf16).
struct HostLayer {
  std::vector<float> conv_w;          // [qkv_dim, 4]
  std::vector<float> A_log, dt_bias;  // [n_v]
  std::vector<float> norm_w;          // [d_v]
};

HostLayer make_layer(const GdnShape& s, std::mt19937& rng) {
  HostLayer l;
  std::uniform_real_distribution<float> u(-0.6f, 0.6f);
  std::normal_distribution<float> nd(0.f, 1.f);
  l.conv_w.resize(static_cast<size_t>(s.qkv_dim()) * 4);
  for (auto& x : l.conv_w) x = round_bf16(u(rng));
  l.A_log.resize(s.n_v_heads);
  l.dt_bias.resize(s.n_v_heads);
  // Decays from very slow (g ~ -0.005, long memory across chunks) to fast (g ~ -5).
  std::uniform_real_distribution<float> ua(std::log(0.01f), std::log(4.f)), ud(-3.f, 1.f);
  for (auto& x : l.A_log) x = ua(rng);
  for (auto& x : l.dt_bias) x = ud(rng);
  l.norm_w.resize(s.d_v);
  for (auto& x : l.norm_w) x = round_bf16(1.f + 0.2f * nd(rng));
  return l;
}

// Per-sequence host state (the oracle's own copy).
struct HostSeq {
  int pos = 0;              // tokens already in the sequence
  std::vector<float> hist;  // [3, qkv_dim] inputs at positions pos-3, pos-2, pos-1
  std::vector<float> S;     // [n_v, d_v, d_k]
};

HostSeq make_seq(const GdnShape& s, int pos, std::mt19937& rng) {
  HostSeq q;
  q.pos = pos;
  q.hist.assign(3 * static_cast<size_t>(s.qkv_dim()), 0.f);
  q.S.assign(static_cast<size_t>(s.n_v_heads) * s.d_v * s.d_k, 0.f);
  if (pos > 0) {
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int r = 0; r < 3; ++r) {
      if (pos - 3 + r < 0) continue;
      for (int c = 0; c < s.qkv_dim(); ++c) q.hist[r * s.qkv_dim() + c] = round_bf16(nd(rng));
    }
    for (auto& x : q.S) x = 0.3f * nd(rng);
  }
  return q;
}

std::vector<float> random_proj(const GdnShape& s, int n_tokens, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> p(static_cast<size_t>(n_tokens) * s.in_dim());
  for (auto& x : p) x = round_bf16(nd(rng));
  return p;
}

float silu_h(float x) { return x / (1.f + std::exp(-x)); }

// The host conv stage of the oracle (conv + SiLU + q/k l2norm, q times d_k^-0.5) for `len` rows
// of proj ([len, in_dim]) of sequence q: [len, qkv_dim].
std::vector<float> ref_conv(const GdnShape& s, const HostLayer& l, const float* proj, int len,
                            const HostSeq& q) {
  const int qd = s.qkv_dim(), in = s.in_dim(), dk = s.d_k;
  std::vector<float> c(static_cast<size_t>(len) * qd);
  auto input = [&](int i, int ch) -> float {
    if (i >= 0) return proj[static_cast<size_t>(i) * in + ch];
    if (q.pos + i < 0) return 0.f;
    return q.hist[(3 + i) * qd + ch];
  };
  for (int t = 0; t < len; ++t) {
    for (int ch = 0; ch < qd; ++ch) {
      float acc = 0.f;
      for (int j = 0; j < 4; ++j) acc += l.conv_w[ch * 4 + j] * input(t - 3 + j, ch);
      c[static_cast<size_t>(t) * qd + ch] = silu_h(acc);
    }
    for (int h = 0; h < 2 * s.n_k_heads; ++h) {
      float* v = &c[static_cast<size_t>(t) * qd + h * dk];
      double ss = 0;
      for (int i = 0; i < dk; ++i) ss += double(v[i]) * v[i];
      const float sc =
          1.f / std::sqrt(float(ss) + 1e-6f) * (h < s.n_k_heads ? 1.f / std::sqrt(float(dk)) : 1.f);
      for (int i = 0; i < dk; ++i) v[i] *= sc;
    }
  }
  return c;
}

// The oracle: runs `len` tokens (rows of proj, [len, in_dim]) through sequence `q`, token by
// token, in fp32. y: [len, out_dim] (raw o when norm is false).
void ref_gdn(const GdnShape& s, const HostLayer& l, const float* proj, int len, HostSeq& q,
             std::vector<float>& y, bool norm = true) {
  const int qd = s.qkv_dim(), in = s.in_dim(), nv = s.n_v_heads, dk = s.d_k, dv = s.d_v;
  const int ratio = s.n_v_heads / s.n_k_heads;
  // Conv + SiLU + l2norm for all tokens.
  const std::vector<float> c = ref_conv(s, l, proj, len, q);
  auto input = [&](int i, int ch) -> float {  // pre-conv input at token index i (< 0: history)
    if (i >= 0) return proj[static_cast<size_t>(i) * in + ch];
    const int pos = q.pos + i;
    if (pos < 0) return 0.f;
    return q.hist[(3 + i) * qd + ch];
  };
  // Recurrence, parallel over value heads.
  std::vector<float> o(static_cast<size_t>(len) * nv * dv);
  auto run_head = [&](int hv) {
    const int hk = hv / ratio;
    float* S = &q.S[static_cast<size_t>(hv) * dv * dk];
    for (int t = 0; t < len; ++t) {
      const float* row = proj + static_cast<size_t>(t) * in;
      const float b = row[qd + s.z_dim() + hv], a = row[qd + s.z_dim() + nv + hv] + l.dt_bias[hv];
      const float beta = 1.f / (1.f + std::exp(-b));
      const float sp = a > 20.f ? a : std::log1p(std::exp(a));
      const float decay = std::exp(-std::exp(l.A_log[hv]) * sp);
      const float* qq = &c[static_cast<size_t>(t) * qd + hk * dk];
      const float* kk = &c[static_cast<size_t>(t) * qd + s.n_k_heads * dk + hk * dk];
      const float* vv = &c[static_cast<size_t>(t) * qd + 2 * s.n_k_heads * dk + hv * dv];
      for (int v = 0; v < dv; ++v) {
        float* Sr = S + static_cast<size_t>(v) * dk;
        float u = 0.f;
        for (int k = 0; k < dk; ++k) {
          Sr[k] *= decay;
          u += Sr[k] * kk[k];
        }
        const float delta = beta * (vv[v] - u);
        float ov = 0.f;
        for (int k = 0; k < dk; ++k) {
          Sr[k] += kk[k] * delta;
          ov += Sr[k] * qq[k];
        }
        o[(static_cast<size_t>(t) * nv + hv) * dv + v] = ov;
      }
    }
  };
  {
    const int n_threads = std::max(1u, std::min(std::thread::hardware_concurrency(), 32u));
    std::vector<std::thread> pool;
    for (int th = 0; th < n_threads; ++th) {
      pool.emplace_back([&, th] {
        for (int hv = th; hv < nv; hv += n_threads) run_head(hv);
      });
    }
    for (auto& t : pool) t.join();
  }
  // Gated RMSNorm.
  y.assign(static_cast<size_t>(len) * nv * dv, 0.f);
  for (int t = 0; t < len; ++t) {
    for (int hv = 0; hv < nv; ++hv) {
      const float* ov = &o[(static_cast<size_t>(t) * nv + hv) * dv];
      float* yv = &y[(static_cast<size_t>(t) * nv + hv) * dv];
      if (!norm) {
        std::copy(ov, ov + dv, yv);
        continue;
      }
      double ss = 0;
      for (int i = 0; i < dv; ++i) ss += double(ov[i]) * ov[i];
      const float r = 1.f / std::sqrt(float(ss / dv) + s.norm_eps);
      const float* z = proj + static_cast<size_t>(t) * in + qd + hv * dv;
      for (int i = 0; i < dv; ++i) yv[i] = l.norm_w[i] * ov[i] * r * silu_h(z[i]);
    }
  }
  // Conv history: the last 3 inputs.
  std::vector<float> hist(3 * static_cast<size_t>(qd));
  for (int r = 0; r < 3; ++r)
    for (int ch = 0; ch < qd; ++ch) hist[r * qd + ch] = input(len - 3 + r, ch);
  q.hist = hist;
  q.pos += len;
}

struct Err {
  double norm = 0, max_abs = 0;
  bool nan = false;
};

Err compare(const std::vector<float>& got, const std::vector<float>& ref) {
  Err e;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) {
      e.nan = true;
      continue;
    }
    const double d = double(got[i]) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
    e.max_abs = std::max(e.max_abs, std::abs(d));
  }
  e.norm = std::sqrt(num / std::max(den, 1e-30));
  return e;
}

#define EXPECT_ERR(e, tol, what)                                                         \
  do {                                                                                   \
    EXPECT_FALSE((e).nan) << what << ": NaN/Inf (unwritten or broken output)";           \
    EXPECT_LT((e).norm, tol) << what << ": normalised error " << (e).norm << " max abs " \
                             << (e).max_abs;                                             \
  } while (0)

// Device buffers for one layer + a state pool.
template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  DevBuf() = default;
  explicit DevBuf(size_t count) : n(count) {
    CK(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr; }
  void poison() { CK(cudaMemset(p, 0xff, n * sizeof(T))); }  // NaN for bf16 and fp32
};

std::vector<bf16_t> to_bf16(const std::vector<float>& v) {
  std::vector<bf16_t> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = f32_to_bf16(v[i]);
  return r;
}

template <typename T, typename H>
void upload(DevBuf<T>& d, const std::vector<H>& h) {
  static_assert(sizeof(T) == sizeof(H));
  ASSERT_EQ(d.n, h.size());
  CK(cudaMemcpy(d.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

std::vector<float> download_bf16(const bf16* p, size_t n) {
  std::vector<bf16_t> h(n);
  CK(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = bf16_to_f32(h[i]);
  return r;
}

std::vector<float> download_f32(const float* p, size_t n) {
  std::vector<float> r(n);
  CK(cudaMemcpy(r.data(), p, n * 4, cudaMemcpyDeviceToHost));
  return r;
}

struct DevLayer {
  DevBuf<bf16> conv_w, norm_w;
  DevBuf<float> A_log, dt_bias;
  GdnLayerWeights w(bool norm = true) const {
    return GdnLayerWeights{conv_w.p, A_log.p, dt_bias.p, norm ? norm_w.p : nullptr};
  }
};

DevLayer upload_layer(const GdnShape& s, const HostLayer& l) {
  DevLayer d{DevBuf<bf16>(l.conv_w.size()), DevBuf<bf16>(l.norm_w.size()),
             DevBuf<float>(s.n_v_heads), DevBuf<float>(s.n_v_heads)};
  upload(d.conv_w, to_bf16(l.conv_w));
  upload(d.norm_w, to_bf16(l.norm_w));
  upload(d.A_log, l.A_log);
  upload(d.dt_bias, l.dt_bias);
  return d;
}

// A state pool of n_slots slots (strides padded a little, to check that strides are honoured).
struct DevPool {
  int64_t conv_stride, rec_stride;
  DevBuf<bf16> conv;
  DevBuf<float> rec;
  DevPool(const GdnShape& s, int n_slots)
      : conv_stride(4LL * s.qkv_dim() + 64),
        rec_stride(int64_t(s.n_v_heads) * s.d_v * s.d_k + 32),
        conv(size_t(conv_stride) * n_slots),
        rec(size_t(rec_stride) * n_slots) {
    conv.poison();
    rec.poison();
  }
  GdnStatePool pool() const { return GdnStatePool{conv.p, rec.p, conv_stride, rec_stride}; }
  // Writes a host sequence's state into slot `slot` (ring rows of positions pos-3..pos-1).
  void put(const GdnShape& s, int slot, const HostSeq& q) {
    if (q.pos == 0) return;  // the kernels must ignore the (poisoned) slot
    const int qd = s.qkv_dim();
    std::vector<bf16_t> ring(4 * size_t(qd), 0xffff);
    for (int r = 0; r < 3; ++r) {
      const int pos = q.pos - 3 + r;
      if (pos < 0) continue;
      for (int c = 0; c < qd; ++c) ring[(pos & 3) * qd + c] = f32_to_bf16(q.hist[r * qd + c]);
    }
    CK(cudaMemcpy(conv.p + slot * conv_stride, ring.data(), ring.size() * 2,
                  cudaMemcpyHostToDevice));
    CK(cudaMemcpy(rec.p + slot * rec_stride, q.S.data(), q.S.size() * 4, cudaMemcpyHostToDevice));
  }
  std::vector<float> state(const GdnShape& s, int slot) const {
    return download_f32(rec.p + slot * rec_stride, size_t(s.n_v_heads) * s.d_v * s.d_k);
  }
  // Ring rows of positions pos-3..pos-1 (>= 0) must hold the host history exactly.
  void expect_ring(const GdnShape& s, int slot, const HostSeq& q, const char* what) const {
    const int qd = s.qkv_dim();
    auto ring = download_bf16(conv.p + slot * conv_stride, 4 * size_t(qd));
    int bad = 0;
    for (int r = 0; r < 3; ++r) {
      const int pos = q.pos - 3 + r;
      if (pos < 0) continue;
      for (int c = 0; c < qd; ++c) bad += ring[(pos & 3) * qd + c] != q.hist[r * qd + c];
    }
    EXPECT_EQ(bad, 0) << what << ": conv ring differs from the last inputs";
  }
};

struct PrefillCase {
  std::vector<int> lens;
  std::vector<int> pos;  // tokens already in each sequence (carried state when > 0)
};

// The prefill variants to check: the generic kernels (no registry) and each specialised kGdnPrefill
// variant of the device's registry, forced for every d_k = d_v = 128 shape (its token threshold
// dropped, so that short and tail cases run it too; other head sizes take the generic fallback).
// engine_dispatch(): the registry as the engine has it.
struct PrefillVariant {
  std::string name;
  const DispatchRegistry* dispatch;
};
int device_sm() {
  int dev = 0, major = 0, minor = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  return major * 10 + minor;
}
const DispatchRegistry* engine_dispatch() {
  static const DispatchRegistry* reg =
      new DispatchRegistry(DispatchRegistry::with_defaults(device_sm()));
  return reg;
}
const std::vector<PrefillVariant>& prefill_variants() {
  static const std::vector<PrefillVariant> vars = [] {
    std::vector<PrefillVariant> v{{"generic", nullptr}};
    const ShapeKey probe = engine_dispatch()->key(128, 128, 1 << 20, 1);  // a long 27B prompt
    for (const KernelVariant& kv : engine_dispatch()->variants()) {
      if (kv.family != KernelFamily::kGdnPrefill || !kv.guard || !kv.enabled || !kv.guard(probe))
        continue;
      auto* reg = new DispatchRegistry();
      reg->add({KernelFamily::kGdnPrefill, kv.name, kv.description,
                [](const ShapeKey& k) { return k.dims[0] == 128 && k.dims[1] == 128; }});
      reg->add({KernelFamily::kGdnPrefill, "chunked", "generic", {}});
      v.push_back({kv.name, reg});
    }
    return v;
  }();
  return vars;
}

// Token offsets of the sequences of lengths lens: [0, lens[0], lens[0] + lens[1], ...].
std::vector<int> cu_seqlens(const std::vector<int>& lens) {
  std::vector<int> cu(lens.size() + 1, 0);
  for (size_t i = 0; i < lens.size(); ++i) cu[i + 1] = cu[i] + lens[i];
  return cu;
}

// Restores the process's GDN prompt forms ($DS_GDN_OUT / $DS_GDN_STATE choices) when a test that
// switches them ends, also when it ends by an exception.
struct GdnFormsRestore {
  GdnOutForm out = gdn_out_form();
  GdnStateForm state = gdn_state_form();
  ~GdnFormsRestore() {
    set_gdn_out_form(out);
    set_gdn_state_form(state);
  }
};

// A prompt batch on the device: proj [n_tokens, in_dim] (bf16), cu_seqlens [n_seqs + 1], positions
// and slots [n_seqs], the output [n_tokens, out_dim] and the prefill workspace; launch() runs
// launch_gdn_prefill on them.
struct DevPrefillBatch {
  int n_seqs, n_tokens;
  DevBuf<bf16> proj, out;
  DevBuf<int32_t> cu, pos, slots;
  size_t ws_bytes;
  DevBuf<unsigned char> ws;
  DevPrefillBatch(const GdnShape& s, const std::vector<float>& h_proj, const std::vector<int>& h_cu,
                  const std::vector<int>& h_pos, const std::vector<int>& h_slots)
      : n_seqs(static_cast<int>(h_slots.size())),
        n_tokens(h_cu.back()),
        proj(h_proj.size()),
        out(size_t(n_tokens) * s.out_dim()),
        cu(n_seqs + 1),
        pos(n_seqs),
        slots(n_seqs),
        ws_bytes(gdn_prefill_workspace_bytes(s, n_tokens, n_seqs)),
        ws(ws_bytes) {
    upload(proj, to_bf16(h_proj));
    upload(cu, h_cu);
    upload(pos, h_pos);
    upload(slots, h_slots);
  }
  void launch(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
              cudaStream_t st, const DispatchRegistry* reg) const {
    launch_gdn_prefill(s, w, pool, proj.p, cu.p, pos.p, slots.p, n_seqs, n_tokens, ws.p, ws_bytes,
                       out.p, st, reg);
  }
};

// Runs one prefill launch of several sequences against the oracle, once per variant (the same
// inputs and initial state); checks y, state and ring.
void check_prefill(const GdnShape& s, const PrefillCase& pc, uint32_t seed, double tol_y = 2e-2,
                   double tol_s = 2e-2, bool norm = true) {
  std::mt19937 rng(seed);
  const HostLayer hl = make_layer(s, rng);
  const DevLayer dl = upload_layer(s, hl);
  const int n_seqs = static_cast<int>(pc.lens.size());
  const std::vector<int> cu = cu_seqlens(pc.lens);
  std::vector<int> slots(n_seqs);
  for (int i = 0; i < n_seqs; ++i) slots[i] = 2 * (n_seqs - 1 - i) + 1;  // a scattered slot order
  const int n_tokens = cu[n_seqs];
  const auto proj = random_proj(s, n_tokens, rng);
  std::vector<HostSeq> init;
  for (int i = 0; i < n_seqs; ++i) init.push_back(make_seq(s, pc.pos[i], rng));
  // The oracle, once for all variants.
  std::vector<HostSeq> seqs = init;
  std::vector<std::vector<float>> ys(n_seqs);
  for (int i = 0; i < n_seqs; ++i)
    ref_gdn(s, hl, &proj[size_t(cu[i]) * s.in_dim()], pc.lens[i], seqs[i], ys[i], norm);

  DevPrefillBatch d(s, proj, cu, pc.pos, slots);
  for (const PrefillVariant& var : prefill_variants()) {
    std::printf(" variant %s\n", var.name.c_str());
    DevPool pool(s, 2 * n_seqs + 1);
    for (int i = 0; i < n_seqs; ++i) pool.put(s, slots[i], init[i]);
    d.ws.poison();
    d.out.poison();
    d.launch(s, dl.w(norm), pool.pool(), nullptr, var.dispatch);
    CK(cudaDeviceSynchronize());
    const auto out = download_bf16(d.out.p, d.out.n);
    for (int i = 0; i < n_seqs; ++i) {
      std::vector<float> got(out.begin() + size_t(cu[i]) * s.out_dim(),
                             out.begin() + size_t(cu[i + 1]) * s.out_dim());
      char what[160];
      std::snprintf(what, sizeof what, "[%s] seq %d (len %d, pos %d) y", var.name.c_str(), i,
                    pc.lens[i], pc.pos[i]);
      if (pc.lens[i] > 0) {
        const Err ey = compare(got, ys[i]);
        EXPECT_ERR(ey, tol_y, what);
        std::printf("  %-42s err %.2e (max abs %.2e)\n", what, ey.norm, ey.max_abs);
      }
      if (pc.lens[i] > 0 || pc.pos[i] > 0) {
        const Err es = compare(pool.state(s, slots[i]), seqs[i].S);
        std::snprintf(what, sizeof what, "[%s] seq %d (len %d, pos %d) state", var.name.c_str(), i,
                      pc.lens[i], pc.pos[i]);
        EXPECT_ERR(es, tol_s, what);
        std::printf("  %-42s err %.2e (max abs %.2e)\n", what, es.norm, es.max_abs);
        pool.expect_ring(s, slots[i], seqs[i], what);
      }
    }
    // Slots no sequence uses stay poisoned (nothing wrote outside its slot).
    auto untouched = download_f32(pool.rec.p, size_t(s.n_v_heads) * s.d_v * s.d_k);
    EXPECT_TRUE(
        std::all_of(untouched.begin(), untouched.end(), [](float x) { return std::isnan(x); }))
        << "[" << var.name << "] slot 0 (unused) was written";
  }
}

// A registry with one kGdnPrefill variant forced for every d_k = d_v = 128 shape (the generic
// kernels for the rest).
std::unique_ptr<DispatchRegistry> forced_gdn_registry(const char* name) {
  auto* reg = new DispatchRegistry();
  reg->add({KernelFamily::kGdnPrefill, name, name,
            [](const ShapeKey& k) { return k.dims[0] == 128 && k.dims[1] == 128; }});
  reg->add({KernelFamily::kGdnPrefill, "chunked", "generic", {}});
  return std::unique_ptr<DispatchRegistry>(reg);
}

// slice_scan_ov's cases: fresh and carried states, ragged batches of 1..4097 tokens.
const PrefillCase kOverlapCases[] = {{{4097}, {0}},
                                     {{4096}, {8192}},
                                     {{65, 1, 4097, 64, 0, 63, 200}, {0, 5, 0, 4096, 3, 0, 70}},
                                     {{700, 1300, 513}, {64, 0, 1}}};

// One case's layer, batch and slots (each sequence in slot i, its history random), with the initial
// slots saved: run() restores them, launches once on `st` and returns y and every slot's state.
struct PrefillRig {
  PrefillRig(const GdnShape& shape, const PrefillCase& pc, uint32_t seed)
      : s(shape), rng(seed), hl(make_layer(s, rng)), dl(upload_layer(s, hl)),
        n_seqs(static_cast<int>(pc.lens.size())), cu(cu_seqlens(pc.lens)),
        slots(slot_list(n_seqs)), n_tokens(cu[n_seqs]),
        d(s, random_proj(s, n_tokens, rng), cu, pc.pos, slots), pool(s, n_seqs),
        rec0(pool.rec.n), conv0(pool.conv.n) {
    for (int i = 0; i < n_seqs; ++i) pool.put(s, slots[i], make_seq(s, pc.pos[i], rng));
    CK(cudaMemcpy(rec0.p, pool.rec.p, rec0.n * 4, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(conv0.p, pool.conv.p, conv0.n * 2, cudaMemcpyDeviceToDevice));
  }
  static std::vector<int> slot_list(int n) {
    std::vector<int> v(n);
    for (int i = 0; i < n; ++i) v[i] = i;
    return v;
  }
  void restore() {
    CK(cudaMemcpy(pool.rec.p, rec0.p, rec0.n * 4, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(pool.conv.p, conv0.p, conv0.n * 2, cudaMemcpyDeviceToDevice));
  }
  // One launch of reg captured in a CUDA graph on a non-blocking stream, replayed `reps` times
  // from the initial slots (y poisoned first): check(y, states, rep) after each.
  template <typename F>
  void graph_replays(const DispatchRegistry* reg, bool norm, int reps, F&& check) {
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    d.launch(s, dl.w(norm), pool.pool(), st, reg);
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < reps; ++rep) {
      restore();
      d.out.poison();
      CK(cudaGraphLaunch(exec, st));
      CK(cudaStreamSynchronize(st));
      check(download_bf16(d.out.p, d.out.n), download_f32(pool.rec.p, pool.rec.n), rep);
    }
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    CK(cudaStreamDestroy(st));
  }
  std::pair<std::vector<float>, std::vector<float>> run(const DispatchRegistry* reg,
                                                        cudaStream_t st, bool poison_ws,
                                                        bool norm = true) {
    restore();
    if (poison_ws) d.ws.poison();
    d.out.poison();
    d.launch(s, dl.w(norm), pool.pool(), st, reg);
    CK(cudaDeviceSynchronize());
    return {download_bf16(d.out.p, d.out.n), download_f32(pool.rec.p, pool.rec.n)};
  }
  GdnShape s;
  std::mt19937 rng;
  HostLayer hl;
  DevLayer dl;
  int n_seqs;
  std::vector<int> cu, slots;
  int n_tokens;
  DevPrefillBatch d;
  DevPool pool;
  DevBuf<float> rec0;
  DevBuf<bf16> conv0;
};

// slice_scan_ov runs slice_scan_cs's kernels with the output beside the state pass (programmatic
// dependent launch, per-chunk ready flags): its y and final states must be bit-identical to
// slice_scan_cs's, from a poisoned workspace, on repeated launches over the same workspace (the
// flags are cleared each launch) and replayed from a CUDA graph (PDL edges in a graph).
// slice_scan_wg (the same with the state pass on wgmma) too: on the H200 wgmma's sums come out
// bit for bit as mma.sync's.
// fused_only: the state pass with the output fused in ($DS_GDN_STATE=fused) alone, with and
// without the gated norm (CudaGdn.PrefillFusedBitExact, the file's last test: it ran on no GPU
// when written, and a hang there must cost no other test).
void prefill_overlap_bit_exact(bool fused_only) {
  REQUIRE_GPU();
  if (device_sm() < 90) GTEST_SKIP() << "slice_scan_ov is sm 90 only";
  const auto reg_cs = forced_gdn_registry("slice_scan_cs"),
             reg_ov = forced_gdn_registry("slice_scan_ov"),
             reg_wg = forced_gdn_registry("slice_scan_wg");
  const GdnShape s = shape_27b();
  uint32_t seed = 40;
  for (const PrefillCase& pc : kOverlapCases) {
    PrefillRig rig(s, pc, seed++);
    const int n_seqs = rig.n_seqs, n_tokens = rig.n_tokens;
    DevPrefillBatch& d = rig.d;
    std::printf("case: %d sequences, %d tokens\n", n_seqs, n_tokens);
    // y and every slot's state after one launch of `reg` from the initial slots.
    auto run = [&](const DispatchRegistry* reg, cudaStream_t st, bool poison_ws,
                   bool norm = true) { return rig.run(reg, st, poison_ws, norm); };
    // Bit-equal; else prints how many elements differ, the largest difference and the first
    // differing element as (row, column) of a [rows, cols] matrix.
    const int out_cols = s.out_dim();
    auto same = [out_cols](const std::vector<float>& a, const std::vector<float>& b) {
      if (a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0) return true;
      size_t n_diff = 0, first = a.size();
      double max_diff = 0;
      for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
        if (std::memcmp(&a[i], &b[i], 4) == 0) continue;
        if (n_diff++ == 0) first = i;
        max_diff = std::max(max_diff, double(std::fabs(a[i] - b[i])));
      }
      std::printf("  differ: %zu of %zu elements, max abs diff %g, first at (%zu, %zu)\n", n_diff,
                  a.size(), max_diff, first / out_cols, first % out_cols);
      return false;
    };
    // The ready flags after a launch: every real chunk of every head counted by each publishing
    // state-pass unit exactly once (`per_chunk`: 2 slices for slice_scan_ov, 4 warps x 2 slices
    // for slice_scan_wg, 0 for the serial slice_scan_cs), slots past the last chunk 0.
    int real_chunks = 0;
    for (int i = 0; i < n_seqs; ++i) real_chunks += (pc.lens[i] + 63) / 64;
    auto flags_ok = [&](int per_chunk, const std::string& what) {
      size_t count = 0;
      const int* flags = gdn_prefill_ready_flags(s, n_tokens, n_seqs, d.ws.p, &count);
      std::vector<int> h(count);
      CK(cudaMemcpy(h.data(), flags, count * sizeof(int), cudaMemcpyDeviceToHost));
      size_t bad = 0;
      for (size_t i = 0; i < count; ++i) {
        const int want = int(i) / s.n_v_heads < real_chunks ? per_chunk : 0;
        if (h[i] != want && bad++ == 0)
          ADD_FAILURE() << what << ": ready flag of chunk " << i / s.n_v_heads << " head "
                        << i % s.n_v_heads << " is " << h[i] << ", expected " << want;
      }
      EXPECT_EQ(bad, 0u) << what << ": ready flags";
    };
    const auto ref = run(reg_cs.get(), nullptr, true);
    flags_ok(0, "slice_scan_cs");
    size_t nan_y = 0;
    for (float x : ref.first) nan_y += std::isnan(x);
    EXPECT_EQ(nan_y, 0u) << "slice_scan_cs left output rows unwritten";
    // slice_scan_wg with each of its output kernels (GdnOutForm; the default restored after).
    const GdnFormsRestore restore_forms;
    const GdnOutForm form0 = restore_forms.out;
    const struct {
      const char* name;
      const DispatchRegistry* reg;
      GdnOutForm form;
      GdnStateForm state_form = GdnStateForm::kWg;
    } arms[] = {{"slice_scan_ov", reg_ov.get(), form0},
                {"slice_scan_wg (wgmma output)", reg_wg.get(), GdnOutForm::kWgmma},
                {"slice_scan_wg (TMA mma.sync output)", reg_wg.get(), GdnOutForm::kTma},
                {"slice_scan_wg (cp.async output)", reg_wg.get(), GdnOutForm::kCpAsync},
                {"slice_scan_wg (tight state pass)", reg_wg.get(), GdnOutForm::kWgmma,
                 GdnStateForm::kTight},
                {"slice_scan_wg (state pass and output fused)", reg_wg.get(),
                 GdnOutForm::kWgmma, GdnStateForm::kFused},
                {"slice_scan_wg (fused, two output warpgroups)", reg_wg.get(),
                 GdnOutForm::kWgmma, GdnStateForm::kFused2},
                {"slice_scan_wg (fused2 on the shipped chain step)", reg_wg.get(),
                 GdnOutForm::kWgmma, GdnStateForm::kFused2Wg}};
    auto is_fused = [](GdnStateForm f) {
      return f == GdnStateForm::kFused || f == GdnStateForm::kFused2 ||
             f == GdnStateForm::kFused2Wg;
    };
    for (const auto& [name, reg, form, state_form] : arms) {
      if (fused_only != is_fused(state_form)) continue;
      set_gdn_out_form(form);
      set_gdn_state_form(state_form);
      const auto* expect = &ref;
      // The fused kernel publishes nothing: its flags stay as the chunk map cleared them.
      const int per_chunk = is_fused(state_form)                               ? 0
                            : std::string(name).rfind("slice_scan_wg", 0) == 0 ? 8
                                                                               : 2;
      for (int rep = 0; rep < 3; ++rep) {  // poisoned workspace, then the last launch's flags
        const auto got = run(reg, nullptr, rep == 0);
        EXPECT_TRUE(same(got.first, expect->first)) << name << " launch " << rep << ": y differs";
        EXPECT_TRUE(same(got.second, expect->second))
            << name << " launch " << rep << ": states differ";
        flags_ok(per_chunk, std::string(name) + " launch " + std::to_string(rep));
      }
      // Captured in a graph on a non-blocking stream, replayed twice.
      rig.graph_replays(reg, /*norm=*/true, 2, [&](const auto& y, const auto& st, int rep) {
        EXPECT_TRUE(same(y, expect->first)) << name << " graph " << rep << ": y";
        EXPECT_TRUE(same(st, expect->second)) << name << " graph " << rep << ": states";
        flags_ok(per_chunk, std::string(name) + " graph " + std::to_string(rep));
      });
    }
    if (!fused_only) continue;
    // Without the gated norm the fused kernel's slices exchange no row sums: y (O itself) and
    // the states still bit-equal to slice_scan_cs's.
    set_gdn_out_form(GdnOutForm::kWgmma);
    set_gdn_state_form(GdnStateForm::kWg);
    const auto ref_nn = run(reg_cs.get(), nullptr, true, /*norm=*/false);
    for (GdnStateForm f :
         {GdnStateForm::kFused, GdnStateForm::kFused2, GdnStateForm::kFused2Wg}) {
      set_gdn_state_form(f);
      const auto got_nn = run(reg_wg.get(), nullptr, true, /*norm=*/false);
      const char* what = f == GdnStateForm::kFused    ? "fused"
                         : f == GdnStateForm::kFused2 ? "fused2"
                                                      : "fused2w";
      EXPECT_TRUE(same(got_nn.first, ref_nn.first)) << what << ", no norm: y differs";
      EXPECT_TRUE(same(got_nn.second, ref_nn.second)) << what << ", no norm: states differ";
    }
  }
}

TEST(CudaGdn, PrefillOverlapBitExact) { prefill_overlap_bit_exact(/*fused_only=*/false); }

TEST(CudaGdn, ShapeChecks) {
  GdnShape s = shape_27b();
  EXPECT_NO_THROW(check_gdn_shape(s));
  s.d_k = 96;
  EXPECT_THROW(check_gdn_shape(s), ds::Error);
  s = shape_27b();
  s.n_v_heads = 40;
  EXPECT_THROW(check_gdn_shape(s), ds::Error);
  s = shape_27b();
  s.d_v = 24;  // the golden "other ratios" fixture: the generic fallback takes it
  EXPECT_NO_THROW(check_gdn_shape(s));
  s.d_v = 26;
  EXPECT_THROW(check_gdn_shape(s), ds::Error);
  s.d_v = 132;
  EXPECT_THROW(check_gdn_shape(s), ds::Error);
  s = shape_27b();
  s.conv_kernel = 3;
  EXPECT_THROW(check_gdn_shape(s), ds::Error);
}

// slice_scan_wg's guard (host only): its TMA maps need n_v_heads % 4 == 0 (gamma's [64, 4] box),
// a 16-byte aligned gamma, rows to map and snapshot rows below 2^31; launch_gdn_slice_scan
// refuses kWgmma outside it with a clear error before launching anything (launch_gdn_prefill
// runs slice_scan_ov's state pass there instead).
TEST(CudaGdn, WgmmaStatePassGuard) {
  const GdnShape s = shape_27b();
  const auto* g16 = reinterpret_cast<const float*>(uintptr_t(4096));
  EXPECT_TRUE(gdn_slice_wg_supported(s, 4096, 65, g16));
  EXPECT_FALSE(gdn_slice_wg_supported(s, 4096, 65, g16 + 1)) << "gamma 4-byte aligned only";
  EXPECT_FALSE(gdn_slice_wg_supported(s, 0, 65, g16)) << "no rows";
  const int64_t per_chunk = int64_t(s.n_v_heads) * 128;  // snapshot rows per chunk
  const int rows_limit = int(((int64_t(1) << 31) + per_chunk - 1) / per_chunk);  // first too many
  EXPECT_TRUE(gdn_slice_wg_supported(s, 4096, rows_limit - 1, g16));
  EXPECT_FALSE(gdn_slice_wg_supported(s, 4096, rows_limit, g16)) << "snapshot rows >= 2^31";
  GdnShape odd = s;
  odd.n_v_heads = 18;  // 6 per k head: n_v % 4 != 0
  odd.n_k_heads = 3;
  EXPECT_FALSE(gdn_slice_wg_supported(odd, 4096, 65, g16));
  GdnShape small = s;
  small.d_k = small.d_v = 64;
  EXPECT_FALSE(gdn_slice_wg_supported(small, 4096, 65, g16));

  // The launch refuses it (fake, aligned addresses: nothing is dereferenced before the check).
  auto* p = reinterpret_cast<bf16*>(uintptr_t(1) << 20);
  GdnStatePool pool;
  pool.rec_state = reinterpret_cast<float*>(p);
  GdnLayerWeights w;
  try {
    launch_gdn_slice_scan(s, w, pool, p, nullptr, nullptr, nullptr, 1, nullptr, nullptr, 65, p,
                          g16 + 1, p, p, p, p, GdnSliceState::kWgmma, 8, nullptr, /*stages=*/1,
                          nullptr, 4096);
    ADD_FAILURE() << "kWgmma with a misaligned gamma was accepted";
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find("wgmma state pass"), std::string::npos) << e.what();
  }
}

// A form switch's values (host only): each of `good` parses to its form (null and "" to
// `dflt`), each of `bad` is a ds::Error naming the variable `env` and the value, and set()
// overrides the process's choice (to `other` and back).
template <class Form>
void expect_form_switch(Form (*parse)(const char*), Form (*get)(), void (*set)(Form),
                        const char* env, Form dflt,
                        std::initializer_list<std::pair<const char*, Form>> good,
                        std::initializer_list<const char*> bad, Form other) {
  EXPECT_EQ(parse(nullptr), dflt);
  EXPECT_EQ(parse(""), dflt);
  for (const auto& [value, form] : good) EXPECT_EQ(parse(value), form) << value;
  for (const char* v : bad) {
    try {
      parse(v);
      ADD_FAILURE() << "'" << v << "' was accepted";
    } catch (const ds::Error& e) {
      EXPECT_NE(std::string(e.what()).find(env), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(v), std::string::npos) << e.what();
    }
  }
  const Form form0 = get();
  set(other);
  EXPECT_EQ(get(), other);
  set(form0);
  EXPECT_EQ(get(), form0);
}

// $DS_GDN_OUT: unset / empty / wg = the wgmma output, tma and cp the mma.sync forms.
TEST(CudaGdn, OutFormSwitch) {
  expect_form_switch(parse_gdn_out_form, gdn_out_form, set_gdn_out_form, "DS_GDN_OUT",
                     GdnOutForm::kWgmma,
                     {{"wg", GdnOutForm::kWgmma}, {"tma", GdnOutForm::kTma},
                      {"cp", GdnOutForm::kCpAsync}},
                     {"0", "TMA", "wgs", "cp.async", " wg"}, GdnOutForm::kCpAsync);
}

// $DS_GDN_CONV: unset / empty / stream = a warp per two heads, head = a warp per head.
TEST(CudaGdn, ConvFormSwitch) {
  expect_form_switch(parse_gdn_conv_form, gdn_conv_form, set_gdn_conv_form, "DS_GDN_CONV",
                     GdnConvForm::kStream,
                     {{"stream", GdnConvForm::kStream}, {"head", GdnConvForm::kHead}},
                     {"1", "Head", "head ", "bulk", "default"}, GdnConvForm::kHead);
}

// $DS_GDN_STATE: unset / empty / wg = the measured chunk step, tight the shorter one, fused /
// fused2 / fused2w the pass with the output in the same kernel (flash, session 34's FlashInfer
// order, was removed in session 36: now refused as any unknown value is).
TEST(CudaGdn, StateFormSwitch) {
  expect_form_switch(parse_gdn_state_form, gdn_state_form, set_gdn_state_form, "DS_GDN_STATE",
                     GdnStateForm::kWg,
                     {{"wg", GdnStateForm::kWg},
                      {"tight", GdnStateForm::kTight},
                      {"fused", GdnStateForm::kFused},
                      {"fused2", GdnStateForm::kFused2},
                      {"fused2w", GdnStateForm::kFused2Wg}},
                     {"1", "Tight", "tight ", "wgmma", "fuse", "Fused", "fused1", "fused3", "flash",
                      "Flash"},
                     GdnStateForm::kTight);
}

TEST(CudaGdn, PrefillWorkspaceTooSmallIsAnError) {
  REQUIRE_GPU();
  const GdnShape s = shape_27b();
  DevBuf<unsigned char> ws(1024);
  DevBuf<bf16> dummy(16);
  DevBuf<float> fdummy(16);
  DevBuf<int32_t> idummy(16);
  GdnLayerWeights w{dummy.p, fdummy.p, fdummy.p, dummy.p};
  GdnStatePool pool{dummy.p, fdummy.p, 4LL * s.qkv_dim(), 48LL * 128 * 128};
  EXPECT_THROW(launch_gdn_prefill(s, w, pool, dummy.p, idummy.p, idummy.p, idummy.p, 1, 64, ws.p,
                                  ws.n, dummy.p, nullptr),
               ds::Error);
}

TEST(CudaGdn, Prefill27BSingleLengths) {
  REQUIRE_GPU();
  for (int len : {1, 63, 64, 65, 4095, 4097}) {
    std::printf("len %d\n", len);
    check_prefill(shape_27b(), PrefillCase{{len}, {0}}, 100 + len);
  }
}

TEST(CudaGdn, Prefill27BRawOutput) {
  REQUIRE_GPU();
  check_prefill(shape_27b(), PrefillCase{{130, 7}, {0, 0}}, 7, 2e-2, 2e-2, /*norm=*/false);
}

TEST(CudaGdn, Prefill27BBatchOfLengths) {
  REQUIRE_GPU();
  check_prefill(shape_27b(), PrefillCase{{65, 1, 4097, 64, 0, 63, 200}, {0, 0, 0, 0, 0, 0, 0}}, 11);
}

TEST(CudaGdn, Prefill27BCarriedState) {
  REQUIRE_GPU();
  // Positions 1, 2, 3 exercise the ring rows before position 0.
  check_prefill(shape_27b(), PrefillCase{{100, 64, 1, 2, 129, 5}, {7, 1, 2, 3, 4096, 70}}, 12);
}

TEST(CudaGdn, PrefillSmallHeads) {
  REQUIRE_GPU();
  const PrefillCase pc{{1, 70, 129, 64, 3}, {0, 0, 5, 2, 1}};
  for (int d : {16, 32, 64}) {
    std::printf("d %d\n", d);
    check_prefill(GdnShape{2, 4, d, d, 4, 1e-6f}, pc, 20 + d);
  }
  std::printf("d_k 32, d_v 64, ratio 3\n");
  check_prefill(GdnShape{2, 6, 32, 64, 4, 1e-6f}, pc, 31);
  std::printf("d_k 128, d_v 16, ratio 1\n");
  check_prefill(GdnShape{3, 3, 128, 16, 4, 1e-6f}, pc, 32);
  // Head sizes off the tensor-core kernels (generic token-by-token fallback).
  std::printf("d_k 16, d_v 24 (the golden other-ratios fixture)\n");
  check_prefill(GdnShape{2, 4, 16, 24, 4, 1e-6f}, pc, 33);
  std::printf("d_k 128, d_v 20, ratio 2\n");
  check_prefill(GdnShape{2, 4, 128, 20, 4, 1e-6f}, pc, 34);
}

// Decode: n steps for a batch of sequences at given positions, each step checked.
void check_decode(const GdnShape& s, const std::vector<int>& pos, int n_steps, uint32_t seed) {
  std::mt19937 rng(seed);
  const HostLayer hl = make_layer(s, rng);
  const DevLayer dl = upload_layer(s, hl);
  const int n = static_cast<int>(pos.size());
  std::vector<HostSeq> seqs;
  std::vector<int> slots(n);
  for (int i = 0; i < n; ++i) {
    seqs.push_back(make_seq(s, pos[i], rng));
    slots[i] = n - i;  // slot 0 unused
  }
  DevPool pool(s, n + 1);
  for (int i = 0; i < n; ++i) pool.put(s, slots[i], seqs[i]);
  DevBuf<bf16> d_proj(size_t(n) * s.in_dim()), d_out(size_t(n) * s.out_dim());
  DevBuf<int32_t> d_pos(n), d_slots(n);
  upload(d_slots, slots);
  for (int step = 0; step < n_steps; ++step) {
    const auto proj = random_proj(s, n, rng);
    upload(d_proj, to_bf16(proj));
    std::vector<int> p(n);
    for (int i = 0; i < n; ++i) p[i] = seqs[i].pos;
    upload(d_pos, p);
    d_out.poison();
    launch_gdn_decode(s, dl.w(), pool.pool(), d_proj.p, d_pos.p, d_slots.p, n, d_out.p, nullptr);
    CK(cudaDeviceSynchronize());
    const auto out = download_bf16(d_out.p, d_out.n);
    for (int i = 0; i < n; ++i) {
      std::vector<float> y;
      ref_gdn(s, hl, &proj[size_t(i) * s.in_dim()], 1, seqs[i], y);
      std::vector<float> got(out.begin() + size_t(i) * s.out_dim(),
                             out.begin() + size_t(i + 1) * s.out_dim());
      char what[128];
      std::snprintf(what, sizeof what, "step %d seq %d (pos %d)", step, i, seqs[i].pos - 1);
      const Err ey = compare(got, y);
      EXPECT_ERR(ey, 1e-2, std::string(what) + " y");
      const Err es = compare(pool.state(s, slots[i]), seqs[i].S);
      EXPECT_ERR(es, 1e-4, std::string(what) + " state");
      pool.expect_ring(s, slots[i], seqs[i], what);
      if (step == n_steps - 1)
        std::printf("  %-28s y err %.2e, state err %.2e\n", what, ey.norm, es.norm);
    }
  }
  auto untouched = download_f32(pool.rec.p, size_t(s.n_v_heads) * s.d_v * s.d_k);
  EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](float x) {
    return std::isnan(x);
  })) << "slot 0 (unused) was written";
}

// gdn_prefill_conv.cu's streaming conv (the slice_scan variants' conv stage) against the host
// oracle and against gdn_conv_prep_multi_kernel: a batch of sequences of lengths 1..1029 (one
// empty) with and without carried conv rings, so sequence starts fall inside and at the edges of
// the strips, for every strip length. qkv within one bf16 step of the multi kernel everywhere
// (approximate SiLU divide, another l2norm order) and within bf16 rounding of the oracle; g and
// beta bit-identical to the multi kernel; every output written (outputs poisoned with NaN).
TEST(CudaGdn, ConvStreamMatchesMulti) {
  REQUIRE_GPU();
  const GdnShape shapes[] = {shape_27b(), GdnShape{4, 4, 128, 128, 4, 1e-6f},
                             GdnShape{2, 8, 128, 128, 4, 1e-6f}};
  std::mt19937 rng(77);
  for (const GdnShape& s : shapes) {
    const HostLayer hl = make_layer(s, rng);
    const DevLayer dl = upload_layer(s, hl);
    const std::vector<int> lens = {1, 2, 3, 5, 37, 0, 64, 300, 1029};
    const std::vector<int> pos = {0, 1, 2, 0, 7, 0, 3, 100, 5};
    const int n_seqs = static_cast<int>(lens.size());
    std::vector<int> cu(n_seqs + 1, 0), slots(n_seqs);
    for (int i = 0; i < n_seqs; ++i) {
      cu[i + 1] = cu[i] + lens[i];
      slots[i] = n_seqs - 1 - i;  // slots in another order than the sequences
    }
    const int T = cu[n_seqs], qd = s.qkv_dim(), nv = s.n_v_heads;
    const auto proj = random_proj(s, T, rng);
    DevPool pool(s, n_seqs);
    std::vector<HostSeq> seqs;
    std::vector<float> ref(static_cast<size_t>(T) * qd);
    for (int i = 0; i < n_seqs; ++i) {
      seqs.push_back(make_seq(s, pos[i], rng));
      pool.put(s, slots[i], seqs[i]);
      const auto c =
          ref_conv(s, hl, proj.data() + static_cast<size_t>(cu[i]) * s.in_dim(), lens[i], seqs[i]);
      std::copy(c.begin(), c.end(), ref.begin() + static_cast<size_t>(cu[i]) * qd);
    }
    DevBuf<bf16> d_proj(proj.size()), qkv_m(size_t(T) * qd), qkv_s(size_t(T) * qd),
        qkv_h(size_t(T) * qd);
    upload(d_proj, to_bf16(proj));
    DevBuf<int32_t> d_cu(n_seqs + 1), d_pos(n_seqs), d_slot(n_seqs);
    upload(d_cu, cu);
    upload(d_pos, pos);
    upload(d_slot, slots);
    DevBuf<float> g_m(size_t(T) * nv), b_m(size_t(T) * nv), g_s(size_t(T) * nv),
        b_s(size_t(T) * nv);
    const GdnLayerWeights w = dl.w();
    const GdnStatePool pp = pool.pool();
    ASSERT_TRUE(gdn_conv_prep_multi_supported(s, w, pp, d_proj.p));
    ASSERT_TRUE(gdn_conv_prep_stream_supported(s, w, pp, d_proj.p));
    qkv_m.poison();
    g_m.poison();
    b_m.poison();
    launch_gdn_conv_prep_multi(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, n_seqs, T, qkv_m.p,
                               g_m.p, b_m.p, nullptr);
    CK(cudaDeviceSynchronize());
    const auto ym = download_bf16(qkv_m.p, qkv_m.n);
    const auto gm = download_f32(g_m.p, g_m.n), bm = download_f32(b_m.p, b_m.n);
    for (int strip : {8, 16, 32, 64, 0}) {
      const std::string what = "shape n_k " + std::to_string(s.n_k_heads) + " n_v " +
                               std::to_string(nv) + ", strip " + std::to_string(strip);
      qkv_s.poison();
      g_s.poison();
      b_s.poison();
      launch_gdn_conv_prep_stream(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, n_seqs, T, qkv_s.p,
                                  g_s.p, b_s.p, nullptr, strip);
      CK(cudaDeviceSynchronize());
      const auto ys = download_bf16(qkv_s.p, qkv_s.n);
      size_t off_step = 0, unwritten = 0;
      for (size_t i = 0; i < ys.size(); ++i) {
        if (!std::isfinite(ys[i])) {
          ++unwritten;
          continue;
        }
        const double bound = std::ldexp(std::max(std::abs(ym[i]), std::abs(ys[i])), -7);
        off_step += std::abs(double(ys[i]) - ym[i]) > bound;
      }
      EXPECT_EQ(unwritten, 0u) << what << ": qkv elements not written (or NaN)";
      EXPECT_EQ(off_step, 0u) << what << ": qkv elements more than one bf16 step from the multi "
                              << "kernel's";
      EXPECT_ERR(compare(ys, ref), 4e-3, what + " qkv vs the oracle");
      EXPECT_TRUE(download_f32(g_s.p, g_s.n) == gm) << what << ": g differs from the multi kernel";
      EXPECT_TRUE(download_f32(b_s.p, b_s.n) == bm) << what << ": beta differs";
      // The head-per-warp form (session 25): the same bounds; v (no l2norm) bit-identical to the
      // stream form's, q / k at most one bf16 step from it (another sum-of-squares order).
      qkv_h.poison();
      g_s.poison();
      b_s.poison();
      launch_gdn_conv_prep_stream(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, n_seqs, T, qkv_h.p,
                                  g_s.p, b_s.p, nullptr, strip, GdnConvForm::kHead);
      CK(cudaDeviceSynchronize());
      const auto yh = download_bf16(qkv_h.p, qkv_h.n);
      size_t h_unwritten = 0, h_off_step = 0, h_v_diff = 0, h_qk_diff = 0;
      const size_t v0 = size_t(2) * s.n_k_heads * s.d_k;  // first v column of a row
      for (size_t i = 0; i < yh.size(); ++i) {
        if (!std::isfinite(yh[i])) {
          ++h_unwritten;
          continue;
        }
        const double bound = std::ldexp(std::max(std::abs(ym[i]), std::abs(yh[i])), -7);
        h_off_step += std::abs(double(yh[i]) - ym[i]) > bound;
        const bool differs = yh[i] != ys[i];
        (i % size_t(qd) >= v0 ? h_v_diff : h_qk_diff) += differs;
      }
      EXPECT_EQ(h_unwritten, 0u) << what << ": head form left qkv elements unwritten (or NaN)";
      EXPECT_EQ(h_off_step, 0u) << what << ": head form qkv more than one bf16 step from multi";
      EXPECT_EQ(h_v_diff, 0u) << what << ": head form v differs from the stream form";
      EXPECT_ERR(compare(yh, ref), 4e-3, what + " head form qkv vs the oracle");
      EXPECT_TRUE(download_f32(g_s.p, g_s.n) == gm) << what << ": head form g differs";
      EXPECT_TRUE(download_f32(b_s.p, b_s.n) == bm) << what << ": head form beta differs";
      if (strip == 0)
        std::printf("  conv head form n_k %d n_v %d: %zu of %zu q/k elements differ from the "
                    "stream form (last bit)\n",
                    s.n_k_heads, nv, h_qk_diff, yh.size() / qd * v0);
    }
    std::printf("  conv stream n_k %d n_v %d: %d tokens in %d sequences, vs oracle %.2e\n",
                s.n_k_heads, nv, T, n_seqs, compare(ym, ref).norm);
  }
  // A strip that is not a multiple of 8 is a clear error.
  const GdnShape s = shape_27b();
  std::mt19937 rng2(3);
  const DevLayer dl = upload_layer(s, make_layer(s, rng2));
  DevPool pool(s, 1);
  DevBuf<bf16> d_proj(size_t(8) * s.in_dim()), qkv(size_t(8) * s.qkv_dim());
  DevBuf<int32_t> d_cu(2), d_pos(1), d_slot(1);
  DevBuf<float> g(8 * size_t(s.n_v_heads)), b(8 * size_t(s.n_v_heads));
  EXPECT_THROW(launch_gdn_conv_prep_stream(s, dl.w(), pool.pool(), d_proj.p, d_cu.p, d_pos.p,
                                           d_slot.p, 1, 8, qkv.p, g.p, b.p, nullptr, 12),
               ds::Error);
}

// Inputs of the WY kernel for T tokens at shape s: the conv output qkv ~ N(0, 0.3), g in
// (-0.6, 0], beta in [0, 1) (what the conv stage hands it, at the magnitudes the model gives).
struct WyInputs {
  std::vector<float> qkv, g, beta;
};
WyInputs random_wy_inputs(const GdnShape& s, int T, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 0.3f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  WyInputs in;
  in.qkv.resize(size_t(T) * s.qkv_dim());
  in.g.resize(size_t(T) * s.n_v_heads);
  in.beta.resize(size_t(T) * s.n_v_heads);
  for (float& x : in.qkv) x = nd(rng);
  for (float& x : in.g) x = -0.6f * ud(rng);
  for (float& x : in.beta) x = ud(rng);
  return in;
}

// The chunk map of sequences of `lens` tokens packed one after another ({seq, t0, n, index} per
// chunk, then an empty entry {-1, 0, 0, 0}: no block work); T receives the tokens in all.
std::vector<int> wy_chunk_map(const std::vector<int>& lens, int& T) {
  std::vector<int> chunks;
  T = 0;
  for (int q = 0; q < int(lens.size()); ++q) {
    for (int c = 0; 64 * c < lens[q]; ++c)
      chunks.insert(chunks.end(), {q, T + 64 * c, std::min(64, lens[q] - 64 * c), c});
    T += lens[q];
  }
  chunks.insert(chunks.end(), {-1, 0, 0, 0});
  return chunks;
}

// The WY kernel with its work spread evenly over the warps (launch_gdn_wy_mma balanced = 1)
// against the by-row-block split (0): gamma, W and U bit for bit, at the 27B shapes, on a chunk
// map with full chunks and partial last chunks of several sequences (1..63 rows), outputs
// poisoned first (rows past a partial chunk stay unwritten in both).
TEST(CudaGdn, WyBalancedBitExact) {
  REQUIRE_GPU();
  if (device_sm() < 90) GTEST_SKIP() << "the staged kernels are sm 90 only";
  const GdnShape s = shape_27b();
  std::mt19937 rng(21);
  const std::vector<int> lens = {4097, 100, 64, 1, 300, 63};
  int T = 0;
  const std::vector<int> chunks = wy_chunk_map(lens, T);
  const int max_chunks = int(chunks.size() / 4), nv = s.n_v_heads;
  const auto [qkv, g, beta] = random_wy_inputs(s, T, rng);
  DevBuf<bf16> d_qkv(qkv.size());
  upload(d_qkv, to_bf16(qkv));
  DevBuf<int32_t> d_chunks(chunks.size());
  upload(d_chunks, chunks);
  DevBuf<float> d_beta(beta.size());
  upload(d_beta, beta);
  std::vector<std::vector<float>> gam(3), wm(3), um(3);
  for (int balanced : {0, 1, 2}) {
    DevBuf<float> d_g(g.size());
    upload(d_g, g);
    DevBuf<bf16> w(size_t(T) * nv * 128), u(size_t(T) * nv * 128);
    w.poison();
    u.poison();
    launch_gdn_wy_mma(s, reinterpret_cast<const int4*>(d_chunks.p), max_chunks, d_qkv.p, d_g.p,
                      d_beta.p, w.p, u.p, nullptr, /*tf32_offdiag=*/true, balanced);
    CK(cudaDeviceSynchronize());
    gam[balanced] = download_f32(d_g.p, d_g.n);
    wm[balanced] = download_bf16(w.p, w.n);
    um[balanced] = download_bf16(u.p, u.n);
  }
  auto n_differ = [](const std::vector<float>& a, const std::vector<float>& b) {
    size_t d = 0;
    for (size_t i = 0; i < a.size(); ++i)
      d += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return d;
  };
  for (int b : {1, 2}) {  // balanced, and balanced with the late V load (56 KB layout)
    size_t finite = 0, finite_u = 0;
    for (float x : wm[b]) finite += std::isfinite(x);
    for (float x : um[b]) finite_u += std::isfinite(x);
    EXPECT_EQ(n_differ(gam[0], gam[b]), 0u) << "gamma, balanced = " << b;
    EXPECT_EQ(n_differ(wm[0], wm[b]), 0u) << "W, balanced = " << b;
    EXPECT_EQ(n_differ(um[0], um[b]), 0u) << "U, balanced = " << b;
    EXPECT_EQ(finite, size_t(T) * nv * 128) << "every valid row of W written, balanced = " << b;
    EXPECT_EQ(finite_u, size_t(T) * nv * 128) << "every valid row of U written, balanced = " << b;
    std::printf("  wy balanced = %d vs by row block: %d tokens in %zu sequences, %d chunks: W %zu, "
                "U %zu, gamma %zu elements differ\n",
                b, T, lens.size(), max_chunks, n_differ(wm[0], wm[b]), n_differ(um[0], um[b]),
                n_differ(gam[0], gam[b]));
  }
  // The shipped build with phase stamps (launch_gdn_wy_mma_timed): the same bits as balanced = 2,
  // and for every block of a chunk entry the stamps in order on its SM's clock (entry <= loads
  // <= diagonal <= T <= warp 0's end; the other warps' ends after the diagonal; globaltimer end
  // >= entry); the empty entry's blocks write none.
  {
    DevBuf<float> d_g(g.size());
    upload(d_g, g);
    DevBuf<bf16> w(size_t(T) * nv * 128), u(size_t(T) * nv * 128);
    w.poison();
    u.poison();
    DevBuf<unsigned long long> st(size_t(max_chunks) * nv * kGdnWyStamps);
    CK(cudaMemset(st.p, 0, st.n * sizeof(unsigned long long)));
    launch_gdn_wy_mma_timed(s, reinterpret_cast<const int4*>(d_chunks.p), max_chunks, d_qkv.p,
                            d_g.p, d_beta.p, w.p, u.p, st.p, nullptr);
    CK(cudaDeviceSynchronize());
    EXPECT_EQ(n_differ(gam[2], download_f32(d_g.p, d_g.n)), 0u) << "gamma, timed";
    EXPECT_EQ(n_differ(wm[2], download_bf16(w.p, w.n)), 0u) << "W, timed";
    EXPECT_EQ(n_differ(um[2], download_bf16(u.p, u.n)), 0u) << "U, timed";
    std::vector<unsigned long long> h(st.n);
    CK(cudaMemcpy(h.data(), st.p, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
    size_t ordered = 0, blocks = 0;
    for (int hv = 0; hv < nv; ++hv) {
      for (int c = 0; c < max_chunks; ++c) {
        const unsigned long long* b = h.data() + (size_t(hv) * max_chunks + c) * kGdnWyStamps;
        if (chunks[4 * c] < 0) {
          EXPECT_TRUE(std::all_of(b, b + kGdnWyStamps, [](auto x) { return x == 0; }))
              << "the empty entry wrote stamps";
          continue;
        }
        ++blocks;
        // Thread 0 takes [0..3], [4], [8], [9] in program order. Another warp ends after the
        // last barrier, which thread 0 reaches only after taking [2].
        bool ok = b[0] <= b[1] && b[1] <= b[2] && b[2] <= b[3] && b[3] <= b[4] && b[9] >= b[8] &&
                  b[8] > 0;
        for (int wp = 1; wp < 4; ++wp) ok = ok && b[4 + wp] >= b[2];
        ordered += ok;
      }
    }
    EXPECT_EQ(ordered, blocks) << "blocks with their stamps in order";
  }
}

TEST(CudaGdn, Decode27BBatch1) {
  REQUIRE_GPU();
  check_decode(shape_27b(), {0}, 6, 41);
  check_decode(shape_27b(), {5000}, 3, 42);
}

TEST(CudaGdn, Decode27BBatch) {
  REQUIRE_GPU();
  check_decode(shape_27b(), {0, 1, 2, 3, 4, 77, 4097}, 5, 43);
}

TEST(CudaGdn, DecodeSmallHeads) {
  REQUIRE_GPU();
  for (int d : {16, 32, 64}) check_decode(GdnShape{2, 4, d, d, 4, 1e-6f}, {0, 3, 9}, 4, 50 + d);
  check_decode(GdnShape{2, 6, 32, 64, 4, 1e-6f}, {0, 3, 9}, 4, 60);
  check_decode(GdnShape{3, 3, 128, 16, 4, 1e-6f}, {0, 3, 9}, 4, 61);
  // d_v not a multiple of 16: the one-block-per-head fallback.
  check_decode(GdnShape{2, 4, 16, 24, 4, 1e-6f}, {0, 3, 9}, 4, 62);
  check_decode(GdnShape{2, 4, 128, 20, 4, 1e-6f}, {0, 3, 9}, 4, 63);
}

// Prefill 65 tokens, prefill 200 more (carried state), then 4 decode steps: one continuous
// sequence, checked against the oracle at the end of each phase.
TEST(CudaGdn, PrefillThenPrefillThenDecode27B) {
  REQUIRE_GPU();
  const GdnShape s = shape_27b();
  std::mt19937 rng(77);
  const HostLayer hl = make_layer(s, rng);
  const DevLayer dl = upload_layer(s, hl);
  HostSeq seq = make_seq(s, 0, rng);
  DevPool pool(s, 2);
  const int slot = 1;
  DevBuf<int32_t> d_slot(1), d_pos(1), d_cu(2);
  upload(d_slot, std::vector<int>{slot});
  for (int len : {65, 200}) {
    const auto proj = random_proj(s, len, rng);
    DevBuf<bf16> d_proj(proj.size()), d_out(size_t(len) * s.out_dim());
    upload(d_proj, to_bf16(proj));
    upload(d_pos, std::vector<int>{seq.pos});
    upload(d_cu, std::vector<int>{0, len});
    const size_t wsb = gdn_prefill_workspace_bytes(s, len, 1);
    DevBuf<unsigned char> ws(wsb);
    d_out.poison();
    launch_gdn_prefill(s, dl.w(), pool.pool(), d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, len, ws.p,
                       wsb, d_out.p, nullptr, engine_dispatch());
    CK(cudaDeviceSynchronize());
    std::vector<float> y;
    ref_gdn(s, hl, proj.data(), len, seq, y);
    EXPECT_ERR(compare(download_bf16(d_out.p, d_out.n), y), 2e-2, "prefill y");
    EXPECT_ERR(compare(pool.state(s, slot), seq.S), 2e-2, "prefill state");
    pool.expect_ring(s, slot, seq, "prefill");
  }
  for (int step = 0; step < 4; ++step) {
    const auto proj = random_proj(s, 1, rng);
    DevBuf<bf16> d_proj(proj.size()), d_out(s.out_dim());
    upload(d_proj, to_bf16(proj));
    upload(d_pos, std::vector<int>{seq.pos});
    d_out.poison();
    launch_gdn_decode(s, dl.w(), pool.pool(), d_proj.p, d_pos.p, d_slot.p, 1, d_out.p, nullptr);
    CK(cudaDeviceSynchronize());
    std::vector<float> y;
    ref_gdn(s, hl, proj.data(), 1, seq, y);
    const Err ey = compare(download_bf16(d_out.p, d_out.n), y);
    EXPECT_ERR(ey, 2e-2, "decode y after prefill");
    EXPECT_ERR(compare(pool.state(s, slot), seq.S), 2e-2, "decode state after prefill");
    pool.expect_ring(s, slot, seq, "decode after prefill");
  }
}

// ---- timing (printed, not asserted) ------------------------------------------------------------
// Median ms of f(i) on the default stream over `iters` calls, after 3 warm-up calls.
template <typename F>
double median_ms(F&& f, int iters) {
  for (int i = 0; i < 3; ++i) f(i);
  int i = 0;
  return test::median_event_ms(nullptr, iters, [&] { f(i++); });
}

TEST(CudaGdn, Timing) {
  REQUIRE_GPU();
  DS_REQUIRE_PERF();
  const GdnShape s = shape_27b();
  std::mt19937 rng(5);
  const HostLayer hl = make_layer(s, rng);
  const DevLayer dl = upload_layer(s, hl);
  // Prefill: one sequence of T tokens from zero state, and the same with carried state.
  for (int T : {64, 512, 2048, 4096, 8192}) {
    const auto proj = random_proj(s, T, rng);
    DevBuf<bf16> d_proj(proj.size()), d_out(size_t(T) * s.out_dim());
    upload(d_proj, to_bf16(proj));
    DevPool pool(s, 1);
    CK(cudaMemset(pool.rec.p, 0, pool.rec.n * 4));
    DevBuf<int32_t> d_cu(2), d_pos(1), d_slot(1);
    upload(d_cu, std::vector<int>{0, T});
    upload(d_pos, std::vector<int>{T});  // carried state (the state stays bounded: decays < 1)
    upload(d_slot, std::vector<int>{0});
    const size_t wsb = gdn_prefill_workspace_bytes(s, T, 1);
    DevBuf<unsigned char> ws(wsb);
    CK(cudaMemset(pool.conv.p, 0, pool.conv.n * 2));
    for (const PrefillVariant& var : prefill_variants()) {
      const double ms = median_ms(
          [&](int) {
            launch_gdn_prefill(s, dl.w(), pool.pool(), d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, T,
                               ws.p, wsb, d_out.p, nullptr, var.dispatch);
          },
          20);
      std::printf(
          "TIMING gdn prefill [%-13s] %5d tokens, 1 seq: %.3f ms/layer (%.1f M tok/s)  [PERF.md: "
          "FLA %s, target 0.16 ms @4096]\n",
          var.name.c_str(), T, ms, T / ms / 1e3,
          T == 512    ? "0.075"
          : T == 4096 ? "0.405"
          : T == 8192 ? "0.788"
                      : "-");
    }
  }
  // Decode: batch B, states rotated over 32 layers' worth of slots (96 MiB at B = 1: past L2).
  for (int B : {1, 4, 16}) {
    const int n_layers = std::max(2, 32 / B);
    std::vector<DevPool> pools;
    for (int l = 0; l < n_layers; ++l) {
      pools.emplace_back(s, B);
      CK(cudaMemset(pools.back().rec.p, 0, pools.back().rec.n * 4));
      CK(cudaMemset(pools.back().conv.p, 0, pools.back().conv.n * 2));
    }
    const auto proj = random_proj(s, B, rng);
    DevBuf<bf16> d_proj(proj.size()), d_out(size_t(B) * s.out_dim());
    upload(d_proj, to_bf16(proj));
    std::vector<int> pos(B, 100), slots(B);
    for (int i = 0; i < B; ++i) slots[i] = i;
    DevBuf<int32_t> d_pos(B), d_slot(B);
    upload(d_pos, pos);
    upload(d_slot, slots);
    const int reps = 64;
    const double ms = median_ms(
                          [&](int) {
                            for (int r = 0; r < reps; ++r) {
                              launch_gdn_decode(s, dl.w(), pools[r % n_layers].pool(), d_proj.p,
                                                d_pos.p, d_slot.p, B, d_out.p, nullptr);
                            }
                          },
                          20) /
                      reps;
    // The same 64 launches captured in a CUDA graph (as the engine runs decode): no launch gaps.
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int r = 0; r < reps; ++r) {
      launch_gdn_decode(s, dl.w(), pools[r % n_layers].pool(), d_proj.p, d_pos.p, d_slot.p, B,
                        d_out.p, st);
    }
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const double ms_graph = median_ms([&](int) { CK(cudaGraphLaunch(exec, nullptr)); }, 20) / reps;
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    CK(cudaStreamDestroy(st));
    const double bytes = 2.0 * B * s.n_v_heads * s.d_v * s.d_k * 4;
    std::printf(
        "TIMING gdn decode batch %2d: %.2f us/layer stream, %.2f us/layer in a graph (state %.1f "
        "MB r+w: %.2f TB/s)  [PERF.md: FLA 5.9 us @1 in a graph, target 2 us]\n",
        B, ms * 1e3, ms_graph * 1e3, bytes / 1e6, bytes / (ms_graph * 1e-3) / 1e12);
  }
}

// Each stage of the d 128 prompt path alone at 4096 tokens (one sequence, carried state): the
// conv kernels, the WY kernels (SIMT vs tf32 off-diagonal blocks of T), slice_scan's state pass
// (plain and lean) and output (4- and 8-warp CTAs), and the state pass + output one after the
// other and overlapped (slice_scan_ov).
// Inputs come from a real conv + WY run, so every stage sees the data it would see in the layer.
// Conv stage kernels alone at each prompt length (one sequence, carried state; CUDA-event
// medians): the generic one-token blocks, the 8-token blocks, the wide grid and the streaming
// kernel at its default strip (and 16 / 32 / 64 at 4096 tokens). Prints; asserts nothing.
TEST(CudaGdn, ConvTiming) {
  REQUIRE_GPU();
  DS_REQUIRE_PERF();
  const GdnShape s = shape_27b();
  std::mt19937 rng(12);
  const DevLayer dl = upload_layer(s, make_layer(s, rng));
  const int t_max = 8192, nv = s.n_v_heads;
  DevBuf<bf16> d_proj(size_t(t_max) * s.in_dim()), qkv(size_t(t_max) * s.qkv_dim());
  upload(d_proj, to_bf16(random_proj(s, t_max, rng)));
  DevBuf<float> g(size_t(t_max) * nv), beta(size_t(t_max) * nv);
  DevPool pool(s, 1);
  CK(cudaMemset(pool.conv.p, 0, pool.conv.n * 2));
  const GdnLayerWeights w = dl.w();
  const GdnStatePool pp = pool.pool();
  DevBuf<int32_t> d_cu(2), d_pos(1), d_slot(1);
  upload(d_pos, std::vector<int>{100});
  upload(d_slot, std::vector<int>{0});
  for (int T : {64, 512, 2048, 4096, 8192}) {
    upload(d_cu, std::vector<int>{0, T});
    const double mb = 2.0 * T * s.qkv_dim() * 2 / 1e6;  // qkv in + out
    auto row = [&](const char* name, auto&& f) {
      const double ms = median_ms([&](int) { f(); }, 20);
      std::printf("CONV gdn conv_prep %5d tokens %-28s %8.1f us  %6.2f TB/s\n", T, name, ms * 1e3,
                  mb / ms / 1e3);
    };
    row("generic (1 token/block)", [&] {
      launch_gdn_conv_prep(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, T, qkv.p, g.p, beta.p,
                           nullptr);
    });
    row("multi (8 tokens/block)", [&] {
      launch_gdn_conv_prep_multi(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, T, qkv.p, g.p,
                                 beta.p, nullptr);
    });
    row("wide (warp x 8 tokens)", [&] {
      launch_gdn_conv_prep_wide(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, T, qkv.p, g.p,
                                beta.p, nullptr);
    });
    for (int strip : {0, 8, 16, 32, 64}) {
      if (strip != 0 && T != 4096) continue;
      const std::string name =
          "stream strip " + std::to_string(strip ? strip : gdn_conv_prep_stream_strip(T));
      row(name.c_str(), [&] {
        launch_gdn_conv_prep_stream(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, T, qkv.p, g.p,
                                    beta.p, nullptr, strip, GdnConvForm::kStream);
      });
      row(("head " + name.substr(7)).c_str(), [&] {
        launch_gdn_conv_prep_stream(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, T, qkv.p, g.p,
                                    beta.p, nullptr, strip, GdnConvForm::kHead);
      });
    }
  }
  CK(cudaDeviceSynchronize());
}

// Where one WY item's time goes (the fused GDN design of docs/perf/gdn_prefill.md needs the
// A / T part of an item in ~2.5 us per chunk, sessions 21-24): the shipped WY build with phase
// stamps on 4096 tokens of one sequence, (a) 2 chunks x 48 heads, one block per SM, (b) all 64
// chunks (4 blocks per SM, as the layer runs it). Per phase the median over blocks, in SM cycles
// and in ns (cycles over the same blocks' globaltimer span): the K / gate loads, A with T's
// diagonal blocks, T's off-diagonal blocks, then W and U (V loaded by warps 2-3) to the last
// warp's last store issued; the item from entry to that end.
TEST(CudaGdn, WyPhaseTiming) {
  REQUIRE_GPU();
  DS_REQUIRE_PERF();
  if (device_sm() < 90) GTEST_SKIP() << "the staged kernels are sm 90 only";
  const GdnShape s = shape_27b();
  const int T = 4096, n_chunks = T / 64, nv = s.n_v_heads;
  std::mt19937 rng(31);
  const auto [qkv, g, beta] = random_wy_inputs(s, T, rng);
  std::vector<int> chunks;
  for (int c = 0; c < n_chunks; ++c) chunks.insert(chunks.end(), {0, 64 * c, 64, c});
  DevBuf<bf16> d_qkv(qkv.size()), w(size_t(T) * nv * 128), u(size_t(T) * nv * 128);
  upload(d_qkv, to_bf16(qkv));
  DevBuf<int32_t> d_chunks(chunks.size());
  upload(d_chunks, chunks);
  DevBuf<float> d_g(g.size()), d_beta(beta.size());
  upload(d_beta, beta);
  DevBuf<unsigned long long> st(size_t(n_chunks) * nv * kGdnWyStamps);
  for (int grid : {2, n_chunks}) {
    std::vector<double> phase[6];  // loads, A + diagonal, off-diagonal, W / U, item, ns per cycle
    for (int rep = 0; rep < 5; ++rep) {
      upload(d_g, g);  // the kernel turns g into gamma in place
      CK(cudaMemset(st.p, 0, st.n * sizeof(unsigned long long)));
      launch_gdn_wy_mma_timed(s, reinterpret_cast<const int4*>(d_chunks.p), grid, d_qkv.p, d_g.p,
                              d_beta.p, w.p, u.p, st.p, nullptr);
      CK(cudaDeviceSynchronize());
      std::vector<unsigned long long> h(size_t(grid) * nv * kGdnWyStamps);
      CK(cudaMemcpy(h.data(), st.p, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
      if (rep == 0) continue;  // warm-up
      for (size_t b = 0; b < h.size(); b += kGdnWyStamps) {
        const unsigned long long* x = h.data() + b;
        const unsigned long long end = *std::max_element(x + 4, x + 8);
        phase[0].push_back(double(x[1] - x[0]));
        phase[1].push_back(double(x[2] - x[1]));
        phase[2].push_back(double(x[3] - x[2]));
        phase[3].push_back(double(end - x[3]));
        phase[4].push_back(double(end - x[0]));
        if (x[4] > x[0]) phase[5].push_back(double(x[9] - x[8]) / double(x[4] - x[0]));
      }
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v.empty() ? 0.0 : v[v.size() / 2];
    };
    const double ns_per_cycle = median(phase[5]);
    const char* names[] = {"K / gate loads", "A + T diagonal blocks", "T off-diagonal blocks",
                           "W, U (V late) to the last store", "the item (entry to end)"};
    for (int p = 0; p < 5; ++p) {
      const double cyc = median(phase[p]);
      std::printf("WY PHASE %2d chunks x %d heads: %-33s %8.0f cycles %7.2f us\n", grid, nv,
                  names[p], cyc, cyc * ns_per_cycle * 1e-3);
    }
    std::printf("WY PHASE %2d chunks x %d heads: clock %.0f MHz (globaltimer / clock64 of thread 0,"
                " median over %zu blocks)\n",
                grid, nv, ns_per_cycle > 0 ? 1e3 / ns_per_cycle : 0.0, phase[5].size());
    EXPECT_GT(median(phase[4]), 0.0);
  }
}

TEST(CudaGdn, PrefillStageTiming) {
  REQUIRE_GPU();
  DS_REQUIRE_PERF();
  if (device_sm() < 90) GTEST_SKIP() << "the staged kernels are sm 90 only";
  const GdnShape s = shape_27b();
  std::mt19937 rng(6);
  const HostLayer hl = make_layer(s, rng);
  const DevLayer dl = upload_layer(s, hl);
  const int T = 4096, n_chunks = T / 64, max_chunks = n_chunks + 1, n_v = s.n_v_heads;
  const auto proj = random_proj(s, T, rng);
  DevBuf<bf16> d_proj(proj.size()), d_out(size_t(T) * s.out_dim());
  upload(d_proj, to_bf16(proj));
  DevPool pool(s, 1);
  CK(cudaMemset(pool.rec.p, 0, pool.rec.n * 4));
  CK(cudaMemset(pool.conv.p, 0, pool.conv.n * 2));
  DevBuf<int32_t> d_cu(2), d_pos(1), d_slot(1), d_chunk0(2), d_chunks(4 * size_t(max_chunks));
  upload(d_cu, std::vector<int>{0, T});
  upload(d_pos, std::vector<int>{T});
  upload(d_slot, std::vector<int>{0});
  upload(d_chunk0, std::vector<int>{0, n_chunks});
  std::vector<int> chunks(4 * size_t(max_chunks), 0);
  for (int c = 0; c < max_chunks; ++c) {
    const bool ok = c < n_chunks;
    chunks[4 * c] = ok ? 0 : -1;
    chunks[4 * c + 1] = ok ? 64 * c : 0;
    chunks[4 * c + 2] = ok ? 64 : 0;
    chunks[4 * c + 3] = ok ? c : 0;
  }
  upload(d_chunks, chunks);
  const int4* ch4 = reinterpret_cast<const int4*>(d_chunks.p);
  DevBuf<bf16> qkv(size_t(T) * s.qkv_dim()), wm(size_t(T) * n_v * 128), um(size_t(T) * n_v * 128),
      hs(size_t(max_chunks) * n_v * 128 * 128);
  DevBuf<float> g(size_t(T) * n_v), g0(size_t(T) * n_v), beta(size_t(T) * n_v);
  const GdnLayerWeights w = dl.w();
  const GdnStatePool pp = pool.pool();
  auto stage = [&](const char* name, auto&& f) {
    const double ms = median_ms([&](int) { f(); }, 20);
    std::printf("STAGE gdn prefill 4096 tokens %-40s %8.1f us\n", name, ms * 1e3);
    return ms;
  };
  stage("conv_prep (generic, 1 token/block)", [&] {
    launch_gdn_conv_prep(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, T, qkv.p, g.p, beta.p,
                         nullptr);
  });
  stage("conv_prep_multi (8 tokens/block)", [&] {
    launch_gdn_conv_prep_multi(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, T, qkv.p, g.p,
                               beta.p, nullptr);
  });
  stage("conv_prep_wide (warp per head x 8 tokens)", [&] {
    launch_gdn_conv_prep_wide(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, T, qkv.p, g.p,
                              beta.p, nullptr);
  });
  stage("conv_prep_stream (gdn_prefill_conv.cu)", [&] {
    launch_gdn_conv_prep_stream(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, T, qkv.p, g.p,
                                beta.p, nullptr, 0, GdnConvForm::kStream);
  });
  stage("conv_prep_stream, head per warp", [&] {
    launch_gdn_conv_prep_stream(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, T, qkv.p, g.p,
                                beta.p, nullptr, 0, GdnConvForm::kHead);
  });
  // The WY kernels turn g into gamma in place: each timed run first restores g (timed alone too).
  CK(cudaMemcpy(g0.p, g.p, g.n * 4, cudaMemcpyDeviceToDevice));
  auto restore_g = [&] {
    CK(cudaMemcpyAsync(g.p, g0.p, g.n * 4, cudaMemcpyDeviceToDevice, nullptr));
  };
  const double t_restore = stage("(g restore copy, included below)", restore_g);
  // SIMT off-diagonal; tf32 by row block; tf32 balanced; tf32 balanced with the late V load
  for (int arm : {0, 1, 2, 3}) {
    const bool tf32 = arm > 0;
    const char* names[][2] = {
        {"wy_mma SIMT off-diagonal (+ restore)", "  = wy_mma SIMT"},
        {"wy_mma tf32 path (+ restore)", "  = wy_mma tf32"},
        {"wy_mma tf32 balanced (+ restore)", "  = wy_mma tf32 balanced"},
        {"wy_mma tf32 balanced, late V (+ restore)", "  = wy_mma tf32 balanced, late V"}};
    const double ms = stage(names[arm][0], [&] {
      restore_g();
      launch_gdn_wy_mma(s, ch4, max_chunks, qkv.p, g.p, beta.p, wm.p, um.p, nullptr, tf32,
                        arm >= 2 ? arm - 1 : 0);
    });
    std::printf("STAGE gdn prefill 4096 tokens %-40s %8.1f us\n", names[arm][1],
                (ms - t_restore) * 1e3);
  }
  // One wave: the first 2 chunks of the 48 heads, 96 blocks, at most one per SM, so the time is
  // one (chunk, head) item's latency with the SM to itself: what a WY warpgroup inside the fused
  // kernel would need per chunk (docs/perf/gdn_prefill.md, session 24's next design).
  {
    const double ms = stage("wy_mma late V, 96 items, 1 per SM (+ r.)", [&] {
      restore_g();
      launch_gdn_wy_mma(s, ch4, 2, qkv.p, g.p, beta.p, wm.p, um.p, nullptr, true, 2);
    });
    std::printf("STAGE gdn prefill 4096 tokens %-40s %8.1f us\n", "  = one WY item's latency",
                (ms - t_restore) * 1e3);
  }
  restore_g();
  launch_gdn_wy_mma(s, ch4, max_chunks, qkv.p, g.p, beta.p, wm.p, um.p, nullptr, true);
  // (The slice state pass writes V_new over U: it runs last; timings do not depend on values.)
  const std::pair<GdnSliceState, const char*> states[] = {
      {GdnSliceState::kV64, "slice state pass, 64-column slices"},
      {GdnSliceState::kV64Lean, "slice state pass, 64 columns, lean"},
      {GdnSliceState::kWgmma, "slice state pass, 64 columns, wgmma"}};
  const GdnFormsRestore restore_forms;
  for (const auto& [st, name] : states) {
    stage(name, [&] {
      launch_gdn_slice_scan(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, ch4, d_chunk0.p,
                            max_chunks, qkv.p, g.p, wm.p, um.p, hs.p, d_out.p, st, 4, nullptr,
                            /*stages=*/1, nullptr, T);
    });
  }
  set_gdn_state_form(GdnStateForm::kTight);
  stage("slice state pass, 64 columns, wgmma, tight", [&] {
    launch_gdn_slice_scan(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, ch4, d_chunk0.p,
                          max_chunks, qkv.p, g.p, wm.p, um.p, hs.p, d_out.p, GdnSliceState::kWgmma,
                          4, nullptr, /*stages=*/1, nullptr, T);
  });
  set_gdn_state_form(restore_forms.state);
  for (int warps : {4, 8}) {
    stage(warps == 4 ? "slice output + gated norm, 4 warps" : "slice output + gated norm, 8 warps",
          [&] {
            launch_gdn_slice_scan(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, ch4, d_chunk0.p,
                                  max_chunks, qkv.p, g.p, wm.p, um.p, hs.p, d_out.p,
                                  GdnSliceState::kV64, warps, nullptr, /*stages=*/2);
          });
  }
  // State pass + output one after the other (slice_scan_cs) and overlapped (slice_scan_ov: the
  // output as a programmatic dependent of the state pass, per-chunk ready flags cleared first),
  // on a created stream (as the engine launches) and on the legacy default stream.
  DevBuf<int> ready(size_t(max_chunks) * n_v);
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  auto stage_on = [&](cudaStream_t sm, const char* name, auto&& f) {
    for (int i = 0; i < 3; ++i) f(sm);
    const double ms = test::median_event_ms(sm, 20, [&] { f(sm); });
    std::printf("STAGE gdn prefill 4096 tokens %-40s %8.1f us\n", name, ms * 1e3);
    return ms;
  };
  auto clear = [&](cudaStream_t sm) { CK(cudaMemsetAsync(ready.p, 0, ready.n * sizeof(int), sm)); };
  auto serial = [&](cudaStream_t sm) {
    launch_gdn_slice_scan(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, ch4, d_chunk0.p,
                          max_chunks, qkv.p, g.p, wm.p, um.p, hs.p, d_out.p, GdnSliceState::kV64, 8,
                          sm, /*stages=*/3);
  };
  auto overlapped = [&](GdnSliceState state) {
    return [&, state](cudaStream_t sm) {
      clear(sm);
      launch_gdn_slice_scan(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, ch4, d_chunk0.p,
                            max_chunks, qkv.p, g.p, wm.p, um.p, hs.p, d_out.p, state, 8, sm,
                            /*stages=*/3, ready.p, T);
    };
  };
  stage_on(nullptr, "slice state + output, serial (null stream)", serial);
  stage_on(nullptr, "slice state + output, overlapped (null st.)", overlapped(GdnSliceState::kV64));
  const double t_clear = stage_on(st, "(ready flags clear, included below)", clear);
  stage_on(st, "slice state pass + output, serial", serial);
  const GdnOutForm form0 = gdn_out_form();
  const struct {
    GdnSliceState state;
    GdnOutForm form;
    const char* name;
    GdnStateForm state_form = GdnStateForm::kWg;
  } ov_arms[] = {
      {GdnSliceState::kV64, form0, "slice state pass + output, overlapped"},
      {GdnSliceState::kV64Lean, form0, "slice state pass (lean) + output, overlapped"},
      {GdnSliceState::kWgmma, GdnOutForm::kCpAsync, "wgmma state + cp.async output, overlapped"},
      {GdnSliceState::kWgmma, GdnOutForm::kTma, "wgmma state + TMA output, overlapped"},
      {GdnSliceState::kWgmma, GdnOutForm::kWgmma, "wgmma state + wgmma output, overlapped"},
      {GdnSliceState::kWgmma, GdnOutForm::kWgmma, "tight wgmma state + wgmma output, overl.",
       GdnStateForm::kTight}};
  double t_ov_wg = 0;  // the shipped pair: wgmma state + wgmma output
  for (const auto& [state, form, name, state_form] : ov_arms) {
    set_gdn_out_form(form);
    set_gdn_state_form(state_form);
    const double t_ov = stage_on(st, name, overlapped(state));
    if (state == GdnSliceState::kWgmma && form == GdnOutForm::kWgmma &&
        state_form == GdnStateForm::kWg)
      t_ov_wg = t_ov;
    std::printf("STAGE gdn prefill 4096 tokens %-40s %8.1f us\n", "  = the same less the clear",
                (t_ov - t_clear) * 1e3);
  }
  // WY beside the pair on a second stream (the design of docs/perf/gdn_prefill.md, session 26):
  // how much does WY on the second half's chunks (32-63) slow the shipped pair when both run at
  // once? Interference only: the pair runs over all 64 chunks as above, and WY reads the same qkv
  // and beta but its own g (a copy of the input gates, since WY turns g into gamma in place) and
  // writes its own W / U, so nothing either reads is written by the other. Rows: WY alone on the
  // 32 chunks, then the pair with it (the second stream forks from the first and joins it before
  // the end event); compare with "wgmma state + wgmma output, overlapped" above.
  {
    set_gdn_out_form(GdnOutForm::kWgmma);
    set_gdn_state_form(GdnStateForm::kWg);
    DevBuf<bf16> wm2(wm.n), um2(um.n);
    DevBuf<float> g2(g.n);
    cudaStream_t s2;
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t fork, join;
    CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    const int half = n_chunks / 2;
    auto wy_half = [&](cudaStream_t sm) {
      CK(cudaMemcpyAsync(g2.p, g0.p, g2.n * 4, cudaMemcpyDeviceToDevice, sm));
      launch_gdn_wy_mma(s, ch4 + half, n_chunks - half, qkv.p, g2.p, beta.p, wm2.p, um2.p, sm,
                        true);
    };
    const double t_wy = stage_on(st, "WY on chunks 32-63 alone (+ g copy)", wy_half);
    // The pair is enqueued first and on a higher-priority stream, so that its 96 state CTAs get
    // their SMs before WY's 1536 blocks can fill them (else the row would time the two one after
    // the other, not side by side).
    int lo_prio = 0, hi_prio = 0;
    CK(cudaDeviceGetStreamPriorityRange(&lo_prio, &hi_prio));
    cudaStream_t s1;
    CK(cudaStreamCreateWithPriority(&s1, cudaStreamNonBlocking, hi_prio));
    auto both = [&](cudaStream_t sm) {
      CK(cudaEventRecord(fork, sm));
      overlapped(GdnSliceState::kWgmma)(sm);
      CK(cudaStreamWaitEvent(s2, fork, 0));
      wy_half(s2);
      CK(cudaEventRecord(join, s2));
      CK(cudaStreamWaitEvent(sm, join, 0));
    };
    const double t_both = stage_on(s1, "wgmma pair + WY(32-63) on a 2nd stream", both);
    std::printf("STAGE gdn prefill 4096 tokens %-40s %8.1f us\n", "  = the same less the clear",
                (t_both - t_clear) * 1e3);
    std::printf("STAGE gdn prefill 4096 tokens %-40s %8.1f us\n", "  (WY alone, then the pair)",
                (t_wy + t_ov_wg - t_clear) * 1e3);
    CK(cudaStreamDestroy(s1));
    CK(cudaEventDestroy(fork));
    CK(cudaEventDestroy(join));
    CK(cudaStreamDestroy(s2));
  }
  // The output kernels alone (the state pass run first, its flags left complete).
  set_gdn_out_form(form0);
  set_gdn_state_form(restore_forms.state);
  overlapped(GdnSliceState::kWgmma)(st);
  for (GdnOutForm form : {GdnOutForm::kCpAsync, GdnOutForm::kTma, GdnOutForm::kWgmma}) {
    set_gdn_out_form(form);
    stage_on(st,
             form == GdnOutForm::kWgmma ? "output alone, wgmma"
             : form == GdnOutForm::kTma ? "output alone, TMA mma.sync"
                                        : "output alone, cp.async mma.sync",
             [&](cudaStream_t sm) {
               launch_gdn_slice_scan(s, w, pp, d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, ch4,
                                     d_chunk0.p, max_chunks, qkv.p, g.p, wm.p, um.p, hs.p,
                                     d_out.p, GdnSliceState::kWgmma, 8, sm, /*stages=*/2, ready.p,
                                     T);
             });
  }
  // Last: the state pass with the output fused in (one kernel; no flags to clear, but the
  // launch clears them as the overlapped pair's does). Written without a GPU: if it hangs, only
  // this row is lost.
  set_gdn_out_form(GdnOutForm::kWgmma);
  for (GdnStateForm f :
       {GdnStateForm::kFused, GdnStateForm::kFused2, GdnStateForm::kFused2Wg}) {
    set_gdn_state_form(f);
    const double t_f = stage_on(st,
                                f == GdnStateForm::kFused    ? "state pass and output fused (one kernel)"
                                : f == GdnStateForm::kFused2 ? "fused, two output warpgroups"
                                                             : "fused2 on the shipped chain step",
                                overlapped(GdnSliceState::kWgmma));
    std::printf("STAGE gdn prefill 4096 tokens %-40s %8.1f us\n", "  = the same less the clear",
                (t_f - t_clear) * 1e3);
  }
  set_gdn_state_form(restore_forms.state);
  set_gdn_out_form(form0);
  CK(cudaStreamSynchronize(st));
  CK(cudaStreamDestroy(st));
  CK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace ds::cuda

namespace ds::cuda {
namespace {
// One 4096-token prefill and one batch-1 decode, for a profiler (run with
// --gtest_also_run_disabled_tests --gtest_filter=*Profile* under ncu).
TEST(CudaGdn, DISABLED_ProfileOnce) {
  REQUIRE_GPU();
  const GdnShape s = shape_27b();
  std::mt19937 rng(9);
  const HostLayer hl = make_layer(s, rng);
  const DevLayer dl = upload_layer(s, hl);
  const int T = 4096;
  const auto proj = random_proj(s, T, rng);
  DevBuf<bf16> d_proj(proj.size()), d_out(size_t(T) * s.out_dim());
  upload(d_proj, to_bf16(proj));
  DevPool pool(s, 1);
  CK(cudaMemset(pool.rec.p, 0, pool.rec.n * 4));
  CK(cudaMemset(pool.conv.p, 0, pool.conv.n * 2));
  DevBuf<int32_t> d_cu(2), d_pos(1), d_slot(1);
  upload(d_cu, std::vector<int>{0, T});
  upload(d_pos, std::vector<int>{T});
  upload(d_slot, std::vector<int>{0});
  const size_t wsb = gdn_prefill_workspace_bytes(s, T, 1);
  DevBuf<unsigned char> ws(wsb);
  for (const PrefillVariant& var : prefill_variants()) {
    launch_gdn_prefill(s, dl.w(), pool.pool(), d_proj.p, d_cu.p, d_pos.p, d_slot.p, 1, T, ws.p, wsb,
                       d_out.p, nullptr, var.dispatch);
  }
  launch_gdn_decode(s, dl.w(), pool.pool(), d_proj.p, d_pos.p, d_slot.p, 1, d_out.p, nullptr);
  CK(cudaDeviceSynchronize());
}
}  // namespace
}  // namespace ds::cuda

namespace ds::cuda {
namespace {

// Last in the file: the fused state pass + output (gdn_prefill_slice.cu, session 24, written
// without a GPU) bit for bit against slice_scan_cs, as PrefillOverlapBitExact's arms.
TEST(CudaGdn, PrefillFusedBitExact) { prefill_overlap_bit_exact(/*fused_only=*/true); }

}  // namespace
}  // namespace ds::cuda
