// `bench ceilings`: what this GPU can do, measured in the same run as every claim (PERF.md):
//  - streaming read: a 2 GiB bf16 buffer summed with 16-byte streaming loads (bytes read / time);
//  - copy: cudaMemcpyAsync device-to-device of 1 GiB as plain calls between CUDA events (bytes
//    read + written / time): 4.22 TB/s on the H200. Inside a CUDA graph the same copy measured
//    2.76 TB/s (a memcpy node goes to the copy engines) and a 16-byte load/store kernel
//    (ceiling_copy.h) 3.81 TB/s; both are printed beside it;
//  - GEMM: cuBLASLt (the engine's GemmEngine) bf16 8192 x 8192 x 8192, fp32 accumulate, bf16 out,
//    random inputs, three input/output sets rotated so no launch finds its operands in L2.
// Each: warm-up, then the median over CUDA-event-timed replays.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/cuda/bulk_ring_probe.h"
#include "bench/cuda/ceiling_copy.h"
#include "bench/cuda/device_util.h"
#include "core/error.h"
#include "cuda/gemm.h"

namespace ds::bench {

std::string cuda_device_status() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no CUDA device: ") + cudaGetErrorString(e);
  }
  if (n == 0) return "no CUDA device: cudaGetDeviceCount found none";
  return "";
}

namespace {

// $DS_BENCH_BULK_PROBE=1: the bulk-copy ring patterns of the decode GEMVs against the read
// ceiling just measured (bulk_ring_probe.h), one block per SM streaming 1.25 MiB (a 27B decode
// GEMV's share per SM), launches rotated through the 2 GiB buffer.
void bulk_ring_probe(const gpu::DevBuf& buf, int n_sms, const Ceilings& c, cudaStream_t s) {
  constexpr size_t kBlockBytes = size_t(1280) << 10;
  gpu::DevBuf sink(size_t(n_sms) * sizeof(float), "bulk ring probe sink");
  gpu::TimerOptions to;
  std::printf("bulk ring probe: one block per SM (%d), %.2f MiB each, consumers without "
              "arithmetic; read ceiling %.2f TB/s\n",
              n_sms, kBlockBytes / 1048576.0, c.read_bps / 1e12);
  for (const gpu::BulkRingShape& r : gpu::bulk_ring_probe_shapes()) {
    const size_t per_launch = gpu::bulk_ring_launch_bytes(r, kBlockBytes, n_sms);
    const size_t sets = std::max<size_t>(1, buf.bytes() / per_launch);
    auto launch = [&](int i) {
      const auto* src = buf.as<const unsigned char>() + size_t(i % int(sets)) * per_launch;
      gpu::launch_bulk_ring(r, src, kBlockBytes, n_sms, sink.as<float>(), s);
    };
    launch(0);  // the shared-memory opt-in and module load, outside any capture
    gpu::check(cudaStreamSynchronize(s), "bulk ring probe");
    const Summary t = gpu::time_launches(launch, s, to);
    const double bps = double(per_launch) / t.p50;
    std::printf("  %-52s %7.2f us  %5.2f TB/s  %5.1f%% of read\n", r.name().c_str(),
                t.p50 * 1e6, bps / 1e12, 100.0 * bps / c.read_bps);
  }
}

}  // namespace

