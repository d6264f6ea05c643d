// cuBLASLt GEMM plans: y[m, n] = x[m, k] w[n, k]^T against a CPU fp64 loop (a sample of rows for
// large m), bf16 and fp32 outputs, accumulate (+=), m = 1, 7, 64, 65, 4097 and the 27B decode /
// prompt shapes. Tolerance: normalised L2 < 8e-3 (bf16 output rounding), < 1e-4 for fp32 output.
// Plans are made once per shape (late_plans counts the ones run() had to make itself).
// Tuning (GemmEngine::tune): on every 27B decode (m 1, 3, 8, 16) and prompt (m 4096) shape the
// tuned plan's output matches the untuned engine's within the same tolerance and a fp64 reference
// on sampled rows x columns; DS_GEMM_TUNE=0 keeps the heuristic's algorithm; tuning twice, one
// candidate, borrowed algorithms and a capturing stream never throw and stay correct.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "cuda/gemm.h"
#include "cuda/kernels.h"
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

// Sets (or unsets, value null) an environment variable for one scope.
struct EnvGuard {
  std::string name, old;
  bool had = false;
  EnvGuard(const char* n, const char* value) : name(n) {
    if (const char* o = std::getenv(n)) had = true, old = o;
    if (value)
      setenv(n, value, 1);
    else
      unsetenv(n);
  }
  ~EnvGuard() {
    if (had)
      setenv(name.c_str(), old.c_str(), 1);
    else
      unsetenv(name.c_str());
  }
};

