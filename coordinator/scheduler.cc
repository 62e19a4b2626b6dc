#include "coordinator/scheduler.h"

#include <algorithm>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "core/log.h"

namespace ellm::coord {

Scheduler::Scheduler(const SchedulerOptions& options, const Tokenizer& tokenizer,
                     StepExecutor* executor)
    : options_(options),
      tokenizer_(tokenizer),
      executor_(executor),
      cache_(options.kv_block_tokens),
      blocks_free_(options.kv_blocks) {
  thread_ = std::thread([this] { Loop(); });
}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::StopAdmitting() {
  std::lock_guard<std::mutex> lock(mu_);  // a Submit holding the lock queues before it
  admitting_.store(false);
}

void Scheduler::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_all();
  executor_->Abandon();  // a step on workers that no longer answer ends now
  if (thread_.joinable()) thread_.join();
  // Anything still queued or running ends now.
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Status status = absl::UnavailableError("the server is shutting down: it stopped before this request ended");
  for (auto& s : waiting_) s->stream->Push({.finished = true, .error = status});
  for (auto& s : running_) s->stream->Push({.finished = true, .error = status});
  waiting_.clear();
  running_.clear();
  leading_.clear();
}

absl::StatusOr<std::shared_ptr<RequestStream>> Scheduler::Submit(GenerateOptions options) {
  ASSIGN_OR_RETURN(std::vector<std::shared_ptr<RequestStream>> streams, SubmitChoices(std::move(options), 1));
  return streams.front();
}

absl::StatusOr<std::vector<std::shared_ptr<RequestStream>>> Scheduler::SubmitChoices(GenerateOptions options,
                                                                                    int n) {
  std::vector<GenerateOptions> one;
  one.push_back(std::move(options));
  return SubmitBatch(std::move(one), n);
}

absl::StatusOr<std::vector<std::shared_ptr<RequestStream>>> Scheduler::SubmitBatch(
    std::vector<GenerateOptions> prompts, int n) {
  const std::string source = prompts.empty() ? std::string() : prompts.front().source;
  const int64_t total = static_cast<int64_t>(n) * static_cast<int64_t>(prompts.size());
  absl::StatusOr<std::vector<std::shared_ptr<RequestStream>>> streams;
  if (n < 1) {
    streams = absl::InvalidArgumentError(absl::StrCat("n = ", n, ": a request has at least one choice"));
  } else if (prompts.empty()) {
    streams = absl::InvalidArgumentError("a request has at least one prompt");
  } else if (total > 1 && total > options_.max_queue) {
    // It could never be queued: not a 429, which a client would retry.
    streams = absl::InvalidArgumentError(absl::StrCat(
        prompts.size() > 1 ? absl::StrCat(prompts.size(), " prompts x ") : std::string(), "n = ", n,
        " choices are more than the wait queue holds (--max-queue ", options_.max_queue, ")"));
  } else {
    std::vector<std::unique_ptr<Sequence>> seqs;
    absl::Status refused;
    for (size_t k = 0; k < prompts.size() && refused.ok(); ++k) {
      for (int i = 0; i < n; ++i) {
        GenerateOptions o = prompts[k];
        o.seed += static_cast<uint64_t>(i);
        if (total > 1) {
          o.source = absl::StrCat(source.empty() ? "request" : source,
                                  prompts.size() > 1 ? absl::StrCat(" prompt ", k) : std::string(),
                                  n > 1 ? absl::StrCat(" choice ", i) : std::string());
        }
        absl::StatusOr<std::unique_ptr<Sequence>> seq = MakeSequence(std::move(o));
        if (!seq.ok()) {
          refused = seq.status();
          break;
        }
        seqs.push_back(*std::move(seq));
      }
    }
    streams = refused.ok() ? Enqueue(std::move(seqs), n, options_.prefix_cache) : refused;
  }
  if (!streams.ok()) Refused(streams.status(), source);
  return streams;
}

std::string Scheduler::Named(const Sequence& s) {
  return s.options.source.empty() ? absl::StrCat("sequence ", s.id)
                                  : absl::StrCat("sequence ", s.id, " (", s.options.source, ")");
}

void Scheduler::Refused(const absl::Status& status, const std::string& source) {
  LogWarning("request %srefused: %s", source.empty() ? "" : absl::StrCat("(", source, ") "), status.ToString());
  if (options_.metrics != nullptr) options_.metrics->RequestEnded("refused");
}

