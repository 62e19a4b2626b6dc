#include "shm/messages.h"

#include <algorithm>
#include <cmath>

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/log.h"

namespace ellm::shm {
namespace {

// memcpy of n bytes where either side may be an empty vector's null data():
// memcpy's pointers must be valid even for 0 bytes.
void CopyBytes(void* dst, const void* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

}  // namespace

absl::Status ValidateSlices(const SeqSlice* slices, uint32_t n_seqs, uint32_t n_tokens,
                            uint32_t max_positions) {
  if (n_seqs == 0) return absl::DataLossError("frame has an empty batch (0 sequences)");
  // Every slice holds a token: checked first, it bounds the pairwise check
  // below by the step's tokens (a frame of many empty slices would otherwise
  // cost n_seqs^2).
  if (n_seqs > n_tokens) {
    return absl::DataLossError(absl::StrCat("batch descriptor has ", n_seqs, " sequences for ", n_tokens, " tokens"));
  }
  uint64_t total = 0;
  for (uint32_t i = 0; i < n_seqs; ++i) {
    const SeqSlice& s = slices[i];
    if (s.n_tokens == 0) {
      return absl::DataLossError(absl::StrCat("sequence ", s.seq_id, " has 0 tokens in the frame"));
    }
    if (static_cast<uint64_t>(s.start_pos) + s.n_tokens > max_positions) {
      return absl::DataLossError(absl::StrCat("sequence ", s.seq_id, " positions [", s.start_pos,
                                              ", ", s.start_pos + uint64_t{s.n_tokens},
                                              ") exceed the context of ", max_positions));
    }
    // Pairwise: a batch holds a few sequences, and this runs on every layer's
    // hop, where a hash set would allocate each time.
    for (uint32_t j = 0; j < i; ++j) {
      if (slices[j].seq_id == s.seq_id) {
        return absl::DataLossError(absl::StrCat("sequence ", s.seq_id, " appears twice in a frame"));
      }
    }
    total += s.n_tokens;
  }
  if (total != n_tokens) {
    return absl::DataLossError(absl::StrCat("batch descriptor says ", n_tokens,
                                            " tokens but its sequences hold ", total));
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckKind(const FrameHeader& header, FrameKind kind, const char* what) {
  if (header.kind != static_cast<uint16_t>(kind)) {
    return absl::DataLossError(
        absl::StrCat("expected a ", what, " frame (kind ", static_cast<int>(kind), "), got kind ",
                     header.kind));
  }
  return absl::OkStatus();
}

absl::Status CheckBytes(const FrameHeader& header, uint64_t expected, const char* what) {
  if (header.payload_bytes != expected) {
    return absl::DataLossError(absl::StrCat(what, " payload is ", header.payload_bytes,
                                            " bytes, its batch descriptor needs ", expected));
  }
  return absl::OkStatus();
}

uint64_t StepPlanBytes(const StepPlan& plan) {
  return plan.seqs.size() * sizeof(PlanSeq) + plan.tokens.size() * sizeof(int32_t) +
         plan.counts.size() * sizeof(TokenCount) + plan.biases.size() * sizeof(TokenBias);
}

}  // namespace

void SetSampling(const SamplingParams& params, PlanSeq* p) {
  p->temperature = params.temperature;
  p->top_k = params.top_k;
  p->top_p = params.top_p;
  p->min_p = params.min_p;
  p->top_logprobs = params.top_logprobs;
  p->presence_penalty = params.presence_penalty;
  p->frequency_penalty = params.frequency_penalty;
  p->repetition_penalty = params.repetition_penalty;
}

SamplingParams SamplingOf(const PlanSeq& p) {
  return {.temperature = p.temperature, .top_k = p.top_k, .top_p = p.top_p, .min_p = p.min_p,
          .top_logprobs = p.top_logprobs, .presence_penalty = p.presence_penalty,
          .frequency_penalty = p.frequency_penalty, .repetition_penalty = p.repetition_penalty};
}

uint64_t StepPlanCountsCapacity(int max_seqs) { return uint64_t(std::min(max_seqs, 16)) * kMaxPenaltyTokens; }
uint64_t StepPlanBiasesCapacity(int max_seqs) { return uint64_t(std::min(max_seqs, 16)) * kMaxSeqBiases; }

uint32_t ScoredTokens(const PlanSeq& p) {
  return p.score == 0 ? 0 : p.slice.n_tokens - (p.sample != 0 ? 1 : 0);
}

uint64_t StepResultCapacity(int max_seqs, int max_tokens) {
  return sizeof(FrameHeader) + (uint64_t(max_seqs) + uint64_t(max_tokens)) * sizeof(SampledSeq);
}

uint64_t StepPlanCapacity(int max_seqs, int max_tokens) {
  return sizeof(FrameHeader) + uint64_t(max_seqs) * sizeof(PlanSeq) + uint64_t(max_tokens) * sizeof(int32_t) +
         StepPlanCountsCapacity(max_seqs) * sizeof(TokenCount) + StepPlanBiasesCapacity(max_seqs) * sizeof(TokenBias);
}

std::string EncodeStepPlan(const StepPlan& plan) {
  std::string out(StepPlanBytes(plan), '\0');
  char* at = out.data();
  CopyBytes(at, plan.seqs.data(), plan.seqs.size() * sizeof(PlanSeq));
  at += plan.seqs.size() * sizeof(PlanSeq);
  CopyBytes(at, plan.tokens.data(), plan.tokens.size() * sizeof(int32_t));
  at += plan.tokens.size() * sizeof(int32_t);
  CopyBytes(at, plan.counts.data(), plan.counts.size() * sizeof(TokenCount));
  at += plan.counts.size() * sizeof(TokenCount);
  CopyBytes(at, plan.biases.data(), plan.biases.size() * sizeof(TokenBias));
  return out;
}

FrameHeader StepPlanHeader(uint64_t step, const StepPlan& plan) {
  FrameHeader h;
  h.kind = static_cast<uint16_t>(FrameKind::kStepPlan);
  h.step = step;
  h.n_seqs = static_cast<uint32_t>(plan.seqs.size());
  h.n_tokens = static_cast<uint32_t>(plan.tokens.size());
  h.payload_bytes = StepPlanBytes(plan);
  return h;
}

absl::StatusOr<StepPlan> DecodeStepPlan(const FrameHeader& header, const uint8_t* payload,
                                        uint32_t max_positions, int vocab_size) {
  RETURN_IF_ERROR(CheckKind(header, FrameKind::kStepPlan, "step plan"));
  // The sequences first: their n_counts say how long the rest is.
  const uint64_t fixed = uint64_t{header.n_seqs} * sizeof(PlanSeq) + uint64_t{header.n_tokens} * sizeof(int32_t);
  if (header.payload_bytes < fixed) RETURN_IF_ERROR(CheckBytes(header, fixed, "step plan"));
  StepPlan plan;
  plan.seqs.resize(header.n_seqs);
  CopyBytes(plan.seqs.data(), payload, plan.seqs.size() * sizeof(PlanSeq));
  uint64_t n_counts = 0, n_biases = 0;
  for (const PlanSeq& s : plan.seqs) {
    if (s.n_counts > kMaxPenaltyTokens) {
      return absl::DataLossError(absl::StrCat("step plan of sequence ", s.slice.seq_id, " has ", s.n_counts,
                                              " token counts, more than ", kMaxPenaltyTokens));
    }
    if (s.n_biases > kMaxSeqBiases) {
      return absl::DataLossError(absl::StrCat("step plan of sequence ", s.slice.seq_id, " has ", s.n_biases,
                                              " logit biases, more than ", kMaxSeqBiases));
    }
    n_counts += s.n_counts;
    n_biases += s.n_biases;
  }
  RETURN_IF_ERROR(
      CheckBytes(header, fixed + n_counts * sizeof(TokenCount) + n_biases * sizeof(TokenBias), "step plan"));
  plan.tokens.resize(header.n_tokens);
  plan.counts.resize(n_counts);
  plan.biases.resize(n_biases);
  CopyBytes(plan.tokens.data(), payload + plan.seqs.size() * sizeof(PlanSeq), plan.tokens.size() * sizeof(int32_t));
  CopyBytes(plan.counts.data(), payload + fixed, plan.counts.size() * sizeof(TokenCount));
  CopyBytes(plan.biases.data(), payload + fixed + plan.counts.size() * sizeof(TokenCount),
            plan.biases.size() * sizeof(TokenBias));
  std::vector<SeqSlice> slices;
  for (const PlanSeq& s : plan.seqs) slices.push_back(s.slice);
  RETURN_IF_ERROR(ValidateSlices(slices.data(), header.n_seqs, header.n_tokens, max_positions));
  for (const PlanSeq& s : plan.seqs) {
    const absl::Status st = ValidateSamplingParams(SamplingOf(s), vocab_size);
    if (!st.ok()) {
      return absl::DataLossError(absl::StrCat("step plan of sequence ", s.slice.seq_id, ": ", st.message()));
    }
  }
  // Scoring: on or off; a next token (of the vocabulary) exactly when a
  // scored chunk does not sample.
  for (const PlanSeq& s : plan.seqs) {
    const bool wants_next = s.score == 1 && s.sample == 0;
    if (s.score > 1 || (wants_next ? s.next_token < 0 || s.next_token >= vocab_size : s.next_token != -1)) {
      return absl::DataLossError(absl::StrCat("step plan of sequence ", s.slice.seq_id, " has a bad score (",
                                              s.score, ") or next token (", s.next_token,
                                              "): a token of the vocabulary when a scored chunk does not sample, "
                                              "else -1"));
    }
  }
  // Each sequence's counts: distinct tokens of the vocabulary, in order, each
  // generated at least once (a token twice would be penalised twice), or
  // (count 0) a token of the prompt, for a repetition penalty only.
  const TokenCount* c = plan.counts.data();
  for (const PlanSeq& s : plan.seqs) {
    const int32_t least = s.repetition_penalty != 1 ? 0 : 1;
    for (uint32_t i = 0; i < s.n_counts; ++i, ++c) {
      if (c->token < 0 || c->token >= vocab_size || c->count < least || (i > 0 && c->token <= c[-1].token)) {
        return absl::DataLossError(absl::StrCat("step plan of sequence ", s.slice.seq_id, " has a bad token count (",
                                                c->token, " x ", c->count, "): ids must be distinct, in order and ",
                                                "in the vocabulary of ", vocab_size, ", counts at least ", least));
      }
    }
  }
  // Each sequence's logit bias: distinct tokens of the vocabulary, in order,
  // each bias in [-100, 100] or -inf (a ban).
  const TokenBias* b = plan.biases.data();
  for (const PlanSeq& s : plan.seqs) {
    for (uint32_t i = 0; i < s.n_biases; ++i, ++b) {
      const bool banned = b->bias == -std::numeric_limits<float>::infinity();
      if (b->token < 0 || b->token >= vocab_size || (i > 0 && b->token <= b[-1].token) ||
          (!banned && (!std::isfinite(b->bias) || b->bias < -100 || b->bias > 100))) {
        return absl::DataLossError(absl::StrCat("step plan of sequence ", s.slice.seq_id, " has a bad logit bias (",
                                                b->token, ": ", b->bias, "): ids must be distinct, in order and in ",
                                                "the vocabulary of ", vocab_size, ", biases in [-100, 100] or -inf"));
      }
    }
  }
  for (int32_t t : plan.tokens) {
    if (t < 0 || t >= vocab_size) {
      return absl::DataLossError(absl::StrCat("step plan has token id ", t,
                                              " outside the vocabulary of ", vocab_size));
    }
  }
  return plan;
}

absl::StatusOr<std::vector<SampledSeq>> DecodeStepResult(const FrameHeader& header,
                                                         const uint8_t* payload) {
  if (header.kind == static_cast<uint16_t>(FrameKind::kError)) {
    return DecodeError(header, payload);
  }
  RETURN_IF_ERROR(CheckKind(header, FrameKind::kStepResult, "step result"));
  RETURN_IF_ERROR(CheckBytes(header, uint64_t{header.n_seqs} * sizeof(SampledSeq), "step result"));
  std::vector<SampledSeq> out(header.n_seqs);
  CopyBytes(out.data(), payload, out.size() * sizeof(SampledSeq));
  for (const SampledSeq& s : out) {
    if (s.status != kSampled && s.status != kLogitsNotFinite && s.status != kScored) {
      return absl::DataLossError(
          absl::StrCat("step result of sequence ", s.seq_id, " has unknown status ", s.status));
    }
    if (s.n_top > kMaxTopLogprobs) {
      return absl::DataLossError(absl::StrCat("step result of sequence ", s.seq_id, " has ", s.n_top,
                                              " top logprobs (at most ", kMaxTopLogprobs, ")"));
    }
  }
  return out;
}

uint64_t AttnShape::RequestBytes(uint32_t n_seqs, uint32_t n_tokens) const {
  return uint64_t{n_seqs} * sizeof(SeqSlice) +
         uint64_t{n_tokens} * (q_heads + 2 * kv_heads) * head_dim * sizeof(float);
}

uint64_t AttnShape::ResultBytes(uint32_t n_tokens) const {
  return uint64_t{n_tokens} * q_heads * head_dim * sizeof(float);
}

absl::StatusOr<AttnRequestView> DecodeAttnRequest(const FrameHeader& header,
                                                  const uint8_t* payload, const AttnShape& shape,
                                                  uint32_t max_positions,
                                                  std::vector<SeqSlice>* slices) {
  RETURN_IF_ERROR(CheckKind(header, FrameKind::kAttnRequest, "attention request"));
  RETURN_IF_ERROR(CheckBytes(header, shape.RequestBytes(header.n_seqs, header.n_tokens),
                             "attention request"));
  slices->resize(header.n_seqs);
  CopyBytes(slices->data(), payload, slices->size() * sizeof(SeqSlice));
  AttnRequestView view;
  view.slices = slices->data();
  RETURN_IF_ERROR(ValidateSlices(view.slices, header.n_seqs, header.n_tokens, max_positions));
  const float* f = reinterpret_cast<const float*>(payload + header.n_seqs * sizeof(SeqSlice));
  view.q = f;
  view.k = view.q + static_cast<size_t>(header.n_tokens) * shape.q_heads * shape.head_dim;
  view.v = view.k + static_cast<size_t>(header.n_tokens) * shape.kv_heads * shape.head_dim;
  return view;
}

absl::Status DecodeError(const FrameHeader& header, const uint8_t* payload) {
  std::string message(reinterpret_cast<const char*>(payload), header.payload_bytes);
  absl::StatusCode code = static_cast<absl::StatusCode>(header.status);
  if (header.status == 0 || header.status > 16) code = absl::StatusCode::kInternal;
  return absl::Status(code, message);
}

FrameHeader ErrorHeader(uint64_t step, const absl::Status& status, size_t message_bytes) {
  FrameHeader h;
  h.kind = static_cast<uint16_t>(FrameKind::kError);
  h.step = step;
  h.status = static_cast<uint32_t>(status.code());
  h.payload_bytes = message_bytes;
  return h;
}

void CommitError(Ring& ring, uint8_t* slot, uint64_t step, const absl::Status& status) {
  const size_t bytes = std::min<size_t>(status.message().size(), ring.max_payload_bytes());
  std::memcpy(slot, status.message().data(), bytes);
  ring.CommitWrite(ErrorHeader(step, status, bytes));
}

absl::Status WriteError(Ring& ring, uint64_t step, const absl::Status& status,
                        absl::Duration timeout) {
  WaitOptions wait;
  wait.timeout = timeout;
  ASSIGN_OR_RETURN(uint8_t * slot, ring.BeginWrite(wait));
  CommitError(ring, slot, step, status);
  return absl::OkStatus();
}

void ReplyError(Ring& ring, uint64_t step, const absl::Status& status) {
  const absl::Status st = WriteError(ring, step, status);
  if (!st.ok()) LogError("cannot send the error reply of step %d: %s", step, st.ToString());
}

}  // namespace ellm::shm
