// DType traits table, DTypeBytes, and the half / bfloat16 conversions.
#include "core/dtype.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace ellm {
namespace {

float FromBits(uint32_t bits) { return std::bit_cast<float>(bits); }

TEST(DTypeTraitsTest, BlockSizesMatchGgml) {
  struct Expected {
    DType type;
    uint32_t id;
    const char* name;
    int64_t block_elements;
    int64_t block_bytes;
    bool readable;
  };
  const Expected expected[] = {
      {DType::kF32, 0, "f32", 1, 4, true},       {DType::kF16, 1, "f16", 1, 2, true},
      {DType::kQ4_0, 2, "q4_0", 32, 18, true},  {DType::kQ4_1, 3, "q4_1", 32, 20, false},
      {DType::kQ5_0, 6, "q5_0", 32, 22, false},  {DType::kQ5_1, 7, "q5_1", 32, 24, false},
      {DType::kQ8_0, 8, "q8_0", 32, 34, true},  {DType::kQ8_1, 9, "q8_1", 32, 36, false},
      {DType::kQ2_K, 10, "q2_K", 256, 84, false}, {DType::kQ3_K, 11, "q3_K", 256, 110, false},
      {DType::kQ4_K, 12, "q4_K", 256, 144, true}, {DType::kQ5_K, 13, "q5_K", 256, 176, true},
      {DType::kQ6_K, 14, "q6_K", 256, 210, true}, {DType::kQ8_K, 15, "q8_K", 256, 292, false},
      {DType::kBF16, 30, "bf16", 1, 2, true},
  };
  for (const Expected& e : expected) {
    SCOPED_TRACE(e.name);
    const DTypeTraits* t = FindDTypeTraits(e.id);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t, &Traits(e.type));
    EXPECT_EQ(t->type, e.type);
    EXPECT_EQ(t->name, e.name);
    EXPECT_EQ(t->block_elements, e.block_elements);
    EXPECT_EQ(t->block_bytes, e.block_bytes);
    EXPECT_EQ(t->dequantize != nullptr, e.readable);
  }
}

TEST(DTypeTraitsTest, UnknownIdsHaveNoTraits) {
  // 4 and 5 were Q4_2 / Q4_3, removed from ggml; 16+ are types ellm lacks.
  for (uint32_t id : {4u, 5u, 16u, 29u, 31u, 99u, 0xffffffffu}) {
    EXPECT_EQ(FindDTypeTraits(id), nullptr) << id;
  }
}

TEST(DTypeBytesTest, WholeBlocks) {
  EXPECT_EQ(*DTypeBytes(DType::kF32, 10), 40u);
  EXPECT_EQ(*DTypeBytes(DType::kF16, 7), 14u);
  EXPECT_EQ(*DTypeBytes(DType::kBF16, 0), 0u);
  EXPECT_EQ(*DTypeBytes(DType::kQ8_0, 64), 68u);
  EXPECT_EQ(*DTypeBytes(DType::kQ4_K, 512), 288u);
  EXPECT_EQ(*DTypeBytes(DType::kQ6_K, 4096), 16u * 210u);
}

TEST(DTypeBytesTest, PartialBlockIsAnError) {
  absl::StatusOr<uint64_t> bytes = DTypeBytes(DType::kQ8_0, 33);
  ASSERT_FALSE(bytes.ok());
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bytes.status().message()).find("whole number of q8_0 blocks"),
            std::string::npos)
      << bytes.status();
}

TEST(DTypeBytesTest, OverflowIsAnError) {
  absl::StatusOr<uint64_t> bytes = DTypeBytes(DType::kF32, uint64_t{1} << 62);
  ASSERT_FALSE(bytes.ok());
  EXPECT_NE(std::string(bytes.status().message()).find("overflows"), std::string::npos)
      << bytes.status();
  // Largest whole count of Q8_0 blocks: 2^64 / 32 blocks * 34 bytes overflows too.
  EXPECT_FALSE(DTypeBytes(DType::kQ8_0, ~uint64_t{0} & ~uint64_t{31}).ok());
}

