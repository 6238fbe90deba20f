// CUDA kernels: one thread per 16-element block, numerics from nvfp4/numerics.h.
//
// Written for bandwidth: a thread reads its block with 16-byte loads (2 for bf16/f16, 4
// for f32; a warp reads 1-2 KiB contiguous), keeps the block and its RHT in registers,
// and writes its 8 code bytes with one 8-byte store; adjacent threads own adjacent blocks,
// so stores coalesce. E2M1 conversion is branch-free software (sm_90 has no cvt to e2m1).
// Quantize is a single pass over x after the amax pass; the scalars (amax, key words) are
// read on the device, so nothing synchronizes with the host.
#ifndef NVFP4_CUDA_KERNELS_CUH_
#define NVFP4_CUDA_KERNELS_CUH_

#include <cstdint>

#include "nvfp4/dtypes.h"
#include "nvfp4/launch.h"
#include "nvfp4/numerics.h"
#include "nvfp4/quantize_params.h"

namespace nvfp4::cuda {

// Every kernel but the 1-thread scalar ones is launched with kThreads threads per block
// (nvfp4/launch.h computes the grids); __launch_bounds__ lets the compiler budget registers
// for exactly that, and a launch with more threads fails instead of running wrongly.
constexpr int kThreads = kLaunchThreads;
#define NVFP4_KERNEL __global__ void __launch_bounds__(nvfp4::cuda::kThreads)

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// 16 elements of T at p. `vec`: p is 16-byte aligned (uniform across the grid).
template <class T>
__device__ __forceinline__ void LoadRaw(const typename T::Storage* p, bool vec, float v[kBlock]) {
  using S = typename T::Storage;
  S s[kBlock];
  if (vec) {
    constexpr int kLoads = kBlock * sizeof(S) / 16;
    NVFP4_UNROLL
    for (int k = 0; k < kLoads; ++k) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(p) + k);
      memcpy(reinterpret_cast<char*>(s) + 16 * k, &u, 16);
    }
  } else {
    NVFP4_UNROLL
    for (int i = 0; i < kBlock; ++i) s[i] = p[i];
  }
  NVFP4_UNROLL
  for (int i = 0; i < kBlock; ++i) v[i] = T::Load(s[i]);
}

// 16 elements of T with 16-byte loads, and the forward RHT rounded to T when rht.
template <class T>
__device__ __forceinline__ void LoadBlockVec(const typename T::Storage* p, bool vec, bool rht,
                                             float v[kBlock]) {
  LoadRaw<T>(p, vec, v);
  if (rht) {
    Rht16(v, /*inverse=*/false);
    NVFP4_UNROLL
    for (int i = 0; i < kBlock; ++i) v[i] = RoundTo<T>(v[i]);
  }
}

template <class U>
__device__ __forceinline__ void StoreBlockVec(const float v[kBlock], bool vec,
                                              typename U::Storage* p) {
  using S = typename U::Storage;
  S s[kBlock];
  NVFP4_UNROLL
  for (int i = 0; i < kBlock; ++i) s[i] = U::Store(v[i]);
  if (vec) {
    constexpr int kStores = kBlock * sizeof(S) / 16;
    NVFP4_UNROLL
    for (int k = 0; k < kStores; ++k) {
      uint4 u;
      memcpy(&u, reinterpret_cast<const char*>(s) + 16 * k, 16);
      reinterpret_cast<uint4*>(p)[k] = u;
    }
  } else {
    NVFP4_UNROLL
    for (int i = 0; i < kBlock; ++i) p[i] = s[i];
  }
}

__device__ __forceinline__ void StoreCodes(const uint8_t q[kBlock / 2], bool vec, uint8_t* p) {
  if (vec) {
    uint2 u;
    memcpy(&u, q, 8);
    *reinterpret_cast<uint2*>(p) = u;
  } else {
    NVFP4_UNROLL
    for (int i = 0; i < kBlock / 2; ++i) p[i] = q[i];
  }
}

__device__ __forceinline__ uint32_t WarpMax(uint32_t v) { return __reduce_max_sync(~0u, v); }

// ---------------------------------------------------------------------------
// amax: grid-stride over blocks, one atomicMax per warp on the result's bits.

template <class T>
NVFP4_KERNEL AmaxKernel(const typename T::Storage* x, int64_t blocks, bool vec, bool rht,
                        uint32_t* out_bits) {
  uint32_t seen = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = GlobalThread(); b < blocks; b += stride) {
    float v[kBlock];
    LoadBlockVec<T>(x + b * kBlock, vec, rht, v);
    const uint32_t m = MaxAbsBits16(v);
    seen = m > seen ? m : seen;
  }
  seen = WarpMax(seen);
  if ((threadIdx.x & 31) == 0) atomicMax(out_bits, seen);
}

// The kernels that are no templates are static: cuda/handlers.cu and cuda/ms_eden.cu both
// include this header, and each keeps its own copy.

// Max |x| bits -> f32 amax, NaN when any element was not finite.
static NVFP4_KERNEL AmaxFinalizeKernel(uint32_t* bits) {
  *bits = *bits < kInfBits ? *bits : kNanBits;
}

