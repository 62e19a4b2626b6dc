// AttentionShard: the attention worker's logic, free of transport types. For
// each attention request of one layer it appends the new k, v of every token
// to the KV cache and computes causal attention for the shard's query heads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attn-worker/kv_cache.h"
#include "core/thread_pool.h"
#include "shm/messages.h"

namespace ellm::attn {

struct ShardGeometry {
  int layers = 0;
  int kv_head_begin = 0;  // KV heads [begin, end) of the model
  int kv_head_end = 0;
  int gqa_ratio = 1;      // query heads per KV head
  int head_dim = 0;
  int max_positions = 0;  // the model's context
  int kv_heads() const { return kv_head_end - kv_head_begin; }
  int q_heads() const { return kv_heads() * gqa_ratio; }
  shm::AttnShape shape() const { return {q_heads(), kv_heads(), head_dim}; }
};

class AttentionShard {
 public:
  AttentionShard(const ShardGeometry& geometry, KvCache* cache, ThreadPool* pool);

  // Handles one request of `layer`: slices[n_seqs] with q/k/v as in
  // shm/messages.h; writes out[n_tokens][q_heads][head_dim].
  // Errors (FailedPrecondition for out-of-order positions, ResourceExhausted
  // when the cache is full, InvalidArgument for a bad layer) leave the cache
  // consistent.
  absl::Status Process(uint32_t layer, uint32_t n_seqs, uint32_t n_tokens,
                       const shm::AttnRequestView& request, float* out);

  std::string kernel_name() const { return "f32-reference"; }

 private:
  ShardGeometry g_;
  KvCache* cache_;
  ThreadPool* pool_;
  // Per-thread scratch: row pointers and scores of up to max_positions.
  struct Scratch {
    std::vector<const float*> k_rows, v_rows;
    std::vector<float> scores;
  };
  std::vector<Scratch> scratch_;
};

}  // namespace ellm::attn
