// ModelConfig::FromGguf on the real files and on small files made here.
#include "core/model_config.h"

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/kv_heads.h"
#include "core/model_maker.h"
#include "core/weights.h"
#include "gtest/gtest.h"

namespace ellm {
namespace {

const std::string kModels = ELLM_MODELS_DIR;

testing::AssertionResult IsInvalid(const absl::Status& status, std::string_view substring) {
  if (status.ok()) return testing::AssertionFailure() << "status is OK";
  if (status.code() != absl::StatusCode::kInvalidArgument) {
    return testing::AssertionFailure() << "wrong code: " << status;
  }
  if (std::string(status.message()).find(substring) == std::string::npos) {
    return testing::AssertionFailure() << "message lacks '" << substring << "': " << status;
  }
  return testing::AssertionSuccess();
}

absl::StatusOr<ModelConfig> ConfigOfFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  return ModelConfig::FromGguf(*file);
}

absl::StatusOr<ModelConfig> ConfigOf(const GgufWriter& writer) {
  ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::FromBytes(writer.ToBytes()));
  return ModelConfig::FromGguf(*file);
}

// The keys a llama file must have, and a 10-token vocabulary; nothing optional.
GgufWriter MinimalLlama() {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetUint32("llama.block_count", 2);
  w.SetUint32("llama.embedding_length", 48);
  w.SetUint32("llama.feed_forward_length", 128);
  w.SetUint32("llama.context_length", 256);
  w.SetUint32("llama.attention.head_count", 6);
  w.SetFloat32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.SetStringArray("tokenizer.ggml.tokens", {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"});
  return w;
}

// A vocabulary of n distinct tokens (its size identifies a model family).
std::vector<std::string> NumberedTokens(int n) {
  std::vector<std::string> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = absl::StrCat("t", i);
  return tokens;
}

TEST(ModelConfigTest, Stories260K) {
  absl::StatusOr<ModelConfig> c = ConfigOfFile(kModels + "/stories260K.gguf");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, "llama");
  EXPECT_EQ(c->name, "llama");
  EXPECT_EQ(c->n_layers, 5);
  EXPECT_EQ(c->dim, 64);
  EXPECT_EQ(c->ffn_dim, 172);
  EXPECT_EQ(c->n_heads, 8);
  EXPECT_EQ(c->n_kv_heads, 4);
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_EQ(c->rope_dims, 8);
  EXPECT_EQ(c->rope_base, 10000.0f);  // no freq_base key: the default
  EXPECT_EQ(c->norm_eps, 1e-5f);
  EXPECT_EQ(c->context_length, 2048);
  EXPECT_EQ(c->vocab_size, 512);
  EXPECT_EQ(c->q_dim(), 64);
  EXPECT_EQ(c->kv_dim(), 32);
  EXPECT_EQ(c->gqa_ratio(), 2);
  const std::string s = c->DebugString();
  EXPECT_EQ(s.find('\n'), std::string::npos);
  EXPECT_NE(s.find("layers=5"), std::string::npos) << s;
  EXPECT_NE(s.find("kv_heads=4"), std::string::npos) << s;
}

TEST(ModelConfigTest, LlamaTinyRandom) {
  absl::StatusOr<ModelConfig> c = ConfigOfFile(kModels + "/llama-2-tiny-random.gguf");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "LLaMA v2");
  EXPECT_EQ(c->n_layers, 1);
  EXPECT_EQ(c->dim, 8);
  EXPECT_EQ(c->ffn_dim, 32);
  EXPECT_EQ(c->n_heads, 2);
  EXPECT_EQ(c->n_kv_heads, 2);
  EXPECT_EQ(c->head_dim, 4);
  EXPECT_EQ(c->rope_dims, 4);
  EXPECT_EQ(c->context_length, 4096);
  EXPECT_EQ(c->vocab_size, 32000);
}

TEST(ModelConfigTest, VocabOnlyFileHasHyperparameters) {
  absl::StatusOr<ModelConfig> c = ConfigOfFile(kModels + "/vocab/ggml-vocab-llama-spm.gguf");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->n_layers, 32);
  EXPECT_EQ(c->dim, 4096);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->vocab_size, 32000);
}

