// The residual add + RMSNorm fused into the bulk GEMVs' prologue (src/cuda/gemv_bulk_norm.h)
// against the two launches it replaces, launch_add_rmsnorm (rmsnorm.cu) then launch_gemv_bulk /
// launch_gemv_bulk_silu on its output:
//  - bit-identical GEMV outputs and an updated residual bit-identical to add_rmsnorm's in-place
//    update, with and without a delta (the first layer's input norm has none), at the 27B decode
//    shapes (gdn_in, attn_qkv, gdn_out's k = 6144, gate_up + SiLU at m 1..4), the largest k (8192)
//    and a small k (640: most of the 256 norm threads hold no vector), plain and PDL launches, the
//    norm weight loaded before or after the PDL wait (GemvNormIn::weight_early);
//  - the input residual left untouched (residual_out is a separate buffer), every output written
//    (poisoned before);
//  - errors for misaligned pointers, residual_out aliasing an input, k above kGemvNormMaxK, m
//    above kGemvNormMaxM;
//  - the batch-1 MLP in one kernel (launch_gemv_mlp_norm) against gate_up + SiLU with the norm
//    then the narrow down GEMV: the same act, y and residual bits, its grid barrier reused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "core/error.h"
#include "cuda/argmax.h"
#include "cuda/gemv.h"
#include "cuda/gemv_bulk_norm.h"
#include "cuda/kernels.h"
#include "cuda_test_util.h"

