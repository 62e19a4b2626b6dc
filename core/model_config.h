// Model shapes, read once from GGUF metadata; derived fields computed here only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/gguf.h"
#include "core/status.h"

namespace ellm {

// Rope scaling a GGUF file asks for ({arch}.rope.scaling.*); see core/rope.h
// for the frequencies each type gives.
enum class RopeScalingType { kNone, kLinear, kYarn };

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  float factor = 1;          // rope.scaling.factor (or rope.scale_linear): context extension
  int original_context = 0;  // yarn: rope.scaling.original_context_length (default context_length)
  float attn_factor = 1;     // rope.scaling.attn_factor: multiplies the rotation's cos and sin
  // YaRN's ramp between interpolated and extrapolated pairs, in rotations
  // over the original context (llama.cpp's defaults; llama, qwen2 and qwen3
  // files carry no key for them).
  float beta_fast = 32;
  float beta_slow = 1;
};

struct ModelConfig {
  std::string arch;         // "llama", "qwen2" or "qwen3"
  std::string name;         // general.name, informational
  int n_layers = 0;         // {arch}.block_count
  int dim = 0;              // {arch}.embedding_length
  int ffn_dim = 0;          // {arch}.feed_forward_length
  int n_heads = 0;          // {arch}.attention.head_count
  int n_kv_heads = 0;       // {arch}.attention.head_count_kv (default n_heads)
  int head_dim = 0;         // {arch}.attention.key_length, default dim / n_heads
  int rope_dims = 0;        // {arch}.rope.dimension_count, default head_dim
  float rope_base = 10000;  // {arch}.rope.freq_base, default 10000
  float norm_eps = 1e-5f;   // {arch}.attention.layer_norm_rms_epsilon (required)
  int context_length = 0;   // {arch}.context_length (Mistral-7B v0.1: at most its 4096-token window)
  int vocab_size = 0;       // length of tokenizer.ggml.tokens, else token_embd rows
  RopeScaling rope_scaling;
  // rope_freqs.weight [rope_dims / 2] (llama3 scaling, as llama.cpp's converter
  // writes it for Llama 3.1+): pair i's frequency is divided by factor i.
  // Empty when the file has none.
  std::vector<float> rope_freq_factors;
  // Set from the architecture: qwen2 and qwen3 use NeoX RoPE (pairs
  // (i, i + rope_dims/2)), llama interleaved pairs (2i, 2i+1); qwen2 has
  // biases on Q, K, V; qwen3 RMS-normalises each q and k head (weights
  // [head_dim], per layer) before RoPE.
  bool rope_neox = false;
  bool qkv_bias = false;
  bool qk_norm = false;

  // Derived.
  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
  int gqa_ratio() const { return n_heads / n_kv_heads; }

  // Reads and validates (positive sizes, n_heads % n_kv_heads == 0,
  // rope_dims even and <= head_dim...). Refused with an InvalidArgument that
  // names it: an unsupported architecture, and every metadata key or tensor
  // that would change the computation in a way ellm does not implement (an
  // unknown rope scaling type, soft-capping, a sliding window, experts, a
  // tensor the architecture does not use...): a model ellm cannot compute
  // faithfully is never served.
  static absl::StatusOr<ModelConfig> FromGguf(const GgufFile& file);
  // The checks FromGguf applies, for configs built by hand (tests).
  absl::Status Validate() const;
  std::string DebugString() const;
};

}  // namespace ellm
