// The OpenAI-compatible HTTP front, /metrics and gRPC reflection, end to end
// on the real processes, through a real HTTP client (Boost.Beast): streaming
// and non-streaming completions and chat, SSE framing, usage, stop strings,
// logprobs, n choices sharing one prefill, every error status, a client that
// disconnects mid-stream, 32 concurrent streams each equal to its solo run,
// and the service list a reflection client sees.
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/integration_harness.h"
#include "tests/proto/reflection_list.grpc.pb.h"
#include "tests/tests_util.h"

namespace ellm {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using json = nlohmann::json;
using namespace ellm::testing;  // NOLINT: the harness

const std::string kStories = ELLM_MODELS_DIR "/stories260K.gguf";

struct HttpResult {
  int status = 0;
  std::string content_type;
  std::string body;
  std::string retry_after;  // last: HttpResult{status, type, body} is written below
  json Json() const { return json::parse(body, nullptr, false); }
};

HttpResult Call(int port, http::verb method, const std::string& target, const std::string& body = "",
                const std::string& api_key = "") {
  net::io_context ioc;
  tcp::socket socket(ioc);
  socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
  http::request<http::string_body> req(method, target, 11);
  req.set(http::field::host, "127.0.0.1");
  if (!body.empty()) req.set(http::field::content_type, "application/json");
  if (!api_key.empty()) req.set(http::field::authorization, "Bearer " + api_key);
  req.body() = body;
  req.prepare_payload();
  beast::error_code write_ec;
  http::write(socket, req, write_ec);  // a server that refuses a body answers before reading it all
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(64 << 20);
  beast::error_code ec;
  http::read(socket, buffer, parser, ec);
  HttpResult r;
  if (ec) return r;
  r.status = parser.get().result_int();
  r.content_type = std::string(parser.get()[http::field::content_type]);
  r.retry_after = std::string(parser.get()[http::field::retry_after]);
  r.body = parser.get().body();
  return r;
}

HttpResult Post(int port, const std::string& target, const json& body, const std::string& key = "") {
  return Call(port, http::verb::post, target, body.dump(), key);
}

// The "data: " payloads of an SSE body, in order; every event must be a
// "data: ..." line followed by a blank line.
std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  for (absl::string_view event : absl::StrSplit(body, "\n\n", absl::SkipEmpty())) {
    EXPECT_TRUE(absl::StartsWith(event, "data: ")) << "not an SSE data line: " << event;
    out.emplace_back(event.substr(6));
  }
  EXPECT_TRUE(absl::EndsWith(body, "\n\n"));
  return out;
}

// Text of a streamed completion (and its finish reason, usage chunk).
struct Streamed {
  std::string text;
  std::string finish_reason;
  json usage;
  int chunks = 0;
};
Streamed Collect(const HttpResult& r, bool chat) {
  Streamed s;
  const std::vector<std::string> data = SseData(r.body);
  EXPECT_FALSE(data.empty());
  EXPECT_EQ(data.back(), "[DONE]");
  for (size_t i = 0; i + 1 < data.size(); ++i) {
    const json j = json::parse(data[i], nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << data[i];
    EXPECT_EQ(j["object"], chat ? "chat.completion.chunk" : "text_completion");
    if (j.contains("usage") && !j["usage"].is_null()) s.usage = j["usage"];
    if (j["choices"].empty()) continue;
    const json& c = j["choices"][0];
    if (chat) {
      if (c["delta"].contains("content")) s.text += c["delta"]["content"].get<std::string>();
    } else {
      s.text += c["text"].get<std::string>();
    }
    if (!c["finish_reason"].is_null()) s.finish_reason = c["finish_reason"];
    ++s.chunks;
  }
  return s;
}

// Sends a POST /v1/completions on an open (kept-alive) connection.
void WriteCompletion(tcp::socket& socket, const json& body) {
  http::request<http::string_body> req(http::verb::post, "/v1/completions", 11);
  req.set(http::field::host, "127.0.0.1");
  req.set(http::field::content_type, "application/json");
  req.body() = body.dump();
  req.prepare_payload();
  http::write(socket, req);
}

json Completion(const std::string& prompt, int max_tokens, bool stream) {
  return {{"model", "llama"}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"stream", stream}};
}

