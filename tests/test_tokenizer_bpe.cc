// Byte-level BPE tokenizer (tokenizer.ggml.model "gpt2"): llama.cpp's vocab
// vectors for every pre-tokenizer whose GGUF is in ../shared/models/vocab,
// Qwen2.5 spot checks, special tokens, streaming, speed, and a tiny vocab built
// here for the merge order and the error paths.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/gguf.h"
#include "core/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tokenizer_vectors.h"
#include "core/unicode.h"

namespace ellm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const std::string kVocabDir = std::string(ELLM_MODELS_DIR) + "/vocab/";
const std::string kQwenVocab = kVocabDir + "qwen2.5-vocab-derived.gguf";

using namespace ellm::tokenizer_testing;  // NOLINT: shared test helpers

// --- llama.cpp's vectors ------------------------------------------------------

struct VectorsParam {
  const char* name;     // test name suffix
  const char* vocab;    // GGUF under vocab/
  const char* vectors;  // .inp/.out prefix under vocab/
};

class BpeVectorsTest : public ::testing::TestWithParam<VectorsParam> {};

TEST_P(BpeVectorsTest, EncodesEveryCaseLikeLlamaCpp) {
  std::unique_ptr<Tokenizer> tok = LoadTokenizer(kVocabDir + GetParam().vocab);
  ASSERT_NE(tok, nullptr);
  ExpectEncodesLikeLlamaCpp(*tok, LoadVocabCases(kVocabDir + GetParam().vectors));
}

TEST_P(BpeVectorsTest, DecodeInvertsEncode) {
  std::unique_ptr<Tokenizer> tok = LoadTokenizer(kVocabDir + GetParam().vocab);
  ASSERT_NE(tok, nullptr);
  for (const VocabCase& c : LoadVocabCases(kVocabDir + GetParam().vectors)) {
    SCOPED_TRACE(Escape(c.text));
    EXPECT_EQ(tok->Decode(c.ids), c.text);
    EXPECT_EQ(tok->Decode(tok->Encode(c.text, false)), c.text);
    if (tok->bos_id() >= 0) {
      const std::vector<int32_t> with_bos = tok->Encode(c.text, true);
      ASSERT_FALSE(with_bos.empty());
      EXPECT_EQ(with_bos[0], tok->bos_id());
      EXPECT_EQ(tok->Decode(with_bos), c.text);  // BOS is a control token: no bytes
    }
  }
}

TEST_P(BpeVectorsTest, StreamDecoderEmitsOnlyWholeUtf8) {
  std::unique_ptr<Tokenizer> tok = LoadTokenizer(kVocabDir + GetParam().vocab);
  ASSERT_NE(tok, nullptr);
  ExpectStreamDecodesWholeUtf8(*tok, LoadVocabCases(kVocabDir + GetParam().vectors));
}

TEST_P(BpeVectorsTest, LongPromptEncodesQuickly) {
  std::unique_ptr<Tokenizer> tok = LoadTokenizer(kVocabDir + GetParam().vocab);
  ASSERT_NE(tok, nullptr);
  const std::vector<VocabCase> cases = LoadVocabCases(kVocabDir + GetParam().vectors);
  ASSERT_FALSE(cases.empty());
  std::string prompt;
  while (prompt.size() < 10 * 1024) {
    for (const VocabCase& c : cases) prompt += c.text + " ";
  }
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tok->Encode(prompt, false);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s: %zu bytes -> %zu tokens in %.2f ms\n", GetParam().name, prompt.size(),
              ids.size(), ms);
  EXPECT_LT(ms, 100.0);
  EXPECT_EQ(tok->Decode(ids), prompt);
}

