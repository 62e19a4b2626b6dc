// The single-process fp32 reference forward: the oracle every distributed
// path is compared against. One token at a time, llama2.c style: a config,
// the weights, the activations, and a contiguous KV cache.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/weights.h"

namespace ellm {

class ReferenceModel {
 public:
  // `max_positions` bounds the KV cache (default: the model's context).
  static absl::StatusOr<std::unique_ptr<ReferenceModel>> Create(ModelWeights weights,
                                                               int max_positions = 0);

  // Runs `token` at position `pos` (positions must come in order 0, 1, ...)
  // and returns the logits [vocab] for the next token.
  const std::vector<float>& Forward(int32_t token, int pos);
  // The same without the logits (a prompt token whose successor is known).
  void Feed(int32_t token, int pos);

  // Feeds `prompt` from position 0, then appends `n` greedy tokens.
  std::vector<int32_t> GenerateGreedy(const std::vector<int32_t>& prompt, int n);

  const ModelConfig& config() const { return w_.config; }

 private:
  explicit ReferenceModel(ModelWeights weights, int max_positions);

  ModelWeights w_;
  Rope rope_;
  int max_positions_;
  // Activations.
  std::vector<float> x_, xb_, q_, k_, v_, cos_sin_, att_out_, proj_, hb_, hb2_, scores_, logits_;
  // KV cache: [layers, max_positions, kv_dim] each.
  std::vector<float> key_cache_, value_cache_;
  std::vector<const float*> k_rows_, v_rows_;
};

}  // namespace ellm
