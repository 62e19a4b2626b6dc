// The attention worker's data plane: the loop that turns each request frame
// of its channel (q, k, v of one layer of a step, from the mlp-worker) into
// AttentionShard::Process and a reply frame (the attention output, or the
// error). The process main (main.cc) keeps flags, set-up and signals; tests
// run this loop on a thread (tests/test_pipeline.cc).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>

#include "attn-worker/attention_shard.h"
#include "shm/channel.h"

namespace ellm::attn {

struct ServeOptions {
  // Checked while waiting for a frame; the loop returns once it is true.
  std::function<bool()> stop;
  // Held around every Process (the control plane changes the cache too).
  std::mutex* cache_mu = nullptr;
  // Counts steps served (one per layer-0 frame); may be null.
  std::atomic<int64_t>* steps = nullptr;
  // Adds the nanoseconds spent in the shard's Process; may be null.
  std::atomic<int64_t>* busy_ns = nullptr;
};

// Serves `channel` (created by this side: requests in, replies out) until
// options.stop(). Nothing a frame holds ends the loop: a bad frame or a
// failed step is answered with an error frame and logged.
void ServeChannel(shm::Channel& channel, AttentionShard& shard, const ServeOptions& options);

}  // namespace ellm::attn
