// The XLA FFI handlers of the seven targets both platforms run (amax, quantize, fake
// quantize and their Four Over Six twins, dequantize, the RHT), written once for the CPU
// (cpu/handlers.cc) and CUDA (cuda/handlers.cu): the decoding of the operands and attributes
// (the bindings of nvfp4/bindings.h), the argument checks (nvfp4/checks.h), the parameters
// of the quantizing targets (nvfp4/quantize_params.h) and the error returns. A platform
// only runs its kernels on checked arguments; every failure is an ffi::Error returned to
// XLA, never a crash of the process.
//
// A platform is a struct with
//   using Context = ...;  // what the handler receives: ffi::ThreadPool, cudaStream_t
//   using Binding = ...;  // what binds it: ffi::ThreadPool, ffi::PlatformStream<cudaStream_t>
//   static ffi::Error Amax(Context&, const CheckedArgs&, ffi::AnyBuffer x,
//                          ffi::AnyBuffer result, bool rht);
//   static ffi::Error Quantize(Context&, const QuantizeCall&, ffi::AnyBuffer x,
//                              ffi::AnyBuffer amax, ffi::AnyBuffer key, ffi::AnyBuffer codes,
//                              ffi::AnyBuffer scales, ffi::AnyBuffer stored_amax);
//   static ffi::Error FakeQuantize(Context&, const QuantizeCall&, ffi::AnyBuffer x,
//                                  ffi::AnyBuffer amax, ffi::AnyBuffer key,
//                                  ffi::AnyBuffer result, ffi::AnyBuffer stored_amax);
//   static ffi::Error Dequantize(Context&, const CheckedArgs&, ffi::AnyBuffer codes,
//                                ffi::AnyBuffer scales, ffi::AnyBuffer decode_scale,
//                                ffi::AnyBuffer result, bool rht);
//   static ffi::Error Rht(Context&, const CheckedArgs&, ffi::AnyBuffer x,
//                         ffi::AnyBuffer result, bool inverse);
// and NVFP4_DEFINE_HANDLERS(Cpu, Platform) defines the handler symbols module.cc registers
// (NvFp4AmaxCpu, ...). The targets only one platform has (the CPU's GEMMs, KV cache,
// threefry) have files of their own, as has MS-EDEN on both (MsEdenHandlers below).
#ifndef NVFP4_HANDLERS_H_
#define NVFP4_HANDLERS_H_

#include <cstdint>
#include <string_view>

#include "nvfp4/bindings.h"
#include "nvfp4/checks.h"
#include "nvfp4/quantize_params.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

// One checked call of a quantizing target: its name (for the platform's own errors), the
// layout and dtypes its checks found, and its parameters.
struct QuantizeCall {
  const char* target;
  CheckedArgs args;
  QuantizeParams params;
};

// The parameters of a quantize (or fake quantize: `global_scale`) call.
inline QuantizeParams MakeQuantizeParams(const RowLayout& layout, bool block_2d, bool rht,
                                         bool stochastic_rounding, bool global_scale,
                                         const FourOverSixArgs& fos) {
  QuantizeParams p;
  p.rows = layout.rows;
  p.cols = layout.cols;
  p.block_2d = block_2d;
  p.rht = rht;
  p.sr = stochastic_rounding;
  p.four_over_six = fos.mode;
  p.six_m = fos.six_m;
  p.use_global = global_scale;
  return p;
}

// The handlers of one platform; their parameters are those of nvfp4/bindings.h, in order.
template <class Platform>
struct Handlers {
  using Ctx = typename Platform::Context;
  using Buffer = ffi::AnyBuffer;
  using Result = ffi::Result<ffi::AnyBuffer>;

  static ffi::Error Amax(Ctx ctx, Buffer x, Result out, bool rht) {
    auto args = CheckAmaxArgs(x, *out);
    if (args.has_error()) return args.error();
    return Platform::Amax(ctx, *args, x, *out, rht);
  }

  static ffi::Error Quantize(Ctx ctx, Buffer x, Buffer amax, Buffer key, Result codes,
                             Result scales, Result stored_amax, bool block_2d, bool rht,
                             bool stochastic_rounding) {
    return QuantizeWith(ctx, x, amax, key, *codes, *scales, *stored_amax, block_2d, rht,
                        stochastic_rounding, FourOverSixArgs{});
  }

