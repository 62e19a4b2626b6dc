#include "core/tokenizer.h"
#include "core/unicode.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <queue>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ellm {
namespace {

// U+2581 LOWER ONE EIGHTH BLOCK, SentencePiece's visible space.
constexpr std::string_view kSpmSpace = "\xE2\x96\x81";

// Whether the '▁' at byte k of s starts a word: it follows another character
// than '▁' (a run of '▁' is one word start, at its first).
bool StartsWord(std::string_view s, size_t k) {
  return k > 0 && !(k >= kSpmSpace.size() && s.substr(k - kSpmSpace.size(), kSpmSpace.size()) == kSpmSpace);
}

// U+FFFD REPLACEMENT CHARACTER.
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
// GGUF writers store "no such token" as uint32 max; some as int32 -1.
constexpr int64_t kUnsetIdU32 = 4294967295LL;

// Bytes in the UTF-8 sequence a lead byte starts, as llama.cpp's SPM splitter
// counts them: a stray continuation byte or an invalid lead counts as one.
size_t Utf8SequenceLength(unsigned char lead) {
  static constexpr uint8_t kByHighNibble[16] = {1, 1, 1, 1, 1, 1, 1, 1,
                                                1, 1, 1, 1, 2, 2, 3, 4};
  return kByHighNibble[lead >> 4];
}

// "<0xAB>" -> 0xAB; -1 for any other text.
int ParseByteToken(std::string_view text) {
  if (text.size() != 6 || text.substr(0, 3) != "<0x" || text[5] != '>') return -1;
  int value = 0;
  for (char c : text.substr(3, 2)) {
    value <<= 4;
    if (c >= '0' && c <= '9') {
      value |= c - '0';
    } else if (c >= 'A' && c <= 'F') {
      value |= c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      value |= c - 'a' + 10;
    } else {
      return -1;
    }
  }
  return value;
}

void ReplaceAll(std::string& s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  size_t last = 0;
  for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, last)) {
    out.append(s, last, pos - last);
    out.append(to);
    last = pos + from.size();
  }
  out.append(s, last, std::string::npos);
  s = std::move(out);
}

// SentencePiece vocabularies (tokenizer.ggml.model == "llama"), encoded the
// way llama.cpp's SPM tokenizer does it:
//  1. text is cut at special tokens (Tokenizer::SplitOnSpecialTokens), which
//     are emitted as they are;
//  2. each remaining fragment gets one '▁' prefix (when add_space_prefix and
//     it starts the text or follows a special token), spaces become '▁';
//  3. the fragment is split into UTF-8 characters, and the adjacent pair whose
//     concatenation is a token with the highest score is merged, again and
//     again (ties: the leftmost pair) until no pair forms a token;
//  4. each final piece is its token; a piece that is not a token (only single
//     characters can be) becomes byte tokens <0xXX>.
class SpmTokenizer : public Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(const GgufFile& file);

  using Tokenizer::Encode;
  std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                              const TextSpans& special_spans) const override;
  std::string TokenBytes(int32_t prev, int32_t id) const override;

 private:
  SpmTokenizer() = default;

  // Appends the ids of one escaped fragment ('▁' for spaces) to `out`.
  void EncodeFragment(std::string_view text, std::vector<int32_t>& out) const;
  // The merges of one piece of a fragment, as if it were the whole fragment.
  void EncodeSegment(std::string_view text, std::vector<int32_t>& out) const;

  std::vector<float> scores_;
  // Id for each byte value: its <0xXX> token, else the one-byte token, else unk
  // (-1 when there is no unk either: the byte is dropped).
  std::array<int32_t, 256> byte_token_{};
  // Byte value of each byte token (<0xXX>), -1 for other tokens.
  std::vector<int16_t> token_byte_;
  int32_t unk_id_ = -1;
  bool add_space_prefix_ = true;
  // No token has a '▁' that starts a word (StartsWord) after its first byte,
  // so no merge can join the text before a word start to the text from it
  // on: a fragment is encoded word by word (the same ids; one heap over a long document
  // costs a log factor more: 4 MB took 2.5 s that way, 0.28 s so; see
  // test_tokenizer TokenizerBench.DISABLED_BenchLongDocuments).
  bool split_at_words_ = false;
};