absl::StatusOr<std::unique_ptr<Scheduler::Sequence>> Scheduler::MakeSequence(GenerateOptions options) const {
  if (options.synthetic_context < 0) {
    return absl::InvalidArgumentError("synthetic_context must not be negative");
  }
  // 64-bit: each term is at most INT32_MAX, so the sum cannot wrap.
  const int64_t total = int64_t{options.synthetic_context} +
                        static_cast<int64_t>(options.prompt.size()) + options.max_tokens;
  if (options.prompt.empty() || options.max_tokens <= 0 || total > options_.context_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt of ", options.prompt.size(), " tokens + max_tokens ",
                     options.max_tokens,
                     options.synthetic_context
                         ? absl::StrCat(" + synthetic context ", options.synthetic_context)
                         : "",
                     " must fit the context of ", options_.context_length));
  }
  const int64_t blocks = (total + options_.kv_block_tokens - 1) / options_.kv_block_tokens;
  const int64_t prompt_positions = total - options.max_tokens + 1;  // and the first token generated
  if ((prompt_positions + options_.kv_block_tokens - 1) / options_.kv_block_tokens > options_.kv_blocks) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the prompt alone needs ", prompt_positions - 1, " positions but the KV cache holds ",
        options_.kv_blocks * options_.kv_block_tokens, " (", options_.kv_blocks, " blocks of ",
        options_.kv_block_tokens, "); start ellm with a larger --kv-cache-mb"));
  }
  if (blocks > options_.kv_blocks) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request needs ", blocks, " KV blocks (", total, " positions) but the KV cache holds ",
        options_.kv_blocks, " blocks in all; lower max_tokens or start ellm with a larger --kv-cache-mb"));
  }
  auto seq = std::make_unique<Sequence>();
  seq->options = std::move(options);
  seq->stream = std::make_shared<RequestStream>();
  seq->text = std::make_unique<TextOutput>(tokenizer_, seq->options.stop, seq->options.prompt.back(),
                                           seq->options.include_stop_str_in_output);
  seq->need = blocks;
  seq->base = seq->fed = seq->options.synthetic_context;
  seq->needs_fill = seq->base > 0;
  seq->submitted = absl::Now();
  // The repetition penalty covers the prompt's tokens too (count 0: never
  // generated).
  if (seq->options.sampling.repetition_penalty != 1) {
    for (int32_t t : seq->options.prompt) seq->counts.emplace(t, 0);
  }
  if (seq->options.prompt_logprobs) {
    seq->prompt_logprobs.resize(seq->options.prompt.size() - 1);
    seq->prompt_top.resize(seq->options.prompt.size() - 1);
  }
  // min_tokens: its logit bias, and the tokens that would stop it banned.
  if (seq->options.min_tokens > 0) {
    std::map<int32_t, float> bias;
    for (const TokenBias& b : seq->options.logit_bias) bias[b.token] = b.bias;
    if (!seq->options.ignore_eos) {
      for (int32_t t : tokenizer_.eog_ids()) bias[t] = -std::numeric_limits<float>::infinity();
    }
    for (int32_t t : seq->options.stop_token_ids) bias[t] = -std::numeric_limits<float>::infinity();
    if (bias.size() > static_cast<size_t>(kMaxSeqBiases)) {
      return absl::InvalidArgumentError(absl::StrCat("with min_tokens, the logit bias, the stop token ids and the ",
                                                     "model's end-of-generation tokens are ", bias.size(),
                                                     " tokens; at most ", kMaxSeqBiases));
    }
    for (const auto& [token, b] : bias) seq->early_bias.push_back({token, b});
  }
  return seq;
}

absl::StatusOr<std::vector<std::shared_ptr<RequestStream>>> Scheduler::Enqueue(
    std::vector<std::unique_ptr<Sequence>> seqs, int group, bool lead) {
  std::vector<std::shared_ptr<RequestStream>> streams;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) return broken_status_;
    if (stop_ || !admitting_.load()) {
      return absl::UnavailableError("the server is shutting down: it takes no new requests");
    }
    if (waiting_.size() + seqs.size() > static_cast<size_t>(options_.max_queue)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the wait queue is full (", options_.max_queue, " requests wait for KV space or a batch slot)"));
    }
    for (size_t j = 0; j < seqs.size(); ++j) {
      seqs[j]->id = next_id_++;
      // The first of each group of choices leads the others.
      if (lead && j % group != 0) seqs[j]->leader = seqs[j - j % group]->id;
      if (lead && group > 1 && j % group == 0) leading_.insert(seqs[j]->id);
      streams.push_back(seqs[j]->stream);
    }
    for (std::unique_ptr<Sequence>& seq : seqs) waiting_.push_back(std::move(seq));
  }
  cv_.notify_all();
  return streams;
}

void Scheduler::MarkBroken(const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) return;
    broken_status_ = status;
    broken_ = true;
  }
  cv_.notify_all();
}

SchedulerStats Scheduler::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  SchedulerStats st;
  st.running = static_cast<int>(running_.size());
  st.waiting = static_cast<int>(waiting_.size());
  st.kv_blocks_free = blocks_free_;
  st.kv_blocks_cached = cache_.size();
  st.steps = static_cast<int64_t>(step_);
  st.prefix_hits = prefix_hits_;
  st.prefix_misses = prefix_misses_;
  st.cached_tokens = cached_tokens_;
  st.stored_blocks = cache_.stored();
  st.stored_loaded = stored_loaded_;
  st.recoveries = recoveries_;
  return st;
}

