// Model weights as fp32 arrays, dequantised once at load from the GGUF file.
// Matrices are row-major [out, in] (a GGUF tensor of shape {in, out}).
// With LoadOptions::raw_matrices the 2-D matrices are kept instead as the file
// stores them (RawMatrix), for backends with kernels on the quantised types.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/gguf.h"
#include "core/model_config.h"
#include "core/rope.h"
#include "core/status.h"

namespace ellm {

// One 2-D tensor exactly as the file stores it: `rows` rows of `cols` elements
// of `type`, row-major [rows, cols] (a GGUF tensor of shape {cols, rows}),
// each row cols / Traits(type).block_elements blocks.
struct RawMatrix {
  DType type = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> data;  // rows * row_bytes()

  bool empty() const { return data.empty(); }
  uint64_t row_bytes() const { return rows > 0 ? data.size() / static_cast<uint64_t>(rows) : 0; }
  const uint8_t* row(int64_t r) const { return data.data() + r * row_bytes(); }
};

struct LayerWeights {
  std::vector<float> attn_norm;  // [dim]
  std::vector<float> wq;         // [q_dim, dim]
  std::vector<float> wk;         // [kv_dim, dim]
  std::vector<float> wv;         // [kv_dim, dim]
  std::vector<float> bq, bk, bv;  // [q_dim], [kv_dim], [kv_dim] when config.qkv_bias
  std::vector<float> q_norm, k_norm;  // [head_dim] each when config.qk_norm
  std::vector<float> wo;         // [dim, q_dim]
  std::vector<float> ffn_norm;   // [dim]
  std::vector<float> w_gate;     // [ffn_dim, dim]
  std::vector<float> w_up;       // [ffn_dim, dim]
  std::vector<float> w_down;     // [dim, ffn_dim]
  // With LoadOptions::raw_matrices: the seven matrices above as stored (the
  // fp32 vectors wq .. w_down are then empty). Norms and biases stay fp32.
  RawMatrix raw_wq, raw_wk, raw_wv, raw_wo, raw_w_gate, raw_w_up, raw_w_down;
};

struct ModelWeights {
  ModelConfig config;
  std::vector<float> token_embd;   // [vocab, dim]
  std::vector<LayerWeights> layers;
  std::vector<float> output_norm;  // [dim]
  std::vector<float> output;       // [vocab, dim]; token_embd when the file ties them
  // True when the file has no output.weight (the LM head is token_embd).
  bool tied_embeddings = false;
  // With LoadOptions::raw_matrices: token_embd and output as stored (the fp32
  // vectors are then empty); raw_output is empty when tied_embeddings.
  RawMatrix raw_token_embd, raw_output;
};

// Progress of a long load: (done, total) in the loader's unit (LoadWeights:
// bytes of the tensors read so far, of all the file's tensors).
using LoadProgress = std::function<void(int64_t done, int64_t total)>;

// What follows the q, k, v projections of one token, in the model's order:
// biases (qkv_bias), RMSNorm of each q and k head (qk_norm), then RoPE by
// `cos_sin` (rope.CosSin at the token's position). q [n_heads, head_dim],
// k and v [n_kv_heads, head_dim].
void QkvPostprocess(const ModelConfig& c, const Rope& rope, const LayerWeights& w,
                    const float* cos_sin, float* q, float* k, float* v);

// Reads every tensor the config needs, checking names, shapes and types
// (InvalidArgument naming the tensor: missing, wrong shape, type ellm cannot
// read yet).
absl::StatusOr<ModelWeights> LoadWeights(const GgufFile& file, const ModelConfig& config,
                                         const LoadProgress& progress = nullptr);

struct LoadOptions {
  // Keep token_embd, output and the layers' seven projection matrices as the
  // file stores them (RawMatrix) instead of dequantising them to fp32.
  bool raw_matrices = false;
  // Only check every tensor's name, shape and type; read nothing (the
  // launcher's check before any worker starts).
  bool check_only = false;
  LoadProgress progress;
};

// As above, with options.
absl::StatusOr<ModelWeights> LoadWeights(const GgufFile& file, const ModelConfig& config,
                                         const LoadOptions& options);

// Reads one 2-D tensor as stored, after checking its GGUF shape {cols, rows}
// and that ellm can read its type.
absl::StatusOr<RawMatrix> ReadTensorRaw(const GgufFile& file, const std::string& name,
                                        int64_t cols, int64_t rows);

// Reads one tensor as fp32 after checking its GGUF shape.
absl::StatusOr<std::vector<float>> ReadTensorF32(const GgufFile& file, const std::string& name,
                                                 const std::vector<int64_t>& shape);

}  // namespace ellm
