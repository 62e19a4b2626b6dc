// QuantMatrix repacking (matmul_layout.h), activation quantisation, the
// dispatcher and the threading of MatMul. Baseline x86-64 code only: the SIMD
// kernels live in matmul_avx2.cc (also built as matmul_avx2_vnni.cc) and
// matmul_avx512.cc.
#include "mlp-worker/cpu/matmul.h"

#include "core/cpu_features.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/quants.h"
#include "mlp-worker/cpu/matmul_layout.h"

namespace ellm::mlp {
namespace internal {
namespace {

constexpr GroupLayout kF32Layout{1, 16 * 4, 0};
constexpr GroupLayout kHalfLayout{1, 16 * 2, 0};
constexpr GroupLayout kQ8_0Layout{kQK, 512, 32};
constexpr GroupLayout kQ4_0Layout{kQK, 256, 32};
constexpr GroupLayout kQ4_KLayout{kQK_K, 2048, 320};
constexpr GroupLayout kQ5_KLayout{kQK_K, 2560, 320};
constexpr GroupLayout kQ6_KLayout{kQK_K, 3072, 288};

// Meta offsets within a k-quant block's meta bytes.
constexpr int kMetaD = 0, kMetaDmin = 32, kMetaSc = 64, kMetaM = 192;  // Q4_K, Q5_K
constexpr int kMetaSc6 = 32;                                           // Q6_K

// Byte (r, j) of a 64-byte line.
inline int LineByte(int r, int j) { return 4 * r + j; }

// Position of element w (0..31) of a 32-element unit in the nibble packing
// of Q4_0 / Q4_K: line w % 16 / 4, byte j = w % 4, high nibble when w >= 16.
inline int NibbleLine(int w) { return (w % 16) / 4; }

// --- Repacking: row r of a group --------------------------------------------

void RepackF32(const uint8_t* src, int r, int64_t cols, uint8_t* g) {
  std::memcpy(g + static_cast<size_t>(r) * cols * 4, src, cols * 4);
}

void RepackHalf(const uint8_t* src, int r, int64_t cols, uint8_t* g) {
  auto* dst = reinterpret_cast<uint16_t*>(g);
  const auto* h = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < cols; ++i) dst[i * 16 + r] = h[i];
}

void RepackQ8_0(const uint8_t* src, int r, int64_t cols, uint8_t* g) {
  const int64_t nb = cols / kQK;
  const auto* b = reinterpret_cast<const BlockQ8_0*>(src);
  uint8_t* quant = g;
  auto* d = reinterpret_cast<uint16_t*>(g + nb * 512);
  for (int64_t ib = 0; ib < nb; ++ib) {
    d[ib * 16 + r] = b[ib].d;
    for (int e = 0; e < kQK; ++e) {
      quant[ib * 512 + (e / 4) * 64 + LineByte(r, e % 4)] =
          static_cast<uint8_t>(b[ib].qs[e]) ^ 0x80;
    }
  }
}

void RepackQ4_0(const uint8_t* src, int r, int64_t cols, uint8_t* g) {
  const int64_t nb = cols / kQK;
  const auto* b = reinterpret_cast<const BlockQ4_0*>(src);
  uint8_t* quant = g;
  auto* d = reinterpret_cast<uint16_t*>(g + nb * 256);
  for (int64_t ib = 0; ib < nb; ++ib) {
    d[ib * 16 + r] = b[ib].d;
    // ggml's qs[i] already holds element i (low) and i + 16 (high).
    for (int i = 0; i < 16; ++i)
      quant[ib * 256 + NibbleLine(i) * 64 + LineByte(r, i % 4)] = b[ib].qs[i];
  }
}

// Low nibbles of a 256-element super-block's levels into Q4_K's [8 s][4 k] lines.
void PackNibbles256(const int* levels, int r, uint8_t* quant) {
  for (int s = 0; s < 8; ++s) {
    for (int w = 0; w < 16; ++w) {
      const int lo = levels[32 * s + w] & 15, hi = levels[32 * s + 16 + w] & 15;
      quant[s * 256 + NibbleLine(w) * 64 + LineByte(r, w % 4)] = static_cast<uint8_t>(lo | hi << 4);
    }
  }
}

void PackScalesK4(const uint8_t* scales, int r, uint8_t* meta) {
  for (int s = 0; s < 8; ++s) {
    uint8_t sc, m;
    UnpackScaleMinK4(scales, s, &sc, &m);
    meta[kMetaSc + s * 16 + r] = sc;
    meta[kMetaM + (s / 2) * 32 + 2 * r + s % 2] = m;
  }
}

void RepackQ4_K(const uint8_t* src, int r, int64_t cols, uint8_t* g) {
  const int64_t nb = cols / kQK_K;
  const auto* b = reinterpret_cast<const BlockQ4_K*>(src);
  int levels[kQK_K];
  for (int64_t ib = 0; ib < nb; ++ib) {
    uint8_t* meta = g + nb * 2048 + ib * 320;
    reinterpret_cast<uint16_t*>(meta + kMetaD)[r] = b[ib].d;
    reinterpret_cast<uint16_t*>(meta + kMetaDmin)[r] = b[ib].dmin;
    PackScalesK4(b[ib].scales, r, meta);
    UnpackLevelsQ4_K(b[ib], levels);
    PackNibbles256(levels, r, g + ib * 2048);
  }
}

void RepackQ5_K(const uint8_t* src, int r, int64_t cols, uint8_t* g) {
  const int64_t nb = cols / kQK_K;
  const auto* b = reinterpret_cast<const BlockQ5_K*>(src);
  int levels[kQK_K];
  for (int64_t ib = 0; ib < nb; ++ib) {
    uint8_t* quant = g + ib * 2560;
    uint8_t* meta = g + nb * 2560 + ib * 320;
    reinterpret_cast<uint16_t*>(meta + kMetaD)[r] = b[ib].d;
    reinterpret_cast<uint16_t*>(meta + kMetaDmin)[r] = b[ib].dmin;
    PackScalesK4(b[ib].scales, r, meta);
    UnpackLevelsQ5_K(b[ib], levels);
    PackNibbles256(levels, r, quant);
    for (int s = 0; s < 8; ++s) {
      for (int j = 0; j < 4; ++j) {
        uint8_t bits = 0;
        for (int v = 0; v < 8; ++v)
          bits |= static_cast<uint8_t>(((levels[32 * s + 4 * v + j] >> 4) & 1) << v);
        quant[2048 + s * 64 + LineByte(r, j)] = bits;
      }
    }
  }
}

void RepackQ6_K(const uint8_t* src, int r, int64_t cols, uint8_t* g) {
  const int64_t nb = cols / kQK_K;
  const auto* b = reinterpret_cast<const BlockQ6_K*>(src);
  int levels[kQK_K];
  for (int64_t ib = 0; ib < nb; ++ib) {
    uint8_t* quant = g + ib * 3072;
    uint8_t* meta = g + nb * 3072 + ib * 288;
    reinterpret_cast<uint16_t*>(meta)[r] = b[ib].d;
    for (int s = 0; s < 16; ++s) {
      meta[kMetaSc6 + (s / 2) * 32 + 2 * r + s % 2] = static_cast<uint8_t>(b[ib].scales[s]);
    }
    UnpackLevelsQ6_K(b[ib], levels);
    for (int k = 0; k < 4; ++k) {
      for (int j = 0; j < 4; ++j) {
        for (int P = 0; P < 8; ++P) {
          const int lo = levels[16 * (2 * P) + 4 * k + j] & 15;
          const int hi = levels[16 * (2 * P + 1) + 4 * k + j] & 15;
          quant[P * 256 + k * 64 + LineByte(r, j)] = static_cast<uint8_t>(lo | hi << 4);
        }
        for (int Q = 0; Q < 4; ++Q) {
          uint8_t bits = 0;
          for (int u = 0; u < 4; ++u) {
            bits |= static_cast<uint8_t>((levels[16 * (4 * Q + u) + 4 * k + j] >> 4) << (2 * u));
          }
          quant[2048 + Q * 256 + k * 64 + LineByte(r, j)] = bits;
        }
      }
    }
  }
}

using RepackRowFn = void (*)(const uint8_t* src, int r, int64_t cols, uint8_t* group);

// --- Dequantising row r of a group (the expressions of core/quants.cc) -------

void DequantF32(const uint8_t* g, int r, int64_t cols, float* out) {
  std::memcpy(out, g + static_cast<size_t>(r) * cols * 4, cols * 4);
}
void DequantF16(const uint8_t* g, int r, int64_t cols, float* out) {
  const auto* h = reinterpret_cast<const uint16_t*>(g);
  for (int64_t i = 0; i < cols; ++i) out[i] = HalfToFloat(h[i * 16 + r]);
}
void DequantBf16(const uint8_t* g, int r, int64_t cols, float* out) {
  const auto* h = reinterpret_cast<const uint16_t*>(g);
  for (int64_t i = 0; i < cols; ++i) out[i] = Bf16ToFloat(h[i * 16 + r]);
}
void DequantQ8_0(const uint8_t* g, int r, int64_t cols, float* out) {
  const int64_t nb = cols / kQK;
  const auto* dh = reinterpret_cast<const uint16_t*>(g + nb * 512);
  for (int64_t ib = 0; ib < nb; ++ib, out += kQK) {
    const float d = HalfToFloat(dh[ib * 16 + r]);
    for (int e = 0; e < kQK; ++e) {
      const int8_t q = static_cast<int8_t>(g[ib * 512 + (e / 4) * 64 + LineByte(r, e % 4)] ^ 0x80);
      out[e] = d * q;
    }
  }
}
void DequantQ4_0(const uint8_t* g, int r, int64_t cols, float* out) {
  const int64_t nb = cols / kQK;
  const auto* dh = reinterpret_cast<const uint16_t*>(g + nb * 256);
  for (int64_t ib = 0; ib < nb; ++ib, out += kQK) {
    const float d = HalfToFloat(dh[ib * 16 + r]);
    for (int i = 0; i < 16; ++i) {
      const uint8_t q = g[ib * 256 + NibbleLine(i) * 64 + LineByte(r, i % 4)];
      out[i] = d * ((q & 15) - 8);
      out[i + 16] = d * ((q >> 4) - 8);
    }
  }
}
// Q4_K and Q5_K: x = (d sc) level - (dmin m), as DequantizeRowQ4_K computes it.
void DequantK4(const uint8_t* g, int r, int64_t cols, float* out, bool five) {
  const int64_t nb = cols / kQK_K;
  const int qb = five ? 2560 : 2048;
  for (int64_t ib = 0; ib < nb; ++ib) {
    const uint8_t* quant = g + ib * qb;
    const uint8_t* meta = g + nb * qb + ib * 320;
    const float d = HalfToFloat(reinterpret_cast<const uint16_t*>(meta + kMetaD)[r]);
    const float dmin = HalfToFloat(reinterpret_cast<const uint16_t*>(meta + kMetaDmin)[r]);
    for (int s = 0; s < 8; ++s) {
      const uint8_t sc = meta[kMetaSc + s * 16 + r];
      const uint8_t m = meta[kMetaM + (s / 2) * 32 + 2 * r + s % 2];
      const float ds = d * sc, ms = dmin * m;
      for (int w = 0; w < 32; ++w) {
        const uint8_t byte = quant[s * 256 + NibbleLine(w) * 64 + LineByte(r, w % 4)];
        int level = w < 16 ? byte & 15 : byte >> 4;
        if (five) level |= ((quant[2048 + s * 64 + LineByte(r, w % 4)] >> (w / 4)) & 1) << 4;
        out[32 * s + w] = ds * level - ms;
      }
    }
    out += kQK_K;
  }
}
void DequantQ4_K(const uint8_t* g, int r, int64_t cols, float* out) {
  DequantK4(g, r, cols, out, false);
}
void DequantQ5_K(const uint8_t* g, int r, int64_t cols, float* out) {
  DequantK4(g, r, cols, out, true);
}
void DequantQ6_K(const uint8_t* g, int r, int64_t cols, float* out) {
  const int64_t nb = cols / kQK_K;
  for (int64_t ib = 0; ib < nb; ++ib) {
    const uint8_t* quant = g + ib * 3072;
    const uint8_t* meta = g + nb * 3072 + ib * 288;
    const float d = HalfToFloat(reinterpret_cast<const uint16_t*>(meta)[r]);
    for (int e = 0; e < kQK_K; ++e) {
      const int s = e / 16, k = (e % 16) / 4, j = e % 4;
      const uint8_t lo = quant[(s / 2) * 256 + k * 64 + LineByte(r, j)];
      const uint8_t hi = quant[2048 + (s / 4) * 256 + k * 64 + LineByte(r, j)];
      const int q = ((s % 2 ? lo >> 4 : lo) & 15) | ((hi >> (2 * (s % 4))) & 3) << 4;
      const int8_t sc = static_cast<int8_t>(meta[kMetaSc6 + (s / 2) * 32 + 2 * r + s % 2]);
      out[e] = d * sc * (q - 32);
    }
    out += kQK_K;
  }
}

using DequantRowFn = void (*)(const uint8_t* group, int r, int64_t cols, float* out);

struct MatType {
  DType type;
  const GroupLayout* layout;
  ActFormat act;  // the form the sets read (but see ActFormatFor)
  RepackRowFn repack;
  DequantRowFn dequant;
};

// The one table of the types with kernels.
constexpr MatType kMatTypes[] = {
    {DType::kF32, &kF32Layout, ActFormat::kF32, RepackF32, DequantF32},
    {DType::kF16, &kHalfLayout, ActFormat::kF32, RepackHalf, DequantF16},
    {DType::kBF16, &kHalfLayout, ActFormat::kF32, RepackHalf, DequantBf16},
    {DType::kQ8_0, &kQ8_0Layout, ActFormat::kQ8x32, RepackQ8_0, DequantQ8_0},
    {DType::kQ4_0, &kQ4_0Layout, ActFormat::kQ8x32, RepackQ4_0, DequantQ4_0},
    {DType::kQ4_K, &kQ4_KLayout, ActFormat::kQ8x256, RepackQ4_K, DequantQ4_K},
    {DType::kQ5_K, &kQ5_KLayout, ActFormat::kQ8x256, RepackQ5_K, DequantQ5_K},
    {DType::kQ6_K, &kQ6_KLayout, ActFormat::kQ8x256, RepackQ6_K, DequantQ6_K},
};

const MatType* FindMatType(DType type) {
  for (const MatType& t : kMatTypes) {
    if (t.type == type) return &t;
  }
  return nullptr;
}

const MatType& MatTypeOf(DType type) {
  const MatType* t = FindMatType(type);
  ELLM_CHECK(t != nullptr, absl::StrCat("no CPU matrix kernels for type ", static_cast<unsigned>(type)));
  return *t;
}

}  // namespace

const GroupLayout* FindGroupLayout(DType type) {
  const MatType* t = FindMatType(type);
  return t != nullptr ? t->layout : nullptr;
}

}  // namespace internal

