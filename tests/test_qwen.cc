// The qwen2 and qwen3 architectures (NeoX RoPE and tied embeddings; qwen2's
// Q/K/V biases, qwen3's per-head q/k RMSNorm before RoPE): the reference
// forward checked against an independent double-precision forward written
// here from the architectures' definitions; and ellm's model maker.
#include <cmath>
#include <complex>
#include <random>
#include <vector>

#include "core/gguf.h"
#include "core/kernels.h"
#include "core/model_config.h"
#include "core/model_maker.h"
#include "core/reference_forward.h"
#include "core/weights.h"
#include "gtest/gtest.h"

namespace ellm {
namespace {

const std::string kQwenVocab = ELLM_MODELS_DIR "/vocab/qwen2.5-vocab-derived.gguf";
const std::string kSpmVocab = ELLM_MODELS_DIR "/vocab/ggml-vocab-llama-spm.gguf";

// An independent qwen2 / qwen3 forward in double precision, straight from
// the GGUF (biases and q/k norms where the file has them).
class NaiveQwen {
 public:
  explicit NaiveQwen(const GgufFile& f, const ModelConfig& c) : f_(f), c_(c) {}

  std::vector<double> Tensor(const std::string& name) {
    const GgufTensorInfo* t = f_.FindTensor(name);
    EXPECT_NE(t, nullptr) << name;
    EXPECT_EQ(t->type, DType::kF32);
    const float* p = reinterpret_cast<const float*>(f_.TensorData(*t));
    return std::vector<double>(p, p + t->elements());
  }

  // Logits after feeding tokens[0..n).
  std::vector<double> Logits(const std::vector<int>& tokens) {
    const int d = c_.dim, hd = c_.head_dim, nh = c_.n_heads, nkv = c_.n_kv_heads;
    auto embd = Tensor("token_embd.weight");
    std::vector<std::vector<std::vector<double>>> keys(c_.n_layers), values(c_.n_layers);
    std::vector<double> x;
    for (size_t pos = 0; pos < tokens.size(); ++pos) {
      x.assign(embd.begin() + tokens[pos] * d, embd.begin() + (tokens[pos] + 1) * d);
      for (int l = 0; l < c_.n_layers; ++l) {
        const std::string p = "blk." + std::to_string(l) + ".";
        auto xn = Norm(x, Tensor(p + "attn_norm.weight"));
        auto q = MatVec(Tensor(p + "attn_q.weight"), xn);
        auto k = MatVec(Tensor(p + "attn_k.weight"), xn);
        auto v = MatVec(Tensor(p + "attn_v.weight"), xn);
        if (f_.FindTensor(p + "attn_q.bias") != nullptr) {
          q = Add(q, Tensor(p + "attn_q.bias"));
          k = Add(k, Tensor(p + "attn_k.bias"));
          v = Add(v, Tensor(p + "attn_v.bias"));
        }
        if (f_.FindTensor(p + "attn_q_norm.weight") != nullptr) {
          NormHeads(q, nh, Tensor(p + "attn_q_norm.weight"));
          NormHeads(k, nkv, Tensor(p + "attn_k_norm.weight"));
        }
        Rope(q, nh, pos);
        Rope(k, nkv, pos);
        keys[l].push_back(k);
        values[l].push_back(v);
        std::vector<double> att(nh * hd, 0.0);
        for (int h = 0; h < nh; ++h) {
          const int g = h / (nh / nkv);
          std::vector<double> s(pos + 1);
          double mx = -1e300;
          for (size_t t = 0; t <= pos; ++t) {
            double dot = 0;
            for (int i = 0; i < hd; ++i) dot += q[h * hd + i] * keys[l][t][g * hd + i];
            s[t] = dot / std::sqrt(static_cast<double>(hd));
            mx = std::max(mx, s[t]);
          }
          double sum = 0;
          for (double& e : s) sum += (e = std::exp(e - mx));
          for (size_t t = 0; t <= pos; ++t) {
            for (int i = 0; i < hd; ++i) att[h * hd + i] += s[t] / sum * values[l][t][g * hd + i];
          }
        }
        x = Add(x, MatVec(Tensor(p + "attn_output.weight"), att));
        auto xf = Norm(x, Tensor(p + "ffn_norm.weight"));
        auto gate = MatVec(Tensor(p + "ffn_gate.weight"), xf);
        auto up = MatVec(Tensor(p + "ffn_up.weight"), xf);
        for (size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1 + std::exp(-gate[i])) * up[i];
        x = Add(x, MatVec(Tensor(p + "ffn_down.weight"), gate));
      }
    }
    // Tied LM head: the embedding matrix.
    return MatVec(embd, Norm(x, Tensor("output_norm.weight")));
  }

