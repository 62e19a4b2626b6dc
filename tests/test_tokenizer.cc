#include "core/tokenizer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/gguf.h"
#include "core/topology.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tokenizer_vectors.h"

namespace ellm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const std::string kModels = ELLM_MODELS_DIR;
const std::string kVocabDir = kModels + "/vocab/";

using namespace ellm::tokenizer_testing;  // NOLINT: shared test helpers

class VocabVectorsTest : public ::testing::TestWithParam<const char*> {};

TEST_P(VocabVectorsTest, EncodesEveryCaseLikeLlamaCpp) {
  const std::string path = kVocabDir + GetParam();
  std::unique_ptr<Tokenizer> tok = LoadTokenizer(path);
  ASSERT_NE(tok, nullptr);
  ExpectEncodesLikeLlamaCpp(*tok, LoadVocabCases(path));
}

TEST_P(VocabVectorsTest, DecodeInvertsEncode) {
  const std::string path = kVocabDir + GetParam();
  std::unique_ptr<Tokenizer> tok = LoadTokenizer(path);
  ASSERT_NE(tok, nullptr);
  for (const VocabCase& c : LoadVocabCases(path)) {
    SCOPED_TRACE(Escape(c.text));
    // The space prefix the encoder adds is dropped again after the start or BOS.
    EXPECT_EQ(tok->Decode(tok->Encode(c.text, false)), c.text);
    std::vector<int32_t> with_bos = tok->Encode(c.text, true);
    ASSERT_FALSE(with_bos.empty());
    EXPECT_EQ(with_bos[0], tok->bos_id());
    EXPECT_EQ(tok->Decode(with_bos), c.text);
  }
}

TEST_P(VocabVectorsTest, StreamDecoderEmitsOnlyWholeUtf8) {
  const std::string path = kVocabDir + GetParam();
  std::unique_ptr<Tokenizer> tok = LoadTokenizer(path);
  ASSERT_NE(tok, nullptr);
  ExpectStreamDecodesWholeUtf8(*tok, LoadVocabCases(path));
}

INSTANTIATE_TEST_SUITE_P(Spm, VocabVectorsTest,
                         ::testing::Values("ggml-vocab-llama-spm.gguf", "ggml-vocab-phi-3.gguf"),
                         [](const auto& info) {
                           return std::string(info.param).find("phi") != std::string::npos
                                      ? "Phi3"
                                      : "LlamaSpm";
                         });

class LlamaSpmTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tok_ = LoadTokenizer(kVocabDir + "ggml-vocab-llama-spm.gguf").release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(tok_, nullptr); }
  static Tokenizer* tok_;
};
Tokenizer* LlamaSpmTest::tok_ = nullptr;

TEST_F(LlamaSpmTest, Metadata) {
  EXPECT_EQ(tok_->vocab_size(), 32000);
  EXPECT_EQ(tok_->bos_id(), 1);
  EXPECT_EQ(tok_->eos_id(), 2);
  EXPECT_TRUE(tok_->add_bos());
  EXPECT_EQ(tok_->token(15043), "\xE2\x96\x81Hello");
  EXPECT_EQ(tok_->token_type(0), TokenType::kUnknown);
  EXPECT_EQ(tok_->token_type(1), TokenType::kControl);
  EXPECT_EQ(tok_->token_type(3), TokenType::kByte);
  EXPECT_TRUE(tok_->IsEndOfGeneration(2));
  EXPECT_FALSE(tok_->IsEndOfGeneration(1));
  EXPECT_FALSE(tok_->IsEndOfGeneration(-1));
}

TEST_F(LlamaSpmTest, EmptyText) {
  EXPECT_TRUE(tok_->Encode("", false).empty());
  EXPECT_THAT(tok_->Encode("", true), ElementsAre(1));
  EXPECT_EQ(tok_->Decode({}), "");
}

