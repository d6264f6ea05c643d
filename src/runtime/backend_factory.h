// Picks the engine for BackendOptions::device: "cpu" (the reference forward) or "cuda" /
// "cuda:N" (the CUDA engine, when this binary was built with it).
#pragma once

#include <memory>

#include "model/weights.h"
#include "runtime/backend.h"

namespace ds {

// Throws ds::Error for an unknown device, or "cuda" in a build without the CUDA backend.
std::unique_ptr<Backend> make_backend(const BackendOptions& opts, const HostWeights& weights);

// True when this binary has the CUDA backend compiled in.
bool cuda_backend_built();

}  // namespace ds
