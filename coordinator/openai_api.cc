#include "coordinator/openai_api.h"

#include <algorithm>
#include <string_view>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "coordinator/chat_template.h"
#include "coordinator/python_json.h"
#include "core/unicode.h"

namespace ellm::coord {
namespace {

using json = nlohmann::json;
// Responses keep their members in the order written (OpenAI's order; a
// completions top_logprobs object lists the most likely first, as clients
// that read its first key expect).
using ojson = nlohmann::ordered_json;

absl::Status Bad(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("'", field, "' ", what));
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }
std::string Dump(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

// A text field: a string, or (chat content) an array of {"type": "text",
// "text": ...} parts, joined with new lines as vLLM joins them.
absl::StatusOr<std::string> TextOf(const json& v, const std::string& field, bool allow_parts) {
  if (v.is_string()) return v.get<std::string>();
  if (allow_parts && v.is_array()) {
    std::string out;
    for (const json& part : v) {
      // Every member's type is checked before it is read: nlohmann's value()
      // and get() throw on a mismatch, and a throw here would end the process.
      if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
          !part["text"].is_string()) {
        return Bad(field, "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts");
      }
      if (&part != &v.front()) out += '\n';
      out += part["text"].get<std::string>();
    }
    return out;
  }
  return Bad(field, "must be a string");
}

// Walks `text` from `begin` outside its strings, counting the nesting of
// arrays and objects: `stop(depth)` after each bracket (the depth it leaves)
// ends the walk at that bracket when true. Its index, or npos.
template <typename Stop>
size_t FindByNesting(std::string_view text, size_t begin, Stop stop) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = begin; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if ((c == '[' || c == '{') && stop(++depth)) {
      return i;
    } else if ((c == ']' || c == '}') && stop(--depth)) {
      return i;
    }
  }
  return std::string_view::npos;
}

// Whether `body` nests arrays and objects deeper than `limit` (strings'
// contents aside). Checked before parsing: nlohmann builds every level as a
// node of its own, so a body of nothing but '[' costs many times its size.
bool NestsDeeperThan(const std::string& body, int limit) {
  return FindByNesting(body, 0, [limit](int depth) { return depth > limit; }) != std::string_view::npos;
}

// Fields of OpenAI's (or vLLM's) API that would change what is generated and
// that ellm does not implement, with the value that changes nothing: a
// request setting one otherwise is refused, never answered as if the field
// were not there (a client asking for JSON output or tool calls must not get
// free text with a 200).
struct UnsupportedField {
  const char* name;
  bool (*harmless)(const nlohmann::json& v);
};
bool IsNull(const nlohmann::json& v) { return v.is_null(); }
bool IsEmptyOrNull(const nlohmann::json& v) { return v.is_null() || (v.is_structured() && v.empty()); }
bool IsOneOrNull(const nlohmann::json& v) { return v.is_null() || v == 1; }
bool IsTextFormat(const nlohmann::json& v) {
  return v.is_null() || (v.is_object() && v.contains("type") && v["type"] == "text");
}
bool IsNoTool(const nlohmann::json& v) { return v.is_null() || v == "none" || v == "auto"; }
constexpr UnsupportedField kUnsupported[] = {
    {"response_format", IsTextFormat},
    {"functions", IsEmptyOrNull},       {"function_call", IsNoTool},
    {"best_of", IsOneOrNull},           {"guided_json", IsNull},           {"guided_regex", IsNull},
    // vLLM's own form of prompt logprobs (completions' echo with logprobs gives them).
    {"prompt_logprobs", IsNull},
    {"guided_choice", IsNull},          {"guided_grammar", IsNull},
};

// The top-level fields ParseOpenAiRequest reads, besides kUnsupported's.
// The parser reaches the body's fields only through Field, whose constructor
// is consteval: a field read but missing here does not compile, so the list
// the SAX builder keeps (below) cannot drift from what is read.
constexpr std::string_view kReadFields[] = {
    "model", "messages", "prompt", "echo", "suffix", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stream", "stream_options", "n", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "chat_template_kwargs", "logit_bias", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output"};

constexpr bool IsReadField(std::string_view name) {
  for (std::string_view f : kReadFields) {
    if (name == f) return true;
  }
  for (const UnsupportedField& f : kUnsupported) {
    if (name == f.name) return true;
  }
  return false;
}

class Field {
 public:
  consteval Field(const char* name) : name_(name) {  // NOLINT: implicit on purpose
    if (!IsReadField(name)) throw "ParseOpenAiRequest reads a field that kReadFields does not list";
  }
  const char* name() const { return name_; }

 private:
  const char* name_;
};

// The body's top-level object, read by Field.
class Body {
 public:
  explicit Body(const json& j) : j_(j) {}
  // The field's value; null when it is absent or null.
  const json* Get(Field f) const {
    const auto it = j_.find(f.name());
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }

 private:
  const json& j_;
};

// A SAX handler (json::sax_parse) that builds the DOM of a body's read
// fields (IsReadField) and drops the values of all others as they are parsed:
// kept, a body of tiny values in an ignored field (8 MiB of "[]," is 2.8
// million arrays) would build tens of times its size in nodes. (nlohmann's
// parser callback can drop them too, but it scans an object's parent for
// discarded values at the end of every object: quadratic in a list of
// objects, such as a long "messages".)
class ReadFieldsBuilder {
 public:
  explicit ReadFieldsBuilder(json* root) : root_(root) {}

  bool null() { return Value(nullptr); }
  bool boolean(bool v) { return Value(v); }
  bool number_integer(json::number_integer_t v) { return Value(v); }
  bool number_unsigned(json::number_unsigned_t v) { return Value(v); }
  bool number_float(json::number_float_t v, const json::string_t&) { return Value(v); }
  bool string(json::string_t& v) { return Value(std::move(v)); }
  bool binary(json::binary_t& v) { return Value(std::move(v)); }
  bool start_object(std::size_t) { return Open(json::object()); }
  bool start_array(std::size_t) { return Open(json::array()); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }
  bool key(json::string_t& k) {
    if (skip_ == 0 && depth_ == 1 && !IsReadField(k)) skip_ = 1;
    if (skip_ == 0) key_ = std::move(k);
    return true;
  }
  template <typename Exception>
  bool parse_error(std::size_t, const std::string&, const Exception&) {
    return false;
  }

