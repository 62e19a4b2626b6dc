#include "core/reference_forward.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/kernels.h"

namespace ellm {

absl::StatusOr<std::unique_ptr<ReferenceModel>> ReferenceModel::Create(ModelWeights weights,
                                                                      int max_positions) {
  if (max_positions <= 0) max_positions = weights.config.context_length;
  if (max_positions > weights.config.context_length) {
    return absl::InvalidArgumentError(absl::StrCat("max_positions ", max_positions,
                                                   " exceeds the context length ",
                                                   weights.config.context_length));
  }
  return std::unique_ptr<ReferenceModel>(new ReferenceModel(std::move(weights), max_positions));
}

ReferenceModel::ReferenceModel(ModelWeights weights, int max_positions)
    : w_(std::move(weights)), rope_(w_.config), max_positions_(max_positions) {
  const ModelConfig& c = w_.config;
  x_.resize(c.dim);
  xb_.resize(c.dim);
  q_.resize(c.q_dim());
  k_.resize(c.kv_dim());
  v_.resize(c.kv_dim());
  cos_sin_.resize(c.rope_dims);
  att_out_.resize(c.q_dim());
  proj_.resize(c.dim);
  hb_.resize(c.ffn_dim);
  hb2_.resize(c.ffn_dim);
  scores_.resize(max_positions);
  logits_.resize(c.vocab_size);
  const size_t cache = static_cast<size_t>(c.n_layers) * max_positions * c.kv_dim();
  key_cache_.resize(cache);
  value_cache_.resize(cache);
  k_rows_.resize(max_positions);
  v_rows_.resize(max_positions);
}

const std::vector<float>& ReferenceModel::Forward(int32_t token, int pos) {
  Feed(token, pos);
  const ModelConfig& c = w_.config;
  RmsNorm(x_.data(), w_.output_norm.data(), xb_.data(), c.dim, c.norm_eps);
  MatVec(w_.output.data(), xb_.data(), logits_.data(), c.vocab_size, c.dim);
  return logits_;
}

void ReferenceModel::Feed(int32_t token, int pos) {
  const ModelConfig& c = w_.config;
  const int dim = c.dim, kv_dim = c.kv_dim(), hd = c.head_dim;
  std::copy_n(w_.token_embd.data() + static_cast<size_t>(token) * dim, dim, x_.data());
  rope_.CosSin(pos, cos_sin_.data());

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w_.layers[l];
    // Attention block input: q, k, v with RoPE.
    RmsNorm(x_.data(), L.attn_norm.data(), xb_.data(), dim, c.norm_eps);
    MatVec(L.wq.data(), xb_.data(), q_.data(), c.q_dim(), dim);
    MatVec(L.wk.data(), xb_.data(), k_.data(), kv_dim, dim);
    MatVec(L.wv.data(), xb_.data(), v_.data(), kv_dim, dim);
    QkvPostprocess(c, rope_, L, cos_sin_.data(), q_.data(), k_.data(), v_.data());

    // Append k, v to the cache at `pos`.
    float* layer_k = key_cache_.data() + static_cast<size_t>(l) * max_positions_ * kv_dim;
    float* layer_v = value_cache_.data() + static_cast<size_t>(l) * max_positions_ * kv_dim;
    std::copy(k_.begin(), k_.end(), layer_k + static_cast<size_t>(pos) * kv_dim);
    std::copy(v_.begin(), v_.end(), layer_v + static_cast<size_t>(pos) * kv_dim);

    // Causal attention over [0, pos]; query head h reads KV head h / gqa.
    for (int h = 0; h < c.n_heads; ++h) {
      const int kvh = h / c.gqa_ratio();
      for (int t = 0; t <= pos; ++t) {
        k_rows_[t] = layer_k + static_cast<size_t>(t) * kv_dim + kvh * hd;
        v_rows_[t] = layer_v + static_cast<size_t>(t) * kv_dim + kvh * hd;
      }
      AttendOneHead(q_.data() + h * hd, k_rows_.data(), v_rows_.data(), pos + 1, hd,
                    scores_.data(), att_out_.data() + h * hd);
    }

    // Output projection and residual.
    MatVec(L.wo.data(), att_out_.data(), proj_.data(), dim, c.q_dim());
    for (int i = 0; i < dim; ++i) x_[i] += proj_[i];

    // Gated MLP and residual.
    RmsNorm(x_.data(), L.ffn_norm.data(), xb_.data(), dim, c.norm_eps);
    MatVec(L.w_gate.data(), xb_.data(), hb_.data(), c.ffn_dim, dim);
    MatVec(L.w_up.data(), xb_.data(), hb2_.data(), c.ffn_dim, dim);
    SwiGlu(hb_.data(), hb2_.data(), hb_.data(), c.ffn_dim);
    MatVec(L.w_down.data(), hb_.data(), proj_.data(), dim, c.ffn_dim);
    for (int i = 0; i < dim; ++i) x_[i] += proj_[i];
  }
}

std::vector<int32_t> ReferenceModel::GenerateGreedy(const std::vector<int32_t>& prompt, int n) {
  std::vector<int32_t> out;
  int pos = 0;
  const std::vector<float>* logits = nullptr;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (i + 1 < prompt.size()) {
      Feed(prompt[i], pos++);
    } else {
      logits = &Forward(prompt[i], pos++);
    }
  }
  for (int i = 0; i < n && logits != nullptr; ++i) {
    const int32_t next = static_cast<int32_t>(
        std::max_element(logits->begin(), logits->end()) - logits->begin());
    out.push_back(next);
    if (i + 1 == n || pos >= max_positions_) break;
    logits = &Forward(next, pos++);
  }
  return out;
}

}  // namespace ellm
