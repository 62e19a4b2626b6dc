// MlpBackend: the model's non-attention math for one step of T tokens. The
// backend keeps the hidden states [T, dim] itself (on the device for CUDA);
// q/k/v and attention outputs cross the interface as host arrays in token-major
// layout, which is what the rings carry.
#pragma once

#include <cstddef>
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

  // --- Direct ring I/O (optional) ---
  // A device backend can move q, k, v straight from its memory into the ring
  // slots and the attention output straight back, with no host copy between.
  // The StepRunner uses the calls below only when SupportsDirectIo() is true;
  // the defaults keep a backend without them (the CPU one) unchanged.
  virtual bool SupportsDirectIo() const { return false; }
  // Host memory (a ring segment) the backend may copy to and from directly;
  // registering is only an optimisation: unregistered host pointers work too.
  virtual absl::Status RegisterHostMemory(void* base, size_t bytes) { return absl::OkStatus(); }
  virtual void UnregisterHostMemory(void* base) {}

  // One attention shard's part of a layer: KV heads [kv_head_begin,
  // kv_head_end) and the query heads that map onto them, in host memory.
  struct ShardIo {
    int kv_head_begin = 0;
    int kv_head_end = 0;
    float* q = nullptr;             // [T, shard q heads, head_dim]   (WriteQkvShards)
    float* k = nullptr;             // [T, shard kv heads, head_dim]
    float* v = nullptr;             // [T, shard kv heads, head_dim]
    const float* attn = nullptr;    // [T, shard q heads, head_dim]   (CompleteLayerFromShards)
  };
  // Computes q, k, v of `layer` (as ComputeQkv) and keeps them in the backend.
  virtual absl::Status StageQkv(int layer) {
    return absl::UnimplementedError("StageQkv: no direct ring I/O in this backend");
  }
  // Writes the staged q, k, v heads of each shard to its pointers; returns
  // once the data is in host memory.
  virtual absl::Status WriteQkvShards(const ShardIo* shards, int n_shards) {
    return absl::UnimplementedError("WriteQkvShards: no direct ring I/O in this backend");
  }
  // CompleteLayer with the attention output read from each shard's `attn`;
  // returns once those host buffers have been read (they may then be reused),
  // possibly before the layer's math has finished on the device.
  virtual absl::Status CompleteLayerFromShards(int layer, const ShardIo* shards, int n_shards) {
    return absl::UnimplementedError("CompleteLayerFromShards: no direct ring I/O in this backend");
  }
};

// The CPU backend. With weights loaded natively (LoadOptions::raw_matrices)
// each matrix keeps its GGUF type and runs on the int8/half kernels of
// cpu/matmul.h; with fp32 weights it uses kernels bit-identical to the
// reference forward. Threads split every product by output rows. `isa`
// forces the quantised kernels' instruction set ("auto": the fastest this
// CPU runs; see cpu/matmul.h's MatIsaName for the others); one the CPU
// cannot run is an error.
absl::StatusOr<std::unique_ptr<MlpBackend>> CreateCpuBackend(ModelWeights weights,
                                                             int max_step_tokens, int threads,
                                                             const std::string& isa = "auto");

}  // namespace ellm::mlp
