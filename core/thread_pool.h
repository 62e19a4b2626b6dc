// A fixed pool of worker threads, created once, optionally pinned one per cpu.
// ParallelFor splits [0, n) into contiguous chunks, one per thread, and runs
// them with the calling thread taking the first chunk. After a job, workers
// (and the caller, waiting for them) spin for kSpinMicros before sleeping on a
// condition variable: back-to-back jobs (one per layer in decode) then skip
// the futex wake-up (~5-10 us on bare metal, ~65 us on a small VM), while an
// idle pool still sleeps and burns no core.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ellm {

class ThreadPool {
 public:
  // `threads` >= 1 (the caller counts as one). `cpus`, when not empty, pins
  // thread i to cpus[i % cpus.size()] (the caller is pinned too).
  explicit ThreadPool(int threads, const std::vector<int>& cpus = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // fn(begin, end, thread_index) over a partition of [0, n); returns when all are done.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn);

 private:
  void WorkerLoop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0;
  std::atomic<uint64_t> generation_{0};  // written under mu_, read by spinners
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> pin_warned_{false};
};

// Runs fn(i, thread) for i in [0, n) on `pool`. Each thread owns a
// contiguous range of indices and runs it front to back, so consecutive
// items (chunks of a sequence, chunks of weight rows) stay on one core: one
// unbroken memory stream for its prefetching. A thread whose range is done
// takes single indices from the back of the others' ranges, so unequal
// items or a core busy with something else still balance. Which thread runs
// an item never changes its result. `inline_only`: all on the calling thread.
template <typename Fn>
void ParallelItems(ThreadPool* pool, int64_t n, bool inline_only, const Fn& fn) {
  if (n <= 0) return;
  const int parts = static_cast<int>(std::min<int64_t>(n, pool->size()));
  if (inline_only || parts == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  // Range p is [front, back), both in one word so that the owner (front)
  // and thieves (back) agree through one compare-and-swap.
  struct alignas(64) Range {
    std::atomic<uint64_t> front_back;
  };
  std::unique_ptr<Range[]> ranges(new Range[parts]);
  for (int p = 0; p < parts; ++p) {
    const uint64_t front = static_cast<uint64_t>(n * p / parts), back = static_cast<uint64_t>(n * (p + 1) / parts);
    ranges[p].front_back.store(front | back << 32, std::memory_order_relaxed);
  }
  // The index taken from range r's front (or back), or -1 when it is empty.
  auto take = [](Range& r, bool from_front) -> int64_t {
    uint64_t cur = r.front_back.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t front = cur & 0xffffffffu, back = cur >> 32;
      if (front >= back) return -1;
      const uint64_t next = from_front ? (front + 1) | back << 32 : front | (back - 1) << 32;
      if (r.front_back.compare_exchange_weak(cur, next, std::memory_order_relaxed)) {
        return static_cast<int64_t>(from_front ? front : back - 1);
      }
    }
  };
  pool->ParallelFor(parts, [&](int64_t begin, int64_t end, int thread) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t i = take(ranges[p], true); i >= 0; i = take(ranges[p], true)) fn(i, thread);
      for (int k = 1; k < parts; ++k) {
        Range& other = ranges[(p + k) % parts];
        for (int64_t i = take(other, false); i >= 0; i = take(other, false)) fn(i, thread);
      }
    }
  });
}

// Pins the calling thread to `cpu`; false when the kernel refuses.
bool PinCurrentThread(int cpu);
// Lets the calling thread run on any of `cpus`; false when the kernel
// refuses. Threads it starts inherit this: a pinned thread that starts
// service threads (gRPC, writers) widens itself first, then pins again.
bool SetCurrentThreadCpus(const std::vector<int>& cpus);

}  // namespace ellm
