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
// line the tile occupies.

// GCC 12 warns about the deliberately undefined pass-through operand of the
// AVX-512 intrinsics (_mm512_undefined_*, e.g. in _mm512_reduce_max_ps): a
// known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "attn-worker/attention_kernels.h"

#define ELLM_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,bmi,bmi2")))
#define ELLM_INLINE inline __attribute__((always_inline))
// The AMX entry point. The tile instructions themselves are written as inline
// assembly (volatile, with memory operands or clobbers), not GCC 12's AMX
// intrinsics: those are asm statements that do not tell the compiler which
// memory they read or write, and GCC 12 has a known bug that can drop the tile
// configuration load (see DESIGN.md "Build facts"). The configuration load and
// every tile instruction sit in one function, AttendChunk<true, true>.
#define ELLM_AMX_TARGET                                                                        \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c," \
                        "fma,bmi,bmi2")))

namespace ellm::attn::internal {
namespace {

constexpr int kBlock = 8;  // query heads per register block

// Software prefetch. The kernels consume a tile right after loading it, so
// out-of-order execution alone cannot keep enough misses in flight, and the
// hardware streamer runs too short a distance ahead at this consumption rate
// (measured: 55-60% of the read probe without, 80-88% with). One line of the
// tile about kPrefetchBytes ahead in each of the K and V streams is prefetched
// per step of the score loop, spread out so the fill buffers stay busy
// without a burst that stalls the pipeline.
constexpr int64_t kPrefetchBytes = 2048;

// Per (token, query head) scratch of a chunk (64 floats, see ChunkScratchFloats).
struct HeadScratch {
  float dvec[16];  // lanes of d (summed at the end of the chunk)
  float bvec[16];  // int8: lanes of sum p_t * bias_t
  float w[16];     // f16: the tile's weights p; int8: 16 u8 weight codes
  float pad[16];
};
static_assert(sizeof(HeadScratch) == 64 * sizeof(float));

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
  const int32_t* scores;  // amx: head j's 16 integer dot products at scores + 16 * j
};

ELLM_TARGET ELLM_INLINE int32_t Load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// acc += u8 x s8 products of `a` and the 4 bytes at `b4` broadcast to every
// lane, as one instruction with an embedded broadcast (GCC 12 does not fold
// the broadcast into VPDPBUSD by itself).
ELLM_TARGET ELLM_INLINE __m512i DpbusdBcast(__m512i acc, __m512i a, const void* b4) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*static_cast<const int32_t*>(b4)));
  return acc;
}

