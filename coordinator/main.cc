// ellm-coordinator: the public endpoint. Loads the tokenizer, connects to the
// workers, and serves Generate / Tokenize / GetModelInfo and gRPC health.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <cstdio>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "coordinator/http_server.h"
#include "coordinator/scheduler.h"
#include "coordinator/service.h"
#include "coordinator/worker_link.h"
#include "coordinator/workers.h"
#include "proto/control_secret.h"
#include "core/args.h"
#include "core/gguf.h"
#include "core/log.h"
#include "core/model_config.h"
#include "core/signals.h"
#include "core/tokenizer.h"

namespace ellm::coord {
namespace {

struct CoordinatorConfig {
  std::string model_path;
  std::string listen;
  std::string http_listen;
  int http_max_body_mb = 8;
  int http_max_connections = 1024;
  int client_write_timeout_s = 60;
  std::string mlp_channel;
  std::vector<std::string> workers;
  int max_batch = 16;
  int max_step_tokens = 256;
  int max_queue = 64;
  bool prefix_cache = true;
  bool reasoning_parser = true;
  bool allow_synthetic_context = false;
  bool kv_store = false;
  bool recover = true;
  std::string control_secret_file;
  std::string api_key_file;
  std::string tls_cert, tls_key;
  std::string control_listen;
  absl::Duration recovery_timeout;
  absl::Duration min_step_timeout;
  absl::Duration heartbeat;
  int default_max_tokens = 128;
  absl::Duration connect_timeout;
  absl::Duration drain_timeout;
};

// The flags, spelled as on every ellm binary (core/args.h).
Args Flags() {
  Args a(
      "ellm-coordinator: public gRPC endpoint of ellm (started by ellm-launch).\n"
      "Tokenizes, schedules requests into steps, and streams generated text.");
  a.Flag("model", "", "GGUF model file (tokenizer and shapes are read from it)");
  a.Flag("listen", "127.0.0.1:50051", "public gRPC address");
  a.Flag("http-listen", "",
         "address of the OpenAI-compatible HTTP API and /metrics, HOST:PORT (empty: none)");
  a.Flag("http-max-body-mb", "8", "largest HTTP request body (larger: 413)");
  a.Flag("http-max-connections", "1024", "most HTTP connections open at once (more: answered 503 and closed)");
  a.Flag("client-write-timeout-s", "60",
         "how long one write of an answer may wait for the client to read it (gRPC and HTTP); a client "
         "that reads nothing for this long has its request cancelled");
  a.Flag("mlp-channel", "", "the mlp-worker's shared-memory channel");
  a.Flag("workers", "", "control addresses of all workers, comma-separated");
  a.Flag("max-batch", "16", "most sequences in one step");
  a.Flag("max-step-tokens", "256", "most tokens in one step");
  a.Flag("max-queue", "64", "most requests waiting for admission (more: RESOURCE_EXHAUSTED)");
  a.Flag("default-max-tokens", "128", "max_tokens of a request that does not say (less where the context or the KV cache has less room left)");
  a.Flag("prefix-cache", "true", "share the KV blocks of equal prompt prefixes across requests (true or false)",
         true);
  a.Flag("reasoning-parser", "true",
         "OpenAI chat on a template whose answers think (Qwen3's): return an answer's opening "
         "<think>...</think> block as reasoning_content, apart from its content (true or false)",
         true);
  a.Flag("kv-store", "false",
         "the attention workers keep cached blocks on disk (their --kv-store): index them and load on a match",
         true);
  a.Flag("allow-synthetic-context", "false",
         "accept requests' synthetic_context (benchmarks: random K/V written into the workers' caches "
         "before the prompt; every step waits while it is written) (true or false)",
         true);
  a.Flag("connect-timeout-s", "120", "how long to wait for the workers at start-up");
  a.Flag("drain-timeout-s", "30",
         "on SIGTERM or Ctrl-C: new requests are refused and those in flight run to their end for at "
         "most this long, then are ended (0: end them at once; a second signal ends them at once)");
  a.Flag("recover", "true",
         "after a worker dies or freezes, wait for the launcher to restart the workers and resume "
         "every request; if they are not back within --recovery-timeout-s, exit with status 1 so "
         "that the launcher restarts everything (false: end them all with UNAVAILABLE and stop serving)",
         true);
  a.Flag("recovery-timeout-s", "300", "how long to wait for restarted workers before giving up");
  a.Flag("min-step-timeout-s", "2",
         "a step is stuck after 10x the recent p99 step time, and never before this");
  a.Flag("heartbeat-ms", "500", "interval of the workers' health checks (two missed: frozen)");
  a.Flag("control-secret-file", "",
         "file (0600) holding the launch's control secret, sent with every worker control call");
  a.Flag("api-key-file", "",
         "file (0600) holding the API key every public call must carry (authorization: Bearer KEY)");
  a.Flag("tls-cert", "", "PEM certificate chain: serve the public port over TLS");
  a.Flag("tls-key", "", "PEM private key of --tls-cert");
  a.Flag("control-listen", "",
         "a second, private address (e.g. unix:/run/dir/coordinator.sock) where the launcher checks "
         "health whatever the public port's TLS");
  a.Flag("log-level", "info", "debug, info, warning or error");
  return a;
}

absl::StatusOr<CoordinatorConfig> ConfigFromFlags(const Args& args) {
  CoordinatorConfig c;
  c.model_path = args.Get("model");
  c.listen = args.Get("listen");
  c.http_listen = args.Get("http-listen");
  c.mlp_channel = args.Get("mlp-channel");
  c.workers = absl::StrSplit(args.Get("workers"), ',', absl::SkipEmpty());
  int connect_timeout_s = 0, recovery_timeout_s = 0, heartbeat_ms = 0, drain_timeout_s = 0;
  RETURN_IF_ERROR(args.GetInts({{"http-max-body-mb", &c.http_max_body_mb},
                                {"http-max-connections", &c.http_max_connections},
                                {"client-write-timeout-s", &c.client_write_timeout_s}, {"max-batch", &c.max_batch},
                                {"max-step-tokens", &c.max_step_tokens}, {"max-queue", &c.max_queue},
                                {"default-max-tokens", &c.default_max_tokens},
                                {"connect-timeout-s", &connect_timeout_s},
                                {"recovery-timeout-s", &recovery_timeout_s},
                                {"heartbeat-ms", &heartbeat_ms}, {"drain-timeout-s", &drain_timeout_s}}));
  ASSIGN_OR_RETURN(const double min_step_timeout_s, args.GetDouble("min-step-timeout-s"));
  if (c.http_max_body_mb <= 0) return absl::InvalidArgumentError("--http-max-body-mb must be positive");
  if (c.http_max_connections <= 0) return absl::InvalidArgumentError("--http-max-connections must be positive");
  if (c.client_write_timeout_s <= 0) return absl::InvalidArgumentError("--client-write-timeout-s must be positive");
  if (drain_timeout_s < 0 || drain_timeout_s > 86400) {
    return absl::InvalidArgumentError("--drain-timeout-s must be 0..86400");
  }
  c.drain_timeout = absl::Seconds(drain_timeout_s);
  c.prefix_cache = args.GetBool("prefix-cache");
  c.reasoning_parser = args.GetBool("reasoning-parser");
  c.allow_synthetic_context = args.GetBool("allow-synthetic-context");
  c.kv_store = args.GetBool("kv-store") && c.prefix_cache;
  c.recover = args.GetBool("recover");
  c.connect_timeout = absl::Seconds(connect_timeout_s);
  c.control_secret_file = args.Get("control-secret-file");
  c.api_key_file = args.Get("api-key-file");
  c.tls_cert = args.Get("tls-cert");
  c.tls_key = args.Get("tls-key");
  c.control_listen = args.Get("control-listen");
  if (c.control_secret_file.empty()) {
    return absl::InvalidArgumentError("--control-secret-file is required (ellm-launch writes one)");
  }
  if (c.tls_cert.empty() != c.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  c.recovery_timeout = absl::Seconds(recovery_timeout_s);
  c.min_step_timeout = absl::Seconds(min_step_timeout_s);
  c.heartbeat = absl::Milliseconds(heartbeat_ms);
  if (c.recovery_timeout <= absl::ZeroDuration() || c.min_step_timeout <= absl::ZeroDuration() ||
      c.heartbeat <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--recovery-timeout-s, --min-step-timeout-s and --heartbeat-ms must be positive");
  }
  if (c.model_path.empty()) return absl::InvalidArgumentError("--model is required");
  if (c.mlp_channel.empty()) return absl::InvalidArgumentError("--mlp-channel is required");
  if (c.workers.empty()) return absl::InvalidArgumentError("--workers is required");
  if (c.max_batch <= 0 || c.max_step_tokens <= 0 || c.max_queue < 0 || c.default_max_tokens <= 0) {
    return absl::InvalidArgumentError("batch, step, queue and token limits must be positive");
  }
  return c;
}

// The model's name in the HTTP API: general.name when set, else the file's stem.
std::string ModelId(const std::string& path, const ModelConfig& model) {
  if (!model.name.empty()) return model.name;
  std::string stem = path.substr(path.rfind('/') + 1);
  if (stem.size() > 5 && stem.substr(stem.size() - 5) == ".gguf") stem.resize(stem.size() - 5);
  return stem;
}

// The workers' counters for a metrics scrape.
std::vector<Metrics::WorkerSample> WorkerSamples(WorkerLink& link) {
  std::vector<Metrics::WorkerSample> out;
  for (const ellm::v1::WorkerInfo& info : link.PollInfo()) {
    Metrics::WorkerSample w;
    w.attention = info.role() == ellm::v1::WORKER_ROLE_ATTN;
    w.name = w.attention ? absl::StrCat("attn-", info.shard()) : "mlp";
    w.kv_read_bytes = info.kv_read_bytes();
    w.probe_bytes_per_second = info.probe_bytes_per_second();
    w.blocks_total = info.kv_blocks_total();
    w.blocks_free = info.kv_blocks_free();
    w.blocks_cached = info.kv_blocks_cached();
    w.weight_read_bytes = info.weight_read_bytes();
    w.busy_seconds = info.busy_seconds();
    out.push_back(std::move(w));
  }
  return out;
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().empty()) return absl::InvalidArgumentError(absl::StrCat(path, " is empty"));
  return text.str();
}

// A graceful stop: new requests are refused while the queued and running
// ones (and their last HTTP bytes) go on to their end, for at most `timeout`
// or until a second SIGINT / SIGTERM. What is left then ends with
// UNAVAILABLE (Scheduler::Stop).
// The caller has stopped admissions (Scheduler::StopAdmitting).
void Drain(absl::Duration timeout, Scheduler* scheduler, const HttpServer* http) {
  // The scheduler's requests, or 1 while HTTP responses are still going out.
  auto in_flight = [&] {
    const SchedulerStats st = scheduler->Stats();
    const int n = st.running + st.waiting;
    return n > 0 ? n : (http != nullptr && http->answering() > 0 ? 1 : 0);
  };
  int n = in_flight();
  if (n == 0) return;
  if (timeout <= absl::ZeroDuration()) {
    LogInfo("%s in flight end now (--drain-timeout-s 0)", Count(n, "request"));
    return;
  }
  const SchedulerStats st = scheduler->Stats();
  LogInfo("draining: %d running and %d queued requests go on for up to %s; new ones are refused "
          "(a second Ctrl-C or SIGTERM ends them at once)",
          st.running, st.waiting, absl::FormatDuration(timeout));
  const absl::Time start = absl::Now(), deadline = start + timeout;
  absl::Time next_report = start + absl::Seconds(5);
  const int signals = StopSignals();
  while ((n = in_flight()) > 0) {
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      LogWarning("%s still in flight after --drain-timeout-s; ending them", Count(n, "request"));
      return;
    }
    if (StopSignals() > signals) {
      LogWarning("stopping at once: %s in flight end with UNAVAILABLE", Count(n, "request"));
      return;
    }
    if (now >= next_report) {
      LogInfo("draining: %s in flight", Count(n, "request"));
      next_report += absl::Seconds(5);
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  LogInfo("drain over: no request in flight after %.1f s", absl::ToDoubleSeconds(absl::Now() - start));
}

absl::Status Run(const CoordinatorConfig& config) {
  ASSIGN_OR_RETURN(auto file, GgufFile::Open(config.model_path));
  ASSIGN_OR_RETURN(ModelConfig model, ModelConfig::FromGguf(*file));
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, Tokenizer::FromGguf(*file));
  LogInfo("model %s: %s; tokenizer with %d tokens", config.model_path, model.DebugString(),
          tokenizer->vocab_size());

  LogInfo("connecting to %d workers", static_cast<int>(config.workers.size()));
  WorkersOptions wo;
  wo.mlp_channel = config.mlp_channel;
  wo.addresses = config.workers;
  wo.connect_timeout = config.connect_timeout;
  wo.recovery_timeout = config.recovery_timeout;
  wo.min_step_timeout = config.min_step_timeout;
  wo.heartbeat_timeout = std::max(config.heartbeat, absl::Milliseconds(500));
  // A recovery goes on during a drain (the launcher still replaces dead
  // workers then, and the requests in flight resume); it is given up when
  // the drain is over.
  std::atomic<bool> drained{false};
  wo.stop = [&drained] { return drained.load(); };
  ASSIGN_OR_RETURN(wo.control_secret,
                   CallSecret::FromFile(CallSecret::Kind::kControl, config.control_secret_file));
  ASSIGN_OR_RETURN(std::unique_ptr<Workers> workers, Workers::Connect(wo));
  std::shared_ptr<WorkerLink> link = workers->link();
  std::vector<const ellm::v1::WorkerInfo*> attn = link->attn_workers();
  if (attn.empty() || link->mlp_worker() == nullptr) {
    return absl::InvalidArgumentError("need at least one attn-worker and the mlp-worker in --workers");
  }
  int64_t kv_blocks = attn[0]->kv_blocks_total();
  const int block_tokens = attn[0]->kv_block_tokens();
  for (const ellm::v1::WorkerInfo* w : attn) {
    kv_blocks = std::min(kv_blocks, w->kv_blocks_total());
    if (w->kv_block_tokens() != block_tokens) {
      return absl::InvalidArgumentError("attention workers disagree on --block-tokens");
    }
  }
  // Every worker's rings hold the coordinator's largest step.
  for (const WorkerHandle& h : link->workers()) {
    const ellm::v1::WorkerInfo& w = h.info;
    if (w.max_batch() < config.max_batch || w.max_step_tokens() < config.max_step_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          WorkerName(w), " was sized for ", w.max_batch(), " sequences / ", w.max_step_tokens(),
          " tokens per step, less than the coordinator's"));
    }
  }