// A layer count the tensors do not back is an error before anything is sized
// by it (a fuzzed file with block_count 2^31 - 1 asked for 180 GB).
TEST(ModelConfigTest, LayersWithoutTensorsAreAnErrorBeforeAnyAllocation) {
  MakeModelOptions options;
  options.vocab_from = kModels + "/stories260K.gguf";
  absl::StatusOr<GgufWriter> writer = MakeRandomModel(options);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const uint32_t layers : {3u, 0x7fffffffu}) {
    writer->SetUint32("llama.block_count", layers);
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(writer->ToBytes());
    ASSERT_TRUE(file.ok()) << file.status();
    absl::StatusOr<ModelConfig> c = ModelConfig::FromGguf(**file);
    ASSERT_TRUE(c.ok()) << c.status();
    absl::StatusOr<ModelWeights> w = LoadWeights(**file, *c);
    EXPECT_TRUE(IsInvalid(w.status(), absl::StrCat("declares ", layers, " layers")));
  }
  writer->SetUint32("llama.block_count", 2);
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(writer->ToBytes());
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<ModelWeights> w = LoadWeights(**file, *ModelConfig::FromGguf(**file));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->layers.size(), 2u);
}

TEST(ModelConfigTest, UnsupportedArchitectureIsNamed) {
  GgufWriter w = MinimalLlama();
  w.SetString("general.architecture", "xyz");
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(),
                        "unsupported architecture 'xyz' (ellm supports: llama, qwen2, qwen3)"));
}

TEST(ModelConfigTest, Qwen2ReadsItsHyperparametersAndArchitectureTraits) {
  absl::StatusOr<ModelConfig> c = ConfigOfFile(kModels + "/vocab/qwen2.5-vocab-derived.gguf");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, "qwen2");
  EXPECT_EQ(c->n_layers, 24);
  EXPECT_EQ(c->dim, 896);
  EXPECT_EQ(c->n_heads, 14);
  EXPECT_EQ(c->n_kv_heads, 2);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_FLOAT_EQ(c->rope_base, 1e6f);
  EXPECT_FLOAT_EQ(c->norm_eps, 1e-6f);
  EXPECT_EQ(c->vocab_size, 151936);
  EXPECT_TRUE(c->rope_neox);
  EXPECT_TRUE(c->qkv_bias);
  absl::StatusOr<ModelConfig> llama = ConfigOf(MinimalLlama());
  ASSERT_TRUE(llama.ok());
  EXPECT_FALSE(llama->rope_neox);
  EXPECT_FALSE(llama->qkv_bias);
}

TEST(ModelConfigTest, DefaultsApplied) {
  absl::StatusOr<ModelConfig> c = ConfigOf(MinimalLlama());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "");
  EXPECT_EQ(c->n_kv_heads, 6);  // = n_heads
  EXPECT_EQ(c->head_dim, 8);    // = dim / n_heads
  EXPECT_EQ(c->rope_dims, 8);   // = head_dim
  EXPECT_EQ(c->rope_base, 10000.0f);
  EXPECT_EQ(c->vocab_size, 10);
  EXPECT_EQ(c->gqa_ratio(), 1);
}

TEST(ModelConfigTest, OptionalKeysHonoured) {
  GgufWriter w = MinimalLlama();
  w.SetString("general.name", "tiny");
  w.SetUint32("llama.attention.head_count_kv", 2);
  w.SetUint32("llama.attention.key_length", 16);  // head_dim need not be dim / heads
  w.SetUint32("llama.attention.value_length", 16);
  w.SetUint32("llama.rope.dimension_count", 16);
  w.SetFloat32("llama.rope.freq_base", 500000.0f);
  w.SetFloat32("llama.attention.layer_norm_rms_epsilon", 1e-6f);
  absl::StatusOr<ModelConfig> c = ConfigOf(w);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "tiny");
  EXPECT_EQ(c->n_kv_heads, 2);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->q_dim(), 96);
  EXPECT_EQ(c->kv_dim(), 32);
  EXPECT_EQ(c->gqa_ratio(), 3);
  EXPECT_EQ(c->rope_dims, 16);
  EXPECT_EQ(c->rope_base, 500000.0f);
  EXPECT_EQ(c->norm_eps, 1e-6f);
  // Partial rotary (fewer rotated dimensions than the head's) is refused,
  // as llama.cpp refuses it for these architectures: it was served, rotating
  // the first 12 only.
  w.SetUint32("llama.rope.dimension_count", 12);
  c = ConfigOf(w);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("partial rotary"), std::string::npos) << c.status();
}

