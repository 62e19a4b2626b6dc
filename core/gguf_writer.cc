// GGUF v3 writer; the layout is the one described in gguf.h.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/gguf.h"

namespace ellm {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" as a little-endian u32
constexpr uint32_t kGgufVersion = 3;
constexpr uint64_t kDefaultAlignment = 32;

GgufValue Unsigned(GgufValueType type, uint64_t x) {
  GgufValue v;
  v.type = type;
  v.u = x;
  v.i = x <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? static_cast<int64_t>(x)
                                                                       : 0;
  return v;
}

GgufValue Signed(GgufValueType type, int64_t x) {
  GgufValue v;
  v.type = type;
  v.i = x;
  return v;
}

GgufValue Float32(float x) {
  GgufValue v;
  v.type = GgufValueType::kFloat32;
  v.f = x;
  return v;
}

GgufValue String(std::string s) {
  GgufValue v;
  v.type = GgufValueType::kString;
  v.s = std::move(s);
  return v;
}

GgufValue Array(GgufValueType elem_type, std::vector<GgufValue> elements) {
  GgufValue v;
  v.type = GgufValueType::kArray;
  v.elem_type = elem_type;
  v.array = std::move(elements);
  return v;
}

template <typename T>
void Put(std::string* out, T x) {
  out->append(reinterpret_cast<const char*>(&x), sizeof(T));
}

void PutString(std::string* out, std::string_view s) {
  Put<uint64_t>(out, s.size());
  out->append(s);
}

// A non-array value of `type`, from the field that type uses.
void PutScalar(std::string* out, GgufValueType type, const GgufValue& v) {
  switch (type) {
    case GgufValueType::kUint8: Put<uint8_t>(out, static_cast<uint8_t>(v.i)); return;
    case GgufValueType::kInt8: Put<int8_t>(out, static_cast<int8_t>(v.i)); return;
    case GgufValueType::kUint16: Put<uint16_t>(out, static_cast<uint16_t>(v.i)); return;
    case GgufValueType::kInt16: Put<int16_t>(out, static_cast<int16_t>(v.i)); return;
    case GgufValueType::kUint32: Put<uint32_t>(out, static_cast<uint32_t>(v.i)); return;
    case GgufValueType::kInt32: Put<int32_t>(out, static_cast<int32_t>(v.i)); return;
    case GgufValueType::kUint64: Put<uint64_t>(out, v.u); return;
    case GgufValueType::kInt64: Put<int64_t>(out, v.i); return;
    case GgufValueType::kFloat32: Put<float>(out, static_cast<float>(v.f)); return;
    case GgufValueType::kFloat64: Put<double>(out, v.f); return;
    case GgufValueType::kBool: Put<uint8_t>(out, v.b ? 1 : 0); return;
    case GgufValueType::kString: PutString(out, v.s); return;
    case GgufValueType::kArray: break;
  }
  ::ellm::internal::CheckFailed(__FILE__, __LINE__, "scalar type",
                                absl::StrCat("GgufWriter cannot write a value of type ",
                                             static_cast<unsigned>(type), " as a scalar"));
}

// u32 value_type | value (arrays: u32 elem_type | u64 count | elements).
void PutValue(std::string* out, const GgufValue& v) {
  Put<uint32_t>(out, static_cast<uint32_t>(v.type));
  if (v.type != GgufValueType::kArray) {
    PutScalar(out, v.type, v);
    return;
  }
  Put<uint32_t>(out, static_cast<uint32_t>(v.elem_type));
  Put<uint64_t>(out, v.array.size());
  for (const GgufValue& e : v.array) PutScalar(out, v.elem_type, e);
}

uint64_t AlignUp(uint64_t x, uint64_t alignment) { return (x + alignment - 1) & ~(alignment - 1); }

void PadTo(std::string* out, uint64_t size) {
  if (out->size() < size) out->append(size - out->size(), '\0');
}

}  // namespace

void GgufWriter::Set(std::string key, GgufValue value) {
  for (Entry& e : entries_) {
    if (e.key == key) {  // setting a key again replaces it in place
      e.value = std::move(value);
      return;
    }
  }
  entries_.push_back(Entry{std::move(key), std::move(value)});
}

void GgufWriter::SetValue(std::string key, GgufValue value) {
  Set(std::move(key), std::move(value));
}

void GgufWriter::SetString(std::string key, std::string value) {
  Set(std::move(key), String(std::move(value)));
}

void GgufWriter::SetUint32(std::string key, uint32_t value) {
  Set(std::move(key), Unsigned(GgufValueType::kUint32, value));
}

void GgufWriter::SetInt32(std::string key, int32_t value) {
  Set(std::move(key), Signed(GgufValueType::kInt32, value));
}

void GgufWriter::SetUint64(std::string key, uint64_t value) {
  Set(std::move(key), Unsigned(GgufValueType::kUint64, value));
}

void GgufWriter::SetFloat32(std::string key, float value) {
  Set(std::move(key), Float32(value));
}

void GgufWriter::SetBool(std::string key, bool value) {
  GgufValue v;
  v.type = GgufValueType::kBool;
  v.b = value;
  Set(std::move(key), std::move(v));
}

