// Reference quantisers and dequantisers (core/quants.h) of F32, F16, BF16,
// Q8_0, Q4_0, Q4_K, Q5_K and Q6_K: round trips on random rows, blocks built
// by hand from the ggml layouts, zeros, sizes, and a real F16 model file.
#include "core/quants.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/gguf.h"
#include "gtest/gtest.h"
#include "tests/tests_util.h"

namespace ellm {
namespace {

constexpr uint16_t kHalfOne = 0x3c00;           // 1.0
constexpr uint16_t kHalfHalf = 0x3800;          // 0.5
constexpr uint16_t kHalfThreeQuarters = 0x3a00; // 0.75
constexpr uint16_t kHalfMinusQuarter = 0xb400;  // -0.25

constexpr DType kAllTypes[] = {DType::kF32,  DType::kF16,  DType::kBF16, DType::kQ8_0,
                               DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K};
constexpr DType kBlockTypes[] = {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K,
                                 DType::kQ6_K};

// Quantises `x` (one row) through the traits table and reads it back. Guard
// bytes after the blocks catch a quantiser that writes past its row.
std::vector<float> RoundTrip(DType type, const std::vector<float>& x) {
  const DTypeTraits& t = Traits(type);
  const absl::StatusOr<uint64_t> bytes = DTypeBytes(type, x.size());
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  constexpr size_t kGuard = 64;
  std::vector<uint8_t> blocks(*bytes + kGuard, 0xab);
  t.quantize(x.data(), blocks.data(), static_cast<int64_t>(x.size()));
  for (size_t i = *bytes; i < blocks.size(); ++i) {
    EXPECT_EQ(blocks[i], 0xab) << t.name << " wrote past its row at byte " << i;
  }
  std::vector<float> y(x.size(), NAN);
  t.dequantize(blocks.data(), y.data(), static_cast<int64_t>(x.size()));
  return y;
}

enum class Dist { kNormal, kUniform, kOutliers, kSmallWeights };

const char* DistName(Dist d) {
  switch (d) {
    case Dist::kNormal: return "normal";
    case Dist::kUniform: return "uniform";
    case Dist::kOutliers: return "outliers";
    case Dist::kSmallWeights: return "small-weights";
  }
  return "?";
}

// normal: N(0, 1). uniform: U(-1, 1). outliers: N(0, 1) with about one value
// in 64 replaced by ±U(8, 24) (the heavy tails of real weight rows).
// small-weights: N(0, 0.02), the scale of initialised weights, to exercise
// half scales far below 1.
std::vector<float> MakeRow(Dist dist, size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::uniform_real_distribution<float> big(8.0f, 24.0f);
  std::uniform_int_distribution<int> one_in_64(0, 63);
  std::vector<float> x(n);
  for (float& v : x) {
    switch (dist) {
      case Dist::kNormal: v = normal(rng); break;
      case Dist::kUniform: v = uniform(rng); break;
      case Dist::kOutliers:
        v = normal(rng);
        if (one_in_64(rng) == 0) v = (uniform(rng) < 0 ? -1.0f : 1.0f) * big(rng);
        break;
      case Dist::kSmallWeights: v = 0.02f * normal(rng); break;
    }
  }
  return x;
}

// sqrt(sum (x - y)^2 / sum x^2): the RMS error as a fraction of the RMS.
double RelativeRmsError(const std::vector<float>& x, const std::vector<float>& y) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (static_cast<double>(x[i]) - y[i]) * (static_cast<double>(x[i]) - y[i]);
    den += static_cast<double>(x[i]) * x[i];
  }
  return std::sqrt(num / den);
}

