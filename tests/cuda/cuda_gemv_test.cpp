// The decode GEMV / skinny GEMM (src/cuda/gemv.cu, variant gemm.skinny_mma) against cuBLASLt and
// an fp64 CPU loop:
//  - odd shapes (m = 1, 3, 5, 8, 9, 16; n not a multiple of any tile; k = 8, 24, 40 (not a
//    multiple of the 32-wide k-step), 5128, 32768) with every compiled config, bf16 and fp32
//    output, accumulate, poisoned outputs: normalised error vs fp64 < 4e-3 (bf16 out) / 1e-4
//    (fp32 out: tensor-core fp32 accumulation, as cuda_gemm_test);
//  - every Qwen3.5-27B decode shape at m = 1, 4, 16 with the shipped config vs cuBLASLt (and the
//    engine's path through the registry where the guard picks it, bit-identical): bf16 out within 1
//    bf16 ulp of the larger magnitude, or 1e-3 of the output's max where both are near zero (the
//    two sum in different orders; each rounds an fp32 sum once); fp32 out (lm_head) relative L2 <
//    1e-4 (the measured value is printed);
//  - batch invariance: token i's outputs are bit-identical for m = 1 and m = 16 (the summation
//    order does not depend on m);
//  - programmatic dependent launch: a dependent pair of launches reads finished data, on a stream
//    and from a CUDA graph;
//  - the guard (dispatch) and the launch errors (unaligned pointers, bad shapes).
// The bulk-copy GEMV (gemv_bulk.cu, variant gemm.gemv_bulk; tests CudaGemvBulk.*): odd shapes with
// every config vs fp64, the 27B k <= 8192 shapes at m 1, 2, 3, 4, 8 vs cuBLASLt and vs fp64 on
// sampled rows (tolerances at each test), every config and the engine path bit-identical, batch
// invariance m 1..8, dependent launches, guard and errors.
// The narrow-output GEMV (gemv_narrow.cu, variant gemm.gemv_narrow; tests CudaGemvNarrow.*): odd
// shapes (1..8 tokens, 1 to 8 slices per row with a shorter last slice, grids of 1, 7 and all
// SMs) with every config vs fp64; down / gdn_out / attn_o at m 1, 2, 3, 4, 8 vs cuBLASLt and vs
// fp64 on sampled rows, every config and the engine path bit-identical; batch and grid invariance;
// PDL chains (bulk -> narrow as in the MLP, narrow -> narrow); guard and errors; a second device
// (the per-device shared-memory opt-in; 2 GPUs, else skipped).
// The tensor-core bulk-copy GEMV (gemv_bulk_mma.cu, variant gemm.gemv_bulk_mma, off unless
// DS_GEMV_MMA=1; tests CudaGemvBulkMma.*, launched directly, so they run with the switch either
// way): odd shapes (m 1..16, n 1 .. 48 groups per block, k 64..8192 with a 64-element last chunk,
// grids of 1 and 7) with every config vs fp64 on every element (poisoned outputs); gdn_in /
// gdn_out / attn_qkv / attn_o / gate_up at m 3, 4, 8, 13, 16 vs cuBLASLt and fp64 on sampled rows,
// every config, PDL and the engine path bit-identical; batch invariance (m 16 vs m 1, 3, 8, 13);
// PDL chains (mma -> mma, bulk -> mma) on a stream and from a graph; guard and errors.
// DS_GEMV_SWEEP=1 also times every config on every decode shape (rotating weights past L2) next to
// cuBLASLt and prints a table (used to pick skinny_gemm_config, gemv_bulk_config,
// gemv_narrow_config and the guards).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <tuple>

#include "core/error.h"
#include "cuda/argmax.h"
#include "cuda/dispatch.h"
#include "cuda/gemm.h"
#include "cuda/gemv.h"
#include "cuda/gemv_bulk_norm.h"
#include "cuda/kernels.h"
#include "cuda_test_util.h"

namespace ds {
namespace {

using test::DevBuf;
using bf = uint16_t;
using cuda::GemmOut;
using cuda::SkinnyConfig;

const __nv_bfloat16* B(const DevBuf<bf>& b, size_t off = 0) {
  return reinterpret_cast<const __nv_bfloat16*>(b.ptr + off);
}

// fp64 reference y[m, n] (+ init).
std::vector<float> reference(const std::vector<bf>& x, const std::vector<bf>& w,
                             const std::vector<float>& init, int m, int n, int k) {
  std::vector<float> xf = test::to_f32(x), wf = test::to_f32(w);
  std::vector<float> y(size_t(m) * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double s = init.empty() ? 0.0 : init[size_t(i) * n + j];
      const float* xr = &xf[size_t(i) * k];
      const float* wr = &wf[size_t(j) * k];
      for (int c = 0; c < k; ++c) s += double(xr[c]) * wr[c];
      y[size_t(i) * n + j] = float(s);
    }
  return y;
}

std::vector<float> download_out(const DevBuf<char>& y, size_t count, bool f32) {
  auto raw = y.download();
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) {
    if (f32) {
      std::memcpy(&v[i], raw.data() + 4 * i, 4);
    } else {
      bf b;
      std::memcpy(&b, raw.data() + 2 * i, 2);
      v[i] = bf16_to_f32(b);
    }
  }
  return v;
}

using LaunchFn = std::function<void(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y,
                                    int m, int n, int k, GemmOut out, bool acc)>;

// One shape, one kernel launch: poisoned (or accumulated-into) output vs the fp64 loop.
void check_launch_vs_cpu(int m, int n, int k, GemmOut out, bool acc, const LaunchFn& launch,
                         const std::string& label, std::mt19937& rng) {
  const bool f32 = out == GemmOut::kF32;
  auto x = test::random_bf16(size_t(m) * k, rng), w = test::random_bf16(size_t(n) * k, rng, 0.05f);
  DevBuf<bf> dx(x), dw(w);
  DevBuf<char> y(size_t(m) * n * (f32 ? 4 : 2));
  std::vector<float> init;
  if (acc) {
    std::normal_distribution<float> nd;
    init.resize(size_t(m) * n);
    std::vector<char> raw(y.n);
    for (size_t i = 0; i < init.size(); ++i) {
      init[i] = f32 ? nd(rng) : round_bf16(nd(rng));
      if (f32) {
        std::memcpy(raw.data() + 4 * i, &init[i], 4);
      } else {
        const bf b = f32_to_bf16(init[i]);
        std::memcpy(raw.data() + 2 * i, &b, 2);
      }
    }
    y.upload(raw);
  } else {
    y.poison();
  }
  launch(B(dx), B(dw), y.ptr, m, n, k, out, acc);
  DS_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = download_out(y, size_t(m) * n, f32);
  const auto ref = reference(x, w, init, m, n, k);
  const double e = test::norm_err(got, ref);
  EXPECT_LT(e, f32 ? 1e-4 : 4e-3) << "m " << m << " n " << n << " k " << k << " cfg " << label
                                  << (f32 ? " f32" : " bf16") << (acc ? " +=" : "");
}

void check_vs_cpu(int m, int n, int k, GemmOut out, bool acc, const SkinnyConfig& cfg,
                  std::mt19937& rng) {
  check_launch_vs_cpu(
      m, n, k, out, acc,
      [&](const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, int m_, int n_, int k_,
          GemmOut o, bool a) { cuda::launch_skinny_gemm(x, w, y, m_, n_, k_, o, a, cfg, 0); },
      cfg.name(), rng);
}

TEST(CudaGemv, OddShapesEveryConfig) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(11);
  for (const SkinnyConfig& cfg : cuda::skinny_gemm_configs()) {
    for (int m : {1, 3, 9, 16})
      for (auto [n, k] :
           {std::pair{1, 8}, std::pair{37, 24}, std::pair{203, 40}, std::pair{77, 5128}}) {
        check_vs_cpu(m, n, k, GemmOut::kBF16, false, cfg, rng);
        check_vs_cpu(m, n, k, GemmOut::kF32, false, cfg, rng);
      }
    check_vs_cpu(8, 133, 200, GemmOut::kBF16, true, cfg, rng);
    check_vs_cpu(5, 70, 264, GemmOut::kF32, true, cfg, rng);
  }
  // The largest k the guard accepts, a wide n, one config each.
  check_vs_cpu(2, 24, cuda::kSkinnyMaxK, GemmOut::kBF16, false, {1, 8, 4}, rng);
  check_vs_cpu(16, 1000, 1024, GemmOut::kF32, false, {4, 4, 4}, rng);
}

// ulp of a bf16 value of magnitude a (8 significant bits).
double bf16_ulp(double a) {
  if (a < 1e-30) return 0;
  return std::ldexp(1.0, int(std::floor(std::log2(a))) - 7);
}

struct Op {
  const char* name;
  int n, k;
  bool f32;
};
const Op kOps27b[] = {{"gdn_in", 16480, 5120, false},   {"gdn_out", 5120, 6144, false},
                      {"attn_qkv", 14336, 5120, false}, {"attn_o", 5120, 6144, false},
                      {"gate_up", 34816, 5120, false},  {"down", 5120, 17408, false},
                      {"lm_head", 248320, 5120, true}};

// The variant the registry picks for a shape the other kernels' guard tests name: gemv_tma_narrow
// where $DS_GEMV_TMA_NARROW selects it (it is listed ahead of them), else `otherwise`.
std::string tma_narrow_or(int m, int n, int k, const std::string& otherwise) {
  return cuda::gemv_tma_narrow_preferred(m, n, k) ? "gemv_tma_narrow" : otherwise;
}

// A device pool of random bf16 big enough for the largest weight: 64 Mi
// host-random values uploaded with different shifts (cheap to make; rows never
// repeat with the row length's period).
struct Pool {
  DevBuf<bf> buf;
  explicit Pool(size_t n, std::mt19937& rng, float scale) : buf(n) {
    const size_t chunk = size_t(64) << 20;
    auto src = test::random_bf16(chunk + 4096, rng, scale);
    for (size_t off = 0, i = 0; off < n; off += chunk, ++i) {
      const size_t len = std::min(chunk, n - off);
      DS_CUDA_CHECK(cudaMemcpy(buf.ptr + off, src.data() + (i * 997) % 4096, len * 2,
                               cudaMemcpyHostToDevice));
    }
  }
};

// bf16 outputs a vs cuBLASLt's b (same size, [m, o.n]): each within 1 bf16 ulp of the larger
// magnitude, or 1e-3 of b's max where both are near zero (the two sum in different orders; each
// rounds an fp32 sum once). Expects no output out of tolerance; returns what the callers print.
struct CublasLtDiff {
  size_t differ = 0;  // outputs not bit-identical to cuBLASLt's
  double worst = 0;   // the largest |a - b| / tol
  double ymax = 0;    // max |b|
};
CublasLtDiff expect_bf16_close_to_cublaslt(const std::vector<float>& a, const std::vector<float>& b,
                                           const Op& o, int m) {
  CublasLtDiff r;
  for (float v : b) r.ymax = std::max(r.ymax, double(std::fabs(v)));
  size_t bad = 0, first_bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(double(a[i]) - b[i]);
    const double tol =
        std::max(bf16_ulp(std::max(std::fabs(a[i]), std::fabs(b[i]))), 1e-3 * r.ymax);
    if (!(d <= tol)) {
      if (!bad) first_bad = i;
      ++bad;
    }
    if (d > 0) ++r.differ;
    r.worst = std::max(r.worst, d / std::max(tol, 1e-30));
  }
  EXPECT_EQ(bad, 0u) << o.name << " m " << m << ": first at " << first_bad << " (" << a[first_bad]
                     << " vs " << b[first_bad] << ")";
  return r;
}

// The rows of op o checked against fp64: the first and last 128 and 128 spread ones (i.e. across
// block boundaries), with their weights (w [rows.size(), o.k]) downloaded once per op.
struct SampledRows {
  std::vector<int> rows;
  std::vector<bf> w;
};
SampledRows sample_rows(const Op& o, const Pool& wpool) {
  SampledRows s;
  for (int i = 0; i < 128; ++i) s.rows.push_back(i), s.rows.push_back(o.n - 128 + i);
  for (int i = 0; i < 128; ++i)
    s.rows.push_back(int((int64_t(o.n) * i / 128 + (i * 37) % 97) % o.n));
  s.w.resize(s.rows.size() * size_t(o.k));
  for (size_t r = 0; r < s.rows.size(); ++r)
    DS_CUDA_CHECK(cudaMemcpy(s.w.data() + r * o.k, wpool.buf.ptr + size_t(s.rows[r]) * o.k,
                             size_t(o.k) * 2, cudaMemcpyDeviceToHost));
  return s;
}

// Outputs a [m, o.n] of y = x w^T vs fp64 on the sampled rows: |y - ref| <= 1 bf16 ulp of
// max(|y|, |ref|) (bf16 out) + 1e-4 * sum_i |x_i w_i|. Expects none out of tolerance; returns the
// worst |y - ref| / tol.
double expect_sampled_rows_match_fp64(const std::vector<bf>& x, const SampledRows& s,
                                      const std::vector<float>& a, const Op& o, int m) {
  size_t bad64 = 0;
  double worst64 = 0;
  for (int t = 0; t < m; ++t)
    for (size_t r = 0; r < s.rows.size(); ++r) {
      double sum = 0, mag = 0;
      for (int c = 0; c < o.k; ++c) {
        const double p =
            double(bf16_to_f32(x[size_t(t) * o.k + c])) * bf16_to_f32(s.w[r * o.k + c]);
        sum += p;
        mag += std::fabs(p);
      }
      const double got = a[size_t(t) * o.n + s.rows[r]];
      const double tol =
          (o.f32 ? 0.0 : bf16_ulp(std::max(std::fabs(got), std::fabs(sum)))) + 1e-4 * mag;
      const double d = std::fabs(got - sum);
      if (!(d <= tol)) ++bad64;
      worst64 = std::max(worst64, d / std::max(tol, 1e-30));
    }
  EXPECT_EQ(bad64, 0u) << o.name << " m " << m << " vs fp64";
  return worst64;
}

TEST(CudaGemv, Shapes27bMatchCublasLt) {
  DS_REQUIRE_GPU();
  int dev = 0, major = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  DS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major != 9) GTEST_SKIP() << "the skinny kernel is guarded to sm 90";
  std::mt19937 rng(5);
  Pool wpool(size_t(248320) * 5120, rng, 0.02f);
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  int n_sms = 0;
  DS_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, dev));
  cuda::GemmEngine fast, ref;
  fast.set_dispatch(&reg);
  for (const Op& o : kOps27b) {
    for (int m : {1, 4, 16}) {
      const bool guarded = fast.variant(m, o.n, o.k) == "skinny_mma";
      // the shapes where it wins (long rows, m <= 4), unless the narrow GEMV (gemv_narrow.cu) or
      // the TMA one (gemv_tma.cu, the down projection from m 3 by default) is in front of it
      EXPECT_EQ(guarded, o.k >= 12288 && m <= 4 && !cuda::gemv_narrow_preferred(m, o.n, o.k) &&
                             !cuda::gemv_tma_narrow_preferred(m, o.n, o.k))
          << o.name << " m " << m;
      auto x = test::random_bf16(size_t(m) * o.k, rng);
      DevBuf<bf> dx(x);
      const size_t es = o.f32 ? 4 : 2, cnt = size_t(m) * o.n;
      DevBuf<char> y1(cnt * es), y2(cnt * es);
      y1.poison();
      y2.poison();
      const GemmOut out = o.f32 ? GemmOut::kF32 : GemmOut::kBF16;
      // The kernel with the config it ships with (on every shape, guarded or not) vs cuBLASLt;
      // where the guard picks it, the engine's own path must give the same bits.
      cuda::launch_skinny_gemm(B(dx), B(wpool.buf), y1.ptr, m, o.n, o.k, out, false,
                               cuda::skinny_gemm_config(m, o.n, o.k, n_sms), 0);
      ref.run(B(dx), B(wpool.buf), y2.ptr, m, o.n, o.k, out, 0);
      if (guarded) {
        DevBuf<char> y3(cnt * es);
        y3.poison();
        fast.run(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, out, 0);
        EXPECT_TRUE(y3.download() == y1.download()) << o.name << " m " << m << " engine path";
      }
      DS_CUDA_CHECK(cudaDeviceSynchronize());
      const auto a = download_out(y1, cnt, o.f32), b = download_out(y2, cnt, o.f32);
      if (o.f32) {
        const double e = test::norm_err(a, b);
        EXPECT_LT(e, 1e-4) << o.name << " m " << m;
        std::printf("  %-8s m=%-2d f32 out: relative L2 vs cuBLASLt %.2e\n", o.name, m, e);
      } else {
        const CublasLtDiff r = expect_bf16_close_to_cublaslt(a, b, o, m);
        std::printf(
            "  %-8s m=%-2d bf16 out: %zu of %zu differ from cuBLASLt "
            "(all within %.2f of "
            "the tolerance), max |y| %.3g\n",
            o.name, m, r.differ, cnt, r.worst, r.ymax);
      }
    }
  }
}

TEST(CudaGemv, BatchInvariant) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(9);
  for (auto [n, k] : {std::pair{5120, 6144}, std::pair{16480, 5120}, std::pair{300, 5128}}) {
    auto x = test::random_bf16(size_t(16) * k, rng), w = test::random_bf16(size_t(n) * k, rng);
    DevBuf<bf> dx(x), dw(w);
    DevBuf<char> y16(size_t(16) * n * 2), y1(size_t(n) * 2);
    cuda::launch_skinny_gemm(B(dx), B(dw), y16.ptr, 16, n, k, GemmOut::kBF16, false,
                             cuda::skinny_gemm_config(16, n, k, 132), 0);
    const auto a = y16.download();
    for (int i : {0, 7, 8, 15}) {
      cuda::launch_skinny_gemm(B(dx, size_t(i) * k), B(dw), y1.ptr, 1, n, k, GemmOut::kBF16, false,
                               cuda::skinny_gemm_config(1, n, k, 132), 0);
      const auto b = y1.download();
      EXPECT_EQ(std::memcmp(a.data() + size_t(i) * n * 2, b.data(), size_t(n) * 2), 0)
          << "token " << i << " n " << n << " k " << k;
    }
  }
}

// The two-GEMM chain y1 = x w1^T, y2 = y1 w2^T of the DependentLaunchesChain tests: run without
// PDL (chain(false)) it gives the reference (y2 vs the fp64 loop on y1's bf16 values); with PDL
// (chain(true)) on the stream and replayed from a CUDA graph, 3 times each with y1 and y2 poisoned
// first, it must give the same bits.
template <typename Chain>
void expect_pdl_chain_matches_serial(Chain& chain, DevBuf<bf>& y1, DevBuf<bf>& y2,
                                     const std::vector<bf>& w2, int m, int n1, int n2,
                                     cudaStream_t s) {
  y1.poison();
  y2.poison();
  chain(false);
  DS_CUDA_CHECK(cudaStreamSynchronize(s));
  const auto ref1 = y1.download(), ref2 = y2.download();
  EXPECT_LT(test::norm_err(test::to_f32(ref2), reference(ref1, w2, {}, m, n2, n1)), 4e-3);
  for (int rep = 0; rep < 3; ++rep) {
    y1.poison();
    y2.poison();
    chain(true);
    DS_CUDA_CHECK(cudaStreamSynchronize(s));
    EXPECT_TRUE(y1.download() == ref1) << "rep " << rep;
    EXPECT_TRUE(y2.download() == ref2) << "rep " << rep;
  }
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  DS_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  chain(true);
  DS_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  DS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    y1.poison();
    y2.poison();
    DS_CUDA_CHECK(cudaGraphLaunch(exec, s));
    DS_CUDA_CHECK(cudaStreamSynchronize(s));
    EXPECT_TRUE(y1.download() == ref1) << "graph rep " << rep;
    EXPECT_TRUE(y2.download() == ref2) << "graph rep " << rep;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Programmatic dependent launch: y2 = y1 w2^T launched right behind y1 = x w1^T (both with the
// PDL attribute) must read the finished y1 (poisoned before: a missing wait gives NaN), on a stream
// and replayed from a CUDA graph; bit-identical to the same launches without PDL.
TEST(CudaGemv, DependentLaunchesChain) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(13);
  const int m = 4, n1 = 16384, k1 = 5120, n2 = 1000;  // the first launch is long (168 MB)
  auto x = test::random_bf16(size_t(m) * k1, rng),
       w1 = test::random_bf16(size_t(n1) * k1, rng, 0.02f),
       w2 = test::random_bf16(size_t(n2) * n1, rng, 0.02f);
  DevBuf<bf> dx(x), dw1(w1), dw2(w2), y1(size_t(m) * n1), y2(size_t(m) * n2);
  cudaStream_t s;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto chain = [&](bool pdl) {
    SkinnyConfig c1 = cuda::skinny_gemm_config(m, n1, k1, 132),
                 c2 = cuda::skinny_gemm_config(m, n2, n1, 132);
    c1.pdl = c2.pdl = pdl;
    cuda::launch_skinny_gemm(B(dx), B(dw1), reinterpret_cast<void*>(y1.ptr), m, n1, k1,
                             GemmOut::kBF16, false, c1, s);
    cuda::launch_skinny_gemm(B(y1), B(dw2), reinterpret_cast<void*>(y2.ptr), m, n2, n1,
                             GemmOut::kBF16, false, c2, s);
  };
  expect_pdl_chain_matches_serial(chain, y1, y2, w2, m, n1, n2, s);
  cudaStreamDestroy(s);
}

TEST(CudaGemv, GuardAndErrors) {
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  using F = cuda::KernelFamily;
  EXPECT_EQ(reg.select(F::kGemm, reg.key(1, 5120, 17408)).name,
            tma_narrow_or(1, 5120, 17408, "gemv_narrow"));  // down, m <= 2
  EXPECT_EQ(reg.select(F::kGemm, reg.key(3, 5120, 17408)).name,
            tma_narrow_or(3, 5120, 17408, "skinny_mma"));
  EXPECT_EQ(reg.select(F::kGemm, reg.key(4, 5120, 17408)).name,
            tma_narrow_or(4, 5120, 17408, "skinny_mma"));
  // m > 4: cuBLASLt (the step decided), or gemv_splitk_mma under its A/B switch
  const std::string above4 = tma_narrow_or(
      16, 5120, 17408,
      cuda::gemv_splitk_preferred(16, 5120, 17408) ? "gemv_splitk_mma" : "cublaslt");
  EXPECT_EQ(reg.select(F::kGemm, reg.key(5, 5120, 17408)).name, above4);
  EXPECT_EQ(reg.select(F::kGemm, reg.key(16, 5120, 17408)).name, above4);
  EXPECT_EQ(reg.select(F::kGemm, reg.key(4, 248320, 5120)).name, "cublaslt");  // ties cuBLASLt
  EXPECT_EQ(reg.select(F::kGemm, reg.key(1, 5120, 17412)).name, "cublaslt");   // k % 8
  EXPECT_EQ(reg.select(F::kGemm, reg.key(1, 5120, 65536)).name, "cublaslt");   // k too large
  EXPECT_TRUE(cuda::skinny_gemm_supports(1, 248320, 5120));
  EXPECT_FALSE(cuda::skinny_gemm_supports(1, 5120, 65536));
  auto r80 = cuda::DispatchRegistry::with_defaults(80, "");
  EXPECT_EQ(r80.select(F::kGemm, r80.key(1, 5120, 17408)).name, "cublaslt");
  auto no_narrow = cuda::DispatchRegistry::with_defaults(90, "gemm.gemv_narrow");
  EXPECT_EQ(no_narrow.select(F::kGemm, no_narrow.key(1, 5120, 17408)).name,
            tma_narrow_or(1, 5120, 17408, "skinny_mma"));
  auto off = cuda::DispatchRegistry::with_defaults(
      90, "gemm.gemv_narrow,gemm.skinny_mma,gemm.gemv_tma_narrow");
  EXPECT_EQ(off.select(F::kGemm, off.key(1, 5120, 17408)).name, "cublaslt");
  DS_REQUIRE_GPU();
  DevBuf<bf> x(64), w(64 * 64);
  DevBuf<char> y(64 * 64 * 4);
  const SkinnyConfig c;
  EXPECT_THROW(
      cuda::launch_skinny_gemm(B(x, 1), B(w), y.ptr, 1, 8, 16, GemmOut::kBF16, false, c, 0),
      Error);  // x not 16-byte aligned
  EXPECT_THROW(cuda::launch_skinny_gemm(B(x), B(w), y.ptr, 17, 8, 16, GemmOut::kBF16, false, c, 0),
               Error);
  EXPECT_THROW(cuda::launch_skinny_gemm(B(x), B(w), y.ptr, 1, 8, 12, GemmOut::kBF16, false, c, 0),
               Error);
  EXPECT_THROW(
      cuda::launch_skinny_gemm(B(x), B(w), y.ptr, 1, 8, 16, GemmOut::kBF16, false, {3, 4, 4}, 0),
      Error);  // not compiled
  // Through GemmEngine with the registry: the skinny path makes no cuBLASLt
  // plan.
  auto reg2 = cuda::DispatchRegistry::with_defaults(90, "");
  cuda::GemmEngine g;
  g.set_dispatch(&reg2);
  std::mt19937 rng(3);
  auto hx = test::random_bf16(12288, rng), hw = test::random_bf16(8 * 12288, rng);
  DevBuf<bf> dx(hx), dw(hw);
  DevBuf<char> y1(17 * 8 * 2);
  g.run(B(dx), B(dw), y1.ptr, 1, 8, 12288, GemmOut::kBF16, 0);  // guarded: skinny
  EXPECT_EQ(g.late_plans(), 0);
  g.run(B(dx), B(dw), y1.ptr, 17, 8, 1, GemmOut::kBF16, 0);  // k = 1: cuBLASLt
  EXPECT_EQ(g.late_plans(), 1);
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}


// ---- bulk-copy GEMV (gemv_bulk.cu, variant gemm.gemv_bulk) ----------------------------------

int device_sms() {
  int dev = 0, n_sms = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  DS_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, dev));
  return n_sms;
}

