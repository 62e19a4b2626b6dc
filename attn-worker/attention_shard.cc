#include "attn-worker/attention_shard.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/kernels.h"

namespace ellm::attn {

AttentionShard::AttentionShard(const ShardGeometry& geometry, KvCache* cache, ThreadPool* pool)
    : g_(geometry), cache_(cache), pool_(pool), scratch_(pool->size()) {
  for (Scratch& s : scratch_) {
    s.k_rows.resize(g_.max_positions);
    s.v_rows.resize(g_.max_positions);
    s.scores.resize(g_.max_positions);
  }
}

absl::Status AttentionShard::Process(uint32_t layer, uint32_t n_seqs, uint32_t n_tokens,
                                     const shm::AttnRequestView& req, float* out) {
  if (layer >= static_cast<uint32_t>(g_.layers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention request for layer ", layer, " of a ", g_.layers, "-layer model"));
  }
  const int hd = g_.head_dim, kvh = g_.kv_heads(), qh = g_.q_heads();

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

  // Token index -> (sequence, position).
  std::vector<std::pair<uint64_t, int>> token_at(n_tokens);
  {
    uint32_t t = 0;
    for (uint32_t i = 0; i < n_seqs; ++i) {
      for (uint32_t j = 0; j < req.slices[i].n_tokens; ++j, ++t) {
        token_at[t] = {req.slices[i].seq_id, static_cast<int>(req.slices[i].start_pos + j)};
      }
    }
  }

  // Append k, v.
  for (uint32_t t = 0; t < n_tokens; ++t) {
    const auto [seq, pos] = token_at[t];
    for (int h = 0; h < kvh; ++h) {
      std::copy_n(req.k + (static_cast<size_t>(t) * kvh + h) * hd, hd,
                  cache_->KeyRow(seq, layer, h, pos));
      std::copy_n(req.v + (static_cast<size_t>(t) * kvh + h) * hd, hd,
                  cache_->ValueRow(seq, layer, h, pos));
    }
  }

  // Causal attention, one work item per (token, query head).
  pool_->ParallelFor(static_cast<int64_t>(n_tokens) * qh, [&](int64_t begin, int64_t end, int thread) {
    Scratch& s = scratch_[thread];
    for (int64_t item = begin; item < end; ++item) {
      const int t = static_cast<int>(item / qh);
      const int h = static_cast<int>(item % qh);
      const int kv_head = h / g_.gqa_ratio;
      const auto [seq, pos] = token_at[t];
      for (int p = 0; p <= pos; ++p) {
        s.k_rows[p] = cache_->KeyRow(seq, layer, kv_head, p);
        s.v_rows[p] = cache_->ValueRow(seq, layer, kv_head, p);
      }
      AttendOneHead(req.q + (static_cast<size_t>(t) * qh + h) * hd, s.k_rows.data(),
                    s.v_rows.data(), pos + 1, hd, s.scores.data(),
                    out + (static_cast<size_t>(t) * qh + h) * hd);
    }
  });
  return absl::OkStatus();
}

}  // namespace ellm::attn
