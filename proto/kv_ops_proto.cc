#include "proto/kv_ops_proto.h"

namespace ellm {
namespace {

void ToProto(const KvOps::SequenceBlocks& b, ellm::v1::SequenceBlocks* out) {
  out->set_sequence_id(b.seq);
  out->set_first_block(b.first_block);
  for (uint64_t k : b.keys) out->add_keys(k);
  out->set_parent(b.parent);
  for (int32_t t : b.tokens) out->add_tokens(t);
  out->set_partial_key(b.partial_key);
  out->set_partial_rows(b.partial_rows);
}

KvOps::SequenceBlocks FromProto(const ellm::v1::SequenceBlocks& b) {
  return {b.sequence_id(), b.first_block(), {b.keys().begin(), b.keys().end()}, b.parent(),
          {b.tokens().begin(), b.tokens().end()}, b.partial_key(), b.partial_rows()};
}

}  // namespace

ellm::v1::UpdateKvRequest ToProto(const KvOps& ops) {
  ellm::v1::UpdateKvRequest r;
  for (const KvOps::SequenceBlocks& b : ops.publish) ToProto(b, r.add_publish());
  for (uint64_t id : ops.free) r.add_free_sequences(id);
  for (uint64_t k : ops.evict) r.add_evict(k);
  for (uint64_t k : ops.discard) r.add_discard(k);
  for (const KvOps::SequenceBlocks& b : ops.attach) ToProto(b, r.add_attach());
  return r;
}

KvOps FromProto(const ellm::v1::UpdateKvRequest& r) {
  KvOps ops;
  for (const ellm::v1::SequenceBlocks& b : r.publish()) ops.publish.push_back(FromProto(b));
  ops.free.assign(r.free_sequences().begin(), r.free_sequences().end());
  ops.evict.assign(r.evict().begin(), r.evict().end());
  ops.discard.assign(r.discard().begin(), r.discard().end());
  for (const ellm::v1::SequenceBlocks& b : r.attach()) ops.attach.push_back(FromProto(b));
  return ops;
}

}  // namespace ellm