bool is_sm90() {
  int dev = 0, major = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  DS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  return major == 9;
}

LaunchFn bulk_launch(const cuda::GemvBulkConfig& c, int n_sms) {
  return [c, n_sms](const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, int m, int n, int k,
                    GemmOut o, bool a) {
    cuda::launch_gemv_bulk(x, w, y, m, n, k, o, a, c, n_sms, 0);
  };
}

// Odd shapes with every config that fits: n below the SM count (fewer blocks than SMs), one or
// two rows per block, many rows per block (the ring wraps many times: mbarrier phases), odd row
// counts with two-row stages (a partial last stage), k = 8 (one 16-byte vector), k not a multiple
// of 256 (lanes with fewer vectors), the largest k that fits; bf16 / fp32 out, +=. Normalised
// error vs fp64 < 4e-3 (bf16 out: one rounding) / 1e-5 (fp32 out: fp32 sums of <= 12288 terms).
TEST(CudaGemvBulk, OddShapesEveryConfig) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(31);
  struct NK {
    int n, k;
  };
  const NK shapes[] = {{1, 8}, {37, 24}, {203, 40}, {77, 5128}, {5000, 256}, {20001, 64},
                       {263, 1032}};
  for (int m : {1, 2, 3, 5, 8})
    for (const NK& s : shapes)
      for (const cuda::GemvBulkConfig& c : cuda::gemv_bulk_configs(m, s.k)) {
        check_launch_vs_cpu(m, s.n, s.k, GemmOut::kBF16, false, bulk_launch(c, n_sms), c.name(),
                            rng);
        if (s.n * s.k <= 400000) {
          check_launch_vs_cpu(m, s.n, s.k, GemmOut::kF32, false, bulk_launch(c, n_sms), c.name(),
                              rng);
          check_launch_vs_cpu(m, s.n, s.k, GemmOut::kBF16, true, bulk_launch(c, n_sms), c.name(),
                              rng);
          check_launch_vs_cpu(m, s.n, s.k, GemmOut::kF32, true, bulk_launch(c, n_sms), c.name(),
                              rng);
        }
      }
  // The largest k that fits m = 1 (12288 x 2 bytes x (1 + 8 stages)); a grid of 5 blocks.
  check_launch_vs_cpu(1, 50, 12288, GemmOut::kBF16, false, bulk_launch({1, 8, false}, n_sms),
                      "r1s8", rng);
  check_launch_vs_cpu(2, 300, 1024, GemmOut::kF32, false, bulk_launch({2, 16, false}, 5), "r2s16",
                      rng);
  EXPECT_TRUE(cuda::gemv_bulk_supports(1, 50, 12880));
  EXPECT_FALSE(cuda::gemv_bulk_supports(1, 50, 12888));
}

// Every Qwen3.5-27B decode shape with k <= 8192 at m = 1, 2, 3, 4, 8: the shipped config
//  - vs fp64 on 384 sampled rows (the first and last 128 rows and 128 spread ones, i.e. across
//    block boundaries): |y - ref| <= 1 bf16 ulp of max(|y|, |ref|) + 1e-4 * sum_i |x_i w_i|
//    (bf16 out: one rounding of an fp32 sum) / 1e-4 * sum_i |x_i w_i| (fp32 out);
//  - vs cuBLASLt on every output: within 1 bf16 ulp of the larger magnitude, or 1e-3 of the
//    output's max where both are near zero (fp32 out: relative L2 < 1e-5);
//  - every other config that fits gives the same bits (the order depends on k only), and so does
//    the engine's path through the registry where the guard picks the kernel.
TEST(CudaGemvBulk, Shapes27bMatchCublasLtAndFp64) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(41);
  Pool wpool(size_t(248320) * 5120, rng, 0.02f);
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  cuda::GemmEngine fast, ref;
  fast.set_dispatch(&reg);
  for (const Op& o : kOps27b) {
    if (o.k > 8192) {
      EXPECT_FALSE(cuda::gemv_bulk_preferred(1, o.n, o.k)) << o.name;
      continue;
    }
    const SampledRows sampled = sample_rows(o, wpool);
    for (int m : {1, 2, 3, 4, 8, 16}) {
      if (m > cuda::kGemvBulkMaxM) {
        EXPECT_FALSE(cuda::gemv_bulk_supports(m, o.n, o.k));
        continue;
      }
      const std::string& v = fast.variant(m, o.n, o.k);
      const bool guarded = v == "gemv_bulk" || v == "gemv_bulk_pdl";
      EXPECT_EQ(guarded, (cuda::gemv_bulk_preferred(m, o.n, o.k) ||
                          cuda::gemv_bulk_pdl_preferred(m, o.n, o.k)) &&
                             !cuda::gemv_tma_narrow_preferred(m, o.n, o.k))
          << o.name << " m " << m;
      auto x = test::random_bf16(size_t(m) * o.k, rng);
      DevBuf<bf> dx(x);
      const size_t es = o.f32 ? 4 : 2, cnt = size_t(m) * o.n;
      DevBuf<char> y1(cnt * es), y2(cnt * es), y3(cnt * es);
      y1.poison();
      y2.poison();
      const GemmOut out = o.f32 ? GemmOut::kF32 : GemmOut::kBF16;
      const cuda::GemvBulkConfig shipped = cuda::gemv_bulk_config(m, o.n, o.k);
      cuda::launch_gemv_bulk(B(dx), B(wpool.buf), y1.ptr, m, o.n, o.k, out, false, shipped, n_sms,
                             0);
      ref.run(B(dx), B(wpool.buf), y2.ptr, m, o.n, o.k, out, 0);
      const auto bits = y1.download();
      for (cuda::GemvBulkConfig c : cuda::gemv_bulk_configs(m, o.k)) {
        y3.poison();
        cuda::launch_gemv_bulk(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, out, false, c, n_sms, 0);
        EXPECT_TRUE(y3.download() == bits) << o.name << " m " << m << " config " << c.name();
      }
      if (guarded) {
        y3.poison();
        fast.run(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, out, 0);
        EXPECT_TRUE(y3.download() == bits) << o.name << " m " << m << " engine path";
      }
      DS_CUDA_CHECK(cudaDeviceSynchronize());
      const auto a = download_out(y1, cnt, o.f32), b = download_out(y2, cnt, o.f32);
      const double worst64 = expect_sampled_rows_match_fp64(x, sampled, a, o, m);
      if (o.f32) {
        const double e = test::norm_err(a, b);
        EXPECT_LT(e, 1e-5) << o.name << " m " << m;
        std::printf(
            "  bulk %-8s m=%d f32 out: relative L2 vs cuBLASLt %.2e, fp64 worst %.2f of tol\n",
            o.name, m, e, worst64);
      } else {
        const CublasLtDiff r = expect_bf16_close_to_cublaslt(a, b, o, m);
        std::printf(
            "  bulk %-8s m=%d bf16 out: %zu of %zu differ from cuBLASLt (worst %.2f of tol), "
            "fp64 worst %.2f of tol\n",
            o.name, m, r.differ, cnt, r.worst, worst64);
      }
    }
  }
}

// Token i's outputs are bit-identical for m = 1..8 (the summation order depends on k only, with
// one partial sum per lane).
TEST(CudaGemvBulk, BatchInvariant) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(19);
  for (auto [n, k] : {std::pair{5120, 6144}, std::pair{16480, 5120}, std::pair{300, 5128}}) {
    auto x = test::random_bf16(size_t(8) * k, rng), w = test::random_bf16(size_t(n) * k, rng);
    DevBuf<bf> dx(x), dw(w);
    DevBuf<char> y8(size_t(8) * n * 2), ys(size_t(8) * n * 2);
    cuda::launch_gemv_bulk(B(dx), B(dw), y8.ptr, 8, n, k, GemmOut::kBF16, false,
                           cuda::gemv_bulk_config(8, n, k), n_sms, 0);
    const auto a = y8.download();
    for (auto [t0, m] : {std::pair{0, 1}, std::pair{7, 1}, std::pair{2, 2}, std::pair{4, 3},
                         std::pair{4, 4}}) {
      ys.poison();
      cuda::launch_gemv_bulk(B(dx, size_t(t0) * k), B(dw), ys.ptr, m, n, k, GemmOut::kBF16, false,
                             cuda::gemv_bulk_config(m, n, k), n_sms, 0);
      const auto b = ys.download();
      EXPECT_EQ(std::memcmp(a.data() + size_t(t0) * n * 2, b.data(), size_t(m) * n * 2), 0)
          << "tokens " << t0 << ".." << t0 + m - 1 << " n " << n << " k " << k;
    }
  }
}

// Programmatic dependent launch: y2 = y1 w2^T right behind y1 = x w1^T (both with the attribute:
// the second issues its weight copies early, reads y1 only after griddepcontrol.wait) reads the
// finished y1 (poisoned before), on a stream and from a CUDA graph; bit-identical to no PDL.
TEST(CudaGemvBulk, DependentLaunchesChain) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(23);
  const int m = 4, n1 = 6144, k1 = 5120, n2 = 5120;  // the first launch reads 63 MB
  auto x = test::random_bf16(size_t(m) * k1, rng),
       w1 = test::random_bf16(size_t(n1) * k1, rng, 0.02f),
       w2 = test::random_bf16(size_t(n2) * n1, rng, 0.02f);
  DevBuf<bf> dx(x), dw1(w1), dw2(w2), y1(size_t(m) * n1), y2(size_t(m) * n2);
  cudaStream_t s;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto chain = [&](bool pdl) {
    cuda::GemvBulkConfig c1 = cuda::gemv_bulk_config(m, n1, k1),
                         c2 = cuda::gemv_bulk_config(m, n2, n1);
    c1.pdl = c2.pdl = pdl;
    cuda::launch_gemv_bulk(B(dx), B(dw1), y1.ptr, m, n1, k1, GemmOut::kBF16, false, c1, n_sms, s);
    cuda::launch_gemv_bulk(B(y1), B(dw2), y2.ptr, m, n2, n1, GemmOut::kBF16, false, c2, n_sms, s);
  };
  expect_pdl_chain_matches_serial(chain, y1, y2, w2, m, n1, n2, s);
  cudaStreamDestroy(s);
}

// SwiGLU fused into the bulk GEMV: act = bf16(silu(g) * u) bit-identical to launch_gemv_bulk on
// [gate | up] followed by launch_silu_mul, on the 27B MLP (d_ff 17408, k 5120) and odd shapes,
// m 1..4 (poisoned outputs); vs fp64 (g, u, silu in double): normalised error < 8e-3 (g, u and
// the product each rounded to bf16 once); the engine's run_gate_up_silu takes it where the guard
// says so and returns false (launching nothing) for m > 4 or with the variant switched off.
TEST(CudaGemvBulk, SiluFusedMatchesUnfused) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(43);
  for (auto [d_ff, k] : {std::pair{17408, 5120}, std::pair{37, 24}, std::pair{1000, 5128},
                         std::pair{203, 40}, std::pair{5000, 256}}) {
    auto w = test::random_bf16(size_t(2) * d_ff * k, rng, 0.05f);
    DevBuf<bf> dw(w);
    for (int m = 1; m <= cuda::kGemvBulkSiluMaxM; ++m) {
      auto x = test::random_bf16(size_t(m) * k, rng);
      DevBuf<bf> dx(x), gu(size_t(m) * 2 * d_ff), a1(size_t(m) * d_ff), a2(size_t(m) * d_ff);
      a1.poison();
      a2.poison();
      gu.poison();
      auto* gup = reinterpret_cast<__nv_bfloat16*>(gu.ptr);
      cuda::launch_gemv_bulk_silu(B(dx), B(dw), reinterpret_cast<__nv_bfloat16*>(a1.ptr), m, d_ff,
                                  k, cuda::gemv_bulk_silu_config(m, d_ff, k), n_sms, 0);
      cuda::launch_gemv_bulk(B(dx), B(dw), gup, m, 2 * d_ff, k, GemmOut::kBF16, false,
                             cuda::gemv_bulk_config(m, 2 * d_ff, k), n_sms, 0);
      cuda::launch_silu_mul(gup, m, d_ff, reinterpret_cast<__nv_bfloat16*>(a2.ptr), 0);
      DS_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = a1.download();
      EXPECT_TRUE(got == a2.download()) << "m " << m << " d_ff " << d_ff << " k " << k;
      if (size_t(m) * d_ff * k <= size_t(4) * 17408 * 5120 / 8 || m == 1) {
        std::vector<float> ref(size_t(m) * d_ff);
        for (int t = 0; t < m; ++t)
          for (int j = 0; j < d_ff; ++j) {
            double g = 0, u = 0;
            for (int c = 0; c < k; ++c) {
              const double xv = bf16_to_f32(x[size_t(t) * k + c]);
              g += xv * bf16_to_f32(w[size_t(j) * k + c]);
              u += xv * bf16_to_f32(w[size_t(d_ff + j) * k + c]);
            }
            ref[size_t(t) * d_ff + j] = float(g / (1.0 + std::exp(-g)) * u);
          }
        EXPECT_LT(test::norm_err(test::to_f32(got), ref), 8e-3) << "m " << m << " d_ff " << d_ff;
      }
    }
  }
  // Through the engine and the registry.
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  auto off = cuda::DispatchRegistry::with_defaults(90, "gemm.gemv_bulk_silu");
  cuda::GemmEngine g, g_off;
  g.set_dispatch(&reg);
  g_off.set_dispatch(&off);
  const int d_ff = 17408, k = 5120;
  auto w = test::random_bf16(size_t(2) * d_ff * k, rng, 0.02f), x = test::random_bf16(8 * k, rng);
  DevBuf<bf> dw(w), dx(x), a1(size_t(8) * d_ff), a2(size_t(8) * d_ff);
  for (int m : {1, 4, 5, 16}) {
    a1.poison();
    a2.poison();
    auto* p1 = reinterpret_cast<__nv_bfloat16*>(a1.ptr);
    const bool fused = g.run_gate_up_silu(B(dx), B(dw), p1, m, d_ff, k, 0);
    // m 5..16: the TMA kernel's fused SiLU unless $DS_GEMV_TMA=0 (CudaGemvTma.*)
    const bool tma = m > 4 && cuda::gemv_tma_mode() != cuda::GemvTmaMode::kOff;
    EXPECT_EQ(fused, m <= 4 || tma) << "m " << m;
    EXPECT_EQ(g_off.run_gate_up_silu(B(dx), B(dw), p1, m, d_ff, k, 0), tma);
    if (fused && tma) {
      cuda::launch_gemv_tma_silu(B(dx), B(dw), reinterpret_cast<__nv_bfloat16*>(a2.ptr), m, d_ff,
                                 k, cuda::gemv_tma_config(m, d_ff, k, true), n_sms, 0);
      EXPECT_TRUE(a1.download() == a2.download()) << "m " << m;
    } else if (fused) {
      cuda::launch_gemv_bulk_silu(B(dx), B(dw), reinterpret_cast<__nv_bfloat16*>(a2.ptr), m, d_ff,
                                  k, cuda::gemv_bulk_silu_config(m, d_ff, k), n_sms, 0);
      EXPECT_TRUE(a1.download() == a2.download()) << "m " << m;
    } else {
      const auto untouched = a1.download();  // nothing launched: still the poison
      EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(),
                              [](bf v) { return v == 0xFFFF; }))
          << "m " << m;
    }
  }
  EXPECT_THROW(cuda::launch_gemv_bulk_silu(B(dx), B(dw), reinterpret_cast<__nv_bfloat16*>(a1.ptr),
                                           5, d_ff, k, {2, 8, false}, n_sms, 0),
               Error);  // m > 4
  EXPECT_THROW(cuda::launch_gemv_bulk_silu(B(dx), B(dw), reinterpret_cast<__nv_bfloat16*>(a1.ptr),
                                           1, d_ff, k, {1, 16, false}, n_sms, 0),
               Error);  // one row per stage
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}

// The interleaved stage order (GemvBulkConfig::interleave, GemvNarrowConfig::interleave): every
// output bit-identical to the contiguous split, for the bulk kernel's plain (bf16 and fp32 out,
// accumulate, one and two rows per stage), SwiGLU-fused and norm-fused launches and the narrow
// kernel, m 1..4, the 27B shapes and odd ones (n below the grid, a short last stage), grids of all
// SMs and of 7 blocks (many stages per block), and as PDL launches in a CUDA graph.
TEST(CudaGemvBulk, InterleaveBitExact) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(73);
  cudaStream_t s;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  enum Kind { kPlain, kSilu, kNarrow };
  struct Case {
    Kind kind;
    int n, k;
    bool f32, acc, norm;
  };
  const Case cases[] = {
      {kSilu, 17408, 5120, false, false, false},    // gate_up + SiLU (d_ff)
      {kSilu, 17408, 5120, false, false, true},     // ... with the norm prologue
      {kPlain, 16480, 5120, false, false, true},    // gdn_in + norm
      {kPlain, 5120, 6144, false, false, false},    // gdn_out / attn_o
      {kPlain, 14336, 5120, false, true, false},    // attn_qkv shape, accumulate
      {kPlain, 30001, 5120, true, false, false},    // lm_head-like, fp32 out, odd n
      {kSilu, 37, 24, false, false, false},         // n below the grid
      {kPlain, 1001, 5128, false, false, true},     // a short last two-row stage
      {kPlain, 301, 40, true, true, false},
      {kNarrow, 5120, 17408, false, false, false},  // down
      {kNarrow, 5120, 6144, true, true, false},
      {kNarrow, 77, 4104, false, false, false},     // n below the grid, a short last slice
  };
  for (const Case& c : cases) {
    const int wrows = c.kind == kSilu ? 2 * c.n : c.n;
    auto w = test::random_bf16(size_t(wrows) * c.k, rng, 0.05f);
    DevBuf<bf> dw(w);
    for (int m = 1; m <= 4; ++m) {
      auto x = test::random_bf16(size_t(m) * c.k, rng), d = test::random_bf16(size_t(m) * c.k, rng),
           nw = test::random_bf16(c.k, rng, 0.1f);
      DevBuf<bf> dx(x), dd(d), dnw(nw), rout(size_t(m) * c.k);
      const size_t ybytes = size_t(m) * c.n * (c.f32 ? 4 : 2);
      DevBuf<char> y(ybytes);
      std::vector<char> init(ybytes);
      for (size_t i = 0; i < ybytes; i += 2) init[i] = char(rng() & 0x3F);  // finite values
      cuda::GemvNormIn nin;
      nin.residual = B(dx);
      nin.delta = B(dd);
      nin.weight = B(dnw);
      nin.residual_out = reinterpret_cast<__nv_bfloat16*>(rout.ptr);
      const GemmOut o = c.f32 ? GemmOut::kF32 : GemmOut::kBF16;
      // cfgs: the shipped config and, for the plain kernel, the other rows-per-stage too.
      std::vector<cuda::GemvBulkConfig> bulk_cfgs;
      if (c.kind == kSilu) bulk_cfgs.push_back(cuda::gemv_bulk_silu_config(m, c.n, c.k));
      if (c.kind == kPlain) {
        bulk_cfgs.push_back({1, 16, false});
        bulk_cfgs.push_back({2, 8, false});
        if (!cuda::gemv_bulk_fits(m, c.k, bulk_cfgs[0])) bulk_cfgs[0] = {1, 8, false};
      }
      auto launch_bulk = [&](cuda::GemvBulkConfig cfg, int sms, cudaStream_t st) {
        if (c.kind == kSilu) {
          auto* act = reinterpret_cast<__nv_bfloat16*>(y.ptr);
          if (c.norm)
            cuda::launch_gemv_bulk_silu_norm(nin, B(dw), act, m, c.n, c.k, cfg, sms, st);
          else
            cuda::launch_gemv_bulk_silu(B(dx), B(dw), act, m, c.n, c.k, cfg, sms, st);
        } else if (c.norm) {
          cuda::launch_gemv_bulk_norm(nin, B(dw), y.ptr, m, c.n, c.k, o, cfg, sms, st);
        } else {
          cuda::launch_gemv_bulk(B(dx), B(dw), y.ptr, m, c.n, c.k, o, c.acc, cfg, sms, st);
        }
      };
      auto reset_y = [&]() {
        if (c.acc)
          y.upload(init);
        else
          y.poison();
      };
      const std::string label = "n " + std::to_string(c.n) + " k " + std::to_string(c.k) +
                                " m " + std::to_string(m) +
                                (c.kind == kSilu ? " silu" : c.kind == kNarrow ? " narrow" : "") +
                                (c.norm ? " norm" : "") + (c.acc ? " +=" : "") +
                                (c.f32 ? " f32" : "");
      // One (contiguous, interleaved) pair per grid and config; fn launches with `ilv`.
      auto check = [&](const std::function<void(bool, bool, int, cudaStream_t)>& fn,
                       const std::string& what) {
        for (int sms : {n_sms, 7}) {
          reset_y();
          fn(false, false, sms, 0);
          DS_CUDA_CHECK(cudaDeviceSynchronize());
          const auto ref = y.download();
          reset_y();
          fn(true, false, sms, 0);
          DS_CUDA_CHECK(cudaDeviceSynchronize());
          EXPECT_TRUE(y.download() == ref) << what << " grid " << sms;
          if (sms != n_sms || c.acc) continue;
          // From a CUDA graph: the interleaved launch with PDL behind a contiguous one.
          cudaGraph_t g;
          cudaGraphExec_t ge;
          DS_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
          fn(false, false, sms, s);
          fn(true, true, sms, s);
          DS_CUDA_CHECK(cudaStreamEndCapture(s, &g));
          DS_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
          for (int rep = 0; rep < 2; ++rep) {
            reset_y();
            DS_CUDA_CHECK(cudaDeviceSynchronize());  // the legacy-stream reset before s's replay
            DS_CUDA_CHECK(cudaGraphLaunch(ge, s));
            DS_CUDA_CHECK(cudaStreamSynchronize(s));
            EXPECT_TRUE(y.download() == ref) << what << " graph rep " << rep;
          }
          cudaGraphExecDestroy(ge);
          cudaGraphDestroy(g);
        }
      };
      if (c.kind == kNarrow) {
        if (!cuda::gemv_narrow_supports(m, c.n, c.k, n_sms) ||
            !cuda::gemv_narrow_supports(m, c.n, c.k, 7))
          continue;
        cuda::GemvNarrowConfig base = cuda::gemv_narrow_config(m, c.n, c.k, 7);
        check(
            [&](bool ilv, bool pdl, int sms, cudaStream_t st) {
              cuda::GemvNarrowConfig cfg = base;
              cfg.interleave = ilv;
              cfg.pdl = pdl;
              cuda::launch_gemv_narrow(B(dx), B(dw), y.ptr, m, c.n, c.k, o, c.acc, cfg, sms, st);
            },
            label + " " + base.name());
        continue;
      }
      for (const cuda::GemvBulkConfig& base : bulk_cfgs) {
        if (c.norm && !cuda::gemv_bulk_norm_fits(m, c.k, base)) continue;
        if (!cuda::gemv_bulk_fits(m, c.k, base)) continue;
        check(
            [&](bool ilv, bool pdl, int sms, cudaStream_t st) {
              cuda::GemvBulkConfig cfg = base;
              cfg.interleave = ilv;
              cfg.pdl = pdl;
              launch_bulk(cfg, sms, st);
            },
            label + " " + base.name());
      }
    }
  }
  cuda::GemvBulkConfig named{1, 16, true};
  named.interleave = true;
  EXPECT_EQ(named.name(), "r1s16-pdl-ilv");
  cuda::GemvNarrowConfig nnamed{16, false};
  nnamed.interleave = true;
  EXPECT_EQ(nnamed.name(), "s16-ilv");
  cudaStreamDestroy(s);
}