TEST_F(LlamaSpmTest, BosAndLeadingSpace) {
  EXPECT_THAT(tok_->Encode("Hello world", true), ElementsAre(1, 15043, 3186));
  EXPECT_EQ(tok_->Decode({1, 15043, 3186}), "Hello world");
  // Only the first piece loses its space.
  EXPECT_EQ(tok_->TokenBytes(-1, 15043), "Hello");
  EXPECT_EQ(tok_->TokenBytes(1, 15043), "Hello");
  EXPECT_EQ(tok_->TokenBytes(15043, 15043), " Hello");
  EXPECT_EQ(tok_->Decode({15043, 15043}), "Hello Hello");
}

TEST_F(LlamaSpmTest, SpecialTokensInTextAreNotParsed) {
  const std::vector<int32_t> ids = tok_->Encode("<s>hi</s>", false);
  for (int32_t id : ids) {
    EXPECT_NE(id, 1);
    EXPECT_NE(id, 2);
  }
  EXPECT_EQ(tok_->Decode(ids), "<s>hi</s>");
}

TEST_F(LlamaSpmTest, ParseSpecialEmitsControlTokens) {
  const std::vector<int32_t> ids = tok_->Encode("<s>hi</s>", false, /*parse_special=*/true);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 1);
  EXPECT_EQ(ids.back(), 2);
  // The text after a special token gets the space prefix, as at the start.
  EXPECT_EQ(std::vector<int32_t>(ids.begin() + 1, ids.end() - 1), tok_->Encode("hi", false));
  EXPECT_EQ(tok_->Decode(ids), "hi");
  // The two-argument form does not parse them: no control ids, the text comes back.
  const std::vector<int32_t> plain = tok_->Encode("<s>hi</s>", false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 1), 0);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 2), 0);
  EXPECT_EQ(tok_->Decode(plain), "<s>hi</s>");
}

TEST_F(LlamaSpmTest, TokenBytesByType) {
  EXPECT_EQ(tok_->TokenBytes(5, 1), "");           // control <s>
  EXPECT_EQ(tok_->TokenBytes(5, 2), "");           // control </s>
  EXPECT_EQ(tok_->TokenBytes(5, 0), "<unk>");      // unknown: its text
  EXPECT_EQ(tok_->TokenBytes(5, 3 + 0x41), "A");   // <0x41>
  EXPECT_EQ(tok_->TokenBytes(5, 3 + 0xF0), "\xF0");
  EXPECT_EQ(tok_->TokenBytes(5, 29871), " ");      // "▁"
  EXPECT_EQ(tok_->TokenBytes(5, -1), "");
  EXPECT_EQ(tok_->TokenBytes(5, 32000), "");
}

TEST_F(LlamaSpmTest, ByteFallbackForCharactersOutsideTheVocab) {
  // U+1F999 (🦙, F0 9F A6 99) has no token: four byte tokens <0xXX> = 3 + byte.
  EXPECT_THAT(tok_->Encode("\xF0\x9F\xA6\x99", false),
              ElementsAre(29871, 3 + 0xF0, 3 + 0x9F, 3 + 0xA6, 3 + 0x99));
  // Invalid UTF-8 survives the round trip byte for byte.
  const std::string invalid = "a\xFF\xC3(b\x80";
  const std::vector<int32_t> ids = tok_->Encode(invalid, false);
  EXPECT_EQ(tok_->Decode(ids), invalid);
}

TEST_F(LlamaSpmTest, StreamDecoderHoldsBackSplitEmoji) {
  StreamDecoder stream(*tok_);
  EXPECT_EQ(stream.Push(15043), "Hello");
  EXPECT_EQ(stream.Push(29871), " ");
  EXPECT_EQ(stream.Push(3 + 0xF0), "");
  EXPECT_EQ(stream.Push(3 + 0x9F), "");
  EXPECT_EQ(stream.Push(3 + 0xA6), "");
  EXPECT_EQ(stream.Push(3 + 0x99), "\xF0\x9F\xA6\x99");
  EXPECT_EQ(stream.Push(3 + 'x'), "x");
  EXPECT_EQ(stream.Finish(), "");
}

