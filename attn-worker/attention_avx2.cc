// AVX2 attention kernels (AVX2 + FMA + F16C; 8 lanes, so a tile of 16
// positions is two vectors): f16 and int8 KV. The same structure as
// attention_avx512.cc; see there. int8 takes tiles in pairs as avx512 does;
// f16 takes one tile at a time.
//
// This file is compiled twice: as is (kernel "avx2": int8 products with
// VPMADDUBSW + VPMADDWD, whose saturating int16 pair sums limit query codes
// to ±63 and weight codes to 0..127), and from attention_avx2_vnni.cc with
// ELLM_AVX2_VNNI=1 (kernel "avx2-vnni": VEX VPDPBUSD, full 8-bit codes). Every
// function carries its target attribute; the f16 kernel is only built once.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "attn-worker/attention_kernels.h"

#ifndef ELLM_AVX2_VNNI
#define ELLM_AVX2_VNNI 0
#endif

#if ELLM_AVX2_VNNI
#define ELLM_TARGET __attribute__((target("avx2,fma,f16c,avxvnni,bmi,bmi2")))
#define ELLM_AVX2_NS avx2_vnni
#else
#define ELLM_TARGET __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#define ELLM_AVX2_NS avx2_plain
#endif
#define ELLM_INLINE inline __attribute__((always_inline))

