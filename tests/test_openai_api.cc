// coordinator/openai_api.h without a server: what ParseOpenAiRequest keeps
// of a body, and its messages for out-of-range numbers.
#include "coordinator/openai_api.h"

#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/gguf.h"
#include "core/tokenizer.h"
#include "core/unicode.h"
#include "tests/stories_tokenizer.h"
#include "gtest/gtest.h"

namespace ellm::coord {
namespace {

// ASan holds freed memory in its quarantine (256 MiB by default): there the
// resident peak says nothing about what the parser keeps.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAsan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAsan = true;
#else
constexpr bool kAsan = false;
#endif
#else
constexpr bool kAsan = false;
#endif

const Tokenizer& Stories() { return ellm::testing::StoriesTokenizer(); }

// The JSON objects of SSE bytes ("data: {...}\n\n" each; "[DONE]" left out).
std::vector<nlohmann::json> SseChunks(const std::string& sse) {
  std::vector<nlohmann::json> out;
  for (size_t at = sse.find("data: {"); at != std::string::npos; at = sse.find("data: {", at + 1)) {
    out.push_back(nlohmann::json::parse(sse.substr(at + 6, sse.find("\n\n", at) - at - 6)));
  }
  return out;
}

// This process's peak resident memory in bytes since the last ResetPeak.
int64_t PeakResident() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) << 10;
  }
  return -1;
}
bool ResetPeak() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.close();
  return clear.good();
}

// A body of millions of tiny values in a field the parser does not read:
// they are dropped as they are parsed, not built into nodes (about 100
// bytes each) and thrown away after.
TEST(OpenAiApi, IgnoredFieldsAreNotKept) {
  std::string body = R"({"prompt": "Once upon a time", "max_tokens": 3, "user": [)";
  while (body.size() < (size_t{8} << 20)) body += "[],{},[[]],";
  body += R"(0], "logit_bias": {"50": 100}, "response_format": {"type": "text"}})";
  if (!ResetPeak()) GTEST_SKIP() << "/proc/self/clear_refs cannot be written here";
  const int64_t before = PeakResident();
  absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(body, /*chat=*/false, "m");
  const int64_t grew = PeakResident() - before;
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->generate.prompt(), "Once upon a time");
  EXPECT_EQ(r->generate.max_tokens(), 3);
  EXPECT_EQ(r->generate.logit_bias().at(50), 100.0f);
  if (!kAsan) {
    EXPECT_LT(grew, int64_t{32} << 20) << "parsing an 8 MiB body grew the resident peak by " << (grew >> 20)
                                        << " MiB";
  }
  // Fields it reads or refuses are still seen: a refused one in the same body.
  body.replace(body.rfind("\"text\""), 6, R"("json_object")");
  r = ParseOpenAiRequest(body, false, "m");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("response_format"), std::string::npos) << r.status();
}

// A long list of objects is read in one pass: 200,000 chat messages. (With
// nlohmann's parser callback instead, every object's end scanned its parent
// list: minutes here.)
TEST(OpenAiApi, ALongListOfMessagesIsReadWhole) {
  std::string body = R"({"user": [{}, {}], "messages": [)";
  for (int i = 0; i < 200000; ++i) absl::StrAppend(&body, R"({"role": "user", "content": ")", i, R"("},)");
  body += R"({"role": "user", "content": "last"}]})";
  absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(body, /*chat=*/true, "m");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->generate.messages_size(), 200001);
  EXPECT_EQ(r->generate.messages(12345).content(), "12345");
  EXPECT_EQ(r->generate.messages(200000).content(), "last");
}

// Numbers out of range name the range they must be in; two fields for one
// setting must agree.
TEST(OpenAiApi, OutOfRangeNumbersNameTheirRange) {
  auto message = [](const std::string& body) {
    return std::string(ParseOpenAiRequest(body, false, "m").status().message());
  };
  EXPECT_NE(message(R"({"prompt":"x","max_tokens":2147483648})").find("at most 2147483647"), std::string::npos);
  EXPECT_NE(message(R"({"prompt":"x","max_tokens":0})").find("positive"), std::string::npos);
  EXPECT_NE(message(R"({"prompt":"x","top_p":0})").find("(0, 1]"), std::string::npos);
  EXPECT_NE(message(R"({"prompt":"x","top_p":1.5})").find("(0, 1]"), std::string::npos);
  EXPECT_NE(message(R"({"prompt":"x","temperature":-1})").find("[0, 100]"), std::string::npos);
  EXPECT_NE(message(R"({"prompt":"x","min_p":1.5})").find("min_p"), std::string::npos);
  EXPECT_NE(message(R"({"prompt":"x","min_p":"0.1"})").find("min_p"), std::string::npos);
  absl::StatusOr<OpenAiRequest> min_p = ParseOpenAiRequest(R"({"prompt":"x","min_p":0.05})", false, "m");
  ASSERT_TRUE(min_p.ok()) << min_p.status();
  EXPECT_FLOAT_EQ(min_p->generate.sampling().min_p(), 0.05f);
  EXPECT_NE(message(R"({"prompt":"x","presence_penalty":2.5})").find("[-2, 2]"), std::string::npos);
  EXPECT_NE(message(R"({"prompt":"x","frequency_penalty":-3})").find("[-2, 2]"), std::string::npos);
  absl::StatusOr<OpenAiRequest> penalties =
      ParseOpenAiRequest(R"({"prompt":"x","presence_penalty":0.5,"frequency_penalty":-1.5})", false, "m");
  ASSERT_TRUE(penalties.ok()) << penalties.status();
  EXPECT_FLOAT_EQ(penalties->generate.sampling().presence_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(penalties->generate.sampling().frequency_penalty(), -1.5f);
  EXPECT_TRUE(ParseOpenAiRequest(R"({"prompt":"x","top_p":1,"max_tokens":2147483647})", false, "m").ok());
  // max_tokens and its newer name: both may come, if they agree.
  EXPECT_NE(message(R"({"prompt":"x","max_tokens":5,"max_completion_tokens":7})").find("max_completion_tokens"),
            std::string::npos);
  absl::StatusOr<OpenAiRequest> both =
      ParseOpenAiRequest(R"({"prompt":"x","max_tokens":5,"max_completion_tokens":5})", false, "m");
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->generate.max_tokens(), 5);
}

