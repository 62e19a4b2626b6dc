#include "mlp-worker/cuda/cuda_util.h"


#include "absl/strings/str_format.h"

namespace ellm::mlp::cuda {
namespace {

// "cudaMalloc(&p, n)" -> "cudaMalloc"; file paths -> their last component.
std::string CallName(const char* expr) {
  const char* paren = std::strchr(expr, '(');
  return paren != nullptr ? std::string(expr, paren - expr) : std::string(expr);
}
const char* BaseName(const char* file) {
  const char* slash = std::strrchr(file, '/');
  return slash != nullptr ? slash + 1 : file;
}

}  // namespace

absl::Status ErrorStatus(cudaError_t error, const char* expr, const char* file, int line) {
  // Clears the thread's last error when it is not sticky (a sticky one stays
  // and keeps failing every later call, as it should).
  cudaGetLastError();
  const std::string message =
      absl::StrFormat("%s failed at %s:%d: %s: %s", CallName(expr), BaseName(file), line,
                      cudaGetErrorName(error), cudaGetErrorString(error));
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInvalidDevice:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorSystemDriverMismatch:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status ErrorStatus(cublasStatus_t error, const char* expr, const char* file, int line) {
  const std::string message =
      absl::StrFormat("%s failed at %s:%d: %s: %s", CallName(expr), BaseName(file), line,
                      cublasGetStatusName(error), cublasGetStatusString(error));
  switch (error) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(message);
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<StreamOwner> MakeStream() {
  cudaStream_t s = nullptr;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return StreamOwner(s);
}

absl::StatusOr<EventOwner> MakeEvent(bool timing) {
  cudaEvent_t e = nullptr;
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  return EventOwner(e);
}

absl::StatusOr<std::unique_ptr<HostRegistration>> HostRegistration::Create(void* base,
                                                                           size_t bytes) {
  if (base == nullptr || bytes == 0) {
    return absl::InvalidArgumentError("cannot register an empty host range");
  }
  CUDA_RETURN_IF_ERROR(
      cudaHostRegister(base, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
  void* device = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&device, base, 0);
  if (e != cudaSuccess) {
    absl::Status st = ErrorStatus(e, "cudaHostGetDevicePointer", __FILE__, __LINE__);
    cudaHostUnregister(base);
    return st;
  }
  return std::unique_ptr<HostRegistration>(new HostRegistration(base, bytes, device));
}

HostRegistration::~HostRegistration() {
  if (cudaHostUnregister(host_) != cudaSuccess) cudaGetLastError();
}

void* HostRegistration::DevicePointer(const void* p) const {
  const auto* h = static_cast<const char*>(host_);
  const auto* q = static_cast<const char*>(p);
  if (q < h || q >= h + bytes_) return nullptr;
  return static_cast<char*>(device_) + (q - h);
}

absl::Status GemmBf16(cublasHandle_t handle, const bf16_t* w, int n_out, int k, const bf16_t* x,
                      int n_tokens, float* y, float beta) {
  if (n_tokens <= 0 || n_out <= 0) return absl::OkStatus();
  // cuBLAS is column-major: row-major Y [T, n_out] is Y' [n_out, T] (ld n_out),
  // W [n_out, k] is W' [k, n_out] (ld k) and X [T, k] is X' [k, T] (ld k), so
  // Y' = W'^T X' + beta Y'.
  const float alpha = 1.0f;
  CUDA_RETURN_IF_ERROR(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n_out, n_tokens, k, &alpha,
                                    w, CUDA_R_16BF, k, x, CUDA_R_16BF, k, &beta, y, CUDA_R_32F,
                                    n_out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

}  // namespace ellm::mlp::cuda
