// core/kernels.h against plain double-precision loops written here, on fresh
// random inputs at awkward sizes; core/thread_pool.h's ParallelFor coverage.
//
// Error budgets. u = 2^-24 is the fp32 unit roundoff.
//  * Dot / MatVec accumulate n/8 products per lane, then 8 lanes and a tail:
//    the classic bound |err| <= gamma_k * sum|a_i b_i| with k = n/8 + 8 + 1
//    (one rounding per multiply), gamma_k ~ k u. Exact-index checks (one-hot
//    vectors, where the result must be exact) catch any misaddressed element.
//  * Elementwise kernels (RmsNorm, SwiGlu, Softmax, RoPE): a handful of fp32
//    roundings per element, so a few u relative; we allow 1e-6 .. 5e-6.
//  * AttendOneHead: ~1e-5 of max|v| (scores within a few u of exact, the
//    softmax relative error a few u times the score range, the output a sum of
//    up to 129 fp32 terms).
#include "core/kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <complex>
#include <cstdint>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "core/cpu_features.h"
#include "core/thread_pool.h"
#include "tests/tests_util.h"
#include "gtest/gtest.h"

namespace ellm {
namespace {

constexpr double kU = 1.0 / (1 << 24);
const int kSizes[] = {1, 3, 17, 129, 4097};

std::vector<float> Random(int64_t n, std::mt19937& gen, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> x(n);
  for (float& v : x) v = dist(gen);
  return x;
}

std::vector<float> Normal(int64_t n, std::mt19937& gen, float sd = 1.0f) {
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> x(n);
  for (float& v : x) v = dist(gen);
  return x;
}

// Rigorous bound on the error of Dot's fixed-order fp32 summation.
double DotBound(const float* a, const float* b, int64_t n) {
  double abs_sum = 0;
  for (int64_t i = 0; i < n; ++i) abs_sum += std::fabs(static_cast<double>(a[i]) * b[i]);
  const double k = static_cast<double>(n / 8 + 8 + 1);
  return 1.01 * k * kU * abs_sum + 1e-30;
}

double DotRef(const float* a, const float* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

TEST(Kernels, DotMatchesDoubleReference) {
  std::mt19937 gen(1);
  for (int n : kSizes) {
    for (int trial = 0; trial < 5; ++trial) {
      const std::vector<float> a = Normal(n, gen), b = Normal(n, gen);
      EXPECT_NEAR(Dot(a.data(), b.data(), n), DotRef(a.data(), b.data(), n),
                  DotBound(a.data(), b.data(), n))
          << "n=" << n;
    }
  }
  EXPECT_EQ(Dot(nullptr, nullptr, 0), 0.0f);
}

TEST(Kernels, DotReadsEveryElementOnce) {
  // Against a one-hot vector the result is exactly a[i]: any skipped, doubled or
  // shifted element (main loop or tail) shows.
  std::mt19937 gen(2);
  for (int n : kSizes) {
    const std::vector<float> a = Random(n, gen, 1.0f, 2.0f);
    std::vector<float> e(n, 0.0f);
    for (int i = 0; i < n; ++i) {
      e[i] = 1.0f;
      ASSERT_EQ(Dot(a.data(), e.data(), n), a[i]) << "n=" << n << " i=" << i;
      ASSERT_EQ(Dot(e.data(), a.data(), n), a[i]) << "n=" << n << " i=" << i;
      e[i] = 0.0f;
    }
    // And all-ones counts the elements exactly.
    const std::vector<float> ones(n, 1.0f);
    EXPECT_EQ(Dot(ones.data(), ones.data(), n), static_cast<float>(n));
  }
}

TEST(Kernels, MatVecMatchesDoubleReference) {
  std::mt19937 gen(3);
  for (int rows : {1, 3, 17, 129}) {
    for (int cols : kSizes) {
      const std::vector<float> w = Normal(int64_t{rows} * cols, gen), x = Normal(cols, gen);
      std::vector<float> y(rows + 1, 12345.0f);  // one guard element past the end
      MatVec(w.data(), x.data(), y.data(), rows, cols);
      for (int r = 0; r < rows; ++r) {
        const float* wr = w.data() + int64_t{r} * cols;
        ASSERT_NEAR(y[r], DotRef(wr, x.data(), cols), DotBound(wr, x.data(), cols))
            << rows << "x" << cols << " row " << r;
      }
      EXPECT_EQ(y[rows], 12345.0f) << "MatVec wrote past y[rows-1]";
    }
  }
}

TEST(Kernels, MatVecIsRowMajor) {
  // W[r, c] = 1 only at c = (3r + 1) % cols: y[r] = x[(3r + 1) % cols] exactly.
  std::mt19937 gen(4);
  for (int cols : {3, 17, 129}) {
    const int rows = 17;
    const std::vector<float> x = Random(cols, gen);
    std::vector<float> w(int64_t{rows} * cols, 0.0f);
    for (int r = 0; r < rows; ++r) w[int64_t{r} * cols + (3 * r + 1) % cols] = 1.0f;
    std::vector<float> y(rows);
    MatVec(w.data(), x.data(), y.data(), rows, cols);
    for (int r = 0; r < rows; ++r) EXPECT_EQ(y[r], x[(3 * r + 1) % cols]) << cols << " " << r;
  }
}

TEST(Kernels, RmsNormMatchesDoubleReference) {
  std::mt19937 gen(5);
  for (int n : kSizes) {
    for (float eps : {1e-5f, 1e-6f, 0.5f}) {
      const std::vector<float> x = Normal(n, gen, 3.0f), weight = Random(n, gen, 0.5f, 2.0f);
      std::vector<float> out(n);
      RmsNorm(x.data(), weight.data(), out.data(), n, eps);
      double ss = 0;
      for (float v : x) ss += static_cast<double>(v) * v;
      const double scale = 1.0 / std::sqrt(ss / n + eps);
      for (int i = 0; i < n; ++i) {
        const double ref = x[i] * scale * weight[i];
        ASSERT_NEAR(out[i], ref, 1e-6 * std::fabs(ref) + 1e-30) << "n=" << n << " i=" << i;
      }
    }
  }
  // All zeros: eps keeps the output finite (zero).
  const std::vector<float> zeros(17, 0.0f), ones(17, 1.0f);
  std::vector<float> out(17, 1.0f);
  RmsNorm(zeros.data(), ones.data(), out.data(), 17, 1e-5f);
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

TEST(Kernels, RmsNormOfConstantIsWeight) {
  // x = c everywhere: mean(x^2) = c^2, so out ~ sign(c) * weight (eps tiny next to c^2).
  std::mt19937 gen(6);
  for (int n : kSizes) {
    const std::vector<float> w = Random(n, gen);
    const std::vector<float> x(n, -7.0f);
    std::vector<float> out(n);
    RmsNorm(x.data(), w.data(), out.data(), n, 1e-9f);
    for (int i = 0; i < n; ++i) ASSERT_NEAR(out[i], -w[i], 1e-6) << n << " " << i;
  }
}

TEST(Kernels, SoftmaxMatchesDoubleAndSumsToOne) {
  std::mt19937 gen(7);
  for (int n : kSizes) {
    for (float offset : {0.0f, 1000.0f, -1000.0f}) {
      // The offset would overflow exp without the max subtraction.
      std::vector<float> x = Normal(n, gen, 3.0f);
      for (float& v : x) v += offset;
      std::vector<float> y = x;
      Softmax(y.data(), n);
      double max = -INFINITY;
      for (float v : x) max = std::max(max, static_cast<double>(v));
      double ref_sum = 0, sum = 0;
      for (float v : x) ref_sum += std::exp(v - max);
      for (int i = 0; i < n; ++i) {
        const double ref = std::exp(x[i] - max) / ref_sum;
        ASSERT_TRUE(std::isfinite(y[i]));
        ASSERT_GE(y[i], 0.0f);
        // x - max is formed in fp32: its rounding (|x - max| u, up to ~30 u here)
        // moves exp by that much relative.
        ASSERT_NEAR(y[i], ref, 5e-6 * ref + 1e-30) << "n=" << n << " i=" << i;
        sum += y[i];
      }
      EXPECT_NEAR(sum, 1.0, 1e-5) << "n=" << n;
    }
  }
  float one = 42.0f;
  Softmax(&one, 1);
  EXPECT_EQ(one, 1.0f);
}

TEST(Kernels, SwiGluMatchesDoubleReference) {
  std::mt19937 gen(8);
  for (int n : kSizes) {
    const std::vector<float> gate = Random(n, gen, -12.0f, 12.0f), up = Normal(n, gen);
    std::vector<float> out(n);
    SwiGlu(gate.data(), up.data(), out.data(), n);
    for (int i = 0; i < n; ++i) {
      const double g = gate[i];
      const double ref = g / (1.0 + std::exp(-g)) * up[i];
      ASSERT_NEAR(out[i], ref, 2e-6 * std::fabs(ref) + 1e-12) << "n=" << n << " g=" << g;
    }
  }
  // Large |gate|: silu(g) -> g for g >> 0, -> 0 for g << 0, never NaN.
  const float gate[] = {80.0f, -80.0f, 0.0f, -100.0f};
  const float up[] = {2.0f, 2.0f, 5.0f, 1.0f};
  float out[4];
  SwiGlu(gate, up, out, 4);
  EXPECT_FLOAT_EQ(out[0], 160.0f);
  EXPECT_NEAR(out[1], 0.0f, 1e-30);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_FALSE(std::isnan(out[3]));
  EXPECT_NEAR(out[3], 0.0f, 1e-30);
}

// Causal context already cut: softmax(q k^T / sqrt(hd)) v in double.
std::vector<double> AttendRef(const std::vector<float>& q, const std::vector<const float*>& k,
                              const std::vector<const float*>& v, int n, int hd) {
  std::vector<double> s(n);
  double max = -INFINITY;
  for (int t = 0; t < n; ++t) {
    s[t] = DotRef(q.data(), k[t], hd) / std::sqrt(static_cast<double>(hd));
    max = std::max(max, s[t]);
  }
  double sum = 0;
  for (double& x : s) {
    x = std::exp(x - max);
    sum += x;
  }
  std::vector<double> out(hd, 0.0);
  for (int t = 0; t < n; ++t) {
    for (int d = 0; d < hd; ++d) out[d] += s[t] / sum * v[t][d];
  }
  return out;
}

TEST(Kernels, AttendOneHeadMatchesDoubleReference) {
  std::mt19937 gen(12);
  for (int head_dim : {8, 64, 128}) {
    for (int n : {1, 3, 17, 129}) {
      for (float q_scale : {1.0f, 4.0f}) {  // 4: sharper softmax
        const std::vector<float> q = Normal(head_dim, gen, q_scale);
        // Rows scattered through one buffer in a shuffled order, K and V
        // interleaved: the kernel must follow the row pointers.
        const std::vector<float> pool = Normal(int64_t{2} * n * head_dim, gen);
        std::vector<int> order(2 * n);
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), gen);
        std::vector<const float*> k(n), v(n);
        for (int t = 0; t < n; ++t) {
          k[t] = pool.data() + int64_t{order[2 * t]} * head_dim;
          v[t] = pool.data() + int64_t{order[2 * t + 1]} * head_dim;
        }
        std::vector<float> scores(n), out(head_dim + 1, 777.0f);
        AttendOneHead(q.data(), k.data(), v.data(), n, head_dim, scores.data(), out.data());
        const std::vector<double> ref = AttendRef(q, k, v, n, head_dim);
        double max_v = 0;
        for (int t = 0; t < n; ++t) {
          for (int d = 0; d < head_dim; ++d) max_v = std::max(max_v, std::fabs(double{v[t][d]}));
        }
        for (int d = 0; d < head_dim; ++d) {
          ASSERT_NEAR(out[d], ref[d], 1e-5 * max_v)
              << "head_dim " << head_dim << " n " << n << " d " << d;
        }
        EXPECT_EQ(out[head_dim], 777.0f) << "wrote past out[head_dim - 1]";
      }
    }
  }
}

TEST(Kernels, AttendOneHeadSingleDominantKeyReturnsItsValue) {
  // q aligned with one key and scaled up: p ~ one-hot, out ~ that key's v.
  std::mt19937 gen(13);
  const int hd = 64, n = 17, hot = 11;
  std::vector<std::vector<float>> ks, vs;
  std::vector<const float*> k(n), v(n);
  for (int t = 0; t < n; ++t) {
    ks.push_back(Normal(hd, gen));
    vs.push_back(Normal(hd, gen));
  }
  for (int t = 0; t < n; ++t) {
    k[t] = ks[t].data();
    v[t] = vs[t].data();
  }
  std::vector<float> q(hd);
  for (int d = 0; d < hd; ++d) q[d] = 50.0f * ks[hot][d];
  std::vector<float> scores(n), out(hd);
  AttendOneHead(q.data(), k.data(), v.data(), n, hd, scores.data(), out.data());
  for (int d = 0; d < hd; ++d) EXPECT_NEAR(out[d], vs[hot][d], 1e-4) << d;
}

TEST(ThreadPool, ParallelForCoversRangeExactlyOnce) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t n : {0, 1, 2, 7, 1000}) {
      // Run several times: the pool's generations must not mix jobs.
      for (int rep = 0; rep < 20; ++rep) {
        std::vector<std::atomic<int>> hits(n);
        std::atomic<int> calls{0};
        std::mutex mu;
        std::set<int> indices;
        bool bad_range = false;
        const std::thread::id caller = std::this_thread::get_id();
        bool index0_on_caller = true;
        pool.ParallelFor(n, [&](int64_t begin, int64_t end, int index) {
          ++calls;
          for (int64_t i = begin; i < end; ++i) hits[i].fetch_add(1);
          std::lock_guard<std::mutex> lock(mu);
          if (begin >= end || begin < 0 || end > n || index < 0 || index >= threads) {
            bad_range = true;
          }
          if (!indices.insert(index).second) bad_range = true;  // one chunk per thread
          if (index == 0 && std::this_thread::get_id() != caller) index0_on_caller = false;
        });
        EXPECT_FALSE(bad_range) << "threads " << threads << " n " << n;
        EXPECT_TRUE(index0_on_caller);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(hits[i].load(), 1) << "threads " << threads << " n " << n << " i " << i;
        }
        if (n == 0) {
          EXPECT_EQ(calls.load(), 0);
        }
        EXPECT_LE(calls.load(), threads);
        if (n >= threads) {
          EXPECT_EQ(calls.load(), threads) << "every thread takes a chunk";
        }
      }
    }
  }
}

