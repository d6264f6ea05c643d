// The fused argmax's keys (src/cuda/argmax_key.h) against greedy_token (runtime/backend.h), the
// definition the device argmax must reproduce: a row's token from the maximum of its keys, reduced
// in any partition and any order (as the GEMV's warps, blocks and atomics do), is greedy_token's
// on rows of every kind: ties (several equal maxima, +0 against -0), NaN and +inf anywhere, rows
// of -inf, subnormals, the float extremes. Plain C++: runs in CI (the GPU test
// CudaGemvBulk.ArgmaxFusedMatchesSeparate holds the kernel to launch_argmax_rows).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "cuda/argmax_key.h"
#include "runtime/backend.h"

namespace ds {
namespace {

using cuda::argmax_key;
using cuda::argmax_key_max;
using cuda::argmax_key_token;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// The token from the keys of `row`, folded in the order `order` gives (a permutation of ids).
int32_t token_in_order(const std::vector<float>& row, const std::vector<int>& order) {
  uint64_t best = cuda::kArgmaxKeyNone;
  for (int i : order) best = argmax_key_max(best, argmax_key(row[i], uint32_t(i)));
  return argmax_key_token(best);
}

int32_t token_sequential(const std::vector<float>& row) {
  std::vector<int> order(row.size());
  std::iota(order.begin(), order.end(), 0);
  return token_in_order(row, order);
}

TEST(ArgmaxKey, HandPickedRowsMatchGreedyToken) {
  const float den = std::numeric_limits<float>::denorm_min();
  const float mx = std::numeric_limits<float>::max();
  const std::vector<std::vector<float>> rows = {
      {1, 3, 2, 3},         {-5, -1, -1},           {-kInf, -kInf, -kInf},
      {-kInf, -3, -kInf},   {1, kNan, 2},           {1, kInf, 2},
      {kNan},               {kInf},                 {-kInf},
      {-0.f, 0.f},          {0.f, -0.f},            {-1.f, -0.f, 0.f, -0.f},
      {-den, den, 0.f},     {-den, -0.f},           {den, 2 * den, 2 * den},
      {mx, -mx, mx},        {-mx, -mx},             {-kInf, -mx},
      {-kInf, kNan, -kInf}, {3, 3, 3, 3, kInf},     {-kNan, 1},
      {7},                  {0.f},                  {-0.f},
  };
  for (const auto& row : rows) {
    SCOPED_TRACE(::testing::PrintToString(row));
    EXPECT_EQ(token_sequential(row), greedy_token(row));
    std::vector<int> rev(row.size());
    std::iota(rev.rbegin(), rev.rend(), 0);
    EXPECT_EQ(token_in_order(row, rev), greedy_token(row));
  }
}

TEST(ArgmaxKey, KeyOrderIsValueThenLowerId) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-4.f, 4.f);
  std::uniform_int_distribution<uint32_t> id(0, 300000);
  const std::vector<float> specials = {0.f, -0.f, -kInf, std::numeric_limits<float>::max(),
                                       -std::numeric_limits<float>::max(),
                                       std::numeric_limits<float>::denorm_min(),
                                       -std::numeric_limits<float>::denorm_min(), 1.f, -1.f};
  for (int it = 0; it < 200000; ++it) {
    const float a = it % 5 == 0 ? specials[it / 5 % specials.size()] : u(rng);
    const float b = it % 7 == 0 ? a : it % 3 == 0 ? specials[it % specials.size()] : u(rng);
    const uint32_t ia = id(rng), ib = id(rng);
    const uint64_t ka = argmax_key(a, ia), kb = argmax_key(b, ib);
    // greedy_token's preference: the larger value, then (equal values, +0 == -0) the lower id.
    const bool a_wins = a > b || (a == b && ia < ib);
    const bool b_wins = b > a || (a == b && ib < ia);
    ASSERT_EQ(ka > kb, a_wins) << a << "@" << ia << " vs " << b << "@" << ib;
    ASSERT_EQ(kb > ka, b_wins) << a << "@" << ia << " vs " << b << "@" << ib;
    ASSERT_NE(ka, cuda::kArgmaxKeyBad);
    ASSERT_NE(ka, cuda::kArgmaxKeyNone);
    ASSERT_EQ(argmax_key_token(ka), int32_t(ia));
  }
  // Every pair of the special values, both id orders.
  for (float a : specials)
    for (float b : specials)
      for (auto [ia, ib] : {std::pair<uint32_t, uint32_t>{4, 9}, {9, 4}, {6, 6}}) {
        const uint64_t ka = argmax_key(a, ia), kb = argmax_key(b, ib);
        EXPECT_EQ(ka > kb, a > b || (a == b && ia < ib)) << a << "@" << ia << " vs " << b << "@" << ib;
        EXPECT_EQ(ka == kb, a == b && ia == ib) << a << "@" << ia << " vs " << b << "@" << ib;
      }
  // NaN (either sign, any payload) and +inf: the bad key, token -1.
  for (uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu,
                        0xffffffffu}) {
    float v;
    std::memcpy(&v, &bits, sizeof v);
    EXPECT_EQ(argmax_key(v, 3), cuda::kArgmaxKeyBad) << std::hex << bits;
  }
  EXPECT_EQ(argmax_key(kInf, 0), cuda::kArgmaxKeyBad);
  EXPECT_EQ(argmax_key_token(cuda::kArgmaxKeyBad), -1);
  // Ids up to the largest vocab the GEMVs take and beyond.
  for (uint32_t i : {0u, 1u, 248319u, 262143u, 0x7fffffffu})
    EXPECT_EQ(argmax_key_token(argmax_key(-kInf, i)), int32_t(i));
}

