// GPU tests of the GDN decode kernel's two block splits (src/cuda/gdn_decode.cu): 8-block clusters
// per value head (kCluster8, what kAuto takes at small batch) against 4-block clusters
// (kCluster4, checked against the fp32 CPU recurrence in cuda_gdn_test.cpp, which also runs
// kAuto at batch 1) on identical inputs and initial states. A row's state update is computed
// identically by both, so the new states must be bit-equal and the conv rings equal; the output
// differs only in the order of the gated RMSNorm's sum of squares (tolerance 1e-3). Shapes: 27B
// (16 k / 48 v heads, d 128) at batch 1 / 2 / 3 / 16, positions 0 (fresh state) and later, and
// small heads (d 32, 64). Timing (prints): both at batch 1 / 2 / 4 / 16 in CUDA graphs, states
// rotated past L2, state bandwidth.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/gdn.h"
#include "cuda_graph_timer.h"
#include "cuda_test_util.h"

namespace ds {
namespace {

using bf = uint16_t;
using cuda::GdnDecodeKernel;
using test::DevBuf;

cuda::GdnShape shape_27b() { return cuda::GdnShape{16, 48, 128, 128, 4, 1e-6f}; }

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

// Runs one step with each kernel from the same initial state; compares.
void compare_splits(const cuda::GdnShape& s, const std::vector<int>& pos, uint32_t seed) {
  std::mt19937 rng(seed);
  const int n = int(pos.size());
  ASSERT_TRUE(cuda::gdn_decode_cluster8_supported(s));
  GdnSetup a(s, n + 1, rng);
  const auto conv0 = a.conv.download();
  const auto rec0 = a.rec.download();
  std::vector<int32_t> slots(n);
  for (int i = 0; i < n; ++i) slots[i] = n - i;  // slot 0 unused
  DevBuf<bf> proj(test::random_bf16(size_t(n) * s.in_dim(), rng));
  DevBuf<int32_t> d_pos(std::vector<int32_t>(pos.begin(), pos.end())), d_slots(slots);
  std::vector<bf> outs[2], convs[2];
  std::vector<float> recs[2];
  int k = 0;
  for (auto which : {GdnDecodeKernel::kCluster8, GdnDecodeKernel::kCluster4}) {
    a.conv.upload(conv0);
    a.rec.upload(rec0);
    DevBuf<bf> out(size_t(n) * s.out_dim());
    out.poison();
    cuda::launch_gdn_decode(s, a.w(), a.pool(), proj.as<__nv_bfloat16>(), d_pos.ptr, d_slots.ptr, n,
                            out.as<__nv_bfloat16>(), 0, which);
    DS_CUDA_CHECK(cudaGetLastError());
    outs[k] = out.download();
    convs[k] = a.conv.download();
    recs[k] = a.rec.download();
    for (bf x : outs[k]) ASSERT_TRUE(std::isfinite(bf16_to_f32(x))) << "output not written";
    ++k;
  }
  EXPECT_EQ(0, std::memcmp(recs[0].data(), recs[1].data(), recs[0].size() * 4)) << "states differ";
  EXPECT_EQ(convs[0], convs[1]) << "conv rings differ";
  // Slot 0 is untouched by both.
  const size_t per = size_t(s.n_v_heads) * s.d_v * s.d_k;
  EXPECT_EQ(0, std::memcmp(recs[0].data(), rec0.data(), per * 4)) << "slot 0 written";
  const double e = test::norm_err(test::to_f32(outs[0]), test::to_f32(outs[1]));
  EXPECT_LT(e, 1e-3);
  std::printf("  d %d batch %d: output cluster8 vs cluster4 %.2e, states bit-equal\n", s.d_v, n, e);
}

TEST(CudaGdnDecode, Cluster8MatchesCluster4) {
  DS_REQUIRE_GPU();
  compare_splits(shape_27b(), {0}, 1);
  compare_splits(shape_27b(), {5000}, 2);
  compare_splits(shape_27b(), {3, 1}, 3);
  compare_splits(shape_27b(), {0, 77, 4097}, 4);
  std::vector<int> p16;
  for (int i = 0; i < 16; ++i) p16.push_back(i * 131);
  compare_splits(shape_27b(), p16, 5);
  compare_splits(cuda::GdnShape{2, 4, 64, 64, 4, 1e-6f}, {0, 3, 9}, 6);
  compare_splits(cuda::GdnShape{2, 6, 32, 32, 4, 1e-6f}, {2, 1000}, 7);
}

TEST(CudaGdnDecode, Cluster8Unsupported) {
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
}

TEST(CudaGdnDecode, Timing) {
  DS_REQUIRE_GPU();
  const cuda::GdnShape s = shape_27b();
  std::mt19937 rng(9);
  for (int B : {1, 2, 4, 16}) {
    const int rot = std::max(4, 64 / B);  // 64 x 3 MiB of state at batch 1: past L2
    GdnSetup a(s, B * rot, rng);
    DevBuf<bf> proj(test::random_bf16(size_t(B) * s.in_dim() * rot, rng)),
        out(size_t(B) * s.out_dim() * rot);
    DevBuf<int32_t> pos(std::vector<int32_t>(size_t(B), 100));
    std::vector<int32_t> slots(size_t(B) * rot);
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = int32_t(i);
    DevBuf<int32_t> d_slots(slots);
    double us[2];
    int k = 0;
    for (auto which : {GdnDecodeKernel::kCluster8, GdnDecodeKernel::kCluster4})
      us[k++] = test::graph_time_us(
          [&](int i, cudaStream_t st) {
            const int r = i % rot;
            cuda::launch_gdn_decode(
                s, a.w(), a.pool(), proj.as<__nv_bfloat16>() + size_t(r) * B * s.in_dim(), pos.ptr,
                d_slots.ptr + r * B, B, out.as<__nv_bfloat16>() + size_t(r) * B * s.out_dim(), st,
                which);
          },
          64);
    const double bytes = 2.0 * B * s.n_v_heads * s.d_v * s.d_k * 4;
    std::printf(
        "  gdn decode batch %2d: cluster8 %.2f us (%.2f TB/s), cluster4 %.2f us (%.2f TB/s)\n", B,
        us[0], bytes / us[0] * 1e-6, us[1], bytes / us[1] * 1e-6);
  }
}

}  // namespace
}  // namespace ds
