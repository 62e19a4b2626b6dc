// coordinator/scheduler.h with a fake StepExecutor: admission, continuous
// batching, prompt chunking, stop conditions, KV budget, queue limit, worker
// failure, cancellation. The fake records every plan and every free, answers
// each sampled sequence with a deterministic token, and can be held inside a
// Run so that a test controls what the scheduler sees between two steps.
// Synchronisation is by RequestStream::Pop and condition variables with
// timeouts (a few seconds), never by sleeping.
#include "coordinator/scheduler.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "coordinator/metrics.h"
#include "coordinator/workers.h"
#include "core/gguf.h"
#include "core/tokenizer.h"
#include "tests/stories_tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ellm::coord {
namespace {

using ::testing::HasSubstr;

constexpr auto kWait = std::chrono::seconds(5);
const absl::Duration kPopTimeout = absl::Seconds(5);
constexpr int32_t kEos = 2;
// Ids 3..258 of stories260K are byte tokens; from 259 on they are text pieces.
constexpr int32_t kFirstPiece = 259;

const Tokenizer& Tok() { return ellm::testing::StoriesTokenizer(); }

// The text of `tokens` as an answer to `prompt`: what follows the prompt's
// own text when the whole sequence is decoded.
std::string Answer(const std::vector<int32_t>& prompt, const std::vector<int32_t>& tokens) {
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), tokens.begin(), tokens.end());
  return Tok().Decode(all).substr(Tok().Decode(prompt).size());
}

// The fake's log-probability of the prompt token at `pos` (scored prompts).
float ScoreOf(uint32_t pos) { return -0.01f * static_cast<float>(pos); }

// The fake's default answer: a text piece chosen from the sequence id and the
// position of the step's last token of that sequence. Never EOS.
int32_t DefaultToken(uint64_t seq, uint32_t last_pos, int /*nth*/) {
  return kFirstPiece + static_cast<int32_t>((seq * 7 + last_pos) % (512 - kFirstPiece));
}

// A TokenFn's answer for "the logits were not finite": the fake sends no
// token but that status, as the mlp-worker does for a model that overflowed.
constexpr int32_t kNotFinite = -1;

class FakeExecutor : public StepExecutor {
 public:
  // The token sampled for a sequence: its id, the position of its last token
  // in the step, and how many tokens it sampled before.
  using TokenFn = std::function<int32_t(uint64_t seq, uint32_t last_pos, int nth)>;

  struct Event {
    bool is_free = false;
    uint64_t step = 0;
    shm::StepPlan plan;         // a Run
    std::vector<uint64_t> ids;  // a FreeSequences
  };

  absl::StatusOr<std::vector<shm::SampledSeq>> Run(uint64_t step,
                                                   const shm::StepPlan& plan) override {
    std::unique_lock<std::mutex> lock(mu_);
    log_.push_back({false, step, plan, {}});
    ++runs_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return !hold_; });
    if (runs_ == fail_at_run_) return fail_status_;
    std::vector<shm::SampledSeq> out;
    size_t token_at = 0;
    for (const shm::PlanSeq& p : plan.seqs) {
      // Scored prompt tokens: the token after each, its logprob a function
      // of its position (ScoreOf).
      for (uint32_t i = 0; i < shm::ScoredTokens(p); ++i) {
        shm::SampledSeq& r = out.emplace_back();
        r.seq_id = p.slice.seq_id;
        r.status = shm::kScored;
        r.token = i + 1 < p.slice.n_tokens ? plan.tokens[token_at + i + 1] : p.next_token;
        r.logprob = ScoreOf(p.slice.start_pos + i + 1);
        r.n_top = 1;
        r.top[0] = {r.token, r.logprob};
      }
      token_at += p.slice.n_tokens;
      if (!p.sample) continue;
      const uint64_t id = p.slice.seq_id;
      const int nth = sampled_[id]++;
      const uint32_t last = p.slice.start_pos + p.slice.n_tokens - 1;
      shm::SampledSeq& r = out.emplace_back();
      r.seq_id = id;
      r.token = token_fn_ ? token_fn_(id, last, nth) : DefaultToken(id, last, nth);
      r.logprob = -0.5f - 0.001f * nth;
      if (r.token == kNotFinite) r.status = shm::kLogitsNotFinite, r.token = 0;
    }
    if (mangle_) mangle_(&out);
    return out;
  }
  // Edits each step's result before it is returned (a faulty worker).
  void SetMangle(std::function<void(std::vector<shm::SampledSeq>*)> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    mangle_ = std::move(fn);
  }

  // Applies the ops to a model of a worker's prefix cache (sequences' cached
  // blocks, each key's references) and refuses, as a worker would, what one
  // could not honour.
  absl::Status UpdateKv(const KvOps& ops) override {
    std::lock_guard<std::mutex> lock(mu_);
    log_.push_back({true, 0, {}, ops.free});
    all_ops_.push_back(ops);
    cv_.notify_all();
    if (fail_kv_) return absl::FailedPreconditionError("injected UpdateKv failure");
    for (const KvOps::SequenceBlocks& p : ops.publish) {
      // Blocks it skips stay the sequence's own (0: no key), as a worker
      // allows: a block another sequence cached first.
      std::vector<uint64_t>& held = seq_keys_[p.seq];
      if (p.first_block < static_cast<int>(held.size())) {
        return Refuse("publish out of order for sequence ", p.seq);
      }
      held.resize(static_cast<size_t>(p.first_block), 0);
      std::vector<uint64_t> keys = p.keys;
      if (p.partial_rows > 0) keys.push_back(p.partial_key);  // its last, partial block
      for (uint64_t k : keys) {
        if (refs_.count(k)) return Refuse("publish of a cached key by sequence ", p.seq);
        refs_[k] = 1;
        held.push_back(k);
      }
    }
    for (uint64_t id : ops.free) {
      freed_.insert(id);
      for (uint64_t k : seq_keys_[id]) {
        if (k != 0) --refs_[k];
      }
      seq_keys_.erase(id);
    }
    for (uint64_t k : ops.evict) {
      if (!refs_.count(k) || refs_[k] != 0) return Refuse("evict of a referenced or unknown key by ", 0);
      refs_.erase(k);
      ++evicted_;
    }
    for (const KvOps::SequenceBlocks& a : ops.attach) {
      if (seq_keys_.count(a.seq) || a.first_block != 0) return Refuse("attach to a live sequence ", a.seq);
      for (uint64_t k : a.keys) {
        if (!refs_.count(k)) return Refuse("attach of an unknown key to sequence ", a.seq);
        ++refs_[k];
      }
      if (a.partial_rows > 0 && !refs_.count(a.partial_key)) {
        return Refuse("copy of an unknown partial block to sequence ", a.seq);
      }
      seq_keys_[a.seq] = a.keys;
      attached_[a.seq] = static_cast<int>(a.keys.size());
      if (a.partial_rows > 0) copied_[a.seq] = a.partial_rows;
    }
    return absl::OkStatus();
  }
  absl::Status Refuse(const char* what, uint64_t seq) {
    refusals_.push_back(absl::StrCat(what, seq));
    return absl::FailedPreconditionError(refusals_.back());
  }
  // No op was refused, and once every sequence is freed no cached key is
  // still referenced.
  void ExpectConsistent(bool all_freed) {
    std::unique_lock<std::mutex> lock(mu_);
    EXPECT_TRUE(refusals_.empty()) << refusals_[0];
    if (!all_freed) return;
    // The last frees reach the workers at the scheduler's next flush.
    cv_.wait_for(lock, kWait, [&] { return seq_keys_.empty(); });
    EXPECT_TRUE(seq_keys_.empty()) << seq_keys_.size() << " sequences still hold cached blocks";
    for (const auto& [k, r] : refs_) EXPECT_EQ(r, 0) << "key " << k;
  }
  int attached(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return attached_.count(id) ? attached_[id] : 0;
  }
  int copied(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return copied_.count(id) ? copied_[id] : 0;
  }
  int64_t cached_keys() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(refs_.size());
  }
  int64_t evicted() {
    std::lock_guard<std::mutex> lock(mu_);
    return evicted_;
  }
  void FailKvUpdates() {
    std::lock_guard<std::mutex> lock(mu_);
    fail_kv_ = true;
  }
  // Recover: counts the calls; the workers come back empty (the model of
  // their caches is cleared) unless `recover_status_` says otherwise.
  absl::Status Recover() override {
    absl::SleepFor(recover_delay_);
    std::lock_guard<std::mutex> lock(mu_);
    ++recovers_;
    seq_keys_.clear();
    refs_.clear();
    return recover_status_;
  }
  void SetRecoverDelay(absl::Duration d) { recover_delay_ = d; }  // before the scheduler starts
  void SetRecoverStatus(absl::Status st) {
    std::lock_guard<std::mutex> lock(mu_);
    recover_status_ = std::move(st);
  }
  int recovers() {
    std::lock_guard<std::mutex> lock(mu_);
    return recovers_;
  }

  // The KV store: every key loads (as a cached, unreferenced block). While
  // loads are held, a load waits inside the executor.
  absl::StatusOr<int> LoadBlocks(const std::vector<uint64_t>& keys) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++loads_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return !hold_loads_; });
    for (uint64_t k : keys) refs_.emplace(k, 0);
    return static_cast<int>(keys.size());
  }
  void HoldLoads(bool hold) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      hold_loads_ = hold;
    }
    cv_.notify_all();
  }
  bool WaitForLoads(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return loads_ >= n; });
  }

  absl::Status FillSynthetic(uint64_t id, int positions) override {
    std::lock_guard<std::mutex> lock(mu_);
    filled_[id] += positions;
    return absl::OkStatus();
  }
  int Filled(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return filled_.count(id) ? filled_[id] : 0;
  }

  void SetTokenFn(TokenFn fn) {
    std::lock_guard<std::mutex> lock(mu_);
    token_fn_ = std::move(fn);
  }
  // Run number `n` (1-based) returns `status` instead of tokens.
  void FailAtRun(int n, absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_at_run_ = n;
    fail_status_ = std::move(status);
  }
  // While held, a Run waits inside the executor.
  void Hold() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_ = true;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      hold_ = false;
    }
    cv_.notify_all();
  }
  bool WaitForRuns(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return runs_ >= n; });
  }
  bool WaitForFree(uint64_t id) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return freed_.count(id) > 0; });
  }
  int runs() {
    std::lock_guard<std::mutex> lock(mu_);
    return runs_;
  }
  bool freed(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return freed_.count(id) > 0;
  }
  std::vector<Event> log() {
    std::lock_guard<std::mutex> lock(mu_);
    return log_;
  }
  std::vector<shm::StepPlan> plans() {
    std::vector<shm::StepPlan> out;
    for (const Event& e : log()) {
      if (!e.is_free) out.push_back(e.plan);
    }
    return out;
  }

 private:
  std::map<uint64_t, int> filled_;
  std::map<uint64_t, std::vector<uint64_t>> seq_keys_;  // cached blocks each sequence holds
  std::map<uint64_t, int> refs_;                          // cached key -> sequences holding it
  std::map<uint64_t, int> attached_;
  std::map<uint64_t, int> copied_;  // rows of a cached partial block copied at attach
  std::vector<KvOps> all_ops_;
  std::vector<std::string> refusals_;
  int64_t evicted_ = 0;
  bool fail_kv_ = false;
  int recovers_ = 0;
  absl::Status recover_status_;
  absl::Duration recover_delay_ = absl::ZeroDuration();
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Event> log_;
  std::map<uint64_t, int> sampled_;
  std::set<uint64_t> freed_;
  TokenFn token_fn_;
  int runs_ = 0;
  int fail_at_run_ = -1;
  std::function<void(std::vector<shm::SampledSeq>*)> mangle_;
  absl::Status fail_status_;
  bool hold_ = false;
  int loads_ = 0;
  bool hold_loads_ = false;
};

// Everything a request's stream delivered.
struct Outcome {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::string text;
  std::vector<std::string> texts;  // each event's text
  int events = 0;
  bool finished = false;
  FinishInfo finish;
  absl::Status error;
};

Outcome Collect(RequestStream& stream) {
  Outcome o;
  while (!o.finished) {
    std::optional<StreamEvent> e = stream.Pop(kPopTimeout);
    if (!e) {
      ADD_FAILURE() << "no event within the timeout";
      return o;
    }
    ++o.events;
    o.tokens.insert(o.tokens.end(), e->token_ids.begin(), e->token_ids.end());
    o.logprobs.insert(o.logprobs.end(), e->logprobs.begin(), e->logprobs.end());
    o.text += e->text;
    o.texts.push_back(e->text);
    o.finished = e->finished;
    o.finish = e->finish;
    o.error = e->error;
  }
  return o;
}

// The id the scheduler gave the request whose prompt starts with `first`
// (every test gives its requests distinct first tokens): the sequence whose
// slice at position 0 starts with that token.
std::optional<uint64_t> SeqIdOf(const std::vector<shm::StepPlan>& plans, int32_t first) {
  for (const shm::StepPlan& plan : plans) {
    size_t offset = 0;
    for (const shm::PlanSeq& p : plan.seqs) {
      if (p.slice.start_pos == 0 && plan.tokens[offset] == first) return p.slice.seq_id;
      offset += p.slice.n_tokens;
    }
  }
  return std::nullopt;
}

// What one sequence's slices looked like across all plans, in order.
struct SeqTrace {
  std::vector<shm::PlanSeq> slices;
  std::vector<int32_t> fed;  // tokens of its slices, concatenated
  std::vector<size_t> plan_index;
};

std::map<uint64_t, SeqTrace> Traces(const std::vector<shm::StepPlan>& plans) {
  std::map<uint64_t, SeqTrace> out;
  for (size_t i = 0; i < plans.size(); ++i) {
    size_t offset = 0;
    for (const shm::PlanSeq& p : plans[i].seqs) {
      SeqTrace& t = out[p.slice.seq_id];
      t.slices.push_back(p);
      t.fed.insert(t.fed.end(), plans[i].tokens.begin() + offset,
                   plans[i].tokens.begin() + offset + p.slice.n_tokens);
      t.plan_index.push_back(i);
      offset += p.slice.n_tokens;
    }
  }
  return out;
}

