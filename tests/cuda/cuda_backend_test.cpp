// The whole CUDA forward. Golden fixtures made by HF transformers in fp32 (tests/data/golden) vs
// our bf16 engine: teacher-forced logits (one chunk: max |err| / max |ref| < 0.12, normalised L2
// < 6e-2, top-1 identical wherever HF's top-2 margin > 0.05) and the 16-token greedy continuation
// identical; chunks of 64, 7 and 1 token and token-by-token decoding each within tolerance of HF.
// At the 27B shapes (4 layers, device synthetic weights): chunks 512 / 1000 and token-by-token
// decode agree with one 4096 chunk (L2 < 3e-2). Several sequences in one step (split across
// forwards, batched decode, then a mixed prompt + decode step) agree with one at a time; device
// synthetic weights give bit-identical logits to the host generator's uploaded ones; bad requests
// (slot, token id, KV pool full, length, duplicate slot) are ds::Error and change nothing.
// Decode CUDA graphs: replayed logits bit-identical to eager ($DS_CUDA_GRAPHS=0) for batches of
// 1, 3, 8 across KV buckets and pages, sequences finishing / joining, graphs toggled at run time
// and an LRU cache of 3 graphs, at the tiny and the 27B shapes; device greedy (step_greedy) equal
// to the host greedy_token of the same logits; the split-KV kernel unchanged by empty splits.
// DS_PERF=1: decode TPOT of the synthetic 27B, graphs off / on, logits / device greedy.
// Measured numbers are in docs/GPU.md.
#include "cuda/cuda_backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/npy.h"
#include "cuda/attention_decode.h"
#include "cuda/kernels.h"
#include "cuda_test_util.h"
#include "model/weights.h"

namespace ds {
namespace {

const std::string kGolden = test::test_data_dir() + "/golden";

struct Golden {
  std::vector<int32_t> tokens, greedy;
  std::vector<float> logits;
  int vocab = 0;
};

Golden load_golden(const std::string& name) {
  Golden g;
  std::ifstream f(kGolden + "/" + name + "/golden.json");
  EXPECT_TRUE(f) << "missing fixture " << name;
  auto j = nlohmann::json::parse(f);
  g.tokens = j["tokens"].get<std::vector<int32_t>>();
  g.greedy = j["greedy"].get<std::vector<int32_t>>();
  std::vector<int64_t> shape;
  g.logits = read_npy_f32(kGolden + "/" + name + "/logits.npy", &shape);
  g.vocab = static_cast<int>(shape.at(1));
  return g;
}

CudaEngineOptions quiet() {
  CudaEngineOptions e;
  e.verbose = false;
  e.max_kv_tokens = 1 << 16;
  e.page_size = 16;
  return e;
}

std::unique_ptr<Backend> make(const HostWeights& w, int chunk, int slots = 4) {
  BackendOptions o;
  o.device = "cuda";
  o.n_slots = slots;
  o.chunk_size = chunk;
  return make_cuda_backend(o, w, quiet());
}

std::vector<float> score(Backend& b, int slot, const std::vector<int32_t>& toks) {
  std::vector<float> logits;
  SeqWork w{slot, toks, true};
  b.step(std::span<const SeqWork>(&w, 1), logits);
  return logits;
}

int argmax(const float* r, int n) { return int(std::max_element(r, r + n) - r); }

struct Err {
  double max_rel, l2;
};
Err compare(const std::vector<float>& a, const std::vector<float>& ref) {
  double mx = 0, err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(a[i])) return {INFINITY, INFINITY};
    mx = std::max(mx, std::fabs(double(ref[i])));
    err = std::max(err, std::fabs(double(a[i]) - ref[i]));
  }
  return {err / mx, test::norm_err(a, ref)};
}

