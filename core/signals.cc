#include "core/signals.h"

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>

namespace ellm {
namespace {
// Process-wide by nature: signal dispositions are per process.
std::atomic<bool> g_stop{false};
std::atomic<int> g_signals{0};
void OnSignal(int) {
  g_signals.fetch_add(1);
  g_stop.store(true);
}
sigset_t StopSignalSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}
}  // namespace

void InstallStopSignalHandlers() {
  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // A process started with them blocked (ellm-launch starts its children so)
  // gets what arrived meanwhile now, in the handler.
  UnblockStopSignals();
}

void BlockStopSignals(sigset_t* previous) {
  const sigset_t set = StopSignalSet();
  sigprocmask(SIG_BLOCK, &set, previous);
}

void UnblockStopSignals() {
  const sigset_t set = StopSignalSet();
  sigprocmask(SIG_UNBLOCK, &set, nullptr);
}

bool StopRequested() { return g_stop.load(std::memory_order_relaxed); }
int StopSignals() { return g_signals.load(); }
void RequestStop() { g_stop.store(true); }

void DieWithParent() {
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() == 1) g_stop.store(true);  // the parent is already gone
}

}  // namespace ellm