void Scheduler::Admit() {
  // One KV store load at a time: the request at the head of the queue waits
  // for its blocks (RunLoad admits it), and those behind it wait their turn.
  // (Planning a second load here would overwrite the first, and lose the
  // blocks reserved for it.)
  if (load_) return;
  const int bt = options_.kv_block_tokens;
  while (!waiting_.empty() && static_cast<int>(running_.size()) < options_.max_batch) {
    // The first that is not a choice waiting for its choice 0 comes to the
    // head of the queue (the others keep their order).
    const auto next = std::find_if(waiting_.begin(), waiting_.end(), [this](const auto& w) { return !Held(*w); });
    if (next == waiting_.end()) break;
    std::rotate(waiting_.begin(), next, next + 1);
    Sequence* seq = waiting_.front().get();
    // The longest cached run of whole blocks, short of the block that holds
    // the last prompt token (its logits must be computed).
    // (A request resumed after a worker failure matches its generated tokens too.)
    const std::vector<int32_t> tokens = seq->Tokens();
    const int max_blocks = (static_cast<int>(tokens.size()) - 1) / bt;
    std::vector<uint64_t> keys;
    if (Attachable(*seq)) keys = cache_.Lookup(tokens, max_blocks);
    cache_.Acquire(keys);
    // Stored blocks that continue the match are loaded first (once per
    // request; what fails to load is recomputed).
    if (Attachable(*seq) && options_.kv_store && !seq->tried_store) {
      seq->tried_store = true;
      std::vector<PrefixCache::Block> stored = cache_.LookupStored(tokens, keys, max_blocks);
      const int64_t m = static_cast<int64_t>(stored.size());
      if (m > 0 && m <= blocks_free_ + cache_.evictable()) {
        if (m > blocks_free_) {
          const std::vector<uint64_t> evicted = cache_.Evict(m - blocks_free_);
          pending_.evict.insert(pending_.evict.end(), evicted.begin(), evicted.end());
          blocks_free_ += static_cast<int64_t>(evicted.size());
        }
        blocks_free_ -= m;
        cache_.Release(keys);
        load_ = Load{std::move(stored)};
        return;  // admitted after the load
      }
    }
    // A prefix that goes on inside the next block: the rows it shares with a
    // cached child of the last whole block are copied into the sequence's own
    // block (the source is held until the workers have copied it, at the next
    // FlushKvOps, so no eviction below or by a later admission can drop it
    // before).
    PrefixCache::Partial partial;
    if (Attachable(*seq)) {
      const int start = static_cast<int>(keys.size()) * bt;
      const int n = std::min(bt, static_cast<int>(tokens.size()) - 1 - start);
      if (n > 0) partial = cache_.LongestPartial(keys.empty() ? 0 : keys.back(), tokens.data() + start, n);
      if (partial.rows > 0) cache_.Acquire({partial.key});
    }
    const int64_t own = seq->need - static_cast<int64_t>(keys.size());
    if (own > blocks_free_ + cache_.evictable() && partial.rows > 0) {
      // The held source is a block this request may need (one that needs
      // the whole pool waited for ever): it goes without the copy.
      cache_.Release({partial.key});
      partial = {};
    }
    if (own > blocks_free_ + cache_.evictable()) {  // (and no partial copy: released above)
      cache_.Release(keys);
      break;  // first come, first served: wait for room
    }
    if (own > blocks_free_) {
      const std::vector<uint64_t> evicted = cache_.Evict(own - blocks_free_);
      pending_.evict.insert(pending_.evict.end(), evicted.begin(), evicted.end());
      blocks_free_ += static_cast<int64_t>(evicted.size());
      LogDebug("evicted %d cached KV blocks for sequence %d", evicted.size(), seq->id);
    }
    blocks_free_ -= own;
    seq->blocks = own;
    seq->keys = keys;
    seq->attached = static_cast<int>(keys.size());
    seq->partial = partial;
    const int attached_tokens = seq->attached * bt + partial.rows;
    seq->fed += attached_tokens;
    if (attached_tokens > 0) {
      pending_.attach.push_back({seq->id, 0, keys, 0, {}, partial.key, partial.rows});
      seq->in_kv = true;
    }
    // Counted at its first admission, whatever its end: a request resumed
    // after a worker failure is admitted again, but neither waited in the
    // queue nor brought its prompt a second time, nor is it a second request
    // that hit or missed the cache.
    if (seq->cached_tokens < 0) {
      if (attached_tokens > 0) {
        ++prefix_hits_;
      } else if (Cacheable(*seq)) {
        ++prefix_misses_;
      }
      seq->cached_tokens = attached_tokens;
      cached_tokens_ += attached_tokens;
      seq->admitted = absl::Now();
      if (Metrics* m = options_.metrics) {
        m->PromptTokens(static_cast<int>(seq->options.prompt.size()));
        m->QueueWait(seq->admitted - seq->submitted);
      }
    }
    LogDebug("admitted %s (%d prompt tokens, %d of them cached; %d KV blocks)", Named(*seq),
             seq->options.prompt.size(), attached_tokens, own);
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
}

void Scheduler::Publish(Sequence* s, int blocks) {
  const int bt = options_.kv_block_tokens;
  const std::vector<int32_t> tokens = s->Tokens();
  blocks = std::min<int>(blocks, static_cast<int>(tokens.size()) / bt);
  KvOps::SequenceBlocks published{s->id, static_cast<int>(s->keys.size()), {},
                                  s->keys.empty() ? 0 : s->keys.back(), {}};
  while (static_cast<int>(s->keys.size()) < blocks) {
    const uint64_t parent = s->keys.empty() ? 0 : s->keys.back();
    const int32_t* t = tokens.data() + s->keys.size() * static_cast<size_t>(bt);
    const uint64_t key = ChainKey(parent, t, bt);
    if (!cache_.Insert(key, parent, t)) {
      // Another sequence cached this block first (the same prompt prefilled
      // side by side, or a scored prompt, which attaches nothing): this
      // one's copy stays its own, and it holds the cached one so that its
      // later blocks chain on from it. (Before, it published none of them.)
      if (!published.keys.empty()) pending_.publish.push_back(std::move(published));
      cache_.Acquire({key});
      s->keys.push_back(key);
      published = {s->id, static_cast<int>(s->keys.size()), {}, key, {}};
      continue;
    }
    s->keys.push_back(key);
    published.keys.push_back(key);
    if (options_.kv_store) {
      published.tokens.insert(published.tokens.end(), t, t + bt);
      cache_.AddStored({key, parent, std::vector<int32_t>(t, t + bt)});
    }
    --s->blocks;  // the block now counts as a cache entry
  }
  if (!published.keys.empty()) pending_.publish.push_back(std::move(published));
}

void Scheduler::PublishPartial(Sequence* s) {
  const int bt = options_.kv_block_tokens;
  const int fed = s->fed - s->base;
  const int rows = fed % bt;
  // Only after the chain of the sequence's whole blocks (its own, or
  // cached first by another sequence).
  if (rows == 0 || static_cast<int>(s->keys.size()) != fed / bt) return;
  const std::vector<int32_t> tokens = s->Tokens();
  const uint64_t parent = s->keys.empty() ? 0 : s->keys.back();
  const int32_t* t = tokens.data() + static_cast<size_t>(fed - rows);
  const uint64_t key = ChainKey(parent, t, rows);
  if (!cache_.Insert(key, parent, t, rows)) return;  // the same rows are cached already
  pending_.publish.push_back({s->id, fed / bt, {}, parent, {}, key, rows});
  s->keys.push_back(key);  // released (and stamped first, as the deepest) with the rest
  --s->blocks;             // the block now counts as a cache entry
}

shm::StepPlan Scheduler::PlanStep(std::vector<Sequence*>* in_step) {
  shm::StepPlan plan;
  int budget = options_.max_step_tokens;
  // Penalised sequences' token counts, sent with a chunk that samples: one
  // that would overflow the frame waits for a later step (only a batch of
  // more than 16 long penalised sequences comes near).
  uint64_t counts_budget = shm::StepPlanCountsCapacity(options_.max_batch);
  uint64_t biases_budget = shm::StepPlanBiasesCapacity(options_.max_batch);  // likewise
  // Decoding sequences first (one token each), then prefill chunks: a
  // request's prompt, or after a worker failure its prompt and the tokens it
  // had generated. A chunk that reaches the last token samples the next.
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& s : running_) {
      const int total = s->TokenCount();
      const int done = s->fed - s->base;  // tokens fed
      const bool decoding = !s->generated.empty() && total - done == 1;
      if ((pass == 0) != decoding || budget == 0 || done >= total) continue;
      const int n = std::min(budget, total - done);
      const bool sample = done + n == total;
      const bool sends_counts = sample && s->options.sampling.penalised();
      if (sends_counts && s->counts.size() > counts_budget) continue;
      const std::vector<TokenBias>& bias = s->Bias();
      if (sample && bias.size() > biases_budget) continue;
      shm::PlanSeq p;
      p.slice.seq_id = s->id;
      p.slice.start_pos = static_cast<uint32_t>(s->fed);
      p.slice.n_tokens = static_cast<uint32_t>(n);
      s->AppendTokens(done, n, &plan.tokens);
      p.sample = sample ? 1 : 0;
      // Prompt logprobs: its first prefill scores every prompt token after
      // the first (a prefill run again after a worker failure scores what
      // it had scored, the same; once a token is generated, none).
      if (s->options.prompt_logprobs && s->generated.empty()) {
        p.score = 1;
        if (!sample) p.next_token = s->options.prompt[done + n];
      }
      budget -= n;
      shm::SetSampling(s->options.sampling, &p);
      if (sends_counts) {
        p.n_counts = static_cast<uint32_t>(s->counts.size());
        counts_budget -= p.n_counts;
        for (const auto& [token, count] : s->counts) plan.counts.push_back({token, count});
      }
      if (sample && !bias.empty()) {
        p.n_biases = static_cast<uint32_t>(bias.size());
        biases_budget -= p.n_biases;
        plan.biases.insert(plan.biases.end(), bias.begin(), bias.end());
      }
      // The draw of token number generated.size(): a step that fails and is
      // run again after a recovery draws the same.
      p.u = p.sample ? SampleUniform(s->options.seed, s->generated.size()) : 0;
      plan.seqs.push_back(p);
      in_step->push_back(s.get());
    }
  }
  return plan;
}

