#include "core/kernels.h"

#include <cmath>

namespace ellm {

float Dot(const float* a, const float* b, int64_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lane[j] += a[i + j] * b[i + j];
  }
  float tail = 0;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
         ((lane[4] + lane[5]) + (lane[6] + lane[7])) + tail;
}

void MatVec(const float* w, const float* x, float* y, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) y[r] = Dot(w + r * cols, x, cols);
}

void RmsNorm(const float* x, const float* weight, float* out, int64_t n, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * weight[i];
}

void AddBias(float* x, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += b[i];
}

void Softmax(float* x, int64_t n) {
  if (n <= 0) return;
  float max = x[0];
  for (int64_t i = 1; i < n; ++i) max = x[i] > max ? x[i] : max;
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void SwiGlu(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void AttendOneHead(const float* q, const float* const* k_rows, const float* const* v_rows,
                   int n, int head_dim, float* scores, float* out) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int t = 0; t < n; ++t) scores[t] = Dot(q, k_rows[t], head_dim) * scale;
  Softmax(scores, n);
  for (int d = 0; d < head_dim; ++d) out[d] = 0;
  for (int t = 0; t < n; ++t) {
    const float p = scores[t];
    const float* v = v_rows[t];
    for (int d = 0; d < head_dim; ++d) out[d] += p * v[d];
  }
}

}  // namespace ellm
