// AVX2 matrix kernels (AVX2 + FMA + F16C), and the exact fp32 kernel (AVX
// only). Every function here carries a target attribute; the dispatcher calls
// in only when the CPU has the features.
//
// This file is compiled twice: as is (kernel set "avx2": int8 products with
// VPMADDUBSW + VPMADDWD), and from matmul_avx2_vnni.cc with ELLM_AVX2_VNNI=1
// (kernel set "avx2-vnni": AVX-VNNI's VEX VPDPBUSD, and VPDPWSSD for the
// int16 offset sums). The fp32 kernels (exact F32, F16, BF16) have no int8
// products and are only built once; the avx2-vnni table points at them.
//
// The layout is the AVX-512 one (matmul_layout.h): each 64-byte line holds 16
// rows; these kernels take it as two halves of 8 rows (bytes 0..31 and
// 32..63), one half at a time, except Q8_0's (whole lines, up to 4 tokens a
// tile), F16's and BF16's (whole lines, 1-2 tokens a tile), and the decode
// tiles (RunWhole): one token of Q8_0 (two groups side by side), Q4_0 and
// Q6_K, and up to 4 tokens of Q4_K and Q5_K. The two sets differ only in their int8 products (Q8Half,
// Q4_0Tile, K4Sums, Q6Sums); the tiles around them are shared, so avx2-vnni
// has the one-token tiles too. Before, its half-line tiles read one token's
// weights slower than plain avx2 did; ratio to the probe, 2 threads (Zen 5,
// forced; bench/results/amd-epyc-zen5.md): Q8_0 0.45-0.66 -> 0.71-0.88, Q4_K
// 0.54-0.65 -> 0.57-0.83, Q6_K 0.52-0.55 -> 0.61-0.81. Pairs of groups did not help
// Q4_K and Q6_K: Q4_K stayed at 0.55-0.65 of the probe and Q6_K got slower.
// The half-line tiles prefetch (matmul_layout.h) in their first pass (h = 0);
// the second pass finds its group in L2. A prefetch of the next group spread
// over both passes never ran (GCC had deleted it, see matmul_layout.h) and,
// made to run, slowed T = 4 by about 10%; it is gone.
//
// "avx2": VPMADDUBSW (u8 x s8 -> int16 pair sums, saturating) + VPMADDWD:
//   Q8_0       u8 = code + 128 would overflow the int16 pair sums with
//              8-bit activation codes, so the signed code is restored (xor
//              0x80) and multiplied as |code| x (activation * sign(code)):
//              |pair| <= 2 * 128 * 127. With 7-bit codes (kQ7x32, on request)
//              the stored u8 is multiplied as it is: |pair| <= 2 * 255 * 63.
//   Q4_0/Q4_K  pair sums <= 2 * 15 * 127, so a block's 8 lines add up in int16
//              (<= 30480) before one VPMADDWD, which also applies the
//              sub-block scale (Q4_K) as an int16 pair (sc, sc).
//   Q5_K       pairs <= 2 * 31 * 127: 4 lines per int16 sum (<= 31496).
//   Q6_K       pairs <= 2 * 63 * 127: 2 lines per int16 sum (<= 32004).
// "avx2-vnni": one VPDPBUSD per line and token straight into int32, as the
//   AVX-512 kernels do (Q8_0 multiplies the stored u8 = code + 128 and
//   subtracts 128 * sum(codes)); sub-block scales by VPMULLD.
// The offsets (-8 for Q4_0, mins for the k-quants, -32 for Q6_K) use the
// activation code sums, as in the AVX-512 kernels. Both sets' integer sums are
// exact and their float steps the same, so on the same activation codes they
// give identical results.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "mlp-worker/cpu/matmul_layout.h"

#ifndef ELLM_AVX2_VNNI
#define ELLM_AVX2_VNNI 0
#endif

#if ELLM_AVX2_VNNI
#define ELLM_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#else
#define ELLM_TARGET __attribute__((target("avx2,fma,f16c")))
#endif
// No FMA here: the exact kernel must round every product and sum as Dot does.
#define ELLM_TARGET_AVX __attribute__((target("avx")))
#define ELLM_INLINE inline __attribute__((always_inline))

namespace ellm::mlp::internal {

#if !ELLM_AVX2_VNNI
namespace {

// --- Exact fp32 (core/kernels.h Dot, bit for bit) ------------------------------

// One row against NT tokens: 8 lanes over whole chunks of 8, a scalar tail,
// then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) + tail.
template <int NT>
ELLM_TARGET_AVX void F32Row(const float* wr, const float* x0, int64_t cols, float* y0,
                            int64_t ldy) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const int64_t n8 = cols / 8 * 8;
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 w = _mm256_loadu_ps(wr + i);
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(w, _mm256_loadu_ps(x0 + t * cols + i)));
    }
  }
  for (int t = 0; t < NT; ++t) {
    alignas(32) float l[8];
    _mm256_store_ps(l, acc[t]);
    const float* x = x0 + t * cols;
    float tail = 0;
    for (int64_t i = n8; i < cols; ++i) tail += wr[i] * x[i];
    y0[t * ldy] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])) + tail;
  }
}

ELLM_TARGET_AVX void F32Exact(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
  const QuantMatrix& w = *a.w;
  const int64_t cols = w.cols();
  for (int64_t g = g_begin; g < g_end; ++g) {
    const float* group = reinterpret_cast<const float*>(w.group(g));
    for (int r = 0; r < ValidRows(w, g); ++r) {
      const float* wr = group + r * cols;
      float* y = a.y + g * kGroupRows + r;
      int t0 = 0;
      for (; t0 + 4 <= a.T; t0 += 4) F32Row<4>(wr, a.x + t0 * cols, cols, y + t0 * a.ldy, a.ldy);
      for (; t0 < a.T; ++t0) F32Row<1>(wr, a.x + t0 * cols, cols, y + t0 * a.ldy, a.ldy);
    }
  }
}

}  // namespace

void F32ExactKernelAvx(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
  F32Exact(a, g_begin, g_end);
}

// QuantizeActivationRowScalar's rule, 8 lanes at a time: the same max |x|,
// d and max_code / max|x|, VROUNDPS to nearest-even where nearbyint rounds in the
// default mode, the same clamp, and NaN (x NaN in a finite block) to 0.
// Blocks are 32 or 256 elements, whole multiples of 8.
__attribute__((target("avx2,fma"))) void QuantizeActivationRowAvx2(const float* x, int64_t cols,
                                                                   int block, int max_code,
                                                                   int8_t* codes, float* d) {
  const float m_code = static_cast<float>(max_code);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 hi = _mm256_set1_ps(m_code), lo = _mm256_set1_ps(-m_code);
  for (int64_t b = 0; b < cols / block; ++b) {
    const float* xb = x + b * block;
    int8_t* qb = codes + b * block;
    // max|x| as the scalar loop finds it: NaN elements never win a comparison.
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < block; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + i), abs_mask), m);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float amax = 0;
    for (float v : lanes) amax = std::max(amax, v);
    if (!(amax > 0) || !std::isfinite(amax)) {
      d[b] = 0;
      std::memset(qb, 0, block);
      continue;
    }
    d[b] = amax / m_code;
    const __m256 id = _mm256_set1_ps(m_code / amax);
    for (int i = 0; i < block; i += 8) {
      __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i), id),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 ordered = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
      v = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(v, lo), hi), ordered);
      const __m256i q32 = _mm256_cvtps_epi32(v);
      const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(qb + i), _mm_packs_epi16(q16, q16));
    }
  }
}
#endif  // !ELLM_AVX2_VNNI

