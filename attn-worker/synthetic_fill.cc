#include "attn-worker/synthetic_fill.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace ellm::attn {

absl::Status FillSynthetic(KvCache* cache, uint64_t seq, int positions, uint64_t seed) {
  if (positions <= 0) return absl::InvalidArgumentError("positions must be positive");
  const KvCacheOptions& o = cache->options();
  const int start = cache->Length(seq);
  RETURN_IF_ERROR(cache->Reserve(seq, start, positions));
  std::vector<float> k(o.head_dim), v(o.head_dim);
  uint64_t x = seed | 1;
  auto next = [&x] {  // xorshift64*: plenty for filler data
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    return static_cast<float>(static_cast<int64_t>(x * 0x2545F4914F6CDD1DULL) >> 40) *
           (1.0f / 8388608.0f);
  };
  for (int layer = 0; layer < o.layers; ++layer) {
    for (int h = 0; h < o.kv_heads; ++h) {
      for (int p = start; p < start + positions; ++p) {
        for (int d = 0; d < o.head_dim; ++d) {
          k[d] = next();
          v[d] = next();
        }
        cache->Store(seq, layer, h, p, k.data(), v.data());
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace ellm::attn
