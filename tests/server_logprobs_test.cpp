// NaN and -inf logits through the server, both ways a backend serves prompt rows (host rows, and
// rows the backend scores itself, the CUDA engine's way):
// - logprobs: the engine reads NaN as -inf (logprob -inf, the rank of the whole vocabulary) and
//   the server writes every logprob below -9999 as -9999.0, as vLLM does, since JSON has no -inf
//   (nlohmann would write null);
// - a NaN in the row that samples fails that request, with a 500 when it is not streamed.
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "runtime/engine.h"
#include "runtime_test_backend.h"
#include "server/server.h"

namespace ds {
namespace {

using json = nlohmann::json;
constexpr int kVocab = 32;

int32_t pred(int32_t t) { return (t * 7 + 3) % kVocab; }

// After token t: pred(t) has logit 5, pred(t) + 1 has 1, the rest -10; in the rows of a
// sequence that starts with token 1, at positions before nan_until, pred(t) + 2 is NaN and
// pred(t) + 3 is -inf.
class NanBackend : public test::HistoryBackend {
 public:
  NanBackend(bool score_rows, int nan_until)
      : HistoryBackend("nan", 2, 16, 64, kVocab, score_rows), nan_until_(nan_until) {}
  void step(std::span<const SeqWork> work, std::vector<float>& logits) override {
    HistoryBackend::step(work, logits);
    float* row = logits.data();
    for (const SeqWork& w : work) {
      const std::vector<int32_t>& h = history(w.slot);
      const int n_rows = w.all_logits ? static_cast<int>(w.tokens.size()) : 1;
      for (int j = 0; j < n_rows; ++j, row += kVocab) {
        const int pos = static_cast<int>(h.size()) - n_rows + j;
        if (h[0] != 1 || pos >= nan_until_) continue;
        const int32_t best = pred(h[static_cast<size_t>(pos)]);
        row[(best + 2) % kVocab] = std::numeric_limits<float>::quiet_NaN();
        row[(best + 3) % kVocab] = -INFINITY;
      }
    }
  }

 protected:
  int32_t next_token(const std::vector<int32_t>& h) const override { return pred(h.back()); }

 private:
  int nan_until_;
};

// A server on any free port over `backend`, serving on its own thread until destroyed.
struct TestServer {
  explicit TestServer(std::unique_ptr<Backend> backend)
      : engine(std::move(backend), nullptr, EngineOptions{}), server(engine, nullptr, options()) {
    port = server.bind();
    served = std::async(std::launch::async, [this] { server.serve(); });
  }
  ~TestServer() {
    server.shutdown();
    served.wait();
  }
  static ServerOptions options() {
    ServerOptions so;
    so.port = 0;
    so.http_threads = 2;
    return so;
  }
  httplib::Result post(const json& body) {
    httplib::Client cli("127.0.0.1", port);
    return cli.Post("/v1/completions", body.dump(), "application/json");
  }
  Engine engine;
  Server server;
  int port = 0;
  std::future<void> served;
};

class ServerLogprobs : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(, ServerLogprobs, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Scored" : "HostRows"; });

TEST_P(ServerLogprobs, NanAndMinusInfinityAreWrittenAsMinus9999) {
  // NaN and -inf in the prompt's rows only (positions 0-2; the row at 3 samples).
  TestServer ts(std::make_unique<NanBackend>(GetParam(), 3));
  // Prompt: 1, then the NaN id after it, then the -inf id after that, then the best one.
  const int32_t p1 = (pred(1) + 2) % kVocab, p2 = (pred(p1) + 3) % kVocab, p3 = pred(p2);
  auto res = ts.post({{"prompt", {1, p1, p2, p3}},
                      {"max_tokens", 2},
                      {"temperature", 0},
                      {"echo", true},
                      {"logprobs", 3},
                      {"prompt_logprobs", 2}});
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json r = json::parse(res->body);
  const json& choice = r["choices"][0];

  const double lse = std::log(std::exp(5.0) + std::exp(1.0) + (kVocab - 4) * std::exp(-10.0));
  // OpenAI's echo: the first prompt token null, then the prompt's, then the output's.
  const json& tl = choice["logprobs"]["token_logprobs"];
  ASSERT_EQ(tl.size(), 6u) << tl.dump();
  EXPECT_TRUE(tl[0].is_null());
  EXPECT_EQ(tl[1].get<double>(), -9999.0);  // NaN
  EXPECT_EQ(tl[2].get<double>(), -9999.0);  // -inf
  EXPECT_NEAR(tl[3].get<double>(), 5.0 - lse, 1e-5);
  for (size_t i = 1; i < tl.size(); ++i) EXPECT_TRUE(tl[i].is_number()) << i;

  // vLLM's prompt_logprobs: the token's logprob and rank (NaN and -inf: the whole vocabulary),
  // and the top 2, which are finite.
  const json& pl = choice["prompt_logprobs"];
  ASSERT_EQ(pl.size(), 4u) << pl.dump();
  EXPECT_TRUE(pl[0].is_null());
  for (int j : {1, 2}) {
    const json& e = pl[j][std::to_string(j == 1 ? p1 : p2)];
    EXPECT_EQ(e["logprob"].get<double>(), -9999.0) << j;
    EXPECT_EQ(e["rank"].get<int>(), kVocab) << j;
    EXPECT_EQ(pl[j].size(), 3u) << pl[j].dump();  // the token and the top 2
  }
  const json& best = pl[3][std::to_string(p3)];
  EXPECT_EQ(best["rank"].get<int>(), 1);
  EXPECT_NEAR(best["logprob"].get<double>(), 5.0 - lse, 1e-5);
}

// A request whose sampled row has a NaN fails in the engine: a non-streamed answer says so with
// its status (500 and an error body; it was sent as 200 before its generation ended), a
// streamed one with an error event; other requests go on.
TEST_P(ServerLogprobs, FailedGenerationIs500AndOthersGoOn) {
  TestServer ts(std::make_unique<NanBackend>(GetParam(), 1000));
  auto bad = ts.post({{"prompt", {1, 2, 3}}, {"max_tokens", 4}, {"temperature", 0}});
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 500) << bad->body;
  const json e = json::parse(bad->body);
  EXPECT_EQ(e["error"]["type"], "server_error");
  EXPECT_NE(e["error"]["message"].get<std::string>().find("NaN"), std::string::npos);

  auto streamed = ts.post({{"prompt", {1, 2, 3}}, {"max_tokens", 4}, {"stream", true}});
  ASSERT_TRUE(streamed);
  EXPECT_EQ(streamed->status, 200);  // (sent before the generation runs)
  EXPECT_NE(streamed->body.find("\"error\""), std::string::npos) << streamed->body;
  EXPECT_NE(streamed->body.find("data: [DONE]"), std::string::npos);

  auto good = ts.post({{"prompt", {2, 3}}, {"max_tokens", 4}, {"temperature", 0}});
  ASSERT_TRUE(good);
  ASSERT_EQ(good->status, 200) << good->body;
  const json r = json::parse(good->body);
  EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r["usage"]["completion_tokens"], 4);
}

}  // namespace
}  // namespace ds
