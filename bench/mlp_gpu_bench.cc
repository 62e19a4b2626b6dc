// ellm-mlp-bench: the CUDA MLP backend on its own, on model shapes that need
// no file (random bf16 weights generated on the device).
//
// Prints key=value lines:
//   device ...                         the GPU
//   d2d_copy ... gbps=                 measured device-to-device copy bandwidth
//                                      (bytes read + written), the ceiling
//   model ... bound_ms=                weight bytes read per step / that bandwidth
//   decode ... step_ms= of_bound=      one decode step of `batch` sequences
//                                      through the backend API: per layer q, k, v
//                                      to host buffers (as into ring slots), the
//                                      attention answered at once (its output is
//                                      the q just written), then the MLP; logits
//                                      of every sequence to the host
//   ring_step ... step_ms=             the same step through StepRunner and real
//                                      shared-memory rings, with attention workers
//                                      on threads that answer at once (sampling
//                                      on the host included)
//   ring_hop ... median_us=            one layer's hop alone: device -> request
//                                      slot -> attention thread -> reply slot ->
//                                      device, with empty attention
// Timings are medians over --iters after --warmup.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/args.h"
#include "core/log.h"
#include "core/model_config.h"
#include "mlp-worker/backend.h"
#include "mlp-worker/cuda/cuda_backend.h"
#include "mlp-worker/cuda/cuda_util.h"
#include "mlp-worker/cuda/kernels.h"
#include "mlp-worker/step_runner.h"
#include "shm/channel.h"
#include "shm/messages.h"

namespace ellm::mlp {
namespace {

// The flags, spelled as on every ellm binary (core/args.h).
Args Flags() {
  Args a(
      "ellm-mlp-bench: per-step time of the CUDA MLP backend on random models of real shapes,\n"
      "against the weight-read bound, and the ring hop's round trip.");
  a.Flag("models", "qwen2.5-14b,llama3-8b", "model shapes: qwen2.5-14b, llama3-8b");
  a.Flag("batches", "1,8,64", "sequences per decode step");
  a.Flag("iters", "20", "timed steps per configuration");
  a.Flag("warmup", "3", "untimed steps first (graphs are captured on a step's second use)");
  a.Flag("device", "0", "CUDA device");
  a.Flag("graphs", "both", "CUDA graphs: off, on or both");
  a.Flag("io", "mapped,memcpy",
         "ring I/O paths to time: mapped (kernels address registered host memory), memcpy");
  a.Flag("shards", "2", "attention shards the KV heads are split over");
  a.Flag("hop-iters", "2000", "ring hops timed per batch size");
  a.Flag("ring-steps", "true", "also time whole steps through StepRunner and real rings (true or false)",
         true);
  return a;
}

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct Stats {
  double median = 0, p90 = 0;
};
Stats Summarise(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.median = v[v.size() / 2];
  s.p90 = v[std::min(v.size() - 1, v.size() * 9 / 10)];
  return s;
}

absl::StatusOr<ModelConfig> Shape(const std::string& name) {
  ModelConfig c;
  c.name = name;
  if (name == "qwen2.5-14b") {
    c.arch = "qwen2";
    c.n_layers = 48;
    c.dim = 5120;
    c.ffn_dim = 13824;
    c.n_heads = 40;
    c.n_kv_heads = 8;
    c.rope_base = 1e6f;
    c.norm_eps = 1e-6f;
    c.vocab_size = 152064;
    c.context_length = 32768;
    c.rope_neox = true;
    c.qkv_bias = true;
  } else if (name == "llama3-8b") {
    c.arch = "llama";
    c.n_layers = 32;
    c.dim = 4096;
    c.ffn_dim = 14336;
    c.n_heads = 32;
    c.n_kv_heads = 8;
    c.rope_base = 500000.0f;
    c.norm_eps = 1e-5f;
    c.vocab_size = 128256;
    c.context_length = 8192;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown model shape ", name));
  }
  c.head_dim = 128;
  c.rope_dims = 128;
  RETURN_IF_ERROR(c.Validate());
  return c;
}

// Weight bytes one decode step reads: every layer's matrices and the LM head
// (bf16); the embedding rows and the norms are noise.
double StepWeightBytes(const ModelConfig& c) {
  const double dim = c.dim, qkv = c.q_dim() + 2.0 * c.kv_dim(), ffn = c.ffn_dim;
  const double layer = qkv * dim + dim * c.q_dim() + 3 * ffn * dim;
  return 2.0 * (c.n_layers * layer + static_cast<double>(c.vocab_size) * dim);
}

// Device-to-device copy bandwidth in GB/s, counting bytes read and written.
absl::StatusOr<double> CopyBandwidth(size_t bytes) {
  ASSIGN_OR_RETURN(auto a, cuda::DeviceArray<uint8_t>::Alloc(bytes));
  ASSIGN_OR_RETURN(auto b, cuda::DeviceArray<uint8_t>::Alloc(bytes));
  CUDA_RETURN_IF_ERROR(cudaMemset(a.get(), 1, bytes));
  ASSIGN_OR_RETURN(auto start, cuda::MakeEvent(true));
  ASSIGN_OR_RETURN(auto stop, cuda::MakeEvent(true));
  for (int i = 0; i < 2; ++i) CUDA_RETURN_IF_ERROR(cudaMemcpy(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice));
  std::vector<double> gbps;
  for (int i = 0; i < 10; ++i) {
    CUDA_RETURN_IF_ERROR(cudaEventRecord(start.get(), 0));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, 0));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(stop.get(), 0));
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop.get()));
    float ms = 0;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    gbps.push_back(2.0 * bytes / (ms * 1e-3) / 1e9);
  }
  return Summarise(gbps).median;
}

