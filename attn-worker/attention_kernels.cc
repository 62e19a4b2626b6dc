#include "attn-worker/attention_kernels.h"

#include "core/cpu_features.h"

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

// AMX-TILE and AMX-INT8 (core/cpu_features.h), and Linux's permission to
// use the tile data state, asked once per process (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA): without it the first tile instruction faults.
bool HasAmx() {
  static const bool has = [] {
    if (!CpuHas(Isa::kAmx)) return false;
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

absl::StatusOr<const AttentionKernel*> SelectKernel(Isa choice) {
  switch (choice) {
    case Isa::kAuto:
      // amx is not considered: it measured slower than avx512 (see the header).
      if (CpuHas(Isa::kAvx512)) return &kAvx512;
      if (CpuHas(Isa::kAvx2Vnni)) return &kAvx2Vnni;
      if (CpuHas(Isa::kAvx2)) return &kAvx2;
      return &kReference;
    case Isa::kReference:
      return &kReference;
    case Isa::kAvx2:
      if (CpuHas(Isa::kAvx2)) return &kAvx2;
      return absl::UnavailableError("this CPU lacks AVX2, FMA or F16C");
    case Isa::kAvx2Vnni:
      if (CpuHas(Isa::kAvx2Vnni)) return &kAvx2Vnni;
      return absl::UnavailableError("this CPU lacks AVX2, FMA, F16C or AVX-VNNI");
    case Isa::kAvx512:
      if (CpuHas(Isa::kAvx512)) return &kAvx512;
      return absl::UnavailableError("this CPU lacks AVX-512 F/BW/VL/DQ/VNNI");
    case Isa::kAmx:
      if (HasAmx()) return &kAmx;
      return absl::UnavailableError(
          "this CPU lacks AVX-512 or AMX-TILE/INT8, or Linux refused the AMX tile state");
  }
  return absl::InvalidArgumentError(absl::StrCat("no attention kernel for ", ToAbsl(IsaName(choice))));
}

std::vector<const AttentionKernel*> AvailableKernels() {
  std::vector<const AttentionKernel*> out = {&kReference};
  for (Isa c : {Isa::kAvx2, Isa::kAvx2Vnni, Isa::kAvx512, Isa::kAmx}) {
    absl::StatusOr<const AttentionKernel*> k = SelectKernel(c);
    if (k.ok()) out.push_back(*k);
  }
  return out;
}

}  // namespace ellm::attn
