// Reference (plain-loop) row converters between float and the GGUF/ggml
// weight types ellm reads: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K.
// The traits table in core/dtype.cc points at these; call them through it.
//
// Every function converts one row of `n` values, `n` a multiple of the
// type's block_elements (1, 32 or 256): n / block_elements consecutive blocks.
// Halves are IEEE binary16 bit patterns (HalfToFloat / FloatToHalf).
//
// Byte layouts (ggml's, element indices within one block):
//
//   Q8_0  {d; qs[32]}          x[i] = d * qs[i]                 (qs int8)
//   Q4_0  {d; qs[16]}          x[i]      = d * ((qs[i] & 15) - 8)   i < 16
//                              x[i + 16] = d * ((qs[i] >> 4) - 8)
//
//   K-quants: a 256-element super-block of sub-blocks.
//
//   Q4_K  {d, dmin; scales[12]; qs[128]}: 8 sub-blocks of 32, each with a
//         6-bit scale sc[j] and 6-bit min m[j] packed in scales[12]:
//           j < 4:  sc[j] = scales[j] & 63            m[j] = scales[j + 4] & 63
//           j >= 4: sc[j] = (scales[j + 4] & 15) | (scales[j - 4] >> 6) << 4
//                   m[j]  = (scales[j + 4] >> 4) | (scales[j]     >> 6) << 4
//         Values come in 4 chunks of 64: chunk c (elements 64c..64c+63) uses
//         qs[32c .. 32c+31]; the low nibble of qs[32c + l] is element 64c + l
//         (sub-block 2c), the high nibble is element 64c + 32 + l (2c + 1).
//           x = d * sc[j] * q - dmin * m[j],   q in [0, 15]
//   Q5_K  {d, dmin; scales[12]; qh[32]; qs[128]}: as Q4_K with a 5th bit:
//         element 64c + l takes bit 2c of qh[l], element 64c + 32 + l takes
//         bit 2c + 1 of qh[l] (as +16).  q in [0, 31].
//   Q6_K  {ql[128]; qh[64]; scales[16] (int8); d}: 16 sub-blocks of 16
//         (sub-block of element e is e / 16). Two halves of 128; half h uses
//         ql[64h ..], qh[32h ..]. For l in [0, 32), element 128h + 32k + l:
//           low 4 bits:  k=0: ql[l] & 15,  k=1: ql[l+32] & 15,
//                        k=2: ql[l] >> 4,  k=3: ql[l+32] >> 4
//           high 2 bits: (qh[l] >> 2k) & 3
//           x = d * scales[e / 16] * (q - 32),   q in [0, 63]
//
// Quantisers take finite input (values whose scales fit a half). Q8_0 and
// Q4_0 follow ggml's reference rule (amax scale, round to nearest); the
// K-quant quantisers are our own least-squares scale search, not ggml's, so
// their blocks differ from llama.cpp's but are read identically.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace ellm {

// Plain types: one element per block.
void DequantizeRowF32(const void* src, float* dst, int64_t n);
void DequantizeRowF16(const void* src, float* dst, int64_t n);
void DequantizeRowBf16(const void* src, float* dst, int64_t n);
void QuantizeRowF32(const float* src, void* dst, int64_t n);
void QuantizeRowF16(const float* src, void* dst, int64_t n);   // round to nearest even
void QuantizeRowBf16(const float* src, void* dst, int64_t n);  // round to nearest even

void DequantizeRowQ8_0(const void* src, float* dst, int64_t n);
void DequantizeRowQ4_0(const void* src, float* dst, int64_t n);
void DequantizeRowQ4_K(const void* src, float* dst, int64_t n);
void DequantizeRowQ5_K(const void* src, float* dst, int64_t n);
void DequantizeRowQ6_K(const void* src, float* dst, int64_t n);

void QuantizeRowQ8_0(const float* src, void* dst, int64_t n);
void QuantizeRowQ4_0(const float* src, void* dst, int64_t n);
void QuantizeRowQ4_K(const float* src, void* dst, int64_t n);
void QuantizeRowQ5_K(const float* src, void* dst, int64_t n);
void QuantizeRowQ6_K(const float* src, void* dst, int64_t n);

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block's
// packed scales[12] (the table above), and its inverse.
void UnpackScaleMinK4(const uint8_t* scales, int j, uint8_t* sc, uint8_t* m);
// The levels of a super-block's 256 elements, in element order, as the bits
// store them: Q4_K 0..15, Q5_K 0..31 (x = d sc level - dmin m of the
// element's sub-block of 32), Q6_K 0..63 (x = d scale (level - 32), scale of
// its sub-block of 16). The one decoding of these bit layouts; the
// dequantisers and the CPU kernels' repacking use it.
void UnpackLevelsQ4_K(const BlockQ4_K& b, int levels[kQK_K]);
void UnpackLevelsQ5_K(const BlockQ5_K& b, int levels[kQK_K]);
void UnpackLevelsQ6_K(const BlockQ6_K& b, int levels[kQK_K]);
void PackScaleMinK4(uint8_t* scales, int j, uint8_t sc, uint8_t m);

}  // namespace ellm
