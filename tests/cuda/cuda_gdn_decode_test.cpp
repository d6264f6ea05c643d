// GPU tests of the GDN decode kernels (src/cuda/gdn_decode.cu): the cluster kernels (4 or 8 blocks
// per value head, kCluster4 / kCluster8), the streaming kernel (one block per head, state
// through shared memory by bulk copies; kStream through a ring of 4 chunk buffers, kStreamWhole
// with the whole head in flight) and the split streaming kernels (kSplit2 / kSplit4: a head's
// rows over a 2- / 4-block cluster) and the persistent streaming kernels (kPersist /
// kPersistDeep: at most one wave of blocks walking (sequence, head) units, a 4- / 8-chunk ring
// across units), and kAuto (the default choice by batch size), each run for several carried
// steps from identical inputs and initial states:
//  - against an fp64 CPU step written here (conv ring + conv + SiLU, l2norm, gates, delta rule,
//    gated RMSNorm): state error < 1e-5, output (bf16) < 1e-2, conv ring exact;
//  - against kCluster4: a row's state update is the same code in every kernel (update_row), so the
//    states must be bit-equal and the rings equal; the output differs only in the order of the
//    gated RMSNorm's sum of squares (< 1e-3);
//  - the split and persistent kernels against kStream: states AND outputs bit-equal (same
//    per-row code, the norm's sum of squares in kStream's order), the persistent ones also with
//    their grid capped to 1-7 blocks (PersistCappedGrid: rings across many units per block).
// Outputs are poisoned (NaN) before each step; the unused slot 0 must stay untouched. Shapes: 27B
// (16 k / 48 v heads, d 128) at batch 1, 2, 3, 4, 5, 8, 16, 32 with fresh (position 0), young
// (positions 1-3: zero conv taps) and old sequences; small and odd heads (d_k 16-128, d_v 16-128
// incl. 40, 100 and 112: partial chunks, the 1-block cluster fallback; kernels that do not take a
// shape are skipped, and forcing one throws). Timing (prints): every kernel at batch 1-32 in CUDA
// graphs, states rotated past L2, state bandwidth, next to a device-to-device copy of the same
// bytes.
// Programmatic dependent launch (PdlAfterGemv27B): each kernel launched with PDL right after the
// bulk GEMV that writes its input proj (which triggers its dependents early; proj poisoned
// before the GEMV, so a read before griddepcontrol.wait would see NaN), eagerly and in one CUDA
// graph, several carried steps: every output, state and ring bit-identical to the same steps
// launched without PDL. PdlTiming (prints): PDL GEMV + decode per layer, decode PDL off / on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/gdn.h"
#include "cuda/gemv.h"
#include "cuda_graph_timer.h"
#include "cuda_test_util.h"