// Completions' logprobs of an answer holding characters the vocabulary has
// only as byte tokens (stories260K's 512 pieces have "é" but no "à"): each token's
// text_offset is where its character starts in the returned text, counted in
// code points as a client's string indexes it, and a token that is not whole
// UTF-8 reads "bytes:\xNN" (U+FFFD would lose its bytes and merge
// alternatives into one key).
TEST(OpenAiApi, CompletionLogprobsIndexTheTextInCodePoints) {
  const Tokenizer& tok = Stories();
  const std::vector<int32_t> prompt = tok.Encode("Once", true);
  // A lone lead byte (0xC3) before " au": U+FFFD, then " au" at its own
  // offset (it had the U+FFFD's); a lone continuation byte (0xA9) at the
  // end: the text ends in U+FFFD.
  const std::vector<int32_t> a_grave = tok.Encode("à", false);
  ASSERT_GE(a_grave.size(), 2u);
  const int32_t lead = a_grave[a_grave.size() - 2], trail = a_grave.back();
  std::vector<int32_t> ids = tok.Encode(" voilà, café", false);
  ids.push_back(lead);
  for (int32_t id : tok.Encode(" au lait déjà vu à la", false)) ids.push_back(id);
  ids.push_back(trail);
  int byte_tokens = 0;
  size_t split = 0;  // the events split inside the first à
  int32_t prev = prompt.back();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!IsValidUtf8(tok.TokenBytes(prev, ids[i]))) {
      ++byte_tokens;
      if (split == 0) split = i + 1;
    }
    prev = ids[i];
  }
  ASSERT_GE(byte_tokens, 6) << "the premise: à is spelled by byte tokens";

  absl::StatusOr<OpenAiRequest> request = ParseOpenAiRequest(R"({"prompt": "Once", "logprobs": 2})", false, "m");
  ASSERT_TRUE(request.ok()) << request.status();
  OpenAiResponder responder(*request, "cmpl-1", "m", 0, tok, prompt.back());
  StreamDecoder decoder(tok, prompt.back());
  // Two events.
  std::string text;
  for (size_t part = 0; part < 2; ++part) {
    StreamEvent e;
    for (size_t i = part == 0 ? 0 : split; i < (part == 0 ? split : ids.size()); ++i) {
      e.token_ids.push_back(ids[i]);
      e.logprobs.push_back(-0.5f);
      // Alternatives: both halves of an à, which must not share a key.
      e.top_logprobs.push_back({{lead, -1.0f}, {trail, -2.0f}});
      e.text += decoder.Push(ids[i]);
    }
    if (part == 1) {
      e.text += decoder.Finish();
      e.finished = true;
      e.finish.reason = FinishReason::kMaxTokens;
    }
    text += e.text;
    responder.Add(e);
  }
  const nlohmann::json body = nlohmann::json::parse(responder.Final());
  const nlohmann::json& choice = body["choices"][0];
  ASSERT_EQ(choice["text"].get<std::string>(), text);
  EXPECT_NE(text.find("d\xC3\xA9j\xC3\xA0"), std::string::npos);
  EXPECT_EQ(text.substr(text.size() - 3), "\xEF\xBF\xBD");
  // The text as code points, as the client indexes it.
  std::vector<std::string> chars;
  for (size_t i = 0; i < text.size();) {
    char32_t cp;
    const int n = DecodeUtf8(std::string_view(text).substr(i), &cp);
    chars.push_back(text.substr(i, n));
    i += n;
  }
  const nlohmann::json& lp = choice["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), ids.size());
  prev = prompt.back();
  int64_t last_offset = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string piece = tok.TokenBytes(prev, ids[i]);
    const std::string name = lp["tokens"][i].get<std::string>();
    const int64_t offset = lp["text_offset"][i].get<int64_t>();
    ASSERT_GE(offset, last_offset) << i;
    ASSERT_LT(offset, static_cast<int64_t>(chars.size())) << i;
    last_offset = offset;
    if (IsValidUtf8(piece)) {
      EXPECT_EQ(name, piece) << i;
      std::string from_offset;
      for (size_t c = offset; c < chars.size(); ++c) from_offset += chars[c];
      EXPECT_EQ(from_offset.rfind(piece, 0), 0u) << i << ": '" << piece << "' at " << offset;
    } else {
      std::string escaped = "bytes:";
      for (unsigned char c : piece) escaped += absl::StrFormat("\\x%02x", c);
      EXPECT_EQ(name, escaped) << i;
      // The byte starts (or continues) the character at the offset.
      const std::string& ch = chars[offset];
      EXPECT_TRUE(ch == "\xEF\xBF\xBD" || ch.find(piece.back()) != std::string::npos) << i;
    }
    // Two distinct byte alternatives, and the chosen token unless it is one.
    const size_t keys = ids[i] == lead || ids[i] == trail ? 2 : 3;
    EXPECT_EQ(lp["top_logprobs"][i].size(), keys) << i << ": " << lp["top_logprobs"][i];
    prev = ids[i];
  }
}

}  // namespace
// Tools: each kept as the client wrote its keys (the template writes it out
// so), an assistant's calls and the tools' answers read from the messages,
// and what ellm cannot honour refused naming the field.
TEST(OpenAiApi, ToolsAndToolMessagesAreRead) {
  const std::string body = R"({"messages": [
      {"role": "user", "content": "Time?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "now", "arguments": "{\"zone\": \"UTC\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "12:00"}]}],
    "tools": [{"type": "function", "function": {"name": "now", "parameters": {"zone": {}, "a": 1}}}],
    "tool_choice": "auto", "parallel_tool_calls": true})";
  absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(body, true, "m");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->read_tool_calls);
  ASSERT_EQ(r->generate.tools_size(), 1);
  // In the client's order, as json.dumps writes it.
  EXPECT_EQ(r->generate.tools(0), R"({"type": "function", "function": {"name": "now", "parameters": {"zone": {}, "a": 1}}})");
  ASSERT_EQ(r->generate.messages_size(), 3);
  ASSERT_EQ(r->generate.messages(1).tool_calls_size(), 1);
  EXPECT_EQ(r->generate.messages(1).tool_calls(0).name(), "now");
  EXPECT_EQ(r->generate.messages(1).tool_calls(0).arguments(), R"({"zone": "UTC"})");
  EXPECT_EQ(r->generate.messages(1).content(), "");
  EXPECT_EQ(r->generate.messages(2).role(), "tool");
  EXPECT_EQ(r->generate.messages(2).content(), "12:00");
  EXPECT_FALSE(r->one_tool_call);

  // "none": the tools are listed, the answer read as text.
  std::string none = body;
  none.replace(none.find("\"auto\""), 6, "\"none\"");
  r = ParseOpenAiRequest(none, true, "m");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->read_tool_calls);
  EXPECT_EQ(r->generate.tools_size(), 1);
  // No tools: nothing to read.
  r = ParseOpenAiRequest(R"({"messages": [{"role": "user", "content": "x"}], "tools": []})", true, "m");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->read_tool_calls);

  auto refused = [](const std::string& body, bool chat, const std::string& field) {
    absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(body, chat, "m");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << body;
    EXPECT_NE(r.status().message().find("'" + field + "'"), std::string::npos) << r.status();
  };
  const std::string user = R"("messages": [{"role": "user", "content": "x"}])";
  const std::string tool = R"({"type": "function", "function": {"name": "f"}})";
  refused("{" + user + R"(, "tools": [)" + tool + R"(], "tool_choice": "required"})", true, "tool_choice");
  refused("{" + user + R"(, "tools": [)" + tool + R"(], "tool_choice": {"type": "function", "function": {"name": "f"}}})",
          true, "tool_choice");
  refused("{" + user + R"(, "tools": [{"type": "function", "function": {"description": "no name"}}]})", true,
          "tools[0].function.name");
  refused("{" + user + R"(, "tools": [{"type": "function", "function": {"name": ""}}]})", true, "tools[0].function.name");
  refused("{" + user + R"(, "tools": [{"type": "function", "function": {"name": "f", "description": 5}}]})", true,
          "tools[0].function.description");
  refused("{" + user + R"(, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]})", true,
          "tools[0].function.parameters");
  refused("{" + user + R"(, "tools": [)" + tool + R"(], "parallel_tool_calls": "yes"})", true, "parallel_tool_calls");
  refused(R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{\"a\":"}}]}]})",
          true, "messages[0].tool_calls[0].function.arguments");
  refused(R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": ")" +
              std::string(65, '[') + std::string(65, ']') + R"("}}]}]})",
          true, "messages[0].tool_calls[0].function.arguments");
  // Arguments absent, null or "" are {} (as vLLM takes them); any JSON value is kept.
  r = ParseOpenAiRequest(R"({"messages": [{"role": "assistant", "tool_calls": [
      {"function": {"name": "a"}}, {"function": {"name": "b", "arguments": null}},
      {"function": {"name": "c", "arguments": ""}}, {"function": {"name": "d", "arguments": "[1, 2]"}}]}],
      "parallel_tool_calls": false})", true, "m");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->generate.messages(0).tool_calls_size(), 4);
  for (int c = 0; c < 3; ++c) EXPECT_EQ(r->generate.messages(0).tool_calls(c).arguments(), "{}");
  EXPECT_EQ(r->generate.messages(0).tool_calls(3).arguments(), "[1, 2]");
  EXPECT_TRUE(r->one_tool_call);
  // Content parts are joined with new lines, as vLLM joins them.
  r = ParseOpenAiRequest(
      R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})",
      true, "m");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->generate.messages(0).content(), "a\nb");
  refused("{" + user + R"(, "tools": [{"type": "retrieval"}]})", true, "tools[0]");
  refused("{" + user + R"(, "tools": {"a": 1}})", true, "tools");
  refused(R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}]})",
          true, "messages[0].tool_calls[0].function.arguments");
  refused(R"({"messages": [{"role": "assistant", "tool_calls": {}}]})", true, "messages[0].tool_calls");
  refused(R"({"prompt": "x", "tools": [)" + tool + "]}", false, "tools");
  refused(R"({"prompt": "x", "tool_choice": "auto"})", false, "tool_choice");
  refused("{" + user + R"(, "functions": [{"name": "f"}]})", true, "functions");
}

