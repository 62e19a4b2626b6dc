// Scheduler: admission, continuous batching and the step loop of the
// coordinator, free of transport types. Requests join the running batch at
// the next step (their prompt in chunks of the step's token budget) and leave
// it when they finish; every step is one StepExecutor::Run.
//
// Prefix cache (SchedulerOptions::prefix_cache): a request starts with the
// longest run of cached whole KV blocks that matches its prompt, then the
// rows of the next block that it shares with a cached block (copied into a
// block of its own), never its last prompt token, and prefills only the
// rest. A sequence's full blocks are published to the cache when its prompt
// is in, and when it ends its full and its last, partial block (its answer's
// too, for the next turn of a conversation). KV accounting: the pool holds every running sequence's own
// reserved blocks (prompt + max_tokens, less what it attached) and one block
// per cached entry; unreferenced entries are evicted, least recently used
// first, only when an admission needs their room, so caching never costs
// capacity. Every decision reaches the attention workers as KvOps, flushed
// (StepExecutor::UpdateKv) before the next step.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "coordinator/metrics.h"
#include "coordinator/prefix_cache.h"
#include "coordinator/request_stream.h"
#include "coordinator/text_output.h"
#include "core/kv_ops.h"
#include "core/sampler.h"
#include "core/tokenizer.h"
#include "shm/messages.h"

namespace ellm::coord {

// Runs steps on the workers (the rings in production, a fake in tests).
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual absl::StatusOr<std::vector<shm::SampledSeq>> Run(uint64_t step,
                                                           const shm::StepPlan& plan) = 0;
  // The server stops: a step in flight may stop waiting for its result
  // (Cancelled), e.g. on workers that no longer answer.
  virtual void Abandon() {}
  // Applies the scheduler's KV operations (publish, free, evict, attach) on
  // every attention worker. Any failure means a worker's KV no longer
  // matches the scheduler's view.
  virtual absl::Status UpdateKv(const KvOps& ops) = 0;
  // KV store: loads stored blocks (in order) into every attention worker's
  // cache as cached, unreferenced blocks; returns how many of the first
  // keys every worker loaded.
  virtual absl::StatusOr<int> LoadBlocks(const std::vector<uint64_t>& keys) { return 0; }
  // After a worker failure: returns once a fresh set of workers serves
  // (empty KV caches), or an error when none will (then the scheduler
  // fails every request). The default cannot recover.
  virtual absl::Status Recover() { return absl::UnavailableError("this executor cannot recover"); }
  // Benchmarks: gives a new sequence `positions` positions of random K/V.
  virtual absl::Status FillSynthetic(uint64_t id, int positions) {
    return absl::UnimplementedError("synthetic context is not supported by this executor");
  }
};

struct SchedulerOptions {
  int max_batch = 16;            // sequences in one step
  int max_step_tokens = 256;     // tokens in one step (prefill chunks + decodes)
  int64_t kv_blocks = 0;         // KV blocks each attention worker holds
  int kv_block_tokens = 16;
  int max_queue = 64;            // requests waiting for admission
  int context_length = 0;
  bool prefix_cache = true;      // share whole KV blocks of equal prompt prefixes
  bool kv_store = false;         // the workers keep published blocks on disk (--kv-store)
  // A worker failure (Unavailable or DeadlineExceeded from the executor, or
  // WorkerFailed) pauses every request, waits for StepExecutor::Recover, and
  // resumes each by prefilling its prompt and the tokens it already has.
  // Off: such a failure ends every request and the scheduler stays broken.
  bool recover = false;
  Metrics* metrics = nullptr;    // observations of every request (none: not recorded)
};