namespace ds {
namespace {

using bf = uint16_t;
using cuda::GdnDecodeKernel;
using test::DevBuf;

cuda::GdnShape shape_27b() { return cuda::GdnShape{16, 48, 128, 128, 4, 1e-6f}; }

struct KernelName {
  GdnDecodeKernel k;
  const char* name;
};
const KernelName kKernels[] = {{GdnDecodeKernel::kCluster4, "cluster4"},
                               {GdnDecodeKernel::kCluster8, "cluster8"},
                               {GdnDecodeKernel::kStream, "stream"},
                               {GdnDecodeKernel::kStreamWhole, "stream_whole"},
                               {GdnDecodeKernel::kSplit2, "split2"},
                               {GdnDecodeKernel::kSplit4, "split4"},
                               {GdnDecodeKernel::kPersist, "persist"},
                               {GdnDecodeKernel::kPersistDeep, "persist_deep"},
                               {GdnDecodeKernel::kAuto, "auto"}};  // the default choice

bool is_persist(GdnDecodeKernel k) {
  return k == GdnDecodeKernel::kPersist || k == GdnDecodeKernel::kPersistDeep;
}

// Sets $DS_GDN_DECODE_PERSIST_BLOCKS (the persistent grid's cap) for its lifetime.
struct PersistCap {
  explicit PersistCap(int n) {
    if (n > 0)
      setenv("DS_GDN_DECODE_PERSIST_BLOCKS", std::to_string(n).c_str(), 1);
    else
      unsetenv("DS_GDN_DECODE_PERSIST_BLOCKS");
  }
  ~PersistCap() { unsetenv("DS_GDN_DECODE_PERSIST_BLOCKS"); }
};

std::vector<float> random_f32(size_t n, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// One layer's weights and `n_slots` slots of state, on the device.
struct GdnSetup {
  cuda::GdnShape s;
  int n_slots;
  DevBuf<bf> conv_w, norm_w, conv;
  DevBuf<float> a_log, dt_bias, rec;
  GdnSetup(const cuda::GdnShape& shape, int slots, std::mt19937& rng)
      : s(shape),
        n_slots(slots),
        conv_w(test::random_bf16(size_t(shape.qkv_dim()) * 4, rng, 0.3f)),
        norm_w(test::random_bf16(shape.d_v, rng, 0.5f)),
        conv(test::random_bf16(size_t(slots) * 4 * shape.qkv_dim(), rng)),
        a_log(random_f32(shape.n_v_heads, rng, std::log(0.01f), std::log(4.f))),
        dt_bias(random_f32(shape.n_v_heads, rng, -3.f, 1.f)),
        rec(random_f32(size_t(slots) * shape.n_v_heads * shape.d_v * shape.d_k, rng, -0.2f, 0.2f)) {
  }
  cuda::GdnLayerWeights w() const {
    return {conv_w.as<__nv_bfloat16>(), a_log.ptr, dt_bias.ptr, norm_w.as<__nv_bfloat16>()};
  }
  cuda::GdnStatePool pool() const {
    cuda::GdnStatePool p;
    p.conv_state = conv.as<__nv_bfloat16>();
    p.rec_state = rec.ptr;
    p.conv_slot_stride = 4LL * s.qkv_dim();
    p.rec_slot_stride = int64_t(s.n_v_heads) * s.d_v * s.d_k;
    return p;
  }
};

// The fp64 CPU step for one sequence: updates its ring (bf16 [4, qkv_dim]) and state (fp32
// [n_v_heads, d_v, d_k]) in place and writes y [n_v_heads * d_v].
void ref_step(const cuda::GdnShape& s, const std::vector<bf>& conv_w,
              const std::vector<float>& a_log, const std::vector<float>& dt_bias,
              const std::vector<bf>& norm_w, const bf* x, int p, bf* ring, float* S,
              std::vector<double>& y) {
  const int qkv = s.qkv_dim(), dk = s.d_k, dv = s.d_v, ratio = s.n_v_heads / s.n_k_heads;
  std::vector<double> c(qkv);
  for (int ch = 0; ch < qkv; ++ch) {
    double acc = 0;
    for (int j = 0; j < 3; ++j) {
      const int pp = p - 3 + j;
      if (pp >= 0)
        acc += double(bf16_to_f32(conv_w[ch * 4 + j])) * bf16_to_f32(ring[(pp & 3) * qkv + ch]);
    }
    acc += double(bf16_to_f32(conv_w[ch * 4 + 3])) * bf16_to_f32(x[ch]);
    c[ch] = acc / (1 + std::exp(-acc));
  }
  y.assign(size_t(s.out_dim()), 0.0);
  for (int hv = 0; hv < s.n_v_heads; ++hv) {
    const int hk = hv / ratio;
    std::vector<double> q(c.begin() + hk * dk, c.begin() + (hk + 1) * dk);
    std::vector<double> k(c.begin() + (s.n_k_heads + hk) * dk,
                          c.begin() + (s.n_k_heads + hk + 1) * dk);
    const double* v = &c[size_t(2) * s.n_k_heads * dk + size_t(hv) * dv];
    double sq = 0, sk = 0;
    for (int i = 0; i < dk; ++i) sq += q[i] * q[i], sk += k[i] * k[i];
    for (int i = 0; i < dk; ++i) {
      q[i] *= 1 / std::sqrt(sq + 1e-6) / std::sqrt(double(dk));
      k[i] *= 1 / std::sqrt(sk + 1e-6);
    }
    const double b = bf16_to_f32(x[qkv + s.z_dim() + hv]);
    const double a = double(bf16_to_f32(x[qkv + s.z_dim() + s.n_v_heads + hv])) + dt_bias[hv];
    const double beta = 1 / (1 + std::exp(-b));
    const double decay =
        std::exp(-std::exp(double(a_log[hv])) * (a > 20 ? a : std::log1p(std::exp(a))));
    std::vector<double> o(dv);
    for (int r = 0; r < dv; ++r) {
      float* row = S + (size_t(hv) * dv + r) * dk;
      double u = 0;
      for (int i = 0; i < dk; ++i) u += decay * row[i] * k[i];
      const double delta = beta * (v[r] - u);
      double acc = 0;
      for (int i = 0; i < dk; ++i) {
        const double t = decay * row[i] + k[i] * delta;
        row[i] = float(t);
        acc += t * q[i];
      }
      o[r] = acc;
    }
    double ms = 0;
    for (double e : o) ms += e * e;
    const double rinv = 1 / std::sqrt(ms / dv + s.norm_eps);
    for (int r = 0; r < dv; ++r) {
      const double z = bf16_to_f32(x[qkv + hv * dv + r]);
      y[size_t(hv) * dv + r] = bf16_to_f32(norm_w[r]) * o[r] * rinv * (z / (1 + std::exp(-z)));
    }
  }
  for (int ch = 0; ch < qkv; ++ch) ring[(p & 3) * qkv + ch] = x[ch];
}

size_t count_diff(const std::vector<bf>& a, const std::vector<bf>& b) {
  size_t n = a.size() == b.size() ? 0 : std::max(a.size(), b.size());
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) n += a[i] != b[i];
  return n;
}

struct Step {
  std::vector<bf> out, conv;
  std::vector<float> rec;
};

bool supported(GdnDecodeKernel k, const cuda::GdnShape& s, const cuda::GdnStatePool& pool) {
  if (k == GdnDecodeKernel::kCluster8) return cuda::gdn_decode_cluster8_supported(s);
  if (k == GdnDecodeKernel::kStream || k == GdnDecodeKernel::kStreamWhole || is_persist(k))
    return cuda::gdn_decode_stream_supported(s, pool);
  if (k == GdnDecodeKernel::kSplit2) return cuda::gdn_decode_split_supported(s, pool, 2);
  if (k == GdnDecodeKernel::kSplit4) return cuda::gdn_decode_split_supported(s, pool, 4);
  return true;
}

// n_steps carried steps (positions pos[i] + step) with every kernel from the same initial state;
// each kernel is checked against the fp64 CPU steps and against kCluster4.
void check_kernels(const cuda::GdnShape& s, const std::vector<int>& pos, int n_steps,
                   uint32_t seed) {
  std::mt19937 rng(seed);
  const int n = int(pos.size());
  GdnSetup a(s, n + 1, rng);
  const auto conv0 = a.conv.download();
  const auto rec0 = a.rec.download();
  std::vector<int32_t> slots(n), all_pos(size_t(n) * n_steps);
  for (int i = 0; i < n; ++i) slots[i] = n - i;  // slot 0 unused
  for (int t = 0; t < n_steps; ++t)
    for (int i = 0; i < n; ++i) all_pos[size_t(t) * n + i] = pos[i] + t;
  const auto proj_h = test::random_bf16(size_t(n_steps) * n * s.in_dim(), rng);
  DevBuf<bf> proj(proj_h);
  DevBuf<int32_t> d_pos(all_pos), d_slots(slots);

  // The CPU reference, step by step.
  const auto conv_w = a.conv_w.download(), norm_w = a.norm_w.download();
  const auto a_log = a.a_log.download(), dt_bias = a.dt_bias.download();
  std::vector<bf> ref_conv = conv0;
  std::vector<float> ref_rec = rec0;
  const size_t conv_per = size_t(4) * s.qkv_dim(), rec_per = size_t(s.n_v_heads) * s.d_v * s.d_k;
  std::vector<std::vector<float>> ref_y(n_steps), ref_states(n_steps);
  std::vector<std::vector<bf>> ref_rings(n_steps);
  for (int t = 0; t < n_steps; ++t) {
    ref_y[t].resize(size_t(n) * s.out_dim());
    for (int i = 0; i < n; ++i) {
      float* S = &ref_rec[slots[i] * rec_per];
      if (pos[i] + t == 0) std::fill(S, S + rec_per, 0.f);  // position 0 starts from zero state
      std::vector<double> y;
      ref_step(s, conv_w, a_log, dt_bias, norm_w, &proj_h[(size_t(t) * n + i) * s.in_dim()],
               pos[i] + t, &ref_conv[slots[i] * conv_per], S, y);
      for (size_t j = 0; j < y.size(); ++j) ref_y[t][size_t(i) * s.out_dim() + j] = float(y[j]);
    }
    ref_states[t] = ref_rec;
    ref_rings[t] = ref_conv;
  }

  std::vector<Step> base;    // kCluster4's steps
  std::vector<Step> stream;  // kStream's steps (the split kernels must match them bit for bit)
  for (const KernelName& kn : kKernels) {
    if (!supported(kn.k, s, a.pool())) continue;
    a.conv.upload(conv0);
    a.rec.upload(rec0);
    DevBuf<bf> out(size_t(n) * s.out_dim());
    std::vector<Step> steps;
    for (int t = 0; t < n_steps; ++t) {
      out.poison();
      cuda::launch_gdn_decode(s, a.w(), a.pool(),
                              proj.as<__nv_bfloat16>() + size_t(t) * n * s.in_dim(),
                              d_pos.ptr + t * n, d_slots.ptr, n, out.as<__nv_bfloat16>(), 0, kn.k);
      DS_CUDA_CHECK(cudaGetLastError());
      steps.push_back({out.download(), a.conv.download(), a.rec.download()});
    }
    for (int t = 0; t < n_steps; ++t) {
      const Step& st = steps[t];
      const std::string what = std::string(kn.name) + " d_k " + std::to_string(s.d_k) + " d_v " +
                               std::to_string(s.d_v) + " batch " + std::to_string(n) + " step " +
                               std::to_string(t);
      for (bf x : st.out)
        ASSERT_TRUE(std::isfinite(bf16_to_f32(x))) << what << ": output not written";
      EXPECT_LT(test::norm_err(test::to_f32(st.out), ref_y[t]), 1e-2) << what << ": y vs CPU";
      EXPECT_LT(test::norm_err(st.rec, ref_states[t]), 1e-5) << what << ": state vs CPU";
      EXPECT_EQ(0u, count_diff(st.conv, ref_rings[t])) << what << ": conv ring elements vs CPU";
      EXPECT_EQ(0, std::memcmp(st.rec.data(), rec0.data(), rec_per * 4))
          << what << ": slot 0 written";
      if (!base.empty()) {
        EXPECT_EQ(0, std::memcmp(st.rec.data(), base[t].rec.data(), st.rec.size() * 4))
            << what << ": state not bit-equal to cluster4";
        EXPECT_LT(test::norm_err(test::to_f32(st.out), test::to_f32(base[t].out)), 1e-3)
            << what << ": y vs cluster4";
      }
      const bool split = kn.k == GdnDecodeKernel::kSplit2 || kn.k == GdnDecodeKernel::kSplit4 ||
                         is_persist(kn.k);
      if (split && !stream.empty()) {
        EXPECT_EQ(0u, count_diff(st.out, stream[t].out)) << what << ": y not bit-equal to stream";
        EXPECT_EQ(0, std::memcmp(st.rec.data(), stream[t].rec.data(), st.rec.size() * 4))
            << what << ": state not bit-equal to stream";
      }
    }
    const Step& last = steps.back();
    std::printf("  %-11s d_k %3d d_v %3d batch %2d, %d steps: y vs CPU %.2e, state vs CPU %.2e%s\n",
                kn.name, s.d_k, s.d_v, n, n_steps,
                test::norm_err(test::to_f32(last.out), ref_y.back()),
                test::norm_err(last.rec, ref_states.back()),
                base.empty() ? ""
                : std::memcmp(last.rec.data(), base.back().rec.data(), last.rec.size() * 4) == 0
                    ? ", state bit-equal to cluster4"
                    : ", state DIFFERS from cluster4");
    if (kn.k == GdnDecodeKernel::kStream) stream = steps;
    if (base.empty()) base = std::move(steps);
  }
}

std::vector<int> mixed_positions(int n) {  // fresh, young (zero conv taps) and old sequences
  const int pick[] = {0, 1, 2, 3, 77, 4097, 5000, 131};
  std::vector<int> p;
  for (int i = 0; i < n; ++i) p.push_back(pick[i % 8] + 37 * (i / 8));
  return p;
}

TEST(CudaGdnDecode, Kernels27B) {
  DS_REQUIRE_GPU();
  uint32_t seed = 1;
  for (int b : {1, 2, 3, 4, 5, 8, 16, 32})
    check_kernels(shape_27b(), mixed_positions(b), 3, seed++);
  check_kernels(shape_27b(), {5000}, 2, seed++);
}

TEST(CudaGdnDecode, KernelsSmallAndOddHeads) {
  DS_REQUIRE_GPU();
  check_kernels(cuda::GdnShape{2, 4, 64, 64, 4, 1e-6f}, {0, 3, 9}, 3, 20);
  check_kernels(cuda::GdnShape{2, 6, 32, 32, 4, 1e-6f}, {2, 1000}, 3, 21);
  check_kernels(cuda::GdnShape{2, 4, 16, 16, 4, 1e-6f}, {0, 5}, 3, 22);
  check_kernels(cuda::GdnShape{2, 6, 32, 64, 4, 1e-6f}, {0, 3, 9, 12}, 3, 23);
  check_kernels(cuda::GdnShape{3, 3, 128, 16, 4, 1e-6f}, {1, 7}, 3, 24);
  // d_v not a multiple of 16 (the 1-block cluster fallback) and partial last chunks.
  check_kernels(cuda::GdnShape{2, 4, 128, 40, 4, 1e-6f}, {0, 2, 50}, 3, 25);
  check_kernels(cuda::GdnShape{1, 3, 32, 100, 4, 1e-6f}, {4, 0}, 3, 26);
  check_kernels(cuda::GdnShape{2, 4, 16, 24, 4, 1e-6f}, {0, 3, 9}, 3, 27);
  // The split kernels' partial chunks: d_v 112 (56 / 28 rows per block of 16-row chunks), d_k 64
  // with 64 rows per block (two 32-row chunks).
  check_kernels(cuda::GdnShape{4, 8, 128, 112, 4, 1e-6f}, {0, 1, 6, 300, 9}, 3, 28);
  check_kernels(cuda::GdnShape{2, 4, 64, 128, 4, 1e-6f}, {5, 0, 2}, 3, 29);
}

// The persistent kernels with their grid capped far below one wave: every block walks many
// units (an uneven count: units % blocks != 0), its chunk ring crossing unit boundaries (d_v 16:
// one chunk per unit, 4 / 8 units in flight; d_v 112: a partial last chunk; fresh sequences
// between old ones: chunks copied but unused). States and outputs bit-equal to kStream's.
TEST(CudaGdnDecode, PersistCappedGrid) {
  DS_REQUIRE_GPU();
  {
    PersistCap cap(7);
    check_kernels(shape_27b(), mixed_positions(5), 3, 40);
  }
  {
    PersistCap cap(1);
    check_kernels(cuda::GdnShape{2, 4, 16, 16, 4, 1e-6f}, {0, 5, 9, 1, 0}, 3, 41);
  }
  {
    PersistCap cap(3);
    check_kernels(cuda::GdnShape{4, 8, 128, 112, 4, 1e-6f}, {0, 1, 6, 300, 9}, 3, 42);
    check_kernels(cuda::GdnShape{2, 6, 32, 64, 4, 1e-6f}, {0, 3, 9, 12}, 3, 43);
    check_kernels(cuda::GdnShape{2, 4, 128, 40, 4, 1e-6f}, {0, 2, 50}, 3, 44);
  }
  {
    PersistCap cap(2);
    check_kernels(cuda::GdnShape{2, 4, 64, 128, 4, 1e-6f}, {5, 0, 2}, 3, 45);
  }
}

TEST(CudaGdnDecode, UnsupportedKernelsThrow) {
  DS_REQUIRE_GPU();
  const cuda::GdnShape s{2, 4, 16, 16, 4, 1e-6f};
  EXPECT_FALSE(cuda::gdn_decode_cluster8_supported(s));
  std::mt19937 rng(8);
  GdnSetup a(s, 2, rng);
  DevBuf<bf> proj(test::random_bf16(size_t(s.in_dim()), rng)), out(size_t(s.out_dim()));
  DevBuf<int32_t> pos(std::vector<int32_t>{3}), slot(std::vector<int32_t>{1});
  EXPECT_THROW(
      cuda::launch_gdn_decode(s, a.w(), a.pool(), proj.as<__nv_bfloat16>(), pos.ptr, slot.ptr, 1,
                              out.as<__nv_bfloat16>(), 0, GdnDecodeKernel::kCluster8),
      Error);
  // The split kernels need whole 4-channel groups per block: d_v % 8 (2 blocks), % 16 (4).
  {
    const cuda::GdnShape s40{2, 4, 128, 40, 4, 1e-6f};
    GdnSetup b(s40, 2, rng);
    DevBuf<bf> proj40(test::random_bf16(size_t(s40.in_dim()), rng)), out40(size_t(s40.out_dim()));
    EXPECT_TRUE(cuda::gdn_decode_split_supported(s40, b.pool(), 2));
    EXPECT_FALSE(cuda::gdn_decode_split_supported(s40, b.pool(), 4));
    EXPECT_FALSE(cuda::gdn_decode_split_supported(s40, b.pool(), 3));
    EXPECT_THROW(
        cuda::launch_gdn_decode(s40, b.w(), b.pool(), proj40.as<__nv_bfloat16>(), pos.ptr, slot.ptr,
                                1, out40.as<__nv_bfloat16>(), 0, GdnDecodeKernel::kSplit4),
        Error);
  }
  // A bad grid cap for the persistent kernels names the variable.
  for (const char* bad : {"0", "-3", "12x", "many"}) {
    setenv("DS_GDN_DECODE_PERSIST_BLOCKS", bad, 1);
    try {
      cuda::launch_gdn_decode(s, a.w(), a.pool(), proj.as<__nv_bfloat16>(), pos.ptr, slot.ptr, 1,
                              out.as<__nv_bfloat16>(), 0, GdnDecodeKernel::kPersist);
      ADD_FAILURE() << "DS_GDN_DECODE_PERSIST_BLOCKS=" << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("DS_GDN_DECODE_PERSIST_BLOCKS"), std::string::npos)
          << e.what();
    }
  }
  unsetenv("DS_GDN_DECODE_PERSIST_BLOCKS");
  // Every kernel moves state rows as 16-byte vectors: a misaligned pool is an error, not a
  // misaligned-address fault (the first version of this test ran kAuto on it and faulted).
  for (int shift : {1, 0}) {
    cuda::GdnStatePool odd = a.pool();
    odd.rec_state += shift;
    odd.rec_slot_stride += 1 - shift;  // 4-byte offset of the base, or an odd slot stride
    EXPECT_FALSE(cuda::gdn_decode_stream_supported(s, odd));
    EXPECT_FALSE(cuda::gdn_decode_split_supported(s, odd, 2));
    for (auto k :
         {GdnDecodeKernel::kAuto, GdnDecodeKernel::kCluster4, GdnDecodeKernel::kStream,
          GdnDecodeKernel::kStreamWhole, GdnDecodeKernel::kSplit2, GdnDecodeKernel::kSplit4,
          GdnDecodeKernel::kPersist, GdnDecodeKernel::kPersistDeep})
      EXPECT_THROW(cuda::launch_gdn_decode(s, a.w(), odd, proj.as<__nv_bfloat16>(), pos.ptr,
                                           slot.ptr, 1, out.as<__nv_bfloat16>(), 0, k),
                   Error);
  }
  DS_CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(CudaGdnDecode, VariantNames) {
  GdnDecodeKernel k = GdnDecodeKernel::kAuto;
  EXPECT_TRUE(cuda::gdn_decode_kernel_for_variant("fused_split2", &k));
  EXPECT_EQ(k, GdnDecodeKernel::kSplit2);
  EXPECT_TRUE(cuda::gdn_decode_kernel_for_variant("fused_split4", &k));
  EXPECT_EQ(k, GdnDecodeKernel::kSplit4);
  EXPECT_TRUE(cuda::gdn_decode_kernel_for_variant("fused_stream", &k));
  EXPECT_EQ(k, GdnDecodeKernel::kStream);
  EXPECT_TRUE(cuda::gdn_decode_kernel_for_variant("fused_cluster8", &k));
  EXPECT_EQ(k, GdnDecodeKernel::kCluster8);
  EXPECT_TRUE(cuda::gdn_decode_kernel_for_variant("fused", &k));
  EXPECT_EQ(k, GdnDecodeKernel::kCluster4);
  EXPECT_TRUE(cuda::gdn_decode_kernel_for_variant("fused_persist", &k));
  EXPECT_EQ(k, GdnDecodeKernel::kPersist);
  EXPECT_TRUE(cuda::gdn_decode_kernel_for_variant("fused_persist_deep", &k));
  EXPECT_EQ(k, GdnDecodeKernel::kPersistDeep);
  EXPECT_FALSE(cuda::gdn_decode_kernel_for_variant("prefill_path", &k));
}

// The gdn_in projection of one step as the engine runs it at batch <= 8: the PDL bulk GEMV.
struct InProj {
  int k = 5120;  // d_model at 27B
  DevBuf<bf> w;  // [in_dim, k]
  int n_sms = 0;
  InProj(const cuda::GdnShape& s, std::mt19937& rng)
      : w(test::random_bf16(size_t(s.in_dim()) * 5120, rng, 0.02f)) {
    DS_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, 0));
  }
  // pdl: the GEMV itself a programmatic dependent of the kernel before it (it triggers its own
  // dependents early either way).
  void launch(const cuda::GdnShape& s, const bf* x, bf* proj, int m, cudaStream_t st,
              bool pdl) const {
    cuda::GemvBulkConfig cfg = cuda::gemv_bulk_config(m, s.in_dim(), k);
    cfg.pdl = pdl;
    cuda::launch_gemv_bulk(reinterpret_cast<const __nv_bfloat16*>(x), w.as<__nv_bfloat16>(), proj,
                           m, s.in_dim(), k, cuda::GemmOut::kBF16, false, cfg, n_sms, st);
  }
};

