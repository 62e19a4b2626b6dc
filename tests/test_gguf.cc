// GGUF reader and writer: round trips, the real model files, and one test per
// corruption (each built from GgufWriter::ToBytes, then damaged by hand).
#include "core/gguf.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"

namespace ellm {
namespace {

const std::string kModels = ELLM_MODELS_DIR;

// `status` is an error of `code` whose message contains `substring`.
testing::AssertionResult IsError(const absl::Status& status, absl::StatusCode code,
                                 std::string_view substring) {
  if (status.ok()) return testing::AssertionFailure() << "status is OK";
  if (status.code() != code) return testing::AssertionFailure() << "wrong code: " << status;
  if (std::string(status.message()).find(substring) == std::string::npos) {
    return testing::AssertionFailure() << "message lacks '" << substring << "': " << status;
  }
  return testing::AssertionSuccess();
}

testing::AssertionResult ParseFails(const std::string& bytes, std::string_view substring) {
  return IsError(GgufFile::FromBytes(bytes).status(), absl::StatusCode::kInvalidArgument,
                 substring);
}

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

void PatchU32(std::string* bytes, size_t pos, uint32_t value) {
  ASSERT_LE(pos + 4, bytes->size());
  std::memcpy(bytes->data() + pos, &value, 4);
}

void PatchU64(std::string* bytes, size_t pos, uint64_t value) {
  ASSERT_LE(pos + 8, bytes->size());
  std::memcpy(bytes->data() + pos, &value, 8);
}

// Position of the one occurrence of `needle` in `bytes` (-1 if absent or not unique).
size_t FindOnce(const std::string& bytes, std::string_view needle) {
  const size_t pos = bytes.find(needle);
  if (pos == std::string::npos || bytes.find(needle, pos + 1) != std::string::npos) {
    ADD_FAILURE() << "'" << needle << "' not found exactly once";
    return std::string::npos;
  }
  return pos;
}

// Position just after the one occurrence of `needle` (a name is followed by
// its value type, or by a tensor's n_dims).
size_t After(const std::string& bytes, std::string_view needle) {
  return FindOnce(bytes, needle) + needle.size();
}

// ---------------------------------------------------------------------------
// The small file every corruption test starts from:
//   key #0 general.architecture = "llama"
//   key #1 tokenizer.ggml.tokens = ["tok_a", "tok_b", "tok_c", "tok_d"]
//   key #2 general.name = "hello"
//   tensor #0 blk.0.attn_q.weight [8, 2] f32 (64 bytes, offset 0)
//   tensor #1 output_norm.weight [8] f32 (32 bytes, offset 64)
// Both tensors fill whole 32-byte units, so the file ends with the last one.
std::string SmallFile() {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetStringArray("tokenizer.ggml.tokens", {"tok_a", "tok_b", "tok_c", "tok_d"});
  w.SetString("general.name", "hello");
  std::vector<float> q(16), norm(8);
  for (int i = 0; i < 16; ++i) q[i] = 0.5f * i;
  for (int i = 0; i < 8; ++i) norm[i] = 1.0f + i;
  EXPECT_TRUE(w.AddTensor("blk.0.attn_q.weight", {8, 2}, DType::kF32, Bytes(q)).ok());
  EXPECT_TRUE(w.AddTensor("output_norm.weight", {8}, DType::kF32, Bytes(norm)).ok());
  return w.ToBytes();
}

// Field positions of tensor #0 (two dims) in SmallFile().
struct QInfo {
  size_t n_dims, dim0, dim1, type, offset;
};
QInfo QInfoOf(const std::string& bytes) {
  const size_t p = After(bytes, "blk.0.attn_q.weight");
  return {p, p + 4, p + 12, p + 20, p + 24};
}

TEST(GgufSmallFileTest, Parses) {
  const std::string bytes = SmallFile();
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->version(), 3u);
  EXPECT_EQ((*file)->metadata().size(), 3u);
  ASSERT_EQ((*file)->tensors().size(), 2u);
  const GgufTensorInfo* norm = (*file)->FindTensor("output_norm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->offset, 64u);
  // The data section ends exactly at the end of the file.
  EXPECT_EQ((*file)->TensorData(*norm) + norm->bytes,
            (*file)->TensorData((*file)->tensors()[0]) + 96);
  float first;
  std::memcpy(&first, (*file)->TensorData(*norm), 4);
  EXPECT_EQ(first, 1.0f);
}

// The identity the KV store keys on: the same bytes give the same
// fingerprint; other metadata, or other weights of the same size and
// layout (a re-export), give another.
TEST(GgufSmallFileTest, FingerprintSeesMetadataAndWeights) {
  auto build = [](const std::string& name, float middle, float elsewhere = 3.0f) {
    GgufWriter w;
    w.SetString("general.architecture", "llama");
    w.SetString("general.name", name);
    std::vector<float> weights(4096);
    for (int i = 0; i < 4096; ++i) weights[i] = 0.25f * static_cast<float>(i % 97);
    weights[2048] = middle;
    weights[777] = elsewhere;
    EXPECT_TRUE(w.AddTensor("blk.0.attn_q.weight", {64, 64}, DType::kF32, Bytes(weights)).ok());
    return w.ToBytes();
  };
  auto fingerprint = [](const std::string& bytes) {
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(bytes);
    EXPECT_TRUE(file.ok()) << file.status();
    return file.ok() ? (*file)->Fingerprint() : 0;
  };
  const std::string a = build("hello", 1.0f);
  ASSERT_EQ(build("hellp", 1.0f).size(), a.size());
  ASSERT_EQ(build("hello", 2.0f).size(), a.size());
  EXPECT_EQ(fingerprint(a), fingerprint(build("hello", 1.0f)));
  EXPECT_NE(fingerprint(a), fingerprint(build("hellp", 1.0f)));
  EXPECT_NE(fingerprint(a), fingerprint(build("hello", 2.0f))) << "weights in the middle of a tensor";
  // Anywhere (it sampled three windows of each tensor: a same-size model with
  // other weights elsewhere reused the KV store's blocks).
  EXPECT_NE(fingerprint(a), fingerprint(build("hello", 1.0f, 3.5f))) << "weights away from the windows";
  std::string flipped = a;
  for (size_t i = a.size() - 4096 * 4 + 1000; i < a.size(); i += 4096) {
    flipped[i] ^= 1;
    EXPECT_NE(fingerprint(a), fingerprint(flipped)) << "byte " << i;
    flipped[i] ^= 1;
  }
}

// --- One test per corruption -----------------------------------------------

TEST(GgufCorruptionTest, BadMagic) {
  std::string bytes = SmallFile();
  bytes[0] = 'X';
  EXPECT_TRUE(ParseFails(bytes, "bad magic 0x46554758 (not a GGUF file)"));
}

TEST(GgufCorruptionTest, BadVersion) {
  std::string bytes = SmallFile();
  PatchU32(&bytes, 4, 7);
  EXPECT_TRUE(ParseFails(bytes, "unsupported GGUF version 7"));
}

TEST(GgufCorruptionTest, VersionOneIsUnsupported) {
  std::string bytes = SmallFile();
  PatchU32(&bytes, 4, 1);
  EXPECT_TRUE(ParseFails(bytes, "unsupported GGUF version 1"));
}

TEST(GgufCorruptionTest, BigEndianVersionIsNamed) {
  std::string bytes = SmallFile();
  PatchU32(&bytes, 4, 0x03000000u);
  EXPECT_TRUE(ParseFails(bytes, "(big-endian file)"));
}

TEST(GgufCorruptionTest, TruncatedHeader) {
  EXPECT_TRUE(ParseFails(SmallFile().substr(0, 20), "truncated while reading the header"));
  EXPECT_TRUE(ParseFails(SmallFile().substr(0, 2), "truncated while reading the header"));
  EXPECT_TRUE(ParseFails("", "truncated while reading the header"));
}

TEST(GgufCorruptionTest, TruncatedInKey) {
  const std::string bytes = SmallFile();
  // Cut in the middle of the token array (key #1).
  EXPECT_TRUE(ParseFails(bytes.substr(0, FindOnce(bytes, "tok_c") + 2),
                         "truncated while reading key #1 ('tokenizer.ggml.tokens')"));
  // Cut in the middle of key #2's name.
  EXPECT_TRUE(ParseFails(bytes.substr(0, FindOnce(bytes, "general.name") + 3),
                         "truncated while reading key #2"));
}

TEST(GgufCorruptionTest, MoreKeysThanTheFileHolds) {
  std::string bytes = SmallFile();
  PatchU64(&bytes, 16, 1000);  // n_kv: the tensor infos are read as keys
  EXPECT_TRUE(ParseFails(bytes, "key #"));
}

TEST(GgufCorruptionTest, TruncatedInTensorInfos) {
  const std::string bytes = SmallFile();
  EXPECT_TRUE(ParseFails(bytes.substr(0, QInfoOf(bytes).dim0 + 3),
                         "truncated while reading tensor info #0 ('blk.0.attn_q.weight')"));
  EXPECT_TRUE(ParseFails(bytes.substr(0, FindOnce(bytes, "output_norm") + 4),
                         "truncated while reading tensor info #1"));
}

TEST(GgufCorruptionTest, HugeStringLength) {
  std::string bytes = SmallFile();
  PatchU64(&bytes, FindOnce(bytes, "hello") - 8, uint64_t{1} << 62);
  EXPECT_TRUE(ParseFails(bytes, "key #2 ('general.name'): string length 4611686018427387904 "
                                "exceeds the limit"));
}

TEST(GgufCorruptionTest, StringLongerThanTheFile) {
  std::string bytes = SmallFile();
  PatchU64(&bytes, FindOnce(bytes, "hello") - 8, 1 << 20);  // under the limit
  EXPECT_TRUE(ParseFails(bytes, "truncated while reading key #2 ('general.name')"));
}

TEST(GgufCorruptionTest, HugeKeyLength) {
  std::string bytes = SmallFile();
  PatchU64(&bytes, FindOnce(bytes, "general.name") - 8, 100000);
  EXPECT_TRUE(ParseFails(bytes, "key #2: string length 100000 exceeds the limit of 65535"));
}

TEST(GgufCorruptionTest, HugeArrayCount) {
  std::string bytes = SmallFile();
  // tok_a is preceded by its length (8) and the array count (8).
  PatchU64(&bytes, FindOnce(bytes, "tok_a") - 16, uint64_t{1} << 40);
  EXPECT_TRUE(ParseFails(bytes, "array count 1099511627776 exceeds the limit"));
}

TEST(GgufCorruptionTest, ArrayCountLargerThanTheFile) {
  std::string bytes = SmallFile();
  PatchU64(&bytes, FindOnce(bytes, "tok_a") - 16, 1 << 20);  // under the limit
  EXPECT_TRUE(ParseFails(bytes, "truncated while reading key #1 ('tokenizer.ggml.tokens')"));
}

TEST(GgufCorruptionTest, UnknownValueType) {
  std::string bytes = SmallFile();
  PatchU32(&bytes, After(bytes, "general.name"), 13);
  EXPECT_TRUE(ParseFails(bytes, "key #2 ('general.name'): unknown value type 13"));
}

TEST(GgufCorruptionTest, NestedArray) {
  std::string bytes = SmallFile();
  // After the key: u32 value type (array), then u32 element type.
  PatchU32(&bytes, After(bytes, "tokenizer.ggml.tokens") + 4, 9);
  EXPECT_TRUE(ParseFails(bytes, "nested arrays are not supported"));
}

TEST(GgufCorruptionTest, TensorOffsetOutOfRange) {
  std::string bytes = SmallFile();
  PatchU64(&bytes, QInfoOf(bytes).offset, uint64_t{1} << 40);
  EXPECT_TRUE(ParseFails(bytes, "tensor 'blk.0.attn_q.weight' (offset 1099511627776, 64 bytes) "
                                "lies outside the file"));
}

TEST(GgufCorruptionTest, TensorOffsetOverflows) {
  std::string bytes = SmallFile();
  // Aligned, and offset + bytes wraps around 2^64.
  PatchU64(&bytes, QInfoOf(bytes).offset, ~uint64_t{31});
  EXPECT_TRUE(ParseFails(bytes, "lies outside the file"));
}

TEST(GgufCorruptionTest, TensorDataTruncated) {
  const std::string bytes = SmallFile();
  EXPECT_TRUE(ParseFails(bytes.substr(0, bytes.size() - 4),
                         "tensor 'output_norm.weight' (offset 64, 32 bytes) lies outside the "
                         "file (size " + std::to_string(bytes.size() - 4)));
}

TEST(GgufCorruptionTest, UnalignedOffset) {
  std::string bytes = SmallFile();
  PatchU64(&bytes, QInfoOf(bytes).offset, 4);
  EXPECT_TRUE(ParseFails(bytes, "tensor 'blk.0.attn_q.weight' offset 4 is not a multiple of the "
                                "alignment 32"));
}

TEST(GgufCorruptionTest, UnknownTensorType) {
  std::string bytes = SmallFile();
  PatchU32(&bytes, QInfoOf(bytes).type, 99);
  EXPECT_TRUE(ParseFails(bytes, "tensor 'blk.0.attn_q.weight' has unknown type 99"));
}

TEST(GgufCorruptionTest, TooManyDims) {
  std::string bytes = SmallFile();
  PatchU32(&bytes, QInfoOf(bytes).n_dims, 5);
  EXPECT_TRUE(ParseFails(bytes, "tensor 'blk.0.attn_q.weight' has 5 dimensions"));
}

TEST(GgufCorruptionTest, ZeroDims) {
  std::string bytes = SmallFile();
  PatchU32(&bytes, QInfoOf(bytes).n_dims, 0);
  EXPECT_TRUE(ParseFails(bytes, "tensor 'blk.0.attn_q.weight' has 0 dimensions"));
}

TEST(GgufCorruptionTest, NegativeDimension) {
  std::string bytes = SmallFile();
  PatchU64(&bytes, QInfoOf(bytes).dim1, ~uint64_t{0});
  EXPECT_TRUE(ParseFails(bytes, "dimension 1 is 18446744073709551615 (negative as int64)"));
}

TEST(GgufCorruptionTest, ElementCountOverflows) {
  std::string bytes = SmallFile();
  const QInfo q = QInfoOf(bytes);
  PatchU64(&bytes, q.dim0, uint64_t{1} << 40);
  PatchU64(&bytes, q.dim1, uint64_t{1} << 40);
  EXPECT_TRUE(ParseFails(bytes, "has more elements than int64 can count"));
}

TEST(GgufCorruptionTest, TensorBytesOverflow) {
  std::string bytes = SmallFile();
  // 2^62 f32 elements count fine but need 2^64 bytes.
  PatchU64(&bytes, QInfoOf(bytes).dim1, uint64_t{1} << 59);
  EXPECT_TRUE(ParseFails(bytes, "overflows 64 bits"));
}

TEST(GgufCorruptionTest, RowNotWholeBlocks) {
  GgufWriter w;
  ASSERT_TRUE(w.AddTensor("q8tensor", {32, 2}, DType::kQ8_0, std::string(2 * 34, '\0')).ok());
  std::string bytes = w.ToBytes();
  const size_t dims = After(bytes, "q8tensor") + 4;  // after u32 n_dims
  PatchU64(&bytes, dims, 16);  // [16, 4]: still 64 elements, 2 blocks in total
  PatchU64(&bytes, dims + 8, 4);
  EXPECT_TRUE(ParseFails(bytes, "tensor 'q8tensor' row of 16 elements is not a whole number of q8_0 "
                                "blocks"));
}

TEST(GgufCorruptionTest, DuplicateKey) {
  GgufWriter w;
  w.SetUint32("test.key_a", 1);
  w.SetUint32("test.key_b", 2);
  std::string bytes = w.ToBytes();
  bytes[FindOnce(bytes, "test.key_b") + 9] = 'a';
  EXPECT_TRUE(ParseFails(bytes, "duplicate key 'test.key_a' (key #1)"));
}

TEST(GgufCorruptionTest, DuplicateTensorName) {
  GgufWriter w;
  ASSERT_TRUE(w.AddTensor("t_a", {8}, DType::kF32, std::string(32, '\0')).ok());
  ASSERT_TRUE(w.AddTensor("t_b", {8}, DType::kF32, std::string(32, '\0')).ok());
  std::string bytes = w.ToBytes();
  bytes[FindOnce(bytes, "t_b") + 2] = 'a';
  EXPECT_TRUE(ParseFails(bytes, "duplicate tensor name 't_a' (tensor #1)"));
}

TEST(GgufCorruptionTest, NonPowerOfTwoAlignment) {
  GgufWriter w;
  w.SetUint32("general.alignment", 48);  // an explicit key is written as given
  EXPECT_TRUE(ParseFails(w.ToBytes(), "general.alignment 48 is not a nonzero power of two"));
  w.SetUint32("general.alignment", 0);
  EXPECT_TRUE(ParseFails(w.ToBytes(), "general.alignment 0 is not a nonzero power of two"));
}

TEST(GgufCorruptionTest, AlignmentOfWrongType) {
  GgufWriter w;
  w.SetString("general.alignment", "32");
  EXPECT_TRUE(ParseFails(w.ToBytes(), "key 'general.alignment' is of type string"));
}

TEST(GgufCorruptionTest, TooManyTensorsInHeader) {
  std::string bytes = SmallFile();
  PatchU64(&bytes, 8, uint64_t{1} << 50);
  EXPECT_TRUE(ParseFails(bytes, "header claims 1125899906842624 tensors"));
}

TEST(GgufCorruptionTest, HostileNamesAreEscapedAndCut) {
  GgufWriter w;
  w.SetString(std::string(1000, 'k') + "\n", "v");
  const std::string bytes = w.ToBytes();
  const absl::Status status = GgufFile::FromBytes(bytes.substr(0, bytes.size() - 1)).status();
  EXPECT_TRUE(IsError(status, absl::StatusCode::kInvalidArgument, "...' (1001 bytes)"));
  EXPECT_LT(status.message().size(), 300u) << status;
}

// Random damage: every damaged file either parses, with all tensors inside
// the bytes, or fails cleanly. (Run under ASan/UBSan to catch bad reads.)
TEST(GgufCorruptionTest, RandomDamageNeverCrashes) {
  const std::string good = SmallFile();
  std::mt19937 rng(42);
  for (int trial = 0; trial < 20000; ++trial) {
    std::string bytes = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) {
      bytes[rng() % bytes.size()] = static_cast<char>(rng() % 4 == 0 ? 0xff : rng());
    }
    if (rng() % 4 == 0) bytes.resize(rng() % bytes.size());
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(bytes);
    if (!file.ok()) {
      ASSERT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
      continue;
    }
    for (const GgufTensorInfo& t : (*file)->tensors()) {
      // Touch the first and last byte of every tensor.
      volatile uint8_t sink = 0;
      if (t.bytes > 0) sink = (*file)->TensorData(t)[0] ^ (*file)->TensorData(t)[t.bytes - 1];
      (void)sink;
    }
  }
}

// --- Files on disk -----------------------------------------------------------

TEST(GgufOpenTest, MissingFileIsNotFound) {
  const std::string path = kModels + "/no-such-model.gguf";
  EXPECT_TRUE(IsError(GgufFile::Open(path).status(), absl::StatusCode::kNotFound, path));
}

TEST(GgufOpenTest, DirectoryIsRejected) {
  EXPECT_TRUE(IsError(GgufFile::Open(kModels).status(), absl::StatusCode::kInvalidArgument,
                      "not a regular file"));
}

TEST(GgufOpenTest, AFifoIsRejectedWithoutWaitingForAWriter) {
  // Opening a FIFO for reading blocks until a writer comes unless asked not
  // to: ellm-launch --model on one hung forever (issue 13).
  const std::string path = testing::TempDir() + "/ellm_fifo_" + std::to_string(getpid());
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0);
  EXPECT_TRUE(IsError(GgufFile::Open(path).status(), absl::StatusCode::kInvalidArgument,
                      "not a regular file"));
  std::remove(path.c_str());
}

