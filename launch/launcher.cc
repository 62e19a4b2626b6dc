// ellm-launch: starts ellm on this server — one attn-worker per NUMA node,
// the mlp-worker, the coordinator — waits until all are healthy, and stops
// them all (removing every shared-memory segment) on Ctrl-C / SIGTERM.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/args.h"
#include "core/backend_names.h"
#include "core/cpu_features.h"
#include "core/gguf.h"
#include "core/kv_format.h"
#include "core/kv_heads.h"
#include "core/log.h"
#include "core/model_config.h"
#include "core/signals.h"
#include "core/tokenizer.h"
#include "core/topology.h"
#include "core/weights.h"
#include "proto/control_secret.h"
#include "proto/health.grpc.pb.h"

namespace ellm::launch {
namespace {

namespace fs = std::filesystem;

struct Child {
  std::string name;  // "attn-worker 0", "mlp-worker", "coordinator"
  pid_t pid = -1;
  std::string health_address;
  bool exited = false;
  int status = 0;
  std::vector<std::string> argv;  // to start it again
  bool handled = false;           // its exit was acted on
};

struct LaunchConfig {
  std::string model_path;
  std::string host;
  int port = 50051;
  int http_port = 8080;   // OpenAI-compatible HTTP API and /metrics; 0: none
  int http_max_body_mb = 8;
  int http_max_connections = 1024;
  int client_write_timeout_s = 60;
  int drain_timeout_s = 30;
  int attn_workers = 0;  // 0: one per NUMA node
  int kv_cache_mb = 0;   // per attention worker; 0: automatic
  int max_batch = 16;
  int max_step_tokens = 256;
  int max_queue = 64;
  int default_max_tokens = 128;
  int mlp_threads = 0;
  KvDType kv_dtype = KvDType::kInt8;
  MlpBackendKind backend = MlpBackendKind::kAuto;
  CpuWeights cpu_weights = CpuWeights::kNative;
  Isa matmul_isa = Isa::kAuto;   // the CPU backend's matrix kernels
  int q8_act_bits = 8;           // their Q8_0 activation codes on plain avx2: 8 or 7
  Isa attn_kernel = Isa::kAuto;  // the attention workers' int8/f16 kernels
  std::string topology_spec;
  std::string bin_dir;
  std::string log_level;
  bool use_numactl = true;
  bool prefix_cache = true;
  bool reasoning_parser = true;
  bool allow_synthetic_context = false;
  std::string kv_store;   // folder of the KV store; empty: none
  int kv_store_mb = 16384;
  std::string api_key;      // required on every public call when set
  bool insecure_public = false;
  std::string tls_cert, tls_key;
  bool restart = true;    // restart the workers when one dies (the coordinator resumes)
  int max_restarts = 5;   // crash-loop failures in a row before the launch gives up
  int ready_timeout_s = 180;
  int heartbeat_ms = 500;          // the coordinator's health checks of the workers
  double min_step_timeout_s = 2;   // and the shortest time it lets a step take
};

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("was killed by signal ", WTERMSIG(status));
  return "stopped";
}

bool Executable(const std::string& path) { return access(path.c_str(), X_OK) == 0; }

// Where the binaries are: --bin-dir, $ELLM_BIN_DIR, this program's folder, build/.
std::string FindBinDir(const std::string& flag, const char* argv0) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("ELLM_BIN_DIR"); env != nullptr && *env) return env;
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && Executable((self.parent_path() / "ellm-coordinator").string())) {
    return self.parent_path().string();
  }
  return "build";
}

absl::StatusOr<std::string> FindModel(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("ELLM_MODEL"); env != nullptr && *env) return std::string(env);
  for (const std::string& candidate :
       {std::string("../shared/models/stories260K.gguf"),
        std::string(ELLM_SOURCE_DIR) + "/../shared/models/stories260K.gguf"}) {
    if (fs::exists(candidate)) return fs::absolute(candidate).lexically_normal().string();
  }
  return absl::NotFoundError(
      "no model given: pass --model FILE.gguf or set ELLM_MODEL (e.g. a llama GGUF such as "
      "stories260K.gguf from llama.cpp's test models, placed at ../shared/models/stories260K.gguf)");
}

pid_t Spawn(const std::vector<std::string>& argv) {
  const pid_t parent = getpid();
  // The child starts with SIGINT and SIGTERM blocked, through exec, until its
  // main installs its handlers (InstallStopSignalHandlers unblocks them): a
  // stop sent between fork and exec would otherwise run this process's
  // handler in the child and be lost at exec (the child then served on).
  sigset_t previous;
  BlockStopSignals(&previous);
  pid_t pid = fork();
  if (pid != 0) {
    sigprocmask(SIG_SETMASK, &previous, nullptr);
    return pid;
  }
  // Child: die with the launcher, own process group for signals from the terminal.
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) _exit(1);
  setpgid(0, 0);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execvp(args[0], args.data());
  std::fprintf(stderr, "ellm-launch: cannot run %s: %s\n", args[0], strerror(errno));
  _exit(127);
}

// Runs argv (no shell: any path works) and returns its standard output
// (stderr is dropped) and its wait status; a program still running after
// `timeout` is killed, and the status says so (SIGKILL).
struct RunResult {
  int status = -1;
  std::string output;
};
RunResult RunForOutput(const std::vector<std::string>& argv, absl::Duration timeout) {
  RunResult r;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return r;
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return r;
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    dup2(fds[1], 1);
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, 2);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(fds[1]);
  const absl::Time deadline = absl::Now() + timeout;
  bool killed = false;
  for (;;) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) {
      kill(pid, SIGKILL);
      killed = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1000))) < 0 && errno != EINTR) break;
    if (p.revents == 0) continue;
    char buf[512];
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    r.output.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  waitpid(pid, &r.status, 0);
  if (killed) r.output = absl::StrCat("no answer within ", absl::FormatDuration(timeout));
  return r;
}

