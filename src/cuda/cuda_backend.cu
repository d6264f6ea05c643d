// The CUDA engine (see cuda_backend.h): memory plan and allocation, weight upload / device
// synthetic generation, the host-side KV block manager, and the GPU forward, which reads top to
// bottom: per layer one branch on its type (GDN or gated attention), one line per op.
#include <algorithm>
#include <bit>
#include <climits>
#include <type_traits>
#include <chrono>
#include <compare>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include "core/bf16.h"
#include "cuda/argmax.h"
#include "cuda/attention_decode.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_common.h"
#include "cuda/dispatch.h"
#include "cuda/gdn_prefill_sm90.h"
#include "cuda/gemm.h"
#include "cuda/gemv_bulk_norm.h"
#include "cuda/kernels.h"
#include "cuda/model_shapes.h"
#include "cuda/score_rows.h"
#include "model/memory_plan.h"
#include "model/weight_table.h"

namespace ds {
namespace {

// out_row of a gathered row that is scored on the device (SeqWork::score_top), not returned.
constexpr int64_t kScoredRow = INT64_MIN;

using cuda::bf16;
using cuda::KernelFamily;

// Qwen3.5-27B text config (configs/qwen3.5-27b.json, compact; a test checks they agree).
constexpr const char* kQwen35_27bConfig =
    R"({"architectures":["Qwen3_5ForCausalLM"],"model_type":"qwen3_5_text","dtype":"bfloat16","hidden_size":5120,"num_hidden_layers":64,"intermediate_size":17408,"vocab_size":248320,"num_attention_heads":24,"num_key_value_heads":4,"head_dim":256,"attn_output_gate":true,"linear_num_key_heads":16,"linear_num_value_heads":48,"linear_key_head_dim":128,"linear_value_head_dim":128,"linear_conv_kernel_dim":4,"full_attention_interval":4,"layer_types":["linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention"],"rms_norm_eps":1e-06,"hidden_act":"silu","attention_bias":false,"tie_word_embeddings":false,"max_position_embeddings":262144,"eos_token_id":248044,"rope_parameters":{"rope_type":"default","rope_theta":10000000,"partial_rotary_factor":0.25,"mrope_section":[11,11,10],"mrope_interleaved":true}})";

constexpr int kMaxDecodeSplits = 64;  // splits the decode plan aims at (bucket bottom)
constexpr int kMaxGraphSplits = 2 * kMaxDecodeSplits;  // splits at the bucket top (workspace)
// Device memory one captured decode graph is assumed to take (~900 kernel nodes and their
// parameters after cudaGraphUpload); the reserve keeps max_cuda_graphs of these and the cache
// evicts by the measured sizes. Measured on the H200: see docs/GPU.md.
constexpr int64_t kGraphBytesEstimate = int64_t(4) << 20;
constexpr size_t kGemmWorkspace = size_t(64) << 20;
constexpr size_t kStagingBytes = size_t(64) << 20;  // per pinned staging buffer (2 of them)
// Forwards of at least this many tokens fold the residual add into the out-projection GEMMs
// (CudaEngineOptions::prefill_residual_fold); decode batches stay below it.
constexpr int kFoldMinRows = 64;

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Bump allocation inside one cudaMalloc; with base == nullptr it only measures.
struct Bump {
  char* base = nullptr;
  size_t off = 0;
  template <typename T>
  T* take(int64_t n) {
    off = align_up(off, 256);
    T* p = base ? reinterpret_cast<T*>(base + off) : nullptr;
    off += sizeof(T) * static_cast<size_t>(n);
    return p;
  }
};

struct DevLayer {
  LayerType type = LayerType::kLinear;
  int fl = -1, ll = -1;        // index among the full-attention / GDN layers
  bf16* input_norm = nullptr;  // [d_model]
  bf16* post_norm = nullptr;   // [d_model]
  bf16* gate_up = nullptr;     // [2*d_ff, d_model]
  bf16* down = nullptr;        // [d_model, d_ff]
  bf16* attn_qkv = nullptr;    // [q_proj_dim + 2*kv_dim, d_model]
  bf16* attn_o = nullptr;      // [d_model, n_heads*head_dim]
  bf16* q_norm = nullptr;      // [head_dim]
  bf16* k_norm = nullptr;      // [head_dim]
  bf16* gdn_in = nullptr;      // [gdn_in_dim, d_model]
  bf16* gdn_conv = nullptr;    // [gdn_qkv_dim, conv_kernel]
  bf16* gdn_norm = nullptr;    // [d_v]
  bf16* gdn_out = nullptr;     // [d_model, n_v_heads*d_v]
  float* A_log = nullptr;      // [n_v_heads]
  float* dt_bias = nullptr;    // [n_v_heads]
};

struct DevWeights {
  bf16* embed = nullptr;       // [vocab, d_model]
  bf16* final_norm = nullptr;  // [d_model]
  bf16* lm_head = nullptr;     // [vocab, d_model] (== embed when tied)
  std::vector<DevLayer> layers;
};

// Lays the weights out in `b` (measure first with an empty Bump, then assign).
void layout_weights(const ModelConfig& c, Bump& b, DevWeights& w) {
  const int64_t d = c.d_model;
  w.embed = b.take<bf16>(int64_t(c.vocab_size) * d);
  w.final_norm = b.take<bf16>(d);
  w.lm_head = c.tie_word_embeddings ? w.embed : b.take<bf16>(int64_t(c.vocab_size) * d);
  w.layers.assign(c.n_layers, {});
  int fl = 0, ll = 0;
  for (int il = 0; il < c.n_layers; ++il) {
    DevLayer& L = w.layers[il];
    L.type = c.layer_types[il];
    L.input_norm = b.take<bf16>(d);
    L.post_norm = b.take<bf16>(d);
    L.gate_up = b.take<bf16>(2 * int64_t(c.d_ff) * d);
    L.down = b.take<bf16>(d * c.d_ff);
    if (L.type == LayerType::kFull) {
      L.fl = fl++;
      L.attn_qkv = b.take<bf16>(int64_t(c.q_proj_dim() + 2 * c.kv_dim()) * d);
      L.attn_o = b.take<bf16>(d * c.attn_out_dim());
      L.q_norm = b.take<bf16>(c.head_dim);
      L.k_norm = b.take<bf16>(c.head_dim);
    } else {
      L.ll = ll++;
      L.gdn_in = b.take<bf16>(int64_t(c.gdn_in_dim()) * d);
      L.gdn_conv = b.take<bf16>(int64_t(c.gdn_qkv_dim()) * c.conv_kernel);
      L.gdn_norm = b.take<bf16>(c.d_v);
      L.gdn_out = b.take<bf16>(d * c.gdn_z_dim());
      L.A_log = b.take<float>(c.n_v_heads);
      L.dt_bias = b.take<float>(c.n_v_heads);
    }
  }
}

// The device buffer of a HostWeights / checkpoint field, and whether it is stored as fp32.
void* field_ptr(const DevWeights& w, const WeightSpec& s, int layer, bool& f32) {
  f32 = false;
  if (s.global_field) {
    if (s.global_field == &HostWeights::embed) return w.embed;
    if (s.global_field == &HostWeights::final_norm) return w.final_norm;
    if (s.global_field == &HostWeights::lm_head) return w.lm_head;
  } else {
    const DevLayer& L = w.layers.at(layer);
    const auto f = s.layer_field;
    if (f == &LayerWeights::input_norm) return L.input_norm;
    if (f == &LayerWeights::post_norm) return L.post_norm;
    if (f == &LayerWeights::mlp_gate_up) return L.gate_up;
    if (f == &LayerWeights::mlp_down) return L.down;
    if (f == &LayerWeights::attn_qkv) return L.attn_qkv;
    if (f == &LayerWeights::attn_o) return L.attn_o;
    if (f == &LayerWeights::q_norm) return L.q_norm;
    if (f == &LayerWeights::k_norm) return L.k_norm;
    if (f == &LayerWeights::gdn_in) return L.gdn_in;
    if (f == &LayerWeights::gdn_conv) return L.gdn_conv;
    if (f == &LayerWeights::gdn_norm) return L.gdn_norm;
    if (f == &LayerWeights::gdn_out) return L.gdn_out;
    f32 = true;
    if (f == &LayerWeights::gdn_A_log) return L.A_log;
    if (f == &LayerWeights::gdn_dt_bias) return L.dt_bias;
  }
  ds::throw_error("cuda engine: no device buffer for tensor ", s.name);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double us_between(std::chrono::steady_clock::time_point a,
                  std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// Pipelined decode (launch_greedy_decode): row i's input token becomes the previous step's greedy
// token of row feed[i] (its argmax output, still on the device) where feed[i] >= 0; an invalid
// one (-1: NaN / inf logits) becomes id 0, so the embedding gather stays in bounds.
__global__ void feed_tokens_kernel(const int32_t* feed,      // [n] row of prev_tok, or -1
                                   const int32_t* prev_tok,  // [rows of the previous step]
                                   int32_t* tokens,          // [n] the step's input tokens
                                   int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && feed[i] >= 0) tokens[i] = max(0, prev_tok[feed[i]]);
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(const BackendOptions& opt, const ModelConfig& cfg, const CudaEngineOptions& eopt);
  ~CudaBackend() override;

  void upload(const HostWeights& w);
  void generate_synthetic(uint64_t seed);
  void tune_gemms();  // after the weights exist, before any graph (see the definition)

  const ModelConfig& config() const override { return cfg_; }
  std::string name() const override { return "cuda:" + std::to_string(device_); }
  int n_slots() const override { return n_slots_; }
  int max_seq_len() const override { return layout_.max_seq_len; }
  int slot_len(int slot) const override {
    check_slot(slot);
    return slot_len_[slot];
  }
  bool can_grow(int slot, int n_new) const override;
  void reset_slot(int slot) override;
  MemoryUsage memory() const override;
  void step(std::span<const SeqWork> work, std::vector<float>& logits) override;
  void step_greedy(std::span<const SeqWork> work, StepOutput& out) override;
  int max_score_top() const override { return cuda::kMaxScoreTop; }
  void launch_greedy_decode(std::span<const DecodeItem> items) override;
  void collect_greedy_decode(std::vector<int32_t>& tokens) override;
  bool pipelines_decode() const override { return true; }
  int max_decode_in_flight() const override { return 2; }  // the pinned buffers below
  int decode_in_flight() const override { return static_cast<int>(pipe_q_.size()); }
  CudaStepTiming last_step_timing() const { return timing_; }
  double replay_last_graph(int n);

  CudaGraphStats graph_stats() const {
    CudaGraphStats s = gstats_;
    s.enabled = graphs_on_;
    s.cached = static_cast<int>(graphs_.size());
    return s;
  }
  void set_graphs(bool on) {
    if (!on) clear_graphs();
    graphs_on_ = on;
  }
  int fused_norm_rows() const { return fused_norm_rows_; }
  void set_fused_norm_rows(int rows) {
    DS_CHECK(rows >= 0 && rows <= cuda::kGemvNormMaxM, "fused norm rows must be in 0..",
             cuda::kGemvNormMaxM, ", got ", rows);
    if (rows != fused_norm_rows_) clear_graphs();  // captured graphs hold the other launches
    fused_norm_rows_ = rows;
  }
  int mlp_fused() const { return mlp_fused_; }
  int64_t mlp_fused_enqueued(int form) const { return mlp_fused_enqueued_[form - 1]; }
  void set_mlp_fused(int mode) {
    DS_CHECK(mode >= 0 && mode <= 3, "the fused MLP mode must be 0..3, got ", mode);
    if (mode != mlp_fused_) clear_graphs();  // captured graphs hold the other launches
    mlp_fused_ = mode;
  }
  bool argmax_fused() const { return argmax_fused_; }
  int64_t argmax_fused_enqueued() const { return argmax_fused_enqueued_; }
  void set_argmax_fused(bool on) {
    if (on != argmax_fused_) clear_graphs();  // captured graphs hold the other launches
    argmax_fused_ = on;
  }
  bool head_norm_fused() const { return head_norm_; }
  int64_t head_norm_enqueued() const { return head_norm_enqueued_; }
  bool gdn_early() const { return gdn_early_; }
  void set_gdn_early(bool on) {
    if (on != gdn_early_) clear_graphs();  // captured graphs hold the other launches
    gdn_early_ = on;
  }
  int64_t gdn_early_enqueued() const { return gdn_early_enqueued_; }
  std::vector<unsigned> gdn_early_words() {
    std::vector<unsigned> v(size_t(cfg_.n_layers) + 1);
    DS_CUDA_CHECK(cudaStreamSynchronize(stream_));
    DS_CUDA_CHECK(cudaMemcpy(v.data(), gdn_ready_, v.size() * sizeof(unsigned),
                             cudaMemcpyDeviceToHost));
    return v;
  }
  void set_head_norm_fused(bool on) {
    if (on != head_norm_) clear_graphs();  // captured graphs hold the other launches
    head_norm_ = on;
  }
  bool decode_rope_fused() const { return rope_fused_; }
  void set_decode_rope_fused(bool on) {
    if (on != rope_fused_) clear_graphs();  // captured graphs hold the other launches
    rope_fused_ = on;
  }
  using PrefillFold = CudaEngineOptions::PrefillFold;
  PrefillFold prefill_fold() const { return fold_; }
  void set_prefill_fold(PrefillFold mode) { fold_ = mode; }  // prompt forwards: no graph has it

 private:
  struct Piece {
    int item;  // index into work
    int slot;
    int offset;  // first token of the item in this piece
    int n;       // tokens in this piece
    int pos0;    // tokens the slot held before the piece
  };
  void check_slot(int slot) const {
    DS_CHECK(slot >= 0 && slot < n_slots_, "slot ", slot, " out of range [0, ", n_slots_, ")");
  }
  int blocks_for(int tokens) const { return (tokens + page_size_ - 1) / page_size_; }
  // The split-KV decode grid for a bucket of max kv lengths (see decode_kv_plan()).
  struct DecodeKvPlan {
    int bucket = 0;  // power of two >= every kv_len of the step (the grid's bound)
    int kv_chunk = 0, n_splits = 0;
  };
  // Pointers into one metadata block (host mirror or device) laid out for T tokens, S pieces.
  struct StepMeta {
    int32_t *tokens = nullptr, *positions = nullptr, *slot_map = nullptr, *gather = nullptr;
    int32_t *q_start = nullptr, *q_len = nullptr, *kv_len = nullptr, *seq_pos = nullptr;
    int32_t *slot_ids = nullptr, *cu = nullptr, *cu_p = nullptr, *btab = nullptr;
    size_t n_ints = 0;
  };
  // Every host decision of one forward, made before the first launch.
  struct FwdPlan {
    int T = 0, S = 0, S_d = 0, S_p = 0;  // tokens, pieces, decode pieces, prompt pieces
    int max_q = 0, max_kv = 0, max_kv_d = 0, max_q_p = 0, max_kv_p = 0;
    int n_gather = 0;     // hidden rows that go through lm_head
    bool argmax = false;  // some gathered rows want only their argmax
    bool attn_split_kv = false, gdn_fused_decode = false;
    cuda::AttnDecodeKernel attn_decode_kernel = cuda::AttnDecodeKernel::kSimt;
    cuda::AttnDecodeMode attn_decode_mode = cuda::AttnDecodeMode::kPlanned;  // mma kernel only
    cuda::GdnDecodeKernel gdn_decode_kernel = cuda::GdnDecodeKernel::kCluster4;
    cuda::RopeKvKernel rope_kernel = cuda::RopeKvKernel::kBlockPerToken;  // kAuto: warp per head
    // Decode-only forward whose attention split kernel does rope_kv's work (decode_rope_fused).
    bool rope_fused = false;
    // Decode-only forward whose final norm runs in lm_head's prologue (head_norm_fused): the
    // layers end before it, and lm_head reads the hidden rows in place (no gather).
    bool head_norm = false;
    DecodeKvPlan kv;
    StepMeta d;  // device metadata
  };
  struct GraphKey {
    int n_seqs = 0, kv_bucket = 0;
    bool argmax = false;
    auto operator<=>(const GraphKey&) const = default;
  };
  struct GraphEntry {
    cudaGraphExec_t exec = nullptr;
    uint64_t last_used = 0;
    int64_t bytes = 0;
  };

  // A pipelined decode step in forward(): pinned buffer pair `buf`, the launch's feed rows.
  struct PipeStep {
    int buf = 0;
    std::span<const DecodeItem> items;
  };
  void run_step(std::span<const SeqWork> work, std::vector<float>& logits,
                std::vector<int32_t>* tokens, const PipeStep* pipe = nullptr);
  void forward(std::span<const SeqWork> work, const std::vector<Piece>& pieces,
               const std::vector<int64_t>& row_base, std::vector<float>& logits,
               std::vector<int32_t>* tokens, const PipeStep* pipe);
  DecodeKvPlan decode_kv_plan(int n_seqs, int max_kv_len) const;
  StepMeta meta_layout(int32_t* base, int T, int S) const;
  void enqueue_layers(const FwdPlan& f);
  void enqueue_head(const FwdPlan& f, int r0, int r);
  bool gemv_norm_fits(const bf16* w, int m, int n, int k) const;
  bool gemv_norm(const cuda::GemvNormIn& nin, const bf16* w, void* y, int m, int n, int k,
                 const cuda::GemvL2Next& next = {}, cuda::GemmOut out = cuda::GemmOut::kBF16,
                 const cuda::GemvSignal& sig = {});
  // The L2 prefetch of a later GEMV (m rows, weight [n, k]) for the GEMV before it ($DS_GEMV_L2_NEXT;
  // rows 0 when off): its grid as GemmEngine would launch it.
  cuda::GemvL2Next l2_next(const bf16* w, int m, int n, int k);
  bool gate_up_silu_norm(const cuda::GemvNormIn& nin, const bf16* w, bf16* act, int m, int d_ff,
                         int k);
  int mlp_fusion(int m, int k0, int layer);
  void run_mlp_fused(const cuda::GemvNormIn& nin, const cuda::GemvMlpMixer& mixer,
                     const cuda::GemvMlpNext& next, const bf16* w_gate_up, const bf16* w_down,
                     int layer);
  bool run_graph(const FwdPlan& f);
  void graph_failed(const char* what, const std::string& why);
  void destroy_graph(std::map<GraphKey, GraphEntry>::iterator it);
  void clear_graphs();
  cuda::GdnStatePool gdn_pool(int ll) const {
    cuda::GdnStatePool p;
    const int64_t conv_slot = 4 * int64_t(cfg_.gdn_qkv_dim());
    const int64_t rec_slot = int64_t(cfg_.n_v_heads) * cfg_.d_v * cfg_.d_k;
    p.conv_state = conv_state_ + ll * n_slots_ * conv_slot;
    p.rec_state = rec_state_ + ll * n_slots_ * rec_slot;
    p.conv_slot_stride = conv_slot;
    p.rec_slot_stride = rec_slot;
    return p;
  }

  ModelConfig cfg_;
  CudaEngineOptions eopt_;
  int device_ = 0, sm_ = 0, n_sms_ = 0;
  int n_slots_ = 0, page_size_ = 0, chunk_size_ = 0;
  CudaMemoryLayout layout_;
  cudaStream_t stream_ = nullptr;
  cuda::DispatchRegistry dispatch_;
  bool rope_warp_ok_ = false;  // the warp-per-head rope_kv kernel supports this attention shape
  std::unique_ptr<cuda::GemmEngine> gemm_;
  cuda::AttnShape attn_;
  cuda::GdnShape gdn_;

  // Device memory.
  void* weight_mem_ = nullptr;
  void* kv_mem_ = nullptr;
  void* state_mem_ = nullptr;
  void* act_mem_ = nullptr;
  DevWeights w_;
  bf16* kv_pool_ = nullptr;     // [n_full, 2, n_blocks, n_kv_heads, page_size, head_dim]
  bf16* conv_state_ = nullptr;  // [n_linear, n_slots, 4, gdn_qkv_dim]
  float* rec_state_ = nullptr;  // [n_linear, n_slots, n_v_heads, d_v, d_k]
  bf16 *h_ = nullptr, *xn_ = nullptr, *delta_ = nullptr;  // [T, d_model]
  bf16* h2_ = nullptr;  // [min(T, kGemvNormMaxM), d_model]: the fused norms' other residual buffer
  bf16* proj_ = nullptr;                                  // [T, max(gdn_in_dim, attn qkv, 2*d_ff)]
  bf16* mix_ = nullptr;                                   // [T, max(n_v*d_v, n_heads*head_dim)]
  bf16* q_ = nullptr;                                     // [T, n_heads*head_dim]
  bf16* act_ = nullptr;                                   // [T, d_ff]
  bf16* lrows_ = nullptr;                                 // [logits_rows, d_model]
  float* dlogits_ = nullptr;                              // [logits_rows, vocab]
  void* gdn_ws_ = nullptr;
  size_t gdn_ws_bytes_ = 0;
  void* attn_ws_ = nullptr;
  unsigned* mlp_bar_ = nullptr;  // [n_layers, 2]: the fused MLP's grid barrier per layer
  int mlp_fused_ = 0;            // CudaEngineOptions::mlp_fused
  int64_t mlp_fused_enqueued_[3] = {0, 0, 0};  // forms 1, 2, 3
  void* argmax_ws_ = nullptr;  // the fused argmax's keys and counter (zeroed once; gemv.h)
  bool argmax_fused_ = false;  // CudaEngineOptions::argmax_fused
  int64_t argmax_fused_enqueued_ = 0;
  bool head_norm_ = false;  // CudaEngineOptions::head_norm_fused
  int64_t head_norm_enqueued_ = 0;
  bool attn_o_pdl_ = true;  // $DS_ATTN_O_PDL (session 33's probe; on: as before)
  bool gdn_early_ = false;  // CudaEngineOptions::gdn_early
  int64_t gdn_early_enqueued_ = 0;
  // [n_layers + 1]: each layer's early-rows counter (GdnDecodeEarly; zero between forwards), then
  // the count of gdn_decode blocks that gave up waiting for one.
  unsigned* gdn_ready_ = nullptr;
  // The residual buffer (h_ or h2_) enqueue_layers ended on when it left the final norm to
  // lm_head (FwdPlan::head_norm): enqueue_head's norm input.
  bf16* head_res_ = nullptr;
  int32_t* dmeta_ = nullptr;  // device metadata
  int32_t* hmeta_ = nullptr;  // pinned mirror
  size_t meta_ints_ = 0;
  int32_t* dtok_ = nullptr;  // [logits_rows] argmax of the lm_head rows
  int32_t* htok_ = nullptr;  // [logits_rows] pinned mirror
  // Scored rows (SeqWork::score_top; allocated at the first use): per group of lm_head rows, the
  // rows' indices and targets [2, logits_rows] and the results [logits_rows, stride(max top)],
  // device and pinned; score_base_: each work item's first RowScore, scores_out_: where they go
  // (set by step_greedy for its run_step).
  int32_t* dscore_rows_ = nullptr;
  int32_t* hscore_rows_ = nullptr;
  uint32_t* dscore_out_ = nullptr;
  uint32_t* hscore_out_ = nullptr;
  std::vector<int64_t> score_base_;
  std::vector<RowScore>* scores_out_ = nullptr;
  // Pipelined decode: two pinned metadata / token mirrors used in turn (at most 2 steps in flight,
  // so a buffer is rewritten only after the step that used it was collected), an event per
  // buffer recorded after its step's token copy, and the launched steps (oldest first).
  int32_t* pipe_hmeta_[2] = {nullptr, nullptr};  // [meta_ints_] each
  int32_t* pipe_htok_[2] = {nullptr, nullptr};   // [logits_rows] each
  cudaEvent_t pipe_ev_[2] = {nullptr, nullptr};
  struct PipeLaunch {
    int buf = 0, rows = 0;
  };
  std::deque<PipeLaunch> pipe_q_;
  int pipe_next_ = 0;
  int last_launch_rows_ = -1;  // rows of the last call when it was a launch, else -1 (no feed)
  CudaStepTiming timing_;      // host clock split of the last step (test / profile hooks)
  cudaGraphExec_t last_exec_ = nullptr;  // the graph the last decode step replayed

  // Residual add + RMSNorm in the prologue of the bulk decode GEMVs (gemv_bulk_norm.h) for
  // forwards of at most this many tokens.
  int fused_norm_rows_ = 2;
  bool rope_fused_ = true;  // CudaEngineOptions::decode_rope_fused
  // The residual add folded into the out-projection GEMMs of prompt forwards of >= kFoldMinRows
  // tokens (CudaEngineOptions::prefill_residual_fold).
  CudaEngineOptions::PrefillFold fold_ = CudaEngineOptions::PrefillFold::kAll;
  // Decode graphs.
  bool graphs_on_ = true;
  // Adaptive split-KV decode attention: splits of at least attn_min_chunk_ keys, at most
  // attn_max_splits_ of them ($DS_ATTN_MIN_CHUNK, $DS_ATTN_MAX_SPLITS: A/B knobs).
  int attn_min_chunk_ = 64, attn_max_splits_ = 64;
  std::map<GraphKey, GraphEntry> graphs_;
  std::set<GraphKey> warm_keys_;  // keys that ran eagerly once: captured on the next use
  uint64_t graph_clock_ = 0;
  CudaGraphStats gstats_;

  // Host block manager.
  std::vector<int> free_blocks_;
  std::vector<std::vector<int>> slot_blocks_;
  std::vector<int> slot_len_;
};

CudaBackend::CudaBackend(const BackendOptions& opt, const ModelConfig& cfg,
                         const CudaEngineOptions& eopt)
    : cfg_(cfg), eopt_(eopt) {
  cfg_.validate();
  DS_CHECK(opt.n_slots >= 1, "cuda engine: n_slots must be at least 1, got ", opt.n_slots);
  DS_CHECK(opt.chunk_size >= 1, "cuda engine: chunk_size must be at least 1, got ", opt.chunk_size);
  DS_CHECK(eopt.page_size >= 1, "cuda engine: page_size must be at least 1");
  DS_CHECK(eopt.logits_rows >= 1, "cuda engine: logits_rows must be at least 1");
  if (!opt.device.empty() && opt.device != "cuda") {
    DS_CHECK(opt.device.rfind("cuda:", 0) == 0, "cuda engine: bad device '", opt.device, "'");
    try {
      device_ = std::stoi(opt.device.substr(5));
    } catch (...) {
      ds::throw_error("cuda engine: bad device '", opt.device, "' (expected cuda or cuda:N)");
    }
  }
  int n_dev = 0;
  DS_CUDA_CHECK(cudaGetDeviceCount(&n_dev));
  DS_CHECK(device_ >= 0 && device_ < n_dev, "cuda engine: device ", device_, " not present (",
           n_dev, " GPUs)");
  DS_CUDA_CHECK(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  DS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  sm_ = prop.major * 10 + prop.minor;
  n_sms_ = prop.multiProcessorCount;
  DS_CHECK(sm_ == 90, "cuda engine: built for sm_90a (Hopper) only, device ", device_, " is ",
           prop.name, " (sm_", sm_, ")");
  dispatch_ = cuda::DispatchRegistry::with_defaults(sm_, eopt.disable_kernels);
  n_slots_ = opt.n_slots;
  page_size_ = eopt.page_size;
  chunk_size_ = opt.chunk_size;

  attn_ = cuda::attn_shape_of(cfg_, page_size_);
  rope_warp_ok_ = cfg_.n_full_layers() > 0 && cuda::qk_norm_rope_kv_warp_supported(attn_);
  gdn_ = cuda::gdn_shape_of(cfg_);
  const int n_full = cfg_.n_full_layers(), n_lin = cfg_.n_linear_layers();
  if (n_full > 0) cuda::check_attn_shape(attn_);
  if (n_lin > 0) cuda::check_gdn_shape(gdn_);

  // ---- Memory plan ----
  const int64_t T = chunk_size_;
  const int64_t d = cfg_.d_model;
  Bump wb;
  DevWeights tmp;
  layout_weights(cfg_, wb, tmp);
  layout_.weight_bytes = static_cast<int64_t>(wb.off);
  layout_.max_step_tokens = chunk_size_;
  const int64_t proj_w = std::max<int64_t>(
      {n_lin ? cfg_.gdn_in_dim() : 0, n_full ? attn_.qkv_dim() : 0, 2 * int64_t(cfg_.d_ff)});
  const int64_t mix_w =
      std::max<int64_t>(n_lin ? cfg_.gdn_z_dim() : 0, n_full ? cfg_.attn_out_dim() : 0);
  const int logit_rows = eopt_.logits_rows;
  gdn_ws_bytes_ = n_lin ? cuda::gdn_prefill_workspace_bytes(gdn_, chunk_size_, n_slots_) : 0;
  const size_t attn_ws =
      n_full ? cuda::attention_decode_workspace_bytes(attn_, n_slots_, kMaxGraphSplits) : 0;
  const int64_t conv_slot = 4 * int64_t(cfg_.gdn_qkv_dim());
  const int64_t rec_slot = int64_t(cfg_.n_v_heads) * cfg_.d_v * cfg_.d_k;
  layout_.gdn_state_bytes = int64_t(n_lin) * n_slots_ * (conv_slot * 2 + rec_slot * 4);
  layout_.kv_block_bytes = int64_t(n_full) * 2 * cfg_.n_kv_heads * page_size_ * cfg_.head_dim * 2;
  auto measure_acts = [&](Bump& b) {
    h_ = b.take<bf16>(T * d);
    h2_ = b.take<bf16>(std::min<int64_t>(T, cuda::kGemvNormMaxM) * d);
    xn_ = b.take<bf16>(T * d);
    delta_ = b.take<bf16>(T * d);
    proj_ = b.take<bf16>(T * proj_w);
    mix_ = b.take<bf16>(T * mix_w);
    q_ = b.take<bf16>(T * int64_t(cfg_.n_heads) * cfg_.head_dim);
    act_ = b.take<bf16>(T * cfg_.d_ff);
    lrows_ = b.take<bf16>(int64_t(logit_rows) * d);
    dlogits_ = b.take<float>(int64_t(logit_rows) * cfg_.vocab_size);
    dtok_ = b.take<int32_t>(logit_rows);
    gdn_ws_ = b.take<char>(static_cast<int64_t>(gdn_ws_bytes_));
    attn_ws_ = b.take<char>(static_cast<int64_t>(attn_ws));
    mlp_bar_ = b.take<unsigned>(2 * int64_t(cfg_.n_layers));
    gdn_ready_ = b.take<unsigned>(int64_t(cfg_.n_layers) + 1);  // + the late count
    argmax_ws_ = b.take<char>(static_cast<int64_t>(cuda::kGemvBulkArgmaxWorkspaceBytes));
  };
  Bump ab;
  measure_acts(ab);
  layout_.activation_bytes =
      static_cast<int64_t>(ab.off) - static_cast<int64_t>(gdn_ws_bytes_ + attn_ws);
  layout_.workspace_bytes = static_cast<int64_t>(gdn_ws_bytes_ + attn_ws + kGemmWorkspace);

  const int max_pos = cfg_.max_position_embeddings > 0 ? cfg_.max_position_embeddings : (1 << 20);
  const int want_len = opt.max_seq_len > 0 ? opt.max_seq_len : max_pos;
  size_t free_b = 0, total_b = 0;
  DS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const int64_t budget = std::min<int64_t>(static_cast<int64_t>(free_b),
                                           static_cast<int64_t>(eopt_.memory_fraction * total_b));
  graphs_on_ = eopt_.cuda_graphs;
  if (const char* env = std::getenv("DS_CUDA_GRAPHS")) {
    const std::string v = env;
    if (v == "0" || v == "off" || v == "false") graphs_on_ = false;
  }
  set_fused_norm_rows(eopt_.fused_norm_rows);
  rope_fused_ = cuda::env_switch("DS_DECODE_ROPE_FUSED", eopt_.decode_rope_fused);
  argmax_fused_ = cuda::env_switch("DS_ARGMAX_FUSED", eopt_.argmax_fused);
  head_norm_ = cuda::env_switch("DS_HEAD_NORM", eopt_.head_norm_fused);
  gdn_early_ = cuda::env_switch("DS_GDN_EARLY", eopt_.gdn_early);
  attn_o_pdl_ = cuda::env_switch("DS_ATTN_O_PDL", true);
  (void)cuda::gemv_tma_kbox_mode();  // a bad $DS_GEMV_TMA_KBOX fails the start, not a later step
  mlp_fused_ = eopt_.mlp_fused;
  if (const char* env = std::getenv("DS_MLP_FUSED"); env && *env) {
    const std::string v = env;
    DS_CHECK(v == "0" || v == "1" || v == "2" || v == "3", "DS_MLP_FUSED must be 0..3, got '", v,
             "'");
    mlp_fused_ = v[0] - '0';
  }
  DS_CHECK(mlp_fused_ >= 0 && mlp_fused_ <= 3, "CudaEngineOptions::mlp_fused must be 0..3, got ",
           mlp_fused_);
  if (const char* env = std::getenv("DS_FUSED_NORM")) {
    const std::string v = env;
    DS_CHECK(v.size() == 1 && v[0] >= '0' && v[0] <= '0' + cuda::kGemvNormMaxM,
             "DS_FUSED_NORM must be a row count 0..", cuda::kGemvNormMaxM, ", got '", v, "'");
    set_fused_norm_rows(v[0] - '0');
  }
  if (const char* env = std::getenv("DS_ATTN_MIN_CHUNK")) {
    const int v = std::atoi(env);
    DS_CHECK(v >= 8 && v <= 65536 && v % 8 == 0,
             "DS_ATTN_MIN_CHUNK must be a multiple of 8 in 8..65536, got '", env, "'");
    attn_min_chunk_ = v;
  }
  if (const char* env = std::getenv("DS_ATTN_MAX_SPLITS")) {
    const int v = std::atoi(env);
    DS_CHECK(v >= 1 && v <= kMaxDecodeSplits, "DS_ATTN_MAX_SPLITS must be 1..", kMaxDecodeSplits,
             ", got '", env, "'");
    attn_max_splits_ = v;
  }
  fold_ = eopt_.prefill_residual_fold;
  if (const char* env = std::getenv("DS_PREFILL_FOLD")) {
    const std::string v = env;
    DS_CHECK(v == "0" || v == "1" || v == "mixer" || v == "all",
             "DS_PREFILL_FOLD must be 0, mixer, all or 1 (= all), got '", v, "'");
    fold_ = v == "0"       ? PrefillFold::kOff
            : v == "mixer" ? PrefillFold::kMixer
                           : PrefillFold::kAll;
  }
  // $DS_GDN_DECODE_PDL is read at every GDN decode launch (tests switch it between engines); a bad
  // value fails here, at start-up, with its ds::Error, not in every decode forward.
  (void)cuda::gdn_decode_pdl_mode();
  (void)cuda::attention_decode_mode();  // the same for $DS_ATTN_DECODE
  (void)cuda::attention_merge_one_trip();  // and $DS_ATTN_MERGE
  (void)cuda::rmsnorm_fit_enabled();     // and $DS_NORM_FIT (read by every prompt-chunk norm)
  (void)cuda::gemv_l2_next_mib();        // and $DS_GEMV_L2_NEXT (read by every fused decode GEMV)
  (void)cuda::gemv_norm_weight_early();  // and $DS_GEMV_NORM_EARLY (likewise)
  (void)cuda::gemv_bulk_mma_enabled();   // and $DS_GEMV_MMA (read by the gemm registry guard)
  (void)cuda::gemv_splitk_enabled();     // and $DS_GEMV_SPLITK (likewise)
  (void)cuda::gdn_out_form();            // and $DS_GDN_OUT (read by every GDN prompt layer)
  (void)cuda::gdn_state_form();          // and $DS_GDN_STATE
  (void)cuda::gdn_conv_form();           // and $DS_GDN_CONV
  // Kept whether graphs are on or not, so that both modes get the same KV pool.
  layout_.graph_bytes = std::max(0, eopt_.max_cuda_graphs) * kGraphBytesEstimate;
  layout_.reserve_bytes =
      std::max<int64_t>(int64_t(1) << 30, static_cast<int64_t>(total_b) / 50) + layout_.graph_bytes;
  const int64_t fixed = layout_.weight_bytes + layout_.gdn_state_bytes + layout_.activation_bytes +
                        layout_.workspace_bytes + layout_.reserve_bytes;
  if (fixed > budget) {
    ds::throw_error(
        "cuda engine: the model does not fit on ", prop.name, ": weights ",
        format_bytes(layout_.weight_bytes), " + GDN state ", format_bytes(layout_.gdn_state_bytes),
        " + activations ", format_bytes(layout_.activation_bytes), " + workspaces ",
        format_bytes(layout_.workspace_bytes), " + reserve ", format_bytes(layout_.reserve_bytes),
        " > budget ", format_bytes(budget), " (try fewer slots or a smaller chunk size)");
  }
  int64_t n_blocks = int64_t(n_slots_) * blocks_for(want_len);
  if (layout_.kv_block_bytes > 0) {
    n_blocks = std::min<int64_t>(n_blocks, (budget - fixed) / layout_.kv_block_bytes);
    if (eopt_.max_kv_tokens > 0)
      n_blocks = std::min<int64_t>(n_blocks, (eopt_.max_kv_tokens + page_size_ - 1) / page_size_);
    DS_CHECK(n_blocks >= 1, "cuda engine: no memory left for the KV cache");
    n_blocks = std::min<int64_t>(n_blocks, INT32_MAX / 2);
    layout_.max_seq_len = static_cast<int>(std::min<int64_t>(want_len, n_blocks * page_size_));
  } else {
    layout_.max_seq_len = want_len;  // no attention layer: no KV cache
    n_blocks = 0;
  }
  DS_CHECK(opt.max_seq_len <= 0 || layout_.max_seq_len == opt.max_seq_len,
           "cuda engine: ", opt.max_seq_len, " tokens per sequence requested, only ",
           layout_.max_seq_len, " fit in the KV pool");
  layout_.n_kv_blocks = n_blocks;
  layout_.max_blocks_per_seq = blocks_for(layout_.max_seq_len);

  // ---- Allocation ----
  DS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  gemm_ = std::make_unique<cuda::GemmEngine>(kGemmWorkspace);
  gemm_->set_dispatch(&dispatch_);
  // $DS_GEMV_AHEAD and $DS_GEMV_TMA_AHEAD (probes, off unless set; session 36 measured both): the
  // decode GEMVs at batch 1-2 / 5-16 queue this many KiB of their next stages for L2 after their
  // wait. Read here, so each engine captures its graphs with its own setting.
  gemm_->set_l2_ahead_kib(cuda::gemv_ahead_kib_from_env(), cuda::gemv_tma_ahead_kib_from_env());
  DS_CUDA_CHECK(cudaMalloc(&weight_mem_, layout_.weight_bytes));
  wb = Bump{static_cast<char*>(weight_mem_)};
  layout_weights(cfg_, wb, w_);
  if (n_blocks > 0) {
    DS_CUDA_CHECK(cudaMalloc(&kv_mem_, n_blocks * layout_.kv_block_bytes));
    kv_pool_ = static_cast<bf16*>(kv_mem_);
  }
  if (layout_.gdn_state_bytes > 0) {
    DS_CUDA_CHECK(cudaMalloc(&state_mem_, layout_.gdn_state_bytes + 512));
    Bump sb{static_cast<char*>(state_mem_)};
    conv_state_ = sb.take<bf16>(int64_t(n_lin) * n_slots_ * conv_slot);
    rec_state_ = sb.take<float>(int64_t(n_lin) * n_slots_ * rec_slot);
  }
  DS_CUDA_CHECK(cudaMalloc(&act_mem_, ab.off + 256));
  ab = Bump{static_cast<char*>(act_mem_)};
  measure_acts(ab);
  // The fused MLP's grid barriers start at zero and leave themselves there.
  DS_CUDA_CHECK(cudaMemset(mlp_bar_, 0, 2 * size_t(cfg_.n_layers) * sizeof(unsigned)));
  // So do the early-rows counters (the last gdn_decode block of each launch resets its layer's).
  DS_CUDA_CHECK(cudaMemset(gdn_ready_, 0, (size_t(cfg_.n_layers) + 1) * sizeof(unsigned)));
  // So does the fused argmax's workspace.
  DS_CUDA_CHECK(cudaMemset(argmax_ws_, 0, cuda::kGemvBulkArgmaxWorkspaceBytes));
  DS_CUDA_CHECK(cudaDeviceSynchronize());  // stream_ does not wait for the legacy stream
  meta_ints_ =
      4 * size_t(T) + 8 * size_t(n_slots_) + 2 + size_t(n_slots_) * layout_.max_blocks_per_seq;
  DS_CUDA_CHECK(cudaMalloc(&dmeta_, meta_ints_ * sizeof(int32_t)));
  DS_CUDA_CHECK(cudaMallocHost(&hmeta_, meta_ints_ * sizeof(int32_t)));
  DS_CUDA_CHECK(cudaMallocHost(&htok_, size_t(logit_rows) * sizeof(int32_t)));
  for (int i = 0; i < 2; ++i) {
    DS_CUDA_CHECK(cudaMallocHost(&pipe_hmeta_[i], meta_ints_ * sizeof(int32_t)));
    DS_CUDA_CHECK(cudaMallocHost(&pipe_htok_[i], size_t(logit_rows) * sizeof(int32_t)));
    DS_CUDA_CHECK(cudaEventCreateWithFlags(&pipe_ev_[i], cudaEventDisableTiming));
  }

  // Block manager: every block free; lowest ids handed out first.
  free_blocks_.resize(n_blocks);
  for (int64_t i = 0; i < n_blocks; ++i) free_blocks_[i] = static_cast<int>(n_blocks - 1 - i);
  slot_blocks_.assign(n_slots_, {});
  slot_len_.assign(n_slots_, 0);

  // GEMM plans for the decode shapes (1..n_slots tokens); prompt shapes are planned on first use.
  for (int m = 1; m <= std::min(n_slots_, chunk_size_); ++m) {
    if (n_lin) {
      gemm_->prepare(m, cfg_.gdn_in_dim(), d, cuda::GemmOut::kBF16);
      gemm_->prepare(m, d, cfg_.gdn_z_dim(), cuda::GemmOut::kBF16);
    }
    if (n_full) {
      gemm_->prepare(m, attn_.qkv_dim(), d, cuda::GemmOut::kBF16);
      gemm_->prepare(m, d, cfg_.attn_out_dim(), cuda::GemmOut::kBF16);
    }
    gemm_->prepare(m, 2 * cfg_.d_ff, d, cuda::GemmOut::kBF16);
    gemm_->prepare(m, d, cfg_.d_ff, cuda::GemmOut::kBF16);
    if (m <= logit_rows) gemm_->prepare(m, cfg_.vocab_size, d, cuda::GemmOut::kF32);
  }
  if (eopt_.verbose) {
    std::fprintf(stderr, "cuda engine: %s (sm_%d, %d SMs), %s total, %s free\n%s", prop.name, sm_,
                 n_sms_, format_bytes(total_b).c_str(), format_bytes(free_b).c_str(),
                 layout_.to_text().c_str());
    std::fprintf(stderr, "cuda engine: kernel dispatch table\n%s", dispatch_.list().c_str());
    std::fprintf(stderr,
                 "cuda engine: decode CUDA graphs %s (at most %d, %s kept in the reserve)\n",
                 graphs_on_ ? "on" : "off ($DS_CUDA_GRAPHS / option)", eopt_.max_cuda_graphs,
                 format_bytes(layout_.graph_bytes).c_str());
  }
}

CudaBackend::~CudaBackend() {
  if (stream_) cudaStreamSynchronize(stream_);
  clear_graphs();
  gemm_.reset();
  cudaFree(weight_mem_);
  cudaFree(kv_mem_);
  cudaFree(state_mem_);
  cudaFree(act_mem_);
  cudaFree(dmeta_);
  cudaFreeHost(hmeta_);
  cudaFreeHost(htok_);
  cudaFree(dscore_rows_);
  cudaFree(dscore_out_);
  cudaFreeHost(hscore_rows_);
  cudaFreeHost(hscore_out_);
  for (int i = 0; i < 2; ++i) {
    cudaFreeHost(pipe_hmeta_[i]);
    cudaFreeHost(pipe_htok_[i]);
    if (pipe_ev_[i]) cudaEventDestroy(pipe_ev_[i]);
  }
  if (stream_) cudaStreamDestroy(stream_);
}

// Copies the host tensors into the device layout through two pinned staging buffers (copy of
// one overlaps the host fill of the other); f16 / f32 tensors are converted to bf16 on the way.
void CudaBackend::upload(const HostWeights& hw) {
  const auto t0 = std::chrono::steady_clock::now();
  DS_CHECK(hw.layers.size() == static_cast<size_t>(cfg_.n_layers), "cuda engine: weights have ",
           hw.layers.size(), " layers, config ", cfg_.n_layers);
  std::vector<std::pair<const TensorView*, std::pair<void*, bool>>> jobs;  // view -> (dst, f32)
  auto add = [&](const TensorView& v, void* dst, int64_t numel, bool f32) {
    DS_CHECK(!v.empty(), "cuda engine: tensor ", v.name, " missing from the weights");
    DS_CHECK(v.numel() == numel, "cuda engine: tensor ", v.name, " has ", v.numel(),
             " elements, the config needs ", numel);
    DS_CHECK(v.dtype == DType::kBF16 || v.dtype == DType::kF16 || v.dtype == DType::kF32,
             "cuda engine: tensor ", v.name, " has dtype ", dtype_name(v.dtype),
             " (bf16, f16 or f32 supported)");
    jobs.push_back({&v, {dst, f32}});
  };
  const int64_t d = cfg_.d_model;
  add(hw.embed, w_.embed, int64_t(cfg_.vocab_size) * d, false);
  add(hw.final_norm, w_.final_norm, d, false);
  if (!cfg_.tie_word_embeddings) add(hw.lm_head, w_.lm_head, int64_t(cfg_.vocab_size) * d, false);
  for (int il = 0; il < cfg_.n_layers; ++il) {
    const LayerWeights& H = hw.layers[il];
    const DevLayer& L = w_.layers[il];
    DS_CHECK(H.type == L.type, "cuda engine: layer ", il, " type differs from the config");
    add(H.input_norm, L.input_norm, d, false);
    add(H.post_norm, L.post_norm, d, false);
    add(H.mlp_gate_up, L.gate_up, 2 * int64_t(cfg_.d_ff) * d, false);
    add(H.mlp_down, L.down, d * cfg_.d_ff, false);
    if (L.type == LayerType::kFull) {
      add(H.attn_qkv, L.attn_qkv, int64_t(attn_.qkv_dim()) * d, false);
      add(H.attn_o, L.attn_o, d * cfg_.attn_out_dim(), false);
      add(H.q_norm, L.q_norm, cfg_.head_dim, false);
      add(H.k_norm, L.k_norm, cfg_.head_dim, false);
    } else {
      add(H.gdn_in, L.gdn_in, int64_t(cfg_.gdn_in_dim()) * d, false);
      add(H.gdn_conv, L.gdn_conv, int64_t(cfg_.gdn_qkv_dim()) * cfg_.conv_kernel, false);
      add(H.gdn_norm, L.gdn_norm, cfg_.d_v, false);
      add(H.gdn_out, L.gdn_out, d * cfg_.gdn_z_dim(), false);
      add(H.gdn_A_log, L.A_log, cfg_.n_v_heads, true);
      add(H.gdn_dt_bias, L.dt_bias, cfg_.n_v_heads, true);
    }
  }
  void* stage[2] = {nullptr, nullptr};
  cudaEvent_t done[2];
  DS_CUDA_CHECK(cudaMallocHost(&stage[0], kStagingBytes));
  DS_CUDA_CHECK(cudaMallocHost(&stage[1], kStagingBytes));
  DS_CUDA_CHECK(cudaEventCreateWithFlags(&done[0], cudaEventDisableTiming));
  DS_CUDA_CHECK(cudaEventCreateWithFlags(&done[1], cudaEventDisableTiming));
  int buf = 0;
  int64_t bytes = 0;
  std::vector<float> tmp;
  for (auto& [v, dst] : jobs) {
    const size_t out_elem = dst.second ? 4 : 2;
    const int64_t n = v->numel();
    const int64_t per_chunk = static_cast<int64_t>(kStagingBytes / 4);  // elements (fits f32 out)
    for (int64_t e0 = 0; e0 < n; e0 += per_chunk) {
      const int64_t e1 = std::min(n, e0 + per_chunk);
      DS_CUDA_CHECK(cudaEventSynchronize(done[buf]));
      char* st = static_cast<char*>(stage[buf]);
      if (!dst.second && v->dtype == DType::kBF16) {
        std::memcpy(st, v->data + e0 * 2, (e1 - e0) * 2);
      } else {
        for (int64_t i = e0; i < e1; ++i) {
          const float f = v->at(i);
          if (dst.second) {
            std::memcpy(st + (i - e0) * 4, &f, 4);
          } else {
            const uint16_t b = f32_to_bf16(f);
            std::memcpy(st + (i - e0) * 2, &b, 2);
          }
        }
      }
      DS_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst.first) + e0 * out_elem, st,
                                    (e1 - e0) * out_elem, cudaMemcpyHostToDevice, stream_));
      DS_CUDA_CHECK(cudaEventRecord(done[buf], stream_));
      bytes += (e1 - e0) * out_elem;
      buf ^= 1;
    }
  }
  DS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  cudaEventDestroy(done[0]);
  cudaEventDestroy(done[1]);
  cudaFreeHost(stage[0]);
  cudaFreeHost(stage[1]);
  const double s = seconds_since(t0);
  if (eopt_.verbose)
    std::fprintf(stderr, "cuda engine: uploaded %s of weights from %s in %.2f s (%.2f GB/s)\n",
                 format_bytes(bytes).c_str(), hw.source.c_str(), s, bytes / s / 1e9);
}

// Device synthetic weights: the large normal tensors by the device generator (bit-identical to
// the host one), the few log-uniform / fp32 ones (A_log, dt_bias) on the host, rounded through
// bf16 exactly as make_synthetic_weights stores them.
void CudaBackend::generate_synthetic(uint64_t seed) {
  const auto t0 = std::chrono::steady_clock::now();
  int64_t bytes = 0;
  for (const CheckpointTensor& t : checkpoint_tensors(cfg_)) {
    bool f32 = false;
    void* base = field_ptr(w_, *t.spec, t.layer, f32);
    const SyntheticSpec spec = synthetic_tensor_spec(cfg_, t.name, seed);
    const int64_t n = t.numel();
    const int64_t row_elems = n / t.shape[0];
    if (f32 || spec.kind != SyntheticKind::kNormal) {
      DS_CHECK(f32, "cuda engine: no device generator for tensor ", t.name);
      std::vector<float> host(n);
      for (int64_t i = 0; i < n; ++i) host[i] = round_bf16(synthetic_value(spec, uint64_t(i)));
      float* dst = static_cast<float*>(base) + t.row_offset * row_elems;
      DS_CUDA_CHECK(cudaMemcpyAsync(dst, host.data(), n * 4, cudaMemcpyHostToDevice, stream_));
      DS_CUDA_CHECK(cudaStreamSynchronize(stream_));
      bytes += n * 4;
    } else {
      bf16* dst = static_cast<bf16*>(base) + t.row_offset * row_elems;
      cuda::launch_fill_synthetic_normal_bf16(dst, n, spec.seed, spec.mean, spec.std, stream_);
      bytes += n * 2;
    }
  }
  DS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const double s = seconds_since(t0);
  if (eopt_.verbose)
    std::fprintf(
        stderr,
        "cuda engine: generated %s of synthetic weights (seed %llu) on the device in %.2f s\n",
        format_bytes(bytes).c_str(), static_cast<unsigned long long>(seed), s);
}

// GEMM autotuning (gemm.h tune()): every cuBLASLt shape the engine runs is timed on the real
// weights and activation buffers, and the fastest of cuBLASLt's top candidates is kept in its
// plan. Decode m in {1, 2, 4, 8, ...} and n_slots are tuned fully; the m's between try only the
// heuristic's choice and the algorithms their two tuned neighbours kept (up to m 32; bounds the
// start-up cost for many slots). The prompt chunk m = chunk_size is tuned with fewer candidates
// and calls (compute-bound, ms per call). Shapes the skinny kernel takes are skipped. Runs before
// any graph is captured (graphs keep the algorithm).
void CudaBackend::tune_gemms() {
  if (!cuda::GemmEngine::tuning_enabled()) {
    if (eopt_.verbose)
      std::fprintf(stderr,
                   "cuda engine: GEMM tuning off ($DS_GEMM_TUNE=0): heuristic algorithms\n");
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  DS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  struct Shape {
    const char* name;
    int n, k;
    cuda::GemmOut out;
    bf16* x;
    void* y;
    std::vector<const bf16*> w;
  };
  const ModelConfig& c = cfg_;
  const int dm = c.d_model;
  std::vector<Shape> shapes = {
      {"gdn_in", c.gdn_in_dim(), dm, cuda::GemmOut::kBF16, xn_, proj_, {}},
      {"gdn_out", dm, c.gdn_z_dim(), cuda::GemmOut::kBF16, mix_, delta_, {}},
      {"attn_qkv", attn_.qkv_dim(), dm, cuda::GemmOut::kBF16, xn_, proj_, {}},
      {"attn_o", dm, c.attn_out_dim(), cuda::GemmOut::kBF16, mix_, delta_, {}},
      {"gate_up", 2 * c.d_ff, dm, cuda::GemmOut::kBF16, xn_, proj_, {}},
      {"down", dm, c.d_ff, cuda::GemmOut::kBF16, act_, delta_, {}},
  };
  constexpr size_t kMaxWeights = 4;  // distinct matrices rotated per shape (> L2 on the 27B)
  auto add_w = [&](Shape& s, const bf16* w) {
    if (s.w.size() < kMaxWeights) s.w.push_back(w);
  };
  for (const DevLayer& L : w_.layers) {
    if (L.type == LayerType::kFull) {
      add_w(shapes[2], L.attn_qkv);
      add_w(shapes[3], L.attn_o);
    } else {
      add_w(shapes[0], L.gdn_in);
      add_w(shapes[1], L.gdn_out);
    }
    add_w(shapes[4], L.gate_up);
    add_w(shapes[5], L.down);
  }
  Shape lm_head{"lm_head", c.vocab_size, dm, cuda::GemmOut::kF32, lrows_, dlogits_, {w_.lm_head}};

  int n_tuned = 0, n_timed = 0, n_cached = 0, n_changed = 0;
  double saved_us = 0;  // per call, summed over the tuned shapes
  auto tune = [&](const Shape& s, int m, const cuda::GemmTuneOptions& o, bool acc = false) {
    if (s.w.empty() || gemm_->variant(m, s.n, s.k) != "cublaslt") return;
    const cuda::GemmTuneResult r =
        gemm_->tune(m, s.n, s.k, s.out, s.w, s.x, s.y, stream_, acc, o);
    ++n_tuned;
    n_timed += r.timed && !r.cached;
    n_cached += r.cached;
    if (r.timed && r.chosen != 0) {
      ++n_changed;
      saved_us += r.heuristic_us - r.chosen_us;
    }
    // One line per shape timed here or whose timing failed (not for the cached or
    // single-candidate ones: the summary counts them; describe() has every plan's result).
    if (eopt_.verbose && ((r.timed && !r.cached) || (!r.timed && r.candidates > 1)))
      std::fprintf(stderr, "cuda engine: %-8s %s\n", s.name, r.to_string().c_str());
    if (eopt_.verbose && r.sustained && !r.cached)  // every candidate's time, to compare runs
      for (size_t i = 0; i < r.cand_us.size(); ++i)
        std::fprintf(stderr, "cuda engine: %-8s   #%zu %9.2f us  %s\n", s.name, i, r.cand_us[i],
                     r.cand_desc[i].c_str());
  };
  // Decode shapes: the m's prepared in the constructor.
  const int m_max = std::min(n_slots_, chunk_size_);
  std::vector<int> exact;
  for (int m = 1; m < m_max; m *= 2) exact.push_back(m);
  exact.push_back(m_max);
  cuda::GemmTuneOptions full;
  for (int m : exact) {
    for (const Shape& s : shapes) tune(s, m, full);
    if (m <= eopt_.logits_rows) tune(lm_head, m, full);
  }
  constexpr int kMaxBetweenM = 32;  // m's between tuned ones above this keep the heuristic's
  for (size_t i = 0; i + 1 < exact.size() && exact[i + 1] <= kMaxBetweenM; ++i) {
    cuda::GemmTuneOptions between;
    between.max_candidates = 1;
    between.borrow_m = {exact[i], exact[i + 1]};
    for (int m = exact[i] + 1; m < exact[i + 1]; ++m) {
      for (const Shape& s : shapes) tune(s, m, between);
      if (m <= eopt_.logits_rows) tune(lm_head, m, between);
    }
  }
  // The full prompt chunk (prompt shapes only; lm_head runs on the gathered rows), and 4096 rows
  // when the chunk is longer (a 4096-token prompt, or the rest of a longer one, keeps the
  // algorithms tuned for it).
  // $DS_GEMM_TUNE_WINDOW_MS > 0 times the prompt shapes' candidates in sustained windows of that
  // many ms (gemm.h GemmTuneOptions::window_ms: ranked at the power-capped clock a long prompt
  // runs at), $DS_GEMM_TUNE_CANDIDATES how many of cuBLASLt's candidates they try (default 8).
  double window_ms = 0;
  int prompt_cands = 8;
  if (const char* env = std::getenv("DS_GEMM_TUNE_WINDOW_MS")) {
    char* end = nullptr;
    window_ms = std::strtod(env, &end);
    DS_CHECK(end != env && *end == '\0' && window_ms >= 0 && window_ms <= 2000,
             "DS_GEMM_TUNE_WINDOW_MS must be a number of ms in 0..2000, got '", env, "'");
  }
  if (const char* env = std::getenv("DS_GEMM_TUNE_CANDIDATES")) {
    const int v = std::atoi(env);
    DS_CHECK(v >= 1 && v <= 64, "DS_GEMM_TUNE_CANDIDATES must be 1..64, got '", env, "'");
    prompt_cands = v;
  }
  for (int m : {chunk_size_, 4096}) {
    if (m <= m_max || (m == 4096 && chunk_size_ <= 4096)) continue;
    cuda::GemmTuneOptions prompt;
    prompt.max_candidates = prompt_cands;
    prompt.max_weights = 1;
    prompt.batches = 3;
    prompt.window_ms = window_ms;
    for (const Shape& s : shapes) tune(s, m, prompt);
    // The out-projections with the residual folded in (beta = 1), planned whether the fold is on
    // or not, so that set_cuda_prefill_fold can switch it at run time.
    if (m >= kFoldMinRows)
      for (const Shape& s : shapes)
        if (s.n == dm) tune(s, m, prompt, true);
  }
  DS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (eopt_.verbose)
    std::fprintf(stderr,
                 "cuda engine: tuned %d GEMM shapes in %.2f s (%d timed, %d reused from this "
                 "process, the rest kept the heuristic's untimed): %d run another algorithm "
                 "than the heuristic's, %.1f us saved per call summed over them "
                 "($DS_GEMM_TUNE=0: off)\n",
                 n_tuned, seconds_since(t0), n_timed, n_cached, n_changed, saved_us);
}

bool CudaBackend::can_grow(int slot, int n_new) const {
  check_slot(slot);
  if (n_new < 0) return false;
  const int64_t len = int64_t(slot_len_[slot]) + n_new;
  if (len > layout_.max_seq_len) return false;
  if (layout_.kv_block_bytes == 0) return true;
  const int64_t need = blocks_for(static_cast<int>(len)) - int64_t(slot_blocks_[slot].size());
  return need <= static_cast<int64_t>(free_blocks_.size());
}

void CudaBackend::reset_slot(int slot) {
  check_slot(slot);
  for (auto it = slot_blocks_[slot].rbegin(); it != slot_blocks_[slot].rend(); ++it)
    free_blocks_.push_back(*it);
  slot_blocks_[slot].clear();
  slot_len_[slot] = 0;  // GDN state: a sequence at position 0 starts from zero state (gdn.h)
}

MemoryUsage CudaBackend::memory() const {
  MemoryUsage m;
  m.kv_blocks_total = layout_.n_kv_blocks;
  m.kv_blocks_used = layout_.n_kv_blocks - static_cast<int64_t>(free_blocks_.size());
  m.state_slots_total = n_slots_;
  for (int s = 0; s < n_slots_; ++s) m.state_slots_used += slot_len_[s] > 0;
  m.page_size = page_size_;
  return m;
}

void CudaBackend::step(std::span<const SeqWork> work, std::vector<float>& logits) {
  run_step(work, logits, nullptr);
}

void CudaBackend::step_greedy(std::span<const SeqWork> work, StepOutput& out) {
  scores_out_ = &out.scores;
  try {
    run_step(work, out.logits, &out.tokens);
  } catch (...) {
    scores_out_ = nullptr;
    throw;
  }
  scores_out_ = nullptr;
}

// One greedy decode step enqueued without waiting (see Backend::launch_greedy_decode): the same
// validation, metadata and graph as step_greedy, from the other pinned buffer; fed rows take the
// previous step's argmax on the device (feed_tokens_kernel after the metadata copy); the tokens
// come back into that buffer's pinned mirror, the event marks them there.
void CudaBackend::launch_greedy_decode(std::span<const DecodeItem> items) {
  check_decode_launch(items, last_launch_rows_);
  const int n = static_cast<int>(items.size());
  DS_CHECK(n <= eopt_.logits_rows && n <= chunk_size_, "launch_greedy_decode: ", n,
           " rows exceed the engine's step (logits_rows ", eopt_.logits_rows, ", chunk_size ",
           chunk_size_, ")");
  std::vector<int32_t> toks(n);
  std::vector<SeqWork> work(n);
  for (int i = 0; i < n; ++i) {
    const DecodeItem& it = items[i];
    check_slot(it.slot);
    DS_CHECK(slot_len_[it.slot] > 0, "launch_greedy_decode: slot ", it.slot,
             " holds no tokens (run its prompt with step() first)");
    toks[i] = it.feed_row >= 0 ? 0 : it.token;  // fed rows: overwritten on the device
    work[i].slot = it.slot;
    work[i].tokens = std::span<const int32_t>(&toks[i], 1);
    work[i].greedy = true;
  }
  PipeStep pipe;
  pipe.buf = pipe_next_;
  pipe.items = items;
  std::vector<float> no_logits;
  std::vector<int32_t> no_tokens;
  run_step(work, no_logits, &no_tokens, &pipe);  // validates the rest; throws before any change
  pipe_q_.push_back({pipe.buf, n});
  pipe_next_ ^= 1;
  last_launch_rows_ = n;
}

void CudaBackend::collect_greedy_decode(std::vector<int32_t>& tokens) {
  DS_CHECK(!pipe_q_.empty(), "collect_greedy_decode: no launched step to collect");
  const PipeLaunch p = pipe_q_.front();
  pipe_q_.pop_front();
  const auto t0 = std::chrono::steady_clock::now();
  DS_CUDA_CHECK(cudaEventSynchronize(pipe_ev_[p.buf]));  // also surfaces asynchronous errors
  timing_.collect_wait_us = us_between(t0, std::chrono::steady_clock::now());
  tokens.assign(pipe_htok_[p.buf], pipe_htok_[p.buf] + p.rows);
}

// Replays the graph of the last decode step n times back to back between two events (no host
// work in between) and returns the mean ms per replay: the step's pure device time. It re-runs
// the same step on the slots' state (their GDN state advances n more times): a measuring tool.
double CudaBackend::replay_last_graph(int n) {
  DS_CHECK(last_exec_ != nullptr, "replay_last_graph: no decode graph ran yet");
  DS_CHECK(n >= 1, "replay_last_graph: n must be >= 1");
  DS_CHECK(pipe_q_.empty(), "replay_last_graph: launched decode steps not collected");
  last_launch_rows_ = -1;  // the replays overwrite the argmax buffer: nothing to feed from
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  DS_CUDA_CHECK(cudaEventCreate(&e0));
  DS_CUDA_CHECK(cudaEventCreate(&e1));
  DS_CUDA_CHECK(cudaEventRecord(e0, stream_));
  for (int i = 0; i < n; ++i) DS_CUDA_CHECK(cudaGraphLaunch(last_exec_, stream_));
  DS_CUDA_CHECK(cudaEventRecord(e1, stream_));
  DS_CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  DS_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms / n;
}

void CudaBackend::run_step(std::span<const SeqWork> work, std::vector<float>& logits,
                           std::vector<int32_t>* tokens, const PipeStep* pipe) {
  timing_ = CudaStepTiming{};
  const auto t_enter = std::chrono::steady_clock::now();
  if (!pipe) {
    DS_CHECK(pipe_q_.empty(), "step: ", pipe_q_.size(),
             " launched decode step(s) not collected (collect_greedy_decode first)");
    last_launch_rows_ = -1;  // the argmax buffer is this step's now: nothing to feed from
  }
  // Validate everything before touching any state.
  std::vector<char> seen(n_slots_, 0);
  int64_t need_blocks = 0, total_rows = 0, total_scores = 0;
  std::vector<int64_t> row_base(work.size());
  score_base_.assign(work.size(), -1);
  for (size_t i = 0; i < work.size(); ++i) {
    const SeqWork& w = work[i];
    check_slot(w.slot);
    DS_CHECK(!seen[w.slot], "step: slot ", w.slot, " appears twice in one step");
    seen[w.slot] = 1;
    DS_CHECK(!w.tokens.empty(), "step: empty token list for slot ", w.slot);
    for (int32_t t : w.tokens)
      DS_CHECK(t >= 0 && t < cfg_.vocab_size, "step: token id ", t, " out of range [0, ",
               cfg_.vocab_size, ") for slot ", w.slot);
    const int64_t len = int64_t(slot_len_[w.slot]) + int64_t(w.tokens.size());
    DS_CHECK(len <= layout_.max_seq_len, "step: slot ", w.slot, " would hold ", len,
             " tokens, more than the engine's max_seq_len ", layout_.max_seq_len);
    if (layout_.kv_block_bytes > 0)
      need_blocks += std::max<int64_t>(
          0, blocks_for(static_cast<int>(len)) - int64_t(slot_blocks_[w.slot].size()));
    if (w.score_top >= 0) {
      DS_CHECK(tokens && scores_out_, "step: scored rows (score_top) need step_greedy");
      DS_CHECK(!w.all_logits, "step: an item cannot both score its rows and return them");
      DS_CHECK(w.score_top <= cuda::kMaxScoreTop, "step: score_top ", w.score_top,
               " is more than ", cuda::kMaxScoreTop);
      DS_CHECK(w.score_next < cfg_.vocab_size, "step: score_next ", w.score_next,
               " out of range [0, ", cfg_.vocab_size, ")");
      score_base_[i] = total_scores;
      total_scores += int64_t(w.tokens.size()) - 1 + (w.score_next >= 0);
    }
    if (tokens && w.greedy && !w.all_logits) {
      row_base[i] = -1;  // the token only
    } else if (w.score_top >= 0 && w.score_next >= 0) {
      row_base[i] = -1;  // every row scored: no logits row (and no token)
    } else {
      row_base[i] = total_rows;
      total_rows += w.all_logits ? int64_t(w.tokens.size()) : 1;
    }
  }
  DS_CHECK(need_blocks <= static_cast<int64_t>(free_blocks_.size()), "step: the KV pool is full (",
           need_blocks, " blocks of ", page_size_, " tokens needed, ", free_blocks_.size(),
           " free of ", layout_.n_kv_blocks, ")");
  // Every row is written below: no clearing (1 MB per row at a 248K vocabulary).
  logits.resize(static_cast<size_t>(total_rows) * cfg_.vocab_size);
  if (tokens) tokens->assign(work.size(), -1);
  if (scores_out_) {
    scores_out_->assign(static_cast<size_t>(total_scores), RowScore{});
    if (total_scores > 0 && !hscore_out_) {  // first use: the scoring buffers
      // (one at a time, each kept once made: a failed allocation throws, and the next step
      // makes only what is still missing)
      const size_t rows_bytes = size_t(2 * eopt_.logits_rows) * sizeof(int32_t);
      const size_t out_bytes = size_t(eopt_.logits_rows) *
                               cuda::score_stride(cuda::kMaxScoreTop) * sizeof(uint32_t);
      if (!dscore_rows_) DS_CUDA_CHECK(cudaMalloc(&dscore_rows_, rows_bytes));
      if (!dscore_out_) DS_CUDA_CHECK(cudaMalloc(&dscore_out_, out_bytes));
      if (!hscore_rows_) DS_CUDA_CHECK(cudaMallocHost(&hscore_rows_, rows_bytes));
      DS_CUDA_CHECK(cudaMallocHost(&hscore_out_, out_bytes));
    }
  }

  // Chunked execution: each forward takes at most chunk_size tokens in all.
  std::vector<int> done(work.size(), 0);
  for (;;) {
    std::vector<Piece> pieces;
    int budget = chunk_size_;
    for (size_t i = 0; i < work.size() && budget > 0; ++i) {
      const int left = static_cast<int>(work[i].tokens.size()) - done[i];
      if (left <= 0) continue;
      const int n = std::min(left, budget);
      pieces.push_back({static_cast<int>(i), work[i].slot, done[i], n, slot_len_[work[i].slot]});
      budget -= n;
    }
    if (pieces.empty()) break;
    if (pipe) DS_ASSERT(pieces.size() == work.size());  // n <= chunk_size: one forward
    timing_.validate_us = us_between(t_enter, std::chrono::steady_clock::now());
    forward(work, pieces, row_base, logits, tokens, pipe);
    for (const Piece& p : pieces) done[p.item] += p.n;
  }
}

CudaBackend::DecodeKvPlan CudaBackend::decode_kv_plan(int n_seqs, int max_kv_len) const {
  // The grid is sized for the bucket's top (splits past a sequence's kv_len write empty
  // partials) and the chunk for its bottom, so a step anywhere in the bucket fills the GPU.
  DecodeKvPlan p;
  p.bucket = 64;
  while (p.bucket < max_kv_len) p.bucket *= 2;
  const int lo = std::max(64, p.bucket / 2);
  p.kv_chunk =
      cuda::attention_decode_kv_chunk(n_seqs, cfg_.n_kv_heads, lo, n_sms_, kMaxDecodeSplits);
  p.n_splits = (p.bucket + p.kv_chunk - 1) / p.kv_chunk;
  DS_CHECK(p.n_splits <= kMaxGraphSplits, "cuda engine: decode plan of ", p.n_splits,
           " splits for ", max_kv_len, " tokens exceeds the workspace (", kMaxGraphSplits, ")");
  return p;
}

CudaBackend::StepMeta CudaBackend::meta_layout(int32_t* base, int T, int S) const {
  const int MB = layout_.max_blocks_per_seq;
  StepMeta m;
  m.tokens = base;
  m.positions = base + T;
  m.slot_map = base + 2 * T;
  m.gather = base + 3 * T;
  m.q_start = base + 4 * T;
  m.q_len = m.q_start + S;
  m.kv_len = m.q_len + S;
  m.seq_pos = m.kv_len + S;
  m.slot_ids = m.seq_pos + S;
  m.cu = m.slot_ids + S;    // [S + 1]
  m.cu_p = m.cu + S + 1;    // [S_p + 1] offsets of the prompt pieces, from their first token
  m.btab = m.cu_p + S + 1;  // [S, MB]
  m.n_ints = 4 * size_t(T) + 7 * size_t(S) + 2 + size_t(S) * MB;
  return m;
}

void CudaBackend::forward(std::span<const SeqWork> work, const std::vector<Piece>& pieces_in,
                          const std::vector<int64_t>& row_base, std::vector<float>& logits,
                          std::vector<int32_t>* tokens, const PipeStep* pipe) {
  const auto t_fwd = std::chrono::steady_clock::now();
  const ModelConfig& c = cfg_;
  // Decode pieces (one token of a running sequence) first: they take the decode kernels, the
  // rest (prompt chunks) the prompt kernels, in the same forward.
  std::vector<Piece> pieces = pieces_in;
  auto is_decode = [](const Piece& p) { return p.n == 1 && p.pos0 > 0; };
  std::stable_partition(pieces.begin(), pieces.end(), is_decode);
  FwdPlan f;
  f.S = static_cast<int>(pieces.size());
  for (const Piece& p : pieces) {
    f.T += p.n;
    f.max_q = std::max(f.max_q, p.n);
    f.max_kv = std::max(f.max_kv, p.pos0 + p.n);
    if (is_decode(p)) {
      ++f.S_d;
      f.max_kv_d = std::max(f.max_kv_d, p.pos0 + 1);
    } else {
      f.max_q_p = std::max(f.max_q_p, p.n);
      f.max_kv_p = std::max(f.max_kv_p, p.pos0 + p.n);
    }
  }
  f.S_p = f.S - f.S_d;
  const int T = f.T, S = f.S;
  // KV blocks for the new tokens (validated in step()).
  if (layout_.kv_block_bytes > 0) {
    for (const Piece& p : pieces) {
      auto& blocks = slot_blocks_[p.slot];
      while (static_cast<int>(blocks.size()) < blocks_for(p.pos0 + p.n)) {
        blocks.push_back(free_blocks_.back());
        free_blocks_.pop_back();
      }
    }
  }

  // Step metadata, one host->device copy. The layout depends on (T, S) only, so a graph captured
  // for a decode batch of S finds its arrays at the same device addresses on every replay.
  const int MB = layout_.max_blocks_per_seq;
  const StepMeta h = meta_layout(pipe ? pipe_hmeta_[pipe->buf] : hmeta_, T, S);
  f.d = meta_layout(dmeta_, T, S);
  std::vector<int64_t> out_row;  // per gathered hidden row: its logits row, or -1 - item (token)
  // Scored rows: out_row kScoredRow, and their RowScore index, target and top count here.
  struct ScoreRef {
    int64_t out;
    int32_t target;
    int top;
  };
  std::vector<ScoreRef> score_ref;
  int t = 0;
  for (int i = 0; i < S; ++i) {
    const Piece& p = pieces[i];
    const SeqWork& w = work[p.item];
    h.q_start[i] = t;
    h.cu[i] = t;
    h.q_len[i] = p.n;
    h.kv_len[i] = p.pos0 + p.n;
    h.seq_pos[i] = p.pos0;
    h.slot_ids[i] = p.slot;
    const auto& blocks = slot_blocks_[p.slot];
    for (int b = 0; b < MB; ++b)
      h.btab[i * MB + b] = b < static_cast<int>(blocks.size()) ? blocks[b] : 0;
    for (int j = 0; j < p.n; ++j, ++t) {
      const int pos = p.pos0 + j;
      h.tokens[t] = w.tokens[p.offset + j];
      h.positions[t] = pos;
      h.slot_map[t] = layout_.kv_block_bytes > 0
                          ? blocks[pos / page_size_] * page_size_ + pos % page_size_
                          : -1;
      const bool last_of_item = p.offset + j == static_cast<int>(w.tokens.size()) - 1;
      const bool scored = w.score_top >= 0 && (!last_of_item || w.score_next >= 0);
      if (w.all_logits) {
        h.gather[f.n_gather++] = t;
        out_row.push_back(row_base[p.item] + p.offset + j);
      } else if (scored) {
        h.gather[f.n_gather++] = t;
        out_row.push_back(kScoredRow);
        score_ref.resize(out_row.size(), ScoreRef{-1, 0, 0});
        score_ref.back() = {score_base_[p.item] + p.offset + j,
                            last_of_item ? w.score_next : w.tokens[p.offset + j + 1], w.score_top};
      } else if (last_of_item) {
        h.gather[f.n_gather++] = t;
        out_row.push_back(row_base[p.item] >= 0 ? row_base[p.item] : -1 - int64_t(p.item));
        if (row_base[p.item] < 0) f.argmax = true;
      }
    }
  }
  h.cu[S] = T;
  for (int i = 0; i <= f.S_p; ++i) h.cu_p[i] = h.cu[f.S_d + i] - f.S_d;  // decode pieces: 1 token
  // Pipelined: the feed rows ride behind the metadata (the buffers hold a prompt chunk's layout,
  // far more than S more ints) and a tiny kernel copies the fed argmax ids into the tokens.
  size_t n_copy = h.n_ints;
  bool feed = false;
  if (pipe) {
    DS_ASSERT(f.S_d == S && T == S && h.n_ints + S <= meta_ints_);
    for (int i = 0; i < S; ++i) {
      const int fr = pipe->items[pieces[i].item].feed_row;
      pipe_hmeta_[pipe->buf][h.n_ints + i] = fr;
      feed |= fr >= 0;
    }
    if (feed) n_copy += S;
  }
  const auto t_meta = std::chrono::steady_clock::now();
  DS_CUDA_CHECK(
      cudaMemcpyAsync(dmeta_, h.tokens, n_copy * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  if (feed) {
    feed_tokens_kernel<<<(S + 255) / 256, 256, 0, stream_>>>(dmeta_ + h.n_ints, dtok_, f.d.tokens,
                                                             S);
    DS_CUDA_CHECK(cudaGetLastError());
  }

  // Host decisions for the kernels (all before any launch, so a graph can replay them).
  const int group = c.n_heads / std::max(1, c.n_kv_heads);
  if (rope_warp_ok_) {
    const std::string& rope_v =
        dispatch_.select(KernelFamily::kRopeKv, dispatch_.key(attn_.head_dim, attn_.rotary_dim, f.T))
            .name;
    if (rope_v == "warp_per_head") f.rope_kernel = cuda::RopeKvKernel::kAuto;
    if (rope_v == "token_table") f.rope_kernel = cuda::RopeKvKernel::kTokenTable;
  }
  if (f.S_d > 0) {
    f.kv = decode_kv_plan(f.S_d, f.max_kv_d);
    const std::string& attn_v =
        dispatch_.select(KernelFamily::kAttnDecode,
                         dispatch_.key(c.head_dim, group, f.S_d, f.kv.bucket))
            .name;
    f.attn_split_kv = attn_v == "split_kv_mma" || attn_v == "split_kv";
    // kAuto: the tensor-core kernel when the launch's alignment checks pass, else SIMT.
    f.attn_decode_kernel =
        attn_v == "split_kv_mma" ? cuda::AttnDecodeKernel::kAuto : cuda::AttnDecodeKernel::kSimt;
    // $DS_ATTN_DECODE (attention_decode.h): pdl (default), pdl_early, pdl_rope, pdl_cluster,
    // adaptive, planned.
    if (attn_v == "split_kv_mma") f.attn_decode_mode = cuda::attention_decode_mode();
    // rope_kv folded into the adaptive split kernel: decode-only forwards whose rope_kv would be
    // the warp-per-head kernel (the fused code is its arithmetic), on the adaptive modes.
    const cuda::AttnDecodeMode m = f.attn_decode_mode;
    f.rope_fused = rope_fused_ && f.S_p == 0 && attn_v == "split_kv_mma" &&
                   f.rope_kernel == cuda::RopeKvKernel::kAuto &&
                   (m == cuda::AttnDecodeMode::kPdl || m == cuda::AttnDecodeMode::kPdlEarly ||
                    m == cuda::AttnDecodeMode::kAdaptive || m == cuda::AttnDecodeMode::kPdlCluster);
    const std::string& gdn_v =
        dispatch_.select(KernelFamily::kGdnDecode, dispatch_.key(c.d_k, c.d_v, f.S_d)).name;
    // fused_stream / fused_cluster8 / fused: the fused kernel; prefill_path: the prompt kernels.
    f.gdn_fused_decode = cuda::gdn_decode_kernel_for_variant(gdn_v, &f.gdn_decode_kernel);
  }

  // The final norm in lm_head's prologue: decode-only forwards (each row gathered is its own
  // token row, in order) within the fused norms' rows, lm_head on the bulk GEMV in one call.
  f.head_norm = head_norm_ && f.S_d == S && f.n_gather == S &&
                S <= eopt_.logits_rows && f.T <= fused_norm_rows_ &&
                gemv_norm_fits(w_.lm_head, S, cfg_.vocab_size, cfg_.d_model);

  // A decode-only forward replays its graph (or captures it); everything else runs eagerly.
  const auto t_plan = std::chrono::steady_clock::now();
  const bool graphed = f.S_d == S && f.n_gather == S && S <= eopt_.logits_rows &&
                       (f.attn_split_kv || c.n_full_layers() == 0) &&
                       (f.gdn_fused_decode || c.n_linear_layers() == 0) && run_graph(f);
  if (!graphed) enqueue_layers(f);
  const auto t_launched = std::chrono::steady_clock::now();
  timing_.graphed = graphed;
  timing_.meta_us = us_between(t_fwd, t_meta);
  timing_.copy_plan_us = us_between(t_meta, t_plan);
  timing_.launch_us = us_between(t_plan, t_launched);

  if (pipe) {  // tokens to the buffer's pinned mirror; collect_greedy_decode waits for them
    if (!graphed) enqueue_head(f, 0, f.n_gather);
    DS_CUDA_CHECK(cudaMemcpyAsync(pipe_htok_[pipe->buf], dtok_, size_t(S) * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, stream_));
    DS_CUDA_CHECK(cudaEventRecord(pipe_ev_[pipe->buf], stream_));
    for (const Piece& p : pieces) slot_len_[p.slot] = p.pos0 + p.n;
    timing_.tail_us = us_between(t_launched, std::chrono::steady_clock::now());
    return;
  }

  // ---- Outputs: logits rows to the host, greedy rows as token ids ----
  const int V = c.vocab_size;
  for (int r0 = 0; r0 < f.n_gather; r0 += eopt_.logits_rows) {
    const int r = std::min(eopt_.logits_rows, f.n_gather - r0);
    if (!graphed) enqueue_head(f, r0, r);
    // Logits rows in runs that are contiguous on both sides, straight into the output.
    for (int i = 0; i < r;) {
      const int64_t dst = out_row[r0 + i];
      if (dst < 0) {
        ++i;
        continue;
      }
      int n = 1;
      while (i + n < r && out_row[r0 + i + n] == dst + n) ++n;
      DS_CUDA_CHECK(cudaMemcpyAsync(logits.data() + dst * V, dlogits_ + size_t(i) * V,
                                    size_t(n) * V * sizeof(float), cudaMemcpyDeviceToHost,
                                    stream_));
      i += n;
    }
    if (f.argmax)
      DS_CUDA_CHECK(cudaMemcpyAsync(htok_, dtok_, size_t(r) * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream_));
    // Scored rows: their logprob, rank and top ids on the device, a few words each to the host.
    int n_scored = 0, top = 0;
    for (int i = 0; i < r; ++i) n_scored += out_row[r0 + i] == kScoredRow;
    for (int i = 0, k = 0; i < r; ++i) {  // [rows | targets], n_scored each
      if (out_row[r0 + i] != kScoredRow) continue;
      hscore_rows_[k] = i;
      hscore_rows_[n_scored + k++] = score_ref[r0 + i].target;
      top = std::max(top, score_ref[r0 + i].top);
    }
    const int stride = cuda::score_stride(top);
    if (n_scored > 0) {
      DS_CUDA_CHECK(cudaMemcpyAsync(dscore_rows_, hscore_rows_,
                                    size_t(2 * n_scored) * sizeof(int32_t),
                                    cudaMemcpyHostToDevice, stream_));
      cuda::launch_score_rows(dlogits_, V, dscore_rows_, dscore_rows_ + n_scored, n_scored, top,
                              dscore_out_, stream_);
      DS_CUDA_CHECK(cudaMemcpyAsync(hscore_out_, dscore_out_,
                                    size_t(n_scored) * stride * sizeof(uint32_t),
                                    cudaMemcpyDeviceToHost, stream_));
    }
    const auto t_sync = std::chrono::steady_clock::now();
    DS_CUDA_CHECK(cudaStreamSynchronize(stream_));  // also surfaces asynchronous kernel errors
    timing_.sync_us += us_between(t_sync, std::chrono::steady_clock::now());
    if (f.argmax)
      for (int i = 0; i < r; ++i)
        if (out_row[r0 + i] < 0 && out_row[r0 + i] != kScoredRow)
          (*tokens)[-1 - out_row[r0 + i]] = htok_[i];
    for (int i = 0, k = 0; i < r; ++i) {
      if (out_row[r0 + i] != kScoredRow) continue;
      const ScoreRef& ref = score_ref[r0 + i];
      const uint32_t* o = hscore_out_ + size_t(k++) * stride;
      RowScore& rs = (*scores_out_)[static_cast<size_t>(ref.out)];
      rs.logprob = std::bit_cast<float>(o[0]);
      rs.rank = static_cast<int32_t>(o[1]);
      rs.top.resize(static_cast<size_t>(ref.top));
      for (int k2 = 0; k2 < ref.top; ++k2)
        rs.top[k2] = {static_cast<int32_t>(o[2 + 2 * k2]), std::bit_cast<float>(o[3 + 2 * k2])};
    }
  }
  DS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (const Piece& p : pieces) slot_len_[p.slot] = p.pos0 + p.n;
  timing_.tail_us = us_between(t_launched, std::chrono::steady_clock::now()) - timing_.sync_us;
}

// The layers of a forward, from the embedding to the final norm (with FwdPlan::head_norm, up to
// it: lm_head's prologue computes it from head_res_): every launch reads only `f` and fixed
// buffers, so the same sequence can be captured into a graph.
void CudaBackend::enqueue_layers(const FwdPlan& f) {
  const ModelConfig& c = cfg_;
  const int T = f.T, S = f.S, S_d = f.S_d, S_p = f.S_p;
  const int MB = layout_.max_blocks_per_seq;
  const StepMeta& d = f.d;
  cuda::AttnBatch ab;
  ab.n_seqs = S;
  ab.q_start = d.q_start;
  ab.q_len = d.q_len;
  ab.kv_len = d.kv_len;
  ab.block_table = d.btab;
  ab.block_table_stride = MB;
  ab.max_q_len = f.max_q;
  ab.max_kv_len = f.max_kv;
  // The decode pieces [0, S_d) and the prompt pieces [S_d, S) as separate batches.
  cuda::AttnBatch ab_d = ab, ab_p = ab;
  ab_d.n_seqs = S_d;
  ab_d.max_q_len = 1;
  ab_d.max_kv_len = S_d > 0 ? f.kv.bucket : 0;  // the grid bound of the decode plan
  ab_p.n_seqs = S_p;
  ab_p.q_start += S_d;
  ab_p.q_len += S_d;
  ab_p.kv_len += S_d;
  ab_p.block_table += size_t(S_d) * MB;
  ab_p.max_q_len = f.max_q_p;
  ab_p.max_kv_len = f.max_kv_p;
  cuda::AttnGate gate;
  if (attn_.gated) {
    gate.ptr = proj_ + c.head_dim;
    gate.token_stride = attn_.qkv_dim();
    gate.head_stride = 2 * c.head_dim;
  }
  const float eps = c.rms_norm_eps;
  const int dm = c.d_model;
  auto gemm = [&](const bf16* x, const bf16* wt, bf16* y, int n, int k) {
    gemm_->run(x, wt, y, T, n, k, cuda::GemmOut::kBF16, stream_);
  };
  // The residual stream h lives in `res`. Where a bulk GEMV takes the norm into its prologue
  // (decode batches, gemv_bulk_norm.h) the GEMV writes h + delta to the other buffer of the h_ /
  // h2_ pair (its blocks still read `res`) and `res` flips; elsewhere add_rmsnorm updates `res` in
  // place and writes xn_.
  bf16* res = h_;
  const bool fuse = T <= fused_norm_rows_;  // h2_ holds kGemvNormMaxM >= fused_norm_rows_ rows
  // Prompt forwards: gdn_out / attn_o (and down with kAll) add their product into `res`
  // (cuBLASLt beta = 1) and the norm after each reads `res` alone (delta null): see
  // CudaEngineOptions::prefill_residual_fold. Decode-only forwards (the graphs) never fold.
  const bool fold_ok = !fuse && T >= kFoldMinRows && S_p > 0;
  const bool fold_mixer = fold_ok && fold_ != PrefillFold::kOff;
  const bool fold_down = fold_ok && fold_ == PrefillFold::kAll;
  bf16* const mixer_out = fold_mixer ? nullptr : delta_;  // the delta the post norm adds
  bf16* const mlp_out = fold_down ? nullptr : delta_;     // the delta the next input norm adds
  auto gemm_out = [&](const bf16* x, const bf16* wt, int k, bool fold, bool pdl = true) {
    if (fold)
      gemm_->run(x, wt, res, T, dm, k, cuda::GemmOut::kBF16, stream_, true);
    else
      gemm_->run(x, wt, delta_, T, dm, k, cuda::GemmOut::kBF16, stream_, false, pdl);
  };
  auto norm_in = [&](const bf16* delta, const bf16* w) {
    cuda::GemvNormIn nin;
    nin.residual = res;
    nin.delta = delta;
    nin.weight = w;
    nin.eps = eps;
    nin.weight_offset = 1.f;
    nin.residual_out = delta ? (res == h_ ? h2_ : h_) : nullptr;
    nin.weight_early = cuda::gemv_norm_weight_early();
    return nin;
  };
  auto flip = [&](const cuda::GemvNormIn& nin) {
    if (nin.delta) res = nin.residual_out;
  };
  // y = norm(h + delta) wt^T (h += delta); `next`: the weights of the GEMV after the mixer
  // kernels, prefetched into L2 as this one ends (fused decode GEMVs only).
  auto norm_gemm = [&](const bf16* delta, const bf16* nw, const bf16* wt, bf16* y, int n,
                       const cuda::GemvL2Next& next) {
    const cuda::GemvNormIn nin = norm_in(delta, nw);
    if (fuse && gemv_norm(nin, wt, y, T, n, dm, next)) return flip(nin);
    cuda::launch_add_rmsnorm(res, delta, nw, T, dm, eps, 1.f, xn_, stream_);
    gemm(xn_, wt, y, n, dm);
  };

  cuda::launch_gather_rows(w_.embed, d.tokens, T, dm, h_, stream_);
  bool in_proj_done = false;  // the previous layer's fused MLP (form 3) ran this in-projection
  for (int il = 0; il < c.n_layers; ++il) {
    const DevLayer& L = w_.layers[il];
    // h += previous layer's MLP output; input_layernorm(h) -> the mixer's in-projection
    const bf16* mlp_delta = il == 0 ? nullptr : mlp_out;
    // $DS_MLP_FUSED: 1 the MLP, 2 also the mixer's out-projection, 3 also the next layer's input
    // norm and in-projection, in one kernel (batch 1).
    const bool linear = L.type == LayerType::kLinear;
    const int mixer_k = linear ? c.gdn_z_dim() : c.attn_out_dim();
    const int mlp_mode = fuse && !fold_down && !fold_mixer ? mlp_fusion(T, mixer_k, il) : 0;
    const bool skip_in_proj = in_proj_done;
    in_proj_done = false;
    if (L.type == LayerType::kLinear) {
      // $DS_GDN_EARLY (CudaEngineOptions::gdn_early): at batch 1 the gdn_in GEMV sweeps its rows
      // from b / a on and then qkv, z last, and raises gdn_ready_[il] once qkv, b and a are
      // stored; gdn_decode runs on that signal and waits for the GEMV's end only for z.
      cuda::GdnDecodeEarly early;
      bool in_proj_ran = skip_in_proj;
      const cuda::GemvL2Next in_next =
          fuse ? l2_next(L.gdn_out, T, dm, c.gdn_z_dim()) : cuda::GemvL2Next{};
      const int n_in = c.gdn_in_dim();
      if (!skip_in_proj && gdn_early_ && f.gdn_fused_decode && T == 1 && S_d == 1 && fuse &&
          in_next.rows == 0 &&
          cuda::gdn_decode_early_supported(
              gdn_, cuda::gdn_decode_resolve(gdn_, gdn_pool(L.ll), S_d, f.gdn_decode_kernel)) &&
          cuda::gemv_bulk_signal_supported(T, cuda::gemv_bulk_config(T, n_in, dm))) {
        const int qkv = gdn_.qkv_dim(), first = qkv + gdn_.z_dim();
        cuda::GemvSignal sig;
        sig.counter = gdn_ready_ + il;
        sig.first_row = first;              // b, a
        sig.rows = (n_in - first) + qkv;  // then q, k, v
        const cuda::GemvNormIn nin = norm_in(mlp_delta, L.input_norm);
        // false (nothing launched) where the bulk GEMV is not the pick: the plain path below
        if (gemv_norm(nin, L.gdn_in, proj_, T, n_in, dm, in_next, cuda::GemmOut::kBF16, sig)) {
          flip(nin);
          in_proj_ran = true;
          early.ready = gdn_ready_ + il;
          early.target = unsigned(cuda::gemv_bulk_signal_count(
              T, n_in, dm, cuda::gemv_bulk_config(T, n_in, dm), n_sms_));
          early.late = gdn_ready_ + c.n_layers;
          ++gdn_early_enqueued_;
        }
      }
      if (!in_proj_ran)
        norm_gemm(mlp_delta, L.input_norm, L.gdn_in, proj_, n_in, in_next);  // [qkv | z | b | a]
      cuda::GdnLayerWeights gw{L.gdn_conv, L.A_log, L.dt_bias, L.gdn_norm};
      if (f.gdn_fused_decode) {  // decode rows [0, S_d), prompt rows after them
        // PDL: the state / conv taps load while the gdn_in GEMV runs ($DS_GDN_DECODE_PDL)
        cuda::launch_gdn_decode(gdn_, gw, gdn_pool(L.ll), proj_, d.seq_pos, d.slot_ids, S_d, mix_,
                                stream_, f.gdn_decode_kernel, cuda::gdn_decode_pdl_for(S_d),
                                early);
        if (S_p > 0)
          cuda::launch_gdn_prefill(gdn_, gw, gdn_pool(L.ll), proj_ + size_t(S_d) * c.gdn_in_dim(),
                                   d.cu_p, d.seq_pos + S_d, d.slot_ids + S_d, S_p, T - S_d, gdn_ws_,
                                   gdn_ws_bytes_, mix_ + size_t(S_d) * c.gdn_z_dim(), stream_,
                                   &dispatch_);
      } else {
        cuda::launch_gdn_prefill(gdn_, gw, gdn_pool(L.ll), proj_, d.cu, d.seq_pos, d.slot_ids, S, T,
                                 gdn_ws_, gdn_ws_bytes_, mix_, stream_, &dispatch_);
      }
      if (mlp_mode < 2) gemm_out(mix_, L.gdn_out, c.gdn_z_dim(), fold_mixer);
    } else {
      if (!skip_in_proj)
        norm_gemm(mlp_delta, L.input_norm, L.attn_qkv, proj_, attn_.qkv_dim(),  // [q+gate | k | v]
                  fuse ? l2_next(L.attn_o, T, dm, c.attn_out_dim()) : cuda::GemvL2Next{});
      const int64_t layer_elems =
          layout_.n_kv_blocks * c.n_kv_heads * page_size_ * int64_t(c.head_dim);
      bf16* kc = kv_pool_ + (2 * int64_t(L.fl)) * layer_elems;
      bf16* vc = kc + layer_elems;
      // The fused rope reads 16-byte rows of the norm weights (the engine's weights are aligned;
      // checked per layer so that any other layout takes rope_kv).
      const bool rope_fused = f.rope_fused && reinterpret_cast<uintptr_t>(L.q_norm) % 16 == 0 &&
                              reinterpret_cast<uintptr_t>(L.k_norm) % 16 == 0;
      if (!rope_fused)
        cuda::launch_qk_norm_rope_kv(attn_, proj_, L.q_norm, L.k_norm, d.positions, d.slot_map, T,
                                     q_, kc, vc, stream_, f.rope_kernel,
                                     f.attn_decode_mode == cuda::AttnDecodeMode::kPdlRope);
      if (f.attn_split_kv) {  // rows are absolute (q_start), so the two batches share q_ / mix_
        if (f.attn_decode_mode != cuda::AttnDecodeMode::kPlanned) {
          // Splits of >= 64 keys sized on the device per sequence, one wave of split blocks; with
          // PDL their cached K/V loads overlap rope_kv (rope_kv writes only q and the new rows).
          cuda::AttnDecodeLaunch how;
          how.which = cuda::AttnDecodeKernel::kMma;
          how.split = cuda::AttnDecodeSplit::kAdaptive;
          how.pdl = f.attn_decode_mode != cuda::AttnDecodeMode::kAdaptive;
          how.early_dependents = f.attn_decode_mode == cuda::AttnDecodeMode::kPdlEarly;
          // pdl_cluster: 16 splits per (kv head, sequence) in one cluster, merged in distributed
          // shared memory (no merge kernel).
          how.cluster = f.attn_decode_mode == cuda::AttnDecodeMode::kPdlCluster;
          if (rope_fused)  // q from the projection row, the newest K/V row written by the kernel
            how.rope = {proj_, L.q_norm, L.k_norm, d.positions, d.slot_map, kc, vc};
          cuda::launch_attention_decode(
              attn_, ab_d, q_, kc, vc, gate, attn_min_chunk_,
              how.cluster ? cuda::kAttnDecodeClusterSplits
                          : cuda::attention_decode_adaptive_splits(S_d, c.n_kv_heads, n_sms_,
                                                                   attn_max_splits_),
              attn_ws_, mix_, stream_, how);
        } else {
          cuda::launch_attention_decode(attn_, ab_d, q_, kc, vc, gate, f.kv.kv_chunk,
                                        f.kv.n_splits, attn_ws_, mix_, stream_,
                                        f.attn_decode_kernel);
        }
        if (S_p > 0)
          cuda::launch_attention_prefill(attn_, ab_p, q_, kc, vc, gate, mix_, stream_, &dispatch_);
      } else {
        cuda::launch_attention_prefill(attn_, ab, q_, kc, vc, gate, mix_, stream_, &dispatch_);
      }
      // $DS_ATTN_O_PDL=0: attn_o launched plainly after the merge (session 33's probe, not yet
      // measured: with every decode GEMV off PDL the merge's advance was 3.6 us, 7.7 with PDL, on
      // an H200; under PDL attn_o's ring fill runs beside the merge).
      if (mlp_mode < 2) gemm_out(mix_, L.attn_o, c.attn_out_dim(), fold_mixer, attn_o_pdl_);
    }
    // h += mixer output; post_attention_layernorm(h); MLP. gate_up with SiLU-and-mul in its
    // epilogue where the registry picks gemm.gemv_bulk_silu (decode, bit-identical to the two
    // launches below; with the norm in its prologue when fused), else GEMM then silu_mul.
    const cuda::GemvNormIn post = norm_in(mixer_out, L.post_norm);
    // $DS_MLP_FUSED: at batch 1 the projections in one kernel (the same bits as the launches
    // below, with mode 2 as the mixer's gemm_out above, with mode 3 as the next layer's norm_gemm).
    if (mlp_mode > 0) {
      cuda::GemvMlpMixer mixer;
      if (mlp_mode >= 2) {
        mixer.x0 = mix_;
        mixer.w0 = linear ? L.gdn_out : L.attn_o;
        mixer.y0 = delta_;
        mixer.k0 = mixer_k;
      }
      cuda::GemvMlpNext next;
      if (mlp_mode == 3) {  // the norm after this MLP: res is then post's residual_out
        const DevLayer& N = w_.layers[il + 1];
        const bool n_linear = N.type == LayerType::kLinear;
        const bf16* after = post.residual_out;
        next.norm = post;
        next.norm.residual = after;
        next.norm.delta = delta_;  // this MLP's output
        next.norm.weight = N.input_norm;
        next.norm.residual_out = after == h_ ? h2_ : h_;
        next.w = n_linear ? N.gdn_in : N.attn_qkv;
        next.y = proj_;
        next.n = n_linear ? c.gdn_in_dim() : int(attn_.qkv_dim());
      }
      run_mlp_fused(post, mixer, next, L.gate_up, L.down, il);
      flip(post);
      if (mlp_mode == 3) {
        flip(next.norm);
        in_proj_done = true;
      }
      continue;
    }
    if (fuse && gate_up_silu_norm(post, L.gate_up, act_, T, c.d_ff, dm)) {
      flip(post);
    } else {
      cuda::launch_add_rmsnorm(res, mixer_out, L.post_norm, T, dm, eps, 1.f, xn_, stream_);
      if (!gemm_->run_gate_up_silu(xn_, L.gate_up, act_, T, c.d_ff, dm, stream_)) {
        gemm(xn_, L.gate_up, proj_, 2 * c.d_ff, dm);
        cuda::launch_silu_mul(proj_, T, c.d_ff, act_, stream_);
      }
    }
    gemm_out(act_, L.down, c.d_ff, fold_down);
  }
  if (f.head_norm) {  // lm_head's prologue computes the final norm (enqueue_head)
    head_res_ = res;
    return;
  }
  cuda::launch_add_rmsnorm(res, mlp_out, w_.final_norm, T, dm, eps, 1.f, xn_, stream_);
}

// The later GEMV (m rows, weight [n, k]) as GemmEngine would launch it: its grid, and the rows
// of each of its blocks that $DS_GEMV_L2_NEXT's budget allows (rows 0: off).
cuda::GemvL2Next CudaBackend::l2_next(const bf16* w, int m, int n, int k) {
  cuda::GemvL2Next nx;
  if (cuda::gemv_l2_next_mib() == 0) return nx;
  const std::string& v = gemm_->variant(m, n, k);
  int grid = n_sms_;  // cuBLASLt: any order; the bulk GEMVs: their grid
  if (v == "gemv_bulk" || v == "gemv_bulk_pdl") {
    const cuda::GemvBulkConfig cfg = cuda::gemv_bulk_config(m, n, k);
    grid = cuda::gemv_bulk_grid(n, cfg, n_sms_);
  }
  grid = std::min(grid, n);
  nx.w = w;
  nx.n = n;
  nx.k = k;
  nx.grid = grid;
  nx.rows = cuda::gemv_l2_next_rows(n, k, grid);
  return nx;
}

// The bulk GEMV with the add + RMSNorm in its prologue when the registry picks the bulk GEMV for
// (m, n, k) (what GemmEngine::run would launch, with the same config and PDL mode); false:
// nothing launched (the caller runs add_rmsnorm, then the GEMM).
// Whether the GEMV y[m, n] = x w^T run() would launch can take the norm before it into its
// prologue: run() picks the bulk GEMV and its config leaves room for the norm's warp sums.
bool CudaBackend::gemv_norm_fits(const bf16* w, int m, int n, int k) const {
  const std::string& v = gemm_->variant(m, n, k);
  return (v == "gemv_bulk" || v == "gemv_bulk_pdl") && m <= cuda::kGemvNormMaxM &&
         k <= cuda::kGemvNormMaxK && reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
         cuda::gemv_bulk_norm_fits(m, k, cuda::gemv_bulk_config(m, n, k));
}

bool CudaBackend::gemv_norm(const cuda::GemvNormIn& nin, const bf16* w, void* y, int m, int n,
                            int k, const cuda::GemvL2Next& next, cuda::GemmOut out,
                            const cuda::GemvSignal& sig) {
  if (!gemv_norm_fits(w, m, n, k)) return false;
  cuda::GemvBulkConfig cfg = cuda::gemv_bulk_config(m, n, k);
  cfg.pdl = cuda::gemv_pdl_mode() != cuda::GemvPdl::kOff;
  if (m <= cuda::kGemvAheadMaxM && out == cuda::GemmOut::kBF16 && next.rows == 0)
    cfg.l2_ahead = cuda::gemv_bulk_ahead_stages(gemm_->l2_ahead_kib(), k, cfg, false);
  cuda::launch_gemv_bulk_norm(nin, w, y, m, n, k, out, cfg, n_sms_, stream_, next, sig);
  return true;
}

// The same for gate_up + SiLU-and-mul (GemmEngine::run_gate_up_silu's guard and config).
bool CudaBackend::gate_up_silu_norm(const cuda::GemvNormIn& nin, const bf16* w, bf16* act, int m,
                                    int d_ff, int k) {
  if (dispatch_.select(KernelFamily::kGemm, dispatch_.key(m, 2 * int64_t(d_ff), k, 1)).name !=
          "gemv_bulk_silu" ||
      m > cuda::kGemvNormMaxM || k > cuda::kGemvNormMaxK ||
      reinterpret_cast<uintptr_t>(w) % 16 != 0)
    return false;
  cuda::GemvBulkConfig cfg = cuda::gemv_bulk_silu_config(m, d_ff, k);
  if (!cuda::gemv_bulk_norm_fits(m, k, cfg)) return false;
  cfg.pdl = cuda::gemv_pdl_mode() != cuda::GemvPdl::kOff;
  if (m <= cuda::kGemvAheadMaxM)
    cfg.l2_ahead = cuda::gemv_bulk_ahead_stages(gemm_->l2_ahead_kib(), k, cfg, true);
  cuda::launch_gemv_bulk_silu_norm(nin, w, act, m, d_ff, k, cfg, n_sms_, stream_);
  return true;
}

// Which fused MLP form a forward of m tokens takes for a layer whose mixer output is k0 wide: 0
// none (the separate launches), 1 the MLP (launch_gemv_mlp_norm), 2 the mixer's out-projection and
// the MLP. A form runs only where the kernels it fuses are what the engine would launch (the
// registry's picks at m = 1: gemv_bulk_silu with the norm, gemv_narrow, and gemv_bulk for the
// out-projection), so its bits are theirs.
int CudaBackend::mlp_fusion(int m, int k0, int layer) {
  if (mlp_fused_ == 0 || m != 1) return 0;
  const int d_ff = cfg_.d_ff, dm = cfg_.d_model;
  const DevLayer& L = w_.layers[layer];
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!aligned(L.gate_up) || !aligned(L.down)) return 0;  // the launch's requirement: fall back
  if (!cuda::gemv_mlp_norm_supports(m, d_ff, dm, dm, 0, n_sms_) ||
      dispatch_.select(KernelFamily::kGemm, dispatch_.key(m, 2 * int64_t(d_ff), dm, 1)).name !=
          "gemv_bulk_silu" ||
      gemm_->variant(m, dm, d_ff) != "gemv_narrow" ||
      !cuda::gemv_bulk_norm_fits(m, dm, cuda::gemv_bulk_silu_config(m, d_ff, dm)))
    return 0;
  if (mlp_fused_ < 2 || !cuda::gemv_mlp_norm_supports(m, d_ff, dm, dm, k0, n_sms_)) return 1;
  const std::string& v = gemm_->variant(m, dm, k0);
  if ((v != "gemv_bulk" && v != "gemv_bulk_pdl") ||
      !aligned(L.type == LayerType::kLinear ? L.gdn_out : L.attn_o))
    return 1;
  if (mlp_fused_ < 3 || layer + 1 >= cfg_.n_layers) return 2;
  // Form 3: the next layer's in-projection as norm_gemm would launch it (gemv_norm: the bulk
  // GEMV with the norm in its prologue).
  const DevLayer& N = w_.layers[layer + 1];
  const bool n_linear = N.type == LayerType::kLinear;
  const int n_in = n_linear ? cfg_.gdn_in_dim() : int(attn_.qkv_dim());
  const std::string& vn = gemm_->variant(m, n_in, dm);
  if ((vn != "gemv_bulk" && vn != "gemv_bulk_pdl") ||
      !cuda::gemv_bulk_norm_fits(m, dm, cuda::gemv_bulk_config(m, n_in, dm)) ||
      !cuda::gemv_mlp_norm_supports(m, d_ff, dm, dm, k0, n_sms_, n_in) ||
      reinterpret_cast<uintptr_t>(n_linear ? N.gdn_in : N.attn_qkv) % 16 != 0)
    return 2;
  return 3;
}

// The fused form mlp_fusion chose (mixer.w0 set: form 2). Writes act_ and delta_ (the MLP output;
// with form 2 first the mixer output, the norm's delta).
void CudaBackend::run_mlp_fused(const cuda::GemvNormIn& nin, const cuda::GemvMlpMixer& mixer,
                                const cuda::GemvMlpNext& next, const bf16* w_gate_up,
                                const bf16* w_down, int layer) {
  const int d_ff = cfg_.d_ff, dm = cfg_.d_model;
  cuda::launch_gemv_mlp_norm(nin, mixer, next, w_gate_up, act_, w_down, delta_, 1, d_ff, dm, dm,
                             cuda::gemv_pdl_mode() != cuda::GemvPdl::kOff, mlp_bar_ + 2 * layer,
                             n_sms_, stream_);
  ++mlp_fused_enqueued_[next.w ? 2 : mixer.w0 ? 1 : 0];
}

// lm_head on gathered rows [r0, r0 + r) into dlogits_ (fp32), and their argmax into dtok_ when
// the step has greedy rows.
void CudaBackend::enqueue_head(const FwdPlan& f, int r0, int r) {
  const int V = cfg_.vocab_size, dm = cfg_.d_model;
  bool fused_argmax = false;  // lm_head took the argmax into its epilogue
  if (f.head_norm) {  // one call on all rows (forward()'s plan), x = final_norm(h + delta)
    DS_CHECK(r0 == 0 && r == f.S, "cuda engine: lm_head with the final norm takes every row at "
             "once (rows ", r0, "..", r0 + r, " of ", f.S, ")");
    cuda::GemvNormIn nin;
    nin.residual = head_res_;
    nin.delta = delta_;  // the last MLP's output (decode forwards never fold it into h)
    nin.weight = w_.final_norm;
    nin.eps = cfg_.rms_norm_eps;
    nin.weight_offset = 1.f;
    nin.residual_out = head_res_ == h_ ? h2_ : h_;  // h + delta, which nothing reads after
    nin.weight_early = cuda::gemv_norm_weight_early();
    if (f.argmax && argmax_fused_) {
      cuda::GemvBulkConfig cfg = cuda::gemv_bulk_config(r, V, dm);
      cfg.pdl = cuda::gemv_pdl_mode() != cuda::GemvPdl::kOff;  // gemv_norm's config
      fused_argmax = cuda::gemv_bulk_argmax_supports(r, V, dm, cfg, true);
      if (fused_argmax)
        cuda::launch_gemv_bulk_argmax_norm(nin, w_.lm_head, dlogits_, dtok_, argmax_ws_, r, V, dm,
                                           cfg, n_sms_, stream_);
    }
    if (!fused_argmax)
      DS_CHECK(gemv_norm(nin, w_.lm_head, dlogits_, r, V, dm, {}, cuda::GemmOut::kF32),
               "cuda engine: lm_head with the final norm no longer fits the bulk GEMV");
    ++head_norm_enqueued_;
  } else {
    cuda::launch_gather_rows(xn_, f.d.gather + r0, r, dm, lrows_, stream_);
    // The argmax in lm_head's epilogue where the bulk GEMV takes lm_head (the same logits and
    // tokens as lm_head + the argmax kernel below).
    fused_argmax = f.argmax && argmax_fused_ &&
                   gemm_->run_head_argmax(lrows_, w_.lm_head, dlogits_, dtok_, argmax_ws_, r, V,
                                          dm, stream_);
    if (!fused_argmax)
      gemm_->run(lrows_, w_.lm_head, dlogits_, r, V, dm, cuda::GemmOut::kF32, stream_);
  }
  if (fused_argmax) {
    ++argmax_fused_enqueued_;
    return;
  }
  // The cluster argmax waits for lm_head under PDL (the bulk lm_head GEMV triggers its
  // dependents at its start, so the argmax blocks are resident when it ends).
  if (f.argmax)
    cuda::launch_argmax_rows(dlogits_, r, V, dtok_, stream_, cuda::argmax_kernel_default(),
                             cuda::gemv_pdl_mode() != cuda::GemvPdl::kOff);
}

// Replays (or captures, then replays) the graph of a decode-only forward: layers + lm_head (+
// argmax). False: run it eagerly (graphs off, first use of the key, or a failure just now).
bool CudaBackend::run_graph(const FwdPlan& f) {
  if (!graphs_on_) {
    ++gstats_.eager_decode;
    return false;
  }
  const GraphKey key{f.S, cfg_.n_full_layers() > 0 ? f.kv.bucket : 0, f.argmax};
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    if (warm_keys_.insert(key).second) {  // first use: eager, which loads every kernel
      ++gstats_.eager_decode;
      return false;
    }
    // Keep within the count and the memory kept for graphs: least recently used go first.
    while (!graphs_.empty() && (static_cast<int>(graphs_.size()) >= eopt_.max_cuda_graphs ||
                                gstats_.graph_bytes + kGraphBytesEstimate > layout_.graph_bytes)) {
      auto lru = std::min_element(graphs_.begin(), graphs_.end(), [](const auto& a, const auto& b) {
        return a.second.last_used < b.second.last_used;
      });
      destroy_graph(lru);
      ++gstats_.evictions;
    }
    if (eopt_.max_cuda_graphs < 1) {
      ++gstats_.eager_decode;
      return false;
    }
    size_t free0 = 0, free1 = 0, total = 0;
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    try {
      DS_CUDA_CHECK(cudaMemGetInfo(&free0, &total));
      DS_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      try {
        enqueue_layers(f);
        enqueue_head(f, 0, f.n_gather);
      } catch (...) {
        cudaStreamEndCapture(stream_, &g);  // leaves capture mode (the capture is invalid)
        if (g) cudaGraphDestroy(g);
        g = nullptr;
        throw;
      }
      DS_CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
      DS_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
      DS_CUDA_CHECK(cudaGraphDestroy(g));
      g = nullptr;
      DS_CUDA_CHECK(cudaGraphUpload(exec, stream_));
      DS_CUDA_CHECK(cudaStreamSynchronize(stream_));
      DS_CUDA_CHECK(cudaMemGetInfo(&free1, &total));
    } catch (const std::exception& e) {
      if (g) cudaGraphDestroy(g);
      if (exec) cudaGraphExecDestroy(exec);
      graph_failed("capture", e.what());
      return false;
    }
    GraphEntry entry;
    entry.exec = exec;
    entry.bytes = free0 > free1 ? static_cast<int64_t>(free0 - free1) : 0;
    gstats_.graph_bytes += entry.bytes;
    ++gstats_.captures;
    it = graphs_.emplace(key, entry).first;
  }
  it->second.last_used = ++graph_clock_;
  last_exec_ = it->second.exec;
  const cudaError_t err = cudaGraphLaunch(it->second.exec, stream_);
  if (err != cudaSuccess) {
    cudaGetLastError();
    graph_failed("launch", cudaGetErrorString(err));
    return false;
  }
  ++gstats_.replays;
  return true;
}

void CudaBackend::graph_failed(const char* what, const std::string& why) {
  cudaGetLastError();  // the capture's error is not sticky: clear it for the eager run
  ++gstats_.failures;
  ++gstats_.eager_decode;
  std::fprintf(stderr,
               "cuda engine: warning: CUDA graph %s failed (%s); decode steps run eagerly from now "
               "on\n",
               what, why.c_str());
  clear_graphs();
  graphs_on_ = false;
}

void CudaBackend::destroy_graph(std::map<GraphKey, GraphEntry>::iterator it) {
  if (it->second.exec == last_exec_) last_exec_ = nullptr;
  cudaGraphExecDestroy(it->second.exec);  // freed when it completes, if still in flight
  gstats_.graph_bytes -= it->second.bytes;
  graphs_.erase(it);
}

void CudaBackend::clear_graphs() {
  while (!graphs_.empty()) destroy_graph(graphs_.begin());
  warm_keys_.clear();
}

}  // namespace

std::string CudaMemoryLayout::to_text() const {
  std::ostringstream os;
  auto line = [&](const char* k, const std::string& v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "  %-26s ", k);
    os << buf << v << "\n";
  };
  line("weights", format_bytes(weight_bytes));
  line("KV pool (attention layers)", format_bytes(n_kv_blocks * kv_block_bytes) + " = " +
                                         std::to_string(n_kv_blocks) + " blocks of " +
                                         format_bytes(kv_block_bytes));
  line("GDN state slots", format_bytes(gdn_state_bytes));
  line("activations", format_bytes(activation_bytes) + " (" + std::to_string(max_step_tokens) +
                          " tokens per forward)");
  line("workspaces", format_bytes(workspace_bytes));
  line("reserve",
       format_bytes(reserve_bytes) + " (of which decode graphs " + format_bytes(graph_bytes) + ")");
  line("max tokens per sequence", std::to_string(max_seq_len));
  return os.str();
}

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& opt, const HostWeights& w) {
  CudaEngineOptions e;
  if (const char* env = std::getenv("DS_CUDA_QUIET")) e.verbose = std::string(env) != "1";
  return make_cuda_backend(opt, w, e);
}

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& opt, const HostWeights& w,
                                           const CudaEngineOptions& eopt) {
  auto b = std::make_unique<CudaBackend>(opt, w.config, eopt);
  b->upload(w);
  b->tune_gemms();
  return b;
}

