// CPU matrix products on the GGUF weight types: y[t, r] = W[r, :] · x[t, :]
// for T tokens at once, W [rows, cols] kept in its own type (F32, F16, BF16,
// Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) and repacked at load into the layout the
// kernels stream (matmul_layout.h).
//
//   QuantMatrix  one weight matrix, repacked (FromRaw) or fp32 (FromF32).
//   Activations  x [T, cols] of one step, converted on first use to the form
//                the matrix type's kernels read, and reused by every matrix
//                that multiplies the same x (q, k, v; gate, up):
//                  kF32     the floats themselves (F32, F16, BF16 weights);
//                  kQ8x32   int8 codes per block of 32 with an fp32 scale and
//                           the block's code sum (Q8_0, Q4_0 weights);
//                  kQ7x32   the same with codes |code| <= 63 (Q8_0 weights
//                           on plain avx2 with q8_act_bits = 7, see below);
//                  kQ8x256  int8 codes per block of 256 with an fp32 scale,
//                           code sums per 16 and per 32 (the k-quants).
//   MatMul       splits the matrix's groups of 16 output rows across the
//                pool's threads; every row is computed by one thread with the
//                same code, so results do not depend on the thread count.
//
// Kernel sets (core/cpu_features.h Isa), picked once at start-up from what the CPU supports; tests
// and callers may ask for any kernel the CPU can run:
//   reference    plain loops: each row dequantised exactly as core/quants.h
//                does, dotted with the dequantised activations in fp64 (F32:
//                core/kernels.h Dot). The oracle, and the fallback.
//   avx2         AVX2 + FMA + F16C, 8 rows per vector; int8 products with
//                VPMADDUBSW + VPMADDWD. With q8_act_bits = 7 (off by
//                default), Q8_0 weights take 7-bit activation codes
//                (kQ7x32): VPMADDUBSW's int16 pair sums of the stored u8 =
//                code + 128 times |code| <= 63 cannot saturate (2 x 255 x 63
//                = 32130), so a product is 3 vector operations instead of 4
//                (the sign trick 8-bit codes need) and the 4-token tile runs
//                about 20% faster (bench/results/amd-epyc-zen5.md). The cost
//                is the activations' rounding, half a step of max|x| / 63
//                instead of max|x| / 127: on 2-layer random models the
//                logits' error against fp32 weights went from 1.3% to 3.2-3.4%
//                of their rms (CpuBackend.NativeModeIsCloseToF32ForEveryWeightType),
//                more than the k-quants' 1.9-2.2%. Other sets and types ignore it.
//   avx2-vnni    avx2 with AVX-VNNI (VEX VPDPBUSD) for the int8 products:
//                CPUs with AVX-VNNI but no AVX-512 (Alder Lake and later
//                client cores, server parts with AVX-512 off). Gives the same
//                results as avx2 bit for bit on the same activation codes
//                (both integer sums are exact).
//   avx512       AVX-512 F/BW/VL/DQ + VNNI + F16C, 16 rows per vector; int8
//                products with VPDPBUSD (weight codes u8 x activation codes s8
//                with an embedded 4-byte broadcast).
//   amx          avx512, except the block types (Q8_0, Q4_0, Q4_K, Q5_K,
//                Q6_K) on steps of 16 tokens or more (prefill): those run on
//                the AMX tile unit in bfloat16 with fp32 sums (TDPBF16PS;
//                activations and dequantised weights rounded to bf16,
//                matmul_amx.cc), about 1.4-1.9 times avx512's speed on the
//                bench model's Q8_0 matrices and closer to fp32 (Q8_0
//                logits' rms error 0.8% against avx512's 1.3%). Not chosen by auto: a
//                token's result then depends on whether its step had 16
//                tokens or more, i.e. on how the scheduler cut the prompt and
//                what else ran, where every other set gives the same bits
//                whatever the batch.
// Every kernel computes F32 matrices exactly as core/kernels.h MatVec does (8
// lanes, no FMA, the same final sum), bit for bit: the fp32 path of the
// pipeline stays identical to the reference forward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/thread_pool.h"

namespace ellm::mlp {

// The matrix kernel sets are named by core/cpu_features.h's Isa: reference,
// avx2, avx2-vnni, avx512 and amx.
// The set named `name` (an IsaName, or "auto" for BestMatIsa()), to force one
// from a flag or a test; InvalidArgument for any other name. Whether this CPU
// runs it is MatIsaSupported's business.
absl::StatusOr<Isa> ParseMatIsa(std::string_view name);
// Whether there are matrix kernels for `isa` and this CPU runs them.
bool MatIsaSupported(Isa isa);
// The fastest kernel set this CPU supports (decided once): avx512 >
// avx2-vnni > avx2 > reference (amx only when asked for: see above).
Isa BestMatIsa();

enum class ActFormat { kF32, kQ8x32, kQ7x32, kQ8x256 };

// The activation form the kernel set `isa` reads for weights of `type`;
// q8_act_bits (8, or 7) as MatMul's.
ActFormat ActFormatFor(DType type, Isa isa, int q8_act_bits = 8);

// 64-byte aligned bytes (the repacked weights, quantised activations).
class AlignedBytes {
 public:
  AlignedBytes() = default;
  // Grows (old contents are lost when it reallocates; new bytes are zero).
  void Resize(size_t n);
  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data_;
  size_t size_ = 0, capacity_ = 0;
};

// One weight matrix W [rows, cols] in the kernels' layout: groups of 16 rows
// (the last padded with zero rows), each group's blocks interleaved so that
// one 64-byte line holds 4 consecutive elements of each of the 16 rows.
class QuantMatrix {
 public:
  QuantMatrix() = default;
  // Repacks rows stored as the GGUF type `type` (`data`: rows * row bytes),
  // groups split across `pool` when given. InvalidArgument when cols is not a
  // whole number of the type's blocks, the byte count does not match, or the
  // type has no kernels.
  static absl::StatusOr<QuantMatrix> FromRaw(DType type, int64_t rows, int64_t cols,
                                             const uint8_t* data, size_t bytes,
                                             ThreadPool* pool = nullptr);
  // An fp32 matrix [rows, cols], row-major (MatMul then equals MatVec exactly).
  static QuantMatrix FromF32(const float* w, int64_t rows, int64_t cols);

