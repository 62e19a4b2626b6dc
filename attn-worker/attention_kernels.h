// Attention kernels over the paged KV cache, for f16 and int8 KV (f32 KV
// keeps core/kernels.h's AttendOneHead: the pipeline's bit-exact path).
//
// The unit of work is one chunk: for the n_tokens query tokens of one
// sequence (a decode token, or a few tokens of a prefill chunk) and the
// `group` query heads of one KV head, a kernel computes the online-softmax
// partial (partial.h) of every (token, head) over positions
// [pos_begin, pos_end), token i seeing only positions <= last_pos[i]. Each K
// and V tile is read once for all heads of the group and all tokens.
// Callers split a sequence into chunks across the thread pool and merge the
// partials with Partial::Merge, always in chunk order.
//
// Kernels (chosen once at start-up from what the CPU supports; tests may force
// any that the CPU can run):
//   reference  plain loops, fp64 accumulation, exact softmax per chunk, the
//              unquantised query: the oracle the others are tested against.
//   avx512     AVX-512 F/BW/VL/VNNI + F16C. int8: scores with VPDPBUSD
//              (K codes u8 x query codes s8), p·V with VPDPBUSD (weights u8
//              x V codes s8); f16: VCVTPH2PS + FMA.
//   amx        decode (one token a chunk): avx512 with the int8 scores
//              (q·K) on the AMX tile unit: TDPBSUD with A = the query codes
//              of the group's heads (s8, one row per head, up to 16) and B =
//              the K tile's code lines as stored (u8, the VNNI layout), C =
//              int32 scores [heads][16 positions]; everything else (softmax,
//              p·V) is avx512's code. Bit-identical to avx512 (the int32 dot
//              products are exact). On its own it measured slower than
//              avx512 on the Sapphire Rapids VM (TILELOADD of K lines that
//              are not yet in L1 stalls far longer than vector loads do, and
//              the VNNI score loop is only part of the per-tile work).
//              Prefill (several tokens a chunk, head dims a multiple of 64 up
//              to 256, up to 16 heads): both products on tiles, 16 rows
//              (token, head) at a time, p·V in bfloat16 with o summed by the
//              tile unit (attention_avx512.cc, AttendRowsBf16). Its results
//              differ from avx512's by rounding, and a token alone in its
//              chunk takes the decode path, so a prompt's rounding depends
//              on how its prefill was cut into steps: auto never picks amx.
//              (Decode through the same bf16 path, which would make amx's
//              results batch-independent, read 0.40-0.49 of the read probe
//              in `ellm-bench attention --positions 16K,64K --threads all`,
//              against avx512's 0.71-0.98.)
//              Measured on Xeon family 6 model 207, 2 threads, ellm-bench
//              prefill at 16K with --matmul-isa amx: attention 11.4-12.9 s
//              against avx512's 15.5-15.9 (784-873 against 696-708 tokens/s);
//              the prefill item bench (one thread, hd 128 / 64): 298-316 /
//              224 against 216 / 168 G multiply-adds/s. Tried first and not
//              kept: the int8 scheme with p·V on tiles, 5% faster at 16K, as
//              the per-pair weight codes and the vector update of o per pair
//              and row (29% of the item time) stayed. Later (the same VM,
//              another day): each 16 rows' p·V as soon as their weights are
//              done, and V widened by VPERMB: item bench 340-347 -> 371 /
//              241-243 -> 259-262 G multiply-adds/s, attention at 16K 9.96
//              -> 9.22-9.34 s. What bounds it: per 16 rows and step of 64
//              positions (counted from the code, not profiled) the tile
//              unit needs about 384 cycles (8 TDPBSUD, 16 TDPBF16PS), the
//              vector units about 650 at two instructions a cycle (the
//              softmax, about 14 instructions per 16 scores, and a fifth of
//              the step's V conversion at 80 rows), so it cannot pass about
//              0.4 of the bf16 tile peak even with the two fully overlapped.
//              Needs AMX-TILE/INT8/BF16, AVX512-BF16, AVX512-VBMI and the
//              kernel's permission for the tile state (arch_prctl, asked
//              once).
//   avx2-vnni  AVX2 + FMA + F16C + AVX-VNNI (VEX VPDPBUSD), 8 lanes.
//   avx2       AVX2 + FMA + F16C; int8 products with VPMADDUBSW + VPMADDWD,
//              whose int16 pair sums need query codes within ±63 and weight
//              codes within 0..127.
// Each SIMD file compiles only its own functions for its instruction set
// (function target attributes); the build baseline stays generic x86-64.
//
// Int8 arithmetic (SIMD kernels). The query row q is quantised once per step:
// codes c = round(q / sq), sq = max|q| / q_max. With K codes kc (k = ks·kc +
// kmin), the base-2 score is
//   s = log2(e)/sqrt(hd) · sq · (ks · sum(c·kc) + kmin · sum(c)).
// Per tile of 16 positions (avx512 and amx: per pair of consecutive tiles of
// a chunk, the last tile alone when the count is odd) and query head, the
// weights w_t = p_t · vs_t (p_t = 2^(s_t - m)) are quantised to u8 codes
// against their maximum, and
//   o += (max w / p_max) · sum_t code_t · vc_t  +  sum_t p_t · (vmin_t + 128·vs_t)
// with V codes vc (s8). Both sums over codes run in int32 on VPDPBUSD.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/strings/string_view.h"
#include "attn-worker/partial.h"
#include "core/cpu_features.h"
#include "core/kv_format.h"
#include "core/status.h"
#include "core/thread_pool.h"