namespace ellm::attn::internal {
namespace ELLM_AVX2_NS {
namespace {

constexpr int kBlock = 8;                            // query heads per register block
constexpr int kWeightMax = ELLM_AVX2_VNNI ? 255 : 127;  // int8 weight codes

struct HeadScratch {
  float dvec[16];  // lanes of d
  float bvec[16];  // int8: lanes of sum p_t * bias_t
  float w[16];     // f16: the tile's 16 weights p; int8: the T tiles' 16 T u8 weight codes
  float pad[16];
};
static_assert(sizeof(HeadScratch) == kHeadScratchFloats * sizeof(float));

struct TileCtx {
  const uint8_t* k;
  const uint8_t* v;
  int hp;
  int nvalid;
  __m256 valid[2];  // lane masks of positions 0-7, 8-15
  __m256 kscale[2], kmin[2], vscale[2], vbias[2];
  const char* pk;  // a later tile's K and V to prefetch (nullptr: none)
  const char* pv;
};

// Software prefetch, as in attention_avx512.cc: the tile StartChunk's
// prefetch_tiles ahead, its K lines one per step of the score loop and its V
// lines spread over p·V (measured, --kernel=avx2-vnni, 16K positions, 2
// threads: int8 0.56-0.79 -> 0.60-0.88 of the read probe, f16 0.45-0.70 ->
// 0.47-0.75, against all lines from the score loop).

ELLM_TARGET ELLM_INLINE void PrefetchK(const TileCtx& t, int i) {
  if (t.pk != nullptr) _mm_prefetch(t.pk + 64 * i, _MM_HINT_T0);
}
ELLM_TARGET ELLM_INLINE void PrefetchV(const TileCtx& t, int i) {
  if (t.pv != nullptr) _mm_prefetch(t.pv + 64 * i, _MM_HINT_T0);
}

struct HeadsCtx {
  const int8_t* codes;
  const float* scaled;
  const float* code_scale;
  const int32_t* code_sum;
  float* part;
  int pf;
  HeadScratch* hs;
};

ELLM_TARGET ELLM_INLINE int32_t Load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

ELLM_TARGET ELLM_INLINE __m256 LoadHalves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The maximum of x's lanes, in every lane (no trip through a scalar register).
ELLM_TARGET ELLM_INLINE __m256 AllMax(__m256 x) {
  x = _mm256_max_ps(x, _mm256_permute2f128_ps(x, x, 0x01));
  x = _mm256_max_ps(x, _mm256_permute_ps(x, 0x4E));
  return _mm256_max_ps(x, _mm256_permute_ps(x, 0xB1));
}

ELLM_TARGET ELLM_INLINE float HMax(__m256 x) { return _mm256_cvtss_f32(AllMax(x)); }

ELLM_TARGET ELLM_INLINE float HSum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// u8 x s8 products, 4 per int32 lane, added to acc.
ELLM_TARGET ELLM_INLINE __m256i Dpbusd(__m256i acc, __m256i a_u8, __m256i b_s8) {
#if ELLM_AVX2_VNNI
  return _mm256_dpbusd_avx_epi32(acc, a_u8, b_s8);
#else
  const __m256i pairs = _mm256_maddubs_epi16(a_u8, b_s8);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// How far the running reference score may trail the maximum (base 2).
constexpr float kMaxSlack = 8.0f;

// 2^x for x <= kMaxSlack: x = n + f with n the nearest integer (by adding
// and subtracting 1.5 x 2^23, which leaves n in the low mantissa bits of the
// sum) and f in [-1/2, 1/2]; 2^f by a degree-4 polynomial (minimax for the
// relative error on [-1/2, 1/2]: 2.6e-6, far below the 8-bit weight codes'
// steps), and 2^n added straight into its exponent field. Lanes below -100
// are clamped there, so results stay normal floats. 10 vector operations:
// at head dim 64 the per-score work (this, the scores, the weight codes) is
// about 45% of the int8 kernel's time (perf, qwen2.5-0.5b, avx2-vnni), and
// 14 here (VROUNDPS, a degree-6 polynomial, a multiply by a built 2^n) made
// that shape 5-7% slower from cache.
ELLM_TARGET ELLM_INLINE __m256 Exp2(__m256 x) {
  const __m256 magic = _mm256_set1_ps(12582912.0f);  // 1.5 x 2^23
  x = _mm256_max_ps(x, _mm256_set1_ps(-100.0f));
  const __m256 t = _mm256_add_ps(x, magic);
  const __m256 f = _mm256_sub_ps(x, _mm256_sub_ps(t, magic));
  __m256 p = _mm256_set1_ps(9.570102207e-03f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.591785908e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402474433e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931217909e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.999992847e-01f));
  // t's bits are those of 1.5 x 2^23 plus n: shifted by 23, only n << 23 is left.
  const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(t), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

// Online-softmax step over V vectors of 8 scores s[V] (one tile: V = 2, a
// pair of tiles: V = 4; invalid lanes -inf); writes the weights to p[V] (0
// in invalid lanes) and adds them to d's 16 lanes. The reference score m
// trails the running maximum by up to kMaxSlack and moves only when a score
// passes it by more (as in attention_avx512.cc). kFull: every lane is valid
// (no masking).
template <int V, bool kFull = false>
ELLM_TARGET ELLM_INLINE void SoftmaxStep(const __m256* s, const __m256* valid, float* part, int hp,
                                         HeadScratch* h, bool int8, __m256* p) {
  float& m = part[hp];
  const __m256 m_raise = _mm256_set1_ps(m + kMaxSlack);
  __m256 over_lanes = _mm256_cmp_ps(s[0], m_raise, _CMP_GT_OQ);
  for (int x = 1; x < V; ++x) over_lanes = _mm256_or_ps(over_lanes, _mm256_cmp_ps(s[x], m_raise, _CMP_GT_OQ));
  if (_mm256_movemask_ps(over_lanes) != 0) {  // rare once a sequence's leading scores have been seen
    __m256 top = s[0];
    for (int x = 1; x < V; ++x) top = _mm256_max_ps(top, s[x]);
    const float tmax = HMax(top);
    if (m != -INFINITY) {
      const __m256 alpha = Exp2(_mm256_set1_ps(m - tmax));
      for (int i = 0; i < hp; i += 8) {
        _mm256_storeu_ps(part + i, _mm256_mul_ps(_mm256_loadu_ps(part + i), alpha));
      }
      for (int i = 0; i < 16; i += 8) {
        _mm256_storeu_ps(h->dvec + i, _mm256_mul_ps(_mm256_loadu_ps(h->dvec + i), alpha));
        if (int8) _mm256_storeu_ps(h->bvec + i, _mm256_mul_ps(_mm256_loadu_ps(h->bvec + i), alpha));
      }
    }
    m = tmax;
  }
  const __m256 mv = _mm256_set1_ps(m);
  __m256 d[2] = {_mm256_loadu_ps(h->dvec), _mm256_loadu_ps(h->dvec + 8)};
  for (int x = 0; x < V; ++x) {
    p[x] = Exp2(_mm256_sub_ps(s[x], mv));
    if constexpr (!kFull) p[x] = _mm256_and_ps(valid[x], p[x]);
    d[x % 2] = _mm256_add_ps(d[x % 2], p[x]);
  }
  _mm256_storeu_ps(h->dvec, d[0]);
  _mm256_storeu_ps(h->dvec + 8, d[1]);
}

// The int8 products of a tile go in passes over a few heads at a time, each
// pass covering both halves of the tile (positions 0-7 and 8-15): 2N
// independent accumulators hide VPDPBUSD's latency (with N = 5 heads and one
// half at a time, 5 chains left the avx2-vnni kernel at 0.44 of the read
// probe), and one broadcast of a query or weight code serves both halves.
// kPassHeads bounds N so that accumulators, operands and (for the
// VPMADDUBSW pair) its temporaries fit the 16 ymm registers.
constexpr int kPassHeads = ELLM_AVX2_VNNI ? 6 : 5;

// A pass of N < 4 heads has too few chains (2N) for the latency of VPDPBUSD
// or FMA: it splits each sum in S, the s-th taking every S-th step of the
// loop (dims of q·K, positions of p·V), for 2N S <= 12 chains, as many as
// the registers hold besides the operands. (VPMADDUBSW's chain is a 1-cycle
// add: the plain avx2 int8 passes need no split.) avx2-vnni from cache
// (`--positions=1K --threads=1 --footprint-mb=8`, shapes NAME:Q/KV/128):
// G = 1 36-38 -> 42 GB/s, G = 3 22-24 -> 25; qwen2.5-0.5b (4 + 3 heads) did
// not move: its cost is the per-score work (softmax, weight codes), with
// head dim 64 as large as the dot products.
constexpr int ChainSplit(int n) { return n >= 4 ? 1 : n == 3 ? 2 : n == 2 ? 3 : 4; }
constexpr int Int8Split(int n) { return ELLM_AVX2_VNNI ? ChainSplit(n) : 1; }

// Heads of the first pass when a group needs two: half of them (int8; with
// VNNI, G = 7 as 5 + 2 or G = 8 as 5 + 3 were no faster). f16 takes 5 first
// (see F16Tile).
template <int G>
constexpr int kFirstPass = G <= kPassHeads ? G : (G + 1) / 2;

// Scores of heads [J0, J0 + N): acc[x][j] for the 8 positions of half x.
// The sums run in locals and are written out once at the end: summed in
// acc itself, GCC stored every accumulator to memory at every step.
template <int G, int J0, int N>
ELLM_TARGET ELLM_INLINE void Int8ScoresPass(const TileCtx& t, const HeadsCtx& q, __m256i (*acc)[G]) {
  constexpr int S = Int8Split(N);
  const int n_dq = t.hp / 4;
  __m256i sum[S][2][N];
  for (int s = 0; s < S; ++s) {
    for (int x = 0; x < 2; ++x) {
      for (int j = 0; j < N; ++j) sum[s][x][j] = _mm256_setzero_si256();
    }
  }
  const auto step = [&](int dq, int s) ELLM_TARGET __attribute__((always_inline)) {
    if constexpr (J0 == 0) PrefetchK(t, dq);
    const __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.k + 64 * dq));
    const __m256i k1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.k + 64 * dq + 32));
    for (int j = 0; j < N; ++j) {
      const __m256i c = _mm256_set1_epi32(Load32(q.codes + (J0 + j) * t.hp + 4 * dq));
      sum[s][0][j] = Dpbusd(sum[s][0][j], k0, c);
      sum[s][1][j] = Dpbusd(sum[s][1][j], k1, c);
    }
  };
  int dq = 0;
  for (; dq + S <= n_dq; dq += S) {
    for (int s = 0; s < S; ++s) step(dq + s, s);
  }
  for (; dq < n_dq; ++dq) step(dq, 0);
  for (int x = 0; x < 2; ++x) {
    for (int j = 0; j < N; ++j) {
      __m256i a = sum[0][x][j];
      for (int s = 1; s < S; ++s) a = _mm256_add_epi32(a, sum[s][x][j]);
      acc[x][J0 + j] = a;
    }
  }
}

