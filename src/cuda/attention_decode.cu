// Decode attention (one query token per sequence) over the paged KV cache, split-KV
// (flash-decoding): the keys of a sequence are cut into n_splits ranges of kv_chunk tokens; one
// block per (split, kv head, sequence) computes an unnormalised partial softmax for all query heads
// of the GQA group at once (each K/V byte is read once, not once per query head), and a second
// kernel merges the partials by log-sum-exp, divides, applies sigmoid(gate) and writes bf16.
// Inside a block, 4 warps take keys round-robin; a lane holds head_dim/32 consecutive dims (16-byte
// loads at head_dim 256), dot products by warp shuffles, online softmax in fp32 (exp2 domain).
// Partials: float2 (m, l) [n_seqs, n_heads, n_splits] then float o [n_seqs, n_heads, n_splits, hd].
// Shapes: head_dim in {32, 64, 128, 256}, group (n_heads / n_kv_heads) <= 8; other shapes go to the
// prefill kernel through the dispatch registry (attention_decode_supported). Splits past a
// sequence's length write an empty partial, so the grid may be sized for the longest sequence.
// Tests: tests/cuda/cuda_attention_test.cpp (vs the fp32 CPU reference and vs the prefill kernel).
#include "cuda/cuda_common.h"
#include "cuda/kernels.h"

namespace ds::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxGroup = 8;

template <int HD>
__global__ void __launch_bounds__(kWarps * 32)
    attention_decode_split_kernel(AttnShape s, AttnBatch b,
                                  const bf16* __restrict__ q,        // [n_rows, n_heads, HD]
                                  const bf16* __restrict__ k_cache,  // [blocks, n_kv, page, HD]
                                  const bf16* __restrict__ v_cache, int kv_chunk, int n_splits,
                                  float2* __restrict__ part_ml,  // [n_seqs, n_heads, n_splits]
                                  float* __restrict__ part_o) {  // [n_seqs, n_heads, n_splits, HD]
  // dims per lane
  constexpr int kEpl = HD / 32;
  __shared__ float sm_m[kWarps][kMaxGroup], sm_l[kWarps][kMaxGroup];
  __shared__ float sm_o[kWarps][kMaxGroup][HD];
  const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = s.n_heads / s.n_kv_heads;
  const int kv_len = b.kv_len[seq];
  const int k_begin = split * kv_chunk, k_end = min(kv_len, k_begin + kv_chunk);
  const int32_t* btab = b.block_table + (int64_t)seq * b.block_table_stride;
  const int64_t qrow = b.q_start[seq];
  const float scale_log2 = rsqrtf((float)HD) * 1.4426950408889634f;

  float qv[kMaxGroup][kEpl], acc[kMaxGroup][kEpl], m[kMaxGroup], l[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kEpl; ++e) {
      acc[g][e] = 0.f;
      qv[g][e] =
          g < group
              ? __bfloat162float(q[(qrow * s.n_heads + kvh * group + g) * HD + lane * kEpl + e]) *
                    scale_log2
              : 0.f;
    }
  }

  for (int key = k_begin + warp; key < k_end; key += kWarps) {
    const int64_t blk = btab[key / s.page_size];
    const int64_t off =
        ((blk * s.n_kv_heads + kvh) * s.page_size + key % s.page_size) * HD + lane * kEpl;
    float kf[kEpl], vf[kEpl];
    if constexpr (kEpl == 1) {
      kf[0] = __bfloat162float(k_cache[off]);
      vf[0] = __bfloat162float(v_cache[off]);
    } else {
#pragma unroll
      for (int e = 0; e < kEpl; e += 2) {
        const __nv_bfloat162 k2 = *reinterpret_cast<const __nv_bfloat162*>(k_cache + off + e);
        const __nv_bfloat162 v2 = *reinterpret_cast<const __nv_bfloat162*>(v_cache + off + e);
        kf[e] = __low2float(k2);
        kf[e + 1] = __high2float(k2);
        vf[e] = __low2float(v2);
        vf[e + 1] = __high2float(v2);
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= group) break;
      float d = 0.f;
#pragma unroll
      for (int e = 0; e < kEpl; ++e) d += qv[g][e] * kf[e];
      d = warp_sum(d);
      const float m_new = fmaxf(m[g], d);
      const float corr = exp2f(m[g] - m_new);  // m[g] = -inf -> 0
      const float p = exp2f(d - m_new);
      l[g] = l[g] * corr + p;
#pragma unroll
      for (int e = 0; e < kEpl; ++e) acc[g][e] = acc[g][e] * corr + p * vf[e];
      m[g] = m_new;
    }
  }

  // Merge the warps of the block.
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= group) break;
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < kEpl; ++e) sm_o[warp][g][lane * kEpl + e] = acc[g][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * HD; i += kWarps * 32) {
    const int g = i / HD, d = i % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float lsum = 0.f, o = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2f(sm_m[w][g] - mx);
        lsum += sm_l[w][g] * f;
        o += sm_o[w][g][d] * f;
      }
    }
    const int64_t idx = ((int64_t)seq * s.n_heads + kvh * group + g) * n_splits + split;
    part_o[idx * HD + d] = o;
    if (d == 0) part_ml[idx] = make_float2(mx, lsum);
  }
}

