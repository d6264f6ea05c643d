// Order statistics and floor arithmetic of the benchmarks (see bench_math.h).
#include "bench/bench_math.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace ds::bench {

double percentile(std::vector<double>& samples, double q) {
  DS_CHECK(!samples.empty(), "percentile of an empty sample set");
  DS_CHECK(q >= 0 && q <= 100, "percentile ", q, " outside [0, 100]");
  std::sort(samples.begin(), samples.end());
  const double pos = q / 100.0 * static_cast<double>(samples.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, samples.size() - 1);
  const double f = pos - static_cast<double>(lo);
  return samples[lo] + (samples[hi] - samples[lo]) * f;
}

Summary summarize(std::vector<double> samples) {
  DS_CHECK(!samples.empty(), "no timing samples to summarise");
  for (double x : samples) DS_CHECK(std::isfinite(x), "non-finite timing sample ", x);
  Summary s;
  s.n = static_cast<int>(samples.size());
  double sum = 0;
  for (double x : samples) sum += x;
  s.mean = sum / s.n;
  double var = 0;
  for (double x : samples) var += (x - s.mean) * (x - s.mean);
  s.stddev = s.n > 1 ? std::sqrt(var / (s.n - 1)) : 0.0;
  s.p10 = percentile(samples, 10);
  s.p50 = percentile(samples, 50);
  s.p90 = percentile(samples, 90);
  s.p99 = percentile(samples, 99);
  s.min = samples.front();
  s.max = samples.back();
  return s;
}

double layer_matrix_params(const ModelConfig& c, LayerType t) {
  const double h = c.d_model;
  double n = 3.0 * h * c.d_ff;  // gate/up + down
  if (t == LayerType::kFull) {
    n += (double(c.q_proj_dim()) + 2.0 * c.kv_dim()) * h + h * c.attn_out_dim();
  } else {
    n += double(c.gdn_in_dim()) * h + h * c.gdn_z_dim();
  }
  return n;
}

DecodeBytes decode_step_bytes(const ModelConfig& c, int64_t context, int batch) {
  DS_CHECK(context >= 0 && batch >= 1, "decode floor: bad context ", context, " / batch ", batch);
  DecodeBytes b;
  // Weights: every layer's parameters (bf16; A_log / dt_bias are fp32 on the device, a few
  // hundred bytes), final norm, lm_head, and only the batch's rows of the embedding table.
  double layer = 0;
  for (LayerType t : c.layer_types) layer += double(c.n_params_layer(t)) * 2.0;
  b.weights = layer + double(c.d_model) * 2.0 + double(c.vocab_size) * c.d_model * 2.0 +
              double(batch) * c.d_model * 2.0;
  const double n_full = c.n_full_layers(), n_lin = c.n_linear_layers();
  // KV: K and V, every kv head, every cached token of every attention layer, bf16, read once.
  const double kv_per_token = n_full * 2.0 * c.n_kv_heads * c.head_dim * 2.0;
  b.kv = double(batch) * double(context) * kv_per_token;
  // The new token's K and V are written.
  b.activations = double(batch) * kv_per_token;
  // GDN: fp32 recurrent state [n_v, d_v, d_k] read and written, conv ring [4, qkv_dim] bf16
  // read and written, per sequence and layer.
  const double state = double(c.n_v_heads) * c.d_v * c.d_k * 4.0;
  const double ring = double(c.conv_kernel) * c.gdn_qkv_dim() * 2.0;
  b.gdn_state = double(batch) * n_lin * 2.0 * (state + ring);
  return b;
}

double causal_pairs(int64_t n_new, int64_t n_cached) {
  const double q = double(n_new), kv0 = double(n_cached);
  return q * kv0 + q * (q + 1.0) / 2.0;
}

double gdn_layer_flops(const ModelConfig& c, int64_t n_tokens) {
  // Per value head and chunk of C tokens (d_k = K, d_v = V), the chunked (WY/UT) form does:
  //   K K^T and Q K^T inside the chunk           2 * 2 C^2 K
  //   W = A (beta K), U = A (beta V)              2 C^2 K + 2 C^2 V
  //   U - W S, Q S (state in), K^T U (state out)  3 * 2 C K V
  //   (Q K^T masked) U                            2 C^2 V
  // = 6 C K V + 6 C^2 K + 4 C^2 V per chunk; per token divide by C. The triangular solve
  // (C^3 / 3 per chunk) and the elementwise gates are left out (under 2%).
  const double C = kGdnChunk, K = c.d_k, V = c.d_v;
  const double per_token = 6.0 * K * V + 6.0 * C * K + 4.0 * C * V;
  return per_token * double(c.n_v_heads) * double(n_tokens);
}

PrefillFlops prefill_flops(const ModelConfig& c, int64_t n_new, int64_t n_cached,
                           int64_t logit_rows) {
  DS_CHECK(n_new >= 1 && n_cached >= 0 && logit_rows >= 0, "prefill floor: bad shape (", n_new,
           " new tokens, ", n_cached, " cached)");
  PrefillFlops f;
  double params = 0;
  for (LayerType t : c.layer_types) params += layer_matrix_params(c, t);
  f.linear =
      2.0 * params * double(n_new) + 2.0 * double(c.vocab_size) * c.d_model * double(logit_rows);
  // QK^T and PV: 2 FLOPs per multiply-add, head_dim each, per (query, key) pair and query head.
  f.attention =
      double(c.n_full_layers()) * 4.0 * c.n_heads * c.head_dim * causal_pairs(n_new, n_cached);
  f.gdn = double(c.n_linear_layers()) * gdn_layer_flops(c, n_new);
  return f;
}

double prefill_min_bytes(const ModelConfig& c, int64_t n_new, int64_t n_cached) {
  const DecodeBytes d = decode_step_bytes(c, n_cached, 1);
  const double kv_per_token = double(c.n_full_layers()) * 2.0 * c.n_kv_heads * c.head_dim * 2.0;
  return d.weights + d.kv + d.gdn_state + double(n_new) * kv_per_token;
}

Floor roofline_floor(double bytes, double flops, double bytes_per_s, double flops_per_s) {
  DS_CHECK(bytes_per_s > 0 && flops_per_s > 0, "roofline: ceilings must be positive");
  const double tm = bytes / bytes_per_s, tc = flops / flops_per_s;
  return Floor{std::max(tm, tc), tm >= tc};
}

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what) {
  std::vector<int64_t> out;
  size_t i = 0;
  DS_CHECK(!text.empty(), what, ": empty list");
  while (i <= text.size()) {
    const size_t j = std::min(text.find(',', i), text.size());
    std::string item = text.substr(i, j - i);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front())))
      item.erase(item.begin());
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.pop_back();
    DS_CHECK(!item.empty(), what, ": empty item in '", text, "'");
    int64_t mult = 1;
    if (item.back() == 'k' || item.back() == 'K') {
      mult = 1024;
      item.pop_back();
    }
    DS_CHECK(
        !item.empty() &&
            std::all_of(item.begin(), item.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) &&
            item.size() <= 9,
        what, ": '", text.substr(i, j - i), "' is not a positive integer");
    const int64_t v = std::stoll(item) * mult;
    DS_CHECK(v > 0, what, ": values must be positive, got ", v);
    out.push_back(v);
    i = j + 1;
  }
  return out;
}

std::string format_seconds(double s) {
  char buf[48];
  if (s >= 1.0)
    std::snprintf(buf, sizeof buf, "%.3f s", s);
  else if (s >= 1e-3)
    std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.2f us", s * 1e6);
  return buf;
}

}  // namespace ds::bench