// p·V of heads [J0, J0 + N) for dims [16 dg, 16 dg + 16) over the T tiles'
// 16 T positions, added to the partial outputs with each head's weight
// scale (int32 sums: at most 16 T x 255 x 128).
// The quad loop is unrolled and each sum is pinned to a register after its
// step (the empty asm): rolled, GCC 12 kept 6 of the 10 sums of a 5-head
// pass on the stack (a load, add and store per step each); unrolled alone,
// it reassociated them across steps and still spilled. Plain avx2 forced on
// Xeon family 6 model 207, alternated runs: from cache (`ellm-bench
// attention --kernel avx2 --positions 1K --threads 1 --footprint-mb 8`,
// medians of 6) qwen2.5-14b 11.2 -> 11.5 GB/s, llama-3-8b 13.2 -> 14.2,
// qwen2.5-0.5b 6.9 -> 7.5; from DRAM (16K, 2 threads, 3 rounds) 0.65-0.71
// -> 0.75-0.77, 0.72-0.79 -> 0.77-0.84, 0.47-0.50 -> 0.51-0.53 of the read
// probe; the 4096-token prefill's attention 3.16-3.40 -> 3.01-3.12 s.
// avx2-vnni did not move.
template <int J0, int N, int T>
ELLM_TARGET ELLM_INLINE void Int8ValuesPass(const TileCtx* t, const HeadsCtx& q, int dg, const float* wscale) {
  constexpr int S = Int8Split(N);
  __m256i va[S][2][N];
  for (int s = 0; s < S; ++s) {
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < N; ++j) va[s][h][j] = _mm256_setzero_si256();
    }
  }
  const auto step = [&](int quad, int s) ELLM_TARGET __attribute__((always_inline)) {
    const TileCtx& tx = t[quad / 4];
    if constexpr (J0 == 0) PrefetchV(tx, 4 * dg + quad % 4);
    const uint8_t* line = tx.v + 64 * (4 * dg + quad % 4);
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32));
    for (int j = 0; j < N; ++j) {
      const __m256i w = _mm256_set1_epi32(Load32(reinterpret_cast<const uint8_t*>(q.hs[J0 + j].w) + 4 * quad));
      va[s][0][j] = Dpbusd(va[s][0][j], w, v0);
      va[s][1][j] = Dpbusd(va[s][1][j], w, v1);
      __asm__("" : "+x"(va[s][0][j]), "+x"(va[s][1][j]));  // in registers, in this order
    }
  };
  constexpr int kQuads = 4 * T;
  constexpr int kWhole = kQuads - kQuads % S;
