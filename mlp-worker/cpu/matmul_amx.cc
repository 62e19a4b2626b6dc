// AMX matrix kernels (AMX-TILE + AMX-BF16, with AVX-512 and AVX512-BF16 for
// the conversions). The "amx" kernel set is avx512 except for the block
// types (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) on steps of at least kAmxMinTokens
// tokens (prefill), which run on the tile unit in bfloat16 with fp32 sums:
//
//   y[t][r] = sum_k bf16(x[t][k]) * bf16(w[r][k]),  w = the dequantised weight
//
// with TDPBF16PS on tiles of 16 tokens x 16 rows x 32 columns: A = the
// tokens' bf16 activations (Activations::bf16, one 64-byte row per token and
// block), B = the group's block dequantised once into the VNNI pair layout
// (row k2 = [16 r][2 j]: elements 2 k2 + j), C = the fp32 sums, carried in
// the tile across all blocks of a chunk of kChunkBlocks and in y between
// chunks. w is the reference dequantisation's fp32 value (BlockSource);
// both operands are then rounded to bfloat16 (8 bits of mantissa, nearest
// even), and the products
// (exact in fp32) are summed in fp32 by the tile unit. So the results differ
// from avx512's (int8 activation codes per block) by rounding, and the
// same token gives a slightly different y in a step of 16 tokens or more than
// in a smaller one; within either kind, a token's y depends neither on the
// other tokens nor on the thread count.
//
// Why bf16 and not int8 (TDPBSUD): Q8_0 scales every block of 32 by its own
// activation and weight scales, so int8 sums cannot run across blocks; each
// 16 x 16 x 32 product then needed a tile store and 16 rows of vector
// conversion, and on a Xeon (family 6 model 207) that ran no faster than
// avx512's VPDPBUSD (ellm-bench prefill on 2 threads: 312-317 against 326-335
// G multiply-adds/s). In bf16 the scales are folded into the operands and the
// sums stay in the tile.
//
// Order of work per kernel call (a range of groups): chunks of kChunkBlocks
// blocks (1024 columns) outside, so the chunk's activations (T x 2 KiB) stay
// in L2 while every group of the range uses them; per pair of groups the
// chunk's weights, dequantised into 2 x 32 KiB, serve every token tile,
// two token tiles at a time (2 x 2 C tiles), while the vector units
// dequantise the next pair's, a line of each group per block step (two
// buffers). Measured on 5120 x 5120 at T = 256, 1 thread, Xeon family 6
// model 207, one group at a time: 0.52-0.55 of avx512's time; chunks of 16
// or 8 blocks, 0.55-0.70. Pairs of groups (ellm-bench prefill, README
// benchmark model, 4096 tokens, 2 threads, alternating with one group at a
// time): matrix work 676-749 against 586-642 G multiply-adds/s (1.12-1.21x);
// chunks of 16 blocks then ran no faster than single groups, chunks of 64
// within the noise of 32, and prefetching the next A tiles slower.
//
// The tile instructions are inline assembly in the one function that loads
// the tile configuration (DESIGN.md "Build facts": GCC 12 can drop a
// configuration load that intrinsics leave unconnected to the tile code).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "core/amx.h"
#include "mlp-worker/cpu/matmul_layout.h"

#define ELLM_AVX512_BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")))
#define ELLM_INLINE inline __attribute__((always_inline))
#define ELLM_AMX_TARGET                                                                     \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16," \
                        "f16c,fma")))

namespace ellm::mlp::internal {

ELLM_AVX512_BF16_TARGET void ToBf16TileRowAvx512(const float* x, int64_t nb, uint16_t* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 32 * b + 16), _mm512_loadu_ps(x + 32 * b));
    std::memcpy(out + 512 * b, &h, 64);
  }
}

