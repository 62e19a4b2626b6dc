// Rotary position embedding: the one definition of a model's rotation, for
// the reference forward and every backend. The frequencies are computed once
// from the config (base, dims, and the scaling its GGUF file asks for).
//
// Pair i < dims/2 of a head, (2i, 2i+1) in the llama layout or
// (i, i + dims/2) in NeoX, rotates by the angle pos * freq[i], and its cos
// and sin are both multiplied by mscale (so attention scores by mscale²);
// dimensions past `dims` are left as they are. With f_i = base^(-2i/dims)
// and ff_i the llama3 factor of pair i (rope_freqs.weight; 1 without it):
//
//   none     freq_i = f_i / ff_i                                  mscale = a
//   linear   freq_i = f_i / ff_i / factor                         mscale = a
//   yarn     freq_i = f_i / ff_i * ((1 - r_i) / factor + r_i)     mscale = a (1 + 0.1 ln factor)
//
// where a is rope.scaling.attn_factor and YaRN's ramp r_i is 1 for pairs that
// turn fast over the original context (kept as trained), 0 for slow ones
// (interpolated by the factor) and linear between:
//   r_i = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1),
//   lo = max(0, floor(d(beta_fast))), hi = min(dims - 1, ceil(d(beta_slow))),
//   d(b) = dims ln(original_context / (2 pi b)) / (2 ln base)
// (the pair index whose wavelength fits b times in the original context).
// These are llama.cpp's formulas (ggml's rope_yarn); lo and hi are computed
// in float as there, the frequencies in double.
#pragma once

#include <cstdint>
#include <vector>

#include "core/model_config.h"

namespace ellm {

class Rope {
 public:
  explicit Rope(const ModelConfig& c);

  int dims() const { return dims_; }
  int pairs() const { return dims_ / 2; }
  bool neox() const { return neox_; }
  const std::vector<double>& freq() const { return freq_; }  // [pairs]
  double mscale() const { return mscale_; }

  // cos_sin[i] = {cos, sin}(pos * freq[i]) * mscale, rounded to float:
  // [pairs, 2].
  void CosSin(int64_t pos, float* cos_sin) const;
  // Rotates the first dims() of each head of x [n_heads, head_dim] by a
  // CosSin table: a' = a c - b s, b' = a s + b c.
  void Rotate(const float* cos_sin, float* x, int n_heads, int head_dim) const;

 private:
  int dims_ = 0;
  bool neox_ = false;
  std::vector<double> freq_;
  double mscale_ = 1;
};

}  // namespace ellm