TEST(OpenAiApi, ToolCallsAreReadAsLlama31sTemplateAsksForThem) {
  // vLLM's llama3_json: objects separated by "; ", "parameters" or "arguments".
  std::optional<ToolCallsAnswer> a = ParseToolCalls(
      R"({"name": "now", "parameters": {"zone": "UTC", "a": [1, "}"]}}; {"name": "f", "arguments": {}})",
      ToolCallSyntax::kLlamaJson);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->content, "");
  ASSERT_EQ(a->calls.size(), 2u);
  EXPECT_EQ(a->calls[0].name, "now");
  EXPECT_EQ(a->calls[0].arguments, R"({"zone": "UTC", "a": [1, "}"]})");
  EXPECT_EQ(a->calls[1].name, "f");
  EXPECT_EQ(a->calls[1].arguments, "{}");
  // A trailing newline is within the separator's two characters.
  EXPECT_TRUE(ParseToolCalls("{\"name\": \"f\", \"parameters\": {}}\n", ToolCallSyntax::kLlamaJson).has_value());
  // Text: not starting with "{", text after the call, no name, no
  // parameters, unclosed, the other syntax.
  for (const char* text : {" {\"name\": \"f\", \"parameters\": {}}", "{\"name\": \"f\", \"parameters\": {}} and more",
                           "{\"parameters\": {}}", "{\"name\": \"f\"}", "{\"name\": \"f\", \"parameters\": {",
                           "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", "{\"a\": \"{\"}"}) {
    EXPECT_FALSE(ParseToolCalls(text, ToolCallSyntax::kLlamaJson).has_value()) << text;
  }
  EXPECT_FALSE(ParseToolCalls("{\"name\": \"f\", \"arguments\": {}}", ToolCallSyntax::kHermes).has_value());
}

TEST(OpenAiApi, ToolCallsAreReadAsQwensTemplatesAskForThem) {
  std::optional<ToolCallsAnswer> a = ParseToolCalls(
      "Checking.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {\"zone\":\"UTC\",\"a\":[1,2]}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
      ToolCallSyntax::kHermes);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->content, "Checking.\n");
  ASSERT_EQ(a->calls.size(), 2u);
  EXPECT_EQ(a->calls[0].name, "now");
  EXPECT_EQ(a->calls[0].arguments, R"({"zone": "UTC", "a": [1, 2]})");  // keys in order, Python's separators
  EXPECT_EQ(a->calls[1].name, "f");
  EXPECT_EQ(a->calls[1].arguments, "{}");
  // An unclosed last call (the answer ended at its stop token) still counts.
  a = ParseToolCalls("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}", ToolCallSyntax::kHermes);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->content, "");
  ASSERT_EQ(a->calls.size(), 1u);
  // Not calls: no marker, JSON that does not parse, no name, no arguments.
  EXPECT_FALSE(ParseToolCalls("Just text about <tool_calls>.", ToolCallSyntax::kHermes).has_value());
  EXPECT_FALSE(ParseToolCalls("<tool_call>{\"name\": \"f\", \"arguments\": {</tool_call>", ToolCallSyntax::kHermes).has_value());
  EXPECT_FALSE(ParseToolCalls("<tool_call>{\"arguments\": {}}</tool_call>", ToolCallSyntax::kHermes).has_value());
  EXPECT_FALSE(ParseToolCalls("<tool_call>{\"name\": \"f\"}</tool_call>", ToolCallSyntax::kHermes).has_value());
  EXPECT_FALSE(ParseToolCalls(
                   "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call><tool_call>[1]</tool_call>",
                   ToolCallSyntax::kHermes)
                   .has_value());
}

