// The serving Engine (scheduler + sampling + streams, src/runtime/engine.h) on the CUDA backend
// with a KV pool far too small for the load, at the tiny config (4 layers: 3 GDN + 1 attention,
// d_model 64, vocab 1024; synthetic weights), so it runs in seconds:
//  - PreemptionRecomputesAndMatchesAlone: 8 concurrent greedy requests in a 24-block pool (16
//    tokens per block) that each grow to 4-7 blocks: the scheduler must preempt running sequences
//    mid-generation (recompute: the slot is freed, later the prompt + generated tokens are
//    prefilled again). Every request completes with exactly max_tokens tokens, the engine's
//    preemption counter is > 0, KV blocks / state slots / running / waiting return to 0, and each
//    request's tokens equal the same request run alone in a large pool, up to the tolerance below.
//  - ConcurrentWithRandomCancellations: 32 concurrent streaming requests (16 slots, 40 blocks)
//    of which a random third are cancelled at a random point (before the first token or after a
//    few): each ends cancelled or with all its tokens, the others are checked like above, nothing
//    leaks, and the engine serves a new request correctly afterwards.
//
// Tolerance (why not bit-exact): alone, a request's tokens come from decode steps (split-KV
// attention, fused GDN decode, batch 1 GEMMs). Under pressure the same positions are computed
// inside batches of other sizes, and after a preemption by prefill kernels over the recomputed
// prefix: valid bf16 orders of the same sums. This random tiny model is ill-conditioned (see
// CudaEngineNumerics below): merely rounding its weights to bf16 moves the CPU fp32 oracle's
// logits by L2 1.07e-1, single logits by up to 3.7 (logit std 1) and flips greedy tokens by up to
// 2.2 nats, exactly what every device path does (H200: L2 1.0-1.1e-1, up to 3.8, 2.1 nats); and
// 55% of its greedy tokens have a top-2 margin below 0.25 nats. So a valid bf16 order can flip the
// argmax at ill-conditioned rows by more than a nat (the first H200 run: 1.38 and 2.18 nats
// against a one-pass prefill), while a row moves by ~0.2 on average. A single global tolerance is
// either too loose for the well-conditioned rows or fails the ill-conditioned ones; the tolerance
// is per row instead, from the measured errors of correct computations of that very
// row (the teacher-forced check below). Checks per request:
//  - Teacher-forced: every generated token (all positions, also after a first difference from
//    the alone run) is the CPU oracle's greedy choice given the same prefix, within the row's
//    tolerance (below), plus two controls: a valid path outside the envelope passes, a planted
//    recompute bug is caught in every request.
//  - The tokens equal the alone run's up to the first difference, and there the alone run's top-2
//    margin is within the row's tolerance; after it the two continuations are different sequences.
// The counts (exact requests, tokens not the oracle's argmax, largest gap, largest gap relative to
// the envelope, controls) are printed. H200 (2026-11-29, 8d6522d, two repeats, same numbers): the
// loaded runs' largest gap / (2 x envelope) is 0.21 and 0.36 (largest gaps 0.98 and 1.74 nats), the
// chunk-7 control's 0.50 and 0.88, all under kNoiseFactor = 2; the planted bug is caught in 8/8
// and 22/22 requests at up to 28x and 51x the envelope.
// What this test does NOT catch (review, 2026-11-29): the envelope includes the batch-1 device
// paths (one-pass and chunked prefill, prompt + decode), so a numerical bug inside those kernels
// widens its own tolerance. This test is about the scheduler (batching, preemption, recompute,
// cancellation, block and slot accounting); the kernels are held to the CPU oracle by their own
// tests (cuda_gdn_test, cuda_gdn_decode_test, cuda_attention*_test, cuda_gemv_test) and the whole
// model by CudaEngineNumerics below (every path within 2.5x of the bf16-weight yardstick) and
// cuda_backend_test's golden HF fixtures.
//
// DS_ENGINE_TEST_DEVICE=cpu runs the same tests on the CPU reference backend behind a host-side
// paged-pool accounting (same page size and block count), to check the test itself on a machine
// without a GPU; there recompute is exact, so every request must match its alone run exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cpu/forward.h"
#include "cuda/cuda_backend.h"
#include "cuda_test_util.h"
#include "model/weights.h"
#include "runtime/cpu_backend.h"
#include "runtime/engine.h"

namespace ds {
namespace {

constexpr int kPage = 16;           // tokens per KV block
constexpr float kNearTie = 0.25f;   // nats: "close to a tie" in the alone runs' printed statistics
constexpr int64_t kBigPool = 8192;  // tokens: no memory pressure
constexpr auto kWait = std::chrono::milliseconds(60000);

bool on_cpu() {
  const char* e = std::getenv("DS_ENGINE_TEST_DEVICE");
  return e && std::string(e) == "cpu";
}

// The CPU reference backend with the CUDA engine's paged-pool accounting on top: a sequence of n
// tokens holds ceil(n / page) of `blocks` blocks; can_grow refuses what would not fit.
class PooledCpuBackend : public Backend {
 public:
  PooledCpuBackend(const HostWeights& w, const BackendOptions& o, int64_t blocks)
      : cpu_(w, o), blocks_(blocks) {}
  const ModelConfig& config() const override { return cpu_.config(); }
  std::string name() const override { return "cpu+pool"; }
  int n_slots() const override { return cpu_.n_slots(); }
  int max_seq_len() const override {
    return static_cast<int>(std::min<int64_t>(cpu_.max_seq_len(), blocks_ * kPage));
  }
  int slot_len(int s) const override { return cpu_.slot_len(s); }
  bool can_grow(int s, int n) const override {
    const int64_t after = used() - blocks_of(slot_len(s)) + blocks_of(slot_len(s) + n);
    return after <= blocks_ && slot_len(s) + n <= max_seq_len() && cpu_.can_grow(s, n);
  }
  void reset_slot(int s) override { cpu_.reset_slot(s); }
  MemoryUsage memory() const override {
    MemoryUsage m = cpu_.memory();
    m.kv_blocks_total = blocks_;
    m.kv_blocks_used = used();
    m.page_size = kPage;
    return m;
  }
  void step(std::span<const SeqWork> work, std::vector<float>& logits) override {
    for (const SeqWork& w : work)
      DS_CHECK(can_grow(w.slot, static_cast<int>(w.tokens.size())), "pooled cpu: slot ", w.slot,
               " overflows the pool");
    cpu_.step(work, logits);
  }

