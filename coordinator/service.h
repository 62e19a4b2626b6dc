// The public gRPC service (ellm.v1.Ellm): request validation, tokenisation,
// and streaming a Scheduler's events to the client. The only place where
// Generate's protobuf types meet the scheduler.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"

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
  // How long one write of a streamed answer may wait for the client to read
  // before the request is cancelled (gRPC; the HTTP front has its own copy).
  absl::Duration client_write_timeout = absl::Seconds(60);
};

// Cancels a gRPC call whose write has waited longer than a limit. The
// synchronous ServerWriter has no deadline of its own: a client that stays
// connected but stops reading fills its flow-control window, and the write
// then waits for ever, holding a server thread and the request's queued
// tokens. One thread checks every writer a few times per limit.
class WriteWatchdog {
 public:
  explicit WriteWatchdog(absl::Duration limit);
  ~WriteWatchdog();
  WriteWatchdog(const WriteWatchdog&) = delete;
  WriteWatchdog& operator=(const WriteWatchdog&) = delete;

  // Writes `response` on `context`'s call. False when the write failed;
  // `*stalled` then says whether this watchdog cancelled it.
  bool Write(grpc::ServerContext* context, grpc::ServerWriter<ellm::v1::GenerateResponse>* writer,
             const ellm::v1::GenerateResponse& response, bool* stalled);
  absl::Duration limit() const { return limit_; }

 private:
  void Run();

  const absl::Duration limit_;
  std::mutex mu_;
  std::condition_variable stop_cv_;
  // Calls in a write, and when it must have gone out; InfiniteFuture once
  // the watchdog has cancelled one.
  absl::flat_hash_map<grpc::ServerContext*, absl::Time> writing_;
  bool stop_ = false;
  std::thread thread_;
};

class EllmService final : public ellm::v1::Ellm::Service {
 public:
  EllmService(const ServiceOptions& options, const ModelConfig& config, const Tokenizer& tokenizer,
              Scheduler* scheduler)
      : options_(options), config_(config), tokenizer_(tokenizer), scheduler_(scheduler),
        watchdog_(options.client_write_timeout) {}

  grpc::Status Generate(grpc::ServerContext* context, const ellm::v1::GenerateRequest* request,
                        grpc::ServerWriter<ellm::v1::GenerateResponse>* writer) override;
  grpc::Status Tokenize(grpc::ServerContext* context, const ellm::v1::TokenizeRequest* request,
                        ellm::v1::TokenizeResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context, const ellm::v1::GetModelInfoRequest* request,
                            ellm::v1::ModelInfo* response) override;

  // Generate calls that have not returned yet.
  int generating() const { return generating_.load(); }

  // The HTTP front's API-key check (the Authorization header's value).
  bool AuthorizeHttp(std::string_view authorization) const { return options_.api_key.Matches(authorization); }
  // The model's chat template (how its answers call tools, among others).
  const ChatTemplate& chat_template() const { return options_.chat; }
  // Turns a request into scheduler options (InvalidArgument on bad input).
  absl::StatusOr<GenerateOptions> Validate(const ellm::v1::GenerateRequest& request) const;
  // The prompt's token ids: the raw prompt, or the chat messages rendered
  // with the model's template and the tools they may call (special tokens
  // parsed in the template's own text only; enable_thinking as
  // ChatTemplate::Render's).
  absl::StatusOr<std::vector<int32_t>> PromptTokens(
      const std::string& prompt,
      const google::protobuf::RepeatedPtrField<ellm::v1::ChatMessage>& messages,
      const google::protobuf::RepeatedPtrField<std::string>& tools, const std::optional<bool>& add_bos,
      bool enable_thinking = true) const;
  // A request's prompt_token_ids, checked against the vocabulary.
  absl::StatusOr<std::vector<int32_t>> GivenTokens(const ellm::v1::GenerateRequest& request) const;

  // Texts of kLargeText bytes or more are tokenized at most kLargeTextsAtOnce
  // at a time, over both fronts: tokenizing takes several times the text's
  // size in memory while it runs (TokenizerBench in tests/test_tokenizer.cc),
  // and gRPC serves every call on a thread of its own. The others wait.
  static constexpr size_t kLargeText = size_t{256} << 10;
  static constexpr int kLargeTextsAtOnce = 2;
  // The most large texts that were being tokenized at once so far.
  int large_texts_peak() const {
    std::lock_guard<std::mutex> lock(encode_mu_);
    return large_texts_peak_;
  }

 private:
  std::vector<int32_t> Encode(std::string_view text, bool add_bos, const Tokenizer::TextSpans& markup) const;

  const ServiceOptions& options_;
  const ModelConfig& config_;
  const Tokenizer& tokenizer_;
  Scheduler* scheduler_;
  WriteWatchdog watchdog_;
  std::atomic<int> generating_{0};
  mutable std::mutex encode_mu_;
  mutable std::condition_variable encode_cv_;
  mutable int large_texts_ = 0;  // being tokenized now
  mutable int large_texts_peak_ = 0;
};

}  // namespace ellm::coord
