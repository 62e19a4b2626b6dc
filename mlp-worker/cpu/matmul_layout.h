// Internal to the CPU matrix kernels: the byte layout of a repacked
// QuantMatrix group and the kernel table.
//
// A matrix is stored as groups of 16 rows (kGroupRows; the last group padded
// with zero rows), each group `group_bytes` long (a multiple of 64, so every
// group starts 64-byte aligned). A group of a block type holds nb = cols /
// block blocks along the row:
//
//   [quant region: nb * quant_bytes][meta region: nb * meta_bytes][pad to 64]
//
// The quant region is made of 64-byte "lines": line (.., r, j) is byte
// 4 * r + j, i.e. 4 consecutive elements of each of the 16 rows, so that
// VPDPBUSD of one line with a broadcast 4-byte group of activation codes
// leaves the 16 rows' partial dots in the 16 int32 lanes (no horizontal sums).
// In each block, line k of a 32-element unit carries elements 4k + j
// (k = 0..7), whatever the packing below; levels are unsigned.
//
//   F32   block 1, no interleave: the group is [16 rows][cols] floats, row
//         major (the exact fp32 kernels read rows as core Dot does).
//   F16,  block 1: [cols][16 rows] halves / bfloat16s (one 32-byte line of
//   BF16  16 rows per element).
//   Q8_0  block 32. quant 512: [8 k][16 r][4 j] u8 = code ^ 0x80 (code + 128).
//         meta 32: d[16 r] half.
//   Q4_0  block 32. quant 256: [4 k][16 r][4 j]: low nibble = level of element
//         4k + j, high nibble = level of element 16 + 4k + j (x = d (level - 8)).
//         meta 32: d[16 r] half.
//   Q4_K  block 256 = 8 sub-blocks s of 32. quant 2048: [8 s][4 k][16 r][4 j],
//         nibbles as Q4_0 within sub-block s (elements 32s + 4k + j and
//         32s + 16 + 4k + j). meta 320: d[16 r] half, dmin[16 r] half,
//         sc[8 s][16 r] u8, m[4 p][16 r][2 h] u8 (min of sub-block 2p + h).
//   Q5_K  block 256. quant 2560: the 2048 bytes of Q4_K (low 4 bits), then
//         qh[8 s][16 r][4 j]: bit v of byte (s, r, j) is bit 4 of the element
//         of line v of sub-block s (element 32s + 4v + j). meta 320 as Q4_K.
//   Q6_K  block 256 = 16 sub-blocks of 16. quant 3072: ql[8 P][4 k][16 r][4 j]:
//         low nibble = low 4 bits of element 16(2P) + 4k + j, high nibble =
//         low 4 bits of element 16(2P + 1) + 4k + j; then qh[4 Q][4 k][16 r][4 j]:
//         bits 2u, 2u + 1 = high 2 bits of element 16(4Q + u) + 4k + j.
//         Levels 0..63, x = d sc (level - 32). meta 288: d[16 r] half,
//         sc[8 p][16 r][2 h] int8 (scale of sub-block 2p + h).
#pragma once

#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/dtype.h"
#include "mlp-worker/cpu/matmul.h"

