// The dispatch registry (host only, no GPU needed): variants are tried in order, guards pick the
// specialised ones, generic fallbacks catch the rest, specialised variants switch off by name, by
// "all" and through $DS_DISABLE_KERNELS, fallbacks cannot be switched off, unknown names are
// errors that list the known ones; and the decode-split planner covers every length.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/error.h"
#include "cuda/dispatch.h"
#include "cuda/gemv.h"
#include "cuda/kernels.h"

namespace ds::cuda {
namespace {

TEST(CudaDispatch, DefaultsPickSpecialisedThenFallback) {
  unsetenv("DS_DISABLE_KERNELS");
  DispatchRegistry r = DispatchRegistry::with_defaults(90);
  EXPECT_EQ(r.select(KernelFamily::kAttnDecode, r.key(256, 6, 1, 4096)).name, "split_kv_mma");
  EXPECT_EQ(r.select(KernelFamily::kAttnDecode, r.key(64, 6, 1, 4096)).name, "split_kv");  // hd 64
  EXPECT_EQ(r.select(KernelFamily::kAttnDecode, r.key(16, 4, 1, 100)).name,
            "prefill_kernel");  // hd 16
  EXPECT_EQ(r.select(KernelFamily::kAttnDecode, r.key(128, 12, 1, 100)).name,
            "prefill_kernel");  // group 12
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 16)).name, "fused_persist_deep");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 15)).name, "fused_stream");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 8)).name, "fused_stream");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 3)).name, "fused_stream");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 2)).name, "fused_cluster8");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 1)).name, "fused_split4");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 17)).name, "fused_stream");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 32)).name, "fused_stream");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 64, 16)).name, "fused_stream");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(64, 128, 1)).name, "fused_cluster8");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 48, 1)).name, "fused");  // d_v % 32
  const DispatchRegistry r80 = DispatchRegistry::with_defaults(80);  // no bulk copies before sm 90
  EXPECT_EQ(r80.select(KernelFamily::kGdnDecode, r80.key(128, 128, 8)).name, "fused");
  EXPECT_EQ(r.select(KernelFamily::kRopeKv, r.key(256, 64, 1)).name, "warp_per_head");
  EXPECT_EQ(r.select(KernelFamily::kRopeKv, r.key(256, 64, 128)).name, "warp_per_head");
  EXPECT_EQ(r.select(KernelFamily::kRopeKv, r.key(256, 64, 129)).name, "token_table");  // prompt
  EXPECT_EQ(r.select(KernelFamily::kRopeKv, r.key(256, 64, 4096)).name, "token_table");
  EXPECT_EQ(r.select(KernelFamily::kRopeKv, r.key(256, 40, 4096)).name, "fused");  // 40 % 16
  EXPECT_EQ(r.select(KernelFamily::kRopeKv, r.key(32, 32, 4096)).name, "fused");   // hd 32
  EXPECT_EQ(r.select(KernelFamily::kRopeKv, r.key(256, 40, 1)).name, "fused");    // 40 % 16
  EXPECT_EQ(r.select(KernelFamily::kRopeKv, r.key(32, 32, 1)).name, "fused");     // hd 32
  // the down projection: gemv_tma_narrow where $DS_GEMV_TMA_NARROW puts it (by default m 3..16)
  auto down = [](int m, const char* otherwise) {
    return cuda::gemv_tma_narrow_preferred(m, 5120, 17408) ? std::string("gemv_tma_narrow")
                                                           : std::string(otherwise);
  };
  EXPECT_EQ(r.select(KernelFamily::kGemm, r.key(1, 5120, 17408)).name, down(1, "gemv_narrow"));
  EXPECT_EQ(r.select(KernelFamily::kGemm, r.key(4, 5120, 17408)).name, down(4, "skinny_mma"));
  EXPECT_EQ(r.select(KernelFamily::kGemm, r.key(16, 5120, 17408)).name,  // or the A/B switch
            down(16, cuda::gemv_splitk_preferred(16, 5120, 17408) ? "gemv_splitk_mma"
                                                                  : "cublaslt"));
  if (cuda::gemv_tma_narrow_mode() == cuda::GemvTmaNarrowMode::kDownBatch) {
    EXPECT_EQ(r.select(KernelFamily::kGemm, r.key(16, 5120, 17408)).name, "gemv_tma_narrow");
    EXPECT_EQ(r.select(KernelFamily::kGemm, r.key(4, 5120, 17408)).name, "gemv_tma_narrow");
    EXPECT_EQ(r.select(KernelFamily::kGemm, r.key(3, 5120, 17408)).name, "gemv_tma_narrow");
    EXPECT_EQ(r.select(KernelFamily::kGemm, r.key(2, 5120, 17408)).name, "gemv_narrow");
    EXPECT_EQ(r.select(KernelFamily::kGemm, r.key(1, 5120, 17408)).name, "gemv_narrow");
  }
  EXPECT_EQ(r.select(KernelFamily::kGemm, r.key(4096, 5120, 17408)).name, "cublaslt");
  const std::string list = r.list();
  EXPECT_NE(list.find("attn_decode.split_kv"), std::string::npos);
  EXPECT_NE(list.find("[fallback]"), std::string::npos);
}