// Page-aligned host memory.
struct HostBlock {
  explicit HostBlock(size_t n) : bytes((n + 4095) / 4096 * 4096) {
    data = static_cast<float*>(std::aligned_alloc(4096, bytes));
    std::memset(data, 0, bytes);
  }
  ~HostBlock() { std::free(data); }
  size_t bytes;
  float* data;
};

std::vector<KvHeads> ShardBounds(const ModelConfig& c, int shards) {
  shards = std::max(1, std::min(shards, c.n_kv_heads));
  std::vector<KvHeads> b;
  for (int s = 0; s < shards; ++s) b.push_back(SplitKvHeads(c.n_kv_heads, shards, s));
  return b;
}

// Decode steps through the backend API, attention answered at once.
absl::StatusOr<Stats> TimeDecode(MlpBackend& backend, const ModelConfig& c, int batch,
                                 int shards, bool register_memory, int warmup, int iters) {
  const auto bounds = ShardBounds(c, shards);
  const int hd = c.head_dim, g = c.gqa_ratio();
  HostBlock block(static_cast<size_t>(batch) * (c.q_dim() + 2 * c.kv_dim()) * sizeof(float));
  if (register_memory) RETURN_IF_ERROR(backend.RegisterHostMemory(block.data, block.bytes));
  std::vector<MlpBackend::ShardIo> io(bounds.size());
  float* cursor = block.data;
  for (size_t s = 0; s < bounds.size(); ++s) {
    const int kvh = bounds[s].count();
    io[s].heads = bounds[s];
    io[s].q = cursor;
    io[s].attn = cursor;  // the attention "answers" with the q it was sent
    cursor += static_cast<size_t>(batch) * kvh * g * hd;
    io[s].k = cursor;
    cursor += static_cast<size_t>(batch) * kvh * hd;
    io[s].v = cursor;
    cursor += static_cast<size_t>(batch) * kvh * hd;
  }
  std::mt19937 rng(batch);
  std::vector<int32_t> tokens(batch), positions(batch), rows(batch);
  for (int i = 0; i < batch; ++i) {
    tokens[i] = static_cast<int32_t>(rng() % c.vocab_size);
    positions[i] = 1000 + i;
    rows[i] = i;
  }
  std::vector<float> logits(static_cast<size_t>(batch) * c.vocab_size);
  std::vector<double> ms;
  for (int it = 0; it < warmup + iters; ++it) {
    const Clock::time_point t0 = Clock::now();
    RETURN_IF_ERROR(backend.BeginStep(tokens.data(), positions.data(), batch));
    for (int layer = 0; layer < c.n_layers; ++layer) {
      RETURN_IF_ERROR(backend.StageQkv(layer));
      RETURN_IF_ERROR(backend.WriteQkvShards(io.data(), static_cast<int>(io.size())));
      RETURN_IF_ERROR(backend.CompleteLayerFromShards(layer, io.data(), static_cast<int>(io.size())));
    }
    RETURN_IF_ERROR(backend.ComputeLogits(rows.data(), batch, logits.data()));
    if (it >= warmup) ms.push_back(Ms(Clock::now() - t0));
  }
  for (float x : logits) {
    if (!std::isfinite(x)) return absl::InternalError("non-finite logits");
  }
  if (register_memory) backend.UnregisterHostMemory(block.data);
  return Summarise(ms);
}

