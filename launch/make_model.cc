// ellm-make-model: writes a GGUF model with random weights of any shape, with
// the tokenizer of a given vocabulary GGUF. For tests and benchmarks.
#include <cstdio>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "core/args.h"
#include "core/gguf.h"
#include "core/log.h"
#include "core/model_config.h"
#include "core/model_maker.h"

namespace ellm::launch {
namespace {

int Main(int argc, char** argv) {
  SetLogIdentity("make-model");
  Args args(
      "ellm-make-model: write a GGUF model with random weights.\n\n"
      "Usage: ellm-make-model --arch llama|qwen2|qwen3 --layers N --hidden N --heads N\n"
      "         --kv-heads N --head-dim N --ffn N --weight-type TYPE --vocab-from VOCAB.gguf\n"
      "         --out FILE [--context N] [--seed N]\n"
      "         [--chat-template chatml|qwen3|llama2|llama3|none]\n"
      "         [--rope-scaling llama3|yarn|linear [--rope-factor F] [--rope-original-context N]\n"
      "          [--rope-low-freq-factor F] [--rope-high-freq-factor F]] [--rope-attn-factor F]\n"
      "Weights are N(0, 1/fan_in) (norms near 1, qwen2 biases small), so activations stay in\n"
      "a realistic range; the same flags give the same bytes. qwen2 and qwen3 models tie the\n"
      "LM head to the embeddings (no output.weight); qwen3 has q/k norms and no biases.\n"
      "Rope scaling is written as llama.cpp's converters write it: llama3 as a\n"
      "rope_freqs.weight tensor (llama only), yarn and linear as rope.scaling.* keys.");
  args.Flag("arch", "llama", "llama, qwen2 or qwen3");
  args.Flag("layers", "2", "transformer blocks");
  args.Flag("hidden", "", "embedding width");
  args.Flag("heads", "", "query heads");
  args.Flag("kv-heads", "", "KV heads (divides --heads)");
  args.Flag("head-dim", "", "head width (default hidden / heads)");
  args.Flag("ffn", "", "MLP width");
  args.Flag("weight-type", "f32", "f32, f16, bf16, q8_0, q4_0, q4_k, q5_k or q6_k");
  args.Flag("embedding-type", "", "type of token_embd (and output) when not --weight-type");
  args.Flag("vocab-from", "", "GGUF whose tokenizer the model gets (e.g. a vocab-only file)");
  args.Flag("context", "0", "context length (0: the vocab file's, else 4096)");
  args.Flag("seed", "1", "random seed");
  args.Flag("chat-template", "", "chatml, qwen3, llama2, llama3 or none (default: the vocab file's)");
  args.Flag("rope-base", "0", "rope frequency base (0: 1e6 for qwen, 10000 for llama)");
  args.Flag("rope-scaling", "", "llama3, yarn or linear (default: none)");
  args.Flag("rope-factor", "0", "scaling factor (0: 8 for llama3, 4 for yarn, 2 for linear)");
  args.Flag("rope-original-context", "0", "yarn, llama3: the trained context (0: context / factor)");
  args.Flag("rope-low-freq-factor", "1", "llama3: low_freq_factor");
  args.Flag("rope-high-freq-factor", "4", "llama3: high_freq_factor");
  args.Flag("rope-attn-factor", "0", "rope.scaling.attn_factor to write (0: none)");
  args.Flag("out", "", "output file");
  if (std::optional<int> exit = args.ParseFlagsOnly(argc, argv)) return *exit;
  MakeModelOptions o;
  o.arch = args.Get("arch");
  o.vocab_from = args.Get("vocab-from");
  o.chat_template = args.Get("chat-template");
  absl::Status st = args.GetInts({{"layers", &o.layers}, {"hidden", &o.hidden}, {"heads", &o.heads},
                     {"kv-heads", &o.kv_heads}, {"ffn", &o.ffn}, {"context", &o.context}});
  if (!st.ok()) {
    LogError("%s (required: --hidden --heads --kv-heads --ffn)", st.message());
    return 2;
  }
  if (args.IsSet("head-dim")) {
    absl::StatusOr<int> v = args.GetInt("head-dim");
    if (!v.ok()) {
      LogError("%s", v.status().message());
      return 2;
    }
    o.head_dim = *v;
  } else {
    o.head_dim = o.heads > 0 ? o.hidden / o.heads : 0;
  }
  o.rope_scaling = args.Get("rope-scaling");
  st = args.GetInts({{"rope-original-context", &o.rope_original_context}});
  for (auto [flag, value] : {std::pair{"rope-base", &o.rope_base}, std::pair{"rope-factor", &o.rope_factor},
                             std::pair{"rope-low-freq-factor", &o.rope_low_freq_factor},
                             std::pair{"rope-high-freq-factor", &o.rope_high_freq_factor},
                             std::pair{"rope-attn-factor", &o.rope_attn_factor}}) {
    if (!st.ok()) break;
    absl::StatusOr<double> v = args.GetDouble(flag);
    if (v.ok()) *value = static_cast<float>(*v);
    st = v.status();
  }
  if (!st.ok()) {
    LogError("%s", st.message());
    return 2;
  }
  absl::StatusOr<uint64_t> seed = args.GetUint64("seed");
  if (!seed.ok()) {
    LogError("%s", seed.status().message());
    return 2;
  }
  o.seed = *seed;
  absl::StatusOr<DType> type = ParseWeightType(args.Get("weight-type"));
  if (!type.ok()) {
    LogError("%s", type.status().message());
    return 2;
  }
  o.weight_type = *type;
  if (!args.Get("embedding-type").empty()) {
    absl::StatusOr<DType> embedding = ParseWeightType(args.Get("embedding-type"));
    if (!embedding.ok()) {
      LogError("--embedding-type: %s", embedding.status().message());
      return 2;
    }
    o.embedding_type = *embedding;
  }
  const std::string out = args.Get("out");
  if (out.empty()) {
    LogError("--out is required");
    return 2;
  }
  int last = -1;
  absl::StatusOr<GgufWriter> model = MakeRandomModel(o, [&](int done, int total) {
    if (done * 10 / total != last) {
      last = done * 10 / total;
      LogInfo("tensors %d/%d", done, total);
    }
  });
  if (!model.ok()) {
    LogError("%s", model.status().message());
    return 1;
  }
  st = model->WriteFile(out);
  if (!st.ok()) {
    LogError("%s", st.message());
    return 1;
  }
  // Read it back as ellm would.
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(out);
  absl::StatusOr<ModelConfig> config = file.ok() ? ModelConfig::FromGguf(**file)
                                                 : absl::StatusOr<ModelConfig>(file.status());
  if (!config.ok()) {
    LogError("the written file does not load: %s (removed it)", config.status().message());
    std::error_code ec;
    std::filesystem::remove(out, ec);
    return 1;
  }
  LogInfo("wrote %s: %s", out, config->DebugString());
  return 0;
}

}  // namespace
}  // namespace ellm::launch

int main(int argc, char** argv) { return ellm::launch::Main(argc, argv); }
