// Benchmarks only: appends positions of random K/V to a sequence, as if a
// prompt had been prefilled, so decode at long context can be measured
// without spending minutes in prefill.
#pragma once

#include <cstdint>

#include "attn-worker/kv_cache.h"

namespace ellm::attn {

// Appends `positions` positions (every layer and KV head of the shard) of
// values uniform in [-1, 1) to `seq`, stored in the cache's dtype.
absl::Status FillSynthetic(KvCache* cache, uint64_t seq, int positions, uint64_t seed);

}  // namespace ellm::attn