// One block per (query head, sequence), one thread per dim.
template <int HD>
__global__ void __launch_bounds__(HD)
    attention_decode_merge_kernel(AttnShape s, AttnBatch b, int n_splits,
                                  const float2* __restrict__ part_ml,
                                  const float* __restrict__ part_o, AttnGate gate,
                                  bf16* __restrict__ out) {  // [n_rows, n_heads, HD]
  const int h = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const int64_t base = ((int64_t)seq * s.n_heads + h) * n_splits;
  float mx = -INFINITY;
  for (int i = 0; i < n_splits; ++i) mx = fmaxf(mx, part_ml[base + i].x);
  float lsum = 0.f, o = 0.f;
  if (mx != -INFINITY) {
    for (int i = 0; i < n_splits; ++i) {
      const float2 ml = part_ml[base + i];
      if (ml.x == -INFINITY) continue;
      const float f = exp2f(ml.x - mx);
      lsum += ml.y * f;
      o += part_o[(base + i) * HD + d] * f;
    }
  }
  const int64_t row = b.q_start[seq];
  float y = lsum > 0.f ? o / lsum : 0.f;
  if (gate.ptr)
    y *= sigmoid(
        __bfloat162float(gate.ptr[row * gate.token_stride + (int64_t)h * gate.head_stride + d]));
  out[(row * s.n_heads + h) * HD + d] = __float2bfloat16_rn(y);
}

template <int HD>
void launch_decode_hd(const AttnShape& s, const AttnBatch& b, const bf16* q, const bf16* k_cache,
                      const bf16* v_cache, AttnGate gate, int kv_chunk, int n_splits,
                      void* partials, bf16* out, cudaStream_t stream) {
  float2* ml = static_cast<float2*>(partials);
  float* o = reinterpret_cast<float*>(ml + (size_t)b.n_seqs * s.n_heads * n_splits);
  dim3 grid(n_splits, s.n_kv_heads, b.n_seqs);
  attention_decode_split_kernel<HD>
      <<<grid, kWarps * 32, 0, stream>>>(s, b, q, k_cache, v_cache, kv_chunk, n_splits, ml, o);
  DS_CUDA_LAUNCH_CHECK();
  attention_decode_merge_kernel<HD>
      <<<dim3(s.n_heads, b.n_seqs), HD, 0, stream>>>(s, b, n_splits, ml, o, gate, out);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace

size_t attention_decode_workspace_bytes(const AttnShape& s, int n_seqs, int n_splits) {
  return (size_t)n_seqs * s.n_heads * n_splits * (sizeof(float2) + sizeof(float) * s.head_dim);
}

int attention_decode_kv_chunk(int n_seqs, int n_kv_heads, int max_kv_len, int n_sms,
                              int max_splits) {
  const int per_split_blocks = n_seqs * n_kv_heads > 0 ? n_seqs * n_kv_heads : 1;
  int splits = (2 * n_sms + per_split_blocks - 1) / per_split_blocks;
  const int by_len = (max_kv_len + 63) / 64;
  if (splits > by_len) splits = by_len;
  if (splits > max_splits) splits = max_splits;
  if (splits < 1) splits = 1;
  int chunk = (max_kv_len + splits - 1) / splits;
  chunk = ((chunk + 63) / 64) * 64;
  if (chunk < 64) chunk = 64;
  // The chunk must keep n_splits <= max_splits.
  while ((max_kv_len + chunk - 1) / chunk > max_splits) chunk += 64;
  return chunk;
}

bool attention_decode_supported(const AttnShape& s) {
  const int hd = s.head_dim;
  return (hd == 32 || hd == 64 || hd == 128 || hd == 256) && s.n_kv_heads > 0 &&
         s.n_heads % s.n_kv_heads == 0 && s.n_heads / s.n_kv_heads <= kMaxGroup;
}

void launch_attention_decode(const AttnShape& s, const AttnBatch& b, const bf16* q,
                             const bf16* k_cache, const bf16* v_cache, AttnGate gate, int kv_chunk,
                             int n_splits, void* partials, bf16* out, cudaStream_t stream) {
  if (b.n_seqs <= 0) return;
  check_attn_shape(s);
  DS_CHECK(attention_decode_supported(s), "attention decode: head_dim ", s.head_dim, " / group ",
           s.n_heads / s.n_kv_heads, " not supported by the split-KV kernel");
  DS_CHECK(n_splits >= 1 && kv_chunk >= 1 && (int64_t)n_splits * kv_chunk >= b.max_kv_len,
           "attention decode: ", n_splits, " splits of ", kv_chunk, " tokens cannot cover ",
           b.max_kv_len, " tokens");
  switch (s.head_dim) {
    case 32:
      return launch_decode_hd<32>(s, b, q, k_cache, v_cache, gate, kv_chunk, n_splits, partials,
                                  out, stream);
    case 64:
      return launch_decode_hd<64>(s, b, q, k_cache, v_cache, gate, kv_chunk, n_splits, partials,
                                  out, stream);
    case 128:
      return launch_decode_hd<128>(s, b, q, k_cache, v_cache, gate, kv_chunk, n_splits, partials,
                                   out, stream);
    case 256:
      return launch_decode_hd<256>(s, b, q, k_cache, v_cache, gate, kv_chunk, n_splits, partials,
                                   out, stream);
  }
}

}  // namespace ds::cuda
