// The prefix cache's index, kept by the coordinator: which whole KV blocks the
// attention workers hold under which key, how many running sequences use
// each, and which unused ones to evict first. Free of transport types; the
// scheduler turns its decisions into KvOps for the workers.
//
// A block's key is a chain hash of the token ids up to its end: key_i =
// ChainKey(key_{i-1}, tokens of block i), key_{-1} = 0. Entries also keep
// their parent key and their tokens, and a lookup compares them, so a hash
// collision can never map a sequence onto another prefix's KV.
//
// Unreferenced entries are evicted least recently used first. A released
// chain is stamped from its last block back to its first, so of one chain
// the deepest blocks go first and a kept block's parents are always kept.
//
// Partial blocks: a sequence that ends publishes its last, partial block too
// (key ChainKey(parent, its n < block_tokens tokens)). A new prompt that
// leaves the cached whole blocks inside a block takes the cached child of
// its last whole block (whole or partial) that shares most tokens with it
// (LongestPartial), and the workers copy those rows into a block of its own.
// So a conversation's next turn, or an answer that tokenizes otherwise once
// it is text, recomputes only from the first token that differs.
//
// With a KV store, a second tier lists the blocks the attention workers hold
// on disk (by key, parent and tokens): a prompt's match continues there after
// the cached blocks, and the scheduler has those loaded before it attaches.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace ellm::coord {

// The key of a block of `n` tokens whose predecessor has key `parent`
// (0 for the first block). Stable across processes and runs.
uint64_t ChainKey(uint64_t parent, const int32_t* tokens, int n);

class PrefixCache {
 public:
  explicit PrefixCache(int block_tokens) : block_tokens_(block_tokens) {}

  int block_tokens() const { return block_tokens_; }

  // Keys of the longest run of cached blocks that starts `tokens`, at most
  // `max_blocks` of them (no reference taken).
  std::vector<uint64_t> Lookup(const std::vector<int32_t>& tokens, int max_blocks) const;
  // The cached child of `parent` (whole or partial) whose tokens share the
  // longest run with tokens[0, n): its key and that run's length (0: none).
  struct Partial {
    uint64_t key = 0;
    int rows = 0;
  };
  Partial LongestPartial(uint64_t parent, const int32_t* tokens, int n) const;
  // A sequence starts (or stops) using these cached blocks.
  void Acquire(const std::vector<uint64_t>& keys);
  void Release(const std::vector<uint64_t>& keys);
  // Adds block `key` (child of `parent`, holding `n` tokens: block_tokens, or
  // fewer for a partial block), referenced once by the sequence that
  // publishes it. False when the key is already cached (another sequence
  // published the same prefix first).
  bool Insert(uint64_t key, uint64_t parent, const int32_t* tokens, int n);
  bool Insert(uint64_t key, uint64_t parent, const int32_t* tokens) {
    return Insert(key, parent, tokens, block_tokens_);
  }
  bool Contains(uint64_t key) const { return entries_.contains(key); }
  // Drops up to `n` unreferenced blocks, least recently used first; returns
  // their keys (for the workers' KvOps::evict).
  std::vector<uint64_t> Evict(int64_t n);

  // The KV store tier. A stored block's tokens hold block_tokens ids.
  struct Block {
    uint64_t key = 0;
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
  };
  // Adds (or refreshes) a stored block as the most recently stored. The tier
  // keeps at most the store's capacity (SetStoredCapacity), forgetting the
  // least recently stored first, as the workers' stores delete them.
  void AddStored(const Block& block);
  void RemoveStored(uint64_t key);
  void SetStoredCapacity(int64_t blocks);
  // The stored blocks that continue `tokens` after its first `cached.size()`
  // blocks (whose keys `cached` are), up to `max_blocks` blocks in all.
  std::vector<Block> LookupStored(const std::vector<int32_t>& tokens,
                                  const std::vector<uint64_t>& cached, int max_blocks) const;
  int64_t stored() const { return static_cast<int64_t>(stored_.size()); }

  // Forgets every cached block (the workers restarted with empty caches);
  // the KV store tier stays.
  void ForgetCached() {
    entries_.clear();
    lru_.clear();
    children_.clear();
  }

  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  int64_t evictable() const { return static_cast<int64_t>(lru_.size()); }
  int refs(uint64_t key) const;  // -1 when not cached

 private:
  struct Entry {
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    int refs = 0;
    uint64_t stamp = 0;  // its place in lru_ while refs == 0
  };

  int block_tokens_;
  absl::flat_hash_map<uint64_t, Entry> entries_;
  // parent -> its cached children by their tokens, in lexicographic order:
  // the child sharing most leading tokens with a query is a neighbour of the
  // query's place (LongestPartial looks at two, however many there are).
  absl::flat_hash_map<uint64_t, std::map<std::vector<int32_t>, uint64_t>> children_;
  std::map<uint64_t, uint64_t> lru_;  // stamp -> key of unreferenced entries, oldest first
  struct StoredEntry {
    Block block;
    uint64_t stamp = 0;  // its place in stored_lru_
  };
  void TrimStored();
  absl::flat_hash_map<uint64_t, StoredEntry> stored_;  // the KV store tier, by key
  std::map<uint64_t, uint64_t> stored_lru_;            // stamp -> key, least recently stored first
  int64_t stored_capacity_ = std::numeric_limits<int64_t>::max();
  uint64_t next_stamp_ = 1;
};

}  // namespace ellm::coord
