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
// the tile across all blocks of a chunk of kChunkBlocks and in a tile-major
// scratch between chunks (KernelAmxTiles). w is the reference
// dequantisation's fp32 value (BlockSource); both operands are then rounded
// to bfloat16 (8 bits of mantissa, nearest even), and the products (exact in
// fp32) are summed in fp32 by the tile unit. So the results differ
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
// Order of work per band of up to kBandGroups groups of a kernel call (a
// range of groups): chunks of kChunkBlocks blocks (1024 columns) outside, so
// the chunk's activations (T x 2 KiB) stay in L2 while every group of the
// band uses them; per pair of groups the chunk's weights, dequantised into
// 2 x 32 KiB, serve every token tile, two token tiles at a time (2 x 2 C
// tiles), while the vector units
// dequantise the next pair's, a line of each group per block step (two
// buffers). Measured on 5120 x 5120 at T = 256, 1 thread, Xeon family 6
// model 207, one group at a time: 0.52-0.55 of avx512's time; chunks of 16
// or 8 blocks, 0.55-0.70. Pairs of groups (ellm-bench prefill, README
// benchmark model, 4096 tokens, 2 threads, alternating with one group at a
// time): matrix work 676-749 against 586-642 G multiply-adds/s (1.12-1.21x);
// chunks of 16 blocks then ran no faster than single groups, chunks of 64
// within the noise of 32, and prefetching the next A tiles slower.
//
// What bounds it now (5120 x 5120 Q8_0 at T = 256, 1 thread, the same Xeon,
// the Matvec5120 bench with ELLM_BENCH_TOKENS=256: 9.7-9.9 ms, 0.33 of
// TDPBF16PS's peak; experiments, not kept): without the dequantisation 7.0
// ms; without it and with every tile load from L1 4.8 ms (0.68); also
// without the C tiles' trips to the scratch 4.6 ms. The dequantisation alone
// (no tile work) takes about 2.8 ms, but with the tile work it adds 3-4 ms:
// its stores and the tile loads do not overlap well (without its stores, 8.9
// ms). Chunks of 16 or 8 blocks (B in L1) ran 5-10% slower.
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
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,f16c,fma")))
#define ELLM_INLINE inline __attribute__((always_inline))
#define ELLM_AMX_TARGET                                                                     \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16," \
                        "avx512vbmi,f16c,fma")))

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

// The dequantiser's (below) lane orders: kAmxQuarterBytes (core/amx.h)
// picks a quarter's levels, kRowOfLane[hb] spreads the rows' scales over
// its lanes.
alignas(64) constexpr int32_t kRowOfLane[2][16] = {{0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7},
                                                   {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15}};

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
// levels ([16 r][4 j]) go as four quarters (kAmxQuarterBytes), each widened to
// 16 floats and scaled by its rows' scale and offset, then two quarters at a
// time rounded to bf16: one B tile row each, with no permute. Before, the
// quarters were 4 rows each (extracts, VPMOVZXBD) and the pairs were gathered
// by two VPERMT2Ds: 19 vector instructions a line, now 14 (the kernel's time
// moved within the noise, 10.0 -> 9.9 ms in the case above). The values, and
// so every bit of y, are the same.
template <DType kType>
struct Bf16Dequantizer {
  using Source = BlockSource<kType>;
  const uint8_t* quant = nullptr;  // the group's quant region
  const uint8_t* meta = nullptr;   // its meta region
  int64_t b0 = 0;
  int line = 0, lines = 0;  // next, and all (8 per block)
  uint16_t* out = nullptr;
  const uint8_t* q = nullptr;  // the current block's super-block
  int sub = 0;                 // and its block in it
  __m512 s[2][2], o[2][2];  // the current block's scales and offsets, per half and row half (hb)

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
    const int v = line % 8;
    if (v == 0) {  // a new block: its quant data and its rows' scales and offsets
      const int64_t b = b0 + line / 8;
      const int64_t super = b / Source::kSuper;
      sub = static_cast<int>(b % Source::kSuper);
      q = quant + super * Source::kQuant;
      __m512 scale[2], offset[2];
      Source::Scales(q, meta + super * Source::kMeta, sub, scale, offset);
      const __m512i spread0 = _mm512_load_si512(kRowOfLane[0]), spread1 = _mm512_load_si512(kRowOfLane[1]);
      for (int h = 0; h < 2; ++h) {
        s[h][0] = _mm512_permutexvar_ps(spread0, scale[h]);
        o[h][0] = _mm512_permutexvar_ps(spread0, offset[h]);
        s[h][1] = _mm512_permutexvar_ps(spread1, scale[h]);
        o[h][1] = _mm512_permutexvar_ps(spread1, offset[h]);
      }
    }
    const __m512i levels = Source::Levels(q, sub, v);
    const int h = v / 4;
    const __m512 s0 = s[h][0], s1 = s[h][1], o0 = o[h][0], o1 = o[h][1];
    // Quarter q = 2 p + hb, widened to floats and scaled.
    const auto quarter = [&](int qi, __m512 scale, __m512 offset) ELLM_AVX512_BF16_TARGET __attribute__((always_inline)) {
      const __m512i level =
          _mm512_maskz_permutexvar_epi8(kAmxLowBytes, _mm512_load_si512(kAmxQuarterBytes[qi].data()), levels);
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(level), scale, offset);
    };
    uint16_t* dst = out + 64 * static_cast<int64_t>(line);  // block line / 8, B rows 2v and 2v + 1
    _mm512_store_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(quarter(1, s1, o1), quarter(0, s0, o0)));
    _mm512_store_si512(dst + 32, (__m512i)_mm512_cvtne2ps_pbh(quarter(3, s1, o1), quarter(2, s0, o0)));
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

