// One small logging facade. Every line names the process and its role
// ("attn-worker[1]") so that interleaved logs of several processes read well:
//   2026-11-29 12:00:00.123 attn-worker[1] I allocated 512 KV blocks on node 1
// The process name is set once in main(); the rest of the code only logs.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ellm {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Sets the name printed on every line (e.g. "coordinator") and the least level
// printed. Call once at the start of main(); the default is "ellm", kInfo.
void SetLogIdentity(std::string_view process_name, LogLevel min_level = LogLevel::kInfo);
// Parses "debug", "info", "warning", "error".
bool ParseLogLevel(std::string_view text, LogLevel* level);

void LogLine(LogLevel level, std::string_view message);

template <typename... Args>
void LogInfo(const absl::FormatSpec<Args...>& fmt, const Args&... args) {
  LogLine(LogLevel::kInfo, absl::StrFormat(fmt, args...));
}
template <typename... Args>
void LogWarning(const absl::FormatSpec<Args...>& fmt, const Args&... args) {
  LogLine(LogLevel::kWarning, absl::StrFormat(fmt, args...));
}
template <typename... Args>
void LogError(const absl::FormatSpec<Args...>& fmt, const Args&... args) {
  LogLine(LogLevel::kError, absl::StrFormat(fmt, args...));
}
template <typename... Args>
void LogDebug(const absl::FormatSpec<Args...>& fmt, const Args&... args) {
  LogLine(LogLevel::kDebug, absl::StrFormat(fmt, args...));
}

// "1 request", "3 requests": a count and its noun (plural by an "s").
inline std::string Count(int64_t n, const char* noun) {
  return absl::StrCat(n, " ", noun, n == 1 ? "" : "s");
}

}  // namespace ellm
