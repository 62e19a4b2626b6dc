// GGUF reader. The file is untrusted: every read goes through a Cursor that
// checks it against the file size, every count is bounded before anything is
// allocated for it, and all offset arithmetic is overflow-checked.
#include "core/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <algorithm>
#include <cstring>
#include <limits>
#include <system_error>
#include <type_traits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace ellm {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the GGUF reader reads little-endian fields in place");

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian u32

// A name from the file, quoted and escaped for an error message; long names
// are cut so that a hostile 64 KiB key does not become a 64 KiB message.
std::string Quote(absl::string_view s) {
  constexpr size_t kMaxShown = 96;
  if (s.size() <= kMaxShown) return absl::StrCat("'", absl::CHexEscape(s), "'");
  return absl::StrCat("'", absl::CHexEscape(s.substr(0, kMaxShown)), "...' (", s.size(),
                      " bytes)");
}

bool IsKnownValueType(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::kFloat64); }

bool IsIntegerType(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
      return true;
    default:
      return false;
  }
}

bool IsFloatType(GgufValueType t) {
  return t == GgufValueType::kFloat32 || t == GgufValueType::kFloat64;
}

// Bytes an element of `t` takes at least in the file (a string is at least
// its u64 length). Used to reject counts the rest of the file cannot hold.
uint64_t MinEncodedSize(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
    case GgufValueType::kString:
      return 8;
    case GgufValueType::kArray:
      return 4 + 8;
  }
  return 1;
}

// "u32", or "array of string" for arrays.
std::string DescribeType(const GgufValue& v) {
  if (v.type != GgufValueType::kArray) return std::string(GgufValueTypeName(v.type));
  return absl::StrCat("array of ", ToAbsl(GgufValueTypeName(v.elem_type)));
}

// Reads little-endian fields from [data, data + size). Every failure names
// `context` (what is being read, e.g. "key #3 ('tokenizer.ggml.tokens')").
class Cursor {
 public:
  Cursor(const uint8_t* data, uint64_t size) : data_(data), size_(size) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }
  void set_context(std::string context) { context_ = std::move(context); }

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(context_, ": ", what));
  }
  absl::Status Truncated(uint64_t need) const {
    return absl::InvalidArgumentError(
        absl::StrFormat("truncated while reading %s: need %d bytes at offset %d, file size %d",
                        context_, need, pos_, size_));
  }

  absl::Status ReadBytes(void* dst, uint64_t n) {
    if (n > remaining()) return Truncated(n);
    std::memcpy(dst, data_ + pos_, n);
    pos_ += n;
    return absl::OkStatus();
  }
  template <typename T>
  absl::Status ReadScalar(T* value) {
    static_assert(std::is_arithmetic_v<T>);
    return ReadBytes(value, sizeof(T));
  }
  // A GGUF string: u64 length, then that many bytes (no terminator).
  absl::Status ReadString(uint64_t max_length, std::string* out) {
    uint64_t length = 0;
    RETURN_IF_ERROR(ReadScalar(&length));
    if (length > max_length) {
      return Error(absl::StrCat("string length ", length, " exceeds the limit of ", max_length));
    }
    if (length > remaining()) return Truncated(length);
    out->assign(reinterpret_cast<const char*>(data_ + pos_), length);
    pos_ += length;
    return absl::OkStatus();
  }

 private:
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
  std::string context_;
};

template <typename T>
absl::Status ReadInteger(Cursor& in, GgufValue* v) {
  T x = 0;
  RETURN_IF_ERROR(in.ReadScalar(&x));
  if constexpr (std::is_signed_v<T>) {
    v->i = x;
  } else {
    // Unsigned values keep their exact value in `u`; `i` holds it when it fits.
    v->u = x;
    v->i = x <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
               ? static_cast<int64_t>(x)
               : 0;
  }
  return absl::OkStatus();
}

