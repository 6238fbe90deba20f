// XLA FFI handlers for the CUDA kernels: the same targets, checks and dtype dispatch as
// the CPU handlers, launching on XLA's stream. Nothing here synchronizes with the host.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/kernels.cuh"
#include "nvfp4/checks.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4::cuda {
namespace {

int64_t GridFor(int64_t threads) {
  return std::max<int64_t>(1, (threads + kThreads - 1) / kThreads);
}

bool Aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

ffi::Error LaunchError(const char* target) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(target) + ": CUDA launch failed: " +
                              cudaGetErrorString(e));
}

ffi::Error AmaxImpl(cudaStream_t stream, ffi::AnyBuffer x,
                    ffi::Result<ffi::Buffer<ffi::F32>> out, bool rht) {
  constexpr const char* kTarget = "nvfp4_amax";
  auto layout = QuantizedLayout(kTarget, "x", x, /*block_2d=*/false);
  if (layout.has_error()) return layout.error();
  if (auto e = ExpectScalarF32(kTarget, "result", *out); e.failure()) return e;
  auto* bits = reinterpret_cast<uint32_t*>(out->typed_data());
  const int64_t blocks = layout->size() / kBlock;
  return DispatchFloat(kTarget, "x", x, [&](auto t) {
    using T = decltype(t);
    cudaMemsetAsync(bits, 0, sizeof(uint32_t), stream);
    // Enough threads to fill the GPU; each loops over its share of blocks.
    const int64_t grid = std::min<int64_t>(GridFor(blocks), 4096);
    if (blocks > 0) {
      AmaxKernel<T><<<grid, kThreads, 0, stream>>>(
          static_cast<const typename T::Storage*>(x.untyped_data()), blocks,
          Aligned(x.untyped_data(), 16), rht, bits);
    }
    AmaxFinalizeKernel<<<1, 1, 0, stream>>>(bits);
    return LaunchError(kTarget);
  });
}

template <class T, class Sink>
void LaunchQuantize(cudaStream_t stream, const QuantizeArgs& a, bool block_2d) {
  const int64_t blocks = a.rows * (a.cols / kBlock);
  if (blocks == 0) return;
  if (block_2d) {
    const int64_t warps = (a.rows / kBlock) * ((a.cols / kBlock + 1) / 2);
    Quantize2dKernel<T, Sink><<<GridFor(32 * warps), kThreads, 0, stream>>>(a);
  } else {
    Quantize1dKernel<T, Sink><<<GridFor(blocks), kThreads, 0, stream>>>(a);
  }
}

ffi::ErrorOr<QuantizeArgs> MakeArgs(const char* target, const ffi::AnyBuffer& x,
                                    ffi::Buffer<ffi::F32> amax, ffi::Buffer<ffi::U32> key,
                                    bool block_2d, bool rht, bool sr) {
  auto layout = CheckQuantizeInputs(target, x, amax, key, block_2d);
  if (layout.has_error()) return ffi::Unexpected(layout.error());
  QuantizeArgs a{};
  a.x = x.untyped_data();
  a.amax = amax.typed_data();
  a.key = key.typed_data();
  a.rows = layout->rows;
  a.cols = layout->cols;
  a.rht = rht;
  a.sr = sr;
  a.vec = Aligned(a.x, 16);
  return a;
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                        ffi::Buffer<ffi::U32> key, ffi::Result<ffi::AnyBuffer> codes,
                        ffi::Result<ffi::AnyBuffer> scales,
                        ffi::Result<ffi::Buffer<ffi::F32>> stored_amax, bool block_2d,
                        bool rht, bool stochastic_rounding) {
  constexpr const char* kTarget = "nvfp4_quantize";
  auto args = MakeArgs(kTarget, x, amax, key, block_2d, rht, stochastic_rounding);
  if (args.has_error()) return args.error();
  const RowLayout layout{args->rows, args->cols};
  if (auto e = CheckCodesAndScales(kTarget, layout, *codes, *scales); e.failure()) return e;
  if (auto e = ExpectScalarF32(kTarget, "stored_amax", *stored_amax); e.failure()) return e;
  args->codes = static_cast<uint8_t*>(codes->untyped_data());
  args->scales = static_cast<uint8_t*>(scales->untyped_data());
  args->vec = args->vec && Aligned(args->codes, 8);
  args->nonfinite = reinterpret_cast<uint32_t*>(stored_amax->typed_data());
  // Stream order: A (or NaN) first, then the pass that turns it NaN on bad input.
  StoredAmaxKernel<<<1, 1, 0, stream>>>(args->amax, stored_amax->typed_data());
  return DispatchFloat(kTarget, "x", x, [&](auto t) {
    LaunchQuantize<decltype(t), CodeSink>(stream, *args, block_2d);
    return LaunchError(kTarget);
  });
}

