// The KV cache of one attention shard: KV heads [a, b) of every layer, in
// paged blocks from one pool allocated on the shard's NUMA node.
//
// Pool layout: blocks × [layers][2 (K, V)][kv_heads][block_tokens][head_dim] f32.
// A sequence owns a list of blocks (its block table); position p of a
// sequence lives in block table[p / block_tokens], row p % block_tokens.
// Positions are appended in order; a sequence's blocks return to the pool when
// it is freed.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/status.h"

namespace ellm::attn {

struct KvCacheOptions {
  int layers = 0;
  int kv_heads = 0;      // KV heads of this shard
  int head_dim = 0;
  int block_tokens = 16;
  int64_t blocks = 0;    // pool size
  int numa_node = -1;    // allocate on this node (libnuma); -1: anywhere
};

// Memory from libnuma on a node (or plain mmap), released by the destructor.
class NodeMemory {
 public:
  static absl::StatusOr<std::unique_ptr<NodeMemory>> Allocate(size_t bytes, int numa_node);
  ~NodeMemory();
  float* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  NodeMemory() = default;
  float* data_ = nullptr;
  size_t bytes_ = 0;
  bool numa_ = false;
};

class KvCache {
 public:
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheOptions& options);
  // Bytes of one block (all layers, K and V).
  static size_t BlockBytes(const KvCacheOptions& options);

  // Makes room for positions [start, start + n) of `seq`: start must equal the
  // sequence's current length (FailedPrecondition otherwise); ResourceExhausted
  // when the pool runs out (the sequence is left as it was).
  absl::Status Reserve(uint64_t seq, int start, int n);
  // K and V rows of (layer, kv head, position) of `seq`; the position must be reserved.
  float* KeyRow(uint64_t seq, int layer, int kv_head, int pos);
  float* ValueRow(uint64_t seq, int layer, int kv_head, int pos);
  // Positions held for `seq` (0 if unknown).
  int Length(uint64_t seq) const;
  void Free(uint64_t seq);

  int64_t blocks_total() const { return options_.blocks; }
  int64_t blocks_free() const { return static_cast<int64_t>(free_.size()); }
  const KvCacheOptions& options() const { return options_; }

 private:
  struct Sequence {
    std::vector<int32_t> blocks;
    int length = 0;
  };
  explicit KvCache(const KvCacheOptions& options) : options_(options) {}
  float* Row(uint64_t seq, int layer, int kv, int kv_head, int pos);

  KvCacheOptions options_;
  size_t block_floats_ = 0;
  std::unique_ptr<NodeMemory> memory_;
  std::vector<int32_t> free_;
  std::unordered_map<uint64_t, Sequence> seqs_;
};

}  // namespace ellm::attn
