#include "mlp-worker/step_runner.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/sampler.h"

namespace ellm::mlp {

absl::StatusOr<std::unique_ptr<StepRunner>> StepRunner::Create(const ModelConfig& config,
                                                               MlpBackend* backend,
                                                               std::vector<ShardLink> shards,
                                                               int max_step_tokens) {
  int next = 0;
  for (const ShardLink& s : shards) {
    if (s.kv_head_begin != next || s.kv_head_end <= s.kv_head_begin || s.channel == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attention shards must cover KV heads 0..", config.n_kv_heads,
          " in order; shard ", s.shard, " has [", s.kv_head_begin, ", ", s.kv_head_end, ")"));
    }
    next = s.kv_head_end;
  }
  if (next != config.n_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("attention shards cover KV heads 0..", next,
                                                   " of ", config.n_kv_heads));
  }
  std::unique_ptr<StepRunner> runner(
      new StepRunner(config, backend, std::move(shards), max_step_tokens));
  if (!backend->SupportsDirectIo()) {
    const size_t T = static_cast<size_t>(max_step_tokens);
    runner->q_.resize(T * config.q_dim());
    runner->attn_.resize(runner->q_.size());
    runner->k_.resize(T * config.kv_dim());
    runner->v_.resize(runner->k_.size());
  } else {
    runner->direct_ = true;
    for (const ShardLink& s : runner->shards_) {
      absl::Status st = backend->RegisterHostMemory(s.channel->memory(), s.channel->memory_bytes());
      if (st.ok()) {
        runner->registered_.push_back(s.channel->memory());
      } else {
        LogWarning("attn-worker %d: ring memory not registered with backend %s (%s); "
                   "copies go through staging buffers",
                   s.shard, backend->name(), st.ToString());
      }
    }
  }
  return runner;
}

StepRunner::~StepRunner() {
  for (void* base : registered_) backend_->UnregisterHostMemory(base);
}

shm::WaitOptions StepRunner::ShardWait(const ShardLink& link) const {
  shm::WaitOptions wait;
  wait.timeout = shard_timeout;
  shm::Channel* channel = link.channel;
  wait.peer_alive = [channel] { return channel->PeerAlive(); };
  return wait;
}

absl::Status StepRunner::ReadError(const ShardLink& link, const absl::Status& status) const {
  if (status.code() == absl::StatusCode::kUnavailable) {
    return absl::UnavailableError(absl::StrCat("attn-worker ", link.shard, " (pid ",
                                               link.channel->replies().producer_pid(),
                                               ") has exited"));
  }
  return absl::Status(status.code(), absl::StrCat("attn-worker ", link.shard, ": ", status.message()));
}

absl::Status StepRunner::CheckReply(const ShardLink& link, const shm::FrameHeader& h,
                                    const uint8_t* payload, uint64_t step, int layer,
                                    uint32_t T) const {
  const int qh = (link.kv_head_end - link.kv_head_begin) * c_.gqa_ratio();
  if (h.kind == static_cast<uint16_t>(shm::FrameKind::kError)) {
    absl::Status remote = shm::DecodeError(h, payload);
    return absl::Status(remote.code(),
                        absl::StrCat("attn-worker ", link.shard, ": ", remote.message()));
  }
  if (h.kind != static_cast<uint16_t>(shm::FrameKind::kAttnResult) || h.step != step ||
      h.layer != static_cast<uint32_t>(layer) || h.n_tokens != T ||
      h.payload_bytes != shm::AttnShape{qh, 0, c_.head_dim}.ResultBytes(T)) {
    return absl::DataLossError(absl::StrCat("attn-worker ", link.shard, " answered kind ", h.kind,
                                            " step ", h.step, " layer ", h.layer, " with ",
                                            h.payload_bytes, " bytes; expected step ", step,
                                            " layer ", layer));
  }
  return absl::OkStatus();
}

StepRunner::StepRunner(const ModelConfig& config, MlpBackend* backend,
                       std::vector<ShardLink> shards, int max_step_tokens)
    : c_(config),
      backend_(backend),
      shards_(std::move(shards)),
      max_tokens_(max_step_tokens),
      io_(shards_.size()),
      slots_(shards_.size()),
      held_(shards_.size()) {}

