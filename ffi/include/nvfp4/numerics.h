// The NVFP4 numerics of docs/NUMERICS.md, shared by the C++ CPU and the CUDA kernels.
//
// Every function here is compiled for host and device from this one file, so the two
// kernels cannot drift apart. All arithmetic is f32, round to nearest even, in exactly
// the order docs/NUMERICS.md writes it; the build turns off FMA contraction and fast-math.
// Conversions are branch-free bit arithmetic (selects, no data-dependent branches), so
// they vectorize on the CPU and do not diverge on the GPU.
//
// XLA on CPU runs with denormals flushed (FTZ/DAZ), so the scale and code math here never
// relies on an f32 subnormal intermediate and gives the same answer with or without
// flushing. The RHT butterflies are the exception: tiny normal inputs (below about 2^-122)
// can produce subnormal sums, which flushing zeroes (docs/NUMERICS.md section 8).
#ifndef NVFP4_NUMERICS_H_
#define NVFP4_NUMERICS_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define NVFP4_HD __host__ __device__ __forceinline__
// Fully unrolled loops keep the 16-value arrays in registers.
#define NVFP4_UNROLL _Pragma("unroll")
#else
#define NVFP4_HD inline __attribute__((always_inline))
#define NVFP4_UNROLL
#endif

// Loops over a block that convert between widths (u16 <-> f32, nibbles -> f32): on the GPU
// unrolled; on the CPU kept whole for GCC's loop vectorizer, which turns them into a few
// vector instructions, where fully unrolling them first leaves scalar code behind.
#if defined(__CUDACC__)
#define NVFP4_SIMD_LOOP _Pragma("unroll")
#elif defined(__GNUC__) && !defined(__clang__)
#define NVFP4_SIMD_LOOP _Pragma("GCC unroll 1")
#else
#define NVFP4_SIMD_LOOP
#endif