absl::StatusOr<std::unique_ptr<Tokenizer>> SpmTokenizer::Create(const GgufFile& file) {
  std::unique_ptr<SpmTokenizer> tok(new SpmTokenizer());

  RETURN_IF_ERROR(tok->LoadVocabulary(file));
  const size_t n = tok->tokens_.size();
  const int32_t n_vocab = static_cast<int32_t>(n);

  tok->scores_.assign(n, 0.0f);
  if (file.Has("tokenizer.ggml.scores")) {
    absl::StatusOr<std::vector<double>> scores = file.GetFloatArray("tokenizer.ggml.scores");
    if (!scores.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer: tokenizer.ggml.scores: ", scores.status().message()));
    }
    if (scores->size() != n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tokenizer: tokenizer.ggml.scores has %d entries for %d tokens", scores->size(), n));
    }
    for (size_t i = 0; i < n; ++i) tok->scores_[i] = static_cast<float>((*scores)[i]);
  }

  // SentencePiece defaults, as llama.cpp applies them when the keys are absent.
  ASSIGN_OR_RETURN(tok->bos_id_, ReadTokenId(file, "tokenizer.ggml.bos_token_id", 1, n_vocab));
  ASSIGN_OR_RETURN(tok->eos_id_, ReadTokenId(file, "tokenizer.ggml.eos_token_id", 2, n_vocab));
  ASSIGN_OR_RETURN(tok->unk_id_,
                   ReadTokenId(file, "tokenizer.ggml.unknown_token_id", 0, n_vocab));
  ASSIGN_OR_RETURN(tok->add_bos_, ReadBool(file, "tokenizer.ggml.add_bos_token", true));
  ASSIGN_OR_RETURN(tok->add_space_prefix_,
                   ReadBool(file, "tokenizer.ggml.add_space_prefix", true));

  tok->token_byte_.assign(n, -1);
  for (int32_t id = 0; id < n_vocab; ++id) {
    if (tok->types_[id] == TokenType::kByte) {
      tok->token_byte_[id] = static_cast<int16_t>(ParseByteToken(tok->tokens_[id]));
    }
  }

  for (int b = 0; b < 256; ++b) {
    int32_t id = tok->FindToken(absl::StrFormat("<0x%02X>", b));
    if (id < 0) id = tok->FindToken(std::string(1, static_cast<char>(b)));
    tok->byte_token_[b] = id >= 0 ? id : tok->unk_id_;
  }

  tok->split_at_words_ = std::none_of(tok->tokens_.begin(), tok->tokens_.end(), [](std::string_view t) {
    for (size_t k = t.find(kSpmSpace, 1); k != std::string_view::npos; k = t.find(kSpmSpace, k + 1)) {
      if (StartsWord(t, k)) return true;
    }
    return false;
  });

  RETURN_IF_ERROR(tok->LoadEndOfGeneration(file));
  return std::unique_ptr<Tokenizer>(std::move(tok));
}

std::vector<int32_t> SpmTokenizer::Encode(std::string_view text, bool add_bos,
                                          const TextSpans& special_spans) const {
  std::vector<int32_t> out;
  if (add_bos && bos_id_ >= 0) out.push_back(bos_id_);
  if (text.empty()) return out;

  bool after_special = true;  // the start of the text counts as one
  std::string escaped;
  for (const Fragment& f : SplitOnSpecialTokens(text, special_spans)) {
    if (f.id >= 0) {
      out.push_back(f.id);
      after_special = true;
      continue;
    }
    escaped.clear();
    if (add_space_prefix_ && after_special) escaped.push_back(' ');
    escaped.append(f.text);
    ReplaceAll(escaped, " ", kSpmSpace);
    EncodeFragment(escaped, out);
    after_special = false;
  }
  return out;
}

void SpmTokenizer::EncodeFragment(std::string_view text, std::vector<int32_t>& out) const {
  if (!split_at_words_) return EncodeSegment(text, out);
  size_t begin = 0;
  for (size_t k = text.find(kSpmSpace, 1); k != std::string_view::npos; k = text.find(kSpmSpace, k + 1)) {
    if (!StartsWord(text, k)) continue;
    EncodeSegment(text.substr(begin, k - begin), out);
    begin = k;
  }
  EncodeSegment(text.substr(begin), out);
}