INSTANTIATE_TEST_SUITE_P(
    Vocabs, BpeVectorsTest,
    ::testing::Values(
        // Qwen2's vectors (HF Qwen1.5) with the Qwen2.5 vocab built from the same merges.
        VectorsParam{"Qwen2", "qwen2.5-vocab-derived.gguf", "ggml-vocab-qwen2.gguf"},
        // DeepSeek-R1-Qwen uses the Qwen2 pre-tokenizer and vocabulary.
        VectorsParam{"DeepseekR1Qwen", "qwen2.5-vocab-derived.gguf",
                     "ggml-vocab-deepseek-r1-qwen.gguf"},
        VectorsParam{"Gpt2", "ggml-vocab-gpt-2.gguf", "ggml-vocab-gpt-2.gguf"},
        VectorsParam{"Starcoder", "ggml-vocab-starcoder.gguf", "ggml-vocab-starcoder.gguf"},
        VectorsParam{"Refact", "ggml-vocab-refact.gguf", "ggml-vocab-refact.gguf"},
        VectorsParam{"Mpt", "ggml-vocab-mpt.gguf", "ggml-vocab-mpt.gguf"},
        VectorsParam{"Falcon", "ggml-vocab-falcon.gguf", "ggml-vocab-falcon.gguf"},
        VectorsParam{"DeepseekCoder", "ggml-vocab-deepseek-coder.gguf",
                     "ggml-vocab-deepseek-coder.gguf"},
        VectorsParam{"DeepseekLlm", "ggml-vocab-deepseek-llm.gguf",
                     "ggml-vocab-deepseek-llm.gguf"}),
    [](const auto& info) { return std::string(info.param.name); });

// --- Qwen2.5 ------------------------------------------------------------------

class QwenTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { tok_ = LoadTokenizer(kQwenVocab).release(); }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(tok_, nullptr); }
  static Tokenizer* tok_;
};
Tokenizer* QwenTest::tok_ = nullptr;

constexpr int32_t kEndOfText = 151643;  // <|endoftext|>, also BOS and pad
constexpr int32_t kImStart = 151644;    // <|im_start|>
constexpr int32_t kImEnd = 151645;      // <|im_end|>, EOS
constexpr int32_t kToolCall = 151657;   // <tool_call>, user-defined

TEST_F(QwenTest, Metadata) {
  EXPECT_EQ(tok_->vocab_size(), 151936);
  EXPECT_EQ(tok_->bos_id(), kEndOfText);
  EXPECT_EQ(tok_->eos_id(), kImEnd);
  EXPECT_FALSE(tok_->add_bos());
  EXPECT_EQ(tok_->token(kImStart), "<|im_start|>");
  EXPECT_EQ(tok_->token_type(kImStart), TokenType::kControl);
  EXPECT_EQ(tok_->token(kToolCall), "<tool_call>");
  EXPECT_EQ(tok_->token_type(kToolCall), TokenType::kUserDefined);
  EXPECT_EQ(tok_->token_type(151900), TokenType::kUnused);
}

TEST_F(QwenTest, EndOfGeneration) {
  EXPECT_TRUE(tok_->IsEndOfGeneration(kImEnd));
  EXPECT_TRUE(tok_->IsEndOfGeneration(kEndOfText));
  EXPECT_FALSE(tok_->IsEndOfGeneration(kImStart));
  EXPECT_FALSE(tok_->IsEndOfGeneration(14990));
  EXPECT_FALSE(tok_->IsEndOfGeneration(-1));
}

TEST_F(QwenTest, SpotChecks) {
  EXPECT_THAT(tok_->Encode("hello", false), ElementsAre(14990));
  EXPECT_THAT(tok_->Encode(" world", false), ElementsAre(1879));
  EXPECT_THAT(tok_->Encode("I'm", false), ElementsAre(40, 2776));
  EXPECT_THAT(tok_->Encode("hello\tworld", false), ElementsAre(14990, 76508));
  EXPECT_THAT(tok_->Encode("\xF0\x9F\x98\x8A", false), ElementsAre(144236));  // 😊
  EXPECT_TRUE(tok_->Encode("", false).empty());
  // add_bos is false for Qwen, but an explicit request is honoured.
  EXPECT_THAT(tok_->Encode("hello", true), ElementsAre(kEndOfText, 14990));
}

TEST_F(QwenTest, TokenBytes) {
  EXPECT_EQ(tok_->TokenBytes(-1, 1879), " world");  // "Ġworld"
  EXPECT_EQ(tok_->TokenBytes(5, 14990), "hello");
  EXPECT_EQ(tok_->TokenBytes(-1, 144236), "\xF0\x9F\x98\x8A");
  EXPECT_EQ(tok_->TokenBytes(-1, kImStart), "");   // control
  EXPECT_EQ(tok_->TokenBytes(-1, kImEnd), "");
  EXPECT_EQ(tok_->TokenBytes(-1, kToolCall), "<tool_call>");  // user-defined: its text
  EXPECT_EQ(tok_->TokenBytes(-1, 151900), "");     // unused padding
  EXPECT_EQ(tok_->TokenBytes(-1, -1), "");
  EXPECT_EQ(tok_->TokenBytes(-1, 151936), "");
  // Byte tokens 0..255 are GPT-2's byte symbols: 'Ġ' (id 220) is ' ', and
  // bytes past ASCII stand alone (id of byte 0xF0 decodes to that byte).
  EXPECT_EQ(tok_->TokenBytes(-1, 220), " ");
  const std::vector<int32_t> lead = tok_->Encode("\xF0", false);
  ASSERT_EQ(lead.size(), 1u);
  EXPECT_EQ(tok_->TokenBytes(-1, lead[0]), "\xF0");
}