// A /metrics exposition's samples: "name{labels}" -> value.
std::map<std::string, double> Samples(const std::string& exposition) {
  std::map<std::string, double> samples;
  for (absl::string_view line : absl::StrSplit(exposition, '\n', absl::SkipEmpty())) {
    if (line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    EXPECT_NE(space, absl::string_view::npos) << line;
    if (space == absl::string_view::npos) continue;
    samples[std::string(line.substr(0, space))] = std::stod(std::string(line.substr(space + 1)));
  }
  return samples;
}

// Waits (up to 200 polls) until /metrics shows `running` requests in the
// batch and `waiting` in the queue.
bool WaitForQueue(int port, int running, int waiting) {
  for (int i = 0; i < 200; ++i) {
    const HttpResult m = Call(port, http::verb::get, "/metrics");
    if (m.status == 200) {
      std::map<std::string, double> s = Samples(m.body);
      if (s["ellm_requests_running"] == running && s["ellm_requests_waiting"] == waiting) return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

TEST(Http, CompletionsStreamingAndNotAgreeWithGrpc) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=2", "--no-numactl"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  const Generated grpc_answer = Generate(system.stub(), Greedy("Once upon a time", 40));
  ASSERT_TRUE(grpc_answer.status.ok());

  HttpResult r = Post(port, "/v1/completions", Completion("Once upon a time", 40, false));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.content_type, "application/json");
  json j = r.Json();
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "llama");
  EXPECT_EQ(j["choices"][0]["text"], grpc_answer.text);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(j["usage"]["completion_tokens"], 40);
  EXPECT_EQ(j["usage"]["total_tokens"], 45);
  EXPECT_TRUE(j["usage"]["prompt_tokens_details"].contains("cached_tokens"));
  // A prompt of token ids (a list, or a list of one list) is the same prompt.
  ellm::v1::TokenizeRequest treq;
  treq.set_text("Once upon a time");
  ellm::v1::TokenizeResponse ids;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(system.stub()->Tokenize(&ctx, treq, &ids).ok());
  }
  {
    // Text and messages at once: which one to show is not guessed.
    ellm::v1::TokenizeRequest both = treq;
    auto* m = both.add_messages();
    m->set_role("user");
    m->set_content("hi");
    ellm::v1::TokenizeResponse ignored;
    grpc::ClientContext ctx;
    const grpc::Status st = system.stub()->Tokenize(&ctx, both, &ignored);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("not both"), std::string::npos) << st.error_message();
  }
  const json id_list(std::vector<int32_t>(ids.token_ids().begin(), ids.token_ids().end()));
  for (const json& prompt : {id_list, json::array({id_list})}) {
    json id_req = Completion("", 40, false);
    id_req["prompt"] = prompt;
    j = Post(port, "/v1/completions", id_req).Json();
    EXPECT_EQ(j["choices"][0]["text"], grpc_answer.text) << prompt;
    EXPECT_EQ(j["usage"]["prompt_tokens"], 5);
  }

  json stream_req = Completion("Once upon a time", 40, true);
  stream_req["stream_options"] = {{"include_usage", true}};
  r = Post(port, "/v1/completions", stream_req);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.content_type, "text/event-stream");
  const Streamed s = Collect(r, false);
  EXPECT_EQ(s.text, grpc_answer.text);
  EXPECT_EQ(s.finish_reason, "length");
  EXPECT_GT(s.chunks, 10);  // streamed, not in one piece
  EXPECT_EQ(s.usage["completion_tokens"], 40);

  // logit_bias: -100 on the greedy answer's first token makes the first
  // token the runner-up of its raw top 2 (the logprobs stay raw); +100 on a
  // token makes every token that one.
  {
    json top_req = Completion("Once upon a time", 1, false);
    top_req["logprobs"] = 2;
    const json greedy = Post(port, "/v1/completions", top_req).Json()["choices"][0]["logprobs"];
    const json top = greedy["top_logprobs"][0];
    ASSERT_EQ(top.size(), 2u) << top;
    json banned = Completion("Once upon a time", 1, false);
    banned["logit_bias"] = {{std::to_string(grpc_answer.tokens[0]), -100}};
    banned["logprobs"] = 2;
    const json b = Post(port, "/v1/completions", banned).Json()["choices"][0];
    const std::string first = b["logprobs"]["tokens"][0];
    EXPECT_TRUE(top.contains(first) && first != greedy["tokens"][0]) << b << " " << top;
    EXPECT_FLOAT_EQ(b["logprobs"]["token_logprobs"][0].get<float>(), top[first].get<float>()) << "raw logprob";
    json forced = Completion("Once upon a time", 6, false);
    forced["logit_bias"] = {{"400", 100}};
    forced["logprobs"] = 0;
    const json f = Post(port, "/v1/completions", forced).Json()["choices"][0]["logprobs"]["tokens"];
    ASSERT_EQ(f.size(), 6u);
    for (const json& t : f) EXPECT_EQ(t, f[0]) << f;
    for (const auto& [bias, status] : std::vector<std::pair<json, int>>{{{{"512", 1}}, 400}, {{{"-1", 1}}, 400},
                                                                       {{{"x", 1}}, 400}, {{{"5", 101}}, 400},
                                                                       {{{"05", 1}}, 400},
                                                                       {{{"5", "1"}}, 400}, {json::array(), 400}}) {
      json bad = Completion("Once", 2, false);
      bad["logit_bias"] = bias;
      const HttpResult r = Post(port, "/v1/completions", bad);
      EXPECT_EQ(r.status, status) << bias << " " << r.body;
      EXPECT_NE(r.body.find("logit_bias"), std::string::npos) << r.body;
    }
  }

  // vLLM's stop_token_ids, ignore_eos and min_tokens. The greedy answer's
  // 6th token as a stop token id ends it there (its text dropped, or kept
  // with include_stop_str_in_output; streamed or not); with min_tokens 6 it
  // is banned until token 7, so the 6th token differs from the greedy one.
  // With EOS biased, ignore_eos runs on.
  {
    json six_req = Completion("Once upon a time", 6, false);
    six_req["logprobs"] = 0;
    const json six = Post(port, "/v1/completions", six_req).Json()["choices"][0];
    ASSERT_EQ(six["logprobs"]["tokens"].size(), 6u) << six;
    const json five = Post(port, "/v1/completions", Completion("Once upon a time", 5, false)).Json()["choices"][0];
    ASSERT_NE(five["text"], six["text"]);
    for (const bool stream : {false, true}) {
      for (const bool include : {false, true}) {
        json stop_id = Completion("Once upon a time", 40, stream);
        stop_id["stop_token_ids"] = {grpc_answer.tokens[5]};
        if (include) stop_id["include_stop_str_in_output"] = true;
        const HttpResult sr = Post(port, "/v1/completions", stop_id);
        ASSERT_EQ(sr.status, 200) << sr.body;
        const json& expected = include ? six["text"] : five["text"];
        if (stream) {
          const Streamed st = Collect(sr, false);
          EXPECT_EQ(st.finish_reason, "stop");
          EXPECT_EQ(st.text, expected) << include;
        } else {
          EXPECT_EQ(sr.Json()["choices"][0]["finish_reason"], "stop");
          EXPECT_EQ(sr.Json()["choices"][0]["text"], expected) << include;
          EXPECT_EQ(sr.Json()["usage"]["completion_tokens"], 6);
        }
      }
    }
    json late = Completion("Once upon a time", 8, false);
    late["stop_token_ids"] = {grpc_answer.tokens[5]};
    late["min_tokens"] = 6;
    late["logprobs"] = 0;
    const json l = Post(port, "/v1/completions", late).Json()["choices"][0];
    ASSERT_EQ(l["logprobs"]["tokens"].size(), 8u) << l;
    EXPECT_EQ(l["finish_reason"], "length") << l;
    for (int i = 0; i < 5; ++i) EXPECT_EQ(l["logprobs"]["tokens"][i], six["logprobs"]["tokens"][i]) << l;
    EXPECT_NE(l["logprobs"]["tokens"][5], six["logprobs"]["tokens"][5]) << l;
    json on = Completion("Once upon a time", 30, false);
    on["logit_bias"] = {{"2", 30}};
    on["ignore_eos"] = true;
    const json o = Post(port, "/v1/completions", on).Json();
    EXPECT_EQ(o["choices"][0]["finish_reason"], "length") << o;
    EXPECT_EQ(o["usage"]["completion_tokens"], 30);
    on.erase("ignore_eos");
    EXPECT_EQ(Post(port, "/v1/completions", on).Json()["choices"][0]["finish_reason"], "stop");
  }

  // echo: the prompt's text, then the answer's.
  json echo_req = Completion("Once upon a time", 40, false);
  echo_req["echo"] = true;
  EXPECT_EQ(Post(port, "/v1/completions", echo_req).Json()["choices"][0]["text"], "Once upon a time" + grpc_answer.text);
  // With logprobs, the prompt's tokens come first, scored as gRPC's
  // prompt_logprobs scores them (the first null), streamed or not.
  {
    ellm::v1::GenerateRequest scored = Greedy("Once upon a time", 3);
    scored.set_prompt_logprobs(true);
    const Generated g = Generate(system.stub(), scored);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    ASSERT_EQ(g.prompt_logprobs.size(), 4u);
    for (const bool stream : {false, true}) {
      json req = Completion("Once upon a time", 3, stream);
      req["echo"] = true;
      req["logprobs"] = 1;
      const HttpResult er = Post(port, "/v1/completions", req);
      ASSERT_EQ(er.status, 200) << er.body;
      json lp;
      if (stream) {
        lp = {{"tokens", json::array()}, {"token_logprobs", json::array()}, {"text_offset", json::array()}};
        for (size_t at = er.body.find("data: {"); at != std::string::npos; at = er.body.find("data: {", at + 1)) {
          const json chunk = json::parse(er.body.substr(at + 6, er.body.find("\n\n", at) - at - 6));
          if (chunk["choices"].empty() || chunk["choices"][0]["logprobs"].is_null()) continue;
          for (const char* key : {"tokens", "token_logprobs", "text_offset"}) {
            for (const json& v : chunk["choices"][0]["logprobs"][key]) lp[key].push_back(v);
          }
        }
      } else {
        lp = er.Json()["choices"][0]["logprobs"];
        EXPECT_EQ(er.Json()["choices"][0]["text"].get<std::string>().rfind("Once upon a time", 0), 0u);
      }
      ASSERT_EQ(lp["tokens"].size(), 8u) << lp;  // 5 prompt tokens (BOS first), 3 generated
      EXPECT_TRUE(lp["token_logprobs"][0].is_null()) << lp;
      for (int i = 1; i < 5; ++i) EXPECT_FLOAT_EQ(lp["token_logprobs"][i].get<float>(), g.prompt_logprobs[i - 1]) << lp;
      for (int i = 0; i < 3; ++i) EXPECT_FLOAT_EQ(lp["token_logprobs"][5 + i].get<float>(), grpc_answer.logprobs[i]);
      EXPECT_EQ(lp["text_offset"][1], 0) << lp;
    }
    // max_tokens 0 (vLLM's prompt-only scoring): the prompt alone.
    for (const bool stream : {false, true}) {
      json req = Completion("Once upon a time", 0, stream);
      req["echo"] = true;
      req["logprobs"] = 1;
      req["stream_options"] = {{"include_usage", stream}};
      const HttpResult er = Post(port, "/v1/completions", req);
      ASSERT_EQ(er.status, 200) << er.body;
      std::string text, finish;
      json lp = {{"tokens", json::array()}, {"token_logprobs", json::array()}}, usage;
      const std::vector<std::string> data = stream ? SseData(er.body) : std::vector<std::string>{er.body};
      for (const std::string& d : data) {
        if (d == "[DONE]") continue;
        const json chunk = json::parse(d);
        if (chunk.contains("usage") && !chunk["usage"].is_null()) usage = chunk["usage"];
        if (chunk["choices"].empty()) continue;
        const json& c = chunk["choices"][0];
        text += c["text"].get<std::string>();
        if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
        if (c["logprobs"].is_null()) continue;
        for (const char* key : {"tokens", "token_logprobs"}) {
          for (const json& v : c["logprobs"][key]) lp[key].push_back(v);
        }
      }
      EXPECT_EQ(text, "Once upon a time") << er.body;
      EXPECT_EQ(finish, "length");
      ASSERT_EQ(lp["tokens"].size(), 5u) << lp;
      for (int i = 1; i < 5; ++i) EXPECT_FLOAT_EQ(lp["token_logprobs"][i].get<float>(), g.prompt_logprobs[i - 1]);
      EXPECT_EQ(usage["completion_tokens"], 0) << er.body;
      EXPECT_EQ(usage["prompt_tokens"], 5) << er.body;
    }
    json no_echo = Completion("Once upon a time", 0, false);
    const HttpResult ne = Post(port, "/v1/completions", no_echo);
    EXPECT_EQ(ne.status, 400) << ne.body;
    EXPECT_NE(ne.body.find("'max_tokens' must be positive"), std::string::npos) << ne.body;
  }

  // min_p reaches the sampler in the MLP worker: at 1 it keeps only the
  // most likely token, so a hot sampled request is the greedy answer (and
  // the same request without it is not).
  json hot = Completion("Once upon a time", 40, false);
  hot["temperature"] = 2;
  hot["seed"] = 7;
  EXPECT_NE(Post(port, "/v1/completions", hot).Json()["choices"][0]["text"], grpc_answer.text) << "the premise";
  hot["min_p"] = 1;
  EXPECT_EQ(Post(port, "/v1/completions", hot).Json()["choices"][0]["text"], grpc_answer.text);

  // Penalties, checked from what the API returns: each greedy pick is the
  // most likely of the raw top 20 once every token's logprob has lost
  // presence + frequency x (its count so far) -- and beats the 20th's raw
  // logprob, which bounds every token outside the list.
  {
    ellm::v1::GenerateRequest req = Greedy("Once upon a time", 60);
    req.mutable_sampling()->set_presence_penalty(0.6f);
    req.mutable_sampling()->set_frequency_penalty(0.4f);
    req.set_top_logprobs(20);
    const Generated g = Generate(system.stub(), req);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    ASSERT_EQ(g.tokens.size(), 60u);
    EXPECT_NE(g.text, Generate(system.stub(), Greedy("Once upon a time", 60)).text) << "the premise: they change it";
    std::map<int32_t, int> counts;
    for (size_t i = 0; i < g.tokens.size(); ++i) {
      const ellm::v1::TopLogprobs& top = g.top_logprobs[i];
      ASSERT_EQ(top.token_ids_size(), 20);
      int32_t best = -1;
      float best_value = -INFINITY;
      for (int j = 0; j < 20; ++j) {
        const auto it = counts.find(top.token_ids(j));
        const int c = it == counts.end() ? 0 : it->second;
        const float v = top.logprobs(j) - (c > 0 ? 0.6f + 0.4f * c : 0.0f);
        if (v > best_value + 1e-4f) best = top.token_ids(j), best_value = v;
      }
      ASSERT_GT(best_value, top.logprobs(19)) << "token " << i << ": the pick may lie outside the top 20";
      EXPECT_EQ(g.tokens[i], best) << "token " << i;
      ++counts[g.tokens[i]];
    }
  }

  // Stop strings: the text ends before the stop, finish_reason stop.
  json stop_req = Completion("Once upon a time", 100, false);
  stop_req["stop"] = json::array({"Lily", "zzz"});
  j = Post(port, "/v1/completions", stop_req).Json();
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][0]["text"], grpc_answer.text.substr(0, grpc_answer.text.find("Lily")));
  // Logprobs: the chosen token's, as the gRPC API gives them, and (logprobs
  // = 3) the three most likely with it, as gRPC's top_logprobs name them.
  ellm::v1::GenerateRequest top_req = Greedy("Once upon a time", 8);
  top_req.set_top_logprobs(3);
  const Generated grpc_top = Generate(system.stub(), top_req);
  ASSERT_TRUE(grpc_top.status.ok());
  ASSERT_EQ(grpc_top.top_logprobs.size(), 8u);
  EXPECT_EQ(grpc_top.tokens, std::vector<int32_t>(grpc_answer.tokens.begin(), grpc_answer.tokens.begin() + 8));
  json lp_req = Completion("Once upon a time", 8, false);
  lp_req["logprobs"] = 3;
  j = Post(port, "/v1/completions", lp_req).Json();
  const json& lp = j["choices"][0]["logprobs"];
  ASSERT_EQ(lp["token_logprobs"].size(), 8u);
  ASSERT_EQ(lp["top_logprobs"].size(), 8u);
  int64_t offset = 0;
  for (int i = 0; i < 8; ++i) {
    EXPECT_FLOAT_EQ(lp["token_logprobs"][i].get<float>(), grpc_answer.logprobs[i]);
    // Greedy: the chosen token is the best of the three.
    const json& top = lp["top_logprobs"][i];
    EXPECT_EQ(top.size(), 3u) << top;
    float best = -1e30f;
    for (const auto& [piece, value] : top.items()) best = std::max(best, value.get<float>());
    EXPECT_FLOAT_EQ(top[lp["tokens"][i].get<std::string>()].get<float>(), best);
    for (int k = 0; k < 3; ++k) {
      bool found = false;
      for (const auto& [piece, value] : top.items()) found |= value.get<float>() == grpc_top.top_logprobs[i].logprobs(k);
      EXPECT_TRUE(found) << "alternative " << k << " of token " << i << ": " << top;
    }
    EXPECT_EQ(lp["text_offset"][i].get<int64_t>(), offset);
    offset += static_cast<int64_t>(lp["tokens"][i].get<std::string>().size());
  }
  // The tokens spell the text, the first one too (it follows the prompt's
  // last token: a word-start space is part of it).
  for (const char* prompt : {"Once upon a time", "Once upon a time there was a"}) {
    json spell_req = Completion(prompt, 8, false);
    spell_req["logprobs"] = 0;
    const json spell = Post(port, "/v1/completions", spell_req).Json();
    std::string spelled;
    for (const json& t : spell["choices"][0]["logprobs"]["tokens"]) spelled += t.get<std::string>();
    EXPECT_EQ(spelled, spell["choices"][0]["text"].get<std::string>()) << prompt;
    if (std::string(prompt) != "Once upon a time") {
      EXPECT_EQ(spelled[0], ' ') << "a word follows the prompt";
    }
  }
  // /v1/models and /health.
  j = Call(port, http::verb::get, "/v1/models").Json();
  EXPECT_EQ(j["data"][0]["id"], "llama");
  EXPECT_EQ(Call(port, http::verb::get, "/health").status, 200);
  ExpectCleanShutdown(system);
}

