#include "shm/channel.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/log.h"

namespace ellm::shm {

namespace {

inline constexpr uint32_t kChannelMagic = 0x434d4c45;  // "ELMC"
inline constexpr uint32_t kChannelVersion = 1;

// Byte layout (64 bytes at offset 0 of the segment):
//   0  u32 magic            kChannelMagic, stored last (release) by the creator:
//                           0 means "still being initialised"
//   4  u32 version
//   8  u64 requests_offset  64-byte aligned
//  16  u64 requests_bytes
//  24  u64 replies_offset   64-byte aligned
//  32  u64 replies_bytes
//  40  reserved
struct alignas(64) ChannelHeader {
  std::atomic<uint32_t> magic;
  uint32_t version;
  uint64_t requests_offset;
  uint64_t requests_bytes;
  uint64_t replies_offset;
  uint64_t replies_bytes;
};
static_assert(sizeof(ChannelHeader) == 64);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

uint64_t RoundUp64(uint64_t n) { return (n + 63) & ~uint64_t{63}; }

ChannelHeader* HeaderOf(const SharedSegment& segment) {
  return static_cast<ChannelHeader*>(segment.data());
}

// Checks that [offset, offset + bytes) is a 64-aligned range after the header
// inside a segment of `size` bytes.
absl::Status CheckRange(const char* what, uint64_t offset, uint64_t bytes, uint64_t size) {
  uint64_t end = 0;
  if (offset < sizeof(ChannelHeader) || offset % 64 != 0 ||
      __builtin_add_overflow(offset, bytes, &end) || end > size) {
    return absl::DataLossError(absl::StrFormat(
        "channel %s ring at offset %d (%d bytes) is outside the %d-byte segment or misaligned",
        what, offset, bytes, size));
  }
  return absl::OkStatus();
}

// True when `name` holds an initialised channel whose creator has exited
// (a crashed server): such a segment is safe to remove and re-create.
bool IsStaleChannel(const std::string& name) {
  auto segment = SharedSegment::Open(name);
  if (!segment.ok() || (*segment)->size() < sizeof(ChannelHeader)) return false;
  const ChannelHeader* header = HeaderOf(**segment);
  if (header->magic.load(std::memory_order_acquire) != kChannelMagic) return false;
  if (CheckRange("requests", header->requests_offset, header->requests_bytes,
                 (*segment)->size())
          .ok()) {
    auto requests = Ring::Attach(static_cast<uint8_t*>((*segment)->data()) +
                                     header->requests_offset,
                                 header->requests_bytes);
    if (!requests.ok()) return false;
    const pid_t creator = requests->consumer_pid();
    return creator > 0 && !ProcessAlive(creator);
  }
  return false;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Channel>> Channel::Create(const std::string& name, uint32_t slots,
                                                         uint64_t request_slot_bytes,
                                                         uint64_t reply_slot_bytes) {
  const size_t requests_bytes = Ring::BytesFor(slots, request_slot_bytes);
  const size_t replies_bytes = Ring::BytesFor(slots, reply_slot_bytes);
  if (slots == 0 || requests_bytes == SIZE_MAX || replies_bytes == SIZE_MAX) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "channel '%s': bad ring geometry (%d slots of %d / %d bytes)", name, slots,
        request_slot_bytes, reply_slot_bytes));
  }
  const uint64_t requests_offset = sizeof(ChannelHeader);
  const uint64_t replies_offset = requests_offset + RoundUp64(requests_bytes);
  uint64_t total = 0;
  if (replies_offset < requests_offset ||
      __builtin_add_overflow(replies_offset, uint64_t{replies_bytes}, &total)) {
    return absl::InvalidArgumentError(absl::StrFormat("channel '%s' is too large", name));
  }

  auto segment = SharedSegment::Create(name, total);
  if (absl::IsAlreadyExists(segment.status()) && IsStaleChannel(name)) {
    LogWarning("removing stale channel segment '%s' left by an exited process", name);
    SharedSegment::Remove(name);
    segment = SharedSegment::Create(name, total);
  }
  if (!segment.ok()) return segment.status();

  std::unique_ptr<Channel> channel(new Channel());
  channel->segment_ = std::move(*segment);
  channel->creator_ = true;
  auto* base = static_cast<uint8_t*>(channel->segment_->data());
  ASSIGN_OR_RETURN(channel->requests_,
                   Ring::Create(base + requests_offset, requests_bytes, slots, request_slot_bytes));
  ASSIGN_OR_RETURN(channel->replies_,
                   Ring::Create(base + replies_offset, replies_bytes, slots, reply_slot_bytes));
  channel->requests_.SetConsumerPid(getpid());
  channel->replies_.SetProducerPid(getpid());

