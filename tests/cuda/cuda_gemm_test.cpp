// cuBLASLt GEMM plans: y[m, n] = x[m, k] w[n, k]^T against a CPU fp64 loop (a sample of rows for
// large m), bf16 and fp32 outputs, accumulate (+=), m = 1, 7, 64, 65, 4097 and the 27B decode /
// prompt shapes. Tolerance: normalised L2 < 8e-3 (bf16 output rounding), < 1e-4 for fp32 output.
// Plans are made once per shape (late_plans counts the ones run() had to make itself).
#include <gtest/gtest.h>

#include "cuda/gemm.h"
#include "cuda_test_util.h"

namespace ds {
namespace {

using test::DevBuf;
using bf = uint16_t;

void check_gemm(cuda::GemmEngine& g, int m, int n, int k, cuda::GemmOut out_t, bool acc,
                std::mt19937& rng) {
  auto x = test::random_bf16(size_t(m) * k, rng), w = test::random_bf16(size_t(n) * k, rng, 0.05f);
  DevBuf<bf> dx(x), dw(w);
  const bool f32 = out_t == cuda::GemmOut::kF32;
  DevBuf<char> y(size_t(m) * n * (f32 ? 4 : 2));
  std::vector<float> init(size_t(m) * n, 0.f);
  if (acc) {
    std::normal_distribution<float> nd;
    for (auto& v : init) v = f32 ? nd(rng) : round_bf16(nd(rng));
    if (f32) {
      DS_CUDA_CHECK(cudaMemcpy(y.ptr, init.data(), init.size() * 4, cudaMemcpyHostToDevice));
    } else {
      std::vector<bf> ib(init.size());
      for (size_t i = 0; i < ib.size(); ++i) ib[i] = f32_to_bf16(init[i]);
      DS_CUDA_CHECK(cudaMemcpy(y.ptr, ib.data(), ib.size() * 2, cudaMemcpyHostToDevice));
    }
  } else {
    y.poison();
  }
  g.run(dx.as<__nv_bfloat16>(), dw.as<__nv_bfloat16>(), y.ptr, m, n, k, out_t, 0, acc);
  auto raw = y.download();
  std::vector<int> rows;
  if (m <= 70)
    for (int i = 0; i < m; ++i) rows.push_back(i);
  else
    for (int i : {0, 1, 63, 64, 65, m / 2, m - 2, m - 1}) rows.push_back(i);
  std::vector<float> got, ref;
  for (int r : rows)
    for (int j = 0; j < n; ++j) {
      double s = acc ? init[size_t(r) * n + j] : 0.0;
      for (int c = 0; c < k; ++c)
        s += double(bf16_to_f32(x[size_t(r) * k + c])) * bf16_to_f32(w[size_t(j) * k + c]);
      ref.push_back(float(s));
      const size_t idx = size_t(r) * n + j;
      got.push_back(f32 ? reinterpret_cast<const float*>(raw.data())[idx]
                        : bf16_to_f32(reinterpret_cast<const bf*>(raw.data())[idx]));
    }
  const double e = test::norm_err(got, ref);
  EXPECT_LT(e, f32 ? 1e-4 : 8e-3) << "m " << m << " n " << n << " k " << k
                                  << (f32 ? " f32" : " bf16") << (acc ? " +=" : "");
}

TEST(CudaGemm, OddAndSmallShapes) {
  DS_REQUIRE_GPU();
  cuda::GemmEngine g;
  std::mt19937 rng(1);
  for (int m : {1, 7, 64, 65, 4097})
    for (auto [n, k] : {std::pair{96, 64}, std::pair{520, 200}, std::pair{48, 5120}}) {
      check_gemm(g, m, n, k, cuda::GemmOut::kBF16, false, rng);
      check_gemm(g, m, n, k, cuda::GemmOut::kF32, false, rng);
    }
  check_gemm(g, 65, 520, 200, cuda::GemmOut::kBF16, true, rng);
  check_gemm(g, 3, 520, 200, cuda::GemmOut::kF32, true, rng);
}

TEST(CudaGemm, Shapes27b) {
  DS_REQUIRE_GPU();
  cuda::GemmEngine g;
  std::mt19937 rng(2);
  g.prepare(1, 16480, 5120, cuda::GemmOut::kBF16);
  check_gemm(g, 1, 16480, 5120, cuda::GemmOut::kBF16, false, rng);  // fused GDN in_proj
  check_gemm(g, 4, 5120, 17408, cuda::GemmOut::kBF16, false, rng);  // down, batch 4
  check_gemm(g, 512, 2048 + 2048 + 12288, 5120, cuda::GemmOut::kBF16, false, rng);  // attention qkv
  check_gemm(g, 2, 248320, 5120, cuda::GemmOut::kF32, false, rng);                  // lm_head
  EXPECT_EQ(g.late_plans(), 3);  // the first shape was prepared
  EXPECT_EQ(g.n_plans(), 4);
}

}  // namespace
}  // namespace ds