TEST(GgufOpenTest, ErrorsNameThePath) {
  const std::string path = testing::TempDir() + "/ellm_bad_magic.gguf";
  std::string bytes = SmallFile();
  bytes[1] = 'X';
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
  }
  EXPECT_TRUE(IsError(GgufFile::Open(path).status(), absl::StatusCode::kInvalidArgument,
                      path + ": bad magic"));
  std::remove(path.c_str());
}

TEST(GgufOpenTest, EmptyFile) {
  const std::string path = testing::TempDir() + "/ellm_empty.gguf";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  EXPECT_TRUE(IsError(GgufFile::Open(path).status(), absl::StatusCode::kInvalidArgument,
                      "truncated while reading the header"));
  std::remove(path.c_str());
}

// --- Round trips ------------------------------------------------------------

GgufValue Scalar(GgufValueType type) {
  GgufValue v;
  v.type = type;
  return v;
}

GgufValue Int(GgufValueType type, int64_t i) {
  GgufValue v = Scalar(type);
  v.i = i;
  if (i >= 0 && type != GgufValueType::kInt8 && type != GgufValueType::kInt16 &&
      type != GgufValueType::kInt32 && type != GgufValueType::kInt64) {
    v.u = static_cast<uint64_t>(i);  // the reader fills `u` for unsigned types
  }
  return v;
}