  SchedulerOptions so;
  so.max_batch = config.max_batch;
  so.max_step_tokens = config.max_step_tokens;
  so.kv_blocks = kv_blocks;
  so.kv_block_tokens = block_tokens;
  so.max_queue = config.max_queue;
  so.prefix_cache = config.prefix_cache;
  so.kv_store = config.kv_store;
  so.recover = config.recover;
  Metrics metrics;
  so.metrics = &metrics;
  so.context_length = model.context_length;
  Scheduler scheduler(so, *tokenizer, workers.get());
  if (config.kv_store) {
    absl::StatusOr<WorkerLink::StoredBlocks> stored = link->ListStoredBlocks();
    if (stored.ok()) {
      scheduler.AddStored(stored->blocks, stored->capacity);
      LogInfo("KV store: %d blocks on disk match this model (%d tokens); room for %d blocks", stored->blocks.size(),
              static_cast<int64_t>(stored->blocks.size()) * block_tokens, stored->capacity);
    } else {
      LogWarning("KV store: cannot list the workers' blocks: %s", stored.status().message());
    }
  }

  ServiceOptions service_options;
  service_options.model_path = config.model_path;
  service_options.default_max_tokens = config.default_max_tokens;
  service_options.allow_synthetic_context = config.allow_synthetic_context;
  service_options.client_write_timeout = absl::Seconds(config.client_write_timeout_s);
  service_options.worker_info = [&workers] { return workers->link()->PollInfo(); };
  ellm::v1::ModelInfo& info = service_options.model_info;
  info.set_model_path(config.model_path);
  info.set_architecture(model.arch);
  info.set_name(model.name);
  info.set_layers(model.n_layers);
  info.set_hidden(model.dim);
  info.set_heads(model.n_heads);
  info.set_kv_heads(model.n_kv_heads);
  info.set_head_dim(model.head_dim);
  info.set_vocab_size(model.vocab_size);
  info.set_context_length(model.context_length);
  info.set_attn_workers(static_cast<int>(attn.size()));
  info.set_mlp_backend(link->mlp_worker()->kernel());
  info.set_kv_blocks_total(kv_blocks);
  info.set_kv_block_tokens(block_tokens);
  info.set_max_batch(config.max_batch);
  info.set_prefix_cache(config.prefix_cache);
  info.set_kv_store(config.kv_store);
  if (!config.api_key_file.empty()) {
    ASSIGN_OR_RETURN(service_options.api_key, CallSecret::FromFile(CallSecret::Kind::kApiKey, config.api_key_file));
  }
  service_options.chat = ChatTemplate::FromGgufTemplate(
      file->Has("tokenizer.chat_template") ? file->GetString("tokenizer.chat_template").value_or("")
                                           : "");
  service_options.chat.CheckVocabulary(*tokenizer);
  LogInfo("chat template: %s%s%s", service_options.chat.name(),
          service_options.chat.takes_tools() ? " (takes tools)" : "",
          !service_options.chat.thinks()  ? ""
          : config.reasoning_parser       ? " (thinking returned as reasoning_content)"
                                          : " (thinking returned in content: --reasoning-parser=false)");
  info.set_chat_template(service_options.chat.name());
  info.set_chat(service_options.chat.format() != ChatFormat::kNone);
  info.set_tools(service_options.chat.takes_tools());
  EllmService service(service_options, model, *tokenizer, &scheduler);

