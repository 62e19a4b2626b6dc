// AMX matrix kernels (AMX-TILE + AMX-INT8, with the AVX-512 set for the
// float side). The "amx" kernel set is avx512 except for Q8_0 weights on
// steps of at least kTileTokens tokens (prefill), whose integer dot products
// run on the tile unit:
//
//   per group of 16 rows, tile of up to 16 tokens and block b of 32 columns,
//   C[t][r] = sum_k a[t][k] * w[k][r] with TDPBSUD: A = the tokens' int8
//   activation codes of the block (one 32-byte row per token, straight from
//   Activations::Q8), B = the group's block as stored (matmul_layout.h: 8
//   lines of [16 r][4 j] u8 = code + 128, which is TDPBSUD's B layout).
//   Then s = C - 128 * sum(codes) is the exact integer dot, and
//   y += float(s) * d_act * d_w in the same operations and order as avx512's
//   Q8_0 tile: the two sets give the same results bit for bit.
//
// Each block needs its own C (the scales change per block), so each 16 x 16
// x 32 product is followed by a tile store and 16 rows of vector conversion
// (add, convert, multiply, FMA). The tile unit multiplies block j + 1 while
// block j is stored, and the vector units convert block j - kAhead. Measured
// (Xeon family 6 model 207, 5120 x 5120, T = 256, 1 thread): the tile side
// alone 15-18 ms, the conversion alone 14 ms, both 31-47 ms against avx512's
// 33-60 ms as the VM's speed moved; on 2 threads in ellm-bench prefill no
// faster than avx512, so auto does not choose this set (matmul.h).
//
// The tile instructions are inline assembly in the one function that loads
// the tile configuration (DESIGN.md "Build facts": GCC 12 can drop a
// configuration load that intrinsics leave unconnected to the tile code).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "core/amx.h"
#include "mlp-worker/cpu/matmul_layout.h"

#define ELLM_AMX_TARGET                                                                      \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni," \
                        "f16c,fma")))
#define ELLM_INLINE inline __attribute__((always_inline))

namespace ellm::mlp::internal {
namespace {

constexpr int kTileTokens = 16;  // rows of A and C
// Blocks the tile unit runs ahead of the conversion, and the ring of score
// buffers that allows (a buffer is read kRing - kAhead blocks after its store
// issued, so no vector load waits on a tile store still in flight).
constexpr int kAhead = 2, kRing = 4;
// Tokens per pass over a thread's groups: their codes (640 KiB at 5120
// columns) stay in L2 while each group's weights serve all of them.
constexpr int kAmxTokenPass = 128;

// tmm0, tmm1: C of alternate blocks (n tokens x 16 int32); tmm2, tmm3: A
// (n x 32 codes); tmm4, tmm5: B (8 lines x 64 bytes).
AmxTileConfig MakeConfig(int n) {
  AmxTileConfig c;
  for (int i = 0; i < 2; ++i) {
    c.rows[i] = static_cast<uint8_t>(n);
    c.colsb[i] = 64;
    c.rows[2 + i] = static_cast<uint8_t>(n);
    c.colsb[2 + i] = 32;
    c.rows[4 + i] = 8;
    c.colsb[4 + i] = 64;
  }
  return c;
}

// One block's integer dots for the tile's tokens (n rows; rows past n unused).
struct alignas(64) Scores {
  int32_t v[kTileTokens][16];
};
// Per token tile and block: -128 * the tokens' code sums and their scales,
// laid out for one broadcast operand per row.
struct alignas(64) BlockScales {
  int32_t neg_sum[kTileTokens];
  float d[kTileTokens];
};

// Block b's product into C tile `slot`, and that tile's store to *out. The
// store is an output operand, so the compiler orders the vector loads of
// *out after it and the next store to *out after them; no "memory" clobber,
// which would keep the accumulators in memory. (The tile loads read codes and
// weights that nothing in these kernels writes.)
#define ELLM_AMX_COMPUTE(slot, a_ptr, a_stride, b_ptr)                          \
  __asm__ volatile("tilezero %%tmm" #slot "\n\t"                                \
                   "tileloadd (%0,%1,1), %%tmm" ELLM_AMX_A##slot "\n\t"         \
                   "tileloadd (%2,%3,1), %%tmm" ELLM_AMX_B##slot "\n\t"         \
                   "tdpbsud %%tmm" ELLM_AMX_B##slot ", %%tmm" ELLM_AMX_A##slot  \
                   ", %%tmm" #slot                                              \
                   :                                                            \
                   : "r"(a_ptr), "r"(a_stride), "r"(b_ptr), "r"(int64_t{64}))
#define ELLM_AMX_STORE(slot, out)                            \
  __asm__ volatile("tilestored %%tmm" #slot ", (%1,%2,1)"    \
                   : "=m"(*(out))                            \
                   : "r"((out)->v), "r"(int64_t{64}))
#define ELLM_AMX_A0 "2"
#define ELLM_AMX_A1 "3"
#define ELLM_AMX_B0 "4"
#define ELLM_AMX_B1 "5"

// Rows of group g for tokens [t0, t0 + n), n <= 16 (kFull: n == 16, the
// accumulators in registers); sc[b]: the tokens' block scales.
template <bool kFull>
ELLM_AMX_TARGET void Q8_0TileAmx(const KernelArgs& a, int64_t g, int t0, int n, const BlockScales* sc) {
  const AmxTileConfig cfg = MakeConfig(n);
  __asm__ volatile("" ::: "memory");
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
  const QuantMatrix& w = *a.w;
  const int64_t nb = w.cols() / 32;
  const uint8_t* quant = w.group(g);
  const uint16_t* dh = reinterpret_cast<const uint16_t*>(quant + nb * 512);
  const int8_t* codes = a.q8->codes(t0);
  const int64_t stride = a.q8->token_stride;
  Scores c[kRing];
  __m512 acc[kTileTokens];
  for (int i = 0; i < kTileTokens; ++i) acc[i] = _mm512_setzero_ps();
  const auto compute = [&](int64_t b) {
    const int8_t* ap = codes + 32 * b;
    const uint8_t* bp = quant + 512 * b;
    if ((b & 1) == 0) {
      ELLM_AMX_COMPUTE(0, ap, stride, bp);
    } else {
      ELLM_AMX_COMPUTE(1, ap, stride, bp);
    }
  };
  const auto store = [&](int64_t b) {
    Scores* out = &c[b % kRing];
    if ((b & 1) == 0) {
      ELLM_AMX_STORE(0, out);
    } else {
      ELLM_AMX_STORE(1, out);
    }
  };
  // Step j: the tile unit multiplies block j + 1 while block j's scores are
  // stored, and the vector units convert block j - kAhead.
  compute(0);
  for (int64_t j = 0; j < nb + kAhead; ++j) {
    if (j < nb) {
      if (j + 1 < nb) compute(j + 1);
      store(j);
    }
    const int64_t b = j - kAhead;
    if (b < 0) continue;
    const Scores& cb = c[b % kRing];
    const BlockScales& s = sc[b];
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dh + 16 * b)));
    const int rows = kFull ? kTileTokens : n;
#pragma GCC unroll 16
    for (int i = 0; i < rows; ++i) {
      const __m512i dot = _mm512_add_epi32(_mm512_load_si512(cb.v[i]), _mm512_set1_epi32(s.neg_sum[i]));
      const __m512 f = _mm512_cvtepi32_ps(dot);
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(f, _mm512_set1_ps(s.d[i])), dw, acc[i]);
    }
  }
  const int valid = ValidRows(w, g);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const int rows = kFull ? kTileTokens : n;
  for (int i = 0; i < rows; ++i) {
    _mm512_mask_storeu_ps(a.y + (t0 + i) * a.ldy + g * kGroupRows, mask, acc[i]);
  }
}

