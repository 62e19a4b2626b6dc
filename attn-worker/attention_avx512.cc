// AVX-512 attention kernels (F, BW, VL, DQ, VNNI + F16C): f16 and int8 KV.
// Every function here carries the target attribute; nothing else in the
// program is compiled for AVX-512, and the dispatcher only calls in here when
// the CPU reports all of these features.
//
// Shape of the work, per tile of 16 positions (one 16-lane vector of scores
// per query head, no horizontal reduction for the scores):
//   int8  scores: hp/4 K lines of 64 bytes, each multiplied by the G query
//                 heads' 4-byte code groups (embedded broadcast) with
//                 VPDPBUSD; p·V: hp/16 x 4 V lines, each multiplied by the
//                 G heads' 4 weight codes with VPDPBUSD.
//   f16   scores: hp K lines of 32 bytes -> VCVTPH2PS -> G FMAs with a
//                 broadcast query element; p·V: 16 rows x hp/16 vectors ->
//                 VCVTPH2PS -> G FMAs with a broadcast weight.
// Query heads are taken in register blocks of up to 8 (G, a template
// parameter), so each K and V line is loaded once per block from the cache
// line the tile occupies. Tiles are taken in pairs (Int8Tiles / F16Tiles
// with T = 2; the last tile of a chunk alone when the count is odd): each
// broadcast query element serves both tiles' K lines, and the softmax step,
// (int8) the weight scale and the float update of o are paid once per 32
// positions.
//
// Prefetching (see kPrefetchBytes) is spread over a pair's work: the first
// later tile from the score loop, the second from p·V. Measured on 2
// Sapphire Rapids cores (ellm-bench attention, 16K positions, int8,
// qwen2.5-14b shape): single tiles 0.86 of the read probe, pairs with all
// prefetches in the score loop 0.71-0.81, pairs spread 0.91.

// GCC 12 warns about the deliberately undefined pass-through operand of the
// AVX-512 intrinsics (_mm512_undefined_*, e.g. in _mm512_reduce_max_ps): a
// known false positive. (Clang has no -Wmaybe-uninitialized.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "attn-worker/attention_kernels.h"
#include "core/amx.h"

#define ELLM_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,bmi,bmi2")))
#define ELLM_INLINE inline __attribute__((always_inline))
// The AMX entry point and its prefill part (AttendRowsBf16, which also
// converts to bfloat16 and runs TDPBF16PS: CpuHas(amx) includes AVX512-BF16
// and AMX-BF16). The tile instructions themselves are written as inline
// assembly (volatile, with memory operands or clobbers), not GCC 12's AMX
// intrinsics: those are asm statements that do not tell the compiler which
// memory they read or write, and GCC 12 has a known bug that can drop the tile
// configuration load (see DESIGN.md "Build facts"). The configuration load and
// every tile instruction sit in one function: AttendChunk<true, true>
// (decode) or AttendRowsBf16 (prefill), with their tile helpers inlined.
#define ELLM_AMX_TARGET                                                                        \
  __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,"      \
                        "avx512vnni,avx512bf16,avx512vbmi,f16c,fma,bmi,bmi2")))

namespace ellm::attn::internal {
namespace {

constexpr int kBlock = 8;  // query heads per register block

// Software prefetch. The kernels consume a tile right after loading it, so
// out-of-order execution alone cannot keep enough misses in flight, and the
// hardware streamer runs too short a distance ahead at this consumption rate
// (measured: 55-60% of the read probe without, 80-88% with). Lines of the
// tile about 2 KiB ahead (StartChunk's prefetch_tiles, per tile of a pair)
// in each of the K and V streams are prefetched one or two per step, spread
// out so the fill buffers stay busy without a burst that stalls the
// pipeline. Longer distances measured worse (single tiles, qwen2.5-14b int8,
// 16K positions: 4 KiB -3 to -6%, 16 KiB -15 to -19%), as did adding
// PREFETCHT2 further ahead.

// Per (token, query head) scratch of a chunk (64 floats, see ChunkScratchFloats).
struct HeadScratch {
  float dvec[16];  // lanes of d (summed at the end of the chunk)
  float bvec[16];  // int8: lanes of sum p_t * bias_t
  float w[32];     // f16: the T tiles' 16 T weights p; int8: their 16 T u8 weight codes,
                   // and the codes' scale at w[kWscaleAt]
};
constexpr int kWscaleAt = 16;  // after the 32 code bytes
static_assert(sizeof(HeadScratch) == kHeadScratchFloats * sizeof(float));

// What one tile gives every token and head.
struct TileCtx {
  const uint8_t* k;
  const uint8_t* v;
  int hp;
  int nvalid;  // positions of the tile this token sees (a prefix)
  __mmask16 valid;
  __m512 kscale, kmin, vscale, vbias;  // int8 only
  const char* pk;  // a later tile's K and V, prefetched line by line while
  const char* pv;  // this one computes (nullptr: none)
};

// Prefetches line i of the later tile's K and V.
ELLM_TARGET ELLM_INLINE void PrefetchLine(const TileCtx& t, int i) {
  if (t.pk != nullptr) {
    _mm_prefetch(t.pk + 64 * i, _MM_HINT_T0);
    _mm_prefetch(t.pv + 64 * i, _MM_HINT_T0);
  }
}

// Query heads j0.. of one token: their rows, partials and scratch.
struct HeadsCtx {
  const int8_t* codes;   // head j at codes + j * hp
  const float* scaled;   // head j at scaled + j * hp
  const float* code_scale;
  const int32_t* code_sum;
  float* part;           // head j at part + j * pf
  int pf;
  HeadScratch* hs;       // head j at hs + j
  const int32_t* scores[2];  // amx: tile x's head j's 16 integer dot products at scores[x] + 16 * j
};

ELLM_TARGET ELLM_INLINE int32_t Load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// acc += u8 x s8 products of `a` and the 4 bytes at `b4` broadcast to every
// lane, by a separate broadcast: VPDPBUSD with an embedded broadcast runs at
// less than half the rate on Zen 5 (`ellm-bench peak --threads 1`, 10
// independent chains: 2.4-2.5 G/s embedded, 4.9-5.2 with a VPBROADCASTD
// from memory, 5.8-6.2 from registers only).
ELLM_TARGET ELLM_INLINE __m512i DpbusdBcast(__m512i acc, __m512i a, const void* b4) {
  return _mm512_dpbusd_epi32(acc, a, _mm512_set1_epi32(Load32(b4)));
}

ELLM_TARGET ELLM_INLINE __m512 LoadHalves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 2^x for x <= 0: f = x - floor(x) in [0, 1) by VREDUCEPS, a degree-3
// minimax polynomial for 2^f (relative error 7.5e-5 in float arithmetic),
// times 2^floor(x) by VSCALEFPS (which floors its exponent operand itself).
// That is ample: int8 weight codes have steps of 1/255 of their maximum, f16
// K and V round at 4.9e-4, and a weight's error enters o and d alike. (The
// degree-5 fit before, 1.8e-7, cost the prefill item bench about 1%.) Lanes
// below -100 are clamped there, so results stay normal floats (no denormal
// assists); weights under 2^-100 of the maximum do not change a float sum
// anyway.
ELLM_TARGET ELLM_INLINE __m512 Exp2(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(7.802452147e-02f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.260671556e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.958335638e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999251962e-01f));
  return _mm512_scalef_ps(p, x);
}

// The running reference score m of a head trails the maximum by up to
// kMaxSlack (base-2 units), so weights p = 2^(s - m) stay below 2^kMaxSlack
// (harmless in float sums, and the int8 weight codes are scaled to their own
// maximum), and m only moves when a score passes it by more than that: on
// random data most tiles of a chunk's first hundreds of positions hold a new
// maximum, and each move costs a branch miss and a rescale of o.
constexpr float kMaxSlack = 8.0f;

// Raises the reference score of the heads whose scores pass it by more than
// kMaxSlack (s[x * G + j]: tile x of T, head j) to their maximum, rescaling
// o, the lane sums of d and (int8) of the V offsets by 2^(m_old - m_new).
// Off the hot path.
template <int G, int T>
ELLM_TARGET __attribute__((noinline)) void RaiseMax(const __m512* s, float* part, int pf, int hp,
                                                    HeadScratch* hs, bool int8) {
  for (int j = 0; j < G; ++j) {
    float* pj = part + j * pf;
    __m512 top = s[j];
    for (int x = 1; x < T; ++x) top = _mm512_max_ps(top, s[x * G + j]);
    const float m = pj[hp], tmax = _mm512_reduce_max_ps(top);
    if (!(tmax > m + kMaxSlack)) continue;
    pj[hp] = tmax;
    if (m == -INFINITY) continue;  // nothing accumulated yet
    const __m512 alpha = Exp2(_mm512_set1_ps(m - tmax));
    for (int i = 0; i < hp; i += 16) {
      _mm512_storeu_ps(pj + i, _mm512_mul_ps(_mm512_loadu_ps(pj + i), alpha));
    }
    _mm512_storeu_ps(hs[j].dvec, _mm512_mul_ps(_mm512_loadu_ps(hs[j].dvec), alpha));
    if (int8) _mm512_storeu_ps(hs[j].bvec, _mm512_mul_ps(_mm512_loadu_ps(hs[j].bvec), alpha));
  }
}

// The online-softmax step of G heads over T tiles' scores s[x * G + j]
// (invalid lanes -inf): raises the reference scores where needed, then turns
// the scores into the weights p = 2^(s - m) (0 in invalid lanes) and adds
// them to d's lanes.
template <int G, int T>
ELLM_TARGET ELLM_INLINE void SoftmaxStep(__m512* s, const __mmask16* valid, float* part, int pf,
                                         int hp, HeadScratch* hs, bool int8) {
  __mmask16 over = 0;
  for (int j = 0; j < G; ++j) {
    for (int x = 0; x < T; ++x) {
      over |= _mm512_cmp_ps_mask(s[x * G + j], _mm512_set1_ps(part[j * pf + hp] + kMaxSlack), _CMP_GT_OQ);
    }
  }
  if (over) RaiseMax<G, T>(s, part, pf, hp, hs, int8);
  for (int j = 0; j < G; ++j) {
    const __m512 m = _mm512_set1_ps(part[j * pf + hp]);
    __m512 d = _mm512_loadu_ps(hs[j].dvec);
    for (int x = 0; x < T; ++x) {
      s[x * G + j] = _mm512_maskz_mov_ps(valid[x], Exp2(_mm512_sub_ps(s[x * G + j], m)));
      d = _mm512_add_ps(d, s[x * G + j]);
    }
    _mm512_storeu_ps(hs[j].dvec, d);
  }
}

// The maxima of G <= 8 vectors at once (a transposing tree: 23 instructions
// for 8 vectors instead of 8 separate reductions): head j's maximum lands in
// lane MaxLane(j) of the result.
constexpr int MaxLane(int j) { return j < 4 ? 4 * j : 4 * (j - 4) + 2; }

template <int G>
ELLM_TARGET ELLM_INLINE __m512 MaxEach(const __m512* x) {
  __m512 in[8];
  for (int j = 0; j < 8; ++j) in[j] = j < G ? x[j] : _mm512_setzero_ps();
  __m512 t[4];
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_max_ps(_mm512_shuffle_f32x4(in[2 * i], in[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(in[2 * i], in[2 * i + 1], 0xEE));
  }
  const __m512 u0 = _mm512_max_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88),
                                  _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
  const __m512 u1 = _mm512_max_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x88),
                                  _mm512_shuffle_f32x4(t[2], t[3], 0xDD));
  const __m512 v = _mm512_max_ps(_mm512_shuffle_ps(u0, u1, 0x44), _mm512_shuffle_ps(u0, u1, 0xEE));
  return _mm512_max_ps(v, _mm512_permute_ps(v, 0xB1));
}

