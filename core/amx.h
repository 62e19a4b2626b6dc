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

}  // namespace ellm
