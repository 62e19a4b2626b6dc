// Byte-level BPE tokenizer for GGUF vocabularies with tokenizer.ggml.model
// "gpt2" (GPT-2, Qwen2, Llama-3, StarCoder, Falcon, DeepSeek, ...).
//
// Encoding, as HF tokenizers and llama.cpp do it:
//  1. the text is cut at special tokens (Tokenizer::SplitOnSpecialTokens);
//  2. each remaining fragment is cut into words by the pre-tokenizer named by
//     tokenizer.ggml.pre: a sequence of regex splits, each applied to every
//     piece the previous ones left (matches and the text between them both
//     become pieces). The regexes are implemented by hand below, one matcher
//     function per regex, over the fragment's code points;
//  3. each word's bytes become GPT-2's byte symbols (bytes_to_unicode: the
//     printable Latin-1 bytes stand for themselves, the other 68 bytes for
//     U+0100..U+0143), one symbol per byte, each a token;
//  4. the adjacent pair of symbols with the lowest merge rank (its index in
//     tokenizer.ggml.merges) is merged, again and again (ties: the leftmost
//     pair), until no adjacent pair has a merge.
// Decoding maps the byte symbols of a token's text back to bytes.

#include "core/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <iterator>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/unicode.h"

namespace ellm {
namespace {


// --- GPT-2 byte symbols -------------------------------------------------------

// bytes_to_unicode(): byte -> the code point that stands for it in tokens.
constexpr std::array<char32_t, 256> MakeByteSymbols() {
  std::array<char32_t, 256> symbols{};
  char32_t next = 0x100;
  for (int b = 0; b < 256; ++b) {
    const bool printable =
        (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    symbols[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return symbols;
}
constexpr std::array<char32_t, 256> kByteSymbols = MakeByteSymbols();
constexpr char32_t kSymbolLimit = 0x100 + 68;  // symbols are below this

// The inverse: code point -> byte, -1 for code points that are no symbol.
constexpr std::array<int16_t, kSymbolLimit> MakeSymbolBytes() {
  std::array<int16_t, kSymbolLimit> bytes{};
  for (auto& b : bytes) b = -1;
  for (int b = 0; b < 256; ++b) bytes[kByteSymbols[b]] = static_cast<int16_t>(b);
  return bytes;
}
constexpr std::array<int16_t, kSymbolLimit> kSymbolBytes = MakeSymbolBytes();

std::string ToByteSymbols(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char b : bytes) AppendUtf8(kByteSymbols[static_cast<unsigned char>(b)], out);
  return out;
}

// --- Pre-tokenizer regexes ----------------------------------------------------

// One character of the fragment being split. A byte that is not valid UTF-8
// is a character of its own (U+FFFD, a symbol) so that no byte is lost.
// 8 bytes (with a byte offset instead of `bytes`, 24): 8 MiB of text with
// the Qwen2.5 vocabulary peaked 144 MB over the resident size before the
// encode, against 250 (test_tokenizer TokenizerBench.DISABLED_BenchLongDocuments).
struct Char {
  char32_t cp;
  UnicodeCategory category;
  bool space;     // regex \s (Unicode White_Space)
  uint8_t bytes;  // its UTF-8 length, 1 to 4 (1 for an invalid byte)
};
static_assert(sizeof(Char) == 8);

bool IsLetter(const Char& c) { return c.category == UnicodeCategory::kLetter; }
bool IsNumber(const Char& c) { return c.category == UnicodeCategory::kNumber; }
bool IsPunctuation(const Char& c) { return c.category == UnicodeCategory::kPunctuation; }
bool IsSpace(const Char& c) { return c.space; }
bool IsNewline(const Char& c) { return c.cp == '\r' || c.cp == '\n'; }
bool IsAsciiDigit(const Char& c) { return c.cp >= '0' && c.cp <= '9'; }
// [^\s\p{L}\p{N}]
bool IsOtherChar(const Char& c) { return !c.space && !IsLetter(c) && !IsNumber(c); }

bool InRanges(char32_t cp, const std::pair<char32_t, char32_t>* ranges, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (cp >= ranges[i].first && cp <= ranges[i].second) return true;
  }
  return false;
}

// [一-龥ࠀ-一가-퟿]: U+4E00..9FA5, U+0800..4E00, U+AC00..D7FF (DeepSeek).
bool IsDeepseekCjk(const Char& c) {
  return (c.cp >= 0x0800 && c.cp <= 0x9FA5) || (c.cp >= 0xAC00 && c.cp <= 0xD7FF);
}

// DeepSeek LLM's explicit letter class: the cased letters of these scripts.
constexpr std::pair<char32_t, char32_t> kDeepseekLetters[] = {
    {0x0041, 0x005A}, {0x0061, 0x007A}, {0x00B5, 0x00B5}, {0x00C0, 0x00D6}, {0x00D8, 0x00F6},
    {0x00F8, 0x01BA}, {0x01BC, 0x01BF}, {0x01C4, 0x0293}, {0x0295, 0x02AF}, {0x0370, 0x0373},
    {0x0376, 0x0377}, {0x037B, 0x037D}, {0x037F, 0x037F}, {0x0386, 0x0386}, {0x0388, 0x038A},
    {0x038C, 0x038C}, {0x038E, 0x03A1}, {0x03A3, 0x03F5}, {0x03F7, 0x0481}, {0x048A, 0x052F},
    {0x0531, 0x0556}, {0x10A0, 0x10C5}, {0x13A0, 0x13F5}, {0x13F8, 0x13FD}, {0x1C90, 0x1CBA},
    {0x1CBD, 0x1CBF}, {0x1D00, 0x1D2B}, {0x1D6B, 0x1D77}, {0x1D79, 0x1D9A}, {0x1E00, 0x1F15},
    {0x1F18, 0x1F1D}, {0x1F20, 0x1F45}, {0x1F48, 0x1F4D}, {0x1F50, 0x1F57}, {0x1F59, 0x1F59},
    {0x1F5B, 0x1F5B}, {0x1F5D, 0x1F5D}, {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4}, {0x1FB6, 0x1FBC},
    {0x1FBE, 0x1FBE}, {0x1FC2, 0x1FC4}, {0x1FC6, 0x1FCC}, {0x1FD0, 0x1FD3}, {0x1FD6, 0x1FDB},
    {0x1FE0, 0x1FEC}, {0x1FF2, 0x1FF4}, {0x1FF6, 0x1FFC}, {0x2102, 0x2102}, {0x2107, 0x2107},
    {0x210A, 0x2113}, {0x2115, 0x2115}, {0x2119, 0x211D}, {0x2124, 0x2124}, {0x2126, 0x2126},
    {0x2128, 0x2128}, {0x212A, 0x212D}, {0x212F, 0x2134}, {0x2139, 0x2139}, {0x213C, 0x213F},
    {0x2145, 0x2149}, {0x214E, 0x214E}, {0x2183, 0x2184}, {0x2C00, 0x2C7B}, {0x2C7E, 0x2CE4},
    {0x2CEB, 0x2CEE}, {0x2CF2, 0x2CF3}, {0xA640, 0xA66D}, {0xA680, 0xA69B}, {0xA722, 0xA76F},
    {0xA771, 0xA787}, {0xA78B, 0xA78E}, {0xAB70, 0xABBF}, {0xFB00, 0xFB06}, {0xFB13, 0xFB17},
    {0xFF21, 0xFF3A}, {0xFF41, 0xFF5A}, {0x10400, 0x1044F}, {0x104B0, 0x104D3},
    {0x104D8, 0x104FB}, {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF},
    {0x1E900, 0x1E943},
};
bool IsDeepseekLetter(const Char& c) {
  return InRanges(c.cp, kDeepseekLetters, std::size(kDeepseekLetters));
}

// DeepSeek LLM's punctuation class [!-/:-~！-／：-～‘-‟　-。].
constexpr std::pair<char32_t, char32_t> kDeepseekPunctuation[] = {
    {0x0021, 0x002F}, {0x003A, 0x007E}, {0xFF01, 0xFF0F},
    {0xFF1A, 0xFF5E}, {0x2018, 0x201F}, {0x3000, 0x3002},
};
bool IsDeepseekPunctuation(const Char& c) {
  return InRanges(c.cp, kDeepseekPunctuation, std::size(kDeepseekPunctuation));
}

// A matcher returns the length (in characters) of its regex's match starting
// exactly at `pos` of the piece chars[0, end), 0 when there is none. Each
// follows the regex's alternation order (the first alternative that matches
// wins) and greedy quantifiers; the piece is the whole text for lookaheads
// and `$`. None of the regexes can match the empty string. The splitter tries
// every position that no match covers, so the work a matcher does must be
// paid for by the characters it matches (or bounded), or splitting a long run
// goes quadratic.
using Matcher = size_t (*)(const Char* chars, size_t pos, size_t end);

template <typename Pred>
size_t RunEnd(const Char* chars, size_t pos, size_t end, Pred pred) {
  while (pos < end && pred(chars[pos])) ++pos;
  return pos;
}

// `lead?body+`
template <typename Lead, typename Body>
size_t MatchOptionalThenRun(const Char* chars, size_t pos, size_t end, Lead lead, Body body) {
  size_t start = pos;
  if (lead(chars[pos]) && pos + 1 < end && body(chars[pos + 1])) start = pos + 1;
  if (!body(chars[start])) return 0;
  return RunEnd(chars, start, end, body) - pos;
}

// 's|'t|'re|'ve|'m|'ll|'d, optionally ignoring ASCII case.
size_t MatchContraction(const Char* chars, size_t pos, size_t end, bool ignore_case) {
  if (chars[pos].cp != '\'' || pos + 1 >= end) return 0;
  auto at = [&](size_t i) -> char32_t {
    if (i >= end) return 0;
    const char32_t cp = chars[i].cp;
    return ignore_case && cp >= 'A' && cp <= 'Z' ? cp + ('a' - 'A') : cp;
  };
  switch (at(pos + 1)) {
    case 's': case 't': case 'm': case 'd':
      return 2;
    case 'r': case 'v':
      return at(pos + 2) == 'e' ? 3 : 0;
    case 'l':
      return at(pos + 2) == 'l' ? 3 : 0;
    default:
      return 0;
  }
}

// \s+(?!\S)|\s+ : a whitespace run, less its last character when more than
// one and a non-space follows (that one then leads the next word).
size_t MatchSpaceRun(const Char* chars, size_t pos, size_t end) {
  if (!chars[pos].space) return 0;
  const size_t run = RunEnd(chars, pos, end, IsSpace) - pos;
  return pos + run == end || run == 1 ? run : run - 1;
}

// GPT-2:  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
size_t MatchGpt2(const Char* chars, size_t pos, size_t end) {
  auto is_space = [](const Char& c) { return c.cp == ' '; };
  size_t n = MatchContraction(chars, pos, end, /*ignore_case=*/false);
  if (n == 0) n = MatchOptionalThenRun(chars, pos, end, is_space, IsLetter);
  if (n == 0) n = MatchOptionalThenRun(chars, pos, end, is_space, IsNumber);
  if (n == 0) n = MatchOptionalThenRun(chars, pos, end, is_space, IsOtherChar);
  if (n == 0) n = MatchSpaceRun(chars, pos, end);
  return n;
}

// Llama-3 (kMaxDigits 3) and Qwen2 (1):
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,kMaxDigits}|
//   ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
template <size_t kMaxDigits>
size_t MatchLlama3Family(const Char* chars, size_t pos, size_t end) {
  size_t n = MatchContraction(chars, pos, end, /*ignore_case=*/true);
  if (n > 0) return n;
  auto letter_lead = [](const Char& c) { return !IsNewline(c) && !IsLetter(c) && !IsNumber(c); };
  n = MatchOptionalThenRun(chars, pos, end, letter_lead, IsLetter);
  if (n > 0) return n;
  if (IsNumber(chars[pos])) {
    return RunEnd(chars, pos, std::min(end, pos + kMaxDigits), IsNumber) - pos;
  }
  auto is_space = [](const Char& c) { return c.cp == ' '; };
  n = MatchOptionalThenRun(chars, pos, end, is_space, IsOtherChar);
  if (n > 0) return RunEnd(chars, pos + n, end, IsNewline) - pos;
  if (!chars[pos].space) return 0;
  // \s*[\r\n]+ : the whitespace run up to and including its last newline.
  const size_t run_end = RunEnd(chars, pos, end, IsSpace);
  for (size_t k = run_end; k > pos; --k) {
    if (IsNewline(chars[k - 1])) return k - pos;
  }
  return MatchSpaceRun(chars, pos, end);
}

// \p{N}
size_t MatchOneNumber(const Char* chars, size_t pos, size_t) {
  return IsNumber(chars[pos]) ? 1 : 0;
}
// \p{N}+
size_t MatchNumberRun(const Char* chars, size_t pos, size_t end) {
  return RunEnd(chars, pos, end, IsNumber) - pos;
}
// [0-9][0-9][0-9]
size_t MatchThreeDigits(const Char* chars, size_t pos, size_t end) {
  return pos + 3 <= end && IsAsciiDigit(chars[pos]) && IsAsciiDigit(chars[pos + 1]) &&
                 IsAsciiDigit(chars[pos + 2])
             ? 3
             : 0;
}
// [\p{P}\$\+<=>\^~\|]+ : HF's Punctuation pre-tokenizer (ASCII punctuation
// counts even where Unicode calls it a symbol), except the backtick.
size_t MatchPunctuationRun(const Char* chars, size_t pos, size_t end) {
  auto pred = [](const Char& c) {
    return IsPunctuation(c) || c.cp == '$' || c.cp == '+' || c.cp == '<' || c.cp == '=' ||
           c.cp == '>' || c.cp == '^' || c.cp == '~' || c.cp == '|';
  };
  return RunEnd(chars, pos, end, pred) - pos;
}
// [\p{P}\$\+<=>\^~\|`]+ (Falcon)
size_t MatchPunctuationRunWithBacktick(const Char* chars, size_t pos, size_t end) {
  auto pred = [](const Char& c) {
    return IsPunctuation(c) || c.cp == '$' || c.cp == '+' || c.cp == '<' || c.cp == '=' ||
           c.cp == '>' || c.cp == '^' || c.cp == '~' || c.cp == '|' || c.cp == '`';
  };
  return RunEnd(chars, pos, end, pred) - pos;
}
// [\r\n]
size_t MatchNewline(const Char* chars, size_t pos, size_t) {
  return IsNewline(chars[pos]) ? 1 : 0;
}
// \s?\p{L}+
size_t MatchSpaceLetters(const Char* chars, size_t pos, size_t end) {
  return MatchOptionalThenRun(chars, pos, end, IsSpace, IsLetter);
}
// \s?\p{P}+
size_t MatchSpacePunctuation(const Char* chars, size_t pos, size_t end) {
  return MatchOptionalThenRun(chars, pos, end, IsSpace, IsPunctuation);
}
// [一-龥ࠀ-一가-퟿]+
size_t MatchDeepseekCjk(const Char* chars, size_t pos, size_t end) {
  return RunEnd(chars, pos, end, IsDeepseekCjk) - pos;
}
// \s?[A-Za-zµÀ-ÖØ-öø-ƺ...]+ (kDeepseekLetters)
size_t MatchDeepseekLetters(const Char* chars, size_t pos, size_t end) {
  return MatchOptionalThenRun(chars, pos, end, IsSpace, IsDeepseekLetter);
}
// \s?[!-/:-~！-／：-～‘-‟　-。]+
size_t MatchDeepseekPunctuation(const Char* chars, size_t pos, size_t end) {
  return MatchOptionalThenRun(chars, pos, end, IsSpace, IsDeepseekPunctuation);
}
// \s+$
size_t MatchTrailingSpace(const Char* chars, size_t pos, size_t end) {
  if (!chars[pos].space) return 0;
  // When the character before was a space too, the match tried there failed,
  // and this one fails the same way.
  if (pos > 0 && chars[pos - 1].space) return 0;
  const size_t run_end = RunEnd(chars, pos, end, IsSpace);
  return run_end == end ? run_end - pos : 0;
}

constexpr int kMaxPreSteps = 6;

// A tokenizer.ggml.pre value: the regex splits in order, and the defaults
// that llama.cpp ties to it.
struct PreTokenizerSpec {
  std::string_view name;
  Matcher steps[kMaxPreSteps];  // unused slots are null
  bool ignore_merges;           // a word that is itself a token is not merged
  bool add_bos;                 // default of tokenizer.ggml.add_bos_token
};

constexpr Matcher kGpt2 = MatchGpt2;
constexpr Matcher kLlama3 = MatchLlama3Family<3>;
constexpr Matcher kQwen2 = MatchLlama3Family<1>;

constexpr PreTokenizerSpec kPreTokenizers[] = {
    {"default", {MatchPunctuationRun, kGpt2, MatchNumberRun, MatchThreeDigits}, false, false},
    {"gpt-2", {kGpt2}, false, false},
    {"phi-2", {kGpt2}, false, false},
    {"mpt", {kGpt2}, false, false},
    {"olmo", {kGpt2}, false, false},
    {"roberta-bpe", {kGpt2}, false, false},
    {"starcoder", {MatchOneNumber, kGpt2}, false, false},
    {"refact", {MatchOneNumber, kGpt2}, false, false},
    {"command-r", {MatchOneNumber, kGpt2}, false, false},
    {"smollm", {MatchOneNumber, kGpt2}, false, false},
    {"falcon", {MatchPunctuationRunWithBacktick, kGpt2, MatchThreeDigits}, false, false},
    {"qwen2", {kQwen2}, false, false},
    {"deepseek-r1-qwen", {kQwen2}, false, false},
    {"stablelm2", {kQwen2}, false, false},
    {"llama-bpe", {kLlama3}, true, true},
    {"llama3", {kLlama3}, true, true},
    {"llama-v3", {kLlama3}, true, true},
    {"dbrx", {kLlama3}, false, false},
    {"smaug-bpe", {kLlama3}, false, false},
    {"deepseek-llm",
     {MatchNewline, MatchDeepseekLetters, MatchDeepseekPunctuation, MatchTrailingSpace,
      MatchDeepseekCjk, MatchNumberRun},
     false, false},
    {"deepseek-coder",
     {MatchNewline, MatchSpaceLetters, MatchSpacePunctuation, MatchDeepseekCjk, MatchOneNumber},
     false, false},
};

const PreTokenizerSpec* FindPreTokenizer(std::string_view name) {
  for (const PreTokenizerSpec& spec : kPreTokenizers) {
    if (spec.name == name) return &spec;
  }
  return nullptr;
}

std::string PreTokenizerNames() {
  std::string names;
  for (const PreTokenizerSpec& spec : kPreTokenizers) {
    absl::StrAppend(&names, names.empty() ? "" : ", ", ToAbsl(spec.name));
  }
  return names;
}

// The words of `text` (views into it) under `spec`. Their concatenation is
// `text`.
std::vector<std::string_view> PreTokenize(const PreTokenizerSpec& spec, std::string_view text) {
  std::vector<Char> chars;
  chars.reserve(text.size());
  for (size_t offset = 0; offset < text.size();) {
    char32_t cp;
    const int len = DecodeUtf8(text.substr(offset), &cp);
    chars.push_back({cp, UnicodeCategoryOf(cp), IsUnicodeWhitespace(cp), static_cast<uint8_t>(len)});
    offset += static_cast<size_t>(len);
  }
  const size_t n = chars.size();

  // Pieces as [begin, end) character ranges, in order, covering the text.
  std::vector<std::pair<size_t, size_t>> pieces;
  if (n > 0) pieces.emplace_back(0, n);
  std::vector<std::pair<size_t, size_t>> split;
  for (Matcher match : spec.steps) {
    if (match == nullptr) break;
    split.clear();
    for (const auto& [begin, end] : pieces) {
      // The matcher sees the piece as the whole text: chars[0, piece_end).
      const Char* piece = chars.data() + begin;
      const size_t piece_end = end - begin;
      size_t gap = begin;  // start of the text no match has covered yet
      size_t pos = begin;
      while (pos < end) {
        const size_t len = match(piece, pos - begin, piece_end);
        if (len == 0) {
          ++pos;
          continue;
        }
        if (gap < pos) split.emplace_back(gap, pos);
        split.emplace_back(pos, pos + len);
        pos += len;
        gap = pos;
      }
      if (gap < end) split.emplace_back(gap, end);
    }
    pieces.swap(split);
  }

  std::vector<std::string_view> words;
  words.reserve(pieces.size());
  size_t from = 0;  // the pieces cover the text in order
  for (const auto& [begin, end] : pieces) {
    size_t bytes = 0;
    for (size_t i = begin; i < end; ++i) bytes += chars[i].bytes;
    words.push_back(text.substr(from, bytes));
    from += bytes;
  }
  return words;
}

// --- The tokenizer --------------------------------------------------------------

class BpeTokenizer : public Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(const GgufFile& file);