TEST_F(QwenTest, ParseSpecialEmitsControlTokens) {
  const std::string chat = "<|im_start|>user\nhi<|im_end|>";
  const std::vector<int32_t> ids = tok_->Encode(chat, false, /*parse_special=*/true);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), kImStart);
  EXPECT_EQ(ids.back(), kImEnd);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), kImStart), 1);
  // Between them: exactly the plain encoding of the text between them.
  EXPECT_EQ(std::vector<int32_t>(ids.begin() + 1, ids.end() - 1), tok_->Encode("user\nhi", false));
  // Control tokens decode to nothing.
  EXPECT_EQ(tok_->Decode(ids), "user\nhi");

  // Without parse_special the markers are plain text.
  const std::vector<int32_t> plain = tok_->Encode(chat, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), kImStart), 0);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), kImEnd), 0);
  EXPECT_EQ(tok_->Decode(plain), chat);
  // The two-argument form is parse_special = false.
  EXPECT_EQ(plain, tok_->Encode(chat, false, false));
}

TEST_F(QwenTest, ParseSpecialChatTurns) {
  const std::string chat =
      "<|im_start|>system\nYou help.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
      "<|im_start|>assistant\n";
  const std::vector<int32_t> ids = tok_->Encode(chat, false, true);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), kImStart), 3);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), kImEnd), 2);
  EXPECT_EQ(ids.front(), kImStart);
}

TEST_F(QwenTest, UserDefinedTokensAlwaysMatch) {
  // User-defined tokens are matched in text with or without parse_special
  // (as HF and llama.cpp do) and decode to their text.
  for (bool parse_special : {false, true}) {
    const std::vector<int32_t> ids = tok_->Encode("a<tool_call>b", false, parse_special);
    ASSERT_EQ(ids.size(), 3u);
    EXPECT_EQ(ids[1], kToolCall);
    EXPECT_EQ(tok_->Decode(ids), "a<tool_call>b");
  }
}

TEST_F(QwenTest, LongestSpecialTokenFirst) {
  // "<|im_start|>" must not be cut by a shorter special token it contains,
  // and adjacent tokens split cleanly.
  const std::vector<int32_t> ids =
      tok_->Encode("<|im_start|><|im_end|><|endoftext|>", false, true);
  EXPECT_THAT(ids, ElementsAre(kImStart, kImEnd, kEndOfText));
}

TEST_F(QwenTest, InvalidUtf8SurvivesTheRoundTrip) {
  for (const std::string& text :
       {std::string("a\xFF\xC3(b\x80"), std::string("\xF0\x9F\x98"), std::string("\xED\xA0\x80"),
        std::string("x \xC0\xAF y\n\xFE")}) {
    SCOPED_TRACE(Escape(text));
    EXPECT_EQ(tok_->Decode(tok_->Encode(text, false)), text);
  }
}

TEST_F(QwenTest, RandomBytesRoundTrip) {
  // Random bytes, biased towards what splits words and characters.
  std::mt19937 rng(1234);
  const std::string alphabet = std::string("ab 1\n\t'!<|>") + "\xE4\xBD\xA0\xF0\x9F\x98\x8A\xC3";
  for (int round = 0; round < 300; ++round) {
    std::string text;
    const int len = static_cast<int>(rng() % 64);
    for (int i = 0; i < len; ++i) {
      text.push_back(rng() % 2 ? alphabet[rng() % alphabet.size()] : static_cast<char>(rng()));
    }
    SCOPED_TRACE(Escape(text));
    EXPECT_EQ(tok_->Decode(tok_->Encode(text, false)), text);
    EXPECT_EQ(tok_->Decode(tok_->Encode(text, false, true)), text);
  }
}