std::unique_ptr<Backend> make_cuda_backend_synthetic(const BackendOptions& opt,
                                                     const ModelConfig& config, uint64_t seed,
                                                     const CudaEngineOptions& eopt) {
  auto b = std::make_unique<CudaBackend>(opt, config, eopt);
  b->generate_synthetic(seed);
  b->tune_gemms();
  return b;
}

namespace {
// The CUDA engine behind b (const when b is), or a clear error naming the caller.
template <class B>
auto* cuda_engine(B& b, const char* caller) {
  using C = std::conditional_t<std::is_const_v<B>, const CudaBackend, CudaBackend>;
  auto* cb = dynamic_cast<C*>(&b);
  DS_CHECK(cb != nullptr, caller, ": backend ", b.name(), " is not the CUDA engine");
  return cb;
}
}  // namespace

CudaGraphStats cuda_graph_stats(const Backend& b) {
  const auto* cb = cuda_engine(b, "cuda_graph_stats");
  return cb->graph_stats();
}

void set_cuda_graphs(Backend& b, bool on) {
  auto* cb = cuda_engine(b, "set_cuda_graphs");
  cb->set_graphs(on);
}

void set_cuda_fused_norm(Backend& b, int rows) {
  auto* cb = cuda_engine(b, "set_cuda_fused_norm");
  cb->set_fused_norm_rows(rows);
}