// Checks the plans' invariants: the step budget, batch size, no sequence
// twice in a step, contiguous positions from 0 per sequence, the tokens fed are
// the prompt then the generated tokens, and only the chunk that finishes the
// prompt (and each decode) samples.
void CheckPlans(const std::vector<shm::StepPlan>& plans, const SchedulerOptions& options,
                const std::map<uint64_t, std::pair<std::vector<int32_t>, std::vector<int32_t>>>&
                    prompt_and_generated) {
  for (const shm::StepPlan& plan : plans) {
    ASSERT_FALSE(plan.seqs.empty());
    ASSERT_LE(static_cast<int>(plan.seqs.size()), options.max_batch);
    ASSERT_LE(static_cast<int>(plan.tokens.size()), options.max_step_tokens);
    uint32_t total = 0;
    std::set<uint64_t> ids;
    for (const shm::PlanSeq& p : plan.seqs) {
      ASSERT_GT(p.slice.n_tokens, 0u);
      total += p.slice.n_tokens;
      ASSERT_TRUE(ids.insert(p.slice.seq_id).second) << "sequence twice in a step";
    }
    ASSERT_EQ(total, plan.tokens.size());
  }
  const std::map<uint64_t, SeqTrace> traces = Traces(plans);
  for (const auto& [id, pg] : prompt_and_generated) {
    const auto& [prompt, generated] = pg;
    ASSERT_TRUE(traces.count(id)) << "sequence " << id << " never ran";
    const SeqTrace& t = traces.at(id);
    uint32_t pos = 0;
    int samples = 0;
    for (const shm::PlanSeq& p : t.slices) {
      EXPECT_EQ(p.slice.start_pos, pos) << "sequence " << id << ": positions not contiguous";
      pos += p.slice.n_tokens;
      const bool ends_prompt_or_decodes = pos >= prompt.size();
      EXPECT_EQ(p.sample, ends_prompt_or_decodes ? 1u : 0u) << "sequence " << id << " at " << pos;
      if (p.slice.start_pos >= prompt.size()) {
        EXPECT_EQ(p.slice.n_tokens, 1u) << "a decode feeds one token";
      }
      samples += p.sample;
    }
    EXPECT_EQ(samples, static_cast<int>(generated.size())) << "sequence " << id;
    // Fed: the prompt, then every generated token but the last.
    std::vector<int32_t> expected_fed = prompt;
    expected_fed.insert(expected_fed.end(), generated.begin(), generated.end() - 1);
    EXPECT_EQ(t.fed, expected_fed) << "sequence " << id;
  }
}

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.max_batch = 8;
    options_.max_step_tokens = 64;
    options_.kv_blocks = 64;
    options_.kv_block_tokens = 16;
    options_.max_queue = 8;
    options_.context_length = 2048;
  }
  void TearDown() override {
    exec_.Release();  // never leave the step thread stuck in Run
    scheduler_.reset();
  }
  void Start() { scheduler_ = std::make_unique<Scheduler>(options_, Tok(), &exec_); }

  // A prompt of `n` tokens whose first token is `first` (distinct per request).
  static std::vector<int32_t> Prompt(int32_t first, int n) {
    std::vector<int32_t> p = {first};
    for (int i = 1; i < n; ++i) p.push_back(kFirstPiece + (first * 13 + i * 5) % 200);
    return p;
  }
  std::shared_ptr<RequestStream> Submit(std::vector<int32_t> prompt, int max_tokens,
                                        std::vector<std::string> stop = {}) {
    GenerateOptions o;
    o.prompt = std::move(prompt);
    o.max_tokens = max_tokens;
    o.sampling = {.temperature = 0.7f, .top_k = 40, .top_p = 0.95f};
    o.seed = 1234;
    o.stop = std::move(stop);
    absl::StatusOr<std::shared_ptr<RequestStream>> s = scheduler_->Submit(std::move(o));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : nullptr;
  }
  // Polls Stats until `pred` holds (or the timeout).
  bool WaitForStats(const std::function<bool(const SchedulerStats&)>& pred) {
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    while (std::chrono::steady_clock::now() < deadline) {
      if (pred(scheduler_->Stats())) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return false;
  }

  SchedulerOptions options_;
  FakeExecutor exec_;
  std::unique_ptr<Scheduler> scheduler_;
};

TEST_F(SchedulerTest, YieldsExactlyMaxTokens) {
  Start();
  const std::vector<int32_t> prompt = Tok().Encode("Once upon a time", true);
  ASSERT_GT(prompt.size(), 2u);
  GenerateOptions o;
  o.prompt = prompt;
  o.max_tokens = 7;
  o.sampling = {.temperature = 0.8f, .top_k = 40, .top_p = 0.9f};
  o.seed = 99;
  absl::StatusOr<std::shared_ptr<RequestStream>> stream = scheduler_->Submit(o);
  ASSERT_TRUE(stream.ok()) << stream.status();
  const Outcome out = Collect(**stream);
  ASSERT_TRUE(out.finished);
  EXPECT_TRUE(out.error.ok()) << out.error;
  EXPECT_EQ(out.finish.reason, FinishReason::kMaxTokens);
  EXPECT_EQ(out.finish.completion_tokens, 7);
  EXPECT_EQ(out.finish.prompt_tokens, static_cast<int>(prompt.size()));
  ASSERT_EQ(out.tokens.size(), 7u);
  ASSERT_EQ(out.logprobs.size(), 7u);

  const std::vector<shm::StepPlan> plans = exec_.plans();
  const std::optional<uint64_t> id = SeqIdOf(plans, prompt[0]);
  ASSERT_TRUE(id.has_value());
  // The tokens are the executor's answers, in order, with their logprobs.
  for (int n = 0; n < 7; ++n) {
    const uint32_t last_pos = static_cast<uint32_t>(prompt.size()) - 1 + n;
    EXPECT_EQ(out.tokens[n], DefaultToken(*id, last_pos, n)) << n;
    EXPECT_FLOAT_EQ(out.logprobs[n], -0.5f - 0.001f * n);
  }
  EXPECT_EQ(out.text, Answer(prompt, out.tokens));
  CheckPlans(plans, options_, {{*id, {prompt, out.tokens}}});
  // Every sampling slice carries the request's parameters and the draw of
  // the token it samples, SampleUniform(seed, k) for the k-th; slices that
  // do not sample carry u = 0.
  uint64_t k = 0;
  const SeqTrace trace = Traces(plans)[*id];
  for (const shm::PlanSeq& p : trace.slices) {
    EXPECT_FLOAT_EQ(p.temperature, 0.8f);
    EXPECT_EQ(p.top_k, 40);
    EXPECT_FLOAT_EQ(p.top_p, 0.9f);
    if (p.sample) {
      EXPECT_EQ(p.u, SampleUniform(99, k++));
    } else {
      EXPECT_EQ(p.u, 0.0f);
    }
  }
  // The finished sequence's KV is freed and its blocks return.
  EXPECT_TRUE(exec_.WaitForFree(*id));
  EXPECT_TRUE(WaitForStats([&](const SchedulerStats& s) {
    return s.running == 0 && s.waiting == 0 && s.kv_blocks_free + s.kv_blocks_cached == options_.kv_blocks;
  }));
}

TEST_F(SchedulerTest, ARequestThatFillsTheContextEndsWithContextFull) {
  options_.context_length = 40;
  Start();
  const std::vector<int32_t> prompt = Prompt(300, 12);
  std::shared_ptr<RequestStream> full = Submit(prompt, options_.context_length - 12);
  std::shared_ptr<RequestStream> short_of_it = Submit(Prompt(301, 12), options_.context_length - 13);
  ASSERT_NE(full, nullptr);
  ASSERT_NE(short_of_it, nullptr);
  const Outcome a = Collect(*full);
  const Outcome b = Collect(*short_of_it);
  ASSERT_TRUE(a.finished && b.finished);
  EXPECT_EQ(a.finish.reason, FinishReason::kContext);
  EXPECT_EQ(a.finish.completion_tokens, options_.context_length - 12);
  EXPECT_EQ(b.finish.reason, FinishReason::kMaxTokens);
  EXPECT_EQ(b.finish.completion_tokens, options_.context_length - 13);
}