// The responses: tool_calls (content null when the answer is only calls),
// finish_reason "tool_calls"; streamed, no part of a call reaches the
// content, even a "<tool_call>" split across events.
TEST(OpenAiApi, AnswersThatCallToolsAreReturnedAsToolCalls) {
  const Tokenizer& tok = Stories();
  absl::StatusOr<OpenAiRequest> request = ParseOpenAiRequest(
      R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "now"}}]})",
      true, "m");
  ASSERT_TRUE(request.ok()) << request.status();
  auto events = [](const std::vector<std::string>& parts) {
    std::vector<StreamEvent> out;
    for (const std::string& p : parts) out.push_back(StreamEvent{.text = p});
    out.back().finished = true;
    out.back().finish.reason = FinishReason::kStopToken;
    return out;
  };
  const std::vector<std::string> call = {"Let me look.", "\n<to", "ol_c", "all>\n{\"name\": \"now\", ",
                                         "\"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>", ""};
  const std::vector<std::string> text = {"A <tool", "_ca", "ll> is how I would ", "call <tool"};
  for (bool streaming : {false, true}) {
    OpenAiRequest r = *request;
    r.stream = streaming;
    for (const auto& [parts, calls] : {std::pair{call, true}, std::pair{text, false}}) {
      OpenAiResponder responder(r, "chatcmpl-abc", "m", 0, tok, 1);
      std::string content, finish;
      nlohmann::json tool_calls;
      if (!streaming) {
        for (const StreamEvent& e : events(parts)) responder.Add(e);
        const nlohmann::json j = nlohmann::json::parse(responder.Final());
        const nlohmann::json& message = j["choices"][0]["message"];
        content = message["content"].is_null() ? "<null>" : message["content"].get<std::string>();
        finish = j["choices"][0]["finish_reason"];
        if (message.contains("tool_calls")) tool_calls = message["tool_calls"];
      } else {
        for (const StreamEvent& e : events(parts)) {
          const std::string sse = responder.SseFor(e);
          for (const nlohmann::json& j : SseChunks(sse)) {
            const nlohmann::json& c = j["choices"][0];
            if (c["delta"].contains("content")) content += c["delta"]["content"].get<std::string>();
            if (c["delta"].contains("tool_calls")) tool_calls = c["delta"]["tool_calls"];
            if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
          }
        }
      }
      if (calls) {
        EXPECT_EQ(content, "Let me look.\n") << streaming;
        EXPECT_EQ(finish, "tool_calls");
        ASSERT_EQ(tool_calls.size(), 1u) << tool_calls;
        EXPECT_EQ(tool_calls[0]["type"], "function");
        EXPECT_EQ(tool_calls[0]["id"], "call_abc_0");
        EXPECT_EQ(tool_calls[0]["function"]["name"], "now");
        EXPECT_EQ(tool_calls[0]["function"]["arguments"], R"({"zone": "UTC"})");
        EXPECT_EQ(tool_calls[0].contains("index"), streaming);
      } else {
        // Text that only looks like the start of a call comes out whole.
        EXPECT_EQ(content, "A <tool_call> is how I would call <tool") << streaming;
        EXPECT_EQ(finish, "stop");
        EXPECT_TRUE(tool_calls.is_null()) << tool_calls;
      }
    }
  }
  // Llama 3.1: an answer that starts with "{" is held whole, then read as
  // calls (content null) or, if it is not, given as text.
  OpenAiRequest llama = *request;
  llama.tool_syntax = ToolCallSyntax::kLlamaJson;
  for (bool streaming : {false, true}) {
    llama.stream = streaming;
    for (const auto& [parts, calls] :
         {std::pair{std::vector<std::string>{"", "{\"name\": ", "\"now\", \"parameters\": {}}", ""}, true},
          std::pair{std::vector<std::string>{"{\"name\": ", "\"now\"} is JSON"}, false},
          std::pair{std::vector<std::string>{"Sure: ", "{\"name\": \"now\", \"parameters\": {}}"}, false}}) {
      OpenAiResponder responder(llama, "chatcmpl-abc", "m", 0, tok, 1);
      std::string all;
      for (const std::string& p : parts) all += p;
      std::string content = "<null>", finish;
      nlohmann::json tool_calls;
      if (!streaming) {
        for (const StreamEvent& e : events(parts)) responder.Add(e);
        const nlohmann::json j = nlohmann::json::parse(responder.Final());
        const nlohmann::json& message = j["choices"][0]["message"];
        if (!message["content"].is_null()) content = message["content"];
        finish = j["choices"][0]["finish_reason"];
        if (message.contains("tool_calls")) tool_calls = message["tool_calls"];
      } else {
        std::vector<std::string> deltas;
        for (const StreamEvent& e : events(parts)) {
          const std::string sse = responder.SseFor(e);
          for (const nlohmann::json& j : SseChunks(sse)) {
            const nlohmann::json& c = j["choices"][0];
            if (c["delta"].contains("content") && c["delta"]["content"] != "") {
              deltas.push_back(c["delta"]["content"]);
            }
            if (c["delta"].contains("tool_calls")) tool_calls = c["delta"]["tool_calls"];
            if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
          }
        }
        if (!deltas.empty()) content = absl::StrJoin(deltas, "");
        // Text that is not calls streams as it comes.
        if (parts[0] == "Sure: ") {
          EXPECT_EQ(deltas.size(), 2u);
        }
      }
      if (calls) {
        EXPECT_EQ(content, "<null>") << streaming;
        EXPECT_EQ(finish, "tool_calls");
        ASSERT_EQ(tool_calls.size(), 1u) << tool_calls;
        EXPECT_EQ(tool_calls[0]["function"]["name"], "now");
        EXPECT_EQ(tool_calls[0]["function"]["arguments"], "{}");
      } else {
        EXPECT_EQ(content, all) << streaming;
        EXPECT_EQ(finish, "stop");
        EXPECT_TRUE(tool_calls.is_null()) << tool_calls;
      }
    }
  }

  // parallel_tool_calls false: the first call only.
  {
    OpenAiRequest one = *request;
    one.one_tool_call = true;
    OpenAiResponder responder(one, "chatcmpl-abc", "m", 0, tok, 1);
    for (const StreamEvent& e : events({"<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>"
                                        "<tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>"})) {
      responder.Add(e);
    }
    const nlohmann::json j = nlohmann::json::parse(responder.Final());
    ASSERT_EQ(j["choices"][0]["message"]["tool_calls"].size(), 1u) << j;
    EXPECT_EQ(j["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "a");
  }

  // With tool_choice "none" the same answer is text.
  OpenAiRequest none = *request;
  none.read_tool_calls = false;
  OpenAiResponder responder(none, "chatcmpl-abc", "m", 0, tok, 1);
  for (const StreamEvent& e : events(call)) responder.Add(e);
  const nlohmann::json j = nlohmann::json::parse(responder.Final());
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls"));
}

// n choices: each event goes to its choice's index, however the choices'
// events interleave; a choice's held text and calls stay its own (call ids
// differ between choices); the finish of each comes with its index, and the
// usage (the prompt once, every choice's completion tokens) and [DONE] only
// after the last choice to finish.
TEST(OpenAiApi, ChoicesAreKeptApartWhenTheirEventsInterleave) {
  const Tokenizer& tok = Stories();
  for (const char* bad : {"0", "17", "1.5", "\"2\"", "-1", "true"}) {
    const absl::StatusOr<OpenAiRequest> r =
        ParseOpenAiRequest(absl::StrCat(R"({"prompt": "x", "n": )", bad, "}"), false, "m");
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("'n' must be an integer in [1, 16]"), std::string::npos) << r.status();
  }
  const absl::StatusOr<OpenAiRequest> best_of =
      ParseOpenAiRequest(R"({"prompt": "x", "n": 2, "best_of": 1})", false, "m");
  EXPECT_NE(best_of.status().message().find("'best_of' must not be less than n"), std::string::npos)
      << best_of.status();
  absl::StatusOr<OpenAiRequest> request = ParseOpenAiRequest(
      R"({"messages": [{"role": "user", "content": "x"}], "n": 3, "stream_options": {"include_usage": true},
          "tools": [{"type": "function", "function": {"name": "now"}}]})",
      true, "m");
  ASSERT_TRUE(request.ok()) << request.status();
  ASSERT_EQ(request->n, 3);
  // Choices 0 and 2 call the tool (split over events), choice 1 answers in
  // text; their events interleave, and choice 1 ends first.
  const std::vector<std::vector<std::string>> parts = {
      {"Let me look.", "\n<to", "ol_c", "all>\n{\"name\": \"now\", ", "\"arguments\": {}}\n</tool_call>"},
      {"It is ", "noon <tool"},
      {"<tool_call>{\"name\": \"now\", ", "\"arguments\": {\"zone\": \"UTC\"}}"}};
  const std::vector<int> completion = {5, 2, 2};
  std::vector<std::pair<int, StreamEvent>> events;
  for (size_t step = 0; step < 5; ++step) {
    for (int c : {1, 0, 2}) {
      if (step >= parts[c].size()) continue;
      StreamEvent e{.text = parts[c][step], .token_ids = {5}};
      if (step + 1 == parts[c].size()) {
        e.finished = true;
        e.finish.reason = FinishReason::kStopToken;
        e.finish.prompt_tokens = 9;
        e.finish.completion_tokens = completion[c];
        e.finish.cached_tokens = c == 0 ? 0 : 8;
      }
      events.emplace_back(c, e);
    }
  }
  for (bool streaming : {false, true}) {
    OpenAiRequest r = *request;
    r.stream = streaming;
    r.include_usage = streaming;
    OpenAiResponder responder(r, "chatcmpl-abc", "m", 0, tok, 1);
    std::vector<std::string> content(3), finish(3);
    std::vector<nlohmann::json> calls(3);
    nlohmann::json usage;
    if (!streaming) {
      for (const auto& [c, e] : events) {
        EXPECT_FALSE(responder.finished());
        responder.Add(e, c);
      }
      ASSERT_TRUE(responder.finished());
      const nlohmann::json j = nlohmann::json::parse(responder.Final());
      ASSERT_EQ(j["choices"].size(), 3u) << j;
      for (int c = 0; c < 3; ++c) {
        const nlohmann::json& choice = j["choices"][c];
        EXPECT_EQ(choice["index"], c);
        content[c] = choice["message"]["content"].is_null() ? "" : choice["message"]["content"].get<std::string>();
        finish[c] = choice["finish_reason"];
        if (choice["message"].contains("tool_calls")) calls[c] = choice["message"]["tool_calls"];
      }
      usage = j["usage"];
    } else {
      int done = 0;
      for (size_t i = 0; i < events.size(); ++i) {
        const std::string sse = responder.SseFor(events[i].second, events[i].first);
        const bool last = i + 1 == events.size();
        EXPECT_EQ(sse.find("[DONE]") != std::string::npos, last) << i;
        EXPECT_EQ(absl::EndsWith(sse, "data: [DONE]\n\n"), last) << i;
        for (const nlohmann::json& j : SseChunks(sse)) {
          if (j.contains("usage")) {
            EXPECT_TRUE(last);
            EXPECT_TRUE(j["choices"].empty());
            usage = j["usage"];
            continue;
          }
          ASSERT_EQ(j["choices"].size(), 1u);
          const nlohmann::json& ch = j["choices"][0];
          const int c = ch["index"];
          EXPECT_EQ(c, events[i].first) << "a chunk under another choice's index";
          if (ch["delta"].contains("content")) content[c] += ch["delta"]["content"].get<std::string>();
          if (ch["delta"].contains("tool_calls")) calls[c] = ch["delta"]["tool_calls"];
          if (!ch["finish_reason"].is_null()) {
            finish[c] = ch["finish_reason"];
            ++done;
          }
        }
      }
      EXPECT_EQ(done, 3);
    }
    EXPECT_EQ(content[0], "Let me look.\n") << streaming;
    EXPECT_EQ(content[1], "It is noon <tool") << streaming;
    EXPECT_EQ(content[2], "") << streaming;
    EXPECT_EQ(finish, (std::vector<std::string>{"tool_calls", "stop", "tool_calls"})) << streaming;
    ASSERT_EQ(calls[0].size(), 1u) << calls[0];
    ASSERT_EQ(calls[2].size(), 1u) << calls[2];
    EXPECT_TRUE(calls[1].is_null());
    EXPECT_EQ(calls[0][0]["function"]["arguments"], "{}");
    EXPECT_EQ(calls[2][0]["function"]["arguments"], R"({"zone": "UTC"})");
    EXPECT_EQ(calls[0][0]["id"], "call_abc_0");
    EXPECT_EQ(calls[2][0]["id"], "call_abc_2_0");
    EXPECT_EQ(usage["prompt_tokens"], 9) << usage;
    EXPECT_EQ(usage["completion_tokens"], 9) << usage;
    EXPECT_EQ(usage["total_tokens"], 18) << usage;
    EXPECT_EQ(usage["prompt_tokens_details"]["cached_tokens"], 0) << "the prompt as choice 0 found it";
  }
}

