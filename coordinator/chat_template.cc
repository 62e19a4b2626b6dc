#include "coordinator/chat_template.h"

#include <ctime>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator/python_json.h"
#include "core/unicode.h"

namespace ellm::coord {
namespace {

// Python's str.isspace(), which Jinja's `trim` and the templates' strip()
// use: ASCII whitespace, the separators 0x1C-0x1F, NEL, and Unicode's spaces
// and line and paragraph separators (NBSP, U+2000-U+200A, U+3000...).
bool PythonSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// s without the Python whitespace at its start (left) and its end (right).
absl::string_view PythonStrip(absl::string_view s, bool left = true, bool right = true) {
  size_t begin = 0, end = 0;  // [begin, end): from the first non-space to the end of the last
  bool seen = false;
  for (size_t i = 0; i < s.size();) {
    char32_t c;
    const int n = DecodeUtf8(std::string_view(s.data() + i, s.size() - i), &c);
    if (!PythonSpace(c)) {
      if (!seen) begin = i;
      seen = true;
      end = i + n;
    }
    i += n;
  }
  if (!seen) return s.substr(s.size());
  return s.substr(left ? begin : 0, (right ? end : s.size()) - (left ? begin : 0));
}

absl::string_view StripNewlines(absl::string_view s, bool left, bool right) {
  while (left && !s.empty() && s.front() == '\n') s.remove_prefix(1);
  while (right && !s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

// The text Llama 3.1's template writes before the tools' list, in the first
// user turn.
constexpr char kLlamaToolsIntro[] =
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}.Do not use variables.\n\n";

// The text Qwen2.5's and Qwen3's templates write around the tools' list.
constexpr char kToolsIntro[] =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\n<tools>";
constexpr char kToolsOutro[] =
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n";

}  // namespace

ChatTemplate ChatTemplate::FromGgufTemplate(const std::string& jinja) {
  ChatTemplate t;
  t.has_template_ = !jinja.empty();
  if (jinja.find("<|im_start|>") != std::string::npos && jinja.find("<think>") != std::string::npos) {
    t.format_ = ChatFormat::kQwen3;  // no default system message
    // A generation prompt that opens the thinking block itself (QwQ, Qwen3
    // "Thinking-2507": "<|im_start|>assistant\n<think>\n") is not Qwen3's
    // hybrid one, which ellm renders: not guessed.
    if (jinja.find("assistant\\n<think>") != std::string::npos ||
        jinja.find("assistant\n<think>") != std::string::npos) {
      t.format_ = ChatFormat::kNone;
    }
  } else if (jinja.find("<|im_start|>") != std::string::npos) {
    t.format_ = ChatFormat::kChatMl;
    // Qwen2.5 and Qwen2 templates insert a system message when none is given.
    for (const char* system : {"You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
                               "You are a helpful assistant."}) {
      if (jinja.find(system) != std::string::npos) {
        t.default_system_ = system;
        break;
      }
    }
    // A system turn of the template's own that is none of those (SmolLM2's
    // "You are a helpful AI assistant named SmolLM...") would be left out of
    // every prompt: not guessed.
    if (t.default_system_.empty() && jinja.find("<|im_start|>system") != std::string::npos) {
      t.format_ = ChatFormat::kNone;
    }
  } else if (jinja.find("<|start_header_id|>") != std::string::npos) {
    t.format_ = ChatFormat::kLlama3;
    // Llama 3.1 and later always open with a system block that dates the
    // conversation: "Today Date: " + date_string, whose default the template
    // sets (3.1, 3.3: a fixed date) or takes from the clock (3.2:
    // strftime_now("%d %b %Y") where the renderer has it, as llama.cpp's and
    // transformers' have).
    if (jinja.find("Cutting Knowledge Date: December 2023") != std::string::npos) {
      t.knowledge_header_ = true;
      const std::string set = "set date_string = \"";
      const size_t begin = jinja.find(set);
      const size_t end = begin == std::string::npos ? begin : jinja.find('"', begin + set.size());
      if (jinja.find("strftime_now") != std::string::npos) {
        t.date_from_clock_ = true;
      } else if (end != std::string::npos) {
        t.date_string_ = jinja.substr(begin + set.size(), end - begin - set.size());
      } else {
        t.format_ = ChatFormat::kNone;  // a dated header whose date ellm cannot tell
      }
    }
  } else if (jinja.find("[INST]") != std::string::npos && jinja.find("<<SYS>>") != std::string::npos) {
    t.format_ = ChatFormat::kLlama2;
  }
  // Qwen2.5's and Qwen3's tools section (Qwen2's ChatML has none).
  t.takes_tools_ = (t.format_ == ChatFormat::kChatMl || t.format_ == ChatFormat::kQwen3) &&
                   jinja.find("<tool_call>") != std::string::npos &&
                   jinja.find("<tool_response>") != std::string::npos &&
                   jinja.find("You are provided with function signatures within <tools></tools> XML tags") !=
                       std::string::npos;
  if (t.format_ == ChatFormat::kChatMl && t.default_system_.empty()) t.takes_tools_ = false;
  // Llama 3.1's, 3.2's and 3.3's (3.0's has none): JSON calls, the tools in
  // the first user turn.
  if (t.format_ == ChatFormat::kLlama3 && t.knowledge_header_ &&
      jinja.find("Given the following functions, please respond with a JSON for a function call") !=
          std::string::npos) {
    t.takes_tools_ = true;
  }
  // Anything else, e.g. Mistral's [INST] templates (no <<SYS>>; their turns,
  // spaces and system message differ from Llama 2's by version), is not
  // guessed: kNone, and a chat request is refused.
  return t;
}

void ChatTemplate::CheckVocabulary(const Tokenizer& tokenizer) {
  std::vector<const char*> special;  // the turn's end first
  switch (format_) {
    case ChatFormat::kChatMl:
    case ChatFormat::kQwen3: special = {"<|im_end|>", "<|im_start|>"}; break;
    case ChatFormat::kLlama2: special = {"</s>", "<s>"}; break;
    case ChatFormat::kLlama3:
      special = {"<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"};
      break;
    case ChatFormat::kNone: return;
  }
  for (const char* text : special) {
    const std::vector<int32_t> ids = tokenizer.Encode(text, /*add_bos=*/false, /*parse_special=*/true);
    const char* wrong = ids.size() != 1                                                ? "is not one token"
                        : text == special.front() && !tokenizer.IsEndOfGeneration(ids[0]) ? "does not end generation"
                                                                                          : nullptr;
    if (wrong != nullptr) {
      refused_ = absl::StrCat("a ", name(), " template, but ", text, " ", wrong,
                              " in this vocabulary (chat requests are refused; raw prompts work)");
      format_ = ChatFormat::kNone;
      return;
    }
  }
}

const char* ChatTemplate::name() const {
  if (!refused_.empty()) return refused_.c_str();
  switch (format_) {
    case ChatFormat::kChatMl: return "chatml";
    case ChatFormat::kQwen3: return "qwen3";
    case ChatFormat::kLlama2: return "llama2";
    case ChatFormat::kLlama3: return "llama3";
    case ChatFormat::kNone: break;
  }
  return has_template_ ? "not one ellm knows (chat requests are refused; raw prompts work)"
                       : "none (chat requests are refused; raw prompts work)";
}

absl::StatusOr<ChatPrompt> ChatTemplate::Render(const std::vector<ChatMessage>& messages,
                                                const std::vector<std::string>& tools, bool enable_thinking) const {
  if (format_ == ChatFormat::kNone) {
    if (!refused_.empty()) return absl::InvalidArgumentError(absl::StrCat("chat is off: ", refused_));
    return absl::InvalidArgumentError(
        has_template_ ? "the model's chat template is not one ellm knows (ChatML, Qwen3, Llama-2, "
                        "Llama-3); send a raw prompt instead"
                      : "the model has no chat template; send a raw prompt instead");
  }
  if (messages.empty()) return absl::InvalidArgumentError("no chat messages");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant" && !(role == "tool" && takes_tools_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("message ", i, " has role '", role.substr(0, 32), role.size() > 32 ? "...'" : "'",
                       takes_tools_ ? " (system, user, assistant or tool)"
                       : role == "tool"
                           ? absl::StrCat(" but the model's chat template (", name(), ") does not take tools")
                           : " (system, user or assistant)"));
    }
    if (!messages[i].tool_calls.empty() && (role != "assistant" || !takes_tools_)) {
      return absl::InvalidArgumentError(
          role != "assistant"
              ? absl::StrCat("message ", i, " has tool calls but only an assistant's message may")
              : absl::StrCat("message ", i, " has tool calls but the model's chat template (", name(),
                             ") does not take tools"));
    }
  }
  if (!tools.empty() && !takes_tools_) {
    return absl::InvalidArgumentError(absl::StrCat("the model's chat template (", name(),
                                                   ") does not take tools (ellm renders Qwen2.5's, Qwen3's and "
                                                   "Llama 3.1's)"));
  }
  // The tools and the calls' arguments as the template's tojson writes them
  // (Llama 3.1's tools with indent=4).
  std::vector<std::string> tool_texts;
  for (size_t i = 0; i < tools.size(); ++i) {
    absl::StatusOr<std::string> text = PythonJson(tools[i], format_ == ChatFormat::kLlama3 ? 4 : 0);
    if (!text.ok() || text->empty() || text->front() != '{') {
      return absl::InvalidArgumentError(absl::StrCat(
          "tool ", i, " is not a JSON object", text.ok() ? "" : absl::StrCat(": ", text.status().message())));
    }
    tool_texts.push_back(*std::move(text));
  }
  // A call's arguments: any JSON value; none ("") is {} (as vLLM takes it).
  std::vector<std::vector<std::string>> arguments(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    for (size_t c = 0; c < messages[i].tool_calls.size(); ++c) {
      const std::string& given = messages[i].tool_calls[c].arguments;
      absl::StatusOr<std::string> text = PythonJson(given.empty() ? "{}" : given);
      if (!text.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("message ", i, "'s tool call ", c,
                                                       " has arguments that are ", text.status().message()));
      }
      arguments[i].push_back(*std::move(text));
    }
  }
  const bool with_tools = !tool_texts.empty();
  size_t system_end = messages[0].role == "system" ? 1 : 0;  // Llama 3.1: the first user turn's index
  if (format_ == ChatFormat::kLlama3 && takes_tools_) {
    // Llama 3.1's template raises on these; its tools go into the first
    // message after the system one, which must be the user's.
    for (size_t i = 0; i < messages.size(); ++i) {
      if (messages[i].tool_calls.size() > 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("message ", i, " has ", messages[i].tool_calls.size(),
                         " tool calls; Llama 3.1's chat template takes one call per message"));
      }
    }
    if (with_tools && (system_end >= messages.size() || messages[system_end].role != "user")) {
      return absl::InvalidArgumentError(
          "Llama 3.1's chat template puts the tools in the first user message: the messages need one "
          "(first, or after the system message)");
    }
  }
  // ChatML, Qwen3 and Llama 3 render any order of turns, as their templates
  // do: a system message later on (an agent's new instructions) is a system
  // turn there, and a conversation may end with an answer, which is closed
  // before the new answer begins. Llama 2's template has no place for them
  // (it drops a later system message without a word; after a last answer,
  // it would continue past "</s>"): refused.
  if (format_ == ChatFormat::kLlama2) {
    for (size_t i = 1; i < messages.size(); ++i) {
      if (messages[i].role == "system") {
        return absl::InvalidArgumentError("Llama 2's chat template takes a system message only as the first one");
      }
    }
    if (messages.back().role != "user") {
      return absl::InvalidArgumentError("Llama 2's chat template needs the last chat message to be from the user");
    }
  }
  ChatPrompt out;
  // The template's own text (special tokens parsed) and a message's (plain).
  auto markup = [&out](absl::string_view text) {
    const size_t begin = out.text.size();
    out.text.append(text.data(), text.size());
    if (!out.markup.empty() && out.markup.back().second == begin) {
      out.markup.back().second = out.text.size();
    } else if (!text.empty()) {
      out.markup.emplace_back(begin, out.text.size());
    }
  };
  auto content = [&out](absl::string_view text) { out.text.append(text.data(), text.size()); };
  switch (format_) {
    case ChatFormat::kChatMl:
    case ChatFormat::kQwen3: {
      // <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n
      // With tools, the system turn lists them after the given system
      // message (which it takes the place of), or (Qwen2.5) Qwen's default
      // one. The tools' text is the client's: plain text, as a message.
      const bool first_is_system = messages[0].role == "system";
      if (!tool_texts.empty()) {
        markup("<|im_start|>system\n");
        if (format_ == ChatFormat::kChatMl) {
          content(first_is_system ? messages[0].content : default_system_);
          markup("\n\n");
        } else if (first_is_system) {
          content(messages[0].content);
          markup("\n\n");
        }
        markup(kToolsIntro);
        for (const std::string& tool : tool_texts) {
          markup("\n");
          content(tool);
        }
        markup(kToolsOutro);
      } else if (!first_is_system && !default_system_.empty()) {
        markup("<|im_start|>system\n");
        content(default_system_);
        markup("<|im_end|>\n");
      }
      // Qwen3: the last user message that is not a tool's answer
      // ("<tool_response>...</tool_response>"); answers after it (in a tool
      // loop) keep their thinking, earlier ones lose it.
      size_t last_query = messages.size() - 1;
      if (format_ == ChatFormat::kQwen3) {
        for (size_t i = messages.size(); i-- > 0;) {
          const absl::string_view c = messages[i].content;
          if (messages[i].role == "user" &&
              !(absl::StartsWith(c, "<tool_response>") && absl::EndsWith(c, "</tool_response>"))) {
            last_query = i;
            break;
          }
        }
      }
      for (size_t i = first_is_system && !tool_texts.empty() ? 1 : 0; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "tool") {
          // A run of tools' answers is one user turn.
          if (i == 0 || messages[i - 1].role != "tool") markup("<|im_start|>user");
          markup("\n<tool_response>\n");
          content(m.content);
          markup("\n</tool_response>");
          if (i + 1 == messages.size() || messages[i + 1].role != "tool") markup("<|im_end|>\n");
          continue;
        }
        // Qwen2.5: an answer with calls has its text, if any, on the line
        // after the role, then a line per call.
        const bool chatml_calls = format_ == ChatFormat::kChatMl && !m.tool_calls.empty();
        markup(absl::StrCat("<|im_start|>", m.role, chatml_calls && m.content.empty() ? "" : "\n"));
        absl::string_view text = m.content;
        // Qwen3: the answer's text without its thinking decides whether the
        // first call starts on a new line.
        absl::string_view answer = text;
        if (format_ == ChatFormat::kQwen3 && m.role == "assistant") {
          // As Qwen3's template: an answer holding "</think>" is what
          // follows the last one (leading newlines dropped), its thinking
          // what precedes the first one, after the last "<think>" there.
          absl::string_view thinking;
          const size_t end_think = text.rfind("</think>");
          if (m.reasoning.has_value()) {
            thinking = *m.reasoning;  // given apart: the content is kept whole
          } else if (end_think != absl::string_view::npos) {
            thinking = StripNewlines(text.substr(0, text.find("</think>")), false, true);
            const size_t open = thinking.rfind("<think>");
            if (open != absl::string_view::npos) thinking.remove_prefix(open + 7);
            thinking = StripNewlines(thinking, true, false);
            text = StripNewlines(text.substr(end_think + 8), true, false);
          }
          answer = text;
          // After the last question, the template writes the thinking
          // block when there is thinking, and always for a last message
          // (a conversation that ends with an answer): empty, then.
          if (i > last_query && (!thinking.empty() || i + 1 == messages.size())) {
            markup("<think>\n");
            content(StripNewlines(thinking, true, true));
            markup("\n</think>\n\n");
            text = StripNewlines(text, true, false);
          }
        }
        content(text);
        for (size_t c = 0; c < m.tool_calls.size(); ++c) {
          if (format_ == ChatFormat::kChatMl || c > 0 || !answer.empty()) markup("\n");
          markup("<tool_call>\n{\"name\": \"");
          content(m.tool_calls[c].name);
          markup("\", \"arguments\": ");
          // Qwen3's template writes arguments that are a string (JSON
          // given as a JSON string) as that string itself.
          const std::optional<std::string> text =
              format_ == ChatFormat::kQwen3 ? JsonStringValue(arguments[i][c]) : std::nullopt;
          content(text.has_value() ? *text : arguments[i][c]);
          markup("}\n</tool_call>");
        }
        markup("<|im_end|>\n");
      }
      markup("<|im_start|>assistant\n");
      if (format_ == ChatFormat::kQwen3 && !enable_thinking) markup("<think>\n\n</think>\n\n");
      break;
    }
    case ChatFormat::kLlama3: {
      // <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|> ...
      markup("<|begin_of_text|>");
      size_t first = 0;
      if (knowledge_header_) {
        // Llama 3.1: the system block always, the given system message (if
        // any) after the dates.
        std::string date = date_string_;
        if (date_from_clock_) {
          const std::time_t now = std::time(nullptr);
          std::tm local{};
          localtime_r(&now, &local);
          char buf[32];
          date.assign(buf, std::strftime(buf, sizeof(buf), "%d %b %Y", &local));
        }
        markup(absl::StrCat("<|start_header_id|>system<|end_header_id|>\n\n",
                            with_tools ? "Environment: ipython\n" : "",
                            "Cutting Knowledge Date: December 2023\nToday Date: ", date, "\n\n"));
        if (messages[0].role == "system") {
          content(PythonStrip(messages[0].content));
          first = 1;
        }
        markup("<|eot_id|>");
      }
      if (with_tools) {
        // Llama 3.1: the tools (json.dumps with indent=4) open the first
        // user turn.
        markup(absl::StrCat("<|start_header_id|>user<|end_header_id|>\n\n", kLlamaToolsIntro));
        for (const std::string& tool : tool_texts) {
          content(tool);
          markup("\n\n");
        }
        content(PythonStrip(messages[system_end].content));
        markup("<|eot_id|>");
        first = system_end + 1;
      }
      for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (!m.tool_calls.empty()) {
          // Llama 3.1: the call alone (the answer's text is not written).
          markup("<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"");
          content(m.tool_calls[0].name);
          markup("\", \"parameters\": ");
          content(arguments[i][0]);
          markup("}<|eot_id|>");
        } else if (m.role == "tool") {
          // Llama 3.1's template writes a tool's answer through tojson (a
          // string is iterable there): as a JSON string.
          markup("<|start_header_id|>ipython<|end_header_id|>\n\n");
          content(PythonJsonString(m.content));
          markup("<|eot_id|>");
        } else {
          markup(absl::StrCat("<|start_header_id|>", m.role, "<|end_header_id|>\n\n"));
          content(PythonStrip(m.content));
          markup("<|eot_id|>");
        }
      }
      markup("<|start_header_id|>assistant<|end_header_id|>\n\n");
      break;
    }
    case ChatFormat::kLlama2: {
      // <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {answer} </s><s>[INST] ...
      // As Llama 2's template: the roles alternate user, assistant, ...
      // after the system message; each turn is strip()ped, the first user
      // turn together with the system block (so the system message keeps
      // its own whitespace, and an empty first turn takes the block's
      // trailing newlines with it).
      const bool has_system = messages[0].role == "system";
      const size_t first = has_system ? 1 : 0;
      for (size_t i = first; i < messages.size(); ++i) {
        if ((messages[i].role == "user") != ((i - first) % 2 == 0)) {
          return absl::InvalidArgumentError(
              "Llama 2's chat template needs the messages to alternate user, assistant, user, ... "
              "(after an optional system message)");
        }
      }
      for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "user") {
          markup("<s>[INST] ");
          if (has_system && i == first) {
            const absl::string_view user = PythonStrip(m.content, false, true);
            markup("<<SYS>>\n");
            content(messages[0].content);
            markup(user.empty() ? "\n<</SYS>>" : "\n<</SYS>>\n\n");
            content(user);
          } else {
            content(PythonStrip(m.content));
          }
          markup(" [/INST]");
        } else {
          markup(" ");
          content(PythonStrip(m.content));
          markup(" </s>");
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
