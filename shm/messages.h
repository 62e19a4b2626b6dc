// Payloads of the data-plane frames, with encoders and validating decoders.
// Every decoder checks the exact payload size against the header's batch
// descriptor before reading, so a corrupt frame is an error, not a crash.
//
// kStepPlan (coordinator -> mlp-worker), header n_seqs = S, n_tokens = T:
//   PlanSeq[S] | int32 token_ids[T]        (tokens of seq 0, then seq 1, ...)
//   | TokenCount counts[sum of n_counts]  (seq 0's, then seq 1's, ...)
// kStepResult (mlp-worker -> coordinator), n_seqs = number of entries:
//   SampledSeq[n_seqs]  (per sequence of the plan, in its order: a scored
//   entry for each token its chunk scores, then its sampled token if any)
// kAttnRequest (mlp-worker -> attn-worker s), n_seqs = S, n_tokens = T, layer:
//   SeqSlice[S] | f32 q[T][hq_s][hd] | f32 k[T][hkv_s][hd] | f32 v[T][hkv_s][hd]
//   (hq_s = query heads of the shard's KV heads, hkv_s = its KV heads)
// kAttnResult (attn-worker s -> mlp-worker): f32 out[T][hq_s][hd]
// kError: UTF-8 message (header.status = absl::StatusCode)
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/sampler.h"
#include "core/status.h"
#include "absl/time/time.h"
#include "shm/frame.h"
#include "shm/ring.h"

