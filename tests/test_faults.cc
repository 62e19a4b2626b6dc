// Faults, end to end on the real processes (stories260K): a worker killed
// (SIGKILL) or frozen (SIGSTOP) mid-stream is replaced by the launcher, and
// every stream pauses and resumes with exactly the text a run without the
// fault gives; the service is back within 10 s and nothing is left behind.
// ELLM_FAULT_TRIALS sets the trials per fault (default 1; the closing note's
// figures come from 20).
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration_harness.h"

namespace ellm {
namespace {

using namespace ellm::testing;  // NOLINT: the harness

const std::string kStories = ELLM_MODELS_DIR "/stories260K.gguf";
constexpr int kStreams = 16;
constexpr int kTokens = 300;

int Trials() {
  const char* env = std::getenv("ELLM_FAULT_TRIALS");
  return env != nullptr && std::atoi(env) > 0 ? std::atoi(env) : 1;
}

std::string PromptOf(int i) {
  static const char* kStarts[] = {"Once upon a time", "The little dog", "Lily wanted to", "Tom had a",
                                  "One day, a bird", "The sun was", "Ben and Mia", "A big red ball"};
  return absl::StrCat(kStarts[i % 8], i >= 8 ? " in the park" : "");
}

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Runs kStreams greedy streams at once; `fault(pid)` is applied to the
// victim once stream 0 has 40 tokens. Returns the streams and the seconds
// from the fault until health was SERVING again.
std::pair<std::vector<Generated>, double> RunWithFault(EllmSystem& system, const std::string& victim,
                                                       int signal) {
  std::atomic<bool> done{false};
  std::chrono::steady_clock::time_point fault_time;
  pid_t pid = -1;
  std::vector<std::future<Generated>> futures;
  for (int i = 0; i < kStreams; ++i) {
    futures.push_back(std::async(std::launch::async, [&, i] {
      return Generate(system.stub(), Greedy(PromptOf(i), kTokens), [&, i](const Generated& g) {
        if (i == 0 && g.tokens.size() == 40 && !done.exchange(true)) {
          pid = system.FindChild(victim);
          fault_time = std::chrono::steady_clock::now();
          kill(pid, signal);
        }
      });
    }));
  }
  std::vector<Generated> out;
  for (auto& f : futures) out.push_back(f.get());
  EXPECT_TRUE(done.load()) << "the fault was never applied";
  // Back: health SERVING again (the streams may end before it says so).
  double back = -1;
  while (back < 0 && SecondsSince(fault_time) < 30) {
    if (system.Health() == grpc::health::v1::HealthCheckResponse::SERVING) back = SecondsSince(fault_time);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (signal == SIGSTOP && pid > 0) kill(pid, SIGCONT);  // killed by then; harmless
  return {out, back};
}

TEST(Faults, KilledOrFrozenWorkersAreReplacedAndStreamsResumeExactly) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=2", "--no-numactl", "--max-restarts=100"});
  ASSERT_TRUE(system.ready()) << system.Log();
  std::vector<Generated> expected;
  for (int i = 0; i < kStreams; ++i) {
    expected.push_back(Generate(system.stub(), Greedy(PromptOf(i), kTokens)));
    ASSERT_TRUE(expected.back().status.ok());
    ASSERT_EQ(expected.back().tokens.size(), static_cast<size_t>(kTokens));
  }
  struct Fault {
    const char* victim;
    int signal;
  };
  for (const Fault& fault : {Fault{"ellm-attn-worker", SIGKILL}, Fault{"ellm-mlp-worker", SIGKILL},
                             Fault{"ellm-attn-worker", SIGSTOP}, Fault{"ellm-mlp-worker", SIGSTOP}}) {
    for (int trial = 0; trial < Trials(); ++trial) {
      SCOPED_TRACE(absl::StrCat(fault.victim, fault.signal == SIGKILL ? " SIGKILL" : " SIGSTOP", " trial ", trial));
      auto [streams, back_s] = RunWithFault(system, fault.victim, fault.signal);
      for (int i = 0; i < kStreams; ++i) {
        ASSERT_TRUE(streams[i].status.ok()) << i << ": " << streams[i].status.error_message();
        EXPECT_EQ(streams[i].tokens, expected[i].tokens) << i;
        EXPECT_EQ(streams[i].text, expected[i].text) << i;
      }
      EXPECT_GE(back_s, 0);
      EXPECT_LT(back_s, 10.0);
      // The launcher counts a failure within 2 s of a restart as a crash
      // loop (and backs off): let the new set settle between trials.
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      std::printf("fault %s %s trial %d: back in %.2f s\n", fault.victim,
                  fault.signal == SIGKILL ? "SIGKILL" : "SIGSTOP", trial, back_s);
      std::fflush(stdout);
    }
  }
  ExpectCleanShutdown(system);
}

// A worker that keeps dying (here: killed again as soon as it is back) ends
// the launch with a clear message once the restarts run out.
TEST(Faults, AWorkerThatKeepsDyingEndsTheLaunch) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=1", "--no-numactl", "--max-restarts=2"});
  ASSERT_TRUE(system.ready()) << system.Log();
  // The launcher has exited (a zombie until the harness reaps it) once its
  // /proc entry says so.
  auto launcher_gone = [&] {
    std::ifstream stat(absl::StrCat("/proc/", system.pid(), "/stat"));
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    return paren == std::string::npos || line.substr(paren + 2, 1) == "Z";
  };
  const auto start = std::chrono::steady_clock::now();
  while (!launcher_gone() && SecondsSince(start) < 60) {
    const pid_t pid = system.FindChild("ellm-attn-worker");
    if (pid > 0) kill(pid, SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const int status = system.WaitExit();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << status;
  EXPECT_NE(system.Log().find("giving up"), std::string::npos) << system.Log();
  EXPECT_TRUE(LeftoverSegments(system.pid()).empty());
}

}  // namespace
}  // namespace ellm
