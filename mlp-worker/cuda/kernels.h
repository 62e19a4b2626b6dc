// Small CUDA kernels of the GPU MLP backend, each with a host launcher that
// enqueues it on a stream and returns the launch error. They reproduce the
// CPU references of core/kernels.h in the same order of float operations
// (explicit round-to-nearest intrinsics, no fused multiply-add), so a kernel
// and its reference differ only where the CPU sums in another order (RMSNorm's
// fp64 sum) or CUDA's expf/cos/sin differ from libm by an ulp.
//
// Every pointer is device memory unless a comment says otherwise; matrices
// are row-major. bf16 values cross this header as their 16-bit pattern
// (bf16_t), so it compiles in plain C++.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace ellm::mlp::cuda {

using bf16_t = uint16_t;  // bfloat16 bit pattern

// x[t, :] = float(table[tokens[t], :]). tokens are checked on the host.
cudaError_t LaunchEmbed(const int32_t* tokens, const bf16_t* table, float* x, int n_tokens,
                        int dim, cudaStream_t stream);

// out[r, :] = RmsNorm(x[src, :]) * weight with src = rows ? rows[r] : r
// (core RmsNorm: fp64 sum of squares, scale = float(1 / sqrt(ss / n + eps)),
// out = x * scale * weight). x [*, dim], out [n_rows, dim].
cudaError_t LaunchRmsNorm(const float* x, const int32_t* rows, const float* weight, float* out,
                          int n_rows, int dim, float eps, cudaStream_t stream);
cudaError_t LaunchRmsNorm(const float* x, const int32_t* rows, const float* weight, bf16_t* out,
                          int n_rows, int dim, float eps, cudaStream_t stream);

// cos_sin[t, i] = {cos, sin}(positions[t] * freq[i]) * mscale for i < pairs,
// computed in fp64 and rounded to float as core Rope::CosSin does; freq
// [pairs] is Rope::freq() (scaling included). cos_sin is [n_tokens, pairs, 2].
cudaError_t LaunchRopeTable(const int32_t* positions, int n_tokens, int pairs, const double* freq,
                            double mscale, float* cos_sin, cudaStream_t stream);

// qwen3: in place on the q and k heads of qkv [n_tokens, row_stride] (q | k
// | v as for LaunchQkvBiasRope), RMS-normalises each head: head =
// RmsNorm(head) * weight, with q_norm [head_dim] for the q heads and k_norm
// [head_dim] for the k heads (core RmsNorm's arithmetic). Runs before
// LaunchQkvBiasRope; no architecture has both biases and q/k norms.
cudaError_t LaunchQkHeadNorm(float* qkv, int n_tokens, int row_stride, int n_heads, int n_kv_heads, int head_dim, const float* q_norm,
                             const float* k_norm, float eps, cudaStream_t stream);

// In place on the rows of a projection output qkv [n_tokens, row_stride]
// whose first q_dim + 2 * kv_dim columns are q | k | v: adds the bias
// ([q_dim + 2 * kv_dim], when not null), then rotates the q and k heads
// (QkvPostprocess: interleaved pairs (2i, 2i+1), or NeoX pairs (i, i + rope_dims/2)).
struct QkvRopeParams {
  float* qkv = nullptr;
  int n_tokens = 0;
  int row_stride = 0;
  const float* bias = nullptr;
  const float* cos_sin = nullptr;  // LaunchRopeTable's output for these tokens
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int rope_dims = 0;
  bool neox = false;
};
cudaError_t LaunchQkvBiasRope(const QkvRopeParams& p, cudaStream_t stream);

// out[t, i] = silu(gate[t, i]) * up[t, i] for i < n; gate and up rows are
// in_stride floats apart, out rows out_stride apart.
cudaError_t LaunchSwiGlu(const float* gate, const float* up, int64_t in_stride, float* out,
                         int64_t out_stride, int n_tokens, int n, cudaStream_t stream);
cudaError_t LaunchSwiGlu(const float* gate, const float* up, int64_t in_stride, bf16_t* out,
                         int64_t out_stride, int n_tokens, int n, cudaStream_t stream);

// out[i] = bf16(in[i]) (round to nearest even), i < n.
cudaError_t LaunchF32ToBf16(const float* in, bf16_t* out, int64_t n, cudaStream_t stream);

// Deterministic pseudo-random fills (a hash of seed and index, no state):
// out[i] = uniform in [-scale, scale) (bf16), or center + that (f32).
cudaError_t LaunchFillRandom(bf16_t* out, int64_t n, uint64_t seed, float scale,
                             cudaStream_t stream);
cudaError_t LaunchFillRandom(float* out, int64_t n, uint64_t seed, float center, float scale,
                             cudaStream_t stream);

// Copies between the step's q | k | v rows on the device and the attention
// shards' buffers, which are host memory seen through device pointers
// (cudaHostRegisterMapped + cudaHostGetDevicePointer), so the kernel itself
// writes and reads the ring slots. Shard s owns KV heads [kv_head_begin,
// kv_head_end) and query heads [begin * g, end * g) with g = n_heads / n_kv_heads.
inline constexpr int kMaxShards = 16;
struct ShardPtrs {
  float* q = nullptr;           // [T, shard q heads, head_dim]
  float* k = nullptr;           // [T, shard kv heads, head_dim]
  float* v = nullptr;           // [T, shard kv heads, head_dim]
  const float* attn = nullptr;  // [T, shard q heads, head_dim]
  int kv_head_begin = 0;
  int kv_head_end = 0;
};
struct ShardCopyParams {
  ShardPtrs shard[kMaxShards];
  int n_shards = 0;
  int n_tokens = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
};
// qkv [T, row_stride] (q | k | v columns) -> each shard's q, k, v.
cudaError_t LaunchScatterQkv(const ShardCopyParams& p, const float* qkv, int row_stride,
                             cudaStream_t stream);
// Each shard's attn -> attn_out [T, n_heads * head_dim] as bf16.
cudaError_t LaunchGatherAttn(const ShardCopyParams& p, bf16_t* attn_out, cudaStream_t stream);

}  // namespace ellm::mlp::cuda
