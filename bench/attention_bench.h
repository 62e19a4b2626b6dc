// ellm-bench attention (see attention_bench.cc and its --help).
#pragma once

namespace ellm::bench {

// argv holds the flags after the subcommand name.
int AttentionMain(int argc, char** argv);

}  // namespace ellm::bench
