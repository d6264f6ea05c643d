// Launch helpers for the GPU tests: run_once_on runs a launch body once, eagerly or captured in a
// CUDA graph; median_event_ms times single launches with CUDA events;
// graph_time_us captures `reps` calls of a launch body in one CUDA graph and
// returns the median time per call over several replays (warm, launch gaps removed as in the
// engine's captured decode step). The body gets the call index (to rotate inputs past L2) and
// the stream to launch on.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/cuda_common.h"

// Timing-only tests (they print numbers and assert nothing): skipped unless DS_PERF=1
// (scripts/gpu_test.sh --perf), so that the correctness run spends its device time on tests.
// Performance claims come from `deltaserve bench`, not from these.
#define DS_REQUIRE_PERF()                                                               \
  if (const char* ds_perf_ = std::getenv("DS_PERF"); !ds_perf_ || std::string(ds_perf_) != "1") \
  GTEST_SKIP() << "timing only: set DS_PERF=1 to run"

namespace ds::test {

// Median time in ms of `runs` calls of launch() (work enqueued on stream st), each timed on its own
// by a pair of CUDA events on st.
template <typename Launch>
float median_event_ms(cudaStream_t st, int runs, Launch&& launch) {
  cudaEvent_t e0, e1;
  DS_CUDA_CHECK(cudaEventCreate(&e0));
  DS_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int r = 0; r < runs; ++r) {
    DS_CUDA_CHECK(cudaEventRecord(e0, st));
    launch();
    DS_CUDA_CHECK(cudaEventRecord(e1, st));
    DS_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    DS_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    ts.push_back(ms);
  }
  DS_CUDA_CHECK(cudaEventDestroy(e0));
  DS_CUDA_CHECK(cudaEventDestroy(e1));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// Runs body() (launches on stream st) once: eagerly, or captured into a CUDA graph that is
// launched once (graph = true); returns after st has finished.
template <typename Body>
void run_once_on(cudaStream_t st, bool graph, Body&& body) {
  if (!graph) {
    body();
    DS_CUDA_CHECK(cudaStreamSynchronize(st));
    return;
  }
  cudaGraph_t g;
  cudaGraphExec_t exec;
  DS_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  body();
  DS_CUDA_CHECK(cudaStreamEndCapture(st, &g));
  DS_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  DS_CUDA_CHECK(cudaGraphLaunch(exec, st));
  DS_CUDA_CHECK(cudaStreamSynchronize(st));
  DS_CUDA_CHECK(cudaGraphExecDestroy(exec));
  DS_CUDA_CHECK(cudaGraphDestroy(g));
}

template <typename Body>
double graph_time_us(Body&& body, int reps = 20, int replays = 7) {
  cudaStream_t st;
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (int i = 0; i < 3; ++i) body(i, st);  // warm-up (module load, one-time attributes)
  DS_CUDA_CHECK(cudaStreamSynchronize(st));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  DS_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < reps; ++i) body(i, st);
  DS_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  DS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  DS_CUDA_CHECK(cudaGraphLaunch(exec, st));
  DS_CUDA_CHECK(cudaStreamSynchronize(st));
  const float ms = median_event_ms(st, replays, [&] { DS_CUDA_CHECK(cudaGraphLaunch(exec, st)); });
  DS_CUDA_CHECK(cudaGraphExecDestroy(exec));
  DS_CUDA_CHECK(cudaGraphDestroy(graph));
  DS_CUDA_CHECK(cudaStreamDestroy(st));
  return ms * 1e3 / reps;
}

}  // namespace ds::test
