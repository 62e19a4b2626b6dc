// Error handling for all of ellm: absl::Status / absl::StatusOr everywhere,
// with the two macros that Debian's abseil (20220623) does not ship.
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ellm {
// Debian's abseil has its own absl::string_view (not std::string_view), which
// absl::StrCat, StrSplit and the Status constructors take; this converts.
inline absl::string_view ToAbsl(std::string_view s) { return {s.data(), s.size()}; }
}  // namespace ellm

namespace ellm::internal {
// Prints "<file>:<line>: check failed: <condition>: <message>" and aborts.
[[noreturn]] void CheckFailed(const char* file, int line, const char* condition, std::string_view message);
}  // namespace ellm::internal

// Programmer errors only (a misused API, a broken invariant): never for file
// contents, requests or ring frames, which get an absl::Status.
#define ELLM_CHECK(cond, message)                                              \
  do {                                                                         \
    if (!(cond)) ::ellm::internal::CheckFailed(__FILE__, __LINE__, #cond, (message)); \
  } while (0)

#define ELLM_CONCAT_INNER_(a, b) a##b
#define ELLM_CONCAT_(a, b) ELLM_CONCAT_INNER_(a, b)

// Returns from the calling function when `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                      \
  do {                                             \
    ::absl::Status ellm_status_ = (expr);          \
    if (!ellm_status_.ok()) return ellm_status_;   \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX());` — declares/assigns x from a StatusOr,
// returning its status from the calling function on error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ELLM_ASSIGN_OR_RETURN_IMPL_(ELLM_CONCAT_(ellm_statusor_, __LINE__), lhs, expr)
#define ELLM_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return std::move(tmp).status();    \
  lhs = std::move(tmp).value()