void Scheduler::Finish(Sequence* s, FinishReason reason) {
  StreamEvent e;
  e.finished = true;
  FinishInfo& f = e.finish;
  f.reason = reason;
  f.prompt_tokens = static_cast<int>(s->options.prompt.size());
  f.completion_tokens = static_cast<int>(s->generated.size());
  f.queue_ms = absl::ToDoubleMilliseconds(s->admitted - s->submitted);
  f.cached_tokens = std::max(0, s->cached_tokens);
  if (Metrics* m = options_.metrics) {
    m->RequestEnded(reason == FinishReason::kMaxTokens || reason == FinishReason::kContext ? "length" : "stop");
  }
  if (!s->generated.empty()) {
    f.time_to_first_token_ms = absl::ToDoubleMilliseconds(s->first_token - s->submitted);
    if (s->generated.size() > 1) {
      f.decode_ms_per_token =
          absl::ToDoubleMilliseconds(s->last_token - s->first_token) / (s->generated.size() - 1);
    }
  }
  LogInfo("%s finished (%s): prompt %d tokens, %d from the prefix cache; tokenized in %.1f ms, "
          "queued %.1f ms, first token %.1f ms after submission, %d generated at %.2f ms/token",
          Named(*s), FinishReasonName(reason), f.prompt_tokens, f.cached_tokens, s->options.tokenize_ms,
          f.queue_ms, f.time_to_first_token_ms, f.completion_tokens, f.decode_ms_per_token);
  s->stream->Push(std::move(e));
}