GgufValue Uint64(uint64_t u) {
  GgufValue v = Scalar(GgufValueType::kUint64);
  v.u = u;
  v.i = u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? static_cast<int64_t>(u)
                                                                       : 0;
  return v;
}

GgufValue Float(GgufValueType type, double f) {
  GgufValue v = Scalar(type);
  v.f = f;
  return v;
}

GgufValue Bool(bool b) {
  GgufValue v = Scalar(GgufValueType::kBool);
  v.b = b;
  return v;
}

GgufValue Str(std::string s) {
  GgufValue v = Scalar(GgufValueType::kString);
  v.s = std::move(s);
  return v;
}

GgufValue Arr(GgufValueType elem_type, std::vector<GgufValue> elements) {
  GgufValue v = Scalar(GgufValueType::kArray);
  v.elem_type = elem_type;
  v.array = std::move(elements);
  return v;
}

void ExpectSameValue(const GgufValue& a, const GgufValue& b, const std::string& where) {
  SCOPED_TRACE(where);
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.i, b.i);
  EXPECT_EQ(a.u, b.u);
  EXPECT_EQ(a.f, b.f);
  EXPECT_EQ(a.b, b.b);
  EXPECT_EQ(a.s, b.s);
  if (a.type == GgufValueType::kArray) {
    EXPECT_EQ(a.elem_type, b.elem_type);
    ASSERT_EQ(a.array.size(), b.array.size());
    for (size_t i = 0; i < a.array.size(); ++i) {
      ExpectSameValue(a.array[i], b.array[i], where + "[" + std::to_string(i) + "]");
    }
  }
}