  DType type() const { return type_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t groups() const { return (rows_ + 15) / 16; }
  // Bytes one pass over the matrix reads (the repacked size).
  size_t bytes() const { return data_.size(); }
  bool empty() const { return rows_ == 0; }

  // Row r as floats, exactly as Traits(type).dequantize gives it from the
  // original row.
  void DequantizeRow(int64_t r, float* out) const;

  // Group g's bytes (layout in matmul_layout.h).
  const uint8_t* group(int64_t g) const { return data_.data() + g * group_bytes_; }
  size_t group_bytes() const { return group_bytes_; }

 private:
  DType type_ = DType::kF32;
  int64_t rows_ = 0, cols_ = 0;
  size_t group_bytes_ = 0;
  AlignedBytes data_;
};

// x [T, cols] prepared for the kernels. Not thread-safe: MatMul converts on
// first use, from the calling thread.
class Activations {
 public:
  // Keeps the pointer: x must stay unchanged while this object is used.
  void Set(const float* x, int T, int64_t cols);
  int tokens() const { return T_; }
  int64_t cols() const { return cols_; }
  const float* f32() const { return x_; }

  // The int8 forms, converted once per Set (kQ8x32, kQ7x32: cols % 32 == 0;
  // kQ8x256: cols % 256 == 0), the tokens split over `pool` when given.
  struct Q8 {
    int block = 0;               // 32 or 256 elements
    int64_t token_stride = 0;    // bytes of one token's codes (cols rounded up to 64)
    AlignedBytes qs;             // [T][token_stride] int8 codes, |code| <= 127 (kQ7x32: 63)
    std::vector<float> d;        // [T][cols / block] scales: x ≈ d * code
    std::vector<int32_t> sum;    // kQ8x32: [T][cols / 32] code sums per block
    std::vector<int16_t> sum16;  // kQ8x256: [T][cols / 16] code sums per 16
    std::vector<int16_t> sum32;  // kQ8x256: [T][cols / 32] code sums per 32
    const int8_t* codes(int t) const {
      return reinterpret_cast<const int8_t*>(qs.data() + t * token_stride);
    }
  };
  // The int8 form `f` (not kF32).
  const Q8& q8(ActFormat f, ThreadPool* pool = nullptr);
  // x rounded to bfloat16 (nearest even) in the amx set's tile order: per
  // tile of 16 tokens and block of 32 columns, 16 rows of 32 (1 KiB; rows
  // past T are left as they are: the last tile's loads take T % 16 rows),
  // tiles [T / 16 rounded up][cols / 32]. What the amx
  // set's Q8_0 products read (cols % 32 == 0). Converted once per Set; needs
  // a CPU that runs the amx set.
  const uint16_t* bf16(ThreadPool* pool = nullptr);

 private:
  const float* x_ = nullptr;
  int T_ = 0;
  int64_t cols_ = 0;
  // Indexed by ActFormat (kF32's entries unused; kQ8x256 is the last form).
  static constexpr int kForms = static_cast<int>(ActFormat::kQ8x256) + 1;
  bool have_[kForms] = {};
  Q8 forms_[kForms];
  bool have_bf16_ = false;
  AlignedBytes bf16_;
};

// Quantises one token's row x[cols] to the int8 form (the one rule every
// kernel shares, M = max_code: 127, or 63 for kQ7x32): per block, d = max|x| /
// M, code = round-half-even(x / d) (x * (M / max|x|)), d = 0 and codes 0 for
// an all-zero block.
void QuantizeActivationRow(const float* x, int64_t cols, int block, int max_code, int8_t* codes,
                           float* d);
// The same rule one element at a time (QuantizeActivationRow runs an AVX2
// form of it where the CPU has AVX2; the two agree bit for bit).
void QuantizeActivationRowScalar(const float* x, int64_t cols, int block, int max_code,
                                 int8_t* codes, float* d);

// y [T, rows] (row stride `rows`) = x [T, cols] · Wᵀ with the kernel set
// `isa` (a programmer error, fatal, when the CPU cannot run it or the shapes
// disagree). `pool` may be null (the calling thread does all rows).
// q8_act_bits = 7 has plain avx2 multiply Q8_0 weights with 7-bit activation
// codes (faster, less exact: see "avx2" above); it must be 8 or 7.
void MatMul(const QuantMatrix& w, Activations& x, float* y, ThreadPool* pool,
            Isa isa = BestMatIsa(), int q8_act_bits = 8);

// The name of the kernel MatMul runs for this type, isa and q8_act_bits,
// e.g. "avx512/q4_K*q8x256", "avx2/q8_0*q7x32".
std::string KernelName(DType type, Isa isa, int q8_act_bits = 8);

}  // namespace ellm::mlp