void Scheduler::Fail(Sequence* s, const absl::Status& status) {
  if (options_.metrics != nullptr) options_.metrics->RequestEnded("error");
  s->stream->Push({.finished = true, .error = status});
}

void Scheduler::Loop() {
  for (;;) {
    std::vector<Sequence*> in_step;
    shm::StepPlan plan;
    uint64_t step = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Not `broken_`: once broken and drained there is nothing to wake for,
      // and waking on it would spin the thread.
      cv_.wait_for(lock, std::chrono::milliseconds(100), [this] {
        return stop_ || !running_.empty() || !waiting_.empty() || !pending_.empty();
      });
      if (stop_) return;
      if (!worker_failure_.ok()) {
        const absl::Status failure = worker_failure_;
        worker_failure_ = absl::OkStatus();
        FailWorkersLocked(failure);
      }
      if (broken_) {
        for (auto& s : waiting_) Fail(s.get(), broken_status_);
        for (auto& s : running_) Fail(s.get(), broken_status_);
        waiting_.clear();
        running_.clear();
        leading_.clear();
        pending_ = KvOps();
        continue;
      }
      if (recovering_) {
        // Requests keep their place in the queue (new ones join it) while
        // the executor waits for a fresh set of workers.
        lock.unlock();
        const absl::Status st = executor_->Recover();
        lock.lock();
        if (!st.ok()) {
          if (st.code() != absl::StatusCode::kCancelled) LogError("recovery failed: %s", st.ToString());
          recovering_ = false;
          BreakLocked(st);
          continue;
        }
        recovering_ = false;
        ++recoveries_;
        LogInfo("workers are back; resuming %s", Count(static_cast<int64_t>(waiting_.size()), "request"));
        if (on_recovering) on_recovering(false);
        continue;
      }
      // Drop cancelled requests (their KV so far is whole: it can be cached).
      std::vector<Sequence*> cancelled;
      for (auto& s : running_) {
        if (s->stream->cancelled()) cancelled.push_back(s.get());
      }
      for (Sequence* s : cancelled) {
        LogInfo("%s cancelled by the client: prompt %d tokens, %d from the prefix cache; queued %.1f ms, "
                "%d generated", Named(*s), static_cast<int>(s->options.prompt.size()), std::max(0, s->cached_tokens),
                absl::ToDoubleMilliseconds(s->admitted - s->submitted), static_cast<int>(s->generated.size()));
        if (options_.metrics != nullptr) options_.metrics->RequestEnded("cancelled");
        Retire(s, /*publish=*/true);
      }
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if (!(*it)->stream->cancelled()) {
          ++it;
          continue;
        }
        LogInfo("%s cancelled by the client while it waited (%.1f ms, prompt %d tokens)", Named(**it),
                absl::ToDoubleMilliseconds(absl::Now() - (*it)->submitted),
                static_cast<int>((*it)->options.prompt.size()));
        if (options_.metrics != nullptr) options_.metrics->RequestEnded("cancelled");
        leading_.erase((*it)->id);
        it = waiting_.erase(it);
      }
      Admit();
    }
    FlushKvOps();
    RunLoad();
    std::vector<Sequence*> to_fill;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_ || stop_) continue;
      for (auto& s : running_) {
        if (s->needs_fill) to_fill.push_back(s.get());
      }
    }
    // Benchmarks: synthetic context goes straight into the attention caches.
    // Only this thread removes running sequences, so the pointers stay valid.
    for (Sequence* s : to_fill) {
      absl::Status st = executor_->FillSynthetic(s->id, s->base);
      std::lock_guard<std::mutex> lock(mu_);
      if (recovering_ || broken_) break;
      s->needs_fill = false;
      s->in_kv = true;
      if (!st.ok() && IsWorkerFailure(st)) {
        FailWorkersLocked(st);
        break;
      }
      if (!st.ok()) {
        Fail(s, st);
        Retire(s, /*publish=*/false);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_ || stop_ || recovering_) continue;
      plan = PlanStep(&in_step);
      step = ++step_;
    }
    if (plan.seqs.empty()) continue;

    absl::StatusOr<std::vector<shm::SampledSeq>> result = executor_->Run(step, plan);
    const absl::Time now = absl::Now();
    std::lock_guard<std::mutex> lock(mu_);
    if (!result.ok()) {
      // Abandoned by Stop, which ends its sequences with the others.
      if (stop_ && absl::IsCancelled(result.status())) continue;
      LogError("step %d failed: %s", step, result.status().ToString());
      if (IsWorkerFailure(result.status())) {
        FailWorkersLocked(result.status());
        continue;  // the loop recovers, or fails every request
      }
      // A failed step: its sequences end with the error, the rest go on.
      for (Sequence* s : in_step) {
        Fail(s, absl::InternalError(absl::StrCat("step failed: ", result.status().message())));
        s->in_kv = true;
        Retire(s, /*publish=*/false);
      }
      continue;
    }
    // Advance every sequence of the step, then deliver sampled tokens. A
    // sequence whose answer is missing or unusable ends with an error, and
    // its KV serves no other request (the workers' reply is checked, not
    // trusted); the other sequences go on.
    for (size_t i = 0; i < plan.seqs.size(); ++i) {
      Sequence* s = in_step[i];
      const int start = s->fed - s->base;  // prompt index of the chunk's first token
      s->fed += static_cast<int>(plan.seqs[i].slice.n_tokens);
      s->in_kv = true;
      absl::Status scores = TakeScores(s, start, plan.seqs[i], *result);
      if (!scores.ok()) {
        LogError("step %d: %s ends: %s", step, Named(*s), scores.ToString());
        Fail(s, scores);
        Retire(s, /*publish=*/false);
        continue;
      }
      if (!plan.seqs[i].sample) continue;
      const absl::Status answer = CheckAnswer(*s, *result);
      if (!answer.ok()) {
        LogError("step %d: %s ends: %s", step, Named(*s), answer.ToString());
        Fail(s, answer);
        Retire(s, /*publish=*/false);
        continue;
      }
      // A prefill is in: its full blocks can serve other requests now.
      if (Cacheable(*s) && (plan.seqs[i].slice.n_tokens > 1 || s->generated.empty())) {
        Publish(s, s->fed / options_.kv_block_tokens);
      }
    }
    for (const shm::SampledSeq& r : *result) {
      if (r.status != shm::kScored) Deliver(r, now);
    }
  }
}

