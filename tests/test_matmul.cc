// CPU matrix kernels (mlp-worker/cpu/matmul.h): every weight type x every
// kernel set the CPU runs, on random matrices quantised by the reference
// quantisers, at awkward sizes, against an fp64 oracle built from the
// ORIGINAL blocks (Traits(type).dequantize) and the kernels' own int8
// activations; repacking exactness; thread-count independence; the exact
// fp32 path; the CPU backend's native and f32 weight modes on random models.
//
// Error budgets (S = sum_i |a_i| (|w_i| + o_i), a the activations the kernel
// sees, o_i the sub-block offset dmin * m of Q4_K / Q5_K, else 0):
//   int8 types  (nb + 8) * 2^-23 * S, nb = blocks per row: the integer dots
//               are exact; each block adds a few float roundings.
//   F16, BF16   (cols / 2 + 8) * 2^-24 * S: two fp32 FMA chains of cols / 2.
//   F32         bit-identical to core MatVec.
// Against the unquantised activations x (int8 types): additionally
//   sum_i |w_i| * d_b(i) / 2, the activation rounding (half a step per value).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/peak.h"
#include "core/dtype.h"
#include "core/gguf.h"
#include "core/kernels.h"
#include "core/model_maker.h"
#include "core/quants.h"
#include "core/reference_forward.h"
#include "core/read_probe.h"
#include "core/thread_pool.h"
#include "core/topology.h"
#include "core/weights.h"
#include "gtest/gtest.h"
#include "mlp-worker/backend.h"
#include "mlp-worker/cpu/matmul.h"
#include "mlp-worker/cpu/matmul_layout.h"
#include "tests/tests_util.h"

namespace ellm::mlp {
namespace {

constexpr DType kTypes[] = {DType::kF32,  DType::kF16,  DType::kBF16, DType::kQ8_0,
                            DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K};
constexpr int kOuts[] = {1, 3, 17, 129, 300};
constexpr int kTokens[] = {1, 2, 5, 16};

std::string Name(DType t) { return std::string(Traits(t).name); }

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kReference, Isa::kAvx2, Isa::kAvx2Vnni, Isa::kAvx512, Isa::kAmx}) {
    if (MatIsaSupported(isa)) out.push_back(isa);
  }
  return out;
}

// A kernel set as MatMul is asked for it: the isa and q8_act_bits.
struct KernelSet {
  Isa isa;
  int q8_act_bits;
  ActFormat Form(DType type) const { return ActFormatFor(type, isa, q8_act_bits); }
  std::string Name(DType type) const { return KernelName(type, isa, q8_act_bits); }
};

// Every supported set with 8-bit codes, and plain avx2 with 7-bit Q8_0 codes.
std::vector<KernelSet> SupportedSets() {
  std::vector<KernelSet> out;
  for (Isa isa : SupportedIsas()) out.push_back({isa, 8});
  if (MatIsaSupported(Isa::kAvx2)) out.push_back({Isa::kAvx2, 7});
  return out;
}

// Awkward row lengths per type: a single block, an odd number of blocks,
// many blocks (and for the plain types lengths that are no multiple of 8).
std::vector<int64_t> ColsFor(DType t) {
  switch (Traits(t).block_elements) {
    case 1: return {1, 9, 64, 301};
    case 32: return {32, 160, 1088};
    default: return {256, 768, 2560};
  }
}

// A random matrix quantised row by row with the reference quantiser: the
// raw bytes, and each row dequantised by the traits table.
struct TestMatrix {
  DType type;
  int64_t rows, cols;
  std::string raw;
  std::vector<float> deq;     // [rows, cols] as Traits(type).dequantize reads raw
  std::vector<float> offset;  // [rows, cols] |dmin * m| (Q4_K, Q5_K), else 0
};

TestMatrix MakeMatrix(DType type, int64_t rows, int64_t cols, uint64_t seed) {
  const DTypeTraits& tr = Traits(type);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(0.02f, 2.0f);
  TestMatrix m{type, rows, cols, {}, {}, {}};
  const uint64_t row_bytes = *DTypeBytes(type, cols);
  m.raw.resize(row_bytes * rows);
  m.deq.resize(rows * cols);
  m.offset.assign(rows * cols, 0.0f);
  std::vector<float> x(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float s = scale(rng);
    const float shift = 0.3f * normal(rng);  // k-quant sub-blocks with nonzero minimum
    for (float& v : x) v = s * (normal(rng) + shift);
    uint8_t* dst = reinterpret_cast<uint8_t*>(m.raw.data()) + r * row_bytes;
    tr.quantize(x.data(), dst, cols);
    tr.dequantize(dst, m.deq.data() + r * cols, cols);
    if (type == DType::kQ4_K || type == DType::kQ5_K) {
      for (int64_t b = 0; b < cols / kQK_K; ++b) {
        const uint8_t* blk = dst + b * tr.block_bytes;
        uint16_t dmin_h;
        std::memcpy(&dmin_h, blk + 2, 2);  // {d, dmin, scales[12], ...}
        const uint8_t* scales = blk + 4;
        for (int j = 0; j < 8; ++j) {
          uint8_t sc, mn;
          UnpackScaleMinK4(scales, j, &sc, &mn);
          for (int i = 0; i < 32; ++i) {
            m.offset[r * cols + b * kQK_K + 32 * j + i] = std::fabs(HalfToFloat(dmin_h) * mn);
          }
        }
      }
    }
  }
  return m;
}

std::vector<float> RandomActivations(int T, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(T * cols);
  for (float& v : x) v = normal(rng);
  // A few outliers, as real activations have.
  for (int64_t i = 0; i < static_cast<int64_t>(x.size()); i += 97) x[i] *= 12;
  return x;
}

// The activations of form `f` (a kernel set's for its type), dequantised: [T, cols].
std::vector<double> KernelActivations(ActFormat f, Activations& act) {
  const int T = act.tokens();
  const int64_t cols = act.cols();
  std::vector<double> a(T * cols);
  if (f == ActFormat::kF32) {
    for (int64_t i = 0; i < T * cols; ++i) a[i] = act.f32()[i];
    return a;
  }
  const Activations::Q8& q = act.q8(f);
  const int block = q.block;
  for (int t = 0; t < T; ++t) {
    for (int64_t i = 0; i < cols; ++i) {
      a[t * cols + i] = static_cast<double>(q.d[t * (cols / block) + i / block]) * q.codes(t)[i];
    }
  }
  return a;
}

struct Oracle {
  std::vector<double> y;       // [T, rows]
  std::vector<double> budget;  // [T, rows]
};

Oracle ComputeOracle(const TestMatrix& m, const std::vector<double>& a, int T) {
  const int block = Traits(m.type).block_elements;
  const double eps = std::ldexp(1.0, -24);
  const double factor = block == 1 ? (m.cols / 2.0 + 8) * eps : (m.cols / block + 8) * 2 * eps;
  Oracle o{std::vector<double>(T * m.rows), std::vector<double>(T * m.rows)};
  for (int t = 0; t < T; ++t) {
    const double* at = a.data() + t * m.cols;
    for (int64_t r = 0; r < m.rows; ++r) {
      const float* w = m.deq.data() + r * m.cols;
      const float* off = m.offset.data() + r * m.cols;
      double sum = 0, s = 0;
      for (int64_t i = 0; i < m.cols; ++i) {
        sum += static_cast<double>(w[i]) * at[i];
        s += std::fabs(at[i]) * (std::fabs(w[i]) + off[i]);
      }
      o.y[t * m.rows + r] = sum;
      o.budget[t * m.rows + r] = factor * s + 1e-30;
    }
  }
  return o;
}

