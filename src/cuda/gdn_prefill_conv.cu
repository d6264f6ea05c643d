// GDN prompt path, Hopper conv stage for d_k = d_v = 128 (the slice_scan variants of dispatch.cpp
// run it from gdn_prefill.cu): causal depthwise conv (kernel 4) + SiLU, q/k l2norm (q also times
// d_k^-0.5), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias): launch_gdn_conv_prep's
// maths, as a streaming kernel.
//
// gdn_conv_prep_stream_kernel: a warp owns two heads (256 channels, 8 per lane: 16-byte loads and
// stores) over a strip of consecutive tokens, and slides the conv window down the strip: each
// input row is read once (plus 3 halo rows per strip) instead of once per tap, 8 rows in flight
// per lane at a time (4 KB per warp), the conv weights of its 8 channels in registers for the
// whole strip. Sequence starts inside a strip reload the window from that sequence's conv ring
// (positions < 0: zero), so any mix of sequences runs in one launch. The multi / wide kernels of
// gdn_prefill_sm90.cu read every row 4 times through L1 with 8-byte loads and walk 8 tokens per
// block (~104 / 114 us at 4096 tokens for ~170 MB of compulsory traffic, 1.6 TB/s).
// Arithmetic: the conv sum in the same order as the other conv kernels (taps 0..3, fp32); SiLU
// with the approximate divide (x * rcp(1 + e^-x), 2 ulp: the IEEE divide made the other kernels
// issue-bound, ncu 53% SM throughput at 29% of DRAM bandwidth) and the l2norm's sum of squares
// in another order (8 channels per lane, then 16 lanes), so outputs may differ from theirs in the
// last bf16 bit (cuda_gdn_test ConvStreamMatchesMulti bounds it).
// Grid: (head pairs / 4, token strips); strip = 8, 16 or 32 tokens so short prompts still fill
// the GPU. Gates: by the blocks of the first head group, for their strip's tokens.
// Measured on the H200 (2026-11-29, cuda_gdn_test ConvTiming: CUDA-event medians, 27B shapes, one
// sequence with carried state), us, stream vs multi / wide / generic:
//   tokens      64     512    2048    4096    8192
//   stream    11.4    16.6    45.5    75.0   135.4   (4096: 2.2 TB/s of qkv in + out)
//   multi     53.7    54.6    80.2   101.5   184.3
//   wide      11.3    19.8    62.0   111.4   212.0
//   generic   16.3    19.7    57.6   104.5   193.6
// Whole layer (slice_scan_cs vs slice_scan, same run): 4096 tokens 0.524 vs 0.550 ms, 8192 0.981
// vs 1.034, 2048 0.289 vs 0.325. ncu at 4096 tokens (strip 32): 71 us, DRAM 45% of peak, 22%
// achieved occupancy (128 registers: 4 blocks per SM), 6.3 cycles per issued instruction: more
// bytes in flight per SM (fewer registers, or the next batch's rows loaded during this one's
// arithmetic, or bulk copies) is what would pay next (~40 us at the copy ceiling). Session 25
// tried that: bulk copies of a whole strip into shared memory were slower (79.9 vs 75.0 us,
// removed); a warp per head (the kHead form below, LC = 4: 72 registers, 7 blocks per SM) is
// 3-8% faster alone (71-73 us) and a tie in whole prompts, so it is off ($DS_GDN_CONV=head;
// docs/perf/gdn_prefill.md).
// Test: tests/cuda/cuda_gdn_test.cpp (ConvStreamMatchesMulti, every prefill case through the
// slice_scan variants; PrefillStageTiming / ConvTiming time it beside the other conv kernels).
#include <atomic>
#include <string>

#include "cuda/cuda_common.h"
#include "cuda/gdn_chunk.cuh"
#include "cuda/gdn_prefill_sm90.h"
#include "cuda/mma_util.cuh"