namespace {

// --- AVX2 -------------------------------------------------------------------

constexpr int kMaxTile = 2;  // tokens per register tile (16 ymm registers)

// Pins an integer sum to a register at this point of a loop. GCC 12
// reassociates integer sums across an unrolled loop: for Q8_0 it computed a
// block's 8 lines of products first, parked them on the stack and added them
// up afterwards (60 stack accesses a block), which ran the plain avx2 tile at
// about half of VPMADDUBSW's peak; the plain Q4_K/Q5_K tiles did the same
// with their int16 sums (T = 4, 2 threads, 5120 x 5120, alternated 3 rounds:
// Q4_K 13.5-19.2 -> 17.1-22.6 GB/s, Q5_K 12.0-17.9 -> 17.5-18.8; Q4_0
// 13.6-15.2 -> 14.7-17.0, and at T = 16 4.5-4.8 -> 4.9-5.4). Q6_K's spills
// are its operands', not its sums': pinning them changed nothing.
ELLM_TARGET ELLM_INLINE void KeepSum(__m256i& s) { __asm__("" : "+x"(s)); }

ELLM_TARGET ELLM_INLINE __m256i Bcast4(const void* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

ELLM_TARGET ELLM_INLINE __m256i Load32(const uint8_t* p) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
}

ELLM_TARGET ELLM_INLINE __m128i Load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

ELLM_TARGET ELLM_INLINE __m256 LoadHalves8(const void* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}

ELLM_TARGET ELLM_INLINE __m256 LoadBf16x8(const void* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

ELLM_TARGET ELLM_INLINE void Store8(__m256 v, float* y, int valid) {
  if (valid >= 8) {
    _mm256_storeu_ps(y, v);
    return;
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int i = 0; i < valid; ++i) y[i] = tmp[i];
}

// Rows of half h of group g that exist.
inline int ValidHalf(const QuantMatrix& w, int64_t g, int h) {
  const int v = ValidRows(w, g) - 8 * h;
  return v < 0 ? 0 : v;
}

// The weight codes both sets multiply, unpacked from a 32-byte half line
// (8 rows x 32 bytes) as u8 lanes.

// Q4_0, Q4_K, Q5_K: the low nibbles (w0: columns 4i..4i+3 of the sub-block)
// and high nibbles (w1: columns 16 + 4i..) of `line`, line i of its
// sub-block; Q5_K adds the fifth bits from hb (the sub-block's high-bit line).
template <bool kQ5>
ELLM_TARGET ELLM_INLINE void NibbleCodes(const uint8_t* line, __m256i hb, int i, __m256i* w0,
                                         __m256i* w1) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i v = Load32(line);
  *w0 = _mm256_and_si256(v, low);
  *w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  if constexpr (kQ5) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    *w0 = _mm256_or_si256(*w0, _mm256_and_si256(_mm256_sll_epi16(hb, _mm_cvtsi32_si128(4 - i)), bit4));
    *w1 = _mm256_or_si256(*w1, _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(i)), bit4));
  }
}

// Q6_K: line k of sub-block 2P (odd = false) or 2P + 1 (odd), 6-bit codes
// 0..63 from the low-bit line and the high-bit line (qb: the block's, with
// the half's offset). Sub-block 2P's high bits are bits 2u, 2u + 1 of qh with
// u = 2 (P % 2), shifted to bits 4, 5 (and 2P + 1's, bits 6, 7, to 4, 5 after
// >> 2).
ELLM_TARGET ELLM_INLINE __m256i Q6Code(const uint8_t* qb, int P, int k, bool odd) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i two = _mm256_set1_epi8(0x30);
  const __m256i v = Load32(qb + 256 * P + 64 * k);
  const __m256i hbits =
      _mm256_sll_epi16(Load32(qb + 2048 + 256 * (P / 2) + 64 * k), _mm_cvtsi32_si128(P % 2 ? 0 : 4));
  if (odd) {
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                           _mm256_and_si256(_mm256_srli_epi16(hbits, 2), two));
  }
  return _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(hbits, two));
}

// Both sub-blocks' codes of line k (the compiler shares the two loads).
ELLM_TARGET ELLM_INLINE void Q6Codes(const uint8_t* qb, int P, int k, __m256i* we, __m256i* wo) {
  *we = Q6Code(qb, P, k, false);
  *wo = Q6Code(qb, P, k, true);
}

#if ELLM_AVX2_VNNI

// --- AVX-VNNI int8 products -------------------------------------------------------
// The AVX-512 kernels' arithmetic on 8 rows at a time (see matmul_avx512.cc for
// the bounds); the float steps are those of the "avx2" set.

ELLM_TARGET ELLM_INLINE __m256i Dpbusd(__m256i acc, __m256i u8, __m256i s8) {
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
}

// acc + the int16 pair products of a and b, per int32 lane.
ELLM_TARGET ELLM_INLINE __m256i AddPairProducts(__m256i acc, __m256i a, __m256i b) {
  return _mm256_dpwssd_avx_epi32(acc, a, b);
}

// One 32-byte half line of Q8_0 codes (4 codes of 8 rows), stored as
// u8 = code + 128: Dot adds its products with a token's 4 broadcast codes.
// The sums start at kQ8Start * (the block's activation code sum).
struct Q8Half {
  static constexpr int32_t kQ8Start = -128;
  __m256i u8;
  ELLM_TARGET ELLM_INLINE explicit Q8Half(const uint8_t* p) : u8(Load32(p)) {}
  ELLM_TARGET ELLM_INLINE __m256i Dot(__m256i s, __m256i c) const { return Dpbusd(s, u8, c); }
};

// Q4_0: block b's integer sums for the 8 rows of half h (quant: the half's
// first line) and NT tokens, the -8 offset included.
struct Q4_0Sums {
  template <int NT>
  ELLM_TARGET ELLM_INLINE static void Block(const uint8_t* quant, const TileActs<NT>& act, int64_t b,
                                            __m256i* s) {
    __m256i s0[NT], s1[NT];
    for (int t = 0; t < NT; ++t) {
      s0[t] = _mm256_set1_epi32(-8 * act.sum[t][b]);
      s1[t] = _mm256_setzero_si256();
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      __m256i w0, w1;
      NibbleCodes<false>(quant + b * 256 + 64 * i, _mm256_setzero_si256(), i, &w0, &w1);
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) {
        const int8_t* c = act.codes[t] + 32 * b;
        s0[t] = Dpbusd(s0[t], w0, Bcast4(c + 4 * i));
        s1[t] = Dpbusd(s1[t], w1, Bcast4(c + 16 + 4 * i));
      }
    }
    for (int t = 0; t < NT; ++t) s[t] = _mm256_add_epi32(s0[t], s1[t]);
  }
};

