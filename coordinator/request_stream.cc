#include "coordinator/request_stream.h"

#include <chrono>

namespace ellm::coord {

void RequestStream::Push(StreamEvent event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(event));
  }
  cv_.notify_one();
}

std::optional<StreamEvent> RequestStream::Pop(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, absl::ToChronoMilliseconds(timeout), [this] { return !events_.empty(); })) {
    return std::nullopt;
  }
  StreamEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

}  // namespace ellm::coord
