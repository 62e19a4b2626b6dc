// CPU backend. The matrices (projections, MLP, LM head, embeddings) are
// QuantMatrix objects (cpu/matmul.h), multiplied for all T tokens of a step
// at once with rows split across the pool's threads; RMSNorm, RoPE, biases
// and SwiGLU are core/kernels.h's, per token.
//
// Two weight modes, set by how the weights were loaded:
//   f32     LoadWeights dequantised every matrix to fp32 (the default load):
//           F32 matrices, whose kernel is core Dot bit for bit, composed in
//           the reference forward's order, so the results equal the
//           reference forward's exactly.
//   native  LoadOptions::raw_matrices: each matrix keeps its GGUF type,
//           repacked for the int8 / half kernels. Close to the reference
//           (activations are quantised to int8 per block), not identical;
//           F32 matrices still take the exact kernel.
#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/kernels.h"
#include "core/log.h"
#include "core/thread_pool.h"
#include "mlp-worker/backend.h"
#include "mlp-worker/cpu/matmul.h"

namespace ellm::mlp {
namespace {


// Moves one matrix [rows, cols] out of the loaded weights into a QuantMatrix,
// freeing the loaded copy.
absl::StatusOr<QuantMatrix> TakeMatrix(std::string_view name, int64_t rows, int64_t cols,
                                       std::vector<float>* f32, RawMatrix* raw, ThreadPool* pool) {
  if (!raw->empty()) {
    if (raw->rows != rows || raw->cols != cols) {
      return absl::InvalidArgumentError(absl::StrCat(
          ToAbsl(name), " is [", raw->rows, ", ", raw->cols, "], expected [", rows, ", ", cols, "]"));
    }
    absl::StatusOr<QuantMatrix> m =
        QuantMatrix::FromRaw(raw->type, rows, cols, raw->data.data(), raw->data.size(), pool);
    if (!m.ok())
      return absl::Status(m.status().code(), absl::StrCat(ToAbsl(name), ": ", m.status().message()));
    *raw = RawMatrix();
    return m;
  }
  if (f32->size() != static_cast<size_t>(rows * cols)) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(name), " has ", f32->size(), " values, expected ", rows * cols));
  }
  QuantMatrix m = QuantMatrix::FromF32(f32->data(), rows, cols);
  *f32 = std::vector<float>();
  return m;
}

class CpuBackend final : public MlpBackend {
 public:
  static absl::StatusOr<std::unique_ptr<MlpBackend>> Create(ModelWeights weights,
                                                            int max_step_tokens, int threads,
                                                            Isa isa, int q8_act_bits) {
    std::unique_ptr<CpuBackend> b(
        new CpuBackend(std::move(weights), max_step_tokens, threads, isa, q8_act_bits));
    RETURN_IF_ERROR(b->TakeMatrices());
    b->LogKernels();
    return std::unique_ptr<MlpBackend>(std::move(b));
  }

  std::string name() const override {
    if (!native_) return absl::StrCat("cpu-f32 (", pool_.size(), " threads)");
    return absl::StrCat("cpu-native ", ToAbsl(IsaName(isa_)), " (", absl::StrJoin(type_names_, ", "),
                        ActFormatFor(DType::kQ8_0, isa_, q8_act_bits_) == ActFormat::kQ7x32
                            ? "; q8_0 activations 7-bit"
                            : "",
                        "; ", pool_.size(),
                        " threads)");
  }

  absl::Status BeginStep(const int32_t* tokens, const int32_t* positions, int n) override {
    if (n <= 0 || n > max_tokens_) {
      return absl::InvalidArgumentError(
          absl::StrCat("step of ", n, " tokens (max ", max_tokens_, ")"));
    }
    const ModelConfig& c = w_.config;
    for (int t = 0; t < n; ++t) {
      if (tokens[t] < 0 || tokens[t] >= c.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", tokens[t], " out of range"));
      }
    }
    for (int t = 0; t < n; ++t) {
      if (positions[t] < 0) {
        return absl::InvalidArgumentError(absl::StrCat("position ", positions[t], " out of range"));
      }
    }
    for (int t = 0; t < n; ++t) {
      token_embd_.DequantizeRow(tokens[t], x_.data() + static_cast<size_t>(t) * c.dim);
      rope_.CosSin(positions[t], cos_sin_.data() + static_cast<size_t>(t) * c.rope_dims);
    }
    n_ = n;
    return absl::OkStatus();
  }