  // nvfp4_quantize_4over6: nvfp4_quantize under Four Over Six (docs/NUMERICS.md section 13).
  static ffi::Error Quantize4over6(Ctx ctx, Buffer x, Buffer amax, Buffer key, Result codes,
                                   Result scales, Result stored_amax, bool block_2d, bool rht,
                                   bool stochastic_rounding, std::string_view error,
                                   int32_t e4m3_max) {
    auto fos = CheckFourOverSixAttrs("nvfp4_quantize_4over6", error, e4m3_max);
    if (fos.has_error()) return fos.error();
    return QuantizeWith(ctx, x, amax, key, *codes, *scales, *stored_amax, block_2d, rht,
                        stochastic_rounding, *fos);
  }

  static ffi::Error FakeQuantize(Ctx ctx, Buffer x, Buffer amax, Buffer key, Result out,
                                 Result stored_amax, bool block_2d, bool rht,
                                 bool stochastic_rounding, bool global_scale) {
    return FakeQuantizeWith(ctx, x, amax, key, *out, *stored_amax, block_2d, rht,
                            stochastic_rounding, global_scale, FourOverSixArgs{});
  }

  // nvfp4_fake_quantize_4over6: nvfp4_fake_quantize under Four Over Six.
  static ffi::Error FakeQuantize4over6(Ctx ctx, Buffer x, Buffer amax, Buffer key, Result out,
                                       Result stored_amax, bool block_2d, bool rht,
                                       bool stochastic_rounding, bool global_scale,
                                       std::string_view error, int32_t e4m3_max) {
    auto fos = CheckFourOverSixAttrs("nvfp4_fake_quantize_4over6", error, e4m3_max);
    if (fos.has_error()) return fos.error();
    return FakeQuantizeWith(ctx, x, amax, key, *out, *stored_amax, block_2d, rht,
                            stochastic_rounding, global_scale, *fos);
  }

  static ffi::Error Dequantize(Ctx ctx, Buffer codes, Buffer scales, Buffer decode_scale,
                               Result out, bool rht) {
    auto args = CheckDequantizeArgs(codes, scales, decode_scale, *out);
    if (args.has_error()) return args.error();
    return Platform::Dequantize(ctx, *args, codes, scales, decode_scale, *out, rht);
  }

  static ffi::Error Rht(Ctx ctx, Buffer x, Result out, bool inverse) {
    auto args = CheckRhtArgs(x, *out);
    if (args.has_error()) return args.error();
    return Platform::Rht(ctx, *args, x, *out, inverse);
  }

 private:
  static ffi::Error QuantizeWith(Ctx& ctx, Buffer x, Buffer amax, Buffer key, Buffer codes,
                                 Buffer scales, Buffer stored_amax, bool block_2d, bool rht,
                                 bool stochastic_rounding, const FourOverSixArgs& fos) {
    auto args = CheckQuantizeArgs(x, amax, key, codes, scales, stored_amax, block_2d,
                                  fos.quantize_target);
    if (args.has_error()) return args.error();
    const QuantizeCall call{fos.quantize_target, *args,
                            MakeQuantizeParams(args->layout, block_2d, rht, stochastic_rounding,
                                               /*global_scale=*/true, fos)};
    return Platform::Quantize(ctx, call, x, amax, key, codes, scales, stored_amax);
  }

  static ffi::Error FakeQuantizeWith(Ctx& ctx, Buffer x, Buffer amax, Buffer key, Buffer out,
                                     Buffer stored_amax, bool block_2d, bool rht,
                                     bool stochastic_rounding, bool global_scale,
                                     const FourOverSixArgs& fos) {
    auto args = CheckFakeQuantizeArgs(x, amax, key, out, stored_amax, block_2d,
                                      fos.fake_quantize_target);
    if (args.has_error()) return args.error();
    const QuantizeCall call{fos.fake_quantize_target, *args,
                            MakeQuantizeParams(args->layout, block_2d, rht, stochastic_rounding,
                                               global_scale, fos)};
    return Platform::FakeQuantize(ctx, call, x, amax, key, out, stored_amax);
  }
};

