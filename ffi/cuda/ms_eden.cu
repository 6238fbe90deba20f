// XLA FFI handlers of MS-EDEN on CUDA (docs/NUMERICS.md section 14): the checks of
// nvfp4/checks.h, the kernels of cuda/ms_eden.cuh launched on XLA's stream. The bindings are
// nvfp4/bindings.h's, shared with the CPU handlers (cpu/ms_eden.cc).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/handler_util.cuh"
#include "cuda/kernels.cuh"
#include "cuda/ms_eden.cuh"
#include "nvfp4/bindings.h"
#include "nvfp4/checks.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4::cuda {
namespace {

// MS-EDEN (docs/NUMERICS.md section 14): one thread per 128-element group.
ffi::Error MsEdenAmaxImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer rotation,
                          ffi::Result<ffi::AnyBuffer> out) {
  auto args = CheckMsEdenAmaxArgs(x, rotation, *out);
  if (args.has_error()) return args.error();
  ClearStaleError();
  auto* bits = static_cast<uint32_t*>(out->untyped_data());
  const int64_t groups = args->layout.size() / kMsEdenGroup;
  const cudaError_t e = cudaMemsetAsync(bits, 0, sizeof(uint32_t), stream);
  if (e != cudaSuccess) return CudaError("nvfp4_amax_ms_eden", "cudaMemsetAsync", e);
  if (groups > 0) {
    VisitFloatType(args->x, [&](auto t) {
      MsEdenAmaxKernel<decltype(t)><<<StridedGridFor(groups), kThreads, 0, stream>>>(
          x.untyped_data(), groups, static_cast<const uint32_t*>(rotation.untyped_data()), bits);
    });
  }
  AmaxFinalizeKernel<<<1, 1, 0, stream>>>(bits);
  return LaunchError("nvfp4_amax_ms_eden");
}

MsEdenArgs MakeMsEdenArgs(const ffi::AnyBuffer& x, const RowLayout& layout,
                          const ffi::AnyBuffer& amax, const ffi::AnyBuffer& key,
                          const ffi::AnyBuffer& rotation, const ffi::AnyBuffer& stored_amax) {
  MsEdenArgs a{};
  a.x = x.untyped_data();
  a.groups = layout.size() / kMsEdenGroup;
  a.amax = F32Data(amax);
  a.key = static_cast<const uint32_t*>(key.untyped_data());
  a.rotation = static_cast<const uint32_t*>(rotation.untyped_data());
  a.nonfinite = static_cast<uint32_t*>(stored_amax.untyped_data());
  return a;
}

ffi::Error MsEdenQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer amax,
                              ffi::AnyBuffer key, ffi::AnyBuffer rotation,
                              ffi::Result<ffi::AnyBuffer> codes,
                              ffi::Result<ffi::AnyBuffer> scales,
                              ffi::Result<ffi::AnyBuffer> stored_amax) {
  const char* target = "nvfp4_quantize_ms_eden";
  auto args = CheckMsEdenQuantizeArgs(x, amax, key, rotation, *codes, *scales, *stored_amax);
  if (args.has_error()) return args.error();
  MsEdenArgs a = MakeMsEdenArgs(x, args->layout, amax, key, rotation, *stored_amax);
  const int64_t grid = GridFor(a.groups);
  if (grid == 0) return TooLarge(target, a.groups);
  ClearStaleError();
  a.codes = static_cast<uint8_t*>(codes->untyped_data());
  a.scales = static_cast<uint8_t*>(scales->untyped_data());
  float* stored = F32Data(*stored_amax);
  StoredAmaxKernel<<<1, 1, 0, stream>>>(a.amax, stored);
  if (a.groups > 0) {
    VisitFloatType(args->x, [&](auto t) {
      MsEdenQuantizeKernel<decltype(t), F32, false><<<grid, kThreads, 0, stream>>>(a);
    });
    const int64_t blocks = args->layout.size() / kBlock;
    NonFiniteCodesKernel<<<StridedGridFor(blocks), kThreads, 0, stream>>>(stored, blocks,
                                                                          a.codes, a.scales);
  }
  return LaunchError(target);
}

ffi::Error MsEdenFakeQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer amax,
                                  ffi::AnyBuffer key, ffi::AnyBuffer rotation,
                                  ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> stored_amax, bool global_scale) {
  const char* target = "nvfp4_fake_quantize_ms_eden";
  auto args = CheckMsEdenFakeQuantizeArgs(x, amax, key, rotation, *out, *stored_amax);
  if (args.has_error()) return args.error();
  MsEdenArgs a = MakeMsEdenArgs(x, args->layout, amax, key, rotation, *stored_amax);
  const int64_t grid = GridFor(a.groups);
  if (grid == 0) return TooLarge(target, a.groups);
  ClearStaleError();
  a.values = out->untyped_data();
  a.use_global = global_scale;
  float* stored = F32Data(*stored_amax);
  StoredAmaxKernel<<<1, 1, 0, stream>>>(a.amax, stored);
  const int64_t size = args->layout.size();
  if (size > 0) {
    VisitFloatType(args->x, [&](auto t) {
      VisitFloatType(args->result, [&](auto u) {
        using U = decltype(u);
        MsEdenQuantizeKernel<decltype(t), U, true><<<grid, kThreads, 0, stream>>>(a);
        FillNanKernel<U><<<StridedGridFor(size), kThreads, 0, stream>>>(
            stored, size, static_cast<typename U::Storage*>(a.values));
      });
    });
  }
  return LaunchError(target);
}

}  // namespace
}  // namespace nvfp4::cuda

namespace ffi = xla::ffi;

// The context of every CUDA handler: XLA's stream, on which the kernels launch.
using CudaStream = ffi::PlatformStream<cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4AmaxMsEdenCuda, nvfp4::cuda::MsEdenAmaxImpl,
                              nvfp4::bindings::MsEdenAmax<CudaStream>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4QuantizeMsEdenCuda, nvfp4::cuda::MsEdenQuantizeImpl,
                              nvfp4::bindings::MsEdenQuantize<CudaStream>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4FakeQuantizeMsEdenCuda, nvfp4::cuda::MsEdenFakeQuantizeImpl,
                              nvfp4::bindings::MsEdenFakeQuantize<CudaStream>());