TEST(CudaGdnDecode, PdlAfterGemv27B) {
  DS_REQUIRE_GPU();
  const cuda::GdnShape s = shape_27b();
  std::mt19937 rng(31);
  InProj gemv(s, rng);
  const int n_steps = 3;
  cudaStream_t st;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const KernelName kernels[] = {{GdnDecodeKernel::kCluster4, "cluster4"},
                                {GdnDecodeKernel::kCluster8, "cluster8"},
                                {GdnDecodeKernel::kStream, "stream"},
                                {GdnDecodeKernel::kSplit2, "split2"},
                                {GdnDecodeKernel::kSplit4, "split4"},
                                {GdnDecodeKernel::kPersist, "persist"},
                                {GdnDecodeKernel::kPersistDeep, "persist_deep"},
                                {GdnDecodeKernel::kAuto, "auto"}};
  for (int B : {1, 2, 3, 4, 8}) {
    const std::vector<int> pos = mixed_positions(B);
    GdnSetup a(s, B + 1, rng);
    const auto conv0 = a.conv.download();
    const auto rec0 = a.rec.download();
    std::vector<int32_t> slots(B), all_pos(size_t(B) * n_steps);
    for (int i = 0; i < B; ++i) slots[i] = B - i;
    for (int t = 0; t < n_steps; ++t)
      for (int i = 0; i < B; ++i) all_pos[size_t(t) * B + i] = pos[i] + t;
    DevBuf<int32_t> d_pos(all_pos), d_slots(slots);
    DevBuf<bf> x(test::random_bf16(size_t(n_steps) * B * gemv.k, rng));
    // One proj region per step, poisoned before the run. Each step's GEMV is launched without
    // PDL, so it starts once the previous step's decode has completed, as in the engine, where a
    // forward's decode kernels follow the previous forward's end (the metadata copy, a stream
    // synchronisation); with a PDL GEMV, step t + 1's decode could load the states before step
    // t's had stored them.
    DevBuf<bf> proj(size_t(n_steps) * B * s.in_dim()), out(size_t(n_steps) * B * s.out_dim());
    const auto steps = [&](cudaStream_t stream, GdnDecodeKernel k, bool pdl) {
      for (int t = 0; t < n_steps; ++t) {
        bf* pr = proj.ptr + size_t(t) * B * s.in_dim();
        gemv.launch(s, x.ptr + size_t(t) * B * gemv.k, pr, B, stream, false);
        cuda::launch_gdn_decode(s, a.w(), a.pool(), reinterpret_cast<__nv_bfloat16*>(pr),
                                d_pos.ptr + t * B, d_slots.ptr, B,
                                out.as<__nv_bfloat16>() + size_t(t) * B * s.out_dim(), stream, k,
                                pdl);
      }
    };
    for (const KernelName& kn : kernels) {
      if (!supported(kn.k, s, a.pool())) continue;
      Step ref;
      for (int graph = 0; graph < 2; ++graph) {
        for (int pdl = 0; pdl < 2; ++pdl) {
          a.conv.upload(conv0);
          a.rec.upload(rec0);
          out.poison();
          proj.poison();
          DS_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets are not ordered with `st`
          test::run_once_on(st, graph, [&] { steps(st, kn.k, pdl); });
          Step run{out.download(), a.conv.download(), a.rec.download()};
          const std::string what = std::string(kn.name) + " batch " + std::to_string(B) +
                                   (graph ? " graph" : " eager") + (pdl ? " pdl" : " plain");
          for (bf v : run.out)
            ASSERT_TRUE(std::isfinite(bf16_to_f32(v))) << what << ": output NaN or unwritten";
          if (!graph && !pdl) {
            EXPECT_NE(0, std::memcmp(run.rec.data(), rec0.data(), rec0.size() * 4)) << what;
            ref = std::move(run);
            continue;
          }
          EXPECT_EQ(0u, count_diff(run.out, ref.out)) << what << ": outputs vs eager plain";
          EXPECT_EQ(0u, count_diff(run.conv, ref.conv)) << what << ": rings vs eager plain";
          EXPECT_EQ(0, std::memcmp(run.rec.data(), ref.rec.data(), ref.rec.size() * 4))
              << what << ": states vs eager plain";
        }
      }
      std::printf("  %-8s batch %d, %d steps after the PDL GEMV: eager / graph x plain / pdl "
                  "bit-identical\n",
                  kn.name, B, n_steps);
    }
  }
  DS_CUDA_CHECK(cudaStreamDestroy(st));
}

