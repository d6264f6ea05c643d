// Host side of the Hopper tensor memory accelerator (TMA): tensor maps for the sm_90 kernels that
// move tiles with cp.async.bulk.tensor (attention_prefill_mma.cu, gdn_prefill_slice.cu). The
// encoder is the driver's cuTensorMapEncodeTiled, reached through the runtime's driver entry
// point (no link against libcuda).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>

namespace ds::cuda {

// The driver's cuTensorMapEncodeTiled (looked up once per process); throws ds::Error when the
// driver has none.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder();

// A tiled tensor map of `rank` (1..5) dims over `base`: dims innermost first (elements),
// byte_strides of dims 1..rank-1, the box (elements per dim; box[0] * element size a multiple of
// 16 bytes), element strides 1, no interleave, `swizzle`, L2 promotion 256 B, out-of-bound
// elements read as zeros and dropped on stores. Throws ds::Error naming `what` when the encoder
// rejects the map (alignment, strides, box) or the driver has no encoder.
CUtensorMap make_tensor_map(CUtensorMapDataType type, int rank, const void* base,
                            const uint64_t* dims, const uint64_t* byte_strides,
                            const uint32_t* box, CUtensorMapSwizzle swizzle, const char* what);

}  // namespace ds::cuda