// The greedy argmax fused into the bulk GEMV (launch_gemv_bulk_argmax; session 27):
//  - its logits are launch_gemv_bulk's bits (same config, one partial sum per lane), its tokens
//    launch_argmax_rows' on those logits (greedy_token: lowest id on ties, -1 for NaN / +inf, 0
//    for a row of -inf);
//  - on lm_head (248320 x 5120) with the engine's config and both stage orders, and on odd shapes
//    (one row, n below the grid, a partial last two-row stage, k = 8) with every config that fits,
//    m 1 and 2, contiguous and interleaved stages, PDL on and off;
//  - rows made to tie at the top (a weight row duplicated into another block, the lower id must
//    win), a NaN weight (every row's token -1), a +inf product (-1), every logit -inf (token 0);
//  - 8 launches back to back with new x each (the workspace must be zero again after each), and a
//    CUDA graph of the launch replayed 3 times;
//  - GemmEngine::run_head_argmax takes it where run() takes the bulk GEMV and launches nothing
//    (returns false) otherwise; the launch errors.
TEST(CudaGemvBulk, ArgmaxFusedMatchesSeparate) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(59);
  DevBuf<char> ws(cuda::kGemvBulkArgmaxWorkspaceBytes);
  DS_CUDA_CHECK(cudaMemset(ws.ptr, 0, ws.n));
  DevBuf<int32_t> tok(cuda::kGemvBulkArgmaxMaxM), tok_ref(cuda::kGemvBulkArgmaxMaxM);
  auto ws_is_zero = [&] {
    for (char c : ws.download())
      if (c != 0) return false;
    return true;
  };
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {  // NaN == NaN
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), 4 * a.size()) == 0;
  };
  // One fused launch against the two kernels; returns the fused tokens.
  auto check = [&](const DevBuf<bf>& dx, const bf* dw, int m, int n, int k,
                   cuda::GemvBulkConfig c, const std::string& what) {
    DevBuf<float> y(size_t(m) * n), y_ref(size_t(m) * n);
    y.poison();
    y_ref.poison();
    DS_CUDA_CHECK(cudaMemset(tok.ptr, 0x7f, tok.n * 4));
    const auto* w = reinterpret_cast<const __nv_bfloat16*>(dw);
    cuda::launch_gemv_bulk_argmax(B(dx), w, y.ptr, tok.ptr, ws.ptr, m, n, k, c, n_sms, 0);
    cuda::GemvBulkConfig cs = c;
    cs.pdl = false;
    cuda::launch_gemv_bulk(B(dx), w, y_ref.ptr, m, n, k, GemmOut::kF32, false, cs, n_sms, 0);
    cuda::launch_argmax_rows(y_ref.ptr, m, n, tok_ref.ptr, 0, cuda::ArgmaxKernel::kBlock, false);
    const auto t = tok.download(), tr = tok_ref.download();
    EXPECT_TRUE(same_bits(y.download(), y_ref.download())) << what << " config " << c.name();
    for (int i = 0; i < m; ++i) EXPECT_EQ(t[i], tr[i]) << what << " row " << i << " " << c.name();
    EXPECT_TRUE(ws_is_zero()) << what << " config " << c.name();
    return std::vector<int32_t>(t.begin(), t.begin() + m);
  };
  const bf kNanBf = 0x7fc0, kInfBf = 0x7f80, kNegInfBf = 0xff80, kOneBf = 0x3f80;
  // The cases of one (m, n, k, config) on weights dw (device, restored after each case).
  auto cases = [&](int m, int n, int k, bf* dw, const cuda::GemvBulkConfig& c,
                   const std::string& shape) {
    const std::string what = shape + " m=" + std::to_string(m);
    auto hx = test::random_bf16(size_t(m) * k, rng);
    DevBuf<bf> dx(hx);
    check(dx, dw, m, n, k, c, what + " random");
    auto row = [&](int j) {
      std::vector<bf> r(k);
      DS_CUDA_CHECK(cudaMemcpy(r.data(), dw + size_t(j) * k, 2 * k, cudaMemcpyDeviceToHost));
      return r;
    };
    auto put = [&](int j, const std::vector<bf>& r) {
      DS_CUDA_CHECK(cudaMemcpy(dw + size_t(j) * k, r.data(), 2 * k, cudaMemcpyHostToDevice));
    };
    // A tie at the top for token row 0: weight row j aligned with x's row 0 (the largest logit by
    // far), copied to row j2 in the other half (another block); the lower of the two must win.
    if (n >= 2) {
      const int j = int(rng() % n), j2 = int((j + n / 2 + rng() % 3) % n);
      if (j2 != j) {
        const auto keep_j = row(j), keep_j2 = row(j2);
        std::vector<bf> top(k);
        for (int c2 = 0; c2 < k; ++c2) top[c2] = hx[c2];  // x row 0 itself: sum of squares
        put(j, top);
        put(j2, top);
        const auto t = check(dx, dw, m, n, k, c, what + " tie");
        EXPECT_EQ(t[0], std::min(j, j2)) << what << " tie of rows " << j << ", " << j2;
        put(j, keep_j);
        put(j2, keep_j2);
      }
    }
    // Specials in column 0 of one weight row (or of all), x[., 0] = 1.
    std::vector<bf> hx1 = hx;
    for (int t = 0; t < m; ++t) hx1[size_t(t) * k] = kOneBf;
    DevBuf<bf> dx1(hx1);
    const int j = int(rng() % n);
    const auto keep = row(j);
    for (bf special : {kNanBf, kInfBf}) {
      auto r = keep;
      r[0] = special;
      put(j, r);
      const auto t = check(dx1, dw, m, n, k, c, what + (special == kNanBf ? " NaN" : " +inf"));
      for (int i = 0; i < m; ++i) EXPECT_EQ(t[i], -1) << what << " special row " << j;
      put(j, keep);
    }
    if (size_t(n) * k <= (size_t(8) << 20)) {  // every logit -inf: token 0
      std::vector<bf> all(size_t(n) * k);
      DS_CUDA_CHECK(cudaMemcpy(all.data(), dw, all.size() * 2, cudaMemcpyDeviceToHost));
      std::vector<bf> neg = all;
      for (int r = 0; r < n; ++r) neg[size_t(r) * k] = kNegInfBf;
      DS_CUDA_CHECK(cudaMemcpy(dw, neg.data(), neg.size() * 2, cudaMemcpyHostToDevice));
      const auto t = check(dx1, dw, m, n, k, c, what + " all -inf");
      for (int i = 0; i < m; ++i) EXPECT_EQ(t[i], 0) << what;
      DS_CUDA_CHECK(cudaMemcpy(dw, all.data(), all.size() * 2, cudaMemcpyHostToDevice));
    }
  };

  // lm_head at the engine's configs.
  {
    Pool wpool(size_t(248320) * 5120, rng, 0.02f);
    for (int m : {1, 2}) {
      cuda::GemvBulkConfig c = cuda::gemv_bulk_config(m, 248320, 5120);
      ASSERT_TRUE(cuda::gemv_bulk_argmax_supports(m, 248320, 5120, c)) << c.name();
      for (bool ilv : {true, false}) {
        c.interleave = ilv;
        c.pdl = ilv;
        cases(m, 248320, 5120, wpool.buf.ptr, c, "lm_head");
      }
    }
  }
  // Odd shapes, every config that fits.
  for (auto [n, k] : {std::pair{1, 8}, std::pair{37, 24}, std::pair{131, 1032},
                      std::pair{5003, 256}, std::pair{20001, 64}}) {
    auto hw = test::random_bf16(size_t(n) * k, rng, 0.05f);
    DevBuf<bf> dw(hw);
    for (int m : {1, 2})
      for (cuda::GemvBulkConfig c : cuda::gemv_bulk_configs(m, k)) {
        if (c.blocks_per_sm != 1) {
          EXPECT_FALSE(cuda::gemv_bulk_argmax_supports(m, n, k, c));
          continue;
        }
        for (bool ilv : {false, true}) {
          c.interleave = ilv;
          c.pdl = !ilv;
          cases(m, n, k, dw.ptr, c, std::to_string(n) + "x" + std::to_string(k));
        }
      }
  }

  // Back to back on one stream (PDL), then from a graph: every launch's tokens are its own.
  {
    const int n = 30011, k = 1024, m = 2;
    auto hw = test::random_bf16(size_t(n) * k, rng, 0.05f);
    DevBuf<bf> dw(hw);
    cuda::GemvBulkConfig c = cuda::gemv_bulk_config(m, n, k);
    c.pdl = true;
    std::vector<std::unique_ptr<DevBuf<bf>>> dxs;
    const int runs = 8;
    DevBuf<int32_t> toks(size_t(runs) * m);
    DevBuf<float> y(size_t(m) * n);
    for (int r = 0; r < runs; ++r) dxs.push_back(std::make_unique<DevBuf<bf>>(
                                        test::random_bf16(size_t(m) * k, rng)));
    cudaStream_t s;
    DS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (int r = 0; r < runs; ++r)
      cuda::launch_gemv_bulk_argmax(B(*dxs[r]), B(dw), y.ptr, toks.ptr + r * m, ws.ptr, m, n, k,
                                    c, n_sms, s);
    DS_CUDA_CHECK(cudaStreamSynchronize(s));
    const auto got = toks.download();
    for (int r = 0; r < runs; ++r) {
      DevBuf<float> yr(size_t(m) * n);
      cuda::launch_gemv_bulk(B(*dxs[r]), B(dw), yr.ptr, m, n, k, GemmOut::kF32, false,
                             cuda::gemv_bulk_config(m, n, k), n_sms, 0);
      cuda::launch_argmax_rows(yr.ptr, m, n, tok_ref.ptr, 0, cuda::ArgmaxKernel::kBlock, false);
      const auto tr = tok_ref.download();
      for (int i = 0; i < m; ++i) EXPECT_EQ(got[size_t(r) * m + i], tr[i]) << "run " << r;
    }
    EXPECT_TRUE(ws_is_zero());
    cudaGraph_t g;
    cudaGraphExec_t ge;
    DS_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    cuda::launch_gemv_bulk_argmax(B(*dxs[0]), B(dw), y.ptr, tok.ptr, ws.ptr, m, n, k, c, n_sms,
                                  s);
    DS_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    DS_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int rep = 0; rep < 3; ++rep) {
      DS_CUDA_CHECK(cudaMemsetAsync(tok.ptr, 0x7f, tok.n * 4, s));  // ordered before the replay
      DS_CUDA_CHECK(cudaGraphLaunch(ge, s));
      DS_CUDA_CHECK(cudaStreamSynchronize(s));
      const auto t = tok.download();
      for (int i = 0; i < m; ++i) EXPECT_EQ(t[i], got[i]) << "graph replay " << rep;
    }
    EXPECT_TRUE(ws_is_zero());
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(s);
  }

  // The engine's entry: the fused launch where run() takes the bulk GEMV, nothing otherwise.
  {
    auto reg = cuda::DispatchRegistry::with_defaults(90, "");
    cuda::GemmEngine g;
    g.set_dispatch(&reg);
    const int n = 248320, k = 5120;
    Pool wpool(size_t(n) * k, rng, 0.02f);
    DevBuf<bf> dx(test::random_bf16(size_t(4) * k, rng));
    DevBuf<float> y(size_t(4) * n), y_ref(size_t(4) * n);
    for (int m : {1, 2, 3, 4}) {
      y.poison();
      y_ref.poison();  // rows m.. of both stay poisoned: compared too
      DS_CUDA_CHECK(cudaMemset(tok.ptr, 0x7f, tok.n * 4));
      const bool took = g.run_head_argmax(B(dx), B(wpool.buf), y.ptr, tok.ptr, ws.ptr, m, n, k, 0);
      const bool bulk = g.variant(m, n, k) == "gemv_bulk";
      EXPECT_EQ(took, bulk && m <= cuda::kGemvBulkArgmaxMaxM) << "m " << m;
      if (!took) continue;
      g.run(B(dx), B(wpool.buf), y_ref.ptr, m, n, k, GemmOut::kF32, 0);
      cuda::launch_argmax_rows(y_ref.ptr, m, n, tok_ref.ptr, 0, cuda::ArgmaxKernel::kBlock, false);
      EXPECT_TRUE(same_bits(y.download(), y_ref.download())) << "m " << m;
      const auto t = tok.download(), tr = tok_ref.download();
      for (int i = 0; i < m; ++i) EXPECT_EQ(t[i], tr[i]) << "engine m " << m;
    }
    auto off = cuda::DispatchRegistry::with_defaults(90, "gemm.gemv_bulk");
    g.set_dispatch(&off);
    EXPECT_FALSE(g.run_head_argmax(B(dx), B(wpool.buf), y.ptr, tok.ptr, ws.ptr, 1, n, k, 0));
  }

  // Errors: m past the compiled two, two blocks per SM, the workspace.
  DevBuf<bf> x(64), w(64 * 64);
  DevBuf<float> y(64 * 64);
  const cuda::GemvBulkConfig c{1, 8, false};
  auto launch = [&](int m, cuda::GemvBulkConfig cc, void* wsp) {
    cuda::launch_gemv_bulk_argmax(B(x), B(w), y.ptr, tok.ptr, wsp, m, 8, 16, cc, n_sms, 0);
  };
  EXPECT_THROW(launch(3, c, ws.ptr), Error);
  EXPECT_THROW(launch(1, {1, 8, false, 2}, ws.ptr), Error);
  EXPECT_THROW(launch(1, c, nullptr), Error);
  EXPECT_THROW(launch(1, c, ws.ptr + 4), Error);  // not 8-byte aligned
  EXPECT_NO_THROW(launch(1, c, ws.ptr));
  DS_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(ws_is_zero());
}

TEST(CudaGemvBulk, GuardAndErrors) {
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  using F = cuda::KernelFamily;
  auto pick = [&](const cuda::DispatchRegistry& r, int m, int n, int k, int glu = 0) {
    return r.select(F::kGemm, r.key(m, n, k, glu)).name;
  };
  EXPECT_EQ(pick(reg, 1, 34816, 5120), "gemv_bulk");   // gate_up
  EXPECT_EQ(pick(reg, 2, 34816, 5120), "gemv_bulk");
  EXPECT_EQ(pick(reg, 1, 16480, 5120), "gemv_bulk");   // gdn_in
  EXPECT_EQ(pick(reg, 1, 14336, 5120), "gemv_bulk");   // attn_qkv
  EXPECT_EQ(pick(reg, 1, 248320, 5120), "gemv_bulk");  // lm_head
  EXPECT_EQ(pick(reg, 2, 16480, 5120), "cublaslt");    // lost from m 2
  // gdn_out / attn_o: lost alone, the PDL variant unless DS_GEMV_PDL=0
  EXPECT_EQ(pick(reg, 1, 5120, 6144),
            tma_narrow_or(1, 5120, 6144,
                          cuda::gemv_pdl_mode() == cuda::GemvPdl::kOff ? "cublaslt"
                                                                        : "gemv_bulk_pdl"));
  EXPECT_EQ(pick(reg, 2, 5120, 6144), tma_narrow_or(2, 5120, 6144, "cublaslt"));
  // m 3.. : gemv_bulk_mma with $DS_GEMV_MMA=1 (CudaGemvBulkMma.GuardAndErrors), else cuBLASLt
  const std::string m3 = cuda::gemv_bulk_mma_enabled() ? "gemv_bulk_mma" : "cublaslt";
  EXPECT_EQ(pick(reg, 3, 34816, 5120), m3);
  EXPECT_EQ(pick(reg, 4, 34816, 5120, 1), "gemv_bulk_silu");  // the MLP's fused key
  EXPECT_EQ(pick(reg, 5, 34816, 5120, 1),  // from m 5 the TMA kernel's fused SiLU by default
            cuda::gemv_tma_mode() != cuda::GemvTmaMode::kOff ? "gemv_tma_silu" : m3);
  EXPECT_EQ(pick(reg, 1, 34815, 5120, 1), "gemv_bulk");  // odd n: no [gate | up] split
  EXPECT_EQ(pick(reg, 1, 248320, 64), "cublaslt");     // k below the measured range (tiny models)
  EXPECT_EQ(pick(reg, 1, 512, 64, 1), "cublaslt");
  EXPECT_EQ(pick(reg, 1, 2048, 4096, 1), "cublaslt");  // d_ff 1024 < 8192
  EXPECT_EQ(pick(reg, 1, 5120, 17408), tma_narrow_or(1, 5120, 17408, "gemv_narrow"));  // k > 8192
  EXPECT_EQ(pick(reg, 1, 5120, 5124), "cublaslt");     // k % 8
  auto r80 = cuda::DispatchRegistry::with_defaults(80, "");
  EXPECT_EQ(pick(r80, 1, 34816, 5120), "cublaslt");
  auto off = cuda::DispatchRegistry::with_defaults(90, "gemm.gemv_bulk");
  EXPECT_EQ(pick(off, 1, 34816, 5120), "cublaslt");
  EXPECT_TRUE(cuda::gemv_bulk_fits(4, 6144, {1, 8, false}));
  EXPECT_FALSE(cuda::gemv_bulk_fits(4, 6144, {1, 16, false}));  // 242 KB > 227 KB
  EXPECT_FALSE(cuda::gemv_bulk_fits(1, 5120, {1, 12, false}));  // not a multiple of 8 warps
  EXPECT_FALSE(cuda::gemv_bulk_fits(9, 64, {1, 8, false}));     // m > 8
  for (int m = 1; m <= cuda::kGemvBulkMaxM; ++m)
    for (int k : {8, 5120, 6144, 8192})
      if (cuda::gemv_bulk_supports(m, 100, k)) {
        EXPECT_TRUE(cuda::gemv_bulk_fits(m, k, cuda::gemv_bulk_config(m, 100, k))) << m << " " << k;
      }
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  DevBuf<bf> x(64), w(64 * 64);
  DevBuf<char> y(64 * 64 * 4);
  const cuda::GemvBulkConfig c{1, 8, false};
  auto launch = [&](int xo, int m, int n, int k, cuda::GemvBulkConfig cc, int sms) {
    cuda::launch_gemv_bulk(B(x, xo), B(w), y.ptr, m, n, k, GemmOut::kBF16, false, cc, sms, 0);
  };
  EXPECT_THROW(launch(1, 1, 8, 16, c, 132), Error);   // x not 16-byte aligned
  EXPECT_THROW(launch(0, 9, 8, 16, c, 132), Error);   // m > 8
  EXPECT_THROW(launch(0, 1, 8, 12, c, 132), Error);   // k % 8
  EXPECT_THROW(launch(0, 1, 8, 16, {3, 8, false}, 132), Error);  // rows per stage
  EXPECT_THROW(launch(0, 1, 8, 16, {1, 40, false}, 132), Error);  // slots
  EXPECT_THROW(launch(0, 1, 8, 16, c, 0), Error);     // n_sms
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}

// ---- narrow-output GEMV (gemv_narrow.cu, variant gemm.gemv_narrow) ------------------------------

LaunchFn narrow_launch(const cuda::GemvNarrowConfig& c, int n_sms) {
  return [c, n_sms](const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, int m, int n, int k,
                    GemmOut o,
                    bool a) { cuda::launch_gemv_narrow(x, w, y, m, n, k, o, a, c, n_sms, 0); };
}

// Odd shapes with every config that fits, vs fp64 (poisoned outputs, or accumulated into): n below
// the SM count (fewer blocks than SMs), many rows per block (the ring wraps many times: mbarrier
// phases), one slice per row (k <= 6144), 2 and 4 slices with a shorter last slice (6152 -> 3080
// + 3072, 12296 -> 3 x 3080 + 3056, 17416 -> 3 x 4360 + 4336), k = 8 (one vector) and k not a
// multiple of 256 (lanes with fewer vectors); bf16 / fp32 out, +=; a grid smaller than the device
// (1 and 7 blocks). Normalised error < 4e-3 (bf16 out: one rounding) / 1e-4 (fp32 out).
TEST(CudaGemvNarrow, OddShapesEveryConfig) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(51);
  struct NK {
    int n, k;
  };
  const NK shapes[] = {{1, 8},      {37, 24},   {203, 40},    {77, 5128},  {5000, 256},
                       {20001, 64}, {33, 6152}, {263, 12296}, {100, 17416}};
  EXPECT_EQ(cuda::gemv_narrow_slices(6152), 2);
  EXPECT_EQ(cuda::gemv_narrow_slices(12296), 4);
  EXPECT_EQ(cuda::gemv_narrow_slice_len(17416), 4360);
  int launched = 0;
  for (int m : {1, 2, 3, 5, 8})
    for (const NK& s : shapes)
      for (const cuda::GemvNarrowConfig& c : cuda::gemv_narrow_configs(m, s.n, s.k, n_sms)) {
        check_launch_vs_cpu(m, s.n, s.k, GemmOut::kBF16, false, narrow_launch(c, n_sms), c.name(),
                            rng);
        ++launched;
      }
  EXPECT_GT(launched, 60);
  const cuda::GemvNarrowConfig c8{8, false};
  check_launch_vs_cpu(3, 133, 12296, GemmOut::kF32, false, narrow_launch(c8, n_sms), "s8", rng);
  check_launch_vs_cpu(4, 150, 17408, GemmOut::kBF16, true, narrow_launch(c8, n_sms), "s8", rng);
  check_launch_vs_cpu(5, 70, 264, GemmOut::kF32, true, narrow_launch(c8, n_sms), "s8", rng);
  // One SM (every row in one block), and a grid of 7 (blocks of unequal row counts).
  check_launch_vs_cpu(2, 300, 1032, GemmOut::kBF16, false, narrow_launch(c8, 1), "s8 1 SM", rng);
  check_launch_vs_cpu(1, 40, 17408, GemmOut::kBF16, false, narrow_launch(c8, 7), "s8 7 SMs", rng);
}