// A stand-in attention worker on a thread: creates its channel and answers
// every request at once with an (unwritten) output of the right size.
class EmptyAttention {
 public:
  EmptyAttention(const ModelConfig& c, int kv_begin, int kv_end, int max_seqs, int max_tokens)
      : shape_{(kv_end - kv_begin) * c.gqa_ratio(), kv_end - kv_begin, c.head_dim} {
    static int counter = 0;
    name_ = absl::StrCat("ellm-bench-", getpid(), "-", counter++);
    auto channel = shm::Channel::Create(
        name_, 2, sizeof(shm::FrameHeader) + shape_.RequestBytes(max_seqs, max_tokens),
        sizeof(shm::FrameHeader) + shape_.ResultBytes(max_tokens));
    status_ = channel.status();
    if (!channel.ok()) return;
    channel_ = std::move(*channel);
    thread_ = std::thread([this] { Serve(); });
  }
  ~EmptyAttention() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  const absl::Status& status() const { return status_; }
  const std::string& name() const { return name_; }

 private:
  void Serve() {
    shm::WaitOptions wait;
    wait.spin = absl::Milliseconds(2);  // an attention worker under load is awake
    wait.peer_alive = [this] { return !stop_.load(); };
    while (!stop_) {
      absl::StatusOr<shm::Ring::Frame> frame = channel_->requests().BeginRead(wait);
      if (!frame.ok()) continue;
      const shm::FrameHeader h = frame->header;
      absl::StatusOr<uint8_t*> slot = channel_->replies().BeginWrite(wait);
      if (slot.ok()) {
        shm::FrameHeader reply;
        reply.kind = static_cast<uint16_t>(shm::FrameKind::kAttnResult);
        reply.step = h.step;
        reply.layer = h.layer;
        reply.n_seqs = h.n_seqs;
        reply.n_tokens = h.n_tokens;
        reply.payload_bytes = shape_.ResultBytes(h.n_tokens);
        channel_->replies().CommitWrite(reply);
      }
      channel_->requests().EndRead();
    }
  }