namespace ds::cuda {
namespace {

constexpr int kD = 128;
constexpr int kWarps = 4;  // warps per block
constexpr int kBatch = 8;  // rows loaded at once per lane

// LC bf16 channels of one lane: one 16-byte word (LC 8, a warp = two heads) or one 8-byte word
// (LC 4, a warp = one head).
template <int LC>
struct ConvVec;
template <>
struct ConvVec<8> {
  using T = uint4;
  __device__ static T zero() { return make_uint4(0, 0, 0, 0); }
};
template <>
struct ConvVec<4> {
  using T = uint2;
  __device__ static T zero() { return make_uint2(0, 0); }
};

// LC bf16 (one word) as floats.
__device__ __forceinline__ void unpack_lc(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 p = *reinterpret_cast<const __nv_bfloat162*>(&w[i]);
    f[2 * i] = __low2float(p);
    f[2 * i + 1] = __high2float(p);
  }
}
__device__ __forceinline__ void unpack_lc(const uint2& u, float (&f)[4]) {
  const uint32_t w[2] = {u.x, u.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const __nv_bfloat162 p = *reinterpret_cast<const __nv_bfloat162*>(&w[i]);
    f[2 * i] = __low2float(p);
    f[2 * i + 1] = __high2float(p);
  }
}
__device__ __forceinline__ void pack_lc(const float (&v)[8], float scale, uint4& u) {
  u.x = pack_bf16(v[0] * scale, v[1] * scale);
  u.y = pack_bf16(v[2] * scale, v[3] * scale);
  u.z = pack_bf16(v[4] * scale, v[5] * scale);
  u.w = pack_bf16(v[6] * scale, v[7] * scale);
}
__device__ __forceinline__ void pack_lc(const float (&v)[4], float scale, uint2& u) {
  u.x = pack_bf16(v[0] * scale, v[1] * scale);
  u.y = pack_bf16(v[2] * scale, v[3] * scale);
}

// LC = 8 (kStream, 128 registers, 4 blocks per SM); LC = 4 (kHead, session 25): half the channels
// per lane, so a quarter of the registers' windows and weights, for more warps per SM.
template <int LC>
__global__ void __launch_bounds__(kWarps * 32, LC == 8 ? 0 : 7)
    gdn_conv_prep_stream_kernel(GdnShape s, GdnLayerWeights w, GdnStatePool pool,
                                const bf16* __restrict__ proj,           // [n_tokens, in_dim]
                                const int32_t* __restrict__ cu_seqlens,  // [n_seqs + 1]
                                const int32_t* __restrict__ seq_pos,     // [n_seqs]
                                const int32_t* __restrict__ slot_ids,    // [n_seqs]
                                int n_seqs, int n_tokens, int strip,
                                bf16* __restrict__ qkv,    // [n_tokens, qkv_dim]
                                float* __restrict__ g,     // [n_tokens, n_v_heads]
                                float* __restrict__ beta)  // [n_tokens, n_v_heads]
{
  using Vec = typename ConvVec<LC>::T;
  constexpr int kHeadsPerWarp = LC / 4;     // 2 or 1
  constexpr int kWarpCh = 32 * LC;          // channels per warp
  constexpr int kLanesPerHead = kD / LC;    // 16 or 32
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int qkv_dim = s.qkv_dim(), in_dim = s.in_dim();
  const int n_heads = 2 * s.n_k_heads + s.n_v_heads;
  const int t_begin = blockIdx.y * strip, t_end = min(n_tokens, t_begin + strip);
  const int unit = blockIdx.x * kWarps + warp;  // the warp's head pair (LC 8) or head (LC 4)
  const int hh = kHeadsPerWarp * unit + lane / kLanesPerHead;  // this lane's head (q, k, v)
  // Warps past the last head (pair) have nothing to do; a pair's second head may be missing (odd
  // head count): those 16 lanes only shuffle among themselves and neither load nor store.
  if (kHeadsPerWarp * unit < n_heads) {
    const bool valid = hh < n_heads;
    const bool is_v = hh >= 2 * s.n_k_heads;
    const float head_scale = hh < s.n_k_heads ? rsqrtf(static_cast<float>(kD)) : 1.f;
    const int ch = unit * kWarpCh + LC * lane;
    float wt0[16], wt1[16];  // [channel][tap] of channels ch..ch+3 and ch+4..ch+7 (LC 8)
    if (valid) {
      load16_bf16(w.conv_w + ch * 4, wt0);
      if constexpr (LC == 8) load16_bf16(w.conv_w + ch * 4 + 16, wt1);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) wt0[i] = wt1[i] = 0.f;
    }
    const Vec zero = ConvVec<LC>::zero();

    // The sequence of token t_begin, and the input row r (< first token of the window's sequence
    // or not) as that sequence sees it: a prompt row, a row of its conv ring, or zero.
    int seq = seq_of_token(cu_seqlens, n_seqs, t_begin);
    int seq_start = cu_seqlens[seq], seq_end = cu_seqlens[seq + 1];
    auto input_row = [&](int r) -> Vec {
      if (!valid) return zero;
      if (r >= seq_start) return *reinterpret_cast<const Vec*>(proj + int64_t(r) * in_dim + ch);
      const int pp = seq_pos[seq] + (r - seq_start);
      if (pp < 0) return zero;
      const bf16* ring =
          pool.conv_state + static_cast<int64_t>(slot_ids[seq]) * pool.conv_slot_stride;
      return *reinterpret_cast<const Vec*>(ring + (pp & 3) * qkv_dim + ch);
    };
    float win[3][LC];  // inputs of t - 3, t - 2, t - 1 for the next token t (as floats)
#pragma unroll
    for (int d = 0; d < 3; ++d) unpack_lc(input_row(t_begin - 3 + d), win[d]);

    for (int t0 = t_begin; t0 < t_end; t0 += kBatch) {
      Vec x[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int t = t0 + i;
        x[i] = valid && t < t_end ? *reinterpret_cast<const Vec*>(proj + int64_t(t) * in_dim + ch)
                                  : zero;
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int t = t0 + i;
        if (t >= t_end) break;                   // uniform across the warp
        if (t >= seq_end && seq + 1 < n_seqs) {  // a sequence starts at t (empty ones skipped):
          do {                                   // its window comes from its conv ring
            ++seq;
            seq_start = seq_end;
            seq_end = cu_seqlens[seq + 1];
          } while (t >= seq_end && seq + 1 < n_seqs);
#pragma unroll
          for (int d = 0; d < 3; ++d) unpack_lc(input_row(t - 3 + d), win[d]);
        }
        float cur[LC];
        unpack_lc(x[i], cur);
        float v[LC];
        float ss = 0.f;
#pragma unroll
        for (int c = 0; c < LC; ++c) {
          const float* wc = c < 4 ? wt0 + 4 * c : wt1 + 4 * (c - 4);
          float acc = wc[0] * win[0][c];
          acc += wc[1] * win[1][c];
          acc += wc[2] * win[2][c];
          acc += wc[3] * cur[c];
          acc = __fdividef(acc, 1.f + __expf(-acc));  // SiLU (acc << 0: 0, as the limit)
          v[c] = acc;
          ss += acc * acc;
        }
#pragma unroll
        for (int o = kLanesPerHead / 2; o > 0; o >>= 1)
          ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float scale = is_v ? 1.f : rsqrtf(ss + 1e-6f) * head_scale;
        if (valid) {
          Vec u;
          pack_lc(v, scale, u);
          *reinterpret_cast<Vec*>(qkv + int64_t(t) * qkv_dim + ch) = u;
        }
#pragma unroll
        for (int c = 0; c < LC; ++c) {
          win[0][c] = win[1][c];
          win[1][c] = win[2][c];
          win[2][c] = cur[c];
        }
      }
    }
  }
  if (blockIdx.x != 0) return;
  // Gates of this strip's tokens: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
  // (threshold 20), as the other conv kernels.
  const int n_v = s.n_v_heads;
  for (int e = threadIdx.x; e < (t_end - t_begin) * n_v; e += blockDim.x) {
    const int64_t t = t_begin + e / n_v;
    const int h = e % n_v;
    const bf16* b_in = proj + t * in_dim + qkv_dim + s.z_dim();
    const float b = __bfloat162float(b_in[h]);
    const float a = __bfloat162float(b_in[n_v + h]) + w.dt_bias[h];
    beta[t * n_v + h] = 1.f / (1.f + expf(-b));
    g[t * n_v + h] = -expf(w.A_log[h]) * (a > 20.f ? a : log1pf(expf(a)));
  }
}

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

