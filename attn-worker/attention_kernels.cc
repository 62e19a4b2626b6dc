#include "attn-worker/attention_kernels.h"

#include "core/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace ellm::attn {
namespace {

const AttentionKernel kReference{"reference", 127, 255, internal::AttendChunkReference,
                                 internal::AttendChunkReference};
const AttentionKernel kAvx2{"avx2", 63, 127, internal::AttendF16Avx2, internal::AttendInt8Avx2};
const AttentionKernel kAvx2Vnni{"avx2-vnni", 127, 255, internal::AttendF16Avx2,
                                internal::AttendInt8Avx2Vnni};
const AttentionKernel kAvx512{"avx512", 127, 255, internal::AttendF16Avx512,
                              internal::AttendInt8Avx512};
const AttentionKernel kAmx{"amx", 127, 255, internal::AttendF16Avx512, internal::AttendInt8Amx};

bool HasAvx2() { return Cpu().Avx2Set(); }
bool HasAvxVnni() { return Cpu().Avx2Set() && Cpu().avx_vnni; }
bool HasAvx512() { return Cpu().Avx512Set(); }

// AMX-TILE and AMX-INT8 (CPUID leaf 7 EDX bits 24 and 25; GCC 12's
// __builtin_cpu_supports does not know them), and Linux's permission to use
// the tile data state, asked once per process (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA): without it the first tile instruction faults.
bool HasAmx() {
  static const bool has = [] {
    if (!HasAvx512()) return false;
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if ((edx & (1u << 24)) == 0 || (edx & (1u << 25)) == 0) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
}

}  // namespace

void PrepareQueries(const float* q, int rows, int head_dim, int q_max, QueryPrep* prep,
                    ThreadPool* pool) {
  const int hp = (head_dim + 15) / 16 * 16;
  prep->rows = rows;
  prep->head_dim = head_dim;
  prep->padded_dim = hp;
  prep->score_scale = static_cast<float>(M_LOG2E / std::sqrt(static_cast<double>(head_dim)));
  prep->raw.Resize(static_cast<size_t>(rows) * hp);
  prep->scaled.Resize(static_cast<size_t>(rows) * hp);
  prep->codes.Resize(static_cast<size_t>(rows) * hp);
  prep->code_scale.resize(rows);
  prep->code_sum.resize(rows);
  // Rows are independent: a prefill step's (tokens x heads) split over the pool.
  auto prepare = [&](int64_t r_begin, int64_t r_end, int) {
  for (int64_t r = r_begin; r < r_end; ++r) {
    const float* x = q + static_cast<size_t>(r) * head_dim;
    float* raw = prep->raw.data() + static_cast<size_t>(r) * hp;
    float* scaled = prep->scaled.data() + static_cast<size_t>(r) * hp;
    int8_t* codes = prep->codes.data() + static_cast<size_t>(r) * hp;
    float amax = 0;
    for (int d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float sq = amax / static_cast<float>(q_max);
    const float inv = sq > 0 ? 1.0f / sq : 0.0f;
    int32_t sum = 0;
    for (int d = 0; d < hp; ++d) {
      const float v = d < head_dim ? x[d] : 0.0f;
      raw[d] = v;
      scaled[d] = v * prep->score_scale;
      // Round half away from zero (no libm call), within ±q_max.
      const float x = v * inv;
      const int c = static_cast<int>(x + (x >= 0 ? 0.5f : -0.5f));
      codes[d] = static_cast<int8_t>(std::clamp(c, -q_max, q_max));
      sum += codes[d];
    }
    prep->code_scale[r] = sq * prep->score_scale;
    prep->code_sum[r] = sum;
  }
  };
  if (pool != nullptr && pool->size() > 1 && rows >= 256) {
    pool->ParallelFor(rows, prepare);
  } else {
    prepare(0, rows, 0);
  }
}

size_t ChunkScratchFloats(int n_tokens, int group) {
  return static_cast<size_t>(n_tokens) * group * internal::kHeadScratchFloats + 64;
}

internal::ChunkStart internal::StartChunk(const ChunkArgs& a) {
  constexpr int64_t kPrefetchBytes = 2048;
  const int hp = a.kv.format.padded_dim, pf = PartialFloats(hp), rows = a.n_tokens * a.group;
  for (int x = 0; x < rows; ++x) Partial(a.partials + static_cast<size_t>(x) * pf, hp).Clear();
  std::fill_n(a.scratch, static_cast<size_t>(rows) * kHeadScratchFloats, 0.0f);
  ChunkStart c;
  c.end = a.pos_begin;
  for (int i = 0; i < a.n_tokens; ++i) c.end = std::max(c.end, std::min(a.pos_end, a.last_pos[i] + 1));
  c.prefetch_end = std::max(c.end, std::min(a.kv.length, a.prefetch_end));
  const int64_t tile = a.kv.format.tile_bytes;
  c.prefetch_tiles = std::max<int>(1, static_cast<int>((kPrefetchBytes + tile / 2) / tile));
  return c;
}

absl::StatusOr<KernelChoice> ParseKernelChoice(absl::string_view name) {
  if (name == "auto") return KernelChoice::kAuto;
  if (name == "reference") return KernelChoice::kReference;
  if (name == "avx2") return KernelChoice::kAvx2;
  if (name == "avx2-vnni") return KernelChoice::kAvx2Vnni;
  if (name == "avx512") return KernelChoice::kAvx512;
  if (name == "amx") return KernelChoice::kAmx;
  return absl::InvalidArgumentError(absl::StrCat("unknown attention kernel '", name,
                                                 "' (expected auto, reference, avx2, avx2-vnni, "
                                                 "avx512 or amx)"));
}

absl::StatusOr<const AttentionKernel*> SelectKernel(KernelChoice choice) {
  switch (choice) {
    case KernelChoice::kAuto:
      // amx is not considered: it measured slower than avx512 (see the header).
      if (HasAvx512()) return &kAvx512;
      if (HasAvxVnni()) return &kAvx2Vnni;
      if (HasAvx2()) return &kAvx2;
      return &kReference;
    case KernelChoice::kReference:
      return &kReference;
    case KernelChoice::kAvx2:
      if (HasAvx2()) return &kAvx2;
      return absl::UnavailableError("this CPU lacks AVX2, FMA or F16C");
    case KernelChoice::kAvx2Vnni:
      if (HasAvxVnni()) return &kAvx2Vnni;
      return absl::UnavailableError("this CPU lacks AVX2, FMA, F16C or AVX-VNNI");
    case KernelChoice::kAvx512:
      if (HasAvx512()) return &kAvx512;
      return absl::UnavailableError("this CPU lacks AVX-512 F/BW/VL/DQ/VNNI");
    case KernelChoice::kAmx:
      if (HasAmx()) return &kAmx;
      return absl::UnavailableError(
          "this CPU lacks AVX-512 or AMX-TILE/INT8, or Linux refused the AMX tile state");
  }
  return absl::InvalidArgumentError("bad kernel choice");
}

std::vector<const AttentionKernel*> AvailableKernels() {
  std::vector<const AttentionKernel*> out = {&kReference};
  for (KernelChoice c : {KernelChoice::kAvx2, KernelChoice::kAvx2Vnni, KernelChoice::kAvx512,
                         KernelChoice::kAmx}) {
    absl::StatusOr<const AttentionKernel*> k = SelectKernel(c);
    if (k.ok()) out.push_back(*k);
  }
  return out;
}

}  // namespace ellm::attn
