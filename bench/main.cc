// ellm-bench: kernel and end-to-end benchmarks. One subcommand per benchmark;
// each prints one key=value line per case on stdout and its progress on stderr.
#include <cstdio>
#include <cstring>

#include "bench/attention_bench.h"
#include "bench/e2e_bench.h"
#include "bench/peak.h"
#include "bench/prefill_bench.h"

int main(int argc, char** argv) {
  const char* usage =
      "usage: ellm-bench SUBCOMMAND [flags]   (ellm-bench SUBCOMMAND --help for its flags)\n"
      "subcommands:\n"
      "  attention   decode attention of one worker's shard against a read-bandwidth probe\n"
      "  e2e         decode ms/token of the whole system at long context against the bound\n"
      "              (--turns: time to first token of a conversation, prefix cache on and off)\n"
      "  peak        the dot-product instructions' measured peaks, and what broadcasts cost them\n"
      "  prefill     cold prefill: matrix work and attention against their instructions' peaks\n";
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    std::fputs(usage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (std::strcmp(argv[1], "attention") == 0) return ellm::bench::AttentionMain(argc - 2, argv + 2);
  if (std::strcmp(argv[1], "e2e") == 0) return ellm::bench::E2eMain(argc - 2, argv + 2);
  if (std::strcmp(argv[1], "peak") == 0) return ellm::bench::PeakMain(argc - 2, argv + 2);
  if (std::strcmp(argv[1], "prefill") == 0) return ellm::bench::PrefillMain(argc - 2, argv + 2);
  std::fprintf(stderr, "ellm-bench: unknown subcommand '%s'\n%s", argv[1], usage);
  return 2;
}