bool gdn_conv_prep_stream_supported(const GdnShape& s, const GdnLayerWeights& w,
                                    const GdnStatePool& pool, const bf16* proj) {
  return s.d_k == kD && s.d_v == kD && s.in_dim() % 8 == 0 && pool.conv_slot_stride % 8 == 0 &&
         aligned(proj, 16) && aligned(pool.conv_state, 16) && aligned(w.conv_w, 16);
}

namespace {
std::atomic<int> g_conv_form{-1};  // -1: not read yet
}

GdnConvForm parse_gdn_conv_form(const char* value) {
  const std::string v = value ? value : "";
  DS_CHECK(v.empty() || v == "stream" || v == "head",
           "$DS_GDN_CONV must be stream or head (got '", v, "')");
  return v == "head" ? GdnConvForm::kHead : GdnConvForm::kStream;
}

GdnConvForm gdn_conv_form() {
  return cached_form(g_conv_form, "DS_GDN_CONV", parse_gdn_conv_form);
}

void set_gdn_conv_form(GdnConvForm form) { g_conv_form.store(static_cast<int>(form)); }

int gdn_conv_prep_stream_strip(int n_tokens) {
  // 10 blocks per strip at 27B shapes, 4 blocks per SM (128 registers): H200 at 4096 tokens,
  // strip 8 / 16 / 32 / 64: 79.8 / 75.0 / 78.3 / 93.1 us (16: 2560 blocks, ~4.8 waves; 32 leaves
  // a 0.4 wave tail); 32 at 8192 tokens (135 us, again ~4.8 waves), 8 below 2048 tokens.
  return n_tokens >= 8192 ? 32 : n_tokens >= 2048 ? 16 : 8;
}