// Q4_K (kQ5 = false) and Q5_K: block b's integer sums for the 8 rows of
// halves [h0, h0 + kHalves) and NT tokens: si[hh], the sub-block dots times
// their scales (VPMULLD), and sm[hh], the activation sums times the mins. qb
// and meta are the block's (qb without a half's offset). Whole takes both
// halves at once, so that each broadcast of a token's codes serves both
// halves' lines (gains in K4Tile::Whole).
template <bool kQ5>
struct K4Sums {
  static constexpr int kQuant = kQ5 ? 2560 : 2048;
  template <int NT, int kHalves>
  ELLM_TARGET ELLM_INLINE static void Halves(const uint8_t* qb, const uint8_t* meta, int h0, const TileActs<NT>& act,
                                             int64_t b, __m256i (*si)[NT], __m256i (*sm)[NT]) {
    for (int hh = 0; hh < kHalves; ++hh) {
      for (int t = 0; t < NT; ++t) si[hh][t] = sm[hh][t] = _mm256_setzero_si256();
    }
    // Up to 2 (half, token) sums: two sums each (4 chains); more: one (the
    // registers hold no more, and the sums' chains are enough).
    constexpr int kSums = kHalves * NT <= 2 ? 2 : 1;
    for (int s = 0; s < 8; ++s) {
      __m256i hb[kHalves];
      for (int hh = 0; hh < kHalves; ++hh) {
        hb[hh] = kQ5 ? Load32(qb + 32 * (h0 + hh) + 2048 + 64 * s) : _mm256_setzero_si256();
      }
      __m256i acc[kHalves][NT][kSums];
      for (int hh = 0; hh < kHalves; ++hh) {
        for (int t = 0; t < NT; ++t) {
          for (int k = 0; k < kSums; ++k) acc[hh][t][k] = _mm256_setzero_si256();
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m256i w[kHalves][2];
        for (int hh = 0; hh < kHalves; ++hh) {
          NibbleCodes<kQ5>(qb + 32 * (h0 + hh) + 256 * s + 64 * i, hb[hh], i, &w[hh][0], &w[hh][1]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          const int8_t* c = act.codes[t] + 256 * b + 32 * s;
          const __m256i c0 = Bcast4(c + 4 * i), c1 = Bcast4(c + 16 + 4 * i);
          for (int hh = 0; hh < kHalves; ++hh) {
            acc[hh][t][0] = Dpbusd(acc[hh][t][0], w[hh][0], c0);
            acc[hh][t][kSums - 1] = Dpbusd(acc[hh][t][kSums - 1], w[hh][1], c1);
          }
        }
      }
      for (int hh = 0; hh < kHalves; ++hh) {
        // The sub-block scales of this half's 8 rows, int32.
        const __m256i sc = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + 64 + 16 * s + 8 * (h0 + hh))));
        for (int t = 0; t < NT; ++t) {
          const __m256i sum = kSums == 2 ? _mm256_add_epi32(acc[hh][t][0], acc[hh][t][1]) : acc[hh][t][0];
          si[hh][t] = _mm256_add_epi32(si[hh][t], _mm256_mullo_epi32(sum, sc));
        }
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      for (int t = 0; t < NT; ++t) {
        const __m256i a = Bcast4(act.sum32[t] + 8 * b + 2 * p);
        for (int hh = 0; hh < kHalves; ++hh) {
          const __m256i mp = _mm256_cvtepu8_epi16(Load16(meta + 192 + 32 * p + 16 * (h0 + hh)));
          sm[hh][t] = _mm256_dpwssd_avx_epi32(sm[hh][t], mp, a);
        }
      }
    }
  }
};

// Q6_K: sub-blocks 2P and 2P + 1 of block b, for the 8 rows of half h and NT
// tokens, added to si (the dots times their scales) and corr (the activation
// sums times the scales: the -32 offset). qb and meta are the block's.
struct Q6Sums {
  template <int NT>
  ELLM_TARGET ELLM_INLINE static void PairHalf(const uint8_t* qb, const uint8_t* meta, int P, int h,
                                               const TileActs<NT>& act, int64_t b, __m256i* si,
                                               __m256i* corr) {
    qb += 32 * h;
    // Per row the int16 pair (sc[2P], sc[2P + 1]), and each as an int32.
    const __m256i scp = _mm256_cvtepi8_epi16(Load16(meta + 32 + 32 * P + 16 * h));
    const __m256i sce = _mm256_srai_epi32(_mm256_slli_epi32(scp, 16), 16);
    const __m256i sco = _mm256_srai_epi32(scp, 16);
    __m256i s0[NT], s1[NT];
    for (int t = 0; t < NT; ++t) s0[t] = s1[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      __m256i we, wo;
      Q6Codes(qb, P, k, &we, &wo);
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) {
        const int8_t* c = act.codes[t] + 256 * b + 32 * P;
        s0[t] = Dpbusd(s0[t], we, Bcast4(c + 4 * k));
        s1[t] = Dpbusd(s1[t], wo, Bcast4(c + 16 + 4 * k));
      }
    }
    for (int t = 0; t < NT; ++t) {
      si[t] = _mm256_add_epi32(si[t], _mm256_add_epi32(_mm256_mullo_epi32(s0[t], sce),
                                                       _mm256_mullo_epi32(s1[t], sco)));
      corr[t] = _mm256_dpwssd_avx_epi32(corr[t], scp, Bcast4(act.sum16[t] + 16 * b + 2 * P));
    }
  }

  // PairHalf for 3 or 4 tokens: 2 NT sums, the codes and the offsets' sums
  // would not fit the 16 registers (4 tokens spilled: from cache 10-17 ->
  // 8-10 GB/s). So the even and odd sub-blocks go in two sweeps, each
  // unpacking only its own codes (NT sums at a time), and the offsets' sums
  // (corr) are left to Q6Corr, after the block. The integer sums are PairHalf's.
  template <int NT>
  ELLM_TARGET ELLM_INLINE static void PairHalfSplit(const uint8_t* qb, const uint8_t* meta, int P, int h,
                                                    const TileActs<NT>& act, int64_t b, __m256i* si) {
    qb += 32 * h;
    const __m256i scp = _mm256_cvtepi8_epi16(Load16(meta + 32 + 32 * P + 16 * h));
#pragma GCC unroll 2
    for (int odd = 0; odd < 2; ++odd) {
      __m256i s[NT];
      for (int t = 0; t < NT; ++t) s[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const __m256i w = Q6Code(qb, P, k, odd != 0);
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          s[t] = Dpbusd(s[t], w, Bcast4(act.codes[t] + 256 * b + 32 * P + 16 * odd + 4 * k));
        }
      }
      // Per row sc[2P] (even) or sc[2P + 1] (odd) as an int32.
      const __m256i sc = odd ? _mm256_srai_epi32(scp, 16) : _mm256_srai_epi32(_mm256_slli_epi32(scp, 16), 16);
      for (int t = 0; t < NT; ++t) si[t] = _mm256_add_epi32(si[t], _mm256_mullo_epi32(s[t], sc));
    }
  }
};

#else  // !ELLM_AVX2_VNNI

// --- AVX2 int8 products (VPMADDUBSW + VPMADDWD) -------------------------------------

