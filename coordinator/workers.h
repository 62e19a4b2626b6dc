// The coordinator's workers across restarts: a StepExecutor that forwards to
// the current WorkerLink (one set of started workers) and replaces it after
// a failure.
//
// Failure handling, with ellm-launch: the launcher restarts every worker
// when one dies. The coordinator finds a worker dead (its process gone, a
// ring peer gone) or frozen (no answer to its health check for two
// heartbeats, or a step past its deadline); Recover then kills what is left
// of the old set, so the launcher replaces it whole, and waits until a new
// set (every pid new) answers and its channel opens.
//
// Step deadline: 10x the step's expected time, at least min_step_timeout.
// Expected: the recent p99 step time, per step or per token times the
// step's tokens (the longer), plus the positions the step's tokens attend
// times the least recent time per attended position. (The last term is for
// a step far out in the context after short ones: a prompt that hits a long
// cached prefix starts there, and its chunks' attention costs more than any
// recent step's.)
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coordinator/worker_link.h"

namespace ellm::coord {

struct WorkersOptions {
  std::string mlp_channel;
  std::vector<std::string> addresses;     // every worker's control address
  absl::Duration connect_timeout = absl::Seconds(120);
  absl::Duration recovery_timeout = absl::Seconds(300);
  absl::Duration min_step_timeout = absl::Seconds(2);
  absl::Duration heartbeat_timeout = absl::Seconds(1);
  std::function<bool()> stop;             // true: give up waiting (shutdown)
  CallSecret control_secret = CallSecret::None(CallSecret::Kind::kControl);
};

// A finished step: its time, tokens, and the positions its tokens attended.
struct StepCost {
  double seconds;
  int tokens;
  double attended;
};
// The positions a plan's tokens attend (token i of a slice: start_pos + i + 1).
double AttendedPositions(const shm::StepPlan& plan);
// The deadline of a step of `tokens` tokens attending `attended` positions,
// after the `recent` steps (see above); at least `min`.
absl::Duration StepDeadline(const std::deque<StepCost>& recent, int tokens, double attended, absl::Duration min);

class Workers final : public StepExecutor {
 public:
  static absl::StatusOr<std::unique_ptr<Workers>> Connect(const WorkersOptions& options);

  absl::StatusOr<std::vector<shm::SampledSeq>> Run(uint64_t step, const shm::StepPlan& plan) override;
  absl::Status UpdateKv(const KvOps& ops) override;
  absl::StatusOr<int> LoadBlocks(const std::vector<uint64_t>& keys) override;
  absl::Status FillSynthetic(uint64_t id, int positions) override;
  absl::Status Recover() override;
  void Abandon() override { abandoned_.store(true); }

  // One heartbeat: every worker's process alive and answering its health
  // check. Unavailable naming a dead worker; a worker that misses two
  // heartbeats in a row is frozen: it is killed (so the launcher replaces
  // the set) and reported the same way.
  absl::Status Heartbeat();
  // The current link (its workers' info, the stored blocks...).
  std::shared_ptr<WorkerLink> link() const;

 private:
  explicit Workers(const WorkersOptions& options) : options_(options) {}
  std::shared_ptr<WorkerLink> Current() const;

  const WorkersOptions options_;
  mutable std::mutex mu_;
  std::shared_ptr<WorkerLink> link_;
  std::vector<int> missed_;  // consecutive missed heartbeats, per worker of link_
  std::atomic<bool> abandoned_{false};
  std::deque<StepCost> recent_;  // newest last
};

}  // namespace ellm::coord
