#include "proto/control_secret.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/log.h"

namespace ellm {
namespace {

const char* MetadataKey(CallSecret::Kind kind) {
  return kind == CallSecret::Kind::kControl ? "ellm-control-secret" : "authorization";
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

absl::StatusOr<CallSecret> CallSecret::FromValue(Kind kind, std::string value) {
  value = std::string(absl::StripAsciiWhitespace(value));
  if (value.empty()) return absl::InvalidArgumentError("the secret is empty");
  return CallSecret(kind, std::move(value));
}

absl::StatusOr<CallSecret> CallSecret::FromFile(Kind kind, const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("cannot read the secret file ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(
        absl::StrFormat("the secret file %s is readable by others (mode %03o); chmod 600 it", path, st.st_mode & 0777));
  }
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<CallSecret> s = FromValue(kind, text.str());
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("the secret file ", path, " is empty"));
  return s;
}

void CallSecret::Attach(grpc::ClientContext* ctx) const {
  if (value_.empty()) return;
  ctx->AddMetadata(MetadataKey(kind_), kind_ == Kind::kApiKey ? absl::StrCat("Bearer ", value_) : value_);
}

bool CallSecret::Matches(std::string_view given) const {
  if (value_.empty()) return true;
  if (kind_ == Kind::kApiKey) {
    if (given.substr(0, 7) == "Bearer " || given.substr(0, 7) == "bearer ") given.remove_prefix(7);
  }
  return !given.empty() && ConstantTimeEquals(given, value_);
}

grpc::Status CallSecret::Check(const grpc::ServerContext* ctx, const char* method) const {
  if (value_.empty()) return grpc::Status::OK;
  const auto& md = ctx->client_metadata();
  const auto it = md.find(MetadataKey(kind_));
  std::string_view given;
  if (it != md.end()) given = std::string_view(it->second.data(), it->second.size());
  if (it != md.end() && Matches(given)) return grpc::Status::OK;
  LogWarning("refused %s from %s: %s", method, ctx->peer(),
             it == md.end() ? "no credential" : "wrong credential");
  return kind_ == Kind::kControl
             ? grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                            "control calls need this launch's secret (ellm-control-secret)")
             : grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                            "this server needs an API key: metadata 'authorization: Bearer <key>'");
}

absl::StatusOr<std::string> WriteNewSecret(const std::string& path) {
  std::random_device rd;
  std::string value;
  for (int i = 0; i < 8; ++i) absl::StrAppendFormat(&value, "%08x", rd());
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  const bool ok = write(fd, value.data(), value.size()) == static_cast<ssize_t>(value.size());
  close(fd);
  if (!ok) return absl::InternalError(absl::StrCat("cannot write ", path));
  return value;
}

}  // namespace ellm
