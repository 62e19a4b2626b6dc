// The OpenAI-compatible API's request and response shapes, free of any
// transport: a JSON body becomes a GenerateRequest (then validated exactly as
// the gRPC API validates it, by EllmService::Validate), and a request's
// events become OpenAI's JSON objects and Server-Sent-Events chunks.
//
// Supported: POST /v1/completions (prompt: a string or token ids, or a list
// of those: a batch, each prompt with its n choices)
// and /v1/chat/completions (messages with string or text-part content) with
// model, max_tokens / max_completion_tokens, temperature, top_p, top_k,
// min_p, presence_penalty, frequency_penalty, repetition_penalty (vLLM's),
// logit_bias, seed, stop
// (string or list), vLLM's min_tokens, ignore_eos, stop_token_ids and
// include_stop_str_in_output, stream, stream_options.include_usage, logprobs (chat:
// true, with top_logprobs 0..20 alternatives per token; completions: an
// integer 0..20, the number of alternatives, the chosen token always
// included), n (1..kMaxChoices choices, each sampled as its own request
// with seed + i; see OpenAiResponder); completions: echo (the prompt's
// text before each choice's; with logprobs, its tokens are listed first,
// scored: prompt logprobs; with max_tokens 0, the prompt alone); chat: tools with tool_choice auto or none, messages with an
// assistant's tool_calls and the tool role (rendered by the template,
// coordinator/chat_template.h), and an answer's <tool_call>s returned as
// tool_calls (ParseToolCalls); chat_template_kwargs.enable_thinking, a
// message's reasoning_content, and (Qwen3) an answer's thinking block
// returned as reasoning_content (SplitReasoning). Refused with 400 naming
// the field: n out of range, suffix, any field that
// would constrain the output or change its length (response_format other
// than text, tool_choice required or named, functions, function_call other
// than none/auto, best_of > 1, and vLLM's guided_*), and any field of the wrong type. Other fields (user, metadata,
// ...) are ignored. A body nested deeper than kMaxJsonDepth is refused
// before it is parsed. Log-probabilities are of the model's raw distribution
// (temperature 1, before penalties, top-k, min-p and top-p).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "coordinator/chat_template.h"
#include "coordinator/request_stream.h"
#include "core/tokenizer.h"
#include "core/status.h"
#include "proto/ellm.pb.h"