class GoldenCuda : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenCuda, LogitsGreedyAndChunking) {
  DS_REQUIRE_GPU();
  const std::string name = GetParam();
  const Golden g = load_golden(name);
  HostWeights w = load_host_weights(kGolden + "/" + name + "/text");
  std::unique_ptr<Backend> b;
  try {
    b = make(w, 4096);
  } catch (const Error& e) {
    GTEST_SKIP() << name << ": the engine does not support this config: " << e.what();
  }
  const int V = g.vocab;
  const int T = int(g.tokens.size());
  auto logits = score(*b, 0, g.tokens);
  ASSERT_EQ(logits.size(), size_t(T) * V);
  const Err e = compare(logits, g.logits);
  std::printf("  %s: teacher-forced logits max|err|/max|ref| %.3e, normalised L2 %.3e\n",
              name.c_str(), e.max_rel, e.l2);
  // bf16 activations vs HF's fp32 run; this 64-wide, 8-layer random model measured 7.6e-2 / 3.4e-2.
  EXPECT_LT(e.max_rel, 0.12);
  EXPECT_LT(e.l2, 6e-2);
  int agree = 0, decisive = 0, agree_decisive = 0;
  for (int t = 0; t < T; ++t) {
    const float* ref = g.logits.data() + size_t(t) * V;
    const int top = argmax(ref, V);
    std::vector<float> r(ref, ref + V);
    std::nth_element(r.begin(), r.begin() + 1, r.end(), std::greater<float>());
    const bool same = argmax(logits.data() + size_t(t) * V, V) == top;
    agree += same;
    if (r[0] - r[1] > 0.05) {
      ++decisive;
      agree_decisive += same;
    }
  }
  std::printf("  %s: top-1 agreement %d/%d (all), %d/%d (HF margin > 0.05)\n", name.c_str(), agree,
              T, agree_decisive, decisive);
  EXPECT_GE(agree_decisive, decisive * 0.99);
  EXPECT_EQ(agree_decisive, decisive);

  // Greedy continuation from the prompt, decoding one token per step.
  b->reset_slot(0);
  std::vector<float> step_logits;
  SeqWork w0{0, g.tokens, false};
  b->step(std::span<const SeqWork>(&w0, 1), step_logits);
  std::vector<int32_t> cont;
  for (size_t i = 0; i < g.greedy.size(); ++i) {
    const int32_t next = argmax(step_logits.data(), V);
    cont.push_back(next);
    std::vector<int32_t> one{next};
    SeqWork wd{0, one, false};
    b->step(std::span<const SeqWork>(&wd, 1), step_logits);
  }
  EXPECT_EQ(cont, g.greedy) << name << ": greedy continuation differs from HF";

  // Chunked prefill (64, 7 and 1 token per forward) and token by token through step() (decode
  // kernels after the first token): each within the same bf16 tolerance of HF, and the same top-1
  // wherever HF's margin is decisive.
  auto check_variant = [&](const std::vector<float>& lv, const std::string& what) {
    const Err ev = compare(lv, g.logits);
    int agree_v = 0, n_dec = 0;
    for (int t = 0; t < T; ++t) {
      const float* ref = g.logits.data() + size_t(t) * V;
      std::vector<float> r(ref, ref + V);
      std::nth_element(r.begin(), r.begin() + 1, r.end(), std::greater<float>());
      if (r[0] - r[1] <= 0.05) continue;
      ++n_dec;
      agree_v += argmax(lv.data() + size_t(t) * V, V) == argmax(ref, V);
    }
    const Err vs_one = compare(lv, logits);
    std::printf(
        "  %s: %s vs HF: max rel %.3e, L2 %.3e, decisive top-1 %d/%d; vs one chunk: max rel %.3e\n",
        name.c_str(), what.c_str(), ev.max_rel, ev.l2, agree_v, n_dec, vs_one.max_rel);
    // Measured on the H200: L2 2.7e-2..5.3e-2, max rel 4.5e-2..1.9e-1 (chunk 7: most boundaries),
    // decisive top-1 80/81..81/81. This 64-wide random model amplifies bf16 rounding (the 27B-shape
    // test below sees 1-2%).
    EXPECT_LT(ev.max_rel, 0.25) << what;
    EXPECT_LT(ev.l2, 6e-2) << what;
    EXPECT_GE(agree_v, n_dec * 97 / 100) << what;
  };
  for (int chunk : {64, 7, 1}) {
    auto bc = make(w, chunk);
    check_variant(score(*bc, 2, g.tokens), "chunk " + std::to_string(chunk));
  }
  {
    auto bt = make(w, 4096);
    std::vector<float> all;
    for (int t = 0; t < T; ++t) {
      std::vector<int32_t> one{g.tokens[t]};
      std::vector<float> l;
      SeqWork wt{1, one, true};
      bt->step(std::span<const SeqWork>(&wt, 1), l);
      all.insert(all.end(), l.begin(), l.end());
    }
    check_variant(all, "token-by-token");
  }
}

