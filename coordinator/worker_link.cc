#include "coordinator/worker_link.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <thread>

#include "absl/container/flat_hash_map.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/log.h"
#include "core/signals.h"
#include "proto/grpc_status.h"
#include "proto/kv_ops_proto.h"

namespace ellm::coord {

absl::StatusOr<std::unique_ptr<WorkerLink>> WorkerLink::Connect(
    const std::string& mlp_channel, const std::vector<std::string>& addresses, absl::Duration wait,
    const CallSecret& secret) {
  std::unique_ptr<WorkerLink> link(new WorkerLink(secret));
  const absl::Time deadline = absl::Now() + wait;
  for (const std::string& address : addresses) {
    WorkerHandle w;
    w.address = address;
    // Workers start at the same time as the coordinator. A channel whose
    // first connection failed waits out gRPC's reconnect backoff, so each
    // attempt gets a fresh channel until the worker answers.
    for (;;) {
      w.stub = ellm::v1::WorkerControl::NewStub(
          grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      secret.Attach(&ctx);
      ellm::v1::GetInfoRequest req;
      grpc::Status st = w.stub->GetInfo(&ctx, req, &w.info);
      if (st.ok()) break;
      if (StopRequested()) return absl::CancelledError("stopped while connecting to the workers");
      if (absl::Now() > deadline) {
        return absl::UnavailableError(
            absl::StrCat("worker at ", address, " does not answer: ", st.error_message()));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    LogInfo("%s at %s: pid %d%s", WorkerName(w.info), address, w.info.pid(),
            w.info.role() == ellm::v1::WORKER_ROLE_ATTN
                ? absl::StrCat(", KV heads [", w.info.kv_head_begin(), ", ", w.info.kv_head_end(),
                               "), ", w.info.kv_blocks_total(), " KV blocks")
                : absl::StrCat(", backend ", w.info.kernel()));
    link->workers_.push_back(std::move(w));
  }
  ASSIGN_OR_RETURN(link->channel_,
                   shm::Channel::Open(mlp_channel, std::max(deadline - absl::Now(), absl::Seconds(1))));
  return link;
}

std::string WorkerName(const ellm::v1::WorkerInfo& info) {
  switch (info.role()) {
    case ellm::v1::WORKER_ROLE_ATTN: return absl::StrCat("attn-worker ", info.shard());
    case ellm::v1::WORKER_ROLE_MLP: return "mlp-worker";
    default: return absl::StrCat("worker of unknown role ", static_cast<int>(info.role()));
  }
}

std::vector<const ellm::v1::WorkerInfo*> WorkerLink::attn_workers() const {
  std::vector<const ellm::v1::WorkerInfo*> out;
  for (const WorkerHandle& w : workers_) {
    if (w.info.role() == ellm::v1::WORKER_ROLE_ATTN) out.push_back(&w.info);
  }
  return out;
}

const ellm::v1::WorkerInfo* WorkerLink::mlp_worker() const {
  for (const WorkerHandle& w : workers_) {
    if (w.info.role() == ellm::v1::WORKER_ROLE_MLP) return &w.info;
  }
  return nullptr;
}

absl::StatusOr<std::vector<shm::SampledSeq>> RunStep(shm::Channel& channel, uint64_t step,
                                                     const shm::StepPlan& plan, absl::Duration timeout,
                                                     const std::atomic<bool>* abandoned) {
  const std::string payload = shm::EncodeStepPlan(plan);
  shm::WaitOptions wait;
  wait.timeout = timeout;
  auto given_up = [abandoned] { return abandoned != nullptr && abandoned->load(); };
  wait.peer_alive = [&channel, given_up] { return channel.PeerAlive() && !given_up(); };
  absl::Status st = channel.requests().Write(shm::StepPlanHeader(step, plan), payload.data(), wait);
  if (!st.ok()) {
    return absl::Status(st.code(), absl::StrCat("mlp-worker: ", st.message()));
  }
  absl::StatusOr<shm::Ring::Frame> frame = channel.replies().BeginRead(wait);
  if (!frame.ok() && given_up()) return absl::CancelledError("the server is shutting down");
  if (!frame.ok()) {
    if (frame.status().code() == absl::StatusCode::kUnavailable) {
      return absl::UnavailableError(absl::StrCat("the mlp-worker (pid ",
                                                 channel.replies().producer_pid(), ") has exited"));
    }
    return absl::Status(frame.status().code(),
                        absl::StrCat("mlp-worker: ", frame.status().message()));
  }
  absl::StatusOr<std::vector<shm::SampledSeq>> result =
      frame->header.step != step && frame->header.kind != static_cast<uint16_t>(shm::FrameKind::kError)
          ? absl::DataLossError(absl::StrCat("mlp-worker answered step ", frame->header.step,
                                             " to step ", step))
          : shm::DecodeStepResult(frame->header, frame->payload);
  channel.replies().EndRead();
  return result;
}

absl::StatusOr<std::vector<shm::SampledSeq>> WorkerLink::Run(uint64_t step,
                                                             const shm::StepPlan& plan) {
  absl::StatusOr<std::vector<shm::SampledSeq>> result = RunStep(*channel_, step, plan, step_timeout, abandoned);
  if (!result.ok() && result.status().code() == absl::StatusCode::kUnavailable) {
    // Name every worker that is gone: the launcher stops the others when one
    // dies, so the MLP worker this step waits on is often not the first.
    if (absl::Status gone = CheckWorkers(); !gone.ok()) return gone;
  }
  return result;
}

template <typename Rpc>
absl::Status WorkerLink::ForEachAttnWorker(absl::Duration timeout, const Rpc& rpc) {
  for (WorkerHandle& w : workers_) {
    if (w.info.role() != ellm::v1::WORKER_ROLE_ATTN) continue;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    secret_.Attach(&ctx);
    const grpc::Status st = rpc(w, ctx);
    if (!st.ok()) {
      const absl::Status remote = FromGrpcStatus(st);
      return absl::Status(remote.code(), absl::StrCat("attn-worker ", w.info.shard(), " at ",
                                                      w.address, ": ", remote.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status WorkerLink::UpdateKv(const KvOps& ops) {
  const ellm::v1::UpdateKvRequest req = ToProto(ops);
  return ForEachAttnWorker(absl::Seconds(5), [&](WorkerHandle& w, grpc::ClientContext& ctx) {
    ellm::v1::UpdateKvResponse resp;
    return w.stub->UpdateKv(&ctx, req, &resp);
  });
}

absl::StatusOr<int> WorkerLink::LoadBlocks(const std::vector<uint64_t>& keys) {
  ellm::v1::LoadBlocksRequest req;
  for (uint64_t k : keys) req.add_keys(k);
  int loaded = static_cast<int>(keys.size());
  RETURN_IF_ERROR(ForEachAttnWorker(absl::Seconds(120), [&](WorkerHandle& w, grpc::ClientContext& ctx) {
    ellm::v1::LoadBlocksResponse resp;
    grpc::Status st = w.stub->LoadBlocks(&ctx, req, &resp);
    if (st.ok()) loaded = std::min(loaded, resp.loaded());
    return st;
  }));
  return loaded;
}

absl::StatusOr<WorkerLink::StoredBlocks> WorkerLink::ListStoredBlocks() {
  // key -> (block, how many workers list it)
  absl::flat_hash_map<uint64_t, std::pair<PrefixCache::Block, int>> seen;
  int workers = 0;
  bool enabled = true;
  int64_t capacity = std::numeric_limits<int64_t>::max();
  RETURN_IF_ERROR(ForEachAttnWorker(absl::Seconds(60), [&](WorkerHandle& w, grpc::ClientContext& ctx) {
    ellm::v1::ListStoredBlocksResponse resp;
    grpc::Status st = w.stub->ListStoredBlocks(&ctx, ellm::v1::ListStoredBlocksRequest(), &resp);
    if (!st.ok()) return st;
    ++workers;
    enabled = enabled && resp.enabled();
    capacity = std::min(capacity, resp.capacity_blocks());
    for (const ellm::v1::StoredBlock& b : resp.blocks()) {
      auto& [block, count] = seen[b.key()];
      if (count == 0) block = {b.key(), b.parent(), {b.tokens().begin(), b.tokens().end()}};
      ++count;
    }
    return st;
  }));
  StoredBlocks out;
  if (!enabled || workers == 0) return out;
  out.capacity = capacity;
  for (auto& [key, entry] : seen) {
    if (entry.second == workers) out.blocks.push_back(std::move(entry.first));
  }
  return out;
}

absl::Status WorkerLink::FillSynthetic(uint64_t id, int positions) {
  ellm::v1::FillSyntheticRequest req;
  req.set_sequence_id(id);
  req.set_positions(positions);
  req.set_seed(id * 0x9e3779b97f4a7c15ULL + 1);
  return ForEachAttnWorker(absl::Seconds(600), [&](WorkerHandle& w, grpc::ClientContext& ctx) {
    ellm::v1::FillSyntheticResponse resp;
    return w.stub->FillSynthetic(&ctx, req, &resp);
  });
}

std::vector<ellm::v1::WorkerInfo> WorkerLink::PollInfo() {
  std::vector<ellm::v1::WorkerInfo> out;
  for (WorkerHandle& w : workers_) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    secret_.Attach(&ctx);
    ellm::v1::WorkerInfo info;
    if (w.stub->GetInfo(&ctx, ellm::v1::GetInfoRequest(), &info).ok()) out.push_back(std::move(info));
  }
  return out;
}

absl::Status WorkerLink::CheckWorkers() {
  std::vector<std::string> gone;
  for (WorkerHandle& w : workers_) {
    if (w.info.role() == ellm::v1::WORKER_ROLE_MLP) continue;  // through its channel, below
    if (!shm::ProcessAlive(w.info.pid())) gone.push_back(absl::StrCat(WorkerName(w.info), " (pid ", w.info.pid(), ")"));
  }
  if (!channel_->PeerAlive()) {
    gone.push_back(absl::StrCat("the mlp-worker (pid ", channel_->replies().producer_pid(), ")"));
  }
  if (gone.empty()) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat(absl::StrJoin(gone, " and "), gone.size() == 1 ? " has exited" : " have exited"));
}

}  // namespace ellm::coord
