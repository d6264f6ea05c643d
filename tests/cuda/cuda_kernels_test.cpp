// GPU tests of the small kernels against CPU loops on random inputs, at the 27B widths and odd
// ones, outputs poisoned (NaN) before each run: row gather / embedding (exact), fused add +
// RMSNorm (normalised error < 4e-3, residual exact), SiLU-mul (< 4e-3), q/k norm + RoPE + paged KV
// write (both kernels, 1 and 65 tokens: < 8e-3, v exact, nothing else written), bf16 <-> f32
// (exact), device synthetic weights (bit-identical to the host generator), sampling (greedy
// exact; top-k / top-p / temperature by frequencies; replay).
// DecodeSmallKernelTiming prints the decode-sized launches (rope_kv, add_rmsnorm, silu_mul);
// AddRmsNormFitBitExact checks the prompt-chunk norm build against the first one bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>

#include "cuda/argmax.h"
#include "cuda/kernels.h"
#include "cuda_graph_timer.h"
#include "cuda_test_util.h"
#include "model/weight_table.h"
#include "runtime/backend.h"

namespace ds {
namespace {

using test::DevBuf;
using bf = uint16_t;

TEST(CudaKernels, GatherRowsExact) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(1);
  for (int d : {5120, 64, 37}) {
    const int n_src = 300, n = 65;
    auto src = test::random_bf16(size_t(n_src) * d, rng);
    std::vector<int32_t> idx(n);
    for (auto& i : idx) i = rng() % n_src;
    DevBuf<bf> dsrc(src);
    DevBuf<int32_t> didx(idx);
    DevBuf<bf> out(size_t(n) * d);
    out.poison();
    cuda::launch_gather_rows(dsrc.as<__nv_bfloat16>(), didx.ptr, n, d, out.as<__nv_bfloat16>(), 0);
    auto h = out.download();
    for (int r = 0; r < n; ++r)
      for (int c = 0; c < d; ++c) ASSERT_EQ(h[size_t(r) * d + c], src[size_t(idx[r]) * d + c]) << d;
  }
}

TEST(CudaKernels, AddRmsNorm) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(2);
  for (int d : {5120, 4096, 100, 36}) {
    for (int rows : {1, 63, 65}) {
      for (int with_delta : {0, 1}) {
        auto res = test::random_bf16(size_t(rows) * d, rng, 3.f);
        auto del = test::random_bf16(size_t(rows) * d, rng);
        auto w = test::random_bf16(d, rng, 0.1f);
        DevBuf<bf> dres(res), ddel(del), dw(w), out(size_t(rows) * d);
        out.poison();
        cuda::launch_add_rmsnorm(
            dres.as<__nv_bfloat16>(), with_delta ? ddel.as<__nv_bfloat16>() : nullptr,
            dw.as<__nv_bfloat16>(), rows, d, 1e-6f, 1.f, out.as<__nv_bfloat16>(), 0);
        auto got = test::to_f32(out.download());
        auto got_res = dres.download();
        std::vector<float> ref(got.size());
        for (int r = 0; r < rows; ++r) {
          double ss = 0;
          std::vector<float> x(d);
          for (int c = 0; c < d; ++c) {
            float v = bf16_to_f32(res[size_t(r) * d + c]);
            if (with_delta) v = round_bf16(v + bf16_to_f32(del[size_t(r) * d + c]));
            x[c] = v;
            ss += double(v) * v;
            ASSERT_EQ(got_res[size_t(r) * d + c], f32_to_bf16(v)) << "residual row " << r;
          }
          const float inv = 1.f / std::sqrt(float(ss / d) + 1e-6f);
          for (int c = 0; c < d; ++c)
            ref[size_t(r) * d + c] = x[c] * inv * (1.f + bf16_to_f32(w[c]));
        }
        EXPECT_LT(test::norm_err(got, ref), 4e-3) << "d " << d << " rows " << rows;
      }
    }
  }
}

