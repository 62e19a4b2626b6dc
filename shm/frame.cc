#include "shm/frame.h"

#include "absl/strings/str_format.h"

namespace ellm::shm {

namespace {

bool KnownKind(uint16_t kind) {
  switch (static_cast<FrameKind>(kind)) {
    case FrameKind::kStepPlan:
    case FrameKind::kStepResult:
    case FrameKind::kAttnRequest:
    case FrameKind::kAttnResult:
    case FrameKind::kError:
      return true;
  }
  return false;
}

}  // namespace

absl::Status ValidateFrameHeader(const FrameHeader& header, uint64_t max_payload_bytes) {
  if (header.magic != kFrameMagic) {
    return absl::DataLossError(absl::StrFormat("bad frame magic 0x%08x (expected 0x%08x)",
                                               header.magic, kFrameMagic));
  }
  if (header.version != kFrameVersion) {
    return absl::DataLossError(
        absl::StrFormat("frame version %d (expected %d)", header.version, kFrameVersion));
  }
  if (!KnownKind(header.kind)) {
    return absl::DataLossError(absl::StrFormat("unknown frame kind %d", header.kind));
  }
  if (header.payload_bytes > max_payload_bytes) {
    return absl::DataLossError(absl::StrFormat("frame payload %d bytes exceeds slot capacity %d",
                                               header.payload_bytes, max_payload_bytes));
  }
  return absl::OkStatus();
}

}  // namespace ellm::shm
