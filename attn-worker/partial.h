// The online-softmax partial: what attention over a subset of positions
// leaves for one query head, and the one Merge() that combines two of them.
// Every split across work items (chunks of a sequence on different threads,
// chunks of a prefill) is merged here, always in chunk order; inside a chunk
// the SIMD kernels fold tile after tile into the same representation with
// their own vector code (SoftmaxStep in attention_avx512.cc / _avx2.cc).
//
// Scores are in base 2: s_t = log2(e) * q·k_t / sqrt(head_dim). For a set T of
// positions a partial holds, for a reference score m at most the maximum
// score (the kernels keep the running maximum, or with avx512 one that
// trails it by up to 8):
//   d    = sum_{t in T} 2^(s_t - m)
//   o[i] = sum_{t in T} 2^(s_t - m) * v_t[i]
// so that the attention output over T is o / d. The empty set is m = -inf,
// d = 0, o = 0; any non-empty set has d >= 1 (the maximum contributes at
// least 1).
//
// Memory: PartialFloats(dim) floats, o[dim] first (64-byte aligned when the
// base is and dim is a multiple of 16), then m, d, padding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace ellm::attn {

inline constexpr int PartialFloats(int dim) { return (dim + 15) / 16 * 16 + 16; }

class Partial {
 public:
  Partial(float* data, int dim) : data_(data), dim_(dim), mo_((dim + 15) / 16 * 16) {}

  float* o() const { return data_; }
  float& m() const { return data_[mo_]; }
  float& d() const { return data_[mo_ + 1]; }
  int dim() const { return dim_; }
  bool empty() const { return d() == 0; }

  void Clear() const {
    std::fill_n(data_, dim_, 0.0f);
    m() = -std::numeric_limits<float>::infinity();
    d() = 0;
  }

  // *this = *this ⊕ other: rescales both to the larger reference score and
  // adds. Commutative bit for bit (max is exact and each side's product is
  // formed the same way before one addition); associative up to rounding.
  // An empty side leaves the other unchanged, so no -inf - -inf appears.
  void Merge(const Partial& other) const {
    if (other.empty()) return;
    if (empty()) {
      std::memcpy(data_, other.data_, dim_ * sizeof(float));
      m() = other.m();
      d() = other.d();
      return;
    }
    const float m_new = std::max(m(), other.m());
    const float a = std::exp2(m() - m_new), b = std::exp2(other.m() - m_new);
    float* oa = data_;
    const float* ob = other.data_;
    for (int i = 0; i < dim_; ++i) oa[i] = oa[i] * a + ob[i] * b;
    d() = d() * a + other.d() * b;
    m() = m_new;
  }

  // out[i] = o[i] / d for i < n (zeros for the empty partial).
  void Normalize(float* out, int n) const {
    if (empty()) {
      std::fill_n(out, n, 0.0f);
      return;
    }
    const float den = d();
    for (int i = 0; i < n; ++i) out[i] = data_[i] / den;
  }

 private:
  float* data_;
  int dim_;
  int mo_;  // index of m
};

}  // namespace ellm::attn
