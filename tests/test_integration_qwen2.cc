// qwen2 end to end: a model made by ellm-make-model with Qwen2.5-0.5B's head
// layout (14 query / 2 KV heads of 64) and quantised weights runs through the
// real processes and gives the reference forward's greedy tokens; chat
// messages render with the ChatML template exactly.
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/gguf.h"
#include "core/model_config.h"
#include "core/reference_forward.h"
#include "core/tokenizer.h"
#include "core/weights.h"
#include "gtest/gtest.h"
#include "tests/integration_harness.h"
#include "tests/tests_util.h"

namespace ellm {
namespace {

using namespace ellm::testing;  // NOLINT: the harness

const std::string kQwenVocab = ELLM_MODELS_DIR "/vocab/qwen2.5-vocab-derived.gguf";

// Writes the model with the real tool; returns its path.
std::string MakeModel(const std::string& dir, const std::string& type) {
  const std::string out = absl::StrCat(dir, "/qwen2-", type, ".gguf");
  const std::string cmd = absl::StrCat(
      ELLM_BINARY_DIR, "/ellm-make-model --arch qwen2 --layers 2 --hidden 896 --heads 14 ",
      "--kv-heads 2 --head-dim 64 --ffn 1024 --weight-type ", type, " --vocab-from ", kQwenVocab,
      " --context 512 --seed 5 --chat-template chatml --out ", out, " 2>/dev/null");
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return out;
}

std::vector<int32_t> ReferenceGreedy(const std::string& model_path, const std::string& prompt, int n) {
  auto file = GgufFile::Open(model_path);
  EXPECT_TRUE(file.ok()) << file.status();
  auto config = ModelConfig::FromGguf(**file);
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

}  // namespace
}  // namespace ellm