using VT = GgufValueType;

// Every scalar type at its extremes, and an array of every element type.
std::vector<std::pair<std::string, GgufValue>> EveryType() {
  return {
      {"t.u8", Int(VT::kUint8, 255)},
      {"t.i8", Int(VT::kInt8, -128)},
      {"t.u16", Int(VT::kUint16, 65535)},
      {"t.i16", Int(VT::kInt16, -32768)},
      {"t.u32", Int(VT::kUint32, 4294967295)},
      {"t.i32", Int(VT::kInt32, std::numeric_limits<int32_t>::min())},
      {"t.u64", Uint64(~uint64_t{0})},
      {"t.u64_small", Uint64(12345)},
      {"t.i64", Int(VT::kInt64, std::numeric_limits<int64_t>::min())},
      {"t.f32", Float(VT::kFloat32, -1.5)},
      {"t.f64", Float(VT::kFloat64, 0.1)},
      {"t.bool_true", Bool(true)},
      {"t.bool_false", Bool(false)},
      {"t.str", Str(std::string("h\xc3\xa9llo\0world", 12))},
      {"t.str_empty", Str("")},
      {"t.arr_u8", Arr(VT::kUint8, {Int(VT::kUint8, 0), Int(VT::kUint8, 200)})},
      {"t.arr_i8", Arr(VT::kInt8, {Int(VT::kInt8, -5), Int(VT::kInt8, 127)})},
      {"t.arr_u16", Arr(VT::kUint16, {Int(VT::kUint16, 1)})},
      {"t.arr_i16", Arr(VT::kInt16, {Int(VT::kInt16, -1)})},
      {"t.arr_u32", Arr(VT::kUint32, {Int(VT::kUint32, 7), Int(VT::kUint32, 4000000000)})},
      {"t.arr_i32", Arr(VT::kInt32, {Int(VT::kInt32, -7)})},
      {"t.arr_u64", Arr(VT::kUint64, {Uint64(1), Uint64(~uint64_t{0})})},
      {"t.arr_i64", Arr(VT::kInt64, {Int(VT::kInt64, -3)})},
      {"t.arr_f32", Arr(VT::kFloat32, {Float(VT::kFloat32, 0.25), Float(VT::kFloat32, -3)})},
      {"t.arr_f64", Arr(VT::kFloat64, {Float(VT::kFloat64, 1e300)})},
      {"t.arr_bool", Arr(VT::kBool, {Bool(true), Bool(false)})},
      {"t.arr_str", Arr(VT::kString, {Str("a"), Str(""), Str("ccc")})},
      {"t.arr_empty", Arr(VT::kInt32, {})},
  };
}

