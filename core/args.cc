#include "core/args.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"

namespace ellm {

void Args::Flag(const std::string& name, const std::string& default_value, const std::string& help,
                bool is_bool) {
  order_.push_back(name);
  specs_[name] = Spec{default_value, help, is_bool};
}

std::optional<int> Args::ParseFlagsOnly(int argc, char** argv) {
  absl::Status st = Parse(argc, argv);
  if (help_) {
    std::printf("%s", HelpText().c_str());
    return 0;
  }
  if (st.ok() && !positional_.empty()) {
    st = absl::InvalidArgumentError(absl::StrCat("unexpected argument '", positional_[0], "' (see --help)"));
  }
  if (!st.ok()) {
    LogError("%s", st.message());
    return 2;
  }
  return std::nullopt;
}

absl::Status Args::Parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help_ = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0 || arg == "--") {
      positional_.push_back(arg);
      continue;
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto it = specs_.find(name);
    if (it == specs_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    }
    if (it->second.is_bool) {
      if (has_value && value != "true" && value != "false") {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " is true or false, got '", value, "'"));
      }
      values_[name].push_back(has_value ? value : "true");
      continue;
    }
    if (!has_value) {
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      value = argv[++i];
    }
    values_[name].push_back(value);
  }
  return absl::OkStatus();
}

std::string Args::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it != values_.end()) return it->second.back();  // the last one given
  auto spec = specs_.find(name);
  return spec == specs_.end() ? "" : spec->second.default_value;
}

bool Args::IsSet(const std::string& name) const { return values_.count(name) > 0; }

std::vector<std::string> Args::GetAll(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>{} : it->second;
}

absl::StatusOr<int> Args::GetInt(const std::string& name) const {
  int v = 0;
  if (!absl::SimpleAtoi(Get(name), &v)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be an integer, got '", Get(name), "'"));
  }
  return v;
}

absl::StatusOr<uint64_t> Args::GetUint64(const std::string& name) const {
  uint64_t v = 0;
  if (!absl::SimpleAtoi(Get(name), &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " must be a non-negative integer, got '", Get(name), "'"));
  }
  return v;
}

absl::StatusOr<double> Args::GetDouble(const std::string& name) const {
  double v = 0;
  if (!absl::SimpleAtod(Get(name), &v)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be a number, got '", Get(name), "'"));
  }
  return v;
}

absl::Status Args::GetInts(const std::vector<std::pair<const char*, int*>>& flags) const {
  for (const auto& [name, field] : flags) {
    ASSIGN_OR_RETURN(*field, GetInt(name));
  }
  return absl::OkStatus();
}

bool Args::GetBool(const std::string& name) const { return Get(name) == "true"; }

std::string Args::HelpText() const {
  std::string out = usage_ + "\n\nFlags:\n";
  // Names in a column of 28, descriptions after it (on the next line when
  // the name is longer). A switch shows its default only when it is on.
  auto line = [&out](std::string left, const std::string& text) {
    constexpr size_t kColumn = 28;
    if (left.size() >= kColumn) left = absl::StrCat(left, "\n", std::string(kColumn, ' '));
    left.resize(std::max(left.size(), kColumn), ' ');
    absl::StrAppend(&out, left, " ", text, "\n");
  };
  for (const std::string& name : order_) {
    const Spec& s = specs_.at(name);
    std::string text = s.help;
    if (!s.is_bool && !s.default_value.empty()) absl::StrAppend(&text, " (default: ", s.default_value, ")");
    if (s.is_bool && s.default_value == "true") absl::StrAppend(&text, " (default: true; --", name, "=false turns it off)");
    line(absl::StrCat("  --", name, s.is_bool ? "" : " VALUE"), text);
  }
  line("  --help", "show this help");
  return out;
}

}  // namespace ellm
