// Tokenizers built from GGUF metadata (tokenizer.ggml.*).
//
// SentencePiece-style ("llama" model): the vocabulary's tokens and scores,
// '▁' (U+2581) for spaces, a space prefix added to the text, byte-fallback
// tokens <0xXX> for bytes no piece covers; greedy merging of adjacent pieces
// by highest score, as llama.cpp's SPM tokenizer does.
//
// Byte-level BPE ("gpt2" model, tokenizer_bpe.cc): the text is cut into words
// by the pre-tokenizer that tokenizer.ggml.pre names, each word's bytes become
// GPT-2's printable byte symbols, and adjacent symbols are merged by the rank
// of their pair in tokenizer.ggml.merges (lowest first).
//
// Both: the vocabulary's USER_DEFINED tokens written in the text are always
// matched whole and emitted as their ids; CONTROL (and UNKNOWN) tokens only
// when the caller asks to parse special tokens. Longer tokens match first.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "core/gguf.h"
#include "core/status.h"

namespace ellm {

// GGUF tokenizer.ggml.token_type values.
enum class TokenType : int32_t {
  kUndefined = 0, kNormal = 1, kUnknown = 2, kControl = 3,
  kUserDefined = 4, kUnused = 5, kByte = 6,
};

class Tokenizer {
 public:
  // InvalidArgument for a tokenizer model ellm does not support (the message
  // names it) or inconsistent metadata (scores/types of the wrong length...).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& file);
  virtual ~Tokenizer() = default;

  // Byte ranges [begin, end) of a text, sorted and disjoint.
  using TextSpans = std::vector<std::pair<size_t, size_t>>;

  // Text to ids. `add_bos` prepends the BOS id. Control tokens written in the
  // text are not parsed (they are encoded as plain text); user-defined ones are.
  std::vector<int32_t> Encode(std::string_view text, bool add_bos) const {
    return Encode(text, add_bos, TextSpans());
  }
  // As above; with `parse_special` the vocabulary's control and unknown tokens
  // written in the text (e.g. "<|im_start|>", "<s>") become their ids too.
  std::vector<int32_t> Encode(std::string_view text, bool add_bos, bool parse_special) const {
    return Encode(text, add_bos, parse_special ? TextSpans{{0, text.size()}} : TextSpans());
  }
  // As above, parsing control and unknown tokens only where one lies wholly
  // inside one of `special_spans` (a chat prompt's markup, never a message's
  // content). The text is otherwise cut and encoded exactly as a whole.
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                                      const TextSpans& special_spans) const = 0;

  // The bytes a token stands for when it follows `prev` (-1 at the start):
  // control and unused tokens nothing, user-defined tokens their text. SPM:
  // '▁' becomes ' ', a byte token its byte, and the leading space of the first
  // piece after BOS (or at the start) is dropped. BPE: the byte symbols become
  // their bytes (a token may end inside a UTF-8 sequence).
  virtual std::string TokenBytes(int32_t prev, int32_t id) const = 0;
  // Concatenated TokenBytes of `ids` (may end in an incomplete UTF-8 sequence
  // only if the ids do).
  std::string Decode(const std::vector<int32_t>& ids) const;

  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  // tokenizer.ggml.add_bos_token; default true for SPM and Llama-3 BPE, else false.
  bool add_bos() const { return add_bos_; }
  int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
  const std::string& token(int32_t id) const { return tokens_[id]; }
  TokenType token_type(int32_t id) const { return types_[id]; }
  // True for ids that end generation: EOS, the EOT/EOM ids the metadata
  // names, and control or user-defined tokens with a well-known end-of-turn
  // text (<|im_end|>, <|endoftext|>, <|eot_id|>, <|end|>, <end_of_turn>, ...).
  bool IsEndOfGeneration(int32_t id) const;
  // Those ids, in the order found.
  const std::vector<int32_t>& eog_ids() const { return eog_ids_; }

 protected:
  // A piece of the text to encode: raw text (id -1) or a special token's id.
  struct Fragment {
    std::string_view text;
    int32_t id;
  };

  // Reads tokenizer.ggml.tokens and tokenizer.ggml.token_type (all NORMAL when
  // absent) into tokens_/types_ and builds token_to_id_ and special_tokens_.
  absl::Status LoadVocabulary(const GgufFile& file);
  // Fills eog_ids_ from eos_id_ (set it first), the eot/eom id keys and the
  // well-known end-of-turn texts.
  absl::Status LoadEndOfGeneration(const GgufFile& file);
  // Cuts `text` at special tokens (see the top of this file): user-defined
  // ones anywhere, control and unknown ones inside `special_spans` only.
  std::vector<Fragment> SplitOnSpecialTokens(std::string_view text,
                                             const TextSpans& special_spans) const;
  // The id of the token with exactly this text, -1 if none (a repeated text
  // maps to its last id, as in llama.cpp).
  int32_t FindToken(std::string_view text) const;

  // A token id from metadata `key`: `fallback` when absent, -1 when stored as
  // unset (uint32 max or -1). InvalidArgument when outside [0, n_vocab).
  static absl::StatusOr<int32_t> ReadTokenId(const GgufFile& file, std::string_view key,
                                             int32_t fallback, int32_t n_vocab);
  static absl::StatusOr<bool> ReadBool(const GgufFile& file, std::string_view key, bool fallback);

  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  absl::flat_hash_map<std::string, int32_t> token_to_id_;
  // CONTROL, USER_DEFINED and UNKNOWN tokens with non-empty text, longest first.
  std::vector<int32_t> special_tokens_;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  std::vector<int32_t> eog_ids_;
  bool add_bos_ = true;
};

namespace internal {
// The byte-level BPE tokenizer (tokenizer_bpe.cc); reached through
// Tokenizer::FromGguf for tokenizer.ggml.model == "gpt2".
absl::StatusOr<std::unique_ptr<Tokenizer>> CreateBpeTokenizer(const GgufFile& file);
// The words the BPE pre-tokenizer `pre` (a tokenizer.ggml.pre value) cuts
// `text` into (tests). InvalidArgument for an unknown `pre`.
absl::StatusOr<std::vector<std::string>> BpePreTokenize(std::string_view pre,
                                                        std::string_view text);
}  // namespace internal

// Turns a stream of token ids into text pieces that are always whole UTF-8:
// bytes of an incomplete multi-byte sequence are held back until completed
// (or flushed as U+FFFD by Finish when the stream ends mid-sequence).
class StreamDecoder {
 public:
  // `prev` is the token the stream follows (the prompt's last, for an
  // answer; -1 at the start of a sequence): SPM's leading-space rule drops
  // the space of a sequence's first piece, not of an answer's.
  explicit StreamDecoder(const Tokenizer& tokenizer, int32_t prev = -1)
      : tokenizer_(tokenizer), prev_(prev) {}
  // Text that became complete with `id` (possibly empty). `earlier`, when
  // given, gets how many of its code points belong wholly to earlier tokens
  // (the U+FFFD of a held-back sequence that `id` shows to be invalid):
  // where `id`'s own text starts in it.
  std::string Push(int32_t id, int* earlier = nullptr);
  std::string Finish();

 private:
  const Tokenizer& tokenizer_;
  int32_t prev_ = -1;
  std::string pending_;
};

}  // namespace ellm