struct GenerateOptions {
  std::vector<int32_t> prompt;
  int max_tokens = 0;
  SamplingParams sampling;
  std::vector<TokenBias> logit_bias;  // by increasing token id, at most kMaxLogitBias
  uint64_t seed = 0;
  std::vector<std::string> stop;
  // vLLM's: tokens to generate before one that would stop it (end of
  // generation, a stop token id) may be sampled and before stop strings are
  // looked for; at most max_tokens.
  int min_tokens = 0;
  bool ignore_eos = false;               // the model's end-of-generation tokens do not stop it
  // Score the prompt: the first event carries the log-probability of each
  // prompt token after the first (with sampling.top_logprobs alternatives).
  // Such a request prefills its whole prompt: it attaches no cached blocks.
  bool prompt_logprobs = false;
  std::vector<int32_t> stop_token_ids;   // more tokens that stop it, sorted, distinct
  // The text ends with the stop string, or the stop token id's text, that
  // ended it (without: just before).
  bool include_stop_str_in_output = false;
  int synthetic_context = 0;  // benchmarks: random K/V positions before the prompt
  double tokenize_ms = 0;     // time the service took to tokenize the prompt (for the log)
  // Who asked, for the log lines of the request: "HTTP cmpl-…" (the id its
  // answer carries), "gRPC ipv4:…" (the peer). Empty: not said.
  std::string source;
};

struct SchedulerStats {
  int running = 0;
  int waiting = 0;
  int64_t kv_blocks_free = 0;    // neither reserved nor cached
  int64_t kv_blocks_cached = 0;  // prefix-cache entries (referenced or not)
  int64_t steps = 0;
  int64_t recoveries = 0;        // worker failures recovered from
  int64_t prefix_hits = 0;       // admitted requests that started with cached blocks
  int64_t prefix_misses = 0;     // admitted requests that found none (cache on)
  int64_t cached_tokens = 0;     // prompt tokens served from the cache, in all
  int64_t stored_blocks = 0;     // blocks the KV store holds (as the coordinator knows)
  int64_t stored_loaded = 0;     // blocks loaded back from the KV store, in all
};

class Scheduler {
 public:
  Scheduler(const SchedulerOptions& options, const Tokenizer& tokenizer, StepExecutor* executor);
  ~Scheduler();

  // Queues a request. ResourceExhausted when it can never fit the KV budget or
  // the queue is full; Unavailable once the workers have failed. Every
  // refusal is logged and counted (Refused).
  absl::StatusOr<std::shared_ptr<RequestStream>> Submit(GenerateOptions options);
  // The n choices of one request (OpenAI's n): n sequences of `options`'
  // prompt, choice i sampled with seed + i (and named "choice i" in the
  // log), queued together or not at all; InvalidArgument when n is more
  // than the wait queue holds. With the prefix cache, choices 1..n-1 wait
  // in the queue until choice 0 has sampled its first token (or ended), so
  // that they find its prompt's whole blocks cached instead of prefilling
  // the prompt again; requests queued behind them are admitted meanwhile.
  absl::StatusOr<std::vector<std::shared_ptr<RequestStream>>> SubmitChoices(GenerateOptions options, int n);
  // A batch of prompts (OpenAI's list of prompts), each with n choices as
  // SubmitChoices gives them, all queued together or none: prompt k's choice
  // i is stream k n + i.
  absl::StatusOr<std::vector<std::shared_ptr<RequestStream>>> SubmitBatch(std::vector<GenerateOptions> prompts,
                                                                          int n);
  // Logs and counts a request refused before it reached the queue (a bad
  // request, a full queue, a server that is stopping): "refused" in the
  // metrics' requests by outcome. Submit calls it; so do the fronts for the
  // requests they refuse before Submit.
  // `source` as GenerateOptions::source.
  void Refused(const absl::Status& status, const std::string& source);

  // The KV store's blocks at start-up (the blocks every attention worker
  // lists): prompts that continue a cached prefix into them load them. The
  // tier keeps at most `capacity` blocks (what the smallest store holds),
  // forgetting the least recently stored as the stores delete them.
  void AddStored(const std::vector<PrefixCache::Block>& blocks, int64_t capacity);

  // Called when a worker is found dead: every request ends with `status`
  // and later submissions are refused.
  void MarkBroken(const absl::Status& status);
  // Called when a worker is found dead or frozen: with options.recover the
  // scheduler recovers (see SchedulerOptions::recover), else MarkBroken.
  void WorkerFailed(const absl::Status& status);
  bool broken() const { return broken_.load(); }
  bool recovering() const { return recovering_.load(); }
  // Called (from the step thread) when the scheduler turns broken.
  std::function<void(const absl::Status&)> on_broken;
  // Called (from the step thread) when recovery starts (true) and ends (false).
  std::function<void(bool)> on_recovering;