TEST_F(LlamaSpmTest, StreamDecoderAfterAPromptKeepsTheAnswersLeadingSpace) {
  // "Lily wanted to" + " go on": the answer's first piece "▁go" is a
  // continuation, so its space stays; at a sequence's start it is dropped.
  const std::vector<int32_t> prompt = tok_->Encode("Lily wanted to", true);
  const std::vector<int32_t> answer = tok_->Encode("go on", false);  // "▁go▁on"
  ASSERT_EQ(tok_->token(answer[0]).rfind("\xE2\x96\x81", 0), 0u) << "a piece with the space prefix";
  StreamDecoder after(*tok_, prompt.back());
  std::string text;
  for (int32_t id : answer) text += after.Push(id);
  EXPECT_EQ(text, " go on");
  StreamDecoder fresh(*tok_);
  text.clear();
  for (int32_t id : answer) text += fresh.Push(id);
  EXPECT_EQ(text, "go on");
}

TEST_F(LlamaSpmTest, StreamDecoderFinishFlushesIncompleteAsReplacement) {
  StreamDecoder stream(*tok_);
  EXPECT_EQ(stream.Push(3 + 0xF0), "");
  EXPECT_EQ(stream.Push(3 + 0x9F), "");
  EXPECT_EQ(stream.Finish(), "\xEF\xBF\xBD");
  // After Finish the decoder starts over (first piece drops its space).
  EXPECT_EQ(stream.Push(15043), "Hello");
  EXPECT_EQ(stream.Finish(), "");
}

// `earlier`: how many of the code points a token flushes are the earlier
// tokens' (a held lead byte its own byte shows invalid), so that its own
// text starts after them (logprobs' text_offset).
TEST_F(LlamaSpmTest, StreamDecoderReplacesInvalidBytes) {
  StreamDecoder stream(*tok_);
  int earlier = -1;
  EXPECT_EQ(stream.Push(3 + 0xFF, &earlier), "\xEF\xBF\xBD");  // never valid
  EXPECT_EQ(earlier, 0);
  EXPECT_EQ(stream.Push(3 + 0xE2, &earlier), "");  // lead of 3
  EXPECT_EQ(earlier, 0);
  EXPECT_EQ(stream.Push(3 + 'A', &earlier), "\xEF\xBF\xBD" "A");  // broken by an ASCII byte
  EXPECT_EQ(earlier, 1);
  EXPECT_EQ(stream.Push(3 + 0x80, &earlier), "\xEF\xBF\xBD");  // stray continuation
  EXPECT_EQ(earlier, 0);
  EXPECT_EQ(stream.Push(3 + 0xED), "");
  EXPECT_EQ(stream.Push(3 + 0xA0, &earlier), "\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate: 2 ill-formed
  EXPECT_EQ(earlier, 1);
  EXPECT_EQ(stream.Push(3 + 0xE2), "");
  EXPECT_EQ(stream.Push(3 + 0x82), "");
  EXPECT_EQ(stream.Push(15043, &earlier), "\xEF\xBF\xBD Hello");  // 2 held bytes, one U+FFFD
  EXPECT_EQ(earlier, 1);
  EXPECT_EQ(stream.Push(3 + 0xE2), "");
  EXPECT_EQ(stream.Push(3 + 0x82), "");
  EXPECT_EQ(stream.Push(3 + 0xAC, &earlier), "\xE2\x82\xAC");  // completes a held character: it starts there
  EXPECT_EQ(earlier, 0);
  EXPECT_EQ(stream.Finish(), "");
}

TEST_F(LlamaSpmTest, LongPromptTokenizesInMilliseconds) {
  const std::vector<VocabCase> cases = LoadVocabCases(kVocabDir + "ggml-vocab-llama-spm.gguf");
  ASSERT_FALSE(cases.empty());
  std::string prompt;
  while (prompt.size() < 10 * 1024) {
    for (const VocabCase& c : cases) prompt += c.text + " ";
  }
  // Worst cases for pair merging: one long run of a character.
  const std::string spaces(10 * 1024, ' ');
  const std::string digits(10 * 1024, '3');
  for (const std::string* text : std::vector<const std::string*>{&prompt, &spaces, &digits}) {
    const auto start = std::chrono::steady_clock::now();
    const std::vector<int32_t> ids = tok_->Encode(*text, true);
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - start)
                          .count();
    std::printf("%zu bytes -> %zu tokens in %.2f ms\n", text->size(), ids.size(), ms);
    EXPECT_LT(ms, 250.0);  // milliseconds in practice; generous for loaded CI
    EXPECT_EQ(tok_->Decode(ids), *text);
  }
}