QuantMatrix Repack(const TestMatrix& m) {
  auto q = QuantMatrix::FromRaw(m.type, m.rows, m.cols,
                                reinterpret_cast<const uint8_t*>(m.raw.data()), m.raw.size());
  EXPECT_TRUE(q.ok()) << q.status();
  return *std::move(q);
}

TEST(MatMulDispatch, PicksASimdKernelOnThisCpu) {
  const Isa best = BestMatIsa();
  std::printf("best kernel set: %s\n", std::string(IsaName(best)).c_str());
  for (DType t : kTypes) std::printf("  %s\n", KernelName(t, best).c_str());
  EXPECT_TRUE(MatIsaSupported(best));
  // What the kernel says the CPU has (/proc/cpuinfo), not what the
  // dispatcher itself reads.
  using ellm::testing::CpuinfoHas;
  const bool avx2 = CpuinfoHas("avx2") && CpuinfoHas("fma") && CpuinfoHas("f16c") && CpuinfoHas("bmi1") &&
                    CpuinfoHas("bmi2");
  EXPECT_EQ(Cpu().bmi1, CpuinfoHas("bmi1"));
  EXPECT_EQ(Cpu().bmi2, CpuinfoHas("bmi2"));
  const bool avx512 = avx2 && CpuinfoHas("avx512_vnni") && CpuinfoHas("avx512bw") &&
                      CpuinfoHas("avx512vl") && CpuinfoHas("avx512dq") && CpuinfoHas("avx512f");
  // AMX also needs Linux's permission (granted by every kernel that lists
  // the flags, 5.16 and later).
  EXPECT_EQ(MatIsaSupported(Isa::kAmx), avx512 && CpuinfoHas("avx512_bf16") && CpuinfoHas("avx512vbmi") &&
                                            CpuinfoHas("amx_tile") && CpuinfoHas("amx_int8") &&
                                            CpuinfoHas("amx_bf16"));
  if (avx512) {  // amx only when asked for: its rounding depends on the step (matmul.h)
    EXPECT_EQ(best, Isa::kAvx512);
  } else if (avx2 && CpuinfoHas("avx_vnni")) {
    EXPECT_EQ(best, Isa::kAvx2Vnni);
  } else if (avx2) {
    EXPECT_EQ(best, Isa::kAvx2);
  }
  // A CPU with AVX-512 VNNI also has AVX-VNNI where the kernels are built
  // for (Sapphire Rapids and later), but the 512-bit set stays first.
  EXPECT_EQ(MatIsaSupported(Isa::kAvx2Vnni), avx2 && CpuinfoHas("avx_vnni"));
  std::printf("avx2-vnni supported here: %s\n", MatIsaSupported(Isa::kAvx2Vnni) ? "yes" : "no");
  EXPECT_EQ(KernelName(DType::kQ4_K, Isa::kAvx512), "avx512/q4_K*q8x256");
  EXPECT_EQ(KernelName(DType::kQ8_0, Isa::kAmx), "amx/q8_0*bf16");
  EXPECT_EQ(KernelName(DType::kQ8_0, Isa::kAvx2Vnni), "avx2-vnni/q8_0*q8x32");
  EXPECT_EQ(KernelName(DType::kQ8_0, Isa::kAvx2), "avx2/q8_0*q8x32");
  EXPECT_EQ(KernelName(DType::kQ8_0, Isa::kAvx2, 7), "avx2/q8_0*q7x32");
  EXPECT_EQ(KernelName(DType::kQ4_0, Isa::kAvx2, 7), "avx2/q4_0*q8x32");  // Q8_0 only
  EXPECT_EQ(KernelName(DType::kQ8_0, Isa::kAvx2Vnni, 7), "avx2-vnni/q8_0*q8x32");  // plain avx2 only
}

TEST(MatMulDispatch, ParsesKernelSetNames) {
  for (Isa isa : {Isa::kReference, Isa::kAvx2, Isa::kAvx2Vnni, Isa::kAvx512, Isa::kAmx}) {
    auto parsed = ParseMatIsa(IsaName(isa));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, isa);
  }
  EXPECT_EQ(IsaName(Isa::kAvx2Vnni), "avx2-vnni");
  auto best = ParseMatIsa("auto");
  ASSERT_TRUE(best.ok());
  EXPECT_EQ(*best, BestMatIsa());
  EXPECT_FALSE(ParseMatIsa("avx2vnni").ok());
  EXPECT_EQ(MatIsaSupported(Isa::kAmx), CpuHas(Isa::kAmx));
  EXPECT_FALSE(MatIsaSupported(Isa::kAuto));
  EXPECT_FALSE(ParseMatIsa("").ok());
}

TEST(QuantMatrix, RepackedRowsDequantiseExactlyAsTheTraitsTable) {
  for (DType type : kTypes) {
    for (int64_t cols : ColsFor(type)) {
      for (int rows : {1, 17, 35}) {
        const TestMatrix m = MakeMatrix(type, rows, cols, 100 + rows);
        const QuantMatrix q = Repack(m);
        EXPECT_EQ(q.rows(), rows);
        EXPECT_EQ(q.cols(), cols);
        std::vector<float> row(cols);
        for (int r = 0; r < rows; ++r) {
          q.DequantizeRow(r, row.data());
          ASSERT_EQ(std::memcmp(row.data(), m.deq.data() + r * cols, cols * sizeof(float)), 0)
              << Name(type) << " row " << r << " of [" << rows << ", " << cols << "]";
        }
      }
    }
  }
}

TEST(QuantMatrix, RejectsBadShapesAndTypes) {
  std::string bytes(34 * 2, '\0');
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  EXPECT_FALSE(
      QuantMatrix::FromRaw(DType::kQ8_0, 2, 33, p, bytes.size()).ok());  // not whole blocks
  EXPECT_FALSE(QuantMatrix::FromRaw(DType::kQ8_0, 2, 32, p, bytes.size() - 1).ok());
  EXPECT_FALSE(QuantMatrix::FromRaw(DType::kQ2_K, 1, 256, p, 84).ok());  // no kernels
  EXPECT_TRUE(QuantMatrix::FromRaw(DType::kQ8_0, 2, 32, p, bytes.size()).ok());
}

TEST(Activations, QuantiserRule) {
  std::vector<float> x = {0.5f, -1.0f, 0.25f, 0.0f};
  x.resize(32, 0.1f);
  x.resize(64, 0.0f);  // an all-zero block
  std::vector<int8_t> codes(64);
  float d[2];
  QuantizeActivationRow(x.data(), 64, 32, 127, codes.data(), d);
  EXPECT_FLOAT_EQ(d[0], 1.0f / 127);
  EXPECT_EQ(codes[1], -127);
  EXPECT_EQ(codes[0], 64);  // round-half-even(63.5)
  EXPECT_EQ(codes[2], 32);  // 31.75
  EXPECT_EQ(codes[3], 0);
  EXPECT_EQ(d[1], 0.0f);
  for (int i = 32; i < 64; ++i) EXPECT_EQ(codes[i], 0);
  // kQ7x32's codes (max_code 63).
  QuantizeActivationRow(x.data(), 64, 32, 63, codes.data(), d);
  EXPECT_FLOAT_EQ(d[0], 1.0f / 63);
  EXPECT_EQ(codes[1], -63);
  EXPECT_EQ(codes[0], 32);  // round-half-even(31.5)
  EXPECT_EQ(codes[2], 16);  // 15.75
  EXPECT_EQ(codes[4], 6);   // 6.3
  EXPECT_EQ(d[1], 0.0f);
  for (int i = 32; i < 64; ++i) EXPECT_EQ(codes[i], 0);
}

