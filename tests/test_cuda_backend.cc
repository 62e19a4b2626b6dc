// GPU tests (label gpu): every CUDA kernel against its CPU reference on fresh
// random inputs at awkward sizes, the cuBLAS product against a double
// reference, and the whole CUDA backend against the CPU backend on random
// models (llama and qwen2 layouts, host and direct ring I/O, with and without
// CUDA graphs), including a StepRunner over real rings with stand-in
// attention workers. Without a visible device every test skips.
//
// Error budgets: kernels that reproduce a reference's float operations are
// held to ~1e-6 relative (they differ only in summation order or an ulp of
// expf/cos/sin); bf16 results to one bf16 ulp; the backend, whose weights are
// bf16 where the CPU's are fp32, to ||cuda - cpu|| / ||cpu|| < 2e-2 per layer
// output and 3e-2 for the logits (measured bf16 rounding is ~4e-3 per product).
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/kernels.h"
#include "core/model_config.h"
#include "core/model_maker.h"
#include "core/rope.h"
#include "core/weights.h"
#include "gtest/gtest.h"
#include "mlp-worker/backend.h"
#include "mlp-worker/cuda/cuda_backend.h"
#include "mlp-worker/cuda/cuda_util.h"
#include "mlp-worker/cuda/kernels.h"
#include "mlp-worker/step_runner.h"
#include "shm/channel.h"
#include "shm/messages.h"

