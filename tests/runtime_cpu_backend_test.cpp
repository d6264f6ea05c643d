// CpuBackend through the Backend interface: interleaved slots give the same logits as one
// sequence alone, multi-item steps, slot bookkeeping and limits, bad steps rejected without
// touching any slot; make_backend's device choice.
#include <gtest/gtest.h>

#include "core/error.h"
#include "model/weights.h"
#include "runtime/backend_factory.h"
#include "runtime/cpu_backend.h"

namespace ds {
namespace {

HostWeights tiny() {
  ModelConfig c = tiny_model_config(256);
  return make_synthetic_weights(c, 7);
}

std::vector<int32_t> seq(int n, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((i * 37 + salt * 11) % 256);
  return t;
}

TEST(CpuBackend, InterleavedSlotsMatchSingleSequence) {
  HostWeights w = tiny();
  BackendOptions o;
  o.n_slots = 3;
  o.chunk_size = 16;
  CpuBackend be(w, o);
  const int V = be.config().vocab_size;
  const auto a = seq(40, 1), b = seq(25, 2);

  // Reference: each alone in the CpuModel, split the same way (so the rounding is the same).
  auto alone = [&](const std::vector<int32_t>& t, size_t split) {
    CpuSeqState s = be.model().new_state();
    std::vector<float> l;
    std::span<const int32_t> st(t);
    be.model().forward(s, st.subspan(0, split), 16, false, l);
    l.clear();
    be.model().forward(s, st.subspan(split), 16, false, l);
    return l;
  };
  // Interleaved: a's prompt in two steps, b's in one, both in the same step once.
  std::vector<float> out;
  std::span<const int32_t> sa(a), sb(b);
  SeqWork w0{0, sa.subspan(0, 30), false};
  be.step(std::span<const SeqWork>(&w0, 1), out);
  ASSERT_EQ(out.size(), static_cast<size_t>(V));
  std::vector<SeqWork> both = {{2, sb, true}, {0, sa.subspan(30), false}};
  be.step(both, out);
  ASSERT_EQ(out.size(), static_cast<size_t>(V) * (b.size() + 1));
  const auto ra = alone(a, 30), rb = alone(b, 0);
  for (int i = 0; i < V; ++i) {
    EXPECT_FLOAT_EQ(out[(b.size() - 1) * V + i], rb[i]);  // last row of b's all-logits
    EXPECT_FLOAT_EQ(out[b.size() * V + i], ra[i]);        // a's last row
  }
  EXPECT_EQ(be.slot_len(0), 40);
  EXPECT_EQ(be.slot_len(1), 0);
  EXPECT_EQ(be.slot_len(2), 25);
  EXPECT_EQ(be.memory().state_slots_used, 2);
  be.reset_slot(0);
  EXPECT_EQ(be.slot_len(0), 0);
  EXPECT_EQ(be.memory().state_slots_used, 1);
  EXPECT_EQ(be.name(), "cpu");
}

TEST(CpuBackend, LimitsAndBadStepsLeaveSlotsAlone) {
  HostWeights w = tiny();
  BackendOptions o;
  o.n_slots = 2;
  o.max_seq_len = 10;
  CpuBackend be(w, o);
  EXPECT_EQ(be.max_seq_len(), 10);
  const auto t = seq(8, 3);
  std::vector<float> out;
  SeqWork ok{1, t, false};
  be.step(std::span<const SeqWork>(&ok, 1), out);
  EXPECT_TRUE(be.can_grow(1, 2));
  EXPECT_FALSE(be.can_grow(1, 3));
  // Too long for slot 1, together with a valid item for slot 0: nothing runs.
  std::vector<SeqWork> bad = {{0, t, false}, {1, std::span<const int32_t>(t).subspan(0, 3), false}};
  EXPECT_THROW(be.step(bad, out), Error);
  EXPECT_EQ(be.slot_len(0), 0);
  EXPECT_EQ(be.slot_len(1), 8);
  std::vector<SeqWork> dup = {{0, t, false}, {0, t, false}};
  EXPECT_THROW(be.step(dup, out), Error);
  std::vector<SeqWork> range = {{2, t, false}};
  EXPECT_THROW(be.step(range, out), Error);
  const std::vector<int32_t> oov = {1, 256};
  std::vector<SeqWork> vocab = {{0, oov, false}};
  EXPECT_THROW(be.step(vocab, out), Error);
  EXPECT_EQ(be.slot_len(0), 0);
  EXPECT_THROW(be.reset_slot(-1), Error);
  o.n_slots = 0;
  EXPECT_THROW(CpuBackend(w, o), Error);
}

TEST(BackendFactory, ChoosesByDevice) {
  HostWeights w = tiny();
  BackendOptions o;
  o.n_slots = 1;
  auto be = make_backend(o, w);
  EXPECT_EQ(be->name(), "cpu");
  o.device = "tpu";
  EXPECT_THROW(make_backend(o, w), Error);
  if (!cuda_backend_built()) {
    o.device = "cuda";
    try {
      make_backend(o, w);
      FAIL() << "cuda accepted without a CUDA build";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not built"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace ds
