// GCC 12 warns about the deliberately undefined pass-through operand of the
// AVX-512 reductions (_mm512_reduce_add_*): a known false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "bench/peak.h"

#include "core/amx.h"
#include "core/args.h"
#include "core/cpu_features.h"
#include "core/topology.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>
#include <utility>
#include <vector>

namespace ellm::bench {
namespace {

constexpr int64_t kIters = 1 << 22;

// Eight independent accumulator chains per loop, enough to cover the
// instructions' latency on every x86 core of the last decade.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) int64_t RunAvx512Vnni(int64_t iters) {
  __m512i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (int64_t n = 0; n < iters; ++n) {
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  }
  __m512i s = acc[0];
  for (int i = 1; i < 8; ++i) s = _mm512_add_epi32(s, acc[i]);
  return _mm512_reduce_add_epi32(s);
}

__attribute__((target("avx2,avxvnni"))) int64_t RunAvxVnni(int64_t iters) {
  __m256i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_set1_epi32(i);
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
  for (int64_t n = 0; n < iters; ++n) {
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], a, b);
  }
  __m256i s = acc[0];
  for (int i = 1; i < 8; ++i) s = _mm256_add_epi32(s, acc[i]);
  return _mm256_extract_epi32(s, 0) + _mm256_extract_epi32(s, 7);
}

// Eight sums, as above. The loop body is one asm statement, so the sums and
// operands have to be in registers at it: written with intrinsics (an array,
// and then named sums), GCC 12 kept 3 to 6 of the 8 sums on the stack, and
// the loop timed store-to-load forwarding instead of the products (2.3-2.6 G
// VPMADDUBSW a second on Zen 5, against 3.7 widened and 6 in int16 here).
// kWiden: each pair sum is widened to int32 (VPMADDWD) and added there, as
// every dot product of the plain AVX2 attention kernel and Q8_0's matrix
// kernel does; else the pair sums are added in int16 (they wrap here; the
// kernels bound them), as the 4-, 5- and 6-bit matrix kernels do for a few
// lines before one VPMADDWD.
#define ELLM_MADD_STEP(s, t)                  \
  "vpmaddubsw %[b], %[a], %[" t "]\n\t"      \
  "vpmaddwd %[ones], %[" t "], %[" t "]\n\t" \
  "vpaddd %[" t "], %[" s "], %[" s "]\n\t"
#define ELLM_MADD16_STEP(s, t)           \
  "vpmaddubsw %[b], %[a], %[" t "]\n\t" \
  "vpaddw %[" t "], %[" s "], %[" s "]\n\t"
template <bool kWiden>
__attribute__((target("avx2"))) int64_t RunAvx2Madd(int64_t iters) {
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  __m256i t0, t1;
  for (int64_t n = 0; n < iters; ++n) {
    if constexpr (kWiden) {
      __asm__ volatile(ELLM_MADD_STEP("s0", "t0") ELLM_MADD_STEP("s1", "t1") ELLM_MADD_STEP("s2", "t0")
                       ELLM_MADD_STEP("s3", "t1") ELLM_MADD_STEP("s4", "t0") ELLM_MADD_STEP("s5", "t1")
                       ELLM_MADD_STEP("s6", "t0") ELLM_MADD_STEP("s7", "t1")
                       : [s0] "+x"(s0), [s1] "+x"(s1), [s2] "+x"(s2), [s3] "+x"(s3), [s4] "+x"(s4),
                         [s5] "+x"(s5), [s6] "+x"(s6), [s7] "+x"(s7), [t0] "=&x"(t0), [t1] "=&x"(t1)
                       : [a] "x"(a), [b] "x"(b), [ones] "x"(ones));
    } else {
      __asm__ volatile(ELLM_MADD16_STEP("s0", "t0") ELLM_MADD16_STEP("s1", "t1") ELLM_MADD16_STEP("s2", "t0")
                       ELLM_MADD16_STEP("s3", "t1") ELLM_MADD16_STEP("s4", "t0") ELLM_MADD16_STEP("s5", "t1")
                       ELLM_MADD16_STEP("s6", "t0") ELLM_MADD16_STEP("s7", "t1")
                       : [s0] "+x"(s0), [s1] "+x"(s1), [s2] "+x"(s2), [s3] "+x"(s3), [s4] "+x"(s4),
                         [s5] "+x"(s5), [s6] "+x"(s6), [s7] "+x"(s7), [t0] "=&x"(t0), [t1] "=&x"(t1)
                       : [a] "x"(a), [b] "x"(b));
    }
  }
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(s0, s1), _mm256_add_epi32(s2, s3)),
                                     _mm256_add_epi32(_mm256_add_epi32(s4, s5), _mm256_add_epi32(s6, s7)));
  return _mm256_extract_epi32(s, 0);
}
#undef ELLM_MADD_STEP
#undef ELLM_MADD16_STEP

