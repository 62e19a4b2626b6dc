// CPU backend: composes the core kernels in exactly the order of the reference
// forward, so its results equal the reference's bit for bit.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/kernels.h"
#include "core/thread_pool.h"
#include "mlp-worker/backend.h"

namespace ellm::mlp {
namespace {

class CpuBackend final : public MlpBackend {
 public:
  CpuBackend(ModelWeights weights, int max_step_tokens, int threads)
      : w_(std::move(weights)), max_tokens_(max_step_tokens), pool_(threads) {
    const ModelConfig& c = w_.config;
    x_.resize(static_cast<size_t>(max_tokens_) * c.dim);
    positions_.resize(max_tokens_);
    per_thread_.resize(pool_.size());
    for (Scratch& s : per_thread_) {
      s.xb.resize(c.dim);
      s.proj.resize(c.dim);
      s.hb.resize(c.ffn_dim);
      s.hb2.resize(c.ffn_dim);
    }
  }

  std::string name() const override { return absl::StrCat("cpu-f32 (", pool_.size(), " threads)"); }

  absl::Status BeginStep(const int32_t* tokens, const int32_t* positions, int n) override {
    if (n <= 0 || n > max_tokens_) {
      return absl::InvalidArgumentError(absl::StrCat("step of ", n, " tokens (max ", max_tokens_, ")"));
    }
    const ModelConfig& c = w_.config;
    for (int t = 0; t < n; ++t) {
      if (tokens[t] < 0 || tokens[t] >= c.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", tokens[t], " out of range"));
      }
      std::copy_n(w_.token_embd.data() + static_cast<size_t>(tokens[t]) * c.dim, c.dim,
                  x_.data() + static_cast<size_t>(t) * c.dim);
      positions_[t] = positions[t];
    }
    n_ = n;
    return absl::OkStatus();
  }

  absl::Status ComputeQkv(int layer, float* q, float* k, float* v) override {
    const ModelConfig& c = w_.config;
    const LayerWeights& L = w_.layers[layer];
    pool_.ParallelFor(n_, [&](int64_t begin, int64_t end, int thread) {
      Scratch& s = per_thread_[thread];
      for (int64_t t = begin; t < end; ++t) {
        float* qt = q + t * c.q_dim();
        float* kt = k + t * c.kv_dim();
        float* vt = v + t * c.kv_dim();
        RmsNorm(x_.data() + t * c.dim, L.attn_norm.data(), s.xb.data(), c.dim, c.norm_eps);
        MatVec(L.wq.data(), s.xb.data(), qt, c.q_dim(), c.dim);
        MatVec(L.wk.data(), s.xb.data(), kt, c.kv_dim(), c.dim);
        MatVec(L.wv.data(), s.xb.data(), vt, c.kv_dim(), c.dim);
        RopeInterleaved(qt, c.n_heads, c.head_dim, c.rope_dims, positions_[t], c.rope_base);
        RopeInterleaved(kt, c.n_kv_heads, c.head_dim, c.rope_dims, positions_[t], c.rope_base);
      }
    });
    return absl::OkStatus();
  }

  absl::Status CompleteLayer(int layer, const float* attn) override {
    const ModelConfig& c = w_.config;
    const LayerWeights& L = w_.layers[layer];
    pool_.ParallelFor(n_, [&](int64_t begin, int64_t end, int thread) {
      Scratch& s = per_thread_[thread];
      for (int64_t t = begin; t < end; ++t) {
        float* x = x_.data() + t * c.dim;
        MatVec(L.wo.data(), attn + t * c.q_dim(), s.proj.data(), c.dim, c.q_dim());
        for (int i = 0; i < c.dim; ++i) x[i] += s.proj[i];
        RmsNorm(x, L.ffn_norm.data(), s.xb.data(), c.dim, c.norm_eps);
        MatVec(L.w_gate.data(), s.xb.data(), s.hb.data(), c.ffn_dim, c.dim);
        MatVec(L.w_up.data(), s.xb.data(), s.hb2.data(), c.ffn_dim, c.dim);
        SwiGlu(s.hb.data(), s.hb2.data(), s.hb.data(), c.ffn_dim);
        MatVec(L.w_down.data(), s.hb.data(), s.proj.data(), c.dim, c.ffn_dim);
        for (int i = 0; i < c.dim; ++i) x[i] += s.proj[i];
      }
    });
    return absl::OkStatus();
  }

  absl::Status ComputeLogits(const int32_t* rows, int n, float* logits) override {
    const ModelConfig& c = w_.config;
    for (int i = 0; i < n; ++i) {
      if (rows[i] < 0 || rows[i] >= n_) return absl::InvalidArgumentError("logits row out of range");
    }
    pool_.ParallelFor(n, [&](int64_t begin, int64_t end, int thread) {
      Scratch& s = per_thread_[thread];
      for (int64_t i = begin; i < end; ++i) {
        RmsNorm(x_.data() + static_cast<size_t>(rows[i]) * c.dim, w_.output_norm.data(),
                s.xb.data(), c.dim, c.norm_eps);
        MatVec(w_.output.data(), s.xb.data(), logits + i * c.vocab_size, c.vocab_size, c.dim);
      }
    });
    return absl::OkStatus();
  }

 private:
  struct Scratch {
    std::vector<float> xb, proj, hb, hb2;
  };
  ModelWeights w_;
  int max_tokens_;
  ThreadPool pool_;
  std::vector<float> x_;           // [max_tokens, dim] hidden states
  std::vector<int32_t> positions_;
  std::vector<Scratch> per_thread_;
  int n_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MlpBackend>> CreateCpuBackend(ModelWeights weights,
                                                             int max_step_tokens, int threads) {
  if (max_step_tokens <= 0) return absl::InvalidArgumentError("max_step_tokens must be positive");
  return std::unique_ptr<MlpBackend>(new CpuBackend(std::move(weights), max_step_tokens, threads));
}

}  // namespace ellm::mlp