void SpmTokenizer::EncodeSegment(std::string_view text, std::vector<int32_t>& out) const {
  // A piece of `text` in a doubly linked list; merged-away pieces have len 0.
  // Pieces are always contiguous: a piece's bytes end where its next begins.
  struct Piece {
    int prev;
    int next;
    size_t offset;
    size_t len;
  };
  // A pair of adjacent pieces whose concatenation (`len` bytes) is a token.
  struct Candidate {
    float score;
    int left;
    int right;
    size_t len;
  };
  // Highest score first, then the leftmost pair.
  auto lower_priority = [](const Candidate& a, const Candidate& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };

  std::vector<Piece> pieces;
  pieces.reserve(text.size());
  for (size_t offset = 0; offset < text.size();) {
    const size_t len = std::min(text.size() - offset,
                                Utf8SequenceLength(static_cast<unsigned char>(text[offset])));
    const int index = static_cast<int>(pieces.size());
    pieces.push_back({index - 1, index + 1, offset, len});
    offset += len;
  }
  if (pieces.empty()) return;
  pieces.back().next = -1;

  std::priority_queue<Candidate, std::vector<Candidate>, decltype(lower_priority)> queue(
      lower_priority);
  auto try_add = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const size_t len = pieces[left].len + pieces[right].len;
    const int32_t id = FindToken(text.substr(pieces[left].offset, len));
    if (id < 0) return;
    queue.push({scores_[id], left, right, len});
  };
  for (int i = 1; i < static_cast<int>(pieces.size()); ++i) try_add(i - 1, i);

  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Piece& left = pieces[c.left];
    Piece& right = pieces[c.right];
    // Stale: one side was merged into something else since it was queued.
    if (left.len == 0 || right.len == 0 || left.len + right.len != c.len) continue;
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (right.next >= 0) pieces[right.next].prev = c.left;
    try_add(left.prev, c.left);
    try_add(c.left, left.next);
  }

  for (int i = 0; i >= 0; i = pieces[i].next) {
    const std::string_view piece = text.substr(pieces[i].offset, pieces[i].len);
    const int32_t id = FindToken(piece);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    for (char byte : piece) {
      const int32_t byte_id = byte_token_[static_cast<unsigned char>(byte)];
      if (byte_id >= 0) out.push_back(byte_id);
    }
  }
}

std::string SpmTokenizer::TokenBytes(int32_t prev, int32_t id) const {
  if (id < 0 || id >= vocab_size()) return "";
  std::string bytes;
  switch (types_[id]) {
    case TokenType::kControl:
    case TokenType::kUnused:
      return "";
    case TokenType::kByte:
      if (token_byte_[id] >= 0) {
        bytes.push_back(static_cast<char>(token_byte_[id]));
      } else {
        bytes = tokens_[id];
      }
      break;
    case TokenType::kUnknown:
    case TokenType::kUserDefined:
      bytes = tokens_[id];
      break;
    case TokenType::kNormal:
    case TokenType::kUndefined:
      bytes = tokens_[id];
      ReplaceAll(bytes, kSpmSpace, " ");
      break;
  }
  // The encoder put one space in front of the text; take it back off.
  if (add_space_prefix_ && (prev < 0 || prev == bos_id_) && !bytes.empty() && bytes[0] == ' ') {
    bytes.erase(0, 1);
  }
  return bytes;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& file) {
  if (!file.Has("tokenizer.ggml.model")) {
    return absl::InvalidArgumentError(
        "tokenizer: the GGUF has no tokenizer.ggml.model (no tokenizer)");
  }
  absl::StatusOr<std::string> model = file.GetString("tokenizer.ggml.model");
  if (!model.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer: tokenizer.ggml.model: ", model.status().message()));
  }
  // llama.cpp appends EOS to a prompt where this is true (embedding and
  // encoder models set it); ellm's prompts never end with EOS, so such a
  // model would see other prompts than it expects.
  ASSIGN_OR_RETURN(const bool add_eos, ReadBool(file, "tokenizer.ggml.add_eos_token", false));
  if (add_eos) {
    return absl::InvalidArgumentError(
        "tokenizer: tokenizer.ggml.add_eos_token is true (prompts end with EOS), which ellm does not do");
  }
  if (*model == "llama") return SpmTokenizer::Create(file);
  if (*model == "gpt2") return internal::CreateBpeTokenizer(file);
  return absl::InvalidArgumentError(absl::StrCat(
      "tokenizer model '", *model, "' is not supported yet (supported: llama, gpt2)"));
}

