// ellm-mlp-worker: holds the weights and runs every step plan the coordinator
// sends: embeddings, per layer q/k/v -> attention shards -> O projection and
// MLP, then the LM head and sampling. A thin shell around StepRunner.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/args.h"
#include "core/backend_names.h"
#include "core/gguf.h"
#include "core/log.h"
#include "core/model_config.h"
#include "core/signals.h"
#include "core/weights.h"
#include "mlp-worker/backend.h"
#include "mlp-worker/serve.h"
#include "mlp-worker/step_runner.h"
#if ELLM_HAVE_CUDA
#include "mlp-worker/cuda/cuda_backend.h"
#endif
#include "proto/control_secret.h"
#include "proto/ellm.grpc.pb.h"
#include "shm/channel.h"
#include "shm/messages.h"

namespace ellm::mlp {
namespace {

struct ShardSpec {
  std::string channel;
  KvHeads heads;
};

struct MlpWorkerConfig {
  std::string model_path;
  std::string channel;
  std::vector<ShardSpec> shards;
  std::string listen;
  MlpBackendKind backend = MlpBackendKind::kCpu;  // cpu or cuda
  CpuWeights cpu_weights = CpuWeights::kNative;
  std::string matmul_isa;   // core/cpu_features.h IsaName, or "auto"
  int q8_act_bits = 8;      // cpu/matmul.h MatMul's: 8, or 7
  int threads = 1;
  int device = 0;
  bool cuda_graphs = false;
  int max_batch = 16;
  int max_step_tokens = 256;
  absl::Duration connect_timeout;
  std::string control_secret_file;
};

// The flags, spelled as on every ellm binary (core/args.h).
Args Flags() {
  Args a(
      "ellm-mlp-worker: weights and non-attention math of ellm (started by ellm-launch).\n"
      "Runs the coordinator's step plans, sending each attention shard its heads.");
  a.Flag("model", "", "GGUF model file");
  a.Flag("channel", "", "name of the shared-memory channel to create for the coordinator");
  a.Flag("attn-shards", "",
         "attention shards as CHANNEL=BEGIN:END,... (KV heads [BEGIN, END) each), in head order");
  a.Flag("listen", "", "gRPC control address, e.g. unix:/tmp/x.sock");
  a.Flag("backend", "cpu", "cpu, or cuda (a GPU; builds with the CUDA toolkit)");
  a.Flag("threads", "1", "threads of the CPU backend");
  a.Flag("matmul-isa", "auto",
         "CPU backend: instruction set of the quantised matrix kernels: auto (the fastest "
         "batch-independent set this CPU runs), reference, avx2, avx2-vnni, avx512 or amx (avx512, with "
         "the prefill of block-quantised weights (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) on the AMX tile unit in "
         "bf16: faster, but results then depend on how prompts are cut into steps; never chosen by auto)");
  a.Flag("q8-act-bits", "8",
         "CPU backend, plain avx2 kernels: bits of the activation codes Q8_0 weights are multiplied "
         "with: 8, or 7 (a product without VPSIGNB: prefill's matrix work about 20% faster, at about "
         "twice the activation rounding); the other kernel sets always take 8");
  a.Flag("cpu-weights", "native",
         "weights of the CPU backend: native (each matrix in its file type, int8/half kernels) or "
         "f32 (dequantised at load: results bit-identical to the reference forward)");
  a.Flag("device", "0", "CUDA device of the cuda backend");
  a.Flag("cuda-graphs", "false", "cuda backend: replay each layer's kernels from CUDA graphs", true);
  a.Flag("probe-cuda", "false",
         "print 'cuda: yes (<device>)' and exit 0 when --device is a usable CUDA device, else "
         "'cuda: no (<why>)' and exit 1",
         true);
  a.Flag("max-batch", "16", "most sequences in one step");
  a.Flag("max-step-tokens", "256", "most tokens in one step");
  a.Flag("connect-timeout-s", "60", "how long to wait for the attention workers' channels");
  a.Flag("control-secret-file", "",
         "file (0600) holding the launch's control secret; every control call must carry it");
  a.Flag("log-level", "info", "debug, info, warning or error");
  return a;
}

absl::StatusOr<MlpWorkerConfig> ConfigFromFlags(const Args& args) {
  MlpWorkerConfig c;
  c.model_path = args.Get("model");
  c.channel = args.Get("channel");
  c.listen = args.Get("listen");
  ASSIGN_OR_RETURN(c.backend, ParseMlpBackend(args.Get("backend")));
  ASSIGN_OR_RETURN(c.cpu_weights, ParseCpuWeights(args.Get("cpu-weights")));
  c.matmul_isa = args.Get("matmul-isa");
  c.control_secret_file = args.Get("control-secret-file");
  int connect_timeout_s = 0;
  RETURN_IF_ERROR(args.GetInts({{"threads", &c.threads}, {"device", &c.device},
                                {"max-batch", &c.max_batch}, {"max-step-tokens", &c.max_step_tokens},
                                {"connect-timeout-s", &connect_timeout_s},
                                {"q8-act-bits", &c.q8_act_bits}}));
  if (c.q8_act_bits != 8 && c.q8_act_bits != 7) {
    return absl::InvalidArgumentError(
        absl::StrCat("--q8-act-bits: expected 8 or 7, got ", c.q8_act_bits));
  }
  c.threads = std::max(1, c.threads);
  c.cuda_graphs = args.GetBool("cuda-graphs");
  c.connect_timeout = absl::Seconds(connect_timeout_s);
  if (c.model_path.empty()) return absl::InvalidArgumentError("--model is required");
  if (c.control_secret_file.empty()) {
    return absl::InvalidArgumentError("--control-secret-file is required (ellm-launch writes one)");
  }
  if (c.channel.empty()) return absl::InvalidArgumentError("--channel is required");
  if (c.listen.empty()) return absl::InvalidArgumentError("--listen is required");
  if (c.backend == MlpBackendKind::kCuda) {
#if ELLM_HAVE_CUDA
    std::string why;
    if (!CudaDeviceAvailable(&why, c.device)) {
      return absl::UnavailableError(absl::StrCat("no CUDA device: ", why));
    }
#else
    return absl::InvalidArgumentError("--backend cuda: this build has no CUDA backend");
#endif
  } else if (c.backend != MlpBackendKind::kCpu) {
    return absl::InvalidArgumentError("--backend auto is the launcher's choice; a worker runs cpu or cuda");
  }
  if (c.max_batch <= 0 || c.max_step_tokens <= 0) {
    return absl::InvalidArgumentError("--max-batch and --max-step-tokens must be positive");
  }
  for (absl::string_view spec : absl::StrSplit(args.Get("attn-shards"), ',', absl::SkipEmpty())) {
    std::vector<std::string> kv = absl::StrSplit(spec, '=');
    absl::StatusOr<KvHeads> heads =
        kv.size() == 2 ? KvHeads::Parse(kv[1]) : absl::InvalidArgumentError("no '='");
    if (!heads.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("bad --attn-shards entry '", spec,
                                                     "' (expected CHANNEL=BEGIN:END): ",
                                                     heads.status().message()));
    }
    c.shards.push_back({kv[0], *heads});
  }
  if (c.shards.empty()) return absl::InvalidArgumentError("--attn-shards is required");
  return c;
}

class ControlService final : public ellm::v1::WorkerControl::Service {
 public:
  ControlService(const MlpWorkerConfig& config, CallSecret secret, std::string backend,
                 int64_t weight_bytes_per_step, std::atomic<int64_t>* steps, std::atomic<int64_t>* busy_ns)
      : config_(config),
        secret_(std::move(secret)),
        backend_(std::move(backend)),
        weight_bytes_per_step_(weight_bytes_per_step),
        steps_(steps),
        busy_ns_(busy_ns) {}
  grpc::Status GetInfo(grpc::ServerContext* ctx, const ellm::v1::GetInfoRequest*,
                       ellm::v1::WorkerInfo* info) override {
    if (grpc::Status denied = secret_.Check(ctx, "GetInfo"); !denied.ok()) return denied;
    info->set_role(ellm::v1::WORKER_ROLE_MLP);
    info->set_pid(getpid());
    info->set_model_path(config_.model_path);
    info->set_channel(config_.channel);
    info->set_kernel(backend_);
    info->set_threads(config_.threads);
    info->set_steps(steps_->load());
    info->set_busy_seconds(static_cast<double>(busy_ns_->load()) * 1e-9);
    info->set_max_batch(config_.max_batch);
    info->set_max_step_tokens(config_.max_step_tokens);
    info->set_numa_node(-1);
    info->set_weight_read_bytes(steps_->load() * weight_bytes_per_step_);
    return grpc::Status::OK;
  }
  grpc::Status Shutdown(grpc::ServerContext* ctx, const ellm::v1::ShutdownRequest*,
                        ellm::v1::ShutdownResponse*) override {
    if (grpc::Status denied = secret_.Check(ctx, "Shutdown"); !denied.ok()) return denied;
    RequestStop();
    return grpc::Status::OK;
  }