 private:
  std::vector<double> Norm(const std::vector<double>& x, const std::vector<double>& w) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double s = 1 / std::sqrt(ss / x.size() + c_.norm_eps);
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] * s * w[i];
    return out;
  }
  // RMSNorm of each head of v [heads, head_dim] with weight w [head_dim].
  void NormHeads(std::vector<double>& v, int heads, const std::vector<double>& w) {
    const int hd = c_.head_dim;
    for (int h = 0; h < heads; ++h) {
      const std::vector<double> head(v.begin() + h * hd, v.begin() + (h + 1) * hd);
      const std::vector<double> normed = Norm(head, w);
      std::copy(normed.begin(), normed.end(), v.begin() + h * hd);
    }
  }
  std::vector<double> MatVec(const std::vector<double>& w, const std::vector<double>& x) {
    const size_t rows = w.size() / x.size();
    std::vector<double> y(rows, 0.0);
    for (size_t r = 0; r < rows; ++r) {
      for (size_t i = 0; i < x.size(); ++i) y[r] += w[r * x.size() + i] * x[i];
    }
    return y;
  }
  std::vector<double> Add(std::vector<double> a, const std::vector<double>& b) {
    for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
    return a;
  }
  void Rope(std::vector<double>& v, int heads, size_t pos) {
    const int hd = c_.head_dim, half = c_.rope_dims / 2;
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < half; ++i) {
        std::complex<double> z(v[h * hd + i], v[h * hd + i + half]);
        z *= std::polar(1.0, pos * std::pow(static_cast<double>(c_.rope_base), -2.0 * i / c_.rope_dims));
        v[h * hd + i] = z.real();
        v[h * hd + i + half] = z.imag();
      }
    }
  }
  const GgufFile& f_;
  const ModelConfig& c_;
};

MakeModelOptions TinyQwen(DType type) {
  MakeModelOptions o;
  o.arch = "qwen2";
  o.layers = 2;
  o.hidden = 64;
  o.heads = 4;
  o.kv_heads = 2;
  o.head_dim = 16;
  o.ffn = 96;
  o.weight_type = type;
  o.vocab_from = kQwenVocab;
  o.context = 256;
  o.seed = 11;
  return o;
}

// The reference forward's logits against NaiveQwen's at a few positions.
void ExpectReferenceMatchesNaive(const MakeModelOptions& options) {
  auto writer = MakeRandomModel(options);
  ASSERT_TRUE(writer.ok()) << writer.status();
  auto file = GgufFile::FromBytes(writer->ToBytes());
  ASSERT_TRUE(file.ok()) << file.status();
  auto config = ModelConfig::FromGguf(**file);
  ASSERT_TRUE(config.ok()) << config.status();
  auto weights = LoadWeights(**file, *config);
  ASSERT_TRUE(weights.ok()) << weights.status();
  auto model = ReferenceModel::Create(*std::move(weights), 64);
  ASSERT_TRUE(model.ok());
  NaiveQwen naive(**file, *config);
  const std::vector<int> tokens = {14990, 1879, 40, 2776, 151643, 7, 99, 1000};
  std::vector<int> prefix;
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    const std::vector<float>& logits = (*model)->Forward(tokens[pos], static_cast<int>(pos));
    prefix.push_back(tokens[pos]);
    if (pos != 0 && pos != 3 && pos + 1 != tokens.size()) continue;  // the naive one is slow
    std::vector<double> expected = naive.Logits(prefix);
    double max_err = 0, max_abs = 0;
    for (size_t i = 0; i < expected.size(); ++i) {
      max_err = std::max(max_err, std::abs(logits[i] - expected[i]));
      max_abs = std::max(max_abs, std::abs(expected[i]));
    }
    // fp32 accumulation over a 64-wide model: well under 1e-4 of the logit scale.
    EXPECT_LT(max_err, 1e-4 * std::max(1.0, max_abs)) << options.arch << " position " << pos;
  }
}