 private:
  static int64_t blocks_of(int64_t n) { return (n + kPage - 1) / kPage; }
  int64_t used() const {
    int64_t b = 0;
    for (int s = 0; s < cpu_.n_slots(); ++s) b += blocks_of(cpu_.slot_len(s));
    return b;
  }
  CpuBackend cpu_;
  int64_t blocks_;
};

const HostWeights& weights() {
  static const HostWeights w = make_synthetic_weights(tiny_model_config(), 11);
  return w;
}

// logits_rows > 0: lm_head rows per group on the device (CudaEngineOptions::logits_rows).
std::unique_ptr<Backend> make_backend(int n_slots, int64_t kv_tokens, int chunk,
                                      int logits_rows = 0) {
  BackendOptions o;
  o.n_slots = n_slots;
  o.chunk_size = chunk;
  std::unique_ptr<Backend> b;
  if (on_cpu()) {
    o.device = "cpu";
    o.max_seq_len = 512;
    b = std::make_unique<PooledCpuBackend>(weights(), o, kv_tokens / kPage);
  } else {
    o.device = "cuda";
    CudaEngineOptions e;
    e.verbose = false;
    e.page_size = kPage;
    e.max_kv_tokens = kv_tokens;
    if (logits_rows > 0) e.logits_rows = logits_rows;
    b = make_cuda_backend(o, weights(), e);
  }
  const MemoryUsage m = b->memory();
  EXPECT_EQ(m.page_size, kPage);
  EXPECT_EQ(m.kv_blocks_total, kv_tokens / kPage);
  return b;
}

std::unique_ptr<Engine> make_engine(int n_slots, int64_t kv_tokens, int chunk = 32) {
  std::unique_ptr<Backend> b = make_backend(n_slots, kv_tokens, chunk);
  EngineOptions eo;
  eo.scheduler.max_batch = n_slots;
  eo.scheduler.chunk_size = chunk;
  eo.scheduler.max_num_batched_tokens = 128;
  eo.scheduler.max_waiting = 64;
  return std::make_unique<Engine>(std::move(b), nullptr, eo);
}

struct Collected {
  std::vector<GeneratedToken> tokens;
  StreamOutput last;
};

// Reads a stream to its end; cancels it once `cancel_after` tokens came (-1: never; 0: at once).
Collected collect(RequestStream& s, int cancel_after = -1) {
  Collected c;
  if (cancel_after == 0) s.cancel();
  StreamOutput out;
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (std::chrono::steady_clock::now() < deadline) {
    if (!s.next(out, std::chrono::milliseconds(1000))) {
      if (s.finished() && c.last.finish != FinishReason::kNone) break;
      continue;
    }
    for (auto& g : out.tokens) c.tokens.push_back(g);
    c.last = out;
    if (out.finish != FinishReason::kNone) break;
    if (cancel_after > 0 && static_cast<int>(c.tokens.size()) >= cancel_after) s.cancel();
  }
  return c;
}

GenerationRequest make_request(std::mt19937& rng, int prompt_len, int max_tokens) {
  GenerationRequest r;
  const int vocab = weights().config.vocab_size;
  r.prompt.resize(prompt_len);
  for (auto& t : r.prompt) t = static_cast<int32_t>(rng() % vocab);
  r.sampling.temperature = 0;
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  return r;
}

// The requests run one at a time in a large pool, with the top-2 logprobs of every position.
std::vector<Collected> run_alone(const std::vector<GenerationRequest>& reqs) {
  auto eng = make_engine(1, kBigPool);
  std::vector<Collected> out;
  for (GenerationRequest r : reqs) {
    r.top_logprobs = 2;
    out.push_back(collect(*eng->submit(r)));
    EXPECT_EQ(out.back().last.finish, FinishReason::kLength);
    EXPECT_EQ(out.back().last.n_preemptions, 0);
  }
  EXPECT_EQ(eng->stats().n_preemptions, 0);
  // How close the alone runs come to ties (what the tolerance has to cover).
  int n = 0, close = 0;
  float min_margin = 1e30f;
  for (const Collected& c : out) {
    for (const GeneratedToken& g : c.tokens) {
      if (g.top.size() < 2) continue;
      const float m = g.top[0].logprob - g.top[1].logprob;
      ++n;
      close += m < kNearTie;
      min_margin = std::min(min_margin, m);
    }
  }
  std::printf("  alone runs: %d tokens, %d with a top-2 margin below %.2f nats (smallest %.4f)\n",
              n, close, kNearTie, n ? min_margin : 0.0f);
  return out;
}

struct MatchStats {
  int exact = 0, near_tie = 0, compared = 0;
  float min_margin_at_diff = 1e30f;
};

// `got` against `alone`: equal up to the first difference, and there the alone run's top-2 margin
// is within the row's tolerance (`tol`: the teacher-forced tolerance of `got`'s row k, whose
// prefix is the alone run's); on the CPU backend recompute is exact, so no difference at all.
// After a first difference the two continuations are different sequences.
void expect_matches_alone(const std::vector<GeneratedToken>& got, const Collected& alone,
                          const std::vector<float>& tol, const std::string& what, MatchStats& st) {
  ++st.compared;
  const size_t n = std::min(got.size(), alone.tokens.size());
  size_t k = 0;
  while (k < n && got[k].id == alone.tokens[k].id) ++k;
  if (k == n) {
    ++st.exact;
    return;
  }
  const auto& top = alone.tokens[k].top;
  ASSERT_GE(top.size(), 2u) << what;
  ASSERT_LT(k, tol.size()) << what;
  const float margin = top[0].logprob - top[1].logprob;
  st.min_margin_at_diff = std::min(st.min_margin_at_diff, margin);
  ++st.near_tie;
  if (on_cpu()) {
    ADD_FAILURE() << what << ": token " << k << " is " << got[k].id << ", alone "
                  << alone.tokens[k].id << " (the CPU backend recomputes exactly)";
  }
  EXPECT_LE(margin, tol[k]) << what << ": token " << k << " is " << got[k].id << ", alone "
                            << alone.tokens[k].id << " whose top-2 margin is " << margin
                            << " nats, more than the row's tolerance " << tol[k];
}

// ---- The teacher-forced check ------------------------------------------------------------------
// For a request's teacher sequence (prompt + generated tokens but the last), the rows at the
// generated positions from the CPU fp32 oracle, and the per-row noise envelope of correct
// computations of those rows: noise_k = the largest |logit - oracle| at row k over three valid
// device paths (one-pass prefill in chunks of 32, in chunks of 16, and prompt + token-by-token
// decode, the alone run's path) and the oracle itself with its residual stream rounded to bf16
// after every layer (a device-independent sample of the row's sensitivity). A correct computation
// in any other valid order (the loaded runs: batched GEMMs, other KV buckets, a re-prefill after a
// preemption) errs by the same order at the same row, since the error comes from the row's
// conditioning (CudaEngineNumerics below: every device path's row errors follow the CPU-measured
// sensitivity). A generated token t at row k passes when
//   gap_k = max(oracle_k) - oracle_k[t] <= 2 * kNoiseFactor * noise_k + kGapFloor:
// to win, t's logit error minus the best token's must reach gap_k, each error at most
// kNoiseFactor times the envelope. Checked on every generated token (also after a first difference
// from the alone run), and on two controls on the same rows: a valid path outside the envelope
// (prefill in chunks of 7: its argmax must pass) and a planted recompute bug (a preemption after 8
// tokens whose recompute restored the wrong state: the first prompt + 8 positions re-prefilled from
// other tokens; the rows after it must be flagged in every request).
constexpr float kNoiseFactor = 2.0f;
constexpr float kGapFloor = 1e-3f;  // nats; the CPU backends' fp32 order differences are < 1e-3

const CpuModel& oracle() {
  static const CpuModel m(weights());
  return m;
}

// rows [n, V] of seq from the CPU oracle (one pass; its chunked GDN in 64-token sub-chunks);
// bf16_residual: the residual stream rounded to bf16 after every layer.
std::vector<float> oracle_rows(std::span<const int32_t> seq, bool bf16_residual = false) {
  static const CpuModel rounded = [] {
    CpuModel m(weights());
    const int d = weights().config.d_model;
    m.set_layer_probe([d](int, int n, const float* x) {
      float* y = const_cast<float*>(x);  // the forward's own (non-const) residual buffer
      for (int i = 0; i < n * d; ++i) y[i] = round_bf16(y[i]);
    });
    return m;
  }();
  const CpuModel& m = bf16_residual ? rounded : oracle();
  CpuSeqState st = m.new_state();
  std::vector<float> l;
  m.forward(st, seq, 0, true, l);
  return l;
}

// Slot 0 of `b` scores seq in one step (all rows) or prompt + decode (all rows); slot left empty.
std::vector<float> device_rows(Backend& b, std::span<const int32_t> seq, int n_prompt) {
  b.reset_slot(0);
  std::vector<float> l;
  if (n_prompt <= 0) {
    const SeqWork w{0, seq, true};
    b.step(std::span<const SeqWork>(&w, 1), l);
  } else {
    test::prefill_then_decode(b, seq, n_prompt, /*keep_prompt=*/true, l);
  }
  b.reset_slot(0);
  return l;
}

size_t argmax_of(const float* r, size_t n) { return size_t(std::max_element(r, r + n) - r); }
float max_abs_diff(const float* a, const float* b, size_t n) {
  float m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

struct TeacherRows {
  int n_gen = 0;
  std::vector<float> oracle;  // [n_gen, V] at the generated positions
  std::vector<float> noise;   // [n_gen] envelope of the valid paths
  std::vector<float> tol;     // [n_gen] allowed gap
};

// Device backends without memory pressure (1 slot each) for the envelope and the controls.
struct RefBackends {
  std::unique_ptr<Backend> chunk32 = make_backend(1, kBigPool, 32);
  std::unique_ptr<Backend> chunk16 = make_backend(1, kBigPool, 16);
  std::unique_ptr<Backend> chunk7 = make_backend(1, kBigPool, 7);
};

std::vector<int32_t> teacher_sequence(const GenerationRequest& r,
                                      const std::vector<GeneratedToken>& got) {
  std::vector<int32_t> seq = r.prompt;
  for (size_t k = 0; k + 1 < got.size(); ++k) seq.push_back(got[k].id);
  return seq;
}

TeacherRows teacher_rows(RefBackends& ref, const GenerationRequest& r,
                         const std::vector<GeneratedToken>& got) {
  TeacherRows t;
  t.n_gen = static_cast<int>(got.size());
  if (got.empty()) return t;
  const std::vector<int32_t> seq = teacher_sequence(r, got);
  const size_t V = static_cast<size_t>(ref.chunk32->config().vocab_size);
  const size_t first = r.prompt.size() - 1;  // row of the first generated token
  const std::vector<float> o = oracle_rows(seq);
  const std::vector<std::vector<float>> paths = {
      device_rows(*ref.chunk32, seq, 0), device_rows(*ref.chunk16, seq, 0),
      device_rows(*ref.chunk32, seq, static_cast<int>(r.prompt.size())),
      oracle_rows(seq, /*bf16_residual=*/true)};
  for (const auto& p : paths) {
    EXPECT_EQ(p.size(), seq.size() * V);
    if (p.size() != seq.size() * V) {  // (the failure above; no reads past the end)
      t.n_gen = 0;
      return t;
    }
  }
  if (o.size() != seq.size() * V) {
    ADD_FAILURE() << "oracle rows: " << o.size() << " values for " << seq.size() << " tokens";
    t.n_gen = 0;
    return t;
  }
  t.oracle.assign(o.begin() + first * V, o.end());
  for (int k = 0; k < t.n_gen; ++k) {
    const size_t at = (first + k) * V;
    float n = 0;
    for (const auto& p : paths) n = std::max(n, max_abs_diff(p.data() + at, o.data() + at, V));
    t.noise.push_back(n);
    t.tol.push_back(2 * kNoiseFactor * n + kGapFloor);
  }
  return t;
}

// gap of token `id` at generated row k under the oracle.
float gap_at(const TeacherRows& t, int k, int32_t id) {
  const size_t V = t.oracle.size() / t.n_gen;
  const float* row = t.oracle.data() + size_t(k) * V;
  return *std::max_element(row, row + V) - row[id];
}

struct ForcedStats {
  int tokens = 0, not_argmax = 0, over = 0;
  float max_gap = 0, max_ratio = 0;  // ratio: gap / (2 noise), what kNoiseFactor must cover
  void add(float gap, float noise, float tol) {
    ++tokens;
    not_argmax += gap > 0;
    over += gap > tol;
    max_gap = std::max(max_gap, gap);
    if (gap > kGapFloor) max_ratio = std::max(max_ratio, gap / std::max(2 * noise, 1e-6f));
  }
  void print(const char* what) const {
    std::printf(
        "  %s: %d tokens, %d not the oracle's argmax, largest gap %.4f nats, largest gap / "
        "(2 noise) %.2f, %d over the tolerance\n",
        what, tokens, not_argmax, max_gap, max_ratio, over);
  }
};

// The generated tokens against the oracle within the row tolerance (all positions).
void expect_greedy_teacher_forced(const TeacherRows& t, const std::vector<GeneratedToken>& got,
                                  const std::string& what, ForcedStats& st) {
  ASSERT_EQ(static_cast<int>(got.size()), t.n_gen) << what;
  const int V = static_cast<int>(t.oracle.size() / std::max(t.n_gen, 1));
  for (int k = 0; k < t.n_gen; ++k) {
    ASSERT_GE(got[k].id, 0) << what;
    ASSERT_LT(got[k].id, V) << what;
    const float gap = gap_at(t, k, got[k].id);
    st.add(gap, t.noise[k], t.tol[k]);
    EXPECT_LE(gap, t.tol[k]) << what << ": generated token " << k << " (" << got[k].id << ") is "
                             << gap << " nats below the oracle's greedy choice given the same "
                             << "prefix; correct device paths err by up to " << t.noise[k]
                             << " at this row (tolerance " << t.tol[k] << ")";
  }
}

// The controls of the file comment on the same teacher rows: a valid path outside the envelope
// (prefill in chunks of 7: its argmax must pass) and a planted recompute bug (below: its argmax
// must be flagged at some row of every request).
struct ControlStats {
  ForcedStats valid, planted;
  int planted_requests = 0, planted_caught = 0;
};
void run_controls(RefBackends& ref, const GenerationRequest& r,
                  const std::vector<GeneratedToken>& got, const TeacherRows& t, ControlStats& cs) {
  if (got.size() < 2) return;
  const std::vector<int32_t> seq = teacher_sequence(r, got);
  const size_t V = static_cast<size_t>(ref.chunk7->config().vocab_size);
  const size_t first = r.prompt.size() - 1;
  const std::vector<float> c7 = device_rows(*ref.chunk7, seq, 0);
  ASSERT_EQ(c7.size(), seq.size() * V);
  for (int k = 0; k < t.n_gen; ++k) {
    const int32_t id = static_cast<int32_t>(argmax_of(c7.data() + (first + k) * V, V));
    const float gap = gap_at(t, k, id);
    cs.valid.add(gap, t.noise[k], t.tol[k]);
    EXPECT_LE(gap, t.tol[k]) << "control (prefill in chunks of 7, a correct path): row " << k
                             << ", envelope " << t.noise[k];
  }
  // Planted: a preemption after g0 generated tokens whose recompute restored the wrong state (the
  // first p positions re-prefilled from other tokens); rows after p are checked. Requests with 16
  // or more tokens (enough rows after the recompute).
  if (got.size() < 16) return;
  const int g0 = 8;
  const size_t p = r.prompt.size() + g0;
  std::vector<int32_t> bad = seq;
  for (size_t j = 0; j < p; ++j) bad[j] = static_cast<int32_t>((bad[j] * 7919 + 104729) % V);
  const std::vector<float> b = device_rows(*ref.chunk7, bad, 0);
  ASSERT_EQ(b.size(), bad.size() * V);
  int caught = 0;
  for (int k = g0 + 1; k < t.n_gen; ++k) {  // row first + k: the query token at p - 1 + k - g0
    const int32_t id = static_cast<int32_t>(argmax_of(b.data() + (first + k) * V, V));
    const float gap = gap_at(t, k, id);
    cs.planted.add(gap, t.noise[k], t.tol[k]);
    caught += gap > t.tol[k];
  }
  ++cs.planted_requests;
  cs.planted_caught += caught > 0;
}

// Submits every request at once and reads each stream on its own thread (cancel_after[i] as in
// collect()); the streams are returned for the finished() checks.
std::vector<Collected> submit_and_collect(Engine& eng, const std::vector<GenerationRequest>& reqs,
                                          const std::vector<int>& cancel_after,
                                          std::vector<std::shared_ptr<RequestStream>>& streams) {
  for (const auto& r : reqs) streams.push_back(eng.submit(r));
  std::vector<Collected> got(reqs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < reqs.size(); ++i)
    threads.emplace_back([&, i] { got[i] = collect(*streams[i], cancel_after[i]); });
  for (auto& t : threads) t.join();
  return got;
}

void expect_drained(Engine& eng) {
  ASSERT_TRUE(eng.wait_idle(kWait));
  const EngineStats st = eng.stats();
  EXPECT_EQ(st.n_running, 0);
  EXPECT_EQ(st.n_waiting, 0);
  EXPECT_EQ(st.memory.kv_blocks_used, 0);
  EXPECT_EQ(st.memory.state_slots_used, 0);
}

#define REQUIRE_DEVICE() \
  if (!on_cpu()) DS_REQUIRE_GPU()

// The checks shared by both tests for request i: alone-run agreement, the teacher-forced check
// and its two controls.
struct Checks {
  MatchStats ms;
  ForcedStats fs;
  ControlStats cs;
  RefBackends ref;
  void check(const GenerationRequest& r, const std::vector<GeneratedToken>& got,
             const Collected& alone, const std::string& what) {
    if (got.empty()) return;
    const TeacherRows t = teacher_rows(ref, r, got);
    expect_matches_alone(got, alone, t.tol, what, ms);
    expect_greedy_teacher_forced(t, got, what, fs);
    run_controls(ref, r, got, t, cs);
  }
  void print_and_check_controls() {
    fs.print("teacher-forced (loaded runs)");
    cs.valid.print("control, prefill in chunks of 7 (a correct path)");
    cs.planted.print("control, planted recompute bug (wrong state restored)");
    std::printf("  planted bug caught in %d of %d requests\n", cs.planted_caught,
                cs.planted_requests);
    // A wrong prefix is a different sequence: every request must show it.
    EXPECT_EQ(cs.planted_caught, cs.planted_requests)
        << "the tolerance is too loose to see a recompute from the wrong sequence";
  }
};

TEST(CudaEngine, PreemptionRecomputesAndMatchesAlone) {
  REQUIRE_DEVICE();
  std::mt19937 rng(5);
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 8; ++i) reqs.push_back(make_request(rng, 20 + 6 * i, 48));
  const std::vector<Collected> alone = run_alone(reqs);

  // 24 blocks of 16 = 384 tokens for 8 sequences growing to 68-110 tokens (5-7 blocks each).
  auto eng = make_engine(8, 24 * kPage);
  std::vector<std::shared_ptr<RequestStream>> streams;
  const std::vector<Collected> got =
      submit_and_collect(*eng, reqs, std::vector<int>(reqs.size(), -1), streams);

  Checks ck;
  int preempted_requests = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const std::string what = "request " + std::to_string(i);
    EXPECT_EQ(got[i].last.finish, FinishReason::kLength) << what << ": " << got[i].last.error;
    ASSERT_EQ(got[i].tokens.size(), 48u) << what;
    EXPECT_EQ(got[i].last.n_generated, 48) << what;
    preempted_requests += got[i].last.n_preemptions > 0;
    ck.check(reqs[i], got[i].tokens, alone[i], what);
  }
  const EngineStats st = eng->stats();
  std::printf(
      "  %s: %lld preemptions (%d of 8 requests preempted), %d/8 requests token-exact vs alone, "
      "%d differ first within the row tolerance (smallest alone margin there %.4f nats)\n",
      on_cpu() ? "cpu+pool" : "cuda", static_cast<long long>(st.n_preemptions), preempted_requests,
      ck.ms.exact, ck.ms.near_tie, ck.ms.near_tie ? ck.ms.min_margin_at_diff : 0.0f);
  ck.print_and_check_controls();
  EXPECT_GT(st.n_preemptions, 0) << "the pool did not force a preemption";
  EXPECT_GT(preempted_requests, 0);
  expect_drained(*eng);
}

// Prompt logprobs (GenerationRequest::prompt_logprobs) through the engine: on the device the
// backend scores the prompt rows itself (Backend::max_score_top; the CPU pool backend of
// DS_ENGINE_TEST_DEVICE=cpu gives the rows to the host instead). Either way each position must
// match position_logprobs over the logits rows a second backend gives for the same 64-token
// items with all_logits (each split by the backends into 32-token forwards, whose rows go through
// lm_head 16 at a time): the logprob within 2e-6 (float exps summed in another order), the rank
// and the top ids exactly unless two logits are within 1e-5 of each other; a request after it
// without them runs as usual.
TEST(CudaEngine, PromptLogprobsMatchTheBackendRows) {
  REQUIRE_DEVICE();
  std::mt19937 rng(9);
  GenerationRequest r = make_request(rng, 100, 4);
  r.prompt_logprobs = 3;
  const GenerationRequest plain = make_request(rng, 50, 4);
  std::unique_ptr<Backend> b = make_backend(2, kBigPool, 32, 16);
  const bool on_device = b->max_score_top() >= 3;
  EngineOptions eo;
  eo.scheduler.max_batch = 2;
  eo.scheduler.chunk_size = 64;
  eo.scheduler.max_num_batched_tokens = 128;
  eo.scheduler.max_logit_rows = 64;  // (the host path's cap; the device path has none)
  Engine eng(std::move(b), nullptr, eo);
  // Alone, so that every step's shapes (and so its logits) are the reference's below: a request
  // beside it changes the GEMMs' M and with it the bf16 rounding of this tiny model's activations
  // (logprobs moved by up to 0.014 when the plain request below ran in the same steps).
  auto s1 = eng.submit(r);
  std::vector<GeneratedToken> prompt_lp;
  StreamOutput out;
  for (int i = 0; i < 1000 && out.finish == FinishReason::kNone; ++i) {
    if (!s1->next(out, kWait)) break;
    for (auto& g : out.prompt_logprobs) prompt_lp.push_back(g);
  }
  const Collected c2 = collect(*eng.submit(plain));
  EXPECT_EQ(out.finish, FinishReason::kLength) << out.error;
  EXPECT_EQ(c2.last.finish, FinishReason::kLength) << c2.last.error;
  ASSERT_EQ(prompt_lp.size(), 99u);

  std::unique_ptr<Backend> ref = make_backend(1, kBigPool, 32, 16);
  const size_t V = static_cast<size_t>(weights().config.vocab_size);
  std::vector<float> rows, part;
  for (int b0 = 0; b0 < 100; b0 += 64) {
    SeqWork w;
    w.slot = 0;
    w.tokens = std::span<const int32_t>(r.prompt).subspan(b0, std::min(64, 100 - b0));
    w.all_logits = true;
    ref->step(std::span<const SeqWork>(&w, 1), part);
    rows.insert(rows.end(), part.begin(), part.end());
  }
  ASSERT_EQ(rows.size(), 100 * V);
  int bad = 0, near_ties = 0;
  float worst = 0;
  for (int j = 1; j < 100; ++j) {
    const std::span<const float> row(rows.data() + (j - 1) * V, V);
    const PositionLogprobs want = position_logprobs(row, r.prompt[j], 3);
    const GeneratedToken& g = prompt_lp[j - 1];
    EXPECT_EQ(g.id, r.prompt[j]);
    worst = std::max(worst, std::fabs(g.logprob - want.logprob));
    bad += std::fabs(g.logprob - want.logprob) > 2e-6f || g.top.size() != 3;
    // Ranks and top ids are exact where no other logit is within 1e-5 of the ones compared.
    std::vector<float> sorted(row.begin(), row.end());
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    bool tie = false;
    for (size_t k = 0; k + 1 < sorted.size() && k < 4; ++k) tie |= sorted[k] - sorted[k + 1] < 1e-5f;
    for (float x : row) tie |= x != row[r.prompt[j]] && std::fabs(x - row[r.prompt[j]]) < 1e-5f;
    if (tie) {
      ++near_ties;
      continue;
    }
    bad += g.rank != want.rank;
    for (size_t k = 0; k < std::min<size_t>(3, g.top.size()); ++k)
      bad += g.top[k].token != want.top[k].token ||
             std::fabs(g.top[k].logprob - want.top[k].logprob) > 2e-6f;
  }
  std::printf("  %s (%s): 99 prompt positions, %d differ, largest logprob difference %.3g, %d "
              "near ties\n",
              on_cpu() ? "cpu+pool" : "cuda", on_device ? "scored by the backend" : "host rows",
              bad, worst, near_ties);
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(on_device, !on_cpu());
  expect_drained(eng);
}

TEST(CudaEngine, ConcurrentWithRandomCancellations) {
  REQUIRE_DEVICE();
  std::mt19937 rng(17);
  std::vector<GenerationRequest> reqs;
  std::vector<int> cancel_after;  // -1: never
  for (int i = 0; i < 32; ++i) {
    reqs.push_back(make_request(rng, 8 + static_cast<int>(rng() % 48), 16 + i % 17));
    cancel_after.push_back(i % 3 == 1 ? static_cast<int>(rng() % 6) : -1);
  }
  const std::vector<Collected> alone = run_alone(reqs);

  auto eng = make_engine(16, 40 * kPage, 16);
  std::vector<std::shared_ptr<RequestStream>> streams;
  const std::vector<Collected> got = submit_and_collect(*eng, reqs, cancel_after, streams);

  Checks ck;
  int cancelled = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const std::string what = "request " + std::to_string(i);
    const FinishReason f = got[i].last.finish;
    EXPECT_TRUE(streams[i]->finished()) << what;
    if (cancel_after[i] >= 0 && f == FinishReason::kCancelled) {
      ++cancelled;
      EXPECT_LE(got[i].tokens.size(), static_cast<size_t>(reqs[i].max_tokens)) << what;
    } else {
      EXPECT_EQ(f, FinishReason::kLength) << what << ": " << got[i].last.error;
      EXPECT_EQ(got[i].tokens.size(), static_cast<size_t>(reqs[i].max_tokens)) << what;
    }
    // Whatever came (also before a cancellation) follows the alone run.
    ck.check(reqs[i], got[i].tokens, alone[i], what);
  }
  const EngineStats st = eng->stats();
  std::printf(
      "  %s: 32 requests, %d cancelled, %lld preemptions, %d/%d token-exact vs alone, %d differ "
      "first within the row tolerance\n",
      on_cpu() ? "cpu+pool" : "cuda", cancelled, static_cast<long long>(st.n_preemptions),
      ck.ms.exact, ck.ms.compared, ck.ms.near_tie);
  EXPECT_GT(cancelled, 0);
  expect_drained(*eng);
  EXPECT_EQ(eng->stats().n_finished[static_cast<int>(FinishReason::kCancelled)], cancelled);