TEST(ModelConfigTest, VocabFromEmbeddingWithoutTokens) {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetUint32("llama.block_count", 1);
  w.SetUint32("llama.embedding_length", 4);
  w.SetUint32("llama.feed_forward_length", 8);
  w.SetUint32("llama.context_length", 16);
  w.SetUint32("llama.attention.head_count", 2);
  w.SetFloat32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  // token_embd.weight is [dim, vocab] in GGUF order.
  ASSERT_TRUE(w.AddTensor("token_embd.weight", {4, 7}, DType::kF32, std::string(4 * 7 * 4, '\0'))
                  .ok());
  absl::StatusOr<ModelConfig> c = ConfigOf(w);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->vocab_size, 7);
}

TEST(ModelConfigTest, NoVocabulary) {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetUint32("llama.block_count", 1);
  w.SetUint32("llama.embedding_length", 4);
  w.SetUint32("llama.feed_forward_length", 8);
  w.SetUint32("llama.context_length", 16);
  w.SetUint32("llama.attention.head_count", 2);
  w.SetFloat32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), "cannot determine the vocabulary size"));
}

TEST(ModelConfigTest, MissingArchitecture) {
  GgufWriter w;
  w.SetUint32("llama.block_count", 1);
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), "missing required key 'general.architecture'"));
}

TEST(ModelConfigTest, MissingRequiredKeyIsNamed) {
  for (const char* key : {"llama.block_count", "llama.embedding_length",
                          "llama.feed_forward_length", "llama.context_length",
                          "llama.attention.head_count", "llama.attention.layer_norm_rms_epsilon"}) {
    SCOPED_TRACE(key);
    // Rebuild without `key`, keeping the rest of MinimalLlama.
    absl::StatusOr<std::unique_ptr<GgufFile>> full = GgufFile::FromBytes(MinimalLlama().ToBytes());
    ASSERT_TRUE(full.ok());
    GgufWriter w;
    for (const auto& [k, v] : (*full)->metadata()) {
      if (k != key) w.SetValue(k, v);
    }
    EXPECT_TRUE(
        IsInvalid(ConfigOf(w).status(), std::string("missing required key '") + key + "'"));
  }
}

TEST(ModelConfigTest, WrongTypeIsNamed) {
  GgufWriter w = MinimalLlama();
  w.SetString("llama.block_count", "five");
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), "key 'llama.block_count' is of type string"));
}

TEST(ModelConfigTest, HeadsNotDivisibleByKvHeads) {
  GgufWriter w = MinimalLlama();
  w.SetUint32("llama.attention.head_count_kv", 4);
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), "n_heads 6 is not a multiple of n_kv_heads 4"));
}

TEST(ModelConfigTest, DimNotDivisibleByHeads) {
  GgufWriter w = MinimalLlama();
  w.SetUint32("llama.attention.head_count", 5);
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(),
                        "llama.embedding_length 48 is not a multiple of "
                        "llama.attention.head_count 5"));
}

TEST(ModelConfigTest, RopeDims) {
  GgufWriter w = MinimalLlama();
  w.SetUint32("llama.rope.dimension_count", 7);
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), "rope_dims 7 must be even"));
  w.SetUint32("llama.rope.dimension_count", 10);  // head_dim is 8
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), "at most head_dim 8"));
}

TEST(ModelConfigTest, NonPositiveSizes) {
  GgufWriter w = MinimalLlama();
  w.SetUint32("llama.context_length", 0);
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(),
                        "context_length (llama.context_length) must be positive, got 0"));
  w = MinimalLlama();
  w.SetInt32("llama.block_count", -1);
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), "n_layers (llama.block_count) must be positive"));
  w = MinimalLlama();
  w.SetUint64("llama.feed_forward_length", uint64_t{1} << 40);
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), "llama.feed_forward_length = 1099511627776 is "
                                              "out of range"));
}

