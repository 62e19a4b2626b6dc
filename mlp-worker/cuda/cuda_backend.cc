// CUDA backend: the CPU backend's math (cpu/cpu_backend.cc) on one GPU.
//
// Per step of T tokens, all on one stream:
//   BeginStep:  tokens, positions -> device; x [T, dim] = embeddings (fp32);
//               the RoPE cos/sin table of the step's positions.
//   StageQkv:   xb = RmsNorm(x) (bf16); qkv [T, q|k|v] = xb · Wqkv^T (one
//               cuBLAS product over the fused q, k, v rows); bias + RoPE.
//   q, k, v go to the attention shards; their output comes back as
//   attn [T, q_dim] (bf16), then
//   MLP phase:  x += attn · Wo^T (cuBLAS, beta = 1 is the residual);
//               xb = RmsNorm(x); gu [T, 2 ffn] = xb · Wgate_up^T;
//               h = silu(gate) * up (bf16); x += h · Wdown^T.
//   ComputeLogits: RmsNorm of the sampled rows, LM head, fp32 logits to host.
// Weights are bf16 (norms and biases fp32); products accumulate in fp32. The
// host waits on the device only where it must: when q, k, v must be in host
// memory, when the attention output has been read, and for the logits.
#include "mlp-worker/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/log.h"
#include "mlp-worker/cuda/cuda_util.h"
#include "mlp-worker/cuda/kernels.h"

namespace ellm::mlp {
namespace {

using cuda::bf16_t;
using cuda::DeviceArray;
using cuda::PinnedArray;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

struct DeviceLayer {
  DeviceArray<bf16_t> wqkv;       // [q_dim + 2 kv_dim, dim]: rows of wq | wk | wv
  DeviceArray<float> bqkv;        // [q_dim + 2 kv_dim] when config.qkv_bias
  DeviceArray<float> qk_norm;     // [2, head_dim]: q_norm | k_norm when config.qk_norm
  DeviceArray<bf16_t> wo;         // [dim, q_dim]
  DeviceArray<bf16_t> w_gate_up;  // [2 ffn, dim]: rows of w_gate | w_up
  DeviceArray<bf16_t> w_down;     // [dim, ffn]
  DeviceArray<float> attn_norm;   // [dim]
  DeviceArray<float> ffn_norm;    // [dim]
};

// Bytes of device memory the weights take (tied output counted once).
size_t WeightBytes(const ModelConfig& c, bool tied) {
  const size_t dim = c.dim, qkv = c.q_dim() + 2 * c.kv_dim(), ffn = c.ffn_dim;
  size_t layer = 2 * (qkv * dim + dim * c.q_dim() + 2 * ffn * dim + dim * ffn) + 4 * 2 * dim;
  if (c.qkv_bias) layer += 4 * qkv;
  if (c.qk_norm) layer += 4 * 2 * static_cast<size_t>(c.head_dim);
  const size_t embd = 2 * static_cast<size_t>(c.vocab_size) * dim;
  return c.n_layers * layer + embd * (tied ? 1 : 2) + 4 * dim;
}

// Makes `device` current and creates its context, so that a missing, busy
// (exclusive mode) or unusable device is an error here rather than later.
absl::StatusOr<cudaDeviceProp> OpenDevice(int device) {
  std::string why;
  if (!CudaDeviceAvailable(&why, device)) {
    return absl::UnavailableError(absl::StrCat("no CUDA device: ", why));
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaDeviceProp prop;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  const cudaError_t e = cudaFree(nullptr);
  if (e != cudaSuccess) {
    absl::Status st = cuda::ErrorStatus(e, "cudaFree(nullptr)", __FILE__, __LINE__);
    return absl::UnavailableError(absl::StrFormat("CUDA device %d (%s) is busy or unusable: %s",
                                                  device, prop.name, st.message()));
  }
  return prop;
}

class CudaBackend final : public MlpBackend {
 public:
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const ModelConfig& c,
                                                             int max_step_tokens,
                                                             const CudaBackendOptions& options,
                                                             bool tied_output) {
    RETURN_IF_ERROR(c.Validate());
    if (max_step_tokens <= 0) return absl::InvalidArgumentError("max_step_tokens must be positive");
    // The per-token kernels put the step's tokens on the grid's y axis.
    if (max_step_tokens > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("--max-step-tokens ", max_step_tokens,
                                                     " is over the CUDA backend's 65535 (its grids' y extent)"));
    }
    ASSIGN_OR_RETURN(cudaDeviceProp prop, OpenDevice(options.device));
    std::unique_ptr<CudaBackend> b(new CudaBackend(c, max_step_tokens, options));
    b->device_name_ = prop.name;
    RETURN_IF_ERROR(b->Allocate(tied_output));
    return b;
  }

  ~CudaBackend() override {
    cudaSetDevice(options_.device);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_.get());
    graphs_.clear();
    registrations_.clear();
  }