#pragma GCC unroll 16
  for (int quad = 0; quad < kWhole; quad += S) {  // 4 T quads: 8 at most
    for (int s = 0; s < S; ++s) step(quad + s, s);
  }
  for (int quad = kWhole; quad < kQuads; ++quad) step(quad, 0);
  for (int j = 0; j < N; ++j) {
    for (int h = 0; h < 2; ++h) {
      for (int s = 1; s < S; ++s) va[0][h][j] = _mm256_add_epi32(va[0][h][j], va[s][h][j]);
    }
  }
  // In locals: each store to o could otherwise alias q's fields.
  float* const part = q.part;
  const int pf = q.pf;
  for (int j = 0; j < N; ++j) {
    float* o = part + (J0 + j) * pf + 16 * dg;
    const __m256 scale = _mm256_set1_ps(wscale[J0 + j]);
    for (int h = 0; h < 2; ++h) {
      _mm256_storeu_ps(o + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(va[0][h][j]), scale, _mm256_loadu_ps(o + 8 * h)));
    }
  }
}

// T = 1 or 2 consecutive int8 tiles for G query heads of one token. A pair
// shares what it can, as in attention_avx512.cc: one softmax step, one weight
// scale per head (the maximum over 32 positions) and one int32 p·V sum
// before the float update of o, so those fixed costs are paid once per 32
// positions. The scores go tile by tile (a pair's 4 vectors of scores per
// head would leave too few registers for enough heads per pass). kFull:
// the token sees all 16 T positions, so no lane needs masking.
template <int G, int T, bool kFull>
ELLM_TARGET void Int8Tiles(const TileCtx* t, const HeadsCtx& q) {
  constexpr int kFirst = kFirstPass<G>;
  const int hp = t[0].hp;
  __m256i acc[T][2][G];
  for (int x = 0; x < T; ++x) {
    Int8ScoresPass<G, 0, kFirst>(t[x], q, acc[x]);
    if constexpr (kFirst < G) Int8ScoresPass<G, kFirst, G - kFirst>(t[x], q, acc[x]);
    PrefetchK(t[x], hp / 4);  // the tile's last line (scales come first)
    PrefetchV(t[x], hp / 4);
  }
  float wscale[G];
  for (int j = 0; j < G; ++j) {
    const __m256 qsum = _mm256_set1_ps(static_cast<float>(q.code_sum[j]));
    const __m256 qscale = _mm256_set1_ps(q.code_scale[j]);
    __m256 s[2 * T], p[2 * T], w[2 * T], valid[2 * T];
    for (int x = 0; x < T; ++x) {
      for (int h = 0; h < 2; ++h) {
        __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[x][h][j]), t[x].kscale[h],
                                   _mm256_mul_ps(t[x].kmin[h], qsum));
        v = _mm256_mul_ps(v, qscale);
        s[2 * x + h] = kFull ? v : _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, t[x].valid[h]);
        valid[2 * x + h] = t[x].valid[h];
      }
    }
    HeadScratch* h = q.hs + j;
    SoftmaxStep<2 * T, kFull>(s, valid, q.part + j * q.pf, hp, h, true, p);
    __m256 b[2] = {_mm256_loadu_ps(h->bvec), _mm256_loadu_ps(h->bvec + 8)};
    __m256 top = _mm256_setzero_ps();
    for (int x = 0; x < 2 * T; ++x) {
      const TileCtx& tx = t[x / 2];
      if constexpr (kFull) {
        b[x % 2] = _mm256_fmadd_ps(p[x], tx.vbias[x % 2], b[x % 2]);
        w[x] = _mm256_mul_ps(p[x], tx.vscale[x % 2]);
      } else {  // masked: V rows past the token's last position may hold anything
        b[x % 2] = _mm256_add_ps(b[x % 2], _mm256_and_ps(valid[x], _mm256_mul_ps(p[x], tx.vbias[x % 2])));
        w[x] = _mm256_and_ps(valid[x], _mm256_mul_ps(p[x], tx.vscale[x % 2]));
      }
      top = _mm256_max_ps(top, w[x]);
    }
    _mm256_storeu_ps(h->bvec, b[0]);
    _mm256_storeu_ps(h->bvec + 8, b[1]);
    // inv = kWeightMax / wmax where wmax > 0, else 0: in vectors, so the
    // heads' chains do not each wait on a scalar compare and division.
    const __m256 wmax = AllMax(top);
    const __m256 inv = _mm256_and_ps(_mm256_cmp_ps(wmax, _mm256_setzero_ps(), _CMP_GT_OQ),
                                     _mm256_div_ps(_mm256_set1_ps(kWeightMax), wmax));
    // The 16 T codes as bytes in position order: the two packs leave
    // positions [8 i + 4 k, +4) (vector i < 2 T, 128-bit lane k) at dword
    // 4 k + i, which VPERMD puts in order.
    __m256i c[4];
    for (int x = 0; x < 2 * T; ++x) c[x] = _mm256_cvtps_epi32(_mm256_mul_ps(w[x], inv));
    const __m256i c16a = _mm256_packus_epi32(c[0], c[1]);
    const __m256i c16b = T == 2 ? _mm256_packus_epi32(c[2], c[3]) : c16a;
    const __m256i c8 = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(c16a, c16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if constexpr (T == 2) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h->w), c8);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h->w), _mm256_castsi256_si128(c8));
    }
    wscale[j] = _mm256_cvtss_f32(wmax) * (1.0f / kWeightMax);
  }
  for (int dg = 0; dg < hp / 16; ++dg) {
    Int8ValuesPass<0, kFirst, T>(t, q, dg, wscale);
    if constexpr (kFirst < G) Int8ValuesPass<kFirst, G - kFirst, T>(t, q, dg, wscale);
  }
}

