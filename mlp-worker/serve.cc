#include "mlp-worker/serve.h"

#include "core/log.h"
#include "shm/messages.h"

namespace ellm::mlp {

void ServeChannel(shm::Channel& channel, StepRunner& runner, const ModelConfig& model,
                  const ServeOptions& options) {
  shm::WaitOptions wait;
  wait.peer_alive = [&options] { return !options.stop(); };
  absl::Status broken;  // set once a shard has died: every later step fails fast
  while (!options.stop()) {
    absl::StatusOr<shm::Ring::Frame> frame = channel.requests().BeginRead(wait);
    if (!frame.ok()) {
      if (options.stop()) break;
      LogError("bad frame from the coordinator: %s", frame.status().ToString());
      shm::ReplyError(channel.replies(), 0, frame.status());
      continue;
    }
    const shm::FrameHeader header = frame->header;
    absl::StatusOr<shm::StepPlan> plan =
        shm::DecodeStepPlan(header, frame->payload, model.context_length, model.vocab_size);
    channel.requests().EndRead();
    absl::StatusOr<std::vector<shm::SampledSeq>> result =
        !plan.ok() ? plan.status() : !broken.ok() ? broken : runner.Run(header.step, *plan);
    if (options.steps != nullptr) ++*options.steps;
    if (!result.ok()) {
      LogError("step %d: %s", header.step, result.status().ToString());
      if (result.status().code() == absl::StatusCode::kUnavailable) broken = result.status();
      shm::ReplyError(channel.replies(), header.step, result.status());
      continue;
    }
    shm::FrameHeader reply;
    reply.kind = static_cast<uint16_t>(shm::FrameKind::kStepResult);
    reply.step = header.step;
    reply.n_seqs = static_cast<uint32_t>(result->size());
    reply.n_tokens = header.n_tokens;
    reply.payload_bytes = result->size() * sizeof(shm::SampledSeq);
    shm::WaitOptions write_wait;
    write_wait.timeout = absl::Seconds(30);
    const absl::Status st = channel.replies().Write(reply, result->data(), write_wait);
    if (!st.ok()) {
      // Every step gets an answer, or the coordinator waits out its timeout
      // and restarts the workers (and, with the same batch, again).
      LogError("cannot send step %d result: %s", header.step, st.ToString());
      shm::ReplyError(channel.replies(), header.step, st);
    }
  }
}

}  // namespace ellm::mlp