// acc + the int16 pair products of a and b, per int32 lane.
ELLM_TARGET ELLM_INLINE __m256i AddPairProducts(__m256i acc, __m256i a, __m256i b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

// One 32-byte half line of Q8_0 codes (see the VNNI Q8Half) against 8-bit
// activation codes (kQ8x32): the signed code is restored (xor 0x80) and
// multiplied as |code| x (activation * sign(code)), so the int16 pair sums
// cannot saturate. The sums start at 0.
struct Q8Half {
  static constexpr int32_t kQ8Start = 0;
  __m256i ws, aw;
  ELLM_TARGET ELLM_INLINE explicit Q8Half(const uint8_t* p)
      : ws(_mm256_xor_si256(Load32(p), _mm256_set1_epi8(static_cast<char>(0x80)))),
        aw(_mm256_sign_epi8(ws, ws)) {}
  ELLM_TARGET ELLM_INLINE __m256i Dot(__m256i s, __m256i c) const {
    return _mm256_add_epi32(
        s, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(c, ws)), _mm256_set1_epi16(1)));
  }
};

// The same against 7-bit activation codes (kQ7x32, |c| <= 63; asked for with
// q8_act_bits = 7): the stored u8 = code + 128 is multiplied as it is, the
// int16 pair sums are at most 2 x 255 x 63 = 32130, and the sums start at
// -128 * (the block's activation code sum) as VPDPBUSD's do. A product is
// VPMADDUBSW, VPMADDWD and VPADDD, without Q8Half's VPSIGNB: the 4-token tile
// runs about 20% faster (4096-token prefill of the bench model, AMD EPYC Zen
// 5, forced: matrix work 9.25-9.88 -> 7.59-7.98 s;
// bench/results/amd-epyc-zen5.md), at about twice the activation rounding.
struct Q8Half7 {
  static constexpr int32_t kQ8Start = -128;
  __m256i u8;
  ELLM_TARGET ELLM_INLINE explicit Q8Half7(const uint8_t* p) : u8(Load32(p)) {}
  ELLM_TARGET ELLM_INLINE __m256i Dot(__m256i s, __m256i c) const {
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, c), _mm256_set1_epi16(1)));
  }
};

// Q4_0: block b's integer sums for the 8 rows of half h (quant: the half's
// first line) and NT tokens, the -8 offset included.
struct Q4_0Sums {
  template <int NT>
  ELLM_TARGET ELLM_INLINE static void Block(const uint8_t* quant, const TileActs<NT>& act, int64_t b,
                                            __m256i* s) {
    __m256i s16[NT];
    for (int t = 0; t < NT; ++t) s16[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      __m256i w0, w1;
      NibbleCodes<false>(quant + b * 256 + 64 * i, _mm256_setzero_si256(), i, &w0, &w1);
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) {
        const int8_t* c = act.codes[t] + 32 * b;
        s16[t] = _mm256_add_epi16(
            s16[t], _mm256_add_epi16(_mm256_maddubs_epi16(w0, Bcast4(c + 4 * i)),
                                     _mm256_maddubs_epi16(w1, Bcast4(c + 16 + 4 * i))));
        KeepSum(s16[t]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      s[t] = _mm256_sub_epi32(_mm256_madd_epi16(s16[t], _mm256_set1_epi16(1)),
                              _mm256_set1_epi32(8 * act.sum[t][b]));
    }
  }
};

// Q4_K (kQ5 = false) and Q5_K: block b's integer sums for the 8 rows of
// halves [h0, h0 + kHalves) and NT tokens: si[hh], the sub-block dots times
// their scales, and sm[hh], the activation sums times the mins. qb and meta
// are the block's (qb without a half's offset). Whole takes both halves at
// once, so that each broadcast of a token's codes serves both halves' lines.
template <bool kQ5>
struct K4Sums {
  static constexpr int kQuant = kQ5 ? 2560 : 2048;
  template <int NT, int kHalves>
  ELLM_TARGET ELLM_INLINE static void Halves(const uint8_t* qb, const uint8_t* meta, int h0, const TileActs<NT>& act,
                                             int64_t b, __m256i (*si)[NT], __m256i (*sm)[NT]) {
    for (int hh = 0; hh < kHalves; ++hh) {
      for (int t = 0; t < NT; ++t) si[hh][t] = sm[hh][t] = _mm256_setzero_si256();
    }
    for (int s = 0; s < 8; ++s) {
      __m256i hb[kHalves];
      for (int hh = 0; hh < kHalves; ++hh) {
        hb[hh] = kQ5 ? Load32(qb + 32 * (h0 + hh) + 2048 + 64 * s) : _mm256_setzero_si256();
      }
      __m256i s0[kHalves][NT], s1[kHalves][NT];
      for (int hh = 0; hh < kHalves; ++hh) {
        for (int t = 0; t < NT; ++t) s0[hh][t] = s1[hh][t] = _mm256_setzero_si256();
      }
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m256i w[kHalves][2];
        for (int hh = 0; hh < kHalves; ++hh) {
          NibbleCodes<kQ5>(qb + 32 * (h0 + hh) + 256 * s + 64 * i, hb[hh], i, &w[hh][0], &w[hh][1]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          const int8_t* c = act.codes[t] + 256 * b + 32 * s;
          const __m256i c0 = Bcast4(c + 4 * i), c1 = Bcast4(c + 16 + 4 * i);
          for (int hh = 0; hh < kHalves; ++hh) {
            const __m256i p0 = _mm256_maddubs_epi16(w[hh][0], c0);
            const __m256i p1 = _mm256_maddubs_epi16(w[hh][1], c1);
            if constexpr (kQ5) {  // lines 0..3 and 4..7 in separate int16 sums
              s0[hh][t] = _mm256_add_epi16(s0[hh][t], p0);
              s1[hh][t] = _mm256_add_epi16(s1[hh][t], p1);
              KeepSum(s1[hh][t]);
            } else {
              s0[hh][t] = _mm256_add_epi16(s0[hh][t], _mm256_add_epi16(p0, p1));
            }
            KeepSum(s0[hh][t]);
          }
        }
      }
      for (int hh = 0; hh < kHalves; ++hh) {
        // (sc, sc) int16 pairs of this half's 8 rows.
        __m256i sc = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + 64 + 16 * s + 8 * (h0 + hh))));
        sc = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
        for (int t = 0; t < NT; ++t) {
          __m256i d = _mm256_madd_epi16(s0[hh][t], sc);
          if constexpr (kQ5) d = _mm256_add_epi32(d, _mm256_madd_epi16(s1[hh][t], sc));
          si[hh][t] = _mm256_add_epi32(si[hh][t], d);
        }
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      for (int t = 0; t < NT; ++t) {
        const __m256i a = Bcast4(act.sum32[t] + 8 * b + 2 * p);
        for (int hh = 0; hh < kHalves; ++hh) {
          const __m256i mp = _mm256_cvtepu8_epi16(Load16(meta + 192 + 32 * p + 16 * (h0 + hh)));
          sm[hh][t] = _mm256_add_epi32(sm[hh][t], _mm256_madd_epi16(mp, a));
        }
      }
    }
  }
};

