#include "core/backend_names.h"

#include "absl/strings/str_cat.h"

namespace ellm {

std::string_view MlpBackendName(MlpBackendKind kind) {
  switch (kind) {
    case MlpBackendKind::kAuto: return "auto";
    case MlpBackendKind::kCpu: return "cpu";
    case MlpBackendKind::kCuda: return "cuda";
  }
  return "?";
}

absl::StatusOr<MlpBackendKind> ParseMlpBackend(std::string_view name) {
  for (MlpBackendKind k : {MlpBackendKind::kAuto, MlpBackendKind::kCpu, MlpBackendKind::kCuda}) {
    if (name == MlpBackendName(k)) return k;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown MLP backend '", ToAbsl(name), "' (expected auto, cpu or cuda)"));
}

std::string_view CpuWeightsName(CpuWeights weights) {
  return weights == CpuWeights::kNative ? "native" : "f32";
}

absl::StatusOr<CpuWeights> ParseCpuWeights(std::string_view name) {
  for (CpuWeights w : {CpuWeights::kNative, CpuWeights::kF32}) {
    if (name == CpuWeightsName(w)) return w;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown CPU weight mode '", ToAbsl(name), "' (expected native or f32)"));
}

}  // namespace ellm