TEST(GgufRoundTripTest, EveryMetadataType) {
  GgufWriter w;
  for (const auto& [key, value] : EveryType()) w.SetValue(key, value);
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(w.ToBytes());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().size(), EveryType().size());
  EXPECT_TRUE((*file)->tensors().empty());
  for (const auto& [key, value] : EveryType()) {
    const GgufValue* read = (*file)->Find(key);
    ASSERT_NE(read, nullptr) << key;
    ExpectSameValue(*read, value, key);
  }
}

TEST(GgufRoundTripTest, TypedSetters) {
  GgufWriter w;
  w.SetString("s", "text");
  w.SetUint32("u32", 4000000000u);
  w.SetInt32("i32", -42);
  w.SetUint64("u64", uint64_t{1} << 40);
  w.SetFloat32("f32", 0.5f);
  w.SetBool("b", true);
  w.SetStringArray("sa", {"x", "yy"});
  w.SetFloat32Array("fa", {1.5f, -2.0f});
  w.SetInt32Array("ia", {3, -4});
  w.SetInt32("i32", -43);  // a second Set replaces the first
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(w.ToBytes());
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_EQ(f.metadata().size(), 9u);
  EXPECT_EQ(*f.GetString("s"), "text");
  EXPECT_EQ(*f.GetInt("u32"), 4000000000);
  EXPECT_EQ(f.Find("u32")->type, GgufValueType::kUint32);
  EXPECT_EQ(*f.GetInt("i32"), -43);
  EXPECT_EQ(*f.GetInt("u64"), int64_t{1} << 40);
  EXPECT_EQ(*f.GetFloat("f32"), 0.5);
  EXPECT_EQ(*f.GetFloat("i32"), -43.0);  // integers read as floats too
  EXPECT_EQ(*f.GetBool("b"), true);
  EXPECT_EQ(*f.GetStringArray("sa"), (std::vector<std::string>{"x", "yy"}));
  EXPECT_EQ(*f.GetFloatArray("fa"), (std::vector<double>{1.5, -2.0}));
  EXPECT_EQ(*f.GetIntArray("ia"), (std::vector<int64_t>{3, -4}));
  EXPECT_EQ(*f.GetFloatArray("ia"), (std::vector<double>{3, -4}));
}