  grpc::EnableDefaultHealthCheckService(true);
  // Reflection: grpcurl and other generic clients can list and call the API.
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!config.tls_cert.empty()) {
    ASSIGN_OR_RETURN(std::string cert, ReadSmallFile(config.tls_cert));
    ASSIGN_OR_RETURN(std::string key, ReadSmallFile(config.tls_key));
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({key, cert});
    credentials = grpc::SslServerCredentials(ssl);
  }
  builder.AddListeningPort(config.listen, credentials, &port);
  // gRPC sets SO_REUSEPORT by default: a second server on the same port
  // would start without a word and take part of this one's clients.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Pings every 30 s: a client whose host vanished (no FIN, no RST) is found
  // within 40 s, and the thread writing its stream is freed (its request
  // cancelled), instead of waiting on TCP's retransmissions for minutes.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  if (!config.control_listen.empty()) {
    builder.AddListeningPort(config.control_listen, grpc::InsecureServerCredentials());
  }
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", config.listen,
                                               " (is another server using the port?)"));
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus(false);  // SERVING once the HTTP API listens too (below)
  scheduler.on_broken = [health](const absl::Status& status) {
    if (status.code() == absl::StatusCode::kCancelled) {
      LogInfo("stopping: %s", status.message());
    } else {
      LogError("not serving any more: %s", status.message());
    }
    health->SetServingStatus(false);
  };
  scheduler.on_recovering = [health, &scheduler](bool recovering) {
    // NOT_SERVING while the workers restart, and after it during a drain.
    health->SetServingStatus(!recovering && scheduler.admitting());
  };
  LogInfo("serving on %s (%d KV blocks of %d positions, batch up to %d, prefix cache %s)",
          config.listen, kv_blocks, block_tokens, config.max_batch, config.prefix_cache ? "on" : "off");

  auto serving = [&scheduler] { return !scheduler.broken() && !scheduler.recovering() && scheduler.admitting(); };
  std::unique_ptr<HttpServer> http;
  if (!config.http_listen.empty()) {
    HttpOptions ho;
    const size_t colon = config.http_listen.rfind(':');
    int http_port = -1;
    if (colon == std::string::npos || !absl::SimpleAtoi(config.http_listen.substr(colon + 1), &http_port)) {
      return absl::InvalidArgumentError(absl::StrCat("--http-listen must be HOST:PORT, got '", config.http_listen, "'"));
    }
    ho.host = config.http_listen.substr(0, colon);
    ho.port = http_port;
    ho.max_body_bytes = int64_t{config.http_max_body_mb} << 20;
    ho.max_connections = config.http_max_connections;
    ho.write_timeout = std::chrono::seconds(config.client_write_timeout_s);
    ho.model_id = ModelId(config.model_path, model);
    ho.reasoning_parser = config.reasoning_parser;
    ho.serving = serving;
    ho.metrics = [&scheduler, &metrics, &workers] {
      return metrics.Render(scheduler.Stats(), WorkerSamples(*workers->link()));
    };
    ASSIGN_OR_RETURN(http, HttpServer::Start(ho, &service, &scheduler, tokenizer.get()));
    LogInfo("HTTP API on %s:%d (OpenAI-compatible /v1, /health, /metrics)", ho.host, http->port());
  }
  // Ready: the launcher (and load balancers) see SERVING only now, so a
  // server that cannot open its HTTP port is never announced as ready.
  health->SetServingStatus(serving());

  // Heartbeats: a dead or frozen worker pauses every request until the
  // launcher has restarted the workers (or, without --recover, ends them).
  absl::Status exit_status;
  absl::Time next_heartbeat = absl::Now() + config.heartbeat;
  while (!StopRequested()) {
    // A stop signal is seen within 20 ms, whatever --heartbeat-ms.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (absl::Now() < next_heartbeat) continue;
    next_heartbeat = absl::Now() + config.heartbeat;
    if (scheduler.broken() && config.recover && !StopRequested()) {
      // The workers did not come back (or the KV state is lost): a
      // launcher that restarts processes starts everything again.
      exit_status = absl::UnavailableError("not serving any more; exiting so that the launcher restarts ellm");
      break;
    }
    if (scheduler.broken() || scheduler.recovering()) continue;
    absl::Status st = workers->Heartbeat();
    if (!st.ok()) {
      LogError("%s; %s", st.message(),
               config.recover ? "pausing requests until the workers are back"
                              : "requests now fail with UNAVAILABLE");
      health->SetServingStatus(false);
      scheduler.WorkerFailed(absl::UnavailableError(absl::StrCat("a worker failed: ", st.message())));
    }
  }
  scheduler.StopAdmitting();
  health->SetServingStatus(false);
  if (exit_status.ok()) Drain(config.drain_timeout, &scheduler, http.get());
  drained = true;
  LogInfo("stopping");
  scheduler.Stop();
  // The ended requests' last events (their errors) still go out, briefly.
  for (const absl::Time end = absl::Now() + absl::Seconds(2);
       http != nullptr && http->answering() > 0 && absl::Now() < end;) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  http.reset();  // after the scheduler: no more events reach its sessions
  // The same for gRPC's Generate calls; then a short grace for their last
  // messages. (Shutdown waits for every connection to close, so a client
  // that merely keeps an idle channel open held every stop for the whole
  // deadline: 2 s.)
  for (const absl::Time end = absl::Now() + absl::Seconds(2); service.generating() > 0 && absl::Now() < end;) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(250));
  return exit_status;
}

}  // namespace
}  // namespace ellm::coord