TEST(HalfTest, KnownValuesToFloat) {
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);            // largest finite
  EXPECT_EQ(HalfToFloat(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(HalfToFloat(0x03ff), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(HalfToFloat(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x0000), 0.0f);
  EXPECT_FALSE(std::signbit(HalfToFloat(0x0000)));
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
  EXPECT_EQ(HalfToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(HalfToFloat(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7c01)));  // signalling NaN stays NaN
}

TEST(HalfTest, KnownValuesFromFloat) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(1.0f / 3.0f), 0x3555);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65519.99f), 0x7bff);  // just under the halfway point
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);   // halfway, ties to even = inf
  EXPECT_EQ(FloatToHalf(1e6f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-1e6f), 0xfc00);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), 0xfc00);
  const uint16_t nan = FloatToHalf(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x03ff, 0);
  // A NaN whose payload lives only in the low float bits must not become inf.
  EXPECT_NE(FloatToHalf(FromBits(0x7f800001u)) & 0x03ff, 0);
}

TEST(HalfTest, RoundsToNearestEven) {
  const float ulp1 = std::ldexp(1.0f, -10);  // half spacing in [1, 2)
  EXPECT_EQ(FloatToHalf(1.0f + ulp1 / 2), 0x3c00);      // tie -> even (down)
  EXPECT_EQ(FloatToHalf(1.0f + 3 * ulp1 / 2), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(FloatToHalf(std::nextafter(1.0f + ulp1 / 2, 2.0f)), 0x3c01);
  EXPECT_EQ(FloatToHalf(std::nextafter(1.0f + ulp1 / 2, 0.0f)), 0x3c00);
  // Mantissa carry into the exponent: just under 2 rounds to 2.
  EXPECT_EQ(FloatToHalf(std::nextafter(2.0f, 0.0f)), 0x4000);
}

TEST(HalfTest, Subnormals) {
  const float tiny = std::ldexp(1.0f, -24);  // one subnormal unit
  EXPECT_EQ(FloatToHalf(tiny), 0x0001);
  EXPECT_EQ(FloatToHalf(-tiny), 0x8001);
  EXPECT_EQ(FloatToHalf(tiny / 2), 0x0000);  // tie between 0 and 1 unit -> 0
  EXPECT_EQ(FloatToHalf(std::nextafter(tiny / 2, 1.0f)), 0x0001);
  EXPECT_EQ(FloatToHalf(1.5f * tiny), 0x0002);  // tie between 1 and 2 -> 2
  EXPECT_EQ(FloatToHalf(2.5f * tiny), 0x0002);  // tie between 2 and 3 -> 2
  EXPECT_EQ(FloatToHalf(1e-10f), 0x0000);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::denorm_min()), 0x0000);
  // Largest subnormal + half a unit ties up to the smallest normal (even).
  EXPECT_EQ(FloatToHalf(1023.5f * tiny), 0x0400);
  EXPECT_EQ(FloatToHalf(1022.5f * tiny), 0x03fe);
}

TEST(HalfTest, EveryHalfRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    const bool is_nan = (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0;
    if (is_nan) {
      ASSERT_TRUE(std::isnan(f)) << h;
      ASSERT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f)))) << h;
    } else {
      ASSERT_EQ(FloatToHalf(f), h) << std::hex << h;
    }
  }
}