absl::Status Scheduler::TakeScores(Sequence* s, int start, const shm::PlanSeq& p,
                                   const std::vector<shm::SampledSeq>& result) const {
  // Its entries: first the `want` scores, then its sampled token's.
  const uint32_t want = shm::ScoredTokens(p);
  uint32_t got = 0;
  for (const shm::SampledSeq& r : result) {
    if (r.seq_id != s->id || (got == want && r.status != shm::kScored)) continue;
    // Entry `got` scores prompt token start + got + 1.
    const size_t at = static_cast<size_t>(start) + got + 1;
    if (got == want || r.status == shm::kSampled || at >= s->options.prompt.size() ||
        r.token != s->options.prompt[at]) {
      return absl::InternalError(absl::StrCat("the mlp-worker scored tokens this step did not ask for (",
                                              got + 1, " of ", want, ": token ", r.token, ")"));
    }
    if (r.status == shm::kLogitsNotFinite) {
      return absl::InternalError(absl::StrCat("the model's logits at position ", start + got,
                                              " are not finite (NaN or infinity): its weights or activations "
                                              "overflowed; the prompt token after it has no log-probability"));
    }
    s->prompt_logprobs[at - 1] = r.logprob;
    s->prompt_top[at - 1].assign(r.top, r.top + std::min<uint32_t>(r.n_top, kMaxTopLogprobs));
    ++got;
  }
  if (got != want) {
    return absl::InternalError(absl::StrCat("the mlp-worker scored ", got, " prompt tokens of the ", want,
                                            " this step asked for"));
  }
  return absl::OkStatus();
}