// The prompt-chunk build of add_rmsnorm (RmsNormKernel::kFit: vectors per thread sized to d) is
// bit-identical to the 8-vector build (kMax8) it replaces at >= kRmsNormFitMinRows rows, output
// and updated residual, with and without delta, at widths that need 1, 2, 3, 4, 5, 6 and 8
// vectors per thread (5 and 6: the fit build falls back to the 8-vector one); then both are timed
// at the 27B prompt chunk (4096 x 5120, inputs rotated past L2).
TEST(CudaKernels, AddRmsNormFitBitExact) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(12);
  for (int d : {5120, 6144, 2048, 4096, 1000, 8192, 10240, 12288, 16384}) {
    for (int rows : {64, 129}) {
      for (int with_delta : {0, 1}) {
        auto res = test::random_bf16(size_t(rows) * d, rng, 3.f);
        auto del = test::random_bf16(size_t(rows) * d, rng);
        auto w = test::random_bf16(d, rng, 0.1f);
        std::vector<bf> outs[2], resids[2];
        int k = 0;
        for (auto which : {cuda::RmsNormKernel::kMax8, cuda::RmsNormKernel::kFit}) {
          DevBuf<bf> dres(res), ddel(del), dw(w), out(size_t(rows) * d);
          out.poison();
          cuda::launch_add_rmsnorm(dres.as<__nv_bfloat16>(),
                                   with_delta ? ddel.as<__nv_bfloat16>() : nullptr,
                                   dw.as<__nv_bfloat16>(), rows, d, 1e-6f, 1.f,
                                   out.as<__nv_bfloat16>(), 0, which);
          outs[k] = out.download();
          resids[k++] = dres.download();
        }
        EXPECT_EQ(outs[0], outs[1]) << "d " << d << " rows " << rows << " delta " << with_delta;
        EXPECT_EQ(resids[0], resids[1]) << "d " << d << " rows " << rows;
      }
    }
  }
  const int T = 4096, d = 5120, rot = 3;  // 3 x 84 MB of rows: past the 60 MB L2
  DevBuf<bf> h(test::random_bf16(size_t(T) * d * rot, rng)),
      dl(test::random_bf16(size_t(T) * d * rot, rng)), w(test::random_bf16(d, rng, 0.1f)),
      o(size_t(T) * d * rot);
  for (int with_delta : {1, 0}) {
    double us[2];
    int k = 0;
    for (auto which : {cuda::RmsNormKernel::kMax8, cuda::RmsNormKernel::kFit})
      us[k++] = test::graph_time_us([&](int i, cudaStream_t st) {
        const size_t off = size_t(i % rot) * T * d;
        cuda::launch_add_rmsnorm(h.as<__nv_bfloat16>() + off,
                                 with_delta ? dl.as<__nv_bfloat16>() + off : nullptr,
                                 w.as<__nv_bfloat16>(), T, d, 1e-6f, 1.f,
                                 o.as<__nv_bfloat16>() + off, st, which);
      });
    const double mb = (with_delta ? 4.0 : 2.0) * T * d * 2 / 1e6;  // bytes read + written
    std::printf(
        "TIMING add_rmsnorm %d x %d %s: max8 %.2f us (%.0f GB/s), fit %.2f us (%.0f GB/s)\n", T,
        d, with_delta ? "with delta" : "no delta (residual folded into the GEMM)", us[0],
        mb / us[0] * 1e3, us[1], mb / us[1] * 1e3);
  }
}

