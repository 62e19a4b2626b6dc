#include "core/kv_heads.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace ellm {

absl::StatusOr<KvHeads> KvHeads::Parse(std::string_view text) {
  const std::vector<absl::string_view> parts = absl::StrSplit(ToAbsl(text), ':');
  KvHeads h;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &h.begin) ||
      !absl::SimpleAtoi(parts[1], &h.end) || h.begin < 0 || h.end <= h.begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad KV head range '", ToAbsl(text), "' (expected BEGIN:END with 0 <= BEGIN < END)"));
  }
  return h;
}

std::string KvHeads::Flag() const { return absl::StrCat(begin, ":", end); }

std::string KvHeads::ToString() const { return absl::StrCat("[", begin, ", ", end, ")"); }

KvHeads SplitKvHeads(int n_kv_heads, int n, int i) {
  return {n_kv_heads * i / n, n_kv_heads * (i + 1) / n};
}

absl::Status KvHeadCover::Add(KvHeads range) {
  if (range.begin != next_ || range.end <= range.begin) {
    return absl::InvalidArgumentError(absl::StrCat("shard ", added_, " has KV heads ",
                                                   range.ToString(), "; the shards must cover ",
                                                   "the KV heads in order, from ", next_));
  }
  next_ = range.end;
  ++added_;
  return absl::OkStatus();
}

absl::Status KvHeadCover::Finish(int n_kv_heads) const {
  if (next_ != n_kv_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("the shards cover KV heads [0, ", next_, ") of the model's ", n_kv_heads));
  }
  return absl::OkStatus();
}

}  // namespace ellm