// n choices: choice i is the answer the same request with seed + i gives
// alone; streamed or not, every choice comes under its index with its own
// finish, the usage counts the prompt once, and one [DONE] ends the stream.
// With the prefix cache (on by default) the prompt is prefilled once: the
// other choices find its whole blocks cached. Off, the choices run at once.
TEST(Http, ChoicesAreTheirSeedsAnswersAndShareOnePrefill) {
  const std::string prompt =
      "Once upon a time there was a little girl named Lily. She loved to play outside in the park with her "
      "friends. One day, she saw a big red ball under a tall tree. She ran to get it, but a big dog was there too.";
  for (bool cache : {true, false}) {
    // Steps of 32 tokens: the prompt takes choice 0 several steps, so choices
    // submitted with it would prefill alongside it instead of finding it.
    std::vector<std::string> args = {"--model=" + kStories, "--no-numactl", "--max-step-tokens=32"};
    if (!cache) args.push_back("--no-prefix-cache");
    EllmSystem system(args);
    ASSERT_TRUE(system.ready()) << system.Log();
    const int port = system.http_port();
    ellm::v1::ModelInfo info;
    {
      grpc::ClientContext ctx;
      ASSERT_TRUE(system.stub()->GetModelInfo(&ctx, ellm::v1::GetModelInfoRequest(), &info).ok());
    }
    json req = {{"model", "llama"}, {"prompt", prompt}, {"max_tokens", 24}, {"temperature", 1.0}, {"seed", 11}, {"n", 3}};
    std::map<std::string, double> before = Samples(Call(port, http::verb::get, "/metrics").body);
    const HttpResult r = Post(port, "/v1/completions", req);
    ASSERT_EQ(r.status, 200) << r.body;
    std::map<std::string, double> after = Samples(Call(port, http::verb::get, "/metrics").body);
    const json j = r.Json();
    ASSERT_EQ(j["choices"].size(), 3u) << j;
    const int prompt_tokens = j["usage"]["prompt_tokens"];
    ASSERT_GT(prompt_tokens, 3 * info.kv_block_tokens()) << "the premise: a prompt of several blocks";
    const double cached = after["ellm_cached_prompt_tokens_total"] - before["ellm_cached_prompt_tokens_total"];
    if (cache) {
      EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0) << "choice 0 prefilled it";
      EXPECT_GE(cached, 2 * (prompt_tokens / info.kv_block_tokens()) * info.kv_block_tokens())
          << "choices 1 and 2 prefilled the prompt again";
    } else {
      EXPECT_EQ(cached, 0);
    }
    std::set<std::string> texts;
    int completion = 0;
    for (int i = 0; i < 3; ++i) {
      const json& choice = j["choices"][i];
      EXPECT_EQ(choice["index"], i);
      json alone = req;
      alone.erase("n");
      alone["seed"] = 11 + i;
      const json a = Post(port, "/v1/completions", alone).Json();
      EXPECT_EQ(choice["text"], a["choices"][0]["text"]) << "choice " << i << " (cache " << cache << ")";
      EXPECT_EQ(choice["finish_reason"], a["choices"][0]["finish_reason"]) << i;
      completion += a["usage"]["completion_tokens"].get<int>();
      texts.insert(choice["text"].get<std::string>());
    }
    EXPECT_EQ(texts.size(), 3u) << "the premise: three seeds, three answers";
    EXPECT_EQ(j["usage"]["completion_tokens"], completion);
    EXPECT_EQ(j["usage"]["total_tokens"], prompt_tokens + completion);

    // Streamed: the same choices, each chunk under its index.
    json stream_req = req;
    stream_req["stream"] = true;
    stream_req["stream_options"] = {{"include_usage", true}};
    const HttpResult s = Post(port, "/v1/completions", stream_req);
    ASSERT_EQ(s.status, 200) << s.body;
    const std::vector<std::string> data = SseData(s.body);
    ASSERT_GE(data.size(), 3u);
    EXPECT_EQ(data.back(), "[DONE]");
    std::vector<std::string> text(3), finish(3);
    int finishes = 0, usages = 0;
    for (size_t i = 0; i + 1 < data.size(); ++i) {
      const json c = json::parse(data[i], nullptr, false);
      ASSERT_FALSE(c.is_discarded()) << data[i];
      if (c.contains("usage")) {
        ++usages;
        EXPECT_EQ(finishes, 3) << "usage before every choice finished";
        EXPECT_EQ(c["usage"]["completion_tokens"], completion);
        EXPECT_EQ(c["usage"]["prompt_tokens"], prompt_tokens);
        continue;
      }
      ASSERT_EQ(c["choices"].size(), 1u) << data[i];
      const int index = c["choices"][0]["index"];
      ASSERT_TRUE(index >= 0 && index < 3) << data[i];
      EXPECT_TRUE(finish[index].empty()) << "a chunk of choice " << index << " after its finish";
      text[index] += c["choices"][0]["text"].get<std::string>();
      if (!c["choices"][0]["finish_reason"].is_null()) {
        finish[index] = c["choices"][0]["finish_reason"];
        ++finishes;
      }
    }
    EXPECT_EQ(usages, 1);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(text[i], j["choices"][i]["text"]) << i;
      EXPECT_EQ(finish[i], j["choices"][i]["finish_reason"]) << i;
    }
    // Greedy, every choice is the greedy answer.
    json greedy = Completion(prompt, 16, false);
    greedy["n"] = 2;
    const json g = Post(port, "/v1/completions", greedy).Json();
    ASSERT_EQ(g["choices"].size(), 2u) << g;
    EXPECT_EQ(g["choices"][0]["text"], Post(port, "/v1/completions", Completion(prompt, 16, false)).Json()["choices"][0]["text"]);
    EXPECT_EQ(g["choices"][1]["text"], g["choices"][0]["text"]);
    ExpectCleanShutdown(system);
  }
}