// Reads a value of non-array type `type` into `v` (whose `type` is set here).
absl::Status ReadScalarValue(Cursor& in, GgufValueType type, GgufValue* v) {
  v->type = type;
  switch (type) {
    case GgufValueType::kUint8: return ReadInteger<uint8_t>(in, v);
    case GgufValueType::kInt8: return ReadInteger<int8_t>(in, v);
    case GgufValueType::kUint16: return ReadInteger<uint16_t>(in, v);
    case GgufValueType::kInt16: return ReadInteger<int16_t>(in, v);
    case GgufValueType::kUint32: return ReadInteger<uint32_t>(in, v);
    case GgufValueType::kInt32: return ReadInteger<int32_t>(in, v);
    case GgufValueType::kUint64: return ReadInteger<uint64_t>(in, v);
    case GgufValueType::kInt64: return ReadInteger<int64_t>(in, v);
    case GgufValueType::kFloat32: {
      float x = 0;
      RETURN_IF_ERROR(in.ReadScalar(&x));
      v->f = x;
      return absl::OkStatus();
    }
    case GgufValueType::kFloat64: return in.ReadScalar(&v->f);
    case GgufValueType::kBool: {
      uint8_t x = 0;
      RETURN_IF_ERROR(in.ReadScalar(&x));
      v->b = x != 0;
      return absl::OkStatus();
    }
    case GgufValueType::kString: return in.ReadString(kGgufMaxStringLength, &v->s);
    case GgufValueType::kArray: break;
  }
  return in.Error("internal: array passed to ReadScalarValue");
}

// Array: u32 elem_type | u64 count | count elements. `element_budget` is what
// is left of kGgufMaxTotalArrayElements; every element costs one.
absl::Status ReadArrayValue(Cursor& in, uint64_t* element_budget, GgufValue* v) {
  v->type = GgufValueType::kArray;
  uint32_t elem_type = 0;
  RETURN_IF_ERROR(in.ReadScalar(&elem_type));
  if (!IsKnownValueType(elem_type)) {
    return in.Error(absl::StrCat("array has unknown element type ", elem_type));
  }
  v->elem_type = static_cast<GgufValueType>(elem_type);
  if (v->elem_type == GgufValueType::kArray) return in.Error("nested arrays are not supported");
  uint64_t count = 0;
  RETURN_IF_ERROR(in.ReadScalar(&count));
  if (count > kGgufMaxArrayCount) {
    return in.Error(
        absl::StrCat("array count ", count, " exceeds the limit of ", kGgufMaxArrayCount));
  }
  if (count > *element_budget) {
    return in.Error(absl::StrCat("array count ", count, " exceeds the limit of ",
                                 kGgufMaxTotalArrayElements, " elements over all arrays"));
  }
  // Before allocating: the rest of the file must be able to hold `count`
  // elements (both factors are bounded above, so no overflow).
  const uint64_t min_bytes = count * MinEncodedSize(v->elem_type);
  if (min_bytes > in.remaining()) return in.Truncated(min_bytes);
  *element_budget -= count;
  v->array.resize(count);
  for (GgufValue& element : v->array) {
    RETURN_IF_ERROR(ReadScalarValue(in, v->elem_type, &element));
  }
  return absl::OkStatus();
}

// Closes a file descriptor when it goes out of scope.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() { ::close(fd_); }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;

 private:
  int fd_;
};

absl::Status ErrnoError(int error, absl::string_view what) {
  const std::string message =
      absl::StrCat(what, ": ", std::error_code(error, std::generic_category()).message());
  switch (error) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOMEM:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace

std::string_view GgufValueTypeName(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8: return "u8";
    case GgufValueType::kInt8: return "i8";
    case GgufValueType::kUint16: return "u16";
    case GgufValueType::kInt16: return "i16";
    case GgufValueType::kUint32: return "u32";
    case GgufValueType::kInt32: return "i32";
    case GgufValueType::kFloat32: return "f32";
    case GgufValueType::kBool: return "bool";
    case GgufValueType::kString: return "string";
    case GgufValueType::kArray: return "array";
    case GgufValueType::kUint64: return "u64";
    case GgufValueType::kInt64: return "i64";
    case GgufValueType::kFloat64: return "f64";
  }
  return "unknown";
}

