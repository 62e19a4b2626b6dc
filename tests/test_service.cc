// coordinator/service.h without a server or workers: what EllmService does
// to a request before the scheduler sees it, on stories260K's tokenizer.
#include "coordinator/service.h"

#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/gguf.h"
#include "core/model_config.h"
#include "core/tokenizer.h"
#include "gtest/gtest.h"

namespace ellm::coord {
namespace {

struct Stories {
  std::unique_ptr<GgufFile> file = *GgufFile::Open(std::string(ELLM_MODELS_DIR) + "/stories260K.gguf");
  ModelConfig config = *ModelConfig::FromGguf(*file);
  std::unique_ptr<Tokenizer> tokenizer = *Tokenizer::FromGguf(*file);
};

// Words drawn at random: a text the tokenizer cannot cut the same way twice.
std::string RandomText(size_t bytes, uint32_t seed) {
  static const char* const kWords[] = {"Once", "upon", "a", "time", "there", "was", "little", "girl",
                                       "named", "Lily.", "She", "liked", "to", "play", "outside,"};
  std::mt19937 rng(seed);
  std::string text;
  while (text.size() < bytes) {
    absl::StrAppend(&text, kWords[rng() % std::size(kWords)], " ");
  }
  return text;
}

// Every front validates on its own thread (gRPC: one per call; HTTP: its
// preparing pool), so six 1 MiB prompts at once would be six tokenizations
// at once. The service lets two run, and each still gets its own text's ids.
TEST(Service, LargeTextsAreTokenizedAtMostTwoAtATime) {
  Stories m;
  ServiceOptions options;
  EllmService service(options, m.config, *m.tokenizer, nullptr);
  constexpr int kRequests = 6;
  std::vector<std::string> texts;
  std::vector<size_t> expected;
  for (int i = 0; i < kRequests; ++i) {
    texts.push_back(RandomText(EllmService::kLargeText * 4, i));
    expected.push_back(m.tokenizer->Encode(texts.back(), m.tokenizer->add_bos()).size());
  }
  std::vector<std::string> errors(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      ellm::v1::GenerateRequest request;
      request.set_prompt(texts[i]);
      // Far over stories' 2048-token context: refused after tokenizing, with the count.
      errors[i] = std::string(service.Validate(request).status().message());
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kRequests; ++i) {
    EXPECT_NE(errors[i].find(absl::StrCat("prompt is ", expected[i], " tokens")), std::string::npos)
        << "request " << i << ": " << errors[i];
  }
  EXPECT_GE(service.large_texts_peak(), 1) << "the large texts did not pass the limit";
  EXPECT_LE(service.large_texts_peak(), EllmService::kLargeTextsAtOnce);

  // Texts under the size are not counted (they never wait).
  EllmService fresh(options, m.config, *m.tokenizer, nullptr);
  ellm::v1::GenerateRequest small;
  small.set_prompt(RandomText(EllmService::kLargeText / 2, 99));
  EXPECT_FALSE(fresh.Validate(small).ok());
  EXPECT_EQ(fresh.large_texts_peak(), 0);
}

// A penalised sequence's token counts travel with its steps, sized for
// kMaxPenaltyTokens distinct tokens: a request with penalties and more
// max_tokens (and a vocabulary larger than that) is refused, naming why.
TEST(Service, PenaltiesBoundMaxTokens) {
  Stories m;
  ModelConfig big = m.config;  // a long context and a large vocabulary
  big.context_length = 4 * kMaxPenaltyTokens;
  big.vocab_size = 4 * kMaxPenaltyTokens;
  ServiceOptions options;
  EllmService service(options, big, *m.tokenizer, nullptr);
  ellm::v1::GenerateRequest request;
  request.set_prompt("Once upon a time");
  request.set_max_tokens(kMaxPenaltyTokens + 1);
  EXPECT_TRUE(service.Validate(request).ok()) << "no penalties: no bound";
  request.mutable_sampling()->set_frequency_penalty(0.5f);
  const absl::Status refused = service.Validate(request).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find(absl::StrCat("max_tokens may be at most ", kMaxPenaltyTokens)), std::string::npos)
      << refused;
  request.set_max_tokens(kMaxPenaltyTokens);
  absl::StatusOr<GenerateOptions> ok = service.Validate(request);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->sampling.frequency_penalty, 0.5f);
  request.mutable_sampling()->set_presence_penalty(-2.5f);
  EXPECT_NE(service.Validate(request).status().message().find("presence_penalty must be in [-2, 2]"),
            std::string::npos);
}

}  // namespace
}  // namespace ellm::coord
