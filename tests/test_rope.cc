// core/rope.h: the rotation frequencies of every scaling (none, linear,
// llama3 rope_freqs, YaRN) and the rotation itself, against independent
// double-precision implementations written here from the published
// definitions (Meta's llama3 scaling as llama.cpp's converter writes it into
// rope_freqs.weight; YaRN as ggml's rope_yarn computes it), at positions near
// 0, near the original context and far beyond it.
#include "core/rope.h"

#include <algorithm>
#include <cmath>
#include <complex>
#include <functional>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace ellm {
namespace {

ModelConfig RopeConfig(int dims, double base, bool neox) {
  ModelConfig c;
  c.arch = neox ? "qwen2" : "llama";
  c.rope_dims = dims;
  c.head_dim = dims;
  c.rope_base = static_cast<float>(base);
  c.rope_neox = neox;
  return c;
}

// Meta's llama3 frequency factors (what convert_hf_to_gguf.py stores in
// rope_freqs.weight): wavelengths shorter than old_context / high_freq_factor
// keep their frequency, longer than old_context / low_freq_factor are divided
// by `factor`, and those between are smoothed.
std::vector<float> Llama3Factors(int dims, double base, double factor, double low, double high,
                                 double old_context) {
  std::vector<float> out;
  for (int i = 0; i < dims / 2; ++i) {
    const double freq = 1.0 / std::pow(base, 2.0 * i / dims);
    const double wavelen = 2 * M_PI / freq;
    if (wavelen < old_context / high) {
      out.push_back(1.0f);
    } else if (wavelen > old_context / low) {
      out.push_back(static_cast<float>(factor));
    } else {
      const double smooth = (old_context / wavelen - low) / (high - low);
      out.push_back(static_cast<float>(1.0 / ((1 - smooth) / factor + smooth)));
    }
  }
  return out;
}

// YaRN's angle for pair i at `pos`, in the shape of its definition: a mix of
// the interpolated angle (theta / factor) and the extrapolated one (theta),
// weighted by a ramp over the pairs between the correction dimensions.
double YarnAngle(int i, int64_t pos, int dims, double base, double factor, int original_context) {
  auto corr_dim = [&](double rotations) {
    return dims * std::log(original_context / (rotations * 2 * M_PI)) / (2 * std::log(base));
  };
  const double lo = std::max(0.0, std::floor(corr_dim(32)));
  const double hi = std::min(dims - 1.0, std::ceil(corr_dim(1)));
  const double extrap = pos * std::pow(base, -2.0 * i / dims);
  const double interp = extrap / factor;
  const double y = (i - lo) / std::max(0.001, hi - lo);
  const double ramp = 1 - std::min(1.0, std::max(0.0, y));
  return interp * (1 - ramp) + extrap * ramp;
}

// Rotates each pair of x (layout per `neox`) by angle(i) with magnitude m,
// as complex multiplication in double.
std::vector<double> RotateRef(const std::vector<float>& x, int heads, int head_dim, int dims,
                              bool neox, const std::function<double(int)>& angle, double m) {
  std::vector<double> out(x.begin(), x.end());
  const int half = dims / 2;
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < half; ++i) {
      const int a = h * head_dim + (neox ? i : 2 * i);
      const int b = h * head_dim + (neox ? i + half : 2 * i + 1);
      const std::complex<double> z = std::complex<double>(x[a], x[b]) * std::polar(m, angle(i));
      out[a] = z.real();
      out[b] = z.imag();
    }
  }
  return out;
}

