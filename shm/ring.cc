#include "shm/ring.h"

#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace ellm::shm {
namespace {
constexpr uint32_t kRingMagic = 0x524d4c45;  // "ELMR"
constexpr uint16_t kRingVersion = 1;
}  // namespace

// The control block at the start of a ring's memory (192 bytes, three cache
// lines, so the producer's and the consumer's hot words never share a line).
//
// Lost-wakeup protocol (same for both directions; shown for data):
//   consumer: s = data_seq; ++data_waiters; re-check head; FUTEX_WAIT(data_seq, s)
//   producer: head = h + 1; ++data_seq; if (data_waiters) FUTEX_WAKE(data_seq)
// All of these are seq_cst. If the consumer's re-check misses the new head,
// its ++data_waiters precedes the producer's read of data_waiters, so the
// producer wakes it; and data_seq then differs from s, so a FUTEX_WAIT that
// comes after the wake returns at once.
struct alignas(64) RingControl {
  // Line 0: geometry (written once by Create; magic last), pids.
  std::atomic<uint32_t> magic;
  uint16_t version;
  uint16_t reserved0;
  uint32_t slots;
  uint32_t reserved1;
  uint64_t slot_stride;  // multiple of 64, >= kPayloadOffset
  std::atomic<int32_t> producer_pid;
  std::atomic<int32_t> consumer_pid;

  // Line 1: written by the producer.
  alignas(64) std::atomic<uint64_t> head;  // frames published
  std::atomic<uint32_t> data_seq;          // futex word: bumped after each publish
  std::atomic<uint32_t> space_waiters;     // producer asleep on space_seq (0 or 1)

  // Line 2: written by the consumer.
  alignas(64) std::atomic<uint64_t> tail;  // frames released
  std::atomic<uint32_t> space_seq;         // futex word: bumped after each release
  std::atomic<uint32_t> data_waiters;      // consumer asleep on data_seq (0 or 1)
};
static_assert(sizeof(RingControl) == 192);
static_assert(sizeof(RingControl) % 64 == 0);
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<int32_t>::is_always_lock_free);
// The futex syscall operates on the 32-bit word inside the atomic.
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
static_assert(sizeof(pid_t) == sizeof(int32_t));
static_assert(Ring::kPayloadOffset >= sizeof(FrameHeader) && Ring::kPayloadOffset % 64 == 0);

namespace {

constexpr auto kMaxSleep = std::chrono::milliseconds(100);

uint64_t RoundUp64(uint64_t n) { return (n + 63) & ~uint64_t{63}; }

// Slot stride for a requested slot size; 0 when it is invalid or overflows.
uint64_t StrideFor(uint64_t slot_bytes) {
  if (slot_bytes < sizeof(FrameHeader)) return 0;
  uint64_t payload = slot_bytes - sizeof(FrameHeader);
  if (payload > (uint64_t{1} << 62)) return 0;
  return Ring::kPayloadOffset + RoundUp64(payload);
}

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

uint32_t* FutexWord(std::atomic<uint32_t>* word) { return reinterpret_cast<uint32_t*>(word); }

// Sleeps while *word == expected, at most `timeout`. Not FUTEX_PRIVATE: the
// word lives in memory shared between processes.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  syscall(SYS_futex, FutexWord(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
  // EAGAIN (value changed), EINTR, ETIMEDOUT and wakes all mean: look again.
}

