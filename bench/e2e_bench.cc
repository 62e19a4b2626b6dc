// ellm-bench e2e: decode speed of the whole system (real processes, rings,
// gRPC) at long context, against the machine's bound
//   (KV bytes read + weight bytes read per token) / read bandwidth,
// with the bandwidth measured by a probe in this process just before.
#include "bench/e2e_bench.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/args.h"
#include "core/gguf.h"
#include "core/kv_format.h"
#include "core/model_config.h"
#include "core/read_probe.h"
#include "core/thread_pool.h"
#include "core/topology.h"
#include "proto/ellm.grpc.pb.h"

namespace ellm::bench {
namespace {

namespace fs = std::filesystem;

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Bytes of weights one decode step reads: every tensor but the embedding
// table (one row is gathered), which counts once as the LM head when tied.
double WeightBytesPerToken(const GgufFile& file) {
  double bytes = 0;
  bool has_output = file.FindTensor("output.weight") != nullptr;
  for (const GgufTensorInfo& t : file.tensors()) {
    if (t.name == "token_embd.weight" && has_output) continue;
    bytes += static_cast<double>(t.bytes);
  }
  return bytes;
}

// A launched ellm (or none when --server is given), stopped on destruction.
class Launched {
 public:
  // Stops it and removes its files (the log stays when it failed to start).
  ~Launched() {
    Stop();
    if (!out_path_.empty()) unlink(out_path_.c_str());
    if (!log_path_.empty() && !failed_) unlink(log_path_.c_str());
  }
  void Stop() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
    pid_ = -1;
  }
  absl::Status Start(const std::vector<std::string>& args) {
    const std::string out_path = out_path_ = absl::StrCat("/tmp/ellm-bench-", getpid(), ".out");
    const std::string log_path = log_path_ = absl::StrCat("/tmp/ellm-bench-", getpid(), ".log");
    unlink(out_path.c_str());  // a previous launch's "listening" line must not count
    pid_ = fork();
    if (pid_ == 0) {
      int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      dup2(out, 1);
      dup2(log, 2);
      std::vector<char*> argv;
      std::vector<std::string> copy = args;
      copy.insert(copy.begin() + 1, "--drain-timeout-s=0");  // a stopped bench waits for no request
      for (std::string& a : copy) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    std::fprintf(stderr, "[e2e] launching ellm (log: %s)\n", log_path.c_str());
    for (int i = 0; i < 6000; ++i) {
      std::ifstream in(out_path);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (text.find("ellm listening") != std::string::npos) return absl::OkStatus();
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        failed_ = true;
        return absl::UnavailableError(absl::StrCat("ellm-launch exited during start-up; see ", log_path));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    failed_ = true;
    return absl::DeadlineExceededError("ellm did not start within 10 minutes");
  }

 private:
  pid_t pid_ = -1;
  std::string out_path_, log_path_;
  bool failed_ = false;
};

struct Timing {
  grpc::Status status;
  std::vector<double> arrivals;  // seconds, one per streamed token
  double start = 0;
  int prompt_tokens = 0;
  int cached_tokens = 0;
  std::string text;
  std::vector<int32_t> ids;  // generated
  double ttft_ms() const { return arrivals.empty() ? 0 : (arrivals[0] - start) * 1e3; }
};

// The workers' busy seconds (ModelInfo) at a moment.
struct Busy {
  bool ok = false;
  double at = 0, mlp = 0, attn = 0;
};

Busy ReadBusy(ellm::v1::Ellm::Stub* stub) {
  Busy b;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  ellm::v1::ModelInfo info;
  b.ok = stub->GetModelInfo(&ctx, ellm::v1::GetModelInfoRequest(), &info).ok();
  b.at = Seconds();
  b.mlp = info.mlp_busy_seconds();
  b.attn = info.attn_busy_seconds();
  return b;
}

// `busy` (when given): the workers' busy seconds read when the first token
// arrives (decoding has begun) and again when the stream ends.
Timing Run(ellm::v1::Ellm::Stub* stub, const ellm::v1::GenerateRequest& req, Busy* busy = nullptr) {
  Timing t;
  grpc::ClientContext ctx;
  t.start = Seconds();
  auto reader = stub->Generate(&ctx, req);
  ellm::v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    const double now = Seconds();
    if (busy != nullptr && t.arrivals.empty() && resp.token_ids_size() > 0) busy[0] = ReadBusy(stub);
    for (int i = 0; i < resp.token_ids_size(); ++i) t.arrivals.push_back(now);
    t.ids.insert(t.ids.end(), resp.token_ids().begin(), resp.token_ids().end());
    t.text += resp.text();
    if (resp.has_finish()) {
      t.prompt_tokens = resp.finish().prompt_tokens();
      t.cached_tokens = resp.finish().cached_tokens();
    }
  }
  if (busy != nullptr) busy[1] = ReadBusy(stub);
  t.status = reader->Finish();
  return t;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Text of about `tokens` tokens (for the SPM vocabularies of the bench
// models), varied enough that no two turns repeat each other.
std::string Text(int tokens, int seed) {
  static const char* kWords[] = {"the", "little", "dog", "ran", "to", "park", "and", "saw", "a", "big",
                                 "red", "ball", "then", "she", "smiled", "at", "her", "friend", "sun"};
  std::string out;
  uint64_t x = 0x9E3779B97F4A7C15ULL * (seed + 1);
  for (int i = 0; i < tokens; ++i) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    out += " ";
    out += kWords[(x * 0x2545F4914F6CDD1DULL >> 33) % (sizeof(kWords) / sizeof(kWords[0]))];
  }
  return out;
}

// The ids of `text` from the server's tokenizer: as a text prompt would
// start (BOS where the model wants one), or without BOS for a continuation.
absl::StatusOr<std::vector<int32_t>> TokenIds(ellm::v1::Ellm::Stub* stub, const std::string& text,
                                              bool prompt_start) {
  ellm::v1::TokenizeRequest req;
  req.set_text(text);
  if (!prompt_start) req.set_add_bos(false);
  ellm::v1::TokenizeResponse resp;
  grpc::ClientContext ctx;
  const grpc::Status st = stub->Tokenize(&ctx, req, &resp);
  if (!st.ok()) return absl::UnavailableError(absl::StrCat("Tokenize: ", st.error_message()));
  return std::vector<int32_t>(resp.token_ids().begin(), resp.token_ids().end());
}

// --turns: a conversation over one long document. Turn 1 is the document
// (about --context tokens); every later turn appends the answer and about
// --turn-tokens new tokens, and generates --answer-tokens. Prints the time to
// first token of every turn with the prefix cache and without it, then, after
// a restart on the same --kv-store, of one more turn. With `ids`, the client
// sends token ids and appends the answer's own ids, as an agent that keeps
// them does; otherwise it sends text, and the answer is tokenized anew.
int RunTurns(const std::vector<std::string>& launch_base, const std::string& port_arg, int context,
             int turns, int turn_tokens, int answer_tokens, const std::string& server, bool ids) {
  const std::string store = absl::StrCat("/tmp/ellm-bench-kvstore-", getpid());
  struct Mode {
    const char* name;
    std::vector<std::string> flags;
  };
  const Mode modes[] = {{"off", {"--no-prefix-cache"}}, {"on", {"--kv-store=" + store}}};
  std::vector<std::string> prompts;  // the "on" run's, replayed after the restart
  double cold_ttft = 0;
  for (const Mode& mode : modes) {
    Launched launched;
    std::vector<std::string> args = launch_base;
    args.insert(args.end(), mode.flags.begin(), mode.flags.end());
    absl::Status st = launched.Start(args);
    if (!st.ok()) {
      std::fprintf(stderr, "ellm-bench e2e: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    auto stub = ellm::v1::Ellm::NewStub(grpc::CreateChannel(server, grpc::InsecureChannelCredentials()));
    std::string prompt = Text(context, 0);
    std::vector<int32_t> prompt_ids;
    double turn1 = 0;
    for (int turn = 1; turn <= turns + (std::string(mode.name) == "on" ? 1 : 0); ++turn) {
      const bool after_restart = std::string(mode.name) == "on" && turn == turns + 1;
      if (after_restart) {
        // Restart on the same store: the conversation's prefix is on disk only.
        launched.Stop();
        st = launched.Start(args);
        if (!st.ok()) {
          std::fprintf(stderr, "ellm-bench e2e: restart: %s\n", std::string(st.message()).c_str());
          return 1;
        }
        stub = ellm::v1::Ellm::NewStub(grpc::CreateChannel(server, grpc::InsecureChannelCredentials()));
      }
      std::fprintf(stderr, "[e2e] prefix cache %s, turn %d%s...\n", mode.name, turn,
                   after_restart ? " (after a restart, from the KV store)" : "");
      ellm::v1::GenerateRequest req;
      if (ids) {
        if (turn == 1) {
          absl::StatusOr<std::vector<int32_t>> first = TokenIds(stub.get(), prompt, true);
          if (!first.ok()) {
            std::fprintf(stderr, "ellm-bench e2e: %s\n", std::string(first.status().message()).c_str());
            return 1;
          }
          prompt_ids = *std::move(first);
        }
        for (int32_t id : prompt_ids) req.add_prompt_token_ids(id);
      } else {
        req.set_prompt(prompt);
      }
      req.set_max_tokens(answer_tokens);
      req.mutable_sampling()->set_temperature(0);
      Timing t = Run(stub.get(), req);
      if (!t.status.ok()) {
        std::fprintf(stderr, "ellm-bench e2e: turn %d: %s\n", turn, t.status.error_message().c_str());
        return 1;
      }
      if (turn == 1) turn1 = t.ttft_ms();
      if (turn == 1 && std::string(mode.name) == "off") cold_ttft = t.ttft_ms();
      // Text input: how many of the answer's ids the next prompt's text
      // tokenizes back to (the cache can serve those, and no more).
      std::string kept;
      if (!ids) {
        absl::StatusOr<std::vector<int32_t>> before = TokenIds(stub.get(), prompt, true);
        absl::StatusOr<std::vector<int32_t>> after = TokenIds(stub.get(), prompt + t.text, true);
        if (before.ok() && after.ok()) {
          std::vector<int32_t> want = *before;
          want.insert(want.end(), t.ids.begin(), t.ids.end());
          size_t same = 0;
          while (same < want.size() && same < after->size() && want[same] == (*after)[same]) ++same;
          const size_t answer = same > before->size() ? same - before->size() : 0;
          kept = absl::StrCat(" answer_ids_kept_as_text=", answer, "/", t.ids.size());
        }
      }
      std::printf("turn=%d prefix_cache=%s%s input=%s prompt_tokens=%d cached_tokens=%d ttft_ms=%.1f "
                  "ratio_to_turn1=%.4f ratio_to_cold=%.4f%s\n",
                  turn, mode.name, after_restart ? " restarted_from_kv_store=1" : "", ids ? "ids" : "text",
                  t.prompt_tokens,
                  t.cached_tokens, t.ttft_ms(), turn1 > 0 ? t.ttft_ms() / turn1 : 0,
                  cold_ttft > 0 ? t.ttft_ms() / cold_ttft : 0, kept.c_str());
      std::fflush(stdout);
      const std::string next = Text(turn_tokens, turn);
      prompt += t.text + next;
      if (ids) {
        absl::StatusOr<std::vector<int32_t>> next_ids = TokenIds(stub.get(), next, false);
        if (!next_ids.ok()) {
          std::fprintf(stderr, "ellm-bench e2e: %s\n", std::string(next_ids.status().message()).c_str());
          return 1;
        }
        prompt_ids.insert(prompt_ids.end(), t.ids.begin(), t.ids.end());
        prompt_ids.insert(prompt_ids.end(), next_ids->begin(), next_ids->end());
      }
    }
  }
  std::error_code ec;
  fs::remove_all(store, ec);
  (void)port_arg;
  return 0;
}

}  // namespace

int E2eMain(int argc, char** argv) {
  Args args(
      "ellm-bench e2e: decode ms/token of the whole system at long context, against the bound\n"
      "(KV bytes + weight bytes read per token) / probe bandwidth.\n\n"
      "Launches ellm (ellm-launch from --bin-dir) on --model, or uses a running one with --server.\n"
      "For each context it brings one sequence to that length, by real prefill (--fill prefill)\n"
      "or by writing random K/V straight into the attention workers' caches (--fill synthetic,\n"
      "the default; rows are labelled fill=synthetic), then decodes --tokens tokens and reports\n"
      "the median interval. Prints one key=value line per context on stdout:\n"
      "  context= kv_dtype= fill= ms_per_token= tokens_per_s= bound_ms= ratio= mlp_ms= mlp_bound_ms=\n"
      "  attention_ms= attention_bound_ms= other_ms= kv_mb= weight_mb= probe_gb_per_s= probe_before=\n"
      "  probe_after=\n"
      "(ratio = ms_per_token / bound_ms; 1.0 is the machine's limit), and one prefill line.\n"
      "The phases split ms_per_token by the workers' busy seconds (GetModelInfo) over the decoding:\n"
      "mlp_ms the mlp-worker's matrix work, attention_ms the busiest attn-worker's attention,\n"
      "other_ms the rest (hand-offs between the processes, waking threads, the coordinator); each\n"
      "beside its part of the bound (weights / probe, KV / probe). The busy seconds are read when\n"
      "the first token arrives and when the stream ends, each read up to a layer's work behind:\n"
      "the split is good to a few percent from --tokens 64 on.\n"
      "The probe is a streaming read on all cores in this process, run before the first context\n"
      "and again after each; a row's bound uses the best probe so far (probe_gb_per_s), and\n"
      "probe_before and probe_after show how far the machine's bandwidth drifted around it.\n\n"
      "Usage: ellm-bench e2e --model FILE.gguf [--context 4096,16384,32768,65536] [--tokens 16]");
  args.Flag("model", "", "GGUF model (required; the same file a --server runs)");
  args.Flag("context", "4096,16384,32768,65536", "context lengths to measure, comma-separated");
  args.Flag("tokens", "16", "decoded tokens per context (the median interval is reported)");
  args.Flag("fill", "synthetic", "synthetic or prefill");
  args.Flag("kv-dtype", "int8", "KV cache dtype of the launched system (int8, f16, f32)");
  args.Flag("attn-workers", "0", "attention workers of the launched system (0: one per node)");
  args.Flag("matmul-isa", "auto", "matrix kernels of the launched system (ellm-launch --matmul-isa)");
  args.Flag("attn-kernel", "auto", "attention kernel of the launched system (ellm-launch --attn-kernel)");
  args.Flag("server", "", "use a running ellm at HOST:PORT instead of launching one (for --fill synthetic, "
            "launched with --allow-synthetic-context)");
  args.Flag("prefill-tokens", "512", "prompt length of the prefill-throughput measurement (0: skip)");
  args.Flag("plot", "", "write a PNG of ms/token against context with the bound (needs gnuplot)");
  args.Flag("turns", "0", "instead: a conversation of N turns over a document of --context tokens; "
            "time to first token of each turn with and without the prefix cache, and after a "
            "restart from the KV store");
  args.Flag("turn-tokens", "256", "--turns: new tokens each turn appends");
  args.Flag("answer-tokens", "64", "--turns: tokens each turn generates");
  args.Flag("turn-input", "text",
            "--turns: what the client sends: text (each answer is tokenized anew with the prompt, so "
            "an answer whose text tokenizes otherwise is recomputed from the first id that differs; "
            "each line says answer_ids_kept_as_text=K/N) or ids (the answer's own ids)");
  args.Flag("no-prefix-cache", "", "launch with --no-prefix-cache (decode with and without the cache)", true);
  args.Flag("bin-dir", "", "folder of ellm-launch (default: this program's folder)");
  args.Flag("port", "50391", "port for the launched system");
  if (std::optional<int> exit = args.ParseFlagsOnly(argc + 1, argv - 1)) return *exit;
  const std::string model_path = args.Get("model");
  if (model_path.empty()) {
    std::fprintf(stderr, "ellm-bench e2e: --model is required (e.g. a model from ellm-make-model)\n");
    return 2;
  }
  std::vector<int> contexts;
  for (absl::string_view c : absl::StrSplit(args.Get("context"), ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(c, &v) || v <= 0) {
      std::fprintf(stderr, "ellm-bench e2e: bad --context entry '%s'\n", std::string(c).c_str());
      return 2;
    }
    contexts.push_back(v);
  }
  const std::string fill = args.Get("fill");
  if (fill != "synthetic" && fill != "prefill") {
    std::fprintf(stderr, "ellm-bench e2e: --fill must be synthetic or prefill\n");
    return 2;
  }
  absl::StatusOr<int> tokens = args.GetInt("tokens");
  absl::StatusOr<int> prefill_tokens = args.GetInt("prefill-tokens");
  absl::StatusOr<int> port = args.GetInt("port");
  if (!tokens.ok() || *tokens < 2 || !prefill_tokens.ok() || !port.ok()) {
    std::fprintf(stderr, "ellm-bench e2e: --tokens must be >= 2; --prefill-tokens and --port integers\n");
    return 2;
  }
  auto file = GgufFile::Open(model_path);
  if (!file.ok()) {
    std::fprintf(stderr, "ellm-bench e2e: %s\n", file.status().ToString().c_str());
    return 1;
  }
  auto config = ModelConfig::FromGguf(**file);
  if (!config.ok()) {
    std::fprintf(stderr, "ellm-bench e2e: %s\n", config.status().ToString().c_str());
    return 1;
  }
  const int max_context = *std::max_element(contexts.begin(), contexts.end());
  if (max_context + *tokens + 8 > config->context_length) {
    std::fprintf(stderr, "ellm-bench e2e: context %d + %d tokens exceeds the model's %d\n",
                 max_context, *tokens, config->context_length);
    return 2;
  }
  absl::StatusOr<KvDType> kv_dtype = ParseKvDType(args.Get("kv-dtype"));
  if (!kv_dtype.ok()) {
    std::fprintf(stderr, "ellm-bench e2e: %s\n", kv_dtype.status().ToString().c_str());
    return 2;
  }
  const KvFormat format = KvFormat::Make(*kv_dtype, config->head_dim);
  const double kv_bytes_per_position = format.BytesPerPosition() * config->n_kv_heads * config->n_layers;
  const double weight_bytes = WeightBytesPerToken(**file);

  // The probe: all cores this process may use, same process, before the runs.
  auto topology = DiscoverTopology();
  const int cores = topology.ok() ? topology->TotalCores() : 1;
  // Measured again after each context (the system idle between requests):
  // a shared machine's bandwidth can move by half from one minute to the
  // next. Each row's bound uses the best probe so far, as the attention
  // bench's ratio does: a probe that something else slowed makes the bound
  // too lenient (the mean of the probes either side of a row printed ratios
  // under 1 on this VM).
  const auto measure_probe = [cores]() {
    std::fprintf(stderr, "[e2e] read-bandwidth probe on %d threads...\n", cores);
    ThreadPool pool(cores);
    ReadProbe probe(int64_t{1} << 30);
    const double gb_per_s = probe.Measure(pool);
    std::fprintf(stderr, "[e2e] probe: %.1f GB/s\n", gb_per_s);
    return gb_per_s;
  };
  double probe_gb_per_s = measure_probe();
  double probe_best = probe_gb_per_s;

  absl::StatusOr<int> turns = args.GetInt("turns");
  absl::StatusOr<int> turn_tokens = args.GetInt("turn-tokens");
  absl::StatusOr<int> answer_tokens = args.GetInt("answer-tokens");
  if (!turns.ok() || *turns < 0 || !turn_tokens.ok() || !answer_tokens.ok() || *answer_tokens < 1) {
    std::fprintf(stderr, "ellm-bench e2e: --turns, --turn-tokens and --answer-tokens must be integers\n");
    return 2;
  }
  if (*turns > 0) {
    if (!args.Get("server").empty()) {
      std::fprintf(stderr, "ellm-bench e2e: --turns launches its own servers (no --server)\n");
      return 2;
    }
    std::string bin_dir = args.Get("bin-dir");
    if (bin_dir.empty()) {
      std::error_code ec;
      bin_dir = fs::read_symlink("/proc/self/exe", ec).parent_path().string();
    }
    const int positions = max_context + (*turns + 1) * (*turn_tokens + *answer_tokens) + 512;
    const int kv_mb = static_cast<int>(kv_bytes_per_position * positions * 1.15 / 1048576.0) + 16;
    const std::vector<std::string> base = {
        bin_dir + "/ellm-launch", "--bin-dir=" + bin_dir, "--model=" + model_path,
        absl::StrCat("--port=", *port), "--kv-dtype=" + args.Get("kv-dtype"),
        absl::StrCat("--kv-cache-mb=", kv_mb), "--max-batch=2", "--ready-timeout=600",
        absl::StrCat("--attn-workers=", args.Get("attn-workers")), "--matmul-isa=" + args.Get("matmul-isa"),
        "--attn-kernel=" + args.Get("attn-kernel")};
    std::printf("# cpu=%s probe_gb_per_s=%.1f\n", CpuModelName().c_str(), probe_gb_per_s);
    const std::string input = args.Get("turn-input");
    if (input != "text" && input != "ids") {
      std::fprintf(stderr, "ellm-bench e2e: --turn-input is text or ids, not '%s'\n", input.c_str());
      return 2;
    }
    return RunTurns(base, "", max_context, *turns, *turn_tokens, *answer_tokens,
                    absl::StrCat("127.0.0.1:", *port), input == "ids");
  }

  Launched launched;
  std::string server = args.Get("server");
  if (server.empty()) {
    std::string bin_dir = args.Get("bin-dir");
    if (bin_dir.empty()) {
      std::error_code ec;
      bin_dir = fs::read_symlink("/proc/self/exe", ec).parent_path().string();
    }
    // KV budget: the longest context plus room, per worker (heads split evenly).
    absl::StatusOr<int> workers = args.GetInt("attn-workers");
    const int n_workers = workers.ok() && *workers > 0 ? *workers
                          : topology.ok() ? static_cast<int>(topology->nodes.size()) : 1;
    const double per_worker = kv_bytes_per_position / n_workers * (max_context + *tokens + 512);
    const int kv_mb = static_cast<int>(per_worker * 1.15 / 1048576.0) + 16;
    std::vector<std::string> launch = {
        bin_dir + "/ellm-launch", "--bin-dir=" + bin_dir, "--model=" + model_path,
        absl::StrCat("--port=", *port), "--kv-dtype=" + args.Get("kv-dtype"),
        absl::StrCat("--kv-cache-mb=", kv_mb), "--max-batch=2", "--ready-timeout=600",
        absl::StrCat("--attn-workers=", args.Get("attn-workers")), "--matmul-isa=" + args.Get("matmul-isa"),
        "--attn-kernel=" + args.Get("attn-kernel")};
    if (args.GetBool("no-prefix-cache")) launch.push_back("--no-prefix-cache");
    if (fill == "synthetic") launch.push_back("--allow-synthetic-context");
    absl::Status st = launched.Start(launch);
    if (!st.ok()) {
      std::fprintf(stderr, "ellm-bench e2e: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    server = absl::StrCat("127.0.0.1:", *port);
  }
  auto channel = grpc::CreateChannel(server, grpc::InsecureChannelCredentials());
  auto stub = ellm::v1::Ellm::NewStub(channel);

  struct Row {
    int context;
    double ms, bound_ms;
  };
  std::vector<Row> rows;
  const std::string prompt = "Once upon a time";
  for (int context : contexts) {
    std::fprintf(stderr, "[e2e] context %d: filling (%s)...\n", context, fill.c_str());
    ellm::v1::GenerateRequest req;
    req.set_max_tokens(*tokens + 1);
    req.mutable_sampling()->set_temperature(0);
    if (fill == "synthetic") {
      req.set_prompt(prompt);
      req.set_synthetic_context(std::max(0, context - 8));
    } else {
      std::string text;
      while (static_cast<int>(text.size()) < context * 3) text += " the little dog ran to the park";
      req.set_prompt(text);
    }
    Busy busy[2];
    Timing t = Run(stub.get(), req, busy);
    if (!t.status.ok()) {
      std::fprintf(stderr, "ellm-bench e2e: context %d: %s\n", context, t.status.error_message().c_str());
      return 1;
    }
    std::vector<double> intervals;
    for (size_t i = 1; i < t.arrivals.size(); ++i) intervals.push_back(t.arrivals[i] - t.arrivals[i - 1]);
    const double ms = Median(intervals) * 1e3;
    const double kv_bytes = kv_bytes_per_position * context;
    const double probe_before = probe_gb_per_s;
    const double probe_after = measure_probe();
    probe_gb_per_s = probe_after;  // the next row's "before"
    probe_best = std::max(probe_best, probe_after);
    const double bound_ms = (kv_bytes + weight_bytes) / (probe_best * 1e9) * 1e3;
    rows.push_back({context, ms, bound_ms});
    // Where a token's time goes: each worker's share of the decoding stretch's
    // wall time (busy seconds, first token to the end), times ms_per_token;
    // the rest is hand-offs, waits and the coordinator. Next to each, its
    // part of the bound.
    std::string phases;
    const double wall = busy[1].at - busy[0].at;
    if (busy[0].ok && busy[1].ok && wall > 0) {
      const double mlp_ms = (busy[1].mlp - busy[0].mlp) / wall * ms;
      const double attn_ms = (busy[1].attn - busy[0].attn) / wall * ms;
      char text[200];
      std::snprintf(text, sizeof(text),
                    "mlp_ms=%.3f mlp_bound_ms=%.3f attention_ms=%.3f attention_bound_ms=%.3f other_ms=%.3f ", mlp_ms,
                    weight_bytes / (probe_best * 1e6), attn_ms, kv_bytes / (probe_best * 1e6), ms - mlp_ms - attn_ms);
      phases = text;
    }
    std::printf(
        "context=%d kv_dtype=%s fill=%s prefix_cache=%s ms_per_token=%.3f tokens_per_s=%.2f bound_ms=%.3f "
        "ratio=%.3f %skv_mb=%.1f weight_mb=%.1f probe_gb_per_s=%.1f probe_before=%.1f probe_after=%.1f "
        "cpu=\"%s\"\n",
        context, args.Get("kv-dtype").c_str(), fill.c_str(), args.GetBool("no-prefix-cache") ? "off" : "on", ms,
        ms > 0 ? 1e3 / ms : 0, bound_ms, bound_ms > 0 ? ms / bound_ms : 0, phases.c_str(), kv_bytes / 1048576.0,
        weight_bytes / 1048576.0, probe_best, probe_before, probe_after, CpuModelName().c_str());
    std::fflush(stdout);
  }

  if (*prefill_tokens > 0) {
    std::string text;
    while (static_cast<int>(text.size()) < *prefill_tokens * 4) text += " the little dog ran to the park";
    ellm::v1::GenerateRequest req;
    req.set_prompt(text);
    req.set_max_tokens(1);
    req.mutable_sampling()->set_temperature(0);
    std::fprintf(stderr, "[e2e] prefill throughput...\n");
    Timing t = Run(stub.get(), req);
    if (t.status.ok() && !t.arrivals.empty()) {
      const double seconds = t.arrivals[0] - t.start;
      std::printf("prefill_tokens=%d prefill_s=%.3f prefill_tokens_per_s=%.1f\n", t.prompt_tokens,
                  seconds, t.prompt_tokens / seconds);
    } else {
      std::fprintf(stderr, "ellm-bench e2e: prefill: %s\n", t.status.error_message().c_str());
    }
  }

  const std::string plot = args.Get("plot");
  if (!plot.empty()) {
    const std::string data = plot + ".dat";
    {
      std::ofstream out(data);
      out << "# context ms_per_token bound_ms\n";
      for (const Row& r : rows) out << r.context << " " << r.ms << " " << r.bound_ms << "\n";
    }
    const std::string script = absl::StrCat(
        "set terminal png size 900,600 noenhanced; set output '", plot, "'; ",
        "set title 'ellm decode, ", fs::path(model_path).filename().string(), ", kv ",
        args.Get("kv-dtype"), " (", fill, " fill)'; set xlabel 'context (tokens)'; ",
        "set ylabel 'ms per token'; set key left top; set grid; set logscale x 2; ",
        "plot '", data, "' using 1:2 with linespoints lw 2 title 'ellm', '", data,
        "' using 1:3 with lines dt 2 lw 2 title 'bound (KV + weights) / probe'");
    const std::string cmd = absl::StrCat("gnuplot -e \"", script, "\"");
    if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
      std::fprintf(stderr, "ellm-bench e2e: gnuplot not found (apt-get install gnuplot-nox); data in %s\n",
                   data.c_str());
    } else if (std::system(cmd.c_str()) != 0) {
      std::fprintf(stderr, "ellm-bench e2e: gnuplot failed; data in %s\n", data.c_str());
    } else {
      std::fprintf(stderr, "[e2e] plot written to %s\n", plot.c_str());
    }
  }
  return 0;
}

}  // namespace ellm::bench