CudaStepTiming cuda_last_step_timing(const Backend& b) {
  const auto* cb = cuda_engine(b, "cuda_last_step_timing");
  return cb->last_step_timing();
}

double cuda_replay_last_graph(Backend& b, int n) {
  auto* cb = cuda_engine(b, "cuda_replay_last_graph");
  return cb->replay_last_graph(n);
}

void set_cuda_decode_rope_fused(Backend& b, bool on) {
  auto* cb = cuda_engine(b, "set_cuda_decode_rope_fused");
  cb->set_decode_rope_fused(on);
}

bool cuda_decode_rope_fused(const Backend& b) {
  const auto* cb = cuda_engine(b, "cuda_decode_rope_fused");
  return cb->decode_rope_fused();
}

void set_cuda_mlp_fused(Backend& b, int mode) {
  auto* cb = cuda_engine(b, "set_cuda_mlp_fused");
  cb->set_mlp_fused(mode);
}

int cuda_mlp_fused(const Backend& b) {
  const auto* cb = cuda_engine(b, "cuda_mlp_fused");
  return cb->mlp_fused();
}

int64_t cuda_mlp_fused_enqueued(const Backend& b, int form) {
  const auto* cb = cuda_engine(b, "cuda_mlp_fused_enqueued");
  DS_CHECK(form >= 1 && form <= 3, "cuda_mlp_fused_enqueued: form 1..3, got ", form);
  return cb->mlp_fused_enqueued(form);
}

