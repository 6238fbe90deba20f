// MS-EDEN on the CPU (docs/NUMERICS.md section 14), compiled once per instruction set
// (NVFP4_ISA names it). One 128-element group at a time: the rotation, the encoding and the
// stochastic rounding of the scales are nvfp4/ms_eden.h's, shared with the CUDA kernels, in
// plain loops over a group that the compiler vectorizes at this level's width; the order
// of every f32 operation is the header's whatever the width (no FMA: -ffp-contract=off).
//
// As in kernels_isa.cc: nothing from the standard library, everything in the per-ISA
// namespace or always-inline.
#include <cstdint>

#include "cpu/ms_eden.h"
#include "nvfp4/dtypes.h"
#include "nvfp4/ms_eden.h"
#include "nvfp4/numerics.h"

#ifndef NVFP4_ISA
#error "compile with -DNVFP4_ISA=<namespace>"
#endif

namespace nvfp4::cpu::NVFP4_ISA {
namespace {

// Group `group` of x, rotated: y (128 f32). Returns the max |y| bits.
template <class T>
inline __attribute__((always_inline)) uint32_t LoadRotated(const MsEdenJob& job, int64_t group,
                                                           float y[kMsEdenGroup]) {
  const auto* x = static_cast<const typename T::Storage*>(job.x) + group * kMsEdenGroup;
  NVFP4_SIMD_LOOP
  for (int i = 0; i < kMsEdenGroup; ++i) y[i] = T::Load(x[i]);
  Rotate128(y, job.sign_bits);
  uint32_t m = 0;
  NVFP4_SIMD_LOOP
  for (int i = 0; i < kMsEdenGroup; ++i) {
    const uint32_t a = AsBits(y[i]) & kAbsMask;
    m = a > m ? a : m;
  }
  return m;
}

// The 8 block uniforms of a group: block b (global 8 * group + b) hashes the counter
// counter_offset + 2 * block, and takes the top 24 bits of the first word.
inline __attribute__((always_inline)) void GroupUniforms(const MsEdenJob& job, int64_t group,
                                                         float u[kMsEdenBlocks]) {
  for (int b = 0; b < kMsEdenBlocks; ++b) {
    const uint64_t c =
        job.counter_offset + 2u * static_cast<uint64_t>(group * kMsEdenBlocks + b);
    uint32_t x0 = static_cast<uint32_t>(c >> 32), x1 = static_cast<uint32_t>(c);
    Threefry2x32(job.k0, job.k1, x0, x1);
    u[b] = BlockUniform(x0);
  }
}

template <class T>
uint32_t AmaxRange(const MsEdenJob& job, int64_t begin, int64_t end) {
  uint32_t seen = 0;
  for (int64_t group = begin; group < end; ++group) {
    float y[kMsEdenGroup];
    const uint32_t m = LoadRotated<T>(job, group, y);
    seen = m > seen ? m : seen;
  }
  return seen;
}

template <class T>
uint32_t QuantizeRange(const MsEdenJob& job, int64_t begin, int64_t end) {
  uint32_t seen = 0;
  for (int64_t group = begin; group < end; ++group) {
    float y[kMsEdenGroup], u[kMsEdenBlocks];
    const uint32_t m = LoadRotated<T>(job, group, y);
    seen = m > seen ? m : seen;
    GroupUniforms(job, group, u);
    uint32_t codes[kMsEdenGroup], scales[kMsEdenBlocks];
    MsEdenEncodeGroup(y, job.g, u, codes, scales);
    uint8_t* out = job.codes + group * (kMsEdenGroup / 2);
    NVFP4_SIMD_LOOP
    for (int i = 0; i < kMsEdenGroup / 2; ++i) {
      out[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
    }
    for (int b = 0; b < kMsEdenBlocks; ++b) {
      job.scales[group * kMsEdenBlocks + b] = static_cast<uint8_t>(scales[b]);
    }
  }
  return seen;
}

template <class T, class U>
uint32_t FakeQuantizeRange(const MsEdenJob& job, int64_t begin, int64_t end) {
  uint32_t seen = 0;
  for (int64_t group = begin; group < end; ++group) {
    float y[kMsEdenGroup], u[kMsEdenBlocks];
    const uint32_t m = LoadRotated<T>(job, group, y);
    seen = m > seen ? m : seen;
    GroupUniforms(job, group, u);
    uint32_t codes[kMsEdenGroup], scales[kMsEdenBlocks];
    MsEdenEncodeGroup(y, job.g, u, codes, scales);
    auto* out = static_cast<typename U::Storage*>(job.values) + group * kMsEdenGroup;
    for (int b = 0; b < kMsEdenBlocks; ++b) {
      const float factor = E4m3ToF32(scales[b]) * job.global;
      NVFP4_SIMD_LOOP
      for (int k = 0; k < kBlock; ++k) {
        out[b * kBlock + k] = U::Store(E2m1ToF32(codes[b * kBlock + k]) * factor);
      }
    }
  }
  return seen;
}

template <class T>
constexpr MsEdenRangeFn kFake[kNumFloatTypes] = {FakeQuantizeRange<T, Bf16>,
                                                 FakeQuantizeRange<T, F16>,
                                                 FakeQuantizeRange<T, F32>};

}  // namespace

const MsEdenTable& MsEdenKernels() {
  static const MsEdenTable table = {
      {AmaxRange<Bf16>, AmaxRange<F16>, AmaxRange<F32>},
      {QuantizeRange<Bf16>, QuantizeRange<F16>, QuantizeRange<F32>},
      {{kFake<Bf16>[0], kFake<Bf16>[1], kFake<Bf16>[2]},
       {kFake<F16>[0], kFake<F16>[1], kFake<F16>[2]},
       {kFake<F32>[0], kFake<F32>[1], kFake<F32>[2]}},
  };
  return table;
}

}  // namespace nvfp4::cpu::NVFP4_ISA