// The 27B narrow decode shapes (down 5120 x 17408, gdn_out / attn_o 5120 x 6144) at m 1, 2, 3, 4
// and 8 (where x fits), shipped config:
//  - vs fp64 on 384 sampled rows (first / last 128 and 128 spread ones, i.e. across block
//    boundaries): |y - ref| <= 1 bf16 ulp of max(|y|, |ref|) + 1e-4 * sum_i |x_i w_i|;
//  - vs cuBLASLt on every output: within 1 bf16 ulp of the larger magnitude, or 1e-3 of the
//    output's max where both are near zero (the two sum in different orders, each rounds once);
//  - every other config that fits gives the same bits (the order depends on k only), and so does
//    the engine's path through the registry where a guard picks the kernel.
TEST(CudaGemvNarrow, Shapes27bMatchCublasLtAndFp64) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(53);
  Pool wpool(size_t(5120) * 17408, rng, 0.02f);
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  cuda::GemmEngine fast, ref;
  fast.set_dispatch(&reg);
  for (const Op& o : kOps27b) {
    if (o.n != 5120) continue;  // the narrow outputs: gdn_out, attn_o, down
    const SampledRows sampled = sample_rows(o, wpool);
    for (int m : {1, 2, 3, 4, 8}) {
      if (o.k == 17408 && m == 8) {  // x (278 KB) does not fit the shared memory
        EXPECT_FALSE(cuda::gemv_narrow_supports(m, o.n, o.k, n_sms));
        continue;
      }
      ASSERT_TRUE(cuda::gemv_narrow_supports(m, o.n, o.k, n_sms)) << o.name << " m " << m;
      const std::string& v = fast.variant(m, o.n, o.k);
      const bool guarded = v == "gemv_narrow";
      EXPECT_EQ(guarded, cuda::gemv_narrow_preferred(m, o.n, o.k) &&
                             !cuda::gemv_tma_narrow_preferred(m, o.n, o.k))
          << o.name << " m " << m;
      EXPECT_EQ(guarded, o.k == 17408 && m <= 2 && !cuda::gemv_tma_narrow_preferred(m, o.n, o.k))
          << o.name << " m " << m;
      auto x = test::random_bf16(size_t(m) * o.k, rng);
      DevBuf<bf> dx(x);
      const size_t cnt = size_t(m) * o.n;
      DevBuf<char> y1(cnt * 2), y2(cnt * 2), y3(cnt * 2);
      y1.poison();
      y2.poison();
      const cuda::GemvNarrowConfig shipped = cuda::gemv_narrow_config(m, o.n, o.k, n_sms);
      cuda::launch_gemv_narrow(B(dx), B(wpool.buf), y1.ptr, m, o.n, o.k, GemmOut::kBF16, false,
                               shipped, n_sms, 0);
      ref.run(B(dx), B(wpool.buf), y2.ptr, m, o.n, o.k, GemmOut::kBF16, 0);
      const auto bits = y1.download();
      for (cuda::GemvNarrowConfig c : cuda::gemv_narrow_configs(m, o.n, o.k, n_sms)) {
        y3.poison();
        cuda::launch_gemv_narrow(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, GemmOut::kBF16, false, c,
                                 n_sms, 0);
        EXPECT_TRUE(y3.download() == bits) << o.name << " m " << m << " config " << c.name();
      }
      if (guarded) {
        y3.poison();
        fast.run(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, GemmOut::kBF16, 0);
        EXPECT_TRUE(y3.download() == bits) << o.name << " m " << m << " engine path";
      }
      DS_CUDA_CHECK(cudaDeviceSynchronize());
      const auto a = download_out(y1, cnt, false), b = download_out(y2, cnt, false);
      const double worst64 = expect_sampled_rows_match_fp64(x, sampled, a, o, m);
      const CublasLtDiff r = expect_bf16_close_to_cublaslt(a, b, o, m);
      std::printf(
          "  narrow %-8s m=%d bf16 out: %zu of %zu differ from cuBLASLt (worst %.2f of tol), "
          "fp64 worst %.2f of tol\n",
          o.name, m, r.differ, cnt, r.worst, worst64);
    }
  }
}

// Token i's outputs are bit-identical for m = 1..4 and 8 (the summation order depends on k only),
// and for any grid size.
TEST(CudaGemvNarrow, BatchAndGridInvariant) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(57);
  for (auto [n, k, mmax] :
       {std::tuple{5120, 17408, 4}, std::tuple{5120, 6144, 8}, std::tuple{300, 12296, 4}}) {
    auto x = test::random_bf16(size_t(mmax) * k, rng), w = test::random_bf16(size_t(n) * k, rng);
    DevBuf<bf> dx(x), dw(w);
    DevBuf<char> ya(size_t(mmax) * n * 2), ys(size_t(mmax) * n * 2);
    cuda::launch_gemv_narrow(B(dx), B(dw), ya.ptr, mmax, n, k, GemmOut::kBF16, false,
                             cuda::gemv_narrow_config(mmax, n, k, n_sms), n_sms, 0);
    const auto a = ya.download();
    for (auto [t0, m] :
         {std::pair{0, 1}, std::pair{mmax - 1, 1}, std::pair{1, 2}, std::pair{1, 3}}) {
      ys.poison();
      cuda::launch_gemv_narrow(B(dx, size_t(t0) * k), B(dw), ys.ptr, m, n, k, GemmOut::kBF16, false,
                               cuda::gemv_narrow_config(m, n, k, n_sms), n_sms, 0);
      const auto b = ys.download();
      EXPECT_EQ(std::memcmp(a.data() + size_t(t0) * n * 2, b.data(), size_t(m) * n * 2), 0)
          << "tokens " << t0 << ".." << t0 + m - 1 << " n " << n << " k " << k;
    }
    for (int grid : {n_sms / 2, 100}) {
      if (!cuda::gemv_narrow_supports(mmax, n, k, grid)) continue;
      ys.poison();
      cuda::launch_gemv_narrow(B(dx), B(dw), ys.ptr, mmax, n, k, GemmOut::kBF16, false,
                               cuda::gemv_narrow_config(mmax, n, k, grid), grid, 0);
      EXPECT_TRUE(ys.download() == a) << "grid " << grid << " n " << n << " k " << k;
    }
  }
}

// Programmatic dependent launch, as in the MLP: act = x w_up^T (the bulk GEMV, [4, 17408]) then
// y = act w_down^T (the narrow GEMV, k 17408), both with the attribute: the second streams its
// weights early and reads act only after griddepcontrol.wait (act poisoned before: a missing wait
// gives NaN), on a stream and from a CUDA graph; bit-identical to no PDL.
TEST(CudaGemvNarrow, DependentLaunchesChain) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(59);
  const int m = 4, n1 = 17408, k1 = 1024, n2 = 1024;
  auto x = test::random_bf16(size_t(m) * k1, rng),
       w1 = test::random_bf16(size_t(n1) * k1, rng, 0.05f),
       w2 = test::random_bf16(size_t(n2) * n1, rng, 0.02f);
  DevBuf<bf> dx(x), dw1(w1), dw2(w2), y1(size_t(m) * n1), y2(size_t(m) * n2);
  cudaStream_t s;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto chain = [&](bool pdl) {
    cuda::GemvBulkConfig c1 = cuda::gemv_bulk_config(m, n1, k1);
    cuda::GemvNarrowConfig c2 = cuda::gemv_narrow_config(m, n2, n1, n_sms);
    c1.pdl = c2.pdl = pdl;
    cuda::launch_gemv_bulk(B(dx), B(dw1), y1.ptr, m, n1, k1, GemmOut::kBF16, false, c1, n_sms, s);
    cuda::launch_gemv_narrow(B(y1), B(dw2), y2.ptr, m, n2, n1, GemmOut::kBF16, false, c2, n_sms, s);
  };
  expect_pdl_chain_matches_serial(chain, y1, y2, w2, m, n1, n2, s);
  // narrow -> narrow (the next layer's down projection right behind this one's)
  DevBuf<bf> y3(size_t(m) * n2);
  auto w3 = test::random_bf16(size_t(n2) * n2, rng, 0.05f);
  DevBuf<bf> dw3(w3);
  auto chain2 = [&](bool pdl) {
    cuda::GemvNarrowConfig c = cuda::gemv_narrow_config(m, n2, n1, n_sms);
    c.pdl = pdl;
    cuda::launch_gemv_narrow(B(y1), B(dw2), y2.ptr, m, n2, n1, GemmOut::kBF16, false, c, n_sms, s);
    cuda::GemvNarrowConfig c3 = cuda::gemv_narrow_config(m, n2, n2, n_sms);
    c3.pdl = pdl;
    cuda::launch_gemv_narrow(B(y2), B(dw3), y3.ptr, m, n2, n2, GemmOut::kBF16, false, c3, n_sms, s);
  };
  expect_pdl_chain_matches_serial(chain2, y2, y3, w3, m, n2, n2, s);
  cudaStreamDestroy(s);
}

// The L2 prefetch ahead (GemvNarrowConfig::l2_ahead, session 34): after the wait and x's copy the
// producer queues its next slices for L2. The down projection (m 1, 2) and gdn_out's shape (m 1),
// contiguous and interleaved, plain and PDL, and an odd shape: every count (1, 10, past the last
// stage) gives the bits of 0, every output written, with accumulate too. m 3, fp32 out and a
// negative count are refused; the KiB to stages rounding.
TEST(CudaGemvNarrow, L2AheadBitIdentical) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(61);
  Pool wpool(size_t(5120) * 17408, rng, 0.02f);
  struct Sh {
    const char* name;
    int m, n, k;
  };
  int compared = 0;
  for (const Sh& sh : {Sh{"down", 1, 5120, 17408}, Sh{"down m2", 2, 5120, 17408},
                       Sh{"gdn_out", 1, 5120, 6144}, Sh{"odd", 2, 1001, 12296}}) {
    DevBuf<bf> dx(test::random_bf16(size_t(sh.m) * sh.k, rng));
    const size_t cnt = size_t(sh.m) * sh.n;
    const std::vector<bf> y0 = test::random_bf16(cnt, rng);  // accumulate's starting values
    for (bool ilv : {false, true})
      for (bool acc : {false, true}) {
        cuda::GemvNarrowConfig c = cuda::gemv_narrow_config(sh.m, sh.n, sh.k, n_sms);
        c.interleave = ilv;
        DevBuf<bf> ref(cnt), y(cnt);
        if (acc) ref.upload(y0); else ref.poison();
        cuda::launch_gemv_narrow(B(dx), B(wpool.buf), ref.ptr, sh.m, sh.n, sh.k, GemmOut::kBF16,
                                 acc, c, n_sms, 0);
        DS_CUDA_CHECK(cudaDeviceSynchronize());
        const auto bits = ref.download();
        size_t nan = 0;
        for (bf v : bits) nan += (v & 0x7f80) == 0x7f80 && (v & 0x7f);
        EXPECT_EQ(nan, 0u) << sh.name << ": outputs unwritten";
        for (int ahead : {1, 10, 100000})
          for (bool pdl : {false, true}) {
            cuda::GemvNarrowConfig a = c;
            a.pdl = pdl;
            a.l2_ahead = ahead;
            if (acc) y.upload(y0); else y.poison();
            cuda::launch_gemv_narrow(B(dx), B(wpool.buf), y.ptr, sh.m, sh.n, sh.k, GemmOut::kBF16,
                                     acc, a, n_sms, 0);
            DS_CUDA_CHECK(cudaDeviceSynchronize());
            EXPECT_TRUE(y.download() == bits) << sh.name << (acc ? " acc " : " ") << a.name();
            ++compared;
          }
      }
  }
  EXPECT_EQ(compared, 96);
  DevBuf<bf> dx(test::random_bf16(size_t(3) * 17408, rng)), y(size_t(3) * 5120);
  DevBuf<float> yf(5120);
  cuda::GemvNarrowConfig a = cuda::gemv_narrow_config(3, 5120, 17408, n_sms);
  a.l2_ahead = 4;
  EXPECT_THROW(cuda::launch_gemv_narrow(B(dx), B(wpool.buf), y.ptr, 3, 5120, 17408, GemmOut::kBF16,
                                        false, a, n_sms, 0),
               Error);  // m 3
  a = cuda::gemv_narrow_config(1, 5120, 17408, n_sms);
  a.l2_ahead = 4;
  EXPECT_THROW(cuda::launch_gemv_narrow(B(dx), B(wpool.buf), yf.ptr, 1, 5120, 17408, GemmOut::kF32,
                                        false, a, n_sms, 0),
               Error);  // fp32 out
  a.l2_ahead = -1;
  EXPECT_THROW(cuda::launch_gemv_narrow(B(dx), B(wpool.buf), y.ptr, 1, 5120, 17408, GemmOut::kBF16,
                                        false, a, n_sms, 0),
               Error);
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(CudaGemvNarrow, L2AheadBudget) {
  EXPECT_EQ(cuda::gemv_narrow_ahead_stages(0, 17408), 0);
  EXPECT_EQ(cuda::gemv_narrow_ahead_stages(80, 17408), 10);  // 8.5 KiB slices (4 x 4352)
  EXPECT_EQ(cuda::gemv_narrow_ahead_stages(80, 6144), 7);    // one 12 KiB slice a row
  EXPECT_EQ(cuda::gemv_narrow_ahead_stages(1, 6144), 1);
}

TEST(CudaGemvNarrow, GuardAndErrors) {
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  using F = cuda::KernelFamily;
  auto pick = [&](const cuda::DispatchRegistry& r, int m, int n, int k) {
    return r.select(F::kGemm, r.key(m, n, k)).name;
  };
  for (int m = 1; m <= 2; ++m)
    EXPECT_EQ(pick(reg, m, 5120, 17408), tma_narrow_or(m, 5120, 17408, "gemv_narrow")) << m;
  for (int m = 3; m <= 4; ++m)
    EXPECT_EQ(pick(reg, m, 5120, 17408), tma_narrow_or(m, 5120, 17408, "skinny_mma")) << m;
  const std::string above4 = tma_narrow_or(
      16, 5120, 17408,
      cuda::gemv_splitk_preferred(16, 5120, 17408) ? "gemv_splitk_mma" : "cublaslt");
  for (int m = 5; m <= 16; ++m) EXPECT_EQ(pick(reg, m, 5120, 17408), above4) << m;
  EXPECT_EQ(pick(reg, 1, 5120, 17412), "cublaslt");     // k % 8
  EXPECT_EQ(pick(reg, 1, 17408, 17408), "skinny_mma");  // n > 8192: not measured
  EXPECT_EQ(pick(reg, 1, 512, 17408), "skinny_mma");    // n < 1024
  // gdn_out / attn_o stay with gemv_bulk_pdl (ties in the decode step) / cuBLASLt, or
  // gemv_tma_narrow under its switch
  EXPECT_EQ(pick(reg, 1, 5120, 6144),
            tma_narrow_or(1, 5120, 6144,
                          cuda::gemv_pdl_mode() == cuda::GemvPdl::kOff ? "cublaslt"
                                                                        : "gemv_bulk_pdl"));
  EXPECT_EQ(pick(reg, 2, 5120, 6144), tma_narrow_or(2, 5120, 6144, "cublaslt"));
  auto r80 = cuda::DispatchRegistry::with_defaults(80, "");
  EXPECT_EQ(pick(r80, 1, 5120, 17408), "cublaslt");
  auto off = cuda::DispatchRegistry::with_defaults(90, "gemm.gemv_narrow");
  EXPECT_EQ(pick(off, 1, 5120, 17408), tma_narrow_or(1, 5120, 17408, "skinny_mma"));
  EXPECT_TRUE(cuda::gemv_narrow_supports(4, 5120, 17408, 132));
  EXPECT_FALSE(cuda::gemv_narrow_supports(5, 5120, 17408, 132));           // x: 174 KB + 8 stages
  EXPECT_FALSE(cuda::gemv_narrow_supports(9, 100, 64, 132));               // m > 8
  EXPECT_FALSE(cuda::gemv_narrow_supports(1, 100, 12, 132));               // k % 8
  EXPECT_FALSE(cuda::gemv_narrow_fits(1, 5120, 17408, {12, false}, 132));  // not a multiple of 8
  EXPECT_FALSE(cuda::gemv_narrow_fits(1, 5120, 17408, {40, false}, 132));  // > 32 slots
  EXPECT_EQ(cuda::gemv_narrow_slices(17408), 4);
  EXPECT_EQ(cuda::gemv_narrow_slice_len(17408), 4352);
  EXPECT_EQ(cuda::gemv_narrow_slices(6144), 1);
  for (int m = 1; m <= 4; ++m)
    for (int k : {6144, 17408})
      EXPECT_TRUE(
          cuda::gemv_narrow_fits(m, 5120, k, cuda::gemv_narrow_config(m, 5120, k, 132), 132))
          << m << " " << k;
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  DevBuf<bf> x(64), w(64 * 64);
  DevBuf<char> y(64 * 64 * 4);
  const cuda::GemvNarrowConfig c{8, false};
  auto launch = [&](int xo, int m, int n, int k, cuda::GemvNarrowConfig cc, int sms, void* yp) {
    cuda::launch_gemv_narrow(B(x, xo), B(w), yp, m, n, k, GemmOut::kBF16, false, cc, sms, 0);
  };
  EXPECT_THROW(launch(1, 1, 8, 16, c, 132, y.ptr), Error);            // x not 16-byte aligned
  EXPECT_THROW(launch(0, 9, 8, 16, c, 132, y.ptr), Error);            // m > 8
  EXPECT_THROW(launch(0, 1, 8, 12, c, 132, y.ptr), Error);            // k % 8
  EXPECT_THROW(launch(0, 1, 8, 16, {12, false}, 132, y.ptr), Error);  // slots
  EXPECT_THROW(launch(0, 1, 8, 16, c, 0, y.ptr), Error);              // n_sms
  EXPECT_THROW(launch(0, 1, 8, 16, c, 132, nullptr), Error);          // null y
  DS_CUDA_CHECK(cudaDeviceSynchronize());
  // Through GemmEngine: the narrow path makes no cuBLASLt plan.
  cuda::GemmEngine g;
  g.set_dispatch(&reg);
  std::mt19937 rng(61);
  auto hx = test::random_bf16(17408, rng), hw = test::random_bf16(size_t(1024) * 17408, rng);
  DevBuf<bf> dx(hx), dw(hw);
  DevBuf<char> y1(1024 * 2);
  EXPECT_EQ(g.variant(1, 1024, 17408), "gemv_narrow");
  g.run(B(dx), B(dw), y1.ptr, 1, 1024, 17408, GemmOut::kBF16, 0);
  EXPECT_EQ(g.late_plans(), 0);
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}

// The > 48 KiB shared-memory opt-in belongs to each device's context (ensure_smem_optin): after
// the kernel ran on device 0, its first launches on device 1 must work too (a per-process
// std::call_once left them failing there) and give the same bits (2 GPUs, else skipped).
TEST(CudaGemvNarrow, SecondDevice) {
  DS_REQUIRE_GPU();
  DS_REQUIRE_GPUS(2);
  test::RestoreDevice restore;
  std::mt19937 rng(67);
  const int n = 5120, k = 17408;  // the down projection, m 1..2 (what the guard ships)
  auto x = test::random_bf16(size_t(2) * k, rng), w = test::random_bf16(size_t(n) * k, rng, 0.02f);
  std::vector<char> outs[2][2];
  for (int dev : {0, 1}) {
    DS_CUDA_CHECK(cudaSetDevice(dev));
    if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90 (device " << dev << ")";
    const int n_sms = device_sms();
    {
      DevBuf<bf> dx(x), dw(w);
      for (int m : {1, 2}) {
        DevBuf<char> y(size_t(m) * n * 2);
        y.poison();
        cuda::launch_gemv_narrow(B(dx), B(dw), y.ptr, m, n, k, GemmOut::kBF16, false,
                                 cuda::gemv_narrow_config(m, n, k, n_sms), n_sms, 0);
        DS_CUDA_CHECK(cudaDeviceSynchronize());
        outs[dev][m - 1] = y.download();
      }
    }
    const cuda::GemvNarrowConfig c8{8, false};
    check_launch_vs_cpu(2, 150, k, GemmOut::kF32, true, narrow_launch(c8, n_sms),
                        "s8 device " + std::to_string(dev), rng);
  }
  for (int m : {1, 2}) EXPECT_TRUE(outs[0][m - 1] == outs[1][m - 1]) << "m " << m;
}

// ---- tensor-core bulk-copy GEMV (gemv_bulk_mma.cu, variant gemm.gemv_bulk_mma) ------------------
// Launched directly, so these run (and must pass) with $DS_GEMV_MMA either way; only the registry
// expectations follow the switch.

// fp64 y[t, j] = sum_c x[t, c] w[j, c] and sum_c |x[t, c] w[j, c]| for t < m.
void reference64(const std::vector<bf>& x, const std::vector<bf>& w, int m, int n, int k,
                 std::vector<double>& ref, std::vector<double>& mag) {
  const std::vector<float> xf = test::to_f32(x), wf = test::to_f32(w);
  ref.assign(size_t(m) * n, 0.0);
  mag.assign(size_t(m) * n, 0.0);
  for (int t = 0; t < m; ++t)
    for (int j = 0; j < n; ++j) {
      double s = 0, a = 0;
      const float* xr = &xf[size_t(t) * k];
      const float* wr = &wf[size_t(j) * k];
      for (int c = 0; c < k; ++c) {
        const double p = double(xr[c]) * wr[c];
        s += p;
        a += std::fabs(p);
      }
      ref[size_t(t) * n + j] = s, mag[size_t(t) * n + j] = a;
    }
}

// Every output of got [m, n] vs fp64: |y - ref| <= (bf16 out: 1 bf16 ulp of max(|y|, |ref|)) +
// 1e-4 * sum |x w|. An element left unwritten keeps the poison (NaN) and fails. Returns the number
// out of tolerance.
size_t count_bad_vs_fp64(const std::vector<float>& got, const std::vector<double>& ref,
                         const std::vector<double>& mag, bool f32, double* worst = nullptr) {
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(double(got[i]) - ref[i]);
    const double tol =
        (f32 ? 0.0 : bf16_ulp(std::max(std::fabs(double(got[i])), std::fabs(ref[i])))) +
        1e-4 * mag[i];
    if (!(d <= tol)) ++bad;
    if (worst) *worst = std::max(*worst, d / std::max(tol, 1e-30));
  }
  return bad;
}

size_t count_nonfinite(const std::vector<float>& v) {
  return size_t(std::count_if(v.begin(), v.end(), [](float f) { return !std::isfinite(f); }));
}

// Odd shapes, every config that fits, m 1, 3, 8, 13, 16, bf16 and fp32 out, poisoned outputs,
// every element vs fp64 (tolerance at count_bad_vs_fp64), every config bit-identical to the
// first: n below 16 x the SM count (blocks of 1..8 rows: one partial group), n = 1, k = 64 (one
// 64-wide step), k 4160 (a 64-element last chunk for kc 512 and 1024), k 4096 and 8192 (the guard's
// range), many rows per block (20001: 10 groups, the ring wraps many times, warps with two groups),
// the most groups a block takes (n = 768 x SMs: 48 groups, all six accumulator sets of every
// warp), and grids of 1 and 7 blocks.
TEST(CudaGemvBulkMma, OddShapesEveryConfig) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(71);
  struct Case {
    int n, k, sms;
  };
  const int n_max = n_sms * 16 * cuda::gemv_bulk_mma_max_groups();
  const Case cases[] = {{1, 64, n_sms},     {37, 128, n_sms},   {203, 576, n_sms},
                        {1000, 4096, n_sms}, {133, 4160, n_sms}, {2111, 8192, n_sms},
                        {20001, 256, n_sms}, {n_max, 64, n_sms}, {700, 576, 1},
                        {5000, 1088, 7}};
  int launched = 0;
  for (const Case& cs : cases) {
    auto x = test::random_bf16(size_t(16) * cs.k, rng),
         w = test::random_bf16(size_t(cs.n) * cs.k, rng, 0.05f);
    DevBuf<bf> dx(x), dw(w);
    std::vector<double> ref, mag;
    reference64(x, w, 16, cs.n, cs.k, ref, mag);  // rows t < m are the m-token references
    for (int m : {1, 3, 8, 13, 16}) {
      const std::vector<double> rm(ref.begin(), ref.begin() + size_t(m) * cs.n),
          mm(mag.begin(), mag.begin() + size_t(m) * cs.n);
      for (bool f32 : {false, true}) {
        const GemmOut out = f32 ? GemmOut::kF32 : GemmOut::kBF16;
        DevBuf<char> y(size_t(m) * cs.n * (f32 ? 4 : 2));
        std::vector<char> first;
        const auto cfgs = cuda::gemv_bulk_mma_configs(m, cs.n, cs.k, cs.sms);
        ASSERT_FALSE(cfgs.empty()) << "n " << cs.n << " k " << cs.k << " sms " << cs.sms;
        for (const cuda::GemvBulkMmaConfig& c : cfgs) {
          y.poison();
          cuda::launch_gemv_bulk_mma(B(dx), B(dw), y.ptr, m, cs.n, cs.k, out, false, c, cs.sms, 0);
          DS_CUDA_CHECK(cudaDeviceSynchronize());
          ++launched;
          const auto raw = y.download();
          const auto got = download_out(y, size_t(m) * cs.n, f32);
          EXPECT_EQ(count_nonfinite(got), 0u) << "unwritten outputs: m " << m << " n " << cs.n
                                              << " k " << cs.k << " " << c.name();
          EXPECT_EQ(count_bad_vs_fp64(got, rm, mm, f32), 0u)
              << "m " << m << " n " << cs.n << " k " << cs.k << " sms " << cs.sms << " "
              << c.name() << (f32 ? " f32" : " bf16");
          if (first.empty())
            first = raw;
          else
            EXPECT_TRUE(raw == first) << "config " << c.name() << " m " << m << " n " << cs.n;
        }
      }
    }
  }
  EXPECT_GT(launched, 300);
  EXPECT_TRUE(cuda::gemv_bulk_mma_supports(16, n_max, 64, n_sms));
  EXPECT_FALSE(cuda::gemv_bulk_mma_supports(16, n_max + 1, 64, n_sms));  // 49 groups
}