// The 27B shapes (d_model 5120, 24/4 heads of 256, 16/48 GDN heads of 128, vocab 248320), first 4
// layers (3 GDN + 1 attention), device synthetic weights: a 2048-token prompt plus 64 more tokens,
// teacher-forced, with one 4096 chunk, chunks of 512 and of 1000 (not a multiple of the GDN chunk
// 64), and the 64 tokens decoded one by one (decode kernels): same logits within tolerance;
// top-1 printed (random weights give near-flat logits, so top-1 is not a meaningful gate here).
TEST(CudaBackend, ChunkingAndDecodeAgreeAt27bShapes) {
  DS_REQUIRE_GPU();
  ModelConfig c = synthetic_model_config("27b");
  c.n_layers = 4;
  c.layer_types.resize(4);
  const int V = c.vocab_size, P = 2048, D = 64;
  std::mt19937 rng(5);
  std::vector<int32_t> toks(P + D);
  for (auto& t : toks) t = rng() % V;
  auto run = [&](int chunk, bool decode_tail) {
    BackendOptions o;
    o.device = "cuda";
    o.n_slots = 1;
    o.chunk_size = chunk;
    CudaEngineOptions e = quiet();
    e.max_kv_tokens = 4096;
    e.page_size = 64;
    auto b = make_cuda_backend_synthetic(o, c, 3, e);
    std::vector<float> out;
    if (!decode_tail) {
      SeqWork w{0, toks, true};
      b->step(std::span<const SeqWork>(&w, 1), out);
      return std::vector<float>(out.end() - size_t(D) * V, out.end());  // the last D rows
    }
    test::prefill_then_decode(*b, toks, P, /*keep_prompt=*/false, out);
    return out;
  };
  const auto ref = run(4096, false);
  for (auto [chunk, dec] : {std::pair{512, false}, std::pair{1000, false}, std::pair{4096, true}}) {
    const auto got = run(chunk, dec);
    const Err e = compare(got, ref);
    int agree = 0;
    for (int r = 0; r < D; ++r)
      agree += argmax(got.data() + size_t(r) * V, V) == argmax(ref.data() + size_t(r) * V, V);
    std::printf(
        "  27b shapes, 4 layers: %s vs one 4096 chunk over the last %d tokens: max rel %.3e, L2 "
        "%.3e, top-1 %d/%d\n",
        dec ? "token-by-token decode" : ("chunk " + std::to_string(chunk)).c_str(), D, e.max_rel,
        e.l2, agree, D);
    // Measured on the H200: L2 0.96e-2 (chunk 512), 1.1e-2 (1000), 1.9e-2 (decode); max rel
    // <= 2.2e-2. Top-1 is printed, not gated: a random 248320-way head has near-flat logits (tiny
    // margins).
    EXPECT_LT(e.l2, 3e-2);
    EXPECT_LT(e.max_rel, 5e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenCuda,
                         ::testing::Values("qwen35_27b_ratios", "qwen35_other_ratios"));

TEST(CudaBackend, BatchOfSequencesMatchesOneAtATime) {
  DS_REQUIRE_GPU();
  ModelConfig c = tiny_model_config();
  HostWeights w = make_synthetic_weights(c, 7);
  std::mt19937 rng(3);
  std::vector<std::vector<int32_t>> prompts;
  for (int n : {37, 1, 130, 64, 50}) {
    std::vector<int32_t> p(n);
    for (auto& t : p) t = rng() % c.vocab_size;
    prompts.push_back(p);
  }
  const int n_dec = 4, late = 4;  // sequence 4 arrives with the 4th decode step (a mixed step)
  auto dec_tok = [&](size_t i, int k) { return int32_t((i * 7 + k) % c.vocab_size); };
  // Reference: each sequence alone, its prompt then n_dec decode tokens (the late one: prompt
  // only).
  std::vector<std::vector<float>> ref;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto b = make(w, 4096);
    std::vector<float> l;
    SeqWork sw{0, prompts[i], false};
    b->step(std::span<const SeqWork>(&sw, 1), l);
    std::vector<float> seq = l;
    for (int k = 0; k < (int(i) == late ? 0 : n_dec); ++k) {
      std::vector<int32_t> one{dec_tok(i, k)};
      SeqWork d{0, one, false};
      b->step(std::span<const SeqWork>(&d, 1), l);
      seq.insert(seq.end(), l.begin(), l.end());
    }
    ref.push_back(seq);
  }
  // One engine: four prompts in one step (chunk 100 splits them across forwards), three batched
  // decode steps, then a mixed step: the late prompt (listed first) with four decode tokens.
  auto b = make(w, 100, 5);
  std::vector<SeqWork> work;
  for (int i = 0; i < late; ++i) work.push_back({i, prompts[i], false});
  std::vector<float> l;
  b->step(work, l);
  std::vector<std::vector<float>> got(prompts.size());
  const int V = c.vocab_size;
  for (int i = 0; i < late; ++i)
    got[i].assign(l.begin() + size_t(i) * V, l.begin() + size_t(i + 1) * V);
  for (int k = 0; k < n_dec; ++k) {
    std::vector<std::vector<int32_t>> toks(late);
    work.clear();
    if (k == n_dec - 1) work.push_back({late, prompts[late], false});
    for (int i = 0; i < late; ++i) {
      toks[i] = {dec_tok(i, k)};
      work.push_back({i, toks[i], false});
    }
    b->step(work, l);
    ASSERT_EQ(l.size(), work.size() * V);
    for (size_t r = 0; r < work.size(); ++r)
      got[work[r].slot].insert(got[work[r].slot].end(), l.begin() + r * V, l.begin() + (r + 1) * V);
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Err e = compare(got[i], ref[i]);
    std::printf(
        "  sequence %zu: batched (chunk 100, mixed last step) vs alone: max rel %.3e, L2 %.3e\n", i,
        e.max_rel, e.l2);
    EXPECT_LT(e.max_rel, 6e-2) << "sequence " << i;
    EXPECT_LT(e.l2, 3e-2) << "sequence " << i;
  }
  EXPECT_EQ(b->slot_len(2), 130 + n_dec);
  EXPECT_EQ(b->slot_len(late), 50);
}

TEST(CudaBackend, DeviceSyntheticEqualsHostSynthetic) {
  DS_REQUIRE_GPU();
  ModelConfig c = tiny_model_config();
  HostWeights w = make_synthetic_weights(c, 42);
  BackendOptions o;
  o.device = "cuda";
  o.n_slots = 2;
  auto host = make_cuda_backend(o, w, quiet());
  auto dev = make_cuda_backend_synthetic(o, c, 42, quiet());
  std::vector<int32_t> toks{1, 2, 3, 50, 99, 7, 7, 7};
  auto a = score(*host, 0, toks), bb = score(*dev, 0, toks);
  ASSERT_EQ(a.size(), bb.size());
  EXPECT_EQ(std::memcmp(a.data(), bb.data(), a.size() * sizeof(float)), 0)
      << "device-generated synthetic weights differ from the host generator's";
}

TEST(CudaBackend, BadRequestsAreErrors) {
  DS_REQUIRE_GPU();
  ModelConfig c = tiny_model_config();
  HostWeights w = make_synthetic_weights(c, 1);
  BackendOptions o;
  o.device = "cuda";
  o.n_slots = 2;
  CudaEngineOptions e = quiet();
  e.max_kv_tokens = 64;  // 4 blocks of 16
  auto b = make_cuda_backend(o, w, e);
  std::vector<float> l;
  std::vector<int32_t> ok{1, 2, 3};
  std::vector<int32_t> bad_tok{1, c.vocab_size};
  SeqWork w1{5, ok, false};
  EXPECT_THROW(b->step(std::span<const SeqWork>(&w1, 1), l), Error);
  SeqWork w2{0, bad_tok, false};
  EXPECT_THROW(b->step(std::span<const SeqWork>(&w2, 1), l), Error);
  EXPECT_EQ(b->slot_len(0), 0);  // nothing ran
  std::vector<int32_t> long_prompt(65, 1);
  SeqWork w3{0, long_prompt, false};
  EXPECT_FALSE(b->can_grow(0, 65));
  EXPECT_THROW(b->step(std::span<const SeqWork>(&w3, 1), l), Error);
  std::vector<int32_t> p40(40, 1), p30(30, 2);
  SeqWork w4{0, p40, false};
  b->step(std::span<const SeqWork>(&w4, 1), l);
  EXPECT_EQ(b->memory().kv_blocks_used, 3);
  SeqWork w5{1, p30, false};  // needs 2 blocks, 1 free
  EXPECT_FALSE(b->can_grow(1, 30));
  EXPECT_THROW(b->step(std::span<const SeqWork>(&w5, 1), l), Error);
  b->reset_slot(0);
  EXPECT_EQ(b->memory().kv_blocks_used, 0);
  b->step(std::span<const SeqWork>(&w5, 1), l);
  EXPECT_EQ(b->slot_len(1), 30);
  std::vector<SeqWork> dup{{1, ok, false}, {1, ok, false}};
  EXPECT_THROW(b->step(dup, l), Error);
}

// ---- Decode CUDA graphs and device greedy ----

// The split-KV decode kernel with more splits than the keys need (what a graph planned for its
// bucket's top does for every shorter sequence): the extra splits are empty partials, so the
// output is bit-identical to the tight grid with the same kv_chunk.
TEST(CudaGraphs, DecodeSplitsPastKvLenChangeNothing) {
  DS_REQUIRE_GPU();
  const cuda::AttnShape s = test::attn_shape_27b(/*page_size=*/16);
  const std::vector<int32_t> kv_len = {100, 37, 300};
  const int S = 3, hd = s.head_dim, ps = s.page_size;
  int MB = 0, n_blocks = 2;
  for (int l : kv_len) {
    MB = std::max(MB, (l + ps - 1) / ps);
    n_blocks += (l + ps - 1) / ps;
  }
  std::vector<int32_t> btab(size_t(S) * MB, 0);
  int next = n_blocks - 1;  // blocks handed out backwards: the table is not the identity
  for (int i = 0; i < S; ++i)
    for (int b = 0; b < (kv_len[i] + ps - 1) / ps; ++b) btab[i * MB + b] = next--;
  std::mt19937 rng(17);
  const size_t cache_elems = size_t(n_blocks) * s.n_kv_heads * ps * hd;
  test::DevBuf<uint16_t> kc(test::random_bf16(cache_elems, rng)),
      vc(test::random_bf16(cache_elems, rng));
  test::DevBuf<uint16_t> q(test::random_bf16(size_t(S) * s.n_heads * hd, rng, 2.f));
  test::DevBuf<uint16_t> g(test::random_bf16(size_t(S) * s.n_heads * hd, rng));
  test::DevBuf<int32_t> d_btab(btab), d_kv(kv_len), d_qs(std::vector<int32_t>{0, 1, 2}),
      d_ql(std::vector<int32_t>{1, 1, 1});
  cuda::AttnBatch b;
  b.n_seqs = S;
  b.q_start = d_qs.ptr;
  b.q_len = d_ql.ptr;
  b.kv_len = d_kv.ptr;
  b.block_table = d_btab.ptr;
  b.block_table_stride = MB;
  b.max_q_len = 1;
  b.max_kv_len = 300;
  cuda::AttnGate gate{g.as<const cuda::bf16>(), int64_t(s.n_heads) * hd, hd};
  auto run = [&](int n_splits) {
    test::DevBuf<char> ws(cuda::attention_decode_workspace_bytes(s, S, n_splits));
    test::DevBuf<uint16_t> out(size_t(S) * s.n_heads * hd);
    out.poison();
    cuda::launch_attention_decode(s, b, q.as<const cuda::bf16>(), kc.as<const cuda::bf16>(),
                                  vc.as<const cuda::bf16>(), gate, 64, n_splits, ws.ptr,
                                  out.as<cuda::bf16>(), nullptr);
    return out.download();
  };
  const auto tight = run(5);  // 5 * 64 >= 300
  for (float f : test::to_f32(tight)) ASSERT_TRUE(std::isfinite(f));
  for (int n : {6, 16, 128}) EXPECT_EQ(run(n), tight) << n << " splits vs 5";
}

// Runs the same steps on a backend with decode graphs and on one without ($DS_CUDA_GRAPHS=0 at
// construction): logits compared bit for bit, step_greedy's device argmax compared with the host
// greedy_token of the eager logits. Decode tokens are fixed (not sampled), so both stay in step.
class GraphVsEager {
 public:
  GraphVsEager(const std::function<std::unique_ptr<Backend>()>& make) {
    g_ = make();
    setenv("DS_CUDA_GRAPHS", "0", 1);
    e_ = make();
    unsetenv("DS_CUDA_GRAPHS");
    V_ = g_->config().vocab_size;
  }
  Backend& graphs() { return *g_; }
  Backend& eager() { return *e_; }

  void prefill(const std::vector<std::pair<int, std::vector<int32_t>>>& prompts,
               const std::vector<int>& decoding = {}) {
    std::vector<std::vector<int32_t>> toks;
    std::vector<SeqWork> work;
    for (int s : decoding) toks.push_back({token(s)});
    for (size_t i = 0; i < decoding.size(); ++i) work.push_back({decoding[i], toks[i], false});
    for (const auto& [slot, p] : prompts) work.push_back({slot, p, false});
    run(work, 0);
  }
  // One decode token for each slot; mode 0: step() on both; 1: step_greedy with every item
  // greedy; 2: step_greedy with every other item greedy.
  void decode(const std::vector<int>& slots, int mode) {
    std::vector<std::vector<int32_t>> toks;
    for (int s : slots) toks.push_back({token(s)});
    std::vector<SeqWork> work;
    for (size_t i = 0; i < slots.size(); ++i) work.push_back({slots[i], toks[i], false});
    run(work, mode);
  }
  void reset(int slot) {
    g_->reset_slot(slot);
    e_->reset_slot(slot);
  }
  int steps() const { return steps_; }
  int greedy_rows() const { return greedy_rows_; }

 private:
  int32_t token(int slot) const { return int32_t((steps_ * 131 + slot * 17 + 5) % V_); }
  void run(std::vector<SeqWork>& work, int mode) {
    ++steps_;
    std::vector<float> ref;
    e_->step(work, ref);
    ASSERT_EQ(ref.size(), work.size() * size_t(V_));
    std::vector<float> rows;
    std::vector<int32_t> toks;
    if (mode == 0) {
      g_->step(work, rows);
    } else {
      for (size_t i = 0; i < work.size(); ++i) work[i].greedy = mode == 1 || i % 2 == 0;
      StepOutput out;
      g_->step_greedy(work, out);
      rows = std::move(out.logits);
      toks = std::move(out.tokens);
      ASSERT_EQ(toks.size(), work.size());
    }
    size_t r = 0;
    for (size_t i = 0; i < work.size(); ++i) {
      const float* e = ref.data() + i * V_;
      if (mode != 0 && work[i].greedy) {
        ++greedy_rows_;
        EXPECT_EQ(toks[i], greedy_token(std::span<const float>(e, V_)))
            << "step " << steps_ << " item " << i << " (slot " << work[i].slot << ")";
        continue;
      }
      if (mode != 0) {
        EXPECT_EQ(toks[i], -1);
      }
      ASSERT_LE((r + 1) * V_, rows.size());
      const float* gr = rows.data() + r * V_;
      if (std::memcmp(gr, e, V_ * sizeof(float)) != 0) {
        int first = 0;
        while (gr[first] == e[first]) ++first;
        ADD_FAILURE() << "step " << steps_ << " item " << i << " (slot " << work[i].slot
                      << ", batch " << work.size() << "): graph logits differ from eager at "
                      << first << ": " << gr[first] << " vs " << e[first];
      }
      ++r;
    }
    EXPECT_EQ(r * V_, rows.size());
    for (const SeqWork& w : work) EXPECT_EQ(g_->slot_len(w.slot), e_->slot_len(w.slot));
  }

  std::unique_ptr<Backend> g_, e_;
  int V_ = 0, steps_ = 0, greedy_rows_ = 0;
};

std::vector<int32_t> prompt_of(int n, int salt, int vocab) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = (i * 7919 + salt * 104729) % vocab;
  return p;
}

