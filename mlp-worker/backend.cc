#include "mlp-worker/backend.h"

#include "absl/strings/str_cat.h"

namespace ellm::mlp {

absl::Status CheckShardIo(const MlpBackend::ShardIo* shards, int n_shards, int n_kv_heads,
                          bool outputs) {
  KvHeadCover cover;
  for (int i = 0; i < n_shards; ++i) {
    const MlpBackend::ShardIo& s = shards[i];
    RETURN_IF_ERROR(cover.Add(s.heads));
    if (outputs ? !(s.q && s.k && s.v) : s.attn == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard ", i, " (KV heads ", s.heads.ToString(), ") has no ",
                       outputs ? "q, k, v" : "attention", " buffer"));
    }
  }
  return cover.Finish(n_kv_heads);
}

absl::Status ComputeQkv(MlpBackend& backend, int n_kv_heads, int layer, float* q, float* k,
                        float* v) {
  RETURN_IF_ERROR(backend.StageQkv(layer));
  MlpBackend::ShardIo whole;
  whole.heads = {0, n_kv_heads};
  whole.q = q;
  whole.k = k;
  whole.v = v;
  return backend.WriteQkvShards(&whole, 1);
}

absl::Status CompleteLayer(MlpBackend& backend, int n_kv_heads, int layer, const float* attn) {
  MlpBackend::ShardIo whole;
  whole.heads = {0, n_kv_heads};
  whole.attn = attn;
  return backend.CompleteLayerFromShards(layer, &whole, 1);
}

}  // namespace ellm::mlp
