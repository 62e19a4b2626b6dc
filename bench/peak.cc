#include "bench/peak.h"

#include "core/cpu_features.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>

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

__attribute__((target("avx2"))) int64_t RunAvx2Madd(int64_t iters) {
  __m256i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_set1_epi32(i);
  __m256i a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_set1_epi8(static_cast<char>(3 + i));
  const __m256i b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  for (int64_t n = 0; n < iters; ++n) {
    // The products do not depend on the loop: opaque operands keep the
    // compiler from hoisting them out of it or merging them.
    for (int i = 0; i < 8; ++i) __asm__ volatile("" : "+x"(a[i]));
    for (int i = 0; i < 8; ++i) {
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a[i], b), ones));
    }
  }
  __m256i s = acc[0];
  for (int i = 1; i < 8; ++i) s = _mm256_add_epi32(s, acc[i]);
  return _mm256_extract_epi32(s, 0);
}

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

}  // namespace

std::string DotUnitName(DotUnit unit) {
  switch (unit) {
    case DotUnit::kAvx512Vnni: return "vpdpbusd-zmm";
    case DotUnit::kAvxVnni: return "vpdpbusd-ymm";
    case DotUnit::kAvx2Madd: return "vpmaddubsw-ymm";
    case DotUnit::kAvx512Fma: return "vfmadd-zmm";
    case DotUnit::kAvx2Fma: return "vfmadd-ymm";
  }
  return "?";
}

bool DotUnitSupported(DotUnit unit) {
  const CpuFeatures& cpu = Cpu();
  switch (unit) {
    case DotUnit::kAvx512Vnni: return cpu.avx512_vnni && cpu.avx512bw;
    case DotUnit::kAvxVnni: return cpu.avx_vnni;
    case DotUnit::kAvx2Madd: return cpu.avx2;
    case DotUnit::kAvx512Fma: return cpu.avx512f;
    case DotUnit::kAvx2Fma: return cpu.avx2 && cpu.fma;
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
    case DotUnit::kAvx2Madd: run = RunAvx2Madd, macs_per_iter = 8 * 32; break;
    case DotUnit::kAvx512Fma: run = RunAvx512Fma, macs_per_iter = 8 * 16; break;
    case DotUnit::kAvx2Fma: run = RunAvx2Fma, macs_per_iter = 8 * 8; break;
  }
  std::atomic<int64_t> sink{0};
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {  // the best of three: a shared VM stalls now and then
    const auto t0 = std::chrono::steady_clock::now();
    pool.ParallelFor(pool.size(), [&](int64_t begin, int64_t end, int) {
      for (int64_t i = begin; i < end; ++i) sink += run(kIters);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, pool.size() * kIters * macs_per_iter / s / 1e9);
  }
  return sink.load() == 42 ? best + 1e-9 : best;
}

DotUnit AttentionDotUnit(std::string_view kernel, KvDType dtype) {
  const bool f16 = dtype != KvDType::kInt8;
  if (kernel.substr(0, 6) == "avx512" || kernel.substr(0, 3) == "amx") {
    return f16 ? DotUnit::kAvx512Fma : DotUnit::kAvx512Vnni;
  }
  if (kernel.substr(0, 9) == "avx2-vnni") return f16 ? DotUnit::kAvx2Fma : DotUnit::kAvxVnni;
  return f16 ? DotUnit::kAvx2Fma : DotUnit::kAvx2Madd;
}

}  // namespace ellm::bench
