// Next-token sampling: logit bias, repetition, presence and frequency
// penalties, greedy,
// temperature, top-k, min-p, top-p. Stateless: the
// random draw `u` of a sequence's k-th sampled token is SampleUniform(seed, k)
// (drawn by the coordinator), so the same seed gives the same tokens wherever
// sampling runs, and again after a step that failed and was run over.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"

namespace ellm {

// The most alternatives a sampled token can report (OpenAI's top_logprobs limit).
constexpr int kMaxTopLogprobs = 20;
// The most distinct tokens a penalised sequence's counts may hold (they
// travel with every step): its generated tokens, and with a repetition
// penalty its prompt's too; requests with penalties are held under it.
constexpr int kMaxPenaltyTokens = 16384;
// The most tokens a request's logit bias may list.
constexpr int kMaxLogitBias = 1024;
// The most stop token ids a request may list (vLLM's stop_token_ids).
constexpr int kMaxStopTokenIds = 256;
// The most biases one sequence's sampling may carry: its logit bias, and
// while it has generated fewer than its min_tokens the tokens that would
// stop it (its stop token ids and the model's end-of-generation ids, at
// most kMaxStopTokenIds more), banned.
constexpr int kMaxSeqBiases = kMaxLogitBias + 2 * kMaxStopTokenIds;
// The smallest repetition penalty: a logit divided by less could overflow.
constexpr float kMinRepetitionPenalty = 0.01f;

struct SamplingParams {
  float temperature = 1.0f;  // 0: greedy (argmax)
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // 1: off
  // 0: off. Keeps the tokens whose tempered probability is at least min_p
  // times the most likely one's; applied before top_p, as vLLM does.
  float min_p = 0.0f;
  int32_t top_logprobs = 0;  // report this many most likely tokens with each pick (not a sampling rule)
  // OpenAI's penalties, on the tokens generated so far (as vLLM applies
  // them): a token's logit loses presence_penalty once it has appeared and
  // frequency_penalty for each time it has, before anything else. 0: off.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // The repetition penalty of Hugging Face and vLLM (CTRL's), on the tokens
  // of the prompt and those generated so far: a positive logit is divided
  // by it, a negative one multiplied, before the other penalties. 1: off.
  float repetition_penalty = 1.0f;
  bool penalised() const { return presence_penalty != 0 || frequency_penalty != 0 || repetition_penalty != 1; }
};

// A token of the sequence and how often it was generated so far: at least
// once, or 0 for a token only of the prompt (sent for the repetition
// penalty alone).
struct TokenCount {
  int32_t token = 0;
  int32_t count = 0;
};

// OpenAI's logit_bias: added to a token's logit before the penalties and
// every sampling rule, in [-100, 100] (-100 bans the token in practice);
// or -infinity: the token is never picked (min_tokens' ban on the tokens
// that would stop a sequence).
struct TokenBias {
  int32_t token = 0;
  float bias = 0;
};

// InvalidArgument naming the parameter: temperature in [0, 100], top_k >= 0
// (0 or the vocabulary's size or more: off), top_p in (0, 1], min_p in
// [0, 1], all finite,
// top_logprobs in [0, min(kMaxTopLogprobs, vocab_size)], the presence and
// frequency penalties in [-2, 2], the repetition penalty in [0.01, 10].
absl::Status ValidateSamplingParams(const SamplingParams& params, int vocab_size);

// A token and log p(token) under the model's raw distribution (temperature 1,
// before penalties, top-k, min-p and top-p): what OpenAI's API calls a
// logprob.
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
};

struct SampledToken {
  // False when the logits had no distribution: a NaN or +inf among them, or
  // all -inf (a model that overflowed). Nothing was sampled; token is 0.
  bool finite = true;
  int32_t token = 0;
  float logprob = 0;  // of `token`, as in TokenLogprob
  // The params' top_logprobs most likely tokens, most likely first (ties: lower id).
  int32_t n_top = 0;
  TokenLogprob top[kMaxTopLogprobs];
};

// Picks a token from logits [n]. `u` is uniform in [0, 1). Greedy ignores u;
// ties go to the lowest id. A -inf logit is a token of probability 0, never
// picked; logits without a finite log-sum-exp give `finite` false. `counts`
// (n_counts of them, distinct tokens < n) are the tokens the penalties apply
// to (TokenCount), `biases` (n_biases, distinct tokens < n) the logit bias,
// added first; the logprobs stay those of the raw logits.
SampledToken Sample(const float* logits, int n, const SamplingParams& params, float u,
                    const TokenCount* counts = nullptr, int n_counts = 0, const TokenBias* biases = nullptr,
                    int n_biases = 0);

// Scores a given token (prompt logprobs): its log-probability under the raw
// logits [n] and the top_logprobs most likely tokens, as Sample reports a
// sampled one (`finite` false, nothing but the token set, when they have
// no distribution).
SampledToken Score(const float* logits, int n, int32_t token, int top_logprobs);

// The draw u for the index-th token (0: the first) sampled with `seed`: the
// index-th output of SplitMix64 started at the seed's SplitMix64 mix (so
// that no two seeds' streams are shifts of each other), in [0, 1) with 24 random
// bits. A function of (seed, index) alone: a sequence resumed after a worker
// failure draws for its next token what the lost step drew.
float SampleUniform(uint64_t seed, uint64_t index);

// xoshiro256** seeded with splitmix64: a small, fast, reproducible generator
// (tests draw their random inputs from it).
class SequenceRng {
 public:
  explicit SequenceRng(uint64_t seed);
  uint64_t Next();
  float NextUniform();  // [0, 1), 24 random bits

 private:
  uint64_t s_[4];
};

}  // namespace ellm