  std::string name() const override {
    return absl::StrFormat("cuda:%d %s (bf16 weights, cuBLAS%s)", options_.device, device_name_,
                           graphs_enabled_ ? ", CUDA graphs" : "");
  }

  absl::Status BeginStep(const int32_t* tokens, const int32_t* positions, int n) override {
    if (n <= 0 || n > max_tokens_) {
      return absl::InvalidArgumentError(
          absl::StrCat("step of ", n, " tokens (max ", max_tokens_, ")"));
    }
    for (int t = 0; t < n; ++t) {
      if (tokens[t] < 0 || tokens[t] >= c_.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", tokens[t], " out of range"));
      }
      if (positions[t] < 0) {
        return absl::InvalidArgumentError(absl::StrCat("position ", positions[t], " out of range"));
      }
    }
    RETURN_IF_ERROR(Current());
    cudaStream_t s = stream_.get();
    // The previous upload from the staging buffer must be done before it is rewritten.
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staging_free_.get()));
    std::memcpy(staging_.get(), tokens, n * sizeof(int32_t));
    std::memcpy(staging_.get() + max_tokens_, positions, n * sizeof(int32_t));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tokens_d(), staging_.get(), n * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, s));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(positions_d(), staging_.get() + max_tokens_,
                                         n * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(staging_free_.get(), s));
    CUDA_RETURN_IF_ERROR(cuda::LaunchEmbed(tokens_d(), embd_.get(), x_.get(), n, c_.dim, s));
    CUDA_RETURN_IF_ERROR(
        cuda::LaunchRopeTable(positions_d(), n, rope_.pairs(), rope_freq_.get(), rope_.mscale(), cos_sin_.get(), s));
    n_ = n;
    return absl::OkStatus();
  }

  absl::Status ComputeLogits(const int32_t* rows, int n, float* logits) override {
    for (int i = 0; i < n; ++i) {
      if (rows[i] < 0 || rows[i] >= n_) return absl::InvalidArgumentError("logits row out of range");
    }
    if (n <= 0) return absl::OkStatus();
    if (n > max_tokens_) {
      return absl::InvalidArgumentError(
          absl::StrCat(n, " logits rows (max ", max_tokens_, ")"));
    }
    RETURN_IF_ERROR(Current());
    cudaStream_t s = stream_.get();
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staging_free_.get()));
    std::memcpy(staging_.get() + 2 * max_tokens_, rows, n * sizeof(int32_t));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(rows_d(), staging_.get() + 2 * max_tokens_,
                                         n * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(staging_free_.get(), s));
    CUDA_RETURN_IF_ERROR(cuda::LaunchRmsNorm(x_.get(), rows_d(), output_norm_.get(), xb_.get(), n,
                                             c_.dim, c_.norm_eps, s));
    RETURN_IF_ERROR(cuda::GemmBf16(cublas_.get(), output_w_, c_.vocab_size, c_.dim, xb_.get(), n,
                                   logits_.get(), 0.0f));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits, logits_.get(),
                                         static_cast<size_t>(n) * c_.vocab_size * sizeof(float),
                                         cudaMemcpyDeviceToHost, s));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    return absl::OkStatus();
  }

  // --- Ring I/O: device memory straight to and from the ring slots ---
  absl::Status RegisterHostMemory(void* base, size_t bytes) override {
    RETURN_IF_ERROR(Current());
    if (DevicePointer(base, bytes) != nullptr) return absl::OkStatus();
    ASSIGN_OR_RETURN(auto reg, cuda::HostRegistration::Create(base, bytes));
    registrations_.push_back(std::move(reg));
    return absl::OkStatus();
  }

  void UnregisterHostMemory(void* base) override {
    if (!Current().ok()) return;
    cudaStreamSynchronize(stream_.get());  // nothing in flight may still touch it
    std::erase_if(registrations_, [&](const auto& r) { return r->host() == base; });
  }

  absl::Status StageQkv(int layer) override {
    RETURN_IF_ERROR(CheckLayer(layer));
    RETURN_IF_ERROR(Current());
    return RunPhase(layer, Phase::kQkv);
  }

  absl::Status WriteQkvShards(const ShardIo* shards, int n_shards) override {
    RETURN_IF_ERROR(CheckShards(shards, n_shards, /*outputs=*/true));
    RETURN_IF_ERROR(Current());
    cudaStream_t s = stream_.get();
    cuda::ShardCopyParams p;
    if (MapShards(shards, n_shards, /*outputs=*/true, &p)) {
      CUDA_RETURN_IF_ERROR(cuda::LaunchScatterQkv(p, qkv_.get(), qkv_dim(), s));
    } else {
      const int hd = c_.head_dim, g = c_.gqa_ratio();
      const size_t row = qkv_dim() * sizeof(float);
      for (int i = 0; i < n_shards; ++i) {
        const ShardIo& io = shards[i];
        const int kvh = io.heads.count();
        const size_t qb = static_cast<size_t>(kvh) * g * hd * sizeof(float);
        const size_t kvb = static_cast<size_t>(kvh) * hd * sizeof(float);
        const float* base = qkv_.get();
        CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(io.q, qb, base + io.heads.begin * g * hd, row, qb,
                                               n_, cudaMemcpyDeviceToHost, s));
        CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(io.k, kvb, base + c_.q_dim() + io.heads.begin * hd,
                                               row, kvb, n_, cudaMemcpyDeviceToHost, s));
        CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
            io.v, kvb, base + c_.q_dim() + c_.kv_dim() + io.heads.begin * hd, row, kvb, n_,
            cudaMemcpyDeviceToHost, s));
      }
    }
    // The host must see q, k, v before it publishes the ring slots.
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    return absl::OkStatus();
  }

  absl::Status CompleteLayerFromShards(int layer, const ShardIo* shards, int n_shards) override {
    RETURN_IF_ERROR(CheckLayer(layer));
    RETURN_IF_ERROR(CheckShards(shards, n_shards, /*outputs=*/false));
    RETURN_IF_ERROR(Current());
    cudaStream_t s = stream_.get();
    cuda::ShardCopyParams p;
    if (MapShards(shards, n_shards, /*outputs=*/false, &p)) {
      CUDA_RETURN_IF_ERROR(cuda::LaunchGatherAttn(p, attn_bf16_.get(), s));
      CUDA_RETURN_IF_ERROR(cudaEventRecord(attn_read_.get(), s));
    } else {
      const int hd = c_.head_dim, g = c_.gqa_ratio();
      for (int i = 0; i < n_shards; ++i) {
        const ShardIo& io = shards[i];
        const size_t qb =
            static_cast<size_t>(io.heads.count()) * g * hd * sizeof(float);
        CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(attn_f32_.get() + io.heads.begin * g * hd,
                                               c_.q_dim() * sizeof(float), io.attn, qb, qb, n_,
                                               cudaMemcpyHostToDevice, s));
      }
      CUDA_RETURN_IF_ERROR(cudaEventRecord(attn_read_.get(), s));
      CUDA_RETURN_IF_ERROR(cuda::LaunchF32ToBf16(
          attn_f32_.get(), attn_bf16_.get(), static_cast<int64_t>(n_) * c_.q_dim(), s));
    }
    // The layer's math is queued before the host waits, so the device runs on.
    RETURN_IF_ERROR(RunPhase(layer, Phase::kMlp));
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(attn_read_.get()));
    return absl::OkStatus();
  }

  // --- Weights ---
  // Uploads `w` as bf16 (fp32 for norms and biases), freeing each host tensor
  // once it is on the device.
  absl::Status UploadWeights(ModelWeights& w, bool tied, const LoadProgress& progress) {
    RETURN_IF_ERROR(Current());
    const int total = 3 + (9 + (c_.qkv_bias ? 3 : 0) + (c_.qk_norm ? 2 : 0)) * c_.n_layers;
    int done = 0;
    auto tick = [&] {
      ++done;
      if (progress) progress(done, total);
    };
    const size_t dim = c_.dim, qd = c_.q_dim(), kvd = c_.kv_dim(), ffn = c_.ffn_dim;
    RETURN_IF_ERROR(ToBf16(w.token_embd, "token_embd", static_cast<size_t>(c_.vocab_size) * dim, embd_.get()));
    tick();
    for (int l = 0; l < c_.n_layers; ++l) {
      LayerWeights& L = w.layers[l];
      DeviceLayer& D = layers_[l];
      const std::string p = absl::StrCat("blk.", l, ".");
      RETURN_IF_ERROR(ToF32(L.attn_norm, p + "attn_norm", dim, D.attn_norm.get()));
      tick();
      RETURN_IF_ERROR(ToBf16(L.wq, p + "attn_q", qd * dim, D.wqkv.get()));
      tick();
      RETURN_IF_ERROR(ToBf16(L.wk, p + "attn_k", kvd * dim, D.wqkv.get() + qd * dim));
      tick();
      RETURN_IF_ERROR(ToBf16(L.wv, p + "attn_v", kvd * dim, D.wqkv.get() + (qd + kvd) * dim));
      tick();
      if (c_.qkv_bias) {
        RETURN_IF_ERROR(ToF32(L.bq, p + "attn_q.bias", qd, D.bqkv.get()));
        tick();
        RETURN_IF_ERROR(ToF32(L.bk, p + "attn_k.bias", kvd, D.bqkv.get() + qd));
        tick();
        RETURN_IF_ERROR(ToF32(L.bv, p + "attn_v.bias", kvd, D.bqkv.get() + qd + kvd));
        tick();
      }
      if (c_.qk_norm) {
        RETURN_IF_ERROR(ToF32(L.q_norm, p + "attn_q_norm", c_.head_dim, D.qk_norm.get()));
        tick();
        RETURN_IF_ERROR(ToF32(L.k_norm, p + "attn_k_norm", c_.head_dim, D.qk_norm.get() + c_.head_dim));
        tick();
      }
      RETURN_IF_ERROR(ToBf16(L.wo, p + "attn_output", dim * qd, D.wo.get()));
      tick();
      RETURN_IF_ERROR(ToF32(L.ffn_norm, p + "ffn_norm", dim, D.ffn_norm.get()));
      tick();
      RETURN_IF_ERROR(ToBf16(L.w_gate, p + "ffn_gate", ffn * dim, D.w_gate_up.get()));
      tick();
      RETURN_IF_ERROR(ToBf16(L.w_up, p + "ffn_up", ffn * dim, D.w_gate_up.get() + ffn * dim));
      tick();
      RETURN_IF_ERROR(ToBf16(L.w_down, p + "ffn_down", dim * ffn, D.w_down.get()));
      tick();
    }
    RETURN_IF_ERROR(ToF32(w.output_norm, "output_norm", dim, output_norm_.get()));
    tick();
    if (tied) {
      std::vector<float>().swap(w.output);
    } else {
      RETURN_IF_ERROR(ToBf16(w.output, "output", static_cast<size_t>(c_.vocab_size) * dim, output_.get()));
    }
    tick();
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
    upload_.reset();
    return absl::OkStatus();
  }

  // Random weights (see CreateCudaBackendRandom), generated on the device.
  absl::Status RandomWeights(uint64_t seed) {
    RETURN_IF_ERROR(Current());
    cudaStream_t s = stream_.get();
    uint64_t tensor = 0;
    auto next = [&] { return seed * 0x100000001B3ull + (++tensor); };
    auto proj = [&](const DeviceArray<bf16_t>& a, int fan_in) {
      return cuda::LaunchFillRandom(a.get(), static_cast<int64_t>(a.size()), next(),
                                    std::sqrt(3.0f / fan_in), s);
    };
    CUDA_RETURN_IF_ERROR(cuda::LaunchFillRandom(embd_.get(), static_cast<int64_t>(embd_.size()),
                                                next(), 1.0f, s));
    for (DeviceLayer& D : layers_) {
      CUDA_RETURN_IF_ERROR(proj(D.wqkv, c_.dim));
      CUDA_RETURN_IF_ERROR(proj(D.wo, c_.q_dim()));
      CUDA_RETURN_IF_ERROR(proj(D.w_gate_up, c_.dim));
      CUDA_RETURN_IF_ERROR(proj(D.w_down, c_.ffn_dim));
      CUDA_RETURN_IF_ERROR(
          cuda::LaunchFillRandom(D.attn_norm.get(), c_.dim, next(), 1.0f, 0.1f, s));
      CUDA_RETURN_IF_ERROR(cuda::LaunchFillRandom(D.ffn_norm.get(), c_.dim, next(), 1.0f, 0.1f, s));
      if (c_.qkv_bias) {
        CUDA_RETURN_IF_ERROR(cuda::LaunchFillRandom(
            D.bqkv.get(), static_cast<int64_t>(D.bqkv.size()), next(), 0.0f, 0.1f, s));
      }
      if (c_.qk_norm) {
        CUDA_RETURN_IF_ERROR(cuda::LaunchFillRandom(
            D.qk_norm.get(), static_cast<int64_t>(D.qk_norm.size()), next(), 1.0f, 0.1f, s));
      }
    }
    CUDA_RETURN_IF_ERROR(
        cuda::LaunchFillRandom(output_norm_.get(), c_.dim, next(), 1.0f, 0.1f, s));
    if (output_.get() != nullptr) CUDA_RETURN_IF_ERROR(proj(output_, c_.dim));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    return absl::OkStatus();
  }

 private:
  enum class Phase { kQkv = 0, kMlp = 1 };

  struct GraphEntry {
    int uses = 0;
    cuda::GraphExecOwner exec;
  };

  // fp32 -> bf16 uploads go through two pinned chunks and a device scratch,
  // converting on the device; alive only while the weights are uploaded.
  struct Uploader {
    static constexpr size_t kChunk = size_t{8} << 20;  // floats
    PinnedArray<float> host[2];
    DeviceArray<float> scratch[2];
    cuda::EventOwner done[2];
  };

  CudaBackend(const ModelConfig& c, int max_step_tokens, const CudaBackendOptions& options)
      : c_(c),
        rope_(c),
        max_tokens_(max_step_tokens),
        options_(options),
        graphs_enabled_(options.use_graphs) {
    options_.progress = nullptr;  // only the factory's upload reports progress
  }

  int qkv_dim() const { return c_.q_dim() + 2 * c_.kv_dim(); }
  int32_t* tokens_d() const { return ints_.get(); }
  int32_t* positions_d() const { return ints_.get() + max_tokens_; }
  int32_t* rows_d() const { return ints_.get() + 2 * max_tokens_; }

  // Every entry point may run on a thread whose current device is another.
  absl::Status Current() const {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
    return absl::OkStatus();
  }

  absl::Status CheckLayer(int layer) const {
    if (n_ <= 0) return absl::FailedPreconditionError("no step begun (BeginStep first)");
    if (layer < 0 || layer >= c_.n_layers) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
    }
    return absl::OkStatus();
  }

  // The shards must cover the KV heads in order, with every buffer given.
  absl::Status CheckShards(const ShardIo* shards, int n_shards, bool outputs) const {
    if (n_ <= 0) return absl::FailedPreconditionError("no step begun (BeginStep first)");
    return CheckShardIo(shards, n_shards, c_.n_kv_heads, outputs);
  }

  // Device address of the registered host range [p, p + bytes), or nullptr.
  void* DevicePointer(const void* p, size_t bytes) const {
    for (const auto& r : registrations_) {
      void* d = r->DevicePointer(p);
      if (d != nullptr && static_cast<const char*>(p) + bytes <=
                              static_cast<const char*>(r->host()) + r->bytes()) {
        return d;
      }
    }
    return nullptr;
  }

  // Fills `p` with device addresses of the shards' buffers when the mapped
  // path is on and every buffer lies in registered memory.
  bool MapShards(const ShardIo* shards, int n_shards, bool outputs, cuda::ShardCopyParams* p) const {
    if (!options_.mapped_ring_io || n_shards > cuda::kMaxShards) return false;
    const int hd = c_.head_dim, g = c_.gqa_ratio();
    p->n_shards = n_shards;
    p->n_tokens = n_;
    p->n_heads = c_.n_heads;
    p->n_kv_heads = c_.n_kv_heads;
    p->head_dim = hd;
    for (int i = 0; i < n_shards; ++i) {
      const ShardIo& io = shards[i];
      const size_t kvh = io.heads.count();
      const size_t qb = static_cast<size_t>(n_) * kvh * g * hd * sizeof(float);
      const size_t kvb = static_cast<size_t>(n_) * kvh * hd * sizeof(float);
      cuda::ShardPtrs& d = p->shard[i];
      d.kv_head_begin = io.heads.begin;
      d.kv_head_end = io.heads.end;
      if (outputs) {
        d.q = static_cast<float*>(DevicePointer(io.q, qb));
        d.k = static_cast<float*>(DevicePointer(io.k, kvb));
        d.v = static_cast<float*>(DevicePointer(io.v, kvb));
        if (!d.q || !d.k || !d.v) return false;
      } else {
        d.attn = static_cast<const float*>(DevicePointer(io.attn, qb));
        if (!d.attn) return false;
      }
    }
    return true;
  }

  absl::Status EnqueueQkv(int layer) {
    const DeviceLayer& L = layers_[layer];
    cudaStream_t s = stream_.get();
    CUDA_RETURN_IF_ERROR(cuda::LaunchRmsNorm(x_.get(), nullptr, L.attn_norm.get(), xb_.get(), n_,
                                             c_.dim, c_.norm_eps, s));
    RETURN_IF_ERROR(cuda::GemmBf16(cublas_.get(), L.wqkv.get(), qkv_dim(), c_.dim, xb_.get(), n_,
                                   qkv_.get(), 0.0f));
    if (c_.qk_norm) {
      CUDA_RETURN_IF_ERROR(cuda::LaunchQkHeadNorm(qkv_.get(), n_, qkv_dim(), c_.n_heads,
                                                  c_.n_kv_heads, c_.head_dim, L.qk_norm.get(),
                                                  L.qk_norm.get() + c_.head_dim, c_.norm_eps, s));
    }
    cuda::QkvRopeParams p;
    p.qkv = qkv_.get();
    p.n_tokens = n_;
    p.row_stride = qkv_dim();
    p.bias = c_.qkv_bias ? L.bqkv.get() : nullptr;
    p.cos_sin = cos_sin_.get();
    p.n_heads = c_.n_heads;
    p.n_kv_heads = c_.n_kv_heads;
    p.head_dim = c_.head_dim;
    p.rope_dims = c_.rope_dims;
    p.neox = c_.rope_neox;
    CUDA_RETURN_IF_ERROR(cuda::LaunchQkvBiasRope(p, s));
    return absl::OkStatus();
  }

  // Reads attn_bf16_.
  absl::Status EnqueueMlp(int layer) {
    const DeviceLayer& L = layers_[layer];
    cudaStream_t s = stream_.get();
    const int ffn = c_.ffn_dim;
    RETURN_IF_ERROR(cuda::GemmBf16(cublas_.get(), L.wo.get(), c_.dim, c_.q_dim(), attn_bf16_.get(),
                                   n_, x_.get(), 1.0f));
    CUDA_RETURN_IF_ERROR(cuda::LaunchRmsNorm(x_.get(), nullptr, L.ffn_norm.get(), xb_.get(), n_,
                                             c_.dim, c_.norm_eps, s));
    RETURN_IF_ERROR(cuda::GemmBf16(cublas_.get(), L.w_gate_up.get(), 2 * ffn, c_.dim, xb_.get(),
                                   n_, gate_up_.get(), 0.0f));
    CUDA_RETURN_IF_ERROR(cuda::LaunchSwiGlu(gate_up_.get(), gate_up_.get() + ffn, 2 * ffn,
                                            h_.get(), ffn, n_, ffn, s));
    RETURN_IF_ERROR(cuda::GemmBf16(cublas_.get(), L.w_down.get(), c_.dim, ffn, h_.get(), n_,
                                   x_.get(), 1.0f));
    return absl::OkStatus();
  }

  absl::Status Enqueue(int layer, Phase phase) {
    return phase == Phase::kQkv ? EnqueueQkv(layer) : EnqueueMlp(layer);
  }

  // Enqueues one phase of a layer, from a CUDA graph when graphs are on and
  // the step is small: the first use of (layer, phase, T) launches directly
  // (loading modules, settling cuBLAS's choice), the second captures.
  absl::Status RunPhase(int layer, Phase phase) {
    if (!graphs_enabled_ || n_ > options_.graph_max_tokens) return Enqueue(layer, phase);
    const uint64_t key = (static_cast<uint64_t>(layer) << 32) |
                         (static_cast<uint64_t>(n_) << 1) | static_cast<uint64_t>(phase);
    GraphEntry& entry = graphs_[key];
    if (entry.exec == nullptr) {
      if (++entry.uses < 2) return Enqueue(layer, phase);
      absl::StatusOr<cuda::GraphExecOwner> exec = Capture(layer, phase);
      if (!exec.ok()) {
        LogWarning("CUDA graph capture failed (%s); launching kernels directly from now on",
                   exec.status().ToString());
        graphs_enabled_ = false;
        graphs_.clear();
        return Enqueue(layer, phase);
      }
      entry.exec = std::move(*exec);
    }
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(entry.exec.get(), stream_.get()));
    return absl::OkStatus();
  }

  absl::StatusOr<cuda::GraphExecOwner> Capture(int layer, Phase phase) {
    CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_.get(), cudaStreamCaptureModeThreadLocal));
    const absl::Status enqueued = Enqueue(layer, phase);
    cudaGraph_t raw = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream_.get(), &raw);
    cuda::GraphOwner graph(raw);
    RETURN_IF_ERROR(enqueued);
    CUDA_RETURN_IF_ERROR(ended);
    cudaGraphExec_t exec = nullptr;
    CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph.get(), 0));
    return cuda::GraphExecOwner(exec);
  }

  absl::Status Allocate(bool tied) {
    const size_t need = WeightBytes(c_, tied);
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (need > free_bytes) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "the bf16 weights need %.1f GiB; CUDA device %d has %.1f GiB free of %.1f GiB", need / kGiB,
          options_.device, free_bytes / kGiB, total_bytes / kGiB));
    }
    ASSIGN_OR_RETURN(stream_, cuda::MakeStream());
    ASSIGN_OR_RETURN(staging_free_, cuda::MakeEvent());
    ASSIGN_OR_RETURN(attn_read_, cuda::MakeEvent());
    cublasHandle_t handle = nullptr;
    CUDA_RETURN_IF_ERROR(cublasCreate(&handle));
    cublas_.reset(handle);
    CUDA_RETURN_IF_ERROR(cublasSetStream(handle, stream_.get()));
    // A workspace of our own: cuBLAS then allocates nothing while a graph is captured.
    ASSIGN_OR_RETURN(workspace_, DeviceArray<uint8_t>::Alloc(kCublasWorkspaceBytes));
    CUDA_RETURN_IF_ERROR(cublasSetWorkspace(handle, workspace_.get(), workspace_.bytes()));

    const size_t dim = c_.dim, qkv = qkv_dim(), qd = c_.q_dim(), ffn = c_.ffn_dim;
    const size_t vocab = c_.vocab_size, T = max_tokens_;
    ASSIGN_OR_RETURN(embd_, DeviceArray<bf16_t>::Alloc(vocab * dim));
    if (!tied) {
      ASSIGN_OR_RETURN(output_, DeviceArray<bf16_t>::Alloc(vocab * dim));
    }
    output_w_ = tied ? embd_.get() : output_.get();
    ASSIGN_OR_RETURN(output_norm_, DeviceArray<float>::Alloc(dim));
    layers_.resize(c_.n_layers);
    for (DeviceLayer& D : layers_) {
      ASSIGN_OR_RETURN(D.wqkv, DeviceArray<bf16_t>::Alloc(qkv * dim));
      if (c_.qkv_bias) {
        ASSIGN_OR_RETURN(D.bqkv, DeviceArray<float>::Alloc(qkv));
      }
      if (c_.qk_norm) {
        ASSIGN_OR_RETURN(D.qk_norm, DeviceArray<float>::Alloc(2 * static_cast<size_t>(c_.head_dim)));
      }
      ASSIGN_OR_RETURN(D.wo, DeviceArray<bf16_t>::Alloc(dim * qd));
      ASSIGN_OR_RETURN(D.w_gate_up, DeviceArray<bf16_t>::Alloc(2 * ffn * dim));
      ASSIGN_OR_RETURN(D.w_down, DeviceArray<bf16_t>::Alloc(dim * ffn));
      ASSIGN_OR_RETURN(D.attn_norm, DeviceArray<float>::Alloc(dim));
      ASSIGN_OR_RETURN(D.ffn_norm, DeviceArray<float>::Alloc(dim));
    }
    ASSIGN_OR_RETURN(x_, DeviceArray<float>::Alloc(T * dim));
    ASSIGN_OR_RETURN(xb_, DeviceArray<bf16_t>::Alloc(T * dim));
    ASSIGN_OR_RETURN(qkv_, DeviceArray<float>::Alloc(T * qkv));
    ASSIGN_OR_RETURN(attn_f32_, DeviceArray<float>::Alloc(T * qd));
    ASSIGN_OR_RETURN(attn_bf16_, DeviceArray<bf16_t>::Alloc(T * qd));
    ASSIGN_OR_RETURN(gate_up_, DeviceArray<float>::Alloc(T * 2 * ffn));
    ASSIGN_OR_RETURN(h_, DeviceArray<bf16_t>::Alloc(T * ffn));
    ASSIGN_OR_RETURN(logits_, DeviceArray<float>::Alloc(T * vocab));
    ASSIGN_OR_RETURN(cos_sin_, DeviceArray<float>::Alloc(T * std::max(c_.rope_dims, 2)));
    ASSIGN_OR_RETURN(rope_freq_, DeviceArray<double>::Alloc(std::max(rope_.pairs(), 1)));
    CUDA_RETURN_IF_ERROR(cudaMemcpy(rope_freq_.get(), rope_.freq().data(),
                                    rope_.pairs() * sizeof(double), cudaMemcpyHostToDevice));
    ASSIGN_OR_RETURN(ints_, DeviceArray<int32_t>::Alloc(3 * T));
    ASSIGN_OR_RETURN(staging_, PinnedArray<int32_t>::Alloc(3 * T));
    return absl::OkStatus();
  }

  absl::Status CheckSize(const std::vector<float>& v, const std::string& name, size_t n) const {
    if (v.size() != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, " has ", v.size(), " values; the config needs ", n));
    }
    return absl::OkStatus();
  }

  absl::Status ToF32(std::vector<float>& v, const std::string& name, size_t n, float* dst) {
    RETURN_IF_ERROR(CheckSize(v, name, n));
    // On our stream (a non-blocking one would not wait for the legacy stream).
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, v.data(), n * sizeof(float), cudaMemcpyHostToDevice,
                                         stream_.get()));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
    std::vector<float>().swap(v);
    return absl::OkStatus();
  }

  absl::Status ToBf16(std::vector<float>& v, const std::string& name, size_t n, bf16_t* dst) {
    RETURN_IF_ERROR(CheckSize(v, name, n));
    if (upload_ == nullptr) {
      auto u = std::make_unique<Uploader>();
      for (int b = 0; b < 2; ++b) {
        ASSIGN_OR_RETURN(u->host[b], PinnedArray<float>::Alloc(Uploader::kChunk));
        ASSIGN_OR_RETURN(u->scratch[b], DeviceArray<float>::Alloc(Uploader::kChunk));
        ASSIGN_OR_RETURN(u->done[b], cuda::MakeEvent());
      }
      upload_ = std::move(u);
    }
    cudaStream_t s = stream_.get();
    for (size_t off = 0; off < n; off += Uploader::kChunk) {
      const size_t len = std::min(Uploader::kChunk, n - off);
      const int b = static_cast<int>((off / Uploader::kChunk) & 1);
      // The device is done with this pinned chunk and scratch from two rounds ago.
      CUDA_RETURN_IF_ERROR(cudaEventSynchronize(upload_->done[b].get()));
      std::memcpy(upload_->host[b].get(), v.data() + off, len * sizeof(float));
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(upload_->scratch[b].get(), upload_->host[b].get(),
                                           len * sizeof(float), cudaMemcpyHostToDevice, s));
      CUDA_RETURN_IF_ERROR(cuda::LaunchF32ToBf16(upload_->scratch[b].get(), dst + off,
                                                 static_cast<int64_t>(len), s));
      CUDA_RETURN_IF_ERROR(cudaEventRecord(upload_->done[b].get(), s));
    }
    std::vector<float>().swap(v);
    return absl::OkStatus();
  }

  ModelConfig c_;
  Rope rope_;  // the rotation frequencies, computed once
  int max_tokens_;
  CudaBackendOptions options_;
  std::string device_name_;
  bool graphs_enabled_;
  int n_ = 0;  // tokens of the current step

  // Declared first, destroyed last (the handle before its workspace).
  cuda::StreamOwner stream_;
  DeviceArray<uint8_t> workspace_;
  cuda::CublasOwner cublas_;
  cuda::EventOwner staging_free_;  // the last upload from staging_ has been read
  cuda::EventOwner attn_read_;     // the attention output has been read from the host

  // Weights.
  DeviceArray<bf16_t> embd_;    // [vocab, dim]
  DeviceArray<bf16_t> output_;  // [vocab, dim]; empty when tied to embd_
  const bf16_t* output_w_ = nullptr;
  DeviceArray<float> output_norm_;
  std::vector<DeviceLayer> layers_;

  // Activations, each for up to max_tokens_ tokens.
  DeviceArray<float> x_;           // [T, dim] hidden states
  DeviceArray<bf16_t> xb_;         // [T, dim] normed, the products' input
  DeviceArray<float> qkv_;         // [T, q_dim + 2 kv_dim]
  DeviceArray<float> attn_f32_;    // [T, q_dim] attention output as copied in
  DeviceArray<bf16_t> attn_bf16_;  // [T, q_dim] O projection input
  DeviceArray<float> gate_up_;     // [T, 2 ffn]
  DeviceArray<bf16_t> h_;          // [T, ffn]
  DeviceArray<float> logits_;      // [T, vocab]
  DeviceArray<float> cos_sin_;     // [T, rope_dims / 2, 2]
  DeviceArray<double> rope_freq_;  // [rope_dims / 2]: rope_.freq()
  DeviceArray<int32_t> ints_;      // tokens | positions | logits rows, max_tokens_ each
  PinnedArray<int32_t> staging_;   // the same, on the host

  std::unique_ptr<Uploader> upload_;
  std::vector<std::unique_ptr<cuda::HostRegistration>> registrations_;
  std::unordered_map<uint64_t, GraphEntry> graphs_;
};

