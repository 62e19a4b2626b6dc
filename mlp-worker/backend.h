// MlpBackend: the model's non-attention math for one step of T tokens. The
// backend keeps the hidden states [T, dim] itself (on the device for CUDA);
// q/k/v and attention outputs cross the interface as host arrays in token-major
// layout, which is what the rings carry.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"
#include "core/weights.h"

namespace ellm::mlp {

class MlpBackend {
 public:
  virtual ~MlpBackend() = default;
  virtual std::string name() const = 0;

  // Starts a step: embeds tokens[T] (positions[T] are used by RoPE).
  virtual absl::Status BeginStep(const int32_t* tokens, const int32_t* positions, int n_tokens) = 0;
  // q [T, n_heads, head_dim], k and v [T, n_kv_heads, head_dim], RoPE applied.
  virtual absl::Status ComputeQkv(int layer, float* q, float* k, float* v) = 0;
  // attn [T, n_heads, head_dim]: O projection, residual, norm, gated MLP, residual.
  virtual absl::Status CompleteLayer(int layer, const float* attn) = 0;
  // Final norm and LM head for the tokens rows[n] of the step: logits [n, vocab].
  virtual absl::Status ComputeLogits(const int32_t* rows, int n, float* logits) = 0;
};

// The CPU backend: fp32 weights, the core kernels, threads split by tokens.
absl::StatusOr<std::unique_ptr<MlpBackend>> CreateCpuBackend(ModelWeights weights,
                                                             int max_step_tokens, int threads);

}  // namespace ellm::mlp
