// ellm-bench prefill: cold prefill in one process, split into its matrix work
// (the CPU MLP backend: projections, MLP, LM head) and its attention (an
// attention shard holding every KV head), each in multiply-adds per second
// next to the peak of the dot-product instruction it runs on, measured on the
// same threads in the same run (bench/peak.h).
#include "bench/prefill_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "attn-worker/attention_kernels.h"
#include "attn-worker/attention_shard.h"
#include "attn-worker/kv_cache.h"
#include "bench/peak.h"
#include "core/args.h"
#include "core/gguf.h"
#include "core/model_config.h"
#include "core/thread_pool.h"
#include "core/topology.h"
#include "core/weights.h"
#include "mlp-worker/backend.h"
#include "mlp-worker/cpu/matmul.h"
#include "shm/messages.h"

namespace ellm::bench {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int PrefillMain(int argc, char** argv) {
  Args args(
      "ellm-bench prefill: cold prefill of prompts in one process, split into matrix work and\n"
      "attention, each in G multiply-adds/s against the peak of its dot-product instruction\n"
      "on the same threads (the higher of the peaks measured before and after the prompt).\n"
      "Prints one key=value line per prompt length:\n"
      "  prompt= tokens_per_s= matrix_gmacs= matrix_peak= matrix_ratio= attention_gmacs=\n"
      "  attention_peak= attention_ratio= attention_peak_before= attention_peak_after= cpu=\n"
      "  isa= kernel= ...\n\n"
      "Usage: ellm-bench prefill --model FILE.gguf [--prompt 1024,4096,16384,32768]");
  args.Flag("model", "", "GGUF model (required)");
  args.Flag("prompt", "1024,4096,16384,32768", "prompt lengths, comma-separated");
  args.Flag("threads", "0", "threads for each part (0: the machine's cores)");
  args.Flag("step-tokens", "256", "tokens per step (the launcher's --max-step-tokens)");
  args.Flag("kv-dtype", "int8", "KV cache dtype: int8 or f16");
  args.Flag("matmul-isa", "auto", "matrix kernels: auto, reference, avx2, avx2-vnni, avx512 or amx");
  args.Flag("q8-act-bits", "8",
            "plain avx2 matrix kernels: bits of Q8_0's activation codes, 8 or 7 (see ellm-launch --help)");
  args.Flag("kernel", "auto", "attention kernel: auto, reference, avx2, avx2-vnni, avx512 or amx");
  if (std::optional<int> exit = args.ParseFlagsOnly(argc + 1, argv - 1)) return *exit;
  auto fail = [](const std::string& what) {
    std::fprintf(stderr, "ellm-bench prefill: %s\n", what.c_str());
    return 1;
  };
  std::vector<int> prompts;
  for (absl::string_view p : absl::StrSplit(args.Get("prompt"), ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(p, &v) || v <= 0) return fail("bad --prompt entry");
    prompts.push_back(v);
  }
  absl::StatusOr<int> threads_flag = args.GetInt("threads"), step_flag = args.GetInt("step-tokens"),
                      q8_act_bits = args.GetInt("q8-act-bits");
  if (!q8_act_bits.ok()) return fail(std::string(q8_act_bits.status().message()));
  if (!threads_flag.ok() || !step_flag.ok() || *step_flag <= 0) return fail("--threads and --step-tokens");
  absl::StatusOr<Topology> topology = DiscoverTopology();
  const int threads = *threads_flag > 0 ? *threads_flag : topology.ok() ? topology->TotalCores() : 1;
  const int step = *step_flag;
  absl::StatusOr<KvDType> dtype = ParseKvDType(args.Get("kv-dtype"));
  if (!dtype.ok() || *dtype == KvDType::kF32) return fail("--kv-dtype must be int8 or f16");
  absl::StatusOr<Isa> choice = ParseIsa(args.Get("kernel"));
  if (!choice.ok()) return fail(std::string(choice.status().message()));
  absl::StatusOr<Isa> isa = mlp::ParseMatIsa(args.Get("matmul-isa"));
  if (!isa.ok()) return fail(std::string(isa.status().message()));

