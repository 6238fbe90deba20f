// CUDA kernels of MS-EDEN (docs/NUMERICS.md section 14): one thread per 128-element rotation
// group, the numerics of nvfp4/ms_eden.h (shared with the CPU kernels). Included by
// cuda/ms_eden.cu after cuda/kernels.cuh, whose amax finalization and non-finite fills
// (NonFiniteCodesKernel, FillNanKernel) the handlers reuse.
//
// Written for correctness first: a thread keeps its group (128 f32) in registers and local
// memory; the sign bits of the rotation sit in shared memory, computed once per thread block.
#ifndef NVFP4_CUDA_MS_EDEN_CUH_
#define NVFP4_CUDA_MS_EDEN_CUH_

#include <cstdint>

#include "cuda/kernels.cuh"
#include "nvfp4/dtypes.h"
#include "nvfp4/ms_eden.h"
#include "nvfp4/numerics.h"

namespace nvfp4::cuda {

#define NVFP4_MS_EDEN_KERNEL __global__ void __launch_bounds__(nvfp4::cuda::kThreads)

struct MsEdenArgs {
  const void* x;
  int64_t groups;
  const float* amax;
  const uint32_t* key;       // k0, k1, counter offset lo, hi
  const uint32_t* rotation;  // the 128 sign bits
  uint32_t* nonfinite;       // the stored amax's bits: NaN when a rotated value is not finite
  uint8_t* codes;
  uint8_t* scales;
  void* values;
  bool use_global;
};

// The rotation's sign bits in shared memory, filled by the block's first 128 threads.
__device__ __forceinline__ void LoadSignBits(const uint32_t* rotation, uint32_t* sign_bits) {
  if (threadIdx.x < kMsEdenGroup) {
    uint32_t words[4];
    NVFP4_UNROLL
    for (int i = 0; i < 4; ++i) words[i] = __ldg(rotation + i);
    sign_bits[threadIdx.x] = RotationSignBit(words, static_cast<int>(threadIdx.x));
  }
  __syncthreads();
}

template <class T>
__device__ __forceinline__ uint32_t LoadRotatedGroup(const void* x, int64_t group,
                                                     const uint32_t* sign_bits,
                                                     float y[kMsEdenGroup]) {
  const auto* p = static_cast<const typename T::Storage*>(x) + group * kMsEdenGroup;
  for (int i = 0; i < kMsEdenGroup; ++i) y[i] = T::Load(p[i]);
  Rotate128(y, sign_bits);
  uint32_t m = 0;
  for (int i = 0; i < kMsEdenGroup; ++i) {
    const uint32_t a = AsBits(y[i]) & kAbsMask;
    m = a > m ? a : m;
  }
  return m;
}

// The max |y| bits of the rotated x: grid-stride over groups, one atomicMax per warp.
template <class T>
NVFP4_MS_EDEN_KERNEL MsEdenAmaxKernel(const void* x, int64_t groups, const uint32_t* rotation,
                                      uint32_t* out_bits) {
  __shared__ uint32_t sign_bits[kMsEdenGroup];
  LoadSignBits(rotation, sign_bits);
  uint32_t seen = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = GlobalThread(); g < groups; g += stride) {
    float y[kMsEdenGroup];
    const uint32_t m = LoadRotatedGroup<T>(x, g, sign_bits, y);
    seen = m > seen ? m : seen;
  }
  seen = WarpMax(seen);
  if ((threadIdx.x & 31) == 0) atomicMax(out_bits, seen);
}

// Quantize (kValues false: packed codes and scales) or fake quantize (values of U): thread t
// owns group t. No early return before the shared sign bits are loaded.
template <class T, class U, bool kValues>
NVFP4_MS_EDEN_KERNEL MsEdenQuantizeKernel(MsEdenArgs a) {
  __shared__ uint32_t sign_bits[kMsEdenGroup];
  LoadSignBits(a.rotation, sign_bits);
  const int64_t group = GlobalThread();
  if (group >= a.groups) return;
  const float amax = __ldg(a.amax);
  const MsEdenScale g = MakeMsEdenScale(amax);
  float y[kMsEdenGroup];
  const uint32_t bits = LoadRotatedGroup<T>(a.x, group, sign_bits, y);
  if (bits >= kInfBits) *a.nonfinite = kNanBits;  // every writer writes the same value
  const uint32_t k0 = __ldg(a.key), k1 = __ldg(a.key + 1);
  const uint64_t offset =
      static_cast<uint64_t>(__ldg(a.key + 2)) | static_cast<uint64_t>(__ldg(a.key + 3)) << 32;
  float u[kMsEdenBlocks];
  for (int b = 0; b < kMsEdenBlocks; ++b) {
    const uint64_t c = offset + 2u * static_cast<uint64_t>(group * kMsEdenBlocks + b);
    uint32_t x0 = static_cast<uint32_t>(c >> 32), x1 = static_cast<uint32_t>(c);
    Threefry2x32(k0, k1, x0, x1);
    u[b] = BlockUniform(x0);
  }
  uint32_t codes[kMsEdenGroup], scales[kMsEdenBlocks];
  MsEdenEncodeGroup(y, g, u, codes, scales);
  if constexpr (kValues) {
    const float global = a.use_global ? MsEdenDecode(amax) : 1.0f;
    auto* out = static_cast<typename U::Storage*>(a.values) + group * kMsEdenGroup;
    for (int b = 0; b < kMsEdenBlocks; ++b) {
      const float factor = E4m3ToF32(scales[b]) * global;
      for (int k = 0; k < kBlock; ++k) {
        out[b * kBlock + k] = U::Store(E2m1ToF32(codes[b * kBlock + k]) * factor);
      }
    }
  } else {
    uint8_t* out = a.codes + group * (kMsEdenGroup / 2);
    for (int i = 0; i < kMsEdenGroup / 2; ++i) {
      out[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
    }
    for (int b = 0; b < kMsEdenBlocks; ++b) {
      a.scales[group * kMsEdenBlocks + b] = static_cast<uint8_t>(scales[b]);
    }
  }
}

#undef NVFP4_MS_EDEN_KERNEL

}  // namespace nvfp4::cuda

#endif  // NVFP4_CUDA_MS_EDEN_CUH_