// Q6_K: sub-blocks 2P and 2P + 1 of block b, for the 8 rows of half h and NT
// tokens, added to si (the dots times their scales) and corr (the activation
// sums times the scales: the -32 offset). qb and meta are the block's.
struct Q6Sums {
  template <int NT>
  ELLM_TARGET ELLM_INLINE static void PairHalf(const uint8_t* qb, const uint8_t* meta, int P, int h,
                                               const TileActs<NT>& act, int64_t b, __m256i* si,
                                               __m256i* corr) {
    // Per dword (sc_even, sc_odd) -> (sc_even, sc_even) / (sc_odd, sc_odd).
    const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1,
                                          0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    const __m256i odd = _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2,
                                         3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
    qb += 32 * h;
    {
      const __m256i scp = _mm256_cvtepi8_epi16(Load16(meta + 32 + 32 * P + 16 * h));
      const __m256i sce = _mm256_shuffle_epi8(scp, even);
      const __m256i sco = _mm256_shuffle_epi8(scp, odd);
#pragma GCC unroll 2
      for (int kp = 0; kp < 4; kp += 2) {  // lines kp, kp + 1: one int16 sum each
        __m256i we[2], wo[2];
        for (int u = 0; u < 2; ++u) Q6Codes(qb, P, kp + u, &we[u], &wo[u]);
#pragma GCC unroll 2
        for (int t = 0; t < NT; ++t) {
          const int8_t* c = act.codes[t] + 256 * b + 32 * P;
          const __m256i e = _mm256_add_epi16(_mm256_maddubs_epi16(we[0], Bcast4(c + 4 * kp)),
                                             _mm256_maddubs_epi16(we[1], Bcast4(c + 4 * kp + 4)));
          const __m256i o = _mm256_add_epi16(_mm256_maddubs_epi16(wo[0], Bcast4(c + 16 + 4 * kp)),
                                             _mm256_maddubs_epi16(wo[1], Bcast4(c + 16 + 4 * kp + 4)));
          si[t] = _mm256_add_epi32(
              si[t], _mm256_add_epi32(_mm256_madd_epi16(e, sce), _mm256_madd_epi16(o, sco)));
        }
      }
      for (int t = 0; t < NT; ++t) {
        corr[t] = _mm256_add_epi32(corr[t],
                                   _mm256_madd_epi16(scp, Bcast4(act.sum16[t] + 16 * b + 2 * P)));
      }
    }
  }

  // PairHalf for 3 or 4 tokens, as the VNNI set's PairHalfSplit: the even and
  // odd sub-blocks in two sweeps, the offsets' sums left to Q6Corr. The integer
  // sums are PairHalf's.
  template <int NT>
  ELLM_TARGET ELLM_INLINE static void PairHalfSplit(const uint8_t* qb, const uint8_t* meta, int P, int h,
                                                    const TileActs<NT>& act, int64_t b, __m256i* si) {
    qb += 32 * h;
    const __m256i scp = _mm256_cvtepi8_epi16(Load16(meta + 32 + 32 * P + 16 * h));
#pragma GCC unroll 2
    for (int odd = 0; odd < 2; ++odd) {
      // Per dword (sc_even, sc_odd) -> (sc_even, sc_even) or (sc_odd, sc_odd).
      const __m256i pick = odd ? _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3,
                                                  2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15)
                               : _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1,
                                                  0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
      const __m256i sc = _mm256_shuffle_epi8(scp, pick);
#pragma GCC unroll 2
      for (int kp = 0; kp < 4; kp += 2) {  // lines kp, kp + 1: one int16 sum
        const __m256i w0 = Q6Code(qb, P, kp, odd != 0), w1 = Q6Code(qb, P, kp + 1, odd != 0);
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          const int8_t* c = act.codes[t] + 256 * b + 32 * P + 16 * odd + 4 * kp;
          const __m256i e =
              _mm256_add_epi16(_mm256_maddubs_epi16(w0, Bcast4(c)), _mm256_maddubs_epi16(w1, Bcast4(c + 4)));
          si[t] = _mm256_add_epi32(si[t], _mm256_madd_epi16(e, sc));
        }
      }
    }
  }
};

#endif  // ELLM_AVX2_VNNI

// Q6Sums::PairHalf's corr over block b's 8 sub-block pairs, for half h (for
// PairHalfSplit, which leaves it out).
template <int NT>
ELLM_TARGET ELLM_INLINE void Q6Corr(const uint8_t* meta, int h, const TileActs<NT>& act, int64_t b, __m256i* corr) {
#pragma GCC unroll 8
  for (int P = 0; P < 8; ++P) {
    const __m256i scp = _mm256_cvtepi8_epi16(Load16(meta + 32 + 32 * P + 16 * h));
    for (int t = 0; t < NT; ++t) corr[t] = AddPairProducts(corr[t], scp, Bcast4(act.sum16[t] + 16 * b + 2 * P));
  }
}

// --- int8 tiles, on either set's products -------------------------------------------

// Q8_0 takes whole 64-byte lines (both halves of 8 rows): each activation
// broadcast serves 16 rows, and each line is read once. (Half a line per
// pass, the group streamed twice, ran at 0.58 of the read probe on avx2.)
// For several tokens (prefill) a line's two halves serve every token of the
// tile, so a VPDPBUSD costs 1/2 + 1/NT loads (0.75 for 4 tokens) where a
// half-line tile's cost 1 + 1/NT for two tokens at most (1.5): prefill of
// 1024 tokens on the bench model (ellm-bench prefill --matmul-isa avx2-vnni,
// AMD EPYC Zen 5, 2 threads), matrix work at 0.35-0.39 -> 0.50-0.52 of the
// VPDPBUSD peak, 348-383 -> 508 tokens/s. Plain avx2 takes 4 tokens too:
// its sums stay in registers (KeepSum) and the float sums, touched once a
// block, go to the stack. Against 2 tokens with the sums reassociated
// through the stack (AMD EPYC Zen 5, forced, alternated 3 rounds): 4096-token
// prefill 283-288 -> 328-355 tokens/s, matrix work 0.47-0.48 -> 0.59-0.60 of
// the widened VPMADDUBSW peak (ellm-bench peak); 5120 x 5120 at T = 4, 2
// threads, 19.4-22.7 -> 29.1-32.8 GB/s of weights.
template <typename Half>
struct Q8_0Tile {
  static constexpr bool kWholeLines = true;
  static constexpr int kMaxTokens = 4;
  template <int NT>
  ELLM_TARGET static void Run(const KernelArgs& a, int64_t g, int /*h*/, int t0) {
    Lines<NT, 1>(a, g, t0);
  }

  // One token (T = 1, decode): groups in pairs, their lines interleaved. Two
  // streams of lines keep more DRAM reads in flight than one: one group at a
  // time ran at 0.63-0.83 of the read probe, pairs at 0.84-1.03 (avx2; the
  // AVX-512 kernel reads groups in pairs too). Two tokens of a pair would spill.
  ELLM_TARGET static void RunWhole(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
    int64_t g = g_begin;
    for (; g + 1 < g_end; g += 2) Lines<1, 2>(a, g, 0);
    if (g < g_end) Lines<1, 1>(a, g, 0);
  }

