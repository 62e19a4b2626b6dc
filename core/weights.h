// Model weights as fp32 arrays, dequantised once at load from the GGUF file.
// Matrices are row-major [out, in] (a GGUF tensor of shape {in, out}).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/gguf.h"
#include "core/model_config.h"
#include "core/status.h"

namespace ellm {

struct LayerWeights {
  std::vector<float> attn_norm;  // [dim]
  std::vector<float> wq;         // [q_dim, dim]
  std::vector<float> wk;         // [kv_dim, dim]
  std::vector<float> wv;         // [kv_dim, dim]
  std::vector<float> wo;         // [dim, q_dim]
  std::vector<float> ffn_norm;   // [dim]
  std::vector<float> w_gate;     // [ffn_dim, dim]
  std::vector<float> w_up;       // [ffn_dim, dim]
  std::vector<float> w_down;     // [dim, ffn_dim]
};

struct ModelWeights {
  ModelConfig config;
  std::vector<float> token_embd;   // [vocab, dim]
  std::vector<LayerWeights> layers;
  std::vector<float> output_norm;  // [dim]
  std::vector<float> output;       // [vocab, dim]; token_embd when the file ties them
};

// Called after each tensor with (tensors done, tensors total).
using LoadProgress = std::function<void(int done, int total)>;

// Reads every tensor the config needs, checking names, shapes and types
// (InvalidArgument naming the tensor: missing, wrong shape, type ellm cannot
// read yet).
absl::StatusOr<ModelWeights> LoadWeights(const GgufFile& file, const ModelConfig& config,
                                         const LoadProgress& progress = nullptr);

// Reads one tensor as fp32 after checking its GGUF shape.
absl::StatusOr<std::vector<float>> ReadTensorF32(const GgufFile& file, const std::string& name,
                                                 const std::vector<int64_t>& shape);

}  // namespace ellm