TEST(ModelConfigTest, BadFloats) {
  GgufWriter w = MinimalLlama();
  w.SetFloat32("llama.rope.freq_base", 0.0f);
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), "rope_base 0 must be positive"));
  w = MinimalLlama();
  w.SetFloat32("llama.attention.layer_norm_rms_epsilon", -1.0f);
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), "norm_eps -1 must be positive"));
}

TEST(ModelConfigTest, ValueLengthMustMatchKeyLength) {
  GgufWriter w = MinimalLlama();
  w.SetUint32("llama.attention.value_length", 4);
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), "llama.attention.value_length 4 differs"));
}

TEST(ModelConfigTest, ValidateHandMadeConfig) {
  // Built in code, not read from a file (FromGguf validates on its own).
  ModelConfig hand;
  hand.arch = "llama";
  hand.n_layers = 2;
  hand.dim = 64;
  hand.ffn_dim = 128;
  hand.n_heads = 8;
  hand.n_kv_heads = 2;
  hand.head_dim = 8;
  hand.rope_dims = 8;
  hand.context_length = 32;
  hand.vocab_size = 100;
  EXPECT_TRUE(hand.Validate().ok()) << hand.Validate();
  absl::StatusOr<ModelConfig> c = ConfigOf(MinimalLlama());
  ASSERT_TRUE(c.ok()) << c.status();
  ModelConfig bad = hand;
  bad.n_heads = 7;  // not a multiple of n_kv_heads
  EXPECT_TRUE(IsInvalid(bad.Validate(), "multiple"));
  bad = *c;
  bad.n_kv_heads = 0;
  EXPECT_TRUE(IsInvalid(bad.Validate(), "n_kv_heads"));
  bad = *c;
  bad.arch = "mamba";
  EXPECT_TRUE(IsInvalid(bad.Validate(), "unsupported architecture 'mamba'"));
}

TEST(ModelConfigTest, RopeScalingKeysAsLlamaCppReadsThem) {
  absl::StatusOr<ModelConfig> c = ConfigOf(MinimalLlama());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
  EXPECT_TRUE(c->rope_freq_factors.empty());

  GgufWriter w = MinimalLlama();
  w.SetString("llama.rope.scaling.type", "yarn");
  w.SetFloat32("llama.rope.scaling.factor", 4);
  w.SetUint32("llama.rope.scaling.original_context_length", 64);
  w.SetBool("llama.rope.scaling.finetuned", true);  // informational
  c = ConfigOf(w);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kYarn);
  EXPECT_EQ(c->rope_scaling.factor, 4);
  EXPECT_EQ(c->rope_scaling.original_context, 64);
  EXPECT_EQ(c->rope_scaling.attn_factor, 1);
  EXPECT_NE(c->DebugString().find("yarn(x4, original context 64)"), std::string::npos);

  // A yarn factor below 1: refused (it was served with a magnitude llama.cpp
  // no longer uses).
  w = MinimalLlama();
  w.SetString("llama.rope.scaling.type", "yarn");
  w.SetFloat32("llama.rope.scaling.factor", 0.5f);
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), "factor below 1"));

  // yarn without an original context: the model's context.
  w = MinimalLlama();
  w.SetString("llama.rope.scaling.type", "yarn");
  w.SetFloat32("llama.rope.scaling.factor", 2);
  w.SetFloat32("llama.rope.scaling.attn_factor", 0.75f);
  c = ConfigOf(w);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.original_context, 256);
  EXPECT_EQ(c->rope_scaling.attn_factor, 0.75f);

  // A factor without a type is linear (llama.cpp's default); the old key too.
  for (const char* key : {"llama.rope.scaling.factor", "llama.rope.scale_linear"}) {
    w = MinimalLlama();
    w.SetFloat32(key, 2);
    c = ConfigOf(w);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kLinear) << key;
    EXPECT_EQ(c->rope_scaling.factor, 2) << key;
  }
  // "none" ignores the factor.
  w = MinimalLlama();
  w.SetString("llama.rope.scaling.type", "none");
  w.SetFloat32("llama.rope.scaling.factor", 8);
  c = ConfigOf(w);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
}

