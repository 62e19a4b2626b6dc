#include "attn-worker/kv_cache.h"

#include <numa.h>
#include <sys/mman.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace ellm::attn {

absl::StatusOr<std::unique_ptr<NodeMemory>> NodeMemory::Allocate(size_t bytes, int numa_node) {
  std::unique_ptr<NodeMemory> m(new NodeMemory());
  m->bytes_ = bytes;
  if (numa_node >= 0 && numa_available() >= 0) {
    if (numa_node > numa_max_node()) {
      return absl::InvalidArgumentError(
          absl::StrCat("NUMA node ", numa_node, " does not exist (max ", numa_max_node(), ")"));
    }
    m->data_ = static_cast<float*>(numa_alloc_onnode(bytes, numa_node));
    m->numa_ = true;
  } else {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    m->data_ = p == MAP_FAILED ? nullptr : static_cast<float*>(p);
  }
  if (m->data_ == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes >> 20, " MiB for the KV cache"));
  }
  return m;
}

NodeMemory::~NodeMemory() {
  if (data_ == nullptr) return;
  if (numa_) {
    numa_free(data_, bytes_);
  } else {
    munmap(data_, bytes_);
  }
}

size_t KvCache::BlockBytes(const KvCacheOptions& o) {
  return static_cast<size_t>(o.layers) * 2 * o.kv_heads * o.block_tokens * o.head_dim *
         sizeof(float);
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheOptions& options) {
  if (options.layers <= 0 || options.kv_heads <= 0 || options.head_dim <= 0 ||
      options.block_tokens <= 0 || options.blocks <= 0 || options.blocks > INT32_MAX) {
    return absl::InvalidArgumentError("KV cache options must all be positive");
  }
  std::unique_ptr<KvCache> cache(new KvCache(options));
  cache->block_floats_ = BlockBytes(options) / sizeof(float);
  ASSIGN_OR_RETURN(cache->memory_,
                   NodeMemory::Allocate(BlockBytes(options) * options.blocks, options.numa_node));
  cache->free_.reserve(options.blocks);
  for (int64_t b = options.blocks - 1; b >= 0; --b) cache->free_.push_back(static_cast<int32_t>(b));
  return cache;
}

absl::Status KvCache::Reserve(uint64_t seq, int start, int n) {
  Sequence& s = seqs_[seq];
  if (start != s.length) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq, " holds ", s.length,
                                                      " positions; cannot append at ", start));
  }
  const int bt = options_.block_tokens;
  const size_t need = static_cast<size_t>((start + n + bt - 1) / bt);
  if (need > s.blocks.size() && need - s.blocks.size() > free_.size()) {
    if (s.length == 0 && s.blocks.empty()) seqs_.erase(seq);
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: sequence ", seq, " needs ", need - s.blocks.size(),
                     " more blocks, ", free_.size(), " free"));
  }
  while (s.blocks.size() < need) {
    s.blocks.push_back(free_.back());
    free_.pop_back();
  }
  s.length = start + n;
  return absl::OkStatus();
}

float* KvCache::Row(uint64_t seq, int layer, int kv, int kv_head, int pos) {
  const Sequence& s = seqs_.at(seq);
  const KvCacheOptions& o = options_;
  const int32_t block = s.blocks[pos / o.block_tokens];
  const size_t offset =
      ((((static_cast<size_t>(layer) * 2 + kv) * o.kv_heads + kv_head) * o.block_tokens) +
       pos % o.block_tokens) *
      o.head_dim;
  return memory_->data() + block * block_floats_ + offset;
}

float* KvCache::KeyRow(uint64_t seq, int layer, int kv_head, int pos) {
  return Row(seq, layer, 0, kv_head, pos);
}

float* KvCache::ValueRow(uint64_t seq, int layer, int kv_head, int pos) {
  return Row(seq, layer, 1, kv_head, pos);
}

int KvCache::Length(uint64_t seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? 0 : it->second.length;
}

void KvCache::Free(uint64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  for (int32_t b : it->second.blocks) free_.push_back(b);
  seqs_.erase(it);
}

}  // namespace ellm::attn