TEST(CudaKernels, SiluMul) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(3);
  for (int d_ff : {17408, 37}) {
    for (int n : {1, 65}) {
      auto gu = test::random_bf16(size_t(n) * 2 * d_ff, rng, 2.f);
      DevBuf<bf> dgu(gu), out(size_t(n) * d_ff);
      out.poison();
      cuda::launch_silu_mul(dgu.as<__nv_bfloat16>(), n, d_ff, out.as<__nv_bfloat16>(), 0);
      auto got = test::to_f32(out.download());
      std::vector<float> ref(got.size());
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < d_ff; ++i) {
          const float g = bf16_to_f32(gu[size_t(t) * 2 * d_ff + i]);
          const float u = bf16_to_f32(gu[size_t(t) * 2 * d_ff + d_ff + i]);
          ref[size_t(t) * d_ff + i] = g / (1.f + std::exp(-g)) * u;
        }
      EXPECT_LT(test::norm_err(got, ref), 4e-3) << d_ff << " x " << n;
    }
  }
}

// CPU reference of launch_qk_norm_rope_kv for one head vector.
std::vector<float> norm_rope_ref(const float* x, const std::vector<bf>& w, int hd, int rot,
                                 float theta, int pos) {
  double ss = 0;
  for (int i = 0; i < hd; ++i) ss += double(x[i]) * x[i];
  const float inv = 1.f / std::sqrt(float(ss / hd) + 1e-6f);
  std::vector<float> y(hd), o(hd);
  for (int i = 0; i < hd; ++i) y[i] = round_bf16(x[i] * inv * (1.f + bf16_to_f32(w[i])));
  o = y;
  const int half = rot / 2;
  for (int i = 0; i < half; ++i) {
    const double f = std::pow(double(theta), -2.0 * i / rot);
    const double a = double(pos) * f;
    o[i] = float(y[i] * std::cos(a) - y[i + half] * std::sin(a));
    o[i + half] = float(y[i + half] * std::cos(a) + y[i] * std::sin(a));
  }
  return o;
}