namespace ds {
namespace {

using test::DevBuf;
using bf = uint16_t;

__nv_bfloat16* P(const DevBuf<bf>& b, size_t off = 0) {
  return reinterpret_cast<__nv_bfloat16*>(b.ptr + off);
}

int n_sms() {
  int dev = 0, n = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  DS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

struct Case {
  const char* name;
  int m, n, k;  // n = d_ff for silu
  bool silu;
};

// The fused norm's input as these tests give it (eps 1e-6, the norm weight offset 1): residual +
// delta with residual_out, or the residual alone (delta null: nothing written).
cuda::GemvNormIn norm_input(const DevBuf<bf>& res, const DevBuf<bf>& delta, const DevBuf<bf>& nw,
                            const DevBuf<bf>& res_out, bool with_delta, bool weight_early) {
  cuda::GemvNormIn nin;
  nin.residual = P(res);
  nin.delta = with_delta ? P(delta) : nullptr;
  nin.weight = P(nw);
  nin.eps = 1e-6f;
  nin.weight_offset = 1.f;
  nin.residual_out = with_delta ? P(res_out) : nullptr;
  nin.weight_early = weight_early;
  return nin;
}

TEST(CudaGemvBulkNorm, BitIdenticalToAddRmsnormThenGemv) {
  DS_REQUIRE_GPU();
  const Case cases[] = {
      {"gdn_in", 1, 16480, 5120, false},    {"attn_qkv", 1, 14336, 5120, false},
      {"gdn_out k", 1, 5120, 6144, false},  {"m3 n4100", 3, 4100, 5120, false},
      {"k8192", 1, 3000, 8192, false},      {"k640 m2", 2, 777, 640, false},
      {"gate_up m1", 1, 17408, 5120, true}, {"gate_up m2", 2, 17408, 5120, true},
      {"gate_up m4", 4, 17408, 5120, true}, {"silu k640", 3, 1000, 640, true},
  };
  std::mt19937 rng(41);
  const int sms = n_sms();
  cudaStream_t st = nullptr;
  DS_CUDA_CHECK(cudaStreamCreate(&st));
  for (const Case& c : cases) {
    const int rows_w = c.silu ? 2 * c.n : c.n;
    const size_t xk = size_t(c.m) * c.k;
    const size_t out_n = size_t(c.m) * c.n;
    DevBuf<bf> w(test::random_bf16(size_t(rows_w) * c.k, rng, 0.05f));
    DevBuf<bf> nw(test::random_bf16(c.k, rng, 0.2f));  // zero-centred norm weight (offset 1)
    const std::vector<bf> h_res = test::random_bf16(xk, rng, 2.f);
    const std::vector<bf> h_delta = test::random_bf16(xk, rng, 1.f);
    for (bool with_delta : {true, false}) {
      for (int variant = 0; variant < 3; ++variant) {
        // 0: plain launch; 1: PDL; 2: PDL with the norm weight loaded after the wait
        // (GemvNormIn::weight_early off, $DS_GEMV_NORM_EARLY=0).
        const bool pdl = variant > 0, early = variant < 2;
        const std::string what = std::string(c.name) + (with_delta ? " +delta" : " no delta") +
                                 (pdl ? " pdl" : "") + (early ? "" : " late weight");
        // Reference: add_rmsnorm in place, then the GEMV on its output.
        DevBuf<bf> res_ref(h_res), delta(h_delta), xn(xk), y_ref(out_n);
        xn.poison();
        y_ref.poison();
        cuda::launch_add_rmsnorm(P(res_ref), with_delta ? P(delta) : nullptr, P(nw), c.m, c.k,
                                 1e-6f, 1.f, P(xn), st);
        cuda::GemvBulkConfig cfg = c.silu ? cuda::gemv_bulk_silu_config(c.m, c.n, c.k)
                                          : cuda::gemv_bulk_config(c.m, c.n, c.k);
        cfg.pdl = pdl;
        if (c.silu)
          cuda::launch_gemv_bulk_silu(P(xn), P(w), P(y_ref), c.m, c.n, c.k, cfg, sms, st);
        else
          cuda::launch_gemv_bulk(P(xn), P(w), y_ref.ptr, c.m, c.n, c.k, cuda::GemmOut::kBF16, false,
                                 cfg, sms, st);
        // Fused.
        DevBuf<bf> res_in(h_res), res_out(xk), y(out_n);
        res_out.poison();
        y.poison();
        const cuda::GemvNormIn nin = norm_input(res_in, delta, nw, res_out, with_delta, early);
        if (c.silu)
          cuda::launch_gemv_bulk_silu_norm(nin, P(w), P(y), c.m, c.n, c.k, cfg, sms, st);
        else
          cuda::launch_gemv_bulk_norm(nin, P(w), y.ptr, c.m, c.n, c.k, cuda::GemmOut::kBF16, cfg,
                                      sms, st);
        DS_CUDA_CHECK(cudaStreamSynchronize(st));
        const auto a = y.download(), b = y_ref.download();
        size_t differ = 0;
        for (size_t i = 0; i < out_n; ++i) differ += a[i] != b[i];
        EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << out_n << " outputs differ";
        size_t nan = 0;
        for (bf v : a) nan += (v & 0x7f80) == 0x7f80 && (v & 0x7f);
        EXPECT_EQ(nan, 0u) << what << ": outputs not written (NaN poison left)";
        EXPECT_EQ(res_in.download(), h_res) << what << ": the input residual was modified";
        if (with_delta) {
          EXPECT_EQ(res_out.download(), res_ref.download())
              << what << ": residual_out differs from add_rmsnorm's updated residual";
        } else {
          EXPECT_EQ(res_out.download(), std::vector<bf>(xk, 0xFFFF))
              << what << ": residual_out written without a delta";
        }
        std::printf("  %-26s m=%d n=%d k=%d: %zu outputs bit-identical\n", what.c_str(), c.m, c.n,
                    c.k, out_n);
      }
    }
  }
  cudaStreamDestroy(st);
}


// The decode head in one kernel (launch_gemv_bulk_argmax_norm; session 27: the final norm in the
// prologue, the greedy argmax in the epilogue) against launch_gemv_bulk_norm (fp32 out, one
// partial sum) followed by launch_argmax_rows: the logits, residual_out and the tokens
// bit-identical, at lm_head (248320 x 5120) m 1 and 2 and at small shapes (k 640 and 8192, n below
// the grid), with and without a delta, plain / PDL / the weight after the wait, contiguous and
// interleaved stages; a tie planted at the top of row 0 (two equal weight rows in different halves:
// the lower id must win); then the refusals (m 3, k above kGemvNormMaxK).
TEST(CudaGemvBulkNorm, ArgmaxNormBitIdenticalToNormGemvThenArgmax) {
  DS_REQUIRE_GPU();
  struct HeadCase {
    const char* name;
    int m, n, k;
  };
  const HeadCase cases[] = {{"lm_head m1", 1, 248320, 5120}, {"lm_head m2", 2, 248320, 5120},
                            {"k640 m2", 2, 777, 640},        {"k8192 m1", 1, 3001, 8192},
                            {"n below grid", 2, 37, 640}};
  std::mt19937 rng(61);
  const int sms = n_sms();
  cudaStream_t st = nullptr;
  DS_CUDA_CHECK(cudaStreamCreate(&st));
  DevBuf<char> ws(cuda::kGemvBulkArgmaxWorkspaceBytes);
  DS_CUDA_CHECK(cudaMemset(ws.ptr, 0, ws.n));
  DevBuf<int32_t> tok(2), tok_ref(2);
  for (const HeadCase& c : cases) {
    const size_t xk = size_t(c.m) * c.k, out_n = size_t(c.m) * c.n;
    std::vector<bf> hw = test::random_bf16(size_t(c.n) * c.k, rng, 0.05f);
    DevBuf<bf> nw(test::random_bf16(c.k, rng, 0.2f));
    const std::vector<bf> h_res = test::random_bf16(xk, rng, 2.f);
    const std::vector<bf> h_delta = test::random_bf16(xk, rng, 1.f);
    for (bool tie : {false, true}) {
      if (tie) {  // rows j and j2 equal and large for row 0's normed x: compute x on the host
        std::vector<float> x(c.k);
        for (int i = 0; i < c.k; ++i)
          x[i] = bf16_to_f32(f32_to_bf16(bf16_to_f32(h_res[i]) + bf16_to_f32(h_delta[i])));
        const int j = int(rng() % c.n), j2 = (j + c.n / 2 + 1) % c.n;
        for (int i = 0; i < c.k; ++i) {  // w aligned with x's sign pattern: a large positive dot
          const bf v = f32_to_bf16(x[i] >= 0 ? 0.5f : -0.5f);
          hw[size_t(j) * c.k + i] = hw[size_t(j2) * c.k + i] = v;
        }
      }
      DevBuf<bf> w(hw);
      for (bool with_delta : {true, false}) {
        for (int variant = 0; variant < 3; ++variant) {
          const bool pdl = variant > 0, early = variant < 2, ilv = variant != 1;
          const std::string what = std::string(c.name) + (tie ? " tie" : "") +
                                   (with_delta ? " +delta" : " no delta") + (pdl ? " pdl" : "") +
                                   (early ? "" : " late weight") + (ilv ? " ilv" : "");
          cuda::GemvBulkConfig cfg = cuda::gemv_bulk_config(c.m, c.n, c.k);
          cfg.pdl = pdl;
          cfg.interleave = ilv;
          ASSERT_TRUE(cuda::gemv_bulk_argmax_supports(c.m, c.n, c.k, cfg, true)) << what;
          DevBuf<bf> res_in(h_res), delta(h_delta), res_out(xk), res_out_ref(xk);
          DevBuf<float> y(out_n), y_ref(out_n);
          res_out.poison();
          res_out_ref.poison();
          y.poison();
          y_ref.poison();
          cuda::launch_gemv_bulk_norm(
              norm_input(res_in, delta, nw, res_out_ref, with_delta, early), P(w), y_ref.ptr, c.m,
              c.n, c.k, cuda::GemmOut::kF32, cfg, sms, st);
          DS_CUDA_CHECK(cudaMemsetAsync(tok_ref.ptr, 0x7f, 8, st));
          cuda::launch_argmax_rows(y_ref.ptr, c.m, c.n, tok_ref.ptr, st,
                                   cuda::ArgmaxKernel::kBlock, false);
          DS_CUDA_CHECK(cudaMemsetAsync(tok.ptr, 0x7f, 8, st));
          cuda::launch_gemv_bulk_argmax_norm(
              norm_input(res_in, delta, nw, res_out, with_delta, early), P(w), y.ptr, tok.ptr,
              ws.ptr, c.m, c.n, c.k, cfg, sms, st);
          DS_CUDA_CHECK(cudaStreamSynchronize(st));
          const auto a = y.download(), b = y_ref.download();
          EXPECT_EQ(std::memcmp(a.data(), b.data(), 4 * out_n), 0) << what << ": logits differ";
          size_t unwritten = 0;  // the NaN poison left in either
          for (size_t i = 0; i < out_n; ++i) unwritten += std::isnan(a[i]) || std::isnan(b[i]);
          EXPECT_EQ(unwritten, 0u) << what << ": logits not written";
          EXPECT_EQ(res_out.download(), res_out_ref.download()) << what << ": residual_out";
          if (!with_delta) {
            EXPECT_EQ(res_out.download(), std::vector<bf>(xk, 0xFFFF))
                << what << ": residual_out written without a delta";
          }
          EXPECT_EQ(res_in.download(), h_res) << what << ": the input residual was modified";
          const auto t = tok.download(), tr = tok_ref.download();
          for (int i = 0; i < c.m; ++i) EXPECT_EQ(t[i], tr[i]) << what << " row " << i;
          if (tie && with_delta) {
            // The planted pair is the top of row 0 (normed x against its own sign pattern);
            // the lower of the two ids wins.
            const int j = int(std::max_element(b.begin(), b.begin() + c.n) - b.begin());
            EXPECT_EQ(t[0], j) << what;
            int equal = 0;
            for (int i = 0; i < c.n; ++i) equal += b[i] == b[j];
            EXPECT_GE(equal, 2) << what << ": the planted tie is not a tie";
          }
          for (char z : ws.download()) ASSERT_EQ(z, 0) << what << ": workspace not reset";
        }
      }
    }
  }
  // Refusals: m 3 (past the argmax's 2), k above the norm's 8192.
  DevBuf<bf> x(16 * 8200), w(64 * 8200), nw(8200);
  DevBuf<float> y(3 * 64);
  cuda::GemvNormIn nin;
  nin.residual = P(x);
  nin.weight = P(nw);
  nin.eps = 1e-6f;
  nin.weight_offset = 1.f;
  auto launch = [&](int m, int k, cuda::GemvBulkConfig c) {
    cuda::launch_gemv_bulk_argmax_norm(nin, P(w), y.ptr, tok.ptr, ws.ptr, m, 64, k, c, sms, st);
  };
  const cuda::GemvBulkConfig c{1, 8, false};
  EXPECT_THROW(launch(3, 640, c), Error);
  EXPECT_THROW(launch(1, 8200, c), Error);
  EXPECT_FALSE(cuda::gemv_bulk_argmax_supports(1, 64, 8200, c, true));
  EXPECT_TRUE(cuda::gemv_bulk_argmax_supports(1, 64, 8200, c, false));
  EXPECT_NO_THROW(launch(1, 640, c));
  DS_CUDA_CHECK(cudaStreamSynchronize(st));
  for (char z : ws.download()) EXPECT_EQ(z, 0);
  cudaStreamDestroy(st);
}

// The batch-1 MLP in one kernel (launch_gemv_mlp_norm, $DS_MLP_FUSED) against the two kernels it
// fuses, launch_gemv_bulk_silu_norm then launch_gemv_narrow: act, y and residual_out bit-identical
// at the 27B shapes (d_ff 17408: 4 slices per down row, 2 per stage), a small shape whose down
// rows are one slice (an odd count: a stage with one slice; d_ff 3000, k 640, n 777) and one with
// 8 slices per row (d_ff 32768), with
// and without a delta, plain and PDL launches; the grid barrier
// reused by back-to-back launches on one stream and by 3 replays of a graph holding 2 launches
// (each must find it reset); and the guard's refusals.
TEST(CudaGemvBulkNorm, FusedMlpBitIdenticalToTheTwoKernels) {
  DS_REQUIRE_GPU();
  struct MlpCase {
    const char* name;
    int d_ff, k, n;
  };
  const MlpCase cases[] = {{"27B", 17408, 5120, 5120},
                           {"k640 d_ff 3000", 3000, 640, 777},
                           {"d_ff 32768 (8 slices)", 32768, 640, 777}};
  std::mt19937 rng(43);
  const int sms = n_sms();
  cudaStream_t st = nullptr;
  DS_CUDA_CHECK(cudaStreamCreate(&st));
  DevBuf<unsigned> bar(2);
  DS_CUDA_CHECK(cudaMemset(bar.ptr, 0, 2 * sizeof(unsigned)));
  for (const MlpCase& c : cases) {
    if (!cuda::gemv_mlp_norm_supports(1, c.d_ff, c.k, c.n, 0, sms)) {
      ADD_FAILURE() << c.name << ": not supported on " << sms << " SMs";
      continue;
    }
    DevBuf<bf> wgu(test::random_bf16(size_t(2) * c.d_ff * c.k, rng, 0.05f));
    DevBuf<bf> wd(test::random_bf16(size_t(c.n) * c.d_ff, rng, 0.03f));
    DevBuf<bf> nw(test::random_bf16(c.k, rng, 0.2f));
    const std::vector<bf> h_res = test::random_bf16(c.k, rng, 2.f);
    const std::vector<bf> h_delta = test::random_bf16(c.k, rng, 1.f);
    for (bool with_delta : {true, false}) {
      for (bool pdl : {false, true}) {
        const std::string what =
            std::string(c.name) + (with_delta ? " +delta" : " no delta") + (pdl ? " pdl" : "");
        auto nin_of = [&](const DevBuf<bf>& res, const DevBuf<bf>& delta, DevBuf<bf>& out) {
          cuda::GemvNormIn nin;
          nin.residual = P(res);
          nin.delta = with_delta ? P(delta) : nullptr;
          nin.weight = P(nw);
          nin.eps = 1e-6f;
          nin.residual_out = with_delta ? P(out) : nullptr;
          return nin;
        };
        // The two kernels.
        DevBuf<bf> res(h_res), delta(h_delta), rout_ref(c.k), act_ref(c.d_ff), y_ref(c.n);
        rout_ref.poison();
        act_ref.poison();
        y_ref.poison();
        cuda::GemvBulkConfig scfg = cuda::gemv_bulk_silu_config(1, c.d_ff, c.k);
        scfg.pdl = pdl;
        cuda::launch_gemv_bulk_silu_norm(nin_of(res, delta, rout_ref), P(wgu), P(act_ref), 1,
                                         c.d_ff, c.k, scfg, sms, st);
        cuda::GemvNarrowConfig ncfg = cuda::gemv_narrow_config(1, c.n, c.d_ff, sms);
        ncfg.pdl = pdl;
        cuda::launch_gemv_narrow(P(act_ref), P(wd), y_ref.ptr, 1, c.n, c.d_ff,
                                 cuda::GemmOut::kBF16, false, ncfg, sms, st);
        const auto ref_act = act_ref.download(), ref_y = y_ref.download();
        const auto ref_rout = rout_ref.download();
        // Fused: twice back to back (the barrier reused), checked after each.
        DevBuf<bf> rout(c.k), act(c.d_ff), y(c.n);
        for (int rep = 0; rep < 2; ++rep) {
          rout.poison();
          act.poison();
          y.poison();
          cuda::launch_gemv_mlp_norm(nin_of(res, delta, rout), {}, {}, P(wgu), P(act), P(wd),
                                     P(y), 1,
                                     c.d_ff, c.k, c.n, pdl, bar.ptr, sms, st);
          DS_CUDA_CHECK(cudaStreamSynchronize(st));
          EXPECT_TRUE(act.download() == ref_act) << what << " rep " << rep << ": act differs";
          EXPECT_TRUE(y.download() == ref_y) << what << " rep " << rep << ": y differs";
          if (with_delta)
            EXPECT_TRUE(rout.download() == ref_rout) << what << ": residual_out differs";
          else
            EXPECT_EQ(rout.download(), std::vector<bf>(c.k, 0xFFFF))
                << what << ": residual_out written without a delta";
        }
        EXPECT_EQ(res.download(), h_res) << what << ": the input residual was modified";
        size_t nan = 0;
        for (bf v : y.download()) nan += (v & 0x7f80) == 0x7f80 && (v & 0x7f);
        EXPECT_EQ(nan, 0u) << what << ": y not written";
        std::printf("  fused MLP %-22s d_ff=%d k=%d n=%d: act, y, residual bit-identical\n",
                    what.c_str(), c.d_ff, c.k, c.n);
      }
    }
    // A graph of two launches (the second reads the first's y as its delta and the first's
    // residual_out as its residual), replayed 3 times with every output poisoned before each
    // replay: each replay's act and y equal the two-kernel reference of the same chain, so the
    // barrier was left reset every time (a barrier passed early would leave poison or stale act).
    if (c.n == c.k) {
      auto chain_in = [&](const bf* res, const bf* delta, bf* rout) {
        cuda::GemvNormIn nin;
        nin.residual = reinterpret_cast<const __nv_bfloat16*>(res);
        nin.delta = reinterpret_cast<const __nv_bfloat16*>(delta);
        nin.weight = P(nw);
        nin.residual_out = reinterpret_cast<__nv_bfloat16*>(rout);
        return nin;
      };
      DevBuf<bf> res(h_res), delta(h_delta);
      // The reference chain on the two kernels.
      DevBuf<bf> rr1(c.k), rr2(c.k), ra1(c.d_ff), ra2(c.d_ff), ry1(c.k), ry2(c.n);
      cuda::GemvBulkConfig scfg = cuda::gemv_bulk_silu_config(1, c.d_ff, c.k);
      cuda::GemvNarrowConfig ncfg = cuda::gemv_narrow_config(1, c.n, c.d_ff, sms);
      cuda::launch_gemv_bulk_silu_norm(chain_in(res.ptr, delta.ptr, rr1.ptr), P(wgu), P(ra1), 1,
                                       c.d_ff, c.k, scfg, sms, st);
      cuda::launch_gemv_narrow(P(ra1), P(wd), ry1.ptr, 1, c.n, c.d_ff, cuda::GemmOut::kBF16,
                               false, ncfg, sms, st);
      cuda::launch_gemv_bulk_silu_norm(chain_in(rr1.ptr, ry1.ptr, rr2.ptr), P(wgu), P(ra2), 1,
                                       c.d_ff, c.k, scfg, sms, st);
      cuda::launch_gemv_narrow(P(ra2), P(wd), ry2.ptr, 1, c.n, c.d_ff, cuda::GemmOut::kBF16,
                               false, ncfg, sms, st);
      DS_CUDA_CHECK(cudaStreamSynchronize(st));
      const auto w_a1 = ra1.download(), w_a2 = ra2.download(), w_y1 = ry1.download(),
                 w_y2 = ry2.download();
      // The fused chain, captured once and replayed.
      DevBuf<bf> r1(c.k), r2(c.k), a1(c.d_ff), a2(c.d_ff), y1(c.k), y2(c.n);
      cudaGraph_t g = nullptr;
      cudaGraphExec_t ge = nullptr;
      DS_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      cuda::launch_gemv_mlp_norm(chain_in(res.ptr, delta.ptr, r1.ptr), {}, {}, P(wgu), P(a1), P(wd),
                                 P(y1), 1, c.d_ff, c.k, c.n, true, bar.ptr, sms, st);
      cuda::launch_gemv_mlp_norm(chain_in(r1.ptr, y1.ptr, r2.ptr), {}, {}, P(wgu), P(a2), P(wd),
                                 P(y2), 1,
                                 c.d_ff, c.k, c.n, true, bar.ptr, sms, st);
      DS_CUDA_CHECK(cudaStreamEndCapture(st, &g));
      DS_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
      for (int rep = 0; rep < 3; ++rep) {
        for (DevBuf<bf>* p : {&r1, &r2, &a1, &a2, &y1, &y2}) p->poison();
        DS_CUDA_CHECK(cudaGraphLaunch(ge, st));
        DS_CUDA_CHECK(cudaStreamSynchronize(st));
        EXPECT_TRUE(a1.download() == w_a1 && y1.download() == w_y1)
            << c.name << ": graph replay " << rep << ": the first launch differs";
        EXPECT_TRUE(a2.download() == w_a2 && y2.download() == w_y2)
            << c.name << ": graph replay " << rep << ": the second launch differs";
      }
      cudaGraphExecDestroy(ge);
      cudaGraphDestroy(g);
      unsigned hb[2] = {1, 1};
      DS_CUDA_CHECK(cudaMemcpy(hb, bar.ptr, sizeof(hb), cudaMemcpyDeviceToHost));
      EXPECT_EQ(hb[0], 0u) << "the barrier's count is left at 0";
    }
  }
  // The guard: batch > 1, fewer rows than blocks, k above the norm's limit.
  EXPECT_FALSE(cuda::gemv_mlp_norm_supports(2, 17408, 5120, 5120, 0, sms));
  EXPECT_FALSE(cuda::gemv_mlp_norm_supports(1, 17408, 5120, sms - 1, 0, sms));
  EXPECT_FALSE(cuda::gemv_mlp_norm_supports(1, 17408, 16384, 5120, 0, sms));
  EXPECT_TRUE(cuda::gemv_mlp_norm_supports(1, 17408, 5120, 5120, 6144, sms));
  EXPECT_FALSE(cuda::gemv_mlp_norm_supports(1, 17408, 5120, 5120, 6148, sms));  // k0 % 8
  cudaStreamDestroy(st);
}

// The mixer form ($DS_MLP_FUSED=2): the out-projection (gdn_out / attn_o: 5120 x 6144) as the
// fused kernel's first phase, then the MLP, against launch_gemv_bulk (the engine's gdn_out at
// batch 1) then gate_up + SiLU with the norm then the narrow down GEMV; and form 3, which adds the
// next layer's input norm and in-projection (gdn_in) against launch_gemv_bulk_norm: every output
// (delta, act, y, residual_out, the second residual, the projection) bit-identical, plain and PDL,
// twice back to back (the barrier's generations per launch), and 3 graph replays with every
// output poisoned first; the guard refuses y0 != delta and a next norm not fed by y.
TEST(CudaGemvBulkNorm, FusedMixerMlpNextBitIdenticalToTheSeparateKernels) {
  DS_REQUIRE_GPU();
  const int d_ff = 17408, k = 5120, n = 5120, k0 = 6144;
  std::mt19937 rng(47);
  const int sms = n_sms();
  ASSERT_TRUE(cuda::gemv_mlp_norm_supports(1, d_ff, k, n, k0, sms));
  cudaStream_t st = nullptr;
  DS_CUDA_CHECK(cudaStreamCreate(&st));
  DevBuf<unsigned> bar(2);
  DS_CUDA_CHECK(cudaMemset(bar.ptr, 0, 2 * sizeof(unsigned)));
  DevBuf<bf> w0(test::random_bf16(size_t(k) * k0, rng, 0.03f));
  DevBuf<bf> wgu(test::random_bf16(size_t(2) * d_ff * k, rng, 0.05f));
  DevBuf<bf> wd(test::random_bf16(size_t(n) * d_ff, rng, 0.03f));
  DevBuf<bf> nw(test::random_bf16(k, rng, 0.2f));
  DevBuf<bf> x0(test::random_bf16(k0, rng, 1.f));
  const std::vector<bf> h_res = test::random_bf16(k, rng, 2.f);
  DevBuf<bf> res(h_res);
  // The three kernels.
  DevBuf<bf> d_ref(k), r_ref(k), a_ref(d_ff), y_ref(n);
  cuda::GemvBulkConfig ocfg = cuda::gemv_bulk_config(1, k, k0);
  cuda::launch_gemv_bulk(P(x0), P(w0), d_ref.ptr, 1, k, k0, cuda::GemmOut::kBF16, false, ocfg,
                         sms, st);
  cuda::GemvNormIn nin;
  nin.residual = P(res);
  nin.delta = P(d_ref);
  nin.weight = P(nw);
  nin.residual_out = P(r_ref);
  cuda::launch_gemv_bulk_silu_norm(nin, P(wgu), P(a_ref), 1, d_ff, k,
                                   cuda::gemv_bulk_silu_config(1, d_ff, k), sms, st);
  cuda::launch_gemv_narrow(P(a_ref), P(wd), y_ref.ptr, 1, n, d_ff, cuda::GemmOut::kBF16, false,
                           cuda::gemv_narrow_config(1, n, d_ff, sms), sms, st);
  DS_CUDA_CHECK(cudaStreamSynchronize(st));
  const auto w_d = d_ref.download(), w_r = r_ref.download(), w_a = a_ref.download(),
             w_y = y_ref.download();
  // Form 3's last phase, the next layer's input norm and in-projection (gdn_in: 16480 rows in
  // 8240 row pairs over the blocks), by the bulk GEMV with the norm in its prologue.
  const int n_in = 16480;
  DevBuf<bf> w_in(test::random_bf16(size_t(n_in) * k, rng, 0.03f));
  DevBuf<bf> nw2(test::random_bf16(k, rng, 0.2f));
  DevBuf<bf> r2_ref(k), p_ref(n_in);
  cuda::GemvNormIn nin2 = nin;
  nin2.residual = P(r_ref);
  nin2.delta = P(y_ref);
  nin2.weight = P(nw2);
  nin2.residual_out = P(r2_ref);
  cuda::launch_gemv_bulk_norm(nin2, P(w_in), p_ref.ptr, 1, n_in, k, cuda::GemmOut::kBF16,
                              cuda::gemv_bulk_config(1, n_in, k), sms, st);
  DS_CUDA_CHECK(cudaStreamSynchronize(st));
  const auto w_r2 = r2_ref.download(), w_p = p_ref.download();
  ASSERT_TRUE(cuda::gemv_mlp_norm_supports(1, d_ff, k, n, k0, sms, n_in));
  // Fused: delta, act, y, residual_out (and with next: the second residual and the projection).
  DevBuf<bf> dl(k), ro(k), a(d_ff), y(n), ro2(k), pj(n_in);
  cuda::GemvNormIn fin = nin;
  fin.delta = P(dl);
  fin.residual_out = P(ro);
  cuda::GemvMlpMixer mx;
  mx.x0 = P(x0);
  mx.w0 = P(w0);
  mx.y0 = P(dl);
  mx.k0 = k0;
  cuda::GemvMlpNext nx;
  nx.norm = nin2;
  nx.norm.residual = P(ro);
  nx.norm.delta = P(y);
  nx.norm.residual_out = P(ro2);
  nx.w = P(w_in);
  nx.y = P(pj);
  nx.n = n_in;
  for (bool with_next : {false, true}) {
    const cuda::GemvMlpNext use = with_next ? nx : cuda::GemvMlpNext{};
    auto check = [&](const std::string& what0) {
      const std::string what = what0 + (with_next ? " +next" : "");
      EXPECT_TRUE(dl.download() == w_d) << what << ": the out-projection (delta) differs";
      EXPECT_TRUE(ro.download() == w_r) << what << ": residual_out differs";
      EXPECT_TRUE(a.download() == w_a) << what << ": act differs";
      EXPECT_TRUE(y.download() == w_y) << what << ": y differs";
      if (with_next) {
        EXPECT_TRUE(ro2.download() == w_r2) << what << ": the next residual differs";
        EXPECT_TRUE(pj.download() == w_p) << what << ": the next in-projection differs";
      }
    };
    auto poison = [&] {
      for (DevBuf<bf>* p : {&dl, &ro, &a, &y, &ro2, &pj}) p->poison();
    };
    for (bool pdl : {false, true})
      for (int rep = 0; rep < 2; ++rep) {
        poison();
        cuda::launch_gemv_mlp_norm(fin, mx, use, P(wgu), P(a), P(wd), P(y), 1, d_ff, k, n, pdl,
                                   bar.ptr, sms, st);
        DS_CUDA_CHECK(cudaStreamSynchronize(st));
        check(std::string(pdl ? "pdl" : "plain") + " rep " + std::to_string(rep));
      }
    cudaGraph_t g = nullptr;
    cudaGraphExec_t ge = nullptr;
    DS_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    cuda::launch_gemv_mlp_norm(fin, mx, use, P(wgu), P(a), P(wd), P(y), 1, d_ff, k, n, true,
                               bar.ptr, sms, st);
    DS_CUDA_CHECK(cudaStreamEndCapture(st, &g));
    DS_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int rep = 0; rep < 3; ++rep) {
      poison();
      DS_CUDA_CHECK(cudaGraphLaunch(ge, st));
      DS_CUDA_CHECK(cudaStreamSynchronize(st));
      check("graph replay " + std::to_string(rep));
    }
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    std::printf("  fused out-projection + MLP%s: every output bit-identical\n",
                with_next ? " + next in-projection" : "");
  }
  cuda::GemvMlpMixer bad = mx;
  bad.y0 = P(a);  // not the norm's delta
  EXPECT_THROW(cuda::launch_gemv_mlp_norm(fin, bad, {}, P(wgu), P(a), P(wd), P(y), 1, d_ff, k, n,
                                          false, bar.ptr, sms, st),
               ds::Error);
  cuda::GemvMlpNext bad_next = nx;
  bad_next.norm.delta = P(dl);  // not y
  EXPECT_THROW(cuda::launch_gemv_mlp_norm(fin, mx, bad_next, P(wgu), P(a), P(wd), P(y), 1, d_ff, k,
                                          n, false, bar.ptr, sms, st),
               ds::Error);
  cudaStreamDestroy(st);
}

// The fused MLP's buffer rules (host only: no device memory is touched): the engine's layout of
// form 3 is accepted (y is the norm's delta, the next norm writes into the first norm's residual),
// and each other overlap is refused with the two buffers named.
TEST(CudaGemvBulkNorm, FusedMlpBufferRules) {
  const int m = 1, d_ff = 17408, k = 5120, n = 5120, k0 = 6144, n_in = 16480;
  // Fake, 1 MiB apart device addresses: only compared, never dereferenced.
  auto at = [](int i) {
    return reinterpret_cast<__nv_bfloat16*>(uintptr_t(1) << 40 | uintptr_t(i) << 20);
  };
  __nv_bfloat16 *h = at(0), *h2 = at(1), *delta = at(2), *act = at(3), *mix = at(4), *proj = at(5);
  cuda::GemvNormIn post;
  post.residual = h;
  post.delta = delta;
  post.weight = at(6);
  post.residual_out = h2;
  cuda::GemvMlpMixer mx{mix, at(7), delta, k0};
  cuda::GemvMlpNext nx;
  nx.norm = post;
  nx.norm.residual = h2;
  nx.norm.delta = delta;
  nx.norm.residual_out = h;  // the engine's ping-pong: the first norm's residual
  nx.w = at(8);
  nx.y = proj;
  nx.n = n_in;
  EXPECT_NO_THROW(cuda::gemv_mlp_norm_check_buffers(post, mx, nx, act, delta, m, d_ff, k, n));
  EXPECT_NO_THROW(cuda::gemv_mlp_norm_check_buffers(post, mx, {}, act, delta, m, d_ff, k, n));
  EXPECT_NO_THROW(cuda::gemv_mlp_norm_check_buffers(post, {}, {}, act, delta, m, d_ff, k, n));
  auto refused = [&](const cuda::GemvNormIn& a, const cuda::GemvMlpMixer& b,
                     const cuda::GemvMlpNext& c, const void* ac, const void* y, const char* names) {
    try {
      cuda::gemv_mlp_norm_check_buffers(a, b, c, ac, y, m, d_ff, k, n);
      ADD_FAILURE() << "not refused: " << names;
    } catch (const ds::Error& e) {
      EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << e.what();
    }
  };
  refused(post, mx, nx, act, act, "act and y overlap");  // y over act
  cuda::GemvMlpNext bad = nx;
  bad.y = act + 100;  // the next projection inside act
  refused(post, mx, bad, act, delta, "act and next y overlap");
  bad = nx;
  bad.norm.residual_out = delta;
  refused(post, mx, bad, act, delta, "y and next residual_out overlap");
  cuda::GemvMlpMixer bad_mx = mx;
  bad_mx.x0 = act;
  refused(post, bad_mx, nx, act, delta, "act and x0 overlap");
  cuda::GemvNormIn bad_post = post;
  bad_post.residual_out = h + 8;  // straddles the residual
  refused(bad_post, {}, {}, act, delta, "residual and residual_out overlap");
}

// The L2 prefetch of a later GEMV's rows (GemvL2Next, what the decode step asks of gdn_in and
// attn_qkv for gdn_out / attn_o): the outputs are bit-identical with and without it, for the
// 27B pairs, a prefetch grid larger than this GEMV's (several ranges per block), more rows than a
// range holds (clamped), plain and PDL launches; the prefetched weight is left untouched; and the
// guard throws for a misaligned weight, a grid above n, k % 8 != 0 and m above kGemvL2NextMaxM.
TEST(CudaGemvBulkNorm, L2PrefetchOfALaterGemvChangesNoBit) {
  DS_REQUIRE_GPU();
  struct Pair {
    const char* name;
    int m, n, k;                    // this GEMV
    int next_n, next_k, grid, rows;  // the later one
  };
  const int sms = n_sms();
  const Pair pairs[] = {
      {"gdn_in -> gdn_out", 1, 16480, 5120, 5120, 6144, sms, 24},
      {"attn_qkv -> attn_o", 1, 14336, 5120, 5120, 6144, sms, 39},
      {"m2, grid 3x, rows clamped", 2, 4100, 5120, 5000, 6144, 3 * sms, 1000},
  };
  std::mt19937 rng(43);
  cudaStream_t st = nullptr;
  DS_CUDA_CHECK(cudaStreamCreate(&st));
  for (const Pair& c : pairs) {
    const size_t xk = size_t(c.m) * c.k, out_n = size_t(c.m) * c.n;
    DevBuf<bf> w(test::random_bf16(size_t(c.n) * c.k, rng, 0.05f));
    const std::vector<bf> h_next = test::random_bf16(size_t(c.next_n) * c.next_k, rng, 0.05f);
    DevBuf<bf> wnext(h_next);
    DevBuf<bf> nw(test::random_bf16(c.k, rng, 0.2f));
    const std::vector<bf> h_res = test::random_bf16(xk, rng, 2.f);
    DevBuf<bf> delta(test::random_bf16(xk, rng, 1.f));
    for (bool pdl : {false, true}) {
      cuda::GemvBulkConfig cfg = cuda::gemv_bulk_config(c.m, c.n, c.k);
      cfg.pdl = pdl;
      std::vector<bf> outs[2], resids[2];
      for (int with = 0; with < 2; ++with) {
        DevBuf<bf> res(h_res), res_out(xk), y(out_n);
        res_out.poison();
        y.poison();
        cuda::GemvNormIn nin;
        nin.residual = P(res);
        nin.delta = P(delta);
        nin.weight = P(nw);
        nin.residual_out = P(res_out);
        cuda::GemvL2Next nx;
        if (with) nx = {P(wnext), c.next_n, c.next_k, c.grid, c.rows};
        cuda::launch_gemv_bulk_norm(nin, P(w), y.ptr, c.m, c.n, c.k, cuda::GemmOut::kBF16, cfg,
                                    sms, st, nx);
        DS_CUDA_CHECK(cudaStreamSynchronize(st));
        outs[with] = y.download();
        resids[with] = res_out.download();
      }
      size_t differ = 0, nan = 0;
      for (size_t i = 0; i < out_n; ++i) differ += outs[0][i] != outs[1][i];
      for (bf v : outs[1]) nan += (v & 0x7f80) == 0x7f80 && (v & 0x7f);
      EXPECT_EQ(differ, 0u) << c.name << (pdl ? " pdl" : "") << ": outputs differ";
      EXPECT_EQ(nan, 0u) << c.name << ": outputs not written";
      EXPECT_EQ(resids[0], resids[1]) << c.name << ": residual_out differs";
      EXPECT_EQ(wnext.download(), h_next) << c.name << ": the prefetched weight changed";
      std::printf("  %-28s%s m=%d n=%d k=%d, next %dx%d grid %d rows %d: bit-identical\n", c.name,
                  pdl ? " pdl" : "", c.m, c.n, c.k, c.next_n, c.next_k, c.grid, c.rows);
    }
  }
  // Guard.
  DevBuf<bf> w(size_t(512) * 1024), wnext(size_t(512) * 1024 + 8), nw(1024), res(1024), y(512);
  cuda::GemvNormIn nin;
  nin.residual = P(res);
  nin.weight = P(nw);
  const cuda::GemvBulkConfig cfg = cuda::gemv_bulk_config(1, 512, 1024);
  auto run = [&](const cuda::GemvL2Next& nx) {
    cuda::launch_gemv_bulk_norm(nin, P(w), y.ptr, 1, 512, 1024, cuda::GemmOut::kBF16, cfg, sms,
                                st, nx);
  };
  EXPECT_NO_THROW(run({P(wnext), 512, 1024, 132, 4}));
  EXPECT_THROW(run({P(wnext, 1), 512, 1024, 132, 4}), ds::Error);  // misaligned
  EXPECT_THROW(run({P(wnext), 512, 1024, 513, 4}), ds::Error);     // grid above n
  EXPECT_THROW(run({P(wnext), 512, 1020, 132, 4}), ds::Error);     // k % 8
  EXPECT_NO_THROW(run({nullptr, 0, 0, 0, 4}));                     // no weight: off
  // compiled for m <= kGemvL2NextMaxM only: m 3 with a prefetch is refused, without one it runs
  DevBuf<bf> x3(size_t(3) * 1024), y3(size_t(3) * 512);
  const cuda::GemvBulkConfig cfg3 = cuda::gemv_bulk_config(3, 512, 1024);
  EXPECT_THROW(cuda::launch_gemv_bulk(P(x3), P(w), y3.ptr, 3, 512, 1024, cuda::GemmOut::kBF16,
                                      false, cfg3, sms, st, {P(wnext), 512, 1024, 132, 4}),
               ds::Error);
  EXPECT_NO_THROW(cuda::launch_gemv_bulk(P(x3), P(w), y3.ptr, 3, 512, 1024, cuda::GemmOut::kBF16,
                                         false, cfg3, sms, st));
  DS_CUDA_CHECK(cudaStreamSynchronize(st));
  cudaStreamDestroy(st);
}

// The early-rows signal (GemvSignal, session 32): the sweep starting at first_row changes no bit
// of y or of the residual; every row is written; the counter ends at gemv_bulk_signal_count
// (added to what it held: one zeroed word per launch here); bad requests throw. Whether gdn_decode
// may read the covered rows once the count is reached is Specialisations.GdnEarlyOnVsOff*.
TEST(CudaGemvBulkNorm, EarlyRowsSignalChangesNoBit) {
  DS_REQUIRE_GPU();
  struct Sig {
    const char* name;
    int n, k, first_row, rows;
  };
  const Sig cases[] = {
      {"27B gdn_in: b / a, then qkv", 16480, 5120, 10240 + 6144, 96 + 10240},
      {"27B gdn_in: all rows", 16480, 5120, 16384, 16480},
      {"27B gdn_in: from row 0, 1 row", 16480, 5120, 0, 1},
      {"odd n 1001, wrap at 997", 1001, 1024, 997, 300},
      {"n below the grid", 40, 5120, 7, 12},
  };
  const int sms = n_sms();
  std::mt19937 rng(71);
  cudaStream_t st = nullptr;
  DS_CUDA_CHECK(cudaStreamCreate(&st));
  DevBuf<unsigned> counter(1);
  for (const Sig& c : cases) {
    DevBuf<bf> w(test::random_bf16(size_t(c.n) * c.k, rng, 0.05f));
    DevBuf<bf> nw(test::random_bf16(c.k, rng, 0.2f));
    const std::vector<bf> h_res = test::random_bf16(c.k, rng, 2.f);
    DevBuf<bf> delta(test::random_bf16(c.k, rng, 1.f));
    for (bool pdl : {false, true}) {
      cuda::GemvBulkConfig cfg = cuda::gemv_bulk_config(1, c.n, c.k);
      cfg.pdl = pdl;
      cfg.interleave = true;
      std::vector<bf> outs[2], resids[2];
      for (int with = 0; with < 2; ++with) {
        DevBuf<bf> res(h_res), res_out(c.k), y(c.n);
        res_out.poison();
        y.poison();
        DS_CUDA_CHECK(cudaMemset(counter.ptr, 0, sizeof(unsigned)));
        const cuda::GemvNormIn nin = norm_input(res, delta, nw, res_out, true, true);
        cuda::GemvSignal sig;
        if (with) sig = {counter.ptr, c.first_row, c.rows};
        cuda::launch_gemv_bulk_norm(nin, P(w), y.ptr, 1, c.n, c.k, cuda::GemmOut::kBF16, cfg, sms,
                                    st, {}, sig);
        DS_CUDA_CHECK(cudaStreamSynchronize(st));
        outs[with] = y.download();
        resids[with] = res_out.download();
        const unsigned raised = counter.download()[0];
        if (with)
          EXPECT_EQ(raised, unsigned(cuda::gemv_bulk_signal_count(1, c.n, c.k, cfg, sms)))
              << c.name;
        else
          EXPECT_EQ(raised, 0u) << c.name << ": a launch without the signal raised it";
      }
      size_t differ = 0, nan = 0;
      for (int i = 0; i < c.n; ++i) differ += outs[0][i] != outs[1][i];
      for (bf v : outs[1]) nan += (v & 0x7f80) == 0x7f80 && (v & 0x7f);
      EXPECT_EQ(differ, 0u) << c.name << (pdl ? " pdl" : "") << ": outputs differ";
      EXPECT_EQ(nan, 0u) << c.name << ": outputs not written";
      EXPECT_EQ(resids[0], resids[1]) << c.name << ": residual_out differs";
      std::printf("  %-32s%s n=%d k=%d first_row %d rows %d: bit-identical, %d raises\n", c.name,
                  pdl ? " pdl" : "", c.n, c.k, c.first_row, c.rows,
                  cuda::gemv_bulk_signal_count(1, c.n, c.k, cfg, sms));
    }
  }
  // Refused: what the signal is not compiled for, and rows outside the weight.
  const int n = 512, k = 1024;
  DevBuf<bf> w(size_t(n) * k), nw(k), res(2 * k), y(2 * n), wnext(size_t(n) * k);
  cuda::GemvNormIn nin;
  nin.residual = P(res);
  nin.weight = P(nw);
  cuda::GemvBulkConfig cfg = cuda::gemv_bulk_config(1, n, k);
  cfg.interleave = true;
  auto run = [&](int m, const cuda::GemvBulkConfig& cf, const cuda::GemvSignal& sg,
                 const cuda::GemvL2Next& nx = {}) {
    cuda::launch_gemv_bulk_norm(nin, P(w), y.ptr, m, n, k, cuda::GemmOut::kBF16, cf, sms, st, nx,
                                sg);
  };
  const cuda::GemvSignal ok{counter.ptr, 100, 200};
  EXPECT_NO_THROW(run(1, cfg, ok));
  EXPECT_THROW(run(2, cuda::gemv_bulk_config(2, n, k), ok), ds::Error);  // m 2
  cuda::GemvBulkConfig contiguous = cfg;
  contiguous.interleave = false;
  EXPECT_THROW(run(1, contiguous, ok), ds::Error);
  cuda::GemvBulkConfig full_ring = cfg;  // the counter lives in the last ring barrier word
  full_ring.slots = 32;
  ASSERT_TRUE(cuda::gemv_bulk_fits(1, k, full_ring));
  EXPECT_FALSE(cuda::gemv_bulk_signal_supported(1, full_ring));
  EXPECT_THROW(run(1, full_ring, ok), ds::Error);
  EXPECT_TRUE(cuda::gemv_bulk_signal_supported(1, cfg));
  EXPECT_THROW(run(1, cfg, {counter.ptr, n, 1}), ds::Error);      // first_row past n
  EXPECT_THROW(run(1, cfg, {counter.ptr, -1, 1}), ds::Error);
  EXPECT_THROW(run(1, cfg, {counter.ptr, 0, 0}), ds::Error);      // no rows
  EXPECT_THROW(run(1, cfg, {counter.ptr, 0, n + 1}), ds::Error);  // more rows than n
  EXPECT_THROW(run(1, cfg, ok, {P(wnext), n, k, sms, 4}), ds::Error);  // with the L2 prefetch
  DS_CUDA_CHECK(cudaStreamSynchronize(st));
  cudaStreamDestroy(st);
}

// The own-stage L2 prefetch after the wait (GemvBulkConfig::l2_ahead, session 34): every count
// (0 = the shipped kernels, 1, 8, more stages than a block has) gives the same bits of y, act and
// the residual, for the plain GEMV (gdn_out / attn_o's shape, contiguous and interleaved), the
// fused norm (gdn_in, attn_qkv; with the early-rows signal too), gate_up + SiLU with the norm, at
// m 1 and 2, plain and PDL, and for odd shapes (n below the grid, k 1024); every output is written.
// m 3, fp32 out, a GemvL2Next beside it, the argmax kernel and a negative count are refused.
TEST(CudaGemvBulkNorm, L2AheadChangesNoBit) {
  DS_REQUIRE_GPU();
  struct Ah {
    const char* name;
    int m, n, k;  // n = d_ff for silu
    enum Kind { kPlain, kNorm, kSignal, kSilu } kind;
    bool interleave;
  };
  const Ah cases[] = {
      {"gdn_out plain", 1, 5120, 6144, Ah::kPlain, true},
      {"gdn_out plain contiguous", 1, 5120, 6144, Ah::kPlain, false},
      {"attn_o plain m2", 2, 5120, 6144, Ah::kPlain, true},
      {"gdn_in norm", 1, 16480, 5120, Ah::kNorm, true},
      {"gdn_in norm + early rows", 1, 16480, 5120, Ah::kSignal, true},
      {"attn_qkv norm m2", 2, 14336, 5120, Ah::kNorm, true},
      {"gate_up silu norm", 1, 17408, 5120, Ah::kSilu, true},
      {"gate_up silu norm m2 contiguous", 2, 17408, 5120, Ah::kSilu, false},
      {"odd n 1001 k 1024 norm", 1, 1001, 1024, Ah::kNorm, true},
      {"n 40 below the grid", 1, 40, 5120, Ah::kPlain, true},
  };
  const int sms = n_sms();
  std::mt19937 rng(83);
  cudaStream_t st = nullptr;
  DS_CUDA_CHECK(cudaStreamCreate(&st));
  DevBuf<unsigned> counter(1);
  for (const Ah& c : cases) {
    const bool silu = c.kind == Ah::kSilu;
    const size_t xk = size_t(c.m) * c.k, out_n = size_t(c.m) * c.n;
    DevBuf<bf> w(test::random_bf16(size_t(silu ? 2 : 1) * c.n * c.k, rng, 0.05f));
    DevBuf<bf> x(test::random_bf16(xk, rng, 1.f));
    DevBuf<bf> nw(test::random_bf16(c.k, rng, 0.2f));
    const std::vector<bf> h_res = test::random_bf16(xk, rng, 2.f);
    DevBuf<bf> delta(test::random_bf16(xk, rng, 1.f));
    for (bool pdl : {false, true}) {
      cuda::GemvBulkConfig cfg = silu ? cuda::gemv_bulk_silu_config(c.m, c.n, c.k)
                                      : cuda::gemv_bulk_config(c.m, c.n, c.k);
      cfg.pdl = pdl;
      cfg.interleave = c.interleave;
      const int aheads[] = {0, 1, 8, 4096};
      std::vector<bf> outs[4], resids[4];
      for (int a = 0; a < 4; ++a) {
        cfg.l2_ahead = aheads[a];
        DevBuf<bf> res(h_res), res_out(xk), y(out_n);
        res_out.poison();
        y.poison();
        DS_CUDA_CHECK(cudaMemset(counter.ptr, 0, sizeof(unsigned)));
        const cuda::GemvNormIn nin = norm_input(res, delta, nw, res_out, true, true);
        switch (c.kind) {
          case Ah::kPlain:
            cuda::launch_gemv_bulk(P(x), P(w), y.ptr, c.m, c.n, c.k, cuda::GemmOut::kBF16, false,
                                   cfg, sms, st);
            break;
          case Ah::kNorm:
            cuda::launch_gemv_bulk_norm(nin, P(w), y.ptr, c.m, c.n, c.k, cuda::GemmOut::kBF16,
                                        cfg, sms, st);
            break;
          case Ah::kSignal:
            cuda::launch_gemv_bulk_norm(nin, P(w), y.ptr, c.m, c.n, c.k, cuda::GemmOut::kBF16,
                                        cfg, sms, st, {},
                                        {counter.ptr, 10240 + 6144, 96 + 10240});
            break;
          case Ah::kSilu:
            cuda::launch_gemv_bulk_silu_norm(nin, P(w), P(y), c.m, c.n, c.k, cfg, sms, st);
            break;
        }
        DS_CUDA_CHECK(cudaStreamSynchronize(st));
        outs[a] = y.download();
        resids[a] = res_out.download();
        if (c.kind == Ah::kSignal) {
          EXPECT_EQ(counter.download()[0],
                    unsigned(cuda::gemv_bulk_signal_count(1, c.n, c.k, cfg, sms)))
              << c.name << " ahead " << aheads[a];
        }
      }
      size_t nan = 0;
      for (bf v : outs[0]) nan += (v & 0x7f80) == 0x7f80 && (v & 0x7f);
      EXPECT_EQ(nan, 0u) << c.name << ": outputs not written";
      for (int a = 1; a < 4; ++a) {
        size_t differ = 0;
        for (size_t i = 0; i < out_n; ++i) differ += outs[a][i] != outs[0][i];
        EXPECT_EQ(differ, 0u) << c.name << (pdl ? " pdl" : "") << " ahead " << aheads[a]
                              << ": outputs differ";
        if (c.kind != Ah::kPlain) {
          EXPECT_EQ(resids[a], resids[0]) << c.name << " ahead " << aheads[a];
        }
      }
      std::printf("  %-32s%s m=%d n=%d k=%d (%s): ahead 1 / 8 / 4096 bit-identical to 0\n",
                  c.name, pdl ? " pdl" : "", c.m, c.n, c.k, cfg.name().c_str());
    }
  }
  // Refused: what the prefetch is not compiled for.
  const int n = 512, k = 1024;
  DevBuf<bf> w(size_t(2 * n) * k), wnext(size_t(n) * k), x(3 * k), nw(k), res(3 * k);
  DevBuf<float> yf(size_t(3) * 2 * n), logits(2 * n);
  DevBuf<bf> y(size_t(3) * 2 * n);
  DevBuf<int32_t> tok(2);
  DevBuf<unsigned char> ws(cuda::kGemvBulkArgmaxWorkspaceBytes);
  DS_CUDA_CHECK(cudaMemset(ws.ptr, 0, cuda::kGemvBulkArgmaxWorkspaceBytes));
  cuda::GemvNormIn nin;
  nin.residual = P(res);
  nin.weight = P(nw);
  auto ahead = [](cuda::GemvBulkConfig c, int a) {
    c.l2_ahead = a;
    return c;
  };
  const cuda::GemvBulkConfig c1 = cuda::gemv_bulk_config(1, n, k);
  EXPECT_NO_THROW(cuda::launch_gemv_bulk(P(x), P(w), y.ptr, 1, n, k, cuda::GemmOut::kBF16, false,
                                         ahead(c1, 4), sms, st));
  EXPECT_THROW(cuda::launch_gemv_bulk(P(x), P(w), y.ptr, 3, n, k, cuda::GemmOut::kBF16, false,
                                      ahead(cuda::gemv_bulk_config(3, n, k), 4), sms, st),
               ds::Error);  // m 3
  EXPECT_THROW(cuda::launch_gemv_bulk(P(x), P(w), yf.ptr, 1, n, k, cuda::GemmOut::kF32, false,
                                      ahead(c1, 4), sms, st),
               ds::Error);  // fp32 out
  EXPECT_THROW(cuda::launch_gemv_bulk(P(x), P(w), y.ptr, 1, n, k, cuda::GemmOut::kBF16, false,
                                      ahead(c1, -1), sms, st),
               ds::Error);  // negative
  EXPECT_THROW(cuda::launch_gemv_bulk_norm(nin, P(w), y.ptr, 1, n, k, cuda::GemmOut::kBF16,
                                           ahead(c1, 4), sms, st, {P(wnext), n, k, sms, 4}),
               ds::Error);  // beside a later GEMV's prefetch
  EXPECT_THROW(cuda::launch_gemv_bulk_silu_norm(nin, P(w), P(y), 3, n, k,
                                                ahead(cuda::gemv_bulk_silu_config(3, n, k), 4),
                                                sms, st),
               ds::Error);  // silu m 3
  EXPECT_THROW(cuda::launch_gemv_bulk_argmax(P(x), P(w), logits.ptr, tok.ptr, ws.ptr, 1, n, k,
                                             ahead(c1, 4), sms, st),
               ds::Error);  // not compiled in the argmax kernel
  DS_CUDA_CHECK(cudaStreamSynchronize(st));
  cudaStreamDestroy(st);
}

// $DS_GEMV_AHEAD's and $DS_GEMV_TMA_AHEAD's parse (unset: off) and the KiB -> stages
// conversion (host only).
TEST(CudaGemvBulkNorm, L2AheadBudget) {
  struct Var {
    const char* name;
    int (*read)();
    int unset;
  };
  for (const Var& v : {Var{"DS_GEMV_AHEAD", cuda::gemv_ahead_kib_from_env, 0},
                       Var{"DS_GEMV_TMA_AHEAD", cuda::gemv_tma_ahead_kib_from_env, 0}}) {
    unsetenv(v.name);
    EXPECT_EQ(v.read(), v.unset) << v.name;
    for (const char* ok : {"0", "80", "512"}) {
      setenv(v.name, ok, 1);
      EXPECT_EQ(v.read(), std::atoi(ok)) << v.name;
    }
    for (const char* bad : {"-1", "513", "8k", "x", " 8"}) {
      setenv(v.name, bad, 1);
      try {
        v.read();
        ADD_FAILURE() << v.name << "=" << bad << " was accepted";
      } catch (const ds::Error& e) {
        EXPECT_NE(std::string(e.what()).find(v.name), std::string::npos) << e.what();
      }
    }
    unsetenv(v.name);
  }
  const cuda::GemvBulkConfig r1{1, 16, false}, r2{2, 8, false};
  EXPECT_EQ(cuda::gemv_bulk_ahead_stages(0, 5120, r1, false), 0);
  EXPECT_EQ(cuda::gemv_bulk_ahead_stages(80, 5120, r1, false), 8);   // 10 KiB stages
  EXPECT_EQ(cuda::gemv_bulk_ahead_stages(80, 5120, r1, true), 4);    // gate + up: 20 KiB
  EXPECT_EQ(cuda::gemv_bulk_ahead_stages(80, 6144, r1, false), 7);   // 12 KiB: rounded up
  EXPECT_EQ(cuda::gemv_bulk_ahead_stages(80, 5120, r2, false), 4);   // two rows a stage
  EXPECT_EQ(cuda::gemv_bulk_ahead_stages(1, 5120, r1, false), 1);    // at least one
}

TEST(CudaGemvBulkNorm, Errors) {
  DS_REQUIRE_GPU();
  const int m = 1, n = 512, k = 1024;
  DevBuf<bf> w(size_t(2 * n) * k), nw(k + 8), res(k + 8), delta(k), out(k + 8), y(2 * n);
  const int sms = n_sms();
  const cuda::GemvBulkConfig cfg = cuda::gemv_bulk_config(m, n, k);
  const cuda::GemvBulkConfig scfg = cuda::gemv_bulk_silu_config(m, n, k);
  cuda::GemvNormIn ok;
  ok.residual = P(res);
  ok.delta = P(delta);
  ok.weight = P(nw);
  ok.residual_out = P(out);
  auto run_k = [&](const cuda::GemvNormIn& nin, int kk) {
    cuda::launch_gemv_bulk_norm(nin, P(w), y.ptr, m, n, kk, cuda::GemmOut::kBF16, cfg, sms,
                                nullptr);
  };
  auto run = [&](const cuda::GemvNormIn& nin) { run_k(nin, k); };
  auto run_silu = [&](const cuda::GemvNormIn& nin) {
    cuda::launch_gemv_bulk_silu_norm(nin, P(w), P(y), m, n, k, scfg, sms, nullptr);
  };
  EXPECT_NO_THROW(run(ok));
  EXPECT_NO_THROW(run_silu(ok));
  DS_CUDA_CHECK(cudaDeviceSynchronize());
  cuda::GemvNormIn bad = ok;
  bad.residual = P(res, 1);  // 2-byte offset
  EXPECT_THROW(run(bad), ds::Error);
  EXPECT_THROW(run_silu(bad), ds::Error);
  bad = ok;
  bad.weight = P(nw, 4);
  EXPECT_THROW(run(bad), ds::Error);
  bad = ok;
  bad.residual_out = P(out, 1);
  EXPECT_THROW(run(bad), ds::Error);
  bad = ok;
  bad.residual_out = P(res);  // aliases the residual it reads
  EXPECT_THROW(run(bad), ds::Error);
  bad.residual_out = P(delta);
  EXPECT_THROW(run_silu(bad), ds::Error);
  bad = ok;
  bad.residual_out = nullptr;  // a delta needs somewhere to put residual + delta
  EXPECT_THROW(run(bad), ds::Error);
  bad = ok;
  bad.weight = nullptr;
  EXPECT_THROW(run(bad), ds::Error);
  bad = ok;
  bad.residual = nullptr;
  EXPECT_THROW(run(bad), ds::Error);
  EXPECT_THROW(run_k(ok, cuda::kGemvNormMaxK + 8), ds::Error);
  // m above kGemvNormMaxM (checked before any launch: the buffers here hold one row)
  EXPECT_THROW(cuda::launch_gemv_bulk_norm(ok, P(w), y.ptr, cuda::kGemvNormMaxM + 1, n, k,
                                           cuda::GemmOut::kBF16, cfg, sms, nullptr),
               ds::Error);
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}

// The engine's question before it fuses (host only): the 27B shapes fit; a config whose GEMV
// shared memory leaves less than the norm's warp sums (d_model 6816 at m 1: 232256 of 232448
// bytes) does not, nor m / k out of range. The engine then runs add_rmsnorm + the GEMV instead
// of throwing from the launch.
TEST(CudaGemvBulkNorm, FitsGuard) {
  const cuda::GemvBulkConfig c27 = cuda::gemv_bulk_config(1, 16480, 5120);
  EXPECT_TRUE(cuda::gemv_bulk_norm_fits(1, 5120, c27));
  EXPECT_TRUE(cuda::gemv_bulk_norm_fits(1, 5120, cuda::gemv_bulk_silu_config(1, 17408, 5120)));
  EXPECT_TRUE(cuda::gemv_bulk_norm_fits(4, 5120, cuda::gemv_bulk_silu_config(4, 17408, 5120)));
  const cuda::GemvBulkConfig full = cuda::gemv_bulk_config(1, 16384, 6816);
  EXPECT_TRUE(cuda::gemv_bulk_fits(1, 6816, full));
  EXPECT_FALSE(cuda::gemv_bulk_norm_fits(1, 6816, full));
  EXPECT_FALSE(cuda::gemv_bulk_norm_fits(cuda::kGemvNormMaxM + 1, 512, {1, 8, false}));
  EXPECT_FALSE(cuda::gemv_bulk_norm_fits(1, cuda::kGemvNormMaxK + 8, {1, 8, false}));
}

}  // namespace
}  // namespace ds