using internal::kGroupRows;

// --- AlignedBytes -------------------------------------------------------------

void AlignedBytes::Resize(size_t n) {
  if (n > capacity_) {
    const size_t bytes = std::max<size_t>(64, (n + 63) / 64 * 64);
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(64, bytes));
    ELLM_CHECK(p != nullptr, absl::StrCat("out of memory allocating ", bytes, " bytes"));
    std::memset(p, 0, bytes);
    data_.reset(p);
    capacity_ = bytes;
  }
  size_ = n;
}

// --- QuantMatrix --------------------------------------------------------------

absl::StatusOr<QuantMatrix> QuantMatrix::FromRaw(DType type, int64_t rows, int64_t cols,
                                                 const uint8_t* data, size_t bytes,
                                                 ThreadPool* pool) {
  const internal::MatType* mt = internal::FindMatType(type);
  const DTypeTraits& traits = Traits(type);
  if (mt == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("no CPU matrix kernels for type ",
                     ToAbsl(traits.name)));
  }
  if (rows <= 0 || cols <= 0 || cols % mt->layout->block != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("matrix [", rows, ", ", cols, "] is not a whole number of ",
                     ToAbsl(traits.name), " blocks per row"));
  }
  ASSIGN_OR_RETURN(const uint64_t row_bytes, DTypeBytes(type, static_cast<uint64_t>(cols)));
  if (row_bytes * static_cast<uint64_t>(rows) != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("matrix [", rows, ", ", cols, "] of ",
                     ToAbsl(traits.name), " needs ",
                     row_bytes * rows, " bytes, got ", bytes));
  }
  QuantMatrix m;
  m.type_ = type;
  m.rows_ = rows;
  m.cols_ = cols;
  m.group_bytes_ = internal::GroupBytes(*mt->layout, cols);
  m.data_.Resize(m.group_bytes_ * static_cast<size_t>(m.groups()));
  // Each group's bytes are written by one task.
  auto repack = [&](int64_t g_begin, int64_t g_end, int) {
    for (int64_t row = g_begin * kGroupRows; row < std::min(rows, g_end * kGroupRows); ++row) {
      mt->repack(data + row * row_bytes, static_cast<int>(row % kGroupRows), cols,
                 m.data_.data() + (row / kGroupRows) * m.group_bytes_);
    }
  };
  if (pool != nullptr && pool->size() > 1 && bytes > (256 << 10)) {
    pool->ParallelFor(m.groups(), repack);
  } else {
    repack(0, m.groups(), 0);
  }
  return m;
}