// o[16 dg .. 16 (dg + D)) of G heads += the codes' scale * sum over the T
// tiles' 16 T positions of weight code x V code (int32 sums: at most 16 T x 255 x 128).
// Pairs also prefetch here (kPrefetch): lines [pf_line, pf_end) of the
// second tile's later tile, spread over the steps.
template <int G, int D, int T, bool kPrefetch>
ELLM_TARGET ELLM_INLINE void VTile(const TileCtx* t, int dg, const HeadsCtx& q, int pf_line = 0, int pf_end = 0) {
  static_assert(T == 2 || !kPrefetch, "only pairs prefetch from p·V");
  __m512i va[D][G];
  for (int b = 0; b < D; ++b) {
    for (int j = 0; j < G; ++j) va[b][j] = _mm512_setzero_si512();
  }
  // A call prefetches at most 5 D lines (Int8Tiles: hp / 4 + 1 lines over
  // hp / 16 groups of 16 dims), kPfPerQuad per step. Written with a fixed
  // count and one test per line so that the steps unroll and each test
  // takes the same way on every call for the same dg: a loop whose trip
  // count varied from step to step kept the steps rolled up (accumulators
  // copied between registers every step) and mispredicted its exit.
  constexpr int kPfPerQuad = (5 * D + 4 * T - 1) / (4 * T);
#pragma GCC unroll 8
  for (int quad = 0; quad < 4 * T; ++quad) {
    if constexpr (kPrefetch) {
      for (int k = 0; k < kPfPerQuad; ++k) {
        if (pf_line + quad + 4 * T * k < pf_end) PrefetchLine(t[1], pf_line + quad + 4 * T * k);
      }
    }
    const uint8_t* v = t[quad / 4].v + 64 * (quad % 4);
    for (int j = 0; j < G; ++j) {
      const __m512i w = _mm512_set1_epi32(Load32(reinterpret_cast<const uint8_t*>(q.hs[j].w) + 4 * quad));
      for (int b = 0; b < D; ++b) {
        va[b][j] = _mm512_dpbusd_epi32(va[b][j], w, _mm512_loadu_si512(v + 256 * (dg + b)));
      }
    }
  }
  if constexpr (kPrefetch) {
    for (int l = pf_line + 4 * T * kPfPerQuad; l < pf_end; ++l) PrefetchLine(t[1], l);  // none so far
  }
  // In locals: each store to o could otherwise alias q's fields, and they
  // would be reloaded after every store.
  float* const part = q.part;
  const int pf = q.pf;
  for (int b = 0; b < D; ++b) {
    for (int j = 0; j < G; ++j) {
      float* o = part + j * pf + 16 * (dg + b);
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(va[b][j]), _mm512_set1_ps(q.hs[j].w[kWscaleAt]),
                                          _mm512_loadu_ps(o)));
    }
  }
}

// p·V of all hp / 16 dim groups, kDg at a time.
template <int G, int kDg, int T, bool kPrefetch>
ELLM_TARGET ELLM_INLINE void ValuesOf(const TileCtx* t, const HeadsCtx& q, int n_dg, int pf_lines, int per_dg) {
  int dg = 0;
  for (; dg + kDg <= n_dg; dg += kDg) {
    VTile<G, kDg, T, kPrefetch>(t, dg, q, dg * per_dg, std::min(pf_lines, (dg + kDg) * per_dg));
  }
  for (; dg < n_dg; ++dg) {
    VTile<G, 1, T, kPrefetch>(t, dg, q, dg * per_dg, std::min(pf_lines, (dg + 1) * per_dg));
  }
}

