// Gated DeltaNet decode: one fused kernel per layer for one new token in each of n_seqs sequences
// (layouts in gdn.h). One block per (sequence, value head), 512 threads:
//  1. conv: the 4 taps of each needed qkv channel (3 from the slot's ring, rows (p-3..p-1) % 4,
//     zero before position 0, plus the new input), SiLU; the new input goes to ring row p % 4 (v
//     channels by their head's block, q/k channels by the first value head of the key group; no
//     block reads row p % 4, so the in-place update has no race);
//  2. q/k l2norm (q * d_k^-0.5), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias);
//  3. the state rows S[v, :] (d_k contiguous fp32) are all loaded up front (16-byte loads, DK/4
//     lanes per row, every row of the head in flight at once), then per row: decay by e^g,
//     u = S k, S += k beta (v - u), o = S q; the row is stored back; state read + written once;
//  4. gated RMSNorm over the head's d_v outputs with z, written as bf16 (the out_proj input).
// Specialised on d_k (16/32/64/128, template); d_v is any of 16..128 at run time.
// Bytes per layer: 2 * n_seqs * n_v_heads * d_v * d_k * 4 (state) + small; 27B batch 1: 6.3 MB.
// Test: tests/cuda/cuda_gdn_test.cpp (Decode* vs the fp32 CPU recurrence; timings printed).
#include "cuda/cuda_common.h"
#include "cuda/gdn.h"

namespace ds::cuda {
namespace {

constexpr int kDecodeThreads = 512;
constexpr int kMaxD = 128;

template <int DK>
__global__ void __launch_bounds__(kDecodeThreads)
    gdn_decode_kernel(GdnShape s, GdnLayerWeights w, GdnStatePool pool,
                      const bf16* __restrict__ proj,        // [n_seqs, in_dim]
                      const int32_t* __restrict__ seq_pos,  // [n_seqs]
                      const int32_t* __restrict__ slot_ids,  // [n_seqs]
                      bf16* __restrict__ out)               // [n_seqs, n_v_heads * d_v]
{
  constexpr int kLanesPerRow = DK / 4;               // each lane holds 4 consecutive k values
  constexpr int kRowsPerWarp = 32 / kLanesPerRow;    // rows a warp covers per pass
  constexpr int kGroups = (kDecodeThreads / 32) * kRowsPerWarp;  // lane groups in the block
  constexpr int kMaxRowsPerGroup = (kMaxD + kGroups - 1) / kGroups;

  __shared__ __align__(16) float qs[DK], ks[DK], vs[kMaxD], os[kMaxD];
  __shared__ float red[32];
  __shared__ float gate[2];  // beta, e^g

  const int seq = blockIdx.x, hv = blockIdx.y;
  const int ratio = s.n_v_heads / s.n_k_heads, hk = hv / ratio;
  const int d_v = s.d_v, qkv_dim = s.qkv_dim(), in_dim = s.in_dim();
  const int p = seq_pos[seq];
  const int64_t slot = slot_ids[seq];
  bf16* ring = pool.conv_state + slot * pool.conv_slot_stride;
  const bf16* x = proj + static_cast<int64_t>(seq) * in_dim;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // 1. conv + SiLU over q (DK), k (DK), v (d_v) channels of this head.
  const bool write_qk = hv % ratio == 0;
  for (int e = tid; e < 2 * DK + d_v; e += kDecodeThreads) {
    int ch;
    if (e < DK) ch = hk * DK + e;
    else if (e < 2 * DK) ch = s.n_k_heads * DK + hk * DK + (e - DK);
    else ch = 2 * s.n_k_heads * DK + hv * d_v + (e - 2 * DK);
    const bf16 xin = x[ch];
    float acc = __bfloat162float(w.conv_w[ch * 4 + 3]) * __bfloat162float(xin);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      const int pp = p - 3 + j;
      if (pp >= 0) acc += __bfloat162float(w.conv_w[ch * 4 + j]) * __bfloat162float(ring[(pp & 3) * qkv_dim + ch]);
    }
    const float y = acc / (1.f + __expf(-acc));
    if (e < DK) qs[e] = y;
    else if (e < 2 * DK) ks[e - DK] = y;
    else vs[e - 2 * DK] = y;
    if (e >= 2 * DK || write_qk) ring[(p & 3) * qkv_dim + ch] = xin;
  }
  __syncthreads();
  // 2. l2norm of q (warp 0) and k (warp 1); gates (warp 2).
  if (warp < 2) {
    float* vec = warp == 0 ? qs : ks;
    float ss = 0.f;
    for (int c = lane; c < DK; c += 32) ss += vec[c] * vec[c];
    ss = warp_sum(ss);
    const float scale = rsqrtf(ss + 1e-6f) * (warp == 0 ? rsqrtf(static_cast<float>(DK)) : 1.f);
    for (int c = lane; c < DK; c += 32) vec[c] *= scale;
  } else if (warp == 2 && lane == 0) {
    const float b = __bfloat162float(x[qkv_dim + s.z_dim() + hv]);
    const float a = __bfloat162float(x[qkv_dim + s.z_dim() + s.n_v_heads + hv]) + w.dt_bias[hv];
    const float sp = a > 20.f ? a : log1pf(expf(a));
    gate[0] = 1.f / (1.f + expf(-b));
    gate[1] = expf(-expf(w.A_log[hv]) * sp);
  }
  __syncthreads();

