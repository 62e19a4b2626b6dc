// ellm: the command-line client.
//   ellm generate "prompt" [--max-tokens N --temperature T --top-p P --top-k K --seed S --stop S]
//   ellm tokenize "text"
//   ellm info
//   ellm health
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "core/args.h"
#include "proto/ellm.grpc.pb.h"
#include "proto/health.grpc.pb.h"

namespace ellm::launch {
namespace {

int Fail(const std::string& message) {
  std::fprintf(stderr, "ellm: %s\n", message.c_str());
  return 1;
}

int FailRpc(const grpc::Status& st, const std::string& server) {
  std::string hint;
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE && st.error_message().find("failed to connect") != std::string::npos) {
    hint = absl::StrCat(" (is ellm running? start it with launch/ellm-launch; server ", server, ")");
  }
  static constexpr const char* kCodes[] = {
      "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
      "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const int code = st.error_code();
  const std::string name = code >= 0 && code <= 16 ? kCodes[code] : absl::StrCat(code);
  return Fail(absl::StrCat(st.error_message(), " [", name, "]", hint));
}

const char* ReasonName(ellm::v1::FinishReason r) {
  switch (r) {
    case ellm::v1::FINISH_REASON_STOP_TOKEN: return "stop token";
    case ellm::v1::FINISH_REASON_MAX_TOKENS: return "max tokens";
    case ellm::v1::FINISH_REASON_STOP_STRING: return "stop string";
    case ellm::v1::FINISH_REASON_CONTEXT: return "context full";
    default: return "unspecified";
  }
}

// A conversation on stdin/stdout: each line is a user turn; the reply
// streams back and joins the history. Ctrl-D ends it.
int Chat(ellm::v1::Ellm::Stub* stub, const ellm::v1::GenerateRequest& base, const std::string& system,
         const std::string& server, const std::function<void(grpc::ClientContext*)>& authorize) {
  {
    // A model without a chat format ellm knows is told before the first turn.
    ellm::v1::ModelInfo info;
    grpc::ClientContext ctx;
    authorize(&ctx);
    const grpc::Status status = stub->GetModelInfo(&ctx, ellm::v1::GetModelInfoRequest(), &info);
    if (!status.ok()) return FailRpc(status, server);
    if (!info.chat()) return Fail(absl::StrCat("the model's chat template: ", info.chat_template()));
  }
  std::vector<std::pair<std::string, std::string>> history;
  if (!system.empty()) history.push_back({"system", system});
  std::string line;
  for (;;) {
    std::printf("> ");
    std::fflush(stdout);
    char buf[8192];
    if (std::fgets(buf, sizeof(buf), stdin) == nullptr) break;
    line = buf;
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    if (line.empty()) continue;
    history.push_back({"user", line});
    ellm::v1::GenerateRequest req = base;
    for (const auto& [role, content] : history) {
      ellm::v1::ChatMessage* m = req.add_messages();
      m->set_role(role);
      m->set_content(content);
    }
    grpc::ClientContext ctx;
    authorize(&ctx);
    auto reader = stub->Generate(&ctx, req);
    ellm::v1::GenerateResponse resp;
    std::string reply;
    while (reader->Read(&resp)) {
      reply += resp.text();
      std::fwrite(resp.text().data(), 1, resp.text().size(), stdout);
      std::fflush(stdout);
    }
    if (!reply.empty()) std::printf("\n");
    grpc::Status status = reader->Finish();
    if (!status.ok()) return FailRpc(status, server);
    history.push_back({"assistant", reply});
  }
  std::printf("\n");
  return 0;
}

int Main(int argc, char** argv) {
  Args args(
      "ellm: command-line client of an ellm server.\n\n"
      "Usage:\n"
      "  ellm generate \"prompt\" [flags]   stream generated text to stdout\n"
      "  ellm chat [--system TEXT]        chat on stdin/stdout with the model's chat template\n"
      "  ellm tokenize \"text\"             print token ids and pieces\n"
      "  ellm info                        print the served model\n"
      "  ellm health                      print SERVING / NOT_SERVING");
  args.Flag("server", "127.0.0.1:50051", "address of the ellm server");
  args.Flag("max-tokens", "", "tokens to generate (default: the server's, 128)");
  args.Flag("temperature", "", "0 = greedy (default 1)");
  args.Flag("top-p", "", "nucleus sampling, (0, 1] (default 1)");
  args.Flag("top-k", "0", "keep the k most likely tokens; 0 = off");
  args.Flag("min-p", "0", "keep the tokens at least this fraction as likely as the most likely one, [0, 1]; 0 = off");
  args.Flag("presence-penalty", "0", "subtract this from the logit of every token generated so far, [-2, 2]");
  args.Flag("frequency-penalty", "0", "subtract this from a token's logit for each time it was generated, [-2, 2]");
  args.Flag("repetition-penalty", "1", "divide the positive logits (multiply the negative ones) of the prompt's and "
            "the generated tokens by this, [0.01, 10]; 1: off");
  args.Flag("seed", "", "random seed: same seed, same output");
  args.Flag("stop", "", "stop when this string appears (not printed); give it again for more strings (up to 16)");
  args.Flag("min-tokens", "0", "generate at least this many tokens before one that ends the text may be sampled "
            "and before stop strings count");
  args.Flag("ignore-eos", "", "do not stop at the model's end-of-text tokens (run to --max-tokens)", true);
  args.Flag("no-bos", "", "do not prepend the BOS token", true);
  args.Flag("stats", "", "print token counts and timings to stderr at the end", true);
  args.Flag("system", "", "chat: the system message");
  args.Flag("api-key", "", "API key of the server (default: $ELLM_API_KEY)");
  args.Flag("tls-ca", "", "PEM certificate(s) to trust: talk TLS to a server started with --tls-cert");
  absl::Status st = args.Parse(argc, argv);
  if (args.help() || (st.ok() && args.positional().empty())) {
    std::printf("%s", args.HelpText().c_str());
    return args.help() ? 0 : 2;
  }
  if (!st.ok()) return Fail(std::string(st.message()));
  const std::string command = args.positional()[0];
  const std::string server = args.Get("server");
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!args.Get("tls-ca").empty()) {
    std::ifstream in(args.Get("tls-ca"));
    std::stringstream pem;
    pem << in.rdbuf();
    if (pem.str().empty()) return Fail("cannot read --tls-ca " + args.Get("tls-ca"));
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = pem.str();
    credentials = grpc::SslCredentials(ssl);
  }
  std::string api_key = args.Get("api-key");
  if (api_key.empty() && std::getenv("ELLM_API_KEY") != nullptr) api_key = std::getenv("ELLM_API_KEY");
  // Every call carries the API key (when there is one).
  auto authorize = [&api_key](grpc::ClientContext* ctx) {
    if (!api_key.empty()) ctx->AddMetadata("authorization", "Bearer " + api_key);
  };
  auto channel = grpc::CreateChannel(server, credentials);
  auto stub = ellm::v1::Ellm::NewStub(channel);

