#include "core/dtype.h"

#include <bit>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/quants.h"

namespace ellm {
namespace {

static_assert(std::endian::native == std::endian::little,
              "ellm reads little-endian tensor data in place");

// The one table. Block sizes are ggml's; the converters are core/quants.h's,
// and types without them cannot be read (or written) yet.
constexpr DTypeTraits kTraits[] = {
    {DType::kF32, "f32", 1, sizeof(float), DequantizeRowF32, QuantizeRowF32},
    {DType::kF16, "f16", 1, sizeof(uint16_t), DequantizeRowF16, QuantizeRowF16},
    {DType::kQ4_0, "q4_0", kQK, sizeof(BlockQ4_0), DequantizeRowQ4_0, QuantizeRowQ4_0},
    {DType::kQ4_1, "q4_1", kQK, sizeof(BlockQ4_1), nullptr, nullptr},
    {DType::kQ5_0, "q5_0", kQK, sizeof(BlockQ5_0), nullptr, nullptr},
    {DType::kQ5_1, "q5_1", kQK, sizeof(BlockQ5_1), nullptr, nullptr},
    {DType::kQ8_0, "q8_0", kQK, sizeof(BlockQ8_0), DequantizeRowQ8_0, QuantizeRowQ8_0},
    {DType::kQ8_1, "q8_1", kQK, sizeof(BlockQ8_1), nullptr, nullptr},
    {DType::kQ2_K, "q2_K", kQK_K, sizeof(BlockQ2_K), nullptr, nullptr},
    {DType::kQ3_K, "q3_K", kQK_K, sizeof(BlockQ3_K), nullptr, nullptr},
    {DType::kQ4_K, "q4_K", kQK_K, sizeof(BlockQ4_K), DequantizeRowQ4_K, QuantizeRowQ4_K},
    {DType::kQ5_K, "q5_K", kQK_K, sizeof(BlockQ5_K), DequantizeRowQ5_K, QuantizeRowQ5_K},
    {DType::kQ6_K, "q6_K", kQK_K, sizeof(BlockQ6_K), DequantizeRowQ6_K, QuantizeRowQ6_K},
    {DType::kQ8_K, "q8_K", kQK_K, sizeof(BlockQ8_K), nullptr, nullptr},
    {DType::kBF16, "bf16", 1, sizeof(uint16_t), DequantizeRowBf16, QuantizeRowBf16},
};

}  // namespace

absl::Span<const DTypeTraits> AllDTypeTraits() { return kTraits; }

const DTypeTraits* FindDTypeTraits(uint32_t type_id) {
  for (const DTypeTraits& t : kTraits) {
    if (static_cast<uint32_t>(t.type) == type_id) return &t;
  }
  return nullptr;
}

const DTypeTraits& Traits(DType type) {
  const DTypeTraits* t = FindDTypeTraits(static_cast<uint32_t>(type));
  // Only reachable by casting an arbitrary integer to DType: a bug.
  ELLM_CHECK(t != nullptr, absl::StrCat("Traits() called with invalid DType ", static_cast<unsigned>(type)));
  return *t;
}

absl::StatusOr<uint64_t> DTypeBytes(DType type, uint64_t elements) {
  const DTypeTraits& t = Traits(type);
  const uint64_t block_elements = static_cast<uint64_t>(t.block_elements);
  if (elements % block_elements != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(elements, " elements is not a whole number of ", ToAbsl(t.name),
                     " blocks (", block_elements, " elements each)"));
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(elements / block_elements,
                             static_cast<uint64_t>(t.block_bytes), &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "size of ", elements, " ", ToAbsl(t.name), " elements overflows 64 bits"));
  }
  return bytes;
}

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
// IEEE binary32: 1 sign, 8 exponent (bias 127), 23 mantissa bits.
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    // Inf or NaN; the NaN payload moves to the top of the float mantissa.
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + (127 - 15)) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;  // ±0
  } else {
    // Subnormal: mant * 2^-24. Normalize so the leading 1 lands on bit 10,
    // lowering the exponent once per shift.
    int e = 1 - 15;  // exponent of the subnormal range
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    mant &= 0x3ffu;
    bits = sign | (static_cast<uint32_t>(e + 127) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

uint16_t FloatToHalf(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {
    if (abs == 0x7f800000u) return sign | 0x7c00u;  // ±inf
    // NaN: keep the top payload bits and force a quiet NaN so that the
    // payload cannot truncate to zero (which would read as inf).
    return sign | 0x7e00u | static_cast<uint16_t>((abs & 0x7fffffu) >> 13);
  }
  const int32_t exp = static_cast<int32_t>(abs >> 23);  // biased float exponent
  const int32_t half_exp = exp - 127 + 15;
  if (half_exp >= 0x1f) return sign | 0x7c00u;  // too large even before rounding
  if (half_exp >= 1) {
    // Normal half: keep the top 10 mantissa bits, round the 13 dropped bits
    // to nearest even. A carry out of the mantissa bumps the exponent, and
    // past the largest exponent gives exactly the inf encoding.
    uint32_t h = (static_cast<uint32_t>(half_exp) << 10) | ((abs & 0x7fffffu) >> 13);
    const uint32_t rest = abs & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return sign | static_cast<uint16_t>(h);
  }
  // Subnormal half (or zero): count in units of 2^-24. The value is
  // m * 2^(exp - 150) with the implicit bit in m, i.e. m >> (126 - exp) units.
  if (abs <= 0x33000000u) return sign;  // <= 2^-25: rounds to ±0 (ties to even)
  const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
  const int shift = 126 - exp;  // 14..24 here
  uint32_t h = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1);
  const uint32_t halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (h & 1u))) ++h;  // may reach 0x400: min normal
  return sign | static_cast<uint16_t>(h);
}

// bfloat16 is the top half of a binary32.
float Bf16ToFloat(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

uint16_t FloatToBf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN stays a (quiet) NaN
  }
  // Round to nearest even on the 16 dropped bits; overflow carries into inf.
  const uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

}  // namespace ellm