// The five Qwen3.5-27B decode projections with k <= 8192 (gdn_in, gdn_out, attn_qkv, attn_o,
// gate_up) at m 3, 4, 8, 13, 16, poisoned outputs:
//  - vs cuBLASLt on every output (expect_bf16_close_to_cublaslt: 1 bf16 ulp of the larger
//    magnitude, or 1e-3 of the output's max near zero);
//  - vs fp64 on 384 sampled rows (expect_sampled_rows_match_fp64);
//  - every config, a PDL launch, and (with $DS_GEMV_MMA=1, where the guard picks the kernel) the
//    engine's path bit-identical to the shipped config; fp32 out (attn_o) vs cuBLASLt.
TEST(CudaGemvBulkMma, Shapes27bMatchCublasLtAndFp64) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(73);
  Pool wpool(size_t(34816) * 5120, rng, 0.02f);
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  cuda::GemmEngine fast, ref;
  fast.set_dispatch(&reg);
  const bool on = cuda::gemv_bulk_mma_enabled();
  std::printf("  DS_GEMV_MMA %s\n", on ? "on" : "off");
  for (const Op& o : kOps27b) {
    if (o.k > 8192 || o.f32) continue;  // down (k 17408), lm_head (n 248320)
    const SampledRows sampled = sample_rows(o, wpool);
    for (int m : {3, 4, 8, 13, 16}) {
      ASSERT_TRUE(cuda::gemv_bulk_mma_supports(m, o.n, o.k, n_sms)) << o.name << " m " << m;
      EXPECT_EQ(cuda::gemv_bulk_mma_preferred(m, o.n, o.k), on) << o.name << " m " << m;
      const bool guarded = fast.variant(m, o.n, o.k) == "gemv_bulk_mma";
      EXPECT_EQ(guarded, on) << o.name << " m " << m;
      auto x = test::random_bf16(size_t(m) * o.k, rng);
      DevBuf<bf> dx(x);
      const size_t cnt = size_t(m) * o.n;
      DevBuf<char> y1(cnt * 2), y2(cnt * 2), y3(cnt * 2);
      y1.poison();
      y2.poison();
      const cuda::GemvBulkMmaConfig shipped = cuda::gemv_bulk_mma_config(m, o.n, o.k);
      cuda::launch_gemv_bulk_mma(B(dx), B(wpool.buf), y1.ptr, m, o.n, o.k, GemmOut::kBF16, false,
                                 shipped, n_sms, 0);
      ref.run(B(dx), B(wpool.buf), y2.ptr, m, o.n, o.k, GemmOut::kBF16, 0);
      const auto bits = y1.download();
      for (cuda::GemvBulkMmaConfig c : cuda::gemv_bulk_mma_configs(m, o.n, o.k, n_sms)) {
        for (bool pdl : {false, true}) {
          c.pdl = pdl;
          y3.poison();
          cuda::launch_gemv_bulk_mma(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, GemmOut::kBF16,
                                     false, c, n_sms, 0);
          EXPECT_TRUE(y3.download() == bits) << o.name << " m " << m << " config " << c.name();
        }
      }
      if (guarded) {
        y3.poison();
        fast.run(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, GemmOut::kBF16, 0);
        EXPECT_TRUE(y3.download() == bits) << o.name << " m " << m << " engine path";
      }
      DS_CUDA_CHECK(cudaDeviceSynchronize());
      const auto a = download_out(y1, cnt, false), b = download_out(y2, cnt, false);
      EXPECT_EQ(count_nonfinite(a), 0u) << o.name << " m " << m << ": unwritten outputs";
      const double worst64 = expect_sampled_rows_match_fp64(x, sampled, a, o, m);
      const CublasLtDiff r = expect_bf16_close_to_cublaslt(a, b, o, m);
      std::printf(
          "  bulk_mma %-8s m=%-2d bf16 out: %zu of %zu differ from cuBLASLt (worst %.2f of tol), "
          "fp64 worst %.2f of tol\n",
          o.name, m, r.differ, cnt, r.worst, worst64);
    }
  }
  // fp32 out (the kernel's other epilogue) on attn_o at m 16: relative L2 vs cuBLASLt < 1e-5.
  const int m = 16, n = 5120, k = 6144;
  auto x = test::random_bf16(size_t(m) * k, rng);
  DevBuf<bf> dx(x);
  DevBuf<char> y1(size_t(m) * n * 4), y2(size_t(m) * n * 4);
  y1.poison();
  cuda::launch_gemv_bulk_mma(B(dx), B(wpool.buf), y1.ptr, m, n, k, GemmOut::kF32, false,
                             cuda::gemv_bulk_mma_config(m, n, k), n_sms, 0);
  ref.run(B(dx), B(wpool.buf), y2.ptr, m, n, k, GemmOut::kF32, 0);
  DS_CUDA_CHECK(cudaDeviceSynchronize());
  const auto a = download_out(y1, size_t(m) * n, true), b = download_out(y2, size_t(m) * n, true);
  EXPECT_EQ(count_nonfinite(a), 0u);
  const double e = test::norm_err(a, b);
  EXPECT_LT(e, 1e-5);
  std::printf("  bulk_mma attn_o   m=16 f32 out: relative L2 vs cuBLASLt %.2e\n", e);
}

// Batch invariance: token t's outputs in an m = 16 call are bit-identical to the same x row in
// calls of m = 3 (and 1, 8, 13) starting at that row (the padding rows are zeros and an MMA's
// output row depends on its own A row only), for bf16 and fp32 out.
TEST(CudaGemvBulkMma, BatchInvariant) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(79);
  for (auto [n, k] : {std::pair{5120, 6144}, std::pair{16480, 5120}, std::pair{300, 4160}}) {
    auto x = test::random_bf16(size_t(16) * k, rng), w = test::random_bf16(size_t(n) * k, rng);
    DevBuf<bf> dx(x), dw(w);
    for (bool f32 : {false, true}) {
      const GemmOut out = f32 ? GemmOut::kF32 : GemmOut::kBF16;
      const size_t es = f32 ? 4 : 2;
      DevBuf<char> y16(size_t(16) * n * es), ys(size_t(16) * n * es);
      y16.poison();
      cuda::launch_gemv_bulk_mma(B(dx), B(dw), y16.ptr, 16, n, k, out, false,
                                 cuda::gemv_bulk_mma_config(16, n, k), n_sms, 0);
      const auto a = y16.download();
      for (auto [t0, m] : {std::pair{0, 3}, std::pair{5, 3}, std::pair{13, 3}, std::pair{15, 1},
                           std::pair{8, 8}, std::pair{2, 13}}) {
        ys.poison();
        cuda::launch_gemv_bulk_mma(B(dx, size_t(t0) * k), B(dw), ys.ptr, m, n, k, out, false,
                                   cuda::gemv_bulk_mma_config(m, n, k), n_sms, 0);
        const auto b = ys.download();
        EXPECT_EQ(std::memcmp(a.data() + size_t(t0) * n * es, b.data(), size_t(m) * n * es), 0)
            << "tokens " << t0 << ".." << t0 + m - 1 << " n " << n << " k " << k
            << (f32 ? " f32" : " bf16");
      }
    }
  }
}

// Programmatic dependent launch: y2 = y1 w2^T right behind y1 = x w1^T, both with the attribute
// (the second issues its first weight stages early and copies y1 only after griddepcontrol.wait;
// y1 poisoned before), on a stream and from a CUDA graph: bit-identical to plain launches. The
// shapes of attn_qkv-like -> attn_o-like at m 16.
TEST(CudaGemvBulkMma, DependentLaunchesChain) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(83);
  const int m = 16, n1 = 6144, k1 = 5120, n2 = 5120;
  auto x = test::random_bf16(size_t(m) * k1, rng),
       w1 = test::random_bf16(size_t(n1) * k1, rng, 0.02f),
       w2 = test::random_bf16(size_t(n2) * n1, rng, 0.02f);
  DevBuf<bf> dx(x), dw1(w1), dw2(w2), y1(size_t(m) * n1), y2(size_t(m) * n2);
  cudaStream_t s;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto chain = [&](bool pdl) {
    cuda::GemvBulkMmaConfig c1 = cuda::gemv_bulk_mma_config(m, n1, k1),
                            c2 = cuda::gemv_bulk_mma_config(m, n2, n1);
    c1.pdl = c2.pdl = pdl;
    cuda::launch_gemv_bulk_mma(B(dx), B(dw1), y1.ptr, m, n1, k1, GemmOut::kBF16, false, c1,
                               n_sms, s);
    cuda::launch_gemv_bulk_mma(B(y1), B(dw2), y2.ptr, m, n2, n1, GemmOut::kBF16, false, c2,
                               n_sms, s);
  };
  expect_pdl_chain_matches_serial(chain, y1, y2, w2, m, n1, n2, s);
  // A bulk GEMV (m 8) feeding the mma GEMV, as gdn_in -> ... -> gdn_out would at batch 8.
  DevBuf<bf> z1(size_t(8) * n1), z2(size_t(8) * n2);
  auto chain2 = [&](bool pdl) {
    cuda::GemvBulkConfig c1 = cuda::gemv_bulk_config(8, n1, k1);
    cuda::GemvBulkMmaConfig c2 = cuda::gemv_bulk_mma_config(8, n2, n1);
    c1.pdl = c2.pdl = pdl;
    cuda::launch_gemv_bulk(B(dx), B(dw1), z1.ptr, 8, n1, k1, GemmOut::kBF16, false, c1, n_sms, s);
    cuda::launch_gemv_bulk_mma(B(z1), B(dw2), z2.ptr, 8, n2, n1, GemmOut::kBF16, false, c2, n_sms,
                               s);
  };
  expect_pdl_chain_matches_serial(chain2, z1, z2, w2, 8, n1, n2, s);
  cudaStreamDestroy(s);
}

TEST(CudaGemvBulkMma, GuardAndErrors) {
  const bool on = cuda::gemv_bulk_mma_enabled();
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  using F = cuda::KernelFamily;
  auto pick = [&](const cuda::DispatchRegistry& r, int m, int n, int k, int glu = 0) {
    return r.select(F::kGemm, r.key(m, n, k, glu)).name;
  };
  const std::string mma = on ? "gemv_bulk_mma" : "cublaslt";
  // gemv_tma (on by default, asked before gemv_bulk_mma) takes gdn_in / attn_qkv / gate_up at m
  // 5..16 unless $DS_GEMV_TMA is 0 (plain shapes) or silu (the fused key only)
  const cuda::GemvTmaMode tm = cuda::gemv_tma_mode();
  for (int m = 3; m <= 16; ++m) {
    const bool tma_plain = m >= 5 && tm == cuda::GemvTmaMode::kAll;
    const bool tma_silu = m >= 5 && tm != cuda::GemvTmaMode::kOff;
    EXPECT_EQ(pick(reg, m, 16480, 5120), tma_plain ? "gemv_tma" : mma) << m;  // gdn_in
    EXPECT_EQ(pick(reg, m, 5120, 6144), tma_narrow_or(m, 5120, 6144, mma)) << m;  // gdn_out
    EXPECT_EQ(pick(reg, m, 14336, 5120), tma_plain ? "gemv_tma" : mma) << m;  // attn_qkv
    EXPECT_EQ(pick(reg, m, 34816, 5120), tma_plain ? "gemv_tma" : mma) << m;  // gate_up (plain)
    // the MLP's fused key: gemv_bulk_silu keeps m 3..4 (asked first); from m 5 gemv_tma_silu, else
    // the plain GEMM
    EXPECT_EQ(pick(reg, m, 34816, 5120, 1),
              m <= 4 ? std::string("gemv_bulk_silu") : tma_silu ? std::string("gemv_tma_silu") : mma)
        << m;
    EXPECT_NE(pick(reg, m, 5120, 17408), "gemv_bulk_mma") << m;  // down: k > 8192
  }
  EXPECT_EQ(pick(reg, 1, 34816, 5120), "gemv_bulk");  // m 1..2 unchanged
  EXPECT_EQ(pick(reg, 2, 34816, 5120), "gemv_bulk");
  EXPECT_EQ(pick(reg, 2, 16480, 5120), "cublaslt");
  EXPECT_EQ(pick(reg, 17, 16480, 5120), "cublaslt");   // m > 16
  EXPECT_EQ(pick(reg, 8, 4096, 4096), mma);            // the range's corners
  EXPECT_EQ(pick(reg, 8, 4096, 8192), mma);
  EXPECT_EQ(pick(reg, 8, 4096, 4160), mma);            // k % 64 == 0, not % 512
  EXPECT_EQ(pick(reg, 8, 4096, 8256), "cublaslt");     // k > 8192
  EXPECT_EQ(pick(reg, 8, 4096, 4032), "cublaslt");     // k < 4096
  EXPECT_EQ(pick(reg, 8, 4096, 5128), "cublaslt");     // k % 64
  EXPECT_EQ(pick(reg, 8, 4095, 5120), "cublaslt");     // n < 4096
  EXPECT_EQ(pick(reg, 8, 248320, 5120), "cublaslt");   // lm_head: > 48 groups per block
  auto r80 = cuda::DispatchRegistry::with_defaults(80, "");
  EXPECT_EQ(pick(r80, 8, 16480, 5120), "cublaslt");
  auto off = cuda::DispatchRegistry::with_defaults(90, "gemm.gemv_bulk_mma,gemm.gemv_tma");
  EXPECT_EQ(pick(off, 8, 16480, 5120), "cublaslt");
  // fits
  const cuda::GemvBulkMmaConfig d;
  EXPECT_EQ(d.kc, 512);
  EXPECT_EQ(d.slots, 11);
  EXPECT_TRUE(cuda::gemv_bulk_mma_fits(16, 34816, 5120, d, 132));
  EXPECT_TRUE(cuda::gemv_bulk_mma_fits(1, 1, 64, d, 132));
  EXPECT_TRUE(cuda::gemv_bulk_mma_fits(16, 34816, 5120, {1024, 5, false}, 132));
  EXPECT_FALSE(cuda::gemv_bulk_mma_fits(16, 34816, 5120, {1024, 6, false}, 132));  // smem
  EXPECT_FALSE(cuda::gemv_bulk_mma_fits(16, 34816, 5120, {512, 12, false}, 132));  // smem
  EXPECT_FALSE(cuda::gemv_bulk_mma_fits(16, 34816, 5120, {256, 8, false}, 132));   // kc
  EXPECT_FALSE(cuda::gemv_bulk_mma_fits(16, 34816, 5120, {512, 1, false}, 132));   // slots
  EXPECT_FALSE(cuda::gemv_bulk_mma_fits(17, 34816, 5120, d, 132));                 // m
  EXPECT_FALSE(cuda::gemv_bulk_mma_fits(0, 34816, 5120, d, 132));
  EXPECT_FALSE(cuda::gemv_bulk_mma_fits(16, 34816, 5100, d, 132));                 // k % 64
  EXPECT_FALSE(cuda::gemv_bulk_mma_fits(16, 34816, 32832, d, 132));                // k
  EXPECT_TRUE(cuda::gemv_bulk_mma_fits(16, 132 * 768, 64, d, 132));
  EXPECT_FALSE(cuda::gemv_bulk_mma_fits(16, 132 * 768 + 1, 64, d, 132));  // 49 groups
  EXPECT_FALSE(cuda::gemv_bulk_mma_fits(16, 34816, 5120, d, 0));
  EXPECT_LE(cuda::gemv_bulk_mma_smem_bytes({1024, 5, false}), size_t(232448));
  for (const auto& c : cuda::gemv_bulk_mma_configs(16, 34816, 5120, 132))
    EXPECT_LE(cuda::gemv_bulk_mma_smem_bytes(c), size_t(232448)) << c.name();
  EXPECT_EQ(cuda::gemv_bulk_mma_configs(16, 34816, 5120, 132).size(), 4u);
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  DevBuf<bf> x(16 * 128), w(64 * 128);
  DevBuf<char> y(16 * 64 * 4);
  auto launch = [&](int xo, int wo, int m, int n, int k, cuda::GemvBulkMmaConfig c, int sms,
                    bool acc, void* yp) {
    cuda::launch_gemv_bulk_mma(B(x, xo), B(w, wo), yp, m, n, k, GemmOut::kBF16, acc, c, sms, 0);
  };
  EXPECT_NO_THROW(launch(0, 0, 3, 64, 128, d, 132, false, y.ptr));
  EXPECT_THROW(launch(0, 0, 3, 64, 128, d, 132, true, y.ptr), Error);           // accumulate
  EXPECT_THROW(launch(1, 0, 3, 64, 128, d, 132, false, y.ptr), Error);          // x unaligned
  EXPECT_THROW(launch(0, 4, 3, 64, 128, d, 132, false, y.ptr), Error);          // w unaligned
  EXPECT_THROW(launch(0, 0, 17, 64, 128, d, 132, false, y.ptr), Error);         // m > 16
  EXPECT_THROW(launch(0, 0, 0, 64, 128, d, 132, false, y.ptr), Error);          // m 0
  EXPECT_THROW(launch(0, 0, 3, 64, 120, d, 132, false, y.ptr), Error);          // k % 64
  EXPECT_THROW(launch(0, 0, 3, 64, 128, {256, 8, false}, 132, false, y.ptr), Error);  // kc
  EXPECT_THROW(launch(0, 0, 3, 64, 128, {512, 12, false}, 132, false, y.ptr), Error);  // smem
  EXPECT_THROW(launch(0, 0, 3, 64, 128, d, 0, false, y.ptr), Error);            // n_sms
  EXPECT_THROW(launch(0, 0, 3, 64, 128, d, 132, false, nullptr), Error);        // null y
  DS_CUDA_CHECK(cudaDeviceSynchronize());
  // Through GemmEngine: with the switch on the kernel runs without a cuBLASLt plan; accumulate
  // (y +=) always goes to cuBLASLt.
  cuda::GemmEngine g;
  g.set_dispatch(&reg);
  std::mt19937 rng(89);
  auto hx = test::random_bf16(size_t(8) * 4096, rng), hw = test::random_bf16(size_t(4096) * 4096, rng);
  DevBuf<bf> dx(hx), dw(hw);
  DevBuf<char> y1(size_t(8) * 4096 * 2);
  EXPECT_EQ(g.variant(8, 4096, 4096), mma);
  g.run(B(dx), B(dw), y1.ptr, 8, 4096, 4096, GemmOut::kBF16, 0);
  EXPECT_EQ(g.late_plans(), on ? 0 : 1);
  g.run(B(dx), B(dw), y1.ptr, 8, 4096, 4096, GemmOut::kBF16, 0, true);  // +=: cuBLASLt
  EXPECT_EQ(g.late_plans(), on ? 1 : 2);
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}

// ---- split-K tensor-core GEMV (gemv_splitk_mma.cu) ----------------------------------------------
// Which shapes $DS_GEMV_SPLITK hands the registry (the test's own reading of the variable).
bool splitk_env_on(int k) {
  const char* e = std::getenv("DS_GEMV_SPLITK");
  const std::string v = e ? e : "";
  return v == "1" || (v == "down" && k == 17408) || (v == "out" && k == 6144);
}

// The 27B down projection (5120 x 17408) and out projection (5120 x 6144) at m 1, 5, 8, 13, 16:
// vs cuBLASLt (within the bf16 tolerance) and fp64 on sampled rows; three launches on one
// workspace, a PDL launch, two CUDA-graph replays and grids of 2 and 9 row groups bit-identical to
// the first (the row groups' counters come back to zero); the engine's path under the switch;
// fp32 out vs cuBLASLt.
TEST(CudaGemvSplitK, Down27bMatchesCublasLtAndFp64) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  std::mt19937 rng(91);
  std::printf("  DS_GEMV_SPLITK %s\n", std::getenv("DS_GEMV_SPLITK") ? std::getenv("DS_GEMV_SPLITK")
                                                                      : "(unset)");
  DevBuf<char> ws(cuda::gemv_splitk_workspace_bytes());
  DS_CUDA_CHECK(cudaMemset(ws.ptr, 0, cuda::gemv_splitk_workspace_bytes()));
  cudaStream_t s;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int oi : {5, 1}) {
    const Op& o = kOps27b[oi];
    ASSERT_TRUE(std::string(o.name) == "down" || std::string(o.name) == "gdn_out");
    Pool wpool(size_t(o.n) * o.k, rng, 0.02f);
    const SampledRows sampled = sample_rows(o, wpool);
    cuda::GemmEngine ref, fast;
    auto reg = cuda::DispatchRegistry::with_defaults(90, "");
    fast.set_dispatch(&reg);
    for (int m : {1, 5, 8, 13, 16}) {
      ASSERT_TRUE(cuda::gemv_splitk_supports(m, o.n, o.k)) << m;
      auto x = test::random_bf16(size_t(m) * o.k, rng);
      DevBuf<bf> dx(x);
      const size_t cnt = size_t(m) * o.n;
      DevBuf<char> y1(cnt * 2), y2(cnt * 2), y3(cnt * 2);
      y1.poison();
      // Uploads and poison run on the legacy stream, which the non-blocking stream s does not
      // wait for: synchronise before every launch on s.
      DS_CUDA_CHECK(cudaDeviceSynchronize());
      cuda::launch_gemv_splitk(B(dx), B(wpool.buf), y1.ptr, m, o.n, o.k, GemmOut::kBF16, false,
                               ws.ptr, s);
      DS_CUDA_CHECK(cudaStreamSynchronize(s));
      const auto bits = y1.download();
      // repeats, PDL, and grids of 2 and 9 row groups (8 and 36 SMs)
      const std::pair<int, bool> runs[] = {{0, false}, {0, false}, {0, true}, {8, false}, {36, true}};
      for (auto [sms, pdl] : runs) {
        y3.poison();
        DS_CUDA_CHECK(cudaDeviceSynchronize());
        cuda::launch_gemv_splitk(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, GemmOut::kBF16, false,
                                 ws.ptr, s, sms, pdl);
        DS_CUDA_CHECK(cudaStreamSynchronize(s));
        EXPECT_TRUE(y3.download() == bits)
            << o.name << " m " << m << " sms " << sms << (pdl ? " pdl" : "");
      }
      {  // from a CUDA graph (PDL launch), replayed twice
        cudaGraph_t g;
        cudaGraphExec_t ge;
        DS_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        cuda::launch_gemv_splitk(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, GemmOut::kBF16, false,
                                 ws.ptr, s, 0, true);
        DS_CUDA_CHECK(cudaStreamEndCapture(s, &g));
        DS_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
        for (int rep = 0; rep < 2; ++rep) {
          y3.poison();
          DS_CUDA_CHECK(cudaDeviceSynchronize());
          DS_CUDA_CHECK(cudaGraphLaunch(ge, s));
          DS_CUDA_CHECK(cudaStreamSynchronize(s));
          EXPECT_TRUE(y3.download() == bits) << o.name << " m " << m << " graph replay " << rep;
        }
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
      }
      if (splitk_env_on(o.k) && m >= 5) {  // the engine's path (GemmEngine::run, the registry)
        EXPECT_EQ(fast.variant(m, o.n, o.k), "gemv_splitk_mma") << o.name << " " << m;
        y3.poison();
        DS_CUDA_CHECK(cudaDeviceSynchronize());
        fast.run(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, GemmOut::kBF16, s);
        DS_CUDA_CHECK(cudaStreamSynchronize(s));
        EXPECT_TRUE(y3.download() == bits) << o.name << " m " << m << " engine path";
      }
      ref.run(B(dx), B(wpool.buf), y2.ptr, m, o.n, o.k, GemmOut::kBF16, 0);
      DS_CUDA_CHECK(cudaDeviceSynchronize());
      const auto a = download_out(y1, cnt, false), b = download_out(y2, cnt, false);
      EXPECT_EQ(count_nonfinite(a), 0u) << o.name << " m " << m << ": unwritten outputs";
      const double worst64 = expect_sampled_rows_match_fp64(x, sampled, a, o, m);
      const CublasLtDiff r = expect_bf16_close_to_cublaslt(a, b, o, m);
      std::printf("  splitk %s m=%-2d bf16 out: %zu of %zu differ from cuBLASLt (worst %.2f of "
                  "tol), fp64 worst %.2f of tol\n",
                  o.name, m, r.differ, cnt, r.worst, worst64);
    }
    const int m = 16;
    auto x = test::random_bf16(size_t(m) * o.k, rng);
    DevBuf<bf> dx(x);
    DevBuf<char> y1(size_t(m) * o.n * 4), y2(size_t(m) * o.n * 4);
    y1.poison();
    DS_CUDA_CHECK(cudaDeviceSynchronize());
    cuda::launch_gemv_splitk(B(dx), B(wpool.buf), y1.ptr, m, o.n, o.k, GemmOut::kF32, false,
                             ws.ptr, s);
    DS_CUDA_CHECK(cudaStreamSynchronize(s));
    ref.run(B(dx), B(wpool.buf), y2.ptr, m, o.n, o.k, GemmOut::kF32, 0);
    DS_CUDA_CHECK(cudaDeviceSynchronize());
    const auto a = download_out(y1, size_t(m) * o.n, true),
               b = download_out(y2, size_t(m) * o.n, true);
    EXPECT_EQ(count_nonfinite(a), 0u);
    const double e = test::norm_err(a, b);
    EXPECT_LT(e, 1e-5) << o.name;
    std::printf("  splitk %s m=16 f32 out: relative L2 vs cuBLASLt %.2e\n", o.name, e);
  }
  cudaStreamDestroy(s);
}