// T = 1 or 2 consecutive int8 tiles for G query heads of one token, in two
// parts: Int8Weights (the scores, the softmax step and the weight codes) and
// Int8Values (p·V). A pair shares its work where it can: each 4-byte query
// code broadcast serves both tiles' K lines, one softmax step, one weight
// scale per head (the maximum over 32 positions) and one int32 p·V sum before
// the float update of o, so the per-tile fixed costs and their latency are
// paid once per 32 positions. AttendChunk runs an item's values after the
// next item's weights (see there).
template <int G, int T, bool kAmx>
ELLM_TARGET void Int8Weights(const TileCtx* t, const HeadsCtx& q) {
  const int hp = t[0].hp, n_dq = hp / 4;  // n_dq is a multiple of 4
  __m512i acc[T][G];
  if constexpr (kAmx) {
    // The dot products came from the tile unit (AttendChunk<true, true>).
    for (int x = 0; x < T; ++x) {
      for (int j = 0; j < G; ++j) acc[x][j] = _mm512_load_si512(q.scores[x] + 16 * j);
    }
  } else if constexpr (T == 1) {
    // Two accumulator banks (even and odd 4-dim groups) hide VPDPBUSD's latency.
    __m512i acc2[G];
    for (int j = 0; j < G; ++j) acc[0][j] = acc2[j] = _mm512_setzero_si512();
    for (int dq = 0; dq < n_dq; dq += 2) {
      PrefetchLine(t[0], dq);
      PrefetchLine(t[0], dq + 1);
      const __m512i k0 = _mm512_loadu_si512(t[0].k + 64 * dq);
      const __m512i k1 = _mm512_loadu_si512(t[0].k + 64 * dq + 64);
      for (int j = 0; j < G; ++j) {
        const int8_t* c = q.codes + j * hp + 4 * dq;
        acc[0][j] = DpbusdBcast(acc[0][j], k0, c);
        acc2[j] = DpbusdBcast(acc2[j], k1, c + 4);
      }
    }
    for (int j = 0; j < G; ++j) acc[0][j] = _mm512_add_epi32(acc[0][j], acc2[j]);
    PrefetchLine(t[0], n_dq);  // a tile is n_dq + 1 lines: scales first
  } else {
    // Each broadcast query code against the same line of both tiles; for few
    // heads a second bank (odd 4-dim groups) keeps enough chains in flight.
    constexpr int kBanks = G <= 4 ? 2 : 1;
    __m512i bank[kBanks][2][G];
    for (int r = 0; r < kBanks; ++r) {
      for (int x = 0; x < 2; ++x) {
        for (int j = 0; j < G; ++j) bank[r][x][j] = _mm512_setzero_si512();
      }
    }
    for (int dq = 0; dq < n_dq; dq += kBanks) {
      for (int r = 0; r < kBanks; ++r) {
        PrefetchLine(t[0], dq + r);  // the second tile's in p·V
        const __m512i k0 = _mm512_loadu_si512(t[0].k + 64 * (dq + r));
        const __m512i k1 = _mm512_loadu_si512(t[1].k + 64 * (dq + r));
        for (int j = 0; j < G; ++j) {
          const __m512i c = _mm512_set1_epi32(Load32(q.codes + j * hp + 4 * (dq + r)));
          bank[r][0][j] = _mm512_dpbusd_epi32(bank[r][0][j], k0, c);
          bank[r][1][j] = _mm512_dpbusd_epi32(bank[r][1][j], k1, c);
        }
      }
    }
    for (int x = 0; x < 2; ++x) {
      for (int j = 0; j < G; ++j) {
        acc[x][j] = kBanks == 2 ? _mm512_add_epi32(bank[0][x][j], bank[kBanks - 1][x][j]) : bank[0][x][j];
      }
    }
    PrefetchLine(t[0], n_dq);
  }
  // Scores: s = code_scale * (kscale * dot + kmin * code_sum).
  __m512 s[T * G];
  __mmask16 valid[T];
  for (int x = 0; x < T; ++x) {
    valid[x] = t[x].valid;
    for (int j = 0; j < G; ++j) {
      __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[x][j]), t[x].kscale,
                                 _mm512_mul_ps(t[x].kmin, _mm512_set1_ps(static_cast<float>(q.code_sum[j]))));
      s[x * G + j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), t[x].valid, v,
                                        _mm512_set1_ps(q.code_scale[j]));
    }
  }
  SoftmaxStep<G, T>(s, valid, q.part, q.pf, hp, q.hs, true);
  // Weights w = p * vscale, as u8 codes against each head's maximum over
  // the T tiles.
  __m512 wtop[G];
  for (int j = 0; j < G; ++j) {
    HeadScratch* h = q.hs + j;
    __m512 b = _mm512_loadu_ps(h->bvec);
    for (int x = 0; x < T; ++x) {
      b = _mm512_mask3_fmadd_ps(s[x * G + j], t[x].vbias, b, t[x].valid);
      s[x * G + j] = _mm512_maskz_mul_ps(t[x].valid, s[x * G + j], t[x].vscale);
    }
    _mm512_storeu_ps(h->bvec, b);
    wtop[j] = T == 1 ? s[j] : _mm512_max_ps(s[j], s[(T - 1) * G + j]);
  }
  const __m512 wmax = MaxEach<G>(wtop);
  alignas(64) float inv[16], wscale[16];
  _mm512_store_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(wmax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                           _mm512_set1_ps(255.0f), wmax));
  _mm512_store_ps(wscale, _mm512_mul_ps(wmax, _mm512_set1_ps(1.0f / 255.0f)));
  for (int j = 0; j < G; ++j) {
    for (int x = 0; x < T; ++x) {
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(s[x * G + j], _mm512_set1_ps(inv[MaxLane(j)])));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.hs[j].w) + x, _mm512_cvtepi32_epi8(codes));
    }
    q.hs[j].w[kWscaleAt] = wscale[MaxLane(j)];
  }
}

template <int G, int T>
ELLM_TARGET void Int8Values(const TileCtx* t, const HeadsCtx& q) {
  const int hp = t[0].hp, n_dq = hp / 4;
  // p·V: kDg groups of 16 dims at a time, so that each head's broadcast
  // weight codes serve kDg VPDPBUSDs (V lines come from L1 as memory operands).
  constexpr int kDg = G <= 4 ? 4 : 2;
  const int n_dg = hp / 16;
  // A pair spreads the second tile's prefetches (n_dq + 1 lines) over p·V.
  const int pf_lines = T == 2 ? n_dq + 1 : 0, per_dg = (pf_lines + n_dg - 1) / n_dg;
  // Only a chunk's first token prefetches (AttendChunk): the others run p·V
  // without the per-line tests (the prefill item bench, one thread, hd 128:
  // 267-272 -> 277-283 G multiply-adds/s).
  if constexpr (T == 2) {
    if (t[1].pk != nullptr) {
      ValuesOf<G, kDg, T, true>(t, q, n_dg, pf_lines, per_dg);
      return;
    }
  }
  ValuesOf<G, kDg, T, false>(t, q, n_dg, pf_lines, per_dg);
}

