#include "coordinator/request_stream.h"

#include <chrono>

namespace ellm::coord {

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone: return "not finished";
    case FinishReason::kStopToken: return "stop token";
    case FinishReason::kMaxTokens: return "max_tokens";
    case FinishReason::kStopString: return "stop string";
    case FinishReason::kContext: return "context full";
  }
  return "unknown";
}

void RequestStream::Push(StreamEvent event) {
  std::function<void()> notify;
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(event));
    notify = notify_;
  }
  cv_.notify_one();
  if (notify) notify();
}

std::optional<StreamEvent> RequestStream::Pop(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout <= absl::ZeroDuration()) {
    if (events_.empty()) return std::nullopt;
    StreamEvent e = std::move(events_.front());
    events_.pop_front();
    return e;
  }
  if (!cv_.wait_for(lock, absl::ToChronoMilliseconds(timeout), [this] { return !events_.empty(); })) {
    return std::nullopt;
  }
  StreamEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

}  // namespace ellm::coord