namespace nvfp4 {

// Block size along the quantized axis, and codes per packed byte.
constexpr int kBlock = 16;

constexpr float kE4m3Max = 448.0f;
constexpr float k2688 = 2688.0f;  // FP4_MAX * E4M3_MAX, exact in f32.
constexpr float kFltMax = 3.40282346638528859812e+38f;
constexpr uint32_t kRcp6Bits = 0x3E2AAAABu;     // f32(1/6)
constexpr uint32_t kRcp2688Bits = 0x39C30C31u;  // f32(1/2688)
constexpr uint32_t kRcp1536Bits = 0x3A2AAAABu;  // f32(1/1536): 6M for M = 256 (Four Over Six)
constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kNanBits = 0x7FC00000u;
constexpr uint32_t kE4m3Nan = 0x7Fu;  // the E4M3 scale byte of a non-finite tensor
// RHT sign vector as a bitmask: bit i set where sign i is -1.
constexpr uint32_t kRhtSignMask = 0xD7E8u;

// ---------------------------------------------------------------------------
// Bit casts.

NVFP4_HD float AsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

NVFP4_HD uint32_t AsBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

// jnp.minimum semantics: a NaN operand gives NaN (std::fmin would drop it).
NVFP4_HD float MinNan(float a, float b) { return (a < b || a != a) ? a : b; }

// ---------------------------------------------------------------------------
// Storage types <-> f32 (RNE, NaN stays NaN).

NVFP4_HD float Bf16ToF32(uint16_t h) { return AsFloat(uint32_t{h} << 16); }

NVFP4_HD uint16_t F32ToBf16(float f) {
  const uint32_t x = AsBits(f);
  const uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (x >> 16) | 0x40u;
  return static_cast<uint16_t>((x & kAbsMask) > kInfBits ? quiet_nan : rounded);
}

// f16 subnormals are f32 normals: built as integer * 2^-24 so no f32 subnormal appears.
NVFP4_HD float F16ToF32(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t em = h & 0x7FFFu;
  const uint32_t normal = (em << 13) + (112u << 23);  // rebias 15 -> 127
  const uint32_t inf_nan = (em << 13) | kInfBits;
  const uint32_t subnormal = AsBits(static_cast<float>(em) * 5.9604644775390625e-8f);
  uint32_t bits = em >= 0x7C00u ? inf_nan : normal;
  bits = em < 0x400u ? subnormal : bits;
  return AsFloat(bits | sign);
}

NVFP4_HD uint16_t F32ToF16(float f) {
  const uint32_t x = AsBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & kAbsMask;
  // |f| >= 2^16 overflows for sure; NaN becomes a quiet NaN.
  const uint32_t huge = a > kInfBits ? 0x7E00u : 0x7C00u;
  // Below 2^-14 the f16 quantum is 2^-24, the ulp of 0.5: the f32 adder rounds for us.
  const uint32_t subnormal = AsBits(AsFloat(a) + 0.5f) - 0x3F000000u;
  // Normal: rebias 127 -> 15 and round 23 -> 10 mantissa bits, ties to even; a carry
  // into the exponent (65520 -> inf) is the correct rounding.
  const uint32_t normal = (a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  uint32_t h = a < 0x38800000u ? subnormal : normal;
  h = a >= 0x47800000u ? huge : h;
  return static_cast<uint16_t>(h | sign);
}

// ---------------------------------------------------------------------------
// E4M3 (float8_e4m3fn), the block scale.

// v must be in [0, 448] or NaN (the caller clamps: 465 would otherwise become NaN).
NVFP4_HD uint32_t F32ToE4m3(float v) {
  // Below 2^-6 the E4M3 quantum is 2^-9, the ulp of 2^14: the f32 adder rounds (RNE).
  const uint32_t subnormal = AsBits(v + 16384.0f) - 0x46800000u;
  // Normal: rebias 127 -> 7 and round 23 -> 3 mantissa bits, ties to even.
  const uint32_t x = AsBits(v);
  const uint32_t normal = ((x + 0x7FFFFu + ((x >> 20) & 1u)) >> 20) - (120u << 3);
  uint32_t code = v < 0.015625f ? subnormal : normal;
  return v != v ? kE4m3Nan : code;
}

NVFP4_HD float E4m3ToF32(uint32_t c) {
  const uint32_t e = (c >> 3) & 0xFu;
  const uint32_t m = c & 7u;
  const float subnormal = static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  const float normal = AsFloat(((e + 120u) << 23) | (m << 20));
  float mag = e == 0 ? subnormal : normal;
  mag = (c & 0x7Fu) == 0x7Fu ? AsFloat(kNanBits) : mag;
  return AsFloat(AsBits(mag) | ((c & 0x80u) << 24));
}

// ---------------------------------------------------------------------------
// E2M1 (FP4) element codes.

// E2M1 magnitude codes count the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6. From 1 up, the grid is
// exactly the f32 values with one mantissa bit, so the code is the top bits of |y| (exponent
// and that bit) minus those of 1.0, plus 2; below 1 it is a multiple of 0.5.
// Comparisons are on the bits of non-negative values (same order as the values, NaN above
// inf): integer compares cannot trap, so the compiler if-converts and vectorizes them.
constexpr uint32_t kOneBits = 0x3F800000u;
constexpr uint32_t kOneTop = kOneBits >> 22;  // top 10 bits of 1.0f

NVFP4_HD uint32_t E2m1Saturate(uint32_t code, uint32_t abits) {
  code = code < 7u ? code : 7u;         // 6 and above (inf too) saturate to code 7
  return abits > kInfBits ? 0u : code;  // NaN gives code 0, as the reference does
}

// Round to nearest even, saturating at 6; bit 3 is the sign bit of y (-0 gives 0x8).
NVFP4_HD uint32_t E2m1Rn(float y) {
  const uint32_t bits = AsBits(y);
  const uint32_t abits = bits & kAbsMask;
  // Below 1: 0, 0.5 or 1 (edges 0.25 and 0.75; ties go to the even codes 0 and 2).
  const uint32_t small = (abits > 0x3E800000u ? 1u : 0u) + (abits >= 0x3F400000u ? 1u : 0u);
  // From 1 up: round away the mantissa below bit 22, ties to even.
  const uint32_t big = ((abits + 0x1FFFFFu + ((abits >> 22) & 1u)) >> 22) - kOneTop + 2u;
  const uint32_t code = E2m1Saturate(abits < kOneBits ? small : big, abits);
  return code | ((bits >> 28) & 8u);
}

// docs/NUMERICS.md section 7: t = |y| + u * step(|y|), then floor(t / step(t)) * step(t) clamped to
// 6, which is the largest grid value <= t: the same counting as above, truncating.
NVFP4_HD uint32_t E2m1Sr(float y, uint32_t random_byte) {
  const uint32_t bits = AsBits(y);
  const uint32_t abits = bits & kAbsMask;
  const float u = static_cast<float>(random_byte) * 0.00390625f;  // r / 256, exact
  const float step = abits < 0x40000000u ? 0.5f : (abits < 0x40800000u ? 1.0f : 2.0f);
  const uint32_t t = AsBits(AsFloat(abits) + u * step);  // u * step is exact: one rounding
  const uint32_t small = t >= 0x3F000000u ? 1u : 0u;     // t < 1: 0 or 0.5
  const uint32_t big = (t >> 22) - kOneTop + 2u;
  const uint32_t code = E2m1Saturate(t < kOneBits ? small : big, t);
  return code | ((bits >> 28) & 8u);
}

// Magnitude of an E2M1 code as f32 (the sign is bit 3).
NVFP4_HD float E2m1ToF32(uint32_t c) {
  const uint32_t m = c & 7u;
  // Codes >= 2 are normal: exponent (m >> 1) - 1, one mantissa bit (m & 1).
  const uint32_t normal = ((126u + (m >> 1)) << 23) | ((m & 1u) << 22);
  uint32_t bits = m < 2 ? (m == 1 ? 0x3F000000u : 0u) : normal;
  return AsFloat(bits | ((c & 8u) << 28));
}

// ---------------------------------------------------------------------------
// Scale math (docs/NUMERICS.md sections 2 and 3).

struct GlobalScale {
  float enc;       // S_enc
  float dec;       // S_dec = 1 / S_enc
  float enc_rcp6;  // S_enc * RCP6, multiplied first as the contract says
};

// six_m = 6M, the E4M3 max M of the global scale times 6: 2688 (M = 448) for plain NVFP4,
// 1536 (M = 256) or 2688 under Four Over Six (section 13).
NVFP4_HD GlobalScale MakeGlobalScale(float amax, float six_m = k2688) {
  float enc = MinNan(six_m / amax, kFltMax);
  enc = (amax == 0.0f || enc == 0.0f) ? 1.0f : enc;
  return GlobalScale{enc, 1.0f / enc, enc * AsFloat(kRcp6Bits)};
}

// E4M3 scale of a block whose max |x| is block_amax, clamped before the cast.
NVFP4_HD uint32_t BlockScale(float block_amax, const GlobalScale& g) {
  return F32ToE4m3(MinNan(block_amax * g.enc_rcp6, kE4m3Max));
}

// Per-block encode factor; a zero scale gives 1/0 = inf, hence FLT_MAX.
NVFP4_HD float BlockEncode(uint32_t scale, const GlobalScale& g) {
  return MinNan(1.0f / (E4m3ToF32(scale) * g.dec), kFltMax);
}

// D = A * RCP2688 (a multiplication: see docs/NUMERICS.md section 3); under Four Over Six
// with M = 256, A * f32(1/1536).
NVFP4_HD float DecodeGlobal(float amax, float six_m = k2688) {
  return amax * AsFloat(six_m == k2688 ? kRcp2688Bits : kRcp1536Bits);
}

// Whether a tensor amax A is usable: finite and not negative (-0 counts as 0).
NVFP4_HD bool AmaxValid(float amax) {
  const uint32_t bits = AsBits(amax);
  return bits < kInfBits || bits == 0x80000000u;
}

// Stored amax: A, or NaN when A is not valid or any input element is not finite
// (docs/NUMERICS.md section 8: then every scale is E4M3 NaN and every code 0).
NVFP4_HD float StoredAmax(float amax, bool input_finite) {
  return (AmaxValid(amax) && input_finite) ? amax : AsFloat(kNanBits);
}

// ---------------------------------------------------------------------------
// Four Over Six (docs/NUMERICS.md section 13): two candidate scales per block, its amax
// mapped to 6 and to 4; the block keeps the one whose reconstruction errs less.

enum FourOverSix : int { kPlain = 0, kMae = 1, kMse = 2 };

struct ScalePair {
  uint32_t s4;  // map-to-4
  uint32_t s6;  // map-to-6
};

// base = (block_amax / 6) * S_enc, a true division; s6 = e4m3(min(base, 448)),
// s4 = e4m3(min(base * 1.5, 448)) (448 even when M = 256).
NVFP4_HD ScalePair FourOverSixScales(float block_amax, const GlobalScale& g) {
  const float base = (block_amax / 6.0f) * g.enc;
  return ScalePair{F32ToE4m3(MinNan(base * 1.5f, kE4m3Max)), F32ToE4m3(MinNan(base, kE4m3Max))};
}

// The error term of one element: |d| (MAE) or d * d (MSE).
NVFP4_HD float ErrorTerm(float d, int mode) {
  return mode == kMse ? d * d : AsFloat(AsBits(d) & kAbsMask);
}

// The error of the 16 values v of a block under one candidate (scale, its encode factor
// enc): each v rounds to nearest, q = value(e2m1(v * enc)), is reconstructed as
// val = ((q * f32(scale)) * A) / (6M), and adds ErrorTerm(val - v) to a sum that starts at
// +0 and takes the elements in order.
NVFP4_HD float CandidateError(const float v[kBlock], uint32_t scale, float enc, float amax,
                              float six_m, int mode) {
  const float s = E4m3ToF32(scale);
  float err = 0.0f;
  NVFP4_UNROLL
  for (int i = 0; i < kBlock; ++i) {
    const float value = ((E2m1ToF32(E2m1Rn(v[i] * enc)) * s) * amax) / six_m;
    err = err + ErrorTerm(value - v[i], mode);
  }
  return err;
}

// The 2D tile error from its 16 rows' errors r[0..15]: a fixed tree of f32 additions.
NVFP4_HD float TileError(const float r[kBlock]) {
  float a[8];
  NVFP4_UNROLL
  for (int i = 0; i < 8; ++i) a[i] = r[i] + r[i + 8];
  NVFP4_UNROLL
  for (int i = 0; i < 4; ++i) a[i] = a[i] + a[i + 4];
  NVFP4_UNROLL
  for (int i = 0; i < 2; ++i) a[i] = a[i] + a[i + 2];
  return a[0] + a[1];
}

// ---------------------------------------------------------------------------
// Threefry2x32 with 20 rounds, as jax.extend.random.threefry_2x32.

NVFP4_HD uint32_t RotL(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// The home of threefry2x32's constants: its key schedule and the rotations of its 20 rounds,
// on words W of any kind (a uint32_t here; 16 lanes of u32 in the CPU kernels, which pass
// their vector ops). `add(x, k)` adds the key word k to every lane of x, `rotl(x, r)` rotates
// every lane left by r. The CPU kernels of SR (cpu/kernels_isa.cc) and of MS-EDEN
// (cpu/ms_eden_isa.cc) and Threefry2x32 below all run this one schedule.
template <class W, class Rotl>
NVFP4_HD void ThreefryRounds4(W& x0, W& x1, Rotl rotl, int r0, int r1, int r2, int r3) {
  x0 = x0 + x1, x1 = rotl(x1, r0) ^ x0;
  x0 = x0 + x1, x1 = rotl(x1, r1) ^ x0;
  x0 = x0 + x1, x1 = rotl(x1, r2) ^ x0;
  x0 = x0 + x1, x1 = rotl(x1, r3) ^ x0;
}

template <class W, class Add, class Rotl>
NVFP4_HD void Threefry2x32Schedule(uint32_t k0, uint32_t k1, W& x0, W& x1, Add add, Rotl rotl) {
  const uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
  x0 = add(x0, k0), x1 = add(x1, k1);
  ThreefryRounds4(x0, x1, rotl, 13, 15, 26, 6);
  x0 = add(x0, k1), x1 = add(x1, k2 + 1u);
  ThreefryRounds4(x0, x1, rotl, 17, 29, 16, 24);
  x0 = add(x0, k2), x1 = add(x1, k0 + 2u);
  ThreefryRounds4(x0, x1, rotl, 13, 15, 26, 6);
  x0 = add(x0, k0), x1 = add(x1, k1 + 3u);
  ThreefryRounds4(x0, x1, rotl, 17, 29, 16, 24);
  x0 = add(x0, k1), x1 = add(x1, k2 + 4u);
  ThreefryRounds4(x0, x1, rotl, 13, 15, 26, 6);
  x0 = add(x0, k2), x1 = add(x1, k0 + 5u);
}

// Threefry2x32 with 20 rounds of one pair of words, as jax.extend.random.threefry_2x32.
NVFP4_HD void Threefry2x32(uint32_t k0, uint32_t k1, uint32_t& x0, uint32_t& x1) {
  Threefry2x32Schedule(
      k0, k1, x0, x1, [](uint32_t x, uint32_t k) { return x + k; },
      [](uint32_t x, int r) { return RotL(x, r); });
}

// The 16 random bytes of the 16 elements starting at local flat index n0 (n0 % 16 == 0):
// counters c0 + n0/8 and c0 + n0/8 + 1, where c0 = `counter_offset` (the global element
// offset / 8 of a shard's first element, 0 for a whole tensor); element n takes byte n % 8
// of w0 | w1 << 32. Written as four little-endian words: word i holds the bytes of
// elements 4i..4i+3.
NVFP4_HD void RandomWords16(uint32_t k0, uint32_t k1, uint64_t counter_offset, int64_t n0,
                            uint32_t words[4]) {
  const uint64_t j = counter_offset + (static_cast<uint64_t>(n0) >> 3);
  NVFP4_UNROLL
  for (int h = 0; h < 2; ++h) {
    const uint64_t c = j + static_cast<uint64_t>(h);
    uint32_t x0 = static_cast<uint32_t>(c >> 32), x1 = static_cast<uint32_t>(c);
    Threefry2x32(k0, k1, x0, x1);
    words[2 * h] = x0;
    words[2 * h + 1] = x1;
  }
}

NVFP4_HD uint32_t RandomByte(const uint32_t words[4], int i) {
  return (words[i >> 2] >> (8 * (i & 3))) & 0xFFu;
}

// ---------------------------------------------------------------------------
// Random Hadamard Transform on 16 values (docs/NUMERICS.md section 5), butterflies in the fixed
// order h = 1, 2, 4, 8 so every implementation rounds identically.

NVFP4_HD void Fwht16(float v[kBlock]) {
  NVFP4_UNROLL
  for (int h = 1; h < kBlock; h <<= 1) {
    NVFP4_UNROLL
    for (int i = 0; i < kBlock; ++i) {
      if ((i & h) == 0) {  // compile-time after unrolling
        const float a = v[i], b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
    }
  }
}

// Multiplying by +-1 and by 0.25 is exact: flip sign bits, then scale.
NVFP4_HD void ApplySigns(float v[kBlock]) {
  NVFP4_UNROLL
  for (int i = 0; i < kBlock; ++i) {
    v[i] = AsFloat(AsBits(v[i]) ^ (((kRhtSignMask >> i) & 1u) << 31));
  }
}

NVFP4_HD void Rht16(float v[kBlock], bool inverse) {
  if (!inverse) ApplySigns(v);
  Fwht16(v);
  NVFP4_UNROLL
  for (int i = 0; i < kBlock; ++i) v[i] *= 0.25f;
  if (inverse) ApplySigns(v);
}

// ---------------------------------------------------------------------------
// One block of 16 f32 values -> 8 packed code bytes (element 2i low nibble, 2i+1 high).

NVFP4_HD uint32_t MaxAbsBits16(const float v[kBlock]) {
  uint32_t m = 0;
  NVFP4_SIMD_LOOP
  for (int i = 0; i < kBlock; ++i) {
    const uint32_t a = AsBits(v[i]) & kAbsMask;
    m = a > m ? a : m;  // unsigned order of |f32| bits is value order; NaN is above inf
  }
  return m;
}

NVFP4_HD void PackCodes16(const uint32_t c[kBlock], uint8_t out[kBlock / 2]) {
  NVFP4_UNROLL
  for (int i = 0; i < kBlock / 2; ++i) {
    out[i] = static_cast<uint8_t>(c[2 * i] | (c[2 * i + 1] << 4));
  }
}

NVFP4_HD void EncodeBlockRn(const float v[kBlock], float enc, uint8_t out[kBlock / 2]) {
  uint32_t c[kBlock];
  NVFP4_UNROLL
  for (int i = 0; i < kBlock; ++i) c[i] = E2m1Rn(v[i] * enc);
  PackCodes16(c, out);
}

NVFP4_HD void EncodeBlockSr(const float v[kBlock], float enc, const uint32_t words[4],
                            uint8_t out[kBlock / 2]) {
  uint32_t c[kBlock];
  NVFP4_UNROLL
  for (int i = 0; i < kBlock; ++i) c[i] = E2m1Sr(v[i] * enc, RandomByte(words, i));
  PackCodes16(c, out);
}

// Dequantized block: code value * block factor (factor = s_b * D, or s_b alone).
// Unpack first, then one flat loop: contiguous lanes vectorize, interleaved stores do not.
NVFP4_HD void DecodeBlock(const uint8_t codes[kBlock / 2], float factor, float out[kBlock]) {
  uint32_t c[kBlock];
  NVFP4_SIMD_LOOP
  for (int i = 0; i < kBlock / 2; ++i) {
    c[2 * i] = codes[i] & 0xFu;
    c[2 * i + 1] = codes[i] >> 4;
  }
  NVFP4_SIMD_LOOP
  for (int i = 0; i < kBlock; ++i) out[i] = E2m1ToF32(c[i]) * factor;
}

}  // namespace nvfp4

#endif  // NVFP4_NUMERICS_H_
