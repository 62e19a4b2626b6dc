// One token, end to end, in one process: the decode pipeline as the three
// kinds of process run it, here on threads over the same shared-memory rings.
// To follow a token, read in this order:
//   1. coordinator/scheduler.cc     Scheduler::PlanStep puts it in a step plan
//   2. coordinator/worker_link.cc   RunStep writes the plan into the mlp-worker's ring
//   3. mlp-worker/serve.cc          ServeChannel decodes the plan (shm/messages.cc)
//   4. mlp-worker/step_runner.cc    StepRunner::Run: per layer, the backend writes q/k/v
//                                   into every shard's ring slot (SendQkv), reads the
//                                   outputs back (GatherAttn) and finishes the layer
//   5. attn-worker/serve.cc         ServeChannel: AttentionShard::Process, the output back
//   6. attn-worker/attention_shard.cc  the KV cache append and the attention itself
// then StepRunner samples, the reply frame carries the token back to RunStep,
// and Scheduler::Deliver streams it. The processes add only flags, set-up and
// signals (*/main.cc) and the control plane (gRPC, tests/test_integration.cc).
//
// Checked: with fp32 KV and weights, the tokens and log-probabilities of
// concurrent greedy requests are bit-identical to the single-process
// reference forward (core/reference_forward.cc) on the real stories260K
// model for a few hundred positions; a failure in each stage (the
// coordinator's plan, an attention shard, the KV operations, the executor)
// is an error the caller sees, and the pipeline serves on afterwards; a
// request the model overflows on (logits not finite) ends with an error and
// leaves the requests beside it untouched.
#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attn-worker/attention_shard.h"
#include "attn-worker/kv_cache.h"
#include "attn-worker/serve.h"
#include "coordinator/scheduler.h"
#include "coordinator/worker_link.h"
#include "core/gguf.h"
#include "core/model_config.h"
#include "core/reference_forward.h"
#include "core/sampler.h"
#include "core/thread_pool.h"
#include "core/tokenizer.h"
#include "core/weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mlp-worker/backend.h"
#include "mlp-worker/serve.h"
#include "mlp-worker/step_runner.h"
#include "shm/channel.h"
#include "shm/messages.h"

