#include "core/weights.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ellm {

absl::StatusOr<std::vector<float>> ReadTensorF32(const GgufFile& file, const std::string& name,
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
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has type ", std::string(traits.name),
                                                   ", which ellm cannot read yet"));
  }
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

absl::StatusOr<ModelWeights> LoadWeights(const GgufFile& file, const ModelConfig& c,
                                         const LoadProgress& progress) {
  ModelWeights w;
  w.config = c;
  const int64_t dim = c.dim, q = c.q_dim(), kv = c.kv_dim(), ffn = c.ffn_dim;
  const int total = 3 + 9 * c.n_layers;
  int done = 0;
  auto tick = [&] {
    ++done;
    if (progress) progress(done, total);
  };
  ASSIGN_OR_RETURN(w.token_embd, ReadTensorF32(file, "token_embd.weight", {dim, c.vocab_size}));
  tick();
  w.layers.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights& L = w.layers[l];
    const std::string p = absl::StrCat("blk.", l, ".");
    ASSIGN_OR_RETURN(L.attn_norm, ReadTensorF32(file, p + "attn_norm.weight", {dim}));
    tick();
    ASSIGN_OR_RETURN(L.wq, ReadTensorF32(file, p + "attn_q.weight", {dim, q}));
    tick();
    ASSIGN_OR_RETURN(L.wk, ReadTensorF32(file, p + "attn_k.weight", {dim, kv}));
    tick();
    ASSIGN_OR_RETURN(L.wv, ReadTensorF32(file, p + "attn_v.weight", {dim, kv}));
    tick();
    ASSIGN_OR_RETURN(L.wo, ReadTensorF32(file, p + "attn_output.weight", {q, dim}));
    tick();
    ASSIGN_OR_RETURN(L.ffn_norm, ReadTensorF32(file, p + "ffn_norm.weight", {dim}));
    tick();
    ASSIGN_OR_RETURN(L.w_gate, ReadTensorF32(file, p + "ffn_gate.weight", {dim, ffn}));
    tick();
    ASSIGN_OR_RETURN(L.w_up, ReadTensorF32(file, p + "ffn_up.weight", {dim, ffn}));
    tick();
    ASSIGN_OR_RETURN(L.w_down, ReadTensorF32(file, p + "ffn_down.weight", {ffn, dim}));
    tick();
  }
  ASSIGN_OR_RETURN(w.output_norm, ReadTensorF32(file, "output_norm.weight", {dim}));
  tick();
  if (file.FindTensor("output.weight") != nullptr) {
    ASSIGN_OR_RETURN(w.output, ReadTensorF32(file, "output.weight", {dim, c.vocab_size}));
  } else {
    w.output = w.token_embd;  // tied embeddings
  }
  tick();
  return w;
}

}  // namespace ellm
