// CUDA and cuBLAS plumbing for the GPU backend: one error macro that turns a
// failed call into an absl::Status naming the call, RAII owners for device
// memory, pinned host memory, streams, events, graphs and the cuBLAS handle,
// and the one matrix product the backend uses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "core/status.h"
#include "mlp-worker/cuda/kernels.h"

namespace ellm::mlp::cuda {

// Status for a failed CUDA runtime or cuBLAS call: "<call> failed at
// file:line: <name>: <description>". Out of memory is ResourceExhausted, a
// missing, busy or unusable device Unavailable, the rest Internal. A
// non-sticky CUDA error is cleared so that later launch checks do not see it.
absl::Status ErrorStatus(cudaError_t error, const char* expr, const char* file, int line);
absl::Status ErrorStatus(cublasStatus_t error, const char* expr, const char* file, int line);
inline bool Succeeded(cudaError_t e) { return e == cudaSuccess; }
inline bool Succeeded(cublasStatus_t e) { return e == CUBLAS_STATUS_SUCCESS; }

}  // namespace ellm::mlp::cuda

// Returns an absl::Status from the calling function when `expr` (a
// cudaError_t or cublasStatus_t) is not success.
#define CUDA_RETURN_IF_ERROR(expr)                                                    \
  do {                                                                                \
    const auto ellm_cuda_result_ = (expr);                                            \
    if (!::ellm::mlp::cuda::Succeeded(ellm_cuda_result_)) {                           \
      return ::ellm::mlp::cuda::ErrorStatus(ellm_cuda_result_, #expr, __FILE__, __LINE__); \
    }                                                                                 \
  } while (0)

namespace ellm::mlp::cuda {

// A typed device allocation (cudaMalloc); freed by the destructor.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  static absl::StatusOr<DeviceArray> Alloc(size_t count) {
    DeviceArray a;
    if (count == 0) return a;
    void* p = nullptr;
    CUDA_RETURN_IF_ERROR(cudaMalloc(&p, count * sizeof(T)));
    a.ptr_ = static_cast<T*>(p);
    a.count_ = count;
    return a;
  }
  ~DeviceArray() { Reset(); }
  DeviceArray(DeviceArray&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

 private:
  void Reset() {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    count_ = 0;
  }
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// A typed page-locked host allocation (cudaMallocHost).
template <typename T>
class PinnedArray {
 public:
  PinnedArray() = default;
  static absl::StatusOr<PinnedArray> Alloc(size_t count) {
    PinnedArray a;
    if (count == 0) return a;
    void* p = nullptr;
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&p, count * sizeof(T)));
    a.ptr_ = static_cast<T*>(p);
    a.count_ = count;
    return a;
  }
  ~PinnedArray() { Reset(); }
  PinnedArray(PinnedArray&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  PinnedArray& operator=(PinnedArray&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return count_; }

 private:
  void Reset() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    count_ = 0;
  }
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

struct StreamDeleter {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
struct EventDeleter {
  void operator()(cudaEvent_t e) const { cudaEventDestroy(e); }
};
struct GraphDeleter {
  void operator()(cudaGraph_t g) const { cudaGraphDestroy(g); }
};
struct GraphExecDeleter {
  void operator()(cudaGraphExec_t g) const { cudaGraphExecDestroy(g); }
};
struct CublasDeleter {
  void operator()(cublasHandle_t h) const { cublasDestroy(h); }
};
using StreamOwner = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, StreamDeleter>;
using EventOwner = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDeleter>;
using GraphOwner = std::unique_ptr<std::remove_pointer_t<cudaGraph_t>, GraphDeleter>;
using GraphExecOwner = std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, GraphExecDeleter>;
using CublasOwner = std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, CublasDeleter>;

absl::StatusOr<StreamOwner> MakeStream();  // non-blocking w.r.t. the legacy stream
absl::StatusOr<EventOwner> MakeEvent(bool timing = false);

// Host memory registered with the device (cudaHostRegister, mapped): the
// device may DMA to it and kernels may address it through device_ptr().
// Unregisters in the destructor.
class HostRegistration {
 public:
  static absl::StatusOr<std::unique_ptr<HostRegistration>> Create(void* base, size_t bytes);
  ~HostRegistration();
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

  void* host() const { return host_; }
  size_t bytes() const { return bytes_; }
  // The device address of host address p (inside the range), else nullptr.
  void* DevicePointer(const void* p) const;

 private:
  HostRegistration(void* host, size_t bytes, void* device)
      : host_(host), bytes_(bytes), device_(device) {}
  void* host_;
  size_t bytes_;
  void* device_;
};

// y [n_tokens, n_out] = x [n_tokens, k] · W^T + beta * y, with W [n_out, k]
// row-major: bf16 inputs, fp32 output, fp32 accumulation (cublasGemmEx,
// CUBLAS_COMPUTE_32F). beta = 1 adds the product to y (the residuals).
absl::Status GemmBf16(cublasHandle_t handle, const bf16_t* w, int n_out, int k, const bf16_t* x,
                      int n_tokens, float* y, float beta);

}  // namespace ellm::mlp::cuda
