// shm/messages.h: payload encoders and validating decoders of the data-plane
// frames. Each corruption a decoder guards against is fed on its own and must
// give a DataLoss error whose message says what is wrong.
#include "shm/messages.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shm/frame.h"

namespace ellm::shm {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kMaxPositions = 1024;
constexpr int kVocab = 512;

// An 8-byte-aligned copy of some bytes (ring slots are aligned; the decoders
// read SeqSlice / float arrays in place).
class Payload {
 public:
  explicit Payload(const std::string& bytes) : words_((bytes.size() + 7) / 8 + 1, 0) {
    std::memcpy(words_.data(), bytes.data(), bytes.size());
  }
  const uint8_t* data() const { return reinterpret_cast<const uint8_t*>(words_.data()); }
  uint8_t* mutable_data() { return reinterpret_cast<uint8_t*>(words_.data()); }

 private:
  std::vector<uint64_t> words_;
};

PlanSeq MakePlanSeq(uint64_t id, uint32_t start, uint32_t n, uint32_t sample = 1) {
  PlanSeq p;
  p.slice = {id, start, n};
  p.sample = sample;
  // Valid sampling parameters that differ between sequences.
  p.temperature = 0.25f * static_cast<float>(id % 64);
  p.top_k = static_cast<int32_t>(id % 100) + 3;
  p.top_p = 0.5f + 0.01f * static_cast<float>(id % 50);
  p.u = 0.125f * static_cast<float>(n % 8);
  p.top_logprobs = static_cast<int32_t>(id % (kMaxTopLogprobs + 1));
  p.min_p = 0.01f * static_cast<float>(id % 90);
  p.presence_penalty = 0.1f * static_cast<float>(id % 20) - 1;
  p.frequency_penalty = 1 - 0.1f * static_cast<float>(id % 20);
  return p;
}

// Three sequences: a prefill chunk, a decode, and a chunk not yet sampled;
// the first two with the counts of their generated tokens, the second with a
// logit bias.
StepPlan ThreeSeqPlan() {
  StepPlan plan;
  plan.seqs = {MakePlanSeq(7, 0, 5), MakePlanSeq(42, 99, 1), MakePlanSeq(3, 16, 3, 0)};
  plan.tokens = {1, 400, 401, 402, 403, 17, 511, 0, 9};
  plan.seqs[0].n_counts = 1;
  plan.seqs[1].n_counts = 3;
  plan.counts = {{5, 2}, {2, 1}, {17, 4}, {511, 2}};
  plan.seqs[1].n_biases = 2;
  plan.biases = {{3, -100.0f}, {9, -std::numeric_limits<float>::infinity()}};  // 9: banned (min_tokens)
  // The first and the third score their prompt (the third, which does not
  // sample, with the token after its chunk).
  plan.seqs[0].score = 1;
  plan.seqs[2].score = 1;
  plan.seqs[2].next_token = 12;
  return plan;
}

absl::StatusOr<StepPlan> RoundTrip(const StepPlan& plan, FrameHeader* header_out = nullptr) {
  const FrameHeader header = StepPlanHeader(9, plan);
  if (header_out != nullptr) *header_out = header;
  const Payload payload(EncodeStepPlan(plan));
  return DecodeStepPlan(header, payload.data(), kMaxPositions, kVocab);
}

void ExpectDataLoss(const absl::Status& status, const std::string& substring) {
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(substring));
}