void set_cuda_argmax_fused(Backend& b, bool on) {
  auto* cb = cuda_engine(b, "set_cuda_argmax_fused");
  cb->set_argmax_fused(on);
}

bool cuda_argmax_fused(const Backend& b) {
  const auto* cb = cuda_engine(b, "cuda_argmax_fused");
  return cb->argmax_fused();
}

int64_t cuda_argmax_fused_enqueued(const Backend& b) {
  const auto* cb = cuda_engine(b, "cuda_argmax_fused_enqueued");
  return cb->argmax_fused_enqueued();
}

void set_cuda_head_norm_fused(Backend& b, bool on) {
  auto* cb = cuda_engine(b, "set_cuda_head_norm_fused");
  cb->set_head_norm_fused(on);
}

bool cuda_head_norm_fused(const Backend& b) {
  const auto* cb = cuda_engine(b, "cuda_head_norm_fused");
  return cb->head_norm_fused();
}

int64_t cuda_head_norm_enqueued(const Backend& b) {
  const auto* cb = cuda_engine(b, "cuda_head_norm_enqueued");
  return cb->head_norm_enqueued();
}

void set_cuda_gdn_early(Backend& b, bool on) {
  auto* cb = cuda_engine(b, "set_cuda_gdn_early");
  cb->set_gdn_early(on);
}