// The quantiser MatMul runs (AVX2 where the CPU has it) is the scalar rule
// bit for bit, also with NaN, infinity, zeros and values that round to .5.
TEST(Activations, QuantiserMatchesTheScalarRule) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int block : {32, 256})
  for (int max_code : {127, 63}) {
    const int64_t cols = 4 * 256;
    std::vector<float> x(cols);
    for (int rep = 0; rep < 50; ++rep) {
      for (float& v : x) v = normal(rng) * (rep % 7 == 0 ? 1e-30f : rep % 5 == 0 ? 1e30f : 1.0f);
      x[rng() % cols] = std::nanf("");
      if (rep % 3 == 0) x[rng() % cols] = INFINITY;
      if (rep % 4 == 0) std::fill(x.begin() + block, x.begin() + 2 * block, 0.0f);
      for (int i = 0; i < 8; ++i) x[rng() % cols] = (static_cast<int>(rng() % 255) - 127) / 254.0f;  // halves
      std::vector<int8_t> a(cols), b(cols);
      std::vector<float> da(cols / block), db(cols / block);
      QuantizeActivationRow(x.data(), cols, block, max_code, a.data(), da.data());
      QuantizeActivationRowScalar(x.data(), cols, block, max_code, b.data(), db.data());
      ASSERT_EQ(a, b) << "block " << block << " max code " << max_code << " rep " << rep;
      ASSERT_EQ(std::memcmp(da.data(), db.data(), da.size() * sizeof(float)), 0)
          << block << " " << max_code << " " << rep;
      for (int8_t c : a) ASSERT_LE(std::abs(int{c}), max_code);
    }
  }
}

TEST(MatMul, EveryKernelMatchesTheFp64OracleAtAwkwardSizes) {
  const std::vector<KernelSet> sets = SupportedSets();
  int cases = 0;
  for (DType type : kTypes) {
    std::vector<double> worst(sets.size(), 0.0);  // largest error / budget
    for (int64_t cols : ColsFor(type)) {
      for (int rows : kOuts) {
        const TestMatrix m = MakeMatrix(type, rows, cols, 7 * rows + cols);
        const QuantMatrix q = Repack(m);
        for (int T : kTokens) {
          const std::vector<float> x = RandomActivations(T, cols, 1000 + T);
          Activations act;
          act.Set(x.data(), T, cols);
          // One oracle per activation form the sets read.
          std::vector<std::pair<ActFormat, Oracle>> oracles;
          std::vector<float> yref;
          for (size_t k = 0; k < sets.size(); ++k) {
            const KernelSet& set = sets[k];
            // amx's tiles (block types, 16 tokens or more) compute in
            // bfloat16: AmxTilesMatchTheirBf16Oracle.
            if (set.isa == Isa::kAmx && internal::AmxTileType(type) && T >= 16) continue;
            const ActFormat f = set.Form(type);
            auto it = absl::c_find_if(oracles, [&](const auto& p) { return p.first == f; });
            if (it == oracles.end()) {
              oracles.emplace_back(f, ComputeOracle(m, KernelActivations(f, act), T));
              it = oracles.end() - 1;
            }
            const Oracle& o = it->second;
            std::vector<float> y(T * rows, NAN);
            MatMul(q, act, y.data(), nullptr, set.isa, set.q8_act_bits);
            for (int i = 0; i < T * rows; ++i) {
              const double err = std::fabs(y[i] - o.y[i]);
              worst[k] = std::max(worst[k], err / o.budget[i]);
              ASSERT_LE(err, o.budget[i]) << set.Name(type) << " [" << rows << ", " << cols
                                          << "] T=" << T << " token " << i / rows << " row "
                                          << i % rows << ": " << y[i] << " vs " << o.y[i];
            }
            if (type == DType::kF32) {  // exact: core MatVec
              if (yref.empty()) {
                yref.resize(T * rows);
                for (int t = 0; t < T; ++t)
                  MatVec(m.deq.data(), x.data() + t * cols, yref.data() + t * rows, rows, cols);
              }
              ASSERT_EQ(std::memcmp(y.data(), yref.data(), y.size() * sizeof(float)), 0)
                  << set.Name(type) << " [" << rows << ", " << cols << "] T=" << T;
            }
            ++cases;
          }
        }
      }
    }
    for (size_t k = 0; k < sets.size(); ++k) {
      // Sets that differ only in q8_act_bits run the same kernel but for Q8_0.
      if (sets[k].q8_act_bits == 7 && type != DType::kQ8_0) continue;
      std::printf("%-26s worst error / budget %.3f\n", sets[k].Name(type).c_str(), worst[k]);
    }
  }
  std::printf("%d (type, kernel, shape, T) cases\n", cases);
}

