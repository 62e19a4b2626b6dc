// Single-producer / single-consumer ring of fixed-size slots in shared memory.
//
// Memory layout (at the start of the memory given to Create/Attach):
//   RingControl (192 bytes, three cache lines): magic, version, slot count,
//     slot stride, head (frames published, written by the producer only),
//     tail (frames released, written by the consumer only),
//     two futex words (data_seq bumped on publish, space_seq bumped on release),
//     waiter counts (so a publish/release only makes a futex syscall when a
//     peer sleeps), producer and consumer pids.
//   slots × slot_stride: each slot is FrameHeader, padding to kPayloadOffset
//     (64), then the payload; a slot is 64 + the payload capacity rounded up to
//     64 bytes, so payloads are 64-byte aligned.
// head and tail are lock-free std::atomic<uint64_t>; slot i lives at
// index i % slots. A waiting side spins for WaitOptions::spin, then sleeps on
// the futex (FUTEX_WAIT, shared), waking at least every 100 ms to check
// `peer_alive` and the deadline, so an idle system uses no CPU.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/time/time.h"
#include "core/status.h"
#include "shm/frame.h"

namespace ellm::shm {

struct WaitOptions {
  // DeadlineExceeded when nothing arrives in time.
  absl::Duration timeout = absl::InfiniteDuration();
  // Busy-poll this long before sleeping on the futex.
  absl::Duration spin = absl::Microseconds(50);
  // Polled while sleeping (at least every 100 ms); when it returns false the
  // wait ends with Unavailable. Empty: the peer is assumed alive.
  std::function<bool()> peer_alive;
};

struct RingControl;  // defined in ring.cc

class Ring {
 public:
  // Offset of the payload in a slot (the FrameHeader sits at offset 0).
  static constexpr size_t kPayloadOffset = 64;

  // Bytes of shared memory a ring of `slots` slots of `slot_bytes` needs.
  // slot_bytes includes the FrameHeader (>= sizeof(FrameHeader)); the payload
  // capacity is at least slot_bytes - sizeof(FrameHeader), rounded up to 64.
  // The memory must be 64-byte aligned. SIZE_MAX when the size overflows.
  static size_t BytesFor(uint32_t slots, uint64_t slot_bytes);
  // Lays out a fresh, empty ring in `memory` (`bytes` >= BytesFor).
  static absl::StatusOr<Ring> Create(void* memory, size_t bytes, uint32_t slots,
                                     uint64_t slot_bytes);
  // Attaches to a ring laid out by Create; validates magic, version, and that
  // the slots fit in `bytes` (DataLoss otherwise).
  static absl::StatusOr<Ring> Attach(void* memory, size_t bytes);

  Ring() = default;

  // Largest payload one frame can carry.
  uint64_t max_payload_bytes() const;
  uint32_t slots() const;
  // Bytes from one slot to the next (kPayloadOffset + max_payload_bytes()).
  uint64_t slot_stride() const { return slot_stride_; }

  // Records this process as the producer / consumer (for the peer's liveness
  // check: see Channel::PeerAlive). 0 until set.
  void SetProducerPid(pid_t pid);
  void SetConsumerPid(pid_t pid);
  pid_t producer_pid() const;
  pid_t consumer_pid() const;

  // --- Producer side ---
  // Waits for a free slot and returns its payload area (max_payload_bytes()).
  absl::StatusOr<uint8_t*> BeginWrite(const WaitOptions& wait);
  // Publishes the slot taken by BeginWrite with `header` (magic and version
  // are filled in; header.payload_bytes must be <= max_payload_bytes()).
  // Calling it without BeginWrite, or with too large a payload, is a
  // programmer error and aborts.
  void CommitWrite(const FrameHeader& header);
  // BeginWrite + copy + CommitWrite. InvalidArgument when the payload does
  // not fit.
  absl::Status Write(const FrameHeader& header, const void* payload, const WaitOptions& wait);

  // --- Consumer side ---
  struct Frame {
    FrameHeader header;
    const uint8_t* payload = nullptr;  // header.payload_bytes bytes, valid until EndRead
  };
  // Waits for the next frame and validates its header. A frame with a bad
  // header is released and reported as DataLoss (the ring stays usable).
  // The header is copied out of shared memory before it is checked, so a
  // peer that rewrites it afterwards cannot make `payload` overrun the slot.
  absl::StatusOr<Frame> BeginRead(const WaitOptions& wait);
  // Releases the frame returned by BeginRead.
  void EndRead();

  // Frames published but not yet released.
  uint64_t Pending() const;

 private:
  Ring(RingControl* control, uint8_t* slots, uint32_t slot_count, uint64_t slot_stride)
      : control_(control), slots_(slots), slot_count_(slot_count), slot_stride_(slot_stride) {}
  uint8_t* Slot(uint64_t index) const;

  RingControl* control_ = nullptr;
  uint8_t* slots_ = nullptr;
  // Geometry, copied out of shared memory once it was validated: a peer that
  // scribbles over the control block cannot move our slots.
  uint32_t slot_count_ = 0;
  uint64_t slot_stride_ = 0;
  // Between BeginWrite and CommitWrite / BeginRead and EndRead.
  bool writing_ = false;
  bool reading_ = false;
};

// True while process `pid` exists (kill(pid, 0); EPERM counts as alive, and
// so does an exited child that was not reaped yet); false for pid <= 0.
bool ProcessAlive(pid_t pid);

}  // namespace ellm::shm