namespace ellm {
namespace {

using ::testing::HasSubstr;

const std::string kStories = ELLM_MODELS_DIR "/stories260K.gguf";
constexpr int kMaxSeqs = 8;
constexpr int kMaxStepTokens = 24;  // small: prompts prefill in several chunks
constexpr int kBlockTokens = 16;

// The workers of one system on threads: `shards` attention workers (each a
// KV cache, an AttentionShard and its serve loop) and the mlp-worker (the
// CPU backend, a StepRunner and its serve loop); the test is the
// coordinator, through this StepExecutor.
class Pipeline : public coord::StepExecutor {
 public:
  Pipeline(const ModelConfig& config, ModelWeights weights, int shards, int64_t kv_blocks)
      : config_(config) {
    static std::atomic<int> counter{0};
    const std::string prefix = absl::StrCat("ellm-test-pipeline-", getpid(), "-", counter++);
    std::vector<mlp::ShardLink> links;
    for (int i = 0; i < shards; ++i) {
      auto part = std::make_unique<AttnPart>();
      attn::ShardGeometry g;
      g.layers = config.n_layers;
      g.heads = SplitKvHeads(config.n_kv_heads, shards, i);
      g.gqa_ratio = config.gqa_ratio();
      g.head_dim = config.head_dim;
      g.max_positions = config.context_length;
      attn::KvCacheOptions kv;
      kv.layers = config.n_layers;
      kv.kv_heads = g.kv_heads();
      kv.head_dim = config.head_dim;
      kv.block_tokens = kBlockTokens;
      kv.dtype = KvDType::kF32;  // the bit-exact path
      kv.blocks = kv_blocks;
      auto cache = attn::KvCache::Create(kv);
      ELLM_CHECK(cache.ok(), cache.status().ToString());
      part->cache = *std::move(cache);
      part->pool = std::make_unique<ThreadPool>(2);
      part->shard = std::make_unique<attn::AttentionShard>(g, part->cache.get(), part->pool.get());
      const shm::AttnShape shape = g.shape();
      auto channel = shm::Channel::Create(
          absl::StrCat(prefix, "-attn-", i), 4,
          sizeof(shm::FrameHeader) + shape.RequestBytes(kMaxSeqs, kMaxStepTokens),
          sizeof(shm::FrameHeader) + std::max<uint64_t>(shape.ResultBytes(kMaxStepTokens), 4096));
      ELLM_CHECK(channel.ok(), channel.status().ToString());
      part->channel = *std::move(channel);
      AttnPart* p = part.get();
      part->thread = std::thread([this, p] {
        attn::ServeOptions o;
        o.stop = [this] { return stop_.load(); };
        o.cache_mu = &p->mu;
        attn::ServeChannel(*p->channel, *p->shard, o);
      });
      // The mlp-worker's end of the shard's channel.
      auto open = shm::Channel::Open(part->channel->name(), absl::Seconds(5));
      ELLM_CHECK(open.ok(), open.status().ToString());
      links.push_back({i, g.heads, open->get()});
      mlp_ends_.push_back(*std::move(open));
      attn_.push_back(std::move(part));
    }
    auto backend = mlp::CreateCpuBackend(std::move(weights), kMaxStepTokens, 2);
    ELLM_CHECK(backend.ok(), backend.status().ToString());
    backend_ = *std::move(backend);
    auto runner = mlp::StepRunner::Create(config, backend_.get(), links, kMaxStepTokens);
    ELLM_CHECK(runner.ok(), runner.status().ToString());
    runner_ = *std::move(runner);
    runner_->shard_timeout = absl::Seconds(30);
    auto mlp_channel = shm::Channel::Create(
        absl::StrCat(prefix, "-mlp"), 4,
        shm::StepPlanCapacity(kMaxSeqs, kMaxStepTokens),
        std::max<uint64_t>(shm::StepResultCapacity(kMaxSeqs, kMaxStepTokens), sizeof(shm::FrameHeader) + 4096));
    ELLM_CHECK(mlp_channel.ok(), mlp_channel.status().ToString());
    mlp_channel_ = *std::move(mlp_channel);
    mlp_thread_ = std::thread([this] {
      mlp::ServeOptions o;
      o.stop = [this] { return stop_.load(); };
      mlp::ServeChannel(*mlp_channel_, *runner_, config_, o);
    });
    // The coordinator's end.
    auto coord = shm::Channel::Open(mlp_channel_->name(), absl::Seconds(5));
    ELLM_CHECK(coord.ok(), coord.status().ToString());
    coord_ = *std::move(coord);
  }

  ~Pipeline() override {
    stop_ = true;
    mlp_thread_.join();
    for (auto& part : attn_) part->thread.join();
  }

  absl::StatusOr<std::vector<shm::SampledSeq>> Run(uint64_t step, const shm::StepPlan& plan) override {
    if (fail_next_run_.exchange(false)) return absl::UnavailableError("the test ended this step");
    return coord::RunStep(*coord_, step, plan, absl::Seconds(60));
  }

  // The control plane's part, without gRPC: every shard applies the ops.
  absl::Status UpdateKv(const KvOps& ops) override {
    for (auto& part : attn_) {
      std::lock_guard<std::mutex> lock(part->mu);
      RETURN_IF_ERROR(part->cache->Apply(ops));
    }
    return absl::OkStatus();
  }

  void FailNextRun() { fail_next_run_ = true; }
  // Blocks free in every shard (they agree: the scheduler decides for all).
  std::vector<int64_t> BlocksFree() {
    std::vector<int64_t> out;
    for (auto& part : attn_) {
      std::lock_guard<std::mutex> lock(part->mu);
      out.push_back(part->cache->blocks_free());
    }
    return out;
  }