// Against the unquantised activations, every set's error stays within the
// activation rounding of its own codes (half a step per value, plus the
// kernel budget). Prints each set's rms error relative to the exact product's
// rms: what 7-bit Q8_0 activation codes (plain avx2, q8_act_bits = 7) cost
// against 8-bit ones.
TEST(MatMul, ActivationQuantisationErrorIsBounded) {
  for (DType type : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {
    const int64_t cols = Traits(type).block_elements == 32 ? 1088 : 2560;
    const int rows = 129, T = 5;
    const TestMatrix m = MakeMatrix(type, rows, cols, 99);
    const QuantMatrix q = Repack(m);
    const std::vector<float> x = RandomActivations(T, cols, 5);
    for (const KernelSet& set : SupportedSets()) {
      if (set.q8_act_bits == 7 && type != DType::kQ8_0) continue;
      Activations act;
      act.Set(x.data(), T, cols);
      const Oracle o = ComputeOracle(m, KernelActivations(set.Form(type), act), T);
      const Activations::Q8& q8 = act.q8(set.Form(type));
      const int block = q8.block;
      std::vector<float> y(T * rows);
      MatMul(q, act, y.data(), nullptr, set.isa, set.q8_act_bits);
      double err2 = 0, exact2 = 0;
      for (int t = 0; t < T; ++t) {
        for (int r = 0; r < rows; ++r) {
          double exact = 0, bound = 0;
          for (int64_t i = 0; i < cols; ++i) {
            const double w = m.deq[r * cols + i];
            exact += w * x[t * cols + i];
            bound += std::fabs(w) * q8.d[t * (cols / block) + i / block] / 2;
          }
          const double err = y[t * rows + r] - exact;
          EXPECT_LE(std::fabs(err), bound + o.budget[t * rows + r]) << set.Name(type);
          err2 += err * err;
          exact2 += exact * exact;
        }
      }
      std::printf("%-26s rms error / rms product %.2e\n", set.Name(type).c_str(),
                  std::sqrt(err2 / exact2));
    }
  }
}

// A prefill step's many tokens (more than a pass of kTokenChunk, with a
// ragged end) give, bit for bit, what the same tokens give a few at a time:
// a token's result depends neither on the step's size nor on its place in it.
TEST(MatMul, ManyTokensGiveWhatFewAtATimeGive) {
  constexpr int kT = 150, kSlice = 7;
  for (const KernelSet& set : SupportedSets()) {
    for (DType type : kTypes) {
      if (set.q8_act_bits == 7 && type != DType::kQ8_0) continue;
      const int64_t cols = ColsFor(type)[1];
      const int rows = 40;  // two groups and a partial one
      const TestMatrix m = MakeMatrix(type, rows, cols, 11);
      const QuantMatrix q = Repack(m);
      const std::vector<float> x = RandomActivations(kT, cols, 12);
      Activations all;
      all.Set(x.data(), kT, cols);
      std::vector<float> y_all(kT * rows, NAN), y_few(kT * rows, NAN);
      MatMul(q, all, y_all.data(), nullptr, set.isa, set.q8_act_bits);
      // amx's tiles take 16 tokens or more (fewer run avx512's int8
      // kernel, with other rounding): slices of 30 there.
      const int slice = set.isa == Isa::kAmx && internal::AmxTileType(type) ? 30 : kSlice;
      for (int t0 = 0; t0 < kT; t0 += slice) {
        const int n = std::min(slice, kT - t0);
        Activations few;
        few.Set(x.data() + t0 * cols, n, cols);
        MatMul(q, few, y_few.data() + t0 * rows, nullptr, set.isa, set.q8_act_bits);
      }
      for (int t = 0; t < kT; ++t) {
        ASSERT_EQ(std::memcmp(y_all.data() + t * rows, y_few.data() + t * rows, rows * sizeof(float)), 0)
            << set.Name(type) << " token " << t;
      }
    }
  }
}

TEST(MatMul, RepackingAndResultsDoNotDependOnTheThreadCount) {
  ThreadPool one(1), three(3);
  for (DType type : kTypes) {
    const int64_t cols = Traits(type).block_elements == 256 ? 1024 : 1056;
    const int rows = 1000;
    const TestMatrix m = MakeMatrix(type, rows, cols, 3);
    const QuantMatrix q = Repack(m);
    auto pooled = QuantMatrix::FromRaw(type, rows, cols,
                                       reinterpret_cast<const uint8_t*>(m.raw.data()), m.raw.size(),
                                       &three);
    ASSERT_TRUE(pooled.ok());
    ASSERT_EQ(pooled->bytes(), q.bytes());
    EXPECT_EQ(std::memcmp(pooled->group(0), q.group(0), q.bytes()), 0) << Name(type);
    for (int T : {1, 5}) {
      const std::vector<float> x = RandomActivations(T, cols, 9);
      Activations act;
      act.Set(x.data(), T, cols);
      std::vector<float> a(T * rows), b(T * rows), c(T * rows);
      MatMul(q, act, a.data(), nullptr);
      MatMul(q, act, b.data(), &one);
      MatMul(q, act, c.data(), &three);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << Name(type);
      EXPECT_EQ(std::memcmp(a.data(), c.data(), a.size() * sizeof(float)), 0) << Name(type);
    }
  }
}

// y = x · Wᵀ by the kernel set `isa` on the activation form `f` (one whose
// codes that set's products take exactly: avx2-vnni and the reference take
// any int8 codes), so that sets can be compared on the same codes.
void MatMulOnForm(const QuantMatrix& w, Activations& x, ActFormat f, Isa isa, float* y) {
  internal::KernelArgs args;
  args.w = &w;
  args.x = x.f32();
  args.q8 = f == ActFormat::kF32 ? nullptr : &x.q8(f);
  args.T = x.tokens();
  args.y = y;
  args.ldy = w.rows();
  const internal::MatKernel kernel =
      isa == Isa::kAvx2Vnni ? internal::Avx2VnniKernel(w.type()) : internal::RefKernel(w.type());
  ASSERT_TRUE(isa == Isa::kAvx2Vnni || isa == Isa::kReference);
  kernel(args, 0, w.groups());
}

// avx2-vnni differs from avx2 only in how the exact integer block sums are
// formed (VPDPBUSD vs VPMADDUBSW + VPMADDWD); the float steps are the same, so
// on the same activation codes the two sets agree bit for bit (Q8_0 with
// 7-bit codes too, against avx2-vnni run on them), also at the codes'
// extremes (|code| = 127, or 63, weight levels at their maxima), where the
// int16 pair sums of avx2 are tightest.
TEST(MatMul, Avx2VnniEqualsAvx2BitForBit) {
  if (!MatIsaSupported(Isa::kAvx2Vnni)) GTEST_SKIP() << "no AVX-VNNI on this CPU";
  int cases = 0;
  for (DType type : kTypes) {
    for (int64_t cols : ColsFor(type)) {
      for (int rows : {17, 129}) {
        const TestMatrix m = MakeMatrix(type, rows, cols, 31 * rows + cols);
        const QuantMatrix q = Repack(m);
        for (int T : {1, 2, 3, 16})
        for (int bits : {8, 7}) {
          if (bits == 7 && type != DType::kQ8_0) continue;
          std::vector<float> x = RandomActivations(T, cols, 77 + T);
          if (T == 3) {  // saturated activations: every code +-127 (+-63)
            for (size_t i = 0; i < x.size(); ++i) x[i] = (i * 7919) % 3 ? 1.0f : -1.0f;
          }
          Activations act;
          act.Set(x.data(), T, cols);
          std::vector<float> a(T * rows, NAN), b(T * rows, NAN);
          MatMul(q, act, a.data(), nullptr, Isa::kAvx2, bits);
          MatMulOnForm(q, act, ActFormatFor(type, Isa::kAvx2, bits), Isa::kAvx2Vnni, b.data());
          ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
              << KernelName(type, Isa::kAvx2, bits) << " [" << rows << ", " << cols << "] T=" << T;
          ++cases;
        }
      }
    }
  }
  // Extreme weights: Q8_0 codes -128 / 127 (the sign trick of 8-bit codes,
  // and the stored u8 0 / 255 that 7-bit codes and VPDPBUSD multiply, at
  // their limits) against codes of both signs.
  for (int8_t code : {int8_t{-128}, int8_t{127}}) {
    constexpr int64_t kCols = 1024;
    constexpr int kRows = 9;
    std::string raw(kRows * (kCols / 32) * sizeof(BlockQ8_0), '\0');
    auto* blocks = reinterpret_cast<BlockQ8_0*>(raw.data());
    for (int64_t i = 0; i < kRows * (kCols / 32); ++i) {
      blocks[i].d = FloatToHalf(0.01f);
      for (int e = 0; e < 32; ++e) blocks[i].qs[e] = (e + i) % 5 ? code : 0;
    }
    auto q = QuantMatrix::FromRaw(DType::kQ8_0, kRows, kCols,
                                  reinterpret_cast<const uint8_t*>(raw.data()), raw.size());
    ASSERT_TRUE(q.ok());
    for (int T : {2, 16})  // 16: the 4-token tiles too
    for (int bits : {8, 7}) {
      // Every code +-127 (+-63), in a sign pattern of each token's own.
      std::vector<float> x(T * kCols);
      for (int64_t i = 0; i < T * kCols; ++i) x[i] = ((i % kCols) * 7 + i / kCols) % 3 ? 1.0f : -1.0f;
      Activations act;
      act.Set(x.data(), T, kCols);
      const ActFormat f = ActFormatFor(DType::kQ8_0, Isa::kAvx2, bits);
      std::vector<float> a(T * kRows), b(T * kRows), r(T * kRows);
      MatMul(*q, act, a.data(), nullptr, Isa::kAvx2, bits);
      MatMulOnForm(*q, act, f, Isa::kAvx2Vnni, b.data());
      MatMulOnForm(*q, act, f, Isa::kReference, r.data());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << int{code} << " T=" << T << " bits " << bits;
      for (int i = 0; i < T * kRows; ++i) EXPECT_NEAR(b[i], r[i], 1e-3 * std::fabs(r[i]) + 1e-6);
    }
  }
  std::printf("%d (type, shape, T) cases identical\n", cases);
}

// x rounded to bfloat16, nearest even (finite x), as a float.
float RoundBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

// amx runs the block types' steps of 16 tokens or more on the tile unit in
// bfloat16: y = sum bf16(x) * bf16(w), w the reference dequantisation
// (Traits(type).dequantize), the products exact in fp32 and summed in fp32.
// Against that sum in fp64, the error is the fp32 summation's alone: at most
// (K + 2) 2^-24 sum |products| (K = cols). A misplaced element, a wrong
// row, pair, nibble or sub-block scale, or a lost chunk (1088, 2080 and 2560
// columns cross the kernel's chunks of 1024) costs a whole product or more.
// Checked at token counts that fill tile pairs, leave a single and a partial
// tile, with a partial group (17, 129 rows), with groups in pairs and one
// left over (48, 129 rows), with more groups than a band of the kernel (537
// rows: 34 groups, in bands of 32 and 2 on 1 thread), on 1 and 3 threads;
// below 16 tokens the set is avx512 bit for bit.
TEST(MatMul, AmxTilesMatchTheirBf16Oracle) {
  if (!MatIsaSupported(Isa::kAmx)) GTEST_SKIP() << "no AMX-BF16 on this CPU (or Linux refused the tile state)";
  ThreadPool three(3);
  for (DType type : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {
  ASSERT_TRUE(internal::AmxTileType(type));
  int cases = 0;
  double worst = 0;
  std::vector<int64_t> all_cols = ColsFor(type);
  if (Traits(type).block_elements == 32) all_cols.push_back(2080);
  for (int64_t cols : all_cols) {
    for (int rows : {16, 17, 48, 129, 537}) {
      const bool bands = rows > 16 * 32;  // the largest and smallest cols only, 2 token counts (time)
      if (bands && cols != all_cols.front() && cols != all_cols.back()) continue;
      const TestMatrix m = MakeMatrix(type, rows, cols, 41 * rows + cols);
      const QuantMatrix q = Repack(m);
      for (int T : {5, 16, 17, 31, 40, 77}) {
        if (bands && T != 17 && T != 40) continue;
        const std::vector<float> x = RandomActivations(T, cols, 5 * T + cols);
        Activations act;
        act.Set(x.data(), T, cols);
        std::vector<float> y1(T * rows, NAN), y3(T * rows, NAN);
        MatMul(q, act, y1.data(), nullptr, Isa::kAmx);
        MatMul(q, act, y3.data(), &three, Isa::kAmx);
        ASSERT_EQ(std::memcmp(y1.data(), y3.data(), y1.size() * sizeof(float)), 0)
            << "threads [" << rows << ", " << cols << "] T=" << T;
        if (T < 16) {
          std::vector<float> ya(T * rows, NAN);
          MatMul(q, act, ya.data(), nullptr, Isa::kAvx512);
          ASSERT_EQ(std::memcmp(y1.data(), ya.data(), y1.size() * sizeof(float)), 0)
              << "avx512 [" << rows << ", " << cols << "] T=" << T;
          continue;
        }
        for (int t = 0; t < T; ++t) {
          for (int r = 0; r < rows; ++r) {
            double sum = 0, mag = 0;
            for (int64_t k = 0; k < cols; ++k) {
              const double p = double(RoundBf16(x[t * cols + k])) * RoundBf16(m.deq[r * cols + k]);
              sum += p;
              mag += std::fabs(p);
            }
            const double budget = (cols + 2) * std::ldexp(1.0, -24) * mag + 1e-30;
            const double err = std::fabs(y1[t * rows + r] - sum);
            worst = std::max(worst, err / budget);
            ASSERT_LE(err, budget) << "[" << rows << ", " << cols << "] T=" << T << " token " << t
                                   << " row " << r << ": " << y1[t * rows + r] << " vs " << sum;
          }
        }
        ++cases;
      }
    }
  }
  std::printf("%s: %d (shape, T) cases; worst error / budget %.3f\n", Name(type).c_str(), cases, worst);
  }
}

// --- The CPU backend's weight modes on random models ------------------------

struct Model {
  std::unique_ptr<GgufFile> file;
  ModelConfig config;
};

Model MakeModel(const std::string& arch, DType type) {
  MakeModelOptions o;
  o.arch = arch;
  o.layers = 2;
  o.hidden = 256;
  o.heads = 4;
  o.kv_heads = 2;
  o.head_dim = 64;
  o.ffn = 512;
  o.weight_type = type;
  o.vocab_from = testing::ModelsDir() + "/stories260K.gguf";
  o.context = 64;
  o.seed = 21;
  auto writer = MakeRandomModel(o);
  EXPECT_TRUE(writer.ok()) << writer.status();
  auto file = GgufFile::FromBytes(writer->ToBytes());
  EXPECT_TRUE(file.ok()) << file.status();
  auto config = ModelConfig::FromGguf(**file);
  EXPECT_TRUE(config.ok()) << config.status();
  return {*std::move(file), *config};
}

std::unique_ptr<MlpBackend> MakeBackend(const Model& m, bool native, int threads,
                                        const std::string& isa = "auto", int q8_act_bits = 8) {
  LoadOptions load;
  load.raw_matrices = native;
  auto weights = LoadWeights(*m.file, m.config, load);
  EXPECT_TRUE(weights.ok()) << weights.status();
  auto backend = CreateCpuBackend(*std::move(weights), 32, threads, isa, q8_act_bits);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return *std::move(backend);
}

// Logits of each token as the first token of its own sequence (position 0,
// where attention returns v itself), all tokens in one step.
std::vector<float> FirstTokenLogits(MlpBackend& b, const ModelConfig& c,
                                    const std::vector<int32_t>& tokens) {
  const int T = static_cast<int>(tokens.size());
  std::vector<int32_t> positions(T, 0), rows(T);
  for (int i = 0; i < T; ++i) rows[i] = i;
  std::vector<float> q(T * c.q_dim()), k(T * c.kv_dim()), v(T * c.kv_dim()), attn(T * c.q_dim());
  EXPECT_TRUE(b.BeginStep(tokens.data(), positions.data(), T).ok());
  for (int l = 0; l < c.n_layers; ++l) {
    EXPECT_TRUE(ComputeQkv(b, c.n_kv_heads, l, q.data(), k.data(), v.data()).ok());
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < c.n_heads; ++h) {
        std::copy_n(v.data() + t * c.kv_dim() + (h / c.gqa_ratio()) * c.head_dim, c.head_dim,
                    attn.data() + t * c.q_dim() + h * c.head_dim);
      }
    }
    EXPECT_TRUE(CompleteLayer(b, c.n_kv_heads, l, attn.data()).ok());
  }
  std::vector<float> logits(T * c.vocab_size);
  EXPECT_TRUE(b.ComputeLogits(rows.data(), T, logits.data()).ok());
  return logits;
}

