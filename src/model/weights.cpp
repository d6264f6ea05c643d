// Host weights: loading a HF safetensors checkpoint (single file or sharded; text-only `model.` or
// vision-language wrapper `model.language_model.` names) with fusion of [qkv|z|b|a], [q|k|v] and
// [gate|up] at load; deterministic synthetic weights; writing a checkpoint in the HF layout.
#include "model/weights.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/bf16.h"
#include "core/error.h"
#include "model/checkpoint_info.h"
#include "model/safetensors.h"
#include "model/weight_table.h"

namespace ds {
namespace fs = std::filesystem;

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF32:
      return "F32";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  return "?";
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
      return 4;
    case DType::kF8E4M3:
      return 1;
  }
  return 0;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

float TensorView::at(int64_t i) const {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t v;
      std::memcpy(&v, data + 2 * i, 2);
      return bf16_to_f32(v);
    }
    case DType::kF16: {
      uint16_t v;
      std::memcpy(&v, data + 2 * i, 2);
      return f16_to_f32(v);
    }
    case DType::kF32: {
      float v;
      std::memcpy(&v, data + 4 * i, 4);
      return v;
    }
    case DType::kF8E4M3:
      break;
  }
  throw_error("tensor ", name, ": dtype ", dtype_name(dtype), " cannot be widened to float");
}

void TensorView::to_f32(float* out) const {
  const int64_t n = numel();
  if (dtype == DType::kF8E4M3)
    throw_error("tensor ", name, ": dtype F8_E4M3 cannot be widened to float");
  if (dtype == DType::kF32) {
    std::memcpy(out, data, static_cast<size_t>(n) * 4);
    return;
  }
  const bool bf = dtype == DType::kBF16;
#pragma omp parallel for schedule(static) if (n > (1 << 20))
  for (int64_t i = 0; i < n; ++i) {
    uint16_t v;
    std::memcpy(&v, data + 2 * i, 2);
    out[i] = bf ? bf16_to_f32(v) : f16_to_f32(v);
  }
}

