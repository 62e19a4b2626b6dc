#include "coordinator/http_server.h"

#include <sys/socket.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <deque>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/openai_api.h"
#include "core/log.h"

namespace ellm::coord {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

constexpr auto kRequestTimeout = std::chrono::seconds(60);  // to read a request
// A stream's bytes queued for a client that does not read them: past this,
// the client is treated as gone (its request is cancelled). Per choice: a
// request of n choices may queue n times as much.
constexpr size_t kMaxQueuedBytes = size_t{16} << 20;
// After refusing a request it has not read to its end, the server reads and
// drops what the client still sends, for this long and this much at most,
// before it closes: closing on unread bytes resets the connection, and a
// client still uploading would lose the answer.
constexpr auto kLingerTime = std::chrono::seconds(5);
constexpr size_t kLingerBytes = size_t{64} << 20;
// Bytes read but not yet taken by the parser. The parser takes body bytes as
// they come (up to --http-max-body-mb) and bounds the header, but Boost 1.74's
// parser bounds neither a chunk's size line (its extensions) nor the trailer
// of a chunked body: without this bound, one client sending either without
// end would grow the buffer until the coordinator ran out of memory. Past it,
// the read fails with buffer_overflow (answered 400, see OnRead).
constexpr size_t kMaxUnparsedBytes = size_t{1} << 20;
// Request bodies under this size are parsed and tokenized on the session's
// I/O thread (well under a millisecond to a few); larger ones on the prepare
// pool, where they wait for each other but no small request waits for them.
constexpr size_t kPrepareInline = size_t{64} << 10;

}  // namespace

