// AVX-512 matrix kernels (F, BW, VL, DQ, VNNI + F16C, FMA). Every function
// here carries the target attribute; nothing else in the program is compiled
// for AVX-512, and the dispatcher calls in only when the CPU has all of it.
//
// Shape of the work: one group of 16 rows at a time, its 16 rows in the 16
// lanes of every vector (matmul_layout.h), tokens in tiles of up to kMaxTile
// whose accumulators stay in registers while each weight line is loaded and
// unpacked once for the whole tile. Per 64-byte line of weight codes and
// token: one VPDPBUSD with the token's 4 activation codes broadcast.
//
//   Q8_0 / Q4_0  per block of 32: s = -off * sum(codes) + sum_k dpbusd(line_k,
//                codes_k) (off = 128 for Q8_0's u8 = code + 128, 8 for Q4_0),
//                y += float(s) * d_act * d_w.
//   Q4_K / Q5_K  per super-block: si = sum_s sc_s * dot_s (int32, VPMULLD),
//                sm = sum_s m_s * sum32_s (VPDPWSSD on (m, m) x (sum, sum)
//                pairs), y += d_act * (d * si - dmin * sm).
//   Q6_K         si = sum_s sc_s * dot_s, corr = sum_s sc_s * sum16_s
//                (VPDPWSSD), y += d_act * d * (si - 32 corr).
//   F16 / BF16   per element: VCVTPH2PS (or a 16-bit shift) of the 16 rows'
//                weights, one FMA per token with the broadcast activation.
// All integer sums are exact (bounds in the comments); only the per-block
// float accumulation differs from the fp64 reference.
#include <immintrin.h>

#include <cstdint>

// GCC 12 warns on its own AVX-512 headers' undefined-vector idiom. (Clang
// has no -Wmaybe-uninitialized.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "mlp-worker/cpu/matmul_layout.h"

#define ELLM_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define ELLM_INLINE inline __attribute__((always_inline))

namespace ellm::mlp::internal {
namespace {

constexpr int kMaxTile = 4;  // tokens per register tile

ELLM_TARGET ELLM_INLINE __m512i Bcast4(const void* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

ELLM_TARGET ELLM_INLINE __m512 LoadHalves16(const void* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

ELLM_TARGET ELLM_INLINE __m512 LoadBf16x16(const void* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

ELLM_TARGET ELLM_INLINE __m512i Load64(const uint8_t* p) {
  return _mm512_load_si512(reinterpret_cast<const void*>(p));
}

ELLM_TARGET ELLM_INLINE void Store16(__m512 v, float* y, int valid) {
  if (valid == 16) {
    _mm512_storeu_ps(y, v);
  } else {
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << valid) - 1), v);
  }
}

// Q8_0 (kQ4 = false) and Q4_0 (kQ4 = true) on kG groups of 16 rows at once.
// Bounds: |dot| <= 32 * 255 * 127.
// kG = 2: each broadcast activation group serves two VPDPBUSDs, one per
// group's line. One group is bound by loads (a 4-byte broadcast and half a
// weight line per VPDPBUSD); two need 0.75 loads per VPDPBUSD. A single group
// keeps two sum chains (its two lines) to cover VPDPBUSD's latency; integer
// sums are exact, so both shapes give the same results bit for bit.
template <bool kQ4, int kG>
struct Q32Tile {
  template <int NT>
  ELLM_TARGET static void Run(const KernelArgs& a, int64_t g, int t0) {
    constexpr int kQuant = kQ4 ? 256 : 512;
    constexpr int32_t kOffset = kQ4 ? 8 : 128;
    constexpr int kChains = kG == 1 ? 2 : 1;  // sum chains per group and token
    const QuantMatrix& w = *a.w;
    const int64_t nb = w.cols() / 32;
    const uint8_t* quant[kG];
    const uint16_t* dh[kG];
    for (int h = 0; h < kG; ++h) {
      quant[h] = w.group(g + h);
      dh[h] = reinterpret_cast<const uint16_t*>(quant[h] + nb * kQuant);
    }
    const TileActs<NT> act(a, t0, 32);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[kG][NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      for (int h = 0; h < kG; ++h) acc[h][t] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
      __m512i s[kG][kChains][NT];
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        for (int h = 0; h < kG; ++h) {
          s[h][0][t] = _mm512_set1_epi32(-kOffset * act.sum[t][b]);
          if constexpr (kChains == 2) s[h][1][t] = _mm512_setzero_si512();
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m512i w0[kG], w1[kG];
#pragma GCC unroll 2
        for (int h = 0; h < kG; ++h) {
          const uint8_t* qb = quant[h] + b * kQuant;
          if constexpr (kQ4) {
            const __m512i v = Load64(qb + 64 * i);
            w0[h] = _mm512_and_si512(v, low);
            w1[h] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          } else {
            w0[h] = Load64(qb + 128 * i);
            w1[h] = Load64(qb + 128 * i + 64);
          }
        }
        // Activation offsets of the two lines.
        const int o0 = kQ4 ? 4 * i : 8 * i, o1 = kQ4 ? 16 + 4 * i : 8 * i + 4;
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          const int8_t* c = act.codes[t] + 32 * b;
          const __m512i c0 = Bcast4(c + o0), c1 = Bcast4(c + o1);
          for (int h = 0; h < kG; ++h) s[h][0][t] = _mm512_dpbusd_epi32(s[h][0][t], w0[h], c0);
          for (int h = 0; h < kG; ++h) {
            s[h][kChains - 1][t] = _mm512_dpbusd_epi32(s[h][kChains - 1][t], w1[h], c1);
          }
        }
      }
#pragma GCC unroll 2
      for (int h = 0; h < kG; ++h) {
        const __m512 dw = LoadHalves16(dh[h] + 16 * b);
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          const __m512i sum = kChains == 2 ? _mm512_add_epi32(s[h][0][t], s[h][kChains - 1][t]) : s[h][0][t];
          const __m512 f = _mm512_cvtepi32_ps(sum);
          acc[h][t] = _mm512_fmadd_ps(_mm512_mul_ps(f, _mm512_set1_ps(act.d[t][b])), dw, acc[h][t]);
        }
      }
    }
    for (int h = 0; h < kG; ++h) {
      const int valid = ValidRows(w, g + h);
      for (int t = 0; t < NT; ++t) Store16(acc[h][t], a.y + (t0 + t) * a.ldy + (g + h) * kGroupRows, valid);
    }
  }
};

