// The CUDA + cuBLAS MLP backend: bf16 weights on one GPU, fp32 activations,
// cuBLAS (bf16 inputs, fp32 accumulation) for every matrix product, small
// kernels (mlp-worker/cuda/kernels.h) for the rest. It supports the direct
// ring I/O of MlpBackend: q, k, v go from device memory straight into the
// (registered) ring slots and the attention output straight back.
//
// This header needs no CUDA headers; it exists only in builds with the CUDA
// toolkit (ELLM_HAVE_CUDA).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/model_config.h"
#include "core/status.h"
#include "core/weights.h"
#include "mlp-worker/backend.h"

namespace ellm::mlp {

struct CudaBackendOptions {
  int device = 0;
  // Replays each layer's kernel sequence (norm, projections, RoPE / O
  // projection, MLP) from a CUDA graph captured on its second use, for steps
  // of at most graph_max_tokens tokens (decode); larger steps launch directly.
  bool use_graphs = false;
  int graph_max_tokens = 64;
  // Copy q, k, v and the attention output between device and registered ring
  // memory with kernels that address the host memory directly (one launch per
  // direction); false: one cudaMemcpy2DAsync per shard and tensor.
  bool mapped_ring_io = true;
  // Called while the weights are uploaded: (tensors done, tensors total).
  LoadProgress progress;
};

// True when device `device` can be used. *why (optional) gets a short
// description of the device, or the reason there is none ("no NVIDIA driver
// (cudaErrorInsufficientDriver)", "no CUDA device", ...).
bool CudaDeviceAvailable(std::string* why, int device = 0);

// Uploads the weights once, as bf16 (norms and biases stay fp32), freeing
// each host tensor once it is on the device. Unavailable when the device is
// missing or busy, ResourceExhausted when the weights do not fit.
absl::StatusOr<std::unique_ptr<MlpBackend>> CreateCudaBackend(ModelWeights weights,
                                                              int max_step_tokens,
                                                              const CudaBackendOptions& options);

// A backend for `config` with random bf16 weights generated on the device
// (deterministic in `seed`; projections uniform with scale 1/sqrt(fan in),
// norms near 1), for benchmarks of models that are not on disk.
absl::StatusOr<std::unique_ptr<MlpBackend>> CreateCudaBackendRandom(
    const ModelConfig& config, uint64_t seed, int max_step_tokens,
    const CudaBackendOptions& options);

}  // namespace ellm::mlp
