#include "coordinator/service.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/unicode.h"
#include "proto/grpc_status.h"

namespace ellm::coord {
namespace {

constexpr size_t kMaxStopBytes = 256;  // per stop string

ellm::v1::FinishReason ToProto(FinishReason r) {
  switch (r) {
    case FinishReason::kStopToken: return ellm::v1::FINISH_REASON_STOP_TOKEN;
    case FinishReason::kMaxTokens: return ellm::v1::FINISH_REASON_MAX_TOKENS;
    case FinishReason::kStopString: return ellm::v1::FINISH_REASON_STOP_STRING;
    case FinishReason::kContext: return ellm::v1::FINISH_REASON_CONTEXT;
    case FinishReason::kNone: break;
  }
  return ellm::v1::FINISH_REASON_UNSPECIFIED;
}

}  // namespace

WriteWatchdog::WriteWatchdog(absl::Duration limit) : limit_(limit), thread_([this] { Run(); }) {}

WriteWatchdog::~WriteWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  thread_.join();
}

bool WriteWatchdog::Write(grpc::ServerContext* context, grpc::ServerWriter<ellm::v1::GenerateResponse>* writer,
                          const ellm::v1::GenerateResponse& response, bool* stalled) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_[context] = absl::Now() + limit_;
  }
  const bool ok = writer->Write(response);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = writing_.find(context);
  *stalled = it->second == absl::InfiniteFuture();
  writing_.erase(it);
  return ok;
}

void WriteWatchdog::Run() {
  const absl::Duration tick = std::clamp(limit_ / 4, absl::Milliseconds(10), absl::Seconds(1));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_cv_.wait_for(lock, absl::ToChronoMilliseconds(tick), [this] { return stop_; })) {
    const absl::Time now = absl::Now();
    for (auto& [context, deadline] : writing_) {
      if (deadline > now) continue;
      // Under the lock, so `context` is still alive: Write erases its entry
      // under the same lock before the call can end.
      LogWarning("Generate from %s: the client has read nothing for %s; cancelling the request",
                 context->peer(), absl::FormatDuration(limit_));
      context->TryCancel();
      deadline = absl::InfiniteFuture();
    }
  }
}

std::vector<int32_t> EllmService::Encode(std::string_view text, bool add_bos,
                                         const Tokenizer::TextSpans& markup) const {
  if (text.size() < kLargeText) return tokenizer_.Encode(text, add_bos, markup);
  {
    std::unique_lock<std::mutex> lock(encode_mu_);
    encode_cv_.wait(lock, [this] { return large_texts_ < kLargeTextsAtOnce; });
    large_texts_peak_ = std::max(large_texts_peak_, ++large_texts_);
  }
  std::vector<int32_t> ids = tokenizer_.Encode(text, add_bos, markup);
  {
    std::lock_guard<std::mutex> lock(encode_mu_);
    --large_texts_;
  }
  encode_cv_.notify_one();
  return ids;
}