  ChannelHeader* header = HeaderOf(*channel->segment_);
  header->version = kChannelVersion;
  header->requests_offset = requests_offset;
  header->requests_bytes = requests_bytes;
  header->replies_offset = replies_offset;
  header->replies_bytes = replies_bytes;
  // Last: an opener that sees the magic sees everything above.
  header->magic.store(kChannelMagic, std::memory_order_release);
  return channel;
}

absl::StatusOr<std::unique_ptr<Channel>> Channel::Open(const std::string& name, absl::Duration wait,
                                                       const std::function<bool()>& stop) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto budget = wait >= absl::Hours(24 * 365)
                          ? std::chrono::nanoseconds(std::chrono::hours(24 * 365))
                          : std::max(std::chrono::nanoseconds(0), absl::ToChronoNanoseconds(wait));
  const auto deadline = start + budget;
  auto backoff = std::chrono::milliseconds(1);

  std::unique_ptr<SharedSegment> segment;
  for (;;) {
    std::string not_ready;
    auto opened = SharedSegment::Open(name);
    if (opened.ok()) {
      if ((*opened)->size() < sizeof(ChannelHeader)) {
        return absl::DataLossError(absl::StrFormat(
            "channel segment '%s' has %d bytes, less than its header", name, (*opened)->size()));
      }
      const uint32_t magic = HeaderOf(**opened)->magic.load(std::memory_order_acquire);
      if (magic == kChannelMagic) {
        segment = std::move(*opened);
        break;
      }
      if (magic != 0) {
        return absl::DataLossError(absl::StrFormat(
            "channel segment '%s': bad magic 0x%08x (expected 0x%08x)", name, magic, kChannelMagic));
      }
      not_ready = "was not initialised";
    } else if (absl::IsNotFound(opened.status()) || absl::IsUnavailable(opened.status())) {
      not_ready = "did not appear";
    } else {
      return opened.status();
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "channel segment '%s' %s within %s", name, not_ready, absl::FormatDuration(wait)));
    }
    if (stop && stop()) {
      return absl::CancelledError(absl::StrFormat("stopped while waiting for channel segment '%s'", name));
    }
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(20));
  }

  const ChannelHeader* header = HeaderOf(*segment);
  if (header->version != kChannelVersion) {
    return absl::DataLossError(absl::StrFormat("channel segment '%s': version %d (expected %d)",
                                               name, header->version, kChannelVersion));
  }
  const uint64_t size = segment->size();
  const uint64_t requests_offset = header->requests_offset;
  const uint64_t requests_bytes = header->requests_bytes;
  const uint64_t replies_offset = header->replies_offset;
  const uint64_t replies_bytes = header->replies_bytes;
  RETURN_IF_ERROR(CheckRange("requests", requests_offset, requests_bytes, size));
  RETURN_IF_ERROR(CheckRange("replies", replies_offset, replies_bytes, size));
  if (requests_offset < replies_offset + replies_bytes &&
      replies_offset < requests_offset + requests_bytes) {
    return absl::DataLossError(
        absl::StrFormat("channel segment '%s': the two rings overlap", name));
  }

  std::unique_ptr<Channel> channel(new Channel());
  auto* base = static_cast<uint8_t*>(segment->data());
  auto requests = Ring::Attach(base + requests_offset, requests_bytes);
  auto replies = Ring::Attach(base + replies_offset, replies_bytes);
  if (!requests.ok() || !replies.ok()) {
    const absl::Status& bad = requests.ok() ? replies.status() : requests.status();
    return absl::Status(bad.code(),
                        absl::StrFormat("channel segment '%s': %s", name, bad.message()));
  }
  channel->segment_ = std::move(segment);
  channel->requests_ = *requests;
  channel->replies_ = *replies;
  channel->requests_.SetProducerPid(getpid());
  channel->replies_.SetConsumerPid(getpid());
  return channel;
}

bool Channel::PeerAlive() const {
  const pid_t peer = creator_ ? requests_.producer_pid() : requests_.consumer_pid();
  // 0: the peer has not opened the channel yet; it is not dead.
  return peer == 0 || ProcessAlive(peer);
}

}  // namespace ellm::shm
