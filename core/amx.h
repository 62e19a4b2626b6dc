// The 64-byte tile configuration LDTILECFG loads (palette 1): per tile, its
// row count and bytes per row. Shared by the AMX kernels (attention, matrix)
// and the peak benchmark.
#pragma once

#include <cstdint>

namespace ellm {

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tile i
  uint8_t rows[16] = {};
};
static_assert(sizeof(AmxTileConfig) == 64);

// VPERMT2D indices that take, from two vectors of 16 dwords (a: 0-15, b:
// 16-31), the even dwords ([0]) or the odd ones ([1]) in order: how the AMX
// kernels split dwords of bf16 pairs into the rows of a VNNI-pair B tile
// (_mm512_permutex2var_epi32(a, load(kAmxEvenOddDwords[p]), b)).
alignas(64) inline constexpr int32_t kAmxEvenOddDwords[2][16] = {
    {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
    {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};

}  // namespace ellm