  if (args.Get("model").empty()) return fail("--model is required (e.g. the README's bench model)");
  auto file = GgufFile::Open(args.Get("model"));
  if (!file.ok()) return fail(file.status().ToString());
  auto config = ModelConfig::FromGguf(**file);
  if (!config.ok()) return fail(config.status().ToString());
  const ModelConfig& c = *config;
  const int max_prompt = *std::max_element(prompts.begin(), prompts.end());
  if (max_prompt + 1 > c.context_length) return fail("a prompt is longer than the model's context");

  std::fprintf(stderr, "[prefill] loading %s...\n", args.Get("model").c_str());
  LoadOptions load;
  load.raw_matrices = true;
  auto weights = LoadWeights(**file, c, load);
  if (!weights.ok()) return fail(weights.status().ToString());
  // The projections' type names the matrix kernels' instruction.
  const DType matrix_type = weights->layers.empty() ? DType::kQ8_0 : weights->layers[0].raw_wq.type;
  auto backend =
      mlp::CreateCpuBackend(*std::move(weights), step, threads, args.Get("matmul-isa"), *q8_act_bits);
  if (!backend.ok()) return fail(backend.status().ToString());

  attn::KvCacheOptions kv;
  kv.layers = c.n_layers;
  kv.kv_heads = c.n_kv_heads;
  kv.head_dim = c.head_dim;
  kv.block_tokens = 16;
  kv.dtype = *dtype;
  kv.blocks = (max_prompt + 31) / 16;
  auto cache = attn::KvCache::Create(kv);
  if (!cache.ok()) return fail(cache.status().ToString());
  ThreadPool attn_pool(threads);
  auto kernel = attn::SelectKernel(*choice);
  if (!kernel.ok()) return fail(kernel.status().ToString());
  attn::ShardGeometry geometry;
  geometry.layers = c.n_layers;
  geometry.heads = {0, c.n_kv_heads};
  geometry.gqa_ratio = c.gqa_ratio();
  geometry.head_dim = c.head_dim;
  geometry.max_positions = c.context_length;
  attn::AttentionShard shard(geometry, cache->get(), &attn_pool, *kernel);

  const DotUnit matrix_unit = MatrixDotUnit(*isa, matrix_type);  // ParseMatIsa resolved "auto"
  const DotUnit attention_unit = AttentionDotUnit(shard.kernel_name(), *dtype, /*prefill=*/true);
  // The peaks are measured before the first prompt and again after each, and
  // a prompt is held against the higher of the measurements around it: on a
  // shared VM they moved from 480 to 880 GMAC/s within minutes.
  struct Peaks {
    double matrix = 0, attention = 0;
  };
  ThreadPool peak_pool(threads);
  const auto measure_peaks = [&]() {
    std::fprintf(stderr, "[prefill] peak of %s and %s on %d threads...\n", DotUnitName(matrix_unit).c_str(),
                 DotUnitName(attention_unit).c_str(), threads);
    Peaks p;
    p.matrix = PeakGmacs(matrix_unit, peak_pool);
    p.attention = attention_unit == matrix_unit ? p.matrix : PeakGmacs(attention_unit, peak_pool);
    return p;
  };
  Peaks before = measure_peaks();

  // Multiply-adds of one token through the layers' matrices, and of the LM head.
  const double layer_macs = static_cast<double>(c.dim) * (c.q_dim() + 2.0 * c.kv_dim()) +
                            static_cast<double>(c.q_dim()) * c.dim + 3.0 * c.dim * c.ffn_dim;
  const double matrix_macs_per_token = layer_macs * c.n_layers;
  const double head_macs = static_cast<double>(c.vocab_size) * c.dim;