// A list of prompts (OpenAI's batch): prompt k's choice i (index k n + i)
// is the answer the request gives for that prompt alone with seed + i,
// streamed or not; usage counts each prompt once. A bad prompt in the list
// refuses the whole request, naming it; a batch the queue could never hold
// is a 400.
TEST(Http, AListOfPromptsIsAnsweredAsEachAlone) {
  EllmSystem system({"--model=" + kStories, "--no-numactl", "--max-step-tokens=32", "--max-queue=8"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  const json prompts = {"Once upon a time", "The little dog", json::array({1, 400, 401, 402})};
  json req = {{"prompt", prompts}, {"max_tokens", 12}, {"temperature", 1.0}, {"seed", 11}, {"n", 2}, {"echo", true}};
  const HttpResult r = Post(port, "/v1/completions", req);
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = r.Json();
  ASSERT_EQ(j["choices"].size(), 6u) << j;
  int prompt_tokens = 0, completion = 0;
  std::set<std::string> texts;
  for (int k = 0; k < 3; ++k) {
    for (int i = 0; i < 2; ++i) {
      const json& choice = j["choices"][2 * k + i];
      EXPECT_EQ(choice["index"], 2 * k + i);
      json alone = req;
      alone.erase("n");
      alone["prompt"] = prompts[k];
      alone["seed"] = 11 + i;
      const json a = Post(port, "/v1/completions", alone).Json();
      EXPECT_EQ(choice["text"], a["choices"][0]["text"]) << "prompt " << k << " choice " << i;
      EXPECT_EQ(choice["finish_reason"], a["choices"][0]["finish_reason"]);
      if (i == 0) prompt_tokens += a["usage"]["prompt_tokens"].get<int>();
      completion += a["usage"]["completion_tokens"].get<int>();
      texts.insert(choice["text"].get<std::string>());
    }
  }
  EXPECT_EQ(texts.size(), 6u) << "the premise: six different answers";
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(j["usage"]["completion_tokens"], completion);
  json stream_req = req;
  stream_req["stream"] = true;
  const HttpResult s = Post(port, "/v1/completions", stream_req);
  ASSERT_EQ(s.status, 200) << s.body;
  const std::vector<std::string> data = SseData(s.body);
  ASSERT_FALSE(data.empty());
  EXPECT_EQ(data.back(), "[DONE]");
  std::vector<std::string> text(6);
  for (size_t i = 0; i + 1 < data.size(); ++i) {
    const json c = json::parse(data[i]);
    const int index = c["choices"][0]["index"];
    ASSERT_TRUE(index >= 0 && index < 6) << data[i];
    text[index] += c["choices"][0]["text"].get<std::string>();
  }
  for (int c = 0; c < 6; ++c) EXPECT_EQ(text[c], j["choices"][c]["text"]) << c;
  json bad = req;
  bad["prompt"] = {"Once", json::array({1, 512})};
  const HttpResult b = Post(port, "/v1/completions", bad);
  EXPECT_EQ(b.status, 400) << b.body;
  EXPECT_NE(b.body.find("(prompt 1)"), std::string::npos) << b.body;
  json many = req;
  many["prompt"] = {"a", "b", "c", "d", "e"};  // x 2 choices: 10, over --max-queue 8
  const HttpResult m = Post(port, "/v1/completions", many);
  EXPECT_EQ(m.status, 400) << m.body;
  EXPECT_NE(m.body.find("5 prompts x n = 2 choices are more than the wait queue holds"), std::string::npos) << m.body;
  ExpectCleanShutdown(system);
}

TEST(Http, ChatCompletionsWithTheModelsTemplate) {
  const std::string dir = MakeTempDir("httpchat");
  const std::string model = dir + "/qwen3.gguf";
  const std::string cmd = absl::StrCat(ELLM_BINARY_DIR, "/ellm-make-model --arch qwen3 --layers 1 --hidden 64 ",
                                       "--heads 4 --kv-heads 2 --head-dim 16 --ffn 128 --context 512 --vocab-from ",
                                       ELLM_MODELS_DIR, "/vocab/qwen2.5-vocab-derived.gguf --chat-template qwen3 --out ",
                                       model, " 2>/dev/null");
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  EllmSystem system({"--model=" + model, "--attn-workers=1", "--no-numactl"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  json req = {{"messages", {{{"role", "system"}, {"content", "Be brief."}}, {{"role", "user"}, {"content", "Hi there"}}}},
              {"max_completion_tokens", 12},
              {"temperature", 0},
              {"logprobs", true},
              {"top_logprobs", 4}};
  HttpResult r = Post(port, "/v1/chat/completions", req);
  ASSERT_EQ(r.status, 200) << r.body;
  json j = r.Json();
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  const std::string text = j["choices"][0]["message"]["content"];
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);
  const json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 12u);
  for (const json& c : content) {
    // Four alternatives, most likely first, the first the (greedy) choice.
    ASSERT_EQ(c["top_logprobs"].size(), 4u) << c;
    EXPECT_EQ(c["top_logprobs"][0]["token"], c["token"]);
    EXPECT_EQ(c["top_logprobs"][0]["logprob"], c["logprob"]);
    for (int k = 1; k < 4; ++k) {
      EXPECT_LE(c["top_logprobs"][k]["logprob"].get<float>(), c["top_logprobs"][k - 1]["logprob"].get<float>());
      EXPECT_NE(c["top_logprobs"][k]["token"], c["token"]);
    }
  }
  req["stream"] = true;
  r = Post(port, "/v1/chat/completions", req);
  ASSERT_EQ(r.status, 200) << r.body;
  const std::vector<std::string> data = SseData(r.body);
  ASSERT_GE(data.size(), 3u);
  EXPECT_EQ(json::parse(data[0])["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(Collect(r, true).text, text);
  // The prompt is exactly the template's (the gRPC Tokenize of the messages).
  EXPECT_EQ(j["usage"]["prompt_tokens"].get<int>() > 10, true);

  // Tools: listed in the system turn (the prompt grows by them); a
  // conversation with the answer's calls and the tools' answers is served;
  // what ellm cannot honour is a 400 naming the field.
  const json tools = json::array(
      {{{"type", "function"},
        {"function", {{"name", "get_time"}, {"description", "The time in a zone"},
                      {"parameters", {{"type", "object"}, {"properties", {{"zone", {{"type", "string"}}}}}}}}}}});
  json with_tools = {{"messages", req["messages"]}, {"max_completion_tokens", 4}, {"temperature", 0}, {"tools", tools}};
  r = Post(port, "/v1/chat/completions", with_tools);
  ASSERT_EQ(r.status, 200) << r.body;
  const int tools_prompt = r.Json()["usage"]["prompt_tokens"].get<int>();
  EXPECT_NE(system.Log().find("chat template: qwen3 (takes tools)"), std::string::npos) << system.Log();
  {
    // GetModelInfo says so; the gRPC Tokenize of the same messages and tool
    // (as the HTTP API passes it on) is the prompt the request had.
    ellm::v1::ModelInfo info;
    grpc::ClientContext ctx;
    ASSERT_TRUE(system.stub()->GetModelInfo(&ctx, ellm::v1::GetModelInfoRequest(), &info).ok());
    EXPECT_TRUE(info.tools());
    ellm::v1::TokenizeRequest tokenize;
    for (const json& m : with_tools["messages"]) {
      ellm::v1::ChatMessage* out = tokenize.add_messages();
      out->set_role(m["role"].get<std::string>());
      out->set_content(m["content"].get<std::string>());
    }
    tokenize.add_tools(tools[0].dump());
    ellm::v1::TokenizeResponse ids;
    grpc::ClientContext ctx2;
    ASSERT_TRUE(system.stub()->Tokenize(&ctx2, tokenize, &ids).ok());
    EXPECT_EQ(ids.token_ids_size(), tools_prompt);
  }
  EXPECT_GT(tools_prompt, j["usage"]["prompt_tokens"].get<int>() + 30);
  with_tools["messages"].push_back(
      {{"role", "assistant"},
       {"content", nullptr},
       {"tool_calls",
        json::array({{{"id", "c"}, {"type", "function"},
                      {"function", {{"name", "get_time"}, {"arguments", "{\"zone\": \"UTC\"}"}}}}})}});
  with_tools["messages"].push_back({{"role", "tool"}, {"tool_call_id", "c"}, {"content", "12:00"}});
  with_tools["stream"] = true;
  r = Post(port, "/v1/chat/completions", with_tools);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Collect(r, true).finish_reason.empty(), false) << r.body;
  with_tools["stream"] = false;
  r = Post(port, "/v1/chat/completions", with_tools);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_GT(r.Json()["usage"]["prompt_tokens"].get<int>(), tools_prompt + 10);
  // Thinking (Qwen3): chat_template_kwargs.enable_thinking false and an
  // answer's reasoning_content reach the prompt as the gRPC Tokenize of the
  // same request renders it (the empty thinking block, the given reasoning
  // in the last answer's block); the log says how answers' thinking returns.
  EXPECT_NE(system.Log().find("(thinking returned as reasoning_content)"), std::string::npos) << system.Log();
  {
    json thinking = {{"messages", {{{"role", "user"}, {"content", "Hi there"}},
                                   {{"role", "assistant"}, {"content", "Sure."}, {"reasoning_content", "Think it over."}}}},
                     {"max_completion_tokens", 2},
                     {"chat_template_kwargs", {{"enable_thinking", false}}}};
    r = Post(port, "/v1/chat/completions", thinking);
    ASSERT_EQ(r.status, 200) << r.body;
    const int with_both = r.Json()["usage"]["prompt_tokens"];
    ellm::v1::TokenizeRequest tokenize;
    ellm::v1::ChatMessage* user = tokenize.add_messages();
    user->set_role("user");
    user->set_content("Hi there");
    ellm::v1::ChatMessage* answer = tokenize.add_messages();
    answer->set_role("assistant");
    answer->set_content("Sure.");
    answer->set_reasoning_content("Think it over.");
    tokenize.set_enable_thinking(false);
    ellm::v1::TokenizeResponse ids;
    grpc::ClientContext ctx;
    ASSERT_TRUE(system.stub()->Tokenize(&ctx, tokenize, &ids).ok());
    EXPECT_EQ(ids.token_ids_size(), with_both);
    thinking["messages"][1].erase("reasoning_content");
    const int without_reasoning = Post(port, "/v1/chat/completions", thinking).Json()["usage"]["prompt_tokens"];
    thinking["chat_template_kwargs"]["enable_thinking"] = true;
    const int thinking_on = Post(port, "/v1/chat/completions", thinking).Json()["usage"]["prompt_tokens"];
    EXPECT_GE(with_both, without_reasoning + 3) << "the reasoning is in the prompt";
    // (gRPC: enable_thinking with a text is refused, not ignored.)
    ellm::v1::TokenizeRequest text;
    text.set_text("Hi");
    text.set_enable_thinking(false);
    grpc::ClientContext ctx3;
    EXPECT_EQ(system.stub()->Tokenize(&ctx3, text, &ids).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_GT(without_reasoning, thinking_on) << "the empty thinking block is in the prompt";
  }
  with_tools["tool_choice"] = "required";
  r = Post(port, "/v1/chat/completions", with_tools);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("'tool_choice'"), std::string::npos) << r.body;
  with_tools["tool_choice"] = "auto";
  with_tools["messages"][2]["tool_calls"][0]["function"]["arguments"] = "{\"zone\": ";
  r = Post(port, "/v1/chat/completions", with_tools);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("'messages[2].tool_calls[0].function.arguments' is not valid JSON (parse error at line 1"),
            std::string::npos)
      << r.body;
  ExpectCleanShutdown(system);
  std::filesystem::remove_all(dir);
}

// What a client that sends its whole request before it reads (as most do)
// gets for a POST of a `body_bytes` body to /v1/completions: the reply, read
// to the connection's end, or "" when the server cut the upload short.
std::string ReplyAfterSending(int port, size_t body_bytes) {
  net::io_context ioc;
  tcp::socket socket(ioc);
  socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
  const std::string header = absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                          "Content-Type: application/json\r\nContent-Length: ", body_bytes, "\r\n\r\n");
  beast::error_code ec;
  net::write(socket, net::buffer(header), ec);
  const std::string body(body_bytes, ' ');
  if (!ec) net::write(socket, net::buffer(body), ec);
  if (ec) return "";
  std::string out;
  char buf[4096];
  for (;;) {
    const size_t n = socket.read_some(net::buffer(buf), ec);
    out.append(buf, n);
    if (ec) break;
  }
  return out;
}

TEST(Http, EveryErrorHasItsStatusAndOpenAisShape) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=1", "--no-numactl", "--http-max-body-mb=1",
                     "--max-batch=1", "--max-queue=1", "--no-restart", "--heartbeat-ms=5000",
                     "--min-step-timeout-s=60"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  auto expect = [&](const HttpResult& r, int status, const std::string& needle) {
    EXPECT_EQ(r.status, status) << r.body;
    const json j = r.Json();
    ASSERT_TRUE(j.contains("error")) << r.body;
    EXPECT_TRUE(j["error"]["message"].is_string());
    EXPECT_NE(j["error"]["message"].get<std::string>().find(needle), std::string::npos) << r.body;
    // A refused field is the error's param too.
    if (needle.size() > 2 && needle.front() == '\'' && needle.back() == '\'') {
      EXPECT_EQ(j["error"]["param"], needle.substr(1, needle.size() - 2)) << r.body;
    } else if (status != 400) {
      EXPECT_TRUE(j["error"]["param"].is_null()) << r.body;
    }
  };
  expect(Call(port, http::verb::post, "/v1/completions", "{not json"), 400, "not valid JSON");
  expect(Post(port, "/v1/completions", {{"prompt", 5}}), 400, "'prompt'");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"max_tokens", "ten"}}), 400, "'max_tokens'");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"max_tokens", -1}}), 400, "'max_tokens'");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"temperature", -1}}), 400, "'temperature'");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"top_p", 2}}), 400, "'top_p'");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"repetition_penalty", 0}}), 400,
         "'repetition_penalty' must be in [0.01, 10]");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"stop", 3}}), 400, "'stop'");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"stop", std::string(257, 'a')}}), 400, "at most 256");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"n", 17}}), 400, "'n'");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"logprobs", 21}}), 400, "'logprobs'");
  expect(Post(port, "/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"top_logprobs", 2}}),
         400, "'top_logprobs'");
  expect(Post(port, "/v1/completions", {{"prompt", ""}}), 400, "prompt is empty");
  expect(Post(port, "/v1/completions", {{"prompt", {1, "a"}}}), 400, "'prompt'");
  expect(Post(port, "/v1/completions", {{"prompt", {1, 4294967296LL}}}), 400, "'prompt'");
  expect(Post(port, "/v1/completions", {{"prompt", {json::array()}}}), 400, "empty list of token ids");
  expect(Post(port, "/v1/completions", {{"prompt", {1, 512}}}), 400, "outside the vocabulary");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 5000}}), 400, "exceeds");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 5}, {"min_tokens", 6}}), 400,
         "'min_tokens' is 6, more than max_tokens (5)");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"min_tokens", 5000}}), 400, "min_tokens must be in [0, ");
  // The service's checks name their field too.
  for (const auto& [body, param] : std::vector<std::pair<json, std::string>>{
           {{{"prompt", "x"}, {"min_tokens", 5000}}, "min_tokens"},
           {{{"prompt", "x"}, {"stop_token_ids", {2, 512}}}, "stop_token_ids"},
           {{{"prompt", "x"}, {"max_tokens", 5000}}, "max_tokens"},
           {{{"prompt", "x"}, {"logit_bias", {{"512", 1}}}}, "logit_bias"}}) {
    const HttpResult r = Post(port, "/v1/completions", body);
    EXPECT_EQ(r.status, 400) << r.body;
    EXPECT_EQ(r.Json()["error"]["param"], param) << r.body;
  }
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"min_tokens", -1}}), 400, "'min_tokens'");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"ignore_eos", 1}}), 400, "'ignore_eos'");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"stop_token_ids", 2}}), 400, "'stop_token_ids'");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"stop_token_ids", {2, -1}}}), 400, "'stop_token_ids'");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"stop_token_ids", {2, 512}}}), 400,
         "outside the vocabulary");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"stop_token_ids", std::vector<int>(257, 2)}}), 400,
         "at most 256");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"stream", "yes"}}), 400, "'stream'");
  expect(Post(port, "/v1/chat/completions", {{"messages", json::array()}}), 400, "'messages'");
  // Fields that would constrain or bias the output are refused, never
  // ignored; their neutral values pass (these requests then fail on the
  // missing chat template, past the fields' check).
  const json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  for (const auto& [field, value] : std::vector<std::pair<std::string, json>>{
           {"response_format", {{"type", "json_object"}}},
           {"functions", {{{"name", "f"}}}},
           {"best_of", 3},
           {"prompt_logprobs", 1},
           {"guided_json", json::object()}}) {
    json body = chat;
    body[field] = value;
    expect(Post(port, "/v1/chat/completions", body), 400, "'" + field + "' is not supported");
  }
  for (const auto& [field, value] : std::vector<std::pair<std::string, json>>{
           {"logit_bias", {{"17", 100}}},
           {"repetition_penalty", 1.2},
           {"response_format", {{"type", "text"}}},
           {"tool_choice", "none"},
           {"tools", {{{"type", "function"}, {"function", {{"name", "f"}}}}}},
           {"best_of", 1},
           {"ignore_eos", true},
           {"min_tokens", 4},
           {"stop_token_ids", {5, 2}},
           {"user", "u-1"}}) {
    json body = chat;
    body[field] = value;
    expect(Post(port, "/v1/chat/completions", body), 400, "no chat template");
  }
  // Tools are served where the template takes them; a call the output
  // would have to be constrained to is refused.
  json required = chat;
  required["tool_choice"] = "required";
  expect(Post(port, "/v1/chat/completions", required), 400, "'tool_choice' must be \"auto\" or \"none\"");
  // Deep nesting is refused before it is parsed (parsed, it took 600 MB).
  expect(Call(port, http::verb::post, "/v1/completions",
              absl::StrCat(R"({"prompt":)", std::string(400000, '['), std::string(400000, ']'), "}")),
         400, "nests deeper than 32");
  // Brackets inside strings are text, not nesting.
  EXPECT_EQ(Post(port, "/v1/completions", Completion(std::string(100, '[') + "\\\"{", 2, false)).status, 200);
  // Content parts whose "type" is not a string (a type error, not a crash).
  for (const char* type : {"5", "null", "[\"text\"]"}) {
    expect(Call(port, http::verb::post, "/v1/chat/completions",
                absl::StrCat(R"({"messages":[{"role":"user","content":[{"type":)", type, R"(,"text":"x"}]}]})")),
           400, "'messages[0].content'");
  }
  expect(Post(port, "/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "hi"}}}}}), 400,
         "no chat template");
  expect(Post(port, "/v1/completions", {{"prompt", "x"}, {"model", "gpt-4"}}), 404, "gpt-4");
  expect(Call(port, http::verb::get, "/v2/nothing"), 404, "no such endpoint");
  expect(Call(port, http::verb::get, "/v1/completions"), 405, "not allowed");
  expect(Call(port, http::verb::post, "/v1/completions", std::string(2 << 20, ' ')), 413, "limit");
  // A client that sends its whole body before it reads gets the 413 too: the
  // server reads the rest and drops it rather than reset the upload.
  const std::string reply = ReplyAfterSending(port, 16 << 20);
  EXPECT_TRUE(absl::StartsWith(reply, "HTTP/1.1 413")) << "reply: " << reply.substr(0, 200);
  // More choices than the wait queue holds can never be served: 400 (not a
  // 429 that a client would retry for ever), nothing queued.
  json many = Completion("Once upon a time", 50, true);
  many["n"] = 3;
  expect(Post(port, "/v1/completions", many), 400, "more than the wait queue holds (--max-queue 1)");
  EXPECT_TRUE(WaitForQueue(port, 0, 0)) << "a choice of the refused request stayed";
  // One request runs (--max-batch=1), one waits (--max-queue=1): a third is
  // 429. The attention worker is stopped meanwhile, so that the running
  // request cannot end (at EOS, on a fast machine) before the third arrives;
  // the heartbeats (5 s apart, two misses) and step deadline (60 s) allow it.
  const pid_t worker = system.FindChild("ellm-attn-worker");
  ASSERT_GT(worker, 0);
  kill(worker, SIGSTOP);
  auto running = std::async(std::launch::async, [&] {
    return Post(port, "/v1/completions", Completion("Once upon a time", 100, false));
  });
  const bool admitted = WaitForQueue(port, 1, 0);
  auto waiting = std::async(std::launch::async, [&] {
    return Post(port, "/v1/completions", Completion("The dog", 100, false));
  });
  const bool queued = admitted && WaitForQueue(port, 1, 1);
  // (Were it queued instead, it would wait for the stopped worker.)
  auto third = std::async(std::launch::async, [&] {
    return Post(port, "/v1/completions", Completion("The cat", 5, false));
  });
  const bool answered = third.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  kill(worker, SIGCONT);
  EXPECT_TRUE(admitted && queued) << "the running and the waiting request never showed in /metrics";
  EXPECT_TRUE(answered) << "a request beyond --max-queue waited instead of being refused";
  const HttpResult refused = third.get();
  expect(refused, 429, "wait queue");
  EXPECT_EQ(refused.retry_after, "1") << "a client's back-off reads Retry-After";
  EXPECT_EQ(running.get().status, 200);
  EXPECT_EQ(waiting.get().status, 200);
  // A dead worker (no restarts): 503, and /health says so.
  kill(worker, SIGKILL);
  for (int i = 0; i < 150 && Call(port, http::verb::get, "/health").status != 503; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(Call(port, http::verb::get, "/health").status, 503);
  expect(Post(port, "/v1/completions", Completion("Once", 4, false)), 503, "worker");
  ExpectCleanShutdown(system);
}

TEST(Http, ApiKeyIsRequiredWhenSet) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=1", "--no-numactl", "--api-key=k3y"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  EXPECT_EQ(Post(port, "/v1/completions", Completion("Once", 4, false)).status, 401);
  EXPECT_EQ(Post(port, "/v1/completions", Completion("Once", 4, false), "nope").status, 401);
  EXPECT_EQ(Post(port, "/v1/completions", Completion("Once", 4, false), "k3y").status, 200);
  EXPECT_EQ(Call(port, http::verb::get, "/health").status, 200);  // load balancers need no key
  ExpectCleanShutdown(system);
}