void StepRunner::CopyQkvToShards(uint32_t T) {
  const int hd = c_.head_dim, g = c_.gqa_ratio();
  for (const MlpBackend::ShardIo& s : io_) {
    const int kvh = s.kv_head_end - s.kv_head_begin;
    const size_t q_row = static_cast<size_t>(kvh) * g * hd, kv_row = static_cast<size_t>(kvh) * hd;
    for (uint32_t t = 0; t < T; ++t) {
      std::memcpy(s.q + t * q_row, q_.data() + t * static_cast<size_t>(c_.q_dim()) + s.kv_head_begin * g * hd,
                  q_row * sizeof(float));
      std::memcpy(s.k + t * kv_row, k_.data() + t * static_cast<size_t>(c_.kv_dim()) + s.kv_head_begin * hd,
                  kv_row * sizeof(float));
      std::memcpy(s.v + t * kv_row, v_.data() + t * static_cast<size_t>(c_.kv_dim()) + s.kv_head_begin * hd,
                  kv_row * sizeof(float));
    }
  }
}

void StepRunner::CopyShardsToAttn(uint32_t T) {
  const int hd = c_.head_dim, g = c_.gqa_ratio();
  for (const MlpBackend::ShardIo& s : io_) {
    const size_t row = static_cast<size_t>(s.kv_head_end - s.kv_head_begin) * g * hd;
    for (uint32_t t = 0; t < T; ++t) {
      std::memcpy(attn_.data() + t * static_cast<size_t>(c_.q_dim()) + s.kv_head_begin * g * hd,
                  s.attn + t * row, row * sizeof(float));
    }
  }
}

