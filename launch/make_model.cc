// ellm-make-model: writes a GGUF model with random weights of any shape, with
// the tokenizer of a given vocabulary GGUF. For tests and benchmarks.
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "core/gguf.h"
#include "core/log.h"
#include "core/model_config.h"
#include "core/model_maker.h"
#include "launch/args.h"

namespace ellm::launch {
namespace {

int Main(int argc, char** argv) {
  SetLogIdentity("make-model");
  Args args(
      "ellm-make-model: write a GGUF model with random weights.\n\n"
      "Usage: ellm-make-model --arch qwen2|llama --layers N --hidden N --heads N --kv-heads N\n"
      "         --head-dim N --ffn N --weight-type TYPE --vocab-from VOCAB.gguf --out FILE\n"
      "         [--context N] [--seed N] [--chat-template chatml|llama2|llama3|none]\n"
      "Weights are N(0, 1/fan_in) (norms 1, qwen2 biases small), so activations stay in a\n"
      "realistic range; the same flags give the same bytes. qwen2 models tie the LM head to\n"
      "the embeddings (no output.weight).");
  args.Flag("arch", "llama", "llama or qwen2");
  args.Flag("layers", "2", "transformer blocks");
  args.Flag("hidden", "", "embedding width");
  args.Flag("heads", "", "query heads");
  args.Flag("kv-heads", "", "KV heads (divides --heads)");
  args.Flag("head-dim", "", "head width (default hidden / heads)");
  args.Flag("ffn", "", "MLP width");
  args.Flag("weight-type", "f32", "f32, f16, bf16, q8_0, q4_0, q4_k, q5_k or q6_k");
  args.Flag("vocab-from", "", "GGUF whose tokenizer the model gets (e.g. a vocab-only file)");
  args.Flag("context", "0", "context length (0: the vocab file's, else 4096)");
  args.Flag("seed", "1", "random seed");
  args.Flag("chat-template", "", "chatml, llama2, llama3 or none (default: the vocab file's)");
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
    LogError("the written file does not load: %s", config.status().message());
    return 1;
  }
  LogInfo("wrote %s: %s", out, config->DebugString());
  return 0;
}

}  // namespace
}  // namespace ellm::launch

int main(int argc, char** argv) { return ellm::launch::Main(argc, argv); }
