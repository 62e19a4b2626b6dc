// KV cache element types and the byte layout of K and V inside a block.
//
// A block holds `block_tokens` consecutive positions of one sequence. Inside
// the cache, each (layer, KV head) has its own region of blocks (see
// kv_cache.h); a block of a region is a K segment followed by a V segment.
// For f16 and int8 a segment is block_tokens / kTile tiles of kTile = 16
// positions; hp = head_dim rounded up to a multiple of 16, padding dims hold
// zeros (K) or codes of zero (V) and are never part of a result.
//
//   f32   K, V: [block_tokens][head_dim] f32 rows (no tiles; KeyRow works)
//   f16   K tile: [hp][16] f16, transposed: one 32-byte line per dim, so a
//               SIMD lane is a position and a score needs no reduction
//         V tile: [16][hp] f16 rows
//   int8  K tile: scale[16] f16, min[16] f16 (one 64-byte line), then
//               [hp/4][16][4] u8 codes: byte 64 + (16 * (d / 4) + t) * 4 + d % 4
//               holds dim d of position t, so each 64-byte line is 16
//               positions x 4 dims, the operand shape of VPDPBUSD (u8 x s8,
//               4 products per int32 lane). k[d] = scale * code + min.
//         V tile: scale[16] f16, min[16] f16, then [hp/16][4][16][4] s8
//               codes: byte 64 + ((4 * (d / 16) + t / 4) * 16 + d % 16) * 4 +
//               t % 4 holds dim d of position t, so each 64-byte line is 16
//               dims x 4 positions and p (u8, 4 positions) x v (s8)
//               accumulates 16 output dims per VPDPBUSD.
//               v[d] = scale * (code + 128) + min.
//         Tile bytes: 64 + 16 * hp. The scales come first so that a kernel
//         reads every tile front to back: the hardware prefetchers follow a
//         stream that never steps back.
//
// The int8 scheme, chosen by measuring (attention-output error against fp64
// on 4096 positions, head_dim 128, keys with a few large-mean outlier
// channels as real keys have, queries at two temperatures):
//
//   per (position, head)     symmetric   K 2.2e-2 / 4.9e-2   V 9.5e-3
//   per (position, head)     asymmetric  K 1.4e-2 / 4.9e-2   V 7.1e-3
//   per 32 dims, symmetric               K 1.6e-2 / 3.3e-2   V 6.0e-3
//   (relative L2 error of the output, K quantised alone / V alone; the two K
//   columns are mild and peaked attention)
//
// Asymmetric per (position, head) — codes over [min, max] of the row — costs
// nothing extra in the kernels: the u8 codes that VPDPBUSD wants for K need an
// offset correction anyway (score = scale * sum(q_i * code_i) + min * sum(q_i)),
// and for V the min adds one scalar per (position, query head). It uses all
// 256 levels where symmetric wastes half of them on a skewed row, and it
// beats symmetric by 1.3-1.6x on outlier keys. Per-32-dim groups are better
// on peaked attention still, but need 4x the scales (+6% bytes at head_dim
// 128) and a per-group rescale in the dot product (+25% instructions), which
// the bandwidth-bound decode cannot afford. K and V therefore share one
// scheme; the scale and min are f16 (3% of the bytes at head_dim 128) and are
// rounded before the codes are computed, so codes and scales agree. Values
// beyond the f16 range (65504) saturate.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/strings/string_view.h"
#include "core/status.h"

namespace ellm {

enum class KvDType : uint8_t { kF32 = 0, kF16 = 1, kInt8 = 2 };

std::string_view KvDTypeName(KvDType dtype);  // "f32", "f16", "int8"
absl::StatusOr<KvDType> ParseKvDType(absl::string_view name);

inline constexpr int kTile = 16;  // positions per tile (f16, int8)
inline constexpr int kMaxHeadDim = 1024;

// The layout of one (layer, KV head)'s K or V data for a dtype and head size.
struct KvFormat {
  KvDType dtype = KvDType::kF32;
  int head_dim = 0;
  int padded_dim = 0;      // hp: head_dim rounded up to 16 (f32: head_dim)
  int64_t tile_bytes = 0;  // bytes of one K (or V) tile of kTile positions

  static KvFormat Make(KvDType dtype, int head_dim);
  // Bytes of the K (or V) segment of a block of `block_tokens` positions.
  int64_t SegmentBytes(int block_tokens) const;
  // Bytes read per position for K and V together (scales included).
  double BytesPerPosition() const;
  // block_tokens must be a multiple of kTile except for f32.
  absl::Status CheckBlockTokens(int block_tokens) const;

  // Stores row `row` (0..kTile-1; any row of the block for f32) of a K or V
  // tile from head_dim floats, quantising for int8: the one place where KV
  // values are rounded.
  void StoreKey(uint8_t* tile, int row, const float* x) const;
  void StoreValue(uint8_t* tile, int row, const float* x) const;
  // The stored row as head_dim floats (exactly the values the kernels use).
  void LoadKey(const uint8_t* tile, int row, float* x) const;
  void LoadValue(const uint8_t* tile, int row, float* x) const;
};

// Int8 quantisation of one row: codes over [min, min + 255 * scale], with
// scale and min rounded to f16 first. Exposed for tests.
struct Int8Row {
  uint16_t scale_f16 = 0, min_f16 = 0;
};
Int8Row QuantizeInt8Row(const float* x, int n, uint8_t* codes);

// One sequence's K and V of one (layer, KV head) in the paged cache: block b
// of the sequence is block blocks[b] of the region starting at `base`.
struct KvSeqView {
  KvFormat format;
  const uint8_t* base = nullptr;
  const int32_t* blocks = nullptr;  // the sequence's block table
  int64_t block_stride = 0;         // bytes between consecutive blocks of the region
  int64_t value_offset = 0;         // the V segment's offset inside a block
  int block_tokens = 0;
  int length = 0;                   // positions held

  // The K / V tile holding `pos` (f16, int8), or the block's row base (f32).
  const uint8_t* KeyTile(int pos) const {
    return base + blocks[pos / block_tokens] * block_stride +
           (pos % block_tokens) / kTile * format.tile_bytes;
  }
  const uint8_t* ValueTile(int pos) const { return KeyTile(pos) + value_offset; }
  // The row of `pos` inside its tile (for f32 with any block_tokens too).
  int RowInTile(int pos) const { return pos % block_tokens % kTile; }
};

}  // namespace ellm