namespace ellm::mlp {
namespace {

using cuda::bf16_t;
using cuda::DeviceArray;

#define CUDA_ASSERT_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

std::vector<float> Uniform(size_t n, float lo, float hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

template <typename T>
DeviceArray<T> ToDevice(const std::vector<T>& v) {
  auto a = DeviceArray<T>::Alloc(v.size());
  EXPECT_TRUE(a.ok()) << a.status();
  if (!a.ok()) return DeviceArray<T>();
  EXPECT_EQ(cudaMemcpy(a->get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  // The copy ran on the legacy stream, which the tests' non-blocking stream
  // does not wait for.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return std::move(*a);
}

// An output buffer filled with 0xFF bytes (NaN as float and as bf16), so an
// element the kernel does not write fails the comparison.
template <typename T>
DeviceArray<T> Poisoned(size_t n) {
  auto a = DeviceArray<T>::Alloc(n);
  EXPECT_TRUE(a.ok()) << a.status();
  if (!a.ok()) return DeviceArray<T>();
  EXPECT_EQ(cudaMemset(a->get(), 0xFF, n * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return std::move(*a);
}

template <typename T>
std::vector<T> ToHost(const DeviceArray<T>& a, cudaStream_t stream) {
  std::vector<T> v(a.size());
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(v.data(), a.get(), a.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

std::vector<float> Bf16ToFloats(const std::vector<bf16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = Bf16ToFloat(v[i]);
  return f;
}

std::vector<float> RoundToBf16(const std::vector<float>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = Bf16ToFloat(FloatToBf16(v[i]));
  return f;
}

// ||a - b|| / ||b||; infinity when sizes differ or anything is not finite.
double RelError(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Every element within rel * |b| + abs of b (and finite).
void ExpectClose(const std::vector<float>& a, const std::vector<float>& b, double rel, double abs,
                 const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool ok = std::isfinite(a[i]) && std::abs(static_cast<double>(a[i]) - b[i]) <=
                                               rel * std::abs(b[i]) + abs;
    if (!ok && ++bad <= 5) {
      ADD_FAILURE() << what << ": element " << i << " is " << a[i] << ", expected " << b[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << a.size() << " elements differ";
}

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaDeviceAvailable(&why)) GTEST_SKIP() << "no CUDA device: " << why;
    CUDA_ASSERT_OK(cudaSetDevice(0));
    auto s = cuda::MakeStream();
    ASSERT_TRUE(s.ok()) << s.status();
    stream_ = std::move(*s);
  }
  cudaStream_t stream() const { return stream_.get(); }

  std::mt19937_64 rng_{std::random_device{}()};
  cuda::StreamOwner stream_;
};

// --- Kernels against core/kernels.h ---

TEST_F(CudaTest, RmsNormMatchesReference) {
  for (int dim : {1, 3, 17, 129, 4097, 5120}) {
    const int rows_in = 3;
    std::vector<float> x = Uniform(static_cast<size_t>(rows_in) * dim, -3, 3, rng_);
    std::vector<float> w = Uniform(dim, 0.5f, 1.5f, rng_);
    const float eps = 1e-6f;
    std::vector<int32_t> rows = {2, 0, 2, 1};
    const int n = static_cast<int>(rows.size());
    std::vector<float> ref(static_cast<size_t>(n) * dim);
    for (int r = 0; r < n; ++r) {
      RmsNorm(x.data() + static_cast<size_t>(rows[r]) * dim, w.data(), ref.data() + r * dim, dim, eps);
    }
    auto dx = ToDevice(x);
    auto dw = ToDevice(w);
    auto drows = ToDevice(rows);
    auto out = Poisoned<float>(ref.size());
    auto out16 = Poisoned<bf16_t>(ref.size());
    CUDA_ASSERT_OK(cuda::LaunchRmsNorm(dx.get(), drows.get(), dw.get(), out.get(), n, dim, eps, stream()));
    CUDA_ASSERT_OK(cuda::LaunchRmsNorm(dx.get(), drows.get(), dw.get(), out16.get(), n, dim, eps, stream()));
    ExpectClose(ToHost(out, stream()), ref, 1e-6, 1e-30, absl::StrCat("rmsnorm dim ", dim));
    ExpectClose(Bf16ToFloats(ToHost(out16, stream())), RoundToBf16(ref), 1.0 / 128, 1e-30,
                absl::StrCat("rmsnorm bf16 dim ", dim));

    // Without a row list: rows 0..n-1.
    std::vector<float> ref_plain(x.size());
    for (int r = 0; r < rows_in; ++r) {
      RmsNorm(x.data() + r * dim, w.data(), ref_plain.data() + r * dim, dim, eps);
    }
    auto plain = Poisoned<float>(x.size());
    CUDA_ASSERT_OK(cuda::LaunchRmsNorm(dx.get(), nullptr, dw.get(), plain.get(), rows_in, dim, eps, stream()));
    ExpectClose(ToHost(plain, stream()), ref_plain, 1e-6, 1e-30, absl::StrCat("rmsnorm rows dim ", dim));
  }
}

struct RopeCase {
  int n_heads, n_kv_heads, head_dim, rope_dims;
  bool neox, bias;
  RopeScalingType scaling = RopeScalingType::kNone;
  bool llama3_factors = false;
  bool qk_norm = false;
};

// LaunchRopeTable + (LaunchQkHeadNorm) + LaunchQkvBiasRope against core's
// QkvPostprocess, for every rope scaling and the qwen3 q/k norms.
TEST_F(CudaTest, QkvBiasRopeMatchesQkvPostprocess) {
  const RopeCase cases[] = {
      {4, 2, 16, 16, false, false}, {4, 2, 16, 16, true, true},  {5, 1, 8, 4, false, true},
      {5, 1, 8, 4, true, false},    {40, 8, 128, 128, true, true}, {32, 8, 128, 128, false, false},
      {3, 3, 6, 2, true, true},
      {32, 8, 128, 128, false, false, RopeScalingType::kNone, true},
      {28, 4, 128, 128, true, true, RopeScalingType::kYarn},
      {8, 2, 64, 64, false, false, RopeScalingType::kLinear},
      {16, 8, 128, 128, true, false, RopeScalingType::kYarn, false, true},
      {4, 2, 16, 16, true, false, RopeScalingType::kNone, false, true},
  };
  for (const RopeCase& rc : cases) {
    ModelConfig c;
    c.n_heads = rc.n_heads;
    c.n_kv_heads = rc.n_kv_heads;
    c.head_dim = rc.head_dim;
    c.rope_dims = rc.rope_dims;
    c.rope_base = rc.neox ? 1e6f : 500000.0f;
    c.rope_neox = rc.neox;
    c.qkv_bias = rc.bias;
    c.qk_norm = rc.qk_norm;
    c.norm_eps = 1e-6f;
    c.rope_scaling.type = rc.scaling;
    c.rope_scaling.factor = 4;
    c.rope_scaling.original_context = 8192;
    if (rc.llama3_factors) c.rope_freq_factors = Llama3RopeFactors(c.rope_dims, c.rope_base, 8, 1, 4, 8192);
    const Rope rope(c);
    const int q_dim = c.q_dim(), kv_dim = c.kv_dim(), cols = q_dim + 2 * kv_dim;
    const int stride = cols + 3;  // rows padded: the kernel must honour the stride
    for (int T : {1, 3, 17}) {
      std::vector<float> qkv = Uniform(static_cast<size_t>(T) * stride, -2, 2, rng_);
      std::vector<int32_t> pos(T);
      std::uniform_int_distribution<int> pd(0, 100000);
      for (int& p : pos) p = pd(rng_);
      pos[0] = 0;
      LayerWeights L;
      std::vector<float> bias = Uniform(cols, -0.5f, 0.5f, rng_);
      L.bq.assign(bias.begin(), bias.begin() + q_dim);
      L.bk.assign(bias.begin() + q_dim, bias.begin() + q_dim + kv_dim);
      L.bv.assign(bias.begin() + q_dim + kv_dim, bias.end());
      std::vector<float> norms = Uniform(2 * c.head_dim, 0.5f, 1.5f, rng_);
      L.q_norm.assign(norms.begin(), norms.begin() + c.head_dim);
      L.k_norm.assign(norms.begin() + c.head_dim, norms.end());
      std::vector<float> ref = qkv, cos_sin(c.rope_dims);
      for (int t = 0; t < T; ++t) {
        float* row = ref.data() + static_cast<size_t>(t) * stride;
        rope.CosSin(pos[t], cos_sin.data());
        QkvPostprocess(c, rope, L, cos_sin.data(), row, row + q_dim, row + q_dim + kv_dim);
      }
      auto dqkv = ToDevice(qkv);
      auto dbias = ToDevice(bias);
      auto dnorms = ToDevice(norms);
      auto dpos = ToDevice(pos);
      auto dfreq = ToDevice(rope.freq());
      auto table = Poisoned<float>(static_cast<size_t>(T) * rc.rope_dims);
      CUDA_ASSERT_OK(cuda::LaunchRopeTable(dpos.get(), T, rope.pairs(), dfreq.get(), rope.mscale(),
                                           table.get(), stream()));
      if (rc.qk_norm) {
        CUDA_ASSERT_OK(cuda::LaunchQkHeadNorm(dqkv.get(), T, stride, c.n_heads, c.n_kv_heads,
                                              c.head_dim, dnorms.get(), dnorms.get() + c.head_dim,
                                              c.norm_eps, stream()));
      }
      cuda::QkvRopeParams p;
      p.qkv = dqkv.get();
      p.n_tokens = T;
      p.row_stride = stride;
      p.bias = rc.bias ? dbias.get() : nullptr;
      p.cos_sin = table.get();
      p.n_heads = c.n_heads;
      p.n_kv_heads = c.n_kv_heads;
      p.head_dim = c.head_dim;
      p.rope_dims = c.rope_dims;
      p.neox = c.rope_neox;
      CUDA_ASSERT_OK(cuda::LaunchQkvBiasRope(p, stream()));
      // cos/sin of CUDA's fp64 functions may differ from libm's in the last
      // fp64 ulp, which after rounding to float moves a result by an ulp at
      // most; the norms' fp64 sums differ in order only.
      ExpectClose(ToHost(dqkv, stream()), ref, 2e-6, 2e-6,
                  absl::StrCat("rope heads ", rc.n_heads, "/", rc.n_kv_heads, " hd ", rc.head_dim,
                               " rope ", rc.rope_dims, rc.neox ? " neox" : " interleaved",
                               rc.bias ? " bias" : "", " scaling ", static_cast<int>(rc.scaling),
                               rc.llama3_factors ? " llama3" : "", rc.qk_norm ? " qk_norm" : "",
                               " T ", T));
    }
  }
}

TEST_F(CudaTest, SwiGluMatchesReference) {
  for (int n : {1, 17, 4097}) {
    const int T = 3;
    std::vector<float> gu(static_cast<size_t>(T) * 2 * n);
    std::vector<float> g = Uniform(gu.size(), -12, 12, rng_);
    std::vector<float> u = Uniform(gu.size(), -2, 2, rng_);
    std::vector<float> ref(static_cast<size_t>(T) * n);
    for (int t = 0; t < T; ++t) {
      std::copy_n(g.data() + t * 2 * n, n, gu.data() + t * 2 * n);
      std::copy_n(u.data() + t * 2 * n, n, gu.data() + t * 2 * n + n);
      SwiGlu(gu.data() + t * 2 * n, gu.data() + t * 2 * n + n, ref.data() + t * n, n);
    }
    auto d = ToDevice(gu);
    auto out = Poisoned<float>(ref.size());
    auto out16 = Poisoned<bf16_t>(ref.size());
    CUDA_ASSERT_OK(cuda::LaunchSwiGlu(d.get(), d.get() + n, 2 * n, out.get(), n, T, n, stream()));
    CUDA_ASSERT_OK(cuda::LaunchSwiGlu(d.get(), d.get() + n, 2 * n, out16.get(), n, T, n, stream()));
    ExpectClose(ToHost(out, stream()), ref, 2e-6, 1e-30, absl::StrCat("swiglu n ", n));
    ExpectClose(Bf16ToFloats(ToHost(out16, stream())), RoundToBf16(ref), 1.0 / 128, 1e-30,
                absl::StrCat("swiglu bf16 n ", n));
  }
}

TEST_F(CudaTest, EmbedAndConvertAreExact) {
  const int vocab = 50, dim = 129;
  std::vector<float> table_f = Uniform(static_cast<size_t>(vocab) * dim, -4, 4, rng_);
  std::vector<bf16_t> table(table_f.size());
  for (size_t i = 0; i < table.size(); ++i) table[i] = FloatToBf16(table_f[i]);
  std::vector<int32_t> tokens = {7, 0, 49, 7, 13};
  const int T = static_cast<int>(tokens.size());
  auto dt = ToDevice(table);
  auto dtok = ToDevice(tokens);
  auto x = Poisoned<float>(static_cast<size_t>(T) * dim);
  CUDA_ASSERT_OK(cuda::LaunchEmbed(dtok.get(), dt.get(), x.get(), T, dim, stream()));
  std::vector<float> ref(static_cast<size_t>(T) * dim);
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < dim; ++i) ref[t * dim + i] = Bf16ToFloat(table[tokens[t] * dim + i]);
  }
  EXPECT_EQ(ToHost(x, stream()), ref);

  // fp32 -> bf16, round to nearest even, ties and extremes included.
  std::vector<float> v = Uniform(100003, -1e4f, 1e4f, rng_);
  v.insert(v.end(), {0.0f, -0.0f, 1.00390625f, 1.01171875f, 3.0e38f, -3.0e38f, 1e-40f, INFINITY});
  auto dv = ToDevice(v);
  auto out = Poisoned<bf16_t>(v.size());
  CUDA_ASSERT_OK(cuda::LaunchF32ToBf16(dv.get(), out.get(), static_cast<int64_t>(v.size()), stream()));
  std::vector<bf16_t> got = ToHost(out, stream());
  int bad = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (got[i] != FloatToBf16(v[i]) && ++bad <= 5) {
      ADD_FAILURE() << "bf16(" << v[i] << ") = " << got[i] << ", expected " << FloatToBf16(v[i]);
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST_F(CudaTest, GemmMatchesDoubleReference) {
  auto handle_raw = [] {
    cublasHandle_t h = nullptr;
    return cublasCreate(&h) == CUBLAS_STATUS_SUCCESS ? h : nullptr;
  }();
  ASSERT_NE(handle_raw, nullptr);
  cuda::CublasOwner handle(handle_raw);
  ASSERT_EQ(cublasSetStream(handle.get(), stream()), CUBLAS_STATUS_SUCCESS);
  struct Shape {
    int n_out, k, T;
  };
  for (const Shape& s : {Shape{1, 1, 1}, Shape{17, 129, 3}, Shape{256, 4097, 1},
                         Shape{1000, 512, 64}, Shape{129, 64, 17}, Shape{5120, 5120, 8}}) {
    std::vector<float> w = RoundToBf16(Uniform(static_cast<size_t>(s.n_out) * s.k, -1, 1, rng_));
    std::vector<float> x = RoundToBf16(Uniform(static_cast<size_t>(s.T) * s.k, -1, 1, rng_));
    std::vector<float> y0 = Uniform(static_cast<size_t>(s.T) * s.n_out, -1, 1, rng_);
    std::vector<bf16_t> w16(w.size()), x16(x.size());
    for (size_t i = 0; i < w.size(); ++i) w16[i] = FloatToBf16(w[i]);
    for (size_t i = 0; i < x.size(); ++i) x16[i] = FloatToBf16(x[i]);
    auto dw = ToDevice(w16);
    auto dx = ToDevice(x16);
    for (float beta : {0.0f, 1.0f}) {
      std::vector<float> ref(y0.size());
      for (int t = 0; t < s.T; ++t) {
        for (int r = 0; r < s.n_out; ++r) {
          double acc = beta * y0[static_cast<size_t>(t) * s.n_out + r];
          for (int i = 0; i < s.k; ++i) {
            acc += static_cast<double>(w[static_cast<size_t>(r) * s.k + i]) * x[static_cast<size_t>(t) * s.k + i];
          }
          ref[static_cast<size_t>(t) * s.n_out + r] = static_cast<float>(acc);
        }
      }
      DeviceArray<float> y = beta == 0 ? Poisoned<float>(y0.size()) : ToDevice(y0);
      absl::Status st = cuda::GemmBf16(handle.get(), dw.get(), s.n_out, s.k, dx.get(), s.T, y.get(), beta);
      ASSERT_TRUE(st.ok()) << st;
      const double err = RelError(ToHost(y, stream()), ref);
      EXPECT_LT(err, 1e-5) << "gemm " << s.n_out << "x" << s.k << " T " << s.T << " beta " << beta;
    }
  }
}

TEST_F(CudaTest, RandomFillIsDeterministicAndInRange) {
  const int64_t n = 1000003;
  auto a = Poisoned<bf16_t>(n);
  auto b = Poisoned<bf16_t>(n);
  auto f = Poisoned<float>(n);
  CUDA_ASSERT_OK(cuda::LaunchFillRandom(a.get(), n, 42, 0.5f, stream()));
  CUDA_ASSERT_OK(cuda::LaunchFillRandom(b.get(), n, 42, 0.5f, stream()));
  CUDA_ASSERT_OK(cuda::LaunchFillRandom(f.get(), n, 43, 1.0f, 0.1f, stream()));
  std::vector<bf16_t> ha = ToHost(a, stream());
  EXPECT_EQ(ha, ToHost(b, stream()));
  double sum = 0, sq = 0;
  for (bf16_t v : ha) {
    const float x = Bf16ToFloat(v);
    ASSERT_TRUE(std::isfinite(x));
    ASSERT_LE(std::abs(x), 0.5f);
    sum += x;
    sq += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sq / n, 0.25 / 3, 0.01);  // uniform on [-a, a]: variance a^2 / 3
  for (float x : ToHost(f, stream())) {
    ASSERT_GE(x, 0.9f);
    ASSERT_LE(x, 1.1f);
  }
}

// Page-aligned host memory, freed with free().
struct HostBlock {
  explicit HostBlock(size_t bytes) : bytes((bytes + 4095) / 4096 * 4096) {
    data = static_cast<float*>(std::aligned_alloc(4096, this->bytes));
  }
  ~HostBlock() { std::free(data); }
  size_t bytes;
  float* data;
};

TEST_F(CudaTest, ScatterAndGatherThroughMappedHostMemory) {
  const int n_heads = 8, n_kv = 4, hd = 16, T = 5;
  const int g = n_heads / n_kv, q_dim = n_heads * hd, kv_dim = n_kv * hd, cols = q_dim + 2 * kv_dim;
  const int bounds[] = {0, 1, 4};  // shards: KV heads [0, 1) and [1, 4)
  std::vector<float> qkv = Uniform(static_cast<size_t>(T) * cols, -1, 1, rng_);
  auto dqkv = ToDevice(qkv);
  HostBlock block(static_cast<size_t>(T) * (cols + q_dim) * sizeof(float) * 2);
  std::fill_n(reinterpret_cast<uint8_t*>(block.data), block.bytes, 0xFF);
  auto reg = cuda::HostRegistration::Create(block.data, block.bytes);
  ASSERT_TRUE(reg.ok()) << reg.status();
  cuda::ShardCopyParams p;
  p.n_shards = 2;
  p.n_tokens = T;
  p.n_heads = n_heads;
  p.n_kv_heads = n_kv;
  p.head_dim = hd;
  std::vector<float*> hq(2), hk(2), hv(2), ha(2);
  float* cursor = block.data;
  for (int s = 0; s < 2; ++s) {
    const int kvh = bounds[s + 1] - bounds[s];
    hq[s] = cursor;
    cursor += T * kvh * g * hd;
    hk[s] = cursor;
    cursor += T * kvh * hd;
    hv[s] = cursor;
    cursor += T * kvh * hd;
    ha[s] = cursor;
    cursor += T * kvh * g * hd;
    for (int i = 0; i < T * kvh * g * hd; ++i) ha[s][i] = static_cast<float>(rng_() % 1000) / 7.0f;
    p.shard[s].kv_head_begin = bounds[s];
    p.shard[s].kv_head_end = bounds[s + 1];
    p.shard[s].q = static_cast<float*>((*reg)->DevicePointer(hq[s]));
    p.shard[s].k = static_cast<float*>((*reg)->DevicePointer(hk[s]));
    p.shard[s].v = static_cast<float*>((*reg)->DevicePointer(hv[s]));
    p.shard[s].attn = static_cast<const float*>((*reg)->DevicePointer(ha[s]));
  }
  CUDA_ASSERT_OK(cuda::LaunchScatterQkv(p, dqkv.get(), cols, stream()));
  auto attn = Poisoned<bf16_t>(static_cast<size_t>(T) * q_dim);
  CUDA_ASSERT_OK(cuda::LaunchGatherAttn(p, attn.get(), stream()));
  CUDA_ASSERT_OK(cudaStreamSynchronize(stream()));
  std::vector<bf16_t> got = ToHost(attn, stream());
  for (int s = 0; s < 2; ++s) {
    const int b = bounds[s], kvh = bounds[s + 1] - b;
    for (int t = 0; t < T; ++t) {
      const float* row = qkv.data() + static_cast<size_t>(t) * cols;
      for (int i = 0; i < kvh * g * hd; ++i) {
        ASSERT_EQ(hq[s][t * kvh * g * hd + i], row[b * g * hd + i]) << "q shard " << s;
        ASSERT_EQ(got[static_cast<size_t>(t) * q_dim + b * g * hd + i],
                  FloatToBf16(ha[s][t * kvh * g * hd + i]))
            << "attn shard " << s;
      }
      for (int i = 0; i < kvh * hd; ++i) {
        ASSERT_EQ(hk[s][t * kvh * hd + i], row[q_dim + b * hd + i]) << "k shard " << s;
        ASSERT_EQ(hv[s][t * kvh * hd + i], row[q_dim + kv_dim + b * hd + i]) << "v shard " << s;
      }
    }
  }
}

// --- The backend against the CPU backend ---

ModelConfig TinyConfig(bool qwen2, int rope_dims = 16) {
  ModelConfig c;
  c.arch = qwen2 ? "qwen2" : "llama";
  c.n_layers = 3;
  c.dim = 128;
  c.ffn_dim = 320;
  c.n_heads = 8;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  c.rope_dims = rope_dims;
  c.rope_base = qwen2 ? 1e6f : 10000.0f;
  c.norm_eps = 1e-6f;
  c.context_length = 4096;
  c.vocab_size = 300;
  c.rope_neox = qwen2;
  c.qkv_bias = qwen2;
  return c;
}

ModelWeights RandomWeights(const ModelConfig& c, uint64_t seed, bool tied) {
  std::mt19937_64 rng(seed);
  auto proj = [&](int rows, int fan_in) {
    const float a = std::sqrt(3.0f / fan_in);
    return Uniform(static_cast<size_t>(rows) * fan_in, -a, a, rng);
  };
  ModelWeights w;
  w.config = c;
  w.token_embd = Uniform(static_cast<size_t>(c.vocab_size) * c.dim, -1, 1, rng);
  w.layers.resize(c.n_layers);
  for (LayerWeights& L : w.layers) {
    L.attn_norm = Uniform(c.dim, 0.9f, 1.1f, rng);
    L.wq = proj(c.q_dim(), c.dim);
    L.wk = proj(c.kv_dim(), c.dim);
    L.wv = proj(c.kv_dim(), c.dim);
    if (c.qkv_bias) {
      L.bq = Uniform(c.q_dim(), -0.1f, 0.1f, rng);
      L.bk = Uniform(c.kv_dim(), -0.1f, 0.1f, rng);
      L.bv = Uniform(c.kv_dim(), -0.1f, 0.1f, rng);
    }
    L.wo = proj(c.dim, c.q_dim());
    L.ffn_norm = Uniform(c.dim, 0.9f, 1.1f, rng);
    L.w_gate = proj(c.ffn_dim, c.dim);
    L.w_up = proj(c.ffn_dim, c.dim);
    L.w_down = proj(c.dim, c.ffn_dim);
  }
  w.output_norm = Uniform(c.dim, 0.9f, 1.1f, rng);
  w.output = tied ? w.token_embd : proj(c.vocab_size, c.dim);
  return w;
}

enum class Io { kHost, kDirectMapped, kDirectUnregistered };

struct BackendCase {
  bool qwen2;
  int rope_dims;
  bool tied;
  bool graphs;
  Io io;
};

std::string Describe(const BackendCase& bc) {
  const char* io = bc.io == Io::kHost ? "host" : bc.io == Io::kDirectMapped ? "mapped" : "unregistered";
  return absl::StrCat(bc.qwen2 ? "qwen2" : "llama", " rope ", bc.rope_dims, bc.tied ? " tied" : "",
                      bc.graphs ? " graphs" : "", " io ", io);
}

// Runs steps through both backends, giving both the same attention output
// (the CPU's q: deterministic and of realistic size), and compares q, k, v of
// every layer and the logits.
void CompareWithCpu(const BackendCase& bc, std::mt19937_64& rng) {
  SCOPED_TRACE(Describe(bc));
  const ModelConfig c = TinyConfig(bc.qwen2, bc.rope_dims);
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  const int max_tokens = 24;
  ModelWeights w = RandomWeights(c, rng(), bc.tied);
  auto cpu = CreateCpuBackend(w, max_tokens, 2);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  CudaBackendOptions options;
  options.use_graphs = bc.graphs;
  options.graph_max_tokens = 16;
  options.mapped_ring_io = bc.io == Io::kDirectMapped;
  int last_done = 0;
  options.progress = [&](int64_t done, int64_t total) {
    EXPECT_EQ(done, last_done + 1);
    last_done = done;
  };
  auto gpu = CreateCudaBackend(w, max_tokens, options);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ(last_done, 3 + (c.qkv_bias ? 12 : 9) * c.n_layers);

  // Two attention shards: KV heads [0, 1) and [1, 2), as on a two-socket server.
  const int bounds[] = {0, 1, 2};
  const int hd = c.head_dim, g = c.gqa_ratio();
  HostBlock block(static_cast<size_t>(max_tokens) * (2 * c.q_dim() + 2 * c.kv_dim()) * sizeof(float));
  if (bc.io == Io::kDirectMapped) {
    absl::Status st = (*gpu)->RegisterHostMemory(block.data, block.bytes);
    ASSERT_TRUE(st.ok()) << st;
  }

  // Three steps of each size: graphs are captured on a step's second use and replayed on the third.
  for (int T : {1, 1, 1, 5, 5, 5, 24}) {
    SCOPED_TRACE(absl::StrCat("T = ", T));
    std::vector<int32_t> tokens(T), positions(T);
    for (int t = 0; t < T; ++t) {
      tokens[t] = static_cast<int32_t>(rng() % c.vocab_size);
      positions[t] = static_cast<int32_t>(rng() % 3000);
    }
    ASSERT_TRUE((*cpu)->BeginStep(tokens.data(), positions.data(), T).ok());
    absl::Status st = (*gpu)->BeginStep(tokens.data(), positions.data(), T);
    ASSERT_TRUE(st.ok()) << st;
    std::vector<float> q(static_cast<size_t>(T) * c.q_dim()), k(static_cast<size_t>(T) * c.kv_dim()),
        v(k.size());
    for (int layer = 0; layer < c.n_layers; ++layer) {
      SCOPED_TRACE(absl::StrCat("layer ", layer));
      ASSERT_TRUE(ComputeQkv(**cpu, c.n_kv_heads, layer, q.data(), k.data(), v.data()).ok());
      std::vector<float> gq(q.size(), NAN), gk(k.size(), NAN), gv(v.size(), NAN);
      std::vector<MlpBackend::ShardIo> io(2);
      if (bc.io == Io::kHost) {
        st = ComputeQkv(**gpu, c.n_kv_heads, layer, gq.data(), gk.data(), gv.data());
        ASSERT_TRUE(st.ok()) << st;
      } else {
        std::fill_n(reinterpret_cast<uint8_t*>(block.data), block.bytes, 0xFF);
        float* cursor = block.data;
        for (int s = 0; s < 2; ++s) {
          const int kvh = bounds[s + 1] - bounds[s];
          io[s].heads = {bounds[s], bounds[s + 1]};
          io[s].q = cursor;
          cursor += T * kvh * g * hd;
          io[s].k = cursor;
          cursor += T * kvh * hd;
          io[s].v = cursor;
          cursor += T * kvh * hd;
          io[s].attn = cursor;
          cursor += T * kvh * g * hd;
        }
        st = (*gpu)->StageQkv(layer);
        ASSERT_TRUE(st.ok()) << st;
        st = (*gpu)->WriteQkvShards(io.data(), 2);
        ASSERT_TRUE(st.ok()) << st;
        // Back to the whole-model layout of ComputeQkv.
        for (int s = 0; s < 2; ++s) {
          const int b = bounds[s], kvh = bounds[s + 1] - b;
          for (int t = 0; t < T; ++t) {
            std::copy_n(io[s].q + t * kvh * g * hd, kvh * g * hd, gq.data() + t * c.q_dim() + b * g * hd);
            std::copy_n(io[s].k + t * kvh * hd, kvh * hd, gk.data() + t * c.kv_dim() + b * hd);
            std::copy_n(io[s].v + t * kvh * hd, kvh * hd, gv.data() + t * c.kv_dim() + b * hd);
          }
        }
      }
      EXPECT_LT(RelError(gq, q), 2e-2);
      EXPECT_LT(RelError(gk, k), 2e-2);
      EXPECT_LT(RelError(gv, v), 2e-2);

      const std::vector<float>& attn = q;  // the same stand-in attention output for both
      ASSERT_TRUE(CompleteLayer(**cpu, c.n_kv_heads, layer, attn.data()).ok());
      if (bc.io == Io::kHost) {
        st = CompleteLayer(**gpu, c.n_kv_heads, layer, attn.data());
      } else {
        for (int s = 0; s < 2; ++s) {
          const int b = bounds[s], kvh = bounds[s + 1] - b;
          float* dst = const_cast<float*>(io[s].attn);
          for (int t = 0; t < T; ++t) {
            std::copy_n(attn.data() + t * c.q_dim() + b * g * hd, kvh * g * hd, dst + t * kvh * g * hd);
          }
        }
        st = (*gpu)->CompleteLayerFromShards(layer, io.data(), 2);
      }
      ASSERT_TRUE(st.ok()) << st;
    }
    std::vector<int32_t> rows;
    for (int t = T - 1; t >= 0; t -= 2) rows.push_back(t);
    const int n = static_cast<int>(rows.size());
    std::vector<float> logits(static_cast<size_t>(n) * c.vocab_size),
        glogits(logits.size(), NAN);
    ASSERT_TRUE((*cpu)->ComputeLogits(rows.data(), n, logits.data()).ok());
    st = (*gpu)->ComputeLogits(rows.data(), n, glogits.data());
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_LT(RelError(glogits, logits), 3e-2);
  }
  if (bc.io == Io::kDirectMapped) (*gpu)->UnregisterHostMemory(block.data);
}

TEST_F(CudaTest, BackendMatchesCpuBackend) {
  const BackendCase cases[] = {
      {false, 16, false, false, Io::kHost},
      {true, 16, false, false, Io::kHost},
      {true, 8, true, false, Io::kHost},
      {false, 8, true, false, Io::kDirectMapped},
      {true, 16, false, false, Io::kDirectMapped},
      {true, 16, false, false, Io::kDirectUnregistered},
      {false, 16, false, true, Io::kHost},
      {true, 16, false, true, Io::kDirectMapped},
      {false, 16, true, true, Io::kDirectUnregistered},
  };
  for (const BackendCase& bc : cases) {
    CompareWithCpu(bc, rng_);
    if (HasFatalFailure()) return;
  }
}

// Graph replays launch the kernels of the direct launches: the same results
// (bit for bit unless cuBLAS picks another algorithm under capture).
TEST_F(CudaTest, GraphsGiveTheSameResults) {
  const ModelConfig c = TinyConfig(true);
  const ModelWeights w = RandomWeights(c, rng_(), false);
  CudaBackendOptions eager_options, graph_options;
  graph_options.use_graphs = true;
  auto eager = CreateCudaBackend(w, 8, eager_options);
  auto graphed = CreateCudaBackend(w, 8, graph_options);
  ASSERT_TRUE(eager.ok()) << eager.status();
  ASSERT_TRUE(graphed.ok()) << graphed.status();
  EXPECT_NE((*graphed)->name().find("graphs"), std::string::npos) << (*graphed)->name();
  std::vector<int32_t> tokens = {1, 2, 3}, positions = {10, 11, 12};
  std::vector<float> q(3 * c.q_dim()), k(3 * c.kv_dim()), v(k.size());
  std::vector<float> q2(q.size()), k2(k.size()), v2(v.size());
  for (int step = 0; step < 4; ++step) {
    ASSERT_TRUE((*eager)->BeginStep(tokens.data(), positions.data(), 3).ok());
    ASSERT_TRUE((*graphed)->BeginStep(tokens.data(), positions.data(), 3).ok());
    for (int layer = 0; layer < c.n_layers; ++layer) {
      ASSERT_TRUE(ComputeQkv(**eager, c.n_kv_heads, layer, q.data(), k.data(), v.data()).ok());
      absl::Status st = ComputeQkv(**graphed, c.n_kv_heads, layer, q2.data(), k2.data(), v2.data());
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_LT(RelError(q2, q), 1e-6) << "step " << step << " layer " << layer;
      EXPECT_LT(RelError(k2, k), 1e-6) << "step " << step << " layer " << layer;
      EXPECT_LT(RelError(v2, v), 1e-6) << "step " << step << " layer " << layer;
      ASSERT_TRUE(CompleteLayer(**eager, c.n_kv_heads, layer, q.data()).ok());
      ASSERT_TRUE(CompleteLayer(**graphed, c.n_kv_heads, layer, q.data()).ok());
    }
    std::vector<int32_t> rows = {0, 2};
    std::vector<float> l1(2 * c.vocab_size), l2(l1.size());
    ASSERT_TRUE((*eager)->ComputeLogits(rows.data(), 2, l1.data()).ok());
    ASSERT_TRUE((*graphed)->ComputeLogits(rows.data(), 2, l2.data()).ok());
    EXPECT_LT(RelError(l2, l1), 1e-6) << "step " << step;
  }
}

TEST_F(CudaTest, RejectsBadInput) {
  const ModelConfig c = TinyConfig(false);
  auto gpu = CreateCudaBackend(RandomWeights(c, 1, false), 4, CudaBackendOptions());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  std::vector<int32_t> tokens = {1, 2, 3, 4, 5}, positions = {0, 1, 2, 3, 4};
  EXPECT_EQ((*gpu)->BeginStep(tokens.data(), positions.data(), 5).code(),
            absl::StatusCode::kInvalidArgument);
  tokens[0] = c.vocab_size;
  EXPECT_EQ((*gpu)->BeginStep(tokens.data(), positions.data(), 2).code(),
            absl::StatusCode::kInvalidArgument);
  tokens[0] = 0;
  ASSERT_TRUE((*gpu)->BeginStep(tokens.data(), positions.data(), 2).ok());
  EXPECT_EQ((*gpu)->StageQkv(c.n_layers).code(), absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> rows = {2};
  std::vector<float> logits(c.vocab_size);
  EXPECT_EQ((*gpu)->ComputeLogits(rows.data(), 1, logits.data()).code(),
            absl::StatusCode::kInvalidArgument);
  MlpBackend::ShardIo io;  // covers nothing
  ASSERT_TRUE((*gpu)->StageQkv(0).ok());
  EXPECT_EQ((*gpu)->WriteQkvShards(&io, 1).code(), absl::StatusCode::kInvalidArgument);

  // Weights that do not match the config.
  ModelWeights bad = RandomWeights(c, 2, false);
  bad.layers[1].w_up.pop_back();
  auto rejected = CreateCudaBackend(std::move(bad), 4, CudaBackendOptions());
  EXPECT_EQ(rejected.status().code(), absl::StatusCode::kInvalidArgument) << rejected.status();
  EXPECT_NE(rejected.status().message().find("blk.1.ffn_up"), absl::string_view::npos)
      << rejected.status();

  CudaBackendOptions missing;
  missing.device = 1000;
  auto none = CreateCudaBackend(RandomWeights(c, 3, false), 4, missing);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable) << none.status();
}

// Without a device too: the per-token kernels' grids hold 65535 tokens on
// their y axis, so a larger step is refused when the backend is made (it
// failed every such step with cudaErrorInvalidConfiguration).
TEST(CudaBackendLimits, AStepOverTheGridsYExtentIsRefusedUpFront) {
  auto too_many = CreateCudaBackend(RandomWeights(TinyConfig(false), 1, false), 65536, CudaBackendOptions());
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument) << too_many.status();
  EXPECT_NE(too_many.status().message().find("65535"), absl::string_view::npos) << too_many.status();
}

TEST_F(CudaTest, RandomBackendRuns) {
  ModelConfig c = TinyConfig(true);
  c.n_layers = 2;
  auto gpu = CreateCudaBackendRandom(c, 7, 8, CudaBackendOptions());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  std::vector<int32_t> tokens = {5, 6}, positions = {0, 1};
  ASSERT_TRUE((*gpu)->BeginStep(tokens.data(), positions.data(), 2).ok());
  std::vector<float> q(2 * c.q_dim()), k(2 * c.kv_dim()), v(k.size());
  for (int layer = 0; layer < c.n_layers; ++layer) {
    ASSERT_TRUE(ComputeQkv(**gpu, c.n_kv_heads, layer, q.data(), k.data(), v.data()).ok());
    for (float x : q) ASSERT_TRUE(std::isfinite(x));
    ASSERT_TRUE(CompleteLayer(**gpu, c.n_kv_heads, layer, q.data()).ok());
  }
  std::vector<int32_t> rows = {1};
  std::vector<float> logits(c.vocab_size);
  ASSERT_TRUE((*gpu)->ComputeLogits(rows.data(), 1, logits.data()).ok());
  float lo = logits[0], hi = logits[0];
  for (float x : logits) {
    ASSERT_TRUE(std::isfinite(x));
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  EXPECT_GT(hi - lo, 1e-3f);
}

// --- StepRunner over real rings, with stand-in attention workers ---

// An attention worker on a thread: creates its channel and answers every
// request with out = q (a stand-in for attention, exact to check), or an
// error frame for a request it cannot decode.
class EchoAttention {
 public:
  EchoAttention(const ModelConfig& c, int kv_begin, int kv_end, int max_seqs, int max_tokens)
      : shape_{(kv_end - kv_begin) * c.gqa_ratio(), kv_end - kv_begin, c.head_dim} {
    static int counter = 0;
    name_ = absl::StrCat("ellm-test-cuda-", getpid(), "-", counter++);
    auto channel = shm::Channel::Create(
        name_, 2, sizeof(shm::FrameHeader) + shape_.RequestBytes(max_seqs, max_tokens),
        sizeof(shm::FrameHeader) + shape_.ResultBytes(max_tokens));
    status_ = channel.status();
    if (!channel.ok()) return;
    channel_ = std::move(*channel);
    thread_ = std::thread([this] { Serve(); });
  }
  ~EchoAttention() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  const absl::Status& status() const { return status_; }
  const std::string& name() const { return name_; }
  int requests() const { return requests_.load(); }

 private:
  void Serve() {
    shm::WaitOptions wait;
    wait.peer_alive = [this] { return !stop_.load(); };
    std::vector<shm::SeqSlice> slices;
    while (!stop_) {
      absl::StatusOr<shm::Ring::Frame> frame = channel_->requests().BeginRead(wait);
      if (!frame.ok()) continue;
      ++requests_;  // before the reply, so the count is final once the reply is read
      const shm::FrameHeader h = frame->header;
      absl::StatusOr<shm::AttnRequestView> view =
          shm::DecodeAttnRequest(h, frame->payload, shape_, 1 << 20, &slices);
      absl::StatusOr<uint8_t*> slot = channel_->replies().BeginWrite(wait);
      if (slot.ok()) {
        if (view.ok()) {
          std::memcpy(*slot, view->q, shape_.ResultBytes(h.n_tokens));
          shm::FrameHeader reply;
          reply.kind = static_cast<uint16_t>(shm::FrameKind::kAttnResult);
          reply.step = h.step;
          reply.layer = h.layer;
          reply.n_seqs = h.n_seqs;
          reply.n_tokens = h.n_tokens;
          reply.payload_bytes = shape_.ResultBytes(h.n_tokens);
          channel_->replies().CommitWrite(reply);
        } else {
          const std::string message(view.status().message());
          std::memcpy(*slot, message.data(), message.size());
          channel_->replies().CommitWrite(shm::ErrorHeader(h.step, view.status(), message.size()));
        }
      }
      channel_->requests().EndRead();
    }
  }

  shm::AttnShape shape_;
  std::string name_;
  absl::Status status_;
  std::unique_ptr<shm::Channel> channel_;
  std::atomic<bool> stop_{false};
  std::atomic<int> requests_{0};
  std::thread thread_;
};

TEST_F(CudaTest, StepRunnerWithDirectRingIo) {
  const ModelConfig c = TinyConfig(true);
  const int max_tokens = 16, max_seqs = 4;
  const ModelWeights w = RandomWeights(c, rng_(), false);
  shm::StepPlan plan;
  auto seq = [](uint64_t id, uint32_t start, uint32_t n, bool sample) {
    shm::PlanSeq s;
    s.slice = {id, start, n};
    s.sample = sample ? 1 : 0;
    s.temperature = 0;  // greedy
    return s;
  };
  plan.seqs = {seq(1, 0, 4, true), seq(2, 10, 1, true), seq(3, 3, 2, false)};
  plan.tokens = {11, 12, 13, 14, 200, 7, 8};

  std::vector<std::vector<shm::SampledSeq>> results;
  for (bool use_gpu : {false, true}) {
    SCOPED_TRACE(use_gpu ? "cuda" : "cpu");
    EchoAttention a0(c, 0, 1, max_seqs, max_tokens), a1(c, 1, 2, max_seqs, max_tokens);
    ASSERT_TRUE(a0.status().ok()) << a0.status();
    ASSERT_TRUE(a1.status().ok()) << a1.status();
    auto ch0 = shm::Channel::Open(a0.name(), absl::Seconds(5));
    auto ch1 = shm::Channel::Open(a1.name(), absl::Seconds(5));
    ASSERT_TRUE(ch0.ok()) << ch0.status();
    ASSERT_TRUE(ch1.ok()) << ch1.status();
    auto backend = use_gpu ? CreateCudaBackend(w, max_tokens, CudaBackendOptions())
                           : CreateCpuBackend(w, max_tokens, 1);
    ASSERT_TRUE(backend.ok()) << backend.status();
    {
      auto runner = StepRunner::Create(c, backend->get(),
                                       {{0, {0, 1}, ch0->get()}, {1, {1, 2}, ch1->get()}}, max_tokens);
      ASSERT_TRUE(runner.ok()) << runner.status();
      (*runner)->shard_timeout = absl::Seconds(30);
      for (uint64_t step = 1; step <= 3; ++step) {
        auto out = (*runner)->Run(step, plan);
        ASSERT_TRUE(out.ok()) << out.status();
        ASSERT_EQ(out->size(), 2u);
        EXPECT_EQ((*out)[0].seq_id, 1u);
        EXPECT_EQ((*out)[1].seq_id, 2u);
        if (step == 1) results.push_back(*out);
      }
    }
    EXPECT_EQ(a0.requests(), 3 * c.n_layers);
    EXPECT_EQ(a1.requests(), 3 * c.n_layers);
  }
  ASSERT_EQ(results.size(), 2u);
  // Greedy tokens agree unless two logits are within the bf16 error; then the
  // log-probabilities still must be close.
  for (int i = 0; i < 2; ++i) {
    const shm::SampledSeq& cpu = results[0][i];
    const shm::SampledSeq& gpu = results[1][i];
    EXPECT_TRUE(std::isfinite(gpu.logprob));
    EXPECT_NEAR(gpu.logprob, cpu.logprob, 0.1) << "seq " << cpu.seq_id;
    if (gpu.token != cpu.token) {
      std::printf("seq %llu: cpu token %d (logprob %.4f), cuda token %d (logprob %.4f)\n",
                  static_cast<unsigned long long>(cpu.seq_id), cpu.token, cpu.logprob, gpu.token,
                  gpu.logprob);
    }
  }
  EXPECT_TRUE(results[0][0].token == results[1][0].token ||
              results[0][1].token == results[1][1].token)
      << "both greedy tokens differ between the CPU and CUDA backends";
}

// Runs (and passes) without a device: the probe must say why there is none.
TEST(CudaProbe, ExplainsItsAnswer) {
  std::string why;
  const bool available = CudaDeviceAvailable(&why);
  EXPECT_FALSE(why.empty());
  std::printf("CudaDeviceAvailable: %s (%s)\n", available ? "yes" : "no", why.c_str());
}

}  // namespace
}  // namespace ellm::mlp