TEST(CpuBackend, F32ModeEqualsTheReferenceForwardBitForBit) {
  for (const auto& [arch, type] : {std::pair<std::string, DType>{"llama", DType::kQ4_K},
                                   std::pair<std::string, DType>{"qwen2", DType::kQ8_0}}) {
    const Model m = MakeModel(arch, type);
    auto backend = MakeBackend(m, /*native=*/false, 2);
    EXPECT_EQ(backend->name(), "cpu-f32 (2 threads)");
    const std::vector<int32_t> tokens = {1, 300, 77};
    const std::vector<float> logits = FirstTokenLogits(*backend, m.config, tokens);
    auto weights = LoadWeights(*m.file, m.config);
    ASSERT_TRUE(weights.ok());
    auto ref = ReferenceModel::Create(*std::move(weights), 8);
    ASSERT_TRUE(ref.ok());
    for (size_t t = 0; t < tokens.size(); ++t) {
      const std::vector<float>& expected = (*ref)->Forward(tokens[t], 0);
      EXPECT_EQ(std::memcmp(expected.data(), logits.data() + t * m.config.vocab_size,
                            expected.size() * sizeof(float)),
                0)
          << arch << " token " << t;
    }
  }
}

// The StepRunner's protocol: q, k, v written into one buffer per attention
// shard, the attention output read back from one per shard. Cut by KV heads
// it must carry exactly the whole-model arrays, and refuse shards that do not
// cover the heads in order.
TEST(CpuBackend, ShardIoIsTheWholeModelCutByKvHeads) {
  const Model m = MakeModel("qwen2", DType::kQ8_0);
  const ModelConfig& c = m.config;
  ASSERT_EQ(c.n_kv_heads, 2);
  auto whole = MakeBackend(m, /*native=*/false, 1);
  auto cut = MakeBackend(m, /*native=*/false, 1);
  const std::vector<int32_t> tokens = {1, 300, 77}, positions = {0, 1, 2};
  const int T = 3, hd = c.head_dim, g = c.gqa_ratio();
  ASSERT_TRUE(whole->BeginStep(tokens.data(), positions.data(), T).ok());
  ASSERT_TRUE(cut->BeginStep(tokens.data(), positions.data(), T).ok());
  std::vector<float> q(T * c.q_dim()), k(T * c.kv_dim()), v(k.size());
  // Per shard (one KV head each): q, k, v, attn in the ring's token-major layout.
  std::vector<std::vector<float>> sq(2, std::vector<float>(T * g * hd, NAN)),
      sk(2, std::vector<float>(T * hd, NAN)), sv(sk), sa(sq);
  std::vector<MlpBackend::ShardIo> io(2);
  for (int s = 0; s < 2; ++s) {
    io[s].heads = {s, s + 1};
    io[s].q = sq[s].data();
    io[s].k = sk[s].data();
    io[s].v = sv[s].data();
    io[s].attn = sa[s].data();
  }
  for (int l = 0; l < c.n_layers; ++l) {
    ASSERT_TRUE(ComputeQkv(*whole, c.n_kv_heads, l, q.data(), k.data(), v.data()).ok());
    ASSERT_TRUE(cut->StageQkv(l).ok());
    ASSERT_TRUE(cut->WriteQkvShards(io.data(), 2).ok());
    for (int s = 0; s < 2; ++s) {
      for (int t = 0; t < T; ++t) {
        EXPECT_EQ(0, std::memcmp(sq[s].data() + t * g * hd, q.data() + t * c.q_dim() + s * g * hd,
                                 g * hd * sizeof(float)))
            << "layer " << l << " shard " << s << " token " << t;
        EXPECT_EQ(0, std::memcmp(sk[s].data() + t * hd, k.data() + t * c.kv_dim() + s * hd,
                                 hd * sizeof(float)));
        EXPECT_EQ(0, std::memcmp(sv[s].data() + t * hd, v.data() + t * c.kv_dim() + s * hd,
                                 hd * sizeof(float)));
        // The stand-in attention output: q itself, cut the same way.
        std::copy_n(q.data() + t * c.q_dim() + s * g * hd, g * hd, sa[s].data() + t * g * hd);
      }
    }
    ASSERT_TRUE(CompleteLayer(*whole, c.n_kv_heads, l, q.data()).ok());
    ASSERT_TRUE(cut->CompleteLayerFromShards(l, io.data(), 2).ok());
  }
  std::vector<float> a(T * c.vocab_size), b(a.size());
  const std::vector<int32_t> rows = {0, 1, 2};
  ASSERT_TRUE(whole->ComputeLogits(rows.data(), T, a.data()).ok());
  ASSERT_TRUE(cut->ComputeLogits(rows.data(), T, b.data()).ok());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));

  // Shards that do not cover the KV heads in order, or lack a buffer.
  ASSERT_TRUE(cut->StageQkv(0).ok());
  std::vector<MlpBackend::ShardIo> swapped = {io[1], io[0]};
  EXPECT_EQ(cut->WriteQkvShards(swapped.data(), 2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cut->WriteQkvShards(io.data(), 1).code(), absl::StatusCode::kInvalidArgument);
  std::vector<MlpBackend::ShardIo> no_v = io;
  no_v[1].v = nullptr;
  EXPECT_EQ(cut->WriteQkvShards(no_v.data(), 2).code(), absl::StatusCode::kInvalidArgument);
  std::vector<MlpBackend::ShardIo> no_attn = io;
  no_attn[0].attn = nullptr;
  EXPECT_EQ(cut->CompleteLayerFromShards(0, no_attn.data(), 2).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cut->StageQkv(c.n_layers).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cut->CompleteLayerFromShards(-1, io.data(), 2).code(),
            absl::StatusCode::kInvalidArgument);
  auto fresh = MakeBackend(m, /*native=*/false, 1);
  EXPECT_EQ(fresh->StageQkv(0).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CpuBackend, RefusesActivationBitsOtherThan8Or7) {
  const Model m = MakeModel("llama", DType::kQ8_0);
  for (int bits : {6, 9, 0}) {
    auto weights = LoadWeights(*m.file, m.config);
    ASSERT_TRUE(weights.ok());
    auto backend = CreateCpuBackend(*std::move(weights), 16, 1, "auto", bits);
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument) << bits;
  }
}

