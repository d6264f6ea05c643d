// CUPTI for the profile tests (cuda_decode_profile_test, cuda_prefill_profile_test), loaded at run
// time with dlopen so the test binaries start without it: $DS_CUPTI_LIB (a path, or "none": not
// loaded), else libcupti.so.13 / libcupti.so from the loader's search path. CuptiLib registers the
// test's activity-buffer callback (buffers from cupti_buffer_requested); the callback walks its
// records with cupti_next_record. demangle() names kernels.
#pragma once

#include <cupti.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace ds::test {

using CuptiNextRecordFn = CUptiResult (*)(uint8_t*, size_t, CUpti_Activity**);
// cuptiActivityGetNextRecord once a CuptiLib has loaded it (null before).
inline CuptiNextRecordFn cupti_next_record = nullptr;

inline std::string demangle(const char* s) {
  if (!s) return "?";
  int st = 0;
  char* d = abi::__cxa_demangle(s, nullptr, nullptr, &st);
  std::string r = st == 0 && d ? d : s;
  std::free(d);
  return r;
}

inline void CUPTIAPI cupti_buffer_requested(uint8_t** buf, size_t* size, size_t* max_records) {
  *size = size_t(16) << 20;
  *buf = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

// The CUPTI entry points the tests use. ok: loaded and `completed` registered; else `why` says why.
struct CuptiLib {
  CUptiResult (*enable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*disable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc,
                                    CUpti_BuffersCallbackCompleteFunc) = nullptr;
  CUptiResult (*flush_all)(uint32_t) = nullptr;
  CUptiResult (*timestamp)(uint64_t*) = nullptr;
  CUptiResult (*callback_name)(CUpti_CallbackDomain, uint32_t, const char**) = nullptr;
  bool ok = false;
  std::string why;

  explicit CuptiLib(CUpti_BuffersCallbackCompleteFunc completed) {
    std::vector<std::string> names;
    if (const char* e = std::getenv("DS_CUPTI_LIB")) {
      if (std::string(e) == "none") {  // the host times in a process without CUPTI
        why = "DS_CUPTI_LIB=none";
        return;
      }
      names.push_back(e);
    }
    names.push_back("libcupti.so.13");
    names.push_back("libcupti.so");
    void* lib = nullptr;
    for (const auto& n : names) {
      lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib) break;
      why += n + ": " + dlerror() + "; ";
    }
    if (!lib) return;
    auto sym = [&](const char* s) {
      void* p = dlsym(lib, s);
      if (!p) why += std::string("missing ") + s + "; ";
      return p;
    };
    enable = reinterpret_cast<decltype(enable)>(sym("cuptiActivityEnable"));
    disable = reinterpret_cast<decltype(disable)>(sym("cuptiActivityDisable"));
    register_callbacks =
        reinterpret_cast<decltype(register_callbacks)>(sym("cuptiActivityRegisterCallbacks"));
    flush_all = reinterpret_cast<decltype(flush_all)>(sym("cuptiActivityFlushAll"));
    timestamp = reinterpret_cast<decltype(timestamp)>(sym("cuptiGetTimestamp"));
    callback_name = reinterpret_cast<decltype(callback_name)>(sym("cuptiGetCallbackName"));
    cupti_next_record = reinterpret_cast<CuptiNextRecordFn>(sym("cuptiActivityGetNextRecord"));
    ok = enable && disable && register_callbacks && flush_all && timestamp && cupti_next_record &&
         register_callbacks(cupti_buffer_requested, completed) == CUPTI_SUCCESS;
    if (!ok) why += "cuptiActivityRegisterCallbacks failed; ";
  }
  // A runtime / driver API record's function name (cbid), or "runtime#<cbid>" when unknown.
  std::string api_name(bool runtime, uint32_t cbid) const {
    const char* n = nullptr;
    if (callback_name)
      callback_name(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API, cbid, &n);
    return n ? std::string(n) : (runtime ? "runtime#" : "driver#") + std::to_string(cbid);
  }
};

}  // namespace ds::test