int main(int argc, char** argv) {
  ellm::DieWithParent();
  ellm::Args args = ellm::coord::Flags();
  if (std::optional<int> exit_code = args.ParseFlagsOnly(argc, argv)) return *exit_code;
  ellm::LogLevel level = ellm::LogLevel::kInfo;
  if (!ellm::ParseLogLevel(args.Get("log-level"), &level)) {
    std::fprintf(stderr, "--log-level must be debug, info, warning or error, got '%s'\n",
                 args.Get("log-level").c_str());
    return 2;
  }
  ellm::SetLogIdentity("coordinator", level);
  ellm::InstallStopSignalHandlers();
  // Every client connection (gRPC or HTTP) takes a descriptor; the usual
  // soft limit of 1024 would refuse clients long before --http-max-connections.
  if (rlimit files{}; getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = std::min<rlim_t>(files.rlim_max, 65536);
    if (setrlimit(RLIMIT_NOFILE, &files) == 0) {
      ellm::LogDebug("open files limit raised to %d", static_cast<int>(files.rlim_cur));
    }
  }
  absl::StatusOr<ellm::coord::CoordinatorConfig> config = ellm::coord::ConfigFromFlags(args);
  if (!config.ok()) {
    ellm::LogError("%s", config.status().message());
    return 2;
  }
  absl::Status status = ellm::coord::Run(*config);
  if (!status.ok()) {
    ellm::LogError("%s", status.ToString());
    return 1;
  }
  return 0;
}