  SchedulerStats Stats();
  // Refuses new requests (Unavailable) while those queued and running go on
  // to their end: the first step of a graceful shutdown.
  void StopAdmitting();
  bool admitting() const { return admitting_.load(); }
  void Stop();

 private:
  struct Sequence {
    uint64_t id = 0;
    GenerateOptions options;
    std::shared_ptr<RequestStream> stream;
    std::unique_ptr<TextOutput> text;
    int64_t blocks = 0;     // own KV blocks reserved (not counting cached entries)
    int64_t need = 0;       // blocks for prompt + max_tokens in all
    int fed = 0;            // positions written to the KV cache (incl. synthetic ones)
    int base = 0;           // synthetic positions before the prompt
    // Prefix-cache keys of its first keys.size() blocks: attached, then
    // published; it holds one reference to each.
    std::vector<uint64_t> keys;
    int attached = 0;       // blocks it started with from the cache
    // The cached block whose first rows it copies into its next block (rows
    // 0: none); it holds a reference to it until the workers have copied
    // them (FlushKvOps).
    PrefixCache::Partial partial;
    bool tried_store = false;  // its KV-store blocks were asked for
    int cached_tokens = -1;    // prompt tokens attached at its first admission (-1: not yet)
    bool needs_fill = false;
    std::vector<int32_t> generated;
    // Choices 1..n-1 of a request (SubmitChoices): the id of its choice 0,
    // whose first token they wait for while it is in leading_ (0: none).
    uint64_t leader = 0;
    // Its tokens' counts when it has penalties (by token id: the frame's order):
    // generated ones, and with a repetition penalty the prompt's (count 0).
    std::map<int32_t, int32_t> counts;
    // Prompt logprobs: of prompt tokens 1.. (filled as its prefill runs).
    std::vector<float> prompt_logprobs;
    std::vector<std::vector<TokenLogprob>> prompt_top;
    // While it has fewer than min_tokens generated: its logit bias with the
    // tokens that would stop it banned (-inf), by token id.
    std::vector<TokenBias> early_bias;
    const std::vector<TokenBias>& Bias() const {
      return static_cast<int>(generated.size()) < options.min_tokens ? early_bias : options.logit_bias;
    }
    // Its tokens so far: the prompt, then the generated ones. Positions
    // [base, fed) hold the first fed - base of them.
    std::vector<int32_t> Tokens() const {
      std::vector<int32_t> t = options.prompt;
      t.insert(t.end(), generated.begin(), generated.end());
      return t;
    }
    int TokenCount() const { return static_cast<int>(options.prompt.size() + generated.size()); }
    // Appends tokens [from, from + n) of Tokens() to *out, copying no others
    // (a step's slice of a long context; Tokens() would copy all of it).
    void AppendTokens(int from, int n, std::vector<int32_t>* out) const {
      const int p = static_cast<int>(options.prompt.size());
      for (int i = from; i < std::min(from + n, p); ++i) out->push_back(options.prompt[i]);
      for (int i = std::max(from, p); i < from + n; ++i) out->push_back(generated[i - p]);
    }
    absl::Time submitted, admitted, first_token, last_token;
    bool in_kv = false;     // some of it reached the workers
  };

