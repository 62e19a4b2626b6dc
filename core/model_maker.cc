#include "core/model_maker.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sampler.h"

namespace ellm {

absl::StatusOr<DType> ParseWeightType(const std::string& name) {
  // Every type core/quants.h can write, by its name in the dtype table.
  std::vector<std::string> names;
  for (const DTypeTraits& t : AllDTypeTraits()) {
    if (t.quantize == nullptr) continue;
    if (absl::EqualsIgnoreCase(name, ToAbsl(t.name))) return t.type;
    names.push_back(absl::AsciiStrToLower(ToAbsl(t.name)));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown weight type '", name, "' (one of ", absl::StrJoin(names, ", "), ")"));
}

std::vector<float> Llama3RopeFactors(int rope_dims, double base, double factor, double low_freq_factor,
                                     double high_freq_factor, double original_context) {
  std::vector<float> out;
  const double low_wavelen = original_context / low_freq_factor;
  const double high_wavelen = original_context / high_freq_factor;
  for (int i = 0; i < rope_dims / 2; ++i) {
    const double wavelen = 2 * M_PI * std::pow(base, 2.0 * i / rope_dims);
    double f = 1;
    if (wavelen > low_wavelen) {
      f = factor;
    } else if (wavelen >= high_wavelen) {
      const double smooth =
          (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
      f = 1 / ((1 - smooth) / factor + smooth);
    }
    out.push_back(static_cast<float>(f));
  }
  return out;
}

namespace {

// Normal draws from the reproducible generator (Box-Muller).
class Normal {
 public:
  explicit Normal(uint64_t seed) : rng_(seed) {}
  float Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u1 = 0;
    while (u1 <= 1e-12) u1 = rng_.NextUniform();
    const double u2 = rng_.NextUniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = static_cast<float>(r * std::sin(2 * M_PI * u2));
    has_spare_ = true;
    return static_cast<float>(r * std::cos(2 * M_PI * u2));
  }

 private:
  SequenceRng rng_;
  bool has_spare_ = false;
  float spare_ = 0;
};

// Encodes [rows, cols] floats (GGUF shape {cols, rows}) as `type`.
absl::StatusOr<std::string> Encode(const std::vector<float>& values, int64_t cols, DType type) {
  const DTypeTraits& t = Traits(type);
  ASSIGN_OR_RETURN(uint64_t bytes, DTypeBytes(type, values.size()));
  std::string out(bytes, '\0');
  if (t.quantize == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot write weight type ", std::string(t.name)));
  }
  const int64_t rows = static_cast<int64_t>(values.size()) / cols;
  const uint64_t row_bytes = bytes / rows;
  for (int64_t r = 0; r < rows; ++r) {
    t.quantize(values.data() + r * cols, out.data() + r * row_bytes, cols);
  }
  return out;
}

}  // namespace

absl::StatusOr<GgufWriter> MakeRandomModel(const MakeModelOptions& o,
                                           const std::function<void(int, int)>& progress) {
  if (o.arch != "llama" && o.arch != "qwen2" && o.arch != "qwen3") {
    return absl::InvalidArgumentError(
        absl::StrCat("--arch must be llama, qwen2 or qwen3, got '", o.arch, "'"));
  }
  const std::string& scaling = o.rope_scaling;
  if (!scaling.empty() && scaling != "linear" && scaling != "yarn" && scaling != "llama3") {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown rope scaling '", scaling, "' (llama3, yarn, linear, or none given)"));
  }
  if (scaling == "llama3" && o.arch != "llama") {
    return absl::InvalidArgumentError("llama3 rope scaling (rope_freqs.weight) is for --arch llama");
  }
  if (o.layers <= 0 || o.hidden <= 0 || o.heads <= 0 || o.kv_heads <= 0 || o.head_dim <= 0 ||
      o.ffn <= 0 || o.heads % o.kv_heads != 0 || o.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        "layers, hidden, heads, kv-heads, head-dim and ffn must be positive; heads a multiple of "
        "kv-heads; head-dim even");
  }
  if (o.vocab_from.empty()) return absl::InvalidArgumentError("--vocab-from is required");
  ASSIGN_OR_RETURN(auto vocab, GgufFile::Open(o.vocab_from));
  ASSIGN_OR_RETURN(std::vector<std::string> tokens, vocab->GetStringArray("tokenizer.ggml.tokens"));
  const int64_t n_vocab = static_cast<int64_t>(tokens.size());

  GgufWriter w;
  const std::string& a = o.arch;
  w.SetString("general.architecture", a);
  w.SetString("general.name", absl::StrCat("ellm-random-", a));
  int context = o.context;
  if (context <= 0) {
    auto from_vocab = vocab->GetInt(a + ".context_length");
    context = from_vocab.ok() ? static_cast<int>(*from_vocab) : 4096;
  }
  w.SetUint32(a + ".context_length", context);
  w.SetUint32(a + ".embedding_length", o.hidden);
  w.SetUint32(a + ".feed_forward_length", o.ffn);
  w.SetUint32(a + ".block_count", o.layers);
  w.SetUint32(a + ".attention.head_count", o.heads);
  w.SetUint32(a + ".attention.head_count_kv", o.kv_heads);
  w.SetUint32(a + ".attention.key_length", o.head_dim);
  w.SetUint32(a + ".attention.value_length", o.head_dim);
  w.SetUint32(a + ".rope.dimension_count", o.head_dim);
  const bool qwen = a == "qwen2" || a == "qwen3";
  const float rope_base = o.rope_base > 0 ? o.rope_base : qwen ? 1e6f : 10000.0f;
  w.SetFloat32(a + ".rope.freq_base", rope_base);
  w.SetFloat32(a + ".attention.layer_norm_rms_epsilon", qwen ? 1e-6f : 1e-5f);
  const float rope_factor = o.rope_factor > 0                ? o.rope_factor
                            : scaling == "llama3"            ? 8.0f
                            : scaling == "yarn"              ? 4.0f
                                                             : 2.0f;
  const int original_context = o.rope_original_context > 0
                                   ? o.rope_original_context
                                   : std::max(1, static_cast<int>(context / rope_factor));
  if (scaling == "linear" || scaling == "yarn") {
    w.SetString(a + ".rope.scaling.type", scaling);
    w.SetFloat32(a + ".rope.scaling.factor", rope_factor);
    if (scaling == "yarn") w.SetUint32(a + ".rope.scaling.original_context_length", original_context);
  }
  if (o.rope_attn_factor > 0) w.SetFloat32(a + ".rope.scaling.attn_factor", o.rope_attn_factor);
  w.CopyMetadata(*vocab, "tokenizer.");
  // Minimal Jinja templates of each family (ellm recognises a family by its markers).
  if (o.chat_template == "qwen3") {
    // The shape of Qwen3's template: ChatML, earlier answers without their
    // <think> part, the answer opens its own thinking block; tools listed in
    // the system turn, calls and answers as <tool_call> and <tool_response>.
    w.SetString("tokenizer.chat_template",
                "{% if tools %}{{ '<|im_start|>system\n# Tools\n\nYou are provided with function signatures "
                "within <tools></tools> XML tags:\n<tools>' }}{% for tool in tools %}{{ '\n' + tool | tojson }}"
                "{% endfor %}{{ '\n</tools>\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call><|im_end|>\n' }}{% endif %}"
                "{# a run of tools' answers: <|im_start|>user\n<tool_response>\n...\n</tool_response><|im_end|> #}"
                "{% for message in messages %}{% if message['role'] == 'assistant' %}{% set content = "
                "message['content'].split('</think>')[-1].lstrip('\n') %}{% else %}{% set content = "
                "message['content'] %}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + content + "
                "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
                "{% endif %}{% endif %}");
  } else if (o.chat_template == "chatml") {
    w.SetString("tokenizer.chat_template",
                "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|im_start|>assistant\\n' }}{% endif %}");
  } else if (o.chat_template == "llama3") {
    w.SetString("tokenizer.chat_template",
                "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] "
                "+ '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
                "{% endif %}");
  } else if (o.chat_template == "llama2") {
    w.SetString("tokenizer.chat_template",
                "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
                "{% set system_message = '<<SYS>>\\n' + messages[0]['content'] | trim + '\\n<</SYS>>\\n\\n' %}"
                "{% else %}{% set loop_messages = messages %}{% set system_message = '' %}{% endif %}"
                "{% for message in loop_messages %}{% if loop.index0 == 0 %}"
                "{% set content = system_message + message['content'] | trim %}"
                "{% else %}{% set content = message['content'] | trim %}{% endif %}"
                "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content + ' [/INST]' }}"
                "{% else %}{{ ' ' + content + ' ' + eos_token }}{% endif %}{% endfor %}");
  } else if (o.chat_template == "none") {
    w.SetString("tokenizer.chat_template", "");
  } else if (!o.chat_template.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown chat template '", o.chat_template,
                                                   "' (chatml, qwen3, llama2, llama3 or none)"));
  }

  const bool bias = a == "qwen2", qk_norm = a == "qwen3";
  const int64_t q_dim = int64_t{o.heads} * o.head_dim, kv_dim = int64_t{o.kv_heads} * o.head_dim;
  const int total = 2 + (qwen ? 0 : 1) + (scaling == "llama3" ? 1 : 0) +
                    o.layers * (9 + (bias ? 3 : 0) + (qk_norm ? 2 : 0));
  int done = 0;
  Normal normal(o.seed);

  // A matrix [rows, cols] with N(0, scale²) entries, in the weight type (F16
  // when its rows do not split into whole blocks of that type).
  auto add_typed_matrix = [&](const std::string& name, int64_t cols, int64_t rows, float scale,
                              DType type) -> absl::Status {
    std::vector<float> v(static_cast<size_t>(rows * cols));
    for (float& x : v) x = normal.Next() * scale;
    if (cols % Traits(type).block_elements != 0) type = DType::kF16;
    ASSIGN_OR_RETURN(std::string bytes, Encode(v, cols, type));
    RETURN_IF_ERROR(w.AddTensor(name, {cols, rows}, type, std::move(bytes)));
    if (progress) progress(++done, total);
    return absl::OkStatus();
  };
  auto add_matrix = [&](const std::string& name, int64_t cols, int64_t rows, float scale) {
    return add_typed_matrix(name, cols, rows, scale, o.weight_type);
  };
  auto add_vector = [&](const std::string& name, int64_t n, float value, float noise) -> absl::Status {
    std::vector<float> v(n);
    for (float& x : v) x = value + (noise > 0 ? normal.Next() * noise : 0);
    std::string bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    RETURN_IF_ERROR(w.AddTensor(name, {n}, DType::kF32, std::move(bytes)));
    if (progress) progress(++done, total);
    return absl::OkStatus();
  };

  const float in_hidden = 1.0f / std::sqrt(static_cast<float>(o.hidden));
  const DType embedding_type = o.embedding_type.value_or(o.weight_type);
  RETURN_IF_ERROR(add_typed_matrix("token_embd.weight", o.hidden, n_vocab, 2.0f * in_hidden, embedding_type));
  if (scaling == "llama3") {
    const std::vector<float> f = Llama3RopeFactors(o.head_dim, rope_base, rope_factor,
                                                   o.rope_low_freq_factor, o.rope_high_freq_factor,
                                                   original_context);
    std::string bytes(reinterpret_cast<const char*>(f.data()), f.size() * sizeof(float));
    RETURN_IF_ERROR(w.AddTensor("rope_freqs.weight", {static_cast<int64_t>(f.size())}, DType::kF32,
                                std::move(bytes)));
    if (progress) progress(++done, total);
  }
  for (int l = 0; l < o.layers; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    RETURN_IF_ERROR(add_vector(p + "attn_norm.weight", o.hidden, 1.0f, 0));
    RETURN_IF_ERROR(add_matrix(p + "attn_q.weight", o.hidden, q_dim, in_hidden));
    RETURN_IF_ERROR(add_matrix(p + "attn_k.weight", o.hidden, kv_dim, in_hidden));
    RETURN_IF_ERROR(add_matrix(p + "attn_v.weight", o.hidden, kv_dim, in_hidden));
    if (bias) {
      RETURN_IF_ERROR(add_vector(p + "attn_q.bias", q_dim, 0, 0.1f));
      RETURN_IF_ERROR(add_vector(p + "attn_k.bias", kv_dim, 0, 0.1f));
      RETURN_IF_ERROR(add_vector(p + "attn_v.bias", kv_dim, 0, 0.1f));
    }
    if (qk_norm) {
      RETURN_IF_ERROR(add_vector(p + "attn_q_norm.weight", o.head_dim, 1.0f, 0.2f));
      RETURN_IF_ERROR(add_vector(p + "attn_k_norm.weight", o.head_dim, 1.0f, 0.2f));
    }
    RETURN_IF_ERROR(add_matrix(p + "attn_output.weight", q_dim, o.hidden,
                               1.0f / std::sqrt(static_cast<float>(q_dim))));
    RETURN_IF_ERROR(add_vector(p + "ffn_norm.weight", o.hidden, 1.0f, 0));
    RETURN_IF_ERROR(add_matrix(p + "ffn_gate.weight", o.hidden, o.ffn, in_hidden));
    RETURN_IF_ERROR(add_matrix(p + "ffn_up.weight", o.hidden, o.ffn, in_hidden));
    RETURN_IF_ERROR(add_matrix(p + "ffn_down.weight", o.ffn, o.hidden,
                               1.0f / std::sqrt(static_cast<float>(o.ffn))));
  }
  RETURN_IF_ERROR(add_vector("output_norm.weight", o.hidden, 1.0f, 0));
  // qwen2 and qwen3 tie the LM head to the embeddings (no output.weight), as
  // Qwen2.5-0.5B and Qwen3-0.6B do.
  if (!qwen) RETURN_IF_ERROR(add_typed_matrix("output.weight", o.hidden, n_vocab, 2.0f * in_hidden, embedding_type));
  return w;
}

}  // namespace ellm
