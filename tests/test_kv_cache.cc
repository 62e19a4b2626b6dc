// attn-worker/kv_cache.h and attn-worker/attention_shard.h.
//
// KvCache: block accounting (reserve in order, running out, freeing), which
// blocks a sequence gets (ascending, in consecutive zones), and
// the row layout (no two (sequence, layer, K/V, head, position) rows share
// memory).
// AttentionShard: against a plain causal-attention reference written here, in
// double, over every position the sequence has seen, on random q/k/v with
// prefill chunks and decodes of several sequences in one batch.
//
// Error budget for the attention outputs: 1e-5 x max|v| of the rows attended.
// The shard computes in fp32 (scores from a 8-lane dot, a max-subtracted
// softmax, an fp32 weighted sum of up to 129 rows); with q, k, v ~ N(0, 1) the
// observed error is ~1e-7 of max|v|, so the budget has ample headroom yet
// catches any wrong row, head mapping, position or scale.
#include "attn-worker/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <ostream>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "attn-worker/attention_shard.h"
#include "core/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shm/messages.h"

namespace ellm::attn {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<KvCache> MakeCache(const KvCacheOptions& options) {
  absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create(options);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? *std::move(cache) : nullptr;
}

TEST(KvCache, RejectsBadOptions) {
  const KvCacheOptions good{.layers = 2, .kv_heads = 2, .head_dim = 4, .block_tokens = 4,
                            .blocks = 4};
  EXPECT_TRUE(KvCache::Create(good).ok());
  for (int field = 0; field < 5; ++field) {
    KvCacheOptions bad = good;
    switch (field) {
      case 0: bad.layers = 0; break;
      case 1: bad.kv_heads = -1; break;
      case 2: bad.head_dim = 0; break;
      case 3: bad.block_tokens = 0; break;
      case 4: bad.blocks = 0; break;
    }
    EXPECT_EQ(KvCache::Create(bad).status().code(), absl::StatusCode::kInvalidArgument) << field;
  }
  // More blocks than 32-bit ids: refused before any memory is asked for, and
  // said so (a huge --kv-cache-mb was answered "must all be positive").
  KvCacheOptions huge = good;
  huge.blocks = int64_t{INT32_MAX} + 1;
  const absl::Status st = KvCache::Create(huge).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("32-bit"), std::string::npos) << st;
  // layers x 2 x kv_heads x block_tokens x head_dim floats.
  EXPECT_EQ(KvCache::BlockBytes(good), 2u * 2 * 2 * 4 * 4 * sizeof(float));
}

TEST(KvCache, ReservesInOrder) {
  auto cache = MakeCache({.layers = 2, .kv_heads = 3, .head_dim = 4, .block_tokens = 4,
                          .blocks = 8});
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(cache->blocks_total(), 8);
  EXPECT_EQ(cache->blocks_free(), 8);
  EXPECT_EQ(cache->Length(1), 0);
  ASSERT_TRUE(cache->Reserve(1, 0, 3).ok());
  EXPECT_EQ(cache->Length(1), 3);
  EXPECT_EQ(cache->blocks_free(), 7);
  ASSERT_TRUE(cache->Reserve(1, 3, 1).ok());  // fills block 0 exactly
  EXPECT_EQ(cache->blocks_free(), 7);
  ASSERT_TRUE(cache->Reserve(1, 4, 1).ok());  // first row of a new block
  EXPECT_EQ(cache->Length(1), 5);
  EXPECT_EQ(cache->blocks_free(), 6);
  ASSERT_TRUE(cache->Reserve(1, 5, 9).ok());  // to 14: blocks 0..3
  EXPECT_EQ(cache->Length(1), 14);
  EXPECT_EQ(cache->blocks_free(), 4);
}

