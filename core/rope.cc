#include "core/rope.h"

#include <algorithm>
#include <cmath>

namespace ellm {

Rope::Rope(const ModelConfig& c) : dims_(c.rope_dims), neox_(c.rope_neox) {
  const RopeScaling& s = c.rope_scaling;
  const int pairs = dims_ / 2;
  freq_.resize(pairs);
  // YaRN's ramp bounds, in float as ggml computes them.
  float lo = 0, hi = 0;
  if (s.type == RopeScalingType::kYarn) {
    auto corr_dim = [&](float rotations) {
      return static_cast<float>(dims_) *
             std::log(static_cast<float>(s.original_context) / (rotations * 2.0f * static_cast<float>(M_PI))) /
             (2.0f * std::log(c.rope_base));
    };
    lo = std::max(0.0f, std::floor(corr_dim(s.beta_fast)));
    hi = std::min(static_cast<float>(dims_ - 1), std::ceil(corr_dim(s.beta_slow)));
  }
  for (int i = 0; i < pairs; ++i) {
    double f = std::pow(static_cast<double>(c.rope_base), -2.0 * i / dims_);
    if (!c.rope_freq_factors.empty()) f /= c.rope_freq_factors[i];
    switch (s.type) {
      case RopeScalingType::kNone:
        break;
      case RopeScalingType::kLinear:
        f /= s.factor;
        break;
      case RopeScalingType::kYarn: {
        const double y = (i - static_cast<double>(lo)) / std::max(0.001, static_cast<double>(hi - lo));
        const double ramp = 1.0 - std::clamp(y, 0.0, 1.0);
        f *= (1.0 - ramp) / s.factor + ramp;
        break;
      }
    }
    freq_[i] = f;
  }
  mscale_ = s.attn_factor;
  if (s.type == RopeScalingType::kYarn) mscale_ *= 1.0 + 0.1 * std::log(static_cast<double>(s.factor));
}

void Rope::CosSin(int64_t pos, float* cos_sin) const {
  for (int i = 0; i < pairs(); ++i) {
    const double angle = static_cast<double>(pos) * freq_[i];
    cos_sin[2 * i] = static_cast<float>(std::cos(angle) * mscale_);
    cos_sin[2 * i + 1] = static_cast<float>(std::sin(angle) * mscale_);
  }
}

void Rope::Rotate(const float* cos_sin, float* x, int n_heads, int head_dim) const {
  const int half = pairs();
  for (int h = 0; h < n_heads; ++h) {
    float* head = x + static_cast<int64_t>(h) * head_dim;
    for (int i = 0; i < half; ++i) {
      const float c = cos_sin[2 * i], s = cos_sin[2 * i + 1];
      float* a = neox_ ? head + i : head + 2 * i;
      float* b = neox_ ? head + i + half : head + 2 * i + 1;
      const float va = *a, vb = *b;
      *a = va * c - vb * s;
      *b = va * s + vb * c;
    }
  }
}

}  // namespace ellm