  // Still serving: one more request, alone on the drained engine, checked like the others.
  Collected c = collect(*eng->submit(reqs[0]));
  EXPECT_EQ(c.last.finish, FinishReason::kLength);
  EXPECT_EQ(c.tokens.size(), alone[0].tokens.size());
  ck.check(reqs[0], c.tokens, alone[0], "request 0 after the load");
  expect_drained(*eng);
  ck.print_and_check_controls();
}

// ---- CudaEngineNumerics: every device path vs the CPU fp32 oracle -----------------------------
// The sequences the preemption test checks (its 8 prompts, each followed by the oracle's greedy
// continuation of 48 tokens) scored by every device path: one pass, prefill in chunks of 32 / 16 /
// 7, prompt + token-by-token decode with CUDA graphs on and off, every token its own step, and
// (CUDA) one pass / prompt + decode with every specialised kernel switched off (the generic
// fallbacks). Each row is compared with the CPU fp32 oracle: normalised L2, largest |error|,
// rows whose argmax is not the oracle's and the largest such gap (what the engine test's
// teacher-forced check sees), and where the worst row is; per layer, the same on the model cut
// after layer 1, 2, 3 (GDN layers) and on one attention layer alone.
// The yardstick: the same oracle run on the synthetic weights BEFORE their rounding to bf16
// (make_synthetic_weights with F32): a half-ulp bf16 perturbation of every weight and nothing
// else. It moves the logits as much as the device does, layer by layer (H200, 2026-11-29, at
// 8d6522d, L2 / largest |err| vs the oracle, device one pass | unrounded weights):
//   1 GDN layer 2.5e-2 / 1.35 | 1.6e-2 / 0.43;  2 GDN layers 5.4e-2 / 2.0 | 5.3e-2 / 2.6;
//   3 GDN layers 1.0e-1 / 4.3 | 9.7e-2 / 3.4;   full model 1.10e-1 / 3.8 | 1.07e-1 / 3.7 (largest
//   gap 2.12 | 2.21 nats);  attention layer alone 8.9e-3 / 0.07 | 6.8e-3 / 0.05,
// and every device path (prefill, decode, graphs, generic kernels) errs the same (L2 1.00e-1 to
// 1.10e-1). So the 1-2 nat gaps of the engine test are this random model's conditioning, not a
// kernel bug: its GDN layers amplify bf16-sized changes ~10x (e.g. the gated RMSNorm of a GDN
// output that nearly cancels: o = beta (q.k) v at a token whose q.k is near 0 flips sign under
// any rounding). A path with a real bug (a wrong index, state or boundary) errs far beyond the
// yardstick: the bound is kPathFactor x the yardstick's L2 (measured ratio <= 1.6). Also printed:
// row errors per position class (page starts, chunk starts, prompt vs generated rows: a boundary
// bug shows there; H200: mean 0.17-0.22 in every class) and against the yardstick row by row (e/s;
// H200: median 1.06, correlation of the logs 0.63). Graphs on and off bit-identical.
constexpr double kPathFactor = 2.5;