// o[16 db .. 16 (db + D)) of G heads += sum over the rows this token sees
// of p x V, row by row through the T tiles: each row's G weights are
// broadcast once for D blocks of 16 dims. Rows past the token's last
// position may hold anything (even NaN bits): they are skipped, not
// multiplied by zero. Pairs also prefetch the second tile's later tile here,
// lines [pf_line, pf_end) spread over the rows.
template <int G, int D, int T>
ELLM_TARGET ELLM_INLINE void F16Rows(const TileCtx* t, const HeadsCtx& q, int db, int pf_line, int pf_end) {
  const int hp = t[0].hp;
  __m512 va[D][G];
  for (int b = 0; b < D; ++b) {
    for (int j = 0; j < G; ++j) va[b][j] = _mm512_setzero_ps();
  }
  for (int x = 0; x < T; ++x) {
    const uint8_t* row = t[x].v + 32 * db;
    for (int r = 0; r < t[x].nvalid; ++r, row += 2 * hp) {
      if constexpr (T == 2) {
        for (int l = pf_line + x * kTile + r; l < pf_end; l += T * kTile) PrefetchLine(t[1], l);
      }
      __m512 w[G];
      for (int j = 0; j < G; ++j) w[j] = _mm512_set1_ps(q.hs[j].w[x * kTile + r]);
      for (int b = 0; b < D; ++b) {
        const __m512 v = LoadHalves(row + 32 * b);
        for (int j = 0; j < G; ++j) va[b][j] = _mm512_fmadd_ps(v, w[j], va[b][j]);
      }
    }
  }
  for (int b = 0; b < D; ++b) {
    for (int j = 0; j < G; ++j) {
      float* o = q.part + j * q.pf + 16 * (db + b);
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), va[b][j]));
    }
  }
}

// T = 1 or 2 consecutive f16 tiles for G query heads of one token; a pair
// loads each broadcast query element once for both tiles' K lines and takes
// one softmax step.
template <int G, int T>
ELLM_TARGET void F16Tiles(const TileCtx* t, const HeadsCtx& q) {
  const int hp = t[0].hp;
  // Scores, lane = position: 2 banks (even and odd dims) per tile for a
  // single tile or few heads, enough independent FMA chains to cover the
  // FMA latency at 2 per cycle.
  constexpr int kBanks = T == 1 || G <= 3 ? 2 : 1;
  __m512 acc[kBanks][T][G];
  for (int r = 0; r < kBanks; ++r) {
    for (int x = 0; x < T; ++x) {
      for (int j = 0; j < G; ++j) acc[r][x][j] = _mm512_setzero_ps();
    }
  }
  for (int d = 0; d < hp; d += 2) {
    PrefetchLine(t[0], d / 2);  // a tile is hp / 2 lines
    for (int b = 0; b < 2; ++b) {
      __m512 k[T];
      for (int x = 0; x < T; ++x) k[x] = LoadHalves(t[x].k + 32 * (d + b));
      for (int j = 0; j < G; ++j) {
        const __m512 qd = _mm512_set1_ps(q.scaled[j * hp + d + b]);
        for (int x = 0; x < T; ++x) acc[b % kBanks][x][j] = _mm512_fmadd_ps(k[x], qd, acc[b % kBanks][x][j]);
      }
    }
  }
  __m512 s[T * G];
  __mmask16 valid[T];
  for (int x = 0; x < T; ++x) {
    valid[x] = t[x].valid;
    for (int j = 0; j < G; ++j) {
      const __m512 v = kBanks == 2 ? _mm512_add_ps(acc[0][x][j], acc[kBanks - 1][x][j]) : acc[0][x][j];
      s[x * G + j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), t[x].valid, v);
    }
  }
  SoftmaxStep<G, T>(s, valid, q.part, q.pf, hp, q.hs, false);
  for (int j = 0; j < G; ++j) {
    for (int x = 0; x < T; ++x) _mm512_storeu_ps(q.hs[j].w + x * kTile, s[x * G + j]);
  }
  // p·V over the rows this token sees.
  constexpr int kDb = G <= 3 ? 8 : G <= 6 ? 4 : 2;
  const int n_db = hp / 16;
  const int pf_lines = T == 2 ? hp / 2 : 0, per_db = (pf_lines + n_db - 1) / n_db;
  int db = 0;
  for (; db + kDb <= n_db; db += kDb) {
    F16Rows<G, kDb, T>(t, q, db, db * per_db, std::min(pf_lines, (db + kDb) * per_db));
  }
  for (; db < n_db; ++db) F16Rows<G, 1, T>(t, q, db, db * per_db, std::min(pf_lines, (db + 1) * per_db));
}

// The part of the work for T tiles (2: a pair) and g <= kBlock heads.
enum class Part { kF16, kInt8Weights, kInt8Values, kInt8Whole };

template <Part kPart, int G, int T, bool kAmx>
ELLM_TARGET ELLM_INLINE void RunTiles(const TileCtx* t, const HeadsCtx& q) {
  if constexpr (kPart == Part::kF16) {
    F16Tiles<G, T>(t, q);
  } else if constexpr (kPart == Part::kInt8Weights) {
    Int8Weights<G, T, kAmx>(t, q);
  } else if constexpr (kPart == Part::kInt8Values) {
    Int8Values<G, T>(t, q);
  } else {
    Int8Weights<G, T, kAmx>(t, q);
    Int8Values<G, T>(t, q);
  }
}

template <Part kPart, int T, bool kAmx>
ELLM_TARGET void TilesForHeads(int g, const TileCtx* t, const HeadsCtx& q) {
  switch (g) {
    case 1: RunTiles<kPart, 1, T, kAmx>(t, q); break;
    case 2: RunTiles<kPart, 2, T, kAmx>(t, q); break;
    case 3: RunTiles<kPart, 3, T, kAmx>(t, q); break;
    case 4: RunTiles<kPart, 4, T, kAmx>(t, q); break;
    case 5: RunTiles<kPart, 5, T, kAmx>(t, q); break;
    case 6: RunTiles<kPart, 6, T, kAmx>(t, q); break;
    case 7: RunTiles<kPart, 7, T, kAmx>(t, q); break;
    default: RunTiles<kPart, 8, T, kAmx>(t, q); break;
  }
}

template <Part kPart, bool kAmx>
ELLM_TARGET ELLM_INLINE void PartForHeads(int tiles, int g, const TileCtx* t, const HeadsCtx& q) {
  if (tiles == 2) {
    TilesForHeads<kPart, 2, kAmx>(g, t, q);
  } else {
    TilesForHeads<kPart, 1, kAmx>(g, t, q);
  }
}

// AMX (int8 only): the tile configuration, and the scores of one tile of 16
// positions for every token that sees it, all heads of the group at once:
// C[head][position] += sum_d A[head][d] * B[d / 4][4 * position + d % 4] with
// TDPBSUD, A = the query codes (s8, one row of hp bytes per head), B = the K
// tile's codes as stored (u8, one 64-byte line per 4 dims = VNNI format).
// Tiles: tmm0 C (G rows x 64 bytes), tmm1 / tmm2 A / B for 64 dims, tmm3 /
// tmm4 A / B for the last hp % 64 dims.

constexpr int kAmxMaxGroup = 16;  // rows of a tile
// Scores are computed kAmxAhead tiles ahead of their use (a ring of kAmxRing
// buffers), so that the vector loads of a tile's scores never issue before
// the tile store that writes them.
constexpr int kAmxAhead = 2, kAmxRing = 4;

AmxTileConfig MakeAmxConfig(int group, int hp) {
  AmxTileConfig c;
  c.rows[0] = c.rows[1] = static_cast<uint8_t>(group);
  c.colsb[0] = c.colsb[1] = 64;
  c.rows[2] = 16;
  c.colsb[2] = 64;
  const int tail = hp % 64;
  if (tail != 0) {
    c.rows[3] = static_cast<uint8_t>(group);
    c.colsb[3] = static_cast<uint16_t>(tail);
    c.rows[4] = static_cast<uint8_t>(tail / 4);
    c.colsb[4] = 64;
  }
  return c;
}