  // Groups g .. g + kG - 1, NT tokens.
  template <int NT, int kG>
  ELLM_TARGET static void Lines(const KernelArgs& a, int64_t g, int t0) {
    const QuantMatrix& w = *a.w;
    const int64_t nb = w.cols() / 32;
    const uint8_t* quant[kG];
    const uint16_t* dh[kG];
    for (int i = 0; i < kG; ++i) {
      quant[i] = w.group(g + i);
      dh[i] = reinterpret_cast<const uint16_t*>(quant[i] + nb * 512);
    }
    const TileActs<NT> act(a, t0, 32);
    __m256 acc[kG][NT][2];
    for (int i = 0; i < kG; ++i) {
      for (int t = 0; t < NT; ++t) acc[i][t][0] = acc[i][t][1] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
      __m256i s[kG][NT][2];
      for (int i = 0; i < kG; ++i) {
        for (int t = 0; t < NT; ++t) {
          s[i][t][0] = s[i][t][1] = _mm256_set1_epi32(Half::kQ8Start * act.sum[t][b]);
        }
        PrefetchAhead(quant[i] + b * 512, 512);
        PrefetchAhead(dh[i] + 16 * b, 32);
      }
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
#pragma GCC unroll 2
        for (int i = 0; i < kG; ++i) {
          const uint8_t* line = quant[i] + b * 512 + 64 * k;
          const Half w0(line), w1(line + 32);
#pragma GCC unroll 4
          for (int t = 0; t < NT; ++t) {
            const __m256i c = Bcast4(act.codes[t] + 32 * b + 4 * k);
            s[i][t][0] = w0.Dot(s[i][t][0], c);
            s[i][t][1] = w1.Dot(s[i][t][1], c);
            KeepSum(s[i][t][0]);
            KeepSum(s[i][t][1]);
          }
        }
      }
#pragma GCC unroll 2
      for (int i = 0; i < kG; ++i) {
        const __m256 dw0 = LoadHalves8(dh[i] + 16 * b), dw1 = LoadHalves8(dh[i] + 16 * b + 8);
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          const __m256 da = _mm256_set1_ps(act.d[t][b]);
          acc[i][t][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[i][t][0]), da), dw0, acc[i][t][0]);
          acc[i][t][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[i][t][1]), da), dw1, acc[i][t][1]);
        }
      }
    }
    for (int i = 0; i < kG; ++i) {
      for (int t = 0; t < NT; ++t) {
        for (int h = 0; h < 2; ++h) {
          Store8(acc[i][t][h], a.y + (t0 + t) * a.ldy + (g + i) * kGroupRows + 8 * h, ValidHalf(w, g + i, h));
        }
      }
    }
  }
};

// Q4_0: half lines, NT tokens.
struct Q4_0Tile {
  template <int NT>
  ELLM_TARGET static void Run(const KernelArgs& a, int64_t g, int h, int t0) {
    const QuantMatrix& w = *a.w;
    const int64_t nb = w.cols() / 32;
    const uint8_t* quant = w.group(g) + 32 * h;
    const uint16_t* dh = reinterpret_cast<const uint16_t*>(w.group(g) + nb * 256) + 8 * h;
    const TileActs<NT> act(a, t0, 32);
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      if (h == 0) {
        PrefetchAhead(quant + b * 256, 256);
        PrefetchAhead(dh + 16 * b, 32);
      }
      __m256i s[NT];
      Q4_0Sums::Block<NT>(quant, act, b, s);
      const __m256 dw = LoadHalves8(dh + 16 * b);
      for (int t = 0; t < NT; ++t) {
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[t]), _mm256_set1_ps(act.d[t][b])),
                                 dw, acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      Store8(acc[t], a.y + (t0 + t) * a.ldy + g * kGroupRows + 8 * h, ValidHalf(w, g, h));
    }
  }

  // One token (T = 1, decode): both halves of each block in turn, so the
  // group is read in one pass (Run<1> reads it twice, the second time from
  // cache). The arithmetic per half is Run's.
  ELLM_TARGET static void RunWhole(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
    const QuantMatrix& w = *a.w;
    const int64_t nb = w.cols() / 32;
    const TileActs<1> act(a, 0, 32);
    for (int64_t g = g_begin; g < g_end; ++g) {
      const uint8_t* quant = w.group(g);
      const uint16_t* dh = reinterpret_cast<const uint16_t*>(quant + nb * 256);
      __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t b = 0; b < nb; ++b) {
        PrefetchBlocks(w, g, b, nb, 256, 32);
        for (int h = 0; h < 2; ++h) {
          __m256i s;
          Q4_0Sums::Block<1>(quant + 32 * h, act, b, &s);
          acc[h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(act.d[0][b])),
                                   LoadHalves8(dh + 16 * b + 8 * h), acc[h]);
        }
      }
      for (int h = 0; h < 2; ++h) Store8(acc[h], a.y + g * kGroupRows + 8 * h, ValidHalf(w, g, h));
    }
  }
};

template <bool kQ5>
struct K4Tile {
  using Sums = K4Sums<kQ5>;
  static constexpr int kQuant = Sums::kQuant;
  // avx2-vnni: 4 tokens a tile (one sum per token, see K4Sums). T = 4 from
  // cache (ELLM_BENCH_MATVEC_N=1024, 1 thread, Zen 5) 14.6-15.0 -> 18.8-19.3
  // GB/s of Q4_K, from DRAM (2 threads) 0.33-0.41 -> 0.43-0.44 of the probe.
  // Plain avx2's half-line tiles stay at 2: with 4, GCC spilled the int16
  // sums (T = 4 and 16 slower, 2 threads, 5120 x 5120, alternated 3 rounds).
  static constexpr int kMaxTokens = ELLM_AVX2_VNNI ? 4 : kMaxTile;
  // Plain avx2 Q4_K takes every step, prefill too, through RunWhole in tiles
  // of 4 tokens, one half of a block after the other (Whole): a line's 4-bit
  // codes are unpacked once for 4 tokens, where two tiles of 2 unpacked them
  // twice and read the group twice. (The half-line tiles' spills were a token
  // loop that GCC unrolled by 2 only: K4Sums now asks for 4.) 5120 x 5120 from
  // cache (ELLM_BENCH_MATVEC_N=1024 ELLM_BENCH_WORKING_SET_KB=400), AMD EPYC
  // Zen 5, alternated 2 rounds: T = 4, 1 thread, 16.1-16.3 -> 17.1-17.5 GB/s;
  // T = 16, 1 thread, 3.7-4.0 -> 4.3, 2 threads 7.7-7.8 -> 8.1-8.2. From DRAM,
  // T = 4, 2 threads, 5 rounds: 22.4-29.2 -> 24.8-31.4 (within this VM's noise).
  // Elsewhere RunWhole takes up to 4 tokens (decode batches) in tiles of
  // kMaxTokens.
  static constexpr bool kFourAlways = !ELLM_AVX2_VNNI && !kQ5;
  static constexpr int kWholeTile = kFourAlways ? 4 : kMaxTokens;
  static constexpr int kWholeTokens = kFourAlways ? std::numeric_limits<int>::max() : 4;

