// Harness for the integration tests: starts ellm-launch (and so the real
// attention workers, mlp-worker and coordinator) on loopback, talks to it over
// gRPC, and checks that stopping it leaves no process or segment behind.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/ellm.grpc.pb.h"
#include "proto/health.grpc.pb.h"

namespace ellm::testing {

namespace fs = std::filesystem;

inline int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

inline std::vector<pid_t> ChildrenOf(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    // pid (comm) state ppid ...
    const size_t close_paren = line.rfind(')');
    if (close_paren == std::string::npos) continue;
    std::istringstream rest(line.substr(close_paren + 2));
    std::string state;
    int ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(std::stoi(name));
  }
  return out;
}

inline std::string Cmdline(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/cmdline"));
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (char& c : s) {
    if (c == '\0') c = ' ';
  }
  return s;
}

inline std::vector<std::string> LeftoverSegments(pid_t launcher) {
  std::vector<std::string> out;
  const std::string prefix = absl::StrCat("ellm-", launcher, "-");
  for (const char* dir : {"/dev/shm", "/tmp"}) {
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.path().filename().string().rfind(prefix, 0) == 0) out.push_back(entry.path().string());
    }
  }
  return out;
}

// One running ellm (ellm-launch and its children), stopped by the destructor.
class EllmSystem {
 public:
  // Starts ellm-launch with `args`; Ready() tells whether it came up.
  explicit EllmSystem(std::vector<std::string> args) {
    port_ = FreePort();
    // Each probe closes its socket, so the kernel may hand out the same
    // port twice: the HTTP server then cannot listen beside gRPC.
    do {
      http_port_ = FreePort();
    } while (http_port_ == port_);
    log_path_ = absl::StrCat("/tmp/ellm-test-launch-", getpid(), "-", port_, ".log");
    std::vector<std::string> argv = {std::string(ELLM_BINARY_DIR) + "/ellm-launch",
                                     absl::StrCat("--port=", port_), absl::StrCat("--http-port=", http_port_),
                                     "--ready-timeout=60", "--drain-timeout-s=0"};
    argv.insert(argv.end(), args.begin(), args.end());
    int out_pipe[2];
    pipe(out_pipe);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out_pipe[1], 1);
      int log = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      dup2(log, 2);
      close(out_pipe[0]);
      std::vector<char*> cargv;
      for (std::string& a : argv) cargv.push_back(a.data());
      cargv.push_back(nullptr);
      execv(cargv[0], cargv.data());
      _exit(127);
    }
    close(out_pipe[1]);
    // Wait for "ellm listening on" or the launcher's exit.
    FILE* out = fdopen(out_pipe[0], "r");
    char line[512];
    while (fgets(line, sizeof(line), out) != nullptr) {
      if (std::string(line).find("ellm listening on") != std::string::npos) {
        ready_ = true;
        break;
      }
    }
    out_ = out;
    if (ready_) {
      channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), grpc::InsecureChannelCredentials());
      stub_ = ellm::v1::Ellm::NewStub(channel_);
    }
  }

  // Stops it; its log goes with it unless the test failed (then it stays
  // for reading, and the failure messages name it).
  ~EllmSystem() {
    Stop();
    if (!::testing::Test::HasFailure()) {
      std::remove(log_path_.c_str());
    } else {
      std::fprintf(stderr, "ellm log kept: %s\n", log_path_.c_str());
    }
  }

  // SIGTERM to the launcher; returns its exit status.
  int Stop() {
    if (pid_ <= 0) return exit_status_;
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    if (out_ != nullptr) fclose(out_);
    out_ = nullptr;
    exit_status_ = status;
    stopped_pid_ = pid_;
    pid_ = -1;
    return status;
  }

  // Waits for the launcher to exit by itself (start-up failures).
  int WaitExit() {
    int status = 0;
    waitpid(pid_, &status, 0);
    stopped_pid_ = pid_;
    pid_ = -1;
    exit_status_ = status;
    return status;
  }

  bool ready() const { return ready_; }
  int port() const { return port_; }
  int http_port() const { return http_port_; }
  pid_t pid() const { return pid_ > 0 ? pid_ : stopped_pid_; }
  ellm::v1::Ellm::Stub* stub() { return stub_.get(); }
  std::string Log() const {
    std::ifstream in(log_path_);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  std::vector<pid_t> FindChildren(const std::string& needle) const {
    std::vector<pid_t> found;
    for (pid_t p : ChildrenOf(pid_)) {
      if (Cmdline(p).find(needle) != std::string::npos) found.push_back(p);
    }
    return found;
  }
  // The first child whose command line holds `needle`, or -1.
  pid_t FindChild(const std::string& needle) const {
    const std::vector<pid_t> found = FindChildren(needle);
    return found.empty() ? -1 : found[0];
  }
  // Waits until GetModelInfo shows `n` requests in the server, running or
  // waiting (up to 100 polls 50 ms apart; with a worker stopped each poll
  // takes about 1 s, its worker figures' deadline).
  bool WaitForRequests(int n) {
    for (int i = 0; i < 100; ++i) {
      ellm::v1::ModelInfo info;
      grpc::ClientContext ctx;
      if (stub_->GetModelInfo(&ctx, ellm::v1::GetModelInfoRequest(), &info).ok() &&
          info.running() + info.waiting() == n) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
  // No request running or waiting.
  bool WaitUntilIdle() { return WaitForRequests(0); }
  grpc::health::v1::HealthCheckResponse::ServingStatus Health() {
    auto stub = grpc::health::v1::Health::NewStub(channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status st = stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp);
    return st.ok() ? resp.status() : grpc::health::v1::HealthCheckResponse::UNKNOWN;
  }

 private:
  int port_ = 0;
  int http_port_ = 0;
  pid_t pid_ = -1;
  pid_t stopped_pid_ = -1;
  int exit_status_ = 0;
  bool ready_ = false;
  FILE* out_ = nullptr;
  std::string log_path_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ellm::v1::Ellm::Stub> stub_;
};

struct Generated {
  grpc::Status status;
  std::string text;
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;  // one per token
  std::vector<ellm::v1::TopLogprobs> top_logprobs;  // one per token when asked
  std::vector<float> prompt_logprobs;                // with prompt_logprobs
  std::vector<ellm::v1::TopLogprobs> prompt_top_logprobs;
  ellm::v1::Finish finish;
  int messages = 0;
};

inline ellm::v1::GenerateRequest Greedy(const std::string& prompt, int max_tokens) {
  ellm::v1::GenerateRequest req;
  req.set_prompt(prompt);
  req.set_max_tokens(max_tokens);
  req.mutable_sampling()->set_temperature(0);
  return req;
}

inline Generated Generate(ellm::v1::Ellm::Stub* stub, const ellm::v1::GenerateRequest& req,
                   const std::function<void(const Generated&)>& on_message = nullptr) {
  Generated g;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto reader = stub->Generate(&ctx, req);
  ellm::v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    ++g.messages;
    g.text += resp.text();
    g.tokens.insert(g.tokens.end(), resp.token_ids().begin(), resp.token_ids().end());
    g.logprobs.insert(g.logprobs.end(), resp.logprobs().begin(), resp.logprobs().end());
    g.top_logprobs.insert(g.top_logprobs.end(), resp.top_logprobs().begin(), resp.top_logprobs().end());
    g.prompt_logprobs.insert(g.prompt_logprobs.end(), resp.prompt_logprobs().begin(), resp.prompt_logprobs().end());
    g.prompt_top_logprobs.insert(g.prompt_top_logprobs.end(), resp.prompt_top_logprobs().begin(),
                                 resp.prompt_top_logprobs().end());
    if (resp.has_finish()) g.finish = resp.finish();
    if (on_message) on_message(g);
  }
  g.status = reader->Finish();
  return g;
}

inline void ExpectCleanShutdown(EllmSystem& system) {
  const pid_t launcher = system.pid();
  std::vector<pid_t> children = ChildrenOf(launcher);
  const int status = system.Stop();
  EXPECT_TRUE(WIFEXITED(status)) << "launcher status " << status;
  for (pid_t c : children) {
    EXPECT_NE(kill(c, 0), 0) << "process " << c << " (" << Cmdline(c) << ") outlived the launcher";
  }
  EXPECT_TRUE(LeftoverSegments(launcher).empty())
      << "leftover: " << (LeftoverSegments(launcher).empty() ? "" : LeftoverSegments(launcher)[0]);
}


}  // namespace ellm::testing