TEST(ModelConfigTest, RopeFreqsTensorIsRead) {
  GgufWriter w = MinimalLlama();
  const std::vector<float> f = Llama3RopeFactors(8, 10000, 8, 1, 4, 64);
  ASSERT_TRUE(w.AddTensor("rope_freqs.weight", {4}, DType::kF32,
                          std::string(reinterpret_cast<const char*>(f.data()), 16))
                  .ok());
  absl::StatusOr<ModelConfig> c = ConfigOf(w);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_freq_factors, f);
  EXPECT_NE(c->DebugString().find("rope_freqs=llama3"), std::string::npos);

  // Wrong length, non-positive factors, and an architecture that has none.
  GgufWriter bad = MinimalLlama();
  ASSERT_TRUE(bad.AddTensor("rope_freqs.weight", {3}, DType::kF32, std::string(12, '\0')).ok());
  EXPECT_TRUE(IsInvalid(ConfigOf(bad).status(), "'rope_freqs.weight' has shape {3}, expected {4}"));
  bad = MinimalLlama();
  ASSERT_TRUE(bad.AddTensor("rope_freqs.weight", {4}, DType::kF32, std::string(16, '\0')).ok());
  EXPECT_TRUE(IsInvalid(ConfigOf(bad).status(), "rope_freqs.weight[0] = 0 must be a positive factor"));
  bad = MinimalLlama();
  bad.SetString("general.architecture", "qwen2");
  absl::StatusOr<std::unique_ptr<GgufFile>> llama_keys = GgufFile::FromBytes(MinimalLlama().ToBytes());
  ASSERT_TRUE(llama_keys.ok());
  GgufWriter qwen;
  for (const auto& [k, v] : (*llama_keys)->metadata()) {
    std::string key = k;
    if (key.rfind("llama.", 0) == 0) key = "qwen2." + key.substr(6);
    qwen.SetValue(key, v);
  }
  qwen.SetString("general.architecture", "qwen2");
  ASSERT_TRUE(qwen.AddTensor("rope_freqs.weight", {4}, DType::kF32,
                             std::string(reinterpret_cast<const char*>(f.data()), 16))
                  .ok());
  EXPECT_TRUE(IsInvalid(ConfigOf(qwen).status(), "tensor 'rope_freqs.weight'"));
}

// A Llama 3.1 converted before llama.cpp wrote rope_freqs.weight looks like
// a Llama 3 with a long context: refused, never served unscaled.
TEST(ModelConfigTest, ALlama31WithoutItsRopeFreqsIsRefused) {
  std::vector<std::string> tokens = NumberedTokens(128256);
  const auto llama3 = [&](uint32_t context) {
    GgufWriter w = MinimalLlama();
    w.SetStringArray("tokenizer.ggml.tokens", tokens);
    w.SetFloat32("llama.rope.freq_base", 500000.0f);
    w.SetUint32("llama.context_length", context);
    return w;
  };
  EXPECT_TRUE(IsInvalid(ConfigOf(llama3(131072)).status(), "without its rope_freqs.weight tensor"));
  // A fine-tune that added tokens too (it was served).
  tokens.push_back("<|added_1|>");
  tokens.push_back("<|added_2|>");
  EXPECT_TRUE(IsInvalid(ConfigOf(llama3(131072)).status(), "without its rope_freqs.weight tensor"));
  tokens.resize(128256);
  // Llama 3 itself (8192), and a Llama 3.1 with its factors, load.
  absl::StatusOr<ModelConfig> c = ConfigOf(llama3(8192));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->vocab_size, 128256);
  GgufWriter with_factors = llama3(131072);
  const std::vector<float> f = Llama3RopeFactors(8, 500000, 8, 1, 4, 8192);
  ASSERT_TRUE(with_factors.AddTensor("rope_freqs.weight", {4}, DType::kF32,
                                     std::string(reinterpret_cast<const char*>(f.data()), 16))
                  .ok());
  c = ConfigOf(with_factors);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_freq_factors, f);
}

