#include "attn-worker/attention_shard.h"

#include <algorithm>
#include <atomic>
#include <memory>

#include "absl/strings/str_cat.h"
#include "core/kernels.h"

namespace ellm::attn {
namespace {

// Partials of parallel chunks held per step, at most (the rest fold inside
// their items).
constexpr int64_t kPartialBudgetBytes = int64_t{64} << 20;
// Parallel chunks are grouped into items so that each thread gets about this
// many items per step (or single chunks when there are fewer): measured on 2
// cores at 16K positions, 1-4 items per thread are within noise of each other
// and 8 loses 2-6%; 2 leaves something to take from a slow thread's range.
constexpr int64_t kItemsPerThread = 2;

}  // namespace

int AutoChunkPositions(const KvFormat& format) {
  const double per_position = format.BytesPerPosition();
  int c = 256;
  while (c < 4096 && c * per_position < 128 * 1024) c *= 2;
  return c;
}

AttentionShard::AttentionShard(const ShardGeometry& geometry, KvCache* cache, ThreadPool* pool,
                               const AttentionKernel* kernel)
    : g_(geometry), cache_(cache), pool_(pool), kernel_(kernel), scratch_(pool->size()) {
  if (kernel_ == nullptr) kernel_ = *SelectKernel(Isa::kAuto);
  chunk_ = g_.chunk_positions > 0 ? (g_.chunk_positions + kTile - 1) / kTile * kTile
                                  : AutoChunkPositions(cache_->format());
  if (cache_->format().dtype == KvDType::kF32) {
    f32_scratch_.resize(pool->size());
    for (F32Scratch& s : f32_scratch_) {
      s.k_rows.resize(g_.max_positions);
      s.v_rows.resize(g_.max_positions);
      s.scores.resize(g_.max_positions);
    }
  }
}

std::string AttentionShard::kernel_name() const {
  if (cache_->format().dtype == KvDType::kF32) return "f32-reference";
  return absl::StrCat(std::string(kernel_->name), " ", std::string(KvDTypeName(cache_->format().dtype)));
}

absl::Status AttentionShard::Process(uint32_t layer, uint32_t n_seqs, uint32_t n_tokens,
                                     const shm::AttnRequestView& req, float* out) {
  if (layer >= static_cast<uint32_t>(g_.layers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention request for layer ", layer, " of a ", g_.layers, "-layer model"));
  }
  const int hd = g_.head_dim, kvh = g_.kv_heads();

  // Reserve positions once per step (layer 0); later layers must find them.
  if (layer == 0) {
    for (uint32_t i = 0; i < n_seqs; ++i) {
      const shm::SeqSlice& s = req.slices[i];
      // On failure, sequences reserved before this one keep their room: the
      // coordinator fails the whole step and frees every sequence in it.
      RETURN_IF_ERROR(cache_->Reserve(s.seq_id, s.start_pos, s.n_tokens));
    }
  } else {
    for (uint32_t i = 0; i < n_seqs; ++i) {
      const shm::SeqSlice& s = req.slices[i];
      if (cache_->Length(s.seq_id) < static_cast<int>(s.start_pos + s.n_tokens)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "layer ", layer, " request for sequence ", s.seq_id, " positions up to ",
            s.start_pos + s.n_tokens, " that layer 0 did not append"));
      }
    }
  }

  {
    int64_t positions = 0;
    for (uint32_t i = 0; i < n_seqs; ++i) positions += req.slices[i].start_pos + req.slices[i].n_tokens;
    kv_read_bytes_.fetch_add(static_cast<int64_t>(positions * cache_->format().BytesPerPosition() * kvh),
                             std::memory_order_relaxed);
  }

  // Token index -> sequence and position; slice -> first token.
  last_pos_.resize(n_tokens);
  token_seq_.resize(n_tokens);
  slice_token0_.resize(n_seqs);
  {
    uint32_t t = 0;
    for (uint32_t i = 0; i < n_seqs; ++i) {
      slice_token0_[i] = static_cast<int32_t>(t);
      for (uint32_t j = 0; j < req.slices[i].n_tokens; ++j, ++t) {
        token_seq_[t] = req.slices[i].seq_id;
        last_pos_[t] = static_cast<int32_t>(req.slices[i].start_pos + j);
      }
    }
  }

