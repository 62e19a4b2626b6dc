#include "core/weights.h"

#include "absl/strings/str_cat.h"
#include "core/kernels.h"
#include "absl/strings/str_join.h"

namespace ellm {

namespace {

// The shape and type checks ReadTensorF32 and ReadTensorRaw share.
absl::StatusOr<const GgufTensorInfo*> FindReadableTensor(const GgufFile& file,
                                                         const std::string& name,
                                                         const std::vector<int64_t>& shape) {
  const GgufTensorInfo* info = file.FindTensor(name);
  if (info == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("model file has no tensor '", name, "'"));
  }
  if (info->shape != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' has shape {", absl::StrJoin(info->shape, ", "),
                     "}, expected {", absl::StrJoin(shape, ", "), "}"));
  }
  const DTypeTraits& traits = Traits(info->type);
  if (traits.dequantize == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has type ",
                                                   std::string(traits.name), ", which ellm cannot read yet"));
  }
  return info;
}

}  // namespace

absl::StatusOr<std::vector<float>> ReadTensorF32(const GgufFile& file, const std::string& name,
                                                 const std::vector<int64_t>& shape) {
  ASSIGN_OR_RETURN(const GgufTensorInfo* info, FindReadableTensor(file, name, shape));
  const DTypeTraits& traits = Traits(info->type);
  std::vector<float> out(static_cast<size_t>(info->elements()));
  const int64_t row = shape[0];
  const int64_t rows = info->elements() / row;
  const uint8_t* src = file.TensorData(*info);
  const uint64_t row_bytes = info->bytes / static_cast<uint64_t>(rows);
  for (int64_t r = 0; r < rows; ++r) {
    traits.dequantize(src + r * row_bytes, out.data() + r * row, row);
  }
  return out;
}

void QkvPostprocess(const ModelConfig& c, const Rope& rope, const LayerWeights& w,
                    const float* cos_sin, float* q, float* k, float* v) {
  if (c.qkv_bias) {
    AddBias(q, w.bq.data(), c.q_dim());
    AddBias(k, w.bk.data(), c.kv_dim());
    AddBias(v, w.bv.data(), c.kv_dim());
  }
  if (c.qk_norm) {
    const int hd = c.head_dim;
    for (int h = 0; h < c.n_heads; ++h) RmsNorm(q + h * hd, w.q_norm.data(), q + h * hd, hd, c.norm_eps);
    for (int h = 0; h < c.n_kv_heads; ++h) RmsNorm(k + h * hd, w.k_norm.data(), k + h * hd, hd, c.norm_eps);
  }
  rope.Rotate(cos_sin, q, c.n_heads, c.head_dim);
  rope.Rotate(cos_sin, k, c.n_kv_heads, c.head_dim);
}


absl::StatusOr<RawMatrix> ReadTensorRaw(const GgufFile& file, const std::string& name,
                                        int64_t cols, int64_t rows) {
  ASSIGN_OR_RETURN(const GgufTensorInfo* info, FindReadableTensor(file, name, {cols, rows}));
  RawMatrix m;
  m.type = info->type;
  m.rows = rows;
  m.cols = cols;
  const uint8_t* src = file.TensorData(*info);
  m.data.assign(src, src + info->bytes);
  return m;
}

absl::StatusOr<ModelWeights> LoadWeights(const GgufFile& file, const ModelConfig& c,
                                         const LoadProgress& progress) {
  LoadOptions options;
  options.progress = progress;
  return LoadWeights(file, c, options);
}