TEST_F(QwenTest, StreamDecoderReassemblesSplitCharacters) {
  const std::string text =
      "\xF0\x9F\x98\x8A \xE4\xBD\xA0\xE5\xA5\xBD\xEF\xBC\x8C\xE4\xB8\x96\xE7\x95\x8C\xEF\xBC\x81 "
      "\xF0\x9F\xA6\x99\xF0\x9F\x9A\x80\xF0\x9F\x98\xB6\xE2\x80\x8D\xF0\x9F\x8C\xAB\xEF\xB8\x8F "
      "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E\xE3\x81\xA8\xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4 "
      "\xF0\x90\x8D\x88\xF0\x9D\x84\x9E \xE2\x98\x83 \xC3\x9C" "n\xC3\xAF" "c\xC3\xB6" "d\xC3\xA9";
  ASSERT_TRUE(IsStrictUtf8(text));
  const std::vector<int32_t> ids = tok_->Encode(text, false);
  // The test only means something if some token ends inside a character.
  int partial = 0;
  for (int32_t id : ids) partial += IsStrictUtf8(tok_->TokenBytes(-1, id)) ? 0 : 1;
  EXPECT_GT(partial, 0);

  StreamDecoder stream(*tok_);
  std::string out;
  for (int32_t id : ids) {
    const std::string piece = stream.Push(id);
    EXPECT_TRUE(IsStrictUtf8(piece)) << "token " << id;
    out += piece;
  }
  out += stream.Finish();
  EXPECT_EQ(out, text);
}

TEST_F(QwenTest, LongPromptEncodesQuickly) {
  const std::vector<VocabCase> cases = LoadVocabCases(kVocabDir + "ggml-vocab-qwen2.gguf");
  ASSERT_FALSE(cases.empty());
  std::string prompt;
  while (prompt.size() < 10 * 1024) {
    for (const VocabCase& c : cases) prompt += c.text + " ";
  }
  // Worst cases for merging: long runs of one character (one word each).
  const std::string spaces(10 * 1024, ' ');
  const std::string letters(10 * 1024, 'a');
  const std::string digits(10 * 1024, '3');
  for (const std::string* text :
       std::vector<const std::string*>{&prompt, &spaces, &letters, &digits}) {
    const auto start = std::chrono::steady_clock::now();
    const std::vector<int32_t> ids = tok_->Encode(*text, false);
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - start)
                          .count();
    std::printf("%zu bytes -> %zu tokens in %.2f ms\n", text->size(), ids.size(), ms);
    EXPECT_LT(ms, 100.0);
    EXPECT_EQ(tok_->Decode(ids), *text);
  }
}

TEST(BpeVocabTest, Gpt2Metadata) {
  std::unique_ptr<Tokenizer> tok = LoadTokenizer(kVocabDir + "ggml-vocab-gpt-2.gguf");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->eos_id(), 50256);
  EXPECT_FALSE(tok->add_bos());  // no key: false for GPT-2 style vocabularies
  EXPECT_TRUE(tok->IsEndOfGeneration(50256));
  EXPECT_THAT(tok->Encode("Hello world", false), ElementsAre(15496, 995));
  EXPECT_THAT(tok->Encode("<|endoftext|>", false, true), ElementsAre(50256));
  EXPECT_GT(tok->Encode("<|endoftext|>", false, false).size(), 1u);
}

TEST(BpeVocabTest, DeepseekKeepsAddBosFromMetadata) {
  std::unique_ptr<Tokenizer> tok = LoadTokenizer(kVocabDir + "ggml-vocab-deepseek-llm.gguf");
  ASSERT_NE(tok, nullptr);
  EXPECT_TRUE(tok->add_bos());
  EXPECT_EQ(tok->bos_id(), 100000);
  EXPECT_TRUE(tok->IsEndOfGeneration(100001));  // <｜end▁of▁sentence｜>
}

// --- Pre-tokenizers -------------------------------------------------------------

std::vector<std::string> Split(std::string_view pre, std::string_view text) {
  absl::StatusOr<std::vector<std::string>> words = internal::BpePreTokenize(pre, text);
  EXPECT_TRUE(words.ok()) << words.status();
  return words.ok() ? *words : std::vector<std::string>{};
}

TEST(BpePreTokenizerTest, Llama3GroupsDigitsByThree) {
  EXPECT_THAT(Split("llama-bpe", "3333333"), ElementsAre("333", "333", "3"));
  EXPECT_THAT(Split("qwen2", "3333"), ElementsAre("3", "3", "3", "3"));
  EXPECT_THAT(Split("gpt-2", "3333 x"), ElementsAre("3333", " x"));
}

