#include "mlp-worker/step_runner.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/sampler.h"

namespace ellm::mlp {
namespace {
// Rows of logits computed at once for scored prompt tokens.
constexpr uint32_t kScoreRows = 32;
}  // namespace

absl::StatusOr<std::unique_ptr<StepRunner>> StepRunner::Create(const ModelConfig& config,
                                                               MlpBackend* backend,
                                                               std::vector<ShardLink> shards,
                                                               int max_step_tokens) {
  KvHeadCover cover;
  for (const ShardLink& s : shards) {
    if (s.channel == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("attention shard ", s.shard, " has no channel"));
    }
    RETURN_IF_ERROR(cover.Add(s.heads));
  }
  RETURN_IF_ERROR(cover.Finish(config.n_kv_heads));
  std::unique_ptr<StepRunner> runner(
      new StepRunner(config, backend, std::move(shards), max_step_tokens));
  for (const ShardLink& s : runner->shards_) {
    absl::Status st = backend->RegisterHostMemory(s.channel->memory(), s.channel->memory_bytes());
    if (st.ok()) {
      runner->registered_.push_back(s.channel->memory());
    } else {
      LogWarning("attn-worker %d: ring memory not registered with backend %s (%s); "
                 "the backend copies through pageable memory",
                 s.shard, backend->name(), st.ToString());
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
  const int qh = link.heads.count() * c_.gqa_ratio();
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

absl::Status StepRunner::RunLayer(uint64_t step, int layer, const std::vector<shm::SeqSlice>& slices,
                                  uint32_t T) {
  RETURN_IF_ERROR(backend_->StageQkv(layer));
  RETURN_IF_ERROR(SendQkv(step, layer, slices, T));
  absl::Status st = GatherAttn(step, layer, T);
  busy_since_ = absl::Now();
  // The backend has read the reply slots when this returns; they are released after.
  if (st.ok()) st = backend_->CompleteLayerFromShards(layer, io_.data(), static_cast<int>(io_.size()));
  for (size_t i = 0; i < shards_.size(); ++i) {
    if (held_[i]) shards_[i].channel->replies().EndRead();
  }
  return st;
}

absl::Status StepRunner::SendQkv(uint64_t step, int layer, const std::vector<shm::SeqSlice>& slices,
                                 uint32_t T) {
  const int hd = c_.head_dim, g = c_.gqa_ratio();
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
    const size_t kvh = link.heads.count();
    MlpBackend::ShardIo& s = io_[taken];
    s.heads = link.heads;
    s.q = f;
    s.k = s.q + T * kvh * g * hd;
    s.v = s.k + T * kvh * hd;
    slots_[taken++] = p;
  }
  if (st.ok()) st = backend_->WriteQkvShards(io_.data(), static_cast<int>(io_.size()));
  // Busy until here: once the frames are committed the shards' threads may
  // take this thread's core until they answer, and that is their time.
  AddBusy();
  for (size_t i = 0; i < taken; ++i) {
    const ShardLink& link = shards_[i];
    shm::Ring& ring = link.channel->requests();
    if (st.ok()) {
      const int kvh = link.heads.count();
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
  }
  return st;
}

absl::Status StepRunner::GatherAttn(uint64_t step, int layer, uint32_t T) {
  absl::Status first_error;
  for (size_t i = 0; i < shards_.size(); ++i) {
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
  return first_error;
}

void StepRunner::AddBusy() {
  const absl::Time now = absl::Now();
  if (busy_ns != nullptr) *busy_ns += absl::ToInt64Nanoseconds(now - busy_since_);
  busy_since_ = now;
}

absl::StatusOr<std::vector<shm::SampledSeq>> StepRunner::Run(uint64_t step,
                                                            const shm::StepPlan& plan) {
  busy_since_ = absl::Now();
  absl::StatusOr<std::vector<shm::SampledSeq>> out = RunStep(step, plan);
  AddBusy();
  return out;
}

absl::StatusOr<std::vector<shm::SampledSeq>> StepRunner::RunStep(uint64_t step,
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
  // The sampled rows' logits at once; each sequence's entries in plan order:
  // its scored prompt tokens (their logits a batch of rows at a time: a
  // chunk's in one piece would be tokens x vocabulary floats), then its
  // sampled token.
  if (!sample_rows.empty()) {
    logits_.resize(sample_rows.size() * static_cast<size_t>(c_.vocab_size));
    RETURN_IF_ERROR(backend_->ComputeLogits(sample_rows.data(), static_cast<int>(sample_rows.size()),
                                            logits_.data()));
  }
  const auto entry = [](uint64_t seq, const SampledToken& tok, shm::SampleStatus status) {
    shm::SampledSeq r;
    r.seq_id = seq;
    r.status = tok.finite ? status : shm::kLogitsNotFinite;
    r.token = tok.token;
    r.logprob = tok.logprob;
    r.n_top = static_cast<uint32_t>(tok.n_top);
    std::copy(tok.top, tok.top + tok.n_top, r.top);
    return r;
  };
  std::vector<shm::SampledSeq> out;
  size_t sampled = 0;
  int row = 0;  // the sequence's first row (and token) in the step
  const TokenCount* counts = plan.counts.data();
  const TokenBias* biases = plan.biases.data();
  for (const shm::PlanSeq& s : plan.seqs) {
    const uint32_t scored = shm::ScoredTokens(s);
    for (uint32_t done = 0; done < scored;) {
      const uint32_t n = std::min<uint32_t>(scored - done, kScoreRows);
      std::vector<int32_t> rows(n);
      for (uint32_t j = 0; j < n; ++j) rows[j] = row + static_cast<int32_t>(done + j);
      score_logits_.resize(n * static_cast<size_t>(c_.vocab_size));
      RETURN_IF_ERROR(backend_->ComputeLogits(rows.data(), static_cast<int>(n), score_logits_.data()));
      for (uint32_t j = 0; j < n; ++j) {
        const uint32_t i = done + j;  // scores the token after the chunk's i-th
        const int32_t next = i + 1 < s.slice.n_tokens ? plan.tokens[row + i + 1] : s.next_token;
        const SampledToken tok = Score(score_logits_.data() + j * static_cast<size_t>(c_.vocab_size),
                                       c_.vocab_size, next, s.top_logprobs);
        out.push_back(entry(s.slice.seq_id, tok, shm::kScored));
      }
      done += n;
    }
    if (s.sample) {
      const SampledToken tok = Sample(logits_.data() + sampled * c_.vocab_size, c_.vocab_size, shm::SamplingOf(s),
                                      s.u, counts, static_cast<int>(s.n_counts), biases, static_cast<int>(s.n_biases));
      out.push_back(entry(s.slice.seq_id, tok, shm::kSampled));
      ++sampled;
    }
    row += static_cast<int>(s.slice.n_tokens);
    counts += s.n_counts;
    biases += s.n_biases;
  }
  return out;
}

}  // namespace ellm::mlp
