// The KV cache of one attention shard: KV heads [a, b) of every layer, in
// paged blocks from one pool allocated on the shard's NUMA node.
//
// Pool layout: [layers][kv_heads] regions, each [K, V][blocks] segments
// (kv_format.h gives a segment's bytes for each dtype). A sequence owns a
// list of block ids (its block table), the same ids in every region;
// position p lives in block table[p / block_tokens], row p % block_tokens.
// The K (and the V) of one (layer, KV head) of a sequence whose blocks are
// consecutive ids is therefore one contiguous run of memory, and a decode
// kernel reads two sequential streams front to back (with software prefetch
// ahead of both).
// Positions are appended in order and quantised once, when stored.
//
// Prefix cache: a full block can be published under a key (the coordinator's
// chain hash of the tokens up to its end). A new sequence may start with a
// run of cached blocks (Attach) instead of computing them; blocks carry
// reference counts (the sequences whose table holds them), are never written
// once full, and a published block stays in the pool, unreferenced, after its
// sequences are freed, until the coordinator evicts it. The coordinator
// decides every key, attach and eviction; a call this cache cannot honour
// (an unknown key, a referenced block to evict, a block to publish that is
// not full, or not the sequence's last) is an error that changes nothing.
// A sequence's last, partial block can be published too when the sequence
// ends; a new sequence then starts with a copy of its first rows (Attach's
// partial_key), as it never writes into a cached block.
//
// Block choice keeps each sequence's blocks ascending and in long
// consecutive runs, so that its K and V read as long forward streams of
// memory: a sequence that needs a block and has none left in its zone claims
// a zone of up to kZoneBlocks free blocks, the first such run at or after its
// last block (then from the pool's start), and takes the zone's blocks in
// order as it grows. Other sequences pass over claimed blocks while any free
// unclaimed block is left, and take them only when the pool is otherwise
// full, so zones never cost capacity. A freed sequence releases its zone.
// Measured with ellm-bench attention --positions=16K --threads=2 (3 shapes,
// int8 and f16): consecutive blocks 0.80-0.95 of the read probe; blocks in
// descending order, which a stack of freed ids hands to the next sequence,
// 0.58-0.77 (with the old stack allocator forced to that order). Four
// sequences taking 16-position blocks in turn (--interleave=4, at 16K and
// 64K): 0.42-0.71 without zones (commit f699fc8), 0.71-0.88 with zones of 64
// blocks, 0.72-0.91 with 256.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "core/kv_format.h"
#include "core/kv_ops.h"
#include "core/status.h"

namespace ellm::attn {

// Blocks a sequence claims ahead of its growth at a time (see above).
inline constexpr int64_t kZoneBlocks = 256;

struct KvCacheOptions {
  int layers = 0;
  int kv_heads = 0;      // KV heads of this shard
  int head_dim = 0;
  int block_tokens = 16;
  int64_t blocks = 0;    // pool size
  int numa_node = -1;    // allocate on this node (libnuma); -1: anywhere
  KvDType dtype = KvDType::kF32;  // the worker's default is int8 (--kv-dtype)
};

// Memory from libnuma on a node (or plain mmap), released by the destructor.
class NodeMemory {
 public:
  static absl::StatusOr<std::unique_ptr<NodeMemory>> Allocate(size_t bytes, int numa_node);
  ~NodeMemory();
  float* data() const { return data_; }
  uint8_t* bytes_data() const { return reinterpret_cast<uint8_t*>(data_); }
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
  // K and V rows of (layer, kv head, position) of `seq`; the position must be
  // reserved. f32 caches only (nullptr for the other dtypes: use Store).
  float* KeyRow(uint64_t seq, int layer, int kv_head, int pos);
  float* ValueRow(uint64_t seq, int layer, int kv_head, int pos);
  // Stores k and v [head_dim] at a reserved position, converting to the dtype.
  void Store(uint64_t seq, int layer, int kv_head, int pos, const float* k, const float* v);
  // The blocks of (layer, kv head) of `seq`, for the kernels; valid until the
  // sequence is next reserved or freed. The sequence must exist.
  KvSeqView View(uint64_t seq, int layer, int kv_head) const;
  // Positions held for `seq` (0 if unknown).
  int Length(uint64_t seq) const;
  // Releases the sequence's blocks: each loses a reference, and returns to
  // the pool when it has none left and is not cached.
  void Free(uint64_t seq);