TEST(BpePreTokenizerTest, Llama3Words) {
  EXPECT_THAT(Split("llama-bpe", "Hello world"), ElementsAre("Hello", " world"));
  // Case-insensitive contractions; any non-letter may lead a word.
  EXPECT_THAT(Split("llama-bpe", "I'M (ok)"), ElementsAre("I", "'M", " (", "ok", ")"));
  EXPECT_THAT(Split("llama-bpe", "\tfoo"), ElementsAre("\tfoo"));
  // Whitespace: up to the last newline; a run before a word leaves its last space.
  EXPECT_THAT(Split("llama-bpe", "a\n\n  b"), ElementsAre("a", "\n\n", " ", " b"));
  EXPECT_THAT(Split("llama-bpe", "a   "), ElementsAre("a", "   "));
  EXPECT_THAT(Split("llama-bpe", "!!\n\nx"), ElementsAre("!!\n\n", "x"));
}

TEST(BpePreTokenizerTest, Gpt2Words) {
  EXPECT_THAT(Split("gpt-2", "I'm  here"), ElementsAre("I", "'m", " ", " here"));
  // Case-sensitive contractions.
  EXPECT_THAT(Split("gpt-2", "I'M"), ElementsAre("I", "'", "M"));
  EXPECT_THAT(Split("gpt-2", "a\n\tb"), ElementsAre("a", "\n", "\t", "b"));
  EXPECT_THAT(Split("gpt-2", "x !?y"), ElementsAre("x", " !?", "y"));
}

TEST(BpePreTokenizerTest, SequencesSplitEveryPiece) {
  EXPECT_THAT(Split("starcoder", "ab 12"), ElementsAre("ab", " ", "1", "2"));
  EXPECT_THAT(Split("falcon", "x=1234"), ElementsAre("x", "=", "123", "4"));
  EXPECT_THAT(Split("deepseek-coder", "ab,\n12"), ElementsAre("ab", ",", "\n", "1", "2"));
}

TEST(BpePreTokenizerTest, NoBytesLost) {
  const std::string text = "a\xFF\xC3(b\x80 \xE4\xBD\xA0\xE5\xA5\xBD 12345 \n\n x";
  for (std::string_view pre : {"default", "gpt-2", "qwen2", "llama-bpe", "starcoder", "falcon",
                               "deepseek-llm", "deepseek-coder"}) {
    std::string joined;
    for (const std::string& w : Split(pre, text)) joined += w;
    EXPECT_EQ(joined, text) << pre;
  }
}

TEST(BpePreTokenizerTest, LongRunsSplitInLinearTime) {
  // Runs that a careless matcher rescans at every position. The runs are long
  // enough that rescanning (n^2 / 2 ~ 5e9 steps at 100K bytes) takes seconds,
  // while a linear split takes a few ms, and well under 1 s under ASan (about
  // 1.5 us per byte there) or on a busy machine: the limit sits between.
  const std::string n(50000, ' ');
  const std::vector<std::string> texts = {
      n + "x",
      n + "x" + n,
      std::string(50000, '\n'),
      std::string(50000, '7'),
      std::string(50000, '!'),
      std::string(50000, '\t') + "!",
      " \n \r\n\t" + n + "\n" + n + "y",
  };
  for (std::string_view pre : {"default", "gpt-2", "qwen2", "llama-bpe", "starcoder", "falcon",
                               "deepseek-llm", "deepseek-coder"}) {
    for (const std::string& text : texts) {
      const auto start = std::chrono::steady_clock::now();
      const std::vector<std::string> words = Split(pre, text);
      const double ms = std::chrono::duration<double, std::milli>(
                            std::chrono::steady_clock::now() - start)
                            .count();
      EXPECT_LT(ms, 1000.0) << pre << ", " << text.size() << " bytes";
      size_t bytes = 0;
      for (const std::string& w : words) bytes += w.size();
      EXPECT_EQ(bytes, text.size()) << pre;
    }
  }
}

TEST(BpePreTokenizerTest, UnknownName) {
  EXPECT_FALSE(internal::BpePreTokenize("no-such-pre", "x").ok());
}

// --- A tiny vocabulary built here -------------------------------------------------

