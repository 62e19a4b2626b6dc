// The public gRPC service (ellm.v1.Ellm): request validation, tokenisation,
// and streaming a Scheduler's events to the client. The only place where
// Generate's protobuf types meet the scheduler.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "coordinator/chat_template.h"
#include "coordinator/scheduler.h"
#include "core/model_config.h"
#include "core/tokenizer.h"
#include "proto/control_secret.h"
#include "proto/ellm.grpc.pb.h"

namespace ellm::coord {

struct ServiceOptions {
  std::string model_path;
  int default_max_tokens = 128;
  ellm::v1::ModelInfo model_info;  // filled by main
  ChatTemplate chat;               // from tokenizer.chat_template
  // Checked on every public call (none: every call passes).
  CallSecret api_key = CallSecret::None(CallSecret::Kind::kApiKey);
  // The workers' current WorkerInfo, for GetModelInfo's busy seconds (unset:
  // none reported).
  std::function<std::vector<ellm::v1::WorkerInfo>()> worker_info;
  // Accept GenerateRequest.synthetic_context (benchmarks). Off by default: a
  // synthetic fill holds the step loop while the workers write it.
  bool allow_synthetic_context = false;
};

class EllmService final : public ellm::v1::Ellm::Service {
 public:
  EllmService(const ServiceOptions& options, const ModelConfig& config, const Tokenizer& tokenizer,
              Scheduler* scheduler)
      : options_(options), config_(config), tokenizer_(tokenizer), scheduler_(scheduler) {}

  grpc::Status Generate(grpc::ServerContext* context, const ellm::v1::GenerateRequest* request,
                        grpc::ServerWriter<ellm::v1::GenerateResponse>* writer) override;
  grpc::Status Tokenize(grpc::ServerContext* context, const ellm::v1::TokenizeRequest* request,
                        ellm::v1::TokenizeResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context, const ellm::v1::GetModelInfoRequest* request,
                            ellm::v1::ModelInfo* response) override;

  // The HTTP front's API-key check (the Authorization header's value).
  bool AuthorizeHttp(std::string_view authorization) const { return options_.api_key.Matches(authorization); }
  // Turns a request into scheduler options (InvalidArgument on bad input).
  absl::StatusOr<GenerateOptions> Validate(const ellm::v1::GenerateRequest& request) const;
  // The prompt's token ids: the raw prompt, or the chat messages rendered
  // with the model's template (special tokens parsed).
  absl::StatusOr<std::vector<int32_t>> PromptTokens(
      const std::string& prompt,
      const google::protobuf::RepeatedPtrField<ellm::v1::ChatMessage>& messages,
      const std::optional<bool>& add_bos) const;
  // A request's prompt_token_ids, checked against the vocabulary.
  absl::StatusOr<std::vector<int32_t>> GivenTokens(const ellm::v1::GenerateRequest& request) const;

 private:
  const ServiceOptions& options_;
  const ModelConfig& config_;
  const Tokenizer& tokenizer_;
  Scheduler* scheduler_;
};

}  // namespace ellm::coord