TEST_F(SchedulerTest, InvalidRequestsAreRefused) {
  Start();
  GenerateOptions o;
  o.max_tokens = 5;
  EXPECT_EQ(scheduler_->Submit(o).status().code(), absl::StatusCode::kInvalidArgument);  // empty
  o.prompt = {1, 300};
  o.max_tokens = 0;
  EXPECT_EQ(scheduler_->Submit(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.max_tokens = options_.context_length - 1;  // 2 + 2047 > 2048
  EXPECT_EQ(scheduler_->Submit(o).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(exec_.runs(), 0);
}

TEST_F(SchedulerTest, LongPromptIsChunkedToTheStepBudget) {
  options_.max_step_tokens = 8;
  Start();
  const std::vector<int32_t> prompt = Prompt(300, 30);
  std::shared_ptr<RequestStream> stream = Submit(prompt, 3);
  ASSERT_NE(stream, nullptr);
  const Outcome out = Collect(*stream);
  ASSERT_TRUE(out.error.ok()) << out.error;
  ASSERT_EQ(out.tokens.size(), 3u);
  const std::vector<shm::StepPlan> plans = exec_.plans();
  const std::optional<uint64_t> id = SeqIdOf(plans, 300);
  ASSERT_TRUE(id.has_value());
  CheckPlans(plans, options_, {{*id, {prompt, out.tokens}}});
  std::vector<uint32_t> sizes;
  const SeqTrace trace = Traces(plans)[*id];
  for (const shm::PlanSeq& p : trace.slices) sizes.push_back(p.slice.n_tokens);
  EXPECT_EQ(sizes, (std::vector<uint32_t>{8, 8, 8, 6, 1, 1}));
}

TEST_F(SchedulerTest, ManyRequestsRespectTheBudgetAndEachOthersPositions) {
  options_.max_step_tokens = 10;
  options_.max_batch = 3;
  Start();
  const std::vector<int> prompt_lengths = {7, 13, 1, 25, 10};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (size_t i = 0; i < prompt_lengths.size(); ++i) {
    prompts.push_back(Prompt(400 + static_cast<int32_t>(i), prompt_lengths[i]));
    streams.push_back(Submit(prompts.back(), 4 + static_cast<int>(i)));
    ASSERT_NE(streams.back(), nullptr);
  }
  std::map<uint64_t, std::pair<std::vector<int32_t>, std::vector<int32_t>>> expected;
  for (size_t i = 0; i < streams.size(); ++i) {
    const Outcome out = Collect(*streams[i]);
    ASSERT_TRUE(out.error.ok()) << out.error;
    EXPECT_EQ(out.finish.reason, FinishReason::kMaxTokens);
    EXPECT_EQ(out.tokens.size(), 4 + i);
    const std::optional<uint64_t> id = SeqIdOf(exec_.plans(), prompts[i][0]);
    ASSERT_TRUE(id.has_value());
    expected[*id] = {prompts[i], out.tokens};
  }
  CheckPlans(exec_.plans(), options_, expected);
}

TEST_F(SchedulerTest, ConcurrentRequestsShareSteps) {
  Start();
  exec_.Hold();
  std::shared_ptr<RequestStream> a = Submit(Prompt(300, 5), 6);
  ASSERT_TRUE(exec_.WaitForRuns(1));  // A's prompt is inside Run
  std::shared_ptr<RequestStream> b = Submit(Prompt(301, 4), 6);
  exec_.Release();
  const Outcome oa = Collect(*a), ob = Collect(*b);
  ASSERT_TRUE(oa.error.ok() && ob.error.ok());
  ASSERT_EQ(oa.tokens.size(), 6u);
  ASSERT_EQ(ob.tokens.size(), 6u);
  const std::vector<shm::StepPlan> plans = exec_.plans();
  const uint64_t ida = SeqIdOf(plans, 300).value(), idb = SeqIdOf(plans, 301).value();
  // Step 1: A's prompt. Steps 2..6: A decodes while B prefills then decodes,
  // both in the same plans. Step 7: B's last decode.
  ASSERT_EQ(plans.size(), 7u);
  int both = 0;
  for (const shm::StepPlan& p : plans) {
    std::set<uint64_t> ids;
    for (const shm::PlanSeq& s : p.seqs) ids.insert(s.slice.seq_id);
    both += ids.count(ida) && ids.count(idb);
  }
  EXPECT_EQ(both, 5);
  // Decodes go first in a plan, prompt chunks after.
  ASSERT_EQ(plans[1].seqs.size(), 2u);
  EXPECT_EQ(plans[1].seqs[0].slice.seq_id, ida);
  EXPECT_EQ(plans[1].seqs[1].slice.seq_id, idb);
  CheckPlans(plans, options_,
             {{ida, {Prompt(300, 5), oa.tokens}}, {idb, {Prompt(301, 4), ob.tokens}}});
}

// Penalised requests' token counts go with each step that samples, by
// token id: the generated tokens' counts, and with a repetition penalty the
// prompt's distinct tokens too (count 0 until generated); a request without
// penalties sends none. The generated tokens repeat, so counts grow past 1.
TEST_F(SchedulerTest, PenalisedRequestsSendTheirTokensCounts) {
  exec_.SetTokenFn([](uint64_t, uint32_t, int nth) { return kFirstPiece + (nth * nth) % 5; });
  Start();
  struct Case {
    int32_t first;
    SamplingParams sampling;
    bool prompt_too;
  };
  for (const Case& k : {Case{300, {.temperature = 0.7f, .presence_penalty = 0.5f, .frequency_penalty = 0.25f}, false},
                        Case{310, {.temperature = 0.7f, .repetition_penalty = 1.3f}, true}}) {
    SCOPED_TRACE(k.first);
    GenerateOptions o;
    o.prompt = Prompt(k.first, 20);
    o.prompt.push_back(o.prompt[3]);  // a token twice in the prompt
    o.max_tokens = 12;
    o.sampling = k.sampling;
    absl::StatusOr<std::shared_ptr<RequestStream>> penalised = scheduler_->Submit(o);
    ASSERT_TRUE(penalised.ok()) << penalised.status();
    const Outcome out = Collect(**penalised);
    ASSERT_TRUE(out.error.ok()) << out.error;
    ASSERT_EQ(out.tokens.size(), 12u);
    const Outcome plain = Collect(*Submit(Prompt(k.first + 1, 20), 5));
    ASSERT_TRUE(plain.error.ok()) << plain.error;
    const std::vector<shm::StepPlan> plans = exec_.plans();
    const uint64_t id = SeqIdOf(plans, k.first).value(), plain_id = SeqIdOf(plans, k.first + 1).value();
    int sampled = 0;
    for (const shm::StepPlan& plan : plans) {
      size_t at = 0;
      for (const shm::PlanSeq& p : plan.seqs) {
        std::vector<TokenCount> counts(plan.counts.begin() + at, plan.counts.begin() + at + p.n_counts);
        at += p.n_counts;
        if (p.slice.seq_id == plain_id) {
          EXPECT_EQ(p.n_counts, 0u);
        }
        if (p.slice.seq_id != id || !p.sample) continue;
        EXPECT_EQ(p.presence_penalty, k.sampling.presence_penalty);
        EXPECT_EQ(p.frequency_penalty, k.sampling.frequency_penalty);
        EXPECT_EQ(p.repetition_penalty, k.sampling.repetition_penalty);
        std::map<int32_t, int32_t> expected;
        if (k.prompt_too) {
          for (int32_t t : o.prompt) expected[t] = 0;
        }
        for (int i = 0; i < sampled; ++i) ++expected[out.tokens[i]];
        std::map<int32_t, int32_t> got;
        for (size_t i = 0; i < counts.size(); ++i) {
          got[counts[i].token] = counts[i].count;
          if (i > 0) {
            EXPECT_LT(counts[i - 1].token, counts[i].token) << "by token id";
          }
        }
        EXPECT_EQ(got, expected) << "before token " << sampled;
        ++sampled;
      }
      EXPECT_EQ(at, plan.counts.size());
    }
    EXPECT_EQ(sampled, 12);
  }
}

// A logit bias goes with each chunk that samples, by token id, and with
// nothing else.
TEST_F(SchedulerTest, LogitBiasGoesWithEveryChunkThatSamples) {
  options_.max_step_tokens = 8;  // the prompt takes several chunks
  Start();
  GenerateOptions o;
  o.prompt = Prompt(320, 20);
  o.max_tokens = 5;
  o.logit_bias = {{3, -100.0f}, {kFirstPiece + 1, 4.0f}};
  absl::StatusOr<std::shared_ptr<RequestStream>> s = scheduler_->Submit(o);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(Collect(**s).error.ok());
  const std::vector<shm::StepPlan> plans = exec_.plans();
  const uint64_t id = SeqIdOf(plans, 320).value();
  int sampled = 0, chunks = 0;
  for (const shm::StepPlan& plan : plans) {
    size_t at = 0;
    for (const shm::PlanSeq& p : plan.seqs) {
      std::vector<TokenBias> biases(plan.biases.begin() + at, plan.biases.begin() + at + p.n_biases);
      at += p.n_biases;
      if (p.slice.seq_id != id) continue;
      ++chunks;
      if (!p.sample) {
        EXPECT_EQ(p.n_biases, 0u);
        continue;
      }
      ASSERT_EQ(biases.size(), 2u);
      EXPECT_EQ(biases[0].token, 3);
      EXPECT_EQ(biases[0].bias, -100.0f);
      EXPECT_EQ(biases[1].token, kFirstPiece + 1);
      EXPECT_EQ(biases[1].bias, 4.0f);
      ++sampled;
    }
    EXPECT_EQ(at, plan.biases.size());
  }
  EXPECT_EQ(sampled, 5);
  EXPECT_GT(chunks, sampled) << "the premise: chunks that do not sample";
}

TEST_F(SchedulerTest, EndOfSequenceTokenStops) {
  exec_.SetTokenFn([](uint64_t seq, uint32_t pos, int nth) {
    return nth == 2 ? kEos : DefaultToken(seq, pos, nth);
  });
  Start();
  std::shared_ptr<RequestStream> stream = Submit(Prompt(300, 4), 10);
  const Outcome out = Collect(*stream);
  ASSERT_TRUE(out.error.ok()) << out.error;
  EXPECT_EQ(out.finish.reason, FinishReason::kStopToken);
  ASSERT_EQ(out.tokens.size(), 3u);
  EXPECT_EQ(out.tokens.back(), kEos);
  EXPECT_EQ(out.finish.completion_tokens, 3);
  // EOS adds no text.
  EXPECT_EQ(out.text, Answer(Prompt(300, 4), {out.tokens[0], out.tokens[1]}));
  const uint64_t id = SeqIdOf(exec_.plans(), 300).value();
  EXPECT_TRUE(exec_.WaitForFree(id));
}

// vLLM's ignore_eos: the model's end of generation is kept as a token (no
// text) and generation goes on; stop_token_ids stop it, their text dropped
// unless include_stop_str_in_output.
TEST_F(SchedulerTest, IgnoreEosGoesOnAndStopTokenIdsStop) {
  constexpr int32_t kStop = kFirstPiece + 5;
  exec_.SetTokenFn([](uint64_t seq, uint32_t pos, int nth) {
    return nth == 1 ? kEos : nth == 3 ? kStop : DefaultToken(seq, pos, nth);
  });
  Start();
  struct Case {
    bool ignore_eos;
    std::vector<int32_t> stop_token_ids;
    FinishReason reason;
    size_t tokens;
    bool include = false;
  };
  for (const Case& c : {Case{true, {}, FinishReason::kMaxTokens, 6}, Case{true, {kStop}, FinishReason::kStopToken, 4},
                        Case{true, {kStop}, FinishReason::kStopToken, 4, true},
                        Case{false, {kStop}, FinishReason::kStopToken, 2}}) {
    GenerateOptions o;
    o.prompt = Prompt(300, 4);
    o.max_tokens = 6;
    o.ignore_eos = c.ignore_eos;
    o.stop_token_ids = c.stop_token_ids;
    o.include_stop_str_in_output = c.include;
    absl::StatusOr<std::shared_ptr<RequestStream>> s = scheduler_->Submit(o);
    ASSERT_TRUE(s.ok()) << s.status();
    const Outcome out = Collect(**s);
    ASSERT_TRUE(out.error.ok()) << out.error;
    EXPECT_EQ(out.finish.reason, c.reason) << c.ignore_eos << " " << c.stop_token_ids.size();
    ASSERT_EQ(out.tokens.size(), c.tokens);
    EXPECT_EQ(out.tokens[1], kEos);
    if (c.tokens > 3) {
      EXPECT_EQ(out.tokens[3], kStop);
    }
    EXPECT_EQ(out.finish.completion_tokens, static_cast<int>(c.tokens));
    // The end of generation adds no text; a stop token id's only with include.
    const bool stop_text = c.tokens != 4 || c.include;
    EXPECT_EQ(out.text, Answer(o.prompt, {out.tokens.begin(), out.tokens.end() - (stop_text ? 0 : 1)}));
    if (c.tokens == 4) {
      EXPECT_NE(Answer(o.prompt, out.tokens), Answer(o.prompt, {out.tokens.begin(), out.tokens.end() - 1}));
    }
  }
}

// vLLM's min_tokens: while fewer are generated, every chunk that samples
// bans (-inf) the tokens that would stop the sequence (the model's end of
// generation unless ignore_eos, the stop token ids), overriding the logit
// bias; from then on it sends the logit bias alone.
TEST_F(SchedulerTest, MinTokensBansTheStoppingTokensUntilReached) {
  options_.max_step_tokens = 8;  // the prompt takes several chunks
  Start();
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr int32_t kStop = 100;  // a byte token: never the fake's answer
  ASSERT_FALSE(Tok().eog_ids().empty());
  for (const bool ignore_eos : {false, true}) {
    GenerateOptions o;
    o.prompt = Prompt(ignore_eos ? 330 : 320, 20);
    o.max_tokens = 6;
    o.min_tokens = 3;
    o.ignore_eos = ignore_eos;
    o.stop_token_ids = {kStop};
    o.logit_bias = {{kEos, 5.0f}, {kFirstPiece + 1, 4.0f}};
    absl::StatusOr<std::shared_ptr<RequestStream>> s = scheduler_->Submit(o);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(Collect(**s).error.ok());
    std::map<int32_t, float> early = {{kEos, 5.0f}, {kFirstPiece + 1, 4.0f}, {kStop, -kInf}};
    if (!ignore_eos) {
      for (int32_t t : Tok().eog_ids()) early[t] = -kInf;
    }
    const std::vector<shm::StepPlan> plans = exec_.plans();
    const uint64_t id = SeqIdOf(plans, o.prompt[0]).value();
    int sampled = 0;
    for (const shm::StepPlan& plan : plans) {
      size_t at = 0;
      for (const shm::PlanSeq& p : plan.seqs) {
        const std::vector<TokenBias> biases(plan.biases.begin() + at, plan.biases.begin() + at + p.n_biases);
        at += p.n_biases;
        if (p.slice.seq_id != id || !p.sample) continue;
        std::map<int32_t, float> sent;
        for (const TokenBias& b : biases) sent[b.token] = b.bias;
        EXPECT_EQ(sent.size(), biases.size()) << "distinct ids";
        // Token number `sampled` + 1 is drawn with `sampled` generated.
        if (sampled < o.min_tokens) {
          EXPECT_EQ(sent, early) << "token " << sampled + 1 << ", ignore_eos " << ignore_eos;
        } else {
          EXPECT_EQ(sent, (std::map<int32_t, float>{{kEos, 5.0f}, {kFirstPiece + 1, 4.0f}}))
              << "token " << sampled + 1;
        }
        ++sampled;
      }
    }
    EXPECT_EQ(sampled, 6);
  }
}

// Prompt logprobs: every prefill chunk of a scored request scores its
// tokens' next ones (the last chunk's, up to its sampled token), the first
// event carries them all in order, and it attaches no cached blocks though
// the same prompt is cached. A worker that scores other tokens, or fewer,
// fails the request and only it.
TEST_F(SchedulerTest, PromptLogprobsScoreEveryChunkAndAttachNothing) {
  options_.max_step_tokens = 8;
  Start();
  const std::vector<int32_t> prompt = Prompt(340, 37);
  std::shared_ptr<RequestStream> plain = Submit(prompt, 2);
  ASSERT_TRUE(Collect(*plain).error.ok());
  GenerateOptions o;
  o.prompt = prompt;
  o.max_tokens = 3;
  o.prompt_logprobs = true;
  absl::StatusOr<std::shared_ptr<RequestStream>> s = scheduler_->Submit(o);
  ASSERT_TRUE(s.ok()) << s.status();
  std::optional<StreamEvent> first = (*s)->Pop(kPopTimeout);
  ASSERT_TRUE(first.has_value());
  ASSERT_TRUE(first->error.ok()) << first->error;
  ASSERT_EQ(first->prompt_logprobs.size(), prompt.size() - 1);
  ASSERT_EQ(first->prompt_top_logprobs.size(), prompt.size() - 1);
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    EXPECT_EQ(first->prompt_logprobs[i], ScoreOf(static_cast<uint32_t>(i + 1))) << i;
    ASSERT_EQ(first->prompt_top_logprobs[i].size(), 1u);
    EXPECT_EQ(first->prompt_top_logprobs[i][0].token, prompt[i + 1]);
  }
  const Outcome out = Collect(**s);
  ASSERT_TRUE(out.error.ok()) << out.error;
  EXPECT_EQ(out.finish.cached_tokens, 0) << "scored prompts attach nothing";
  int chunks = 0;
  const std::vector<shm::StepPlan> plans = exec_.plans();
  const uint64_t id = SeqIdOf(plans, 340).value() + 1;  // the plain request's is first
  for (const shm::StepPlan& plan : plans) {
    for (const shm::PlanSeq& p : plan.seqs) {
      if (p.slice.seq_id != id) continue;
      const bool prefill = p.slice.start_pos < prompt.size();
      EXPECT_EQ(p.score, prefill ? 1u : 0u) << p.slice.start_pos;
      if (prefill && !p.sample) {
        EXPECT_EQ(p.next_token, prompt[p.slice.start_pos + p.slice.n_tokens]);
        ++chunks;
      }
    }
  }
  EXPECT_GE(chunks, 4) << "the premise: several chunks";
  // A worker that scores a wrong token, or drops one.
  for (int fault = 0; fault < 2; ++fault) {
    exec_.SetMangle([fault](std::vector<shm::SampledSeq>* out) {
      for (auto it = out->begin(); it != out->end(); ++it) {
        if (it->status != shm::kScored) continue;
        if (fault == 0) {
          it->token ^= 1;
        } else {
          out->erase(it);
        }
        return;
      }
    });
    absl::StatusOr<std::shared_ptr<RequestStream>> bad = scheduler_->Submit(o);
    ASSERT_TRUE(bad.ok()) << bad.status();
    std::shared_ptr<RequestStream> other = Submit(Prompt(350 + fault, 5), 3);
    const Outcome failed = Collect(**bad);
    EXPECT_EQ(failed.error.code(), absl::StatusCode::kInternal) << failed.error;
    EXPECT_THAT(std::string(failed.error.message()), HasSubstr("scored")) << failed.error;
    exec_.SetMangle(nullptr);
    EXPECT_TRUE(Collect(*other).error.ok()) << "the other request goes on";
  }
}

// A scored prompt that continues a cached one (helper-32's audit): it
// attaches nothing, but publishes the blocks past the cached prefix,
// chained on from the cached ones, so a plain request of the whole prompt
// then attaches all of it (but the last token, which it feeds).
TEST_F(SchedulerTest, AScoredPromptPublishesItsBlocksPastACachedPrefix) {
  Start();
  const std::vector<int32_t> longer = Prompt(360, 70);
  const std::vector<int32_t> prefix(longer.begin(), longer.begin() + 33);  // 2 whole blocks and a row
  ASSERT_TRUE(Collect(*Submit(prefix, 2)).error.ok());
  GenerateOptions o;
  o.prompt = longer;
  o.max_tokens = 2;
  o.prompt_logprobs = true;
  absl::StatusOr<std::shared_ptr<RequestStream>> scored = scheduler_->Submit(o);
  ASSERT_TRUE(scored.ok()) << scored.status();
  const Outcome s = Collect(**scored);
  ASSERT_TRUE(s.error.ok()) << s.error;
  EXPECT_EQ(s.finish.cached_tokens, 0);
  const Outcome plain = Collect(*Submit(longer, 2));
  ASSERT_TRUE(plain.error.ok()) << plain.error;
  EXPECT_EQ(plain.finish.cached_tokens, 69) << "all of the 70-token prompt but its last token (without the fix, 33)";
  exec_.ExpectConsistent(/*all_freed=*/true);
}

class SchedulerStopStrings : public SchedulerTest {
 protected:
  // Runs a request whose tokens are `script` (then EOS) with `stop` strings.
  Outcome RunScript(const std::vector<int32_t>& script, const std::vector<std::string>& stop,
                    int max_tokens) {
    exec_.SetTokenFn([script](uint64_t, uint32_t, int nth) {
      return nth < static_cast<int>(script.size()) ? script[nth] : kEos;
    });
    Start();
    std::shared_ptr<RequestStream> stream = Submit(Prompt(300, 3), max_tokens, stop);
    return stream ? Collect(*stream) : Outcome{};
  }
  const std::vector<int32_t> script_ =
      Tok().Encode("the big cat sat on the mat and the dog ran away", false);
};

// The request's text and token count when stop strings end it: the shortest
// prefix of `script` whose text holds a stop string, cut at the earliest one.
std::pair<std::string, size_t> ExpectedStop(const std::vector<int32_t>& prompt,
                                            const std::vector<int32_t>& script,
                                            const std::vector<std::string>& stop) {
  for (size_t m = 1; m <= script.size(); ++m) {
    const std::string text = Answer(prompt, {script.begin(), script.begin() + m});
    size_t cut = std::string::npos;
    for (const std::string& s : stop) cut = std::min(cut, text.find(s));
    if (cut != std::string::npos) return {text.substr(0, cut), m};
  }
  return {"", 0};
}

TEST_F(SchedulerStopStrings, StopStringEndsTheRequestAndIsNotSent) {
  ASSERT_GT(script_.size(), 8u);
  const std::vector<std::string> stop = {"sat on"};
  const auto [text, count] = ExpectedStop(Prompt(300, 3), script_, stop);
  ASSERT_GT(count, 0u);
  ASSERT_FALSE(text.empty());
  const Outcome out = RunScript(script_, stop, 40);
  ASSERT_TRUE(out.error.ok()) << out.error;
  EXPECT_EQ(out.finish.reason, FinishReason::kStopString);
  EXPECT_EQ(out.text, text);
  EXPECT_EQ(out.text.find("sat"), std::string::npos);
  EXPECT_EQ(out.tokens.size(), count);
}

// include_stop_str_in_output: the text ends with the stop string.
TEST_F(SchedulerStopStrings, IncludedStopStringEndsTheText) {
  const std::vector<std::string> stop = {"t sat", "mat"};
  const auto [text, count] = ExpectedStop(Prompt(300, 3), script_, stop);
  ASSERT_GT(count, 0u);
  exec_.SetTokenFn([this](uint64_t, uint32_t, int nth) {
    return nth < static_cast<int>(script_.size()) ? script_[nth] : kEos;
  });
  Start();
  GenerateOptions o;
  o.prompt = Prompt(300, 3);
  o.max_tokens = 40;
  o.stop = stop;
  o.include_stop_str_in_output = true;
  absl::StatusOr<std::shared_ptr<RequestStream>> s = scheduler_->Submit(o);
  ASSERT_TRUE(s.ok()) << s.status();
  const Outcome out = Collect(**s);
  EXPECT_EQ(out.finish.reason, FinishReason::kStopString);
  EXPECT_EQ(out.text, text + "t sat");
  EXPECT_EQ(out.tokens.size(), count);
}

TEST_F(SchedulerStopStrings, EarliestOfSeveralStopStringsAcrossTokens) {
  // "t sat" spans the tokens of "cat" and "sat"; "mat" comes later.
  const std::vector<std::string> stop = {"mat", "t sat"};
  const auto [text, count] = ExpectedStop(Prompt(300, 3), script_, stop);
  ASSERT_GT(count, 0u);
  const Outcome out = RunScript(script_, stop, 40);
  EXPECT_EQ(out.finish.reason, FinishReason::kStopString);
  EXPECT_EQ(out.text, text);
  EXPECT_THAT(text, ::testing::EndsWith("ca"));
  EXPECT_EQ(out.tokens.size(), count);
}

TEST_F(SchedulerStopStrings, HeldBackPrefixIsFlushedWhenNoStopCompletes) {
  // The text ends in "... the mat and the", a prefix of the stop string: it
  // is held back while it could still complete, then sent at the end.
  const std::vector<int32_t> script =
      Tok().Encode("the big cat sat on the mat and the", false);
  const Outcome out =
      RunScript(script, {"mat and the cow", "zzz"}, static_cast<int>(script.size()));
  ASSERT_TRUE(out.error.ok()) << out.error;
  EXPECT_EQ(out.finish.reason, FinishReason::kMaxTokens);
  EXPECT_EQ(out.tokens, script);
  EXPECT_EQ(out.text, Answer(Prompt(300, 3), script));
  // "mat and the" went out in one piece once the request ended, not token by
  // token as it was generated.
  size_t first = 0;
  while (first < out.texts.size() && out.texts[first].find("mat") == std::string::npos) ++first;
  ASSERT_LT(first, out.texts.size());
  EXPECT_NE(out.texts[first].find("mat and the"), std::string::npos) << out.texts[first];
}

// min_tokens: stop strings are looked for from token min_tokens + 1 on,
// and only those that end in its text or later (vLLM's rule); one that
// began in the earlier tokens' text still counts.
TEST_F(SchedulerStopStrings, MinTokensDelaysStopStrings) {
  const std::vector<int32_t> prompt = Prompt(300, 3);
  const std::vector<std::string> stop = {"the", "big cat"};
  ASSERT_EQ(ExpectedStop(prompt, script_, stop).second, 1u) << "the premise: \"the\" ends the first token";
  const int min_tokens = 2;
  // The reference: the first token after min_tokens whose text completes a
  // stop string, cut at the earliest such string's start.
  std::string text;
  size_t count = 0;
  for (size_t k = min_tokens + 1; k <= script_.size() && count == 0; ++k) {
    const std::string before = Answer(prompt, {script_.begin(), script_.begin() + k - 1});
    const std::string now = Answer(prompt, {script_.begin(), script_.begin() + k});
    size_t cut = std::string::npos;
    for (const std::string& s : stop) {
      for (size_t at = now.find(s); at != std::string::npos; at = now.find(s, at + 1)) {
        if (at + s.size() > before.size()) {
          cut = std::min(cut, at);
          break;
        }
      }
    }
    if (cut != std::string::npos) {
      text = now.substr(0, cut);
      count = k;
    }
  }
  ASSERT_GT(count, static_cast<size_t>(min_tokens));
  exec_.SetTokenFn([this](uint64_t, uint32_t, int nth) {
    return nth < static_cast<int>(script_.size()) ? script_[nth] : kEos;
  });
  Start();
  GenerateOptions o;
  o.prompt = prompt;
  o.max_tokens = 40;
  o.min_tokens = min_tokens;
  o.stop = stop;
  absl::StatusOr<std::shared_ptr<RequestStream>> s = scheduler_->Submit(o);
  ASSERT_TRUE(s.ok()) << s.status();
  const Outcome out = Collect(**s);
  ASSERT_TRUE(out.error.ok()) << out.error;
  EXPECT_EQ(out.finish.reason, FinishReason::kStopString);
  EXPECT_EQ(out.text, text);
  EXPECT_EQ(out.tokens.size(), count);
  EXPECT_THAT(out.text, HasSubstr("the")) << "the first \"the\" did not stop it";
}

TEST_F(SchedulerTest, RequestLargerThanTheKvCacheIsRefusedAtSubmit) {
  options_.kv_blocks = 4;  // 64 positions
  Start();
  GenerateOptions o;
  o.prompt = Prompt(300, 10);
  o.max_tokens = 55;  // 65 positions: 5 blocks
  absl::StatusOr<std::shared_ptr<RequestStream>> s = scheduler_->Submit(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("KV"));
  o.max_tokens = 54;  // exactly 64 positions
  s = scheduler_->Submit(o);
  ASSERT_TRUE(s.ok()) << s.status();
  const Outcome out = Collect(**s);
  EXPECT_TRUE(out.error.ok());
  EXPECT_EQ(out.tokens.size(), 54u);
}

TEST_F(SchedulerTest, SecondRequestWaitsForKvAndRunsAfterTheFirstIsFreed) {
  options_.kv_blocks = 2;  // one request of <= 32 positions at a time
  Start();
  exec_.Hold();
  std::shared_ptr<RequestStream> a = Submit(Prompt(300, 5), 20);  // 25 positions: 2 blocks
  ASSERT_TRUE(exec_.WaitForRuns(1));
  std::shared_ptr<RequestStream> b = Submit(Prompt(301, 5), 20);
  SchedulerStats stats = scheduler_->Stats();
  EXPECT_EQ(stats.running, 1);
  EXPECT_EQ(stats.waiting, 1);
  EXPECT_EQ(stats.kv_blocks_free, 0);
  exec_.Release();
  const Outcome oa = Collect(*a), ob = Collect(*b);
  ASSERT_TRUE(oa.error.ok() && ob.error.ok());
  EXPECT_EQ(oa.finish.reason, FinishReason::kMaxTokens);
  EXPECT_EQ(ob.finish.reason, FinishReason::kMaxTokens);
  EXPECT_EQ(oa.tokens.size(), 20u);
  EXPECT_EQ(ob.tokens.size(), 20u);

  const std::vector<FakeExecutor::Event> log = exec_.log();
  std::vector<shm::StepPlan> plans;
  for (const auto& e : log) {
    if (!e.is_free) plans.push_back(e.plan);
  }
  const uint64_t ida = SeqIdOf(plans, 300).value(), idb = SeqIdOf(plans, 301).value();
  // In log order: every run of A, then A's free, then every run of B.
  int phase = 0;  // 0: A running, 1: A freed, 2: B running
  for (const auto& e : log) {
    if (e.is_free) {
      if (std::count(e.ids.begin(), e.ids.end(), ida)) {
        EXPECT_EQ(phase, 0);
        phase = 1;
      }
      continue;
    }
    for (const shm::PlanSeq& p : e.plan.seqs) {
      if (p.slice.seq_id == ida) {
        EXPECT_EQ(phase, 0) << "A ran after it was freed";
      }
      if (p.slice.seq_id == idb) {
        EXPECT_GE(phase, 1) << "B ran before A's KV was freed";
        phase = 2;
      }
    }
  }
  EXPECT_EQ(phase, 2);
  CheckPlans(plans, options_,
             {{ida, {Prompt(300, 5), oa.tokens}}, {idb, {Prompt(301, 5), ob.tokens}}});
}

TEST_F(SchedulerTest, FullQueueIsResourceExhausted) {
  options_.kv_blocks = 2;
  options_.max_queue = 2;
  Start();
  exec_.Hold();
  std::shared_ptr<RequestStream> a = Submit(Prompt(300, 5), 20);
  ASSERT_TRUE(exec_.WaitForRuns(1));  // A admitted; B and C will wait
  std::shared_ptr<RequestStream> b = Submit(Prompt(301, 5), 20);
  std::shared_ptr<RequestStream> c = Submit(Prompt(302, 5), 20);
  GenerateOptions o;
  o.prompt = Prompt(303, 5);
  o.max_tokens = 20;
  const absl::Status st = scheduler_->Submit(o).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("queue"));
  EXPECT_EQ(scheduler_->Stats().waiting, 2);
  exec_.Release();
  for (auto* s : {a.get(), b.get(), c.get()}) {
    const Outcome out = Collect(*s);
    EXPECT_TRUE(out.error.ok()) << out.error;
    EXPECT_EQ(out.tokens.size(), 20u);
  }
  // The queue drained: a new request is accepted.
  absl::StatusOr<std::shared_ptr<RequestStream>> d = scheduler_->Submit(o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(Collect(**d).error.ok());
}

class SchedulerWorkerFailure : public SchedulerTest,
                               public ::testing::WithParamInterface<absl::StatusCode> {};

TEST_P(SchedulerWorkerFailure, FailsEveryRequestAndLaterSubmits) {
  Start();
  std::vector<absl::Status> broken_calls;
  std::mutex mu;
  scheduler_->on_broken = [&](const absl::Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    broken_calls.push_back(s);
  };
  exec_.Hold();
  std::shared_ptr<RequestStream> a = Submit(Prompt(300, 5), 50);
  ASSERT_TRUE(exec_.WaitForRuns(1));
  std::shared_ptr<RequestStream> b = Submit(Prompt(301, 5), 50);
  exec_.FailAtRun(3, absl::Status(GetParam(), "ring to attn-worker 1 timed out"));
  exec_.Release();
  for (auto* s : {a.get(), b.get()}) {
    const Outcome out = Collect(*s);
    ASSERT_TRUE(out.finished);
    EXPECT_EQ(out.error.code(), absl::StatusCode::kUnavailable) << out.error;
    EXPECT_THAT(std::string(out.error.message()), HasSubstr("attn-worker 1"));
    EXPECT_LT(out.tokens.size(), 3u);  // at most the tokens of steps 1 and 2
  }
  EXPECT_TRUE(scheduler_->broken());
  GenerateOptions o;
  o.prompt = Prompt(302, 5);
  o.max_tokens = 5;
  EXPECT_EQ(scheduler_->Submit(o).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(exec_.runs(), 3);  // nothing ran after the failure
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(broken_calls.size(), 1u);
  EXPECT_EQ(broken_calls[0].code(), absl::StatusCode::kUnavailable);
}

INSTANTIATE_TEST_SUITE_P(Codes, SchedulerWorkerFailure,
                         ::testing::Values(absl::StatusCode::kUnavailable,
                                           absl::StatusCode::kDeadlineExceeded));

double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

TEST_F(SchedulerTest, BrokenSchedulerDoesNotSpin) {
  // Once broken, the step thread must sleep like an idle one, not poll in a
  // tight loop. Measured over 400 ms of wall time (the sleep here measures;
  // it synchronises nothing): an idle scheduler uses well under 100 ms of CPU.
  Start();
  std::shared_ptr<RequestStream> a = Submit(Prompt(300, 5), 5);
  ASSERT_TRUE(Collect(*a).error.ok());
  scheduler_->MarkBroken(absl::UnavailableError("mlp-worker died"));
  ASSERT_TRUE(scheduler_->broken());
  const double cpu0 = ProcessCpuSeconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  const double cpu = ProcessCpuSeconds() - cpu0;
  EXPECT_LT(cpu, 0.1) << "the step thread burned " << cpu << " s of CPU in 0.4 s while broken";
}

TEST_F(SchedulerTest, FailedStepFailsOnlyItsRequests) {
  // A non-transport error (the workers are alive) ends the step's requests
  // with Internal, frees their KV, and the scheduler goes on.
  Start();
  exec_.FailAtRun(2, absl::InvalidArgumentError("bad token in plan"));
  std::shared_ptr<RequestStream> a = Submit(Prompt(300, 5), 10);
  const Outcome oa = Collect(*a);
  EXPECT_EQ(oa.error.code(), absl::StatusCode::kInternal) << oa.error;
  EXPECT_THAT(std::string(oa.error.message()), HasSubstr("bad token in plan"));
  const uint64_t ida = SeqIdOf(exec_.plans(), 300).value();
  EXPECT_TRUE(exec_.WaitForFree(ida));
  EXPECT_FALSE(scheduler_->broken());
  std::shared_ptr<RequestStream> b = Submit(Prompt(301, 5), 10);
  ASSERT_NE(b, nullptr);
  const Outcome ob = Collect(*b);
  EXPECT_TRUE(ob.error.ok()) << ob.error;
  EXPECT_EQ(ob.tokens.size(), 10u);
  EXPECT_TRUE(WaitForStats([&](const SchedulerStats& s) {
    return s.running == 0 && s.kv_blocks_free + s.kv_blocks_cached == options_.kv_blocks;
  }));
}

TEST_F(SchedulerTest, CancelledRunningRequestIsDroppedAndFreed) {
  Start();
  exec_.Hold();
  std::shared_ptr<RequestStream> a = Submit(Prompt(300, 5), 1000);
  ASSERT_TRUE(exec_.WaitForRuns(1));  // A's prompt is inside Run
  a->Cancel();
  exec_.Release();
  const uint64_t id = SeqIdOf(exec_.plans(), 300).value();
  ASSERT_TRUE(exec_.WaitForFree(id));
  EXPECT_TRUE(WaitForStats([&](const SchedulerStats& s) {
    return s.running == 0 && s.waiting == 0 && s.kv_blocks_free + s.kv_blocks_cached == options_.kv_blocks;
  }));
  // A ran in step 1 only; nothing after its free mentions it.
  int runs_with_a = 0;
  bool freed = false;
  for (const auto& e : exec_.log()) {
    if (e.is_free) {
      freed = freed || std::count(e.ids.begin(), e.ids.end(), id);
      continue;
    }
    for (const shm::PlanSeq& p : e.plan.seqs) {
      if (p.slice.seq_id == id) {
        ++runs_with_a;
        EXPECT_FALSE(freed) << "a freed sequence ran";
      }
    }
  }
  EXPECT_EQ(runs_with_a, 1);
  // The stream got at most the token of step 1, never 1000.
  int tokens = 0;
  while (std::optional<StreamEvent> e = a->Pop(absl::ZeroDuration())) {
    tokens += static_cast<int>(e->token_ids.size());
  }
  EXPECT_LE(tokens, 1);
}

TEST_F(SchedulerTest, CancelledWaitingRequestNeverRuns) {
  options_.kv_blocks = 2;
  Metrics metrics;
  options_.metrics = &metrics;
  Start();
  exec_.Hold();
  std::shared_ptr<RequestStream> a = Submit(Prompt(300, 5), 20);
  ASSERT_TRUE(exec_.WaitForRuns(1));
  std::shared_ptr<RequestStream> b = Submit(Prompt(301, 5), 20);
  b->Cancel();
  exec_.Release();
  EXPECT_TRUE(Collect(*a).error.ok());
  EXPECT_TRUE(WaitForStats([&](const SchedulerStats& s) {
    return s.running == 0 && s.waiting == 0 && s.kv_blocks_free + s.kv_blocks_cached == options_.kv_blocks;
  }));
  EXPECT_FALSE(SeqIdOf(exec_.plans(), 301).has_value()) << "a cancelled waiting request ran";
  // It is counted as cancelled in the metrics, as a running one would be.
  EXPECT_TRUE(absl::StrContains(metrics.Render(scheduler_->Stats(), {}), "ellm_requests_total{outcome=\"cancelled\"} 1\n"));
}

// One sample of a metrics exposition, by its full name ("name{labels}").
double Sample(const std::string& exposition, const std::string& name) {
  const size_t at = exposition.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stod(exposition.substr(at + name.size() + 2));
}

// Every request is counted once, whatever its end: prompt and cached tokens
// (the latter as its Finish reports them) and its queue wait at its first admission, its first token when it comes
// (a cancelled request's too), and a refusal as outcome "refused". (Counted
// at the end, a cancelled request's prompt and first token were missing.)
TEST_F(SchedulerTest, MetricsCountEveryRequestOnceWhateverItsEnd) {
  Metrics metrics;
  options_.metrics = &metrics;
  Start();
  exec_.Hold();
  std::shared_ptr<RequestStream> a = Submit(Prompt(300, 20), options_.kv_blocks * options_.kv_block_tokens - 20);
  ASSERT_TRUE(exec_.WaitForRuns(1));
  std::shared_ptr<RequestStream> b = Submit(Prompt(301, 9), 5);  // waits: a holds every block
  ASSERT_NE(b, nullptr);
  b->Cancel();
  a->Cancel();
  exec_.Release();
  EXPECT_TRUE(WaitForStats([&](const SchedulerStats& st) { return st.running == 0 && st.waiting == 0; }));
  size_t a_tokens = 0;  // a cancelled stream gets no finish event
  while (std::optional<StreamEvent> e = a->Pop(absl::ZeroDuration())) a_tokens += e->token_ids.size();
  GenerateOptions bad;
  bad.prompt = Prompt(302, 4);
  bad.max_tokens = 0;
  EXPECT_FALSE(scheduler_->Submit(bad).ok());
  const Outcome out_d = Collect(*Submit(Prompt(303, 20), 5));
  ASSERT_TRUE(out_d.error.ok()) << out_d.error;
  const Outcome out_e = Collect(*Submit(Prompt(303, 20), 5));  // d's prompt again: a cache hit
  ASSERT_TRUE(out_e.error.ok()) << out_e.error;
  ASSERT_GE(out_e.finish.cached_tokens, options_.kv_block_tokens);
  const std::string text = metrics.Render(scheduler_->Stats(), {});
  EXPECT_EQ(Sample(text, "ellm_requests_total{outcome=\"cancelled\"}"), 2) << text;
  EXPECT_EQ(Sample(text, "ellm_requests_total{outcome=\"refused\"}"), 1) << text;
  EXPECT_EQ(Sample(text, "ellm_requests_total{outcome=\"length\"}"), 2) << text;
  EXPECT_EQ(Sample(text, "ellm_prompt_tokens_total"), 20 + 20 + 20) << "a's, d's and e's; b never ran\n" << text;
  EXPECT_EQ(Sample(text, "ellm_queue_wait_seconds_count"), 3) << text;
  EXPECT_EQ(Sample(text, "ellm_time_to_first_token_seconds_count"), (a_tokens == 0 ? 0 : 1) + 2) << text;
  EXPECT_EQ(Sample(text, "ellm_generated_tokens_total"), static_cast<double>(a_tokens + 5 + 5)) << text;
  EXPECT_EQ(Sample(text, "ellm_cached_prompt_tokens_total"), out_d.finish.cached_tokens + out_e.finish.cached_tokens)
      << text;
}

TEST_F(SchedulerTest, MarkBrokenFailsRunningAndWaitingRequests) {
  options_.kv_blocks = 2;
  Start();
  exec_.Hold();
  std::shared_ptr<RequestStream> a = Submit(Prompt(300, 5), 20);  // running, inside Run
  ASSERT_TRUE(exec_.WaitForRuns(1));
  std::shared_ptr<RequestStream> b = Submit(Prompt(301, 5), 20);  // waiting for KV
  const absl::Status dead = absl::UnavailableError("attn-worker 0 exited with signal 9");
  scheduler_->MarkBroken(dead);
  EXPECT_TRUE(scheduler_->broken());
  exec_.Release();
  for (auto* s : {a.get(), b.get()}) {
    const Outcome out = Collect(*s);
    ASSERT_TRUE(out.finished);
    EXPECT_EQ(out.error, dead);
  }
  EXPECT_EQ(exec_.runs(), 1);
  GenerateOptions o;
  o.prompt = Prompt(302, 5);
  o.max_tokens = 5;
  EXPECT_EQ(scheduler_->Submit(o).status(), dead);
}

TEST_F(SchedulerTest, StopEndsQueuedAndRunningRequests) {
  options_.kv_blocks = 2;
  options_.max_queue = 1 << 20;  // room for the probes below however slow Stop is
  Start();
  exec_.Hold();
  std::shared_ptr<RequestStream> a = Submit(Prompt(300, 5), 20);
  ASSERT_TRUE(exec_.WaitForRuns(1));
  std::shared_ptr<RequestStream> b = Submit(Prompt(301, 5), 20);
  std::thread stopper([&] { scheduler_->Stop(); });
  // Stop is in effect once Submit refuses; probes queued before that wait
  // behind B (the KV is full) and end with the others.
  std::vector<std::shared_ptr<RequestStream>> streams = {a, b};
  GenerateOptions o;
  o.prompt = Prompt(302, 5);
  o.max_tokens = 5;
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  for (;;) {
    absl::StatusOr<std::shared_ptr<RequestStream>> probe = scheduler_->Submit(o);
    if (!probe.ok()) {
      EXPECT_EQ(probe.status().code(), absl::StatusCode::kUnavailable) << probe.status();
      break;
    }
    streams.push_back(*probe);
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "Stop never took effect";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  exec_.Release();
  stopper.join();
  for (const auto& s : streams) {
    const Outcome out = Collect(*s);
    ASSERT_TRUE(out.finished);
    EXPECT_EQ(out.error.code(), absl::StatusCode::kUnavailable) << out.error;
  }
  EXPECT_EQ(exec_.runs(), 1);
}

}  // namespace
}  // namespace ellm::coord

namespace ellm::coord {
namespace {

TEST_F(SchedulerTest, SyntheticContextIsFilledOnceAndPositionsFollowIt) {
  Start();
  const std::vector<int32_t> prompt = Tok().Encode("Once upon a time", true);
  GenerateOptions o;
  o.prompt = prompt;
  o.max_tokens = 3;
  o.sampling.temperature = 0;
  o.synthetic_context = 300;
  absl::StatusOr<std::shared_ptr<RequestStream>> stream = scheduler_->Submit(o);
  ASSERT_TRUE(stream.ok()) << stream.status();
  const Outcome out = Collect(**stream);
  ASSERT_TRUE(out.finished);
  EXPECT_TRUE(out.error.ok()) << out.error;
  EXPECT_EQ(out.tokens.size(), 3u);
  const std::vector<shm::StepPlan> plans = exec_.plans();
  ASSERT_FALSE(plans.empty());
  const uint64_t id = plans[0].seqs[0].slice.seq_id;
  EXPECT_EQ(exec_.Filled(id), 300);
  // The prompt starts right after the synthetic positions; decodes follow on.
  EXPECT_EQ(plans[0].seqs[0].slice.start_pos, 300u);
  EXPECT_EQ(plans.back().seqs[0].slice.start_pos, 300u + prompt.size() + 1);
  // It counts against the context.
  o.synthetic_context = options_.context_length;
  EXPECT_EQ(scheduler_->Submit(o).status().code(), absl::StatusCode::kInvalidArgument);
  // Terms whose 32-bit sum wraps negative are refused, not admitted.
  o.synthetic_context = INT32_MAX;
  EXPECT_EQ(scheduler_->Submit(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.synthetic_context = INT32_MAX - 2;
  o.max_tokens = INT32_MAX;
  EXPECT_EQ(scheduler_->Submit(o).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(scheduler_->Stats().waiting, 0);
}

}  // namespace
}  // namespace ellm::coord

namespace ellm::coord {
namespace {

// The prefix cache, seen from the scheduler: which blocks a request attaches,
// what it publishes, what is evicted, and that every way of ending leaves the
// workers' reference counts balanced (FakeExecutor models a worker's cache
// and refuses any op a worker would refuse).
class PrefixCacheTest : public SchedulerTest {
 protected:
  // Runs one request to its end; returns its outcome and sequence id.
  std::pair<Outcome, uint64_t> RunOne(const std::vector<int32_t>& prompt, int max_tokens,
                                      std::vector<std::string> stop = {}) {
    std::shared_ptr<RequestStream> s = Submit(prompt, max_tokens, std::move(stop));
    const Outcome out = Collect(*s);
    const uint64_t id = IdOf(prompt);
    return {out, id};
  }
  // The newest sequence whose plans fed the end of `prompt` (its last token).
  uint64_t IdOf(const std::vector<int32_t>& prompt) {
    uint64_t id = 0;
    for (const auto& [seq, trace] : Traces(exec_.plans())) {
      const uint32_t end = trace.slices.back().slice.start_pos + trace.slices.back().slice.n_tokens;
      if (trace.slices.front().slice.start_pos < prompt.size() && end >= prompt.size()) id = std::max(id, seq);
    }
    return id;
  }
  bool AllReleased() {
    return WaitForStats([&](const SchedulerStats& s) {
      return s.running == 0 && s.waiting == 0 &&
             s.kv_blocks_free + s.kv_blocks_cached == options_.kv_blocks;
    });
  }
};

TEST_F(PrefixCacheTest, SamePromptAttachesItsWholeBlocksAndPrefillsTheRest) {
  Start();
  const std::vector<int32_t> prompt = Prompt(300, 40);  // 2 whole blocks + 8
  const auto [first, id1] = RunOne(prompt, 4);
  ASSERT_TRUE(first.error.ok()) << first.error;
  EXPECT_EQ(first.finish.cached_tokens, 0);
  const auto [second, id2] = RunOne(prompt, 4);
  ASSERT_TRUE(second.error.ok()) << second.error;
  // The 2 whole blocks, and 7 rows copied from the first request's last,
  // partial block (40 + 3 fed): all but the last prompt token.
  EXPECT_EQ(second.finish.cached_tokens, 39);
  EXPECT_EQ(exec_.attached(id2), 2);
  EXPECT_EQ(exec_.copied(id2), 7);
  // The second request's first slice starts after the cached rows.
  const SeqTrace t = Traces(exec_.plans()).at(id2);
  EXPECT_EQ(t.slices.front().slice.start_pos, 39u);
  EXPECT_EQ(t.fed.front(), prompt.back());
  const SchedulerStats st = scheduler_->Stats();
  EXPECT_EQ(st.prefix_hits, 1);
  EXPECT_EQ(st.prefix_misses, 1);
  EXPECT_EQ(st.cached_tokens, 39);
  EXPECT_TRUE(AllReleased());
  exec_.ExpectConsistent(true);
}

TEST_F(PrefixCacheTest, ALastTokenAtABlockEndIsStillComputed) {
  Start();
  const std::vector<int32_t> prompt = Prompt(310, 32);  // exactly 2 blocks
  RunOne(prompt, 3);
  const auto [again, id] = RunOne(prompt, 3);
  ASSERT_TRUE(again.error.ok());
  // The first block whole; the second holds the token whose logits are
  // needed, so only its first 15 rows are copied.
  EXPECT_EQ(again.finish.cached_tokens, 31);
  EXPECT_EQ(exec_.attached(id), 1);
  EXPECT_EQ(exec_.copied(id), 15);
  EXPECT_EQ(Traces(exec_.plans()).at(id).slices.front().slice.start_pos, 31u);
  exec_.ExpectConsistent(true);
}

TEST_F(PrefixCacheTest, TheAnswerIsCachedForTheNextTurn) {
  Start();
  const std::vector<int32_t> turn1 = Prompt(320, 20);
  const auto [a, id1] = RunOne(turn1, 30);  // 20 + 29 fed: 3 whole blocks + 1
  ASSERT_TRUE(a.error.ok());
  std::vector<int32_t> turn2 = turn1;
  turn2.insert(turn2.end(), a.tokens.begin(), a.tokens.end());
  for (int i = 0; i < 10; ++i) turn2.push_back(kFirstPiece + i);
  const auto [b, id2] = RunOne(turn2, 5);
  ASSERT_TRUE(b.error.ok());
  // The answer's last token was never fed: it is the first fed now.
  EXPECT_EQ(b.finish.cached_tokens, 49);
  EXPECT_EQ(exec_.copied(id2), 1);
  EXPECT_EQ(Traces(exec_.plans()).at(id2).fed.front(), a.tokens.back());
  exec_.ExpectConsistent(true);
}

// A prompt that leaves a cached prefix inside a block (an answer that
// tokenizes otherwise as text, an edited question) starts with the rows it
// shares with the cached block there, and prefills from the first token that
// differs.
TEST_F(PrefixCacheTest, APromptThatDivergesInsideABlockCopiesTheRowsItShares) {
  Start();
  const std::vector<int32_t> first = Prompt(390, 50);
  RunOne(first, 4);  // 53 fed: 3 whole blocks + 5 rows
  std::vector<int32_t> second(first.begin(), first.begin() + 45);
  for (int i = 0; i < 15; ++i) second.push_back(kFirstPiece + 100 + i);
  const auto [b, id] = RunOne(second, 3);
  ASSERT_TRUE(b.error.ok()) << b.error;
  EXPECT_EQ(b.finish.cached_tokens, 45);
  EXPECT_EQ(exec_.attached(id), 2);
  EXPECT_EQ(exec_.copied(id), 13);  // of the first's third block
  const SeqTrace t = Traces(exec_.plans()).at(id);
  EXPECT_EQ(t.slices.front().slice.start_pos, 45u);
  EXPECT_EQ(std::vector<int32_t>(t.fed.begin(), t.fed.begin() + 15),
            std::vector<int32_t>(second.begin() + 45, second.end()));
  // Its own blocks from the copy on are published under their own keys: a
  // third prompt equal to it finds all but its last token.
  EXPECT_EQ(RunOne(second, 3).first.finish.cached_tokens, 59);
  // A prompt sharing only part of the first block copies from it too.
  std::vector<int32_t> short_prefix(first.begin(), first.begin() + 5);
  for (int i = 0; i < 8; ++i) short_prefix.push_back(kFirstPiece + 200 + i);
  const auto [c, id_c] = RunOne(short_prefix, 2);
  EXPECT_EQ(c.finish.cached_tokens, 5);
  EXPECT_EQ(exec_.attached(id_c), 0);
  EXPECT_EQ(exec_.copied(id_c), 5);
  EXPECT_TRUE(AllReleased());
  exec_.ExpectConsistent(true);
}

TEST_F(PrefixCacheTest, OffMeansNoAttachNoPublish) {
  options_.prefix_cache = false;
  Start();
  const std::vector<int32_t> prompt = Prompt(330, 40);
  RunOne(prompt, 4);
  const auto [again, id] = RunOne(prompt, 4);
  EXPECT_EQ(again.finish.cached_tokens, 0);
  EXPECT_EQ(exec_.cached_keys(), 0);
  const SchedulerStats st = scheduler_->Stats();
  EXPECT_EQ(st.kv_blocks_cached, 0);
  EXPECT_EQ(st.prefix_hits + st.prefix_misses, 0);
}

TEST_F(PrefixCacheTest, ConcurrentSharersAndOneCancelledMidway) {
  Start();
  const std::vector<int32_t> prompt = Prompt(340, 50);  // 3 whole blocks + 2
  std::shared_ptr<RequestStream> a = Submit(prompt, 200);
  // Once a's prompt is in, its blocks are published and b can share them.
  ASSERT_TRUE(WaitForStats([](const SchedulerStats& s) { return s.kv_blocks_cached >= 3; }));
  std::shared_ptr<RequestStream> b = Submit(prompt, 30);
  std::shared_ptr<RequestStream> c = Submit(prompt, 200);
  ASSERT_TRUE(WaitForStats([](const SchedulerStats& s) { return s.prefix_hits >= 2; }));
  a->Cancel();  // the publisher goes away while others use its blocks
  const Outcome ob = Collect(*b);
  ASSERT_TRUE(ob.error.ok());
  // 3 whole blocks; 49 when a ended before b came (the fake is fast) and
  // left its last, partial block cached.
  EXPECT_GE(ob.finish.cached_tokens, 48);
  EXPECT_LE(ob.finish.cached_tokens, 49);
  c->Cancel();  // a cancelled stream gets no more events: the client has gone
  EXPECT_TRUE(AllReleased());
  exec_.ExpectConsistent(true);
}

// n choices (SubmitChoices): queued together, choice i with seed + i; with
// the prefix cache, choices 1..n-1 wait until choice 0 has sampled, while a
// request queued behind them is admitted, and then attach its prompt's whole
// blocks instead of prefilling them again.
TEST_F(PrefixCacheTest, ChoicesWaitForTheFirstsPrefillAndShareIt) {
  options_.max_step_tokens = 16;  // the prompt takes choice 0 several steps
  Start();
  const std::vector<int32_t> prompt = Prompt(360, 52);  // 3 whole blocks + 4
  // The choices and a request behind them are all queued before the step
  // that admits them: the steps wait while a first request's step runs.
  exec_.Hold();
  std::shared_ptr<RequestStream> first = Submit(Prompt(359, 4), 1);
  ASSERT_TRUE(exec_.WaitForRuns(1));
  GenerateOptions o;
  o.prompt = prompt;
  o.max_tokens = 6;
  o.sampling = {.temperature = 0.7f, .top_k = 40, .top_p = 0.95f};
  o.seed = 1234;
  o.source = "test";
  absl::StatusOr<std::vector<std::shared_ptr<RequestStream>>> choices = scheduler_->SubmitChoices(o, 3);
  ASSERT_TRUE(choices.ok()) << choices.status();
  ASSERT_EQ(choices->size(), 3u);
  std::shared_ptr<RequestStream> other = Submit(Prompt(361, 8), 3);
  ASSERT_TRUE(WaitForStats([](const SchedulerStats& s) { return s.waiting == 4; }));
  exec_.Release();
  std::vector<Outcome> out;
  for (const auto& c : *choices) out.push_back(Collect(*c));
  EXPECT_TRUE(Collect(*other).error.ok());
  EXPECT_TRUE(Collect(*first).error.ok());
  for (const Outcome& x : out) ASSERT_TRUE(x.error.ok()) << x.error;
  // From the plans: the request behind the held choices ran by the step in
  // which choice 0 sampled (the steps' token budget went to choice 0's
  // prompt first), and choices 1, 2 only after it.
  {
    const std::map<uint64_t, SeqTrace> t = Traces(exec_.plans());
    const uint64_t c0 = SeqIdOf(exec_.plans(), 360).value(), behind = SeqIdOf(exec_.plans(), 361).value();
    size_t sampled_at = 0;
    for (size_t i = 0; i < t.at(c0).slices.size(); ++i) {
      if (t.at(c0).slices[i].sample) {
        sampled_at = t.at(c0).plan_index[i];
        break;
      }
    }
    EXPECT_LE(t.at(behind).plan_index.front(), sampled_at) << "the request behind the choices waited for them";
    for (uint64_t c : {c0 + 1, c0 + 2}) {
      ASSERT_TRUE(t.contains(c)) << "choice ids follow choice 0's";
      EXPECT_GT(t.at(c).plan_index.front(), sampled_at) << "a choice ran before choice 0 sampled";
    }
  }
  EXPECT_EQ(out[0].finish.cached_tokens, 0);
  EXPECT_GE(out[1].finish.cached_tokens, 48) << "choice 1 prefilled the prompt again";
  EXPECT_GE(out[2].finish.cached_tokens, 48) << "choice 2 prefilled the prompt again";
  // Choice i samples as a request of seed 1234 + i alone: its draws are that
  // seed's.
  std::map<uint64_t, SeqTrace> traces = Traces(exec_.plans());
  std::vector<std::vector<float>> draws;
  for (const auto& [id, t] : traces) {
    // (Choices 1, 2 feed the prompt from where their cached rows end.)
    const size_t start = t.slices.front().slice.start_pos;
    if (start >= prompt.size() || t.fed.size() < prompt.size() - start ||
        !std::equal(prompt.begin() + start, prompt.end(), t.fed.begin())) {
      continue;
    }
    std::vector<float> u;
    for (const shm::PlanSeq& p : t.slices) {
      if (p.sample) u.push_back(p.u);
    }
    draws.push_back(u);
  }
  ASSERT_EQ(draws.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    GenerateOptions alone = o;
    alone.seed = 1234 + i;
    absl::StatusOr<std::shared_ptr<RequestStream>> s = scheduler_->Submit(alone);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(Collect(**s).error.ok());
    // (The traces held in a variable: a range-for over a member of a
    // temporary would read it after it is destroyed.)
    const std::map<uint64_t, SeqTrace> now = Traces(exec_.plans());
    std::vector<float> u;
    for (const shm::PlanSeq& p : now.rbegin()->second.slices) {
      if (p.sample) u.push_back(p.u);
    }
    EXPECT_EQ(u, draws[i]) << "choice " << i;
  }
  EXPECT_NE(draws[0], draws[1]);
  EXPECT_TRUE(AllReleased());
  exec_.ExpectConsistent(true);
}

// Choices are queued all or none: a queue without room for every one takes
// none (ResourceExhausted), more than it can ever hold is InvalidArgument;
// a choice 0 cancelled before its first token releases the others.
TEST_F(PrefixCacheTest, ChoicesAreQueuedTogetherAndNeverWaitForAGoneFirst) {
  options_.max_batch = 1;
  Start();
  exec_.Hold();
  std::shared_ptr<RequestStream> running = Submit(Prompt(370, 20), 3);
  ASSERT_TRUE(exec_.WaitForRuns(1));
  for (int i = 0; i < 5; ++i) Submit(Prompt(371 + i, 20), 3);
  ASSERT_TRUE(WaitForStats([](const SchedulerStats& s) { return s.waiting == 5; }));
  GenerateOptions o;
  o.prompt = Prompt(380, 40);
  o.max_tokens = 4;
  EXPECT_EQ(scheduler_->SubmitChoices(o, 4).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(scheduler_->Stats().waiting, 5) << "some choices were queued";
  EXPECT_EQ(scheduler_->SubmitChoices(o, 9).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::vector<std::shared_ptr<RequestStream>>> choices = scheduler_->SubmitChoices(o, 3);
  ASSERT_TRUE(choices.ok()) << choices.status();
  EXPECT_EQ(scheduler_->Stats().waiting, 8);
  (*choices)[0]->Cancel();
  exec_.Release();
  for (size_t i = 1; i < 3; ++i) {
    const Outcome c = Collect(*(*choices)[i]);
    EXPECT_TRUE(c.error.ok()) << c.error;
    EXPECT_EQ(c.tokens.size(), 4u) << "choice " << i;
  }
  EXPECT_TRUE(AllReleased());
  exec_.ExpectConsistent(true);
}

TEST_F(PrefixCacheTest, EveryWayOfEndingLeavesTheCountsRight) {
  Start();
  const std::vector<int32_t> prompt = Prompt(350, 40);
  RunOne(prompt, 3);
  // max_tokens, a stop string, an end-of-sequence token, a cancellation, a
  // failed step: each attaches the cached blocks and releases them.
  RunOne(prompt, 5);
  exec_.SetTokenFn([](uint64_t, uint32_t, int nth) { return nth == 1 ? kEos : kFirstPiece + 7; });
  const auto [eos, id_eos] = RunOne(prompt, 10);
  EXPECT_EQ(eos.finish.reason, FinishReason::kStopToken);
  exec_.SetTokenFn(nullptr);
  const std::string stop = Tok().TokenBytes(prompt.back(), DefaultToken(0, 0, 0));
  const int64_t steps_before = scheduler_->Stats().steps;
  std::shared_ptr<RequestStream> cancelled = Submit(prompt, 500);
  ASSERT_TRUE(WaitForStats([&](const SchedulerStats& s) { return s.steps >= steps_before + 8; }));
  cancelled->Cancel();
  ASSERT_TRUE(WaitForStats([](const SchedulerStats& s) { return s.running == 0; }));
  exec_.FailAtRun(exec_.runs() + 1, absl::InternalError("injected step failure"));
  const auto [failed, id_failed] = RunOne(prompt, 5);
  EXPECT_FALSE(failed.error.ok());
  EXPECT_FALSE(scheduler_->broken());  // a failed step ends its requests only
  EXPECT_TRUE(AllReleased());
  exec_.ExpectConsistent(true);
  EXPECT_GE(scheduler_->Stats().prefix_hits, 4);
}

// An answer the coordinator cannot use (logits that were not finite, a token
// outside the vocabulary) ends that request with an error naming why and
// publishes none of its blocks: its KV may hold the overflow. The other
// requests go on, and every block comes back.
TEST_F(PrefixCacheTest, AnUnusableAnswerEndsOnlyItsRequestAndPublishesNothing) {
  Start();
  const std::vector<int32_t> overflowed = Prompt(360, 40), outside = Prompt(361, 41), fine = Prompt(362, 42);
  exec_.SetTokenFn([](uint64_t seq, uint32_t last_pos, int nth) {
    if (last_pos == 39) return kNotFinite;
    if (last_pos == 40 && nth == 0) return Tok().vocab_size();
    return DefaultToken(seq, last_pos, nth);
  });
  std::shared_ptr<RequestStream> a = Submit(overflowed, 5), b = Submit(outside, 5), c = Submit(fine, 5);
  const Outcome oa = Collect(*a), ob = Collect(*b), oc = Collect(*c);
  EXPECT_EQ(oa.error.code(), absl::StatusCode::kInternal) << oa.error;
  EXPECT_THAT(std::string(oa.error.message()), HasSubstr("logits at position 39 are not finite"));
  EXPECT_TRUE(oa.tokens.empty());
  EXPECT_EQ(ob.error.code(), absl::StatusCode::kInternal) << ob.error;
  EXPECT_THAT(std::string(ob.error.message()), HasSubstr("outside the vocabulary"));
  EXPECT_TRUE(ob.tokens.empty());
  ASSERT_TRUE(oc.error.ok()) << oc.error;
  EXPECT_EQ(oc.tokens.size(), 5u);
  EXPECT_TRUE(AllReleased());
  exec_.ExpectConsistent(true);

  // Asked again, the failed prompts find nothing cached; the good one all but
  // its last token (2 blocks and 9 rows of its last, partial one).
  exec_.SetTokenFn(nullptr);
  EXPECT_EQ(RunOne(overflowed, 2).first.finish.cached_tokens, 0);
  EXPECT_EQ(RunOne(outside, 2).first.finish.cached_tokens, 0);
  EXPECT_EQ(RunOne(fine, 2).first.finish.cached_tokens, 41);
  EXPECT_TRUE(AllReleased());
  exec_.ExpectConsistent(true);
}

TEST_F(PrefixCacheTest, EvictsLeastRecentlyUsedUnreferencedBlocksOnlyWhenRoomIsNeeded) {
  options_.kv_blocks = 8;
  Start();
  // Three prompts of 2 whole blocks each fill 6 blocks of cache.
  for (int32_t first : {360, 361, 362}) RunOne(Prompt(first, 32), 1);
  EXPECT_TRUE(AllReleased());
  EXPECT_EQ(scheduler_->Stats().kv_blocks_cached, 6);
  EXPECT_EQ(exec_.evicted(), 0);
  // Touch 360 again (its first block, and 15 rows copied from its second) so
  // 361 is the least recently used.
  RunOne(Prompt(360, 32), 1);
  EXPECT_EQ(scheduler_->Stats().kv_blocks_cached, 6);
  // A request of 4 blocks: 2 free + evict 2 (361's chain: deepest first).
  const auto [big, id] = RunOne(Prompt(370, 60), 1);
  ASSERT_TRUE(big.error.ok());
  EXPECT_EQ(exec_.evicted(), 2);
  EXPECT_EQ(RunOne(Prompt(360, 32), 1).first.finish.cached_tokens, 31);  // kept
  EXPECT_EQ(RunOne(Prompt(361, 32), 1).first.finish.cached_tokens, 0);   // evicted
  exec_.ExpectConsistent(true);
}

// A partial hit holds its source block only until the workers have copied
// it: a request that needs the whole pool still runs (it waited for ever, and
// every request behind it), and two that fill the pool together run side by
// side as they do without the cache (they ran one after the other).
TEST_F(PrefixCacheTest, APartialHitNeverCostsARequestItsRoom) {
  options_.kv_blocks = 8;  // 128 positions
  Start();
  RunOne(Prompt(420, 5), 1);  // leaves a cached partial block of 5 rows
  ASSERT_TRUE(AllReleased());
  ASSERT_EQ(scheduler_->Stats().kv_blocks_cached, 1);
  // Sharing its first 4 tokens: prompt 100 + 28 = the whole pool.
  std::vector<int32_t> whole = Prompt(420, 4);
  for (int i = 0; i < 96; ++i) whole.push_back(kFirstPiece + 50 + i % 100);
  std::shared_ptr<RequestStream> big = Submit(whole, 28);
  std::shared_ptr<RequestStream> small = Submit(Prompt(421, 3), 2);
  const Outcome b = Collect(*big);
  ASSERT_TRUE(b.finished && b.error.ok()) << b.error;
  EXPECT_EQ(b.tokens.size(), 28u);
  const Outcome s = Collect(*small);
  EXPECT_TRUE(s.finished && s.error.ok()) << s.error;
  ASSERT_TRUE(AllReleased());

  // Two of 4 blocks each, both with a partial hit on the same cached block.
  RunOne(Prompt(430, 5), 1);
  ASSERT_TRUE(AllReleased());
  // The second arrives while the first's prefill step runs (held), after
  // the first's copy was flushed to the workers.
  std::vector<std::shared_ptr<RequestStream>> pair;
  const int runs = static_cast<int>(exec_.plans().size());
  exec_.Hold();
  for (int k = 0; k < 2; ++k) {
    std::vector<int32_t> p = Prompt(430, 4);
    for (int i = 0; i < 36; ++i) p.push_back(kFirstPiece + 100 + k * 50 + i);
    pair.push_back(Submit(p, 24));  // 40 + 24 = 64 positions: 4 blocks
    if (k == 0) {
      ASSERT_TRUE(exec_.WaitForRuns(runs + 1));
    }
  }
  exec_.Release();
  for (auto& stream : pair) {
    const Outcome o = Collect(*stream);
    ASSERT_TRUE(o.finished && o.error.ok()) << o.error;
  }
  const std::map<uint64_t, SeqTrace> traces = Traces(exec_.plans());
  std::vector<std::pair<size_t, size_t>> spans;  // plans each of the last two sequences ran in
  for (auto it = traces.rbegin(); it != traces.rend() && spans.size() < 2; ++it) {
    spans.push_back({it->second.plan_index.front(), it->second.plan_index.back()});
  }
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_TRUE(spans[0].first <= spans[1].second && spans[1].first <= spans[0].second)
      << "the two ran one after the other: plans " << spans[1].first << "-" << spans[1].second << " then "
      << spans[0].first << "-" << spans[0].second;
  EXPECT_TRUE(AllReleased());
  exec_.ExpectConsistent(true);
}

TEST_F(PrefixCacheTest, AFailedKvUpdateBreaksTheScheduler) {
  Start();
  const auto [first, id] = RunOne(Prompt(380, 40), 2);
  ASSERT_TRUE(exec_.WaitForFree(id));
  exec_.FailKvUpdates();
  std::shared_ptr<RequestStream> s = Submit(Prompt(380, 40), 4);  // attaches: an update
  const Outcome out = Collect(*s);
  EXPECT_EQ(out.error.code(), absl::StatusCode::kUnavailable) << out.error;
  EXPECT_TRUE(scheduler_->broken());
}

// With a KV store, requests that continue stored prefixes each have their
// blocks loaded before they are admitted, one load at a time. Requests that
// queue while a load runs get theirs in turn: each is served its stored
// blocks, and every reserved block comes back to the pool (a second load
// used to overwrite the first one's reservation, and its blocks were lost).
TEST_F(PrefixCacheTest, QueuedRequestsEachLoadTheirStoredBlocksAndNoBlockIsLost) {
  options_.kv_store = true;
  Start();
  const int bt = options_.kv_block_tokens;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<PrefixCache::Block> stored;
  for (int32_t first : {300, 301, 302}) {
    prompts.push_back(Prompt(first, 2 * bt + 8));  // 2 whole blocks on disk, then 8 tokens
    uint64_t parent = 0;
    for (int b = 0; b < 2; ++b) {
      const int32_t* t = prompts.back().data() + b * bt;
      const uint64_t key = ChainKey(parent, t, bt);
      stored.push_back({key, parent, std::vector<int32_t>(t, t + bt)});
      parent = key;
    }
  }
  scheduler_->AddStored(stored, 1000);
  exec_.HoldLoads(true);
  std::vector<std::shared_ptr<RequestStream>> streams;
  streams.push_back(Submit(prompts[0], 4));
  ASSERT_TRUE(exec_.WaitForLoads(1));  // the first load runs; the others queue behind it
  streams.push_back(Submit(prompts[1], 4));
  streams.push_back(Submit(prompts[2], 4));
  exec_.HoldLoads(false);
  for (size_t i = 0; i < streams.size(); ++i) {
    const Outcome out = Collect(*streams[i]);
    ASSERT_TRUE(out.error.ok()) << out.error;
    EXPECT_EQ(out.finish.cached_tokens, 2 * bt) << "request " << i << " was served its stored blocks";
  }
  EXPECT_TRUE(AllReleased()) << "free " << scheduler_->Stats().kv_blocks_free << " + cached "
                             << scheduler_->Stats().kv_blocks_cached << " of " << options_.kv_blocks;
  EXPECT_EQ(scheduler_->Stats().stored_loaded, 6);
  exec_.ExpectConsistent(/*all_freed=*/true);
}

TEST(PrefixCacheIndex, ChainKeysLookupAndLeafFirstEviction) {
  PrefixCache cache(4);
  const std::vector<int32_t> t = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const uint64_t k0 = ChainKey(0, t.data(), 4), k1 = ChainKey(k0, t.data() + 4, 4);
  EXPECT_NE(k0, k1);
  EXPECT_NE(ChainKey(1, t.data(), 4), k0);  // the parent is part of the key
  EXPECT_TRUE(cache.Lookup(t, 3).empty());
  ASSERT_TRUE(cache.Insert(k0, 0, t.data()));
  ASSERT_TRUE(cache.Insert(k1, k0, t.data() + 4));
  EXPECT_FALSE(cache.Insert(k1, k0, t.data() + 4));
  EXPECT_EQ(cache.Lookup(t, 3), (std::vector<uint64_t>{k0, k1}));
  EXPECT_EQ(cache.Lookup(t, 1), (std::vector<uint64_t>{k0}));
  std::vector<int32_t> other = t;
  other[5] = 99;  // differs in the second block
  EXPECT_EQ(cache.Lookup(other, 3), (std::vector<uint64_t>{k0}));
  EXPECT_EQ(cache.evictable(), 0);  // both referenced by their publisher
  EXPECT_TRUE(cache.Evict(5).empty());
  cache.Release({k0, k1});
  EXPECT_EQ(cache.evictable(), 2);
  EXPECT_EQ(cache.Evict(1), (std::vector<uint64_t>{k1}));  // the deeper block first
  EXPECT_EQ(cache.Lookup(t, 3), (std::vector<uint64_t>{k0}));
  cache.Acquire({k0});
  EXPECT_TRUE(cache.Evict(1).empty());
  EXPECT_EQ(cache.refs(k0), 1);
  EXPECT_EQ(cache.refs(k1), -1);
}

// Partial blocks: the child of a block (whole or partial) that shares the
// most leading tokens with what follows; a partial entry never continues a
// whole-block lookup; an evicted child is no longer offered.
TEST(PrefixCacheIndex, LongestPartialPicksTheChildSharingMostTokens) {
  PrefixCache cache(4);
  const std::vector<int32_t> t = {1, 2, 3, 4, 5, 6, 7, 8};
  const uint64_t k0 = ChainKey(0, t.data(), 4);
  ASSERT_TRUE(cache.Insert(k0, 0, t.data()));
  EXPECT_EQ(cache.LongestPartial(k0, t.data() + 4, 4).rows, 0);  // no children yet
  const std::vector<int32_t> a = {5, 6, 9}, b = {5, 6, 7, 9};
  const uint64_t ka = ChainKey(k0, a.data(), 3), kb = ChainKey(k0, b.data(), 4);
  EXPECT_NE(ka, ChainKey(k0, a.data(), 2));  // the length is part of the key
  ASSERT_TRUE(cache.Insert(ka, k0, a.data(), 3));
  ASSERT_TRUE(cache.Insert(kb, k0, b.data()));
  PrefixCache::Partial p = cache.LongestPartial(k0, t.data() + 4, 4);
  EXPECT_EQ(p.key, kb);
  EXPECT_EQ(p.rows, 3);
  EXPECT_EQ(cache.LongestPartial(k0, t.data() + 4, 2).rows, 2);  // at most n
  EXPECT_EQ(cache.LongestPartial(0, t.data(), 4).key, k0);
  // A partial entry is never a whole block of a lookup, even of its tokens.
  const std::vector<int32_t> with_a = {1, 2, 3, 4, 5, 6, 9, 0};
  EXPECT_EQ(cache.Lookup(with_a, 2), (std::vector<uint64_t>{k0}));
  EXPECT_EQ(cache.LongestPartial(k0, with_a.data() + 4, 4).key, ka);
  cache.Release({ka});  // the oldest stamp: evicted first
  cache.Release({k0, kb});
  EXPECT_EQ(cache.Evict(1), (std::vector<uint64_t>{ka}));
  EXPECT_EQ(cache.LongestPartial(k0, with_a.data() + 4, 4).key, kb);
  EXPECT_EQ(cache.LongestPartial(k0, with_a.data() + 4, 4).rows, 2);
  EXPECT_EQ(cache.Evict(2), (std::vector<uint64_t>{kb, k0}));
  EXPECT_EQ(cache.LongestPartial(k0, t.data() + 4, 4).rows, 0);
  EXPECT_EQ(cache.LongestPartial(0, t.data(), 4).rows, 0);
}

// Among many siblings (as the first blocks of many different prompts are),
// LongestPartial finds as long a shared run as a scan of all of them does.
TEST(PrefixCacheIndex, LongestPartialAmongManySiblingsMatchesAFullScan) {
  constexpr int kBt = 8;
  PrefixCache cache(kBt);
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> tok(0, 3);  // few values: long shared runs
  std::uniform_int_distribution<int> len(1, kBt);
  std::vector<std::vector<int32_t>> kids;
  for (int i = 0; i < 2000; ++i) {
    std::vector<int32_t> t(len(rng));
    for (int32_t& x : t) x = tok(rng);
    if (cache.Insert(ChainKey(42, t.data(), static_cast<int>(t.size())), 42, t.data(), static_cast<int>(t.size()))) {
      kids.push_back(t);
    }
  }
  for (int q = 0; q < 500; ++q) {
    std::vector<int32_t> query(len(rng));
    for (int32_t& x : query) x = tok(rng);
    const int n = static_cast<int>(query.size());
    int want = 0;
    for (const std::vector<int32_t>& t : kids) {
      int r = 0;
      while (r < n && r < static_cast<int>(t.size()) && t[r] == query[r]) ++r;
      want = std::max(want, r);
    }
    const PrefixCache::Partial got = cache.LongestPartial(42, query.data(), n);
    ASSERT_EQ(got.rows, want) << "query " << q;
    EXPECT_EQ(cache.LongestPartial(7, query.data(), n).rows, 0);  // another parent's
  }
}

// The stored tier mirrors the workers' stores: bounded by their capacity,
// the least recently stored forgotten first, so it neither grows without
// bound nor lists many blocks the stores have deleted.
TEST(PrefixCacheIndex, TheStoredTierKeepsTheStoresCapacityLeastRecentFirst) {
  PrefixCache cache(4);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<PrefixCache::Block> blocks;
  for (int p = 0; p < 4; ++p) {
    prompts.push_back({10 * p + 1, 10 * p + 2, 10 * p + 3, 10 * p + 4, 0});
    blocks.push_back({ChainKey(0, prompts[p].data(), 4), 0, {prompts[p].begin(), prompts[p].begin() + 4}});
  }
  auto listed = [&](int p) { return cache.LookupStored(prompts[p], {}, 1).size() == 1; };
  cache.SetStoredCapacity(3);
  for (int p = 0; p < 3; ++p) cache.AddStored(blocks[p]);
  EXPECT_EQ(cache.stored(), 3);
  cache.AddStored(blocks[0]);  // stored again: now the most recent
  cache.AddStored(blocks[3]);  // over capacity: 1 goes
  EXPECT_EQ(cache.stored(), 3);
  EXPECT_TRUE(listed(0));
  EXPECT_FALSE(listed(1));
  EXPECT_TRUE(listed(2));
  EXPECT_TRUE(listed(3));
  cache.SetStoredCapacity(1);  // a smaller store: only the most recent stays
  EXPECT_EQ(cache.stored(), 1);
  EXPECT_TRUE(listed(3));
  cache.RemoveStored(blocks[3].key);
  EXPECT_EQ(cache.stored(), 0);
}

}  // namespace
}  // namespace ellm::coord

namespace ellm::coord {
namespace {

// Recovery (SchedulerOptions::recover): a worker failure pauses every
// request, the executor recovers, and each request resumes by prefilling its
// prompt and generated tokens: the tokens it streams are those of a run
// without the failure, none lost or repeated.
class RecoveryTest : public SchedulerTest {
 protected:
  void SetUp() override {
    SchedulerTest::SetUp();
    options_.recover = true;
  }
};

TEST_F(RecoveryTest, RequestsResumeWithTheTokensOfARunWithoutTheFailure) {
  std::vector<Outcome> expected;
  {
    Start();
    for (int32_t first : {300, 301, 302}) expected.push_back(Collect(*Submit(Prompt(first, 40), 30)));
    scheduler_.reset();
  }
  FakeExecutor faulty;
  Scheduler scheduler(options_, Tok(), &faulty);
  std::vector<bool> recovering_calls;
  scheduler.on_recovering = [&](bool r) { recovering_calls.push_back(r); };
  faulty.FailAtRun(12, absl::UnavailableError("the mlp-worker (pid 1) has exited"));
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int32_t first : {300, 301, 302}) {
    GenerateOptions o;
    o.prompt = Prompt(first, 40);
    o.max_tokens = 30;
    o.sampling = {.temperature = 0.7f, .top_k = 40, .top_p = 0.95f};
    o.seed = 1234;
    streams.push_back(*scheduler.Submit(o));
  }
  for (size_t i = 0; i < streams.size(); ++i) {
    const Outcome out = Collect(*streams[i]);
    ASSERT_TRUE(out.error.ok()) << out.error;
    EXPECT_EQ(out.tokens, expected[i].tokens) << i;
    EXPECT_EQ(out.text, expected[i].text) << i;
    EXPECT_EQ(out.finish.completion_tokens, 30);
  }
  EXPECT_EQ(faulty.recovers(), 1);
  EXPECT_EQ(scheduler.Stats().recoveries, 1);
  EXPECT_FALSE(scheduler.broken());
  EXPECT_EQ(recovering_calls, (std::vector<bool>{true, false}));
  // After the failure each request was prefilled again from position 0 with
  // its prompt and the tokens it had: its plans restart at 0 once.
  int restarts = 0;
  for (const auto& [id, trace] : Traces(faulty.plans())) {
    for (size_t k = 1; k < trace.slices.size(); ++k) restarts += trace.slices[k].slice.start_pos == 0;
  }
  EXPECT_EQ(restarts, 3);
  faulty.ExpectConsistent(true);
  scheduler.Stop();
}

// A request resumed after a worker failure is admitted again, but counted
// once: its queue wait is the wait for its first admission (the pause for
// the recovery was booked as queue wait), its prompt counted once.
TEST_F(RecoveryTest, AResumedRequestCountsItsQueueWaitAndPromptOnce) {
  Metrics metrics;
  options_.metrics = &metrics;
  exec_.SetRecoverDelay(absl::Milliseconds(400));
  exec_.FailAtRun(5, absl::UnavailableError("the mlp-worker (pid 1) has exited"));
  Start();
  const Outcome out = Collect(*Submit(Prompt(330, 40), 30));
  ASSERT_TRUE(out.error.ok()) << out.error;
  ASSERT_EQ(exec_.recovers(), 1);
  EXPECT_LT(out.finish.queue_ms, 200) << "the recovery's 400 ms counted as queue wait";
  const std::string text = metrics.Render(scheduler_->Stats(), {});
  EXPECT_EQ(Sample(text, "ellm_queue_wait_seconds_count"), 1) << text;
  EXPECT_LT(Sample(text, "ellm_queue_wait_seconds_sum"), 0.2) << text;
  EXPECT_EQ(Sample(text, "ellm_prompt_tokens_total"), 40) << text;
  EXPECT_EQ(Sample(text, "ellm_time_to_first_token_seconds_count"), 1) << text;
  // One request: one hit or miss (its resume after the failure counted a
  // second one).
  const SchedulerStats st = scheduler_->Stats();
  EXPECT_EQ(st.prefix_hits + st.prefix_misses, 1) << st.prefix_hits << " hits, " << st.prefix_misses << " misses";
}

// A restarted worker's byte counter starts from 0 again: the read rate is
// what it read since its start (it read as 0, however much that was).
TEST(Metrics, ReadRatesAfterAWorkerRestart) {
  Metrics metrics;
  const SchedulerStats stats;
  auto rate = [&](int64_t kv_bytes) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    Metrics::WorkerSample w;
    w.name = "attn-0";
    w.attention = true;
    w.kv_read_bytes = kv_bytes;
    w.probe_bytes_per_second = 1e9;
    return Sample(metrics.Render(stats, {w}), "ellm_kv_read_bytes_per_second{worker=\"attn-0\"}");
  };
  EXPECT_EQ(rate(1'000'000), 0) << "no earlier scrape";
  const double steady = rate(6'000'000);
  EXPECT_GT(steady, 0);
  EXPECT_LE(steady, 5'000'000 / 0.05);
  const double restarted = rate(3'000'000);  // less than before: counting from 0 again
  EXPECT_GT(restarted, 0);
  EXPECT_LE(restarted, 3'000'000 / 0.05);
}

TEST_F(RecoveryTest, WorkerFailedPausesIdleRequestsAndRecoversToo) {
  Start();
  scheduler_->WorkerFailed(absl::UnavailableError("attn-worker 0 froze"));
  ASSERT_TRUE(WaitForStats([&](const SchedulerStats& s) { return s.recoveries == 1; }));
  const Outcome out = Collect(*Submit(Prompt(310, 10), 5));
  EXPECT_TRUE(out.error.ok()) << out.error;
  EXPECT_EQ(exec_.recovers(), 1);
}

TEST_F(RecoveryTest, ARecoveryThatFailsEndsEveryRequest) {
  exec_.SetRecoverStatus(absl::UnavailableError("the workers did not come back within 5m"));
  exec_.FailAtRun(3, absl::DeadlineExceededError("step 3 took longer than its deadline"));
  Start();
  const Outcome out = Collect(*Submit(Prompt(320, 10), 50));
  EXPECT_EQ(out.error.code(), absl::StatusCode::kUnavailable) << out.error;
  EXPECT_NE(std::string(out.error.message()).find("did not come back"), std::string::npos) << out.error;
  EXPECT_TRUE(scheduler_->broken());
}

// The step deadline follows the step's work: its tokens, and the positions
// they attend. A chunk far out in the context after short steps (a prompt
// that hits a long cached prefix) gets the time its attention needs.
TEST(StepDeadline, ScalesWithTokensAndAttendedPositions) {
  shm::StepPlan plan;
  plan.seqs.resize(2);
  plan.seqs[0].slice = {1, 10, 3};  // attends 11 + 12 + 13
  plan.seqs[1].slice = {2, 0, 1};   // attends 1
  EXPECT_DOUBLE_EQ(AttendedPositions(plan), 37);

  const absl::Duration min = absl::Seconds(2);
  std::deque<StepCost> recent;
  EXPECT_EQ(StepDeadline(recent, 1, 100, min), absl::Seconds(60));  // nothing seen yet
  for (int i = 0; i < 100; ++i) recent.push_back({0.010, 1, 1000});  // decode at 1000 positions
  EXPECT_EQ(StepDeadline(recent, 1, 1000, min), min);               // 10 x (10 + 10 ms)
  // 256 tokens at 16K: per token 2.56 s, and per attended position (at most
  // 10 us, the decode steps') 41.9 s more.
  const double far = 256.0 * 16384 + 256.0 * 257 / 2;
  EXPECT_NEAR(absl::ToDoubleSeconds(StepDeadline(recent, 256, far, min)), 10 * (2.56 + 1e-5 * far), 1e-6);
  // A long step seen bounds the time per position more tightly (the p99s
  // of 101 steps are still the decode steps').
  recent.push_back({4.0, 256, far});
  EXPECT_NEAR(absl::ToDoubleSeconds(StepDeadline(recent, 256, far, min)), 10 * (2.56 + 4.0), 1e-6);
}

}  // namespace
}  // namespace ellm::coord