struct NumSeq {
  std::vector<int32_t> tokens;
  int n_prompt = 0;
};

std::vector<NumSeq> numerics_sequences(const CpuModel& m) {
  std::mt19937 rng(5);
  std::vector<NumSeq> out;
  const size_t V = static_cast<size_t>(m.config().vocab_size);
  for (int i = 0; i < 8; ++i) {
    NumSeq s;
    s.tokens = make_request(rng, 20 + 6 * i, 48).prompt;
    s.n_prompt = static_cast<int>(s.tokens.size());
    CpuSeqState st = m.new_state();
    std::vector<float> l;
    m.forward(st, s.tokens, 0, false, l);
    for (int k = 0; k + 1 < 48; ++k) {
      const int32_t t = static_cast<int32_t>(argmax_of(l.data() + l.size() - V, V));
      s.tokens.push_back(t);
      l.clear();
      m.forward(st, std::span<const int32_t>(&s.tokens.back(), 1), 0, false, l);
    }
    out.push_back(std::move(s));
  }
  return out;
}

// Errors of one path against the oracle over all rows of all sequences.
struct PathErr {
  std::string name;
  double num = 0, den = 0;
  float max_abs = 0, max_gap = 0;
  int rows = 0, not_argmax = 0, worst_seq = -1, worst_pos = -1;
  std::vector<float> row_err;  // per row, max |path - oracle|
  std::vector<int> row_pos, row_prompt;
  void add(const std::vector<float>& got, const std::vector<float>& ref, size_t V, int seq,
           int n_prompt) {
    ASSERT_EQ(got.size(), ref.size()) << name;
    for (size_t r = 0; r < ref.size() / V; ++r) {
      const float* g = got.data() + r * V;
      const float* o = ref.data() + r * V;
      float e = 0;
      for (size_t v = 0; v < V; ++v) {
        const double d = double(g[v]) - o[v];
        num += d * d;
        den += double(o[v]) * o[v];
        e = std::isfinite(g[v]) ? std::max(e, float(std::fabs(d))) : INFINITY;
      }
      const float gap = o[argmax_of(o, V)] - o[argmax_of(g, V)];
      not_argmax += gap > 0;
      max_gap = std::max(max_gap, gap);
      if (e > max_abs) {
        max_abs = e;
        worst_seq = seq;
        worst_pos = static_cast<int>(r);
      }
      row_err.push_back(e);
      row_pos.push_back(static_cast<int>(r));
      row_prompt.push_back(static_cast<int>(r) < n_prompt - 1);
      ++rows;
    }
  }
  double l2() const { return std::sqrt(num / std::max(den, 1e-30)); }
};

