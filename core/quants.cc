#include "core/quants.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"

namespace ellm {
namespace {

// Round to nearest (halves away from zero, as ggml's roundf), after clamping
// to [lo, hi] so that the conversion to int is always defined.
int ClampRound(float v, int lo, int hi) {
  v = std::clamp(v, static_cast<float>(lo), static_cast<float>(hi));
  return static_cast<int>(std::lround(v));
}

// ---------------------------------------------------------------------------
// Scale searches for the k-quants. Sub-blocks are at most 32 values.

constexpr int kMaxSub = 32;

// Affine grid of Q4_K / Q5_K sub-blocks: x ≈ scale * q - offset with
// q in [0, nmax], scale >= 0 and offset >= 0 (the grid always reaches zero or
// below, since the stored min is unsigned and dmin is non-negative).
struct AffineGrid {
  float scale = 0;
  float offset = 0;
};

int AffineLevel(float x, const AffineGrid& g, int nmax) {
  return g.scale > 0 ? ClampRound((x + g.offset) / g.scale, 0, nmax) : 0;
}

// Squared error of rounding x[0..n) to the grid, computed as the dequantiser
// computes a value (scale * q - offset in float).
double AffineError(const float* x, int n, int nmax, const AffineGrid& g) {
  double err = 0;
  for (int i = 0; i < n; ++i) {
    const double e = g.scale * static_cast<float>(AffineLevel(x[i], g, nmax)) - g.offset - x[i];
    err += e * e;
  }
  return err;
}

// The least-squares grid for fixed levels q: minimises sum (s*q - o - x)^2;
// when the free optimum has o < 0 (grid floor above zero) it pins o = 0.
// Returns false when the levels do not determine a positive scale.
bool FitAffineToLevels(const float* x, const int* q, int n, AffineGrid* g) {
  double sq = 0, sqq = 0, sx = 0, sxq = 0;
  for (int i = 0; i < n; ++i) {
    sq += q[i];
    sqq += static_cast<double>(q[i]) * q[i];
    sx += x[i];
    sxq += static_cast<double>(x[i]) * q[i];
  }
  const double det = n * sqq - sq * sq;
  if (det <= 0) return false;
  double s = (n * sxq - sq * sx) / det;
  double b = (sqq * sx - sq * sxq) / det;  // x ≈ s*q + b, b = -offset
  if (b > 0) {
    b = 0;
    s = sxq / sqq;
  }
  if (!(s > 0)) return false;
  g->scale = static_cast<float>(s);
  g->offset = static_cast<float>(-b);
  return true;
}

// Searches grids for one sub-block: the min/max grid, then from each of 21
// stretched starting grids (nmax ± 1 levels across the range) up to three
// rounds of "fit the grid to the levels, re-round the levels to the grid".
AffineGrid FitAffine(const float* x, int n, int nmax) {
  float lo = 0, hi = x[0];
  for (int i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  if (hi <= lo) return {0, -lo};  // constant (non-positive) sub-block
  AffineGrid best{(hi - lo) / nmax, -lo};
  double best_err = AffineError(x, n, nmax, best);
  int q[kMaxSub];
  for (int step = -10; step <= 10; ++step) {
    const float iscale = (nmax + 0.1f * step) / (hi - lo);
    for (int i = 0; i < n; ++i) q[i] = ClampRound(iscale * (x[i] - lo), 0, nmax);
    for (int round = 0; round < 3; ++round) {
      AffineGrid g;
      if (!FitAffineToLevels(x, q, n, &g)) break;
      const double err = AffineError(x, n, nmax, g);
      if (err < best_err) {
        best_err = err;
        best = g;
      }
      bool changed = false;
      for (int i = 0; i < n; ++i) {
        const int l = AffineLevel(x[i], g, nmax);
        changed |= l != q[i];
        q[i] = l;
      }
      if (!changed) break;
    }
  }
  return best;
}

// Symmetric grid of Q6_K sub-blocks: x ≈ scale * q, q in [-qmax, qmax - 1];
// the scale is signed, so the value of largest magnitude can use level -qmax.
int SymLevel(float x, float scale, int qmax) {
  return scale != 0 ? ClampRound(x / scale, -qmax, qmax - 1) : 0;
}

double SymError(const float* x, int n, int qmax, float scale) {
  double err = 0;
  for (int i = 0; i < n; ++i) {
    const double e = scale * static_cast<float>(SymLevel(x[i], scale, qmax)) - x[i];
    err += e * e;
  }
  return err;
}

float FitSym(const float* x, int n, int qmax) {
  float extreme = 0;  // the value of largest magnitude, with its sign
  for (int i = 0; i < n; ++i) {
    if (std::fabs(x[i]) > std::fabs(extreme)) extreme = x[i];
  }
  if (extreme == 0) return 0;
  float best = extreme / -static_cast<float>(qmax);
  double best_err = SymError(x, n, qmax, best);
  int q[kMaxSub];
  for (int step = -9; step <= 9; ++step) {
    const float iscale = -(qmax + 0.1f * step) / extreme;
    for (int i = 0; i < n; ++i) q[i] = ClampRound(iscale * x[i], -qmax, qmax - 1);
    for (int round = 0; round < 3; ++round) {
      double sxq = 0, sqq = 0;
      for (int i = 0; i < n; ++i) {
        sxq += static_cast<double>(x[i]) * q[i];
        sqq += static_cast<double>(q[i]) * q[i];
      }
      if (sqq == 0) break;
      const float s = static_cast<float>(sxq / sqq);
      if (s == 0) break;
      const double err = SymError(x, n, qmax, s);
      if (err < best_err) {
        best_err = err;
        best = s;
      }
      bool changed = false;
      for (int i = 0; i < n; ++i) {
        const int l = SymLevel(x[i], s, qmax);
        changed |= l != q[i];
        q[i] = l;
      }
      if (!changed) break;
    }
  }
  return best;
}

// Quantises one 256-value super-block of Q4_K (nmax 15) or Q5_K (nmax 31):
// fits each 32-value sub-block, stores its scale and offset as 6-bit
// multiples of the half super-scales d = max scale / 63 and
// dmin = max offset / 63 (picking, among the nearest codes ±1, the pair with
// least error), and rounds each value to the stored grid. Returns the levels
// in `levels` and fills d, dmin and scales.
void QuantizeSuperBlockAffine(const float* x, int nmax, uint16_t* d, uint16_t* dmin,
                              uint8_t scales[12], int levels[kQK_K]) {
  constexpr int kSub = 32;
  AffineGrid fits[kQK_K / kSub];
  float max_scale = 0, max_offset = 0;
  for (int j = 0; j < kQK_K / kSub; ++j) {
    fits[j] = FitAffine(x + kSub * j, kSub, nmax);
    max_scale = std::max(max_scale, fits[j].scale);
    max_offset = std::max(max_offset, fits[j].offset);
  }
  *d = FloatToHalf(max_scale / 63);
  *dmin = FloatToHalf(max_offset / 63);
  const float df = HalfToFloat(*d);
  const float dminf = HalfToFloat(*dmin);
  std::memset(scales, 0, 12);
  for (int j = 0; j < kQK_K / kSub; ++j) {
    const float* xs = x + kSub * j;
    const int ls0 = df > 0 ? ClampRound(fits[j].scale / df, 0, 63) : 0;
    const int lm0 = dminf > 0 ? ClampRound(fits[j].offset / dminf, 0, 63) : 0;
    int best_ls = ls0, best_lm = lm0;
    double best_err = -1;
    for (int ls = std::max(0, ls0 - 1); ls <= std::min(63, ls0 + 1); ++ls) {
      for (int lm = std::max(0, lm0 - 1); lm <= std::min(63, lm0 + 1); ++lm) {
        const double err = AffineError(xs, kSub, nmax, {df * ls, dminf * lm});
        if (best_err < 0 || err < best_err) {
          best_err = err;
          best_ls = ls;
          best_lm = lm;
        }
      }
    }
    PackScaleMinK4(scales, j, static_cast<uint8_t>(best_ls), static_cast<uint8_t>(best_lm));
    const AffineGrid stored{df * best_ls, dminf * best_lm};
    for (int i = 0; i < kSub; ++i) levels[kSub * j + i] = AffineLevel(xs[i], stored, nmax);
  }
}

}  // namespace

void UnpackScaleMinK4(const uint8_t* scales, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = scales[j] & 63;
    *m = scales[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
  }
}

void PackScaleMinK4(uint8_t* scales, int j, uint8_t sc, uint8_t m) {
  if (j < 4) {
    scales[j] = static_cast<uint8_t>((scales[j] & 0xc0) | (sc & 63));
    scales[j + 4] = static_cast<uint8_t>((scales[j + 4] & 0xc0) | (m & 63));
  } else {
    scales[j + 4] = static_cast<uint8_t>((sc & 15) | ((m & 15) << 4));
    scales[j - 4] = static_cast<uint8_t>((scales[j - 4] & 63) | (((sc >> 4) & 3) << 6));
    scales[j] = static_cast<uint8_t>((scales[j] & 63) | (((m >> 4) & 3) << 6));
  }
}

// --- Plain types -----------------------------------------------------------

void DequantizeRowF32(const void* src, float* dst, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

void DequantizeRowF16(const void* src, float* dst, int64_t n) {
  const auto* h = static_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(h[i]);
}

void DequantizeRowBf16(const void* src, float* dst, int64_t n) {
  const auto* h = static_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(h[i]);
}

void QuantizeRowF32(const float* src, void* dst, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

void QuantizeRowF16(const float* src, void* dst, int64_t n) {
  auto* h = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) h[i] = FloatToHalf(src[i]);
}

void QuantizeRowBf16(const float* src, void* dst, int64_t n) {
  auto* h = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) h[i] = FloatToBf16(src[i]);
}

// --- Q8_0 ------------------------------------------------------------------

void DequantizeRowQ8_0(const void* src, float* dst, int64_t n) {
  const auto* b = static_cast<const BlockQ8_0*>(src);
  for (int64_t ib = 0; ib < n / kQK; ++ib, dst += kQK) {
    const float d = HalfToFloat(b[ib].d);
    for (int i = 0; i < kQK; ++i) dst[i] = d * b[ib].qs[i];
  }
}

// d = amax / 127, q = round(x / d): the largest magnitude maps to ±127.
void QuantizeRowQ8_0(const float* src, void* dst, int64_t n) {
  auto* b = static_cast<BlockQ8_0*>(dst);
  for (int64_t ib = 0; ib < n / kQK; ++ib, src += kQK) {
    float amax = 0;
    for (int i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(src[i]));
    const float d = amax / 127;
    const float id = d != 0 ? 1 / d : 0;
    b[ib].d = FloatToHalf(d);
    for (int i = 0; i < kQK; ++i) {
      b[ib].qs[i] = static_cast<int8_t>(ClampRound(src[i] * id, -127, 127));
    }
  }
}

// --- Q4_0 ------------------------------------------------------------------

void DequantizeRowQ4_0(const void* src, float* dst, int64_t n) {
  const auto* b = static_cast<const BlockQ4_0*>(src);
  for (int64_t ib = 0; ib < n / kQK; ++ib, dst += kQK) {
    const float d = HalfToFloat(b[ib].d);
    for (int i = 0; i < kQK / 2; ++i) {
      dst[i] = d * ((b[ib].qs[i] & 15) - 8);
      dst[i + kQK / 2] = d * ((b[ib].qs[i] >> 4) - 8);
    }
  }
}

// The value of largest magnitude, m, gets level 0 (d = m / -8, so it reads
// back as exactly -8 d = m); the others round to nearest in [0, 15].
void QuantizeRowQ4_0(const float* src, void* dst, int64_t n) {
  auto* b = static_cast<BlockQ4_0*>(dst);
  for (int64_t ib = 0; ib < n / kQK; ++ib, src += kQK) {
    float extreme = 0;
    for (int i = 0; i < kQK; ++i) {
      if (std::fabs(src[i]) > std::fabs(extreme)) extreme = src[i];
    }
    const float d = extreme / -8;
    const float id = d != 0 ? 1 / d : 0;
    b[ib].d = FloatToHalf(d);
    auto level = [&](float x) {
      return std::clamp(static_cast<int>(std::floor(x * id + 8.5f)), 0, 15);
    };
    for (int i = 0; i < kQK / 2; ++i) {
      b[ib].qs[i] = static_cast<uint8_t>(level(src[i]) | (level(src[i + kQK / 2]) << 4));
    }
  }
}

// --- Q4_K ------------------------------------------------------------------

void UnpackLevelsQ4_K(const BlockQ4_K& b, int levels[kQK_K]) {
  for (int c = 0; c < 4; ++c) {  // chunks of 64: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    for (int l = 0; l < 32; ++l) {
      levels[64 * c + l] = b.qs[32 * c + l] & 15;
      levels[64 * c + 32 + l] = b.qs[32 * c + l] >> 4;
    }
  }
}

void UnpackLevelsQ5_K(const BlockQ5_K& b, int levels[kQK_K]) {
  for (int c = 0; c < 4; ++c) {  // as Q4_K, the 5th bit of sub-block s in bit s of qh
    for (int l = 0; l < 32; ++l) {
      levels[64 * c + l] = (b.qs[32 * c + l] & 15) | (((b.qh[l] >> (2 * c)) & 1) << 4);
      levels[64 * c + 32 + l] = (b.qs[32 * c + l] >> 4) | (((b.qh[l] >> (2 * c + 1)) & 1) << 4);
    }
  }
}

void UnpackLevelsQ6_K(const BlockQ6_K& b, int levels[kQK_K]) {
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 4; ++k) {  // element 128h + 32k + l
      const uint8_t* low = b.ql + 64 * h + (k & 1) * 32;
      const int low_shift = (k >> 1) * 4;
      for (int l = 0; l < 32; ++l) {
        levels[128 * h + 32 * k + l] =
            ((low[l] >> low_shift) & 15) | (((b.qh[32 * h + l] >> (2 * k)) & 3) << 4);
      }
    }
  }
}