namespace ellm::attn {

// 64-byte aligned storage that keeps its capacity across steps.
template <typename T>
class AlignedArray {
 public:
  T* data() const { return data_.get(); }
  size_t size() const { return size_; }
  // Grows (contents are lost when it reallocates) and sets size().
  void Resize(size_t n) {
    if (n > capacity_) {
      const size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
      data_.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
      capacity_ = n;
    }
    size_ = n;
  }
  T& operator[](size_t i) const { return data_.get()[i]; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  size_t size_ = 0, capacity_ = 0;
};

// The form of the query rows a kernel reads (AttentionKernel::QueryFormFor).
enum class QueryForm {
  kRaw,     // raw: q as given (the reference kernel)
  kScaled,  // scaled: q * score_scale (f16 SIMD kernels)
  kCodes,   // codes, code_scale, code_sum (int8 SIMD kernels)
};

// The query rows of one step, prepared once in the form the kernel reads:
// rows are (token, query head) in the request's order, each padded to hp
// dims.
struct QueryPrep {
  int rows = 0;
  int head_dim = 0;
  int padded_dim = 0;
  float score_scale = 0;         // log2(e) / sqrt(head_dim)
  AlignedArray<float> raw;       // [rows][hp] q as given
  AlignedArray<float> scaled;    // [rows][hp] q * score_scale
  AlignedArray<int8_t> codes;    // [rows][hp] int8 query codes
  std::vector<float> code_scale;  // [rows] sq * score_scale
  std::vector<int32_t> code_sum;  // [rows] sum of codes
};

struct ChunkArgs {
  KvSeqView kv;               // the sequence's K and V of one (layer, KV head)
  int group = 1;              // query heads of the KV head
  int pos_begin = 0;          // chunk positions [pos_begin, pos_end);
  int pos_end = 0;            //   pos_begin % kTile == 0, pos_end <= kv.length
  // Positions the kernel may prefetch ahead up to (0: pos_end), at most
  // kv.length: the end of the run of chunks the caller goes on with, so the
  // memory stream does not stall at every chunk boundary.
  int prefetch_end = 0;
  int n_tokens = 0;           // query tokens, at most kMaxChunkTokens
  const int32_t* last_pos = nullptr;  // [n_tokens] token i sees positions <= last_pos[i]
  const QueryPrep* q = nullptr;
  int q_row0 = 0;             // q row of (token i, head j) = q_row0 + i * q_token_stride + j
  int q_token_stride = 0;
  float* partials = nullptr;  // out: [n_tokens][group] partials of PartialFloats(hp) floats, 64-byte aligned
  float* scratch = nullptr;   // ChunkScratchFloats(n_tokens, group) floats, 64-byte aligned
};
inline constexpr int kMaxChunkTokens = 16;
size_t ChunkScratchFloats(int n_tokens, int group);

using AttendChunkFn = void (*)(const ChunkArgs&);

struct AttentionKernel {
  std::string_view name;
  int q_max = 127;  // int8 query codes
  int p_max = 255;  // int8 attention-weight codes
  AttendChunkFn f16 = nullptr;
  AttendChunkFn int8 = nullptr;
  bool reference = false;  // reads the raw query (any dtype)
  AttendChunkFn For(KvDType dtype) const { return dtype == KvDType::kF16 ? f16 : int8; }
  // The QueryPrep form the kernel reads for `dtype`.
  QueryForm QueryFormFor(KvDType dtype) const {
    return reference ? QueryForm::kRaw : dtype == KvDType::kF16 ? QueryForm::kScaled : QueryForm::kCodes;
  }
};

// Fills the forms of `prep` that `kernel` reads for `dtype` from q
// [rows][head_dim] f32 (int8 codes lie in [-q_max, q_max]). Many rows (a
// prefill step) are split over `pool` when given.
void PrepareQueries(const AttentionKernel& kernel, KvDType dtype, const float* q, int rows, int head_dim,
                    QueryPrep* prep, ThreadPool* pool = nullptr);

// The kernel for `choice` (core/cpu_features.h; kAuto: the fastest this CPU
// runs, amx excluded); its name is IsaName(choice). Unavailable when the CPU
// lacks the instructions.
absl::StatusOr<const AttentionKernel*> SelectKernel(Isa choice = Isa::kAuto);
// Every kernel this CPU can run, the reference first.
std::vector<const AttentionKernel*> AvailableKernels();

// Per-ISA entry points (attention_ref.cc, attention_avx2.cc, attention_avx512.cc).
namespace internal {
void AttendChunkReference(const ChunkArgs& args);
void AttendF16Avx2(const ChunkArgs& args);
void AttendInt8Avx2(const ChunkArgs& args);
void AttendInt8Avx2Vnni(const ChunkArgs& args);
void AttendF16Avx512(const ChunkArgs& args);
void AttendInt8Avx512(const ChunkArgs& args);
void AttendInt8Amx(const ChunkArgs& args);  // in attention_avx512.cc
// One query row's int8 codes (attention_avx2.cc; every int8 SIMD kernel's
// CPU has AVX2): codes[d] = round(x[d] / sq) (half away from zero) for d <
// head_dim, 0 up to hp, sq = max|x| / q_max. Returns sq; *sum = sum of codes.
float QuantizeQueryAvx2(const float* x, int head_dim, int hp, int q_max, int8_t* codes, int32_t* sum);

// Scratch floats per (token, head) row that ChunkScratchFloats provides.
inline constexpr int kHeadScratchFloats = 64;
// What every SIMD kernel does first on a chunk: clears the partials and the
// scratch rows, and says where the chunk ends for its tokens (`end`), how far
// it may prefetch (`prefetch_end`, see ChunkArgs) and how many tiles ahead
// (`prefetch_tiles`: the tile about 2 KiB ahead in each of the K and V
// streams; longer distances measured worse, see attention_avx512.cc).
struct ChunkStart {
  int end, prefetch_end, prefetch_tiles;
};
ChunkStart StartChunk(const ChunkArgs& args);
}  // namespace internal

}  // namespace ellm::attn
