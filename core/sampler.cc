#include "core/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ellm {

absl::Status ValidateSamplingParams(const SamplingParams& p, int vocab_size) {
  if (!std::isfinite(p.temperature) || p.temperature < 0 || p.temperature > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be in [0, 100], got ", p.temperature));
  }
  if (p.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("top_k must not be negative, got ", p.top_k));
  }
  if (!std::isfinite(p.top_p) || p.top_p <= 0 || p.top_p > 1) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", p.top_p));
  }
  if (!std::isfinite(p.min_p) || p.min_p < 0 || p.min_p > 1) {
    return absl::InvalidArgumentError(absl::StrCat("min_p must be in [0, 1], got ", p.min_p));
  }
  for (const auto& [name, v] : {std::pair{"presence_penalty", p.presence_penalty},
                                std::pair{"frequency_penalty", p.frequency_penalty}}) {
    if (!std::isfinite(v) || v < -2 || v > 2) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be in [-2, 2], got ", v));
    }
  }
  // (Below 0.01, dividing a logit by it could overflow to infinity.)
  if (!std::isfinite(p.repetition_penalty) || p.repetition_penalty < kMinRepetitionPenalty ||
      p.repetition_penalty > 10) {
    return absl::InvalidArgumentError(
        absl::StrFormat("repetition_penalty must be in [0.01, 10], got %.9g", p.repetition_penalty));
  }
  const int max_top = std::min(kMaxTopLogprobs, vocab_size);
  if (p.top_logprobs < 0 || p.top_logprobs > max_top) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs must be in [0, ", max_top, "], got ", p.top_logprobs));
  }
  return absl::OkStatus();
}

namespace {

// log-sum-exp of logits, in double.
double LogSumExp(const float* x, int n) {
  float max = x[0];
  for (int i = 1; i < n; ++i) max = std::max(max, x[i]);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(static_cast<double>(x[i]) - max);
  return max + std::log(sum);
}

// The k most likely tokens into out->top (k <= kMaxTopLogprobs, n).
void TopLogprobs(const float* logits, int n, int k, double lse, SampledToken* out) {
  k = std::clamp(k, 0, std::min(n, kMaxTopLogprobs));
  // One pass keeping the k best seen so far, sorted; each new logit that
  // beats the last is inserted (k is small, the vocabulary is large).
  int m = 0;
  for (int i = 0; i < n && k > 0; ++i) {
    if (m == k && logits[i] <= logits[out->top[m - 1].token]) continue;
    int j = m < k ? m++ : m - 1;
    while (j > 0 && logits[out->top[j - 1].token] < logits[i]) {
      out->top[j] = out->top[j - 1];
      --j;
    }
    out->top[j].token = i;
  }
  for (int j = 0; j < m; ++j) out->top[j].logprob = static_cast<float>(logits[out->top[j].token] - lse);
  out->n_top = m;
}

}  // namespace

SampledToken Score(const float* logits, int n, int32_t token, int top_logprobs) {
  SampledToken out;
  out.token = token;
  const double lse = LogSumExp(logits, n);
  if (!std::isfinite(lse)) {
    out.finite = false;
    return out;
  }
  if (top_logprobs > 0) TopLogprobs(logits, n, top_logprobs, lse, &out);
  out.logprob = static_cast<float>(logits[token] - lse);
  return out;
}

