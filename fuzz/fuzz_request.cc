// libFuzzer harness: request validation of the public API (Generate's
// EllmService::Validate and the prompt tokenization it does) on arbitrary
// protobuf bytes, against stories260K's config, tokenizer and a ChatML
// template. Every input must give a status; accepted requests must fit the
// context.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "coordinator/service.h"
#include "core/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  struct Fixture {
    std::unique_ptr<ellm::GgufFile> file;
    ellm::ModelConfig config;
    std::unique_ptr<ellm::Tokenizer> tokenizer;
    ellm::coord::ServiceOptions options;
    std::unique_ptr<ellm::coord::EllmService> service;
  };
  static Fixture* f = [] {
    auto* x = new Fixture;
    auto file = ellm::GgufFile::Open(std::string(ELLM_MODELS_DIR) + "/stories260K.gguf");
    if (!file.ok()) std::abort();
    x->file = *std::move(file);
    x->config = *ellm::ModelConfig::FromGguf(*x->file);
    x->tokenizer = *ellm::Tokenizer::FromGguf(*x->file);
    x->options.chat = ellm::coord::ChatTemplate::FromGgufTemplate("<|im_start|>");
    x->options.allow_synthetic_context = true;  // its sizes are what this fuzzes most
    x->service = std::make_unique<ellm::coord::EllmService>(x->options, x->config, *x->tokenizer, nullptr);
    return x;
  }();
  ellm::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto options = f->service->Validate(request);
  if (!options.ok()) return 0;
  const int64_t total = static_cast<int64_t>(options->prompt.size()) + options->max_tokens + options->synthetic_context;
  if (options->prompt.empty() || options->max_tokens <= 0 || total > f->config.context_length) std::abort();
  return 0;
}
