// The coordinator's links to its workers: the mlp-worker's shared-memory
// channel (step plans out, sampled tokens back) and every worker's gRPC
// control stub.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "coordinator/scheduler.h"
#include "proto/control_secret.h"
#include "proto/ellm.grpc.pb.h"
#include "shm/channel.h"

namespace ellm::coord {

// One step over the mlp-worker's channel: writes the plan, then waits (up to
// `timeout`, and while the worker lives) for its sampled tokens. Unavailable
// when the worker has exited; the worker's own error when it could not run
// the step; DataLoss for a reply to another step; Cancelled once `abandoned`
// (when given) turns true.
absl::StatusOr<std::vector<shm::SampledSeq>> RunStep(shm::Channel& channel, uint64_t step,
                                                     const shm::StepPlan& plan, absl::Duration timeout,
                                                     const std::atomic<bool>* abandoned = nullptr);

// "attn-worker 3" or "mlp-worker": a worker as the logs name it.
std::string WorkerName(const ellm::v1::WorkerInfo& info);

struct WorkerHandle {
  std::string address;
  std::unique_ptr<ellm::v1::WorkerControl::Stub> stub;
  ellm::v1::WorkerInfo info;  // as of Connect
};

class WorkerLink final : public StepExecutor {
 public:
  // Opens the mlp-worker's channel and asks every worker for its info,
  // retrying until `wait` has passed.
  // Every control call carries `secret`.
  static absl::StatusOr<std::unique_ptr<WorkerLink>> Connect(
      const std::string& mlp_channel, const std::vector<std::string>& worker_addresses,
      absl::Duration wait, const CallSecret& secret);

  absl::StatusOr<std::vector<shm::SampledSeq>> Run(uint64_t step, const shm::StepPlan& plan) override;
  absl::Status UpdateKv(const KvOps& ops) override;
  absl::StatusOr<int> LoadBlocks(const std::vector<uint64_t>& keys) override;
  // The KV store's blocks that every attention worker holds (none when a
  // worker runs without a store).
  struct StoredBlocks {
    std::vector<PrefixCache::Block> blocks;  // those every worker's store holds
    int64_t capacity = 0;                    // blocks the smallest store holds
  };
  absl::StatusOr<StoredBlocks> ListStoredBlocks();
  absl::Status FillSynthetic(uint64_t id, int positions) override;
  // Every worker's current info (counters for the metrics), asked with a
  // short deadline; a worker that does not answer is left out.
  std::vector<ellm::v1::WorkerInfo> PollInfo();
  // Checks every worker: the mlp-worker's process and each control endpoint.
  // Unavailable naming the first that does not answer.
  absl::Status CheckWorkers();

  const std::vector<WorkerHandle>& workers() const { return workers_; }
  std::vector<const ellm::v1::WorkerInfo*> attn_workers() const;
  const ellm::v1::WorkerInfo* mlp_worker() const;

  absl::Duration step_timeout = absl::Seconds(300);
  // When set and true, Run stops waiting for its step (Cancelled).
  const std::atomic<bool>* abandoned = nullptr;

 private:
  // Calls rpc(worker, context) on every attention worker with `timeout`; the
  // first failure, as its status naming the shard.
  template <typename Rpc>
  absl::Status ForEachAttnWorker(absl::Duration timeout, const Rpc& rpc);
  explicit WorkerLink(const CallSecret& secret) : secret_(secret) {}
  const CallSecret secret_;
  std::unique_ptr<shm::Channel> channel_;
  std::vector<WorkerHandle> workers_;
};

}  // namespace ellm::coord