// What launchers that were killed (SIGKILL: no clean-up) left behind: run
// folders /tmp/ellm-<pid>-<hex> and segments /dev/shm/ellm-<pid>-<hex>-*
// whose launcher pid is gone. Their children died with them (PDEATHSIG).
void RemoveStaleLaunches() {
  std::error_code ec;
  int removed = 0;
  for (const char* dir : {"/tmp", "/dev/shm"}) {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      int pid = 0;
      unsigned hex = 0;
      int consumed = 0;
      if (std::sscanf(name.c_str(), "ellm-%d-%8x%n", &pid, &hex, &consumed) != 2 || consumed < 14 ||
          pid <= 0 || pid == getpid()) {
        continue;
      }
      if (name.size() > static_cast<size_t>(consumed) && name[consumed] != '-') continue;
      if (kill(pid, 0) == 0 || errno != ESRCH) continue;  // that launcher still runs
      fs::remove_all(entry.path(), ec);
      if (!ec) ++removed;
    }
  }
  if (removed > 0) LogInfo("removed %d leftovers of launches that were killed", removed);
}

bool Healthy(const std::string& address) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  return stub->Check(&ctx, req, &resp).ok() &&
         resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

class Launch {
 public:
  explicit Launch(LaunchConfig config) : c_(std::move(config)) {}
  ~Launch() { StopAll(); }

  absl::Status Start();
  // Runs until a stop signal or the coordinator's exit; returns the exit code.
  int Serve();

 private:
  void Reap();
  void StopAll();
  void RemoveSegments();
  // Stops (SIGKILL) the children [first, end) still running and removes
  // their segments and sockets.
  void KillChildren(size_t first, size_t end);
  // Starts children [first, end) again from their argv and waits until they
  // are healthy.
  absl::Status Respawn(size_t first, size_t end);
  // Waits until children [first, end) answer their health checks.
  absl::Status WaitHealthy(size_t first, size_t end, absl::Duration timeout);
  // Once serving: passes each new stop signal on to the coordinator (the
  // first starts its drain, a second ends it at once).
  void PassOnStop();
  // Once serving: true after a second stop signal or past the drain's
  // deadline; before, after any stop signal (start-up is simply cut short).
  bool StopNow() const;

  LaunchConfig c_;
  std::string prefix_;   // of every shared-memory segment of this launch
  std::string run_dir_;  // control sockets
  std::vector<Child> children_;
  bool serving_ = false;
  bool draining_ = false;        // the coordinator has its first SIGTERM
  absl::Time drain_deadline_;    // for the coordinator to end its drain
  int signals_passed_ = 0;
  bool stopped_ = false;
  // Serve gave up on the workers: no drain can end well, so the coordinator
  // is told to end its requests at once (a second stop signal).
  bool gave_up_ = false;
};

