// Tokenizers built from GGUF metadata (tokenizer.ggml.*).
//
// SentencePiece-style ("llama" model): the vocabulary's tokens and scores,
// '▁' (U+2581) for spaces, a space prefix added to the text, byte-fallback
// tokens <0xXX> for bytes no piece covers; greedy merging of adjacent pieces
// by highest score, as llama.cpp's SPM tokenizer does.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

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

  // Text to ids. `add_bos` prepends the BOS id. Special tokens written in the
  // text are not parsed (they are encoded as plain text).
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_bos) const = 0;

  // The bytes a token stands for when it follows `prev` (-1 at the start):
  // '▁' becomes ' ', a byte token its byte, control tokens nothing. For SPM
  // the leading space of the first piece after BOS (or at the start) is dropped.
  virtual std::string TokenBytes(int32_t prev, int32_t id) const = 0;
  // Concatenated TokenBytes of `ids` (may end in an incomplete UTF-8 sequence
  // only if the ids do).
  std::string Decode(const std::vector<int32_t>& ids) const;

  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  bool add_bos() const { return add_bos_; }  // tokenizer.ggml.add_bos_token, default true for SPM
  int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
  const std::string& token(int32_t id) const { return tokens_[id]; }
  TokenType token_type(int32_t id) const { return types_[id]; }
  // True for ids that end generation: EOS and EOT (when the vocab has one).
  bool IsEndOfGeneration(int32_t id) const;

 protected:
  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  int32_t eot_id_ = -1;
  bool add_bos_ = true;
};

// Turns a stream of token ids into text pieces that are always whole UTF-8:
// bytes of an incomplete multi-byte sequence are held back until completed
// (or flushed as U+FFFD by Finish when the stream ends mid-sequence).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  // Text that became complete with `id` (possibly empty).
  std::string Push(int32_t id);
  std::string Finish();

 private:
  const Tokenizer& tokenizer_;
  int32_t prev_ = -1;
  std::string pending_;
};

}  // namespace ellm