// Both kernels (warp per head, block per token) where they apply, the default (kAuto) otherwise,
// against the CPU loop; the two kernels' caches agree (v bit-exact) and their q / k within 1e-2.
TEST(CudaKernels, QkNormRopeKvWrite) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(4);
  struct Shape {
    int nh, nkv, hd, rot;
    bool gated;
  };
  using K = cuda::RopeKvKernel;
  for (Shape sh :
       {Shape{24, 4, 256, 64, true}, Shape{16, 2, 128, 32, true}, Shape{8, 2, 64, 16, false},
        Shape{6, 1, 32, 8, true}, Shape{8, 2, 16, 4, false}, Shape{4, 2, 256, 8, true}}) {
    cuda::AttnShape s;
    s.n_heads = sh.nh;
    s.n_kv_heads = sh.nkv;
    s.head_dim = sh.hd;
    s.rotary_dim = sh.rot;
    s.gated = sh.gated;
    s.rope_theta = 1e7f;
    s.eps = 1e-6f;
    s.page_size = 16;
    const bool warp_ok = cuda::qk_norm_rope_kv_warp_supported(s);
    EXPECT_EQ(warp_ok, sh.hd >= 64 && (sh.rot / 2) % (sh.hd / 32) == 0) << "hd " << sh.hd;
    for (int T : {1, 65, 200}) {
      const int n_blocks = 16;
      auto qkv = test::random_bf16(size_t(T) * s.qkv_dim(), rng, 2.f);
      auto qw = test::random_bf16(sh.hd, rng, 0.1f), kw = test::random_bf16(sh.hd, rng, 0.1f);
      std::vector<int32_t> pos(T), slot(T);
      std::vector<int> perm(n_blocks * s.page_size);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int t = 0; t < T; ++t) {
        pos[t] = t == 0 ? (T == 1 ? 32767 : 200000) : int(rng() % 5000);
        slot[t] = t == 7 ? -1 : perm[t];  // token 7 skips the cache
      }
      DevBuf<bf> dqkv(qkv), dqw(qw), dkw(kw);
      DevBuf<int32_t> dpos(pos), dslot(slot);
      const size_t cache_n = size_t(n_blocks) * sh.nkv * s.page_size * sh.hd;
      std::vector<K> kernels = warp_ok
                                   ? std::vector<K>{K::kWarpPerHead, K::kBlockPerToken,
                                                    K::kTokenTable}
                                   : std::vector<K>{K::kAuto};
      if (!warp_ok) {
        DevBuf<bf> q(size_t(T) * sh.nh * sh.hd), kc(cache_n), vc(cache_n);
        for (K bad : {K::kWarpPerHead, K::kTokenTable})
          EXPECT_THROW(cuda::launch_qk_norm_rope_kv(
                           s, dqkv.as<__nv_bfloat16>(), dqw.as<__nv_bfloat16>(),
                           dkw.as<__nv_bfloat16>(), dpos.ptr, dslot.ptr, T, q.as<__nv_bfloat16>(),
                           kc.as<__nv_bfloat16>(), vc.as<__nv_bfloat16>(), 0, bad),
                       Error);
      }
      std::vector<std::vector<float>> qs, ks;
      for (K which : kernels) {
        const char* kname = which == K::kWarpPerHead   ? "warp_per_head"
                            : which == K::kTokenTable ? "token_table"
                                                      : "block_per_token";
        DevBuf<bf> q(size_t(T) * sh.nh * sh.hd), kc(cache_n), vc(cache_n);
        q.poison();
        kc.poison();
        vc.poison();
        cuda::launch_qk_norm_rope_kv(s, dqkv.as<__nv_bfloat16>(), dqw.as<__nv_bfloat16>(),
                                     dkw.as<__nv_bfloat16>(), dpos.ptr, dslot.ptr, T,
                                     q.as<__nv_bfloat16>(), kc.as<__nv_bfloat16>(),
                                     vc.as<__nv_bfloat16>(), 0, which);
        auto hq = test::to_f32(q.download());
        auto hk = kc.download(), hv = vc.download();
        auto fq = test::to_f32(qkv);
        std::vector<float> got_q, ref_q, got_k, ref_k;
        for (int t = 0; t < T; ++t) {
          const float* row = fq.data() + size_t(t) * s.qkv_dim();
          for (int h = 0; h < sh.nh; ++h) {
            auto r = norm_rope_ref(row + h * sh.hd * (sh.gated ? 2 : 1), qw, sh.hd, sh.rot, 1e7f,
                                   pos[t]);
            for (int i = 0; i < sh.hd; ++i) {
              ref_q.push_back(r[i]);
              got_q.push_back(hq[(size_t(t) * sh.nh + h) * sh.hd + i]);
            }
          }
          if (slot[t] < 0) continue;
          const int blk = slot[t] / s.page_size, rr = slot[t] % s.page_size;
          for (int h = 0; h < sh.nkv; ++h) {
            auto r =
                norm_rope_ref(row + s.q_proj_dim() + h * sh.hd, kw, sh.hd, sh.rot, 1e7f, pos[t]);
            const size_t base = ((size_t(blk) * sh.nkv + h) * s.page_size + rr) * sh.hd;
            for (int i = 0; i < sh.hd; ++i) {
              ref_k.push_back(r[i]);
              got_k.push_back(bf16_to_f32(hk[base + i]));
              ASSERT_EQ(hv[base + i],
                        qkv[size_t(t) * s.qkv_dim() + s.q_proj_dim() + s.kv_dim() + h * sh.hd + i])
                  << kname;
            }
          }
        }
        // Every other cache row (token 7's among them) is still NaN: nothing else was written.
        size_t written = 0;
        for (size_t i = 0; i < hk.size(); ++i) written += std::isfinite(bf16_to_f32(hk[i]));
        EXPECT_EQ(written, size_t(T > 7 ? T - 1 : T) * sh.nkv * sh.hd) << kname;
        EXPECT_LT(test::norm_err(got_q, ref_q), 8e-3) << "q, hd " << sh.hd << " " << kname;
        EXPECT_LT(test::norm_err(got_k, ref_k), 8e-3) << "k, hd " << sh.hd << " " << kname;
        qs.push_back(got_q);
        ks.push_back(got_k);
      }
      if (qs.size() == 3) {
        EXPECT_LT(test::norm_err(qs[0], qs[1]), 1e-2) << "q: warp vs block, hd " << sh.hd;
        EXPECT_LT(test::norm_err(ks[0], ks[1]), 1e-2) << "k: warp vs block, hd " << sh.hd;
        // token_table is the warp kernel's arithmetic with the angles from a table: bit-identical.
        EXPECT_TRUE(qs[2] == qs[0]) << "q: token_table vs warp, hd " << sh.hd << " T " << T;
        EXPECT_TRUE(ks[2] == ks[0]) << "k: token_table vs warp, hd " << sh.hd << " T " << T;
      }
    }
  }
}