  using Tokenizer::Encode;
  std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                              const TextSpans& special_spans) const override;
  std::string TokenBytes(int32_t prev, int32_t id) const override;

 private:
  BpeTokenizer() = default;

  struct Merge {
    int32_t rank;
    int32_t id;  // the merged token
  };
  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }

  // Appends the ids of one word (raw bytes) to `out`.
  void EncodeWord(std::string_view word, std::vector<int32_t>& out) const;

  const PreTokenizerSpec* pre_ = nullptr;
  // (left id, right id) -> rank and merged id.
  absl::flat_hash_map<uint64_t, Merge> merges_;
  // The token of each byte's symbol (-1 when the vocabulary lacks it).
  std::array<int32_t, 256> byte_token_{};
  int32_t unk_id_ = -1;
};

absl::StatusOr<std::unique_ptr<Tokenizer>> BpeTokenizer::Create(const GgufFile& file) {
  std::unique_ptr<BpeTokenizer> tok(new BpeTokenizer());
  RETURN_IF_ERROR(tok->LoadVocabulary(file));
  const int32_t n_vocab = tok->vocab_size();

  // Without tokenizer.ggml.pre the splits the model was trained with are
  // unknown: llama.cpp then guesses "default" and warns that quality will
  // suffer; ellm refuses rather than serve a guess. (llama.cpp writes the key
  // since May 2024; older Llama-3 and Qwen1.5 files lack it.)
  if (!file.Has("tokenizer.ggml.pre")) {
    return absl::InvalidArgumentError(
        "tokenizer: the GGUF has a BPE vocabulary but no tokenizer.ggml.pre, so how its text is split "
        "before merging is unknown (files converted before May 2024 lack it); convert the model again "
        "with a current llama.cpp");
  }
  absl::StatusOr<std::string> pre = file.GetString("tokenizer.ggml.pre");
  if (!pre.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer: tokenizer.ggml.pre: ", pre.status().message()));
  }
  const std::string pre_name = *std::move(pre);
  tok->pre_ = FindPreTokenizer(pre_name);
  if (tok->pre_ == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer: pre-tokenizer '", pre_name,
                     "' (tokenizer.ggml.pre) is not supported (supported: ", PreTokenizerNames(),
                     ")"));
  }

  ASSIGN_OR_RETURN(tok->bos_id_, ReadTokenId(file, "tokenizer.ggml.bos_token_id", -1, n_vocab));
  ASSIGN_OR_RETURN(tok->eos_id_, ReadTokenId(file, "tokenizer.ggml.eos_token_id", -1, n_vocab));
  ASSIGN_OR_RETURN(tok->unk_id_,
                   ReadTokenId(file, "tokenizer.ggml.unknown_token_id", -1, n_vocab));
  ASSIGN_OR_RETURN(tok->add_bos_,
                   ReadBool(file, "tokenizer.ggml.add_bos_token", tok->pre_->add_bos));

  if (!file.Has("tokenizer.ggml.merges")) {
    return absl::InvalidArgumentError(
        "tokenizer: the GGUF has no tokenizer.ggml.merges (a BPE vocabulary needs them)");
  }
  absl::StatusOr<std::vector<std::string>> merges = file.GetStringArray("tokenizer.ggml.merges");
  if (!merges.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer: tokenizer.ggml.merges: ", merges.status().message()));
  }
  if (merges->size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError("tokenizer: tokenizer.ggml.merges is too large");
  }
  tok->merges_.reserve(merges->size());
  for (size_t rank = 0; rank < merges->size(); ++rank) {
    const std::string& merge = (*merges)[rank];
    // "left right"; a part is never empty, and only the first space after
    // the first byte separates (a symbol is never a space itself).
    const size_t space = merge.size() < 3 ? std::string::npos : merge.find(' ', 1);
    if (space == std::string::npos || space + 1 == merge.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tokenizer: merge %d ('%s') is not two tokens separated by a space", rank, merge));
    }
    const std::string_view left = std::string_view(merge).substr(0, space);
    const std::string_view right = std::string_view(merge).substr(space + 1);
    const int32_t left_id = tok->FindToken(left);
    const int32_t right_id = tok->FindToken(right);
    const int32_t merged_id = tok->FindToken(absl::StrCat(ToAbsl(left), ToAbsl(right)));
    if (left_id < 0 || right_id < 0 || merged_id < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tokenizer: merge %d ('%s') uses or makes a token that is not in the vocabulary", rank,
          merge));
    }
    // A repeated pair keeps its first (best) rank.
    tok->merges_.try_emplace(PairKey(left_id, right_id),
                             Merge{static_cast<int32_t>(rank), merged_id});
  }

  for (int b = 0; b < 256; ++b) {
    std::string symbol;
    AppendUtf8(kByteSymbols[b], symbol);
    tok->byte_token_[b] = tok->FindToken(symbol);
  }

  RETURN_IF_ERROR(tok->LoadEndOfGeneration(file));
  return std::unique_ptr<Tokenizer>(std::move(tok));
}

