// GPU tests of decode attention (src/cuda/attention_decode.cu): the tensor-core split kernel (mma)
// with the host's planned splits and with the adaptive per-sequence splits (AttnDecodeSplit), and
// the first SIMT kernel (simt), against a double-precision CPU reference over a paged cache with
// shuffled blocks, and against each other. Cache rows past each sequence (and unused blocks) are
// NaN, outputs and the split workspace are poisoned (NaN) before each run, so a kernel that reads
// past a sequence, leaves an output unwritten or merges a partial nobody wrote fails.
// Cases: the 27B shape (24 q / 4 kv heads, head_dim 256, sigmoid gate) at contexts 1, 63, 64, 65,
// 4095, 4097, 20000, 32768 and batches 1 / 3 / 7 / 16; grids much larger than the batch needs
// (n_splits * kv_chunk >> kv_len: most splits empty, as CUDA-graph buckets capture them); chunks
// and page sizes that are not multiples of the 8-key tile (the per-key page lookup path); head_dim
// 128 with GQA groups 1, 5 and 8. Tolerance: normalised L2 error < 1e-2 vs the reference (bf16
// inputs and output, P rounded to bf16 in the mma kernel; errors printed, typically 3e-3), and
// < 1e-2 between the kernels.
// PDL (PdlAfterRope27b): rope_kv writes q and each sequence's newest K/V row (both poisoned before)
// and the adaptive kernel runs as its programmatic dependent, eagerly and captured in a CUDA graph,
// at batch 1 / 4 / 16 x 4K..32K (uniform and ragged): bit-identical to the same kernels launched
// without PDL, and within 1e-2 of the planned path.
// Timing (prints, asserts nothing): rope_kv + attention decode per launch in a CUDA graph (KV
// rotated past L2), planned vs adaptive vs adaptive under PDL, at batch 1 / 4 / 16 x 4096, 4160,
// 16384, 32768, 32832 (4160 and 32832: just past a bucket, the engine's usual case).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
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

  cuda::AttnBatch batch(const DevBuf<int32_t>& qs, const DevBuf<int32_t>& ql,
                        const DevBuf<int32_t>& kl, const DevBuf<int32_t>& bt) const {
    cuda::AttnBatch b;
    b.n_seqs = int(kv_len.size());
    b.q_start = qs.ptr;
    b.q_len = ql.ptr;
    b.kv_len = kl.ptr;
    b.block_table = bt.ptr;
    b.block_table_stride = std::max(1, max_blocks);
    b.max_q_len = 1;
    b.max_kv_len = max_kv;
    return b;
  }

  cuda::AttnGate gate_of(const DevBuf<bf>& dg) const {
    cuda::AttnGate g;
    g.ptr = dg.as<__nv_bfloat16>() + s.head_dim;
    g.token_stride = int64_t(s.n_heads) * 2 * s.head_dim;
    g.head_stride = 2 * s.head_dim;
    return g;
  }

  // Runs one configuration; kv_chunk / n_splits 0: the engine's plan (132 SMs, at most 64
  // splits; for kAdaptive: splits of >= 64 keys, one wave). repeats > 1: launches again on the
  // same workspace (output poisoned before each launch).
  std::vector<float> run(cuda::AttnDecodeLaunch how, int kv_chunk = 0, int n_splits = 0,
                         int repeats = 1) const {
    DevBuf<bf> dq(q), dk(kc), dv(vc), dg(gate), out(q.size());
    DevBuf<int32_t> qs(q_start), ql(q_len), kl(kv_len), bt(btab);
    const cuda::AttnBatch b = batch(qs, ql, kl, bt);
    if (kv_chunk == 0) plan(how.split, &kv_chunk, &n_splits);
    if (how.cluster) n_splits = cuda::kAttnDecodeClusterSplits;  // the cluster's blocks
    DevBuf<char> ws(cuda::attention_decode_workspace_bytes(s, b.n_seqs, n_splits));
    ws.poison();
    for (int r = 0; r < repeats; ++r) {
      out.poison();
      cuda::launch_attention_decode(s, b, dq.as<__nv_bfloat16>(), dk.as<__nv_bfloat16>(),
                                    dv.as<__nv_bfloat16>(), gate_of(dg), kv_chunk, n_splits,
                                    ws.ptr, out.as<__nv_bfloat16>(), 0, how);
    }
    DS_CUDA_CHECK(cudaGetLastError());
    return test::to_f32(out.download());
  }

  void plan(cuda::AttnDecodeSplit split, int* kv_chunk, int* n_splits) const {
    const int n = int(kv_len.size());
    if (split == cuda::AttnDecodeSplit::kAdaptive) {
      *kv_chunk = 64;
      *n_splits = cuda::attention_decode_adaptive_splits(n, s.n_kv_heads, 132, 64);
      return;
    }
    *kv_chunk = cuda::attention_decode_kv_chunk(n, s.n_kv_heads, max_kv, 132, 64);
    *n_splits = std::max(1, (max_kv + *kv_chunk - 1) / *kv_chunk);
  }
};

