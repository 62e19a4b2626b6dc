// Peak throughput of the dot-product instructions the kernels use, measured
// on the benchmark's own threads in its own process: the compute roof that a
// compute-bound kernel's multiply-adds per second are judged against (as a
// bandwidth-bound one is judged against the read probe).
#pragma once

#include <string>
#include <string_view>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/kv_format.h"
#include "core/thread_pool.h"

namespace ellm::bench {

enum class DotUnit {
  kAvx512Vnni,  // VPDPBUSD zmm: 64 u8 x s8 multiply-adds
  kAvxVnni,     // VPDPBUSD ymm (AVX-VNNI): 32
  kAvx2Madd,    // VPMADDUBSW + VPMADDWD + VPADDD ymm: 32 per three instructions
  kAvx2Madd16,  // VPMADDUBSW + VPADDW ymm (int16 sums, widened now and then): 32 per two
  kAvx512Fma,   // VFMADD zmm f32: 16
  kAvx2Fma,     // VFMADD ymm f32: 8
  kAmxInt8,     // TDPBSUD on full tiles (16 x 16 x 64): 16384
  kAmxBf16,     // TDPBF16PS on full tiles (16 x 16 x 32): 8192
};

std::string DotUnitName(DotUnit unit);  // "vpdpbusd-zmm", ...
bool DotUnitSupported(DotUnit unit);
// Multiply-adds per second (in G) of `unit` with every thread of `pool`
// running independent chains; 0 when the CPU lacks it.
double PeakGmacs(DotUnit unit, ThreadPool& pool);

// `ellm-bench peak`: every supported unit's peak, and VPDPBUSD zmm's rate
// (G instructions/s) with its 4-byte groups from broadcasts.
int PeakMain(int argc, char** argv);

// The instruction the matrix kernels of `isa` (resolved: not kAuto) run
// their inner loops on for weights of `type`: integer dot products for the
// quantized types (amx: the bf16 tile unit), f32 FMAs for F16, BF16 and F32.
DotUnit MatrixDotUnit(Isa isa, DType type);

// The instruction the inner loops of the attention kernel named `kernel`
// (AttentionKernel::name, e.g. "avx2-vnni") run for `dtype`: int8 on integer
// dot products, f16 on f32 FMAs. The reference kernel is judged as avx2.
// amx's int8 prefill (`prefill`: chunks of several tokens) runs q·K on
// TDPBSUD and p·V on TDPBF16PS: it is held against the slower, TDPBF16PS.
DotUnit AttentionDotUnit(std::string_view kernel, KvDType dtype, bool prefill = false);

}  // namespace ellm::bench