void print_graph_stats(const char* what, const Backend& b) {
  const CudaGraphStats s = cuda_graph_stats(b);
  std::printf(
      "  %s: graphs %s, %d cached, %lld captured, %lld replays, %lld eager decode steps, %lld "
      "evicted, %lld failures, %.1f MiB held\n",
      what, s.enabled ? "on" : "off", s.cached, (long long)s.captures, (long long)s.replays,
      (long long)s.eager_decode, (long long)s.evictions, (long long)s.failures,
      s.graph_bytes / 1048576.0);
}

// Tiny model (3 GDN + 1 attention layer), page 16: batches of 1, 3 and 8 decoding across KV
// buckets (64 -> 128 -> 256) and pages, sequences finishing and new ones joining (a mixed prompt +
// decode step, then batch 8 again), graphs switched off and on at run time, and a cache of at most
// 3 graphs (evictions).
TEST(CudaGraphs, ReplayMatchesEagerBitExactTiny) {
  DS_REQUIRE_GPU();
  const ModelConfig c = tiny_model_config();
  const HostWeights w = make_synthetic_weights(c, 21);
  GraphVsEager t([&] {
    BackendOptions o;
    o.device = "cuda";
    o.n_slots = 8;
    o.chunk_size = 64;
    CudaEngineOptions e = quiet();
    e.max_cuda_graphs = 3;
    return make_cuda_backend(o, w, e);
  });
  const int V = c.vocab_size;
  std::vector<std::pair<int, std::vector<int32_t>>> prompts;
  for (int i = 0; i < 8; ++i) prompts.push_back({i, prompt_of(20 + 13 * i, i, V)});
  t.prefill(prompts);  // 8 prompts, chunk 64: several forwards
  int k = 0;
  for (int i = 0; i < 50; ++i) t.decode({0}, k++ % 3);  // slot 0: 21 -> 70 (bucket 64 -> 128)
  for (int i = 0; i < 30; ++i) t.decode({0, 1, 2}, k++ % 3);
  const std::vector<int> all{0, 1, 2, 3, 4, 5, 6, 7};
  for (int i = 0; i < 25; ++i) t.decode(all, k++ % 3);  // slot 7: 111 -> 136 (bucket 256)
  // Slots 2 and 5 finish; new prompts join in a mixed step with the other six decoding.
  t.reset(2);
  t.reset(5);
  t.prefill({{2, prompt_of(30, 9, V)}, {5, prompt_of(45, 10, V)}}, {0, 1, 3, 4, 6, 7});
  for (int i = 0; i < 15; ++i) t.decode(all, k++ % 3);
  for (int i = 0; i < 6; ++i) t.decode({6, 1}, k++ % 3);  // a batch in another slot order
  set_cuda_graphs(t.graphs(), false);
  EXPECT_FALSE(cuda_graph_stats(t.graphs()).enabled);
  for (int i = 0; i < 3; ++i) t.decode(all, k++ % 3);
  set_cuda_graphs(t.graphs(), true);
  for (int i = 0; i < 6; ++i) t.decode(all, k++ % 3);
  print_graph_stats("tiny, graphs", t.graphs());
  print_graph_stats("tiny, DS_CUDA_GRAPHS=0", t.eager());
  const CudaGraphStats g = cuda_graph_stats(t.graphs()), e = cuda_graph_stats(t.eager());
  EXPECT_TRUE(g.enabled);
  EXPECT_EQ(g.failures, 0);
  EXPECT_GT(g.captures, 5);
  EXPECT_GT(g.replays, 80);
  EXPECT_GT(g.evictions, 0);
  EXPECT_LE(g.cached, 3);
  EXPECT_FALSE(e.enabled);
  EXPECT_EQ(e.replays, 0);
  EXPECT_EQ(e.captures, 0);
  EXPECT_GT(t.greedy_rows(), 200);
}