// The handlers of MS-EDEN's three targets (docs/NUMERICS.md section 14), both platforms'
// (cpu/ms_eden.cc, cuda/ms_eden.cu). A platform is a struct with Context and Binding as
// above and
//   static ffi::Error Amax(Context&, const CheckedArgs&, ffi::AnyBuffer x,
//                          ffi::AnyBuffer rotation, ffi::AnyBuffer result);
//   static ffi::Error Quantize(Context&, const CheckedArgs&, ffi::AnyBuffer x,
//                              ffi::AnyBuffer amax, ffi::AnyBuffer key, ffi::AnyBuffer rotation,
//                              ffi::AnyBuffer codes, ffi::AnyBuffer scales,
//                              ffi::AnyBuffer stored_amax);
//   static ffi::Error FakeQuantize(Context&, const CheckedArgs&, ffi::AnyBuffer x,
//                                  ffi::AnyBuffer amax, ffi::AnyBuffer key,
//                                  ffi::AnyBuffer rotation, ffi::AnyBuffer result,
//                                  ffi::AnyBuffer stored_amax, bool global_scale);
template <class Platform>
struct MsEdenHandlers {
  using Ctx = typename Platform::Context;
  using Buffer = ffi::AnyBuffer;
  using Result = ffi::Result<ffi::AnyBuffer>;

  static ffi::Error Amax(Ctx ctx, Buffer x, Buffer rotation, Result out) {
    auto args = CheckMsEdenAmaxArgs(x, rotation, *out);
    if (args.has_error()) return args.error();
    return Platform::Amax(ctx, *args, x, rotation, *out);
  }

  static ffi::Error Quantize(Ctx ctx, Buffer x, Buffer amax, Buffer key, Buffer rotation,
                             Result codes, Result scales, Result stored_amax) {
    auto args = CheckMsEdenQuantizeArgs(x, amax, key, rotation, *codes, *scales, *stored_amax);
    if (args.has_error()) return args.error();
    return Platform::Quantize(ctx, *args, x, amax, key, rotation, *codes, *scales, *stored_amax);
  }

  static ffi::Error FakeQuantize(Ctx ctx, Buffer x, Buffer amax, Buffer key, Buffer rotation,
                                 Result out, Result stored_amax, bool global_scale) {
    auto args = CheckMsEdenFakeQuantizeArgs(x, amax, key, rotation, *out, *stored_amax);
    if (args.has_error()) return args.error();
    return Platform::FakeQuantize(ctx, *args, x, amax, key, rotation, *out, *stored_amax,
                                  global_scale);
  }
};

}  // namespace nvfp4

// Defines the three MS-EDEN handler symbols of `Platform`: NvFp4AmaxMsEden##suffix, ...
#define NVFP4_DEFINE_MS_EDEN_HANDLERS(suffix, Platform)                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4AmaxMsEden##suffix, nvfp4::MsEdenHandlers<Platform>::Amax, \
                                nvfp4::bindings::MsEdenAmax<Platform::Binding>());             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4QuantizeMsEden##suffix,                                   \
                                nvfp4::MsEdenHandlers<Platform>::Quantize,                     \
                                nvfp4::bindings::MsEdenQuantize<Platform::Binding>());         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4FakeQuantizeMsEden##suffix,                               \
                                nvfp4::MsEdenHandlers<Platform>::FakeQuantize,                 \
                                nvfp4::bindings::MsEdenFakeQuantize<Platform::Binding>())

// Defines the seven handler symbols of `Platform` (a type name without commas), suffixed
// `suffix` as python/module.cc declares them: NvFp4Amax##suffix, ...
#define NVFP4_DEFINE_HANDLERS(suffix, Platform)                                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4Amax##suffix, nvfp4::Handlers<Platform>::Amax,           \
                                nvfp4::bindings::Amax<Platform::Binding>());                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4Quantize##suffix, nvfp4::Handlers<Platform>::Quantize,   \
                                nvfp4::bindings::Quantize<Platform::Binding>());               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4FakeQuantize##suffix,                                     \
                                nvfp4::Handlers<Platform>::FakeQuantize,                       \
                                nvfp4::bindings::FakeQuantize<Platform::Binding>());           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4Quantize4over6##suffix,                                   \
                                nvfp4::Handlers<Platform>::Quantize4over6,                     \
                                nvfp4::bindings::Quantize4over6<Platform::Binding>());         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4FakeQuantize4over6##suffix,                               \
                                nvfp4::Handlers<Platform>::FakeQuantize4over6,                 \
                                nvfp4::bindings::FakeQuantize4over6<Platform::Binding>());     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4Dequantize##suffix,                                       \
                                nvfp4::Handlers<Platform>::Dequantize,                         \
                                nvfp4::bindings::Dequantize<Platform::Binding>());             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4Rht##suffix, nvfp4::Handlers<Platform>::Rht,             \
                                nvfp4::bindings::Rht<Platform::Binding>())

#endif  // NVFP4_HANDLERS_H_
