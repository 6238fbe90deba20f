// Argument checks and dtype dispatch shared by the CPU and CUDA FFI handlers (host code).
//
// Every rejection is an ffi::Error::InvalidArgument whose message names the target, the
// operand, its shape and dtype, so a user sees what was wrong without a debugger.
#ifndef NVFP4_CHECKS_H_
#define NVFP4_CHECKS_H_

#include <cstdint>
#include <string>

#include "nvfp4/dtypes.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

namespace ffi = xla::ffi;

// A tensor viewed as rows x cols, cols being the last (quantized) axis.
struct RowLayout {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t blocks() const { return cols / kBlock; }
  int64_t size() const { return rows * cols; }
};

inline const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return "bf16";
    case ffi::DataType::F16: return "f16";
    case ffi::DataType::F32: return "f32";
    case ffi::DataType::F64: return "f64";
    case ffi::DataType::U8: return "u8";
    case ffi::DataType::U32: return "u32";
    case ffi::DataType::S32: return "s32";
    case ffi::DataType::F8E4M3FN: return "f8e4m3fn";
    case ffi::DataType::F4E2M1FN: return "f4e2m1fn";
    default: return "an unsupported dtype";
  }
}

inline std::string ShapeString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + (dims.size() == 1 ? ",)" : ")");
}

inline std::string Describe(const char* what, const ffi::AnyBuffer& b) {
  return std::string(what) + " of shape " + ShapeString(b.dimensions()) + " and dtype " +
         DtypeName(b.element_type());
}

inline ffi::Error Invalid(const char* target, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + message);
}

// Rows x cols of a float tensor quantized along its last axis (cols % 16 == 0, and rows
// % 16 == 0 for 16x16 blocks). Returns the error for anything else.
inline ffi::ErrorOr<RowLayout> QuantizedLayout(const char* target, const char* what,
                                               const ffi::AnyBuffer& x, bool block_2d,
                                               int64_t cols_per_element = 1) {
  const auto dims = x.dimensions();
  if (dims.size() == 0) {
    return ffi::Unexpected(Invalid(target, Describe(what, x) + ": needs rank >= 1"));
  }
  RowLayout l;
  l.cols = dims.back() * cols_per_element;
  l.rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) l.rows *= dims[i];
  if (l.cols % kBlock != 0) {
    return ffi::Unexpected(Invalid(
        target, Describe(what, x) + ": the quantized (last) axis must be a multiple of 16"));
  }
  if (block_2d && l.rows % kBlock != 0) {
    return ffi::Unexpected(Invalid(
        target, Describe(what, x) + ": 16x16 blocks need a row count that is a multiple of 16"));
  }
  return l;
}

inline ffi::Error ExpectCount(const char* target, const char* what, const ffi::AnyBuffer& b,
                              ffi::DataType dtype, int64_t count) {
  if (b.element_type() != dtype || static_cast<int64_t>(b.element_count()) != count) {
    return Invalid(target, Describe(what, b) + ": expected " + std::to_string(count) +
                               " elements of dtype " + DtypeName(dtype));
  }
  return ffi::Error::Success();
}

inline ffi::Error ExpectKey(const char* target, ffi::Buffer<ffi::U32> key) {
  if (key.element_count() != 4) {
    return Invalid(target, "key words of shape " + ShapeString(key.dimensions()) +
                               ": expected uint32[4] (k0, k1, counter offset lo, hi)");
  }
  return ffi::Error::Success();
}

inline ffi::Error ExpectScalarF32(const char* target, const char* what,
                                  ffi::Buffer<ffi::F32> b) {
  if (b.element_count() != 1) {
    return Invalid(target, std::string(what) + " of shape " + ShapeString(b.dimensions()) +
                               ": expected an f32 scalar");
  }
  return ffi::Error::Success();
}

// Operands of nvfp4_quantize and nvfp4_fake_quantize: x, amax, key words.
inline ffi::ErrorOr<RowLayout> CheckQuantizeInputs(const char* target, const ffi::AnyBuffer& x,
                                                   ffi::Buffer<ffi::F32> amax,
                                                   ffi::Buffer<ffi::U32> key, bool block_2d) {
  auto layout = QuantizedLayout(target, "x", x, block_2d);
  if (layout.has_error()) return layout;
  if (auto e = ExpectScalarF32(target, "amax", amax); e.failure()) return ffi::Unexpected(e);
  if (auto e = ExpectKey(target, key); e.failure()) return ffi::Unexpected(e);
  return layout;
}

// Packed codes (rows, cols/2) u8 and scales (rows, cols/16) f8e4m3fn for a layout.
inline ffi::Error CheckCodesAndScales(const char* target, const RowLayout& l,
                                      const ffi::AnyBuffer& codes,
                                      const ffi::AnyBuffer& scales) {
  if (auto e = ExpectCount(target, "codes", codes, ffi::DataType::U8, l.size() / 2);
      e.failure()) {
    return e;
  }
  return ExpectCount(target, "scales", scales, ffi::DataType::F8E4M3FN, l.blocks() * l.rows);
}

// Output values: a float tensor with as many elements as the layout.
inline ffi::Error CheckValues(const char* target, const char* what, const RowLayout& l,
                              const ffi::AnyBuffer& out) {
  const auto t = out.element_type();
  const bool is_float =
      t == ffi::DataType::BF16 || t == ffi::DataType::F16 || t == ffi::DataType::F32;
  if (!is_float || static_cast<int64_t>(out.element_count()) != l.size()) {
    return Invalid(target, Describe(what, out) + ": expected " + std::to_string(l.size()) +
                               " elements of dtype bf16, f16 or f32");
  }
  return ffi::Error::Success();
}

// Calls fn(T{}) with the traits type of a bf16/f16/f32 buffer, or returns the error.
template <class Fn>
ffi::Error DispatchFloat(const char* target, const char* what, const ffi::AnyBuffer& b,
                         Fn&& fn) {
  switch (b.element_type()) {
    case ffi::DataType::BF16: return fn(Bf16{});
    case ffi::DataType::F16: return fn(F16{});
    case ffi::DataType::F32: return fn(F32{});
    default:
      return Invalid(target, Describe(what, b) + ": expected dtype bf16, f16 or f32");
  }
}

}  // namespace nvfp4

#endif  // NVFP4_CHECKS_H_
