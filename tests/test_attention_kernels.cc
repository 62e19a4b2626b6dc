// attn-worker/attention_kernels.h, partial.h, kv_format.h, and the kernel path
// of attention_shard.h, against a plain fp64 oracle written here: softmax of
// q·k / sqrt(hd) over positions [0, pos], times v, on the dequantised K and V
// rows (KvFormat::LoadKey / LoadValue give the exact stored values) and the
// query as given.
//
// Inputs are fresh random (q, k, v ~ N(0, 1), and a peaked variant with q
// x 4), at awkward sizes: 1, 3, 17, 129, 4097 positions; head_dim 64 and 128
// (and 40: padding); GQA ratios 1, 2, 5, 7, 8; the KV is a view into a larger
// paged cache (shuffled block table, unused rows full of NaN bytes); chunks of
// 48 and 512 positions; 1 and several threads (shard tests).
//
// Error budgets, as |out - oracle| / max|v| over the rows attended:
//  * reference kernel: 1e-5. It accumulates in fp64 and stores the partials
//    in fp32; merging chunk partials costs a few fp32 roundings per chunk.
//  * f16 SIMD kernels: 2^-11 (f16 rounding). They read the same f16 values
//    as the oracle and compute in fp32 (scores from hd FMAs, a degree-6 exp2
//    with 1.2e-7 relative error), so only fp32 rounding separates them:
//    observed ~1e-6.
//  * int8 SIMD kernels: 4e-2 (avx512, avx2-vnni) and 6e-2 (avx2). On top of
//    the int8 KV, which the oracle sees too, they quantise each query head to
//    8-bit codes with one scale, once per step (plain AVX2: 7 bits), and the
//    attention weights to u8 per tile (each within max/510 of its tile's
//    largest). The query codes dominate: a score error of about
//    sq / sqrt(12) · |k| / sqrt(hd) per position (sq = max|q| / 127), which
//    moves a peaked softmax the most. Observed worst cases here: 2.7e-2
//    (4.1e-2 with 7-bit codes) for peaked attention over 3-17 positions,
//    5.8e-3 (1.1e-2) for mild attention; against an oracle fed the same
//    quantised query the error drops 5-40x (<= 4e-3), which bounds what the
//    weight codes cost.
//  * int8 cache against the unquantised fp32 data (quantisation of K and V
//    included), mild attention: 5e-2 (observed ~1.5e-2).
#include "attn-worker/attention_kernels.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/str_split.h"
#include "attn-worker/attention_shard.h"
#include "attn-worker/kv_cache.h"
#include "core/kv_format.h"
#include "attn-worker/partial.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "core/topology.h"
#include "gtest/gtest.h"
#include "shm/messages.h"

namespace ellm::attn {
namespace {

const int kPositions[] = {1, 3, 17, 129, 4097};
const int kGqa[] = {1, 2, 3, 5, 6, 7, 8};  // every way the kernels split a group into passes

std::vector<float> Normal(size_t n, std::mt19937& gen, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> x(n);
  for (float& v : x) v = dist(gen);
  return x;
}

double Budget(const AttentionKernel& k, KvDType dtype) {
  if (k.name == "reference") return 1e-5;
  if (dtype == KvDType::kF16) return 1.0 / 2048;
  return k.name == "avx2" ? 6e-2 : 4e-2;
}

// One (layer, KV head) of one sequence in a paged pool much larger than it:
// blocks in shuffled order, everything not stored left as NaN bytes. With
// `trend`, key dim 0 of position p gets trend * p added, so that a query
// with q[0] > 0 sees scores that rise along the sequence (falling for < 0).
class PagedKv {
 public:
  PagedKv(KvDType dtype, int head_dim, int length, int block_tokens, std::mt19937& gen,
          float trend = 0.0f)
      : format_(KvFormat::Make(dtype, head_dim)), block_tokens_(block_tokens), length_(length) {
    const int needed = (length + block_tokens - 1) / block_tokens;
    const int pool_blocks = 2 * needed + 3;
    segment_ = format_.SegmentBytes(block_tokens);
    pool_.Resize(static_cast<size_t>(pool_blocks) * 2 * segment_);
    std::memset(pool_.data(), 0xff, pool_.size());
    std::vector<int32_t> ids(pool_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), gen);
    table_.assign(ids.begin(), ids.begin() + needed);
    k_ = Normal(static_cast<size_t>(length) * head_dim, gen);
    v_ = Normal(k_.size(), gen);
    for (int p = 0; p < length; ++p) k_[size_t{1} * p * head_dim] += trend * static_cast<float>(p);
    for (int p = 0; p < length; ++p) {
      const KvSeqView v = view();
      format_.StoreKey(const_cast<uint8_t*>(v.KeyTile(p)), v.RowInTile(p), &k_[size_t{1} * p * head_dim]);
      format_.StoreValue(const_cast<uint8_t*>(v.ValueTile(p)), v.RowInTile(p), &v_[size_t{1} * p * head_dim]);
    }
    // The stored values, as the oracle sees them.
    kd_.resize(k_.size());
    vd_.resize(v_.size());
    for (int p = 0; p < length; ++p) {
      const KvSeqView v = view();
      format_.LoadKey(v.KeyTile(p), v.RowInTile(p), &kd_[size_t{1} * p * head_dim]);
      format_.LoadValue(v.ValueTile(p), v.RowInTile(p), &vd_[size_t{1} * p * head_dim]);
    }
  }

  KvSeqView view() const {
    KvSeqView v;
    v.format = format_;
    v.base = pool_.data();
    v.blocks = table_.data();
    v.block_stride = 2 * segment_;
    v.value_offset = segment_;
    v.block_tokens = block_tokens_;
    v.length = length_;
    return v;
  }
  const std::vector<float>& k() const { return k_; }        // as generated
  const std::vector<float>& v() const { return v_; }
  const std::vector<float>& k_stored() const { return kd_; }  // as stored
  const std::vector<float>& v_stored() const { return vd_; }

