// coordinator/openai_api.h without a server: what ParseOpenAiRequest keeps
// of a body, and its messages for out-of-range numbers.
#include "coordinator/openai_api.h"

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace ellm::coord {
namespace {

// ASan holds freed memory in its quarantine (256 MiB by default): there the
// resident peak says nothing about what the parser keeps.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAsan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAsan = true;
#else
constexpr bool kAsan = false;
#endif
#else
constexpr bool kAsan = false;
#endif

// This process's peak resident memory in bytes since the last ResetPeak.
int64_t PeakResident() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) << 10;
  }
  return -1;
}
bool ResetPeak() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.close();
  return clear.good();
}

// A body of millions of tiny values in a field the parser does not read:
// they are dropped as they are parsed, not built into nodes (about 100
// bytes each) and thrown away after.
TEST(OpenAiApi, IgnoredFieldsAreNotKept) {
  std::string body = R"({"prompt": "Once upon a time", "max_tokens": 3, "user": [)";
  while (body.size() < (size_t{8} << 20)) body += "[],{},[[]],";
  body += R"(0], "logit_bias": {}})";
  if (!ResetPeak()) GTEST_SKIP() << "/proc/self/clear_refs cannot be written here";
  const int64_t before = PeakResident();
  absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(body, /*chat=*/false, "m");
  const int64_t grew = PeakResident() - before;
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->generate.prompt(), "Once upon a time");
  EXPECT_EQ(r->generate.max_tokens(), 3);
  if (!kAsan) {
    EXPECT_LT(grew, int64_t{32} << 20) << "parsing an 8 MiB body grew the resident peak by " << (grew >> 20)
                                        << " MiB";
  }
  // Fields it reads or refuses are still seen: a refused one in the same body.
  body.replace(body.rfind("{}"), 2, R"({"50": 100})");
  r = ParseOpenAiRequest(body, false, "m");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("logit_bias"), std::string::npos) << r.status();
}

// A long list of objects is read in one pass: 200,000 chat messages. (With
// nlohmann's parser callback instead, every object's end scanned its parent
// list: minutes here.)
TEST(OpenAiApi, ALongListOfMessagesIsReadWhole) {
  std::string body = R"({"user": [{}, {}], "messages": [)";
  for (int i = 0; i < 200000; ++i) absl::StrAppend(&body, R"({"role": "user", "content": ")", i, R"("},)");
  body += R"({"role": "user", "content": "last"}]})";
  absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(body, /*chat=*/true, "m");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->generate.messages_size(), 200001);
  EXPECT_EQ(r->generate.messages(12345).content(), "12345");
  EXPECT_EQ(r->generate.messages(200000).content(), "last");
}

// Numbers out of range name the range they must be in; two fields for one
// setting must agree.
TEST(OpenAiApi, OutOfRangeNumbersNameTheirRange) {
  auto message = [](const std::string& body) {
    return std::string(ParseOpenAiRequest(body, false, "m").status().message());
  };
  EXPECT_NE(message(R"({"prompt":"x","max_tokens":2147483648})").find("at most 2147483647"), std::string::npos);
  EXPECT_NE(message(R"({"prompt":"x","max_tokens":0})").find("positive"), std::string::npos);
  EXPECT_NE(message(R"({"prompt":"x","top_p":0})").find("(0, 1]"), std::string::npos);
  EXPECT_NE(message(R"({"prompt":"x","top_p":1.5})").find("(0, 1]"), std::string::npos);
  EXPECT_NE(message(R"({"prompt":"x","temperature":-1})").find("[0, 100]"), std::string::npos);
  EXPECT_TRUE(ParseOpenAiRequest(R"({"prompt":"x","top_p":1,"max_tokens":2147483647})", false, "m").ok());
  // max_tokens and its newer name: both may come, if they agree.
  EXPECT_NE(message(R"({"prompt":"x","max_tokens":5,"max_completion_tokens":7})").find("max_completion_tokens"),
            std::string::npos);
  absl::StatusOr<OpenAiRequest> both =
      ParseOpenAiRequest(R"({"prompt":"x","max_tokens":5,"max_completion_tokens":5})", false, "m");
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->generate.max_tokens(), 5);
}

}  // namespace
}  // namespace ellm::coord
