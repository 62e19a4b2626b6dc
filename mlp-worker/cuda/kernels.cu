// CUDA kernels of the GPU MLP backend (see kernels.h for the contracts).
// Float arithmetic that has a CPU reference uses the _rn intrinsics so that
// nvcc cannot contract a*b+c into an FMA the reference does not do.
#include "mlp-worker/cuda/kernels.h"

#include <cuda_bf16.h>

#include <algorithm>

namespace ellm::mlp::cuda {
namespace {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements.
unsigned GridFor(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 20));
}

__device__ inline void Store(float* p, float v) { *p = v; }
__device__ inline void Store(bf16_t* p, float v) {
  *reinterpret_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(v);
}
__device__ inline float LoadBf16(const bf16_t* p) {
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the total.
__device__ double BlockSum(double v) {
  __shared__ double warp_sums[32];
  __shared__ double total;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int n_warps = blockDim.x >> 5;
    v = lane < n_warps ? warp_sums[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

__global__ void EmbedKernel(const int32_t* tokens, const bf16_t* table, float* x, int dim) {
  const int t = blockIdx.x;
  const bf16_t* row = table + static_cast<int64_t>(tokens[t]) * dim;
  float* out = x + static_cast<int64_t>(t) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) out[i] = LoadBf16(row + i);
}

// One block per output row.
template <typename OutT>
__global__ void RmsNormKernel(const float* x, const int32_t* rows, const float* weight, OutT* out,
                              int dim, float eps) {
  const int r = blockIdx.x;
  const int src = rows != nullptr ? rows[r] : r;
  const float* xr = x + static_cast<int64_t>(src) * dim;
  double ss = 0;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    const double v = xr[i];
    ss += v * v;  // exact in fp64, as the reference's product
  }
  ss = BlockSum(ss);
  const float scale = static_cast<float>(1.0 / sqrt(ss / dim + static_cast<double>(eps)));
  OutT* o = out + static_cast<int64_t>(r) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    Store(o + i, __fmul_rn(__fmul_rn(xr[i], scale), weight[i]));
  }
}

__global__ void RopeTableKernel(const int32_t* positions, int n_tokens, int pairs, const double* freq,
                                double mscale, float* cos_sin) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(n_tokens) * pairs) return;
  const int t = static_cast<int>(idx / pairs), i = static_cast<int>(idx % pairs);
  const double angle = static_cast<double>(positions[t]) * freq[i];
  cos_sin[2 * idx] = static_cast<float>(cos(angle) * mscale);
  cos_sin[2 * idx + 1] = static_cast<float>(sin(angle) * mscale);
}

// One block per (head, token); heads [0, n_heads) are q, then the k heads.
__global__ void QkHeadNormKernel(float* qkv, int row_stride, int n_heads,
                                 int head_dim, const float* q_norm, const float* k_norm, float eps) {
  const int h = blockIdx.x, t = blockIdx.y;
  const int64_t col = static_cast<int64_t>(h) * head_dim;
  float* x = qkv + static_cast<int64_t>(t) * row_stride + col;
  const float* w = h < n_heads ? q_norm : k_norm;
  double ss = 0;
  for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
    const double v = x[i];
    ss += v * v;
  }
  ss = BlockSum(ss);
  const float scale = static_cast<float>(1.0 / sqrt(ss / head_dim + static_cast<double>(eps)));
  for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
    x[i] = __fmul_rn(__fmul_rn(x[i], scale), w[i]);
  }
}

// grid (column blocks, tokens); one thread per column of q | k | v. The
// thread holding the first element of a rotated pair rotates the pair.
__global__ void QkvBiasRopeKernel(QkvRopeParams p) {
  const int t = blockIdx.y;
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  const int hd = p.head_dim;
  const int qk_cols = (p.n_heads + p.n_kv_heads) * hd;
  const int cols = qk_cols + p.n_kv_heads * hd;
  if (e >= cols) return;
  float* row = p.qkv + static_cast<int64_t>(t) * p.row_stride;
  const int d = e % hd;
  if (e >= qk_cols || d >= p.rope_dims) {  // v, or a head's unrotated tail: bias only
    if (p.bias != nullptr) row[e] = __fadd_rn(row[e], p.bias[e]);
    return;
  }
  const int half = p.rope_dims / 2;
  int i, partner;
  if (p.neox) {
    if (d >= half) return;  // the second of a pair: its first rotates it
    i = d;
    partner = e + half;
  } else {
    if (d & 1) return;
    i = d / 2;
    partner = e + 1;
  }
  float a = row[e], b = row[partner];
  if (p.bias != nullptr) {
    a = __fadd_rn(a, p.bias[e]);
    b = __fadd_rn(b, p.bias[partner]);
  }
  const float* cs = p.cos_sin + (static_cast<int64_t>(t) * half + i) * 2;
  const float c = cs[0], s = cs[1];
  row[e] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  row[partner] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

// grid (column blocks, tokens).
template <typename OutT>
__global__ void SwiGluKernel(const float* gate, const float* up, int64_t in_stride, OutT* out,
                             int64_t out_stride, int n) {
  const int t = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = gate[t * in_stride + i];
  const float u = up[t * in_stride + i];
  Store(out + t * out_stride + i, __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u));
}