// The 27B shapes (first 4 layers: 3 GDN + 1 attention; cuBLASLt or the decode GEMVs, the real
// decode attention and GDN kernels), page 64: batch 1 crossing the 64 -> 128 bucket, batch 4
// crossing a page and the 128 -> 256 bucket, then a sequence finishing and a new one joining.
TEST(CudaGraphs, ReplayMatchesEagerBitExact27bShapes) {
  DS_REQUIRE_GPU();
  ModelConfig c = synthetic_model_config("27b");
  c.n_layers = 4;
  c.layer_types.resize(4);
  GraphVsEager t([&] {
    BackendOptions o;
    o.device = "cuda";
    o.n_slots = 4;
    o.chunk_size = 4096;
    CudaEngineOptions e = quiet();
    e.max_kv_tokens = 4096;
    e.page_size = 64;
    return make_cuda_backend_synthetic(o, c, 3, e);
  });
  const int V = c.vocab_size;
  t.prefill({{0, prompt_of(60, 1, V)},
             {1, prompt_of(100, 2, V)},
             {2, prompt_of(121, 3, V)},
             {3, prompt_of(200, 4, V)}});
  int k = 0;
  for (int i = 0; i < 10; ++i) t.decode({0}, k++ % 3);           // 61 -> 70
  for (int i = 0; i < 12; ++i) t.decode({0, 1, 2, 3}, k++ % 3);  // slot 2: 121 -> 133
  t.reset(1);
  t.prefill({{1, prompt_of(77, 5, V)}}, {0, 2, 3});
  for (int i = 0; i < 6; ++i) t.decode({3, 2, 1, 0}, k++ % 3);
  print_graph_stats("27b shapes, graphs", t.graphs());
  const CudaGraphStats g = cuda_graph_stats(t.graphs());
  EXPECT_EQ(g.failures, 0);
  EXPECT_GT(g.replays, 15);
  EXPECT_GT(t.greedy_rows(), 20);
}