namespace ellm::coord {

constexpr int kMaxJsonDepth = 32;
constexpr int kMaxChoices = 16;  // most choices (n) one request may ask for
constexpr int kMaxPrompts = 64;  // most prompts one completions request may list

struct OpenAiRequest {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;
  int top_logprobs = 0;  // alternatives per token (also in generate)
  int n = 1;             // choices: n sequences of the same prompt
  bool echo = false;     // completions: each choice's text starts with the prompt's
  // echo with max_tokens 0: the prompt alone is returned (generate asks for
  // one token, which is dropped; usage counts none).
  bool prompt_only = false;
  // Chat with tools and tool_choice "auto": the answer's calls (in
  // tool_syntax) are returned as tool_calls.
  bool read_tool_calls = false;
  ToolCallSyntax tool_syntax = ToolCallSyntax::kHermes;  // set by the server from the model's template
  bool one_tool_call = false;  // parallel_tool_calls false: the answer's first call only
  // Chat on a template whose answers think (ChatTemplate::thinks), unless
  // the server was told otherwise: an answer's opening "<think>" block is
  // returned as reasoning_content (SplitReasoning). Set by the server.
  bool read_reasoning = false;
  // The request (with its first prompt, for completions).
  ellm::v1::GenerateRequest generate;
  // Completions with a list of prompts (OpenAI's batch): the second and
  // later ones, each a text (prompt set) or token ids (prompt_token_ids
  // set). Their choices follow the first prompt's: prompt k's choice i has
  // index k n + i.
  std::vector<ellm::v1::GenerateRequest> more_prompts;
  int prompts() const { return 1 + static_cast<int>(more_prompts.size()); }
  // `generate` with prompt k.
  ellm::v1::GenerateRequest GenerateFor(int k) const;
};

// Parses a request body of /v1/completions (chat false) or
// /v1/chat/completions. InvalidArgument naming the field; NotFound for a
// model other than `model_id`.
absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(const std::string& body, bool chat,
                                                 const std::string& model_id);

// "stop" for a stop token or string, "length" for max_tokens or the context.
const char* OpenAiFinishReason(FinishReason reason);

// An answer's calls of tools (ToolCallSyntax): its text (kHermes: before the
// first call), and each call.
struct ToolCallsAnswer {
  std::string content;
  struct Call {
    std::string name;
    std::string arguments;  // JSON text, as Python's json.dumps writes it
  };
  std::vector<Call> calls;
};
// nullopt when the text holds no calls in that syntax, or one that is not
// such an object: the answer is then plain text.
std::optional<ToolCallsAnswer> ParseToolCalls(std::string_view text, ToolCallSyntax syntax);

// An answer that opens with "<think>" (Qwen3's thinking block): the text up
// to the first "</think>" is its reasoning, the rest its content (all of it
// reasoning when "</think>" never comes, as when max_tokens cuts the
// thinking short). Otherwise all content, with no reasoning. Nothing is
// trimmed (as vLLM's reasoning parsers return them). Tool calls are read
// from the content only: a "<tool_call>" the model thinks about is not one.
struct ReasoningAnswer {
  std::optional<std::string> reasoning;
  std::string content;
};
ReasoningAnswer SplitReasoning(std::string_view text);

// One prompt of a request, as OpenAiResponder needs it.
struct ResponderPrompt {
  int32_t last_token = -1;      // its last token: the first answer token reads as after it
  std::vector<int32_t> tokens;  // echo with logprobs: its tokens, listed and scored
};

// Builds the responses of one request: `id` like "cmpl-..." / "chatcmpl-...".
// A request of n choices of each of its prompts has an event stream per
// choice (each its own sequence): prompt k's choice i has index k n + i. The
// events of each are passed with its index, in their order, and the streams
// may interleave. The response carries every choice under its index; its
// usage counts each prompt once (prompt_tokens and cached_tokens as its
// choice 0 found them) and the completion tokens of all.
class OpenAiResponder {
 public:
  // `tokenizer` names each token in logprobs; the first generated token reads
  // as it does after `last_prompt_token`.
  OpenAiResponder(const OpenAiRequest& request, std::string id, std::string model_id, int64_t created,
                  const Tokenizer& tokenizer, std::vector<ResponderPrompt> prompts);
  // One prompt: `prompt` its tokens for echo with logprobs.
  OpenAiResponder(const OpenAiRequest& request, std::string id, std::string model_id, int64_t created,
                  const Tokenizer& tokenizer, int32_t last_prompt_token, std::vector<int32_t> prompt = {})
      : OpenAiResponder(request, std::move(id), std::move(model_id), created, tokenizer,
                        std::vector<ResponderPrompt>{{last_prompt_token, std::move(prompt)}}) {}

  // Streaming: the SSE bytes ("data: {...}\n\n" ...) for one event of a
  // choice, and after the last event of the last choice to finish the usage
  // chunk (when asked) and "data: [DONE]\n\n".
  std::string SseFor(const coord::StreamEvent& event, int choice = 0);
  // Not streaming: folds in an event; Final() is the whole response body,
  // once every choice has finished.
  void Add(const coord::StreamEvent& event, int choice = 0);
  std::string Final();
  // Every choice has had its last event.
  bool finished() const { return finished_ == static_cast<int>(choices_.size()); }