std::vector<int32_t> BpeTokenizer::Encode(std::string_view text, bool add_bos,
                                          const TextSpans& special_spans) const {
  std::vector<int32_t> out;
  if (add_bos && bos_id_ >= 0) out.push_back(bos_id_);
  for (const Fragment& f : SplitOnSpecialTokens(text, special_spans)) {
    if (f.id >= 0) {
      out.push_back(f.id);
      continue;
    }
    for (std::string_view word : PreTokenize(*pre_, f.text)) EncodeWord(word, out);
  }
  return out;
}

void BpeTokenizer::EncodeWord(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (pre_->ignore_merges) {
    const int32_t id = FindToken(ToByteSymbols(word));
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }

  // The word's symbols as a doubly linked list over its bytes; a symbol that
  // was merged into its left neighbour gets id kGone. Ids stay -1 for bytes
  // whose symbol is not in the vocabulary (they never merge).
  constexpr int32_t kGone = -2;
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  const auto n = static_cast<int32_t>(word.size());
  std::vector<Symbol> symbols(word.size());
  for (int32_t i = 0; i < n; ++i) {
    symbols[i] = {byte_token_[static_cast<unsigned char>(word[i])], i - 1, i + 1};
  }
  symbols.back().next = -1;

  // A merge that was possible when queued; stale once either side changed.
  struct Candidate {
    int32_t rank;
    int32_t left;
    int32_t right;
    int32_t left_id;
    int32_t right_id;
    int32_t merged_id;
  };
  // Lowest rank first, then the leftmost pair.
  auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(later);
  auto try_add = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const int32_t left_id = symbols[left].id;
    const int32_t right_id = symbols[right].id;
    if (left_id < 0 || right_id < 0) return;
    const auto it = merges_.find(PairKey(left_id, right_id));
    if (it == merges_.end()) return;
    queue.push({it->second.rank, left, right, left_id, right_id, it->second.id});
  };
  for (int32_t i = 1; i < n; ++i) try_add(i - 1, i);

  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = symbols[c.left];
    Symbol& right = symbols[c.right];
    if (left.id != c.left_id || right.id != c.right_id || left.next != c.right) continue;
    left.id = c.merged_id;
    left.next = right.next;
    right.id = kGone;
    if (right.next >= 0) symbols[right.next].prev = c.left;
    try_add(left.prev, c.left);
    try_add(c.left, left.next);
  }

  for (int32_t i = 0; i >= 0; i = symbols[i].next) {
    if (symbols[i].id >= 0) {
      out.push_back(symbols[i].id);
    } else if (unk_id_ >= 0) {
      out.push_back(unk_id_);
    }
  }
}

