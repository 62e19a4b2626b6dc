#include "coordinator/chat_template.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace ellm::coord {

ChatTemplate ChatTemplate::FromGgufTemplate(const std::string& jinja) {
  ChatTemplate t;
  t.has_template_ = !jinja.empty();
  if (jinja.find("<|im_start|>") != std::string::npos) {
    t.format_ = ChatFormat::kChatMl;
    // Qwen2.5 and Qwen2 templates insert a system message when none is given.
    for (const char* system : {"You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
                               "You are a helpful assistant."}) {
      if (jinja.find(system) != std::string::npos) {
        t.default_system_ = system;
        break;
      }
    }
  } else if (jinja.find("<|start_header_id|>") != std::string::npos) {
    t.format_ = ChatFormat::kLlama3;
  } else if (jinja.find("[INST]") != std::string::npos) {
    t.format_ = ChatFormat::kLlama2;
  }
  return t;
}

const char* ChatTemplate::name() const {
  switch (format_) {
    case ChatFormat::kChatMl: return "chatml";
    case ChatFormat::kLlama2: return "llama2";
    case ChatFormat::kLlama3: return "llama3";
    case ChatFormat::kNone: break;
  }
  return "none";
}

absl::StatusOr<std::string> ChatTemplate::Render(const std::vector<ChatMessage>& messages) const {
  if (format_ == ChatFormat::kNone) {
    return absl::InvalidArgumentError(
        has_template_ ? "the model's chat template is not one ellm knows (ChatML, Llama-2, "
                        "Llama-3); send a raw prompt instead"
                      : "the model has no chat template; send a raw prompt instead");
  }
  if (messages.empty()) return absl::InvalidArgumentError("no chat messages");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant") {
      return absl::InvalidArgumentError(
          absl::StrCat("message ", i, " has role '", role, "' (system, user or assistant)"));
    }
    if (role == "system" && i != 0) {
      return absl::InvalidArgumentError("only the first message may be a system message");
    }
  }
  if (messages.back().role != "user") {
    return absl::InvalidArgumentError("the last chat message must be from the user");
  }
  std::string out;
  switch (format_) {
    case ChatFormat::kChatMl: {
      // <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n
      if (messages[0].role != "system" && !default_system_.empty()) {
        absl::StrAppend(&out, "<|im_start|>system\n", default_system_, "<|im_end|>\n");
      }
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n");
      }
      absl::StrAppend(&out, "<|im_start|>assistant\n");
      break;
    }
    case ChatFormat::kLlama3: {
      // <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|> ...
      out = "<|begin_of_text|>";
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|start_header_id|>", m.role, "<|end_header_id|>\n\n",
                        absl::StripAsciiWhitespace(m.content), "<|eot_id|>");
      }
      absl::StrAppend(&out, "<|start_header_id|>assistant<|end_header_id|>\n\n");
      break;
    }
    case ChatFormat::kLlama2: {
      // <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {answer} </s><s>[INST] ...
      size_t i = 0;
      std::string system;
      if (messages[0].role == "system") {
        system = absl::StrCat("<<SYS>>\n", absl::StripAsciiWhitespace(messages[0].content),
                              "\n<</SYS>>\n\n");
        i = 1;
      }
      for (; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "user") {
          absl::StrAppend(&out, "<s>[INST] ", system, absl::StripAsciiWhitespace(m.content), " [/INST]");
          system.clear();
        } else {
          absl::StrAppend(&out, " ", absl::StripAsciiWhitespace(m.content), " </s>");
        }
      }
      break;
    }
    case ChatFormat::kNone:
      break;
  }
  return out;
}

}  // namespace ellm::coord