  void Loop();
  // Builds the next plan from the running sequences (locked).
  shm::StepPlan PlanStep(std::vector<Sequence*>* in_step);
  // Submit's and SubmitChoices' checks of a request: a sequence to queue.
  absl::StatusOr<std::unique_ptr<Sequence>> MakeSequence(GenerateOptions options) const;
  // Queues all of `seqs` or none (locked inside); with `lead`, the first of
  // each `group` of them leads the others (SubmitChoices).
  absl::StatusOr<std::vector<std::shared_ptr<RequestStream>>> Enqueue(std::vector<std::unique_ptr<Sequence>> seqs,
                                                                     int group, bool lead);
  // A choice waiting for its choice 0's first token (locked).
  bool Held(const Sequence& s) const { return s.leader != 0 && leading_.contains(s.leader); }
  void Admit();  // locked
  // "sequence 3 (HTTP cmpl-…)": how the log names a request.
  static std::string Named(const Sequence& s);
  // The final event (reason, counts, timings) of a finished sequence.
  void Finish(Sequence* seq, FinishReason reason);
  // Takes `seq` out of running_ and releases its KV: its full blocks go to
  // the prefix cache when `publish` (its KV is complete), its own blocks
  // back to the pool; the workers learn it at the next FlushKvOps. Locked.
  void Retire(Sequence* seq, bool publish);
  // Hands a sampled token to its sequence: text, stop conditions. Locked.
  // Ok when the step's result holds a usable token for `seq`: present,
  // sampled from finite logits, inside the vocabulary.
  absl::Status CheckAnswer(const Sequence& seq, const std::vector<shm::SampledSeq>& result) const;
  void Deliver(const shm::SampledSeq& sampled, absl::Time now);
  void Fail(Sequence* seq, const absl::Status& status);
  // Publishes `seq`'s full blocks up to `blocks` to the prefix cache (those
  // not cached yet, stopping at one another sequence cached first). Locked.
  void Publish(Sequence* seq, int blocks);
  // Publishes the last, partial block of `seq` (which is ending) when its
  // whole blocks are all its own published chain. Locked.
  void PublishPartial(Sequence* seq);
  bool Cacheable(const Sequence& seq) const { return options_.prefix_cache && seq.base == 0; }
  // Whether it may start from cached blocks: not while its prompt is to be scored.
  bool Attachable(const Sequence& seq) const {
    return Cacheable(seq) && !(seq.options.prompt_logprobs && seq.generated.empty());
  }
  // The prompt scores a step's result has for s (whose chunk began at
  // prompt token `start`) into s; an error when they are not those asked.
  absl::Status TakeScores(Sequence* s, int start, const shm::PlanSeq& p,
                          const std::vector<shm::SampledSeq>& result) const;
  // Sends pending_ to the workers (unlocked call to the executor); a failure
  // breaks the scheduler.
  void FlushKvOps();
  // Loads load_'s blocks from the KV store (unlocked call), caches what every
  // worker loaded, discards the rest, and admits again.
  void RunLoad();
  void BreakLocked(const absl::Status& status);
  // A worker failed: with options_.recover, every running request goes back
  // to the front of the queue with no KV, the cache index forgets what the
  // workers held, and the loop waits for Recover; else BreakLocked. Locked.
  void FailWorkersLocked(const absl::Status& status);
  bool IsWorkerFailure(const absl::Status& status) const {
    return status.code() == absl::StatusCode::kUnavailable ||
           status.code() == absl::StatusCode::kDeadlineExceeded;
  }

  const SchedulerOptions options_;
  const Tokenizer& tokenizer_;
  StepExecutor* executor_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::list<std::unique_ptr<Sequence>> running_;
  // Choices 0 of SubmitChoices whose first token has not come yet (by id):
  // their other choices are Held. An id leaves it at the first token or when
  // the sequence ends, however it ends.
  absl::flat_hash_set<uint64_t> leading_;
  KvOps pending_;         // decided, not yet sent to the workers
  PrefixCache cache_;
  int64_t blocks_free_;   // neither reserved by a sequence nor cached
  int64_t prefix_hits_ = 0, prefix_misses_ = 0, cached_tokens_ = 0, stored_loaded_ = 0;
  // A KV-store load the head of the queue waits for; its blocks are
  // reserved in blocks_free_.
  struct Load {
    std::vector<PrefixCache::Block> blocks;
  };
  std::optional<Load> load_;
  uint64_t next_id_ = 1;
  uint64_t step_ = 0;
  bool stop_ = false;
  std::atomic<bool> admitting_{true};
  std::atomic<bool> broken_{false};
  absl::Status broken_status_;
  std::atomic<bool> recovering_{false};
  absl::Status worker_failure_;  // reported by WorkerFailed, handled by the loop
  int64_t recoveries_ = 0;
  std::thread thread_;
};

}  // namespace ellm::coord
