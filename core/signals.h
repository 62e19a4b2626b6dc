// Ctrl-C / SIGTERM handling shared by every process: the handler only sets a
// flag; the process's loops poll StopRequested() and shut down cleanly.
#pragma once

#include <signal.h>

namespace ellm {

// Installs handlers for SIGINT and SIGTERM (and ignores SIGPIPE), then
// unblocks them: a SIGTERM sent while a child was between fork and exec (its
// parent's handler then, lost at exec) stays pending, blocked, until here.
void InstallStopSignalHandlers();
// Blocks SIGINT and SIGTERM in this thread (the mask survives fork and
// exec); `previous` gets the mask before, for sigprocmask(SIG_SETMASK).
void BlockStopSignals(sigset_t* previous);
void UnblockStopSignals();
bool StopRequested();
// SIGINT and SIGTERM received so far: a second one asks to stop at once
// (e.g. not to wait for requests in flight).
int StopSignals();
// Sets the flag from inside the process (e.g. a Shutdown RPC).
void RequestStop();
// Asks the kernel to send SIGTERM to this process when its parent dies, so a
// killed launcher leaves no orphans. Call first thing in main().
void DieWithParent();

}  // namespace ellm