// With the best kernel set, and for Q8_0 also plain avx2 with 7-bit
// activation codes (q8_act_bits = 7), whose error is printed beside.
TEST(CpuBackend, NativeModeIsCloseToF32ForEveryWeightType) {
  const std::vector<int32_t> tokens5 = {1, 300, 77, 5, 411};
  for (DType type : {DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_K,
                     DType::kQ5_K, DType::kQ6_K}) {
    std::vector<std::pair<std::string, int>> sets = {{"auto", 8}};
    if (type == DType::kQ8_0 && MatIsaSupported(Isa::kAvx2)) sets.push_back({"avx2", 7});
    // amx: the block types on the tile unit in bfloat16, from 16 tokens in a step.
    if (internal::AmxTileType(type) && MatIsaSupported(Isa::kAmx)) sets.push_back({"amx", 8});
    for (const std::string arch : {"llama", "qwen2"})
    for (const auto& [isa, bits] : sets) {
      std::vector<int32_t> tokens = tokens5;
      if (isa == "amx") {
        for (int i = 0; i < 15; ++i) tokens.push_back(static_cast<int32_t>(7 + 31 * i));
      }
      const Model m = MakeModel(arch, type);
      auto exact = MakeBackend(m, false, 1);
      auto native = MakeBackend(m, true, 2, isa, bits);
      EXPECT_NE(native->name().find("cpu-native"), std::string::npos) << native->name();
      const std::vector<float> a = FirstTokenLogits(*exact, m.config, tokens);
      const std::vector<float> b = FirstTokenLogits(*native, m.config, tokens);
      const int V = m.config.vocab_size;
      double worst_rms = 0, worst_max = 0;
      for (size_t t = 0; t < tokens.size(); ++t) {
        double max_err = 0, sq = 0, err_sq = 0;
        for (int i = 0; i < V; ++i) {
          const double d = double(a[t * V + i]) - b[t * V + i];
          max_err = std::max(max_err, std::fabs(d));
          sq += double(a[t * V + i]) * a[t * V + i];
          err_sq += d * d;
        }
        const double rms = std::sqrt(sq / V), rms_err = std::sqrt(err_sq / V);
        worst_rms = std::max(worst_rms, rms_err / rms);
        worst_max = std::max(worst_max, max_err / rms);
        // int8 activations (per-block steps of max|x| / 127) through 2
        // layers and the head: a few percent of the logits' rms.
        EXPECT_LT(rms_err, 0.05 * rms) << Name(type) << " " << arch << " token " << t;
        EXPECT_LT(max_err, 0.15 * rms) << Name(type) << " " << arch << " token " << t;
        const float* at = a.data() + t * V;
        const float* bt = b.data() + t * V;
        const int top_a = static_cast<int>(std::max_element(at, at + V) - at);
        const int top_b = static_cast<int>(std::max_element(bt, bt + V) - bt);
        // Top-1 agrees unless the exact top two are within the error.
        std::vector<float> sorted(at, at + V);
        std::nth_element(sorted.begin(), sorted.begin() + 1, sorted.end(), std::greater<float>());
        if (sorted[0] - sorted[1] > 2 * max_err) {
          EXPECT_EQ(top_a, top_b) << Name(type) << " " << arch << " token " << t;
        }
      }
      const std::string acts = isa == "amx" ? "bf16" : absl::StrCat(bits, "-bit");
      std::printf("native (%s, %s activations, %zu tokens) vs f32, %s %s: logits error rms %.2f%%, max "
                  "%.2f%% of the logits' rms\n",
                  isa.c_str(), acts.c_str(), tokens.size(), Name(type).c_str(), arch.c_str(), 100 * worst_rms,
                  100 * worst_max);
      if (bits == 7) {
        EXPECT_NE(native->name().find("q8_0 activations 7-bit"), std::string::npos) << native->name();
      }
    }
  }
}