TEST(GgufGetterTest, ErrorsNameTheKeyAndTypes) {
  GgufWriter w;
  for (const auto& [key, value] : EveryType()) w.SetValue(key, value);
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(w.ToBytes());
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_TRUE(IsError(f.GetInt("nope").status(), absl::StatusCode::kNotFound, "key 'nope'"));
  EXPECT_TRUE(IsError(f.GetInt("t.str").status(), absl::StatusCode::kInvalidArgument,
                      "key 't.str' is of type string, not an integer"));
  EXPECT_TRUE(IsError(f.GetInt("t.u64").status(), absl::StatusCode::kInvalidArgument,
                      "does not fit in int64"));
  EXPECT_EQ(*f.GetInt("t.u64_small"), 12345);
  EXPECT_EQ(*f.GetFloat("t.u64"), 18446744073709551615.0);
  EXPECT_TRUE(IsError(f.GetString("t.u8").status(), absl::StatusCode::kInvalidArgument,
                      "is of type u8"));
  EXPECT_TRUE(IsError(f.GetBool("t.i8").status(), absl::StatusCode::kInvalidArgument, "bool"));
  EXPECT_TRUE(IsError(f.GetFloat("t.arr_f32").status(), absl::StatusCode::kInvalidArgument,
                      "is of type array of f32"));
  EXPECT_TRUE(IsError(f.GetStringArray("t.arr_i32").status(),
                      absl::StatusCode::kInvalidArgument, "not array of string"));
  EXPECT_TRUE(IsError(f.GetIntArray("t.arr_f32").status(), absl::StatusCode::kInvalidArgument,
                      "not array of integers"));
  EXPECT_TRUE(IsError(f.GetIntArray("t.arr_u64").status(), absl::StatusCode::kInvalidArgument,
                      "does not fit in int64"));
  EXPECT_TRUE(IsError(f.GetFloatArray("t.arr_str").status(),
                      absl::StatusCode::kInvalidArgument, "not array of numbers"));
  EXPECT_EQ(*f.GetIntArray("t.arr_empty"), std::vector<int64_t>{});
}

TEST(GgufRoundTripTest, Tensors) {
  std::vector<float> f32(3 * 2);
  for (size_t i = 0; i < f32.size(); ++i) f32[i] = 0.25f * i - 1;
  std::vector<uint16_t> f16(8 * 4), bf16(5);
  for (size_t i = 0; i < f16.size(); ++i) f16[i] = FloatToHalf(0.125f * i);
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = FloatToBf16(-3.0f * i);
  std::string q8(2 * 2 * 34, '\0');  // [64, 2] q8_0: 2 rows of 2 blocks
  for (size_t i = 0; i < q8.size(); ++i) q8[i] = static_cast<char>(i * 7);

  GgufWriter w;
  w.SetString("general.architecture", "llama");
  ASSERT_TRUE(w.AddTensor("a.f32", {3, 2}, DType::kF32, Bytes(f32)).ok());
  ASSERT_TRUE(w.AddTensor("b.f16", {8, 4}, DType::kF16, Bytes(f16)).ok());
  ASSERT_TRUE(w.AddTensor("c.q8", {64, 2}, DType::kQ8_0, q8).ok());
  ASSERT_TRUE(w.AddTensor("d.bf16", {5, 1, 1, 1}, DType::kBF16, Bytes(bf16)).ok());

  for (uint64_t alignment : {32u, 64u, 8u}) {
    SCOPED_TRACE(alignment);
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(w.ToBytes(alignment));
    ASSERT_TRUE(file.ok()) << file.status();
    const GgufFile& f = **file;
    EXPECT_EQ(f.alignment(), alignment);
    EXPECT_EQ(f.Has("general.alignment"), alignment != 32);
    ASSERT_EQ(f.tensors().size(), 4u);
    struct Expected {
      const char* name;
      std::vector<int64_t> shape;
      DType type;
      std::string data;
    };
    const Expected expected[] = {
        {"a.f32", {3, 2}, DType::kF32, Bytes(f32)},
        {"b.f16", {8, 4}, DType::kF16, Bytes(f16)},
        {"c.q8", {64, 2}, DType::kQ8_0, q8},
        {"d.bf16", {5, 1, 1, 1}, DType::kBF16, Bytes(bf16)},
    };
    for (size_t i = 0; i < 4; ++i) {
      const Expected& e = expected[i];
      SCOPED_TRACE(e.name);
      const GgufTensorInfo* info = f.FindTensor(e.name);
      ASSERT_NE(info, nullptr);
      EXPECT_EQ(info, &f.tensors()[i]);  // file order is insertion order
      EXPECT_EQ(info->shape, e.shape);
      EXPECT_EQ(info->type, e.type);
      EXPECT_EQ(info->bytes, e.data.size());
      EXPECT_EQ(info->offset % alignment, 0u);
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(f.TensorData(*info)), info->bytes),
                e.data);
    }
    EXPECT_EQ(f.FindTensor("b.f16")->elements(), 32);
    EXPECT_EQ(f.FindTensor("missing"), nullptr);
  }
}