// us per layer of the gdn_in GEMV + GDN decode pair in a CUDA graph (states and inputs rotated
// past L2), the decode launched plain or with PDL, and the GEMV alone.
TEST(CudaGdnDecode, PdlTiming) {
  DS_REQUIRE_GPU();
  DS_REQUIRE_PERF();
  const cuda::GdnShape s = shape_27b();
  std::mt19937 rng(32);
  InProj gemv(s, rng);
  for (int round = 0; round < 2; ++round) {
    std::printf("  round %d: us per layer (gdn_in GEMV + GDN decode), kernel as kAuto\n", round);
    for (int B : {1, 2, 3, 4, 8}) {
      const int rot = std::max(4, 64 / B);
      GdnSetup a(s, B * rot, rng);
      DevBuf<bf> x(test::random_bf16(size_t(B) * gemv.k * rot, rng));
      DevBuf<bf> proj(size_t(B) * s.in_dim() * rot), out(size_t(B) * s.out_dim() * rot);
      DevBuf<int32_t> pos(std::vector<int32_t>(size_t(B), 100));
      std::vector<int32_t> slots(size_t(B) * rot);
      for (size_t i = 0; i < slots.size(); ++i) slots[i] = int32_t(i);
      DevBuf<int32_t> d_slots(slots);
      double us[3];
      for (int mode = 0; mode < 3; ++mode) {  // 0: GEMV alone, 1: + plain decode, 2: + PDL
        us[mode] = test::graph_time_us(
            [&](int i, cudaStream_t st) {
              const int r = i % rot;
              bf* pr = proj.ptr + size_t(r) * B * s.in_dim();
              gemv.launch(s, x.ptr + size_t(r) * B * gemv.k, pr, B, st, true);
              if (mode > 0)
                cuda::launch_gdn_decode(s, a.w(), a.pool(), reinterpret_cast<__nv_bfloat16*>(pr),
                                        pos.ptr, d_slots.ptr + r * B, B,
                                        out.as<__nv_bfloat16>() + size_t(r) * B * s.out_dim(), st,
                                        GdnDecodeKernel::kAuto, mode == 2);
            },
            64);
      }
      std::printf("  batch %d: gemv %.2f, + decode plain %.2f (+%.2f), + decode pdl %.2f (+%.2f)\n",
                  B, us[0], us[1], us[1] - us[0], us[2], us[2] - us[0]);
    }
  }
}