  // Append k, v: the one place they are converted to the cache's dtype.
  const int64_t rows = static_cast<int64_t>(n_tokens) * kvh;
  auto store = [&](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / kvh;
      const int h = static_cast<int>(r % kvh);
      cache_->Store(token_seq_[t], static_cast<int>(layer), h, last_pos_[t],
                    req.k + static_cast<size_t>(r) * hd, req.v + static_cast<size_t>(r) * hd);
    }
  };
  if (rows >= 64 && cache_->format().dtype != KvDType::kF32) {
    pool_->ParallelFor(rows, store);
  } else {
    store(0, rows, 0);
  }

  if (cache_->format().dtype == KvDType::kF32) {
    ProcessF32(layer, n_tokens, req, out);
    return absl::OkStatus();
  }

  PrepareQueries(*kernel_, cache_->format().dtype, req.q, static_cast<int>(n_tokens) * g_.q_heads(), hd, &prep_,
                 pool_);

  // Plan: parallel chunks for decodes and small prefill chunks (within the
  // partials budget), one folding item per (16 tokens, KV head) otherwise.
  const int group = g_.gqa_ratio;
  const int pf = PartialFloats(prep_.padded_dim);
  const int64_t budget_slots = kPartialBudgetBytes / (pf * static_cast<int64_t>(sizeof(float)));
  items_.clear();
  merges_.clear();
  int64_t slots = 0;
  double kv_bytes = 0;  // read by this step
  for (uint32_t s = 0; s < n_seqs; ++s) {
    const shm::SeqSlice& slice = req.slices[s];
    const int n = static_cast<int>(slice.n_tokens);
    // KV head outermost: a thread's consecutive items of a prefill are the
    // head's token groups, which read the same K and V (from L2 when they fit).
    for (int h = 0; h < kvh; ++h) {
      for (int tg = 0; tg < n; tg += kMaxChunkTokens) {
        const int nt = std::min(kMaxChunkTokens, n - tg);
        const int token0 = slice_token0_[s] + tg;
        const int chunks = last_pos_[token0 + nt - 1] / chunk_ + 1;
        kv_bytes += (last_pos_[token0 + nt - 1] + 1.0) * cache_->format().BytesPerPosition();
        const int64_t need = static_cast<int64_t>(chunks) * nt * group;
        if (n <= kMaxChunkTokens && slots + need <= budget_slots) {
          const int merge = static_cast<int>(merges_.size());
          merges_.push_back({static_cast<int>(s), token0, nt, h, chunks, slots});
          for (int c = 0; c < chunks; ++c) {
            items_.push_back({static_cast<int>(s), token0, nt, h, c, c + 1,
                              slots + static_cast<int64_t>(c) * nt * group, merge});
          }
          slots += need;
        } else {
          items_.push_back({static_cast<int>(s), token0, nt, h, 0, chunks, -1, -1});
        }
      }
    }
  }
  // Consecutive chunks of a merge group run as one item, enough items left
  // for every thread to take a few: fewer kernel calls and hand-offs, and the
  // kernel's prefetching runs on across the chunk boundaries. Results do not
  // change (each chunk still has its own partial).
  {
    int64_t parallel = 0;
    for (const Item& item : items_) parallel += item.merge >= 0;
    const int64_t run = std::max<int64_t>(1, parallel / (kItemsPerThread * pool_->size()));
    size_t kept = 0;
    for (size_t i = 0; i < items_.size(); ++i) {
      const Item& item = items_[i];
      Item* last = kept > 0 ? &items_[kept - 1] : nullptr;
      if (item.merge >= 0 && last != nullptr && last->merge == item.merge &&
          last->chunk_end - last->chunk_begin < run) {
        last->chunk_end = item.chunk_end;
      } else {
        items_[kept++] = item;
      }
    }
    items_.resize(kept);
  }
  partials_.Resize(static_cast<size_t>(slots) * pf);
  const size_t chunk_floats = ChunkScratchFloats(kMaxChunkTokens, group);
  const size_t partial_floats = static_cast<size_t>(kMaxChunkTokens) * group * pf;
  for (ThreadScratch& s : scratch_) {
    s.chunk.Resize(chunk_floats);
    s.partials.Resize(partial_floats);
    s.acc.Resize(partial_floats);
  }

  if (merges_.size() > chunks_left_capacity_) {
    chunks_left_capacity_ = std::max(merges_.size(), 2 * chunks_left_capacity_);
    chunks_left_.reset(new std::atomic<int>[chunks_left_capacity_]);
  }
  for (size_t m = 0; m < merges_.size(); ++m) {
    chunks_left_[m].store(merges_[m].chunks, std::memory_order_relaxed);
  }

  ParallelItems(pool_, static_cast<int64_t>(items_.size()), kv_bytes < g_.parallel_min_bytes,
                [&](int64_t i, int thread) {
    const Item& item = items_[i];
    RunItem(item, layer, req, out, scratch_[thread]);
    // The last chunk of a merge group to finish merges the group; acq_rel
    // makes every chunk's partials visible to that thread.
    const int chunks = item.chunk_end - item.chunk_begin;
    if (item.merge >= 0 &&
        chunks_left_[item.merge].fetch_sub(chunks, std::memory_order_acq_rel) == chunks) {
      Merge(merges_[item.merge], out, scratch_[thread]);
    }
  });
  return absl::OkStatus();
}