namespace {

constexpr int kTileTokens = 16;   // rows of A and C
constexpr int kChunkBlocks = 32;  // blocks of 32 columns per chunk
constexpr int kBlockBytes = 1024;  // one block of a group as a bf16 B tile

// Tiles: tmm0-tmm3 C, tile (x, y) = tmm(x + 2 y) for token tile x and group
// y of a pair of each; tmm4, tmm5 A of the two token tiles; tmm6, tmm7 B of
// the two groups. n: rows of C and A (16, or the last token tile's).
AmxTileConfig MakeConfig(int n) {
  AmxTileConfig c;
  for (int i = 0; i < 6; ++i) {
    c.rows[i] = static_cast<uint8_t>(n);
    c.colsb[i] = 64;
  }
  for (int i : {6, 7}) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  return c;
}

// The permutes of the dequantiser (below): kSpread[q] spreads rows 4q..4q+3
// of a 16-row vector over (r, j) lanes; kAmxEvenOddDwords[p] (core/amx.h)
// gathers the pairs p.
alignas(64) constexpr int32_t kSpread[4][16] = {
    {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
    {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
    {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11},
    {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}};
// (Row r = 4q + rr: dword (q < 2 ? 0 : 16) + 8 (q % 2) + 2 rr + p.)

// The 16 rows' scale and offset of one block of 32 columns (x = scale *
// level + offset), for its first and its second 16 columns (the same but for
// Q6_K), and the 64 levels (u8, [16 r][4 j]) of its virtual line v (elements
// 4v + j), for each block type in its repacked layout (matmul_layout.h). The
// arithmetic is the reference dequantisation's (matmul.cc Dequant*): the
// products are exact in fp32 and FMA rounds once, as it does.
template <DType kType>
struct BlockSource;

// Q8_0: level = code + 128, x = d level - 128 d.
template <>
struct BlockSource<DType::kQ8_0> {
  static constexpr int kQuant = 512, kMeta = 32, kSuper = 1;  // per block of kSuper x 32
  ELLM_AVX512_BF16_TARGET ELLM_INLINE static void Scales(const uint8_t*, const uint8_t* meta, int,
                                                         __m512 scale[2], __m512 offset[2]) {
    scale[0] = scale[1] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta)));
    offset[0] = offset[1] = _mm512_mul_ps(scale[0], _mm512_set1_ps(-128.0f));
  }
  ELLM_AVX512_BF16_TARGET ELLM_INLINE static __m512i Levels(const uint8_t* quant, int, int v) {
    return _mm512_load_si512(quant + 64 * v);
  }
};

// Nibble lines (Q4_0, Q4_K, Q5_K): line v % 4, low nibble for v < 4.
ELLM_AVX512_BF16_TARGET ELLM_INLINE __m512i Nibbles(const uint8_t* lines, int v) {
  const __m512i line = _mm512_load_si512(lines + 64 * (v % 4));
  return _mm512_and_si512(v < 4 ? line : _mm512_srli_epi16(line, 4), _mm512_set1_epi8(0x0F));
}

// Q4_0: x = d level - 8 d.
template <>
struct BlockSource<DType::kQ4_0> {
  static constexpr int kQuant = 256, kMeta = 32, kSuper = 1;
  ELLM_AVX512_BF16_TARGET ELLM_INLINE static void Scales(const uint8_t*, const uint8_t* meta, int,
                                                         __m512 scale[2], __m512 offset[2]) {
    scale[0] = scale[1] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta)));
    offset[0] = offset[1] = _mm512_mul_ps(scale[0], _mm512_set1_ps(-8.0f));
  }
  ELLM_AVX512_BF16_TARGET ELLM_INLINE static __m512i Levels(const uint8_t* quant, int, int v) {
    return Nibbles(quant, v);
  }
};

// Q4_K, Q5_K (kFive): sub-block s of the super-block; x = (d sc) level - dmin m.
template <bool kFive>
struct BlockSourceK4 {
  static constexpr int kQuant = kFive ? 2560 : 2048, kMeta = 320, kSuper = 8;
  ELLM_AVX512_BF16_TARGET ELLM_INLINE static void Scales(const uint8_t*, const uint8_t* meta, int s,
                                                         __m512 scale[2], __m512 offset[2]) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 32)));
    const __m512 sc = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 64 + 16 * s))));
    // m[s / 2][16 r][2 h], h = s % 2.
    const __m512i mm = _mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 192 + 32 * (s / 2))));
    const __m512i m = s % 2 ? _mm512_srli_epi32(mm, 8) : _mm512_and_si512(mm, _mm512_set1_epi32(0xFF));
    scale[0] = scale[1] = _mm512_mul_ps(d, sc);
    offset[0] = offset[1] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m)));
  }
  ELLM_AVX512_BF16_TARGET ELLM_INLINE static __m512i Levels(const uint8_t* quant, int s, int v) {
    __m512i level = Nibbles(quant + 256 * s, v);
    if constexpr (kFive) {  // bit v of qh byte (s, r, j) is the level's bit 4
      const __m512i qh = _mm512_load_si512(quant + 2048 + 64 * s);
      const __m512i bit = _mm512_and_si512(_mm512_srli_epi16(qh, v), _mm512_set1_epi8(1));
      level = _mm512_or_si512(level, _mm512_slli_epi16(bit, 4));
    }
    return level;
  }
};
template <>
struct BlockSource<DType::kQ4_K> : BlockSourceK4<false> {};
template <>
struct BlockSource<DType::kQ5_K> : BlockSourceK4<true> {};

