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
    // The kernels stream this memory: huge pages spare TLB misses.
    if (m->data_ != nullptr) madvise(m->data_, bytes, MADV_HUGEPAGE);
  } else {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    m->data_ = p == MAP_FAILED ? nullptr : static_cast<float*>(p);
    if (m->data_ != nullptr) madvise(m->data_, bytes, MADV_HUGEPAGE);
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
  const KvFormat f = KvFormat::Make(o.dtype, o.head_dim);
  return static_cast<size_t>(o.layers) * o.kv_heads * 2 * f.SegmentBytes(o.block_tokens);
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheOptions& options) {
  if (options.layers <= 0 || options.kv_heads <= 0 || options.head_dim <= 0 ||
      options.block_tokens <= 0 || options.blocks <= 0) {
    return absl::InvalidArgumentError("KV cache options must all be positive");
  }
  if (options.blocks > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(options.blocks, " KV blocks are more than ", INT32_MAX,
                                                   " (block ids are 32-bit): ask for less memory"));
  }
  if (options.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim ", options.head_dim, " exceeds ", kMaxHeadDim));
  }
  std::unique_ptr<KvCache> cache(new KvCache(options));
  cache->format_ = KvFormat::Make(options.dtype, options.head_dim);
  RETURN_IF_ERROR(cache->format_.CheckBlockTokens(options.block_tokens));
  cache->segment_bytes_ = cache->format_.SegmentBytes(options.block_tokens);
  const size_t block_bytes = BlockBytes(options);
  if (block_bytes > SIZE_MAX / static_cast<size_t>(options.blocks)) {
    return absl::InvalidArgumentError("KV cache size overflows");
  }
  ASSIGN_OR_RETURN(cache->memory_,
                   NodeMemory::Allocate(block_bytes * options.blocks, options.numa_node));
  cache->free_bits_.assign(static_cast<size_t>((options.blocks + 63) / 64), ~uint64_t{0});
  if (options.blocks % 64 != 0) cache->free_bits_.back() = (uint64_t{1} << (options.blocks % 64)) - 1;
  cache->unclaimed_bits_ = cache->free_bits_;
  cache->free_count_ = options.blocks;
  cache->refs_.assign(static_cast<size_t>(options.blocks), 0);
  cache->is_cached_.assign(static_cast<size_t>(options.blocks), 0);
  return cache;
}

absl::Status KvCache::Reserve(uint64_t seq, int start, int n) {
  const auto found = seqs_.find(seq);
  const int length = found == seqs_.end() ? 0 : found->second.length;
  if (start != length) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq, " holds ", length,
                                                      " positions; cannot append at ", start));
  }
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("cannot reserve ", n, " positions"));
  const int64_t bt = options_.block_tokens;
  if (n > 0 && start % bt != 0 && is_cached_[found->second.blocks.back()]) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", seq, " ends in a cached partial block; it cannot grow"));
  }
  // 64-bit throughout: start + n may exceed int, and such a need is refused
  // below before anything is taken.
  const int64_t need = (int64_t{start} + n + bt - 1) / bt;
  const int64_t held = found == seqs_.end() ? 0 : static_cast<int64_t>(found->second.blocks.size());
  if (int64_t{start} + n > INT32_MAX || need - held > free_count_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: sequence ", seq, " needs ", need - held, " more blocks, ",
                     free_count_, " free of ", options_.blocks));
  }
  Sequence& s = seqs_[seq];
  while (static_cast<int64_t>(s.blocks.size()) < need) s.blocks.push_back(TakeBlock(s));
  s.length = start + n;
  return absl::OkStatus();
}

int64_t KvCache::FindSet(int64_t from, int64_t to,
                         std::initializer_list<const std::vector<uint64_t>*> masks) const {
  for (int64_t w = from / 64; w * 64 < to; ++w) {
    uint64_t bits = ~uint64_t{0};
    for (const std::vector<uint64_t>* m : masks) bits &= (*m)[static_cast<size_t>(w)];
    if (w == from / 64) bits &= ~uint64_t{0} << (from % 64);
    if (bits != 0) {
      const int64_t b = w * 64 + __builtin_ctzll(bits);
      return b < to ? b : -1;
    }
  }
  return -1;
}

