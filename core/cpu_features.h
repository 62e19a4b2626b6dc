// The CPU's instruction-set extensions, read once from CPUID and XGETBV
// (whether the OS saves the AVX and AVX-512 register state): the one place
// every kernel dispatcher asks. (Compilers' __builtin_cpu_supports differ in
// the names they know: clang 14 knows neither "f16c" nor "avxvnni".)
#pragma once

namespace ellm {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx_vnni = false;     // VEX VPDPBUSD on 256-bit vectors
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_vnni = false;
  bool amx_tile = false, amx_int8 = false;  // CPUID only: the kernel's permission is asked separately
  // The AVX2 kernels' baseline (AVX2 + FMA + F16C) and the AVX-512 one
  // (F, BW, VL, DQ, VNNI): what the dispatchers test.
  bool Avx2Set() const { return avx2 && fma && f16c; }
  bool Avx512Set() const { return Avx2Set() && avx512f && avx512bw && avx512vl && avx512dq && avx512_vnni; }
};

// Detected on first use.
const CpuFeatures& Cpu();

}  // namespace ellm