TEST(StepPlan, RoundTrips) {
  const StepPlan plan = ThreeSeqPlan();
  FrameHeader header;
  absl::StatusOr<StepPlan> decoded = RoundTrip(plan, &header);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(header.kind, static_cast<uint16_t>(FrameKind::kStepPlan));
  EXPECT_EQ(header.step, 9u);
  EXPECT_EQ(header.n_seqs, 3u);
  EXPECT_EQ(header.n_tokens, 9u);
  EXPECT_EQ(header.payload_bytes,
            3 * sizeof(PlanSeq) + 9 * sizeof(int32_t) + 4 * sizeof(TokenCount) + 2 * sizeof(TokenBias));
  EXPECT_TRUE(ValidateFrameHeader(header, header.payload_bytes).ok());
  EXPECT_FALSE(ValidateFrameHeader(header, header.payload_bytes - 1).ok());  // it does check the size
  ASSERT_EQ(decoded->seqs.size(), plan.seqs.size());
  for (size_t i = 0; i < plan.seqs.size(); ++i) {
    const PlanSeq& a = plan.seqs[i];
    const PlanSeq& b = decoded->seqs[i];
    EXPECT_EQ(b.slice.seq_id, a.slice.seq_id);
    EXPECT_EQ(b.slice.start_pos, a.slice.start_pos);
    EXPECT_EQ(b.slice.n_tokens, a.slice.n_tokens);
    EXPECT_EQ(b.sample, a.sample);
    EXPECT_EQ(b.temperature, a.temperature);
    EXPECT_EQ(b.top_k, a.top_k);
    EXPECT_EQ(b.top_p, a.top_p);
    EXPECT_EQ(b.u, a.u);
    EXPECT_EQ(b.top_logprobs, a.top_logprobs);
    EXPECT_EQ(b.min_p, a.min_p);
    EXPECT_EQ(b.presence_penalty, a.presence_penalty);
    EXPECT_EQ(b.frequency_penalty, a.frequency_penalty);
    EXPECT_EQ(b.n_counts, a.n_counts);
    EXPECT_EQ(b.repetition_penalty, a.repetition_penalty);
    EXPECT_EQ(b.n_biases, a.n_biases);
    EXPECT_EQ(b.score, a.score);
    EXPECT_EQ(b.next_token, a.next_token);
  }
  ASSERT_EQ(decoded->biases.size(), plan.biases.size());
  for (size_t i = 0; i < plan.biases.size(); ++i) {
    EXPECT_EQ(decoded->biases[i].token, plan.biases[i].token);
    EXPECT_EQ(decoded->biases[i].bias, plan.biases[i].bias);
  }
  EXPECT_EQ(decoded->tokens, plan.tokens);
  ASSERT_EQ(decoded->counts.size(), plan.counts.size());
  for (size_t i = 0; i < plan.counts.size(); ++i) {
    EXPECT_EQ(decoded->counts[i].token, plan.counts[i].token);
    EXPECT_EQ(decoded->counts[i].count, plan.counts[i].count);
  }
}

// A sequence's token counts must be distinct ids of the vocabulary, in
// order, each at least 1 (0 with a repetition penalty: a prompt token), and
// no more than kMaxPenaltyTokens: a bad one would penalise a token twice or
// read outside the logits.
TEST(StepPlan, BadTokenCountsAreAnError) {
  const std::vector<std::pair<std::function<void(StepPlan*)>, std::string>> cases = {
      {[](StepPlan* p) { p->counts[2].token = 2; }, "distinct"},       // 2 twice
      {[](StepPlan* p) { p->counts[2].token = 1; }, "in order"},       // 2, 1, 511
      {[](StepPlan* p) { p->counts[3].token = kVocab; }, "vocabulary"},
      {[](StepPlan* p) { p->counts[1].token = -1; }, "vocabulary"},
      {[](StepPlan* p) { p->counts[0].count = 0; }, "at least 1"},  // (0: a prompt token, with a repetition penalty)
      {[](StepPlan* p) {
         p->seqs[0].repetition_penalty = 1.2f;
         p->counts[0].count = -1;
       },
       "at least 0"},
      {[](StepPlan* p) { p->seqs[2].n_counts = kMaxPenaltyTokens + 1; }, "more than"},
      {[](StepPlan* p) { p->biases[1].token = 3; }, "bad logit bias"},
      {[](StepPlan* p) { p->biases[1].token = kVocab; }, "bad logit bias"},
      {[](StepPlan* p) { p->biases[0].bias = 100.5f; }, "bad logit bias"},
      {[](StepPlan* p) { p->biases[0].bias = std::nanf(""); }, "bad logit bias"},
      {[](StepPlan* p) { p->biases[1].bias = std::numeric_limits<float>::infinity(); }, "bad logit bias"},
      {[](StepPlan* p) { p->biases[1].bias = -std::numeric_limits<float>::max(); }, "bad logit bias"},
      {[](StepPlan* p) { p->seqs[0].n_biases = kMaxSeqBiases + 1; }, "more than"},
      {[](StepPlan* p) { p->seqs[1].score = 2; }, "bad score"},
      {[](StepPlan* p) { p->seqs[0].next_token = 5; }, "bad score"},     // it samples: no next token
      {[](StepPlan* p) { p->seqs[1].next_token = 5; }, "bad score"},     // it does not score
      {[](StepPlan* p) { p->seqs[2].next_token = -1; }, "bad score"},    // it scores and does not sample
      {[](StepPlan* p) { p->seqs[2].next_token = kVocab; }, "bad score"},
  };
  for (const auto& [edit, what] : cases) {
    StepPlan plan = ThreeSeqPlan();
    edit(&plan);
    ExpectDataLoss(RoundTrip(plan).status(), what);
  }
  // With a repetition penalty, a prompt token's count 0 is taken.
  StepPlan prompt_token = ThreeSeqPlan();
  prompt_token.seqs[0].repetition_penalty = 1.2f;
  prompt_token.counts[0].count = 0;
  absl::StatusOr<StepPlan> taken = RoundTrip(prompt_token);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->seqs[0].repetition_penalty, 1.2f);
  // n_counts that disagree with the bytes: the payload's size is wrong.
  StepPlan plan = ThreeSeqPlan();
  plan.seqs[1].n_counts = 2;
  ExpectDataLoss(RoundTrip(plan).status(), "payload");
}

