#include "core/log.h"

#include <cstdlib>

#include <sys/time.h>
#include <time.h>

#include <mutex>

namespace ellm {
namespace {

// The identity is written once at start-up, before any thread logs.
struct LogState {
  std::string name = "ellm";
  LogLevel min_level = LogLevel::kInfo;
  std::mutex mu;
};

LogState& State() {
  static LogState* state = new LogState();
  return *state;
}

char LevelChar(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return 'D';
    case LogLevel::kInfo: return 'I';
    case LogLevel::kWarning: return 'W';
    case LogLevel::kError: return 'E';
  }
  return '?';
}

}  // namespace

void SetLogIdentity(std::string_view process_name, LogLevel min_level) {
  State().name = std::string(process_name);
  State().min_level = min_level;
}

bool ParseLogLevel(std::string_view text, LogLevel* level) {
  if (text == "debug") *level = LogLevel::kDebug;
  else if (text == "info") *level = LogLevel::kInfo;
  else if (text == "warning") *level = LogLevel::kWarning;
  else if (text == "error") *level = LogLevel::kError;
  else return false;
  return true;
}

void LogLine(LogLevel level, std::string_view message) {
  LogState& state = State();
  if (level < state.min_level) return;
  timeval tv;
  gettimeofday(&tv, nullptr);
  tm local;
  localtime_r(&tv.tv_sec, &local);
  char stamp[32];
  strftime(stamp, sizeof(stamp), "%Y-%m-%d %H:%M:%S", &local);
  std::lock_guard<std::mutex> lock(state.mu);
  std::fprintf(stderr, "%s.%03d %s %c %.*s\n", stamp, static_cast<int>(tv.tv_usec / 1000),
               state.name.c_str(), LevelChar(level), static_cast<int>(message.size()),
               message.data());
  std::fflush(stderr);
}

namespace internal {

void CheckFailed(const char* file, int line, const char* condition, std::string_view message) {
  std::fprintf(stderr, "%s:%d: check failed: %s: %.*s\n", file, line, condition,
               static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  std::abort();
}

}  // namespace internal
}  // namespace ellm