absl::Status Scheduler::CheckAnswer(const Sequence& s, const std::vector<shm::SampledSeq>& result) const {
  // Its sampled token's entry: after its scored ones.
  auto it = std::find_if(result.begin(), result.end(), [&s](const shm::SampledSeq& r) {
    return r.seq_id == s.id && r.status != shm::kScored;
  });
  if (it == result.end()) return absl::InternalError("the mlp-worker returned no token for this request");
  if (it->status == shm::kLogitsNotFinite) {
    return absl::InternalError(absl::StrCat(
        "the model's logits at position ", s.fed - 1,
        " are not finite (NaN or infinity): its weights or activations overflowed; nothing was sampled"));
  }
  if (it->token < 0 || it->token >= tokenizer_.vocab_size()) {
    return absl::InternalError(absl::StrCat("the mlp-worker returned token ", it->token,
                                            ", outside the vocabulary of ", tokenizer_.vocab_size()));
  }
  return absl::OkStatus();
}

void Scheduler::Retire(Sequence* s, bool publish) {
  auto it = std::find_if(running_.begin(), running_.end(), [s](const auto& r) { return r.get() == s; });
  if (it == running_.end()) return;
  if (publish && Cacheable(*s) && s->in_kv) {
    Publish(s, (s->fed - s->base) / options_.kv_block_tokens);
    PublishPartial(s);
  }
  if (s->in_kv) pending_.free.push_back(s->id);
  if (s->partial.rows > 0) cache_.Release({s->partial.key});
  cache_.Release(s->keys);
  blocks_free_ += s->blocks;
  leading_.erase(s->id);
  running_.erase(it);
  cv_.notify_all();
}

void Scheduler::Deliver(const shm::SampledSeq& r, absl::Time now) {
  auto it = std::find_if(running_.begin(), running_.end(),
                         [&](const auto& s) { return s->id == r.seq_id; });
  if (it == running_.end()) return;  // failed or cancelled meanwhile
  Sequence* s = it->get();
  if (Metrics* m = options_.metrics) {
    m->GeneratedToken();
    if (s->generated.empty()) {
      m->TimeToFirstToken(now - s->submitted);
    } else {
      m->InterTokenLatency(now - s->last_token);
    }
  }
  StreamEvent e;
  if (s->generated.empty()) {
    s->first_token = now;
    leading_.erase(s->id);  // its prompt's blocks are published: its other choices may come
    e.prompt_logprobs = std::move(s->prompt_logprobs);
    e.prompt_top_logprobs = std::move(s->prompt_top);
  }
  s->last_token = now;
  s->generated.push_back(r.token);
  if (s->options.sampling.penalised()) ++s->counts[r.token];
  e.token_ids.push_back(r.token);
  e.logprobs.push_back(r.logprob);
  if (s->options.sampling.top_logprobs > 0) {
    e.top_logprobs.emplace_back(r.top, r.top + std::min<uint32_t>(r.n_top, kMaxTopLogprobs));
  }
  FinishReason reason = FinishReason::kNone;
  const int generated = static_cast<int>(s->generated.size());
  // Before min_tokens the tokens that stop are banned (early_bias) and stop
  // strings are not looked for. As vLLM: a token that stops (the model's end
  // of generation, a stop token id) adds no text unless
  // include_stop_str_in_output (the end of generation has none anyway), and
  // the text it then adds may still hold a stop string.
  const bool may_stop = generated > s->options.min_tokens;
  const bool stop_id =
      std::binary_search(s->options.stop_token_ids.begin(), s->options.stop_token_ids.end(), r.token);
  if (!s->options.ignore_eos && tokenizer_.IsEndOfGeneration(r.token)) {
    reason = FinishReason::kStopToken;
  } else if (stop_id && !s->options.include_stop_str_in_output) {
    reason = FinishReason::kStopToken;
  } else {
    bool stopped = false;
    e.text = s->text->Push(r.token, may_stop, &stopped);
    if (stopped) {
      reason = FinishReason::kStopString;
    } else if (stop_id) {
      reason = FinishReason::kStopToken;
    }
  }
  // The context first: a request without max_tokens is given the room the
  // context leaves (EllmService::Validate), and ends there with "context full".
  if (reason == FinishReason::kNone &&
      s->base + static_cast<int>(s->options.prompt.size()) + generated >= options_.context_length) {
    reason = FinishReason::kContext;
  }
  if (reason == FinishReason::kNone && generated >= s->options.max_tokens) {
    reason = FinishReason::kMaxTokens;
  }
  if (reason == FinishReason::kNone) {
    s->stream->Push(std::move(e));
    return;
  }
  if (reason != FinishReason::kStopString) e.text += s->text->Flush();
  s->stream->Push(std::move(e));
  Finish(s, reason);
  Retire(s, /*publish=*/true);
}