absl::StatusOr<std::vector<int32_t>> EllmService::PromptTokens(
    const std::string& prompt,
    const google::protobuf::RepeatedPtrField<ellm::v1::ChatMessage>& messages,
    const google::protobuf::RepeatedPtrField<std::string>& tools, const std::optional<bool>& add_bos,
    bool enable_thinking) const {
  if (messages.empty()) {
    if (!tools.empty()) return absl::InvalidArgumentError("tools are given but no chat messages");
    if (prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
    if (!IsValidUtf8(prompt)) return absl::InvalidArgumentError("prompt is not valid UTF-8");
    return Encode(prompt, add_bos.value_or(tokenizer_.add_bos()), {});
  }
  if (!prompt.empty()) {
    return absl::InvalidArgumentError("send either a prompt or chat messages, not both");
  }
  std::vector<ChatMessage> chat;
  for (const ellm::v1::ChatMessage& m : messages) {
    if (!IsValidUtf8(m.content())) {
      return absl::InvalidArgumentError("a chat message is not valid UTF-8");
    }
    ChatMessage message{m.role(), m.content()};
    if (m.has_reasoning_content()) {
      if (!IsValidUtf8(m.reasoning_content())) {
        return absl::InvalidArgumentError("a chat message's reasoning_content is not valid UTF-8");
      }
      message.reasoning = m.reasoning_content();
    }
    for (const ellm::v1::ToolCall& call : m.tool_calls()) {
      if (!IsValidUtf8(call.name()) || !IsValidUtf8(call.arguments())) {
        return absl::InvalidArgumentError("a chat message's tool call is not valid UTF-8");
      }
      message.tool_calls.push_back({call.name(), call.arguments()});
    }
    chat.push_back(std::move(message));
  }
  for (const std::string& tool : tools) {
    if (!IsValidUtf8(tool)) return absl::InvalidArgumentError("a tool is not valid UTF-8");
  }
  ASSIGN_OR_RETURN(ChatPrompt rendered,
                   options_.chat.Render(chat, std::vector<std::string>(tools.begin(), tools.end()), enable_thinking));
  // The template writes BOS itself where the model wants one. Special tokens
  // are parsed in its markup only: message contents are plain text.
  return Encode(rendered.text, add_bos.value_or(false), rendered.markup);
}

absl::StatusOr<std::vector<int32_t>> EllmService::GivenTokens(const ellm::v1::GenerateRequest& r) const {
  if (!r.prompt().empty() || !r.messages().empty()) {
    return absl::InvalidArgumentError("send one of a prompt, chat messages or prompt_token_ids");
  }
  if (!r.tools().empty()) return absl::InvalidArgumentError("tools are given but no chat messages");
  if (r.has_add_bos()) {
    return absl::InvalidArgumentError("add_bos applies to text; prompt_token_ids are used as given");
  }
  for (int i = 0; i < r.prompt_token_ids_size(); ++i) {
    const int32_t id = r.prompt_token_ids(i);
    if (id < 0 || id >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_token_ids[", i, "] = ", id,
                                                     " is outside the vocabulary of ", config_.vocab_size,
                                                     " tokens"));
    }
  }
  return std::vector<int32_t>(r.prompt_token_ids().begin(), r.prompt_token_ids().end());
}