namespace {

// float -> IEEE half, round to nearest even (for f16 synthetic weights and mixed-dtype fusion).
uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (absx < 0x38800000u) {  // subnormal or zero in half
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(absx >> 23);  // 14..24
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t h = ((absx - 0x38000000u) >> 13);
  uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

void store_value(DType t, std::byte* dst, int64_t i, float v) {
  if (t == DType::kF32) {
    std::memcpy(dst + 4 * i, &v, 4);
  } else {
    uint16_t h = t == DType::kBF16 ? f32_to_bf16(v) : f32_to_f16(v);
    std::memcpy(dst + 2 * i, &h, 2);
  }
}

// What keeps a HostWeights' data alive.
struct HostStorage {
  std::unique_ptr<SafetensorsCheckpoint> checkpoint;
  std::vector<std::unique_ptr<std::byte[]>> buffers;
  std::byte* alloc(size_t n) {
    buffers.emplace_back(new std::byte[std::max<size_t>(n, 1)]);
    return buffers.back().get();
  }
};

TensorView& field_of(HostWeights& w, const CheckpointTensor& t) {
  if (t.layer < 0) return w.*(t.spec->global_field);
  return w.layers[t.layer].*(t.spec->layer_field);
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

// Fused field shapes: the parts' rows stacked.
std::vector<int64_t> fused_shape(const std::vector<const CheckpointTensor*>& parts) {
  std::vector<int64_t> s = parts[0]->shape;
  for (size_t i = 1; i < parts.size(); ++i) s[0] += parts[i]->shape[0];
  return s;
}

std::string fused_name(int layer, const std::vector<const CheckpointTensor*>& parts) {
  std::string n = "fused:layers." + std::to_string(layer) + ".[";
  for (size_t i = 0; i < parts.size(); ++i) {
    std::string p = parts[i]->name.substr(parts[i]->name.find('.', 7) + 1);
    n += (i ? "|" : "") + p;
  }
  return n + "]";
}

// Groups checkpoint tensors by destination field: (layer, field) -> parts in part order.
struct FieldGroup {
  int layer;
  std::vector<const CheckpointTensor*> parts;
};
std::vector<FieldGroup> group_fields(const std::vector<CheckpointTensor>& tensors) {
  std::vector<FieldGroup> groups;
  std::map<std::pair<int, const void*>, size_t> pos;
  for (const CheckpointTensor& t : tensors) {
    // A field is identified by the first table entry that writes it.
    const void* key = t.spec;
    if (t.layer >= 0) {
      for (const WeightSpec& s : weight_table()) {
        if (s.scope != LayerScope::kGlobal && s.layer_field == t.spec->layer_field) {
          key = &s;
          break;
        }
      }
    }
    auto [it, fresh] = pos.emplace(std::make_pair(t.layer, key), groups.size());
    if (fresh) groups.push_back({t.layer, {}});
    groups[it->second].parts.push_back(&t);
  }
  return groups;
}

// A checkpoint whose text tensors are all found and checked (names, dtypes, shapes) without
// reading any tensor data.
struct Source {
  const TensorLocation* loc;
  DType dtype;
};
struct ResolvedCheckpoint {
  ModelConfig config;
  std::unique_ptr<SafetensorsCheckpoint> checkpoint;
  std::vector<CheckpointTensor> tensors;
  std::vector<Source> sources;  // [tensors.size()]
  CheckpointStats stats;
};

ResolvedCheckpoint resolve_checkpoint(const std::string& model_dir) {
  ResolvedCheckpoint w;  // named like the HostWeights it feeds
  fs::path dir(model_dir);
  fs::path config_path = dir / "config.json";
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw_error(model_dir, ": not a directory (expected a checkpoint folder)");
  if (!fs::exists(config_path, ec)) throw_error(model_dir, ": no config.json in this folder");
  w.config = load_model_config(config_path.string());
  const ModelConfig& c = w.config;

  w.checkpoint = std::make_unique<SafetensorsCheckpoint>(model_dir);
  const SafetensorsCheckpoint& ck = *w.checkpoint;
  w.stats.n_files = static_cast<int>(ck.files().size());

  // Classify every tensor name: text (by its name without prefix), visual, mtp or other.
  std::map<std::string, std::string> text_names;  // name without prefix -> full checkpoint name
  std::string text_prefix;                        // the prefix the checkpoint uses
  for (const std::string& full : ck.names()) {
    const TensorLocation* loc = ck.find(full);
    std::string rest;
    if (full.rfind("model.visual.", 0) == 0) {
      ++w.stats.n_visual_tensors;
      w.stats.visual_params += loc->entry->numel();
      continue;
    }
    if (full.rfind("mtp.", 0) == 0) {
      ++w.stats.n_mtp_tensors;
      w.stats.mtp_params += loc->entry->numel();
      continue;
    }
    std::string prefix;
    if (full.rfind("model.language_model.", 0) == 0) {
      prefix = "model.language_model.";
    } else if (full == "lm_head.weight") {
      prefix = "";
    } else if (full.rfind("model.", 0) == 0) {
      prefix = "model.";
    } else {
      ++w.stats.n_other_tensors;
      w.stats.other_tensor_names.push_back(full);
      continue;
    }
    rest = full.substr(prefix.size());
    if (!prefix.empty() && text_prefix.empty()) text_prefix = prefix;
    auto [it, fresh] = text_names.emplace(rest, full);
    if (!fresh) {
      throw_error(ck.listing(), ": tensor '", rest, "' appears twice, as '", it->second, "' and '",
                  full, "'");
    }
  }
  if (text_prefix.empty()) text_prefix = c.is_wrapper ? "model.language_model." : "model.";
  auto full_name = [&](const std::string& rest) {
    return rest == "lm_head.weight" ? rest : text_prefix + rest;
  };

  // Text names the table does not know: Qwen3-Next packed projections, layers past the config,
  // tensors of the other layer kind (config/checkpoint mismatch) are errors; the rest is listed.
  std::set<std::string> expected_names;
  w.tensors = checkpoint_tensors(c);
  const std::vector<CheckpointTensor>& tensors = w.tensors;
  for (const CheckpointTensor& t : tensors) expected_names.insert(t.name);
  for (auto& [rest, full] : text_names) {
    if (expected_names.count(rest)) continue;
    const std::string& file = ck.find(full)->file->path();
    if (rest == "lm_head.weight" && c.tie_word_embeddings) {
      w.stats.other_tensor_names.push_back(full + " (ignored: tie_word_embeddings is true)");
      ++w.stats.n_other_tensors;
      continue;
    }
    if (rest.find("in_proj_qkvz") != std::string::npos ||
        rest.find("in_proj_ba") != std::string::npos) {
      throw_error(file, ": tensor '", full,
                  "' is a Qwen3-Next packed GDN projection (in_proj_qkvz / in_proj_ba); unpacking "
                  "that layout is "
                  "not supported yet (Qwen3.5 checkpoints use in_proj_qkv, in_proj_z, in_proj_b, "
                  "in_proj_a)");
    }
    if (rest.rfind("layers.", 0) == 0) {
      size_t dot = rest.find('.', 7);
      std::string idx = rest.substr(7, dot == std::string::npos ? std::string::npos : dot - 7);
      char* endp = nullptr;
      long il = std::strtol(idx.c_str(), &endp, 10);
      bool numeric = !idx.empty() && endp != nullptr && *endp == '\0';
      // "03", "+3" or 20 digits parse as a number but are not the name of any layer's tensor.
      if (numeric && std::to_string(il) != idx) {
        throw_error(file, ": tensor '", full, "' has the layer index '", idx,
                    "', which is not written as a layer number (layers.0 ... layers.",
                    c.n_layers - 1, ")");
      }
      if (numeric && (il < 0 || il >= c.n_layers)) {
        throw_error(file, ": tensor '", full, "' belongs to layer ", il, " but ", c.source,
                    " has num_hidden_layers ", c.n_layers);
      }
      if (numeric && dot != std::string::npos) {
        std::string suffix = rest.substr(dot + 1);
        for (const WeightSpec& s : weight_table()) {
          if (suffix == s.name) {
            throw_error(
                file, ": tensor '", full, "' belongs to a ",
                s.scope == LayerScope::kFullLayer ? "full-attention" : "Gated DeltaNet",
                " layer, but ", c.source, " makes layer ", il, " a ",
                c.layer_types[il] == LayerType::kFull ? "full_attention" : "linear_attention",
                " layer (layer_types / full_attention_interval disagree with the checkpoint)");
          }
        }
        if (suffix.find(".experts.") != std::string::npos || suffix.rfind("mlp.gate.", 0) == 0) {
          throw_error(file, ": tensor '", full,
                      "' is a mixture-of-experts weight; MoE models are not supported");
        }
      }
    }
    ++w.stats.n_other_tensors;
    w.stats.other_tensor_names.push_back(full);
  }

  // Resolve every expected tensor: present, usable dtype, right shape.
  std::vector<Source>& sources = w.sources;
  sources.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const CheckpointTensor& t = tensors[i];
    std::string full = full_name(t.name);
    auto it = text_names.find(t.name);
    if (it == text_names.end()) {
      std::string hint;
      if (t.layer >= 0) {  // name the shard holding the rest of this layer
        std::string lp = "layers." + std::to_string(t.layer) + ".";
        for (auto& [rest, f] : text_names) {
          if (rest.rfind(lp, 0) == 0) {
            hint = " (the other tensors of layer " + std::to_string(t.layer) + " are in " +
                   ck.find(f)->file->path() + ")";
            break;
          }
        }
      }
      if (t.spec->kind == ParamKind::kLmHead)
        hint = " (tie_word_embeddings is false in " + c.source + ")";
      throw_error(ck.listing(), ": missing tensor '", full, "' with shape ", shape_str(t.shape),
                  hint);
    }
    const TensorLocation* loc = ck.find(it->second);
    const SafetensorsEntry& e = *loc->entry;
    DType dt;
    if (!e.engine_dtype(&dt)) {
      throw_error(loc->file->path(), ": tensor '", e.name, "' has dtype ", e.dtype_str,
                  "; weights must be BF16, F16 or F32");
    }
    if (dt == DType::kF8E4M3) {
      throw_error(
          loc->file->path(), ": tensor '", e.name,
          "' is FP8 (F8_E4M3): FP8 checkpoints are not supported yet; use the BF16 checkpoint");
    }
    if (e.shape != t.shape) {
      throw_error(loc->file->path(), ": tensor '", e.name, "' has shape ", shape_str(e.shape),
                  ", expected ", shape_str(t.shape), " from ", c.source);
    }
    sources[i] = {loc, dt};
    ++w.stats.n_text_tensors;
    w.stats.text_bytes += static_cast<int64_t>(e.end - e.begin);
  }
  return w;
}

}  // namespace

HostWeights load_host_weights(const std::string& model_dir) {
  auto t0 = std::chrono::steady_clock::now();
  ResolvedCheckpoint rc = resolve_checkpoint(model_dir);
  HostWeights w;
  w.source = model_dir;
  w.config = rc.config;
  w.stats = rc.stats;
  const ModelConfig& c = w.config;
  auto storage = std::make_shared<HostStorage>();
  storage->checkpoint = std::move(rc.checkpoint);
  const std::vector<CheckpointTensor>& tensors = rc.tensors;
  const std::vector<Source>& sources = rc.sources;

  // Build the views; fused groups get one owned buffer, converted to F32 when the parts' dtypes
  // differ (lossless for any mix of BF16 / F16 / F32).
  w.layers.resize(c.n_layers);
  for (int il = 0; il < c.n_layers; ++il) w.layers[il].type = c.layer_types[il];
  struct CopyJob {
    std::byte* dst;
    DType dst_dtype;
    const std::byte* src;
    DType src_dtype;
    int64_t numel;
  };
  std::vector<CopyJob> jobs;
  std::map<const CheckpointTensor*, size_t> index_of;
  for (size_t i = 0; i < tensors.size(); ++i) index_of[&tensors[i]] = i;
  for (const FieldGroup& g : group_fields(tensors)) {
    const CheckpointTensor& first = *g.parts[0];
    TensorView& dst = field_of(w, first);
    if (g.parts.size() == 1) {
      const Source& s = sources[index_of[&first]];
      dst.name = s.loc->entry->name;
      dst.dtype = s.dtype;
      dst.shape = first.shape;
      dst.data = s.loc->file->tensor_data(*s.loc->entry);
      continue;
    }
    DType common = sources[index_of[g.parts[0]]].dtype;
    for (const CheckpointTensor* p : g.parts) {
      if (sources[index_of[p]].dtype != common) common = DType::kF32;
    }
    dst.name = fused_name(g.layer, g.parts);
    dst.dtype = common;
    dst.shape = fused_shape(g.parts);
    std::byte* buf = storage->alloc(dst.nbytes());
    dst.data = buf;
    const int64_t row = dst.shape[1];
    for (const CheckpointTensor* p : g.parts) {
      const Source& s = sources[index_of[p]];
      jobs.push_back({buf + p->row_offset * row * dtype_size(common), common,
                      s.loc->file->tensor_data(*s.loc->entry), s.dtype, p->numel()});
    }
  }
  // Copies touch the mmapped pages for the first time: all cores help with the page faults
  // (threads only for real sizes: on a busy machine a parallel region costs milliseconds).
  int64_t copy_elems = 0;
  for (const CopyJob& job : jobs) copy_elems += job.numel;
#pragma omp parallel for schedule(dynamic, 1) if (copy_elems > (int64_t(1) << 22))
  for (size_t j = 0; j < jobs.size(); ++j) {
    const CopyJob& job = jobs[j];
    if (job.src_dtype == job.dst_dtype) {
      std::memcpy(job.dst, job.src, static_cast<size_t>(job.numel) * dtype_size(job.dst_dtype));
    } else {
      TensorView v;
      v.dtype = job.src_dtype;
      v.shape = {job.numel};
      v.data = job.src;
      for (int64_t k = 0; k < job.numel; ++k) store_value(job.dst_dtype, job.dst, k, v.at(k));
    }
  }
  if (c.tie_word_embeddings) w.lm_head = w.embed;
  w.storage = storage;
  w.stats.load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return w;
}

HostWeights make_synthetic_weights(const ModelConfig& config, uint64_t seed, DType dtype) {
  auto t0 = std::chrono::steady_clock::now();
  config.validate();
  if (dtype == DType::kF8E4M3) throw_error("synthetic weights: dtype F8_E4M3 is not supported");
  HostWeights w;
  w.config = config;
  w.source = "synthetic:" + std::to_string(seed);
  auto storage = std::make_shared<HostStorage>();
  const ModelConfig& c = w.config;
  w.layers.resize(c.n_layers);
  for (int il = 0; il < c.n_layers; ++il) w.layers[il].type = c.layer_types[il];

  std::vector<CheckpointTensor> tensors = checkpoint_tensors(c);
  struct GenJob {
    std::byte* dst;  // start of this part
    SyntheticSpec spec;
    int64_t numel;
  };
  std::vector<GenJob> jobs;
  for (const FieldGroup& g : group_fields(tensors)) {
    TensorView& dst = field_of(w, *g.parts[0]);
    dst.name = g.parts.size() == 1 ? g.parts[0]->name : fused_name(g.layer, g.parts);
    dst.dtype = dtype;
    dst.shape = g.parts.size() == 1 ? g.parts[0]->shape : fused_shape(g.parts);
    std::byte* buf = storage->alloc(dst.nbytes());
    dst.data = buf;
    for (const CheckpointTensor* p : g.parts) {
      const int64_t row_elems = dst.numel() / dst.shape[0];
      jobs.push_back({buf + p->row_offset * row_elems * dtype_size(dtype),
                      synthetic_tensor_spec(c, p->name, seed), p->numel()});
    }
    ++w.stats.n_text_tensors;
    w.stats.text_bytes += static_cast<int64_t>(dst.nbytes());
  }
  // Every element is a pure function of (tensor seed, index): split into fixed blocks, any
  // thread count gives the same bytes.
  constexpr int64_t kBlock = 1 << 14;
  std::vector<std::pair<size_t, int64_t>> blocks;
  for (size_t j = 0; j < jobs.size(); ++j) {
    for (int64_t b = 0; b < jobs[j].numel; b += kBlock) blocks.emplace_back(j, b);
  }
#pragma omp parallel for schedule(dynamic, 4) if (blocks.size() > 64)
  for (size_t k = 0; k < blocks.size(); ++k) {
    const GenJob& job = jobs[blocks[k].first];
    const int64_t b0 = blocks[k].second, n = std::min(job.numel - b0, kBlock);
    float vals[kBlock];
    synthetic_fill(job.spec, static_cast<uint64_t>(b0), n, vals);
    if (dtype == DType::kF32) {
      std::memcpy(job.dst + 4 * b0, vals, static_cast<size_t>(n) * 4);
    } else if (dtype == DType::kBF16) {
      uint16_t* out = reinterpret_cast<uint16_t*>(job.dst) + b0;
      for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(vals[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) store_value(dtype, job.dst, b0 + i, vals[i]);
    }
  }
  if (c.tie_word_embeddings) w.lm_head = w.embed;
  w.storage = storage;
  w.stats.load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return w;
}

void write_checkpoint(const HostWeights& w, const std::string& dir, int n_shards, bool wrapper) {
  const ModelConfig& c = w.config;
  if (n_shards < 1) throw_error("write_checkpoint: --shards must be >= 1, got ", n_shards);
  std::vector<CheckpointTensor> tensors = checkpoint_tensors(c);
  if (static_cast<size_t>(n_shards) > tensors.size()) {
    throw_error("write_checkpoint: ", n_shards, " shards for only ", tensors.size(), " tensors");
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw_error(dir, ": cannot create directory: ", ec.message());

  // Each checkpoint tensor is a row range of a (possibly fused) field.
  std::vector<TensorToWrite> all;
  uint64_t total = 0;
  const std::string prefix = wrapper ? "model.language_model." : "model.";
  for (const CheckpointTensor& t : tensors) {
    const TensorView& f = field_of(const_cast<HostWeights&>(w), t);
    if (f.empty()) throw_error("write_checkpoint: tensor '", t.name, "' has no data");
    if (f.dtype == DType::kF8E4M3)
      throw_error("write_checkpoint: tensor '", t.name, "' is F8_E4M3");
    int64_t row_elems = f.numel() / std::max<int64_t>(1, f.shape[0]);
    std::string name = t.spec->kind == ParamKind::kLmHead ? t.name : prefix + t.name;
    all.push_back(
        {name, f.dtype, t.shape, f.data + t.row_offset * row_elems * dtype_size(f.dtype)});
    total += static_cast<uint64_t>(t.numel()) * dtype_size(f.dtype);
  }

  // Contiguous, non-empty shards of roughly equal bytes.
  std::vector<std::vector<TensorToWrite>> shards(n_shards);
  uint64_t acc = 0;
  size_t s = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    size_t remaining_tensors = all.size() - i, remaining_shards = n_shards - s - 1;
    bool past_target = acc >= (s + 1) * total / n_shards;
    if (!shards[s].empty() && s + 1 < static_cast<size_t>(n_shards) &&
        (past_target || remaining_tensors <= remaining_shards)) {
      ++s;
    }
    shards[s].push_back(all[i]);
    int64_t numel = 1;
    for (int64_t d : all[i].shape) numel *= d;
    acc += static_cast<uint64_t>(numel) * dtype_size(all[i].dtype);
  }

  fs::path d(dir);
  std::ofstream cfg(d / "config.json");
  cfg << model_config_to_json(c, wrapper) << "\n";
  if (!cfg) throw_error((d / "config.json").string(), ": write failed");
  cfg.close();
  if (n_shards == 1) {
    write_safetensors((d / "model.safetensors").string(), shards[0]);
    fs::remove(d / "model.safetensors.index.json", ec);
    return;
  }
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", total}};
  nlohmann::ordered_json map = nlohmann::ordered_json::object();
  for (int k = 0; k < n_shards; ++k) {
    char fname[64];
    std::snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", k + 1, n_shards);
    write_safetensors((d / fname).string(), shards[k]);
    for (const TensorToWrite& t : shards[k]) map[t.name] = fname;
  }
  index["weight_map"] = map;
  std::ofstream idx(d / "model.safetensors.index.json");
  idx << index.dump(2) << "\n";
  if (!idx) throw_error((d / "model.safetensors.index.json").string(), ": write failed");
  fs::remove(d / "model.safetensors", ec);
}

ModelConfig tiny_model_config(int vocab_size) {
  ModelConfig c;
  c.model_type = "qwen3_5_text";
  c.source = "<tiny config>";
  c.d_model = 64;
  c.n_layers = 4;
  c.d_ff = 128;
  c.vocab_size = vocab_size;
  c.rms_norm_eps = 1e-6f;
  c.tie_word_embeddings = false;
  c.layer_types = {LayerType::kLinear, LayerType::kLinear, LayerType::kLinear, LayerType::kFull};
  c.n_heads = 6;
  c.n_kv_heads = 1;
  c.head_dim = 32;
  c.attn_output_gate = true;
  c.rope_theta = 1e7;
  c.partial_rotary_factor = 0.25f;
  c.rotary_dim = 8;
  c.max_position_embeddings = 32768;
  c.mrope_section = {2, 1, 1};
  c.mrope_interleaved = true;
  c.n_k_heads = 2;
  c.n_v_heads = 6;
  c.d_k = 16;
  c.d_v = 16;
  c.conv_kernel = 4;
  c.validate();
  return c;
}

}  // namespace ds

namespace ds {

int64_t CheckpointInfo::text_params() const {
  int64_t n = 0;
  for (int64_t v : params_by_kind) n += v;
  return n;
}

int64_t CheckpointInfo::text_bytes() const {
  int64_t n = 0;
  for (int64_t v : bytes_by_kind) n += v;
  return n;
}

CheckpointInfo inspect_checkpoint(const std::string& model_dir) {
  CheckpointInfo info;
  info.dir = model_dir;
  fs::path dir(model_dir);
  std::error_code ec;
  bool weights = fs::exists(dir / "model.safetensors", ec) ||
                 fs::exists(dir / "model.safetensors.index.json", ec);
  if (!weights) {
    // Config only: the counts follow from the config (bf16 assumed).
    if (!fs::is_directory(dir, ec))
      throw_error(model_dir, ": not a directory (expected a checkpoint folder)");
    if (!fs::exists(dir / "config.json", ec))
      throw_error(model_dir, ": no config.json in this folder");
    info.config = load_model_config((dir / "config.json").string());
    for (const CheckpointTensor& t : checkpoint_tensors(info.config)) {
      info.params_by_kind[int(t.spec->kind)] += t.numel();
      info.bytes_by_kind[int(t.spec->kind)] += t.numel() * 2;
    }
    return info;
  }
  ResolvedCheckpoint rc = resolve_checkpoint(model_dir);
  info.has_weights = true;
  info.config = rc.config;
  info.stats = rc.stats;
  info.listing = rc.checkpoint->listing();
  for (size_t i = 0; i < rc.tensors.size(); ++i) {
    const SafetensorsEntry& e = *rc.sources[i].loc->entry;
    info.params_by_kind[int(rc.tensors[i].spec->kind)] += e.numel();
    info.bytes_by_kind[int(rc.tensors[i].spec->kind)] += static_cast<int64_t>(e.end - e.begin);
    ++info.text_tensors_by_dtype[e.dtype_str];
  }
  return info;
}

}  // namespace ds