// Response ids are unique: within a run, and across a restart (the first
// request of every run had the same id); a request's log lines name its id.
TEST(Http, ResponseIdsDifferAcrossRequestsAndRestarts) {
  std::set<std::string> ids;
  for (int run = 0; run < 2; ++run) {
    EllmSystem system({"--model=" + kStories, "--attn-workers=1", "--no-numactl"});
    ASSERT_TRUE(system.ready()) << system.Log();
    std::string last;
    for (int i = 0; i < 2; ++i) {
      const HttpResult r = Post(system.http_port(), "/v1/completions", Completion("Once", 2, false));
      ASSERT_EQ(r.status, 200) << r.body;
      last = r.Json()["id"].get<std::string>();
      ids.insert(last);
    }
    ExpectCleanShutdown(system);
    // The request's log line names the id its answer carried.
    EXPECT_NE(system.Log().find(absl::StrCat("(HTTP ", last, ") finished")), std::string::npos) << system.Log();
  }
  EXPECT_EQ(ids.size(), 4u);
}

// HTTP/1.1 keeps the connection: requests sent one after another on it,
// streamed or not, are each answered in turn, and each as on a fresh
// connection. (The server watches a generating connection for a hang-up;
// that watch must never hold up the next request's answer.)
TEST(Http, AKeptAliveConnectionAnswersItsRequestsInTurn) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=2", "--no-numactl"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  const std::vector<json> requests = {Completion("Once upon a time", 12, true), Completion("The little dog", 12, false),
                                      Completion("Once upon a time", 12, false), Completion("The little dog", 12, true)};
  std::vector<std::string> fresh;
  for (const json& r : requests) fresh.push_back(Post(port, "/v1/completions", r).body);

  net::io_context ioc;
  tcp::socket socket(ioc);
  socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
  beast::flat_buffer buffer;
  for (size_t i = 0; i < requests.size(); ++i) {
    WriteCompletion(socket, requests[i]);
    // A hung answer fails the test instead of hanging it.
    std::future<http::response<http::string_body>> answer = std::async(std::launch::async, [&] {
      http::response<http::string_body> res;
      beast::error_code ec;
      http::read(socket, buffer, res, ec);
      EXPECT_FALSE(ec) << ec.message();
      return res;
    });
    if (answer.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      socket.shutdown(tcp::socket::shutdown_both);  // ends the read, so the future can be joined
      ADD_FAILURE() << "request " << i << " on the kept-alive connection got no answer in 20 s";
      return;
    }
    http::response<http::string_body> res = answer.get();
    EXPECT_EQ(res.result_int(), 200) << "request " << i;
    EXPECT_TRUE(res.keep_alive()) << "request " << i;
    const bool stream = requests[i]["stream"];
    if (stream) {
      EXPECT_EQ(Collect(HttpResult{200, "", res.body()}, false).text, Collect(HttpResult{200, "", fresh[i]}, false).text);
    } else {
      EXPECT_EQ(json::parse(res.body())["choices"][0]["text"], json::parse(fresh[i])["choices"][0]["text"]);
    }
  }
  socket.close();
  ExpectCleanShutdown(system);
}