__global__ void F32ToBf16Kernel(const float* in, bf16_t* out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Store(out + i, in[i]);
  }
}

__host__ __device__ inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1) from (key, i).
__device__ inline float HashUniform(uint64_t key, int64_t i) {
  const uint64_t h = SplitMix64(key ^ SplitMix64(static_cast<uint64_t>(i)));
  return static_cast<float>(h >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

__global__ void FillRandomBf16Kernel(bf16_t* out, int64_t n, uint64_t key, float scale) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Store(out + i, HashUniform(key, i) * scale);
  }
}

__global__ void FillRandomF32Kernel(float* out, int64_t n, uint64_t key, float center,
                                    float scale) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = center + HashUniform(key, i) * scale;
  }
}

// grid (shards, tokens).
__global__ void ScatterQkvKernel(ShardCopyParams p, const float* qkv, int row_stride) {
  const ShardPtrs& s = p.shard[blockIdx.x];
  const int t = blockIdx.y;
  const int hd = p.head_dim, g = p.n_heads / p.n_kv_heads;
  const int kvh = s.kv_head_end - s.kv_head_begin;
  const int q_len = kvh * g * hd, kv_len = kvh * hd;
  const float* row = qkv + static_cast<int64_t>(t) * row_stride;
  const float* q_src = row + s.kv_head_begin * g * hd;
  const float* k_src = row + p.n_heads * hd + s.kv_head_begin * hd;
  const float* v_src = row + (p.n_heads + p.n_kv_heads) * hd + s.kv_head_begin * hd;
  float* q_dst = s.q + static_cast<int64_t>(t) * q_len;
  float* k_dst = s.k + static_cast<int64_t>(t) * kv_len;
  float* v_dst = s.v + static_cast<int64_t>(t) * kv_len;
  for (int i = threadIdx.x; i < q_len; i += blockDim.x) q_dst[i] = q_src[i];
  for (int i = threadIdx.x; i < kv_len; i += blockDim.x) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

// grid (shards, tokens). The source is host memory, each read a round trip
// over the bus: every thread issues kLoads reads before it waits on any.
__global__ void GatherAttnKernel(ShardCopyParams p, bf16_t* attn_out) {
  constexpr int kLoads = 8;
  const ShardPtrs& s = p.shard[blockIdx.x];
  const int t = blockIdx.y;
  const int hd = p.head_dim, g = p.n_heads / p.n_kv_heads;
  const int q_len = (s.kv_head_end - s.kv_head_begin) * g * hd;
  const float* src = s.attn + static_cast<int64_t>(t) * q_len;
  bf16_t* dst = attn_out + static_cast<int64_t>(t) * p.n_heads * hd + s.kv_head_begin * g * hd;
  for (int base = threadIdx.x; base < q_len; base += kLoads * blockDim.x) {
    float v[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = base + j * blockDim.x;
      v[j] = i < q_len ? src[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = base + j * blockDim.x;
      if (i < q_len) Store(dst + i, v[j]);
    }
  }
}

template <typename OutT>
cudaError_t RmsNormImpl(const float* x, const int32_t* rows, const float* weight, OutT* out,
                        int n_rows, int dim, float eps, cudaStream_t stream) {
  if (n_rows <= 0 || dim <= 0) return cudaSuccess;
  RmsNormKernel<OutT><<<n_rows, kThreads, 0, stream>>>(x, rows, weight, out, dim, eps);
  return cudaGetLastError();
}

template <typename OutT>
cudaError_t SwiGluImpl(const float* gate, const float* up, int64_t in_stride, OutT* out,
                       int64_t out_stride, int n_tokens, int n, cudaStream_t stream) {
  if (n_tokens <= 0 || n <= 0) return cudaSuccess;
  dim3 grid((n + kThreads - 1) / kThreads, n_tokens);
  SwiGluKernel<OutT><<<grid, kThreads, 0, stream>>>(gate, up, in_stride, out, out_stride, n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchEmbed(const int32_t* tokens, const bf16_t* table, float* x, int n_tokens,
                        int dim, cudaStream_t stream) {
  if (n_tokens <= 0 || dim <= 0) return cudaSuccess;
  EmbedKernel<<<n_tokens, kThreads, 0, stream>>>(tokens, table, x, dim);
  return cudaGetLastError();
}

cudaError_t LaunchRmsNorm(const float* x, const int32_t* rows, const float* weight, float* out,
                          int n_rows, int dim, float eps, cudaStream_t stream) {
  return RmsNormImpl(x, rows, weight, out, n_rows, dim, eps, stream);
}
cudaError_t LaunchRmsNorm(const float* x, const int32_t* rows, const float* weight, bf16_t* out,
                          int n_rows, int dim, float eps, cudaStream_t stream) {
  return RmsNormImpl(x, rows, weight, out, n_rows, dim, eps, stream);
}

cudaError_t LaunchRopeTable(const int32_t* positions, int n_tokens, int pairs, const double* freq,
                            double mscale, float* cos_sin, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(n_tokens) * pairs;
  if (n == 0) return cudaSuccess;
  RopeTableKernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      positions, n_tokens, pairs, freq, mscale, cos_sin);
  return cudaGetLastError();
}

cudaError_t LaunchQkHeadNorm(float* qkv, int n_tokens, int row_stride, int n_heads, int n_kv_heads, int head_dim, const float* q_norm,
                             const float* k_norm, float eps, cudaStream_t stream) {
  if (n_tokens == 0) return cudaSuccess;
  // A multiple of 32 (BlockSum), about one thread per element.
  const int threads = std::min(1024, (head_dim + 31) / 32 * 32);
  QkHeadNormKernel<<<dim3(n_heads + n_kv_heads, n_tokens), threads, 0, stream>>>(
      qkv, row_stride, n_heads, head_dim, q_norm, k_norm, eps);
  return cudaGetLastError();
}

cudaError_t LaunchQkvBiasRope(const QkvRopeParams& p, cudaStream_t stream) {
  const int cols = (p.n_heads + 2 * p.n_kv_heads) * p.head_dim;
  if (p.n_tokens <= 0 || cols <= 0) return cudaSuccess;
  dim3 grid((cols + kThreads - 1) / kThreads, p.n_tokens);
  QkvBiasRopeKernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchSwiGlu(const float* gate, const float* up, int64_t in_stride, float* out,
                         int64_t out_stride, int n_tokens, int n, cudaStream_t stream) {
  return SwiGluImpl(gate, up, in_stride, out, out_stride, n_tokens, n, stream);
}
cudaError_t LaunchSwiGlu(const float* gate, const float* up, int64_t in_stride, bf16_t* out,
                         int64_t out_stride, int n_tokens, int n, cudaStream_t stream) {
  return SwiGluImpl(gate, up, in_stride, out, out_stride, n_tokens, n, stream);
}

cudaError_t LaunchF32ToBf16(const float* in, bf16_t* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  F32ToBf16Kernel<<<GridFor(n), kThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

cudaError_t LaunchFillRandom(bf16_t* out, int64_t n, uint64_t seed, float scale,
                             cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FillRandomBf16Kernel<<<GridFor(n), kThreads, 0, stream>>>(out, n, SplitMix64(seed), scale);
  return cudaGetLastError();
}
cudaError_t LaunchFillRandom(float* out, int64_t n, uint64_t seed, float center, float scale,
                             cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FillRandomF32Kernel<<<GridFor(n), kThreads, 0, stream>>>(out, n, SplitMix64(seed), center,
                                                           scale);
  return cudaGetLastError();
}

cudaError_t LaunchScatterQkv(const ShardCopyParams& p, const float* qkv, int row_stride,
                             cudaStream_t stream) {
  if (p.n_shards <= 0 || p.n_tokens <= 0) return cudaSuccess;
  if (p.n_shards > kMaxShards) return cudaErrorInvalidValue;
  ScatterQkvKernel<<<dim3(p.n_shards, p.n_tokens), kThreads, 0, stream>>>(p, qkv, row_stride);
  return cudaGetLastError();
}

cudaError_t LaunchGatherAttn(const ShardCopyParams& p, bf16_t* attn_out, cudaStream_t stream) {
  if (p.n_shards <= 0 || p.n_tokens <= 0) return cudaSuccess;
  if (p.n_shards > kMaxShards) return cudaErrorInvalidValue;
  GatherAttnKernel<<<dim3(p.n_shards, p.n_tokens), kThreads, 0, stream>>>(p, attn_out);
  return cudaGetLastError();
}

}  // namespace ellm::mlp::cuda
