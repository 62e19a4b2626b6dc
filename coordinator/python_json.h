// JSON written as Python's json.dumps(json.loads(text), ensure_ascii=False)
// writes it: how the chat templates' tojson filter (transformers', vLLM's)
// writes a tool and a call's arguments, and how vLLM writes the arguments of
// the calls it reads from an answer.
//
//   separators  ", " and ": " (indent=N: "," and a new line, N spaces a level)
//   keys        in their first place; a repeated key keeps its last value
//   strings     \" \\ \b \f \n \r \t and \u00XX for the other controls;
//               everything else as itself (UTF-8)
//   numbers     integers as their digits (past 64 bits too); others as
//               Python's float repr: the shortest digits that read back,
//               exponent form below 1e-4 or from 1e16 ("1e-05", "1e+16").
//               Unlike Python, a number past the double range (1e400, an
//               integer of 309 digits) and NaN are not read: nlohmann's
//               reader refuses them
//
// The text is read by events (nlohmann's SAX parser), never built into a
// tree: the cost is linear in its size, and nesting deeper than
// kMaxPythonJsonNesting levels stops the reading where it starts.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace ellm::coord {

constexpr int kMaxPythonJsonNesting = 64;

// InvalidArgument (saying why) when `text` is not JSON or nests too deep.
absl::StatusOr<std::string> PythonJson(std::string_view text, int indent = 0);

// The JSON string of `s` (UTF-8), as json.dumps writes a str.
std::string PythonJsonString(std::string_view s);

// The value of `json_text` when it is a JSON string; nullopt otherwise.
std::optional<std::string> JsonStringValue(std::string_view json_text);

// The items of the JSON object or array `text`, each written as PythonJson
// writes it: an object's members with their keys (in their first place),
// an array's elements. With `only_key`, an object's other members are read
// but not written.
struct PythonJsonItems {
  bool object = false;
  struct Item {
    std::string key;  // "" in an array
    std::string text;
  };
  std::vector<Item> items;
};
absl::StatusOr<PythonJsonItems> PythonJsonItemsOf(std::string_view text, std::string_view only_key = {});

}  // namespace ellm::coord
