#include "core/read_probe.h"

#include "core/cpu_features.h"

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace ellm {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Sums of 64-bit words: a read loop the memory system, not the core, bounds.
__attribute__((target("avx2"))) uint64_t SumAvx2(const uint8_t* p, size_t n) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i + 128 <= n; i += 128) {
    a = _mm256_add_epi64(a, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_add_epi64(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    c = _mm256_add_epi64(c, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    d = _mm256_add_epi64(d, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  a = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

uint64_t SumPlain(const uint8_t* p, size_t n) {
  uint64_t s[4] = {0, 0, 0, 0};
  for (size_t i = 0; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t v;
      std::memcpy(&v, p + i + 8 * k, 8);
      s[k] += v;
    }
  }
  return s[0] + s[1] + s[2] + s[3];
}

}  // namespace

ReadProbe::ReadProbe(int64_t bytes) : bytes_(bytes) {
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::fprintf(stderr, "cannot allocate the %ld MiB probe buffer\n", static_cast<long>(bytes_ >> 20));
    std::exit(1);
  }
  madvise(p, bytes_, MADV_HUGEPAGE);
  data_ = static_cast<uint8_t*>(p);
  std::memset(data_, 1, bytes_);
  __builtin_cpu_init();
  sum_ = Cpu().avx2 ? SumAvx2 : SumPlain;
}

ReadProbe::~ReadProbe() { munmap(data_, bytes_); }

double ReadProbe::Measure(ThreadPool& pool) {
  std::vector<double> rates;
  std::vector<uint64_t> sink(pool.size());
  const int parts = pool.size();
  const size_t share = static_cast<size_t>(bytes_ / parts) / 256 * 256;
  for (int rep = 0; rep < 6; ++rep) {
    const double t0 = Now();
    pool.ParallelFor(parts, [&](int64_t begin, int64_t end, int thread) {
      for (int64_t part = begin; part < end; ++part) sink[thread] += sum_(data_ + part * share, share);
    });
    const double dt = Now() - t0;
    if (rep > 0) rates.push_back(static_cast<double>(share * parts) / dt / 1e9);
  }
  if (sink[0] == 42) std::fprintf(stderr, " ");  // keep the sums alive
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

}  // namespace ellm