__attribute__((target("avx512f"))) int64_t RunAvx512Fma(int64_t iters) {
  __m512 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  for (int64_t n = 0; n < iters; ++n) {
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  __m512 s = acc[0];
  for (int i = 1; i < 8; ++i) s = _mm512_add_ps(s, acc[i]);
  return static_cast<int64_t>(_mm512_reduce_add_ps(s));
}

__attribute__((target("avx2,fma"))) int64_t RunAvx2Fma(int64_t iters) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  for (int64_t n = 0; n < iters; ++n) {
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  __m256 s = acc[0];
  for (int i = 1; i < 8; ++i) s = _mm256_add_ps(s, acc[i]);
  return static_cast<int64_t>(_mm256_cvtss_f32(s));
}

// TDPBSUD on full tiles: four C tiles (tmm0-3) from two A (tmm4, 5) and two
// B (tmm6, 7), eight products per iteration. The configuration load and the
// tile code sit in one function (DESIGN.md "Build facts").
alignas(64) int8_t g_tile_bytes[16 * 64];

// kBf16: TDPBF16PS instead (zero operands: no denormals, no overflow).
// A product takes 16 cycles or more: a tenth of kIters' iterations runs long
// enough (kAmxIterFraction).
constexpr int kAmxIterFraction = 10;
template <bool kBf16>
__attribute__((target("amx-tile,amx-int8,amx-bf16"))) int64_t RunAmx(int64_t iters) {
  iters /= kAmxIterFraction;
  AmxTileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  const int64_t stride = 64;
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
  __asm__ volatile(
      "tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3\n\t"
      "tileloadd (%0,%1,1), %%tmm4\n\ttileloadd (%0,%1,1), %%tmm5\n\t"
      "tileloadd (%0,%1,1), %%tmm6\n\ttileloadd (%0,%1,1), %%tmm7"
      :
      : "r"(g_tile_bytes), "r"(stride)
      : "memory");
  for (int64_t n = 0; n < iters; ++n) {
    if constexpr (kBf16) {
      __asm__ volatile(
          "tdpbf16ps %%tmm6, %%tmm4, %%tmm0\n\ttdpbf16ps %%tmm7, %%tmm4, %%tmm1\n\t"
          "tdpbf16ps %%tmm6, %%tmm5, %%tmm2\n\ttdpbf16ps %%tmm7, %%tmm5, %%tmm3\n\t"
          "tdpbf16ps %%tmm6, %%tmm4, %%tmm0\n\ttdpbf16ps %%tmm7, %%tmm4, %%tmm1\n\t"
          "tdpbf16ps %%tmm6, %%tmm5, %%tmm2\n\ttdpbf16ps %%tmm7, %%tmm5, %%tmm3" ::
              : "memory");
      continue;
    }
    __asm__ volatile(
        "tdpbsud %%tmm6, %%tmm4, %%tmm0\n\ttdpbsud %%tmm7, %%tmm4, %%tmm1\n\t"
        "tdpbsud %%tmm6, %%tmm5, %%tmm2\n\ttdpbsud %%tmm7, %%tmm5, %%tmm3\n\t"
        "tdpbsud %%tmm6, %%tmm4, %%tmm0\n\ttdpbsud %%tmm7, %%tmm4, %%tmm1\n\t"
        "tdpbsud %%tmm6, %%tmm5, %%tmm2\n\ttdpbsud %%tmm7, %%tmm5, %%tmm3" ::
            : "memory");
  }
  alignas(64) int32_t out[16 * 16];
  __asm__ volatile("tilestored %%tmm0, (%1,%2,1)\n\ttilerelease" : "=m"(out) : "r"(out), "r"(stride));
  return out[0];
}

// VPDPBUSD zmm fed by broadcast 4-byte groups, as the int8 kernels feed it:
// 10 independent chains, two register operands k0, k1, and per iteration
// kMode: 0 no broadcast (a register), 1 a VPBROADCASTD from memory per two
// VPDPBUSDs, 2 one per VPDPBUSD, 3 VPDPBUSD's embedded broadcast ({1to16}).
alignas(64) int32_t g_codes[64];

template <int kMode>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) int64_t RunVnniBroadcast(int64_t iters) {
  __m512i acc[10];
  for (int i = 0; i < 10; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i k0 = _mm512_set1_epi8(3), k1 = _mm512_set1_epi8(5);
  for (int64_t n = 0; n < iters; ++n) {
    __asm__ volatile("" : "+v"(k0), "+v"(k1));
    const int32_t* m = g_codes + (n & 7) * 8;
    for (int j = 0; j < 5; ++j) {
      if constexpr (kMode == 3) {
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc[2 * j]) : "v"(k0), "m"(m[j]));
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc[2 * j + 1]) : "v"(k1), "m"(m[j + 1]));
      } else {
        __m512i c0 = kMode == 0 ? k0 : _mm512_set1_epi32(m[j]);
        __m512i c1 = kMode == 2 ? _mm512_set1_epi32(m[j + 1]) : c0;
        __asm__ volatile("" : "+v"(c0), "+v"(c1));
        acc[2 * j] = _mm512_dpbusd_epi32(acc[2 * j], k0, c0);
        acc[2 * j + 1] = _mm512_dpbusd_epi32(acc[2 * j + 1], k1, c1);
      }
    }
  }
  __m512i s = acc[0];
  for (int i = 1; i < 10; ++i) s = _mm512_add_epi32(s, acc[i]);
  return _mm512_reduce_add_epi32(s);
}