TEST(KvCache, OutOfOrderAppendIsFailedPrecondition) {
  auto cache = MakeCache({.layers = 1, .kv_heads = 1, .head_dim = 4, .block_tokens = 4,
                          .blocks = 8});
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(cache->Reserve(1, 0, 5).ok());
  for (int start : {0, 4, 6, 100}) {
    const absl::Status st = cache->Reserve(1, start, 1);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << start;
    EXPECT_EQ(cache->Length(1), 5);
  }
  EXPECT_EQ(cache->blocks_free(), 6);
  // A new sequence must start at 0.
  EXPECT_EQ(cache->Reserve(2, 1, 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->Length(2), 0);
  EXPECT_EQ(cache->blocks_free(), 6);
  EXPECT_TRUE(cache->Reserve(2, 0, 1).ok());
}

TEST(KvCache, NeedsBeyondThePoolAreRefusedBeforeTakingAnything) {
  auto cache = MakeCache({.layers = 1, .kv_heads = 1, .head_dim = 4, .block_tokens = 16,
                          .blocks = 8});
  ASSERT_NE(cache, nullptr);
  // A count whose 32-bit end (start + n + block_tokens - 1) wraps negative.
  for (int n : {INT32_MAX, INT32_MAX - 15, 1 << 30, 129}) {
    const absl::Status st = cache->Reserve(1, 0, n);
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << n << ": " << st;
    EXPECT_EQ(cache->blocks_free(), 8) << n;
    EXPECT_EQ(cache->Length(1), 0) << n;
  }
  ASSERT_TRUE(cache->Reserve(1, 0, 100).ok());
  EXPECT_EQ(cache->Reserve(1, 100, INT32_MAX - 50).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache->Reserve(1, 100, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Length(1), 100);
  EXPECT_EQ(cache->blocks_free(), 1);
  EXPECT_TRUE(cache->Reserve(1, 100, 28).ok());  // exactly the pool
  EXPECT_EQ(cache->blocks_free(), 0);
}

TEST(KvCache, RunningOutIsResourceExhaustedAndLeavesTheSequence) {
  auto cache = MakeCache({.layers = 1, .kv_heads = 2, .head_dim = 4, .block_tokens = 4,
                          .blocks = 4});
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(cache->Reserve(1, 0, 12).ok());  // 3 blocks
  // A new sequence needing 2 blocks: refused, nothing held for it.
  absl::Status st = cache->Reserve(2, 0, 8);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("full"));
  EXPECT_EQ(cache->Length(2), 0);
  EXPECT_EQ(cache->blocks_free(), 1);
  // A growing sequence needing 2 more: refused, length and blocks unchanged.
  st = cache->Reserve(1, 12, 5);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(cache->Length(1), 12);
  EXPECT_EQ(cache->blocks_free(), 1);
  // Its rows keep their contents through the failed call.
  cache->KeyRow(1, 0, 1, 11)[3] = 42.0f;
  EXPECT_FALSE(cache->Reserve(1, 12, 100).ok());
  EXPECT_EQ(cache->KeyRow(1, 0, 1, 11)[3], 42.0f);
  // Exactly the last block still fits.
  EXPECT_TRUE(cache->Reserve(1, 12, 4).ok());
  EXPECT_EQ(cache->blocks_free(), 0);
  EXPECT_EQ(cache->Reserve(3, 0, 1).code(), absl::StatusCode::kResourceExhausted);
}

TEST(KvCache, FreeReturnsBlocks) {
  auto cache = MakeCache({.layers = 1, .kv_heads = 1, .head_dim = 2, .block_tokens = 4,
                          .blocks = 4});
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(cache->Reserve(1, 0, 9).ok());  // 3 blocks
  ASSERT_TRUE(cache->Reserve(2, 0, 1).ok());  // 1 block
  EXPECT_EQ(cache->blocks_free(), 0);
  cache->Free(1);
  EXPECT_EQ(cache->blocks_free(), 3);
  EXPECT_EQ(cache->Length(1), 0);
  EXPECT_EQ(cache->Length(2), 1);
  cache->Free(99);  // unknown: nothing happens
  EXPECT_EQ(cache->blocks_free(), 3);
  // A freed id starts again from position 0 and can take all freed blocks.
  EXPECT_EQ(cache->Reserve(1, 9, 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(cache->Reserve(1, 0, 12).ok());
  EXPECT_EQ(cache->blocks_free(), 0);
  cache->Free(1);
  cache->Free(2);
  EXPECT_EQ(cache->blocks_free(), 4);
}

// The blocks of `seq`, as its block table holds them.
std::vector<int32_t> BlocksOf(const KvCache& cache, uint64_t seq) {
  const KvSeqView v = cache.View(seq, 0, 0);
  const int n = (v.length + v.block_tokens - 1) / v.block_tokens;
  return std::vector<int32_t>(v.blocks, v.blocks + n);
}

std::vector<int32_t> Range(int32_t begin, int32_t end) {
  std::vector<int32_t> r;
  for (int32_t b = begin; b < end; ++b) r.push_back(b);
  return r;
}

// A sequence's blocks are ascending and consecutive where the pool allows:
// it claims a zone of kZoneBlocks ahead of its growth, so sequences growing
// side by side (decode, chunked prefill) do not interleave their blocks; a
// sequence reusing freed blocks gets them in ascending order; zones never
// cost capacity (a full pool hands out claimed blocks too).
// Prefix cache: publish, attach, reference counts, eviction, and every call
// a worker must refuse (leaving its state as it was).
TEST(KvCache, PublishedBlocksAreSharedCountedAndEvictedOnlyWhenUnused) {
  auto cache = MakeCache({.layers = 2, .kv_heads = 1, .head_dim = 4, .block_tokens = 4,
                          .blocks = 10});
  ASSERT_NE(cache, nullptr);
  std::vector<float> k(4), v(4);
  ASSERT_TRUE(cache->Reserve(1, 0, 10).ok());  // blocks: 2 full + 1 partial
  for (int p = 0; p < 10; ++p) {
    for (int d = 0; d < 4; ++d) k[d] = v[d] = 100.0f * p + d;
    for (int l = 0; l < 2; ++l) cache->Store(1, l, 0, p, k.data(), v.data());
  }
  EXPECT_EQ(cache->blocks_free(), 7);
  // Only full blocks can be published.
  EXPECT_EQ(cache->Publish(1, 1, {11, 12}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Publish(9, 0, {11}).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(cache->Publish(1, 0, {11, 12}).ok());
  EXPECT_EQ(cache->blocks_cached(), 2);
  EXPECT_EQ(cache->Publish(1, 1, {13}).code(), absl::StatusCode::kInvalidArgument) << "already published";
  // Sequence 2 starts with both cached blocks: the same rows, no copy.
  EXPECT_EQ(cache->Attach(2, {11, 99}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Length(2), 0);
  ASSERT_TRUE(cache->Attach(2, {11, 12}).ok());
  EXPECT_EQ(cache->Length(2), 8);
  EXPECT_EQ(cache->blocks_free(), 7);
  for (int l = 0; l < 2; ++l) {
    for (int p = 0; p < 8; ++p) EXPECT_EQ(cache->KeyRow(2, l, 0, p), cache->KeyRow(1, l, 0, p));
  }
  EXPECT_EQ(cache->Attach(2, {11}).code(), absl::StatusCode::kInvalidArgument) << "already holds";
  // It appends after them, into blocks of its own.
  ASSERT_TRUE(cache->Reserve(2, 8, 3).ok());
  EXPECT_EQ(cache->blocks_free(), 6);
  EXPECT_NE(cache->KeyRow(2, 0, 0, 8), cache->KeyRow(1, 0, 0, 8));
  // Referenced blocks cannot be evicted; freeing the publisher keeps them.
  EXPECT_EQ(cache->Evict({11}).code(), absl::StatusCode::kFailedPrecondition);
  cache->Free(1);
  EXPECT_EQ(cache->blocks_free(), 7);  // its partial block only
  EXPECT_EQ(cache->Evict({12}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*cache->KeyRow(2, 1, 0, 5), 500.0f);
  cache->Free(2);
  EXPECT_EQ(cache->blocks_free(), 8);
  EXPECT_EQ(cache->blocks_cached(), 2);
  EXPECT_EQ(cache->Evict({11, 77}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->blocks_cached(), 2) << "a refused eviction drops nothing";
  ASSERT_TRUE(cache->Evict({11, 12}).ok());
  EXPECT_EQ(cache->blocks_free(), 10);
  EXPECT_EQ(cache->blocks_cached(), 0);
  EXPECT_EQ(cache->Attach(3, {11}).code(), absl::StatusCode::kInvalidArgument);
}

// A sequence's last, partial block can be cached as it ends; a new sequence
// starts with a copy of its first rows in a block of its own (int8 and f16:
// tiled segments; two tiles so a copy spans a tile boundary), and nothing
// ever writes into the cached partial block.
TEST(KvCache, PartialBlocksArePublishedAtTheEndAndCopiedIntoNewSequences) {
  for (KvDType dtype : {KvDType::kInt8, KvDType::kF16}) {
    SCOPED_TRACE(std::string(KvDTypeName(dtype)));
    constexpr int kBt = 32, kHd = 24, kLayers = 2, kHeads = 2;
    auto cache = MakeCache({.layers = kLayers, .kv_heads = kHeads, .head_dim = kHd, .block_tokens = kBt,
                            .blocks = 6, .dtype = dtype});
    ASSERT_NE(cache, nullptr);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    // Sequence 1: a whole block and 21 rows of a second one.
    ASSERT_TRUE(cache->Reserve(1, 0, kBt + 21).ok());
    std::vector<float> k(kHd), v(kHd);
    for (int p = 0; p < kBt + 21; ++p) {
      for (int l = 0; l < kLayers; ++l) {
        for (int h = 0; h < kHeads; ++h) {
          for (int d = 0; d < kHd; ++d) k[d] = normal(rng), v[d] = normal(rng);
          cache->Store(1, l, h, p, k.data(), v.data());
        }
      }
    }
    // The partial block must be the sequence's last, with exactly its rows.
    EXPECT_EQ(cache->Publish(1, 0, {10}, 11, 20).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(cache->Publish(1, 0, {}, 11, 21).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(cache->Publish(1, 0, {10}, 11, kBt).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(cache->blocks_cached(), 0) << "a refused publish caches nothing";
    ASSERT_TRUE(cache->Publish(1, 0, {10}, 11, 21).ok());
    EXPECT_EQ(cache->blocks_cached(), 2);
    // It cannot grow into its cached partial block.
    EXPECT_EQ(cache->Reserve(1, kBt + 21, 1).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(cache->Length(1), kBt + 21);

    // Sequence 2: the whole block, then 19 rows copied from the partial one.
    EXPECT_EQ(cache->Attach(2, {10}, 12, 19).code(), absl::StatusCode::kInvalidArgument) << "unknown key";
    EXPECT_EQ(cache->Attach(2, {10}, 11, kBt).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(cache->Length(2), 0);
    const int64_t free_before = cache->blocks_free();
    ASSERT_TRUE(cache->Attach(2, {10}, 11, 19).ok());
    EXPECT_EQ(cache->Length(2), kBt + 19);
    EXPECT_EQ(cache->blocks_free(), free_before - 1);
    std::vector<float> a(kHd), b(kHd);
    for (int l = 0; l < kLayers; ++l) {
      for (int h = 0; h < kHeads; ++h) {
        const KvSeqView s1 = cache->View(1, l, h), s2 = cache->View(2, l, h);
        EXPECT_EQ(s2.KeyTile(0), s1.KeyTile(0)) << "the whole block is shared";
        EXPECT_NE(s2.KeyTile(kBt), s1.KeyTile(kBt)) << "the partial one is copied";
        for (int p = kBt; p < kBt + 19; ++p) {
          s1.format.LoadKey(s1.KeyTile(p), s1.RowInTile(p), a.data());
          s2.format.LoadKey(s2.KeyTile(p), s2.RowInTile(p), b.data());
          EXPECT_EQ(a, b) << "K layer " << l << " head " << h << " position " << p;
          s1.format.LoadValue(s1.ValueTile(p), s1.RowInTile(p), a.data());
          s2.format.LoadValue(s2.ValueTile(p), s2.RowInTile(p), b.data());
          EXPECT_EQ(a, b) << "V layer " << l << " head " << h << " position " << p;
        }
      }
    }
    // Sequence 2 grows in its own block; the cached partial block keeps its rows.
    const KvSeqView before = cache->View(1, 0, 0);
    before.format.LoadKey(before.KeyTile(kBt + 19), before.RowInTile(kBt + 19), a.data());
    ASSERT_TRUE(cache->Reserve(2, kBt + 19, 5).ok());
    for (int d = 0; d < kHd; ++d) k[d] = v[d] = 1000.0f;
    for (int p = kBt + 19; p < kBt + 24; ++p) cache->Store(2, 0, 0, p, k.data(), v.data());
    const KvSeqView after = cache->View(1, 0, 0);
    after.format.LoadKey(after.KeyTile(kBt + 19), after.RowInTile(kBt + 19), b.data());
    EXPECT_EQ(a, b);
    // Freed, the publisher leaves both blocks cached; the copy holds no
    // reference to the partial block, which can be evicted at once.
    cache->Free(1);
    ASSERT_TRUE(cache->Evict({11}).ok());
    EXPECT_EQ(cache->Evict({10}).code(), absl::StatusCode::kFailedPrecondition);
    cache->Free(2);
    ASSERT_TRUE(cache->Evict({10}).ok());
    EXPECT_EQ(cache->blocks_free(), 6);
    // A copy needs a free block: with none, the attach changes nothing.
    ASSERT_TRUE(cache->Reserve(3, 0, 5 * kBt + 3).ok());
    ASSERT_TRUE(cache->Publish(3, 0, {20, 21, 22, 23, 24}, 25, 3).ok());
    EXPECT_EQ(cache->Attach(4, {20}, 25, 2).code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(cache->Length(4), 0);
    cache->Free(3);
    EXPECT_EQ(cache->Evict({20}).code(), absl::StatusCode::kOk) << "the refused attach took no reference";
  }
}

TEST(KvCache, ApplyRunsPublishFreeEvictAttachInOrder) {
  auto cache = MakeCache({.layers = 1, .kv_heads = 1, .head_dim = 4, .block_tokens = 4,
                          .blocks = 4});
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(cache->Reserve(1, 0, 8).ok());
  // Publish then free sequence 1, and in the same call start sequence 2 on
  // its blocks: the order lets a finishing request's blocks serve the next.
  KvOps ops;
  ops.publish.push_back({1, 0, {5, 6}});
  ops.free.push_back(1);
  ops.attach.push_back({2, 0, {5, 6}});
  ASSERT_TRUE(cache->Apply(ops).ok());
  EXPECT_EQ(cache->Length(2), 8);
  EXPECT_EQ(cache->Length(1), 0);
  KvOps bad;
  bad.evict = {5};  // still used by sequence 2
  EXPECT_FALSE(cache->Apply(bad).ok());
  KvOps done;
  done.free = {2};
  done.evict = {6};
  ASSERT_TRUE(cache->Apply(done).ok());
  EXPECT_EQ(cache->blocks_cached(), 1);
  EXPECT_EQ(cache->blocks_free(), 3);
}

TEST(KvCache, SequencesGrowInConsecutiveZones) {
  constexpr int32_t kZ = static_cast<int32_t>(kZoneBlocks), kPool = 3 * kZ;
  auto cache = MakeCache({.layers = 2, .kv_heads = 1, .head_dim = 2, .block_tokens = 4,
                          .blocks = kPool});
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(cache->Reserve(1, 0, 40).ok());  // 10 blocks
  ASSERT_TRUE(cache->Reserve(2, 0, 20).ok());  // 5 blocks, past sequence 1's zone
  EXPECT_EQ(BlocksOf(*cache, 1), Range(0, 10));
  EXPECT_EQ(BlocksOf(*cache, 2), Range(kZ, kZ + 5));
  // Side by side, one block at a time: each extends in place.
  for (int step = 0; step < 6; ++step) {
    ASSERT_TRUE(cache->Reserve(1, 40 + 4 * step, 4).ok());
    ASSERT_TRUE(cache->Reserve(2, 20 + 4 * step, 4).ok());
  }
  EXPECT_EQ(BlocksOf(*cache, 1), Range(0, 16));
  EXPECT_EQ(BlocksOf(*cache, 2), Range(kZ, kZ + 11));
  // A zone used up: the next one starts at the first free unclaimed block
  // after it, past sequence 2's zone.
  ASSERT_TRUE(cache->Reserve(1, 64, 4 * (kZ + 2 - 16)).ok());
  std::vector<int32_t> want = Range(0, kZ);
  for (int32_t b : Range(2 * kZ, 2 * kZ + 2)) want.push_back(b);
  EXPECT_EQ(BlocksOf(*cache, 1), want);
  // A freed sequence's blocks go to the next one in ascending order.
  cache->Free(1);
  ASSERT_TRUE(cache->Reserve(3, 0, 16).ok());
  ASSERT_TRUE(cache->Reserve(3, 16, 16).ok());
  EXPECT_EQ(BlocksOf(*cache, 3), Range(0, 8));
  EXPECT_EQ(cache->blocks_free(), kPool - 11 - 8);
  // Zones never cost capacity: the pool fills to the last block, claimed or
  // not, then says so.
  ASSERT_TRUE(cache->Reserve(4, 0, 4 * (kPool - 11 - 8)).ok());
  EXPECT_EQ(cache->blocks_free(), 0);
  EXPECT_EQ(cache->Reserve(5, 0, 4).code(), absl::StatusCode::kResourceExhausted);
  std::set<int32_t> all;
  for (uint64_t seq : {2, 3, 4}) {
    for (int32_t b : BlocksOf(*cache, seq)) EXPECT_TRUE(all.insert(b).second) << "block " << b << " twice";
  }
  EXPECT_EQ(all.size(), static_cast<size_t>(kPool));
  cache->Free(2);
  cache->Free(3);
  cache->Free(4);
  EXPECT_EQ(cache->blocks_free(), kPool);
  ASSERT_TRUE(cache->Reserve(5, 0, 4 * kPool).ok());
  EXPECT_EQ(BlocksOf(*cache, 5), Range(0, kPool));
}

// A value unique to each (sequence, layer, K/V, head, position, element) of
// RowsDoNotAlias (mixed radix: layer < 3, head < 2, pos < 32, d < 5), exact in fp32.
float Pattern(uint64_t seq, int layer, int kv, int head, int pos, int d) {
  return static_cast<float>(((((seq * 3 + layer) * 2 + kv) * 2 + head) * 32 + pos) * 5 + d);
}

TEST(KvCache, RowsDoNotAlias) {
  const KvCacheOptions o{.layers = 3, .kv_heads = 2, .head_dim = 5, .block_tokens = 3,
                         .blocks = 40};
  auto cache = MakeCache(o);
  ASSERT_NE(cache, nullptr);
  // Three sequences grown in interleaved chunks, so their blocks interleave in the pool.
  const std::vector<uint64_t> seqs = {10, 20, 30};
  std::map<uint64_t, int> length;
  const int chunks[][3] = {{1, 4, 2}, {5, 1, 3}, {3, 3, 7}, {1, 8, 1}};
  for (const auto& step : chunks) {
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(cache->Reserve(seqs[i], length[seqs[i]], step[i]).ok());
      length[seqs[i]] += step[i];
    }
  }
  // Distinct row pointers, each row head_dim floats apart from any other.
  std::set<const float*> rows;
  for (uint64_t s : seqs) {
    for (int l = 0; l < o.layers; ++l) {
      for (int h = 0; h < o.kv_heads; ++h) {
        for (int p = 0; p < length[s]; ++p) {
          for (int kv = 0; kv < 2; ++kv) {
            float* row = kv ? cache->ValueRow(s, l, h, p) : cache->KeyRow(s, l, h, p);
            for (int d = 0; d < o.head_dim; ++d) row[d] = Pattern(s, l, kv, h, p, d);
            ASSERT_TRUE(rows.insert(row).second) << "row reused";
          }
        }
      }
    }
  }
  const float* prev = nullptr;
  for (const float* r : rows) {
    if (prev != nullptr) {
      ASSERT_GE(r - prev, o.head_dim) << "rows overlap";
    }
    prev = r;
  }
  for (uint64_t s : seqs) {
    for (int l = 0; l < o.layers; ++l) {
      for (int h = 0; h < o.kv_heads; ++h) {
        for (int p = 0; p < length[s]; ++p) {
          for (int kv = 0; kv < 2; ++kv) {
            const float* row = kv ? cache->ValueRow(s, l, h, p) : cache->KeyRow(s, l, h, p);
            for (int d = 0; d < o.head_dim; ++d) {
              ASSERT_EQ(row[d], Pattern(s, l, kv, h, p, d))
                  << "seq " << s << " layer " << l << " kv " << kv << " head " << h << " pos "
                  << p << " d " << d;
            }
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// AttentionShard against a reference.

// One step's request, built by hand in the layout of shm/messages.h.
struct Request {
  std::vector<shm::SeqSlice> slices;
  std::vector<float> q, k, v;  // [T][q_heads][hd], [T][kv_heads][hd] x 2
  uint32_t n_tokens = 0;
  shm::AttnRequestView view() const { return {slices.data(), q.data(), k.data(), v.data()}; }
};

Request MakeRequest(const std::vector<shm::SeqSlice>& slices, const ShardGeometry& g,
                    std::mt19937& gen) {
  Request r;
  r.slices = slices;
  for (const shm::SeqSlice& s : slices) r.n_tokens += s.n_tokens;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  r.q.resize(size_t{r.n_tokens} * g.q_heads() * g.head_dim);
  r.k.resize(size_t{r.n_tokens} * g.kv_heads() * g.head_dim);
  r.v.resize(r.k.size());
  for (float& x : r.q) x = dist(gen);
  for (float& x : r.k) x = dist(gen);
  for (float& x : r.v) x = dist(gen);
  return r;
}

// Everything a sequence has seen: rows[layer][kv_head][position] = (k, v).
class Reference {
 public:
  explicit Reference(const ShardGeometry& g) : g_(g) {}

  void Append(uint32_t layer, const Request& r) {
    const int hd = g_.head_dim, kvh = g_.kv_heads();
    uint32_t t = 0;
    for (const shm::SeqSlice& s : r.slices) {
      auto& rows = seqs_[s.seq_id];
      rows.resize(g_.layers, std::vector<std::vector<Row>>(kvh));
      for (uint32_t j = 0; j < s.n_tokens; ++j, ++t) {
        for (int h = 0; h < kvh; ++h) {
          auto& list = rows[layer][h];
          ASSERT_EQ(list.size(), s.start_pos + j) << "test schedule is not contiguous";
          const float* k = r.k.data() + (size_t{t} * kvh + h) * hd;
          const float* v = r.v.data() + (size_t{t} * kvh + h) * hd;
          list.push_back({std::vector<double>(k, k + hd), std::vector<double>(v, v + hd)});
        }
      }
    }
  }

  void Free(uint64_t seq) { seqs_.erase(seq); }

  // Checks out[T][q_heads][hd] for every token of `r`.
  void Check(uint32_t layer, const Request& r, const std::vector<float>& out) const {
    const int hd = g_.head_dim, qh = g_.q_heads();
    uint32_t t = 0;
    for (const shm::SeqSlice& s : r.slices) {
      const auto& rows = seqs_.at(s.seq_id)[layer];
      for (uint32_t j = 0; j < s.n_tokens; ++j, ++t) {
        const int pos = static_cast<int>(s.start_pos + j);
        for (int h = 0; h < qh; ++h) {
          const auto& list = rows[h / g_.gqa_ratio];
          const float* q = r.q.data() + (size_t{t} * qh + h) * hd;
          // softmax over positions [0, pos] of q.k / sqrt(hd), then sum p v.
          std::vector<double> score(pos + 1);
          double max = -INFINITY, max_v = 0;
          for (int p = 0; p <= pos; ++p) {
            double dot = 0;
            for (int d = 0; d < hd; ++d) dot += q[d] * list[p].k[d];
            score[p] = dot / std::sqrt(static_cast<double>(hd));
            max = std::max(max, score[p]);
            for (int d = 0; d < hd; ++d) max_v = std::max(max_v, std::fabs(list[p].v[d]));
          }
          double sum = 0;
          for (double& x : score) sum += (x = std::exp(x - max));
          for (int d = 0; d < hd; ++d) {
            double ref = 0;
            for (int p = 0; p <= pos; ++p) ref += score[p] / sum * list[p].v[d];
            const float got = out[(size_t{t} * qh + h) * hd + d];
            ASSERT_NEAR(got, ref, 1e-5 * max_v)
                << "layer " << layer << " seq " << s.seq_id << " pos " << pos << " q head " << h
                << " d " << d;
          }
        }
      }
    }
  }

 private:
  struct Row {
    std::vector<double> k, v;
  };
  ShardGeometry g_;
  std::map<uint64_t, std::vector<std::vector<std::vector<Row>>>> seqs_;
};

struct GqaCase {
  int gqa_ratio;
  int kv_heads;
  int kv_head_begin;
};

void PrintTo(const GqaCase& c, std::ostream* os) {
  *os << "gqa " << c.gqa_ratio << ", kv heads [" << c.kv_head_begin << ", "
      << c.kv_head_begin + c.kv_heads << ")";
}

using ShardParam = std::tuple<GqaCase, int /*head_dim*/, int /*threads*/>;

class AttentionShardTest : public ::testing::TestWithParam<ShardParam> {};

TEST_P(AttentionShardTest, MatchesReferenceOverPrefillAndDecodeSteps) {
  const auto [gqa, head_dim, threads] = GetParam();
  ShardGeometry g;
  g.layers = 3;
  g.heads = {gqa.kv_head_begin, gqa.kv_head_begin + gqa.kv_heads};
  g.gqa_ratio = gqa.gqa_ratio;
  g.head_dim = head_dim;
  g.max_positions = 256;
  const int block_tokens = head_dim == 8 ? 5 : 16;  // 5: blocks end at odd places
  auto cache = MakeCache({.layers = g.layers, .kv_heads = g.kv_heads(), .head_dim = head_dim,
                          .block_tokens = block_tokens, .blocks = 64});
  ASSERT_NE(cache, nullptr);
  ThreadPool pool(threads);
  AttentionShard shard(g, cache.get(), &pool);
  Reference ref(g);
  std::mt19937 gen(head_dim * 100 + gqa.gqa_ratio * 10 + threads);

  // Sequences of 1 (A), 3 (B), 17 (C) and 129 (D) positions over several steps,
  // in varying order; A is freed after step 1 and E (5 positions) reuses its blocks.
  const uint64_t A = 1, B = 2, C = 1000, D = 77, E = 1ull << 40;
  const std::vector<std::vector<shm::SeqSlice>> steps = {
      {{A, 0, 1}, {B, 0, 2}, {C, 0, 5}, {D, 0, 64}},
      {{D, 64, 60}, {C, 5, 11}, {B, 2, 1}},
      {{C, 16, 1}, {E, 0, 3}, {D, 124, 1}},
      {{D, 125, 1}, {E, 3, 1}},
      {{E, 4, 1}, {D, 126, 3}},
  };
  for (size_t step = 0; step < steps.size(); ++step) {
    SCOPED_TRACE(testing::Message() << "step " << step);
    if (step == 2) {
      cache->Free(A);
      cache->Free(B);
      ref.Free(A);
      ref.Free(B);
    }
    for (uint32_t layer = 0; layer < static_cast<uint32_t>(g.layers); ++layer) {
      const Request r = MakeRequest(steps[step], g, gen);
      std::vector<float> out(size_t{r.n_tokens} * g.q_heads() * head_dim, NAN);
      const absl::Status st = shard.Process(layer, static_cast<uint32_t>(r.slices.size()),
                                            r.n_tokens, r.view(), out.data());
      ASSERT_TRUE(st.ok()) << st;
      ref.Append(layer, r);
      ref.Check(layer, r, out);
      if (HasFatalFailure()) return;
    }
    for (const shm::SeqSlice& s : steps[step]) {
      EXPECT_EQ(cache->Length(s.seq_id), static_cast<int>(s.start_pos + s.n_tokens));
    }
  }
  EXPECT_EQ(cache->Length(D), 129);
  EXPECT_EQ(cache->Length(C), 17);
  EXPECT_EQ(cache->Length(E), 5);
  EXPECT_EQ(cache->Length(A), 0);
}

std::string ShardParamName(const ::testing::TestParamInfo<ShardParam>& info) {
  const auto& [gqa, hd, threads] = info.param;
  return "gqa" + std::to_string(gqa.gqa_ratio) + "_kv" + std::to_string(gqa.kv_heads) + "_from" +
         std::to_string(gqa.kv_head_begin) + "_hd" + std::to_string(hd) + "_t" +
         std::to_string(threads);
}

INSTANTIATE_TEST_SUITE_P(
    Geometries, AttentionShardTest,
    ::testing::Combine(::testing::Values(GqaCase{1, 2, 0}, GqaCase{2, 2, 1}, GqaCase{4, 1, 3},
                                         GqaCase{5, 2, 2}),
                       ::testing::Values(8, 64), ::testing::Values(1, 3)),
    ShardParamName);

class AttentionShardErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    g_.layers = 2;
    g_.heads = {2, 4};
    g_.gqa_ratio = 2;
    g_.head_dim = 8;
    g_.max_positions = 64;
    cache_ = MakeCache({.layers = 2, .kv_heads = 2, .head_dim = 8, .block_tokens = 4,
                        .blocks = 4});
    ASSERT_NE(cache_, nullptr);
    shard_ = std::make_unique<AttentionShard>(g_, cache_.get(), &pool_);
  }
  absl::Status Run(uint32_t layer, const std::vector<shm::SeqSlice>& slices) {
    const Request r = MakeRequest(slices, g_, gen_);
    std::vector<float> out(size_t{r.n_tokens} * g_.q_heads() * g_.head_dim);
    return shard_->Process(layer, static_cast<uint32_t>(slices.size()), r.n_tokens, r.view(),
                           out.data());
  }

  ShardGeometry g_;
  std::unique_ptr<KvCache> cache_;
  ThreadPool pool_{2};
  std::unique_ptr<AttentionShard> shard_;
  std::mt19937 gen_{5};
};

TEST_F(AttentionShardErrors, LaterLayerBeyondWhatLayerZeroAppended) {
  ASSERT_TRUE(Run(0, {{1, 0, 3}}).ok());
  absl::Status st = Run(1, {{1, 0, 4}});
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("layer 0"));
  st = Run(1, {{9, 0, 1}});  // a sequence layer 0 never saw
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ(cache_->Length(1), 3);
  EXPECT_TRUE(Run(1, {{1, 0, 3}}).ok());
  // Next step: layer 0 extends, then layer 1 follows.
  EXPECT_EQ(Run(1, {{1, 3, 1}}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Run(0, {{1, 3, 1}}).ok());
  EXPECT_TRUE(Run(1, {{1, 3, 1}}).ok());
}

TEST_F(AttentionShardErrors, LayerOutOfRangeIsInvalidArgument) {
  for (uint32_t layer : {2u, 3u, 1000u}) {
    const absl::Status st = Run(layer, {{1, 0, 2}});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << layer;
  }
  EXPECT_EQ(cache_->Length(1), 0);
  EXPECT_EQ(cache_->blocks_free(), 4);
}

TEST_F(AttentionShardErrors, OutOfOrderPositionsAtLayerZero) {
  ASSERT_TRUE(Run(0, {{1, 0, 2}}).ok());
  EXPECT_EQ(Run(0, {{1, 3, 1}}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Run(0, {{1, 0, 1}}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache_->Length(1), 2);
}

TEST_F(AttentionShardErrors, FullCacheIsResourceExhausted) {
  ASSERT_TRUE(Run(0, {{1, 0, 12}}).ok());  // 3 of 4 blocks
  EXPECT_EQ(Run(0, {{2, 0, 5}}).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache_->Length(2), 0);
  EXPECT_EQ(cache_->blocks_free(), 1);
  EXPECT_TRUE(Run(0, {{2, 0, 4}}).ok());
}

}  // namespace
}  // namespace ellm::attn