TEST(Qwen3, ReferenceForwardMatchesIndependentForward) {
  MakeModelOptions o = TinyQwen(DType::kF32);
  o.arch = "qwen3";
  o.head_dim = 32;  // q_dim 128 != hidden 64, as Qwen3's models have it
  auto writer = MakeRandomModel(o);
  ASSERT_TRUE(writer.ok()) << writer.status();
  auto file = GgufFile::FromBytes(writer->ToBytes());
  ASSERT_TRUE(file.ok()) << file.status();
  auto config = ModelConfig::FromGguf(**file);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->rope_neox);
  EXPECT_TRUE(config->qk_norm);
  EXPECT_FALSE(config->qkv_bias);
  EXPECT_EQ(config->q_dim(), 128);
  EXPECT_EQ((*file)->FindTensor("attn_q.bias"), nullptr);
  EXPECT_NE((*file)->FindTensor("blk.1.attn_k_norm.weight"), nullptr);
  ExpectReferenceMatchesNaive(o);
}

TEST(Qwen2, ReferenceForwardMatchesIndependentForward) {
  auto writer = MakeRandomModel(TinyQwen(DType::kF32));
  ASSERT_TRUE(writer.ok()) << writer.status();
  auto file = GgufFile::FromBytes(writer->ToBytes());
  ASSERT_TRUE(file.ok()) << file.status();
  auto config = ModelConfig::FromGguf(**file);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->rope_neox);
  EXPECT_TRUE(config->qkv_bias);
  EXPECT_EQ((*file)->FindTensor("output.weight"), nullptr);  // tied
  ExpectReferenceMatchesNaive(TinyQwen(DType::kF32));
}

TEST(Qwen2, MakeModelIsDeterministicAndLoadsForEveryWeightType) {
  auto a = MakeRandomModel(TinyQwen(DType::kF32));
  auto b = MakeRandomModel(TinyQwen(DType::kF32));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->ToBytes(), b->ToBytes());
  MakeModelOptions other = TinyQwen(DType::kF32);
  other.seed = 12;
  EXPECT_NE(MakeRandomModel(other)->ToBytes(), a->ToBytes());
  for (DType type : {DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_K,
                     DType::kQ5_K, DType::kQ6_K}) {
    MakeModelOptions o = TinyQwen(type);
    o.hidden = 256;  // K-quants need rows of 256
    o.heads = 4;
    o.head_dim = 64;
    o.ffn = 256;
    o.vocab_from = kSpmVocab;  // 32000 rows: quicker than Qwen's 151936
    auto w = MakeRandomModel(o);
    ASSERT_TRUE(w.ok()) << Traits(type).name << ": " << w.status();
    auto file = GgufFile::FromBytes(w->ToBytes());
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ((*file)->FindTensor("blk.0.attn_q.weight")->type, type);
    auto config = ModelConfig::FromGguf(**file);
    ASSERT_TRUE(config.ok());
    auto weights = LoadWeights(**file, *config);
    ASSERT_TRUE(weights.ok()) << Traits(type).name << ": " << weights.status();
    // The weights keep the scale they were drawn with: N(0, 1/hidden).
    double ss = 0;
    for (float v : weights->layers[0].wq) ss += v * v;
    const double var = ss / weights->layers[0].wq.size();
    EXPECT_NEAR(var * o.hidden, 1.0, 0.1) << Traits(type).name;
  }
  // llama: separate output.weight, SPM vocab.
  MakeModelOptions llama = TinyQwen(DType::kF32);
  llama.arch = "llama";
  llama.vocab_from = kSpmVocab;
  auto w = MakeRandomModel(llama);
  ASSERT_TRUE(w.ok());
  auto file = GgufFile::FromBytes(w->ToBytes());
  ASSERT_TRUE(file.ok());
  EXPECT_NE((*file)->FindTensor("output.weight"), nullptr);
  EXPECT_EQ((*file)->GetString("tokenizer.ggml.model").value_or(""), "llama");
}

TEST(Qwen2, MakeModelRejectsBadShapes) {
  MakeModelOptions o = TinyQwen(DType::kF32);
  o.kv_heads = 3;
  EXPECT_FALSE(MakeRandomModel(o).ok());
  o = TinyQwen(DType::kF32);
  o.arch = "mamba";
  EXPECT_NE(MakeRandomModel(o).status().message().find("mamba"), absl::string_view::npos);
  o = TinyQwen(DType::kF32);
  o.vocab_from = "/nonexistent.gguf";
  EXPECT_FALSE(MakeRandomModel(o).ok());
}

}  // namespace
}  // namespace ellm
