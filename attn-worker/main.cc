// ellm-attn-worker: owns KV heads [a, b) of every layer on one NUMA node and
// answers the mlp-worker's attention requests through a shared-memory channel.
// A thin shell: flags -> AttnWorkerConfig -> KvCache + AttentionShard, a gRPC
// control server, and the ring loop.
#include <numa.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "attn-worker/attention_kernels.h"
#include "attn-worker/attention_shard.h"
#include "attn-worker/kv_cache.h"
#include "attn-worker/kv_store.h"
#include "attn-worker/serve.h"
#include "attn-worker/synthetic_fill.h"
#include "core/args.h"
#include "core/gguf.h"
#include "core/log.h"
#include "core/read_probe.h"
#include "core/model_config.h"
#include "core/signals.h"
#include "core/thread_pool.h"
#include "core/topology.h"
#include "proto/ellm.grpc.pb.h"
#include "proto/control_secret.h"
#include "proto/grpc_status.h"
#include "proto/kv_ops_proto.h"
#include "shm/channel.h"
#include "shm/messages.h"

namespace ellm::attn {
namespace {

struct AttnWorkerConfig {
  std::string model_path;
  int shard = 0;
  KvHeads heads;  // --kv-heads
  std::string channel;
  std::string listen;
  int numa_node = -1;
  std::vector<int> cpus;
  int threads = 1;
  int64_t kv_cache_bytes = 0;
  int block_tokens = 16;
  int max_batch = 16;
  int max_step_tokens = 256;
  KvDType kv_dtype = KvDType::kInt8;
  Isa kernel = Isa::kAuto;
  std::string kv_store;
  int64_t kv_store_bytes = 0;
  std::string control_secret_file;
  int probe_mb = 256;
};

// The flags, spelled as on every ellm binary (core/args.h).
Args Flags() {
  Args a(
      "ellm-attn-worker: attention shard of ellm (started by ellm-launch).\n"
      "Owns KV heads [a, b) of every layer in node-local memory and answers\n"
      "attention requests over a shared-memory channel.");
  a.Flag("model", "", "GGUF model file (only its metadata is read)");
  a.Flag("shard", "0", "index of this attention shard (for logs and info)");
  a.Flag("kv-heads", "", "KV heads this shard owns, as BEGIN:END (end exclusive)");
  a.Flag("channel", "", "name of the shared-memory channel to create");
  a.Flag("listen", "", "gRPC control address, e.g. unix:/tmp/x.sock");
  a.Flag("numa-node", "-1", "NUMA node to bind memory and threads to (-1: none)");
  a.Flag("cpus", "", "cpus for the attention threads, e.g. 0-7 (default: the node's cores)");
  a.Flag("threads", "0", "attention threads (default: one per cpu in --cpus)");
  a.Flag("kv-cache-mb", "256", "KV cache size of this shard in MiB");
  a.Flag("block-tokens", "16", "positions per KV block (a multiple of 16 for int8 and f16)");
  a.Flag("kv-dtype", "int8",
         "KV cache element type: int8 (per-position asymmetric codes, f16 scale and min), "
         "f16, or f32 (bit-exact with the fp32 reference forward)");
  a.Flag("attn-kernel", "auto",
         "attention kernel for int8/f16: auto (the fastest batch-independent one this CPU runs), "
         "reference, avx2, avx2-vnni, avx512 or amx (int8 prefill on the AMX tile unit, p·V in bf16: "
         "a token's rounding then depends on how its prompt was cut into steps)");
  a.Flag("kv-store", "",
         "folder of the KV store: prefix-cache blocks written to disk, loaded back on a match "
         "(empty: none)");
  a.Flag("kv-store-kb", "8388608", "most KiB of this shard's KV store files (least recently used go first)");
  a.Flag("probe-mb", "256",
         "read-bandwidth probe at start-up over this many MiB (the bandwidth accounting's reference; 0: none)");
  a.Flag("max-batch", "16", "most sequences in one step");
  a.Flag("max-step-tokens", "256", "most tokens in one step");
  a.Flag("control-secret-file", "",
         "file (0600) holding the launch's control secret; every control call must carry it");
  a.Flag("log-level", "info", "debug, info, warning or error");
  return a;
}

absl::StatusOr<AttnWorkerConfig> ConfigFromFlags(const Args& args) {
  AttnWorkerConfig c;
  c.model_path = args.Get("model");
  c.channel = args.Get("channel");
  c.listen = args.Get("listen");
  c.kv_store = args.Get("kv-store");
  c.control_secret_file = args.Get("control-secret-file");
  int kv_cache_mb = 0;
  int kv_store_kb = 0;
  RETURN_IF_ERROR(args.GetInts({{"shard", &c.shard}, {"numa-node", &c.numa_node},
                                {"kv-cache-mb", &kv_cache_mb}, {"block-tokens", &c.block_tokens},
                                {"max-batch", &c.max_batch}, {"max-step-tokens", &c.max_step_tokens},
                                {"probe-mb", &c.probe_mb}, {"kv-store-kb", &kv_store_kb},
                                {"threads", &c.threads}}));
  c.kv_cache_bytes = int64_t{kv_cache_mb} << 20;
  c.kv_store_bytes = int64_t{kv_store_kb} << 10;
  if (c.control_secret_file.empty()) {
    return absl::InvalidArgumentError("--control-secret-file is required (ellm-launch writes one)");
  }
  if (c.model_path.empty()) return absl::InvalidArgumentError("--model is required");
  if (c.kv_store_bytes <= 0) return absl::InvalidArgumentError("--kv-store-kb must be positive");
  if (c.channel.empty()) return absl::InvalidArgumentError("--channel is required");
  if (c.listen.empty()) return absl::InvalidArgumentError("--listen is required");
  absl::StatusOr<KvHeads> heads = KvHeads::Parse(args.Get("kv-heads"));
  if (!heads.ok()) return absl::InvalidArgumentError(absl::StrCat("--kv-heads: ", heads.status().message()));
  c.heads = *heads;
  if (c.kv_cache_bytes <= 0 || c.block_tokens <= 0 || c.max_batch <= 0 ||
      c.max_step_tokens <= 0) {
    return absl::InvalidArgumentError(
        "--kv-cache-mb, --block-tokens, --max-batch and --max-step-tokens must be positive");
  }
  const std::string cpus = args.Get("cpus");
  if (!cpus.empty()) {
    ASSIGN_OR_RETURN(c.cpus, ParseCpuList(cpus));
  } else if (c.numa_node >= 0) {
    ASSIGN_OR_RETURN(Topology topo, DiscoverTopology());
    for (const NumaNode& n : topo.nodes) {
      if (n.id == c.numa_node) c.cpus = n.cpus;
    }
  }
  ASSIGN_OR_RETURN(c.kv_dtype, ParseKvDType(args.Get("kv-dtype")));
  ASSIGN_OR_RETURN(c.kernel, ParseIsa(args.Get("attn-kernel")));
  if (c.threads <= 0) c.threads = c.cpus.empty() ? 1 : static_cast<int>(c.cpus.size());
  return c;
}

// The control plane: info, freeing finished sequences, shutdown.
class ControlService final : public ellm::v1::WorkerControl::Service {
 public:
  ControlService(const AttnWorkerConfig& config, CallSecret secret, KvCache* cache, std::mutex* cache_mu,
                 KvStore* store, const AttentionShard* shard, double probe_bytes_per_second,
                 std::atomic<int64_t>* steps, std::atomic<int64_t>* busy_ns)
      : config_(config),
        secret_(std::move(secret)),
        cache_(cache),
        cache_mu_(cache_mu),
        store_(store),
        shard_(shard),
        kernel_(shard->kernel_name()),
        probe_bytes_per_second_(probe_bytes_per_second),
        steps_(steps),
        busy_ns_(busy_ns) {}