#if !ELLM_AVX2_VNNI
// f16 goes in passes over heads as int8 does, with ChainSplit: a pass of N
// heads keeps 2N S FMA chains, and 5 heads go first where a group needs two
// passes. G = 7 (qwen2.5-0.5b and -7b) went from passes of 4 + 3 heads with
// S = 1 (8 + 6 chains) to 5 + 2 with S = 3 (10 + 12): `ellm-bench attention
// --dtypes=f16 --kernel=avx2 --positions=16K --threads=all` on Zen 5,
// 19.5-19.9 -> 21.4-22.3 GB/s (0.68-0.70 -> 0.74-0.79 of the FMA roof); the
// shapes of 4 and 5 heads did not move. From cache (`--positions=1K
// --threads=1 --footprint-mb=8`), G = 8 (5 + 3): 9.0-9.4 -> 10.5-10.8 GB/s.

// q·K of heads [J0, J0 + N): acc[x][j] for the 8 positions of half x, summed
// in locals (see Int8ScoresPass). The loop takes U dims a step (S, or 2 with
// S = 1 so that each step starts a K line and prefetches it without a test).
template <int G, int J0, int N>
ELLM_TARGET ELLM_INLINE void F16ScoresPass(const TileCtx& t, const HeadsCtx& q, __m256 (*acc)[G]) {
  constexpr int S = ChainSplit(N), U = S == 1 ? 2 : S;
  const int hp = t.hp;
  __m256 sum[S][2][N];
  for (int s = 0; s < S; ++s) {
    for (int x = 0; x < 2; ++x) {
      for (int j = 0; j < N; ++j) sum[s][x][j] = _mm256_setzero_ps();
    }
  }
  const auto dim = [&](int d, int s) ELLM_TARGET __attribute__((always_inline)) {
    // hp / 2 K lines per tile, one per even dim (V's go with p·V).
    if constexpr (J0 == 0 && U % 2 != 0) {
      if (d % 2 == 0) PrefetchK(t, d / 2);
    }
    const __m256 k0 = LoadHalves(t.k + 32 * d), k1 = LoadHalves(t.k + 32 * d + 16);
    for (int j = 0; j < N; ++j) {
      const __m256 c = _mm256_set1_ps(q.scaled[(J0 + j) * hp + d]);
      sum[s][0][j] = _mm256_fmadd_ps(k0, c, sum[s][0][j]);
      sum[s][1][j] = _mm256_fmadd_ps(k1, c, sum[s][1][j]);
    }
  };
  int d = 0;
  for (; d + U <= hp; d += U) {
    if constexpr (J0 == 0 && U % 2 == 0) {
      for (int l = 0; l < U / 2; ++l) PrefetchK(t, d / 2 + l);
    }
    for (int u = 0; u < U; ++u) dim(d + u, u % S);
  }
  for (; d < hp; ++d) dim(d, 0);  // hp % 3 dims with S = 3
  for (int x = 0; x < 2; ++x) {
    for (int j = 0; j < N; ++j) {
      __m256 a = sum[0][x][j];
      for (int s = 1; s < S; ++s) a = _mm256_add_ps(a, sum[s][x][j]);
      acc[x][J0 + j] = a;
    }
  }
}