// Bounds on the relative RMS round-trip error. Rounding to a uniform grid of
// step D costs D / sqrt(12) RMS. For N(0, 1) data (uniform and small-weight
// rows do no worse; real weights fit the same bounds), with the error we
// measured (seed fixed, worst over row lengths) in brackets:
//  F32  exact.
//  F16  11-bit significand: relative error <= 2^-11 per value, ~2^-11/sqrt(3)
//       = 2.8e-4 RMS [2.3e-4]. Bound 4e-4.
//  BF16 8-bit significand: ~2^-8/sqrt(3) = 2.3e-3 [1.8e-3]. Bound 3e-3.
//  Q8_0 D = amax / 127 per 32 values, E[amax] ~ 2.1: 0.0165/sqrt(12) = 0.48%
//       [0.55%, 0.57% on real weights]. Bound 0.7%.
//  Q6_K 64 levels (-32..31) per 16 values, amax of 16 normals ~ 1.8, so
//       D ~ 0.056: 1.6%; 8-bit sub-block scales add a little [1.73%, 1.83%].
//       Bound 2.2%.
//  Q5_K 32 levels across each 32-value sub-block's range (~4.1): D ~ 0.13,
//       3.8% before the min/scale search [3.51%, 3.62%]. Bound 4%.
//  Q4_K 16 levels across the range: D ~ 0.27, 7.9% before the search
//       [7.04%, 7.39%]. Bound 8%.
//  Q4_0 16 levels (-8..7) with D = amax / 8 ~ 0.26: 7.6%, plus the clipped
//       tail opposite the extreme, which has only 7 levels [8.96%, 9.12%].
//       Bound 10%.
// Outlier rows (one value in 64 is ±U(8, 24), mean square 277; the row mean
// square is ~5.3): a block holding an outlier A gets a step ~A / levels for all
// its values, which roughly doubles the relative error. For Q8_0, 40% of the
// 32-value blocks hold one: sqrt(0.4 * 277 / 127^2 / 12 / 5.3) = 1.04% [1.16%].
// Measured: Q4_0 17.1%, Q4_K 10.2%, Q5_K 5.12%, Q6_K 3.11%; F16 / BF16 as
// above. Bounds about 12% above those.
double ErrorBound(DType type, Dist dist = Dist::kNormal) {
  const bool outliers = dist == Dist::kOutliers;
  switch (type) {
    case DType::kF32: return 0.0;
    case DType::kF16: return 4e-4;
    case DType::kBF16: return 3e-3;
    case DType::kQ8_0: return outliers ? 0.013 : 0.007;
    case DType::kQ6_K: return outliers ? 0.035 : 0.022;
    case DType::kQ5_K: return outliers ? 0.057 : 0.04;
    case DType::kQ4_K: return outliers ? 0.115 : 0.08;
    case DType::kQ4_0: return outliers ? 0.19 : 0.10;
    default: return 0.0;
  }
}

TEST(QuantsTraitsTest, EveryReadTypeHasBothConverters) {
  for (DType type : kAllTypes) {
    const DTypeTraits& t = Traits(type);
    SCOPED_TRACE(std::string(t.name));
    EXPECT_NE(t.dequantize, nullptr);
    EXPECT_NE(t.quantize, nullptr);
  }
  // Types ellm does not convert yet keep both pointers empty.
  for (DType type : {DType::kQ4_1, DType::kQ5_0, DType::kQ5_1, DType::kQ8_1, DType::kQ2_K,
                     DType::kQ3_K, DType::kQ8_K}) {
    EXPECT_EQ(Traits(type).dequantize, nullptr);
    EXPECT_EQ(Traits(type).quantize, nullptr);
  }
}

TEST(QuantsTraitsTest, DTypeBytes) {
  EXPECT_EQ(*DTypeBytes(DType::kF32, 7), 28u);
  EXPECT_EQ(*DTypeBytes(DType::kF16, 3), 6u);
  EXPECT_EQ(*DTypeBytes(DType::kBF16, 5), 10u);
  EXPECT_EQ(*DTypeBytes(DType::kQ8_0, 32), 34u);
  EXPECT_EQ(*DTypeBytes(DType::kQ8_0, 128), 4u * 34u);
  EXPECT_EQ(*DTypeBytes(DType::kQ4_0, 64), 36u);
  EXPECT_EQ(*DTypeBytes(DType::kQ4_K, 256), 144u);
  EXPECT_EQ(*DTypeBytes(DType::kQ5_K, 768), 3u * 176u);
  EXPECT_EQ(*DTypeBytes(DType::kQ6_K, 512), 420u);
  EXPECT_FALSE(DTypeBytes(DType::kQ4_0, 48).ok());
  EXPECT_FALSE(DTypeBytes(DType::kQ4_K, 255).ok());
  EXPECT_FALSE(DTypeBytes(DType::kQ5_K, 128).ok());
  EXPECT_FALSE(DTypeBytes(DType::kQ6_K, 32).ok());
}