 private:
  // Puts v where the parser is: the root, the end of the open array, or the
  // open object's last key. Pointers to open containers stay valid: only the
  // innermost one grows.
  json* Place(json&& v) {
    if (open_.empty()) {
      *root_ = std::move(v);
      return root_;
    }
    json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    json& slot = parent[key_];
    slot = std::move(v);
    return &slot;
  }
  // While skip_ (the depth of a dropped field's key) is set, events are
  // dropped until its value has ended.
  template <typename T>
  bool Value(T&& v) {
    if (skip_ != 0) {
      if (depth_ == skip_) skip_ = 0;
      return true;
    }
    Place(json(std::forward<T>(v)));
    return true;
  }
  bool Open(json&& empty) {
    ++depth_;
    if (skip_ == 0) open_.push_back(Place(std::move(empty)));
    return true;
  }
  bool Close() {
    --depth_;
    if (skip_ != 0) {
      if (depth_ == skip_) skip_ = 0;
      return true;
    }
    open_.pop_back();
    return true;
  }

  json* root_;
  std::vector<json*> open_;  // the containers being built, outermost first
  std::string key_;
  int depth_ = 0;  // containers open in the text, dropped ones too
  int skip_ = 0;
};

}  // namespace

absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(const std::string& body, bool chat,
                                                 const std::string& model_id) {
  if (NestsDeeperThan(body, kMaxJsonDepth)) {
    return absl::InvalidArgumentError(absl::StrCat("the body nests deeper than ", kMaxJsonDepth, " levels"));
  }
  json j;
  ReadFieldsBuilder builder(&j);
  if (!json::sax_parse(body, &builder)) return absl::InvalidArgumentError("the body is not valid JSON");
  if (!j.is_object()) return absl::InvalidArgumentError("the body must be a JSON object");
  for (const UnsupportedField& f : kUnsupported) {
    if (j.contains(f.name) && !f.harmless(j[f.name])) return Bad(f.name, "is not supported");
  }
  OpenAiRequest r;
  r.chat = chat;
  const Body fields(j);
  ellm::v1::GenerateRequest& g = r.generate;
  // A number in [lo, hi], or (lo, hi] when `above_lo`.
  auto number = [&](Field field, double lo, double hi,
                    bool above_lo = false) -> absl::StatusOr<std::optional<double>> {
    const json* v = fields.Get(field);
    if (v == nullptr) return std::optional<double>();
    if (!v->is_number()) return Bad(field.name(), "must be a number");
    const double x = v->get<double>();
    if (!((above_lo ? x > lo : x >= lo) && x <= hi)) {
      return Bad(field.name(), absl::StrCat("must be in ", above_lo ? "(" : "[", lo, ", ", hi, "]"));
    }
    return std::optional<double>(x);
  };
  auto boolean = [&](Field field) -> absl::StatusOr<bool> {
    const json* v = fields.Get(field);
    if (v == nullptr) return false;
    if (!v->is_boolean()) return Bad(field.name(), "must be true or false");
    return v->get<bool>();
  };

  if (const json* v = fields.Get("model")) {
    if (!v->is_string()) return Bad("model", "must be a string");
    const std::string model = v->get<std::string>();
    if (!model.empty() && model != model_id) {
      return absl::NotFoundError(
          absl::StrCat("the model '", model, "' does not exist; this server serves '", model_id, "'"));
    }
  }
  if (chat) {
    const json* messages = fields.Get("messages");
    if (messages == nullptr || !messages->is_array() || messages->empty()) {
      return Bad("messages", "must be a non-empty list");
    }
    for (size_t i = 0; i < messages->size(); ++i) {
      const json& m = (*messages)[i];
      const std::string field = absl::StrCat("messages[", i, "]");
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
        return Bad(field, "must be an object with a string 'role'");
      }
      ellm::v1::ChatMessage* out = g.add_messages();
      out->set_role(m["role"].get<std::string>());
      if (m.contains("content") && !m["content"].is_null()) {
        ASSIGN_OR_RETURN(std::string content, TextOf(m["content"], field + ".content", true));
        out->set_content(content);
      }
      // An assistant's thinking as this API returns it: "reasoning_content"
      // (vLLM until 0.11), or "reasoning" (later vLLM); the first one given.
      for (const char* name : {"reasoning_content", "reasoning"}) {
        if (!m.contains(name) || m[name].is_null()) continue;
        if (!m[name].is_string()) return Bad(absl::StrCat(field, ".", name), "must be a string");
        out->set_reasoning_content(m[name].get<std::string>());
        break;
      }
      // An assistant's calls: [{"id", "type": "function", "function":
      // {"name", "arguments": a JSON object's text}}]; the id is not part
      // of the prompt.
      if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
        const json& calls = m["tool_calls"];
        if (!calls.is_array()) return Bad(field + ".tool_calls", "must be a list");
        for (size_t c = 0; c < calls.size(); ++c) {
          const json& call = calls[c];
          const std::string call_field = absl::StrCat(field, ".tool_calls[", c, "]");
          if (!call.is_object() || !call.contains("function") || !call["function"].is_object() ||
              (call.contains("type") && call["type"] != "function")) {
            return Bad(call_field, "must be {\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": ...}}");
          }
          const json& f = call["function"];
          if (!f.contains("name") || !f["name"].is_string()) return Bad(call_field + ".function.name", "must be a string");
          // The arguments' JSON text; none (absent, null, "") is {}, as vLLM
          // takes it.
          std::string arguments = "{}";
          if (f.contains("arguments") && !f["arguments"].is_null()) {
            if (!f["arguments"].is_string()) {
              return Bad(call_field + ".function.arguments", "must be a string (the arguments' JSON text)");
            }
            if (!f["arguments"].get<std::string>().empty()) arguments = f["arguments"].get<std::string>();
          }
          if (absl::Status valid = PythonJson(arguments).status(); !valid.ok()) {
            return Bad(call_field + ".function.arguments", absl::StrCat("is ", valid.message()));
          }
          ellm::v1::ToolCall* tc = out->add_tool_calls();
          tc->set_name(f["name"].get<std::string>());
          tc->set_arguments(std::move(arguments));
        }
      }
    }
    // tool_choice: "auto" (the default) lets the model call the tools,
    // "none" lists them but reads the answer as text (as vLLM does);
    // "required" and a named function would need the output constrained.
    bool read_calls = true;
    if (const json* v = fields.Get("tool_choice")) {
      if (*v == "none") {
        read_calls = false;
      } else if (*v != "auto") {
        return Bad("tool_choice", "must be \"auto\" or \"none\" (ellm does not constrain the output to a call)");
      }
    }
    if (const json* tools = fields.Get("tools")) {
      if (!tools->is_array()) return Bad("tools", "must be a list");
      for (size_t i = 0; i < tools->size(); ++i) {
        const json& t = (*tools)[i];
        const std::string field = absl::StrCat("tools[", i, "]");
        if (!t.is_object() || !t.contains("type") || t["type"] != "function" || !t.contains("function") ||
            !t["function"].is_object()) {
          return Bad(field, "must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}}");
        }
        const json& f = t["function"];
        if (!f.contains("name") || !f["name"].is_string() || f["name"].get<std::string>().empty()) {
          return Bad(field + ".function.name", "must be a non-empty string");
        }
        if (f.contains("description") && !f["description"].is_null() && !f["description"].is_string()) {
          return Bad(field + ".function.description", "must be a string");
        }
        if (f.contains("parameters") && !f["parameters"].is_null() && !f["parameters"].is_object()) {
          return Bad(field + ".function.parameters", "must be an object (a JSON Schema)");
        }
      }
      if (!tools->empty()) {
        // Again, for the tools alone, in their keys' order (the template
        // writes each tool as the client wrote it): read as events, never
        // built into a tree, so a tool of many keys costs its size.
        ASSIGN_OR_RETURN(const PythonJsonItems top, PythonJsonItemsOf(body, "tools"));
        for (const PythonJsonItems::Item& item : top.items) {
          if (item.key != "tools") continue;
          ASSIGN_OR_RETURN(PythonJsonItems each, PythonJsonItemsOf(item.text));
          for (PythonJsonItems::Item& tool : each.items) g.add_tools(std::move(tool.text));
        }
        r.read_tool_calls = read_calls;
      }
    }
    // The template's variables (vLLM's chat_template_kwargs): enable_thinking
    // is the one ellm's templates read (Qwen3's); others are ignored, as a
    // template ignores variables it does not use.
    if (const json* kwargs = fields.Get("chat_template_kwargs")) {
      if (!kwargs->is_object()) return Bad("chat_template_kwargs", "must be an object");
      if (kwargs->contains("enable_thinking") && !(*kwargs)["enable_thinking"].is_null()) {
        if (!(*kwargs)["enable_thinking"].is_boolean()) {
          return Bad("chat_template_kwargs.enable_thinking", "must be true or false");
        }
        g.set_enable_thinking((*kwargs)["enable_thinking"].get<bool>());
      }
    }
    if (const json* v = fields.Get("parallel_tool_calls")) {
      if (!v->is_boolean()) return Bad("parallel_tool_calls", "must be true or false");
      r.one_tool_call = !v->get<bool>();
    }
  } else {
    const json* prompt = fields.Get("prompt");
    if (prompt == nullptr) return Bad("prompt", "is required");
    const json& p = *prompt;
    // A string or a list of token ids is one prompt; a list of those is a
    // batch of prompts (OpenAI's form), each answered with n choices.
    const bool one = p.is_string() || (p.is_array() && !p.empty() && p[0].is_number_integer());
    if (!one && !(p.is_array() && !p.empty())) {
      return Bad("prompt", "must be a string, a list of token ids, or a non-empty list of those");
    }
    if (!one && p.size() > static_cast<size_t>(kMaxPrompts)) {
      return Bad("prompt", absl::StrCat("lists ", p.size(), " prompts; at most ", kMaxPrompts));
    }
    const size_t count = one ? 1 : p.size();
    for (size_t k = 0; k < count; ++k) {
      const json& item = one ? p : p[k];
      ellm::v1::GenerateRequest& into = k == 0 ? g : r.more_prompts.emplace_back();
      const std::string where = one ? "prompt" : absl::StrCat("prompt[", k, "]");
      if (item.is_array()) {
        for (const json& id : item) {
          if (!id.is_number_integer() || id.get<int64_t>() < INT32_MIN || id.get<int64_t>() > INT32_MAX) {
            return Bad("prompt", absl::StrCat(where, ": a list of token ids must hold only 32-bit integers"));
          }
          into.add_prompt_token_ids(static_cast<int32_t>(id.get<int64_t>()));
        }
        if (into.prompt_token_ids().empty()) return Bad("prompt", absl::StrCat(where, " is an empty list of token ids"));
      } else if (item.is_string()) {
        ASSIGN_OR_RETURN(std::string text, TextOf(item, "prompt", false));
        into.set_prompt(text);
      } else {
        return Bad("prompt", absl::StrCat(where, " must be a string or a list of token ids"));
      }
    }
    ASSIGN_OR_RETURN(r.echo, boolean("echo"));
    if (fields.Get("suffix") != nullptr) return Bad("suffix", "is not supported");
    for (Field field : {Field("tools"), Field("tool_choice")}) {
      if (const json* v = fields.Get(field); v != nullptr && !(v->is_array() && v->empty()) && *v != "none") {
        return Bad(field.name(), "applies to chat completions");
      }
    }
  }

  std::optional<int64_t> asked;
  for (Field field : {Field("max_tokens"), Field("max_completion_tokens")}) {
    const json* f = fields.Get(field);
    if (f == nullptr) continue;
    if (!f->is_number_integer()) return Bad(field.name(), "must be an integer");
    const int64_t v = f->get<int64_t>();
    if (v < 0 || (v == 0 && !r.echo)) return Bad(field.name(), r.echo ? "must not be negative" : "must be positive");
    if (v > INT32_MAX) return Bad(field.name(), absl::StrCat("must be at most ", INT32_MAX));
    if (asked && *asked != v) {
      return Bad(field.name(), absl::StrCat("is ", v, " but max_tokens is ", *asked, " (send one of them)"));
    }
    asked = v;
  }
  if (asked) {
    // echo with max_tokens 0 (vLLM's): the prompt alone (with logprobs, its
    // scores); one token is generated and not returned.
    r.prompt_only = *asked == 0;
    g.set_max_tokens(static_cast<int32_t>(r.prompt_only ? 1 : *asked));
  }
  // vLLM's: min_tokens (at most max_tokens, checked by Validate, which
  // knows the default), ignore_eos, include_stop_str_in_output,
  // stop_token_ids (the vocabulary checked by Validate).
  if (const json* v = fields.Get("min_tokens")) {
    if (!v->is_number_integer() || v->get<int64_t>() < 0 || v->get<int64_t>() > INT32_MAX) {
      return Bad("min_tokens", "must be an integer, at least 0");
    }
    if (asked && v->get<int64_t>() > *asked) {
      return Bad("min_tokens", absl::StrCat("is ", v->get<int64_t>(), ", more than max_tokens (", *asked, ")"));
    }
    g.set_min_tokens(static_cast<int32_t>(v->get<int64_t>()));
  }
  ASSIGN_OR_RETURN(const bool ignore_eos, boolean("ignore_eos"));
  g.set_ignore_eos(ignore_eos);
  ASSIGN_OR_RETURN(const bool include_stop, boolean("include_stop_str_in_output"));
  g.set_include_stop_str_in_output(include_stop);
  if (const json* v = fields.Get("stop_token_ids")) {
    if (!v->is_array()) return Bad("stop_token_ids", "must be a list of token ids");
    if (v->size() > static_cast<size_t>(kMaxStopTokenIds)) {
      return Bad("stop_token_ids", absl::StrCat("lists ", v->size(), " tokens; at most ", kMaxStopTokenIds));
    }
    for (const json& id : *v) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
        return Bad("stop_token_ids", "must be a list of token ids (integers, at least 0)");
      }
      g.add_stop_token_ids(static_cast<int32_t>(id.get<int64_t>()));
    }
  }
  ASSIGN_OR_RETURN(std::optional<double> temperature, number("temperature", 0, 100));
  if (temperature) g.mutable_sampling()->set_temperature(static_cast<float>(*temperature));
  ASSIGN_OR_RETURN(std::optional<double> top_p, number("top_p", 0, 1, /*above_lo=*/true));
  if (top_p) g.mutable_sampling()->set_top_p(static_cast<float>(*top_p));
  if (const json* v = fields.Get("top_k")) {
    if (!v->is_number_integer() || v->get<int64_t>() < 0 || v->get<int64_t>() > INT32_MAX) {
      return Bad("top_k", "must be a non-negative integer");
    }
    g.mutable_sampling()->set_top_k(static_cast<int32_t>(v->get<int64_t>()));
  }
  ASSIGN_OR_RETURN(std::optional<double> min_p, number("min_p", 0, 1));
  if (min_p) g.mutable_sampling()->set_min_p(static_cast<float>(*min_p));
  if (const json* v = fields.Get("seed")) {
    if (!v->is_number_integer()) return Bad("seed", "must be an integer");
    g.mutable_sampling()->set_seed(v->is_number_unsigned() ? v->get<uint64_t>()
                                                           : static_cast<uint64_t>(v->get<int64_t>()));
  }
  if (const json* stop = fields.Get("stop")) {
    if (stop->is_string()) {
      g.add_stop(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& s : *stop) {
        if (!s.is_string()) return Bad("stop", "must be a string or a list of strings");
        g.add_stop(s.get<std::string>());
      }
    } else {
      return Bad("stop", "must be a string or a list of strings");
    }
  }
  ASSIGN_OR_RETURN(r.stream, boolean("stream"));
  if (const json* o = fields.Get("stream_options")) {
    if (!o->is_object()) return Bad("stream_options", "must be an object");
    if (o->contains("include_usage")) {
      if (!(*o)["include_usage"].is_boolean()) return Bad("stream_options.include_usage", "must be true or false");
      r.include_usage = (*o)["include_usage"].get<bool>();
    }
  }
  if (const json* v = fields.Get("n")) {
    if (!v->is_number_integer() || v->get<int64_t>() < 1 || v->get<int64_t>() > kMaxChoices) {
      return Bad("n", absl::StrCat("must be an integer in [1, ", kMaxChoices, "]"));
    }
    r.n = static_cast<int>(v->get<int64_t>());
    // best_of (only 1 is taken) counts the candidates n is chosen from.
    if (r.n > 1 && fields.Get("best_of") != nullptr) return Bad("best_of", "must not be less than n");
  }
  // vLLM's repetition_penalty (Hugging Face's): over the prompt's tokens
  // and the generated ones.
  ASSIGN_OR_RETURN(std::optional<double> repetition, number("repetition_penalty", kMinRepetitionPenalty, 10));
  if (repetition) g.mutable_sampling()->set_repetition_penalty(static_cast<float>(*repetition));
  // {"token id": bias}: the ids as decimal strings (JSON keys), the vocabulary
  // checked by Validate.
  if (const json* bias = fields.Get("logit_bias")) {
    if (!bias->is_object()) return Bad("logit_bias", "must be an object of token ids and biases");
    if (bias->size() > static_cast<size_t>(kMaxLogitBias)) {
      return Bad("logit_bias", absl::StrCat("lists ", bias->size(), " tokens; at most ", kMaxLogitBias));
    }
    for (const auto& [key, value] : bias->items()) {
      int32_t id = 0;
      // Decimal digits without leading zeros: "0432" would name 432 again.
      const bool digits = !key.empty() && key.size() <= 10 && (key == "0" || key[0] != '0') &&
                          std::all_of(key.begin(), key.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      if (!digits || !absl::SimpleAtoi(key, &id)) {
        return Bad("logit_bias", absl::StrCat("has a key that is not a token id: \"", key.substr(0, 32), "\""));
      }
      if (!value.is_number() || !(value.get<double>() >= -100 && value.get<double>() <= 100)) {
        return Bad("logit_bias", absl::StrCat("the bias of token ", id, " must be a number in [-100, 100]"));
      }
      (*g.mutable_logit_bias())[id] = static_cast<float>(value.get<double>());
    }
  }
  ASSIGN_OR_RETURN(std::optional<double> presence, number("presence_penalty", -2, 2));
  if (presence) g.mutable_sampling()->set_presence_penalty(static_cast<float>(*presence));
  ASSIGN_OR_RETURN(std::optional<double> frequency, number("frequency_penalty", -2, 2));
  if (frequency) g.mutable_sampling()->set_frequency_penalty(static_cast<float>(*frequency));
  // The number of alternatives: chat's top_logprobs, completions' logprobs.
  const Field top_field = chat ? Field("top_logprobs") : Field("logprobs");
  if (chat) {
    ASSIGN_OR_RETURN(r.logprobs, boolean("logprobs"));
  }
  if (const json* v = fields.Get(top_field)) {
    if (!v->is_number_integer() || v->get<int64_t>() < 0 || v->get<int64_t>() > kMaxTopLogprobs) {
      return Bad(top_field.name(), absl::StrCat("must be an integer in [0, ", kMaxTopLogprobs, "]"));
    }
    r.top_logprobs = static_cast<int>(v->get<int64_t>());
    if (!chat) r.logprobs = true;
    if (chat && !r.logprobs && r.top_logprobs > 0) return Bad(top_field.name(), "needs logprobs: true");
    g.set_top_logprobs(r.top_logprobs);
  }
  // echo with logprobs lists the prompt's tokens first, scored (vLLM's;
  // what lm-evaluation-harness asks for its log-likelihoods).
  if (r.echo && r.logprobs) g.set_prompt_logprobs(true);
  return r;
}