// Max and mean of the row errors over the rows where pred(i) holds.
std::string row_class(const PathErr& e, const std::function<bool(size_t)>& pred) {
  float mx = 0;
  double sum = 0;
  int n = 0;
  for (size_t i = 0; i < e.row_err.size(); ++i) {
    if (!pred(i)) continue;
    mx = std::max(mx, e.row_err[i]);
    sum += e.row_err[i];
    ++n;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f/%.3f (%d)", n ? sum / n : 0.0, mx, n);
  return buf;
}

// Row error relative to the sensitivity s_r: quantiles of e_r / s_r and the correlation of the
// logs (s_r floored at 1e-3).
std::string vs_sensitivity(const PathErr& e, const PathErr& s) {
  if (e.row_err.size() != s.row_err.size() || e.row_err.empty()) return "-";
  std::vector<double> ratio, le, ls;
  for (size_t i = 0; i < e.row_err.size(); ++i) {
    const double si = std::max(s.row_err[i], 1e-3f), ei = std::max(e.row_err[i], 1e-6f);
    ratio.push_back(ei / si);
    le.push_back(std::log(ei));
    ls.push_back(std::log(si));
  }
  std::sort(ratio.begin(), ratio.end());
  const size_t n = le.size();
  double me = 0, ms = 0;
  for (size_t i = 0; i < n; ++i) me += le[i] / n, ms += ls[i] / n;
  double cov = 0, ve = 0, vs = 0;
  for (size_t i = 0; i < n; ++i) {
    cov += (le[i] - me) * (ls[i] - ms);
    ve += (le[i] - me) * (le[i] - me);
    vs += (ls[i] - ms) * (ls[i] - ms);
  }
  char buf[128];
  std::snprintf(buf, sizeof buf, "e/s median %.2f p99 %.2f max %.2f, corr(log e, log s) %.2f",
                ratio[n / 2], ratio[std::min(n - 1, n * 99 / 100)], ratio.back(),
                cov / std::sqrt(std::max(ve * vs, 1e-30)));
  return buf;
}

void print_path(const PathErr& e, const PathErr* sens) {
  std::printf("  %-34s L2 %.3e max|err| %.3f (seq %d row %d) not-argmax %3d/%d max gap %.3f\n",
              e.name.c_str(), e.l2(), e.max_abs, e.worst_seq, e.worst_pos, e.not_argmax, e.rows,
              e.max_gap);
  if (!sens) return;
  const auto& pos = e.row_pos;
  std::printf(
      "  %-34s mean/max|err| (rows): page starts %s, others %s; chunk-32 starts %s; prompt rows "
      "%s, generated rows %s\n",
      "", row_class(e, [&](size_t i) { return pos[i] % kPage == 0; }).c_str(),
      row_class(e, [&](size_t i) { return pos[i] % kPage != 0; }).c_str(),
      row_class(e, [&](size_t i) { return pos[i] % 32 == 0; }).c_str(),
      row_class(e, [&](size_t i) { return e.row_prompt[i] != 0; }).c_str(),
      row_class(e, [&](size_t i) { return e.row_prompt[i] == 0; }).c_str());
  std::printf("  %-34s %s\n", "", vs_sensitivity(e, *sens).c_str());
}

struct PathSpec {
  std::string name;
  int chunk;
  int mode;  // 0: one pass, 1: prompt + decode, 2: every token its own step
  bool graphs = true, generic = false, cuda_only = false;
};

std::unique_ptr<Backend> make_numerics_backend(const HostWeights& w, const PathSpec& p) {
  BackendOptions o;
  o.n_slots = 1;
  o.chunk_size = p.chunk;
  if (on_cpu()) {
    o.device = "cpu";
    o.max_seq_len = 512;
    return std::make_unique<CpuBackend>(w, o);
  }
  o.device = "cuda";
  CudaEngineOptions e;
  e.verbose = false;
  e.page_size = kPage;
  e.max_kv_tokens = 4096;
  e.cuda_graphs = p.graphs;
  if (p.generic) e.disable_kernels = "all";
  return make_cuda_backend(o, w, e);
}

// One model (synthetic weights of `seed`): every path against the oracle, printed, after the
// yardsticks (out[0]: unrounded fp32 weights; out[1]: the residual stream rounded to bf16 after
// every layer); returns the errors.
std::vector<PathErr> run_paths(const HostWeights& w, uint64_t seed, const std::vector<NumSeq>& seqs,
                               const std::vector<PathSpec>& paths, bool print_classes,
                               std::vector<std::vector<float>>* graphs_on_rows = nullptr) {
  const size_t V = static_cast<size_t>(w.config.vocab_size);
  CpuModel m(w);
  std::vector<std::vector<float>> ref;
  for (const NumSeq& s : seqs) {
    CpuSeqState st = m.new_state();
    ref.emplace_back();
    m.forward(st, s.tokens, 0, true, ref.back());
  }
  std::vector<PathErr> out;
  auto oracle_variant = [&](const std::string& name, const HostWeights& wv,
                            CpuModel::LayerProbe probe) {
    CpuModel pm(wv);
    if (probe) pm.set_layer_probe(std::move(probe));
    PathErr e;
    e.name = name;
    for (size_t i = 0; i < seqs.size(); ++i) {
      CpuSeqState st = pm.new_state();
      std::vector<float> l;
      pm.forward(st, seqs[i].tokens, 0, true, l);
      e.add(l, ref[i], V, static_cast<int>(i), seqs[i].n_prompt);
    }
    return e;
  };
  const HostWeights unrounded = make_synthetic_weights(w.config, seed, DType::kF32);
  out.push_back(oracle_variant("cpu: unrounded fp32 weights", unrounded, nullptr));
  const int d = w.config.d_model;
  // The probe's buffer is the forward's own (non-const) residual stream.
  auto round_residual = [d](int, int n, const float* x) {
    float* y = const_cast<float*>(x);
    for (int i = 0; i < n * d; ++i) y[i] = round_bf16(y[i]);
  };
  out.push_back(oracle_variant("cpu: residual -> bf16 per layer", w, round_residual));
  for (const PathErr& e : out) print_path(e, nullptr);
  for (const PathSpec& p : paths) {
    if (p.cuda_only && on_cpu()) continue;
    auto b = make_numerics_backend(w, p);
    PathErr e;
    e.name = (on_cpu() ? "cpu: " : "cuda: ") + p.name;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int n_prompt = p.mode == 0 ? 0 : p.mode == 1 ? seqs[i].n_prompt : 1;
      std::vector<float> l = device_rows(*b, seqs[i].tokens, n_prompt);
      e.add(l, ref[i], V, static_cast<int>(i), seqs[i].n_prompt);
      if (graphs_on_rows && p.mode == 1 && p.chunk == 32 && !p.generic) {
        if (p.graphs) {
          graphs_on_rows->push_back(l);
        } else if (i < graphs_on_rows->size()) {
          EXPECT_EQ(std::memcmp(l.data(), (*graphs_on_rows)[i].data(), l.size() * sizeof(float)), 0)
              << "prompt + decode: graphs on and off differ (sequence " << i << ")";
        }
      }
    }
    print_path(e, print_classes ? &out[0] : nullptr);
    out.push_back(std::move(e));
  }
  return out;
}