// A line of /proc/self/status in kB (VmRSS, VmHWM), -1 if absent.
long StatusKb(const std::string& key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key + ":", 0) == 0) return std::strtol(line.c_str() + key.size() + 1, nullptr, 10);
  }
  return -1;
}

// Benchmark, not a check: encode time and peak memory of long documents
// (the llama vocabulary's test texts repeated), on the llama SPM and the
// Qwen2.5 BPE vocabularies. ELLM_BENCH_TOKENIZER_KB sets the sizes (default
// 80,4096,8192: 8 MiB is the HTTP API's largest body). peak_extra_mb: the
// process's peak resident memory during the encode (reset before it) over
// its resident memory before.
TEST(TokenizerBench, DISABLED_BenchLongDocuments) {
  const std::vector<VocabCase> cases = LoadVocabCases(kVocabDir + "ggml-vocab-llama-spm.gguf");
  ASSERT_FALSE(cases.empty());
  for (const char* vocab : {"ggml-vocab-llama-spm.gguf", "qwen2.5-vocab-derived.gguf"}) {
    std::unique_ptr<Tokenizer> tok = LoadTokenizer(kVocabDir + vocab);
    ASSERT_NE(tok, nullptr) << vocab;
    const char* env = std::getenv("ELLM_BENCH_TOKENIZER_KB");
    for (absl::string_view kb : absl::StrSplit(env != nullptr ? env : "80,4096,8192", ',')) {
      size_t bytes = 0;
      ASSERT_TRUE(absl::SimpleAtoi(kb, &bytes)) << kb;
      bytes *= 1024;
      std::string text;
      while (text.size() < bytes) {
        for (const VocabCase& c : cases) text += c.text + " ";
      }
      const long rss_before = StatusKb("VmRSS");
      std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM := VmRSS
      const auto start = std::chrono::steady_clock::now();
      const std::vector<int32_t> ids = tok->Encode(text, true);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      std::printf("tokenizer %s: %zu bytes -> %zu tokens in %.1f ms, peak_extra_mb=%.0f cpu=\"%s\"\n", vocab,
                  text.size(), ids.size(), ms, (StatusKb("VmHWM") - rss_before) / 1024.0, CpuModelName().c_str());
    }
  }
}

TEST(TokenizerTest, Phi3EndOfTurnAndUserDefinedTokens) {
  std::unique_ptr<Tokenizer> tok = LoadTokenizer(kVocabDir + "ggml-vocab-phi-3.gguf");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 32064);
  EXPECT_EQ(tok->eos_id(), 32000);
  EXPECT_TRUE(tok->IsEndOfGeneration(32000));  // <|endoftext|>
  EXPECT_TRUE(tok->IsEndOfGeneration(32007));  // <|end|>
  EXPECT_FALSE(tok->IsEndOfGeneration(2));
  // '</s>' is a user-defined token in this vocab: matched whole in text, as
  // llama.cpp and HF do, and decoded as its text.
  ASSERT_EQ(tok->token_type(2), TokenType::kUserDefined);
  const std::vector<int32_t> ids = tok->Encode("a</s>b", false);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 2), 1);
  EXPECT_EQ(ids.size(), 3u);
  EXPECT_EQ(tok->Decode(ids), "a</s> b");
  // Control tokens written in the text stay plain text.
  const std::vector<int32_t> end = tok->Encode("<|end|>", false);
  EXPECT_EQ(std::count(end.begin(), end.end(), 32007), 0);
}

