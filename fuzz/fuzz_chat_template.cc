// libFuzzer harness: chat templates on arbitrary messages. The input is a
// template family (first byte) and messages (role byte, content up to a NUL;
// two more "roles": an answer whose content is a tool call's arguments, and
// a tool whose content is its JSON). Each content is also read as an
// answer's tool calls (ParseToolCalls) and written as JSON (PythonJson).
// Checks that a rendered prompt's markup spans are sorted, disjoint and
// inside the text, and tokenizes it as the service does (BPE, special tokens
// parsed in the markup only). test_chat_template checks what the spans keep
// out.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "coordinator/chat_template.h"
#include "coordinator/openai_api.h"
#include "coordinator/python_json.h"
#include "core/tokenizer.h"
#include "fuzz/fuzz_models.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::unique_ptr<ellm::Tokenizer> bpe = LoadFuzzTokenizer("vocab/qwen2.5-vocab-derived.gguf");
  if (size < 1) return 0;
  static const char* kTemplates[] = {"<|im_start|>",
                                     "<|im_start|><think>",
                                     "<|start_header_id|>",
                                     "Cutting Knowledge Date: December 2023 <|start_header_id|> set date_string = \"1 May\"",
                                     "You are Qwen, created by Alibaba Cloud. You are a helpful assistant. <|im_start|> "
                                     "You are provided with function signatures within <tools></tools> XML tags "
                                     "<tool_call> <tool_response>",
                                     "<|im_start|><think> You are provided with function signatures within "
                                     "<tools></tools> XML tags <tool_call> <tool_response>",
                                     "Cutting Knowledge Date: December 2023 <|start_header_id|> set date_string = \"1 May\" "
                                     "Given the following functions, please respond with a JSON for a function call",
                                     "[INST] <<SYS>>",
                                     "[INST]",
                                     "",
                                     "?"};
  const auto tmpl = ellm::coord::ChatTemplate::FromGgufTemplate(kTemplates[data[0] % std::size(kTemplates)]);
  static const char* kRoles[] = {"system", "user", "assistant", "tool"};
  std::vector<ellm::coord::ChatMessage> messages;
  std::vector<std::string> tools;
  size_t i = 1;
  while (i < size && messages.size() < 16) {
    const int kind = data[i++] % 6;
    size_t end = i;
    while (end < size && data[end] != 0) ++end;
    std::string content(reinterpret_cast<const char*>(data + i), end - i);
    i = end + 1;
    // What PythonJson writes, it reads back to the same text (with and
    // without indent).
    for (int indent : {0, 4}) {
      if (const auto once = ellm::coord::PythonJson(content, indent); once.ok()) {
        const auto twice = ellm::coord::PythonJson(*once, indent);
        if (!twice.ok() || *twice != *once) std::abort();
      }
    }
    for (auto syntax : {ellm::coord::ToolCallSyntax::kHermes, ellm::coord::ToolCallSyntax::kLlamaJson}) {
      if (const auto calls = ellm::coord::ParseToolCalls(content, syntax)) {
        for (const auto& call : calls->calls) {
          if (!ellm::coord::PythonJson(call.arguments).ok()) std::abort();  // what it writes reads back
        }
      }
    }
    if (kind == 4) {
      messages.push_back({"assistant", "", {{"f", std::move(content)}}});
    } else if (kind == 5) {
      tools.push_back(std::move(content));
    } else {
      messages.push_back({kRoles[kind], std::move(content)});
    }
  }
  auto prompt = tmpl.Render(messages, tools);
  if (!prompt.ok()) return 0;
  size_t at = 0;
  for (const auto& [b, e] : prompt->markup) {
    if (b < at || e <= b || e > prompt->text.size()) std::abort();
    at = e;
  }
  const std::vector<int32_t> ids = bpe->Encode(prompt->text, false, prompt->markup);
  for (int32_t id : ids) {
    if (id < 0 || id >= bpe->vocab_size()) std::abort();
  }
  return 0;
}