const char* OpenAiFinishReason(FinishReason reason) {
  switch (reason) {
    case FinishReason::kMaxTokens:
    case FinishReason::kContext: return "length";
    default: return "stop";
  }
}

namespace {

// One call's JSON object: its name and the first of args_keys' values
// (Python's json.dumps); nullopt when it is not {"name": string, <args_key>:
// ...}. Read as events (PythonJsonItemsOf): a model's arguments of many
// keys cost their size.
std::optional<ToolCallsAnswer::Call> CallOf(std::string_view json_text, std::initializer_list<const char*> args_keys) {
  const absl::StatusOr<PythonJsonItems> call = PythonJsonItemsOf(json_text);
  if (!call.ok() || !call->object) return std::nullopt;
  auto member = [&call](std::string_view key) -> const std::string* {
    for (const PythonJsonItems::Item& item : call->items) {
      if (item.key == key) return &item.text;
    }
    return nullptr;
  };
  const std::string* name = member("name");
  const std::string* arguments = nullptr;
  for (const char* key : args_keys) {
    if (arguments == nullptr) arguments = member(key);
  }
  if (name == nullptr || arguments == nullptr) return std::nullopt;
  std::optional<std::string> decoded = JsonStringValue(*name);
  if (!decoded) return std::nullopt;
  return ToolCallsAnswer::Call{*std::move(decoded), *arguments};
}

// The end of the JSON object that starts at text[begin] ('{'): one past its
// closing brace, or npos when it does not close.
size_t ObjectEnd(std::string_view text, size_t begin) {
  const size_t last = FindByNesting(text, begin, [](int depth) { return depth == 0; });
  return last == std::string_view::npos ? last : last + 1;
}

}  // namespace