  grpc::Status GetInfo(grpc::ServerContext* ctx, const ellm::v1::GetInfoRequest*,
                       ellm::v1::WorkerInfo* info) override {
    if (grpc::Status denied = secret_.Check(ctx, "GetInfo"); !denied.ok()) return denied;
    std::lock_guard<std::mutex> lock(*cache_mu_);
    info->set_role(ellm::v1::WORKER_ROLE_ATTN);
    info->set_pid(getpid());
    info->set_model_path(config_.model_path);
    info->set_channel(config_.channel);
    info->set_shard(config_.shard);
    info->set_kv_head_begin(config_.heads.begin);
    info->set_kv_head_end(config_.heads.end);
    info->set_kv_blocks_total(cache_->blocks_total());
    info->set_kv_blocks_free(cache_->blocks_free());
    info->set_kv_blocks_cached(cache_->blocks_cached());
    info->set_kv_read_bytes(shard_->kv_read_bytes());
    info->set_probe_bytes_per_second(probe_bytes_per_second_);
    info->set_kv_block_tokens(config_.block_tokens);
    info->set_numa_node(config_.numa_node);
    info->set_kernel(kernel_);
    info->set_threads(config_.threads);
    info->set_steps(steps_->load());
    info->set_busy_seconds(static_cast<double>(busy_ns_->load()) * 1e-9);
    info->set_max_batch(config_.max_batch);
    info->set_max_step_tokens(config_.max_step_tokens);
    return grpc::Status::OK;
  }

