// The dispatch registry: every kernel choice of the CUDA engine goes through here. Each kernel
// family (GEMM, attention prefill/decode, GDN prefill/decode, ...) has an ordered list of
// variants; a specialised variant has a guard over (device, dtype, shape) and comes before the
// family's generic fallback, which accepts every shape. select() returns the first enabled variant
// whose guard accepts the shape. Variants can be listed (`deltaserve ... --list-kernels`, the
// engine's start-up log) and switched off at run time by name, from the constructor argument or
// the environment variable DS_DISABLE_KERNELS (comma-separated "family.variant" names, or "all"
// for every specialised variant). A generic fallback cannot be switched off.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace ds::cuda {

enum class KernelFamily : uint8_t {
  kGemm,         // dims: {m, n, k}
  kAttnPrefill,  // dims: {head_dim, group, max_q_len, max_kv_len}
  kAttnDecode,   // dims: {head_dim, group, n_seqs, max_kv_len}
  kGdnPrefill,   // dims: {d_k, d_v, n_tokens, n_seqs}
  kGdnDecode,    // dims: {d_k, d_v, n_seqs}
  kRmsNorm,      // dims: {d}
  kRopeKv,       // dims: {head_dim, rotary_dim}
  kSiluMul,      // dims: {d_ff}
  kSample,       // dims: {vocab}
  kCount
};
const char* family_name(KernelFamily f);

struct ShapeKey {
  int sm = 0;     // compute capability, major * 10 + minor
  int dtype = 0;  // 0: bf16 (the only one for now)
  int64_t dims[4] = {0, 0, 0, 0};
};

struct KernelVariant {
  KernelFamily family = KernelFamily::kGemm;
  std::string name;                            // short name, unique in its family
  std::string description;                     // what it is specialised for
  std::function<bool(const ShapeKey&)> guard;  // empty: generic fallback (accepts everything)
  bool enabled = true;
  std::string full_name() const;  // "family.name"
};

class DispatchRegistry {
 public:
  // The engine's built-in variants for a device of compute capability `sm`, minus the ones named
  // in `disabled` and in $DS_DISABLE_KERNELS. Throws ds::Error on an unknown name.
  static DispatchRegistry with_defaults(int sm, const std::string& disabled = "");

  // Adds a variant; earlier variants of a family are tried first. Returns its index.
  int add(KernelVariant v);
  // Switches variants off by comma-separated full names ("attn_decode.split_kv") or "all".
  void disable(const std::string& names);
  void set_enabled(const std::string& full_name, bool on);

  // The variant for this shape. Throws ds::Error if the family has no variant at all.
  const KernelVariant& select(KernelFamily f, const ShapeKey& key) const;
  // Convenience: is `name` the variant select() picks?
  bool picks(KernelFamily f, const ShapeKey& key, const std::string& name) const {
    return select(f, key).name == name;
  }
  int sm() const { return sm_; }
  ShapeKey key(int64_t d0 = 0, int64_t d1 = 0, int64_t d2 = 0, int64_t d3 = 0) const {
    ShapeKey k;
    k.sm = sm_;
    k.dims[0] = d0, k.dims[1] = d1, k.dims[2] = d2, k.dims[3] = d3;
    return k;
  }
  const std::vector<KernelVariant>& variants() const { return variants_; }
  std::string list() const;  // a table: family, variant, on/off, description

 private:
  int sm_ = 0;
  std::vector<KernelVariant> variants_;
};

}  // namespace ds::cuda