  absl::Status StageQkv(int layer) override {
    RETURN_IF_ERROR(CheckLayer(layer));
    if (n_ <= 0) return absl::FailedPreconditionError("no step begun (BeginStep first)");
    const ModelConfig& c = w_.config;
    const LayerWeights& L = w_.layers[layer];
    const Layer& M = layers_[layer];
    float *q = q_.data(), *k = k_.data(), *v = v_.data();
    ForTokens(n_, [&](int64_t t) {
      RmsNorm(x_.data() + t * c.dim, L.attn_norm.data(), xb_.data() + t * c.dim, c.dim, c.norm_eps);
    });
    act_.Set(xb_.data(), n_, c.dim);
    MatMul(M.wq, act_, q, &pool_, isa_, q8_act_bits_);
    MatMul(M.wk, act_, k, &pool_, isa_, q8_act_bits_);
    MatMul(M.wv, act_, v, &pool_, isa_, q8_act_bits_);
    ForTokens(n_, [&](int64_t t) {
      QkvPostprocess(c, rope_, L, cos_sin_.data() + t * c.rope_dims, q + t * c.q_dim(), k + t * c.kv_dim(),
                     v + t * c.kv_dim());
    });
    return absl::OkStatus();
  }

  // Copies each shard's heads of the staged q, k, v out, row by row.
  absl::Status WriteQkvShards(const ShardIo* shards, int n_shards) override {
    if (n_ <= 0) return absl::FailedPreconditionError("no step begun (BeginStep first)");
    const ModelConfig& c = w_.config;
    RETURN_IF_ERROR(CheckShardIo(shards, n_shards, c.n_kv_heads, /*outputs=*/true));
    const size_t hd = c.head_dim, g = c.gqa_ratio(), qd = c.q_dim(), kvd = c.kv_dim();
    for (int i = 0; i < n_shards; ++i) {
      const ShardIo& s = shards[i];
      const size_t q_row = s.heads.count() * g * hd, kv_row = s.heads.count() * hd;
      const size_t q_off = s.heads.begin * g * hd, kv_off = s.heads.begin * hd;
      for (int t = 0; t < n_; ++t) {
        std::memcpy(s.q + t * q_row, q_.data() + t * qd + q_off, q_row * sizeof(float));
        std::memcpy(s.k + t * kv_row, k_.data() + t * kvd + kv_off, kv_row * sizeof(float));
        std::memcpy(s.v + t * kv_row, v_.data() + t * kvd + kv_off, kv_row * sizeof(float));
      }
    }
    return absl::OkStatus();
  }

  // Gathers the shards' attention output (one shard covering every head is
  // read where it is), then finishes the layer.
  absl::Status CompleteLayerFromShards(int layer, const ShardIo* shards, int n_shards) override {
    RETURN_IF_ERROR(CheckLayer(layer));
    if (n_ <= 0) return absl::FailedPreconditionError("no step begun (BeginStep first)");
    const ModelConfig& c = w_.config;
    RETURN_IF_ERROR(CheckShardIo(shards, n_shards, c.n_kv_heads, /*outputs=*/false));
    const float* attn = shards[0].attn;
    if (n_shards > 1) {
      const size_t hd = c.head_dim, g = c.gqa_ratio(), qd = c.q_dim();
      for (int i = 0; i < n_shards; ++i) {
        const ShardIo& s = shards[i];
        const size_t row = s.heads.count() * g * hd, off = s.heads.begin * g * hd;
        for (int t = 0; t < n_; ++t) {
          std::memcpy(attn_.data() + t * qd + off, s.attn + t * row, row * sizeof(float));
        }
      }
      attn = attn_.data();
    }
    CompleteLayer(layer, attn);
    return absl::OkStatus();
  }

  absl::Status ComputeLogits(const int32_t* rows, int n, float* logits) override {
    const ModelConfig& c = w_.config;
    if (n < 0 || n > max_tokens_) return absl::InvalidArgumentError("too many logits rows");
    for (int i = 0; i < n; ++i) {
      if (rows[i] < 0 || rows[i] >= n_)
        return absl::InvalidArgumentError("logits row out of range");
    }
    // xb_ is free here: the last layer is complete.
    ForTokens(n, [&](int64_t i) {
      RmsNorm(x_.data() + static_cast<size_t>(rows[i]) * c.dim, w_.output_norm.data(),
              xb_.data() + i * c.dim, c.dim, c.norm_eps);
    });
    act_.Set(xb_.data(), n, c.dim);
    MatMul(*lm_head_, act_, logits, &pool_, isa_, q8_act_bits_);
    return absl::OkStatus();
  }