// Ids 0..255: the byte symbols of bytes 0..255 (GPT-2's bytes_to_unicode);
// then 256 "ab", 257 "aa", 258 "Ġa", 259 "abd" (reachable by no merge),
// 260 "<|end|>" (control), 261 "<x>" (user-defined).
// Merges by rank: "a b" (0), "a a" (1), "Ġ a" (2).
struct TinyBpeOptions {
  std::string pre = "gpt-2";
  bool write_pre = true;
  bool write_merges = true;
  std::vector<std::string> merges = {"a b", "a a", "\xC4\xA0 a"};
  bool write_add_bos = false;
  bool add_bos = false;
  std::optional<bool> add_eos;  // tokenizer.ggml.add_eos_token, when set
};

std::string ByteSymbol(int b) {
  int n = 0;
  for (int x = 0; x < 256; ++x) {
    const bool printable =
        (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
    const int cp = printable ? x : 256 + n++;
    if (x == b) {
      std::string s;
      if (cp < 0x80) {
        s.push_back(static_cast<char>(cp));
      } else {
        s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      return s;
    }
  }
  return "";
}

absl::StatusOr<std::unique_ptr<Tokenizer>> TinyBpe(const TinyBpeOptions& o) {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(ByteSymbol(b));
    types.push_back(1);
  }
  for (const char* t : {"ab", "aa", "\xC4\xA0" "a", "abd"}) {
    tokens.push_back(t);
    types.push_back(1);
  }
  tokens.push_back("<|end|>");
  types.push_back(3);
  tokens.push_back("<x>");
  types.push_back(4);

  GgufWriter w;
  w.SetString("general.architecture", "gpt2");
  w.SetString("tokenizer.ggml.model", "gpt2");
  if (o.write_pre) w.SetString("tokenizer.ggml.pre", o.pre);
  w.SetStringArray("tokenizer.ggml.tokens", tokens);
  w.SetInt32Array("tokenizer.ggml.token_type", types);
  if (o.write_merges) w.SetStringArray("tokenizer.ggml.merges", o.merges);
  w.SetUint32("tokenizer.ggml.bos_token_id", 260);
  w.SetUint32("tokenizer.ggml.eos_token_id", 260);
  if (o.write_add_bos) w.SetBool("tokenizer.ggml.add_bos_token", o.add_bos);
  if (o.add_eos.has_value()) w.SetBool("tokenizer.ggml.add_eos_token", *o.add_eos);
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(w.ToBytes());
  if (!file.ok()) return file.status();
  return Tokenizer::FromGguf(**file);
}

TEST(TinyBpeTest, LowestRankMergesFirst) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyBpe({});
  ASSERT_TRUE(tok.ok()) << tok.status();
  // Words "ab", " abd". In " abd", "a b" (rank 0) beats "Ġ a" (rank 2), and
  // "Ġ ab" is no merge: Ġ ab d.
  EXPECT_THAT((*tok)->Encode("ab abd", false), ElementsAre(256, ' ', 256, 'd'));
  // " a": only "Ġ a".
  EXPECT_THAT((*tok)->Encode(" a", false), ElementsAre(258));
  EXPECT_EQ((*tok)->Decode({256, ' ', 256, 'd', 258}), "ab abd a");
}

TEST(TinyBpeTest, EqualRanksMergeLeftmostFirst) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyBpe({});
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT((*tok)->Encode("aaa", false), ElementsAre(257, 'a'));
  EXPECT_THAT((*tok)->Encode("aaaa", false), ElementsAre(257, 257));
  // "aab": "a b" outranks "a a" though it is further right.
  EXPECT_THAT((*tok)->Encode("aab", false), ElementsAre('a', 256));
}

TEST(TinyBpeTest, Llama3IgnoresMergesForWholeTokensAndAddsBos) {
  TinyBpeOptions o;
  o.pre = "llama-bpe";
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyBpe(o);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_TRUE((*tok)->add_bos());  // Llama-3's default
  EXPECT_THAT((*tok)->Encode("abd", false), ElementsAre(259));
  EXPECT_THAT((*tok)->Encode("abd", true), ElementsAre(260, 259));

  tok = TinyBpe({});  // gpt-2: merges only
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_FALSE((*tok)->add_bos());
  EXPECT_THAT((*tok)->Encode("abd", false), ElementsAre(256, 'd'));

  o.write_add_bos = true;
  o.add_bos = false;
  tok = TinyBpe(o);  // the key wins over the default
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_FALSE((*tok)->add_bos());
}