// Token t's outputs in an m = 16 call are bit-identical to the same x row in calls of fewer
// tokens starting at that row (bf16 and fp32 out), for both compiled k, on n 5120, 512, 264 (33
// tiles: one per row group on 132 SMs, groups of uneven size elsewhere), 8 (one tile: one group)
// and 8192 (the workspace's limit); the m = 16 and m = 7 bf16 results of the other widths also
// against cuBLASLt.
TEST(CudaGemvSplitK, BatchInvariant) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  std::mt19937 rng(97);
  DevBuf<char> ws(cuda::gemv_splitk_workspace_bytes());
  DS_CUDA_CHECK(cudaMemset(ws.ptr, 0, cuda::gemv_splitk_workspace_bytes()));
  DS_CUDA_CHECK(cudaDeviceSynchronize());
  cuda::GemmEngine ref;
  for (int k : {17408, 6144})
    for (int n : {5120, 512, 264, 8, 8192}) {
      auto x = test::random_bf16(size_t(16) * k, rng),
           w = test::random_bf16(size_t(n) * k, rng, 0.02f);
      DevBuf<bf> dx(x), dw(w);
      if (n != 5120) {
        const Op o{"down-like", n, k, false};
        for (int m : {16, 7}) {
          const size_t cnt = size_t(m) * n;
          DevBuf<char> y1(cnt * 2), y2(cnt * 2);
          y1.poison();
          cuda::launch_gemv_splitk(B(dx), B(dw), y1.ptr, m, n, k, GemmOut::kBF16, false, ws.ptr,
                                   0);
          ref.run(B(dx), B(dw), y2.ptr, m, n, k, GemmOut::kBF16, 0);
          DS_CUDA_CHECK(cudaDeviceSynchronize());
          const auto a = download_out(y1, cnt, false), b = download_out(y2, cnt, false);
          EXPECT_EQ(count_nonfinite(a), 0u)
              << "k " << k << " n " << n << " m " << m << ": unwritten outputs";
          const CublasLtDiff r = expect_bf16_close_to_cublaslt(a, b, o, m);
          std::printf("  splitk k=%-5d n=%-4d m=%-2d: %zu of %zu differ from cuBLASLt (worst %.2f "
                      "of tol)\n",
                      k, n, m, r.differ, cnt, r.worst);
        }
      }
      for (bool f32 : {false, true}) {
        const GemmOut out = f32 ? GemmOut::kF32 : GemmOut::kBF16;
        const size_t es = f32 ? 4 : 2;
        DevBuf<char> y16(size_t(16) * n * es), ys(size_t(16) * n * es);
        y16.poison();
        cuda::launch_gemv_splitk(B(dx), B(dw), y16.ptr, 16, n, k, out, false, ws.ptr, 0);
        const auto a = y16.download();
        for (auto [t0, m] : {std::pair{0, 5}, std::pair{5, 3}, std::pair{11, 5}, std::pair{15, 1},
                             std::pair{8, 8}, std::pair{2, 13}}) {
          ys.poison();
          cuda::launch_gemv_splitk(B(dx, size_t(t0) * k), B(dw), ys.ptr, m, n, k, out, false,
                                   ws.ptr, 0);
          const auto b = ys.download();
          EXPECT_EQ(std::memcmp(a.data() + size_t(t0) * n * es, b.data(), size_t(m) * n * es), 0)
              << "tokens " << t0 << ".." << t0 + m - 1 << " k " << k << " n " << n
              << (f32 ? " f32" : " bf16");
        }
      }
    }
}

// The guard (no GPU needed): the shapes it takes, the registry pick (only under $DS_GEMV_SPLITK,
// m 5..16, on the shape it names), the grid, and the launch's refusals before anything reaches
// the device.
TEST(CudaGemvSplitK, GuardAndErrors) {
  EXPECT_TRUE(cuda::gemv_splitk_supports(16, 5120, 17408));
  EXPECT_TRUE(cuda::gemv_splitk_supports(16, 5120, 6144));
  EXPECT_TRUE(cuda::gemv_splitk_supports(1, 8, 17408));
  EXPECT_TRUE(cuda::gemv_splitk_supports(16, 5000, 6144));
  EXPECT_FALSE(cuda::gemv_splitk_supports(17, 5120, 17408));  // m
  EXPECT_FALSE(cuda::gemv_splitk_supports(16, 5120, 17416));  // k: only 17408 / 6144 compiled
  EXPECT_FALSE(cuda::gemv_splitk_supports(16, 5120, 5120));
  EXPECT_FALSE(cuda::gemv_splitk_supports(16, 5004, 17408));  // n % 8
  EXPECT_FALSE(cuda::gemv_splitk_supports(16, 8448, 17408));  // n > 8192 (workspace)
  EXPECT_EQ(cuda::gemv_splitk_blocks(5120, 132), 132);          // 33 groups of 19-20 tiles
  EXPECT_EQ(cuda::gemv_splitk_blocks(5120, 114), 112);          // H100 PCIe: 28 groups
  EXPECT_EQ(cuda::gemv_splitk_blocks(16, 132), 8);              // 2 tiles: 2 groups
  EXPECT_EQ(cuda::gemv_splitk_blocks(8192, 1000), 256);         // at most 64 groups
  EXPECT_EQ(cuda::gemv_splitk_blocks(5120, 2), 4);              // at least one
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  using F = cuda::KernelFamily;
  for (int k : {17408, 6144})
    for (int m = 1; m <= 16; ++m) {
      const std::string got = reg.select(F::kGemm, reg.key(m, 5120, k)).name;
      if (m >= 5 && splitk_env_on(k))
        EXPECT_EQ(got, "gemv_splitk_mma") << m << " k " << k;
      else
        EXPECT_NE(got, "gemv_splitk_mma") << m << " k " << k;
    }
  auto* p = reinterpret_cast<const __nv_bfloat16*>(uintptr_t(4096));
  void* y = reinterpret_cast<void*>(uintptr_t(8192));
  EXPECT_THROW(cuda::launch_gemv_splitk(p, p, y, 16, 5120, 17408, GemmOut::kBF16, true, y, 0),
               Error);  // accumulate
  EXPECT_THROW(cuda::launch_gemv_splitk(p, p, y, 16, 5120, 12288, GemmOut::kBF16, false, y, 0),
               Error);  // k
  EXPECT_THROW(cuda::launch_gemv_splitk(p + 1, p, y, 16, 5120, 17408, GemmOut::kBF16, false, y, 0),
               Error);  // unaligned x
  EXPECT_THROW(cuda::launch_gemv_splitk(p, p, y, 16, 5120, 17408, GemmOut::kBF16, false, nullptr,
                                        0),
               Error);  // no workspace
}

// ---- optional sweep (DS_GEMV_SWEEP=1): every config on every decode shape,
// and cuBLASLt ----
double time_us(const std::function<void(int)>& launch, int rot, cudaStream_t s) {
  cudaEvent_t a, b;
  DS_CUDA_CHECK(cudaEventCreate(&a));
  DS_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch(i % rot);
  std::vector<float> ts;
  const int reps = std::max(8, rot);
  for (int rep = 0; rep < 7; ++rep) {
    DS_CUDA_CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < reps; ++i) launch(i % rot);
    DS_CUDA_CHECK(cudaEventRecord(b, s));
    DS_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    DS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1e3f / reps);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

TEST(CudaGemv, Sweep) {
  const char* e = std::getenv("DS_GEMV_SWEEP");
  if (!e || std::string(e) != "1") GTEST_SKIP() << "set DS_GEMV_SWEEP=1 to time every config";
  DS_REQUIRE_GPU();
  int dev = 0, n_sms = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  DS_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, dev));
  std::mt19937 rng(21);
  const size_t pool_elems = size_t(248320) * 5120;  // 2.5 GB: every shape rotates through it
  Pool wpool(pool_elems, rng, 0.02f);
  auto xs = test::random_bf16(size_t(16) * 17408, rng);
  DevBuf<bf> dx(xs);
  DevBuf<char> y(size_t(16) * 248320 * 4);
  cuda::GemmEngine ref;
  cudaStream_t st;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::printf(
      "SWEEP shape m | cublaslt us TB/s | picked cfg us TB/s | best "
      "cfg us TB/s | all\n");
  double sum_ref[3] = {0, 0, 0}, sum_pick[3] = {0, 0, 0}, sum_best[3] = {0, 0, 0},
         sum_pdl[3] = {0, 0, 0};
  const int mult[] = {48, 48, 16, 16, 64, 64, 1};
  int oi = 0;
  for (const Op& o : kOps27b) {
    const size_t welems = size_t(o.n) * o.k;
    const int rot = int(std::max<size_t>(1, std::min<size_t>(pool_elems / welems, 16)));
    const GemmOut out = o.f32 ? GemmOut::kF32 : GemmOut::kBF16;
    int mi = 0;
    for (int m : {1, 4, 16}) {
      const double bytes = 2.0 * welems + 2.0 * m * o.k + (o.f32 ? 4.0 : 2.0) * m * o.n;
      ref.prepare(m, o.n, o.k, out);
      const double t_ref = time_us(
          [&](int i) { ref.run(B(dx), B(wpool.buf, i * welems), y.ptr, m, o.n, o.k, out, st); },
          rot, st);
      const SkinnyConfig pick = cuda::skinny_gemm_config(m, o.n, o.k, n_sms);
      double t_pick = 0, t_best = 1e30;
      std::string best, all;
      for (const SkinnyConfig& c : cuda::skinny_gemm_configs()) {
        const double t = time_us(
            [&](int i) {
              cuda::launch_skinny_gemm(B(dx), B(wpool.buf, i * welems), y.ptr, m, o.n, o.k, out,
                                       false, c, st);
            },
            rot, st);
        if (c.name() == pick.name()) t_pick = t;
        if (t < t_best) t_best = t, best = c.name();
        char buf[64];
        std::snprintf(buf, sizeof buf, " %s:%.1f", c.name().c_str(), t);
        all += buf;
      }
      SkinnyConfig with_pdl = pick;
      with_pdl.pdl = true;
      const double t_pdl = time_us(
          [&](int i) {
            cuda::launch_skinny_gemm(B(dx), B(wpool.buf, i * welems), y.ptr, m, o.n, o.k, out,
                                     false, with_pdl, st);
          },
          rot, st);
      std::printf(
          "SWEEP %-8s m=%-2d | %8.2f %5.2f | %s %8.2f %5.2f (with pdl %.2f) | %s %8.2f %5.2f |%s\n",
          o.name, m, t_ref, bytes / t_ref * 1e-6, pick.name().c_str(), t_pick,
          bytes / t_pick * 1e-6, t_pdl, best.c_str(), t_best, bytes / t_best * 1e-6, all.c_str());
      sum_pdl[mi] += mult[oi] * t_pdl;
      sum_ref[mi] += mult[oi] * t_ref;
      sum_pick[mi] += mult[oi] * t_pick;
      sum_best[mi] += mult[oi] * t_best;
      ++mi;
    }
    ++oi;
  }
  for (int mi = 0; mi < 3; ++mi)
    std::printf(
        "SWEEP 27B decode step GEMMs m=%d: cublaslt %.3f ms, picked %.3f ms (with pdl %.3f), "
        "best %.3f ms\n",
        mi == 0 ? 1 : (mi == 1 ? 4 : 16), sum_ref[mi] * 1e-3, sum_pick[mi] * 1e-3,
        sum_pdl[mi] * 1e-3, sum_best[mi] * 1e-3);
  cudaStreamDestroy(st);
}


// DS_GEMV_SWEEP=1: the bulk GEMV's configs on the k <= 8192 decode shapes at m = 1, 2, 3, 4, 8
// next to cuBLASLt tuned as the engine tunes it (top 12 algorithms timed on rotating weights) and
// the skinny kernel's shipped config; rotating weights past L2; per-step sums with the 27B counts.
TEST(CudaGemvBulk, Sweep) {
  const char* e = std::getenv("DS_GEMV_SWEEP");
  if (!e || std::string(e) != "1") GTEST_SKIP() << "set DS_GEMV_SWEEP=1 to time every config";
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(27);
  const size_t pool_elems = size_t(248320) * 5120;
  Pool wpool(pool_elems, rng, 0.02f);
  auto xs = test::random_bf16(size_t(8) * 6144, rng);
  DevBuf<bf> dx(xs), xt(size_t(8) * 6144);
  DevBuf<char> y(size_t(8) * 248320 * 4);
  cudaStream_t st;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int ms[] = {1, 2, 3, 4, 8};
  double sum_lt[5] = {}, sum_sk[5] = {}, sum_pick[5] = {}, sum_best[5] = {}, sum_pdl[5] = {};
  std::printf(
      "BULK shape m | cublaslt_tuned us TB/s | skinny us | bulk picked us TB/s (pdl) | best | "
      "all\n");
  for (const Op& o : kOps27b) {
    if (o.k > 8192) continue;
    const int count = std::string(o.name) == "gate_up"     ? 64
                      : std::string(o.name) == "gdn_in"    ? 48
                      : std::string(o.name) == "gdn_out"   ? 48
                      : std::string(o.name) == "lm_head"   ? 1
                                                           : 16;
    const size_t welems = size_t(o.n) * o.k;
    const int rot = int(std::max<size_t>(1, std::min<size_t>(pool_elems / welems, 16)));
    const GemmOut out = o.f32 ? GemmOut::kF32 : GemmOut::kBF16;
    for (int mi = 0; mi < 5; ++mi) {
      const int m = ms[mi];
      const double bytes = 2.0 * welems + 2.0 * m * o.k + (o.f32 ? 4.0 : 2.0) * m * o.n;
      cuda::GemmEngine lt;
      std::vector<const __nv_bfloat16*> ws;
      for (int i = 0; i < std::min(rot, 4); ++i) ws.push_back(B(wpool.buf, i * welems));
      const auto tr = lt.tune(m, o.n, o.k, out, ws, reinterpret_cast<__nv_bfloat16*>(xt.ptr),
                              y.ptr, st);
      auto time_lt = [&](int i) {
        lt.run(B(dx), B(wpool.buf, i * welems), y.ptr, m, o.n, o.k, out, st);
      };
      const double t_lt = time_us(time_lt, rot, st);
      const SkinnyConfig sk = cuda::skinny_gemm_config(m, o.n, o.k, n_sms);
      const double t_sk = time_us(
          [&](int i) {
            cuda::launch_skinny_gemm(B(dx), B(wpool.buf, i * welems), y.ptr, m, o.n, o.k, out,
                                     false, sk, st);
          },
          rot, st);
      auto time_bulk = [&](const cuda::GemvBulkConfig& c) {
        return time_us(
            [&](int i) {
              cuda::launch_gemv_bulk(B(dx), B(wpool.buf, i * welems), y.ptr, m, o.n, o.k, out,
                                     false, c, n_sms, st);
            },
            rot, st);
      };
      const cuda::GemvBulkConfig pick = cuda::gemv_bulk_config(m, o.n, o.k);
      double t_pick = 0, t_best = 1e30;
      std::string best, all;
      for (const cuda::GemvBulkConfig& c : cuda::gemv_bulk_configs(m, o.k)) {
        const double t = time_bulk(c);
        if (c.name() == pick.name()) t_pick = t;
        if (t < t_best) t_best = t, best = c.name();
        char buf[64];
        std::snprintf(buf, sizeof buf, " %s:%.2f", c.name().c_str(), t);
        all += buf;
      }
      cuda::GemvBulkConfig pdl = pick;
      pdl.pdl = true;
      const double t_pdl = time_bulk(pdl);
      std::printf(
          "BULK %-8s m=%d | %7.2f %4.2f (%s) | %7.2f | %s %7.2f %4.2f (%.2f) | %s %7.2f %4.2f "
          "|%s\n",
          o.name, m, t_lt, bytes / t_lt * 1e-6, tr.timed ? "tuned" : "heuristic", t_sk,
          pick.name().c_str(), t_pick, bytes / t_pick * 1e-6, t_pdl, best.c_str(), t_best,
          bytes / t_best * 1e-6, all.c_str());
      if (std::string(o.name) == "gate_up" && m <= cuda::kGemvBulkSiluMaxM) {
        const int d_ff = o.n / 2;
        DevBuf<bf> actb(size_t(m) * d_ff);
        auto* act = reinterpret_cast<__nv_bfloat16*>(actb.ptr);
        const double t_silu = time_us(
            [&](int) {
              cuda::launch_silu_mul(reinterpret_cast<const __nv_bfloat16*>(y.ptr), m, d_ff, act,
                                    st);
            },
            1, st);
        const double t_fused = time_us(
            [&](int i) {
              cuda::launch_gemv_bulk_silu(B(dx), B(wpool.buf, i * welems), act, m, d_ff, o.k,
                                          cuda::gemv_bulk_silu_config(m, d_ff, o.k), n_sms, st);
            },
            rot, st);
        std::printf(
            "BULK gate_up+silu m=%d | cublaslt_tuned + silu_mul %.2f | bulk picked + silu_mul "
            "%.2f | fused %.2f us %4.2f TB/s | per step (64): %.3f / %.3f / %.3f ms\n",
            m, t_lt + t_silu, t_pick + t_silu, t_fused, bytes / t_fused * 1e-6,
            64 * (t_lt + t_silu) * 1e-3, 64 * (t_pick + t_silu) * 1e-3, 64 * t_fused * 1e-3);
      }
      std::fflush(stdout);
      sum_lt[mi] += count * t_lt;
      sum_sk[mi] += count * t_sk;
      sum_pick[mi] += count * t_pick;
      sum_best[mi] += count * t_best;
      sum_pdl[mi] += count * t_pdl;
    }
  }
  for (int mi = 0; mi < 5; ++mi)
    std::printf(
        "BULK 27B decode step, k <= 8192 GEMMs (64 gate_up, 48 gdn_in, 48 gdn_out, 16 qkv, 16 o, "
        "1 lm_head) m=%d: cublaslt_tuned %.3f ms, skinny %.3f ms, bulk picked %.3f ms (pdl "
        "%.3f), bulk best %.3f ms\n",
        ms[mi], sum_lt[mi] * 1e-3, sum_sk[mi] * 1e-3, sum_pick[mi] * 1e-3, sum_pdl[mi] * 1e-3,
        sum_best[mi] * 1e-3);
  cudaStreamDestroy(st);
}

// DS_GEMV_ILV_TIMING=1: contiguous vs interleaved stage order on the 27B m 1..2 decode shapes,
// launched alone and with PDL back to back, rotating weights past L2 (us per call).
TEST(CudaGemvBulk, InterleaveTiming) {
  const char* e = std::getenv("DS_GEMV_ILV_TIMING");
  if (!e || std::string(e) != "1") GTEST_SKIP() << "set DS_GEMV_ILV_TIMING=1 to time";
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(29);
  const size_t pool_elems = size_t(248320) * 5120;
  Pool wpool(pool_elems, rng, 0.02f);
  auto xs = test::random_bf16(size_t(8) * 17408, rng);
  DevBuf<bf> dx(xs);
  DevBuf<char> y(size_t(8) * 248320 * 4);
  cudaStream_t st;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::printf("ILV shape m variant | contiguous us (pdl) | interleaved us (pdl) | change\n");
  for (int round = 0; round < 2; ++round)
    for (const Op& op : kOps27b) {
      const size_t welems = size_t(op.n) * op.k;
      const int rot = int(std::max<size_t>(1, std::min<size_t>(pool_elems / welems, 16)));
      const GemmOut out = op.f32 ? GemmOut::kF32 : GemmOut::kBF16;
      for (int m = 1; m <= 2; ++m) {
        const bool narrow = op.k > 8192;
        const bool silu = std::string(op.name) == "gate_up";
        double t[2][2];
        std::string name;
        for (int ilv = 0; ilv < 2; ++ilv)
          for (int pdl = 0; pdl < 2; ++pdl) {
            std::function<void(int)> fn;
            if (narrow) {
              cuda::GemvNarrowConfig c = cuda::gemv_narrow_config(m, op.n, op.k, n_sms);
              c.interleave = ilv, c.pdl = pdl;
              name = "narrow " + c.name();
              fn = [&, c](int i) {
                cuda::launch_gemv_narrow(B(dx), B(wpool.buf, i * welems), y.ptr, m, op.n, op.k,
                                         out, false, c, n_sms, st);
              };
            } else if (silu) {
              cuda::GemvBulkConfig c = cuda::gemv_bulk_silu_config(m, op.n / 2, op.k);
              c.interleave = ilv, c.pdl = pdl;
              name = "bulk_silu " + c.name();
              fn = [&, c](int i) {
                cuda::launch_gemv_bulk_silu(B(dx), B(wpool.buf, i * welems),
                                            reinterpret_cast<__nv_bfloat16*>(y.ptr), m, op.n / 2,
                                            op.k, c, n_sms, st);
              };
            } else {
              cuda::GemvBulkConfig c = cuda::gemv_bulk_config(m, op.n, op.k);
              c.interleave = ilv, c.pdl = pdl;
              name = "bulk " + c.name();
              fn = [&, c](int i) {
                cuda::launch_gemv_bulk(B(dx), B(wpool.buf, i * welems), y.ptr, m, op.n, op.k,
                                       out, false, c, n_sms, st);
              };
            }
            t[ilv][pdl] = time_us(fn, rot, st);
          }
        std::printf("ILV r%d %-8s m=%d %-24s | %7.2f (%7.2f) | %7.2f (%7.2f) | %+.2f%% (%+.2f%%)\n",
                    round + 1, op.name, m, name.c_str(), t[0][0], t[0][1], t[1][0], t[1][1],
                    100.0 * (t[1][0] / t[0][0] - 1), 100.0 * (t[1][1] / t[0][1] - 1));
        std::fflush(stdout);
      }
    }
  cudaStreamDestroy(st);
}