TEST(StepPlan, RoundTripsAtTheEdges) {
  // One sequence filling the context exactly, tokens 0 and vocab - 1.
  StepPlan plan;
  plan.seqs = {MakePlanSeq(~0ull, kMaxPositions - 2, 2)};
  plan.tokens = {0, kVocab - 1};
  absl::StatusOr<StepPlan> decoded = RoundTrip(plan);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->seqs[0].slice.seq_id, ~0ull);
  EXPECT_EQ(decoded->tokens, plan.tokens);
}

TEST(StepPlan, PayloadSizeMismatchIsAnError) {
  const StepPlan plan = ThreeSeqPlan();
  const Payload payload(EncodeStepPlan(plan) + std::string(16, '\0'));
  for (int64_t delta : {-4, -1, 1, 4, 40}) {
    FrameHeader header = StepPlanHeader(1, plan);
    header.payload_bytes += delta;
    ExpectDataLoss(DecodeStepPlan(header, payload.data(), kMaxPositions, kVocab).status(),
                   "payload");
  }
  // The header's counts disagree with the bytes: one sequence fewer.
  FrameHeader header = StepPlanHeader(1, plan);
  header.n_seqs -= 1;
  ExpectDataLoss(DecodeStepPlan(header, payload.data(), kMaxPositions, kVocab).status(), "payload");
}

TEST(StepPlan, TokenCountNotTheSumOfSlicesIsAnError) {
  // Bytes and header agree (10 tokens) but the slices hold 9.
  StepPlan plan = ThreeSeqPlan();
  plan.tokens.push_back(5);
  ExpectDataLoss(RoundTrip(plan).status(), "tokens");
  // And the other way: the slices hold more than the header's tokens.
  plan = ThreeSeqPlan();
  plan.tokens.pop_back();
  ExpectDataLoss(RoundTrip(plan).status(), "tokens");
}

TEST(StepPlan, EmptySliceIsAnError) {
  StepPlan plan = ThreeSeqPlan();
  plan.seqs.push_back(MakePlanSeq(77, 0, 0));
  ExpectDataLoss(RoundTrip(plan).status(), "0 tokens");
}

TEST(StepPlan, EmptyBatchIsAnError) {
  StepPlan plan;
  EXPECT_EQ(RoundTrip(plan).status().code(), absl::StatusCode::kDataLoss);
}

TEST(StepPlan, PositionsBeyondContextAreAnError) {
  StepPlan plan = ThreeSeqPlan();
  plan.seqs[1].slice.start_pos = kMaxPositions;  // one past the end
  ExpectDataLoss(RoundTrip(plan).status(), "exceed");
  plan = ThreeSeqPlan();
  plan.seqs[0].slice.start_pos = kMaxPositions - 4;  // 5 tokens: one past
  ExpectDataLoss(RoundTrip(plan).status(), "exceed");
  // start + n overflowing 32 bits must not wrap around into range.
  plan = ThreeSeqPlan();
  plan.seqs[0].slice.start_pos = UINT32_MAX - 1;
  ExpectDataLoss(RoundTrip(plan).status(), "exceed");
}