TEST(CudaEngineNumerics, EveryPathVsCpuOracle) {
  REQUIRE_DEVICE();
  const std::vector<NumSeq> seqs = numerics_sequences(oracle());
  const std::vector<PathSpec> paths = {
      {"one pass (chunk 4096)", 4096, 0},
      {"prefill chunk 32", 32, 0},
      {"prefill chunk 16", 16, 0},
      {"prefill chunk 7", 7, 0},
      {"prompt + decode, graphs", 32, 1, true},
      {"prompt + decode, no graphs", 32, 1, false, false, true},
      {"every token its own step", 32, 2},
      {"generic kernels: one pass", 4096, 0, true, true, true},
      {"generic kernels: prompt + decode", 32, 1, false, true, true},
  };
  std::printf("  full model (3 GDN + 1 attention), %zu sequences of 68-110 tokens:\n", seqs.size());
  std::vector<std::vector<float>> graph_rows;
  const std::vector<PathErr> full = run_paths(weights(), 11, seqs, paths, true, &graph_rows);
  for (size_t i = 2; i < full.size(); ++i) {
    EXPECT_LT(full[i].l2(), kPathFactor * full[0].l2()) << full[i].name;
    EXPECT_TRUE(std::isfinite(full[i].max_abs)) << full[i].name;
  }
  // Per layer: the model cut after layer 1..3 (GDN layers), and one attention layer alone.
  const std::vector<PathSpec> few = {
      {"one pass", 4096, 0},
      {"prefill chunk 16", 16, 0},
      {"prompt + decode", 32, 1},
      {"generic kernels: prompt + decode", 32, 1, false, true, true}};
  for (int cut = 1; cut <= 4; ++cut) {
    ModelConfig c = tiny_model_config();
    if (cut < 4) {
      c.n_layers = cut;
      c.layer_types.resize(cut);
    } else {
      c.n_layers = 1;
      c.layer_types = {LayerType::kFull};
    }
    const HostWeights w = make_synthetic_weights(c, 11);
    if (cut < 4) {
      std::printf("  cut after layer %d (%d GDN layer%s):\n", cut, cut, cut > 1 ? "s" : "");
    } else {
      std::printf("  one attention layer alone:\n");
    }
    // Every cut runs on the H200 (log of ce33b2d): an error here is a failure, not a skip.
    const std::vector<PathErr> e = run_paths(w, 11, seqs, few, false);
    for (size_t i = 2; i < e.size(); ++i)
      EXPECT_LT(e[i].l2(), kPathFactor * e[0].l2()) << e[i].name << ", cut " << cut;
  }
}

}  // namespace
}  // namespace ds
