// The 64-byte tile configuration LDTILECFG loads (palette 1): per tile, its
// row count and bytes per row. Shared by the AMX kernels (attention, matrix)
// and the peak benchmark.
#pragma once

#include <array>
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

// VPERMB indices that widen a 64-byte line of bytes [16 r][4 j] (r: a
// weight row or a V dim, j: a column or a position) into the rows of a
// VNNI-pair bf16 B tile. Quarter q = 2 p + hb takes, into dword lane i, the
// byte of r = 8 hb + i / 2 and j = 2 p + i % 2; all four bytes of the dword
// name it, so that the mask picks where it lands: kAmxLowBytes, in the low
// byte (zero-extended), kAmxHighBytes, in the high one (the signed value
// times 2^24). As floats, quarters 2 p and 2 p + 1 rounded by
// VCVTNE2PS2BF16 (the second, the first) are the line's B tile row p:
// [16 r][2 j], the pairs j = 2 p and 2 p + 1. (VPMOVZXBD of the line's
// quarters and two VPERMT2Ds did the same in 5 more instructions a line.)
inline constexpr uint64_t kAmxLowBytes = 0x1111111111111111ULL, kAmxHighBytes = 0x8888888888888888ULL;
alignas(64) inline constexpr std::array<std::array<uint8_t, 64>, 4> kAmxQuarterBytes = [] {
  std::array<std::array<uint8_t, 64>, 4> t{};
  for (int q = 0; q < 4; ++q) {
    for (int i = 0; i < 16; ++i) {
      for (int b = 0; b < 4; ++b) t[q][4 * i + b] = static_cast<uint8_t>(4 * (8 * (q % 2) + i / 2) + 2 * (q / 2) + i % 2);
    }
  }
  return t;
}();

}  // namespace ellm