// The best rate of `ops_per_iter` x kIters operations per thread over three
// runs on every thread of `pool`, in G per second.
double BestRate(int64_t (*run)(int64_t), double ops_per_iter, ThreadPool& pool) {
  std::atomic<int64_t> sink{0};
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {  // the best of three: a shared VM stalls now and then
    const auto t0 = std::chrono::steady_clock::now();
    pool.ParallelFor(pool.size(), [&](int64_t begin, int64_t end, int) {
      for (int64_t i = begin; i < end; ++i) sink += run(kIters);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, pool.size() * kIters * ops_per_iter / s / 1e9);
  }
  return sink.load() == 42 ? best + 1e-9 : best;
}

}  // namespace

std::string DotUnitName(DotUnit unit) {
  switch (unit) {
    case DotUnit::kAvx512Vnni: return "vpdpbusd-zmm";
    case DotUnit::kAvxVnni: return "vpdpbusd-ymm";
    case DotUnit::kAvx2Madd: return "vpmaddubsw-ymm";
    case DotUnit::kAvx2Madd16: return "vpmaddubsw-int16-ymm";
    case DotUnit::kAvx512Fma: return "vfmadd-zmm";
    case DotUnit::kAvx2Fma: return "vfmadd-ymm";
    case DotUnit::kAmxInt8: return "tdpbsud-tile";
    case DotUnit::kAmxBf16: return "tdpbf16ps-tile";
  }
  return "?";
}

bool DotUnitSupported(DotUnit unit) {
  const CpuFeatures& cpu = Cpu();
  switch (unit) {
    case DotUnit::kAvx512Vnni: return cpu.avx512_vnni && cpu.avx512bw;
    case DotUnit::kAvxVnni: return cpu.avx_vnni;
    case DotUnit::kAvx2Madd:
    case DotUnit::kAvx2Madd16: return cpu.avx2;
    case DotUnit::kAvx512Fma: return cpu.avx512f;
    case DotUnit::kAvx2Fma: return cpu.avx2 && cpu.fma;
    case DotUnit::kAmxInt8:
    case DotUnit::kAmxBf16: return CpuHas(Isa::kAmx);
  }
  return false;
}

double PeakGmacs(DotUnit unit, ThreadPool& pool) {
  if (!DotUnitSupported(unit)) return 0;
  int64_t (*run)(int64_t) = nullptr;
  double macs_per_iter = 0;  // eight instructions (or triplets) per iteration
  switch (unit) {
    case DotUnit::kAvx512Vnni: run = RunAvx512Vnni, macs_per_iter = 8 * 64; break;
    case DotUnit::kAvxVnni: run = RunAvxVnni, macs_per_iter = 8 * 32; break;
    case DotUnit::kAvx2Madd: run = RunAvx2Madd<true>, macs_per_iter = 8 * 32; break;
    case DotUnit::kAvx2Madd16: run = RunAvx2Madd<false>, macs_per_iter = 8 * 32; break;
    case DotUnit::kAvx512Fma: run = RunAvx512Fma, macs_per_iter = 8 * 16; break;
    case DotUnit::kAvx2Fma: run = RunAvx2Fma, macs_per_iter = 8 * 8; break;
    case DotUnit::kAmxInt8: run = RunAmx<false>, macs_per_iter = 8.0 * 16 * 16 * 64 / kAmxIterFraction; break;
    case DotUnit::kAmxBf16: run = RunAmx<true>, macs_per_iter = 8.0 * 16 * 16 * 32 / kAmxIterFraction; break;
  }
  return BestRate(run, macs_per_iter, pool);
}

