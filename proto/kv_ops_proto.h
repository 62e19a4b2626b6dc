// KvOps (core/kv_ops.h) to and from the UpdateKv control message: the one
// place they convert.
#pragma once

#include "core/kv_ops.h"
#include "proto/ellm.pb.h"

namespace ellm {

ellm::v1::UpdateKvRequest ToProto(const KvOps& ops);
KvOps FromProto(const ellm::v1::UpdateKvRequest& request);

}  // namespace ellm