 private:
  struct AttnPart {
    std::unique_ptr<attn::KvCache> cache;
    std::unique_ptr<ThreadPool> pool;
    std::unique_ptr<attn::AttentionShard> shard;
    std::unique_ptr<shm::Channel> channel;
    std::mutex mu;
    std::thread thread;
  };
  ModelConfig config_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> fail_next_run_{false};
  std::vector<std::unique_ptr<AttnPart>> attn_;
  std::vector<std::unique_ptr<shm::Channel>> mlp_ends_;
  std::unique_ptr<mlp::MlpBackend> backend_;
  std::unique_ptr<mlp::StepRunner> runner_;
  std::unique_ptr<shm::Channel> mlp_channel_;
  std::thread mlp_thread_;
  std::unique_ptr<shm::Channel> coord_;
};

struct Model {
  std::unique_ptr<GgufFile> file;
  ModelConfig config;
  std::unique_ptr<Tokenizer> tokenizer;
  ModelWeights Weights() const {
    auto w = LoadWeights(*file, config);  // fp32: the bit-exact path
    ELLM_CHECK(w.ok(), w.status().ToString());
    return *std::move(w);
  }
};

Model LoadStories() {
  Model m;
  auto file = GgufFile::Open(kStories);
  ELLM_CHECK(file.ok(), file.status().ToString());
  m.file = *std::move(file);
  auto config = ModelConfig::FromGguf(*m.file);
  ELLM_CHECK(config.ok(), config.status().ToString());
  m.config = *config;
  auto tokenizer = Tokenizer::FromGguf(*m.file);
  ELLM_CHECK(tokenizer.ok(), tokenizer.status().ToString());
  m.tokenizer = *std::move(tokenizer);
  return m;
}

// Greedy tokens and their logprobs from the reference forward.
struct Answer {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
};
Answer Reference(const Model& m, const std::vector<int32_t>& prompt, int n) {
  auto ref = ReferenceModel::Create(m.Weights());
  ELLM_CHECK(ref.ok(), ref.status().ToString());
  for (size_t i = 0; i + 1 < prompt.size(); ++i) (*ref)->Feed(prompt[i], static_cast<int>(i));
  int pos = static_cast<int>(prompt.size()) - 1;
  const std::vector<float>* logits = &(*ref)->Forward(prompt.back(), pos++);
  Answer a;
  for (int i = 0; i < n; ++i) {
    const SampledToken s = Sample(logits->data(), m.config.vocab_size, {.temperature = 0}, 0);
    a.tokens.push_back(s.token);
    a.logprobs.push_back(s.logprob);
    if (i + 1 < n) logits = &(*ref)->Forward(s.token, pos++);
  }
  return a;
}

Answer Collect(coord::RequestStream& stream, absl::Status* error) {
  Answer a;
  for (;;) {
    std::optional<coord::StreamEvent> e = stream.Pop(absl::Seconds(120));
    if (!e) {
      *error = absl::DeadlineExceededError("no event within 120 s");
      return a;
    }
    a.tokens.insert(a.tokens.end(), e->token_ids.begin(), e->token_ids.end());
    a.logprobs.insert(a.logprobs.end(), e->logprobs.begin(), e->logprobs.end());
    if (e->finished || !e->error.ok()) {
      *error = e->error;
      return a;
    }
  }
}

coord::SchedulerOptions SchedulerFor(const ModelConfig& c, int64_t kv_blocks) {
  coord::SchedulerOptions o;
  o.max_batch = kMaxSeqs;
  o.max_step_tokens = kMaxStepTokens;
  o.kv_blocks = kv_blocks;
  o.kv_block_tokens = kBlockTokens;
  o.context_length = c.context_length;
  return o;
}

TEST(Pipeline, ConcurrentGreedyRequestsEqualTheReferenceForwardBitForBit) {
  const Model m = LoadStories();
  constexpr int64_t kBlocks = 128;
  Pipeline pipeline(m.config, m.Weights(), /*shards=*/2, kBlocks);
  coord::Scheduler scheduler(SchedulerFor(m.config, kBlocks), *m.tokenizer, &pipeline);
  // Prompts of different lengths (prefilled in chunks of kMaxStepTokens
  // beside the others' decodes), answers running to ~300 positions.
  const std::vector<std::string> texts = {
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the park",
      "The dog", "Tom and his mom went to the store to buy some apples. Tom saw a big red ball"};
  const int n = 240;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<coord::RequestStream>> streams;
  for (const std::string& text : texts) {
    coord::GenerateOptions o;
    o.prompt = m.tokenizer->Encode(text, true);
    o.max_tokens = n;
    o.sampling.temperature = 0;
    o.sampling.top_logprobs = 0;
    prompts.push_back(o.prompt);
    auto stream = scheduler.Submit(o);
    ASSERT_TRUE(stream.ok()) << stream.status();
    streams.push_back(*stream);
  }
  for (size_t i = 0; i < texts.size(); ++i) {
    absl::Status error;
    const Answer got = Collect(*streams[i], &error);
    ASSERT_TRUE(error.ok()) << error;
    const Answer want = Reference(m, prompts[i], static_cast<int>(got.tokens.size()));
    // The model may end a story before n tokens; then it ended on the reference's end token.
    ASSERT_GE(got.tokens.size(), 60u) << texts[i];
    EXPECT_EQ(got.tokens, want.tokens) << texts[i];
    EXPECT_EQ(got.logprobs, want.logprobs) << texts[i];
  }
  // Every block is back (cached prefixes count as free for admission but
  // hold their blocks until evicted): the shards agree on what they hold.
  const std::vector<int64_t> free = pipeline.BlocksFree();
  EXPECT_EQ(free[0], free[1]);
  scheduler.Stop();
}

TEST(Pipeline, AFailureInEachStageIsAnErrorAndThePipelineServesOn) {
  const Model m = LoadStories();
  constexpr int64_t kBlocks = 64;
  Pipeline pipeline(m.config, m.Weights(), /*shards=*/2, kBlocks);
  const std::vector<int32_t> prompt = m.tokenizer->Encode("Once upon a time", true);
  auto plan_of = [](uint64_t seq, int start, const std::vector<int32_t>& tokens) {
    shm::StepPlan plan;
    shm::PlanSeq s;
    s.slice = {seq, static_cast<uint32_t>(start), static_cast<uint32_t>(tokens.size())};
    s.sample = 1;
    plan.seqs.push_back(s);
    plan.tokens = tokens;
    return plan;
  };

  // 1. The coordinator's plan: a token outside the vocabulary. The
  //    mlp-worker refuses the frame, as a frame, and names what is wrong.
  std::vector<int32_t> bad = prompt;
  bad[1] = m.config.vocab_size;
  auto r = pipeline.Run(1, plan_of(1007, 0, bad));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("vocabulary"));

