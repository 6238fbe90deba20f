// Storage types of the floating-point tensors the kernels read and write.
//
// Each type is a traits struct: Storage is the element as it sits in memory, Load
// converts it to f32 exactly, Store rounds f32 to it (RNE). Shared by C++ and CUDA.
#ifndef NVFP4_DTYPES_H_
#define NVFP4_DTYPES_H_

#include <cstdint>

#include "nvfp4/numerics.h"

namespace nvfp4 {

struct Bf16 {
  using Storage = uint16_t;
  static constexpr const char* kName = "bf16";
  static NVFP4_HD float Load(Storage s) { return Bf16ToF32(s); }
  static NVFP4_HD Storage Store(float f) { return F32ToBf16(f); }
};

struct F16 {
  using Storage = uint16_t;
  static constexpr const char* kName = "f16";
  static NVFP4_HD float Load(Storage s) { return F16ToF32(s); }
  static NVFP4_HD Storage Store(float f) { return F32ToF16(f); }
};

struct F32 {
  using Storage = float;
  static constexpr const char* kName = "f32";
  static NVFP4_HD float Load(Storage s) { return s; }
  static NVFP4_HD Storage Store(float f) { return f; }
};

// f32 -> T -> f32: what "round to the input dtype" means after the RHT.
template <class T>
NVFP4_HD float RoundTo(float f) {
  return T::Load(T::Store(f));
}

// 16 elements of T -> f32, with the forward RHT (rounded to T) when rht is set.
template <class T>
NVFP4_HD void LoadBlock(const typename T::Storage* p, bool rht, float v[kBlock]) {
  NVFP4_SIMD_LOOP
  for (int i = 0; i < kBlock; ++i) v[i] = T::Load(p[i]);
  if (rht) {
    Rht16(v, /*inverse=*/false);
    NVFP4_SIMD_LOOP
    for (int i = 0; i < kBlock; ++i) v[i] = RoundTo<T>(v[i]);
  }
}

template <class T>
NVFP4_HD void StoreBlock(const float v[kBlock], typename T::Storage* p) {
  NVFP4_SIMD_LOOP
  for (int i = 0; i < kBlock; ++i) p[i] = T::Store(v[i]);
}

}  // namespace nvfp4

#endif  // NVFP4_DTYPES_H_