// Greedy decoding through the backend with an fp32 KV cache kept here
// (core AttendOneHead, as the reference forward attends).
class Decoder {
 public:
  Decoder(MlpBackend* b, const ModelConfig& c, int max_pos) : b_(b), c_(c), max_pos_(max_pos) {
    kcache_.resize(static_cast<size_t>(c.n_layers) * max_pos * c.kv_dim());
    vcache_.resize(kcache_.size());
  }
  // Logits after feeding `token` at position `pos`.
  std::vector<float> Step(int32_t token, int pos) {
    const ModelConfig& c = c_;
    std::vector<float> q(c.q_dim()), k(c.kv_dim()), v(c.kv_dim()), attn(c.q_dim()), scores(pos + 1);
    std::vector<const float*> krows(pos + 1), vrows(pos + 1);
    EXPECT_TRUE(b_->BeginStep(&token, &pos, 1).ok());
    for (int l = 0; l < c.n_layers; ++l) {
      EXPECT_TRUE(ComputeQkv(*b_, c.n_kv_heads, l, q.data(), k.data(), v.data()).ok());
      float* lk = kcache_.data() + static_cast<size_t>(l) * max_pos_ * c.kv_dim();
      float* lv = vcache_.data() + static_cast<size_t>(l) * max_pos_ * c.kv_dim();
      std::copy(k.begin(), k.end(), lk + static_cast<size_t>(pos) * c.kv_dim());
      std::copy(v.begin(), v.end(), lv + static_cast<size_t>(pos) * c.kv_dim());
      for (int h = 0; h < c.n_heads; ++h) {
        const int kvh = h / c.gqa_ratio();
        for (int t = 0; t <= pos; ++t) {
          krows[t] = lk + static_cast<size_t>(t) * c.kv_dim() + kvh * c.head_dim;
          vrows[t] = lv + static_cast<size_t>(t) * c.kv_dim() + kvh * c.head_dim;
        }
        AttendOneHead(q.data() + h * c.head_dim, krows.data(), vrows.data(), pos + 1, c.head_dim,
                      scores.data(), attn.data() + h * c.head_dim);
      }
      EXPECT_TRUE(CompleteLayer(*b_, c.n_kv_heads, l, attn.data()).ok());
    }
    std::vector<float> logits(c.vocab_size);
    const int32_t row = 0;
    EXPECT_TRUE(b_->ComputeLogits(&row, 1, logits.data()).ok());
    return logits;
  }

 private:
  MlpBackend* b_;
  ModelConfig c_;
  int max_pos_;
  std::vector<float> kcache_, vcache_;
};

int ArgMax(const std::vector<float>& v) {
  return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
}

TEST(CpuBackend, DecodingF32IsExactAndNativeTracksTheReference) {
  const std::vector<int32_t> prompt = {1, 300, 77, 5};
  constexpr int kNew = 28;
  for (const auto& [arch, type] : {std::pair<std::string, DType>{"qwen2", DType::kQ8_0},
                                   std::pair<std::string, DType>{"qwen2", DType::kQ4_K},
                                   std::pair<std::string, DType>{"llama", DType::kQ6_K}}) {
    const Model m = MakeModel(arch, type);
    auto weights = LoadWeights(*m.file, m.config);
    ASSERT_TRUE(weights.ok());
    auto ref = ReferenceModel::Create(*std::move(weights), 64);
    ASSERT_TRUE(ref.ok());
    const std::vector<int32_t> expected = (*ref)->GenerateGreedy(prompt, kNew);
    ASSERT_EQ(expected.size(), static_cast<size_t>(kNew));
    // The reference's whole sequence, fed to both backends (teacher forcing).
    std::vector<int32_t> seq = prompt;
    seq.insert(seq.end(), expected.begin(), expected.end() - 1);
    auto exact = MakeBackend(m, false, 2);
    auto native = MakeBackend(m, true, 2);
    Decoder de(exact.get(), m.config, 64), dn(native.get(), m.config, 64);
    int agree = 0, total = 0;
    for (size_t pos = 0; pos < seq.size(); ++pos) {
      const std::vector<float> le = de.Step(seq[pos], static_cast<int>(pos));
      const std::vector<float> ln = dn.Step(seq[pos], static_cast<int>(pos));
      if (pos + 1 < prompt.size()) continue;
      const int32_t want = expected[pos + 1 - prompt.size()];
      EXPECT_EQ(ArgMax(le), want) << arch << " " << Name(type) << " position " << pos;
      agree += ArgMax(ln) == want;
      ++total;
    }
    std::printf("native %s %s: top-1 agrees with the reference at %d of %d positions\n",
                arch.c_str(), Name(type).c_str(), agree, total);
    EXPECT_GE(agree, total * 8 / 10) << arch << " " << Name(type);
  }
}