 private:
  struct Layer {
    QuantMatrix wq, wk, wv, wo, w_gate, w_up, w_down;
  };

  // attn [T, q_dim]: O projection, residual, norm, gated MLP, residual.
  void CompleteLayer(int layer, const float* attn) {
    const ModelConfig& c = w_.config;
    const LayerWeights& L = w_.layers[layer];
    const Layer& M = layers_[layer];
    act_.Set(attn, n_, c.q_dim());
    MatMul(M.wo, act_, proj_.data(), &pool_, isa_, q8_act_bits_);
    ForTokens(n_, [&](int64_t t) {
      float* x = x_.data() + t * c.dim;
      const float* p = proj_.data() + t * c.dim;
      for (int i = 0; i < c.dim; ++i) x[i] += p[i];
      RmsNorm(x, L.ffn_norm.data(), xb_.data() + t * c.dim, c.dim, c.norm_eps);
    });
    act_.Set(xb_.data(), n_, c.dim);
    MatMul(M.w_gate, act_, hb_.data(), &pool_, isa_, q8_act_bits_);
    MatMul(M.w_up, act_, hb2_.data(), &pool_, isa_, q8_act_bits_);
    ForTokens(n_, [&](int64_t t) {
      float* h = hb_.data() + t * c.ffn_dim;
      SwiGlu(h, hb2_.data() + t * c.ffn_dim, h, c.ffn_dim);
    });
    act_.Set(hb_.data(), n_, c.ffn_dim);
    MatMul(M.w_down, act_, proj_.data(), &pool_, isa_, q8_act_bits_);
    ForTokens(n_, [&](int64_t t) {
      float* x = x_.data() + t * c.dim;
      const float* p = proj_.data() + t * c.dim;
      for (int i = 0; i < c.dim; ++i) x[i] += p[i];
    });
  }