// The LM head is the embedding table: the file says so, or (weights built by
// hand) the two arrays are equal.
bool TiedOutput(const ModelWeights& w) {
  if (w.tied_embeddings) return true;
  return w.output.size() == w.token_embd.size() &&
         (w.output.data() == w.token_embd.data() ||
          std::memcmp(w.output.data(), w.token_embd.data(), w.output.size() * sizeof(float)) == 0);
}

}  // namespace

bool CudaDeviceAvailable(std::string* why, int device) {
  auto say = [&](std::string text) {
    if (why != nullptr) *why = std::move(text);
  };
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (e == cudaErrorInsufficientDriver) {
      say(absl::StrCat("no usable NVIDIA driver (cudaErrorInsufficientDriver: ",
                       cudaGetErrorString(e), ")"));
    } else if (e == cudaErrorNoDevice) {
      say("no CUDA device (cudaErrorNoDevice)");
    } else {
      say(absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
    }
    return false;
  }
  if (count <= 0) {
    say("no CUDA device");
    return false;
  }
  if (device < 0 || device >= count) {
    say(absl::StrFormat("CUDA device %d does not exist (%d visible)", device, count));
    return false;
  }
  cudaDeviceProp prop;
  const cudaError_t pe = cudaGetDeviceProperties(&prop, device);
  if (pe != cudaSuccess) {
    cudaGetLastError();
    say(absl::StrCat("cudaGetDeviceProperties: ", cudaGetErrorName(pe)));
    return false;
  }
  if (prop.major < 8) {
    say(absl::StrFormat("cuda:%d %s is sm_%d%d; the backend needs sm_80 or newer (bf16)", device,
                        prop.name, prop.major, prop.minor));
    return false;
  }
  say(absl::StrFormat("cuda:%d %s, sm_%d%d, %.1f GiB, %d device(s) visible", device, prop.name,
                      prop.major, prop.minor, prop.totalGlobalMem / kGiB, count));
  return true;
}