// p·V of heads [J0, J0 + N) for dims [16 dg, 16 dg + 16), as two blocks of
// 8 dims: each weight broadcast serves both.
template <int J0, int N>
ELLM_TARGET ELLM_INLINE void F16ValuesPass(const TileCtx& t, const HeadsCtx& q, int dg) {
  constexpr int S = ChainSplit(N);
  const int hp = t.hp;
  __m256 va[S][2][N];
  for (int s = 0; s < S; ++s) {
    for (int b = 0; b < 2; ++b) {
      for (int j = 0; j < N; ++j) va[s][b][j] = _mm256_setzero_ps();
    }
  }
  if constexpr (J0 == 0) {
    for (int l = 8 * dg; l < 8 * dg + 8; ++l) PrefetchV(t, l);  // hp / 2 lines over hp / 16 groups
  }
  const uint8_t* vcol = t.v + 32 * dg;
  const auto row = [&](int r, int s) ELLM_TARGET __attribute__((always_inline)) {
    const __m256 v0 = LoadHalves(vcol + 2 * r * hp), v1 = LoadHalves(vcol + 2 * r * hp + 16);
    for (int j = 0; j < N; ++j) {
      const __m256 w = _mm256_set1_ps(q.hs[J0 + j].w[r]);
      va[s][0][j] = _mm256_fmadd_ps(v0, w, va[s][0][j]);
      va[s][1][j] = _mm256_fmadd_ps(v1, w, va[s][1][j]);
    }
  };
  int r = 0;
  for (; r + S <= t.nvalid; r += S) {
    for (int s = 0; s < S; ++s) row(r + s, s);
  }
  for (; r < t.nvalid; ++r) row(r, 0);
  for (int j = 0; j < N; ++j) {
    float* o = q.part + (J0 + j) * q.pf + 16 * dg;
    for (int b = 0; b < 2; ++b) {
      __m256 a = va[0][b][j];
      for (int s = 1; s < S; ++s) a = _mm256_add_ps(a, va[s][b][j]);
      _mm256_storeu_ps(o + 8 * b, _mm256_add_ps(_mm256_loadu_ps(o + 8 * b), a));
    }
  }
}

template <int G>
ELLM_TARGET void F16Tile(const TileCtx& t, const HeadsCtx& q) {
  constexpr int kFirst = G <= 6 ? G : 5;
  const int hp = t.hp;
  __m256 acc[2][G];
  F16ScoresPass<G, 0, kFirst>(t, q, acc);
  if constexpr (kFirst < G) F16ScoresPass<G, kFirst, G - kFirst>(t, q, acc);
  for (int j = 0; j < G; ++j) {
    __m256 s[2], p[2];
    for (int x = 0; x < 2; ++x) s[x] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), acc[x][j], t.valid[x]);
    HeadScratch* h = q.hs + j;
    SoftmaxStep<2>(s, t.valid, q.part + j * q.pf, hp, h, false, p);
    _mm256_storeu_ps(h->w, p[0]);
    _mm256_storeu_ps(h->w + 8, p[1]);
  }
  for (int dg = 0; dg < hp / 16; ++dg) {
    F16ValuesPass<0, kFirst>(t, q, dg);
    if constexpr (kFirst < G) F16ValuesPass<kFirst, G - kFirst>(t, q, dg);
  }
}
#endif