void launch_gdn_conv_prep_stream(const GdnShape& s, const GdnLayerWeights& w,
                                 const GdnStatePool& pool, const bf16* proj,
                                 const int32_t* cu_seqlens, const int32_t* seq_pos,
                                 const int32_t* slot_ids, int n_seqs, int n_tokens, bf16* qkv,
                                 float* g, float* beta, cudaStream_t stream, int strip,
                                 GdnConvForm form) {
  DS_CHECK(gdn_conv_prep_stream_supported(s, w, pool, proj),
           "gdn conv prep stream: shape / alignment not supported (d_k = d_v = 128, 16-byte "
           "aligned proj / ring rows)");
  DS_CHECK(aligned(qkv, 16), "gdn conv prep stream: qkv must be 16-byte aligned");
  if (strip <= 0) strip = gdn_conv_prep_stream_strip(n_tokens);
  DS_CHECK(strip % kBatch == 0, "gdn conv prep stream: strip must be a multiple of ", kBatch,
           ", got ", strip);
  if (n_tokens <= 0 || n_seqs <= 0) return;
  const int n_heads = 2 * s.n_k_heads + s.n_v_heads;
  if (form == GdnConvForm::kDefault) form = gdn_conv_form();
  const bool head = form == GdnConvForm::kHead;
  const int units = head ? n_heads : (n_heads + 1) / 2;  // warps' heads or head pairs
  const dim3 grid((units + kWarps - 1) / kWarps, (n_tokens + strip - 1) / strip);
  auto* kernel = head ? gdn_conv_prep_stream_kernel<4> : gdn_conv_prep_stream_kernel<8>;
  kernel<<<grid, kWarps * 32, 0, stream>>>(s, w, pool, proj, cu_seqlens, seq_pos, slot_ids, n_seqs,
                                           n_tokens, strip, qkv, g, beta);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