// With read_reasoning (Qwen3's template), an answer's opening
// "<think>...</think>" block is reasoning_content, streamed or not, however
// its markers are split across events; tool calls are read from the content
// only; an answer that opens no block is all content; a block max_tokens cut
// short is all reasoning. chat_template_kwargs.enable_thinking and a
// message's reasoning_content reach the GenerateRequest.
TEST(OpenAiApi, ThinkingIsReturnedAsReasoningContent) {
  const Tokenizer& tok = Stories();
  absl::StatusOr<OpenAiRequest> request = ParseOpenAiRequest(
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a", "reasoning_content": "r"},
                       {"role": "user", "content": "y"}],
          "chat_template_kwargs": {"enable_thinking": false, "other": 1},
          "tools": [{"type": "function", "function": {"name": "now"}}]})",
      true, "m");
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_TRUE(request->generate.has_enable_thinking());
  EXPECT_FALSE(request->generate.enable_thinking());
  EXPECT_EQ(request->generate.messages(1).reasoning_content(), "r");
  EXPECT_FALSE(request->generate.messages(0).has_reasoning_content());
  // Later vLLM's name for it.
  const absl::StatusOr<OpenAiRequest> later = ParseOpenAiRequest(
      R"({"messages": [{"role": "assistant", "content": "a", "reasoning": "r2"}]})", true, "m");
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_EQ(later->generate.messages(0).reasoning_content(), "r2");
  for (const char* bad : {R"("chat_template_kwargs": {"enable_thinking": "no"})", R"("chat_template_kwargs": 1)",
                          R"("messages": [{"role": "assistant", "content": "a", "reasoning_content": 5}])"}) {
    const absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(
        absl::StrCat(R"({"messages": [{"role": "user", "content": "x"}], )", bad, "}"), true, "m");
    EXPECT_FALSE(r.ok()) << bad;
  }
  request->read_reasoning = true;
  struct Case {
    std::vector<std::string> parts;
    std::optional<std::string> reasoning;
    std::string content;  // "<null>": null
    bool call;
  };
  const std::vector<Case> cases = {
      {{"<thi", "nk>\nI think <tool_call> is", " a tag.\n</thi", "nk>\n\nThe answer",
        "<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>"},
       "\nI think <tool_call> is a tag.\n", "\n\nThe answer", true},
      {{"<think>", "</think>", "Hi."}, "", "Hi.", false},
      {{"Hello <think>", "x</think>"}, std::nullopt, "Hello <think>x</think>", false},
      {{"<think>\nstill ", "thinking </th"}, "\nstill thinking </th", "<null>", false},
      {{"<th"}, std::nullopt, "<th", false},
      {{"", "<", "think>", "a</think>b"}, "a", "b", false},
      // The end of the thinking and the calls in the last event.
      {{"<think>a", "b</think><tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>"}, "ab", "<null>", true},
  };
  for (bool streaming : {false, true}) {
    for (const Case& k : cases) {
      OpenAiRequest r = *request;
      r.stream = streaming;
      OpenAiResponder responder(r, "chatcmpl-abc", "m", 0, tok, 1);
      std::vector<StreamEvent> events;
      for (const std::string& p : k.parts) events.push_back(StreamEvent{.text = p});
      events.back().finished = true;
      events.back().finish.reason = FinishReason::kStopToken;
      std::optional<std::string> reasoning;
      std::string content;
      bool call = false;
      if (!streaming) {
        for (const StreamEvent& e : events) responder.Add(e);
        const nlohmann::json j = nlohmann::json::parse(responder.Final());
        const nlohmann::json& m = j["choices"][0]["message"];
        if (m.contains("reasoning_content")) reasoning = m["reasoning_content"].get<std::string>();
        EXPECT_EQ(m.contains("reasoning"), m.contains("reasoning_content"));
        if (m.contains("reasoning")) {
          EXPECT_EQ(m["reasoning"], m["reasoning_content"]);
        }
        content = m["content"].is_null() ? "<null>" : m["content"].get<std::string>();
        call = m.contains("tool_calls");
      } else {
        for (const StreamEvent& e : events) {
          const std::string sse = responder.SseFor(e);
          for (const nlohmann::json& j : SseChunks(sse)) {
            const nlohmann::json& d = j["choices"][0]["delta"];
            EXPECT_EQ(d.contains("reasoning"), d.contains("reasoning_content"));
            if (d.contains("reasoning_content")) {
              EXPECT_TRUE(content.empty()) << "reasoning after content";
              reasoning = reasoning.value_or("") + d["reasoning_content"].get<std::string>();
            }
            if (d.contains("content")) content += d["content"].get<std::string>();
            call = call || d.contains("tool_calls");
          }
        }
        // Streamed, a block that holds nothing shows no reasoning delta;
        // no answer after thinking is no content.
        if (k.reasoning && k.reasoning->empty() && !reasoning) reasoning = "";
        if (content.empty() && k.content == "<null>") content = "<null>";
      }
      const std::string label = absl::StrCat(absl::StrJoin(k.parts, "|"), streaming ? " (streamed)" : "");
      EXPECT_EQ(reasoning, k.reasoning) << label;
      EXPECT_EQ(content, k.content) << label;
      EXPECT_EQ(call, k.call) << label;
    }
  }
}