absl::StatusOr<ModelWeights> LoadWeights(const GgufFile& file, const ModelConfig& c,
                                         const LoadOptions& options) {
  ModelWeights w;
  w.config = c;
  const int64_t dim = c.dim, q = c.q_dim(), kv = c.kv_dim(), ffn = c.ffn_dim;
  int64_t total = 0, done = 0;
  for (const GgufTensorInfo& t : file.tensors()) total += static_cast<int64_t>(t.bytes);
  // Called after reading tensor `name` (empty: none).
  auto tick = [&](const std::string& name) {
    if (const GgufTensorInfo* t = name.empty() ? nullptr : file.FindTensor(name)) {
      done += static_cast<int64_t>(t->bytes);
    }
    if (options.progress) options.progress(std::min(done, total), total);
  };
  // A vector or norm, as fp32.
  auto vec = [&](const std::string& name, int64_t n, std::vector<float>* f) -> absl::Status {
    if (options.check_only) {
      RETURN_IF_ERROR(FindReadableTensor(file, name, {n}).status());
    } else {
      ASSIGN_OR_RETURN(*f, ReadTensorF32(file, name, {n}));
    }
    tick(name);
    return absl::OkStatus();
  };
  // A matrix {cols, rows}: fp32 into `f`, or as stored into `raw`.
  auto matrix = [&](const std::string& name, int64_t cols, int64_t rows, std::vector<float>* f,
                    RawMatrix* raw) -> absl::Status {
    if (options.check_only) {
      RETURN_IF_ERROR(FindReadableTensor(file, name, {cols, rows}).status());
    } else if (options.raw_matrices) {
      ASSIGN_OR_RETURN(*raw, ReadTensorRaw(file, name, cols, rows));
    } else {
      ASSIGN_OR_RETURN(*f, ReadTensorF32(file, name, {cols, rows}));
    }
    tick(name);
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(matrix("token_embd.weight", dim, c.vocab_size, &w.token_embd, &w.raw_token_embd));
  // The layer count comes from the metadata: a file must hold the tensors
  // of its last layer before anything is sized by that count.
  if (const std::string last = absl::StrCat("blk.", c.n_layers - 1, ".attn_norm.weight");
      file.FindTensor(last) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("the model declares ", c.n_layers,
                                                   " layers but has no tensor '", last, "'"));
  }
  w.layers.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights& L = w.layers[l];
    const std::string p = absl::StrCat("blk.", l, ".");
    RETURN_IF_ERROR(vec(p + "attn_norm.weight", dim, &L.attn_norm));
    RETURN_IF_ERROR(matrix(p + "attn_q.weight", dim, q, &L.wq, &L.raw_wq));
    RETURN_IF_ERROR(matrix(p + "attn_k.weight", dim, kv, &L.wk, &L.raw_wk));
    RETURN_IF_ERROR(matrix(p + "attn_v.weight", dim, kv, &L.wv, &L.raw_wv));
    if (c.qkv_bias) {
      RETURN_IF_ERROR(vec(p + "attn_q.bias", q, &L.bq));
      RETURN_IF_ERROR(vec(p + "attn_k.bias", kv, &L.bk));
      RETURN_IF_ERROR(vec(p + "attn_v.bias", kv, &L.bv));
    }
    if (c.qk_norm) {
      RETURN_IF_ERROR(vec(p + "attn_q_norm.weight", c.head_dim, &L.q_norm));
      RETURN_IF_ERROR(vec(p + "attn_k_norm.weight", c.head_dim, &L.k_norm));
    }
    RETURN_IF_ERROR(matrix(p + "attn_output.weight", q, dim, &L.wo, &L.raw_wo));
    RETURN_IF_ERROR(vec(p + "ffn_norm.weight", dim, &L.ffn_norm));
    RETURN_IF_ERROR(matrix(p + "ffn_gate.weight", dim, ffn, &L.w_gate, &L.raw_w_gate));
    RETURN_IF_ERROR(matrix(p + "ffn_up.weight", dim, ffn, &L.w_up, &L.raw_w_up));
    RETURN_IF_ERROR(matrix(p + "ffn_down.weight", ffn, dim, &L.w_down, &L.raw_w_down));
  }
  RETURN_IF_ERROR(vec("output_norm.weight", dim, &w.output_norm));
  if (file.FindTensor("output.weight") != nullptr) {
    RETURN_IF_ERROR(matrix("output.weight", dim, c.vocab_size, &w.output, &w.raw_output));
  } else {
    w.tied_embeddings = true;
    if (!options.raw_matrices) w.output = w.token_embd;  // tied embeddings
    tick("");
  }
  return w;
}

}  // namespace ellm