Ceilings measure_ceilings(int device, int repeats) {
  const std::string why = cuda_device_status();
  DS_CHECK(why.empty(), "bench ceilings: ", why);
  gpu::check(cudaSetDevice(device), "cudaSetDevice");
  cudaDeviceProp prop{};
  gpu::check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  Ceilings c;
  char buf[512];
  std::snprintf(buf, sizeof buf, "%.256s (sm_%d%d, %d SMs, %.0f MiB L2, %.0f GiB)", prop.name,
                prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize / 1048576.0,
                prop.totalGlobalMem / 1073741824.0);
  c.device = buf;
  c.l2_bytes = prop.l2CacheSize;
  cudaStream_t s = nullptr;
  gpu::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } sg{s};
  gpu::TimerOptions to;
  to.samples = repeats;
  to.min_sample_s = 0;  // each launch is long already

  {  // streaming read
    const size_t bytes = size_t(2) << 30;
    gpu::DevBuf a(bytes, "read ceiling");
    gpu::DevBuf partial(gpu::read_kernel_blocks() * sizeof(float), "read partials");
    gpu::fill_normal_bf16(a.as<__nv_bfloat16>(), int64_t(bytes / 2), 11, 0.f, 1.f, s);
    c.read_s = gpu::time_launches(
        [&](int) { gpu::launch_stream_read(a.as<void>(), bytes, partial.as<float>(), s); }, s, to);
    c.read_bytes = double(bytes);
    c.read_bps = c.read_bytes / c.read_s.p50;
    const char* probe = std::getenv("DS_BENCH_BULK_PROBE");
    if (probe && std::string(probe) == "1") bulk_ring_probe(a, prop.multiProcessorCount, c, s);
  }
  {  // device-to-device copy
    const size_t bytes = size_t(1) << 30;
    gpu::DevBuf a(bytes, "copy source"), b(bytes, "copy destination");
    gpu::fill_normal_bf16(a.as<__nv_bfloat16>(), int64_t(bytes / 2), 12, 0.f, 1.f, s);
    auto memcpy_d2d = [&](int) {
      gpu::check(cudaMemcpyAsync(b.as<void>(), a.as<void>(), bytes, cudaMemcpyDeviceToDevice, s),
                 "cudaMemcpyAsync D2D");
    };
    // The ceiling: cudaMemcpyAsync D2D as plain calls between events (each lasts ~0.5 ms, so no
    // graph is needed). Captured into a CUDA graph the same copy becomes a memcpy node run by the
    // copy engines: 2.76 TB/s against 4.22 on the H200 (2026-11-29), hence not time_launches.
    cudaEvent_t e0, e1;
    gpu::check(cudaEventCreate(&e0), "cudaEventCreate");
    gpu::check(cudaEventCreate(&e1), "cudaEventCreate");
    auto time_plain = [&](const std::function<void(int)>& launch) {
      launch(0);  // warm-up
      std::vector<double> t;
      for (int i = 0; i < repeats; ++i) {
        gpu::check(cudaEventRecord(e0, s), "cudaEventRecord");
        launch(i);
        gpu::check(cudaEventRecord(e1, s), "cudaEventRecord");
        gpu::check(cudaEventSynchronize(e1), "cudaEventSynchronize");
        float ms = 0;
        gpu::check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
        t.push_back(ms * 1e-3);
      }
      return summarize(t);
    };
    c.copy_s = time_plain(memcpy_d2d);
    c.copy_bytes = 2.0 * double(bytes);
    c.copy_bps = c.copy_bytes / c.copy_s.p50;
    // For the record: the same copy in a graph, and our 16-byte load/store kernel in a graph.
    const Summary in_graph = gpu::time_launches(memcpy_d2d, s, to);
    const Summary kernel = gpu::time_launches(
        [&](int) { gpu::launch_copy_16b(b.as<void>(), a.as<void>(), bytes, s); }, s, to);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::printf(
        "ceilings: D2D copy of 1 GiB: cudaMemcpyAsync %.2f TB/s as plain calls (the ceiling used), "
        "%.2f TB/s in a CUDA graph; 16-byte load/store kernel %.2f TB/s\n",
        c.copy_bps / 1e12, c.copy_bytes / in_graph.p50 / 1e12, c.copy_bytes / kernel.p50 / 1e12);
  }
  {  // GEMM 8192^3, bf16, rotated sets
    const int n = 8192, sets = 3;
    const int64_t e = int64_t(n) * n;
    std::vector<gpu::DevBuf> x, w, y;
    for (int i = 0; i < sets; ++i) {
      x.emplace_back(size_t(e) * 2, "gemm x");
      w.emplace_back(size_t(e) * 2, "gemm w");
      y.emplace_back(size_t(e) * 2, "gemm y");
      gpu::fill_normal_bf16(x[i].as<__nv_bfloat16>(), e, 100 + i, 0.f, 1.f, s);
      gpu::fill_normal_bf16(w[i].as<__nv_bfloat16>(), e, 200 + i, 0.f, 0.02f, s);
    }
    cuda::GemmEngine gemm;
    gpu::TimerOptions tg = to;
    tg.min_per_replay = sets;
    gemm.prepare(n, n, n, cuda::GemmOut::kBF16);
    c.gemm_s = gpu::time_launches(
        [&](int i) {
          const int k = i % sets;
          gemm.run(x[k].as<__nv_bfloat16>(), w[k].as<__nv_bfloat16>(), y[k].as<void>(), n, n, n,
                   cuda::GemmOut::kBF16, s);
        },
        s, tg);
    c.gemm_flop = 2.0 * double(n) * n * n;
    c.gemm_flops = c.gemm_flop / c.gemm_s.p50;
  }
  gpu::check(cudaStreamSynchronize(s), "ceilings");
  c.valid = true;
  return c;
}

}  // namespace ds::bench
