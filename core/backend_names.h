// The MLP worker's backends and the CPU backend's weight modes: one enum and
// one spelling each, on every flag (ellm-launch's and ellm-mlp-worker's
// --backend and --cpu-weights) and log line.
#pragma once

#include <string_view>

#include "core/status.h"

namespace ellm {

// kAuto is the launcher's choice: cuda when ellm-mlp-worker --probe-cuda
// finds a usable GPU, cpu otherwise. A worker runs cpu or cuda.
enum class MlpBackendKind { kAuto, kCpu, kCuda };
std::string_view MlpBackendName(MlpBackendKind kind);  // "auto", "cpu", "cuda"
absl::StatusOr<MlpBackendKind> ParseMlpBackend(std::string_view name);

// native: each matrix in its GGUF type on the int8 / half kernels; f32:
// dequantised at load, results bit-identical to the reference forward.
enum class CpuWeights { kNative, kF32 };
std::string_view CpuWeightsName(CpuWeights weights);  // "native", "f32"
absl::StatusOr<CpuWeights> ParseCpuWeights(std::string_view name);

}  // namespace ellm
