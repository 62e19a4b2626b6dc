// The KV store: this shard's prefix-cache blocks on disk, so that a cached
// prefix outlives its eviction from DRAM and a restart. Every block published
// to the cache is written (write-through, so a clean shutdown has nothing
// left to save and a crash loses only what was queued); the coordinator
// lists what is stored at start-up and asks for blocks back when a prompt
// matches them.
//
// One file per block, <dir>/<model fingerprint>/kv<begin>-<end>/<key>.kvb
// (16 hex digits each; begin, end the shard's KV heads):
//
//   KvBlockFileHeader                        96 bytes
//   tokens   int32[block_tokens]             the block's token ids
//   payload  KvCache::CachedBlockBytes       for each layer and KV head: K segment, V segment
//
// Files are written by a thread of their own under a temporary name, then
// renamed, never on the step path; a full disk is a warning. The store keeps
// at most `max_bytes`, deleting the least recently used files first. A file
// that does not match this model (its GgufFile::Fingerprint), dtype, block
// size and shard, that is truncated or that fails a checksum is skipped with
// one warning line and deleted: the prefix is recomputed, never served wrong.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "core/kv_format.h"
#include "core/kv_heads.h"
#include "core/status.h"

namespace ellm::attn {

struct KvBlockFileHeader {
  char magic[8];              // "ELLMKVB" and a 0
  uint32_t version;           // kKvStoreVersion
  uint32_t header_bytes;      // sizeof(KvBlockFileHeader)
  uint64_t model;             // GgufFile::Fingerprint() of the model file
  uint32_t dtype;             // KvDType
  uint32_t block_tokens;
  uint32_t layers;
  uint32_t head_dim;
  uint32_t kv_head_begin;     // the shard: KV heads [begin, end)
  uint32_t kv_head_end;
  uint64_t key;               // the coordinator's chain hash of the tokens up to the block's end
  uint64_t parent;            // the key before it (0 for a first block)
  uint64_t payload_bytes;
  uint64_t payload_checksum;  // Checksum64 of the payload
  uint64_t header_checksum;   // Checksum64 of this header (this field 0) and the tokens
  uint64_t reserved;          // 0
};
static_assert(sizeof(KvBlockFileHeader) == 96);
inline constexpr uint32_t kKvStoreVersion = 1;

// A 64-bit checksum of `n` bytes (four multiply-rotate lanes over 8-byte
// words; detects truncation, flipped bits and reordered words).
uint64_t Checksum64(const void* data, size_t n);

// What a stored block must match to be used.
struct KvStoreLayout {
  uint64_t model = 0;
  KvDType dtype = KvDType::kInt8;
  int block_tokens = 16;
  int layers = 0;
  int head_dim = 0;
  KvHeads heads;  // the shard's
  uint64_t payload_bytes = 0;  // KvCache::BlockBytes
};

class KvStore {
 public:
  // Opens (creating) the shard's folder under `dir` and indexes the valid
  // files in it. An error only when the folder cannot be made or read (the
  // worker then runs without a store).
  static absl::StatusOr<std::unique_ptr<KvStore>> Open(const std::string& dir, int64_t max_bytes,
                                                       const KvStoreLayout& layout);
  // Writes what is still queued, then stops the writer.
  ~KvStore();

  struct Stored {
    uint64_t key = 0;
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
  };
  // The blocks on disk (headers checked), in no particular order.
  std::vector<Stored> List() const;
  // Queues a block for the writer (`tokens` holds block_tokens ids). Blocks
  // already stored are not written again.
  void Save(uint64_t key, uint64_t parent, const int32_t* tokens, std::string payload);
  // Whether Save would queue the block: it is not stored (a stored one is
  // marked recently used instead), not queued, and the writer's queue has
  // room. Lets the caller skip copying the bytes of a block Save would drop.
  bool Wants(uint64_t key);
  // Reads a block's payload back, checking the file again, and marks it
  // recently used. NotFound when it is not stored; DataLoss (the file is
  // deleted) when it fails a check.
  absl::StatusOr<std::string> Load(uint64_t key);
  // Waits until every queued block is written (or given up).
  void Flush();

  const std::string& folder() const { return folder_; }
  int64_t bytes() const;
  int64_t files() const;
  // How many block files the size bound holds.
  int64_t capacity_blocks() const;

 private:
  struct Entry {
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    int64_t file_bytes = 0;
    uint64_t stamp = 0;  // its place in lru_
  };
  struct Pending {
    uint64_t key = 0, parent = 0;
    std::vector<int32_t> tokens;
    std::string payload;
  };

  KvStore(std::string folder, int64_t max_bytes, const KvStoreLayout& layout)
      : folder_(std::move(folder)), max_bytes_(max_bytes), layout_(layout) {}
  std::string PathOf(uint64_t key) const;
  // Reads and checks a file's header and tokens; with `payload`, the payload too.
  absl::StatusOr<Stored> ReadFile(const std::string& path, uint64_t expected_key,
                                  std::string* payload) const;
  void Scan();
  void WriterLoop();
  absl::Status Write(const Pending& p);
  // Adds an entry as most recently used and deletes the oldest files beyond
  // max_bytes_. Locked.
  void Index(uint64_t key, Entry entry);
  // Marks a stored block most recently used; false when it is not stored.
  // Locked.
  bool Touch(uint64_t key);
  void Forget(uint64_t key, bool delete_file);  // locked
  // Save's test (Wants): not stored (a stored block is touched instead), not
  // queued, and room in the queue for `payload_bytes`; a block turned away
  // for room counts in dropped_. Locked.
  bool Admits(uint64_t key, uint64_t payload_bytes);

  const std::string folder_;
  const int64_t max_bytes_;
  const KvStoreLayout layout_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  absl::flat_hash_map<uint64_t, Entry> index_;
  std::map<uint64_t, uint64_t> lru_;  // stamp -> key, oldest first
  uint64_t next_stamp_ = 1;
  int64_t bytes_ = 0;
  std::deque<Pending> queue_;
  int64_t queued_bytes_ = 0;
  bool writing_ = false;
  bool stop_ = false;
  bool warned_full_ = false;
  int64_t dropped_ = 0;  // blocks not queued since the queue was last empty (one warning per run)
  std::thread writer_;
};

}  // namespace ellm::attn