QuantMatrix QuantMatrix::FromF32(const float* w, int64_t rows, int64_t cols) {
  absl::StatusOr<QuantMatrix> m =
      FromRaw(DType::kF32, rows, cols, reinterpret_cast<const uint8_t*>(w),
              static_cast<size_t>(rows * cols) * sizeof(float));
  ELLM_CHECK(m.ok(), m.status().ToString());
  return *std::move(m);
}

ActFormat ActFormatFor(DType type, Isa isa, int q8_act_bits) {
  if (type == DType::kQ8_0 && isa == Isa::kAvx2 && q8_act_bits == 7) return ActFormat::kQ7x32;
  return internal::MatTypeOf(type).act;
}

void QuantMatrix::DequantizeRow(int64_t r, float* out) const {
  internal::MatTypeOf(type_).dequant(group(r / kGroupRows), static_cast<int>(r % kGroupRows), cols_,
                                     out);
}

// --- Activations --------------------------------------------------------------

void QuantizeActivationRow(const float* x, int64_t cols, int block, int max_code, int8_t* codes,
                           float* d) {
  static const bool avx2 = CpuHas(Isa::kAvx2);
  if (avx2) return internal::QuantizeActivationRowAvx2(x, cols, block, max_code, codes, d);
  QuantizeActivationRowScalar(x, cols, block, max_code, codes, d);
}

