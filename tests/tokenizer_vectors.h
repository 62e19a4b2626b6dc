// Shared by the tokenizer tests: llama.cpp's tokenizer test vectors
// (X.gguf.inp: strings separated by "\n__ggml_vocab_test__\n"; X.gguf.out:
// one line of expected ids per string), loading a tokenizer, UTF-8 checks.
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "core/gguf.h"
#include "core/tokenizer.h"
#include "gtest/gtest.h"

namespace ellm::tokenizer_testing {

inline std::string ReadFileOrDie(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::unique_ptr<Tokenizer> LoadTokenizer(const std::string& path) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  EXPECT_TRUE(file.ok()) << path << ": " << file.status();
  if (!file.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromGguf(**file);
  EXPECT_TRUE(tok.ok()) << path << ": " << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

// The tests' own strict UTF-8 check, written apart from core/unicode.h so it
// can serve as its oracle (no overlongs, surrogates or code points past
// U+10FFFF, no truncated sequences).
inline bool IsStrictUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    int need;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b0 < 0x80) {
      need = 1;
    } else if (b0 >= 0xC2 && b0 <= 0xDF) {
      need = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      need = 3;
      if (b0 == 0xE0) lo = 0xA0;
      if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      need = 4;
      if (b0 == 0xF0) lo = 0x90;
      if (b0 == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (i + need > s.size()) return false;
    for (int k = 1; k < need; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return false;
    }
    i += need;
  }
  return true;
}

// llama.cpp's tokenizer vectors: X.inp holds the strings, each followed by
// "\n__ggml_vocab_test__\n"; X.out one line of space-separated ids per string.
struct VocabCase {
  std::string text;
  std::vector<int32_t> ids;
};

inline std::vector<VocabCase> LoadVocabCases(const std::string& vocab_path) {
  const std::string inp = ReadFileOrDie(vocab_path + ".inp");
  const std::string out = ReadFileOrDie(vocab_path + ".out");
  const std::string separator = "\n__ggml_vocab_test__\n";
  std::vector<std::string> texts;
  size_t start = 0;
  for (size_t pos = inp.find(separator); pos != std::string::npos;
       pos = inp.find(separator, start)) {
    texts.push_back(inp.substr(start, pos - start));
    start = pos + separator.size();
  }
  EXPECT_EQ(start, inp.size()) << "the .inp should end with a separator";

  std::vector<VocabCase> cases;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    VocabCase c;
    std::istringstream words(line);
    int64_t id;
    while (words >> id) c.ids.push_back(static_cast<int32_t>(id));
    cases.push_back(std::move(c));
  }
  EXPECT_EQ(texts.size(), cases.size()) << vocab_path;
  for (size_t i = 0; i < std::min(texts.size(), cases.size()); ++i) cases[i].text = texts[i];
  cases.resize(std::min(texts.size(), cases.size()));
  return cases;
}

inline std::string Escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      out += c;
    }
  }
  return out;
}

// Every case encodes to llama.cpp's ids (46 cases per vector file).
inline void ExpectEncodesLikeLlamaCpp(const Tokenizer& tok, const std::vector<VocabCase>& cases) {
  ASSERT_EQ(cases.size(), 46u);
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "case " << i << " '" << Escape(cases[i].text) << "'");
    EXPECT_EQ(tok.Encode(cases[i].text, /*add_bos=*/false), cases[i].ids);
  }
}

// Streaming each case's ids gives only whole UTF-8 pieces and the case's text.
inline void ExpectStreamDecodesWholeUtf8(const Tokenizer& tok, const std::vector<VocabCase>& cases) {
  for (const VocabCase& c : cases) {
    SCOPED_TRACE(Escape(c.text));
    StreamDecoder stream(tok);
    std::string text;
    for (int32_t id : c.ids) {
      const std::string piece = stream.Push(id);
      EXPECT_TRUE(IsStrictUtf8(piece)) << "token " << id;
      text += piece;
    }
    text += stream.Finish();
    EXPECT_EQ(text, c.text);
  }
}

}  // namespace ellm::tokenizer_testing
