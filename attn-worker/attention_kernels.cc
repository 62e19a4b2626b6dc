#include "attn-worker/attention_kernels.h"

#include "core/cpu_features.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace ellm::attn {
namespace {

const AttentionKernel kReference{"reference", 127, 255, internal::AttendChunkReference,
                                 internal::AttendChunkReference, /*reference=*/true};
const AttentionKernel kAvx2{"avx2", 63, 127, internal::AttendF16Avx2, internal::AttendInt8Avx2};
const AttentionKernel kAvx2Vnni{"avx2-vnni", 127, 255, internal::AttendF16Avx2,
                                internal::AttendInt8Avx2Vnni};
const AttentionKernel kAvx512{"avx512", 127, 255, internal::AttendF16Avx512,
                              internal::AttendInt8Avx512};
const AttentionKernel kAmx{"amx", 127, 255, internal::AttendF16Avx512, internal::AttendInt8Amx};

}  // namespace

void PrepareQueries(const AttentionKernel& kernel, KvDType dtype, const float* q, int rows, int head_dim,
                    QueryPrep* prep, ThreadPool* pool) {
  const int hp = (head_dim + 15) / 16 * 16;
  const QueryForm form = kernel.QueryFormFor(dtype);
  prep->rows = rows;
  prep->head_dim = head_dim;
  prep->padded_dim = hp;
  prep->score_scale = static_cast<float>(M_LOG2E / std::sqrt(static_cast<double>(head_dim)));
  const size_t n = static_cast<size_t>(rows) * hp;
  // Only the form the kernel reads: a prefill step has tens of thousands of
  // rows, and each form costs a pass over them.
  switch (form) {
    case QueryForm::kRaw: prep->raw.Resize(n); break;
    case QueryForm::kScaled: prep->scaled.Resize(n); break;
    case QueryForm::kCodes:
      prep->codes.Resize(n);
      prep->code_scale.resize(rows);
      prep->code_sum.resize(rows);
      break;
  }
  // Rows are independent: a prefill step's (tokens x heads) split over the pool.
  auto prepare = [&](int64_t r_begin, int64_t r_end, int) {
    for (int64_t r = r_begin; r < r_end; ++r) {
      const float* x = q + static_cast<size_t>(r) * head_dim;
      const size_t at = static_cast<size_t>(r) * hp;
      switch (form) {
        case QueryForm::kRaw:
          std::copy_n(x, head_dim, prep->raw.data() + at);
          std::fill(prep->raw.data() + at + head_dim, prep->raw.data() + at + hp, 0.0f);
          break;
        case QueryForm::kScaled: {
          float* scaled = prep->scaled.data() + at;
          for (int d = 0; d < head_dim; ++d) scaled[d] = x[d] * prep->score_scale;
          std::fill(scaled + head_dim, scaled + hp, 0.0f);
          break;
        }
        case QueryForm::kCodes: {
          const float sq = internal::QuantizeQueryAvx2(x, head_dim, hp, kernel.q_max, prep->codes.data() + at,
                                                       &prep->code_sum[r]);
          prep->code_scale[r] = sq * prep->score_scale;
          break;
        }
      }
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
      if (CpuHas(Isa::kAmx)) return &kAmx;
      return absl::UnavailableError(
          "this CPU lacks AVX-512 (F/BW/VL/DQ/VNNI, BF16, VBMI) or AMX-TILE/INT8/BF16, or Linux refused the "
          "AMX tile state");
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