// Rows of 1, 2, 3 and 4 blocks (blocks of at least 32 values for the plain
// types, so that each row has enough values for a meaningful RMS), 24 rows
// each; the bound applies to the error over all rows of one length.
TEST(QuantsRoundTripTest, RandomRowsWithinBounds) {
  std::mt19937 rng(1234);
  for (DType type : kAllTypes) {
    const DTypeTraits& t = Traits(type);
    const size_t block = static_cast<size_t>(std::max<int64_t>(t.block_elements, kQK));
    for (Dist dist : {Dist::kNormal, Dist::kUniform, Dist::kOutliers, Dist::kSmallWeights}) {
      for (size_t blocks = 1; blocks <= 4; ++blocks) {
        std::vector<float> all_x, all_y;
        for (int row = 0; row < 24; ++row) {
          const std::vector<float> x = MakeRow(dist, blocks * block, rng);
          const std::vector<float> y = RoundTrip(type, x);
          all_x.insert(all_x.end(), x.begin(), x.end());
          all_y.insert(all_y.end(), y.begin(), y.end());
        }
        const double err = RelativeRmsError(all_x, all_y);
        EXPECT_LE(err, ErrorBound(type, dist))
            << t.name << " " << DistName(dist) << " rows of " << blocks << " blocks";
      }
    }
  }
}

TEST(QuantsRoundTripTest, Deterministic) {
  std::mt19937 rng(99);
  const std::vector<float> x = MakeRow(Dist::kOutliers, 512, rng);
  for (DType type : kAllTypes) {
    const DTypeTraits& t = Traits(type);
    std::vector<uint8_t> a(*DTypeBytes(type, x.size())), b(a.size(), 0x5a);
    t.quantize(x.data(), a.data(), static_cast<int64_t>(x.size()));
    t.quantize(x.data(), b.data(), static_cast<int64_t>(x.size()));
    EXPECT_EQ(a, b) << t.name;
  }
}

// Constant rows hit the degenerate branches of the scale searches (zero
// range, a sub-block with nothing but its min).
TEST(QuantsRoundTripTest, ConstantRows) {
  for (DType type : kAllTypes) {
    for (float c : {1.0f, -3.0f, 0.015625f}) {
      const std::vector<float> x(256, c);
      const std::vector<float> y = RoundTrip(type, x);
      EXPECT_LE(RelativeRmsError(x, y), ErrorBound(type) + 1e-6)
          << Traits(type).name << " constant " << c;
    }
  }
}

TEST(QuantsRoundTripTest, ZerosGiveZeros) {
  for (DType type : kAllTypes) {
    const std::vector<float> x(512, 0.0f);
    const std::vector<float> y = RoundTrip(type, x);
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_EQ(y[i], 0.0f) << Traits(type).name << " at " << i;
    }
  }
}

// A row with zero blocks in between others: the zero blocks read back as zeros.
TEST(QuantsRoundTripTest, ZeroBlockAmongOthers) {
  std::mt19937 rng(5);
  for (DType type : kBlockTypes) {
    const size_t block = static_cast<size_t>(Traits(type).block_elements);
    std::vector<float> x = MakeRow(Dist::kNormal, 3 * block, rng);
    std::fill(x.begin() + block, x.begin() + 2 * block, 0.0f);
    const std::vector<float> y = RoundTrip(type, x);
    for (size_t i = block; i < 2 * block; ++i) ASSERT_EQ(y[i], 0.0f) << Traits(type).name;
  }
}

// --- Known answers: blocks written byte by byte from the ggml layouts -------

TEST(QuantsKnownAnswerTest, Q8_0) {
  BlockQ8_0 b{};
  b.d = kHalfThreeQuarters;
  b.qs[0] = -128;
  b.qs[1] = 127;
  b.qs[7] = 4;
  b.qs[31] = -1;
  float y[32];
  DequantizeRowQ8_0(&b, y, 32);
  EXPECT_EQ(y[0], -96.0f);
  EXPECT_EQ(y[1], 95.25f);
  EXPECT_EQ(y[7], 3.0f);
  EXPECT_EQ(y[31], -0.75f);
  EXPECT_EQ(y[2], 0.0f);
}

