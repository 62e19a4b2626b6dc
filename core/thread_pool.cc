#include "core/thread_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>

#include "core/log.h"

namespace ellm {
namespace {

// Short: with the CPU backend the MLP worker and the attention workers take
// turns on the same cores, and a spinning pool must not hold a core long
// after its job (the rings spin for the same 50 us).
constexpr int kSpinMicros = 50;

// Spins until done() or kSpinMicros pass; true when done() became true.
template <typename Done>
bool SpinUntil(const Done& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
  while (!done()) {
    for (int i = 0; i < 32; ++i) _mm_pause();
    if (std::chrono::steady_clock::now() > until) return false;
  }
  return true;
}

}  // namespace

bool PinCurrentThread(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

bool SetCurrentThreadCpus(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : cpus) {
    if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &set);
  }
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

namespace {
// Pins, and says once per pool when the kernel refuses (a CPU outside this
// process's cpuset): the thread then runs wherever the scheduler puts it.
void Pin(int cpu, std::atomic<bool>* warned) {
  if (PinCurrentThread(cpu) || warned->exchange(true)) return;
  LogWarning("cannot pin a thread to CPU %d (outside the CPUs this process may use?): its threads run unpinned",
             cpu);
}
}  // namespace

ThreadPool::ThreadPool(int threads, const std::vector<int>& cpus) {
  if (threads < 1) threads = 1;
  if (!cpus.empty()) Pin(cpus[0], &pin_warned_);
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this, i, cpus] {
      if (!cpus.empty()) Pin(cpus[i % cpus.size()], &pin_warned_);
      WorkerLoop(i);
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

namespace {
void Chunk(int64_t n, int parts, int index, int64_t* begin, int64_t* end) {
  *begin = n * index / parts;
  *end = n * (index + 1) / parts;
}
}  // namespace

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  const int parts = size();
  if (parts == 1 || n == 1) {
    fn(0, n, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    pending_ = parts - 1;
    ++generation_;
  }
  work_cv_.notify_all();
  int64_t begin, end;
  Chunk(n, parts, 0, &begin, &end);
  if (begin < end) fn(begin, end, 0);
  SpinUntil([this] { return pending_.load(std::memory_order_acquire) == 0; });
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t, int)>* job;
    int64_t n;
    {
      SpinUntil([&] {
        return stop_.load(std::memory_order_acquire) ||
               generation_.load(std::memory_order_acquire) != seen;
      });
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
    }
    int64_t begin, end;
    Chunk(n, size(), index, &begin, &end);
    if (begin < end) (*job)(begin, end, index);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace ellm
