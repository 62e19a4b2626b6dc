#include "attn-worker/kv_store.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/log.h"

namespace ellm::attn {
namespace {

namespace fs = std::filesystem;

constexpr char kMagic[8] = {'E', 'L', 'L', 'M', 'K', 'V', 'B', 0};
// Blocks waiting for the writer beyond this are dropped (with a warning):
// the store is a cache, and memory for the step path comes first.
constexpr int64_t kMaxQueuedBytes = int64_t{512} << 20;

uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

std::string Hex(uint64_t v) { return absl::StrFormat("%016x", v); }

// Reads exactly n bytes at offset; false on a short read or an error.
bool ReadAt(int fd, void* out, size_t n, off_t offset) {
  char* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t r = pread(fd, p, n, offset);
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
    offset += r;
  }
  return true;
}

bool WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w <= 0) {
      if (w < 0 && errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

uint64_t Checksum64(const void* data, size_t n) {
  constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL, kP2 = 0xC2B2AE3D27D4EB4FULL;
  uint64_t lane[4] = {kP1, kP2, ~kP1, ~kP2};
  const auto* p = static_cast<const unsigned char*>(data);
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int j = 0; j < 4; ++j) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * j, 8);
      lane[j] = Rotl(lane[j] + w * kP2, 31) * kP1;
    }
  }
  uint64_t h = Rotl(lane[0], 1) + Rotl(lane[1], 7) + Rotl(lane[2], 12) + Rotl(lane[3], 18);
  for (; i < n; ++i) h = Rotl(h ^ (p[i] * kP1), 11) * kP2;
  h ^= static_cast<uint64_t>(n) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  return h;
}

absl::StatusOr<std::unique_ptr<KvStore>> KvStore::Open(const std::string& dir, int64_t max_bytes,
                                                       const KvStoreLayout& layout) {
  const std::string folder = absl::StrCat(dir, "/", Hex(layout.model), "/kv", layout.heads.begin, "-",
                                          layout.heads.end);
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot create ", folder, ": ", ec.message()));
  if (access(folder.c_str(), R_OK | W_OK | X_OK) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot read and write ", folder));
  }
  std::unique_ptr<KvStore> store(new KvStore(folder, max_bytes, layout));
  store->Scan();
  store->writer_ = std::thread([s = store.get()] { s->WriterLoop(); });
  return store;
}

KvStore::~KvStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

std::string KvStore::PathOf(uint64_t key) const { return absl::StrCat(folder_, "/", Hex(key), ".kvb"); }

absl::StatusOr<KvStore::Stored> KvStore::ReadFile(const std::string& path, uint64_t expected_key,
                                                  std::string* payload) const {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    return errno == ENOENT ? absl::NotFoundError(absl::StrCat(path, " does not exist"))
                           : absl::DataLossError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return absl::DataLossError(absl::StrCat(path, " is not a regular file"));
  KvBlockFileHeader h;
  if (!ReadAt(fd, &h, sizeof(h), 0)) return absl::DataLossError(absl::StrCat(path, " is truncated (header)"));
  const KvStoreLayout& L = layout_;
  auto mismatch = [&](const char* what) {
    return absl::DataLossError(absl::StrCat(path, ": ", what, " does not match this server"));
  };
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0) return absl::DataLossError(absl::StrCat(path, " is not a KV block file"));
  if (h.version != kKvStoreVersion || h.header_bytes != sizeof(h)) return mismatch("the file version");
  if (h.block_tokens != static_cast<uint32_t>(L.block_tokens)) return mismatch("the block size");
  const std::vector<int32_t>::size_type n_tokens = static_cast<size_t>(L.block_tokens);
  std::vector<int32_t> tokens(n_tokens);
  if (!ReadAt(fd, tokens.data(), n_tokens * sizeof(int32_t), sizeof(h))) {
    return absl::DataLossError(absl::StrCat(path, " is truncated (tokens)"));
  }
  KvBlockFileHeader zeroed = h;
  zeroed.header_checksum = 0;
  std::string check(reinterpret_cast<const char*>(&zeroed), sizeof(zeroed));
  check.append(reinterpret_cast<const char*>(tokens.data()), n_tokens * sizeof(int32_t));
  if (Checksum64(check.data(), check.size()) != h.header_checksum) {
    return absl::DataLossError(absl::StrCat(path, ": it fails its header checksum"));
  }
  if (h.model != L.model) return mismatch("the model file");
  if (h.dtype != static_cast<uint32_t>(L.dtype)) return mismatch("the KV dtype");
  if (h.block_tokens != static_cast<uint32_t>(L.block_tokens) || h.layers != static_cast<uint32_t>(L.layers) ||
      h.head_dim != static_cast<uint32_t>(L.head_dim) || h.payload_bytes != L.payload_bytes) {
    return mismatch("the block layout");
  }
  if (h.kv_head_begin != static_cast<uint32_t>(L.heads.begin) ||
      h.kv_head_end != static_cast<uint32_t>(L.heads.end)) {
    return mismatch("the shard");
  }
  if (h.key != expected_key) return absl::DataLossError(absl::StrCat(path, " holds another key"));
  const uint64_t total = sizeof(h) + n_tokens * sizeof(int32_t) + h.payload_bytes;
  if (static_cast<uint64_t>(st.st_size) != total) {
    return absl::DataLossError(absl::StrCat(path, " has ", st.st_size, " bytes, expected ", total,
                                            " (truncated?)"));
  }
  if (payload != nullptr) {
    payload->resize(h.payload_bytes);
    if (!ReadAt(fd, payload->data(), payload->size(), static_cast<off_t>(sizeof(h) + n_tokens * sizeof(int32_t)))) {
      return absl::DataLossError(absl::StrCat(path, " is truncated (payload)"));
    }
    if (Checksum64(payload->data(), payload->size()) != h.payload_checksum) {
      return absl::DataLossError(absl::StrCat(path, ": it fails its payload checksum"));
    }
  }
  return Stored{h.key, h.parent, std::move(tokens)};
}