  grpc::Status UpdateKv(grpc::ServerContext* ctx, const ellm::v1::UpdateKvRequest* req,
                        ellm::v1::UpdateKvResponse* resp) override {
    if (grpc::Status denied = secret_.Check(ctx, "UpdateKv"); !denied.ok()) return denied;
    std::lock_guard<std::mutex> lock(*cache_mu_);
    const KvOps ops = FromProto(*req);
    const absl::Status st = cache_->Apply(ops);
    if (!st.ok()) LogError("KV update refused: %s", st.ToString());
    if (st.ok() && store_ != nullptr) {
      // Write-through: every published block goes to the store's writer.
      for (const KvOps::SequenceBlocks& p : ops.publish) {
        if (p.tokens.size() != p.keys.size() * static_cast<size_t>(config_.block_tokens)) continue;
        for (size_t i = 0; i < p.keys.size(); ++i) {
          if (!store_->Wants(p.keys[i])) continue;  // stored, queued, or no room: no copy
          absl::StatusOr<std::string> bytes = cache_->CachedBlockBytes(p.keys[i]);
          if (!bytes.ok()) continue;
          store_->Save(p.keys[i], i == 0 ? p.parent : p.keys[i - 1],
                       p.tokens.data() + i * config_.block_tokens, *std::move(bytes));
        }
      }
    }
    resp->set_kv_blocks_free(cache_->blocks_free());
    resp->set_kv_blocks_cached(cache_->blocks_cached());
    return ToGrpcStatus(st);
  }

  grpc::Status ListStoredBlocks(grpc::ServerContext* ctx, const ellm::v1::ListStoredBlocksRequest*,
                                ellm::v1::ListStoredBlocksResponse* resp) override {
    if (grpc::Status denied = secret_.Check(ctx, "ListStoredBlocks"); !denied.ok()) return denied;
    resp->set_enabled(store_ != nullptr);
    if (store_ == nullptr) return grpc::Status::OK;
    resp->set_capacity_blocks(store_->capacity_blocks());
    for (const KvStore::Stored& s : store_->List()) {
      ellm::v1::StoredBlock* b = resp->add_blocks();
      b->set_key(s.key);
      b->set_parent(s.parent);
      for (int32_t t : s.tokens) b->add_tokens(t);
    }
    return grpc::Status::OK;
  }

  grpc::Status LoadBlocks(grpc::ServerContext* ctx, const ellm::v1::LoadBlocksRequest* req,
                          ellm::v1::LoadBlocksResponse* resp) override {
    if (grpc::Status denied = secret_.Check(ctx, "LoadBlocks"); !denied.ok()) return denied;
    std::lock_guard<std::mutex> lock(*cache_mu_);
    int loaded = 0;
    const absl::Time start = absl::Now();
    if (store_ != nullptr) {
      for (uint64_t key : req->keys()) {
        absl::StatusOr<std::string> bytes = store_->Load(key);
        if (!bytes.ok()) break;  // logged by the store
        const absl::Status st = cache_->InsertCached(key, *bytes);
        if (!st.ok() && st.code() != absl::StatusCode::kInvalidArgument) {
          LogWarning("KV store: block %d not loaded: %s", key, st.message());
          break;
        }
        ++loaded;
      }
      cache_->EndInserts();
    }
    if (loaded > 0) {
      LogInfo("KV store: loaded %d of %d blocks in %.0f ms", loaded, req->keys_size(),
              absl::ToDoubleMilliseconds(absl::Now() - start));
    }
    resp->set_loaded(loaded);
    return grpc::Status::OK;
  }

  grpc::Status Shutdown(grpc::ServerContext* ctx, const ellm::v1::ShutdownRequest*,
                        ellm::v1::ShutdownResponse*) override {
    if (grpc::Status denied = secret_.Check(ctx, "Shutdown"); !denied.ok()) return denied;
    LogInfo("shutdown requested over gRPC");
    RequestStop();
    return grpc::Status::OK;
  }