absl::Status Launch::Start() {
  ASSIGN_OR_RETURN(auto file, GgufFile::Open(c_.model_path));
  ASSIGN_OR_RETURN(ModelConfig model, ModelConfig::FromGguf(*file));
  // The tokenizer is the coordinator's, which starts last: a file whose
  // tokenizer ellm refuses is refused here, before the workers spend minutes
  // loading its weights.
  if (absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromGguf(*file); !tokenizer.ok()) {
    return tokenizer.status();
  }
  // So are a missing tensor, a wrong shape or a type ellm cannot read: the
  // MLP worker's load checks the same table, but after the others started.
  LoadOptions table_only;
  table_only.check_only = true;
  RETURN_IF_ERROR(LoadWeights(*file, model, table_only).status());
  Topology topo;
  if (!c_.topology_spec.empty()) {
    ASSIGN_OR_RETURN(topo, ParseTopologySpec(c_.topology_spec));
  } else {
    ASSIGN_OR_RETURN(topo, DiscoverTopology());
  }
  const int n = c_.attn_workers > 0 ? c_.attn_workers : static_cast<int>(topo.nodes.size());
  if (model.n_kv_heads % n != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot split the model's ", model.n_kv_heads, " KV heads evenly over ", n,
        " attention workers; choose --attn-workers from the divisors of ", model.n_kv_heads));
  }
  const int heads_each = model.n_kv_heads / n;
  for (const char* bin : {"ellm-attn-worker", "ellm-mlp-worker", "ellm-coordinator"}) {
    if (!Executable(c_.bin_dir + "/" + bin)) {
      return absl::NotFoundError(absl::StrCat("cannot find ", c_.bin_dir, "/", bin,
                                              "; build ellm first, or point --bin-dir (or $ELLM_BIN_DIR) at the binaries"));
    }
  }
  const bool numactl = c_.use_numactl && system("command -v numactl >/dev/null 2>&1") == 0;
  // The MLP backend: cuda when asked, or when auto finds a GPU; cpu otherwise.
  MlpBackendKind backend = c_.backend;
  if (backend != MlpBackendKind::kCpu) {
    // A CUDA driver that hangs must not hang the launch: the probe gets a minute.
    RunResult probe = RunForOutput({c_.bin_dir + "/ellm-mlp-worker", "--probe-cuda"}, absl::Seconds(60));
    std::string answer = probe.output;
    if (!answer.empty() && answer.back() == '\n') answer.pop_back();
    const bool cuda = WIFEXITED(probe.status) && WEXITSTATUS(probe.status) == 0;
    if (answer.empty()) answer = absl::StrCat("the probe (", c_.bin_dir, "/ellm-mlp-worker --probe-cuda) ",
                                              probe.status < 0 ? "could not start" : DescribeExit(probe.status));
    if (backend == MlpBackendKind::kAuto) backend = cuda ? MlpBackendKind::kCuda : MlpBackendKind::kCpu;
    else if (!cuda) return absl::UnavailableError(absl::StrCat("--backend cuda: ", answer));
    LogInfo("MLP backend %s (%s)", MlpBackendName(backend), answer.empty() ? "no CUDA probe" : answer);
  }
  LogInfo("model %s: %s", c_.model_path, model.DebugString());
  LogInfo("topology %s; %s with %s each%s", topo.DebugString(), Count(n, "attention worker"),
          Count(heads_each, "KV head"), numactl ? " (bound with numactl)" : "");

  RemoveStaleLaunches();
  std::random_device rd;
  prefix_ = absl::StrFormat("ellm-%d-%08x", getpid(), rd());
  run_dir_ = absl::StrCat("/tmp/", prefix_);
  if (mkdir(run_dir_.c_str(), 0700) != 0) {
    return absl::InternalError(absl::StrCat("cannot create ", run_dir_, ": ", strerror(errno)));
  }

  // The control plane's secret (and the API key) travel in 0600 files in the
  // 0700 run folder, never on a command line.
  const std::string secret_file = run_dir_ + "/control-secret";
  RETURN_IF_ERROR(WriteNewSecret(secret_file).status());
  const std::string secret_flag = "--control-secret-file=" + secret_file;
  std::string api_key_flag = "--api-key-file=";
  if (!c_.api_key.empty()) {
    const std::string path = run_dir_ + "/api-key";
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 || write(fd, c_.api_key.data(), c_.api_key.size()) != static_cast<ssize_t>(c_.api_key.size())) {
      if (fd >= 0) close(fd);
      return absl::InternalError(absl::StrCat("cannot write ", path));
    }
    close(fd);
    api_key_flag += path;
  }

  // KV budget per worker: what the batch can use at full context, at most 1/4 of RAM shared.
  int kv_mb = c_.kv_cache_mb;
  if (kv_mb <= 0) {
    const double per_token =
        KvFormat::Make(c_.kv_dtype, model.head_dim).BytesPerPosition() * model.n_layers * heads_each;
    const double want = per_token * model.context_length * c_.max_batch / 1048576.0;
    const double ram_mb = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE) / 1048576.0;
    kv_mb = static_cast<int>(std::max(1.0, std::min(want, ram_mb / 4 / n)) + 1);
  }

  const std::string common_limits = absl::StrCat("--max-batch=", c_.max_batch);
  const std::string step_limit = absl::StrCat("--max-step-tokens=", c_.max_step_tokens);
  std::vector<std::string> shard_specs, worker_addresses;
  for (int i = 0; i < n; ++i) {
    const NumaNode& node = topo.nodes[i % topo.nodes.size()];
    // Workers that land on the same node split its cores between them.
    const int nodes = static_cast<int>(topo.nodes.size());
    const int sharing = n / nodes + (i % nodes < n % nodes ? 1 : 0);
    const int slot = i / nodes;
    std::vector<int> cpus;
    for (size_t k = 0; k < node.cpus.size(); ++k) {
      if (static_cast<int>(k) % sharing == slot) cpus.push_back(node.cpus[k]);
    }
    if (cpus.empty()) cpus = node.cpus;
    const std::string channel = absl::StrCat(prefix_, "-attn-", i);
    const KvHeads heads = SplitKvHeads(model.n_kv_heads, n, i);
    const std::string address = absl::StrCat("unix:", run_dir_, "/attn-", i, ".sock");
    std::vector<std::string> argv;
    if (numactl) {
      argv = {"numactl", absl::StrCat("--cpunodebind=", node.id), absl::StrCat("--membind=", node.id)};
    }
    std::vector<std::string> rest = {
        c_.bin_dir + "/ellm-attn-worker", "--model=" + c_.model_path,
        absl::StrCat("--shard=", i), "--kv-heads=" + heads.Flag(),
        "--channel=" + channel, "--listen=" + address, absl::StrCat("--numa-node=", node.id),
        "--cpus=" + FormatCpuList(cpus), absl::StrCat("--kv-cache-mb=", kv_mb),
        absl::StrCat("--kv-dtype=", ToAbsl(KvDTypeName(c_.kv_dtype))),
        absl::StrCat("--attn-kernel=", ToAbsl(IsaName(c_.attn_kernel))), common_limits,
        step_limit, "--log-level=" + c_.log_level, secret_flag};
    if (!c_.kv_store.empty()) {
      rest.push_back("--kv-store=" + c_.kv_store);
      // In KiB: an even share of the total, which whole MiB would round (1
      // MiB over 4 workers was 1 MiB each).
      rest.push_back(absl::StrCat("--kv-store-kb=", std::clamp<int64_t>((int64_t{c_.kv_store_mb} << 10) / n, 1, INT32_MAX)));
    }
    argv.insert(argv.end(), rest.begin(), rest.end());
    children_.push_back({absl::StrCat("attn-worker ", i), Spawn(argv), address, false, 0, argv});
    shard_specs.push_back(absl::StrCat(channel, "=", heads.Flag()));
    worker_addresses.push_back(address);
  }

  const NumaNode& mlp_node = topo.nodes[0];
  const int mlp_threads = c_.mlp_threads > 0 ? c_.mlp_threads : static_cast<int>(mlp_node.cpus.size());
  const std::string mlp_channel = prefix_ + "-mlp";
  const std::string mlp_address = absl::StrCat("unix:", run_dir_, "/mlp.sock");
  {
    std::vector<std::string> argv;
    if (numactl) argv = {"numactl", absl::StrCat("--cpunodebind=", mlp_node.id)};
    std::vector<std::string> rest = {
        c_.bin_dir + "/ellm-mlp-worker", "--model=" + c_.model_path, "--channel=" + mlp_channel,
        "--attn-shards=" + absl::StrJoin(shard_specs, ","), "--listen=" + mlp_address,
        absl::StrCat("--threads=", mlp_threads), absl::StrCat("--backend=", ToAbsl(MlpBackendName(backend))),
        absl::StrCat("--cpu-weights=", ToAbsl(CpuWeightsName(c_.cpu_weights))), absl::StrCat("--matmul-isa=", ToAbsl(IsaName(c_.matmul_isa))),
        absl::StrCat("--q8-act-bits=", c_.q8_act_bits), common_limits, step_limit,
        "--log-level=" + c_.log_level, secret_flag};
    argv.insert(argv.end(), rest.begin(), rest.end());
    children_.push_back({"mlp-worker", Spawn(argv), mlp_address, false, 0, argv});
    worker_addresses.push_back(mlp_address);
  }
  const std::string public_address = absl::StrCat(c_.host, ":", c_.port);
  // The launcher checks the coordinator's health here, whatever the public
  // port's TLS.
  const std::string coordinator_address = absl::StrCat("unix:", run_dir_, "/coordinator.sock");
  {
    std::vector<std::string> argv = {
        c_.bin_dir + "/ellm-coordinator", "--model=" + c_.model_path, "--listen=" + public_address,
        "--mlp-channel=" + mlp_channel, "--workers=" + absl::StrJoin(worker_addresses, ","),
        common_limits, step_limit, "--log-level=" + c_.log_level,
        c_.prefix_cache ? "--prefix-cache=true" : "--prefix-cache=false",
        c_.reasoning_parser ? "--reasoning-parser=true" : "--reasoning-parser=false",
        c_.allow_synthetic_context ? "--allow-synthetic-context=true" : "--allow-synthetic-context=false",
        c_.kv_store.empty() ? "--kv-store=false" : "--kv-store=true", c_.restart ? "--recover=true" : "--recover=false",
        secret_flag, api_key_flag, "--tls-cert=" + c_.tls_cert, "--tls-key=" + c_.tls_key,
        "--control-listen=" + coordinator_address, absl::StrCat("--max-queue=", c_.max_queue),
        absl::StrCat("--default-max-tokens=", c_.default_max_tokens),
        c_.http_port > 0 ? absl::StrCat("--http-listen=", c_.host, ":", c_.http_port) : "--http-listen=",
        absl::StrCat("--http-max-body-mb=", c_.http_max_body_mb),
        absl::StrCat("--http-max-connections=", c_.http_max_connections),
        absl::StrCat("--client-write-timeout-s=", c_.client_write_timeout_s),
        absl::StrCat("--drain-timeout-s=", c_.drain_timeout_s),
        // The coordinator waits for the workers as long as this launcher
        // does: at start-up, and for a restarted set (one start and its
        // longest backoff).
        absl::StrCat("--connect-timeout-s=", c_.ready_timeout_s),
        absl::StrCat("--recovery-timeout-s=", c_.ready_timeout_s + 10),
        absl::StrCat("--heartbeat-ms=", c_.heartbeat_ms),
        absl::StrCat("--min-step-timeout-s=", c_.min_step_timeout_s)};
    children_.push_back({"coordinator", Spawn(argv), coordinator_address, false, 0, argv});
  }

  // Wait until every process answers its health check.
  RETURN_IF_ERROR(WaitHealthy(0, children_.size(), absl::Seconds(c_.ready_timeout_s)));
  LogInfo("ellm is ready: listening on %s (model %s, %s, %d MiB KV cache each)", public_address,
          fs::path(c_.model_path).filename().string(), Count(n, "attention worker"), kv_mb);
  LogInfo("KV cache %s; MLP backend %s%s", KvDTypeName(c_.kv_dtype), MlpBackendName(backend),
          backend == MlpBackendKind::kCpu
              ? absl::StrCat(" (", ToAbsl(CpuWeightsName(c_.cpu_weights)), " weights, ", mlp_threads, " threads)")
              : "");
  std::printf("ellm listening on %s\n", public_address.c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

void Launch::Reap() {
  for (Child& c : children_) {
    if (c.exited || c.pid <= 0) continue;
    int status = 0;
    if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
      c.exited = true;
      c.status = status;
    }
  }
}

