// ellm-bench attention: decode attention of one attention worker's shard
// against the machine's read bandwidth, measured in the same process with
// the same threads.
//
// A case is (shape, dtype, positions, threads): one sequence holding
// `positions` positions in the KV cache of a worker's shard, and one decode
// token per layer through AttentionShard::Process — the worker's own path:
// append (quantise) the token's k and v, prepare the query, run the chunk
// items on the pinned thread pool, merge. The cache holds as many layers as
// it takes to touch at least --footprint-mb (default twice the last-level
// cache), and a step runs every layer once, so each layer's KV comes from
// DRAM as it does in real decode (one layer alone at 16K positions would sit
// in a large LLC).
//
// gb_per_s counts the KV bytes the kernels read (K and V codes, scales and
// mins) per layer at the sequence's length, divided by the time per layer.
// probe_gb_per_s is a plain streaming read (256-bit loads where the CPU has AVX2) of
// a buffer of --probe-mb with the same threads, run just before each case;
// the ratio is taken against the best probe of the run so far for that
// thread count (ratio = gb_per_s / probe_gb_per_s), so that a probe caught
// in a moment of interference (seen on a shared VM: 17 instead of 27 GB/s)
// cannot flatter the kernel.
#include "bench/attention_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "attn-worker/attention_kernels.h"
#include "attn-worker/attention_shard.h"
#include "attn-worker/kv_cache.h"
#include "bench/peak.h"
#include "core/args.h"
#include "core/read_probe.h"
#include "core/thread_pool.h"
#include "core/topology.h"
#include "shm/messages.h"