// Mistral-7B v0.1's sliding window (4096) is in no key: its shape gives it
// away, and its context is capped to the window, where full attention is
// the same. v0.2's (rope base 1e6, no window) is not.
TEST(ModelConfigTest, MistralV01IsCappedToItsWindow) {
  std::vector<std::string> tokens = NumberedTokens(32000);
  const auto mistral = [&](float rope_base) {
    GgufWriter w = MinimalLlama();
    w.SetUint32("llama.block_count", 32);
    w.SetUint32("llama.embedding_length", 4096);
    w.SetUint32("llama.feed_forward_length", 14336);
    w.SetUint32("llama.attention.head_count", 32);
    w.SetUint32("llama.attention.head_count_kv", 8);
    w.SetUint32("llama.context_length", 32768);
    w.SetFloat32("llama.rope.freq_base", rope_base);
    w.SetStringArray("tokenizer.ggml.tokens", tokens);
    return w;
  };
  absl::StatusOr<ModelConfig> c = ConfigOf(mistral(10000.0f));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->context_length, 4096);
  c = ConfigOf(mistral(1e6f));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->context_length, 32768);
  // A fine-tune with added tokens (OpenHermes-2.5: ChatML's two, 32002): it
  // kept its 32768 and full attention.
  tokens.push_back("<|im_end|>");
  tokens.push_back("<|im_start|>");
  c = ConfigOf(mistral(10000.0f));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->context_length, 4096);
}

// Every key and tensor that would change the computation, and that ellm
// does not implement, is refused by name (a model ellm cannot compute
// faithfully never serves).
TEST(ModelConfigTest, UnimplementedFeaturesAreRefusedByName) {
  struct Case {
    const char* key;
    GgufValue value;
    const char* needle;
  };
  auto u32 = [](int64_t v) {
    GgufValue g;
    g.type = GgufValueType::kUint32;
    g.i = v;
    return g;
  };
  auto f32 = [](double v) {
    GgufValue g;
    g.type = GgufValueType::kFloat32;
    g.f = v;
    return g;
  };
  auto str = [](const char* v) {
    GgufValue g;
    g.type = GgufValueType::kString;
    g.s = v;
    return g;
  };
  auto boolean = [](bool v) {
    GgufValue g;
    g.type = GgufValueType::kBool;
    g.b = v;
    return g;
  };
  const Case cases[] = {
      {"llama.rope.scaling.type", str("longrope"), "LongRoPE"},
      {"llama.rope.scaling.type", str("dynamic"), "'dynamic'"},
      {"llama.attention.sliding_window", u32(4096), "sliding attention window"},
      {"llama.attn_logit_softcapping", f32(50), "attention logit soft-capping"},
      {"llama.final_logit_softcapping", f32(30), "final logit soft-capping"},
      {"llama.expert_count", u32(8), "mixture of experts"},
      {"llama.attention.causal", boolean(false), "non-causal attention"},
      {"llama.attention.layer_norm_epsilon", f32(1e-5), "LayerNorm"},
      {"llama.attention.scale", f32(0.1), "attention scale"},
      {"llama.embedding_scale", f32(12), "scaled embeddings"},
      {"llama.logit_scale", f32(0.2), "scaled logits"},
      {"llama.some_future_key", u32(1), "'llama.some_future_key' is unknown to ellm"},
      {"gemma2.attention.sliding_window", u32(4096), "'gemma2.attention.sliding_window' is unknown"},
      {"split.count", u32(3), "split over 3 GGUF files"},
  };
  for (const Case& k : cases) {
    GgufWriter w = MinimalLlama();
    w.SetValue(k.key, k.value);
    const absl::Status st = ConfigOf(w).status();
    EXPECT_TRUE(IsInvalid(st, k.needle)) << k.key;
    EXPECT_NE(std::string(st.message()).find(k.key == std::string("split.count") ? "split" : k.key),
              std::string::npos)
        << st;
  }
  // Harmless values of the same keys load.
  for (const Case& k : {Case{"llama.expert_count", u32(0), ""}, Case{"llama.attention.causal", boolean(true), ""},
                        Case{"split.count", u32(1), ""}, Case{"llama.vocab_size", u32(10), ""},
                        Case{"quantize.imatrix.file", str("x.dat"), ""}}) {
    GgufWriter w = MinimalLlama();
    w.SetValue(k.key, k.value);
    EXPECT_TRUE(ConfigOf(w).ok()) << k.key << ": " << ConfigOf(w).status();
  }
  // Tensors outside the architecture: biases llama does not have, MoE
  // routers, layers beyond block_count, q/k norms outside qwen3.
  for (const char* name : {"blk.0.attn_q.bias", "blk.0.attn_output.bias", "blk.0.ffn_gate_inp.weight",
                           "blk.2.attn_q.weight", "blk.x.attn_q.weight", "output.bias",
                           "blk.1.attn_q_norm.weight", "rope_factors_long.weight",
                           // layer numbers the loader never reads (they were ignored)
                           "blk.01.attn_q.weight", "blk.+1.attn_q.weight", "blk. 1.attn_q.weight"}) {
    GgufWriter w = MinimalLlama();
    ASSERT_TRUE(w.AddTensor(name, {4}, DType::kF32, std::string(16, '\0')).ok());
    EXPECT_TRUE(IsInvalid(ConfigOf(w).status(), absl::StrCat("tensor '", name, "'"))) << name;
  }
}

