// The mlp-worker's data plane: the loop that turns each step plan of its
// channel (from the coordinator) into StepRunner::Run and a reply frame (the
// sampled tokens, or the error). The process main (main.cc) keeps flags,
// set-up and signals; tests run this loop on a thread
// (tests/test_pipeline.cc).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

#include "core/model_config.h"
#include "mlp-worker/step_runner.h"
#include "shm/channel.h"

namespace ellm::mlp {

struct ServeOptions {
  // Checked while waiting for a plan; the loop returns once it is true.
  std::function<bool()> stop;
  // Counts steps served; may be null.
  std::atomic<int64_t>* steps = nullptr;
};

// Serves `channel` (created by this side: plans in, results out) until
// options.stop(). A bad plan or a failed step is answered with an error
// frame and logged; once an attention worker has died (Unavailable) every
// later step fails fast with that error, as no step can succeed without it.
void ServeChannel(shm::Channel& channel, StepRunner& runner, const ModelConfig& model,
                  const ServeOptions& options);

}  // namespace ellm::mlp