namespace ellm::bench {
namespace {

struct Shape {
  std::string name;
  int q_heads, kv_heads, head_dim;
};

// One attention worker's shard of each model: the heads of the whole model on
// one worker (one NUMA node).
const Shape kShapes[] = {
    {"qwen2.5-14b", 40, 8, 128},
    {"llama-3-8b", 32, 8, 128},
    {"qwen2.5-0.5b", 14, 2, 64},
};

struct Options {
  std::vector<Shape> shapes;
  std::vector<int> positions;
  std::vector<KvDType> dtypes;
  std::vector<int> threads;
  Isa kernel = Isa::kAuto;
  double min_time_s = 0.5;
  int interleave = 1;  // sequences whose blocks are taken in turn
  int block_tokens = 16;  // positions per KV block
  int64_t footprint_bytes = 0;
  int64_t probe_bytes = 0;
};

Args Flags() {
  Args a(
      "ellm-bench attention: decode attention (one query token per layer) of one\n"
      "attention worker's shard, against a streaming-read probe in the same run.\n"
      "\n"
      "Output: one line per case on stdout,\n"
      "  shape= dtype= positions= threads= us_per_layer= gb_per_s= probe_gb_per_s= ratio=\n"
      "  macs_per_byte= gmacs= unit= peak_gmacs= roof_gb_per_s= bound= ratio_to_roof=\n"
      "  isa= cpu=\n"
      "progress on stderr. The probe runs before every case; probe_gb_per_s is the\n"
      "best it measured so far in the run with that thread count.\n"
      "The roofline: macs_per_byte is what the case needs (q.K and p.V of the group's\n"
      "query heads per KV byte read), peak_gmacs the measured peak of the kernel's\n"
      "dot-product instruction (unit) on the same pinned threads, roof_gb_per_s =\n"
      "min(probe, peak_gmacs / macs_per_byte), and bound says which limit that is:\n"
      "a compute-bound case cannot reach the probe whatever its memory access does.\n"
      "Lists are comma-separated.");
  a.Flag("shapes", "qwen2.5-14b,llama-3-8b,qwen2.5-0.5b",
         "qwen2.5-14b (40 query / 8 KV heads, head dim 128), llama-3-8b (32/8, 128), "
         "qwen2.5-0.5b (14/2, 64), or NAME:Q/KV/HD for any other shard");
  a.Flag("positions", "1K,4K,16K,64K,128K", "KV lengths; K = 1024");
  a.Flag("dtypes", "int8,f16", "int8, f16, f32 (f32 runs the fp32 reference path)");
  a.Flag("threads", "1,all",
         "thread counts, or 'all' for one per physical core of NUMA node 0; threads are pinned, "
         "one per core");
  a.Flag("kernel", "auto", "auto, reference, avx2, avx2-vnni, avx512 or amx");
  a.Flag("min-time", "0.5", "seconds spent measuring each case");
  a.Flag("footprint-mb", "",
         "KV MiB each case cycles through, as whole layers (default: twice the last-level cache, "
         "at least 256)");
  a.Flag("probe-mb", "", "probe buffer MiB (default: twice the last-level cache, at least 256)");
  a.Flag("block-tokens", "16",
         "positions per KV block, a multiple of 16 (as the attention worker's --block-tokens)");
  a.Flag("interleave", "1",
         "N sequences take their KV blocks in turn, a block at a time, as sequences decoding side "
         "by side do; the measured one then reads every N-th block (1: consecutive blocks). The "
         "cache grows N-fold");
  a.Flag("quick", "false",
         "a smoke test in seconds: qwen2.5-0.5b, 1K and 4K positions, all threads, 256 MiB "
         "footprint and probe, short timing (flags given as well win). Indicative numbers only",
         true);
  return a;
}

int64_t LastLevelCacheBytes() {
  for (int index = 4; index >= 0; --index) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    std::string text;
    if (f >> text && !text.empty()) {
      int64_t v = std::atoll(text.c_str());
      if (text.back() == 'K') v <<= 10;
      if (text.back() == 'M') v <<= 20;
      if (v > 0) return v;
    }
  }
  const long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return v > 0 ? v : (int64_t{32} << 20);
}

absl::StatusOr<std::vector<std::string>> ListFlag(const std::string& text) {
  std::vector<std::string> out = absl::StrSplit(text, ',', absl::SkipEmpty());
  if (out.empty()) return absl::InvalidArgumentError("empty list");
  return out;
}

absl::StatusOr<Options> ParseOptions(const Args& args) {
  Options o;
  const bool quick = args.GetBool("quick");
  // --quick changes the defaults; a flag given explicitly still wins.
  auto value = [&](const char* name, const char* quick_value) {
    return quick && !args.IsSet(name) ? std::string(quick_value) : args.Get(name);
  };
  const std::string shapes = value("shapes", "qwen2.5-0.5b"), positions = value("positions", "1K,4K"),
                    dtypes = args.Get("dtypes"), threads = value("threads", "all");
  ASSIGN_OR_RETURN(o.min_time_s, args.GetDouble("min-time"));
  if (quick && !args.IsSet("min-time")) o.min_time_s = 0.1;
  if (o.min_time_s <= 0) return absl::InvalidArgumentError("--min-time must be a positive number of seconds");
  RETURN_IF_ERROR(args.GetInts({{"block-tokens", &o.block_tokens}, {"interleave", &o.interleave}}));
  if (o.block_tokens < 16 || o.block_tokens % 16 != 0) {
    return absl::InvalidArgumentError("--block-tokens must be a positive multiple of 16");
  }
  if (o.interleave < 1 || o.interleave > 64) return absl::InvalidArgumentError("--interleave must be 1..64");
  const int64_t automatic =
      quick ? int64_t{256} << 20 : std::max<int64_t>(2 * LastLevelCacheBytes(), int64_t{256} << 20);
  for (const auto& [name, bytes] : {std::pair<const char*, int64_t*>{"footprint-mb", &o.footprint_bytes},
                                    {"probe-mb", &o.probe_bytes}}) {
    *bytes = automatic;
    if (args.Get(name).empty()) continue;
    ASSIGN_OR_RETURN(const int mb, args.GetInt(name));
    if (mb <= 0) return absl::InvalidArgumentError(absl::StrCat("--", name, " must be a positive number of MiB"));
    *bytes = int64_t{mb} << 20;
  }
  ASSIGN_OR_RETURN(auto shape_list, ListFlag(shapes));
  for (const std::string& s : shape_list) {
    bool found = false;
    for (const Shape& k : kShapes) {
      if (k.name == s) {
        o.shapes.push_back(k);
        found = true;
      }
    }
    if (found) continue;
    // NAME:Q/KV/HD
    std::vector<std::string> parts = absl::StrSplit(s, absl::ByAnyChar(":/"));
    Shape custom;
    if (parts.size() != 4 || !absl::SimpleAtoi(parts[1], &custom.q_heads) ||
        !absl::SimpleAtoi(parts[2], &custom.kv_heads) || !absl::SimpleAtoi(parts[3], &custom.head_dim) ||
        custom.kv_heads <= 0 || custom.q_heads % custom.kv_heads != 0 || custom.head_dim <= 0 ||
        custom.head_dim > kMaxHeadDim) {
      return absl::InvalidArgumentError("unknown shape '" + s + "' (a known name or NAME:Q/KV/HD)");
    }
    custom.name = parts[0];
    o.shapes.push_back(custom);
  }
  ASSIGN_OR_RETURN(auto position_list, ListFlag(positions));
  for (std::string p : position_list) {
    int64_t scale = 1;
    if (!p.empty() && (p.back() == 'K' || p.back() == 'k')) {
      scale = 1024;
      p.pop_back();
    }
    int64_t v;
    if (!absl::SimpleAtoi(p, &v) || v <= 0 || v * scale > (int64_t{1} << 24)) {
      return absl::InvalidArgumentError("bad position count '" + p + "'");
    }
    o.positions.push_back(static_cast<int>(v * scale));
  }
  ASSIGN_OR_RETURN(auto dtype_list, ListFlag(dtypes));
  for (const std::string& d : dtype_list) {
    ASSIGN_OR_RETURN(KvDType t, ParseKvDType(d));
    o.dtypes.push_back(t);
  }
  ASSIGN_OR_RETURN(Topology topo, DiscoverTopology());
  const int all = static_cast<int>(topo.nodes.at(0).cpus.size());
  ASSIGN_OR_RETURN(auto thread_list, ListFlag(threads));
  for (const std::string& t : thread_list) {
    int n;
    if (t == "all") {
      n = all;
    } else if (!absl::SimpleAtoi(t, &n) || n <= 0) {
      return absl::InvalidArgumentError("bad thread count '" + t + "'");
    }
    o.threads.push_back(n);
  }
  ASSIGN_OR_RETURN(o.kernel, ParseIsa(args.Get("kernel")));
  return o;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---------------------------------------------------------------------------
// A case.

struct Result {
  double us_per_layer = 0;
  double gb_per_s = 0;
};

// The cache of one (shape, dtype, positions): as many layers as the footprint
// needs, every layer a copy of layer 0 (random k and v).
struct Setup {
  std::unique_ptr<attn::KvCache> cache;
  attn::ShardGeometry geometry;
  int layers = 0;
  int filled = 0;  // positions stored before timing
};

constexpr int kMaxSteps = 16;  // timed steps at most; each appends one position

Setup Prepare(const Shape& shape, KvDType dtype, int positions, int runs, int64_t footprint,
              int interleave, int block_tokens, ThreadPool& pool) {
  Setup s;
  const KvFormat format = KvFormat::Make(dtype, shape.head_dim);
  const double layer_bytes = format.BytesPerPosition() * shape.kv_heads * positions;
  s.layers = static_cast<int>(std::max(1.0, std::ceil(footprint / layer_bytes)));
  // Start a little short so that the timed steps straddle `positions`.
  s.filled = std::max(1, positions - kMaxSteps / 2);
  attn::KvCacheOptions o;
  o.layers = s.layers;
  o.kv_heads = shape.kv_heads;
  o.head_dim = shape.head_dim;
  o.block_tokens = block_tokens;
  const int capacity = s.filled + kMaxSteps * runs + 16;
  o.blocks = int64_t{interleave} * ((capacity + block_tokens - 1) / block_tokens + 1);
  o.dtype = dtype;
  absl::StatusOr<std::unique_ptr<attn::KvCache>> cache = attn::KvCache::Create(o);
  if (!cache.ok()) {
    std::fprintf(stderr, "%s\n", cache.status().ToString().c_str());
    std::exit(1);
  }
  s.cache = *std::move(cache);
  const uint64_t seq = 1;
  // Sequences 1..interleave take blocks in turn; only sequence 1 holds data.
  for (int pos = 0; pos < s.filled; pos += block_tokens) {
    for (int other = 0; other < interleave; ++other) {
      if (!s.cache->Reserve(seq + other, pos, std::min(block_tokens, s.filled - pos)).ok()) std::exit(1);
    }
  }
  // Layer 0 from random rows, on every thread.
  pool.ParallelFor(s.filled, [&](int64_t begin, int64_t end, int thread) {
    std::mt19937 gen(static_cast<uint32_t>(begin * 7919 + thread));
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> k(shape.head_dim), v(shape.head_dim);
    for (int64_t p = begin; p < end; ++p) {
      for (int h = 0; h < shape.kv_heads; ++h) {
        for (int d = 0; d < shape.head_dim; ++d) {
          k[d] = dist(gen);
          v[d] = dist(gen);
        }
        s.cache->Store(seq, 0, h, static_cast<int>(p), k.data(), v.data());
      }
    }
  });
  // Other layers: copies of layer 0's regions.
  const size_t region_bytes = static_cast<size_t>(o.blocks) * 2 * format.SegmentBytes(o.block_tokens);
  pool.ParallelFor(static_cast<int64_t>(s.layers - 1) * shape.kv_heads, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      const int layer = static_cast<int>(i / shape.kv_heads) + 1, h = static_cast<int>(i % shape.kv_heads);
      std::memcpy(const_cast<uint8_t*>(s.cache->View(seq, layer, h).base), s.cache->View(seq, 0, h).base,
                  region_bytes);
    }
  });
  s.geometry.layers = s.layers;
  s.geometry.heads = {0, shape.kv_heads};
  s.geometry.gqa_ratio = shape.q_heads / shape.kv_heads;
  s.geometry.head_dim = shape.head_dim;
  s.geometry.max_positions = capacity;
  return s;
}