  shm::AttnShape shape_;
  std::string name_;
  absl::Status status_;
  std::unique_ptr<shm::Channel> channel_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

struct Workers {
  std::vector<std::unique_ptr<EmptyAttention>> attn;
  std::vector<std::unique_ptr<shm::Channel>> channels;  // the mlp side
  std::vector<ShardLink> links;
};

absl::StatusOr<std::unique_ptr<Workers>> StartWorkers(const ModelConfig& c, int shards,
                                                      int batch) {
  auto w = std::make_unique<Workers>();
  int i = 0;
  for (const KvHeads& heads : ShardBounds(c, shards)) {
    w->attn.push_back(std::make_unique<EmptyAttention>(c, heads.begin, heads.end, batch, batch));
    RETURN_IF_ERROR(w->attn.back()->status());
    ASSIGN_OR_RETURN(auto channel, shm::Channel::Open(w->attn.back()->name(), absl::Seconds(10)));
    w->links.push_back({i++, heads, channel.get()});
    w->channels.push_back(std::move(channel));
  }
  return w;
}

shm::StepPlan DecodePlan(const ModelConfig& c, int batch) {
  shm::StepPlan plan;
  std::mt19937 rng(batch + 1);
  for (int i = 0; i < batch; ++i) {
    shm::PlanSeq s;
    s.slice = {static_cast<uint64_t>(i + 1), static_cast<uint32_t>(1000 + i), 1};
    s.sample = 1;
    s.temperature = 0;
    plan.seqs.push_back(s);
    plan.tokens.push_back(static_cast<int32_t>(rng() % c.vocab_size));
  }
  return plan;
}

// Whole decode steps through StepRunner and real rings.
absl::StatusOr<Stats> TimeRingSteps(MlpBackend& backend, const ModelConfig& c, int batch,
                                    int shards, int warmup, int iters) {
  ASSIGN_OR_RETURN(auto workers, StartWorkers(c, shards, batch));
  ASSIGN_OR_RETURN(auto runner, StepRunner::Create(c, &backend, workers->links, batch));
  runner->shard_timeout = absl::Seconds(30);
  const shm::StepPlan plan = DecodePlan(c, batch);
  std::vector<double> ms;
  for (int it = 0; it < warmup + iters; ++it) {
    const Clock::time_point t0 = Clock::now();
    ASSIGN_OR_RETURN(auto out, runner->Run(static_cast<uint64_t>(it + 1), plan));
    if (it >= warmup) ms.push_back(Ms(Clock::now() - t0));
    if (static_cast<int>(out.size()) != batch) return absl::InternalError("wrong sample count");
  }
  return Summarise(ms);
}

// One layer's hop: scatter q, k, v of `batch` tokens from the device into the
// request slots, wait for the replies, gather them back to the device.
absl::StatusOr<Stats> TimeHop(const ModelConfig& c, int batch, int shards, bool mapped,
                              int iters) {
  ASSIGN_OR_RETURN(auto workers, StartWorkers(c, shards, batch));
  std::vector<std::unique_ptr<cuda::HostRegistration>> regs;
  for (const auto& ch : workers->channels) {
    ASSIGN_OR_RETURN(auto reg, cuda::HostRegistration::Create(ch->memory(), ch->memory_bytes()));
    regs.push_back(std::move(reg));
  }
  auto device_ptr = [&](const void* p) -> void* {
    for (const auto& r : regs) {
      if (void* d = r->DevicePointer(p)) return d;
    }
    return nullptr;
  };
  const int hd = c.head_dim, g = c.gqa_ratio();
  const int cols = c.q_dim() + 2 * c.kv_dim();
  ASSIGN_OR_RETURN(auto stream, cuda::MakeStream());
  ASSIGN_OR_RETURN(auto qkv, cuda::DeviceArray<float>::Alloc(static_cast<size_t>(batch) * cols));
  ASSIGN_OR_RETURN(auto attn32, cuda::DeviceArray<float>::Alloc(static_cast<size_t>(batch) * c.q_dim()));
  ASSIGN_OR_RETURN(auto attn, cuda::DeviceArray<cuda::bf16_t>::Alloc(static_cast<size_t>(batch) * c.q_dim()));
  CUDA_RETURN_IF_ERROR(cuda::LaunchFillRandom(qkv.get(), static_cast<int64_t>(qkv.size()), 5, 0.0f, 1.0f, stream.get()));
  std::vector<shm::SeqSlice> slices;
  for (int i = 0; i < batch; ++i) slices.push_back({static_cast<uint64_t>(i + 1), static_cast<uint32_t>(100 + i), 1});
  const uint32_t T = batch;
  std::vector<double> us;
  const int warmup = 50;
  for (int it = 0; it < warmup + iters; ++it) {
    const Clock::time_point t0 = Clock::now();
    cuda::ShardCopyParams p;
    p.n_shards = static_cast<int>(workers->links.size());
    p.n_tokens = batch;
    p.n_heads = c.n_heads;
    p.n_kv_heads = c.n_kv_heads;
    p.head_dim = hd;
    std::vector<float*> hq, hk, hv;
    for (size_t s = 0; s < workers->links.size(); ++s) {
      const ShardLink& link = workers->links[s];
      shm::WaitOptions wait;
      wait.timeout = absl::Seconds(10);
      ASSIGN_OR_RETURN(uint8_t * slot, link.channel->requests().BeginWrite(wait));
      std::memcpy(slot, slices.data(), slices.size() * sizeof(shm::SeqSlice));
      const int kvh = link.heads.count();
      float* q = reinterpret_cast<float*>(slot + slices.size() * sizeof(shm::SeqSlice));
      float* k = q + static_cast<size_t>(T) * kvh * g * hd;
      float* v = k + static_cast<size_t>(T) * kvh * hd;
      hq.push_back(q);
      hk.push_back(k);
      hv.push_back(v);
      p.shard[s] = {static_cast<float*>(device_ptr(q)), static_cast<float*>(device_ptr(k)),
                    static_cast<float*>(device_ptr(v)), nullptr, link.heads.begin,
                    link.heads.end};
    }
    if (mapped) {
      CUDA_RETURN_IF_ERROR(cuda::LaunchScatterQkv(p, qkv.get(), cols, stream.get()));
    } else {
      for (size_t s = 0; s < workers->links.size(); ++s) {
        const ShardLink& link = workers->links[s];
        const int kvh = link.heads.count();
        const size_t qb = static_cast<size_t>(kvh) * g * hd * 4, kvb = static_cast<size_t>(kvh) * hd * 4;
        const float* base = qkv.get();
        CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(hq[s], qb, base + link.heads.begin * g * hd, cols * 4, qb, T, cudaMemcpyDeviceToHost, stream.get()));
        CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(hk[s], kvb, base + c.q_dim() + link.heads.begin * hd, cols * 4, kvb, T, cudaMemcpyDeviceToHost, stream.get()));
        CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(hv[s], kvb, base + c.q_dim() + c.kv_dim() + link.heads.begin * hd, cols * 4, kvb, T, cudaMemcpyDeviceToHost, stream.get()));
      }
    }
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream.get()));
    for (size_t s = 0; s < workers->links.size(); ++s) {
      const ShardLink& link = workers->links[s];
      const int kvh = link.heads.count();
      shm::FrameHeader h;
      h.kind = static_cast<uint16_t>(shm::FrameKind::kAttnRequest);
      h.step = static_cast<uint64_t>(it + 1);
      h.n_seqs = static_cast<uint32_t>(slices.size());
      h.n_tokens = T;
      h.payload_bytes = shm::AttnShape{kvh * g, kvh, hd}.RequestBytes(h.n_seqs, T);
      link.channel->requests().CommitWrite(h);
    }
    for (size_t s = 0; s < workers->links.size(); ++s) {
      const ShardLink& link = workers->links[s];
      shm::WaitOptions wait;
      wait.timeout = absl::Seconds(10);
      ASSIGN_OR_RETURN(shm::Ring::Frame frame, link.channel->replies().BeginRead(wait));
      const int qh = (link.heads.count()) * g;
      const float* out = reinterpret_cast<const float*>(frame.payload);
      if (mapped) {
        p.shard[s].attn = static_cast<const float*>(device_ptr(out));
      } else {
        const size_t qb = static_cast<size_t>(qh) * hd * 4;
        CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(attn32.get() + link.heads.begin * g * hd, c.q_dim() * 4, out, qb, qb, T, cudaMemcpyHostToDevice, stream.get()));
      }
    }
    if (mapped) {
      CUDA_RETURN_IF_ERROR(cuda::LaunchGatherAttn(p, attn.get(), stream.get()));
    } else {
      CUDA_RETURN_IF_ERROR(cuda::LaunchF32ToBf16(attn32.get(), attn.get(), static_cast<int64_t>(batch) * c.q_dim(), stream.get()));
    }
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream.get()));
    for (const ShardLink& link : workers->links) link.channel->replies().EndRead();
    if (it >= warmup) us.push_back(Ms(Clock::now() - t0) * 1e3);
  }
  return Summarise(us);
}