TEST(StepPlan, DuplicateSequenceIsAnError) {
  StepPlan plan = ThreeSeqPlan();
  plan.seqs[2].slice.seq_id = plan.seqs[0].slice.seq_id;
  ExpectDataLoss(RoundTrip(plan).status(), "twice");
}

TEST(StepPlan, TokenOutsideVocabIsAnError) {
  for (int32_t bad : {-1, kVocab, kVocab + 1000, INT32_MIN}) {
    StepPlan plan = ThreeSeqPlan();
    plan.tokens[4] = bad;
    ExpectDataLoss(RoundTrip(plan).status(), "vocabulary");
  }
}

TEST(StepPlan, BadSamplingParamsAreAnError) {
  const std::vector<std::pair<std::function<void(PlanSeq*)>, std::string>> cases = {
      {[](PlanSeq* p) { p->temperature = -1; }, "temperature"},
      {[](PlanSeq* p) { p->top_k = -1; }, "top_k"},
      {[](PlanSeq* p) { p->top_p = 0; }, "top_p"},
      {[](PlanSeq* p) { p->min_p = 2; }, "min_p"},
      {[](PlanSeq* p) { p->presence_penalty = 3; }, "presence_penalty"},
      {[](PlanSeq* p) { p->frequency_penalty = -2.5f; }, "frequency_penalty"},
      {[](PlanSeq* p) { p->top_logprobs = kMaxTopLogprobs + 1; }, "top_logprobs"},
      {[](PlanSeq* p) { p->top_logprobs = -3; }, "top_logprobs"},
  };
  for (const auto& [edit, name] : cases) {
    StepPlan plan = ThreeSeqPlan();
    edit(&plan.seqs[1]);
    ExpectDataLoss(RoundTrip(plan).status(), name);
  }
}

TEST(StepPlan, WrongKindIsAnError) {
  const StepPlan plan = ThreeSeqPlan();
  const Payload payload(EncodeStepPlan(plan));
  for (FrameKind kind : {FrameKind::kStepResult, FrameKind::kAttnRequest, FrameKind::kError}) {
    FrameHeader header = StepPlanHeader(1, plan);
    header.kind = static_cast<uint16_t>(kind);
    ExpectDataLoss(DecodeStepPlan(header, payload.data(), kMaxPositions, kVocab).status(), "kind");
  }
}

TEST(StepResult, RoundTrips) {
  std::vector<SampledSeq> seqs(3);
  seqs[0].seq_id = 5, seqs[0].token = 17, seqs[0].logprob = -0.25f;
  seqs[1].seq_id = ~0ull, seqs[1].token = 0, seqs[1].logprob = -7.5f;
  seqs[2].seq_id = 9, seqs[2].token = 511, seqs[2].logprob = 0.0f;
  seqs[2].status = kLogitsNotFinite;  // a sequence the model overflowed on
  seqs[0].status = kScored;           // a scored prompt token
  seqs[1].n_top = kMaxTopLogprobs;  // alternatives travel with their token
  for (int j = 0; j < kMaxTopLogprobs; ++j) seqs[1].top[j] = {j * 3, -0.5f * j};
  FrameHeader header;
  header.kind = static_cast<uint16_t>(FrameKind::kStepResult);
  header.n_seqs = 3;
  header.payload_bytes = 3 * sizeof(SampledSeq);
  const Payload payload(std::string(reinterpret_cast<const char*>(seqs.data()),
                                    seqs.size() * sizeof(SampledSeq)));
  absl::StatusOr<std::vector<SampledSeq>> decoded = DecodeStepResult(header, payload.data());
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ASSERT_EQ(decoded->size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ((*decoded)[i].seq_id, seqs[i].seq_id);
    EXPECT_EQ((*decoded)[i].token, seqs[i].token);
    EXPECT_EQ((*decoded)[i].logprob, seqs[i].logprob);
    EXPECT_EQ((*decoded)[i].status, seqs[i].status);
    ASSERT_EQ((*decoded)[i].n_top, seqs[i].n_top);
    for (uint32_t j = 0; j < seqs[i].n_top; ++j) {
      EXPECT_EQ((*decoded)[i].top[j].token, seqs[i].top[j].token);
      EXPECT_EQ((*decoded)[i].top[j].logprob, seqs[i].top[j].logprob);
    }
  }
  // More alternatives than a result can hold: a corrupt frame.
  std::vector<SampledSeq> bad = seqs;
  bad[2].n_top = kMaxTopLogprobs + 1;
  const Payload bad_payload(std::string(reinterpret_cast<const char*>(bad.data()), bad.size() * sizeof(SampledSeq)));
  ExpectDataLoss(DecodeStepResult(header, bad_payload.data()).status(), "top logprobs");
  // A status this coordinator does not know.
  bad = seqs;
  bad[0].status = 3;
  const Payload bad_status(std::string(reinterpret_cast<const char*>(bad.data()), bad.size() * sizeof(SampledSeq)));
  ExpectDataLoss(DecodeStepResult(header, bad_status.data()).status(), "unknown status 3");
  header.payload_bytes -= 1;
  ExpectDataLoss(DecodeStepResult(header, payload.data()).status(), "payload");
  header.payload_bytes += 1;
  header.kind = static_cast<uint16_t>(FrameKind::kStepPlan);
  ExpectDataLoss(DecodeStepResult(header, payload.data()).status(), "kind");
}

