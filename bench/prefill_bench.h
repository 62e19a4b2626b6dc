// ellm-bench prefill (see prefill_bench.cc and its --help).
#pragma once

namespace ellm::bench {

// argv holds the flags after the subcommand name.
int PrefillMain(int argc, char** argv);

}  // namespace ellm::bench
