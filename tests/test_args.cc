// core/args.h, the one command-line parser of every ellm binary, and the
// names it reads (core/backend_names.h, core/cpu_features.h's Isa).
#include "core/args.h"

#include <string>
#include <vector>

#include "core/backend_names.h"
#include "core/cpu_features.h"
#include "gtest/gtest.h"

namespace ellm {
namespace {

// Parses `words` (after a program name) with the flags a test binary declares.
absl::Status ParseWords(Args& args, std::vector<std::string> words) {
  words.insert(words.begin(), "prog");
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  return args.Parse(static_cast<int>(argv.size()), argv.data());
}

Args TestFlags() {
  Args a("prog: a test");
  a.Flag("max-batch", "16", "most sequences");
  a.Flag("kv-heads", "", "BEGIN:END");
  a.Flag("ratio", "0.5", "a number");
  a.Flag("recover", "true", "a switch", true);
  return a;
}

TEST(Args, ReadsBothSpellingsDefaultsAndPositionals) {
  Args a = TestFlags();
  ASSERT_TRUE(ParseWords(a, {"--max-batch", "8", "--kv-heads=0:4", "text", "--recover=false"}).ok());
  EXPECT_EQ(*a.GetInt("max-batch"), 8);
  EXPECT_EQ(a.Get("kv-heads"), "0:4");
  EXPECT_DOUBLE_EQ(*a.GetDouble("ratio"), 0.5);
  EXPECT_FALSE(a.IsSet("ratio"));
  EXPECT_TRUE(a.IsSet("max-batch"));
  EXPECT_FALSE(a.GetBool("recover"));
  EXPECT_EQ(a.positional(), std::vector<std::string>{"text"});
  EXPECT_EQ(a.GetAll("kv-heads"), std::vector<std::string>{"0:4"});
  EXPECT_TRUE(a.GetAll("ratio").empty());

  // A flag given again: Get has the last value, GetAll every one in order
  // (the client's --stop).
  Args r = TestFlags();
  ASSERT_TRUE(ParseWords(r, {"--kv-heads", "a", "--kv-heads=b", "--kv-heads", ""}).ok());
  EXPECT_EQ(r.Get("kv-heads"), "");
  EXPECT_EQ(r.GetAll("kv-heads"), (std::vector<std::string>{"a", "b", ""}));

  Args b = TestFlags();
  ASSERT_TRUE(ParseWords(b, {"--recover"}).ok());
  EXPECT_TRUE(b.GetBool("recover"));
  Args c = TestFlags();
  ASSERT_TRUE(ParseWords(c, {}).ok());
  EXPECT_TRUE(c.GetBool("recover"));  // its default
}

TEST(Args, RefusesWhatItCannotRead) {
  for (const std::vector<std::string>& words :
       {std::vector<std::string>{"--max_batch=8"},  // the underscore spelling is gone
        {"--unknown"},
        {"--max-batch"},  // no value
        {"--recover=maybe"},
        {"--recover=1"}}) {
    Args a = TestFlags();
    EXPECT_EQ(ParseWords(a, words).code(), absl::StatusCode::kInvalidArgument) << words[0];
  }
  Args a = TestFlags();
  ASSERT_TRUE(ParseWords(a, {"--max-batch=eight"}).ok());
  EXPECT_EQ(a.GetInt("max-batch").status().code(), absl::StatusCode::kInvalidArgument);
  int v = 0;
  EXPECT_FALSE(a.GetInts({{"max-batch", &v}}).ok());

  Args help = TestFlags();
  ASSERT_TRUE(ParseWords(help, {"--help"}).ok());
  EXPECT_TRUE(help.help());
  EXPECT_NE(help.HelpText().find("--max-batch VALUE"), std::string::npos) << help.HelpText();
  EXPECT_NE(help.HelpText().find("(default: 16)"), std::string::npos);
  // Every description starts in one column, also after a long name and for --help.
  Args wide("usage");
  wide.Flag("a-rather-long-flag-name-here", "1", "long one");
  wide.Flag("x", "2", "short one");
  wide.Flag("on-switch", "true", "a switch that is on", true);
  wide.Flag("off-switch", "", "a switch that is off", true);
  const std::string text = wide.HelpText();
  for (const char* d : {"long one", "short one", "a switch that is on", "a switch that is off", "show this help"}) {
    const size_t at = text.find(d);
    ASSERT_NE(at, std::string::npos) << d;
    EXPECT_EQ(at - text.rfind('\n', at) - 1, 29u) << d << " in\n" << text;
  }
  EXPECT_NE(text.find("a switch that is on (default: true; --on-switch=false turns it off)"), std::string::npos) << text;
  EXPECT_EQ(text.find("a switch that is off (default"), std::string::npos) << text;
}

TEST(Names, EachParsesItsOwnSpellingAndNothingElse) {
  for (MlpBackendKind k : {MlpBackendKind::kAuto, MlpBackendKind::kCpu, MlpBackendKind::kCuda}) {
    EXPECT_EQ(*ParseMlpBackend(MlpBackendName(k)), k);
  }
  for (CpuWeights w : {CpuWeights::kNative, CpuWeights::kF32}) {
    EXPECT_EQ(*ParseCpuWeights(CpuWeightsName(w)), w);
  }
  EXPECT_EQ(*ParseIsa("auto"), Isa::kAuto);
  for (Isa isa : kAllIsas) EXPECT_EQ(*ParseIsa(IsaName(isa)), isa);
  for (const char* bad : {"", "gpu", "CPU", "ref", "avx2vnni", "avx512vnni"}) {
    EXPECT_FALSE(ParseMlpBackend(bad).ok()) << bad;
    EXPECT_FALSE(ParseIsa(bad).ok()) << bad;
  }
  EXPECT_FALSE(ParseCpuWeights("f16").ok());
  EXPECT_TRUE(CpuHas(Isa::kReference));
  EXPECT_TRUE(CpuHas(Isa::kAuto));
}

}  // namespace
}  // namespace ellm
