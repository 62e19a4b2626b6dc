#include "core/model_config.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace ellm {
namespace {

// Architectures whose forward pass ellm implements, and how they differ.
struct ArchTraits {
  const char* name;
  bool rope_neox;  // RoPE rotates pairs (i, i + rope_dims/2) instead of (2i, 2i+1)
  bool qkv_bias;   // Q, K, V projections carry biases
};
constexpr ArchTraits kArchitectures[] = {
    {"llama", false, false},
    {"qwen2", true, true},
};
constexpr const char* kSupportedArchitectures[] = {"llama", "qwen2"};

const ArchTraits* FindArch(std::string_view arch) {
  for (const ArchTraits& a : kArchitectures) {
    if (arch == a.name) return &a;
  }
  return nullptr;
}

bool IsSupported(std::string_view arch) { return FindArch(arch) != nullptr; }

absl::Status Unsupported(absl::string_view arch) {
  return absl::InvalidArgumentError(absl::StrCat("unsupported architecture '", arch,
                                                 "' (ellm supports: ",
                                                 absl::StrJoin(kSupportedArchitectures, ", "),
                                                 ")"));
}

absl::StatusOr<int> ToInt(absl::string_view key, int64_t value) {
  if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(key, " = ", value, " is out of range"));
  }
  return static_cast<int>(value);
}

absl::StatusOr<int> RequiredInt(const GgufFile& file, const std::string& key) {
  if (!file.Has(key)) {
    return absl::InvalidArgumentError(absl::StrCat("missing required key '", key, "'"));
  }
  ASSIGN_OR_RETURN(int64_t value, file.GetInt(key));
  return ToInt(key, value);
}

absl::StatusOr<int> OptionalInt(const GgufFile& file, const std::string& key, int fallback) {
  if (!file.Has(key)) return fallback;
  ASSIGN_OR_RETURN(int64_t value, file.GetInt(key));
  return ToInt(key, value);
}

absl::StatusOr<float> OptionalFloat(const GgufFile& file, const std::string& key,
                                    float fallback) {
  if (!file.Has(key)) return fallback;
  ASSIGN_OR_RETURN(double value, file.GetFloat(key));
  return static_cast<float>(value);
}

// tokenizer.ggml.tokens has one entry per token; without it, the embedding
// matrix token_embd.weight is [dim, vocab] in GGUF order.
absl::StatusOr<int> VocabSize(const GgufFile& file) {
  if (const GgufValue* tokens = file.Find("tokenizer.ggml.tokens")) {
    if (tokens->type != GgufValueType::kArray) {
      return absl::InvalidArgumentError("tokenizer.ggml.tokens is not an array");
    }
    return ToInt("size of tokenizer.ggml.tokens", static_cast<int64_t>(tokens->array.size()));
  }
  if (const GgufTensorInfo* embd = file.FindTensor("token_embd.weight")) {
    if (embd->shape.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("token_embd.weight has ",
                                                     embd->shape.size(),
                                                     " dimensions, expected 2 ([dim, vocab])"));
    }
    return ToInt("token_embd.weight shape[1]", embd->shape[1]);
  }
  return absl::InvalidArgumentError(
      "cannot determine the vocabulary size: no tokenizer.ggml.tokens and no token_embd.weight");
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfig::FromGguf(const GgufFile& file) {
  ModelConfig c;
  if (!file.Has("general.architecture")) {
    return absl::InvalidArgumentError("missing required key 'general.architecture'");
  }
  ASSIGN_OR_RETURN(c.arch, file.GetString("general.architecture"));
  if (!IsSupported(c.arch)) return Unsupported(c.arch);
  if (file.Has("general.name")) {
    ASSIGN_OR_RETURN(c.name, file.GetString("general.name"));
  }

  // Every hyperparameter key is prefixed with the architecture name.
  const std::string p = c.arch + ".";
  ASSIGN_OR_RETURN(c.n_layers, RequiredInt(file, p + "block_count"));
  ASSIGN_OR_RETURN(c.dim, RequiredInt(file, p + "embedding_length"));
  ASSIGN_OR_RETURN(c.ffn_dim, RequiredInt(file, p + "feed_forward_length"));
  ASSIGN_OR_RETURN(c.context_length, RequiredInt(file, p + "context_length"));
  ASSIGN_OR_RETURN(c.n_heads, RequiredInt(file, p + "attention.head_count"));
  ASSIGN_OR_RETURN(c.n_kv_heads, OptionalInt(file, p + "attention.head_count_kv", c.n_heads));

  // head_dim: explicit key_length, else dim split evenly over the heads.
  const std::string key_length = p + "attention.key_length";
  if (file.Has(key_length)) {
    ASSIGN_OR_RETURN(c.head_dim, RequiredInt(file, key_length));
  } else if (c.n_heads > 0 && c.dim > 0) {
    if (c.dim % c.n_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, "embedding_length ", c.dim, " is not a multiple of ", p, "attention.head_count ",
          c.n_heads, " and there is no ", key_length));
    }
    c.head_dim = c.dim / c.n_heads;
  }
  // V heads as wide as K heads is all the attention code supports.
  const std::string value_length = p + "attention.value_length";
  if (file.Has(value_length)) {
    ASSIGN_OR_RETURN(int v_dim, RequiredInt(file, value_length));
    if (v_dim != c.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(value_length, " ", v_dim,
                                                     " differs from the key head size ",
                                                     c.head_dim, " (unsupported)"));
    }
  }

  ASSIGN_OR_RETURN(c.rope_dims, OptionalInt(file, p + "rope.dimension_count", c.head_dim));
  ASSIGN_OR_RETURN(c.rope_base, OptionalFloat(file, p + "rope.freq_base", 10000.0f));
  ASSIGN_OR_RETURN(c.norm_eps,
                   OptionalFloat(file, p + "attention.layer_norm_rms_epsilon", 1e-5f));
  ASSIGN_OR_RETURN(c.vocab_size, VocabSize(file));
  const ArchTraits* traits = FindArch(c.arch);
  c.rope_neox = traits->rope_neox;
  c.qkv_bias = traits->qkv_bias;

  RETURN_IF_ERROR(c.Validate());
  return c;
}