namespace ellm::shm {

// One sequence's tokens in a step: positions [start_pos, start_pos + n_tokens).
struct SeqSlice {
  uint64_t seq_id = 0;
  uint32_t start_pos = 0;
  uint32_t n_tokens = 0;
};
static_assert(sizeof(SeqSlice) == 16);

struct PlanSeq {
  SeqSlice slice;
  uint32_t sample = 0;      // 1: sample a next token after the slice's last token
  float temperature = 0;
  int32_t top_k = 0;
  float top_p = 1;
  float u = 0;              // the sequence's uniform draw for this step
  int32_t top_logprobs = 0; // alternatives to report, 0 .. kMaxTopLogprobs
  float min_p = 0;
  float presence_penalty = 0;
  float frequency_penalty = 0;
  float repetition_penalty = 1;
  // Its tokens' counts in the frame (TokenCount: generated ones, and with a
  // repetition penalty the prompt's), by increasing token id (the
  // penalties' input; 0 without penalties), at most kMaxPenaltyTokens.
  uint32_t n_counts = 0;
  // Its logit bias in the frame (after all counts), at most kMaxSeqBiases
  // entries by increasing token id, each in [-100, 100] or -inf (banned:
  // min_tokens); only with a chunk that samples.
  uint32_t n_biases = 0;
  // 1: score the prompt (prompt logprobs): the result lists, as kScored
  // entries, the log-probability of the token after each of the chunk's
  // tokens (with top_logprobs alternatives): the chunk's next tokens, and
  // after its last one next_token, unless the chunk samples.
  uint32_t score = 0;
  int32_t next_token = -1;  // with score on a chunk that does not sample; else -1
};
static_assert(sizeof(PlanSeq) == 72);

// The entries a plan's sequence gets in the step result: one per token it
// scores, and one for its sampled token.
uint32_t ScoredTokens(const PlanSeq& p);

// A sequence's sampling parameters in a PlanSeq and back: the one place
// that maps the fields (the scheduler writes them, the decoder checks them,
// the MLP worker samples with them).
void SetSampling(const SamplingParams& params, PlanSeq* p);
SamplingParams SamplingOf(const PlanSeq& p);

// SampledSeq::status: the token was sampled, or the sequence's logits were
// not finite (NaN or infinity: the model overflowed) and nothing was.
// kScored: an entry of a scored prompt token (PlanSeq::score): `token` is
// the token, `logprob` its log-probability, `top` the alternatives.
enum SampleStatus : uint32_t { kSampled = 0, kLogitsNotFinite = 1, kScored = 2 };

struct SampledSeq {
  uint64_t seq_id = 0;
  int32_t token = 0;
  float logprob = 0;
  uint32_t n_top = 0;       // entries of `top` in use, <= kMaxTopLogprobs
  uint32_t status = kSampled;
  TokenLogprob top[kMaxTopLogprobs];
};
static_assert(sizeof(SampledSeq) == 24 + 8 * kMaxTopLogprobs);

struct StepPlan {
  std::vector<PlanSeq> seqs;
  std::vector<int32_t> tokens;
  std::vector<TokenCount> counts;
  std::vector<TokenBias> biases;
};

// The token counts one step plan may carry, all sequences together: all
// of 16 sequences' (kMaxPenaltyTokens each), whatever the batch, so that a
// large --max-batch does not reserve shared memory for counts no real batch
// sends. (The scheduler keeps a step under it.)
uint64_t StepPlanCountsCapacity(int max_seqs);
// Likewise the logit biases one step plan may carry: 16 sequences' worth
// (kMaxSeqBiases each).
uint64_t StepPlanBiasesCapacity(int max_seqs);
// The largest step plan frame (header included) of up to max_seqs sequences
// and max_tokens tokens: what the coordinator's ring slots must hold.
uint64_t StepPlanCapacity(int max_seqs, int max_tokens);

// Checks a batch descriptor: n_seqs in [1, max_seqs], every slice non-empty,
// start_pos + n_tokens <= max_positions, the slices' tokens sum to n_tokens,
// no sequence twice.
absl::Status ValidateSlices(const SeqSlice* slices, uint32_t n_seqs, uint32_t n_tokens,
                            uint32_t max_positions);

// Step plan.
std::string EncodeStepPlan(const StepPlan& plan);
FrameHeader StepPlanHeader(uint64_t step, const StepPlan& plan);
absl::StatusOr<StepPlan> DecodeStepPlan(const FrameHeader& header, const uint8_t* payload,
                                        uint32_t max_positions, int vocab_size);

// Step result. The largest one of a plan of up to max_seqs sequences and
// max_tokens tokens (each may be scored), header included.
uint64_t StepResultCapacity(int max_seqs, int max_tokens);
absl::StatusOr<std::vector<SampledSeq>> DecodeStepResult(const FrameHeader& header,
                                                         const uint8_t* payload);

// Attention request geometry of one shard.
struct AttnShape {
  int q_heads = 0;   // query heads of the shard
  int kv_heads = 0;  // KV heads of the shard
  int head_dim = 0;
  uint64_t RequestBytes(uint32_t n_seqs, uint32_t n_tokens) const;
  uint64_t ResultBytes(uint32_t n_tokens) const;
};

// A decoded attention request: q, k, v are views into the payload.
struct AttnRequestView {
  const SeqSlice* slices = nullptr;
  const float* q = nullptr;  // [T][q_heads][head_dim]
  const float* k = nullptr;  // [T][kv_heads][head_dim]
  const float* v = nullptr;  // [T][kv_heads][head_dim]
};
// The batch descriptor is copied into *slices (the view's `slices` point
// there) and checked there: the payload lies in memory the peer can still
// write, and what indexes the KV cache must be what was checked.
absl::StatusOr<AttnRequestView> DecodeAttnRequest(const FrameHeader& header,
                                                  const uint8_t* payload, const AttnShape& shape,
                                                  uint32_t max_positions,
                                                  std::vector<SeqSlice>* slices);

// An error frame's status.
absl::Status DecodeError(const FrameHeader& header, const uint8_t* payload);
FrameHeader ErrorHeader(uint64_t step, const absl::Status& status, size_t message_bytes);
// Publishes `status` as an error frame of `step` in `slot`, which the caller
// took with ring.BeginWrite (the message cut to the slot's size): a taken
// slot always ends as a frame, so the ring stays usable.
void CommitError(Ring& ring, uint8_t* slot, uint64_t step, const absl::Status& status);
// Writes `status` as an error frame of `step` into `ring` (the answer a
// worker gives when it cannot serve a request), waiting up to `timeout` for a slot.
absl::Status WriteError(Ring& ring, uint64_t step, const absl::Status& status,
                        absl::Duration timeout = absl::Seconds(5));
// WriteError for a serve loop: a reply that cannot be sent is logged (the
// caller's peer then times out or sees it has died), never returned.
void ReplyError(Ring& ring, uint64_t step, const absl::Status& status);

}  // namespace ellm::shm