// What a raw client sends and gets back, read to the connection's end.
std::string RawExchange(int port, const std::string& request) {
  net::io_context ioc;
  tcp::socket socket(ioc);
  socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
  net::write(socket, net::buffer(request));
  std::string out;
  beast::error_code ec;
  char buf[4096];
  for (;;) {
    const size_t n = socket.read_some(net::buffer(buf), ec);
    out.append(buf, n);
    if (ec) break;
  }
  return out;
}

// Requests the parser refuses are answered (400, 431) and the connection
// closed, never dropped without a word; an HTTP/1.0 client's stream is not
// chunked (1.0 has no chunked encoding) and ends with the connection.
TEST(Http, BadFramingIsAnsweredAndHttp10StreamsArePlain) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=1", "--no-numactl"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  EXPECT_TRUE(absl::StartsWith(RawExchange(port, "GET /health HTTP/9.9\r\nHost: x\r\n\r\n"), "HTTP/1.1 400"));
  EXPECT_TRUE(absl::StartsWith(RawExchange(port, "GET /health HTTP/1.1\r\nBad Header\r\n\r\n"), "HTTP/1.1 400"));
  const std::string big = absl::StrCat("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ", std::string(20000, 'a'), "\r\n\r\n");
  EXPECT_TRUE(absl::StartsWith(RawExchange(port, big), "HTTP/1.1 431")) << "header over the limit";
  // A POST without Content-Length (or chunks) has no body: 411, saying so.
  const std::string body_10 = Completion("Once", 2, false).dump();
  const std::string no_length = RawExchange(port, absl::StrCat("POST /v1/completions HTTP/1.0\r\n\r\n", body_10));
  EXPECT_TRUE(absl::StartsWith(no_length, "HTTP/1.0 411")) << no_length.substr(0, 300);
  EXPECT_NE(no_length.find("Content-Length"), std::string::npos) << no_length;
  // A chunked body whose chunk-size line (its extension) or trailer never
  // ends: the server stops reading at its bound and answers, where it would
  // otherwise buffer all it is sent (and wait for the rest).
  const std::string chunked = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  EXPECT_TRUE(absl::StartsWith(RawExchange(port, absl::StrCat(chunked, "1;x=", std::string(3 << 20, 'a'))),
                               "HTTP/1.1 400"))
      << "endless chunk extension";
  EXPECT_TRUE(absl::StartsWith(RawExchange(port, absl::StrCat(chunked, "0\r\nX-T: ", std::string(3 << 20, 'a'))),
                               "HTTP/1.1 400"))
      << "endless trailer";
  // The bound is on what waits to be parsed, not on the body: a 3 MiB chunk
  // (whitespace, then the request) is read as it comes.
  const std::string json_body = std::string(3 << 20, ' ') + Completion("Once upon a time", 2, false).dump();
  const std::string big_chunk = RawExchange(
      port, absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n",
                         "Transfer-Encoding: chunked\r\n\r\n", absl::StrFormat("%x", json_body.size()), "\r\n",
                         json_body, "\r\n0\r\n\r\n"));
  EXPECT_TRUE(absl::StartsWith(big_chunk, "HTTP/1.1 200")) << big_chunk.substr(0, 300);

  const std::string body = Completion("Once upon a time", 12, true).dump();
  const std::string reply = RawExchange(
      port, absl::StrCat("POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: ",
                         body.size(), "\r\n\r\n", body));
  ASSERT_TRUE(absl::StartsWith(reply, "HTTP/1.0 200")) << reply;
  const size_t end_of_header = reply.find("\r\n\r\n");
  ASSERT_NE(end_of_header, std::string::npos);
  EXPECT_EQ(absl::AsciiStrToLower(reply.substr(0, end_of_header)).find("transfer-encoding"), std::string::npos);
  const std::string sse = reply.substr(end_of_header + 4);
  EXPECT_EQ(Collect(HttpResult{200, "", sse}, false).text,
            Collect(Post(port, "/v1/completions", Completion("Once upon a time", 12, true)), false).text);
  ExpectCleanShutdown(system);
}

// The protocol's corners: HEAD (GET's header, no body, so that the next
// answer on the connection is read right), "Expect: 100-continue" (the
// interim answer before the body, as curl waits for on bodies over 1 MiB),
// codings the server cannot read (refused, not read as plain), and a request
// line in the absolute form.
TEST(Http, HeadExpectCodingsAndTheAbsoluteForm) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=1", "--no-numactl"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  const std::string get = RawExchange(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  const std::string head_then_get =
      RawExchange(port, "HEAD /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n"
                        "Connection: close\r\n\r\n");
  ASSERT_TRUE(absl::StartsWith(head_then_get, "HTTP/1.1 200")) << head_then_get;
  const size_t head_end = head_then_get.find("\r\n\r\n");
  ASSERT_NE(head_end, std::string::npos);
  // The HEAD answer says the GET's length and is followed at once by the GET's answer.
  EXPECT_NE(head_then_get.substr(0, head_end).find(absl::StrCat(
                "Content-Length: ", get.size() - get.find("\r\n\r\n") - 4)),
            std::string::npos)
      << head_then_get;
  EXPECT_EQ(head_then_get.substr(head_end + 4), get);
  const std::string head_post = RawExchange(port, "HEAD /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_TRUE(absl::StartsWith(head_post, "HTTP/1.1 405")) << head_post;
  EXPECT_TRUE(absl::EndsWith(head_post, "\r\n\r\n")) << "a body after a HEAD answer: " << head_post;

  const std::string body = Completion("Once upon a time", 4, false).dump();
  {
    net::io_context ioc;
    tcp::socket socket(ioc);
    socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
    net::write(socket, net::buffer(absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                                "Expect: 100-continue\r\nContent-Length: ", body.size(), "\r\n\r\n")));
    std::string interim;
    net::read_until(socket, net::dynamic_buffer(interim), "\r\n\r\n");
    EXPECT_TRUE(absl::StartsWith(interim, "HTTP/1.1 100 Continue\r\n")) << interim;
    net::write(socket, net::buffer(body));
    std::string rest;
    beast::error_code ec;
    net::read(socket, net::dynamic_buffer(rest), ec);
    const std::string answer = interim.substr(interim.find("\r\n\r\n") + 4) + rest;
    EXPECT_TRUE(absl::StartsWith(answer, "HTTP/1.1 200")) << answer;
  }
  const std::string post = absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
  EXPECT_TRUE(absl::StartsWith(
      RawExchange(port, absl::StrCat(post, "Expect: teapot\r\nContent-Length: ", body.size(), "\r\n\r\n", body)),
      "HTTP/1.1 417"));
  EXPECT_TRUE(absl::StartsWith(
      RawExchange(port, absl::StrCat(post, "Transfer-Encoding: gzip, chunked\r\n\r\n",
                                     absl::StrFormat("%x", body.size()), "\r\n", body, "\r\n0\r\n\r\n")),
      "HTTP/1.1 501"));
  EXPECT_TRUE(absl::StartsWith(
      RawExchange(port, absl::StrCat(post, "Content-Encoding: gzip\r\nContent-Length: ", body.size(), "\r\n\r\n", body)),
      "HTTP/1.1 415"));
  EXPECT_TRUE(absl::StartsWith(
      RawExchange(port, absl::StrCat(post, "Content-Encoding: identity\r\nContent-Length: ", body.size(), "\r\n\r\n", body)),
      "HTTP/1.1 200"));
  EXPECT_EQ(RawExchange(port, "GET http://127.0.0.1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"), get);
  ExpectCleanShutdown(system);
}