// echo (completions): every choice's text starts with the prompt's (ids
// decoded), streamed or not; a non-boolean echo is refused.
TEST(OpenAiApi, EchoPutsThePromptBeforeEachChoice) {
  const Tokenizer& tok = Stories();
  EXPECT_FALSE(ParseOpenAiRequest(R"({"prompt": "x", "echo": "yes"})", false, "m").ok());
  const absl::StatusOr<OpenAiRequest> with_logprobs =
      ParseOpenAiRequest(R"({"prompt": "x", "echo": true, "logprobs": 1})", false, "m");
  ASSERT_TRUE(with_logprobs.ok()) << with_logprobs.status();
  EXPECT_TRUE(with_logprobs->generate.prompt_logprobs()) << "echo with logprobs scores the prompt";
  EXPECT_FALSE(ParseOpenAiRequest(R"({"prompt": "x", "echo": true})", false, "m")->generate.prompt_logprobs());
  EXPECT_FALSE(ParseOpenAiRequest(R"({"prompt": "x", "logprobs": 1})", false, "m")->generate.prompt_logprobs());
  const std::vector<int32_t> ids = tok.Encode("Once upon a time", true, {});
  const std::string decoded = tok.Decode(ids);
  ASSERT_EQ(decoded, "Once upon a time") << "the premise";
  for (const std::string& prompt : {std::string(R"("The cat")"), absl::StrCat("[", absl::StrJoin(ids, ","), "]")}) {
    const std::string expected = prompt[0] == '"' ? "The cat" : decoded;
    absl::StatusOr<OpenAiRequest> request =
        ParseOpenAiRequest(absl::StrCat(R"({"prompt": )", prompt, R"(, "echo": true, "n": 2})"), false, "m");
    ASSERT_TRUE(request.ok()) << request.status();
    ASSERT_TRUE(request->echo);
    for (bool streaming : {false, true}) {
      OpenAiRequest r = *request;
      r.stream = streaming;
      OpenAiResponder responder(r, "cmpl-1", "m", 0, tok, 1);
      std::vector<std::string> text(2);
      for (const char* part : {" sat", " down"}) {
        for (int c = 0; c < 2; ++c) {
          StreamEvent e{.text = absl::StrCat(part, c)};
          e.finished = std::string(part) == " down";
          if (!streaming) {
            responder.Add(e, c);
            continue;
          }
          const std::string sse = responder.SseFor(e, c);
          for (const nlohmann::json& j : SseChunks(sse)) {
            text[j["choices"][0]["index"].get<int>()] += j["choices"][0]["text"].get<std::string>();
          }
        }
      }
      if (!streaming) {
        const nlohmann::json j = nlohmann::json::parse(responder.Final());
        for (int c = 0; c < 2; ++c) text[c] = j["choices"][c]["text"];
      }
      for (int c = 0; c < 2; ++c) {
        EXPECT_EQ(text[c], absl::StrCat(expected, " sat", c, " down", c)) << prompt << " streaming " << streaming;
      }
    }
  }
}

