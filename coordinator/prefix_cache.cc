#include "coordinator/prefix_cache.h"

#include <algorithm>
#include <iterator>

namespace ellm::coord {
namespace {

// splitmix64's finaliser: a bijective 64-bit mix.
uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t ChainKey(uint64_t parent, const int32_t* tokens, int n) {
  uint64_t h = Mix(parent + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(n + 1));
  for (int i = 0; i < n; ++i) h = Mix(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) + (static_cast<uint64_t>(i) << 32)));
  return h;
}

std::vector<uint64_t> PrefixCache::Lookup(const std::vector<int32_t>& tokens, int max_blocks) const {
  std::vector<uint64_t> keys;
  const int bt = block_tokens_;
  const int blocks = std::min<int64_t>(max_blocks, static_cast<int64_t>(tokens.size()) / bt);
  uint64_t parent = 0;
  for (int i = 0; i < blocks; ++i) {
    const int32_t* t = tokens.data() + static_cast<size_t>(i) * bt;
    const uint64_t key = ChainKey(parent, t, bt);
    const auto it = entries_.find(key);
    if (it == entries_.end() || it->second.parent != parent || it->second.tokens.size() != static_cast<size_t>(bt) ||
        !std::equal(t, t + bt, it->second.tokens.begin())) {
      break;
    }
    keys.push_back(key);
    parent = key;
  }
  return keys;
}

PrefixCache::Partial PrefixCache::LongestPartial(uint64_t parent, const int32_t* tokens, int n) const {
  Partial best;
  const auto children = children_.find(parent);
  if (children == children_.end() || n <= 0) return best;
  const std::map<std::vector<int32_t>, uint64_t>& kids = children->second;
  const std::vector<int32_t> query(tokens, tokens + n);
  const auto consider = [&](std::map<std::vector<int32_t>, uint64_t>::const_iterator it) {
    const std::vector<int32_t>& t = it->first;
    const int limit = std::min<int>(n, static_cast<int>(t.size()));
    int rows = 0;
    while (rows < limit && t[rows] == query[rows]) ++rows;
    if (rows > best.rows) best = {it->second, rows};
  };
  const auto at = kids.lower_bound(query);
  if (at != kids.end()) consider(at);
  if (at != kids.begin()) consider(std::prev(at));
  return best;
}

void PrefixCache::Acquire(const std::vector<uint64_t>& keys) {
  for (uint64_t key : keys) {
    Entry& e = entries_.at(key);
    if (e.refs++ == 0) lru_.erase(e.stamp);
  }
}

void PrefixCache::Release(const std::vector<uint64_t>& keys) {
  // Deepest first: the chain's last block gets the oldest stamp.
  for (auto it = keys.rbegin(); it != keys.rend(); ++it) {
    Entry& e = entries_.at(*it);
    if (--e.refs == 0) {
      e.stamp = next_stamp_++;
      lru_[e.stamp] = *it;
    }
  }
}

bool PrefixCache::Insert(uint64_t key, uint64_t parent, const int32_t* tokens, int n) {
  if (entries_.contains(key)) return false;
  Entry& e = entries_[key];
  e.parent = parent;
  e.tokens.assign(tokens, tokens + n);
  e.refs = 1;
  children_[parent].emplace(e.tokens, key);
  return true;
}

std::vector<uint64_t> PrefixCache::Evict(int64_t n) {
  std::vector<uint64_t> out;
  while (n-- > 0 && !lru_.empty()) {
    const uint64_t key = lru_.begin()->second;
    lru_.erase(lru_.begin());
    const auto entry = entries_.find(key);
    const auto siblings = children_.find(entry->second.parent);
    siblings->second.erase(entry->second.tokens);
    if (siblings->second.empty()) children_.erase(siblings);
    entries_.erase(entry);
    out.push_back(key);
  }
  return out;
}

void PrefixCache::AddStored(const Block& block) {
  if (static_cast<int>(block.tokens.size()) != block_tokens_) return;
  RemoveStored(block.key);
  const uint64_t stamp = next_stamp_++;
  stored_[block.key] = {block, stamp};
  stored_lru_[stamp] = block.key;
  TrimStored();
}

void PrefixCache::RemoveStored(uint64_t key) {
  const auto it = stored_.find(key);
  if (it == stored_.end()) return;
  stored_lru_.erase(it->second.stamp);
  stored_.erase(it);
}

void PrefixCache::SetStoredCapacity(int64_t blocks) {
  stored_capacity_ = std::max<int64_t>(blocks, 0);
  TrimStored();
}

void PrefixCache::TrimStored() {
  while (static_cast<int64_t>(stored_.size()) > stored_capacity_) {
    stored_.erase(stored_lru_.begin()->second);
    stored_lru_.erase(stored_lru_.begin());
  }
}

std::vector<PrefixCache::Block> PrefixCache::LookupStored(const std::vector<int32_t>& tokens,
                                                          const std::vector<uint64_t>& cached,
                                                          int max_blocks) const {
  std::vector<Block> out;
  const int bt = block_tokens_;
  const int blocks = std::min<int64_t>(max_blocks, static_cast<int64_t>(tokens.size()) / bt);
  uint64_t parent = cached.empty() ? 0 : cached.back();
  for (int i = static_cast<int>(cached.size()); i < blocks; ++i) {
    const int32_t* t = tokens.data() + static_cast<size_t>(i) * bt;
    const uint64_t key = ChainKey(parent, t, bt);
    const auto it = stored_.find(key);
    if (it == stored_.end() || it->second.block.parent != parent ||
        !std::equal(t, t + bt, it->second.block.tokens.begin())) {
      break;
    }
    out.push_back(it->second.block);
    parent = key;
  }
  return out;
}

int PrefixCache::refs(uint64_t key) const {
  const auto it = entries_.find(key);
  return it == entries_.end() ? -1 : it->second.refs;
}

}  // namespace ellm::coord