  grpc::Status FillSynthetic(grpc::ServerContext* ctx, const ellm::v1::FillSyntheticRequest* req,
                             ellm::v1::FillSyntheticResponse*) override {
    if (grpc::Status denied = secret_.Check(ctx, "FillSynthetic"); !denied.ok()) return denied;
    std::lock_guard<std::mutex> lock(*cache_mu_);
    const absl::Time start = absl::Now();
    absl::Status st = attn::FillSynthetic(cache_, req->sequence_id(), req->positions(), req->seed());
    if (st.ok()) {
      LogInfo("benchmark: %d positions of random K/V for sequence %d in %.0f ms", req->positions(),
              req->sequence_id(), absl::ToDoubleMilliseconds(absl::Now() - start));
    }
    return ToGrpcStatus(st);
  }

 private:
  const AttnWorkerConfig& config_;
  const CallSecret secret_;
  KvCache* cache_;
  std::mutex* cache_mu_;
  KvStore* store_;  // null without --kv-store
  const AttentionShard* shard_;
  std::string kernel_;
  double probe_bytes_per_second_;
  std::atomic<int64_t>* steps_;
  std::atomic<int64_t>* busy_ns_;
};

absl::Status Run(const AttnWorkerConfig& config) {
  ASSIGN_OR_RETURN(auto file, GgufFile::Open(config.model_path));
  ASSIGN_OR_RETURN(ModelConfig model, ModelConfig::FromGguf(*file));
  if (config.heads.end > model.n_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("--kv-heads ", config.heads.Flag(),
                                                   " exceeds the model's ", model.n_kv_heads,
                                                   " KV heads"));
  }
  ShardGeometry geometry;
  geometry.layers = model.n_layers;
  geometry.heads = config.heads;
  geometry.gqa_ratio = model.gqa_ratio();
  geometry.head_dim = model.head_dim;
  geometry.max_positions = model.context_length;