// Launch-level timings of the decode-sized small kernels (1 and 16 rows), CUDA-graph replays
// (cuda_graph_timer.h), inputs rotated past L2. Prints; asserts nothing.
TEST(CudaKernels, DecodeSmallKernelTiming) {
  DS_REQUIRE_GPU();
  DS_REQUIRE_PERF();
  std::mt19937 rng(9);
  const cuda::AttnShape s = test::attn_shape_27b();
  const int rot = 64;
  for (int T : {1, 16}) {
    const size_t qn = size_t(T) * s.qkv_dim() * rot;
    DevBuf<bf> qkv(test::random_bf16(qn, rng)), qw(test::random_bf16(256, rng, 0.1f)),
        kw(test::random_bf16(256, rng, 0.1f)), q(size_t(T) * s.n_heads * 256 * rot),
        kc(size_t(rot) * 4 * 64 * 256), vc(size_t(rot) * 4 * 64 * 256);
    std::vector<int32_t> pos(size_t(T) * rot), slot(size_t(T) * rot);
    for (size_t i = 0; i < pos.size(); ++i) {
      pos[i] = 4096 + int(i);
      slot[i] = int(i);
    }
    DevBuf<int32_t> dpos(pos), dslot(slot);
    double us[2];
    int k = 0;
    for (auto which : {cuda::RopeKvKernel::kWarpPerHead, cuda::RopeKvKernel::kBlockPerToken})
      us[k++] = test::graph_time_us([&](int i, cudaStream_t st) {
        const int r = i % rot;
        cuda::launch_qk_norm_rope_kv(s, qkv.as<__nv_bfloat16>() + size_t(r) * T * s.qkv_dim(),
                                     qw.as<__nv_bfloat16>(), kw.as<__nv_bfloat16>(),
                                     dpos.ptr + r * T, dslot.ptr + r * T, T,
                                     q.as<__nv_bfloat16>() + size_t(r) * T * s.n_heads * 256,
                                     kc.as<__nv_bfloat16>(), vc.as<__nv_bfloat16>(), st, which);
      });
    std::printf("  rope_kv %2d tokens: warp_per_head %.2f us, block_per_token %.2f us\n", T, us[0],
                us[1]);
    const int d = 5120, dff = 17408;
    DevBuf<bf> h(test::random_bf16(size_t(T) * d * rot, rng)),
        dl(test::random_bf16(size_t(T) * d * rot, rng)), w(test::random_bf16(d, rng, 0.1f)),
        o(size_t(T) * d * rot), gu(test::random_bf16(size_t(T) * 2 * dff * rot, rng)),
        act(size_t(T) * dff * rot);
    const double rms = test::graph_time_us([&](int i, cudaStream_t st) {
      const size_t off = size_t(i % rot) * T * d;
      cuda::launch_add_rmsnorm(h.as<__nv_bfloat16>() + off, dl.as<__nv_bfloat16>() + off,
                               w.as<__nv_bfloat16>(), T, d, 1e-6f, 1.f, o.as<__nv_bfloat16>() + off,
                               st);
    });
    const double silu = test::graph_time_us([&](int i, cudaStream_t st) {
      const size_t r = size_t(i % rot);
      cuda::launch_silu_mul(gu.as<__nv_bfloat16>() + r * T * 2 * dff, T, dff,
                            act.as<__nv_bfloat16>() + r * T * dff, st);
    });
    std::printf("  add_rmsnorm %2d x 5120: %.2f us; silu_mul %2d x 17408: %.2f us\n", T, rms, T,
                silu);
  }
}