void KvStore::Scan() {
  std::error_code ec;
  int64_t skipped = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (const fs::directory_entry& e : fs::directory_iterator(folder_, ec)) {
    const std::string name = e.path().filename().string();
    if (const size_t tmp = name.find(".tmp"); tmp != std::string::npos) {
      // A write that never finished, unless its writer (the pid after
      // ".tmp") is alive: another server on the same folder, mid-write.
      int pid = 0;
      const bool writer_alive = absl::SimpleAtoi(name.substr(tmp + 4), &pid) && pid > 0 && pid != getpid() &&
                                (kill(pid, 0) == 0 || errno == EPERM);
      if (!writer_alive) fs::remove(e.path(), ec);
      continue;
    }
    uint64_t key = 0;
    if (name.size() != 20 || name.substr(16) != ".kvb" || !absl::SimpleHexAtoi(name.substr(0, 16), &key)) {
      LogWarning("KV store: skipping %s (not a block file)", e.path().string());
      ++skipped;
      continue;
    }
    absl::StatusOr<Stored> s = ReadFile(e.path().string(), key, nullptr);
    if (!s.ok()) {
      LogWarning("KV store: skipping %s", s.status().message());
      fs::remove(e.path(), ec);
      ++skipped;
      continue;
    }
    const int64_t file_bytes = static_cast<int64_t>(e.file_size(ec));
    Entry entry{s->parent, std::move(s->tokens), file_bytes, 0};
    index_.erase(key);
    entry.stamp = next_stamp_++;
    lru_[entry.stamp] = key;
    bytes_ += file_bytes;
    index_[key] = std::move(entry);
  }
  if (ec) LogWarning("KV store: cannot list %s: %s", folder_, ec.message());
  LogInfo("KV store %s: %d blocks (%.1f MiB)%s", folder_, index_.size(), bytes_ / 1048576.0,
          skipped > 0 ? absl::StrCat(", ", skipped, " files skipped") : "");
  while (bytes_ > max_bytes_ && !lru_.empty()) Forget(lru_.begin()->second, /*delete_file=*/true);
}

std::vector<KvStore::Stored> KvStore::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Stored> out;
  out.reserve(index_.size());
  for (const auto& [key, e] : index_) out.push_back({key, e.parent, e.tokens});
  return out;
}

void KvStore::Save(uint64_t key, uint64_t parent, const int32_t* tokens, std::string payload) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!Admits(key, payload.size())) return;
  queued_bytes_ += static_cast<int64_t>(payload.size());
  queue_.push_back({key, parent, std::vector<int32_t>(tokens, tokens + layout_.block_tokens), std::move(payload)});
  cv_.notify_all();
}

bool KvStore::Wants(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  return Admits(key, layout_.payload_bytes);
}

bool KvStore::Admits(uint64_t key, uint64_t payload_bytes) {
  if (Touch(key)) return false;  // stored: now the most recently used
  for (const Pending& p : queue_) {
    if (p.key == key) return false;
  }
  if (queued_bytes_ + static_cast<int64_t>(payload_bytes) > kMaxQueuedBytes) {
    if (dropped_++ == 0) {
      LogWarning("KV store: the writer is %d MiB behind; new blocks are not stored until it catches up",
                 queued_bytes_ >> 20);
    }
    return false;
  }
  return true;
}