absl::StatusOr<int32_t> Tokenizer::ReadTokenId(const GgufFile& file, std::string_view key,
                                               int32_t fallback, int32_t n_vocab) {
  if (!file.Has(key)) return fallback < n_vocab ? fallback : -1;
  absl::StatusOr<int64_t> value = file.GetInt(key);
  if (!value.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer: ", ToAbsl(key), ": ", value.status().message()));
  }
  if (*value == -1 || *value == kUnsetIdU32) return -1;
  if (*value < 0 || *value >= n_vocab) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tokenizer: %s = %d is outside the vocabulary of %d tokens", ToAbsl(key), *value, n_vocab));
  }
  return static_cast<int32_t>(*value);
}

absl::StatusOr<bool> Tokenizer::ReadBool(const GgufFile& file, std::string_view key,
                                         bool fallback) {
  if (!file.Has(key)) return fallback;
  absl::StatusOr<bool> value = file.GetBool(key);
  if (!value.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer: ", ToAbsl(key), ": ", value.status().message()));
  }
  return *value;
}

absl::Status Tokenizer::LoadVocabulary(const GgufFile& file) {
  if (!file.Has("tokenizer.ggml.tokens")) {
    return absl::InvalidArgumentError(
        "tokenizer: the GGUF has no tokenizer.ggml.tokens (no vocabulary)");
  }
  absl::StatusOr<std::vector<std::string>> tokens = file.GetStringArray("tokenizer.ggml.tokens");
  if (!tokens.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer: tokenizer.ggml.tokens: ", tokens.status().message()));
  }
  if (tokens->empty()) {
    return absl::InvalidArgumentError("tokenizer: tokenizer.ggml.tokens is empty");
  }
  if (tokens->size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError("tokenizer: tokenizer.ggml.tokens is too large");
  }
  tokens_ = *std::move(tokens);
  const size_t n = tokens_.size();

  types_.assign(n, TokenType::kNormal);
  if (file.Has("tokenizer.ggml.token_type")) {
    absl::StatusOr<std::vector<int64_t>> types = file.GetIntArray("tokenizer.ggml.token_type");
    if (!types.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer: tokenizer.ggml.token_type: ", types.status().message()));
    }
    if (types->size() != n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tokenizer: tokenizer.ggml.token_type has %d entries for %d tokens", types->size(), n));
    }
    for (size_t i = 0; i < n; ++i) {
      const int64_t t = (*types)[i];
      if (t < static_cast<int64_t>(TokenType::kUndefined) ||
          t > static_cast<int64_t>(TokenType::kByte)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "tokenizer: token %d ('%s') has unknown token type %d", i, tokens_[i], t));
      }
      types_[i] = static_cast<TokenType>(t);
    }
  }

  token_to_id_.reserve(n);
  special_tokens_.clear();
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<int32_t>(i);
    token_to_id_.insert_or_assign(tokens_[i], id);
    const TokenType type = types_[i];
    if ((type == TokenType::kControl || type == TokenType::kUserDefined ||
         type == TokenType::kUnknown) &&
        !tokens_[i].empty()) {
      special_tokens_.push_back(id);
    }
  }
  std::stable_sort(special_tokens_.begin(), special_tokens_.end(), [&](int32_t a, int32_t b) {
    return tokens_[a].size() > tokens_[b].size();
  });
  return absl::OkStatus();
}

absl::Status Tokenizer::LoadEndOfGeneration(const GgufFile& file) {
  const int32_t n_vocab = vocab_size();
  eog_ids_.clear();
  auto add = [&](int32_t id) {
    if (id >= 0 && std::find(eog_ids_.begin(), eog_ids_.end(), id) == eog_ids_.end()) {
      eog_ids_.push_back(id);
    }
  };
  add(eos_id_);
  ASSIGN_OR_RETURN(const int32_t eot,
                   ReadTokenId(file, "tokenizer.ggml.eot_token_id", -1, n_vocab));
  add(eot);
  ASSIGN_OR_RETURN(const int32_t eom,
                   ReadTokenId(file, "tokenizer.ggml.eom_token_id", -1, n_vocab));
  add(eom);
  // Chat vocabularies mark the end of a turn with one of these; the metadata
  // often names only the end of the document (or only the end of the turn).
  for (std::string_view text :
       {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
        "<|end_of_text|>", "<EOT>",
        // DeepSeek's <｜end▁of▁sentence｜> (fullwidth bars, '▁' for spaces).
        "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>"}) {
    const int32_t id = FindToken(text);
    if (id >= 0 &&
        (types_[id] == TokenType::kControl || types_[id] == TokenType::kUserDefined)) {
      add(id);
    }
  }
  return absl::OkStatus();
}