// Rows drawn from a few values so that ties are common, with NaN / +inf now and then; each reduced
// as the fused GEMV does (warps take stages round robin, blocks own interleaved stages, every fold
// in an arbitrary order), against greedy_token.
TEST(ArgmaxKey, AnyPartitionAndOrderGivesGreedyToken) {
  std::mt19937 rng(11);
  const std::vector<float> pool = {-kInf, -2.5f, -0.f, 0.f, 1.f, 1.f, 3.75f, 3.75f,
                                   std::numeric_limits<float>::denorm_min()};
  int n_bad = 0, n_tie = 0;
  for (int it = 0; it < 3000; ++it) {
    const int n = 1 + int(rng() % 700);
    std::vector<float> row(n);
    for (float& v : row) v = pool[rng() % pool.size()];
    if (rng() % 10 == 0) row[rng() % n] = rng() % 2 ? kNan : kInf;
    const int32_t want = greedy_token(row);
    n_bad += want == -1;
    if (want >= 0)
      n_tie += std::count_if(row.begin(), row.end(), [&](float v) { return v == row[want]; }) > 1;
    // Blocks G, stages of R rows interleaved over the blocks, 8 warps per block round robin.
    const int G = 1 + int(rng() % 9), R = 1 + int(rng() % 2);
    const int stages = (n + R - 1) / R;
    std::vector<uint64_t> block_keys;
    for (int b = 0; b < G; ++b) {
      std::vector<uint64_t> warp_keys(8, cuda::kArgmaxKeyNone);
      for (int s = 0, st = b; st < stages; ++s, st += G)
        for (int r = 0; r < R && st * R + r < n; ++r) {
          const int i = st * R + r;
          uint64_t& k = warp_keys[s % 8];
          k = argmax_key_max(k, argmax_key(row[i], uint32_t(i)));
        }
      std::shuffle(warp_keys.begin(), warp_keys.end(), rng);
      uint64_t bk = cuda::kArgmaxKeyNone;
      for (uint64_t k : warp_keys) bk = argmax_key_max(bk, k);
      block_keys.push_back(bk);
    }
    std::shuffle(block_keys.begin(), block_keys.end(), rng);
    uint64_t g = cuda::kArgmaxKeyNone;
    for (uint64_t k : block_keys) g = argmax_key_max(g, k);
    ASSERT_EQ(argmax_key_token(g), want) << "n=" << n << " G=" << G << " R=" << R;
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    ASSERT_EQ(token_in_order(row, order), want);
  }
  // The draws covered the cases that matter.
  EXPECT_GT(n_bad, 100);
  EXPECT_GT(n_tie, 1000);
}

}  // namespace
}  // namespace ds
