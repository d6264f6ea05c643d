// Prompt attention over the paged KV cache (SPEC.md "Gated full attention", steps 5-6): causal
// softmax(q k^T / sqrt(head_dim)) v for query chunks whose earlier tokens are already in the cache,
// bottom-right aligned (query j of a q_len chunk sits at position kv_len - q_len + j), GQA, times
// sigmoid(gate) in the epilogue. Many sequences of different lengths per launch (AttnBatch).
//
// Layout of the work: one block per (row tile, kv head, sequence). The rows of a tile are
// (query token, query head of the GQA group) pairs, row = token * group + head, so each K/V tile
// loaded into shared memory serves every query head that reads it (6 for Qwen3.5-27B). 4 warps x
// 16 rows = 64 rows, 64 keys per step. S = Q K^T and O += P V on tensor cores (WMMA bf16 16x16x16,
// fp32 accumulate); online softmax in fp32 (exp2 domain) by 2 lanes per row; the running output
// O lives in shared memory in fp32 and is rescaled there. Keys past the last query of the tile
// are never loaded; masked scores are -inf; K/V rows past the sequence are zero-filled.
// Shapes: head_dim in {16, 32, 64, 128, 256}, any group size, any lengths. Shared memory at
// head_dim 256: 191 KiB (one block per SM). This is the generic, correct-first kernel; the
// head_dim 256 specialisation (attention_prefill_mma.cu) is picked here through the registry.
// Tests: tests/cuda/cuda_attention_test.cpp (vs an fp32 CPU reference, rel. error < 1e-2).
#include <mma.h>

#include <string_view>
#include <utility>

#include "cuda/attention_prefill_mma.h"
#include "cuda/cuda_common.h"
#include "cuda/dispatch.h"
#include "cuda/kernels.h"

namespace ds::cuda {
namespace {

using namespace nvcuda;

constexpr int kBM = 64;  // rows per tile (4 warps x 16)
constexpr int kBN = 64;  // keys per step
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kLdS = kBN + 4;  // fp32 score row stride (pad keeps WMMA 32-byte alignment)
constexpr int kLdP = kBN + 8;  // bf16 probability row stride

template <int HD>
struct PrefillSmem {
  static constexpr int kLdQ = HD + 8;  // bf16 row stride of Q, K, V tiles
  static constexpr int kLdO = HD + 4;  // fp32 row stride of O
  static constexpr size_t q_off = 0;
  static constexpr size_t k_off = q_off + sizeof(bf16) * kBM * kLdQ;
  static constexpr size_t v_off = k_off + sizeof(bf16) * kBN * kLdQ;
  static constexpr size_t s_off = v_off + sizeof(bf16) * kBN * kLdQ;
  static constexpr size_t p_off = s_off + sizeof(float) * kBM * kLdS;
  static constexpr size_t o_off = p_off + sizeof(bf16) * kBM * kLdP;
  static constexpr size_t m_off = o_off + sizeof(float) * kBM * kLdO;
  static constexpr size_t l_off = m_off + sizeof(float) * kBM;
  static constexpr size_t a_off = l_off + sizeof(float) * kBM;
  static constexpr size_t pos_off = a_off + sizeof(float) * kBM;
  static constexpr size_t bytes = pos_off + sizeof(int) * kBM;
};

template <int HD>
__global__ void __launch_bounds__(kThreads)
    attention_prefill_kernel(AttnShape s, AttnBatch b,
                             const bf16* __restrict__ q,        // [n_rows, n_heads, HD]
                             const bf16* __restrict__ k_cache,  // [blocks, n_kv, page, HD]
                             const bf16* __restrict__ v_cache,  // [blocks, n_kv, page, HD]
                             AttnGate gate,
                             bf16* __restrict__ out) {  // [n_rows, n_heads, HD]
  using L = PrefillSmem<HD>;
  constexpr int kLdQ = L::kLdQ, kLdO = L::kLdO;
  constexpr int kVec = HD / 8;  // 16-byte vectors per row
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem + L::q_off);
  bf16* Ks = reinterpret_cast<bf16*>(smem + L::k_off);
  bf16* Vs = reinterpret_cast<bf16*>(smem + L::v_off);
  float* Ss = reinterpret_cast<float*>(smem + L::s_off);
  bf16* Ps = reinterpret_cast<bf16*>(smem + L::p_off);
  float* Os = reinterpret_cast<float*>(smem + L::o_off);
  float* row_m = reinterpret_cast<float*>(smem + L::m_off);
  float* row_l = reinterpret_cast<float*>(smem + L::l_off);
  float* row_a = reinterpret_cast<float*>(smem + L::a_off);
  int* row_pos = reinterpret_cast<int*>(smem + L::pos_off);

