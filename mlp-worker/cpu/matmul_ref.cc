// Reference matrix kernels: plain loops, the oracle of the SIMD kernels and
// the fallback of CPUs without AVX2. Each row is dequantised exactly as
// core/quants.h does (QuantMatrix::DequantizeRow) and dotted in fp64 with the
// activations the SIMD kernels see (the int8 codes times their scale, or the
// floats). F32 rows use core/kernels.h Dot, so F32 products equal MatVec.
#include <vector>

#include "core/kernels.h"
#include "mlp-worker/cpu/matmul_layout.h"

namespace ellm::mlp::internal {
namespace {

void RefKernelAll(const KernelArgs& a, int64_t g_begin, int64_t g_end) {
  const QuantMatrix& w = *a.w;
  const int64_t cols = w.cols();
  std::vector<float> row(static_cast<size_t>(cols));
  const int block = a.q8 != nullptr ? a.q8->block : 1;
  const int64_t nb = cols / block;
  for (int64_t g = g_begin; g < g_end; ++g) {
    for (int r = 0; r < ValidRows(w, g); ++r) {
      const int64_t R = g * kGroupRows + r;
      w.DequantizeRow(R, row.data());
      for (int t = 0; t < a.T; ++t) {
        float* y = a.y + t * a.ldy + R;
        if (w.type() == DType::kF32) {
          *y = Dot(row.data(), a.x + t * cols, cols);
        } else if (a.q8 == nullptr) {  // kF32
          const float* x = a.x + t * cols;
          double sum = 0;
          for (int64_t i = 0; i < cols; ++i) sum += static_cast<double>(row[i]) * x[i];
          *y = static_cast<float>(sum);
        } else {
          const int8_t* codes = a.q8->codes(t);
          const float* d = a.q8->d.data() + t * nb;
          double sum = 0;
          for (int64_t b = 0; b < nb; ++b) {
            double block_sum = 0;
            for (int i = 0; i < block; ++i) {
              block_sum += static_cast<double>(row[b * block + i]) * codes[b * block + i];
            }
            sum += block_sum * d[b];
          }
          *y = static_cast<float>(sum);
        }
      }
    }
  }
}

}  // namespace

MatKernel RefKernel(DType type) {
  return FindGroupLayout(type) != nullptr ? RefKernelAll : nullptr;
}

}  // namespace ellm::mlp::internal