absl::Status Launch::WaitHealthy(size_t first, size_t end, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t i = first; i < end; ++i) {
    Child& child = children_[i];
    while (!Healthy(child.health_address)) {
      Reap();
      for (size_t k = first; k < end; ++k) {
        const Child& c = children_[k];
        if (c.exited) {
          return absl::UnavailableError(absl::StrCat(c.name, " (pid ", c.pid, ") ", DescribeExit(c.status),
                                                     " during start-up; see its log above"));
        }
      }
      PassOnStop();
      if (StopNow()) return absl::CancelledError("interrupted during start-up");
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(child.name, " did not become healthy within ",
                                                        absl::FormatDuration(timeout)));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  return absl::OkStatus();
}

void Launch::KillChildren(size_t first, size_t end) {
  for (size_t i = first; i < end; ++i) {
    Child& c = children_[i];
    if (c.pid > 0 && !c.exited) kill(c.pid, SIGKILL);
  }
  for (size_t i = first; i < end; ++i) {
    Child& c = children_[i];
    if (c.pid > 0 && !c.exited) {
      waitpid(c.pid, &c.status, 0);
      c.exited = true;
    }
  }
  // Their shared-memory segments and control sockets, so the new ones start
  // clean (a half-written ring must not be read by a new peer).
  std::error_code ec;
  for (size_t i = first; i < end; ++i) {
    const std::string& address = children_[i].health_address;
    if (address.rfind("unix:", 0) == 0) fs::remove(address.substr(5), ec);
  }
  const bool coordinator = end == children_.size();
  for (const auto& entry : fs::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix_, 0) != 0) continue;
    const bool worker_segment = name.rfind(prefix_ + "-attn-", 0) == 0 || name.rfind(prefix_ + "-mlp", 0) == 0;
    if (worker_segment || coordinator) fs::remove(entry.path(), ec);
  }
}

