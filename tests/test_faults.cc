// Faults, end to end on the real processes (stories260K): a worker killed
// (SIGKILL) or frozen (SIGSTOP) mid-stream is replaced by the launcher, and
// every stream pauses and resumes with exactly the text a run without the
// fault gives; the service is back within 10 s and nothing is left behind.
// ELLM_FAULT_TRIALS sets the trials per fault (default 1; the closing note's
// figures come from 20).
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration_harness.h"
#include "tests/tests_util.h"

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

// The running requests of each pause for a worker failure so far, as the
// coordinator logged them ("...; pausing N running and M waiting requests").
std::vector<int> Pauses(const std::string& log) {
  std::vector<int> running;
  static const std::string kPausing = "; pausing ";
  for (size_t at = log.find(kPausing); at != std::string::npos; at = log.find(kPausing, at + 1)) {
    const char* number = log.c_str() + at + kPausing.size();
    char* end = nullptr;
    const long n = std::strtol(number, &end, 10);
    if (end != number && std::strncmp(end, " running", 8) == 0) running.push_back(static_cast<int>(n));
  }
  return running;
}

// Stream i's request: greedy for even i; sampled with seed i for odd i (a
// seeded sample must resume with the text it would have had too).
ellm::v1::GenerateRequest RequestOf(int i) {
  ellm::v1::GenerateRequest r = Greedy(PromptOf(i), kTokens);
  if (i % 2 == 1) {
    r.mutable_sampling()->set_temperature(0.8f);
    r.mutable_sampling()->set_seed(i);
  }
  return r;
}