// Large bodies are parsed and tokenized two at a time, away from the I/O
// threads; a small request sent while twelve of them wait is answered
// before they all are.
TEST(Http, LargeUploadsDoNotHoldUpSmallRequests) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=1", "--no-numactl"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  // 7 MB of prompt text: tokenized, then refused as longer than the context.
  const json large = Completion(std::string(7 << 20, 'a'), 1, false);
  constexpr int kUploads = 12;
  std::vector<std::future<HttpResult>> uploads;
  for (int i = 0; i < kUploads; ++i) {
    uploads.push_back(std::async(std::launch::async, [&] { return Post(port, "/v1/completions", large); }));
  }
  // Received by then (84 MB on loopback), and far from prepared: each takes
  // a pool thread about 0.3 s here (Release build).
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const HttpResult small = Post(port, "/v1/completions", Completion("Once upon a time", 2, false));
  int answered = 0;
  for (auto& f : uploads) answered += f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  EXPECT_EQ(small.status, 200) << small.body;
  EXPECT_LT(answered, kUploads) << "the small request was answered after every large one";
  for (auto& f : uploads) {
    const HttpResult r = f.get();
    EXPECT_EQ(r.status, 400);
    EXPECT_NE(r.body.find("the context holds"), std::string::npos) << r.body;
  }
  ExpectCleanShutdown(system);
}

// Past --http-max-connections a new connection is answered 503 at once and
// closed; once one closes, connections are served again.
TEST(Http, ConnectionsOverTheLimitAreAnswered503) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=1", "--no-numactl", "--http-max-connections=3"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  ASSERT_EQ(Call(port, http::verb::get, "/health").status, 200);
  net::io_context ioc;
  std::vector<tcp::socket> idle;
  for (int i = 0; i < 3; ++i) {
    idle.emplace_back(ioc);
    idle.back().connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
  }
  // The server takes the three (in its own time); the fourth is refused.
  // (The refusal comes before the request is read: the client just reads.)
  const auto refused = [&] {
    tcp::socket s(ioc);
    s.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
    std::string out;
    beast::error_code ec;
    char buf[4096];
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
    int available = 0;
    while (std::chrono::steady_clock::now() < deadline && (available = static_cast<int>(s.available(ec))) == 0 && !ec) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (available == 0) return out;  // taken as a session: no answer before a request
    for (;;) {
      const size_t n = s.read_some(net::buffer(buf), ec);
      out.append(buf, n);
      if (ec) break;
    }
    return out;
  };
  std::string reply;
  for (int i = 0; i < 50 && !absl::StartsWith(reply, "HTTP/1.1 503"); ++i) reply = refused();
  EXPECT_TRUE(absl::StartsWith(reply, "HTTP/1.1 503")) << reply;
  EXPECT_NE(reply.find("--http-max-connections"), std::string::npos) << reply;
  // Closed: the server drops their sessions (once it reads the end of each,
  // as it does for every connection a call below closes: hence the retries).
  idle.pop_back();
  idle.pop_back();
  int status = 0;
  for (int i = 0; i < 100 && status != 200; ++i) {
    status = Post(port, "/v1/completions", Completion("Once", 4, false)).status;
    if (status != 200) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(status, 200);
  idle.clear();
  ExpectCleanShutdown(system);
}