ELLM_TARGET ELLM_INLINE __m512 LoadHalves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 2^x for x <= 0 (lanes below -126 give ~0): round-to-nearest split, Taylor
// polynomial of degree 6 on [-0.5, 0.5] (relative error 1.2e-7), VSCALEFPS.
ELLM_TARGET ELLM_INLINE __m512 Exp2(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Raises the running max of the heads whose tile scores s[j] exceed it:
// m_j = max(m_j, max s[j]), rescaling o, the lane sums of d and (int8) of
// the V offsets by 2^(m_old - m_new). Off the hot path: once a sequence's
// leading scores have been seen, a tile rarely holds a new maximum.
template <int G>
ELLM_TARGET __attribute__((noinline)) void RaiseMax(const __m512* s, float* part, int pf, int hp,
                                                    HeadScratch* hs, bool int8) {
  for (int j = 0; j < G; ++j) {
    float* pj = part + j * pf;
    const float m = pj[hp], tmax = _mm512_reduce_max_ps(s[j]);
    if (!(tmax > m)) continue;
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

// The online-softmax step of G heads over a tile's scores s[j] (invalid
// lanes -inf): raises the running maxima where needed, then turns s[j] into
// the weights p = 2^(s - m) (0 in invalid lanes) and adds them to d's lanes.
template <int G>
ELLM_TARGET ELLM_INLINE void SoftmaxStep(__m512* s, __mmask16 valid, float* part, int pf, int hp,
                                         HeadScratch* hs, bool int8) {
  __mmask16 over = 0;
  for (int j = 0; j < G; ++j) {
    over |= _mm512_cmp_ps_mask(s[j], _mm512_set1_ps(part[j * pf + hp]), _CMP_GT_OQ);
  }
  if (over) RaiseMax<G>(s, part, pf, hp, hs, int8);
  for (int j = 0; j < G; ++j) {
    s[j] = _mm512_maskz_mov_ps(valid, Exp2(_mm512_sub_ps(s[j], _mm512_set1_ps(part[j * pf + hp]))));
    _mm512_storeu_ps(hs[j].dvec, _mm512_add_ps(_mm512_loadu_ps(hs[j].dvec), s[j]));
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

// o[16 dg .. 16 (dg + D)) of G heads += wscale * sum over the tile's 16
// positions of weight code x V code.
template <int G, int D>
ELLM_TARGET ELLM_INLINE void VTile(const uint8_t* v, int dg, const HeadsCtx& q, const float* wscale) {
  __m512i va[D][G];
  for (int b = 0; b < D; ++b) {
    for (int j = 0; j < G; ++j) va[b][j] = _mm512_setzero_si512();
  }
  for (int quad = 0; quad < 4; ++quad) {
    for (int j = 0; j < G; ++j) {
      const __m512i w = _mm512_set1_epi32(Load32(reinterpret_cast<const uint8_t*>(q.hs[j].w) + 4 * quad));
      for (int b = 0; b < D; ++b) {
        va[b][j] = _mm512_dpbusd_epi32(va[b][j], w, _mm512_loadu_si512(v + 64 * (4 * (dg + b) + quad)));
      }
    }
  }
  for (int b = 0; b < D; ++b) {
    for (int j = 0; j < G; ++j) {
      float* o = q.part + j * q.pf + 16 * (dg + b);
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(va[b][j]), _mm512_set1_ps(wscale[MaxLane(j)]),
                                          _mm512_loadu_ps(o)));
    }
  }
}

template <int G, bool kAmx>
ELLM_TARGET void Int8Tile(const TileCtx& t, const HeadsCtx& q) {
  const int hp = t.hp, n_dq = hp / 4;  // n_dq is a multiple of 4
  __m512i acc[G];
  if constexpr (kAmx) {
    // The dot products came from the tile unit (AttendChunk<true, true>).
    for (int j = 0; j < G; ++j) acc[j] = _mm512_load_si512(q.scores + 16 * j);
  } else {
    // Two accumulator banks (even and odd 4-dim groups) hide VPDPBUSD's latency.
    __m512i acc2[G];
    for (int j = 0; j < G; ++j) acc[j] = acc2[j] = _mm512_setzero_si512();
    for (int dq = 0; dq < n_dq; dq += 2) {
      PrefetchLine(t, dq);
      PrefetchLine(t, dq + 1);
      const __m512i k0 = _mm512_loadu_si512(t.k + 64 * dq);
      const __m512i k1 = _mm512_loadu_si512(t.k + 64 * dq + 64);
      for (int j = 0; j < G; ++j) {
        const int8_t* c = q.codes + j * hp + 4 * dq;
        acc[j] = DpbusdBcast(acc[j], k0, c);
        acc2[j] = DpbusdBcast(acc2[j], k1, c + 4);
      }
    }
    for (int j = 0; j < G; ++j) acc[j] = _mm512_add_epi32(acc[j], acc2[j]);
    PrefetchLine(t, n_dq);  // a tile is n_dq + 1 lines: scales first
  }
  // Scores: s = code_scale * (kscale * dot + kmin * code_sum).
  __m512 s[G];
  for (int j = 0; j < G; ++j) {
    s[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j]), t.kscale,
                           _mm512_mul_ps(t.kmin, _mm512_set1_ps(static_cast<float>(q.code_sum[j]))));
    s[j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), t.valid, s[j],
                              _mm512_set1_ps(q.code_scale[j]));
  }
  SoftmaxStep<G>(s, t.valid, q.part, q.pf, hp, q.hs, true);
  // Weights w = p * vscale, as u8 codes against each head's tile maximum.
  for (int j = 0; j < G; ++j) {
    HeadScratch* h = q.hs + j;
    _mm512_storeu_ps(h->bvec, _mm512_mask3_fmadd_ps(s[j], t.vbias, _mm512_loadu_ps(h->bvec), t.valid));
    s[j] = _mm512_maskz_mul_ps(t.valid, s[j], t.vscale);
  }
  const __m512 wmax = MaxEach<G>(s);
  alignas(64) float inv[16], wscale[16];
  _mm512_store_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(wmax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                           _mm512_set1_ps(255.0f), wmax));
  _mm512_store_ps(wscale, _mm512_mul_ps(wmax, _mm512_set1_ps(1.0f / 255.0f)));
  for (int j = 0; j < G; ++j) {
    const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(s[j], _mm512_set1_ps(inv[MaxLane(j)])));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.hs[j].w), _mm512_cvtepi32_epi8(codes));
  }
  // p·V: kDg groups of 16 dims at a time, so that each head's broadcast
  // weight codes serve kDg VPDPBUSDs (V lines come from L1 as memory operands).
  constexpr int kDg = G <= 4 ? 4 : 2;
  const int n_dg = hp / 16;
  int dg = 0;
  for (; dg + kDg <= n_dg; dg += kDg) VTile<G, kDg>(t.v, dg, q, wscale);
  for (; dg < n_dg; ++dg) VTile<G, 1>(t.v, dg, q, wscale);
}

