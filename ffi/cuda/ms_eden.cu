// XLA FFI handlers of MS-EDEN on CUDA (docs/NUMERICS.md section 14): the checks of
// nvfp4/checks.h, the kernels of cuda/ms_eden.cuh launched on XLA's stream. The bindings, the
// decoding and the checks are nvfp4/handlers.h's (MsEdenHandlers), shared with the CPU
// handlers (cpu/ms_eden.cc).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/handler_util.cuh"
#include "cuda/kernels.cuh"
#include "cuda/ms_eden.cuh"
#include "nvfp4/bindings.h"
#include "nvfp4/checks.h"
#include "nvfp4/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4::cuda {
namespace {

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

// The CUDA platform of nvfp4/handlers.h's MsEdenHandlers (docs/NUMERICS.md section 14): one
// thread per 128-element group.
struct CudaMsEden {
  using Context = cudaStream_t;
  using Binding = ffi::PlatformStream<cudaStream_t>;

  static ffi::Error Amax(cudaStream_t stream, const CheckedArgs& args, ffi::AnyBuffer x,
                         ffi::AnyBuffer rotation, ffi::AnyBuffer out) {
    ClearStaleError();
    auto* bits = static_cast<uint32_t*>(out.untyped_data());
    const int64_t groups = args.layout.size() / kMsEdenGroup;
    const cudaError_t e = cudaMemsetAsync(bits, 0, sizeof(uint32_t), stream);
    if (e != cudaSuccess) return CudaError("nvfp4_amax_ms_eden", "cudaMemsetAsync", e);
    if (groups > 0) {
      VisitFloatType(args.x, [&](auto t) {
        MsEdenAmaxKernel<decltype(t)><<<StridedGridFor(groups), kThreads, 0, stream>>>(
            x.untyped_data(), groups, static_cast<const uint32_t*>(rotation.untyped_data()), bits);
      });
    }
    AmaxFinalizeKernel<<<1, 1, 0, stream>>>(bits);
    return LaunchError("nvfp4_amax_ms_eden");
  }

  static ffi::Error Quantize(cudaStream_t stream, const CheckedArgs& args, ffi::AnyBuffer x,
                             ffi::AnyBuffer amax, ffi::AnyBuffer key, ffi::AnyBuffer rotation,
                             ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                             ffi::AnyBuffer stored_amax) {
    const char* target = "nvfp4_quantize_ms_eden";
    MsEdenArgs a = MakeMsEdenArgs(x, args.layout, amax, key, rotation, stored_amax);
    const int64_t grid = GridFor(a.groups);
    if (grid == 0) return TooLarge(target, a.groups);
    ClearStaleError();
    a.codes = static_cast<uint8_t*>(codes.untyped_data());
    a.scales = static_cast<uint8_t*>(scales.untyped_data());
    float* stored = F32Data(stored_amax);
    StoredAmaxKernel<<<1, 1, 0, stream>>>(a.amax, stored);
    if (a.groups > 0) {
      VisitFloatType(args.x, [&](auto t) {
        MsEdenQuantizeKernel<decltype(t), F32, false><<<grid, kThreads, 0, stream>>>(a);
      });
      const int64_t blocks = args.layout.size() / kBlock;
      NonFiniteCodesKernel<<<StridedGridFor(blocks), kThreads, 0, stream>>>(stored, blocks,
                                                                            a.codes, a.scales);
    }
    return LaunchError(target);
  }

  static ffi::Error FakeQuantize(cudaStream_t stream, const CheckedArgs& args, ffi::AnyBuffer x,
                                 ffi::AnyBuffer amax, ffi::AnyBuffer key, ffi::AnyBuffer rotation,
                                 ffi::AnyBuffer out, ffi::AnyBuffer stored_amax,
                                 bool global_scale) {
    const char* target = "nvfp4_fake_quantize_ms_eden";
    MsEdenArgs a = MakeMsEdenArgs(x, args.layout, amax, key, rotation, stored_amax);
    const int64_t grid = GridFor(a.groups);
    if (grid == 0) return TooLarge(target, a.groups);
    ClearStaleError();
    a.values = out.untyped_data();
    a.use_global = global_scale;
    float* stored = F32Data(stored_amax);
    StoredAmaxKernel<<<1, 1, 0, stream>>>(a.amax, stored);
    const int64_t size = args.layout.size();
    if (size > 0) {
      VisitFloatType(args.x, [&](auto t) {
        VisitFloatType(args.result, [&](auto u) {
          using U = decltype(u);
          MsEdenQuantizeKernel<decltype(t), U, true><<<grid, kThreads, 0, stream>>>(a);
          FillNanKernel<U><<<StridedGridFor(size), kThreads, 0, stream>>>(
              stored, size, static_cast<typename U::Storage*>(a.values));
        });
      });
    }
    return LaunchError(target);
  }
};

}  // namespace
}  // namespace nvfp4::cuda

namespace ffi = xla::ffi;

using NvFp4CudaMsEden = nvfp4::cuda::CudaMsEden;
NVFP4_DEFINE_MS_EDEN_HANDLERS(Cuda, NvFp4CudaMsEden);