TEST(ModelConfigTest, Qwen3Traits) {
  GgufWriter w;
  w.SetString("general.architecture", "qwen3");
  w.SetUint32("qwen3.block_count", 2);
  w.SetUint32("qwen3.embedding_length", 64);
  w.SetUint32("qwen3.feed_forward_length", 128);
  w.SetUint32("qwen3.context_length", 256);
  w.SetUint32("qwen3.attention.head_count", 4);
  w.SetUint32("qwen3.attention.head_count_kv", 2);
  w.SetUint32("qwen3.attention.key_length", 32);
  w.SetUint32("qwen3.attention.value_length", 32);
  w.SetFloat32("qwen3.attention.layer_norm_rms_epsilon", 1e-6f);
  w.SetStringArray("tokenizer.ggml.tokens", {"a", "b"});
  absl::StatusOr<ModelConfig> c = ConfigOf(w);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->rope_neox);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_EQ(c->q_dim(), 128);  // wider than the embedding, as Qwen3 has it
  ModelConfig both = *c;
  both.qkv_bias = true;
  EXPECT_TRUE(IsInvalid(both.Validate(), "biases together with q/k norms"));
}

TEST(KvHeads, ParsesSplitsAndChecksCovers) {
  auto h = KvHeads::Parse("2:6");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*h, (KvHeads{2, 6}));
  EXPECT_EQ(h->count(), 4);
  EXPECT_EQ(h->Flag(), "2:6");
  EXPECT_EQ(h->ToString(), "[2, 6)");
  for (const char* bad : {"", "3", "3:3", "4:2", "-1:2", "a:b", "1:2:3", "1:"}) {
    EXPECT_EQ(KvHeads::Parse(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(SplitKvHeads(8, 2, 0), (KvHeads{0, 4}));
  EXPECT_EQ(SplitKvHeads(8, 2, 1), (KvHeads{4, 8}));
  EXPECT_EQ(SplitKvHeads(8, 4, 3), (KvHeads{6, 8}));
  // Uneven: parts differ by at most one head and still cover every head.
  EXPECT_EQ(SplitKvHeads(5, 2, 0), (KvHeads{0, 2}));
  EXPECT_EQ(SplitKvHeads(5, 2, 1), (KvHeads{2, 5}));

  KvHeadCover good;
  EXPECT_TRUE(good.Add({0, 1}).ok());
  EXPECT_TRUE(good.Add({1, 3}).ok());
  EXPECT_TRUE(good.Finish(3).ok());
  EXPECT_TRUE(IsInvalid(good.Finish(4), "cover KV heads [0, 3)"));
  KvHeadCover gap;
  EXPECT_TRUE(gap.Add({0, 1}).ok());
  EXPECT_TRUE(IsInvalid(gap.Add({2, 3}), "shard 1 has KV heads [2, 3)"));
  KvHeadCover empty;
  EXPECT_TRUE(IsInvalid(empty.Add({0, 0}), "shard 0"));
  EXPECT_TRUE(IsInvalid(KvHeadCover().Finish(2), "[0, 0)"));
}

}  // namespace
}  // namespace ellm
