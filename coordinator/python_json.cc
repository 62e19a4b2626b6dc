#include "coordinator/python_json.h"

#include <charconv>
#include <cstdio>
#include <optional>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace ellm::coord {
namespace {

using Json = nlohmann::json;

void AppendString(std::string_view s, std::string* out) {
  out->push_back('"');
  for (const char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\b': out->append("\\b"); break;
      case '\f': out->append("\\f"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out->append(buf);
        } else {
          out->push_back(ch);
        }
    }
  }
  out->push_back('"');
}

// Python's repr of a finite double: the shortest digits that read back
// (std::to_chars), placed as CPython's float_repr places them.
std::string FloatRepr(double v) {
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  const std::string_view sci(buf, static_cast<size_t>(r.ptr - buf));  // [-]d[.ddd]e(+|-)XX
  const size_t e = sci.find('e');
  std::string digits;
  bool negative = false;
  for (const char c : sci.substr(0, e)) {
    if (c == '-') negative = true;
    if (c >= '0' && c <= '9') digits.push_back(c);
  }
  int exponent = 0;
  std::from_chars(sci.data() + e + (sci[e + 1] == '+' ? 2 : 1), sci.data() + sci.size(), exponent);
  const int decpt = exponent + 1;  // digits[0] is at 10^(decpt - 1)
  const int n = static_cast<int>(digits.size());
  std::string out = negative ? "-" : "";
  if (decpt <= -4 || decpt > 16) {
    out += digits.substr(0, 1);
    if (n > 1) absl::StrAppend(&out, ".", digits.substr(1));
    const int x = decpt - 1;
    char exp[16];
    std::snprintf(exp, sizeof(exp), "e%c%02d", x < 0 ? '-' : '+', x < 0 ? -x : x);
    out += exp;
  } else if (decpt <= 0) {
    absl::StrAppend(&out, "0.", std::string(static_cast<size_t>(-decpt), '0'), digits);
  } else if (decpt >= n) {
    absl::StrAppend(&out, digits, std::string(static_cast<size_t>(decpt - n), '0'), ".0");
  } else {
    absl::StrAppend(&out, digits.substr(0, decpt), ".", digits.substr(decpt));
  }
  return out;
}

// nlohmann's SAX events, written out level by level: each open container
// keeps its items until it closes (a repeated key replaces its value in
// place, as a Python dict does), then becomes one item of its parent.
class Writer {
 public:
  Writer(int indent, bool keep_top_items, std::string_view only_key)
      : indent_(indent), keep_top_items_(keep_top_items), only_key_(only_key) {}