// Rope::CosSin + Rotate against RotateRef at positions near 0, near the
// original context and far beyond it.
void ExpectRotationMatches(const ModelConfig& c, int head_dim,
                           const std::function<double(int, int64_t)>& angle, double m,
                           int original_context) {
  const Rope rope(c);
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  const int heads = 3;
  std::vector<float> cos_sin(c.rope_dims);
  for (int64_t pos : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{original_context} - 1,
                      int64_t{original_context}, int64_t{original_context} + 17,
                      int64_t{4} * original_context + 5, int64_t{1} << 20}) {
    std::vector<float> x(heads * head_dim);
    for (float& v : x) v = normal(gen);
    std::vector<float> y = x;
    rope.CosSin(pos, cos_sin.data());
    rope.Rotate(cos_sin.data(), y.data(), heads, head_dim);
    const std::vector<double> ref =
        RotateRef(x, heads, head_dim, c.rope_dims, c.rope_neox, [&](int i) { return angle(i, pos); }, m);
    float max_abs = 0;
    for (float v : x) max_abs = std::max(max_abs, std::fabs(v));
    for (int k = 0; k < heads * head_dim; ++k) {
      if (k % head_dim >= c.rope_dims) {
        ASSERT_EQ(y[k], x[k]) << "dimensions past rope_dims must not move";
        continue;
      }
      // float cos/sin and products: a few ulp of the largest element.
      ASSERT_NEAR(y[k], ref[k], 5e-7 * m * max_abs) << "pos " << pos << " k " << k;
    }
  }
}

TEST(Rope, PlainFrequenciesAndBothLayouts) {
  for (bool neox : {false, true}) {
    for (int dims : {2, 8, 64, 128}) {
      for (double base : {10000.0, 1e6}) {
        const ModelConfig c = RopeConfig(dims, base, neox);
        const Rope rope(c);
        ASSERT_EQ(rope.freq().size(), static_cast<size_t>(dims / 2));
        EXPECT_EQ(rope.mscale(), 1.0);
        for (int i = 0; i < dims / 2; ++i) {
          EXPECT_DOUBLE_EQ(rope.freq()[i], std::pow(base, -2.0 * i / dims));
        }
        ExpectRotationMatches(
            c, dims, [&](int i, int64_t pos) { return pos * std::pow(base, -2.0 * i / dims); }, 1,
            4096);
      }
    }
  }
}

TEST(Rope, PartialRotationLeavesTheTail) {
  ModelConfig c = RopeConfig(32, 10000, false);
  c.head_dim = 64;
  ExpectRotationMatches(
      c, 64, [&](int i, int64_t pos) { return pos * std::pow(10000.0, -2.0 * i / 32); }, 1, 2048);
  c.rope_neox = true;
  ExpectRotationMatches(
      c, 64, [&](int i, int64_t pos) { return pos * std::pow(10000.0, -2.0 * i / 32); }, 1, 2048);
}

TEST(Rope, PositionZeroIsIdentityAndRotationsCompose) {
  const Rope rope(RopeConfig(64, 10000, false));
  std::mt19937 gen(11);
  std::normal_distribution<float> normal;
  std::vector<float> x(64);
  for (float& v : x) v = normal(gen);
  std::vector<float> cs(64), y = x;
  rope.CosSin(0, cs.data());
  rope.Rotate(cs.data(), y.data(), 1, 64);
  EXPECT_EQ(y, x);
  // Rotating by 5 then 12 equals rotating by 17 (within rounding): catches a
  // frequency that depends on anything but pos * freq.
  std::vector<float> two = x, one = x;
  rope.CosSin(5, cs.data());
  rope.Rotate(cs.data(), two.data(), 1, 64);
  rope.CosSin(12, cs.data());
  rope.Rotate(cs.data(), two.data(), 1, 64);
  rope.CosSin(17, cs.data());
  rope.Rotate(cs.data(), one.data(), 1, 64);
  for (int d = 0; d < 64; ++d) EXPECT_NEAR(two[d], one[d], 1e-5) << d;
}