// Device argmax (step_greedy's sampler): both kernels (one block per row, and the cluster of 8
// blocks per row for long aligned rows) against the host's greedy_token on random rows of the
// 27B vocab and odd widths: the maximum repeated in several parts of the row (the lowest index
// must win across the cluster's blocks), at the first and the last index, a NaN or +inf in a
// later part, a row of -inf, and a graph launch under PDL behind another kernel.
TEST(CudaKernels, ArgmaxRows) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.f, 3.f);
  for (int V : {248320, 32768, 40000, 151936, 1001, 7}) {
    const int R = 12;
    std::vector<float> h(size_t(R) * V);
    for (auto& v : h) v = nd(rng);
    auto row = [&](int r) { return h.data() + size_t(r) * V; };
    // r 0: random. r 1: the max at several places (ties across parts). r 2: max at index 0 and
    // repeated at the end. r 3: max at the last index. r 4: NaN late. r 5: +inf late. r 6: all
    // -inf. r 7: -inf except one finite value late. r 8..11: random with a tie at part borders.
    for (int j : {V / 3, V / 8 + 1, V / 2, V - 2}) row(1)[j] = 50.f;
    row(2)[0] = 60.f, row(2)[V - 1] = 60.f;
    row(3)[V - 1] = 70.f;
    row(4)[V - 1 - V / 9] = std::numeric_limits<float>::quiet_NaN();
    row(5)[V - 1] = INFINITY;
    std::fill(row(6), row(6) + V, -INFINITY);
    std::fill(row(7), row(7) + V, -INFINITY);
    row(7)[V - 3] = -1e30f;
    for (int r = 8; r < R; ++r) {
      const int a = std::max(0, V / 8 * (r - 7) - 1), b = std::min(V - 1, V / 8 * (r - 7));
      row(r)[b] = 40.f, row(r)[a] = 40.f;
    }
    std::vector<int32_t> want(R);
    for (int r = 0; r < R; ++r) want[r] = greedy_token(std::span<const float>(row(r), V));
    EXPECT_EQ(want[4], -1);
    EXPECT_EQ(want[5], -1);
    EXPECT_EQ(want[6], 0);
    DevBuf<float> dl(h);
    DevBuf<int32_t> out(R);
    for (auto which : {cuda::ArgmaxKernel::kBlock, cuda::ArgmaxKernel::kAuto}) {
      for (bool pdl : {false, true}) {
        DS_CUDA_CHECK(cudaMemset(out.ptr, 0x7F, sizeof(int32_t) * R));  // not -1
        cuda::launch_argmax_rows(dl.ptr, R, V, out.ptr, 0, which, pdl);
        DS_CUDA_CHECK(cudaDeviceSynchronize());
        const auto got = out.download();
        for (int r = 0; r < R; ++r)
          EXPECT_EQ(got[r], want[r]) << "V " << V << " row " << r << " kernel "
                                     << (which == cuda::ArgmaxKernel::kAuto ? "auto" : "block")
                                     << " pdl " << pdl;
      }
    }
    EXPECT_EQ(cuda::argmax_cluster_applies(dl.ptr, R, V), V % 4 == 0 && V >= 32768) << V;
    // Unaligned rows take the block kernel.
    EXPECT_FALSE(cuda::argmax_cluster_applies(dl.ptr + 1, R, V));
    if (V < 32768) continue;
    // In a CUDA graph, under PDL behind a kernel that writes the logits (a row gather of their
    // bytes, as bf16 pairs, into a NaN-poisoned buffer: the argmax must see its result).
    DevBuf<float> src(h), dst(h.size());
    dst.poison();
    std::vector<int32_t> ident(R);
    std::iota(ident.begin(), ident.end(), 0);
    DevBuf<int32_t> didx(ident);
    cudaStream_t st;
    DS_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    DS_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    cuda::launch_gather_rows(reinterpret_cast<const __nv_bfloat16*>(src.ptr), didx.ptr, R, 2 * V,
                             reinterpret_cast<__nv_bfloat16*>(dst.ptr), st);
    cuda::launch_argmax_rows(dst.ptr, R, V, out.ptr, st, cuda::ArgmaxKernel::kAuto, true);
    DS_CUDA_CHECK(cudaStreamEndCapture(st, &g));
    DS_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    DS_CUDA_CHECK(cudaMemset(out.ptr, 0x7F, sizeof(int32_t) * R));  // not -1
    DS_CUDA_CHECK(cudaGraphLaunch(ge, st));
    DS_CUDA_CHECK(cudaStreamSynchronize(st));
    EXPECT_EQ(out.download(), want) << "graph V " << V;
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(st);
  }
}