std::optional<ToolCallsAnswer> ParseToolCalls(std::string_view text, ToolCallSyntax syntax) {
  ToolCallsAnswer out;
  if (syntax == ToolCallSyntax::kLlamaJson) {
    // As vLLM's llama3_json: objects from the first character on, each
    // followed by two characters of separator; anything else is text.
    if (text.empty() || text.front() != '{') return std::nullopt;
    for (size_t at = 0; at < text.size();) {
      if (text[at] != '{') return std::nullopt;
      const size_t end = ObjectEnd(text, at);
      if (end == std::string_view::npos) return std::nullopt;
      std::optional<ToolCallsAnswer::Call> call = CallOf(text.substr(at, end - at), {"arguments", "parameters"});
      if (!call) return std::nullopt;
      out.calls.push_back(*std::move(call));
      at = end + 2;
    }
    return out;
  }
  constexpr std::string_view kOpen = "<tool_call>", kClose = "</tool_call>";
  size_t at = text.find(kOpen);
  if (at == std::string_view::npos) return std::nullopt;
  out.content = std::string(text.substr(0, at));
  while (at != std::string_view::npos) {
    const size_t begin = at + kOpen.size();
    const size_t end = text.find(kClose, begin);
    std::optional<ToolCallsAnswer::Call> call =
        CallOf(text.substr(begin, end == std::string_view::npos ? end : end - begin), {"arguments"});
    if (!call) return std::nullopt;
    out.calls.push_back(*std::move(call));
    if (end == std::string_view::npos) break;
    at = text.find(kOpen, end + kClose.size());
  }
  return out;
}