absl::StatusOr<std::string> KvStore::Load(uint64_t key) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!index_.contains(key)) return absl::NotFoundError(absl::StrCat("block ", Hex(key), " is not stored"));
  }
  std::string payload;
  absl::StatusOr<Stored> s = ReadFile(PathOf(key), key, &payload);
  std::lock_guard<std::mutex> lock(mu_);
  if (!s.ok()) {
    LogWarning("KV store: skipping %s", s.status().message());
    Forget(key, /*delete_file=*/s.status().code() != absl::StatusCode::kNotFound);
    return s.status().code() == absl::StatusCode::kNotFound ? s.status() : absl::DataLossError(s.status().message());
  }
  // The writer may have evicted the block while the file was read (the lock
  // is not held across the read): the bytes read are whole and checked, so
  // they are served either way; Touch then finds nothing to mark.
  Touch(key);
  return payload;
}

void KvStore::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && !writing_; });
}

int64_t KvStore::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

int64_t KvStore::files() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(index_.size());
}

int64_t KvStore::capacity_blocks() const {
  return max_bytes_ / static_cast<int64_t>(sizeof(KvBlockFileHeader) +
                                           static_cast<size_t>(layout_.block_tokens) * sizeof(int32_t) +
                                           layout_.payload_bytes);
}

void KvStore::WriterLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, everything written
    Pending p = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    lock.unlock();
    const absl::Status st = Write(p);
    lock.lock();
    writing_ = false;
    queued_bytes_ -= static_cast<int64_t>(p.payload.size());
    if (st.ok()) {
      warned_full_ = false;
      const int64_t file_bytes = static_cast<int64_t>(sizeof(KvBlockFileHeader) +
                                                      p.tokens.size() * sizeof(int32_t) + p.payload.size());
      Index(p.key, Entry{p.parent, std::move(p.tokens), file_bytes, 0});
    } else if (!warned_full_) {
      // One line per run of failures (a full disk fails every write).
      LogWarning("KV store: %s; serving goes on without storing", st.message());
      warned_full_ = true;
    }
    if (queue_.empty() && dropped_ > 0) {
      LogInfo("KV store: the writer caught up; %d blocks were not stored meanwhile", dropped_);
      dropped_ = 0;
    }
    cv_.notify_all();
  }
}

absl::Status KvStore::Write(const Pending& p) {
  KvBlockFileHeader h;
  std::memset(&h, 0, sizeof(h));
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = kKvStoreVersion;
  h.header_bytes = sizeof(h);
  h.model = layout_.model;
  h.dtype = static_cast<uint32_t>(layout_.dtype);
  h.block_tokens = static_cast<uint32_t>(layout_.block_tokens);
  h.layers = static_cast<uint32_t>(layout_.layers);
  h.head_dim = static_cast<uint32_t>(layout_.head_dim);
  h.kv_head_begin = static_cast<uint32_t>(layout_.heads.begin);
  h.kv_head_end = static_cast<uint32_t>(layout_.heads.end);
  h.key = p.key;
  h.parent = p.parent;
  h.payload_bytes = p.payload.size();
  h.payload_checksum = Checksum64(p.payload.data(), p.payload.size());
  std::string check(reinterpret_cast<const char*>(&h), sizeof(h));
  check.append(reinterpret_cast<const char*>(p.tokens.data()), p.tokens.size() * sizeof(int32_t));
  h.header_checksum = Checksum64(check.data(), check.size());

  const std::string path = PathOf(p.key);
  const std::string tmp = absl::StrCat(path, ".tmp", getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot create ", tmp, ": ", std::strerror(errno)));
  const bool ok = WriteAll(fd, &h, sizeof(h)) &&
                  WriteAll(fd, p.tokens.data(), p.tokens.size() * sizeof(int32_t)) &&
                  WriteAll(fd, p.payload.data(), p.payload.size());
  const int err = errno;
  close(fd);
  if (!ok || rename(tmp.c_str(), path.c_str()) != 0) {
    unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot write ", path, ": ", std::strerror(ok ? errno : err)));
  }
  return absl::OkStatus();
}

void KvStore::Index(uint64_t key, Entry entry) {
  if (index_.contains(key)) Forget(key, /*delete_file=*/false);
  entry.stamp = next_stamp_++;
  lru_[entry.stamp] = key;
  bytes_ += entry.file_bytes;
  index_[key] = std::move(entry);
  while (bytes_ > max_bytes_ && lru_.size() > 1) Forget(lru_.begin()->second, /*delete_file=*/true);
}

bool KvStore::Touch(uint64_t key) {
  const auto it = index_.find(key);
  if (it == index_.end()) return false;
  Entry& e = it->second;
  lru_.erase(e.stamp);
  e.stamp = next_stamp_++;
  lru_[e.stamp] = key;
  return true;
}

void KvStore::Forget(uint64_t key, bool delete_file) {
  const auto it = index_.find(key);
  if (it == index_.end()) return;
  lru_.erase(it->second.stamp);
  bytes_ -= it->second.file_bytes;
  index_.erase(it);
  if (delete_file) unlink(PathOf(key).c_str());
}

}  // namespace ellm::attn