TEST(ErrorFrame, RoundTripsCodeAndMessage) {
  const std::vector<absl::Status> statuses = {
      absl::NotFoundError("no such sequence 12"),
      absl::ResourceExhaustedError("KV cache full: sequence 3 needs 2 more blocks, 0 free"),
      absl::UnavailableError("worker 1 exited"),
      absl::DataLossError(""),
      absl::UnauthenticatedError("code 16, the highest"),
      absl::CancelledError("code 1, the lowest"),
  };
  for (const absl::Status& st : statuses) {
    const std::string msg(st.message());
    const FrameHeader header = ErrorHeader(33, st, msg.size());
    EXPECT_EQ(header.kind, static_cast<uint16_t>(FrameKind::kError));
    EXPECT_EQ(header.step, 33u);
    EXPECT_EQ(header.payload_bytes, msg.size());
    const Payload payload(msg);
    EXPECT_EQ(DecodeError(header, payload.data()), st);
    // A step result that turns out to be an error frame is that error.
    EXPECT_EQ(DecodeStepResult(header, payload.data()).status(), st);
  }
}

TEST(ErrorFrame, UnknownOrOkCodeBecomesInternal) {
  // An error frame must never decode as OK, nor as a code absl does not know.
  const std::string msg = "odd";
  const Payload payload(msg);
  for (uint32_t code : {0u, 17u, 1000u}) {
    FrameHeader header = ErrorHeader(1, absl::InternalError(msg), msg.size());
    header.status = code;
    const absl::Status st = DecodeError(header, payload.data());
    EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << code;
    EXPECT_EQ(st.message(), msg);
    EXPECT_FALSE(DecodeStepResult(header, payload.data()).ok());
  }
}

// An attention request built by hand: slices | q | k | v, every float distinct.
struct AttnFixture {
  AttnShape shape{6, 2, 4};  // 6 query heads on 2 KV heads, head_dim 4
  std::vector<SeqSlice> slices = {{11, 0, 3}, {12, 40, 1}, {13, 7, 2}};
  uint32_t n_tokens = 6;
  std::string bytes;