// Q6_K: 32-block s covers 16-sub-blocks 2s (v < 4) and 2s + 1;
// x = (d sc) level - 32 (d sc).
template <>
struct BlockSource<DType::kQ6_K> {
  static constexpr int kQuant = 3072, kMeta = 288, kSuper = 8;
  ELLM_AVX512_BF16_TARGET ELLM_INLINE static void Scales(const uint8_t*, const uint8_t* meta, int s,
                                                         __m512 scale[2], __m512 offset[2]) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta)));
    // sc[s][16 r][2 h] int8 at 32: each row's pair as one int16.
    const __m512i pair = _mm512_cvtepi16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 32 + 32 * s)));
    const __m512i sc0 = _mm512_srai_epi32(_mm512_slli_epi32(pair, 24), 24);
    const __m512i sc1 = _mm512_srai_epi32(pair, 8);
    scale[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc0));
    scale[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc1));
    for (int h = 0; h < 2; ++h) offset[h] = _mm512_mul_ps(scale[h], _mm512_set1_ps(-32.0f));
  }
  ELLM_AVX512_BF16_TARGET ELLM_INLINE static __m512i Levels(const uint8_t* quant, int s, int v) {
    const int half = v / 4, k = v % 4;
    const __m512i ql = _mm512_load_si512(quant + 256 * s + 64 * k);
    const __m512i lo = _mm512_and_si512(half ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(0x0F));
    const __m512i qh = _mm512_load_si512(quant + 2048 + 256 * (s / 2) + 64 * k);
    const int shift = 2 * ((2 * s + half) % 4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qh, shift), _mm512_set1_epi8(3));
    return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
  }
};

// Blocks [b0, b1) of 32 columns of group g as bf16 B tiles, one virtual
// line per Step, so that the tile kernel can run it between its tile
// instructions: out + (b - b0) * 512 is block b, row k2 = 2v + p (elements
// 4v + 2p, 4v + 2p + 1 of the 16 rows, as 16 pairs). A virtual line's 64
// levels ([16 r][4 j]) go as four quarters of 4 rows, each widened to 16
// floats in (r, j) order and scaled by its rows' scale and offset (spread
// over the quarter's lanes), then two quarters at a time rounded to bf16,
// whose dword 8 q + 2 r + p holds the pair p of row 4 q + r.
template <DType kType>
struct Bf16Dequantizer {
  using Source = BlockSource<kType>;
  const uint8_t* quant = nullptr;  // the group's quant region
  const uint8_t* meta = nullptr;   // its meta region
  int64_t b0 = 0;
  int line = 0, lines = 0;  // next, and all (8 per block)
  uint16_t* out = nullptr;
  __m512 s[2][4], o[2][4];  // the current block's scales and offsets, per half and quarter

  void Start(const QuantMatrix& w, int64_t g, int64_t first, int64_t end, uint16_t* dst) {
    const int64_t supers = w.cols() / (32 * Source::kSuper);
    quant = w.group(g);
    meta = quant + supers * Source::kQuant;
    b0 = first;
    line = 0;
    lines = static_cast<int>(8 * (end - first));
    out = dst;
  }
  void Stop() { line = lines = 0; }  // nothing to do
  bool done() const { return line >= lines; }