absl::StatusOr<GenerateOptions> EllmService::Validate(const ellm::v1::GenerateRequest& r) const {
  GenerateOptions o;
  const absl::Time start = absl::Now();
  if (r.has_enable_thinking() && r.messages().empty()) {
    return absl::InvalidArgumentError("enable_thinking applies to chat messages");
  }
  if (r.prompt_token_ids().empty()) {
    ASSIGN_OR_RETURN(o.prompt, PromptTokens(r.prompt(), r.messages(), r.tools(),
                                            r.has_add_bos() ? std::optional<bool>(r.add_bos())
                                                            : std::nullopt,
                                            !r.has_enable_thinking() || r.enable_thinking()));
  } else {
    ASSIGN_OR_RETURN(o.prompt, GivenTokens(r));
  }
  o.tokenize_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  const int n = static_cast<int>(o.prompt.size());
  const int ctx = config_.context_length;
  if (n >= ctx) {
    return absl::InvalidArgumentError(absl::StrCat("prompt is ", n, " tokens; the context holds ",
                                                   ctx, " (and at least one must be generated)"));
  }
  if (r.has_max_tokens()) {
    if (r.max_tokens() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("max_tokens must be positive, got ", r.max_tokens()));
    }
    if (r.max_tokens() > ctx - n) {
      return absl::InvalidArgumentError(absl::StrCat("max_tokens ", r.max_tokens(), " exceeds the ",
                                                     ctx - n, " positions the context leaves after a ",
                                                     n, "-token prompt"));
    }
    o.max_tokens = r.max_tokens();
  } else {
    o.max_tokens = std::min(options_.default_max_tokens, ctx - n);
  }
  const ellm::v1::SamplingParams& s = r.sampling();
  o.sampling.temperature = s.has_temperature() ? s.temperature() : 1.0f;
  o.sampling.top_k = s.top_k();
  o.sampling.top_p = s.has_top_p() ? s.top_p() : 1.0f;
  o.sampling.min_p = s.min_p();
  o.sampling.top_logprobs = r.top_logprobs();
  o.sampling.presence_penalty = s.presence_penalty();
  o.sampling.frequency_penalty = s.frequency_penalty();
  o.sampling.repetition_penalty = s.has_repetition_penalty() ? s.repetition_penalty() : 1.0f;
  RETURN_IF_ERROR(ValidateSamplingParams(o.sampling, config_.vocab_size));
  if (r.logit_bias_size() > kMaxLogitBias) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit_bias lists ", r.logit_bias_size(), " tokens; at most ", kMaxLogitBias));
  }
  for (const auto& [token, bias] : r.logit_bias()) {
    if (token < 0 || token >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias: token ", token, " is outside the vocabulary of ",
                                                     config_.vocab_size, " tokens"));
    }
    if (!std::isfinite(bias) || bias < -100 || bias > 100) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias: the bias of token ", token, " must be in [-100, 100], got ", bias));
    }
    o.logit_bias.push_back({token, bias});
  }
  std::sort(o.logit_bias.begin(), o.logit_bias.end(),
            [](const TokenBias& a, const TokenBias& b) { return a.token < b.token; });
  // A penalised sequence's token counts go with each of its steps, in frames
  // sized for kMaxPenaltyTokens distinct tokens: its generated ones, and with
  // a repetition penalty its prompt's.
  if (o.sampling.penalised() && config_.vocab_size > kMaxPenaltyTokens) {
    int64_t prompt_tokens = 0;
    if (o.sampling.repetition_penalty != 1) {
      std::vector<int32_t> distinct = o.prompt;
      std::sort(distinct.begin(), distinct.end());
      prompt_tokens = std::unique(distinct.begin(), distinct.end()) - distinct.begin();
    }
    if (prompt_tokens + o.max_tokens > kMaxPenaltyTokens) {
      return absl::InvalidArgumentError(
          prompt_tokens == 0
              ? absl::StrCat("with presence_penalty or frequency_penalty, max_tokens may be at most ",
                             kMaxPenaltyTokens, ", got ", o.max_tokens)
              : absl::StrCat("with repetition_penalty, the prompt's distinct tokens (", prompt_tokens,
                             ") and max_tokens (", o.max_tokens, ") may be at most ", kMaxPenaltyTokens,
                             " together"));
    }
  }
  if (s.has_seed()) {
    o.seed = s.seed();
  } else {
    std::random_device rd;  // 32 bits a call
    o.seed = uint64_t{rd()} << 32 | rd();
  }
  if (r.synthetic_context() < 0) {
    return absl::InvalidArgumentError("synthetic_context must not be negative");
  }
  if (r.synthetic_context() > 0 && !options_.allow_synthetic_context) {
    return absl::InvalidArgumentError(
        "synthetic_context is for benchmarks: this server was not started with --allow-synthetic-context");
  }
  if (r.synthetic_context() > 0) {
    // Bounded like max_tokens, and summed in 64 bits: no term can make it wrap.
    if (r.synthetic_context() >= ctx - n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "synthetic_context ", r.synthetic_context(), " leaves no room in the context of ", ctx,
          " after a ", n, "-token prompt"));
    }
    o.synthetic_context = r.synthetic_context();
    if (int64_t{n} + o.max_tokens + o.synthetic_context > ctx) {
      if (r.has_max_tokens()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "synthetic_context ", o.synthetic_context, " + prompt ", n, " + max_tokens ",
            o.max_tokens, " exceed the context of ", ctx));
      }
      o.max_tokens = ctx - n - o.synthetic_context;
      if (o.max_tokens <= 0) {
        return absl::InvalidArgumentError("synthetic_context leaves no room in the context");
      }
    }
  }
  if (!r.has_max_tokens()) {
    // The default also fits the KV cache: with a small --kv-cache-mb a request
    // that does not say max_tokens gets what room is left, not a refusal that
    // names a field it never set. (A prompt that alone does not fit is refused
    // by the scheduler, which says so.)
    const int64_t kv_positions = options_.model_info.kv_blocks_total() * options_.model_info.kv_block_tokens();
    const int64_t room = kv_positions - n - o.synthetic_context;
    if (room > 0 && room < o.max_tokens) o.max_tokens = static_cast<int>(room);
  }
  if (r.stop_size() > 16) return absl::InvalidArgumentError("at most 16 stop strings");
  for (const std::string& stop : r.stop()) {
    if (stop.empty()) return absl::InvalidArgumentError("a stop string is empty");
    if (!IsValidUtf8(stop)) return absl::InvalidArgumentError("a stop string is not valid UTF-8");
    // The search for stop strings runs on the step thread, and its cost per
    // token grows with the square of the longest one.
    if (stop.size() > kMaxStopBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("a stop string has ", stop.size(), " bytes; at most ", kMaxStopBytes));
    }
    o.stop.push_back(stop);
  }
  if (r.stop_token_ids_size() > kMaxStopTokenIds) {
    return absl::InvalidArgumentError(
        absl::StrCat("stop_token_ids lists ", r.stop_token_ids_size(), " tokens; at most ", kMaxStopTokenIds));
  }
  for (int32_t id : r.stop_token_ids()) {
    if (id < 0 || id >= config_.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop_token_ids: token ", id, " is outside the vocabulary of ", config_.vocab_size, " tokens"));
    }
    o.stop_token_ids.push_back(id);
  }
  std::sort(o.stop_token_ids.begin(), o.stop_token_ids.end());
  o.stop_token_ids.erase(std::unique(o.stop_token_ids.begin(), o.stop_token_ids.end()), o.stop_token_ids.end());
  o.ignore_eos = r.ignore_eos();
  o.include_stop_str_in_output = r.include_stop_str_in_output();
  if (r.min_tokens() < 0 || r.min_tokens() > o.max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_tokens must be in [0, max_tokens = ", o.max_tokens,
                     r.has_max_tokens() ? "" : " (not given: --default-max-tokens or the room left)", "], got ",
                     r.min_tokens()));
  }
  o.min_tokens = r.min_tokens();
  if (r.prompt_logprobs() && o.synthetic_context > 0) {
    return absl::InvalidArgumentError("prompt_logprobs scores a prompt, not a synthetic context");
  }
  o.prompt_logprobs = r.prompt_logprobs();
  return o;
}

