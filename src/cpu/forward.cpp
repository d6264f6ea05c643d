// CPU reference forward of the Qwen3.5 text model (see forward.h and ../shared/SPEC.md).
//
// Layout conventions: activations are row-major [n_tokens, features]; weights are [out, in] as in
// the checkpoint, widened to fp32 once at construction. Every op is written out plainly; the only
// parallelism is OpenMP over output features (matmuls), heads (attention, GDN) and rows.
#include "cpu/forward.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"

namespace ds {

struct CpuModel::Layer {
  LayerType type = LayerType::kLinear;
  int cache_idx = 0;               // index into the state's per-full / per-linear arrays
  std::vector<float> input_norm;   // [d_model] already 1 + w
  std::vector<float> post_norm;    // [d_model] already 1 + w
  std::vector<float> mlp_gate_up;  // [2*d_ff, d_model] rows [gate | up]
  std::vector<float> mlp_down;     // [d_model, d_ff]
  // Full attention.
  std::vector<float> attn_qkv;  // [q_proj_dim + 2*kv_dim, d_model] rows [q(+gate) | k | v]
  std::vector<float> attn_o;    // [d_model, n_heads*head_dim]
  std::vector<float> q_norm;    // [head_dim] already 1 + w
  std::vector<float> k_norm;    // [head_dim] already 1 + w
  // Gated DeltaNet.
  std::vector<float> gdn_in;    // [gdn_in_dim, d_model] rows [qkv | z | b | a]
  std::vector<float> gdn_conv;  // [gdn_qkv_dim, conv_kernel]
  std::vector<float> dt_bias;   // [n_v_heads]
  std::vector<float> A;         // [n_v_heads] exp(A_log), so g = -A * softplus(a + dt_bias)
  std::vector<float> gdn_norm;  // [d_v] plain weight
  std::vector<float> gdn_out;   // [d_model, n_v_heads*d_v]
};

namespace {

constexpr int kGdnChunk = 64;  // sub-chunk of the WY form, as HF / FLA

// Widens a tensor after checking its element count against the expected shape.
std::vector<float> widen(const TensorView& t, int64_t expect, const char* what) {
  DS_CHECK(!t.empty(), "CpuModel: tensor ", what, " (", t.name, ") is missing");
  DS_CHECK(t.numel() == expect, "CpuModel: tensor ", t.name.empty() ? what : t.name.c_str(),
           " has ", t.numel(), " elements, expected ", expect);
  std::vector<float> out(static_cast<size_t>(expect));
  t.to_f32(out.data());
  return out;
}

std::vector<float> widen_plus_one(const TensorView& t, int64_t expect, const char* what) {
  std::vector<float> w = widen(t, expect, what);
  for (float& v : w) v += 1.0f;  // zero-centred RMSNorm weight
  return w;
}

// Dot product with 8 independent partial sums in a fixed order: vectorisable, and the result of
// a row never depends on how many rows are processed together (chunked == token by token).
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (; i < n; ++i) acc[i & 7] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Register-blocked piece of y = x W^T: NT token rows x NO weight rows, 4-wide vectors along `in`.
// Each y element sums its products in the same fixed order (4 lanes, a scalar tail into lane
// k % 4, then (l0 + l1) + (l2 + l3)) whatever NT / NO it is computed with, so a row's result does
// not depend on how many rows are processed together (chunked == token by token, bit for bit).
typedef float v4f __attribute__((vector_size(16)));

inline v4f load4(const float* p) {
  v4f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int NT, int NO>
inline void matmul_block(const float* x, const float* w, float* y, int in, int out) {
  v4f acc[NT][NO];
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
    for (int o = 0; o < NO; ++o) acc[t][o] = v4f{0, 0, 0, 0};
  int k = 0;
  for (; k + 4 <= in; k += 4) {
    v4f xv[NT], wv[NO];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) xv[t] = load4(x + static_cast<size_t>(t) * in + k);
#pragma GCC unroll 4
    for (int o = 0; o < NO; ++o) wv[o] = load4(w + static_cast<size_t>(o) * in + k);
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
      for (int o = 0; o < NO; ++o) acc[t][o] += xv[t] * wv[o];
  }
  for (int t = 0; t < NT; ++t) {
    for (int o = 0; o < NO; ++o) {
      float l[4];
      std::memcpy(l, &acc[t][o], sizeof(l));
      for (int kk = k; kk < in; ++kk)
        l[kk & 3] += x[static_cast<size_t>(t) * in + kk] * w[static_cast<size_t>(o) * in + kk];
      y[static_cast<size_t>(t) * out + o] = (l[0] + l[1]) + (l[2] + l[3]);
    }
  }
}

template <int NT>
inline void matmul_rows(const float* x, const float* w, float* y, int in, int out, int n_o) {
  switch (n_o) {
    case 4:
      matmul_block<NT, 4>(x, w, y, in, out);
      break;
    case 3:
      matmul_block<NT, 3>(x, w, y, in, out);
      break;
    case 2:
      matmul_block<NT, 2>(x, w, y, in, out);
      break;
    default:
      matmul_block<NT, 1>(x, w, y, in, out);
      break;
  }
}

// y = x W^T. x: [n, in], w: [out, in], y: [n, out]. Tiles of 16 tokens x 32 weight rows are
// shared out over the threads; inside a tile, blocks of 2 tokens x 4 rows.
void matmul(const float* x, const float* w, float* y, int n, int in, int out) {
  constexpr int kTileT = 16, kTileO = 32;
  const int n_tb = (n + kTileT - 1) / kTileT, n_ob = (out + kTileO - 1) / kTileO;
  const bool big =
      static_cast<int64_t>(n) * in * out >= (1 << 22);  // else threads cost more than they save
#pragma omp parallel for schedule(static) collapse(2) if (big)
  for (int tb = 0; tb < n_tb; ++tb) {
    for (int ob = 0; ob < n_ob; ++ob) {
      const int t_end = std::min(n, (tb + 1) * kTileT), o_end = std::min(out, (ob + 1) * kTileO);
      for (int o = ob * kTileO; o < o_end; o += 4) {
        const int n_o = std::min(4, o_end - o);
        const float* wr = w + static_cast<size_t>(o) * in;
        int t = tb * kTileT;
        for (; t + 2 <= t_end; t += 2) {
          matmul_rows<2>(x + static_cast<size_t>(t) * in, wr, y + static_cast<size_t>(t) * out + o,
                         in, out, n_o);
        }
        for (; t < t_end; ++t) {
          matmul_rows<1>(x + static_cast<size_t>(t) * in, wr, y + static_cast<size_t>(t) * out + o,
                         in, out, n_o);
        }
      }
    }
  }
}

// out = x * rsqrt(mean(x^2) + eps) * w over rows of length d (w already holds 1 + w where
// zero-centred).
inline void rms_norm_row(const float* x, const float* w, float* out, int d, float eps) {
  float ss = 0.0f;
  for (int i = 0; i < d; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int i = 0; i < d; ++i) out[i] = x[i] * r * w[i];
}

void rms_norm_rows(const float* x, const float* w, float* out, int n, int d, float eps) {
#pragma omp parallel for schedule(static) if (static_cast <int64_t>(n) * d >= (1 << 18))
  for (int t = 0; t < n; ++t)
    rms_norm_row(x + static_cast<size_t>(t) * d, w, out + static_cast<size_t>(t) * d, d, eps);
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float softplus(float x) {
  return x > 20.0f ? x : std::log1p(std::exp(x));
}  // torch threshold 20

// x *= rsqrt(sum(x^2) + 1e-6), as HF / FLA l2norm.
inline void l2norm(float* x, int d) {
  float ss = 0.0f;
  for (int i = 0; i < d; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss + 1e-6f);
  for (int i = 0; i < d; ++i) x[i] *= r;
}

}  // namespace

CpuModel::CpuModel(const HostWeights& w) : cfg_(w.config) {
  cfg_.validate();
  const int64_t d = cfg_.d_model, V = cfg_.vocab_size;
  // fp32 copies of every weight (lm_head too when tied): refuse clearly rather than be OOM-killed.
  const double need =
      4.0 * static_cast<double>(cfg_.n_params_text() + (cfg_.tie_word_embeddings ? V * d : 0));
  const double phys =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  DS_CHECK(phys <= 0 || need < 0.9 * phys,
           "the CPU reference widens the weights to fp32: ", w.source, " needs ", need / (1 << 30),
           " GiB, this machine has ", phys / (1 << 30), " GiB of memory (use --device cuda)");
  DS_CHECK(static_cast<int>(w.layers.size()) == cfg_.n_layers, "CpuModel: ", w.layers.size(),
           " layers in the weights, config says ", cfg_.n_layers);
  embed_ = widen(w.embed, V * d, "embed_tokens");
  final_norm_ = widen_plus_one(w.final_norm, d, "norm");
  lm_head_ = widen(w.lm_head.empty() ? w.embed : w.lm_head, V * d, "lm_head");

  const int rot = cfg_.rotary_dim;
  DS_CHECK(rot % 2 == 0 && rot <= cfg_.head_dim, "CpuModel: rotary_dim ", rot,
           " must be even and <= head_dim");
  rope_inv_freq_.resize(rot / 2);
  for (int i = 0; i < rot / 2; ++i) {  // as HF: 1 / theta^(2i / rot) with the exponent in fp32
    const float e = static_cast<float>(2 * i) / static_cast<float>(rot);
    rope_inv_freq_[i] =
        1.0f / static_cast<float>(std::pow(cfg_.rope_theta, static_cast<double>(e)));
  }

  int n_full = 0, n_lin = 0;
  layers_.resize(cfg_.n_layers);
  for (int il = 0; il < cfg_.n_layers; ++il) {
    const LayerWeights& lw = w.layers[il];
    Layer& L = layers_[il];
    L.type = cfg_.layer_types[il];
    DS_CHECK(lw.type == L.type, "CpuModel: layer ", il, " weights are of the other layer type");
    L.input_norm = widen_plus_one(lw.input_norm, d, "input_layernorm");
    L.post_norm = widen_plus_one(lw.post_norm, d, "post_attention_layernorm");
    L.mlp_gate_up = widen(lw.mlp_gate_up, 2LL * cfg_.d_ff * d, "mlp gate_up");
    L.mlp_down = widen(lw.mlp_down, d * cfg_.d_ff, "mlp.down_proj");
    if (L.type == LayerType::kFull) {
      L.cache_idx = n_full++;
      L.attn_qkv =
          widen(lw.attn_qkv, int64_t{cfg_.q_proj_dim() + 2 * cfg_.kv_dim()} * d, "attn qkv");
      L.attn_o = widen(lw.attn_o, d * cfg_.attn_out_dim(), "self_attn.o_proj");
      L.q_norm = widen_plus_one(lw.q_norm, cfg_.head_dim, "self_attn.q_norm");
      L.k_norm = widen_plus_one(lw.k_norm, cfg_.head_dim, "self_attn.k_norm");
    } else {
      L.cache_idx = n_lin++;
      L.gdn_in = widen(lw.gdn_in, int64_t{cfg_.gdn_in_dim()} * d, "linear_attn in_proj");
      L.gdn_conv =
          widen(lw.gdn_conv, int64_t{cfg_.gdn_qkv_dim()} * cfg_.conv_kernel, "linear_attn.conv1d");
      L.dt_bias = widen(lw.gdn_dt_bias, cfg_.n_v_heads, "linear_attn.dt_bias");
      L.A = widen(lw.gdn_A_log, cfg_.n_v_heads, "linear_attn.A_log");
      for (float& a : L.A) a = std::exp(a);
      L.gdn_norm = widen(lw.gdn_norm, cfg_.d_v, "linear_attn.norm");
      L.gdn_out = widen(lw.gdn_out, d * cfg_.gdn_z_dim(), "linear_attn.out_proj");
    }
  }
}

CpuModel::~CpuModel() = default;
CpuModel::CpuModel(CpuModel&&) noexcept = default;
CpuModel& CpuModel::operator=(CpuModel&&) noexcept = default;

CpuSeqState CpuModel::new_state() const {
  CpuSeqState s;
  const int n_full = cfg_.n_full_layers(), n_lin = cfg_.n_linear_layers();
  s.k_cache.resize(n_full);
  s.v_cache.resize(n_full);
  s.conv_state.assign(
      n_lin,
      std::vector<float>(static_cast<size_t>(cfg_.conv_kernel - 1) * cfg_.gdn_qkv_dim(), 0.0f));
  s.rec_state.assign(
      n_lin, std::vector<float>(static_cast<size_t>(cfg_.n_v_heads) * cfg_.d_k * cfg_.d_v, 0.0f));
  return s;
}

void CpuModel::forward(CpuSeqState& state, std::span<const int32_t> tokens, int chunk_size,
                       bool all_logits, std::vector<float>& logits) const {
  const int V = cfg_.vocab_size, d = cfg_.d_model;
  for (size_t i = 0; i < tokens.size(); ++i) {
    DS_CHECK(tokens[i] >= 0 && tokens[i] < V, "token id ", tokens[i], " at position ", i,
             " is outside the vocabulary [0, ", V, ")");
  }
  DS_CHECK(state.k_cache.size() == static_cast<size_t>(cfg_.n_full_layers()) &&
               state.rec_state.size() == static_cast<size_t>(cfg_.n_linear_layers()),
           "CpuModel::forward: state was not made by this model's new_state()");
  if (tokens.empty()) return;
  const int n_total = static_cast<int>(tokens.size());
  const int chunk = chunk_size <= 0 ? n_total : chunk_size;

  std::vector<float> x, xn;
  for (int start = 0; start < n_total; start += chunk) {
    const int n = std::min(chunk, n_total - start);
    forward_chunk(state, tokens.subspan(start, n), x);
    // Final norm + lm_head for the rows we return.
    const int first = all_logits ? 0 : (start + n == n_total ? n - 1 : n);
    const int rows = n - first;
    if (rows <= 0) continue;
    xn.resize(static_cast<size_t>(rows) * d);
    rms_norm_rows(x.data() + static_cast<size_t>(first) * d, final_norm_.data(), xn.data(), rows, d,
                  cfg_.rms_norm_eps);
    const size_t off = logits.size();
    logits.resize(off + static_cast<size_t>(rows) * V);
    matmul(xn.data(), lm_head_.data(), logits.data() + off, rows, d, V);
  }
}

void CpuModel::forward_chunk(CpuSeqState& state, std::span<const int32_t> tokens,
                             std::vector<float>& x) const {
  const int n = static_cast<int>(tokens.size()), d = cfg_.d_model, d_ff = cfg_.d_ff;
  const float eps = cfg_.rms_norm_eps;
  x.resize(static_cast<size_t>(n) * d);
  for (int t = 0; t < n; ++t) {
    std::memcpy(&x[static_cast<size_t>(t) * d], &embed_[static_cast<size_t>(tokens[t]) * d],
                d * sizeof(float));
  }
  std::vector<float> xn(x.size()), mix(x.size()), gate_up(static_cast<size_t>(n) * 2 * d_ff),
      act(static_cast<size_t>(n) * d_ff);

  for (int il = 0; il < cfg_.n_layers; ++il) {
    const Layer& L = layers_[il];
    // h = h + Mixer(RMSNorm(h))
    rms_norm_rows(x.data(), L.input_norm.data(), xn.data(), n, d, eps);
    if (L.type == LayerType::kFull) {
      attention_layer(L, state, n, xn.data(), mix.data());
    } else {
      gdn_layer(L, state, n, xn.data(), mix.data());
    }
    for (size_t i = 0; i < x.size(); ++i) x[i] += mix[i];

    // h = h + down(silu(gate(x)) * up(x)), x = RMSNorm(h)
    rms_norm_rows(x.data(), L.post_norm.data(), xn.data(), n, d, eps);
    matmul(xn.data(), L.mlp_gate_up.data(), gate_up.data(), n, d, 2 * d_ff);
    for (int t = 0; t < n; ++t) {
      const float* g = &gate_up[static_cast<size_t>(t) * 2 * d_ff];
      float* a = &act[static_cast<size_t>(t) * d_ff];
      for (int i = 0; i < d_ff; ++i) a[i] = silu(g[i]) * g[d_ff + i];
    }
    matmul(act.data(), L.mlp_down.data(), mix.data(), n, d_ff, d);
    for (size_t i = 0; i < x.size(); ++i) x[i] += mix[i];
    if (probe_) probe_(il, n, x.data());
  }
  state.n_past += n;
}

// Gated full attention over the KV cache. xn: [n, d_model]; out: [n, d_model].
void CpuModel::attention_layer(const Layer& L, CpuSeqState& state, int n, const float* xn,
                               float* out) const {
  const int d = cfg_.d_model, H = cfg_.n_heads, Hkv = cfg_.n_kv_heads, hd = cfg_.head_dim;
  const int q_dim = cfg_.q_proj_dim(), kv_dim = cfg_.kv_dim(), row = q_dim + 2 * kv_dim;
  const int group = H / Hkv, half = cfg_.rotary_dim / 2;
  const bool gated = cfg_.attn_output_gate;
  const int q_stride = gated ? 2 * hd : hd;  // per head: [query | gate] interleaved by head
  const float eps = cfg_.rms_norm_eps, scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int p0 = state.n_past;

  std::vector<float> qkv(static_cast<size_t>(n) * row);
  matmul(xn, L.attn_qkv.data(), qkv.data(), n, d, row);

  // q/k norm, then partial NeoX RoPE on dims [0, rotary_dim). note: K is cached after both.
  std::vector<float> q(static_cast<size_t>(n) * H * hd);
  std::vector<float>& kc = state.k_cache[L.cache_idx];
  std::vector<float>& vc = state.v_cache[L.cache_idx];
  kc.resize(static_cast<size_t>(p0 + n) * kv_dim);
  vc.resize(static_cast<size_t>(p0 + n) * kv_dim);
  auto rope = [&](float* x, int pos) {
    for (int i = 0; i < half; ++i) {
      const float ang = static_cast<float>(pos) * rope_inv_freq_[i];
      const float c = static_cast<float>(std::cos(static_cast<double>(ang)));
      const float s = static_cast<float>(std::sin(static_cast<double>(ang)));
      const float x0 = x[i], x1 = x[i + half];
      x[i] = x0 * c - x1 * s;
      x[i + half] = x1 * c + x0 * s;
    }
  };
  for (int t = 0; t < n; ++t) {
    const float* r = &qkv[static_cast<size_t>(t) * row];
    for (int h = 0; h < H; ++h) {
      float* qh = &q[(static_cast<size_t>(t) * H + h) * hd];
      rms_norm_row(r + h * q_stride, L.q_norm.data(), qh, hd, eps);
      rope(qh, p0 + t);
    }
    for (int h = 0; h < Hkv; ++h) {
      float* kh = &kc[static_cast<size_t>(p0 + t) * kv_dim + h * hd];
      rms_norm_row(r + q_dim + h * hd, L.k_norm.data(), kh, hd, eps);
      rope(kh, p0 + t);
      std::memcpy(&vc[static_cast<size_t>(p0 + t) * kv_dim + h * hd], r + q_dim + kv_dim + h * hd,
                  hd * sizeof(float));
    }
  }

  // Causal softmax attention; query head h reads kv head h / group; output times sigmoid(gate).
  std::vector<float> attn(static_cast<size_t>(n) * H * hd);
  const bool big = static_cast<int64_t>(n) * H * (p0 + n) * hd >= (1 << 20);
#pragma omp parallel if (big)
  {
    std::vector<float> score(p0 + n);
#pragma omp for schedule(static) collapse(2)
    for (int t = 0; t < n; ++t) {
      for (int h = 0; h < H; ++h) {
        const int n_ctx = p0 + t + 1, kvh = h / group;
        const float* qh = &q[(static_cast<size_t>(t) * H + h) * hd];
        float mx = -INFINITY;
        for (int j = 0; j < n_ctx; ++j) {
          score[j] = dot(qh, &kc[static_cast<size_t>(j) * kv_dim + kvh * hd], hd) * scale;
          mx = std::max(mx, score[j]);
        }
        float sum = 0.0f;
        for (int j = 0; j < n_ctx; ++j) {
          score[j] = std::exp(score[j] - mx);
          sum += score[j];
        }
        float* o = &attn[(static_cast<size_t>(t) * H + h) * hd];
        std::fill(o, o + hd, 0.0f);
        for (int j = 0; j < n_ctx; ++j) {
          const float p = score[j] / sum;
          const float* vj = &vc[static_cast<size_t>(j) * kv_dim + kvh * hd];
          for (int i = 0; i < hd; ++i) o[i] += p * vj[i];
        }
        if (gated) {
          const float* gate = &qkv[static_cast<size_t>(t) * row + h * q_stride + hd];
          for (int i = 0; i < hd; ++i) o[i] *= sigmoid(gate[i]);
        }
      }
    }
  }
  matmul(attn.data(), L.attn_o.data(), out, n, H * hd, d);
}

// Gated DeltaNet. xn: [n, d_model]; out: [n, d_model].
void CpuModel::gdn_layer(const Layer& L, CpuSeqState& state, int n, const float* xn,
                         float* out) const {
  const int d = cfg_.d_model, nk = cfg_.n_k_heads, nv = cfg_.n_v_heads, dk = cfg_.d_k,
            dv = cfg_.d_v;
  const int K = cfg_.conv_kernel, C = cfg_.gdn_qkv_dim(), z_dim = cfg_.gdn_z_dim();
  const int row = cfg_.gdn_in_dim(), ratio = nv / nk;
  const float eps = cfg_.rms_norm_eps, q_scale = 1.0f / std::sqrt(static_cast<float>(dk));

  // [qkv | z | b | a] = xn W^T
  std::vector<float> proj(static_cast<size_t>(n) * row);
  matmul(xn, L.gdn_in.data(), proj.data(), n, d, row);

  // Depthwise causal conv over the qkv channels, the K-1 previous inputs from the conv state, SiLU.
  std::vector<float>& conv_state = state.conv_state[L.cache_idx];  // [K-1, C], oldest first
  std::vector<float> ext(static_cast<size_t>(K - 1 + n) * C);      // [K-1+n, C] pre-conv inputs
  std::copy(conv_state.begin(), conv_state.end(), ext.begin());
  for (int t = 0; t < n; ++t) {
    std::memcpy(&ext[static_cast<size_t>(K - 1 + t) * C], &proj[static_cast<size_t>(t) * row],
                C * sizeof(float));
  }
  std::vector<float> qkv(static_cast<size_t>(n) * C);  // [n, C] = [q: nk*dk | k: nk*dk | v: nv*dv]
#pragma omp parallel for schedule(static) if (static_cast <int64_t>(n) * C * K >= (1 << 20))
  for (int c = 0; c < C; ++c) {
    const float* w = &L.gdn_conv[static_cast<size_t>(c) * K];
    for (int t = 0; t < n; ++t) {
      float s = 0.0f;
      for (int j = 0; j < K; ++j) s += w[j] * ext[static_cast<size_t>(t + j) * C + c];
      qkv[static_cast<size_t>(t) * C + c] = silu(s);
    }
  }
  std::copy(ext.end() - static_cast<ptrdiff_t>(conv_state.size()), ext.end(), conv_state.begin());

  // Per token: l2norm(q) * dk^-0.5, l2norm(k); beta = sigmoid(b); g = -A * softplus(a + dt_bias).
  std::vector<float> beta(static_cast<size_t>(n) * nv), g(static_cast<size_t>(n) * nv);
  for (int t = 0; t < n; ++t) {
    float* r = &qkv[static_cast<size_t>(t) * C];
    for (int h = 0; h < nk; ++h) {
      float* qh = r + h * dk;
      l2norm(qh, dk);
      for (int i = 0; i < dk; ++i) qh[i] *= q_scale;
      l2norm(r + nk * dk + h * dk, dk);
    }
    const float* b = &proj[static_cast<size_t>(t) * row + C + z_dim];
    const float* a = b + nv;
    for (int h = 0; h < nv; ++h) {
      beta[static_cast<size_t>(t) * nv + h] = sigmoid(b[h]);
      g[static_cast<size_t>(t) * nv + h] = -L.A[h] * softplus(a[h] + L.dt_bias[h]);
    }
  }

  // The delta rule per value head h (key head h / ratio), state S: [dk, dv].
  std::vector<float>& S_all = state.rec_state[L.cache_idx];
  std::vector<float> o(static_cast<size_t>(n) * nv * dv);  // [n, nv, dv]
  const bool recurrent = n == 1 || gdn_mode_ == GdnMode::kRecurrent;
#pragma omp parallel for schedule(static) if (static_cast <int64_t>(n) * nv * dk * dv >= (1 << 20))
  for (int h = 0; h < nv; ++h) {
    float* S = &S_all[static_cast<size_t>(h) * dk * dv];
    const int kh = h / ratio;
    auto q_of = [&](int t) { return &qkv[static_cast<size_t>(t) * C + kh * dk]; };
    auto k_of = [&](int t) { return &qkv[static_cast<size_t>(t) * C + nk * dk + kh * dk]; };
    auto v_of = [&](int t) { return &qkv[static_cast<size_t>(t) * C + 2 * nk * dk + h * dv]; };
    auto o_of = [&](int t) { return &o[(static_cast<size_t>(t) * nv + h) * dv]; };
    std::vector<float> u(dv);
    if (recurrent) {
      // S = exp(g) S; u = S^T k; S += k (beta (v - u))^T; o = S^T q
      for (int t = 0; t < n; ++t) {
        const float* qt = q_of(t);
        const float* kt = k_of(t);
        const float* vt = v_of(t);
        const float decay = std::exp(g[static_cast<size_t>(t) * nv + h]);
        const float bt = beta[static_cast<size_t>(t) * nv + h];
        for (int i = 0; i < dk * dv; ++i) S[i] *= decay;
        std::fill(u.begin(), u.end(), 0.0f);
        for (int i = 0; i < dk; ++i) {
          for (int j = 0; j < dv; ++j) u[j] += S[i * dv + j] * kt[i];
        }
        for (int j = 0; j < dv; ++j) u[j] = bt * (vt[j] - u[j]);
        for (int i = 0; i < dk; ++i) {
          for (int j = 0; j < dv; ++j) S[i * dv + j] += kt[i] * u[j];
        }
        float* ot = o_of(t);
        std::fill(ot, ot + dv, 0.0f);
        for (int i = 0; i < dk; ++i) {
          for (int j = 0; j < dv; ++j) ot[j] += S[i * dv + j] * qt[i];
        }
      }
      continue;
    }
    // Chunked WY / UT form over sub-chunks of kGdnChunk tokens (HF torch_chunk_gated_delta_rule):
    //   gc = cumsum(g) in the sub-chunk; A[i][j] = beta_i (k_i . k_j) exp(gc_i - gc_j), j < i
    //   (I + A) U = beta v,  (I + A) W = beta k exp(gc)          (forward substitution)
    //   v_new = U - W S;  o_i = exp(gc_i) q_i S + sum_{j<=i} (q_i . k_j) exp(gc_i - gc_j) v_new_j
    //   S = exp(gc_last) S + sum_j exp(gc_last - gc_j) k_j v_new_j^T
    std::vector<float> gc(kGdnChunk), Amat(kGdnChunk * kGdnChunk), U(kGdnChunk * dv),
        W(kGdnChunk * dk);
    for (int s0 = 0; s0 < n; s0 += kGdnChunk) {
      const int Lc = std::min(kGdnChunk, n - s0);
      float acc = 0.0f;
      for (int i = 0; i < Lc; ++i) {
        acc += g[static_cast<size_t>(s0 + i) * nv + h];
        gc[i] = acc;
      }
      for (int i = 0; i < Lc; ++i) {
        const float bi = beta[static_cast<size_t>(s0 + i) * nv + h];
        for (int j = 0; j < i; ++j) {
          Amat[i * kGdnChunk + j] =
              bi * dot(k_of(s0 + i), k_of(s0 + j), dk) * std::exp(gc[i] - gc[j]);
        }
      }
      for (int i = 0; i < Lc; ++i) {
        const float bi = beta[static_cast<size_t>(s0 + i) * nv + h];
        const float eg = std::exp(gc[i]);
        float* Ui = &U[static_cast<size_t>(i) * dv];
        float* Wi = &W[static_cast<size_t>(i) * dk];
        const float* vi = v_of(s0 + i);
        const float* ki = k_of(s0 + i);
        for (int c = 0; c < dv; ++c) Ui[c] = bi * vi[c];
        for (int c = 0; c < dk; ++c) Wi[c] = bi * ki[c] * eg;
        for (int j = 0; j < i; ++j) {
          const float a = Amat[i * kGdnChunk + j];
          const float* Uj = &U[static_cast<size_t>(j) * dv];
          const float* Wj = &W[static_cast<size_t>(j) * dk];
          for (int c = 0; c < dv; ++c) Ui[c] -= a * Uj[c];
          for (int c = 0; c < dk; ++c) Wi[c] -= a * Wj[c];
        }
      }
      // v_new = U - W S (in place in U)
      for (int i = 0; i < Lc; ++i) {
        float* Ui = &U[static_cast<size_t>(i) * dv];
        const float* Wi = &W[static_cast<size_t>(i) * dk];
        for (int r = 0; r < dk; ++r) {
          for (int c = 0; c < dv; ++c) Ui[c] -= Wi[r] * S[r * dv + c];
        }
      }
      // Outputs: inter-chunk read of the old state plus the intra-chunk attention.
      for (int i = 0; i < Lc; ++i) {
        const float* qi = q_of(s0 + i);
        float* oi = o_of(s0 + i);
        const float eg = std::exp(gc[i]);
        std::fill(oi, oi + dv, 0.0f);
        for (int r = 0; r < dk; ++r) {
          const float qr = qi[r] * eg;
          for (int c = 0; c < dv; ++c) oi[c] += qr * S[r * dv + c];
        }
        for (int j = 0; j <= i; ++j) {
          const float a = dot(qi, k_of(s0 + j), dk) * std::exp(gc[i] - gc[j]);
          const float* Uj = &U[static_cast<size_t>(j) * dv];
          for (int c = 0; c < dv; ++c) oi[c] += a * Uj[c];
        }
      }
      // State update.
      const float g_last = gc[Lc - 1], e_last = std::exp(g_last);
      for (int i = 0; i < dk * dv; ++i) S[i] *= e_last;
      for (int j = 0; j < Lc; ++j) {
        const float* kj = k_of(s0 + j);
        const float ej = std::exp(g_last - gc[j]);
        const float* Uj = &U[static_cast<size_t>(j) * dv];
        for (int r = 0; r < dk; ++r) {
          const float kr = kj[r] * ej;
          for (int c = 0; c < dv; ++c) S[r * dv + c] += kr * Uj[c];
        }
      }
    }
  }

  // Gated RMSNorm per head: w * (o * rsqrt(mean(o^2) + eps)) * silu(z); one w[dv] for all heads.
  for (int t = 0; t < n; ++t) {
    const float* z = &proj[static_cast<size_t>(t) * row + C];
    for (int h = 0; h < nv; ++h) {
      float* oh = &o[(static_cast<size_t>(t) * nv + h) * dv];
      rms_norm_row(oh, L.gdn_norm.data(), oh, dv, eps);
      for (int i = 0; i < dv; ++i) oh[i] *= silu(z[h * dv + i]);
    }
  }
  matmul(o.data(), L.gdn_out.data(), out, n, nv * dv, d);
}

}  // namespace ds