// For random floats in the half range, the chosen half is at least as close
// as both neighbours, and on a tie it is the even one.
TEST(HalfTest, RandomFloatsRoundToNearest) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> exponent(-26.0f, 16.0f);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  for (int i = 0; i < 200000; ++i) {
    float f = std::ldexp(mantissa(rng), static_cast<int>(std::floor(exponent(rng))));
    if (i % 2) f = -f;
    if (std::fabs(f) >= 65520.0f) continue;
    const uint16_t h = FloatToHalf(f);
    ASSERT_EQ(h >> 15, std::signbit(f) ? 1 : 0) << f;
    const uint16_t mag = h & 0x7fff;
    ASSERT_LT(mag, 0x7c00) << f;  // finite
    const double err = std::fabs(static_cast<double>(f) - HalfToFloat(h));
    for (int step : {-1, 1}) {
      const int neighbour = mag + step;
      if (neighbour < 0 || neighbour >= 0x7c00) continue;
      const uint16_t n = static_cast<uint16_t>((h & 0x8000) | neighbour);
      const double n_err = std::fabs(static_cast<double>(f) - HalfToFloat(n));
      ASSERT_LE(err, n_err) << f;
      if (err == n_err) {
        ASSERT_EQ(h & 1, 0) << "tie not to even for " << f;
      }
    }
  }
}

TEST(HalfTest, RandomFloatsRoundTripWithinHalfAnUlp) {
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> dist(-60000.0f, 60000.0f);
  for (int i = 0; i < 100000; ++i) {
    const float f = dist(rng);
    const float back = HalfToFloat(FloatToHalf(f));
    if (std::fabs(f) >= std::ldexp(1.0f, -14)) {
      // Normal halves have 11 significant bits: relative error <= 2^-11.
      ASSERT_LE(std::fabs(back - f), std::ldexp(std::fabs(f), -11)) << f;
    }
    ASSERT_EQ(FloatToHalf(back), FloatToHalf(f));
  }
}

TEST(Bf16Test, KnownValues) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBf16(3.14159265f), 0x4049);
  EXPECT_EQ(Bf16ToFloat(0x4049), 3.140625f);
  EXPECT_EQ(FloatToBf16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(Bf16ToFloat(0x7f80), std::numeric_limits<float>::infinity());
  // Ties to even on the 16 dropped bits.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808000u)), 0x3f80);
  EXPECT_EQ(FloatToBf16(FromBits(0x3f818000u)), 0x3f82);
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808001u)), 0x3f81);
  // The largest float rounds up to inf, as round-to-nearest demands.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
  // Subnormals keep their top bits.
  EXPECT_EQ(FloatToBf16(FromBits(0x00010000u)), 0x0001);
}

TEST(Bf16Test, NanStaysNan) {
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // Payload only in the dropped bits: truncation alone would give inf.
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(FromBits(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(FromBits(0xffffffffu)))));
}

TEST(Bf16Test, EveryBf16RoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f), h) << std::hex << h;
  }
}

TEST(Bf16Test, RandomFloatsWithinHalfAnUlp) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const float f = FromBits(bits(rng));
    if (!std::isfinite(f) || std::fabs(f) < std::numeric_limits<float>::min()) continue;
    const float back = Bf16ToFloat(FloatToBf16(f));
    if (std::isinf(back)) continue;  // rounded past the largest bf16
    ASSERT_LE(std::fabs(static_cast<double>(back) - f), std::ldexp(std::fabs(f), -8)) << f;
  }
}

TEST(DequantizeTest, PlainTypes) {
  const std::vector<float> values = {0.0f, 1.0f, -2.5f, 0.15625f, 65504.0f};
  std::vector<float> out(values.size());

  Traits(DType::kF32).dequantize(values.data(), out.data(), values.size());
  EXPECT_EQ(out, values);

  std::vector<uint16_t> halves;
  for (float v : values) halves.push_back(FloatToHalf(v));
  Traits(DType::kF16).dequantize(halves.data(), out.data(), values.size());
  EXPECT_EQ(out, values);  // all exactly representable in half

  std::vector<uint16_t> bf16s;
  for (float v : values) bf16s.push_back(FloatToBf16(v));
  Traits(DType::kBF16).dequantize(bf16s.data(), out.data(), values.size());
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(out[i], Bf16ToFloat(bf16s[i]));
}

}  // namespace
}  // namespace ellm
