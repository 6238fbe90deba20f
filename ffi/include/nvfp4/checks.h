// Argument checks shared by the CPU and CUDA FFI handlers (host code): one function per
// target checks every operand and result of that target and returns its row layout and
// parsed float dtypes, so a handler only runs its kernels.
//
// Every rejection is an ffi::Error::InvalidArgument whose message names the target, the
// operand, its shape and dtype, so a user sees what was wrong without a debugger:
//   nvfp4_amax: x of shape (4, 20) and dtype f32: the quantized (last) axis must be a
//   multiple of 16
// The handlers bind every buffer as ffi::AnyBuffer, so a wrong dtype reaches these checks
// instead of XLA's generic "Wrong buffer dtype" decoding error.
#ifndef NVFP4_CHECKS_H_
#define NVFP4_CHECKS_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "nvfp4/dtypes.h"
#include "nvfp4/ms_eden.h"
#include "nvfp4/numerics.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

namespace ffi = xla::ffi;

// A tensor viewed as rows x cols, cols being the last (quantized) axis.
struct RowLayout {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t blocks() const { return cols / kBlock; }  // 16-blocks per row
  int64_t size() const { return rows * cols; }
};

// What the checks of a target found. `x` is set by the targets with an x operand (amax,
// quantize, fake quantize, rht), `result` by those with a values result (fake quantize,
// dequantize, rht).
struct CheckedArgs {
  RowLayout layout;
  FloatType x = FloatType::kF32;
  FloatType result = FloatType::kF32;
};

inline std::string DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::INVALID: return "invalid";
    case ffi::DataType::PRED: return "pred";
    case ffi::DataType::S1: return "s1";
    case ffi::DataType::S2: return "s2";
    case ffi::DataType::S4: return "s4";
    case ffi::DataType::S8: return "s8";
    case ffi::DataType::S16: return "s16";
    case ffi::DataType::S32: return "s32";
    case ffi::DataType::S64: return "s64";
    case ffi::DataType::U1: return "u1";
    case ffi::DataType::U2: return "u2";
    case ffi::DataType::U4: return "u4";
    case ffi::DataType::U8: return "u8";
    case ffi::DataType::U16: return "u16";
    case ffi::DataType::U32: return "u32";
    case ffi::DataType::U64: return "u64";
    case ffi::DataType::F16: return "f16";
    case ffi::DataType::F32: return "f32";
    case ffi::DataType::F64: return "f64";
    case ffi::DataType::BF16: return "bf16";
    case ffi::DataType::C64: return "c64";
    case ffi::DataType::C128: return "c128";
    case ffi::DataType::TOKEN: return "token";
    case ffi::DataType::F8E5M2: return "f8e5m2";
    case ffi::DataType::F8E4M3: return "f8e4m3";
    case ffi::DataType::F8E4M3FN: return "f8e4m3fn";
    case ffi::DataType::F8E4M3B11FNUZ: return "f8e4m3b11fnuz";
    case ffi::DataType::F8E5M2FNUZ: return "f8e5m2fnuz";
    case ffi::DataType::F8E4M3FNUZ: return "f8e4m3fnuz";
    case ffi::DataType::F8E3M4: return "f8e3m4";
    case ffi::DataType::F4E2M1FN: return "f4e2m1fn";
    case ffi::DataType::F8E8M0FNU: return "f8e8m0fnu";
  }
  return "#" + std::to_string(static_cast<int>(t));  // a dtype newer than these headers
}

inline std::string ShapeString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + (dims.size() == 1 ? ",)" : ")");
}

// Runs the checks of one target in order and keeps the first failure; once a check has
// failed, the later ones do nothing (and return placeholders).
class ArgChecker {
 public:
  explicit ArgChecker(const char* target) : target_(target) {}

  // A float tensor's dtype: bf16, f16 or f32, never a default for anything else.
  FloatType Float(const char* what, const ffi::AnyBuffer& b) {
    if (failed()) return FloatType::kF32;
    switch (b.element_type()) {
      case ffi::DataType::BF16: return FloatType::kBf16;
      case ffi::DataType::F16: return FloatType::kF16;
      case ffi::DataType::F32: return FloatType::kF32;
      default: Fail(what, b, "expected dtype bf16, f16 or f32"); return FloatType::kF32;
    }
  }