int64_t GgufTensorInfo::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // overflow excluded when the file was parsed
  return n;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (the type check
  // below refuses it); it changes nothing for a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoError(errno, absl::StrCat("cannot open '", path, "'"));
  FdCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError(errno, absl::StrCat("cannot stat '", path, "'"));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' is not a regular file"));
  }

  std::unique_ptr<GgufFile> file(new GgufFile());
  file->path_ = path;
  file->size_ = static_cast<uint64_t>(st.st_size);
  if (file->size_ > 0) {  // mmap of 0 bytes fails; an empty file fails in Parse
    void* p = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) return ErrnoError(errno, absl::StrCat("cannot mmap '", path, "'"));
    file->mapping_ = p;
    file->base_ = static_cast<const uint8_t*>(p);
  }
  absl::Status status = file->Parse();
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat(path, ": ", status.message()));
  }
  return file;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::FromBytes(std::string_view bytes) {
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->owned_bytes_.assign(bytes.data(), bytes.size());
  file->base_ = reinterpret_cast<const uint8_t*>(file->owned_bytes_.data());
  file->size_ = file->owned_bytes_.size();
  RETURN_IF_ERROR(file->Parse());
  return file;
}

GgufFile::~GgufFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
}

absl::Status GgufFile::Parse() {
  Cursor in(base_, size_);

  // Header: u32 magic | u32 version | u64 n_tensors | u64 n_kv.
  in.set_context("the header");
  uint32_t magic = 0;
  RETURN_IF_ERROR(in.ReadScalar(&magic));
  if (magic != kGgufMagic) {
    return absl::InvalidArgumentError(absl::StrFormat("bad magic 0x%08x (not a GGUF file)", magic));
  }
  RETURN_IF_ERROR(in.ReadScalar(&version_));
  // v2 and v3 have the same little-endian layout (v3 only added big-endian
  // files, which show up here as a byte-swapped version); v1 had u32 counts.
  if (version_ != 2 && version_ != 3) {
    const bool swapped = version_ == 0x02000000u || version_ == 0x03000000u;
    return absl::InvalidArgumentError(absl::StrCat("unsupported GGUF version ", version_,
                                                   swapped ? " (big-endian file)" : ""));
  }
  uint64_t n_tensors = 0, n_kv = 0;
  RETURN_IF_ERROR(in.ReadScalar(&n_tensors));
  RETURN_IF_ERROR(in.ReadScalar(&n_kv));
  if (n_tensors > kGgufMaxTensors) {
    return absl::InvalidArgumentError(absl::StrCat("header claims ", n_tensors,
                                                   " tensors (limit ", kGgufMaxTensors, ")"));
  }
  if (n_kv > kGgufMaxKeys) {
    return absl::InvalidArgumentError(
        absl::StrCat("header claims ", n_kv, " metadata keys (limit ", kGgufMaxKeys, ")"));
  }

  // Metadata: n_kv × { string key | u32 value_type | value }. Counts are not
  // trusted for reservations; each entry consumes bytes, so a bogus count
  // ends in a truncation error.
  uint64_t element_budget = kGgufMaxTotalArrayElements;
  for (uint64_t k = 0; k < n_kv; ++k) {
    in.set_context(absl::StrCat("key #", k));
    std::string key;
    RETURN_IF_ERROR(in.ReadString(kGgufMaxKeyLength, &key));
    in.set_context(absl::StrCat("key #", k, " (", Quote(key), ")"));
    if (metadata_.contains(key)) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate key ", Quote(key), " (key #", k, ")"));
    }
    uint32_t type = 0;
    RETURN_IF_ERROR(in.ReadScalar(&type));
    if (!IsKnownValueType(type)) return in.Error(absl::StrCat("unknown value type ", type));
    GgufValue value;
    if (static_cast<GgufValueType>(type) == GgufValueType::kArray) {
      RETURN_IF_ERROR(ReadArrayValue(in, &element_budget, &value));
    } else {
      RETURN_IF_ERROR(ReadScalarValue(in, static_cast<GgufValueType>(type), &value));
    }
    metadata_.emplace(std::move(key), std::move(value));
  }

  if (Has("general.alignment")) {
    absl::StatusOr<int64_t> alignment = GetInt("general.alignment");
    if (!alignment.ok()) return alignment.status();
    if (*alignment <= 0 || (*alignment & (*alignment - 1)) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("general.alignment ", *alignment, " is not a nonzero power of two"));
    }
    alignment_ = static_cast<uint64_t>(*alignment);
  }

  // Tensor infos: n_tensors × { string name | u32 n_dims | u64 ne[n_dims] |
  // u32 ggml_type | u64 offset }.
  for (uint64_t t = 0; t < n_tensors; ++t) {
    in.set_context(absl::StrCat("tensor info #", t));
    GgufTensorInfo info;
    RETURN_IF_ERROR(in.ReadString(kGgufMaxTensorNameLength, &info.name));
    const std::string name = Quote(info.name);
    in.set_context(absl::StrCat("tensor info #", t, " (", name, ")"));
    if (tensor_index_.contains(info.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate tensor name ", name, " (tensor #", t, ")"));
    }
    uint32_t n_dims = 0;
    RETURN_IF_ERROR(in.ReadScalar(&n_dims));
    if (n_dims == 0 || n_dims > kGgufMaxDims) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has ", n_dims,
                                                     " dimensions (ellm supports 1 to ",
                                                     kGgufMaxDims, ")"));
    }
    uint64_t elements = 1;
    bool too_many = false;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t ne = 0;
      RETURN_IF_ERROR(in.ReadScalar(&ne));
      if (ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", name, " dimension ", d, " is ", ne, " (negative as int64)"));
      }
      info.shape.push_back(static_cast<int64_t>(ne));
      too_many |= __builtin_mul_overflow(elements, ne, &elements);
    }
    uint32_t type_id = 0;
    RETURN_IF_ERROR(in.ReadScalar(&type_id));
    RETURN_IF_ERROR(in.ReadScalar(&info.offset));

    if (too_many || elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, " shape [", absl::StrJoin(info.shape, ", "),
                       "] has more elements than int64 can count"));
    }
    const DTypeTraits* traits = FindDTypeTraits(type_id);
    if (traits == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, " has unknown type ", type_id));
    }
    info.type = traits->type;
    // Rows (shape[0]) are whole blocks; this also makes the total whole blocks.
    if (info.shape[0] % traits->block_elements != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", name, " row of ", info.shape[0], " elements is not a whole number of ",
          ToAbsl(traits->name), " blocks (", traits->block_elements, " elements each)"));
    }
    absl::StatusOr<uint64_t> bytes = DTypeBytes(info.type, elements);
    if (!bytes.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, ": ", bytes.status().message()));
    }
    info.bytes = *bytes;
    if (info.offset % alignment_ != 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " offset ", info.offset,
                                                     " is not a multiple of the alignment ",
                                                     alignment_));
    }
    tensor_index_.emplace(info.name, tensors_.size());
    tensors_.push_back(std::move(info));
  }

  // The data section starts at the first multiple of the alignment after
  // the tensor infos. A file without tensors needs none (vocab-only files
  // end right here, unpadded).
  uint64_t data_start = 0;
  if (__builtin_add_overflow(in.pos(), alignment_ - 1, &data_start)) {
    return absl::InvalidArgumentError(
        absl::StrCat("general.alignment ", alignment_, " puts the data section past 2^64"));
  }
  data_start_ = data_start & ~(alignment_ - 1);
  if (tensors_.empty()) return absl::OkStatus();

  const uint64_t data_size = data_start_ <= size_ ? size_ - data_start_ : 0;
  for (const GgufTensorInfo& info : tensors_) {
    // offset + bytes <= data_size, written so that nothing can overflow.
    if (info.offset > data_size || info.bytes > data_size - info.offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", Quote(info.name), " (offset ", info.offset, ", ", info.bytes,
          " bytes) lies outside the file (size ", size_, ", data section starts at ",
          data_start_, ")"));
    }
  }
  if (data_start_ > size_) {  // only left for tensors of 0 bytes
    return absl::InvalidArgumentError(absl::StrCat(
        "data section starts at ", data_start_, ", past the end of the file (size ", size_, ")"));
  }
  return absl::OkStatus();
}