// Decode TPOT of the synthetic 27B (64 layers) with graphs off / on, full logits rows / device
// greedy, batch 1 and 4 at context 4096, batch 1 at 32768 (batch 4 too with DS_PERF_B4_32K=1),
// timed on the host around each step (median of 20 after 4 warm-up steps). DS_PERF=1 only.
TEST(CudaGraphsPerf, DecodeSynthetic27b) {
  DS_REQUIRE_GPU();
  const char* env = std::getenv("DS_PERF");
  if (!env || std::string(env) != "1") GTEST_SKIP() << "set DS_PERF=1 to run the 27B timing";
  const bool b4_long =
      std::getenv("DS_PERF_B4_32K") && std::string(std::getenv("DS_PERF_B4_32K")) == "1";
  const ModelConfig c = synthetic_model_config("27b");
  BackendOptions o;
  o.device = "cuda";
  o.n_slots = 4;
  o.chunk_size = 4096;
  CudaEngineOptions e;
  e.max_kv_tokens = b4_long ? 4 * 33600 : 3 * 4600 + 33600;
  auto t0 = std::chrono::steady_clock::now();
  auto b = make_cuda_backend_synthetic(o, c, 1, e);
  std::printf("  load %.2f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::mt19937 rng(1);
  const int V = c.vocab_size;
  std::vector<float> logits;
  auto fill = [&](int n_seqs, int ctx) {
    const auto f0 = std::chrono::steady_clock::now();
    for (int s = 0; s < n_seqs; ++s) {
      const int have = b->slot_len(s);
      if (have >= ctx) continue;
      std::vector<int32_t> p(ctx - have);
      for (auto& x : p) x = rng() % V;
      SeqWork w{s, p, false};
      b->step(std::span<const SeqWork>(&w, 1), logits);
    }
    std::printf("  filled %d slot(s) to %d tokens in %.2f s\n", n_seqs, ctx,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count());
  };
  auto tpot = [&](int batch, bool graphs, bool greedy) {
    set_cuda_graphs(*b, graphs);
    std::vector<std::vector<int32_t>> toks(batch, std::vector<int32_t>(1));
    std::vector<SeqWork> work(batch);
    StepOutput out;
    std::vector<double> t;
    for (int st = 0; st < 24; ++st) {
      for (int s = 0; s < batch; ++s) {
        toks[s][0] = rng() % V;
        work[s] = {s, toks[s], false, greedy};
      }
      const auto s0 = std::chrono::steady_clock::now();
      if (greedy) {
        b->step_greedy(work, out);
      } else {
        b->step(work, logits);
      }
      if (st >= 4)
        t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2] * 1e3;
  };
  auto row = [&](int batch, int ctx) {
    const double el = tpot(batch, false, false), eg = tpot(batch, false, true);
    const double gl = tpot(batch, true, false), gg = tpot(batch, true, true);
    std::printf(
        "GRAPHS decode batch %d context %d: eager+logits %.3f ms | eager+greedy %.3f ms | "
        "graph+logits %.3f ms | graph+greedy %.3f ms (graph+greedy vs eager+logits: -%.3f ms, "
        "%.1f%%)\n",
        batch, ctx, el, eg, gl, gg, el - gg, 100 * (el - gg) / el);
  };
  fill(4, 4096);
  row(1, 4096);
  row(4, 4096);
  fill(b4_long ? 4 : 1, 32768);
  row(1, 32768);
  if (b4_long) row(4, 32768);
  print_graph_stats("27b", *b);
  const CudaGraphStats s = cuda_graph_stats(*b);
  EXPECT_EQ(s.failures, 0);
  if (s.cached > 0)
    std::printf("  device memory per captured 64-layer graph: %.2f MiB\n",
                s.graph_bytes / 1048576.0 / s.cached);
}

TEST(CudaBackend, BuiltinConfigMatchesConfigsFile) {
  ModelConfig a = synthetic_model_config("27b");
  ModelConfig f = load_model_config(test::source_dir() + "/configs/qwen3.5-27b.json");
  EXPECT_EQ(a.summary(), f.summary());
  EXPECT_EQ(a.n_layers, 64);
  EXPECT_EQ(a.d_model, 5120);
  EXPECT_EQ(a.n_full_layers(), 16);
}

}  // namespace
}  // namespace ds