cuda::AttnDecodeLaunch launch_of(AttnDecodeKernel k,
                                 cuda::AttnDecodeSplit sp = cuda::AttnDecodeSplit::kPlanned,
                                 bool pdl = false, bool cluster = false) {
  cuda::AttnDecodeLaunch how;
  how.which = k;
  how.split = sp;
  how.pdl = pdl;
  how.cluster = cluster;
  return how;
}

// Elements of a and b that differ bitwise (outputs are bf16, widened exactly to float).
size_t n_differ(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

// mma planned, mma adaptive (engine plan, or kv_chunk as its smallest split and n_splits as its
// most splits), mma cluster (16 splits of >= kv_chunk keys merged in distributed shared memory),
// simt planned: each vs the reference, each vs mma planned.
void check_all(const DecodeFixture& f, const std::string& what, int kv_chunk = 0,
               int n_splits = 0) {
  const auto ref = f.ref_all();
  struct Cfg {
    const char* name;
    cuda::AttnDecodeLaunch how;
  };
  const Cfg cfgs[] = {
      {"mma planned", launch_of(AttnDecodeKernel::kMma)},
      {"mma adaptive", launch_of(AttnDecodeKernel::kMma, cuda::AttnDecodeSplit::kAdaptive)},
      {"mma cluster", launch_of(AttnDecodeKernel::kMma, cuda::AttnDecodeSplit::kAdaptive, false,
                                true)},
      {"simt planned", launch_of(AttnDecodeKernel::kSimt)},
  };
  std::vector<float> first;
  for (const Cfg& c : cfgs) {
    const auto got = f.run(c.how, kv_chunk, n_splits, 2);
    for (size_t j = 0; j < got.size(); ++j)
      ASSERT_TRUE(std::isfinite(got[j]))
          << what << " [" << c.name << "]: element " << j << " not written / not finite";
    const double e = test::norm_err(got, ref);
    EXPECT_LT(e, 1e-2) << what << " [" << c.name << "]";
    double vs = 0;
    if (first.empty())
      first = got;
    else
      vs = test::norm_err(got, first);
    EXPECT_LT(vs, 1e-2) << what << ": " << c.name << " vs mma planned";
    std::printf("  %s [%s]: normalised error %.2e, vs mma planned %.2e\n", what.c_str(), c.name,
                e, vs);
  }
}

TEST(CudaAttentionDecode, Contexts27b) {
  DS_REQUIRE_GPU();
  DecodeFixture f(test::attn_shape_27b(), {1, 63, 64, 65, 4095, 4097, 20000}, 21);
  check_all(f, "27b batch 7, kv 1..20000");
  DecodeFixture one(test::attn_shape_27b(), {32768}, 22);
  check_all(one, "27b batch 1, kv 32768");
}

TEST(CudaAttentionDecode, Batches27b) {
  DS_REQUIRE_GPU();
  DecodeFixture b1(test::attn_shape_27b(), {4097}, 31);
  check_all(b1, "27b batch 1, kv 4097");
  DecodeFixture b3(test::attn_shape_27b(), {65, 1, 4097}, 32);
  check_all(b3, "27b batch 3, kv 65/1/4097");
  std::vector<int32_t> lens;
  std::mt19937 rng(5);
  for (int i = 0; i < 16; ++i)
    lens.push_back(i < 4 ? std::vector<int>{1, 63, 64, 65}[i] : 1 + int(rng() % 3000));
  DecodeFixture b16(test::attn_shape_27b(), lens, 33);
  check_all(b16, "27b batch 16, kv 1..3000");
}

TEST(CudaAttentionDecode, OversizedAndOddGrids) {
  DS_REQUIRE_GPU();
  // 64 splits of 512 keys for sequences of at most 300: most splits (and whole blocks) are empty.
  DecodeFixture f(test::attn_shape_27b(), {1, 65, 300}, 41);
  check_all(f, "27b 64 x 512-key splits over kv <= 300", 512, 64);
  // One split covering everything, and a chunk that is not a multiple of the 8-key tile.
  check_all(f, "27b one split of 4096", 4096, 1);
  check_all(f, "27b chunk 20 (tiles cross splits' ends)", 20, 15);
  // Page sizes that are not multiples of 8 (a tile crosses pages) and a small one.
  for (int ps : {24, 16, 8}) {
    cuda::AttnShape s = test::attn_shape_27b();
    s.page_size = ps;
    DecodeFixture g(s, {1, 63, 64, 65, 777}, 50 + ps);
    check_all(g, "27b page " + std::to_string(ps));
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
    check_all(f, "hd 128 group " + std::to_string(nh / nkv));
  }
}

// rope_kv (writing q and each sequence's newest K/V row from a projection row, as the engine
// does) followed by the decode attention on one stream, eagerly or captured in a CUDA graph. q and
// the newest rows are poisoned first, so an attention kernel that reads them before rope_kv has
// written them gives NaN. fused: no rope_kv launch, the split kernel does its work
// (AttnDecodeLaunch::rope; q stays poisoned and unused). caches: the K and V caches after the run.
std::vector<float> run_after_rope(const DecodeFixture& f, cuda::AttnDecodeLaunch how, bool graph,
                                  bool fused = false, std::vector<bf>* caches = nullptr) {
  const cuda::AttnShape& s = f.s;
  const int n = int(f.kv_len.size()), hd = s.head_dim, ps = s.page_size, nkv = s.n_kv_heads;
  std::mt19937 rng(1234);
  const auto qkv = test::random_bf16(size_t(n) * s.qkv_dim(), rng, 2.f);
  const auto qnw = test::random_bf16(size_t(hd), rng, 0.5f);
  const auto knw = test::random_bf16(size_t(hd), rng, 0.5f);
  std::vector<int32_t> pos(n), slot(n);
  std::vector<bf> kc = f.kc, vc = f.vc;
  for (int i = 0; i < n; ++i) {
    pos[i] = f.kv_len[i] - 1;
    slot[i] = f.btab[size_t(i) * f.max_blocks + pos[i] / ps] * ps + pos[i] % ps;
    for (int h = 0; h < nkv; ++h) {  // the newest row: rope_kv must write it
      const size_t row = (size_t(slot[i] / ps) * nkv + h) * ps * hd + size_t(slot[i] % ps) * hd;
      std::fill_n(kc.begin() + row, hd, f32_to_bf16(NAN));
      std::fill_n(vc.begin() + row, hd, f32_to_bf16(NAN));
    }
  }
  DevBuf<bf> d_qkv(qkv), d_qn(qnw), d_kn(knw), dk(kc), dv(vc), dg(f.gate), dq(f.q.size()),
      out(f.q.size());
  DevBuf<int32_t> d_pos(pos), d_slot(slot), qs(f.q_start), ql(f.q_len), kl(f.kv_len), bt(f.btab);
  dq.poison();
  out.poison();
  int kv_chunk = 0, n_splits = 0;
  f.plan(how.split, &kv_chunk, &n_splits);
  if (how.cluster) n_splits = cuda::kAttnDecodeClusterSplits;
  DevBuf<char> ws(cuda::attention_decode_workspace_bytes(s, n, n_splits));
  ws.poison();
  const cuda::AttnBatch b = f.batch(qs, ql, kl, bt);
  cudaStream_t st;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  if (fused)
    how.rope = {d_qkv.as<__nv_bfloat16>(), d_qn.as<__nv_bfloat16>(), d_kn.as<__nv_bfloat16>(),
                d_pos.ptr, d_slot.ptr, dk.as<__nv_bfloat16>(), dv.as<__nv_bfloat16>()};
  auto body = [&] {
    if (!fused)
      cuda::launch_qk_norm_rope_kv(s, d_qkv.as<__nv_bfloat16>(), d_qn.as<__nv_bfloat16>(),
                                   d_kn.as<__nv_bfloat16>(), d_pos.ptr, d_slot.ptr, n,
                                   dq.as<__nv_bfloat16>(), dk.as<__nv_bfloat16>(),
                                   dv.as<__nv_bfloat16>(), st);
    cuda::launch_attention_decode(s, b, fused ? nullptr : dq.as<__nv_bfloat16>(),
                                  dk.as<__nv_bfloat16>(), dv.as<__nv_bfloat16>(), f.gate_of(dg),
                                  kv_chunk, n_splits, ws.ptr, out.as<__nv_bfloat16>(), st, how);
  };
  test::run_once_on(st, graph, body);
  DS_CUDA_CHECK(cudaStreamDestroy(st));
  if (caches) {
    *caches = dk.download();
    const auto v = dv.download();
    caches->insert(caches->end(), v.begin(), v.end());
  }
  return test::to_f32(out.download());
}

// rope_kv's work inside the adaptive split kernel (AttnDecodeLaunch::rope) vs rope_kv + the same
// kernel (the engine's path before it): outputs and both caches (the newest rows above all)
// bit-identical, eager and in a CUDA graph, with and without PDL, at the 27B shape (batch 1 from
// one key to 32K, uniform and ragged batches of 4 and 16, page sizes 64 and 24) and at head_dim 128
// with groups 5 and 8. The newest rows are poisoned first (NaN), so a block that reads its
// newest tile before the row is stored, or a row nobody writes, shows. The cluster form
// (AttnDecodeLaunch::cluster, 16 splits merged in distributed shared memory) against the same
// reference: caches bit-identical, outputs within the decode tolerance (other splits).
TEST(CudaAttentionDecode, FusedRope27b) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(78);
  struct Case {
    cuda::AttnShape s;
    std::vector<int32_t> lens;
    std::string what;
  };
  std::vector<Case> cases;
  for (int L : {1, 2, 63, 64, 65, 4096, 4097, 16384, 32768})
    cases.push_back({test::attn_shape_27b(), {L}, "27b batch 1 x " + std::to_string(L)});
  {
    std::vector<int32_t> r4{32768}, r16;
    for (int i = 1; i < 4; ++i) r4.push_back(1 + int(rng() % 32768));
    for (int i = 0; i < 16; ++i) r16.push_back(i < 4 ? std::vector<int>{1, 63, 64, 65}[i]
                                                     : 1 + int(rng() % 8192));
    cases.push_back({test::attn_shape_27b(), r4, "27b ragged batch 4 up to 32768"});
    cases.push_back({test::attn_shape_27b(), std::vector<int32_t>(16, 4096), "27b batch 16 x 4096"});
    cases.push_back({test::attn_shape_27b(), r16, "27b ragged batch 16 up to 8192"});
    cuda::AttnShape p24 = test::attn_shape_27b();
    p24.page_size = 24;
    cases.push_back({p24, {1, 23, 24, 25, 777, 4100}, "27b page 24, batch 6"});
    for (auto [nh, nkv] : {std::pair{10, 2}, std::pair{16, 2}}) {
      cuda::AttnShape h = test::attn_shape_27b();
      h.n_heads = nh;
      h.n_kv_heads = nkv;
      h.head_dim = 128;
      h.rotary_dim = 32;
      h.page_size = 16;
      cases.push_back({h, {1, 100, 4097}, "hd 128 group " + std::to_string(nh / nkv)});
    }
  }
  const auto adaptive = cuda::AttnDecodeSplit::kAdaptive;
  // $DS_FUSED_ROPE_CASE: run only the cases whose name contains it (to profile one shape).
  const char* only = std::getenv("DS_FUSED_ROPE_CASE");
  int seed = 200;
  for (const Case& c : cases) {
    if (only && *only && c.what.find(only) == std::string::npos) {
      ++seed;
      continue;
    }
    const DecodeFixture f(c.s, c.lens, seed++);
    std::vector<bf> ref_cache;
    const auto ref = run_after_rope(f, launch_of(AttnDecodeKernel::kMma, adaptive, true), false,
                                    false, &ref_cache);
    struct Arm {
      const char* name;
      bool pdl, graph, early, cluster = false, fused = true;
    };
    for (const Arm& a : {Arm{"plain", false, false, false}, Arm{"pdl", true, false, false},
                         Arm{"pdl graph", true, true, false},
                         Arm{"pdl early graph", true, true, true},
                         Arm{"cluster pdl", true, false, false, true},
                         Arm{"cluster pdl graph", true, true, false, true},
                         Arm{"cluster graph", false, true, false, true},
                         Arm{"cluster after rope_kv, pdl", true, false, false, true, false}}) {
      auto how = launch_of(AttnDecodeKernel::kMma, adaptive, a.pdl, a.cluster);
      how.early_dependents = a.early;
      std::vector<bf> cache;
      const auto got = run_after_rope(f, how, a.graph, a.fused, &cache);
      for (size_t j = 0; j < got.size(); ++j)
        ASSERT_TRUE(std::isfinite(got[j])) << c.what << " [" << a.name << "]: element " << j;
      size_t cache_differ = 0;
      for (size_t j = 0; j < cache.size(); ++j)
        cache_differ += cache[j] != ref_cache[j] &&
                        !(std::isnan(bf16_to_f32(cache[j])) && std::isnan(bf16_to_f32(ref_cache[j])));
      if (a.cluster)  // other splits (16, merged in the cluster): the same maths, other roundings
        EXPECT_LT(test::norm_err(got, ref), 1e-2) << c.what << " [" << a.name << "]";
      else
        EXPECT_EQ(n_differ(got, ref), 0u) << c.what << " [" << a.name << "]: vs rope_kv + kernel";
      EXPECT_EQ(cache_differ, 0u) << c.what << " [" << a.name << "]: cache vs rope_kv's";
      std::printf("  %s [fused rope, %s]: %zu of %zu outputs, %zu of %zu cache elements differ\n",
                  c.what.c_str(), a.name, n_differ(got, ref), got.size(), cache_differ,
                  cache.size());
    }
  }
  // Refused: the fused rope on the planned split, or with other caches than the attention's.
  const DecodeFixture f(test::attn_shape_27b(), {100}, 5);
  DevBuf<bf> qkv(size_t(f.s.qkv_dim())), w(size_t(f.s.head_dim)), kc(f.kc), vc(f.vc);
  DevBuf<int32_t> pos(std::vector<int32_t>{99}), slot(std::vector<int32_t>{99});
  DevBuf<int32_t> qs(f.q_start), ql(f.q_len), kl(f.kv_len), bt(f.btab);
  DevBuf<char> ws(cuda::attention_decode_workspace_bytes(f.s, 1, 64));
  DevBuf<bf> dg(f.gate), out(f.q.size());
  auto how = launch_of(AttnDecodeKernel::kMma, cuda::AttnDecodeSplit::kPlanned);
  how.rope = {qkv.as<__nv_bfloat16>(), w.as<__nv_bfloat16>(), w.as<__nv_bfloat16>(), pos.ptr,
              slot.ptr, kc.as<__nv_bfloat16>(), vc.as<__nv_bfloat16>()};
  auto launch = [&] {
    cuda::launch_attention_decode(f.s, f.batch(qs, ql, kl, bt), nullptr, kc.as<__nv_bfloat16>(),
                                  vc.as<__nv_bfloat16>(), f.gate_of(dg), 64, 64, ws.ptr,
                                  out.as<__nv_bfloat16>(), 0, how);
  };
  EXPECT_THROW(launch(), Error);
  how.split = adaptive;
  how.rope.v_cache = how.rope.k_cache;
  EXPECT_THROW(launch(), Error);
  how.rope.v_cache = vc.as<__nv_bfloat16>();
  EXPECT_NO_THROW(launch());
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}