absl::StatusOr<std::unique_ptr<MlpBackend>> CreateCudaBackend(ModelWeights weights,
                                                              int max_step_tokens,
                                                              const CudaBackendOptions& options) {
  const ModelConfig& c = weights.config;
  if (static_cast<int>(weights.layers.size()) != c.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("the weights have ", weights.layers.size(),
                                                   " layers; the config has ", c.n_layers));
  }
  if (weights.token_embd.empty() || (!weights.layers.empty() && weights.layers[0].wq.empty())) {
    return absl::InvalidArgumentError(
        "the CUDA backend takes fp32 weights (load them without LoadOptions::raw_matrices)");
  }
  const bool tied = TiedOutput(weights);
  ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> b,
                   CudaBackend::Create(c, max_step_tokens, options, tied));
  RETURN_IF_ERROR(b->UploadWeights(weights, tied, options.progress));
  return std::unique_ptr<MlpBackend>(std::move(b));
}

absl::StatusOr<std::unique_ptr<MlpBackend>> CreateCudaBackendRandom(
    const ModelConfig& config, uint64_t seed, int max_step_tokens,
    const CudaBackendOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> b,
                   CudaBackend::Create(config, max_step_tokens, options, /*tied_output=*/false));
  RETURN_IF_ERROR(b->RandomWeights(seed));
  return std::unique_ptr<MlpBackend>(std::move(b));
}

}  // namespace ellm::mlp