// /metrics asks every worker for its figures; a frozen worker makes each ask
// wait for its deadline. That wait must not hold the I/O threads: /health
// and the API answer while scrapes wait.
TEST(Http, AScrapeWaitingOnAFrozenWorkerHoldsNothingElse) {
  // (The heartbeats kill the frozen worker after two misses, about 2 s: the
  // first scrape's 1 s wait is over before.)
  EllmSystem system({"--model=" + kStories, "--attn-workers=1", "--no-numactl", "--no-restart"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  const pid_t worker = system.FindChild("ellm-attn-worker");
  ASSERT_GT(worker, 0);
  kill(worker, SIGSTOP);
  std::vector<std::future<HttpResult>> scrapes;
  for (int i = 0; i < 4; ++i) {  // more than the I/O threads
    scrapes.push_back(std::async(std::launch::async, [&] { return Call(port, http::verb::get, "/metrics"); }));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const HttpResult health = Call(port, http::verb::get, "/health");
  const HttpResult models = Call(port, http::verb::get, "/v1/models");
  int answered = 0;
  for (auto& f : scrapes) answered += f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  EXPECT_GT(health.status, 0);
  EXPECT_EQ(models.status, 200);
  EXPECT_EQ(answered, 0) << "/health and /v1/models waited for a scrape (each waits 1 s for the frozen worker)";
  kill(worker, SIGCONT);
  for (auto& f : scrapes) EXPECT_EQ(f.get().status, 200);
  ExpectCleanShutdown(system);
}

// A graceful stop: on SIGTERM the requests in flight (gRPC, HTTP streamed
// and whole) run to their end with every token while new ones are refused
// and /health answers 503, also when a worker dies during the drain (it is
// replaced and they resume); a second SIGTERM ends what is left at once.
// The attention workers are stopped meanwhile, so that nothing can end
// before the signal.
TEST(Http, SigtermLetsTheRequestsInFlightFinish) {
  enum class Then { kNothing, kSecondSignal, kWorkerDies };
  for (const Then then : {Then::kNothing, Then::kSecondSignal, Then::kWorkerDies}) {
    const bool second_signal = then == Then::kSecondSignal;
    SCOPED_TRACE(second_signal ? "a second SIGTERM" : then == Then::kWorkerDies ? "a worker dies" : "one SIGTERM");
    EllmSystem system({"--model=" + kStories, "--attn-workers=2", "--no-numactl", "--kv-dtype=f32",
                       "--heartbeat-ms=5000", "--min-step-timeout-s=60", "--drain-timeout-s=60"});
    ASSERT_TRUE(system.ready()) << system.Log();
    const int port = system.http_port();
    constexpr int kLong = 1800;
    const Generated alone = Generate(system.stub(), Greedy("Once upon a time", kLong));
    ASSERT_TRUE(alone.status.ok()) << alone.status.error_message();
    ASSERT_EQ(alone.finish.completion_tokens(), kLong);
    const std::string alone_text = Collect(Post(port, "/v1/completions", Completion("Once upon a time", kLong, true)), false).text;
    ASSERT_EQ(alone_text, alone.text);

    // Three long requests, decoding when the workers stop (stopped before
    // that, the control calls of their admission would time out).
    const std::vector<pid_t> workers = system.FindChildren("ellm-attn-worker");
    ASSERT_EQ(workers.size(), 2u);
    auto grpc_call = std::async(std::launch::async, [&] { return Generate(system.stub(), Greedy("Once upon a time", kLong)); });
    auto streamed = std::async(std::launch::async, [&] {
      return Post(port, "/v1/completions", Completion("Once upon a time", kLong, true));
    });
    auto whole = std::async(std::launch::async, [&] {
      return Post(port, "/v1/completions", Completion("Once upon a time", kLong, false));
    });
    bool running = false;
    for (int i = 0; i < 400 && !running; ++i) {
      ellm::v1::ModelInfo info;
      grpc::ClientContext ctx;
      running = system.stub()->GetModelInfo(&ctx, ellm::v1::GetModelInfoRequest(), &info).ok() && info.running() == 3;
      if (!running) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_TRUE(running);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // past their prefill and its KV update
    for (pid_t w : workers) kill(w, SIGSTOP);
    kill(system.pid(), SIGTERM);
    // Once the coordinator has the signal (/health: 503), new requests are refused.
    bool unhealthy = false;
    for (int i = 0; i < 200 && !unhealthy; ++i) {
      unhealthy = Call(port, http::verb::get, "/health").status == 503;
      if (!unhealthy) std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    ASSERT_TRUE(unhealthy);
    const HttpResult refused = Post(port, "/v1/completions", Completion("Once", 4, false));
    EXPECT_EQ(refused.status, 503);
    EXPECT_NE(refused.body.find("shutting down"), std::string::npos) << refused.body;
    const Generated late = Generate(system.stub(), Greedy("Once", 4));
    EXPECT_EQ(late.status.error_code(), grpc::StatusCode::UNAVAILABLE) << late.status.error_message();
    EXPECT_EQ(grpc_call.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
        << "the request in flight ended with the signal";

    if (second_signal) {
      kill(system.pid(), SIGTERM);
      const Generated cut = grpc_call.get();
      EXPECT_EQ(cut.status.error_code(), grpc::StatusCode::UNAVAILABLE) << cut.status.error_message();
      EXPECT_NE(whole.get().status, 200);
      EXPECT_NE(streamed.get().body.find("shutting down"), std::string::npos);
      for (pid_t w : workers) kill(w, SIGCONT);
    } else {
      if (then == Then::kWorkerDies) kill(workers[0], SIGKILL);
      for (pid_t w : workers) kill(w, SIGCONT);
      const Generated g = grpc_call.get();
      ASSERT_TRUE(g.status.ok()) << g.status.error_message();
      EXPECT_EQ(g.tokens, alone.tokens);
      const Streamed s = Collect(streamed.get(), false);
      EXPECT_EQ(s.text, alone_text);
      const HttpResult w = whole.get();
      ASSERT_EQ(w.status, 200) << w.body;
      EXPECT_EQ(w.Json()["choices"][0]["text"].get<std::string>(), alone_text);
    }
    const int status = system.WaitExit();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << system.Log();
    EXPECT_NE(system.Log().find(second_signal ? "stopping at once: " : "drain over: no request in flight"),
              std::string::npos)
        << system.Log();
    EXPECT_EQ(system.Log().find("killing it"), std::string::npos) << system.Log();
    EXPECT_EQ(system.Log().find("restarting the workers") != std::string::npos, then == Then::kWorkerDies)
        << system.Log();
    EXPECT_TRUE(LeftoverSegments(system.pid()).empty());
  }
}

// A client may send its next request before the answer to the one before
// (HTTP/1.1 pipelining): the server answers both, in order. The second
// arrives while the first generates, which the server's hang-up watch sees
// as data on the socket.
TEST(Http, APipelinedRequestIsAnsweredAfterTheOneBeforeIt) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=1", "--no-numactl", "--heartbeat-ms=5000",
                     "--min-step-timeout-s=60"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  const std::vector<json> requests = {Completion("Once upon a time", 400, false), Completion("The little dog", 8, false)};
  std::vector<std::string> fresh;
  for (const json& r : requests) fresh.push_back(Post(port, "/v1/completions", r).body);

  net::io_context ioc;
  tcp::socket socket(ioc);
  socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
  // The second goes out while the first is in the server for sure: the
  // attention worker stops until the server shows it (400 tokens take a few ms
  // on a fast machine). The first may be running, or waiting for admission
  // behind the KV update the fresh runs left, which goes to the stopped
  // worker too and fails it after 5 s: the stop lasts about 1 s.
  const pid_t worker = system.FindChild("ellm-attn-worker");
  ASSERT_GT(worker, 0);
  kill(worker, SIGSTOP);
  WriteCompletion(socket, requests[0]);
  const bool running = system.WaitForRequests(1);
  WriteCompletion(socket, requests[1]);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // it reaches the server
  kill(worker, SIGCONT);
  EXPECT_TRUE(running) << "the first request never showed in /metrics";
  std::future<std::vector<http::response<http::string_body>>> answers = std::async(std::launch::async, [&] {
    std::vector<http::response<http::string_body>> out;
    beast::flat_buffer buffer;
    for (size_t i = 0; i < requests.size(); ++i) {
      http::response<http::string_body> res;
      beast::error_code ec;
      http::read(socket, buffer, res, ec);
      if (ec) {
        ADD_FAILURE() << "answer " << i << ": " << ec.message();
        break;
      }
      out.push_back(std::move(res));
    }
    return out;
  });
  if (answers.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    socket.shutdown(tcp::socket::shutdown_both);
    ADD_FAILURE() << "the pipelined requests got no answers in 30 s";
    return;
  }
  const std::vector<http::response<http::string_body>> got = answers.get();
  ASSERT_EQ(got.size(), requests.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].result_int(), 200) << "request " << i;
    EXPECT_EQ(json::parse(got[i].body())["choices"][0]["text"], json::parse(fresh[i])["choices"][0]["text"])
        << "request " << i;
  }
  socket.close();
  ExpectCleanShutdown(system);
}

TEST(Http, ADisconnectCancelsAndConcurrentStreamsMatchTheirSoloRuns) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=2", "--no-numactl", "--max-batch=32",
                     "--heartbeat-ms=5000", "--min-step-timeout-s=60"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  // Read the start of a long stream of three choices, then hang up. The
  // attention workers stop meanwhile, so that the request cannot end by
  // itself (at EOS, in a few ms) before the server sees the hang-up.
  const std::vector<pid_t> workers = system.FindChildren("ellm-attn-worker");
  ASSERT_EQ(workers.size(), 2u);
  {
    net::io_context ioc;
    tcp::socket socket(ioc);
    socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
    http::request<http::string_body> req(http::verb::post, "/v1/completions", 11);
    req.set(http::field::host, "127.0.0.1");
    json body = Completion("Once upon a time", 1900, true);
    body["n"] = 3;
    req.body() = body.dump();
    req.prepare_payload();
    http::write(socket, req);
    std::string seen;
    char buf[4096];
    while (seen.find("data: ") == std::string::npos) {
      const size_t n = socket.read_some(net::buffer(buf));
      seen.append(buf, n);
    }
    for (pid_t w : workers) kill(w, SIGSTOP);
    socket.close();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    for (pid_t w : workers) kill(w, SIGCONT);
  }
  // The server cancels it, every choice: nothing runs a moment later.
  EXPECT_TRUE(system.WaitUntilIdle()) << "the disconnected request still runs";
  EXPECT_EQ(Samples(Call(port, http::verb::get, "/metrics").body)["ellm_requests_total{outcome=\"cancelled\"}"], 3);
  EXPECT_EQ(Post(port, "/v1/completions", Completion("Once", 4, false)).status, 200);

  // 32 concurrent streams, each what it gives alone.
  std::vector<std::string> prompts;
  for (int i = 0; i < 32; ++i) prompts.push_back(absl::StrCat(i % 2 ? "The little dog" : "Once upon a time", " ", i));
  std::vector<std::string> solo;
  for (const std::string& p : prompts) solo.push_back(Collect(Post(port, "/v1/completions", Completion(p, 48, true)), false).text);
  // All 32 in one batch for sure: the attention workers stop until they are
  // all in the server (each alone takes a few ms).
  for (pid_t w : workers) kill(w, SIGSTOP);
  std::vector<std::future<std::string>> together;
  for (const std::string& p : prompts) {
    together.push_back(std::async(std::launch::async, [&, p] {
      return Collect(Post(port, "/v1/completions", Completion(p, 48, true)), false).text;
    }));
  }
  const bool all_in = system.WaitForRequests(static_cast<int>(prompts.size()));
  for (pid_t w : workers) kill(w, SIGCONT);
  EXPECT_TRUE(all_in) << "the 32 requests were never in the server together";
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(together[i].get(), solo[i]) << prompts[i];
  ExpectCleanShutdown(system);
}

TEST(Http, MetricsCountWhatHappenedAndReflectionListsTheApi) {
  const auto launched = std::chrono::steady_clock::now();
  EllmSystem system({"--model=" + kStories, "--attn-workers=2", "--no-numactl"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const int port = system.http_port();
  for (int i = 0; i < 3; ++i) ASSERT_EQ(Post(port, "/v1/completions", Completion("Once upon a time", 20, false)).status, 200);
  EXPECT_EQ(Post(port, "/v1/completions", {{"prompt", ""}}).status, 400);
  const HttpResult m = Call(port, http::verb::get, "/metrics");
  ASSERT_EQ(m.status, 200);
  EXPECT_TRUE(absl::StartsWith(m.content_type, "text/plain"));
  std::map<std::string, double> samples = Samples(m.body);
  EXPECT_EQ(samples["ellm_requests_total{outcome=\"length\"}"], 3);
  EXPECT_EQ(samples["ellm_requests_total{outcome=\"refused\"}"], 1);  // the empty prompt
  EXPECT_EQ(samples["ellm_generated_tokens_total"], 60);
  EXPECT_EQ(samples["ellm_prompt_tokens_total"], 15);
  EXPECT_EQ(samples["ellm_time_to_first_token_seconds_count"], 3);
  EXPECT_EQ(samples["ellm_inter_token_latency_seconds_count"], 57);
  EXPECT_EQ(samples["ellm_requests_running"], 0);
  // Bandwidth accounting per attention worker: positive, and at most ~1.5x its probe.
  for (int shard : {0, 1}) {
    const std::string w = absl::StrCat("{worker=\"attn-", shard, "\"}");
    EXPECT_GT(samples["ellm_kv_read_probe_bytes_per_second" + w], 1e9);
    EXPECT_GT(samples["ellm_kv_read_bytes_total" + w], 0);
    EXPECT_LE(samples["ellm_kv_read_bandwidth_ratio" + w], 1.5);
    EXPECT_GE(samples["ellm_kv_read_bandwidth_ratio" + w], 0);
  }
  EXPECT_GT(samples["ellm_weight_read_bytes_total{worker=\"mlp\"}"], 0);
  // Busy seconds: every worker computed, for less time than it has existed;
  // GetModelInfo gives the mlp-worker's and the busiest attn-worker's, and
  // both grow with the next request.
  const double alive = std::chrono::duration<double>(std::chrono::steady_clock::now() - launched).count();
  double attn_busy = 0;
  for (const char* w : {"attn-0", "attn-1", "mlp"}) {
    const double busy = samples[absl::StrCat("ellm_worker_busy_seconds_total{worker=\"", w, "\"}")];
    EXPECT_GT(busy, 0) << w;
    EXPECT_LT(busy, alive) << w;
    if (w[0] == 'a') attn_busy = std::max(attn_busy, busy);
  }
  ellm::v1::ModelInfo before, after;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(system.stub()->GetModelInfo(&ctx, ellm::v1::GetModelInfoRequest(), &before).ok());
  }
  EXPECT_GE(before.attn_busy_seconds(), attn_busy);
  EXPECT_GE(before.mlp_busy_seconds(), samples["ellm_worker_busy_seconds_total{worker=\"mlp\"}"]);
  ASSERT_EQ(Post(port, "/v1/completions", Completion("Once upon a time", 20, false)).status, 200);
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(system.stub()->GetModelInfo(&ctx, ellm::v1::GetModelInfoRequest(), &after).ok());
  }
  EXPECT_GT(after.attn_busy_seconds(), before.attn_busy_seconds());
  EXPECT_GT(after.mlp_busy_seconds(), before.mlp_busy_seconds());
  if (std::system("command -v promtool >/dev/null 2>&1") == 0) {
    const std::string path = MakeTempDir("metrics") + "/m.txt";
    std::ofstream(path) << m.body;
    EXPECT_EQ(std::system(("promtool check metrics < " + path).c_str()), 0);
  }

  // gRPC reflection on the public port.
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", system.port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto rw = stub->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest req;
  req.set_list_services("");
  ASSERT_TRUE(rw->Write(req));
  rw->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse resp;
  std::vector<std::string> services;
  while (rw->Read(&resp)) {
    for (const auto& s : resp.list_services_response().service()) services.push_back(s.name());
  }
  EXPECT_TRUE(rw->Finish().ok());
  EXPECT_NE(std::find(services.begin(), services.end(), "ellm.v1.Ellm"), services.end());
  ExpectCleanShutdown(system);
}

}  // namespace
}  // namespace ellm