void KvCache::SetBit(std::vector<uint64_t>& bits, int64_t b, bool on) {
  const uint64_t m = uint64_t{1} << (b % 64);
  uint64_t& w = bits[static_cast<size_t>(b / 64)];
  w = on ? w | m : w & ~m;
}

void KvCache::ReleaseZone(Sequence& s) {
  // Claims are hints: a block of the zone that another sequence took (the
  // pool was full) is simply skipped.
  for (int64_t b = s.blocks.empty() ? s.zone_end : int64_t{s.blocks.back()} + 1; b < s.zone_end; ++b) {
    if (Bit(free_bits_, b)) SetBit(unclaimed_bits_, b, true);
  }
  s.zone_end = 0;
}

int32_t KvCache::TakeBlock(Sequence& s) {
  const int64_t n = options_.blocks;
  const int64_t from = s.blocks.empty() ? 0 : int64_t{s.blocks.back()} + 1;
  int64_t b = -1;
  if (from < s.zone_end && Bit(free_bits_, from)) {
    b = from;  // the zone's next block
  } else {
    ReleaseZone(s);
    // A new zone: the first free unclaimed block at or after `from` (then from
    // the start) and the free unclaimed run after it.
    b = FindSet(from, n, {&free_bits_, &unclaimed_bits_});
    if (b < 0) b = FindSet(0, std::min(from, n), {&free_bits_, &unclaimed_bits_});
    if (b >= 0) {
      int64_t end = b + 1;
      for (; end < n && end < b + kZoneBlocks && Bit(free_bits_, end) && Bit(unclaimed_bits_, end); ++end) {
        SetBit(unclaimed_bits_, end, false);
      }
      s.zone_end = end;
    } else {
      // Every free block lies in some zone: take one all the same.
      b = FindSet(from, n, {&free_bits_});
      if (b < 0) b = FindSet(0, std::min(from, n), {&free_bits_});
      s.zone_end = 0;
    }
  }
  SetBit(free_bits_, b, false);
  SetBit(unclaimed_bits_, b, true);
  --free_count_;
  refs_[b] = 1;
  return static_cast<int32_t>(b);
}

void KvCache::Unref(int32_t b) {
  if (--refs_[b] > 0 || is_cached_[b]) return;
  SetBit(free_bits_, b, true);
  ++free_count_;
}