// T tiles (2: a pair; f16 always takes one) for G query heads; kFull: see
// Int8Tiles.
template <bool kInt8, int G, int T, bool kFull>
ELLM_TARGET ELLM_INLINE void RunTiles(const TileCtx* t, const HeadsCtx& q) {
  if constexpr (kInt8) {
    Int8Tiles<G, T, kFull>(t, q);
  } else {
#if !ELLM_AVX2_VNNI
    static_assert(T == 1);
    F16Tile<G>(t[0], q);
#endif
  }
}

template <bool kInt8, int T, bool kFull = false>
ELLM_TARGET void TilesForHeads(int g, const TileCtx* t, const HeadsCtx& q) {
  switch (g) {
    case 1: RunTiles<kInt8, 1, T, kFull>(t, q); break;
    case 2: RunTiles<kInt8, 2, T, kFull>(t, q); break;
    case 3: RunTiles<kInt8, 3, T, kFull>(t, q); break;
    case 4: RunTiles<kInt8, 4, T, kFull>(t, q); break;
    case 5: RunTiles<kInt8, 5, T, kFull>(t, q); break;
    case 6: RunTiles<kInt8, 6, T, kFull>(t, q); break;
    case 7: RunTiles<kInt8, 7, T, kFull>(t, q); break;
    default: RunTiles<kInt8, 8, T, kFull>(t, q); break;
  }
}

template <bool kInt8>
ELLM_TARGET void AttendChunk(const ChunkArgs& a) {
  const int hp = a.kv.format.padded_dim, pf = PartialFloats(hp);
  const QueryPrep& prep = *a.q;
  HeadScratch* scratch = reinterpret_cast<HeadScratch*>(a.scratch);
  const ChunkStart c = StartChunk(a);
  const int end = c.end, prefetch_end = c.prefetch_end, dist = c.prefetch_tiles;
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  TileCtx t[2];
  for (int pos = a.pos_begin; pos < end;) {
    // int8: tiles in pairs while two are left (see Int8Tiles).
    const int tiles = kInt8 && pos + kTile < end ? 2 : 1;
    for (int x = 0; x < tiles; ++x) {
      TileCtx& tx = t[x];
      const int p = pos + x * kTile;
      tx.hp = hp;
      tx.k = a.kv.KeyTile(p);
      tx.v = tx.k + a.kv.value_offset;
      // As far ahead in steps as one tile is with single tiles.
      const int ahead = p + tiles * dist * kTile;
      tx.pk = tx.pv = nullptr;
      if (ahead < prefetch_end) {
        tx.pk = reinterpret_cast<const char*>(a.kv.KeyTile(ahead));
        tx.pv = tx.pk + a.kv.value_offset;
      }
      if constexpr (kInt8) {
        for (int h = 0; h < 2; ++h) {
          tx.kscale[h] = LoadHalves(tx.k + 16 * h);
          tx.kmin[h] = LoadHalves(tx.k + 32 + 16 * h);
          tx.vscale[h] = LoadHalves(tx.v + 16 * h);
          tx.vbias[h] = _mm256_fmadd_ps(tx.vscale[h], _mm256_set1_ps(128.0f), LoadHalves(tx.v + 32 + 16 * h));
        }
        tx.k += 64;  // codes after the scale and min line
        tx.v += 64;
      }
    }
    for (int i = 0; i < a.n_tokens; ++i) {
      const int seen = std::min(a.pos_end, a.last_pos[i] + 1) - pos;
      if (seen <= 0) continue;
      // A token that sees only the first tile of a pair takes it alone.
      const int mine = seen > kTile ? tiles : 1;
      for (int x = 0; x < mine; ++x) {
        t[x].nvalid = std::min(seen - x * kTile, kTile);
        for (int h = 0; h < 2; ++h) {
          t[x].valid[h] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(t[x].nvalid - 8 * h), iota));
        }
      }
      for (int j0 = 0; j0 < a.group; j0 += kBlock) {
        const int row = a.q_row0 + i * a.q_token_stride + j0;
        HeadsCtx q;
        // Only the form this dtype prepared (QueryFormFor) exists.
        q.codes = kInt8 ? prep.codes.data() + static_cast<size_t>(row) * hp : nullptr;
        q.scaled = kInt8 ? nullptr : prep.scaled.data() + static_cast<size_t>(row) * hp;
        q.code_scale = kInt8 ? prep.code_scale.data() + row : nullptr;
        q.code_sum = kInt8 ? prep.code_sum.data() + row : nullptr;
        q.part = a.partials + static_cast<size_t>(i * a.group + j0) * pf;
        q.pf = pf;
        q.hs = scratch + i * a.group + j0;
        const int g = std::min(kBlock, a.group - j0);
        if constexpr (!kInt8) {
          TilesForHeads<false, 1>(g, t, q);
        } else if (mine == 1) {
          TilesForHeads<true, 1>(g, t, q);
        } else if (t[1].nvalid == kTile) {
          TilesForHeads<true, 2, true>(g, t, q);
        } else {
          TilesForHeads<true, 2>(g, t, q);
        }
      }
      // The later tiles this token prefetched are on their way: the
      // chunk's other tokens need not ask again.
      for (int x = 0; x < mine; ++x) t[x].pk = t[x].pv = nullptr;
    }
    pos += tiles * kTile;
  }
  for (int i = 0; i < a.n_tokens; ++i) {
    for (int j = 0; j < a.group; ++j) {
      const Partial part(a.partials + static_cast<size_t>(i * a.group + j) * pf, hp);
      const HeadScratch& h = scratch[i * a.group + j];
      part.d() = HSum(_mm256_add_ps(_mm256_loadu_ps(h.dvec), _mm256_loadu_ps(h.dvec + 8)));
      if constexpr (kInt8) {
        const __m256 b =
            _mm256_set1_ps(HSum(_mm256_add_ps(_mm256_loadu_ps(h.bvec), _mm256_loadu_ps(h.bvec + 8))));
        for (int d = 0; d < hp; d += 8) {
          _mm256_storeu_ps(part.o() + d, _mm256_add_ps(_mm256_loadu_ps(part.o() + d), b));
        }
      }
    }
  }
}

}  // namespace
}  // namespace ELLM_AVX2_NS