struct HttpServer::Impl {
  HttpOptions options;
  const EllmService* service = nullptr;
  Scheduler* scheduler = nullptr;
  const Tokenizer* tokenizer = nullptr;
  net::io_context ioc;
  tcp::acceptor acceptor{ioc};
  net::steady_timer accept_retry{ioc};
  std::vector<std::thread> threads;
  // Work that may block (/metrics asks every worker), off the I/O threads.
  // After ioc: stopped and joined before it is destroyed.
  net::thread_pool blocking{1};
  // Parsing and tokenizing request bodies (8 MiB of text takes 0.3-0.4 s to
  // tokenize: TokenizerBench in test_tokenizer), so that the I/O threads keep
  // every other connection's stream going meanwhile. After ioc, as blocking is.
  net::thread_pool prepare{2};
  std::atomic<uint64_t> next_id{1};
  // Response ids are id_base ^ (n * an odd constant): distinct within a run,
  // and random across runs (a restarted server does not repeat them).
  const uint64_t id_base = [] {
    std::random_device rd;
    return uint64_t{rd()} << 32 | rd();
  }();
  std::atomic<int> sessions{0};  // open connections (Session objects)
  std::atomic<int> answering{0};  // generations whose response is not all out yet
  bool accept_failing = false;  // one warning per run of failed accepts
  bool refusing = false;        // one warning per run of connections over the limit
  void Accept();
};

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, HttpServer::Impl* server) : stream_(std::move(socket)), server_(server) {
    ++server_->sessions;
  }
  ~Session() {
    --server_->sessions;
    if (requests_.empty()) return;
    --server_->answering;
    for (const std::shared_ptr<RequestStream>& r : requests_) r->SetNotify(nullptr);
    if (!finished_) CancelAll();  // the client went away mid-generation
  }

  void Start() { Read(); }

 private:
  void Read() {
    parser_.emplace();
    parser_->body_limit(static_cast<uint64_t>(server_->options.max_body_bytes));
    head_ = false;
    stream_.expires_after(kRequestTimeout);
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
  }

  // The header alone: codings this server cannot read are refused before
  // the body, and a client that expects "100 Continue" (curl does, for
  // bodies over 1 MiB) gets it instead of waiting a second for it.
  void OnHeader(beast::error_code ec) {
    if (ec) return OnRead(ec);
    const http::request<http::string_body>& req = parser_->get();
    version_ = req.version();
    auto refuse = [&](absl::Status status, int http_status) {
      keep_alive_ = false;
      unread_input_ = !parser_->is_done();
      SendError(status, http_status);
    };
    if (const auto te = req.find(http::field::transfer_encoding);
        te != req.end() && !beast::iequals(te->value(), "chunked")) {
      return refuse(absl::UnimplementedError(absl::StrCat("Transfer-Encoding '", std::string(te->value()),
                                                          "' is not supported (only chunked)")),
                    501);
    }
    if (const auto ce = req.find(http::field::content_encoding);
        ce != req.end() && !beast::iequals(ce->value(), "identity")) {
      return refuse(absl::InvalidArgumentError(absl::StrCat("Content-Encoding '", std::string(ce->value()),
                                                            "' is not supported (send the body as it is)")),
                    415);
    }
    // A POST says how long its body is: without Content-Length or chunks it
    // has none (an HTTP/1.0 client that meant "until I close" would get "not
    // valid JSON" for a body it did send).
    if (req.method() == http::verb::post && !parser_->content_length() && !parser_->chunked()) {
      return refuse(absl::InvalidArgumentError("a POST needs a Content-Length header (or a chunked body)"), 411);
    }
    const auto expect = req.find(http::field::expect);
    if (expect == req.end() || parser_->is_done()) return ReadBody();
    if (!beast::iequals(expect->value(), "100-continue")) {
      return refuse(absl::InvalidArgumentError(
                        absl::StrCat("Expect: '", std::string(expect->value()), "' is not supported")),
                    417);
    }
    if (req.version() < 11) return ReadBody();  // no interim answers to HTTP/1.0
    auto res = std::make_shared<http::response<http::empty_body>>(http::status::continue_, 11);
    http::async_write(stream_, *res, [self = shared_from_this(), res](beast::error_code ec, size_t) {
      if (ec) return self->Close();
      self->ReadBody();
    });
  }

  void ReadBody() {
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void OnRead(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == net::error::eof) return Close();
    if (ec == http::error::body_limit) {
      keep_alive_ = false;
      unread_input_ = true;
      return SendError(absl::ResourceExhaustedError(absl::StrCat(
                           "the body is over the limit of ", server_->options.max_body_bytes >> 20,
                           " MiB (--http-max-body-mb)")),
                       413);
    }
    if (ec == http::error::header_limit) {
      keep_alive_ = false;
      unread_input_ = true;
      return SendError(absl::InvalidArgumentError("the request's header is too large"), 431);
    }
    if (ec.category() == http::make_error_code(http::error::bad_method).category() &&
        ec != http::error::partial_message) {
      keep_alive_ = false;  // the stream's framing is lost: answer, then close
      unread_input_ = true;
      return SendError(absl::InvalidArgumentError(absl::StrCat("malformed HTTP request: ", ec.message())), 400);
    }
    if (ec) return Close();  // a timeout, a reset, a request cut short
    const http::request<http::string_body>& req = parser_->get();
    // A server that stops (drains) asks kept-alive clients to go elsewhere.
    keep_alive_ = req.keep_alive() && server_->scheduler->admitting();
    version_ = req.version();
    head_ = req.method() == http::verb::head;
    try {
      Route(req);
    } catch (const std::exception& e) {
      Fail(e);
    }
  }

  // A bug in a handler: this request fails alone, the server goes on.
  void Fail(const std::exception& e) {
    const http::request<http::string_body>& req = parser_->get();
    LogError("HTTP %s %s: %s", std::string(req.method_string()), std::string(req.target()), e.what());
    if (!finished_) CancelAll();
    finished_ = true;
    if (writing_) return Close();
    keep_alive_ = false;
    SendError(absl::InternalError(absl::StrCat("internal error: ", e.what())), 500);
  }

  void Route(const http::request<http::string_body>& req) {
    std::string target(req.target());
    // The absolute form (RFC 9112, 3.2.2): "http://host:port/path?query".
    if (const size_t scheme = target.find("://"); scheme != std::string::npos && target[0] != '/') {
      const size_t slash = target.find('/', scheme + 3);
      target = slash == std::string::npos ? "/" : target.substr(slash);
    }
    const std::string path = target.substr(0, target.find('?'));
    // HEAD is GET without the body (Send leaves it out).
    const bool get = req.method() == http::verb::get || head_, post = req.method() == http::verb::post;
    if (get && path == "/health") {
      const bool ok = server_->options.serving && server_->options.serving();
      return Send(ok ? 200 : 503, ok ? "{\"status\":\"ok\"}" : "{\"status\":\"unavailable\"}", "application/json");
    }
    if (get && path == "/metrics") {
      // Rendering asks each worker for its figures (a second each at most):
      // done on the blocking pool, the answer posted back to this session.
      net::post(server_->blocking, [self = shared_from_this(), executor = stream_.get_executor()] {
        std::string body = self->server_->options.metrics ? self->server_->options.metrics() : "";
        net::post(executor, [self, body = std::move(body)]() mutable {
          self->Send(200, std::move(body), "text/plain; version=0.0.4; charset=utf-8");
        });
      });
      return;
    }
    // The API: the key when there is one.
    const auto auth = req.find(http::field::authorization);
    if (!server_->service->AuthorizeHttp(auth == req.end() ? std::string_view()
                                                           : std::string_view(auth->value().data(), auth->value().size()))) {
      return SendError(absl::UnauthenticatedError("this server needs an API key: 'Authorization: Bearer <key>'"));
    }
    if (get && path == "/v1/models") {
      nlohmann::json body = {{"object", "list"},
                             {"data", nlohmann::json::array({{{"id", server_->options.model_id},
                                                              {"object", "model"},
                                                              {"created", 0},
                                                              {"owned_by", "ellm"}}})}};
      return Send(200, body.dump(), "application/json");
    }
    if (post && (path == "/v1/completions" || path == "/v1/chat/completions")) {
      // (The body is moved out: nothing reads the parsed request after this.)
      return Generate(std::move(parser_->get().body()), path == "/v1/chat/completions");
    }
    if (path == "/v1/completions" || path == "/v1/chat/completions" || path == "/v1/models" ||
        path == "/health" || path == "/metrics") {
      return SendError(absl::InvalidArgumentError(absl::StrCat("method ", std::string(req.method_string()),
                                                                " is not allowed on ", path)),
                       405);
    }
    SendError(absl::NotFoundError(absl::StrCat("no such endpoint: ", path)));
  }

  // A request parsed and validated (status ok), or why not.
  struct Prepared {
    absl::Status status;
    OpenAiRequest request;
    std::vector<GenerateOptions> options;  // one per prompt
  };

  // Prepares the request (here, or on the prepare pool when the body is
  // large), then submits it from this session's executor.
  void Generate(std::string body, bool chat) {
    if (body.size() < kPrepareInline) return Submit(Prepare(*server_, body, chat));
    net::post(server_->prepare, [self = shared_from_this(), executor = stream_.get_executor(), body = std::move(body),
                                 chat]() {
      auto prepared = std::make_shared<Prepared>(Prepare(*self->server_, body, chat));
      net::post(executor, [self, prepared] {
        try {
          self->Submit(std::move(*prepared));
        } catch (const std::exception& e) {
          self->Fail(e);
        }
      });
    });
  }

  // Touches nothing of a session: runs on any thread.
  static Prepared Prepare(const HttpServer::Impl& server, const std::string& body, bool chat) {
    Prepared p;
    try {
      absl::StatusOr<OpenAiRequest> parsed = ParseOpenAiRequest(body, chat, server.options.model_id);
      if (!parsed.ok()) {
        p.status = parsed.status();
        return p;
      }
      for (int k = 0; k < parsed->prompts(); ++k) {
        absl::StatusOr<GenerateOptions> options = server.service->Validate(parsed->GenerateFor(k));
        if (!options.ok()) {
          p.status = parsed->prompts() == 1
                         ? options.status()
                         : absl::Status(options.status().code(),
                                        absl::StrCat(options.status().message(), " (prompt ", k, ")"));
          return p;
        }
        p.options.push_back(*std::move(options));
      }
      p.request = *std::move(parsed);
      p.request.tool_syntax = server.service->chat_template().tool_syntax();
      p.request.read_reasoning =
          chat && server.options.reasoning_parser && server.service->chat_template().thinks();
    } catch (const std::exception& e) {
      LogError("HTTP %s: preparing the request: %s", chat ? "/v1/chat/completions" : "/v1/completions", e.what());
      p.status = absl::InternalError(absl::StrCat("internal error: ", e.what()));
    }
    return p;
  }

  void Submit(Prepared prepared) {
    if (!prepared.status.ok()) {
      server_->scheduler->Refused(prepared.status, "HTTP");
      return SendError(prepared.status);
    }
    const OpenAiRequest& parsed = prepared.request;
    const bool chat = parsed.chat;
    // The id the answer carries, in the request's log lines too.
    const uint64_t n = server_->next_id.fetch_add(1);
    const std::string id =
        absl::StrFormat("%s-%016x", chat ? "chatcmpl" : "cmpl", server_->id_base ^ (n * 0x9E3779B97F4A7C15ULL));
    std::vector<ResponderPrompt> prompts;
    for (GenerateOptions& o : prepared.options) {
      o.source = absl::StrCat("HTTP ", id);
      ResponderPrompt& r = prompts.emplace_back();
      r.last_token = o.prompt.empty() ? -1 : o.prompt.back();
      if (o.prompt_logprobs) r.tokens = o.prompt;  // echo with logprobs lists the prompt's tokens
    }
    // n choices of each prompt: n sequences of it, all queued together
    // (Scheduler::SubmitBatch).
    absl::StatusOr<std::vector<std::shared_ptr<RequestStream>>> choices =
        server_->scheduler->SubmitBatch(std::move(prepared.options), parsed.n);
    if (!choices.ok()) return SendError(choices.status());
    requests_ = *std::move(choices);
    ++server_->answering;
    responder_ = std::make_unique<OpenAiResponder>(
        parsed, id,
        server_->options.model_id, static_cast<int64_t>(std::time(nullptr)), *server_->tokenizer,
        std::move(prompts));
    stream_.expires_never();
    for (const std::shared_ptr<RequestStream>& r : requests_) Notify(*r);
    streaming_ = parsed.stream;
    if (streaming_) {
      header_.emplace(http::status::ok, version_);
      header_->set(http::field::content_type, "text/event-stream");
      header_->set(http::field::cache_control, "no-cache");
      // HTTP/1.0 has no chunked encoding: the body runs to the connection's end.
      chunked_ = version_ >= 11;
      if (!chunked_) keep_alive_ = false;
      header_->keep_alive(keep_alive_);
      header_->chunked(chunked_);
      serializer_.emplace(*header_);
      writing_ = true;
      stream_.expires_after(server_->options.write_timeout);
      http::async_write_header(stream_, *serializer_, [self = shared_from_this()](beast::error_code ec, size_t) {
        self->writing_ = false;
        if (ec) return self->Close();
        self->WriteNext();
      });
    }
    WatchPeer();
    Drain();  // events that arrived before the notifier was set
  }

  // Events of `request` wake this session (on its executor) to Drain.
  void Notify(RequestStream& request) {
    std::weak_ptr<Session> weak = shared_from_this();
    auto executor = stream_.get_executor();
    request.SetNotify([weak, executor] {
      net::post(executor, [weak] {
        if (auto self = weak.lock()) self->Drain();
      });
    });
  }

  void CancelAll() {
    for (const std::shared_ptr<RequestStream>& r : requests_) r->Cancel();
  }

  // The request fails: the choices still running are cancelled, and the
  // client gets the error (in the stream once it has begun).
  void FailAll(const absl::Status& error) {
    CancelAll();
    finished_ = true;
    if (streaming_) {
      // The headers may be out: report in the stream, as OpenAI's servers do.
      outbox_.push_back(absl::StrCat("data: ", OpenAiErrorBody(error), "\n\n"));
      last_queued_ = true;
      WriteNext();
    } else {
      SendError(error);
    }
  }

  // Takes every event the choices have; queues their bytes (streaming) or,
  // at the end, the whole response.
  void Drain() {
    if (requests_.empty() || finished_) return;
    for (size_t i = 0; i < requests_.size() && !finished_; ++i) DrainChoice(static_cast<int>(i));
    if (!finished_ && responder_->finished()) {
      finished_ = true;
      if (!streaming_) return Send(200, responder_->Final(), "application/json");
      last_queued_ = true;
    }
    WriteNext();
  }

  void DrainChoice(int index) {
    RequestStream& request = *requests_[static_cast<size_t>(index)];
    while (std::optional<StreamEvent> e = request.Pop(absl::ZeroDuration())) {
      if (!e->error.ok()) return FailAll(e->error);
      if (streaming_) {
        std::string bytes = responder_->SseFor(*e, index);
        outbox_bytes_ += bytes.size();
        if (!bytes.empty()) outbox_.push_back(std::move(bytes));
        if (outbox_bytes_ > kMaxQueuedBytes * requests_.size()) {
          LogWarning("HTTP client reads too slowly (%d MiB of its stream queued)", outbox_bytes_ >> 20);
          return ClientGone();
        }
      } else {
        responder_->Add(*e, index);
      }
      if (e->finished) return;
    }
  }

  void WriteNext() {
    if (!streaming_ || writing_ || closed_) return;
    if (outbox_.empty()) {
      if (last_queued_ && !last_written_) {
        last_written_ = true;
        if (!chunked_) return Close();  // HTTP/1.0: the end of the connection ends the body
        writing_ = true;
        stream_.expires_after(server_->options.write_timeout);
        net::async_write(stream_, http::make_chunk_last(), [self = shared_from_this()](beast::error_code ec, size_t) {
          self->writing_ = false;
          if (ec || !self->keep_alive_) return self->Close();
          self->Reset();
          self->Read();
        });
      }
      return;
    }
    auto chunk = std::make_shared<std::string>(std::move(outbox_.front()));
    outbox_.pop_front();
    outbox_bytes_ -= chunk->size();
    writing_ = true;
    // A client that stops reading fails the write after --client-write-timeout-s and
    // is treated as gone.
    stream_.expires_after(server_->options.write_timeout);
    auto done = [self = shared_from_this(), chunk](beast::error_code ec, size_t) {
      self->writing_ = false;
      if (ec) return self->ClientGone();
      self->WriteNext();
    };
    if (chunked_) {
      net::async_write(stream_, http::make_chunk(net::buffer(*chunk)), std::move(done));
    } else {
      net::async_write(stream_, net::buffer(*chunk), std::move(done));
    }
  }

  // While a generation runs nothing is read: wait for the socket to turn
  // readable, which a closed client end makes it (a read of 0 bytes).
  // The wait can also end with nothing to read (a readiness edge that the
  // request's own read already consumed, or the next request of a kept-alive
  // connection that Read takes first), so the peek must not block: a
  // blocking peek would hold this connection's strand, and with it the
  // response, until the client sent more.
  void WatchPeer() {
    if (watching_) return;  // one wait at a time, across the requests of a connection
    watching_ = true;
    stream_.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this()](beast::error_code ec) {
      self->watching_ = false;
      if (self->finished_ || self->closed_) return;
      if (ec) return self->ClientGone();
      char probe;
      const ssize_t n = ::recv(self->stream_.socket().native_handle(), &probe, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n > 0) {
        // Data (a pipelined request) is left for after the response. This
        // wait held the session between events; with no wait pending, the
        // session holds itself until the response is out (Reset, Close).
        self->pinned_ = self;
        return;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return self->WatchPeer();
      self->ClientGone();  // 0: the client closed its end; < 0: the connection failed
    });
  }

  void ClientGone() {
    if (!requests_.empty() && !finished_) {
      LogInfo("HTTP client went away; cancelling its request");
      CancelAll();
      finished_ = true;
    }
    Close();
  }

  void Send(int status, std::string body, const char* content_type) {
    if (!server_->scheduler->admitting()) keep_alive_ = false;  // draining: the last answer here
    auto res = std::make_shared<http::response<http::string_body>>(static_cast<http::status>(status), version_);
    res->set(http::field::content_type, content_type);
    res->set(http::field::server, "ellm");
    // A full wait queue: OpenAI's clients retry after this many seconds.
    if (status == 429) res->set(http::field::retry_after, "1");
    res->keep_alive(keep_alive_);
    const size_t length = body.size();
    if (!head_) res->body() = std::move(body);
    res->prepare_payload();
    if (head_) res->content_length(length);  // the GET answer's header, no body
    writing_ = true;
    stream_.expires_after(server_->options.write_timeout);
    http::async_write(stream_, *res, [self = shared_from_this(), res](beast::error_code ec, size_t) {
      self->writing_ = false;
      if (!ec && self->unread_input_) return self->Linger();
      if (ec || !res->keep_alive()) return self->Close();
      self->Reset();
      self->Read();
    });
  }

  void SendError(const absl::Status& status, int http_status = 0) {
    if (http_status == 0) http_status = HttpStatusOf(status);
    Send(http_status, OpenAiErrorBody(status), "application/json");
  }

  // Both are called from handlers that hold a reference of their own, so
  // dropping pinned_ here never destroys the session under them.
  void Reset() {
    pinned_.reset();
    if (!requests_.empty()) --server_->answering;
    for (const std::shared_ptr<RequestStream>& r : requests_) r->SetNotify(nullptr);
    requests_.clear();
    responder_.reset();
    streaming_ = finished_ = last_queued_ = last_written_ = chunked_ = false;
    outbox_.clear();
    outbox_bytes_ = 0;
    serializer_.reset();
    header_.reset();
  }

  // The answer is out: end the sending side, then read and drop what the
  // client still sends until it closes (or kLingerTime, kLingerBytes).
  void Linger() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return Close();
    stream_.expires_after(kLingerTime);
    DropInput(0);
  }
  void DropInput(size_t dropped) {
    if (dropped > kLingerBytes) return Close();
    stream_.async_read_some(net::buffer(linger_buffer_),
                            [self = shared_from_this(), dropped](beast::error_code ec, size_t n) {
                              if (ec) return self->Close();  // the client's end, the time limit, a reset
                              self->DropInput(dropped + n);
                            });
  }

  void Close() {
    pinned_.reset();
    if (closed_) return;
    closed_ = true;
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream_.socket().close(ec);
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_{kMaxUnparsedBytes};
  HttpServer::Impl* server_;
  std::optional<http::request_parser<http::string_body>> parser_;
  unsigned version_ = 11;
  bool keep_alive_ = false;
  bool head_ = false;  // the request is a HEAD: answers carry no body
  // The generation this connection serves: one stream per choice.
  std::vector<std::shared_ptr<RequestStream>> requests_;
  std::unique_ptr<OpenAiResponder> responder_;
  bool streaming_ = false, finished_ = false, last_queued_ = false, last_written_ = false;
  std::optional<http::response<http::empty_body>> header_;
  std::optional<http::response_serializer<http::empty_body>> serializer_;
  std::deque<std::string> outbox_;
  size_t outbox_bytes_ = 0;
  bool chunked_ = false;  // the stream's body is chunked (HTTP/1.1)
  bool writing_ = false, closed_ = false, watching_ = false;
  bool unread_input_ = false;  // refused before its request was read to the end: Linger, then close
  std::array<char, 16384> linger_buffer_;
  std::shared_ptr<Session> pinned_;  // set while a generation runs with no wait on the socket
};

}  // namespace

