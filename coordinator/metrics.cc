#include "coordinator/metrics.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/scheduler.h"

namespace ellm::coord {

Metrics::Histogram Metrics::Latency() {
  Histogram h;
  h.bounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
  h.counts.assign(h.bounds.size() + 1, 0);
  return h;
}

void Metrics::Histogram::Observe(double v) {
  const size_t i = std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin();
  ++counts[i];
  sum += v;
  ++count;
}

void Metrics::RequestEnded(const std::string& outcome) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_[outcome];
}

void Metrics::PromptTokens(int prompt) {
  std::lock_guard<std::mutex> lock(mu_);
  prompt_tokens_ += static_cast<uint64_t>(std::max(0, prompt));
}

void Metrics::GeneratedToken() {
  std::lock_guard<std::mutex> lock(mu_);
  ++generated_tokens_;
}

void Metrics::TimeToFirstToken(absl::Duration d) {
  std::lock_guard<std::mutex> lock(mu_);
  ttft_.Observe(absl::ToDoubleSeconds(d));
}

void Metrics::InterTokenLatency(absl::Duration d) {
  std::lock_guard<std::mutex> lock(mu_);
  itl_.Observe(absl::ToDoubleSeconds(d));
}

void Metrics::QueueWait(absl::Duration d) {
  std::lock_guard<std::mutex> lock(mu_);
  queue_.Observe(absl::ToDoubleSeconds(d));
}