  ELLM_AVX512_BF16_TARGET ELLM_INLINE void Step() {
    if (line >= lines) return;
    const int64_t b = b0 + line / 8;
    const int v = line % 8;
    const int64_t super = b / Source::kSuper;
    const int sub = static_cast<int>(b % Source::kSuper);
    const uint8_t* q = quant + super * Source::kQuant;
    if (v == 0) {
      __m512 scale[2], offset[2];
      Source::Scales(q, meta + super * Source::kMeta, sub, scale, offset);
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < 4; ++i) {
          const __m512i spread = _mm512_load_si512(kSpread[i]);
          s[h][i] = _mm512_permutexvar_ps(spread, scale[h]);
          o[h][i] = _mm512_permutexvar_ps(spread, offset[h]);
        }
      }
    }
    const __m512i levels = Source::Levels(q, sub, v);
    const int h = v / 4;
    __m512 f[4];
    f[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(levels))), s[h][0],
                           o[h][0]);
    f[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(levels, 1))),
                           s[h][1], o[h][1]);
    f[2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(levels, 2))),
                           s[h][2], o[h][2]);
    f[3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(levels, 3))),
                           s[h][3], o[h][3]);
    const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
    const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
    uint16_t* dst = out + (line / 8) * (kBlockBytes / 2) + 64 * v;
    _mm512_store_si512(dst, _mm512_permutex2var_epi32(lo, _mm512_load_si512(kAmxEvenOddDwords[0]), hi));
    _mm512_store_si512(dst + 32, _mm512_permutex2var_epi32(lo, _mm512_load_si512(kAmxEvenOddDwords[1]), hi));
    ++line;
  }
};

// The C tile `reg` (0-3) loaded from, stored to, or zeroed.
ELLM_AMX_TARGET ELLM_INLINE void LoadC(int reg, const float* c, int64_t stride) {
  switch (reg) {
    case 0: __asm__ volatile("tileloadd (%0,%1,1), %%tmm0" : : "r"(c), "r"(stride) : "memory"); break;
    case 1: __asm__ volatile("tileloadd (%0,%1,1), %%tmm1" : : "r"(c), "r"(stride) : "memory"); break;
    case 2: __asm__ volatile("tileloadd (%0,%1,1), %%tmm2" : : "r"(c), "r"(stride) : "memory"); break;
    default: __asm__ volatile("tileloadd (%0,%1,1), %%tmm3" : : "r"(c), "r"(stride) : "memory"); break;
  }
}
ELLM_AMX_TARGET ELLM_INLINE void StoreC(int reg, float* c, int64_t stride) {
  switch (reg) {
    case 0: __asm__ volatile("tilestored %%tmm0, (%0,%1,1)" : : "r"(c), "r"(stride) : "memory"); break;
    case 1: __asm__ volatile("tilestored %%tmm1, (%0,%1,1)" : : "r"(c), "r"(stride) : "memory"); break;
    case 2: __asm__ volatile("tilestored %%tmm2, (%0,%1,1)" : : "r"(c), "r"(stride) : "memory"); break;
    default: __asm__ volatile("tilestored %%tmm3, (%0,%1,1)" : : "r"(c), "r"(stride) : "memory"); break;
  }
}
ELLM_AMX_TARGET ELLM_INLINE void ZeroC(int reg) {
  switch (reg) {
    case 0: __asm__ volatile("tilezero %%tmm0" ::: "memory"); break;
    case 1: __asm__ volatile("tilezero %%tmm1" ::: "memory"); break;
    case 2: __asm__ volatile("tilezero %%tmm2" ::: "memory"); break;
    default: __asm__ volatile("tilezero %%tmm3" ::: "memory"); break;
  }
}