template <int G>
ELLM_TARGET void F16Tile(const TileCtx& t, const HeadsCtx& q) {
  const int hp = t.hp;
  // Scores, lane = position. Two banks (even and odd dims) give 2G
  // independent FMA chains, enough to cover the FMA latency at 2 per cycle.
  __m512 acc[2][G];
  for (int j = 0; j < G; ++j) acc[0][j] = acc[1][j] = _mm512_setzero_ps();
  for (int d = 0; d < hp; d += 2) {
    PrefetchLine(t, d / 2);  // a tile is hp / 2 lines
    for (int b = 0; b < 2; ++b) {
      const __m512 k = LoadHalves(t.k + 32 * (d + b));
      for (int j = 0; j < G; ++j) {
        acc[b][j] = _mm512_fmadd_ps(k, _mm512_set1_ps(q.scaled[j * hp + d + b]), acc[b][j]);
      }
    }
  }
  __m512 s[G];
  for (int j = 0; j < G; ++j) {
    s[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), t.valid, _mm512_add_ps(acc[0][j], acc[1][j]));
  }
  SoftmaxStep<G>(s, t.valid, q.part, q.pf, hp, q.hs, false);
  for (int j = 0; j < G; ++j) _mm512_storeu_ps(q.hs[j].w, s[j]);
  // p·V over the rows this token sees.
  // Rows past the token's last position may hold anything (even NaN bits):
  // they are skipped, not multiplied by zero.
  for (int db = 0; db < hp / 16; ++db) {
    __m512 va[2][G];
    for (int j = 0; j < G; ++j) va[0][j] = va[1][j] = _mm512_setzero_ps();
    const uint8_t* vcol = t.v + 32 * db;
    int r = 0;
    for (; r + 2 <= t.nvalid; r += 2) {
      const __m512 v0 = LoadHalves(vcol + 2 * r * hp);
      const __m512 v1 = LoadHalves(vcol + 2 * (r + 1) * hp);
      for (int j = 0; j < G; ++j) {
        va[0][j] = _mm512_fmadd_ps(v0, _mm512_set1_ps(q.hs[j].w[r]), va[0][j]);
        va[1][j] = _mm512_fmadd_ps(v1, _mm512_set1_ps(q.hs[j].w[r + 1]), va[1][j]);
      }
    }
    if (r < t.nvalid) {
      const __m512 v0 = LoadHalves(vcol + 2 * r * hp);
      for (int j = 0; j < G; ++j) va[0][j] = _mm512_fmadd_ps(v0, _mm512_set1_ps(q.hs[j].w[r]), va[0][j]);
    }
    for (int j = 0; j < G; ++j) {
      float* o = q.part + j * q.pf + 16 * db;
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_add_ps(va[0][j], va[1][j])));
    }
  }
}

template <bool kInt8, int G, bool kAmx>
ELLM_TARGET ELLM_INLINE void RunTile(const TileCtx& t, const HeadsCtx& q) {
  if constexpr (kInt8) {
    Int8Tile<G, kAmx>(t, q);
  } else {
    F16Tile<G>(t, q);
  }
}

template <bool kInt8, bool kAmx>
ELLM_TARGET void TileForHeads(int g, const TileCtx& t, const HeadsCtx& q) {
  switch (g) {
    case 1: RunTile<kInt8, 1, kAmx>(t, q); break;
    case 2: RunTile<kInt8, 2, kAmx>(t, q); break;
    case 3: RunTile<kInt8, 3, kAmx>(t, q); break;
    case 4: RunTile<kInt8, 4, kAmx>(t, q); break;
    case 5: RunTile<kInt8, 5, kAmx>(t, q); break;
    case 6: RunTile<kInt8, 6, kAmx>(t, q); break;
    case 7: RunTile<kInt8, 7, kAmx>(t, q); break;
    default: RunTile<kInt8, 8, kAmx>(t, q); break;
  }
}

// AMX (int8 only): the tile configuration, and the scores of one tile of 16
// positions for every token that sees it, all heads of the group at once:
// C[head][position] += sum_d A[head][d] * B[d / 4][4 * position + d % 4] with
// TDPBSUD, A = the query codes (s8, one row of hp bytes per head), B = the K
// tile's codes as stored (u8, one 64-byte line per 4 dims = VNNI format).
// Tiles: tmm0 C (G rows x 64 bytes), tmm1 / tmm2 A / B for 64 dims, tmm3 /
// tmm4 A / B for the last hp % 64 dims.
struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(AmxConfig) == 64);

constexpr int kAmxMaxGroup = 16;  // rows of a tile
// Scores are computed kAmxAhead tiles ahead of their use (a ring of kAmxRing
// buffers), so that the vector loads of a tile's scores never issue before
// the tile store that writes them.
constexpr int kAmxAhead = 2, kAmxRing = 4;