// The k-quant tiles prefetch their lines ahead (matmul_layout.h): 5120 x
// 5120, 2 threads, AMD EPYC Zen 5, best of 3: Q4_K 35.0 -> 39.9 GB/s at T = 1
// and 24.2 -> 34.0 at T = 4, Q6_K 30.3 -> 43.9 and 22.0 -> 29.4. Q8_0, Q4_0
// and F16 run as fast without (the hardware prefetcher keeps up with them).
//
// Q4_K (kQ5 = false) and Q5_K. Bounds: dot_s <= 32 * 31 * 127, si <= 8 * 63 *
// that < 2^26, sm <= 8 * 63 * 32 * 127.
template <bool kQ5>
struct K4Tile {
  template <int NT>
  ELLM_TARGET static void Run(const KernelArgs& a, int64_t g, int t0) {
    constexpr int kQuant = kQ5 ? 2560 : 2048;
    const QuantMatrix& w = *a.w;
    const int64_t nb = w.cols() / 256;
    const uint8_t* quant = w.group(g);
    const uint8_t* meta0 = quant + nb * kQuant;
    const TileActs<NT> act(a, t0, 256);
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    __m512 acc[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = quant + b * kQuant;
      const uint8_t* meta = meta0 + b * 320;
      // A pass's first tile (ForEachTile) prefetches, into L2 only as
      // avx2's K4Tile::Whole does: 5120 x 5120 Q4_K from DRAM, 2 threads,
      // Xeon family 6 model 207, 4 rounds alternated with T0: T = 1
      // 1.00-1.03 -> 1.05-1.12 of the probe, T = 4 0.82-0.83 -> 0.87-0.91
      // (Q6_K: within noise, T0 kept).
      if (t0 % kTokenChunk == 0) PrefetchBlocks<_MM_HINT_T1>(w, g, b, nb, kQuant, 320);
      __m512i si[NT], sm[NT];
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) si[t] = sm[t] = _mm512_setzero_si512();
      for (int s = 0; s < 8; ++s) {
        const __m512i sc = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 64 + 16 * s)));
        __m512i hb = _mm512_setzero_si512();
        if constexpr (kQ5) hb = Load64(qb + 2048 + 64 * s);
        __m512i s0[NT], s1[NT];
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) s0[t] = s1[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const __m512i v = Load64(qb + 256 * s + 64 * i);
          __m512i w0 = _mm512_and_si512(v, low);
          __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          if constexpr (kQ5) {
            // Line i's 5th bits are bit i of hb, line i + 4's bit i + 4.
            w0 = _mm512_or_si512(
                w0, _mm512_and_si512(_mm512_sll_epi16(hb, _mm_cvtsi32_si128(4 - i)), bit4));
            w1 = _mm512_or_si512(
                w1, _mm512_and_si512(_mm512_srl_epi16(hb, _mm_cvtsi32_si128(i)), bit4));
          }
#pragma GCC unroll 4
          for (int t = 0; t < NT; ++t) {
            const int8_t* c = act.codes[t] + 256 * b + 32 * s;
            s0[t] = _mm512_dpbusd_epi32(s0[t], w0, Bcast4(c + 4 * i));
            s1[t] = _mm512_dpbusd_epi32(s1[t], w1, Bcast4(c + 16 + 4 * i));
          }
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          si[t] = _mm512_add_epi32(si[t], _mm512_mullo_epi32(_mm512_add_epi32(s0[t], s1[t]), sc));
        }
      }
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512i mp = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 192 + 32 * p)));
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          sm[t] = _mm512_dpwssd_epi32(sm[t], mp, Bcast4(act.sum32[t] + 8 * b + 2 * p));
        }
      }
      const __m512 d = LoadHalves16(meta);
      const __m512 dmin = LoadHalves16(meta + 32);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const __m512 f = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(si[t]),
                                         _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(sm[t])));
        acc[t] = _mm512_fmadd_ps(f, _mm512_set1_ps(act.d[t][b]), acc[t]);
      }
    }
    const int valid = ValidRows(w, g);
    for (int t = 0; t < NT; ++t) Store16(acc[t], a.y + (t0 + t) * a.ldy + g * kGroupRows, valid);
  }
};