TEST(TokenizerTest, Stories260K) {
  std::unique_ptr<Tokenizer> tok = LoadTokenizer(kModels + "/stories260K.gguf");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 512);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_TRUE(tok->add_bos());  // no key in the file: the SPM default
  const std::vector<int32_t> ids = tok->Encode("Once upon a time", true);
  EXPECT_THAT(ids, ElementsAre(1, 403, 407, 261, 378));
  EXPECT_EQ(tok->Decode(ids), "Once upon a time");
  EXPECT_TRUE(tok->IsEndOfGeneration(2));
}

TEST(TokenizerTest, RejectsUnsupportedModelByName) {
  // WordPiece (BERT) is not supported; byte-level BPE is (test_tokenizer_bpe).
  absl::StatusOr<std::unique_ptr<GgufFile>> file =
      GgufFile::Open(kVocabDir + "ggml-vocab-bert-bge.gguf");
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromGguf(**file);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("'bert'"));
  EXPECT_THAT(tok.status().message(), HasSubstr("not supported"));
}

// A tiny SPM vocabulary built in the test. Ids:
//   0 <unk>  1 <s>  2 </s>  3 ▁  4 a  5 b  6 aa  7 ab  8 ▁a  9 <0x63> ('c')
// No token for 'd' (neither <0x64> nor "d"): it falls back to <unk>.
struct TinyVocabOptions {
  bool add_space_prefix = true;
  bool write_tokens = true;
  size_t scores = 10;  // how many scores to write
  uint32_t bos = 1;
  std::string model = "llama";
  std::string extra_token;  // a normal token after id 9 (scored highest), if not empty
};

absl::StatusOr<std::unique_ptr<Tokenizer>> TinyTokenizer(const TinyVocabOptions& o) {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetString("tokenizer.ggml.model", o.model);
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>", "\xE2\x96\x81", "a", "b",
                                     "aa", "ab", "\xE2\x96\x81" "a", "<0x63>"};
  // "aa" outranks "ab" outranks "▁a".
  std::vector<float> scores = {0, 0, 0, -5, -6, -6, -1, -2, -3, 0};
  std::vector<int32_t> types = {2, 3, 3, 1, 1, 1, 1, 1, 1, 6};
  if (!o.extra_token.empty()) {
    tokens.push_back(o.extra_token);
    scores.push_back(0);
    types.push_back(1);
  }
  if (o.write_tokens) w.SetStringArray("tokenizer.ggml.tokens", tokens);
  scores.resize(o.scores + (o.extra_token.empty() ? 0 : 1));
  w.SetFloat32Array("tokenizer.ggml.scores", scores);
  w.SetInt32Array("tokenizer.ggml.token_type", types);
  w.SetUint32("tokenizer.ggml.bos_token_id", o.bos);
  w.SetUint32("tokenizer.ggml.eos_token_id", 2);
  w.SetUint32("tokenizer.ggml.unknown_token_id", 0);
  w.SetUint32("tokenizer.ggml.padding_token_id", 4294967295u);
  w.SetBool("tokenizer.ggml.add_space_prefix", o.add_space_prefix);
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(w.ToBytes());
  if (!file.ok()) return file.status();
  return Tokenizer::FromGguf(**file);
}

