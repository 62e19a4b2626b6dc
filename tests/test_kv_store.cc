// attn-worker/kv_store.h: blocks written, listed and loaded back across a
// restart (a new KvStore on the same folder), the size bound, and every kind
// of bad file (another model, dtype or shard; truncated; a flipped byte;
// stray files; an unreadable folder) skipped and deleted, never served.
#include "attn-worker/kv_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attn-worker/kv_cache.h"
#include "gtest/gtest.h"
#include "tests/tests_util.h"

namespace ellm::attn {
namespace {

namespace fs = std::filesystem;

KvStoreLayout Layout() {
  KvStoreLayout l;
  l.model = 0x1234abcd5678ef90ULL;
  l.dtype = KvDType::kInt8;
  l.block_tokens = 16;
  l.layers = 2;
  l.head_dim = 64;
  l.heads = {0, 2};
  l.payload_bytes = 1000;
  return l;
}

std::string Payload(uint64_t seed, size_t n = 1000) {
  std::mt19937_64 rng(seed);
  std::string p(n, '\0');
  for (char& c : p) c = static_cast<char>(rng());
  return p;
}

std::vector<int32_t> Tokens(int32_t first) {
  std::vector<int32_t> t(16);
  for (int i = 0; i < 16; ++i) t[i] = first + i;
  return t;
}

class KvStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::MakeTempDir("kvstore"); }
  void TearDown() override { fs::remove_all(dir_); }
  std::unique_ptr<KvStore> Open(const KvStoreLayout& layout = Layout(), int64_t max_bytes = 1 << 30) {
    absl::StatusOr<std::unique_ptr<KvStore>> s = KvStore::Open(dir_, max_bytes, layout);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }
  // Saves blocks 1..n (key k, parent k-1) and closes the store.
  void SaveBlocks(int n) {
    auto store = Open();
    for (int k = 1; k <= n; ++k) store->Save(k, k - 1, Tokens(100 * k).data(), Payload(k));
  }
  std::string FileOf(const KvStore& store, uint64_t key) {
    char name[32];
    std::snprintf(name, sizeof(name), "%016lx.kvb", static_cast<unsigned long>(key));
    return store.folder() + "/" + name;
  }
  std::string dir_;
};