// DS_GEMV_SWEEP=1: the narrow GEMV's configs on the narrow decode shapes (down 5120 x 17408 at m
// 1..4, gdn_out / attn_o 5120 x 6144 at m 1..4 and 8) next to cuBLASLt tuned as the engine tunes
// it, skinny_mma's shipped config and (k 6144) gemv_bulk's; each alone (back-to-back launches
// without PDL) and with PDL (back-to-back, each launch's weight copies start under the previous
// one's tail); rotating weights past L2. Per-step sums with the 27B counts (64 down, 48 gdn_out,
// 16 attn_o).
TEST(CudaGemvNarrow, Sweep) {
  const char* e = std::getenv("DS_GEMV_SWEEP");
  if (!e || std::string(e) != "1") GTEST_SKIP() << "set DS_GEMV_SWEEP=1 to time every config";
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "cp.async.bulk needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(63);
  const size_t pool_elems = size_t(12) * 5120 * 17408;  // 2.1 GB: 12 copies of down
  Pool wpool(pool_elems, rng, 0.02f);
  auto xs = test::random_bf16(size_t(8) * 17408, rng);
  DevBuf<bf> dx(xs), xt(size_t(8) * 17408);
  DevBuf<char> y(size_t(8) * 5120 * 4);
  cudaStream_t st;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::printf(
      "NARROW shape m | cublaslt_tuned us | skinny us (pdl) | bulk us (pdl) | narrow picked us "
      "TB/s (pdl us TB/s) | all configs\n");
  struct Shape {
    const char* name;
    int n, k, count;
  };
  const Shape shapes[] = {{"down", 5120, 17408, 64}, {"gdn_out/attn_o", 5120, 6144, 64}};
  double step_lt[9] = {}, step_best_old[9] = {}, step_narrow[9] = {}, step_narrow_pdl[9] = {};
  for (const Shape& o : shapes) {
    const size_t welems = size_t(o.n) * o.k;
    const int rot = int(std::min<size_t>(pool_elems / welems, 16));
    for (int m : {1, 2, 3, 4, 8}) {
      if (!cuda::gemv_narrow_supports(m, o.n, o.k, n_sms)) continue;
      const double bytes = 2.0 * welems + 2.0 * m * o.k + 2.0 * m * o.n;
      cuda::GemmEngine lt;
      std::vector<const __nv_bfloat16*> ws;
      for (int i = 0; i < std::min(rot, 4); ++i) ws.push_back(B(wpool.buf, i * welems));
      lt.tune(m, o.n, o.k, GemmOut::kBF16, ws, reinterpret_cast<__nv_bfloat16*>(xt.ptr), y.ptr, st);
      const double t_lt = time_us(
          [&](int i) {
            lt.run(B(dx), B(wpool.buf, i * welems), y.ptr, m, o.n, o.k, GemmOut::kBF16, st);
          },
          rot, st);
      auto time_sk = [&](bool pdl) {
        SkinnyConfig c = cuda::skinny_gemm_config(m, o.n, o.k, n_sms);
        c.pdl = pdl;
        return time_us(
            [&](int i) {
              cuda::launch_skinny_gemm(B(dx), B(wpool.buf, i * welems), y.ptr, m, o.n, o.k,
                                       GemmOut::kBF16, false, c, st);
            },
            rot, st);
      };
      const double t_sk = time_sk(false), t_sk_pdl = time_sk(true);
      double t_bulk = 0, t_bulk_pdl = 0;
      if (cuda::gemv_bulk_supports(m, o.n, o.k)) {
        auto time_bulk = [&](bool pdl) {
          cuda::GemvBulkConfig c = cuda::gemv_bulk_config(m, o.n, o.k);
          c.pdl = pdl;
          return time_us(
              [&](int i) {
                cuda::launch_gemv_bulk(B(dx), B(wpool.buf, i * welems), y.ptr, m, o.n, o.k,
                                       GemmOut::kBF16, false, c, n_sms, st);
              },
              rot, st);
        };
        t_bulk = time_bulk(false), t_bulk_pdl = time_bulk(true);
      }
      auto time_narrow = [&](cuda::GemvNarrowConfig c) {
        return time_us(
            [&](int i) {
              cuda::launch_gemv_narrow(B(dx), B(wpool.buf, i * welems), y.ptr, m, o.n, o.k,
                                       GemmOut::kBF16, false, c, n_sms, st);
            },
            rot, st);
      };
      const cuda::GemvNarrowConfig pick = cuda::gemv_narrow_config(m, o.n, o.k, n_sms);
      double t_pick = 0;
      std::string all;
      for (cuda::GemvNarrowConfig c : cuda::gemv_narrow_configs(m, o.n, o.k, n_sms)) {
        const double t = time_narrow(c);
        c.pdl = true;
        const double tp = time_narrow(c);
        if (c.slots == pick.slots) t_pick = t;
        char buf[64];
        std::snprintf(buf, sizeof buf, " s%d:%.2f/%.2f", c.slots, t, tp);
        all += buf;
      }
      cuda::GemvNarrowConfig pp = pick;
      pp.pdl = true;
      const double t_pick_pdl = time_narrow(pp);
      std::printf(
          "NARROW %-14s m=%d | %7.2f | %7.2f (%7.2f) | %7.2f (%7.2f) | %s %7.2f %4.2f (%7.2f "
          "%4.2f) "
          "|%s\n",
          o.name, m, t_lt, t_sk, t_sk_pdl, t_bulk, t_bulk_pdl, pick.name().c_str(), t_pick,
          bytes / t_pick * 1e-6, t_pick_pdl, bytes / t_pick_pdl * 1e-6, all.c_str());
      std::fflush(stdout);
      // per step: down x 64; gdn_out x 48 + attn_o x 16 (same shape)
      const int cnt = o.count;
      step_lt[m] += cnt * t_lt;
      const double old = o.k == 17408 ? t_sk : (m == 1 ? t_bulk_pdl : t_lt);
      step_best_old[m] += cnt * old;
      step_narrow[m] += cnt * t_pick;
      step_narrow_pdl[m] += cnt * t_pick_pdl;
    }
  }
  for (int m : {1, 2, 3, 4})
    std::printf(
        "NARROW 27B step, down + gdn_out + attn_o (64 + 48 + 16) m=%d: cublaslt_tuned %.3f ms, "
        "shipped before (skinny_mma / gemv_bulk_pdl at m 1 / cublaslt) %.3f ms, narrow %.3f ms, "
        "narrow with pdl %.3f ms\n",
        m, step_lt[m] * 1e-3, step_best_old[m] * 1e-3, step_narrow[m] * 1e-3,
        step_narrow_pdl[m] * 1e-3);
  cudaStreamDestroy(st);
}

// The TMA kernels' 27B checks: y (the kernel, bf16 [m, o.n]) has every output written, matches
// fp64 on the sampled rows and cuBLASLt's yref on every output; one line printed per shape.
void expect_outputs_match(const std::vector<bf>& x, const SampledRows& sampled, DevBuf<char>& y,
                          DevBuf<char>& yref, const Op& o, int m, const char* label) {
  DS_CUDA_CHECK(cudaDeviceSynchronize());
  const size_t cnt = size_t(m) * o.n;
  const auto a = download_out(y, cnt, false), b = download_out(yref, cnt, false);
  EXPECT_EQ(count_nonfinite(a), 0u) << o.name << " m " << m << ": unwritten outputs";
  const double worst64 = expect_sampled_rows_match_fp64(x, sampled, a, o, m);
  const CublasLtDiff r = expect_bf16_close_to_cublaslt(a, b, o, m);
  std::printf(
      "  %s %-8s m=%-2d bf16 out: %zu of %zu differ from cuBLASLt (worst %.2f of tol), fp64 worst "
      "%.2f of tol\n",
      label, o.name, m, r.differ, cnt, r.worst, worst64);
}

// ---- The TMA tensor-core GEMV (gemv_tma.cu, variants gemm.gemv_tma / gemm.gemv_tma_silu, on at
// m 5..16 unless DS_GEMV_TMA is 0 / silu; launched directly here, so these run either way).

// Odd shapes (m 1..16, n from 1 to 192 box rows per block, k with a partial last 64-chunk, grids
// of 1, 7 and all SMs), every config, bf16 and fp32 out, vs fp64 on every element (poisoned
// outputs); every config bit-identical.
TEST(CudaGemvTma, OddShapesEveryConfig) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "TMA needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(171);
  struct Case {
    int n, k, sms;
  };
  const Case cases[] = {{1, 64, n_sms},      {37, 128, n_sms},  {203, 584, n_sms},
                        {1000, 4096, n_sms},  {133, 4104, n_sms}, {2111, 8192, n_sms},
                        {n_sms * 384, 136, n_sms}, {300, 576, 1},    {2000, 1096, 7},
                        {300, 8, 3},
                        {777, 4232, n_sms}};  // 4232: kbox 4's last stage holds 3 chunks
  int launched = 0;
  for (const Case& cs : cases) {
    auto x = test::random_bf16(size_t(16) * cs.k, rng),
         w = test::random_bf16(size_t(cs.n) * cs.k, rng, 0.05f);
    DevBuf<bf> dx(x), dw(w);
    std::vector<double> ref, mag;
    reference64(x, w, 16, cs.n, cs.k, ref, mag);
    for (int m : {1, 3, 8, 13, 16}) {
      const std::vector<double> rm(ref.begin(), ref.begin() + size_t(m) * cs.n),
          mm(mag.begin(), mag.begin() + size_t(m) * cs.n);
      for (bool f32 : {false, true}) {
        const GemmOut out = f32 ? GemmOut::kF32 : GemmOut::kBF16;
        DevBuf<char> y(size_t(m) * cs.n * (f32 ? 4 : 2));
        std::vector<char> first;
        const auto cfgs = cuda::gemv_tma_configs(m, cs.n, cs.k, false, cs.sms);
        ASSERT_FALSE(cfgs.empty()) << "n " << cs.n << " k " << cs.k << " sms " << cs.sms;
        for (cuda::GemvTmaConfig c : cfgs)
          for (bool pdl : {false, true}) {
            c.pdl = pdl;
            y.poison();
            cuda::launch_gemv_tma(B(dx), B(dw), y.ptr, m, cs.n, cs.k, out, c, cs.sms, 0);
            DS_CUDA_CHECK(cudaDeviceSynchronize());
            ++launched;
            const auto raw = y.download();
            const auto got = download_out(y, size_t(m) * cs.n, f32);
            EXPECT_EQ(count_nonfinite(got), 0u)
                << "unwritten outputs: m " << m << " n " << cs.n << " k " << cs.k << " " << c.name();
            EXPECT_EQ(count_bad_vs_fp64(got, rm, mm, f32), 0u)
                << "m " << m << " n " << cs.n << " k " << cs.k << " sms " << cs.sms << " "
                << c.name() << (f32 ? " f32" : " bf16");
            if (first.empty())
              first = raw;
            else
              EXPECT_TRUE(raw == first) << "config " << c.name() << " m " << m << " n " << cs.n;
          }
      }
    }
  }
  EXPECT_GT(launched, 300);
  EXPECT_TRUE(cuda::gemv_tma_supports(16, n_sms * 384, 64, false, n_sms));
  EXPECT_FALSE(cuda::gemv_tma_supports(16, n_sms * 384 + 1, 64, false, n_sms));  // 193 box rows
}

// Wider stages (GemvTmaConfig::kbox 2 / 4: 128 / 256 k per stage; session 27) on the 27B
// in-projections at m 5 and 16, plain and with the fused SiLU, with and without PDL: bit-identical
// to kbox 1 (the same k-steps in the same order), every output written (NaN poison). The odd
// shapes with every kbox are in OddShapesEveryConfig (gemv_tma_configs lists them).
TEST(CudaGemvTma, WiderStagesBitIdentical27b) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "TMA needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(177);
  Pool wpool(size_t(34816) * 5120, rng, 0.02f);
  DevBuf<bf> dx(test::random_bf16(size_t(16) * 5120, rng));
  int compared = 0;
  for (auto [name, n, glu] :
       {std::tuple{"gdn_in", 16480, false}, std::tuple{"attn_qkv", 14336, false},
        std::tuple{"gate_up", 34816, false}, std::tuple{"gate_up+silu", 17408, true}}) {
    for (int m : {5, 16}) {
      const size_t cnt = size_t(m) * n;
      DevBuf<bf> y1(cnt), y2(cnt);
      auto launch = [&](const cuda::GemvTmaConfig& c, DevBuf<bf>& y) {
        y.poison();
        if (glu)
          cuda::launch_gemv_tma_silu(B(dx), B(wpool.buf), reinterpret_cast<__nv_bfloat16*>(y.ptr),
                                     m, n, 5120, c, n_sms, 0);
        else
          cuda::launch_gemv_tma(B(dx), B(wpool.buf), y.ptr, m, n, 5120, GemmOut::kBF16, c, n_sms,
                                0);
        DS_CUDA_CHECK(cudaDeviceSynchronize());
      };
      launch({0, false, 1}, y1);
      const auto ref = y1.download();
      size_t nan = 0;
      for (bf v : ref) nan += (v & 0x7f80) == 0x7f80 && (v & 0x7f);
      EXPECT_EQ(nan, 0u) << name << " m " << m << ": kbox 1 left outputs unwritten";
      for (int kb : {2, 4})
        for (bool pdl : {false, true}) {
          const cuda::GemvTmaConfig c{0, pdl, kb};
          if (!cuda::gemv_tma_fits(m, n, 5120, glu, c, n_sms)) {
            // gate_up's 132-row boxes: one 144 KiB stage fits at kbox 4 (2 needed)
            EXPECT_TRUE(kb == 4 && std::string(name).rfind("gate_up", 0) == 0)
                << name << " m " << m << " " << c.name() << " should fit";
            continue;
          }
          launch(c, y2);
          EXPECT_TRUE(y2.download() == ref) << name << " m " << m << " " << c.name();
          ++compared;
        }
    }
  }
  EXPECT_EQ(compared, 24);  // kbox 4 fits gdn_in and attn_qkv only
  // The SiLU kernel on an odd shape: d_ff 1000 (8 features per block), k 4232 (kbox 4's last
  // stage has 3 chunks, the last one partial; kbox 2's last stage 1 chunk).
  {
    const int d_ff = 1000, k = 4232, m = 13;
    DevBuf<bf> w(test::random_bf16(size_t(2) * d_ff * k, rng, 0.05f));
    DevBuf<bf> x(test::random_bf16(size_t(m) * k, rng));
    DevBuf<bf> a1(size_t(m) * d_ff), a2(size_t(m) * d_ff);
    a1.poison();
    cuda::launch_gemv_tma_silu(B(x), B(w), reinterpret_cast<__nv_bfloat16*>(a1.ptr), m, d_ff, k,
                               {0, false, 1}, n_sms, 0);
    const auto ref = a1.download();
    for (int kb : {2, 4}) {
      const cuda::GemvTmaConfig c{0, true, kb};
      ASSERT_TRUE(cuda::gemv_tma_fits(m, d_ff, k, true, c, n_sms)) << c.name();
      a2.poison();
      cuda::launch_gemv_tma_silu(B(x), B(w), reinterpret_cast<__nv_bfloat16*>(a2.ptr), m, d_ff, k,
                                 c, n_sms, 0);
      EXPECT_TRUE(a2.download() == ref) << "silu d_ff 1000 k 4232 " << c.name();
    }
  }
}

// The L2 prefetch ahead (GemvTmaConfig::l2_ahead, session 34): after the wait the producer queues
// the next stages' weight boxes for L2. On the 27B in-projections and gate_up + SiLU at m 5 and
// 16, plain and PDL, and an odd SiLU shape, every count (1, 3, past the last stage) gives kbox 1's
// bits with every output written; kbox 2, fp32 out and a negative count are refused; the KiB to
// stages rounding.
TEST(CudaGemvTma, L2AheadBitIdentical) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "TMA needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(191);
  Pool wpool(size_t(34816) * 5120, rng, 0.02f);
  DevBuf<bf> dx(test::random_bf16(size_t(16) * 5120, rng));
  auto launch = [&](const __nv_bfloat16* w, int m, int n, int k, bool glu,
                    const cuda::GemvTmaConfig& c, DevBuf<bf>& y, const DevBuf<bf>& x) {
    y.poison();
    if (glu)
      cuda::launch_gemv_tma_silu(B(x), w, reinterpret_cast<__nv_bfloat16*>(y.ptr), m, n, k, c,
                                 n_sms, 0);
    else
      cuda::launch_gemv_tma(B(x), w, y.ptr, m, n, k, GemmOut::kBF16, c, n_sms, 0);
    DS_CUDA_CHECK(cudaDeviceSynchronize());
  };
  int compared = 0;
  for (auto [name, n, glu] :
       {std::tuple{"gdn_in", 16480, false}, std::tuple{"attn_qkv", 14336, false},
        std::tuple{"gate_up+silu", 17408, true}}) {
    for (int m : {5, 16}) {
      const size_t cnt = size_t(m) * n;
      DevBuf<bf> y1(cnt), y2(cnt);
      launch(B(wpool.buf), m, n, 5120, glu, {0, true, 1}, y1, dx);
      const auto ref = y1.download();
      size_t nan = 0;
      for (bf v : ref) nan += (v & 0x7f80) == 0x7f80 && (v & 0x7f);
      EXPECT_EQ(nan, 0u) << name << " m " << m << ": outputs unwritten";
      for (int ahead : {1, 3, 1000})
        for (bool pdl : {false, true}) {
          cuda::GemvTmaConfig c{0, pdl, 1};
          c.l2_ahead = ahead;
          launch(B(wpool.buf), m, n, 5120, glu, c, y2, dx);
          EXPECT_TRUE(y2.download() == ref) << name << " m " << m << " " << c.name();
          ++compared;
        }
    }
  }
  EXPECT_EQ(compared, 36);
  {  // odd: d_ff 1000 (8 features per block), k 4232 (a partial last stage), m 13
    const int d_ff = 1000, k = 4232, m = 13;
    DevBuf<bf> w(test::random_bf16(size_t(2) * d_ff * k, rng, 0.05f));
    DevBuf<bf> x(test::random_bf16(size_t(m) * k, rng));
    DevBuf<bf> a1(size_t(m) * d_ff), a2(size_t(m) * d_ff);
    launch(B(w), m, d_ff, k, true, {0, false, 1}, a1, x);
    cuda::GemvTmaConfig c{0, true, 1};
    c.l2_ahead = 5;
    launch(B(w), m, d_ff, k, true, c, a2, x);
    EXPECT_TRUE(a2.download() == a1.download()) << "silu d_ff 1000 k 4232 " << c.name();
  }
  // Refused: what the prefetch is not compiled for.
  DevBuf<bf> y(size_t(16) * 16480);
  DevBuf<float> yf(size_t(16) * 16480);
  cuda::GemvTmaConfig kb2{0, false, 2};
  kb2.l2_ahead = 2;
  EXPECT_THROW(cuda::launch_gemv_tma(B(dx), B(wpool.buf), y.ptr, 16, 16480, 5120, GemmOut::kBF16,
                                     kb2, n_sms, 0),
               Error);
  cuda::GemvTmaConfig a2{0, false, 1};
  a2.l2_ahead = 2;
  EXPECT_THROW(cuda::launch_gemv_tma(B(dx), B(wpool.buf), yf.ptr, 16, 16480, 5120, GemmOut::kF32,
                                     a2, n_sms, 0),
               Error);
  a2.l2_ahead = -1;
  EXPECT_THROW(cuda::launch_gemv_tma(B(dx), B(wpool.buf), y.ptr, 16, 16480, 5120, GemmOut::kBF16,
                                     a2, n_sms, 0),
               Error);
  EXPECT_THROW(cuda::launch_gemv_tma_silu(B(dx), B(wpool.buf),
                                          reinterpret_cast<__nv_bfloat16*>(y.ptr), 16, 8192, 5120,
                                          kb2, n_sms, 0),
               Error);
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(CudaGemvTma, L2AheadBudget) {
  // gate_up + silu on 132 SMs: 132 features a block, two 132 x 128-byte boxes = 33 KiB a stage.
  const cuda::GemvTmaConfig c{0, true, 1};
  EXPECT_EQ(cuda::gemv_tma_ahead_stages(0, 17408, true, c, 132), 0);
  EXPECT_EQ(cuda::gemv_tma_ahead_stages(80, 17408, true, c, 132), 3);  // 80 / 33 rounded up
  EXPECT_EQ(cuda::gemv_tma_ahead_stages(1, 17408, true, c, 132), 1);
  // gdn_in: 125 rows a block, boxes of 63 (-> 64) rows: 16 KiB a stage.
  EXPECT_EQ(cuda::gemv_tma_ahead_stages(80, 16480, false, c, 132), 5);
  EXPECT_EQ(cuda::gemv_tma_ahead_stages(80, 16480, false, {0, true, 2}, 132), 0);  // kbox 2
}

// The 27B in-projections at m 5, 8, 13, 16 vs cuBLASLt (1 bf16 ulp) and fp64 on sampled rows;
// the fused gate_up + SiLU bit-identical to the plain kernel + launch_silu_mul and close to fp64;
// batch invariance (token t of an m 16 call = the same row in calls of m 1 / 3 / 8); the engine
// path (registry) bit-identical where DS_GEMV_TMA selects it.
TEST(CudaGemvTma, Shapes27bMatchCublasLtSiluAndBatch) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "TMA needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(173);
  Pool wpool(size_t(34816) * 5120, rng, 0.02f);
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  cuda::GemmEngine fast, ref;
  fast.set_dispatch(&reg);
  const cuda::GemvTmaMode mode = cuda::gemv_tma_mode();
  std::printf("  DS_GEMV_TMA %s\n", mode == cuda::GemvTmaMode::kOff    ? "off"
                                    : mode == cuda::GemvTmaMode::kAll ? "1"
                                                                      : "silu");
  for (const Op& o : kOps27b) {
    if (o.k > 8192 || o.f32 || o.n < 8192) continue;  // gdn_in, attn_qkv, gate_up (plain)
    const SampledRows sampled = sample_rows(o, wpool);
    for (int m : {5, 8, 13, 16}) {
      ASSERT_TRUE(cuda::gemv_tma_supports(m, o.n, o.k, false, n_sms)) << o.name << " m " << m;
      auto x = test::random_bf16(size_t(16) * o.k, rng);
      DevBuf<bf> dx(x);
      const size_t cnt = size_t(m) * o.n;
      DevBuf<char> y1(cnt * 2), y2(cnt * 2), y3(cnt * 2);
      y1.poison();
      cuda::launch_gemv_tma(B(dx), B(wpool.buf), y1.ptr, m, o.n, o.k, GemmOut::kBF16,
                            cuda::gemv_tma_config(m, o.n, o.k, false), n_sms, 0);
      ref.run(B(dx), B(wpool.buf), y2.ptr, m, o.n, o.k, GemmOut::kBF16, 0);
      const auto bits = y1.download();
      if (fast.variant(m, o.n, o.k) == "gemv_tma") {
        y3.poison();
        fast.run(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, GemmOut::kBF16, 0);
        EXPECT_TRUE(y3.download() == bits) << o.name << " m " << m << " engine path";
      }
      for (auto [t0, mm] : {std::pair{0, 1}, std::pair{m - 1, 1}, std::pair{2, 3}}) {
        if (t0 + mm > m) continue;
        y3.poison();
        cuda::launch_gemv_tma(B(dx, size_t(t0) * o.k), B(wpool.buf), y3.ptr, mm, o.n, o.k,
                              GemmOut::kBF16, cuda::gemv_tma_config(mm, o.n, o.k, false), n_sms,
                              0);
        const auto b = y3.download();
        EXPECT_EQ(std::memcmp(bits.data() + size_t(t0) * o.n * 2, b.data(), size_t(mm) * o.n * 2),
                  0)
            << o.name << " tokens " << t0 << ".." << t0 + mm - 1 << " of m " << m;
      }
      expect_outputs_match(x, sampled, y1, y2, o, m, "tma");
      if (o.n == 34816) {  // gate_up: the fused SiLU kernel
        const int d_ff = o.n / 2;
        DevBuf<bf> a1(size_t(m) * d_ff), a2(size_t(m) * d_ff);
        a1.poison();
        a2.poison();
        auto* p1 = reinterpret_cast<__nv_bfloat16*>(a1.ptr);
        cuda::launch_gemv_tma_silu(B(dx), B(wpool.buf), p1, m, d_ff, o.k,
                                   cuda::gemv_tma_config(m, d_ff, o.k, true), n_sms, 0);
        cuda::launch_silu_mul(reinterpret_cast<const __nv_bfloat16*>(y1.ptr), m, d_ff,
                              reinterpret_cast<__nv_bfloat16*>(a2.ptr), 0);
        DS_CUDA_CHECK(cudaDeviceSynchronize());
        const auto s1 = a1.download();
        EXPECT_TRUE(s1 == a2.download()) << "silu fused vs plain + silu_mul, m " << m;
        // through the engine: fused where DS_GEMV_TMA selects it, else nothing launched
        a2.poison();
        const bool fused = fast.run_gate_up_silu(B(dx), B(wpool.buf),
                                                 reinterpret_cast<__nv_bfloat16*>(a2.ptr), m,
                                                 d_ff, o.k, 0);
        EXPECT_EQ(fused, mode != cuda::GemvTmaMode::kOff) << "m " << m;
        if (fused) {
          EXPECT_TRUE(a2.download() == s1) << "engine silu path, m " << m;
        }
        // fp64 on the first 64 features of each token
        std::vector<float> got, want;
        const auto sf = test::to_f32(s1);
        auto rows = [&](size_t r0) {
          std::vector<bf> h(size_t(64) * o.k);
          DS_CUDA_CHECK(cudaMemcpy(h.data(), wpool.buf.ptr + r0 * o.k, h.size() * 2,
                                   cudaMemcpyDeviceToHost));
          return h;
        };
        const std::vector<bf> wh = rows(0), wu = rows(size_t(d_ff));
        for (int t = 0; t < m; ++t)
          for (int j = 0; j < 64; ++j) {
            double g = 0, u = 0;
            for (int c = 0; c < o.k; ++c) {
              const double xv = bf16_to_f32(x[size_t(t) * o.k + c]);
              g += xv * bf16_to_f32(wh[size_t(j) * o.k + c]);
              u += xv * bf16_to_f32(wu[size_t(j) * o.k + c]);
            }
            want.push_back(float(g / (1.0 + std::exp(-g)) * u));
            got.push_back(sf[size_t(t) * d_ff + j]);
          }
        EXPECT_LT(test::norm_err(got, want), 8e-3) << "silu vs fp64, m " << m;
      }
    }
  }
}