  // 3. State rows. Lane group `grp` owns rows grp, grp + kGroups, ...; lane sub-index k4 covers
  // k = 4*k4 .. 4*k4+3.
  const int grp = warp * kRowsPerWarp + lane / kLanesPerRow;
  const int k4 = lane % kLanesPerRow;
  float* state = pool.rec_state + slot * pool.rec_slot_stride +
                 static_cast<int64_t>(hv) * d_v * DK;
  const bool has_state = p > 0;
  float4 rows[kMaxRowsPerGroup];
#pragma unroll
  for (int r = 0; r < kMaxRowsPerGroup; ++r) {
    const int v = grp + r * kGroups;
    rows[r] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (has_state && v < d_v) rows[r] = *reinterpret_cast<const float4*>(state + v * DK + 4 * k4);
  }
  const float4 kk = *reinterpret_cast<const float4*>(ks + 4 * k4);
  const float4 qq = *reinterpret_cast<const float4*>(qs + 4 * k4);
  const float beta = gate[0], decay = gate[1];
#pragma unroll
  for (int r = 0; r < kMaxRowsPerGroup; ++r) {
    const int v = grp + r * kGroups;
    float4 st = rows[r];
    st.x *= decay; st.y *= decay; st.z *= decay; st.w *= decay;
    float u = st.x * kk.x + st.y * kk.y + st.z * kk.z + st.w * kk.w;
#pragma unroll
    for (int o = kLanesPerRow / 2; o > 0; o >>= 1) u += __shfl_xor_sync(0xffffffffu, u, o);
    const float delta = beta * ((v < d_v ? vs[v] : 0.f) - u);
    st.x += kk.x * delta; st.y += kk.y * delta; st.z += kk.z * delta; st.w += kk.w * delta;
    float o_v = st.x * qq.x + st.y * qq.y + st.z * qq.z + st.w * qq.w;
#pragma unroll
    for (int o = kLanesPerRow / 2; o > 0; o >>= 1) o_v += __shfl_xor_sync(0xffffffffu, o_v, o);
    if (v < d_v) {
      *reinterpret_cast<float4*>(state + v * DK + 4 * k4) = st;
      if (k4 == 0) os[v] = o_v;
    }
  }
  __syncthreads();

  // 4. Gated RMSNorm over the d_v outputs.
  bf16* y = out + static_cast<int64_t>(seq) * s.out_dim() + hv * d_v;
  if (w.norm_w == nullptr) {
    for (int c = tid; c < d_v; c += kDecodeThreads) y[c] = __float2bfloat16(os[c]);
    return;
  }
  if (warp == 0) {
    float ss = 0.f;
    for (int c = lane; c < d_v; c += 32) ss += os[c] * os[c];
    ss = warp_sum(ss);
    if (lane == 0) red[0] = rsqrtf(ss / d_v + s.norm_eps);
  }
  __syncthreads();
  const float rinv = red[0];
  const bf16* z = x + qkv_dim + hv * d_v;
  for (int c = tid; c < d_v; c += kDecodeThreads) {
    const float zf = __bfloat162float(z[c]);
    y[c] = __float2bfloat16(__bfloat162float(w.norm_w[c]) * os[c] * rinv * (zf / (1.f + __expf(-zf))));
  }
}

}  // namespace

void launch_gdn_decode(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                       const bf16* proj, const int32_t* seq_pos, const int32_t* slot_ids,
                       int n_seqs, bf16* out, cudaStream_t stream) {
  check_gdn_shape(s);
  DS_CHECK(w.conv_w && w.A_log && w.dt_bias, "gdn decode: layer weight pointers are null");
  DS_CHECK(pool.conv_state && pool.rec_state, "gdn decode: state pool pointers are null");
  DS_CHECK(pool.conv_slot_stride >= 4LL * s.qkv_dim(), "gdn decode: conv_slot_stride too small");
  DS_CHECK(pool.rec_slot_stride >= static_cast<int64_t>(s.n_v_heads) * s.d_v * s.d_k,
           "gdn decode: rec_slot_stride too small");
  DS_CHECK(n_seqs >= 0, "gdn decode: n_seqs must be >= 0, got ", n_seqs);
  if (n_seqs == 0) return;
  const dim3 grid(n_seqs, s.n_v_heads);
  switch (s.d_k) {
    case 16: gdn_decode_kernel<16><<<grid, kDecodeThreads, 0, stream>>>(s, w, pool, proj, seq_pos, slot_ids, out); break;
    case 32: gdn_decode_kernel<32><<<grid, kDecodeThreads, 0, stream>>>(s, w, pool, proj, seq_pos, slot_ids, out); break;
    case 64: gdn_decode_kernel<64><<<grid, kDecodeThreads, 0, stream>>>(s, w, pool, proj, seq_pos, slot_ids, out); break;
    case 128: gdn_decode_kernel<128><<<grid, kDecodeThreads, 0, stream>>>(s, w, pool, proj, seq_pos, slot_ids, out); break;
    default: DS_ASSERT(false);
  }
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
