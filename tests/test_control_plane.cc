// A closed control plane and a guarded public port, on the real processes:
// worker control calls without the launch's secret are refused (issue 13's
// red-team case: any local process could free a live sequence, fill the KV
// cache or stop a worker); the public API takes an API key and TLS; a
// non-loopback --host needs a key or an explicit --insecure-public.
#include <glob.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/ellm.grpc.pb.h"
#include "tests/integration_harness.h"
#include "tests/tests_util.h"

namespace ellm {
namespace {

namespace fs = std::filesystem;
using namespace ellm::testing;  // NOLINT: the harness

const std::string kStories = ELLM_MODELS_DIR "/stories260K.gguf";

// The launch's run folder (/tmp/ellm-<launcher pid>-<hex>).
std::string RunDir(pid_t launcher) {
  glob_t g;
  std::string out;
  if (glob(absl::StrCat("/tmp/ellm-", launcher, "-*").c_str(), 0, nullptr, &g) == 0 && g.gl_pathc > 0) {
    out = g.gl_pathv[0];
  }
  globfree(&g);
  return out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(ControlPlane, CallsWithoutTheLaunchSecretAreRefused) {
  EllmSystem system({"--model=" + kStories, "--attn-workers=2", "--no-numactl"});
  ASSERT_TRUE(system.ready()) << system.Log();
  const std::string dir = RunDir(system.pid());
  ASSERT_FALSE(dir.empty());
  EXPECT_EQ(fs::status(dir + "/control-secret").permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::owner_write);
  for (const char* sock : {"/attn-0.sock", "/attn-1.sock", "/mlp.sock"}) {
    SCOPED_TRACE(sock);
    auto stub = ellm::v1::WorkerControl::NewStub(
        grpc::CreateChannel("unix:" + dir + sock, grpc::InsecureChannelCredentials()));
    auto call = [&](const std::string& secret, auto&& rpc) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      if (!secret.empty()) ctx.AddMetadata("ellm-control-secret", secret);
      return rpc(&ctx);
    };
    ellm::v1::WorkerInfo info;
    ellm::v1::ShutdownResponse sr;
    ellm::v1::UpdateKvResponse ur;
    ellm::v1::FillSyntheticResponse fr;
    ellm::v1::UpdateKvRequest free_all;
    for (uint64_t id = 1; id < 50; ++id) free_all.add_free_sequences(id);
    ellm::v1::FillSyntheticRequest fill;
    fill.set_sequence_id(999);
    fill.set_positions(1000);
    // The mlp-worker has no KV calls at all.
    const grpc::StatusCode kv_refusal = std::string(sock) == "/mlp.sock" ? grpc::StatusCode::UNIMPLEMENTED
                                                                        : grpc::StatusCode::PERMISSION_DENIED;
    for (const std::string& secret : {std::string(), std::string("not-the-secret")}) {
      EXPECT_EQ(call(secret, [&](grpc::ClientContext* c) { return stub->GetInfo(c, {}, &info); }).error_code(),
                grpc::StatusCode::PERMISSION_DENIED);
      EXPECT_EQ(call(secret, [&](grpc::ClientContext* c) { return stub->Shutdown(c, {}, &sr); }).error_code(),
                grpc::StatusCode::PERMISSION_DENIED);
      EXPECT_EQ(call(secret, [&](grpc::ClientContext* c) { return stub->UpdateKv(c, free_all, &ur); }).error_code(),
                kv_refusal);
      EXPECT_EQ(call(secret, [&](grpc::ClientContext* c) { return stub->FillSynthetic(c, fill, &fr); }).error_code(),
                kv_refusal);
    }
    // With the secret the same call goes through: the check is the secret.
    const std::string secret = ReadFile(dir + "/control-secret");
    EXPECT_TRUE(call(secret, [&](grpc::ClientContext* c) { return stub->GetInfo(c, {}, &info); }).ok());
  }
  // Nothing stopped, nothing freed: the system serves on.
  Generated g = Generate(system.stub(), Greedy("Once upon a time", 16));
  EXPECT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.tokens.size(), 16u);
  EXPECT_NE(system.Log().find("refused Shutdown"), std::string::npos);
  ExpectCleanShutdown(system);
}

TEST(ControlPlane, PublicPortWithApiKeyAndTls) {
  const std::string dir = MakeTempDir("tls");
  const std::string cert = dir + "/cert.pem", key = dir + "/key.pem";
  const std::string cmd = absl::StrCat(
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ", key, " -out ", cert,
      " -days 1 -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 >/dev/null 2>&1");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "openssl is needed (launch/setup.sh installs it)";
  EllmSystem system({"--model=" + kStories, "--attn-workers=1", "--no-numactl", "--api-key=open-sesame",
                     "--tls-cert=" + cert, "--tls-key=" + key});
  ASSERT_TRUE(system.ready()) << system.Log();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ReadFile(cert);
  auto tls = ellm::v1::Ellm::NewStub(
      grpc::CreateChannel(absl::StrCat("localhost:", system.port()), grpc::SslCredentials(ssl)));
  auto generate = [&](ellm::v1::Ellm::Stub* stub, const std::string& key) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (!key.empty()) ctx.AddMetadata("authorization", "Bearer " + key);
    auto reader = stub->Generate(&ctx, Greedy("Once upon a time", 8));
    ellm::v1::GenerateResponse resp;
    int tokens = 0;
    while (reader->Read(&resp)) tokens += resp.token_ids_size();
    grpc::Status st = reader->Finish();
    return std::make_pair(st, tokens);
  };
  EXPECT_EQ(generate(tls.get(), "").first.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(generate(tls.get(), "wrong").first.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  auto [st, tokens] = generate(tls.get(), "open-sesame");
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(tokens, 8);
  // Plaintext does not reach a TLS port.
  EXPECT_FALSE(generate(system.stub(), "open-sesame").first.ok());
  // The key is not on any command line.
  for (pid_t child : ChildrenOf(system.pid())) EXPECT_EQ(Cmdline(child).find("open-sesame"), std::string::npos);
  ExpectCleanShutdown(system);
  fs::remove_all(dir);
}

TEST(ControlPlane, ANonLoopbackHostNeedsAKeyOrAnExplicitChoice) {
  {
    EllmSystem system({"--model=" + kStories, "--host=0.0.0.0", "--no-numactl"});
    EXPECT_FALSE(system.ready());
    const int status = system.WaitExit();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2);
    EXPECT_NE(system.Log().find("needs --api-key"), std::string::npos) << system.Log();
  }
  EllmSystem open({"--model=" + kStories, "--host=0.0.0.0", "--insecure-public", "--no-numactl", "--attn-workers=1"});
  ASSERT_TRUE(open.ready()) << open.Log();
  EXPECT_NE(open.Log().find("listens beyond this machine"), std::string::npos);
  EXPECT_TRUE(Generate(open.stub(), Greedy("Once", 4)).status.ok());
  ExpectCleanShutdown(open);
}

}  // namespace
}  // namespace ellm