void DequantizeRowQ4_K(const void* src, float* dst, int64_t n) {
  const auto* b = static_cast<const BlockQ4_K*>(src);
  int levels[kQK_K];
  for (int64_t ib = 0; ib < n / kQK_K; ++ib) {
    const float d = HalfToFloat(b[ib].d);
    const float dmin = HalfToFloat(b[ib].dmin);
    UnpackLevelsQ4_K(b[ib], levels);
    for (int s = 0; s < 8; ++s) {
      uint8_t sc, m;
      UnpackScaleMinK4(b[ib].scales, s, &sc, &m);
      const float ds = d * sc, ms = dmin * m;
      for (int l = 0; l < 32; ++l) *dst++ = ds * levels[32 * s + l] - ms;
    }
  }
}

void QuantizeRowQ4_K(const float* src, void* dst, int64_t n) {
  auto* b = static_cast<BlockQ4_K*>(dst);
  int levels[kQK_K];
  for (int64_t ib = 0; ib < n / kQK_K; ++ib, src += kQK_K) {
    QuantizeSuperBlockAffine(src, 15, &b[ib].d, &b[ib].dmin, b[ib].scales, levels);
    for (int c = 0; c < 4; ++c) {
      for (int l = 0; l < 32; ++l) {
        b[ib].qs[32 * c + l] =
            static_cast<uint8_t>(levels[64 * c + l] | (levels[64 * c + 32 + l] << 4));
      }
    }
  }
}

