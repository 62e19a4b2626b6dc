// ModelConfig::FromGguf on the real files and on small files made here.
#include "core/model_config.h"

#include <memory>
#include <string>
#include <string_view>
#include <vector>

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
  w.SetStringArray("tokenizer.ggml.tokens", {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"});
  return w;
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

TEST(ModelConfigTest, UnsupportedArchitectureIsNamed) {
  GgufWriter w = MinimalLlama();
  w.SetString("general.architecture", "xyz");
  EXPECT_TRUE(IsInvalid(ConfigOf(w).status(),
                        "unsupported architecture 'xyz' (ellm supports: llama, qwen2)"));
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
  EXPECT_EQ(c->norm_eps, 1e-5f);
  EXPECT_EQ(c->vocab_size, 10);
  EXPECT_EQ(c->gqa_ratio(), 1);
}

TEST(ModelConfigTest, OptionalKeysHonoured) {
  GgufWriter w = MinimalLlama();
  w.SetString("general.name", "tiny");
  w.SetUint32("llama.attention.head_count_kv", 2);
  w.SetUint32("llama.attention.key_length", 16);  // head_dim need not be dim / heads
  w.SetUint32("llama.attention.value_length", 16);
  w.SetUint32("llama.rope.dimension_count", 12);
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
  EXPECT_EQ(c->rope_dims, 12);
  EXPECT_EQ(c->rope_base, 500000.0f);
  EXPECT_EQ(c->norm_eps, 1e-6f);
}

TEST(ModelConfigTest, VocabFromEmbeddingWithoutTokens) {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetUint32("llama.block_count", 1);
  w.SetUint32("llama.embedding_length", 4);
  w.SetUint32("llama.feed_forward_length", 8);
  w.SetUint32("llama.context_length", 16);
  w.SetUint32("llama.attention.head_count", 2);
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
                          "llama.attention.head_count"}) {
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

}  // namespace
}  // namespace ellm