// scores[i][j][16] for the tokens i that see tile `pos`, from the K codes at
// k and query codes q (token i's head 0 at q + i * q_token_bytes).
ELLM_TARGET ELLM_INLINE void AmxScores(const uint8_t* k, const int8_t* q, int64_t q_token_bytes, int hp,
                                       int pos, const ChunkArgs& a, int32_t* scores) {
  const int n_main = hp / 64, tail = hp % 64;
  const int64_t hp64 = hp, line = 64;
  for (int i = 0; i < a.n_tokens; ++i) {
    if (std::min(a.pos_end, a.last_pos[i] + 1) - pos <= 0) continue;
    const int8_t* qi = q + i * q_token_bytes;
    __asm__ volatile("tilezero %%tmm0" ::: "memory");
    for (int kb = 0; kb < n_main; ++kb) {
      __asm__ volatile(
          "tileloadd (%0,%1,1), %%tmm1\n\t"
          "tileloadd (%2,%3,1), %%tmm2\n\t"
          "tdpbsud %%tmm2, %%tmm1, %%tmm0"
          :
          : "r"(qi + 64 * kb), "r"(hp64), "r"(k + 1024 * kb), "r"(line)
          : "memory");
    }
    if (tail != 0) {
      __asm__ volatile(
          "tileloadd (%0,%1,1), %%tmm3\n\t"
          "tileloadd (%2,%3,1), %%tmm4\n\t"
          "tdpbsud %%tmm4, %%tmm3, %%tmm0"
          :
          : "r"(qi + 64 * n_main), "r"(hp64), "r"(k + 1024 * n_main), "r"(line)
          : "memory");
    }
    __asm__ volatile("tilestored %%tmm0, (%0,%1,1)"
                     :
                     : "r"(scores + static_cast<size_t>(i) * a.group * 16), "r"(line)
                     : "memory");
  }
}

// --- amx prefill chunks: p·V in bfloat16 on the tile unit --------------------
//
// A chunk of several tokens (prefill; hp % 64 == 0, hp <= kAmxRowsMaxDim,
// group <= 16) takes its rows r = (token, head), 16 at a time, through both
// products on the tile unit, kQuad = 4 tiles (64 positions) a step:
//   scores  C[row][position] = sum over dims of query code x K code: TDPBSUD
//           as in decode (exact int32), A = the rows' query codes;
//   softmax per row in vectors, as avx512's: s, the running reference m,
//           p = 2^(s - m), d += p;
//   p·V     o[row][dim] += sum over the step's 64 positions of p x v in
//           bfloat16 with fp32 sums: TDPBF16PS with A = the rows' p (bf16,
//           two tiles of 32 positions), B = the step's V dequantised once for
//           all rows (v = scale x (code + 128) + min, rounded to bf16), C =
//           o itself, carried across the chunk in memory (o_rows).
// So there are no int8 weight codes, no per-pair weight scale and no vector
// update of o per pair: the tile unit adds p·V straight into o, the vector
// units do the softmax and the V conversion (shared by every row). Results
// differ from avx512's by rounding (p and v in bf16, 8 bits of mantissa,
// where avx512 codes p x vscale in 8 bits against the pair's maximum). A
// token's result depends only on its own row, so not on the other tokens of
// its chunk nor on the thread count; but a token alone in its chunk (decode,
// or a one-token piece of a prompt) takes the int8 path, so a prompt's
// rounding depends on how its prefill was cut into steps.
// Measured (the prefill item bench, hd 128 and 64, one thread; ellm-bench
// prefill at 16K), see attention_kernels.h.

constexpr int kAmxRowsMaxDim = 256;
constexpr int kQuad = 4;  // tiles a step
constexpr int kRowsRing = kQuad + kAmxAhead + 2;  // score slots: a step's tiles and those computed ahead

// The step's V (tiles t[0 .. n_tiles)) as bf16 B tiles, vbf + 1024 * dg for
// dims [16 dg, 16 dg + 16): row k2 holds positions 2 k2 and 2 k2 + 1 of the
// step as [16 dims][2] (rows 0-15 the first B tile, 16-31 the second). A
// line of V codes (16 dims x 4 positions, [dim][position % 4]) becomes rows
// 2 q and 2 q + 1 of its tile's 8: its 64 values as 4 quarters of 8 dims x 2
// positions (kAmxQuarterBytes), scaled per position, two quarters at a time
// rounded to bf16 as one row (a dword per dim: the pair of positions).
// Positions from `valid` on (past every token of the chunk: their
// bytes may be anything) and tiles past n_tiles are zero.
ELLM_AMX_TARGET ELLM_INLINE void AmxBf16Values(const TileCtx* t, int n_tiles, int valid, int hp,
                                                     uint16_t* vbf) {
  // Lane i of quarter 2 p + hb: position 4 q + 2 p + i % 2 of the tile, for
  // line q (kAmxQuarterBytes).
  const __m512i lane_pos = _mm512_and_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(1));
  // The codes land as code x 2^24 (kAmxHighBytes), so the scale is taken
  // 2^24 smaller: exact (a power of two on an fp16 scale), so v is the same.
  const __m512 unscale = _mm512_set1_ps(0x1p-24f);
  const int n_dg = hp / 16;
  for (int x = 0; x < kQuad; ++x) {
    if (x >= n_tiles) {
      for (int dg = 0; dg < n_dg; ++dg) {
        for (int row = 8 * x; row < 8 * x + 8; ++row) {
          _mm512_store_si512(vbf + 1024 * dg + 32 * row, _mm512_setzero_si512());
        }
      }
      continue;
    }
    const __m512 tile_scale = _mm512_mul_ps(t[x].vscale, unscale);
    for (int q = 0; q < 4; ++q) {
      __m512 scale[2], bias[2];
      __mmask16 ok[2];
      for (int p = 0; p < 2; ++p) {
        const __m512i pos = _mm512_add_epi32(lane_pos, _mm512_set1_epi32(4 * q + 2 * p));
        ok[p] = _mm512_cmplt_epi32_mask(_mm512_add_epi32(pos, _mm512_set1_epi32(16 * x)), _mm512_set1_epi32(valid));
        scale[p] = _mm512_permutexvar_ps(pos, tile_scale);
        bias[p] = _mm512_permutexvar_ps(pos, t[x].vbias);
      }
      for (int dg = 0; dg < n_dg; ++dg) {
        const __m512i line = _mm512_loadu_si512(t[x].v + 64 * (4 * dg + q));
        uint16_t* rows = vbf + 1024 * dg + 32 * (8 * x + 2 * q);
        for (int p = 0; p < 2; ++p) {
          __m512 f[2];
          for (int hb = 0; hb < 2; ++hb) {
            const __m512i code = _mm512_maskz_permutexvar_epi8(
                kAmxHighBytes, _mm512_load_si512(kAmxQuarterBytes[2 * p + hb].data()), line);
            f[hb] = _mm512_maskz_fmadd_ps(ok[p], _mm512_cvtepi32_ps(code), scale[p], bias[p]);
          }
          _mm512_store_si512(rows + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
        }
      }
    }
  }
}

