// CPU kernels over row ranges, compiled once per instruction set (NVFP4_ISA names it).
//
// The kernels work on groups of 16 consecutive blocks (256 elements), one block per
// 16-lane vector (cpu/simd.h): the maxima of the 16 blocks come out of one transposing
// reduction as one vector, so the scale math of docs/NUMERICS.md (E4M3 rounding, the
// division of the encode factor) runs once per group for 16 blocks at a time; then each
// block is encoded, packed and stored with vector instructions. 1x16 blocks are contiguous
// in memory whatever the row length, so a 1D kernel walks its rows as one flat run of
// blocks; only the last group of a range is partial (it runs on a zero-padded copy).
//
// Every vector function below is its scalar twin in numerics.h lane by lane: the same f32
// operations in the same order (no FMA contraction: -ffp-contract=off), the same integer
// bit arithmetic. The two exceptions are documented where they occur and give the same
// result for every input that reaches them.
//
// Everything here is in the per-ISA namespace or always-inline, and nothing from the
// standard library is used: an out-of-line copy of a shared inline function compiled
// with AVX-512 could otherwise be picked by the linker for every caller.
#include <cstdint>

#include "cpu/kernel_table.h"
#include "cpu/simd.h"
#include "nvfp4/dtypes.h"
#include "nvfp4/numerics.h"

#ifndef NVFP4_ISA
#error "compile with -DNVFP4_ISA=<namespace>"
#endif

