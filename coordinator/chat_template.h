// Chat prompts: renders a list of messages with the model's chat template.
// ellm recognises the families it supports from the GGUF's
// tokenizer.chat_template (a Jinja program it does not run): ChatML (Qwen2),
// Qwen3 (ChatML with <think> blocks), Llama-2 ([INST] with <<SYS>>) and
// Llama-3 (<|start_header_id|>; 3.1 and later with their dated system
// block). Others (Mistral's [INST] templates among them) are not guessed.
// Tools (OpenAI's function calling) with Qwen2.5's and Qwen3's templates,
// which list them in the system turn and take the answers' <tool_call>s and
// the tools' <tool_response>s, and Llama 3.1's (3.2, 3.3), which lists them
// in the first user turn and takes one JSON call per answer.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/tokenizer.h"

namespace ellm::coord {

// An assistant's call of a tool: its name, and its arguments as a JSON
// object's text.
struct ChatToolCall {
  std::string name;
  std::string arguments;
};

struct ChatMessage {
  std::string role;     // system, user, assistant, tool
  std::string content;
  std::vector<ChatToolCall> tool_calls = {};  // assistant, with a template that takes tools
  // An assistant's thinking, given apart from its content (OpenAI API's
  // reasoning_content, as vLLM returns it). Qwen3's template writes it
  // where it keeps thinking, instead of taking the thinking from a
  // "<think>...</think>" in the content; other templates ignore it.
  std::optional<std::string> reasoning = std::nullopt;
};

enum class ChatFormat { kNone, kChatMl, kQwen3, kLlama2, kLlama3 };

// How a model's answer calls tools, by its chat template:
//   kHermes     Qwen2.5, Qwen3 (vLLM's "hermes" parser): the answer's text up
//               to the first "<tool_call>", then one {"name": ...,
//               "arguments": ...} JSON object per <tool_call>...</tool_call>
//               (the last may be unclosed); text after a call is dropped.
//   kLlamaJson  Llama 3.1 (vLLM's "llama3_json"): an answer that starts with
//               "{" and is JSON objects {"name": ..., "parameters" (or
//               "arguments"): ...}, each followed by a 2-character separator
//               ("; "); it has no text besides.
enum class ToolCallSyntax { kHermes, kLlamaJson };

// A rendered prompt: its text, and the byte ranges of it that the template
// wrote (its markup: "<|im_start|>user\n", "[INST] ", ...), where special
// tokens are parsed. The messages' contents lie outside them and are always
// tokenized as plain text, so a message cannot inject control tokens.
struct ChatPrompt {
  std::string text;
  std::vector<std::pair<size_t, size_t>> markup;  // sorted, disjoint [begin, end)
};

class ChatTemplate {
 public:
  // From the text of tokenizer.chat_template ("" when the model has none).
  static ChatTemplate FromGgufTemplate(const std::string& jinja);

  ChatFormat format() const { return format_; }
  // "chatml", "qwen3", "llama2", "llama3", or what kNone means for chat.
  const char* name() const;
  // Whether the template takes tools (Qwen2.5's, Qwen3's and Llama 3.1's
  // do), and how the model's answers call them.
  bool takes_tools() const { return takes_tools_; }
  ToolCallSyntax tool_syntax() const {
    return format_ == ChatFormat::kLlama3 ? ToolCallSyntax::kLlamaJson : ToolCallSyntax::kHermes;
  }

  // Turns chat off (kNone, with a name() and Render() error that say why)
  // when a special token the markup writes ("<|im_start|>", "<s>", ...) is
  // not one token of `tokenizer`'s vocabulary, or the token that ends a turn
  // ("<|im_end|>", "</s>", "<|eot_id|>") does not end generation: the markup
  // would reach the model as plain text, or answers run on to max_tokens.
  void CheckVocabulary(const Tokenizer& tokenizer);

  // The prompt, ending where the assistant's answer begins; special tokens
  // appear as text in its markup (tokenize with special tokens parsed in
  // ChatPrompt::markup only). Qwen3: earlier answers lose their <think>
  // part, and the answer opens its own thinking block (enable_thinking, the
  // template's default; false: the prompt ends with an empty one, which
  // tells the model not to think). Other templates ignore enable_thinking.
  // InvalidArgument for an unknown template, an unknown
  // role, no messages, tools (each a JSON object's text: OpenAI's
  // {"type": "function", "function": {...}}), tool calls or a tool's answer
  // with a template that does not take them, or a call's arguments that are
  // not a JSON object.
  absl::StatusOr<ChatPrompt> Render(const std::vector<ChatMessage>& messages,
                                    const std::vector<std::string>& tools = {}, bool enable_thinking = true) const;
  // Whether answers may open with a "<think>" block (Qwen3's template):
  // the OpenAI API then returns that block as reasoning_content.
  bool thinks() const { return format_ == ChatFormat::kQwen3; }

 private:
  ChatFormat format_ = ChatFormat::kNone;
  bool has_template_ = false;
  bool takes_tools_ = false;  // Qwen2.5's, Qwen3's or Llama 3.1's tools section
  std::string refused_;  // why CheckVocabulary turned a known format off
  std::string default_system_;  // ChatML: Qwen's templates add one
  bool knowledge_header_ = false;  // Llama 3.1+: the dated system block
  std::string date_string_;        // its "Today Date"
  bool date_from_clock_ = false;   // ... or today's, "%d %b %Y"
};

}  // namespace ellm::coord
