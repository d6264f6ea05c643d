// GPU attention kernels (prefill: WMMA flash tiles; decode: split-KV) against an fp32 CPU
// reference over a paged cache with shuffled blocks: the 27B shape (24 q / 4 kv heads, head_dim
// 256, sigmoid output gate) at sequence lengths 1, 63, 64, 65, 4095, 4097, several sequences of
// different lengths in one launch, query chunks against a longer cache (chunked prefill), and the
// small head dims of the test configs. Outputs are poisoned (NaN) first and every row must be
// finite; long sequences compare a sample of rows (the first, the last, every tile edge and random
// ones). Tolerance: normalised L2 error < 1e-2 (bf16 inputs, P rounded to bf16, bf16 output).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "cuda/kernels.h"
#include "cuda_test_util.h"

namespace ds {
namespace {

using test::DevBuf;
using bf = uint16_t;

struct SeqSpec {
  int q_len, kv_len;
};

struct Fixture {
  cuda::AttnShape s;
  std::vector<SeqSpec> seqs;
  int n_rows = 0, max_blocks = 0, n_blocks = 0;
  std::vector<float> K, V;  // per seq logical [kv_len, n_kv, hd], concatenated
  std::vector<size_t> kv_off;
  std::vector<bf> q;         // [n_rows, n_heads, hd]
  std::vector<bf> qkv_gate;  // gate source: [n_rows, n_heads, 2*hd], gate at +hd
  std::vector<bf> kc, vc;    // paged caches
  std::vector<int32_t> q_start, q_len, kv_len, btab;