TEST(QuantsKnownAnswerTest, Q4_0) {
  BlockQ4_0 b[2]{};
  b[0].d = kHalfMinusQuarter;  // a negative d, as the quantiser makes for a negative extreme
  for (uint8_t& q : b[0].qs) q = 0x88;  // both nibbles 8: value 0
  b[0].qs[0] = 0x0f;   // element 0: 15 - 8 = 7; element 16: 0 - 8 = -8
  b[0].qs[15] = 0x98;  // element 15: 0; element 31: 9 - 8 = 1
  b[1].d = kHalfOne;
  for (int i = 0; i < 16; ++i) b[1].qs[i] = static_cast<uint8_t>(i | (15 - i) << 4);
  float y[64];
  DequantizeRowQ4_0(b, y, 64);
  EXPECT_EQ(y[0], -1.75f);
  EXPECT_EQ(y[16], 2.0f);
  EXPECT_EQ(y[15], 0.0f);
  EXPECT_EQ(y[31], -0.25f);
  EXPECT_EQ(y[5], 0.0f);
  // Second block: element i (< 16) is i - 8, element 16 + i is 7 - i.
  EXPECT_EQ(y[32 + 0], -8.0f);
  EXPECT_EQ(y[32 + 15], 7.0f);
  EXPECT_EQ(y[32 + 16], 7.0f);
  EXPECT_EQ(y[32 + 31], -8.0f);
  EXPECT_EQ(y[32 + 20], 3.0f);
}

// Sub-block scales and mins shared by the Q4_K and Q5_K blocks below, and
// their packing into scales[12] worked out by hand:
//   sc = {1, 2, 3, 4, 17, 33, 48, 63},  m = {0, 1, 2, 3, 20, 37, 50, 62}
//   sc[4..7] = 0b01'0001, 0b10'0001, 0b11'0000, 0b11'1111
//   m[4..7]  = 0b01'0100, 0b10'0101, 0b11'0010, 0b11'1110
//   bytes 0-3:  sc[j] | (sc[j+4] >> 4) << 6 = 0x41, 0x82, 0xc3, 0xc4
//   bytes 4-7:  m[j]  | (m[j+4]  >> 4) << 6 = 0x40, 0x81, 0xc2, 0xc3
//   bytes 8-11: (sc[j+4] & 15) | (m[j+4] & 15) << 4 = 0x41, 0x51, 0x20, 0xef
constexpr uint8_t kSc[8] = {1, 2, 3, 4, 17, 33, 48, 63};
constexpr uint8_t kM[8] = {0, 1, 2, 3, 20, 37, 50, 62};
constexpr uint8_t kPackedScales[12] = {0x41, 0x82, 0xc3, 0xc4, 0x40, 0x81,
                                       0xc2, 0xc3, 0x41, 0x51, 0x20, 0xef};

TEST(QuantsKnownAnswerTest, ScaleMinK4Packing) {
  uint8_t packed[12] = {};
  for (int j = 0; j < 8; ++j) PackScaleMinK4(packed, j, kSc[j], kM[j]);
  EXPECT_EQ(std::memcmp(packed, kPackedScales, 12), 0);
  // Packing in the other order gives the same bytes.
  uint8_t reversed[12] = {};
  for (int j = 7; j >= 0; --j) PackScaleMinK4(reversed, j, kSc[j], kM[j]);
  EXPECT_EQ(std::memcmp(reversed, kPackedScales, 12), 0);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc = 0, m = 0;
    UnpackScaleMinK4(kPackedScales, j, &sc, &m);
    EXPECT_EQ(sc, kSc[j]) << j;
    EXPECT_EQ(m, kM[j]) << j;
  }
}

TEST(QuantsKnownAnswerTest, Q4_K) {
  BlockQ4_K b{};
  b.d = kHalfOne;
  b.dmin = kHalfHalf;
  std::memcpy(b.scales, kPackedScales, 12);
  // qs[32c + l]: low nibble l & 15 (element 64c + l), high nibble 15 - (l & 15)
  // (element 64c + 32 + l).
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) b.qs[32 * c + l] = static_cast<uint8_t>((l & 15) | (15 - (l & 15)) << 4);
  }
  float y[256];
  DequantizeRowQ4_K(&b, y, 256);
  // x = 1.0 * sc[j] * q - 0.5 * m[j], j = element / 32.
  EXPECT_EQ(y[0], 0.0f);       // j 0: 1*0 - 0
  EXPECT_EQ(y[5], 5.0f);       // j 0: 1*5 - 0
  EXPECT_EQ(y[35], 23.5f);     // j 1, q 15-3 = 12: 2*12 - 0.5
  EXPECT_EQ(y[71], 20.0f);     // j 2, q 7: 3*7 - 1
  EXPECT_EQ(y[111], -1.5f);    // j 3, q 0: 0 - 1.5
  EXPECT_EQ(y[130], 24.0f);    // j 4, q 2: 17*2 - 10
  EXPECT_EQ(y[180], 344.5f);   // j 5, l 20, q 15-4 = 11: 33*11 - 18.5
  EXPECT_EQ(y[223], 695.0f);   // j 6, l 31, q 15: 48*15 - 25
  EXPECT_EQ(y[240], 914.0f);   // j 7, l 16, q 15: 63*15 - 31
  EXPECT_EQ(y[255], -31.0f);   // j 7, l 31, q 0
  // Every element against the formula with the hand-written sc / m tables.
  for (int e = 0; e < 256; ++e) {
    const int j = e / 32, l = e % 32;
    const int q = (j % 2 == 0) ? (l & 15) : 15 - (l & 15);
    EXPECT_EQ(y[e], 1.0f * kSc[j] * q - 0.5f * kM[j]) << e;
  }
}