void Scheduler::FlushKvOps() {
  KvOps ops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_.empty() || broken_) return;
    std::swap(ops, pending_);
  }
  const absl::Status st = executor_->UpdateKv(ops);
  if (st.ok()) {
    // The workers have copied the partial blocks of the sequences attached:
    // their sources need not be held any longer (held to the end, each took
    // a block from the pool for as long as its sequence ran).
    std::lock_guard<std::mutex> lock(mu_);
    for (const KvOps::SequenceBlocks& a : ops.attach) {
      if (a.partial_rows == 0) continue;
      const auto s = std::find_if(running_.begin(), running_.end(), [&a](const auto& r) { return r->id == a.seq; });
      if (s == running_.end() || (*s)->partial.rows == 0 || (*s)->partial.key != a.partial_key) continue;
      cache_.Release({a.partial_key});
      (*s)->partial = {};
    }
    return;
  }
  // A worker that did not apply them no longer holds what the scheduler
  // believes: nothing it computes can be trusted.
  LogError("KV update failed: %s", st.ToString());
  std::lock_guard<std::mutex> lock(mu_);
  if (IsWorkerFailure(st)) {
    FailWorkersLocked(st);
  } else {
    BreakLocked(st);
  }
}

void Scheduler::WorkerFailed(const absl::Status& status) {
  if (!options_.recover) {
    MarkBroken(status);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_ || recovering_) return;
    worker_failure_ = status;
  }
  cv_.notify_all();
}

void Scheduler::FailWorkersLocked(const absl::Status& status) {
  if (!options_.recover) {
    BreakLocked(status);
    return;
  }
  if (broken_ || recovering_) return;
  LogWarning("a worker failed (%s); pausing %d running and %d waiting requests until the workers are back",
             status.message(), static_cast<int>(running_.size()), static_cast<int>(waiting_.size()));
  recovering_ = true;
  if (on_recovering) on_recovering(true);
  // The workers come back with empty caches: every running request goes back
  // to the front of the queue, in order, to be prefilled again (prompt and
  // generated tokens), and the index forgets the cached blocks.
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
    Sequence& s = **it;
    s.fed = s.base;
    s.needs_fill = s.base > 0;
    s.keys.clear();
    s.attached = 0;
    s.partial = {};
    s.blocks = 0;
    s.in_kv = false;
    s.tried_store = false;
    waiting_.push_front(std::move(*it));
  }
  running_.clear();
  pending_ = KvOps();
  load_.reset();
  cache_.ForgetCached();
  blocks_free_ = options_.kv_blocks;
}

void Scheduler::BreakLocked(const absl::Status& status) {
  if (broken_) return;
  broken_status_ = absl::UnavailableError(absl::StrCat("a worker failed: ", status.message()));
  broken_ = true;
  if (on_broken) on_broken(broken_status_);
}

void Scheduler::AddStored(const std::vector<PrefixCache::Block>& blocks, int64_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  cache_.SetStoredCapacity(capacity);
  for (const PrefixCache::Block& b : blocks) cache_.AddStored(b);
}

void Scheduler::RunLoad() {
  Load load;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!load_ || broken_) return;
    load = std::move(*load_);
    load_.reset();
  }
  std::vector<uint64_t> keys;
  for (const PrefixCache::Block& b : load.blocks) keys.push_back(b.key);
  const absl::Time start = absl::Now();
  const absl::StatusOr<int> loaded = executor_->LoadBlocks(keys);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!loaded.ok()) {
      LogError("KV store load failed: %s", loaded.status().ToString());
      if (IsWorkerFailure(loaded.status())) {
        FailWorkersLocked(loaded.status());
      } else {
        BreakLocked(loaded.status());
      }
      return;
    }
    const int n = std::clamp(*loaded, 0, static_cast<int>(keys.size()));
    std::vector<uint64_t> cached;
    for (int i = 0; i < n; ++i) {
      const PrefixCache::Block& b = load.blocks[i];
      if (cache_.Insert(b.key, b.parent, b.tokens.data())) cached.push_back(b.key);
      cache_.AddStored(b);  // a load marks the block recently used in the stores too
    }
    cache_.Release(cached);  // cached, unreferenced: the admission below takes them
    for (size_t i = n; i < keys.size(); ++i) {
      pending_.discard.push_back(keys[i]);
      cache_.RemoveStored(keys[i]);
    }
    blocks_free_ += static_cast<int64_t>(keys.size()) - static_cast<int64_t>(cached.size());
    stored_loaded_ += static_cast<int64_t>(cached.size());
    LogInfo("KV store: %d of %d blocks loaded in %.0f ms", n, keys.size(),
            absl::ToDoubleMilliseconds(absl::Now() - start));
    Admit();
  }
  FlushKvOps();
}

}  // namespace ellm::coord