// Q6_K. Bounds: dot_s <= 16 * 63 * 127, si <= 16 * 128 * that < 2^29,
// 32 corr <= 32 * 16 * 128 * 16 * 127 < 2^28.
struct Q6Tile {
  template <int NT>
  ELLM_TARGET static void Run(const KernelArgs& a, int64_t g, int t0) {
    const QuantMatrix& w = *a.w;
    const int64_t nb = w.cols() / 256;
    const uint8_t* quant = w.group(g);
    const uint8_t* meta0 = quant + nb * 3072;
    const TileActs<NT> act(a, t0, 256);
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i two = _mm512_set1_epi8(0x30);
    __m512 acc[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = quant + b * 3072;
      const uint8_t* meta = meta0 + b * 288;
      if (t0 % kTokenChunk == 0) PrefetchBlocks(w, g, b, nb, 3072, 288);  // a pass's first tile (ForEachTile)
      __m512i si[NT], corr[NT];
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) si[t] = corr[t] = _mm512_setzero_si512();
      for (int P = 0; P < 8; ++P) {  // sub-blocks 2P and 2P + 1
        const __m512i scp = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 32 + 32 * P)));
        const __m512i sce = _mm512_srai_epi32(_mm512_slli_epi32(scp, 16), 16);
        const __m512i sco = _mm512_srai_epi32(scp, 16);
        // Sub-block 2P's high bits are bits 2u, 2u + 1 of qh with u = 2 (P % 2):
        // shifted to bits 4, 5 (and 2P + 1's to bits 6, 7 -> 4, 5 after >> 2).
        const __m128i shift = _mm_cvtsi32_si128(P % 2 ? 0 : 4);
        __m512i s0[NT], s1[NT];
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) s0[t] = s1[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const __m512i v = Load64(qb + 256 * P + 64 * k);
          const __m512i h = _mm512_sll_epi16(Load64(qb + 2048 + 256 * (P / 2) + 64 * k), shift);
          const __m512i we = _mm512_or_si512(_mm512_and_si512(v, low), _mm512_and_si512(h, two));
          const __m512i wo = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                             _mm512_and_si512(_mm512_srli_epi16(h, 2), two));