TEST(QuantsKnownAnswerTest, Q5_K) {
  BlockQ5_K b{};
  b.d = kHalfOne;
  b.dmin = kHalfHalf;
  std::memcpy(b.scales, kPackedScales, 12);
  // Low 4 bits zero except:
  b.qs[3] = 0x21;        // element 3: 1, element 35: 2
  b.qs[64 + 10] = 0xf5;  // chunk 2: element 138: 5, element 170: 15
  // High bits (bit 2c: element 64c + l, bit 2c + 1: element 64c + 32 + l):
  b.qh[3] = 0x01;   // element 3 +16
  b.qh[4] = 0x80;   // bit 7: element 192 + 32 + 4 = 228 +16
  b.qh[5] = 0x04;   // bit 2: element 64 + 5 = 69 +16
  b.qh[6] = 0x08;   // bit 3: element 64 + 32 + 6 = 102 +16
  b.qh[10] = 0x30;  // bits 4, 5: elements 138 and 170 +16
  float y[256];
  DequantizeRowQ5_K(&b, y, 256);
  // Elements with q = 0 read -0.5 * m[j].
  std::vector<float> expected(256);
  for (int e = 0; e < 256; ++e) expected[e] = -0.5f * kM[e / 32];
  expected[3] = 17.0f;      // j 0, q 17: 1*17 - 0
  expected[35] = 3.5f;      // j 1, q 2: 2*2 - 0.5
  expected[228] = 977.0f;   // j 7, q 16: 63*16 - 31
  expected[69] = 47.0f;     // j 2, q 16: 3*16 - 1
  expected[102] = 62.5f;    // j 3, q 16: 4*16 - 1.5
  expected[138] = 347.0f;   // j 4, q 21: 17*21 - 10
  expected[170] = 1004.5f;  // j 5, q 31: 33*31 - 18.5
  for (int e = 0; e < 256; ++e) EXPECT_EQ(y[e], expected[e]) << e;
}

TEST(QuantsKnownAnswerTest, Q6_K) {
  BlockQ6_K b{};
  b.d = kHalfHalf;
  const int8_t scales[16] = {1, -2, 3, -4, 5, -6, 7, -8, 10, -20, 30, -40, 50, -60, 127, -128};
  std::memcpy(b.scales, scales, 16);
  // All quants 0 (value q - 32 = -32) except these; element 128h + 32k + l
  // takes its low 4 bits from ql[64h + 32(k&1) + l] (>> 4 when k >= 2) and its
  // high 2 bits from qh[32h + l] >> 2k.
  b.ql[0] = 0xa5;    // element 0 low 5, element 64 low 10
  b.qh[0] = 0x32;    // element 0 high 2 (bits 0-1), element 64 high 3 (bits 4-5)
  b.ql[49] = 0x0f;   // element 32 + 17 = 49 low 15
  b.qh[17] = 0x04;   // element 49 high 1 (bits 2-3)
  b.qh[31] = 0xc0;   // element 96 + 31 = 127 high 3 (bits 6-7), low 0
  b.ql[99] = 0x07;   // half 1, k 1, l 3: element 163 low 7
  b.qh[35] = 0x08;   // element 163 high 2
  b.ql[116] = 0xf0;  // half 1, k 3, l 20: element 244 low 15
  b.qh[52] = 0xc0;   // element 244 high 3
  b.ql[64] = 0x10;   // half 1, k 2, l 0: element 192 low 1, high 0
  float y[256];
  DequantizeRowQ6_K(&b, y, 256);
  // x = 0.5 * scales[e / 16] * (q - 32); q = 0 gives -16 * scales[e / 16].
  std::vector<float> expected(256);
  for (int e = 0; e < 256; ++e) expected[e] = -16.0f * scales[e / 16];
  expected[0] = 2.5f;       // q 5 | 2<<4 = 37 -> 5; 0.5*1*5
  expected[64] = 65.0f;     // q 10 | 3<<4 = 58 -> 26; 0.5*5*26
  expected[49] = 2.0f;      // q 15 | 1<<4 = 31 -> -1; 0.5*-4*-1
  expected[127] = -64.0f;   // q 0 | 3<<4 = 48 -> 16; 0.5*-8*16
  expected[163] = 105.0f;   // q 7 | 2<<4 = 39 -> 7; 0.5*30*7
  expected[244] = -1984.0f; // q 63 -> 31; 0.5*-128*31
  expected[192] = -775.0f;  // q 1 -> -31; 0.5*50*-31
  for (int e = 0; e < 256; ++e) EXPECT_EQ(y[e], expected[e]) << e;
}

