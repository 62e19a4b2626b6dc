// GGUF v3 reader (over mmap) and writer.
//
// File layout (little endian), as the GGUF format defines it:
//   u32 magic "GGUF" | u32 version (3) | u64 n_tensors | u64 n_kv
//   n_kv ×  { string key | u32 value_type | value }
//   n_tensors × { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset }
//   padding to `general.alignment` (default 32)
//   data section: each tensor at data_start + offset (offset a multiple of the alignment)
// string = u64 length + bytes (no terminator); array = u32 elem_type + u64 count + elems.
//
// The reader treats the file as hostile: every length, count and offset is
// checked against the file size before use, and each failure is an
// InvalidArgument status that names what was wrong and where.
// A file with no tensors needs no data section (vocab-only files).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace ellm {

enum class GgufValueType : uint32_t {
  kUint8 = 0, kInt8 = 1, kUint16 = 2, kInt16 = 3, kUint32 = 4, kInt32 = 5,
  kFloat32 = 6, kBool = 7, kString = 8, kArray = 9, kUint64 = 10, kInt64 = 11,
  kFloat64 = 12,
};

// "u8", "i32", "f32", "string", "array", ...; "unknown" for other values.
std::string_view GgufValueTypeName(GgufValueType type);

// Reader limits: a corrupt count or length fails with an error naming the
// limit instead of allocating. Real files stay far below them (the largest
// vocabularies have ~260k tokens).
inline constexpr uint64_t kGgufMaxKeyLength = 65535;          // GGUF spec
inline constexpr uint64_t kGgufMaxTensorNameLength = 64;      // GGUF spec
inline constexpr uint64_t kGgufMaxStringLength = 256u << 20;  // one string value
inline constexpr uint64_t kGgufMaxArrayCount = 8u << 20;      // elements of one array
inline constexpr uint64_t kGgufMaxTotalArrayElements = 16u << 20;  // all arrays together
inline constexpr uint64_t kGgufMaxKeys = 1u << 20;
inline constexpr uint64_t kGgufMaxTensors = 1u << 20;
inline constexpr uint32_t kGgufMaxDims = 4;

// One metadata value. Scalars are widened: integers into `i` (or `u` for
// uint64 beyond int64), floats into `f`. Arrays keep their element type and
// hold their elements in `array` (strings in `array[i].s`).
struct GgufValue {
  GgufValueType type = GgufValueType::kUint8;
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0;
  bool b = false;
  std::string s;
  GgufValueType elem_type = GgufValueType::kUint8;  // arrays only
  std::vector<GgufValue> array;                     // arrays only
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> shape;  // GGUF order: shape[0] is the contiguous dimension
  DType type = DType::kF32;
  uint64_t offset = 0;         // relative to the data section
  uint64_t bytes = 0;
  int64_t elements() const;
};

class GgufFile {
 public:
  // Maps and parses `path`. Errors: NotFound (missing file), InvalidArgument
  // with a message naming the problem (bad magic, unsupported version,
  // truncated at <what>, tensor '<name>' out of range, unknown tensor type...).
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses an in-memory copy (tests; the bytes are copied).
  static absl::StatusOr<std::unique_ptr<GgufFile>> FromBytes(std::string_view bytes);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  // The file's identity for caches derived from it (the KV store): a hash of
  // every byte (a pass over the file: seconds for a large model). Stable
  // across runs and machines. (It hashed the metadata and three 64-byte
  // windows of each tensor: a model with other weights elsewhere matched.)
  uint64_t Fingerprint() const;
  uint64_t alignment() const { return alignment_; }
  uint64_t size() const { return size_; }  // bytes of the file
  const std::string& path() const { return path_; }

  bool Has(std::string_view key) const;
  const GgufValue* Find(std::string_view key) const;
  const std::map<std::string, GgufValue, std::less<>>& metadata() const { return metadata_; }

  // Typed getters: NotFound when absent, InvalidArgument when of another kind.
  // GetInt accepts every integer type, GetFloat every integer or float type.
  absl::StatusOr<std::string> GetString(std::string_view key) const;
  absl::StatusOr<int64_t> GetInt(std::string_view key) const;
  absl::StatusOr<double> GetFloat(std::string_view key) const;
  absl::StatusOr<bool> GetBool(std::string_view key) const;
  absl::StatusOr<std::vector<std::string>> GetStringArray(std::string_view key) const;
  absl::StatusOr<std::vector<double>> GetFloatArray(std::string_view key) const;
  absl::StatusOr<std::vector<int64_t>> GetIntArray(std::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* FindTensor(std::string_view name) const;
  // Start of a tensor's bytes (inside the mapping; valid while this lives).
  const uint8_t* TensorData(const GgufTensorInfo& info) const;

 private:
  GgufFile() = default;
  absl::Status Parse();

  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  void* mapping_ = nullptr;     // munmap'd in the destructor when set
  std::string owned_bytes_;     // FromBytes
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_start_ = 0;
  std::map<std::string, GgufValue, std::less<>> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

// Builds a GGUF v3 file. Keys keep insertion order; tensors are laid out in
// insertion order, each aligned.
class GgufWriter {
 public:
  void SetString(std::string key, std::string value);
  void SetUint32(std::string key, uint32_t value);
  void SetInt32(std::string key, int32_t value);
  void SetUint64(std::string key, uint64_t value);
  void SetFloat32(std::string key, float value);
  void SetBool(std::string key, bool value);
  void SetStringArray(std::string key, std::vector<std::string> values);
  void SetFloat32Array(std::string key, std::vector<float> values);
  void SetInt32Array(std::string key, std::vector<int32_t> values);
  // Sets a value of any type (e.g. one read by GgufFile, or one a test builds).
  // Scalars are written from the field their type uses: `u` for uint64, `i`
  // for the other integers, `f` for floats, `b`, `s`; arrays from elem_type
  // and `array` (nested arrays are not part of what ellm reads or writes).
  void SetValue(std::string key, GgufValue value);
  // Copies every metadata key of `file` whose name starts with `prefix`
  // (e.g. "tokenizer.") — used to give a made model a real vocabulary.
  void CopyMetadata(const GgufFile& file, std::string_view prefix);
  // `data` must hold exactly the bytes of `shape` elements of `type`.
  absl::Status AddTensor(std::string name, std::vector<int64_t> shape, DType type,
                         std::string data);

  // The whole file. `alignment` (a nonzero power of two; anything else is a
  // programmer error and fatal) pads the data section and every tensor. When
  // it is not 32 a u32 `general.alignment` key is added, unless one was set
  // explicitly: an explicit key is written as given (tests use that to make
  // inconsistent files). With no tensors the file ends after the tensor infos.
  std::string ToBytes(uint64_t alignment = 32) const;
  absl::Status WriteFile(const std::string& path, uint64_t alignment = 32) const;

 private:
  struct Entry {
    std::string key;
    GgufValue value;
  };
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    DType type;
    std::string data;
  };
  void Set(std::string key, GgufValue value);
  std::vector<Entry> entries_;
  std::vector<Tensor> tensors_;
};

}  // namespace ellm
