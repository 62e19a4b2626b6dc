// Tensor element types of GGUF files and the one traits table that describes
// them. Values are the ggml type ids stored in GGUF tensor infos.
#pragma once

#include "absl/types/span.h"

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/status.h"

namespace ellm {

enum class DType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kBF16 = 30,
};

// ggml quantization blocks, byte for byte as ggml stores them. `d`, `m`, `s`
// and `dmin` are IEEE halves (bit patterns; see HalfToFloat), except
// BlockQ8_K::d which is a float. Each block covers block_elements values of
// one row; a row of n values is n / block_elements consecutive blocks.
inline constexpr int kQK = 32;    // elements per block of the legacy formats
inline constexpr int kQK_K = 256; // elements per super-block of the k-quants

struct BlockQ4_0 { uint16_t d; uint8_t qs[kQK / 2]; };                 // 4-bit, x = d * (q - 8)
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[kQK / 2]; };              // 4-bit, x = d * q + m
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[kQK / 2]; };  // 5th bits in qh
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[kQK / 2]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[kQK]; };                      // x = d * q
struct BlockQ8_1 { uint16_t d, s; int8_t qs[kQK]; };                   // s = d * sum(qs)
struct BlockQ2_K { uint8_t scales[kQK_K / 16]; uint8_t qs[kQK_K / 4]; uint16_t d, dmin; };
struct BlockQ3_K { uint8_t hmask[kQK_K / 8]; uint8_t qs[kQK_K / 4]; uint8_t scales[12]; uint16_t d; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[kQK_K / 2]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[kQK_K / 8]; uint8_t qs[kQK_K / 2]; };
struct BlockQ6_K { uint8_t ql[kQK_K / 2]; uint8_t qh[kQK_K / 4]; int8_t scales[kQK_K / 16]; uint16_t d; };
struct BlockQ8_K { float d; int8_t qs[kQK_K]; int16_t bsums[kQK_K / 16]; };

static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ8_1) == 36);
static_assert(sizeof(BlockQ2_K) == 84);
static_assert(sizeof(BlockQ3_K) == 110);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockQ8_K) == 292);

// Converts `n` elements (a multiple of the block size) of a row to float.
using DequantizeFn = void (*)(const void* src, float* dst, int64_t n);
// Converts `n` floats (a multiple of the block size) to n / block_elements
// blocks of the type (reference quantisers, core/quants.h).
using QuantizeFn = void (*)(const float* src, void* dst, int64_t n);

struct DTypeTraits {
  DType type;
  std::string_view name;     // "f32", "q8_0", ...
  int64_t block_elements;    // elements per block (1 for plain types)
  int64_t block_bytes;       // bytes per block
  DequantizeFn dequantize;   // nullptr where ellm cannot read the type yet
  QuantizeFn quantize;       // nullptr where ellm cannot write the type yet
};

// The traits of `type`, or nullptr when the id is not a ggml type ellm knows.
const DTypeTraits* FindDTypeTraits(uint32_t type_id);
// Every type of the table, in its order (e.g. to look one up by name).
absl::Span<const DTypeTraits> AllDTypeTraits();
// The traits of a DType value (a programmer error, fatal, if `type` is not
// one of the enumerators).
const DTypeTraits& Traits(DType type);

// Bytes of `elements` elements; an error when elements is not a whole number
// of blocks or the size overflows.
absl::StatusOr<uint64_t> DTypeBytes(DType type, uint64_t elements);

// IEEE half and bfloat16 conversions (round to nearest even).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float Bf16ToFloat(uint16_t h);
uint16_t FloatToBf16(float f);

}  // namespace ellm
