#include "core/model_config.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/log.h"

namespace ellm {
namespace {

// Architectures whose forward pass ellm implements, and how they differ.
struct ArchTraits {
  const char* name;
  bool rope_neox;   // RoPE rotates pairs (i, i + rope_dims/2) instead of (2i, 2i+1)
  bool qkv_bias;    // Q, K, V projections carry biases
  bool qk_norm;     // each q and k head is RMS-normalised before RoPE
  bool rope_freqs;  // may carry rope_freqs.weight (llama3 scaling factors)
};
constexpr ArchTraits kArchitectures[] = {
    {"llama", false, false, false, true},
    {"qwen2", true, true, false, false},
    {"qwen3", true, false, true, false},
};
constexpr const char* kSupportedArchitectures[] = {"llama", "qwen2", "qwen3"};

// {arch}.* keys ellm reads (above and in ReadRopeScaling), and those that
// describe the file without changing the computation.
constexpr const char* kReadArchKeys[] = {
    "block_count", "embedding_length", "feed_forward_length", "context_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
    "rope.freq_base", "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear",
    "rope.scaling.original_context_length", "rope.scaling.attn_factor",
    // Informational only.
    "vocab_size", "rope.scaling.finetuned", "tensor_data_layout",
};
// {arch}.* keys that are harmless at one value (what ellm computes) and a
// feature ellm does not implement at any other.
struct NeutralKey {
  const char* key;
  int64_t neutral;  // integer or bool value that changes nothing
  const char* feature;
};
constexpr NeutralKey kNeutralArchKeys[] = {
    {"expert_count", 0, "a mixture of experts"},
    {"expert_used_count", 0, "a mixture of experts"},
    {"expert_shared_count", 0, "a mixture of experts"},
    {"attention.causal", 1, "non-causal attention"},
};
// What some keys ellm refuses ask for, for a clearer error.
constexpr std::pair<const char*, const char*> kKnownFeatures[] = {
    {"attention.sliding_window", "a sliding attention window"},
    {"attn_logit_softcapping", "attention logit soft-capping"},
    {"final_logit_softcapping", "final logit soft-capping"},
    {"attention.layer_norm_epsilon", "LayerNorm instead of RMSNorm"},
    {"attention.scale", "a non-default attention scale"},
    {"attention.clamp_kqv", "clamped q, k, v"},
    {"embedding_scale", "scaled embeddings"},
    {"residual_scale", "scaled residuals"},
    {"logit_scale", "scaled logits"},
    {"pooling_type", "pooled (embedding) outputs"},
    {"rope.dimension_sections", "multi-section RoPE"},
    {"rope.scaling.yarn_log_multiplier", "a YaRN log multiplier"},
};
// Top-level key namespaces that do not describe the computation: file
// information, the tokenizer (read by core/tokenizer), quantisation notes.
constexpr const char* kPassiveNamespaces[] = {"general.", "tokenizer.", "quantize.", "split."};

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

absl::StatusOr<float> RequiredFloat(const GgufFile& file, const std::string& key) {
  if (!file.Has(key)) {
    return absl::InvalidArgumentError(absl::StrCat("missing required key '", key, "'"));
  }
  ASSIGN_OR_RETURN(double value, file.GetFloat(key));
  return static_cast<float>(value);
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

absl::Status Refuse(absl::string_view what, absl::string_view feature) {
  return absl::InvalidArgumentError(absl::StrCat(
      what, feature.empty() ? " is unknown to ellm" : absl::StrCat(" asks for ", feature),
      ": ellm does not implement it and refuses a model it cannot compute faithfully"));
}

// Every metadata key either is read, describes the file only, holds the
// value ellm computes anyway, or refuses the model.
absl::Status CheckMetadataKeys(const GgufFile& file, const std::string& arch) {
  const std::string p = arch + ".";
  for (const auto& [key, value] : file.metadata()) {
    bool passive = false;
    for (const char* ns : kPassiveNamespaces) passive = passive || absl::StartsWith(key, ns);
    if (key == "split.count") {
      ASSIGN_OR_RETURN(int64_t parts, file.GetInt(key));
      if (parts > 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the model is split over ", parts, " GGUF files; merge them into one first "
            "(llama-gguf-split --merge)"));
      }
    }
    if (passive) continue;
    const std::string_view name = std::string_view(key).substr(absl::StartsWith(key, p) ? p.size() : 0);
    const std::string what = absl::StrCat("metadata key '", key, "'");
    if (!absl::StartsWith(key, p)) return Refuse(what, "");
    bool read = false;
    for (const char* k : kReadArchKeys) read = read || name == k;
    if (read) continue;
    const NeutralKey* neutral = nullptr;
    for (const NeutralKey& n : kNeutralArchKeys) {
      if (name == n.key) neutral = &n;
    }
    if (neutral != nullptr) {
      const bool is_bool = value.type == GgufValueType::kBool;
      absl::StatusOr<int64_t> v = is_bool ? absl::StatusOr<int64_t>(value.b) : file.GetInt(key);
      if (v.ok() && *v == neutral->neutral) continue;
      return Refuse(absl::StrCat(what, " = ", v.ok() ? absl::StrCat(*v) : "(not an integer)"),
                    neutral->feature);
    }
    absl::string_view feature;
    for (const auto& [k, f] : kKnownFeatures) {
      if (name == k) feature = f;
    }
    return Refuse(what, feature);
  }
  return absl::OkStatus();
}

// {arch}.rope.scaling.*, as llama.cpp reads them: a missing type with a
// factor means linear; "none" ignores the factor.
absl::StatusOr<RopeScaling> ReadRopeScaling(const GgufFile& file, const std::string& p,
                                            int context_length) {
  RopeScaling r;
  std::string type;
  if (file.Has(p + "rope.scaling.type")) {
    ASSIGN_OR_RETURN(type, file.GetString(p + "rope.scaling.type"));
  }
  float factor = 0;
  if (file.Has(p + "rope.scaling.factor")) {
    ASSIGN_OR_RETURN(factor, OptionalFloat(file, p + "rope.scaling.factor", 0));
  } else {
    ASSIGN_OR_RETURN(factor, OptionalFloat(file, p + "rope.scale_linear", 0));
  }
  if (!std::isfinite(factor) || factor < 0) {
    return absl::InvalidArgumentError(absl::StrCat(p, "rope.scaling.factor ", factor,
                                                   " must be positive"));
  }
  if (type.empty()) type = factor > 0 && factor != 1 ? "linear" : "none";
  if (type == "none") {
    r.type = RopeScalingType::kNone;
  } else if (type == "linear") {
    r.type = RopeScalingType::kLinear;
    r.factor = factor > 0 ? factor : 1;
  } else if (type == "yarn") {
    r.type = RopeScalingType::kYarn;
    r.factor = factor > 0 ? factor : 1;
    ASSIGN_OR_RETURN(r.original_context,
                     OptionalInt(file, p + "rope.scaling.original_context_length", context_length));
  } else {
    return Refuse(absl::StrCat(p, "rope.scaling.type '", type, "'"),
                  type == "longrope" ? "LongRoPE scaling" : "");
  }
  ASSIGN_OR_RETURN(r.attn_factor, OptionalFloat(file, p + "rope.scaling.attn_factor", 1.0f));
  return r;
}

// Every tensor belongs to the computation of `c` (LoadWeights checks that
// the ones it needs are there, with their shapes).
absl::Status CheckTensorNames(const GgufFile& file, const ModelConfig& c, const ArchTraits& traits) {
  std::vector<std::string> per_layer = {"attn_norm.weight",   "attn_q.weight",   "attn_k.weight",
                                        "attn_v.weight",      "attn_output.weight",
                                        "ffn_norm.weight",    "ffn_gate.weight", "ffn_up.weight",
                                        "ffn_down.weight"};
  if (traits.qkv_bias) {
    for (const char* b : {"attn_q.bias", "attn_k.bias", "attn_v.bias"}) per_layer.push_back(b);
  }
  if (traits.qk_norm) {
    for (const char* n : {"attn_q_norm.weight", "attn_k_norm.weight"}) per_layer.push_back(n);
  }
  std::vector<std::string> global = {"token_embd.weight", "output_norm.weight", "output.weight"};
  if (traits.rope_freqs) global.push_back("rope_freqs.weight");
  for (const GgufTensorInfo& t : file.tensors()) {
    const std::string& name = t.name;
    bool known = false;
    if (absl::StartsWith(name, "blk.")) {
      const size_t dot = name.find('.', 4);
      int layer = -1;
      // The number as the loader spells it ("blk.01." or "blk.+1." would
      // pass SimpleAtoi but never be read).
      if (dot != std::string::npos && absl::SimpleAtoi(name.substr(4, dot - 4), &layer) &&
          layer >= 0 && layer < c.n_layers && absl::StrCat(layer) == name.substr(4, dot - 4)) {
        const std::string rest = name.substr(dot + 1);
        for (const std::string& n : per_layer) known = known || rest == n;
      }
    } else {
      for (const std::string& n : global) known = known || name == n;
    }
    if (!known) {
      return Refuse(absl::StrCat("tensor '", name, "'"),
                    absl::StrCat("a computation outside the '", c.arch, "' architecture"));
    }
  }
  return absl::OkStatus();
}

// rope_freqs.weight: [rope_dims / 2] positive factors.
absl::StatusOr<std::vector<float>> ReadRopeFreqs(const GgufFile& file, int rope_dims) {
  const GgufTensorInfo* t = file.FindTensor("rope_freqs.weight");
  if (t == nullptr) return std::vector<float>();
  const std::vector<int64_t> want = {rope_dims / 2};
  if (t->shape != want) {
    return absl::InvalidArgumentError(absl::StrCat("tensor 'rope_freqs.weight' has shape {",
                                                   absl::StrJoin(t->shape, ", "),
                                                   "}, expected {", rope_dims / 2, "}"));
  }
  const DTypeTraits& traits = Traits(t->type);
  if (traits.dequantize == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("tensor 'rope_freqs.weight' has type ",
                                                   std::string(traits.name),
                                                   ", which ellm cannot read"));
  }
  std::vector<float> f(static_cast<size_t>(rope_dims / 2));
  traits.dequantize(file.TensorData(*t), f.data(), static_cast<int64_t>(f.size()));
  for (size_t i = 0; i < f.size(); ++i) {
    if (!std::isfinite(f[i]) || f[i] <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("rope_freqs.weight[", i, "] = ", f[i], " must be a positive factor"));
    }
  }
  return f;
}

