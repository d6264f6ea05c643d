// GPU tests of decode attention (src/cuda/attention_decode.cu): the tensor-core split kernel (mma)
// and the first SIMT kernel (simt) against a double-precision CPU reference over a paged cache with
// shuffled blocks, and against each other. Cache rows past each sequence (and unused blocks) are
// NaN, outputs and the split workspace are poisoned (NaN) before each run, so a kernel that reads
// past a sequence, leaves an output unwritten or merges a partial nobody wrote fails.
// Cases: the 27B shape (24 q / 4 kv heads, head_dim 256, sigmoid gate) at contexts 1, 63, 64, 65,
// 4095, 4097, 20000, 32768 and batches 1 / 3 / 7 / 16; grids much larger than the batch needs
// (n_splits * kv_chunk >> kv_len: most splits empty, as CUDA-graph buckets capture them); chunks
// and page sizes that are not multiples of the 8-key tile (the per-key page lookup path); head_dim
// 128 with GQA groups 1, 5 and 8. Tolerance: normalised L2 error < 1e-2 vs the reference (bf16
// inputs and output, P rounded to bf16 in the mma kernel; errors printed, typically 3e-3), and
// < 1e-2 between the two kernels.
// The mma kernel's folded merge (the last split block of each (sequence, kv head) merges) against
// its two-kernel path: bit-identical outputs on every case above and on the 27B shapes at batch
// 1 / 4 / 16 x 4K..32K (uniform and ragged), and again on a second launch over the same workspace
// (the counters must be back at 0, as CUDA-graph replays need).
// Timing (prints, asserts nothing): mma folded, mma two-kernel and simt at batch 1 / 4 / 16 x
// context 4K / 16K / 32K, KV rotated past L2, CUDA-graph replays (cuda_graph_timer.h), GB/s of KV
// read.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/attention_decode.h"
#include "cuda/kernels.h"
#include "cuda_graph_timer.h"
#include "cuda_test_util.h"

namespace ds {
namespace {

using bf = uint16_t;
using cuda::AttnDecodeKernel;
using cuda::AttnDecodeMerge;
using test::DevBuf;

// One decode batch: sequence i has kv_len[i] cached tokens and one query row (row i).
struct DecodeFixture {
  cuda::AttnShape s;
  std::vector<int32_t> kv_len, q_start, q_len, btab;
  int max_blocks = 0, n_blocks = 0, max_kv = 0;
  std::vector<bf> kc, vc, q, gate;  // gate: [n, n_heads, 2*hd] (gate at +hd, as the projection)