  const int seq = blockIdx.z, kvh = blockIdx.y, tile = blockIdx.x;
  const int group = s.n_heads / s.n_kv_heads;
  const int q_len = b.q_len[seq], kv_len = b.kv_len[seq], q0 = b.q_start[seq];
  const int row0 = tile * kBM;  // first packed row of the tile
  if (row0 >= q_len * group) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int32_t* btab = b.block_table + (int64_t)seq * b.block_table_stride;

  // Q tile, row metadata, O = 0.
  for (int i = threadIdx.x; i < kBM * kVec; i += kThreads) {
    const int r = i / kVec, c = i % kVec, pr = row0 + r, tok = pr / group;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (tok < q_len) {
      const int h = kvh * group + pr % group;
      v = reinterpret_cast<const uint4*>(q + ((int64_t)(q0 + tok) * s.n_heads + h) * HD)[c];
    }
    *reinterpret_cast<uint4*>(Qs + r * kLdQ + c * 8) = v;
  }
  for (int i = threadIdx.x; i < kBM * HD; i += kThreads) Os[(i / HD) * kLdO + i % HD] = 0.f;
  for (int r = threadIdx.x; r < kBM; r += kThreads) {
    const int tok = (row0 + r) / group;
    row_pos[r] = tok < q_len ? kv_len - q_len + tok : -1;
    row_m[r] = -INFINITY;
    row_l[r] = 0.f;
  }
  const int last_tok = min(q_len - 1, (row0 + kBM - 1) / group);
  const int n_keys = kv_len - q_len + last_tok + 1;  // keys 0..pos of the tile's last query
  const float scale_log2 = rsqrtf((float)HD) * 1.4426950408889634f;
  __syncthreads();

  for (int kt = 0; kt < n_keys; kt += kBN) {
    // K and V tiles from the paged cache (zero past n_keys).
    for (int i = threadIdx.x; i < kBN * kVec; i += kThreads) {
      const int r = i / kVec, c = i % kVec, key = kt + r;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
      if (key < n_keys) {
        const int64_t blk = btab[key / s.page_size];
        const int64_t off = ((blk * s.n_kv_heads + kvh) * s.page_size + key % s.page_size) * HD;
        kv = reinterpret_cast<const uint4*>(k_cache + off)[c];
        vv = reinterpret_cast<const uint4*>(v_cache + off)[c];
      }
      *reinterpret_cast<uint4*>(Ks + r * kLdQ + c * 8) = kv;
      *reinterpret_cast<uint4*>(Vs + r * kLdQ + c * 8) = vv;
    }
    __syncthreads();

    // S[16 rows of this warp, 64 keys] = Q K^T.
    {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kBN / 16];
#pragma unroll
      for (int n = 0; n < kBN / 16; ++n) wmma::fill_fragment(acc[n], 0.f);
#pragma unroll 4
      for (int kk = 0; kk < HD / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, Qs + warp * 16 * kLdQ + kk * 16, kLdQ);
#pragma unroll
        for (int n = 0; n < kBN / 16; ++n) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, Ks + n * 16 * kLdQ + kk * 16, kLdQ);
          wmma::mma_sync(acc[n], fa, fb, acc[n]);
        }
      }
#pragma unroll
      for (int n = 0; n < kBN / 16; ++n)
        wmma::store_matrix_sync(Ss + warp * 16 * kLdS + n * 16, acc[n], kLdS, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax: 2 lanes per row, 32 keys each.
    {
      const int r = warp * 16 + (lane >> 1), c0 = (lane & 1) * 32;
      const int pos = row_pos[r];
      float sv[32];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int key = kt + c0 + j;
        sv[j] = key <= pos ? Ss[r * kLdS + c0 + j] * scale_log2 : -INFINITY;
        mx = fmaxf(mx, sv[j]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_old = row_m[r];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const float p = m_new == -INFINITY ? 0.f : exp2f(sv[j] - m_new);
        sum += p;
        Ps[r * kLdP + c0 + j] = __float2bfloat16_rn(p);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      const float alpha = m_new == -INFINITY ? 1.f : exp2f(m_old - m_new);
      const float l_new = row_l[r] * alpha + sum;
      __syncwarp();
      if ((lane & 1) == 0) {
        row_m[r] = m_new;
        row_l[r] = l_new;
        row_a[r] = alpha;
      }
    }
    __syncwarp();

    // O = O * alpha + P V for this warp's rows.
    for (int i = lane; i < 16 * HD; i += 32) {
      const int r = warp * 16 + i / HD;
      Os[r * kLdO + i % HD] *= row_a[r];
    }
    __syncwarp();
#pragma unroll 2
    for (int n = 0; n < HD / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      float* o_ptr = Os + warp * 16 * kLdO + n * 16;
      wmma::load_matrix_sync(acc, o_ptr, kLdO, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, Ps + warp * 16 * kLdP + kk * 16, kLdP);
        wmma::load_matrix_sync(fb, Vs + kk * 16 * kLdQ + n * 16, kLdQ);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(o_ptr, acc, kLdO, wmma::mem_row_major);
    }
    __syncthreads();  // K/V tiles are overwritten next
  }

  // Epilogue: O / l, times sigmoid(gate), to bf16.
  for (int i = lane; i < 16 * HD; i += 32) {
    const int r = warp * 16 + i / HD, c = i % HD;
    const int pr = row0 + r, tok = pr / group;
    if (tok >= q_len) continue;
    const int h = kvh * group + pr % group;
    const float l = row_l[r];
    float o = l > 0.f ? Os[r * kLdO + c] / l : 0.f;
    if (gate.ptr)
      o *= sigmoid(__bfloat162float(
          gate.ptr[(int64_t)(q0 + tok) * gate.token_stride + (int64_t)h * gate.head_stride + c]));
    out[((int64_t)(q0 + tok) * s.n_heads + h) * HD + c] = __float2bfloat16_rn(o);
  }
}