std::vector<Tokenizer::Fragment> Tokenizer::SplitOnSpecialTokens(
    std::string_view text, const TextSpans& special_spans) const {
  std::vector<Fragment> fragments;
  if (text.empty()) return fragments;
  fragments.push_back({text, -1});
  // Whether [begin, end) of `text` lies inside one special span: the last
  // span that starts at or before `begin` (the spans are sorted and
  // disjoint), found by bisection so that a chat of many messages whose text
  // repeats a control token costs no more than one with few.
  auto in_span = [&](size_t begin, size_t end) {
    auto it = std::upper_bound(special_spans.begin(), special_spans.end(), begin,
                               [](size_t v, const std::pair<size_t, size_t>& span) { return v < span.first; });
    return it != special_spans.begin() && end <= std::prev(it)->second;
  };
  std::vector<Fragment> split;
  for (const int32_t id : special_tokens_) {
    const bool anywhere = types_[id] == TokenType::kUserDefined;
    if (!anywhere && special_spans.empty()) continue;
    const std::string& piece = tokens_[id];
    split.clear();
    bool found = false;
    for (const Fragment& f : fragments) {
      if (f.id >= 0 || f.text.size() < piece.size()) {
        split.push_back(f);
        continue;
      }
      const size_t base = static_cast<size_t>(f.text.data() - text.data());
      size_t start = 0;
      for (size_t pos = f.text.find(piece); pos != std::string_view::npos;
           pos = f.text.find(piece, pos + 1)) {
        if (pos < start) continue;
        if (!anywhere && !in_span(base + pos, base + pos + piece.size())) continue;
        found = true;
        if (pos > start) split.push_back({f.text.substr(start, pos - start), -1});
        split.push_back({f.text.substr(pos, piece.size()), id});
        start = pos + piece.size();
      }
      if (start < f.text.size()) split.push_back({f.text.substr(start), -1});
    }
    if (found) fragments.swap(split);
  }
  return fragments;
}

int32_t Tokenizer::FindToken(std::string_view text) const {
  auto it = token_to_id_.find(ToAbsl(text));
  return it == token_to_id_.end() ? -1 : it->second;
}

std::string Tokenizer::Decode(const std::vector<int32_t>& ids) const {
  std::string text;
  int32_t prev = -1;
  for (int32_t id : ids) {
    text += TokenBytes(prev, id);
    prev = id;
  }
  return text;
}

bool Tokenizer::IsEndOfGeneration(int32_t id) const {
  return id >= 0 && std::find(eog_ids_.begin(), eog_ids_.end(), id) != eog_ids_.end();
}

std::string StreamDecoder::Push(int32_t id, int* earlier) {
  const size_t held = pending_.size();  // bytes of earlier tokens
  pending_ += tokenizer_.TokenBytes(prev_, id);
  prev_ = id;
  std::string out;
  size_t i = 0;
  if (earlier != nullptr) *earlier = 0;
  while (i < pending_.size()) {
    const int n = ScanUtf8(std::string_view(pending_).substr(i));
    if (n == 0) break;  // hold back until the next token completes it
    if (n > 0) {
      out.append(pending_, i, n);
      i += n;
    } else {
      out.append(kReplacement);
      i += -n;
      // (A held sequence is incomplete, never whole: only invalid ones end in it.)
      if (earlier != nullptr && i <= held) ++*earlier;
    }
  }
  pending_.erase(0, i);
  return out;
}

std::string StreamDecoder::Finish() {
  std::string out = pending_.empty() ? "" : std::string(kReplacement);
  pending_.clear();
  prev_ = -1;
  return out;
}

}  // namespace ellm
