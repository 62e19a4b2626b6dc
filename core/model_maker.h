// Random models of any shape, written as GGUF: for tests and benchmarks that
// need a model of a given architecture, size and weight type. Weights are
// drawn so activations stay in a realistic range (each projection scaled by
// 1/sqrt(fan_in), norms at 1); the same options give the same bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/dtype.h"
#include "core/gguf.h"
#include "core/status.h"

namespace ellm {

struct MakeModelOptions {
  std::string arch = "llama";   // "llama" or "qwen2"
  int layers = 2;
  int hidden = 64;
  int heads = 4;
  int kv_heads = 4;
  int head_dim = 16;
  int ffn = 128;
  DType weight_type = DType::kF32;
  std::string vocab_from;       // GGUF whose tokenizer.* metadata the model gets
  int context = 0;              // 0: the vocab file's {arch}.context_length, else 4096
  uint64_t seed = 1;
  float rope_base = 0;          // 0: 1e6 for qwen2, 10000 for llama
  // tokenizer.chat_template to write: "" (keep the vocab file's, if any),
  // "chatml", "llama2", "llama3", or "none" (write none).
  std::string chat_template;
};

// Parses "f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k".
absl::StatusOr<DType> ParseWeightType(const std::string& name);

// Builds the model. `progress(done, total)` is called after each tensor.
// Tensors whose rows are not a whole number of the type's blocks are stored
// as F16 (as llama.cpp's quantiser falls back).
absl::StatusOr<GgufWriter> MakeRandomModel(
    const MakeModelOptions& options, const std::function<void(int, int)>& progress = nullptr);

}  // namespace ellm