TEST(GgufRoundTripTest, RewriteReadsBackIdentically) {
  // Read a file, write everything it holds, read that: same keys and tensors.
  absl::StatusOr<std::unique_ptr<GgufFile>> original =
      GgufFile::Open(kModels + "/stories260K.gguf");
  ASSERT_TRUE(original.ok()) << original.status();
  GgufWriter w;
  w.CopyMetadata(**original, "");
  for (const GgufTensorInfo& t : (*original)->tensors()) {
    ASSERT_TRUE(w.AddTensor(t.name, t.shape, t.type,
                            std::string(reinterpret_cast<const char*>((*original)->TensorData(t)),
                                        t.bytes))
                    .ok());
  }
  absl::StatusOr<std::unique_ptr<GgufFile>> copy = GgufFile::FromBytes(w.ToBytes());
  ASSERT_TRUE(copy.ok()) << copy.status();
  ASSERT_EQ((*copy)->metadata().size(), (*original)->metadata().size());
  for (const auto& [key, value] : (*original)->metadata()) {
    const GgufValue* v = (*copy)->Find(key);
    ASSERT_NE(v, nullptr) << key;
    ExpectSameValue(*v, value, key);
  }
  ASSERT_EQ((*copy)->tensors().size(), (*original)->tensors().size());
  for (size_t i = 0; i < (*copy)->tensors().size(); ++i) {
    const GgufTensorInfo& a = (*original)->tensors()[i];
    const GgufTensorInfo& b = (*copy)->tensors()[i];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.shape, b.shape);
    EXPECT_EQ(a.type, b.type);
    EXPECT_EQ(a.offset, b.offset);  // both laid out in order at 32-byte alignment
    EXPECT_EQ(std::memcmp((*original)->TensorData(a), (*copy)->TensorData(b), a.bytes), 0);
  }
}

TEST(GgufRoundTripTest, CopyMetadataTakesThePrefixOnly) {
  absl::StatusOr<std::unique_ptr<GgufFile>> original =
      GgufFile::Open(kModels + "/stories260K.gguf");
  ASSERT_TRUE(original.ok()) << original.status();
  GgufWriter w;
  w.CopyMetadata(**original, "tokenizer.");
  absl::StatusOr<std::unique_ptr<GgufFile>> copy = GgufFile::FromBytes(w.ToBytes());
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ((*copy)->metadata().size(), 9u);  // the 9 tokenizer.* keys
  EXPECT_FALSE((*copy)->Has("general.architecture"));
  EXPECT_EQ((*copy)->GetStringArray("tokenizer.ggml.tokens")->size(), 512u);
}

TEST(GgufRoundTripTest, WriteFileThenOpen) {
  const std::string path = testing::TempDir() + "/ellm_roundtrip.gguf";
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  ASSERT_TRUE(w.AddTensor("x", {4}, DType::kF32, Bytes(std::vector<float>{1, 2, 3, 4})).ok());
  ASSERT_TRUE(w.WriteFile(path).ok());
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->path(), path);
  EXPECT_EQ(std::filesystem::file_size(path), w.ToBytes().size());
  float third;
  std::memcpy(&third, (*file)->TensorData(*(*file)->FindTensor("x")) + 8, 4);
  EXPECT_EQ(third, 3.0f);
  std::remove(path.c_str());

  EXPECT_FALSE(w.WriteFile("/nonexistent-dir/x.gguf").ok());
}

TEST(GgufWriterTest, NoTensorsMeansNoDataSectionAndNoPadding) {
  GgufWriter w;
  w.SetString("a", "b");  // 24 header + (8 + 1) key + 4 type + (8 + 1) value = 46 bytes
  const std::string bytes = w.ToBytes();
  EXPECT_EQ(bytes.size(), 46u);
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->tensors().empty());
}

TEST(GgufWriterTest, AddTensorRejectsBadInput) {
  GgufWriter w;
  EXPECT_TRUE(IsError(w.AddTensor("x", {4}, DType::kF32, std::string(15, '\0')),
                      absl::StatusCode::kInvalidArgument, "need 16"));
  ASSERT_TRUE(w.AddTensor("x", {4}, DType::kF32, std::string(16, '\0')).ok());
  EXPECT_TRUE(IsError(w.AddTensor("x", {4}, DType::kF32, std::string(16, '\0')),
                      absl::StatusCode::kInvalidArgument, "duplicate"));
  EXPECT_TRUE(IsError(w.AddTensor("y", {1, 1, 1, 1, 1}, DType::kF32, std::string(4, '\0')),
                      absl::StatusCode::kInvalidArgument, "dimensions"));
  EXPECT_TRUE(IsError(w.AddTensor("z", {}, DType::kF32, ""),
                      absl::StatusCode::kInvalidArgument, "dimensions"));
  EXPECT_TRUE(IsError(w.AddTensor("q", {16}, DType::kQ8_0, std::string(17, '\0')),
                      absl::StatusCode::kInvalidArgument, "q8_0"));
  EXPECT_TRUE(IsError(w.AddTensor(std::string(65, 'n'), {1}, DType::kF32, std::string(4, '\0')),
                      absl::StatusCode::kInvalidArgument, "tensor name"));
  EXPECT_TRUE(IsError(w.AddTensor("neg", {-1}, DType::kF32, ""),
                      absl::StatusCode::kInvalidArgument, "bad shape"));
}