absl::Status Run(const Args& args) {
  int device = 0, shards = 0, warmup = 0, iters = 0, hop_iters = 0;
  RETURN_IF_ERROR(args.GetInts({{"device", &device}, {"shards", &shards}, {"warmup", &warmup},
                                {"iters", &iters}, {"hop-iters", &hop_iters}}));
  std::string why;
  if (!CudaDeviceAvailable(&why, device)) {
    return absl::UnavailableError(absl::StrCat("no CUDA device: ", why));
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaDeviceProp prop;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  std::string name = prop.name;
  std::replace(name.begin(), name.end(), ' ', '_');
  std::printf("device id=%d name=%s sm=%d%d sms=%d mem_gib=%.1f\n", device, name.c_str(),
              prop.major, prop.minor, prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0);
  const size_t copy_bytes = size_t{2} << 30;
  ASSIGN_OR_RETURN(const double gbps, CopyBandwidth(copy_bytes));
  std::printf("d2d_copy bytes=%zu gbps=%.1f counted=read+write\n", copy_bytes, gbps);
  std::fflush(stdout);

  std::vector<int> batches;
  for (absl::string_view b : absl::StrSplit(args.Get("batches"), ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(b, &v) || v <= 0) return absl::InvalidArgumentError("bad --batches");
    batches.push_back(v);
  }
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  std::vector<bool> graph_modes;
  const std::string graphs = args.Get("graphs");
  if (graphs == "off" || graphs == "both") graph_modes.push_back(false);
  if (graphs == "on" || graphs == "both") graph_modes.push_back(true);
  std::vector<bool> io_modes;  // true: mapped
  for (absl::string_view m : absl::StrSplit(args.Get("io"), ',', absl::SkipEmpty())) {
    if (m == "mapped") io_modes.push_back(true);
    else if (m == "memcpy") io_modes.push_back(false);
    else return absl::InvalidArgumentError("bad --io");
  }

  for (absl::string_view model : absl::StrSplit(args.Get("models"), ',', absl::SkipEmpty())) {
    ASSIGN_OR_RETURN(const ModelConfig c, Shape(std::string(model)));
    const double bytes = StepWeightBytes(c);
    const double bound_ms = bytes / (gbps * 1e9) * 1e3;
    std::printf("model name=%s layers=%d dim=%d ffn=%d heads=%d/%d vocab=%d weight_gib=%.2f "
                "bound_ms=%.3f\n",
                c.name.c_str(), c.n_layers, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads,
                c.vocab_size, bytes / 1073741824.0, bound_ms);
    std::fflush(stdout);
    for (bool use_graphs : graph_modes) {
      for (bool mapped : io_modes) {
        CudaBackendOptions options;
        options.device = device;
        options.use_graphs = use_graphs;
        options.mapped_ring_io = mapped;
        const Clock::time_point t0 = Clock::now();
        ASSIGN_OR_RETURN(auto backend, CreateCudaBackendRandom(c, 1, max_batch, options));
        std::printf("create model=%s graphs=%d io=%s ms=%.0f\n", c.name.c_str(), use_graphs,
                    mapped ? "mapped" : "memcpy", Ms(Clock::now() - t0));
        for (int batch : batches) {
          ASSIGN_OR_RETURN(Stats s, TimeDecode(*backend, c, batch, shards, true, warmup, iters));
          std::printf("decode model=%s batch=%d graphs=%d io=%s step_ms=%.3f p90_ms=%.3f "
                      "tok_s=%.1f bound_ms=%.3f of_bound=%.3f\n",
                      c.name.c_str(), batch, use_graphs, mapped ? "mapped" : "memcpy", s.median,
                      s.p90, batch / (s.median * 1e-3), bound_ms, bound_ms / s.median);
          std::fflush(stdout);
          if (args.GetBool("ring-steps")) {
            ASSIGN_OR_RETURN(Stats r, TimeRingSteps(*backend, c, batch, shards, warmup, iters));
            std::printf("ring_step model=%s batch=%d graphs=%d io=%s shards=%d step_ms=%.3f "
                        "p90_ms=%.3f tok_s=%.1f of_bound=%.3f\n",
                        c.name.c_str(), batch, use_graphs, mapped ? "mapped" : "memcpy", shards,
                        r.median, r.p90, batch / (r.median * 1e-3), bound_ms / r.median);
            std::fflush(stdout);
          }
        }
      }
    }
  }

  ASSIGN_OR_RETURN(const ModelConfig hop_model, Shape("qwen2.5-14b"));
  for (bool mapped : io_modes) {
    for (int batch : batches) {
      ASSIGN_OR_RETURN(Stats s, TimeHop(hop_model, batch, shards, mapped, hop_iters));
      std::printf("ring_hop model=%s batch=%d shards=%d io=%s median_us=%.1f p90_us=%.1f\n",
                  hop_model.name.c_str(), batch, shards, mapped ? "mapped" : "memcpy", s.median,
                  s.p90);
      std::fflush(stdout);
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace ellm::mlp

int main(int argc, char** argv) {
  ellm::Args args = ellm::mlp::Flags();
  if (std::optional<int> exit_code = args.ParseFlagsOnly(argc, argv)) return *exit_code;
  ellm::SetLogIdentity("mlp-bench");
  absl::Status st = ellm::mlp::Run(args);
  if (!st.ok()) {
    std::fprintf(stderr, "ellm-mlp-bench: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