// The quantisers' own blocks follow the layouts: a row whose values sit on
// one block's grid comes back exactly, and the block's fields read as set.
TEST(QuantsKnownAnswerTest, QuantiserFieldsQ8_0AndQ4_0) {
  float x[32];
  for (int i = 0; i < 32; ++i) x[i] = static_cast<float>(i - 16);  // extreme -16
  BlockQ8_0 q8;
  QuantizeRowQ8_0(x, &q8, 32);
  EXPECT_EQ(HalfToFloat(q8.d), HalfToFloat(FloatToHalf(16.0f / 127)));
  EXPECT_EQ(q8.qs[0], -127);  // -16 is the extreme
  EXPECT_EQ(q8.qs[16], 0);

  BlockQ4_0 q4;
  QuantizeRowQ4_0(x, &q4, 32);
  EXPECT_EQ(HalfToFloat(q4.d), 2.0f);  // d = -16 / -8
  EXPECT_EQ(q4.qs[0] & 15, 0);         // -16 = 2 * (0 - 8)
  float y[32];
  DequantizeRowQ4_0(&q4, y, 32);
  // Even values between -16 and 14 are on the grid 2 * (q - 8); odd ones are
  // half a step off; 15 is past the top level 14.
  for (int i = 0; i < 32; ++i) {
    if (x[i] <= 14 && static_cast<int>(x[i]) % 2 == 0) {
      EXPECT_EQ(y[i], x[i]) << i;
    }
    EXPECT_LE(std::fabs(y[i] - x[i]), 1.0f) << i;
  }
}

// --- A real model file --------------------------------------------------------

// llama-2-tiny-random.gguf: F16 matrices and F32 norms that are exactly 1.0.
TEST(QuantsRealFileTest, TinyLlamaF16) {
  const std::string path = testing::ModelsDir() + "/llama-2-tiny-random.gguf";
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok() && file.status().code() == absl::StatusCode::kNotFound) {
    GTEST_SKIP() << path << " not present";
  }
  ASSERT_TRUE(file.ok()) << file.status();
  int f16_tensors = 0, norms = 0;
  for (const GgufTensorInfo& info : (*file)->tensors()) {
    SCOPED_TRACE(info.name);
    const DTypeTraits& t = Traits(info.type);
    ASSERT_NE(t.dequantize, nullptr);
    const uint8_t* data = (*file)->TensorData(info);
    std::vector<float> values(static_cast<size_t>(info.elements()));
    t.dequantize(data, values.data(), info.elements());
    if (info.name.find("norm") != std::string::npos) {
      ++norms;
      for (float v : values) ASSERT_EQ(v, 1.0f);
      continue;
    }
    ASSERT_EQ(info.type, DType::kF16);
    ++f16_tensors;
    double sum2 = 0;
    for (float v : values) {
      ASSERT_TRUE(std::isfinite(v));
      sum2 += static_cast<double>(v) * v;
    }
    const double rms = std::sqrt(sum2 / values.size());
    EXPECT_GT(rms, 0.002);  // random init, std about 0.02
    EXPECT_LT(rms, 0.2);
    // F16 -> float -> F16 is exact: the file's bytes come back.
    std::string back(info.bytes, '\0');
    t.quantize(values.data(), back.data(), info.elements());
    EXPECT_EQ(std::memcmp(back.data(), data, info.bytes), 0);
    // Real weights through every block format, as one long row when the
    // tensor is a whole number of super-blocks.
    if (values.size() % kQK_K == 0) {
      for (DType type : kBlockTypes) {
        EXPECT_LE(RelativeRmsError(values, RoundTrip(type, values)), ErrorBound(type))
            << Traits(type).name;
      }
    }
  }
  EXPECT_EQ(f16_tensors, 9);
  EXPECT_EQ(norms, 3);
}

}  // namespace
}  // namespace ellm