#pragma GCC unroll 4
          for (int t = 0; t < NT; ++t) {
            const int8_t* c = act.codes[t] + 256 * b + 32 * P;
            s0[t] = _mm512_dpbusd_epi32(s0[t], we, Bcast4(c + 4 * k));
            s1[t] = _mm512_dpbusd_epi32(s1[t], wo, Bcast4(c + 16 + 4 * k));
          }
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          si[t] = _mm512_add_epi32(si[t], _mm512_add_epi32(_mm512_mullo_epi32(s0[t], sce),
                                                           _mm512_mullo_epi32(s1[t], sco)));
          corr[t] = _mm512_dpwssd_epi32(corr[t], scp, Bcast4(act.sum16[t] + 16 * b + 2 * P));
        }
      }
      const __m512 d = LoadHalves16(meta);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const __m512i total = _mm512_sub_epi32(si[t], _mm512_slli_epi32(corr[t], 5));
        acc[t] = _mm512_fmadd_ps(
            _mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(act.d[t][b])), d, acc[t]);
      }
    }
    const int valid = ValidRows(w, g);
    for (int t = 0; t < NT; ++t) Store16(acc[t], a.y + (t0 + t) * a.ldy + g * kGroupRows, valid);
  }
};

// F16 (kBf16 = false) and BF16: [cols][16] weights, fp32 activations.
template <bool kBf16>
struct HalfTile {
  template <int NT>
  ELLM_TARGET static void Run(const KernelArgs& a, int64_t g, int t0) {
    const QuantMatrix& w = *a.w;
    const int64_t cols = w.cols();
    const uint16_t* q = reinterpret_cast<const uint16_t*>(w.group(g));
    const float* x[NT];
    __m512 acc0[NT], acc1[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      x[t] = a.x + (t0 + t) * cols;
      acc0[t] = acc1[t] = _mm512_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 2 <= cols; i += 2) {
      const __m512 w0 = kBf16 ? LoadBf16x16(q + 16 * i) : LoadHalves16(q + 16 * i);
      const __m512 w1 = kBf16 ? LoadBf16x16(q + 16 * i + 16) : LoadHalves16(q + 16 * i + 16);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        acc0[t] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[t][i]), acc0[t]);
        acc1[t] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[t][i + 1]), acc1[t]);
      }
    }
    if (i < cols) {
      const __m512 w0 = kBf16 ? LoadBf16x16(q + 16 * i) : LoadHalves16(q + 16 * i);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) acc0[t] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[t][i]), acc0[t]);
    }
    const int valid = ValidRows(w, g);
    for (int t = 0; t < NT; ++t) {
      Store16(_mm512_add_ps(acc0[t], acc1[t]), a.y + (t0 + t) * a.ldy + g * kGroupRows, valid);
    }
  }
};

// Groups [g_begin, g_end), tokens in tiles of kMaxTile (a group's weights are
// read from memory once and from cache for the later tiles), in passes of
// kTokenChunk (matmul_layout.h).
template <typename Tile>
ELLM_TARGET void RunTiles(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
  ForEachTokenPass(a.T, [&](int t_begin, int t_end) {
    for (int64_t g = g_begin; g < g_end; ++g) {
      ForEachTile<kMaxTile>(t_begin, t_end, [&](int t0, auto nt) {
        Tile::template Run<decltype(nt)::value>(a, g, t0);
      });
    }
  });
}

// Groups in pairs (Pair::Run<NT>(a, g, t0) computes groups g and g + 1), the
// last one alone when the count is odd.
template <typename Pair, typename Single>
ELLM_TARGET void RunPairTiles(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
  const int64_t g_pairs_end = g_begin + (g_end - g_begin) / 2 * 2;
  ForEachTokenPass(a.T, [&](int t_begin, int t_end) {
    for (int64_t g = g_begin; g < g_pairs_end; g += 2) {
      ForEachTile<kMaxTile>(t_begin, t_end, [&](int t0, auto nt) {
        Pair::template Run<decltype(nt)::value>(a, g, t0);
      });
    }
  });
  if (g_pairs_end < g_end) RunTiles<Single>(a, g_pairs_end, g_end);
}

}  // namespace

MatKernel Avx512VnniKernel(DType type) {
  switch (type) {
    case DType::kF32: return F32ExactKernelAvx;
    case DType::kF16: return RunTiles<HalfTile<false>>;
    case DType::kBF16: return RunTiles<HalfTile<true>>;
    case DType::kQ8_0: return RunPairTiles<Q32Tile<false, 2>, Q32Tile<false, 1>>;
    case DType::kQ4_0: return RunPairTiles<Q32Tile<true, 2>, Q32Tile<true, 1>>;
    case DType::kQ4_K: return RunTiles<K4Tile<false>>;
    case DType::kQ5_K: return RunTiles<K4Tile<true>>;
    case DType::kQ6_K: return RunTiles<Q6Tile>;
    default: return nullptr;
  }
}

}  // namespace ellm::mlp::internal
