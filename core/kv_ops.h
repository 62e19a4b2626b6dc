// The prefix-cache operations the coordinator sends every attention worker
// between steps (gRPC UpdateKv), applied in the order of the fields: the
// workers' KV caches follow the coordinator's decisions exactly, so all of
// them hold the same blocks under the same keys.
#pragma once

#include <cstdint>
#include <vector>

namespace ellm {

struct KvOps {
  // Blocks [first_block, first_block + keys.size()) of a sequence, by key.
  struct SequenceBlocks {
    uint64_t seq = 0;
    int first_block = 0;
    std::vector<uint64_t> keys;
  };
  std::vector<SequenceBlocks> publish;  // full blocks of live sequences become cached
  std::vector<uint64_t> free;           // sequences whose blocks are released
  std::vector<uint64_t> evict;          // unreferenced cached blocks dropped
  std::vector<SequenceBlocks> attach;   // new sequences start with cached blocks (first_block 0)

  bool empty() const { return publish.empty() && free.empty() && evict.empty() && attach.empty(); }
};

}  // namespace ellm