namespace ellm::mlp::internal {

inline constexpr int kGroupRows = 16;

struct GroupLayout {
  int block = 0;        // elements per block along a row
  int quant_bytes = 0;  // per block, all 16 rows
  int meta_bytes = 0;   // per block, all 16 rows
};

// The layout of `type`, or nullptr when it has no kernels.
const GroupLayout* FindGroupLayout(DType type);

// Bytes of one group of `cols` columns (64-byte multiple).
inline size_t GroupBytes(const GroupLayout& l, int64_t cols) {
  const size_t nb = static_cast<size_t>(cols / l.block);
  return (nb * (l.quant_bytes + l.meta_bytes) + 63) / 64 * 64;
}

// What a kernel is given. Activations of the form its set reads
// (ActFormatFor) are ready.
struct KernelArgs {
  const QuantMatrix* w = nullptr;
  const float* x = nullptr;             // kF32: [T][cols]
  const Activations::Q8* q8 = nullptr;  // the int8 forms; null for kF32
  const uint16_t* bf16 = nullptr;       // amx, Q8_0, T >= kAmxMinTokens: Activations::bf16
  int T = 0;
  float* y = nullptr;  // [T][ldy], rows [0, w->rows())
  int64_t ldy = 0;
};

// The quantised activations of tokens [t0, t0 + NT) that an int8 kernel tile
// reads, for blocks of `block` (32: kQ8x32, kQ7x32; 256: kQ8x256).
template <int NT>
struct TileActs {
  const int8_t* codes[NT];
  const float* d[NT];
  const int32_t* sum[NT];    // kQ8x32, kQ7x32
  const int16_t* sum16[NT];  // kQ8x256
  const int16_t* sum32[NT];  // kQ8x256
  TileActs(const KernelArgs& a, int t0, int block) {
    const int64_t cols = a.w->cols(), nb = cols / block;
    for (int t = 0; t < NT; ++t) {
      codes[t] = a.q8->codes(t0 + t);
      d[t] = a.q8->d.data() + (t0 + t) * nb;
      sum[t] = block == 32 ? a.q8->sum.data() + (t0 + t) * nb : nullptr;
      sum16[t] = block == 256 ? a.q8->sum16.data() + (t0 + t) * (cols / 16) : nullptr;
      sum32[t] = block == 256 ? a.q8->sum32.data() + (t0 + t) * (cols / 32) : nullptr;
    }
  }
};

// Computes the rows of groups [g_begin, g_end) for all T tokens.
using MatKernel = void (*)(const KernelArgs& args, int64_t g_begin, int64_t g_end);

// Each kernel file's table; nullptr where it has no kernel for the type.
MatKernel RefKernel(DType type);
MatKernel Avx2Kernel(DType type);
MatKernel Avx2Q8_0Act7Kernel();  // Q8_0 on kQ7x32 activations (matmul_avx2.cc)
MatKernel Avx2VnniKernel(DType type);  // matmul_avx2_vnni.cc
MatKernel Avx512VnniKernel(DType type);
MatKernel AmxKernel(DType type);  // matmul_amx.cc: block types on the tile unit, the rest avx512's
// Whether amx runs `type` on the tile unit (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K).
bool AmxTileType(DType type);
// Steps of at least this many tokens run amx's tile kernels (on bf16
// activations); fewer run avx512's (on int8 codes).
inline constexpr int kAmxMinTokens = 16;
// One token's x[32 nb] rounded to bfloat16 (nearest even): block b's 32 to
// out + 512 b (its row in each tile of Activations::bf16).
void ToBf16TileRowAvx512(const float* x, int64_t nb, uint16_t* out);

// QuantizeActivationRow on AVX2 (matmul_avx2.cc).
void QuantizeActivationRowAvx2(const float* x, int64_t cols, int block, int max_code, int8_t* codes,
                               float* d);

// The exact fp32 kernel (core Dot's order) on AVX, shared by the SIMD sets.
void F32ExactKernelAvx(const KernelArgs& args, int64_t g_begin, int64_t g_end);

// Rows of group g that exist (16 except in the last group).
inline int ValidRows(const QuantMatrix& w, int64_t g) {
  const int64_t left = w.rows() - g * kGroupRows;
  return left < kGroupRows ? static_cast<int>(left) : kGroupRows;
}

// Tokens per pass over a thread's groups when a step has many (prefill): the
// pass's activations stay in L2 while each group's weights serve them tile
// by tile. With all 256 tokens of a step in one pass their codes (1.3 MB at
// 5120 columns) streamed from L3 for every group. Tiles take 4 tokens (or 2)
// and start at multiples of this, so the tiles, and the results, are those
// of one pass.
constexpr int kTokenChunk = 64;

// The kernels' token loop: passes of kTokenChunk tokens, pass(t_begin, t_end).
template <typename Pass>
inline void ForEachTokenPass(int T, Pass&& pass) {
  for (int tc = 0; tc < T; tc += kTokenChunk) pass(tc, std::min(T, tc + kTokenChunk));
}

// Tiles of kTokens tokens over [t_begin, t_end) (fewer at the end): run(t0,
// nt), nt a std::integral_constant<int, NT>. A pass's first tile starts at a
// multiple of kTokenChunk: the tiles that fetch a group ahead do it there.
template <int kTokens, typename Run>
inline void ForEachTile(int t_begin, int t_end, Run&& run) {
  static_assert(kTokens >= 1 && kTokens <= 4 && kTokenChunk % kTokens == 0);
  for (int t0 = t_begin; t0 < t_end; t0 += kTokens) {
    switch (std::min(t_end - t0, kTokens)) {
      case 1: run(t0, std::integral_constant<int, 1>()); break;
      case 2: if constexpr (kTokens >= 2) run(t0, std::integral_constant<int, 2>()); break;
      case 3: if constexpr (kTokens >= 3) run(t0, std::integral_constant<int, 3>()); break;
      default: if constexpr (kTokens >= 4) run(t0, std::integral_constant<int, 4>()); break;
    }
  }
}

// Software prefetch for the kernels. With the hardware prefetcher alone they
// ran compute and DRAM reads one after the other (AVX2 Q8_0, 1 thread, AMD
// EPYC Zen 5: 54 GB/s from cache, a 29 GB/s read probe, 17 GB/s from DRAM;
// the DISABLED_Matvec5120 bench in tests/test_matmul.cc, with
// ELLM_BENCH_MATVEC_N=512 ELLM_BENCH_WORKING_SET_KB=300 for "from cache");
// asking for the weight lines kAheadBytes ahead overlaps the two.
// Prefetching past the end of a matrix is harmless (no fault, no use).
constexpr int kAheadBytes = 2048;

// The prefetch helpers are always inlined. GCC 12 proves an out-of-line
// copy "pure" (a prefetch is no side effect to it) and then deletes every
// call: a helper too long for the early inliner (PrefetchNextGroup, since
// removed) had vanished from every kernel that called it.
#define ELLM_PREFETCH_INLINE inline __attribute__((always_inline))

// The lines of [p, p + bytes).
template <int kHint = _MM_HINT_T0>
ELLM_PREFETCH_INLINE void PrefetchLines(const void* p, int bytes) {
  const char* c = static_cast<const char*>(p);
  static_assert(kHint == _MM_HINT_T0 || kHint == _MM_HINT_T1);
  for (int o = 0; o < bytes; o += 64) {
    // (Each hint spelled out: GCC's and clang's _mm_prefetch take different types.)
    if constexpr (kHint == _MM_HINT_T0) {
      _mm_prefetch(c + o, _MM_HINT_T0);
    } else {
      _mm_prefetch(c + o, _MM_HINT_T1);
    }
  }
}

// The lines of [p, p + bytes), kAheadBytes on.
ELLM_PREFETCH_INLINE void PrefetchAhead(const void* p, int bytes) {
  PrefetchLines(static_cast<const char*>(p) + kAheadBytes, bytes);
}

// For the k-quant kernels, whose group holds its nb blocks of quant_bytes
// and then their metadata, meta_bytes per block: prefetches block b +
// kBlocksAhead's quant bytes and the metadata kAheadBytes on, continuing
// into group g + 1 (which a thread takes next) past the end of group g.
// PrefetchAhead from the last blocks fetched the group's own metadata, so
// the next group's first blocks and their metadata missed in DRAM (one
// token, 2 threads, medians: AVX2 Q4_K 0.54-0.59 of the probe -> 0.62-0.71
// with 2 blocks ahead, 0.75-0.81 with 4; AVX-512 Q4_K 0.64-0.67 -> 0.82-0.90
// -> 0.91-0.94; bench/results/amd-epyc-zen5.md).
inline constexpr int64_t kBlocksAhead = 4;
// kHint: where the quant lines go (_MM_HINT_T1: L2 only, see K4Tile::Whole).
template <int kHint = _MM_HINT_T0>
ELLM_PREFETCH_INLINE void PrefetchBlocks(const QuantMatrix& w, int64_t g, int64_t b, int64_t nb,
                                         int quant_bytes, int meta_bytes) {
  const bool has_next = g + 1 < w.groups();
  const int64_t bq = b + kBlocksAhead, bm = b + (kAheadBytes + meta_bytes - 1) / meta_bytes;
  if (bq < nb) {
    PrefetchLines<kHint>(w.group(g) + bq * quant_bytes, quant_bytes);
  } else if (has_next) {
    PrefetchLines<kHint>(w.group(g + 1) + (bq - nb) * quant_bytes, quant_bytes);
  }
  if (bm < nb) {
    PrefetchLines(w.group(g) + nb * quant_bytes + bm * meta_bytes, meta_bytes);
  } else if (has_next) {
    PrefetchLines(w.group(g + 1) + nb * quant_bytes + (bm - nb) * meta_bytes, meta_bytes);
  }
}

}  // namespace ellm::mlp::internal
