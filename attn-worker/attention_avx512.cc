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
// AVX-512 intrinsics (_mm512_undefined_*): a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "attn-worker/attention_kernels.h"

#define ELLM_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,bmi,bmi2")))
#define ELLM_INLINE inline __attribute__((always_inline))

namespace ellm::attn::internal {
namespace {

constexpr int kBlock = 8;  // query heads per register block

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
};

// Query heads j0.. of one token: their rows, partials and scratch.
struct HeadsCtx {
  const int8_t* codes;   // head j at codes + j * hp
  const float* scaled;   // head j at scaled + j * hp
  const float* code_scale;
  const int32_t* code_sum;
  float* part;           // head j at part + j * pf
  int pf;
  HeadScratch* hs;       // head j at hs + j
};

ELLM_TARGET ELLM_INLINE int32_t Load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
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

// The online-softmax step of one head over a tile's scores `s` (invalid lanes
// -inf): raises the running max m (rescaling o and the lane sums), adds the
// weights to d's lanes and returns them (0 in invalid lanes).
ELLM_TARGET ELLM_INLINE __m512 SoftmaxStep(__m512 s, __mmask16 valid, float* part, int hp,
                                           HeadScratch* h, bool int8) {
  float& m = part[hp];
  const float tmax = _mm512_reduce_max_ps(s);
  if (tmax > m) {
    if (m != -INFINITY) {
      const __m512 alpha = _mm512_set1_ps(std::exp2(m - tmax));
      for (int i = 0; i < hp; i += 16) {
        _mm512_storeu_ps(part + i, _mm512_mul_ps(_mm512_loadu_ps(part + i), alpha));
      }
      _mm512_storeu_ps(h->dvec, _mm512_mul_ps(_mm512_loadu_ps(h->dvec), alpha));
      if (int8) _mm512_storeu_ps(h->bvec, _mm512_mul_ps(_mm512_loadu_ps(h->bvec), alpha));
    }
    m = tmax;
  }
  const __m512 p = _mm512_maskz_mov_ps(valid, Exp2(_mm512_sub_ps(s, _mm512_set1_ps(m))));
  _mm512_storeu_ps(h->dvec, _mm512_add_ps(_mm512_loadu_ps(h->dvec), p));
  return p;
}

template <int G>
ELLM_TARGET void Int8Tile(const TileCtx& t, const HeadsCtx& q) {
  const int hp = t.hp, n_dq = hp / 4;
  __m512i acc[G];
  for (int j = 0; j < G; ++j) acc[j] = _mm512_setzero_si512();
  if constexpr (G <= 4) {
    // Few heads: two accumulator banks hide VPDPBUSD's latency.
    __m512i acc2[G];
    for (int j = 0; j < G; ++j) acc2[j] = _mm512_setzero_si512();
    for (int dq = 0; dq < n_dq; dq += 2) {
      const __m512i k0 = _mm512_loadu_si512(t.k + 64 * dq);
      const __m512i k1 = _mm512_loadu_si512(t.k + 64 * dq + 64);
      for (int j = 0; j < G; ++j) {
        const int8_t* c = q.codes + j * hp + 4 * dq;
        acc[j] = _mm512_dpbusd_epi32(acc[j], k0, _mm512_set1_epi32(Load32(c)));
        acc2[j] = _mm512_dpbusd_epi32(acc2[j], k1, _mm512_set1_epi32(Load32(c + 4)));
      }
    }
    for (int j = 0; j < G; ++j) acc[j] = _mm512_add_epi32(acc[j], acc2[j]);
  } else {
    for (int dq = 0; dq < n_dq; ++dq) {
      const __m512i k0 = _mm512_loadu_si512(t.k + 64 * dq);
      for (int j = 0; j < G; ++j) {
        acc[j] = _mm512_dpbusd_epi32(acc[j], k0,
                                     _mm512_set1_epi32(Load32(q.codes + j * hp + 4 * dq)));
      }
    }
  }
  float wscale[G];
  for (int j = 0; j < G; ++j) {
    __m512 s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j]), t.kscale,
                               _mm512_mul_ps(t.kmin, _mm512_set1_ps(static_cast<float>(q.code_sum[j]))));
    s = _mm512_mul_ps(s, _mm512_set1_ps(q.code_scale[j]));
    s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), t.valid, s);
    HeadScratch* h = q.hs + j;
    const __m512 p = SoftmaxStep(s, t.valid, q.part + j * q.pf, hp, h, true);
    _mm512_storeu_ps(h->bvec, _mm512_mask3_fmadd_ps(p, t.vbias, _mm512_loadu_ps(h->bvec), t.valid));
    const __m512 w = _mm512_maskz_mul_ps(t.valid, p, t.vscale);
    const float wmax = _mm512_reduce_max_ps(w);
    const float inv = wmax > 0 ? 255.0f / wmax : 0.0f;
    const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(w, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h->w), _mm512_cvtepi32_epi8(codes));
    wscale[j] = wmax * (1.0f / 255.0f);
  }
  for (int dg = 0; dg < hp / 16; ++dg) {
    __m512i va[G];
    for (int j = 0; j < G; ++j) va[j] = _mm512_setzero_si512();
    for (int quad = 0; quad < 4; ++quad) {
      const __m512i v = _mm512_loadu_si512(t.v + 64 * (4 * dg + quad));
      for (int j = 0; j < G; ++j) {
        const uint8_t* w = reinterpret_cast<const uint8_t*>(q.hs[j].w) + 4 * quad;
        va[j] = _mm512_dpbusd_epi32(va[j], _mm512_set1_epi32(Load32(w)), v);
      }
    }
    for (int j = 0; j < G; ++j) {
      float* o = q.part + j * q.pf + 16 * dg;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(va[j]), _mm512_set1_ps(wscale[j]),
                                          _mm512_loadu_ps(o)));
    }
  }
}