TEST(Rope, Llama3FactorsDivideEachPairsFrequency) {
  // Llama 3.1: base 5e5, head dim 128, factor 8, low 1, high 4, 8192 original.
  const std::vector<float> factors = Llama3Factors(128, 500000, 8, 1, 4, 8192);
  // The factors llama.cpp's converter writes for Llama 3.1 (pairs 0-28 keep
  // their frequency, 35-63 are divided by 8, 29-34 are smoothed).
  const float smoothed[] = {1.207484f, 1.553415f, 2.026313f, 2.694530f, 3.684253f, 5.257327f};
  for (int i = 0; i < 64; ++i) {
    const float want = i < 29 ? 1.0f : i >= 35 ? 8.0f : smoothed[i - 29];
    ASSERT_NEAR(factors[i], want, 2e-5 * want) << i;
  }
  for (bool neox : {false, true}) {
    ModelConfig c = RopeConfig(128, 500000, neox);
    c.rope_freq_factors = factors;
    const Rope rope(c);
    for (int i = 0; i < 64; ++i) {
      EXPECT_DOUBLE_EQ(rope.freq()[i], std::pow(500000.0, -2.0 * i / 128) / factors[i]) << i;
    }
    EXPECT_EQ(rope.mscale(), 1.0);
    ExpectRotationMatches(
        c, 128,
        [&](int i, int64_t pos) { return pos * std::pow(500000.0, -2.0 * i / 128) / factors[i]; },
        1, 8192);
  }
}

TEST(Rope, LinearScalingDividesEveryFrequency) {
  ModelConfig c = RopeConfig(64, 10000, false);
  c.rope_scaling.type = RopeScalingType::kLinear;
  c.rope_scaling.factor = 4;
  c.rope_scaling.attn_factor = 1.25f;
  const Rope rope(c);
  EXPECT_DOUBLE_EQ(rope.mscale(), 1.25);
  for (int i = 0; i < 32; ++i) EXPECT_DOUBLE_EQ(rope.freq()[i], std::pow(10000.0, -2.0 * i / 64) / 4);
  ExpectRotationMatches(
      c, 64, [&](int i, int64_t pos) { return pos / 4.0 * std::pow(10000.0, -2.0 * i / 64); },
      1.25, 4096);
}

TEST(Rope, YarnMatchesItsDefinition) {
  struct Case {
    int dims;
    double base;
    double factor;
    int original;
    int lo, hi;  // correction dims llama.cpp computes for these settings
  };
  for (const Case& k : {Case{128, 1e6, 4, 32768, 23, 40}, Case{128, 500000, 8, 8192, 18, 35},
                        Case{64, 10000, 2, 2048, 0, 0}}) {
    for (bool neox : {true, false}) {
      ModelConfig c = RopeConfig(k.dims, k.base, neox);
      c.rope_scaling.type = RopeScalingType::kYarn;
      c.rope_scaling.factor = static_cast<float>(k.factor);
      c.rope_scaling.original_context = k.original;
      const Rope rope(c);
      const double mscale = 1 + 0.1 * std::log(k.factor);
      EXPECT_NEAR(rope.mscale(), mscale, 1e-7);
      for (int i = 0; i < k.dims / 2; ++i) {
        const double f = std::pow(k.base, -2.0 * i / k.dims);
        EXPECT_NEAR(rope.freq()[i], YarnAngle(i, 1, k.dims, k.base, k.factor, k.original), 1e-12 * f) << i;
        if (k.hi > 0) {  // pairs up to lo keep their frequency, from hi on are interpolated
          if (i <= k.lo) {
            EXPECT_DOUBLE_EQ(rope.freq()[i], f) << i;
          }
          if (i >= k.hi) {
            EXPECT_DOUBLE_EQ(rope.freq()[i], f / k.factor) << i;
          }
          if (i > k.lo && i < k.hi) {
            EXPECT_LT(rope.freq()[i], f) << i;
            EXPECT_GT(rope.freq()[i], f / k.factor) << i;
          }
        }
      }
      ExpectRotationMatches(
          c, k.dims,
          [&](int i, int64_t pos) { return YarnAngle(i, pos, k.dims, k.base, k.factor, k.original); },
          mscale, k.original);
    }
  }
}

TEST(Rope, AttnFactorMultipliesTheYarnMagnitude) {
  ModelConfig c = RopeConfig(64, 1e6, true);
  c.rope_scaling.type = RopeScalingType::kYarn;
  c.rope_scaling.factor = 4;
  c.rope_scaling.original_context = 4096;
  c.rope_scaling.attn_factor = 0.5f;
  EXPECT_NEAR(Rope(c).mscale(), 0.5 * (1 + 0.1 * std::log(4.0)), 1e-7);
}

}  // namespace
}  // namespace ellm
