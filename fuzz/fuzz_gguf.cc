// libFuzzer harness: the GGUF reader and everything that reads a model file
// (config, tokenizer, weights) on arbitrary bytes. Every input must give a
// status, never a crash, a hang or an unbounded allocation.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/gguf.h"
#include "core/model_config.h"
#include "core/tokenizer.h"
#include "core/weights.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = ellm::GgufFile::FromBytes(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!file.ok()) return 0;
  (void)(*file)->Fingerprint();
  auto tokenizer = ellm::Tokenizer::FromGguf(**file);
  if (tokenizer.ok()) {
    const std::vector<int32_t> ids = (*tokenizer)->Encode("Hello world <s> \xE2\x96\x81 \xF0\x9F\x98\x8A", true, true);
    (void)(*tokenizer)->Decode(ids);
  }
  auto config = ellm::ModelConfig::FromGguf(**file);
  if (config.ok()) (void)ellm::LoadWeights(**file, *config);
  return 0;
}