// The tile configuration of AttendRowsBf16: tmm0 A (16 rows x 64 query
// codes), tmm1 B (a K tile's 16 lines of 64 dims), tmm2 / tmm3 A (16 rows
// x 32 p in bf16: the step's first and last 32 positions), tmm4-tmm7 C (16
// rows x 16 int32 scores or fp32 o); in p·V, tmm0 and tmm1 hold the B tiles
// (16 rows x 64 bytes of V in bf16). All of 16 rows x 64 bytes.
AmxTileConfig MakeAmxRowsConfig() {
  AmxTileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  return c;
}

// Scores of one K tile (codes at k) for every row, 16 at a time (C in tmm4
// to tmm7 in turn, so that the tile unit need not wait for a store before
// the next product): scores[row][16] int32. qbuf: [rows][hp] query codes,
// zero past n_rows up to a multiple of 16.
ELLM_TARGET ELLM_INLINE void AmxRowScores(const uint8_t* k, const int8_t* qbuf, int n_rows, int hp,
                                          int32_t* scores) {
  const int64_t hp64 = hp, line = 64;
#define ELLM_ROW_SCORES(C)                                                       \
  do {                                                                           \
    __asm__ volatile("tilezero %%" C ::: "memory");                              \
    for (int kb = 0; kb < hp / 64; ++kb) {                                       \
      __asm__ volatile("tileloadd (%0,%1,1), %%tmm0\n\t"                         \
                       "tileloadd (%2,%3,1), %%tmm1\n\t"                         \
                       "tdpbsud %%tmm1, %%tmm0, %%" C                            \
                       :                                                         \
                       : "r"(qbuf + static_cast<int64_t>(r0) * hp + 64 * kb),   \
                         "r"(hp64), "r"(k + 1024 * kb), "r"(line)                \
                       : "memory");                                              \
    }                                                                            \
    __asm__ volatile("tilestored %%" C ", (%0,%1,1)"                             \
                     :                                                           \
                     : "r"(scores + 16 * r0), "r"(line)                          \
                     : "memory");                                                \
  } while (0)
  for (int r0 = 0; r0 < n_rows; r0 += 16) {
    switch (r0 / 16 % 4) {
      case 0: ELLM_ROW_SCORES("tmm4"); break;
      case 1: ELLM_ROW_SCORES("tmm5"); break;
      case 2: ELLM_ROW_SCORES("tmm6"); break;
      default: ELLM_ROW_SCORES("tmm7"); break;
    }
  }
#undef ELLM_ROW_SCORES
}

// o[16 rows][hp] (o_rows + r0 * hp, fp32) += p[16 rows][64] (pbuf + r0 * 64,
// bf16) x the step's V (vbf), 2 groups of 16 dims per asm statement: C in
// tmm4-tmm7, B in tmm0 and tmm1.
ELLM_TARGET ELLM_INLINE void AmxRowValues(int r0, const uint16_t* pbuf, const uint16_t* vbf, float* o_rows,
                                          int hp) {
  const int64_t line = 64, p_stride = 128, c_stride = static_cast<int64_t>(hp) * 4;
  __asm__ volatile(
      "tileloadd (%0,%1,1), %%tmm2\n\t"
      "tileloadd 64(%0,%1,1), %%tmm3"
      :
      : "r"(pbuf + 64 * r0), "r"(p_stride)
      : "memory");
  // Dims [16 dg, 16 dg + 32): C tiles C0 and C1 (tmm4/5 and tmm6/7 in turn).
#define ELLM_ROW_VALUES(C0, C1)                                                                    \
  __asm__ volatile("tileloadd (%0,%2,1), %%" C0 "\n\t"                                            \
                   "tileloadd 64(%0,%2,1), %%" C1 "\n\t"                                          \
                   "tileloadd (%1,%3,1), %%tmm0\n\t"                                              \
                   "tileloadd 1024(%1,%3,1), %%tmm1\n\t"                                          \
                   "tdpbf16ps %%tmm0, %%tmm2, %%" C0 "\n\t"                                      \
                   "tdpbf16ps %%tmm1, %%tmm3, %%" C0 "\n\t"                                      \
                   "tileloadd 2048(%1,%3,1), %%tmm0\n\t"                                          \
                   "tileloadd 3072(%1,%3,1), %%tmm1\n\t"                                          \
                   "tdpbf16ps %%tmm0, %%tmm2, %%" C1 "\n\t"                                      \
                   "tdpbf16ps %%tmm1, %%tmm3, %%" C1 "\n\t"                                      \
                   "tilestored %%" C0 ", (%0,%2,1)\n\t"                                          \
                   "tilestored %%" C1 ", 64(%0,%2,1)"                                            \
                   :                                                                               \
                   : "r"(o_rows + static_cast<int64_t>(r0) * hp + 16 * dg), "r"(vbf + 1024 * dg), \
                     "r"(c_stride), "r"(line)                                                      \
                   : "memory")
  for (int dg = 0; dg < hp / 16; dg += 2) {
    if (dg % 4 == 0) {
      ELLM_ROW_VALUES("tmm4", "tmm5");
    } else {
      ELLM_ROW_VALUES("tmm6", "tmm7");
    }
  }
#undef ELLM_ROW_VALUES
}