ellm::v1::GenerateRequest OpenAiRequest::GenerateFor(int k) const {
  if (k == 0) return generate;
  ellm::v1::GenerateRequest g = generate;
  const ellm::v1::GenerateRequest& p = more_prompts.at(static_cast<size_t>(k - 1));
  g.set_prompt(p.prompt());
  *g.mutable_prompt_token_ids() = p.prompt_token_ids();
  return g;
}

namespace {
int64_t CodePoints(std::string_view whole_utf8);
}  // namespace

OpenAiResponder::OpenAiResponder(const OpenAiRequest& request, std::string id, std::string model_id,
                                 int64_t created, const Tokenizer& tokenizer, std::vector<ResponderPrompt> prompts)
    : request_(request), tokenizer_(tokenizer), id_(std::move(id)), model_id_(std::move(model_id)),
      created_(created), prompts_(std::move(prompts)) {
  if (prompts_.empty()) prompts_.emplace_back();
  echo_.resize(prompts_.size());
  const int n = std::max(1, request_.n);
  choices_.reserve(prompts_.size() * static_cast<size_t>(n));
  for (int k = 0; k < static_cast<int>(prompts_.size()); ++k) {
    if (request_.echo) {
      const ellm::v1::GenerateRequest g = k < request_.prompts() ? request_.GenerateFor(k) : request_.generate;
      const auto& ids = g.prompt_token_ids();
      echo_[k] = ids.empty() ? g.prompt() : tokenizer.Decode(std::vector<int32_t>(ids.begin(), ids.end()));
      // Ids may decode to bytes that are not UTF-8: the echo is the text the
      // client reads (U+FFFD for them, as Dump writes it), so that the
      // answer's text_offset counts them.
      if (!IsValidUtf8(echo_[k])) echo_[k] = json::parse(Dump(json(echo_[k]))).get<std::string>();
    }
    for (int i = 0; i < n; ++i) {
      choices_.emplace_back(tokenizer, k, prompts_[k].last_token);
      // The answer's offsets count from the start of the echoed prompt.
      if (request_.echo) choices_.back().text_offset = CodePoints(echo_[k]);
    }
  }
}