TEST(CudaKernels, Bf16F32ConvertExact) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(5);
  std::vector<float> f(100003);
  std::normal_distribution<float> nd(0.f, 100.f);
  for (auto& x : f) x = nd(rng);
  f[0] = INFINITY;
  f[1] = -0.f;
  f[2] = 1e-40f;
  DevBuf<float> df(f), back(f.size());
  DevBuf<bf> b(f.size());
  b.poison();
  back.poison();
  cuda::launch_f32_to_bf16(df.ptr, f.size(), b.as<__nv_bfloat16>(), 0);
  cuda::launch_bf16_to_f32(b.as<__nv_bfloat16>(), f.size(), back.ptr, 0);
  auto hb = b.download();
  auto hf = back.download();
  for (size_t i = 0; i < f.size(); ++i) {
    ASSERT_EQ(hb[i], f32_to_bf16(f[i])) << i;
    const float e = bf16_to_f32(hb[i]);
    ASSERT_EQ(std::memcmp(&hf[i], &e, 4), 0) << i;
  }
}

TEST(CudaKernels, SyntheticWeightsMatchHostGenerator) {
  DS_REQUIRE_GPU();
  ModelConfig c = tiny_model_config();
  for (const CheckpointTensor& t : checkpoint_tensors(c)) {
    const SyntheticSpec spec = synthetic_tensor_spec(c, t.name, 1234);
    if (spec.kind != SyntheticKind::kNormal) continue;
    const int64_t n = std::min<int64_t>(t.numel(), 1 << 20);
    DevBuf<bf> out(n);
    out.poison();
    cuda::launch_fill_synthetic_normal_bf16(out.as<__nv_bfloat16>(), n, spec.seed, spec.mean,
                                            spec.std, 0);
    auto h = out.download();
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(h[i], f32_to_bf16(synthetic_value(spec, uint64_t(i))))
          << t.name << " element " << i;
  }
}

// ---- sampling ----
std::vector<int32_t> run_sample(const std::vector<float>& logits, int rows, int vocab,
                                const std::vector<cuda::SamplingParams>& p) {
  DevBuf<float> dl(logits);
  DevBuf<cuda::SamplingParams> dp(p);
  DevBuf<int32_t> out(rows);
  out.poison();
  cuda::launch_sample(dl.ptr, dp.ptr, rows, vocab, out.ptr, 0);
  return out.download();
}

