// The XLA FFI bindings of the targets both platforms run, declared once for the CPU
// (cpu/handlers.cc) and the CUDA (cuda/handlers.cu) handlers: which operands, results and
// attributes each target decodes, in which order, of which type and under which name.
//
// Each function returns the ffi::Ffi::Bind() chain of one target with the platform's
// context first: ffi::ThreadPool on the CPU, ffi::PlatformStream<cudaStream_t> on CUDA.
// A handler file passes it to XLA_FFI_DEFINE_HANDLER_SYMBOL, and binding.To(impl) checks
// at compile time that the impl takes exactly these parameters (the context, then the
// arguments, results and attributes in the order below), so the two platforms' handlers
// cannot drift apart without one of them failing to build.
//
// The order of the arguments and results is the order of the ffi_call's operands and
// results in nvfp4_jax/_src/core/kernels/, and the attribute names are the keyword
// arguments it passes. Every buffer is an ffi::AnyBuffer: the dtypes and shapes are checked
// by nvfp4/checks.h, so that a wrong one is an ffi::Error naming the operand.
//
// Scalars that change from step to step (amax, the SR key words) are operands, not
// attributes, so new values do not recompile; the static flags are attributes.
#ifndef NVFP4_BINDINGS_H_
#define NVFP4_BINDINGS_H_

#include <cstdint>
#include <string_view>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace nvfp4::bindings {

namespace ffi = xla::ffi;
using Buffer = ffi::AnyBuffer;

// After ffi::Ffi::Bind().Ctx<Platform>() the chain's type depends on Platform, so each
// further member template is called as `.template Arg<...>()`.

// nvfp4_amax(x) -> result: x bf16, f16 or f32 (..., C); result f32 (), max |x| (of the
// RHT of x with rht).
template <class Platform>
auto Amax() {
  return ffi::Ffi::Bind()
      .Ctx<Platform>()
      .template Arg<Buffer>()  // x
      .template Ret<Buffer>()  // result
      .template Attr<bool>("rht");
}

// nvfp4_quantize(x, amax, key) -> (codes, scales, stored_amax): x bf16, f16 or f32
// (..., C); amax f32 (); key u32 (4,), the SR seed words; codes u8 (..., C/2); scales
// f8e4m3fn (..., C/16); stored_amax f32 (), amax or NaN.
template <class Platform>
auto Quantize() {
  return ffi::Ffi::Bind()
      .Ctx<Platform>()
      .template Arg<Buffer>()  // x
      .template Arg<Buffer>()  // amax
      .template Arg<Buffer>()  // key
      .template Ret<Buffer>()  // codes
      .template Ret<Buffer>()  // scales
      .template Ret<Buffer>()  // stored_amax
      .template Attr<bool>("block_2d")
      .template Attr<bool>("rht")
      .template Attr<bool>("stochastic_rounding");
}

// nvfp4_fake_quantize(x, amax, key) -> (result, stored_amax): the operands of quantize;
// result bf16, f16 or f32 (..., C), dequantize(quantize(x)).
template <class Platform>
auto FakeQuantize() {
  return ffi::Ffi::Bind()
      .Ctx<Platform>()
      .template Arg<Buffer>()  // x
      .template Arg<Buffer>()  // amax
      .template Arg<Buffer>()  // key
      .template Ret<Buffer>()  // result
      .template Ret<Buffer>()  // stored_amax
      .template Attr<bool>("block_2d")
      .template Attr<bool>("rht")
      .template Attr<bool>("stochastic_rounding")
      .template Attr<bool>("global_scale");
}

// The attributes Four Over Six adds after a plain target's (docs/NUMERICS.md section 13):
// error "mae" or "mse", e4m3_max i32 256 or 448 (checked by CheckFourOverSixAttrs).
template <class Binding>
auto WithFourOverSix(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Attr<std::string_view>("error")
      .template Attr<int32_t>("e4m3_max");
}

// nvfp4_quantize_4over6: nvfp4_quantize's operands and attributes, then Four Over Six's.
template <class Platform>
auto Quantize4over6() {
  return WithFourOverSix(Quantize<Platform>());
}

// nvfp4_fake_quantize_4over6: nvfp4_fake_quantize's, then Four Over Six's.
template <class Platform>
auto FakeQuantize4over6() {
  return WithFourOverSix(FakeQuantize<Platform>());
}

// MS-EDEN (docs/NUMERICS.md section 14): the operand `rotation` is u32 (4,), the 128 sign
// bits of the group rotation; x's last axis is a multiple of 128.
// nvfp4_amax_ms_eden(x, rotation) -> result: f32 (), max |y| of the rotated x.
template <class Platform>
auto MsEdenAmax() {
  return ffi::Ffi::Bind()
      .Ctx<Platform>()
      .template Arg<Buffer>()   // x
      .template Arg<Buffer>()   // rotation
      .template Ret<Buffer>();  // result
}

// nvfp4_quantize_ms_eden(x, amax, key, rotation) -> (codes, scales, stored_amax): the
// operands and results of nvfp4_quantize, then the rotation; no attributes.
template <class Platform>
auto MsEdenQuantize() {
  return ffi::Ffi::Bind()
      .Ctx<Platform>()
      .template Arg<Buffer>()   // x
      .template Arg<Buffer>()   // amax
      .template Arg<Buffer>()   // key
      .template Arg<Buffer>()   // rotation
      .template Ret<Buffer>()   // codes
      .template Ret<Buffer>()   // scales
      .template Ret<Buffer>();  // stored_amax
}

// nvfp4_fake_quantize_ms_eden(x, amax, key, rotation) -> (result, stored_amax): the values
// in the rotated basis.
template <class Platform>
auto MsEdenFakeQuantize() {
  return ffi::Ffi::Bind()
      .Ctx<Platform>()
      .template Arg<Buffer>()  // x
      .template Arg<Buffer>()  // amax
      .template Arg<Buffer>()  // key
      .template Arg<Buffer>()  // rotation
      .template Ret<Buffer>()  // result
      .template Ret<Buffer>()  // stored_amax
      .template Attr<bool>("global_scale");
}

// nvfp4_dequantize(codes, scales, decode_scale) -> result: codes u8 (..., C/2); scales
// f8e4m3fn (..., C/16); decode_scale f32 (); result bf16, f16 or f32 (..., C).
template <class Platform>
auto Dequantize() {
  return ffi::Ffi::Bind()
      .Ctx<Platform>()
      .template Arg<Buffer>()  // codes
      .template Arg<Buffer>()  // scales
      .template Arg<Buffer>()  // decode_scale
      .template Ret<Buffer>()  // result
      .template Attr<bool>("rht");
}

// nvfp4_rht(x) -> result: x bf16, f16 or f32 (..., C); result of x's shape and dtype, the
// blockwise random Hadamard transform of x (or the inverse one).
template <class Platform>
auto Rht() {
  return ffi::Ffi::Bind()
      .Ctx<Platform>()
      .template Arg<Buffer>()  // x
      .template Ret<Buffer>()  // result
      .template Attr<bool>("inverse");
}

}  // namespace nvfp4::bindings

#endif  // NVFP4_BINDINGS_H_