TEST(TinyBpeTest, SpecialTokens) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyBpe({});
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT((*tok)->Encode("ab<|end|>", false, true), ElementsAre(256, 260));
  EXPECT_THAT((*tok)->Encode("<x>ab", false, false), ElementsAre(261, 256));
  EXPECT_EQ((*tok)->Decode({256, 260, 261}), "ab<x>");
  EXPECT_TRUE((*tok)->IsEndOfGeneration(260));
}

// Prompts that should end with EOS (llama.cpp appends it): ellm's never do,
// so such a model is refused; an explicit false is what ellm does.
TEST(TinyBpeTest, AddEosTokenIsRefused) {
  TinyBpeOptions o;
  o.add_eos = true;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyBpe(o);
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(tok.status().message(), HasSubstr("add_eos_token"));
  o.add_eos = false;
  EXPECT_TRUE(TinyBpe(o).ok());
}

TEST(TinyBpeTest, MissingPreIsRefusedAndDefaultIsAValue) {
  TinyBpeOptions o;
  o.write_pre = false;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyBpe(o);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("no tokenizer.ggml.pre"));
  o.write_pre = true;
  o.pre = "default";
  tok = TinyBpe(o);
  ASSERT_TRUE(tok.ok()) << tok.status();
  // The default pre-tokenizer splits punctuation runs first.
  EXPECT_THAT((*tok)->Encode("ab!!", false), ElementsAre(256, '!', '!'));
}

TEST(TinyBpeTest, ErrorsNameTheProblem) {
  TinyBpeOptions bad_pre;
  bad_pre.pre = "klingon";
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = TinyBpe(bad_pre);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("'klingon'"));
  EXPECT_THAT(tok.status().message(), HasSubstr("tokenizer.ggml.pre"));

  TinyBpeOptions no_merges;
  no_merges.write_merges = false;
  tok = TinyBpe(no_merges);
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(tok.status().message(), HasSubstr("tokenizer.ggml.merges"));

  TinyBpeOptions no_space;
  no_space.merges = {"a b", "ab"};
  tok = TinyBpe(no_space);
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(tok.status().message(), HasSubstr("merge 1 ('ab')"));

  TinyBpeOptions unknown_result;
  unknown_result.merges = {"b a"};  // "ba" is no token
  tok = TinyBpe(unknown_result);
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(tok.status().message(), HasSubstr("merge 0 ('b a')"));
}

// core/unicode.h's scanner against the tests' own strict validator, on
// known sequences and on random bytes (biased towards UTF-8's lead bytes).
TEST(Utf8Scan, AgreesWithAnIndependentValidator) {
  EXPECT_EQ(ellm::ScanUtf8("a"), 1);
  EXPECT_EQ(ellm::ScanUtf8("\xC3\xA9"), 2);
  EXPECT_EQ(ellm::ScanUtf8("\xE2\x82"), 0);           // incomplete euro sign
  EXPECT_EQ(ellm::ScanUtf8("\xE0\x80\x80"), -1);     // overlong
  EXPECT_EQ(ellm::ScanUtf8("\xED\xA0\x80"), -1);     // surrogate
  EXPECT_EQ(ellm::ScanUtf8("\xF0\x9F\x98\x8A"), 4); // emoji
  EXPECT_EQ(ellm::ScanUtf8("\xE2\x82\x41"), -2);     // broken third byte
  char32_t cp = 0;
  EXPECT_EQ(ellm::DecodeUtf8("\xF0\x9F\x98\x8A", &cp), 4);
  EXPECT_EQ(cp, 0x1F60Au);
  EXPECT_EQ(ellm::DecodeUtf8("\xE2\x82", &cp), 1);
  EXPECT_EQ(cp, ellm::kReplacementCodePoint);
  uint64_t x = 88172645463325252ULL;
  const unsigned char pool[] = {'a', 0x80, 0xBF, 0xC2, 0xDF, 0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xA0, 0x9F, 0x90, 0x8F};
  for (int trial = 0; trial < 20000; ++trial) {
    std::string bytes;
    const int n = 1 + trial % 7;
    for (int i = 0; i < n; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      bytes.push_back(static_cast<char>(pool[x % sizeof(pool)]));
    }
    ASSERT_EQ(ellm::IsValidUtf8(bytes), ellm::tokenizer_testing::IsStrictUtf8(bytes)) << Escape(bytes);
  }
}

}  // namespace
}  // namespace ellm
