// The read-bandwidth probe every benchmark measures against: a plain
// streaming read of a buffer larger than the last-level cache, on the given
// threads, in the benchmark's own process.
#pragma once

#include <cstdint>

#include "core/thread_pool.h"

namespace ellm {

class ReadProbe {
 public:
  // Allocates and touches `bytes` (use well over the LLC: 1 GiB is plenty).
  explicit ReadProbe(int64_t bytes);
  ~ReadProbe();
  ReadProbe(const ReadProbe&) = delete;
  ReadProbe& operator=(const ReadProbe&) = delete;

  // Median GB/s of 5 reads (after one warm-up) on `pool`'s threads.
  double Measure(ThreadPool& pool);

 private:
  int64_t bytes_;
  uint8_t* data_ = nullptr;
  uint64_t (*sum_)(const uint8_t*, size_t) = nullptr;
};

}  // namespace ellm
