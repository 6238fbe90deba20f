// MS-EDEN (docs/NUMERICS.md section 14), the numerics of one 128-element rotation group,
// shared by the C++ CPU kernels (cpu/ms_eden_isa.cc) and the CUDA kernels (cuda/ms_eden.cu).
//
// A group is 128 consecutive elements along the quantized axis: 8 NVFP4 blocks of 16. The
// steps, each an f32 operation in the order written (no FMA: the build turns contraction
// off), are those of nvfp4_jax/_src/core/reference/ms_eden.py:
//   1. Rotate128: flip the signs the rotation's bits name, Walsh-Hadamard butterflies
//      h = 1, 2, ..., 64, times R = f32(1/sqrt(128)).
//   2. MsEdenEncodeGroup: per block the E4M3 scale (round to nearest; 0 becomes 1), the
//      E2M1 codes (round to nearest even), the block sums of y^2 and y*v; per group the
//      EDEN correction c = sum y^2 / sum y*v; per block the corrected scale rounded
//      stochastically to a neighbouring E4M3 value (RoundScaleSr) with the block's word.
#ifndef NVFP4_MS_EDEN_H_
#define NVFP4_MS_EDEN_H_

#include <cstdint>

#include "nvfp4/numerics.h"

namespace nvfp4 {

constexpr int kMsEdenGroup = 128;
constexpr int kMsEdenBlocks = kMsEdenGroup / kBlock;
constexpr uint32_t kMsEdenCBits = 0x44C24EB2u;          // C = 256 * V, V = f32(6/(17/16*0.93))
constexpr uint32_t kMsEdenRcpValMaxBits = 0x3E28A3D7u;  // f32(1/V)
constexpr uint32_t kMsEdenRcpCBits = 0x3A28A3D7u;       // f32(1/C)
constexpr uint32_t kRcpSqrt128Bits = 0x3DB504F3u;       // f32(1/sqrt(128))
constexpr uint32_t kE4m3One = 0x38u;                    // the E4M3 byte of 1.0

// The tensor scales of MS-EDEN: S_enc = min(C / A, FLT_MAX) (1 for A == 0 or S_enc == 0),
// S_dec = 1 / S_enc and S_enc * f32(1/V), formed first as the contract says.
struct MsEdenScale {
  float enc;
  float dec;
  float enc_rcpv;
};

NVFP4_HD MsEdenScale MakeMsEdenScale(float amax) {
  float enc = MinNan(AsFloat(kMsEdenCBits) / amax, kFltMax);
  enc = (amax == 0.0f || enc == 0.0f) ? 1.0f : enc;
  return MsEdenScale{enc, 1.0f / enc, enc * AsFloat(kMsEdenRcpValMaxBits)};
}

// The decode factor D = A * f32(1/C): a multiplication, as section 3's.
NVFP4_HD float MsEdenDecode(float amax) { return amax * AsFloat(kMsEdenRcpCBits); }

// The f32 sign-bit mask of position i of a group: bit i % 32 of word i / 32.
NVFP4_HD uint32_t RotationSignBit(const uint32_t words[4], int i) {
  return ((words[i >> 5] >> (i & 31)) & 1u) << 31;
}

// The forward rotation of one group, in place: signs, butterflies, times R.
NVFP4_HD void Rotate128(float v[kMsEdenGroup], const uint32_t sign_bits[kMsEdenGroup]) {
  NVFP4_SIMD_LOOP
  for (int i = 0; i < kMsEdenGroup; ++i) v[i] = AsFloat(AsBits(v[i]) ^ sign_bits[i]);
  for (int h = 1; h < kMsEdenGroup; h <<= 1) {
    for (int base = 0; base < kMsEdenGroup; base += 2 * h) {
      NVFP4_SIMD_LOOP
      for (int j = 0; j < h; ++j) {
        const float a = v[base + j], b = v[base + j + h];
        v[base + j] = a + b;
        v[base + j + h] = a - b;
      }
    }
  }
  const float r = AsFloat(kRcpSqrt128Bits);
  NVFP4_SIMD_LOOP
  for (int i = 0; i < kMsEdenGroup; ++i) v[i] = v[i] * r;
}

// The uniform of a block from its random word: the top 24 bits times 2^-24, exact.
NVFP4_HD float BlockUniform(uint32_t word) {
  return static_cast<float>(word >> 8) * 5.9604644775390625e-8f;
}

// Stochastic rounding of `target` (f32 in [0, 448]) to a neighbouring E4M3 value: lo, the
// largest E4M3 value <= target, or hi = lo + one step, chosen when u * (hi - lo) < target - lo
// (both sides exact). Returns the E4M3 byte. A target that is an E4M3 value stays itself;
// target 448 has hi = NaN, so the comparison fails and it stays 448.
NVFP4_HD uint32_t RoundScaleSr(float target, float u) {
  const uint32_t nearest = F32ToE4m3(target);
  const uint32_t lo = E4m3ToF32(nearest) > target ? nearest - 1u : nearest;
  const float lo_value = E4m3ToF32(lo);
  const float step = E4m3ToF32(lo + 1u) - lo_value;
  return u * step < target - lo_value ? lo + 1u : lo;
}

// The E4M3 byte of block scale s_b from the block amax (round to nearest, clamped to 448
// first; a scale that rounds to 0 becomes 1.0).
NVFP4_HD uint32_t MsEdenBlockScale(float block_amax, const MsEdenScale& g) {
  const uint32_t s = F32ToE4m3(MinNan(block_amax * g.enc_rcpv, kE4m3Max));
  return s == 0u ? kE4m3One : s;
}

// One group y (rotated, f32) -> its 128 codes (unpacked, sign in bit 3) and its 8 chosen
// scale bytes, with `uniform[b]` block b's uniform. Sums: each block's 16 terms in element
// order from +0, then the group's 8 block sums in block order from +0.
NVFP4_HD void MsEdenEncodeGroup(const float y[kMsEdenGroup], const MsEdenScale& g,
                                const float uniform[kMsEdenBlocks], uint32_t codes[kMsEdenGroup],
                                uint32_t scales[kMsEdenBlocks]) {
  float scale_value[kMsEdenBlocks];
  float num = 0.0f, den = 0.0f;
  for (int b = 0; b < kMsEdenBlocks; ++b) {
    const float* yb = y + b * kBlock;
    const uint32_t s = MsEdenBlockScale(AsFloat(MaxAbsBits16(yb)), g);
    scale_value[b] = E4m3ToF32(s);
    const float enc = MinNan(1.0f / (scale_value[b] * g.dec), kFltMax);
    float n = 0.0f, d = 0.0f;
    NVFP4_UNROLL
    for (int k = 0; k < kBlock; ++k) {
      const float v = yb[k] * enc;
      const uint32_t c = E2m1Rn(v);
      codes[b * kBlock + k] = c;
      n = n + v * v;
      d = d + v * E2m1ToF32(c);
    }
    num = num + n;
    den = den + d;
  }
  const float correction = den == 0.0f ? 1.0f : num / den;
  for (int b = 0; b < kMsEdenBlocks; ++b) {
    scales[b] = RoundScaleSr(MinNan(scale_value[b] * correction, kE4m3Max), uniform[b]);
  }
}

}  // namespace nvfp4

#endif  // NVFP4_MS_EDEN_H_