  AttnFixture() {
    bytes.assign(reinterpret_cast<const char*>(slices.data()), slices.size() * sizeof(SeqSlice));
    const size_t floats = n_tokens * (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim;
    for (size_t i = 0; i < floats; ++i) {
      const float f = static_cast<float>(i) + 0.5f;
      bytes.append(reinterpret_cast<const char*>(&f), sizeof(f));
    }
  }
  FrameHeader Header() const {
    FrameHeader h;
    h.kind = static_cast<uint16_t>(FrameKind::kAttnRequest);
    h.layer = 3;
    h.n_seqs = static_cast<uint32_t>(slices.size());
    h.n_tokens = n_tokens;
    h.payload_bytes = bytes.size();
    return h;
  }
};

// DecodeAttnRequest's status alone.
absl::Status AttnRequestStatus(const FrameHeader& header, const uint8_t* payload, const AttnShape& shape,
                               uint32_t max_positions) {
  std::vector<SeqSlice> slices;
  return DecodeAttnRequest(header, payload, shape, max_positions, &slices).status();
}

TEST(AttnRequest, ShapeByteCounts) {
  const AttnShape shape{6, 2, 4};
  EXPECT_EQ(shape.RequestBytes(3, 6), 3 * 16 + 6 * (6 + 2 * 2) * 4 * 4u);
  EXPECT_EQ(shape.ResultBytes(6), 6 * 6 * 4 * 4u);
  // No 32-bit overflow for a large step.
  const AttnShape big{64, 8, 128};
  EXPECT_EQ(big.RequestBytes(1, 100000), 16 + uint64_t{100000} * (64 + 16) * 128 * 4);
}

TEST(AttnRequest, DecodeGivesViewsAtTheRightOffsets) {
  AttnFixture f;
  ASSERT_EQ(f.bytes.size(), f.shape.RequestBytes(3, f.n_tokens));
  Payload payload(f.bytes);
  std::vector<SeqSlice> slices;
  absl::StatusOr<AttnRequestView> view =
      DecodeAttnRequest(f.Header(), payload.data(), f.shape, kMaxPositions, &slices);
  ASSERT_TRUE(view.ok()) << view.status();
  const uint8_t* base = payload.data();
  EXPECT_EQ(view->slices, slices.data());
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(view->q), base + 3 * sizeof(SeqSlice));
  EXPECT_EQ(view->k, view->q + 6 * 6 * 4);
  EXPECT_EQ(view->v, view->k + 6 * 2 * 4);
  EXPECT_EQ(view->slices[1].seq_id, 12u);
  EXPECT_EQ(view->slices[1].start_pos, 40u);
  EXPECT_EQ(view->slices[2].n_tokens, 2u);
  // The floats were numbered i + 0.5 in order: q, then k, then v.
  EXPECT_EQ(view->q[0], 0.5f);
  EXPECT_EQ(view->k[0], 144.5f);  // after 6 tokens x 6 heads x 4
  EXPECT_EQ(view->v[0], 192.5f);  // after 6 x 2 x 4 more
  EXPECT_EQ(view->v[6 * 2 * 4 - 1], 239.5f);  // the last float of the payload
  // The descriptor is the one checked: a peer that rewrites its slot
  // afterwards (a sequence with positions far past the context) changes
  // nothing the shard indexes by.
  const SeqSlice rewritten{11, 1u << 30, 1u << 30};
  std::memcpy(payload.mutable_data() + sizeof(SeqSlice), &rewritten, sizeof(rewritten));
  EXPECT_EQ(view->slices[1].seq_id, 12u);
  EXPECT_EQ(view->slices[1].start_pos, 40u);
  EXPECT_EQ(view->slices[1].n_tokens, 1u);
}

TEST(AttnRequest, WrongPayloadSizeIsAnError) {
  AttnFixture f;
  const Payload payload(f.bytes + std::string(64, '\0'));
  for (int64_t delta : {-4, 4, 16}) {
    FrameHeader h = f.Header();
    h.payload_bytes += delta;
    ExpectDataLoss(AttnRequestStatus(h, payload.data(), f.shape, kMaxPositions),
                   "payload");
  }
  // A shard that expects another geometry sees the wrong size too.
  ExpectDataLoss(
      AttnRequestStatus(f.Header(), payload.data(), AttnShape{4, 2, 4}, kMaxPositions),
      "payload");
}