// The engine's decode sequence: the adaptive kernel as a programmatic dependent of rope_kv,
// eager and in a graph (and with the merge's early dependents), vs the same kernels launched
// plainly (bit-identical) and vs the planned path (tolerance). 27B shapes at batch 1 / 4 / 16,
// 4K..32K, uniform and ragged.
TEST(CudaAttentionDecode, PdlAfterRope27b) {
  DS_REQUIRE_GPU();
  std::mt19937 rng(77);
  struct Case {
    int batch, ctx;
    bool ragged;
  };
  const Case cases[] = {{1, 4096, false}, {1, 4097, false}, {1, 16384, false}, {1, 32768, false},
                        {4, 4096, false}, {4, 32768, true}, {16, 4096, false}, {16, 8192, true}};
  const auto adaptive = cuda::AttnDecodeSplit::kAdaptive;
  for (const Case& c : cases) {
    std::vector<int32_t> lens(c.batch, c.ctx);
    if (c.ragged)
      for (int i = 1; i < c.batch; ++i) lens[i] = 1 + int(rng() % c.ctx);
    const DecodeFixture f(test::attn_shape_27b(), lens, 90 + c.batch);
    const std::string what = std::string("27b ") + (c.ragged ? "ragged " : "") + "batch " +
                             std::to_string(c.batch) + " x " + std::to_string(c.ctx);
    const auto plain = run_after_rope(f, launch_of(AttnDecodeKernel::kMma, adaptive), false);
    const auto pdl = run_after_rope(f, launch_of(AttnDecodeKernel::kMma, adaptive, true), false);
    const auto pdl_graph =
        run_after_rope(f, launch_of(AttnDecodeKernel::kMma, adaptive, true), true);
    auto early = launch_of(AttnDecodeKernel::kMma, adaptive, true);
    early.early_dependents = true;
    const auto pdl_early = run_after_rope(f, early, true);
    auto serial = launch_of(AttnDecodeKernel::kMma, adaptive, true);
    serial.serial_merge = true;
    const auto pdl_serial = run_after_rope(f, serial, true);
    const auto planned = run_after_rope(f, launch_of(AttnDecodeKernel::kMma), false);
    for (size_t j = 0; j < pdl.size(); ++j) {
      ASSERT_TRUE(std::isfinite(pdl[j])) << what << " [pdl]: element " << j << " not finite";
      ASSERT_TRUE(std::isfinite(pdl_graph[j])) << what << " [pdl graph]: element " << j;
      ASSERT_TRUE(std::isfinite(pdl_early[j])) << what << " [pdl early graph]: element " << j;
      ASSERT_TRUE(std::isfinite(planned[j])) << what << " [planned]: element " << j;
    }
    EXPECT_EQ(n_differ(pdl, plain), 0u) << what << ": pdl vs plain launch";
    EXPECT_EQ(n_differ(pdl_graph, plain), 0u) << what << ": pdl in a graph vs plain launch";
    EXPECT_EQ(n_differ(pdl_early, plain), 0u) << what << ": pdl (early dependents) vs plain";
    EXPECT_EQ(n_differ(pdl_serial, pdl_graph), 0u) << what << ": serial merge vs one-trip merge";
    const double e = test::norm_err(pdl, planned);
    EXPECT_LT(e, 1e-2) << what << ": adaptive vs planned";
    std::printf("  %s: pdl vs plain %zu, pdl graph vs plain %zu, pdl early graph vs plain %zu of "
                "%zu differ, serial merge vs one-trip %zu; adaptive vs planned %.2e\n",
                what.c_str(), n_differ(pdl, plain), n_differ(pdl_graph, plain),
                n_differ(pdl_early, plain), pdl.size(), n_differ(pdl_serial, pdl_graph), e);
  }
  // The engine's workspace bound: more splits than one wave, most empty, smallest split 8 keys.
  DecodeFixture f(test::attn_shape_27b(), {4096, 100, 1}, 99);
  const auto ref = f.ref_all();
  const auto got = f.run(launch_of(AttnDecodeKernel::kMma, adaptive), 8, 128);
  EXPECT_LT(test::norm_err(got, ref), 1e-2) << "adaptive, up to 128 splits of >= 8 keys";
  std::printf("  adaptive, up to 128 splits of >= 8 keys: %.2e\n", test::norm_err(got, ref));
  // More used splits than the merge block has threads (512 of >= 8 keys for 4096): the one-trip
  // merge's loops past its preloaded values, bit for bit the serial merge's sums.
  {
    auto one = launch_of(AttnDecodeKernel::kMma, adaptive);
    auto ser = one;
    ser.serial_merge = true;
    const auto a = f.run(one, 8, 512), b = f.run(ser, 8, 512);
    EXPECT_LT(test::norm_err(a, ref), 1e-2) << "adaptive, up to 512 splits of >= 8 keys";
    EXPECT_EQ(n_differ(a, b), 0u) << "512 splits: one-trip vs serial merge";
    std::printf("  adaptive, up to 512 splits of >= 8 keys: %.2e, one-trip vs serial %zu differ\n",
                test::norm_err(a, ref), n_differ(a, b));
  }
  // PDL without the adaptive split, and adaptive on the simt kernel, are refused.
  EXPECT_THROW(f.run(launch_of(AttnDecodeKernel::kMma, cuda::AttnDecodeSplit::kPlanned, true)),
               Error);
  EXPECT_THROW(f.run(launch_of(AttnDecodeKernel::kSimt, adaptive)), Error);
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
  EXPECT_THROW(f.run(launch_of(AttnDecodeKernel::kMma)), Error);
  EXPECT_THROW(f.run(launch_of(AttnDecodeKernel::kAuto, cuda::AttnDecodeSplit::kAdaptive)), Error);
  // kAuto falls back to the simt kernel.
  const auto got = f.run(launch_of(AttnDecodeKernel::kAuto));
  EXPECT_LT(test::norm_err(got, f.ref_all()), 1e-2);
}

