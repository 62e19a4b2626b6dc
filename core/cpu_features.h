// The CPU's instruction-set extensions, read once from CPUID and XGETBV
// (whether the OS saves the AVX and AVX-512 register state): the one place
// every kernel dispatcher asks. (Compilers' __builtin_cpu_supports differ in
// the names they know: clang 14 knows neither "f16c" nor "avxvnni".)
#pragma once

#include <string_view>

#include "core/status.h"

namespace ellm {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool bmi1 = false, bmi2 = false;  // the attention kernels' masks (SHLX and friends)
  bool avx_vnni = false;     // VEX VPDPBUSD on 256-bit vectors
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_vnni = false;
  bool avx512_bf16 = false;  // VCVTNE2PS2BF16 and friends
  bool avx512_vbmi = false;  // VPERMB (the amx kernels' bf16 dequantiser)
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;  // CPUID only (CpuHas(kAmx) also asks Linux)
  // The AVX2 kernels' baseline (AVX2 + FMA + F16C + BMI1/2, as every AVX2
  // CPU has, but a VM may hide) and the AVX-512 one (F, BW, VL, DQ, VNNI):
  // what the dispatchers test.
  bool Avx2Set() const { return avx2 && fma && f16c && bmi1 && bmi2; }
  bool Avx512Set() const { return Avx2Set() && avx512f && avx512bw && avx512vl && avx512dq && avx512_vnni; }
};

// Detected on first use.
const CpuFeatures& Cpu();

// The instruction sets ellm's CPU kernels are written for, with one spelling
// on every flag (--attn-kernel, --matmul-isa, --kernel), log line and
// benchmark line (isa=):
//   auto        not a set: the fastest this CPU runs, chosen by each dispatcher
//   reference   plain C++: the oracle every kernel is tested against, and the
//               fallback
//   avx2        AVX2 + FMA + F16C (+ BMI1, BMI2)
//   avx2-vnni   avx2 and AVX-VNNI (VEX VPDPBUSD on 256-bit vectors)
//   avx512      AVX-512 F/BW/VL/DQ + VNNI
//   amx         avx512, AVX512-BF16 and AMX-TILE/INT8/BF16 (Sapphire Rapids and
//               later), with Linux's permission for the tile data state
//               (CpuHas asks it)
enum class Isa { kAuto, kReference, kAvx2, kAvx2Vnni, kAvx512, kAmx };
inline constexpr Isa kAllIsas[] = {Isa::kReference, Isa::kAvx2, Isa::kAvx2Vnni, Isa::kAvx512,
                                   Isa::kAmx};
inline constexpr int kNumIsas = 6;  // with kAuto: the size of a table indexed by Isa

std::string_view IsaName(Isa isa);
// An IsaName; InvalidArgument naming the choices for anything else.
absl::StatusOr<Isa> ParseIsa(std::string_view name);
// Whether this CPU has the instructions of `isa` (kAuto, kReference: true);
// for kAmx, also whether this process may use them.
bool CpuHas(Isa isa);
// Whether Linux lets this process use the AMX tile data state: asked once per
// process (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), false
// without AMX-TILE/INT8. Without it the first tile instruction faults.
bool AmxTileStateGranted();

}  // namespace ellm