TEST(TinyVocabTest, HighestScoreMergesFirst) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyTokenizer({});
  ASSERT_TRUE(tok.ok()) << tok.status();
  // ▁ a b: "ab" (-2) beats "▁a" (-3), and "▁ab" is no token.
  EXPECT_THAT((*tok)->Encode("ab", false), ElementsAre(3, 7));
  // ▁ a: only "▁a".
  EXPECT_THAT((*tok)->Encode("a", false), ElementsAre(8));
}

TEST(TinyVocabTest, EqualScoresMergeLeftmostFirst) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyTokenizer({});
  ASSERT_TRUE(tok.ok()) << tok.status();
  // ▁ a a a: both "aa" pairs score -1; the left one wins, then "▁a" is stale.
  EXPECT_THAT((*tok)->Encode("aaa", false), ElementsAre(3, 6, 4));
  EXPECT_THAT((*tok)->Encode("aaaa", false), ElementsAre(3, 6, 6));
}

// Words are encoded one by one only where no token spans a word start: with
// "b▁a" in the vocabulary, "b a" must still merge across the space.
TEST(TinyVocabTest, MergesAcrossWordsWhereATokenSpansThem) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> plain = TinyTokenizer({});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_THAT((*plain)->Encode("b a", false), ElementsAre(3, 5, 8));  // ▁ b ▁a
  TinyVocabOptions o;
  o.extra_token = "b\xE2\x96\x81" "a";
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyTokenizer(o);
  ASSERT_TRUE(tok.ok()) << tok.status();
  // ▁a (-3) first, then b + ▁a = "b▁a" (id 10).
  EXPECT_THAT((*tok)->Encode("b a", false), ElementsAre(3, 10));
  EXPECT_THAT((*tok)->Encode("ab b a b", false), ElementsAre(3, 7, 3, 10, 3, 5));
}

TEST(TinyVocabTest, ByteFallbackThenUnknown) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyTokenizer({});
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT((*tok)->Encode("c", false), ElementsAre(3, 9));
  EXPECT_THAT((*tok)->Encode("d", false), ElementsAre(3, 0));
  EXPECT_THAT((*tok)->Encode("a b", true), ElementsAre(1, 8, 3, 5));
  EXPECT_EQ((*tok)->Decode({1, 8, 3, 5, 9, 0}), "a bc<unk>");
}

TEST(TinyVocabTest, NoSpacePrefix) {
  TinyVocabOptions o;
  o.add_space_prefix = false;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyTokenizer(o);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT((*tok)->Encode("ab", false), ElementsAre(7));
  EXPECT_THAT((*tok)->Encode(" a", false), ElementsAre(8));
  // Nothing was added, so nothing is dropped.
  EXPECT_EQ((*tok)->Decode({8}), " a");
}

TEST(TinyVocabTest, UnsetBosId) {
  TinyVocabOptions o;
  o.bos = 4294967295u;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyTokenizer(o);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->bos_id(), -1);
  EXPECT_THAT((*tok)->Encode("a", true), ElementsAre(8));
}

TEST(TinyVocabTest, ErrorsNameTheProblem) {
  TinyVocabOptions no_tokens;
  no_tokens.write_tokens = false;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyTokenizer(no_tokens);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("tokenizer.ggml.tokens"));

  TinyVocabOptions short_scores;
  short_scores.scores = 7;
  tok = TinyTokenizer(short_scores);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("tokenizer.ggml.scores"));

  TinyVocabOptions bad_bos;
  bad_bos.bos = 10;
  tok = TinyTokenizer(bad_bos);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("bos_token_id"));

  TinyVocabOptions wordpiece;
  wordpiece.model = "bert";
  tok = TinyTokenizer(wordpiece);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().message(),
            "tokenizer model 'bert' is not supported yet (supported: llama, gpt2)");
}

TEST(TinyVocabTest, MissingTokenizerModel) {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(w.ToBytes());
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromGguf(**file);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("tokenizer.ggml.model"));
}

}  // namespace
}  // namespace ellm