// --- Real files --------------------------------------------------------------

TEST(GgufRealFileTest, Stories260K) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(kModels + "/stories260K.gguf");
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.metadata().size(), 19u);
  EXPECT_EQ(*f.GetString("general.architecture"), "llama");
  EXPECT_EQ(*f.GetInt("llama.block_count"), 5);
  EXPECT_EQ(*f.GetInt("llama.embedding_length"), 64);
  EXPECT_EQ(*f.GetInt("tokenizer.ggml.padding_token_id"), 4294967295);
  EXPECT_NEAR(*f.GetFloat("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-12);
  absl::StatusOr<std::vector<std::string>> tokens = f.GetStringArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 512u);
  EXPECT_EQ((*tokens)[1], "<s>");
  EXPECT_EQ((*tokens)[2], "</s>");
  EXPECT_EQ(f.GetFloatArray("tokenizer.ggml.scores")->size(), 512u);

  ASSERT_EQ(f.tensors().size(), 48u);
  int64_t params = 0;
  for (const GgufTensorInfo& t : f.tensors()) {
    EXPECT_EQ(t.type, DType::kF32) << t.name;
    params += t.elements();
  }
  EXPECT_EQ(params, 292800);
  const GgufTensorInfo* embd = f.FindTensor("token_embd.weight");
  ASSERT_NE(embd, nullptr);
  EXPECT_EQ(embd->shape, (std::vector<int64_t>{64, 512}));
  EXPECT_EQ(embd->bytes, 64u * 512 * 4);
  EXPECT_EQ(f.FindTensor("blk.4.ffn_down.weight")->shape, (std::vector<int64_t>{172, 64}));
  EXPECT_EQ(f.FindTensor("blk.0.attn_k.weight")->shape, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(f.FindTensor("output_norm.weight")->shape, (std::vector<int64_t>{64}));
  // Tied embeddings stored twice, byte for byte.
  const GgufTensorInfo* output = f.FindTensor("output.weight");
  ASSERT_NE(output, nullptr);
  EXPECT_EQ(std::memcmp(f.TensorData(*embd), f.TensorData(*output), embd->bytes), 0);
  std::vector<float> row(64);
  Traits(DType::kF32).dequantize(f.TensorData(*embd), row.data(), 64);
  for (float x : row) EXPECT_TRUE(std::isfinite(x));
}

TEST(GgufRealFileTest, LlamaTinyRandomF16) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file =
      GgufFile::Open(kModels + "/llama-2-tiny-random.gguf");
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_EQ(*f.GetString("general.name"), "LLaMA v2");
  EXPECT_EQ(*f.GetInt("general.file_type"), 1);
  ASSERT_EQ(f.tensors().size(), 12u);
  int f16 = 0, f32 = 0;
  int64_t params = 0;
  for (const GgufTensorInfo& t : f.tensors()) {
    (t.type == DType::kF16 ? f16 : f32)++;
    params += t.elements();
  }
  EXPECT_EQ(f16, 9);
  EXPECT_EQ(f32, 3);
  EXPECT_EQ(params, 513048);
  const GgufTensorInfo* embd = f.FindTensor("token_embd.weight");
  ASSERT_NE(embd, nullptr);
  EXPECT_EQ(embd->type, DType::kF16);
  EXPECT_EQ(embd->shape, (std::vector<int64_t>{8, 32000}));
  EXPECT_EQ(embd->bytes, 8u * 32000 * 2);
  // Random init (std ~0.02): dequantized values are small and finite.
  std::vector<float> values(embd->elements());
  Traits(DType::kF16).dequantize(f.TensorData(*embd), values.data(), embd->elements());
  double sum_sq = 0;
  for (float x : values) {
    ASSERT_TRUE(std::isfinite(x));
    sum_sq += static_cast<double>(x) * x;
  }
  const double std_dev = std::sqrt(sum_sq / values.size());
  EXPECT_GT(std_dev, 0.005);
  EXPECT_LT(std_dev, 0.1);
  // The norms are exactly 1.
  const GgufTensorInfo* norm = f.FindTensor("output_norm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->type, DType::kF32);
  for (int i = 0; i < 8; ++i) {
    float x;
    std::memcpy(&x, f.TensorData(*norm) + 4 * i, 4);
    EXPECT_EQ(x, 1.0f);
  }
}

TEST(GgufRealFileTest, VocabOnlyFile) {
  const std::string path = kModels + "/vocab/ggml-vocab-llama-spm.gguf";
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.metadata().size(), 22u);
  EXPECT_EQ(f.GetStringArray("tokenizer.ggml.tokens")->size(), 32000u);
  EXPECT_EQ(f.GetIntArray("tokenizer.ggml.token_type")->size(), 32000u);
  EXPECT_EQ(*f.GetBool("tokenizer.ggml.add_bos_token"), true);
  EXPECT_EQ(*f.GetBool("tokenizer.ggml.add_eos_token"), false);
}

TEST(GgufRealFileTest, EveryVocabFileOpens) {
  int opened = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kModels + "/vocab")) {
    if (entry.path().extension() != ".gguf") continue;
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(entry.path().string());
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_TRUE((*file)->Has("tokenizer.ggml.tokens")) << entry.path();
    ++opened;
  }
  EXPECT_GE(opened, 11);
}

}  // namespace
}  // namespace ellm
