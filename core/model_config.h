// Model shapes, read once from GGUF metadata; derived fields computed here only.
#pragma once

#include <cstdint>
#include <string>

#include "core/gguf.h"
#include "core/status.h"

namespace ellm {

struct ModelConfig {
  std::string arch;         // "llama" or "qwen2"
  std::string name;         // general.name, informational
  int n_layers = 0;         // {arch}.block_count
  int dim = 0;              // {arch}.embedding_length
  int ffn_dim = 0;          // {arch}.feed_forward_length
  int n_heads = 0;          // {arch}.attention.head_count
  int n_kv_heads = 0;       // {arch}.attention.head_count_kv (default n_heads)
  int head_dim = 0;         // {arch}.attention.key_length, default dim / n_heads
  int rope_dims = 0;        // {arch}.rope.dimension_count, default head_dim
  float rope_base = 10000;  // {arch}.rope.freq_base, default 10000
  float norm_eps = 1e-5f;   // {arch}.attention.layer_norm_rms_epsilon, default 1e-5
  int context_length = 0;   // {arch}.context_length
  int vocab_size = 0;       // length of tokenizer.ggml.tokens, else token_embd rows
  // Set from the architecture: qwen2 uses NeoX RoPE (pairs (i, i + rope_dims/2))
  // and biases on Q, K, V; llama uses interleaved pairs (2i, 2i+1), no biases.
  bool rope_neox = false;
  bool qkv_bias = false;

  // Derived.
  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
  int gqa_ratio() const { return n_heads / n_kv_heads; }

  // Reads and validates (positive sizes, n_heads % n_kv_heads == 0,
  // rope_dims even and <= head_dim...). Unsupported architectures are an
  // InvalidArgument naming the architecture.
  static absl::StatusOr<ModelConfig> FromGguf(const GgufFile& file);
  // The checks FromGguf applies, for configs built by hand (tests).
  absl::Status Validate() const;
  std::string DebugString() const;
};

}  // namespace ellm
