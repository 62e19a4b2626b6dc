// stories260K's tokenizer for tests that read tokens without a model:
// loaded once, the test failing (and the process aborting) when it cannot be.
#pragma once

#include <cstdlib>
#include <memory>
#include <string>

#include "core/gguf.h"
#include "core/tokenizer.h"
#include "gtest/gtest.h"

namespace ellm::testing {

inline const Tokenizer& StoriesTokenizer() {
  static const Tokenizer* tokenizer = [] {
    absl::StatusOr<std::unique_ptr<GgufFile>> file =
        GgufFile::Open(std::string(ELLM_MODELS_DIR) + "/stories260K.gguf");
    if (!file.ok()) {
      ADD_FAILURE() << file.status();
      std::abort();
    }
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromGguf(**file);
    if (!tok.ok()) {
      ADD_FAILURE() << tok.status();
      std::abort();
    }
    return tok->release();
  }();
  return *tokenizer;
}

}  // namespace ellm::testing