grpc::Status EllmService::Generate(grpc::ServerContext* context,
                                   const ellm::v1::GenerateRequest* request,
                                   grpc::ServerWriter<ellm::v1::GenerateResponse>* writer) {
  if (grpc::Status denied = options_.api_key.Check(context, "Generate"); !denied.ok()) return denied;
  ++generating_;
  const absl::Cleanup returned = [this] { --generating_; };
  absl::StatusOr<GenerateOptions> options = Validate(*request);
  const std::string source = absl::StrCat("gRPC ", context->peer());
  if (!options.ok()) {
    scheduler_->Refused(options.status(), source);
    return ToGrpcStatus(options.status());
  }
  options->source = source;
  absl::StatusOr<std::shared_ptr<RequestStream>> stream = scheduler_->Submit(*std::move(options));  // logs a refusal
  if (!stream.ok()) return ToGrpcStatus(stream.status());
  for (;;) {
    if (context->IsCancelled()) {
      (*stream)->Cancel();
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
    }
    std::optional<StreamEvent> e = (*stream)->Pop(absl::Milliseconds(50));
    if (!e.has_value()) continue;
    if (!e->error.ok()) return ToGrpcStatus(e->error);
    ellm::v1::GenerateResponse resp;
    resp.set_text(e->text);
    for (int32_t id : e->token_ids) resp.add_token_ids(id);
    for (float lp : e->logprobs) resp.add_logprobs(lp);
    // Each position's alternatives as a TopLogprobs message.
    const auto add_top = [](const std::vector<std::vector<TokenLogprob>>& tops,
                            google::protobuf::RepeatedPtrField<ellm::v1::TopLogprobs>* out) {
      for (const std::vector<TokenLogprob>& top : tops) {
        ellm::v1::TopLogprobs* t = out->Add();
        for (const TokenLogprob& a : top) {
          t->add_token_ids(a.token);
          t->add_logprobs(a.logprob);
        }
      }
    };
    add_top(e->top_logprobs, resp.mutable_top_logprobs());
    for (float lp : e->prompt_logprobs) resp.add_prompt_logprobs(lp);
    if (request->top_logprobs() > 0) add_top(e->prompt_top_logprobs, resp.mutable_prompt_top_logprobs());
    if (e->finished) {
      ellm::v1::Finish* f = resp.mutable_finish();
      f->set_reason(ToProto(e->finish.reason));
      f->set_prompt_tokens(e->finish.prompt_tokens);
      f->set_completion_tokens(e->finish.completion_tokens);
      f->set_time_to_first_token_ms(e->finish.time_to_first_token_ms);
      f->set_decode_ms_per_token(e->finish.decode_ms_per_token);
      f->set_queue_ms(e->finish.queue_ms);
      f->set_cached_tokens(e->finish.cached_tokens);
    }
    if (!e->finished && resp.text().empty() && resp.token_ids_size() == 0) continue;
    bool stalled = false;
    if (!watchdog_.Write(context, writer, resp, &stalled)) {
      (*stream)->Cancel();
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          stalled ? "the client stopped reading" : "the client went away");
    }
    if (e->finished) return grpc::Status::OK;
  }
}

