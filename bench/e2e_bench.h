// ellm-bench e2e (see e2e_bench.cc and its --help).
#pragma once

namespace ellm::bench {

// argv holds the flags after the subcommand name.
int E2eMain(int argc, char** argv);

}  // namespace ellm::bench
