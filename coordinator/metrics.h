// The coordinator's Prometheus metrics: what the scheduler observes
// (requests by outcome, tokens, latency histograms) and, at each scrape, the
// workers' own counters from the control plane, including the live bandwidth
// accounting: per attention worker the KV bytes it read per second since the
// previous scrape against the read bandwidth it measured at start-up, and
// per MLP worker the weight bytes read per second. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace ellm::coord {

struct SchedulerStats;

class Metrics {
 public:
  // Observations (any thread).
  void RequestEnded(const std::string& outcome);  // "stop", "length", "cancelled", "error", "refused"
  // At a request's first admission, whatever its end. (Its cached tokens
  // are the scheduler's count, SchedulerStats::cached_tokens.)
  void PromptTokens(int prompt);
  void GeneratedToken();
  void TimeToFirstToken(absl::Duration d);
  void InterTokenLatency(absl::Duration d);
  void QueueWait(absl::Duration d);

  // One worker's counters at a scrape (from its GetInfo).
  struct WorkerSample {
    std::string name;            // "attn-0", ..., "mlp"
    bool attention = false;
    int64_t kv_read_bytes = 0;   // attention: K and V bytes read so far
    double probe_bytes_per_second = 0;
    int64_t blocks_total = 0, blocks_free = 0, blocks_cached = 0;
    int64_t weight_read_bytes = 0;  // mlp: weight bytes read so far
    double busy_seconds = 0;        // WorkerInfo.busy_seconds
  };
  // The text exposition (format 0.0.4) of everything, rates taken over the
  // time since the previous Render.
  std::string Render(const SchedulerStats& stats, const std::vector<WorkerSample>& workers);

 private:
  struct Histogram {
    std::vector<double> bounds;
    std::vector<uint64_t> counts;  // per bound, not cumulative; one more for +Inf
    double sum = 0;
    uint64_t count = 0;
    void Observe(double v);
  };
  static Histogram Latency();

  std::mutex mu_;
  std::map<std::string, uint64_t> requests_;
  uint64_t prompt_tokens_ = 0, generated_tokens_ = 0;
  Histogram ttft_ = Latency(), itl_ = Latency(), queue_ = Latency();
  // The previous scrape's counters, for rates.
  absl::Time last_render_;
  std::map<std::string, int64_t> last_bytes_;
};

}  // namespace ellm::coord