// --- Microbenchmark (run with --gtest_also_run_disabled_tests) ---------------

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The kernel sets to time: ELLM_BENCH_ISAS="avx2,avx2-vnni" (names as
// ParseMatIsa reads them), else the best one.
std::vector<Isa> BenchIsas() {
  std::vector<Isa> out;
  const char* env = std::getenv("ELLM_BENCH_ISAS");
  std::string list = env != nullptr ? env : "auto";
  for (size_t pos = 0; pos <= list.size();) {
    size_t end = list.find(',', pos);
    if (end == std::string::npos) end = list.size();
    auto isa = ParseMatIsa(std::string_view(list).substr(pos, end - pos));
    EXPECT_TRUE(isa.ok()) << isa.status();
    if (isa.ok() && MatIsaSupported(*isa)) out.push_back(*isa);
    pos = end + 1;
  }
  return out;
}

// ELLM_BENCH_MATVEC_N (default 5120) and ELLM_BENCH_WORKING_SET_KB (default
// 1 GiB, beyond the last-level cache) change the shape and the bytes cycled
// through: e.g. 512 and 300 measure the kernels on weights in cache.
// ELLM_BENCH_TOKENS="1,4,256" sets the tokens per step (default 1,4,16).
// ELLM_BENCH_TYPES="q8_0,q4_K" times only those weight types (of q8_0, q4_0,
// q4_K, q5_K, q6_K and f16). ELLM_BENCH_Q8_ACT_BITS=7 runs MatMul with
// q8_act_bits = 7 (plain avx2 Q8_0 on 7-bit activation codes; the row's
// kernel name ends in q7x32).
// Each row also names its compute roof, as `ellm-bench attention` does: the
// peak of the instruction the kernel's inner loop runs (bench/peak.h),
// measured on the row's threads just before it, over the multiply-adds each
// byte of weights needs (T x weights per byte); roof = the smaller of that
// and the probe, and `bound` says which. The peak counts the products alone,
// not the unpacking of 4-6-bit codes or the scales, so a kernel may stay
// well under a compute roof, but not above it (beyond the noise of the
// peak's own measurement).
TEST(MatMulBench, DISABLED_Matvec5120) {
  const std::vector<Isa> isas = BenchIsas();
  const std::string cpu = CpuModelName();  // every row names the machine
  const char* n_env = std::getenv("ELLM_BENCH_MATVEC_N");
  const char* ws_env = std::getenv("ELLM_BENCH_WORKING_SET_KB");
  const char* bits_env = std::getenv("ELLM_BENCH_Q8_ACT_BITS");
  const int bits = bits_env != nullptr && std::atoi(bits_env) == 7 ? 7 : 8;
  const int64_t kN = n_env != nullptr ? std::max(32LL, std::atoll(n_env)) / 32 * 32 : 5120;
  const size_t kWorkingSet = ws_env != nullptr ? std::max(1LL, std::atoll(ws_env)) * size_t{1024} : size_t{1} << 30;
  // The probe runs again right before every row, on the row's threads: this
  // VM's bandwidth moves by a third within minutes, so each row's ratio is
  // to the probe of its own moment. It is the attention bench's (huge pages,
  // core/read_probe.h): a probe of its own here, on 4 KiB pages, read 7-15%
  // less and put Q8_0 at 1.11 of it.
  ReadProbe probe(static_cast<int64_t>(kWorkingSet));
  for (int threads : {1, 2}) {
    ThreadPool pool(threads);
    std::printf("read probe, %d thread(s): %.1f GB/s\n", threads, probe.Measure(pool));
  }
  std::vector<int> token_counts = {1, 4, 16};
  if (const char* tokens_env = std::getenv("ELLM_BENCH_TOKENS"); tokens_env != nullptr) {
    token_counts.clear();
    for (absl::string_view t : absl::StrSplit(tokens_env, ',')) {
      int n = 0;
      if (absl::SimpleAtoi(t, &n) && n > 0) token_counts.push_back(n);
    }
    ASSERT_FALSE(token_counts.empty()) << "ELLM_BENCH_TOKENS: comma-separated token counts, e.g. 1,4,256";
  }
  const char* types_env = std::getenv("ELLM_BENCH_TYPES");
  const std::vector<std::string> wanted = absl::StrSplit(types_env != nullptr ? types_env : "", ',');
  for (DType type : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K, DType::kF16}) {
    if (types_env != nullptr && !absl::c_linear_search(wanted, std::string(Traits(type).name))) continue;
    // Random blocks (valid halves for the scales), repacked into enough
    // copies to stream from DRAM.
    const uint64_t bytes = *DTypeBytes(type, kN * kN);
    std::string raw(bytes, '\0');
    std::mt19937_64 rng(1);
    for (char& c : raw) c = static_cast<char>(rng());
    const uint64_t block = Traits(type).block_bytes;
    for (uint64_t off = 0; off < bytes; off += block) {
      uint16_t h = 0x2000;  // small positive half
      if (type == DType::kQ6_K) std::memcpy(&raw[off + 208], &h, 2);
      if (type != DType::kQ6_K) std::memcpy(&raw[off], &h, 2);  // d (Q8_0, Q4_0, Q4_K, Q5_K) or the F16 value
      if (type == DType::kQ4_K || type == DType::kQ5_K) std::memcpy(&raw[off + 2], &h, 2);
    }
    auto one = QuantMatrix::FromRaw(type, kN, kN, reinterpret_cast<const uint8_t*>(raw.data()),
                                    raw.size());
    ASSERT_TRUE(one.ok());
    const int copies = static_cast<int>(kWorkingSet / one->bytes()) + 1;
    std::vector<QuantMatrix> ms;
    for (int i = 0; i < copies; ++i) {
      ms.push_back(*QuantMatrix::FromRaw(type, kN, kN, reinterpret_cast<const uint8_t*>(raw.data()),
                                         raw.size()));
    }
    const int max_tokens = *absl::c_max_element(token_counts);
    const std::vector<float> x = RandomActivations(max_tokens, kN, 2);
    std::vector<float> y(static_cast<size_t>(max_tokens) * kN);
    for (int threads : {1, 2}) {
      ThreadPool pool(threads);
      for (int T : token_counts) {
        for (Isa isa : isas) {
          Activations act;
          act.Set(x.data(), T, kN);
          const double probe_gbs = probe.Measure(pool);
          MatMul(ms[0], act, y.data(), &pool, isa, bits);  // converts the activations
          double best = 0;
          for (int rep = 0; rep < 2; ++rep) {
            const auto t0 = std::chrono::steady_clock::now();
            for (const QuantMatrix& m : ms) MatMul(m, act, y.data(), &pool, isa, bits);
            const double s = Seconds(t0, std::chrono::steady_clock::now());
            best = std::max(best, copies * static_cast<double>(one->bytes()) / s / 1e9);
          }
          const bench::DotUnit unit = bench::MatrixDotUnit(isa, type);
          const double peak = bench::PeakGmacs(unit, pool);
          const double macs_per_byte =
              T * static_cast<double>(kN) * kN / static_cast<double>(one->bytes());
          const double compute_gbs = peak / macs_per_byte;
          const double roof = std::min(probe_gbs, compute_gbs);
          std::printf(
              "%-22s %d thread(s), T=%2d: %.1f GB/s of weights (%.2f ms per %lldx%lld matmul), "
              "probe %.1f GB/s just before: ratio %.2f; %s %.0f GMAC/s x %.2f per byte: roof %.1f GB/s "
              "(bound=%s), ratio to roof %.2f; cpu=\"%s\"\n",
              KernelName(type, isa, bits).c_str(), threads, T, best, one->bytes() / best / 1e6,
              static_cast<long long>(kN), static_cast<long long>(kN), probe_gbs, best / probe_gbs,
              bench::DotUnitName(unit).c_str(), peak, macs_per_byte, roof,
              compute_gbs < probe_gbs ? "compute" : "memory", best / roof, cpu.c_str());
        }
      }
    }
  }
}


}  // namespace
}  // namespace ellm::mlp