template <int HD>
void launch_prefill_hd(const AttnShape& s, const AttnBatch& b, const bf16* q, const bf16* k_cache,
                       const bf16* v_cache, AttnGate gate, bf16* out, cudaStream_t stream) {
  constexpr size_t smem = PrefillSmem<HD>::bytes;
  ensure_smem_optin(reinterpret_cast<const void*>(attention_prefill_kernel<HD>), smem);
  const int group = s.n_heads / s.n_kv_heads;
  const int tiles = (b.max_q_len * group + kBM - 1) / kBM;
  dim3 grid(tiles, s.n_kv_heads, b.n_seqs);
  attention_prefill_kernel<HD>
      <<<grid, kThreads, smem, stream>>>(s, b, q, k_cache, v_cache, gate, out);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace

void launch_attention_prefill(const AttnShape& s, const AttnBatch& b, const bf16* q,
                              const bf16* k_cache, const bf16* v_cache, AttnGate gate, bf16* out,
                              cudaStream_t stream, const DispatchRegistry* dispatch) {
  if (b.n_seqs <= 0 || b.max_q_len <= 0) return;
  check_attn_shape(s);
  DS_CHECK(b.n_seqs <= 65535, "attention: too many sequences in one batch (", b.n_seqs, ")");
  // Specialised variants (dispatch.cpp, family attn_prefill); the page-size requirement is not in
  // the shape key, so it is checked here and an unsupported cache falls back to the generic kernel.
  if (dispatch && attention_prefill_mma_supported(s)) {
    const KernelVariant& v = dispatch->select(
        KernelFamily::kAttnPrefill,
        dispatch->key(s.head_dim, s.n_heads / s.n_kv_heads, b.max_q_len, b.max_kv_len));
    static constexpr std::pair<std::string_view, AttnMmaKernel> kMmaVariants[] = {
        {"wgmma_ws", AttnMmaKernel::kWgmmaWs},
        {"wgmma_ws3", AttnMmaKernel::kWgmmaWs3},
        {"wgmma_ws_lean", AttnMmaKernel::kWgmmaWsLean},
        {"wgmma_ws3_lean", AttnMmaKernel::kWgmmaWs3Lean},
        {"wgmma_ws3_persist", AttnMmaKernel::kWgmmaWs3Persist},
        {"wgmma_ws3_lean_persist", AttnMmaKernel::kWgmmaWs3LeanPersist},
        {"wgmma_ws_ulean", AttnMmaKernel::kWgmmaWsULean},
        {"wgmma_ws_lazy", AttnMmaKernel::kWgmmaWsLazy},
        {"wgmma_m128", AttnMmaKernel::kWgmmaM128}};
    for (const auto& [name, kernel] : kMmaVariants) {
      if (v.name == name)
        return launch_attention_prefill_mma(kernel, s, b, q, k_cache, v_cache, gate, out, stream);
    }
  }
  switch (s.head_dim) {
    case 16:
      return launch_prefill_hd<16>(s, b, q, k_cache, v_cache, gate, out, stream);
    case 32:
      return launch_prefill_hd<32>(s, b, q, k_cache, v_cache, gate, out, stream);
    case 64:
      return launch_prefill_hd<64>(s, b, q, k_cache, v_cache, gate, out, stream);
    case 128:
      return launch_prefill_hd<128>(s, b, q, k_cache, v_cache, gate, out, stream);
    case 256:
      return launch_prefill_hd<256>(s, b, q, k_cache, v_cache, gate, out, stream);
    default:
      ds::throw_error("attention prefill: head_dim ", s.head_dim,
                      " not supported (16, 32, 64, 128, 256)");
  }
}

}  // namespace ds::cuda