  const size_t T = static_cast<size_t>(step);
  std::vector<float> q(T * c.q_dim()), k(T * c.kv_dim()), v(T * c.kv_dim()), out(T * c.q_dim());
  std::vector<float> logits(c.vocab_size);
  uint64_t seq = 1;
  for (int prompt : prompts) {
    std::fprintf(stderr, "[prefill] prompt of %d tokens...\n", prompt);
    std::vector<int32_t> tokens(prompt), positions(prompt);
    uint64_t x = 12345 + prompt;
    for (int i = 0; i < prompt; ++i) {
      x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
      tokens[i] = 3 + static_cast<int32_t>((x * 0x2545F4914F6CDD1DULL >> 33) % (c.vocab_size - 3));
      positions[i] = i;
    }
    double matrix_s = 0, attention_s = 0;
    const double start = Now();
    for (int at = 0; at < prompt; at += step) {
      const int n = std::min(step, prompt - at);
      double t0 = Now();
      absl::Status st = (*backend)->BeginStep(tokens.data() + at, positions.data() + at, n);
      matrix_s += Now() - t0;
      shm::SeqSlice slice{seq, static_cast<uint32_t>(at), static_cast<uint32_t>(n)};
      for (int l = 0; l < c.n_layers && st.ok(); ++l) {
        t0 = Now();
        st = ComputeQkv(**backend, c.n_kv_heads, l, q.data(), k.data(), v.data());
        const double t1 = Now();
        if (st.ok()) {
          shm::AttnRequestView req{&slice, q.data(), k.data(), v.data()};
          st = shard.Process(l, 1, n, req, out.data());
        }
        const double t2 = Now();
        if (st.ok()) st = CompleteLayer(**backend, c.n_kv_heads, l, out.data());
        matrix_s += (t1 - t0) + (Now() - t2);
        attention_s += t2 - t1;
      }
      if (st.ok() && at + n == prompt) {
        const int32_t row = n - 1;
        t0 = Now();
        st = (*backend)->ComputeLogits(&row, 1, logits.data());
        matrix_s += Now() - t0;
      }
      if (!st.ok()) return fail(st.ToString());
    }
    const double total_s = Now() - start;
    (*cache)->Free(seq++);
    const double matrix_gmacs = (matrix_macs_per_token * prompt + head_macs) / matrix_s / 1e9;
    // Every layer's query heads against the positions each token sees, q·K and p·V.
    const double attention_macs =
        2.0 * c.n_layers * c.n_heads * c.head_dim * (static_cast<double>(prompt) * (prompt + 1) / 2);
    const double attention_gmacs = attention_macs / attention_s / 1e9;
    const Peaks after = measure_peaks();
    // The higher of the two: a peak measured while something else ran on
    // the cores reads low (half, on this VM), and a mean of the two then
    // flattered the ratios by up to a third.
    const double matrix_peak = std::max(before.matrix, after.matrix);
    const double attention_peak = std::max(before.attention, after.attention);
    std::printf(
        "prompt=%d tokens_per_s=%.1f s=%.2f matrix_s=%.2f attention_s=%.2f matrix_gmacs=%.1f "
        "matrix_peak=%.1f matrix_ratio=%.3f attention_gmacs=%.1f attention_peak=%.1f attention_ratio=%.3f "
        "matrix_peak_before=%.1f matrix_peak_after=%.1f attention_peak_before=%.1f attention_peak_after=%.1f "
        "matrix_unit=%s attention_unit=%s isa=%s kernel=\"%s\" kv_dtype=%s threads=%d step_tokens=%d "
        "cpu=\"%s\"\n",
        prompt, prompt / total_s, total_s, matrix_s, attention_s, matrix_gmacs, matrix_peak,
        matrix_peak > 0 ? matrix_gmacs / matrix_peak : 0, attention_gmacs, attention_peak,
        attention_peak > 0 ? attention_gmacs / attention_peak : 0, before.matrix, after.matrix, before.attention,
        after.attention,
        DotUnitName(matrix_unit).c_str(),
        DotUnitName(attention_unit).c_str(), (*backend)->name().c_str(), shard.kernel_name().c_str(),
        args.Get("kv-dtype").c_str(), threads, step, CpuModelName().c_str());
    std::fflush(stdout);
    before = after;
  }
  return 0;
}

}  // namespace ellm::bench