  absl::Status CheckLayer(int layer) const {
    if (layer < 0 || layer >= w_.config.n_layers) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
    }
    return absl::OkStatus();
  }

  CpuBackend(ModelWeights weights, int max_step_tokens, int threads, Isa isa, int q8_act_bits)
      : w_(std::move(weights)),
        rope_(w_.config),
        max_tokens_(max_step_tokens),
        pool_(threads),
        isa_(isa),
        q8_act_bits_(q8_act_bits) {
    const ModelConfig& c = w_.config;
    const size_t T = static_cast<size_t>(max_tokens_);
    x_.resize(T * c.dim);
    xb_.resize(T * c.dim);
    proj_.resize(T * c.dim);
    hb_.resize(T * c.ffn_dim);
    hb2_.resize(T * c.ffn_dim);
    cos_sin_.resize(T * c.rope_dims);
    q_.resize(T * c.q_dim());
    attn_.resize(q_.size());
    k_.resize(T * c.kv_dim());
    v_.resize(k_.size());
  }

  absl::Status TakeMatrices() {
    const ModelConfig& c = w_.config;
    const int64_t dim = c.dim, q = c.q_dim(), kv = c.kv_dim(), ffn = c.ffn_dim,
                  vocab = c.vocab_size;
    native_ = !w_.raw_token_embd.empty();
    ASSIGN_OR_RETURN(token_embd_, TakeMatrix("token_embd", vocab, dim, &w_.token_embd,
                                             &w_.raw_token_embd, &pool_));
    layers_.resize(c.n_layers);
    for (int l = 0; l < c.n_layers; ++l) {
      LayerWeights& L = w_.layers[l];
      Layer& M = layers_[l];
      const std::string p = absl::StrCat("blk.", l, ".");
      ASSIGN_OR_RETURN(M.wq, TakeMatrix(p + "attn_q", q, dim, &L.wq, &L.raw_wq, &pool_));
      ASSIGN_OR_RETURN(M.wk, TakeMatrix(p + "attn_k", kv, dim, &L.wk, &L.raw_wk, &pool_));
      ASSIGN_OR_RETURN(M.wv, TakeMatrix(p + "attn_v", kv, dim, &L.wv, &L.raw_wv, &pool_));
      ASSIGN_OR_RETURN(M.wo, TakeMatrix(p + "attn_output", dim, q, &L.wo, &L.raw_wo, &pool_));
      ASSIGN_OR_RETURN(M.w_gate,
                       TakeMatrix(p + "ffn_gate", ffn, dim, &L.w_gate, &L.raw_w_gate, &pool_));
      ASSIGN_OR_RETURN(M.w_up, TakeMatrix(p + "ffn_up", ffn, dim, &L.w_up, &L.raw_w_up, &pool_));
      ASSIGN_OR_RETURN(M.w_down,
                       TakeMatrix(p + "ffn_down", dim, ffn, &L.w_down, &L.raw_w_down, &pool_));
    }
    if (native_ && w_.tied_embeddings) {
      lm_head_ = &token_embd_;
    } else {
      ASSIGN_OR_RETURN(output_,
                       TakeMatrix("output", vocab, dim, &w_.output, &w_.raw_output, &pool_));
      lm_head_ = &output_;
    }
    return absl::OkStatus();
  }

  // Logs the kernel of each weight type, with its matrices and bytes.
  void LogKernels() {
    struct Use {
      int matrices = 0;
      size_t bytes = 0;
    };
    std::map<DType, Use> uses;
    auto count = [&](const QuantMatrix& m) {
      uses[m.type()].matrices++;
      uses[m.type()].bytes += m.bytes();
    };
    for (const Layer& M : layers_) {
      for (const QuantMatrix* m : {&M.wq, &M.wk, &M.wv, &M.wo, &M.w_gate, &M.w_up, &M.w_down})
        count(*m);
    }
    count(*lm_head_);
    std::vector<std::string> parts;
    for (const auto& [type, use] : uses) {
      type_names_.push_back(std::string(Traits(type).name));
      parts.push_back(absl::StrCat(KernelName(type, isa_, q8_act_bits_), " (", use.matrices, " matrices, ",
                                   use.bytes >> 20, " MiB)"));
    }
    LogInfo("cpu backend: %s weights, %d threads; matmul kernels: %s", native_ ? "native" : "f32",
            pool_.size(), absl::StrJoin(parts, ", "));
  }

  // fn(t) for t in [0, n): on the pool when there are enough tokens to share.
  template <typename Fn>
  void ForTokens(int64_t n, const Fn& fn) {
    if (n < 8 || pool_.size() == 1) {
      for (int64_t t = 0; t < n; ++t) fn(t);
      return;
    }
    pool_.ParallelFor(n, [&](int64_t begin, int64_t end, int) {
      for (int64_t t = begin; t < end; ++t) fn(t);
    });
  }

  ModelWeights w_;  // config, norms and biases (the matrices moved into QuantMatrix)
  Rope rope_;
  int max_tokens_;
  ThreadPool pool_;
  Isa isa_;
  int q8_act_bits_;  // MatMul's: 8, or 7
  bool native_ = false;
  std::vector<std::string> type_names_;
  QuantMatrix token_embd_, output_;
  const QuantMatrix* lm_head_ = nullptr;
  std::vector<Layer> layers_;
  Activations act_;
  std::vector<float> x_;         // [max_tokens, dim] hidden states
  std::vector<float> xb_;        // [max_tokens, dim] normed
  std::vector<float> proj_;      // [max_tokens, dim]
  std::vector<float> hb_, hb2_;  // [max_tokens, ffn_dim]
  std::vector<float> cos_sin_;   // [max_tokens, rope_dims / 2, 2] of the step's positions
  std::vector<float> q_, k_, v_;  // [max_tokens, q_dim or kv_dim]: StageQkv's output
  std::vector<float> attn_;       // [max_tokens, q_dim]: the shards' outputs gathered
  int n_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MlpBackend>> CreateCpuBackend(ModelWeights weights,
                                                             int max_step_tokens, int threads,
                                                             const std::string& isa,
                                                             int q8_act_bits) {
  if (max_step_tokens <= 0) return absl::InvalidArgumentError("max_step_tokens must be positive");
  if (q8_act_bits != 8 && q8_act_bits != 7) {
    return absl::InvalidArgumentError(
        absl::StrCat("q8_act_bits must be 8 or 7, not ", q8_act_bits));
  }
  ASSIGN_OR_RETURN(Isa chosen, ParseMatIsa(isa));
  if (!MatIsaSupported(chosen)) {
    return absl::UnavailableError(absl::StrCat("this CPU cannot run the ", ToAbsl(IsaName(chosen)),
                                               " matrix kernels"));
  }
  if (q8_act_bits == 7 && chosen != Isa::kAvx2) {
    LogWarning("cpu backend: 7-bit Q8_0 activations apply to the plain avx2 matrix kernels only; %s "
               "takes 8-bit codes",
               IsaName(chosen));
  }
  return CpuBackend::Create(std::move(weights), max_step_tokens, threads, chosen, q8_act_bits);
}

}  // namespace ellm::mlp
