// The prefix-cache operations the coordinator sends every attention worker
// between steps (gRPC UpdateKv), applied in the order of the fields: the
// workers' KV caches follow the coordinator's decisions exactly, so all of
// them hold the same blocks under the same keys. (Discard is for blocks a
// KV-store load brought into some workers but not all.) Cached blocks are
// whole, except the partial blocks of SequenceBlocks::partial_key.
#pragma once

#include <cstdint>
#include <vector>

namespace ellm {

struct KvOps {
  // Blocks [first_block, first_block + keys.size()) of a sequence, by key.
  // Publish also names what the keys stand for (for the KV store's files):
  // the key before the first (0 at the start) and the blocks' tokens.
  struct SequenceBlocks {
    uint64_t seq = 0;
    int first_block = 0;
    std::vector<uint64_t> keys;
    uint64_t parent = 0;
    std::vector<int32_t> tokens;  // keys.size() * block_tokens (publish only)
    // A partial block after the whole ones (partial_rows > 0). Publish: the
    // sequence's block first_block + keys.size(), its last, holding exactly
    // partial_rows positions, is cached under partial_key (a cached partial
    // block is never written again). Attach: the sequence gets a block of its
    // own holding a copy of the first partial_rows positions of cached block
    // partial_key, so it shares a prefix that ends inside a block.
    uint64_t partial_key = 0;
    int partial_rows = 0;
  };
  std::vector<SequenceBlocks> publish;  // full blocks of live sequences become cached
  std::vector<uint64_t> free;           // sequences whose blocks are released
  std::vector<uint64_t> evict;          // unreferenced cached blocks dropped
  std::vector<uint64_t> discard;        // dropped if cached and unreferenced, else ignored
  std::vector<SequenceBlocks> attach;   // new sequences start with cached blocks (first_block 0)

  bool empty() const {
    return publish.empty() && free.empty() && evict.empty() && discard.empty() && attach.empty();
  }
};

}  // namespace ellm
