#include "attn-worker/serve.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/log.h"
#include "shm/messages.h"

namespace ellm::attn {

void ServeChannel(shm::Channel& channel, AttentionShard& shard, const ServeOptions& options) {
  const ShardGeometry& geometry = shard.geometry();
  const shm::AttnShape shape = geometry.shape();
  shm::WaitOptions wait;
  wait.peer_alive = [&options] { return !options.stop(); };
  std::vector<shm::SeqSlice> slices;  // the frame's batch descriptor, as checked
  while (!options.stop()) {
    absl::StatusOr<shm::Ring::Frame> frame = channel.requests().BeginRead(wait);
    if (!frame.ok()) {
      if (options.stop()) break;
      LogError("bad frame from the mlp-worker: %s", frame.status().ToString());
      shm::ReplyError(channel.replies(), 0, frame.status());
      continue;
    }
    const shm::FrameHeader header = frame->header;
    absl::Status status;
    bool replied = false;  // a reply slot was taken and committed
    absl::StatusOr<shm::AttnRequestView> request =
        shm::DecodeAttnRequest(header, frame->payload, shape, geometry.max_positions, &slices);
    if (!request.ok()) {
      status = request.status();
    } else if (shape.ResultBytes(header.n_tokens) > channel.replies().max_payload_bytes()) {
      // The output goes straight into a reply slot: it must fit (a frame
      // that carries fewer sequences than the batch limit has room for more
      // tokens than --max-step-tokens).
      status = absl::InvalidArgumentError(absl::StrCat(
          "a step of ", header.n_tokens, " tokens needs a ", shape.ResultBytes(header.n_tokens),
          "-byte reply; this worker's reply slots hold ", channel.replies().max_payload_bytes(),
          " (--max-step-tokens)"));
    } else {
      // The output goes straight into the reply slot.
      shm::WaitOptions write_wait;
      write_wait.timeout = absl::Seconds(30);
      absl::StatusOr<uint8_t*> slot = channel.replies().BeginWrite(write_wait);
      if (!slot.ok()) {
        status = slot.status();
      } else {
        {
          std::unique_lock<std::mutex> lock;
          if (options.cache_mu != nullptr) lock = std::unique_lock<std::mutex>(*options.cache_mu);
          const absl::Time begin = absl::Now();
          status = shard.Process(header.layer, header.n_seqs, header.n_tokens, *request,
                                 reinterpret_cast<float*>(*slot));
          if (options.busy_ns != nullptr) *options.busy_ns += absl::ToInt64Nanoseconds(absl::Now() - begin);
        }
        if (status.ok()) {
          shm::FrameHeader reply;
          reply.kind = static_cast<uint16_t>(shm::FrameKind::kAttnResult);
          reply.step = header.step;
          reply.layer = header.layer;
          reply.n_seqs = header.n_seqs;
          reply.n_tokens = header.n_tokens;
          reply.payload_bytes = shape.ResultBytes(header.n_tokens);
          channel.replies().CommitWrite(reply);
        } else {
          // The taken slot carries the error (a second BeginWrite would abort).
          shm::CommitError(channel.replies(), *slot, header.step, status);
        }
        replied = true;
      }
    }
    channel.requests().EndRead();
    if (header.layer == 0 && options.steps != nullptr) ++*options.steps;  // one frame per layer
    if (!status.ok()) {
      LogError("step %d layer %d: %s", header.step, header.layer, status.ToString());
      if (!replied) shm::ReplyError(channel.replies(), header.step, status);
    }
  }
}

}  // namespace ellm::attn