// A block type, T >= kAmxMinTokens, groups [g_begin, g_end), in bands of
// at most kBandGroups groups.
//
// Groups go in pairs (the last alone when their count is odd) and token
// tiles in pairs (then a single full tile, then the partial one): each block
// step loads two A and two B tiles for four products, so the A tiles, which
// come from L2, are read once per two groups. Each C tile still sums its
// blocks in column order, so neither the pairing nor the bands change a bit
// of y.
//
// Between chunks the C tiles wait in a tile-major scratch (a group's sums as
// [token][16 rows], 64 bytes a token), not in y: a C tile of y spans 16
// tokens' rows ldy floats apart, 16 pages, and its loads and stores between
// chunks cost more than the products. 5120 x 5120 Q8_0 at T = 256 (the
// disabled Matvec5120 bench with ELLM_BENCH_TOKENS=256, Xeon family 6 model
// 207): 11.1 -> 10.3 ms on 1 thread (with the VPERMB dequantiser and y
// written by 64-byte stores, 9.7-9.9 ms; 2 threads 5.9 -> 4.6). The band
// keeps that scratch (T x 2 KiB) in L2 beside the chunk's A tiles; y gets
// each band's sums once, at its end. (Prefetching the next C tiles into L1
// during the products changed nothing.)
constexpr int64_t kBandGroups = 32;

template <DType kType>
ELLM_AMX_TARGET void KernelAmxTiles(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
  const QuantMatrix& w = *a.w;
  const int64_t nb = w.cols() / 32;
  const int T = a.T;
  const int64_t ab_stride = 64;  // bytes per row of an A tile (a token), a B tile (a pair of columns), a C tile (a token)
  const auto a_tile = [&](int tile, int64_t b) {
    return reinterpret_cast<const uint8_t*>(a.bf16) + (tile * nb + b) * 1024;
  };
  const int full_tiles = T / kTileTokens, rest = T % kTileTokens;
  const int64_t padded_tokens = (full_tiles + (rest > 0 ? 1 : 0)) * kTileTokens;
  // One chunk of each group of a pair as B tiles, twice: the tile unit reads
  // one pair's while the vector units fill the other with the next pair's,
  // a line of each group per block step of the tile loop.
  AlignedBytes b_tiles[4];
  for (AlignedBytes& bt : b_tiles) bt.Resize(kChunkBlocks * kBlockBytes);
  // The band's sums, [group][token][16 rows]; kept per thread, as it only grows.
  thread_local AlignedBytes scratch;
  scratch.Resize(static_cast<size_t>(kBandGroups * padded_tokens * kGroupRows * sizeof(float)));
  float* const sums = reinterpret_cast<float*>(scratch.data());
  const AmxTileConfig full_cfg = MakeConfig(kTileTokens), rest_cfg = MakeConfig(rest == 0 ? 1 : rest);
  Bf16Dequantizer<kType> next[2];
  for (int64_t band = g_begin; band < g_end; band += kBandGroups) {
    const int64_t band_end = std::min(g_end, band + kBandGroups);
    const auto b_buffer = [&](int64_t g) {
      const int64_t i = g - band;
      return reinterpret_cast<uint16_t*>(b_tiles[((i / 2) & 1) * 2 + (i & 1)].data());
    };
    // Starts dequantising the pair of groups from g (nothing past band_end).
    const auto start_pair = [&](int64_t g, int64_t b0, int64_t b1) {
      for (int y = 0; y < 2; ++y) {
        if (g + y < band_end) {
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
      start_pair(band, b0, b1);
      while (!next[0].done() || !next[1].done()) step();
      for (int64_t g = band; g < band_end; g += 2) {
        const int ng = g + 1 < band_end ? 2 : 1;  // groups of this pair
        start_pair(g + 2, b0, b1);
        float* c_base[2] = {};
        const uint8_t* bt[2] = {};
        for (int y = 0; y < ng; ++y) {
          c_base[y] = sums + (g + y - band) * padded_tokens * kGroupRows;
          bt[y] = reinterpret_cast<const uint8_t*>(b_buffer(g + y));
        }
        // C tiles of token tiles [tile, tile + nt) and the pair's groups: in
        // from the scratch (zero on the first chunk) or out to it.
        const auto c_tiles = [&](int tile, int nt, bool store) ELLM_AMX_TARGET __attribute__((always_inline)) {
          for (int y = 0; y < ng; ++y) {
            for (int x = 0; x < nt; ++x) {
              float* c = c_base[y] + static_cast<int64_t>(tile + x) * kTileTokens * kGroupRows;
              if (store) {
                StoreC(x + 2 * y, c, ab_stride);
              } else if (first) {
                ZeroC(x + 2 * y);
              } else {
                LoadC(x + 2 * y, c, ab_stride);
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
    // The band's sums to y: row t of group g is 16 floats (fewer in a last,
    // partial group) at t * ldy + 16 g.
    for (int64_t g = band; g < band_end; ++g) {
      const float* src = sums + (g - band) * padded_tokens * kGroupRows;
      const __mmask16 valid = static_cast<__mmask16>((1u << ValidRows(w, g)) - 1);
      for (int t = 0; t < T; ++t) {
        _mm512_mask_storeu_ps(a.y + t * a.ldy + g * kGroupRows, valid, _mm512_load_ps(src + t * kGroupRows));
      }
    }
  }
  __asm__ volatile("tilerelease" ::: "memory");
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