absl::Status Launch::Respawn(size_t first, size_t end) {
  for (size_t i = first; i < end; ++i) {
    Child& c = children_[i];
    c.pid = Spawn(c.argv);
    c.exited = false;
    c.handled = false;
    c.status = 0;
  }
  return WaitHealthy(first, end, absl::Seconds(c_.ready_timeout_s));
}

void Launch::PassOnStop() {
  if (!serving_ || StopSignals() == signals_passed_) return;
  signals_passed_ = StopSignals();
  Child& coordinator = children_.back();
  if (!draining_) {
    draining_ = true;
    drain_deadline_ = absl::Now() + absl::Seconds(5) + absl::Seconds(c_.drain_timeout_s);
    LogInfo("stopping ellm: the coordinator refuses new requests and lets those in flight end (up to %d s; "
            "Ctrl-C again to end them at once)", c_.drain_timeout_s);
  }
  if (coordinator.pid > 0 && !coordinator.exited) kill(coordinator.pid, SIGTERM);
}

bool Launch::StopNow() const {
  if (!serving_) return StopRequested();
  return StopSignals() >= 2 || (draining_ && absl::Now() >= drain_deadline_);
}

int Launch::Serve() {
  // Restarts: the workers (children_ but the last, the coordinator) are
  // replaced together when one of them dies, the coordinator resuming its
  // requests on the new set; a dead coordinator takes the workers with it
  // and all start again. A crash loop backs off (0.5, 1, 2 ... 8 s) and ends
  // the launch after --max-restarts failures in a row. A failure counts
  // towards it when a restart does not come up (a process dies starting or
  // is not healthy within --ready-timeout), or when a set dies within
  // kStable of being healthy; a killed worker that had been serving
  // restarts at once.
  // A stop signal starts the coordinator's drain; the workers are still
  // replaced meanwhile, so that the requests in flight end as they would
  // have. The drain ends with the coordinator's exit, a second signal or
  // --drain-timeout-s (StopAll).
  constexpr absl::Duration kStable = absl::Seconds(2);
  serving_ = true;
  int streak = 0;
  absl::Time healthy_since = absl::Now();
  const size_t workers = children_.size() - 1;
  for (;;) {
    // A stop is passed on to the coordinator within 20 ms (it then refuses
    // new requests).
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    PassOnStop();
    Reap();
    if (StopNow() || (draining_ && children_.back().exited)) break;
    // What died since the last pass (the coordinator named first: it takes
    // everything down with it).
    const Child* dead = nullptr;
    bool coordinator = false;
    for (size_t i = 0; i < children_.size(); ++i) {
      Child& c = children_[i];
      if (!c.exited || c.handled) continue;
      c.handled = true;
      if (!c_.restart) {
        if (i == workers) {
          LogError("the coordinator (pid %d) %s; stopping ellm", c.pid, DescribeExit(c.status));
          return 1;
        }
        LogError("%s (pid %d) %s; ellm no longer serves (health: NOT_SERVING). Stop with Ctrl-C and "
                 "start it again.", c.name, c.pid, DescribeExit(c.status));
        continue;
      }
      if (dead == nullptr || i == workers) dead = &c;
      coordinator = coordinator || i == workers;
    }
    if (dead == nullptr) continue;
    std::string why = absl::StrCat(dead->name, " (pid ", dead->pid, ") ", DescribeExit(dead->status));
    size_t end = coordinator ? children_.size() : workers;
    streak = absl::Now() - healthy_since < kStable ? streak + 1 : 0;
    // Until the set is healthy again: a restart that fails is one more
    // failure in a row, and the next try waits longer.
    for (;;) {
      if (streak >= c_.max_restarts) {
        LogError("%s, failing %d times in a row; giving up (see the logs above for why it keeps failing)",
                 why, streak);
        gave_up_ = true;
        return 1;
      }
      const absl::Duration backoff =
          streak == 0 ? absl::ZeroDuration() : std::min(absl::Seconds(8), absl::Milliseconds(500) * (1 << (streak - 1)));
      LogWarning("%s; restarting %s%s", why,
                 end == children_.size() ? "every process" : "the workers (the coordinator resumes its requests)",
                 backoff > absl::ZeroDuration() ? absl::StrCat(" in ", absl::FormatDuration(backoff)) : "");
      KillChildren(0, end);
      for (const absl::Time until = absl::Now() + backoff; absl::Now() < until && !StopNow();) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        PassOnStop();
      }
      if (StopNow()) break;
      const absl::Time start = absl::Now();
      const absl::Status st = Respawn(0, end);
      if (st.ok()) {
        healthy_since = absl::Now();
        LogInfo("restarted in %.1f s", absl::ToDoubleSeconds(healthy_since - start));
        break;
      }
      if (st.code() == absl::StatusCode::kCancelled) break;  // stopping at once
      why = absl::StrCat("the restart failed: ", st.message());
      ++streak;
      Reap();
      if (children_[workers].exited) end = children_.size();  // the coordinator went too
    }
  }
  return 0;
}

