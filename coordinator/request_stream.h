// The events of one Generate request, passed from the scheduler's thread to
// the thread serving the request's stream.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/sampler.h"
#include "core/status.h"

namespace ellm::coord {

enum class FinishReason { kNone = 0, kStopToken = 1, kMaxTokens = 2, kStopString = 3, kContext = 4 };

// "stop token", "max_tokens", "stop string", "context full" (for logs).
const char* FinishReasonName(FinishReason reason);

struct FinishInfo {
  FinishReason reason = FinishReason::kNone;
  int prompt_tokens = 0;
  int completion_tokens = 0;
  double time_to_first_token_ms = 0;
  double decode_ms_per_token = 0;
  double queue_ms = 0;
  int cached_tokens = 0;  // prompt tokens whose KV came from the prefix cache
};

struct StreamEvent {
  std::string text;                 // whole UTF-8
  std::vector<int32_t> token_ids;
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top_logprobs;  // per token, when the request asked
  // Prompt logprobs (GenerateOptions::prompt_logprobs), in the first event:
  // of prompt tokens 1.. (token 0 has none), with their alternatives.
  std::vector<float> prompt_logprobs;
  std::vector<std::vector<TokenLogprob>> prompt_top_logprobs;
  bool finished = false;            // last event of the request
  FinishInfo finish;
  absl::Status error;               // non-OK: the request failed (last event)
};

class RequestStream {
 public:
  void Push(StreamEvent event);
  // Waits up to `timeout` for the next event.
  std::optional<StreamEvent> Pop(absl::Duration timeout);
  // Called by the client side; the scheduler drops the request at the next step.
  void Cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  // Called after every Push (on the pushing thread, without the lock held):
  // for a client that waits asynchronously instead of in Pop. Set it before
  // the first event can arrive, or accept missing a wake-up for events
  // already queued (Pop(0) them).
  void SetNotify(std::function<void()> notify) {
    std::lock_guard<std::mutex> lock(mu_);
    notify_ = std::move(notify);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<StreamEvent> events_;
  std::atomic<bool> cancelled_{false};
  std::function<void()> notify_;
};

}  // namespace ellm::coord