// Per-launch time of rope_kv + decode attention in a CUDA graph of 20 launches (median of
// replays), KV rotated over up to 8 block tables (more than 3x L2 at every size): rope_kv alone,
// then with the planned path (the engine's plan for the context's bucket), the adaptive path and
// the adaptive path under PDL.
TEST(CudaAttentionDecode, Timing) {
  DS_REQUIRE_GPU();
  DS_REQUIRE_PERF();
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
  const auto qnw = test::random_bf16(size_t(hd), rng, 0.5f);
  DevBuf<bf> d_nw(qnw);
  std::printf("  %-6s %-7s %9s %12s %12s %12s %12s %12s %12s %9s   (rope + attention us; "
              "attention GB/s)\n",
              "batch", "context", "rope", "planned", "adaptive", "pdl", "fused", "fused pdl",
              "cluster pdl", "pdl GB/s");
  for (int batch : {1, 4, 16})
    for (int ctx : {4096, 4160, 16384, 32768, 32832}) {
      // The planned path sizes its grid for the context's power-of-two bucket (as the engine's
      // graphs do: 4160 runs 128 splits of 64, half of them empty); the adaptive one for kv_len.
      int bucket = 64;
      while (bucket < ctx) bucket *= 2;
      const int bps = (ctx + ps - 1) / ps;
      const double kv_bytes = 2.0 * batch * ctx * nkv * hd * 2;
      const int rot =
          int(std::min<int64_t>(8, std::max<int64_t>(1, pool_blocks / (int64_t(batch) * bps))));
      std::vector<int32_t> table(size_t(rot) * batch * bps);
      std::vector<int32_t> all(pool_blocks);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      for (size_t i = 0; i < table.size(); ++i) table[i] = all[i % pool_blocks];
      std::vector<int32_t> qs(batch), ql(batch, 1), kl(batch, ctx), pos(batch, ctx - 1),
          slots(size_t(rot) * batch);
      std::iota(qs.begin(), qs.end(), 0);
      for (int r = 0; r < rot; ++r)
        for (int i = 0; i < batch; ++i)
          slots[size_t(r) * batch + i] =
              table[(size_t(r) * batch + i) * bps + (ctx - 1) / ps] * ps + (ctx - 1) % ps;
      DevBuf<int32_t> d_t(table), d_qs(qs), d_ql(ql), d_kl(kl), d_pos(pos), d_slots(slots);
      DevBuf<bf> qkv(test::random_bf16(size_t(batch) * s.qkv_dim(), rng)),
          q(size_t(batch) * s.n_heads * hd), out(size_t(batch) * s.n_heads * hd);
      const int chunk =
          cuda::attention_decode_kv_chunk(batch, nkv, std::max(64, bucket / 2), n_sms, 64);
      const int splits = (bucket + chunk - 1) / chunk;
      const int a_splits = cuda::attention_decode_adaptive_splits(batch, nkv, n_sms, 64);
      DevBuf<char> ws(cuda::attention_decode_workspace_bytes(s, batch, std::max(splits, a_splits)));
      DS_CUDA_CHECK(cudaDeviceSynchronize());
      // mode: 0 rope only, 1 planned, 2 adaptive, 3 adaptive under PDL, 4 / 5: adaptive / under
      // PDL with rope_kv's work in the split kernel (AttnDecodeLaunch::rope, no rope_kv launch),
      // 6: 5 in clusters of 16 splits merging in distributed shared memory (no merge kernel)
      auto launch = [&](int mode, int i, cudaStream_t st) {
        const int r = i % rot;
        if (mode < 4)
          cuda::launch_qk_norm_rope_kv(s, qkv.as<__nv_bfloat16>(), d_nw.as<__nv_bfloat16>(),
                                     d_nw.as<__nv_bfloat16>(), d_pos.ptr,
                                     d_slots.ptr + int64_t(r) * batch, batch, q.as<__nv_bfloat16>(),
                                     kc.as<__nv_bfloat16>(), vc.as<__nv_bfloat16>(), st);
        if (mode == 0) return;
        cuda::AttnBatch b;
        b.n_seqs = batch;
        b.q_start = d_qs.ptr;
        b.q_len = d_ql.ptr;
        b.kv_len = d_kl.ptr;
        b.block_table = d_t.ptr + int64_t(r) * batch * bps;
        b.block_table_stride = bps;
        b.max_q_len = 1;
        b.max_kv_len = ctx;
        auto how = mode == 1 ? launch_of(AttnDecodeKernel::kMma)
                             : launch_of(AttnDecodeKernel::kMma, cuda::AttnDecodeSplit::kAdaptive,
                                         mode == 3 || mode >= 5, mode == 6);
        if (mode >= 4)
          how.rope = {qkv.as<__nv_bfloat16>(), d_nw.as<__nv_bfloat16>(), d_nw.as<__nv_bfloat16>(),
                      d_pos.ptr, d_slots.ptr + int64_t(r) * batch, kc.as<__nv_bfloat16>(),
                      vc.as<__nv_bfloat16>()};
        cuda::launch_attention_decode(s, b, q.as<__nv_bfloat16>(), kc.as<__nv_bfloat16>(),
                                      vc.as<__nv_bfloat16>(), cuda::AttnGate{},
                                      mode == 1 ? chunk : 64,
                                      mode == 1   ? splits
                                      : mode == 6 ? cuda::kAttnDecodeClusterSplits
                                                  : a_splits,
                                      ws.ptr, out.as<__nv_bfloat16>(), st, how);
      };
      double us[7];
      // planned, pdl, fused pdl and cluster pdl twice; the last counts
      for (int m : {0, 1, 2, 3, 4, 5, 6, 1, 3, 5, 6})
        us[m] = test::graph_time_us([&](int i, cudaStream_t st) { launch(m, i, st); });
      std::printf("  %-6d %-7d %9.1f %12.1f %12.1f %12.1f %12.1f %12.1f %12.1f %9.0f   (planned: "
                  "chunk %d, %d splits; adaptive: %d splits)\n",
                  batch, ctx, us[0], us[1], us[2], us[3], us[4], us[5], us[6],
                  kv_bytes / (us[3] - us[0]) * 1e-3, chunk, splits, a_splits);
    }
}

}  // namespace
}  // namespace ds