 private:
  KvFormat format_;
  int block_tokens_, length_;
  int64_t segment_ = 0;
  AlignedArray<uint8_t> pool_;
  std::vector<int32_t> table_;
  std::vector<float> k_, v_, kd_, vd_;
};

// Attention of q [hd] over rows [0, n) of k, v [n][hd]; returns the output and max|v|.
std::vector<double> Oracle(const float* q, const std::vector<float>& k, const std::vector<float>& v,
                           int n, int hd, double* max_v) {
  std::vector<double> s(n);
  double mx = -INFINITY;
  for (int t = 0; t < n; ++t) {
    double dot = 0;
    for (int d = 0; d < hd; ++d) dot += static_cast<double>(q[d]) * k[size_t{1} * t * hd + d];
    s[t] = dot / std::sqrt(static_cast<double>(hd));
    mx = std::max(mx, s[t]);
  }
  double sum = 0;
  for (double& x : s) sum += (x = std::exp(x - mx));
  std::vector<double> out(hd, 0.0);
  *max_v = 0;
  for (int t = 0; t < n; ++t) {
    for (int d = 0; d < hd; ++d) {
      out[d] += s[t] / sum * v[size_t{1} * t * hd + d];
      *max_v = std::max(*max_v, std::fabs(static_cast<double>(v[size_t{1} * t * hd + d])));
    }
  }
  return out;
}

// Runs `kernel` over chunks of `chunk` positions for n_tokens query tokens
// (token i sees positions <= last_pos[i]) and `group` heads; q is
// [n_tokens][group][hd]. Returns out [n_tokens][group][hd].
std::vector<float> RunChunks(const AttentionKernel& kernel, const KvSeqView& kv, const float* q,
                             int n_tokens, int group, const std::vector<int32_t>& last_pos,
                             int chunk) {
  const int hd = kv.format.head_dim, hp = kv.format.padded_dim, pf = PartialFloats(hp);
  QueryPrep prep;
  PrepareQueries(kernel, kv.format.dtype, q, n_tokens * group, hd, &prep);
  AlignedArray<float> partials, acc, scratch;
  partials.Resize(static_cast<size_t>(n_tokens) * group * pf);
  acc.Resize(partials.size());
  scratch.Resize(ChunkScratchFloats(n_tokens, group));
  for (int x = 0; x < n_tokens * group; ++x) Partial(acc.data() + x * pf, hp).Clear();
  ChunkArgs a;
  a.kv = kv;
  a.group = group;
  a.n_tokens = n_tokens;
  a.last_pos = last_pos.data();
  a.q = &prep;
  a.q_row0 = 0;
  a.q_token_stride = group;
  a.partials = partials.data();
  a.scratch = scratch.data();
  const int last = *std::max_element(last_pos.begin(), last_pos.end());
  for (int c = 0; c * chunk <= last; ++c) {
    a.pos_begin = c * chunk;
    a.pos_end = std::min(kv.length, (c + 1) * chunk);
    kernel.For(kv.format.dtype)(a);
    for (int x = 0; x < n_tokens * group; ++x) {
      Partial(acc.data() + x * pf, hp).Merge(Partial(partials.data() + x * pf, hp));
    }
  }
  std::vector<float> out(static_cast<size_t>(n_tokens) * group * hd);
  for (int x = 0; x < n_tokens * group; ++x) {
    Partial(acc.data() + x * pf, hp).Normalize(&out[static_cast<size_t>(x) * hd], hd);
  }
  return out;
}

// Worst |out - oracle| / max|v| over tokens, heads and dims.
double WorstError(const std::vector<float>& out, const float* q, const std::vector<float>& k,
                  const std::vector<float>& v, const std::vector<int32_t>& last_pos, int group,
                  int hd) {
  double worst = 0;
  for (size_t i = 0; i < last_pos.size(); ++i) {
    for (int j = 0; j < group; ++j) {
      const size_t row = i * group + j;
      double max_v;
      const std::vector<double> ref = Oracle(q + row * hd, k, v, last_pos[i] + 1, hd, &max_v);
      for (int d = 0; d < hd; ++d) {
        const double e = std::fabs(out[row * hd + d] - ref[d]) / std::max(max_v, 1e-30);
        if (!(e <= worst)) worst = e;  // NaN propagates as the worst
      }
    }
  }
  return worst;
}

// ---------------------------------------------------------------------------
// Formats.

TEST(KvFormat, F16RoundTripsToHalfRounding) {
  std::mt19937 gen(1);
  for (int hd : {8, 64, 128, 40}) {
    const KvFormat f = KvFormat::Make(KvDType::kF16, hd);
    EXPECT_EQ(f.padded_dim % 16, 0);
    std::vector<uint8_t> tile(f.tile_bytes);
    const std::vector<float> x = Normal(hd, gen, 3.0f);
    std::vector<float> back(hd);
    for (int row : {0, 7, 15}) {
      f.StoreKey(tile.data(), row, x.data());
      f.LoadKey(tile.data(), row, back.data());
      for (int d = 0; d < hd; ++d) EXPECT_EQ(back[d], HalfToFloat(FloatToHalf(x[d]))) << hd << " " << d;
      f.StoreValue(tile.data(), row, x.data());
      f.LoadValue(tile.data(), row, back.data());
      for (int d = 0; d < hd; ++d) EXPECT_EQ(back[d], HalfToFloat(FloatToHalf(x[d])));
    }
  }
}

TEST(KvFormat, Int8RowsStayWithinHalfAStep) {
  std::mt19937 gen(2);
  for (int hd : {8, 64, 128, 40}) {
    const KvFormat f = KvFormat::Make(KvDType::kInt8, hd);
    EXPECT_EQ(f.tile_bytes, 16 * f.padded_dim + 64);
    std::vector<uint8_t> tile(f.tile_bytes);
    for (float offset : {0.0f, 5.0f, -100.0f}) {
      std::vector<float> x = Normal(hd, gen);
      for (float& v : x) v += offset;
      float lo = *std::min_element(x.begin(), x.end()), hi = *std::max_element(x.begin(), x.end());
      std::vector<float> back(hd);
      for (int row : {0, 5, 15}) {
        for (bool value : {false, true}) {
          value ? f.StoreValue(tile.data(), row, x.data()) : f.StoreKey(tile.data(), row, x.data());
          value ? f.LoadValue(tile.data(), row, back.data()) : f.LoadKey(tile.data(), row, back.data());
          // Half a step of (hi - lo) / 255, plus the f16 rounding of min and scale.
          const double bound = (hi - lo) / 255.0 * 0.5 * 1.01 + std::fabs(lo) / 2048 + 1e-6;
          for (int d = 0; d < hd; ++d) ASSERT_NEAR(back[d], x[d], bound) << hd << " " << d;
        }
      }
    }
    // A constant row: scale 0, exact up to the f16 rounding of the value.
    std::vector<float> c(hd, 1.5f), back(hd);
    f.StoreKey(tile.data(), 3, c.data());
    f.LoadKey(tile.data(), 3, back.data());
    for (float b : back) EXPECT_EQ(b, 1.5f);
  }
}

TEST(KvFormat, Int8BytesSitWhereTheHeaderSays) {
  const int hd = 32;
  const KvFormat f = KvFormat::Make(KvDType::kInt8, hd);
  std::vector<uint8_t> tile(f.tile_bytes, 0);
  std::vector<float> x(hd, 0.0f);
  x[13] = 255.0f;  // codes: 255 at dim 13, 0 elsewhere (min 0, scale 1)
  f.StoreKey(tile.data(), 6, x.data());
  EXPECT_EQ(tile[64 + (16 * (13 / 4) + 6) * 4 + 13 % 4], 255);
  EXPECT_EQ(HalfToFloat(reinterpret_cast<uint16_t*>(tile.data())[6]), 1.0f);
  EXPECT_EQ(HalfToFloat(reinterpret_cast<uint16_t*>(tile.data() + 32)[6]), 0.0f);
  std::fill(tile.begin(), tile.end(), 0);
  f.StoreValue(tile.data(), 6, x.data());
  EXPECT_EQ(tile[64 + ((4 * (13 / 16) + 6 / 4) * 16 + 13 % 16) * 4 + 6 % 4], 127);  // 255 - 128
  EXPECT_EQ(tile[64 + ((4 * (12 / 16) + 6 / 4) * 16 + 12 % 16) * 4 + 6 % 4], 0x80);  // 0 - 128
}

TEST(KvFormat, ParsesNames) {
  EXPECT_EQ(*ParseKvDType("int8"), KvDType::kInt8);
  EXPECT_EQ(*ParseKvDType("f16"), KvDType::kF16);
  EXPECT_EQ(*ParseKvDType("f32"), KvDType::kF32);
  EXPECT_EQ(ParseKvDType("q4").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(KvFormat::Make(KvDType::kInt8, 64).CheckBlockTokens(8).ok());
  EXPECT_TRUE(KvFormat::Make(KvDType::kInt8, 64).CheckBlockTokens(32).ok());
  EXPECT_TRUE(KvFormat::Make(KvDType::kF32, 64).CheckBlockTokens(5).ok());
}

// ---------------------------------------------------------------------------
// Partial.

std::vector<float> RandomPartial(int dim, std::mt19937& gen) {
  std::vector<float> p(PartialFloats(dim));
  const Partial x(p.data(), dim);
  std::uniform_real_distribution<float> u(-5.0f, 5.0f);
  for (int i = 0; i < dim; ++i) x.o()[i] = u(gen);
  x.m() = u(gen);
  x.d() = 1.0f + std::fabs(u(gen));
  return p;
}

TEST(Partial, MergeIsCommutativeBitForBit) {
  std::mt19937 gen(3);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<float> a = RandomPartial(64, gen), b = RandomPartial(64, gen);
    std::vector<float> ab = a, ba = b;
    Partial(ab.data(), 64).Merge(Partial(b.data(), 64));
    Partial(ba.data(), 64).Merge(Partial(a.data(), 64));
    ASSERT_EQ(0, std::memcmp(ab.data(), ba.data(), ab.size() * sizeof(float)));
  }
}

TEST(Partial, MergeOrderDoesNotMatter) {
  std::mt19937 gen(4);
  const int dim = 48, n = 37;
  std::vector<std::vector<float>> parts;
  for (int i = 0; i < n; ++i) parts.push_back(RandomPartial(dim, gen));
  auto fold = [&](const std::vector<int>& order) {
    std::vector<float> acc(PartialFloats(dim));
    Partial(acc.data(), dim).Clear();
    for (int i : order) Partial(acc.data(), dim).Merge(Partial(parts[i].data(), dim));
    std::vector<float> out(dim);
    Partial(acc.data(), dim).Normalize(out.data(), dim);
    return out;
  };
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  const std::vector<float> first = fold(order);
  for (int trial = 0; trial < 20; ++trial) {
    std::shuffle(order.begin(), order.end(), gen);
    const std::vector<float> other = fold(order);
    for (int d = 0; d < dim; ++d) ASSERT_NEAR(other[d], first[d], 1e-5 * (1 + std::fabs(first[d])));
  }
  // A tree instead of a fold.
  std::vector<std::vector<float>> level = parts;
  while (level.size() > 1) {
    std::vector<std::vector<float>> next;
    for (size_t i = 0; i + 1 < level.size(); i += 2) {
      Partial(level[i].data(), dim).Merge(Partial(level[i + 1].data(), dim));
      next.push_back(level[i]);
    }
    if (level.size() % 2) next.push_back(level.back());
    level = next;
  }
  std::vector<float> tree(dim);
  Partial(level[0].data(), dim).Normalize(tree.data(), dim);
  for (int d = 0; d < dim; ++d) ASSERT_NEAR(tree[d], first[d], 1e-5 * (1 + std::fabs(first[d])));
}

TEST(Partial, EmptyMergesWithoutNan) {
  std::mt19937 gen(5);
  const int dim = 16;
  std::vector<float> e1(PartialFloats(dim)), e2(PartialFloats(dim));
  Partial(e1.data(), dim).Clear();
  Partial(e2.data(), dim).Clear();
  Partial(e1.data(), dim).Merge(Partial(e2.data(), dim));
  const Partial e(e1.data(), dim);
  EXPECT_TRUE(e.empty());
  EXPECT_EQ(e.m(), -INFINITY);
  for (int i = 0; i < dim; ++i) EXPECT_EQ(e.o()[i], 0.0f);
  std::vector<float> out(dim, NAN);
  e.Normalize(out.data(), dim);
  for (float x : out) EXPECT_EQ(x, 0.0f);
  // empty ⊕ a = a ⊕ empty = a, bit for bit.
  std::vector<float> a = RandomPartial(dim, gen);
  std::vector<float> left = e1, right = a;
  Partial(left.data(), dim).Merge(Partial(a.data(), dim));
  Partial(right.data(), dim).Merge(Partial(e1.data(), dim));
  EXPECT_EQ(0, std::memcmp(left.data(), a.data(), (dim + 2) * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(right.data(), a.data(), (dim + 2) * sizeof(float)));
}

// ---------------------------------------------------------------------------
// Kernels against the oracle.

// Each kernel's query forms, against plain loops: the int8 codes are
// round(q / sq) (half away from zero) within ±q_max with sq = max|q| / q_max,
// padding dims are zero, and the sums and scales agree; odd head dims reach
// the SIMD quantiser's scalar tail.
TEST(AttentionKernels, QueriesArePreparedInTheFormsTheKernelReads) {
  std::mt19937 gen(12);
  for (const AttentionKernel* k : AvailableKernels()) {
    for (KvDType dtype : {KvDType::kF16, KvDType::kInt8}) {
      for (int hd : {64, 100, 128}) {
        SCOPED_TRACE(testing::Message() << k->name << " " << KvDTypeName(dtype) << " hd " << hd);
        const int rows = 300, hp = (hd + 15) / 16 * 16;  // 300 rows: split over the pool
        std::vector<float> q = Normal(static_cast<size_t>(rows) * hd, gen, 3.0f);
        std::fill_n(q.begin() + hd, hd, 0.0f);  // an all-zero row
        q[2 * hd + 5] = -40.0f;                 // a row whose maximum is negative
        QueryPrep prep;
        ThreadPool pool(2);
        PrepareQueries(*k, dtype, q.data(), rows, hd, &prep, &pool);
        const QueryForm form = k->QueryFormFor(dtype);
        ASSERT_EQ(form, k->name == "reference"        ? QueryForm::kRaw
                        : dtype == KvDType::kF16 ? QueryForm::kScaled
                                                 : QueryForm::kCodes);
        ASSERT_EQ(prep.padded_dim, hp);
        for (int r = 0; r < rows; ++r) {
          const float* x = q.data() + static_cast<size_t>(r) * hd;
          if (form == QueryForm::kRaw) {
            for (int d = 0; d < hp; ++d) ASSERT_EQ(prep.raw[static_cast<size_t>(r) * hp + d], d < hd ? x[d] : 0.0f);
          }
          if (form == QueryForm::kScaled) {
            for (int d = 0; d < hp; ++d) {
              ASSERT_EQ(prep.scaled[static_cast<size_t>(r) * hp + d], d < hd ? x[d] * prep.score_scale : 0.0f);
            }
          }
          if (form == QueryForm::kCodes) {
            float amax = 0;
            for (int d = 0; d < hd; ++d) amax = std::max(amax, std::fabs(x[d]));
            const float sq = amax / static_cast<float>(k->q_max);
            int32_t sum = 0;
            for (int d = 0; d < hp; ++d) {
              int want = 0;
              if (d < hd && sq > 0) {
                want = static_cast<int>(std::lround(x[d] * (1.0f / sq)));  // halves away from zero
                want = std::clamp(want, -k->q_max, k->q_max);
              }
              ASSERT_EQ(prep.codes[static_cast<size_t>(r) * hp + d], want) << "row " << r << " dim " << d;
              sum += want;
            }
            ASSERT_EQ(prep.code_sum[r], sum) << "row " << r;
            ASSERT_EQ(prep.code_scale[r], sq * prep.score_scale) << "row " << r;
          }
        }
      }
    }
  }
}

TEST(AttentionKernels, DispatcherPicksARunnableKernel) {
  const std::vector<const AttentionKernel*> all = AvailableKernels();
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all[0]->name, "reference");
  absl::StatusOr<const AttentionKernel*> best = SelectKernel(Isa::kAuto);
  ASSERT_TRUE(best.ok());
  // auto takes the last one listed, except amx, which measured slower than
  // avx512 and is only used when forced.
  const AttentionKernel* fastest = all.back()->name == "amx" ? all[all.size() - 2] : all.back();
  EXPECT_EQ((*best)->name, fastest->name);
  std::printf("kernels on this CPU:");
  for (const AttentionKernel* k : all) std::printf(" %s", std::string(k->name).c_str());
  std::printf("; auto picks %s\n", std::string((*best)->name).c_str());
  EXPECT_EQ((*SelectKernel(Isa::kReference))->name, "reference");
  EXPECT_EQ(*ParseIsa("avx2-vnni"), Isa::kAvx2Vnni);
  EXPECT_EQ(*ParseIsa("amx"), Isa::kAmx);
  EXPECT_FALSE(ParseIsa("sse").ok());
  // A kernel's name is its instruction set's one spelling.
  for (Isa isa : kAllIsas) {
    absl::StatusOr<const AttentionKernel*> k = SelectKernel(isa);
    if (k.ok()) {
      EXPECT_EQ((*k)->name, IsaName(isa));
    }
  }
}

struct Case {
  KvDType dtype;
  int head_dim;
  int group;
  int positions;
  float q_scale;
};

// Every kernel, one decode token, over the awkward sizes.
TEST(AttentionKernels, DecodeMatchesOracleWithinBudget) {
  std::mt19937 gen(6);
  std::map<std::string, double> observed;  // worst error per kernel and dtype
  for (KvDType dtype : {KvDType::kF16, KvDType::kInt8}) {
    for (int hd : {64, 128}) {
      for (int positions : kPositions) {
        PagedKv kv(dtype, hd, positions, 32, gen);
        for (int group : kGqa) {
          for (float q_scale : {1.0f, 4.0f}) {
            const std::vector<float> q = Normal(static_cast<size_t>(group) * hd, gen, q_scale);
            const std::vector<int32_t> last = {positions - 1};
            for (const AttentionKernel* k : AvailableKernels()) {
              for (int chunk : {48, 512}) {
                const std::vector<float> out = RunChunks(*k, kv.view(), q.data(), 1, group, last, chunk);
                const double err = WorstError(out, q.data(), kv.k_stored(), kv.v_stored(), last, group, hd);
                double& worst = observed[std::string(k->name) + " " + std::string(KvDTypeName(dtype)) +
                                         (q_scale > 1 ? " peaked" : " mild")];
                worst = std::max(worst, err);
                ASSERT_LE(err, Budget(*k, dtype))
                    << k->name << " " << KvDTypeName(dtype) << " hd " << hd << " positions "
                    << positions << " gqa " << group << " q x" << q_scale << " chunk " << chunk;
              }
            }
          }
        }
      }
    }
  }
  for (const auto& [name, err] : observed) {
    std::printf("worst error / max|v|: %-25s %.2e\n", name.c_str(), err);
  }
}

// Scores that keep rising (a new maximum every few tiles, by more and by less
// than the slack the SIMD kernels let their reference score trail it by) and
// scores that fall (the maximum in the first tile): 3.2 in base 2 per tile,
// over 1000 positions (an odd number of tiles, the last one partial). In one
// chunk of 1024 the scores climb by 200, so a kernel that stopped moving its
// reference score would overflow its float weights.
TEST(AttentionKernels, RisingAndFallingScoresMatchTheOracle) {
  std::mt19937 gen(21);
  for (KvDType dtype : {KvDType::kF16, KvDType::kInt8}) {
    for (int hd : {64, 128}) {
      const float per_position = 0.2f * std::sqrt(static_cast<float>(hd)) / static_cast<float>(M_LOG2E);
      for (float direction : {1.0f, -1.0f}) {
        PagedKv kv(dtype, hd, 1000, 32, gen, direction * per_position);
        for (int group : {1, 5, 7}) {
          std::vector<float> q = Normal(static_cast<size_t>(group) * hd, gen);
          for (int j = 0; j < group; ++j) q[static_cast<size_t>(j) * hd] = 1.0f;
          const std::vector<int32_t> last = {999};
          for (const AttentionKernel* k : AvailableKernels()) {
            for (int chunk : {48, 1024}) {
              const std::vector<float> out = RunChunks(*k, kv.view(), q.data(), 1, group, last, chunk);
              const double err = WorstError(out, q.data(), kv.k_stored(), kv.v_stored(), last, group, hd);
              ASSERT_LE(err, Budget(*k, dtype))
                  << k->name << " " << KvDTypeName(dtype) << " hd " << hd << " direction " << direction
                  << " gqa " << group << " chunk " << chunk;
            }
          }
        }
      }
    }
  }
}

// A few tokens of one sequence in one call (small prefill chunks): each sees
// its own causal prefix; padding dims (head_dim 40) and 16 heads (two
// register blocks) included.
TEST(AttentionKernels, FewTokensAreCausal) {
  std::mt19937 gen(7);
  for (KvDType dtype : {KvDType::kF16, KvDType::kInt8}) {
    for (auto [hd, group] : {std::pair{40, 3}, std::pair{64, 16}, std::pair{128, 5}}) {
      const int positions = 300;
      PagedKv kv(dtype, hd, positions, 16, gen);
      for (int n_tokens : {2, 5, 16}) {
        std::vector<int32_t> last(n_tokens);
        for (int i = 0; i < n_tokens; ++i) last[i] = positions - n_tokens + i;
        if (n_tokens == 5) last = {0, 15, 16, 130, 299};  // not a run of positions
        const std::vector<float> q = Normal(static_cast<size_t>(n_tokens) * group * hd, gen);
        for (const AttentionKernel* k : AvailableKernels()) {
          const std::vector<float> out = RunChunks(*k, kv.view(), q.data(), n_tokens, group, last, 64);
          const double err = WorstError(out, q.data(), kv.k_stored(), kv.v_stored(), last, group, hd);
          ASSERT_LE(err, Budget(*k, dtype)) << k->name << " " << KvDTypeName(dtype) << " hd " << hd
                                           << " gqa " << group << " tokens " << n_tokens;
        }
      }
    }
  }
}

// amx on one token (decode) computes the same int32 dot products as avx512
// on the tile unit and shares every other step with it, so its int8 results
// are bit-identical: head dims with a tail of 16, 32 and 48 dims past the
// last 64, groups up to a full tile (16 rows) and past it (the VNNI
// fallback). Several tokens take the same path where the bf16 prefill path
// does not apply (head dims not a multiple of 64, more than 16 heads): 3
// tokens 37 positions apart, 7 tokens 9 apart (some see only the first tile
// of a pair, some none of a chunk's last pair) and 16 consecutive ones.
TEST(AttentionKernels, AmxInt8IsBitIdenticalToAvx512) {
  absl::StatusOr<const AttentionKernel*> amx = SelectKernel(Isa::kAmx);
  if (!amx.ok()) GTEST_SKIP() << amx.status().message();
  const AttentionKernel& avx512 = **SelectKernel(Isa::kAvx512);
  std::mt19937 gen(8);
  int compared = 0;
  for (int hd : {40, 64, 80, 128, 176, 256}) {
    const int positions = 333;
    PagedKv kv(KvDType::kInt8, hd, positions, 32, gen);
    for (int group : {1, 5, 7, 12, 16, 20}) {
      for (int n_tokens : {1, 3, 7, 16}) {
        if (n_tokens > 1 && hd % 64 == 0 && hd <= 256 && group <= 16) continue;  // bf16 prefill
        const int apart = n_tokens == 16 ? 1 : n_tokens == 7 ? 9 : 37;
        std::vector<int32_t> last(n_tokens);
        for (int i = 0; i < n_tokens; ++i) last[i] = positions - 1 - apart * (n_tokens - 1 - i);
        const std::vector<float> q = Normal(static_cast<size_t>(n_tokens) * group * hd, gen, 3.0f);
        for (int chunk : {32, 160}) {
          const std::vector<float> a = RunChunks(avx512, kv.view(), q.data(), n_tokens, group, last, chunk);
          const std::vector<float> b = RunChunks(**amx, kv.view(), q.data(), n_tokens, group, last, chunk);
          ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
              << "hd " << hd << " gqa " << group << " tokens " << n_tokens << " chunk " << chunk;
          ++compared;
        }
      }
    }
  }
  EXPECT_GT(compared, 100);
}

// amx on several tokens with head dims a multiple of 64 (prefill) runs p·V
// in bf16 on tiles, row (token, head) by row: within the oracle's budget at
// head dims 64, 128 and 256, 1 to 16 heads, 2 to 16 tokens (runs of
// consecutive positions, and tokens that see only part of a step of 64
// positions or none of a chunk), scores that rise so that o is rescaled,
// chunks of 64 and 1024 positions; and each token's result is its own: the
// same bits when it is computed alone with one other token (the row
// independence the shard's batching relies on).
TEST(AttentionKernels, AmxPrefillRowsMatchTheOracleAndEachOther) {
  absl::StatusOr<const AttentionKernel*> amx = SelectKernel(Isa::kAmx);
  if (!amx.ok()) GTEST_SKIP() << amx.status().message();
  std::mt19937 gen(9);
  double worst = 0;
  for (int hd : {64, 128, 256}) {
    for (float rise : {0.0f, 0.2f}) {  // base-2 units per position, as in RisingAndFallingScores...
      const float trend = rise * std::sqrt(static_cast<float>(hd)) / static_cast<float>(M_LOG2E);
      const int positions = 1000;
      PagedKv kv(KvDType::kInt8, hd, positions, 32, gen, trend);
      for (int group : {1, 5, 16}) {
        for (int n_tokens : {2, 9, 16}) {
          std::vector<int32_t> last(n_tokens);
          for (int i = 0; i < n_tokens; ++i) {
            last[i] = n_tokens == 9 ? 37 * i + 600 : positions - n_tokens + i;  // 9: spread out
          }
          std::vector<float> q = Normal(static_cast<size_t>(n_tokens) * group * hd, gen, rise > 0 ? 1.0f : 2.0f);
          if (rise > 0) {
            for (int r = 0; r < n_tokens * group; ++r) q[static_cast<size_t>(r) * hd] = 1.0f;
          }
          for (int chunk : {64, 1024}) {
            const std::vector<float> out = RunChunks(**amx, kv.view(), q.data(), n_tokens, group, last, chunk);
            const double err = WorstError(out, q.data(), kv.k_stored(), kv.v_stored(), last, group, hd);
            worst = std::max(worst, err);
            ASSERT_LE(err, Budget(**amx, KvDType::kInt8))
                << "hd " << hd << " gqa " << group << " tokens " << n_tokens << " chunk " << chunk;
            // Tokens 0 and n - 1 again, as a chunk of their own.
            const size_t row = static_cast<size_t>(group) * hd;
            std::vector<float> q2(q.begin(), q.begin() + row);
            q2.insert(q2.end(), q.end() - row, q.end());
            const std::vector<int32_t> last2 = {last.front(), last.back()};
            const std::vector<float> out2 = RunChunks(**amx, kv.view(), q2.data(), 2, group, last2, chunk);
            ASSERT_EQ(0, std::memcmp(out2.data(), out.data(), row * sizeof(float))) << "first token, hd " << hd;
            ASSERT_EQ(0, std::memcmp(out2.data() + row, out.data() + out.size() - row, row * sizeof(float)))
                << "last token, hd " << hd << " gqa " << group << " tokens " << n_tokens;
          }
        }
      }
    }
  }
  std::printf("amx prefill rows: worst error / max|v| %.2e\n", worst);
}

TEST(AttentionKernels, Int8CacheStaysCloseToTheFp32Data) {
  std::mt19937 gen(8);
  const AttentionKernel& k = **SelectKernel(Isa::kAuto);
  for (int positions : {129, 4097}) {
    PagedKv kv(KvDType::kInt8, 128, positions, 16, gen);
    const int group = 5;
    const std::vector<float> q = Normal(static_cast<size_t>(group) * 128, gen);
    const std::vector<int32_t> last = {positions - 1};
    const std::vector<float> out = RunChunks(k, kv.view(), q.data(), 1, group, last, 512);
    EXPECT_LE(WorstError(out, q.data(), kv.k(), kv.v(), last, group, 128), 5e-2) << positions;
  }
}

TEST(AttentionKernels, ChunkBeyondEveryTokenGivesEmptyPartials) {
  std::mt19937 gen(9);
  for (KvDType dtype : {KvDType::kF16, KvDType::kInt8}) {
    PagedKv kv(dtype, 64, 100, 16, gen);
    for (const AttentionKernel* k : AvailableKernels()) {
      const int group = 3, pf = PartialFloats(64);
      const std::vector<float> q = Normal(static_cast<size_t>(2) * group * 64, gen);
      QueryPrep prep;
      PrepareQueries(*k, dtype, q.data(), 2 * group, 64, &prep);
      AlignedArray<float> partials, scratch;
      partials.Resize(2 * group * pf);
      scratch.Resize(ChunkScratchFloats(2, group));
      const std::vector<int32_t> last = {10, 40};
      ChunkArgs a;
      a.kv = kv.view();
      a.group = group;
      a.n_tokens = 2;
      a.last_pos = last.data();
      a.q = &prep;
      a.q_token_stride = group;
      a.partials = partials.data();
      a.scratch = scratch.data();
      a.pos_begin = 48;
      a.pos_end = 96;
      k->For(dtype)(a);
      for (int x = 0; x < 2 * group; ++x) {
        const Partial p(partials.data() + x * pf, 64);
        EXPECT_TRUE(p.empty()) << k->name;
        EXPECT_EQ(p.m(), -INFINITY);
        for (int d = 0; d < 64; ++d) ASSERT_EQ(p.o()[d], 0.0f) << k->name;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// The shard's kernel path: threads, chunk items, merges, batching.

struct ShardRun {
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<AttentionShard> shard;
};

ShardRun MakeShard(const ShardGeometry& g, KvDType dtype, int threads, const AttentionKernel* k,
                   int blocks = 600) {
  ShardRun r;
  KvCacheOptions o;
  o.layers = g.layers;
  o.kv_heads = g.kv_heads();
  o.head_dim = g.head_dim;
  o.block_tokens = 16;
  o.blocks = blocks;
  o.dtype = dtype;
  r.cache = *KvCache::Create(o);
  r.pool = std::make_unique<ThreadPool>(threads);
  r.shard = std::make_unique<AttentionShard>(g, r.cache.get(), r.pool.get(), k);
  return r;
}

// The q, k, v of every position of a sequence, generated once.
struct SeqData {
  std::vector<float> q, k, v;  // [positions][q_heads or kv_heads][hd]
};

SeqData MakeSeq(const ShardGeometry& g, int positions, std::mt19937& gen) {
  SeqData s;
  s.q = Normal(static_cast<size_t>(positions) * g.q_heads() * g.head_dim, gen);
  s.k = Normal(static_cast<size_t>(positions) * g.kv_heads() * g.head_dim, gen);
  s.v = Normal(s.k.size(), gen);
  return s;
}

// Runs one step: slices of (seq id, data, start, n); returns out [T][q_heads][hd].
std::vector<float> Step(AttentionShard& shard, const ShardGeometry& g,
                        const std::vector<std::tuple<uint64_t, const SeqData*, int, int>>& slices) {
  std::vector<shm::SeqSlice> s;
  std::vector<float> q, k, v;
  const size_t qn = size_t{1} * g.q_heads() * g.head_dim, kn = size_t{1} * g.kv_heads() * g.head_dim;
  uint32_t n_tokens = 0;
  for (const auto& [id, data, start, n] : slices) {
    s.push_back({id, static_cast<uint32_t>(start), static_cast<uint32_t>(n)});
    q.insert(q.end(), data->q.begin() + start * qn, data->q.begin() + (start + n) * qn);
    k.insert(k.end(), data->k.begin() + start * kn, data->k.begin() + (start + n) * kn);
    v.insert(v.end(), data->v.begin() + start * kn, data->v.begin() + (start + n) * kn);
    n_tokens += n;
  }
  std::vector<float> out(static_cast<size_t>(n_tokens) * qn, NAN);
  const absl::Status st =
      shard.Process(0, static_cast<uint32_t>(s.size()), n_tokens, {s.data(), q.data(), k.data(), v.data()},
                    out.data());
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// A token's output depends only on its sequence and position: not on the
// batch around it, the thread count, the chunk mode (parallel items for
// decodes, folded items for prefill) or the step it came in. Bit for bit.
TEST(AttentionShardKernels, ResultsDoNotDependOnBatchingOrThreads) {
  std::mt19937 gen(10);
  ShardGeometry g;
  g.layers = 1;
  g.heads = {0, 2};
  g.gqa_ratio = 5;
  g.head_dim = 64;
  g.max_positions = 4096;
  g.chunk_positions = 64;
  g.parallel_min_bytes = 0;  // small as it is, spread it over the threads
  const int n = 300;
  const SeqData a = MakeSeq(g, n, gen), b = MakeSeq(g, n, gen);
  const size_t qn = size_t{1} * g.q_heads() * g.head_dim;
  for (KvDType dtype : {KvDType::kInt8, KvDType::kF16}) {
    for (const AttentionKernel* k : AvailableKernels()) {
      SCOPED_TRACE(testing::Message() << k->name << " " << KvDTypeName(dtype));
      // Run 1: sequence A alone, one thread: a 200-token prefill, then decodes.
      ShardRun r1 = MakeShard(g, dtype, 1, k);
      std::vector<float> alone = Step(*r1.shard, g, {{7, &a, 0, 200}});
      for (int p = 200; p < n; ++p) {
        const std::vector<float> o = Step(*r1.shard, g, {{7, &a, p, 1}});
        alone.insert(alone.end(), o.begin(), o.end());
      }
      // Run 2: A next to B, three threads, in different pieces: prefill chunks
      // of 16 and 9 tokens (parallel chunk items), then decodes. (amx int8
      // computes a token in a chunk of several in bf16 and one alone in int8:
      // for it the prefill pieces end where run 1's does.)
      const bool by_chunk_size = k->name == "amx" && dtype == KvDType::kInt8;
      ShardRun r2 = MakeShard(g, dtype, 3, k);
      std::vector<float> together;
      int pa = 0, pb = 0;
      while (pa < n) {
        const int na = pa < 200 ? std::min(pa % 2 ? 9 : 16, (by_chunk_size ? 200 : n) - pa) : 1;
        const int nb = std::min(pb < 100 ? 13 : 1, n - pb);
        std::vector<std::tuple<uint64_t, const SeqData*, int, int>> slices;
        if (nb > 0) slices.emplace_back(3, &b, pb, nb);
        slices.emplace_back(7, &a, pa, na);
        const std::vector<float> o = Step(*r2.shard, g, slices);
        together.insert(together.end(), o.begin() + (nb > 0 ? nb : 0) * qn, o.end());
        pa += na;
        pb += nb;
      }
      ASSERT_EQ(alone.size(), together.size());
      for (size_t i = 0; i < alone.size(); ++i) {
        ASSERT_EQ(alone[i], together[i]) << "token " << i / qn << " element " << i % qn;
      }
    }
  }
}

// The whole kernel path of the shard (append + quantise, chunk items on
// several threads, merges) against the oracle on what the cache stored.
TEST(AttentionShardKernels, MatchesOracleAtAwkwardLengths) {
  std::mt19937 gen(11);
  for (KvDType dtype : {KvDType::kInt8, KvDType::kF16}) {
    for (int threads : {1, 3}) {
      for (int group : {1, 7}) {
        ShardGeometry g;
        g.layers = 1;
        g.heads = {1, 3};
        g.gqa_ratio = group;
        g.head_dim = 128;
        g.max_positions = 8192;
        const AttentionKernel* k = *SelectKernel(Isa::kAuto);
        ShardRun r = MakeShard(g, dtype, threads, k);
        const int n = 4097;
        const SeqData s = MakeSeq(g, n, gen);
        // Checks token `t` of a step's output `out`, at position `pos`.
        auto check = [&](const std::vector<float>& out, int t, int pos) {
          for (int h = 0; h < g.kv_heads(); ++h) {
            const KvSeqView view = r.cache->View(5, 0, h);
            std::vector<float> kd(static_cast<size_t>(pos + 1) * 128), vd(kd.size());
            for (int p = 0; p <= pos; ++p) {
              view.format.LoadKey(view.KeyTile(p), view.RowInTile(p), &kd[size_t{1} * p * 128]);
              view.format.LoadValue(view.ValueTile(p), view.RowInTile(p), &vd[size_t{1} * p * 128]);
            }
            const size_t q0 = (size_t{1} * pos * g.q_heads() + h * group) * 128;
            const std::vector<float> q(s.q.begin() + q0, s.q.begin() + q0 + group * 128);
            const size_t o0 = (size_t{1} * t * g.q_heads() + h * group) * 128;
            const std::vector<float> o(out.begin() + o0, out.begin() + o0 + group * 128);
            const double err = WorstError(o, q.data(), kd, vd, {pos}, group, 128);
            EXPECT_LE(err, Budget(*k, dtype)) << KvDTypeName(dtype) << " threads " << threads
                                              << " gqa " << group << " pos " << pos;
          }
        };
        // Prefill to 4000 in pieces (some tokens of each checked), then decode
        // to 4097, checking the last steps.
        int pos = 0;
        for (int piece : {1, 2, 14, 112, 1000, 2871}) {
          const std::vector<float> out = Step(*r.shard, g, {{5, &s, pos, piece}});
          for (int t : {0, piece / 2, piece - 1}) check(out, t, pos + t);
          pos += piece;
        }
        for (; pos < n; ++pos) {
          const std::vector<float> out = Step(*r.shard, g, {{5, &s, pos, 1}});
          if (pos == 4000 || pos == n - 1) check(out, 0, pos);
        }
      }
    }
  }
}

TEST(AttentionShardKernels, NamesTheKernelAndChoosesChunks) {
  ShardGeometry g;
  g.layers = 1;
  g.heads = {0, 8};
  g.gqa_ratio = 5;
  g.head_dim = 128;
  g.max_positions = 1024;
  ShardRun f32 = MakeShard(g, KvDType::kF32, 1, nullptr, 4);
  EXPECT_EQ(f32.shard->kernel_name(), "f32-reference");
  ShardRun i8 = MakeShard(g, KvDType::kInt8, 1, *SelectKernel(Isa::kReference), 4);
  EXPECT_EQ(i8.shard->kernel_name(), "reference int8");
  EXPECT_EQ(i8.shard->chunk_positions(), 512);  // 264 bytes per position: 512 x 264 >= 128 KiB
  EXPECT_EQ(AutoChunkPositions(KvFormat::Make(KvDType::kF16, 128)), 256);
  EXPECT_EQ(AutoChunkPositions(KvFormat::Make(KvDType::kInt8, 64)), 1024);
}

// Not a test: the speed of the kernels on prefill items, 16 tokens of one
// KV head with G = 5 query heads (the qwen2.5-14b shape) over 4K positions
// (ELLM_BENCH_POSITIONS=N for another length; at 4K the K and V take about
// 1 MB at hd 128 and half that at hd 64, about one core's L2),
// every token seeing every position (most of a long prefill's work), one
// thread, in G multiply-adds/s: the best of 30 passes, so that a shared VM's
// stalls do not count. For before/after runs of a kernel change;
// `ellm-bench prefill` gives the whole prefill against the dot-product
// instruction's measured peak. Run with
// --gtest_also_run_disabled_tests --gtest_filter='*PrefillItem*';
// ELLM_BENCH_KERNELS=avx512,avx2 times only those kernels (e.g. under perf).
TEST(AttentionKernelsBench, DISABLED_PrefillItem) {
  std::mt19937 gen(11);
  const int tokens = 16, group = 5;
  const char* env = std::getenv("ELLM_BENCH_POSITIONS");
  const int positions = env != nullptr ? std::atoi(env) : 4096;
  const std::string cpu = CpuModelName();  // every line names the machine
  const char* only = std::getenv("ELLM_BENCH_KERNELS");
  const std::vector<std::string> kernels =
      only != nullptr ? absl::StrSplit(only, ',') : std::vector<std::string>{};
  for (KvDType dtype : {KvDType::kInt8, KvDType::kF16}) {
    for (int hd : {128, 64}) {
      PagedKv kv(dtype, hd, positions, 32, gen);
      const std::vector<float> q = Normal(static_cast<size_t>(tokens) * group * hd, gen);
      const std::vector<int32_t> last(tokens, positions - 1);
      for (const AttentionKernel* k : AvailableKernels()) {
        if (k->name == "reference") continue;
        if (!kernels.empty() && !absl::c_linear_search(kernels, k->name)) continue;
        double best = 1e30;
        for (int rep = 0; rep < 30; ++rep) {
          const auto t0 = std::chrono::steady_clock::now();
          const std::vector<float> out = RunChunks(*k, kv.view(), q.data(), tokens, group, last, 1024);
          best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
          ASSERT_TRUE(std::isfinite(out[0]));
        }
        const double macs = 2.0 * tokens * group * positions * hd;
        std::printf("prefill item: kernel=%s dtype=%s hd=%d positions=%d gmacs=%.1f cpu=\"%s\"\n",
                    std::string(k->name).c_str(), std::string(KvDTypeName(dtype)).c_str(), hd, positions,
                    macs / best / 1e9, cpu.c_str());
      }
    }
  }
}

}  // namespace
}  // namespace ellm::attn