 private:
  // What one choice has sent or gathered so far.
  struct Choice {
    Choice(const Tokenizer& tokenizer, int prompt_index, int32_t last_prompt_token)
        : prompt(prompt_index), prev_token(last_prompt_token), offset_decoder(tokenizer, last_prompt_token) {}
    int prompt;               // its prompt's index
    int32_t prev_token;       // for each token's text in logprobs
    // Completions' text_offset: code points of the text the tokens so far
    // decode to, as the client's string indexes it; a multi-byte character
    // still incomplete is not counted until it completes (its tokens' offsets
    // are where it starts).
    StreamDecoder offset_decoder;
    int64_t text_offset = 0;
    bool sent_role = false;
    bool echoed = false;     // streaming with echo: the prompt's text went out
    std::string held;        // streaming with read_tool_calls: text not shown yet
    bool in_calls = false;   // held is (may be) calls, to the end
    bool shown = false;      // Llama JSON: the answer's first character was not "{"
    // Streaming with read_reasoning: whether the answer opened a thinking
    // block (undecided while its text could still be the start of
    // "<think>"), and text not shown yet (that start, or a tail of the
    // thinking that could begin "</think>").
    enum class Thinking { kUndecided, kIn, kOut } thinking = Thinking::kUndecided;
    std::string think_held;
    // Not streaming: what the request gave.
    std::string text;
    std::vector<int32_t> ids;
    std::vector<float> logprobs;
    std::vector<std::vector<TokenLogprob>> top;
    std::vector<float> prompt_logprobs;  // echo with logprobs: the first event's
    std::vector<std::vector<TokenLogprob>> prompt_top;
    bool finished = false;
    FinishInfo finish;
  };

  nlohmann::ordered_json Chunk(const nlohmann::ordered_json& choice) const;
  // The whole request's usage (once every choice has finished).
  nlohmann::ordered_json Usage() const;
  // OpenAI's tool_calls list of choice `index` (streaming: with each call's index).
  nlohmann::ordered_json ToolCallsJson(const ToolCallsAnswer& answer, int index, bool streaming) const;
  // Streaming with read_tool_calls: the part of `text` that may be shown
  // now. Hermes: from a "<tool_call>" on, the text is held for
  // ParseToolCalls at the end; so is a tail that could begin one. Llama
  // JSON: an answer that starts with "{" is held whole.
  std::string ShowableText(Choice& c, const std::string& text);
  // Streaming with read_reasoning: splits an event's text into what may be
  // shown now as reasoning and as content (SplitReasoning, as the text
  // arrives; `last`: the answer's last event, nothing is held).
  std::pair<std::string, std::string> SplitReasoningDelta(Choice& c, const std::string& text, bool last);
  // The logprobs object of these tokens (advances c's prev_token and text_offset).
  nlohmann::ordered_json LogprobsOf(Choice& c, const std::vector<int32_t>& ids, const std::vector<float>& logprobs,
                            const std::vector<std::vector<TokenLogprob>>& top) const;
  // Completions' logprobs of the prompt's tokens (echo), as LogprobsOf
  // lists an answer's read from the start: the first one null, the others'
  // from the scores.
  nlohmann::ordered_json PromptLogprobsOf(const Choice& c, const std::vector<float>& logprobs,
                                  const std::vector<std::vector<TokenLogprob>>& top) const;
  // OpenAI's finish_reason of a choice ("length" for a prompt-only echo).
  const char* FinishReasonOf(const FinishInfo& finish) const;
  // Folds the end of a choice in (once).
  void Finished(Choice& c, const FinishInfo& finish);

  OpenAiRequest request_;
  const Tokenizer& tokenizer_;
  std::string id_, model_id_;
  int64_t created_;
  std::vector<Choice> choices_;
  int finished_ = 0;  // choices that have had their last event
  std::vector<std::string> echo_;  // echo: each prompt's text (ids decoded)
  std::vector<ResponderPrompt> prompts_;
};

// OpenAI's error body: {"error": {"message", "type", "param", "code"}}, and
// the HTTP status a status maps to (400, 401, 404, 413, 429, 503, 500).
std::string OpenAiErrorBody(const absl::Status& status);
int HttpStatusOf(const absl::Status& status);

}  // namespace ellm::coord