std::string BpeTokenizer::TokenBytes(int32_t /*prev*/, int32_t id) const {
  if (id < 0 || id >= vocab_size()) return "";
  const std::string& text = tokens_[id];
  switch (types_[id]) {
    case TokenType::kControl:
    case TokenType::kUnused:
      return "";
    case TokenType::kUnknown:
    case TokenType::kUserDefined:
      return text;
    case TokenType::kNormal:
    case TokenType::kUndefined:
    case TokenType::kByte:
      break;
  }
  std::string bytes;
  bytes.reserve(text.size());
  const std::string_view view = text;
  for (size_t i = 0; i < view.size();) {
    char32_t cp;
    const int len = DecodeUtf8(view.substr(i), &cp);
    if (cp < kSymbolLimit && kSymbolBytes[cp] >= 0) {
      bytes.push_back(static_cast<char>(kSymbolBytes[cp]));
    } else {
      bytes.append(view.substr(i, static_cast<size_t>(len)));  // not a byte symbol: as it is
    }
    i += static_cast<size_t>(len);
  }
  return bytes;
}

}  // namespace

namespace internal {

absl::StatusOr<std::unique_ptr<Tokenizer>> CreateBpeTokenizer(const GgufFile& file) {
  return BpeTokenizer::Create(file);
}

absl::StatusOr<std::vector<std::string>> BpePreTokenize(std::string_view pre,
                                                        std::string_view text) {
  const PreTokenizerSpec* spec = FindPreTokenizer(pre);
  if (spec == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown pre-tokenizer '", ToAbsl(pre), "'"));
  }
  std::vector<std::string> words;
  for (std::string_view word : PreTokenize(*spec, text)) words.emplace_back(word);
  return words;
}

}  // namespace internal
}  // namespace ellm