template <int G>
ELLM_TARGET void F16Tile(const TileCtx& t, const HeadsCtx& q) {
  const int hp = t.hp;
  // Scores: lane = position; two banks when the heads alone cannot cover the
  // FMA latency.
  constexpr int kBanks = G <= 4 ? 2 : 1;
  __m512 acc[kBanks][G];
  for (int b = 0; b < kBanks; ++b) {
    for (int j = 0; j < G; ++j) acc[b][j] = _mm512_setzero_ps();
  }
  for (int d = 0; d < hp; d += kBanks) {
    for (int b = 0; b < kBanks; ++b) {
      const __m512 k = LoadHalves(t.k + 32 * (d + b));
      for (int j = 0; j < G; ++j) {
        acc[b][j] = _mm512_fmadd_ps(k, _mm512_set1_ps(q.scaled[j * hp + d + b]), acc[b][j]);
      }
    }
  }
  for (int j = 0; j < G; ++j) {
    __m512 s = kBanks == 2 ? _mm512_add_ps(acc[0][j], acc[kBanks - 1][j]) : acc[0][j];
    s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), t.valid, s);
    HeadScratch* h = q.hs + j;
    _mm512_storeu_ps(h->w, SoftmaxStep(s, t.valid, q.part + j * q.pf, hp, h, false));
  }
  // p·V over the rows this token sees.
  for (int db = 0; db < hp / 16; ++db) {
    __m512 va[kBanks][G];
    for (int b = 0; b < kBanks; ++b) {
      for (int j = 0; j < G; ++j) va[b][j] = _mm512_setzero_ps();
    }
    const uint8_t* vcol = t.v + 32 * db;
    int r = 0;
    if constexpr (kBanks == 2) {
      for (; r + 2 <= t.nvalid; r += 2) {
        const __m512 v0 = LoadHalves(vcol + 2 * r * hp);
        const __m512 v1 = LoadHalves(vcol + 2 * (r + 1) * hp);
        for (int j = 0; j < G; ++j) {
          va[0][j] = _mm512_fmadd_ps(v0, _mm512_set1_ps(q.hs[j].w[r]), va[0][j]);
          va[1][j] = _mm512_fmadd_ps(v1, _mm512_set1_ps(q.hs[j].w[r + 1]), va[1][j]);
        }
      }
    }
    for (; r < t.nvalid; ++r) {
      const __m512 v0 = LoadHalves(vcol + 2 * r * hp);
      for (int j = 0; j < G; ++j) va[0][j] = _mm512_fmadd_ps(v0, _mm512_set1_ps(q.hs[j].w[r]), va[0][j]);
    }
    for (int j = 0; j < G; ++j) {
      float* o = q.part + j * q.pf + 16 * db;
      __m512 sum = kBanks == 2 ? _mm512_add_ps(va[0][j], va[kBanks - 1][j]) : va[0][j];
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), sum));
    }
  }
}

template <bool kInt8, int G>
ELLM_TARGET ELLM_INLINE void RunTile(const TileCtx& t, const HeadsCtx& q) {
  if constexpr (kInt8) {
    Int8Tile<G>(t, q);
  } else {
    F16Tile<G>(t, q);
  }
}

template <bool kInt8>
ELLM_TARGET void TileForHeads(int g, const TileCtx& t, const HeadsCtx& q) {
  switch (g) {
    case 1: RunTile<kInt8, 1>(t, q); break;
    case 2: RunTile<kInt8, 2>(t, q); break;
    case 3: RunTile<kInt8, 3>(t, q); break;
    case 4: RunTile<kInt8, 4>(t, q); break;
    case 5: RunTile<kInt8, 5>(t, q); break;
    case 6: RunTile<kInt8, 6>(t, q); break;
    case 7: RunTile<kInt8, 7>(t, q); break;
    default: RunTile<kInt8, 8>(t, q); break;
  }
}

template <bool kInt8>
ELLM_TARGET void AttendChunk(const ChunkArgs& a) {
  const int hp = a.kv.format.padded_dim, pf = PartialFloats(hp);
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
  TileCtx t;
  t.hp = hp;
  for (int pos = a.pos_begin; pos < end; pos += kTile) {
    t.k = a.kv.KeyTile(pos);
    t.v = t.k + a.kv.value_offset;
    if constexpr (kInt8) {
      t.kscale = LoadHalves(t.k + 16 * hp);
      t.kmin = LoadHalves(t.k + 16 * hp + 32);
      t.vscale = LoadHalves(t.v + 16 * hp);
      t.vbias = _mm512_fmadd_ps(t.vscale, _mm512_set1_ps(128.0f), LoadHalves(t.v + 16 * hp + 32));
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
        TileForHeads<kInt8>(std::min(kBlock, a.group - j0), t, q);
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

}  // namespace ellm::attn::internal