// Decode steps on a fresh sequence copy of the setup: returns the median time
// per layer and the bytes read per layer at the median step.
Result RunCase(Setup& s, const Shape& shape, ThreadPool& pool, const attn::AttentionKernel* kernel,
               double min_time) {
  attn::AttentionShard shard(s.geometry, s.cache.get(), &pool, kernel);
  std::mt19937 gen(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(shape.q_heads) * shape.head_dim);
  std::vector<float> k(static_cast<size_t>(shape.kv_heads) * shape.head_dim), v(k.size());
  for (float& x : q) x = dist(gen);
  for (float& x : k) x = dist(gen);
  for (float& x : v) x = dist(gen);
  std::vector<float> out(q.size());
  const uint64_t seq = 1;
  std::vector<double> step_s;
  std::vector<int> step_len;
  const double start = Now();
  for (int step = 0; step < kMaxSteps; ++step) {
    const int pos = s.cache->Length(seq);
    shm::SeqSlice slice{seq, static_cast<uint32_t>(pos), 1};
    const shm::AttnRequestView req{&slice, q.data(), k.data(), v.data()};
    const double t0 = Now();
    for (int layer = 0; layer < s.layers; ++layer) {
      const absl::Status st = shard.Process(static_cast<uint32_t>(layer), 1, 1, req, out.data());
      if (!st.ok()) {
        std::fprintf(stderr, "%s\n", st.ToString().c_str());
        std::exit(1);
      }
    }
    const double dt = Now() - t0;
    if (step > 0) {  // the first step warms up
      step_s.push_back(dt);
      step_len.push_back(pos + 1);
    }
    if (step >= 3 && Now() - start > min_time) break;
  }
  std::vector<size_t> order(step_s.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return step_s[a] < step_s[b]; });
  const size_t mid = order[order.size() / 2];
  Result r;
  const double per_layer = step_s[mid] / s.layers;
  r.us_per_layer = per_layer * 1e6;
  const double bytes = s.cache->format().BytesPerPosition() * shape.kv_heads * step_len[mid];
  r.gb_per_s = bytes / per_layer / 1e9;
  return r;
}

}  // namespace