bool GgufFile::Has(std::string_view key) const { return metadata_.find(key) != metadata_.end(); }

const GgufValue* GgufFile::Find(std::string_view key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {

absl::StatusOr<const GgufValue*> FindOrNotFound(const GgufFile& file, std::string_view key) {
  const GgufValue* v = file.Find(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("key '", ToAbsl(key), "' not found"));
  return v;
}

absl::Status WrongType(std::string_view key, const GgufValue& v, absl::string_view wanted) {
  return absl::InvalidArgumentError(
      absl::StrCat("key '", ToAbsl(key), "' is of type ", DescribeType(v), ", not ", wanted));
}

// An integer value (scalar or array element) as int64.
absl::StatusOr<int64_t> IntOf(std::string_view key, const GgufValue& v) {
  if (v.type == GgufValueType::kUint64 &&
      v.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("key '", ToAbsl(key), "' value ", v.u, " does not fit in int64"));
  }
  return v.i;
}

// An integer or float value as double.
double DoubleOf(const GgufValue& v) {
  if (IsFloatType(v.type)) return v.f;
  if (v.type == GgufValueType::kUint64) return static_cast<double>(v.u);
  return static_cast<double>(v.i);
}

}  // namespace

absl::StatusOr<std::string> GgufFile::GetString(std::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, FindOrNotFound(*this, key));
  if (v->type != GgufValueType::kString) return WrongType(key, *v, "string");
  return v->s;
}

