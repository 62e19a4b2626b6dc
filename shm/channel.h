// A channel: one shared segment holding two rings between two processes —
// `requests` (creator's peer -> creator) and `replies` (creator -> peer).
// The serving side creates it (and so owns and removes the segment); the
// calling side opens it.
//
// Segment layout: ChannelHeader (64 bytes: magic "ELMC", version, offsets and
// sizes of both rings) | requests ring | replies ring.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "core/status.h"
#include "shm/ring.h"
#include "shm/segment.h"

namespace ellm::shm {

class Channel {
 public:
  // Creates segment `name` (owner-only permissions). The creating process is
  // recorded as consumer of `requests` and producer of `replies`. A segment of
  // that name left by a creator that has exited is removed and re-created;
  // any other existing segment gives AlreadyExists.
  static absl::StatusOr<std::unique_ptr<Channel>> Create(const std::string& name, uint32_t slots,
                                                         uint64_t request_slot_bytes,
                                                         uint64_t reply_slot_bytes);
  // Opens a channel created by another process, retrying until it exists or
  // `wait` has passed (DeadlineExceeded naming the segment), or `stop` (when
  // given) says to give up (Cancelled). The opening process is recorded as
  // producer of `requests` and consumer of `replies`.
  static absl::StatusOr<std::unique_ptr<Channel>> Open(const std::string& name, absl::Duration wait,
                                                       const std::function<bool()>& stop = nullptr);

  Ring& requests() { return requests_; }
  Ring& replies() { return replies_; }
  const std::string& name() const { return segment_->name(); }
  // The whole mapped segment (both rings), e.g. to register it with a GPU so
  // copies go straight between ring slots and device memory.
  void* memory() const { return segment_->data(); }
  size_t memory_bytes() const { return segment_->size(); }
  // Liveness of the process on the other side (from the pids in the rings).
  // True while the peer has not opened the channel yet (its pid is unknown).
  bool PeerAlive() const;

 private:
  Channel() = default;
  std::unique_ptr<SharedSegment> segment_;
  Ring requests_;
  Ring replies_;
  bool creator_ = false;
};

}  // namespace ellm::shm