#undef ELLM_AMX_COMPUTE
#undef ELLM_AMX_STORE
#undef ELLM_AMX_A0
#undef ELLM_AMX_A1
#undef ELLM_AMX_B0
#undef ELLM_AMX_B1

ELLM_AMX_TARGET void Q8_0KernelAmx(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
  if (a.T < kTileTokens) {  // decode and short steps: the tile unit would idle
    Avx512VnniKernel(DType::kQ8_0)(a, g_begin, g_end);
    return;
  }
  const int64_t nb = a.w->cols() / 32;
  constexpr int kPassTiles = kAmxTokenPass / kTileTokens;
  std::vector<BlockScales> scales(static_cast<size_t>(kPassTiles * nb));
  for (int tc = 0; tc < a.T; tc += kAmxTokenPass) {
    const int t_end = std::min(a.T, tc + kAmxTokenPass);
    const int tiles = (t_end - tc + kTileTokens - 1) / kTileTokens;
    for (int k = 0; k < tiles; ++k) {
      const int t0 = tc + k * kTileTokens, n = std::min(kTileTokens, t_end - t0);
      for (int64_t b = 0; b < nb; ++b) {
        BlockScales& s = scales[k * nb + b];
        for (int i = 0; i < kTileTokens; ++i) {
          s.neg_sum[i] = i < n ? -128 * a.q8->sum[(t0 + i) * nb + b] : 0;
          s.d[i] = i < n ? a.q8->d[(t0 + i) * nb + b] : 0.0f;
        }
      }
    }
    for (int64_t g = g_begin; g < g_end; ++g) {
      for (int k = 0; k < tiles; ++k) {
        const int t0 = tc + k * kTileTokens, n = std::min(kTileTokens, t_end - t0);
        if (n == kTileTokens) {
          Q8_0TileAmx<true>(a, g, t0, n, &scales[k * nb]);
        } else {
          Q8_0TileAmx<false>(a, g, t0, n, &scales[k * nb]);
        }
      }
    }
  }
  __asm__ volatile("tilerelease" ::: "memory");
}

}  // namespace

MatKernel AmxKernel(DType type) {
  if (type == DType::kQ8_0) return Q8_0KernelAmx;
  return Avx512VnniKernel(type);
}

}  // namespace ellm::mlp::internal
