// A probe of the bulk-copy ring that the decode GEMVs stream weights through (gemv_bulk.cu,
// gemv_narrow.cu, gemv_bulk_mma.cu): how much of the HBM read bandwidth one block per SM reaches
// with a ring of `slots` stages, each stage `copies` 1-D bulk copies (cp.async.bulk, L2
// evict-first) of `copy_bytes`, either contiguous or one per matrix row (a tile of rows x chunk,
// as the tensor-core ring copies it). The consumers do no arithmetic: 8 warps take the stages
// round robin, read one 16-byte word per 512 bytes of the stage and release the slot, so the
// number is what the copy pattern itself allows. Printed by `bench ceilings` (and `bench all`)
// when $DS_BENCH_BULK_PROBE=1; session 7 left it for the question "is the tensor-core ring limited
// by its many small copies" (docs/perf/2026-12-02-session7-AB.md).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ds::bench::gpu {

struct BulkRingShape {
  uint32_t copy_bytes = 16384;  // bytes per bulk copy: a multiple of 16
  int copies = 1;               // copies per stage
  uint32_t row_bytes = 0;       // 0: a stage's copies are contiguous; else the copies are rows of
                                // a matrix with this row length (a multiple of copy_bytes), and
                                // a block walks its rows in groups of `copies`, chunk by chunk
  int slots = 8;                // ring stages: a multiple of the 8 consumer warps, at most 32
  std::string name() const;     // "16x1K rows of 10K, 8 slots (128 KiB in flight)"
};

// Whether the shape is valid and fits one block's shared memory (<= 227 KiB).
bool bulk_ring_shape_ok(const BulkRingShape& r);

// Bytes one launch reads: every SM's block streams `block_bytes` (rounded down to whole stages, or
// to whole row groups for the row pattern) from src + offset. Asynchronous.
size_t bulk_ring_launch_bytes(const BulkRingShape& r, size_t block_bytes, int n_sms);
void launch_bulk_ring(const BulkRingShape& r, const void* src, size_t block_bytes, int n_sms,
                      float* sink, cudaStream_t s);

// The shapes the probe prints: copy size at a fixed 128 KiB in flight (contiguous and as rows of
// 16 KiB), the in-flight depth at 16 KiB copies, and the three decode GEMV patterns.
std::vector<BulkRingShape> bulk_ring_probe_shapes();

}  // namespace ds::bench::gpu