absl::Status StepRunner::RunLayer(uint64_t step, int layer, const std::vector<shm::SeqSlice>& slices,
                                  uint32_t T) {
  // q, k, v: kept in the backend (direct I/O) or computed into q_, k_, v_.
  RETURN_IF_ERROR(direct_ ? backend_->StageQkv(layer)
                          : backend_->ComputeQkv(layer, q_.data(), k_.data(), v_.data()));
  const int hd = c_.head_dim, g = c_.gqa_ratio();
  const size_t n = shards_.size();
  // Take a request slot in every shard's ring; q, k, v go straight into them
  // (the payload layout of shm/messages.h).
  absl::Status st;
  size_t taken = 0;
  for (const ShardLink& link : shards_) {
    absl::StatusOr<uint8_t*> slot = link.channel->requests().BeginWrite(ShardWait(link));
    if (!slot.ok()) {
      st = absl::Status(slot.status().code(),
                        absl::StrCat("attn-worker ", link.shard, ": ", slot.status().message()));
      break;
    }
    uint8_t* p = *slot;
    std::memcpy(p, slices.data(), slices.size() * sizeof(shm::SeqSlice));
    float* f = reinterpret_cast<float*>(p + slices.size() * sizeof(shm::SeqSlice));
    const size_t kvh = link.kv_head_end - link.kv_head_begin;
    MlpBackend::ShardIo& s = io_[taken];
    s.kv_head_begin = link.kv_head_begin;
    s.kv_head_end = link.kv_head_end;
    s.q = f;
    s.k = s.q + T * kvh * g * hd;
    s.v = s.k + T * kvh * hd;
    slots_[taken++] = p;
  }
  if (st.ok()) {
    if (direct_) {
      st = backend_->WriteQkvShards(io_.data(), static_cast<int>(n));
    } else {
      CopyQkvToShards(T);
    }
  }
  for (size_t i = 0; i < taken; ++i) {
    const ShardLink& link = shards_[i];
    shm::Ring& ring = link.channel->requests();
    if (st.ok()) {
      const int kvh = link.kv_head_end - link.kv_head_begin;
      shm::FrameHeader h;
      h.kind = static_cast<uint16_t>(shm::FrameKind::kAttnRequest);
      h.step = step;
      h.layer = static_cast<uint32_t>(layer);
      h.n_seqs = static_cast<uint32_t>(slices.size());
      h.n_tokens = T;
      h.payload_bytes = shm::AttnShape{kvh * g, kvh, hd}.RequestBytes(h.n_seqs, T);
      ring.CommitWrite(h);
    } else {
      shm::CommitError(ring, slots_[i], step, st);  // the ring stays usable
    }
  }
  if (!st.ok()) {
    // The shards that got an error frame answer it; read those answers so the
    // next step does not take them for its own.
    for (size_t i = 0; i < taken; ++i) {
      absl::StatusOr<shm::Ring::Frame> frame = shards_[i].channel->replies().BeginRead(ShardWait(shards_[i]));
      if (frame.ok()) shards_[i].channel->replies().EndRead();
    }
    return st;
  }

  // Every shard's reply is read, even after a failure, so the rings stay in step.
  absl::Status first_error;
  for (size_t i = 0; i < n; ++i) {
    const ShardLink& link = shards_[i];
    held_[i] = false;
    absl::StatusOr<shm::Ring::Frame> frame = link.channel->replies().BeginRead(ShardWait(link));
    if (!frame.ok()) {
      if (first_error.ok()) first_error = ReadError(link, frame.status());
      continue;
    }
    absl::Status check = CheckReply(link, frame->header, frame->payload, step, layer, T);
    if (!check.ok()) {
      link.channel->replies().EndRead();
      if (first_error.ok()) first_error = check;
      continue;
    }
    held_[i] = true;
    io_[i].attn = reinterpret_cast<const float*>(frame->payload);
  }
  // The reply slots have been read when this returns; they are released after.
  if (first_error.ok()) {
    if (direct_) {
      first_error = backend_->CompleteLayerFromShards(layer, io_.data(), static_cast<int>(n));
    } else {
      CopyShardsToAttn(T);
      first_error = backend_->CompleteLayer(layer, attn_.data());
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (held_[i]) shards_[i].channel->replies().EndRead();
  }
  return first_error;
}

absl::StatusOr<std::vector<shm::SampledSeq>> StepRunner::Run(uint64_t step,
                                                            const shm::StepPlan& plan) {
  const int T = static_cast<int>(plan.tokens.size());
  if (T == 0 || T > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat("step of ", T, " tokens (max ", max_tokens_, ")"));
  }
  std::vector<shm::SeqSlice> slices;
  std::vector<int32_t> positions;
  std::vector<int32_t> sample_rows;
  for (const shm::PlanSeq& s : plan.seqs) {
    slices.push_back(s.slice);
    for (uint32_t j = 0; j < s.slice.n_tokens; ++j) {
      positions.push_back(static_cast<int32_t>(s.slice.start_pos + j));
    }
    if (s.sample) sample_rows.push_back(static_cast<int32_t>(positions.size()) - 1);
  }
  RETURN_IF_ERROR(backend_->BeginStep(plan.tokens.data(), positions.data(), T));
  for (int layer = 0; layer < c_.n_layers; ++layer) {
    RETURN_IF_ERROR(RunLayer(step, layer, slices, static_cast<uint32_t>(T)));
  }
  std::vector<shm::SampledSeq> out;
  if (sample_rows.empty()) return out;
  logits_.resize(sample_rows.size() * static_cast<size_t>(c_.vocab_size));
  RETURN_IF_ERROR(backend_->ComputeLogits(sample_rows.data(), static_cast<int>(sample_rows.size()),
                                          logits_.data()));
  size_t i = 0;
  for (const shm::PlanSeq& s : plan.seqs) {
    if (!s.sample) continue;
    SamplingParams params{s.temperature, s.top_k, s.top_p, s.top_logprobs};
    const SampledToken tok = Sample(logits_.data() + i * c_.vocab_size, c_.vocab_size, params, s.u);
    shm::SampledSeq& r = out.emplace_back();
    r.seq_id = s.slice.seq_id;
    r.token = tok.token;
    r.logprob = tok.logprob;
    r.n_top = static_cast<uint32_t>(tok.n_top);
    std::copy(tok.top, tok.top + tok.n_top, r.top);
    ++i;
  }
  return out;
}

}  // namespace ellm::mlp