void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, FutexWord(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Publishes one event on `seq` and wakes the peer if it sleeps.
void Signal(std::atomic<uint32_t>& seq, std::atomic<uint32_t>& waiters) {
  seq.fetch_add(1, std::memory_order_seq_cst);
  if (waiters.load(std::memory_order_seq_cst) != 0) FutexWake(&seq);
}

// Waits until ready() holds: spins for wait.spin, then sleeps on `seq` in
// naps of at most 100 ms, polling wait.peer_alive and the deadline.
// `what` names what is awaited, for the DeadlineExceeded message.
template <typename Ready>
absl::Status Await(Ready ready, std::atomic<uint32_t>& seq, std::atomic<uint32_t>& waiters,
                   const WaitOptions& wait, const char* what) {
  if (ready()) return absl::OkStatus();
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  const bool infinite = wait.timeout == absl::InfiniteDuration();
  const auto timeout = infinite ? std::chrono::nanoseconds::max()
                                : std::max(std::chrono::nanoseconds(0),
                                           absl::ToChronoNanoseconds(wait.timeout));
  const auto spin = std::max(std::chrono::nanoseconds(0),
                             absl::ToChronoNanoseconds(std::min(wait.spin, absl::Seconds(1))));
  const Clock::time_point deadline =
      infinite || timeout > std::chrono::hours(24 * 365) ? Clock::time_point::max()
                                                         : start + timeout;
  const Clock::time_point spin_end = std::min(start + spin, deadline);

  for (uint32_t i = 1;; ++i) {
    if (ready()) return absl::OkStatus();
    if (i % 32 == 0) {
      if (Clock::now() >= spin_end) break;
      if (i % 1024 == 0) std::this_thread::yield();
    }
    CpuRelax();
  }

  for (;;) {
    const uint32_t observed = seq.load(std::memory_order_seq_cst);
    waiters.fetch_add(1, std::memory_order_seq_cst);
    if (ready()) {
      waiters.fetch_sub(1, std::memory_order_seq_cst);
      return absl::OkStatus();
    }
    if (wait.peer_alive && !wait.peer_alive()) {
      waiters.fetch_sub(1, std::memory_order_seq_cst);
      return absl::UnavailableError(absl::StrCat("peer process exited while waiting for ", what));
    }
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      waiters.fetch_sub(1, std::memory_order_seq_cst);
      return absl::DeadlineExceededError(absl::StrCat(
          "no ", what, " within ", absl::FormatDuration(wait.timeout)));
    }
    const auto nap = std::min<std::chrono::nanoseconds>(deadline - now, kMaxSleep);
    FutexWait(&seq, observed, nap);
    waiters.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace

size_t Ring::BytesFor(uint32_t slots, uint64_t slot_bytes) {
  const uint64_t stride = StrideFor(slot_bytes);
  uint64_t total = 0;
  if (stride == 0 || __builtin_mul_overflow(stride, uint64_t{slots}, &total) ||
      __builtin_add_overflow(total, uint64_t{sizeof(RingControl)}, &total) || total > SIZE_MAX) {
    return SIZE_MAX;
  }
  return static_cast<size_t>(total);
}

absl::StatusOr<Ring> Ring::Create(void* memory, size_t bytes, uint32_t slots,
                                  uint64_t slot_bytes) {
  if (memory == nullptr || reinterpret_cast<uintptr_t>(memory) % 64 != 0) {
    return absl::InvalidArgumentError("ring memory must be 64-byte aligned");
  }
  if (slots == 0) return absl::InvalidArgumentError("a ring needs at least one slot");
  if (slot_bytes < sizeof(FrameHeader)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ring slot of %d bytes cannot hold a %d-byte frame header", slot_bytes, sizeof(FrameHeader)));
  }
  const size_t need = BytesFor(slots, slot_bytes);
  if (need == SIZE_MAX || need > bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ring of %d slots of %d bytes does not fit in %d bytes", slots, slot_bytes, bytes));
  }
  auto* control = new (memory) RingControl{};
  control->version = kRingVersion;
  control->slots = slots;
  control->slot_stride = StrideFor(slot_bytes);
  control->producer_pid.store(0, std::memory_order_relaxed);
  control->consumer_pid.store(0, std::memory_order_relaxed);
  control->head.store(0, std::memory_order_relaxed);
  control->tail.store(0, std::memory_order_relaxed);
  control->data_seq.store(0, std::memory_order_relaxed);
  control->space_seq.store(0, std::memory_order_relaxed);
  control->data_waiters.store(0, std::memory_order_relaxed);
  control->space_waiters.store(0, std::memory_order_relaxed);
  control->magic.store(kRingMagic, std::memory_order_release);
  return Ring(control, static_cast<uint8_t*>(memory) + sizeof(RingControl), slots,
              control->slot_stride);
}

absl::StatusOr<Ring> Ring::Attach(void* memory, size_t bytes) {
  if (memory == nullptr || reinterpret_cast<uintptr_t>(memory) % 64 != 0) {
    return absl::InvalidArgumentError("ring memory must be 64-byte aligned");
  }
  if (bytes < sizeof(RingControl)) {
    return absl::DataLossError(absl::StrFormat(
        "ring memory of %d bytes is smaller than the %d-byte control block", bytes,
        sizeof(RingControl)));
  }
  auto* control = static_cast<RingControl*>(memory);
  const uint32_t magic = control->magic.load(std::memory_order_acquire);
  if (magic != kRingMagic) {
    return absl::DataLossError(
        absl::StrFormat("bad ring magic 0x%08x (expected 0x%08x)", magic, kRingMagic));
  }
  if (control->version != kRingVersion) {
    return absl::DataLossError(
        absl::StrFormat("ring version %d (expected %d)", control->version, kRingVersion));
  }
  const uint32_t slots = control->slots;
  const uint64_t stride = control->slot_stride;
  if (slots == 0) return absl::DataLossError("ring has 0 slots");
  if (stride < kPayloadOffset || stride % 64 != 0) {
    return absl::DataLossError(absl::StrFormat(
        "ring slot stride %d is not a multiple of 64 of at least %d", stride, kPayloadOffset));
  }
  uint64_t total = 0;
  if (__builtin_mul_overflow(stride, uint64_t{slots}, &total) ||
      __builtin_add_overflow(total, uint64_t{sizeof(RingControl)}, &total) || total > bytes) {
    return absl::DataLossError(absl::StrFormat(
        "ring of %d slots of %d bytes does not fit in %d bytes", slots, stride, bytes));
  }
  // Tail first: head only grows, so a consistent ring always reads tail <= head.
  const uint64_t tail = control->tail.load(std::memory_order_acquire);
  const uint64_t head = control->head.load(std::memory_order_acquire);
  if (tail > head) {
    return absl::DataLossError(
        absl::StrFormat("ring tail %d is ahead of head %d", tail, head));
  }
  return Ring(control, static_cast<uint8_t*>(memory) + sizeof(RingControl), slots, stride);
}

uint64_t Ring::max_payload_bytes() const {
  return slot_stride_ == 0 ? 0 : slot_stride_ - kPayloadOffset;
}
uint32_t Ring::slots() const { return slot_count_; }

void Ring::SetProducerPid(pid_t pid) { control_->producer_pid.store(pid, std::memory_order_release); }
void Ring::SetConsumerPid(pid_t pid) { control_->consumer_pid.store(pid, std::memory_order_release); }
pid_t Ring::producer_pid() const { return control_->producer_pid.load(std::memory_order_acquire); }
pid_t Ring::consumer_pid() const { return control_->consumer_pid.load(std::memory_order_acquire); }

uint8_t* Ring::Slot(uint64_t index) const { return slots_ + (index % slot_count_) * slot_stride_; }

absl::StatusOr<uint8_t*> Ring::BeginWrite(const WaitOptions& wait) {
  ELLM_CHECK(control_ != nullptr, "BeginWrite on an empty Ring");
  ELLM_CHECK(!writing_, "BeginWrite twice without CommitWrite");
  const uint64_t head = control_->head.load(std::memory_order_relaxed);
  // seq_cst loads of tail also order our slot writes after the consumer's reads.
  RETURN_IF_ERROR(Await(
      [&] { return head - control_->tail.load(std::memory_order_seq_cst) < slot_count_; },
      control_->space_seq, control_->space_waiters, wait, "free ring slot"));
  writing_ = true;
  return Slot(head) + kPayloadOffset;
}

void Ring::CommitWrite(const FrameHeader& header) {
  ELLM_CHECK(writing_, "CommitWrite without BeginWrite");
  ELLM_CHECK(header.payload_bytes <= max_payload_bytes(),
                  "CommitWrite payload exceeds the slot capacity");
  FrameHeader h = header;
  h.magic = kFrameMagic;
  h.version = kFrameVersion;
  const uint64_t head = control_->head.load(std::memory_order_relaxed);
  std::memcpy(Slot(head), &h, sizeof(h));
  control_->head.store(head + 1, std::memory_order_seq_cst);
  Signal(control_->data_seq, control_->data_waiters);
  writing_ = false;
}

absl::Status Ring::Write(const FrameHeader& header, const void* payload, const WaitOptions& wait) {
  if (header.payload_bytes > max_payload_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("frame payload %d bytes exceeds slot capacity %d", header.payload_bytes,
                        max_payload_bytes()));
  }
  if (header.payload_bytes > 0 && payload == nullptr) {
    return absl::InvalidArgumentError("frame payload is null");
  }
  ASSIGN_OR_RETURN(uint8_t * slot, BeginWrite(wait));
  if (header.payload_bytes > 0) std::memcpy(slot, payload, header.payload_bytes);
  CommitWrite(header);
  return absl::OkStatus();
}

absl::StatusOr<Ring::Frame> Ring::BeginRead(const WaitOptions& wait) {
  ELLM_CHECK(control_ != nullptr, "BeginRead on an empty Ring");
  ELLM_CHECK(!reading_, "BeginRead twice without EndRead");
  const uint64_t tail = control_->tail.load(std::memory_order_relaxed);
  RETURN_IF_ERROR(Await([&] { return control_->head.load(std::memory_order_seq_cst) != tail; },
                        control_->data_seq, control_->data_waiters, wait, "ring frame"));
  reading_ = true;
  Frame frame;
  std::memcpy(&frame.header, Slot(tail), sizeof(FrameHeader));
  absl::Status valid = ValidateFrameHeader(frame.header, max_payload_bytes());
  if (!valid.ok()) {
    EndRead();
    return absl::DataLossError(absl::StrCat("ring frame #", tail, ": ", valid.message()));
  }
  frame.payload = Slot(tail) + kPayloadOffset;
  return frame;
}

void Ring::EndRead() {
  ELLM_CHECK(reading_, "EndRead without BeginRead");
  const uint64_t tail = control_->tail.load(std::memory_order_relaxed);
  control_->tail.store(tail + 1, std::memory_order_seq_cst);
  Signal(control_->space_seq, control_->space_waiters);
  reading_ = false;
}

uint64_t Ring::Pending() const {
  if (control_ == nullptr) return 0;
  const uint64_t tail = control_->tail.load(std::memory_order_acquire);
  const uint64_t head = control_->head.load(std::memory_order_acquire);
  return head - tail;
}

bool ProcessAlive(pid_t pid) {
  if (pid <= 0) return false;
  return kill(pid, 0) == 0 || errno == EPERM;
}

}  // namespace ellm::shm
