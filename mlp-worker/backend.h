// MlpBackend: the model's non-attention math for one step of T tokens. The
// backend keeps the hidden states [T, dim] itself (on the device for CUDA);
// q/k/v and attention outputs cross the interface as host arrays, one per
// attention shard, in the token-major layout the rings carry.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/kv_heads.h"
#include "core/status.h"
#include "core/weights.h"

namespace ellm::mlp {

class MlpBackend {
 public:
  virtual ~MlpBackend() = default;
  virtual std::string name() const = 0;

  // One attention shard's part of a layer: its KV heads and the query heads
  // that map onto them, as host arrays (ring slots, in the StepRunner).
  struct ShardIo {
    KvHeads heads;
    float* q = nullptr;           // [T, shard q heads, head_dim]   (WriteQkvShards)
    float* k = nullptr;           // [T, shard kv heads, head_dim]
    float* v = nullptr;           // [T, shard kv heads, head_dim]
    const float* attn = nullptr;  // [T, shard q heads, head_dim]   (CompleteLayerFromShards)
  };

  // A step, in order:
  //   BeginStep                  embeds tokens[T] (positions[T] are used by RoPE).
  //   per layer:
  //     StageQkv                 computes q, k, v (RoPE applied) and keeps them.
  //     WriteQkvShards           writes each shard's heads of them to its pointers;
  //                              returns once the data is in host memory.
  //     CompleteLayerFromShards  reads the attention output from each shard's
  //                              `attn`: O projection, residual, norm, gated
  //                              MLP, residual. Returns once those buffers
  //                              have been read (they may then be reused),
  //                              possibly before the math has finished on a
  //                              device.
  //   ComputeLogits              final norm and LM head for the tokens rows[n]
  //                              of the step: logits [n, vocab].
  // The shards of one call must cover the model's KV heads in order
  // (InvalidArgument otherwise). Each backend moves the data its own way: the
  // CPU one copies, the CUDA one copies from device memory straight into the
  // ring slots.
  virtual absl::Status BeginStep(const int32_t* tokens, const int32_t* positions, int n_tokens) = 0;
  virtual absl::Status StageQkv(int layer) = 0;
  virtual absl::Status WriteQkvShards(const ShardIo* shards, int n_shards) = 0;
  virtual absl::Status CompleteLayerFromShards(int layer, const ShardIo* shards, int n_shards) = 0;
  virtual absl::Status ComputeLogits(const int32_t* rows, int n, float* logits) = 0;

  // Host memory (a ring segment) the backend may copy to and from directly;
  // registering is only an optimisation: unregistered host pointers work too.
  virtual absl::Status RegisterHostMemory(void* base, size_t bytes) { return absl::OkStatus(); }
  virtual void UnregisterHostMemory(void* base) {}
};

// The whole model as one shard, for callers without attention workers (tests,
// benchmarks): q [T, n_heads, head_dim], k and v [T, n_kv_heads, head_dim].
absl::Status ComputeQkv(MlpBackend& backend, int n_kv_heads, int layer, float* q, float* k,
                        float* v);
// attn [T, n_heads, head_dim]: CompleteLayerFromShards with one shard.
absl::Status CompleteLayer(MlpBackend& backend, int n_kv_heads, int layer, const float* attn);

// OK when shards[n] cover [0, n_kv_heads) in order and each has the buffers
// of its direction (q, k, v when `outputs`, attn otherwise).
absl::Status CheckShardIo(const MlpBackend::ShardIo* shards, int n_shards, int n_kv_heads,
                          bool outputs);

// The CPU backend. With weights loaded natively (LoadOptions::raw_matrices)
// each matrix keeps its GGUF type and runs on the int8/half kernels of
// cpu/matmul.h; with fp32 weights it uses kernels bit-identical to the
// reference forward. Threads split every product by output rows. `isa`
// forces the quantised kernels' instruction set ("auto": the fastest this
// CPU runs; core/cpu_features.h's IsaName for the others); one the CPU
// cannot run is an error. `q8_act_bits` (8, or 7) as cpu/matmul.h MatMul's:
// 7 has plain avx2 multiply Q8_0 weights with 7-bit activation codes.
absl::StatusOr<std::unique_ptr<MlpBackend>> CreateCpuBackend(ModelWeights weights,
                                                             int max_step_tokens, int threads,
                                                             const std::string& isa = "auto",
                                                             int q8_act_bits = 8);

}  // namespace ellm::mlp