TEST(ThreadPool, ParallelForUsesTheWorkers) {
  // With 3 threads and enough items, three distinct OS threads run chunks.
  ThreadPool pool(3);
  std::mutex mu;
  std::set<std::thread::id> ids;
  pool.ParallelFor(3000, [&](int64_t, int64_t, int) {
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(ids.size(), 3u);
}

}  // namespace
}  // namespace ellm

namespace ellm {
namespace {

// core/cpu_features against the kernel's own account of the CPU.
TEST(CpuFeatures, AgreeWithProcCpuinfo) {
  using ellm::testing::CpuinfoHas;
  const CpuFeatures& cpu = Cpu();
  EXPECT_EQ(cpu.avx2, CpuinfoHas("avx2"));
  EXPECT_EQ(cpu.fma, CpuinfoHas("fma"));
  EXPECT_EQ(cpu.f16c, CpuinfoHas("f16c"));
  EXPECT_EQ(cpu.avx_vnni, CpuinfoHas("avx_vnni"));
  EXPECT_EQ(cpu.avx512f, CpuinfoHas("avx512f"));
  EXPECT_EQ(cpu.avx512bw, CpuinfoHas("avx512bw"));
  EXPECT_EQ(cpu.avx512vl, CpuinfoHas("avx512vl"));
  EXPECT_EQ(cpu.avx512dq, CpuinfoHas("avx512dq"));
  EXPECT_EQ(cpu.avx512_vnni, CpuinfoHas("avx512_vnni"));
  EXPECT_EQ(cpu.avx512_vbmi, CpuinfoHas("avx512vbmi"));
  EXPECT_EQ(cpu.avx512_bf16, CpuinfoHas("avx512_bf16"));
  EXPECT_EQ(cpu.amx_bf16, CpuinfoHas("amx_bf16"));
  EXPECT_EQ(cpu.amx_tile, CpuinfoHas("amx_tile"));
  EXPECT_EQ(cpu.amx_int8, CpuinfoHas("amx_int8"));
}

}  // namespace
}  // namespace ellm
