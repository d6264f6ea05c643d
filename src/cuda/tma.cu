#include "cuda/tma.h"

#include "cuda/cuda_common.h"

namespace ds::cuda {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult qr{};
    DS_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                   cudaEnableDefault, &qr));
    DS_CHECK(qr == cudaDriverEntryPointSuccess && p != nullptr,
             "TMA: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

CUtensorMap make_tensor_map(CUtensorMapDataType type, int rank, const void* base,
                            const uint64_t* dims, const uint64_t* byte_strides,
                            const uint32_t* box, CUtensorMapSwizzle swizzle, const char* what) {
  DS_CHECK(rank >= 1 && rank <= 5, "TMA: rank ", rank, " for ", what);
  cuuint64_t d[5], st[4];
  cuuint32_t bx[5], es[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    bx[i] = box[i];
    es[i] = 1;
    if (i + 1 < rank) st[i] = byte_strides[i];
  }
  CUtensorMap map;
  const CUresult r = tensor_map_encoder()(
      &map, type, cuuint32_t(rank), const_cast<void*>(base), d, st, bx, es,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DS_CHECK(r == CUDA_SUCCESS, "TMA: cuTensorMapEncodeTiled failed for ", what, " (CUresult ",
           int(r), ")");
  return map;
}

}  // namespace ds::cuda
