// libFuzzer harness: the OpenAI API without a server. The first byte picks
// /v1/completions or /v1/chat/completions and the tool-call syntax; the rest
// is the request body (ParseOpenAiRequest). The body's text is then played
// back as a generated answer, in three events, to each of the request's n
// choices (their events interleaved), through OpenAiResponder, both streamed
// and not, with tool calls read (chat) and, when the first byte says so,
// thinking read as reasoning_content: every response body and SSE chunk
// must be valid JSON, each streamed choice that is not calls must give back
// the text whole (its reasoning and content as SplitReasoning splits the
// whole text), and one [DONE] must end the stream.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "coordinator/openai_api.h"
#include "core/tokenizer.h"
#include "core/unicode.h"
#include "fuzz/fuzz_models.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::unique_ptr<ellm::Tokenizer> tok = LoadFuzzTokenizer("stories260K.gguf");
  if (size < 1) return 0;
  const bool chat = data[0] & 1;
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  absl::StatusOr<ellm::coord::OpenAiRequest> parsed = ellm::coord::ParseOpenAiRequest(body, chat, "m");
  ellm::coord::OpenAiRequest request;
  if (parsed.ok()) request = *std::move(parsed);
  request.chat = chat;
  request.read_tool_calls = chat;  // (tools are refused in completions)
  request.read_reasoning = chat && (data[0] & 4);
  request.logprobs = false;
  request.tool_syntax = data[0] & 2 ? ellm::coord::ToolCallSyntax::kLlamaJson : ellm::coord::ToolCallSyntax::kHermes;
  // Generated text is whole UTF-8: play the body back only when it is.
  if (!ellm::IsValidUtf8(body)) return 0;
  // Events carry whole UTF-8: split at character starts.
  auto start_of_char = [&body](size_t i) {
    while (i > 0 && i < body.size() && (static_cast<unsigned char>(body[i]) & 0xC0) == 0x80) --i;
    return i;
  };
  const size_t a = start_of_char(body.size() / 3), b = std::max(a, start_of_char(2 * body.size() / 3));
  const std::string parts[3] = {body.substr(0, a), body.substr(a, b - a), body.substr(b)};
  for (bool streaming : {false, true}) {
    request.stream = streaming;
    ellm::coord::OpenAiResponder responder(request, "chatcmpl-f", "m", 0, *tok, 1);
    const int n = std::max(1, request.n);
    std::string sse;
    for (int i = 0; i < 3; ++i) {
      for (int choice = 0; choice < n; ++choice) {
        ellm::coord::StreamEvent e;
        e.text = parts[i];
        e.finished = i == 2;
        e.finish.reason = ellm::coord::FinishReason::kStopToken;
        if (streaming) {
          sse += responder.SseFor(e, choice);
        } else {
          responder.Add(e, choice);
        }
      }
    }
    if (!responder.finished()) std::abort();
    if (!streaming) {
      if (nlohmann::json::parse(responder.Final(), nullptr, false).is_discarded()) std::abort();
      continue;
    }
    std::vector<std::string> content(static_cast<size_t>(n)), reasoning(static_cast<size_t>(n));
    std::vector<bool> calls(static_cast<size_t>(n));
    if (sse.size() < 14 || sse.compare(sse.size() - 14, 14, "data: [DONE]\n\n") != 0) std::abort();
    // Events: "data: ...\n\n" (JSON text holds no raw new line).
    for (size_t at = 0; at < sse.size();) {
      const size_t end = sse.find("\n\n", at);
      if (end == std::string::npos || sse.compare(at, 6, "data: ") != 0) std::abort();
      const std::string event = sse.substr(at + 6, end - at - 6);
      at = end + 2;
      if (event == "[DONE]") {
        if (at != sse.size()) std::abort();
        continue;
      }
      const nlohmann::json j = nlohmann::json::parse(event, nullptr, false);
      if (j.is_discarded()) std::abort();
      if (j["choices"].empty()) continue;  // the usage chunk
      const nlohmann::json& c = j["choices"][0];
      const int index = c["index"].get<int>();
      if (index < 0 || index >= n) std::abort();
      if (!chat) {
        content[index] += c["text"].get<std::string>();
        continue;
      }
      if (c["delta"].contains("content")) content[index] += c["delta"]["content"].get<std::string>();
      if (c["delta"].contains("reasoning_content")) {
        if (!request.read_reasoning) std::abort();
        reasoning[index] += c["delta"]["reasoning_content"].get<std::string>();
      }
      if (c["delta"].contains("tool_calls")) calls[index] = true;
    }
    const ellm::coord::ReasoningAnswer split =
        request.read_reasoning ? ellm::coord::SplitReasoning(body) : ellm::coord::ReasoningAnswer{{}, body};
    // echo (completions): the prompt's text comes first, as the client reads
    // it (bytes that are not UTF-8 as U+FFFD); with max_tokens 0 it alone.
    const auto& ids = request.generate.prompt_token_ids();
    std::string echo = !request.echo ? ""
                       : ids.empty() ? request.generate.prompt()
                                     : tok->Decode(std::vector<int32_t>(ids.begin(), ids.end()));
    if (!ellm::IsValidUtf8(echo)) {
      echo = nlohmann::json::parse(nlohmann::json(echo).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace))
                 .get<std::string>();
    }
    for (int i = 0; i < n; ++i) {
      if (reasoning[i] != split.reasoning.value_or("")) std::abort();
      if (!calls[i] && content[i] != echo + (request.prompt_only ? std::string() : split.content)) std::abort();
    }
  }
  return 0;
}
