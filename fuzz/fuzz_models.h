// What the harnesses load from ../shared/models once per process: a
// tokenizer, from a GGUF under ELLM_MODELS_DIR ("stories260K.gguf",
// "vocab/qwen2.5-vocab-derived.gguf", ...). Aborts if it cannot: a harness
// without its tokenizer would fuzz nothing.
#pragma once

#include <cstdlib>
#include <memory>
#include <string>

#include "core/gguf.h"
#include "core/tokenizer.h"

inline std::unique_ptr<ellm::Tokenizer> LoadFuzzTokenizer(const std::string& models_path) {
  auto file = ellm::GgufFile::Open(std::string(ELLM_MODELS_DIR) + "/" + models_path);
  if (!file.ok()) std::abort();
  auto tok = ellm::Tokenizer::FromGguf(**file);
  if (!tok.ok()) std::abort();
  return *std::move(tok);
}