TEST(CudaDispatch, SwitchOff) {
  unsetenv("DS_DISABLE_KERNELS");
  DispatchRegistry r = DispatchRegistry::with_defaults(90, "attn_decode.split_kv_mma");
  EXPECT_EQ(r.select(KernelFamily::kAttnDecode, r.key(256, 6, 1, 4096)).name, "split_kv");
  r.disable("attn_decode.split_kv");
  EXPECT_EQ(r.select(KernelFamily::kAttnDecode, r.key(256, 6, 1, 4096)).name, "prefill_kernel");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 8)).name, "fused_stream");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(64, 128, 16)).name, "fused_stream");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 16)).name, "fused_persist_deep");
  r.disable("gdn_decode.fused_persist_deep");  // the session-5 gdnd8 A/B's "off" arm
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 16)).name, "fused_split2");
  r.disable("gdn_decode.fused_split2");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 16)).name, "fused_stream");
  r.disable("gdn_decode.fused_split4");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 1)).name, "fused_cluster8");
  r.disable("gdn_decode.fused_stream");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 8)).name, "fused");
  r.disable("all");
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 8)).name, "prefill_path");
  r.set_enabled("gdn_decode.fused", true);
  EXPECT_EQ(r.select(KernelFamily::kGdnDecode, r.key(128, 128, 8)).name, "fused");
  EXPECT_THROW(r.disable("gemm.cublaslt"), Error);  // a fallback
  try {
    r.disable("attn_decode.nope");
    FAIL() << "unknown name accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("attn_decode.split_kv"), std::string::npos) << e.what();
  }
  setenv("DS_DISABLE_KERNELS",
         "gdn_decode.fused_persist_deep,"
         "gdn_decode.fused_split4,gdn_decode.fused_split2,gdn_decode.fused_stream,"
         "gdn_decode.fused_cluster8,gdn_decode.fused, attn_decode.split_kv_mma, "
         "attn_decode.split_kv",
         1);
  DispatchRegistry env = DispatchRegistry::with_defaults(90);
  EXPECT_EQ(env.select(KernelFamily::kGdnDecode, env.key(128, 128, 8)).name, "prefill_path");
  EXPECT_EQ(env.select(KernelFamily::kGdnDecode, env.key(128, 128, 1)).name, "prefill_path");
  EXPECT_EQ(env.select(KernelFamily::kAttnDecode, env.key(256, 6, 1, 10)).name, "prefill_kernel");
  setenv("DS_DISABLE_KERNELS", "bogus.kernel", 1);
  EXPECT_THROW(DispatchRegistry::with_defaults(90), Error);
  unsetenv("DS_DISABLE_KERNELS");
  KernelVariant dup{KernelFamily::kGemm, "cublaslt", "again", {}};
  EXPECT_THROW(r.add(dup), Error);
}

TEST(CudaDispatch, DecodeSplitPlanCoversEveryLength) {
  for (int n_seqs : {1, 3, 8, 32})
    for (int len : {1, 63, 64, 65, 4095, 4097, 32768, 262144}) {
      const int chunk = attention_decode_kv_chunk(n_seqs, 4, len, 132, 64);
      const int splits = (len + chunk - 1) / chunk;
      EXPECT_EQ(chunk % 64, 0);
      EXPECT_GE(splits, 1);
      EXPECT_LE(splits, 64) << n_seqs << " seqs, " << len;
      EXPECT_GE(int64_t(splits) * chunk, len);
    }
  // Long single sequences are split to fill the GPU.
  EXPECT_GE((32768 + attention_decode_kv_chunk(1, 4, 32768, 132, 64) - 1) /
                attention_decode_kv_chunk(1, 4, 32768, 132, 64),
            32);
}

}  // namespace
}  // namespace ds::cuda
