// The one place where absl::Status and grpc::Status meet.
#pragma once

#include <grpcpp/support/status.h>

#include "core/status.h"

namespace ellm {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace ellm
