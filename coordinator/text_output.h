// Turns sampled tokens into the text a client sees: streaming detokenisation
// (whole UTF-8 only) and stop strings, holding back any tail that could still
// become a stop string.
#pragma once

#include <string>
#include <vector>

#include "core/tokenizer.h"

namespace ellm::coord {

class TextOutput {
 public:
  // `prev` is the prompt's last token: the first answer token is decoded as
  // its continuation (e.g. SPM keeps its leading space).
  // `include_stop`: the text ends with the stop string that ended it.
  TextOutput(const Tokenizer& tokenizer, std::vector<std::string> stop, int32_t prev = -1,
             bool include_stop = false);
  // Adds a token's text; returns the text now safe to send. Sets *stopped
  // when a stop string appeared (the returned text ends just before it, or
  // with it with include_stop):
  // with `look` only, and then only one that ends in this token's text
  // (min_tokens: stop strings of the tokens before it are not looked for,
  // as vLLM does). Without `look`, a tail that could begin a stop string is
  // still held back.
  std::string Push(int32_t token, bool look, bool* stopped);
  // Text held back at the end of the request (no stop string completed).
  std::string Flush();

 private:
  StreamDecoder decoder_;
  std::vector<std::string> stop_;
  bool include_stop_ = false;
  std::string text_;     // all text so far
  size_t emitted_ = 0;   // bytes of text_ already returned
};

}  // namespace ellm::coord