grpc::Status EllmService::Tokenize(grpc::ServerContext* context, const ellm::v1::TokenizeRequest* request,
                                   ellm::v1::TokenizeResponse* response) {
  if (grpc::Status denied = options_.api_key.Check(context, "Tokenize"); !denied.ok()) return denied;
  if (!IsValidUtf8(request->text())) {
    return ToGrpcStatus(absl::InvalidArgumentError("the text is not valid UTF-8"));
  }
  if (!request->text().empty() && !request->messages().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError("send either text or chat messages, not both"));
  }
  if (request->messages().empty() && !request->tools().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError("tools are given but no chat messages"));
  }
  if (request->messages().empty() && request->has_enable_thinking()) {
    return ToGrpcStatus(absl::InvalidArgumentError("enable_thinking applies to chat messages"));
  }
  absl::StatusOr<std::vector<int32_t>> ids =
      request->messages().empty()
          ? absl::StatusOr<std::vector<int32_t>>(Encode(
                request->text(), request->has_add_bos() ? request->add_bos() : tokenizer_.add_bos(), {}))
          : PromptTokens("", request->messages(), request->tools(),
                         request->has_add_bos() ? std::optional<bool>(request->add_bos()) : std::nullopt,
                         !request->has_enable_thinking() || request->enable_thinking());
  if (!ids.ok()) return ToGrpcStatus(ids.status());
  int32_t prev = -1;
  for (int32_t id : *ids) {
    response->add_token_ids(id);
    std::string piece = tokenizer_.TokenBytes(prev, id);
    // Control tokens print nothing in generated text; here they show as themselves.
    if (piece.empty() && tokenizer_.token_type(id) == TokenType::kControl) piece = tokenizer_.token(id);
    response->add_pieces(piece);
    prev = id;
  }
  return grpc::Status::OK;
}

grpc::Status EllmService::GetModelInfo(grpc::ServerContext* context, const ellm::v1::GetModelInfoRequest*,
                                       ellm::v1::ModelInfo* response) {
  if (grpc::Status denied = options_.api_key.Check(context, "GetModelInfo"); !denied.ok()) return denied;
  *response = options_.model_info;
  const SchedulerStats st = scheduler_->Stats();
  response->set_kv_blocks_free(st.kv_blocks_free);
  response->set_kv_blocks_cached(st.kv_blocks_cached);
  response->set_prefix_cache_hits(st.prefix_hits);
  response->set_prefix_cache_misses(st.prefix_misses);
  response->set_prefix_cached_tokens(st.cached_tokens);
  response->set_running(st.running);
  response->set_waiting(st.waiting);
  response->set_kv_store_blocks(st.stored_blocks);
  response->set_kv_store_loaded(st.stored_loaded);
  if (options_.worker_info) {
    for (const ellm::v1::WorkerInfo& w : options_.worker_info()) {
      if (w.role() == ellm::v1::WORKER_ROLE_ATTN) {
        response->set_attn_busy_seconds(std::max(response->attn_busy_seconds(), w.busy_seconds()));
      } else {
        response->set_mlp_busy_seconds(w.busy_seconds());
      }
    }
  }
  return grpc::Status::OK;
}

}  // namespace ellm::coord