  // 2. An attention shard: positions that do not follow what the sequence
  //    holds (a sequence it has never seen, starting at 4). The error
  //    travels back through the mlp-worker, naming the shard.
  r = pipeline.Run(2, plan_of(1008, 4, prompt));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("attn-worker 0"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("cannot append at 4"));

  // 3. The KV operations: attaching blocks no shard has cached.
  KvOps ops;
  ops.attach.push_back({1009, 0, {0x1234}, 0, {}});
  const absl::Status st = pipeline.UpdateKv(ops);
  EXPECT_FALSE(st.ok());

  // ... and the pipeline still computes the reference's first token.
  r = pipeline.Run(3, plan_of(1010, 0, prompt));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 1u);
  const Answer want = Reference(m, prompt, 1);
  EXPECT_EQ((*r)[0].token, want.tokens[0]);
  EXPECT_EQ((*r)[0].logprob, want.logprobs[0]);

  // 4. The executor under the scheduler: a failed step ends the request with
  //    the error (no recovery configured), never a hang.
  coord::Scheduler scheduler(SchedulerFor(m.config, kBlocks), *m.tokenizer, &pipeline);
  coord::GenerateOptions o;
  o.prompt = prompt;
  o.max_tokens = 20;
  o.sampling.temperature = 0;
  pipeline.FailNextRun();
  auto stream = scheduler.Submit(o);
  ASSERT_TRUE(stream.ok()) << stream.status();
  absl::Status error;
  Collect(**stream, &error);
  EXPECT_EQ(error.code(), absl::StatusCode::kUnavailable) << error;
  scheduler.Stop();
}