  // The rows x cols view of x (or, with `per_element` 2, of packed codes: two per byte),
  // quantized along its last axis in 16-blocks; block_2d also needs rows % 16 == 0.
  RowLayout Layout(const char* what, const ffi::AnyBuffer& b, bool block_2d,
                   int64_t per_element = 1) {
    if (failed()) return {};
    const auto dims = b.dimensions();
    if (dims.size() == 0) {
      Fail(what, b, "needs rank >= 1");
      return {};
    }
    RowLayout l;
    l.cols = dims.back() * per_element;
    l.rows = 1;
    for (size_t i = 0; i + 1 < dims.size(); ++i) l.rows *= dims[i];
    if (l.cols % kBlock != 0) {
      Fail(what, b,
           per_element == 1
               ? "the quantized (last) axis must be a multiple of 16"
               : "the last axis must be a multiple of 8 (16-blocks of codes, two per byte)");
    } else if (block_2d && l.rows % kBlock != 0) {
      Fail(what, b, "16x16 blocks need a row count that is a multiple of 16");
    }
    return l;
  }

  void Dtype(const char* what, const ffi::AnyBuffer& b, ffi::DataType dtype,
             const char* note = "") {
    if (failed() || b.element_type() == dtype) return;
    Fail(what, b, "expected dtype " + DtypeName(dtype) + note);
  }

  void Count(const char* what, const ffi::AnyBuffer& b, int64_t count) {
    if (failed() || static_cast<int64_t>(b.element_count()) == count) return;
    Fail(what, b, "expected " + std::to_string(count) + " elements");
  }

  void CountOf(const char* what, const ffi::AnyBuffer& b, ffi::DataType dtype, int64_t count) {
    if (failed()) return;
    if (b.element_type() != dtype || static_cast<int64_t>(b.element_count()) != count) {
      Fail(what, b, "expected " + std::to_string(count) + " elements of dtype " + DtypeName(dtype));
    }
  }

  // Packed codes (rows, cols/2) u8 and scales (rows, cols/16) f8e4m3fn of a layout.
  void CodesAndScales(const RowLayout& l, const ffi::AnyBuffer& codes,
                      const ffi::AnyBuffer& scales) {
    CountOf("codes", codes, ffi::DataType::U8, l.size() / 2);
    CountOf("scales", scales, ffi::DataType::F8E4M3FN, l.rows * l.blocks());
  }

  // An f32 scalar of shape () (amax operand, amax results).
  void ScalarF32(const char* what, const ffi::AnyBuffer& b) {
    if (failed()) return;
    if (b.element_type() != ffi::DataType::F32 || b.dimensions().size() != 0) {
      Fail(what, b, "expected an f32 scalar of shape ()");
    }
  }

  // The SR key words: uint32[4] (k0, k1, counter offset lo, hi).
  void Key(const ffi::AnyBuffer& key) {
    if (failed()) return;
    const auto dims = key.dimensions();
    if (key.element_type() != ffi::DataType::U32 || dims.size() != 1 || dims[0] != 4) {
      error_ = ffi::Error::InvalidArgument(
          std::string(target_) + ": key words of shape " + ShapeString(dims) +
          ": expected uint32[4] (k0, k1, counter offset lo, hi), got dtype " +
          DtypeName(key.element_type()));
    }
  }

  // MS-EDEN's rotation groups: the quantized (last) axis of x a multiple of 128.
  void Groups(const char* what, const ffi::AnyBuffer& b, const RowLayout& l) {
    if (failed() || l.cols % kMsEdenGroup == 0) return;
    Fail(what, b,
         "the quantized (last) axis must be a multiple of 128 (MS-EDEN's rotation groups)");
  }

  // MS-EDEN's rotation: uint32[4], the 128 sign bits.
  void Rotation(const ffi::AnyBuffer& rotation) {
    if (failed()) return;
    const auto dims = rotation.dimensions();
    if (rotation.element_type() != ffi::DataType::U32 || dims.size() != 1 || dims[0] != 4) {
      Fail("rotation", rotation, "expected uint32[4] (the 128 sign bits of the rotation)");
    }
  }

  ffi::ErrorOr<CheckedArgs> Finish(const CheckedArgs& args) const {
    if (failed()) return ffi::Unexpected(error_);
    return args;
  }

