// Server shutdown with a host-only engine (no model, no tokenizer): a shutdown() that comes
// between bind() and serve() (a SIGTERM while `deltaserve serve` starts) still ends serve().
// httplib's stop() does nothing to a server that is not listening yet, so the drain thread's
// stop() was lost and the listener then ran forever (the process exited only on SIGKILL).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <thread>

#include "runtime/engine.h"
#include "runtime_test_backend.h"
#include "server/server.h"

namespace ds {
namespace {

class EchoBackend : public test::HistoryBackend {
 public:
  EchoBackend() : HistoryBackend("echo", 1, 16, 64, 32) {}

 protected:
  int32_t next_token(const std::vector<int32_t>& h) const override { return h.back() % 32; }
};

// serve() on its own thread; fails (and ends the process: nothing can stop that listener any
// more) when it has not returned 20 s after shutdown().
void expect_serve_returns(Server& server, bool shutdown_first) {
  if (shutdown_first) {
    server.shutdown();
    // The order that hung: the drain (nothing to wait for) ends before the listener starts.
    // Fixed, serve() returns in either order; the pause only makes this the order tested.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  auto served = std::async(std::launch::async, [&] { server.serve(); });
  if (!shutdown_first) server.shutdown();  // as the listener starts (either order may win)
  if (served.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    ADD_FAILURE() << "serve() still listens 20 s after shutdown()";
    std::fflush(stdout);
    std::_Exit(1);
  }
}

std::unique_ptr<Server> bound_server(Engine& engine) {
  ServerOptions so;
  so.port = 0;  // any free port
  so.http_threads = 2;
  auto server = std::make_unique<Server>(engine, nullptr, so);
  EXPECT_GT(server->bind(), 0);
  return server;
}

TEST(ServerShutdown, ShutdownBeforeServeStillEndsServe) {
  Engine engine(std::make_unique<EchoBackend>(), nullptr, EngineOptions{});
  auto server = bound_server(engine);
  expect_serve_returns(*server, true);
}

TEST(ServerShutdown, ShutdownAsServeStartsEndsServe) {
  for (int i = 0; i < 20; ++i) {
    Engine engine(std::make_unique<EchoBackend>(), nullptr, EngineOptions{});
    auto server = bound_server(engine);
    expect_serve_returns(*server, false);
  }
}

}  // namespace
}  // namespace ds
