// The reference attention kernel: plain loops over the dequantised K and V
// rows (KvFormat::LoadKey/LoadValue, the exact stored values), the query as
// given (not quantised), fp64 accumulation and an exact two-pass softmax over
// the chunk. Slow and simple; the oracle for the SIMD kernels.
#include <algorithm>
#include <cmath>
#include <vector>

#include "attn-worker/attention_kernels.h"

namespace ellm::attn::internal {

void AttendChunkReference(const ChunkArgs& a) {
  const KvFormat& f = a.kv.format;
  const int hd = f.head_dim, hp = f.padded_dim, pf = PartialFloats(hp);
  int end = a.pos_begin;
  for (int i = 0; i < a.n_tokens; ++i) end = std::max(end, std::min(a.pos_end, a.last_pos[i] + 1));
  const int n = end - a.pos_begin;
  // Dequantise the chunk's rows once: [n][hd] each.
  std::vector<float> k(static_cast<size_t>(std::max(n, 0)) * hd), v(k.size());
  for (int t = 0; t < n; ++t) {
    const int pos = a.pos_begin + t;
    f.LoadKey(a.kv.KeyTile(pos), a.kv.RowInTile(pos), &k[static_cast<size_t>(t) * hd]);
    f.LoadValue(a.kv.ValueTile(pos), a.kv.RowInTile(pos), &v[static_cast<size_t>(t) * hd]);
  }
  const double c = M_LOG2E / std::sqrt(static_cast<double>(hd));
  std::vector<double> s(std::max(n, 0)), o(hd);
  for (int i = 0; i < a.n_tokens; ++i) {
    const int len = std::min(a.pos_end, a.last_pos[i] + 1) - a.pos_begin;
    for (int j = 0; j < a.group; ++j) {
      const Partial part(a.partials + static_cast<size_t>(i * a.group + j) * pf, hp);
      part.Clear();
      if (len <= 0) continue;
      const float* q = a.q->raw.data() +
                       static_cast<size_t>(a.q_row0 + i * a.q_token_stride + j) * hp;
      double mx = -INFINITY;
      for (int t = 0; t < len; ++t) {
        const float* kt = &k[static_cast<size_t>(t) * hd];
        double dot = 0;
        for (int d = 0; d < hd; ++d) dot += static_cast<double>(q[d]) * kt[d];
        s[t] = c * dot;
        mx = std::max(mx, s[t]);
      }
      const float m = static_cast<float>(mx);
      double den = 0;
      std::fill(o.begin(), o.end(), 0.0);
      for (int t = 0; t < len; ++t) {
        const double p = std::exp2(s[t] - m);
        den += p;
        const float* vt = &v[static_cast<size_t>(t) * hd];
        for (int d = 0; d < hd; ++d) o[d] += p * vt[d];
      }
      for (int d = 0; d < hd; ++d) part.o()[d] = static_cast<float>(o[d]);
      part.m() = m;
      part.d() = static_cast<float>(den);
    }
  }
}

}  // namespace ellm::attn::internal