  // acc += (d * si - dmin * sm) * d_act for half h.
  ELLM_TARGET ELLM_INLINE static __m256 Finish(const uint8_t* meta, int h, __m256i si, __m256i sm,
                                               float d_act, __m256 acc) {
    const __m256 d = LoadHalves8(meta + 16 * h);
    const __m256 dmin = LoadHalves8(meta + 32 + 16 * h);
    const __m256 f =
        _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(si), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(sm)));
    return _mm256_fmadd_ps(f, _mm256_set1_ps(d_act), acc);
  }

  // Half h of each line, NT tokens: two passes per group (h = 0, 1).
  template <int NT>
  ELLM_TARGET static void Run(const KernelArgs& a, int64_t g, int h, int t0) {
    const QuantMatrix& w = *a.w;
    const int64_t nb = w.cols() / 256;
    const uint8_t* quant = w.group(g);
    const uint8_t* meta0 = quant + nb * kQuant;
    const TileActs<NT> act(a, t0, 256);
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = quant + b * kQuant;
      const uint8_t* meta = meta0 + b * 320;
      if (h == 0) {
        PrefetchAhead(qb, kQuant);
        PrefetchAhead(meta, 320);
      }
      __m256i si[1][NT], sm[1][NT];
      Sums::template Halves<NT, 1>(qb, meta, h, act, b, si, sm);
      for (int t = 0; t < NT; ++t) acc[t] = Finish(meta, h, si[0][t], sm[0][t], act.d[t][b], acc[t]);
    }
    for (int t = 0; t < NT; ++t) {
      Store8(acc[t], a.y + (t0 + t) * a.ldy + g * kGroupRows + 8 * h, ValidHalf(w, g, h));
    }
  }

  // Up to kWholeTokens tokens: both halves of each block at once
  // (K4Sums::Halves; plain avx2 with more than 2 tokens, one half after the
  // other), so the group is read in one pass (once per tile of tokens, then
  // from L2) and each activation broadcast serves both halves.
  // The integer sums per half are Run's. avx2-vnni, T = 4 from DRAM, 2
  // threads: 0.39-0.46 -> 0.52-0.54 of the probe against the half-line
  // tiles' two passes (plain avx2 0.28-0.29 -> 0.26-0.41); sharing the
  // broadcasts, from cache, 1 thread: plain avx2 T = 1 33-36 -> 36-44 GB/s,
  // avx2-vnni 40-55 -> 53-70.
  ELLM_TARGET static void RunWhole(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
    ForEachTokenPass(a.T, [&](int t_begin, int t_end) {  // matmul_layout.h
      for (int64_t g = g_begin; g < g_end; ++g) {
        ForEachTile<kWholeTile>(t_begin, t_end, [&](int t0, auto nt) { Whole<decltype(nt)::value>(a, g, t0); });
      }
    });
  }
  template <int NT>
  ELLM_TARGET static void Whole(const KernelArgs& a, int64_t g, int t0) {
    const QuantMatrix& w = *a.w;
    const int64_t nb = w.cols() / 256;
    const uint8_t* quant = w.group(g);
    const uint8_t* meta0 = quant + nb * kQuant;
    const TileActs<NT> act(a, t0, 256);
    __m256 acc[2][NT];
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < NT; ++t) acc[h][t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = quant + b * kQuant;
      const uint8_t* meta = meta0 + b * 320;
      // The block 4 ahead into L2 only (its 32-40 lines at once into L1
      // likely took fill buffers this block's loads needed; not measured
      // directly). 5120 x 5120 Q4_K
      // from DRAM, 2 threads, Xeon family 6 model 207, 5 rounds alternated:
      // T = 1 0.89-0.98 -> 1.02-1.16 of the probe, T = 4 0.63-0.70 ->
      // 0.71-0.76; avx2-vnni T = 4 0.73-0.77 -> 0.81-0.87. (Q4_0's 4 and
      // Q6_K's 48 lines a block: no gain, T0 kept.)
      PrefetchBlocks<_MM_HINT_T1>(w, g, b, nb, kQuant, 320);
      if constexpr (NT > kMaxTokens) {  // one half at a time
        for (int h = 0; h < 2; ++h) {
          __m256i si[1][NT], sm[1][NT];
          Sums::template Halves<NT, 1>(qb, meta, h, act, b, si, sm);
          for (int t = 0; t < NT; ++t) acc[h][t] = Finish(meta, h, si[0][t], sm[0][t], act.d[t][b], acc[h][t]);
        }
      } else {
        __m256i si[2][NT], sm[2][NT];
        Sums::template Halves<NT, 2>(qb, meta, 0, act, b, si, sm);
        for (int h = 0; h < 2; ++h) {
          for (int t = 0; t < NT; ++t) acc[h][t] = Finish(meta, h, si[h][t], sm[h][t], act.d[t][b], acc[h][t]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < NT; ++t) {
        Store8(acc[h][t], a.y + (t0 + t) * a.ldy + g * kGroupRows + 8 * h, ValidHalf(w, g, h));
      }
    }
  }
};

struct Q6Tile {
  static constexpr int kMaxTokens = 4;  // 3-4 tokens: PairHalfSplit
  // acc += (si - 32 corr) * d_act * d for half h.
  ELLM_TARGET ELLM_INLINE static __m256 Finish(const uint8_t* meta, int h, __m256i si, __m256i corr,
                                               float d_act, __m256 acc) {
    const __m256i total = _mm256_sub_epi32(si, _mm256_slli_epi32(corr, 5));
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d_act)),
                           LoadHalves8(meta + 16 * h), acc);
  }

  // Half h of each line, NT tokens: two passes per group (h = 0, 1).
  template <int NT>
  ELLM_TARGET static void Run(const KernelArgs& a, int64_t g, int h, int t0) {
    const QuantMatrix& w = *a.w;
    const int64_t nb = w.cols() / 256;
    const uint8_t* quant = w.group(g);
    const uint8_t* meta0 = quant + nb * 3072;
    const TileActs<NT> act(a, t0, 256);
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = quant + b * 3072;
      const uint8_t* meta = meta0 + b * 288;
      if (h == 0) {
        PrefetchAhead(qb, 3072);
        PrefetchAhead(meta, 288);
      }
      __m256i si[NT], corr[NT];
      for (int t = 0; t < NT; ++t) si[t] = corr[t] = _mm256_setzero_si256();
      if constexpr (NT > 2) {
        for (int P = 0; P < 8; ++P) Q6Sums::PairHalfSplit<NT>(qb, meta, P, h, act, b, si);
        Q6Corr<NT>(meta, h, act, b, corr);
      } else {
        for (int P = 0; P < 8; ++P) Q6Sums::PairHalf<NT>(qb, meta, P, h, act, b, si, corr);
      }
      for (int t = 0; t < NT; ++t) acc[t] = Finish(meta, h, si[t], corr[t], act.d[t][b], acc[t]);
    }
    for (int t = 0; t < NT; ++t) {
      Store8(acc[t], a.y + (t0 + t) * a.ldy + g * kGroupRows + 8 * h, ValidHalf(w, g, h));
    }
  }

  // One token (T = 1, decode): both halves of each sub-block pair in turn, so
  // the group is read in one pass. The arithmetic per half is Run's.
  ELLM_TARGET static void RunWhole(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
    for (int64_t g = g_begin; g < g_end; ++g) Whole(a, g);
  }
  ELLM_TARGET static void Whole(const KernelArgs& a, int64_t g) {
    const QuantMatrix& w = *a.w;
    const int64_t nb = w.cols() / 256;
    const uint8_t* quant = w.group(g);
    const uint8_t* meta0 = quant + nb * 3072;
    const TileActs<1> act(a, 0, 256);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = quant + b * 3072;
      const uint8_t* meta = meta0 + b * 288;
      PrefetchBlocks(w, g, b, nb, 3072, 288);
      __m256i si[2], corr[2];
      for (int h = 0; h < 2; ++h) si[h] = corr[h] = _mm256_setzero_si256();
      for (int P = 0; P < 8; ++P) {
        for (int h = 0; h < 2; ++h) Q6Sums::PairHalf<1>(qb, meta, P, h, act, b, &si[h], &corr[h]);
      }
      for (int h = 0; h < 2; ++h) acc[h] = Finish(meta, h, si[h], corr[h], act.d[0][b], acc[h]);
    }
    for (int h = 0; h < 2; ++h) Store8(acc[h], a.y + g * kGroupRows + 8 * h, ValidHalf(w, g, h));
  }
};