absl::StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, FindOrNotFound(*this, key));
  if (!IsIntegerType(v->type)) return WrongType(key, *v, "an integer");
  return IntOf(key, *v);
}

absl::StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, FindOrNotFound(*this, key));
  if (!IsIntegerType(v->type) && !IsFloatType(v->type)) return WrongType(key, *v, "a number");
  return DoubleOf(*v);
}

absl::StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, FindOrNotFound(*this, key));
  if (v->type != GgufValueType::kBool) return WrongType(key, *v, "bool");
  return v->b;
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(std::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, FindOrNotFound(*this, key));
  if (v->type != GgufValueType::kArray || v->elem_type != GgufValueType::kString) {
    return WrongType(key, *v, "array of string");
  }
  std::vector<std::string> out;
  out.reserve(v->array.size());
  for (const GgufValue& e : v->array) out.push_back(e.s);
  return out;
}

absl::StatusOr<std::vector<double>> GgufFile::GetFloatArray(std::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, FindOrNotFound(*this, key));
  if (v->type != GgufValueType::kArray ||
      (!IsIntegerType(v->elem_type) && !IsFloatType(v->elem_type))) {
    return WrongType(key, *v, "array of numbers");
  }
  std::vector<double> out;
  out.reserve(v->array.size());
  for (const GgufValue& e : v->array) out.push_back(DoubleOf(e));
  return out;
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(std::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, FindOrNotFound(*this, key));
  if (v->type != GgufValueType::kArray || !IsIntegerType(v->elem_type)) {
    return WrongType(key, *v, "array of integers");
  }
  std::vector<int64_t> out;
  out.reserve(v->array.size());
  for (const GgufValue& e : v->array) {
    ASSIGN_OR_RETURN(int64_t x, IntOf(key, e));
    out.push_back(x);
  }
  return out;
}

const GgufTensorInfo* GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

uint64_t GgufFile::Fingerprint() const {
  // Every byte of the file: the KV store keys on it, and another model of
  // the same size and tensor table (a fine-tune, a re-export) must never
  // match. Four independent multiply-rotate lanes over 64-bit words, then
  // the tail bytes and the size (486 MiB from the page cache took 0.2 s on a
  // 2-core Xeon VM: about 6 s for a 15 GB file).
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ULL, kMul2 = 0xC2B2AE3D27D4EB4FULL;
  uint64_t lane[4] = {0x243F6A8885A308D3ULL, 0x13198A2E03707344ULL, 0xA4093822299F31D0ULL,
                      0x082EFA98EC4E6C89ULL};
  auto step = [](uint64_t h, uint64_t w) {
    h = (h ^ w) * kMul;
    return (h << 29) | (h >> 35);
  };
  const uint64_t words = size_ / 8;
  uint64_t i = 0;
  for (; i + 4 <= words; i += 4) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, base_ + 8 * (i + k), 8);
      lane[k] = step(lane[k], w);
    }
  }
  uint64_t h = size_ * kMul2;
  for (; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, base_ + 8 * i, 8);
    h = step(h, w);
  }
  for (uint64_t j = 8 * words; j < size_; ++j) h = step(h, base_[j]);
  for (uint64_t l : lane) h = step(h, l * kMul2);
  h ^= h >> 33;
  h *= kMul2;
  h ^= h >> 29;
  return h;
}

const uint8_t* GgufFile::TensorData(const GgufTensorInfo& info) const {
  return base_ + data_start_ + info.offset;
}

}  // namespace ellm
