// AttentionShard: the attention worker's logic, free of transport types. For
// each attention request of one layer it appends the new k, v of every token
// to the KV cache (quantising them once, there) and computes causal attention
// for the shard's query heads.
//
// f32 caches use core/kernels.h's AttendOneHead per (token, query head): the
// same arithmetic as the single-process reference forward, bit for bit.
// f16 and int8 caches use the flash-decoding kernels of attention_kernels.h:
// a sequence's positions are cut into chunks of chunk_positions (fixed
// absolute boundaries), each (sequence, KV head, chunk) is a unit of work on
// the thread pool, and the partials of a (token, query head) are merged in
// chunk order in one place (Merge, run by the thread that finishes the
// group's last chunk, so a step is one pass over the pool). Slices of more
// than kMaxChunkTokens tokens (prefill) run their chunks one after another
// inside one item per (16 tokens, KV head) and fold them the same way.
// Consecutive chunks of a group may share an item (how many depends on the
// thread count; the results do not), and each thread starts on its own
// contiguous run of items, taking others' only when it runs out, so a
// sequence's consecutive chunks mostly stay on one core. A token's result
// therefore depends only on its own sequence and position: not on the batch
// around it, the thread count, or whether it came in a decode or a prefill
// step.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "attn-worker/attention_kernels.h"
#include "attn-worker/kv_cache.h"
#include "core/kv_heads.h"
#include "core/thread_pool.h"
#include "shm/messages.h"

namespace ellm::attn {

struct ShardGeometry {
  int layers = 0;
  KvHeads heads;          // the model's KV heads this shard owns
  int gqa_ratio = 1;      // query heads per KV head
  int head_dim = 0;
  int max_positions = 0;  // the model's context
  int chunk_positions = 0;  // positions per flash-decoding chunk, a multiple of 16 (0: automatic)
  // Steps that read less KV than this run on the calling thread: waking the
  // pool costs more than it saves (a futex wake-up takes ~5-10 us on bare
  // metal, ~65 us on the 2-vCPU VM these numbers come from, while 256 KiB
  // take ~20 us on one core).
  double parallel_min_bytes = 256 * 1024;
  int kv_heads() const { return heads.count(); }
  int q_heads() const { return kv_heads() * gqa_ratio; }
  shm::AttnShape shape() const { return {q_heads(), kv_heads(), head_dim}; }
};

// Automatic chunk length: the smallest power of two >= 256 positions whose K
// and V reach 128 KiB per KV head (at most 4096), so the partials written and
// merged stay ~1-2% of the bytes read while 4K positions still give 8-16
// items per KV head.
int AutoChunkPositions(const KvFormat& format);

class AttentionShard {
 public:
  // `kernel` computes f16/int8 attention (nullptr: the fastest this CPU runs).
  AttentionShard(const ShardGeometry& geometry, KvCache* cache, ThreadPool* pool,
                 const AttentionKernel* kernel = nullptr);

  // Handles one request of `layer`: slices[n_seqs] with q/k/v as in
  // shm/messages.h; writes out[n_tokens][q_heads][head_dim].
  // Errors (FailedPrecondition for out-of-order positions, ResourceExhausted
  // when the cache is full, InvalidArgument for a bad layer) leave the cache
  // consistent.
  absl::Status Process(uint32_t layer, uint32_t n_seqs, uint32_t n_tokens,
                       const shm::AttnRequestView& request, float* out);

  // "f32-reference", or the kernel and dtype, e.g. "avx512 int8".
  std::string kernel_name() const;
  // K and V bytes the requests so far read from the cache (every position a
  // sequence holds, once per layer and KV head of a step): the figure the
  // bandwidth accounting divides by time.
  int64_t kv_read_bytes() const { return kv_read_bytes_.load(std::memory_order_relaxed); }
  int chunk_positions() const { return chunk_; }
  const ShardGeometry& geometry() const { return g_; }

 private:
  // One work item: tokens [token0, token0 + n_tokens) of slice `slice` (at
  // most kMaxChunkTokens), KV head `kv_head`, chunks [chunk_begin, chunk_end).
  // partial_slot >= 0: chunks of merge group `merge`, chunk c's partials in
  // the slots from partial_slot + (c - chunk_begin) * n_tokens * group; -1:
  // all chunks in turn, folded, normalised into the output.
  struct Item {
    int slice, token0, n_tokens, kv_head, chunk_begin, chunk_end;
    int64_t partial_slot;
    int merge;
  };
  // A (token group, KV head) whose chunks run as separate items. The thread
  // that finishes its last chunk merges them (in chunk order), so one pass
  // over the pool does all the work of a step.
  struct MergeGroup {
    int slice, token0, n_tokens, kv_head, chunks;
    int64_t first_slot;
  };
  struct ThreadScratch {
    AlignedArray<float> chunk, partials, acc;
  };

  void ProcessF32(uint32_t layer, uint32_t n_tokens, const shm::AttnRequestView& req, float* out);
  void RunItem(const Item& item, uint32_t layer, const shm::AttnRequestView& req, float* out,
               ThreadScratch& scratch);
  ChunkArgs ArgsFor(const Item& item, uint32_t layer, const shm::AttnRequestView& req) const;
  void WriteOutput(const MergeGroup& g, int token, int head, const Partial& p, float* out) const;
  void Merge(const MergeGroup& g, float* out, ThreadScratch& scratch) const;

  ShardGeometry g_;
  KvCache* cache_;
  std::atomic<int64_t> kv_read_bytes_{0};
  ThreadPool* pool_;
  const AttentionKernel* kernel_;
  int chunk_ = 0;
  // f32 path: per-thread row pointers and scores of up to max_positions.
  struct F32Scratch {
    std::vector<const float*> k_rows, v_rows;
    std::vector<float> scores;
  };
  std::vector<F32Scratch> f32_scratch_;
  // Kernel path, kept across steps.
  QueryPrep prep_;
  std::vector<int32_t> last_pos_;     // [n_tokens] position of each token of the step
  std::vector<uint64_t> token_seq_;   // [n_tokens] sequence of each token of the step
  std::vector<int32_t> slice_token0_;  // [n_seqs] first token of each slice
  std::vector<Item> items_;
  std::vector<MergeGroup> merges_;
  std::unique_ptr<std::atomic<int>[]> chunks_left_;  // [merges_.size()] items still running
  size_t chunks_left_capacity_ = 0;
  AlignedArray<float> partials_;
  std::vector<ThreadScratch> scratch_;
};

}  // namespace ellm::attn