 private:
  bool failed() const { return error_.failure(); }

  void Fail(const char* what, const ffi::AnyBuffer& b, const std::string& problem) {
    error_ = ffi::Error::InvalidArgument(std::string(target_) + ": " + what + " of shape " +
                                         ShapeString(b.dimensions()) + " and dtype " +
                                         DtypeName(b.element_type()) + ": " + problem);
  }

  const char* target_;
  ffi::Error error_;
};

// nvfp4_amax(x) -> f32 scalar.
inline ffi::ErrorOr<CheckedArgs> CheckAmaxArgs(const ffi::AnyBuffer& x,
                                               const ffi::AnyBuffer& result) {
  ArgChecker c("nvfp4_amax");
  CheckedArgs a;
  a.x = c.Float("x", x);
  a.layout = c.Layout("x", x, /*block_2d=*/false);
  c.ScalarF32("result", result);
  return c.Finish(a);
}

// nvfp4_quantize(x, amax, key) -> codes, scales, stored_amax (also the operands of
// nvfp4_quantize_4over6, whose name `target` then is).
inline ffi::ErrorOr<CheckedArgs> CheckQuantizeArgs(
    const ffi::AnyBuffer& x, const ffi::AnyBuffer& amax, const ffi::AnyBuffer& key,
    const ffi::AnyBuffer& codes, const ffi::AnyBuffer& scales, const ffi::AnyBuffer& stored_amax,
    bool block_2d, const char* target = "nvfp4_quantize") {
  ArgChecker c(target);
  CheckedArgs a;
  a.x = c.Float("x", x);
  a.layout = c.Layout("x", x, block_2d);
  c.ScalarF32("amax", amax);
  c.Key(key);
  c.CodesAndScales(a.layout, codes, scales);
  c.ScalarF32("stored_amax", stored_amax);
  return c.Finish(a);
}

// nvfp4_fake_quantize(x, amax, key) -> result (the values), stored_amax (and of
// nvfp4_fake_quantize_4over6).
inline ffi::ErrorOr<CheckedArgs> CheckFakeQuantizeArgs(
    const ffi::AnyBuffer& x, const ffi::AnyBuffer& amax, const ffi::AnyBuffer& key,
    const ffi::AnyBuffer& result, const ffi::AnyBuffer& stored_amax, bool block_2d,
    const char* target = "nvfp4_fake_quantize") {
  ArgChecker c(target);
  CheckedArgs a;
  a.x = c.Float("x", x);
  a.layout = c.Layout("x", x, block_2d);
  c.ScalarF32("amax", amax);
  c.Key(key);
  a.result = c.Float("result", result);
  c.Count("result", result, a.layout.size());
  c.ScalarF32("stored_amax", stored_amax);
  return c.Finish(a);
}

// nvfp4_dequantize(codes, scales, decode_scale) -> result.
inline ffi::ErrorOr<CheckedArgs> CheckDequantizeArgs(const ffi::AnyBuffer& codes,
                                                     const ffi::AnyBuffer& scales,
                                                     const ffi::AnyBuffer& decode_scale,
                                                     const ffi::AnyBuffer& result) {
  ArgChecker c("nvfp4_dequantize");
  CheckedArgs a;
  c.Dtype("codes", codes, ffi::DataType::U8);
  a.layout = c.Layout("codes", codes, /*block_2d=*/false, /*per_element=*/2);
  c.CodesAndScales(a.layout, codes, scales);
  c.ScalarF32("decode_scale", decode_scale);
  a.result = c.Float("result", result);
  c.Count("result", result, a.layout.size());
  return c.Finish(a);
}

// nvfp4_rht(x) -> result of x's dtype and shape.
inline ffi::ErrorOr<CheckedArgs> CheckRhtArgs(const ffi::AnyBuffer& x,
                                              const ffi::AnyBuffer& result) {
  ArgChecker c("nvfp4_rht");
  CheckedArgs a;
  a.x = c.Float("x", x);
  a.layout = c.Layout("x", x, /*block_2d=*/false);
  c.Dtype("result", result, x.element_type(), " (the dtype of x)");
  a.result = a.x;
  c.Count("result", result, a.layout.size());
  return c.Finish(a);
}

