// The command-line parser of every ellm binary (the launcher, the client, the
// three processes it starts, the benchmarks): GNU-style `--name value` /
// `--name=value` flags spelled with hyphens, positional arguments, and a
// generated --help.
#pragma once

#include <cstdint>

#include <map>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "core/status.h"

namespace ellm {

class Args {
 public:
  explicit Args(std::string usage) : usage_(std::move(usage)) {}
  // Declares a flag with its default and help text. `is_bool` flags take no value.
  void Flag(const std::string& name, const std::string& default_value, const std::string& help,
            bool is_bool = false);
  // InvalidArgument naming an unknown flag or a missing value. Sets help() when
  // --help or -h is present.
  absl::Status Parse(int argc, char** argv);
  // Parse for a tool's main() that takes no positional arguments: prints the
  // help (exit status 0) or logs the error (2) and returns the status main
  // should exit with, or nothing when it should go on.
  std::optional<int> ParseFlagsOnly(int argc, char** argv);

  std::string Get(const std::string& name) const;
  absl::StatusOr<int> GetInt(const std::string& name) const;
  absl::StatusOr<double> GetDouble(const std::string& name) const;
  absl::StatusOr<uint64_t> GetUint64(const std::string& name) const;  // e.g. --seed
  bool GetBool(const std::string& name) const;
  // Reads several integer flags at once; the first that does not parse is the error.
  absl::Status GetInts(const std::vector<std::pair<const char*, int*>>& flags) const;
  bool IsSet(const std::string& name) const;  // given on the command line
  // Every value a repeatable flag was given, in order (Get gives the last).
  std::vector<std::string> GetAll(const std::string& name) const;
  const std::vector<std::string>& positional() const { return positional_; }
  bool help() const { return help_; }
  std::string HelpText() const;

 private:
  struct Spec {
    std::string default_value, help;
    bool is_bool = false;
  };
  std::string usage_;
  std::vector<std::string> order_;
  std::map<std::string, Spec> specs_;
  std::map<std::string, std::vector<std::string>> values_;  // every value given, in order
  std::vector<std::string> positional_;
  bool help_ = false;
};

}  // namespace ellm