AmxConfig MakeAmxConfig(int group, int hp) {
  AmxConfig c;
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
    const AmxConfig cfg = MakeAmxConfig(a.group, hp);
    __asm__ volatile("" ::: "memory");
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
    amx_q = a.q->codes.data() + static_cast<size_t>(a.q_row0) * hp;
    amx_q_token_bytes = static_cast<int64_t>(a.q_token_stride) * hp;
  }
  const QueryPrep& prep = *a.q;
  HeadScratch* scratch = reinterpret_cast<HeadScratch*>(a.scratch);
  int end = a.pos_begin;
  for (int i = 0; i < a.n_tokens; ++i) {
    end = std::max(end, std::min(a.pos_end, a.last_pos[i] + 1));
    for (int j = 0; j < a.group; ++j) {
      Partial(a.partials + static_cast<size_t>(i * a.group + j) * pf, hp).Clear();
      std::memset(&scratch[i * a.group + j], 0, sizeof(HeadScratch));
    }
  }
  // Prefetching may run on into the caller's next chunk (see ChunkArgs).
  const int prefetch_end = std::max(end, std::min(a.kv.length, a.prefetch_end));
  TileCtx t;
  t.hp = hp;
  // Prefetch distance: the tile about kPrefetchBytes ahead in each stream.
  const int dist = std::max<int>(
      1, static_cast<int>((kPrefetchBytes + a.kv.format.tile_bytes / 2) / a.kv.format.tile_bytes)) +
      // amx: as far ahead of the tile loads, which run kAmxAhead tiles early
      // (a TILELOADD that misses the cache costs far more than vector loads).
      (kAmx ? kAmxAhead : 0);
  constexpr int ahead = kAmxAhead;
  if constexpr (kAmx) {
    for (int n = 0; n < ahead && a.pos_begin + n * kTile < end; ++n) {
      const int p = a.pos_begin + n * kTile;
      AmxScores(a.kv.KeyTile(p) + 64, amx_q, amx_q_token_bytes, hp, p, a, amx_scores + n * amx_slot);
    }
  }
  int slot = 0;
  for (int pos = a.pos_begin, n = 0; pos < end; pos += kTile, ++n) {
    if constexpr (kAmx) {
      slot = n % kAmxRing * amx_slot;
      const int p = pos + ahead * kTile;
      if (p < end) {
        AmxScores(a.kv.KeyTile(p) + 64, amx_q, amx_q_token_bytes, hp, p, a,
                  amx_scores + (n + ahead) % kAmxRing * amx_slot);
      }
    }
    t.k = a.kv.KeyTile(pos);
    t.v = t.k + a.kv.value_offset;
    if constexpr (kInt8) {
      t.k += 64;  // codes after the scale and min line
      t.v += 64;
    }
    t.pk = t.pv = nullptr;
    if (pos + dist * kTile < prefetch_end) {
      t.pk = reinterpret_cast<const char*>(a.kv.KeyTile(pos + dist * kTile));
      t.pv = t.pk + a.kv.value_offset;
    }
    if constexpr (kInt8) {
      t.kscale = LoadHalves(t.k - 64);
      t.kmin = LoadHalves(t.k - 32);
      t.vscale = LoadHalves(t.v - 64);
      t.vbias = _mm512_fmadd_ps(t.vscale, _mm512_set1_ps(128.0f), LoadHalves(t.v - 32));
    }
    if constexpr (kAmx) {
      // The VNNI score loop spreads these over its steps; here the tile unit
      // computes the scores, so the tile's prefetches are issued at once.
      for (int l = 0; l <= hp / 4; ++l) PrefetchLine(t, l);
    }
    for (int i = 0; i < a.n_tokens; ++i) {
      const int seen = std::min(a.pos_end, a.last_pos[i] + 1) - pos;
      if (seen <= 0) continue;
      t.nvalid = std::min(seen, kTile);
      t.valid = static_cast<__mmask16>((1u << t.nvalid) - 1);
      for (int j0 = 0; j0 < a.group; j0 += kBlock) {
        const int row = a.q_row0 + i * a.q_token_stride + j0;
        HeadsCtx q;
        q.codes = prep.codes.data() + static_cast<size_t>(row) * hp;
        q.scaled = prep.scaled.data() + static_cast<size_t>(row) * hp;
        q.code_scale = prep.code_scale.data() + row;
        q.code_sum = prep.code_sum.data() + row;
        q.part = a.partials + static_cast<size_t>(i * a.group + j0) * pf;
        q.pf = pf;
        q.hs = scratch + i * a.group + j0;
        q.scores = kAmx ? amx_scores + slot + (i * a.group + j0) * 16 : nullptr;
        TileForHeads<kInt8, kAmx>(std::min(kBlock, a.group - j0), t, q);
      }
    }
  }
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
  AttendChunk<true, true>(args);
  __asm__ volatile("tilerelease" ::: "memory");
}

}  // namespace ellm::attn::internal