// Device buffers of one shape: n_w weight matrices, x, and the outputs of two engines.
struct TuneCase {
  int m, n, k;
  cuda::GemmOut out;
  std::vector<std::unique_ptr<DevBuf<bf>>> w;
  DevBuf<bf> x;
  DevBuf<char> y0, y1;
  TuneCase(int m_, int n_, int k_, cuda::GemmOut o, int n_w, uint64_t seed)
      : m(m_),
        n(n_),
        k(k_),
        out(o),
        x(size_t(m_) * k_),
        y0(size_t(m_) * n_ * (o == cuda::GemmOut::kF32 ? 4 : 2)),
        y1(size_t(m_) * n_ * (o == cuda::GemmOut::kF32 ? 4 : 2)) {
    for (int i = 0; i < n_w; ++i) {
      w.push_back(std::make_unique<DevBuf<bf>>(size_t(n) * k));
      cuda::launch_fill_synthetic_normal_bf16(w.back()->as<__nv_bfloat16>(), int64_t(n) * k,
                                              seed + 100 + i, 0.f, 0.05f, 0);
    }
    fill_x(seed);
  }
  void fill_x(uint64_t seed) {
    cuda::launch_fill_synthetic_normal_bf16(x.as<__nv_bfloat16>(), int64_t(m) * k, seed, 0.f, 1.f,
                                            0);
    DS_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<const __nv_bfloat16*> weights() const {
    std::vector<const __nv_bfloat16*> v;
    for (const auto& b : w) v.push_back(b->as<__nv_bfloat16>());
    return v;
  }
  bool f32() const { return out == cuda::GemmOut::kF32; }
  std::vector<float> values(const DevBuf<char>& y) const {
    auto raw = y.download();
    std::vector<float> v(size_t(m) * n);
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = f32() ? reinterpret_cast<const float*>(raw.data())[i]
                   : bf16_to_f32(reinterpret_cast<const bf*>(raw.data())[i]);
    return v;
  }
};

// Runs the untuned engine g0 and the tuned g1 on fresh x with weight 0 and compares: the two
// outputs (whole), and g1 against a fp64 reference on sampled rows x 64 sampled columns.
void check_tuned(cuda::GemmEngine& g0, cuda::GemmEngine& g1, TuneCase& c, uint64_t seed) {
  c.fill_x(seed);
  c.y0.poison();
  c.y1.poison();
  const auto* w0 = c.w[0]->as<__nv_bfloat16>();
  g0.run(c.x.as<__nv_bfloat16>(), w0, c.y0.ptr, c.m, c.n, c.k, c.out, 0);
  g1.run(c.x.as<__nv_bfloat16>(), w0, c.y1.ptr, c.m, c.n, c.k, c.out, 0);
  const auto v0 = c.values(c.y0), v1 = c.values(c.y1);
  const double tol = c.f32() ? 1e-4 : 8e-3;
  const std::string what = "m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " +
                           std::to_string(c.k) + (c.f32() ? " f32" : " bf16");
  EXPECT_LT(test::norm_err(v1, v0), tol) << what << ": tuned vs untuned";
  // fp64 reference on a sample.
  std::vector<int> rows, cols;
  for (int r : {0, 1, c.m / 2, c.m - 1})
    if (r >= 0 && r < c.m && (rows.empty() || rows.back() != r)) rows.push_back(r);
  std::mt19937 rng{static_cast<uint32_t>(seed)};
  for (int j = 0; j < 64; ++j) cols.push_back(int(rng() % uint32_t(c.n)));
  std::vector<bf> xr(c.k), wr(c.k);
  std::vector<float> got, ref;
  for (int r : rows) {
    DS_CUDA_CHECK(
        cudaMemcpy(xr.data(), c.x.ptr + size_t(r) * c.k, c.k * 2, cudaMemcpyDeviceToHost));
    for (int j : cols) {
      DS_CUDA_CHECK(
          cudaMemcpy(wr.data(), c.w[0]->ptr + size_t(j) * c.k, c.k * 2, cudaMemcpyDeviceToHost));
      double s = 0;
      for (int i = 0; i < c.k; ++i) s += double(bf16_to_f32(xr[i])) * bf16_to_f32(wr[i]);
      ref.push_back(float(s));
      got.push_back(v1[size_t(r) * c.n + j]);
    }
  }
  EXPECT_LT(test::norm_err(got, ref), tol) << what << ": tuned vs fp64";
}

TEST(CudaGemmTune, Shapes27bMatchUntuned) {
  DS_REQUIRE_GPU();
  EnvGuard env("DS_GEMM_TUNE", nullptr);
  cuda::GemmEngine g0, g1;
  struct S {
    int n, k;
    cuda::GemmOut out;
  };
  const cuda::GemmOut b16 = cuda::GemmOut::kBF16;
  const std::vector<S> decode = {{16480, 5120, b16}, {5120, 6144, b16},
                                 {14336, 5120, b16}, {34816, 5120, b16},
                                 {5120, 17408, b16}, {248320, 5120, cuda::GemmOut::kF32}};
  uint64_t seed = 1;
  int n_timed = 0, n_changed = 0;
  for (const S& s : decode) {
    const bool lm = s.n == 248320;
    TuneCase c(16, s.n, s.k, s.out, lm ? 1 : 2, seed++);
    for (int m : {1, 3, 8, 16}) {
      c.m = m;
      cuda::GemmTuneOptions o;
      o.max_weights = 2;
      o.use_process_cache = false;  // time here even if another test tuned the shape
      const auto r =
          g1.tune(m, s.n, s.k, s.out, c.weights(), c.x.as<__nv_bfloat16>(), c.y1.ptr, 0, false, o);
      std::printf("%s\n", r.to_string().c_str());
      EXPECT_TRUE(r.timed || r.candidates == 1) << r.to_string();
      if (r.timed) {
        EXPECT_GE(r.ran, 1);
        EXPECT_LE(r.ran, r.candidates);
        EXPECT_GT(r.heuristic_us, 0);
        EXPECT_LE(r.chosen_us, r.heuristic_us);
      }
      EXPECT_EQ(r.chosen == 0, g1.uses_heuristic_algo(m, s.n, s.k, s.out));
      n_timed += r.timed;
      n_changed += r.chosen != 0;
      check_tuned(g0, g1, c, seed++);
    }
  }
  // Prompt chunk: 4096 tokens, the 6 prompt shapes (down included: no skinny kernel at m 4096).
  for (const S& s : decode) {
    if (s.n == 248320) continue;
    TuneCase c(4096, s.n, s.k, s.out, 1, seed++);
    cuda::GemmTuneOptions o;
    o.max_candidates = 8;
    o.batches = 3;
    o.use_process_cache = false;
    const auto r =
        g1.tune(4096, s.n, s.k, s.out, c.weights(), c.x.as<__nv_bfloat16>(), c.y1.ptr, 0, false, o);
    std::printf("%s\n", r.to_string().c_str());
    EXPECT_TRUE(r.timed || r.candidates == 1) << r.to_string();
    n_timed += r.timed;
    n_changed += r.chosen != 0;
    check_tuned(g0, g1, c, seed++);
  }
  std::printf("tuned %d shapes, %d changed from the heuristic's choice\n", n_timed, n_changed);
  EXPECT_GE(n_timed, 20) << "of 30 shapes: cuBLASLt offered a single candidate too often";
  EXPECT_EQ(g1.late_plans(), 0);
  std::printf("%s", g1.describe().c_str());
}

// Sustained windows (GemmTuneOptions::window_ms): every candidate is timed, the kept one is the
// fastest of them (or the heuristic's within min_gain), and the tuned plan computes the product.
TEST(CudaGemmTune, SustainedWindowsKeepTheFastest) {
  DS_REQUIRE_GPU();
  EnvGuard env("DS_GEMM_TUNE", nullptr);
  cuda::GemmEngine g0, g1;
  TuneCase c(2048, 5120, 6144, cuda::GemmOut::kBF16, 2, 31);
  for (bool acc : {false, true}) {
    cuda::GemmTuneOptions o;
    o.max_candidates = 4;
    o.max_weights = 2;
    o.window_ms = 10;
    o.rounds = 3;
    o.use_process_cache = false;
    const auto r = g1.tune(c.m, c.n, c.k, c.out, c.weights(), c.x.as<__nv_bfloat16>(), c.y1.ptr,
                           0, acc, o);
    std::printf("%s\n", r.to_string().c_str());
    EXPECT_TRUE(r.sustained);
    EXPECT_NE(r.to_string().find("sustained"), std::string::npos);
    ASSERT_EQ(r.cand_desc.size(), size_t(r.candidates));
    for (const std::string& d : r.cand_desc) EXPECT_EQ(d.rfind("id ", 0), 0u) << d;
    if (r.candidates == 1) continue;  // nothing to time
    ASSERT_TRUE(r.timed) << r.to_string();
    ASSERT_EQ(r.cand_us.size(), size_t(r.candidates));
    double best = 1e30;
    for (size_t i = 0; i < r.cand_us.size(); ++i) {
      std::printf("  #%zu %9.2f us  %s\n", i, r.cand_us[i], r.cand_desc[i].c_str());
      if (r.cand_us[i] > 0) best = std::min(best, r.cand_us[i]);
    }
    EXPECT_EQ(r.ran, int(std::count_if(r.cand_us.begin(), r.cand_us.end(),
                                       [](double t) { return t > 0; })));
    EXPECT_DOUBLE_EQ(r.heuristic_us, r.cand_us[0]);
    EXPECT_DOUBLE_EQ(r.chosen_us, r.cand_us[size_t(r.chosen)]);
    if (r.chosen != 0) {
      EXPECT_DOUBLE_EQ(r.chosen_us, best);
      EXPECT_LE(best, r.heuristic_us * (1.0 - o.min_gain));
    } else {  // kept: no candidate was min_gain faster
      EXPECT_GT(best, r.heuristic_us * (1.0 - o.min_gain));
    }
  }
  check_tuned(g0, g1, c, 32);
  EXPECT_EQ(g1.late_plans(), 0);
}

// Not a test: with DS_GEMM_TUNE_PROBE=1, the 27B prompt shapes at m = 8192 (and 4096) are tuned
// as the engine does at start-up (8 candidates, 3 short batches) and then in sustained windows
// ($DS_GEMM_TUNE_PROBE_WINDOW ms, default 200; 3 rounds; $DS_GEMM_TUNE_PROBE_CANDIDATES, default
// 16), printing every candidate's time both ways: do the rankings differ at the power cap?
TEST(CudaGemmTune, SustainedProbe27b) {
  DS_REQUIRE_GPU();
  const char* probe = std::getenv("DS_GEMM_TUNE_PROBE");
  if (probe == nullptr || std::string(probe) != "1") GTEST_SKIP() << "DS_GEMM_TUNE_PROBE=1 runs it";
  EnvGuard env("DS_GEMM_TUNE", nullptr);
  const char* we = std::getenv("DS_GEMM_TUNE_PROBE_WINDOW");
  const char* ce = std::getenv("DS_GEMM_TUNE_PROBE_CANDIDATES");
  const double window = we ? std::atof(we) : 200.0;
  const int cands = ce ? std::atoi(ce) : 16;
  struct S {
    const char* name;
    int n, k;
    bool acc;
  };
  const std::vector<S> shapes = {{"gate_up", 34816, 5120, false}, {"down+=", 5120, 17408, true},
                                 {"gdn_in", 16480, 5120, false},  {"gdn_out+=", 5120, 6144, true},
                                 {"attn_qkv", 14336, 5120, false}, {"down", 5120, 17408, false}};
  cuda::GemmEngine g;
  uint64_t seed = 500;
  for (int m : {8192, 4096}) {
    for (const S& s : shapes) {
      TuneCase c(m, s.n, s.k, cuda::GemmOut::kBF16, 1, seed++);
      cuda::GemmTuneOptions cold;
      cold.max_candidates = 8;
      cold.max_weights = 1;
      cold.batches = 3;
      cold.use_process_cache = false;
      const auto rc = g.tune(m, s.n, s.k, c.out, c.weights(), c.x.as<__nv_bfloat16>(), c.y1.ptr,
                             0, s.acc, cold);
      cuda::GemmTuneOptions hot = cold;
      hot.max_candidates = cands;
      hot.window_ms = window;
      hot.rounds = 3;
      const auto rh = g.tune(m, s.n, s.k, c.out, c.weights(), c.x.as<__nv_bfloat16>(), c.y1.ptr,
                             0, s.acc, hot);
      const double flop = 2.0 * m * s.n * s.k;
      std::printf("PROBE %s m=%d: cold picks #%d (%s), sustained picks #%d (%s)\n", s.name, m,
                  rc.chosen, rc.cand_desc.empty() ? "-" : rc.cand_desc[rc.chosen].c_str(),
                  rh.chosen, rh.cand_desc.empty() ? "-" : rh.cand_desc[rh.chosen].c_str());
      for (size_t i = 0; i < rh.cand_desc.size(); ++i) {
        int cold_i = -1;
        for (size_t j = 0; j < rc.cand_desc.size(); ++j)
          if (rc.cand_desc[j] == rh.cand_desc[i]) cold_i = int(j);
        const double tc =
            cold_i >= 0 && size_t(cold_i) < rc.cand_us.size() ? rc.cand_us[cold_i] : -1;
        const double th = i < rh.cand_us.size() ? rh.cand_us[i] : -1;
        std::printf("PROBE %s m=%d  #%2zu sustained %9.1f us %6.1f TFLOP/s | cold #%2d %9.1f us "
                    "%6.1f TFLOP/s | %s\n",
                    s.name, m, i, th, th > 0 ? flop / th * 1e-6 : 0.0, cold_i, tc,
                    tc > 0 ? flop / tc * 1e-6 : 0.0, rh.cand_desc[i].c_str());
      }
      std::fflush(stdout);
    }
  }
}

TEST(CudaGemmTune, DisabledKeepsHeuristic) {
  DS_REQUIRE_GPU();
  EnvGuard env("DS_GEMM_TUNE", "0");
  EXPECT_FALSE(cuda::GemmEngine::tuning_enabled());
  cuda::GemmEngine g0, g1;
  TuneCase c(1, 14336, 5120, cuda::GemmOut::kBF16, 2, 7);
  const auto r = g1.tune(1, c.n, c.k, c.out, c.weights(), c.x.as<__nv_bfloat16>(), c.y1.ptr, 0);
  EXPECT_FALSE(r.timed);
  EXPECT_NE(r.note.find("DS_GEMM_TUNE=0"), std::string::npos) << r.note;
  EXPECT_TRUE(g1.uses_heuristic_algo(1, c.n, c.k, c.out));
  EXPECT_EQ(g1.n_plans(), 1);
  check_tuned(g0, g1, c, 8);
}

TEST(CudaGemmTune, TwiceSingleCandidateBorrowAndCapture) {
  DS_REQUIRE_GPU();
  EnvGuard env("DS_GEMM_TUNE", nullptr);
  EXPECT_TRUE(cuda::GemmEngine::tuning_enabled());
  cuda::GemmEngine g0, g1;
  TuneCase c(4, 16480, 5120, cuda::GemmOut::kBF16, 3, 11);
  // Twice: the second call re-times from the heuristic and stays correct.
  cuda::GemmTuneOptions fresh;
  fresh.use_process_cache = false;
  cuda::GemmTuneResult last;
  for (int rep = 0; rep < 2; ++rep) {
    last = g1.tune(4, c.n, c.k, c.out, c.weights(), c.x.as<__nv_bfloat16>(), c.y1.ptr, 0, false,
                   fresh);
    EXPECT_TRUE(last.timed || last.candidates == 1) << last.to_string();
    EXPECT_FALSE(last.cached);
    check_tuned(g0, g1, c, 20 + rep);
  }
  EXPECT_EQ(g1.n_plans(), 1);
  // Another engine of this process reuses that choice (process cache): bit-identical outputs.
  {
    cuda::GemmEngine g2;
    const auto r2 = g2.tune(4, c.n, c.k, c.out, c.weights(), c.x.as<__nv_bfloat16>(), c.y1.ptr, 0);
    if (last.timed) {
      EXPECT_TRUE(r2.cached) << r2.to_string();
      EXPECT_EQ(r2.chosen, last.chosen);
    }
    EXPECT_EQ(g2.uses_heuristic_algo(4, c.n, c.k, c.out),
              g1.uses_heuristic_algo(4, c.n, c.k, c.out));
    c.fill_x(25);
    c.y0.poison();
    c.y1.poison();
    g1.run(c.x.as<__nv_bfloat16>(), c.w[0]->as<__nv_bfloat16>(), c.y0.ptr, 4, c.n, c.k, c.out, 0);
    g2.run(c.x.as<__nv_bfloat16>(), c.w[0]->as<__nv_bfloat16>(), c.y1.ptr, 4, c.n, c.k, c.out, 0);
    const auto a = c.y0.download(), b = c.y1.download();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), size_t(4) * c.n * 2), 0)
        << "two engines of one process differ on a tuned shape";
  }
  // One candidate: nothing to time, heuristic kept, no throw.
  c.m = 2;
  cuda::GemmTuneOptions one;
  one.max_candidates = 1;
  one.use_process_cache = false;
  const auto r1 =
      g1.tune(2, c.n, c.k, c.out, c.weights(), c.x.as<__nv_bfloat16>(), c.y1.ptr, 0, false, one);
  EXPECT_FALSE(r1.timed);
  EXPECT_EQ(r1.candidates, 1);
  EXPECT_TRUE(g1.uses_heuristic_algo(2, c.n, c.k, c.out));
  check_tuned(g0, g1, c, 30);
  // Borrowed: m 3 tries the heuristic's choice and what m 2 and 4 kept (when cuBLASLt accepts it).
  c.m = 3;
  cuda::GemmTuneOptions borrow = one;
  borrow.borrow_m = {2, 4};
  const auto r3 =
      g1.tune(3, c.n, c.k, c.out, c.weights(), c.x.as<__nv_bfloat16>(), c.y1.ptr, 0, false, borrow);
  std::printf("%s\n", r3.to_string().c_str());
  EXPECT_GE(r3.candidates, 1);
  EXPECT_LE(r3.candidates,
            3);  // m 3's heuristic choice + at most one each from m 2 and m 4
  check_tuned(g0, g1, c, 31);
  // Tiny shapes with few candidates, fp32 output and accumulate: no throw, correct.
  std::mt19937 rng(5);
  for (auto [m, n, k] : {std::tuple{1, 24, 16}, std::tuple{7, 96, 64}, std::tuple{65, 520, 200}}) {
    TuneCase t(m, n, k, cuda::GemmOut::kF32, 1, 40 + m);
    const auto r = g1.tune(m, n, k, t.out, t.weights(), t.x.as<__nv_bfloat16>(), t.y1.ptr, 0);
    EXPECT_GE(r.candidates, 1) << r.to_string();
    check_tuned(g0, g1, t, 50 + m);
    const auto ra = g1.tune(m, n, k, cuda::GemmOut::kBF16, t.weights(), t.x.as<__nv_bfloat16>(),
                            t.y1.ptr, 0, true);
    EXPECT_GE(ra.candidates, 1) << ra.to_string();
    check_gemm(g1, m, n, k, cuda::GemmOut::kBF16, true, rng);
  }
  // A stream under capture: nothing is launched, heuristic kept.
  cudaStream_t s = nullptr;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  DS_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  c.m = 5;
  const auto rc = g1.tune(5, c.n, c.k, c.out, c.weights(), c.x.as<__nv_bfloat16>(), c.y1.ptr, s);
  cudaGraph_t graph = nullptr;
  DS_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  if (graph) DS_CUDA_CHECK(cudaGraphDestroy(graph));
  DS_CUDA_CHECK(cudaStreamDestroy(s));
  EXPECT_FALSE(rc.timed);
  EXPECT_NE(rc.note.find("capturing"), std::string::npos) << rc.note;
  EXPECT_TRUE(g1.uses_heuristic_algo(5, c.n, c.k, c.out));
  // Bad arguments: a clear error.
  EXPECT_THROW(g1.tune(1, c.n, c.k, c.out, {}, c.x.as<__nv_bfloat16>(), c.y1.ptr, 0), ds::Error);
  EXPECT_THROW(g1.tune(0, c.n, c.k, c.out, c.weights(), c.x.as<__nv_bfloat16>(), c.y1.ptr, 0),
               ds::Error);
}

}  // namespace
}  // namespace ds