void QuantizeActivationRowScalar(const float* x, int64_t cols, int block, int max_code,
                                 int8_t* codes, float* d) {
  const float m = static_cast<float>(max_code);
  for (int64_t b = 0; b < cols / block; ++b) {
    const float* xb = x + b * block;
    int8_t* qb = codes + b * block;
    float amax = 0;
    for (int i = 0; i < block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    if (!(amax > 0) || !std::isfinite(amax)) {
      d[b] = 0;
      std::memset(qb, 0, block);
      continue;
    }
    d[b] = amax / m;
    const float id = m / amax;
    for (int i = 0; i < block; ++i) {
      float v = std::nearbyint(xb[i] * id);
      v = v > m ? m : v < -m ? -m : v;
      qb[i] = static_cast<int8_t>(v == v ? v : 0);
    }
  }
}

void Activations::Set(const float* x, int T, int64_t cols) {
  x_ = x;
  T_ = T;
  cols_ = cols;
  for (bool& h : have_) h = false;
  have_bf16_ = false;
}

const uint16_t* Activations::bf16(ThreadPool* pool) {
  ELLM_CHECK(CpuHas(Isa::kAmx), "Activations::bf16: needs a CPU that runs the amx set");
  if (!have_bf16_) {
    ELLM_CHECK(cols_ % 32 == 0, "Activations::bf16: cols must be a multiple of 32");
    const int64_t nb = cols_ / 32, tiles = (T_ + 15) / 16;
    bf16_.Resize(static_cast<size_t>(tiles) * nb * 1024);
    auto* out = reinterpret_cast<uint16_t*>(bf16_.data());
    const auto rows = [&](int64_t begin, int64_t end, int) {
      for (int64_t t = begin; t < end; ++t) {
        internal::ToBf16TileRowAvx512(x_ + t * cols_, nb, out + (t / 16) * nb * 512 + (t % 16) * 32);
      }
    };
    if (pool != nullptr && pool->size() > 1 && T_ >= 8) {
      pool->ParallelFor(T_, rows);
    } else {
      rows(0, T_, 0);
    }
    have_bf16_ = true;
  }
  return reinterpret_cast<const uint16_t*>(bf16_.data());
}

namespace {

void PrepareQ8(const float* x, int T, int64_t cols, int block, int max_code, Activations::Q8* q,
               ThreadPool* pool) {
  q->block = block;
  q->token_stride = (cols + 63) / 64 * 64;
  q->qs.Resize(static_cast<size_t>(T) * q->token_stride);
  const int64_t nb = cols / block;
  q->d.resize(static_cast<size_t>(T) * nb);
  if (block == 32) {
    q->sum.resize(static_cast<size_t>(T) * nb);
  } else {
    q->sum16.resize(static_cast<size_t>(T) * cols / 16);
    q->sum32.resize(static_cast<size_t>(T) * cols / 32);
  }
  // Each token's row on its own: split over the pool for a prefill chunk (a
  // serial pass cost ~1/4 of the step's matrix time on 2 threads at T = 256).
  auto rows = [&](int64_t t_begin, int64_t t_end, int) {
  for (int64_t t = t_begin; t < t_end; ++t) {
    int8_t* codes = reinterpret_cast<int8_t*>(q->qs.data() + t * q->token_stride);
    QuantizeActivationRow(x + t * cols, cols, block, max_code, codes, q->d.data() + t * nb);
    if (block == 32) {
      for (int64_t b = 0; b < nb; ++b) {
        int32_t s = 0;
        for (int i = 0; i < 32; ++i) s += codes[32 * b + i];
        q->sum[t * nb + b] = s;
      }
    } else {
      for (int64_t b = 0; b < cols / 16; ++b) {
        int32_t s = 0;
        for (int i = 0; i < 16; ++i) s += codes[16 * b + i];
        q->sum16[t * (cols / 16) + b] = static_cast<int16_t>(s);
      }
      for (int64_t b = 0; b < cols / 32; ++b) {
        q->sum32[t * (cols / 32) + b] = static_cast<int16_t>(q->sum16[t * (cols / 16) + 2 * b] +
                                                             q->sum16[t * (cols / 16) + 2 * b + 1]);
      }
    }
  }
  };
  if (pool != nullptr && pool->size() > 1 && T >= 8) {
    pool->ParallelFor(T, rows);
  } else {
    rows(0, T, 0);
  }
}

}  // namespace

const Activations::Q8& Activations::q8(ActFormat f, ThreadPool* pool) {
  ELLM_CHECK(f != ActFormat::kF32, "Activations::q8: kF32 is not an int8 form");
  const int i = static_cast<int>(f);
  if (!have_[i]) {
    PrepareQ8(x_, T_, cols_, f == ActFormat::kQ8x256 ? 256 : 32, f == ActFormat::kQ7x32 ? 63 : 127,
              &forms_[i], pool);
    have_[i] = true;
  }
  return forms_[i];
}

// --- Dispatch -------------------------------------------------------------------

namespace {

internal::MatKernel KernelFor(DType type, Isa isa, ActFormat act) {
  if (act == ActFormat::kQ7x32) return internal::Avx2Q8_0Act7Kernel();
  switch (isa) {
    case Isa::kReference: return internal::RefKernel(type);
    case Isa::kAvx2: return internal::Avx2Kernel(type);
    case Isa::kAvx2Vnni: return internal::Avx2VnniKernel(type);
    case Isa::kAvx512: return internal::Avx512VnniKernel(type);
    case Isa::kAmx: return internal::AmxKernel(type);
    case Isa::kAuto: return nullptr;  // a choice, not a set
  }
  return nullptr;
}

std::string_view ActFormatName(ActFormat f) {
  switch (f) {
    case ActFormat::kF32: return "f32";
    case ActFormat::kQ8x32: return "q8x32";
    case ActFormat::kQ7x32: return "q7x32";
    case ActFormat::kQ8x256: return "q8x256";
  }
  return "?";
}


}  // namespace

bool MatIsaSupported(Isa isa) {
  switch (isa) {
    case Isa::kReference:
    case Isa::kAvx2:
    case Isa::kAvx2Vnni:
    case Isa::kAvx512:
    case Isa::kAmx: return CpuHas(isa);
    case Isa::kAuto: return false;
  }
  return false;
}

Isa BestMatIsa() {
  static const Isa best = [] {
    // Not amx: its prefill rounds differently from its decode (matmul.h).
    for (Isa isa : {Isa::kAvx512, Isa::kAvx2Vnni, Isa::kAvx2}) {
      if (CpuHas(isa)) return isa;
    }
    return Isa::kReference;
  }();
  return best;
}

absl::StatusOr<Isa> ParseMatIsa(std::string_view name) {
  ASSIGN_OR_RETURN(Isa isa, ParseIsa(name));
  if (isa == Isa::kAuto) return BestMatIsa();
  return isa;
}

std::string KernelName(DType type, Isa isa, int q8_act_bits) {
  const internal::MatType* mt = internal::FindMatType(type);
  if (mt == nullptr) return "none";
  const std::string_view tname = Traits(type).name;
  if (type == DType::kF32) return absl::StrCat(ToAbsl(IsaName(isa)), "/f32-exact");
  if (isa == Isa::kAmx && internal::AmxTileType(type)) {  // 16 tokens or more
    return absl::StrCat("amx/", ToAbsl(tname), "*bf16");
  }
  return absl::StrCat(ToAbsl(IsaName(isa)), "/", ToAbsl(tname), "*",
                      ToAbsl(ActFormatName(ActFormatFor(type, isa, q8_act_bits))));
}

void MatMul(const QuantMatrix& w, Activations& x, float* y, ThreadPool* pool, Isa isa,
            int q8_act_bits) {
  const ActFormat act = ActFormatFor(w.type(), isa, q8_act_bits);
  const internal::MatKernel kernel = KernelFor(w.type(), isa, act);
  ELLM_CHECK(kernel != nullptr && MatIsaSupported(isa) && x.cols() == w.cols() && x.tokens() >= 0 &&
                 (q8_act_bits == 8 || q8_act_bits == 7),
             absl::StrCat("MatMul: bad call (type ", static_cast<unsigned>(w.type()), ", isa ",
                          static_cast<int>(isa), ", q8_act_bits ", q8_act_bits, ", x cols ", x.cols(),
                          ", w cols ", w.cols(), ")"));
  if (x.tokens() == 0 || w.empty()) return;
  internal::KernelArgs args;
  args.w = &w;
  args.x = x.f32();
  args.T = x.tokens();
  args.y = y;
  args.ldy = w.rows();
  if (isa == Isa::kAmx && internal::AmxTileType(w.type()) && args.T >= internal::kAmxMinTokens) {
    args.bf16 = x.bf16(pool);  // the tile kernel; fewer tokens run avx512's on int8 codes
  } else if (act != ActFormat::kF32) {
    args.q8 = &x.q8(act, pool);
  }
  const int64_t groups = w.groups();
  // Waking the workers costs some microseconds: small products stay on the
  // calling thread.
  const double work = static_cast<double>(w.bytes()) * (1 + 0.25 * (args.T - 1));
  if (pool == nullptr || pool->size() == 1 || groups == 1 || work < 256 * 1024) {
    kernel(args, 0, groups);
    return;
  }
  // Chunks of groups as ParallelItems: each thread runs its own range of
  // chunks, then takes the others' last chunks, so a thread the machine slows
  // (another process's turn on its core, a shared VM) no longer holds the
  // product up by its whole share. Each group is still one kernel call's, so
  // results do not change.
  constexpr int kChunksPerThread = 8;
  const int64_t chunk = std::max<int64_t>(1, groups / (pool->size() * kChunksPerThread));
  ParallelItems(pool, (groups + chunk - 1) / chunk, false, [&](int64_t i, int) {
    kernel(args, i * chunk, std::min(groups, (i + 1) * chunk));
  });
}

}  // namespace ellm::mlp