int AttentionMain(int argc, char** argv) {
  Args args = Flags();
  // argv[0] is the first flag here (ellm-bench's main passes what follows the
  // subcommand); Args skips a program name.
  if (std::optional<int> exit = args.ParseFlagsOnly(argc + 1, argv - 1)) return *exit;
  absl::StatusOr<Options> parsed = ParseOptions(args);
  if (!parsed.ok()) {
    std::fprintf(stderr, "ellm-bench attention: %s\n", std::string(parsed.status().message()).c_str());
    return 2;
  }
  const Options& o = *parsed;
  absl::StatusOr<const attn::AttentionKernel*> kernel = attn::SelectKernel(o.kernel);
  if (!kernel.ok()) {
    std::fprintf(stderr, "ellm-bench attention: %s\n", std::string(kernel.status().message()).c_str());
    return 2;
  }
  absl::StatusOr<Topology> topo = DiscoverTopology();
  const std::vector<int> cpus = topo.ok() ? topo->nodes.at(0).cpus : std::vector<int>{};
  std::fprintf(stderr,
               "attention kernel %s; threads pinned to cpus %s of node 0; footprint %ld MiB per "
               "case, probe %ld MiB (last-level cache %ld MiB)\n",
               std::string((*kernel)->name).c_str(), FormatCpuList(cpus).c_str(),
               static_cast<long>(o.footprint_bytes >> 20), static_cast<long>(o.probe_bytes >> 20),
               static_cast<long>(LastLevelCacheBytes() >> 20));
  // One pinned pool per thread count, created once.
  std::vector<std::unique_ptr<ThreadPool>> pools;
  for (int t : o.threads) pools.push_back(std::make_unique<ThreadPool>(t, cpus));
  ThreadPool& fill_pool = *pools[std::max_element(o.threads.begin(), o.threads.end()) - o.threads.begin()];
  ReadProbe probe(o.probe_bytes);

  const size_t total = o.shapes.size() * o.dtypes.size() * o.positions.size() * o.threads.size();
  size_t done = 0;
  std::vector<double> best_probe(pools.size(), 0.0);  // per thread count
  // Peak multiply-adds per second of each dot-product unit, per thread count.
  std::vector<std::map<DotUnit, double>> peaks(pools.size());
  const std::string cpu = CpuModelName();
  for (const Shape& shape : o.shapes) {
    for (KvDType dtype : o.dtypes) {
      for (int positions : o.positions) {
        const double t0 = Now();
        Setup setup = Prepare(shape, dtype, positions, static_cast<int>(pools.size()),
                              o.footprint_bytes, o.interleave, o.block_tokens, fill_pool);
        std::fprintf(stderr, "  %s %s %d positions: %d layers filled in %.1f s\n", shape.name.c_str(),
                     std::string(KvDTypeName(dtype)).c_str(), positions, setup.layers, Now() - t0);
        for (size_t ti = 0; ti < pools.size(); ++ti) {
          // Each run appends up to kMaxSteps positions; the lengths stay
          // within positions - 8 .. positions + 8 * runs (bytes are counted
          // at the actual length).
          const double probe_now = probe.Measure(*pools[ti]);
          best_probe[ti] = std::max(best_probe[ti], probe_now);
          const Result r = RunCase(setup, shape, *pools[ti], *kernel, o.min_time_s);
          ++done;
          std::fprintf(stderr, "  [%zu/%zu] %d threads: %.1f us per layer (probe now %.2f GB/s, best %.2f)\n",
                       done, total, pools[ti]->size(), r.us_per_layer, probe_now, best_probe[ti]);
          // The roofline of this case on these threads.
          const std::string_view kernel_name = dtype == KvDType::kF32 ? "reference" : (*kernel)->name;
          const DotUnit unit = AttentionDotUnit(kernel_name, dtype);
          auto peak = peaks[ti].find(unit);
          if (peak == peaks[ti].end()) {
            std::fprintf(stderr, "  peak of %s on %d threads...\n", DotUnitName(unit).c_str(), pools[ti]->size());
            peak = peaks[ti].emplace(unit, PeakGmacs(unit, *pools[ti])).first;
          }
          const double macs_per_byte = 2.0 * shape.q_heads / shape.kv_heads * shape.head_dim /
                                       KvFormat::Make(dtype, shape.head_dim).BytesPerPosition();
          const double compute_roof = peak->second / macs_per_byte;
          const double roof = std::min(best_probe[ti], compute_roof);
          std::printf(
              "shape=%s dtype=%s positions=%d threads=%d us_per_layer=%.1f gb_per_s=%.2f "
              "probe_gb_per_s=%.2f ratio=%.3f macs_per_byte=%.2f gmacs=%.1f unit=%s peak_gmacs=%.1f "
              "roof_gb_per_s=%.2f bound=%s ratio_to_roof=%.3f isa=%s cpu=\"%s\"%s\n",
              shape.name.c_str(), std::string(KvDTypeName(dtype)).c_str(), positions,
              pools[ti]->size(), r.us_per_layer, r.gb_per_s, best_probe[ti], r.gb_per_s / best_probe[ti],
              macs_per_byte, r.gb_per_s * macs_per_byte, DotUnitName(unit).c_str(), peak->second, roof,
              compute_roof < best_probe[ti] ? "compute" : "memory", r.gb_per_s / roof,
              std::string(kernel_name).c_str(), cpu.c_str(),
              o.interleave > 1 || o.block_tokens != 16
                  ? absl::StrCat(" block_tokens=", o.block_tokens, " interleave=", o.interleave).c_str()
                  : "");
          std::fflush(stdout);
        }
      }
    }
  }
  return 0;
}

}  // namespace ellm::bench
