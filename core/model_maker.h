// Random models of any shape, written as GGUF: for tests and benchmarks that
// need a model of a given architecture, size and weight type. Weights are
// drawn so activations stay in a realistic range (each projection scaled by
// 1/sqrt(fan_in), norms at 1); the same options give the same bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/gguf.h"
#include "core/status.h"

namespace ellm {

struct MakeModelOptions {
  std::string arch = "llama";   // "llama", "qwen2" or "qwen3"
  int layers = 2;
  int hidden = 64;
  int heads = 4;
  int kv_heads = 4;
  int head_dim = 16;
  int ffn = 128;
  DType weight_type = DType::kF32;
  // token_embd (and output) type; unset: weight_type. (As llama.cpp's
  // quantize --token-embedding-type: the vocabulary matrices are the
  // largest, and the k-quant search is slow on them.)
  std::optional<DType> embedding_type;
  std::string vocab_from;       // GGUF whose tokenizer.* metadata the model gets
  int context = 0;              // 0: the vocab file's {arch}.context_length, else 4096
  uint64_t seed = 1;
  float rope_base = 0;          // 0: 1e6 for qwen2 and qwen3, 10000 for llama
  // Rope scaling as the GGUF converters write it: "" (none), "linear" and
  // "yarn" ({arch}.rope.scaling.* keys), "llama3" (a rope_freqs.weight tensor
  // of Meta's llama3 factors, llama only).
  std::string rope_scaling;
  float rope_factor = 0;           // 0: 8 for llama3, 4 for yarn, 2 for linear
  int rope_original_context = 0;   // yarn, llama3: 0 means context / factor
  float rope_low_freq_factor = 1;  // llama3
  float rope_high_freq_factor = 4; // llama3
  float rope_attn_factor = 0;      // rope.scaling.attn_factor; 0 writes no key
  // tokenizer.chat_template to write: "" (keep the vocab file's, if any),
  // "chatml", "qwen3" (ChatML with thinking markers), "llama2", "llama3", or
  // "none" (write none).
  std::string chat_template;
};

// Meta's llama3 rope frequency factors, one per rotated pair (what llama.cpp's
// converter writes into rope_freqs.weight for Llama 3.1+): wavelengths below
// original_context / high_freq_factor keep their frequency, those above
// original_context / low_freq_factor are divided by `factor`, and those
// between are smoothed from one to the other.
std::vector<float> Llama3RopeFactors(int rope_dims, double base, double factor, double low_freq_factor,
                                     double high_freq_factor, double original_context);

// Parses "f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k".
absl::StatusOr<DType> ParseWeightType(const std::string& name);

// Builds the model. `progress(done, total)` is called after each tensor.
// Tensors whose rows are not a whole number of the type's blocks are stored
// as F16 (as llama.cpp's quantiser falls back).
absl::StatusOr<GgufWriter> MakeRandomModel(
    const MakeModelOptions& options, const std::function<void(int, int)>& progress = nullptr);

}  // namespace ellm