// PDL: gdn_in-like -> attn_qkv-like chain at m 16 (the second reads the first's output after its
// wait), on a stream and from a graph, bit-identical to plain launches; and the SiLU kernel.
TEST(CudaGemvTma, DependentLaunchesChain) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "TMA needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(179);
  const int m = 16, n1 = 8192, k1 = 5120, n2 = 14336;
  auto x = test::random_bf16(size_t(m) * k1, rng),
       w1 = test::random_bf16(size_t(n1) * k1, rng, 0.02f),
       w2 = test::random_bf16(size_t(n2) * n1, rng, 0.02f);
  DevBuf<bf> dx(x), dw1(w1), dw2(w2), y1(size_t(m) * n1), y2(size_t(m) * n2);
  cudaStream_t s;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto chain = [&](bool pdl) {
    cuda::GemvTmaConfig c1 = cuda::gemv_tma_config(m, n1, k1, false),
                        c2 = cuda::gemv_tma_config(m, n2, n1, false);
    c1.pdl = c2.pdl = pdl;
    cuda::launch_gemv_tma(B(dx), B(dw1), y1.ptr, m, n1, k1, GemmOut::kBF16, c1, n_sms, s);
    cuda::launch_gemv_tma(B(y1), B(dw2), y2.ptr, m, n2, n1, GemmOut::kBF16, c2, n_sms, s);
  };
  expect_pdl_chain_matches_serial(chain, y1, y2, w2, m, n1, n2, s);
  cudaStreamDestroy(s);
}

TEST(CudaGemvTma, GuardAndErrors) {
  const cuda::GemvTmaMode mode = cuda::gemv_tma_mode();
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  using F = cuda::KernelFamily;
  auto pick = [&](const cuda::DispatchRegistry& r, int m, int n, int k, int glu = 0) {
    return r.select(F::kGemm, r.key(m, n, k, glu)).name;
  };
  const bool all = mode == cuda::GemvTmaMode::kAll, on = mode != cuda::GemvTmaMode::kOff;
  for (int m = 5; m <= 16; ++m) {
    if (all) {
      EXPECT_EQ(pick(reg, m, 16480, 5120), "gemv_tma") << m;
      EXPECT_EQ(pick(reg, m, 14336, 5120), "gemv_tma") << m;
    }
    if (!on) {
      EXPECT_NE(pick(reg, m, 16480, 5120), "gemv_tma") << m;
    }
    EXPECT_EQ(pick(reg, m, 34816, 5120, 1) == "gemv_tma_silu", on) << m;
    EXPECT_NE(pick(reg, m, 5120, 6144), "gemv_tma") << m;   // n < 8192
    EXPECT_NE(pick(reg, m, 5120, 17408), "gemv_tma") << m;  // k > 8192
  }
  EXPECT_EQ(pick(reg, 4, 34816, 5120, 1), "gemv_bulk_silu");  // m 1..4 unchanged
  EXPECT_EQ(pick(reg, 1, 34816, 5120), "gemv_bulk");
  EXPECT_NE(pick(reg, 17, 16480, 5120), "gemv_tma");
  EXPECT_NE(pick(reg, 8, 248320, 5120), "gemv_tma");  // lm_head: > 192 box rows per block
  auto r80 = cuda::DispatchRegistry::with_defaults(80, "");
  EXPECT_NE(pick(r80, 8, 34816, 5120, 1), "gemv_tma_silu");
  // fits
  EXPECT_TRUE(cuda::gemv_tma_supports(16, 17408, 5120, true, 132));
  EXPECT_TRUE(cuda::gemv_tma_supports(16, 16480, 5120, false, 132));
  EXPECT_EQ(cuda::gemv_tma_max_slots(132), 6);   // gate_up: 6 x 36 KiB
  EXPECT_EQ(cuda::gemv_tma_max_slots(63), 12);   // gdn_in
  EXPECT_EQ(cuda::gemv_tma_max_slots(55), 14);   // attn_qkv
  EXPECT_EQ(cuda::gemv_tma_max_slots(0), 0);
  // Wider stages (kbox 64-k chunks per stage): 2 x (2 boxes + x) per stage at kbox 2, and so on.
  EXPECT_EQ(cuda::gemv_tma_max_slots(63, 2), 6);   // gdn_in: 6 x 36 KiB
  EXPECT_EQ(cuda::gemv_tma_max_slots(63, 4), 3);   // 3 x 72 KiB
  EXPECT_EQ(cuda::gemv_tma_max_slots(55, 2), 7);   // attn_qkv
  EXPECT_EQ(cuda::gemv_tma_max_slots(132, 2), 3);  // gate_up: 3 x 72 KiB
  EXPECT_EQ(cuda::gemv_tma_max_slots(132, 4), 1);  // one stage: does not fit (2+ needed)
  EXPECT_EQ(cuda::gemv_tma_max_slots(63, 3), 0);   // kbox 1, 2 or 4
  EXPECT_TRUE(cuda::gemv_tma_fits(16, 16480, 5120, false, {0, false, 4}, 132));
  EXPECT_FALSE(cuda::gemv_tma_fits(16, 17408, 5120, true, {0, false, 4}, 132));
  EXPECT_FALSE(cuda::gemv_tma_fits(16, 16480, 5120, false, {0, false, 3}, 132));
  EXPECT_EQ(cuda::GemvTmaConfig({0, true, 2}).name(), "smax-kb2-pdl");
  // gemv_tma_config asks for $DS_GEMV_TMA_KBOX, halved until two stages fit
  EXPECT_EQ(cuda::gemv_tma_config(16, 17408, 5120, true).kbox,
            std::min(cuda::gemv_tma_kbox_mode(), 2));
  EXPECT_EQ(cuda::gemv_tma_config(16, 16480, 5120, false).kbox, cuda::gemv_tma_kbox_mode());
  EXPECT_FALSE(cuda::gemv_tma_supports(17, 16480, 5120, false, 132));
  EXPECT_FALSE(cuda::gemv_tma_supports(0, 16480, 5120, false, 132));
  EXPECT_FALSE(cuda::gemv_tma_supports(16, 16480, 5124, false, 132));  // k % 8
  EXPECT_FALSE(cuda::gemv_tma_supports(16, 16480, 32776, false, 132));
  EXPECT_FALSE(cuda::gemv_tma_supports(16, 132 * 193, 5120, true, 132));  // 193 features
  EXPECT_FALSE(cuda::gemv_tma_fits(16, 17408, 5120, true, {7, false}, 132));  // smem
  EXPECT_FALSE(cuda::gemv_tma_fits(16, 17408, 5120, true, {1, false}, 132));  // slots
  EXPECT_FALSE(cuda::gemv_tma_supports(16, 17408, 5120, true, 0));
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "TMA needs sm 90";
  DevBuf<bf> x(16 * 128), w(128 * 128);
  DevBuf<char> y(16 * 128 * 4);
  const cuda::GemvTmaConfig d;
  auto launch = [&](int xo, int wo, int m, int n, int k, cuda::GemvTmaConfig c, int sms,
                    void* yp) {
    cuda::launch_gemv_tma(B(x, xo), B(w, wo), yp, m, n, k, GemmOut::kBF16, c, sms, 0);
  };
  EXPECT_NO_THROW(launch(0, 0, 3, 64, 128, d, 132, y.ptr));
  EXPECT_THROW(launch(1, 0, 3, 64, 128, d, 132, y.ptr), Error);   // x unaligned
  EXPECT_THROW(launch(0, 4, 3, 64, 128, d, 132, y.ptr), Error);   // w unaligned
  EXPECT_THROW(launch(0, 0, 17, 64, 128, d, 132, y.ptr), Error);  // m > 16
  EXPECT_THROW(launch(0, 0, 3, 64, 124, d, 132, y.ptr), Error);   // k % 8
  EXPECT_THROW(launch(0, 0, 3, 64, 128, {17, false}, 132, y.ptr), Error);  // slots
  EXPECT_THROW(launch(0, 0, 3, 64, 128, d, 0, y.ptr), Error);     // n_sms
  EXPECT_THROW(launch(0, 0, 3, 64, 128, d, 132, nullptr), Error); // null y
  EXPECT_THROW(cuda::launch_gemv_tma_silu(B(x), B(w), reinterpret_cast<__nv_bfloat16*>(y.ptr), 3,
                                          64, 128, d, 0, 0),
               Error);
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}

// ---- The TMA tensor-core GEMV for narrow outputs (gemv_tma.cu, variant gemm.gemv_tma_narrow:
// the down projection at m 3..16 by default, DS_GEMV_TMA_NARROW=0 / down / out / 1; launched
// directly here, so these run in every mode).

// Odd shapes (m 1..16, n with a partial last 8-row group, 1..8 groups per block, grids of 1, 7
// and all SMs, k with a partial last 64-chunk and a last stage of fewer boxes), every config, bf16
// and fp32 out, vs fp64 on every element (poisoned outputs); configs of one kbox bit-identical.
TEST(CudaGemvTmaNarrow, OddShapesEveryConfig) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "TMA needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(181);
  struct Case {
    int n, k, sms;
  };
  const Case cases[] = {{1, 64, n_sms},          {37, 200, n_sms},   {203, 584, n_sms},
                        {1000, 4096, n_sms},      {133, 4104, n_sms},  {5120, 1096, n_sms},
                        {n_sms * 64, 520, n_sms}, {n_sms * 20 + 4, 1096, n_sms},
                        {60, 576, 1},             {400, 1096, 7},      {150, 8, 3},
                        {64, 2056, 1}};
  int launched = 0;
  for (const Case& cs : cases) {
    auto x = test::random_bf16(size_t(16) * cs.k, rng),
         w = test::random_bf16(size_t(cs.n) * cs.k, rng, 0.05f);
    DevBuf<bf> dx(x), dw(w);
    std::vector<double> ref, mag;
    reference64(x, w, 16, cs.n, cs.k, ref, mag);
    for (int m : {1, 2, 5, 13, 16}) {
      const std::vector<double> rm(ref.begin(), ref.begin() + size_t(m) * cs.n),
          mm(mag.begin(), mag.begin() + size_t(m) * cs.n);
      for (bool f32 : {false, true}) {
        const GemmOut out = f32 ? GemmOut::kF32 : GemmOut::kBF16;
        DevBuf<char> y(size_t(m) * cs.n * (f32 ? 4 : 2));
        std::map<int, std::vector<char>> first;  // per kbox
        const auto cfgs = cuda::gemv_tma_narrow_configs(m, cs.n, cs.k, cs.sms);
        ASSERT_FALSE(cfgs.empty()) << "n " << cs.n << " k " << cs.k << " sms " << cs.sms;
        for (cuda::GemvTmaNarrowConfig c : cfgs)
          for (bool pdl : {false, true}) {
            c.pdl = pdl;
            y.poison();
            cuda::launch_gemv_tma_narrow(B(dx), B(dw), y.ptr, m, cs.n, cs.k, out, c, cs.sms, 0);
            DS_CUDA_CHECK(cudaDeviceSynchronize());
            ++launched;
            const auto raw = y.download();
            const auto got = download_out(y, size_t(m) * cs.n, f32);
            EXPECT_EQ(count_nonfinite(got), 0u)
                << "unwritten outputs: m " << m << " n " << cs.n << " k " << cs.k << " " << c.name();
            EXPECT_EQ(count_bad_vs_fp64(got, rm, mm, f32), 0u)
                << "m " << m << " n " << cs.n << " k " << cs.k << " sms " << cs.sms << " "
                << c.name() << (f32 ? " f32" : " bf16");
            auto& f = first[c.kbox];
            if (f.empty())
              f = raw;
            else
              EXPECT_TRUE(raw == f) << "config " << c.name() << " m " << m << " n " << cs.n;
          }
      }
    }
  }
  EXPECT_GT(launched, 400);
  EXPECT_TRUE(cuda::gemv_tma_narrow_supports(16, n_sms * 64, 64, n_sms));
  EXPECT_FALSE(cuda::gemv_tma_narrow_supports(16, n_sms * 64 + 1, 64, n_sms));  // 9 groups
}

// The 27B narrow shapes (gdn_out / attn_o 5120 x 6144, down 5120 x 17408) at m 1, 2, 4, 5, 8, 13,
// 16 vs cuBLASLt (1 bf16 ulp) and fp64 on sampled rows; batch invariance (token t of an m 16 call
// = the same row in calls of m 1 / 3); grid invariance; the engine path (registry) bit-identical
// where DS_GEMV_TMA_NARROW selects it.
TEST(CudaGemvTmaNarrow, Shapes27bMatchCublasLtAndBatch) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "TMA needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(191);
  Pool wpool(size_t(5120) * 17408, rng, 0.02f);
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  cuda::GemmEngine fast, ref;
  fast.set_dispatch(&reg);
  for (const Op& o : kOps27b) {
    if (o.n != 5120) continue;
    const SampledRows sampled = sample_rows(o, wpool);
    for (int m : {1, 2, 4, 5, 8, 13, 16}) {
      ASSERT_TRUE(cuda::gemv_tma_narrow_supports(m, o.n, o.k, n_sms)) << o.name << " m " << m;
      auto x = test::random_bf16(size_t(16) * o.k, rng);
      DevBuf<bf> dx(x);
      const size_t cnt = size_t(m) * o.n;
      DevBuf<char> y1(cnt * 2), y2(cnt * 2), y3(cnt * 2);
      y1.poison();
      const cuda::GemvTmaNarrowConfig c0 = cuda::gemv_tma_narrow_config(m, o.n, o.k);
      cuda::launch_gemv_tma_narrow(B(dx), B(wpool.buf), y1.ptr, m, o.n, o.k, GemmOut::kBF16, c0,
                                   n_sms, 0);
      ref.run(B(dx), B(wpool.buf), y2.ptr, m, o.n, o.k, GemmOut::kBF16, 0);
      const auto bits = y1.download();
      const bool guarded = fast.variant(m, o.n, o.k) == "gemv_tma_narrow";
      EXPECT_EQ(guarded, cuda::gemv_tma_narrow_preferred(m, o.n, o.k)) << o.name << " m " << m;
      if (guarded) {
        y3.poison();
        fast.run(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, GemmOut::kBF16, 0);
        EXPECT_TRUE(y3.download() == bits) << o.name << " m " << m << " engine path";
      }
      for (auto [t0, mm] : {std::pair{0, 1}, std::pair{m - 1, 1}, std::pair{1, 3}}) {
        if (t0 + mm > m || mm == m) continue;
        y3.poison();
        cuda::launch_gemv_tma_narrow(B(dx, size_t(t0) * o.k), B(wpool.buf), y3.ptr, mm, o.n, o.k,
                                     GemmOut::kBF16, c0, n_sms, 0);
        const auto b = y3.download();
        EXPECT_EQ(std::memcmp(bits.data() + size_t(t0) * o.n * 2, b.data(), size_t(mm) * o.n * 2),
                  0)
            << o.name << " tokens " << t0 << ".." << t0 + mm - 1 << " of m " << m;
      }
      for (int grid : {n_sms / 2 + 1, 100}) {
        if (m != 16 || !cuda::gemv_tma_narrow_supports(m, o.n, o.k, grid)) continue;
        y3.poison();
        cuda::launch_gemv_tma_narrow(B(dx), B(wpool.buf), y3.ptr, m, o.n, o.k, GemmOut::kBF16, c0,
                                     grid, 0);
        EXPECT_TRUE(y3.download() == bits) << o.name << " grid " << grid;
      }
      expect_outputs_match(x, sampled, y1, y2, o, m, "tma_narrow");
    }
  }
}

// PDL: gdn_out-like -> down-like chain (the second reads the first's output after its wait), on
// a stream and from a graph, bit-identical to plain launches.
TEST(CudaGemvTmaNarrow, DependentLaunchesChain) {
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "TMA needs sm 90";
  const int n_sms = device_sms();
  std::mt19937 rng(193);
  for (int m : {1, 16}) {
    const int n1 = 4096, k1 = 6144, n2 = 5120;
    auto x = test::random_bf16(size_t(m) * k1, rng),
         w1 = test::random_bf16(size_t(n1) * k1, rng, 0.02f),
         w2 = test::random_bf16(size_t(n2) * n1, rng, 0.02f);
    DevBuf<bf> dx(x), dw1(w1), dw2(w2), y1(size_t(m) * n1), y2(size_t(m) * n2);
    cudaStream_t s;
    DS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    auto chain = [&](bool pdl) {
      cuda::GemvTmaNarrowConfig c1 = cuda::gemv_tma_narrow_config(m, n1, k1),
                                c2 = cuda::gemv_tma_narrow_config(m, n2, n1);
      c1.pdl = c2.pdl = pdl;
      cuda::launch_gemv_tma_narrow(B(dx), B(dw1), y1.ptr, m, n1, k1, GemmOut::kBF16, c1, n_sms,
                                   s);
      cuda::launch_gemv_tma_narrow(B(y1), B(dw2), y2.ptr, m, n2, n1, GemmOut::kBF16, c2, n_sms,
                                   s);
    };
    expect_pdl_chain_matches_serial(chain, y1, y2, w2, m, n1, n2, s);
    cudaStreamDestroy(s);
  }
}

TEST(CudaGemvTmaNarrow, GuardAndErrors) {
  const cuda::GemvTmaNarrowMode mode = cuda::gemv_tma_narrow_mode();
  auto reg = cuda::DispatchRegistry::with_defaults(90, "");
  using F = cuda::KernelFamily;
  auto pick = [&](const cuda::DispatchRegistry& r, int m, int n, int k, int glu = 0) {
    return r.select(F::kGemm, r.key(m, n, k, glu)).name;
  };
  using Mode = cuda::GemvTmaNarrowMode;
  const bool out_on = mode == Mode::kAll || mode == Mode::kOut;
  for (int m = 1; m <= 16; ++m) {
    const bool down_on = mode == Mode::kAll || mode == Mode::kDown ||
                         (mode == Mode::kDownBatch && m >= cuda::kGemvTmaNarrowMinM);
    EXPECT_EQ(pick(reg, m, 5120, 6144) == "gemv_tma_narrow", out_on) << m;
    EXPECT_EQ(pick(reg, m, 5120, 17408) == "gemv_tma_narrow", down_on) << m;
    EXPECT_NE(pick(reg, m, 16480, 5120), "gemv_tma_narrow") << m;  // n > 8192
    EXPECT_NE(pick(reg, m, 34816, 5120, 1), "gemv_tma_narrow") << m;
  }
  EXPECT_NE(pick(reg, 17, 5120, 6144), "gemv_tma_narrow");
  EXPECT_NE(pick(reg, 1, 5120, 2048), "gemv_tma_narrow");  // k < 6144
  EXPECT_NE(pick(reg, 8, 4096, 8192), "gemv_tma_narrow");  // n < 5120
  auto r80 = cuda::DispatchRegistry::with_defaults(80, "");
  EXPECT_NE(pick(r80, 8, 5120, 6144), "gemv_tma_narrow");
  // fits
  EXPECT_TRUE(cuda::gemv_tma_narrow_supports(16, 5120, 17408, 132));
  EXPECT_TRUE(cuda::gemv_tma_narrow_supports(16, 5120, 6144, 100));  // 7 groups per block
  EXPECT_EQ(cuda::gemv_tma_narrow_max_slots(5, 4), 8);  // the 27B on 132 SMs: 8 x 28 KiB
  EXPECT_EQ(cuda::gemv_tma_narrow_max_slots(5, 8), 4);
  EXPECT_EQ(cuda::gemv_tma_narrow_max_slots(5, 3), 0);  // kbox 2 / 4 / 8 / 16 only
  EXPECT_EQ(cuda::gemv_tma_narrow_max_slots(5, 16), 2);
  EXPECT_EQ(cuda::gemv_tma_narrow_max_slots(0, 4), 0);
  EXPECT_FALSE(cuda::gemv_tma_narrow_supports(17, 5120, 6144, 132));
  EXPECT_FALSE(cuda::gemv_tma_narrow_supports(0, 5120, 6144, 132));
  EXPECT_FALSE(cuda::gemv_tma_narrow_supports(16, 5120, 6148, 132));   // k % 8
  EXPECT_FALSE(cuda::gemv_tma_narrow_supports(16, 5120, 32776, 132));  // k
  EXPECT_FALSE(cuda::gemv_tma_narrow_supports(16, 132 * 64 + 8, 6144, 132));  // 9 groups
  EXPECT_FALSE(cuda::gemv_tma_narrow_fits(16, 5120, 6144, {4, 9, false}, 132));  // smem
  EXPECT_FALSE(cuda::gemv_tma_narrow_fits(16, 5120, 6144, {4, 1, false}, 132));  // slots
  EXPECT_FALSE(cuda::gemv_tma_narrow_fits(16, 5120, 6144, {3, 0, false}, 132));  // kbox
  EXPECT_FALSE(cuda::gemv_tma_narrow_supports(16, 5120, 6144, 0));
  DS_REQUIRE_GPU();
  if (!is_sm90()) GTEST_SKIP() << "TMA needs sm 90";
  DevBuf<bf> x(16 * 256), w(128 * 256);
  DevBuf<char> y(16 * 128 * 4);
  const cuda::GemvTmaNarrowConfig d;
  auto launch = [&](int xo, int wo, int m, int n, int k, cuda::GemvTmaNarrowConfig c, int sms,
                    void* yp) {
    cuda::launch_gemv_tma_narrow(B(x, xo), B(w, wo), yp, m, n, k, GemmOut::kBF16, c, sms, 0);
  };
  EXPECT_NO_THROW(launch(0, 0, 3, 64, 256, d, 132, y.ptr));
  EXPECT_THROW(launch(1, 0, 3, 64, 256, d, 132, y.ptr), Error);   // x unaligned
  EXPECT_THROW(launch(0, 4, 3, 64, 256, d, 132, y.ptr), Error);   // w unaligned
  EXPECT_THROW(launch(0, 0, 17, 64, 256, d, 132, y.ptr), Error);  // m > 16
  EXPECT_THROW(launch(0, 0, 3, 64, 252, d, 132, y.ptr), Error);   // k % 8
  EXPECT_THROW(launch(0, 0, 3, 64, 256, {4, 17, false}, 132, y.ptr), Error);  // slots
  EXPECT_THROW(launch(0, 0, 3, 64, 256, {5, 0, false}, 132, y.ptr), Error);   // kbox
  EXPECT_THROW(launch(0, 0, 3, 64, 256, d, 0, y.ptr), Error);     // n_sms
  EXPECT_THROW(launch(0, 0, 3, 64, 256, d, 132, nullptr), Error); // null y
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace ds
