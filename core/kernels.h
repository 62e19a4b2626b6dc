// Plain fp32 CPU kernels shared by the reference forward and the CPU MLP
// backend. They are the references: every faster kernel is tested against
// them. Each is deterministic (fixed summation order), so the distributed
// pipeline reproduces the reference forward bit for bit when it composes the
// same kernels in the same order.
#pragma once

#include <cstdint>

namespace ellm {

// sum_i a[i] * b[i], accumulated in 8 fixed lanes then summed in a fixed order.
float Dot(const float* a, const float* b, int64_t n);

// y[r] = W[r, :] · x for r in [0, rows). W is row-major [rows, cols]
// (GGUF order: a tensor of shape {cols, rows}).
void MatVec(const float* w, const float* x, float* y, int64_t rows, int64_t cols);

// out = x / sqrt(mean(x²) + eps) * weight, all [n].
void RmsNorm(const float* x, const float* weight, float* out, int64_t n, float eps);

// x[i] += b[i] for i < n.
void AddBias(float* x, const float* b, int64_t n);

// In-place softmax over [n] (max-subtracted).
void Softmax(float* x, int64_t n);

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + e^-g).
void SwiGlu(const float* gate, const float* up, float* out, int64_t n);

// One query head attending over n positions (causal context already cut):
//   s_t = q · k_t / sqrt(head_dim),  p = softmax(s),  out = sum_t p_t v_t
// k_rows[t] and v_rows[t] each point at head_dim floats. `scores` is scratch
// of n floats.
void AttendOneHead(const float* q, const float* const* k_rows, const float* const* v_rows,
                   int n, int head_dim, float* scores, float* out);

}  // namespace ellm