// echo with logprobs: the prompt's tokens come first in logprobs, the
// first with null log-probability, the others with the events' scores and
// their alternatives; text_offset counts through the prompt's text into the
// answer's; streamed (in the first chunk) and not, the same lists.
TEST(OpenAiApi, EchoWithLogprobsListsThePromptScored) {
  const Tokenizer& tok = Stories();
  const std::vector<int32_t> prompt = tok.Encode("Once upon a time", true, {});
  ASSERT_GT(prompt.size(), 3u);
  absl::StatusOr<OpenAiRequest> request =
      ParseOpenAiRequest(R"({"prompt": "Once upon a time", "echo": true, "logprobs": 1})", false, "m");
  ASSERT_TRUE(request.ok()) << request.status();
  SequenceRng rng(5);
  std::vector<float> scores;
  std::vector<std::vector<TokenLogprob>> top;
  for (size_t i = 1; i < prompt.size(); ++i) {
    scores.push_back(-4.0f * rng.NextUniform());
    top.push_back({{static_cast<int32_t>(300 + i), -0.5f}});
  }
  const std::vector<int32_t> answer = tok.Encode("there was", false, {});
  std::vector<nlohmann::json> lists;
  for (bool streaming : {false, true}) {
    OpenAiRequest r = *request;
    r.stream = streaming;
    OpenAiResponder responder(r, "cmpl-1", "m", 0, tok, prompt.back(), prompt);
    nlohmann::json got = {{"tokens", nlohmann::json::array()}, {"token_logprobs", nlohmann::json::array()},
                          {"top_logprobs", nlohmann::json::array()}, {"text_offset", nlohmann::json::array()}};
    std::string text;
    for (size_t i = 0; i < answer.size(); ++i) {
      StreamEvent e{.text = tok.TokenBytes(i == 0 ? prompt.back() : answer[i - 1], answer[i])};
      e.token_ids = {answer[i]};
      e.logprobs = {-1.0f - static_cast<float>(i)};
      e.top_logprobs = {{{answer[i], e.logprobs[0]}}};
      if (i == 0) {
        e.prompt_logprobs = scores;
        e.prompt_top_logprobs = top;
      }
      e.finished = i + 1 == answer.size();
      if (!streaming) {
        responder.Add(e);
        continue;
      }
      const std::string sse = responder.SseFor(e);
      for (const nlohmann::json& j : SseChunks(sse)) {
        const nlohmann::json& lp = j["choices"][0]["logprobs"];
        text += j["choices"][0]["text"].get<std::string>();
        if (lp.is_null()) continue;
        for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
          for (const nlohmann::json& v : lp[key]) got[key].push_back(v);
        }
      }
    }
    if (!streaming) {
      const nlohmann::json j = nlohmann::json::parse(responder.Final());
      got = j["choices"][0]["logprobs"];
      text = j["choices"][0]["text"];
    }
    EXPECT_EQ(text, "Once upon a time there was") << streaming;
    const size_t n = prompt.size() + answer.size();
    ASSERT_EQ(got["tokens"].size(), n) << got;
    ASSERT_EQ(got["text_offset"].size(), n) << got;
    EXPECT_TRUE(got["token_logprobs"][0].is_null());
    EXPECT_TRUE(got["top_logprobs"][0].is_null());
    for (size_t i = 1; i < prompt.size(); ++i) {
      EXPECT_FLOAT_EQ(got["token_logprobs"][i].get<float>(), scores[i - 1]) << i;
      EXPECT_EQ(got["top_logprobs"][i].size(), 2u) << got["top_logprobs"][i];
    }
    for (size_t i = 0; i < answer.size(); ++i) {
      EXPECT_FLOAT_EQ(got["token_logprobs"][prompt.size() + i].get<float>(), -1.0f - static_cast<float>(i));
    }
    // Each token's text begins at its offset in the whole text.
    for (size_t i = 0; i < n; ++i) {
      const std::string token = got["tokens"][i];
      const size_t at = got["text_offset"][i];
      EXPECT_EQ(text.compare(at, token.size(), token), 0) << i << " '" << token << "' at " << at << " of " << text;
    }
    lists.push_back(got);
  }
  EXPECT_EQ(lists[0], lists[1]) << "streamed and not";
}

// A list of prompts (OpenAI's batch): each a string or token ids; prompt
// k's choice i is index k n + i, with its own echo; usage counts each
// prompt once. Bad lists are refused naming the prompt.
TEST(OpenAiApi, AListOfPromptsIsABatch) {
  const Tokenizer& tok = Stories();
  absl::StatusOr<OpenAiRequest> request =
      ParseOpenAiRequest(R"({"prompt": ["The cat", [1, 400, 401]], "n": 2, "echo": true, "max_tokens": 3})", false, "m");
  ASSERT_TRUE(request.ok()) << request.status();
  ASSERT_EQ(request->prompts(), 2);
  EXPECT_EQ(request->GenerateFor(0).prompt(), "The cat");
  EXPECT_TRUE(request->GenerateFor(0).prompt_token_ids().empty());
  EXPECT_TRUE(request->GenerateFor(1).prompt().empty());
  const ellm::v1::GenerateRequest second = request->GenerateFor(1);
  EXPECT_EQ(std::vector<int32_t>(second.prompt_token_ids().begin(), second.prompt_token_ids().end()),
            (std::vector<int32_t>{1, 400, 401}));
  EXPECT_EQ(request->GenerateFor(1).max_tokens(), 3) << "the other fields are shared";
  // One prompt in a list is one prompt, as before.
  for (const char* one : {R"(["The cat"])", R"([[1, 400]])", R"([1, 400])", R"("The cat")"}) {
    absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(absl::StrCat(R"({"prompt": )", one, "}"), false, "m");
    ASSERT_TRUE(r.ok()) << one << " " << r.status();
    EXPECT_EQ(r->prompts(), 1) << one;
  }
  for (const auto& [bad, why] : std::vector<std::pair<std::string, std::string>>{
           {"[]", "non-empty list"},
           {R"(["a", 5])", "prompt[1] must be a string or a list of token ids"},
           {R"(["a", []])", "prompt[1] is an empty list"},
           {R"([["a"]])", "prompt[0]: a list of token ids must hold only 32-bit integers"},
           {R"([1, "a"])", "a list of token ids must hold only 32-bit integers"},
           {absl::StrCat("[", absl::StrJoin(std::vector<std::string>(65, "\"x\""), ","), "]"), "at most 64"}}) {
    absl::StatusOr<OpenAiRequest> r = ParseOpenAiRequest(absl::StrCat(R"({"prompt": )", bad, "}"), false, "m");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << bad << ": " << r.status();
  }
  const std::vector<int32_t> cat = tok.Encode("The cat", true, {});
  for (bool streaming : {false, true}) {
    OpenAiRequest r = *request;
    r.stream = streaming;
    r.include_usage = true;
    OpenAiResponder responder(r, "cmpl-1", "m", 0, tok, {{cat.back(), {}}, {401, {}}});
    std::vector<std::string> text(4);
    nlohmann::json usage;
    for (int c : {3, 1, 0, 2}) {
      StreamEvent e{.text = absl::StrCat(" sat", c)};
      e.token_ids = {500};
      e.finished = true;
      e.finish.prompt_tokens = c < 2 ? 3 : 4;
      e.finish.cached_tokens = c % 2 == 1 ? 2 : 0;
      e.finish.completion_tokens = 1 + c;
      if (!streaming) {
        responder.Add(e, c);
        continue;
      }
      const std::string sse = responder.SseFor(e, c);
      for (const nlohmann::json& j : SseChunks(sse)) {
        if (j.contains("usage") && !j["usage"].is_null()) usage = j["usage"];
        if (j["choices"].empty()) continue;
        text[j["choices"][0]["index"].get<int>()] += j["choices"][0]["text"].get<std::string>();
      }
    }
    EXPECT_TRUE(responder.finished());
    if (!streaming) {
      const nlohmann::json j = nlohmann::json::parse(responder.Final());
      ASSERT_EQ(j["choices"].size(), 4u);
      for (int c = 0; c < 4; ++c) text[c] = j["choices"][c]["text"];
      usage = j["usage"];
    }
    const std::string echoed[2] = {"The cat", tok.Decode({1, 400, 401})};
    for (int c = 0; c < 4; ++c) EXPECT_EQ(text[c], absl::StrCat(echoed[c / 2], " sat", c)) << streaming;
    EXPECT_EQ(usage["prompt_tokens"], 3 + 4) << "each prompt once";
    EXPECT_EQ(usage["prompt_tokens_details"]["cached_tokens"], 0) << "as each prompt's choice 0 found it";
    EXPECT_EQ(usage["completion_tokens"], 1 + 2 + 3 + 4);
  }
}