// Runs kStreams streams (RequestOf) at once; `signal` goes to the victim once
// every stream has its first token (the server has most of each stream's
// tokens still to make then: a client-side count such as "stream 0 has 40
// tokens" can lag the server until every stream has ended). Returns the
// streams and the seconds from the fault until health was SERVING again.
std::pair<std::vector<Generated>, double> RunWithFault(EllmSystem& system, const std::string& victim,
                                                       int signal) {
  const pid_t pid = system.FindChild(victim);
  EXPECT_GT(pid, 0) << victim << " not found";
  if (pid <= 0) return {};  // never kill(-1, ...)
  const size_t pauses_before = Pauses(system.Log()).size();
  std::atomic<int> started{0};
  std::vector<std::future<Generated>> futures;
  for (int i = 0; i < kStreams; ++i) {
    futures.push_back(std::async(std::launch::async, [&, i] {
      return Generate(system.stub(), RequestOf(i), [&](const Generated& g) {
        if (g.tokens.size() == 1) ++started;
      });
    }));
  }
  const auto start = std::chrono::steady_clock::now();
  while (started.load() < kStreams && SecondsSince(start) < 60) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const auto fault_time = std::chrono::steady_clock::now();
  kill(pid, signal);
  std::vector<Generated> out;
  for (auto& f : futures) out.push_back(f.get());
  EXPECT_EQ(started.load(), kStreams) << "not every stream started";
  // Back: health SERVING again (the streams may end before it says so).
  double back = -1;
  while (back < 0 && SecondsSince(fault_time) < 30) {
    if (system.Health() == grpc::health::v1::HealthCheckResponse::SERVING) back = SecondsSince(fault_time);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (signal == SIGSTOP) kill(pid, SIGCONT);  // killed by then; harmless
  // The fault hit running streams: the coordinator paused them (once).
  const std::vector<int> pauses = Pauses(system.Log());
  EXPECT_EQ(pauses.size(), pauses_before + 1);
  if (pauses.size() > pauses_before) {
    EXPECT_GE(pauses[pauses_before], 1) << "the fault came after the streams had ended";
  }
  // ... and named the killed worker among those gone (the launcher stops the
  // others when one dies: the MLP worker the step waited on was blamed).
  if (signal == SIGKILL) {
    const std::string log = system.Log();
    const size_t failed = log.rfind("a worker failed (");
    const size_t end = failed == std::string::npos ? failed : log.find("; pausing ", failed);
    EXPECT_NE(end, std::string::npos) << log;
    if (end != std::string::npos) {
      EXPECT_NE(log.substr(failed, end - failed).find(absl::StrCat("(pid ", pid, ")")), std::string::npos)
          << victim << " pid " << pid << ": " << log.substr(failed, end - failed);
    }
  }
  return {out, back};
}

TEST(Faults, KilledOrFrozenWorkersAreReplacedAndStreamsResumeExactly) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=2", "--no-numactl", "--max-restarts=100"});
  ASSERT_TRUE(system.ready()) << system.Log();
  std::vector<Generated> expected;
  for (int i = 0; i < kStreams; ++i) {
    expected.push_back(Generate(system.stub(), RequestOf(i)));
    ASSERT_TRUE(expected.back().status.ok());
    if (i % 2 == 0) {
      ASSERT_EQ(expected.back().tokens.size(), static_cast<size_t>(kTokens));
    }
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
      ASSERT_EQ(streams.size(), static_cast<size_t>(kStreams));
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

// Whether process `pid` (a child of this one) has exited: a zombie until it
// is reaped, as its /proc entry says.
bool Exited(pid_t pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || line.substr(paren + 2, 1) == "Z";
}

// A worker that keeps dying (here: killed again as soon as it is back) ends
// the launch with a clear message once the restarts run out, and the
// request that was waiting for the workers ends then with an error: no
// worker is coming back, so it does not wait out the drain (--drain-timeout-s
// 30; it did, and the launch took 32 s to end).
TEST(Faults, AWorkerThatKeepsDyingEndsTheLaunch) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=1", "--no-numactl", "--max-restarts=2", "--drain-timeout-s=30"});
  ASSERT_TRUE(system.ready()) << system.Log();
  // Requests one after the other until one fails: one is always in flight.
  Generated in_flight;
  double ended_at = -1;
  const auto start = std::chrono::steady_clock::now();
  std::thread request([&] {
    do {
      in_flight = Generate(system.stub(), Greedy("Once upon a time", 1800));
    } while (in_flight.status.ok() && SecondsSince(start) < 90);
    ended_at = SecondsSince(start);
  });
  // Each worker is killed 0.3 s after it appears: after its restart came up
  // (the coordinator then waits for the next), not while it loads.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::set<pid_t> killed;
  while (!Exited(system.pid()) && SecondsSince(start) < 90) {
    const pid_t pid = system.FindChild("ellm-attn-worker");
    if (pid > 0 && killed.insert(pid).second) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      kill(pid, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const int status = system.WaitExit();
  const double exited_at = SecondsSince(start);
  request.join();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << status;
  EXPECT_NE(system.Log().find("giving up"), std::string::npos) << system.Log();
  EXPECT_TRUE(LeftoverSegments(system.pid()).empty());
  EXPECT_FALSE(in_flight.status.ok());
  EXPECT_GT(in_flight.tokens.size(), 0u) << "the last request had not started: " << in_flight.status.error_message();
  EXPECT_LT(exited_at, 15) << system.Log();
  EXPECT_LE(ended_at, exited_at + 1);
}

// A restart that cannot come up (here: the model file is gone, so every new
// worker exits while loading) is a failure in a row too: the launcher backs
// off, tries again, and gives up after --max-restarts instead of respawning
// the workers forever.
TEST(Faults, RestartsThatCannotComeUpEndTheLaunch) {
  const std::string dir = MakeTempDir("faults-gone");
  const std::string model = dir + "/stories260K.gguf";
  std::filesystem::copy_file(kStories, model);
  EllmSystem system({"--model=" + model, "--attn-workers=1", "--no-numactl", "--max-restarts=3"});
  ASSERT_TRUE(system.ready()) << system.Log();
  std::filesystem::remove(model);
  const pid_t worker = system.FindChild("ellm-attn-worker");
  ASSERT_GT(worker, 0);
  kill(worker, SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  while (!Exited(system.pid()) && SecondsSince(start) < 60) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(Exited(system.pid())) << "the launcher still restarts after 60 s:\n" << system.Log();
  const int status = system.WaitExit();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  const std::string log = system.Log();
  EXPECT_NE(log.find("the restart failed"), std::string::npos) << log;
  EXPECT_NE(log.find("failing 3 times in a row; giving up"), std::string::npos) << log;
  EXPECT_TRUE(LeftoverSegments(system.pid()).empty());
  std::filesystem::remove_all(dir);
}

// Workers that do not come back within the coordinator's recovery timeout
// (here: the model file is gone while the launcher keeps trying) make the
// coordinator exit rather than stay up refusing every request; the launcher
// then starts everything again, which serves once the model is back.
TEST(Faults, WorkersThatStayAwayRestartEverything) {
  const std::string dir = MakeTempDir("faults-away");
  const std::string model = dir + "/stories260K.gguf";
  std::filesystem::copy_file(kStories, model);
  // --ready-timeout=5: the coordinator waits 15 s for restarted workers.
  EllmSystem system({"--model=" + model, "--attn-workers=1", "--no-numactl", "--max-restarts=30",
                     "--ready-timeout=5"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const Generated before = Generate(system.stub(), Greedy("Once upon a time", 30));
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();
  std::filesystem::rename(model, model + ".away");
  const pid_t worker = system.FindChild("ellm-attn-worker");
  ASSERT_GT(worker, 0);
  kill(worker, SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  while (system.Log().find("exiting so that the launcher restarts ellm") == std::string::npos &&
         SecondsSince(start) < 60) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_NE(system.Log().find("exiting so that the launcher restarts ellm"), std::string::npos) << system.Log();
  std::filesystem::rename(model + ".away", model);
  while (system.Health() != grpc::health::v1::HealthCheckResponse::SERVING && SecondsSince(start) < 90) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_EQ(system.Health(), grpc::health::v1::HealthCheckResponse::SERVING) << system.Log();
  const Generated after = Generate(system.stub(), Greedy("Once upon a time", 30));
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.text, before.text);
  EXPECT_NE(system.Log().find("restarting every process"), std::string::npos);
  ExpectCleanShutdown(system);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ellm