  if (command == "generate" || command == "chat") {
    if (command == "generate" && args.positional().size() != 2) {
      return Fail("usage: ellm generate \"prompt\" [flags]");
    }
    ellm::v1::GenerateRequest req;
    if (command == "generate") req.set_prompt(args.positional()[1]);
    if (args.IsSet("max-tokens")) {
      absl::StatusOr<int> v = args.GetInt("max-tokens");
      if (!v.ok()) return Fail(std::string(v.status().message()));
      req.set_max_tokens(*v);
    }
    if (args.IsSet("temperature")) {
      absl::StatusOr<double> v = args.GetDouble("temperature");
      if (!v.ok()) return Fail(std::string(v.status().message()));
      req.mutable_sampling()->set_temperature(static_cast<float>(*v));
    }
    if (args.IsSet("top-p")) {
      absl::StatusOr<double> v = args.GetDouble("top-p");
      if (!v.ok()) return Fail(std::string(v.status().message()));
      req.mutable_sampling()->set_top_p(static_cast<float>(*v));
    }
    absl::StatusOr<int> top_k = args.GetInt("top-k");
    if (!top_k.ok()) return Fail(std::string(top_k.status().message()));
    req.mutable_sampling()->set_top_k(*top_k);
    absl::StatusOr<double> min_p = args.GetDouble("min-p");
    if (!min_p.ok()) return Fail(std::string(min_p.status().message()));
    req.mutable_sampling()->set_min_p(static_cast<float>(*min_p));
    absl::StatusOr<double> presence = args.GetDouble("presence-penalty");
    if (!presence.ok()) return Fail(std::string(presence.status().message()));
    req.mutable_sampling()->set_presence_penalty(static_cast<float>(*presence));
    absl::StatusOr<double> frequency = args.GetDouble("frequency-penalty");
    if (!frequency.ok()) return Fail(std::string(frequency.status().message()));
    req.mutable_sampling()->set_frequency_penalty(static_cast<float>(*frequency));
    absl::StatusOr<double> repetition = args.GetDouble("repetition-penalty");
    if (!repetition.ok()) return Fail(std::string(repetition.status().message()));
    if (*repetition != 1) req.mutable_sampling()->set_repetition_penalty(static_cast<float>(*repetition));
    if (args.IsSet("seed")) {
      absl::StatusOr<uint64_t> v = args.GetUint64("seed");
      if (!v.ok()) return Fail(std::string(v.status().message()));
      req.mutable_sampling()->set_seed(*v);
    }
    for (const std::string& stop : args.GetAll("stop")) req.add_stop(stop);
    absl::StatusOr<int> min_tokens = args.GetInt("min-tokens");
    if (!min_tokens.ok()) return Fail(std::string(min_tokens.status().message()));
    req.set_min_tokens(*min_tokens);
    req.set_ignore_eos(args.GetBool("ignore-eos"));
    if (args.GetBool("no-bos")) req.set_add_bos(false);
    if (command == "chat") return Chat(stub.get(), req, args.Get("system"), server, authorize);
    grpc::ClientContext ctx;
    authorize(&ctx);
    auto reader = stub->Generate(&ctx, req);
    ellm::v1::GenerateResponse resp;
    ellm::v1::Finish finish;
    bool finished = false, wrote = false;
    while (reader->Read(&resp)) {
      wrote = wrote || !resp.text().empty();
      std::fwrite(resp.text().data(), 1, resp.text().size(), stdout);
      std::fflush(stdout);
      if (resp.has_finish()) {
        finish = resp.finish();
        finished = true;
      }
    }
    grpc::Status status = reader->Finish();
    if (wrote) std::printf("\n");
    std::fflush(stdout);
    if (!status.ok()) return FailRpc(status, server);
    if (finished && args.GetBool("stats")) {
      std::fprintf(stderr,
                   "[%s; %d prompt tokens (%d from the prefix cache) + %d generated; first token %.1f ms; "
                   "%.2f ms/token]\n",
                   ReasonName(finish.reason()), finish.prompt_tokens(), finish.cached_tokens(),
                   finish.completion_tokens(), finish.time_to_first_token_ms(), finish.decode_ms_per_token());
    }
    return 0;
  }
  if (command == "tokenize") {
    if (args.positional().size() != 2) return Fail("usage: ellm tokenize \"text\"");
    ellm::v1::TokenizeRequest req;
    req.set_text(args.positional()[1]);
    if (args.GetBool("no-bos")) req.set_add_bos(false);
    ellm::v1::TokenizeResponse resp;
    grpc::ClientContext ctx;
    authorize(&ctx);
    grpc::Status status = stub->Tokenize(&ctx, req, &resp);
    if (!status.ok()) return FailRpc(status, server);
    for (int i = 0; i < resp.token_ids_size(); ++i) {
      std::printf("%d\t'%s'\n", resp.token_ids(i), resp.pieces(i).c_str());
    }
    return 0;
  }
  if (command == "info") {
    ellm::v1::ModelInfo info;
    grpc::ClientContext ctx;
    authorize(&ctx);
    grpc::Status status = stub->GetModelInfo(&ctx, ellm::v1::GetModelInfoRequest(), &info);
    if (!status.ok()) return FailRpc(status, server);
    // Every field, also those at their default (false, 0), which
    // DebugString leaves out.
    google::protobuf::util::JsonPrintOptions options;
    options.add_whitespace = true;
    options.always_print_primitive_fields = true;
    options.preserve_proto_field_names = true;
    std::string text;
    if (!google::protobuf::util::MessageToJsonString(info, &text, options).ok()) text = info.DebugString();
    std::printf("%s", text.c_str());
    return 0;
  }
  if (command == "health") {
    auto health = grpc::health::v1::Health::NewStub(channel);
    grpc::ClientContext ctx;
    authorize(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status status = health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp);
    if (!status.ok()) return FailRpc(status, server);
    std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()).c_str());
    return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
  }
  return Fail(absl::StrCat("unknown command '", command, "' (see --help)"));
}

}  // namespace
}  // namespace ellm::launch

int main(int argc, char** argv) { return ellm::launch::Main(argc, argv); }