void Launch::StopAll() {
  if (stopped_) return;
  stopped_ = true;
  auto reaped = [](Child& c) {
    int status = 0;
    if (!c.exited && waitpid(c.pid, &status, WNOHANG) == c.pid) {
      c.exited = true;
      c.status = status;
    }
    return c.exited;
  };
  auto kill_rest = [](const std::vector<Child*>& group, absl::Duration waited) {
    for (Child* c : group) {
      if (c->exited) continue;
      LogWarning("%s (pid %d) did not stop within %s; killing it", c->name, c->pid, absl::FormatDuration(waited));
      kill(c->pid, SIGKILL);
      waitpid(c->pid, &c->status, 0);
      c->exited = true;
    }
  };
  std::vector<Child*> coordinator, workers;
  for (Child& c : children_) {
    if (c.pid <= 0 || c.exited) continue;
    (&c == &children_.back() ? coordinator : workers).push_back(&c);
  }
  // Coordinator first: it refuses new requests and lets those in flight end
  // (up to --drain-timeout-s; a second signal to the launcher is passed on,
  // which ends them at once), while the workers still serve them (Serve
  // replaced any that died meanwhile). Then the workers, all at once.
  if (!coordinator.empty()) {
    if (!draining_) {
      // Start-up cut short, or Serve gave up: no drain was asked for.
      serving_ = draining_ = true;
      drain_deadline_ = absl::Now() + absl::Seconds(5) + absl::Seconds(c_.drain_timeout_s);
      signals_passed_ = StopSignals();
      kill(coordinator[0]->pid, SIGTERM);
    }
    // After giving up, the requests in flight wait for workers that will not
    // come back: a second SIGTERM ends them at once, with an error. Sent
    // again every 200 ms until the coordinator exits, since it counts only
    // the signals that arrive once its drain has begun.
    absl::Time hurry = absl::Now() + absl::Milliseconds(100);
    while (!reaped(*coordinator[0]) && absl::Now() < drain_deadline_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      PassOnStop();
      if (gave_up_ && absl::Now() >= hurry) {
        kill(coordinator[0]->pid, SIGTERM);
        hurry += absl::Milliseconds(200);
      }
    }
    kill_rest(coordinator, absl::Seconds(5) + absl::Seconds(c_.drain_timeout_s));
  }
  for (Child* c : workers) kill(c->pid, SIGTERM);
  for (const absl::Time deadline = absl::Now() + absl::Seconds(5); absl::Now() < deadline;) {
    bool running = false;
    for (Child* c : workers) running = !reaped(*c) || running;
    if (!running) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill_rest(workers, absl::Seconds(5));
  RemoveSegments();
}

void Launch::RemoveSegments() {
  if (prefix_.empty()) return;
  std::error_code ec;
  int removed = 0;
  for (const auto& entry : fs::directory_iterator("/dev/shm", ec)) {
    if (entry.path().filename().string().rfind(prefix_, 0) == 0) {
      fs::remove(entry.path(), ec);
      ++removed;
    }
  }
  fs::remove_all(run_dir_, ec);
  LogInfo("stopped all processes%s", removed ? absl::StrCat("; removed ", removed, " leftover segments") : "");
}

int Main(int argc, char** argv) {
  SetLogIdentity("launch");
  Args args(
      "ellm-launch: start ellm on this server.\n\n"
      "Starts one attention worker per NUMA node (each owning an equal share of the\n"
      "model's KV heads, bound to its node), the MLP worker and the coordinator;\n"
      "waits until all are healthy and prints the address it listens on. Ctrl-C or\n"
      "SIGTERM stops every process and removes every shared-memory segment.\n\n"
      "Usage: ellm-launch [--model FILE.gguf] [flags]\n"
      "Model: --model, else $ELLM_MODEL, else ../shared/models/stories260K.gguf.\n"
      "Binaries: --bin-dir, else $ELLM_BIN_DIR, else the folder of ellm-launch when\n"
      "it holds them, else ./build.");
  args.Flag("model", "", "GGUF model file");
  args.Flag("host", "127.0.0.1", "address the public gRPC API listens on");
  args.Flag("port", "50051", "port of the public gRPC API");
  args.Flag("http-port", "8080", "port of the OpenAI-compatible HTTP API, /health and /metrics on --host "
            "(0: none)");
  args.Flag("http-max-body-mb", "8", "largest HTTP request body (larger: 413)");
  args.Flag("http-max-connections", "1024", "most HTTP connections open at once (more: answered 503 and closed)");
  args.Flag("client-write-timeout-s", "60", "how long one write of an answer may wait for the client to "
            "read it (gRPC and HTTP); a client that reads nothing for this long has its request cancelled");
  args.Flag("drain-timeout-s", "30",
            "on Ctrl-C or SIGTERM, new requests are refused and those in flight run to their end for at most "
            "this long before they are ended (0: at once); a second Ctrl-C ends them at once");
  args.Flag("attn-workers", "0", "attention workers (0: one per NUMA node); must divide the KV heads");
  args.Flag("kv-cache-mb", "0", "KV cache per attention worker in MiB (0: enough for --max-batch "
            "sequences at full context, at most a quarter of RAM)");
  args.Flag("max-batch", "16", "most sequences decoded together");
  args.Flag("max-step-tokens", "256", "most tokens in one step (prompt chunks + decodes)");
  args.Flag("max-queue", "64", "most requests waiting for admission (more: RESOURCE_EXHAUSTED / HTTP 429)");
  args.Flag("default-max-tokens", "128",
            "max_tokens of a request that does not say (less where the context or the KV cache has less room left)");
  args.Flag("mlp-threads", "0", "threads of the CPU MLP backend (0: the cores of node 0)");
  args.Flag("topology", "", "NUMA topology to use instead of the machine's, e.g. 0:0-7;1:8-15 (numactl "
            "binds to these nodes: a layout this machine does not have needs --no-numactl)");
  args.Flag("kv-dtype", "int8", "KV cache element type: int8, f16 or f32 ($ELLM_KV_DTYPE sets the default)");
  args.Flag("backend", "auto", "MLP backend: auto (cuda when a GPU is visible, else cpu), cpu or cuda");
  args.Flag("cpu-weights", "native", "cpu backend: native (quantised kernels on the GGUF types) or f32 "
            "(dequantised at load; bit-exact with the reference forward)");
  args.Flag("matmul-isa", "auto", "cpu backend: force the matrix kernels' instruction set: reference, avx2, "
            "avx2-vnni, avx512 or amx (the prefill of block-quantised weights, Q8_0, Q4_0, Q4_K, Q5_K and "
            "Q6_K, on the AMX tile unit in bf16; results then depend on how prompts are cut into steps); "
            "auto: the fastest batch-independent set this CPU runs");
  args.Flag("q8-act-bits", "8", "cpu backend, plain avx2 matrix kernels: bits of the activation codes Q8_0 "
            "weights are multiplied with: 8, or 7 (prefill's matrix work about 20% faster, at about twice "
            "the activation rounding); the other kernel sets always take 8");
  args.Flag("attn-kernel", "auto", "force the attention kernel: reference, avx2, avx2-vnni, avx512 or "
            "amx (int8 prefill on the AMX tile unit with p·V in bf16; results then depend on how prompts "
            "are cut into steps); auto: the fastest batch-independent kernel this CPU runs");
  args.Flag("bin-dir", "", "folder holding ellm-attn-worker, ellm-mlp-worker, ellm-coordinator");
  args.Flag("log-level", "info", "debug, info, warning or error");
  args.Flag("no-numactl", "", "do not wrap the workers in numactl (it binds each attention worker's CPUs and "
            "memory to its node, and the MLP worker's CPUs to its node)", true);
  args.Flag("no-prefix-cache", "", "do not share KV blocks of equal prompt prefixes across requests",
            true);
  args.Flag("no-reasoning-parser", "", "OpenAI chat with Qwen3's template: keep an answer's <think>...</think> "
            "block in its content (default: returned apart, as reasoning_content, as vLLM's qwen3 reasoning "
            "parser does)", true);
  args.Flag("allow-synthetic-context", "", "accept requests' synthetic_context (ellm-bench e2e: random K/V "
            "written into the caches before the prompt; every step waits while it is written)", true);
  args.Flag("kv-store", "", "folder for the KV store: cached prefixes written to disk and loaded back "
            "after eviction or a restart (default: none)");
  args.Flag("kv-store-mb", "16384", "most MiB the KV store's files take, all workers together");
  args.Flag("api-key", "", "require this key on every public call (gRPC metadata 'authorization: "
            "Bearer KEY'); $ELLM_API_KEY sets it too");
  args.Flag("insecure-public", "", "listen on a non-loopback --host without an API key", true);
  args.Flag("tls-cert", "", "PEM certificate chain: serve the public port over TLS");
  args.Flag("tls-key", "", "PEM private key of --tls-cert");
  args.Flag("no-restart", "", "when a worker dies, stop serving instead of restarting the workers "
            "and resuming", true);
  args.Flag("max-restarts", "5", "failures in a row (a restart that does not come up, or processes dying right after one) "
            "before the launch gives up");
  args.Flag("ready-timeout", "180", "seconds to wait for every process to become healthy");
  args.Flag("heartbeat-ms", "500", "interval of the coordinator's health checks of the workers; a worker that "
            "misses two is frozen and killed (then restarted, see --no-restart)");
  args.Flag("min-step-timeout-s", "2", "a step that takes 10x its expected time (the recent p99 scaled to its tokens and attended positions), and at least this, is stuck: "
            "its workers are killed (then restarted)");
  if (std::optional<int> exit = args.ParseFlagsOnly(argc, argv)) return *exit;
  LaunchConfig c;
  absl::StatusOr<std::string> model = FindModel(args.Get("model"));
  if (!model.ok()) {
    LogError("%s", model.status().message());
    return 2;
  }
  c.model_path = *model;
  c.host = args.Get("host");
  c.topology_spec = args.Get("topology");
  c.bin_dir = FindBinDir(args.Get("bin-dir"), argv[0]);
  c.log_level = args.Get("log-level");
  if (LogLevel parsed; !ParseLogLevel(c.log_level, &parsed)) {
    LogError("--log-level must be debug, info, warning or error, got '%s'", c.log_level);
    return 2;
  }
  c.use_numactl = !args.GetBool("no-numactl");
  c.prefix_cache = !args.GetBool("no-prefix-cache");
  c.reasoning_parser = !args.GetBool("no-reasoning-parser");
  c.allow_synthetic_context = args.GetBool("allow-synthetic-context");
  c.kv_store = args.Get("kv-store");
  c.restart = !args.GetBool("no-restart");
  c.api_key = args.Get("api-key");
  if (!args.IsSet("api-key")) {
    if (const char* env = std::getenv("ELLM_API_KEY"); env != nullptr) c.api_key = env;
  }
  c.insecure_public = args.GetBool("insecure-public");
  c.tls_cert = args.Get("tls-cert");
  c.tls_key = args.Get("tls-key");
  if (c.tls_cert.empty() != c.tls_key.empty()) {
    LogError("--tls-cert and --tls-key go together");
    return 2;
  }
  const std::string host = args.Get("host");
  const bool loopback = host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
  if (!loopback) {
    LogWarning("--host %s listens beyond this machine: %s%s", host,
               c.api_key.empty() ? "anyone who reaches it can use the model"
                                 : "whoever reaches it and has the API key can use the model",
               c.tls_cert.empty() ? ", and traffic is not encrypted (--tls-cert, --tls-key)" : "");
    if (c.api_key.empty() && !c.insecure_public) {
      LogError("a non-loopback --host needs --api-key KEY (or $ELLM_API_KEY), or --insecure-public to "
               "serve without one");
      return 2;
    }
  }
  std::string kv_dtype = args.Get("kv-dtype");
  if (!args.IsSet("kv-dtype")) {
    if (const char* env = std::getenv("ELLM_KV_DTYPE"); env != nullptr && *env) kv_dtype = env;
  }
  absl::StatusOr<KvDType> kv = ParseKvDType(kv_dtype);
  absl::StatusOr<Isa> matmul_isa = ParseIsa(args.Get("matmul-isa"));
  absl::StatusOr<Isa> attn_kernel = ParseIsa(args.Get("attn-kernel"));
  absl::StatusOr<MlpBackendKind> backend = ParseMlpBackend(args.Get("backend"));
  absl::StatusOr<CpuWeights> cpu_weights = ParseCpuWeights(args.Get("cpu-weights"));
  for (const auto& [flag, status] : {std::pair<const char*, absl::Status>{"kv-dtype", kv.status()},
                                     {"matmul-isa", matmul_isa.status()},
                                     {"attn-kernel", attn_kernel.status()},
                                     {"backend", backend.status()},
                                     {"cpu-weights", cpu_weights.status()}}) {
    if (!status.ok()) {
      LogError("--%s: %s", flag, status.message());
      return 2;
    }
  }
  c.backend = *backend;
  c.cpu_weights = *cpu_weights;
  c.kv_dtype = *kv;
  c.matmul_isa = *matmul_isa;
  c.attn_kernel = *attn_kernel;
  absl::Status st = args.GetInts({{"port", &c.port}, {"http-port", &c.http_port},
                     {"http-max-body-mb", &c.http_max_body_mb}, {"http-max-connections", &c.http_max_connections},
                     {"client-write-timeout-s", &c.client_write_timeout_s}, {"attn-workers", &c.attn_workers},
                     {"drain-timeout-s", &c.drain_timeout_s},
                     {"kv-cache-mb", &c.kv_cache_mb}, {"max-batch", &c.max_batch},
                     {"max-step-tokens", &c.max_step_tokens}, {"max-queue", &c.max_queue}, {"mlp-threads", &c.mlp_threads},
                     {"default-max-tokens", &c.default_max_tokens},
                     {"ready-timeout", &c.ready_timeout_s}, {"kv-store-mb", &c.kv_store_mb},
                     {"max-restarts", &c.max_restarts}, {"q8-act-bits", &c.q8_act_bits},
                     {"heartbeat-ms", &c.heartbeat_ms}});
  if (st.ok()) {
    absl::StatusOr<double> step = args.GetDouble("min-step-timeout-s");
    st = step.status();
    if (step.ok()) c.min_step_timeout_s = *step;
  }
  if (!st.ok()) {
    LogError("%s", st.message());
    return 2;
  }
  if (c.heartbeat_ms <= 0 || !(c.min_step_timeout_s > 0) || c.client_write_timeout_s <= 0) {
    LogError("--heartbeat-ms, --min-step-timeout-s and --client-write-timeout-s must be positive");
    return 2;
  }
  if (c.drain_timeout_s < 0 || c.drain_timeout_s > 86400) {
    LogError("--drain-timeout-s must be 0..86400");
    return 2;
  }
  if (c.q8_act_bits != 8 && c.q8_act_bits != 7) {
    LogError("--q8-act-bits: expected 8 or 7, got %d", c.q8_act_bits);
    return 2;
  }
  for (const auto& [bad, message] : std::initializer_list<std::pair<bool, const char*>>{
           {c.port <= 0 || c.port > 65535, "--port must be 1..65535"},
           {c.attn_workers < 0, "--attn-workers must be 0 (one per NUMA node) or more"},
           {c.max_batch <= 0, "--max-batch must be positive"},
           {c.max_step_tokens <= 0, "--max-step-tokens must be positive"},
           {c.default_max_tokens <= 0, "--default-max-tokens must be positive"}}) {
    if (bad) {
      LogError("%s", message);
      return 2;
    }
  }
  if (!c.kv_store.empty() && (!c.prefix_cache || c.kv_store_mb <= 0)) {
    LogError("--kv-store needs the prefix cache (no --no-prefix-cache) and a positive --kv-store-mb");
    return 2;
  }
  InstallStopSignalHandlers();
  Launch launch(c);
  st = launch.Start();
  if (!st.ok()) {
    LogError("%s", st.message());
    return 1;
  }
  return launch.Serve();
}

}  // namespace
}  // namespace ellm::launch

int main(int argc, char** argv) { return ellm::launch::Main(argc, argv); }