  // Publishes blocks [first, first + keys.size()) of `seq` (full ones) under
  // `keys`, and with partial_rows > 0 the next block too, under partial_key:
  // it must be the sequence's last and hold exactly partial_rows positions
  // (the sequence cannot grow into it afterwards). InvalidArgument (and
  // nothing published) for an unknown sequence, a block past its last full
  // one, a partial block that is not its last, a key already cached or a
  // block already published under another key.
  absl::Status Publish(uint64_t seq, int first, const std::vector<uint64_t>& keys,
                       uint64_t partial_key = 0, int partial_rows = 0);
  // Starts the new sequence `seq` with the cached blocks of `keys`, in order
  // (its length becomes keys.size() * block_tokens), and with partial_rows > 0
  // one block of its own after them holding a copy of the first partial_rows
  // (< block_tokens) positions of cached block partial_key. InvalidArgument
  // (and nothing changed) when `seq` already holds positions or a key is not
  // cached; ResourceExhausted when no block is free for the copy.
  absl::Status Attach(uint64_t seq, const std::vector<uint64_t>& keys, uint64_t partial_key = 0,
                      int partial_rows = 0);
  // Drops cached blocks that no sequence references, returning them to the
  // pool. FailedPrecondition (and nothing dropped) for a key that is not
  // cached or whose block is still referenced.
  absl::Status Evict(const std::vector<uint64_t>& keys);
  // Drops those of `keys` that are cached and unreferenced; ignores the rest.
  void Discard(const std::vector<uint64_t>& keys);
  // The coordinator's operations, in KvOps order (publish, free, evict,
  // discard, attach); stops at the first that fails and returns its error.
  absl::Status Apply(const KvOps& ops);

  // A cached block's bytes, for the KV store: for each layer and KV head of
  // the shard, its K segment then its V segment (BlockBytes in all).
  // NotFound when the key is not cached.
  absl::StatusOr<std::string> CachedBlockBytes(uint64_t key) const;
  // Takes a free block, fills it with `bytes` (CachedBlockBytes' layout) and
  // caches it under `key`, unreferenced. InvalidArgument for a key already
  // cached or bytes of the wrong size; ResourceExhausted when no block is free.
  absl::Status InsertCached(uint64_t key, std::string_view bytes);
  // Ends a run of InsertCached calls (whose blocks were taken in one zone).
  void EndInserts();

  int64_t blocks_total() const { return options_.blocks; }
  // Blocks in no sequence and not cached.
  int64_t blocks_free() const { return free_count_; }
  // Cached blocks (referenced or not).
  int64_t blocks_cached() const { return static_cast<int64_t>(cached_.size()); }
  const KvCacheOptions& options() const { return options_; }
  const KvFormat& format() const { return format_; }

 private:
  struct Sequence {
    std::vector<int32_t> blocks;
    int length = 0;
    int64_t zone_end = 0;  // blocks (last block, zone_end) are claimed for it
  };
  explicit KvCache(const KvCacheOptions& options) : options_(options) {}
  // Start of K block `block` of the (layer, kv head) region; its V block is
  // ValueOffset() bytes further.
  uint8_t* BlockBase(int layer, int kv_head, int32_t block) const;
  int64_t ValueOffset() const { return options_.blocks * segment_bytes_; }

  KvCacheOptions options_;
  KvFormat format_;
  int64_t segment_bytes_ = 0;  // K (or V) part of a block of one (layer, kv head)
  // Takes the next block for `s` (see above); a block must be free.
  int32_t TakeBlock(Sequence& s);
  // The first block in [from, to) whose bit is set in all of `masks`
  // (pointers to bitmaps), or -1.
  int64_t FindSet(int64_t from, int64_t to, std::initializer_list<const std::vector<uint64_t>*> masks) const;
  static bool Bit(const std::vector<uint64_t>& bits, int64_t b) { return (bits[b / 64] >> (b % 64)) & 1; }
  static void SetBit(std::vector<uint64_t>& bits, int64_t b, bool on);
  // Releases the unused rest of s's zone.
  void ReleaseZone(Sequence& s);

  // Drops one reference to block b; returns it to the pool when none is
  // left and it is not cached.
  void Unref(int32_t b);

  std::unique_ptr<NodeMemory> memory_;
  std::vector<int32_t> refs_;             // sequences whose table holds block b
  std::vector<uint8_t> is_cached_;        // block b is published under a key
  absl::flat_hash_map<uint64_t, int32_t> cached_;  // key -> block
  std::vector<uint64_t> free_bits_;       // bit b: block b is free
  std::vector<uint64_t> unclaimed_bits_;  // bit b: block b is in no sequence's zone
  int64_t free_count_ = 0;
  std::unordered_map<uint64_t, Sequence> seqs_;
  Sequence inserting_;  // the zone InsertCached takes blocks from
};

}  // namespace ellm::attn
