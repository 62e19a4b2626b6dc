#include "coordinator/workers.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "proto/health.grpc.pb.h"

namespace ellm::coord {
namespace {

constexpr size_t kRecentSteps = 200;

bool Answers(const std::string& address, absl::Duration timeout) {
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckResponse resp;
  return stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok() &&
         resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Workers>> Workers::Connect(const WorkersOptions& options) {
  std::unique_ptr<Workers> w(new Workers(options));
  ASSIGN_OR_RETURN(std::unique_ptr<WorkerLink> link,
                   WorkerLink::Connect(options.mlp_channel, options.addresses, options.connect_timeout,
                                       options.control_secret));
  w->link_ = std::move(link);
  w->missed_.assign(w->link_->workers().size(), 0);
  return w;
}

std::shared_ptr<WorkerLink> Workers::Current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return link_;
}

std::shared_ptr<WorkerLink> Workers::link() const { return Current(); }

double AttendedPositions(const shm::StepPlan& plan) {
  double attended = 0;
  for (const shm::PlanSeq& s : plan.seqs) {
    const double n = s.slice.n_tokens;
    attended += n * s.slice.start_pos + n * (n + 1) / 2;
  }
  return attended;
}

absl::Duration StepDeadline(const std::deque<StepCost>& recent, int tokens, double attended, absl::Duration min) {
  if (recent.empty()) return std::max(min, absl::Seconds(60));
  std::vector<double> per_step, per_token;
  // Attention's time per attended position is at most any step's time over
  // its attended positions (a step took at least that long to attend them):
  // the least of those bounds it, set by the steps that attended the most.
  double per_attended = INFINITY;
  for (const StepCost& c : recent) {
    per_step.push_back(c.seconds);
    per_token.push_back(c.seconds / std::max(1, c.tokens));
    per_attended = std::min(per_attended, c.seconds / std::max(1.0, c.attended));
  }
  auto p99 = [](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(v.size() * 0.99))];
  };
  const double expected =
      std::max(p99(per_step), p99(per_token) * std::max(1, tokens)) + per_attended * attended;
  return std::max(min, absl::Seconds(10 * expected));
}

absl::StatusOr<std::vector<shm::SampledSeq>> Workers::Run(uint64_t step, const shm::StepPlan& plan) {
  std::shared_ptr<WorkerLink> link = Current();
  const int tokens = static_cast<int>(plan.tokens.size());
  const double attended = AttendedPositions(plan);
  {
    std::lock_guard<std::mutex> lock(mu_);
    link->step_timeout = StepDeadline(recent_, tokens, attended, options_.min_step_timeout);
    link->abandoned = &abandoned_;
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<shm::SampledSeq>> out = link->Run(step, plan);
  if (out.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    recent_.push_back({absl::ToDoubleSeconds(absl::Now() - start), tokens, attended});
    if (recent_.size() > kRecentSteps) recent_.pop_front();
  } else if (out.status().code() == absl::StatusCode::kDeadlineExceeded) {
    return absl::DeadlineExceededError(absl::StrCat("step ", step, " took longer than its deadline of ",
                                                    absl::FormatDuration(link->step_timeout), ": ",
                                                    out.status().message()));
  }
  return out;
}

absl::Status Workers::UpdateKv(const KvOps& ops) { return Current()->UpdateKv(ops); }

absl::StatusOr<int> Workers::LoadBlocks(const std::vector<uint64_t>& keys) { return Current()->LoadBlocks(keys); }

absl::Status Workers::FillSynthetic(uint64_t id, int positions) { return Current()->FillSynthetic(id, positions); }

absl::Status Workers::Heartbeat() {
  std::shared_ptr<WorkerLink> link = Current();
  RETURN_IF_ERROR(link->CheckWorkers());  // a process gone
  const std::vector<WorkerHandle>& workers = link->workers();
  for (size_t i = 0; i < workers.size(); ++i) {
    const bool answered = Answers(workers[i].address, options_.heartbeat_timeout);
    int missed = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (link != link_) return absl::OkStatus();  // replaced meanwhile
      missed = answered ? (missed_[i] = 0) : ++missed_[i];
    }
    if (missed >= 2) {
      const int pid = workers[i].info.pid();
      const std::string who = absl::StrCat(WorkerName(workers[i].info), " (pid ", pid, ")");
      LogError("%s has not answered for %d heartbeats: frozen; killing it", who, missed);
      kill(pid, SIGKILL);
      return absl::UnavailableError(absl::StrCat(who, " froze"));
    }
  }
  return absl::OkStatus();
}

absl::Status Workers::Recover() {
  std::shared_ptr<WorkerLink> old = Current();
  std::vector<int> old_pids;
  for (const WorkerHandle& w : old->workers()) {
    old_pids.push_back(w.info.pid());
    // What is left of the failed set goes, so the launcher replaces it whole.
    if (shm::ProcessAlive(w.info.pid())) kill(w.info.pid(), SIGKILL);
  }
  LogInfo("waiting for the launcher to restart the workers (up to %s)",
          absl::FormatDuration(options_.recovery_timeout));
  const absl::Time deadline = absl::Now() + options_.recovery_timeout;
  absl::Status last = absl::UnavailableError("no worker answered");
  while (absl::Now() < deadline) {
    if (options_.stop && options_.stop()) return absl::CancelledError("the server is shutting down");
    absl::StatusOr<std::unique_ptr<WorkerLink>> link =
        WorkerLink::Connect(options_.mlp_channel, options_.addresses, absl::Seconds(2), options_.control_secret);
    if (link.ok()) {
      bool fresh = true;
      for (const WorkerHandle& w : (*link)->workers()) {
        fresh = fresh && std::find(old_pids.begin(), old_pids.end(), w.info.pid()) == old_pids.end();
      }
      if (fresh) {
        std::lock_guard<std::mutex> lock(mu_);
        link_ = *std::move(link);
        missed_.assign(link_->workers().size(), 0);
        recent_.clear();
        return absl::OkStatus();
      }
      last = absl::UnavailableError("the old workers still answer");
    } else {
      last = link.status();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return absl::UnavailableError(absl::StrCat("the workers did not come back within ",
                                             absl::FormatDuration(options_.recovery_timeout), ": ",
                                             last.message()));
}

}  // namespace ellm::coord