TEST_F(KvStoreTest, BlocksSurviveARestart) {
  SaveBlocks(3);  // the destructor writes what is queued
  auto store = Open();
  std::vector<KvStore::Stored> listed = store->List();
  ASSERT_EQ(listed.size(), 3u);
  std::sort(listed.begin(), listed.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
  for (int k = 1; k <= 3; ++k) {
    EXPECT_EQ(listed[k - 1].key, static_cast<uint64_t>(k));
    EXPECT_EQ(listed[k - 1].parent, static_cast<uint64_t>(k - 1));
    EXPECT_EQ(listed[k - 1].tokens, Tokens(100 * k));
    absl::StatusOr<std::string> p = store->Load(k);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(*p, Payload(k));
  }
  EXPECT_EQ(store->Load(9).status().code(), absl::StatusCode::kNotFound);
  // Saving a stored key again writes nothing new.
  store->Save(2, 1, Tokens(0).data(), Payload(77));
  store->Flush();
  EXPECT_EQ(*store->Load(2), Payload(2));
}

TEST_F(KvStoreTest, AnotherModelDtypeOrShardSeesNothing) {
  SaveBlocks(2);
  KvStoreLayout other = Layout();
  other.dtype = KvDType::kF16;
  // Same folder (same model and shard), wrong dtype: skipped and deleted.
  EXPECT_TRUE(Open(other)->List().empty());
  EXPECT_TRUE(Open()->List().empty()) << "the mismatching files were deleted";
  SaveBlocks(2);
  other = Layout();
  other.model ^= 1;  // another model: another folder, nothing there
  EXPECT_TRUE(Open(other)->List().empty());
  EXPECT_EQ(Open()->List().size(), 2u) << "the other model's store leaves these alone";
  other = Layout();
  other.heads = {2, 4};
  EXPECT_TRUE(Open(other)->List().empty());
}

TEST_F(KvStoreTest, BadFilesAreSkippedAndDeletedNeverServed) {
  SaveBlocks(4);
  std::string folder;
  {
    auto store = Open();
    folder = store->folder();
    // 1: truncated; 2: a flipped payload byte; 3: a flipped header byte (the
    // parent); 4: copied to another key's name.
    fs::resize_file(FileOf(*store, 1), fs::file_size(FileOf(*store, 1)) - 10);
    {
      std::fstream f(FileOf(*store, 2), std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(-5, std::ios::end);
      f.put('\x5a');
    }
    {
      std::fstream f(FileOf(*store, 3), std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(offsetof(KvBlockFileHeader, parent));
      f.put('\x7f');
    }
    fs::copy_file(FileOf(*store, 4), FileOf(*store, 5));
    std::ofstream(folder + "/notes.txt") << "not a block";
    std::ofstream(FileOf(*store, 6) + ".tmp999999999") << "an unfinished write (no such process)";
    // Another server's write in progress on the same folder (its writer, here
    // this test's parent process, is alive): left alone.
    std::ofstream(FileOf(*store, 7) + ".tmp" + std::to_string(getppid())) << "a write in progress";
  }
  auto store = Open();
  std::vector<KvStore::Stored> listed = store->List();
  // 1, 3 and 5 fail their header checks at the scan; 2's payload is only
  // read at load, where it fails the checksum.
  std::vector<uint64_t> keys;
  for (const auto& s : listed) keys.push_back(s.key);
  std::sort(keys.begin(), keys.end());
  EXPECT_EQ(keys, (std::vector<uint64_t>{2, 4}));
  EXPECT_EQ(store->Load(2).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(fs::exists(FileOf(*store, 2)));
  EXPECT_FALSE(fs::exists(FileOf(*store, 1)));
  EXPECT_FALSE(fs::exists(FileOf(*store, 6) + ".tmp999999999"));
  EXPECT_TRUE(fs::exists(FileOf(*store, 7) + ".tmp" + std::to_string(getppid())));
  EXPECT_EQ(*store->Load(4), Payload(4));
  EXPECT_EQ(store->List().size(), 1u);
}

TEST_F(KvStoreTest, KeepsAtMostItsBudgetDroppingLeastRecentlyUsed) {
  const int64_t file = sizeof(KvBlockFileHeader) + 16 * 4 + 1000;
  auto store = Open(Layout(), 3 * file);
  for (int k = 1; k <= 3; ++k) store->Save(k, 0, Tokens(k).data(), Payload(k));
  store->Flush();
  ASSERT_TRUE(store->Load(1).ok());  // 1 is now the most recently used
  store->Save(4, 0, Tokens(4).data(), Payload(4));
  store->Flush();
  EXPECT_EQ(store->files(), 3);
  EXPECT_LE(store->bytes(), 3 * file);
  EXPECT_EQ(store->Load(2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store->Load(1).ok());
  EXPECT_TRUE(store->Load(4).ok());
}

// Wants tells the caller whether copying a block's bytes for Save is worth
// it: not for a stored block (which it marks recently used, as a Save of it
// would) nor for a queued one.
TEST_F(KvStoreTest, WantsOnlyBlocksItWouldWrite) {
  const int64_t file = sizeof(KvBlockFileHeader) + 16 * 4 + 1000;
  auto store = Open(Layout(), 3 * file);
  EXPECT_TRUE(store->Wants(1));
  for (int k = 1; k <= 3; ++k) store->Save(k, 0, Tokens(k).data(), Payload(k));
  EXPECT_FALSE(store->Wants(3)) << "queued or already written";
  store->Flush();
  EXPECT_FALSE(store->Wants(1));  // stored; now the most recently used
  EXPECT_TRUE(store->Wants(4));
  store->Save(4, 0, Tokens(4).data(), Payload(4));
  store->Flush();
  EXPECT_TRUE(store->Load(1).ok());
  EXPECT_EQ(store->Load(2).status().code(), absl::StatusCode::kNotFound) << "2 was the least recently used";
}

// Load reads the file outside the lock; the writer may evict the same block
// (the size bound) meanwhile. A load then either returns the bytes it read,
// whole and checked, or NotFound: never a throw that ends the worker.
TEST_F(KvStoreTest, ABlockEvictedWhileItLoadsIsNotACrash) {
  KvStoreLayout layout = Layout();
  layout.payload_bytes = 1 << 20;  // a read long enough for the writer to overlap it
  const int64_t file = sizeof(KvBlockFileHeader) + 16 * 4 + layout.payload_bytes;
  auto store = Open(layout, file);  // room for one block: every write evicts the other
  const std::string one = Payload(1, layout.payload_bytes);
  store->Save(1, 0, Tokens(1).data(), one);
  store->Flush();
  std::atomic<bool> stop{false};
  std::atomic<int> loaded{0}, missing{0};
  std::thread loader([&] {
    while (!stop.load()) {
      absl::StatusOr<std::string> p = store->Load(1);
      if (p.ok()) {
        EXPECT_EQ(*p, one);
        ++loaded;
      } else {
        EXPECT_EQ(p.status().code(), absl::StatusCode::kNotFound) << p.status();
        ++missing;
      }
    }
  });
  const std::string two = Payload(2, layout.payload_bytes);
  for (int i = 0; i < 150; ++i) {
    store->Save(2, 0, Tokens(2).data(), two);  // evicts 1
    store->Flush();
    store->Save(1, 0, Tokens(1).data(), one);  // evicts 2
    store->Flush();
  }
  stop = true;
  loader.join();
  EXPECT_GT(loaded.load(), 0);
  EXPECT_EQ(store->files(), 1);
}

TEST_F(KvStoreTest, AnUnwritableFolderIsAnErrorNotACrash) {
  if (geteuid() == 0) {
    // root reads and writes anything: use a path under a regular file instead.
    std::ofstream(dir_ + "/file") << "x";
    EXPECT_FALSE(KvStore::Open(dir_ + "/file/store", 1 << 20, Layout()).ok());
    return;
  }
  fs::create_directories(dir_ + "/ro");
  chmod((dir_ + "/ro").c_str(), 0500);
  EXPECT_FALSE(KvStore::Open(dir_ + "/ro/store", 1 << 20, Layout()).ok());
}

TEST_F(KvStoreTest, AFullDiskIsAWarningAndTheRestGoesOn) {
  // Writes into a folder that vanished fail like a full disk would: the
  // store logs, drops the block, and keeps serving what it has.
  auto store = Open();
  store->Save(1, 0, Tokens(1).data(), Payload(1));
  store->Flush();
  fs::remove_all(store->folder());
  store->Save(2, 1, Tokens(2).data(), Payload(2));
  store->Flush();
  EXPECT_EQ(store->Load(2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->files(), 1);
}

// A cache's block through the store and back into another cache: the same
// bytes, under the same key, unreferenced until attached.
TEST(KvStoreCache, BlockBytesRoundTripThroughACache) {
  const KvCacheOptions o{.layers = 2, .kv_heads = 2, .head_dim = 64, .block_tokens = 16, .blocks = 8,
                         .dtype = KvDType::kInt8};
  auto a = KvCache::Create(o), b = KvCache::Create(o);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Reserve(1, 0, 16).ok());
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> k(64), v(64);
  for (int p = 0; p < 16; ++p) {
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 2; ++h) {
        for (int d = 0; d < 64; ++d) k[d] = normal(rng), v[d] = normal(rng);
        (*a)->Store(1, l, h, p, k.data(), v.data());
      }
    }
  }
  ASSERT_TRUE((*a)->Publish(1, 0, {42}).ok());
  absl::StatusOr<std::string> bytes = (*a)->CachedBlockBytes(42);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(bytes->size(), KvCache::BlockBytes(o));
  EXPECT_EQ((*b)->InsertCached(42, bytes->substr(1)).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*b)->InsertCached(42, *bytes).ok());
  (*b)->EndInserts();
  EXPECT_EQ((*b)->blocks_free(), 7);
  EXPECT_EQ(*(*b)->CachedBlockBytes(42), *bytes);
  ASSERT_TRUE((*b)->Attach(5, {42}).ok());
  EXPECT_EQ((*b)->Length(5), 16);
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) {
      const KvSeqView va = (*a)->View(1, l, h), vb = (*b)->View(5, l, h);
      EXPECT_EQ(0, std::memcmp(va.KeyTile(0), vb.KeyTile(0), va.format.SegmentBytes(16)));
      EXPECT_EQ(0, std::memcmp(va.ValueTile(0), vb.ValueTile(0), va.format.SegmentBytes(16)));
    }
  }
  EXPECT_EQ((*b)->Evict({42}).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace ellm::attn