// A block type, T >= kAmxMinTokens, groups [g_begin, g_end).
//
// Groups go in pairs (the last alone when their count is odd) and token
// tiles in pairs (then a single full tile, then the partial one): each block
// step loads two A and two B tiles for four products, so the A tiles, which
// come from L2, are read once per two groups. Each C tile still sums its
// blocks in column order, so the pairing changes no bit of y.
template <DType kType>
ELLM_AMX_TARGET void KernelAmxTiles(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
  const QuantMatrix& w = *a.w;
  const int64_t nb = w.cols() / 32;
  const int T = a.T;
  const int64_t ab_stride = 64;  // bytes per row of an A tile (a token) and of a B tile (a pair of columns)
  const auto a_tile = [&](int tile, int64_t b) {
    return reinterpret_cast<const uint8_t*>(a.bf16) + (tile * nb + b) * 1024;
  };
  const int full_tiles = T / kTileTokens, rest = T % kTileTokens;
  // One chunk of each group of a pair as B tiles, twice: the tile unit reads
  // one pair's while the vector units fill the other with the next pair's,
  // a line of each group per block step of the tile loop.
  AlignedBytes b_tiles[4];
  for (AlignedBytes& bt : b_tiles) bt.Resize(kChunkBlocks * kBlockBytes);
  const auto b_buffer = [&](int64_t g) {
    const int64_t i = g - g_begin;
    return reinterpret_cast<uint16_t*>(b_tiles[((i / 2) & 1) * 2 + (i & 1)].data());
  };
  // The sums of a group with fewer than 16 rows live here, not in y.
  AlignedBytes partial;
  const bool has_partial = ValidRows(w, g_end - 1) < kGroupRows;
  if (has_partial) partial.Resize(static_cast<size_t>(T) * kGroupRows * sizeof(float));
  float* partial_sums = reinterpret_cast<float*>(partial.data());
  const AmxTileConfig full_cfg = MakeConfig(kTileTokens), rest_cfg = MakeConfig(rest == 0 ? 1 : rest);
  Bf16Dequantizer<kType> next[2];
  // Starts dequantising the pair of groups from g (nothing past g_end).
  const auto start_pair = [&](int64_t g, int64_t b0, int64_t b1) {
    for (int y = 0; y < 2; ++y) {
      if (g + y < g_end) {
        next[y].Start(w, g + y, b0, b1, b_buffer(g + y));
      } else {
        next[y].Stop();
      }
    }
  };
  const auto step = [&]() ELLM_AMX_TARGET __attribute__((always_inline)) {
    next[0].Step();
    next[1].Step();
  };
  for (int64_t b0 = 0; b0 < nb; b0 += kChunkBlocks) {
    const int64_t b1 = std::min(nb, b0 + kChunkBlocks);
    const bool first = b0 == 0;
    start_pair(g_begin, b0, b1);
    while (!next[0].done() || !next[1].done()) step();
    for (int64_t g = g_begin; g < g_end; g += 2) {
      const int ng = g + 1 < g_end ? 2 : 1;  // groups of this pair
      start_pair(g + 2, b0, b1);
      float* c_base[2] = {};
      int64_t c_stride[2] = {};  // bytes per token
      const uint8_t* bt[2] = {};
      for (int y = 0; y < ng; ++y) {
        const bool in_y = ValidRows(w, g + y) == kGroupRows;
        c_base[y] = in_y ? a.y + (g + y) * kGroupRows : partial_sums;
        c_stride[y] = (in_y ? a.ldy : kGroupRows) * 4;
        bt[y] = reinterpret_cast<const uint8_t*>(b_buffer(g + y));
      }
      // C tiles of token tiles [tile, tile + nt) and the pair's groups: in
      // from y (zero on the first chunk) or out to it.
      const auto c_tiles = [&](int tile, int nt, bool store) ELLM_AMX_TARGET __attribute__((always_inline)) {
        for (int y = 0; y < ng; ++y) {
          for (int x = 0; x < nt; ++x) {
            float* c = c_base[y] + static_cast<int64_t>(tile + x) * kTileTokens * (c_stride[y] / 4);
            if (store) {
              StoreC(x + 2 * y, c, c_stride[y]);
            } else if (first) {
              ZeroC(x + 2 * y);
            } else {
              LoadC(x + 2 * y, c, c_stride[y]);
            }
          }
        }
      };
      __asm__ volatile("" ::: "memory");
      __asm__ volatile("ldtilecfg %0" : : "m"(full_cfg) : "memory");
      int tile = 0;
      for (; tile + 2 <= full_tiles; tile += 2) {
        const uint8_t* a0 = a_tile(tile, b0);
        const uint8_t* a1 = a_tile(tile + 1, b0);
        c_tiles(tile, 2, false);
        if (ng == 2) {
          for (int64_t i = 0; i < b1 - b0; ++i) {
            __asm__ volatile(
                "tileloadd (%0,%4,1), %%tmm6\n\t"
                "tileloadd (%1,%4,1), %%tmm7\n\t"
                "tileloadd (%2,%4,1), %%tmm4\n\t"
                "tdpbf16ps %%tmm6, %%tmm4, %%tmm0\n\t"
                "tdpbf16ps %%tmm7, %%tmm4, %%tmm2\n\t"
                "tileloadd (%3,%4,1), %%tmm5\n\t"
                "tdpbf16ps %%tmm6, %%tmm5, %%tmm1\n\t"
                "tdpbf16ps %%tmm7, %%tmm5, %%tmm3"
                :
                : "r"(bt[0] + i * kBlockBytes), "r"(bt[1] + i * kBlockBytes), "r"(a0 + 1024 * i),
                  "r"(a1 + 1024 * i), "r"(ab_stride)
                : "memory");
            step();
          }
        } else {
          for (int64_t i = 0; i < b1 - b0; ++i) {
            __asm__ volatile(
                "tileloadd (%0,%3,1), %%tmm6\n\t"
                "tileloadd (%1,%3,1), %%tmm4\n\t"
                "tileloadd (%2,%3,1), %%tmm5\n\t"
                "tdpbf16ps %%tmm6, %%tmm4, %%tmm0\n\t"
                "tdpbf16ps %%tmm6, %%tmm5, %%tmm1"
                :
                : "r"(bt[0] + i * kBlockBytes), "r"(a0 + 1024 * i), "r"(a1 + 1024 * i), "r"(ab_stride)
                : "memory");
            step();
          }
        }
        c_tiles(tile, 2, true);
      }
      // One token tile alone: the full one left over (n = 16), then the
      // partial one.
      for (int pass = 0; pass < 2; ++pass) {
        if (pass == 0 && tile == full_tiles) continue;
        if (pass == 1) {
          if (rest == 0) break;
          __asm__ volatile("ldtilecfg %0" : : "m"(rest_cfg) : "memory");
          tile = full_tiles;
        }
        const uint8_t* a0 = a_tile(tile, b0);
        c_tiles(tile, 1, false);
        for (int64_t i = 0; i < b1 - b0; ++i) {
          if (ng == 2) {
            __asm__ volatile(
                "tileloadd (%0,%3,1), %%tmm6\n\t"
                "tileloadd (%1,%3,1), %%tmm7\n\t"
                "tileloadd (%2,%3,1), %%tmm4\n\t"
                "tdpbf16ps %%tmm6, %%tmm4, %%tmm0\n\t"
                "tdpbf16ps %%tmm7, %%tmm4, %%tmm2"
                :
                : "r"(bt[0] + i * kBlockBytes), "r"(bt[1] + i * kBlockBytes), "r"(a0 + 1024 * i),
                  "r"(ab_stride)
                : "memory");
          } else {
            __asm__ volatile(
                "tileloadd (%0,%2,1), %%tmm6\n\t"
                "tileloadd (%1,%2,1), %%tmm4\n\t"
                "tdpbf16ps %%tmm6, %%tmm4, %%tmm0"
                :
                : "r"(bt[0] + i * kBlockBytes), "r"(a0 + 1024 * i), "r"(ab_stride)
                : "memory");
          }
          step();
        }
        c_tiles(tile, 1, true);
      }
      // Few token tiles: the rest of the next pair's lines.
      while (!next[0].done() || !next[1].done()) step();
    }
  }
  __asm__ volatile("tilerelease" ::: "memory");
  if (has_partial) {
    const int valid = ValidRows(w, g_end - 1);
    for (int t = 0; t < T; ++t) {
      std::memcpy(a.y + t * a.ldy + (g_end - 1) * kGroupRows, partial_sums + t * kGroupRows,
                  valid * sizeof(float));
    }
  }
}

template <DType kType>
void KernelAmx(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
  if (a.bf16 == nullptr) {  // fewer than kAmxMinTokens tokens: int8 codes, avx512's kernel
    Avx512VnniKernel(kType)(a, g_begin, g_end);
    return;
  }
  KernelAmxTiles<kType>(a, g_begin, g_end);
}

}  // namespace

bool AmxTileType(DType type) {
  switch (type) {
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K: return true;
    default: return false;
  }
}

MatKernel AmxKernel(DType type) {
  switch (type) {
    case DType::kQ8_0: return KernelAmx<DType::kQ8_0>;
    case DType::kQ4_0: return KernelAmx<DType::kQ4_0>;
    case DType::kQ4_K: return KernelAmx<DType::kQ4_K>;
    case DType::kQ5_K: return KernelAmx<DType::kQ5_K>;
    case DType::kQ6_K: return KernelAmx<DType::kQ6_K>;
    default: return Avx512VnniKernel(type);
  }
}

}  // namespace ellm::mlp::internal
