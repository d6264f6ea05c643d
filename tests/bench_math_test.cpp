// The benchmark arithmetic (bench/bench_math.h): percentiles and summaries, the decode bandwidth
// floor and the prefill FLOP floor of Qwen3.5-27B against the figures PERF.md derives by hand,
// list parsing, and the report's JSON shape. CPU only (runs in CI).
#include "bench/bench_math.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "bench/bench.h"
#include "core/error.h"
#include "model/config.h"

namespace ds::bench {
namespace {

ModelConfig config_27b() {
  return load_model_config(std::string(DS_SOURCE_DIR) + "/configs/qwen3.5-27b.json");
}

TEST(BenchMath, PercentileInterpolatesLikeNumpy) {
  std::vector<double> v = {4, 1, 3, 2};
  EXPECT_DOUBLE_EQ(percentile(v, 50), 2.5);
  EXPECT_DOUBLE_EQ(percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(percentile(v, 100), 4);
  EXPECT_DOUBLE_EQ(percentile(v, 25), 1.75);  // numpy.percentile([1,2,3,4], 25) = 1.75
  std::vector<double> one = {7};
  EXPECT_DOUBLE_EQ(percentile(one, 99), 7);
  std::vector<double> none;
  EXPECT_THROW(percentile(none, 50), Error);
  EXPECT_THROW(percentile(v, 101), Error);
}

TEST(BenchMath, SummaryOfKnownSamples) {
  std::vector<double> v;
  for (int i = 1; i <= 100; ++i) v.push_back(i);
  const Summary s = summarize(v);
  EXPECT_EQ(s.n, 100);
  EXPECT_DOUBLE_EQ(s.mean, 50.5);
  EXPECT_DOUBLE_EQ(s.p50, 50.5);
  EXPECT_NEAR(s.p99, 99.01, 1e-9);  // numpy: 99.01
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 100);
  EXPECT_NEAR(s.stddev, 29.011491975882016, 1e-9);  // sample standard deviation
  EXPECT_THROW(summarize({}), Error);
  EXPECT_THROW(summarize({1.0, NAN}), Error);
}

TEST(BenchMath, P99SeesTheTail) {
  // 126 fast steps and two slow ones: the median ignores them, P99 does not (one slow step in 128
  // sits above the 99th percentile and moves neither).
  std::vector<double> v(126, 0.013);
  v.push_back(0.100);
  v.push_back(0.100);
  const Summary s = summarize(v);
  EXPECT_DOUBLE_EQ(s.p50, 0.013);
  EXPECT_NEAR(s.p99, 0.013 + (0.99 * 127 - 125) * (0.100 - 0.013), 1e-12);
  v.pop_back();
  v.push_back(0.013);
  EXPECT_DOUBLE_EQ(summarize(v).p99, 0.013);
}

TEST(BenchMath, DecodeFloorOf27bMatchesPerfMd) {
  const ModelConfig c = config_27b();
  ASSERT_EQ(c.n_layers, 64);
  // PERF.md: every decode token reads 51.2 GB of weights (all but the embedding table).
  const DecodeBytes b1 = decode_step_bytes(c, 0, 1);
  EXPECT_NEAR(b1.weights / 1e9, 51.2, 0.15);
  // KV: 64 KiB per context token over the 16 attention layers.
  const DecodeBytes b = decode_step_bytes(c, 32768, 1);
  EXPECT_DOUBLE_EQ(b.kv, 32768.0 * 65536.0);
  // GDN state: 144 MiB fp32, read and written, plus the conv ring (48 x 4 x 10240 bf16 = 3.75 MiB).
  const double state = 144.0 * 1048576.0, ring = 48.0 * 4 * 10240 * 2;
  EXPECT_DOUBLE_EQ(b.gdn_state, 2 * (state + ring));
  // At 4.16 TB/s: 12.3 ms per token at short context, about +0.5 ms at 32K.
  EXPECT_NEAR(b1.total() / 4.16e12 * 1e3, 12.4, 0.15);
  EXPECT_NEAR((b.total() - b1.total()) / 4.16e12 * 1e3, 0.516, 0.01);
  // Batch: weights once, KV and state per sequence.
  const DecodeBytes b16 = decode_step_bytes(c, 4096, 16);
  const DecodeBytes b16_1 = decode_step_bytes(c, 4096, 1);
  EXPECT_NEAR(b16.weights, b16_1.weights, 16.0 * c.d_model * 2);
  EXPECT_DOUBLE_EQ(b16.kv, 16 * b16_1.kv);
  EXPECT_DOUBLE_EQ(b16.gdn_state, 16 * b16_1.gdn_state);
  EXPECT_THROW(decode_step_bytes(c, -1, 1), Error);
  EXPECT_THROW(decode_step_bytes(c, 10, 0), Error);
}

TEST(BenchMath, PrefillFloorOf27bMatchesPerfMd) {
  const ModelConfig c = config_27b();
  // PERF.md: 2 x 25.6e9 FLOP per token in linear layers (lm_head included there; here lm_head
  // runs for one row only, so the per-token linear part is 2 x (25.6e9 - vocab * d_model)).
  const PrefillFlops f1 = prefill_flops(c, 1, 0, 0);
  EXPECT_NEAR(f1.linear / 2 / 1e9, 25.6 - 248320.0 * 5120 / 1e9, 0.1);
  // Attention: 4 * 24 * 256 * T^2 / 2 per layer (causal), 16 layers.
  const PrefillFlops f = prefill_flops(c, 4096);
  EXPECT_NEAR(f.attention, 16 * 4.0 * 24 * 256 * (4096.0 * 4097 / 2), 1);
  // PERF.md floors at 791 TFLOP/s: about 0.30 s for 4K, 2.5 s for 32K (rounded up there).
  EXPECT_NEAR(f.total() / 791e12, 0.28, 0.03);
  EXPECT_NEAR(prefill_flops(c, 32768).total() / 791e12, 2.4, 0.1);
  // GDN is a small share (under 2%).
  EXPECT_GT(f.gdn, 0);
  EXPECT_LT(f.gdn / f.total(), 0.02);
  // A chunk after a cache: the pairs grow by n_new * n_cached.
  EXPECT_DOUBLE_EQ(causal_pairs(512, 8192), 512.0 * 8192 + 512.0 * 513 / 2);
  const PrefillFlops g = prefill_flops(c, 512, 8192);
  EXPECT_NEAR(g.attention, 16 * 4.0 * 24 * 256 * causal_pairs(512, 8192), 1);
  EXPECT_THROW(prefill_flops(c, 0), Error);
}

TEST(BenchMath, RooflinePicksTheLargerTerm) {
  const Floor m = roofline_floor(4e9, 1e9, 4e12, 800e12);
  EXPECT_TRUE(m.memory_bound);
  EXPECT_DOUBLE_EQ(m.seconds, 1e-3);
  const Floor f = roofline_floor(1e6, 8e12, 4e12, 800e12);
  EXPECT_FALSE(f.memory_bound);
  EXPECT_DOUBLE_EQ(f.seconds, 0.01);
  EXPECT_THROW(roofline_floor(1, 1, 0, 1), Error);
}

TEST(BenchMath, IntLists) {
  EXPECT_EQ(parse_int_list("4096,8192", "--context"), (std::vector<int64_t>{4096, 8192}));
  EXPECT_EQ(parse_int_list("4K, 32k", "--context"), (std::vector<int64_t>{4096, 32768}));
  EXPECT_THROW(parse_int_list("", "--context"), Error);
  EXPECT_THROW(parse_int_list("4096,", "--context"), Error);
  EXPECT_THROW(parse_int_list("-1", "--context"), Error);
  EXPECT_THROW(parse_int_list("0", "--context"), Error);
  EXPECT_THROW(parse_int_list("12abc", "--context"), Error);
  try {
    parse_int_list("x", "--batch");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--batch"), std::string::npos);
  }
}

TEST(BenchMath, DecodeCases) {
  const auto c = parse_decode_cases("1@4096,16@8K");
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[1].first, 16);
  EXPECT_EQ(c[1].second, 8192);
  EXPECT_THROW(parse_decode_cases("4096"), Error);
  EXPECT_THROW(parse_decode_cases("1@"), Error);
  EngineBenchOptions o;
  o.decode_cases = cross_cases({1, 4}, {4096, 8192});
  EXPECT_EQ(o.decode_cases.size(), 4u);
  EXPECT_EQ(decode_slots_needed(o), 4);
  o.decode_steps = 10;
  o.decode_warmup = 2;
  // Slot 0 is used by all 4 cases, slots 1-3 by the two batch-4 cases; each reaches 8192.
  EXPECT_EQ(decode_kv_tokens_needed(o), (8192 + 4 * 12 + 64) + 3 * (8192 + 2 * 12 + 64));
}

TEST(BenchReport, JsonHasTheRatios) {
  Ceilings c;
  c.valid = true;
  c.read_bps = 4e12;
  c.gemm_flops = 800e12;
  DecodeResult d;
  d.batch = 1;
  d.context = 4096;
  d.context_mean = 4100;
  d.tpot_s = summarize({0.013, 0.014, 0.015});
  d.floor_s = 0.0125;
  Report r;
  r.add_decode({d}, c);
  const auto& j = r.json();
  ASSERT_TRUE(j.contains("decode"));
  EXPECT_NEAR(j["decode"][0]["ratio_p50"].get<double>(), 0.014 / 0.0125, 1e-12);
  EXPECT_EQ(j["decode"][0]["tpot_s"]["n"].get<int>(), 3);
  // Without ceilings the ratio is null, never a made-up number.
  d.floor_s = -1;
  r.add_decode({d}, Ceilings{});
  EXPECT_TRUE(r.json()["decode"][0]["ratio_p50"].is_null());
  const std::string path = std::string(DS_BINARY_DIR) + "/bench_report_test.json";
  r.write(path);
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_NE(ss.str().find("\"decode\""), std::string::npos);
  std::filesystem::remove(path);
  EXPECT_THROW(r.write("/nonexistent-dir/x.json"), Error);
}

}  // namespace
}  // namespace ds::bench