// A model that overflows on one request: the embedding of one token is NaN,
// so a prompt ending in it has logits that are not finite. The mlp-worker
// samples nothing for it and says so; that request ends with an error naming
// the position, and a request in the same steps gets the reference's tokens,
// bit for bit (nothing of the NaN reaches it). Every block comes back.
TEST(Pipeline, ARequestWhoseLogitsAreNotFiniteEndsWithAnErrorAndTheOthersAreUntouched) {
  const Model m = LoadStories();
  constexpr int64_t kBlocks = 64;
  const std::vector<int32_t> clean = m.tokenizer->Encode("Once upon a time, there was a little girl", true);
  const std::vector<int32_t> overflows = m.tokenizer->Encode("The dog barked at the cat", true);
  const int32_t poison = overflows.back();
  ASSERT_EQ(std::count(clean.begin(), clean.end(), poison), 0);
  ModelWeights weights = m.Weights();
  std::fill_n(weights.token_embd.begin() + static_cast<size_t>(poison) * m.config.dim, m.config.dim,
              std::numeric_limits<float>::quiet_NaN());
  Pipeline pipeline(m.config, std::move(weights), /*shards=*/2, kBlocks);
  coord::Scheduler scheduler(SchedulerFor(m.config, kBlocks), *m.tokenizer, &pipeline);
  std::vector<std::shared_ptr<coord::RequestStream>> streams;
  for (const auto* prompt : {&overflows, &clean}) {
    coord::GenerateOptions o;
    o.prompt = *prompt;
    o.max_tokens = 40;
    o.sampling.temperature = 0;
    auto stream = scheduler.Submit(o);
    ASSERT_TRUE(stream.ok()) << stream.status();
    streams.push_back(*stream);
  }
  absl::Status error;
  const Answer bad = Collect(*streams[0], &error);
  EXPECT_EQ(error.code(), absl::StatusCode::kInternal) << error;
  EXPECT_THAT(std::string(error.message()),
              HasSubstr(absl::StrCat("logits at position ", overflows.size() - 1, " are not finite")));
  EXPECT_TRUE(bad.tokens.empty());
  const Answer got = Collect(*streams[1], &error);
  ASSERT_TRUE(error.ok()) << error;
  const Answer want = Reference(m, clean, static_cast<int>(got.tokens.size()));
  ASSERT_GE(got.tokens.size(), 20u);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.logprobs, want.logprobs);
  const auto deadline = absl::Now() + absl::Seconds(10);
  coord::SchedulerStats stats = scheduler.Stats();
  while ((stats.running > 0 || stats.kv_blocks_free + stats.kv_blocks_cached != kBlocks) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
    stats = scheduler.Stats();
  }
  EXPECT_EQ(stats.kv_blocks_free + stats.kv_blocks_cached, kBlocks);
  const std::vector<int64_t> free = pipeline.BlocksFree();
  EXPECT_EQ(free[0], free[1]);
  scheduler.Stop();
}

