// libFuzzer harness: the safetensors header parser over arbitrary bytes. Any outcome other than a
// parsed header or a ds::Error (crash, sanitizer report, other exception, a header whose offsets
// point outside the buffer) is a finding. See fuzz/README.md.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "core/error.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  ds::SafetensorsHeader h;
  try {
    h = ds::parse_safetensors_header(bytes, size, "fuzz.safetensors");
  } catch (const ds::Error&) {
    return 0;
  }
  // Invariants of an accepted header: every tensor lies inside the buffer, sizes agree, the
  // index finds each name. Touch the first and last byte so ASan checks the bounds too.
  volatile uint8_t sink = 0;
  for (const ds::SafetensorsEntry& e : h.tensors) {
    if (e.begin > e.end || h.data_start + e.end > size) std::abort();
    if (static_cast<uint64_t>(e.numel()) * e.elem_bits != (e.end - e.begin) * 8) std::abort();
    if (h.find(e.name) != &e) std::abort();
    if (e.end > e.begin)
      sink = sink + data[h.data_start + e.begin] + data[h.data_start + e.end - 1];
    ds::DType dt;
    (void)e.engine_dtype(&dt);
  }
  (void)sink;
  return 0;
}