ffi::Error FakeQuantizeImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                            ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                            ffi::Buffer<ffi::U32> key, ffi::Result<ffi::AnyBuffer> out,
                            bool block_2d, bool rht, bool stochastic_rounding,
                            bool global_scale) {
  constexpr const char* kTarget = "nvfp4_fake_quantize";
  auto args = MakeArgs(kTarget, x, amax, key, block_2d, rht, stochastic_rounding);
  if (args.has_error()) return args.error();
  const RowLayout layout{args->rows, args->cols};
  if (auto e = CheckValues(kTarget, "result", layout, *out); e.failure()) return e;
  auto flag = scratch.Allocate(sizeof(uint32_t), sizeof(uint32_t));
  if (!flag.has_value()) return ffi::Error::Internal("nvfp4_fake_quantize: no scratch memory");
  args->nonfinite = static_cast<uint32_t*>(*flag);
  args->values = out->untyped_data();
  args->use_global = global_scale;
  args->vec = args->vec && Aligned(args->values, 16);
  cudaMemsetAsync(args->nonfinite, 0, sizeof(uint32_t), stream);
  return DispatchFloat(kTarget, "x", x, [&](auto t) {
    using T = decltype(t);
    return DispatchFloat(kTarget, "result", *out, [&](auto u) {
      using U = decltype(u);
      LaunchQuantize<T, ValueSink<U>>(stream, *args, block_2d);
      if (global_scale && layout.size() > 0) {
        // Threads return at once unless the stored amax is NaN.
        FillNanKernel<U><<<GridFor(layout.size()), kThreads, 0, stream>>>(
            args->amax, args->nonfinite, layout.size(),
            static_cast<typename U::Storage*>(args->values));
      }
      return LaunchError(kTarget);
    });
  });
}

ffi::Error DequantizeImpl(cudaStream_t stream, ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                          ffi::Buffer<ffi::F32> amax, ffi::Result<ffi::AnyBuffer> out,
                          bool rht) {
  constexpr const char* kTarget = "nvfp4_dequantize";
  auto layout = QuantizedLayout(kTarget, "codes", codes, /*block_2d=*/false, 2);
  if (layout.has_error()) return layout.error();
  if (auto e = CheckCodesAndScales(kTarget, *layout, codes, scales); e.failure()) return e;
  if (auto e = ExpectScalarF32(kTarget, "amax", amax); e.failure()) return e;
  if (auto e = CheckValues(kTarget, "result", *layout, *out); e.failure()) return e;
  const int64_t blocks = layout->size() / kBlock;
  const bool vec = Aligned(codes.untyped_data(), 8) && Aligned(out->untyped_data(), 16);
  return DispatchFloat(kTarget, "result", *out, [&](auto u) {
    using U = decltype(u);
    if (blocks > 0) {
      DequantizeKernel<U><<<GridFor(blocks), kThreads, 0, stream>>>(
          static_cast<const uint8_t*>(codes.untyped_data()),
          static_cast<const uint8_t*>(scales.untyped_data()), amax.typed_data(), blocks, rht,
          vec, static_cast<typename U::Storage*>(out->untyped_data()));
    }
    return LaunchError(kTarget);
  });
}

ffi::Error RhtImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                   bool inverse) {
  constexpr const char* kTarget = "nvfp4_rht";
  auto layout = QuantizedLayout(kTarget, "x", x, /*block_2d=*/false);
  if (layout.has_error()) return layout.error();
  if (out->element_type() != x.element_type()) {
    return Invalid(kTarget, Describe("result", *out) + ": expected the dtype of x");
  }
  if (auto e = CheckValues(kTarget, "result", *layout, *out); e.failure()) return e;
  const int64_t blocks = layout->size() / kBlock;
  const bool vec = Aligned(x.untyped_data(), 16) && Aligned(out->untyped_data(), 16);
  return DispatchFloat(kTarget, "x", x, [&](auto t) {
    using T = decltype(t);
    if (blocks > 0) {
      RhtKernel<T><<<GridFor(blocks), kThreads, 0, stream>>>(
          static_cast<const typename T::Storage*>(x.untyped_data()), blocks, inverse, vec,
          static_cast<typename T::Storage*>(out->untyped_data()));
    }
    return LaunchError(kTarget);
  });
}

}  // namespace
}  // namespace nvfp4::cuda

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4AmaxCuda, nvfp4::cuda::AmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("rht"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4QuantizeCuda, nvfp4::cuda::QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("block_2d")
                                  .Attr<bool>("rht")
                                  .Attr<bool>("stochastic_rounding"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4FakeQuantizeCuda, nvfp4::cuda::FakeQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("block_2d")
                                  .Attr<bool>("rht")
                                  .Attr<bool>("stochastic_rounding")
                                  .Attr<bool>("global_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4DequantizeCuda, nvfp4::cuda::DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("rht"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4RhtCuda, nvfp4::cuda::RhtImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("inverse"));