std::vector<std::pair<std::string, double>> VnniBroadcastRates(ThreadPool& pool) {
  if (!DotUnitSupported(DotUnit::kAvx512Vnni)) return {};
  return {{"registers", BestRate(RunVnniBroadcast<0>, 10, pool)},
          {"vpbroadcastd_per_two", BestRate(RunVnniBroadcast<1>, 10, pool)},
          {"vpbroadcastd_per_one", BestRate(RunVnniBroadcast<2>, 10, pool)},
          {"embedded_broadcast", BestRate(RunVnniBroadcast<3>, 10, pool)}};
}

int PeakMain(int argc, char** argv) {
  Args args(
      "ellm-bench peak: the measured peak of each dot-product instruction the kernels use,\n"
      "on the given threads, and VPDPBUSD zmm's rate when its 4-byte groups come from\n"
      "broadcasts (none, one per two, one per instruction, embedded). Prints key=value lines:\n"
      "  unit= threads= peak_gmacs= cpu=\n"
      "  unit=vpdpbusd-zmm threads= g_per_s_registers= g_per_s_vpbroadcastd_per_two= ... cpu=\n\n"
      "Usage: ellm-bench peak [--threads N]");
  args.Flag("threads", "0", "threads (0: the machine's cores)");
  if (std::optional<int> exit = args.ParseFlagsOnly(argc + 1, argv - 1)) return *exit;
  absl::StatusOr<int> threads_flag = args.GetInt("threads");
  if (!threads_flag.ok() || *threads_flag < 0) {
    std::fprintf(stderr, "ellm-bench peak: --threads must be a number >= 0\n");
    return 2;
  }
  absl::StatusOr<Topology> topology = DiscoverTopology();
  const int threads = *threads_flag > 0 ? *threads_flag : topology.ok() ? topology->TotalCores() : 1;
  ThreadPool pool(threads);
  const std::string cpu = CpuModelName();
  for (DotUnit unit : {DotUnit::kAvx512Vnni, DotUnit::kAvxVnni, DotUnit::kAvx2Madd, DotUnit::kAvx2Madd16,
                       DotUnit::kAvx512Fma, DotUnit::kAvx2Fma, DotUnit::kAmxInt8, DotUnit::kAmxBf16}) {
    if (!DotUnitSupported(unit)) continue;
    std::fprintf(stderr, "[peak] %s on %d threads...\n", DotUnitName(unit).c_str(), threads);
    std::printf("unit=%s threads=%d peak_gmacs=%.1f cpu=\"%s\"\n", DotUnitName(unit).c_str(), threads,
                PeakGmacs(unit, pool), cpu.c_str());
    std::fflush(stdout);
  }
  const std::vector<std::pair<std::string, double>> rates = VnniBroadcastRates(pool);
  if (!rates.empty()) {
    std::printf("unit=vpdpbusd-zmm threads=%d", threads);
    for (const auto& [name, rate] : rates) std::printf(" g_per_s_%s=%.2f", name.c_str(), rate);
    std::printf(" cpu=\"%s\"\n", cpu.c_str());
  }
  return 0;
}

DotUnit MatrixDotUnit(Isa isa, DType type) {
  const bool floats = type == DType::kF16 || type == DType::kBF16 || type == DType::kF32;
  switch (isa) {
    case Isa::kAvx512: return floats ? DotUnit::kAvx512Fma : DotUnit::kAvx512Vnni;
    case Isa::kAmx:  // every block type on the tile unit in bf16 (at 16 tokens or more)
      return floats ? DotUnit::kAvx512Fma : DotUnit::kAmxBf16;
    case Isa::kAvx2Vnni: return floats ? DotUnit::kAvx2Fma : DotUnit::kAvxVnni;
    default:
      if (floats) return DotUnit::kAvx2Fma;
      // Q8_0's pair sums reach 2 x 128 x 127 and are widened at once; the
      // narrower codes' are added in int16 first (matmul_avx2.cc).
      return type == DType::kQ8_0 ? DotUnit::kAvx2Madd : DotUnit::kAvx2Madd16;
  }
}

DotUnit AttentionDotUnit(std::string_view kernel, KvDType dtype, bool prefill) {
  const bool f16 = dtype != KvDType::kInt8;
  if (prefill && !f16 && kernel.substr(0, 3) == "amx") return DotUnit::kAmxBf16;
  if (kernel.substr(0, 6) == "avx512" || kernel.substr(0, 3) == "amx") {
    return f16 ? DotUnit::kAvx512Fma : DotUnit::kAvx512Vnni;
  }
  if (kernel.substr(0, 9) == "avx2-vnni") return f16 ? DotUnit::kAvx2Fma : DotUnit::kAvxVnni;
  return f16 ? DotUnit::kAvx2Fma : DotUnit::kAvx2Madd;
}

}  // namespace ellm::bench
