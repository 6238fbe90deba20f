// What the CUDA handler files share (cuda/handlers.cu, cuda/ms_eden.cu): alignment and
// pointer helpers, and the errors of the CUDA runtime and of too large launches, returned
// as ffi::Error.
#ifndef NVFP4_CUDA_HANDLER_UTIL_CUH_
#define NVFP4_CUDA_HANDLER_UTIL_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/kernels.cuh"
#include "xla/ffi/api/ffi.h"

namespace nvfp4::cuda {

namespace ffi = xla::ffi;

// Grids come from nvfp4/launch.h (GridFor, StridedGridFor), checked on the host by
// tests/cuda_launch_check.cc: every launch passes a grid in [1, 2^31 - 1].

inline bool Aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline float* F32Data(const ffi::AnyBuffer& b) { return static_cast<float*>(b.untyped_data()); }

// The runtime's last error is per host thread and sticky across calls until read: read it
// (and so clear it) when a handler starts, so that a failure of some earlier call on this
// thread is not reported as this target's.
inline void ClearStaleError() { cudaGetLastError(); }

inline ffi::Error CudaError(const char* target, const char* what, cudaError_t e) {
  cudaGetLastError();  // the failed call also set the last error: leave none behind
  return ffi::Error::Internal(std::string(target) + ": " + what + " failed: " +
                              cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

// After the last launch of a handler: any launch that failed (bad configuration, no kernel
// image, too many resources) set the last error. Kernel faults surface later, on the
// stream, where XLA reports them.
inline ffi::Error LaunchError(const char* target) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return ffi::Error::Success();
  return CudaError(target, "CUDA kernel launch", e);
}

// One launch covers at most 2^31 - 1 thread blocks of kThreads threads, about 5.5e11
// 16-blocks: far beyond any GPU's memory, but a dim3 would silently truncate the count.
inline ffi::Error TooLarge(const char* target, int64_t threads) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + std::to_string(threads) +
                                     " threads exceed one launch's grid (2^31 - 1 blocks of " +
                                     std::to_string(kThreads) + ")");
}

}  // namespace nvfp4::cuda

#endif  // NVFP4_CUDA_HANDLER_UTIL_CUH_
