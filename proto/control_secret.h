// Secrets checked at the gRPC edge: the launch's control secret, which every
// worker control call carries (so no other local process can free a
// sequence, fill the cache or stop a worker), and the public API key.
//
// A secret travels in a 0600 file (ellm-launch writes the control secret into
// its 0700 run folder), never on a command line, and is compared in constant
// time. Calls without it are refused with PERMISSION_DENIED (UNAUTHENTICATED
// for the API key) and logged.
#pragma once

#include <string>

#include <grpcpp/grpcpp.h>

#include "core/status.h"

namespace ellm {

class CallSecret {
 public:
  // The metadata key the secret travels under: "ellm-control-secret" for
  // the control plane, "authorization" (as "Bearer <key>") for the API key.
  enum class Kind { kControl, kApiKey };

  // Reads the secret from `path` (surrounding whitespace dropped). The file
  // must be a regular file readable by its owner only; an empty secret is an
  // error.
  static absl::StatusOr<CallSecret> FromFile(Kind kind, const std::string& path);
  static absl::StatusOr<CallSecret> FromValue(Kind kind, std::string value);
  // No secret: every call passes (the public API without --api-key).
  static CallSecret None(Kind kind) { return CallSecret(kind, ""); }

  bool enabled() const { return !value_.empty(); }
  // Client side: adds the secret to a call's metadata.
  void Attach(grpc::ClientContext* ctx) const;
  // Server side: OK when the call carries the secret (or none is set).
  grpc::Status Check(const grpc::ServerContext* ctx, const char* method) const;
  // Whether `presented` (a metadata or header value; "Bearer <key>" for the
  // API key) is the secret, or none is set.
  bool Matches(std::string_view presented) const;

 private:
  CallSecret(Kind kind, std::string value) : kind_(kind), value_(std::move(value)) {}
  Kind kind_;
  std::string value_;
};

// A new random control secret (32 bytes, hex) written to `path` (0600).
absl::StatusOr<std::string> WriteNewSecret(const std::string& path);

}  // namespace ellm