  Fixture(cuda::AttnShape shape, std::vector<SeqSpec> ss, uint32_t seed)
      : s(shape), seqs(std::move(ss)) {
    std::mt19937 rng(seed);
    const int nkv = s.n_kv_heads, hd = s.head_dim, ps = s.page_size;
    for (auto& q : seqs) max_blocks = std::max(max_blocks, (q.kv_len + ps - 1) / ps);
    for (auto& q : seqs) n_blocks += (q.kv_len + ps - 1) / ps;
    n_blocks += 3;
    std::vector<int> perm(n_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const size_t blk_elems = size_t(nkv) * ps * hd;
    kc.assign(blk_elems * n_blocks,
              f32_to_bf16(NAN));  // unused cache rows are NaN: must never be read
    vc = kc;
    int next = 0;
    btab.assign(seqs.size() * max_blocks, 0);
    for (size_t i = 0; i < seqs.size(); ++i) {
      const auto& sp = seqs[i];
      q_start.push_back(n_rows);
      q_len.push_back(sp.q_len);
      kv_len.push_back(sp.kv_len);
      n_rows += sp.q_len;
      kv_off.push_back(K.size());
      auto k = test::random_bf16(size_t(sp.kv_len) * nkv * hd, rng);
      auto v = test::random_bf16(size_t(sp.kv_len) * nkv * hd, rng);
      for (int b = 0; b < (sp.kv_len + ps - 1) / ps; ++b) btab[i * max_blocks + b] = perm[next++];
      for (int t = 0; t < sp.kv_len; ++t)
        for (int h = 0; h < nkv; ++h)
          for (int c = 0; c < hd; ++c) {
            const size_t src = (size_t(t) * nkv + h) * hd + c;
            const size_t dst = (size_t(btab[i * max_blocks + t / ps]) * nkv + h) * ps * hd +
                               size_t(t % ps) * hd + c;
            kc[dst] = k[src];
            vc[dst] = v[src];
            K.push_back(bf16_to_f32(k[src]));
            V.push_back(bf16_to_f32(v[src]));
          }
    }
    q = test::random_bf16(size_t(n_rows) * s.n_heads * hd, rng, 1.5f);
    qkv_gate = test::random_bf16(size_t(n_rows) * s.n_heads * 2 * hd, rng, 2.f);
  }

  cuda::AttnGate gate(const DevBuf<bf>& g) const {
    cuda::AttnGate a;
    a.ptr = g.as<__nv_bfloat16>() + s.head_dim;
    a.token_stride = int64_t(s.n_heads) * 2 * s.head_dim;
    a.head_stride = 2 * s.head_dim;
    return a;
  }

  // fp32 reference of one output row (token j of sequence i, head h).
  void ref_row(int i, int j, int h, float* out) const {
    const int hd = s.head_dim, nkv = s.n_kv_heads, g = h / (s.n_heads / nkv);
    const int pos = kv_len[i] - q_len[i] + j;
    const int row = q_start[i] + j;
    const float* Kb = K.data() + kv_off[i];
    const float* Vb = V.data() + kv_off[i];
    std::vector<double> sc(pos + 1);
    double mx = -1e300;
    for (int t = 0; t <= pos; ++t) {
      double d = 0;
      for (int c = 0; c < hd; ++c)
        d += double(bf16_to_f32(q[(size_t(row) * s.n_heads + h) * hd + c])) *
             Kb[(size_t(t) * nkv + g) * hd + c];
      sc[t] = d / std::sqrt(double(hd));
      mx = std::max(mx, sc[t]);
    }
    double z = 0;
    for (auto& x : sc) z += (x = std::exp(x - mx));
    for (int c = 0; c < hd; ++c) {
      double o = 0;
      for (int t = 0; t <= pos; ++t) o += sc[t] * Vb[(size_t(t) * nkv + g) * hd + c];
      const double gt = bf16_to_f32(qkv_gate[(size_t(row) * s.n_heads + h) * 2 * hd + hd + c]);
      out[c] = float(o / z / (1.0 + std::exp(-gt)));
    }
  }

  // Compares the rows of `got` ([n_rows, n_heads, hd]) with the reference; all rows of short
  // sequences, a sample of long ones. Every element of every row must be finite.
  void check(const std::vector<bf>& got_bf, double tol, const char* what) const {
    const int hd = s.head_dim;
    for (size_t i = 0; i < got_bf.size(); ++i)
      ASSERT_TRUE(std::isfinite(bf16_to_f32(got_bf[i])))
          << what << ": element " << i << " not written / NaN";
    std::vector<float> got, ref;
    std::mt19937 rng(11);
    for (size_t i = 0; i < seqs.size(); ++i) {
      std::set<int> rows;
      if (q_len[i] <= 300) {
        for (int j = 0; j < q_len[i]; ++j) rows.insert(j);
      } else {
        for (int j : {0, 1, 9, 10, 11, 63, 64, 65, q_len[i] - 2, q_len[i] - 1}) rows.insert(j);
        for (int k = 0; k < 24; ++k) rows.insert(rng() % q_len[i]);
      }
      std::vector<float> r(hd);
      for (int j : rows)
        for (int h = 0; h < s.n_heads; ++h) {
          ref_row(int(i), j, h, r.data());
          for (int c = 0; c < hd; ++c) {
            ref.push_back(r[c]);
            got.push_back(bf16_to_f32(got_bf[(size_t(q_start[i] + j) * s.n_heads + h) * hd + c]));
          }
        }
    }
    const double e = test::norm_err(got, ref);
    EXPECT_LT(e, tol) << what;
    std::printf("  %s: normalised error %.2e over %zu values\n", what, e, got.size());
  }
};

cuda::AttnShape shape_27b() {
  cuda::AttnShape s;
  s.n_heads = 24;
  s.n_kv_heads = 4;
  s.head_dim = 256;
  s.rotary_dim = 64;
  s.page_size = 64;
  return s;
}

void run_prefill(const Fixture& f, const char* what) {
  DevBuf<bf> q(f.q), kc(f.kc), vc(f.vc), g(f.qkv_gate), out(f.q.size());
  DevBuf<int32_t> qs(f.q_start), ql(f.q_len), kl(f.kv_len), bt(f.btab);
  out.poison();
  cuda::AttnBatch b;
  b.n_seqs = int(f.seqs.size());
  b.q_start = qs.ptr;
  b.q_len = ql.ptr;
  b.kv_len = kl.ptr;
  b.block_table = bt.ptr;
  b.block_table_stride = f.max_blocks;
  for (auto& s : f.seqs) {
    b.max_q_len = std::max(b.max_q_len, s.q_len);
    b.max_kv_len = std::max(b.max_kv_len, s.kv_len);
  }
  cuda::launch_attention_prefill(f.s, b, q.as<__nv_bfloat16>(), kc.as<__nv_bfloat16>(),
                                 vc.as<__nv_bfloat16>(), f.gate(g), out.as<__nv_bfloat16>(), 0);
  f.check(out.download(), 1e-2, what);
}

void run_decode(const Fixture& f, const char* what) {
  DevBuf<bf> q(f.q), kc(f.kc), vc(f.vc), g(f.qkv_gate), out(f.q.size());
  DevBuf<int32_t> qs(f.q_start), ql(f.q_len), kl(f.kv_len), bt(f.btab);
  out.poison();
  cuda::AttnBatch b;
  b.n_seqs = int(f.seqs.size());
  b.q_start = qs.ptr;
  b.q_len = ql.ptr;
  b.kv_len = kl.ptr;
  b.block_table = bt.ptr;
  b.block_table_stride = f.max_blocks;
  b.max_q_len = 1;
  for (auto& s : f.seqs) b.max_kv_len = std::max(b.max_kv_len, s.kv_len);
  const int chunk =
      cuda::attention_decode_kv_chunk(b.n_seqs, f.s.n_kv_heads, b.max_kv_len, 132, 64);
  const int splits = (b.max_kv_len + chunk - 1) / chunk;
  DevBuf<char> ws(cuda::attention_decode_workspace_bytes(f.s, b.n_seqs, splits));
  cuda::launch_attention_decode(f.s, b, q.as<__nv_bfloat16>(), kc.as<__nv_bfloat16>(),
                                vc.as<__nv_bfloat16>(), f.gate(g), chunk, splits, ws.ptr,
                                out.as<__nv_bfloat16>(), 0);
  f.check(out.download(), 1e-2, what);
}

TEST(CudaAttention, Prefill27bSingleSequenceLengths) {
  DS_REQUIRE_GPU();
  for (int n : {1, 63, 64, 65, 4095, 4097}) {
    Fixture f(shape_27b(), {{n, n}}, 100 + n);
    run_prefill(f, ("prefill 27b len " + std::to_string(n)).c_str());
  }
}

TEST(CudaAttention, Prefill27bRaggedBatchWithCachedPrefix) {
  DS_REQUIRE_GPU();
  // q chunk against a longer cache (earlier chunks), several sequences of different lengths.
  Fixture f(shape_27b(), {{65, 200}, {1, 4097}, {512, 1000}, {63, 63}, {64, 129}}, 7);
  run_prefill(f, "prefill 27b ragged + cached prefix");
}

TEST(CudaAttention, PrefillSmallHeadDims) {
  DS_REQUIRE_GPU();
  for (auto [nh, nkv, hd] :
       {std::tuple{6, 1, 32}, std::tuple{8, 2, 16}, std::tuple{16, 2, 128}, std::tuple{8, 8, 64}}) {
    cuda::AttnShape s;
    s.n_heads = nh;
    s.n_kv_heads = nkv;
    s.head_dim = hd;
    s.rotary_dim = hd / 4;
    s.page_size = 16;
    Fixture f(s, {{100, 100}, {1, 37}, {17, 50}}, 9 + hd);
    run_prefill(f, ("prefill hd " + std::to_string(hd)).c_str());
  }
}

TEST(CudaAttention, Decode27bSplitKv) {
  DS_REQUIRE_GPU();
  Fixture f(shape_27b(), {{1, 1}, {1, 63}, {1, 64}, {1, 65}, {1, 4095}, {1, 4097}, {1, 20000}}, 21);
  run_decode(f, "decode 27b batch 7, kv 1..20000");
  run_prefill(f, "same batch through the prefill kernel");
  Fixture one(shape_27b(), {{1, 32768}}, 22);
  run_decode(one, "decode 27b batch 1, kv 32768");
}

TEST(CudaAttention, DecodeOtherShapes) {
  DS_REQUIRE_GPU();
  for (auto [nh, nkv, hd] : {std::tuple{6, 1, 32}, std::tuple{16, 2, 128}, std::tuple{8, 8, 64}}) {
    cuda::AttnShape s;
    s.n_heads = nh;
    s.n_kv_heads = nkv;
    s.head_dim = hd;
    s.rotary_dim = hd / 4;
    s.page_size = 16;
    ASSERT_TRUE(cuda::attention_decode_supported(s));
    Fixture f(s, {{1, 1}, {1, 100}, {1, 1000}}, 30 + hd);
    run_decode(f, ("decode hd " + std::to_string(hd)).c_str());
  }
}

}  // namespace
}  // namespace ds