namespace {

// A token's text in completions' logprobs: itself when it is whole UTF-8,
// else "bytes:" and its bytes as \xNN escapes (OpenAI's form). Replacing the
// bytes with U+FFFD would lose them, and would give every such alternative
// of a position the same key in top_logprobs.
std::string CompletionTokenText(const std::string& piece) {
  if (IsValidUtf8(piece)) return piece;
  std::string out = "bytes:";
  for (unsigned char c : piece) absl::StrAppendFormat(&out, "\\x%02x", c);
  return out;
}

int64_t CodePoints(std::string_view whole_utf8) {
  int64_t n = 0;
  for (unsigned char c : whole_utf8) n += (c & 0xC0) != 0x80;
  return n;
}

}  // namespace

ojson OpenAiResponder::Usage() const {
  // Each prompt once, as its first choice found it (the others find it
  // cached: Scheduler::SubmitChoices holds them until its prefill is in).
  const size_t n = static_cast<size_t>(std::max(1, request_.n));
  int prompt = 0, cached = 0, completion = 0;
  for (size_t i = 0; i < choices_.size(); ++i) {
    const FinishInfo& f = choices_[i].finish;
    if (i % n == 0) {
      prompt += f.prompt_tokens;
      cached += f.cached_tokens;
    }
    if (!request_.prompt_only) completion += f.completion_tokens;
  }
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

ojson OpenAiResponder::LogprobsOf(Choice& c, const std::vector<int32_t>& ids, const std::vector<float>& logprobs,
                                  const std::vector<std::vector<TokenLogprob>>& top) const {
  auto bytes_of = [](const std::string& piece) {
    ojson bytes = ojson::array();
    for (unsigned char c : piece) bytes.push_back(static_cast<int>(c));
    return bytes;
  };
  ojson content = ojson::array();
  ojson tokens = ojson::array(), token_logprobs = ojson::array(), top_logprobs = ojson::array(),
       text_offset = ojson::array();
  for (size_t i = 0; i < ids.size(); ++i) {
    // Every candidate at this position reads as it would after the same
    // previous token (a SentencePiece word start depends on it).
    const int32_t prev = c.prev_token;
    const std::string piece = tokenizer_.TokenBytes(prev, ids[i]);
    c.prev_token = ids[i];
    const float lp = i < logprobs.size() ? logprobs[i] : 0.0f;
    static const std::vector<TokenLogprob> kNone;
    const std::vector<TokenLogprob>& alternatives = i < top.size() ? top[i] : kNone;
    if (request_.chat) {
      ojson alt = ojson::array();
      for (const TokenLogprob& a : alternatives) {
        const std::string p = tokenizer_.TokenBytes(prev, a.token);
        alt.push_back({{"token", p}, {"logprob", a.logprob}, {"bytes", bytes_of(p)}});
      }
      content.push_back({{"token", piece}, {"logprob", lp}, {"bytes", bytes_of(piece)}, {"top_logprobs", alt}});
      continue;
    }
    // Completions: {text: logprob} of the alternatives and the chosen token.
    ojson alt = ojson::object();
    for (const TokenLogprob& a : alternatives) {
      alt[CompletionTokenText(tokenizer_.TokenBytes(prev, a.token))] = a.logprob;
    }
    alt[CompletionTokenText(piece)] = lp;
    tokens.push_back(CompletionTokenText(piece));
    token_logprobs.push_back(lp);
    top_logprobs.push_back(alt);
    // A U+FFFD this token's bytes flush belongs to the tokens before it.
    int earlier = 0;
    const std::string text = c.offset_decoder.Push(ids[i], &earlier);
    text_offset.push_back(c.text_offset + earlier);
    c.text_offset += CodePoints(text);
  }
  if (request_.chat) return {{"content", content}};
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top_logprobs},
          {"text_offset", text_offset}};
}

ojson OpenAiResponder::PromptLogprobsOf(const Choice& c, const std::vector<float>& logprobs,
                                        const std::vector<std::vector<TokenLogprob>>& top) const {
  const std::vector<int32_t>& prompt = prompts_[static_cast<size_t>(c.prompt)].tokens;
  // The first token's entries are placeholders, then null: nothing comes
  // before it (as vLLM gives it).
  Choice start(tokenizer_, c.prompt, -1);
  std::vector<float> lp(1, 0.0f);
  lp.insert(lp.end(), logprobs.begin(), logprobs.end());
  std::vector<std::vector<TokenLogprob>> alt(1);
  alt.insert(alt.end(), top.begin(), top.end());
  ojson out = LogprobsOf(start, prompt, lp, alt);
  if (!prompt.empty()) out["token_logprobs"][0] = out["top_logprobs"][0] = nullptr;
  return out;
}

namespace {
// Completions' logprobs of `first` then `then`, list by list.
ojson JoinLogprobs(ojson first, const ojson& then) {
  if (then.is_null()) return first;
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
    for (const ojson& v : then[key]) first[key].push_back(v);
  }
  return first;
}
}  // namespace