std::string Metrics::Render(const SchedulerStats& st, const std::vector<WorkerSample>& workers) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  auto head = [&out](const char* name, const char* type, const char* help) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  };
  auto sample = [&out](const std::string& name, double v) { absl::StrAppendFormat(&out, "%s %.17g\n", name, v); };
  auto histogram = [&](const char* name, const char* help, const Histogram& h) {
    head(name, "histogram", help);
    uint64_t cumulative = 0;
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      cumulative += h.counts[i];
      sample(absl::StrFormat("%s_bucket{le=\"%g\"}", name, h.bounds[i]), static_cast<double>(cumulative));
    }
    sample(absl::StrCat(name, "_bucket{le=\"+Inf\"}"), static_cast<double>(h.count));
    sample(absl::StrCat(name, "_sum"), h.sum);
    sample(absl::StrCat(name, "_count"), static_cast<double>(h.count));
  };

  head("ellm_requests_total", "counter",
       "Requests by outcome: stop, length, cancelled, error, and refused (never queued: a bad request, a full "
       "queue, a stopping server).");
  for (const char* outcome : {"stop", "length", "cancelled", "error", "refused"}) {
    const auto it = requests_.find(outcome);
    sample(absl::StrCat("ellm_requests_total{outcome=\"", outcome, "\"}"),
           it == requests_.end() ? 0.0 : static_cast<double>(it->second));
  }
  head("ellm_prompt_tokens_total", "counter", "Prompt tokens of admitted requests (at their first admission).");
  sample("ellm_prompt_tokens_total", static_cast<double>(prompt_tokens_));
  head("ellm_cached_prompt_tokens_total", "counter", "Prompt tokens whose KV came from the prefix cache.");
  sample("ellm_cached_prompt_tokens_total", static_cast<double>(st.cached_tokens));
  head("ellm_generated_tokens_total", "counter", "Tokens generated.");
  sample("ellm_generated_tokens_total", static_cast<double>(generated_tokens_));
  histogram("ellm_time_to_first_token_seconds", "Time from a request's arrival to its first token.", ttft_);
  histogram("ellm_inter_token_latency_seconds", "Time between a request's consecutive tokens.", itl_);
  histogram("ellm_queue_wait_seconds", "Time a request waited for its first admission.", queue_);

  head("ellm_requests_running", "gauge", "Requests in the running batch.");
  sample("ellm_requests_running", st.running);
  head("ellm_requests_waiting", "gauge", "Requests waiting for admission.");
  sample("ellm_requests_waiting", st.waiting);
  head("ellm_kv_blocks_free", "gauge", "KV blocks neither reserved by a request nor cached (coordinator's view).");
  sample("ellm_kv_blocks_free", static_cast<double>(st.kv_blocks_free));
  head("ellm_kv_blocks_cached", "gauge", "KV blocks held by the prefix cache (coordinator's view).");
  sample("ellm_kv_blocks_cached", static_cast<double>(st.kv_blocks_cached));
  head("ellm_prefix_cache_hits_total", "counter", "Requests that started with cached KV blocks.");
  sample("ellm_prefix_cache_hits_total", static_cast<double>(st.prefix_hits));
  head("ellm_prefix_cache_misses_total", "counter", "Requests that found no cached KV block.");
  sample("ellm_prefix_cache_misses_total", static_cast<double>(st.prefix_misses));
  head("ellm_worker_recoveries_total", "counter", "Worker failures recovered from.");
  sample("ellm_worker_recoveries_total", static_cast<double>(st.recoveries));

  // Workers: blocks, and bytes read per second since the previous scrape.
  const absl::Time now = absl::Now();
  const double seconds = last_render_ == absl::Time() ? 0 : absl::ToDoubleSeconds(now - last_render_);
  // A worker restarted since the previous scrape counts from 0 again: what
  // it read since its start is the lower bound of the rate.
  auto rate = [&](const std::string& key, int64_t bytes) {
    const auto it = last_bytes_.find(key);
    const double read = it == last_bytes_.end() ? 0 : bytes >= it->second ? bytes - it->second : bytes;
    const double r = seconds <= 0 ? 0 : read / seconds;
    last_bytes_[key] = bytes;
    return r;
  };
  bool any_attention = false, any_mlp = false;
  for (const WorkerSample& w : workers) (w.attention ? any_attention : any_mlp) = true;
  if (any_attention) {
    head("ellm_kv_blocks", "gauge", "KV blocks of each attention worker, by state (used by requests, cached, free).");
    for (const WorkerSample& w : workers) {
      if (!w.attention) continue;
      const std::string l = absl::StrCat("worker=\"", w.name, "\"");
      sample(absl::StrCat("ellm_kv_blocks{", l, ",state=\"free\"}"), static_cast<double>(w.blocks_free));
      sample(absl::StrCat("ellm_kv_blocks{", l, ",state=\"cached\"}"), static_cast<double>(w.blocks_cached));
      sample(absl::StrCat("ellm_kv_blocks{", l, ",state=\"used\"}"),
             static_cast<double>(w.blocks_total - w.blocks_free - w.blocks_cached));
    }
    head("ellm_kv_read_bytes_total", "counter", "K and V bytes each attention worker read.");
    std::vector<double> rates;
    for (const WorkerSample& w : workers) {
      if (!w.attention) continue;
      sample(absl::StrCat("ellm_kv_read_bytes_total{worker=\"", w.name, "\"}"), static_cast<double>(w.kv_read_bytes));
      rates.push_back(rate("kv/" + w.name, w.kv_read_bytes));
    }
    head("ellm_kv_read_bytes_per_second", "gauge", "KV read rate of each attention worker since the previous scrape.");
    size_t i = 0;
    for (const WorkerSample& w : workers) {
      if (w.attention) sample(absl::StrCat("ellm_kv_read_bytes_per_second{worker=\"", w.name, "\"}"), rates[i++]);
    }
    head("ellm_kv_read_probe_bytes_per_second", "gauge",
         "Read bandwidth each attention worker measured on its node at start-up.");
    for (const WorkerSample& w : workers) {
      if (w.attention) sample(absl::StrCat("ellm_kv_read_probe_bytes_per_second{worker=\"", w.name, "\"}"), w.probe_bytes_per_second);
    }
    head("ellm_kv_read_bandwidth_ratio", "gauge",
         "KV read rate over the node's probed bandwidth: how close decode runs to the memory limit.");
    i = 0;
    for (const WorkerSample& w : workers) {
      if (!w.attention) continue;
      const double r = rates[i++];
      sample(absl::StrCat("ellm_kv_read_bandwidth_ratio{worker=\"", w.name, "\"}"),
             w.probe_bytes_per_second > 0 ? r / w.probe_bytes_per_second : 0);
    }
  }
  if (any_mlp) {
    head("ellm_weight_read_bytes_total", "counter", "Weight bytes the MLP worker read (every weight once per step).");
    std::vector<double> rates;
    for (const WorkerSample& w : workers) {
      if (w.attention) continue;
      sample(absl::StrCat("ellm_weight_read_bytes_total{worker=\"", w.name, "\"}"), static_cast<double>(w.weight_read_bytes));
      rates.push_back(rate("w/" + w.name, w.weight_read_bytes));
    }
    head("ellm_weight_read_bytes_per_second", "gauge", "Weight read rate since the previous scrape.");
    size_t i = 0;
    for (const WorkerSample& w : workers) {
      if (!w.attention) sample(absl::StrCat("ellm_weight_read_bytes_per_second{worker=\"", w.name, "\"}"), rates[i++]);
    }
  }
  if (!workers.empty()) {
    head("ellm_worker_busy_seconds_total", "counter",
         "Seconds each worker spent computing (the mlp-worker less its waits for attention).");
    for (const WorkerSample& w : workers) {
      sample(absl::StrCat("ellm_worker_busy_seconds_total{worker=\"", w.name, "\"}"), w.busy_seconds);
    }
  }
  last_render_ = now;
  return out;
}

}  // namespace ellm::coord