  DecodeFixture(cuda::AttnShape shape, std::vector<int32_t> lens, uint32_t seed)
      : s(shape), kv_len(std::move(lens)) {
    std::mt19937 rng(seed);
    const int n = int(kv_len.size()), ps = s.page_size, hd = s.head_dim, nkv = s.n_kv_heads;
    for (int l : kv_len) {
      max_blocks = std::max(max_blocks, (l + ps - 1) / ps);
      n_blocks += (l + ps - 1) / ps;
      max_kv = std::max(max_kv, l);
    }
    n_blocks += 2;  // unused blocks stay NaN
    std::vector<int> perm(n_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const size_t blk = size_t(nkv) * ps * hd;
    kc.assign(blk * n_blocks, f32_to_bf16(NAN));
    vc = kc;
    btab.assign(size_t(n) * std::max(1, max_blocks), 0);
    int next = 0;
    for (int i = 0; i < n; ++i) {
      q_start.push_back(i);
      q_len.push_back(1);
      for (int b = 0; b < (kv_len[i] + ps - 1) / ps; ++b)
        btab[size_t(i) * max_blocks + b] = perm[next++];
      const auto k = test::random_bf16(size_t(kv_len[i]) * nkv * hd, rng);
      const auto v = test::random_bf16(size_t(kv_len[i]) * nkv * hd, rng);
      for (int t = 0; t < kv_len[i]; ++t)
        for (int h = 0; h < nkv; ++h) {
          const size_t dst = (size_t(btab[size_t(i) * max_blocks + t / ps]) * nkv + h) * ps * hd +
                             size_t(t % ps) * hd;
          std::copy_n(k.begin() + (size_t(t) * nkv + h) * hd, hd, kc.begin() + dst);
          std::copy_n(v.begin() + (size_t(t) * nkv + h) * hd, hd, vc.begin() + dst);
        }
    }
    q = test::random_bf16(size_t(n) * s.n_heads * hd, rng, 1.5f);
    gate = test::random_bf16(size_t(n) * s.n_heads * 2 * hd, rng, 2.f);
  }

  // Reference output of sequence i, head h (double precision, from the paged cache).
  void ref(int i, int h, float* out) const {
    const int hd = s.head_dim, nkv = s.n_kv_heads, ps = s.page_size;
    const int kvh = h / (s.n_heads / nkv);
    const int L = kv_len[i];
    auto row = [&](const std::vector<bf>& c, int t) {
      return c.data() + (size_t(btab[size_t(i) * max_blocks + t / ps]) * nkv + kvh) * ps * hd +
             size_t(t % ps) * hd;
    };
    const bf* qr = q.data() + (size_t(i) * s.n_heads + h) * hd;
    std::vector<double> qd(hd), sc(L), o(hd, 0.0);
    for (int c = 0; c < hd; ++c) qd[c] = bf16_to_f32(qr[c]);
    double mx = -1e300;
    for (int t = 0; t < L; ++t) {
      const bf* kr = row(kc, t);
      double d = 0;
      for (int c = 0; c < hd; ++c) d += qd[c] * bf16_to_f32(kr[c]);
      sc[t] = d / std::sqrt(double(hd));
      mx = std::max(mx, sc[t]);
    }
    double z = 0;
    for (int t = 0; t < L; ++t) {
      const double p = std::exp(sc[t] - mx);
      z += p;
      const bf* vr = row(vc, t);
      for (int c = 0; c < hd; ++c) o[c] += p * bf16_to_f32(vr[c]);
    }
    for (int c = 0; c < hd; ++c) {
      const double gt = bf16_to_f32(gate[(size_t(i) * s.n_heads + h) * 2 * hd + hd + c]);
      out[c] = L > 0 ? float(o[c] / z / (1.0 + std::exp(-gt))) : 0.f;
    }
  }

  std::vector<float> ref_all() const {
    const int hd = s.head_dim;
    std::vector<float> r(size_t(kv_len.size()) * s.n_heads * hd);
    for (size_t i = 0; i < kv_len.size(); ++i)
      for (int h = 0; h < s.n_heads; ++h) ref(int(i), h, r.data() + (i * s.n_heads + h) * hd);
    return r;
  }

  // Runs one kernel; kv_chunk / n_splits 0: the engine's plan (132 SMs, at most 64 splits).
  // repeats > 1: launches again on the same workspace (output poisoned before each launch).
  std::vector<float> run(AttnDecodeKernel which, int kv_chunk = 0, int n_splits = 0,
                         AttnDecodeMerge merge = AttnDecodeMerge::kDefault,
                         int repeats = 1) const {
    DevBuf<bf> dq(q), dk(kc), dv(vc), dg(gate), out(q.size());
    DevBuf<int32_t> qs(q_start), ql(q_len), kl(kv_len), bt(btab);
    cuda::AttnBatch b;
    b.n_seqs = int(kv_len.size());
    b.q_start = qs.ptr;
    b.q_len = ql.ptr;
    b.kv_len = kl.ptr;
    b.block_table = bt.ptr;
    b.block_table_stride = std::max(1, max_blocks);
    b.max_q_len = 1;
    b.max_kv_len = max_kv;
    if (kv_chunk == 0) {
      kv_chunk = cuda::attention_decode_kv_chunk(b.n_seqs, s.n_kv_heads, max_kv, 132, 64);
      n_splits = std::max(1, (max_kv + kv_chunk - 1) / kv_chunk);
    }
    DevBuf<char> ws(cuda::attention_decode_workspace_bytes(s, b.n_seqs, n_splits));
    ws.poison();
    cuda::attention_decode_workspace_init(ws.ptr, 0);
    cuda::AttnGate g;
    g.ptr = dg.as<__nv_bfloat16>() + s.head_dim;
    g.token_stride = int64_t(s.n_heads) * 2 * s.head_dim;
    g.head_stride = 2 * s.head_dim;
    for (int r = 0; r < repeats; ++r) {
      out.poison();
      cuda::launch_attention_decode(s, b, dq.as<__nv_bfloat16>(), dk.as<__nv_bfloat16>(),
                                    dv.as<__nv_bfloat16>(), g, kv_chunk, n_splits, ws.ptr,
                                    out.as<__nv_bfloat16>(), 0, which, merge);
    }
    DS_CUDA_CHECK(cudaGetLastError());
    return test::to_f32(out.download());
  }
};

const char* name_of(AttnDecodeKernel k) { return k == AttnDecodeKernel::kMma ? "mma" : "simt"; }

// Elements of a and b that differ bitwise (outputs are bf16, widened exactly to float).
size_t n_differ(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

// The mma kernel with its merge folded (launched twice on one workspace) vs its two-kernel path.
void check_fold_exact(const DecodeFixture& f, const std::string& what, int kv_chunk = 0,
                      int n_splits = 0) {
  const auto two = f.run(AttnDecodeKernel::kMma, kv_chunk, n_splits, AttnDecodeMerge::kSplitMerge);
  const auto fold = f.run(AttnDecodeKernel::kMma, kv_chunk, n_splits, AttnDecodeMerge::kFold, 2);
  for (size_t j = 0; j < fold.size(); ++j)
    ASSERT_TRUE(std::isfinite(fold[j])) << what << " [fold]: element " << j << " not written";
  EXPECT_EQ(n_differ(fold, two), 0u) << what << ": folded merge vs two kernels";
  std::printf("  %s: fold vs two-kernel merge: %zu of %zu elements differ\n", what.c_str(),
              n_differ(fold, two), fold.size());
}

// Both kernels vs the reference and vs each other; the mma kernel's fold vs its two kernels.
void check_both(const DecodeFixture& f, const std::string& what, int kv_chunk = 0,
                int n_splits = 0) {
  check_fold_exact(f, what, kv_chunk, n_splits);
  const auto ref = f.ref_all();
  std::vector<float> outs[2];
  int i = 0;
  for (auto k : {AttnDecodeKernel::kMma, AttnDecodeKernel::kSimt}) {
    auto& got = outs[i++];
    got = f.run(k, kv_chunk, n_splits);
    for (size_t j = 0; j < got.size(); ++j)
      ASSERT_TRUE(std::isfinite(got[j]))
          << what << " [" << name_of(k) << "]: element " << j << " not written / not finite";
    const double e = test::norm_err(got, ref);
    EXPECT_LT(e, 1e-2) << what << " [" << name_of(k) << "]";
    std::printf("  %s [%s]: normalised error %.2e\n", what.c_str(), name_of(k), e);
  }
  const double e = test::norm_err(outs[0], outs[1]);
  EXPECT_LT(e, 1e-2) << what << ": mma vs simt";
  std::printf("  %s: mma vs simt %.2e\n", what.c_str(), e);
}

TEST(CudaAttentionDecode, Contexts27b) {
  DS_REQUIRE_GPU();
  DecodeFixture f(test::attn_shape_27b(), {1, 63, 64, 65, 4095, 4097, 20000}, 21);
  check_both(f, "27b batch 7, kv 1..20000");
  DecodeFixture one(test::attn_shape_27b(), {32768}, 22);
  check_both(one, "27b batch 1, kv 32768");
}

TEST(CudaAttentionDecode, Batches27b) {
  DS_REQUIRE_GPU();
  DecodeFixture b1(test::attn_shape_27b(), {4097}, 31);
  check_both(b1, "27b batch 1, kv 4097");
  DecodeFixture b3(test::attn_shape_27b(), {65, 1, 4097}, 32);
  check_both(b3, "27b batch 3, kv 65/1/4097");
  std::vector<int32_t> lens;
  std::mt19937 rng(5);
  for (int i = 0; i < 16; ++i)
    lens.push_back(i < 4 ? std::vector<int>{1, 63, 64, 65}[i] : 1 + int(rng() % 3000));
  DecodeFixture b16(test::attn_shape_27b(), lens, 33);
  check_both(b16, "27b batch 16, kv 1..3000");
}

TEST(CudaAttentionDecode, OversizedAndOddGrids) {
  DS_REQUIRE_GPU();
  // 64 splits of 512 keys for sequences of at most 300: most splits (and whole blocks) are empty.
  DecodeFixture f(test::attn_shape_27b(), {1, 65, 300}, 41);
  check_both(f, "27b 64 x 512-key splits over kv <= 300", 512, 64);
  // One split covering everything, and a chunk that is not a multiple of the 8-key tile.
  check_both(f, "27b one split of 4096", 4096, 1);
  check_both(f, "27b chunk 20 (tiles cross splits' ends)", 20, 15);
  // Page sizes that are not multiples of 8 (a tile crosses pages) and a small one.
  for (int ps : {24, 16, 8}) {
    cuda::AttnShape s = test::attn_shape_27b();
    s.page_size = ps;
    DecodeFixture g(s, {1, 63, 64, 65, 777}, 50 + ps);
    check_both(g, "27b page " + std::to_string(ps));
  }
}

TEST(CudaAttentionDecode, HeadDim128Groups) {
  DS_REQUIRE_GPU();
  for (auto [nh, nkv] : {std::pair{16, 2}, std::pair{4, 4}, std::pair{10, 2}}) {
    cuda::AttnShape s = test::attn_shape_27b();
    s.n_heads = nh;
    s.n_kv_heads = nkv;
    s.head_dim = 128;
    s.rotary_dim = 32;
    s.page_size = 16;
    DecodeFixture f(s, {1, 100, 1000, 4097}, 60 + nh);
    check_both(f, "hd 128 group " + std::to_string(nh / nkv));
  }
}

// The 27B shapes of the engine's decode plan: batch 1 / 4 / 16 at 4K..32K, uniform and ragged.
TEST(CudaAttentionDecode, FoldBitExact27b) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(77);
  for (int batch : {1, 4, 16})
    for (int ctx : {4096, 16384, 32768}) {
      if (batch == 16 && ctx == 32768) continue;  // host reference data: keep the test quick
      std::vector<int32_t> uni(batch, ctx), rag(batch);
      for (int i = 0; i < batch; ++i) rag[i] = 1 + int(rng() % ctx);
      rag[0] = ctx;
      DecodeFixture fu(test::attn_shape_27b(), uni, 80 + batch);
      check_fold_exact(fu, "27b batch " + std::to_string(batch) + " x " + std::to_string(ctx));
      if (batch > 1) {
        DecodeFixture fr(test::attn_shape_27b(), rag, 90 + batch);
        check_fold_exact(fr, "27b ragged batch " + std::to_string(batch) + " up to " +
                                 std::to_string(ctx));
      }
    }
  // The engine's graph buckets: up to 128 splits (the workspace plan), most of them empty.
  DecodeFixture f(test::attn_shape_27b(), {4096, 100}, 99);
  check_fold_exact(f, "27b 128 splits of 64 over kv 4096 / 100", 64, 128);
}

TEST(CudaAttentionDecode, UnsupportedShapes) {
  DS_REQUIRE_GPU();
  cuda::AttnShape s = test::attn_shape_27b();
  s.head_dim = 64;
  s.n_heads = 8;
  s.n_kv_heads = 8;
  s.rotary_dim = 16;
  s.page_size = 16;
  EXPECT_FALSE(cuda::attention_decode_mma_supported(s));
  EXPECT_TRUE(cuda::attention_decode_mma_supported(test::attn_shape_27b()));
  DecodeFixture f(s, {5, 40}, 70);
  EXPECT_THROW(f.run(AttnDecodeKernel::kMma), Error);
  // kAuto falls back to the simt kernel.
  const auto got = f.run(AttnDecodeKernel::kAuto);
  EXPECT_LT(test::norm_err(got, f.ref_all()), 1e-2);
}

// Per-launch time in a CUDA graph of 20 launches (median of replays), KV rotated over up to 8
// block tables (more than 3x L2 at every size).
TEST(CudaAttentionDecode, Timing) {
  DS_REQUIRE_GPU();
  const cuda::AttnShape s = test::attn_shape_27b();
  const int hd = s.head_dim, nkv = s.n_kv_heads, ps = s.page_size;
  int dev = 0;
  cudaDeviceProp prop{};
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  DS_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  const int n_sms = prop.multiProcessorCount;
  // One pool of 600 MB of pages (random bf16), shared by every case.
  const int64_t page_elems = int64_t(nkv) * ps * hd;
  const int64_t pool_blocks = (600ll << 20) / (page_elems * 2 * 2);
  DevBuf<bf> kc(size_t(pool_blocks * page_elems)), vc(size_t(pool_blocks * page_elems));
  {
    std::mt19937 rng(1);
    auto host = test::random_bf16(size_t(page_elems) * 64, rng);
    for (int64_t b0 = 0; b0 < pool_blocks; b0 += 64) {
      const int64_t nb = std::min<int64_t>(64, pool_blocks - b0);
      DS_CUDA_CHECK(cudaMemcpy(kc.ptr + b0 * page_elems, host.data(), nb * page_elems * 2,
                               cudaMemcpyHostToDevice));
      DS_CUDA_CHECK(cudaMemcpy(vc.ptr + b0 * page_elems, host.data(), nb * page_elems * 2,
                               cudaMemcpyHostToDevice));
    }
  }
  std::mt19937 rng(2);
  std::printf("  %-8s %-7s %10s %9s %10s %9s %8s\n", "batch", "context", "mma us", "mma GB/s",
              "simt us", "simt GB/s", "speedup");
  for (int batch : {1, 4, 16})
    for (int ctx : {4096, 16384, 32768}) {
      const int bps = (ctx + ps - 1) / ps;
      const double kv_bytes = 2.0 * batch * ctx * nkv * hd * 2;
      const int rot =
          int(std::min<int64_t>(8, std::max<int64_t>(1, pool_blocks / (int64_t(batch) * bps))));
      std::vector<int32_t> table(size_t(rot) * batch * bps);
      std::vector<int32_t> all(pool_blocks);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      for (size_t i = 0; i < table.size(); ++i) table[i] = all[i % pool_blocks];
      std::vector<int32_t> qs(batch), ql(batch, 1), kl(batch, ctx);
      std::iota(qs.begin(), qs.end(), 0);
      DevBuf<int32_t> d_t(table), d_qs(qs), d_ql(ql), d_kl(kl);
      auto qh = test::random_bf16(size_t(batch) * s.n_heads * hd, rng);
      DevBuf<bf> q(qh), out(qh.size());
      const int chunk = cuda::attention_decode_kv_chunk(batch, nkv, ctx, n_sms, 64);
      const int splits = (ctx + chunk - 1) / chunk;
      DevBuf<char> ws(cuda::attention_decode_workspace_bytes(s, batch, splits));
      cuda::attention_decode_workspace_init(ws.ptr, 0);
      DS_CUDA_CHECK(cudaDeviceSynchronize());
      auto launch = [&](AttnDecodeKernel k, AttnDecodeMerge m, int i, cudaStream_t st) {
        cuda::AttnBatch b;
        b.n_seqs = batch;
        b.q_start = d_qs.ptr;
        b.q_len = d_ql.ptr;
        b.kv_len = d_kl.ptr;
        b.block_table = d_t.ptr + int64_t(i % rot) * batch * bps;
        b.block_table_stride = bps;
        b.max_q_len = 1;
        b.max_kv_len = ctx;
        cuda::launch_attention_decode(s, b, q.as<__nv_bfloat16>(), kc.as<__nv_bfloat16>(),
                                      vc.as<__nv_bfloat16>(), cuda::AttnGate{}, chunk, splits,
                                      ws.ptr, out.as<__nv_bfloat16>(), st, k, m);
      };
      const double fold_us = test::graph_time_us([&](int i, cudaStream_t st) {
        launch(AttnDecodeKernel::kMma, AttnDecodeMerge::kFold, i, st);
      });
      double us[2];
      int ki = 0;
      for (auto k : {AttnDecodeKernel::kMma, AttnDecodeKernel::kSimt})
        us[ki++] = test::graph_time_us(
            [&](int i, cudaStream_t st) { launch(k, AttnDecodeMerge::kSplitMerge, i, st); });
      std::printf(
          "  %-8d %-7d %10.1f %9.0f %10.1f %9.0f %7.2fx   (chunk %d, %d splits; mma folded merge "
          "%.1f us, %.0f GB/s)\n",
          batch, ctx, us[0], kv_bytes / us[0] * 1e-3, us[1], kv_bytes / us[1] * 1e-3,
          us[1] / us[0], chunk, splits, fold_us, kv_bytes / fold_us * 1e-3);
    }
}

}  // namespace
}  // namespace ds