TEST(AttnRequest, BadBatchDescriptorIsAnError) {
  AttnFixture f;
  {
    // Slice 2 repeats sequence 11.
    std::string bytes = f.bytes;
    const SeqSlice dup{11, 7, 2};
    bytes.replace(2 * sizeof(SeqSlice), sizeof(SeqSlice),
                  std::string(reinterpret_cast<const char*>(&dup), sizeof(dup)));
    const Payload payload(bytes);
    ExpectDataLoss(AttnRequestStatus(f.Header(), payload.data(), f.shape, kMaxPositions),
                   "twice");
  }
  const Payload payload(f.bytes);
  // Positions of slice 1 ([40, 41)) beyond a 40-position context.
  ExpectDataLoss(AttnRequestStatus(f.Header(), payload.data(), f.shape, 40), "exceed");
  // The fixture's three slices in a frame whose header says `n_tokens`
  // (bytes sized to match), decoded.
  auto decode_with_tokens = [&](uint32_t n_tokens) {
    std::string bytes(reinterpret_cast<const char*>(f.slices.data()), 3 * sizeof(SeqSlice));
    bytes.append(n_tokens * (6 + 2 * 2) * 4 * sizeof(float), '\0');
    FrameHeader h = f.Header();
    h.n_tokens = n_tokens;
    h.payload_bytes = bytes.size();
    const Payload p(bytes);
    return AttnRequestStatus(h, p.data(), f.shape, kMaxPositions);
  };
  // The header's token count disagrees with the slices.
  ExpectDataLoss(decode_with_tokens(7), "tokens");
  // More sequences than tokens (a frame of many empty slices, which a
  // pairwise duplicate check would pay for quadratically): refused at once.
  ExpectDataLoss(decode_with_tokens(2), "3 sequences for 2 tokens");
  FrameHeader h = f.Header();
  h.kind = static_cast<uint16_t>(FrameKind::kAttnResult);
  ExpectDataLoss(AttnRequestStatus(h, payload.data(), f.shape, kMaxPositions), "kind");
}

TEST(ErrorFrames, WriteErrorReadsBackAsTheSameStatus) {
  const size_t bytes = Ring::BytesFor(2, 4096);
  struct alignas(64) Line {
    uint8_t bytes[64];
  };
  std::vector<Line> memory(bytes / sizeof(Line) + 1);
  absl::StatusOr<Ring> ring = Ring::Create(memory.data(), bytes, 2, 4096);
  ASSERT_TRUE(ring.ok()) << ring.status();
  const absl::Status sent = absl::ResourceExhaustedError("KV cache full: sequence 9");
  ASSERT_TRUE(WriteError(*ring, 77, sent).ok());
  WaitOptions wait;
  wait.timeout = absl::Seconds(1);
  absl::StatusOr<Ring::Frame> frame = ring->BeginRead(wait);
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(frame->header.kind, static_cast<uint16_t>(FrameKind::kError));
  EXPECT_EQ(frame->header.step, 77u);
  EXPECT_EQ(DecodeError(frame->header, frame->payload), sent);
  ring->EndRead();
  // A full ring: the writer gives up after its timeout instead of hanging.
  ASSERT_TRUE(WriteError(*ring, 1, sent).ok());
  ASSERT_TRUE(WriteError(*ring, 2, sent).ok());
  EXPECT_EQ(WriteError(*ring, 3, sent, absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
}

// A worker that fails after taking a reply slot publishes the error in that
// slot: the message is cut to the slot, the code kept, and the ring goes on.
TEST(ErrorFrames, CommitErrorFillsATakenSlot) {
  const size_t bytes = Ring::BytesFor(2, 64);
  struct alignas(64) Line {
    uint8_t bytes[64];
  };
  std::vector<Line> memory(bytes / sizeof(Line) + 1);
  absl::StatusOr<Ring> ring = Ring::Create(memory.data(), bytes, 2, 64);
  ASSERT_TRUE(ring.ok()) << ring.status();
  const std::string long_message(3 * ring->max_payload_bytes(), 'x');
  WaitOptions wait;
  wait.timeout = absl::Seconds(1);
  for (uint64_t step : {5, 6, 7}) {  // more frames than slots: each one was completed
    absl::StatusOr<uint8_t*> slot = ring->BeginWrite(wait);
    ASSERT_TRUE(slot.ok()) << slot.status();
    CommitError(*ring, *slot, step, absl::FailedPreconditionError(long_message));
    absl::StatusOr<Ring::Frame> frame = ring->BeginRead(wait);
    ASSERT_TRUE(frame.ok()) << frame.status();
    EXPECT_EQ(frame->header.step, step);
    const absl::Status got = DecodeError(frame->header, frame->payload);
    EXPECT_EQ(got.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(got.message(), long_message.substr(0, ring->max_payload_bytes()));
    ring->EndRead();
  }
  // WriteError cuts an over-long message the same way instead of failing.
  ASSERT_TRUE(WriteError(*ring, 8, absl::InternalError(long_message)).ok());
  absl::StatusOr<Ring::Frame> frame = ring->BeginRead(wait);
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(DecodeError(frame->header, frame->payload).message().size(), ring->max_payload_bytes());
  ring->EndRead();
}

}  // namespace
}  // namespace ellm::shm
