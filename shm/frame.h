// Header of every message that crosses a ring. The reader validates it before
// touching the payload; a bad header is an error status, never a crash.
//
// Byte layout (40 bytes, little endian, at the start of each ring slot):
//   0  u32 magic        kFrameMagic ("ELMF")
//   4  u16 version      kFrameVersion
//   6  u16 kind         FrameKind
//   8  u64 step         step id (set by the coordinator, echoed by everyone)
//  16  u32 layer        layer index (attention frames), 0 otherwise
//  20  u32 n_seqs       batch descriptor: sequences in the step
//  24  u32 n_tokens     batch descriptor: tokens in the step
//  28  u32 status       0, or an absl::StatusCode for kError frames
//  32  u64 payload_bytes  bytes of payload following the header
#pragma once

#include <cstdint>

#include "core/status.h"

namespace ellm::shm {

inline constexpr uint32_t kFrameMagic = 0x464d4c45;  // "ELMF"
inline constexpr uint16_t kFrameVersion = 1;

enum class FrameKind : uint16_t {
  kStepPlan = 1,     // coordinator -> mlp-worker
  kStepResult = 2,   // mlp-worker -> coordinator
  kAttnRequest = 3,  // mlp-worker -> attn-worker: q, k, v of one layer
  kAttnResult = 4,   // attn-worker -> mlp-worker: attention output of one layer
  kError = 5,        // any direction: payload is a UTF-8 message, status a code
};

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t version = kFrameVersion;
  uint16_t kind = 0;
  uint64_t step = 0;
  uint32_t layer = 0;
  uint32_t n_seqs = 0;
  uint32_t n_tokens = 0;
  uint32_t status = 0;
  uint64_t payload_bytes = 0;
};
static_assert(sizeof(FrameHeader) == 40);

// Checks magic, version, a known kind and payload_bytes <= max_payload_bytes.
// DataLoss with a message naming the field that is wrong.
absl::Status ValidateFrameHeader(const FrameHeader& header, uint64_t max_payload_bytes);

}  // namespace ellm::shm