ojson OpenAiResponder::ToolCallsJson(const ToolCallsAnswer& answer, int index, bool streaming) const {
  ojson calls = ojson::array();
  // An id per call, unique as the request's id is: "call_" + its random part
  // (and the choice's index after the first).
  std::string base = id_.substr(id_.find('-') + 1);
  if (index > 0) absl::StrAppend(&base, "_", index);
  // parallel_tool_calls false: the first call only.
  const size_t n = request_.one_tool_call ? std::min<size_t>(1, answer.calls.size()) : answer.calls.size();
  for (size_t i = 0; i < n; ++i) {
    ojson call = {{"id", absl::StrCat("call_", base, "_", i)},
                 {"type", "function"},
                 {"function", {{"name", answer.calls[i].name}, {"arguments", answer.calls[i].arguments}}}};
    if (streaming) call["index"] = i;
    calls.push_back(std::move(call));
  }
  return calls;
}

namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";

// The length of the longest tail of `text` that is a start of `marker`
// (shorter than the whole marker).
size_t TailStartingMarker(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

ReasoningAnswer SplitReasoning(std::string_view text) {
  if (!text.starts_with(kThinkOpen)) return {std::nullopt, std::string(text)};
  text.remove_prefix(kThinkOpen.size());
  const size_t end = text.find(kThinkClose);
  if (end == std::string_view::npos) return {std::string(text), ""};
  return {std::string(text.substr(0, end)), std::string(text.substr(end + kThinkClose.size()))};
}

std::pair<std::string, std::string> OpenAiResponder::SplitReasoningDelta(Choice& c, const std::string& text,
                                                                         bool last) {
  using Thinking = Choice::Thinking;
  std::string all = std::move(c.think_held) + text;
  c.think_held.clear();
  if (c.thinking == Thinking::kUndecided) {
    if (!last && all.size() < kThinkOpen.size() && kThinkOpen.starts_with(all)) {
      c.think_held = std::move(all);  // may still open the block
      return {};
    }
    c.thinking = std::string_view(all).starts_with(kThinkOpen) ? Thinking::kIn : Thinking::kOut;
    if (c.thinking == Thinking::kIn) all.erase(0, kThinkOpen.size());
  }
  if (c.thinking == Thinking::kOut) return {"", std::move(all)};
  const size_t end = all.find(kThinkClose);
  if (end != std::string::npos) {
    c.thinking = Thinking::kOut;
    return {all.substr(0, end), all.substr(end + kThinkClose.size())};
  }
  // A tail that may begin "</think>" waits for the next event.
  const size_t keep = last ? 0 : TailStartingMarker(all, kThinkClose);
  c.think_held = all.substr(all.size() - keep);
  all.resize(all.size() - keep);
  return {std::move(all), ""};
}

std::string OpenAiResponder::ShowableText(Choice& c, const std::string& text) {
  constexpr std::string_view kOpen = "<tool_call>";
  if (c.in_calls) {
    c.held += text;
    return "";
  }
  if (request_.tool_syntax == ToolCallSyntax::kLlamaJson) {
    // Calls are the whole answer: its first character decides.
    if (c.shown || text.empty()) return text;
    if (text.front() == '{') {
      c.in_calls = true;
      c.held = text;
      return "";
    }
    c.shown = true;
    return text;
  }
  std::string all = std::move(c.held) + text;
  c.held.clear();
  const size_t at = all.find(kOpen);
  if (at != std::string::npos) {
    c.held = all.substr(at);
    c.in_calls = true;
    all.resize(at);
    return all;
  }
  // The longest tail that is the start of "<tool_call>".
  const size_t n = TailStartingMarker(all, kOpen);
  c.held = all.substr(all.size() - n);
  all.resize(all.size() - n);
  return all;
}

ojson OpenAiResponder::Chunk(const ojson& choice) const {
  return {{"id", id_},
          {"object", request_.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created_},
          {"model", model_id_},
          {"choices", ojson::array({choice})}};
}

void OpenAiResponder::Finished(Choice& c, const FinishInfo& finish) {
  if (c.finished) return;
  c.finished = true;
  c.finish = finish;
  ++finished_;
}

std::string OpenAiResponder::SseFor(const coord::StreamEvent& e, int index) {
  Choice& c = choices_.at(static_cast<size_t>(index));
  std::string out;
  auto emit = [&out](const ojson& j) { absl::StrAppend(&out, "data: ", Dump(j), "\n\n"); };
  if (request_.chat && !c.sent_role) {
    c.sent_role = true;
    emit(Chunk({{"index", index}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                {"finish_reason", nullptr}}));
  }
  std::string reasoning, text = request_.prompt_only ? std::string() : e.text;
  if (request_.read_reasoning) std::tie(reasoning, text) = SplitReasoningDelta(c, e.text, e.finished);
  if (request_.read_tool_calls) text = ShowableText(c, text);
  const bool echoes = request_.echo && !c.echoed;
  if (echoes) {
    c.echoed = true;
    text = echo_[c.prompt] + text;
  }
  std::optional<ToolCallsAnswer> calls;
  if (e.finished && request_.read_tool_calls) {
    if (c.in_calls) calls = ParseToolCalls(c.held, request_.tool_syntax);
    if (!calls) text += c.held;  // not calls after all: the rest is text
    c.held.clear();
  }
  // (Tokens whose text is held show only for their logprobs.)
  const bool holds = request_.read_tool_calls || request_.read_reasoning;
  if (!text.empty() || !reasoning.empty() || e.finished ||
      (!e.token_ids.empty() && (request_.logprobs || !holds))) {
    ojson choice = {{"index", index}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
    if (request_.chat) {
      choice["delta"] = ojson::object();
      // Under both of vLLM's names (its clients read one or the other).
      if (!reasoning.empty()) choice["delta"]["reasoning"] = choice["delta"]["reasoning_content"] = reasoning;
      if (!text.empty()) choice["delta"]["content"] = text;
    } else {
      choice["text"] = text;
    }
    if (request_.logprobs && !e.token_ids.empty() && !request_.prompt_only) {
      choice["logprobs"] = LogprobsOf(c, e.token_ids, e.logprobs, e.top_logprobs);
    }
    if (request_.logprobs && echoes) {
      choice["logprobs"] =
          JoinLogprobs(PromptLogprobsOf(c, e.prompt_logprobs, e.prompt_top_logprobs), choice["logprobs"]);
    }
    if (calls) {
      // The calls in one chunk of their own, then the finish.
      ojson with_calls = choice;
      with_calls["delta"]["tool_calls"] = ToolCallsJson(*calls, index, /*streaming=*/true);
      emit(Chunk(with_calls));
      choice = {{"index", index}, {"delta", ojson::object()}, {"logprobs", nullptr}, {"finish_reason", "tool_calls"}};
    } else if (e.finished) {
      choice["finish_reason"] = FinishReasonOf(e.finish);
    }
    emit(Chunk(choice));
  }
  if (e.finished) {
    Finished(c, e.finish);
    if (finished()) {
      if (request_.include_usage) {
        ojson usage = Chunk({});
        usage["choices"] = ojson::array();
        usage["usage"] = Usage();
        emit(usage);
      }
      out += "data: [DONE]\n\n";
    }
  }
  return out;
}

const char* OpenAiResponder::FinishReasonOf(const FinishInfo& finish) const {
  return request_.prompt_only ? "length" : OpenAiFinishReason(finish.reason);
}

void OpenAiResponder::Add(const coord::StreamEvent& e, int index) {
  Choice& c = choices_.at(static_cast<size_t>(index));
  if (!request_.prompt_only) {  // (its generated token is not returned)
    c.text += e.text;
    c.ids.insert(c.ids.end(), e.token_ids.begin(), e.token_ids.end());
    c.logprobs.insert(c.logprobs.end(), e.logprobs.begin(), e.logprobs.end());
    c.top.insert(c.top.end(), e.top_logprobs.begin(), e.top_logprobs.end());
  }
  if (!e.prompt_logprobs.empty()) {
    c.prompt_logprobs = e.prompt_logprobs;
    c.prompt_top = e.prompt_top_logprobs;
  }
  if (e.finished) Finished(c, e.finish);
}

std::string OpenAiResponder::Final() {
  ojson choices = ojson::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    Choice& c = choices_[i];
    const int index = static_cast<int>(i);
    ojson choice = {{"index", index}, {"finish_reason", FinishReasonOf(c.finish)}, {"logprobs", nullptr}};
    ReasoningAnswer answer = request_.read_reasoning ? SplitReasoning(c.text) : ReasoningAnswer{{}, c.text};
    const std::optional<ToolCallsAnswer> calls =
        request_.read_tool_calls ? ParseToolCalls(answer.content, request_.tool_syntax) : std::nullopt;
    if (calls) {
      choice["message"] = {{"role", "assistant"},
                           {"content", calls->content.empty() ? ojson(nullptr) : ojson(calls->content)},
                           {"tool_calls", ToolCallsJson(*calls, index, /*streaming=*/false)}};
      choice["finish_reason"] = "tool_calls";
    } else if (request_.chat) {
      // After thinking, no answer is null (as vLLM gives it).
      choice["message"] = {{"role", "assistant"},
                           {"content", answer.reasoning && answer.content.empty() ? ojson(nullptr)
                                                                                  : ojson(answer.content)}};
    } else {
      choice["text"] = echo_[c.prompt] + c.text;
    }
    if (answer.reasoning) choice["message"]["reasoning"] = choice["message"]["reasoning_content"] = *answer.reasoning;
    if (request_.logprobs) choice["logprobs"] = LogprobsOf(c, c.ids, c.logprobs, c.top);
    if (request_.logprobs && request_.echo) {
      choice["logprobs"] = JoinLogprobs(PromptLogprobsOf(c, c.prompt_logprobs, c.prompt_top), choice["logprobs"]);
    }
    choices.push_back(std::move(choice));
  }
  ojson body = {{"id", id_},
               {"object", request_.chat ? "chat.completion" : "text_completion"},
               {"created", created_},
               {"model", model_id_},
               {"choices", std::move(choices)},
               {"usage", Usage()}};
  return Dump(body);
}

int HttpStatusOf(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk: return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange: return 400;
    case absl::StatusCode::kUnauthenticated: return 401;
    case absl::StatusCode::kPermissionDenied: return 403;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kResourceExhausted:
      // A full wait queue is "try again later"; a request that can never
      // fit the KV cache is the client's to change.
      return absl::StrContains(status.message(), "wait queue") ? 429 : 400;
    case absl::StatusCode::kUnavailable: return 503;
    case absl::StatusCode::kCancelled: return 499;
    default: return 500;
  }
}

