// The coordinator's HTTP front (Boost.Beast): the OpenAI-compatible API
// (coordinator/openai_api.h) on the same scheduler, tokenizer and checks as
// the gRPC API, plus GET /v1/models, /health and /metrics.
//
// Every connection is an asynchronous session on a small pool of I/O threads
// (no thread per connection). A generation's events reach its session
// through RequestStream::SetNotify, never by blocking a thread, and its
// writes queue in the session: a slow reader slows only itself, never the
// scheduler's step loop. A client that goes away (a failed write, or its end
// of the socket closing while it waits) cancels its request, which frees the
// request's KV at the next step.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "coordinator/scheduler.h"
#include "coordinator/service.h"
#include "core/status.h"

namespace ellm::coord {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                         // 0: an ephemeral port (tests)
  int threads = 2;                         // I/O threads
  int64_t max_body_bytes = 8 << 20;        // larger bodies get 413
  int max_connections = 1024;              // more at once: answered 503 and closed
  std::chrono::seconds write_timeout{60};  // for one write to go out (a client that stopped reading)
  std::string model_id;                    // the model's name in /v1/models and requests
  bool reasoning_parser = true;            // OpenAiRequest::read_reasoning where the template thinks
  std::function<bool()> serving;           // /health: 200 when true, 503 otherwise
  std::function<std::string()> metrics;    // /metrics: Prometheus text exposition
};

class HttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpOptions& options,
                                                           const EllmService* service,
                                                           Scheduler* scheduler,
                                                           const Tokenizer* tokenizer);
  ~HttpServer();  // stops accepting, closes every connection, joins the threads
  int port() const;
  // Generations whose response is not all written yet (a graceful shutdown
  // waits for none).
  int answering() const;

  struct Impl;  // the io_context, acceptor and threads (http_server.cc)

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ellm::coord