// nvfp4_amax_ms_eden(x, rotation) -> f32 scalar (docs/NUMERICS.md section 14).
inline ffi::ErrorOr<CheckedArgs> CheckMsEdenAmaxArgs(const ffi::AnyBuffer& x,
                                                     const ffi::AnyBuffer& rotation,
                                                     const ffi::AnyBuffer& result) {
  ArgChecker c("nvfp4_amax_ms_eden");
  CheckedArgs a;
  a.x = c.Float("x", x);
  a.layout = c.Layout("x", x, /*block_2d=*/false);
  c.Groups("x", x, a.layout);
  c.Rotation(rotation);
  c.ScalarF32("result", result);
  return c.Finish(a);
}

// nvfp4_quantize_ms_eden(x, amax, key, rotation) -> codes, scales, stored_amax.
inline ffi::ErrorOr<CheckedArgs> CheckMsEdenQuantizeArgs(
    const ffi::AnyBuffer& x, const ffi::AnyBuffer& amax, const ffi::AnyBuffer& key,
    const ffi::AnyBuffer& rotation, const ffi::AnyBuffer& codes, const ffi::AnyBuffer& scales,
    const ffi::AnyBuffer& stored_amax) {
  ArgChecker c("nvfp4_quantize_ms_eden");
  CheckedArgs a;
  a.x = c.Float("x", x);
  a.layout = c.Layout("x", x, /*block_2d=*/false);
  c.Groups("x", x, a.layout);
  c.ScalarF32("amax", amax);
  c.Key(key);
  c.Rotation(rotation);
  c.CodesAndScales(a.layout, codes, scales);
  c.ScalarF32("stored_amax", stored_amax);
  return c.Finish(a);
}

// nvfp4_fake_quantize_ms_eden(x, amax, key, rotation) -> result (the values), stored_amax.
inline ffi::ErrorOr<CheckedArgs> CheckMsEdenFakeQuantizeArgs(
    const ffi::AnyBuffer& x, const ffi::AnyBuffer& amax, const ffi::AnyBuffer& key,
    const ffi::AnyBuffer& rotation, const ffi::AnyBuffer& result,
    const ffi::AnyBuffer& stored_amax) {
  ArgChecker c("nvfp4_fake_quantize_ms_eden");
  CheckedArgs a;
  a.x = c.Float("x", x);
  a.layout = c.Layout("x", x, /*block_2d=*/false);
  c.Groups("x", x, a.layout);
  c.ScalarF32("amax", amax);
  c.Key(key);
  c.Rotation(rotation);
  a.result = c.Float("result", result);
  c.Count("result", result, a.layout.size());
  c.ScalarF32("stored_amax", stored_amax);
  return c.Finish(a);
}

// The attributes of the Four Over Six targets (nvfp4_quantize_4over6,
// nvfp4_fake_quantize_4over6; docs/NUMERICS.md section 13), checked.
struct FourOverSixArgs {
  int mode = kPlain;    // kMae or kMse
  float six_m = k2688;  // 6M: 1536 (M = 256) or 2688 (M = 448)
  // The target whose operands are checked.
  const char* quantize_target = "nvfp4_quantize";
  const char* fake_quantize_target = "nvfp4_fake_quantize";
};

// error: "mae" or "mse"; e4m3_max: 256 or 448.
inline ffi::ErrorOr<FourOverSixArgs> CheckFourOverSixAttrs(const char* target,
                                                           std::string_view error,
                                                           int32_t e4m3_max) {
  FourOverSixArgs a;
  if (error == "mae") {
    a.mode = kMae;
  } else if (error == "mse") {
    a.mode = kMse;
  } else {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string(target) + ": attribute error must be \"mae\" or \"mse\", got \"" +
        std::string(error) + "\""));
  }
  if (e4m3_max != 256 && e4m3_max != 448) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string(target) + ": attribute e4m3_max must be 256 or 448, got " +
        std::to_string(e4m3_max)));
  }
  a.six_m = 6.0f * static_cast<float>(e4m3_max);
  a.quantize_target = "nvfp4_quantize_4over6";
  a.fake_quantize_target = "nvfp4_fake_quantize_4over6";
  return a;
}

}  // namespace nvfp4

#endif  // NVFP4_CHECKS_H_