absl::Status ModelConfig::Validate() const {
  if (!IsSupported(arch)) return Unsupported(arch);
  const std::string p = arch + ".";
  const struct {
    int value;
    std::string what;
  } positive[] = {
      {n_layers, "n_layers (" + p + "block_count)"},
      {dim, "dim (" + p + "embedding_length)"},
      {ffn_dim, "ffn_dim (" + p + "feed_forward_length)"},
      {n_heads, "n_heads (" + p + "attention.head_count)"},
      {n_kv_heads, "n_kv_heads (" + p + "attention.head_count_kv)"},
      {head_dim, "head_dim (" + p + "attention.key_length)"},
      {rope_dims, "rope_dims (" + p + "rope.dimension_count)"},
      {context_length, "context_length (" + p + "context_length)"},
      {vocab_size, "vocab_size"},
  };
  for (const auto& [value, what] : positive) {
    if (value <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, " must be positive, got ", value));
    }
  }
  if (n_kv_heads > n_heads || n_heads % n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("n_heads ", n_heads,
                                                   " is not a multiple of n_kv_heads ",
                                                   n_kv_heads));
  }
  if (rope_dims % 2 != 0 || rope_dims > head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rope_dims ", rope_dims, " must be even and at most head_dim ", head_dim));
  }
  if (!std::isfinite(rope_base) || rope_base <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("rope_base ", rope_base, " must be positive"));
  }
  if (!std::isfinite(norm_eps) || norm_eps <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("norm_eps ", norm_eps, " must be positive"));
  }
  if (static_cast<int64_t>(n_heads) * head_dim > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("n_heads ", n_heads, " x head_dim ", head_dim, " overflows int"));
  }
  return absl::OkStatus();
}

std::string ModelConfig::DebugString() const {
  return absl::StrFormat(
      "arch=%s name='%s' layers=%d dim=%d ffn_dim=%d heads=%d kv_heads=%d head_dim=%d "
      "rope_dims=%d rope_base=%g norm_eps=%g context=%d vocab=%d",
      arch, name, n_layers, dim, ffn_dim, n_heads, n_kv_heads, head_dim, rope_dims, rope_base,
      norm_eps, context_length, vocab_size);
}

}  // namespace ellm