 private:
  const MlpWorkerConfig& config_;
  const CallSecret secret_;
  std::string backend_;
  int64_t weight_bytes_per_step_;
  std::atomic<int64_t>* steps_;
  std::atomic<int64_t>* busy_ns_;
};

int64_t WeightFileBytes(const GgufFile& file) {
  int64_t bytes = 0;
  for (const GgufTensorInfo& t : file.tensors()) bytes += static_cast<int64_t>(t.bytes);
  return bytes;
}

// Bytes of weights one step reads: every tensor but the embedding table (one
// row per token is gathered), which counts once as the LM head when tied.
int64_t WeightBytesPerStep(const GgufFile& file) {
  const bool has_output = file.FindTensor("output.weight") != nullptr;
  int64_t bytes = 0;
  for (const GgufTensorInfo& t : file.tensors()) {
    if (t.name == "token_embd.weight" && has_output) continue;
    bytes += static_cast<int64_t>(t.bytes);
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<MlpBackend>> MakeBackend(const MlpWorkerConfig& config,
                                                         ModelWeights weights) {
#if ELLM_HAVE_CUDA
  if (config.backend == MlpBackendKind::kCuda) {
    CudaBackendOptions options;
    options.device = config.device;
    options.use_graphs = config.cuda_graphs;
    int last_percent = -1;
    options.progress = [&](int64_t done, int64_t total) {
      const int percent = static_cast<int>(done * 100 / std::max<int64_t>(1, total));
      if (percent / 10 != last_percent / 10 || done == total) {
        LogInfo("uploading weights to cuda:%d: %d/%d tensors (%d%%)", config.device, done, total,
                percent);
        last_percent = percent;
      }
    };
    return CreateCudaBackend(std::move(weights), config.max_step_tokens, options);
  }
#endif
  return CreateCpuBackend(std::move(weights), config.max_step_tokens, config.threads, config.matmul_isa,
                          config.q8_act_bits);
}

// --probe-cuda: one line for the launcher, exit 0 when a device is usable.
int ProbeCuda(const Args& args) {
#if ELLM_HAVE_CUDA
  absl::StatusOr<int> device = args.GetInt("device");
  if (!device.ok()) {
    std::printf("cuda: no (%s)\n", std::string(device.status().message()).c_str());
    return 1;
  }
  std::string why;
  const bool yes = CudaDeviceAvailable(&why, *device);
  std::printf("cuda: %s (%s)\n", yes ? "yes" : "no", why.c_str());
  return yes ? 0 : 1;
#else
  std::printf("cuda: no (this build has no CUDA backend)\n");
  return 1;
#endif
}

absl::Status Run(const MlpWorkerConfig& config) {
  ASSIGN_OR_RETURN(auto file, GgufFile::Open(config.model_path));
  ASSIGN_OR_RETURN(ModelConfig model, ModelConfig::FromGguf(*file));
  LogInfo("model %s: %s", config.model_path, model.DebugString());
  LoadOptions load;
  // The CPU backend's native kernels take the matrices as stored; other
  // backends get fp32.
  load.raw_matrices = config.backend == MlpBackendKind::kCpu && config.cpu_weights == CpuWeights::kNative;
  // On a terminal, one line that counts up; in a log, a line per stage.
  const bool terminal = isatty(STDERR_FILENO) != 0;
  const absl::Time load_start = absl::Now();
  int last_percent = -1;
  load.progress = [&](int64_t done, int64_t total) {
    const int percent = static_cast<int>(done * 100 / std::max<int64_t>(1, total));
    if (!terminal || percent == last_percent) return;
    last_percent = percent;
    std::fprintf(stderr, "\r[mlp-worker] loading weights: %.0f of %.0f MiB (%d%%)%s", done / 1048576.0,
                 total / 1048576.0, percent, done == total ? "\n" : "");
    std::fflush(stderr);
  };
  LogInfo("loading weights (%.1f MiB)...", static_cast<double>(WeightFileBytes(*file)) / 1048576.0);
  ASSIGN_OR_RETURN(ModelWeights weights, LoadWeights(*file, model, load));
  LogInfo("weights loaded in %.1f s", absl::ToDoubleSeconds(absl::Now() - load_start));
  ASSIGN_OR_RETURN(std::unique_ptr<MlpBackend> backend, MakeBackend(config, std::move(weights)));
  LogInfo("backend %s", backend->name());

  std::vector<std::unique_ptr<shm::Channel>> channels;
  std::vector<ShardLink> links;
  for (size_t i = 0; i < config.shards.size(); ++i) {
    LogInfo("connecting to attn-worker %d (channel %s)", static_cast<int>(i), config.shards[i].channel);
    ASSIGN_OR_RETURN(auto channel, shm::Channel::Open(config.shards[i].channel, config.connect_timeout,
                                                      StopRequested));
    links.push_back({static_cast<int>(i), config.shards[i].heads, channel.get()});
    channels.push_back(std::move(channel));
  }
  ASSIGN_OR_RETURN(auto runner, StepRunner::Create(model, backend.get(), links, config.max_step_tokens));

  const uint64_t plan_bytes = shm::StepPlanCapacity(config.max_batch, config.max_step_tokens);
  const uint64_t result_bytes = std::max<uint64_t>(shm::StepResultCapacity(config.max_batch, config.max_step_tokens),
                                                   sizeof(shm::FrameHeader) + 4096);
  ASSIGN_OR_RETURN(auto coord, shm::Channel::Create(config.channel, 4, plan_bytes, result_bytes));

  std::atomic<int64_t> steps{0}, busy_ns{0};
  ASSIGN_OR_RETURN(CallSecret secret,
                   CallSecret::FromFile(CallSecret::Kind::kControl, config.control_secret_file));
  ControlService control(config, std::move(secret), backend->name(), WeightBytesPerStep(*file), &steps,
                         &busy_ns);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(config.listen, grpc::InsecureServerCredentials());
  builder.RegisterService(&control);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return absl::UnavailableError(absl::StrCat("cannot listen on ", config.listen));
  server->GetHealthCheckService()->SetServingStatus(true);
  LogInfo("serving channel %s, control on %s", config.channel, config.listen);

  ServeOptions serve;
  serve.stop = [] { return StopRequested(); };
  serve.steps = &steps;
  runner->busy_ns = &busy_ns;
  ServeChannel(*coord, *runner, model, serve);
  LogInfo("stopping");
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return absl::OkStatus();
}

}  // namespace
}  // namespace ellm::mlp

int main(int argc, char** argv) {
  ellm::DieWithParent();
  ellm::Args args = ellm::mlp::Flags();
  if (std::optional<int> exit_code = args.ParseFlagsOnly(argc, argv)) return *exit_code;
  ellm::LogLevel level = ellm::LogLevel::kInfo;
  if (!ellm::ParseLogLevel(args.Get("log-level"), &level)) {
    std::fprintf(stderr, "--log-level must be debug, info, warning or error, got '%s'\n",
                 args.Get("log-level").c_str());
    return 2;
  }
  ellm::SetLogIdentity("mlp-worker", level);
  ellm::InstallStopSignalHandlers();
  if (args.GetBool("probe-cuda")) return ellm::mlp::ProbeCuda(args);
  absl::StatusOr<ellm::mlp::MlpWorkerConfig> config = ellm::mlp::ConfigFromFlags(args);
  if (!config.ok()) {
    ellm::LogError("%s", config.status().message());
    return 2;
  }
  absl::Status status = ellm::mlp::Run(*config);
  if (!status.ok()) {
    ellm::LogError("%s", status.ToString());
    return 1;
  }
  return 0;
}