std::string OpenAiErrorBody(const absl::Status& status) {
  const int http = HttpStatusOf(status);
  const char* type = http == 400 || http == 404 ? "invalid_request_error"
                     : http == 401          ? "authentication_error"
                     : http == 429          ? "rate_limit_error"
                     : http == 503          ? "service_unavailable"
                                            : "server_error";
  // The request field a refusal names first ("'max_tokens' must be ...",
  // as Bad writes it; or, as the service's checks write it, a field the
  // parser reads followed by a space or a colon: "min_tokens must be ..."),
  // for OpenAI's "param".
  ojson param = nullptr;
  const std::string_view message(status.message().data(), status.message().size());
  if (http == 400 && message.size() > 2 && message[0] == '\'') {
    const size_t end = message.find('\'', 1);
    const std::string_view name = message.substr(1, end == std::string_view::npos ? 0 : end - 1);
    if (!name.empty() && name.size() <= 200 && name.find(' ') == std::string_view::npos) param = std::string(name);
  } else if (http == 400) {
    const std::string_view name = message.substr(0, message.find_first_of(" :"));
    if (name.size() < message.size() && IsReadField(name)) param = std::string(name);
  }
  return Dump(ojson{{"error", {{"message", std::string(message)}, {"type", type}, {"param", param},
                          {"code", absl::StatusCodeToString(status.code())}}}});
}

}  // namespace ellm::coord