void GgufWriter::SetStringArray(std::string key, std::vector<std::string> values) {
  std::vector<GgufValue> elements;
  elements.reserve(values.size());
  for (std::string& s : values) elements.push_back(String(std::move(s)));
  Set(std::move(key), Array(GgufValueType::kString, std::move(elements)));
}

void GgufWriter::SetFloat32Array(std::string key, std::vector<float> values) {
  std::vector<GgufValue> elements;
  elements.reserve(values.size());
  for (float x : values) elements.push_back(Float32(x));
  Set(std::move(key), Array(GgufValueType::kFloat32, std::move(elements)));
}

void GgufWriter::SetInt32Array(std::string key, std::vector<int32_t> values) {
  std::vector<GgufValue> elements;
  elements.reserve(values.size());
  for (int32_t x : values) elements.push_back(Signed(GgufValueType::kInt32, x));
  Set(std::move(key), Array(GgufValueType::kInt32, std::move(elements)));
}

void GgufWriter::CopyMetadata(const GgufFile& file, std::string_view prefix) {
  for (const auto& [key, value] : file.metadata()) {
    if (absl::StartsWith(key, ToAbsl(prefix))) Set(key, value);
  }
}

absl::Status GgufWriter::AddTensor(std::string name, std::vector<int64_t> shape, DType type,
                                   std::string data) {
  // The same rules the reader enforces, so that what is written reads back.
  if (name.empty() || name.size() > kGgufMaxTensorNameLength) {
    return absl::InvalidArgumentError(absl::StrCat("tensor name '", name, "' must have 1 to ",
                                                   kGgufMaxTensorNameLength, " bytes"));
  }
  for (const Tensor& t : tensors_) {
    if (t.name == name) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name '", name, "'"));
    }
  }
  if (shape.empty() || shape.size() > kGgufMaxDims) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has ", shape.size(),
                                                   " dimensions (1 to ", kGgufMaxDims, ")"));
  }
  const DTypeTraits* traits = FindDTypeTraits(static_cast<uint32_t>(type));
  if (traits == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has unknown type ",
                                                   static_cast<uint32_t>(type)));
  }
  uint64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(elements, static_cast<uint64_t>(d), &elements)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has a bad shape"));
    }
  }
  if (shape[0] % traits->block_elements != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' row of ", shape[0],
                                                   " elements is not a whole number of ",
                                                   ToAbsl(traits->name), " blocks"));
  }
  ASSIGN_OR_RETURN(uint64_t bytes, DTypeBytes(type, elements));
  if (data.size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has ", data.size(),
                                                   " bytes of data; its shape and type need ",
                                                   bytes));
  }
  tensors_.push_back(Tensor{std::move(name), std::move(shape), type, std::move(data)});
  return absl::OkStatus();
}

std::string GgufWriter::ToBytes(uint64_t alignment) const {
  ELLM_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0,
             absl::StrCat("GgufWriter::ToBytes: alignment ", alignment, " is not a power of two"));
  bool has_alignment_key = false;
  for (const Entry& e : entries_) has_alignment_key |= e.key == "general.alignment";
  const bool add_alignment_key = alignment != kDefaultAlignment && !has_alignment_key;

  std::string out;
  Put<uint32_t>(&out, kGgufMagic);
  Put<uint32_t>(&out, kGgufVersion);
  Put<uint64_t>(&out, tensors_.size());
  Put<uint64_t>(&out, entries_.size() + (add_alignment_key ? 1 : 0));
  for (const Entry& e : entries_) {
    PutString(&out, e.key);
    PutValue(&out, e.value);
  }
  if (add_alignment_key) {
    PutString(&out, "general.alignment");
    PutValue(&out, Unsigned(GgufValueType::kUint32, alignment));
  }

  // Tensor i lives at data_start + offsets[i]; every tensor starts aligned.
  std::vector<uint64_t> offsets;
  uint64_t data_size = 0;
  for (const Tensor& t : tensors_) {
    offsets.push_back(data_size);
    data_size = AlignUp(data_size + t.data.size(), alignment);
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& t = tensors_[i];
    PutString(&out, t.name);
    Put<uint32_t>(&out, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) Put<uint64_t>(&out, static_cast<uint64_t>(d));
    Put<uint32_t>(&out, static_cast<uint32_t>(t.type));
    Put<uint64_t>(&out, offsets[i]);
  }
  if (tensors_.empty()) return out;  // no data section, no padding

  const uint64_t data_start = AlignUp(out.size(), alignment);
  for (size_t i = 0; i < tensors_.size(); ++i) {
    PadTo(&out, data_start + offsets[i]);
    out.append(tensors_[i].data);
  }
  PadTo(&out, data_start + data_size);
  return out;
}

absl::Status GgufWriter::WriteFile(const std::string& path, uint64_t alignment) const {
  const std::string bytes = ToBytes(alignment);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    const int error = errno;
    const std::string message = absl::StrCat(
        "cannot create '", path, "': ", std::error_code(error, std::generic_category()).message());
    return error == ENOENT ? absl::NotFoundError(message) : absl::InternalError(message);
  }
  const bool wrote = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  const bool closed = std::fclose(f) == 0;
  if (!wrote || !closed) {
    return absl::InternalError(absl::StrCat("cannot write ", bytes.size(), " bytes to '", path, "'"));
  }
  return absl::OkStatus();
}

}  // namespace ellm
