// Model families end to end through the real processes: qwen2 with
// Qwen2.5-0.5B's head layout and quantised weights, qwen3, and every rope
// scaling (llama3 rope_freqs, YaRN, linear), each made by ellm-make-model and
// giving the reference forward's greedy tokens bit for bit (f32 KV and
// weights) at positions far past the scaled models' original context; chat
// messages render with the ChatML template exactly; and models ellm cannot
// compute faithfully are refused by the launcher.
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/gguf.h"
#include "core/model_config.h"
#include "core/model_maker.h"
#include "core/reference_forward.h"
#include "core/sampler.h"
#include "core/tokenizer.h"
#include "core/weights.h"
#include "gtest/gtest.h"
#include "tests/integration_harness.h"
#include "tests/tests_util.h"

namespace ellm {
namespace {

using namespace ellm::testing;  // NOLINT: the harness

const std::string kQwenVocab = ELLM_MODELS_DIR "/vocab/qwen2.5-vocab-derived.gguf";

const std::string kSpmVocab = ELLM_MODELS_DIR "/vocab/ggml-vocab-llama-spm.gguf";

// Runs ellm-make-model with `flags`, writing `out`.
void RunMakeModel(const std::string& flags, const std::string& out) {
  const std::string cmd = absl::StrCat(ELLM_BINARY_DIR, "/ellm-make-model ", flags, " --out ", out,
                                       " 2>/dev/null");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

// Writes the model with the real tool; returns its path. Every layer
// matrix's rows are whole blocks of each type (512 and 1024 columns), so
// every layer weight is of the named type (a width that is not falls back to
// f16); the 152K-row embedding is f16 (the k-quant search on it takes a
// minute).
std::string MakeModel(const std::string& dir, const std::string& type) {
  const std::string out = absl::StrCat(dir, "/qwen2-", type, ".gguf");
  const std::string cmd = absl::StrCat(
      ELLM_BINARY_DIR, "/ellm-make-model --arch qwen2 --layers 2 --hidden 512 --heads 8 ",
      "--kv-heads 2 --head-dim 64 --ffn 1024 --weight-type ", type, " --embedding-type f16 --vocab-from ", kQwenVocab,
      " --context 512 --seed 5 --chat-template chatml --out ", out, " 2>/dev/null");
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return out;
}

// Greedy tokens of the reference forward and their log-probabilities (as
// the sampler computes them); `edit` may change the config first (to show
// what a scaling changes).
struct RefRun {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top;  // kTop alternatives per token
};
constexpr int kTop = 5;
RefRun ReferenceGreedyWithLogprobs(const std::string& model_path, const std::string& prompt, int n,
                                   const std::function<void(ModelConfig*)>& edit = nullptr) {
  auto file = GgufFile::Open(model_path);
  EXPECT_TRUE(file.ok()) << file.status();
  auto config = ModelConfig::FromGguf(**file);
  EXPECT_TRUE(config.ok()) << config.status();
  if (edit) edit(&*config);
  auto tokenizer = Tokenizer::FromGguf(**file);
  auto weights = LoadWeights(**file, *config);
  EXPECT_TRUE(weights.ok()) << weights.status();
  auto model = ReferenceModel::Create(*std::move(weights), 512);
  RefRun out;
  int pos = 0;
  const std::vector<float>* logits = nullptr;
  const std::vector<int32_t> ids = (*tokenizer)->Encode(prompt, (*tokenizer)->add_bos());
  for (size_t i = 0; i + 1 < ids.size(); ++i) (*model)->Feed(ids[i], pos++);
  logits = &(*model)->Forward(ids.back(), pos++);
  for (int i = 0; i < n; ++i) {
    const SampledToken s =
        Sample(logits->data(), config->vocab_size, SamplingParams{.temperature = 0, .top_logprobs = kTop}, 0);
    out.tokens.push_back(s.token);
    out.logprobs.push_back(s.logprob);
    out.top.emplace_back(s.top, s.top + s.n_top);
    if (i + 1 < n) logits = &(*model)->Forward(s.token, pos++);
  }
  return out;
}

std::vector<int32_t> ReferenceGreedy(const std::string& model_path, const std::string& prompt, int n) {
  auto file = GgufFile::Open(model_path);
  EXPECT_TRUE(file.ok()) << file.status();
  auto config = ModelConfig::FromGguf(**file);
  EXPECT_TRUE(config.ok()) << config.status();
  auto tokenizer = Tokenizer::FromGguf(**file);
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  auto weights = LoadWeights(**file, *config);
  EXPECT_TRUE(weights.ok()) << weights.status();
  auto model = ReferenceModel::Create(*std::move(weights), 256);
  return (*model)->GenerateGreedy((*tokenizer)->Encode(prompt, (*tokenizer)->add_bos()), n);
}

TEST(IntegrationQwen2, QuantisedModelsMatchTheReferenceAndChatRendersChatMl) {
  const std::string dir = testing::MakeTempDir("qwen2");
  for (const std::string type : {"q8_0", "q4_k"}) {
    const std::string model = MakeModel(dir, type);
    const std::string prompt = "The capital of France is";
    const std::vector<int32_t> expected = ReferenceGreedy(model, prompt, 32);
    ASSERT_EQ(expected.size(), 32u);
    EllmSystem system({"--model=" + model, "--attn-workers=2", "--no-numactl", "--kv-dtype=f32",
                       "--cpu-weights=f32"});
    ASSERT_TRUE(system.ready()) << system.Log();
    Generated g = Generate(system.stub(), Greedy(prompt, 32));
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    EXPECT_EQ(g.tokens, expected) << type;

    if (type == "q8_0") {
      // The chat prompt, as Tokenize shows it: exactly ChatML, with the
      // special tokens as single ids.
      ellm::v1::TokenizeRequest req;
      auto* m = req.add_messages();
      m->set_role("system");
      m->set_content("You are terse.");
      m = req.add_messages();
      m->set_role("user");
      m->set_content("Hi! 你好");
      ellm::v1::TokenizeResponse resp;
      grpc::ClientContext ctx;
      ASSERT_TRUE(system.stub()->Tokenize(&ctx, req, &resp).ok());
      std::string text;
      for (const std::string& piece : resp.pieces()) text += piece;
      // Control tokens show as themselves; their ids are where ChatML puts them.
      EXPECT_EQ(resp.token_ids(0), 151644);  // <|im_start|>
      int im_start = 0, im_end = 0;
      for (int id : resp.token_ids()) {
        im_start += id == 151644;
        im_end += id == 151645;
      }
      EXPECT_EQ(im_start, 3);
      EXPECT_EQ(im_end, 2);
      EXPECT_EQ(text,
                "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi! 你好<|im_end|>\n"
                "<|im_start|>assistant\n");

      ellm::v1::GenerateRequest chat;
      *chat.mutable_messages() = req.messages();
      chat.set_max_tokens(8);
      chat.mutable_sampling()->set_temperature(0);
      Generated c = Generate(system.stub(), chat);
      ASSERT_TRUE(c.status.ok()) << c.status.error_message();
      EXPECT_EQ(c.finish.prompt_tokens(), resp.token_ids_size());
      // A prompt and messages together are refused.
      chat.set_prompt("x");
      EXPECT_EQ(Generate(system.stub(), chat).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    }
    ExpectCleanShutdown(system);
  }
  std::filesystem::remove_all(dir);
}

// Every rope layout: ellm's greedy tokens equal the reference forward's,
// whose own frequencies test_rope checks against independent definitions.
// The prompt and answer run to about 4x each scaled model's original
// context, and the reference without the scaling answers differently, so a
// process that ignored the scaling would fail here.
TEST(IntegrationModels, EveryRopeLayoutMatchesTheReference) {
  const std::string dir = testing::MakeTempDir("rope");
  struct Layout {
    std::string name, flags;
  };
  const std::string llama = absl::StrCat("--arch llama --layers 2 --hidden 128 --heads 4 --kv-heads 2 ",
                                         "--head-dim 32 --ffn 256 --context 512 --seed 3 --vocab-from ",
                                         kSpmVocab);
  const std::string qwen = absl::StrCat("--layers 2 --hidden 128 --heads 4 --kv-heads 2 --head-dim 64 ",
                                        "--ffn 256 --context 512 --seed 4 --vocab-from ", kQwenVocab);
  const Layout layouts[] = {
      {"llama3", llama + " --rope-base 500000 --rope-scaling llama3 --rope-factor 8 --rope-original-context 32"},
      {"linear", llama + " --rope-scaling linear --rope-factor 4"},
      {"qwen2-yarn", "--arch qwen2 " + qwen + " --rope-scaling yarn --rope-factor 4 --rope-original-context 32"},
      {"qwen3", "--arch qwen3 " + qwen + " --chat-template qwen3"},
      {"qwen3-yarn", "--arch qwen3 " + qwen +
                         " --rope-scaling yarn --rope-factor 4 --rope-original-context 32 --rope-attn-factor 0.9"},
  };
  std::string prompt;
  for (int i = 0; i < 12; ++i) prompt += "Once upon a time, in a land far away, ";
  for (const Layout& layout : layouts) {
    SCOPED_TRACE(layout.name);
    const std::string model = absl::StrCat(dir, "/", layout.name, ".gguf");
    RunMakeModel(layout.flags, model);
    const RefRun expected = ReferenceGreedyWithLogprobs(model, prompt, 24);
    ASSERT_EQ(expected.tokens.size(), 24u);
    if (layout.name != "qwen3") {
      const RefRun unscaled = ReferenceGreedyWithLogprobs(model, prompt, 24, [](ModelConfig* c) {
        c->rope_scaling = RopeScaling();
        c->rope_freq_factors.clear();
      });
      EXPECT_NE(unscaled.logprobs, expected.logprobs) << "the scaling should change the answer";
    }
    EllmSystem system({"--model=" + model, "--attn-workers=2", "--no-numactl", "--kv-dtype=f32",
                       "--cpu-weights=f32"});
    ASSERT_TRUE(system.ready()) << system.Log();
    ellm::v1::GenerateRequest req = Greedy(prompt, 24);
    req.set_top_logprobs(kTop);
    Generated g = Generate(system.stub(), req);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    EXPECT_GT(g.finish.prompt_tokens(), 100);
    EXPECT_EQ(g.tokens, expected.tokens);
    EXPECT_EQ(g.logprobs, expected.logprobs);  // bit for bit
    // And the alternatives, from the same logits.
    ASSERT_EQ(g.top_logprobs.size(), expected.top.size());
    for (size_t i = 0; i < expected.top.size(); ++i) {
      ASSERT_EQ(g.top_logprobs[i].token_ids_size(), kTop) << i;
      for (int j = 0; j < kTop; ++j) {
        EXPECT_EQ(g.top_logprobs[i].token_ids(j), expected.top[i][j].token) << i << "," << j;
        EXPECT_EQ(g.top_logprobs[i].logprobs(j), expected.top[i][j].logprob) << i << "," << j;
      }
    }
    ExpectCleanShutdown(system);
  }
  std::filesystem::remove_all(dir);
}

// A model whose file asks for what ellm does not compute never serves: the
// launcher exits with an error naming it, and leaves nothing behind.
TEST(IntegrationModels, LauncherRefusesModelsItCannotComputeFaithfully) {
  const std::string dir = testing::MakeTempDir("refused");
  MakeModelOptions o;
  o.layers = 1;
  o.hidden = 64;
  o.heads = 4;
  o.kv_heads = 2;
  o.head_dim = 16;
  o.ffn = 128;
  o.vocab_from = kSpmVocab;
  o.context = 256;
  struct Case {
    std::string name;
    std::function<void(GgufWriter*)> edit;
    std::string needle;
  };
  const Case cases[] = {
      {"sliding-window", [](GgufWriter* w) { w->SetUint32("llama.attention.sliding_window", 128); },
       "'llama.attention.sliding_window' asks for a sliding attention window"},
      {"softcap", [](GgufWriter* w) { w->SetFloat32("llama.final_logit_softcapping", 30); },
       "final logit soft-capping"},
      {"longrope", [](GgufWriter* w) { w->SetString("llama.rope.scaling.type", "longrope"); },
       "LongRoPE"},
      {"extra-tensor",
       [](GgufWriter* w) {
         ASSERT_TRUE(w->AddTensor("blk.0.attn_output.bias", {64}, DType::kF32, std::string(256, '\0')).ok());
       },
       "tensor 'blk.0.attn_output.bias'"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<GgufWriter> w = MakeRandomModel(o);
    ASSERT_TRUE(w.ok()) << w.status();
    c.edit(&*w);
    const std::string path = absl::StrCat(dir, "/", c.name, ".gguf");
    ASSERT_TRUE(w->WriteFile(path).ok());
    EllmSystem system({"--model=" + path, "--no-numactl"});
    EXPECT_FALSE(system.ready()) << c.name;
    const int status = system.WaitExit();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << c.name;
    EXPECT_NE(system.Log().find(c.needle), std::string::npos) << c.name << "\n" << system.Log();
    EXPECT_TRUE(ChildrenOf(system.pid()).empty());
    EXPECT_TRUE(LeftoverSegments(system.pid()).empty());
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ellm