TEST(CudaGdnDecode, Timing) {
  DS_REQUIRE_GPU();
  DS_REQUIRE_PERF();
  const cuda::GdnShape s = shape_27b();
  std::mt19937 rng(9);
  for (int round = 0; round < 2; ++round) {
    std::printf("  round %d (us per launch, TB/s of state read + written)\n", round);
    for (int B : {1, 2, 3, 4, 6, 8, 12, 16, 32}) {
      const int rot = std::max(4, 64 / B);  // 64 x 3 MiB of state at batch 1: past L2
      GdnSetup a(s, B * rot, rng);
      DevBuf<bf> proj(test::random_bf16(size_t(B) * s.in_dim() * rot, rng)),
          out(size_t(B) * s.out_dim() * rot);
      DevBuf<int32_t> pos(std::vector<int32_t>(size_t(B), 100));
      std::vector<int32_t> slots(size_t(B) * rot);
      for (size_t i = 0; i < slots.size(); ++i) slots[i] = int32_t(i);
      DevBuf<int32_t> d_slots(slots);
      const double bytes = 2.0 * B * s.n_v_heads * s.d_v * s.d_k * 4;
      std::printf("  gdn decode batch %2d:", B);
      for (const KernelName& kn : kKernels) {
        const double us = test::graph_time_us(
            [&](int i, cudaStream_t st) {
              const int r = i % rot;
              cuda::launch_gdn_decode(
                  s, a.w(), a.pool(), proj.as<__nv_bfloat16>() + size_t(r) * B * s.in_dim(),
                  pos.ptr, d_slots.ptr + r * B, B,
                  out.as<__nv_bfloat16>() + size_t(r) * B * s.out_dim(), st, kn.k);
            },
            64);
        std::printf("  %s %.2f (%.2f)", kn.name, us, bytes / us * 1e-6);
      }
      {  // The ceiling at this size: a device-to-device copy of the same state bytes.
        const size_t per = size_t(B) * s.n_v_heads * s.d_v * s.d_k;
        DevBuf<float> dst(per * rot);
        const double us = test::graph_time_us(
            [&](int i, cudaStream_t st) {
              const int r = i % rot;
              DS_CUDA_CHECK(cudaMemcpyAsync(dst.ptr + r * per, a.rec.ptr + r * per, per * 4,
                                            cudaMemcpyDeviceToDevice, st));
            },
            64);
        std::printf("  copy %.2f (%.2f)", us, bytes / us * 1e-6);
      }
      std::printf("\n");
    }
  }
}

}  // namespace
}  // namespace ds