  // The node's memory for the KV cache and its CPUs for the threads: what
  // cannot be bound is said, never assumed.
  bool numa_bound = false;
  if (config.numa_node >= 0) {
    if (numa_available() < 0) {
      LogWarning("--numa-node=%d: this system gives no NUMA support (libnuma: numa_available < 0); the KV cache "
                 "and threads are not bound to a node", config.numa_node);
    } else if (config.numa_node > numa_max_node() || !numa_bitmask_isbitset(numa_all_nodes_ptr, config.numa_node)) {
      return absl::InvalidArgumentError(absl::StrCat("--numa-node=", config.numa_node,
                                                     ": no such node, or not one this process may use"));
    } else {
      numa_bound = true;
      if (numa_run_on_node(config.numa_node) != 0) {
        LogWarning("cannot run on NUMA node %d (%s): the threads may run on other nodes", config.numa_node,
                   strerror(errno));
      }
      numa_set_preferred(config.numa_node);
    }
    if (config.cpus.empty()) {
      LogWarning("no CPU of NUMA node %d is known here: one attention thread, not pinned", config.numa_node);
    }
  }
  KvCacheOptions kv;
  kv.layers = model.n_layers;
  kv.kv_heads = geometry.kv_heads();
  kv.head_dim = model.head_dim;
  kv.block_tokens = config.block_tokens;
  kv.numa_node = numa_bound ? config.numa_node : -1;
  kv.dtype = config.kv_dtype;
  if (absl::Status st = KvFormat::Make(kv.dtype, kv.head_dim).CheckBlockTokens(kv.block_tokens); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--block-tokens: ", st.message()));
  }
  kv.blocks = config.kv_cache_bytes / static_cast<int64_t>(KvCache::BlockBytes(kv));
  if (kv.blocks <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--kv-cache-mb is too small for one block of ",
                                                   KvCache::BlockBytes(kv), " bytes"));
  }
  ASSIGN_OR_RETURN(auto cache, KvCache::Create(kv));
  LogInfo("KV heads %s of %d layers: %d blocks of %d positions (%.1f MiB %s, %s)",
          config.heads.ToString(), model.n_layers, kv.blocks, kv.block_tokens,
          (KvCache::BlockBytes(kv) * kv.blocks) / 1048576.0, std::string(KvDTypeName(kv.dtype)),
          numa_bound ? absl::StrCat("NUMA node ", config.numa_node) : "no NUMA binding");

  ThreadPool pool(config.threads, config.cpus);
  ASSIGN_OR_RETURN(const AttentionKernel* kernel, SelectKernel(config.kernel));
  AttentionShard shard(geometry, cache.get(), &pool, kernel);
  LogInfo("attention kernel %s%s, %d threads%s", shard.kernel_name(),
          kv.dtype == KvDType::kF32 ? ""
                                    : absl::StrCat(", chunks of ", shard.chunk_positions(), " positions"),
          pool.size(),
          config.cpus.empty() ? "" : absl::StrCat(" on cpus ", FormatCpuList(config.cpus)));

  const shm::AttnShape shape = geometry.shape();
  const uint64_t request_bytes =
      sizeof(shm::FrameHeader) + shape.RequestBytes(config.max_batch, config.max_step_tokens);
  const uint64_t reply_bytes =
      sizeof(shm::FrameHeader) + std::max<uint64_t>(shape.ResultBytes(config.max_step_tokens), 4096);
  ASSIGN_OR_RETURN(auto channel, shm::Channel::Create(config.channel, 4, request_bytes, reply_bytes));

  std::mutex cache_mu;
  std::atomic<int64_t> steps{0}, busy_ns{0};
  ASSIGN_OR_RETURN(CallSecret secret,
                   CallSecret::FromFile(CallSecret::Kind::kControl, config.control_secret_file));
  double probe_bytes_per_second = 0;
  if (config.probe_mb > 0) {
    ReadProbe probe(int64_t{config.probe_mb} << 20);
    probe_bytes_per_second = probe.Measure(pool) * 1e9;
    LogInfo("read bandwidth of this node (probe, %d threads): %.1f GB/s", pool.size(), probe_bytes_per_second / 1e9);
  }
  // This thread is pool thread 0, pinned to one core; the threads it starts
  // now (the KV-store writer, gRPC's) inherit its affinity. They get the
  // shard's CPUs instead, and this thread its core back once they run.
  if (!config.cpus.empty()) SetCurrentThreadCpus(config.cpus);
  std::unique_ptr<KvStore> store;
  if (!config.kv_store.empty()) {
    KvStoreLayout layout;
    const absl::Time start = absl::Now();
    LogInfo("KV store: fingerprinting the model file (%.1f MiB)...", static_cast<double>(file->size()) / 1048576.0);
    layout.model = file->Fingerprint();
    LogInfo("KV store: model fingerprint %016x (%.1f s)", layout.model, absl::ToDoubleSeconds(absl::Now() - start));
    layout.dtype = kv.dtype;
    layout.block_tokens = kv.block_tokens;
    layout.layers = kv.layers;
    layout.head_dim = kv.head_dim;
    layout.heads = config.heads;
    layout.payload_bytes = KvCache::BlockBytes(kv);
    absl::StatusOr<std::unique_ptr<KvStore>> opened = KvStore::Open(config.kv_store, config.kv_store_bytes, layout);
    if (opened.ok()) {
      store = *std::move(opened);
    } else {
      LogWarning("running without a KV store: %s", opened.status().message());
    }
  }

  ControlService control(config, std::move(secret), cache.get(), &cache_mu, store.get(), &shard,
                         probe_bytes_per_second, &steps, &busy_ns);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(config.listen, grpc::InsecureServerCredentials());
  builder.RegisterService(&control);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", config.listen));
  }
  if (!config.cpus.empty()) PinCurrentThread(config.cpus[0]);
  server->GetHealthCheckService()->SetServingStatus(true);
  LogInfo("serving channel %s, control on %s", config.channel, config.listen);

  ServeOptions serve;
  serve.stop = [] { return StopRequested(); };
  serve.cache_mu = &cache_mu;
  serve.steps = &steps;
  serve.busy_ns = &busy_ns;
  ServeChannel(*channel, shard, serve);
  LogInfo("stopping");
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return absl::OkStatus();
}

}  // namespace
}  // namespace ellm::attn

int main(int argc, char** argv) {
  ellm::DieWithParent();
  ellm::Args args = ellm::attn::Flags();
  if (std::optional<int> exit_code = args.ParseFlagsOnly(argc, argv)) return *exit_code;
  ellm::LogLevel level = ellm::LogLevel::kInfo;
  if (!ellm::ParseLogLevel(args.Get("log-level"), &level)) {
    std::fprintf(stderr, "--log-level must be debug, info, warning or error, got '%s'\n",
                 args.Get("log-level").c_str());
    return 2;
  }
  ellm::SetLogIdentity(absl::StrCat("attn-worker[", args.Get("shard"), "]"), level);
  ellm::InstallStopSignalHandlers();
  absl::StatusOr<ellm::attn::AttnWorkerConfig> config = ellm::attn::ConfigFromFlags(args);
  if (!config.ok()) {
    ellm::LogError("%s", config.status().message());
    return 2;
  }
  absl::Status status = ellm::attn::Run(*config);
  if (!status.ok()) {
    ellm::LogError("%s", status.ToString());
    return 1;
  }
  return 0;
}