namespace nvfp4::cpu::NVFP4_ISA {
namespace {

constexpr int kGroup = 16;  // blocks per group

// The loops over the 16 blocks of a group are unrolled where the vectors are wide (the
// blocks' values then stay in registers); at the baseline's width they would only bloat.
#if defined(NVFP4_SIMD_AVX512) || defined(NVFP4_SIMD_AVX2)
#define NVFP4_GROUP_UNROLL _Pragma("GCC unroll 16")
#else
#define NVFP4_GROUP_UNROLL _Pragma("GCC unroll 1")
#endif
constexpr int32_t kSignBit = INT32_MIN;

// ---------------------------------------------------------------------------
// Storage types <-> f32, 16 lanes (F32ToBf16, F32ToF16, F16ToF32 of numerics.h).

NVFP4_VINLINE VI F32ToBf16Bits(VF f) {
  const VI x = AsVI(f);
  const VI rounded = Srl(x + 0x7FFF + (Srl(x, 16) & 1), 16);
  const VI quiet_nan = Srl(x, 16) | 0x40;
  return Select((x & 0x7FFFFFFF) > int32_t{kInfBits}, quiet_nan, rounded);
}

NVFP4_VINLINE VI F32ToF16Bits(VF f) {
  const VI x = AsVI(f);
  const VI sign = Srl(x, 16) & 0x8000;
  const VI a = x & 0x7FFFFFFF;
  const VI huge = Select(a > int32_t{kInfBits}, SplatI(0x7E00), SplatI(0x7C00));
  const VI subnormal = AsVI(AsVF(a) + 0.5f) - 0x3F000000;
  const VI normal = Srl(a - int32_t{112 << 23} + 0xFFF + (Srl(a, 13) & 1), 13);
  VI h = Select(a < 0x38800000, subnormal, normal);
  h = Select(a >= 0x47800000, huge, h);
  return h | sign;
}

NVFP4_VINLINE VF F16BitsToF32(VI h) {
  const VI sign = (h & 0x8000) << 16;
  const VI em = h & 0x7FFF;
  const VI normal = (em << 13) + int32_t{112 << 23};
  const VI inf_nan = (em << 13) | int32_t{kInfBits};
  const VI subnormal = AsVI(ToF32(em) * 5.9604644775390625e-8f);
  VI bits = Select(em >= 0x7C00, inf_nan, normal);
  bits = Select(em < 0x400, subnormal, bits);
  return AsVF(bits | sign);
}

// Load, Store and Round (f32 -> T -> f32) of 16 elements of T.
template <class T>
struct VecIo;

template <>
struct VecIo<Bf16> {
  static NVFP4_VINLINE VF Load(const uint16_t* p) { return AsVF(WidenU16(p) << 16); }
  static NVFP4_VINLINE void Store(uint16_t* p, VF v) { NarrowStoreU16(p, F32ToBf16Bits(v)); }
  static NVFP4_VINLINE VF Round(VF v) { return AsVF(F32ToBf16Bits(v) << 16); }
};

template <>
struct VecIo<F16> {
  static NVFP4_VINLINE VF Load(const uint16_t* p) { return F16BitsToF32(WidenU16(p)); }
  static NVFP4_VINLINE void Store(uint16_t* p, VF v) { NarrowStoreU16(p, F32ToF16Bits(v)); }
  static NVFP4_VINLINE VF Round(VF v) { return F16BitsToF32(F32ToF16Bits(v)); }
};

template <>
struct VecIo<F32> {
  static NVFP4_VINLINE VF Load(const float* p) { return LoadV<VF>(p); }
  static NVFP4_VINLINE void Store(float* p, VF v) { StoreV(p, v); }
  static NVFP4_VINLINE VF Round(VF v) { return v; }
};

// ---------------------------------------------------------------------------
// RHT of one block (Rht16 of numerics.h). Stage h gives lane i, bit h of i clear,
// v[i] + v[i ^ h], and lane i, bit h set, v[i ^ h] - v[i]: the partner plus v, or plus -v
// (a + (-b) is a - b exactly in IEEE arithmetic, and a + b is b + a), the additions of the
// scalar butterflies on the same operands, so the same bits.

// Butterfly: simd.h.

NVFP4_VINLINE VF Rht16V(VF v, bool inverse) {
  VI sign_bits;
  for (int i = 0; i < 16; ++i) {
    sign_bits.p[i / kLanes][i % kLanes] = ((kRhtSignMask >> i) & 1u) ? kSignBit : 0;
  }
  if (!inverse) v = AsVF(AsVI(v) ^ sign_bits);
  v = Butterfly<8>(Butterfly<4>(Butterfly<2>(Butterfly<1>(v))));
  v = v * 0.25f;
  if (inverse) v = AsVF(AsVI(v) ^ sign_bits);
  return v;
}

// One block of T as f32, with the forward RHT rounded to T when kRht.
template <class T, bool kRht>
NVFP4_VINLINE VF LoadBlockV(const typename T::Storage* p) {
  VF v = VecIo<T>::Load(p);
  if (kRht) v = VecIo<T>::Round(Rht16V(v, /*inverse=*/false));
  return v;
}

// ---------------------------------------------------------------------------
// Pairs of blocks. Two consecutive blocks A, B are held as two vectors E and O: lanes 0-7
// of E are A's even elements (0, 2, ..., 14), lanes 8-15 B's; O holds the odd ones. For
// 16-bit types that is what a shift and a mask of 32 loaded elements give; packed codes
// are then E's code | O's code << 4, byte by byte, and stored values one shift and OR.

// (a, b) the 32 elements in order -> (e, o); and back.
NVFP4_VINLINE void Deinterleave(const VF& a, const VF& b, VF& e, VF& o) {
  NF src[2 * kParts];
  for (int j = 0; j < kParts; ++j) src[j] = a.p[j], src[kParts + j] = b.p[j];
  for (int j = 0; j < kParts; ++j) {
    e.p[j] = __builtin_shuffle(src[2 * j], src[2 * j + 1], kNativeIota * 2);
    o.p[j] = __builtin_shuffle(src[2 * j], src[2 * j + 1], kNativeIota * 2 + 1);
  }
}

NVFP4_VINLINE void Interleave(const VF& e, const VF& o, VF& a, VF& b) {
  const NI first = kNativeIota / 2 + (kNativeIota % 2) * kLanes;
  const NI second = first + kLanes / 2;
  NF dst[2 * kParts];
  for (int j = 0; j < kParts; ++j) {
    dst[2 * j] = __builtin_shuffle(e.p[j], o.p[j], first);
    dst[2 * j + 1] = __builtin_shuffle(e.p[j], o.p[j], second);
  }
  for (int j = 0; j < kParts; ++j) a.p[j] = dst[j], b.p[j] = dst[kParts + j];
}

// Load, Round (f32 -> T -> f32) and Store of a pair of T. StoreFinite may assume finite
// values (it skips the quiet-NaN select of the bf16 rounding).
template <class T>
struct PairIo;

template <>
struct PairIo<Bf16> {
  static NVFP4_VINLINE void Load(const uint16_t* p, VF& e, VF& o) {
    const VI x = LoadV<VI>(p);
    e = AsVF(x << 16);
    o = AsVF(x & int32_t(0xFFFF0000u));
  }
  // RoundTo<Bf16> of the RHT of bf16 input, kept in f32: the rounding add and a mask. The
  // quiet-NaN select of F32ToBf16 is not needed: a NaN here comes from bf16 input (low 16
  // bits zero) through additions, which pass such a payload on or make the default NaN
  // (low bits zero too), so the add cannot carry out of them and the NaN stays a NaN.
  // Finite values and infinities round exactly as F32ToBf16 does.
  static NVFP4_VINLINE VF Round(VF v) {
    const VI x = AsVI(v);
    return AsVF((x + 0x7FFF + (Srl(x, 16) & 1)) & int32_t(0xFFFF0000u));
  }
  static NVFP4_VINLINE void Store(uint16_t* p, VF e, VF o) {
    StoreV(p, F32ToBf16Bits(e) | (F32ToBf16Bits(o) << 16));
  }
  static NVFP4_VINLINE void StoreFinite(uint16_t* p, VF e, VF o) {
    const VI x = AsVI(e), y = AsVI(o);
    const VI re = x + 0x7FFF + (Srl(x, 16) & 1), ro = y + 0x7FFF + (Srl(y, 16) & 1);
    StoreV(p, Srl(re, 16) | (ro & int32_t(0xFFFF0000u)));
  }
};

template <>
struct PairIo<F16> {
  static NVFP4_VINLINE void Load(const uint16_t* p, VF& e, VF& o) {
    const VI x = LoadV<VI>(p);
    e = F16BitsToF32(x & 0xFFFF);
    o = F16BitsToF32(Srl(x, 16));
  }
  static NVFP4_VINLINE VF Round(VF v) { return VecIo<F16>::Round(v); }
  static NVFP4_VINLINE void Store(uint16_t* p, VF e, VF o) {
    StoreV(p, F32ToF16Bits(e) | (F32ToF16Bits(o) << 16));
  }
  static NVFP4_VINLINE void StoreFinite(uint16_t* p, VF e, VF o) { Store(p, e, o); }
};

template <>
struct PairIo<F32> {
  static NVFP4_VINLINE void Load(const float* p, VF& e, VF& o) {
    Deinterleave(LoadV<VF>(p), LoadV<VF>(p + 16), e, o);
  }
  static NVFP4_VINLINE VF Round(VF v) { return v; }
  static NVFP4_VINLINE void Store(float* p, VF e, VF o) {
    VF a, b;
    Interleave(e, o, a, b);
    StoreV(p, a);
    StoreV(p + 16, b);
  }
  static NVFP4_VINLINE void StoreFinite(float* p, VF e, VF o) { Store(p, e, o); }
};

// The RHT of both blocks of a pair (Rht16 of numerics.h): its stage h = 1 adds and
// subtracts E and O; stages h = 2, 4, 8 pair lanes l and l ^ h/2 within E and within O.
NVFP4_VINLINE void RhtPair(VF& e, VF& o, bool inverse) {
  VI se, so;  // the sign bits of the even and the odd elements
  for (int i = 0; i < 16; ++i) {
    const int l = i % 8;
    se.p[i / kLanes][i % kLanes] = ((kRhtSignMask >> (2 * l)) & 1u) ? kSignBit : 0;
    so.p[i / kLanes][i % kLanes] = ((kRhtSignMask >> (2 * l + 1)) & 1u) ? kSignBit : 0;
  }
  if (!inverse) e = AsVF(AsVI(e) ^ se), o = AsVF(AsVI(o) ^ so);
  const VF sum = e + o, diff = e - o;
  e = Butterfly<4>(Butterfly<2>(Butterfly<1>(sum))) * 0.25f;
  o = Butterfly<4>(Butterfly<2>(Butterfly<1>(diff))) * 0.25f;
  if (inverse) e = AsVF(AsVI(e) ^ se), o = AsVF(AsVI(o) ^ so);
}

// A pair of T as f32 (E, O), with the forward RHT rounded to T when kRht.
template <class T, bool kRht>
NVFP4_VINLINE void LoadPair(const typename T::Storage* p, VF& e, VF& o) {
  PairIo<T>::Load(p, e, o);
  if (kRht) {
    RhtPair(e, o, /*inverse=*/false);
    e = PairIo<T>::Round(e);
    o = PairIo<T>::Round(o);
  }
}

// Lanes 0-7 <- lane 2p of v, lanes 8-15 <- lane 2p + 1 (a block value for both halves).
NVFP4_VINLINE VF PairBroadcast(const VF& v, int p) {
  VF r;
  if constexpr (kParts == 1) {
    r.p[0] = __builtin_shuffle(v.p[0], (kNativeIota >> 3) + 2 * p);
  } else {
    for (int j = 0; j < kParts; ++j) {
      const int lane = 2 * p + (j * kLanes >= 8 ? 1 : 0);
      r.p[j] = __builtin_shuffle(v.p[lane / kLanes], NI{} + lane % kLanes);
    }
  }
  return r;
}

// ---------------------------------------------------------------------------
// Block maxima of a group: each block's lanes are folded into one native vector of partial
// maxima; then each level merges pairs of vectors into one that holds half as many partial
// maxima of twice as many blocks, in block order, down to one lane per block.

NVFP4_VINLINE NI MaxN(NI a, NI b) { return a > b ? a : b; }

// x and y hold blocks of P partial maxima each (kLanes / P blocks); the result holds
// x's blocks then y's, P / 2 partials each.
template <int P>
NVFP4_VINLINE NI MergeLevel(NI x, NI y) {
  constexpr int kBlocks = kLanes / P;
  const NI out_block = kNativeIota / (P / 2), within = kNativeIota % (P / 2);
  const NI first = (out_block % kBlocks) * P + within + (out_block / kBlocks) * kLanes;
  return MaxN(__builtin_shuffle(x, y, first), __builtin_shuffle(x, y, first + P / 2));
}

template <int P>
NVFP4_VINLINE void MergeAll(NI* m, int n) {
  if constexpr (P > 1) {
    for (int j = 0; j < n / 2; ++j) m[j] = MergeLevel<P>(m[2 * j], m[2 * j + 1]);
    MergeAll<P / 2>(m, n / 2);
  }
}

// Max |x| bits of a pair's two halves, lane by lane.
NVFP4_VINLINE VI PairAbsMax(VF e, VF o) {
  return MaxI(AsVI(e) & 0x7FFFFFFF, AsVI(o) & 0x7FFFFFFF);
}

// The block maxima (|x| bits) of the 16 blocks of 8 pairs, pair_max(p) giving pair p's
// PairAbsMax (a function, not an array: at the baseline's width GCC kept the array's copies).
template <class PairMaxFn>
NVFP4_VINLINE VI MergePairMaxima(PairMaxFn pair_max) {
  NI m[16];
  int n = 0;
  for (int p = 0; p < 8; ++p) {
    const VI a = pair_max(p);
    if constexpr (kLanes == 16) {
      m[n++] = a.p[0];  // two blocks of 8 partial maxima
    } else {
      constexpr int kPerBlock = 8 / kLanes;  // parts per block
      for (int h = 0; h < 2; ++h) {
        NI b = a.p[h * kPerBlock];
        for (int j = 1; j < kPerBlock; ++j) b = MaxN(b, a.p[h * kPerBlock + j]);
        m[n++] = b;
      }
    }
  }
  MergeAll<kLanes == 16 ? 8 : kLanes>(m, n);
  VI r;
  for (int j = 0; j < kParts; ++j) r.p[j] = m[j];
  return r;
}

// The block maxima (|x| bits) of the 16 blocks of 8 pairs.
NVFP4_VINLINE VI PairMax16(const VF e[8], const VF o[8]) {
  return MergePairMaxima([&](int p) { return PairAbsMax(e[p], o[p]); });
}

NVFP4_VINLINE uint32_t HorizontalMax(VI v) {
  int32_t m = 0;
  for (int i = 0; i < 16; ++i) m = Lane(v, i) > m ? Lane(v, i) : m;
  return static_cast<uint32_t>(m);
}

// ---------------------------------------------------------------------------
// Scales of 16 blocks at once (BlockScale, BlockEncode, F32ToE4m3, E4m3ToF32).

NVFP4_VINLINE VF MinNanV(VF a, float b) { return Select((a < b) | (a != a), a, SplatF(b)); }

NVFP4_VINLINE VI F32ToE4m3V(VF v) {
  const VI subnormal = AsVI(v + 16384.0f) - 0x46800000;
  const VI x = AsVI(v);
  const VI normal = Srl(x + 0x7FFFF + (Srl(x, 20) & 1), 20) - int32_t{120 << 3};
  const VI code = Select(v < 0.015625f, subnormal, normal);
  return Select(v != v, SplatI(kE4m3Nan), code);
}

NVFP4_VINLINE VF E4m3ToF32V(VI c) {
  const VI e = Srl(c, 3) & 0xF;
  const VI m = c & 7;
  const VI subnormal = AsVI(ToF32(m) * 0.001953125f);
  const VI normal = ((e + 120) << 23) | (m << 20);
  VI mag = Select(e == 0, subnormal, normal);
  mag = Select((c & 0x7F) == 0x7F, SplatI(kNanBits), mag);
  return AsVF(mag | ((c & 0x80) << 24));
}

// Block amax (as f32) -> E4M3 scale codes.
NVFP4_VINLINE VI BlockScalesV(VF block_amax, const GlobalScale& g) {
  return F32ToE4m3V(MinNanV(block_amax * g.enc_rcp6, kE4m3Max));
}

// Scale codes -> encode factors min(1 / (f32(s) * S_dec), FLT_MAX).
NVFP4_VINLINE VF BlockEncodeV(VI scale, const GlobalScale& g) {
  return MinNanV(1.0f / (E4m3ToF32V(scale) * g.dec), kFltMax);
}

// ---------------------------------------------------------------------------
// E2M1 codes of 16 values (E2m1Rn, E2m1Sr).
//
// Neither gives code 0 for a NaN y as the scalar functions do: y = x * enc is NaN only
// when x is, and then the handler replaces every code of the tensor (section 8).

// Below 2 the E2M1 grid is the multiples of 0.5, whose codes count them: the f32 adder
// rounds |y| + 2^22 to a multiple of 0.5 (ties to even), and its low bits are the code.
// On [1, 2) this is what the scalar function's rounding of the mantissa gives, which runs
// here from 2 up.
//
// Both clamp |y| to 6 first (code 7, as every larger |y| gets), so no code exceeds 7.
NVFP4_VINLINE VI E2m1RnV(VF y) {
  const VI bits = AsVI(y);
  const VI a = MinI(bits & 0x7FFFFFFF, SplatI(0x40C00000));
  const VI small = AsVI(AsVF(a) + 4194304.0f) - 0x4A800000;
  const VI big = Srl(a + 0x1FFFFF + (Srl(a, 22) & 1), 22) - int32_t{kOneTop - 2u};
  return Select(a < 0x40000000, small, big) | (Srl(bits, 28) & 8);
}

NVFP4_VINLINE VI E2m1SrV(VF y, VI random_bytes) {
  const VI bits = AsVI(y);
  const VI a = MinI(bits & 0x7FFFFFFF, SplatI(0x40C00000));
  const VF u = ToF32(random_bytes) * 0.00390625f;
  VF step = Select(a < 0x40800000, SplatF(1.0f), SplatF(2.0f));
  step = Select(a < 0x40000000, SplatF(0.5f), step);
  const VI t = AsVI(AsVF(a) + u * step);
  const VI small = -(t >= 0x3F000000);
  const VI big = Srl(t, 22) - int32_t{kOneTop - 2u};
  return Select(t < int32_t{kOneBits}, small, big) | (Srl(bits, 28) & 8);
}

// E2m1Value(E2m1RnV(y)) without the code: |y| rounded to the E2M1 grid by the f32 adder,
// |y| + M - M with M = 2^22 below 2 (spacing 0.5), 2^23 on [2, 4) (spacing 1) and 2^24
// from 4 up (spacing 2): ties to even multiples of the spacing, which are the even codes;
// then 6 at most, and y's sign. M's exponent is that of |y| clamped to [1, 4], plus 22.
NVFP4_VINLINE VF E2m1RoundedRnV(VF y) {
  const VI bits = AsVI(y);
  const VI a = bits & 0x7FFFFFFF;
  const VI clamped = MinI(MaxI(a, SplatI(0x3F800000)), SplatI(0x40800000));
  const VF magic = AsVF((clamped & int32_t{kInfBits}) + int32_t{22 << 23});
  VF q = (AsVF(a) + magic) - magic;
  q = MinF(q, SplatF(6.0f));
  return AsVF(AsVI(q) | (bits & kSignBit));
}

// ---------------------------------------------------------------------------
// Four Over Six (FourOverSixScales, CandidateError, ErrorTerm of numerics.h), one block per
// lane. A block's error is a sum over its elements in order, so the group is first turned
// into 16 vectors whose lane b holds element k of block b: each sum is then lane-parallel.

struct CandidatesV {
  VI s4, s6;      // map-to-4 and map-to-6 scale codes
  VF enc4, enc6;  // their encode factors
};

NVFP4_VINLINE CandidatesV FourOverSixScalesV(VF block_amax, const GlobalScale& g) {
  const VF base = (block_amax / 6.0f) * g.enc;  // a true division, as the scalar twin
  CandidatesV c;
  c.s4 = F32ToE4m3V(MinNanV(base * 1.5f, kE4m3Max));
  c.s6 = F32ToE4m3V(MinNanV(base, kE4m3Max));
  c.enc4 = BlockEncodeV(c.s4, g);
  c.enc6 = BlockEncodeV(c.s6, g);
  return c;
}

// t[k] lane b = element k of block b. Pair p's E holds the even elements of blocks 2p
// (lanes 0-7) and 2p + 1 (lanes 8-15), its O the odd ones.
#if defined(NVFP4_SIMD_AVX512)
// Element (p, h, j) = lane 8h + j of x[p] goes to lane 2p + h of out[j]: three rounds of
// two-source lane permutes, round s trading bit s of the vector index (p's) for bit s of the
// lane (j's); the last round also moves the lane bits into the order (p, h).
NVFP4_VINLINE void TransposeHalf(const VF* x, VF* out) {
  alignas(64) static constexpr int32_t kIndex[3][2][16] = {
      {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
       {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}},
      {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
       {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}},
      {{0, 8, 1, 9, 2, 10, 3, 11, 16, 24, 17, 25, 18, 26, 19, 27},
       {4, 12, 5, 13, 6, 14, 7, 15, 20, 28, 21, 29, 22, 30, 23, 31}}};
  __m512 v[8];
  for (int i = 0; i < 8; ++i) v[i] = (__m512)x[i].p[0];
  for (int s = 0; s < 3; ++s) {
    const __m512i lo = _mm512_load_si512(kIndex[s][0]);
    const __m512i hi = _mm512_load_si512(kIndex[s][1]);
    __m512 w[8];
    for (int a = 0; a < 8; ++a) {
      if ((a >> s) & 1) continue;
      const int b = a | (1 << s);
      w[a] = _mm512_permutex2var_ps(v[a], lo, v[b]);
      w[b] = _mm512_permutex2var_ps(v[a], hi, v[b]);
    }
    for (int i = 0; i < 8; ++i) v[i] = w[i];
  }
  for (int j = 0; j < 8; ++j) out[j].p[0] = (NF)v[j];
}

NVFP4_VINLINE void TransposeGroup(const VF* e, const VF* o, VF t[16]) {
  VF even[8], odd[8];
  TransposeHalf(e, even);
  TransposeHalf(o, odd);
  for (int j = 0; j < 8; ++j) {
    t[2 * j] = even[j];
    t[2 * j + 1] = odd[j];
  }
}
#elif defined(NVFP4_SIMD_AVX2)
// out[c] lane r = in[r] lane c: the 8x8 transpose in three rounds of in-lane unpacks and
// shuffles and one of 128-bit half swaps.
NVFP4_VINLINE void Transpose8x8(const __m256 in[8], __m256 out[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // rows 4i..4i+3: columns 0, 1, 2, 3 of each 128-bit half
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    out[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    out[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// Part h of pair p's vector holds block 2p + h's eight even (e) or odd (o) elements: two 8x8
// transposes per parity, blocks 0-7 into part 0 of t[k], blocks 8-15 into part 1.
NVFP4_VINLINE void TransposeGroup(const VF* e, const VF* o, VF t[16]) {
  for (int parity = 0; parity < 2; ++parity) {
    const VF* x = parity ? o : e;
    for (int half = 0; half < 2; ++half) {
      __m256 in[8], out[8];
      for (int r = 0; r < 8; ++r) {
        const int b = 8 * half + r;
        in[r] = (__m256)x[b >> 1].p[b & 1];
      }
      Transpose8x8(in, out);
      for (int j = 0; j < 8; ++j) t[2 * j + parity].p[half] = (NF)out[j];
    }
  }
}
#else
NVFP4_VINLINE void TransposeGroup(const VF* e, const VF* o, VF t[16]) {
  float even[8 * 16], odd[8 * 16];
  for (int p = 0; p < 8; ++p) {
    StoreV(even + 16 * p, e[p]);
    StoreV(odd + 16 * p, o[p]);
  }
  for (int k = 0; k < 16; ++k) {
    const float* src = (k & 1) ? odd : even;
    for (int b = 0; b < 16; ++b) {
      t[k].p[b / kLanes][b % kLanes] = src[16 * (b >> 1) + 8 * (b & 1) + (k >> 1)];
    }
  }
}
#endif

// Each lane's block errors under both candidates: CandidateError lane by lane, for map-to-4
// and map-to-6 in one loop. Each error is still its own sum over k in order (the contract's);
// the two independent chains interleave, so the adder's latency is paid once for both.
template <bool kMseMode>
NVFP4_VINLINE void CandidateErrorsV(const QuantizeJob& job, const VF t[16], const CandidatesV& c,
                                    VF& err4, VF& err6) {
  const VF s4 = E4m3ToF32V(c.s4), s6 = E4m3ToF32V(c.s6);
  VF e4 = SplatF(0.0f), e6 = SplatF(0.0f);
  for (int k = 0; k < 16; ++k) {
    // E2m1RoundedRnV is E2m1Value(E2m1RnV(.)) in fewer instructions (no code, no lookup).
    const VF d4 = ((E2m1RoundedRnV(t[k] * c.enc4) * s4) * job.amax) / job.six_m - t[k];
    const VF d6 = ((E2m1RoundedRnV(t[k] * c.enc6) * s6) * job.amax) / job.six_m - t[k];
    if constexpr (kMseMode) {
      e4 = e4 + d4 * d4;
      e6 = e6 + d6 * d6;
    } else {
      e4 = e4 + AsVF(AsVI(d4) & 0x7FFFFFFF);
      e6 = e6 + AsVF(AsVI(d6) & 0x7FFFFFFF);
    }
  }
  err4 = e4;
  err6 = e6;
}

NVFP4_VINLINE void CandidateErrorsV(const QuantizeJob& job, const VF t[16], const CandidatesV& c,
                                    VF& err4, VF& err6) {
  if (job.four_over_six == kMse) {
    CandidateErrorsV<true>(job, t, c, err4, err6);
  } else {
    CandidateErrorsV<false>(job, t, c, err4, err6);
  }
}

// The scales and encode factors Four Over Six chooses for the 16 blocks of a group (e, o)
// whose maxima (or tile maxima) are `block_amax`: map-to-4 where `pick` says so (the 2D tile
// decisions, a lane mask), or, with pick null, where its error is strictly smaller.
__attribute__((noinline)) void ChooseFourOverSix(const QuantizeJob& job, const VF* e, const VF* o,
                                                 const VF& block_amax, const VI* pick, VI& scale,
                                                 VF& enc) {
  const CandidatesV c = FourOverSixScalesV(block_amax, job.g);
  VI pick4;
  if (pick) {
    pick4 = *pick;
  } else {
    VF t[16];
    TransposeGroup(e, o, t);
    VF err4, err6;
    CandidateErrorsV(job, t, c, err4, err6);
    pick4 = err4 < err6;
  }
  scale = Select(pick4, c.s4, c.s6);
  enc = Select(pick4, c.enc4, c.enc6);
}

// ---------------------------------------------------------------------------
// Threefry2x32 of 16 counters at once, and the SR random bytes of a group.

NVFP4_VINLINE void Threefry16(uint32_t k0, uint32_t k1, VI& x0, VI& x1) {
  Threefry2x32Schedule(
      k0, k1, x0, x1, [](VI x, uint32_t k) { return x + static_cast<int32_t>(k); },
      [](VI x, int r) { return RotL(x, r); });
}

// The random words of the 16 blocks from flat block index block0 (RandomWords16 of each):
// block k's 16 bytes are words 4k..4k+3 (counters 2 * block + 0 and 1, each w0 then w1).
NVFP4_VINLINE void GroupRandomWords(const QuantizeJob& job, int64_t block0, uint32_t words[64]) {
  const uint64_t j0 = job.counter_offset + 2 * static_cast<uint64_t>(block0);
  const VI lo0 = SplatI(static_cast<int32_t>(static_cast<uint32_t>(j0)));
  const VI hi0 = SplatI(static_cast<int32_t>(static_cast<uint32_t>(j0 >> 32)));
  // Interleaving masks: (x0[c], x1[c]) pairs of the first and second half of a part.
  const NI first = kNativeIota / 2 + (kNativeIota % 2) * kLanes;
  const NI second = first + kLanes / 2;
  for (int h = 0; h < 2; ++h) {
    const VI lo = lo0 + (Iota() + 16 * h);
    VI x0 = hi0 - LtU(lo, lo0), x1 = lo;  // a wrapped low word carries into the high one
    Threefry16(job.k0, job.k1, x0, x1);
    for (int j = 0; j < kParts; ++j) {
      uint32_t* out = words + 32 * h + 2 * kLanes * j;
      StoreV(out, __builtin_shuffle(x0.p[j], x1.p[j], first));
      StoreV(out + kLanes, __builtin_shuffle(x0.p[j], x1.p[j], second));
    }
  }
}

// ---------------------------------------------------------------------------
// Quantizing a group of 16 blocks (8 pairs): where its results go. Pair(p, ...) gets the
// scaled values y = x * enc of pair p (and, with SR, their random bytes).

// Packed codes and scales (quantize).
struct CodeSink {
  uint8_t* codes;   // 16 blocks x 8 bytes
  uint8_t* scales;  // 16 bytes

  static CodeSink At(const QuantizeJob& job, int64_t block0) {
    return {job.codes + 8 * block0, job.scales + block0};
  }
  NVFP4_VINLINE void Scales(const QuantizeJob&, VI scale) { NarrowStoreU8(scales, scale); }
  template <bool kSr>
  NVFP4_VINLINE void Pair(int p, VF ye, VF yo, VI re, VI ro) {
    const VI ce = kSr ? E2m1SrV(ye, re) : E2m1RnV(ye);
    const VI co = kSr ? E2m1SrV(yo, ro) : E2m1RnV(yo);
    NarrowStoreU8(codes + 16 * p, ce | (co << 4));
  }

  // Outputs of a partial group, copied out by Flush.
  struct Local {
    uint8_t codes[8 * kGroup];
    uint8_t scales[kGroup];
    CodeSink Sink() { return {codes, scales}; }
    void Flush(const QuantizeJob& job, int64_t block0, int n) const {
      __builtin_memcpy(job.codes + 8 * block0, codes, 8 * n);
      __builtin_memcpy(job.scales + block0, scales, n);
    }
  };
};

// Dequantized values in dtype U (fake quantize): value(code) * factor, the factor
// f32(s_b) * D, or f32(s_b) alone. For finite input every value is finite (|value| <= A),
// and non-finite input has the handler overwrite them all.
template <class U>
struct ValueSink {
  using S = typename U::Storage;
  S* values;  // 16 blocks x 16
  VF factor;

  static ValueSink At(const QuantizeJob& job, int64_t block0) {
    return {static_cast<S*>(job.values) + kBlock * block0, {}};
  }
  NVFP4_VINLINE void Scales(const QuantizeJob& job, VI scale) {
    const VF s = E4m3ToF32V(scale);
    factor = job.use_global ? s * job.global : s;
  }
  template <bool kSr>
  NVFP4_VINLINE void Pair(int p, VF ye, VF yo, VI re, VI ro) {
    const VF f = PairBroadcast(factor, p);
    const VF qe = kSr ? E2m1Value(E2m1SrV(ye, re)) : E2m1RoundedRnV(ye);
    const VF qo = kSr ? E2m1Value(E2m1SrV(yo, ro)) : E2m1RoundedRnV(yo);
    PairIo<U>::StoreFinite(values + 2 * kBlock * p, qe * f, qo * f);
  }

  struct Local {
    S values[kBlock * kGroup];
    ValueSink Sink() { return {values, {}}; }
    void Flush(const QuantizeJob& job, int64_t block0, int n) const {
      __builtin_memcpy(static_cast<S*>(job.values) + kBlock * block0, values,
                       sizeof(S) * kBlock * n);
    }
  };
};

// The n < 16 blocks at x, zero-padded to a group in buf.
template <class S>
const S* PadGroup(const S* x, int n, S* buf) {
  __builtin_memcpy(buf, x, sizeof(S) * kBlock * n);
  __builtin_memset(buf + kBlock * n, 0, sizeof(S) * kBlock * (kGroup - n));
  return buf;
}

// The 8 pairs of the group at x, as (E, O).
template <class T, bool kRht>
NVFP4_VINLINE void LoadGroup(const typename T::Storage* x, VF e[8], VF o[8]) {
  NVFP4_GROUP_UNROLL
  for (int p = 0; p < 8; ++p) LoadPair<T, kRht>(x + 2 * kBlock * p, e[p], o[p]);
}

// Max |x| bits of each of the 16 blocks at x (post-RHT when kRht).
template <class T, bool kRht>
__attribute__((noinline)) VI GroupAmaxBits(const typename T::Storage* x) {
  VF e[8], o[8];
  LoadGroup<T, kRht>(x, e, o);
  return PairMax16(e, o);
}

// Quantizes the 16 blocks at x (flat block index block0) with the block maxima `amax`
// (16x16 tiles), or their own when amax is null; returns their own maxima (or 0). Under
// Four Over Six, `pick` holds the 2D tiles' decisions (null: each block decides).
template <class T, bool kRht, bool kSr, class Sink>
__attribute__((noinline)) VI QuantizeGroup(const QuantizeJob& job, const typename T::Storage* x,
                                           int64_t block0, const VI* amax, const VI* pick,
                                           Sink& out) {
  Sink sink = out;  // a local copy: its pointers cannot alias the stores
  // Without the RHT a pair is loaded again from L1 for each pass (a load and two bit ops)
  // rather than held where the group's 16 vectors outnumber the registers (32 ymm on AVX2,
  // twice its 16; 64 xmm on the baseline): keeping them took 64 stack stores per group on
  // AVX2, more than the group's own 32 stores (the fake quantize of bf16 at 4096^2 on one
  // Zen 3 core: 9.0 -> 8.2 ms). AVX-512's 32 zmm hold the group (16 zmm).
  constexpr bool kReload = !kRht && kParts > 1;
  VF e[8], o[8];
  VI own = SplatI(0);
  if constexpr (kReload) {
    if (!amax) {
      own = MergePairMaxima([&](int p) {
        VF pe, po;
        LoadPair<T, false>(x + 2 * kBlock * p, pe, po);
        return PairAbsMax(pe, po);
      });
    }
  } else {
    LoadGroup<T, kRht>(x, e, o);
    if (!amax) own = PairMax16(e, o);
    // The RHT's values stay in memory (L1) between the passes where they outnumber the
    // registers: without this barrier GCC keeps each of AVX2's 32 ymm in registers and
    // spills it, up to three stores apiece (RHT quantize 12.0 -> 11.7 ms, one Zen 3 core).
    if constexpr (kParts > 1) __asm__ volatile("" : : "r"(e), "r"(o) : "memory");
  }
  VI scale;
  VF enc;
  if (job.four_over_six == kPlain) {
    scale = BlockScalesV(AsVF(amax ? *amax : own), job.g);
    enc = BlockEncodeV(scale, job.g);
  } else {
    if constexpr (kReload) LoadGroup<T, false>(x, e, o);
    ChooseFourOverSix(job, e, o, AsVF(amax ? *amax : own), pick, scale, enc);
  }
  sink.Scales(job, scale);
  uint32_t words[4 * kGroup];
  if (kSr) GroupRandomWords(job, block0, words);
  NVFP4_GROUP_UNROLL
  for (int p = 0; p < 8; ++p) {
    const VF f = PairBroadcast(enc, p);
    VI re{}, ro{};
    if (kSr) {
      // Pair p's 32 random bytes: 16-bit word l holds those of elements 2l and 2l + 1.
      const VI w = WidenU16(words + 8 * p);
      re = w & 0xFF;
      ro = Srl(w, 8);
    }
    VF pe = e[p], po = o[p];
    if constexpr (kReload) LoadPair<T, false>(x + 2 * kBlock * p, pe, po);
    sink.template Pair<kSr>(p, pe * f, po * f, re, ro);
  }
  return own;
}

// Quantizes the group of n <= 16 blocks at x: in place, or through padded copies.
template <class T, bool kRht, bool kSr, class Sink>
NVFP4_VINLINE VI QuantizeSome(const QuantizeJob& job, const typename T::Storage* x, int64_t block0,
                              int n, const VI* amax, const VI* pick) {
  if (n == kGroup) {
    Sink sink = Sink::At(job, block0);
    return QuantizeGroup<T, kRht, kSr>(job, x, block0, amax, pick, sink);
  }
  typename T::Storage padded[kBlock * kGroup];
  typename Sink::Local local;
  Sink sink = local.Sink();
  const VI own =
      QuantizeGroup<T, kRht, kSr>(job, PadGroup(x, n, padded), block0, amax, pick, sink);
  local.Flush(job, block0, n);
  return own;
}

// The values per_column[c] of the 16 blocks from flat block index c0 of a row of `blocks`
// block columns (wrapping to the next row), one per lane.
NVFP4_VINLINE VI ColumnVector(const uint32_t* per_column, int64_t blocks, int64_t c0) {
  uint32_t lanes[kGroup];
  if (blocks % kGroup == 0) {
    __builtin_memcpy(lanes, per_column + c0, sizeof(lanes));
  } else {
    for (int k = 0, c = static_cast<int>(c0); k < kGroup; ++k, c = c + 1 == blocks ? 0 : c + 1) {
      lanes[k] = per_column[c];
    }
  }
  return LoadV<VI>(lanes);
}

// Four Over Six on 16x16 tiles: both candidates' errors of the 16 blocks at x (tile maxima
// `amax`), written as f32 bits to err4[0..15] and err6[0..15].
template <class T, bool kRht>
__attribute__((noinline)) void GroupErrors(const QuantizeJob& job, const typename T::Storage* x,
                                           const VI& amax, uint32_t* err4, uint32_t* err6) {
  VF e[8], o[8];
  LoadGroup<T, kRht>(x, e, o);
  const CandidatesV c = FourOverSixScalesV(AsVF(amax), job.g);
  VF t[16];
  TransposeGroup(e, o, t);
  VF e4, e6;
  CandidateErrorsV(job, t, c, e4, e6);
  StoreV(err4, e4);
  StoreV(err6, e6);
}

// The Four Over Six decision of each tile of a 16-row item (`count` = 16 * blocks blocks at
// x, tile maxima per block column in tile_max): picks[c] all ones where block column c's
// tile takes map-to-4. Its rows' errors go to err4 and err6 (count words each), and each
// tile's are summed by TileError, row 0 first.
template <class T, bool kRht>
void TilePicks(const QuantizeJob& job, const typename T::Storage* x, int64_t blocks,
               const uint32_t* tile_max, uint32_t* err4, uint32_t* err6, uint32_t* picks) {
  const int64_t count = kBlock * blocks;
  for (int64_t g = 0, c0 = 0; g < count; g += kGroup, c0 = (c0 + kGroup) % blocks) {
    GroupErrors<T, kRht>(job, x + kBlock * g, ColumnVector(tile_max, blocks, c0), err4 + g,
                         err6 + g);
  }
  for (int64_t c = 0; c < blocks; ++c) {
    float r4[kBlock], r6[kBlock];
    for (int r = 0; r < kBlock; ++r) {
      r4[r] = AsFloat(err4[r * blocks + c]);
      r6[r] = AsFloat(err6[r * blocks + c]);
    }
    picks[c] = TileError(r4) < TileError(r6) ? 0xFFFFFFFFu : 0u;
  }
}

template <class T, class Sink, bool kRht, bool kSr>
uint32_t QuantizeRangeT(const QuantizeJob& job, int64_t begin, int64_t end, uint32_t* scratch) {
  using S = typename T::Storage;
  const S* x = static_cast<const S*>(job.x);
  const int64_t blocks = job.blocks();
  VI seen = SplatI(0);
  if (!job.block_2d) {
    // 1x16 blocks: rows [begin, end) are one flat run of blocks.
    const int64_t last = end * blocks;
    for (int64_t b = begin * blocks; b < last; b += kGroup) {
      const int n = last - b < kGroup ? static_cast<int>(last - b) : kGroup;
      seen = MaxI(seen,
                  QuantizeSome<T, kRht, kSr, Sink>(job, x + kBlock * b, b, n, nullptr, nullptr));
    }
    return HorizontalMax(seen);
  }
  // 16x16 tiles: a 16-row item is a flat run of 16 * blocks blocks, whole groups. First
  // the tile maxima (block column c's in scratch[c]), then the groups quantized with them.
  for (int64_t item = begin; item < end; ++item) {
    const int64_t first = item * kBlock * blocks, count = kBlock * blocks;
    for (int64_t c = 0; c < blocks; ++c) scratch[c] = 0;
    for (int64_t g = 0, c0 = 0; g < count; g += kGroup, c0 = (c0 + kGroup) % blocks) {
      const VI m = GroupAmaxBits<T, kRht>(x + kBlock * (first + g));
      if (blocks % kGroup == 0) {  // the group is 16 whole block columns
        StoreV(scratch + c0, MaxI(LoadV<VI>(scratch + c0), m));
        continue;
      }
      for (int k = 0, c = static_cast<int>(c0); k < kGroup; ++k, c = c + 1 == blocks ? 0 : c + 1) {
        const uint32_t bits = static_cast<uint32_t>(Lane(m, k));
        scratch[c] = bits > scratch[c] ? bits : scratch[c];
      }
    }
    uint32_t item_max = 0;
    for (int64_t c = 0; c < blocks; ++c) item_max = scratch[c] > item_max ? scratch[c] : item_max;
    seen = MaxI(seen, SplatI(static_cast<int32_t>(item_max)));
    // Four Over Six: the tiles' decisions (scratch after the maxima: both candidates'
    // errors of the item's blocks, then one pick per block column).
    const bool decide = job.four_over_six != kPlain;
    uint32_t* picks = scratch + blocks + 2 * count;
    if (decide) {
      TilePicks<T, kRht>(job, x + kBlock * first, blocks, scratch, scratch + blocks,
                         scratch + blocks + count, picks);
    }
    for (int64_t g = 0, c0 = 0; g < count; g += kGroup, c0 = (c0 + kGroup) % blocks) {
      const VI amax = ColumnVector(scratch, blocks, c0);
      const VI pick = decide ? ColumnVector(picks, blocks, c0) : SplatI(0);
      QuantizeSome<T, kRht, kSr, Sink>(job, x + kBlock * (first + g), first + g, kGroup, &amax,
                                       decide ? &pick : nullptr);
    }
  }
  return HorizontalMax(seen);
}

template <class T, class Sink>
uint32_t QuantizeRange(const QuantizeJob& job, int64_t begin, int64_t end, uint32_t* scratch) {
  if (job.rht) {
    return job.sr ? QuantizeRangeT<T, Sink, true, true>(job, begin, end, scratch)
                  : QuantizeRangeT<T, Sink, true, false>(job, begin, end, scratch);
  }
  return job.sr ? QuantizeRangeT<T, Sink, false, true>(job, begin, end, scratch)
                : QuantizeRangeT<T, Sink, false, false>(job, begin, end, scratch);
}

// ---------------------------------------------------------------------------
// Tensor amax.

// Max of the 16-bit |x| bits of n elements (n a multiple of 16): bf16 and f16 order their
// magnitudes like unsigned integers (NaN above inf), so the maximum needs no conversion.
uint32_t MaxAbsBits16(const uint16_t* p, int64_t n) {
  constexpr int kW = 2 * kLanes;  // u16 lanes per native vector
  const NW abs_mask = NW{} + uint16_t{0x7FFF};
  NW m0{}, m1{}, m2{}, m3{};
  int64_t i = 0;
  for (; i + 4 * kW <= n; i += 4 * kW) {
    const NW a0 = LoadV<NW>(p + i) & abs_mask, a1 = LoadV<NW>(p + i + kW) & abs_mask;
    const NW a2 = LoadV<NW>(p + i + 2 * kW) & abs_mask;
    const NW a3 = LoadV<NW>(p + i + 3 * kW) & abs_mask;
    m0 = a0 > m0 ? a0 : m0;
    m1 = a1 > m1 ? a1 : m1;
    m2 = a2 > m2 ? a2 : m2;
    m3 = a3 > m3 ? a3 : m3;
  }
  for (; i + kW <= n; i += kW) {
    const NW a = LoadV<NW>(p + i) & abs_mask;
    m0 = a > m0 ? a : m0;
  }
  m0 = m1 > m0 ? m1 : m0;
  m2 = m3 > m2 ? m3 : m2;
  m0 = m2 > m0 ? m2 : m0;
  uint32_t m = 0;
  for (int k = 0; k < kW; ++k) m = m0[k] > m ? m0[k] : m;
  for (; i < n; ++i) {
    const uint32_t a = p[i] & 0x7FFFu;
    m = a > m ? a : m;
  }
  return m;
}

template <class T, bool kRht>
uint32_t AmaxRangeT(const typename T::Storage* x, int64_t n) {
  if constexpr (!kRht && sizeof(typename T::Storage) == 2) {
    const uint32_t m = MaxAbsBits16(reinterpret_cast<const uint16_t*>(x), n);
    return AsBits(T::Load(static_cast<typename T::Storage>(m)));
  }
  VI m0 = SplatI(0), m1 = SplatI(0);
  int64_t i = 0;
  if constexpr (kRht && sizeof(typename T::Storage) == 2) {
    // The RHT's values before their rounding to T: rounding to nearest even is monotonic
    // and symmetric, so the max of the rounded |values| is the rounded max, rounded once
    // here (the same bits). A NaN's bits are the rounded NaN's: that range takes the
    // per-element path below.
    for (; i + 2 * kBlock <= n; i += 2 * kBlock) {
      VF e, o;
      PairIo<T>::Load(x + i, e, o);
      RhtPair(e, o, /*inverse=*/false);
      m0 = MaxI(m0, AsVI(e) & 0x7FFFFFFF);
      m1 = MaxI(m1, AsVI(o) & 0x7FFFFFFF);
    }
    if (i < n) m0 = MaxI(m0, AsVI(Rht16V(VecIo<T>::Load(x + i), /*inverse=*/false)) & 0x7FFFFFFF);
    const uint32_t m = HorizontalMax(MaxI(m0, m1));
    if (m <= 0x7F800000u) return AsBits(T::Load(T::Store(AsFloat(m))));
    m0 = SplatI(0), m1 = SplatI(0), i = 0;
  }
  for (; i + 2 * kBlock <= n; i += 2 * kBlock) {
    VF e, o;
    LoadPair<T, kRht>(x + i, e, o);
    m0 = MaxI(m0, AsVI(e) & 0x7FFFFFFF);
    m1 = MaxI(m1, AsVI(o) & 0x7FFFFFFF);
  }
  if (i < n) m0 = MaxI(m0, AsVI(LoadBlockV<T, kRht>(x + i)) & 0x7FFFFFFF);
  return HorizontalMax(MaxI(m0, m1));
}

template <class T>
uint32_t AmaxRange(const void* xv, int64_t cols, bool rht, int64_t begin, int64_t end) {
  const auto* x = static_cast<const typename T::Storage*>(xv) + begin * cols;
  const int64_t n = (end - begin) * cols;
  return rht ? AmaxRangeT<T, true>(x, n) : AmaxRangeT<T, false>(x, n);
}

// ---------------------------------------------------------------------------
// Dequantize: value(code) * (f32(s_b) * D), the inverse RHT when asked, cast to U.

// 16 blocks: codes (8 bytes each) and scales at `codes` and `scales`, values to out.
template <class U, bool kRht>
NVFP4_VINLINE void DequantizeGroup(const uint8_t* codes, const uint8_t* scales, float global,
                                   typename U::Storage* out) {
  const VF factor = E4m3ToF32V(WidenU8(scales)) * global;
  NVFP4_GROUP_UNROLL
  for (int p = 0; p < 8; ++p) {
    // Byte l of the pair's 16 code bytes: element 2l in its low nibble, 2l + 1 high.
    const VI b = WidenU8(codes + 16 * p);
    const VF f = PairBroadcast(factor, p);
    VF e = E2m1Value(b) * f, o = E2m1Value(Srl(b, 4)) * f;
    if (kRht) RhtPair(e, o, /*inverse=*/true);
    PairIo<U>::Store(out + 2 * kBlock * p, e, o);
  }
}

template <class U, bool kRht>
void DequantizeRangeT(const DequantizeJob& job, int64_t begin, int64_t end) {
  using S = typename U::Storage;
  S* out = static_cast<S*>(job.out);
  const int64_t last = end * job.cols / kBlock;
  int64_t b = begin * job.cols / kBlock;
  for (; b + kGroup <= last; b += kGroup) {
    DequantizeGroup<U, kRht>(job.codes + 8 * b, job.scales + b, job.global, out + kBlock * b);
  }
  if (b < last) {  // a partial group: through zero-padded copies
    const int n = static_cast<int>(last - b);
    uint8_t codes[8 * kGroup] = {}, scales[kGroup] = {};
    S values[kBlock * kGroup];
    __builtin_memcpy(codes, job.codes + 8 * b, 8 * n);
    __builtin_memcpy(scales, job.scales + b, n);
    DequantizeGroup<U, kRht>(codes, scales, job.global, values);
    __builtin_memcpy(out + kBlock * b, values, sizeof(S) * kBlock * n);
  }
}

template <class U>
void DequantizeRange(const DequantizeJob& job, int64_t begin, int64_t end) {
  if (job.rht) {
    DequantizeRangeT<U, true>(job, begin, end);
  } else {
    DequantizeRangeT<U, false>(job, begin, end);
  }
}

// ---------------------------------------------------------------------------
// The RHT op.

template <class T>
void RhtRange(const void* xv, void* outv, int64_t cols, bool inverse, int64_t begin, int64_t end) {
  const auto* x = static_cast<const typename T::Storage*>(xv);
  auto* out = static_cast<typename T::Storage*>(outv);
  for (int64_t i = begin * cols; i < end * cols; i += kBlock) {
    VecIo<T>::Store(out + i, Rht16V(VecIo<T>::Load(x + i), inverse));
  }
}

template <class T>
constexpr QuantizeRangeFn kFake[kNumFloatTypes] = {
    QuantizeRange<T, ValueSink<Bf16>>,
    QuantizeRange<T, ValueSink<F16>>,
    QuantizeRange<T, ValueSink<F32>>,
};

}  // namespace

const KernelTable& Table() {
  static constexpr KernelTable kTable = {
      NVFP4_ISA_NAME,
      {AmaxRange<Bf16>, AmaxRange<F16>, AmaxRange<F32>},
      {QuantizeRange<Bf16, CodeSink>, QuantizeRange<F16, CodeSink>, QuantizeRange<F32, CodeSink>},
      {{kFake<Bf16>[0], kFake<Bf16>[1], kFake<Bf16>[2]},
       {kFake<F16>[0], kFake<F16>[1], kFake<F16>[2]},
       {kFake<F32>[0], kFake<F32>[1], kFake<F32>[2]}},
      {DequantizeRange<Bf16>, DequantizeRange<F16>, DequantizeRange<F32>},
      {RhtRange<Bf16>, RhtRange<F16>, RhtRange<F32>},
      GemmPackA,
      GemmPackB,
      GemmTiles,
      ToLookupTable,
  };
  return kTable;
}

}  // namespace nvfp4::cpu::NVFP4_ISA
