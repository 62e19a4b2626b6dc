#include "core/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace ellm {
namespace {

uint64_t Xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t{edx} << 32) | eax;
}

CpuFeatures Detect() {
  CpuFeatures f;
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = (ecx >> 27) & 1, avx = (ecx >> 28) & 1;
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = Xgetbv0();
  const bool os_avx = (xcr0 & 0x6) == 0x6;              // XMM and YMM state
  const bool os_avx512 = os_avx && (xcr0 & 0xE0) == 0xE0;  // opmask, ZMM hi256, hi16 ZMM
  if (!os_avx) return f;
  f.fma = (ecx >> 12) & 1;
  f.f16c = (ecx >> 29) & 1;
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  f.avx2 = (ebx >> 5) & 1;
  f.bmi1 = (ebx >> 3) & 1;
  f.bmi2 = (ebx >> 8) & 1;
  if (os_avx512) {
    f.avx512f = (ebx >> 16) & 1;
    f.avx512dq = (ebx >> 17) & 1;
    f.avx512bw = (ebx >> 30) & 1;
    f.avx512vl = (ebx >> 31) & 1;
    f.avx512_vnni = (ecx >> 11) & 1;
    f.avx512_vbmi = (ecx >> 1) & 1;
  }
  f.amx_tile = (edx >> 24) & 1;
  f.amx_int8 = (edx >> 25) & 1;
  f.amx_bf16 = (edx >> 22) & 1;
  const unsigned subleaves = eax;
  if (subleaves >= 1) {
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    f.avx_vnni = (eax >> 4) & 1;
    f.avx512_bf16 = os_avx512 && ((eax >> 5) & 1);
  }
  return f;
}

}  // namespace

const CpuFeatures& Cpu() {
  static const CpuFeatures features = Detect();
  return features;
}

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAuto: return "auto";
    case Isa::kReference: return "reference";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx2Vnni: return "avx2-vnni";
    case Isa::kAvx512: return "avx512";
    case Isa::kAmx: return "amx";
  }
  return "?";
}

absl::StatusOr<Isa> ParseIsa(std::string_view name) {
  if (name == IsaName(Isa::kAuto)) return Isa::kAuto;
  for (Isa isa : kAllIsas) {
    if (name == IsaName(isa)) return isa;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown instruction set '", ToAbsl(name),
      "' (expected auto, reference, avx2, avx2-vnni, avx512 or amx)"));
}

bool CpuHas(Isa isa) {
  const CpuFeatures& f = Cpu();
  switch (isa) {
    case Isa::kAuto:
    case Isa::kReference: return true;
    case Isa::kAvx2: return f.Avx2Set();
    case Isa::kAvx2Vnni: return f.Avx2Set() && f.avx_vnni;
    case Isa::kAvx512: return f.Avx512Set();
    case Isa::kAmx:
      return f.Avx512Set() && f.avx512_bf16 && f.avx512_vbmi && f.amx_tile && f.amx_int8 && f.amx_bf16 &&
             AmxTileStateGranted();
  }
  return false;
}

bool AmxTileStateGranted() {
  static const bool granted = [] {
    const CpuFeatures& f = Cpu();
    if (!f.amx_tile || !f.amx_int8) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

}  // namespace ellm