TEST(CudaSampling, GreedyIsArgmax) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(6);
  const int V = 248320, R = 5;
  std::vector<float> l(size_t(R) * V);
  std::normal_distribution<float> nd(0.f, 3.f);
  for (auto& x : l) x = nd(rng);
  l[size_t(1) * V + 1000] = 50.f;  // ties: lowest index wins
  l[size_t(1) * V + 2000] = 50.f;
  l[size_t(2) * V + V - 1] = 60.f;
  l[size_t(3) * V + 5] = NAN;
  std::vector<cuda::SamplingParams> p(R);
  p[4].temperature = 1.f;
  p[4].top_k = 1;  // top-k 1 is greedy too
  auto got = run_sample(l, R, V, p);
  for (int r = 0; r < R; ++r) {
    int best = -1;
    for (int i = 0; i < V; ++i)
      if (!std::isnan(l[size_t(r) * V + i]) &&
          (best < 0 || l[size_t(r) * V + i] > l[size_t(r) * V + best]))
        best = i;
    EXPECT_EQ(got[r], best) << "row " << r;
  }
  EXPECT_EQ(got[1], 1000);
}

TEST(CudaSampling, TopKTopPTemperatureFrequencies) {
  DS_REQUIRE_GPU();
  const int V = 1000, R = 4000;
  std::vector<float> base(V);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : base) x = nd(rng);
  base[10] = 4.f;
  base[20] = 3.5f;
  base[30] = 3.f;
  base[40] = 2.9f;
  std::vector<float> l;
  for (int r = 0; r < R; ++r) l.insert(l.end(), base.begin(), base.end());
  auto check = [&](float temp, int top_k, float top_p) {
    std::vector<cuda::SamplingParams> p(R);
    for (int r = 0; r < R; ++r) {
      p[r].temperature = temp;
      p[r].top_k = top_k;
      p[r].top_p = top_p;
      p[r].seed = 99;
      p[r].offset = r;
    }
    auto got = run_sample(l, R, V, p);
    // Reference distribution: temperature, top-k, then top-p over the renormalised top-k.
    std::vector<int> order(V);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return base[a] > base[b]; });
    const int k = top_k > 0 ? top_k : V;
    std::vector<double> w(V, 0.0);
    double z = 0;
    for (int i = 0; i < k; ++i)
      z += w[order[i]] = std::exp((base[order[i]] - base[order[0]]) / temp);
    double cum = 0;
    int kept = 0;
    for (int i = 0; i < k; ++i) {
      cum += w[order[i]] / z;
      ++kept;
      if (cum >= top_p) break;
    }
    std::vector<double> ref(V, 0.0);
    double zk = 0;
    for (int i = 0; i < kept; ++i) zk += w[order[i]];
    for (int i = 0; i < kept; ++i) ref[order[i]] = w[order[i]] / zk;
    std::vector<double> freq(V, 0.0);
    for (int r = 0; r < R; ++r) {
      ASSERT_GE(got[r], 0);
      ASSERT_LT(got[r], V);
      ASSERT_GT(ref[got[r]], 0.0) << "sampled a filtered token " << got[r] << " (T " << temp
                                  << ", k " << top_k << ", p " << top_p << ")";
      freq[got[r]] += 1.0 / R;
    }
    // Total variation over the tokens of reference mass >= 1% (one bucket each) and the rest.
    double tv = 0, rest_f = 0, rest_r = 0;
    for (int i = 0; i < V; ++i) {
      if (ref[i] >= 0.01) {
        tv += std::fabs(freq[i] - ref[i]) / 2;
      } else {
        rest_f += freq[i];
        rest_r += ref[i];
      }
    }
    tv += std::fabs(rest_f - rest_r) / 2;
    EXPECT_LT(tv, 0.05) << "total variation, T " << temp << " k " << top_k << " p " << top_p;
    // Replay: same seeds and offsets, same tokens.
    EXPECT_EQ(run_sample(l, R, V, p), got);
  };
  check(1.f, 0, 1.f);
  check(0.7f, 3, 1.f);
  check(1.f, 0, 0.5f);
  check(1.5f, 50, 0.9f);
}

}  // namespace
}  // namespace ds
