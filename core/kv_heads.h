// KvHeads: a range [begin, end) of a model's KV heads, the unit by which the
// attention workers shard a model. An attention worker owns one range (the KV
// cache of those heads, and the query heads that map onto them, gqa_ratio per
// KV head); the launcher splits the model into ranges, the mlp-worker
// addresses each worker's ring slots by its range. Every process holds a
// shard's heads as this one type.
#pragma once

#include <string>
#include <string_view>

#include "core/status.h"

namespace ellm {

struct KvHeads {
  int begin = 0;
  int end = 0;

  int count() const { return end - begin; }
  bool operator==(const KvHeads&) const = default;

  // "BEGIN:END", the spelling on every command line (--kv-heads, --attn-shards).
  static absl::StatusOr<KvHeads> Parse(std::string_view text);
  std::string Flag() const;      // "BEGIN:END"
  std::string ToString() const;  // "[BEGIN, END)"
};

// Part `i` of `n` consecutive parts of a model's `n_kv_heads`: equal when n
// divides it, else differing by at most one head.
KvHeads SplitKvHeads(int n_kv_heads, int n, int i);

// Checks ranges, given one at a time, that must cover the KV heads
// [0, n_kv_heads) in order, each non-empty:
//   KvHeadCover cover;
//   for (...) RETURN_IF_ERROR(cover.Add(range));
//   RETURN_IF_ERROR(cover.Finish(n_kv_heads));
class KvHeadCover {
 public:
  absl::Status Add(KvHeads range);
  absl::Status Finish(int n_kv_heads) const;

 private:
  int next_ = 0;
  int added_ = 0;
};

}  // namespace ellm