// A prompt of ids that decode to bytes that are not UTF-8 (helper-32's
// audit): the echo reads U+FFFD for them, and the answer's text_offset
// counts those (it counted none: every offset after was short).
TEST(OpenAiApi, EchoOffsetsCountTheReplacementsOfBadBytes) {
  const Tokenizer& tok = Stories();
  const std::vector<int32_t> prompt = {1, 3 + 'd', 3 + 'a', 3 + 0xA9, 3 + 0x80};
  absl::StatusOr<OpenAiRequest> request =
      ParseOpenAiRequest(R"({"prompt": [1, 103, 100, 172, 131], "echo": true, "logprobs": 0})", false, "m");
  ASSERT_TRUE(request.ok()) << request.status();
  const std::vector<int32_t> answer = tok.Encode("and she", false, {});
  for (bool streaming : {false, true}) {
    OpenAiRequest r = *request;
    r.stream = streaming;
    OpenAiResponder responder(r, "cmpl-1", "m", 0, tok, prompt.back(), prompt);
    std::string text;
    nlohmann::json offsets = nlohmann::json::array(), tokens = nlohmann::json::array();
    for (size_t i = 0; i < answer.size(); ++i) {
      StreamEvent e{.text = tok.TokenBytes(i == 0 ? prompt.back() : answer[i - 1], answer[i])};
      e.token_ids = {answer[i]};
      e.logprobs = {-1.0f};
      if (i == 0) e.prompt_logprobs = {-1, -2, -3, -4};
      e.finished = i + 1 == answer.size();
      if (!streaming) {
        responder.Add(e);
        continue;
      }
      for (const nlohmann::json& j : SseChunks(responder.SseFor(e))) {
        text += j["choices"][0]["text"].get<std::string>();
        for (const nlohmann::json& v : j["choices"][0]["logprobs"]["text_offset"]) offsets.push_back(v);
        for (const nlohmann::json& v : j["choices"][0]["logprobs"]["tokens"]) tokens.push_back(v);
      }
    }
    if (!streaming) {
      const nlohmann::json j = nlohmann::json::parse(responder.Final());
      text = j["choices"][0]["text"];
      offsets = j["choices"][0]["logprobs"]["text_offset"];
      tokens = j["choices"][0]["logprobs"]["tokens"];
    }
    EXPECT_EQ(text, "da\uFFFD\uFFFD and she") << streaming;
    ASSERT_EQ(offsets.size(), prompt.size() + answer.size());
    // Code points: "d" 0, "a" 1, the two U+FFFD 2 and 3, " and" 4.
    EXPECT_EQ(offsets[prompt.size()], 4) << offsets << (streaming ? " streamed" : "");
    EXPECT_EQ(tokens[prompt.size()], " and");
  }
}

// Completions' top_logprobs objects list the most likely token first (as
// OpenAI and vLLM do; clients read the first key as the top one), then the
// chosen token when it is not among them; they were in the keys' order.
TEST(OpenAiApi, TopLogprobsListTheMostLikelyFirst) {
  const Tokenizer& tok = Stories();
  const std::vector<int32_t> ids = tok.Encode("Once upon a time", false, {});
  ASSERT_GE(ids.size(), 3u);
  // The alternatives in falling likelihood, their texts in falling
  // alphabetical order (so the keys' order would be the reverse).
  std::vector<int32_t> alts = ids;
  std::sort(alts.begin(), alts.end(), [&](int32_t a, int32_t b) { return tok.TokenBytes(1, a) > tok.TokenBytes(1, b); });
  alts.erase(std::unique(alts.begin(), alts.end(), [&](int32_t a, int32_t b) {
               return tok.TokenBytes(1, a) == tok.TokenBytes(1, b);
             }), alts.end());
  ASSERT_GE(alts.size(), 3u);
  absl::StatusOr<OpenAiRequest> request =
      ParseOpenAiRequest(R"({"prompt": "x", "logprobs": 3})", false, "m");
  ASSERT_TRUE(request.ok()) << request.status();
  for (bool streaming : {false, true}) {
    OpenAiRequest r = *request;
    r.stream = streaming;
    OpenAiResponder responder(r, "cmpl-1", "m", 0, tok, 1);
    StreamEvent e{.text = "x"};
    e.token_ids = {alts[2]};
    e.logprobs = {-3.0f};
    e.top_logprobs = {{{alts[0], -0.1f}, {alts[1], -0.5f}, {alts[2], -3.0f}}};
    e.finished = true;
    std::string body;
    if (streaming) {
      const std::string sse = responder.SseFor(e);
      body = sse.substr(6, sse.find("\n\n") - 6);
    } else {
      responder.Add(e);
      body = responder.Final();
    }
    const nlohmann::ordered_json j = nlohmann::ordered_json::parse(body);
    const nlohmann::ordered_json& top = j["choices"][0]["logprobs"]["top_logprobs"][0];
    ASSERT_EQ(top.size(), 3u) << top;
    std::vector<std::string> keys;
    for (auto it = top.begin(); it != top.end(); ++it) keys.push_back(it.key());
    EXPECT_EQ(keys, (std::vector<std::string>{tok.TokenBytes(1, alts[0]), tok.TokenBytes(1, alts[1]),
                                              tok.TokenBytes(1, alts[2])}))
        << top << (streaming ? " streamed" : "");
    EXPECT_EQ(j.begin().key(), "id") << "the response's members in OpenAI's order";
  }
}

}  // namespace ellm::coord
