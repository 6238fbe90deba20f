// Storage types of the floating-point tensors the kernels read and write.
//
// Each type is a traits struct: Storage is the element as it sits in memory, Load
// converts it to f32 exactly, Store rounds f32 to it (RNE). FloatType names them at run
// time (checks.h parses it from a buffer's dtype). Shared by C++ and CUDA.
#ifndef NVFP4_DTYPES_H_
#define NVFP4_DTYPES_H_

#include <cstdint>

#include "nvfp4/numerics.h"

namespace nvfp4 {

// The float dtypes of x and of the values results; also the index of the CPU kernel tables.
enum class FloatType : int { kBf16 = 0, kF16 = 1, kF32 = 2 };
constexpr int kNumFloatTypes = 3;

struct Bf16 {
  using Storage = uint16_t;
  static NVFP4_HD float Load(Storage s) { return Bf16ToF32(s); }
  static NVFP4_HD Storage Store(float f) { return F32ToBf16(f); }
};

struct F16 {
  using Storage = uint16_t;
  static NVFP4_HD float Load(Storage s) { return F16ToF32(s); }
  static NVFP4_HD Storage Store(float f) { return F32ToF16(f); }
};

struct F32 {
  using Storage = float;
  static NVFP4_HD float Load(Storage s) { return s; }
  static NVFP4_HD Storage Store(float f) { return f; }
};

// f32 -> T -> f32: what "round to the input dtype" means after the RHT.
template <class T>
NVFP4_HD float RoundTo(float f) {
  return T::Load(T::Store(f));
}

template <class T>
NVFP4_HD void StoreBlock(const float v[kBlock], typename T::Storage* p) {
  NVFP4_SIMD_LOOP
  for (int i = 0; i < kBlock; ++i) p[i] = T::Store(v[i]);
}

// Calls fn(Bf16{}), fn(F16{}) or fn(F32{}) for t: template dispatch on a parsed dtype.
template <class Fn>
decltype(auto) VisitFloatType(FloatType t, Fn&& fn) {
  switch (t) {
    case FloatType::kBf16: return fn(Bf16{});
    case FloatType::kF16: return fn(F16{});
    case FloatType::kF32: break;
  }
  return fn(F32{});
}

}  // namespace nvfp4

#endif  // NVFP4_DTYPES_H_