void HttpServer::Impl::Accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted) return;  // stopping
    if (ec) {
      // Out of file descriptors (EMFILE) and the like: accepting again at
      // once would fail again at once. Wait, warn once per run of failures.
      if (!accept_failing) LogWarning("HTTP accept: %s; retrying every 100 ms", ec.message());
      accept_failing = true;
      accept_retry.expires_after(std::chrono::milliseconds(100));
      accept_retry.async_wait([this](beast::error_code wait_ec) {
        if (!wait_ec) Accept();
      });
      return;
    }
    if (accept_failing) LogInfo("HTTP accept works again");
    accept_failing = false;
    if (sessions.load() >= options.max_connections) {
      // Each connection holds a descriptor and memory; past the limit a new
      // one gets its answer at once (one small write to a fresh socket's
      // buffer, which cannot block) and is closed, read nothing.
      static const std::string kBusy = [] {
        const std::string body = OpenAiErrorBody(absl::UnavailableError(
            "too many connections are open (--http-max-connections); try again later"));
        return absl::StrCat("HTTP/1.1 503 Service Unavailable\r\nServer: ellm\r\nContent-Type: application/json\r\n",
                            "Connection: close\r\nRetry-After: 1\r\nContent-Length: ", body.size(), "\r\n\r\n", body);
      }();
      if (!refusing) LogWarning("HTTP: %d connections open (--http-max-connections); refusing new ones", sessions.load());
      refusing = true;
      beast::error_code ignored;
      socket.non_blocking(true, ignored);
      socket.write_some(net::buffer(kBusy), ignored);
      socket.shutdown(tcp::socket::shutdown_send, ignored);
      socket.close(ignored);
    } else {
      if (refusing) LogInfo("HTTP: connections below the limit again");
      refusing = false;
      std::make_shared<Session>(std::move(socket), this)->Start();
    }
    Accept();
  });
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpOptions& options,
                                                              const EllmService* service,
                                                              Scheduler* scheduler,
                                                              const Tokenizer* tokenizer) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->service = service;
  impl->scheduler = scheduler;
  impl->tokenizer = tokenizer;
  beast::error_code ec;
  const net::ip::address address = net::ip::make_address(options.host, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("bad HTTP host '", options.host, "': ", ec.message()));
  const tcp::endpoint endpoint(address, static_cast<unsigned short>(options.port));
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat("cannot listen for HTTP on ", options.host, ":", options.port, ": ",
                                               ec.message(), " (is another server using the port?)"));
  }
  impl->Accept();
  for (int i = 0; i < std::max(1, options.threads); ++i) {
    impl->threads.emplace_back([io = &impl->ioc] {
      // A handler that throws loses its own connection, never the I/O thread.
      for (;;) {
        try {
          io->run();
          return;
        } catch (const std::exception& e) {
          LogError("HTTP I/O thread: %s", e.what());
        }
      }
    });
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::~HttpServer() {
  net::post(impl_->ioc, [impl = impl_.get()] {
    beast::error_code ec;
    impl->acceptor.close(ec);
    impl->accept_retry.cancel();
  });
  impl_->ioc.stop();
  for (std::thread& t : impl_->threads) t.join();
  impl_->blocking.join();  // a /metrics render in flight finishes; its answer is dropped with ioc
  impl_->prepare.join();   // likewise a request being prepared
}

int HttpServer::port() const { return impl_->acceptor.local_endpoint().port(); }

int HttpServer::answering() const { return impl_->answering.load(); }

}  // namespace ellm::coord