bool cuda_gdn_early(const Backend& b) {
  const auto* cb = cuda_engine(b, "cuda_gdn_early");
  return cb->gdn_early();
}

int64_t cuda_gdn_early_enqueued(const Backend& b) {
  const auto* cb = cuda_engine(b, "cuda_gdn_early_enqueued");
  return cb->gdn_early_enqueued();
}

std::vector<unsigned> cuda_gdn_early_words(Backend& b) {
  auto* cb = cuda_engine(b, "cuda_gdn_early_words");
  return cb->gdn_early_words();
}

void set_cuda_prefill_fold(Backend& b, CudaEngineOptions::PrefillFold mode) {
  auto* cb = cuda_engine(b, "set_cuda_prefill_fold");
  cb->set_prefill_fold(mode);
}

CudaEngineOptions::PrefillFold cuda_prefill_fold(const Backend& b) {
  const auto* cb = cuda_engine(b, "cuda_prefill_fold");
  return cb->prefill_fold();
}

int cuda_fused_norm(const Backend& b) {
  const auto* cb = cuda_engine(b, "cuda_fused_norm");
  return cb->fused_norm_rows();
}

ModelConfig synthetic_model_config(const std::string& spec) {
  if (spec == "27b" || spec == "27B") return parse_model_config(kQwen35_27bConfig, "builtin:27b");
  return load_model_config(spec);
}

}  // namespace ds