absl::Status KvCache::Publish(uint64_t seq, int first, const std::vector<uint64_t>& keys,
                             uint64_t partial_key, int partial_rows) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot publish blocks of unknown sequence ", seq));
  }
  const Sequence& s = it->second;
  const int bt = options_.block_tokens;
  const int64_t full = s.length / bt;
  if (first < 0 || first + static_cast<int64_t>(keys.size()) > full) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence ", seq, " has ", full, " full blocks; cannot publish blocks [", first, ", ",
        first + keys.size(), ")"));
  }
  const int64_t last = first + static_cast<int64_t>(keys.size());  // the partial block, if any
  if (partial_rows != 0 &&
      (partial_rows < 0 || partial_rows >= bt || int64_t{s.length} != last * bt + partial_rows)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence ", seq, " holds ", s.length, " positions; block ", last, " is not its last, partial ",
        "block of ", partial_rows, " positions"));
  }
  std::vector<uint64_t> all = keys;
  if (partial_rows > 0) all.push_back(partial_key);
  for (size_t i = 0; i < all.size(); ++i) {
    const int32_t b = s.blocks[first + i];
    if (cached_.contains(all[i]) || is_cached_[b]) {
      return absl::InvalidArgumentError(absl::StrCat("block ", first + i, " of sequence ", seq,
                                                     " or key ", all[i], " is already cached"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (all[j] == all[i]) return absl::InvalidArgumentError("a key is published twice");
    }
  }
  for (size_t i = 0; i < all.size(); ++i) {
    const int32_t b = s.blocks[first + i];
    cached_[all[i]] = b;
    is_cached_[b] = 1;
  }
  return absl::OkStatus();
}

absl::Status KvCache::Attach(uint64_t seq, const std::vector<uint64_t>& keys, uint64_t partial_key,
                            int partial_rows) {
  const auto it = seqs_.find(seq);
  if (it != seqs_.end() && (it->second.length > 0 || !it->second.blocks.empty())) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", seq, " already holds positions; cached blocks start a sequence"));
  }
  std::vector<int32_t> blocks;
  blocks.reserve(keys.size());
  for (uint64_t key : keys) {
    const auto found = cached_.find(key);
    if (found == cached_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cached block ", key, " for sequence ", seq, " is not in this worker's cache"));
    }
    blocks.push_back(found->second);
  }
  int32_t partial_src = -1;
  if (partial_rows != 0) {
    const auto found = cached_.find(partial_key);
    if (partial_rows < 0 || partial_rows >= options_.block_tokens || found == cached_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("cannot copy ", partial_rows, " positions of block ",
                                                     partial_key, " for sequence ", seq,
                                                     ": not cached or not a partial block's size"));
    }
    if (free_count_ == 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("KV cache full: no free block to copy a cached partial block into for sequence ", seq));
    }
    partial_src = found->second;
  }
  if (blocks.empty() && partial_src < 0) return absl::OkStatus();
  for (int32_t b : blocks) ++refs_[b];
  Sequence& s = seqs_[seq];
  s.blocks = std::move(blocks);
  s.length = static_cast<int>(s.blocks.size()) * options_.block_tokens;
  s.zone_end = 0;
  if (partial_src >= 0) {
    // Whole segments: rows are independent (per-position scales), and the
    // rows past partial_rows are overwritten as the sequence grows.
    const int32_t b = TakeBlock(s);
    s.blocks.push_back(b);
    const size_t seg = static_cast<size_t>(segment_bytes_);
    for (int l = 0; l < options_.layers; ++l) {
      for (int h = 0; h < options_.kv_heads; ++h) {
        std::memcpy(BlockBase(l, h, b), BlockBase(l, h, partial_src), seg);
        std::memcpy(BlockBase(l, h, b) + ValueOffset(), BlockBase(l, h, partial_src) + ValueOffset(), seg);
      }
    }
    s.length += partial_rows;
  }
  return absl::OkStatus();
}

absl::Status KvCache::Evict(const std::vector<uint64_t>& keys) {
  for (uint64_t key : keys) {
    const auto found = cached_.find(key);
    if (found == cached_.end()) {
      return absl::FailedPreconditionError(absl::StrCat("cannot evict block ", key, ": not cached"));
    }
    if (refs_[found->second] > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot evict block ", key, ": ", refs_[found->second], " sequences use it"));
    }
  }
  for (uint64_t key : keys) {
    const auto found = cached_.find(key);
    if (found == cached_.end()) continue;  // listed twice
    const int32_t b = found->second;
    cached_.erase(found);
    is_cached_[b] = 0;
    SetBit(free_bits_, b, true);
    ++free_count_;
  }
  return absl::OkStatus();
}

uint8_t* KvCache::BlockBase(int layer, int kv_head, int32_t block) const {
  const size_t region = static_cast<size_t>(layer) * options_.kv_heads + kv_head;
  return memory_->bytes_data() +
         (region * 2 * options_.blocks + block) * static_cast<size_t>(segment_bytes_);
}

float* KvCache::KeyRow(uint64_t seq, int layer, int kv_head, int pos) {
  if (options_.dtype != KvDType::kF32) return nullptr;
  const Sequence& s = seqs_.at(seq);
  return reinterpret_cast<float*>(BlockBase(layer, kv_head, s.blocks[pos / options_.block_tokens])) +
         static_cast<size_t>(pos % options_.block_tokens) * options_.head_dim;
}

float* KvCache::ValueRow(uint64_t seq, int layer, int kv_head, int pos) {
  if (options_.dtype != KvDType::kF32) return nullptr;
  return reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(KeyRow(seq, layer, kv_head, pos)) +
                                  ValueOffset());
}

void KvCache::Store(uint64_t seq, int layer, int kv_head, int pos, const float* k, const float* v) {
  const KvSeqView view = View(seq, layer, kv_head);
  const int row = view.RowInTile(pos);
  format_.StoreKey(const_cast<uint8_t*>(view.KeyTile(pos)), row, k);
  format_.StoreValue(const_cast<uint8_t*>(view.ValueTile(pos)), row, v);
}

