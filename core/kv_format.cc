#include "core/kv_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"

namespace ellm {
namespace {

constexpr float kHalfMax = 65504.0f;

int RoundUp16(int n) { return (n + 15) / 16 * 16; }

// Offsets inside an int8 tile: scales, mins, then the codes.
int64_t Int8KeyIndex(int d, int t) { return 64 + (16 * (d / 4) + t) * 4 + d % 4; }
int64_t Int8ValueIndex(int d, int t) {
  return 64 + ((4 * (d / 16) + t / 4) * 16 + d % 16) * 4 + t % 4;
}

uint16_t* ScaleAt(uint8_t* tile, int /*hp*/, int row) { return reinterpret_cast<uint16_t*>(tile) + row; }
uint16_t* MinAt(uint8_t* tile, int /*hp*/, int row) {
  return reinterpret_cast<uint16_t*>(tile + 32) + row;
}
const uint16_t* ScaleAt(const uint8_t* tile, int /*hp*/, int row) {
  return reinterpret_cast<const uint16_t*>(tile) + row;
}
const uint16_t* MinAt(const uint8_t* tile, int /*hp*/, int row) {
  return reinterpret_cast<const uint16_t*>(tile + 32) + row;
}

uint16_t* Half(uint8_t* p, int64_t index) { return reinterpret_cast<uint16_t*>(p) + index; }
const uint16_t* Half(const uint8_t* p, int64_t index) {
  return reinterpret_cast<const uint16_t*>(p) + index;
}

}  // namespace

std::string_view KvDTypeName(KvDType dtype) {
  switch (dtype) {
    case KvDType::kF32: return "f32";
    case KvDType::kF16: return "f16";
    case KvDType::kInt8: return "int8";
  }
  return "?";
}

absl::StatusOr<KvDType> ParseKvDType(absl::string_view name) {
  for (KvDType t : {KvDType::kF32, KvDType::kF16, KvDType::kInt8}) {
    if (name == ToAbsl(KvDTypeName(t))) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown KV dtype '", name, "' (expected int8, f16 or f32)"));
}

KvFormat KvFormat::Make(KvDType dtype, int head_dim) {
  KvFormat f;
  f.dtype = dtype;
  f.head_dim = head_dim;
  switch (dtype) {
    case KvDType::kF32:
      f.padded_dim = head_dim;
      f.tile_bytes = int64_t{kTile} * head_dim * 4;
      break;
    case KvDType::kF16:
      f.padded_dim = RoundUp16(head_dim);
      f.tile_bytes = int64_t{kTile} * f.padded_dim * 2;
      break;
    case KvDType::kInt8:
      f.padded_dim = RoundUp16(head_dim);
      f.tile_bytes = int64_t{kTile} * f.padded_dim + 64;
      break;
  }
  return f;
}

int64_t KvFormat::SegmentBytes(int block_tokens) const {
  if (dtype == KvDType::kF32) return int64_t{block_tokens} * head_dim * 4;
  return int64_t{block_tokens} / kTile * tile_bytes;
}

double KvFormat::BytesPerPosition() const { return 2.0 * tile_bytes / kTile; }

absl::Status KvFormat::CheckBlockTokens(int block_tokens) const {
  if (block_tokens <= 0 || (dtype != KvDType::kF32 && block_tokens % kTile != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("block_tokens must be a positive multiple of ",
                                                   kTile, " for KV dtype ",
                                                   std::string(KvDTypeName(dtype)),
                                                   " (got ", block_tokens, ")"));
  }
  return absl::OkStatus();
}

Int8Row QuantizeInt8Row(const float* x, int n, uint8_t* codes) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  Int8Row r;
  r.min_f16 = FloatToHalf(std::clamp(lo, -kHalfMax, kHalfMax));
  const float min = HalfToFloat(r.min_f16);
  r.scale_f16 = FloatToHalf(std::min((hi - min) / 255.0f, kHalfMax));
  const float scale = HalfToFloat(r.scale_f16);
  const float inv = scale > 0 ? 1.0f / scale : 0.0f;
  for (int i = 0; i < n; ++i) {
    // Round half up (the argument is >= 0 up to the f16 rounding of min).
    const float c = std::clamp((x[i] - min) * inv + 0.5f, 0.0f, 255.0f);
    codes[i] = static_cast<uint8_t>(c);
  }
  return r;
}

void KvFormat::StoreKey(uint8_t* tile, int row, const float* x) const {
  const int hp = padded_dim;
  switch (dtype) {
    case KvDType::kF32:
      std::memcpy(tile + int64_t{row} * head_dim * 4, x, head_dim * sizeof(float));
      return;
    case KvDType::kF16:
      for (int d = 0; d < hp; ++d) *Half(tile, d * 16 + row) = d < head_dim ? FloatToHalf(x[d]) : 0;
      return;
    case KvDType::kInt8: {
      uint8_t codes[kMaxHeadDim];
      const Int8Row r = QuantizeInt8Row(x, head_dim, codes);
      for (int d = 0; d < hp; ++d) tile[Int8KeyIndex(d, row)] = d < head_dim ? codes[d] : 0;
      *ScaleAt(tile, hp, row) = r.scale_f16;
      *MinAt(tile, hp, row) = r.min_f16;
      return;
    }
  }
}

void KvFormat::StoreValue(uint8_t* tile, int row, const float* x) const {
  const int hp = padded_dim;
  switch (dtype) {
    case KvDType::kF32:
      std::memcpy(tile + int64_t{row} * head_dim * 4, x, head_dim * sizeof(float));
      return;
    case KvDType::kF16:
      for (int d = 0; d < hp; ++d) *Half(tile, row * hp + d) = d < head_dim ? FloatToHalf(x[d]) : 0;
      return;
    case KvDType::kInt8: {
      uint8_t codes[kMaxHeadDim];
      const Int8Row r = QuantizeInt8Row(x, head_dim, codes);
      for (int d = 0; d < hp; ++d) {
        // s8 = code - 128; padding dims hold code 0.
        tile[Int8ValueIndex(d, row)] = static_cast<uint8_t>((d < head_dim ? codes[d] : 0) ^ 0x80);
      }
      *ScaleAt(tile, hp, row) = r.scale_f16;
      *MinAt(tile, hp, row) = r.min_f16;
      return;
    }
  }
}

void KvFormat::LoadKey(const uint8_t* tile, int row, float* x) const {
  const int hp = padded_dim;
  switch (dtype) {
    case KvDType::kF32:
      std::memcpy(x, tile + int64_t{row} * head_dim * 4, head_dim * sizeof(float));
      return;
    case KvDType::kF16:
      for (int d = 0; d < head_dim; ++d) x[d] = HalfToFloat(*Half(tile, d * 16 + row));
      return;
    case KvDType::kInt8: {
      const float scale = HalfToFloat(*ScaleAt(tile, hp, row));
      const float min = HalfToFloat(*MinAt(tile, hp, row));
      for (int d = 0; d < head_dim; ++d) {
        x[d] = static_cast<float>(double{scale} * tile[Int8KeyIndex(d, row)] + min);
      }
      return;
    }
  }
}

void KvFormat::LoadValue(const uint8_t* tile, int row, float* x) const {
  const int hp = padded_dim;
  switch (dtype) {
    case KvDType::kF32:
      std::memcpy(x, tile + int64_t{row} * head_dim * 4, head_dim * sizeof(float));
      return;
    case KvDType::kF16:
      for (int d = 0; d < head_dim; ++d) x[d] = HalfToFloat(*Half(tile, row * hp + d));
      return;
    case KvDType::kInt8: {
      const float scale = HalfToFloat(*ScaleAt(tile, hp, row));
      const float min = HalfToFloat(*MinAt(tile, hp, row));
      for (int d = 0; d < head_dim; ++d) {
        const int code = static_cast<int8_t>(tile[Int8ValueIndex(d, row)]) + 128;
        x[d] = static_cast<float>(double{scale} * code + min);
      }
      return;
    }
  }
}

}  // namespace ellm
