// Chat prompts: renders a list of messages with the model's chat template.
// ellm recognises the families it supports from the GGUF's
// tokenizer.chat_template (a Jinja program it does not run): ChatML (Qwen2),
// Llama-2 ([INST]) and Llama-3 (<|start_header_id|>).
#pragma once

#include <string>
#include <vector>

#include "core/status.h"

namespace ellm::coord {

struct ChatMessage {
  std::string role;     // system, user, assistant
  std::string content;
};

enum class ChatFormat { kNone, kChatMl, kLlama2, kLlama3 };

class ChatTemplate {
 public:
  // From the text of tokenizer.chat_template ("" when the model has none).
  static ChatTemplate FromGgufTemplate(const std::string& jinja);

  ChatFormat format() const { return format_; }
  const char* name() const;

  // The prompt text, ending where the assistant's answer begins; special
  // tokens appear as text (tokenise with special tokens parsed).
  // InvalidArgument for an unknown template, an unknown role, no messages,
  // or a conversation that does not end with a user message.
  absl::StatusOr<std::string> Render(const std::vector<ChatMessage>& messages) const;

 private:
  ChatFormat format_ = ChatFormat::kNone;
  bool has_template_ = false;
  std::string default_system_;  // ChatML: Qwen's templates add one
};

}  // namespace ellm::coord
