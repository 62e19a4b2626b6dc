// StepRunner: runs one step plan through the backend and the attention
// shards: per layer it sends each shard the q, k, v of its heads, gathers the
// outputs, and finishes the layer; at the end it samples the sequences that
// asked for a token.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "core/kv_heads.h"
#include "core/model_config.h"
#include "mlp-worker/backend.h"
#include "shm/channel.h"
#include "shm/messages.h"

namespace ellm::mlp {

struct ShardLink {
  int shard = 0;
  KvHeads heads;  // the KV heads the shard owns
  shm::Channel* channel = nullptr;
};

class StepRunner {
 public:
  // The shards must cover the model's KV heads exactly, in order
  // (InvalidArgument otherwise).
  static absl::StatusOr<std::unique_ptr<StepRunner>> Create(const ModelConfig& config,
                                                            MlpBackend* backend,
                                                            std::vector<ShardLink> shards,
                                                            int max_step_tokens);

  // Unavailable when a shard's process has exited, DeadlineExceeded when one
  // does not answer within `shard_timeout`, other codes from the shards' errors.
  absl::StatusOr<std::vector<shm::SampledSeq>> Run(uint64_t step, const shm::StepPlan& plan);

  ~StepRunner();
  StepRunner(const StepRunner&) = delete;
  StepRunner& operator=(const StepRunner&) = delete;

  absl::Duration shard_timeout = absl::Seconds(120);

  // When set, Run adds the nanoseconds it spends computing, its waits for
  // the shards' answers left out, as it goes (before each wait and at its
  // end), so a reader sees at most one layer's work missing.
  std::atomic<int64_t>* busy_ns = nullptr;

 private:
  StepRunner(const ModelConfig& config, MlpBackend* backend, std::vector<ShardLink> shards,
             int max_step_tokens);
  absl::StatusOr<std::vector<shm::SampledSeq>> RunStep(uint64_t step, const shm::StepPlan& plan);
  // Adds the time since busy_since_ to busy_ns and restarts it.
  void AddBusy();
  // One layer: SendQkv, then GatherAttn, then the backend finishes the layer
  // from the reply slots, which are released after.
  absl::Status RunLayer(uint64_t step, int layer, const std::vector<shm::SeqSlice>& slices,
                        uint32_t n_tokens);
  // Takes a request slot in every shard's ring, has the backend write q, k, v
  // into them (the payload layout of shm/messages.h) and commits them; on a
  // failure every slot taken carries an error frame instead, whose answers
  // are read so the rings stay in step.
  absl::Status SendQkv(uint64_t step, int layer, const std::vector<shm::SeqSlice>& slices,
                       uint32_t n_tokens);
  // Reads every shard's reply (even after a failure, so the rings stay in
  // step); the good ones stay held (held_) with io_[i].attn pointing into
  // them. The first error, if any.
  absl::Status GatherAttn(uint64_t step, int layer, uint32_t n_tokens);
  shm::WaitOptions ShardWait(const ShardLink& link) const;
  // The error of a failed BeginRead on `link`'s reply ring, naming the shard.
  absl::Status ReadError(const ShardLink& link, const absl::Status& status) const;
  // OK when `h` is the attention result of (step, layer) with T tokens for
  // `link`; the shard's error or a DataLoss naming what is wrong otherwise.
  absl::Status CheckReply(const ShardLink& link, const shm::FrameHeader& h, const uint8_t* payload,
                          uint64_t step, int layer, uint32_t T) const;

  ModelConfig c_;
  MlpBackend* backend_;
  std::vector<ShardLink> shards_;
  int max_tokens_;
  std::vector<void*> registered_;  // ring segments registered with the backend
  // Per layer, one entry per shard (kept across layers: no allocation per hop).
  std::vector<MlpBackend::ShardIo> io_;
  std::vector<uint8_t*> slots_;
  std::vector<bool> held_;
  std::vector<float> logits_;        // the step's sampled rows
  std::vector<float> score_logits_;  // a batch of scored prompt rows
  absl::Time busy_since_;  // start of the computing stretch not yet added to busy_ns
};

}  // namespace ellm::mlp