// --- fp32 activations (F16, BF16): built once -----------------------------------

#if !ELLM_AVX2_VNNI
template <bool kBf16>
struct HalfTile {
  // Whole lines (both halves of 8 rows), 2 tokens a tile: each broadcast
  // activation serves both halves, and the sums of each (token, half) are
  // those of the one-token tile below, even and odd columns apart (so any
  // batch gives the same bits). 4 tokens of whole lines would need 16 sums,
  // all the registers. Against half lines of 4 tokens (each half its own
  // pass, each activation broadcast per half), 5120 x 5120 F16 from DRAM,
  // AMD EPYC Zen 5, 3 rounds: T = 4 1 thread 13.4-14.4 -> 15.6-15.9 GB/s,
  // 2 threads 22.0-24.4 -> 25.0-27.5 (bench/results/amd-epyc-zen5.md).
  // One token (decode) reads the lines without the prefetch ahead: 1 thread
  // 13.8-15.5 GB/s in two passes of half lines, 20.1-23.4 in one of whole
  // lines, 18.2-19.7 with the prefetch (the hardware prefetcher follows one
  // stream better); from cache 56 GB/s (28 in two passes).
  static constexpr bool kWholeLines = true;
  static constexpr int kMaxTokens = 2;
  template <int NT>
  ELLM_TARGET static void Run(const KernelArgs& a, int64_t g, int /*h*/, int t0) {
    const QuantMatrix& w = *a.w;
    const int64_t cols = w.cols();
    const uint16_t* q = reinterpret_cast<const uint16_t*>(w.group(g));
    const float* x[NT];
    __m256 acc[2][NT][2];  // [column parity][token][half]
    for (int t = 0; t < NT; ++t) {
      x[t] = a.x + (t0 + t) * cols;
      for (auto& parity : acc) parity[t][0] = parity[t][1] = _mm256_setzero_ps();
    }
    const auto column = [&](int64_t i, int p) ELLM_TARGET __attribute__((always_inline)) {
      const __m256 w0 = kBf16 ? LoadBf16x8(q + 16 * i) : LoadHalves8(q + 16 * i);
      const __m256 w1 = kBf16 ? LoadBf16x8(q + 16 * i + 8) : LoadHalves8(q + 16 * i + 8);
      for (int t = 0; t < NT; ++t) {
        const __m256 xt = _mm256_set1_ps(x[t][i]);
        acc[p][t][0] = _mm256_fmadd_ps(w0, xt, acc[p][t][0]);
        acc[p][t][1] = _mm256_fmadd_ps(w1, xt, acc[p][t][1]);
      }
    };
    int64_t i = 0;
    for (; i + 2 <= cols; i += 2) {  // a 64-byte line holds 2 columns
      if constexpr (NT > 1) PrefetchAhead(q + 16 * i, 64);
      column(i, 0);
      column(i + 1, 1);
    }
    if (i < cols) column(i, 0);
    for (int t = 0; t < NT; ++t) {
      for (int h = 0; h < 2; ++h) {
        Store8(_mm256_add_ps(acc[0][t][h], acc[1][t][h]), a.y + (t0 + t) * a.ldy + g * kGroupRows + 8 * h,
               ValidHalf(w, g, h));
      }
    }
  }
};

#endif  // !ELLM_AVX2_VNNI

// Tiles that take whole lines (kWholeLines) run once per group and token
// pair; the others once per half line.
template <typename Tile, typename = void>
struct TakesWholeLines : std::false_type {};
template <typename Tile>
struct TakesWholeLines<Tile, std::void_t<decltype(Tile::kWholeLines)>> : std::bool_constant<Tile::kWholeLines> {};

// Tokens per tile: Tile::kMaxTokens where it says, else kMaxTile.
template <typename Tile, typename = void>
struct MaxTokens : std::integral_constant<int, kMaxTile> {};
template <typename Tile>
struct MaxTokens<Tile, std::void_t<decltype(Tile::kMaxTokens)>> : std::integral_constant<int, Tile::kMaxTokens> {};

// Tiles with a RunWhole (whole lines, groups [g_begin, g_end)) use it for
// T <= Tile::kWholeTokens where they say, else for T = 1.
template <typename Tile, typename = void>
struct HasRunWhole : std::false_type {};
template <typename Tile>
struct HasRunWhole<Tile, std::void_t<decltype(&Tile::RunWhole)>> : std::true_type {};
template <typename Tile, typename = void>
struct WholeTokens : std::integral_constant<int, 1> {};
template <typename Tile>
struct WholeTokens<Tile, std::void_t<decltype(Tile::kWholeTokens)>> : std::integral_constant<int, Tile::kWholeTokens> {};

// Decode steps on whole lines (RunWhole, up to WholeTokens tokens) where the
// tile has it, else per group tiles of tokens over each half line that has
// rows, or over whole lines (h = 0 covers both halves) for the tiles that
// take them.
template <typename Tile>
ELLM_TARGET void RunTiles(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
  if constexpr (HasRunWhole<Tile>::value) {
    if (a.T <= WholeTokens<Tile>::value) return Tile::RunWhole(a, g_begin, g_end);
  }
  constexpr int kHalves = TakesWholeLines<Tile>::value ? 1 : 2;
  ForEachTokenPass(a.T, [&](int t_begin, int t_end) {  // matmul_layout.h
    for (int64_t g = g_begin; g < g_end; ++g) {
      for (int h = 0; h < kHalves; ++h) {
        if (ValidHalf(*a.w, g, h) == 0) continue;
        ForEachTile<MaxTokens<Tile>::value>(t_begin, t_end, [&](int t0, auto nt) {
          Tile::template Run<decltype(nt)::value>(a, g, h, t0);
        });
      }
    }
  });
}

}  // namespace

#if ELLM_AVX2_VNNI
MatKernel Avx2VnniKernel(DType type) {
  switch (type) {
    case DType::kQ8_0: return RunTiles<Q8_0Tile<Q8Half>>;
    case DType::kQ4_0: return RunTiles<Q4_0Tile>;
    case DType::kQ4_K: return RunTiles<K4Tile<false>>;
    case DType::kQ5_K: return RunTiles<K4Tile<true>>;
    case DType::kQ6_K: return RunTiles<Q6Tile>;
    default: return Avx2Kernel(type);  // F32, F16, BF16: no int8 products
  }
}
#else
MatKernel Avx2Kernel(DType type) {
  switch (type) {
    case DType::kF32: return F32ExactKernelAvx;
    case DType::kF16: return RunTiles<HalfTile<false>>;
    case DType::kBF16: return RunTiles<HalfTile<true>>;
    case DType::kQ8_0: return RunTiles<Q8_0Tile<Q8Half>>;
    case DType::kQ4_0: return RunTiles<Q4_0Tile>;
    case DType::kQ4_K: return RunTiles<K4Tile<false>>;
    case DType::kQ5_K: return RunTiles<K4Tile<true>>;
    case DType::kQ6_K: return RunTiles<Q6Tile>;
    default: return nullptr;
  }
}

MatKernel Avx2Q8_0Act7Kernel() { return RunTiles<Q8_0Tile<Q8Half7>>; }
#endif  // ELLM_AVX2_VNNI

}  // namespace ellm::mlp::internal