// --- Q5_K ------------------------------------------------------------------

void DequantizeRowQ5_K(const void* src, float* dst, int64_t n) {
  const auto* b = static_cast<const BlockQ5_K*>(src);
  int levels[kQK_K];
  for (int64_t ib = 0; ib < n / kQK_K; ++ib) {
    const float d = HalfToFloat(b[ib].d);
    const float dmin = HalfToFloat(b[ib].dmin);
    UnpackLevelsQ5_K(b[ib], levels);
    for (int s = 0; s < 8; ++s) {
      uint8_t sc, m;
      UnpackScaleMinK4(b[ib].scales, s, &sc, &m);
      const float ds = d * sc, ms = dmin * m;
      for (int l = 0; l < 32; ++l) *dst++ = ds * levels[32 * s + l] - ms;
    }
  }
}

void QuantizeRowQ5_K(const float* src, void* dst, int64_t n) {
  auto* b = static_cast<BlockQ5_K*>(dst);
  int levels[kQK_K];
  for (int64_t ib = 0; ib < n / kQK_K; ++ib, src += kQK_K) {
    QuantizeSuperBlockAffine(src, 31, &b[ib].d, &b[ib].dmin, b[ib].scales, levels);
    std::memset(b[ib].qh, 0, sizeof(b[ib].qh));
    for (int c = 0; c < 4; ++c) {
      for (int l = 0; l < 32; ++l) {
        const int lo = levels[64 * c + l], hi = levels[64 * c + 32 + l];
        b[ib].qs[32 * c + l] = static_cast<uint8_t>((lo & 15) | ((hi & 15) << 4));
        b[ib].qh[l] |= static_cast<uint8_t>(((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
      }
    }
  }
}

// --- Q6_K ------------------------------------------------------------------

void DequantizeRowQ6_K(const void* src, float* dst, int64_t n) {
  const auto* b = static_cast<const BlockQ6_K*>(src);
  int levels[kQK_K];
  for (int64_t ib = 0; ib < n / kQK_K; ++ib) {
    const float d = HalfToFloat(b[ib].d);
    UnpackLevelsQ6_K(b[ib], levels);
    for (int e = 0; e < kQK_K; ++e) dst[e] = d * b[ib].scales[e / 16] * (levels[e] - 32);
    dst += kQK_K;
  }
}

// Each 16-value sub-block gets a signed least-squares scale over levels
// [-32, 31]; the super-scale d = (scale of largest magnitude) / -128 so that
// one sub-block uses code -128 and the others round into int8.
void QuantizeRowQ6_K(const float* src, void* dst, int64_t n) {
  constexpr int kSub = 16;
  auto* b = static_cast<BlockQ6_K*>(dst);
  for (int64_t ib = 0; ib < n / kQK_K; ++ib, src += kQK_K) {
    float fits[kQK_K / kSub];
    float extreme = 0;
    for (int j = 0; j < kQK_K / kSub; ++j) {
      fits[j] = FitSym(src + kSub * j, kSub, 32);
      if (std::fabs(fits[j]) > std::fabs(extreme)) extreme = fits[j];
    }
    b[ib].d = FloatToHalf(extreme / -128);
    const float d = HalfToFloat(b[ib].d);
    int levels[kQK_K];
    for (int j = 0; j < kQK_K / kSub; ++j) {
      const float* xs = src + kSub * j;
      const int s0 = d != 0 ? ClampRound(fits[j] / d, -128, 127) : 0;
      int best_s = s0;
      double best_err = -1;
      for (int s = std::max(-128, s0 - 1); s <= std::min(127, s0 + 1); ++s) {
        const double err = SymError(xs, kSub, 32, d * s);
        if (best_err < 0 || err < best_err) {
          best_err = err;
          best_s = s;
        }
      }
      b[ib].scales[j] = static_cast<int8_t>(best_s);
      for (int i = 0; i < kSub; ++i) levels[kSub * j + i] = SymLevel(xs[i], d * best_s, 32) + 32;
    }
    for (int h = 0; h < 2; ++h) {
      uint8_t* ql = b[ib].ql + 64 * h;
      uint8_t* qh = b[ib].qh + 32 * h;
      const int* lv = levels + 128 * h;
      for (int l = 0; l < 32; ++l) {
        const int q0 = lv[l], q1 = lv[l + 32], q2 = lv[l + 64], q3 = lv[l + 96];
        ql[l] = static_cast<uint8_t>((q0 & 15) | ((q2 & 15) << 4));
        ql[l + 32] = static_cast<uint8_t>((q1 & 15) | ((q3 & 15) << 4));
        qh[l] = static_cast<uint8_t>((q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4) |
                                     ((q3 >> 4) << 6));
      }
    }
  }
}

}  // namespace ellm