SampledToken Sample(const float* raw, int n, const SamplingParams& params, float u, const TokenCount* counts,
                    int n_counts, const TokenBias* biases, int n_biases) {
  SampledToken out;
  // NaN and +inf (inf - inf) make it NaN, and so do all -inf: checking it
  // costs nothing, and the sorting below needs ordered keys.
  const double lse = LogSumExp(raw, n);
  if (!std::isfinite(lse)) {
    out.finite = false;
    return out;
  }
  if (params.top_logprobs > 0) TopLogprobs(raw, n, params.top_logprobs, lse, &out);
  // The bias and the penalties change what is picked, not the logprobs
  // reported.
  std::vector<float> penalised;
  const float* logits = raw;
  if (n_biases > 0 || (params.penalised() && n_counts > 0)) {
    penalised.assign(raw, raw + n);
    logits = penalised.data();
  }
  for (int i = 0; i < n_biases; ++i) penalised[biases[i].token] += biases[i].bias;
  if (params.penalised() && n_counts > 0) {
    for (int i = 0; i < n_counts; ++i) {
      // As vLLM: the repetition penalty first, then the other two on the
      // generated tokens only.
      float& l = penalised[counts[i].token];
      if (params.repetition_penalty != 1) l = l > 0 ? l / params.repetition_penalty : l * params.repetition_penalty;
      if (counts[i].count > 0) {
        l -= params.presence_penalty + params.frequency_penalty * static_cast<float>(counts[i].count);
      }
    }
  }
  if (params.temperature == 0) {
    int best = 0;
    for (int i = 1; i < n; ++i) {
      if (logits[i] > logits[best]) best = i;
    }
    out.token = best;
    out.logprob = static_cast<float>(raw[best] - lse);
    return out;
  }
  // Candidates sorted by logit (descending; ties by id), cut by top-k.
  std::vector<int> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  auto by_logit = [&](int a, int b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  int keep = n;
  if (params.top_k > 0 && params.top_k < n) {
    keep = params.top_k;
    std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), by_logit);
  } else {
    std::sort(ids.begin(), ids.end(), by_logit);
  }
  // Tempered probabilities of the kept candidates.
  std::vector<double> probs(keep);
  const double max = logits[ids[0]];
  double sum = 0;
  for (int i = 0; i < keep; ++i) {
    probs[i] = std::exp((logits[ids[i]] - max) / params.temperature);
    sum += probs[i];
  }
  // min-p: the candidates at least min_p times as likely as the first
  // (whose tempered weight is exp(0) = 1), a prefix of the sorted ones.
  if (params.min_p > 0) {
    int cut = 1;
    while (cut < keep && probs[cut] >= params.min_p) ++cut;
    keep = cut;
    sum = 0;
    for (int i = 0; i < keep; ++i) sum += probs[i];
  }
  // top-p: the smallest prefix whose mass reaches top_p.
  if (params.top_p < 1) {
    double cum = 0;
    int cut = keep;
    for (int i = 0; i < keep; ++i) {
      cum += probs[i] / sum;
      if (cum >= params.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = 0;
    for (int i = 0; i < keep; ++i) sum += probs[i];
  }
  // Candidates of weight 0 (banned, -inf) come last: a draw that rounding
  // carries past the others' sum takes the last one of weight.
  while (keep > 1 && probs[keep - 1] == 0) --keep;
  const double target = static_cast<double>(u) * sum;
  double cum = 0;
  int pick = ids[keep - 1];
  for (int i = 0; i < keep; ++i) {
    cum += probs[i];
    if (target < cum) {
      pick = ids[i];
      break;
    }
  }
  out.token = pick;
  out.logprob = static_cast<float>(raw[pick] - lse);
  return out;
}

namespace {
uint64_t SplitMix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

SequenceRng::SequenceRng(uint64_t seed) {
  for (uint64_t& s : s_) s = SplitMix64(seed);
}

uint64_t SequenceRng::Next() {
  const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = Rotl(s_[3], 45);
  return result;
}

float SequenceRng::NextUniform() { return static_cast<float>(Next() >> 40) * (1.0f / 16777216.0f); }

float SampleUniform(uint64_t seed, uint64_t index) {
  // The seed is mixed first: started at the seed itself, the stream of
  // seed + 0x9e37... would be this one's shifted by one draw.
  uint64_t mixed = seed;
  uint64_t x = SplitMix64(mixed) + index * 0x9e3779b97f4a7c15ULL;  // SplitMix64 after `index` draws
  return static_cast<float>(SplitMix64(x) >> 40) * (1.0f / 16777216.0f);
}

}  // namespace ellm