// An attention worker sizes its reply slots for --max-step-tokens, and its
// request slots for --max-batch sequences besides. A frame with one sequence
// can spend the room of the other sequences' descriptors on tokens: more
// tokens than a reply slot holds. It is answered with an error frame (the
// output would have run past the slot, then the worker aborted), and the
// worker serves on.
TEST(Pipeline, AnAttentionFrameWhoseOutputCannotFitIsAnErrorFrame) {
  constexpr uint32_t kBatch = 64, kStep = 256;
  attn::ShardGeometry g;
  g.layers = 1;
  g.heads = {0, 1};
  g.gqa_ratio = 1;
  g.head_dim = 64;
  g.max_positions = 4096;
  attn::KvCacheOptions kv;
  kv.layers = 1;
  kv.kv_heads = 1;
  kv.head_dim = 64;
  kv.block_tokens = kBlockTokens;
  kv.dtype = KvDType::kF32;
  kv.blocks = 64;
  auto cache = attn::KvCache::Create(kv);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ThreadPool pool(2);
  attn::AttentionShard shard(g, cache->get(), &pool);
  const shm::AttnShape shape = g.shape();
  auto channel = shm::Channel::Create(absl::StrCat("ellm-test-attn-fit-", getpid()), 4,
                                      sizeof(shm::FrameHeader) + shape.RequestBytes(kBatch, kStep),
                                      sizeof(shm::FrameHeader) + std::max<uint64_t>(shape.ResultBytes(kStep), 4096));
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::atomic<bool> stop{false};
  std::thread serve([&] {
    attn::ServeOptions o;
    o.stop = [&] { return stop.load(); };
    attn::ServeChannel(**channel, shard, o);
  });
  auto peer = shm::Channel::Open((*channel)->name(), absl::Seconds(5));
  ASSERT_TRUE(peer.ok()) << peer.status();
  shm::WaitOptions wait;
  wait.timeout = absl::Seconds(30);
  // One sequence at `start` with `n` tokens; returns the reply's kind and
  // status.
  auto send = [&](uint64_t step, uint32_t start, uint32_t n) -> std::pair<uint16_t, absl::Status> {
    const shm::SeqSlice slice{7, start, n};
    std::string payload(reinterpret_cast<const char*>(&slice), sizeof(slice));
    payload.append(n * (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim * sizeof(float), '\0');
    shm::FrameHeader h;
    h.kind = static_cast<uint16_t>(shm::FrameKind::kAttnRequest);
    h.step = step;
    h.n_seqs = 1;
    h.n_tokens = n;
    h.payload_bytes = payload.size();
    EXPECT_TRUE((*peer)->requests().Write(h, payload.data(), wait).ok());
    absl::StatusOr<shm::Ring::Frame> reply = (*peer)->replies().BeginRead(wait);
    EXPECT_TRUE(reply.ok()) << reply.status();
    if (!reply.ok()) return {0, reply.status()};
    const uint16_t kind = reply->header.kind;
    const absl::Status st = kind == static_cast<uint16_t>(shm::FrameKind::kError)
                                ? shm::DecodeError(reply->header, reply->payload)
                                : absl::OkStatus();
    (*peer)->replies().EndRead();
    return {kind, st};
  };
  ASSERT_LE(shape.RequestBytes(1, kStep + 1), shape.RequestBytes(kBatch, kStep)) << "the frame fits its request slot";
  auto [kind, st] = send(1, 0, kStep + 1);
  EXPECT_EQ(kind, static_cast<uint16_t>(shm::FrameKind::kError));
  EXPECT_THAT(std::string(st.message()), HasSubstr("reply slots hold"));
  std::tie(kind, st) = send(2, 0, 4);  // and the next frame is served
  EXPECT_EQ(kind, static_cast<uint16_t>(shm::FrameKind::kAttnResult)) << st;
  stop = true;
  serve.join();
}

}  // namespace
}  // namespace ellm