void AttentionShard::Merge(const MergeGroup& m, float* out, ThreadScratch& scratch) const {
  const int group = g_.gqa_ratio, hp = prep_.padded_dim, pf = PartialFloats(hp);
  const Partial acc(scratch.acc.data(), hp);
  for (int i = 0; i < m.n_tokens; ++i) {
    for (int j = 0; j < group; ++j) {
      acc.Clear();
      for (int c = 0; c < m.chunks; ++c) {
        const int64_t slot = m.first_slot + static_cast<int64_t>(c) * m.n_tokens * group + i * group + j;
        acc.Merge(Partial(partials_.data() + slot * pf, hp));
      }
      WriteOutput(m, i, j, acc, out);
    }
  }
}

ChunkArgs AttentionShard::ArgsFor(const Item& item, uint32_t layer,
                                  const shm::AttnRequestView& req) const {
  ChunkArgs a;
  a.kv = cache_->View(req.slices[item.slice].seq_id, static_cast<int>(layer), item.kv_head);
  a.group = g_.gqa_ratio;
  a.n_tokens = item.n_tokens;
  a.last_pos = last_pos_.data() + item.token0;
  a.q = &prep_;
  a.q_row0 = item.token0 * g_.q_heads() + item.kv_head * g_.gqa_ratio;
  a.q_token_stride = g_.q_heads();
  return a;
}

void AttentionShard::WriteOutput(const MergeGroup& m, int token, int head, const Partial& p,
                                 float* out) const {
  const int t = m.token0 + token;
  const int q_head = m.kv_head * g_.gqa_ratio + head;
  p.Normalize(out + (static_cast<size_t>(t) * g_.q_heads() + q_head) * g_.head_dim, g_.head_dim);
}

void AttentionShard::RunItem(const Item& item, uint32_t layer, const shm::AttnRequestView& req,
                             float* out, ThreadScratch& scratch) {
  ChunkArgs a = ArgsFor(item, layer, req);
  a.scratch = scratch.chunk.data();
  const AttendChunkFn attend = kernel_->For(a.kv.format.dtype);
  const int hp = a.kv.format.padded_dim, pf = PartialFloats(hp), group = g_.gqa_ratio;
  a.prefetch_end = std::min(a.kv.length, item.chunk_end * chunk_);
  if (item.partial_slot >= 0) {
    // Each chunk into its own slot of the merge group.
    for (int c = item.chunk_begin; c < item.chunk_end; ++c) {
      a.pos_begin = c * chunk_;
      a.pos_end = std::min(a.kv.length, a.pos_begin + chunk_);
      a.partials = partials_.data() +
                   (item.partial_slot + static_cast<int64_t>(c - item.chunk_begin) * item.n_tokens * group) * pf;
      attend(a);
    }
    return;
  }
  // All chunks in turn, folded exactly as the merge step folds parallel ones.
  const int n = item.n_tokens * group;
  for (int x = 0; x < n; ++x) Partial(scratch.acc.data() + static_cast<size_t>(x) * pf, hp).Clear();
  a.partials = scratch.partials.data();
  for (int c = item.chunk_begin; c < item.chunk_end; ++c) {
    a.pos_begin = c * chunk_;
    a.pos_end = std::min(a.kv.length, a.pos_begin + chunk_);
    attend(a);
    for (int x = 0; x < n; ++x) {
      Partial(scratch.acc.data() + static_cast<size_t>(x) * pf, hp)
          .Merge(Partial(scratch.partials.data() + static_cast<size_t>(x) * pf, hp));
    }
  }
  const MergeGroup m{item.slice, item.token0, item.n_tokens, item.kv_head, 0, 0};
  for (int i = 0; i < item.n_tokens; ++i) {
    for (int j = 0; j < group; ++j) {
      WriteOutput(m, i, j, Partial(scratch.acc.data() + static_cast<size_t>(i * group + j) * pf, hp),
                  out);
    }
  }
}

void AttentionShard::ProcessF32(uint32_t layer, uint32_t n_tokens, const shm::AttnRequestView& req,
                                float* out) {
  const int hd = g_.head_dim, qh = g_.q_heads();
  // Causal attention, one work item per (token, query head).
  pool_->ParallelFor(static_cast<int64_t>(n_tokens) * qh, [&](int64_t begin, int64_t end, int thread) {
    F32Scratch& s = f32_scratch_[thread];
    for (int64_t item = begin; item < end; ++item) {
      const int t = static_cast<int>(item / qh);
      const int h = static_cast<int>(item % qh);
      const int kv_head = h / g_.gqa_ratio;
      const uint64_t seq = token_seq_[t];
      const int pos = last_pos_[t];
      for (int p = 0; p <= pos; ++p) {
        s.k_rows[p] = cache_->KeyRow(seq, layer, kv_head, p);
        s.v_rows[p] = cache_->ValueRow(seq, layer, kv_head, p);
      }
      AttendOneHead(req.q + (static_cast<size_t>(t) * qh + h) * hd, s.k_rows.data(),
                    s.v_rows.data(), pos + 1, hd, s.scores.data(),
                    out + (static_cast<size_t>(t) * qh + h) * hd);
    }
  });
}

}  // namespace ellm::attn