// One row's softmax step over the step's tiles (dots[x]: tile x's 16 int32
// dot products; tiles the row's token does not see, and positions past its
// last, are masked): raises the reference score m (part[hp]) when a score
// passes it by more than kMaxSlack, rescaling the row's o and d's lanes;
// then p = 2^(s - m), added to d's lanes and written to prow as 64 bf16.
ELLM_AMX_TARGET ELLM_INLINE void AmxRowWeights(const TileCtx* t, int mine, const int32_t* const* dots,
                                                     float code_scale, int32_t code_sum, float* part, float* o,
                                                     int hp, HeadScratch* h, uint16_t* prow) {
  __m512 s[kQuad];
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int x = 0; x < kQuad; ++x) {
    if (x >= mine) {
      s[x] = _mm512_set1_ps(-INFINITY);
      continue;
    }
    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[x])), t[x].kscale,
                                     _mm512_mul_ps(t[x].kmin, _mm512_set1_ps(static_cast<float>(code_sum))));
    s[x] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), t[x].valid, v, _mm512_set1_ps(code_scale));
    top = _mm512_max_ps(top, s[x]);
  }
  float& m = part[hp];
  if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(m + kMaxSlack), _CMP_GT_OQ) != 0) {
    const float tmax = _mm512_reduce_max_ps(top);
    if (m != -INFINITY) {
      const __m512 alpha = Exp2(_mm512_set1_ps(m - tmax));
      for (int i = 0; i < hp; i += 16) _mm512_store_ps(o + i, _mm512_mul_ps(_mm512_load_ps(o + i), alpha));
      _mm512_storeu_ps(h->dvec, _mm512_mul_ps(_mm512_loadu_ps(h->dvec), alpha));
    }
    m = tmax;
  }
  const __m512 mv = _mm512_set1_ps(m);
  __m512 p[kQuad];
  __m512 d = _mm512_loadu_ps(h->dvec);
  for (int x = 0; x < kQuad; ++x) {
    p[x] = x < mine ? _mm512_maskz_mov_ps(t[x].valid, Exp2(_mm512_sub_ps(s[x], mv))) : _mm512_setzero_ps();
    d = _mm512_add_ps(d, p[x]);
  }
  _mm512_storeu_ps(h->dvec, d);
  _mm512_store_si512(prow, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
  _mm512_store_si512(prow + 32, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
}

// The per-thread buffers of AttendRowsBf16 (512 KiB at most: 256 rows, hp 256).
struct RowsBuffers {
  AlignedArray<float> o_rows;     // [rows][hp] o, summed by the tile unit
  AlignedArray<int8_t> qbuf;      // [rows][hp] query codes
  AlignedArray<int32_t> scores;   // kRowsRing slots of [rows][16] int32
  AlignedArray<uint16_t> pbuf;    // [rows][64] p in bf16
  AlignedArray<uint16_t> vbf;     // [hp / 16][32][32] V in bf16
};

// A prefill chunk, as the header of this part says.
ELLM_AMX_TARGET void AttendRowsBf16(const ChunkArgs& a) {
  const int hp = a.kv.format.padded_dim, pf = PartialFloats(hp);
  const int n_rows = a.n_tokens * a.group, rows16 = (n_rows + 15) / 16 * 16;
  const QueryPrep& prep = *a.q;
  HeadScratch* scratch = reinterpret_cast<HeadScratch*>(a.scratch);
  const ChunkStart c = StartChunk(a);
  const int end = c.end, prefetch_end = c.prefetch_end, dist = c.prefetch_tiles + kAmxAhead;
  thread_local RowsBuffers buf;
  buf.o_rows.Resize(static_cast<size_t>(rows16) * hp);
  buf.qbuf.Resize(static_cast<size_t>(rows16) * hp);
  buf.scores.Resize(static_cast<size_t>(kRowsRing) * rows16 * 16);
  buf.pbuf.Resize(static_cast<size_t>(rows16) * 64);
  buf.vbf.Resize(static_cast<size_t>(hp) / 16 * 1024);
  float* o_rows = buf.o_rows.data();
  int8_t* qbuf = buf.qbuf.data();
  uint16_t* pbuf = buf.pbuf.data();
  std::fill_n(o_rows, static_cast<size_t>(rows16) * hp, 0.0f);
  const int8_t* q0 = prep.codes.data() + static_cast<size_t>(a.q_row0) * hp;
  for (int i = 0; i < a.n_tokens; ++i) {
    std::memcpy(qbuf + static_cast<size_t>(i) * a.group * hp, q0 + static_cast<size_t>(i) * a.q_token_stride * hp,
                static_cast<size_t>(a.group) * hp);
  }
  std::memset(qbuf + static_cast<size_t>(n_rows) * hp, 0, static_cast<size_t>(rows16 - n_rows) * hp);
  std::memset(pbuf + static_cast<size_t>(n_rows) * 64, 0, static_cast<size_t>(rows16 - n_rows) * 128);
  const auto slot = [&](int tile) { return buf.scores.data() + static_cast<size_t>(tile % kRowsRing) * rows16 * 16; };
  const AmxTileConfig cfg = MakeAmxRowsConfig();
  __asm__ volatile("" ::: "memory");
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
  int scored = 0;  // tiles of the chunk whose scores are computed (kAmxAhead ahead of use)
  TileCtx t[kQuad];
  for (int pos = a.pos_begin, n = 0; pos < end;) {
    const int n_tiles = std::min(kQuad, (end - pos + kTile - 1) / kTile);
    for (; scored < n + n_tiles + kAmxAhead && a.pos_begin + scored * kTile < end; ++scored) {
      AmxRowScores(a.kv.KeyTile(a.pos_begin + scored * kTile) + 64, qbuf, n_rows, hp, slot(scored));
    }
    for (int x = 0; x < n_tiles; ++x) {
      TileCtx& tx = t[x];
      const int p = pos + x * kTile;
      tx.k = a.kv.KeyTile(p) + 64;  // codes after the scale and min line
      tx.v = tx.k + a.kv.value_offset;
      tx.kscale = LoadHalves(tx.k - 64);
      tx.kmin = LoadHalves(tx.k - 32);
      tx.vscale = LoadHalves(tx.v - 64);
      tx.vbias = _mm512_fmadd_ps(tx.vscale, _mm512_set1_ps(128.0f), LoadHalves(tx.v - 32));
      const int ahead = p + n_tiles * dist * kTile;  // as far ahead in steps as a tile in decode
      tx.pk = tx.pv = nullptr;
      if (ahead < prefetch_end) {
        tx.pk = reinterpret_cast<const char*>(a.kv.KeyTile(ahead));
        tx.pv = tx.pk + a.kv.value_offset;
        for (int l = 0; l <= hp / 4; ++l) PrefetchLine(tx, l);
      }
    }
    AmxBf16Values(t, n_tiles, end - pos, hp, buf.vbf.data());
    for (int i = 0; i < a.n_tokens; ++i) {
      const int seen = std::min(a.pos_end, a.last_pos[i] + 1) - pos;
      const int mine = seen <= 0 ? 0 : std::min(n_tiles, (seen + kTile - 1) / kTile);
      for (int x = 0; x < mine; ++x) {
        t[x].nvalid = std::min(seen - x * kTile, kTile);
        t[x].valid = static_cast<__mmask16>((1u << t[x].nvalid) - 1);
      }
      for (int j = 0; j < a.group; ++j) {
        const int r = i * a.group + j;
        if (mine == 0) {
          _mm512_store_si512(pbuf + 64 * r, _mm512_setzero_si512());
          _mm512_store_si512(pbuf + 64 * r + 32, _mm512_setzero_si512());
        } else {
          const int32_t* dots[kQuad];
          for (int x = 0; x < kQuad; ++x) dots[x] = slot(n + x) + 16 * r;
          const int row = a.q_row0 + i * a.q_token_stride + j;
          AmxRowWeights(t, mine, dots, prep.code_scale[row], prep.code_sum[row],
                        a.partials + static_cast<size_t>(r) * pf, o_rows + static_cast<size_t>(r) * hp, hp,
                        scratch + r, pbuf + 64 * r);
        }
        // A block of 16 rows with all its weights: its values now, so
        // that the tile unit runs them while the vector units compute the
        // next block's weights (after all rows, the two did not overlap).
        if (r % 16 == 15 || r == n_rows - 1) AmxRowValues(r - r % 16, pbuf, buf.vbf.data(), o_rows, hp);
      }
    }
    pos += n_tiles * kTile;
    n += n_tiles;
  }
  // o from the tile sums, d from its lanes.
  for (int r = 0; r < n_rows; ++r) {
    const Partial part(a.partials + static_cast<size_t>(r) * pf, hp);
    std::memcpy(part.o(), o_rows + static_cast<size_t>(r) * hp, static_cast<size_t>(hp) * sizeof(float));
    part.d() = _mm512_reduce_add_ps(_mm512_loadu_ps(scratch[r].dvec));
  }
}

template <bool kInt8, bool kAmx = false>
ELLM_TARGET void AttendChunk(const ChunkArgs& a) {
  const int hp = a.kv.format.padded_dim, pf = PartialFloats(hp);
  // amx: a ring of kAmxRing tiles' scores ([n_tokens][group][16] int32 each,
  // 64 KiB of stack at most), the tile unit running kAmxAhead tiles ahead.
  alignas(64) int32_t amx_scores[kAmx ? kAmxRing * kMaxChunkTokens * kAmxMaxGroup * 16 : 1];
  const int amx_slot = a.n_tokens * a.group * 16;  // int32s per ring slot
  const int8_t* amx_q = nullptr;
  int64_t amx_q_token_bytes = 0;
  if constexpr (kAmx) {
    // Per thread, per call: the configuration and the tile code share this
    // function, the barrier keeps the configuration's stores before LDTILECFG.
    const AmxTileConfig cfg = MakeAmxConfig(a.group, hp);
    __asm__ volatile("" ::: "memory");
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
    amx_q = a.q->codes.data() + static_cast<size_t>(a.q_row0) * hp;
    amx_q_token_bytes = static_cast<int64_t>(a.q_token_stride) * hp;
  }
  const QueryPrep& prep = *a.q;
  HeadScratch* scratch = reinterpret_cast<HeadScratch*>(a.scratch);
  const ChunkStart c = StartChunk(a);
  const int end = c.end, prefetch_end = c.prefetch_end;
  // amx: as far ahead of the tile loads, which run kAmxAhead tiles early (a
  // TILELOADD that misses the cache costs far more than vector loads).
  const int dist = c.prefetch_tiles + (kAmx ? kAmxAhead : 0);
  // amx: tile n's scores in ring slot n % kAmxRing, computed kAmxAhead
  // tiles before the step that uses it (a pair uses two).
  int scored = 0;  // tiles of the chunk whose scores have been computed
  // int8 with several items (token, head block) a pair, as in prefill: each
  // item's values (p·V) run after the next item's weights, which do not
  // depend on them, so that out-of-order execution overlaps the one's
  // VPDPBUSDs with the other's softmax step and weight codes (a chain through
  // every head's maximum that p·V would otherwise wait on). The waiting item
  // reads its pair's tiles from the other half of `tiles` (pairs alternate;
  // every pair before c.end has an item, so no pair's tiles are refilled
  // while an item of it waits), or from `first` if it prefetches there (a
  // chunk's first token: the loop below clears the prefetch pointers after
  // it). The arithmetic and its order per item are unchanged. The prefill
  // item bench (one thread, hd 128 / 64): 310 / 236 -> 320 / 249 G
  // multiply-adds/s, with Exp2's degree 3 (about 1% of it).
  TileCtx tiles[2][2], first[2];
  struct Waiting {
    HeadsCtx q{};
    const TileCtx* t = nullptr;
    int tiles = 0, g = 0;
  } waiting;
  const bool pipelined = a.n_tokens * ((a.group + kBlock - 1) / kBlock) > 1;
  const auto values = [&]() ELLM_TARGET __attribute__((always_inline)) {
    if (waiting.t != nullptr) PartForHeads<Part::kInt8Values, kAmx>(waiting.tiles, waiting.g, waiting.t, waiting.q);
    waiting.t = nullptr;
  };
  for (int pos = a.pos_begin, n = 0; pos < end;) {
    TileCtx* t = tiles[(n / 2) % 2];
    // Tiles in pairs while two are left.
    const int n_tiles = pos + kTile < end ? 2 : 1;
    if constexpr (kAmx) {
      for (; scored < n + n_tiles + kAmxAhead && a.pos_begin + scored * kTile < end; ++scored) {
        const int p = a.pos_begin + scored * kTile;
        AmxScores(a.kv.KeyTile(p) + 64, amx_q, amx_q_token_bytes, hp, p, a,
                  amx_scores + scored % kAmxRing * amx_slot);
      }
    }
    for (int x = 0; x < n_tiles; ++x) {
      TileCtx& tx = t[x];
      const int p = pos + x * kTile;
      tx.hp = hp;
      tx.k = a.kv.KeyTile(p);
      tx.v = tx.k + a.kv.value_offset;
      if constexpr (kInt8) {
        tx.k += 64;  // codes after the scale and min line
        tx.v += 64;
      }
      // As far ahead in steps as one tile is in the other kernels.
      const int ahead = p + n_tiles * dist * kTile;
      tx.pk = tx.pv = nullptr;
      if (ahead < prefetch_end) {
        tx.pk = reinterpret_cast<const char*>(a.kv.KeyTile(ahead));
        tx.pv = tx.pk + a.kv.value_offset;
      }
      if constexpr (kInt8) {
        tx.kscale = LoadHalves(tx.k - 64);
        tx.kmin = LoadHalves(tx.k - 32);
        tx.vscale = LoadHalves(tx.v - 64);
        tx.vbias = _mm512_fmadd_ps(tx.vscale, _mm512_set1_ps(128.0f), LoadHalves(tx.v - 32));
      }
      if constexpr (kAmx) {
        // The VNNI score loop spreads these over its steps; here the tile unit
        // computes the scores, so the tile's prefetches are issued at once.
        for (int l = 0; l <= hp / 4; ++l) PrefetchLine(tx, l);
      }
    }
    for (int i = 0; i < a.n_tokens; ++i) {
      const int seen = std::min(a.pos_end, a.last_pos[i] + 1) - pos;
      if (seen <= 0) continue;
      // A token that sees only the first tile of a pair takes it alone.
      const int mine = seen > kTile ? n_tiles : 1;
      for (int x = 0; x < mine; ++x) {
        t[x].nvalid = std::min(seen - x * kTile, kTile);
        t[x].valid = static_cast<__mmask16>((1u << t[x].nvalid) - 1);
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
        for (int x = 0; x < 2; ++x) {
          q.scores[x] = kAmx ? amx_scores + (n + x) % kAmxRing * amx_slot + (i * a.group + j0) * 16 : nullptr;
        }
        const int g = std::min(kBlock, a.group - j0);
        if constexpr (kInt8) {
          if (!pipelined) {  // one item a pair (decode): nothing to overlap with
            PartForHeads<Part::kInt8Whole, kAmx>(mine, g, t, q);
            continue;
          }
          // The same item's next weights would rewrite its codes (and may
          // rescale its o): its values go first.
          if (waiting.q.hs == q.hs) values();
          PartForHeads<Part::kInt8Weights, kAmx>(mine, g, t, q);
          values();
          waiting.q = q;
          waiting.tiles = mine;
          waiting.g = g;
          waiting.t = t;
          if (mine == 2 && t[1].pk != nullptr) {
            first[0] = t[0];
            first[1] = t[1];
            waiting.t = first;
          }
        } else {
          PartForHeads<Part::kF16, kAmx>(mine, g, t, q);
        }
      }
      // The later tiles this token prefetched are on their way: the
      // chunk's other tokens need not ask again.
      for (int x = 0; x < mine; ++x) t[x].pk = t[x].pv = nullptr;
    }
    pos += n_tiles * kTile;
    n += n_tiles;
  }
  if constexpr (kInt8) values();
  // Fold the lane sums into d (and, for int8, the V offsets into o).
  for (int i = 0; i < a.n_tokens; ++i) {
    for (int j = 0; j < a.group; ++j) {
      const Partial part(a.partials + static_cast<size_t>(i * a.group + j) * pf, hp);
      const HeadScratch& h = scratch[i * a.group + j];
      part.d() = _mm512_reduce_add_ps(_mm512_loadu_ps(h.dvec));
      if constexpr (kInt8) {
        const __m512 b = _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_loadu_ps(h.bvec)));
        for (int d = 0; d < hp; d += 16) {
          _mm512_storeu_ps(part.o() + d, _mm512_add_ps(_mm512_loadu_ps(part.o() + d), b));
        }
      }
    }
  }
}

}  // namespace

void AttendF16Avx512(const ChunkArgs& args) { AttendChunk<false>(args); }
void AttendInt8Avx512(const ChunkArgs& args) { AttendChunk<true>(args); }

ELLM_AMX_TARGET void AttendInt8Amx(const ChunkArgs& args) {
  if (args.group > kAmxMaxGroup || args.n_tokens > kMaxChunkTokens) {
    AttendChunk<true>(args);  // more heads than tile rows: the VNNI path
    return;
  }
  const int hp = args.kv.format.padded_dim;
  if (args.n_tokens > 1 && hp % 64 == 0 && hp <= kAmxRowsMaxDim) {
    AttendRowsBf16(args);  // prefill
  } else {
    AttendChunk<true, true>(args);
  }
  __asm__ volatile("tilerelease" ::: "memory");
}

}  // namespace ellm::attn::internal