  bool null() { return Scalar("null"); }
  bool boolean(bool v) { return Scalar(v ? "true" : "false"); }
  bool number_integer(Json::number_integer_t v) { return Scalar(std::to_string(v)); }
  bool number_unsigned(Json::number_unsigned_t v) { return Scalar(std::to_string(v)); }
  bool number_float(Json::number_float_t v, const Json::string_t& raw) {
    if (skip_ > 0) return Scalar("");
    // An integer past 64 bits comes here: Python keeps its digits. (One
    // past the double range, like 1e400, never does: nlohmann's reader
    // refuses it.)
    if (raw.find_first_of(".eE") == std::string::npos) return Scalar(raw == "-0" ? "0" : raw);
    return Scalar(FloatRepr(v));
  }
  bool string(Json::string_t& v) {
    if (skip_ > 0) return Scalar("");
    std::string text;
    AppendString(v, &text);
    return Scalar(std::move(text));
  }
  bool binary(Json::binary_t&) { return false; }
  bool start_object(std::size_t) { return Open(true); }
  bool start_array(std::size_t) { return Open(false); }
  bool key(Json::string_t& k) {
    if (skip_ > 0) return true;
    levels_.back().key = std::move(k);
    if (levels_.size() == 1 && keep_top_items_ && !only_key_.empty() && levels_.back().key != only_key_) skip_ = 1;
    return true;
  }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    // nlohmann's message without its "[json.exception.parse_error.101] ",
    // and cut short: it quotes the token it stopped at, which may be
    // megabytes of the client's (and goes into replies and logs).
    std::string_view what = e.what();
    if (const size_t tag = what.find("] "); !what.empty() && what.front() == '[' && tag != std::string_view::npos) {
      what.remove_prefix(tag + 2);
    }
    constexpr size_t kMaxDetail = 160;
    std::string detail(what.substr(0, kMaxDetail));
    if (what.size() > kMaxDetail) {
      while (!detail.empty() && (static_cast<unsigned char>(detail.back()) & 0xC0) == 0x80) detail.pop_back();
      if (!detail.empty() && static_cast<unsigned char>(detail.back()) >= 0xC0) detail.pop_back();  // a cut lead byte
      detail += "...";
    }
    if (error_.empty()) error_ = absl::StrCat("not valid JSON (", detail, ")");
    return false;
  }

  const std::string& error() const { return error_; }
  std::string& root() { return root_; }
  PythonJsonItems& top() { return top_; }

 private:
  struct Level {
    bool object = false;
    std::string key;  // the key of the member being read
    std::vector<PythonJsonItems::Item> items;
    std::unordered_map<std::string, size_t> index;  // key -> its item
  };

  bool Scalar(std::string text) {
    if (skip_ > 0) {
      if (skip_ == 1) skip_ = 0;  // a skipped member that was a scalar
      return true;
    }
    Place(std::move(text));
    return true;
  }
  bool Open(bool object) {
    if (skip_ > 0) {
      ++skip_;
      return true;
    }
    if (static_cast<int>(levels_.size()) >= kMaxPythonJsonNesting) {
      error_ = absl::StrCat("JSON nested deeper than ", kMaxPythonJsonNesting, " levels");
      return false;
    }
    levels_.push_back(Level{object});
    return true;
  }
  bool Close() {
    if (skip_ > 0) {
      // skip_ counts the skipped member's open containers, plus one.
      if (--skip_ == 1) skip_ = 0;
      return true;
    }
    Level level = std::move(levels_.back());
    levels_.pop_back();
    if (levels_.empty() && keep_top_items_) {
      top_.object = level.object;
      top_.items = std::move(level.items);
      return true;
    }
    Place(Assemble(level, static_cast<int>(levels_.size())));
    return true;
  }
  void Place(std::string text) {
    if (levels_.empty()) {
      root_ = std::move(text);
      return;
    }
    Level& level = levels_.back();
    if (!level.object) {
      level.items.push_back({"", std::move(text)});
      return;
    }
    const auto [it, added] = level.index.emplace(level.key, level.items.size());
    if (added) {
      level.items.push_back({std::move(level.key), std::move(text)});
    } else {
      level.items[it->second].text = std::move(text);
    }
  }
  // A closed container at nesting `depth` (0: the outermost).
  std::string Assemble(const Level& level, int depth) const {
    if (level.items.empty()) return level.object ? "{}" : "[]";
    std::string inner;  // what starts an item: indent=N, a new line and its spaces
    if (indent_ > 0) inner.append(1, '\n').append(static_cast<size_t>(indent_) * static_cast<size_t>(depth + 1), ' ');
    std::string out(1, level.object ? '{' : '[');
    for (size_t i = 0; i < level.items.size(); ++i) {
      if (i > 0) out += indent_ > 0 ? "," : ", ";
      out += inner;
      if (level.object) {
        AppendString(level.items[i].key, &out);
        out += ": ";
      }
      out += level.items[i].text;
    }
    if (indent_ > 0) out.append(1, '\n').append(static_cast<size_t>(indent_) * static_cast<size_t>(depth), ' ');
    out.push_back(level.object ? '}' : ']');
    return out;
  }

  const int indent_;
  const bool keep_top_items_;
  const std::string_view only_key_;
  std::vector<Level> levels_;
  int skip_ = 0;
  std::string root_;
  PythonJsonItems top_;
  std::string error_;
};

absl::Status Read(std::string_view text, Writer* writer) {
  if (!Json::sax_parse(text.begin(), text.end(), writer)) {
    return absl::InvalidArgumentError(writer->error().empty() ? "not valid JSON" : writer->error());
  }
  return absl::OkStatus();
}

}  // namespace

std::optional<std::string> JsonStringValue(std::string_view json_text) {
  if (json_text.empty() || json_text.front() != '"') return std::nullopt;
  const Json j = Json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_string()) return std::nullopt;
  return j.get<std::string>();
}

std::string PythonJsonString(std::string_view s) {
  std::string out;
  AppendString(s, &out);
  return out;
}

absl::StatusOr<std::string> PythonJson(std::string_view text, int indent) {
  Writer writer(indent, /*keep_top_items=*/false, {});
  RETURN_IF_ERROR(Read(text, &writer));
  return std::move(writer.root());
}

absl::StatusOr<PythonJsonItems> PythonJsonItemsOf(std::string_view text, std::string_view only_key) {
  Writer writer(0, /*keep_top_items=*/true, only_key);
  RETURN_IF_ERROR(Read(text, &writer));
  if (!writer.root().empty()) return absl::InvalidArgumentError("not a JSON object or array");
  return std::move(writer.top());
}

}  // namespace ellm::coord