// Llama 3.1 and later (3.2, 3.3) scale their rotary frequencies with
// rope_freqs.weight, which llama.cpp writes since 2024-07-27; a file
// converted in the days before carries no trace of the scaling and reads as
// a Llama 3 (rope base 500000, the Llama-3 vocabulary) with a context over
// Llama 3's 8192. Served without the factors, every position would rotate
// wrongly, so such a file is refused.
absl::Status CheckLlama31RopeFreqs(const ModelConfig& c) {
  constexpr int kLlama3Vocab = 128256;
  // (Fine-tunes may add tokens to the vocabulary.)
  if (c.arch != "llama" || c.rope_base != 500000.0f || c.vocab_size < kLlama3Vocab ||
      c.context_length <= 8192 || !c.rope_freq_factors.empty() ||
      c.rope_scaling.type != RopeScalingType::kNone) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "this looks like Llama 3.1 or later (rope base 500000, the Llama-3 vocabulary, a context of ",
      c.context_length, ") without its rope_freqs.weight tensor (files converted by llama.cpp before "
      "2024-07-27 lack it): without Llama 3.1's frequency scaling every position would be computed "
      "wrongly; convert the model again with a current llama.cpp"));
}

// Mistral-7B v0.1 (and its fine-tunes: Zephyr-7B, OpenHermes-2.5, ...)
// attends through a 4096-token sliding window, which its GGUF does not say
// (llama.cpp's converter writes no sliding_window key for arch llama) and
// ellm does not implement. Its shape gives it away: Mistral 7B's sizes with
// v0.1's rope base of 10000 (v0.2 and later: 1e6, and no window) and a
// declared context of 32768. Within 4096 positions full attention is the
// window's, so its context is capped there, with a warning.
void CapMistralV01Context(ModelConfig* c) {
  constexpr int kWindow = 4096;
  // The vocabulary: 32000, or a few more where a fine-tune added tokens
  // (OpenHermes-2.5: 32002, ChatML's); v0.3 has 32768 (and rope base 1e6).
  if (c->arch != "llama" || c->n_layers != 32 || c->dim != 4096 || c->ffn_dim != 14336 || c->n_heads != 32 ||
      c->n_kv_heads != 8 || c->vocab_size < 32000 || c->vocab_size >= 32768 || c->rope_base != 10000.0f ||
      c->context_length <= kWindow) {
    return;
  }
  LogWarning("model: Mistral-7B v0.1's shape (rope base 10000): it attends through a %d-token sliding window, "
             "which ellm does not implement; its context is capped from %d to %d", kWindow, c->context_length,
             kWindow);
  c->context_length = kWindow;
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
  // Required, as llama.cpp requires it: models differ (1e-5, 1e-6), and a
  // guess would shift every norm of the model.
  ASSIGN_OR_RETURN(c.norm_eps, RequiredFloat(file, p + "attention.layer_norm_rms_epsilon"));
  ASSIGN_OR_RETURN(c.vocab_size, VocabSize(file));
  const ArchTraits* traits = FindArch(c.arch);
  c.rope_neox = traits->rope_neox;
  c.qkv_bias = traits->qkv_bias;
  c.qk_norm = traits->qk_norm;
  ASSIGN_OR_RETURN(c.rope_scaling, ReadRopeScaling(file, p, c.context_length));
  RETURN_IF_ERROR(CheckMetadataKeys(file, c.arch));
  RETURN_IF_ERROR(c.Validate());
  // Partial rotary: llama.cpp refuses it for llama (the converter's q/k
  // permutation spans the whole head), and the Qwen2 and Qwen3 models rotate
  // whole heads, so what such a file means is not known; rotating only its
  // first dimensions would be a guess.
  if (c.rope_dims != c.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        p, "rope.dimension_count is ", c.rope_dims, ", less than the head dimension ", c.head_dim,
        " (partial rotary): '", c.arch, "' rotates whole heads"));
  }
  RETURN_IF_ERROR(CheckTensorNames(file, c, *traits));
  ASSIGN_OR_RETURN(c.rope_freq_factors, ReadRopeFreqs(file, c.rope_dims));
  RETURN_IF_ERROR(CheckLlama31RopeFreqs(c));
  CapMistralV01Context(&c);
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
  if (qkv_bias && qk_norm) {
    // No architecture has both, and the backends apply them in one order only.
    return absl::InvalidArgumentError("q/k/v biases together with q/k norms are not supported");
  }
  const RopeScaling& r = rope_scaling;
  if (!std::isfinite(r.factor) || r.factor <= 0 || !std::isfinite(r.attn_factor) ||
      r.attn_factor <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("rope scaling factor ", r.factor,
                                                   " and attn_factor ", r.attn_factor,
                                                   " must be positive"));
  }
  if (r.type == RopeScalingType::kYarn && r.factor < 1) {
    // YaRN's attention magnitude for a factor below 1 differs between
    // implementations (llama.cpp changed its own); no model ships one.
    return absl::InvalidArgumentError(absl::StrCat("yarn rope scaling with a factor below 1 (", r.factor,
                                                   ") is not supported"));
  }
  if (r.type == RopeScalingType::kYarn &&
      (r.original_context <= 0 || !(r.beta_fast > r.beta_slow) || !(r.beta_slow > 0))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "yarn rope scaling needs a positive original context (got ", r.original_context,
        ") and beta_fast > beta_slow > 0 (got ", r.beta_fast, ", ", r.beta_slow, ")"));
  }
  if (!rope_freq_factors.empty() &&
      rope_freq_factors.size() != static_cast<size_t>(rope_dims / 2)) {
    return absl::InvalidArgumentError(absl::StrCat("rope_freqs holds ", rope_freq_factors.size(),
                                                   " factors, expected rope_dims / 2 = ",
                                                   rope_dims / 2));
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
  std::string scaling;
  switch (rope_scaling.type) {
    case RopeScalingType::kNone: break;
    case RopeScalingType::kLinear:
      scaling = absl::StrFormat(" rope_scaling=linear(x%g)", rope_scaling.factor);
      break;
    case RopeScalingType::kYarn:
      scaling = absl::StrFormat(" rope_scaling=yarn(x%g, original context %d)",
                                rope_scaling.factor, rope_scaling.original_context);
      break;
  }
  if (rope_scaling.attn_factor != 1) {
    absl::StrAppendFormat(&scaling, " rope_attn_factor=%g", rope_scaling.attn_factor);
  }
  if (!rope_freq_factors.empty()) absl::StrAppend(&scaling, " rope_freqs=llama3");
  return absl::StrFormat(
      "arch=%s name='%s' layers=%d dim=%d ffn_dim=%d heads=%d kv_heads=%d head_dim=%d "
      "rope_dims=%d rope_base=%g%s norm_eps=%g context=%d vocab=%d",
      arch, name, n_layers, dim, ffn_dim, n_heads, n_kv_heads, head_dim, rope_dims, rope_base,
      scaling, norm_eps, context_length, vocab_size);
}

}  // namespace ellm