// stored amax = A, or NaN when A is NaN, inf or negative (the quantize pass may still set
// NaN: then the fill kernels below make the whole result the non-finite one).
static NVFP4_KERNEL StoredAmaxKernel(const float* amax, float* stored) {
  *stored = StoredAmax(*amax, true);
}

// ---------------------------------------------------------------------------
// Quantize and fake-quantize share one kernel; Sink decides what a block writes.

// The parameters both platforms share (nvfp4/quantize_params.h), then the device pointers:
// the scalars (amax, key words) are read on the device.
struct QuantizeArgs : QuantizeParams {
  const void* x;
  const float* amax;
  const uint32_t* key;  // k0, k1, SR counter offset lo, hi
  bool vec;             // all pointers aligned for 16-byte (codes: 8-byte) access
  uint32_t* nonfinite;  // the stored amax's bits: set to NaN when an input is not finite
  // Quantize outputs.
  uint8_t* codes;
  uint8_t* scales;
  // Fake quantize output.
  void* values;
};

struct CodeSink {
  static __device__ __forceinline__ void Put(const QuantizeArgs& a, int64_t block, uint32_t scale,
                                             const uint8_t q[kBlock / 2], float /*global*/) {
    StoreCodes(q, a.vec, a.codes + block * (kBlock / 2));
    a.scales[block] = static_cast<uint8_t>(scale);
  }
};

template <class U>
struct ValueSink {
  static __device__ __forceinline__ void Put(const QuantizeArgs& a, int64_t block, uint32_t scale,
                                             const uint8_t q[kBlock / 2], float global) {
    const float s = E4m3ToF32(scale);
    float v[kBlock];
    DecodeBlock(q, a.use_global ? s * global : s, v);
    StoreBlockVec<U>(v, a.vec, static_cast<typename U::Storage*>(a.values) + block * kBlock);
  }
};

// Quantizes block `block` (flat index, row * cols/16 + column block) of values v with the
// E4M3 scale `scale` and its encode factor `enc`.
template <class Sink>
__device__ __forceinline__ void EncodeBlock(const QuantizeArgs& a, float global, int64_t block,
                                            uint32_t scale, float enc, const float v[kBlock]) {
  uint8_t q[kBlock / 2];
  if (a.sr) {
    uint32_t words[4];
    const uint64_t counter_offset =
        static_cast<uint64_t>(__ldg(a.key + 2)) | static_cast<uint64_t>(__ldg(a.key + 3)) << 32;
    RandomWords16(__ldg(a.key), __ldg(a.key + 1), counter_offset, block * kBlock, words);
    EncodeBlockSr(v, enc, words, q);
  } else {
    EncodeBlockRn(v, enc, q);
  }
  Sink::Put(a, block, scale, q, global);
}

// A block's scale and encode factor from its max |x| `block_amax` (or its tile's), plain.
__device__ __forceinline__ void PlainScale(const GlobalScale& g, float block_amax,
                                           uint32_t& scale, float& enc) {
  scale = BlockScale(block_amax, g);
  enc = BlockEncode(scale, g);
}

// Four Over Six: the candidate (map-to-4 if pick4, else map-to-6) of `c`.
__device__ __forceinline__ void PickScale(const GlobalScale& g, const ScalePair& c, bool pick4,
                                          uint32_t& scale, float& enc) {
  scale = pick4 ? c.s4 : c.s6;
  enc = BlockEncode(scale, g);
}

// 1x16 blocks: thread t owns flat block t.
template <class T, class Sink>
NVFP4_KERNEL Quantize1dKernel(QuantizeArgs a) {
  const int64_t block = GlobalThread();
  if (block >= Quantize1dThreads(a.rows, a.cols)) return;
  const float amax = __ldg(a.amax);
  const GlobalScale g = MakeGlobalScale(amax, a.six_m);
  float v[kBlock];
  LoadBlockVec<T>(static_cast<const typename T::Storage*>(a.x) + block * kBlock, a.vec, a.rht, v);
  const uint32_t bits = MaxAbsBits16(v);
  if (bits >= kInfBits) *a.nonfinite = kNanBits;  // every writer writes the same value
  uint32_t scale;
  float enc;
  if (a.four_over_six == kPlain) {
    PlainScale(g, AsFloat(bits), scale, enc);
  } else {
    const ScalePair c = FourOverSixScales(AsFloat(bits), g);
    const float err4 = CandidateError(v, c.s4, BlockEncode(c.s4, g), amax, a.six_m,
                                      a.four_over_six);
    const float err6 = CandidateError(v, c.s6, BlockEncode(c.s6, g), amax, a.six_m,
                                      a.four_over_six);
    PickScale(g, c, err4 < err6, scale, enc);
  }
  EncodeBlock<Sink>(a, DecodeGlobal(amax, a.six_m), block, scale, enc, v);
}