KvSeqView KvCache::View(uint64_t seq, int layer, int kv_head) const {
  const Sequence& s = seqs_.at(seq);
  KvSeqView v;
  v.format = format_;
  v.base = BlockBase(layer, kv_head, 0);
  v.blocks = s.blocks.data();
  v.block_stride = segment_bytes_;
  v.value_offset = ValueOffset();
  v.block_tokens = options_.block_tokens;
  v.length = s.length;
  return v;
}

int KvCache::Length(uint64_t seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? 0 : it->second.length;
}

void KvCache::Discard(const std::vector<uint64_t>& keys) {
  for (uint64_t key : keys) {
    const auto found = cached_.find(key);
    if (found == cached_.end() || refs_[found->second] > 0) continue;
    const int32_t b = found->second;
    cached_.erase(found);
    is_cached_[b] = 0;
    SetBit(free_bits_, b, true);
    ++free_count_;
  }
}

absl::StatusOr<std::string> KvCache::CachedBlockBytes(uint64_t key) const {
  const auto found = cached_.find(key);
  if (found == cached_.end()) return absl::NotFoundError(absl::StrCat("block ", key, " is not cached"));
  const size_t seg = static_cast<size_t>(segment_bytes_);
  std::string out;
  out.reserve(2 * seg * options_.layers * options_.kv_heads);
  for (int l = 0; l < options_.layers; ++l) {
    for (int h = 0; h < options_.kv_heads; ++h) {
      const uint8_t* k = BlockBase(l, h, found->second);
      out.append(reinterpret_cast<const char*>(k), seg);
      out.append(reinterpret_cast<const char*>(k + ValueOffset()), seg);
    }
  }
  return out;
}

absl::Status KvCache::InsertCached(uint64_t key, std::string_view bytes) {
  const size_t seg = static_cast<size_t>(segment_bytes_);
  if (bytes.size() != 2 * seg * options_.layers * options_.kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("a block of this cache holds ",
                                                   2 * seg * options_.layers * options_.kv_heads,
                                                   " bytes, not ", bytes.size()));
  }
  if (cached_.contains(key)) return absl::InvalidArgumentError(absl::StrCat("block ", key, " is already cached"));
  if (free_count_ == 0) return absl::ResourceExhaustedError("no free KV block to load into");
  // Blocks of one run of inserts come from one zone, ascending, as a
  // sequence's would (EndInserts releases the zone's rest).
  const int32_t b = TakeBlock(inserting_);
  inserting_.blocks.push_back(b);
  refs_[b] = 0;
  const char* src = bytes.data();
  for (int l = 0; l < options_.layers; ++l) {
    for (int h = 0; h < options_.kv_heads; ++h) {
      uint8_t* k = BlockBase(l, h, b);
      std::memcpy(k, src, seg);
      std::memcpy(k + ValueOffset(), src + seg, seg);
      src += 2 * seg;
    }
  }
  cached_[key] = b;
  is_cached_[b] = 1;
  return absl::OkStatus();
}

void KvCache::EndInserts() {
  ReleaseZone(inserting_);
  inserting_.blocks.clear();
}

absl::Status KvCache::Apply(const KvOps& ops) {
  for (const KvOps::SequenceBlocks& p : ops.publish) {
    RETURN_IF_ERROR(Publish(p.seq, p.first_block, p.keys, p.partial_key, p.partial_rows));
  }
  for (uint64_t seq : ops.free) Free(seq);
  RETURN_IF_ERROR(Evict(ops.evict));
  Discard(ops.discard);
  for (const KvOps::SequenceBlocks& a : ops.attach) {
    if (a.first_block != 0) return absl::InvalidArgumentError("cached blocks start a sequence (first_block 0)");
    RETURN_IF_ERROR(Attach(a.seq, a.keys, a.partial_key, a.partial_rows));
  }
  return absl::OkStatus();
}

void KvCache::Free(uint64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  ReleaseZone(it->second);
  for (int32_t b : it->second.blocks) Unref(b);
  seqs_.erase(it);
}

}  // namespace ellm::attn