#if !ELLM_AVX2_VNNI
ELLM_TARGET float QuantizeQueryAvx2(const float* x, int head_dim, int hp, int q_max, int8_t* codes,
                                    int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 top = _mm256_setzero_ps();
  int d = 0;
  for (; d + 8 <= head_dim; d += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + d)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float amax = 0;
  for (float l : lanes) amax = std::max(amax, l);
  for (; d < head_dim; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float sq = amax / static_cast<float>(q_max);
  const float inv = sq > 0 ? 1.0f / sq : 0.0f;
  // Round half away from zero (truncate v + copysign(0.5, v)), then clamp.
  const __m256 vinv = _mm256_set1_ps(inv), half = _mm256_set1_ps(0.5f);
  const __m256i hi = _mm256_set1_epi32(q_max), lo = _mm256_set1_epi32(-q_max);
  __m256i total = _mm256_setzero_si256();
  d = 0;
  for (; d + 8 <= head_dim; d += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + d), vinv);
    const __m256 rounded = _mm256_add_ps(v, _mm256_or_ps(half, _mm256_and_ps(sign, v)));
    const __m256i c = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvttps_epi32(rounded)));
    total = _mm256_add_epi32(total, c);
    // 8 int32 -> 8 int8 (within ±127: the packs do not saturate).
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + d), _mm_packs_epi16(w, w));
  }
  alignas(32) int32_t parts[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(parts), total);
  int32_t s = 0;
  for (int32_t p : parts) s += p;
  for (; d < head_dim; ++d) {
    const float v = x[d] * inv;
    const int c = std::clamp(static_cast<int>(v + (v >= 0 ? 0.5f : -0.5f)), -q_max, q_max);
    codes[d] = static_cast<int8_t>(c);
    s += c;
  }
  std::fill(codes + head_dim, codes + hp, int8_t{0});
  *sum = s;
  return sq;
}
#endif

#if ELLM_AVX2_VNNI
void AttendInt8Avx2Vnni(const ChunkArgs& args) { avx2_vnni::AttendChunk<true>(args); }
#else
void AttendF16Avx2(const ChunkArgs& args) { avx2_plain::AttendChunk<false>(args); }
void AttendInt8Avx2(const ChunkArgs& args) { avx2_plain::AttendChunk<true>(args); }
#endif

}  // namespace ellm::attn::internal