// 16x16 blocks: a warp owns two tiles side by side; lane l holds row l % 16 of tile l / 16,
// so the tile max is a shuffle reduction over the 16 lanes of a half-warp.
template <class T, class Sink>
NVFP4_KERNEL Quantize2dKernel(QuantizeArgs a) {
  // No early return: every lane takes part in the shuffles below (launch.h).
  const Quantize2dPlace place = Quantize2dPlaceOf(GlobalThread(), a.rows, a.cols);
  const bool valid = place.valid;
  const int64_t block = place.block;
  const float amax = __ldg(a.amax);
  const GlobalScale g = MakeGlobalScale(amax, a.six_m);
  float v[kBlock];
  uint32_t bits = 0;
  if (valid) {
    LoadBlockVec<T>(static_cast<const typename T::Storage*>(a.x) + block * kBlock, a.vec, a.rht, v);
    bits = MaxAbsBits16(v);
    if (bits >= kInfBits) *a.nonfinite = kNanBits;
  }
  uint32_t tile = bits;
  NVFP4_UNROLL
  for (int offset = 1; offset < 16; offset <<= 1) {
    const uint32_t other = __shfl_xor_sync(~0u, tile, offset);
    tile = other > tile ? other : tile;
  }
  uint32_t scale = 0;
  float enc = 0.0f;
  if (a.four_over_six == kPlain) {
    PlainScale(g, AsFloat(tile), scale, enc);
  } else {
    // Each lane its row's errors; the tile's are the tree of TileError over the 16 lanes
    // (offsets 8, 4, 2, 1: lane i adds lane i + offset), read from the half-warp's lane 0.
    const ScalePair c = FourOverSixScales(AsFloat(tile), g);
    float err4 = 0.0f, err6 = 0.0f;
    if (valid) {
      err4 = CandidateError(v, c.s4, BlockEncode(c.s4, g), amax, a.six_m, a.four_over_six);
      err6 = CandidateError(v, c.s6, BlockEncode(c.s6, g), amax, a.six_m, a.four_over_six);
    }
    NVFP4_UNROLL
    for (int offset = 8; offset >= 1; offset >>= 1) {
      err4 = err4 + __shfl_down_sync(~0u, err4, offset);
      err6 = err6 + __shfl_down_sync(~0u, err6, offset);
    }
    const int leader = static_cast<int>(threadIdx.x & 16u);
    err4 = __shfl_sync(~0u, err4, leader);
    err6 = __shfl_sync(~0u, err6, leader);
    PickScale(g, c, err4 < err6, scale, enc);
  }
  if (valid) EncodeBlock<Sink>(a, DecodeGlobal(amax, a.six_m), block, scale, enc, v);
}

// docs/NUMERICS.md section 8, run after the quantize pass: when the stored amax is NaN (A or an
// input element was not finite), every code 0 and every scale E4M3 NaN. Grid-stride over
// the 16-blocks; the threads return at once for a finite tensor.
static NVFP4_KERNEL NonFiniteCodesKernel(const float* stored, int64_t blocks, uint8_t* codes,
                                         uint8_t* scales) {
  const float a = *stored;
  if (a == a) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = GlobalThread(); b < blocks; b += stride) {
    NVFP4_UNROLL
    for (int i = 0; i < kBlock / 2; ++i) codes[b * (kBlock / 2) + i] = 0;
    scales[b] = static_cast<uint8_t>(kE4m3Nan);
  }
}

// Fake quantization of a non-finite tensor (NaN stored amax): every value NaN, as
// dequantizing the non-finite codes gives. Grid-stride over the n values.
template <class U>
NVFP4_KERNEL FillNanKernel(const float* stored, int64_t n, typename U::Storage* out) {
  const float a = *stored;
  if (a == a) return;
  const typename U::Storage nan = U::Store(AsFloat(kNanBits));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = GlobalThread(); i < n; i += stride) out[i] = nan;
}

// ---------------------------------------------------------------------------
// Dequantize and the RHT.

template <class U>
NVFP4_KERNEL DequantizeKernel(const uint8_t* codes, const uint8_t* scales, const float* decode,
                              int64_t blocks, bool rht, bool vec, typename U::Storage* out) {
  const int64_t b = GlobalThread();
  if (b >= blocks) return;
  uint8_t q[kBlock / 2];
  if (vec) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(codes) + b);
    memcpy(q, &u, 8);
  } else {
    NVFP4_UNROLL
    for (int i = 0; i < kBlock / 2; ++i) q[i] = codes[b * (kBlock / 2) + i];
  }
  float v[kBlock];
  DecodeBlock(q, E4m3ToF32(scales[b]) * __ldg(decode), v);
  if (rht) Rht16(v, /*inverse=*/true);
  StoreBlockVec<U>(v, vec, out + b * kBlock);
}

template <class T>
NVFP4_KERNEL RhtKernel(const typename T::Storage* x, int64_t blocks, bool inverse, bool vec,
                       typename T::Storage* out) {
  const int64_t b = GlobalThread();
  if (b >= blocks) return;
  float v[kBlock];
  LoadRaw<T>(x + b * kBlock, vec, v);
  Rht16(v, inverse);
  StoreBlockVec<T>(v, vec, out + b * kBlock);
}

}  // namespace nvfp4::cuda

#undef NVFP4_KERNEL

#endif  // NVFP4_CUDA_KERNELS_CUH_
